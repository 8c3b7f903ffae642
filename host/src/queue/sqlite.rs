//! The embedded SQLite backend.
//!
//! One writer connection takes every write in a `BEGIN IMMEDIATE` transaction
//! (a deferred transaction that reads before it writes fails with
//! `SQLITE_BUSY` when another connection commits in between, whatever the
//! busy timeout); a separate read-only pool serves listings. WAL journal,
//! `synchronous=FULL` by default, `busy_timeout` set on every connection.
//! Enqueues by other processes wake a running host through a watcher of
//! `PRAGMA data_version` (see [`SqliteSubscription`]).
//! Timestamps are stored as Unix milliseconds.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::migrate::Migrator;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{ConnectOptions as _, QueryBuilder, Row, Sqlite, Transaction};

use super::common::{
    admit_claims, cas, check_versions, chrono_duration, due_outboxes_sql, expire_params, host_share,
    is_unique_violation, now_ms, parse_priority, parse_status, refusal, scan_from_sql, still_claimable, unsent_guard,
    validate_new_op, FinishParams, BOOK_COLUMNS,
};
use super::common::{
    api_key_name_taken, json_column, json_from_column, pause_scope, scopes_column, scopes_from_column, shared_payload,
};
use super::{
    new_token, Backend, BookRow, CandidateOp, Cas, ClaimRequest, Claimed, Completion, Depth, Enqueued, ExpireTo,
    Finish, HaltedSubject, HostShare, LaneHalt, LeaseSpec, Limits, NewOp, Occupant, OpFilter, Queue, QueueError,
    SlotLease, Subscription,
};
use super::{
    ApiKey, AuditEntry, Latency, NewApiKey, NewAuditEntry, OldestDue, OutcomeEntry, Pause, PauseScope, PruneQuery,
    QueueGauges, Tombstone,
};
use super::{DatabaseConfig, Synchronous};
use super::{Expect, Record};
use crate::clock::Clock;
use crate::lanes::LaneRules;
use crate::op::Status;
use crate::op::{truncate_error, Attempt, AttemptClass, AttemptRecord, Lease, Op, OpId, Priority, Transition};

static MIGRATOR: Migrator = sqlx::migrate!("../migrations/sqlite");

const OP_COLUMNS: &str = "id, outbox, kind, priority, lanes, payload, idempotency_key, coalesce_key, subject, \
     correlation_id, status, attempts, attempt_floor, fee_bumps, next_attempt_at, lease_owner, lease_token, \
     lease_until, receipt, last_error, created_at, updated_at, finished_at, payload_ref";

/// What the lane guard reads of an op.
const OCCUPANT_COLUMNS: &str =
    "id, outbox, kind, priority, lanes, status = 'submitted' AS in_flight, receipt IS NOT NULL AS in_doubt";

/// Ops that occupy their lanes (the `ops_occupying` partial index).
const OCCUPYING: &str = "(status = 'submitted' OR (status = 'pending' AND receipt IS NOT NULL))";

/// The SQLite queue.
#[derive(Debug, Clone)]
pub struct SqliteQueue {
    writer: SqlitePool,
    reader: SqlitePool,
    limits: Limits,
    clock: Arc<dyn Clock>,
    /// How the wake-up watcher connects, and how often it looks.
    watch_options: Arc<SqliteConnectOptions>,
    watch: Duration,
    /// The group committer's inbox (`None` in the committer's own copy).
    group: Option<Arc<tokio::sync::mpsc::UnboundedSender<Round>>>,
}

/// One drain round waiting for the group committer: what to settle and
/// claim, and where to send the result.
struct Round {
    completions: Vec<Completion>,
    ids: Vec<OpId>,
    /// Claims that depend on a settle of the round (see `settle_then_claim`).
    follows: Vec<(OpId, OpId)>,
    lease: LeaseSpec,
    rules: LaneRules,
    reply: tokio::sync::oneshot::Sender<RoundResult>,
}

/// What a round's settles and claim came to.
type RoundResult = Result<(Vec<Cas>, Vec<Claimed>), QueueError>;

/// Hands each round its share of a merged application: its settles in
/// order, and the claims of its own ids (an op is in one round only: one
/// drain per outbox, one round in flight per drain).
fn split_rounds(rounds: &[Round], settled: Vec<Cas>, claimed: Vec<Claimed>) -> Vec<RoundResult> {
    let mut owner: std::collections::HashMap<OpId, usize> = std::collections::HashMap::new();
    for (i, round) in rounds.iter().enumerate() {
        for id in &round.ids {
            owner.insert(*id, i);
        }
    }
    let mut claims: Vec<Vec<Claimed>> = rounds.iter().map(|_| Vec::new()).collect();
    for c in claimed {
        if let Some(list) = owner.get(&c.op.id).and_then(|i| claims.get_mut(*i)) {
            list.push(c);
        }
    }
    let mut settled = settled.into_iter();
    rounds
        .iter()
        .zip(claims)
        .map(|(round, claims)| Ok((settled.by_ref().take(round.completions.len()).collect(), claims)))
        .collect()
}

/// Most rounds one group commit takes.
const GROUP_MAX: usize = 64;

/// The group committer: SQLite has one writer, so the rounds of every drain
/// that arrive while a transaction runs are applied together in the next
/// one (each inside a savepoint of its own, so one round's failure is that
/// round's alone), and one commit serves them all.
async fn group_commit(queue: SqliteQueue, mut inbox: tokio::sync::mpsc::UnboundedReceiver<Round>) {
    let mut rounds: Vec<Round> = Vec::with_capacity(GROUP_MAX);
    while inbox.recv_many(&mut rounds, GROUP_MAX).await > 0 {
        let results = queue.apply_rounds(&rounds).await;
        for (round, result) in rounds.drain(..).zip(results) {
            // A drain that gave up waiting has nothing left to tell.
            let _ = round.reply.send(result);
        }
    }
}

/// Wake-ups from commits by other processes. Every `every`, the watcher
/// looks at the write-ahead log's size and modification time (a `stat`,
/// which every commit changes); only when they moved does it ask SQLite for
/// `PRAGMA data_version` and, when that moved too, read the outboxes'
/// insert counters (`outbox_wakeups`, bumped by a trigger on `ops`). An idle
/// host so costs a system call per look, not a query.
struct SqliteSubscription {
    conn: SqliteConnection,
    wal: std::path::PathBuf,
    wal_seen: Option<(u64, std::time::SystemTime)>,
    version: i64,
    seqs: std::collections::HashMap<String, i64>,
    ready: std::collections::VecDeque<String>,
    every: Duration,
    /// Looks so far, for the periodic look that ignores the stat.
    looks: u32,
}

/// Every this many looks the watcher asks SQLite even when the log's stat
/// did not move (20 looks: 100 ms at the default `watch_ms`).
const ASK_ANYWAY: u32 = 20;

impl SqliteSubscription {
    /// The log's size and modification time; `None` when it cannot be read
    /// (then the watcher asks SQLite every time).
    fn wal_state(&self) -> Option<(u64, std::time::SystemTime)> {
        let meta = std::fs::metadata(&self.wal).ok()?;
        Some((meta.len(), meta.modified().ok()?))
    }
}

#[async_trait]
impl Subscription for SqliteSubscription {
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
    Ok(sqlx::query_scalar("PRAGMA data_version").fetch_one(conn).await?)
}

