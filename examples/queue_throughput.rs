//! Baseline throughput of the whole delivery loop, executor excluded:
//! enqueue N ops (batches of 1000), then let the dispatcher claim, "execute"
//! (an in-process executor that confirms at once) and settle them all.
//!
//! `cargo run --release --example queue_throughput -- [sqlite|postgres] [OPS] [OUTBOXES]`
//! (PostgreSQL at `TEST_PG_URL`, default `postgres://postgres@127.0.0.1:5432/test`;
//! it uses a fresh schema and drops it after). Prints ops/s for enqueue and for
//! drain. This is the number the benchmark issue must raise to its targets.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use laneway::clock::SystemClock;
use laneway::dispatch::Dispatcher;
use laneway::executor::{Attempt, Executor, Executors, Registry};
use laneway::op::{Op, Status};
use laneway::outcome::Outcome;
use laneway::queue::postgres::PgQueue;
use laneway::queue::sqlite::SqliteQueue;
use laneway::queue::{NewOp, Queue};

struct Instant0;

#[async_trait]
impl Executor for Instant0 {
    async fn execute(&self, _op: &Op, _attempt: Attempt) -> Outcome {
        Outcome::confirmed()
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let backend = args.next().unwrap_or_else(|| "sqlite".into());
    let ops: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let outboxes: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(8);
    let mut config = laneway::config::from_toml_str(
        "[dispatch]\nmax_in_flight = 256\noutbox_max_in_flight = 128\npoll_ms = 50\n[kinds.bench]\nlanes = \"optional\"\n",
    )?;
    let dir = tempfile::tempdir()?;
    let mut schema = None;
    let queue: Arc<dyn Queue> = match backend.as_str() {
        "postgres" => {
            let url = std::env::var("TEST_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
            let name = format!("lwbench_{}", std::process::id());
            let admin = sqlx::PgPool::connect(&url).await?;
            sqlx::query(&format!("CREATE SCHEMA {name}")).execute(&admin).await?;
            schema = Some((admin, name.clone()));
            config.database.url = url.clone();
            let options = sqlx::postgres::PgConnectOptions::from_str(&url)?.options([("search_path", name.as_str())]);
            Arc::new(PgQueue::open_with(options, &config.database, config.limits(), Arc::new(SystemClock)).await?)
        }
        _ => {
            config.database.url = format!("sqlite://{}", dir.path().join("bench.db").display());
            Arc::new(SqliteQueue::open(&config.database, config.limits(), Arc::new(SystemClock)).await?)
        }
    };
    queue.migrate().await?;

    let batch: Vec<NewOp> = (0..1000)
        .map(|i| {
            let mut op = NewOp::new(format!("outbox-{}", i % outboxes), "bench", "{}");
            op.lanes = vec![format!("lane-{i}")];
            op
        })
        .collect();
    let start = Instant::now();
    for _ in 0..ops / 1000 {
        queue.enqueue(&batch).await?;
    }
    let enqueue = start.elapsed();

    let mut executors = Executors::new();
    executors.insert("bench".into(), Arc::new(Instant0) as Arc<dyn Executor>);
    let dispatcher = Dispatcher::new(
        queue.clone(),
        Arc::new(Registry::new(executors)),
        config,
        Arc::new(SystemClock),
    );
    let runner = dispatcher.clone();
    let handle = tokio::spawn(async move { runner.run().await });
    let start = Instant::now();
    loop {
        let open: i64 = queue
            .depth()
            .await?
            .iter()
            .filter(|d| matches!(d.status, Status::Pending | Status::Submitted))
            .map(|d| d.count)
            .sum();
        if open == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let drain = start.elapsed();
    dispatcher.shutdown();
    handle.await??;
    if let Some((admin, name)) = schema {
        sqlx::query(&format!("DROP SCHEMA {name} CASCADE"))
            .execute(&admin)
            .await?;
    }
    let n = (ops / 1000 * 1000) as f64;
    println!("{backend}: {n} ops over {outboxes} outboxes");
    println!("  enqueue: {:>9.0} ops/s (batches of 1000)", n / enqueue.as_secs_f64());
    println!(
        "  drain:   {:>9.0} ops/s (claim, execute, settle)",
        n / drain.as_secs_f64()
    );
    Ok(())
}
