//! ActivityPub end to end, measured: the real `activitypub` plugin signing
//! every request with an RSA-2048 key through the host signer, fanning
//! activities out to local inboxes, each inbox host a server of its own on
//! 127.0.0.1 (so each is a destination of its own, as remote servers are).
//! The inboxes run in this process and do not verify signatures.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use rsa::pkcs8::EncodePrivateKey as _;

use crate::clock::SystemClock;
use crate::dispatch::Dispatcher;
use crate::fanout::{FanOut, Recipient};
use crate::queue::prelude::*;
use crate::runtime::host::PluginHost;

/// What one inbox server saw: requests being answered now, the most at
/// once, how many it answered, and when each arrived and was answered.
#[derive(Default)]
struct Load {
    now: AtomicUsize,
    most: AtomicUsize,
    served: AtomicUsize,
    times: std::sync::Mutex<Vec<(DateTime<Utc>, DateTime<Utc>)>>,
}

/// Starts one inbox server answering 202 after `delay`, or never (`None`:
/// it holds the request until the client gives up).
async fn serve(load: Arc<Load>, delay: Option<Duration>) -> anyhow::Result<String> {
    let app = axum::Router::new().route(
        "/users/{who}/inbox",
        axum::routing::post(move || {
            let load = load.clone();
            async move {
                let arrived = Utc::now();
                let now = load.now.fetch_add(1, Ordering::SeqCst) + 1;
                load.most.fetch_max(now, Ordering::SeqCst);
                match delay {
                    Some(delay) => tokio::time::sleep(delay).await,
                    None => std::future::pending::<()>().await,
                }
                load.now.fetch_sub(1, Ordering::SeqCst);
                if let Ok(mut times) = load.times.lock() {
                    times.push((arrived, Utc::now()));
                }
                load.served.fetch_add(1, Ordering::SeqCst);
                axum::http::StatusCode::ACCEPTED
            }
        }),
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    inboxes()?.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        axum::serve(listener, app).await
    });
    Ok(format!("http://{addr}"))
}

/// The name of the inbox servers' runtime threads, by which
/// [`inbox_cpu_time`] finds them in /proc.
const INBOX_THREADS: &str = "bench-inboxes";

/// The runtime the bench's inbox servers run on, apart from the host's: a
/// remote inbox does not answer on the host's worker threads, and here an
/// answer that waited for a worker busy with a plugin call or a group
/// commit was counted as time at the inbox and held the lane meanwhile.
/// Both still share the machine's two cores.
/// Built once, inside `get_or_init`: a second one built by a racing caller
/// would be dropped inside the host's runtime, which tokio refuses.
fn inboxes() -> anyhow::Result<&'static tokio::runtime::Runtime> {
    static INBOXES: std::sync::OnceLock<Result<tokio::runtime::Runtime, String>> = std::sync::OnceLock::new();
    INBOXES
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name(INBOX_THREADS)
                .enable_all()
                .build()
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| anyhow::anyhow!("no runtime for the bench's inboxes: {e}"))
}

/// This process's CPU time so far (user + system), from /proc.
fn cpu_time() -> Duration {
    ticks(
        std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| stat_ticks(&stat))
            .unwrap_or(0),
    )
}

/// CPU time so far (user + system) of the threads of the bench's inbox
/// servers' runtime, from /proc: the part of [`cpu_time`] that a real
/// host, whose inboxes are elsewhere, would not spend.
fn inbox_cpu_time() -> Duration {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Duration::ZERO;
    };
    ticks(
        tasks
            .flatten()
            .filter_map(|task| std::fs::read_to_string(task.path().join("stat")).ok())
            .filter(|stat| {
                stat.split_once('(')
                    .is_some_and(|(_, rest)| rest.starts_with(INBOX_THREADS))
            })
            .filter_map(|stat| stat_ticks(&stat))
            .sum(),
    )
}

/// User plus system clock ticks from a `/proc/…/stat` line (the fields
/// after the command name, which may itself hold spaces and parentheses).
fn stat_ticks(stat: &str) -> Option<u64> {
    let fields: Vec<u64> = stat
        .rsplit(')')
        .next()?
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|f| f.parse().ok())
        .collect();
    Some(fields.iter().sum())
}

/// Clock ticks as time: Linux reports 100 a second on every common build.
fn ticks(n: u64) -> Duration {
    Duration::from_millis(n * 10)
}

