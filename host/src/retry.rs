//! The retry policy: from an attempt's [`Outcome`] and the op's history to
//! what happens next (confirm, retry at a time, or dead-letter).
//!
//! Pure: the caller passes `now` and a jitter sample, so every decision is
//! reproducible in tests.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::outcome::Outcome;

/// A kind's retry settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts (claims) before a retryable failure is dead-lettered (seed 002: 12).
    pub max_attempts: u32,
    /// Attempts before a misbehaving executor's op is dead-lettered.
    pub max_fault_attempts: u32,
    /// Backoff for the first retry; doubles per attempt.
    pub backoff_base: Duration,
    /// Longest backoff.
    pub backoff_max: Duration,
    /// Longest wait a `Retry-After` may impose.
    pub retry_after_max: Duration,
    /// Fee bumps after which an op asking for another one is dead-lettered
    /// (seed 003's fee-bump cap); no cap when `None`.
    pub max_fee_bumps: Option<u32>,
    /// How a backoff is spread below its ceiling.
    pub jitter: Jitter,
}

/// How a backoff is drawn below its ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Jitter {
    /// Anywhere in `[0, ceiling]`: spreads a thundering herd best, but a
    /// schedule's total span has no floor.
    #[default]
    Full,
    /// In `[ceiling/2, ceiling]`: still spread, and a schedule of n retries
    /// waits at least half the sum of its ceilings (a retry horizon one can
    /// promise: the ActivityPub kind's "at least two days").
    Equal,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 12,
            max_fault_attempts: 3,
            backoff_base: Duration::from_secs(2),
            backoff_max: Duration::from_secs(120),
            retry_after_max: Duration::from_secs(3600),
            max_fee_bumps: None,
            jitter: Jitter::Full,
        }
    }
}

/// What to do with an op after an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Done.
    Confirm {
        /// Final receipt.
        receipt: Option<String>,
    },
    /// Back to pending until `at`.
    Retry {
        /// Earliest next attempt.
        at: DateTime<Utc>,
        /// Why.
        error: String,
        /// Pay a higher fee next time.
        fee_bump: bool,
    },
    /// Dead-letter.
    DeadLetter {
        /// Why, including the attempt count when the budget ran out.
        error: String,
    },
}

/// Exponential growth without jitter: `min(max, base * 2^(n-1))` for the
/// `n`th time in a row (1 for the first).
pub fn doubled(base: Duration, max: Duration, n: u32) -> Duration {
    let exp = n.saturating_sub(1).min(30);
    base.checked_mul(1u32 << exp).unwrap_or(max).min(max)
}

/// Jittered exponential backoff: a uniform sample (`jitter` in `[0, 1)`) of
/// `[0, ceiling]` (full jitter) or `[ceiling/2, ceiling]` (equal jitter),
/// where the ceiling is [`doubled`]`(base, max, attempt)`.
pub fn backoff(policy: &RetryPolicy, attempt: u32, jitter: f64) -> Duration {
    let ceiling = doubled(policy.backoff_base, policy.backoff_max, attempt);
    let sample = jitter.clamp(0.0, 1.0);
    match policy.jitter {
        Jitter::Full => ceiling.mul_f64(sample),
        Jitter::Equal => ceiling / 2 + (ceiling / 2).mul_f64(sample),
    }
}

/// Where an op stands when an attempt ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct History {
    /// Attempts in the current budget, this one included (1 after the first).
    pub attempts: u32,
    /// Fee bumps before this attempt.
    pub fee_bumps: u32,
    /// The attempt checkpointed a receipt: its side effect may have
    /// happened even though the attempt did not say so.
    pub checkpointed: bool,
}

