//! What becomes of a finished attempt: the retry policy's decision, turned
//! into a retry when the failure is its destination's (a probe that found it
//! still down, or a host its health record holds), and whether the op
//! stalls for the rest of the pass.
//!
//! Pure: no clock, no random numbers, no queue, no runtime (a tidy test
//! holds it to that). The pass passes `now`, the jitter sample and its own
//! marks, and applies the verdict (the breaker, the metrics, the settle).

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::clock::chrono_duration;
use crate::outcome::Outcome;
use crate::retry::{self, Decision, History, RetryPolicy};

/// The kind's rules a verdict reads.
#[derive(Debug, Clone, Copy)]
pub(super) struct Rules {
    /// The kind's retry policy.
    pub(super) policy: RetryPolicy,
    /// How long a held destination waits for its next probe.
    pub(super) probe_every: Duration,
    /// The pass's cap of attempts per op before the op stalls.
    pub(super) in_pass_cap: u32,
}

/// What the pass knows of the op beyond its attempt.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Marks {
    /// The attempt was its destination's health probe.
    pub(super) probing: bool,
    /// The destination's health record holds it (unavailable, suspended),
    /// as written before deciding.
    pub(super) held: bool,
    /// Attempts of the op in this pass, this one included.
    pub(super) tries: u32,
}

/// A finished attempt's fate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Verdict {
    /// Confirm, retry at a time, or dead-letter.
    pub(super) decision: Decision,
    /// The op waits for a later pass (it was retried `in_pass_cap` times in
    /// this one).
    pub(super) stall: bool,
}

/// Decides what becomes of an attempt that ended with `outcome`, after
/// `history`.
pub(super) fn verdict(
    outcome: &Outcome,
    history: History,
    rules: &Rules,
    marks: Marks,
    now: DateTime<Utc>,
    jitter: f64,
) -> Verdict {
    let decision = match retry::decide(&rules.policy, outcome, history, now, jitter) {
        // A probe that finds its destination still down is not a dead
        // letter: its destination is held, and so is it, until the next
        // probe. Nor is an attempt that failed against a host its record
        // now holds (this failure may be what made it unavailable).
        Decision::DeadLetter { error }
            if (marks.probing || marks.held) && outcome.destination_failed() == Some(true) =>
        {
            Decision::Retry {
                at: now + chrono_duration(rules.probe_every),
                error,
                fee_bump: false,
            }
        }
        other => other,
    };
    let stall = matches!(decision, Decision::Retry { .. }) && marks.tries >= rules.in_pass_cap;
    Verdict { decision, stall }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::Fault;

    fn at(ms: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_800_000_000_000 + ms).unwrap_or_default()
    }

    fn rules() -> Rules {
        Rules {
            policy: RetryPolicy {
                max_attempts: 3,
                max_fault_attempts: 2,
                backoff_base: Duration::from_secs(2),
                backoff_max: Duration::from_secs(60),
                max_fee_bumps: Some(1),
                ..RetryPolicy::default()
            },
            probe_every: Duration::from_secs(30),
            in_pass_cap: 2,
        }
    }

    fn history(attempts: u32) -> History {
        History {
            attempts,
            fee_bumps: 0,
            checkpointed: false,
        }
    }

    /// The decision's shape: "confirm", "retry@<ms after now>" or "dead".
    fn shape(v: &Verdict) -> String {
        match &v.decision {
            Decision::Confirm { .. } => "confirm".to_owned(),
            Decision::Retry { at: when, fee_bump, .. } => {
                format!(
                    "retry@{}{}",
                    (*when - at(0)).num_milliseconds(),
                    if *fee_bump { "+bump" } else { "" }
                )
            }
            Decision::DeadLetter { .. } => "dead".to_owned(),
        }
    }

    #[test]
    fn verdicts_follow_the_policy_the_destination_and_the_pass() {
        let down = || Outcome::retry("connection refused");
        let gone = || Outcome::permanent("410 Gone");
        let hung = || Outcome::Fault(Fault::Timeout);
        let crashed = || Outcome::Fault(Fault::Crashed("panic".to_owned()));
        let none = Marks::default();
        let probing = Marks {
            probing: true,
            ..Marks::default()
        };
        let held = Marks {
            held: true,
            ..Marks::default()
        };
        let twice = Marks {
            tries: 2,
            ..Marks::default()
        };
        // (case, outcome, attempts, marks, expected shape, stalls)
        let cases: Vec<(&str, Outcome, u32, Marks, &str, bool)> = vec![
            ("confirmed", Outcome::confirmed(), 1, none, "confirm", false),
            (
                "first failure backs off 2 s (jitter 1)",
                down(),
                1,
                none,
                "retry@2000",
                false,
            ),
            ("second failure backs off 4 s", down(), 2, none, "retry@4000", false),
            ("budget spent", down(), 3, none, "dead", false),
            ("permanent at once", gone(), 1, none, "dead", false),
            ("a fault retries", hung(), 1, none, "retry@2000", false),
            ("faults have their own budget", hung(), 2, none, "dead", false),
            (
                "a probe that finds its host down waits for the next probe",
                down(),
                3,
                probing,
                "retry@30000",
                false,
            ),
            (
                "a held host's failure is not a dead letter",
                down(),
                3,
                held,
                "retry@30000",
                false,
            ),
            (
                "a permanent answer is one, probe or not",
                gone(),
                1,
                probing,
                "dead",
                false,
            ),
            (
                "a timeout is the destination's too",
                hung(),
                2,
                held,
                "retry@30000",
                false,
            ),
            (
                "a crash is the plugin's, not the destination's",
                crashed(),
                2,
                held,
                "dead",
                false,
            ),
            ("the pass cap stalls a retry", down(), 1, twice, "retry@2000", true),
            (
                "a confirm never stalls",
                Outcome::confirmed(),
                1,
                twice,
                "confirm",
                false,
            ),
            ("a dead letter never stalls", gone(), 1, twice, "dead", false),
        ];
        for (case, outcome, attempts, marks, want, stalls) in cases {
            let v = verdict(&outcome, history(attempts), &rules(), marks, at(0), 1.0);
            assert_eq!(shape(&v), want, "{case}");
            assert_eq!(v.stall, stalls, "{case}: stall");
        }
    }

    #[test]
    fn a_checkpointed_attempt_in_doubt_is_reconciled_before_it_is_given_up() {
        let spent = History {
            attempts: 3,
            fee_bumps: 0,
            checkpointed: true,
        };
        let v = verdict(
            &Outcome::retry("timeout"),
            spent,
            &rules(),
            Marks::default(),
            at(0),
            1.0,
        );
        assert!(matches!(v.decision, Decision::Retry { .. }), "{v:?}");
    }

    #[test]
    fn the_jitter_is_the_callers() {
        let early = verdict(&Outcome::retry("x"), history(2), &rules(), Marks::default(), at(0), 0.0);
        let late = verdict(&Outcome::retry("x"), history(2), &rules(), Marks::default(), at(0), 1.0);
        assert_eq!(shape(&early), "retry@0");
        assert_eq!(shape(&late), "retry@4000");
    }
}
