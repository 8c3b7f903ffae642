//! Test databases: a fresh SQLite file per test, or a fresh PostgreSQL schema
//! per test in the shared test database.

use std::str::FromStr;
use std::sync::Arc;

use anyhow::Context;
use chrono::{SubsecRound, Utc};
use laneway::clock::ManualClock;
use laneway::config::{self, DatabaseConfig};
use laneway::queue::postgres::PgQueue;
use laneway::queue::sqlite::SqliteQueue;
use laneway::queue::{Limits, Queue};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};
use tokio::sync::OnceCell;

/// Where the PostgreSQL tests connect.
pub fn pg_url() -> String {
    std::env::var("TEST_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A migrated queue on a throwaway database, with a clock the test moves.
pub struct TestDb {
    pub queue: Arc<dyn Queue>,
    pub clock: ManualClock,
    pub kind: TestBackend,
    // Keeps the SQLite file alive for the test's duration.
    _dir: Option<tempfile::TempDir>,
}

/// The concrete backend, for the tests that need its own API.
pub enum TestBackend {
    Sqlite(SqliteQueue),
    Postgres(PgQueue),
}

fn database_config(url: &str) -> anyhow::Result<DatabaseConfig> {
    let mut config = config::from_toml_str("").context("default config")?.database;
    config.url = url.to_owned();
    Ok(config)
}

fn clock() -> ManualClock {
    ManualClock::new(Utc::now().trunc_subsecs(3))
}

/// An unmigrated SQLite queue in a fresh directory.
pub async fn sqlite_unmigrated() -> anyhow::Result<TestDb> {
    let dir = tempfile::tempdir()?;
    let url = format!("sqlite://{}", dir.path().join("laneway.db").display());
    let clock = clock();
    let queue = SqliteQueue::open(&database_config(&url)?, Limits::default(), Arc::new(clock.clone())).await?;
    Ok(TestDb {
        queue: Arc::new(queue.clone()),
        clock,
        kind: TestBackend::Sqlite(queue),
        _dir: Some(dir),
    })
}

/// A migrated SQLite queue in a fresh directory.
pub async fn sqlite() -> anyhow::Result<TestDb> {
    let db = sqlite_unmigrated().await?;
    db.queue.migrate().await?;
    Ok(db)
}

static PG_READY: OnceCell<()> = OnceCell::const_new();

/// Drops schemas left behind by earlier runs that panicked, once per run,
/// before this run creates any.
async fn pg_sweep() -> anyhow::Result<()> {
    PG_READY
        .get_or_try_init(|| async {
            let mut conn = PgConnection::connect(&pg_url())
                .await
                .with_context(|| format!("PostgreSQL at {} is required for these tests", pg_url()))?;
            let stale: Vec<String> =
                sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'lwtest\\_%'")
                    .fetch_all(&mut conn)
                    .await?;
            for schema in stale {
                sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
                    .execute(&mut conn)
                    .await?;
            }
            anyhow::Ok(())
        })
        .await?;
    Ok(())
}

/// An unmigrated PostgreSQL queue in a fresh schema.
pub async fn postgres_unmigrated() -> anyhow::Result<TestDb> {
    pg_sweep().await?;
    let schema = format!("lwtest_{}", uuid::Uuid::new_v4().simple());
    let mut conn = PgConnection::connect(&pg_url()).await?;
    sqlx::query(&format!("CREATE SCHEMA \"{schema}\""))
        .execute(&mut conn)
        .await?;
    let options = PgConnectOptions::from_str(&pg_url())?.options([("search_path", schema.as_str())]);
    let clock = clock();
    let queue = PgQueue::open_with(
        options,
        &database_config(&pg_url())?,
        Limits::default(),
        Arc::new(clock.clone()),
    )
    .await?;
    Ok(TestDb {
        queue: Arc::new(queue.clone()),
        clock,
        kind: TestBackend::Postgres(queue),
        _dir: None,
    })
}

/// A migrated PostgreSQL queue in a fresh schema.
pub async fn postgres() -> anyhow::Result<TestDb> {
    let db = postgres_unmigrated().await?;
    db.queue.migrate().await?;
    Ok(db)
}

/// Runs the same async test body against both backends, as two tests.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() -> anyhow::Result<()> {
                    super::$name($crate::support::sqlite().await?).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() -> anyhow::Result<()> {
                    super::$name($crate::support::postgres().await?).await
                }
            )*
        }
    };
}
