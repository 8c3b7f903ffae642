//! The PostgreSQL backend: how laneway scales past one machine.
//!
//! Several hosts share one database. A claim locks candidate rows with
//! `FOR UPDATE SKIP LOCKED` only for the claiming transaction, takes each of
//! their lanes' advisory lock without waiting, and commits them as
//! `submitted` with a lease; no transaction stays open while an op is
//! delivered. An insert trigger fills `op_lanes` and sends
//! `NOTIFY laneway_ops, '<outbox>'`, so producers that insert with plain SQL
//! wake the hosts too. What only PostgreSQL does lives here: the advisory
//! lane locks, `LISTEN`, and the settle of a batch as one array per column
//! (`settle`).

mod schema;
mod settle;

pub use schema::{check_schema_name, DEFAULT_SCHEMA};

// The host's committer, compiled against this dialect as the store is.
#[allow(clippy::duplicate_mod)]
#[path = "../committer.rs"]
mod committer;

// The store's one source, compiled against this dialect (see `dialect.rs`):
// loading it once per dialect is the point, not a slip.
#[allow(clippy::duplicate_mod)]
#[path = "../store/mod.rs"]
mod store;

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};
use sqlx::{Postgres, Transaction};

use super::dialect::{Dialect, RecordPut, Round, RoundResult};
use super::policy::lane_lock_key;
use super::{redact_url, Backend, Cas, Completion, DatabaseConfig, Limits, QueueError, Subscription};
use crate::clock::Clock;

pub use store::Store as PgQueue;

pub(crate) use super::sql::postgres as sql;
type Db = Postgres;
type Conn = sqlx::PgConnection;
type Row = sqlx::postgres::PgRow;

static MIGRATOR: Migrator = sqlx::migrate!("../migrations/postgres");

/// Committers per host. PostgreSQL runs transactions side by side: with one
/// committer the database's other core idles while a group commits; with
/// eight (one transaction per drain, as before the committer) the groups are
/// small again. Measured on the 2-core VM, 20,000 ops over 8 outboxes: 1:
/// 5.9-7.0k ops/s, 2: 7.9k, 4: 6.8-7.6k (BENCHMARKS.md).
const COMMITTERS: usize = 2;

/// The channel the insert trigger notifies, with the outbox as payload.
pub const NOTIFY_CHANNEL: &str = "laneway_ops";

/// PostgreSQL's connections: one pool for reads and writes alike, and the
/// committer's inbox (`None` in the committer's own copy).
#[derive(Debug, Clone)]
pub struct Conns {
    pool: PgPool,
    group: Option<committer::Inbox>,
    /// The schema `migrate` creates (and moves a pre-schema laneway into);
    /// `None` when the caller's options chose the search path and made it.
    schema: Option<Arc<str>>,
    /// `[database] lock_timeout_ms`, for laneway's own enqueues.
    lock_timeout_ms: u64,
}

impl PgQueue {
    /// Connects to the database named by `config.url`.
    ///
    /// # Errors
    ///
    /// [`QueueError::Unreachable`] when no connection can be made.
    pub async fn open(config: &DatabaseConfig, limits: Limits, clock: Arc<dyn Clock>) -> Result<Self, QueueError> {
        let options = PgConnectOptions::from_str(&config.url).map_err(|source| QueueError::Unreachable {
            url: redact_url(&config.url),
            source,
        })?;
        // Every connection finds laneway's objects, and only those, first:
        // its own schema, never the application's.
        let schema = schema::resolve(config.schema.as_deref(), &config.url);
        check_schema_name(&schema).map_err(QueueError::InvalidOp)?;
        let options = options.options([("search_path", schema.as_str())]);
        Self::connect(options, config, limits, clock, Some(schema.into())).await
    }

