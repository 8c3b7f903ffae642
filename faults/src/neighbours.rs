//! Hostile plugins as neighbours: the real ActivityPub and Stellar kinds
//! carry a steady open-loop load (a fan-out and payments posted on a fixed
//! schedule, whatever the host answers), measured on fresh hosts and
//! databases, among them a hostile run: every fault fixture loaded as a
//! kind of its own and fed ops for the whole run (a panic, `exit(1)`, deep
//! recursion, a memory bomb, an endless loop, a host call that never
//! answers, and a fee policy that never stops computing, as the oracle of a
//! third payment kind), with quarantine out of the way so they misbehave
//! to the end. Mid-run the hostile host also gets a wrong-version `.wasm`
//! over one fixture and a config adding a plugin with a forbidden import:
//! both reloads must be refused while everything else runs on.
//!
//! Two runs stand beside the hostile one, neither an idle host. The
//! *clean* run carries the same extra kinds served by the well-behaved
//! `noop` plugin (three ops for each hostile op, whose three attempts are
//! three calls) and priced by the real policy. The *failing* run serves
//! them with the `fails` fixture, which fails every attempt politely and
//! at once: the same attempts, backoffs and dead letters as the hostile
//! run, so hostile against failing is what misbehaving costs the
//! neighbours (the sandbox's share), and failing against clean what ops
//! that fail cost them (the queue's share).
//!
//! [`compare`] is pure: it turns the measurements into the table and the
//! verdict (every acknowledged op of the real kinds confirmed in every
//! mode, the bad reloads refused); latency percentiles against
//! [`TOLERANCE`] are reported as figures, not a verdict. For a post-mortem,
//! `LW_NEIGHBOURS_ONLY=spin,slow` feeds only the named fixtures.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _};
use serde_json::{json, Value};
use sqlx::Row as _;

use crate::procs;
use crate::run::{prepare, write_keys, Backend, Env, Workspace};
use crate::stellar::{self, FakeRpc};

/// How much, how fast, how long.
#[derive(Debug, Clone)]
pub struct NeighboursPlan {
    pub backend: Backend,
    /// How long the load is offered.
    pub seconds: u64,
    /// Fan-outs per second, each to [`INBOXES`] inboxes.
    pub activities_per_s: f64,
    /// Payments per second, alternating between the two signers.
    pub payments_per_s: f64,
    /// Ops per second to each hostile kind.
    pub hostile_per_s: f64,
    /// Runs of each [`Mode`], in turn (clean first).
    pub rounds: usize,
}

/// What serves the extra kinds in a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Mode {
    /// `noop`, three ops for each hostile one; the real fee policy.
    #[default]
    Clean,
    /// The `fails` fixture: every attempt fails, politely; the real fee
    /// policy.
    Failing,
    /// The fault fixtures and the fuel hog, and two bad reloads mid-run.
    Hostile,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Clean, Mode::Failing, Mode::Hostile];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Clean => "clean",
            Mode::Failing => "failing",
            Mode::Hostile => "hostile",
        }
    }
}

/// Inboxes per fan-out (on one Node process).
pub const INBOXES: usize = 4;

/// How far the hostile run's percentiles may be from another run's:
/// 10%, plus the 2 ms a millisecond timestamp can misread on each end.
pub const TOLERANCE: (f64, u64) = (1.10, 2);

/// One run's measurements.
#[derive(Debug, Default, Clone)]
pub struct Measured {
    pub mode: Mode,
    /// Acknowledged ops of the real kinds: ActivityPub deliveries, payments.
    pub acked: [usize; 2],
    /// Enqueue to confirm, ms, of those confirmed.
    pub latencies: [Vec<u64>; 2],
    /// The hostile kinds' ops by kind and final status.
    pub fixtures: BTreeMap<String, BTreeMap<String, usize>>,
    /// Reloads the host refused (mid-run, in the hostile run).
    pub refused_reloads: usize,
    /// What the run noticed on the way (each is a failure).
    pub problems: Vec<String>,
    pub elapsed: Duration,
    /// The host's CPU time (user + system) over the run, where /proc says.
    pub cpu: Option<Duration>,
}

