//! The floors: plain job loops with no scheduler, no lanes and no leases,
//! on the same databases laneway uses, so `laneway bench` can say how much
//! of what the database can do laneway's drain gets.

use std::str::FromStr as _;
use std::time::{Duration, Instant};

use super::{pg_url, ScratchSchema};

/// The plain PostgreSQL job loop with no scheduler at all: `clients`
/// connections each take up to 100 pending jobs with `FOR UPDATE SKIP
/// LOCKED`, mark them done and write one history row per job, in one
/// transaction, until none is left. The floor any PostgreSQL queue pays.
pub(super) async fn postgres_round(n: usize, clients: usize) -> anyhow::Result<f64> {
    let schema = ScratchSchema::create("plainbench").await?;
    let options =
        sqlx::postgres::PgConnectOptions::from_str(&pg_url())?.options([("search_path", schema.name.as_str())]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(u32::try_from(clients).unwrap_or(2) + 1)
        .connect_with(options)
        .await?;
    for ddl in [
        "CREATE TABLE jobs (id BIGSERIAL PRIMARY KEY, queue TEXT NOT NULL, state TEXT NOT NULL, payload JSONB NOT NULL, attempts INT NOT NULL DEFAULT 0, updated_at TIMESTAMPTZ NOT NULL DEFAULT now())",
        "CREATE INDEX jobs_pending ON jobs (id) WHERE state = 'pending'",
        "CREATE TABLE history (job_id BIGINT NOT NULL, at TIMESTAMPTZ NOT NULL, outcome TEXT NOT NULL)",
    ] {
        sqlx::query(ddl).execute(&pool).await?;
    }
    sqlx::query("INSERT INTO jobs (queue, state, payload) SELECT 'outbox-' || (g % 8), 'pending', '{}' FROM generate_series(1, $1) g")
        .bind(i64::try_from(n)?)
        .execute(&pool)
        .await?;
    let start = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let pool = pool.clone();
        workers.spawn(async move {
            loop {
                let mut tx = pool.begin().await?;
                let ids: Vec<i64> = sqlx::query_scalar(
                    "SELECT id FROM jobs WHERE state = 'pending' ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED",
                )
                .fetch_all(&mut *tx)
                .await?;
                if ids.is_empty() {
                    tx.commit().await?;
                    return anyhow::Ok(());
                }
                sqlx::query(
                    "UPDATE jobs SET state = 'done', attempts = attempts + 1, updated_at = now() WHERE id = ANY($1)",
                )
                .bind(&ids)
                .execute(&mut *tx)
                .await?;
                sqlx::query("INSERT INTO history (job_id, at, outcome) SELECT unnest($1::bigint[]), now(), 'ok'")
                    .bind(&ids)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
            }
        });
    }
    while let Some(done) = workers.join_next().await {
        done??;
    }
    let seconds = start.elapsed().as_secs_f64();
    pool.close().await;
    schema.drop().await?;
    Ok(n as f64 / seconds)
}