    /// Connects with explicit options (a search path, say) and the pool
    /// settings from `config`.
    ///
    /// # Errors
    ///
    /// [`QueueError::Unreachable`] when no connection can be made.
    pub async fn open_with(
        options: PgConnectOptions,
        config: &DatabaseConfig,
        limits: Limits,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, QueueError> {
        Self::connect(options, config, limits, clock, None).await
    }

    async fn connect(
        options: PgConnectOptions,
        config: &DatabaseConfig,
        limits: Limits,
        clock: Arc<dyn Clock>,
        schema: Option<Arc<str>>,
    ) -> Result<Self, QueueError> {
        let pool = PgPoolOptions::new()
            .max_connections(config.max_connections)
            .acquire_timeout(Duration::from_millis(config.connect_timeout_ms))
            .connect_with(options)
            .await
            .map_err(|source| QueueError::Unreachable {
                url: redact_url(&config.url),
                source,
            })?;
        Ok(committer::open(
            Conns {
                pool,
                group: None,
                schema,
                lock_timeout_ms: config.lock_timeout_ms,
            },
            limits,
            clock,
            COMMITTERS,
        ))
    }

    /// The pool, for callers' own tables and for `LISTEN`.
    pub fn pool(&self) -> &PgPool {
        &self.conns.pool
    }

    /// Begins a transaction for enqueueing together with the caller's rows.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn begin(&self) -> Result<Transaction<'static, Postgres>, QueueError> {
        self.conns.write().await
    }
}

/// `LISTEN laneway_ops`, yielding the outbox each insert names.
struct Listener(PgListener);

#[async_trait]
impl Subscription for Listener {
    async fn next(&mut self) -> Result<String, QueueError> {
        // PgListener reconnects by itself after a dropped connection;
        // notifications sent meanwhile are lost, which the safety-net poll covers.
        Ok(self.0.recv().await?.payload().to_owned())
    }
}

#[async_trait]
impl Dialect for Conns {
    type Db = Postgres;
    const BACKEND: Backend = Backend::Postgres;

    async fn write(&self) -> Result<Transaction<'static, Postgres>, QueueError> {
        Ok(self.pool.begin().await?)
    }

    const BEGIN: Option<&'static str> = None;

    async fn writer(&self) -> Result<sqlx::pool::PoolConnection<Postgres>, QueueError> {
        Ok(self.pool.acquire().await?)
    }

    fn read(&self) -> &PgPool {
        &self.pool
    }

    fn known_migrations() -> Vec<i64> {
        MIGRATOR.iter().map(|m| m.version).collect()
    }

    async fn migrate(&self) -> Result<(), QueueError> {
        if let Some(schema) = &self.schema {
            let mut conn = self.pool.acquire().await?;
            schema::prepare(&mut conn, schema, &MIGRATOR).await?;
        }
        // Each migration commits whole or not at all (one transaction each).
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    async fn subscribe(&self) -> Result<Option<Box<dyn Subscription>>, QueueError> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen(NOTIFY_CHANNEL).await?;
        Ok(Some(Box::new(Listener(listener))))
    }

    async fn hand_off(&self, round: Round) -> Result<RoundResult, Round> {
        match &self.group {
            Some(inbox) => Ok(inbox.submit(round).await),
            None => Err(round),
        }
    }

    async fn hand_off_put(&self, put: RecordPut) -> Result<Result<Cas, QueueError>, RecordPut> {
        match &self.group {
            Some(inbox) => Ok(inbox.put(put).await),
            None => Err(put),
        }
    }

    async fn ops_horizon(conn: &mut Conn, outbox: &str) -> Result<i64, QueueError> {
        Ok(sqlx::query_scalar(sql::dispatch::OPS_HORIZON)
            .bind(outbox)
            .fetch_one(&mut *conn)
            .await?)
    }

    async fn bound_lock_waits(&self, conn: &mut Conn) -> Result<(), QueueError> {
        sqlx::query(sql::ops::SET_LOCK_TIMEOUT)
            .bind(format!("{}ms", self.lock_timeout_ms))
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn contended(conn: &mut Conn, lanes: &[String]) -> Result<HashSet<String>, QueueError> {
        let keys: Vec<i64> = lanes.iter().map(|l| lane_lock_key(l)).collect();
        let refused: HashSet<i64> = sqlx::query_scalar(sql::dispatch::CONTENDED_LANES)
            .bind(&keys)
            .fetch_all(&mut *conn)
            .await?
            .into_iter()
            .collect();
        Ok(lanes
            .iter()
            .filter(|l| refused.contains(&lane_lock_key(l)))
            .cloned()
            .collect())
    }

    async fn settle(conn: &mut Conn, completions: &[Completion], now: DateTime<Utc>) -> Result<Vec<Cas>, QueueError> {
        settle::settle(conn, completions, now).await
    }

    fn parse_cursor(cursor: &str) -> Option<(i64, i64)> {
        // "xid.seq": see the outcomes migration for why both.
        let (xid, seq) = cursor.split_once('.')?;
        Some((xid.parse().ok()?, seq.parse().ok()?))
    }

    fn cursor(xid: i64, seq: i64) -> String {
        format!("{xid}.{seq}")
    }
}