/// A host on a fresh SQLite or PostgreSQL database with the activitypub
/// kind, its key in a scratch folder.
struct ApHost {
    config: crate::config::Config,
    dispatcher: Dispatcher,
    queue: Arc<dyn Queue>,
    handle: tokio::task::JoinHandle<Result<(), crate::dispatch::DispatchError>>,
    schema: Option<super::ScratchSchema>,
    _dir: tempfile::TempDir,
}

impl ApHost {
    async fn start(backend: &str, extra: &str) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let key = rsa::RsaPrivateKey::new(&mut rand::thread_rng(), 2048)?;
        let pem = dir.path().join("actor.pem");
        std::fs::write(&pem, key.to_pkcs8_pem(Default::default())?.as_bytes())?;
        let mut schema = None;
        let database = match backend {
            "postgres" => {
                let url = super::pg_url();
                let created = super::ScratchSchema::create("lwapbench").await?;
                let separator = if url.contains('?') { '&' } else { '?' };
                let url = format!("{url}{separator}options=-c%20search_path%3D{}", created.name);
                schema = Some(created);
                url
            }
            _ => format!("sqlite://{}", dir.path().join("ap.db").display()),
        };
        let base = format!(
            "[database]\nurl = {database:?}\n\
             [keys.actor]\nalgorithm = \"rsa-sha256\"\nfile = {:?}\n\
             [plugins.ap]\npath = {:?}\nallowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1\"]\nkeys = [\"actor\"]\n\
             max_connections = 1024\nmax_idle_connections = 8\nrequest_timeout_ms = 10000\n\
             [kinds.activitypub]\nplugin = \"ap\"\n\
             config = {{ key = \"actor\", key_id = \"https://bench.example/actor#main-key\" }}\n",
            pem.display().to_string(),
            super::plugin("activitypub")?.display().to_string(),
        );
        let config = crate::config::from_layers(&[&base, extra])?;
        let queue = crate::queue::open(&config.database, config.limits(), Arc::new(SystemClock)).await?;
        queue.migrate().await?;
        let host = PluginHost::new(&config)?;
        let refused = host.apply(&config).await?;
        anyhow::ensure!(refused.is_empty(), "plugin refused its config: {refused:?}");
        let dispatcher = Dispatcher::new(queue.clone(), host.registry(), config.clone(), Arc::new(SystemClock));
        let runner = dispatcher.clone();
        let handle = tokio::spawn(async move { runner.run().await });
        Ok(Self {
            config,
            dispatcher,
            queue,
            handle,
            schema,
            _dir: dir,
        })
    }

    async fn fan_out(&self, n: usize, recipients: &[Recipient]) -> anyhow::Result<()> {
        let activity = serde_json::json!({
            "@context": "https://www.w3.org/ns/activitystreams",
            "id": format!("https://bench.example/activities/{n}"),
            "type": "Create",
            "actor": "https://bench.example/actor",
            // About 2 KB, as a real Create with its note's HTML is: past
            // `queue.shared_payload_bytes`, so a fan-out stores it once.
            "object": { "type": "Note", "content": format!("<p>note {n}: {}</p>", "lorem ipsum ".repeat(160)) },
        });
        self.dispatcher
            .fan_out(&FanOut {
                kind: "activitypub".into(),
                actor: "https://bench.example/actor".into(),
                activity: activity.to_string(),
                recipients: recipients.to_vec(),
                priority: None,
                subject: None,
            })
            .await
            .context("fan-out")?;
        Ok(())
    }

    async fn stop(self) -> anyhow::Result<()> {
        self.dispatcher.shutdown();
        self.handle.await??;
        if let Some(schema) = self.schema {
            schema.drop().await?;
        }
        Ok(())
    }
}

/// Where a lane's cycle goes, from the attempts the database recorded and
/// the times the inbox servers saw, request by request: the plugin's work
/// before its request arrives (instance, signature, connection), the inbox,
/// the plugin's work after the answer, and the host's turn from one
/// attempt's end to the next attempt's start on the same lane (settle,
/// claim, commit, spawn). Each lane is one inbox server, in lane order.
async fn cycle(queue: &dyn Queue, inboxes: &[(String, Arc<Load>)]) -> anyhow::Result<String> {
    let mut stages: [Vec<i64>; 4] = Default::default();
    for (inbox, load) in inboxes {
        let filter = crate::queue::OpFilter {
            lane: Some(inbox.clone()),
            limit: 100_000,
            ..Default::default()
        };
        let mut attempts = Vec::new();
        for op in queue.list(&filter).await? {
            if let Some(first) = queue.attempts(op.id).await?.into_iter().next() {
                attempts.push((op.id, first.record.started_at, first.record.finished_at));
            }
        }
        attempts.sort_by_key(|a| a.0);
        let mut seen = load.times.lock().map(|t| t.clone()).unwrap_or_default();
        seen.sort();
        let us = |a: DateTime<Utc>, b: DateTime<Utc>| (b - a).num_microseconds().unwrap_or(0);
        for (k, ((_, started, finished), (arrived, answered))) in attempts.iter().zip(&seen).enumerate() {
            stages[0].push(us(*started, *arrived));
            stages[1].push(us(*arrived, *answered));
            stages[2].push(us(*answered, *finished));
            if let Some((_, next, _)) = attempts.get(k + 1) {
                stages[3].push(us(*finished, *next));
            }
        }
    }
    let mut out = String::new();
    for samples in &mut stages {
        samples.sort_unstable();
        let at = |p: f64| {
            samples
                .get(((samples.len().max(1) - 1) as f64 * p) as usize)
                .copied()
                .unwrap_or(0)
        };
        out.push_str(&format!(
            " {:.1} / {:.1} |",
            at(0.5) as f64 / 1000.0,
            at(0.9) as f64 / 1000.0
        ));
    }
    Ok(out)
}