const CLASSES: [&str; 2] = ["activitypub", "stellar"];

/// The fixtures run as executors: kind (= plugin name), file, plugin
/// settings. `{hang}` is the never-answering server's URL.
pub const FIXTURES: [(&str, &str, &str); 6] = [
    ("panic", "panic", ""),
    ("exit", "exit", ""),
    ("recursion", "deep_recursion", ""),
    ("bomb", "memory_bomb", "memory_mib = 16"),
    ("spin", "spin", "timeout_ms = 1000"),
    (
        "slow",
        "slow_host",
        "timeout_ms = 1000\nallowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1\"]",
    ),
];

/// The third payment kind, priced by the fuel hog.
const HOG_KIND: &str = "hog_payout";

/// Runs the plan's rounds: a run of each mode per round.
pub async fn run(plan: &NeighboursPlan, env: &Env, fake_rpc: &Path) -> anyhow::Result<Vec<Measured>> {
    let mut all = Vec::new();
    for round in 0..plan.rounds {
        for mode in Mode::ALL {
            let env = Env {
                keep: env.keep.as_ref().map(|k| k.join(format!("{}-{round}", mode.name()))),
                ..env.clone()
            };
            all.push(once(plan, &env, fake_rpc, mode).await?);
        }
    }
    Ok(all)
}

/// A server that accepts connections and never answers: where the slow
/// fixture's host calls go.
async fn hang_server() -> anyhow::Result<(u16, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    Ok((port, task))
}

/// The extra kinds: every fixture as a kind of its own and the fuel hog as
/// the oracle of a third payment kind in the hostile run; in the others
/// the same kinds served by `noop` or `fails` and priced by the real
/// policy, so that every run carries the same extra plugin calls.
fn extra_section(plugins: &Path, rpc: &str, hog_account_key: &Path, mode: Mode) -> String {
    // Every attempt runs (no quarantine): the worst neighbour is one that
    // keeps misbehaving. Their retries are short, so they keep coming.
    let mut text = String::from("[runtime]\nreload_debounce_ms = 50\nquarantine_after = 1000000\n");
    for (kind, file, settings) in FIXTURES {
        let (file, settings) = match mode {
            Mode::Hostile => (file, settings),
            Mode::Failing => ("fails", ""),
            Mode::Clean => ("noop", ""),
        };
        text.push_str(&format!(
            "[plugins.{kind}]\npath = \"{}/{file}.wasm\"\n{settings}\n[kinds.{kind}]\nplugin = \"{kind}\"\nlanes = \"optional\"\nmax_attempts = 3\nfault_attempts = 3\nbackoff_base_ms = 100\nbackoff_max_ms = 400\n",
            plugins.display()
        ));
    }
    let policy = if mode == Mode::Hostile {
        "fuel_hog"
    } else {
        "fee_policy"
    };
    text.push_str(&format!(
        "[keys.hog]\nalgorithm = \"ed25519\"\nfile = \"{}\"\n[plugins.hog]\npath = \"{}/{policy}.wasm\"\nfuel = 5000000\n[oracles.hog]\npolicy = \"hog\"\nrpc_url = \"{rpc}\"\npoll_ms = 200\nfirst_sample_wait_ms = 0\n",
        hog_account_key.display(),
        plugins.display()
    ));
    // Its ops fail at pricing: a few attempts, then dead letters.
    text.push_str(
        &stellar::kind_section(HOG_KIND, "deposit", "hog", "hog", rpc)
            .replace("max_attempts = 1000", "max_attempts = 3"),
    );
    text
}

/// The run's config: the real kinds and the extra ones.
fn config_text(db_url: &str, plugins: &Path, dir: &Path, rpc: &str, keys: &crate::run::Keys, mode: Mode) -> String {
    let mut text = crate::run::config_text(db_url, plugins, &keys.pem, &keys.hook_key, None);
    text.push_str(&stellar::section(rpc, plugins, dir, false));
    text = text.replace("[runtime]\nreload_debounce_ms = 50\n", "").replace(
        "keys = [\"vault\", \"rewards\"]",
        "keys = [\"vault\", \"rewards\", \"hog\"]",
    );
    text.push_str(&extra_section(plugins, rpc, &dir.join("hog.pem"), mode));
    text
}

