//! Test databases: a fresh SQLite file per test, or a fresh PostgreSQL schema
//! per test in the shared test database.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use anyhow::{ensure, Context};
use chrono::{SubsecRound, Utc};
use laneway::clock::{Clock, ManualClock, SystemClock};
use laneway::config::{self, DatabaseConfig};
use laneway::lanes::{LaneMode, LaneRule, LaneRules};
use laneway::op::{Op, OpId, Priority, Status};
use laneway::queue::postgres::PgQueue;
use laneway::queue::sqlite::SqliteQueue;
use laneway::queue::{prelude::*, Cas, Claimed, Completion, LeaseSpec, Limits, OpFilter, QueueError};
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

impl TestDb {
    /// Runs SQL on the database as a hand (or a broken tool) would, outside
    /// the queue: `sqlite` on SQLite, `postgres` on PostgreSQL.
    pub async fn tamper(&self, sqlite: &[&str], postgres: &[&str]) -> anyhow::Result<()> {
        match &self.kind {
            TestBackend::Sqlite(q) => {
                for statement in sqlite {
                    sqlx::query(statement).execute(q.pool()).await?;
                }
            }
            TestBackend::Postgres(q) => {
                for statement in postgres {
                    sqlx::query(statement).execute(q.pool()).await?;
                }
            }
        }
        Ok(())
    }
}

/// What the harness's [`QueueExt::claim`] may take: the dispatcher never
/// claims by filter (it claims the ids its scheduler chose), so this lives
/// with the tests.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// Only ops of this outbox (all outboxes when `None`).
    pub outbox: Option<String>,
    /// Only ops of these kinds (all kinds when `None`).
    pub kinds: Option<Vec<String>>,
    /// At most this many ops.
    pub limit: u32,
    /// The lease to take them under.
    pub lease: LeaseSpec,
}

/// An op as the harness's [`QueueExt::candidates`] reads it.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The op.
    pub op: Op,
    /// Its subject is halted.
    pub subject_halted: bool,
}

/// Shorthands the conformance cases use, each built on the paths the
/// dispatcher runs (`settle_then_claim`, `scan`), so no backend keeps a
/// statement only tests call.
#[async_trait::async_trait]
pub trait QueueExt {
    /// Up to `limit` due pending ops in dispatch order, lanes ignored (every
    /// kind serial without a cap).
    async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Claimed>, QueueError>;
    /// Settles, claiming nothing.
    async fn complete(&self, completions: &[Completion]) -> Result<Vec<Cas>, QueueError>;
    /// Claims these ids under the lane rules, settling nothing.
    async fn claim_ids(&self, ids: &[OpId], lease: &LeaseSpec, rules: &LaneRules) -> Result<Vec<Claimed>, QueueError>;
    /// Settles, then claims, with no claim depending on a settle.
    async fn settle_and_claim(
        &self,
        completions: &[Completion],
        ids: &[OpId],
        lease: &LeaseSpec,
        rules: &LaneRules,
    ) -> Result<(Vec<Cas>, Vec<Claimed>), QueueError>;
    /// An outbox's non-terminal ops in dispatch order, with their subject's halt.
    async fn candidates(&self, outbox: &str, limit: u32) -> Result<Vec<Candidate>, QueueError>;
}

#[async_trait::async_trait]
impl<Q: Queue + ?Sized> QueueExt for Q {
    async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Claimed>, QueueError> {
        let pending = self
            .list(&OpFilter {
                status: Some(Status::Pending),
                outbox: request.outbox.clone(),
                limit: request.limit.saturating_mul(4).max(256),
                ..OpFilter::default()
            })
            .await?;
        let mut order: Vec<(Priority, OpId)> = pending
            .iter()
            .filter(|o| request.kinds.as_ref().is_none_or(|k| k.contains(&o.kind)))
            .map(|o| (o.priority, o.id))
            .collect();
        order.sort();
        let free = LaneRule {
            mode: LaneMode::Serial,
            cap: usize::MAX,
        };
        let rules = LaneRules(pending.iter().map(|o| (o.kind.clone(), free)).collect());
        let want = usize::try_from(request.limit).unwrap_or(usize::MAX);
        let mut claimed: Vec<Claimed> = Vec::new();
        let mut rest: &[(Priority, OpId)] = &order;
        // Ops not due yet are left out by the store: go on past them.
        while claimed.len() < want && !rest.is_empty() {
            let (now, later) = rest.split_at((want - claimed.len()).min(rest.len()));
            let ids: Vec<OpId> = now.iter().map(|(_, id)| *id).collect();
            claimed.extend(self.claim_ids(&ids, &request.lease, &rules).await?);
            rest = later;
        }
        claimed.sort_by_key(|c| (c.op.priority, c.op.id));
        Ok(claimed)
    }

    async fn complete(&self, completions: &[Completion]) -> Result<Vec<Cas>, QueueError> {
        let lease = LeaseSpec {
            owner: "harness".to_owned(),
            duration: std::time::Duration::from_secs(30),
        };
        Ok(self
            .settle_then_claim(completions, &[], &[], &lease, &LaneRules::default())
            .await?
            .0)
    }

    async fn claim_ids(&self, ids: &[OpId], lease: &LeaseSpec, rules: &LaneRules) -> Result<Vec<Claimed>, QueueError> {
        Ok(self.settle_then_claim(&[], ids, &[], lease, rules).await?.1)
    }

