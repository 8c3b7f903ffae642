//! The op: laneway's unit of durable intent, and the vocabulary every layer
//! shares about it (priority, status, leases, attempt records).
//!
//! Nothing here does I/O. The queue stores these types; the dispatcher and the
//! CLI read them.

pub mod state;

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

pub use state::{IllegalTransition, Status, Transition};

/// An op's id. It is also the global enqueue sequence: ids are handed out in
/// increasing order, so `ORDER BY priority, id` is dispatch order.
pub type OpId = i64;

/// Priority tier. Within a tier, ops go in enqueue order (FIFO).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Capital leaving the platform, or anything that must never wait.
    Critical,
    /// The default tier.
    Normal,
    /// Background work that yields to everything else.
    Low,
}

impl Priority {
    /// All tiers in dispatch order.
    pub const ALL: [Priority; 3] = [Priority::Critical, Priority::Normal, Priority::Low];

    /// The value stored in the `priority` column; lower goes first.
    pub const fn rank(self) -> i16 {
        match self {
            Priority::Critical => 0,
            Priority::Normal => 1,
            Priority::Low => 2,
        }
    }

    /// The inverse of [`Priority::rank`]; `None` for a value no laneway wrote.
    pub const fn from_rank(rank: i64) -> Option<Self> {
        match rank {
            0 => Some(Priority::Critical),
            1 => Some(Priority::Normal),
            2 => Some(Priority::Low),
            _ => None,
        }
    }

    /// The lowercase name used in config, the CLI and JSON.
    pub const fn as_str(self) -> &'static str {
        match self {
            Priority::Critical => "critical",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that names no priority tier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown priority {0:?} (expected critical, normal or low)")]
pub struct UnknownPriority(pub String);

impl FromStr for Priority {
    type Err = UnknownPriority;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "critical" => Ok(Priority::Critical),
            "normal" => Ok(Priority::Normal),
            "low" => Ok(Priority::Low),
            other => Err(UnknownPriority(other.to_owned())),
        }
    }
}

/// A claim on a submitted op. Every state change made on behalf of a
/// dispatcher names the lease it holds; a change whose lease is no longer
/// current (the op was reclaimed, retried or finished meanwhile) is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Lease {
    /// The claimed op.
    pub op_id: OpId,
    /// The attempt number the claim started (1 for the first delivery).
    pub attempt: i32,
    /// A token unique to this claim.
    pub token: Uuid,
}

/// How one delivery attempt ended, as recorded in the attempt history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptClass {
    /// The side effect happened.
    Confirmed,
    /// It did not happen this time and may be tried again.
    Retryable,
    /// It will never happen with this payload.
    Permanent,
    /// The executor itself misbehaved (trap, timeout, resource limit).
    PluginFault,
    /// The dispatcher holding the lease vanished before reporting.
    LeaseExpired,
    /// Never tried: laneway could not read the op as written (set aside by
    /// a migration, `last_error` saying which value).
    Invalid,
}

impl AttemptClass {
    /// The value stored in the `attempts.outcome` column.
    pub const fn as_str(self) -> &'static str {
        match self {
            AttemptClass::Confirmed => "confirmed",
            AttemptClass::Retryable => "retryable",
            AttemptClass::Permanent => "permanent",
            AttemptClass::PluginFault => "plugin_fault",
            AttemptClass::LeaseExpired => "lease_expired",
            AttemptClass::Invalid => "invalid",
        }
    }

    /// Parses a stored `attempts.outcome` value.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "confirmed" => AttemptClass::Confirmed,
            "retryable" => AttemptClass::Retryable,
            "permanent" => AttemptClass::Permanent,
            "plugin_fault" => AttemptClass::PluginFault,
            "lease_expired" => AttemptClass::LeaseExpired,
            "invalid" => AttemptClass::Invalid,
            _ => return None,
        })
    }
}

impl fmt::Display for AttemptClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Longest error text kept in an attempt row or in `ops.last_error`; longer
/// text is cut so one chatty receiver cannot bloat the database.
pub const MAX_ERROR_TEXT: usize = 2048;

/// Cuts `text` to at most [`MAX_ERROR_TEXT`] bytes on a character boundary.
pub fn truncate_error(text: &str) -> String {
    if text.len() <= MAX_ERROR_TEXT {
        return text.to_owned();
    }
    let mut end = MAX_ERROR_TEXT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// What a dispatcher reports about one attempt, stored as one `attempts` row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptRecord {
    /// When the executor was called.
    pub started_at: DateTime<Utc>,
    /// When the outcome was known.
    pub finished_at: DateTime<Utc>,
    /// The outcome class.
    pub class: AttemptClass,
    /// A short machine-readable detail: an HTTP status, a chain result code.
    pub detail: Option<String>,
    /// The fee paid or offered, for chain executors (stroops).
    pub fee: Option<i64>,
    /// Human-readable error text (truncated when stored).
    pub error: Option<String>,
}