/// One measured run on a fresh workspace.
async fn once(plan: &NeighboursPlan, env: &Env, fake_rpc: &Path, mode: Mode) -> anyhow::Result<Measured> {
    let started = Instant::now();
    let workspace = Workspace::new(env, &plan.backend).await?;
    let (dir, db_url) = (workspace.dir.clone(), workspace.db_url.clone());
    let keys = write_keys(&dir)?;
    for key in ["vault", "rewards", "hog"] {
        stellar::write_ed25519(&dir.join(format!("{key}.pem")))?;
    }
    // The run's own copy of the plugins: the wrong version goes over one.
    let plugins = dir.join("plugins");
    std::fs::create_dir_all(&plugins)?;
    let built = env.repo.join("plugins/target/wasm32-wasip2/release");
    for entry in std::fs::read_dir(&built).context("the plugins (./dev test builds them)")? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "wasm") {
            std::fs::copy(&path, plugins.join(path.file_name().context("file name")?))?;
        }
    }
    let (inbox, inbox_port) = procs::node_inbox(&env.repo, &keys.inbox_keys, &dir.join("inbox.jsonl"))?;
    let (hang_port, hang) = hang_server().await?;
    let rpc_port = procs::free_port()?;
    let rpc = format!("http://127.0.0.1:{rpc_port}");
    let text = config_text(&db_url, &plugins, &dir, &rpc, &keys, mode);
    let laneway = prepare(env, &dir, &text)?;
    let accounts = ["vault", "rewards", "hog"]
        .iter()
        .map(|key| stellar::account(&laneway, key))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let fake = FakeRpc::start(fake_rpc, rpc_port, 250, (&accounts, &[]), &dir)?;
    let secret = laneway.api_key("neighbours", "ops:write")?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let port = procs::free_port()?;
    let mut host = laneway.start(port, None)?;
    procs::ready(&http, &mut host, port).await?;
    let base = format!("http://127.0.0.1:{port}");

    let mut measured = Measured {
        mode,
        ..Measured::default()
    };
    let offer = Offer {
        http: http.clone(),
        base: base.clone(),
        key: secret,
        inboxes: (0..INBOXES)
            .map(|n| format!("http://127.0.0.1:{inbox_port}/users/n{n}/inbox"))
            .collect(),
        accounts: accounts[..2].to_vec(),
        hang: format!("http://127.0.0.1:{hang_port}/"),
        mode,
    };
    let acked = Arc::new(Mutex::new([0usize; 2]));
    let problems = Arc::new(Mutex::new(Vec::new()));
    let load = tokio::spawn(offer.clone().run(plan.clone(), acked.clone(), problems.clone()));
    if mode == Mode::Hostile {
        // Halfway, the two reloads a careless or hostile operator could
        // cause: both must be refused, the running plugins kept.
        tokio::time::sleep(Duration::from_secs(plan.seconds / 2)).await;
        std::fs::copy(built.join("wrong_version.wasm"), plugins.join("panic.wasm"))?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut with_forbidden = text.clone();
        with_forbidden.push_str(&format!(
            "[plugins.forbidden]\npath = \"{}/forbidden_import.wasm\"\n[kinds.forbidden]\nplugin = \"forbidden\"\nlanes = \"optional\"\n",
            plugins.display()
        ));
        std::fs::write(&laneway.config, with_forbidden)?;
    }
    load.await??;
    measured.acked = *acked.lock().unwrap_or_else(PoisonError::into_inner);

    // The real kinds finish; the hostile ones may still be failing.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if open_real(&db_url).await? == 0 {
            break;
        }
        if Instant::now() > deadline {
            measured
                .problems
                .push("ops of the real kinds still open 60 s after the load ended".to_owned());
            break;
        }
        if let Some(status) = host.exited() {
            bail!("the host exited: {status} (see {})", laneway.log.display());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    if host.exited().is_some() {
        measured.problems.push("the host exited".to_owned());
    }
    measured.cpu = cpu_time(host.pid());
    host.signal("TERM")?;
    drop(host);
    drop(fake.proc);
    drop(inbox);
    hang.abort();
    read_rows(&db_url, &mut measured).await?;
    let log = std::fs::read_to_string(&laneway.log).unwrap_or_default();
    measured.refused_reloads = log.matches("Reload refused").count();
    measured
        .problems
        .extend(problems.lock().unwrap_or_else(PoisonError::into_inner).drain(..));
    measured.elapsed = started.elapsed();
    let passed = measured.problems.is_empty();
    measured
        .problems
        .extend(workspace.finish(passed).await?.into_iter().filter(|_| !passed));
    Ok(measured)
}

