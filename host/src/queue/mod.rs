//! The durable queue: one [`Queue`] trait, two backends (SQLite embedded,
//! PostgreSQL shared by several hosts), and the only place in laneway that
//! issues SQL.
//!
//! Every op stays in the database until it reaches a terminal state. A claim
//! is a committed `submitted` row carrying a lease (owner, token, expiry); no
//! transaction is held open while an op is delivered. Every change a
//! dispatcher makes is a compare-and-set on the status, attempt number and
//! lease token it claimed with, so a stale dispatcher can never overwrite a
//! newer state. Operator changes are a compare-and-set on the status.

mod common;
mod operator;
pub mod postgres;
mod settings;
pub mod sqlite;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::clock::Clock;
use crate::lanes::LaneRules;
use crate::op::{Attempt, AttemptRecord, IllegalTransition, Lease, Op, OpId, Priority, Status};

pub use common::validate_new_op;
pub use operator::{
    ApiKey, AuditEntry, Latency, NewApiKey, NewAuditEntry, OldestDue, OutcomeEntry, Pause, PauseScope, PruneQuery,
    QueueGauges, Tombstone,
};
pub use settings::{DatabaseConfig, SqliteConfig, Synchronous};

impl From<sqlx::Error> for QueueError {
    /// A value the database refuses (PostgreSQL's data exceptions: a NUL
    /// byte in text, a date out of its range; the internal-kind trigger) is
    /// the caller's bad input, the same on both backends, not an outage.
    fn from(e: sqlx::Error) -> Self {
        if let sqlx::Error::Database(db) = &e {
            let data_exception = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>().is_some()
                && db.code().is_some_and(|c| c.len() == 5 && c.starts_with("22"));
            if data_exception || db.message().contains("producers cannot enqueue it") {
                return QueueError::InvalidOp(format!("the database refused a value: {}", db.message()));
            }
        }
        QueueError::Database(e)
    }
}

/// Which database a queue lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Embedded, one file, one machine.
    Sqlite,
    /// Shared by several hosts.
    Postgres,
}