    async fn settle_and_claim(
        &self,
        completions: &[Completion],
        ids: &[OpId],
        lease: &LeaseSpec,
        rules: &LaneRules,
    ) -> Result<(Vec<Cas>, Vec<Claimed>), QueueError> {
        self.settle_then_claim(completions, ids, &[], lease, rules).await
    }

    async fn candidates(&self, outbox: &str, limit: u32) -> Result<Vec<Candidate>, QueueError> {
        let mut out = Vec::new();
        for row in self.scan(outbox, None, limit).await? {
            if let Some(op) = self.get(row.id).await? {
                out.push(Candidate {
                    op,
                    subject_halted: row.subject_halted,
                });
            }
        }
        Ok(out)
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

/// A fresh test schema's name: `lwtest_<unix seconds>_<uuid>`, so that a
/// sweep can tell a schema left behind by a run that panicked long ago
/// from one a run going on right now (this one, or another test process on
/// the same server) is using.
pub fn pg_schema_name() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("lwtest_{now}_{}", uuid::Uuid::new_v4().simple())
}

/// Schemas older than this are left behind by a run that died.
const PG_STALE_AFTER_SECS: u64 = 3600;

/// Drops schemas left behind by earlier runs that panicked, once per run,
/// before this run creates any. Only old ones: dropping every `lwtest_`
/// schema dropped those of tests already running (a test on a schema of
/// its own, or a second test process), which then failed with "schema does
/// not exist".
async fn pg_sweep() -> anyhow::Result<()> {
    PG_READY
        .get_or_try_init(|| async {
            let mut conn = PgConnection::connect(&pg_url())
                .await
                .with_context(|| format!("PostgreSQL at {} is required for these tests", pg_url()))?;
            let all: Vec<String> =
                sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'lwtest\\_%'")
                    .fetch_all(&mut conn)
                    .await?;
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            // Names without a time are from before it was added: old.
            let stale = all.into_iter().filter(|name| {
                name.split('_')
                    .nth(1)
                    .and_then(|t| t.parse::<u64>().ok())
                    .is_none_or(|created| created + PG_STALE_AFTER_SECS < now)
            });
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
    let schema = pg_schema_name();
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

/// Runs `test` with a PostgreSQL URL naming a schema of its own (swept like
/// every test schema), so each host opens its own pool on its own runtime.
pub async fn with_own_pg_schema<F, Fut>(test: F) -> anyhow::Result<()>
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    use sqlx::Connection as _;
    pg_sweep().await?;
    let schema = pg_schema_name();
    let mut conn = sqlx::PgConnection::connect(&crate::support::pg_url()).await?;
    sqlx::query(&format!("CREATE SCHEMA \"{schema}\""))
        .execute(&mut conn)
        .await?;
    let separator = if crate::support::pg_url().contains('?') {
        '&'
    } else {
        '?'
    };
    let url = format!(
        "{}{separator}options=-c%20search_path%3D{schema}",
        crate::support::pg_url()
    );
    let result = test(url).await;
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&mut conn)
        .await?;
    result
}

/// A host on a runtime of its own, on a thread of its own, so that a test
/// can kill it mid-call (`shutdown_background`: no graceful shutdown, no
/// settle, its leases just stay, as after kill -9). It opens and migrates
/// the queue, then `start` starts the host (and leaks it, so nothing stops
/// it but the runtime's end) and says what it enqueued.
pub fn doomed_host<T, F, Fut>(config: config::Config, start: F) -> anyhow::Result<(tokio::runtime::Runtime, T)>
where
    T: Send + 'static,
    F: FnOnce(Arc<dyn Queue>, config::Config) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    std::thread::spawn(move || -> anyhow::Result<(tokio::runtime::Runtime, T)> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let started = runtime.block_on(async {
            let queue = laneway::queue::open(&config.database, config.limits(), Arc::new(SystemClock)).await?;
            queue.migrate().await?;
            start(queue, config).await
        })?;
        Ok((runtime, started))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the doomed host's thread panicked"))?
}

/// The `laneway` binary `./dev test` builds beside the tests (the dev
/// profile: the release binary's code, built once with the tests' deps).
pub(crate) fn laneway_binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("LW_LANEWAY_BIN") {
        return Ok(PathBuf::from(path));
    }
    // target/<profile>/deps/it-… → target/<profile>/laneway
    let exe = std::env::current_exe()?;
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|dir| dir.join("laneway"))
        .context("the test binary's directory")?;
    ensure!(
        bin.exists(),
        "{} is missing: run ./dev test, or cargo build -p laneway first",
        bin.display()
    );
    Ok(bin)
}

/// A `laneway` process, killed (and reaped) when dropped.
pub(crate) struct Process(pub(crate) std::process::Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `laneway --config CONFIG migrate`, which must succeed.
pub(crate) fn migrate_with(bin: &Path, config: &Path) -> anyhow::Result<()> {
    let status = std::process::Command::new(bin)
        .arg("--config")
        .arg(config)
        .arg("migrate")
        .stdout(std::process::Stdio::null())
        .status()?;
    ensure!(status.success(), "migrate: {status}");
    Ok(())
}

/// Waits until `GET {base}/healthz` answers 2xx.
pub(crate) async fn wait_healthy(base: &str) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    while !http
        .get(format!("{base}/healthz"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "laneway did not start at {base}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    Ok(())
}
