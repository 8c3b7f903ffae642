//! `laneway bench`: laneway's benchmark, in one invocation, with figures
//! printed side by side from the same run (these machines are noisy; ratios
//! from one run hold). A tool, not a service: it uses `anyhow`, and builds
//! its own scratch databases, executors and fake inboxes.
//!
//! ```sh
//! laneway bench [--quick] [--only throughput,latency,activitypub,...]
//! ```
//!
//! Sections (pick with `--only a,b`; the default set is every section but
//! `soak`, `slow-fediverse` and `deep-backlog`; `--systems
//! full,normal,pg,graphile,plain,statements` narrows the throughput section):
//! - `throughput`: drain ops/s through a no-op executor: laneway on SQLite
//!   (`synchronous` full and normal) and PostgreSQL; beside them, in the same
//!   run, the plain job loops with no scheduler at all (PostgreSQL `SELECT …
//!   FOR UPDATE SKIP LOCKED LIMIT 100` + update + one history row per job, 2
//!   clients; SQLite the same batches in one durable transaction each), and
//!   graphile-worker 0.17.3 on the same PostgreSQL (installed with npm into
//!   a cache folder; left out with a note when `npm` is missing), and
//!   laneway's own SQLite dispatch statements looped with no host around
//!   them (what its schema lets the single writer do); min and median, and
//!   the ratios.
//! - `latency`: enqueue → executor start, p50/p99: in-process producers,
//!   plain-SQL producers on another connection, and the `laneway enqueue`
//!   CLI (another process; its wall time too); beside them the floor, two
//!   durable transactions through the same driver (a plain job inserted,
//!   then claimed by id in the task the insert woke; on SQLite also with
//!   each transaction sent as one call), and each store's p50 less its
//!   floor: the host's own share.
//! - `activitypub`: the real `activitypub` plugin, RSA-signed through the
//!   host signer, fanning out to 50 local inboxes (each its own server) that
//!   answer in 20 ms (`--answer-ms`); under it the CPU budget per op the 1,500
//!   ops/s target leaves on this machine's cores, against one signature's
//!   cost measured in the same run.
//! - `slow-fediverse`: one activity to 5,000 inboxes answering in 200 ms,
//!   1% of the servers hanging until the timeout (`--inboxes N` scales it,
//!   `--hanging-percent P` sets the share), with the shipped config and
//!   with slow attempts off.
//! - `signing`: RSA-2048 PKCS#1 v1.5 SHA-256 signatures per second,
//!   `aws-lc-rs` (the host signer) against `ring` and the `rsa` crate, and
//!   Ed25519.
//! - `stellar-pool`: referral payouts through the real `stellar-vault`
//!   plugin and the fake RPC, from the signer alone and through pools of
//!   1, 4 and 8 channel accounts (a ledger a second): transactions a
//!   ledger against the pool's ceiling (its size).
//! - `backlog`: PostgreSQL rows read per settled op with 10k and with 1M ops
//!   waiting (`--backlog N` changes the big one).
//! - `lanes`: 10,000 strict lanes with 5 ops each.
//! - `settle`: PostgreSQL settle µs per op (100 a settle) with 10 and with
//!   5,000 other ops in flight: the same, or a settle scans what is in flight.
//! - `deep-backlog`: 4 outboxes of 20,000 ops each over 20 strict inbox
//!   lanes on 3 destination hosts, every lane crowded, 5 ms an op: starts
//!   per second against the same lanes 1,000 ops deep.
//! - `soak`: `--soak N` ops (default 1M) through a no-op executor on SQLite
//!   with a producer keeping about 20k waiting, once without pruning and
//!   once with retention at 5 s (the pruner every 500 ms).
//!
//! PostgreSQL is `TEST_PG_URL` (default `postgres://postgres@127.0.0.1:5432/test`);
//! every run uses a fresh schema and drops it. Peak RSS is printed at the end.

mod activitypub;
mod plain;
mod settle;
mod stellar;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::SystemClock;
use crate::config::{Config, Synchronous};
use crate::dispatch::Dispatcher;
use crate::executor::{Attempt, Executor, Executors, Registry};
use crate::op::{Op, OpId, Status};
use crate::outcome::Outcome;
use crate::queue::postgres::PgQueue;
use crate::queue::sqlite::SqliteQueue;
use crate::queue::{prelude::*, NewOp};
use anyhow::{bail, Context};
use async_trait::async_trait;
use tokio::sync::mpsc;

/// Confirms after `delay` (at once when zero), and reports when each op
/// started.
struct NoOp {
    started: mpsc::UnboundedSender<(OpId, Instant)>,
    delay: Duration,
}

