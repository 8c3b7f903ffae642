//! The queue's vocabulary: what callers hand the store and what it hands
//! back. Plain data; the store writes and reads it, `policy` decides with it.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::QueueError;
use crate::lanes::LaneRules;
use crate::op::{AttemptRecord, Lease, Op, OpId, Priority, Status};

/// An op to enqueue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NewOp {
    /// The queue the op belongs to.
    pub outbox: String,
    /// The executor kind.
    pub kind: String,
    /// Priority tier.
    pub priority: Priority,
    /// Lanes (recipients, signer accounts); duplicates are dropped.
    pub lanes: Vec<String>,
    /// JSON text, stored exactly as given. Shared, not copied, by the ops
    /// of one fan-out: a 1 MB activity to 3,000 inboxes was 3,000 copies
    /// of it (6.6 GB resident, 27 s) before it was checked once and stored
    /// once.
    pub payload: Arc<str>,
    /// Unique per outbox forever; a repeat returns the existing op.
    pub idempotency_key: Option<String>,
    /// Unique among the outbox's non-terminal ops; a repeat is declined.
    pub coalesce_key: Option<String>,
    /// The user or actor the op acts for.
    pub subject: Option<String>,
    /// What a dead letter relates to.
    pub correlation_id: Option<String>,
    /// Not before this time (default: now).
    pub not_before: Option<DateTime<Utc>>,
}

impl NewOp {
    /// An op with the given identity and payload and every option unset.
    pub fn new(outbox: impl Into<String>, kind: impl Into<String>, payload: impl Into<Arc<str>>) -> Self {
        Self {
            outbox: outbox.into(),
            kind: kind.into(),
            priority: Priority::Normal,
            lanes: Vec::new(),
            payload: payload.into(),
            idempotency_key: None,
            coalesce_key: None,
            subject: None,
            correlation_id: None,
            not_before: None,
        }
    }
}

/// What an enqueue did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "result", content = "id", rename_all = "snake_case")]
pub enum Enqueued {
    /// A new op was written.
    Created(OpId),
    /// The idempotency key matched this existing op; nothing was written.
    Existing(OpId),
    /// Declined: an op with the same coalesce key is already pending or
    /// submitted in this outbox (this one).
    AlreadyPending(OpId),
}

impl Enqueued {
    /// The op the caller should track.
    pub fn id(self) -> OpId {
        match self {
            Enqueued::Created(id) | Enqueued::Existing(id) | Enqueued::AlreadyPending(id) => id,
        }
    }
}

/// Who takes a lease and for how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseSpec {
    /// The claiming host or dispatcher (for operators; the token is the fence).
    pub owner: String,
    /// How long the claim lasts without an extension.
    pub duration: Duration,
}

/// A claimed op and the lease to report back with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimed {
    /// The op as it stands after the claim.
    pub op: Op,
    /// The lease every follow-up change must name.
    pub lease: Lease,
}

/// How a dispatcher finishes a claimed attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// Delivered: the op is confirmed.
    Confirm {
        /// Final receipt (replaces any checkpointed one when `Some`).
        receipt: Option<String>,
    },
    /// Not delivered this time: back to pending until `next_attempt_at`.
    Retry {
        /// Earliest next claim.
        next_attempt_at: DateTime<Utc>,
        /// Why.
        error: String,
        /// Whether the next attempt uses a bumped fee.
        fee_bump: bool,
        /// No receipt is in doubt any more: the attempt checkpointed nothing
        /// and any earlier receipt was proven dead, so the stored one is
        /// cleared and the op stops holding its lanes. Otherwise the receipt
        /// stays and the op holds its lanes until it is reconciled.
        receipt_settled: bool,
    },
    /// Dead-letter: permanent failure or the budget is spent.
    Fail {
        /// Why.
        error: String,
        /// Hold the op's lanes until an operator skips or retries it (the
        /// `halt` poison policy); written in the same transaction.
        halt_lanes: bool,
    },
}

/// Where an op whose lease expired goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpireTo {
    /// Back to pending, due at this time.
    Retry(DateTime<Utc>),
    /// Dead-letter (the budget is spent), optionally holding its lanes.
    DeadLetter {
        /// As in [`Finish::Fail`].
        halt_lanes: bool,
    },
}

/// A non-terminal op as the scheduler needs it, without its payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BookRow {
    /// The op.
    pub id: OpId,
    /// Its kind.
    pub kind: String,
    /// Its tier.
    pub priority: Priority,
    /// Its lanes.
    pub lanes: Vec<String>,
    /// Claimed and executing (otherwise pending).
    pub in_flight: bool,
    /// It carries a receipt whose fate is unknown.
    pub in_doubt: bool,
    /// Earliest next claim.
    pub next_attempt_at: DateTime<Utc>,
    /// Attempts counted against its budget (see [`Op::budget_attempts`]).
    pub budget_attempts: i32,
    /// Fee bumps so far.
    pub fee_bumps: i32,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// Its subject is halted: it must not be attempted.
    pub subject_halted: bool,
}

