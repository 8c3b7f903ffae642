//! What the queue stores for operators beside the ops: API keys (as hashes),
//! the audit log of every operator write, and pauses of kinds, outboxes and
//! destinations; and the counts `/metrics` and `/stats` read. Types only;
//! each backend stores and counts them.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// An API key as stored: never the secret, only its SHA-256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApiKey {
    /// The public part of the key (`lw_<id>_…`), how a request finds it.
    pub id: String,
    /// The operator's name for it, unique.
    pub name: String,
    /// What it may do (`ops:write`, `outbox:read`, …).
    pub scopes: Vec<String>,
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// When it was revoked; a revoked key authenticates nothing.
    pub revoked_at: Option<DateTime<Utc>>,
}

/// A key to store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewApiKey {
    /// See [`ApiKey::id`].
    pub id: String,
    /// See [`ApiKey::name`].
    pub name: String,
    /// SHA-256 of the secret part.
    pub secret_hash: Vec<u8>,
    /// See [`ApiKey::scopes`].
    pub scopes: Vec<String>,
}

/// One operator write, to record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewAuditEntry {
    /// Who: an API key's name (`key:NAME`) or `cli:$USER`.
    pub actor: String,
    /// What, e.g. `op.retry`, `pause`, `api_key.revoke`.
    pub action: String,
    /// On what, e.g. `op:42`, `kind:deposit`.
    pub target: String,
    /// The state before (JSON), when there was one.
    pub before: Option<serde_json::Value>,
    /// The state after (JSON), when there is one.
    pub after: Option<serde_json::Value>,
}

/// One recorded operator write.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditEntry {
    /// Position in the log (ascending with time).
    pub id: i64,
    /// When.
    pub at: DateTime<Utc>,
    /// See [`NewAuditEntry::actor`].
    pub actor: String,
    /// See [`NewAuditEntry::action`].
    pub action: String,
    /// See [`NewAuditEntry::target`].
    pub target: String,
    /// See [`NewAuditEntry::before`].
    pub before: Option<serde_json::Value>,
    /// See [`NewAuditEntry::after`].
    pub after: Option<serde_json::Value>,
}

/// What a pause stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PauseScope {
    /// Every op of a kind.
    Kind,
    /// Every op of an outbox.
    Outbox,
    /// Every op whose destination (the host of its first lane that is a URL)
    /// is this host.
    Destination,
}

impl PauseScope {
    /// The stored name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Kind => "kind",
            Self::Outbox => "outbox",
            Self::Destination => "destination",
        }
    }

    /// Parses a stored or typed name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "kind" => Some(Self::Kind),
            "outbox" => Some(Self::Outbox),
            "destination" => Some(Self::Destination),
            _ => None,
        }
    }
}

/// A paused target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Pause {
    /// What kind of target.
    pub scope: PauseScope,
    /// The kind, outbox or destination host.
    pub target: String,
    /// Why, if the operator said.
    pub reason: Option<String>,
    /// Who paused it.
    pub actor: String,
    /// Since when.
    pub paused_at: DateTime<Utc>,
}

/// What `/metrics` and `/stats` count at read time, each by one aggregate
/// query (never by listing rows).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct QueueGauges {
    /// Submitted ops whose lease has expired unsettled.
    pub stuck_submitted: i64,
    /// Strict lanes held by a dead letter.
    pub lanes_held: i64,
    /// Halted subjects.
    pub subjects_halted: i64,
    /// Per kind and outbox, the due time of the oldest pending op that is
    /// due now (paused or breaker-held ops included: they are late too).
    pub oldest_due: Vec<OldestDue>,
}

/// The oldest due pending op of one kind in one outbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OldestDue {
    /// The kind.
    pub kind: String,
    /// The outbox.
    pub outbox: String,
    /// When it became due.
    pub due_at: DateTime<Utc>,
}

/// How long one recently confirmed op took, creation to confirmation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Latency {
    /// Its kind.
    pub kind: String,
    /// Its tier.
    pub priority: crate::op::Priority,
    /// Seconds.
    pub seconds: f64,
}

impl OutcomeEntry {
    /// What a producer learns of it: the transition and the op's identity,
    /// receipt and last error (the payload stays out: the producer has it).
    pub fn summary(&self) -> serde_json::Value {
        let op = &self.op;
        serde_json::json!({
            "cursor": self.cursor,
            "status": self.status,
            "at": self.at,
            "op": {
                "id": op.id, "kind": op.kind, "outbox": op.outbox, "lanes": op.lanes,
                "priority": op.priority, "idempotency_key": op.idempotency_key,
                "correlation_id": op.correlation_id, "subject": op.subject,
                "status": op.status, "attempts": op.attempts, "receipt": op.receipt,
                "last_error": op.last_error, "finished_at": op.finished_at,
            },
        })
    }
}

/// One terminal transition from the outcome feed, with its op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutcomeEntry {
    /// Where the next page starts (opaque: pass it back as `after`).
    pub cursor: String,
    /// The status the op reached.
    pub status: crate::op::Status,
    /// When.
    pub at: DateTime<Utc>,
    /// The op as it is now (a retried op may have moved on since).
    pub op: crate::op::Op,
}

/// Which of the feed's transitions a reader asked for: the outcome route's
/// and the CLI's filters, the one reading of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FeedFilter {
    /// Only this outbox's ops.
    pub outbox: Option<String>,
    /// Only ops of this kind.
    pub kind: Option<String>,
    /// Only transitions to this status.
    pub status: Option<crate::op::Status>,
    /// Also laneway's own ops (outcome webhooks, inbound activities).
    pub internal: bool,
}

impl FeedFilter {
    /// Whether `entry` passes; `is_internal` says whether a kind is
    /// laneway's own (the config knows).
    pub fn wants(&self, entry: &OutcomeEntry, is_internal: impl Fn(&str) -> bool) -> bool {
        (self.internal || !is_internal(&entry.op.kind))
            && self.outbox.as_ref().is_none_or(|o| *o == entry.op.outbox)
            && self.kind.as_ref().is_none_or(|k| *k == entry.op.kind)
            && self.status.is_none_or(|s| s == entry.status)
    }
}

/// What an idempotency key remembers of its pruned op.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Tombstone {
    /// The op's outbox.
    pub outbox: String,
    /// Its idempotency key.
    pub idempotency_key: String,
    /// The pruned op's id (what a repeat of the key answers).
    pub op_id: crate::op::OpId,
    /// Its kind.
    pub kind: String,
    /// The terminal status it reached.
    pub status: crate::op::Status,
    /// Its receipt (e.g. the Stellar transaction hash).
    pub receipt: Option<String>,
    /// When it finished.
    pub finished_at: DateTime<Utc>,
    /// When the tombstone goes (`None`: never).
    pub expires_at: Option<DateTime<Utc>>,
}

/// Which terminal ops one pruning pass may delete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PruneQuery {
    /// Only this kind, or (`None`) every kind not in `except_kinds`.
    pub kind: Option<String>,
    /// With `kind: None`: the kinds that have their own policy.
    pub except_kinds: Vec<String>,
    /// Only ops in this terminal status.
    pub status: crate::op::Status,
    /// Only ops that finished before this.
    pub finished_before: DateTime<Utc>,
    /// At most this many (oldest first).
    pub limit: u32,
    /// For kinds whose outcomes a relay still has to send: keep every op
    /// with an outcome past this feed cursor (`Some(None)`: past the start,
    /// so all of them, until the relay has run).
    pub unrelayed_after: Option<Option<String>>,
}
