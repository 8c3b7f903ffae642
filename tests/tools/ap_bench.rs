//! ActivityPub end to end, measured: the real `activitypub` plugin signing
//! through the host signer, fanning activities out to local inboxes that
//! answer 202 after a delay (healthy but not instant, as a remote server
//! is). Prints ops/s, how many requests were in flight on average against
//! `outbox_max_in_flight`, and laneway's CPU per op. The inboxes run in this
//! process too and do not verify signatures, so the CPU figure is laneway's.
//!
//! ```sh
//! cargo run --release -p laneway-tests --example ap_bench -- [OPS] [INBOXES] [DELAY_MS] [sqlite|postgres]
//! ```

use std::path::PathBuf;
use std::str::FromStr as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use laneway::clock::SystemClock;
use laneway::dispatch::Dispatcher;
use laneway::fanout::{FanOut, Recipient};
use laneway::op::Status;
use laneway::queue::prelude::*;
use laneway::runtime::host::PluginHost;
use rsa::pkcs8::EncodePrivateKey as _;

/// The laneway binary's allocator, so the figures are the binary's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Requests being answered now, the most at once, and how many were served.
#[derive(Default)]
struct Load {
    now: AtomicUsize,
    served: AtomicUsize,
}

async fn serve(load: Arc<Load>, delay: Duration) -> anyhow::Result<String> {
    let app = axum::Router::new().route(
        "/users/{who}/inbox",
        axum::routing::post(move || {
            let load = load.clone();
            async move {
                load.now.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(delay).await;
                load.now.fetch_sub(1, Ordering::SeqCst);
                load.served.fetch_add(1, Ordering::SeqCst);
                axum::http::StatusCode::ACCEPTED
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(format!("http://{addr}"))
}

/// This process's CPU time so far (user + system), from /proc.
fn cpu_time() -> Duration {
    let ticks = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let fields: Vec<u64> = s
                .rsplit(')')
                .next()?
                .split_whitespace()
                .skip(11)
                .take(2)
                .filter_map(|f| f.parse().ok())
                .collect();
            Some(fields.iter().sum::<u64>())
        })
        .unwrap_or(0);
    // Linux reports in clock ticks, 100 per second on every common build.
    Duration::from_millis(ticks * 10)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let ops: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(2000);
    let inboxes: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(50);
    let delay = Duration::from_millis(args.next().map(|a| a.parse()).transpose()?.unwrap_or(20));
    let backend = args.next().unwrap_or_else(|| "sqlite".into());

    let dir = tempfile::tempdir()?;
    let key = rsa::RsaPrivateKey::new(&mut rand::thread_rng(), 2048)?;
    let pem = dir.path().join("actor.pem");
    std::fs::write(&pem, key.to_pkcs8_pem(Default::default())?.as_bytes())?;
    let plugin =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../plugins/target/wasm32-wasip2/release/activitypub.wasm");
    anyhow::ensure!(
        plugin.exists(),
        "{} is missing: build the plugins first",
        plugin.display()
    );
    let load = Arc::new(Load::default());
    let base = serve(load.clone(), delay).await?;

    let mut schema = None;
    let database = match backend.as_str() {
        "postgres" => {
            let url = std::env::var("TEST_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
            let name = format!("lwapbench_{}", std::process::id());
            let admin = sqlx::PgPool::connect(&url).await?;
            sqlx::query(&format!("CREATE SCHEMA {name}")).execute(&admin).await?;
            schema = Some((admin, name.clone(), url.clone()));
            url
        }
        _ => format!("sqlite://{}", dir.path().join("ap.db").display()),
    };
    let config = laneway::config::from_layers(&[&format!(
        "[database]\nurl = {database:?}\n\
         [keys.actor]\nalgorithm = \"rsa-sha256\"\nfile = {:?}\n\
         [plugins.ap]\npath = {:?}\nallowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1\"]\nkeys = [\"actor\"]\n\
         max_connections = 64\n\
         [kinds.activitypub]\nplugin = \"ap\"\n\
         config = {{ key = \"actor\", key_id = \"https://bench.example/actor#main-key\" }}\n",
        pem.display().to_string(),
        plugin.display().to_string(),
    )])?;
    let queue: Arc<dyn Queue> = match &schema {
        Some((_, name, url)) => {
            let options = sqlx::postgres::PgConnectOptions::from_str(url)?.options([("search_path", name.as_str())]);
            Arc::new(
                laneway::queue::postgres::PgQueue::open_with(
                    options,
                    &config.database,
                    config.limits(),
                    Arc::new(SystemClock),
                )
                .await?,
            )
        }
        None => laneway::queue::open(&config.database, config.limits(), Arc::new(SystemClock)).await?,
    };
    queue.migrate().await?;
    let host = PluginHost::new(&config)?;
    let refused = host.apply(&config).await?;
    anyhow::ensure!(refused.is_empty(), "plugin refused its config: {refused:?}");
    let outbox_cap = config.dispatch.outbox_max_in_flight;
    let dispatcher = Dispatcher::new(queue.clone(), host.registry(), config, Arc::new(SystemClock));
    let runner = dispatcher.clone();
    let handle = tokio::spawn(async move { runner.run().await });

    let recipients: Vec<Recipient> = (0..inboxes)
        .map(|i| Recipient::parse(&format!("{base}/users/u{i}/inbox")))
        .collect();
    let activities = ops.div_ceil(inboxes);
    let cpu0 = cpu_time();
    let start = Instant::now();
    for n in 0..activities {
        let activity = serde_json::json!({
            "@context": "https://www.w3.org/ns/activitystreams",
            "id": format!("https://bench.example/activities/{n}"),
            "type": "Create",
            "actor": "https://bench.example/actor",
            "object": { "type": "Note", "content": format!("note {n}") },
        });
        dispatcher
            .fan_out(&FanOut {
                kind: "activitypub".into(),
                actor: "https://bench.example/actor".into(),
                activity: activity.to_string(),
                recipients: recipients.clone(),
                priority: None,
                subject: None,
            })
            .await
            .context("fan-out")?;
    }
    let total = activities * inboxes;
    let (mut samples, mut in_flight) = (0usize, 0usize);
    while load.served.load(Ordering::SeqCst) < total {
        in_flight += load.now.load(Ordering::SeqCst);
        samples += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
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
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let seconds = start.elapsed().as_secs_f64();
    let cpu = cpu_time() - cpu0;
    dispatcher.shutdown();
    handle.await??;
    if let Some((admin, name, _)) = schema {
        sqlx::query(&format!("DROP SCHEMA {name} CASCADE"))
            .execute(&admin)
            .await?;
    }
    println!("activitypub end to end ({backend}): {total} ops to {inboxes} inboxes answering 202 after {delay:?}");
    println!("  {:.0} ops/s", total as f64 / seconds);
    println!(
        "  in flight on average: {:.1} (outbox_max_in_flight = {outbox_cap})",
        in_flight as f64 / samples.max(1) as f64
    );
    println!(
        "  CPU per op (whole process, inboxes included): {:.2} ms",
        cpu.as_secs_f64() * 1000.0 / total as f64
    );
    Ok(())
}