/// A pool op's channel re-dealt: the op moves from lane `from` to lane `to`
/// while it waits with no receipt (nothing of it can be on chain).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redeal {
    /// The op.
    pub op: OpId,
    /// Its one lane now (a channel account).
    pub from: String,
    /// Its one lane after (another channel account of the pool).
    pub to: String,
}

/// An op that occupies its lanes, in any outbox: in flight, or holding a
/// receipt in doubt (the receipt rule of [`crate::lanes`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Occupant {
    /// The op.
    pub id: OpId,
    /// Its outbox.
    pub outbox: String,
    /// Its kind (for its lanes' mode).
    pub kind: String,
    /// Its tier (holders go in dispatch order).
    pub priority: Priority,
    /// Its lanes.
    pub lanes: Vec<String>,
    /// Claimed and executing (otherwise pending with a receipt in doubt).
    pub in_flight: bool,
    /// It carries a receipt whose fate is unknown.
    pub in_doubt: bool,
}

impl Occupant {
    /// Pending with a receipt whose fate is unknown: it holds its lanes
    /// until it is reconciled (up to a Stellar transaction's ledger bound).
    /// An op in flight that has checkpointed a receipt is not this: its
    /// attempt is still running and settles in the usual time.
    pub fn waits_in_doubt(&self) -> bool {
        self.in_doubt && !self.in_flight
    }

    /// The op as the lane scheduler sees it: in flight, or waiting while it
    /// holds its lanes; its lanes take its kind's mode, and serial caps are
    /// recorded in `caps`.
    pub fn candidate(&self, rules: &LaneRules, caps: &mut crate::lanes::Caps) -> crate::lanes::Candidate {
        crate::lanes::Candidate {
            id: self.id,
            priority: self.priority,
            seq: self.id,
            kind: self.kind.clone(),
            lanes: rules.lanes(&self.kind, &self.lanes, caps),
            state: if self.in_flight {
                crate::lanes::OpState::InFlight
            } else {
                crate::lanes::OpState::Waiting
            },
            in_doubt: self.in_doubt,
        }
    }
}

/// A held drain slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotLease {
    /// The outbox.
    pub outbox: String,
    /// Fences renewals and the release.
    pub token: Uuid,
}

/// How the live drain slots are shared among the hosts, as one host sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HostShare {
    /// Hosts that announced themselves recently, this one included.
    pub hosts: usize,
    /// Drain slots held now, by any host.
    pub slots: usize,
    /// Drain slots this host holds.
    pub mine: usize,
}

impl HostShare {
    /// How many slots this host should hand back: what it holds beyond an
    /// even share of the held slots, rounded up, so that N hosts on busy
    /// outboxes all work instead of one holding every slot.
    pub fn excess(&self) -> usize {
        if self.hosts <= 1 {
            return 0;
        }
        self.mine.saturating_sub(self.slots.div_ceil(self.hosts))
    }
}

/// A strict lane held by a dead letter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LaneHalt {
    /// The outbox.
    pub outbox: String,
    /// The lane.
    pub lane: String,
    /// The dead letter holding it.
    pub op_id: OpId,
    /// Since when.
    pub halted_at: DateTime<Utc>,
}

/// A halted subject.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HaltedSubject {
    /// The subject.
    pub subject: String,
    /// Why, if the operator said.
    pub reason: Option<String>,
    /// Since when.
    pub halted_at: DateTime<Utc>,
}

/// A stream of outbox names to wake, from producers anywhere.
#[async_trait]
pub trait Subscription: Send {
    /// The next outbox with new ops.
    async fn next(&mut self) -> Result<String, QueueError>;
}

/// One finished attempt, applied under its lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The lease the attempt ran under.
    pub lease: Lease,
    /// What happens to the op.
    pub finish: Finish,
    /// The attempt row to record.
    pub attempt: AttemptRecord,
}

/// Whether a compare-and-set took effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Cas {
    /// The row was in the expected state and changed.
    Applied,
    /// The row had moved on (lease taken over, finished, cancelled): nothing changed.
    Stale,
}

impl Cas {
    /// `true` when applied.
    pub fn applied(self) -> bool {
        self == Cas::Applied
    }
}

