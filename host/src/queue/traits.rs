//! The queue's interface, split by concern so a caller names what it needs
//! ([`Queue`] is all of them). Each backend implements every part once, in
//! `store/`, and passes the one conformance suite.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::{
    ApiKey, AuditEntry, Backend, BookRow, Cas, Claimed, Completion, DeadLetterGroup, Depth, Enqueued, Expect, ExpireTo,
    HaltedSubject, HostShare, KindRegistry, LaneHalt, Latency, LeaseSpec, MinuteCount, NewApiKey, NewAuditEntry, NewOp,
    Occupant, OpFilter, OutcomeEntry, Pause, PauseScope, PruneQuery, QueueError, QueueGauges, Record, Redeal,
    SlotLease, Subscription, Tombstone,
};
use crate::lanes::LaneRules;
use crate::op::{Attempt, Lease, Op, OpId, Priority, Status};

/// Ops: the schema, enqueue, reads of ops, and producers' wake-ups.
#[async_trait]
pub trait OpStore: Send + Sync + std::fmt::Debug {
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

    /// One op.
    async fn get(&self, id: OpId) -> Result<Option<Op>, QueueError>;

    /// An op's attempt history, oldest first.
    async fn attempts(&self, id: OpId) -> Result<Vec<Attempt>, QueueError>;

    /// Which of `ids` a channel pool's drain re-dealt to another channel
    /// (their moves are recorded in `lane_redeals`), in id order.
    async fn redealt(&self, ids: &[OpId]) -> Result<Vec<OpId>, QueueError>;

    /// Ops matching a filter.
    async fn list(&self, filter: &OpFilter) -> Result<Vec<Op>, QueueError>;

    /// Queue depth by status and priority.
    async fn depth(&self) -> Result<Vec<Depth>, QueueError>;

    /// Per minute since `since`: transitions into each terminal status, and
    /// attempts that failed short of a confirmation (`retried`), each
    /// counted over the newest `max_rows` rows at most (so the cost is
    /// bounded whatever the tables hold; outcomes summing to `max_rows`
    /// mean the window was cut short), oldest minute first.
    async fn recent_minutes(&self, since: DateTime<Utc>, max_rows: u32) -> Result<Vec<MinuteCount>, QueueError>;

    /// Wake-ups from producers in other processes, where the backend has
    /// them (PostgreSQL `LISTEN`); `None` otherwise.
    async fn subscribe(&self) -> Result<Option<Box<dyn Subscription>>, QueueError>;

    /// Replaces the kinds registered for plain-SQL producers: each kind's
    /// default priority (what an insert that leaves `priority` out gets; a
    /// kind not listed gets normal) and lane rule, and the contract's
    /// payload limit (the producer contract, docs/producers.md).
    async fn register_kinds(&self, registry: &KindRegistry) -> Result<(), QueueError>;

    /// Ends the coalescing of the pending or in-flight ops of `outbox` with
    /// these idempotency keys (an Undo took them back); returns how many.
    async fn release_coalesce(&self, outbox: &str, idempotency_keys: &[String]) -> Result<u64, QueueError>;
}

/// Dispatch: the drain's book, claims, settles, leases, slots and host shares.
#[async_trait]
pub trait DispatchStore: Send + Sync + std::fmt::Debug {
    /// Settles `completions`, each a compare-and-set on its lease, and
    /// then claims those of `ids` that are still pending and due and whose
    /// lanes, across every outbox, still admit them under `rules` (the lane
    /// scheduler's rule, checked again inside the claiming transaction
    /// against every op that occupies a lane, so two drains of different
    /// outboxes or hosts can never both start ops that exclude each other),
    /// in one transaction: one commit per round of a drain, and the claim
    /// sees the lanes the settles freed. Ops not claimable are left out of
    /// the result. Each `(op, follows)` in `follows` makes the claim of
    /// `op` depend on the settle of `follows`: if that settle did not apply
    /// (its lease was lost), `op` is left out. A drain so starts the next op of a lane in
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
    /// (priority, then id), only the first `per_set` of each lane set (ops
    /// with the same lanes), at most `limit`, as [`DispatchStore::scan`]
    /// reads them: how a full read goes on past a prefix crowded by a few
    /// lanes without reading the rest of their backlogs.
    async fn scan_beyond(
        &self,
        outbox: &str,
        from: (Priority, OpId),
        per_set: u32,
        limit: u32,
    ) -> Result<Vec<BookRow>, QueueError>;

    /// Every op, in any outbox, that occupies one of `lanes`: in flight, or
    /// pending with a receipt in doubt.
    async fn occupants(&self, lanes: &[String]) -> Result<Vec<Occupant>, QueueError>;

    /// Moves each op to its new lane if it is still pending with no receipt
    /// and its one lane is still the move's `from` (a compare-and-set), and
    /// records the move in `lane_redeals` in the same transaction; returns
    /// the ops moved. Only a channel pool's ops are re-dealt (the caller's
    /// rule): every other op's lanes never change after enqueue.
    async fn redeal(&self, moves: &[Redeal]) -> Result<Vec<OpId>, QueueError>;

    /// Persists what the executor is about to do (e.g. a transaction hash)
    /// before it does it, under the current lease.
    async fn checkpoint(&self, lease: &Lease, receipt: &str) -> Result<Cas, QueueError>;