/// What the load posts, and where.
#[derive(Clone)]
struct Offer {
    http: reqwest::Client,
    base: String,
    key: String,
    inboxes: Vec<String>,
    accounts: Vec<String>,
    hang: String,
    mode: Mode,
}

impl Offer {
    /// Posts on schedule for `plan.seconds`: each request on a task of its
    /// own, so a slow answer never delays the next (an open loop).
    async fn run(
        self,
        plan: NeighboursPlan,
        acked: Arc<Mutex<[usize; 2]>>,
        problems: Arc<Mutex<Vec<String>>>,
    ) -> anyhow::Result<()> {
        let started = Instant::now();
        let end = Duration::from_secs(plan.seconds);
        let mut sent = [0usize; 3];
        let mut tasks = tokio::task::JoinSet::new();
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        while started.elapsed() < end {
            tick.tick().await;
            let t = started.elapsed().as_secs_f64();
            let due = [
                (t * plan.activities_per_s) as usize,
                (t * plan.payments_per_s) as usize,
                (t * plan.hostile_per_s) as usize,
            ];
            for class in 0..3 {
                while sent[class] < due[class] {
                    let n = sent[class];
                    sent[class] += 1;
                    let this = self.clone();
                    let (acked, problems) = (acked.clone(), problems.clone());
                    tasks.spawn(async move {
                        if let Err(e) = this.post(class, n, &acked).await {
                            problems
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .push(e.to_string());
                        }
                    });
                }
            }
        }
        while tasks.join_next().await.is_some() {}
        Ok(())
    }

    /// Posts the `n`th request of `class` (0 a fan-out, 1 a payment, 2 an
    /// op to every hostile kind).
    async fn post(&self, class: usize, n: usize, acked: &Mutex<[usize; 2]>) -> anyhow::Result<()> {
        let (path, bodies) = match class {
            0 => {
                let outbox = format!("https://neighbours.laneway.example/actors/{}", n % 4);
                let activity = format!("{outbox}/activities/{n}");
                (
                    "/api/v1/activitypub/deliveries",
                    vec![json!({
                        "outbox": outbox,
                        "activity": {"id": activity, "type": "Create", "actor": outbox,
                                     "object": {"id": format!("{activity}/note"), "type": "Note"}},
                        "recipients": self.inboxes,
                    })],
                )
            }
            1 => {
                let kind = stellar::KINDS[n % 2].0;
                (
                    "/api/v1/ops",
                    vec![json!({
                        "kind": kind,
                        "outbox": "treasury",
                        "payload": {"user": self.accounts[(n + 1) % 2], "amount": (1_000_000 + n).to_string()},
                    })],
                )
            }
            _ => {
                let only = std::env::var("LW_NEIGHBOURS_ONLY").unwrap_or_default();
                // A failing op makes three calls (its attempts); the
                // clean run's ops one each, so it gets three.
                let copies = if self.mode == Mode::Clean { 3 } else { 1 };
                let mut bodies: Vec<Value> = FIXTURES
                    .iter()
                    .filter(|(kind, _, _)| only.is_empty() || only.contains(kind))
                    .flat_map(|(kind, _, _)| {
                        let payload = if *kind == "slow" { json!(self.hang) } else { json!({}) };
                        let body =
                            json!({"kind": kind, "outbox": format!("extra-{kind}-{}", n % 4), "payload": payload});
                        std::iter::repeat_n(body, copies)
                    })
                    .collect();
                bodies.push(json!({
                    "kind": HOG_KIND,
                    "outbox": "hog",
                    "payload": {"user": self.accounts[0], "amount": (1_000_000 + n).to_string()},
                }));
                ("/api/v1/ops", bodies)
            }
        };
        for body in bodies {
            let answer = procs::post_json(&self.http, format!("{}{path}", self.base), &self.key, &body)
                .timeout(Duration::from_secs(10))
                .send()
                .await
                .with_context(|| format!("posting {body}"))?;
            let status = answer.status();
            let text = answer.text().await.unwrap_or_default();
            ensure!(status.is_success(), "{path} answered {status}: {text}");
            if class < 2 {
                let count = if class == 0 { INBOXES } else { 1 };
                acked.lock().unwrap_or_else(PoisonError::into_inner)[class] += count;
            }
        }
        Ok(())
    }
}