#[async_trait]
impl Executor for NoOp {
    async fn execute(&self, op: &Op, _attempt: Attempt) -> Outcome {
        let _ = self.started.send((op.id, Instant::now()));
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        Outcome::confirmed()
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Store {
    SqliteFull,
    SqliteNormal,
    Postgres,
}

impl Store {
    fn name(self) -> &'static str {
        match self {
            Store::SqliteFull => "laneway sqlite (synchronous=full)",
            Store::SqliteNormal => "laneway sqlite (synchronous=normal)",
            Store::Postgres => "laneway postgres",
        }
    }
}

/// A queue in a scratch place (a temp dir or a fresh schema), dropped after.
struct Scratch {
    queue: Arc<dyn Queue>,
    config: Config,
    _dir: tempfile::TempDir,
    schema: Option<ScratchSchema>,
    /// A connection string a plain-SQL producer would use.
    url: String,
    options: Option<sqlx::postgres::PgConnectOptions>,
}

impl Scratch {
    async fn new(store: Store, extra: &str) -> anyhow::Result<Self> {
        let mut config = crate::config::from_toml_str(&format!(
            "[dispatch]\nmax_in_flight = 256\noutbox_max_in_flight = 128\n\
             [kinds.bench]\nlanes = \"optional\"\n{extra}"
        ))?;
        let dir = tempfile::tempdir()?;
        match store {
            Store::Postgres => {
                let url = pg_url();
                let schema = ScratchSchema::create("lwbench").await?;
                config.database.url = url.clone();
                let options =
                    sqlx::postgres::PgConnectOptions::from_str(&url)?.options([("search_path", schema.name.as_str())]);
                let queue: Arc<dyn Queue> = Arc::new(
                    PgQueue::open_with(
                        options.clone(),
                        &config.database,
                        config.limits(),
                        Arc::new(SystemClock),
                    )
                    .await?,
                );
                queue.migrate().await?;
                Ok(Self {
                    queue,
                    config,
                    _dir: dir,
                    schema: Some(schema),
                    url,
                    options: Some(options),
                })
            }
            Store::SqliteFull | Store::SqliteNormal => {
                config.database.url = format!("sqlite://{}", dir.path().join("bench.db").display());
                config.database.sqlite.synchronous = if store == Store::SqliteFull {
                    Synchronous::Full
                } else {
                    Synchronous::Normal
                };
                let queue: Arc<dyn Queue> =
                    Arc::new(SqliteQueue::open(&config.database, config.limits(), Arc::new(SystemClock)).await?);
                queue.migrate().await?;
                let url = config.database.url.clone();
                Ok(Self {
                    queue,
                    config,
                    _dir: dir,
                    schema: None,
                    url,
                    options: None,
                })
            }
        }
    }

    fn dispatcher(&self) -> (Dispatcher, mpsc::UnboundedReceiver<(OpId, Instant)>) {
        self.dispatcher_with(Duration::ZERO)
    }

    /// A dispatcher whose executor takes `delay` per op.
    fn dispatcher_with(&self, delay: Duration) -> (Dispatcher, mpsc::UnboundedReceiver<(OpId, Instant)>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut executors = Executors::new();
        executors.insert(
            "bench".into(),
            Arc::new(NoOp { started: tx, delay }) as Arc<dyn Executor>,
        );
        let dispatcher = Dispatcher::new(
            self.queue.clone(),
            Arc::new(Registry::new(executors)),
            self.config.clone(),
            Arc::new(SystemClock),
        );
        (dispatcher, rx)
    }

    async fn open_ops(&self) -> anyhow::Result<i64> {
        open_ops(self.queue.as_ref()).await
    }

    async fn drop(self) -> anyhow::Result<()> {
        if let Some(schema) = self.schema {
            schema.drop().await?;
        }
        Ok(())
    }
}

/// A fresh PostgreSQL schema for one run, dropped by [`ScratchSchema::drop`].
struct ScratchSchema {
    admin: sqlx::PgPool,
    name: String,
}

impl ScratchSchema {
    async fn create(prefix: &str) -> anyhow::Result<Self> {
        let name = format!("{prefix}_{}_{}", std::process::id(), rand_suffix());
        let admin = sqlx::PgPool::connect(&pg_url()).await?;
        sqlx::query(&format!("CREATE SCHEMA {name}")).execute(&admin).await?;
        Ok(Self { admin, name })
    }