    /// Leaves a pending op pending until `until` without using an attempt
    /// (a fee policy deferred it); `Stale` if it is no longer pending.
    async fn defer(&self, id: OpId, until: DateTime<Utc>) -> Result<Cas, QueueError>;

    /// Pushes the leases' expiry to now + `duration`.
    async fn extend_leases(&self, leases: &[Lease], duration: Duration) -> Result<Vec<Cas>, QueueError>;

    /// Submitted ops whose lease ran out, oldest expiry first.
    async fn expired_leases(&self, limit: u32) -> Result<Vec<Claimed>, QueueError>;

    /// Returns an op whose lease expired to pending (keeping any receipt, so
    /// the executor reconciles before redelivering) or dead-letters it, and
    /// records the attempt as `lease_expired`.
    async fn expire(&self, lease: &Lease, to: ExpireTo) -> Result<Cas, QueueError>;

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
}

/// Operators: changes to ops, lane holds, halted subjects, pauses, API keys, the audit log and the counts.
#[async_trait]
pub trait OperatorStore: Send + Sync + std::fmt::Debug {
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

    /// Force-retries dead letters in one transaction, each due at its time
    /// (a bulk recover spreads them). Each is a compare-and-set on the
    /// failed status (`Transition::ForceRetry`); ops with a coalesce key are
    /// skipped (their retry may conflict: use [`OperatorStore::force_retry`]).
    /// Returns the ids retried.
    async fn retry_dead_letters(&self, due: &[(OpId, DateTime<Utc>)]) -> Result<Vec<OpId>, QueueError>;

    /// Strict lanes held by dead letters (all outboxes when `None`).
    async fn lane_halts(&self, outbox: Option<&str>) -> Result<Vec<LaneHalt>, QueueError>;

    /// At most `limit` held lanes after `after` (outbox, lane, op id), in
    /// that order: a page for a listing thousands long.
    async fn lane_halts_page(
        &self,
        outbox: Option<&str>,
        after: Option<(&str, &str, OpId)>,
        limit: u32,
    ) -> Result<Vec<LaneHalt>, QueueError>;

    /// Operator: lets a halted lane continue past its dead letter, which
    /// stays failed. Returns how many holds were removed.
    async fn skip_lane(&self, outbox: &str, lane: &str) -> Result<u64, QueueError>;

    /// Operator: stops every op for `subject` from being attempted.
    async fn halt_subject(&self, subject: &str, reason: Option<&str>) -> Result<(), QueueError>;

    /// Operator: lets the subject's ops go again; `false` if it was not halted.
    async fn unhalt_subject(&self, subject: &str) -> Result<bool, QueueError>;

    /// Halted subjects.
    async fn halted_subjects(&self) -> Result<Vec<HaltedSubject>, QueueError>;

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

    /// Every dead letter, counted by kind, last attempt class and whether
    /// its outcome is unknown, largest group first.
    async fn dead_letter_groups(&self) -> Result<Vec<DeadLetterGroup>, QueueError>;

    /// The counts `/metrics` and `/stats` show, by aggregate queries.
    async fn gauges(&self) -> Result<QueueGauges, QueueError>;

    /// Creation-to-confirmation times of the newest `limit` ops confirmed
    /// since `since`, newest first.
    async fn recent_latencies(&self, since: DateTime<Utc>, limit: u32) -> Result<Vec<Latency>, QueueError>;
}

/// Shared records, one-host-at-a-time leases, feed cursors and fee snapshots.
#[async_trait]
pub trait RecordStore: Send + Sync + std::fmt::Debug {
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

    /// Takes or renews the lease on one-host-at-a-time work `name` for
    /// `owner` until `ttl` from now; `false` while another host holds it.
    async fn hold_singleton(&self, name: &str, owner: &str, ttl: std::time::Duration) -> Result<bool, QueueError>;

    /// A named position in the outcome feed.
    async fn feed_cursor(&self, name: &str) -> Result<Option<String>, QueueError>;

    /// Stores a named position in the outcome feed.
    async fn set_feed_cursor(&self, name: &str, cursor: &str) -> Result<(), QueueError>;

    /// Stores an oracle's snapshot (JSON) unless a newer one is stored.
    async fn put_fee_snapshot(
        &self,
        oracle: &str,
        snapshot: &str,
        sampled_at: DateTime<Utc>,
    ) -> Result<Cas, QueueError>;

    /// An oracle's latest snapshot (JSON) and when it was sampled.
    async fn fee_snapshot(&self, oracle: &str) -> Result<Option<(String, DateTime<Utc>)>, QueueError>;
}

/// Retention and the outcome feed.
#[async_trait]
pub trait RetentionStore: Send + Sync + std::fmt::Debug {
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

    /// Rows in each table retention bounds (`policy::SIZED_TABLES`), for the
    /// soak and for operators sizing retention.
    async fn table_rows(&self) -> Result<Vec<(String, i64)>, QueueError>;
}

/// The whole queue: what `laneway run` holds and hands to every part.
pub trait Queue: OpStore + DispatchStore + OperatorStore + RecordStore + RetentionStore {}

impl<T: OpStore + DispatchStore + OperatorStore + RecordStore + RetentionStore> Queue for T {}
