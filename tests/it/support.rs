//! Test databases: a fresh SQLite file per test, or a fresh PostgreSQL schema
//! per test in the shared test database.

use std::str::FromStr;
use std::sync::Arc;

use anyhow::Context;
use chrono::{SubsecRound, Utc};
use laneway::clock::{Clock, ManualClock, SystemClock};
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

/// A migrated queue on a throwaway database. Its clock is `clock` (frozen
/// unless advanced), or the system clock for `live` databases, which tests
/// that run a dispatcher in real time use.
pub struct TestDb {
    pub queue: Arc<dyn Queue>,
    pub clock: ManualClock,
    pub kind: TestBackend,
    // Keeps the SQLite file alive for the test's duration.
    _dir: Option<tempfile::TempDir>,
}

impl TestDb {
    /// The SQLite database file (`None` on PostgreSQL).
    pub fn sqlite_path(&self) -> Option<std::path::PathBuf> {
        self._dir.as_ref().map(|d| d.path().join("laneway.db"))
    }
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

/// Sends laneway's logs to the test output (shown for failing tests).
/// `RUST_LOG` picks the level; the default shows warnings and errors.
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

fn clock() -> ManualClock {
    ManualClock::new(Utc::now().trunc_subsecs(3))
}

fn clock_for(live: bool, manual: &ManualClock) -> Arc<dyn Clock> {
    if live {
        Arc::new(SystemClock)
    } else {
        Arc::new(manual.clone())
    }
}

/// An unmigrated SQLite queue in a fresh directory.
pub async fn sqlite_unmigrated() -> anyhow::Result<TestDb> {
    sqlite_with(false, false).await
}

async fn sqlite_with(live: bool, migrate: bool) -> anyhow::Result<TestDb> {
    init_logs();
    let dir = tempfile::tempdir()?;
    let url = format!("sqlite://{}", dir.path().join("laneway.db").display());
    let clock = clock();
    let queue = SqliteQueue::open(&database_config(&url)?, Limits::default(), clock_for(live, &clock)).await?;
    let db = TestDb {
        queue: Arc::new(queue.clone()),
        clock,
        kind: TestBackend::Sqlite(queue),
        _dir: Some(dir),
    };
    if migrate {
        db.queue.migrate().await?;
    }
    Ok(db)
}

/// A migrated SQLite queue on the system clock.
pub async fn sqlite_live() -> anyhow::Result<TestDb> {
    sqlite_with(true, true).await
}

/// A migrated SQLite queue in a fresh directory.
pub async fn sqlite() -> anyhow::Result<TestDb> {
    sqlite_with(false, true).await
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
    postgres_with(false, false).await
}

/// A migrated PostgreSQL queue on the system clock.
pub async fn postgres_live() -> anyhow::Result<TestDb> {
    postgres_with(true, true).await
}

async fn postgres_with(live: bool, migrate: bool) -> anyhow::Result<TestDb> {
    init_logs();
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
        clock_for(live, &clock),
    )
    .await?;
    let db = TestDb {
        queue: Arc::new(queue.clone()),
        clock,
        kind: TestBackend::Postgres(queue),
        _dir: None,
    };
    if migrate {
        db.queue.migrate().await?;
    }
    Ok(db)
}

/// A migrated PostgreSQL queue in a fresh schema.
pub async fn postgres() -> anyhow::Result<TestDb> {
    postgres_with(false, true).await
}

/// Runs the same async test body against both backends, as two tests.
/// `live:` gives the tests databases on the system clock.
#[macro_export]
macro_rules! on_both_backends {
    (live: $($name:ident),* $(,)?) => {
        $crate::on_both_backends!(@with sqlite_live, postgres_live; $($name),*);
    };
    ($($name:ident),* $(,)?) => {
        $crate::on_both_backends!(@with sqlite, postgres; $($name),*);
    };
    (@with $sqlite:ident, $postgres:ident; $($name:ident),*) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() -> anyhow::Result<()> {
                    super::$name($crate::support::$sqlite().await?).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() -> anyhow::Result<()> {
                    super::$name($crate::support::$postgres().await?).await
                }
            )*
        }
    };
}
