//! `laneway demo`: the main job, visible in under a minute on the embedded
//! default. It starts fakes in-process (four ActivityPub inboxes, one slow,
//! one failing twice, one gone; a Stellar network with mild congestion),
//! writes its config beside a fresh SQLite database, starts a host through
//! the one composition root ([`crate::node`]) with the real plugins,
//! enqueues a ledger fan-out and money movements of every kind, shows
//! progress, and ends with a report checked against what the fakes saw.
//!
//! Nothing here is a shortcut around the host: the ops go through the
//! dispatcher, the signatures through the host signer, the fees through the
//! fee oracle and policy plugin, exactly as in `laneway run`.

pub mod fake_rpc;
pub mod inbox;
mod progress;
pub mod report;

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::SystemClock;
use crate::config::{self, ConfigError, FileSource};
use crate::enqueue::EnqueueRequest;
use crate::fanout::{FanOut, Recipient};
use crate::node::{Node, NodeError};
use crate::op::{Op, OpId, Status};
use crate::queue::{self, OpFilter, QueueError};
use fake_rpc::FakeRpc;
use inbox::{Behaviour, Inbox};
use report::{KindRow, Landed, LaneRow};

/// The actor whose ledger the demo fans out.
const ACTOR: &str = "https://demo.laneway.example/users/ledger";
/// How long the demo may take before it says what is still open.
const DEADLINE: Duration = Duration::from_secs(90);
/// A ledger closes this often on the fake network.
const LEDGER_MS: u64 = 250;

/// What `laneway demo` was asked.
#[derive(Debug, Clone)]
pub struct DemoArgs {
    /// The demo's config (`config/demo.toml`).
    pub config: PathBuf,
    /// Fewer ops (what the test runs).
    pub short: bool,
    /// Leave the host and its API up after the report, until ctrl-c.
    pub keep_running: bool,
    /// `LANEWAY_*` variables, layered over the demo's config as for any command.
    pub env: Vec<(String, String)>,
}

