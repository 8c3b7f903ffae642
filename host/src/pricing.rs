//! Prices attempts of kinds that name a fee oracle: reads the oracle's
//! shared snapshot from the database and asks the oracle's fee policy for a
//! decision. The dispatcher prices an op before claiming it, so a deferred
//! op stays pending and never uses an attempt.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::config::Config;
use crate::fees::{FeeDecision, FeeSnapshot, QuoteInput};
use crate::op::{OpId, Priority};
use crate::queue::{BookRow, Queue, QueueError};

/// Why an op could not be priced. The op is not attempted then: sending a
/// money movement at a made-up fee is worse than waiting for the policy.
#[derive(Debug, thiserror::Error)]
pub enum PricingError {
    /// The kind names an oracle the config does not have.
    #[error("kind {kind} names fee oracle {oracle:?}, which is not configured")]
    UnknownOracle {
        /// The kind.
        kind: String,
        /// The oracle it names.
        oracle: String,
    },
    /// The oracle's policy plugin is not loaded.
    #[error("fee policy {0:?} is not loaded")]
    PolicyNotLoaded(String),
    /// The policy failed or refused.
    #[error("fee policy {policy:?}: {reason}")]
    Policy {
        /// The policy.
        policy: String,
        /// What went wrong.
        reason: String,
    },
    /// The stored snapshot does not parse.
    /// The oracle has not sampled the network yet: the op waits for its
    /// first snapshot (up to the oracle's `first_sample_wait_ms`) rather
    /// than go out at a made-up default fee.
    #[error("fee oracle {0:?} has no sample yet; waiting for its first one")]
    NoSampleYet(String),
    #[error("stored fee snapshot of oracle {oracle:?} does not parse: {reason}")]
    BadSnapshot {
        /// The oracle.
        oracle: String,
        /// The parse error.
        reason: String,
    },
    /// The database failed.
    #[error(transparent)]
    Queue(#[from] QueueError),
}

/// The loaded fee policies, by plugin name (the plugin host implements it).
#[async_trait]
pub trait FeePolicies: Send + Sync {
    /// Quotes with the policy named `policy`.
    ///
    /// # Errors
    ///
    /// [`PricingError::PolicyNotLoaded`] or [`PricingError::Policy`].
    async fn quote(&self, policy: &str, input: QuoteInput<'_>) -> Result<FeeDecision, PricingError>;
}

/// An oracle's stored snapshot, if it has one.
///
/// # Errors
///
/// [`PricingError::Queue`], or [`PricingError::BadSnapshot`] when the stored
/// JSON does not parse.
pub async fn stored_snapshot(queue: &dyn Queue, oracle: &str) -> Result<Option<FeeSnapshot>, PricingError> {
    match queue.fee_snapshot(oracle).await? {
        None => Ok(None),
        Some((json, _)) => serde_json::from_str(&json)
            .map(Some)
            .map_err(|e| PricingError::BadSnapshot {
                oracle: oracle.to_owned(),
                reason: e.to_string(),
            }),
    }
}

/// What each oracle contributes to a quote (its snapshot and its policy's
/// settings), read once and reused for every op priced in one go: a drain
/// pass prices many ops against the same view.
#[derive(Debug, Default)]
pub struct OracleViews {
    views: HashMap<String, (Option<FeeSnapshot>, String)>,
}

/// What a new op is expected to cost (seed 003: `estFee`,
/// `estConfirmationSeconds`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct FeeEstimate {
    /// Inclusion fee per operation it would bid now (stroops); 0 when deferred.
    pub base_fee: u64,
    /// Expected seconds to confirmation at that bid; 0 when deferred.
    pub est_confirmation_seconds: u32,
    /// How long the policy would defer it first (LOW under congestion).
    pub deferred_ms: u64,
}

impl From<FeeDecision> for FeeEstimate {
    fn from(decision: FeeDecision) -> Self {
        match decision {
            FeeDecision::Submit {
                bid,
                est_confirmation_seconds,
            } => FeeEstimate {
                base_fee: bid.base_fee,
                est_confirmation_seconds,
                deferred_ms: 0,
            },
            FeeDecision::Defer(wait) => FeeEstimate {
                base_fee: 0,
                est_confirmation_seconds: 0,
                deferred_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            },
        }
    }
}

/// The op (or would-be op) a quote is for.
struct Priced<'a> {
    kind: &'a str,
    priority: Priority,
    /// Attempts in the budget, counting the one being priced.
    attempts: u32,
    fee_bumps: u32,
    enqueued_at: DateTime<Utc>,
    /// A real attempt (not an estimate): it waits for the first sample.
    attempt: bool,
}