/// Errors from the queue layer. Variants name decisions a caller makes.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// The database could not be reached or opened.
    #[error("cannot open database {url}: {source}")]
    Unreachable {
        /// The URL with any password removed.
        url: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The URL names no backend laneway supports.
    #[error("unsupported database url {0:?} (expected sqlite:… or postgres://…)")]
    UnsupportedUrl(String),
    /// The schema is older than this laneway; `laneway migrate` fixes it.
    #[error("database schema is behind this laneway (missing migration {missing}); run `laneway migrate`")]
    SchemaBehind {
        /// The first migration version not applied.
        missing: i64,
    },
    /// The schema was written by a newer laneway; this one must not touch it.
    #[error("database schema version {found} is newer than this laneway knows ({known}); upgrade laneway")]
    SchemaTooNew {
        /// The newest version applied to the database.
        found: i64,
        /// The newest version this binary carries.
        known: i64,
    },
    /// Applying migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The op is malformed; nothing was written.
    #[error("invalid op: {0}")]
    InvalidOp(String),
    /// No op has that id.
    #[error("op {0} not found")]
    NotFound(OpId),
    /// An operator action the op's status does not allow.
    #[error("op {id}: {source}")]
    Illegal {
        /// The op.
        id: OpId,
        /// Why.
        #[source]
        source: IllegalTransition,
    },
    /// The op carries a receipt in doubt: its side effect may have happened,
    /// so it cannot be cancelled; its executor reconciles it first.
    #[error("op {0}: an earlier attempt may have taken effect (its receipt is in doubt); it is reconciled on its next attempt and cannot be cancelled")]
    InDoubt(OpId),
    /// A feed cursor this backend did not hand out.
    #[error("cursor {0:?} is not one this queue handed out")]
    BadCursor(String),
    /// An API key of that name exists already.
    #[error("an API key named {0:?} already exists")]
    KeyNameTaken(String),
    /// The change conflicts with another op or a concurrent writer.
    #[error("op {id}: {message}")]
    Conflict {
        /// The op (0 when it was never written).
        id: OpId,
        /// What conflicted.
        message: String,
    },
    /// A row holds a value no laneway writes (hand-edited, or corrupt).
    #[error("op {id} has an unreadable {column}: {value:?}")]
    Corrupt {
        /// The op.
        id: OpId,
        /// The column.
        column: &'static str,
        /// What was found.
        value: String,
    },
    /// A shared record holds a value no laneway writes.
    #[error("record {namespace}/{key} is unreadable: {why}")]
    BadRecord {
        /// Its namespace.
        namespace: &'static str,
        /// Its key.
        key: String,
        /// Why.
        why: String,
    },
    /// A shared record kept changing under every compare-and-set tried.
    #[error("{0}")]
    RecordContended(String),
    /// Any other database failure; the operation had no effect.
    #[error("database error: {0}")]
    Database(sqlx::Error),
}

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
    /// JSON text, stored exactly as given.
    pub payload: String,
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
    pub fn new(outbox: impl Into<String>, kind: impl Into<String>, payload: impl Into<String>) -> Self {
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

/// Which pending ops a claim may take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    /// Only ops of this outbox (all outboxes when `None`).
    pub outbox: Option<String>,
    /// Only ops of these kinds (all kinds when `None`).
    pub kinds: Option<Vec<String>>,
    /// At most this many ops.
    pub limit: u32,
    /// The lease to take them under.
    pub lease: LeaseSpec,
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

/// A non-terminal op the scheduler considers, with what it needs to know
/// beyond the op itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CandidateOp {
    /// The op.
    pub op: Op,
    /// Its subject is halted (compliance guard): it must not be attempted.
    pub subject_halted: bool,
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

/// The queue store. Both backends implement it and pass one conformance suite.
#[async_trait]
pub trait Queue: Send + Sync + std::fmt::Debug {
    /// Which backend this is.
    fn backend(&self) -> Backend;

    /// Applies every migration this binary carries.
    async fn migrate(&self) -> Result<(), QueueError>;

    /// Checks that the schema is exactly what this binary expects.
    ///
    /// # Errors
    ///
    /// [`QueueError::SchemaBehind`] or [`QueueError::SchemaTooNew`].
    async fn check_schema(&self) -> Result<(), QueueError>;

    /// Enqueues ops in one transaction of the queue's own: all or none.
    async fn enqueue(&self, ops: &[NewOp]) -> Result<Vec<Enqueued>, QueueError>;

    /// Claims up to `limit` due pending ops in dispatch order (priority, then
    /// sequence), each under a fresh lease.
    async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Claimed>, QueueError>;

    /// Claims exactly these ops if they are still pending (and due) and
    /// their lanes, across every outbox, still admit them under `rules` (the
    /// lane scheduler's rule, checked again inside the claiming transaction
    /// against every op that occupies a lane, so two drains of different
    /// outboxes or hosts can never both start ops that exclude each other).
    /// The ones that are not claimable are left out of the result.
    async fn claim_ids(&self, ids: &[OpId], lease: &LeaseSpec, rules: &LaneRules) -> Result<Vec<Claimed>, QueueError> {
        Ok(self.settle_and_claim(&[], ids, lease, rules).await?.1)
    }

    /// Settles `completions` (as [`Queue::complete`]) and then claims `ids`
    /// (as [`Queue::claim_ids`]) in one transaction: one commit per round
    /// of a drain, and the claim sees the lanes the settles freed.
    async fn settle_and_claim(
        &self,
        completions: &[Completion],
        ids: &[OpId],
        lease: &LeaseSpec,
        rules: &LaneRules,
    ) -> Result<(Vec<Cas>, Vec<Claimed>), QueueError> {
        self.settle_then_claim(completions, ids, &[], lease, rules).await
    }

    /// As [`Queue::settle_and_claim`], and each `(op, follows)` in
    /// `follows` makes the claim of `op` depend on the settle of `follows`
    /// in the same transaction: if that settle did not apply (its lease was
    /// lost), `op` is left out. A drain so starts the next op of a lane in
    /// the round that settles the op before it, and still never lets it
    /// overtake an op whose outcome was not recorded.
    async fn settle_then_claim(
        &self,
        completions: &[Completion],
        ids: &[OpId],
        follows: &[(OpId, OpId)],
        lease: &LeaseSpec,
        rules: &LaneRules,
    ) -> Result<(Vec<Cas>, Vec<Claimed>), QueueError>;

    /// An outbox's non-terminal ops as a drain's book keeps them (no
    /// payload): with `after` unset, the first `limit` in dispatch order;
    /// with `after`, those with a greater id (enqueued since), by id.
    async fn scan(&self, outbox: &str, after: Option<OpId>, limit: u32) -> Result<Vec<BookRow>, QueueError>;

    /// An outbox's non-terminal ops after `from` in dispatch order
    /// (priority, then id), at most `limit`, as [`Queue::scan`] reads them:
    /// how a full read goes on past a prefix crowded by a few lanes.
    async fn scan_from(&self, outbox: &str, from: (Priority, OpId), limit: u32) -> Result<Vec<BookRow>, QueueError>;

    /// Every op, in any outbox, that occupies one of `lanes`: in flight, or
    /// pending with a receipt in doubt.
    async fn occupants(&self, lanes: &[String]) -> Result<Vec<Occupant>, QueueError>;

    /// Finishes attempts in one transaction, recording each attempt row.
    /// Each item is applied only if its lease is still current.
    async fn complete(&self, completions: &[Completion]) -> Result<Vec<Cas>, QueueError>;

    /// Persists what the executor is about to do (e.g. a transaction hash)
    /// before it does it, under the current lease.
    async fn checkpoint(&self, lease: &Lease, receipt: &str) -> Result<Cas, QueueError>;

    /// Leaves a pending op pending until `until` without using an attempt
    /// (a fee policy deferred it); `Stale` if it is no longer pending.
    async fn defer(&self, id: OpId, until: DateTime<Utc>) -> Result<Cas, QueueError>;

    /// Pushes the leases' expiry to now + `duration`.
    async fn extend_leases(&self, leases: &[Lease], duration: Duration) -> Result<Vec<Cas>, QueueError>;

    /// Gives back claims that were never started; their attempt is not counted.
    async fn release(&self, leases: &[Lease]) -> Result<Vec<Cas>, QueueError>;

    /// Submitted ops whose lease ran out, oldest expiry first.
    async fn expired_leases(&self, limit: u32) -> Result<Vec<Claimed>, QueueError>;

    /// Returns an op whose lease expired to pending (keeping any receipt, so
    /// the executor reconciles before redelivering) or dead-letters it, and
    /// records the attempt as `lease_expired`.
    async fn expire(&self, lease: &Lease, to: ExpireTo) -> Result<Cas, QueueError>;

    /// Operator: cancels a pending op that was never sent.
    ///
    /// # Errors
    ///
    /// [`QueueError::NotFound`], [`QueueError::Illegal`] if it is not
    /// pending, or [`QueueError::InDoubt`] if an earlier attempt may have
    /// taken effect (it carries a receipt in doubt).
    async fn cancel(&self, id: OpId) -> Result<Op, QueueError>;

    /// Operator: sends a failed op back to pending, due now, with a fresh
    /// attempt budget.
    ///
    /// # Errors
    ///
    /// [`QueueError::NotFound`], or [`QueueError::Illegal`] if it is not failed.
    async fn force_retry(&self, id: OpId) -> Result<Op, QueueError>;

    /// One op.
    async fn get(&self, id: OpId) -> Result<Option<Op>, QueueError>;

    /// An op's attempt history, oldest first.
    async fn attempts(&self, id: OpId) -> Result<Vec<Attempt>, QueueError>;

    /// Ops matching a filter.
    async fn list(&self, filter: &OpFilter) -> Result<Vec<Op>, QueueError>;

    /// Queue depth by status and priority.
    async fn depth(&self) -> Result<Vec<Depth>, QueueError>;

    /// An outbox's non-terminal ops in dispatch order, at most `limit`.
    async fn candidates(&self, outbox: &str, limit: u32) -> Result<Vec<CandidateOp>, QueueError>;

    /// Outboxes that have pending ops due now (the safety-net poll).
    async fn due_outboxes(&self, limit: u32) -> Result<Vec<String>, QueueError>;

    /// Takes the outbox's drain slot if nobody holds a live lease on it.
    async fn acquire_slot(&self, outbox: &str, owner: &str, ttl: Duration) -> Result<Option<SlotLease>, QueueError>;

    /// Extends a held slot; `Stale` when it lapsed and someone else took it.
    async fn renew_slot(&self, slot: &SlotLease, ttl: Duration) -> Result<Cas, QueueError>;

    /// Gives a held slot up at once.
    async fn release_slot(&self, slot: &SlotLease) -> Result<(), QueueError>;

    /// Announces `owner` as a live host until `ttl` from now, forgets hosts
    /// whose announcement ran out, and returns how the live drain slots are
    /// shared.
    async fn heartbeat(&self, owner: &str, ttl: Duration) -> Result<HostShare, QueueError>;

    /// Strict lanes held by dead letters (all outboxes when `None`).
    async fn lane_halts(&self, outbox: Option<&str>) -> Result<Vec<LaneHalt>, QueueError>;

    /// Operator: lets a halted lane continue past its dead letter, which
    /// stays failed. Returns how many holds were removed.
    async fn skip_lane(&self, outbox: &str, lane: &str) -> Result<u64, QueueError>;

    /// Operator: stops every op for `subject` from being attempted.
    async fn halt_subject(&self, subject: &str, reason: Option<&str>) -> Result<(), QueueError>;

    /// Operator: lets the subject's ops go again; `false` if it was not halted.
    async fn unhalt_subject(&self, subject: &str) -> Result<bool, QueueError>;

    /// Halted subjects.
    async fn halted_subjects(&self) -> Result<Vec<HaltedSubject>, QueueError>;

    /// Wake-ups from producers in other processes, where the backend has
    /// them (PostgreSQL `LISTEN`); `None` otherwise.
    async fn subscribe(&self) -> Result<Option<Box<dyn Subscription>>, QueueError>;

    /// Replaces the default priority of every kind, which plain-SQL inserts
    /// that leave `priority` out get (a kind not listed gets normal).
    async fn set_kind_defaults(&self, defaults: &[(String, Priority)]) -> Result<(), QueueError>;

    /// Stores an oracle's snapshot (JSON) unless a newer one is stored.
    async fn put_fee_snapshot(
        &self,
        oracle: &str,
        snapshot: &str,
        sampled_at: DateTime<Utc>,
    ) -> Result<Cas, QueueError>;

    /// An oracle's latest snapshot (JSON) and when it was sampled.
    async fn fee_snapshot(&self, oracle: &str) -> Result<Option<(String, DateTime<Utc>)>, QueueError>;

    /// Force-retries dead letters in one transaction, each due at its time
    /// (a bulk recover spreads them). Each is a compare-and-set on the
    /// failed status (`Transition::ForceRetry`); ops with a coalesce key are
    /// skipped (their retry may conflict: use [`Queue::force_retry`]).
    /// Returns the ids retried.
    async fn retry_dead_letters(&self, due: &[(OpId, DateTime<Utc>)]) -> Result<Vec<OpId>, QueueError>;

    /// Stores a new API key; [`QueueError::Conflict`] if its name is taken.
    async fn create_api_key(&self, key: &NewApiKey) -> Result<ApiKey, QueueError>;

    /// Every API key, revoked ones included, by name.
    async fn api_keys(&self) -> Result<Vec<ApiKey>, QueueError>;

    /// A key and its secret's hash, by its public id.
    async fn api_key(&self, id: &str) -> Result<Option<(ApiKey, Vec<u8>)>, QueueError>;

    /// Revokes the key named `name`; `false` if there is no such live key.
    async fn revoke_api_key(&self, name: &str) -> Result<bool, QueueError>;

    /// Appends to the audit log.
    async fn record_audit(&self, entry: &NewAuditEntry) -> Result<(), QueueError>;

    /// The audit log, newest first, before the entry `before` (paging).
    async fn audit_log(&self, before: Option<i64>, limit: u32) -> Result<Vec<AuditEntry>, QueueError>;

    /// Pauses a target; `false` if it was already paused (the reason and
    /// actor are then left as they were).
    async fn pause(
        &self,
        scope: PauseScope,
        target: &str,
        reason: Option<&str>,
        actor: &str,
    ) -> Result<bool, QueueError>;

    /// Resumes a target; `false` if it was not paused.
    async fn resume(&self, scope: PauseScope, target: &str) -> Result<bool, QueueError>;

    /// Every pause, by scope and target.
    async fn pauses(&self) -> Result<Vec<Pause>, QueueError>;

    /// The counts `/metrics` and `/stats` show, by aggregate queries.
    async fn gauges(&self) -> Result<QueueGauges, QueueError>;

    /// Creation-to-confirmation times of the newest `limit` ops confirmed
    /// since `since`, newest first.
    async fn recent_latencies(&self, since: DateTime<Utc>, limit: u32) -> Result<Vec<Latency>, QueueError>;

    /// The outcome feed: terminal transitions after the cursor `after`
    /// (from the start when `None`), oldest first, at most `limit`, each
    /// with its op. A row is served only once no transaction that could
    /// still write an earlier one is running, so paging by the last
    /// entry's cursor never skips a transition.
    ///
    /// # Errors
    ///
    /// [`QueueError::BadCursor`] for a cursor this backend did not make.
    async fn outcomes(&self, after: Option<&str>, limit: u32) -> Result<Vec<OutcomeEntry>, QueueError>;

    /// Terminal ops a pruning pass may delete, oldest first. A dead letter
    /// that holds a strict lane is never one: it waits for its operator.
    async fn prunable(&self, query: &PruneQuery) -> Result<Vec<Op>, QueueError>;

    /// Stores tombstones (a key already tombstoned keeps its first). The
    /// pruner commits them before it deletes their ops, so an insert of
    /// the key sees the op or its tombstone, never neither.
    async fn put_tombstones(&self, tombstones: &[Tombstone]) -> Result<(), QueueError>;

    /// Deletes the ops among `ids` that are still in `status` (and hold no
    /// lane), with their attempts, lanes and outcome rows, in one
    /// transaction. Returns the ids deleted.
    async fn delete_terminal(&self, ids: &[OpId], status: Status) -> Result<Vec<OpId>, QueueError>;

    /// Deletes up to `limit` tombstones expired by `now`; returns how many.
    async fn expire_tombstones(&self, now: DateTime<Utc>, limit: u32) -> Result<u64, QueueError>;

    /// The tombstone of an idempotency key, if its op was pruned.
    async fn tombstone(&self, outbox: &str, idempotency_key: &str) -> Result<Option<Tombstone>, QueueError>;

    /// Takes or renews the lease on one-host-at-a-time work `name` for
    /// `owner` until `ttl` from now; `false` while another host holds it.
    async fn hold_singleton(&self, name: &str, owner: &str, ttl: std::time::Duration) -> Result<bool, QueueError>;

    /// Ends the coalescing of the pending or in-flight ops of `outbox` with
    /// these idempotency keys (an Undo took them back); returns how many.
    async fn release_coalesce(&self, outbox: &str, idempotency_keys: &[String]) -> Result<u64, QueueError>;

    /// A named position in the outcome feed.
    async fn feed_cursor(&self, name: &str) -> Result<Option<String>, QueueError>;

    /// Stores a named position in the outcome feed.
    async fn set_feed_cursor(&self, name: &str, cursor: &str) -> Result<(), QueueError>;

    /// The record under (namespace, key).
    async fn record(&self, namespace: &str, key: &str) -> Result<Option<Record>, QueueError>;

    /// The records of a namespace with these keys, or every record of it
    /// when `keys` is `None`, by key.
    async fn records(&self, namespace: &str, keys: Option<&[String]>) -> Result<Vec<Record>, QueueError>;

    /// Writes a record if what is stored matches `expect`; the new version
    /// is the old one plus one (1 for an insert).
    async fn put_record(&self, namespace: &str, key: &str, value: &str, expect: Expect) -> Result<Cas, QueueError>;

    /// Deletes a record if what is stored matches `expect` (`Absent`
    /// always answers `Stale`).
    async fn delete_record(&self, namespace: &str, key: &str, expect: Expect) -> Result<Cas, QueueError>;

    /// Rows in each table retention bounds (`common::SIZED_TABLES`), for the
    /// soak and for operators sizing retention.
    async fn table_rows(&self) -> Result<Vec<(String, i64)>, QueueError>;
}

/// What becomes of a shared record in [`update_record`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Leave it as it is (nothing is written).
    Keep,
    /// Store this JSON value.
    Put(String),
    /// Delete it.
    Delete,
}