/// A process's CPU time so far (Linux: /proc/PID/stat, in clock ticks of
/// 10 ms).
fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// The real kinds' ops not finished yet.
async fn open_real(db_url: &str) -> anyhow::Result<i64> {
    crate::run::count(
        db_url,
        "SELECT count(*) FROM ops WHERE status IN ('pending', 'submitted') \
         AND kind IN ('activitypub', 'deposit', 'referral_payout')",
    )
    .await
}

/// Every op's kind, status and enqueue-to-last-change time.
async fn read_rows(db_url: &str, measured: &mut Measured) -> anyhow::Result<()> {
    let rows: Vec<(String, String, i64)> = if db_url.starts_with("sqlite") {
        let pool = sqlx::SqlitePool::connect(db_url).await?;
        let rows = sqlx::query("SELECT kind, status, updated_at - created_at FROM laneway_ops")
            .fetch_all(&pool)
            .await?;
        pool.close().await;
        rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect()
    } else {
        let pool = sqlx::PgPool::connect(db_url).await?;
        let rows =
            sqlx::query("SELECT kind, status, (EXTRACT(EPOCH FROM updated_at - created_at) * 1000)::bigint FROM ops")
                .fetch_all(&pool)
                .await?;
        pool.close().await;
        rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect()
    };
    for (kind, status, ms) in rows {
        let class = match kind.as_str() {
            "activitypub" => Some(0),
            "deposit" | "referral_payout" => Some(1),
            _ => None,
        };
        match class {
            Some(class) if status == "confirmed" => {
                measured.latencies[class].push(u64::try_from(ms).unwrap_or(0));
            }
            Some(class) => measured
                .problems
                .push(format!("a {} op ended {status}", CLASSES[class])),
            None => *measured.fixtures.entry(kind).or_default().entry(status).or_default() += 1,
        }
    }
    Ok(())
}

/// The nearest-rank percentile `p` (0-100) of `sorted`.
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The comparison of the three modes.
#[derive(Debug, Clone)]
pub struct NeighboursReport {
    /// Per class: (acked, confirmed, p50, p95, p99) in each [`Mode`], in
    /// [`Mode::ALL`]'s order.
    pub rows: Vec<(&'static str, [Row; 3])>,
    pub fixtures: BTreeMap<String, BTreeMap<String, usize>>,
    pub refused_reloads: usize,
    /// What fails the run: an op of a real kind not confirmed, the host
    /// gone, a bad reload accepted.
    pub failures: Vec<String>,
    /// Hostile percentiles past [`TOLERANCE`] of the failing run's (what
    /// misbehaving costs): figures, reported, not a verdict (speed is
    /// measured, never a timed test on a noisy machine).
    pub misses: Vec<String>,
    /// The same against the clean run (what failing and misbehaving cost
    /// together).
    pub misses_clean: Vec<String>,
}

/// One class in one mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Row {
    pub acked: usize,
    pub confirmed: usize,
    pub p50: u64,
    pub p95: u64,
    pub p99: u64,
}

