//! A loaded fee-policy plugin in laneway's types: converts samples and
//! snapshots to and from the WIT ones.

use std::sync::Arc;

use super::bindings::fee_policy::exports::laneway::plugin::fee_policy as wit;
use super::bindings::fee_policy::laneway::plugin::types as wit_types;
use super::failure::PluginFailure;
use super::plugin::Plugin;
use crate::fees::{Congestion, FeeBid, FeeDecision, FeeSample, FeeSnapshot, QuoteInput};
use crate::op::Priority;

/// A fee policy plugin.
#[derive(Debug, Clone)]
pub struct FeePolicy {
    plugin: Arc<Plugin>,
}

/// Why a policy call produced no snapshot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The plugin failed.
    #[error(transparent)]
    Plugin(#[from] PluginFailure),
    /// The policy refused the input.
    #[error("the fee policy refused: {0}")]
    Refused(String),
}

fn to_wit(c: Congestion) -> wit::Congestion {
    match c {
        Congestion::Low => wit::Congestion::Low,
        Congestion::Elevated => wit::Congestion::Elevated,
        Congestion::High => wit::Congestion::High,
        Congestion::Severe => wit::Congestion::Severe,
    }
}

fn from_wit(c: wit::Congestion) -> Congestion {
    match c {
        wit::Congestion::Low => Congestion::Low,
        wit::Congestion::Elevated => Congestion::Elevated,
        wit::Congestion::High => Congestion::High,
        wit::Congestion::Severe => Congestion::Severe,
    }
}

fn snapshot_to_wit(s: &FeeSnapshot) -> wit::Snapshot {
    wit::Snapshot {
        recommended_base_fee: s.recommended_base_fee,
        aggressive_base_fee: s.aggressive_base_fee,
        congestion: to_wit(s.congestion),
        ledger_capacity_usage: s.ledger_capacity_usage,
        sampled_at_ms: s.sampled_at_ms,
        congestion_since_ms: s.congestion_since_ms,
        clamped: s.clamped.clone(),
    }
}

impl FeePolicy {
    /// Wraps a loaded plugin of the fee-policy world.
    pub fn new(plugin: Arc<Plugin>) -> Self {
        Self { plugin }
    }

    /// Folds a sample into the previous snapshot.
    ///
    /// # Errors
    ///
    /// [`PolicyError`] when the plugin fails or refuses.
    pub async fn observe(
        &self,
        previous: Option<&FeeSnapshot>,
        sample: FeeSample,
        now_ms: i64,
        config: &str,
    ) -> Result<FeeSnapshot, PolicyError> {
        let sample = wit::FeeSample {
            min: sample.min,
            mode: sample.mode,
            p50: sample.p50,
            p70: sample.p70,
            p90: sample.p90,
            p95: sample.p95,
            p99: sample.p99,
            max: sample.max,
            transaction_count: sample.transaction_count,
            ledger_count: sample.ledger_count,
            latest_ledger: sample.latest_ledger,
        };
        let s = self
            .plugin
            .observe(previous.map(snapshot_to_wit), sample, now_ms, config.to_owned())
            .await?
            .map_err(PolicyError::Refused)?;
        Ok(FeeSnapshot {
            recommended_base_fee: s.recommended_base_fee,
            aggressive_base_fee: s.aggressive_base_fee,
            congestion: from_wit(s.congestion),
            ledger_capacity_usage: s.ledger_capacity_usage,
            sampled_at_ms: s.sampled_at_ms,
            congestion_since_ms: s.congestion_since_ms,
            clamped: s.clamped,
        })
    }

    /// Prices one attempt, or defers it.
    ///
    /// # Errors
    ///
    /// [`PolicyError`] when the plugin fails or refuses.
    pub async fn quote(&self, input: QuoteInput<'_>) -> Result<FeeDecision, PolicyError> {
        let priority = match input.priority {
            Priority::Critical => wit_types::Priority::Critical,
            Priority::Normal => wit_types::Priority::Normal,
            Priority::Low => wit_types::Priority::Low,
        };
        let request = wit::QuoteRequest {
            priority,
            attempts: input.attempts,
            fee_bumps: input.fee_bumps,
            enqueued_at_ms: input.enqueued_at_ms,
            now_ms: input.now_ms,
            snapshot: input.snapshot.map(snapshot_to_wit),
            config: input.config.to_owned(),
        };
        match self.plugin.quote(request).await?.map_err(PolicyError::Refused)? {
            wit::Decision::Submit(q) => Ok(FeeDecision::Submit {
                bid: FeeBid {
                    base_fee: q.fee,
                    aggressive: q.aggressive,
                    capped: q.capped,
                },
                est_confirmation_seconds: q.est_confirmation_seconds,
            }),
            wit::Decision::Defer(ms) => Ok(FeeDecision::Defer(std::time::Duration::from_millis(ms))),
        }
    }
}
