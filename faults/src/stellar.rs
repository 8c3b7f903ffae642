//! The Stellar kinds under faults: the real `stellar-vault` plugin and the
//! repository's fake Stellar RPC as a process of its own
//! (`tests/tools/fake_stellar_rpc.rs`, which checks every envelope's
//! signature, sequence, fee and bounds, and applies what it accepts when a
//! ledger closes), a signer carrying deposits and a pool of four channel accounts carrying
//! referral payouts (the rewards key authorising each), a producer posting
//! payments through the API, and the host killed -9, aborted at the
//! dispatcher's failpoints, frozen past its lease, and left without answers
//! by the RPC (accepted then 504, accepted then hung, accepted then lost,
//! busy). Then a clean host drains, and [`crate::check::check_stellar`]
//! reads what landed on the fake chain against the database.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use rand::Rng as _;
use serde_json::{json, Value};
use sqlx::Row as _;

use crate::check::{Landed, Status, StellarAcked, StellarHistory};
use crate::procs::{self, Proc};
use crate::run::{
    failpoint_reached, open_count, post_until_accepted, prepare, stall, Backend, Env, Workspace, LEASE_MS, SLOT_TTL_MS,
};

/// How one host's life ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StellarFault {
    /// kill -9 0.2-1.5 s after it is ready.
    Kill,
    /// `LANEWAY_FAILPOINT=name@N`.
    Failpoint(String),
    /// The next sends get this fault from the RPC (a line of the fake's
    /// stdin: `504 N`, `hang N`, `lose`, `busy`); then kill -9 while the
    /// transaction's fate is unknown to the host.
    Rpc(&'static str),
    /// SIGSTOP past the lease while a second host takes over; SIGCONT;
    /// both killed.
    Stall,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct StellarPlan {
    pub backend: Backend,
    /// Payments, alternating between the two kinds.
    pub ops: usize,
    pub faults: Vec<StellarFault>,
    /// How often the fake closes a ledger.
    pub close_ms: u64,
    pub drain_deadline: Duration,
}

/// What happened.
#[derive(Debug, Default)]
pub struct StellarOutcome {
    pub history: StellarHistory,
    pub faults: Vec<String>,
    pub elapsed: Duration,
}

/// The channel accounts referral payouts come from (with [`section`]'s
/// pool): four lanes, the rewards key authorising each call.
pub(crate) const CHANNELS: [&str; 4] = ["chan-1", "chan-2", "chan-3", "chan-4"];

/// The two kinds and their signers: deposits on the vault signer's lane,
/// payouts (with the pool) on the channels'.
pub(crate) const KINDS: [(&str, &str, &str); 2] = [
    ("deposit", "deposit", "vault"),
    ("referral_payout", "pay_referral", "rewards"),
];

const CONTRACT: &str = "CAAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQC526";
const PASSPHRASE: &str = "Test SDF Network ; September 2015";

fn config_text(db_url: &str, rpc: &str, plugins: &Path, dir: &Path) -> String {
    format!(
        r#"# Written by laneway-faults (Stellar).
[database]
url = "{db_url}"
[queue]
lease_ms = {LEASE_MS}
[dispatch]
poll_ms = 100
slot_ttl_ms = {SLOT_TTL_MS}
shutdown_grace_ms = 2000
[runtime]
reload_debounce_ms = 50
{section}"#,
        section = section(rpc, plugins, dir, true)
    )
}

/// The Stellar part of a config: the signers' keys (`vault.pem`,
/// `rewards.pem` in `dir`), the vault plugin, the fee policy and its
/// oracle, and [`KINDS`]; with `pool`, the payouts come from [`CHANNELS`]
/// (`chan-N.pem`). The neighbours run adds it (without the pool) to its own.
pub(crate) fn section(rpc: &str, plugins: &Path, dir: &Path, pool: bool) -> String {
    let channels: Vec<&str> = if pool { CHANNELS.to_vec() } else { Vec::new() };
    let mut grants = vec!["\"vault\"".to_owned(), "\"rewards\"".to_owned()];
    grants.extend(channels.iter().map(|c| format!("{c:?}")));
    let mut text = format!(
        r#"[keys.vault]
algorithm = "ed25519"
file = "{vault}"
[keys.rewards]
algorithm = "ed25519"
file = "{rewards}"
[plugins.vault]
path = "{plugins}/stellar_vault.wasm"
allowed_hosts = ["http://127.0.0.1:*"]
allowed_internal = ["127.0.0.1"]
keys = [{grants}]
[plugins.fees]
path = "{plugins}/fee_policy.wasm"
[oracles.stellar]
policy = "fees"
rpc_url = "{rpc}"
poll_ms = 200
first_sample_wait_ms = 0
"#,
        vault = dir.join("vault.pem").display(),
        rewards = dir.join("rewards.pem").display(),
        plugins = plugins.display(),
        grants = grants.join(", "),
    );
    for (kind, function, signer) in KINDS {
        let section = kind_section(kind, function, signer, "stellar", rpc);
        text.push_str(&if pool && kind == "referral_payout" {
            section.replacen(
                "[kinds.referral_payout]\n",
                "[kinds.referral_payout]\npool = \"payouts\"\n",
                1,
            )
        } else {
            section
        });
    }
    if pool {
        for channel in &channels {
            text.push_str(&format!(
                "[keys.{channel}]\nalgorithm = \"ed25519\"\nfile = \"{}\"\n",
                dir.join(format!("{channel}.pem")).display()
            ));
        }
        let listed: Vec<String> = channels.iter().map(|c| format!("{c:?}")).collect();
        text.push_str(&format!(
            "[pools.payouts]\nchannels = [{}]\nfee_payer = \"signer\"\n",
            listed.join(", ")
        ));
    }
    text
}

/// One payment kind of the vault plugin: `signer` pays through
/// `function`, priced by `oracle`.
pub(crate) fn kind_section(kind: &str, function: &str, signer: &str, oracle: &str, rpc: &str) -> String {
    format!(
        r#"[kinds.{kind}]
plugin = "vault"
fee_oracle = "{oracle}"
max_fee_bumps = 3
backoff_base_ms = 50
backoff_max_ms = 500
max_attempts = 1000
timeout_ms = 20000
[kinds.{kind}.config]
rpc_url = "{rpc}"
network_passphrase = "{PASSPHRASE}"
contract_id = "{CONTRACT}"
function = "{function}"
signer_key = "{signer}"
poll_ms = 50
try_again_ms = 100
args = [{{ field = "user", type = "address" }}, {{ field = "amount", type = "i128" }}]
"#
    )
}

/// A fresh Ed25519 key as PKCS#8 PEM.
pub(crate) fn write_ed25519(path: &Path) -> anyhow::Result<()> {
    use ed25519_dalek::pkcs8::EncodePrivateKey as _;
    let key = ed25519_dalek::SigningKey::from_bytes(&rand::thread_rng().gen::<[u8; 32]>());
    let pem = key
        .to_pkcs8_pem(ed25519_dalek::pkcs8::spki::der::pem::LineEnding::LF)
        .context("encoding an Ed25519 key")?;
    std::fs::write(path, pem.as_bytes())?;
    Ok(())
}

/// The fake RPC, its stdin kept to inject faults.
pub(crate) struct FakeRpc {
    pub proc: Proc,
    stdin: std::process::ChildStdin,
    state: PathBuf,
}

impl FakeRpc {
    pub fn start(
        bin: &Path,
        port: u16,
        close_ms: u64,
        (fund, auth): (&[String], &[(&str, String)]),
        dir: &Path,
    ) -> anyhow::Result<Self> {
        let state = dir.join("chain.json");
        let log = std::fs::File::create(dir.join("rpc.log"))?;
        let mut command = Command::new(bin);
        command
            .args([
                "--port",
                &port.to_string(),
                "--close-ms",
                &close_ms.to_string(),
                "--state",
            ])
            .arg(&state)
            .stdin(Stdio::piped())
            .stdout(log.try_clone()?)
            .stderr(log);
        for account in fund {
            command.args(["--fund", account]);
        }
        for (function, account) in auth {
            command.args(["--require-auth", &format!("{function}={account}")]);
        }
        let (proc, stdin) = Proc::spawn_with_stdin(command, "fake-rpc")
            .with_context(|| format!("{} (cargo test builds it: the laneway-tests example)", bin.display()))?;
        Ok(Self { proc, stdin, state })
    }

    fn inject(&mut self, line: &str) -> anyhow::Result<()> {
        writeln!(self.stdin, "{line}").context("the fake RPC's stdin")?;
        Ok(())
    }

    /// What landed, and the three counts that must stay 0 (sends while
    /// the source had one queued, bad sequences, authorisations that did
    /// not hold).
    pub fn read(&self) -> anyhow::Result<(Vec<Landed>, usize, usize, usize)> {
        let Ok(text) = std::fs::read_to_string(&self.state) else {
            return Ok((Vec::new(), 0, 0, 0));
        };
        let state: Value = serde_json::from_str(&text).context("the fake's state file")?;
        let landed = state["landed"]
            .as_array()
            .context("landed")?
            .iter()
            .map(|tx| Landed {
                // A fee bump lands under its own hash; the op's receipt
                // names the transaction it wraps.
                hash: tx["inner_hash"]
                    .as_str()
                    .or_else(|| tx["hash"].as_str())
                    .unwrap_or_default()
                    .to_owned(),
                source: tx["source"].as_str().unwrap_or_default().to_owned(),
                fee_source: tx["fee_source"].as_str().unwrap_or_default().to_owned(),
                args: tx["args"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
                    .unwrap_or_default(),
            })
            .collect();
        let count = |name: &str| state[name].as_u64().and_then(|n| usize::try_from(n).ok()).unwrap_or(0);
        Ok((
            landed,
            count("concurrent_sends"),
            count("bad_seqs"),
            count("auth_failures"),
        ))
    }
}

/// The Stellar account of the host's key `key`, as `laneway keys show`
/// prints it.
pub(crate) fn account(laneway: &crate::procs::Laneway, key: &str) -> anyhow::Result<String> {
    let shown: Value = serde_json::from_str(&laneway.cli(&["keys", "show", key, "--json"])?)?;
    Ok(shown["stellar_account"]
        .as_str()
        .or_else(|| shown["account"].as_str())
        .with_context(|| format!("no account in {shown}"))?
        .to_owned())
}

/// Runs one Stellar plan to the end.
pub async fn run(plan: &StellarPlan, env: &Env, fake_rpc: &Path) -> anyhow::Result<StellarOutcome> {
    let started = Instant::now();
    let workspace = Workspace::new(env, &plan.backend).await?;
    let (dir, db_url) = (&workspace.dir, workspace.db_url.as_str());
    write_ed25519(&dir.join("vault.pem"))?;
    write_ed25519(&dir.join("rewards.pem"))?;
    for channel in CHANNELS {
        write_ed25519(&dir.join(format!("{channel}.pem")))?;
    }
    let rpc_port = procs::free_port()?;
    let rpc = format!("http://127.0.0.1:{rpc_port}");
    let plugins = env.repo.join("plugins/target/wasm32-wasip2/release");
    let laneway = prepare(env, dir, &config_text(db_url, &rpc, &plugins, dir))?;
    let accounts = KINDS
        .iter()
        .map(|(_, _, signer)| account(&laneway, signer))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut funded = accounts.clone();
    for channel in CHANNELS {
        funded.push(account(&laneway, channel)?);
    }
    let auth: Vec<(&str, String)> = KINDS
        .iter()
        .zip(&accounts)
        .map(|((_, function, _), signer)| (*function, signer.clone()))
        .collect();
    let mut fake = FakeRpc::start(fake_rpc, rpc_port, plan.close_ms, (&funded, &auth), dir)?;
    let secret = laneway.api_key("faults", "ops:write")?;
    let http = reqwest::Client::builder().no_proxy().build()?;

    // The producer: payments with amounts unique in the run, posted with an
    // idempotency key until a host acknowledges them.
    let ports: Arc<Mutex<Vec<u16>>> = Arc::new(Mutex::new(Vec::new()));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let acked: Arc<Mutex<Vec<StellarAcked>>> = Arc::new(Mutex::new(Vec::new()));
    let producer = {
        let (http, ports, gate, acked, accounts) = (
            http.clone(),
            ports.clone(),
            gate.clone(),
            acked.clone(),
            accounts.clone(),
        );
        let ops = plan.ops;
        tokio::spawn(async move {
            for n in 0..ops {
                gate.acquire().await?.forget();
                let (kind, _, _) = KINDS[n % KINDS.len()];
                let amount = (1_000_000 + n).to_string();
                let body = json!({
                    "kind": kind,
                    "outbox": "treasury",
                    "payload": {"user": accounts[(n + 1) % accounts.len()], "amount": amount},
                    "idempotency_key": format!("payment-{n}"),
                });
                let url = |port| format!("http://127.0.0.1:{port}/api/v1/ops");
                let (_, answer) = post_until_accepted(&ports, "the op", false, |port| {
                    procs::post_json(&http, url(port), &secret, &body)
                })
                .await?;
                let op = answer["id"].as_i64().with_context(|| format!("no id in {answer}"))?;
                acked
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(StellarAcked { op, amount });
            }
            anyhow::Ok(())
        })
    };
    let set_ports = |list: &[u16]| *ports.lock().unwrap_or_else(PoisonError::into_inner) = list.to_vec();
    let chunk = plan.ops.div_ceil(plan.faults.len() + 1);

    let mut outcome = StellarOutcome::default();
    for fault in &plan.faults {
        let port = procs::free_port()?;
        let failpoint = match fault {
            StellarFault::Failpoint(point) => Some(point.as_str()),
            _ => None,
        };
        let mut host = laneway.start(port, failpoint)?;
        if let Some(line) = procs::ready_unless_aborted(&http, &mut host, port, failpoint).await? {
            gate.add_permits(chunk);
            outcome.faults.push(line);
            continue;
        }
        set_ports(&[port]);
        gate.add_permits(chunk);
        let line = match fault {
            StellarFault::Failpoint(point) => failpoint_reached(&mut host, point).await,
            StellarFault::Kill => {
                let wait = rand::thread_rng().gen_range(200..=1500);
                tokio::time::sleep(Duration::from_millis(wait)).await;
                host.kill9();
                format!("kill -9 {wait} ms after ready")
            }
            StellarFault::Rpc(what) => {
                fake.inject(what)?;
                let wait = rand::thread_rng().gen_range(300..=1200);
                tokio::time::sleep(Duration::from_millis(wait)).await;
                host.kill9();
                format!("the RPC's next send: {what}; kill -9 {wait} ms later")
            }
            StellarFault::Stall => stall(&laneway, &http, &mut host, set_ports).await?,
        };
        outcome.faults.push(line);
    }

    let port = procs::free_port()?;
    let mut host = laneway.start(port, None)?;
    procs::ready(&http, &mut host, port).await?;
    set_ports(&[port]);
    gate.add_permits(plan.ops);
    let deadline = Instant::now() + plan.drain_deadline;
    loop {
        if producer.is_finished() && open_count(db_url).await? == 0 {
            break;
        }
        if Instant::now() > deadline {
            outcome.faults.push(format!(
                "the clean host did not finish within {:?}",
                plan.drain_deadline
            ));
            break;
        }
        if let Some(status) = host.exited() {
            bail!("the clean host exited: {status} (see {})", laneway.log.display());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    host.signal("TERM")?;
    // The fake writes its state within a second of a change.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    drop(host);
    if producer.is_finished() {
        producer.await??;
    } else {
        producer.abort();
    }
    let (landed, concurrent_sends, bad_seqs, auth_failures) = fake.read()?;
    drop(fake.proc);
    let acked = acked.lock().unwrap_or_else(PoisonError::into_inner).clone();
    outcome.history = StellarHistory {
        acked,
        landed,
        rows: rows(db_url).await?,
        concurrent_sends,
        bad_seqs,
        auth_failures,
        channels: funded[accounts.len()..].iter().cloned().collect(),
    };
    outcome.elapsed = started.elapsed();
    let passed = crate::check::check_stellar(&outcome.history).passed();
    outcome.faults.extend(workspace.finish(passed).await?);
    Ok(outcome)
}

/// Every op's status and receipt.
async fn rows(db_url: &str) -> anyhow::Result<HashMap<i64, (Status, Option<String>)>> {
    const SQL: &str = "SELECT id, status, receipt FROM ops";
    let rows: Vec<(i64, String, Option<String>)> = if db_url.starts_with("sqlite") {
        let pool = sqlx::SqlitePool::connect(db_url).await?;
        let rows = sqlx::query(&crate::run::on_sqlite(SQL)).fetch_all(&pool).await?;
        pool.close().await;
        rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect()
    } else {
        let pool = sqlx::PgPool::connect(db_url).await?;
        let rows = sqlx::query(SQL).fetch_all(&pool).await?;
        pool.close().await;
        rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect()
    };
    rows.into_iter()
        .map(|(id, status, receipt)| {
            let status = Status::parse(&status).with_context(|| format!("op {id} has status {status:?}"))?;
            Ok((id, (status, receipt)))
        })
        .collect()
}