/// Filters for operator listings. Unset fields match everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpFilter {
    /// Only this status.
    pub status: Option<Status>,
    /// Only this kind.
    pub kind: Option<String>,
    /// Only this tier.
    pub priority: Option<Priority>,
    /// Only ops for this subject.
    pub subject: Option<String>,
    /// Only this outbox.
    pub outbox: Option<String>,
    /// Only ops in this lane.
    pub lane: Option<String>,
    /// Only ops with this correlation id.
    pub correlation_id: Option<String>,
    /// Only ops enqueued at or after this time.
    pub created_after: Option<DateTime<Utc>>,
    /// Only ops enqueued before this time.
    pub created_before: Option<DateTime<Utc>>,
    /// Only ops with an id greater than this (paging).
    pub after_id: Option<OpId>,
    /// At most this many (newest first when `newest_first`).
    pub limit: u32,
    /// Order by id descending instead of ascending.
    pub newest_first: bool,
}

/// Queue depth for one (status, priority, kind).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Depth {
    /// Status.
    pub status: Status,
    /// Tier.
    pub priority: Priority,
    /// Kind.
    pub kind: String,
    /// How many ops.
    pub count: i64,
}

/// Dead letters of one kind whose last attempt had one class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLetterGroup {
    /// Their kind.
    pub kind: String,
    /// Their last attempt's class (`None`: dead-lettered without one).
    pub class: Option<crate::op::AttemptClass>,
    /// Their outcome is unknown: a receipt was never proven landed or dead.
    pub unknown: bool,
    /// How many.
    pub count: i64,
    /// The newest of them.
    pub newest: OpId,
}

/// How many ops reached one terminal status since a time (the newest
/// outcomes only, up to a bound).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OutcomeCount {
    /// The terminal status.
    pub status: Status,
    /// How many transitions into it.
    pub count: i64,
    /// The oldest of them.
    pub since: DateTime<Utc>,
}

/// [`MinuteCount::what`] of attempts that failed short of a confirmation.
pub const RETRIED: &str = "retried";

/// What happened in one minute, for the console's last hour.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MinuteCount {
    /// The minute's start.
    pub minute: DateTime<Utc>,
    /// A terminal status (`confirmed`, `failed`: dead-lettered,
    /// `cancelled`), or [`RETRIED`].
    pub what: String,
    /// How many.
    pub count: i64,
    /// The earliest of them.
    pub since: DateTime<Utc>,
}

/// A shared record: a JSON value under (namespace, key) with a version
/// every write bumps, so hosts update it by compare-and-set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The key within its namespace.
    pub key: String,
    /// JSON text.
    pub value: String,
    /// Bumped by every write, from 1.
    pub version: i64,
    /// When it was last written.
    pub updated_at: DateTime<Utc>,
}

/// What a record write expects to find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// No record under the key (an insert).
    Absent,
    /// The record at this version.
    Version(i64),
    /// Whatever is there, if anything (a blind write).
    Any,
}

/// Limits the queue enforces on every enqueue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest payload accepted, in bytes.
    pub max_payload_bytes: usize,
    /// Payloads at least this long are stored once (`payloads`), however
    /// many ops carry them; 0 never.
    pub shared_payload_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_payload_bytes: 1024 * 1024,
            shared_payload_bytes: 1024,
        }
    }
}

/// How a registered kind's ops name lanes, as plain-SQL inserts are checked
/// against it (`kind_defaults.lanes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KindLanes {
    /// At least one lane.
    Required,
    /// Zero lanes allowed.
    Optional,
    /// The kind's plugin names them; SQL cannot ask it, so an insert must
    /// name them.
    Plugin,
}

impl KindLanes {
    /// The value stored in `kind_defaults.lanes`.
    pub const fn as_str(self) -> &'static str {
        match self {
            KindLanes::Required => "required",
            KindLanes::Optional => "optional",
            KindLanes::Plugin => "plugin",
        }
    }
}

/// One kind as the hosts register it for plain-SQL producers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredKind {
    /// The kind.
    pub kind: String,
    /// The priority an insert that leaves it out gets.
    pub priority: Priority,
    /// How its ops name lanes.
    pub lanes: KindLanes,
}

/// What the hosts tell every insert into the database (the producer
/// contract, docs/producers.md): the kinds they run and the payload limit.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KindRegistry {
    /// Every configured kind; a kind not listed is refused once limits are
    /// registered.
    pub kinds: Vec<RegisteredKind>,
    /// `queue.max_payload_bytes`. `None` registers the kinds' defaults only:
    /// the database then checks each row's shape but not its kind, lanes
    /// rule or size (a database no configured host has registered with).
    pub max_payload_bytes: Option<usize>,
}

impl KindRegistry {
    /// Default priorities only (optional lanes, no limits): what a
    /// database without a configured host's registration checks.
    pub fn priorities(defaults: &[(&str, Priority)]) -> Self {
        Self {
            kinds: defaults
                .iter()
                .map(|(kind, priority)| RegisteredKind {
                    kind: (*kind).to_owned(),
                    priority: *priority,
                    lanes: KindLanes::Optional,
                })
                .collect(),
            max_payload_bytes: None,
        }
    }
}