/// Reads the record (namespace, key), asks `decide` what becomes of it and
/// writes that by compare-and-set on the version read, reading again and
/// asking again when another writer got there first. Returns what `decide`
/// answered with the change that was written (or kept), or `None` after
/// `tries` lost races. The one read-decide-write loop over shared records.
///
/// # Errors
///
/// A queue error, or what `decide` refuses.
pub async fn update_record<R>(
    queue: &dyn Queue,
    namespace: &str,
    key: &str,
    tries: usize,
    mut decide: impl FnMut(Option<&Record>) -> Result<(Change, R), QueueError>,
) -> Result<Option<R>, QueueError> {
    for _ in 0..tries {
        let stored = queue.record(namespace, key).await?;
        let (change, answer) = decide(stored.as_ref())?;
        let expect = stored.as_ref().map_or(Expect::Absent, |r| Expect::Version(r.version));
        let written = match change {
            Change::Keep => return Ok(Some(answer)),
            Change::Put(value) => queue.put_record(namespace, key, &value, expect).await?,
            Change::Delete => queue.delete_record(namespace, key, expect).await?,
        };
        if written.applied() {
            return Ok(Some(answer));
        }
    }
    Ok(None)
}

/// Opens the queue named by the config's database URL.
///
/// # Errors
///
/// [`QueueError::UnsupportedUrl`] or [`QueueError::Unreachable`].
pub async fn open(
    config: &DatabaseConfig,
    limits: Limits,
    clock: Arc<dyn Clock>,
) -> Result<Arc<dyn Queue>, QueueError> {
    let url = config.url.as_str();
    if url.starts_with("sqlite:") {
        Ok(Arc::new(sqlite::SqliteQueue::open(config, limits, clock).await?))
    } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
        Ok(Arc::new(postgres::PgQueue::open(config, limits, clock).await?))
    } else {
        Err(QueueError::UnsupportedUrl(redact_url(url)))
    }
}