/// The longest an op waits between two attempts to price it while its
/// policy keeps failing.
pub const FAILED_PRICING_WAIT_CAP: Duration = Duration::from_secs(300);

/// How long an op whose pricing failed `failures` times in a row waits
/// before it is priced again: its kind's longest backoff, doubled at each
/// failure after the first, up to [`FAILED_PRICING_WAIT_CAP`] (or the
/// backoff, if that is longer). A policy that fails for every op (its fuel
/// spent, a crash) would otherwise be run for every pending op once per
/// backoff: a payout burst of thousands of ops behind a broken policy made
/// a host-wide loop of failing calls.
pub fn failed_pricing_wait(backoff_max: Duration, failures: u32) -> Duration {
    crate::retry::doubled(backoff_max, FAILED_PRICING_WAIT_CAP.max(backoff_max), failures)
}

/// Ops whose pricing failed, and how many times in a row (in memory: a
/// restart or a new config starts them at one again, which costs a call
/// each, no more).
#[derive(Debug, Default)]
struct Failures {
    by_op: std::sync::Mutex<HashMap<OpId, u32>>,
}

/// Ops followed at most; past it the counts start again.
const FAILURES_TRACKED: usize = 100_000;

impl Failures {
    fn failed(&self, op: OpId) -> u32 {
        let mut by_op = self.by_op.lock().unwrap_or_else(PoisonError::into_inner);
        if by_op.len() >= FAILURES_TRACKED && !by_op.contains_key(&op) {
            by_op.clear();
        }
        let n = by_op.entry(op).or_insert(0);
        *n = n.saturating_add(1);
        *n
    }

    fn priced(&self, op: OpId) {
        let mut by_op = self.by_op.lock().unwrap_or_else(PoisonError::into_inner);
        if !by_op.is_empty() {
            by_op.remove(&op);
        }
    }
}

/// Prices ops against the config of the moment.
#[derive(Clone)]
pub struct Pricer {
    policies: Arc<dyn FeePolicies>,
    queue: Arc<dyn Queue>,
    /// When this pricer first priced anything: the wait for an oracle's
    /// first sample is measured from here, so a backlog found at start
    /// waits as long as a fresh op.
    first_priced: Arc<std::sync::OnceLock<DateTime<Utc>>>,
    failures: Arc<Failures>,
}

impl std::fmt::Debug for Pricer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pricer").finish_non_exhaustive()
    }
}

impl Pricer {
    /// Prices with `policies`, reading snapshots from `queue`.
    pub fn new(policies: Arc<dyn FeePolicies>, queue: Arc<dyn Queue>) -> Self {
        Self {
            policies,
            queue,
            first_priced: Arc::new(std::sync::OnceLock::new()),
            failures: Arc::default(),
        }
    }

    /// `op` could not be priced: how long it waits before the next try
    /// (see [`failed_pricing_wait`]).
    pub fn failed(&self, op: OpId, backoff_max: Duration) -> Duration {
        failed_pricing_wait(backoff_max, self.failures.failed(op))
    }