/// Decides the next step after an attempt.
///
/// An attempt that checkpointed a receipt and then ended without a verdict
/// (a timeout, a crash, any retryable failure) is never dead-lettered for
/// its budget or its fee-bump cap: its side effect may have happened (a
/// fee-bump request may come from a transaction still valid and queued, not
/// yet included), so it goes back once more for its executor to reconcile
/// the receipt, and the dispatcher dead-letters it then only if the receipt
/// provably did not take effect. A payment that landed is never recorded as
/// failed.
pub fn decide(policy: &RetryPolicy, outcome: &Outcome, history: History, now: DateTime<Utc>, jitter: f64) -> Decision {
    let decision = decide_budget(policy, outcome, history, now, jitter);
    let in_doubt = match outcome {
        Outcome::Retryable { .. } | Outcome::Fault(_) => true,
        Outcome::Confirmed { .. } | Outcome::Permanent { .. } => false,
    };
    let past_cap = matches!(outcome, Outcome::Retryable { fee_bump: true, .. })
        && policy.max_fee_bumps.is_some_and(|cap| history.fee_bumps >= cap);
    match decision {
        Decision::DeadLetter { error } if history.checkpointed && in_doubt => Decision::Retry {
            at: now + chrono::Duration::from_std(backoff(policy, history.attempts, jitter)).unwrap_or_default(),
            error: format!("{error}; a receipt was checkpointed, so it is reconciled before giving up"),
            // A bump asked for past the cap is counted (fee_bumps = cap + 1)
            // though no bump is granted: the dispatcher then only
            // reconciles, and gives the op up if its receipt provably did
            // not land (`dispatch::drain::execute`).
            fee_bump: past_cap,
        },
        other => other,
    }
}