/// Why the demo could not run or finish.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// A file or socket.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The demo's config is not TOML or not a valid config.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The host could not start.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// The queue failed.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// A key could not be made.
    #[error("cannot make the demo's key {0}")]
    Key(String),
    /// The fan-out or an enqueue was refused.
    #[error("the demo's ops were refused: {0}")]
    FanOut(String),
    /// A plugin refused a kind's config.
    #[error("a plugin refused the demo's config: {0}")]
    Refused(String),
    /// Ops were still open at the deadline.
    #[error("the demo did not finish within {secs} s; still open: {open}")]
    Unfinished {
        /// The deadline.
        secs: u64,
        /// What was open.
        open: String,
    },
    /// A lane's deliveries broke the lane rule.
    #[error("the lane rule was broken:\n{0}")]
    OutOfOrder(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DemoError {
    let what = what.into();
    move |source| DemoError::Io { what, source }
}

/// How much the demo enqueues.
#[derive(Debug, Clone, Copy)]
struct Size {
    activities: u64,
    deposits: u64,
    rebalances: u64,
    withdrawals: u64,
    payouts: u64,
}

impl Size {
    fn of(short: bool) -> Self {
        if short {
            Size {
                activities: 4,
                deposits: 4,
                rebalances: 2,
                withdrawals: 2,
                payouts: 8,
            }
        } else {
            Size {
                activities: 10,
                deposits: 10,
                rebalances: 4,
                withdrawals: 4,
                payouts: 40,
            }
        }
    }
}

/// The fakes the demo runs against.
struct Fakes {
    inboxes: Vec<Arc<Inbox>>,
    rpc: FakeRpc,
    rpc_url: String,
    closer: tokio::task::JoinHandle<()>,
}

impl Drop for Fakes {
    fn drop(&mut self) {
        self.closer.abort();
    }
}

/// What the demo enqueued, to check the outcome against.
#[derive(Default)]
struct Ledger {
    /// Ledger position of each ActivityPub op.
    positions: HashMap<OpId, u64>,
    /// Op of each Stellar amount (amounts are unique).
    amounts: HashMap<i128, OpId>,
    /// Every op, in enqueue order.
    order: Vec<OpId>,
}

/// Runs the demo and writes its report to `out`.
///
/// # Errors
///
/// [`DemoError`]; an order check that fails is an error too.
pub async fn run(args: DemoArgs, out: &mut dyn Write) -> Result<(), DemoError> {
    let size = Size::of(args.short);
    let mut text = std::fs::read_to_string(&args.config).map_err(io(format!(
        "cannot read {} (run the demo from the repository's root, or give --config)",
        args.config.display()
    )))?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        ConfigError::Invalid(vec![config::Problem {
            path: args.config.display().to_string(),
            message: format!("not valid TOML: {}", e.message()),
        }])
    })?;
    let dir = demo_dir()?;
    let keys = make_keys(&table, &dir)?;
    let actor_key = keys
        .get("actor")
        .cloned()
        .ok_or_else(|| DemoError::Key("actor: the demo config has no [keys.actor]".into()))?;
    let fakes = start_fakes(&keys, &actor_key).await?;
    // The vault contract requires each call's signer to authorise it, as
    // the real one does: a pool's channel carries a call its signer signed.
    for (function, signer) in signers_of(&table) {
        if let Some(DemoKey::Ed25519(public)) = keys.get(&signer) {
            fakes.rpc.require_auth(&function, *public);
        }
    }
    text = effective_config(table, &dir, &fakes.rpc_url)?;
    let path = dir.join("laneway.toml");
    std::fs::write(&path, &text).map_err(io(format!("cannot write {}", path.display())))?;
    let config = config::load(&FileSource::Explicit(path.clone()), args.env.clone())?;

    let queue = queue::open(&config.database, config.limits(), Arc::new(SystemClock)).await?;
    queue.migrate().await?;
    let database = queue::redact_url(&config.database.url);
    let node = Node::open(config, Some(FileSource::Explicit(path.clone()))).await?;
    let api = node.api_addr();
    // A kind its plugin refused would leave its ops waiting, and the demo
    // waiting for them: say why now instead.
    let refused = node
        .plugins
        .as_ref()
        .map(|p| p.status().refused_kinds)
        .unwrap_or_default();
    if !refused.is_empty() {
        node.stop().await?;
        return Err(DemoError::Refused(refused.join("; ")));
    }

    writeln!(out, "laneway demo: {}", dir.display()).map_err(io("output"))?;
    for inbox in &fakes.inboxes {
        writeln!(
            out,
            "  inbox {:<7} {} ({})",
            inbox.name,
            inbox.url,
            inbox.behaviour.describe()
        )
        .map_err(io("output"))?;
    }
    writeln!(
        out,
        "  stellar {} (a ledger every {LEDGER_MS} ms, mild congestion)\n  (LANEWAY_LOG=info shows the host's log)",
        fakes.rpc_url
    )
    .map_err(io("output"))?;

    let mut ledger = Ledger::default();
    enqueue_all(&node, &fakes, &keys, size, &mut ledger).await?;
    let finished = progress::watch(&node, &ledger.order, DEADLINE).await?;
    if let Some(open) = finished {
        return Err(DemoError::Unfinished {
            secs: DEADLINE.as_secs(),
            open,
        });
    }

    let ops = ops_of(&node, &ledger.order).await?;
    let pools = node.dispatcher.config().pools.clone();
    let redealt: HashSet<OpId> = node
        .dispatcher
        .queue()
        .redealt(&ledger.order)
        .await?
        .into_iter()
        .collect();
    let (lanes, notes) = lane_rows(&pools, &ops, &ledger, &fakes, &keys, size.activities, &redealt);
    let kinds = kind_rows(&node, &ops).await?;
    writeln!(out, "\nLanes\n{}", report::lanes_table(&lanes)).map_err(io("output"))?;
    for line in notes {
        writeln!(out, "{line}").map_err(io("output"))?;
    }
    writeln!(out, "\nKinds\n{}", report::kinds_table(&kinds)).map_err(io("output"))?;
    for inbox in &fakes.inboxes {
        if inbox.refused() > 0 {
            return Err(DemoError::OutOfOrder(format!(
                "inbox {} refused {} requests whose signature did not verify",
                inbox.name,
                inbox.refused()
            )));
        }
    }
    let requests: u32 = fakes.inboxes.iter().map(|i| i.requests()).sum();
    writeln!(
        out,
        "\nEvery one of the {requests} inbox requests carried an HTTP Signature the inbox verified; \
         {} transactions landed, each signed by its lane's key (the fake network checks).",
        fakes.rpc.landed().len()
    )
    .map_err(io("output"))?;
    explain_dead_letter(out, &ops, &path)?;
    let exe = exe();
    if let Some(api) = api {
        writeln!(
            out,
            "\nAPI       http://{api}/api/v1  (a key: {exe} --config {} api-keys new --name me --scopes outbox:read)",
            path.display()
        )
        .map_err(io("output"))?;
        writeln!(out, "Metrics   http://{api}/metrics").map_err(io("output"))?;
    }
    writeln!(out, "Database  {database}").map_err(io("output"))?;
    writeln!(out, "Config    {}", path.display()).map_err(io("output"))?;

    let broken = report::broken(&lanes);
    if !broken.is_empty() {
        return Err(DemoError::OutOfOrder(broken));
    }
    if args.keep_running {
        writeln!(out, "\nThe host keeps running; ctrl-c stops it.").map_err(io("output"))?;
        out.flush().map_err(io("output"))?;
        crate::node::shutdown_signal().await;
    }
    node.stop().await?;
    drop(fakes);
    Ok(())
}