/// `ops` deliveries (activities fanned out to `inboxes` inbox servers that
/// answer in `delay`), on SQLite and on PostgreSQL.
pub(super) async fn fan_out(ops: usize, inboxes: usize, delay: Duration) -> anyhow::Result<()> {
    println!(
        "\n## ActivityPub end to end: {ops} deliveries to {inboxes} inbox servers answering in {delay:?}, RSA-2048 signed"
    );
    println!("| store | ops/s | in flight at the inboxes (mean) | CPU per op (inboxes included) | a lane's cycle, ms p50 / p90: plugin before its request | at the inbox | plugin after the answer | host from attempt to attempt |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut cpu_per_op = Vec::new();
    for backend in ["sqlite", "postgres"] {
        let loads: Vec<Arc<Load>> = (0..inboxes).map(|_| Arc::new(Load::default())).collect();
        let mut recipients = Vec::with_capacity(inboxes);
        let mut lanes = Vec::with_capacity(inboxes);
        for (i, load) in loads.iter().enumerate() {
            let base = serve(load.clone(), Some(delay)).await?;
            let inbox = format!("{base}/users/u{i}/inbox");
            recipients.push(Recipient::parse(&inbox));
            lanes.push((inbox, load.clone()));
        }
        let host = ApHost::start(backend, "").await?;
        let activities = ops.div_ceil(inboxes);
        let total = activities * inboxes;
        let (cpu0, inbox_cpu0) = (cpu_time(), inbox_cpu_time());
        let start = Instant::now();
        for n in 0..activities {
            host.fan_out(n, &recipients).await?;
        }
        let served = || loads.iter().map(|l| l.served.load(Ordering::SeqCst)).sum::<usize>();
        let (mut samples, mut in_flight) = (0usize, 0usize);
        while served() < total {
            in_flight += loads.iter().map(|l| l.now.load(Ordering::SeqCst)).sum::<usize>();
            samples += 1;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        while super::open_ops(host.queue.as_ref()).await? > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let seconds = start.elapsed().as_secs_f64();
        let cpu = cpu_time() - cpu0;
        let inbox_cpu = inbox_cpu_time().saturating_sub(inbox_cpu0);
        let cycle = cycle(host.queue.as_ref(), &lanes).await?;
        host.stop().await?;
        let per_op = cpu.as_secs_f64() * 1000.0 / total as f64;
        println!(
            "| {backend} | {:.0} | {:.1} | {per_op:.2} ms |{cycle}",
            total as f64 / seconds,
            in_flight as f64 / samples.max(1) as f64,
        );
        let host_per_op = cpu.saturating_sub(inbox_cpu).as_secs_f64() * 1000.0 / total as f64;
        cpu_per_op.push((backend, per_op, host_per_op));
    }
    cpu_budget(&cpu_per_op)
}

/// One activity to `inboxes` inboxes, five per server, answering in 200 ms;
/// `hanging_percent` of the servers never answer (their requests hang until
/// the kind's timeout). Reports when every live inbox had its delivery,
/// against the ideal (live inboxes × 200 ms ÷ in-flight capacity), and the
/// most requests a hanging server held at once (the per-destination cap);
/// with the shipped config, then with slow attempts off (`max_slow = 0`),
/// each on servers of its own.
pub(super) async fn slow_fediverse(inboxes: usize, hanging_percent: usize) -> anyhow::Result<()> {
    const PER_SERVER: usize = 5;
    let delay = Duration::from_millis(200);
    let servers = inboxes.div_ceil(PER_SERVER);
    let hanging = (servers * hanging_percent.min(100) / 100).max(1);
    println!(
        "\n## A slow fediverse: one activity to {inboxes} inboxes on {servers} servers answering in {delay:?}, {hanging} servers hanging"
    );
    let mut header = true;
    for (label, dispatch) in [("shipped", ""), ("slow attempts off", "[dispatch]\nmax_slow = 0\n")] {
        let mut recipients = Vec::with_capacity(inboxes);
        let mut live = Vec::new();
        let mut hung = Vec::new();
        for s in 0..servers {
            let load = Arc::new(Load::default());
            let hangs = s % (servers / hanging).max(1) == 0 && hung.len() < hanging;
            let base = serve(load.clone(), (!hangs).then_some(delay)).await?;
            let mut count = 0;
            for i in 0..PER_SERVER {
                if recipients.len() < inboxes {
                    recipients.push(Recipient::parse(&format!("{base}/users/u{s}x{i}/inbox")));
                    count += 1;
                }
            }
            if hangs {
                hung.push(load);
            } else {
                live.push((load, count));
            }
        }
        let live_total: usize = live.iter().map(|(_, n)| n).sum();
        // The kind's timeout ends the hanging requests; the retries wait long
        // enough not to come back during the run.
        let host = ApHost::start(
            "sqlite",
            &format!("{dispatch}[kinds.activitypub]\ntimeout_ms = 10000\nbackoff_base_ms = 600000\nbackoff_max_ms = 600000\n"),
        )
        .await?;
        let config = &host.config;
        let capacity = config.dispatch.max_in_flight.min(config.dispatch.outbox_max_in_flight);
        let cap = config.destinations.max_in_flight;
        let start = Instant::now();
        host.fan_out(0, &recipients).await?;
        let enqueued = start.elapsed().as_secs_f64();
        let served = || live.iter().map(|(l, _)| l.served.load(Ordering::SeqCst)).sum::<usize>();
        let deadline = Instant::now() + Duration::from_secs(120);
        let now_live = || live.iter().map(|(l, _)| l.now.load(Ordering::SeqCst)).sum::<usize>();
        let (mut samples, mut in_flight, mut permits, mut slow) = (0usize, 0usize, 0usize, 0usize);
        while served() < live_total && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
            samples += 1;
            in_flight += now_live();
            permits += host.dispatcher.permits_in_use();
            slow = slow.max(host.dispatcher.slow_in_use());
        }
        let seconds = start.elapsed().as_secs_f64();
        let held = hung.iter().map(|l| l.most.load(Ordering::SeqCst)).max().unwrap_or(0);
        let held_all: usize = hung.iter().map(|l| l.most.load(Ordering::SeqCst)).sum();
        let ideal = live_total as f64 * delay.as_secs_f64() / capacity as f64;
        // Without slow attempts, the permits the hanging servers hold
        // (within their cap) for the whole run are not the live inboxes':
        // the best this host can do is the enqueue, then the live inboxes
        // over the permits left.
        let bound =
            enqueued + live_total as f64 * delay.as_secs_f64() / capacity.saturating_sub(held_all).max(1) as f64;
        let mean_live = in_flight as f64 / samples.max(1) as f64;
        let mean_permits = permits as f64 / samples.max(1) as f64;
        if header {
            println!("| config | live inboxes delivered | time (of which the fan-out's enqueue) | ideal (live × 0.2 s ÷ {capacity} in flight) | ratio | most a hanging server held (cap {cap}, {first} until it answers) | bound if the hanging servers' requests all held permits | time / bound | in flight at the live servers (mean) | permits held (mean) | slow attempts (most at once) |", first = config.destinations.max_in_flight_unanswered);
            println!("|---|---|---|---|---|---|---|---|---|---|---|");
            header = false;
        }
        println!(
            "| {label} | {} of {live_total} | {seconds:.2} s ({enqueued:.2} s) | {ideal:.2} s | {:.2}x (target <= 1.3x) | {held} | {bound:.2} s ({:.2}x of ideal; {held_all} held) | {:.2}x | {mean_live:.0} | {mean_permits:.0} | {slow} |",
            served(),
            seconds / ideal,
            bound / ideal,
            seconds / bound
        );
        host.stop().await?;
    }
    Ok(())
}

/// Microseconds per RSA-2048 signature with the host signer's library
/// (aws-lc-rs), signing `data` for about `during`.
fn host_signer_us(key: &aws_lc_rs::signature::RsaKeyPair, data: &[u8], during: Duration) -> anyhow::Result<f64> {
    let rng = aws_lc_rs::rand::SystemRandom::new();
    per_call_us(during, &mut || {
        let mut signature = vec![0u8; key.public_modulus_len()];
        key.sign(&aws_lc_rs::signature::RSA_PKCS1_SHA256, &rng, data, &mut signature)
            .map_err(|e| anyhow::anyhow!("{e}"))
    })
}

/// Microseconds per call of `f`, calling it again and again for about
/// `during`.
fn per_call_us(during: Duration, f: &mut dyn FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut n = 0u32;
    while start.elapsed() < during {
        f()?;
        n += 1;
    }
    Ok(start.elapsed().as_secs_f64() * 1e6 / f64::from(n.max(1)))
}

/// What the ActivityPub target leaves each op on this machine: 1,500 ops/s
/// on its cores is a CPU budget per op, and one RSA-2048 signature (the
/// host signer's library, measured now) is a part of every op no host can
/// skip. Printed under the table, beside each row's CPU per op.
fn cpu_budget(cpu_per_op_ms: &[(&str, f64, f64)]) -> anyhow::Result<()> {
    const TARGET_OPS: f64 = 1_500.0;
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get) as f64;
    let native = aws_lc_rs::signature::RsaKeyPair::generate(aws_lc_rs::rsa::KeySize::Rsa2048)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let sign_ms = host_signer_us(
        &native,
        b"(request-target): post /users/u1/inbox",
        Duration::from_millis(300),
    )? / 1000.0;
    let budget_ms = cores * 1000.0 / TARGET_OPS;
    println!(
        "CPU budget at {TARGET_OPS:.0} ops/s on {cores:.0} cores: {budget_ms:.2} ms per op; one RSA-2048 signature here: {sign_ms:.2} ms ({:.0}% of the budget)",
        100.0 * sign_ms / budget_ms
    );
    for (store, per_op, host_per_op) in cpu_per_op_ms {
        println!(
            "{store}: {per_op:.2} ms of CPU per op, {host_per_op:.2} ms of it the host's (the rest the bench's inbox servers), so the host alone on every core would reach {:.0} ops/s ({:.2} ms per op besides the signature){}",
            cores * 1000.0 / host_per_op.max(f64::EPSILON),
            host_per_op - sign_ms,
            if *store == "postgres" {
                "; PostgreSQL's own CPU is not counted"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// RSA-2048 PKCS#1 v1.5 SHA-256 signing: ring (the host signer) against the
/// `rsa` crate, and Ed25519, each for about a second.
pub(super) fn signing() -> anyhow::Result<()> {
    use rsa::signature::Signer as _;
    println!("\n## Signing, one core");
    let key = rsa::RsaPrivateKey::new(&mut rand::thread_rng(), 2048)?;
    let der = key.to_pkcs8_der()?;
    let pair = ring::signature::RsaKeyPair::from_pkcs8(der.as_bytes()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let rng = ring::rand::SystemRandom::new();
    let native = aws_lc_rs::signature::RsaKeyPair::from_pkcs8(der.as_bytes()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let data = b"(request-target): post /users/u1/inbox\nhost: example.social\ndate: Wed, 02 Dec 2026 12:00:00 GMT\ndigest: SHA-256=47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=";
    let portable = rsa::pkcs1v15::SigningKey::<sha2::Sha256>::new(key);
    let ed = ed25519_dalek::SigningKey::from_bytes(&rand::random::<[u8; 32]>());
    let time = |f: &mut dyn FnMut() -> anyhow::Result<()>| per_call_us(Duration::from_secs(1), f);
    let ring_us = time(&mut || {
        let mut signature = vec![0u8; pair.public().modulus_len()];
        pair.sign(&ring::signature::RSA_PKCS1_SHA256, &rng, data, &mut signature)
            .map_err(|e| anyhow::anyhow!("{e}"))
    })?;
    let native_us = host_signer_us(&native, data, Duration::from_secs(1))?;
    let rsa_us = time(&mut || {
        let _ = portable.sign(data);
        Ok(())
    })?;
    let ed_us = time(&mut || {
        let _ = ed.sign(data);
        Ok(())
    })?;
    println!("| signer | µs per signature | signatures/s |");
    println!("|---|---|---|");
    for (name, us) in [
        ("RSA-2048, aws-lc-rs (the host signer)", native_us),
        ("RSA-2048, ring", ring_us),
        ("RSA-2048, rsa crate", rsa_us),
        ("Ed25519, ed25519-dalek (RFC 9421 peers)", ed_us),
    ] {
        println!("| {name} | {us:.1} | {:.0} |", 1e6 / us);
    }
    Ok(())
}