    /// The decision for `op`'s next attempt, or `None` when its kind is not
    /// priced (no `fee_oracle`).
    ///
    /// # Errors
    ///
    /// [`PricingError`]; the op should wait.
    pub async fn price(
        &self,
        config: &Config,
        views: &mut OracleViews,
        op: &BookRow,
        now: DateTime<Utc>,
    ) -> Result<Option<FeeDecision>, PricingError> {
        let attempts = u32::try_from(op.budget_attempts).unwrap_or(0).saturating_add(1);
        let fee_bumps = u32::try_from(op.fee_bumps).unwrap_or(0);
        let priced = Priced {
            kind: &op.kind,
            priority: op.priority,
            attempts,
            fee_bumps,
            enqueued_at: op.created_at,
            attempt: true,
        };
        let decision = self.quote(config, views, priced, now).await;
        if decision.is_ok() {
            self.failures.priced(op.id);
        }
        decision
    }

    /// What a new op of `kind` at `priority` would bid now, for the estimate
    /// returned at enqueue; `None` when the kind is not priced.
    ///
    /// # Errors
    ///
    /// [`PricingError`].
    pub async fn estimate(
        &self,
        config: &Config,
        kind: &str,
        priority: Priority,
        now: DateTime<Utc>,
    ) -> Result<Option<FeeDecision>, PricingError> {
        let priced = Priced {
            kind,
            priority,
            attempts: 1,
            fee_bumps: 0,
            enqueued_at: now,
            attempt: false,
        };
        self.quote(config, &mut OracleViews::default(), priced, now).await
    }

    async fn quote(
        &self,
        config: &Config,
        views: &mut OracleViews,
        priced: Priced<'_>,
        now: DateTime<Utc>,
    ) -> Result<Option<FeeDecision>, PricingError> {
        let kind_name = priced.kind;
        let Some(oracle_name) = config.kinds.get(kind_name).and_then(|k| k.fee_oracle.as_ref()) else {
            return Ok(None);
        };
        let oracle = config
            .oracles
            .get(oracle_name)
            .ok_or_else(|| PricingError::UnknownOracle {
                kind: kind_name.to_owned(),
                oracle: oracle_name.clone(),
            })?;
        let (snapshot, config_json) = match views.views.entry(oracle_name.clone()) {
            Entry::Occupied(seen) => seen.into_mut(),
            Entry::Vacant(first) => first.insert((
                stored_snapshot(self.queue.as_ref(), oracle_name).await?,
                oracle.config_json(),
            )),
        };
        if snapshot.is_none() && priced.attempt {
            let since = *self.first_priced.get_or_init(|| now);
            let wait = chrono::Duration::milliseconds(i64::try_from(oracle.first_sample_wait_ms).unwrap_or(i64::MAX));
            if now - since < wait {
                return Err(PricingError::NoSampleYet(oracle_name.clone()));
            }
        }
        let input = QuoteInput {
            priority: priced.priority,
            attempts: priced.attempts,
            fee_bumps: priced.fee_bumps,
            enqueued_at_ms: priced.enqueued_at.timestamp_millis(),
            now_ms: now.timestamp_millis(),
            snapshot: snapshot.as_ref(),
            config: config_json,
        };
        self.policies.quote(&oracle.policy, input).await.map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_policy_is_tried_ever_more_rarely_up_to_the_cap() {
        let base = Duration::from_millis(500);
        let waits: Vec<u64> = (1..=12)
            .map(|n| u64::try_from(failed_pricing_wait(base, n).as_millis()).unwrap_or(u64::MAX))
            .collect();
        assert_eq!(
            waits,
            [500, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000, 256000, 300_000, 300_000]
        );
        assert_eq!(failed_pricing_wait(base, u32::MAX), FAILED_PRICING_WAIT_CAP);
        // A kind whose backoff is longer than the cap keeps its backoff.
        let long = Duration::from_secs(600);
        assert_eq!(failed_pricing_wait(long, 1), long);
        assert_eq!(failed_pricing_wait(long, 9), long);
    }

    #[test]
    fn failures_count_per_op_and_a_success_forgets_them() {
        let failures = Failures::default();
        assert_eq!((failures.failed(1), failures.failed(1), failures.failed(2)), (1, 2, 1));
        failures.priced(1);
        assert_eq!((failures.failed(1), failures.failed(2)), (1, 2));
    }
}