/// A fresh directory for this run, kept afterwards so the database can be
/// inspected with the CLI line the report prints.
fn demo_dir() -> Result<PathBuf, DemoError> {
    let stamp = chrono::Utc::now().format("%Y%m%d-%H%M%S-%3f");
    let dir = std::env::temp_dir().join(format!("laneway-demo-{stamp}"));
    std::fs::create_dir_all(&dir).map_err(io(format!("cannot create {}", dir.display())))?;
    Ok(dir)
}

/// A key the demo generated: its file, and its public half.
#[derive(Clone)]
enum DemoKey {
    Rsa(rsa::RsaPublicKey),
    Ed25519([u8; 32]),
}

/// Generates every `[keys.*]` of the demo config into `dir`: RSA for
/// `rsa-sha256`, Ed25519 otherwise.
fn make_keys(table: &toml::Table, dir: &Path) -> Result<HashMap<String, DemoKey>, DemoError> {
    use rsa::pkcs8::EncodePrivateKey as _;
    let mut keys = HashMap::new();
    let Some(toml::Value::Table(declared)) = table.get("keys") else {
        return Ok(keys);
    };
    for (seed, (id, spec)) in (42u8..).zip(declared) {
        let algorithm = spec.get("algorithm").and_then(toml::Value::as_str).unwrap_or("ed25519");
        let (pem, key) = if algorithm.starts_with("rsa") {
            let private = rsa::RsaPrivateKey::new(&mut rand::thread_rng(), 2048)
                .map_err(|e| DemoError::Key(format!("{id}: {e}")))?;
            let pem = private
                .to_pkcs8_pem(rsa::pkcs8::LineEnding::LF)
                .map_err(|e| DemoError::Key(format!("{id}: {e}")))?;
            (pem.to_string(), DemoKey::Rsa(private.to_public_key()))
        } else {
            let (pem, public) = fake_rpc::keypair(seed).map_err(|e| DemoError::Key(format!("{id}: {e}")))?;
            (pem, DemoKey::Ed25519(public))
        };
        let file = dir.join(format!("{id}.pem"));
        std::fs::write(&file, pem).map_err(io(format!("cannot write {}", file.display())))?;
        keys.insert(id.clone(), key);
    }
    Ok(keys)
}

async fn start_fakes(keys: &HashMap<String, DemoKey>, actor: &DemoKey) -> Result<Fakes, DemoError> {
    let DemoKey::Rsa(public) = actor else {
        return Err(DemoError::Key("actor: the demo's actor signs with rsa-sha256".into()));
    };
    let verifier = crate::inbound::PublicKey::Rsa(public.clone());
    let mut inboxes = Vec::new();
    for (name, behaviour) in [
        ("prompt", Behaviour::Prompt),
        ("slow", Behaviour::Slow(Duration::from_millis(400))),
        ("flaky", Behaviour::FailFirst(2)),
        ("gone", Behaviour::Gone),
    ] {
        inboxes.push(
            inbox::start(name, behaviour, verifier.clone())
                .await
                .map_err(io("cannot start a fake inbox"))?,
        );
    }
    let rpc = FakeRpc::default();
    // Mild congestion: ledgers 60% full and a spread of 6x make the policy
    // grade the network "elevated": critical ops bid the aggressive p95.
    rpc.set_fees(100, 250, 600, 900, 60);
    for key in keys.values() {
        if let DemoKey::Ed25519(public) = key {
            rpc.fund(*public, 4_294_967_296);
        }
    }
    // One busy answer from the network, so a retry on a signer lane shows.
    rpc.inject(&[fake_rpc::SendFault::TryAgainLater]);
    let rpc_url = rpc.serve().await.map_err(io("cannot start the fake Stellar RPC"))?;
    let closer = rpc.close_ledgers_every(Duration::from_millis(LEDGER_MS));
    Ok(Fakes {
        inboxes,
        rpc,
        rpc_url,
        closer,
    })
}