fn decide_budget(
    policy: &RetryPolicy,
    outcome: &Outcome,
    history: History,
    now: DateTime<Utc>,
    jitter: f64,
) -> Decision {
    let History {
        attempts, fee_bumps, ..
    } = history;
    match outcome {
        Outcome::Confirmed { receipt, .. } => Decision::Confirm {
            receipt: receipt.clone(),
        },
        Outcome::Permanent { reason, .. } => Decision::DeadLetter { error: reason.clone() },
        Outcome::Retryable {
            reason,
            retry_after,
            fee_bump,
            ..
        } => {
            if attempts >= policy.max_attempts {
                return Decision::DeadLetter {
                    error: format!("gave up after {attempts} attempts: {reason}"),
                };
            }
            if let Some(cap) = policy.max_fee_bumps.filter(|cap| *fee_bump && fee_bumps >= *cap) {
                return Decision::DeadLetter {
                    error: format!("fee-bump cap reached after {cap} bumps: {reason}"),
                };
            }
            // Retry-After is honoured (never retry sooner than asked) but
            // clamped, so a hostile or broken destination cannot park an op
            // for a year.
            let wait =
                backoff(policy, attempts, jitter).max(retry_after.unwrap_or_default().min(policy.retry_after_max));
            Decision::Retry {
                at: now + crate::clock::chrono_duration(wait),
                error: reason.clone(),
                fee_bump: *fee_bump,
            }
        }
        // A denial does not go away by retrying: the grant must change.
        Outcome::Fault(fault @ crate::outcome::Fault::Denied(_)) => Decision::DeadLetter {
            error: fault.to_string(),
        },
        Outcome::Fault(fault) => {
            if attempts >= policy.max_fault_attempts.min(policy.max_attempts) {
                return Decision::DeadLetter {
                    error: format!("gave up after {attempts} attempts: {fault}"),
                };
            }
            let wait = backoff(policy, attempts, jitter);
            Decision::Retry {
                at: now + crate::clock::chrono_duration(wait),
                error: fault.to_string(),
                fee_bump: false,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::Fault;
    use chrono::TimeZone;
    use proptest::prelude::*;

    fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0)
            .single()
            .unwrap_or_default()
    }

    fn h(attempts: u32) -> History {
        History {
            attempts,
            fee_bumps: 0,
            checkpointed: false,
        }
    }

    #[test]
    fn an_attempt_in_doubt_after_a_checkpoint_is_reconciled_not_dead_lettered() {
        let p = RetryPolicy::default();
        let spent = History {
            attempts: 12,
            fee_bumps: 0,
            checkpointed: true,
        };
        for outcome in [
            Outcome::retry("rpc unavailable"),
            Outcome::Fault(Fault::Timeout),
            Outcome::Fault(Fault::Crashed("trap".into())),
        ] {
            assert!(
                matches!(
                    decide(&p, &outcome, spent, now(), 0.5),
                    Decision::Retry { fee_bump: false, .. }
                ),
                "{outcome:?}"
            );
            // Without a checkpoint the budget rules as before.
            assert!(matches!(
                decide(
                    &p,
                    &outcome,
                    History {
                        checkpointed: false,
                        ..spent
                    },
                    now(),
                    0.5
                ),
                Decision::DeadLetter { .. }
            ));
        }
        // A verdict is a verdict: a permanent failure still dead-letters.
        assert!(matches!(
            decide(&p, &Outcome::permanent("tx_bad_auth"), spent, now(), 0.5),
            Decision::DeadLetter { .. }
        ));
        // A fee-bump request is no verdict: it may come from a transaction
        // still valid and queued. Past the cap it is reconciled first (and
        // counted past the cap, so the dispatcher knows to give up if the
        // receipt provably did not land).
        let capped = RetryPolicy {
            max_fee_bumps: Some(1),
            ..p
        };
        let bump = Outcome::Retryable {
            reason: "expired".into(),
            retry_after: None,
            detail: None,
            fee_bump: true,
        };
        assert!(matches!(
            decide(
                &capped,
                &bump,
                History {
                    attempts: 2,
                    fee_bumps: 1,
                    checkpointed: true
                },
                now(),
                0.5
            ),
            Decision::Retry { fee_bump: true, .. }
        ));
    }

    #[test]
    fn the_fee_bump_cap_dead_letters_an_op_asking_for_one_more_bump() {
        let p = RetryPolicy {
            max_fee_bumps: Some(3),
            ..RetryPolicy::default()
        };
        let bump = Outcome::Retryable {
            reason: "transaction expired unconfirmed".into(),
            retry_after: None,
            detail: None,
            fee_bump: true,
        };
        let at = |fee_bumps| History {
            attempts: 2,
            fee_bumps,
            checkpointed: false,
        };
        assert!(matches!(
            decide(&p, &bump, at(2), now(), 0.5),
            Decision::Retry { fee_bump: true, .. }
        ));
        assert_eq!(
            decide(&p, &bump, at(3), now(), 0.5),
            Decision::DeadLetter {
                error: "fee-bump cap reached after 3 bumps: transaction expired unconfirmed".into()
            }
        );
        // A receipt checkpointed by the attempt may still land (a fee bump
        // is asked for a transaction that is valid but not yet included):
        // it is reconciled, at the same bid, before the op is given up.
        let checkpointed = History {
            checkpointed: true,
            ..at(3)
        };
        match decide(&p, &bump, checkpointed, now(), 0.5) {
            Decision::Retry {
                fee_bump: true, error, ..
            } => assert!(
                error.starts_with("fee-bump cap reached after 3 bumps") && error.contains("reconciled"),
                "{error}"
            ),
            other => panic!("{other:?}"),
        }
        // Without a bump request the cap does not apply, and without a cap bumps are unbounded.
        assert!(matches!(
            decide(&p, &Outcome::retry("503"), at(9), now(), 0.5),
            Decision::Retry { .. }
        ));
        assert!(matches!(
            decide(&RetryPolicy::default(), &bump, at(9), now(), 0.5),
            Decision::Retry { .. }
        ));
    }

    #[test]
    fn backoff_doubles_up_to_the_max_and_jitter_scales_it() {
        let p = RetryPolicy::default();
        assert_eq!(backoff(&p, 1, 1.0), Duration::from_secs(2));
        assert_eq!(backoff(&p, 2, 1.0), Duration::from_secs(4));
        assert_eq!(backoff(&p, 6, 1.0), Duration::from_secs(64));
        assert_eq!(backoff(&p, 7, 1.0), Duration::from_secs(120));
        assert_eq!(backoff(&p, 500, 1.0), Duration::from_secs(120));
        assert_eq!(backoff(&p, 3, 0.5), Duration::from_secs(4));
        assert_eq!(backoff(&p, 3, 0.0), Duration::ZERO);
    }

    #[test]
    fn retryable_failures_retry_until_the_budget_then_dead_letter() {
        let p = RetryPolicy::default();
        let out = Outcome::retry("HTTP 503");
        match decide(&p, &out, h(11), now(), 1.0) {
            Decision::Retry { at, error, .. } => {
                assert_eq!(at, now() + chrono::Duration::seconds(120));
                assert_eq!(error, "HTTP 503");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            decide(&p, &out, h(12), now(), 1.0),
            Decision::DeadLetter {
                error: "gave up after 12 attempts: HTTP 503".into()
            }
        );
    }

    #[test]
    fn equal_jitter_keeps_the_upper_half_of_each_backoff() {
        let p = RetryPolicy {
            jitter: Jitter::Equal,
            ..RetryPolicy::default()
        };
        assert_eq!(backoff(&p, 1, 0.0), Duration::from_secs(1));
        assert_eq!(backoff(&p, 1, 1.0), Duration::from_secs(2));
        assert_eq!(backoff(&p, 500, 0.0), Duration::from_secs(60));
    }

    #[test]
    fn the_shipped_activitypub_schedule_retries_for_at_least_two_days() {
        let config = crate::config::from_toml_str("").unwrap_or_else(|e| panic!("{e}"));
        let p = config.kinds["activitypub"].retry_policy();
        let span = |jitter: f64| -> Duration { (1..p.max_attempts).map(|n| backoff(&p, n, jitter)).sum() };
        let two_days = Duration::from_secs(2 * 86_400);
        assert!(span(0.0) >= two_days, "shortest: {:?}", span(0.0));
        assert!(span(1.0) <= Duration::from_secs(7 * 86_400), "longest: {:?}", span(1.0));
        // An inbox down for 30 minutes is far inside the budget: after the
        // attempts that fit in 30 minutes, most of the budget is left.
        let mut waited = Duration::ZERO;
        let mut used = 1;
        while waited < Duration::from_secs(1800) {
            waited += backoff(&p, used, 1.0);
            used += 1;
        }
        assert!(
            used < p.max_attempts / 2,
            "{used} of {} attempts used in 30 minutes",
            p.max_attempts
        );
    }

    #[test]
    fn retry_after_is_honoured_but_clamped() {
        let p = RetryPolicy {
            retry_after_max: Duration::from_secs(60),
            ..RetryPolicy::default()
        };
        let asked = |secs| Outcome::Retryable {
            reason: "429".into(),
            retry_after: Some(Duration::from_secs(secs)),
            detail: Some("429".into()),
            fee_bump: false,
        };
        assert!(
            matches!(decide(&p, &asked(30), h(1), now(), 0.0), Decision::Retry { at, .. } if at == now() + chrono::Duration::seconds(30))
        );
        assert!(
            matches!(decide(&p, &asked(86_400), h(1), now(), 0.0), Decision::Retry { at, .. } if at == now() + chrono::Duration::seconds(60))
        );
    }

    #[test]
    fn permanent_dead_letters_at_once_and_faults_get_fewer_tries() {
        let p = RetryPolicy::default();
        assert_eq!(
            decide(&p, &Outcome::permanent("HTTP 410"), h(1), now(), 0.5),
            Decision::DeadLetter {
                error: "HTTP 410".into()
            }
        );
        let fault = Outcome::Fault(Fault::Crashed("unreachable".into()));
        assert!(matches!(decide(&p, &fault, h(2), now(), 0.5), Decision::Retry { .. }));
        assert!(matches!(
            decide(&p, &fault, h(3), now(), 0.5),
            Decision::DeadLetter { .. }
        ));
        assert!(matches!(
            decide(&p, &Outcome::confirmed(), h(12), now(), 0.5),
            Decision::Confirm { .. }
        ));
    }

    proptest! {
        #[test]
        fn retries_never_exceed_the_budget_nor_wait_beyond_the_caps(attempts in 1u32..40, jitter in 0.0f64..1.0, after in proptest::option::of(0u64..100_000)) {
            let p = RetryPolicy::default();
            let out = Outcome::Retryable { reason: "x".into(), retry_after: after.map(Duration::from_secs), detail: None, fee_bump: false };
            match decide(&p, &out, h(attempts), now(), jitter) {
                Decision::Retry { at, .. } => {
                    prop_assert!(attempts < p.max_attempts);
                    let wait = (at - now()).to_std().unwrap_or_default();
                    prop_assert!(wait <= p.backoff_max.max(p.retry_after_max));
                    if let Some(secs) = after {
                        prop_assert!(wait >= Duration::from_secs(secs).min(p.retry_after_max));
                    }
                }
                Decision::DeadLetter { .. } => prop_assert!(attempts >= p.max_attempts),
                Decision::Confirm { .. } => prop_assert!(false, "a failure confirmed"),
            }
        }
    }
}
