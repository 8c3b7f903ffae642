//! The embedded SQLite backend.
//!
//! One writer connection takes every write in a `BEGIN IMMEDIATE`
//! transaction (a deferred transaction that reads before it writes fails
//! with `SQLITE_BUSY` when another connection commits in between, whatever
//! the busy timeout); a separate read-only pool serves reads. WAL journal,
//! `synchronous=FULL` by default, `busy_timeout` set on every connection.
//! What only SQLite does lives here: the watcher that wakes a host on other
//! processes' commits (`watch`) and the settle of a batch as one JSON
//! parameter (`settle`).

mod settle;
mod watch;

// The host's committer, compiled against this dialect as the store is.
#[allow(clippy::duplicate_mod)]
#[path = "../committer.rs"]
mod committer;
#[cfg(test)]
#[path = "../committer_tests.rs"]
mod committer_tests;

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
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite, Transaction};

use super::dialect::{Dialect, RecordPut, Round, RoundResult};
use super::{redact_url, Backend, Cas, Completion, DatabaseConfig, Limits, QueueError, Subscription, Synchronous};
use crate::clock::Clock;

pub use store::Store as SqliteQueue;

pub(crate) use super::sql::sqlite as sql;
type Db = Sqlite;
type Conn = sqlx::SqliteConnection;
type Row = sqlx::sqlite::SqliteRow;

static MIGRATOR: Migrator = sqlx::migrate!("../migrations/sqlite");

/// SQLite's connections: the one writer, the readers, and what the
/// wake-up watcher and the committer need.
#[derive(Debug, Clone)]
pub struct Conns {
    writer: SqlitePool,
    reader: SqlitePool,
    /// How the wake-up watcher connects, and how often it looks.
    watch_options: Arc<SqliteConnectOptions>,
    watch: Duration,
    /// The committer's inbox (`None` in the committer's own copy).
    group: Option<committer::Inbox>,
}

impl SqliteQueue {
    /// Opens (creating if needed) the database file named by `config.url`.
    ///
    /// # Errors
    ///
    /// [`QueueError::Unreachable`] when the file cannot be opened, and
    /// [`QueueError::UnsupportedUrl`] for an in-memory URL (the writer and
    /// the readers would each get a database of their own).
    pub async fn open(config: &DatabaseConfig, limits: Limits, clock: Arc<dyn Clock>) -> Result<Self, QueueError> {
        let url = &config.url;
        if url.contains(":memory:") || url.contains("mode=memory") {
            return Err(QueueError::UnsupportedUrl(format!(
                "{} (in-memory SQLite cannot be shared by laneway's writer and readers; use a file)",
                redact_url(url)
            )));
        }
        let unreachable = |source| QueueError::Unreachable {
            url: redact_url(url),
            source,
        };
        let busy = Duration::from_millis(config.sqlite.busy_timeout_ms);
        let acquire = Duration::from_millis(config.connect_timeout_ms);
        let base = SqliteConnectOptions::from_str(url)
            .map_err(unreachable)?
            .busy_timeout(busy)
            .foreign_keys(true);
        let writer_options = base
            .clone()
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(match config.sqlite.synchronous {
                Synchronous::Full => SqliteSynchronous::Full,
                Synchronous::Normal => SqliteSynchronous::Normal,
            });
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(acquire)
            // The one writer must never be handed out inside a transaction:
            // sqlx counts a transaction as open until its ROLLBACK succeeds,
            // and a ROLLBACK after SQLite already rolled back (as it does on
            // I/O errors and a full disk) fails, leaving every later BEGIN
            // refused ("begin_with at non-zero transaction depth", seen in
            // CI). sqlx pings every released connection, which runs any
            // rollback a dropped transaction queued; a connection still in a
            // transaction after that is closed here, and the next write
            // opens a fresh one. That ping is the only one: a file has no
            // server that could have hung up, so the ping sqlx would add on
            // every acquire (and one of our own on release) were two more
            // hand-offs to SQLite's worker thread per write, waited for by
            // whatever writes next.
            .test_before_acquire(false)
            .before_acquire(|conn, _| Box::pin(async move { Ok(!sqlx::Connection::is_in_transaction(conn)) }))
            .connect_with(writer_options)
            .await
            .map_err(unreachable)?;
        let reader = SqlitePoolOptions::new()
            .max_connections(config.max_connections)
            // Released connections are pinged by sqlx already (see above).
            .test_before_acquire(false)
            .acquire_timeout(acquire)
            .connect_with(base.clone().read_only(true))
            .await
            .map_err(unreachable)?;
        let conns = Conns {
            writer,
            reader,
            watch_options: Arc::new(base.read_only(true)),
            watch: Duration::from_millis(config.sqlite.watch_ms),
            group: None,
        };
        // One writer: a second committer would only wait at BEGIN IMMEDIATE.
        Ok(committer::open(conns, limits, clock, 1))
    }