/// The demo config with what the demo made filled in (see `config/demo.toml`).
fn effective_config(mut table: toml::Table, dir: &Path, rpc_url: &str) -> Result<String, DemoError> {
    let cwd = std::env::current_dir().map_err(io("cannot read the current directory"))?;
    let set = |table: &mut toml::Table, path: &[&str], value: toml::Value| {
        let mut at = table;
        for part in &path[..path.len() - 1] {
            let next = at
                .entry((*part).to_owned())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            let toml::Value::Table(next) = next else { return };
            at = next;
        }
        at.insert(path[path.len() - 1].to_owned(), value);
    };
    let text = |s: &str| toml::Value::String(s.to_owned());
    let database = format!("sqlite://{}", dir.join("laneway.db").display());
    set(&mut table, &["database", "url"], text(&database));
    set(&mut table, &["api", "listen"], text("127.0.0.1:0"));
    let names = |table: &toml::Table, section: &str| -> Vec<String> {
        table
            .get(section)
            .and_then(toml::Value::as_table)
            .map(|t| t.keys().cloned().collect())
            .unwrap_or_default()
    };
    for id in names(&table, "keys") {
        let file = dir.join(format!("{id}.pem")).display().to_string();
        set(&mut table, &["keys", &id, "file"], text(&file));
    }
    for name in names(&table, "plugins") {
        let relative = table["plugins"][&name]
            .get("path")
            .and_then(toml::Value::as_str)
            .map(PathBuf::from);
        if let Some(path) = relative.filter(|p| p.is_relative()) {
            let absolute = cwd.join(path).display().to_string();
            set(&mut table, &["plugins", &name, "path"], text(&absolute));
        }
    }
    for name in names(&table, "oracles") {
        set(&mut table, &["oracles", &name, "rpc_url"], text(rpc_url));
    }
    let archive = dir.join("archive").display().to_string();
    for kind in names(&table, "kinds") {
        let has_rpc = table["kinds"][&kind]
            .get("config")
            .and_then(|c| c.get("rpc_url"))
            .is_some();
        if has_rpc {
            set(&mut table, &["kinds", &kind, "config", "rpc_url"], text(rpc_url));
        }
        set(&mut table, &["kinds", &kind, "archive"], text(&archive));
    }
    let header = "# Written by `laneway demo` from config/demo.toml, with what it made at\n\
                  # start filled in: this is the config the demo's host ran.\n\n";
    toml::to_string(&table)
        .map(|body| format!("{header}{body}"))
        .map_err(|e| DemoError::Io {
            what: "cannot write the demo's config as TOML".to_owned(),
            source: std::io::Error::other(e),
        })
}

/// Each vault kind's contract function and the key that signs its calls.
fn signers_of(table: &toml::Table) -> Vec<(String, String)> {
    let Some(toml::Value::Table(kinds)) = table.get("kinds") else {
        return Vec::new();
    };
    kinds
        .values()
        .filter_map(|kind| {
            let config = kind.get("config")?;
            let function = config.get("function")?.as_str()?;
            let signer = config.get("signer_key")?.as_str()?;
            Some((function.to_owned(), signer.to_owned()))
        })
        .collect()
}

fn stellar_address(key: &DemoKey) -> Option<String> {
    match key {
        DemoKey::Ed25519(public) => Some(fake_rpc::address(*public)),
        DemoKey::Rsa(_) => None,
    }
}