async fn wakeup_counters(conn: &mut SqliteConnection) -> Result<Vec<(String, i64)>, QueueError> {
    Ok(sqlx::query_as("SELECT outbox, seq FROM outbox_wakeups")
        .fetch_all(conn)
        .await?)
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
                super::redact_url(url)
            )));
        }
        let unreachable = |source| QueueError::Unreachable {
            url: super::redact_url(url),
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
            .connect_with(writer_options)
            .await
            .map_err(unreachable)?;
        let watch_options = Arc::new(base.clone().read_only(true));
        let reader = SqlitePoolOptions::new()
            .max_connections(config.max_connections)
            .acquire_timeout(acquire)
            .connect_with(base.read_only(true))
            .await
            .map_err(unreachable)?;
        let mut queue = Self {
            writer,
            reader,
            limits,
            clock,
            watch_options,
            watch: Duration::from_millis(config.sqlite.watch_ms),
            group: None,
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(group_commit(queue.clone(), rx));
        queue.group = Some(Arc::new(tx));
        Ok(queue)
    }

    /// The writer pool (one connection), for callers that keep their own
    /// business tables in the same database file.
    pub fn pool(&self) -> &SqlitePool {
        &self.writer
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
        Ok(self.writer.begin_with("BEGIN IMMEDIATE").await?)
    }

    /// Enqueues ops on the caller's connection, inside whatever transaction
    /// the caller has open: they commit or roll back with it.
    ///
    /// # Errors
    ///
    /// [`QueueError::InvalidOp`] (nothing written) or a database error.
    pub async fn enqueue_in(&self, conn: &mut SqliteConnection, ops: &[NewOp]) -> Result<Vec<Enqueued>, QueueError> {
        let checked = ops
            .iter()
            .map(|op| validate_new_op(op, self.limits))
            .collect::<Result<Vec<_>, _>>()?;
        let now = now_ms(self.clock.as_ref());
        let mut results = Vec::with_capacity(checked.len());
        for op in &checked {
            results.push(insert_one(conn, op, now, self.limits.shared_payload_bytes).await?);
        }
        Ok(results)
    }

    async fn write(&self) -> Result<Transaction<'static, Sqlite>, QueueError> {
        self.begin().await
    }

    fn now(&self) -> DateTime<Utc> {
        now_ms(self.clock.as_ref())
    }

    async fn claim_where(
        &self,
        lease: &LeaseSpec,
        filter: impl FnOnce(&mut QueryBuilder<'_, Sqlite>, i64),
    ) -> Result<Vec<Claimed>, QueueError> {
        let mut tx = self.write().await?;
        let claimed = self.claim_in(&mut tx, lease, filter).await?;
        tx.commit().await?;
        Ok(claimed)
    }

    /// Claims the pending, due ops `filter` selects, inside `conn`'s
    /// transaction.
    async fn claim_in(
        &self,
        conn: &mut SqliteConnection,
        lease: &LeaseSpec,
        filter: impl FnOnce(&mut QueryBuilder<'_, Sqlite>, i64),
    ) -> Result<Vec<Claimed>, QueueError> {
        let now = self.now();
        let token = new_token();
        let until = now + chrono_duration(lease.duration);
        let mut q = QueryBuilder::<Sqlite>::new("UPDATE ops SET status = ");
        q.push_bind(Transition::Claim.to().as_str())
            .push(", attempts = attempts + 1, lease_owner = ")
            .push_bind(lease.owner.clone())
            .push(", lease_token = ")
            .push_bind(token.to_string())
            .push(", lease_until = ")
            .push_bind(ms(until))
            .push(", updated_at = ")
            .push_bind(ms(now))
            .push(" WHERE status = ")
            .push_bind(Transition::Claim.from().as_str())
            .push(" AND next_attempt_at <= ")
            .push_bind(ms(now))
            .push(" AND id IN (");
        filter(&mut q, ms(now));
        q.push(") RETURNING ").push(OP_COLUMNS);
        let rows = q.build().fetch_all(&mut *conn).await?;
        let mut claimed = rows
            .iter()
            .map(op_from_row)
            .map(|op| {
                op.map(|op| Claimed {
                    lease: Lease {
                        op_id: op.id,
                        attempt: op.attempts,
                        token,
                    },
                    op,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        resolve_payloads(&mut *conn, claimed.iter_mut().map(|c| &mut c.op)).await?;
        // RETURNING gives no order; callers get dispatch order.
        claimed.sort_by_key(|c| (c.op.priority, c.op.id));
        Ok(claimed)
    }

    /// Settles finished attempts inside `tx`, each a compare-and-set on its
    /// lease: one statement for the batch's updates and one for its attempt
    /// rows, whatever its size (the batch travels as one JSON parameter, so
    /// the cost per settle is SQLite's, not a statement's round trip).
    async fn complete_in(&self, tx: &mut SqliteConnection, completions: &[Completion]) -> Result<Vec<Cas>, QueueError> {
        if completions.is_empty() {
            return Ok(Vec::new());
        }
        let now = self.now();
        let ids: std::collections::HashSet<OpId> = completions.iter().map(|c| c.lease.op_id).collect();
        if ids.len() < completions.len() {
            // One op twice (a stale settle beside the current one): settle
            // one at a time, so each is matched to its own lease.
            let mut out = Vec::with_capacity(completions.len());
            for c in completions {
                out.extend(self.settle_batch(tx, std::slice::from_ref(c), now).await?);
            }
            return Ok(out);
        }
        self.settle_batch(tx, completions, now).await
    }

    /// Settles completions of distinct ops in two statements.
    async fn settle_batch(
        &self,
        tx: &mut SqliteConnection,
        completions: &[Completion],
        now: DateTime<Utc>,
    ) -> Result<Vec<Cas>, QueueError> {
        let rows: Vec<serde_json::Value> = completions
            .iter()
            .map(|c| {
                let p = FinishParams::of(&c.finish);
                serde_json::json!({
                    "id": c.lease.op_id,
                    "attempt": c.lease.attempt,
                    "token": c.lease.token.to_string(),
                    "from": p.transition.from().as_str(),
                    "to": p.transition.to().as_str(),
                    "clear": i32::from(p.clear_receipt),
                    "receipt": p.receipt,
                    "error": p.error,
                    "next_at": p.next_attempt_at.map(ms),
                    "bump": p.fee_bump,
                    "finished_at": p.transition.to().is_terminal().then_some(ms(now)),
                })
            })
            .collect();
        let input = serde_json::Value::Array(rows).to_string();
        let applied: std::collections::HashSet<OpId> = sqlx::query_scalar(
            "UPDATE ops SET status = i.to_status, \
                 receipt = CASE WHEN i.clear THEN NULL ELSE COALESCE(i.receipt, ops.receipt) END, \
                 last_error = COALESCE(i.error, ops.last_error), \
                 next_attempt_at = COALESCE(i.next_at, ops.next_attempt_at), fee_bumps = ops.fee_bumps + i.bump, \
                 lease_owner = NULL, lease_token = NULL, lease_until = NULL, updated_at = ?2, \
                 finished_at = i.finished_at \
             FROM (SELECT value ->> '$.id' AS id, value ->> '$.attempt' AS attempt, value ->> '$.token' AS token, \
                     value ->> '$.from' AS from_status, value ->> '$.to' AS to_status, value ->> '$.clear' AS clear, \
                     value ->> '$.receipt' AS receipt, value ->> '$.error' AS error, \
                     value ->> '$.next_at' AS next_at, value ->> '$.bump' AS bump, \
                     value ->> '$.finished_at' AS finished_at \
                   FROM json_each(?1)) AS i \
             WHERE ops.id = i.id AND ops.status = i.from_status AND ops.attempts = i.attempt \
                 AND ops.lease_token = i.token \
             RETURNING ops.id",
        )
        .bind(&input)
        .bind(ms(now))
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .collect();
        let attempts: Vec<serde_json::Value> = completions
            .iter()
            .filter(|c| applied.contains(&c.lease.op_id))
            .map(|c| {
                let r = &c.attempt;
                serde_json::json!({
                    "op_id": c.lease.op_id,
                    "attempt": c.lease.attempt,
                    "started_at": ms(r.started_at),
                    "finished_at": ms(r.finished_at),
                    "outcome": r.class.as_str(),
                    "detail": r.detail,
                    "fee": r.fee,
                    "error": r.error.as_deref().map(truncate_error),
                })
            })
            .collect();
        if !attempts.is_empty() {
            sqlx::query(
                "INSERT INTO attempts (op_id, attempt, started_at, finished_at, outcome, detail, fee, error) \
                 SELECT value ->> '$.op_id', value ->> '$.attempt', value ->> '$.started_at', \
                     value ->> '$.finished_at', value ->> '$.outcome', value ->> '$.detail', value ->> '$.fee', \
                     value ->> '$.error' \
                 FROM json_each(?)",
            )
            .bind(serde_json::Value::Array(attempts).to_string())
            .execute(&mut *tx)
            .await?;
        }
        let mut out = Vec::with_capacity(completions.len());
        for c in completions {
            let done = applied.contains(&c.lease.op_id);
            if done && matches!(c.finish, Finish::Fail { halt_lanes: true, .. }) {
                halt_lanes(&mut *tx, c.lease.op_id, now).await?;
            }
            out.push(if done { Cas::Applied } else { Cas::Stale });
        }
        Ok(out)
    }

    /// Claims those of `ids` that are still pending and due and whose lanes
    /// admit them (the lane rule against every occupant), inside `tx`.
    async fn claim_ids_in(
        &self,
        tx: &mut SqliteConnection,
        ids: &[OpId],
        lease: &LeaseSpec,
        rules: &LaneRules,
    ) -> Result<Vec<Claimed>, QueueError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut q = QueryBuilder::<Sqlite>::new(format!(
            "SELECT {OCCUPANT_COLUMNS} FROM ops WHERE status = 'pending' AND next_attempt_at <= "
        ));
        q.push_bind(ms(self.now())).push(" AND id IN (");
        let mut sep = q.separated(", ");
        for id in ids {
            sep.push_bind(*id);
        }
        q.push(")");
        let picked = q
            .build()
            .fetch_all(&mut *tx)
            .await?
            .iter()
            .map(occupant_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        let lanes: Vec<String> = picked.iter().flat_map(|o| o.lanes.iter().cloned()).collect();
        let occupants = occupants_in(&mut *tx, &lanes).await?;
        let admitted = admit_claims(&picked, &occupants, rules, &std::collections::HashSet::new());
        if admitted.is_empty() {
            return Ok(Vec::new());
        }
        self.claim_in(tx, lease, move |q, _| {
            let mut sep = q.separated(", ");
            for id in admitted {
                sep.push_bind(id);
            }
        })
        .await
    }

    /// Applies rounds in one transaction. BEGIN IMMEDIATE serializes every
    /// writer of the file, in this process and others, so the occupants a
    /// claim reads cannot change before it commits.
    ///
    /// The rounds are first applied as one: one settle statement for all
    /// their completions, one claim for all their ids (one lane check over
    /// every op they pick, so ops of different outboxes that exclude each
    /// other are admitted in dispatch order, as the scheduler would). The
    /// statements per commit are then the same for one round as for sixty,
    /// which is what a single writer's throughput depends on. If that fails,
    /// it is rolled back and each round is applied in a savepoint of its
    /// own, so one round's failure is that round's alone. If a savepoint
    /// itself cannot be used (SQLite rolled the whole transaction back, as
    /// it does on I/O errors), no later round runs and nothing is committed,
    /// so no round is reported failed while its changes stand.
    async fn apply_rounds(&self, rounds: &[Round]) -> Vec<RoundResult> {
        let failed = |e: &QueueError| QueueError::Database(sqlx::Error::Protocol(format!("group commit: {e}")));
        let fail_all = |e: &QueueError| rounds.iter().map(|_| Err(failed(e))).collect::<Vec<_>>();
        let mut tx = match self.write().await {
            Ok(tx) => tx,
            Err(e) => return fail_all(&e),
        };
        let results = match self.apply_merged(&mut tx, rounds).await {
            Ok(Some(results)) => results,
            Ok(None) => {
                let mut results = Vec::with_capacity(rounds.len());
                for round in rounds {
                    match self.apply_round(&mut tx, round).await {
                        Ok(result) => results.push(result),
                        Err(e) => return fail_all(&e),
                    }
                }
                results
            }
            Err(e) => return fail_all(&e),
        };
        if let Err(e) = tx.commit().await {
            return fail_all(&QueueError::from(e));
        }
        results
    }

    /// The rounds applied as one inside a savepoint: their results, or
    /// `None` when they cannot be (they claim under different leases or
    /// rules, or a statement failed and was rolled back), or an error of
    /// the savepoint itself, which leaves the transaction unusable.
    async fn apply_merged(
        &self,
        tx: &mut SqliteConnection,
        rounds: &[Round],
    ) -> Result<Option<Vec<RoundResult>>, QueueError> {
        let Some(first) = rounds.first() else {
            return Ok(Some(Vec::new()));
        };
        if rounds.len() == 1 {
            return Ok(None);
        }
        if rounds.iter().any(|r| r.lease != first.lease || r.rules != first.rules) {
            return Ok(None);
        }
        let completions: Vec<Completion> = rounds.iter().flat_map(|r| r.completions.iter().cloned()).collect();
        let ids: Vec<OpId> = rounds.iter().flat_map(|r| r.ids.iter().copied()).collect();
        let follows: Vec<(OpId, OpId)> = rounds.iter().flat_map(|r| r.follows.iter().copied()).collect();
        sqlx::query("SAVEPOINT rounds").execute(&mut *tx).await?;
        let applied = self
            .settle_then_claim_in(&mut *tx, &completions, &ids, &follows, &first.lease, &first.rules)
            .await;
        let Ok((settled, claimed)) = applied else {
            sqlx::query("ROLLBACK TO rounds").execute(&mut *tx).await?;
            sqlx::query("RELEASE rounds").execute(&mut *tx).await?;
            return Ok(None);
        };
        sqlx::query("RELEASE rounds").execute(&mut *tx).await?;
        Ok(Some(split_rounds(rounds, settled, claimed)))
    }

    /// Settles, then claims what is still claimable, inside `tx`: the body
    /// of [`Queue::settle_then_claim`], for one round or several as one.
    async fn settle_then_claim_in(
        &self,
        tx: &mut SqliteConnection,
        completions: &[Completion],
        ids: &[OpId],
        follows: &[(OpId, OpId)],
        lease: &LeaseSpec,
        rules: &LaneRules,
    ) -> RoundResult {
        let settled = self.complete_in(&mut *tx, completions).await?;
        let ids = still_claimable(ids, follows, completions, &settled);
        let claimed = self.claim_ids_in(&mut *tx, &ids, lease, rules).await?;
        Ok((settled, claimed))
    }

    /// One round inside its savepoint: the round's own result, or an error
    /// of the savepoint itself, which leaves the transaction unusable.
    async fn apply_round(&self, tx: &mut SqliteConnection, round: &Round) -> Result<RoundResult, QueueError> {
        sqlx::query("SAVEPOINT round").execute(&mut *tx).await?;
        let applied = self
            .settle_then_claim_in(
                &mut *tx,
                &round.completions,
                &round.ids,
                &round.follows,
                &round.lease,
                &round.rules,
            )
            .await;
        if applied.is_err() {
            sqlx::query("ROLLBACK TO round").execute(&mut *tx).await?;
        }
        sqlx::query("RELEASE round").execute(&mut *tx).await?;
        Ok(applied)
    }

    /// Applies a compare-and-set update to each lease in one transaction.
    async fn cas_each(
        &self,
        leases: &[Lease],
        set: &str,
        bind: impl Fn(&Lease) -> Vec<SqlValue>,
    ) -> Result<Vec<Cas>, QueueError> {
        let sql =
            format!("UPDATE ops SET {set} WHERE id = ? AND status = 'submitted' AND attempts = ? AND lease_token = ?");
        let mut tx = self.write().await?;
        let mut out = Vec::with_capacity(leases.len());
        for lease in leases {
            let mut query = sqlx::query(&sql);
            for value in bind(lease) {
                query = match value {
                    SqlValue::Int(v) => query.bind(v),
                    SqlValue::Text(v) => query.bind(v),
                };
            }
            let done = query
                .bind(lease.op_id)
                .bind(lease.attempt)
                .bind(lease.token.to_string())
                .execute(&mut *tx)
                .await?;
            out.push(cas(done.rows_affected()));
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn operator_change(
        &self,
        id: OpId,
        transition: Transition,
        set: &str,
        now: DateTime<Utc>,
        after: Option<&str>,
    ) -> Result<Op, QueueError> {
        let mut tx = self.write().await?;
        // Numbered parameters: ?1 status, ?2 now, ?3 id, ?4 expected status.
        let sql = format!(
            "UPDATE ops SET status = ?1, {set} WHERE id = ?3 AND status = ?4{} RETURNING {OP_COLUMNS}",
            unsent_guard(transition)
        );
        let row = sqlx::query(&sql)
            .bind(transition.to().as_str())
            .bind(ms(now))
            .bind(id)
            .bind(transition.from().as_str())
            .fetch_optional(&mut *tx)
            .await;
        let row = match row {
            Ok(row) => row,
            Err(e) if is_unique_violation(&e) => {
                return Err(QueueError::Conflict {
                    id,
                    message: "another op with the same coalesce key is pending in this outbox".to_owned(),
                })
            }
            Err(e) => return Err(e.into()),
        };
        match row {
            Some(row) => {
                let mut op = op_from_row(&row)?;
                resolve_payloads(&mut *tx, [&mut op]).await?;
                if let Some(after) = after {
                    sqlx::query(after).bind(id).execute(&mut *tx).await?;
                }
                tx.commit().await?;
                Ok(op)
            }
            None => {
                let found: Option<(String, bool)> =
                    sqlx::query_as("SELECT status, receipt IS NOT NULL FROM ops WHERE id = ?")
                        .bind(id)
                        .fetch_optional(&mut *tx)
                        .await?;
                tx.rollback().await?;
                Err(refusal(id, found.as_ref().map(|(s, d)| (s.as_str(), *d)), transition))
            }
        }
    }
}

/// A bind value for the generic CAS helper.
enum SqlValue {
    Int(i64),
    Text(Option<String>),
}

async fn insert_one(
    conn: &mut SqliteConnection,
    op: &NewOp,
    now: DateTime<Utc>,
    shared_from: usize,
) -> Result<Enqueued, QueueError> {
    let lanes = serde_json::to_string(&op.lanes).map_err(|e| QueueError::InvalidOp(e.to_string()))?;
    let due = op.not_before.map_or(now, |t| t.max(now));
    let (payload, payload_ref) = match shared_payload(&op.payload, shared_from) {
        Some(hash) => {
            sqlx::query("INSERT INTO payloads (hash, body) VALUES (?, ?) ON CONFLICT DO NOTHING")
                .bind(&hash)
                .bind(&op.payload)
                .execute(&mut *conn)
                .await?;
            ("null", Some(hash))
        }
        None => (op.payload.as_str(), None),
    };
    // A conflicting op can reach a terminal state between the insert and the
    // look-up that explains the conflict; then the insert is simply retried.
    for _ in 0..3 {
        let inserted: Option<i64> = sqlx::query_scalar(
            "INSERT INTO ops (outbox, kind, priority, lanes, payload, idempotency_key, coalesce_key, subject, \
             correlation_id, next_attempt_at, created_at, updated_at, payload_ref) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING RETURNING id",
        )
        .bind(&op.outbox)
        .bind(&op.kind)
        .bind(op.priority.rank())
        .bind(&lanes)
        .bind(payload)
        .bind(&op.idempotency_key)
        .bind(&op.coalesce_key)
        .bind(&op.subject)
        .bind(&op.correlation_id)
        .bind(ms(due))
        .bind(ms(now))
        .bind(ms(now))
        .bind(&payload_ref)
        .fetch_optional(&mut *conn)
        .await?;
        if let Some(id) = inserted {
            return Ok(Enqueued::Created(id));
        }
        if let Some(key) = &op.idempotency_key {
            let existing: Option<i64> =
                sqlx::query_scalar("SELECT id FROM ops WHERE outbox = ? AND idempotency_key = ?")
                    .bind(&op.outbox)
                    .bind(key)
                    .fetch_optional(&mut *conn)
                    .await?;
            if let Some(id) = existing {
                return Ok(Enqueued::Existing(id));
            }
            // Its op was pruned: the tombstone's trigger skipped the insert.
            let pruned: Option<i64> =
                sqlx::query_scalar("SELECT op_id FROM idempotency_tombstones WHERE outbox = ? AND idempotency_key = ?")
                    .bind(&op.outbox)
                    .bind(key)
                    .fetch_optional(&mut *conn)
                    .await?;
            if let Some(id) = pruned {
                return Ok(Enqueued::Existing(id));
            }
        }
        if let Some(key) = &op.coalesce_key {
            let pending: Option<i64> = sqlx::query_scalar(
                "SELECT id FROM ops WHERE outbox = ? AND coalesce_key = ? AND status IN ('pending', 'submitted')",
            )
            .bind(&op.outbox)
            .bind(key)
            .fetch_optional(&mut *conn)
            .await?;
            if let Some(id) = pending {
                return Ok(Enqueued::AlreadyPending(id));
            }
        }
    }
    Err(QueueError::Conflict {
        id: 0,
        message: "enqueue kept conflicting with concurrent changes; try again".to_owned(),
    })
}

#[async_trait]
impl Queue for SqliteQueue {
    fn backend(&self) -> Backend {
        Backend::Sqlite
    }

    async fn migrate(&self) -> Result<(), QueueError> {
        // A migration that rebuilds a table (SQLite cannot alter a column in
        // place) must run with foreign-key enforcement off, which SQLite only
        // allows outside a transaction; every key is checked afterwards.
        let mut conn = self.writer.acquire().await?;
        sqlx::query("PRAGMA foreign_keys = OFF").execute(&mut *conn).await?;
        let ran = MIGRATOR.run_direct(&mut *conn).await;
        let broken: Vec<(String,)> = sqlx::query_as("SELECT \"table\" FROM pragma_foreign_key_check")
            .fetch_all(&mut *conn)
            .await?;
        sqlx::query("PRAGMA foreign_keys = ON").execute(&mut *conn).await?;
        ran?;
        if let Some((table,)) = broken.first() {
            return Err(QueueError::Corrupt {
                id: 0,
                column: "foreign key",
                value: format!("table {table} references rows that no longer exist after migrating"),
            });
        }
        Ok(())
    }

    async fn check_schema(&self) -> Result<(), QueueError> {
        let has_table: Option<String> =
            sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'")
                .fetch_optional(&self.reader)
                .await?;
        let applied: Vec<i64> = if has_table.is_some() {
            sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
                .fetch_all(&self.reader)
                .await?
        } else {
            Vec::new()
        };
        let known: Vec<i64> = MIGRATOR.iter().map(|m| m.version).collect();
        check_versions(&applied, &known)
    }

    async fn enqueue(&self, ops: &[NewOp]) -> Result<Vec<Enqueued>, QueueError> {
        let mut tx = self.write().await?;
        let results = self.enqueue_in(&mut tx, ops).await?;
        tx.commit().await?;
        Ok(results)
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Claimed>, QueueError> {
        let outbox = request.outbox.clone();
        let kinds = request.kinds.clone();
        let limit = i64::from(request.limit);
        self.claim_where(&request.lease, move |q, now| {
            q.push("SELECT id FROM ops WHERE status = 'pending' AND next_attempt_at <= ")
                .push_bind(now);
            if let Some(outbox) = outbox {
                q.push(" AND outbox = ").push_bind(outbox);
            }
            if let Some(kinds) = kinds {
                q.push(" AND kind IN (");
                let mut sep = q.separated(", ");
                for kind in kinds {
                    sep.push_bind(kind);
                }
                q.push(")");
            }
            q.push(" ORDER BY priority, id LIMIT ").push_bind(limit);
        })
        .await
    }

    async fn settle_then_claim(
        &self,
        completions: &[Completion],
        ids: &[OpId],
        follows: &[(OpId, OpId)],
        lease: &LeaseSpec,
        rules: &LaneRules,
    ) -> Result<(Vec<Cas>, Vec<Claimed>), QueueError> {
        if completions.is_empty() && ids.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let Some(group) = &self.group else {
            return Err(QueueError::Database(sqlx::Error::PoolClosed));
        };
        let (reply, answer) = tokio::sync::oneshot::channel();
        let round = Round {
            completions: completions.to_vec(),
            ids: ids.to_vec(),
            follows: follows.to_vec(),
            lease: lease.clone(),
            rules: rules.clone(),
            reply,
        };
        group
            .send(round)
            .map_err(|_| QueueError::Database(sqlx::Error::PoolClosed))?;
        answer
            .await
            .map_err(|_| QueueError::Database(sqlx::Error::PoolClosed))?
    }

    async fn occupants(&self, lanes: &[String]) -> Result<Vec<Occupant>, QueueError> {
        let mut conn = self.reader.acquire().await?;
        occupants_in(&mut conn, lanes).await
    }

    async fn complete(&self, completions: &[Completion]) -> Result<Vec<Cas>, QueueError> {
        let mut tx = self.write().await?;
        let settled = self.complete_in(&mut tx, completions).await?;
        tx.commit().await?;
        Ok(settled)
    }

    async fn checkpoint(&self, lease: &Lease, receipt: &str) -> Result<Cas, QueueError> {
        let now = ms(self.now());
        let receipt = receipt.to_owned();
        let results = self
            .cas_each(std::slice::from_ref(lease), "receipt = ?, updated_at = ?", |_| {
                vec![SqlValue::Text(Some(receipt.clone())), SqlValue::Int(now)]
            })
            .await?;
        Ok(results.first().copied().unwrap_or(Cas::Stale))
    }

    async fn extend_leases(&self, leases: &[Lease], duration: Duration) -> Result<Vec<Cas>, QueueError> {
        let now = self.now();
        let until = ms(now + chrono_duration(duration));
        self.cas_each(leases, "lease_until = ?", |_| vec![SqlValue::Int(until)])
            .await
    }

    async fn release(&self, leases: &[Lease]) -> Result<Vec<Cas>, QueueError> {
        let now = ms(self.now());
        let set = format!(
            "status = '{}', attempts = attempts - 1, lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
             updated_at = ?",
            Transition::Release.to()
        );
        self.cas_each(leases, &set, |_| vec![SqlValue::Int(now)]).await
    }

    async fn expired_leases(&self, limit: u32) -> Result<Vec<Claimed>, QueueError> {
        let now = self.now();
        let rows = sqlx::query(&format!(
            "SELECT {OP_COLUMNS} FROM ops WHERE status = 'submitted' AND lease_until < ? ORDER BY lease_until LIMIT ?"
        ))
        .bind(ms(now))
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await?;
        let mut claimed: Vec<Claimed> = rows
            .iter()
            .map(op_from_row)
            .filter_map(|op| match op {
                Ok(op) => op.lease().map(|lease| Ok(Claimed { op, lease })),
                Err(e) => Some(Err(e)),
            })
            .collect::<Result<_, QueueError>>()?;
        resolve_payloads(&self.reader, claimed.iter_mut().map(|c| &mut c.op)).await?;
        Ok(claimed)
    }

    async fn expire(&self, lease: &Lease, to: ExpireTo) -> Result<Cas, QueueError> {
        let now = self.now();
        let (transition, next_attempt_at, halt) = expire_params(to, now);
        let mut tx = self.write().await?;
        // Record the attempt first, while the row still shows when it was claimed.
        let recorded = sqlx::query(
            "INSERT INTO attempts (op_id, attempt, started_at, finished_at, outcome, error) \
             SELECT id, attempts, updated_at, ?, 'lease_expired', 'lease held by ' || COALESCE(lease_owner, '?') || ' expired' \
             FROM ops WHERE id = ? AND status = 'submitted' AND attempts = ? AND lease_token = ?",
        )
        .bind(ms(now))
        .bind(lease.op_id)
        .bind(lease.attempt)
        .bind(lease.token.to_string())
        .execute(&mut *tx)
        .await?;
        if recorded.rows_affected() == 0 {
            tx.rollback().await?;
            return Ok(Cas::Stale);
        }
        let finished_at = transition.to().is_terminal().then_some(ms(now));
        sqlx::query(
            "UPDATE ops SET status = ?, next_attempt_at = ?, last_error = 'lease expired', lease_owner = NULL, \
             lease_token = NULL, lease_until = NULL, updated_at = ?, finished_at = ? WHERE id = ?",
        )
        .bind(transition.to().as_str())
        .bind(ms(next_attempt_at))
        .bind(ms(now))
        .bind(finished_at)
        .bind(lease.op_id)
        .execute(&mut *tx)
        .await?;
        if halt {
            halt_lanes(&mut tx, lease.op_id, now).await?;
        }
        tx.commit().await?;
        Ok(Cas::Applied)
    }

    async fn cancel(&self, id: OpId) -> Result<Op, QueueError> {
        let now = self.now();
        self.operator_change(id, Transition::Cancel, "updated_at = ?2, finished_at = ?2", now, None)
            .await
    }

    async fn force_retry(&self, id: OpId) -> Result<Op, QueueError> {
        let now = self.now();
        self.operator_change(
            id,
            Transition::ForceRetry,
            "attempt_floor = attempts, next_attempt_at = ?2, updated_at = ?2, finished_at = NULL",
            now,
            // A retried dead letter goes back to being its lanes' head, so
            // any hold it placed on them is no longer needed.
            Some("DELETE FROM lane_halts WHERE op_id = ?"),
        )
        .await
    }

    async fn get(&self, id: OpId) -> Result<Option<Op>, QueueError> {
        let row = sqlx::query(&format!("SELECT {OP_COLUMNS} FROM ops WHERE id = ?"))
            .bind(id)
            .fetch_optional(&self.reader)
            .await?;
        let mut op = row.as_ref().map(op_from_row).transpose()?;
        resolve_payloads(&self.reader, op.iter_mut()).await?;
        Ok(op)
    }

    async fn attempts(&self, id: OpId) -> Result<Vec<Attempt>, QueueError> {
        let rows = sqlx::query(
            "SELECT op_id, attempt, started_at, finished_at, outcome, detail, fee, error FROM attempts \
             WHERE op_id = ? ORDER BY attempt",
        )
        .bind(id)
        .fetch_all(&self.reader)
        .await?;
        rows.iter()
            .map(|row| {
                let op_id: i64 = row.try_get("op_id")?;
                let outcome: String = row.try_get("outcome")?;
                Ok(Attempt {
                    op_id,
                    attempt: row.try_get("attempt")?,
                    record: AttemptRecord {
                        started_at: from_ms(op_id, "started_at", row.try_get("started_at")?)?,
                        finished_at: from_ms(op_id, "finished_at", row.try_get("finished_at")?)?,
                        class: AttemptClass::parse(&outcome).ok_or(QueueError::Corrupt {
                            id: op_id,
                            column: "attempts.outcome",
                            value: outcome.clone(),
                        })?,
                        detail: row.try_get("detail")?,
                        fee: row.try_get("fee")?,
                        error: row.try_get("error")?,
                    },
                })
            })
            .collect()
    }

    async fn list(&self, filter: &OpFilter) -> Result<Vec<Op>, QueueError> {
        let mut q = QueryBuilder::<Sqlite>::new(format!("SELECT {OP_COLUMNS} FROM ops WHERE 1 = 1"));
        if let Some(status) = filter.status {
            q.push(" AND status = ").push_bind(status.as_str());
        }
        if let Some(kind) = &filter.kind {
            q.push(" AND kind = ").push_bind(kind.clone());
        }
        if let Some(priority) = filter.priority {
            q.push(" AND priority = ").push_bind(priority.rank());
        }
        if let Some(subject) = &filter.subject {
            q.push(" AND subject = ").push_bind(subject.clone());
        }
        if let Some(outbox) = &filter.outbox {
            q.push(" AND outbox = ").push_bind(outbox.clone());
        }
        if let Some(lane) = &filter.lane {
            q.push(" AND id IN (SELECT op_id FROM op_lanes WHERE lane = ")
                .push_bind(lane.clone())
                .push(")");
        }
        if let Some(correlation) = &filter.correlation_id {
            q.push(" AND correlation_id = ").push_bind(correlation.clone());
        }
        if let Some(t) = &filter.created_after {
            q.push(" AND created_at >= ").push_bind(ms(*t));
        }
        if let Some(t) = &filter.created_before {
            q.push(" AND created_at < ").push_bind(ms(*t));
        }
        if let Some(after) = filter.after_id {
            if filter.newest_first {
                q.push(" AND id < ").push_bind(after);
            } else {
                q.push(" AND id > ").push_bind(after);
            }
        }
        q.push(if filter.newest_first {
            " ORDER BY id DESC"
        } else {
            " ORDER BY id"
        });
        q.push(" LIMIT ").push_bind(i64::from(filter.limit));
        let rows = q.build().fetch_all(&self.reader).await?;
        let mut ops = rows.iter().map(op_from_row).collect::<Result<Vec<_>, _>>()?;
        resolve_payloads(&self.reader, ops.iter_mut()).await?;
        Ok(ops)
    }

    async fn depth(&self) -> Result<Vec<Depth>, QueueError> {
        let rows = sqlx::query(
            "SELECT status, priority, kind, COUNT(*) AS n FROM ops GROUP BY status, priority, kind \
             ORDER BY status, priority, kind",
        )
        .fetch_all(&self.reader)
        .await?;
        rows.iter()
            .map(|row| {
                let status: String = row.try_get("status")?;
                let priority: i64 = row.try_get("priority")?;
                Ok(Depth {
                    status: parse_status(0, &status)?,
                    priority: parse_priority(0, priority)?,
                    kind: row.try_get("kind")?,
                    count: row.try_get("n")?,
                })
            })
            .collect()
    }

    async fn candidates(&self, outbox: &str, limit: u32) -> Result<Vec<CandidateOp>, QueueError> {
        let columns = OP_COLUMNS
            .split(", ")
            .map(|c| format!("ops.{}", c.trim()))
            .collect::<Vec<_>>()
            .join(", ");
        let rows = sqlx::query(&format!(
            "SELECT {columns}, h.subject IS NOT NULL AS subject_halted FROM ops \
             LEFT JOIN halted_subjects h ON h.subject = ops.subject \
             WHERE ops.outbox = ? AND ops.status IN ('pending', 'submitted') ORDER BY ops.priority, ops.id LIMIT ?"
        ))
        .bind(outbox)
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await?;
        let mut candidates = rows
            .iter()
            .map(|row| {
                Ok(CandidateOp {
                    op: op_from_row(row)?,
                    subject_halted: row.try_get("subject_halted")?,
                })
            })
            .collect::<Result<Vec<_>, QueueError>>()?;
        resolve_payloads(&self.reader, candidates.iter_mut().map(|c| &mut c.op)).await?;
        Ok(candidates)
    }

    async fn scan(&self, outbox: &str, after: Option<OpId>, limit: u32) -> Result<Vec<BookRow>, QueueError> {
        // `priority IN (…)` lets the (outbox, priority, id) index seek each
        // tier at `after`, so a delta read never walks the backlog.
        let order = if after.is_some() {
            "AND priority IN (0, 1, 2) AND id > ?2 ORDER BY id"
        } else {
            "ORDER BY priority, id"
        };
        sqlx::query(&format!(
            "SELECT {BOOK_COLUMNS} FROM ops WHERE outbox = ?1 AND status IN ('pending', 'submitted') {order} LIMIT ?3"
        ))
        .bind(outbox)
        .bind(after.unwrap_or(0))
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await?
        .iter()
        .map(book_row)
        .collect()
    }

    async fn scan_from(&self, outbox: &str, from: (Priority, OpId), limit: u32) -> Result<Vec<BookRow>, QueueError> {
        sqlx::query(&scan_from_sql(from.0, "?1", "?2", "?3"))
            .bind(outbox)
            .bind(from.1)
            .bind(i64::from(limit))
            .fetch_all(&self.reader)
            .await?
            .iter()
            .map(book_row)
            .collect()
    }

    async fn due_outboxes(&self, limit: u32) -> Result<Vec<String>, QueueError> {
        Ok(sqlx::query_scalar(&due_outboxes_sql("?1", "?2"))
            .bind(ms(self.now()))
            .bind(i64::from(limit))
            .fetch_all(&self.reader)
            .await?)
    }

    async fn acquire_slot(&self, outbox: &str, owner: &str, ttl: Duration) -> Result<Option<SlotLease>, QueueError> {
        let now = self.now();
        let token = new_token();
        let mut tx = self.write().await?;
        let taken: Option<String> = sqlx::query_scalar(
            "INSERT INTO drain_slots (outbox, owner, token, lease_until) VALUES (?, ?, ?, ?) \
             ON CONFLICT (outbox) DO UPDATE SET owner = excluded.owner, token = excluded.token, \
             lease_until = excluded.lease_until WHERE drain_slots.lease_until < ? RETURNING token",
        )
        .bind(outbox)
        .bind(owner)
        .bind(token.to_string())
        .bind(ms(now + chrono_duration(ttl)))
        .bind(ms(now))
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(taken.map(|_| SlotLease {
            outbox: outbox.to_owned(),
            token,
        }))
    }

    async fn renew_slot(&self, slot: &SlotLease, ttl: Duration) -> Result<Cas, QueueError> {
        let until = ms(self.now() + chrono_duration(ttl));
        let mut tx = self.write().await?;
        let done = sqlx::query("UPDATE drain_slots SET lease_until = ? WHERE outbox = ? AND token = ?")
            .bind(until)
            .bind(&slot.outbox)
            .bind(slot.token.to_string())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(cas(done.rows_affected()))
    }

    async fn release_slot(&self, slot: &SlotLease) -> Result<(), QueueError> {
        let mut tx = self.write().await?;
        sqlx::query("DELETE FROM drain_slots WHERE outbox = ? AND token = ?")
            .bind(&slot.outbox)
            .bind(slot.token.to_string())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn heartbeat(&self, owner: &str, ttl: Duration) -> Result<HostShare, QueueError> {
        let now = ms(self.now());
        let mut tx = self.write().await?;
        sqlx::query(
            "INSERT INTO hosts (owner, seen_until) VALUES (?, ?) \
             ON CONFLICT (owner) DO UPDATE SET seen_until = excluded.seen_until",
        )
        .bind(owner)
        .bind(now + i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX / 2))
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM hosts WHERE seen_until < ?")
            .bind(now)
            .execute(&mut *tx)
            .await?;
        let (hosts, slots, mine): (i64, i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM hosts), \
                 (SELECT count(*) FROM drain_slots WHERE lease_until >= ?1), \
                 (SELECT count(*) FROM drain_slots WHERE lease_until >= ?1 AND owner = ?2)",
        )
        .bind(now)
        .bind(owner)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(host_share(hosts, slots, mine))
    }

    async fn lane_halts(&self, outbox: Option<&str>) -> Result<Vec<LaneHalt>, QueueError> {
        let rows = sqlx::query(
            "SELECT outbox, lane, op_id, halted_at FROM lane_halts WHERE ?1 IS NULL OR outbox = ?1 \
             ORDER BY outbox, lane, op_id",
        )
        .bind(outbox)
        .fetch_all(&self.reader)
        .await?;
        rows.iter()
            .map(|row| {
                let op_id: i64 = row.try_get("op_id")?;
                Ok(LaneHalt {
                    outbox: row.try_get("outbox")?,
                    lane: row.try_get("lane")?,
                    op_id,
                    halted_at: from_ms(op_id, "lane_halts.halted_at", row.try_get("halted_at")?)?,
                })
            })
            .collect()
    }

    async fn skip_lane(&self, outbox: &str, lane: &str) -> Result<u64, QueueError> {
        let mut tx = self.write().await?;
        let done = sqlx::query("DELETE FROM lane_halts WHERE outbox = ? AND lane = ?")
            .bind(outbox)
            .bind(lane)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    async fn defer(&self, id: OpId, until: DateTime<Utc>) -> Result<Cas, QueueError> {
        let mut tx = self.write().await?;
        let done =
            sqlx::query("UPDATE ops SET next_attempt_at = ?, updated_at = ? WHERE id = ? AND status = 'pending'")
                .bind(ms(until))
                .bind(ms(self.now()))
                .bind(id)
                .execute(&mut *tx)
                .await?;
        tx.commit().await?;
        Ok(if done.rows_affected() == 1 {
            Cas::Applied
        } else {
            Cas::Stale
        })
    }

    async fn halt_subject(&self, subject: &str, reason: Option<&str>) -> Result<(), QueueError> {
        let mut tx = self.write().await?;
        sqlx::query(
            "INSERT INTO halted_subjects (subject, reason, halted_at) VALUES (?, ?, ?) \
             ON CONFLICT (subject) DO UPDATE SET reason = excluded.reason",
        )
        .bind(subject)
        .bind(reason)
        .bind(ms(self.now()))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn unhalt_subject(&self, subject: &str) -> Result<bool, QueueError> {
        let mut tx = self.write().await?;
        let done = sqlx::query("DELETE FROM halted_subjects WHERE subject = ?")
            .bind(subject)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }

    async fn halted_subjects(&self) -> Result<Vec<HaltedSubject>, QueueError> {
        let rows = sqlx::query("SELECT subject, reason, halted_at FROM halted_subjects ORDER BY subject")
            .fetch_all(&self.reader)
            .await?;
        rows.iter()
            .map(|row| {
                Ok(HaltedSubject {
                    subject: row.try_get("subject")?,
                    reason: row.try_get("reason")?,
                    halted_at: from_ms(0, "halted_subjects.halted_at", row.try_get("halted_at")?)?,
                })
            })
            .collect()
    }

    async fn subscribe(&self) -> Result<Option<Box<dyn Subscription>>, QueueError> {
        if self.watch.is_zero() {
            return Ok(None);
        }
        // A connection of its own: PRAGMA data_version changes when another
        // connection commits, so a pooled one could miss the change.
        let mut conn = self.watch_options.connect().await?;
        let version = data_version(&mut conn).await?;
        let seqs = wakeup_counters(&mut conn).await?.into_iter().collect();
        let mut wal = self.watch_options.get_filename().as_os_str().to_owned();
        wal.push("-wal");
        Ok(Some(Box::new(SqliteSubscription {
            conn,
            wal: wal.into(),
            wal_seen: None,
            version,
            seqs,
            ready: std::collections::VecDeque::new(),
            every: self.watch,
            looks: 0,
        })))
    }

    async fn set_kind_defaults(&self, defaults: &[(String, Priority)]) -> Result<(), QueueError> {
        // The same shape as PostgreSQL's (upserts, then a delete of what is
        // no longer listed), though the single writer serialises it anyway.
        let mut tx = self.write().await?;
        let stored: Vec<String> = sqlx::query_scalar("SELECT kind FROM kind_defaults")
            .fetch_all(&mut *tx)
            .await?;
        for kind in stored.iter().filter(|k| !defaults.iter().any(|(d, _)| d == *k)) {
            sqlx::query("DELETE FROM kind_defaults WHERE kind = ?")
                .bind(kind)
                .execute(&mut *tx)
                .await?;
        }
        for (kind, priority) in defaults {
            sqlx::query(
                "INSERT INTO kind_defaults (kind, priority) VALUES (?, ?) \
                 ON CONFLICT (kind) DO UPDATE SET priority = excluded.priority",
            )
            .bind(kind)
            .bind(priority.rank())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn put_fee_snapshot(
        &self,
        oracle: &str,
        snapshot: &str,
        sampled_at: DateTime<Utc>,
    ) -> Result<Cas, QueueError> {
        let mut tx = self.write().await?;
        let done = sqlx::query(
            "INSERT INTO fee_snapshots (oracle, snapshot, sampled_at) VALUES (?, ?, ?) \
             ON CONFLICT (oracle) DO UPDATE SET snapshot = excluded.snapshot, sampled_at = excluded.sampled_at \
             WHERE fee_snapshots.sampled_at < excluded.sampled_at",
        )
        .bind(oracle)
        .bind(snapshot)
        .bind(ms(sampled_at))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(cas(done.rows_affected()))
    }

    async fn fee_snapshot(&self, oracle: &str) -> Result<Option<(String, DateTime<Utc>)>, QueueError> {
        let row = sqlx::query("SELECT snapshot, sampled_at FROM fee_snapshots WHERE oracle = ?")
            .bind(oracle)
            .fetch_optional(&self.reader)
            .await?;
        row.map(|row| {
            let at: i64 = row.try_get("sampled_at")?;
            Ok((row.try_get("snapshot")?, from_ms(0, "fee_snapshots.sampled_at", at)?))
        })
        .transpose()
    }

    async fn retry_dead_letters(&self, due: &[(OpId, DateTime<Utc>)]) -> Result<Vec<OpId>, QueueError> {
        let now = ms(self.now());
        let t = Transition::ForceRetry;
        let mut tx = self.write().await?;
        let mut retried = Vec::with_capacity(due.len());
        for (id, at) in due {
            let done = sqlx::query(
                "UPDATE ops SET status = ?, attempt_floor = attempts, next_attempt_at = ?, updated_at = ?, \
                 finished_at = NULL WHERE id = ? AND status = ? AND coalesce_key IS NULL",
            )
            .bind(t.to().as_str())
            .bind(ms(*at))
            .bind(now)
            .bind(id)
            .bind(t.from().as_str())
            .execute(&mut *tx)
            .await?;
            if done.rows_affected() == 1 {
                sqlx::query("DELETE FROM lane_halts WHERE op_id = ?")
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                retried.push(*id);
            }
        }
        tx.commit().await?;
        Ok(retried)
    }

    async fn create_api_key(&self, key: &NewApiKey) -> Result<ApiKey, QueueError> {
        let now = self.now();
        let mut tx = self.write().await?;
        let done =
            sqlx::query("INSERT INTO api_keys (id, name, secret_hash, scopes, created_at) VALUES (?, ?, ?, ?, ?)")
                .bind(&key.id)
                .bind(&key.name)
                .bind(&key.secret_hash)
                .bind(scopes_column(&key.scopes))
                .bind(ms(now))
                .execute(&mut *tx)
                .await;
        match done {
            Err(e) if is_unique_violation(&e) => return Err(api_key_name_taken(&key.name)),
            other => other?,
        };
        tx.commit().await?;
        Ok(ApiKey {
            id: key.id.clone(),
            name: key.name.clone(),
            scopes: key.scopes.clone(),
            created_at: from_ms(0, "api_keys.created_at", ms(now))?,
            revoked_at: None,
        })
    }

    async fn api_keys(&self) -> Result<Vec<ApiKey>, QueueError> {
        let rows = sqlx::query("SELECT id, name, scopes, created_at, revoked_at FROM api_keys ORDER BY name")
            .fetch_all(&self.reader)
            .await?;
        rows.iter().map(api_key_from_row).collect()
    }

    async fn api_key(&self, id: &str) -> Result<Option<(ApiKey, Vec<u8>)>, QueueError> {
        let row =
            sqlx::query("SELECT id, name, scopes, created_at, revoked_at, secret_hash FROM api_keys WHERE id = ?")
                .bind(id)
                .fetch_optional(&self.reader)
                .await?;
        row.map(|row| Ok((api_key_from_row(&row)?, row.try_get("secret_hash")?)))
            .transpose()
    }

    async fn revoke_api_key(&self, name: &str) -> Result<bool, QueueError> {
        let mut tx = self.write().await?;
        let done = sqlx::query("UPDATE api_keys SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL")
            .bind(ms(self.now()))
            .bind(name)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected() == 1)
    }

    async fn record_audit(&self, entry: &NewAuditEntry) -> Result<(), QueueError> {
        let mut tx = self.write().await?;
        sqlx::query("INSERT INTO audit_log (at, actor, action, target, before, after) VALUES (?, ?, ?, ?, ?, ?)")
            .bind(ms(self.now()))
            .bind(&entry.actor)
            .bind(&entry.action)
            .bind(&entry.target)
            .bind(json_column(entry.before.as_ref()))
            .bind(json_column(entry.after.as_ref()))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn audit_log(&self, before: Option<i64>, limit: u32) -> Result<Vec<AuditEntry>, QueueError> {
        let rows = sqlx::query(
            "SELECT id, at, actor, action, target, before, after FROM audit_log \
             WHERE ?1 IS NULL OR id < ?1 ORDER BY id DESC LIMIT ?2",
        )
        .bind(before)
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await?;
        rows.iter()
            .map(|row| {
                let id: i64 = row.try_get("id")?;
                Ok(AuditEntry {
                    id,
                    at: from_ms(id, "audit_log.at", row.try_get("at")?)?,
                    actor: row.try_get("actor")?,
                    action: row.try_get("action")?,
                    target: row.try_get("target")?,
                    before: json_from_column(id, "audit_log.before", row.try_get("before")?)?,
                    after: json_from_column(id, "audit_log.after", row.try_get("after")?)?,
                })
            })
            .collect()
    }

    async fn pause(
        &self,
        scope: PauseScope,
        target: &str,
        reason: Option<&str>,
        actor: &str,
    ) -> Result<bool, QueueError> {
        let mut tx = self.write().await?;
        let done = sqlx::query(
            "INSERT INTO pauses (scope, target, reason, actor, paused_at) VALUES (?, ?, ?, ?, ?) \
             ON CONFLICT (scope, target) DO NOTHING",
        )
        .bind(scope.as_str())
        .bind(target)
        .bind(reason)
        .bind(actor)
        .bind(ms(self.now()))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(done.rows_affected() == 1)
    }

    async fn resume(&self, scope: PauseScope, target: &str) -> Result<bool, QueueError> {
        let mut tx = self.write().await?;
        let done = sqlx::query("DELETE FROM pauses WHERE scope = ? AND target = ?")
            .bind(scope.as_str())
            .bind(target)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected() == 1)
    }

    async fn pauses(&self) -> Result<Vec<Pause>, QueueError> {
        let rows = sqlx::query("SELECT scope, target, reason, actor, paused_at FROM pauses ORDER BY scope, target")
            .fetch_all(&self.reader)
            .await?;
        rows.iter()
            .map(|row| {
                let scope: String = row.try_get("scope")?;
                Ok(Pause {
                    scope: pause_scope(&scope)?,
                    target: row.try_get("target")?,
                    reason: row.try_get("reason")?,
                    actor: row.try_get("actor")?,
                    paused_at: from_ms(0, "pauses.paused_at", row.try_get("paused_at")?)?,
                })
            })
            .collect()
    }
    async fn gauges(&self) -> Result<QueueGauges, QueueError> {
        let now = ms(self.now());
        let row = sqlx::query(
            "SELECT (SELECT COUNT(*) FROM ops WHERE status = 'submitted' AND lease_until < ?1) AS stuck, \
             (SELECT COUNT(*) FROM lane_halts) AS held, (SELECT COUNT(*) FROM halted_subjects) AS halted",
        )
        .bind(now)
        .fetch_one(&self.reader)
        .await?;
        let rows = sqlx::query(
            "SELECT kind, outbox, MIN(next_attempt_at) AS due FROM ops \
             WHERE status = 'pending' AND next_attempt_at <= ? GROUP BY kind, outbox ORDER BY kind, outbox",
        )
        .bind(now)
        .fetch_all(&self.reader)
        .await?;
        let oldest_due = rows
            .iter()
            .map(|r| {
                Ok(OldestDue {
                    kind: r.try_get("kind")?,
                    outbox: r.try_get("outbox")?,
                    due_at: from_ms(0, "ops.next_attempt_at", r.try_get("due")?)?,
                })
            })
            .collect::<Result<_, QueueError>>()?;
        Ok(QueueGauges {
            stuck_submitted: row.try_get("stuck")?,
            lanes_held: row.try_get("held")?,
            subjects_halted: row.try_get("halted")?,
            oldest_due,
        })
    }

    async fn recent_latencies(&self, since: DateTime<Utc>, limit: u32) -> Result<Vec<Latency>, QueueError> {
        let rows = sqlx::query(
            "SELECT id, kind, priority, finished_at - created_at AS ms FROM ops \
             WHERE status = 'confirmed' AND finished_at >= ? ORDER BY id DESC LIMIT ?",
        )
        .bind(ms(since))
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await?;
        rows.iter()
            .map(|r| {
                let id: i64 = r.try_get("id")?;
                let millis: i64 = r.try_get("ms")?;
                Ok(Latency {
                    kind: r.try_get("kind")?,
                    priority: parse_priority(id, r.try_get("priority")?)?,
                    #[allow(clippy::cast_precision_loss)]
                    seconds: millis.max(0) as f64 / 1000.0,
                })
            })
            .collect()
    }
    async fn outcomes(&self, after: Option<&str>, limit: u32) -> Result<Vec<OutcomeEntry>, QueueError> {
        // One writer: the sequence is the commit order.
        let after: i64 = match after {
            None => 0,
            Some(c) => c.parse().map_err(|_| QueueError::BadCursor(c.to_owned()))?,
        };
        let rows = sqlx::query(&format!(
            "SELECT f.seq, f.fstatus, f.fat, {OP_COLUMNS} FROM ops JOIN \
             (SELECT seq, op_id, status AS fstatus, at AS fat FROM outcomes WHERE seq > ? ORDER BY seq LIMIT ?) f \
             ON f.op_id = ops.id ORDER BY f.seq"
        ))
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await?;
        let entries = rows
            .iter()
            .map(|r| {
                let op = op_from_row(r)?;
                let seq: i64 = r.try_get("seq")?;
                let status: String = r.try_get("fstatus")?;
                Ok(OutcomeEntry {
                    cursor: seq.to_string(),
                    status: parse_status(op.id, &status)?,
                    at: from_ms(op.id, "outcomes.at", r.try_get("fat")?)?,
                    op,
                })
            })
            .collect::<Result<Vec<_>, QueueError>>()?;
        let mut entries = entries;
        resolve_payloads(&self.reader, entries.iter_mut().map(|e| &mut e.op)).await?;
        Ok(entries)
    }
    async fn prunable(&self, query: &PruneQuery) -> Result<Vec<Op>, QueueError> {
        let mut q = QueryBuilder::<Sqlite>::new(format!("SELECT {OP_COLUMNS} FROM ops WHERE status = "));
        q.push_bind(query.status.as_str());
        q.push(" AND finished_at < ").push_bind(ms(query.finished_before));
        match &query.kind {
            Some(kind) => {
                q.push(" AND kind = ").push_bind(kind.clone());
            }
            None => {
                let except =
                    serde_json::to_string(&query.except_kinds).map_err(|e| QueueError::InvalidOp(e.to_string()))?;
                q.push(" AND kind NOT IN (SELECT value FROM json_each(")
                    .push_bind(except)
                    .push("))");
            }
        }
        if let Some(after) = &query.unrelayed_after {
            let seq: i64 = match after {
                None => 0,
                Some(c) => c.parse().map_err(|_| QueueError::BadCursor(c.clone()))?,
            };
            q.push(" AND id NOT IN (SELECT op_id FROM outcomes WHERE seq > ")
                .push_bind(seq)
                .push(")");
        }
        q.push(" AND id NOT IN (SELECT op_id FROM lane_halts) ORDER BY id LIMIT ")
            .push_bind(i64::from(query.limit));
        let rows = q.build().fetch_all(&self.reader).await?;
        let mut ops = rows.iter().map(op_from_row).collect::<Result<Vec<_>, _>>()?;
        resolve_payloads(&self.reader, ops.iter_mut()).await?;
        Ok(ops)
    }

    async fn put_tombstones(&self, tombstones: &[Tombstone]) -> Result<(), QueueError> {
        let mut tx = self.write().await?;
        for t in tombstones {
            sqlx::query(
                "INSERT INTO idempotency_tombstones \
                 (outbox, idempotency_key, op_id, kind, status, receipt, finished_at, expires_at) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            )
            .bind(&t.outbox)
            .bind(&t.idempotency_key)
            .bind(t.op_id)
            .bind(&t.kind)
            .bind(t.status.as_str())
            .bind(&t.receipt)
            .bind(ms(t.finished_at))
            .bind(t.expires_at.map(ms))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn delete_terminal(&self, ids: &[OpId], status: Status) -> Result<Vec<OpId>, QueueError> {
        if !status.is_terminal() {
            return Err(QueueError::InvalidOp(format!("{status} is not a terminal status")));
        }
        let ids = serde_json::to_string(ids).map_err(|e| QueueError::InvalidOp(e.to_string()))?;
        let mut tx = self.write().await?;
        // One writer: what this selects cannot change before the deletes.
        let doomed: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM ops WHERE id IN (SELECT value FROM json_each(?1)) AND status = ?2 \
             AND id NOT IN (SELECT op_id FROM lane_halts) ORDER BY id",
        )
        .bind(&ids)
        .bind(status.as_str())
        .fetch_all(&mut *tx)
        .await?;
        let doomed_json = serde_json::to_string(&doomed).map_err(|e| QueueError::InvalidOp(e.to_string()))?;
        let shared: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT payload_ref FROM ops WHERE id IN (SELECT value FROM json_each(?)) AND payload_ref IS NOT NULL",
        )
        .bind(&doomed_json)
        .fetch_all(&mut *tx)
        .await?;
        for table in ["attempts", "op_lanes", "outcomes"] {
            sqlx::query(&format!(
                "DELETE FROM {table} WHERE op_id IN (SELECT value FROM json_each(?))"
            ))
            .bind(&doomed_json)
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query("DELETE FROM ops WHERE id IN (SELECT value FROM json_each(?))")
            .bind(&doomed_json)
            .execute(&mut *tx)
            .await?;
        // A shared payload goes with the last op that carries it.
        let shared = serde_json::to_string(&shared).map_err(|e| QueueError::InvalidOp(e.to_string()))?;
        sqlx::query(
            "DELETE FROM payloads WHERE hash IN (SELECT value FROM json_each(?)) \
             AND NOT EXISTS (SELECT 1 FROM ops WHERE ops.payload_ref = payloads.hash)",
        )
        .bind(shared)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(doomed)
    }

    async fn expire_tombstones(&self, now: DateTime<Utc>, limit: u32) -> Result<u64, QueueError> {
        let mut tx = self.write().await?;
        let done = sqlx::query(
            "DELETE FROM idempotency_tombstones WHERE (outbox, idempotency_key) IN \
             (SELECT outbox, idempotency_key FROM idempotency_tombstones \
              WHERE expires_at IS NOT NULL AND expires_at < ? LIMIT ?)",
        )
        .bind(ms(now))
        .bind(i64::from(limit))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    async fn tombstone(&self, outbox: &str, idempotency_key: &str) -> Result<Option<Tombstone>, QueueError> {
        let row = sqlx::query(
            "SELECT outbox, idempotency_key, op_id, kind, status, receipt, finished_at, expires_at \
             FROM idempotency_tombstones WHERE outbox = ? AND idempotency_key = ?",
        )
        .bind(outbox)
        .bind(idempotency_key)
        .fetch_optional(&self.reader)
        .await?;
        row.map(|r| {
            let op_id: i64 = r.try_get("op_id")?;
            let status: String = r.try_get("status")?;
            let expires: Option<i64> = r.try_get("expires_at")?;
            Ok(Tombstone {
                outbox: r.try_get("outbox")?,
                idempotency_key: r.try_get("idempotency_key")?,
                op_id,
                kind: r.try_get("kind")?,
                status: parse_status(op_id, &status)?,
                receipt: r.try_get("receipt")?,
                finished_at: from_ms(op_id, "idempotency_tombstones.finished_at", r.try_get("finished_at")?)?,
                expires_at: expires
                    .map(|v| from_ms(op_id, "idempotency_tombstones.expires_at", v))
                    .transpose()?,
            })
        })
        .transpose()
    }

    async fn hold_singleton(&self, name: &str, owner: &str, ttl: std::time::Duration) -> Result<bool, QueueError> {
        let now = self.now();
        let until = now + crate::clock::chrono_duration(ttl);
        let mut tx = self.write().await?;
        let held: Option<String> = sqlx::query_scalar(
            "INSERT INTO singletons (name, owner, until) VALUES (?1, ?2, ?3) \
             ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, until = excluded.until \
             WHERE singletons.until < ?4 OR singletons.owner = excluded.owner RETURNING owner",
        )
        .bind(name)
        .bind(owner)
        .bind(ms(until))
        .bind(ms(now))
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(held.is_some())
    }

    async fn release_coalesce(&self, outbox: &str, idempotency_keys: &[String]) -> Result<u64, QueueError> {
        if idempotency_keys.is_empty() {
            return Ok(0);
        }
        let keys = serde_json::to_string(idempotency_keys).map_err(|e| QueueError::InvalidOp(e.to_string()))?;
        let mut tx = self.write().await?;
        let done = sqlx::query(
            "UPDATE ops SET coalesce_key = NULL, updated_at = ? WHERE outbox = ? AND coalesce_key IS NOT NULL \
             AND status IN ('pending', 'submitted') AND idempotency_key IN (SELECT value FROM json_each(?))",
        )
        .bind(ms(self.now()))
        .bind(outbox)
        .bind(keys)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    async fn feed_cursor(&self, name: &str) -> Result<Option<String>, QueueError> {
        Ok(sqlx::query_scalar("SELECT cursor FROM feed_cursors WHERE name = ?")
            .bind(name)
            .fetch_optional(&self.reader)
            .await?)
    }

    async fn set_feed_cursor(&self, name: &str, cursor: &str) -> Result<(), QueueError> {
        let mut tx = self.write().await?;
        sqlx::query(
            "INSERT INTO feed_cursors (name, cursor) VALUES (?1, ?2) ON CONFLICT (name) DO UPDATE SET cursor = ?2",
        )
        .bind(name)
        .bind(cursor)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn record(&self, namespace: &str, key: &str) -> Result<Option<Record>, QueueError> {
        let row = sqlx::query("SELECT key, value, version, updated_at FROM records WHERE namespace = ? AND key = ?")
            .bind(namespace)
            .bind(key)
            .fetch_optional(&self.reader)
            .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    async fn records(&self, namespace: &str, keys: Option<&[String]>) -> Result<Vec<Record>, QueueError> {
        let rows = match keys {
            None => {
                sqlx::query("SELECT key, value, version, updated_at FROM records WHERE namespace = ? ORDER BY key")
                    .bind(namespace)
                    .fetch_all(&self.reader)
                    .await?
            }
            Some([]) => return Ok(Vec::new()),
            Some(keys) => {
                let keys = serde_json::to_string(keys).map_err(|e| QueueError::InvalidOp(e.to_string()))?;
                sqlx::query(
                    "SELECT key, value, version, updated_at FROM records WHERE namespace = ? \
                     AND key IN (SELECT value FROM json_each(?)) ORDER BY key",
                )
                .bind(namespace)
                .bind(keys)
                .fetch_all(&self.reader)
                .await?
            }
        };
        rows.iter().map(record_from_row).collect()
    }

    async fn put_record(&self, namespace: &str, key: &str, value: &str, expect: Expect) -> Result<Cas, QueueError> {
        let now = ms(self.now());
        let sql = match expect {
            Expect::Absent => {
                "INSERT INTO records (namespace, key, value, version, updated_at) VALUES (?1, ?2, ?3, 1, ?4) \
                 ON CONFLICT (namespace, key) DO NOTHING"
            }
            Expect::Version(_) => {
                "UPDATE records SET value = ?3, version = version + 1, updated_at = ?4 \
                 WHERE namespace = ?1 AND key = ?2 AND version = ?5"
            }
            Expect::Any => {
                "INSERT INTO records (namespace, key, value, version, updated_at) VALUES (?1, ?2, ?3, 1, ?4) \
                 ON CONFLICT (namespace, key) DO UPDATE SET value = excluded.value, \
                 version = records.version + 1, updated_at = excluded.updated_at"
            }
        };
        let version = match expect {
            Expect::Version(v) => v,
            _ => 0,
        };
        let mut tx = self.write().await?;
        let done = sqlx::query(sql)
            .bind(namespace)
            .bind(key)
            .bind(value)
            .bind(now)
            .bind(version)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(cas(done.rows_affected()))
    }

    async fn delete_record(&self, namespace: &str, key: &str, expect: Expect) -> Result<Cas, QueueError> {
        let version = match expect {
            Expect::Absent => return Ok(Cas::Stale),
            Expect::Version(v) => Some(v),
            Expect::Any => None,
        };
        let mut tx = self.write().await?;
        let done =
            sqlx::query("DELETE FROM records WHERE namespace = ?1 AND key = ?2 AND (?3 IS NULL OR version = ?3)")
                .bind(namespace)
                .bind(key)
                .bind(version)
                .execute(&mut *tx)
                .await?;
        tx.commit().await?;
        Ok(cas(done.rows_affected()))
    }

    async fn table_rows(&self) -> Result<Vec<(String, i64)>, QueueError> {
        let mut out = Vec::new();
        for table in super::common::SIZED_TABLES {
            let n: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {table}"))
                .fetch_one(&self.reader)
                .await?;
            out.push((table.to_owned(), n));
        }
        Ok(out)
    }
}

fn api_key_from_row(row: &SqliteRow) -> Result<ApiKey, QueueError> {
    let scopes: String = row.try_get("scopes")?;
    Ok(ApiKey {
        id: row.try_get("id")?,
        name: row.try_get("name")?,
        scopes: scopes_from_column(&scopes),
        created_at: from_ms(0, "api_keys.created_at", row.try_get("created_at")?)?,
        revoked_at: opt_from_ms(0, "api_keys.revoked_at", row.try_get("revoked_at")?)?,
    })
}

async fn halt_lanes(conn: &mut SqliteConnection, op_id: OpId, now: DateTime<Utc>) -> Result<(), QueueError> {
    sqlx::query(
        "INSERT OR IGNORE INTO lane_halts (outbox, lane, op_id, halted_at) \
         SELECT o.outbox, l.lane, o.id, ? FROM ops o JOIN op_lanes l ON l.op_id = o.id WHERE o.id = ?",
    )
    .bind(ms(now))
    .bind(op_id)
    .execute(conn)
    .await?;
    Ok(())
}

fn record_from_row(row: &SqliteRow) -> Result<Record, QueueError> {
    Ok(Record {
        key: row.try_get("key")?,
        value: row.try_get("value")?,
        version: row.try_get("version")?,
        updated_at: from_ms(0, "records.updated_at", row.try_get("updated_at")?)?,
    })
}

fn ms(t: DateTime<Utc>) -> i64 {
    t.timestamp_millis()
}

fn from_ms(id: OpId, column: &'static str, v: i64) -> Result<DateTime<Utc>, QueueError> {
    DateTime::from_timestamp_millis(v).ok_or(QueueError::Corrupt {
        id,
        column,
        value: v.to_string(),
    })
}

fn opt_from_ms(id: OpId, column: &'static str, v: Option<i64>) -> Result<Option<DateTime<Utc>>, QueueError> {
    v.map(|v| from_ms(id, column, v)).transpose()
}

/// Every op that occupies one of `lanes`. The occupying ops are few (the
/// `ops_occupying` index); SQLite matches their lanes in C, so only the ones
/// that matter are decoded.
async fn occupants_in(conn: &mut SqliteConnection, lanes: &[String]) -> Result<Vec<Occupant>, QueueError> {
    if lanes.is_empty() {
        return Ok(Vec::new());
    }
    let wanted = serde_json::to_string(lanes).map_err(|e| QueueError::InvalidOp(e.to_string()))?;
    // INDEXED BY: without statistics SQLite may answer the `pending AND
    // receipt` branch from the status index, reading every waiting op.
    sqlx::query(&format!(
        "SELECT {OCCUPANT_COLUMNS} FROM ops INDEXED BY ops_occupying WHERE {OCCUPYING} AND EXISTS \
         (SELECT 1 FROM json_each(ops.lanes) AS l WHERE l.value IN (SELECT value FROM json_each(?)))"
    ))
    .bind(wanted)
    .fetch_all(&mut *conn)
    .await?
    .iter()
    .map(occupant_from_row)
    .collect()
}

/// A row read with [`BOOK_COLUMNS`].
fn book_row(row: &SqliteRow) -> Result<BookRow, QueueError> {
    let id: i64 = row.try_get("id")?;
    Ok(BookRow {
        id,
        kind: row.try_get("kind")?,
        priority: parse_priority(id, row.try_get("priority")?)?,
        lanes: lanes_from_row(id, row)?,
        in_flight: row.try_get("in_flight")?,
        in_doubt: row.try_get("in_doubt")?,
        next_attempt_at: from_ms(id, "next_attempt_at", row.try_get("next_attempt_at")?)?,
        budget_attempts: row.try_get("budget_attempts")?,
        fee_bumps: row.try_get("fee_bumps")?,
        created_at: from_ms(id, "created_at", row.try_get("created_at")?)?,
        subject_halted: row.try_get("subject_halted")?,
    })
}

fn occupant_from_row(row: &SqliteRow) -> Result<Occupant, QueueError> {
    let id: i64 = row.try_get("id")?;
    Ok(Occupant {
        id,
        outbox: row.try_get("outbox")?,
        kind: row.try_get("kind")?,
        priority: parse_priority(id, row.try_get("priority")?)?,
        lanes: lanes_from_row(id, row)?,
        in_flight: row.try_get("in_flight")?,
        in_doubt: row.try_get("in_doubt")?,
    })
}

fn lanes_from_row(id: OpId, row: &SqliteRow) -> Result<Vec<String>, QueueError> {
    let lanes_text: String = row.try_get("lanes")?;
    serde_json::from_str(&lanes_text).map_err(|_| QueueError::Corrupt {
        id,
        column: "lanes",
        value: lanes_text.clone(),
    })
}

/// Reads shared payloads (`payloads`) into the ops that point at them, so
/// every reader sees the payload as enqueued whichever way it is stored.
async fn resolve_payloads<'a, 'c, E>(exec: E, ops: impl IntoIterator<Item = &'a mut Op>) -> Result<(), QueueError>
where
    E: sqlx::Executor<'c, Database = Sqlite>,
{
    let mut wanting: Vec<&'a mut Op> = ops.into_iter().filter(|o| o.payload_ref.is_some()).collect();
    if wanting.is_empty() {
        return Ok(());
    }
    let mut hashes: Vec<&str> = wanting.iter().filter_map(|o| o.payload_ref.as_deref()).collect();
    hashes.sort_unstable();
    hashes.dedup();
    let list = serde_json::to_string(&hashes).map_err(|e| QueueError::InvalidOp(e.to_string()))?;
    let bodies: std::collections::HashMap<String, String> =
        sqlx::query_as("SELECT hash, body FROM payloads WHERE hash IN (SELECT value FROM json_each(?))")
            .bind(list)
            .fetch_all(exec)
            .await?
            .into_iter()
            .collect();
    for op in &mut wanting {
        let hash = op.payload_ref.clone().unwrap_or_default();
        op.payload = bodies.get(&hash).cloned().ok_or(QueueError::Corrupt {
            id: op.id,
            column: "payload_ref",
            value: hash,
        })?;
    }
    Ok(())
}

fn op_from_row(row: &SqliteRow) -> Result<Op, QueueError> {
    let id: i64 = row.try_get("id")?;
    let lanes = lanes_from_row(id, row)?;
    let status: String = row.try_get("status")?;
    let token: Option<String> = row.try_get("lease_token")?;
    let lease_token = token
        .map(|t| {
            t.parse().map_err(|_| QueueError::Corrupt {
                id,
                column: "lease_token",
                value: t.clone(),
            })
        })
        .transpose()?;
    Ok(Op {
        id,
        outbox: row.try_get("outbox")?,
        kind: row.try_get("kind")?,
        priority: parse_priority(id, row.try_get("priority")?)?,
        lanes,
        payload: row.try_get("payload")?,
        payload_ref: row.try_get("payload_ref")?,
        idempotency_key: row.try_get("idempotency_key")?,
        coalesce_key: row.try_get("coalesce_key")?,
        subject: row.try_get("subject")?,
        correlation_id: row.try_get("correlation_id")?,
        status: parse_status(id, &status)?,
        attempts: row.try_get("attempts")?,
        attempt_floor: row.try_get("attempt_floor")?,
        fee_bumps: row.try_get("fee_bumps")?,
        next_attempt_at: from_ms(id, "next_attempt_at", row.try_get("next_attempt_at")?)?,
        lease_owner: row.try_get("lease_owner")?,
        lease_token,
        lease_until: opt_from_ms(id, "lease_until", row.try_get("lease_until")?)?,
        receipt: row.try_get("receipt")?,
        last_error: row.try_get("last_error")?,
        created_at: from_ms(id, "created_at", row.try_get("created_at")?)?,
        updated_at: from_ms(id, "updated_at", row.try_get("updated_at")?)?,
        finished_at: opt_from_ms(id, "finished_at", row.try_get("finished_at")?)?,
    })
}