/// A fresh lease token.
pub(crate) fn new_token() -> Uuid {
    Uuid::new_v4()
}

/// The URL with any password replaced, for error messages and logs.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some(parts) => parts,
        None => ("", url),
    };
    // The user info runs to the last `@` (a password may hold an `@`, `/`
    // or `?` unencoded); the query is after the first `?` past it.
    let (creds, after) = match rest.rsplit_once('@') {
        Some((creds, after)) => (Some(creds), after),
        None => (None, rest),
    };
    let (location, query) = match after.split_once('?') {
        Some((location, query)) => (location, Some(query)),
        None => (after, None),
    };
    let mut out = String::new();
    if !scheme.is_empty() {
        out.push_str(scheme);
        out.push_str("://");
    }
    if let Some(creds) = creds {
        match creds.split_once(':') {
            Some((user, _)) => out.push_str(&format!("{user}:***@")),
            None => out.push_str(&format!("{creds}@")),
        }
    }
    out.push_str(location);
    if let Some(query) = query {
        let secret = |key: &str| {
            let key = key.to_ascii_lowercase();
            ["pass", "secret", "token", "key"].iter().any(|s| key.contains(s))
        };
        let params: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((key, _)) if secret(key) => format!("{key}=***"),
                _ => pair.to_owned(),
            })
            .collect();
        out.push('?');
        out.push_str(&params.join("&"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_hands_back_what_it_holds_beyond_an_even_share() {
        let share = |hosts, slots, mine| HostShare { hosts, slots, mine }.excess();
        assert_eq!(share(1, 3, 3), 0, "alone, a host keeps everything");
        assert_eq!(share(2, 3, 3), 1, "two hosts, three slots: 2 and 1");
        assert_eq!(share(2, 3, 2), 0);
        assert_eq!(share(3, 3, 3), 2);
        assert_eq!(share(2, 4, 1), 0, "under its share, nothing to give");
        assert_eq!(share(3, 0, 0), 0);
    }

    #[test]
    fn passwords_are_redacted_from_urls() {
        assert_eq!(redact_url("postgres://u:pw@h:5432/db"), "postgres://u:***@h:5432/db");
        assert_eq!(redact_url("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact_url("sqlite://laneway.db"), "sqlite://laneway.db");
        assert_eq!(redact_url("postgres://u:p@ss@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact_url("postgres://u:a/b?c@h/db"), "postgres://u:***@h/db");
        assert_eq!(
            redact_url("postgres://h/db?user=u&password=pw&sslmode=require&sslpassword=x"),
            "postgres://h/db?user=u&password=***&sslmode=require&sslpassword=***"
        );
        assert_eq!(redact_url("sqlite://x.db?mode=rwc"), "sqlite://x.db?mode=rwc");
    }

    #[test]
    fn enqueued_reports_the_op_to_track() {
        assert_eq!(Enqueued::Created(3).id(), 3);
        assert_eq!(Enqueued::Existing(4).id(), 4);
        assert_eq!(Enqueued::AlreadyPending(5).id(), 5);
    }
}