/// Enqueues the ledger fan-out and the money movements, in the order a
/// producer would: the backlog first, then withdrawals, which as CRITICAL
/// ops overtake the backlog on the shared signer.
async fn enqueue_all(
    node: &Node,
    fakes: &Fakes,
    keys: &HashMap<String, DemoKey>,
    size: Size,
    ledger: &mut Ledger,
) -> Result<(), DemoError> {
    let dispatcher = &node.dispatcher;
    for position in 1..=size.activities {
        let activity = serde_json::json!({
            "@context": "https://www.w3.org/ns/activitystreams",
            "id": format!("{ACTOR}/activities/{position}"),
            "type": "Create",
            "actor": ACTOR,
            "object": { "type": "Note", "id": format!("{ACTOR}/entries/{position}"), "position": position,
                        "content": format!("Ledger entry {position}") },
        });
        let (enqueued, _) = dispatcher
            .fan_out(&FanOut {
                kind: "activitypub".into(),
                actor: ACTOR.into(),
                activity: activity.to_string(),
                recipients: fakes.inboxes.iter().map(|i| Recipient::parse(&i.url)).collect(),
                priority: None,
                subject: None,
            })
            .await
            .map_err(|e| DemoError::FanOut(e.to_string()))?;
        for e in enqueued {
            ledger.positions.insert(e.id(), position);
            ledger.order.push(e.id());
        }
    }
    let user = |n: u64| stellar_address(&DemoKey::Ed25519([u8::try_from(n % 200).unwrap_or(0) + 1; 32]));
    let mut amount: i128 = 10_000_000;
    let mut money = |kind: &str, n: u64| {
        amount += 1_000_000 + i128::from(n);
        let who = if kind == "referral_payout" { "referrer" } else { "user" };
        let mut payload = serde_json::json!({ "amount": amount.to_string() });
        payload[who] = serde_json::Value::from(user(n).unwrap_or_default());
        if kind == "rebalance" {
            payload["strategy"] = serde_json::Value::from("yield");
        }
        (kind.to_owned(), payload.to_string(), amount)
    };
    let mut backlog = Vec::new();
    for n in 0..size.deposits.max(size.rebalances) {
        if n < size.deposits {
            backlog.push(money("deposit", n));
        }
        if n < size.rebalances {
            backlog.push(money("rebalance", n));
        }
    }
    for n in 0..size.payouts {
        backlog.push(money("referral_payout", n));
    }
    enqueue(node, keys, backlog, ledger).await?;
    // The withdrawals come once the backlog is moving, as users ask; as
    // CRITICAL ops they go next on the vault agent's lane.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while fakes.rpc.landed().is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let withdrawals = (0..size.withdrawals).map(|n| money("withdraw", n)).collect();
    enqueue(node, keys, withdrawals, ledger).await
}

/// Enqueues money movements as a producer does: through the kind's rules
/// (its default priority), on the lane of the signer its config names.
async fn enqueue(
    node: &Node,
    keys: &HashMap<String, DemoKey>,
    ops: Vec<(String, String, i128)>,
    ledger: &mut Ledger,
) -> Result<(), DemoError> {
    let config = node.dispatcher.config();
    let mut prepared = Vec::new();
    let mut amounts = Vec::new();
    for (kind, payload, amount) in ops {
        // A pool's kind is dealt its channel by the host.
        let pooled = config.kinds.get(&kind).is_some_and(|k| k.pool.is_some());
        let signer = config
            .kinds
            .get(&kind)
            .and_then(|k| k.config.get("signer_key"))
            .and_then(toml::Value::as_str)
            .and_then(|id| keys.get(id))
            .and_then(stellar_address)
            .ok_or_else(|| DemoError::Key(format!("kinds.{kind}.config.signer_key: names no key the demo made")))?;
        let request = EnqueueRequest {
            kind,
            outbox: "vault".to_owned(),
            lanes: if pooled { Vec::new() } else { vec![signer] },
            payload,
            ..EnqueueRequest::default()
        };
        prepared.push(crate::enqueue::prepare(request, &config).map_err(|e| DemoError::FanOut(e.to_string()))?);
        amounts.push(amount);
    }
    let enqueued = node.dispatcher.enqueue(&prepared).await?;
    for (e, amount) in enqueued.into_iter().zip(amounts) {
        ledger.amounts.insert(amount, e.id());
        ledger.order.push(e.id());
    }
    Ok(())
}