impl NeighboursReport {
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    pub fn table(&self, name: &str) -> String {
        let mut out = format!(
            "| {name:<22} | acked | confirmed | p50 ms | p95 ms | p99 ms |\n|{}|-------|-----------|--------|--------|--------|\n",
            "-".repeat(24)
        );
        for (class, rows) in &self.rows {
            for (mode, row) in Mode::ALL.iter().zip(rows) {
                out.push_str(&format!(
                    "| {:<22} | {:>5} | {:>9} | {:>6} | {:>6} | {:>6} |\n",
                    format!("{class}, {}", mode.name()),
                    row.acked,
                    row.confirmed,
                    row.p50,
                    row.p95,
                    row.p99
                ));
            }
        }
        let fixtures: Vec<String> = self
            .fixtures
            .iter()
            .map(|(kind, statuses)| {
                let s: Vec<String> = statuses.iter().map(|(st, n)| format!("{n} {st}")).collect();
                format!("{kind}: {}", s.join(", "))
            })
            .collect();
        out.push_str(&format!("hostile kinds' ops: {}\n", fixtures.join("; ")));
        out.push_str(&format!("reloads refused mid-run: {}\n", self.refused_reloads));
        for (misses, against) in [
            (&self.misses, "the failing run (what misbehaving costs)"),
            (&self.misses_clean, "the clean run (what failing and misbehaving cost)"),
        ] {
            if misses.is_empty() {
                out.push_str(&format!(
                    "latency: every hostile percentile within 10% (+2 ms) of {against}\n"
                ));
            } else {
                out.push_str(&format!("latency target (10% + 2 ms of {against}) missed:\n"));
                for miss in misses {
                    out.push_str(&format!("  {miss}\n"));
                }
            }
        }
        if self.failures.is_empty() {
            out.push_str("PASSED");
        } else {
            out.push_str("FAILED");
            for failure in &self.failures {
                out.push_str(&format!("\n  {failure}"));
            }
        }
        out
    }
}

/// The hostile run's percentiles past [`TOLERANCE`] of `base`'s.
fn misses(name: &str, base: Row, hostile: Row, against: Mode) -> Vec<String> {
    [
        ("p50", base.p50, hostile.p50),
        ("p95", base.p95, hostile.p95),
        ("p99", base.p99, hostile.p99),
    ]
    .into_iter()
    .filter_map(|(what, b, h)| {
        let bound = (b as f64 * TOLERANCE.0) as u64 + TOLERANCE.1;
        (h > bound).then(|| {
            format!(
                "{name} {what}: {h} ms beside hostile plugins against {b} ms in the {} run (target {bound} ms)",
                against.name()
            )
        })
    })
    .collect()
}

