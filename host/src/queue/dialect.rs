//! The seam between the one store and the databases: what differs between
//! SQLite and PostgreSQL beyond their SQL text, and nothing else.
//!
//! The store (`store/`) is written once and compiled once per dialect: each
//! dialect module declares `type Db`, `type Conn`, its `sql` constants and a
//! `Conns` that implements [`Dialect`], then mounts the store's source with
//! `#[path = "../store/mod.rs"] mod store;`. Every body so exists once and
//! is type-checked against every backend, without generic bounds over sqlx
//! (vaultwarden's `db_run!`, at the scale of a module).

use std::collections::HashSet;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool, Transaction};

use super::{Backend, Cas, Claimed, Completion, Expect, LeaseSpec, QueueError, Subscription};
use crate::lanes::LaneRules;
use crate::op::OpId;

/// One drain round: the settles of finished attempts, then the claim of
/// the next ops, in one transaction.
#[derive(Debug, Clone)]
pub struct Round {
    /// The settles, each under its lease.
    pub completions: Vec<Completion>,
    /// The ops to claim.
    pub ids: Vec<OpId>,
    /// Claims that depend on a settle of the round (`(op, follows)`).
    pub follows: Vec<(OpId, OpId)>,
    /// The lease the claims take.
    pub lease: LeaseSpec,
    /// The lane rules the claims are checked against.
    pub rules: LaneRules,
}

/// What a round's settles and claim came to.
pub type RoundResult = Result<(Vec<Cas>, Vec<Claimed>), QueueError>;

/// A shared record's write (`RecordStore::put_record`), handed to the
/// committer like a round: a plugin's note or claim written in the next
/// group commit rather than in a transaction of its own beside it.
#[derive(Debug, Clone)]
pub struct RecordPut {
    /// The record's namespace.
    pub namespace: String,
    /// Its key.
    pub key: String,
    /// The JSON text to store.
    pub value: String,
    /// What the write expects to find.
    pub expect: Expect,
}

/// What one database does its own way.
#[async_trait]
pub trait Dialect: Clone + std::fmt::Debug + Send + Sync + 'static {
    /// The sqlx database.
    type Db: Database;

    /// Which backend this is.
    const BACKEND: Backend;

    /// Begins a write transaction (SQLite: `BEGIN IMMEDIATE` on the one
    /// writer connection, so a transaction that reads before it writes is
    /// never refused for a commit in between).
    async fn write(&self) -> Result<Transaction<'static, Self::Db>, QueueError>;

    /// How [`Dialect::write`] begins a transaction (`None`: a plain `BEGIN`).
    const BEGIN: Option<&'static str>;

    /// The connection write transactions run on, from its pool: the
    /// committer keeps one across group commits while work waits.
    async fn writer(&self) -> Result<PoolConnection<Self::Db>, QueueError>;

    /// The pool reads go to (SQLite: read-only connections beside the writer).
    fn read(&self) -> &Pool<Self::Db>;

    /// The versions of the migrations this binary carries.
    fn known_migrations() -> Vec<i64>;

    /// Applies the migrations.
    async fn migrate(&self) -> Result<(), QueueError>;

    /// Wake-ups from producers in other processes (PostgreSQL: `LISTEN`;
    /// SQLite: a watcher of the file's commits), or `None`.
    async fn subscribe(&self) -> Result<Option<Box<dyn Subscription>>, QueueError>;

    /// Hands a round to the dialect's own committer and waits for its
    /// result, or gives it back (`Err`) for the store to apply in a
    /// transaction of its own. The host's committer (`committer.rs`, both
    /// dialects) applies the rounds of every drain that arrive while a
    /// commit runs in the next one.
    async fn hand_off(&self, round: Round) -> Result<RoundResult, Round>;

    /// Hands a record write to the committer likewise, or gives it back.
    async fn hand_off_put(&self, put: RecordPut) -> Result<Result<Cas, QueueError>, RecordPut>;

    /// Of `lanes`, those another transaction is claiming right now, to be
    /// left for the next round (PostgreSQL: advisory try-locks; SQLite has
    /// one writer, so none).
    async fn contended(
        conn: &mut <Self::Db as Database>::Connection,
        lanes: &[String],
    ) -> Result<HashSet<String>, QueueError>;

    /// The first id of `outbox` a read of its book may not pass yet: every
    /// smaller id was taken by a transaction that has ended (PostgreSQL:
    /// `laneway_ops_horizon`, from the writers' announcements, migration
    /// 20261208000001; SQLite's one writer commits ids in order, so none).
    /// Asked in a statement of its own, before the read's snapshot.
    async fn ops_horizon(conn: &mut <Self::Db as Database>::Connection, outbox: &str) -> Result<i64, QueueError>;

    /// Bounds how long laneway's own enqueue transaction waits for a lock
    /// another transaction holds, such as an idempotency key a producer's
    /// open transaction is inserting (PostgreSQL: `lock_timeout`, for this
    /// transaction only; SQLite's write lock is bounded by `busy_timeout`).
    async fn bound_lock_waits(&self, conn: &mut <Self::Db as Database>::Connection) -> Result<(), QueueError>;

    /// Settles completions in as few statements as the database allows,
    /// each a compare-and-set on its lease, and records the attempt rows of
    /// those that applied; one result per completion, in order.
    async fn settle(
        conn: &mut <Self::Db as Database>::Connection,
        completions: &[Completion],
        now: DateTime<Utc>,
    ) -> Result<Vec<Cas>, QueueError>;

    /// A feed cursor's (xid, seq), or `None` for one this backend did not
    /// make (SQLite: `seq`, its one writer's commit order; PostgreSQL:
    /// `xid.seq`).
    fn parse_cursor(cursor: &str) -> Option<(i64, i64)>;

    /// The cursor of the feed row (xid, seq).
    fn cursor(xid: i64, seq: i64) -> String;
}