/// The demo's ops (`ids`) as the queue has them now.
async fn ops_of(node: &Node, ids: &[OpId]) -> Result<Vec<Op>, DemoError> {
    let wanted: HashSet<OpId> = ids.iter().copied().collect();
    let filter = OpFilter {
        limit: 100_000,
        ..OpFilter::default()
    };
    let mut ops: Vec<Op> = node.dispatcher.queue().list(&filter).await?;
    ops.retain(|o| wanted.contains(&o.id));
    Ok(ops)
}

/// The lane table's rows, and for each signer the kinds in the order they
/// landed on chain (where a CRITICAL withdrawal overtaking the backlog shows).
fn lane_rows(
    pools: &std::collections::BTreeMap<String, crate::config::PoolConfig>,
    ops: &[Op],
    ledger: &Ledger,
    fakes: &Fakes,
    keys: &HashMap<String, DemoKey>,
    activities: u64,
    redealt: &HashSet<OpId>,
) -> (Vec<LaneRow>, Vec<String>) {
    let mut notes = Vec::new();
    let enqueued: HashMap<OpId, usize> = ledger.order.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    let mut rows = Vec::new();
    for inbox in &fakes.inboxes {
        let mut mine: Vec<&Op> = ops.iter().filter(|o| o.lanes.contains(&inbox.url)).collect();
        mine.sort_by_key(|o| enqueued.get(&o.id).copied().unwrap_or(usize::MAX));
        let confirmed: Vec<u64> = mine
            .iter()
            .filter(|o| o.status == Status::Confirmed)
            .filter_map(|o| ledger.positions.get(&o.id).copied())
            .collect();
        let order = report::inbox_order(&confirmed, &inbox.arrivals());
        let left_out = activities.saturating_sub(u64::try_from(mine.len()).unwrap_or(0));
        if left_out > 0 {
            notes.push(format!(
                "inbox {} answered 410 Gone: laneway remembers it, and the {left_out} later fan-outs left it out \
                 (`laneway destinations list` shows it)",
                inbox.name
            ));
        }
        rows.push(report::lane_row(format!("inbox {}", inbox.name), &mine, order));
    }
    let mut signers: Vec<(&String, &DemoKey)> = keys.iter().collect();
    signers.sort_by_key(|(id, _)| (*id).clone());
    let channel_of: HashMap<&str, &str> = pools
        .iter()
        .flat_map(|(pool, p)| p.channels.iter().map(move |c| (c.as_str(), pool.as_str())))
        .collect();
    for (id, key) in signers {
        let (Some(address), DemoKey::Ed25519(public)) = (stellar_address(key), key) else {
            continue;
        };
        let mine: Vec<&Op> = ops.iter().filter(|o| o.lanes.contains(&address)).collect();
        if mine.is_empty() {
            continue;
        }
        let role = match channel_of.get(id.as_str()) {
            Some(pool) => format!("channel {id} (pool {pool})"),
            None => format!("signer {id}"),
        };
        let by_id: HashMap<OpId, &Op> = mine.iter().map(|o| (o.id, *o)).collect();
        let mut landed = fakes.rpc.landed();
        landed.retain(|t| t.source == *public);
        landed.sort_by_key(|t| t.sequence);
        let mut chain = Vec::new();
        let mut kinds: Vec<(&str, usize)> = Vec::new();
        let mut unknown = None;
        for tx in &landed {
            let op = amount_of(&tx.args)
                .and_then(|a| ledger.amounts.get(&a))
                .and_then(|id| by_id.get(id));
            match op {
                Some(op) => {
                    chain.push(Landed {
                        sequence: tx.sequence,
                        priority: op.priority,
                        enqueued: enqueued.get(&op.id).copied().unwrap_or(usize::MAX),
                        redealt: channel_of.contains_key(id.as_str()) && redealt.contains(&op.id),
                    });
                    match kinds.last_mut() {
                        Some((kind, n)) if *kind == op.kind => *n += 1,
                        _ => kinds.push((op.kind.as_str(), 1)),
                    }
                }
                None => unknown = Some(tx.hash.clone()),
            }
        }
        let confirmed = mine.iter().filter(|o| o.status == Status::Confirmed).count();
        let order = match unknown {
            Some(hash) => report::Order::Broken(format!("transaction {hash} is no op of this lane")),
            None if chain.len() != confirmed => report::Order::Broken(format!(
                "{} transactions landed for {confirmed} confirmed ops",
                chain.len()
            )),
            None => report::signer_order(&chain),
        };
        rows.push(report::lane_row(role.clone(), &mine, order));
        let runs: Vec<String> = kinds
            .iter()
            .map(|(kind, n)| {
                if *n == 1 {
                    (*kind).to_owned()
                } else {
                    format!("{kind} ×{n}")
                }
            })
            .collect();
        let moved = chain.iter().filter(|l| l.redealt).count();
        let moved = if moved == 0 {
            String::new()
        } else {
            format!(" ({moved} re-dealt to it from a channel that could not send them; they keep the pool's order)")
        };
        notes.push(format!("{role} landed: {}{moved}", runs.join(" → ")));
    }
    for (name, pool) in pools {
        let publics: HashSet<[u8; 32]> = pool
            .channels
            .iter()
            .filter_map(|c| match keys.get(c) {
                Some(DemoKey::Ed25519(p)) => Some(*p),
                _ => None,
            })
            .collect();
        let mut per_ledger: HashMap<u32, usize> = HashMap::new();
        let mut paid_by_channels = 0usize;
        for t in fakes.rpc.landed() {
            if let (true, fake_rpc::TxState::Success { ledger }) = (publics.contains(&t.source), t.state) {
                *per_ledger.entry(ledger).or_default() += 1;
                paid_by_channels += usize::from(publics.contains(&t.fee_source));
            }
        }
        let landed: usize = per_ledger.values().sum();
        let payer = if paid_by_channels == 0 {
            "every fee paid by the signer in a fee bump".to_owned()
        } else {
            format!("{paid_by_channels} fees paid by the channels")
        };
        if let (Some(first), Some(last)) = (per_ledger.keys().min(), per_ledger.keys().max()) {
            notes.push(format!(
                "pool {name}: {landed} transactions from {} channels over ledgers {first}..={last} ({:.1} a ledger, \
                 at most {} in one; {payer})",
                publics.len(),
                landed as f64 / f64::from(last - first + 1),
                per_ledger.values().max().copied().unwrap_or(0)
            ));
        }
    }
    (rows, notes)
}