/// The same loop on SQLite (`synchronous=full`, WAL, one writer): batches
/// of 100 claimed, marked done and given a history row per job in one
/// durable transaction.
pub(super) async fn sqlite_round(n: usize) -> anyhow::Result<f64> {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
    let dir = tempfile::tempdir()?;
    let options = SqliteConnectOptions::new()
        .filename(dir.path().join("plain.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full);
    let mut conn = sqlx::ConnectOptions::connect(&options).await?;
    for ddl in [
        "CREATE TABLE jobs (id INTEGER PRIMARY KEY, queue TEXT NOT NULL, state TEXT NOT NULL, payload TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, updated_at TEXT)",
        "CREATE INDEX jobs_pending ON jobs (id) WHERE state = 'pending'",
        "CREATE TABLE history (job_id INTEGER NOT NULL, at TEXT NOT NULL, outcome TEXT NOT NULL)",
        "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < ?1) INSERT INTO jobs (queue, state, payload) SELECT 'outbox-' || (i % 8), 'pending', '{}' FROM g",
    ] {
        sqlx::query(ddl).bind(i64::try_from(n)?).execute(&mut conn).await?;
    }
    let start = Instant::now();
    loop {
        let mut tx = sqlx::Connection::begin(&mut conn).await?;
        let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM jobs WHERE state = 'pending' ORDER BY id LIMIT 100")
            .fetch_all(&mut *tx)
            .await?;
        if ids.is_empty() {
            break;
        }
        let list = serde_json::to_string(&ids)?;
        sqlx::query("UPDATE jobs SET state = 'done', attempts = attempts + 1, updated_at = datetime('now') WHERE id IN (SELECT value FROM json_each(?1))")
            .bind(&list)
            .execute(&mut *tx)
            .await?;
        sqlx::query("INSERT INTO history (job_id, at, outcome) SELECT value, datetime('now'), 'ok' FROM json_each(?1)")
            .bind(&list)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// The ceiling of laneway's own design on SQLite: its dispatch statements
/// (the book's read, the settle with its attempt rows, the pick, the lane
/// guard's occupants, the claim), run back to back on one connection with
/// no host around them: no drains, no committer, no executor, no events.
/// Each durable transaction settles the 100 ops the one before claimed and
/// claims the next 100, as a group commit does in the steady state. What
/// this loop leaves to the plain loop is what the schema costs (the
/// indexes and triggers a status change maintains, a lease and an attempt
/// row per op); what the drain leaves to this loop is what the host costs.
pub(super) async fn sqlite_statements_round(n: usize) -> anyhow::Result<(f64, String)> {
    use crate::op::{AttemptClass, Transition};
    use crate::queue::sqlite::sql::dispatch::{CLAIM, OCCUPANTS, PICK_CLAIMABLE, RECORD_ATTEMPTS, SETTLE};
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
    use sqlx::Row as _;
    let scratch = super::Scratch::new(super::Store::SqliteFull, "").await?;
    const OUTBOXES: usize = 8;
    super::enqueue_all(scratch.queue.as_ref(), &super::ops(n, OUTBOXES, n)).await?;
    let options = SqliteConnectOptions::from_str(&scratch.url)?
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .foreign_keys(true);
    let mut conn = sqlx::ConnectOptions::connect(&options).await?;
    let now = || chrono::Utc::now().timestamp_millis();
    // Every status the statements compare and set comes from the state
    // machine, as the store's do.
    let (claim, confirm) = (Transition::Claim, Transition::Confirm);
    let start = Instant::now();
    // Wall time per statement, in the order a transaction runs them.
    let mut spent = [std::time::Duration::ZERO; 8];
    let mut lap = Instant::now();
    let mut mark = |slot: usize| {
        let now = Instant::now();
        spent[slot] += now - lap;
        lap = now;
    };
    // What the last transaction claimed: (id, attempt, token).
    let mut claimed: Vec<(i64, i64, String)> = Vec::new();
    let (mut turn, mut empty_reads) = (0usize, 0usize);
    loop {
        let mut tx: sqlx::Transaction<'_, sqlx::Sqlite> =
            sqlx::Transaction::begin(&mut conn, Some("BEGIN IMMEDIATE".into())).await?;
        mark(0);
        let at = now();
        if !claimed.is_empty() {
            let settles: Vec<serde_json::Value> = claimed
                .iter()
                .map(|(id, attempt, token)| {
                    serde_json::json!({
                        "id": id, "attempt": attempt, "token": token,
                        "from": confirm.from().as_str(), "to": confirm.to().as_str(),
                        "clear": 0, "receipt": null, "error": null, "next_at": null, "bump": 0, "finished_at": at,
                    })
                })
                .collect();
            let settled: Vec<i64> = sqlx::query_scalar(SETTLE)
                .bind(serde_json::Value::Array(settles).to_string())
                .bind(at)
                .fetch_all(&mut *tx)
                .await?;
            anyhow::ensure!(
                settled.len() == claimed.len(),
                "settled {} of {}",
                settled.len(),
                claimed.len()
            );
            mark(1);
            let attempts: Vec<serde_json::Value> = claimed
                .iter()
                .map(|(id, attempt, _)| {
                    serde_json::json!({
                        "op_id": id, "attempt": attempt, "started_at": at, "finished_at": at,
                        "outcome": AttemptClass::Confirmed.as_str(), "detail": null, "fee": null, "error": null,
                    })
                })
                .collect();
            sqlx::query(RECORD_ATTEMPTS)
                .bind(serde_json::Value::Array(attempts).to_string())
                .execute(&mut *tx)
                .await?;
            mark(2);
        }
        // The book's read, one outbox a transaction in turn, through the
        // index a drain's book reads (the settle above left nothing in flight).
        let outbox = format!("outbox-{}", turn % OUTBOXES);
        turn += 1;
        let ids: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM laneway_ops WHERE outbox = $1 AND status IN ('pending', 'submitted') ORDER BY priority, id LIMIT 100",
        )
        .bind(&outbox)
        .fetch_all(&mut *tx)
        .await?;
        empty_reads = if ids.is_empty() { empty_reads + 1 } else { 0 };
        mark(3);
        claimed.clear();
        if !ids.is_empty() {
            let list = serde_json::to_string(&ids)?;
            let picked: Vec<sqlx::sqlite::SqliteRow> = sqlx::query(PICK_CLAIMABLE)
                .bind(&list)
                .bind(claim.from().as_str())
                .bind(at)
                .fetch_all(&mut *tx)
                .await?;
            let mut lanes: Vec<String> = Vec::new();
            for row in &picked {
                let these: Vec<String> = serde_json::from_str(row.try_get::<&str, _>("lanes")?)?;
                lanes.extend(these);
            }
            mark(4);
            let occupants = sqlx::query(OCCUPANTS)
                .bind(serde_json::to_string(&lanes)?)
                .fetch_all(&mut *tx)
                .await?;
            anyhow::ensure!(occupants.is_empty(), "every op has a lane of its own");
            mark(5);
            let token = uuid::Uuid::new_v4().to_string();
            let rows: Vec<sqlx::sqlite::SqliteRow> = sqlx::query(CLAIM)
                .bind(claim.to().as_str())
                .bind("bench")
                .bind(&token)
                .bind(at + 60_000)
                .bind(at)
                .bind(&list)
                .bind(claim.from().as_str())
                .fetch_all(&mut *tx)
                .await?;
            for row in rows {
                claimed.push((row.try_get("id")?, row.try_get("attempts")?, token.clone()));
            }
            mark(6);
        }
        tx.commit().await?;
        mark(7);
        if empty_reads >= OUTBOXES && claimed.is_empty() {
            break;
        }
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    drop(conn);
    scratch.drop().await?;
    let per_op = |slot: usize| spent[slot].as_secs_f64() * 1e6 / n as f64;
    let split = [
        "begin",
        "settle",
        "attempt rows",
        "book",
        "pick",
        "occupants",
        "claim",
        "commit",
    ]
    .iter()
    .enumerate()
    .map(|(slot, name)| format!("{name} {:.1}", per_op(slot)))
    .collect::<Vec<_>>()
    .join(", ");
    Ok((rate, split))
}

/// Which database a latency floor runs on.
#[derive(Clone, Copy)]
pub(super) enum FloorDb {
    /// SQLite, WAL, `synchronous=full`, one writer connection (laneway's).
    Sqlite,
    /// The same, each transaction sent as one multi-statement call.
    SqliteOneCall,
    /// PostgreSQL on a fresh schema, a pool of two.
    Postgres,
}

/// The enqueue → start floor of any queue that keeps laneway's crash story
/// (a job is durable before its enqueue returns, its claim before it
/// starts): a producer task inserts a job in one durable transaction and
/// wakes a consumer task, which claims that job by id in a second durable
/// transaction and counts it started. A plain table, no lanes, no
/// scheduler, the same driver and pause between samples as laneway's own
/// latency rows; the p50 and p99 from producer call to start.
pub(super) async fn latency_floor(db: FloorDb, samples: usize) -> anyhow::Result<(Duration, Duration)> {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
    const JOBS: &str = "CREATE TABLE jobs (id {id} PRIMARY KEY, state TEXT NOT NULL, payload TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0)";
    let dir = tempfile::tempdir()?;
    let mut schema = None;
    let floor = match db {
        FloorDb::Sqlite | FloorDb::SqliteOneCall => {
            let options = SqliteConnectOptions::new()
                .filename(dir.path().join("floor.db"))
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Full);
            let pool = SqlitePoolOptions::new()
                .max_connections(1)
                .test_before_acquire(false)
                .connect_with(options)
                .await?;
            sqlx::query(&JOBS.replace("{id}", "INTEGER")).execute(&pool).await?;
            if matches!(db, FloorDb::SqliteOneCall) {
                Floor::SqliteOneCall(pool)
            } else {
                Floor::Sqlite(pool)
            }
        }
        FloorDb::Postgres => {
            let created = ScratchSchema::create("floorbench").await?;
            let options = sqlx::postgres::PgConnectOptions::from_str(&pg_url())?
                .options([("search_path", created.name.as_str())]);
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect_with(options)
                .await?;
            schema = Some(created);
            sqlx::query(&JOBS.replace("{id}", "BIGSERIAL")).execute(&pool).await?;
            Floor::Postgres(pool)
        }
    };
    let floor = std::sync::Arc::new(floor);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<i64>();
    let consumer = {
        let floor = floor.clone();
        tokio::spawn(async move {
            let mut started = Vec::new();
            while let Some(id) = rx.recv().await {
                floor.claim(id).await?;
                started.push(Instant::now());
            }
            anyhow::Ok(started)
        })
    };
    let mut calls = Vec::with_capacity(samples);
    for _ in 0..samples {
        calls.push(Instant::now());
        let id = floor.insert().await?;
        tx.send(id)?;
        // As laneway's rows: the claim commits before the next arrival.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(tx);
    let started = consumer.await??;
    let mut latencies: Vec<Duration> = calls
        .iter()
        .zip(&started)
        .map(|(call, start)| start.saturating_duration_since(*call))
        .collect();
    anyhow::ensure!(
        latencies.len() == samples,
        "the floor's consumer started {} of {samples}",
        latencies.len()
    );
    if let Ok(floor) = std::sync::Arc::try_unwrap(floor) {
        floor.close().await;
    }
    if let Some(schema) = schema {
        schema.drop().await?;
    }
    Ok((
        super::percentile(&mut latencies, 0.5),
        super::percentile(&mut latencies, 0.99),
    ))
}

/// A latency floor's connections.
enum Floor {
    Sqlite(sqlx::SqlitePool),
    SqliteOneCall(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
}

impl Floor {
    /// One job, in a durable transaction of its own.
    async fn insert(&self) -> anyhow::Result<i64> {
        self.transaction(
            "INSERT INTO jobs (state, payload) VALUES ('pending', '{}') RETURNING id",
            None,
        )
        .await?
        .ok_or_else(|| anyhow::anyhow!("the floor's insert returned no id"))
    }

    /// The job claimed by id, in a durable transaction of its own.
    async fn claim(&self, id: i64) -> anyhow::Result<()> {
        let claimed = self
            .transaction(
                "UPDATE jobs SET state = 'running', attempts = attempts + 1 WHERE id = $1 AND state = 'pending' RETURNING id",
                Some(id),
            )
            .await?;
        anyhow::ensure!(claimed == Some(id), "the floor's job {id} was not claimable");
        Ok(())
    }

    /// `statement` (`id` bound only when given) alone in a durable
    /// transaction: the id it returned, if any.
    async fn transaction(&self, statement: &str, id: Option<i64>) -> anyhow::Result<Option<i64>> {
        // The query with `id` bound when given, for either driver (their
        // query types differ, so a function would need sqlx's whole ladder
        // of bounds).
        macro_rules! query {
            ($sql:expr) => {{
                let query = sqlx::query_scalar($sql);
                match id {
                    Some(id) => query.bind(id),
                    None => query,
                }
            }};
        }
        Ok(match self {
            Floor::Sqlite(pool) => {
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                let returned = query!(statement).fetch_optional(&mut *tx).await?;
                tx.commit().await?;
                returned
            }
            Floor::SqliteOneCall(pool) => {
                let mut conn = pool.acquire().await?;
                // Every statement's rows, or the COMMIT after the first row
                // would never run.
                let one_call = format!("BEGIN IMMEDIATE; {statement}; COMMIT");
                let returned: Vec<i64> = query!(&one_call).fetch_all(&mut *conn).await?;
                returned.first().copied()
            }
            Floor::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                let returned = query!(statement).fetch_optional(&mut *tx).await?;
                tx.commit().await?;
                returned
            }
        })
    }

    async fn close(self) {
        match self {
            Floor::Sqlite(pool) | Floor::SqliteOneCall(pool) => pool.close().await,
            Floor::Postgres(pool) => pool.close().await,
        }
    }
}