/// Pools each mode's runs and compares them: the verdict is pure, so
/// fabricated measurements can show it fails.
pub fn compare(runs: &[Measured]) -> NeighboursReport {
    let mut failures = Vec::new();
    let mut fixtures: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    let mut refused_reloads = 0;
    let mut pooled: [[Vec<u64>; 2]; 3] = Default::default();
    let mut acked = [[0usize; 2]; 3];
    let mut hostile_runs = 0;
    for run in runs {
        let mode = run.mode as usize;
        for class in 0..2 {
            pooled[mode][class].extend(&run.latencies[class]);
            acked[mode][class] += run.acked[class];
        }
        for problem in &run.problems {
            failures.push(format!("{} run: {problem}", run.mode.name()));
        }
        if run.mode == Mode::Hostile {
            hostile_runs += 1;
            refused_reloads += run.refused_reloads;
            for (kind, statuses) in &run.fixtures {
                for (status, n) in statuses {
                    *fixtures
                        .entry(kind.clone())
                        .or_default()
                        .entry(status.clone())
                        .or_default() += n;
                }
            }
        }
    }
    if hostile_runs > 0 {
        if refused_reloads < 2 * hostile_runs {
            failures.push(format!(
                "{refused_reloads} reloads refused in {hostile_runs} hostile runs, expected 2 each (wrong version, forbidden import)"
            ));
        }
        for (kind, _, _) in FIXTURES {
            if !fixtures.contains_key(kind) {
                failures.push(format!("no op of the hostile kind {kind} was enqueued"));
            }
        }
    }
    let (mut rows, mut misses_failing, mut misses_clean) = (Vec::new(), Vec::new(), Vec::new());
    for (class, name) in CLASSES.iter().enumerate() {
        let mut row = [Row::default(); 3];
        for mode in Mode::ALL {
            let m = mode as usize;
            let mut sorted = std::mem::take(&mut pooled[m][class]);
            sorted.sort_unstable();
            row[m] = Row {
                acked: acked[m][class],
                confirmed: sorted.len(),
                p50: percentile(&sorted, 50.0),
                p95: percentile(&sorted, 95.0),
                p99: percentile(&sorted, 99.0),
            };
            if row[m].acked == 0 {
                failures.push(format!("{name}: nothing acknowledged in the {} runs", mode.name()));
            }
            if row[m].confirmed != row[m].acked {
                failures.push(format!(
                    "{name}: {} of {} acknowledged confirmed in the {} runs",
                    row[m].confirmed,
                    row[m].acked,
                    mode.name()
                ));
            }
        }
        let [clean, failing, hostile] = row;
        misses_failing.extend(misses(name, failing, hostile, Mode::Failing));
        misses_clean.extend(misses(name, clean, hostile, Mode::Clean));
        rows.push((*name, row));
    }
    NeighboursReport {
        rows,
        fixtures,
        refused_reloads,
        failures,
        misses: misses_failing,
        misses_clean,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(mode: Mode, latency: u64) -> Measured {
        let mut fixtures = BTreeMap::new();
        for (kind, _, _) in FIXTURES {
            fixtures.insert(kind.to_owned(), BTreeMap::from([("failed".to_owned(), 3)]));
        }
        let hostile = mode == Mode::Hostile;
        Measured {
            mode,
            acked: [100, 20],
            latencies: [
                (0..100).map(|n| latency + n % 10).collect(),
                (0..20).map(|n| latency * 10 + n).collect(),
            ],
            fixtures: if hostile { fixtures } else { BTreeMap::new() },
            refused_reloads: if hostile { 2 } else { 0 },
            ..Measured::default()
        }
    }

    /// A clean, a failing and a hostile run at these latencies.
    fn three(clean: u64, failing: u64, hostile: u64) -> Vec<Measured> {
        vec![
            measured(Mode::Clean, clean),
            measured(Mode::Failing, failing),
            measured(Mode::Hostile, hostile),
        ]
    }

    #[test]
    fn equal_runs_pass() {
        let report = compare(&three(40, 40, 40));
        assert!(report.passed(), "{:?}", report.failures);
        assert!(report.misses.is_empty(), "{:?}", report.misses);
        assert!(report.misses_clean.is_empty(), "{:?}", report.misses_clean);
        assert_eq!(report.rows[0].1[2].p50, 44);
    }

    #[test]
    fn slower_neighbours_are_reported_not_failed() {
        let report = compare(&three(40, 40, 50));
        assert!(report.passed(), "{:?}", report.failures);
        assert!(
            report.misses.iter().any(|f| f.starts_with("activitypub p50")),
            "{:?}",
            report.misses
        );
        assert!(report.table("t").contains("missed"));
    }

    #[test]
    fn the_cost_of_failing_is_told_from_the_cost_of_misbehaving() {
        let report = compare(&three(40, 50, 50));
        assert!(report.misses.is_empty(), "{:?}", report.misses);
        assert!(
            report.misses_clean.iter().any(|f| f.contains("in the clean run")),
            "{:?}",
            report.misses_clean
        );
    }

    #[test]
    fn an_op_left_unconfirmed_fails() {
        let mut runs = three(40, 40, 40);
        runs[1].latencies[1].pop();
        let report = compare(&runs);
        assert!(
            report
                .failures
                .iter()
                .any(|f| f.contains("19 of 20") && f.contains("failing")),
            "{:?}",
            report.failures
        );
    }

    #[test]
    fn an_accepted_bad_reload_fails() {
        let mut runs = three(40, 40, 40);
        runs[2].refused_reloads = 1;
        let report = compare(&runs);
        assert!(
            report.failures.iter().any(|f| f.contains("reloads refused")),
            "{:?}",
            report.failures
        );
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(
            (percentile(&v, 50.0), percentile(&v, 95.0), percentile(&v, 99.0)),
            (50, 95, 99)
        );
        assert_eq!(percentile(&[], 50.0), 0);
    }
}