/// How to call this binary in a printed command line: its path when it is
/// laneway (`./dev run` does not put it on PATH), else `laneway`.
fn exe() -> String {
    std::env::current_exe()
        .ok()
        .filter(|p| p.file_stem().is_some_and(|s| s == "laneway"))
        .map_or_else(|| "laneway".to_owned(), |p| p.display().to_string())
}

fn amount_of(args: &[stellar_xdr::ScVal]) -> Option<i128> {
    args.iter().find_map(|a| match a {
        stellar_xdr::ScVal::I128(p) => Some((i128::from(p.hi) << 64) | i128::from(p.lo)),
        _ => None,
    })
}

async fn kind_rows(node: &Node, ops: &[Op]) -> Result<Vec<KindRow>, DemoError> {
    let queue = node.dispatcher.queue();
    let mut rows = Vec::new();
    for kind in ["activitypub", "withdraw", "deposit", "rebalance", "referral_payout"] {
        let mine: Vec<&Op> = ops.iter().filter(|o| o.kind == kind).collect();
        if mine.is_empty() {
            continue;
        }
        let mut fees = Vec::new();
        for op in mine.iter().filter(|o| o.status == Status::Confirmed) {
            let attempts = queue.attempts(op.id).await?;
            if let Some(fee) = attempts.last().and_then(|a| a.record.fee) {
                fees.push(fee);
            }
        }
        rows.push(report::kind_row(kind, &mine, &fees));
    }
    Ok(rows)
}

fn explain_dead_letter(out: &mut dyn Write, ops: &[Op], config: &Path) -> Result<(), DemoError> {
    let mut dead: Vec<&Op> = ops.iter().filter(|o| o.status == Status::Failed).collect();
    dead.sort_by_key(|o| o.id);
    let Some(first) = dead.first() else {
        return Ok(());
    };
    let why = first.last_error.as_deref().unwrap_or("no error recorded");
    writeln!(
        out,
        "\n{} dead letter{}; the first, op {} to {}: {why}",
        dead.len(),
        if dead.len() == 1 { "" } else { "s" },
        first.id,
        first.lanes.join(", "),
    )
    .map_err(io("output"))?;
    let exe = exe();
    writeln!(
        out,
        "Inspect it:  {exe} --config {} ops show {}",
        config.display(),
        first.id
    )
    .map_err(io("output"))?;
    Ok(())
}