    /// The writer pool (one connection), for callers that keep their own
    /// business tables in the same database file.
    pub fn pool(&self) -> &SqlitePool {
        &self.conns.writer
    }

    /// Begins a write transaction on the writer connection, for enqueueing
    /// together with the caller's own rows (the transactional outbox).
    ///
    /// While it is open, the writer is taken: do not call other queue
    /// methods until it commits or rolls back.
    ///
    /// # Errors
    ///
    /// [`QueueError::Database`] when the write lock cannot be had.
    pub async fn begin(&self) -> Result<Transaction<'static, Sqlite>, QueueError> {
        self.conns.write().await
    }
}

#[async_trait]
impl Dialect for Conns {
    type Db = Sqlite;
    const BACKEND: Backend = Backend::Sqlite;

    async fn write(&self) -> Result<Transaction<'static, Sqlite>, QueueError> {
        Ok(Transaction::begin(self.writer().await?, Self::BEGIN.map(Into::into)).await?)
    }

    const BEGIN: Option<&'static str> = Some("BEGIN IMMEDIATE");

    async fn writer(&self) -> Result<sqlx::pool::PoolConnection<Sqlite>, QueueError> {
        Ok(self.writer.acquire().await?)
    }

    fn read(&self) -> &SqlitePool {
        &self.reader
    }

    fn known_migrations() -> Vec<i64> {
        MIGRATOR.iter().map(|m| m.version).collect()
    }

    async fn migrate(&self) -> Result<(), QueueError> {
        // Foreign keys off for migrations that rebuild a table, which
        // SQLite allows only outside a transaction; every key is checked
        // afterwards.
        let mut conn = self.writer.acquire().await?;
        sqlx::query(sql::schema::FOREIGN_KEYS_OFF).execute(&mut *conn).await?;
        let ran = MIGRATOR.run_direct(&mut *conn).await;
        let broken: Vec<String> = sqlx::query_scalar(sql::schema::FOREIGN_KEY_VIOLATIONS)
            .fetch_all(&mut *conn)
            .await?;
        sqlx::query(sql::schema::FOREIGN_KEYS_ON).execute(&mut *conn).await?;
        ran?;
        if let Some(table) = broken.first() {
            return Err(QueueError::Corrupt {
                id: 0,
                column: "foreign key",
                value: format!("table {table} references rows that no longer exist after migrating"),
            });
        }
        Ok(())
    }

    async fn subscribe(&self) -> Result<Option<Box<dyn Subscription>>, QueueError> {
        watch::subscribe(&self.watch_options, self.watch).await
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

    async fn ops_horizon(_conn: &mut Conn, _outbox: &str) -> Result<i64, QueueError> {
        // `BEGIN IMMEDIATE`: ids are taken and committed in one order.
        Ok(i64::MAX)
    }

    async fn bound_lock_waits(&self, _conn: &mut Conn) -> Result<(), QueueError> {
        // The file's one write lock waits `busy_timeout_ms`, set per connection.
        Ok(())
    }

    async fn contended(_conn: &mut Conn, _lanes: &[String]) -> Result<HashSet<String>, QueueError> {
        // `BEGIN IMMEDIATE` serialises every claim on the file.
        Ok(HashSet::new())
    }

    async fn settle(conn: &mut Conn, completions: &[Completion], now: DateTime<Utc>) -> Result<Vec<Cas>, QueueError> {
        settle::settle(conn, completions, now).await
    }

    fn parse_cursor(cursor: &str) -> Option<(i64, i64)> {
        // One writer: the sequence alone is the commit order.
        cursor.parse().ok().map(|seq| (0, seq))
    }

    fn cursor(_xid: i64, seq: i64) -> String {
        seq.to_string()
    }
}