/// One stored attempt, as read back for operators.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Attempt {
    /// The op this attempt belongs to.
    pub op_id: OpId,
    /// The attempt number (1-based, never reused).
    pub attempt: i32,
    /// What happened.
    #[serde(flatten)]
    pub record: AttemptRecord,
}

/// A stored op, as read back by the dispatcher, the CLI and the API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Op {
    /// Id and global enqueue sequence.
    pub id: OpId,
    /// The queue the op belongs to (an actor, a platform account).
    pub outbox: String,
    /// Which executor kind delivers it.
    pub kind: String,
    /// Priority tier.
    pub priority: Priority,
    /// The lanes (recipients, signer accounts) the op is ordered in.
    pub lanes: Vec<String>,
    /// The payload, exactly as the producer gave it (JSON text).
    pub payload: String,
    /// Where the payload is stored when it is shared (`payloads.hash`);
    /// the queue has already read it into `payload`.
    #[serde(skip)]
    pub payload_ref: Option<String>,
    /// Unique per outbox, forever.
    pub idempotency_key: Option<String>,
    /// Unique among the outbox's non-terminal ops.
    pub coalesce_key: Option<String>,
    /// The user or actor the op acts for (halt guard).
    pub subject: Option<String>,
    /// What a dead letter relates to, e.g. a ledger entry id.
    pub correlation_id: Option<String>,
    /// Where the op is in its lifecycle.
    pub status: Status,
    /// Delivery attempts started so far (claims), across all passes and restarts.
    pub attempts: i32,
    /// Attempts that count against the retry budget start after this many;
    /// an operator's force-retry moves it up to grant a fresh budget.
    pub attempt_floor: i32,
    /// Fee bumps asked for so far (chain executors). One past the kind's
    /// `max_fee_bumps` means the last was refused at the cap and the op's
    /// receipt is being reconciled before it is given up.
    pub fee_bumps: i32,
    /// Not to be claimed before this time.
    pub next_attempt_at: DateTime<Utc>,
    /// Who holds the lease, while submitted.
    pub lease_owner: Option<String>,
    /// The lease token, while submitted.
    pub lease_token: Option<Uuid>,
    /// When the lease runs out, while submitted.
    pub lease_until: Option<DateTime<Utc>>,
    /// What the executor checkpointed before its side effect (e.g. a tx hash).
    pub receipt: Option<String>,
    /// The latest error text.
    pub last_error: Option<String>,
    /// Enqueue time.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// When the op reached a terminal state.
    pub finished_at: Option<DateTime<Utc>>,
}

impl Op {
    /// The lease this op is held under, if it is submitted.
    pub fn lease(&self) -> Option<Lease> {
        match (self.status, self.lease_token) {
            (Status::Submitted, Some(token)) => Some(Lease {
                op_id: self.id,
                attempt: self.attempts,
                token,
            }),
            _ => None,
        }
    }

    /// Attempts that count against the retry budget.
    pub fn budget_attempts(&self) -> i32 {
        self.attempts - self.attempt_floor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priority_ranks_round_trip_and_order_critical_first() {
        for p in Priority::ALL {
            assert_eq!(Priority::from_rank(i64::from(p.rank())), Some(p));
            assert_eq!(p.as_str().parse::<Priority>(), Ok(p));
        }
        assert!(Priority::Critical.rank() < Priority::Normal.rank());
        assert!(Priority::Normal.rank() < Priority::Low.rank());
        assert_eq!(Priority::from_rank(7), None);
        assert!("urgent".parse::<Priority>().is_err());
    }

    #[test]
    fn attempt_classes_round_trip() {
        for c in [
            AttemptClass::Confirmed,
            AttemptClass::Retryable,
            AttemptClass::Permanent,
            AttemptClass::PluginFault,
            AttemptClass::LeaseExpired,
        ] {
            assert_eq!(AttemptClass::parse(c.as_str()), Some(c));
        }
        assert_eq!(AttemptClass::parse("maybe"), None);
    }

    #[test]
    fn error_text_is_truncated_on_a_char_boundary() {
        let short = "boom";
        assert_eq!(truncate_error(short), short);
        let long = "é".repeat(MAX_ERROR_TEXT);
        let cut = truncate_error(&long);
        assert!(cut.len() <= MAX_ERROR_TEXT + '…'.len_utf8());
        assert!(cut.ends_with('…'));
    }
}
