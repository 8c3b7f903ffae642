//! The op state machine: which status changes are legal, and nothing else.
//!
//! ```text
//!  enqueue ─► pending ──claim──► submitted ──confirm──► confirmed
//!              │  ▲                 │  │
//!              │  └─retry/expire/───┘  └──fail──► failed ──force-retry──► pending
//!              │     release
//!              └──cancel──► cancelled
//! ```
//!
//! The queue backends derive every compare-and-set from [`Transition::from`]
//! and [`Transition::to`], so the SQL cannot drift from this table.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Where an op is in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Durable intent; waiting to be claimed (possibly in backoff).
    Pending,
    /// Claimed under a lease and being delivered.
    Submitted,
    /// Delivered (terminal).
    Confirmed,
    /// Dead-lettered: exhausted, permanently rejected or poisoned (terminal
    /// unless an operator forces a retry).
    Failed,
    /// Cancelled by an operator before it was sent (terminal).
    Cancelled,
}

impl Status {
    /// Every status, for exhaustive tests and filters.
    pub const ALL: [Status; 5] = [
        Status::Pending,
        Status::Submitted,
        Status::Confirmed,
        Status::Failed,
        Status::Cancelled,
    ];

    /// The value stored in the `status` column.
    pub const fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Submitted => "submitted",
            Status::Confirmed => "confirmed",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
        }
    }

    /// Whether the op has left the queue for good (barring a force-retry).
    pub const fn is_terminal(self) -> bool {
        matches!(self, Status::Confirmed | Status::Failed | Status::Cancelled)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that names no status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown status {0:?} (expected pending, submitted, confirmed, failed or cancelled)")]
pub struct UnknownStatus(pub String);

impl FromStr for Status {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Status::ALL
            .into_iter()
            .find(|status| status.as_str() == s)
            .ok_or_else(|| UnknownStatus(s.to_owned()))
    }
}

/// A named change of status. Each has exactly one legal source and target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transition {
    /// A dispatcher takes the op under a lease; the attempt counter goes up.
    Claim,
    /// The executor reported the side effect done.
    Confirm,
    /// A retryable failure: back to pending with a backoff.
    Retry,
    /// A permanent failure, or the retry budget is spent: dead-letter.
    Fail,
    /// The lease ran out (the dispatcher crashed or stalled): back to pending.
    Expire,
    /// The dispatcher gives back a claim it never started (shutdown).
    Release,
    /// An operator cancels an op that was never sent.
    Cancel,
    /// An operator sends a dead letter back to the queue.
    ForceRetry,
}

impl Transition {
    /// Every transition, for exhaustive tests.
    pub const ALL: [Transition; 8] = [
        Transition::Claim,
        Transition::Confirm,
        Transition::Retry,
        Transition::Fail,
        Transition::Expire,
        Transition::Release,
        Transition::Cancel,
        Transition::ForceRetry,
    ];

    /// The only status this transition may start from.
    pub const fn from(self) -> Status {
        match self {
            Transition::Claim | Transition::Cancel => Status::Pending,
            Transition::Confirm | Transition::Retry | Transition::Fail | Transition::Expire | Transition::Release => {
                Status::Submitted
            }
            Transition::ForceRetry => Status::Failed,
        }
    }

    /// The status this transition leads to.
    pub const fn to(self) -> Status {
        match self {
            Transition::Claim => Status::Submitted,
            Transition::Confirm => Status::Confirmed,
            Transition::Fail => Status::Failed,
            Transition::Cancel => Status::Cancelled,
            Transition::Retry | Transition::Expire | Transition::Release | Transition::ForceRetry => Status::Pending,
        }
    }

    /// A short name for messages.
    pub const fn name(self) -> &'static str {
        match self {
            Transition::Claim => "claim",
            Transition::Confirm => "confirm",
            Transition::Retry => "retry",
            Transition::Fail => "fail",
            Transition::Expire => "expire",
            Transition::Release => "release",
            Transition::Cancel => "cancel",
            Transition::ForceRetry => "force-retry",
        }
    }
}

/// A status change the state machine does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cannot {} an op that is {from}: {} needs a {} op", .transition.name(), .transition.name(), .transition.from())]
pub struct IllegalTransition {
    /// The status the op was in.
    pub from: Status,
    /// What was attempted.
    pub transition: Transition,
}

/// Applies `transition` to an op in status `from`.
///
/// # Errors
///
/// [`IllegalTransition`] when `from` is not the transition's source status.
pub fn apply(from: Status, transition: Transition) -> Result<Status, IllegalTransition> {
    if from == transition.from() {
        Ok(transition.to())
    } else {
        Err(IllegalTransition { from, transition })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The legal moves, written out independently of `from`/`to` so the test
    /// can catch a mistake in either.
    const LEGAL: [(Status, Transition, Status); 8] = [
        (Status::Pending, Transition::Claim, Status::Submitted),
        (Status::Pending, Transition::Cancel, Status::Cancelled),
        (Status::Submitted, Transition::Confirm, Status::Confirmed),
        (Status::Submitted, Transition::Retry, Status::Pending),
        (Status::Submitted, Transition::Fail, Status::Failed),
        (Status::Submitted, Transition::Expire, Status::Pending),
        (Status::Submitted, Transition::Release, Status::Pending),
        (Status::Failed, Transition::ForceRetry, Status::Pending),
    ];

    #[test]
    fn every_status_transition_pair_is_legal_exactly_when_listed() {
        for from in Status::ALL {
            for t in Transition::ALL {
                let expected = LEGAL
                    .iter()
                    .find(|(f, tr, _)| *f == from && *tr == t)
                    .map(|(_, _, to)| *to);
                match (apply(from, t), expected) {
                    (Ok(to), Some(want)) => assert_eq!(to, want, "{from} --{}-->", t.name()),
                    (Err(e), None) => {
                        assert_eq!(e.from, from);
                        assert_eq!(e.transition, t);
                    }
                    (got, want) => panic!("{from} --{}--> gave {got:?}, expected {want:?}", t.name()),
                }
            }
        }
    }

    #[test]
    fn terminal_states_only_leave_by_force_retry_from_failed() {
        for from in Status::ALL.into_iter().filter(|s| s.is_terminal()) {
            let exits: Vec<_> = Transition::ALL
                .into_iter()
                .filter(|t| apply(from, *t).is_ok())
                .collect();
            if from == Status::Failed {
                assert_eq!(exits, vec![Transition::ForceRetry]);
            } else {
                assert!(exits.is_empty(), "{from} has exits {exits:?}");
            }
        }
    }

    #[test]
    fn cancel_is_refused_once_submitted() {
        let err = apply(Status::Submitted, Transition::Cancel).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot cancel an op that is submitted: cancel needs a pending op"
        );
    }

    #[test]
    fn status_names_round_trip() {
        for s in Status::ALL {
            assert_eq!(s.as_str().parse::<Status>(), Ok(s));
        }
        assert!("done".parse::<Status>().is_err());
    }
}
