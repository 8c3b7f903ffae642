//! The floors: plain job loops with no scheduler, no lanes and no leases,
//! on the same databases laneway uses, so `laneway bench` can say how much
//! of what the database can do laneway's drain gets.

use std::str::FromStr as _;
use std::time::Instant;

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
