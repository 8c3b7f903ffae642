//! Wake-ups from commits by other processes (SQLite has no `NOTIFY`).
//!
//! Every `every`, the watcher looks at the write-ahead log's size and
//! modification time (a `stat`, which every commit changes); only when they
//! moved does it ask SQLite for `PRAGMA data_version` and, when that moved
//! too, read the outboxes' insert counters (`outbox_wakeups`, bumped by a
//! trigger on `ops`). An idle host so costs a system call per look, not a
//! query.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};
use sqlx::ConnectOptions as _;

use super::sql;
use crate::queue::{QueueError, Subscription};

/// Every this many looks the watcher asks SQLite even when the log's stat
/// did not move (20 looks: 100 ms at the default `watch_ms`).
const ASK_ANYWAY: u32 = 20;

struct Watcher {
    conn: SqliteConnection,
    wal: PathBuf,
    wal_seen: Option<(u64, SystemTime)>,
    version: i64,
    seqs: HashMap<String, i64>,
    ready: VecDeque<String>,
    every: Duration,
    /// Looks so far, for the periodic look that ignores the stat.
    looks: u32,
}

/// A watcher on its own connection (`PRAGMA data_version` changes when
/// another connection commits, so a pooled one could miss the change), or
/// `None` when `every` is zero.
pub async fn subscribe(
    options: &SqliteConnectOptions,
    every: Duration,
) -> Result<Option<Box<dyn Subscription>>, QueueError> {
    if every.is_zero() {
        return Ok(None);
    }
    let mut conn = options.connect().await?;
    let version = data_version(&mut conn).await?;
    let seqs = wakeup_counters(&mut conn).await?.into_iter().collect();
    let mut wal = options.get_filename().as_os_str().to_owned();
    wal.push("-wal");
    Ok(Some(Box::new(Watcher {
        conn,
        wal: wal.into(),
        wal_seen: None,
        version,
        seqs,
        ready: VecDeque::new(),
        every,
        looks: 0,
    })))
}

impl Watcher {
    /// The log's size and modification time; `None` when it cannot be read
    /// (then the watcher asks SQLite every time).
    fn wal_state(&self) -> Option<(u64, SystemTime)> {
        let meta = std::fs::metadata(&self.wal).ok()?;
        Some((meta.len(), meta.modified().ok()?))
    }
}

#[async_trait]
impl Subscription for Watcher {
    async fn next(&mut self) -> Result<String, QueueError> {
        loop {
            if let Some(outbox) = self.ready.pop_front() {
                return Ok(outbox);
            }
            tokio::time::sleep(self.every).await;
            self.looks = self.looks.wrapping_add(1);
            let wal = self.wal_state();
            // The log's modification time is as coarse as the kernel's
            // clock tick, and a log that SQLite restarted keeps its size, so
            // two commits within one tick can leave the same stat: every
            // ASK_ANYWAY-th look asks SQLite whatever the stat says, which
            // bounds such a miss to that many looks.
            if wal.is_some() && wal == self.wal_seen && self.looks % ASK_ANYWAY != 0 {
                continue;
            }
            self.wal_seen = wal;
            let version = data_version(&mut self.conn).await?;
            if version == self.version {
                continue;
            }
            self.version = version;
            for (outbox, seq) in wakeup_counters(&mut self.conn).await? {
                if self.seqs.get(&outbox) != Some(&seq) {
                    self.seqs.insert(outbox.clone(), seq);
                    self.ready.push_back(outbox);
                }
            }
        }
    }
}

async fn data_version(conn: &mut SqliteConnection) -> Result<i64, QueueError> {
    Ok(sqlx::query_scalar(sql::schema::DATA_VERSION).fetch_one(conn).await?)
}

async fn wakeup_counters(conn: &mut SqliteConnection) -> Result<Vec<(String, i64)>, QueueError> {
    Ok(sqlx::query_as(sql::schema::WAKEUP_COUNTERS).fetch_all(conn).await?)
}