    async fn drop(self) -> anyhow::Result<()> {
        sqlx::query(&format!("DROP SCHEMA {} CASCADE", self.name))
            .execute(&self.admin)
            .await?;
        Ok(())
    }
}

/// Ops not yet terminal.
async fn open_ops(queue: &dyn Queue) -> anyhow::Result<i64> {
    Ok(queue
        .depth()
        .await?
        .iter()
        .filter(|d| matches!(d.status, Status::Pending | Status::Submitted))
        .map(|d| d.count)
        .sum())
}

fn pg_url() -> String {
    std::env::var("TEST_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

fn rand_suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_owned()
}

fn ops(n: usize, outboxes: usize, lanes: usize) -> Vec<NewOp> {
    (0..n)
        .map(|i| {
            let mut op = NewOp::new(format!("outbox-{}", i % outboxes), "bench", "{}");
            op.lanes = vec![format!("lane-{}", i % lanes)];
            op
        })
        .collect()
}

async fn enqueue_all(queue: &dyn Queue, all: &[NewOp]) -> anyhow::Result<()> {
    for chunk in all.chunks(1000) {
        queue.enqueue(chunk).await?;
    }
    Ok(())
}

/// Drains what is queued; ops/s from the dispatcher's start to the last commit.
async fn drain(scratch: &Scratch) -> anyhow::Result<f64> {
    let total = scratch.open_ops().await?;
    let (dispatcher, mut started) = scratch.dispatcher();
    let runner = dispatcher.clone();
    let handle = tokio::spawn(async move { runner.run().await });
    let start = Instant::now();
    // Counting starts costs the queue nothing; only the last settles are
    // waited for by asking the database.
    for _ in 0..total {
        started.recv().await.context("executor gone")?;
    }
    while scratch.open_ops().await? > 0 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let seconds = start.elapsed().as_secs_f64();
    dispatcher.shutdown();
    handle.await??;
    Ok(total as f64 / seconds)
}

async fn laneway_round(store: Store, n: usize) -> anyhow::Result<f64> {
    let scratch = Scratch::new(store, "").await?;
    enqueue_all(scratch.queue.as_ref(), &ops(n, 8, n)).await?;
    let rate = drain(&scratch).await?;
    scratch.drop().await?;
    Ok(rate)
}

/// graphile-worker's side of the comparison, run with Node.
const GRAPHILE_SCRIPT: &str = include_str!("../../../tests/tools/graphile_bench.mjs");

/// Installs graphile-worker into a scratch folder once; `None` when npm or
/// node is missing (the section says so instead of failing).
fn graphile_dir() -> anyhow::Result<Option<PathBuf>> {
    let dir = std::env::temp_dir().join("laneway-bench/graphile-worker");
    let script = dir.join("graphile_bench.mjs");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(&script, GRAPHILE_SCRIPT)?;
    if !dir.join("node_modules/graphile-worker/package.json").exists() {
        eprintln!("bench: installing graphile-worker@0.17.3 into {}", dir.display());
        let status = std::process::Command::new("npm")
            .args([
                "install",
                "--silent",
                "--no-audit",
                "--no-fund",
                "graphile-worker@0.17.3",
            ])
            .current_dir(&dir)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => bail!("npm install graphile-worker failed: {s}"),
            Err(e) => {
                eprintln!("bench: npm not available ({e}); graphile-worker is left out");
                return Ok(None);
            }
        }
    }
    Ok(Some(dir))
}

async fn graphile_round(dir: &Path, n: usize) -> anyhow::Result<f64> {
    let url = pg_url();
    let schema = format!("gwbench_{}_{}", std::process::id(), rand_suffix());
    let mut command = std::process::Command::new("node");
    command
        .arg(dir.join("graphile_bench.mjs"))
        .args([url.as_str(), schema.as_str(), &n.to_string(), "16"]);
    let out = tokio::task::spawn_blocking(move || command.output())
        .await?
        .context("running node")?;
    let admin = sqlx::PgPool::connect(&url).await?;
    sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .execute(&admin)
        .await?;
    if !out.status.success() {
        bail!("graphile-worker bench failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let line = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value = serde_json::from_str(line.trim().lines().last().unwrap_or_default())
        .with_context(|| format!("graphile-worker bench printed {line:?}"))?;
    json["drain_per_s"].as_f64().context("no drain_per_s")
}

fn summary(rates: &[f64]) -> (f64, f64) {
    let mut sorted = rates.to_vec();
    sorted.sort_by(f64::total_cmp);
    (sorted[0], sorted[sorted.len() / 2])
}

async fn throughput(n: usize, rounds: usize, systems: &[String]) -> anyhow::Result<()> {
    println!("\n## Drain throughput: {n} ops, no-op executor, 8 outboxes, {rounds} alternating rounds");
    let wants = |s: &str| systems.is_empty() || systems.iter().any(|x| x == s);
    let graphile = if wants("graphile") { graphile_dir()? } else { None };
    let stores: Vec<Store> = [
        ("full", Store::SqliteFull),
        ("normal", Store::SqliteNormal),
        ("pg", Store::Postgres),
    ]
    .into_iter()
    .filter(|(name, _)| wants(name))
    .map(|(_, store)| store)
    .collect();
    let mut results: HashMap<&'static str, Vec<f64>> = HashMap::new();
    let mut splits = Vec::new();
    for round in 0..rounds {
        for &store in &stores {
            let rate = laneway_round(store, n).await?;
            eprintln!("  round {round}: {}: {rate:.0} ops/s", store.name());
            results.entry(store.name()).or_default().push(rate);
        }
        if let Some(dir) = &graphile {
            let rate = graphile_round(dir, n).await?;
            eprintln!("  round {round}: graphile-worker 0.17.3: {rate:.0} ops/s");
            results.entry(GRAPHILE).or_default().push(rate);
        }
        if wants("plain") {
            let rate = plain::postgres_round(n, 2).await?;
            eprintln!("  round {round}: {PLAIN_PG}: {rate:.0} ops/s");
            results.entry(PLAIN_PG).or_default().push(rate);
            let rate = plain::sqlite_round(n).await?;
            eprintln!("  round {round}: {PLAIN_SQLITE}: {rate:.0} ops/s");
            results.entry(PLAIN_SQLITE).or_default().push(rate);
        }
        if wants("statements") {
            let (rate, split) = plain::sqlite_statements_round(n).await?;
            eprintln!("  round {round}: {STATEMENTS_SQLITE}: {rate:.0} ops/s");
            splits.push(split);
            results.entry(STATEMENTS_SQLITE).or_default().push(rate);
        }
    }
    println!("| system | min ops/s | median ops/s |");
    println!("|---|---|---|");
    let mut names: Vec<_> = results.keys().copied().collect();
    names.sort_unstable();
    for name in &names {
        let (min, median) = summary(&results[name]);
        println!("| {name} | {min:.0} | {median:.0} |");
    }
    let median = |name: &str| results.get(name).map(|r| summary(r).1);
    let pg = Store::Postgres.name();
    let full = Store::SqliteFull.name();
    for (what, ours, theirs, target) in [
        (
            "laneway PostgreSQL / graphile-worker (batched)",
            pg,
            GRAPHILE,
            "target >= 1.5x",
        ),
        (
            "laneway PostgreSQL / plain SKIP LOCKED loop",
            pg,
            PLAIN_PG,
            "target >= 0.60x",
        ),
        (
            "laneway SQLite full / plain SQLite loop",
            full,
            PLAIN_SQLITE,
            "target >= 0.40x",
        ),
        (
            "laneway's SQLite statements alone / plain SQLite loop",
            STATEMENTS_SQLITE,
            PLAIN_SQLITE,
            "the schema's ceiling for the line above",
        ),
        (
            "laneway SQLite full / its statements alone",
            full,
            STATEMENTS_SQLITE,
            "what the host keeps of its statements",
        ),
    ] {
        if let (Some(a), Some(b)) = (median(ours), median(theirs)) {
            println!("ratio {what} (medians): {:.2}x ({target})", a / b);
        }
    }
    for (round, split) in splits.iter().enumerate() {
        println!("round {round}: laneway's SQLite statements alone, wall µs per op: {split}");
    }
    Ok(())
}

/// The latency floors' names in the table.
const FLOOR_SQLITE: &str = "floor: plain SQLite, two durable transactions (insert; claim in the task it woke)";
const FLOOR_SQLITE_ONE_CALL: &str =
    "floor: plain SQLite, each transaction one multi-statement call (insert; claim in the task it woke)";
const FLOOR_PG: &str = "floor: plain PostgreSQL, two durable transactions (insert; claim in the task it woke)";

/// The names of the comparison systems in the table.
const STATEMENTS_SQLITE: &str =
    "laneway's own SQLite statements alone (100/batch, one connection, no host, synchronous=full)";
const GRAPHILE: &str = "graphile-worker 0.17.3 (16 workers, batched completion)";
const PLAIN_PG: &str = "plain PostgreSQL loop (SKIP LOCKED, 100/batch, history row, 2 clients)";
const PLAIN_SQLITE: &str = "plain SQLite loop (100/batch, history row, synchronous=full)";

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort_unstable();
    let i = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[i.min(samples.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

/// How a latency sample's op gets into the queue.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Producer {
    /// `Dispatcher::enqueue` in the host's own process.
    InProcess,
    /// A plain SQL insert on a connection of its own (as another program).
    PlainSql,
    /// The `laneway enqueue` command.
    Cli,
}

/// One latency row; returns its p50.
async fn latency_samples(store: Store, producer: Producer, samples: usize) -> anyhow::Result<Duration> {
    let scratch = Scratch::new(store, "").await?;
    let (dispatcher, mut started) = scratch.dispatcher();
    let runner = dispatcher.clone();
    let handle = tokio::spawn(async move { runner.run().await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let config_file = scratch._dir.path().join("bench.toml");
    let payload_file = scratch._dir.path().join("payload.json");
    std::fs::write(&payload_file, "{}")?;
    std::fs::write(
        &config_file,
        format!(
            "[database]\nurl = {:?}\n[kinds.bench]\nlanes = \"optional\"\n",
            scratch.config.database.url
        ),
    )?;
    // This very binary: `laneway bench` measures the `laneway` it is.
    let laneway_bin = std::env::current_exe()?;
    let sqlite_producer = match (store, producer) {
        (Store::SqliteFull | Store::SqliteNormal, Producer::PlainSql) => {
            Some(sqlx::SqlitePool::connect(&scratch.url).await?)
        }
        _ => None,
    };
    let pg_producer = match (&scratch.options, producer) {
        (Some(options), Producer::PlainSql) => Some(sqlx::PgPool::connect_with(options.clone()).await?),
        _ => None,
    };
    let mut latencies = Vec::with_capacity(samples);
    let mut walls = Vec::new();
    for i in 0..samples {
        let t0 = Instant::now();
        match producer {
            Producer::InProcess => {
                let mut op = NewOp::new("latency", "bench", "{}");
                op.lanes = vec![format!("l{i}")];
                dispatcher.enqueue(&[op]).await?;
            }
            Producer::PlainSql => {
                let lanes_sqlite = format!("[\"l{i}\"]");
                if let Some(pool) = &sqlite_producer {
                    sqlx::query(
                        "INSERT INTO laneway_ops (outbox, kind, lanes, payload) VALUES ('latency', 'bench', ?, '{}')",
                    )
                    .bind(lanes_sqlite)
                    .execute(pool)
                    .await?;
                } else if let Some(pool) = &pg_producer {
                    sqlx::query(
                        "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('latency', 'bench', ARRAY[$1], '{}')",
                    )
                    .bind(format!("l{i}"))
                    .execute(pool)
                    .await?;
                }
            }
            Producer::Cli => {
                let mut command = std::process::Command::new(&laneway_bin);
                command.arg("--config").arg(&config_file).args([
                    "enqueue",
                    "--kind",
                    "bench",
                    "--outbox",
                    "latency",
                    "--lane",
                    &format!("l{i}"),
                    "--payload",
                ]);
                command.arg(&payload_file);
                let out = tokio::task::spawn_blocking(move || command.output())
                    .await?
                    .with_context(|| {
                        format!(
                            "running {} (build it with cargo build --release -p laneway)",
                            laneway_bin.display()
                        )
                    })?;
                if !out.status.success() {
                    bail!("laneway enqueue failed: {}", String::from_utf8_lossy(&out.stderr));
                }
                walls.push(t0.elapsed());
            }
        }
        let (_, at) = tokio::time::timeout(Duration::from_secs(10), started.recv())
            .await
            .context("the op did not start within 10 s")?
            .context("executor gone")?;
        latencies.push(at.saturating_duration_since(t0));
        // Let the settle commit before the next sample, as separate arrivals.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    dispatcher.shutdown();
    handle.await??;
    scratch.drop().await?;
    let name = match producer {
        Producer::InProcess => "in-process",
        Producer::PlainSql => "plain SQL, another connection",
        Producer::Cli => "`laneway enqueue`, another process",
    };
    let p50 = percentile(&mut latencies, 0.5);
    let p99 = percentile(&mut latencies, 0.99);
    print!("| {} | {name} | {} | {} |", store.name(), ms(p50), ms(p99));
    if walls.is_empty() {
        println!(" |");
    } else {
        println!(" CLI wall p50 {} |", ms(percentile(&mut walls, 0.5)));
    }
    Ok(p50)
}

async fn latency(samples: usize) -> anyhow::Result<()> {
    println!("\n## Enqueue → start latency ({samples} sequential ops each)");
    println!("| store | producer | p50 | p99 | |");
    println!("|---|---|---|---|---|");
    let mut in_process = Vec::new();
    for (store, producer) in [
        (Store::SqliteFull, Producer::InProcess),
        (Store::Postgres, Producer::InProcess),
        (Store::SqliteFull, Producer::PlainSql),
        (Store::Postgres, Producer::PlainSql),
        (Store::SqliteFull, Producer::Cli),
    ] {
        let n = if producer == Producer::Cli {
            samples.min(50)
        } else {
            samples
        };
        let p50 = latency_samples(store, producer, n).await?;
        if producer == Producer::InProcess {
            in_process.push((store, p50));
        }
    }
    // The floor: what the two durable commits the crash story needs cost
    // through the same driver, with one hand-off between them and nothing
    // else, so a row above can be read against what the database allows.
    for (store, db, name) in [
        (Store::SqliteFull, plain::FloorDb::Sqlite, FLOOR_SQLITE),
        (Store::Postgres, plain::FloorDb::Postgres, FLOOR_PG),
        (Store::SqliteFull, plain::FloorDb::SqliteOneCall, FLOOR_SQLITE_ONE_CALL),
    ] {
        let (p50, p99) = plain::latency_floor(db, samples).await?;
        println!("| {name} | in-process | {} | {} | |", ms(p50), ms(p99));
        if let Some((_, ours)) = in_process.iter().find(|(s, _)| *s == store) {
            let ours = ours.as_secs_f64() * 1000.0;
            let floor = p50.as_secs_f64() * 1000.0;
            println!(
                "{}: p50 {ours:.2} ms, the floor {floor:.2} ms, the host's own {:.2} ms ({:.0}% of it)",
                store.name(),
                ours - floor,
                100.0 * (ours - floor) / ours.max(f64::EPSILON)
            );
        }
    }
    Ok(())
}

/// Rows PostgreSQL read from `ops` (heap fetches through indexes plus
/// sequential reads) and buffer hits, from its statistics views.
async fn pg_reads(pool: &sqlx::PgPool, schema: &str) -> anyhow::Result<(i64, i64)> {
    // Statistics are flushed by each backend at most once a second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (rows,): (i64,) = sqlx::query_as(
        "SELECT (COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0))::bigint FROM pg_stat_user_tables \
         WHERE schemaname = $1 AND relname = 'ops'",
    )
    .bind(schema)
    .fetch_one(pool)
    .await?;
    let (buffers,): (i64,) = sqlx::query_as(
        "SELECT (COALESCE(heap_blks_hit, 0) + COALESCE(heap_blks_read, 0) + COALESCE(idx_blks_hit, 0) \
         + COALESCE(idx_blks_read, 0))::bigint FROM pg_statio_user_tables WHERE schemaname = $1 AND relname = 'ops'",
    )
    .bind(schema)
    .fetch_one(pool)
    .await?;
    Ok((rows, buffers))
}

async fn backlog_cost(backlog: usize, settle: usize) -> anyhow::Result<(f64, f64, f64)> {
    let scratch = Scratch::new(Store::Postgres, "").await?;
    let (admin, schema) = scratch
        .schema
        .as_ref()
        .map(|s| (s.admin.clone(), s.name.clone()))
        .context("postgres")?;
    let pool = sqlx::PgPool::connect_with(scratch.options.clone().context("postgres")?).await?;
    // The backlog, inserted by SQL in bulk: one outbox, one lane per op.
    for start in (0..backlog).step_by(100_000) {
        let end = (start + 100_000).min(backlog);
        sqlx::query(
            "INSERT INTO ops (outbox, kind, lanes, payload) \
             SELECT 'backlog', 'bench', ARRAY['lane-' || g], '{}' FROM generate_series($1::bigint, $2::bigint) AS g",
        )
        .bind(start as i64)
        .bind(end as i64 - 1)
        .execute(&pool)
        .await?;
    }
    sqlx::query("ANALYZE ops").execute(&pool).await?;
    let (dispatcher, mut started) = scratch.dispatcher();
    let before = pg_reads(&admin, &schema).await?;
    let runner = dispatcher.clone();
    let handle = tokio::spawn(async move { runner.run().await });
    let start = Instant::now();
    for _ in 0..settle {
        started.recv().await.context("executor gone")?;
    }
    dispatcher.shutdown();
    handle.await??;
    let seconds = start.elapsed().as_secs_f64();
    let (_, _, confirmed) = counts(&pool).await?;
    let after = pg_reads(&admin, &schema).await?;
    drop(pool);
    scratch.drop().await?;
    let per_op = |a: i64, b: i64| (a - b) as f64 / confirmed.max(1) as f64;
    Ok((
        per_op(after.0, before.0),
        per_op(after.1, before.1),
        confirmed as f64 / seconds,
    ))
}

async fn counts(pool: &sqlx::PgPool) -> anyhow::Result<(i64, i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'submitted'), \
         count(*) FILTER (WHERE status = 'confirmed') FROM ops",
    )
    .fetch_one(pool)
    .await?)
}

async fn backlog(big: usize) -> anyhow::Result<()> {
    println!("\n## PostgreSQL cost per settled op against a backlog (20,000 ops settled)");
    println!("| ops waiting | rows read per op | buffers per op | ops/s |");
    println!("|---|---|---|---|");
    for waiting in [10_000, big] {
        let (rows, buffers, rate) = backlog_cost(waiting + 20_000, 20_000).await?;
        println!("| {waiting} | {rows:.1} | {buffers:.1} | {rate:.0} |");
    }
    Ok(())
}

async fn many_lanes() -> anyhow::Result<()> {
    println!("\n## 10,000 strict lanes, 5 ops each (one outbox)");
    println!("| store | ops/s |");
    println!("|---|---|");
    for store in [Store::SqliteFull, Store::Postgres] {
        let scratch = Scratch::new(store, "").await?;
        enqueue_all(scratch.queue.as_ref(), &ops(50_000, 1, 10_000)).await?;
        let rate = drain(&scratch).await?;
        scratch.drop().await?;
        println!("| {} | {rate:.0} |", store.name());
    }
    Ok(())
}

/// Ops of a deep backlog: `per_outbox` in each of `outboxes`, round-robin
/// over `lanes` inbox URLs on three destination hosts (the fault harness's
/// full-size backlog).
fn deep_ops(outboxes: usize, per_outbox: usize, lanes: usize) -> Vec<NewOp> {
    (0..outboxes * per_outbox)
        .map(|i| {
            let mut op = NewOp::new(format!("outbox-{}", i % outboxes), "bench", "{}");
            let lane = (i / outboxes) % lanes;
            op.lanes = vec![format!("https://host-{}.example/inbox/{lane}", lane % 3)];
            op
        })
        .collect()
}

/// Starts per second over the first `starts` ops of a backlog whose every
/// lane waits on a destination cap, each op taking 5 ms.
async fn deep_rate(store: Store, per_outbox: usize, starts: usize) -> anyhow::Result<f64> {
    let scratch = Scratch::new(store, "").await?;
    enqueue_all(scratch.queue.as_ref(), &deep_ops(4, per_outbox, 20)).await?;
    let (dispatcher, mut started) = scratch.dispatcher_with(Duration::from_millis(5));
    let runner = dispatcher.clone();
    let handle = tokio::spawn(async move { runner.run().await });
    let start = Instant::now();
    for _ in 0..starts {
        started.recv().await.context("executor gone")?;
    }
    let seconds = start.elapsed().as_secs_f64();
    dispatcher.shutdown();
    handle.await??;
    scratch.drop().await?;
    Ok(starts as f64 / seconds)
}

/// A backlog many windows deep with every lane crowded, against a shallow
/// one with the same lanes: the deep one should not start ops more slowly.
async fn deep_backlog(deep: usize) -> anyhow::Result<()> {
    let starts = 3_000;
    println!("\n## A deep backlog: 4 outboxes, 20 strict inbox lanes on 3 hosts (8 in flight each), 5 ms an op");
    println!("| store | ops/s, 1,000 per outbox | ops/s, {deep} per outbox | deep / shallow |");
    println!("|---|---|---|---|");
    for store in [Store::SqliteFull, Store::Postgres] {
        let shallow = deep_rate(store, 1_000, starts).await?;
        let deep_r = deep_rate(store, deep, starts).await?;
        println!(
            "| {} | {shallow:.0} | {deep_r:.0} | {:.2} |",
            store.name(),
            deep_r / shallow
        );
    }
    Ok(())
}

fn peak_rss() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .map(|l| l["VmHWM:".len()..].trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

/// `laneway bench`
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Smaller runs (5,000 ops, one round): the same sections in a minute.
    #[arg(long)]
    pub quick: bool,
    /// Only these sections (throughput, latency, activitypub,
    /// slow-fediverse, signing, stellar-pool, backlog, lanes, settle, soak,
    /// deep-backlog).
    #[arg(long, value_delimiter = ',')]
    pub only: Option<Vec<String>>,
    /// Ops per drain round.
    #[arg(long, default_value_t = 20_000)]
    pub ops: usize,
    /// Alternating rounds per system.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// The big backlog of the backlog section.
    #[arg(long, default_value_t = 1_000_000)]
    pub backlog: usize,
    /// Ops of the soak section.
    #[arg(long, default_value_t = 1_000_000)]
    pub soak: usize,
    /// Inboxes of the slow-fediverse section.
    #[arg(long, default_value_t = 5_000)]
    pub inboxes: usize,
    /// Of the slow-fediverse section's servers, the share that never
    /// answers, in percent.
    #[arg(long, default_value_t = 1)]
    pub hanging_percent: usize,
    /// How long the activitypub section's inboxes take to answer, in ms.
    #[arg(long, default_value_t = 20)]
    pub answer_ms: u64,
    /// How often the stellar-pool section's fake network closes a ledger, in ms.
    #[arg(long, default_value_t = 1000)]
    pub ledger_ms: u64,
    /// The throughput section's systems (full, normal, pg, plain, graphile, statements).
    #[arg(long, value_delimiter = ',')]
    pub systems: Vec<String>,
}

/// Runs the sections asked for, printing Markdown tables.
///
/// # Errors
///
/// Any section that cannot run (PostgreSQL unreachable, plugins not built).
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let BenchArgs {
        quick,
        only,
        ops: mut n,
        mut rounds,
        backlog: mut big,
        soak: soak_n,
        inboxes,
        hanging_percent,
        answer_ms,
        ledger_ms,
        systems,
    } = args;
    if quick {
        n = n.min(5_000);
        rounds = rounds.min(1);
        big = big.min(100_000);
    }
    let named = |s: &str| only.as_ref().is_some_and(|o| o.iter().any(|x| x == s));
    let wants = |s: &str| only.as_ref().is_none_or(|o| o.iter().any(|x| x == s));
    let fsync = fsync_cost()?;
    println!(
        "# laneway bench ({} cores; fsync of a 4 KiB write here: {fsync})",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    if wants("throughput") {
        throughput(n, rounds, &systems).await?;
    }
    if wants("latency") {
        latency(if quick { 50 } else { 200 }).await?;
    }
    if wants("signing") {
        activitypub::signing()?;
    }
    if wants("activitypub") {
        activitypub::fan_out(if quick { 1_000 } else { 4_000 }, 50, Duration::from_millis(answer_ms)).await?;
    }
    if named("slow-fediverse") {
        activitypub::slow_fediverse(inboxes, hanging_percent).await?;
    }
    if wants("stellar-pool") {
        stellar::pools(quick, Duration::from_millis(ledger_ms.max(50))).await?;
    }
    if wants("backlog") {
        backlog(big).await?;
    }
    if wants("lanes") {
        many_lanes().await?;
    }
    if wants("settle") {
        settle::settles_by_in_flight().await?;
    }
    if named("soak") {
        soak(soak_n).await?;
    }
    if named("deep-backlog") {
        deep_backlog(if quick { 5_000 } else { 20_000 }).await?;
    }
    println!("\npeak RSS of this process: {}", peak_rss());
    Ok(())
}

/// A built plugin (`NAME.wasm`): beside the binary's checkout, or where
/// `LW_BENCH_PLUGINS` says (not a `LANEWAY_` name: those set config keys).
fn plugin(name: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::var_os("LW_BENCH_PLUGINS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("plugins/target/wasm32-wasip2/release"));
    let path = dir.join(format!("{name}.wasm"));
    anyhow::ensure!(
        path.exists(),
        "{} is missing: build the plugins first (./dev run does), or set LW_BENCH_PLUGINS",
        path.display()
    );
    Ok(path)
}

/// What one soak run saw.
struct SoakRun {
    rate: f64,
    max_rows: HashMap<String, i64>,
    max_file: u64,
    final_rows: HashMap<String, i64>,
}

fn db_bytes(dir: &Path) -> u64 {
    ["bench.db", "bench.db-wal"]
        .iter()
        .filter_map(|f| std::fs::metadata(dir.join(f)).ok())
        .map(|m| m.len())
        .sum()
}

/// `n` ops through the no-op executor with a producer keeping ~20k waiting;
/// with `prune`, retention 5 s and the pruner every 500 ms.
async fn soak_run(n: usize, prune: bool) -> anyhow::Result<SoakRun> {
    let scratch = Scratch::new(
        Store::SqliteNormal,
        "[queue]\nlease_ms = 2000\n[retention]\nconfirmed_ms = 5000\nevery_ms = 500\nbatch = 2000\n",
    )
    .await?;
    let dir = scratch._dir.path().to_owned();
    let (dispatcher, mut started) = scratch.dispatcher();
    let runner = dispatcher.clone();
    let handle = tokio::spawn(async move { runner.run().await });
    let queue = scratch.queue.clone();
    // How many the executor has started: the producer keeps ~20k ahead of
    // it without asking the database (a COUNT over a growing table would
    // slow the unpruned run for a reason that is not the queue's).
    let progress = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let ahead = progress.clone();
    let producer = tokio::spawn(async move {
        let mut sent = 0usize;
        while sent < n {
            if sent.saturating_sub(ahead.load(std::sync::atomic::Ordering::Relaxed)) > 20_000 {
                tokio::time::sleep(Duration::from_millis(2)).await;
                continue;
            }
            let chunk = ops(1000.min(n - sent), 8, 100_000);
            sent += chunk.len();
            queue.enqueue(&chunk).await?;
        }
        Ok::<(), anyhow::Error>(())
    });
    let pruner = prune.then(|| {
        let queue = scratch.queue.clone();
        let config = scratch.config.clone();
        let stop = dispatcher.clone();
        tokio::spawn(async move {
            let pruner = crate::pruner::Pruner::new(queue, Arc::new(SystemClock));
            while !stop.is_cancelled() {
                pruner.run_once(&config, "bench").await?;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Ok::<(), anyhow::Error>(())
        })
    });
    let start = Instant::now();
    let mut max_rows: HashMap<String, i64> = HashMap::new();
    let mut max_file = 0;
    let mut seen = 0usize;
    let mut next_sample = Instant::now();
    while seen < n {
        tokio::select! {
            got = started.recv() => {
                got.context("executor gone")?;
                seen += 1;
                progress.store(seen, std::sync::atomic::Ordering::Relaxed);
            }
            () = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
        if Instant::now() >= next_sample {
            next_sample = Instant::now() + Duration::from_secs(1);
            for (table, rows) in scratch.queue.table_rows().await? {
                let max = max_rows.entry(table).or_default();
                *max = (*max).max(rows);
            }
            max_file = max_file.max(db_bytes(&dir));
        }
    }
    while scratch.open_ops().await? > 0 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    producer.await??;
    dispatcher.shutdown();
    handle.await??;
    if let Some(p) = pruner {
        p.await??;
    }
    let final_rows = scratch.queue.table_rows().await?.into_iter().collect();
    max_file = max_file.max(db_bytes(&dir));
    scratch.drop().await?;
    Ok(SoakRun {
        rate,
        max_rows,
        max_file,
        final_rows,
    })
}

async fn soak(n: usize) -> anyhow::Result<()> {
    println!("\n## soak: {n} ops, SQLite (synchronous=normal), a producer keeping ~20k waiting\n");
    let plain = soak_run(n, false).await?;
    let pruned = soak_run(n, true).await?;
    println!("| run | ops/s | most ops rows | most attempts rows | most tombstones | largest db file (MiB) | ops rows at the end |");
    println!("|---|---|---|---|---|---|---|");
    for (name, run) in [("no pruning", &plain), ("retention 5 s, pruner every 500 ms", &pruned)] {
        let get = |m: &HashMap<String, i64>, t: &str| m.get(t).copied().unwrap_or(0);
        println!(
            "| {name} | {:.0} | {} | {} | {} | {:.1} | {} |",
            run.rate,
            get(&run.max_rows, "ops"),
            get(&run.max_rows, "attempts"),
            get(&run.max_rows, "idempotency_tombstones"),
            run.max_file as f64 / 1_048_576.0,
            get(&run.final_rows, "ops"),
        );
    }
    println!("\nthroughput with pruning / without: {:.2}", pruned.rate / plain.rate);
    Ok(())
}

/// The median time to write 4 KiB and fsync it, here: what bounds a
/// durable commit on SQLite `synchronous=full`.
fn fsync_cost() -> anyhow::Result<String> {
    use std::io::Write as _;
    let dir = tempfile::tempdir()?;
    let mut file = std::fs::File::create(dir.path().join("f"))?;
    let mut times = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        file.write_all(&[0u8; 4096])?;
        file.sync_data()?;
        times.push(t.elapsed());
    }
    Ok(ms(percentile(&mut times, 0.5)))
}
