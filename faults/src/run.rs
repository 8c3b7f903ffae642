//! One faulted run: a fresh database, the Node inboxes, a producer posting
//! fan-outs through the API the whole time, and the `laneway` binary
//! started again and again, each time ended by the next fault of the plan.
//! Then one clean host drains what is left, and the history goes to the
//! checker.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _};
use rand::Rng as _;
use serde_json::{json, Value};
use sqlx::Row as _;

use crate::check::{Acked, Arrival, History, Pruned, Status};
use crate::procs::{self, Laneway, Proc};

/// Which queue the hosts share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    /// A server URL; the run makes (and drops) a database of its own there.
    Postgres(String),
}

impl Backend {
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres(_) => "postgres",
        }
    }
}

/// One fault: how a host's life ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// `LANEWAY_FAILPOINT=name@N`: the host aborts at that point's Nth hit.
    Failpoint(String),
    /// kill -9 at a random moment this long (ms range) after it is ready.
    Kill { after_ms: (u64, u64) },
    /// SIGSTOP past the lease while a second host takes over, then SIGCONT:
    /// the stale host must change nothing; then it is killed.
    Stall,
    /// PostgreSQL only: every connection of the host terminated by the
    /// server mid-run; the host must reconnect and lose nothing.
    TerminateConnections,
    /// The config file rewritten in place (truncated, then written) while
    /// ops flow: no kind may be unloaded, nothing dead-lettered.
    RewriteConfig,
    /// Three hosts share the queue; one is killed -9: its outboxes move to
    /// the others within the slot TTL, and no op is claimed twice.
    ThreeHosts,
    /// PostgreSQL only: the server itself restarted mid-run (`pg_ctlcluster
    /// restart`); the host must ride it out and lose nothing.
    RestartPostgres,
    /// The network between laneway and one destination: latency, resets,
    /// a blackhole, a dribbled answer, answers lost after the inbox
    /// accepted, a second or so each, while ops flow.
    Network,
    /// The kind's `.wasm` rewritten in place (its first half, a pause, then
    /// all of it), as a copy or a build does: the half-written module must
    /// be refused and the running one kept.
    ReplacePlugin,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Failpoint(point) => write!(f, "failpoint {point}"),
            Fault::Kill { .. } => write!(f, "kill -9"),
            Fault::Stall => write!(f, "SIGSTOP past the lease"),
            Fault::TerminateConnections => write!(f, "pg_terminate_backend"),
            Fault::RewriteConfig => write!(f, "config rewritten in place"),
            Fault::ReplacePlugin => write!(f, ".wasm rewritten in place"),
            Fault::ThreeHosts => write!(f, "three hosts, one killed"),
            Fault::Network => write!(f, "network faults"),
            Fault::RestartPostgres => write!(f, "PostgreSQL restarted"),
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Plan {
    pub backend: Backend,
    /// Activities fanned out; each goes to every inbox.
    pub activities: usize,
    pub inboxes: usize,
    /// Sending actors (outboxes), each with its own drain.
    pub outboxes: usize,
    /// Senders of signed inbound activities, and how many each sends.
    pub senders: usize,
    pub inbound_each: usize,
    pub faults: Vec<Fault>,
    /// The longest the clean host may take to finish after the faults.
    pub drain_deadline: Duration,
}

impl Plan {
    /// Outbound deliveries and inbound activities.
    pub fn ops(&self) -> usize {
        self.activities * self.inboxes + self.senders * self.inbound_each
    }
}

/// Where the run finds what it drives.
#[derive(Debug, Clone)]
pub struct Env {
    pub repo: PathBuf,
    pub laneway: PathBuf,
    /// Kept after the run when set (the database, the logs, the config).
    pub keep: Option<PathBuf>,
}

/// What happened, for the table.
#[derive(Debug, Default)]
pub struct Outcome {
    pub history: History,
    /// One line per fault: what it was and what it did.
    pub faults: Vec<String>,
    pub lease_expired: i64,
    pub elapsed: Duration,
}

/// The lease and slot TTL the run's hosts use: short, so that a crash
/// costs a second or two, not the production default's 30 s and 15 s.
pub(crate) const LEASE_MS: u64 = 2000;
pub(crate) const SLOT_TTL_MS: u64 = 1000;
/// Per-destination in-flight cap; each inbox process is one destination.
pub(crate) const PER_DESTINATION: u32 = 8;
pub(crate) const INBOX_PROCESSES: usize = 2;

pub(crate) const KEY_ID: &str = "https://faults.laneway.example/actor#main-key";

/// What the faulted run adds to the config the hostile and disk runs
/// share: outcome webhooks, a short retention with an archive (so the
/// pruner works, and can be crashed, mid-run), and signed inbound traffic
/// handed to an application by the webhook plugin.
pub(crate) struct Faulted {
    /// Where outcome webhooks go.
    pub hooks: String,
    /// Where the inbound kind hands activities on.
    pub app: String,
    /// The kinds' archive directory.
    pub archive: PathBuf,
}

/// How long a finished op is kept in the faulted run: the lease, the least
/// `check-config` allows.
pub(crate) const RETENTION_MS: u64 = LEASE_MS;

/// Where an inbound activity is handed on, as the checker names its lane's
/// inbox (the path on the first Node process).
pub(crate) const APP_PATH: &str = "/hooks/inbound";

/// Every kind's retries in the run: quick, and never dead-lettered by the
/// budget (an op that exhausted it would read as lost).
const RETRIES: &str = "backoff_base_ms = 50\nbackoff_max_ms = 500\ntimeout_ms = 1500\nmax_attempts = 1000";

/// The run's config; `faulted`, what the faulted run adds.
pub(crate) fn config_text(
    db_url: &str,
    plugins: &Path,
    pem: &Path,
    hook_key: &Path,
    faulted: Option<&Faulted>,
) -> String {
    format!(
        r#"# Written by laneway-faults.
[database]
url = "{db_url}"
[outcomes]
allowed_hosts = ["http://127.0.0.1:*"]
allowed_internal = ["127.0.0.1"]
relay_every_ms = 100
[queue]
lease_ms = {LEASE_MS}
[dispatch]
poll_ms = 100
slot_ttl_ms = {SLOT_TTL_MS}
shutdown_grace_ms = 2000
[destinations]
max_in_flight = {PER_DESTINATION}
[runtime]
reload_debounce_ms = 50
[keys.actor]
algorithm = "rsa-sha256"
file = "{pem}"
[keys.hook]
algorithm = "hmac-sha256"
file = "{hook_key}"
[plugins.activitypub]
path = "{plugins}/activitypub.wasm"
allowed_hosts = ["http://127.0.0.1:*"]
allowed_internal = ["127.0.0.1"]
keys = ["actor"]
[kinds.activitypub]
plugin = "activitypub"
{RETRIES}
config = {{ key = "actor", key_id = "{KEY_ID}", signature = "cavage" }}
{webhook}
[kinds.outcome_webhook]
{RETRIES}
{inbound}"#,
        pem = pem.display(),
        hook_key = hook_key.display(),
        plugins = plugins.display(),
        webhook = faulted.map_or(String::new(), |f| format!(
            "outcome_webhook = \"{}\"\noutcome_webhook_key = \"hook\"\narchive = \"{}\"",
            f.hooks,
            f.archive.display()
        )),
        inbound = faulted.map_or(String::new(), |f| format!(
            r#"[kinds.activitypub_inbound]
plugin = "webhook"
lanes = "required"
lane_mode = "strict"
{RETRIES}
config = {{ url = "{app}", key = "hook" }}
outcome_webhook = "{hooks}"
outcome_webhook_key = "hook"
archive = "{archive}"
[plugins.webhook]
path = "{plugins}/webhook.wasm"
allowed_hosts = ["http://127.0.0.1:*"]
allowed_internal = ["127.0.0.1"]
keys = ["hook"]
[inbound]
enabled = true
kind = "activitypub_inbound"
allowed_hosts = ["http://127.0.0.1:*"]
allowed_internal = ["127.0.0.1"]
[retention]
confirmed_ms = {RETENTION_MS}
cancelled_ms = {RETENTION_MS}
failed_ms = {RETENTION_MS}
every_ms = 500
batch = 100
"#,
            app = f.app,
            hooks = f.hooks,
            archive = f.archive.display(),
            plugins = plugins.display(),
        )),
    )
}

/// The files every run writes before its first host.
pub(crate) struct Keys {
    /// The actor's RSA key (PKCS#8 PEM), `[keys.actor]`.
    pub pem: PathBuf,
    /// The outcome webhooks' `whsec_` secret, `[keys.hook]`.
    pub hook_key: PathBuf,
    /// What the Node inbox verifies with: the actor's public key and the
    /// webhook secret; the same public key is what its actor documents
    /// serve for the senders of inbound traffic.
    pub inbox_keys: PathBuf,
    /// The key itself: the harness signs inbound activities with it.
    pub rsa: rsa::RsaPrivateKey,
}

/// Writes a fresh actor key and webhook secret into `dir`.
pub(crate) fn write_keys(dir: &Path) -> anyhow::Result<Keys> {
    use rsa::pkcs8::{EncodePrivateKey as _, EncodePublicKey as _};
    let key = rsa::RsaPrivateKey::new(&mut rand::thread_rng(), 2048)?;
    let pem = dir.join("actor.pem");
    std::fs::write(&pem, key.to_pkcs8_pem(rsa::pkcs8::LineEnding::LF)?.as_bytes())?;
    let public = key.to_public_key().to_public_key_pem(rsa::pkcs8::LineEnding::LF)?;
    let secret = format!(
        "whsec_{}",
        base64::Engine::encode(
            &base64::engine::general_purpose::STANDARD,
            rand::thread_rng().gen::<[u8; 32]>()
        )
    );
    let hook_key = dir.join("hook.key");
    std::fs::write(&hook_key, &secret)?;
    let inbox_keys = dir.join("keys.json");
    std::fs::write(
        &inbox_keys,
        json!({ KEY_ID: {"pem": public, "alg": "rsa-sha256"}, "webhook_secret": secret, "actor_pem": public })
            .to_string(),
    )?;
    Ok(Keys {
        pem,
        hook_key,
        inbox_keys,
        rsa: key,
    })
}

/// Writes `text` as the run's config in `dir` and migrates its database.
pub(crate) fn prepare(env: &Env, dir: &Path, text: &str) -> anyhow::Result<Laneway> {
    let config = dir.join("laneway.toml");
    std::fs::write(&config, text)?;
    let laneway = Laneway {
        bin: env.laneway.clone(),
        config,
        log: dir.join("hosts.log"),
    };
    laneway.cli(&["check-config"])?;
    laneway.cli(&["migrate"])?;
    Ok(laneway)
}

/// Starts a host on a free port and pauses `kind` through its API with the
/// `admin` key, so that ops enqueued next wait: the host, its port and its
/// base URL.
pub(crate) async fn start_paused(
    laneway: &Laneway,
    http: &reqwest::Client,
    admin: &str,
    kind: &str,
) -> anyhow::Result<(Proc, u16, String)> {
    let port = procs::free_port()?;
    let mut host = laneway.start(port, None)?;
    procs::ready(http, &mut host, port).await?;
    let base = format!("http://127.0.0.1:{port}");
    let body = json!({"scope": "kind", "target": kind});
    let paused = procs::post_json(http, format!("{base}/api/admin/pauses"), admin, &body)
        .send()
        .await?;
    ensure!(paused.status().is_success(), "pause: {}", paused.status());
    Ok((host, port, base))
}

/// Where one run keeps its files and its database: a temporary directory
/// (or `env.keep`'s), and a fresh SQLite file or PostgreSQL database.
pub(crate) struct Workspace {
    temp: tempfile::TempDir,
    pub dir: PathBuf,
    pub db_url: String,
    /// The run's own PostgreSQL database, when the backend is PostgreSQL.
    pub pg_name: Option<String>,
    backend: Backend,
    kept: bool,
}

impl Workspace {
    pub async fn new(env: &Env, backend: &Backend) -> anyhow::Result<Self> {
        let temp = tempfile::tempdir()?;
        let dir = env.keep.clone().unwrap_or_else(|| temp.path().to_owned());
        std::fs::create_dir_all(&dir)?;
        let (db_url, pg_name) = match backend {
            Backend::Sqlite => (format!("sqlite://{}", dir.join("queue.db").display()), None),
            Backend::Postgres(server) => {
                let (name, url) = pg_database(server).await?;
                (url, Some(name))
            }
        };
        Ok(Self {
            temp,
            dir,
            db_url,
            pg_name,
            backend: backend.clone(),
            kept: env.keep.is_some(),
        })
    }

    /// Drops the PostgreSQL database of a run that passed; keeps the
    /// database and directory of one that failed (or of every run, with
    /// `--keep`): what was kept, for the operator.
    pub async fn finish(self, passed: bool) -> anyhow::Result<Vec<String>> {
        let mut notes = Vec::new();
        if let (Backend::Postgres(server), Some(name)) = (&self.backend, &self.pg_name) {
            if passed && !self.kept {
                drop_pg_database(server, name).await?;
            } else {
                notes.push(format!("database {name} kept"));
            }
        }
        if !passed && !self.kept {
            notes.push(format!("run directory kept: {}", self.temp.keep().display()));
        }
        Ok(notes)
    }
}

/// Waits for a host armed with `point` to abort there (20 s at most, then
/// it is killed): the fault's line.
pub(crate) async fn failpoint_reached(host: &mut Proc, point: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = host.exited() {
            return format!("failpoint {point}: aborted ({status})");
        }
        if Instant::now() > deadline {
            host.kill9();
            return format!("failpoint {point}: not reached in 20 s; killed -9");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// SIGSTOP past the lease while a second host takes over, SIGCONT, 1.5 s
/// of both, then both killed -9: the fault's line. `set_ports` points the
/// producers at the second host.
pub(crate) async fn stall(
    laneway: &Laneway,
    http: &reqwest::Client,
    host: &mut Proc,
    set_ports: impl Fn(&[u16]),
) -> anyhow::Result<String> {
    let wait = rand::thread_rng().gen_range(200..=800);
    tokio::time::sleep(Duration::from_millis(wait)).await;
    host.signal("STOP")?;
    // A second host takes the stalled one's outboxes once their slots
    // lapse, and its ops once their leases do.
    let second_port = procs::free_port()?;
    let mut second = laneway.start(second_port, None)?;
    // SQLite: the stalled host may hold the write lock, and the second
    // waits on it; the stall ends regardless.
    tokio::time::sleep(Duration::from_millis(LEASE_MS + SLOT_TTL_MS + 1500)).await;
    host.signal("CONT")?;
    // SQLite: a process frozen inside a write transaction holds the file's
    // one write lock, and a process started meanwhile may give up at its
    // first write after busy_timeout_ms ("database is locked"). A
    // supervisor starts it again; so does the harness.
    let mut restarts = 0;
    while let Err(e) = procs::ready(http, &mut second, second_port).await {
        restarts += 1;
        ensure!(restarts <= 3, "the second host never started: {e}");
        second = laneway.start(second_port, None)?;
    }
    set_ports(&[second_port]);
    // The stale host wakes holding expired leases and slots: every write
    // it tries must be refused by its token.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    host.kill9();
    // Then the second host dies too, so the next fault starts from one
    // host again.
    second.kill9();
    Ok(format!(
        "SIGSTOP {wait} ms after ready; a second host took over{}; SIGCONT after {} ms",
        if restarts > 0 {
            format!(" (started {} times: the frozen one held the write lock)", restarts + 1)
        } else {
            String::new()
        },
        LEASE_MS + SLOT_TTL_MS + 1500
    ))
}

/// Posts to whichever host is up (`request` builds the request for a
/// port) until one accepts (2xx): its status and JSON answer. A refused
/// connection or a 5xx (and, with `retry_429`, a 429) is tried again; any
/// other answer is the harness's bug or laneway's, never retried. `what`
/// names it in errors.
pub(crate) async fn post_until_accepted(
    ports: &Mutex<Vec<u16>>,
    what: &str,
    retry_429: bool,
    request: impl Fn(u16) -> reqwest::RequestBuilder,
) -> anyhow::Result<(reqwest::StatusCode, Value)> {
    let started = Instant::now();
    loop {
        let candidates = ports.lock().unwrap_or_else(PoisonError::into_inner).clone();
        for port in candidates {
            let Ok(answer) = request(port).timeout(Duration::from_secs(5)).send().await else {
                continue;
            };
            let status = answer.status();
            let text = answer.text().await.unwrap_or_default();
            if status.is_success() {
                let value = serde_json::from_str(&text).with_context(|| text.clone())?;
                return Ok((status, value));
            }
            ensure!(
                status.is_server_error() || (retry_429 && status == reqwest::StatusCode::TOO_MANY_REQUESTS),
                "{what} was refused with {status}: {text}"
            );
        }
        ensure!(
            started.elapsed() < Duration::from_secs(120),
            "no host accepted {what} for 2 minutes"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A fresh PostgreSQL database for one run, dropped when the run passed.
pub(crate) async fn pg_database(server: &str) -> anyhow::Result<(String, String)> {
    use sqlx::Connection as _;
    let name = format!(
        "laneway_faults_{}_{}",
        std::process::id(),
        rand::thread_rng().gen_range(0..1_000_000u32)
    );
    let mut admin = sqlx::PgConnection::connect(server)
        .await
        .with_context(|| format!("connecting to {server}"))?;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await?;
    let base = server.rsplit_once('/').map_or(server, |(base, _)| base);
    // laneway keeps its tables in its own schema (`laneway` unless told
    // otherwise); the harness's own reads of them name it the same way.
    Ok((
        name.clone(),
        format!("{base}/{name}?options=-c%20search_path%3Dlaneway"),
    ))
}

pub(crate) async fn drop_pg_database(server: &str, name: &str) -> anyhow::Result<()> {
    use sqlx::Connection as _;
    let mut admin = sqlx::PgConnection::connect(server).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(&mut admin)
        .await?;
    Ok(())
}

/// The producer: posts every activity's fan-out until it is acknowledged,
/// through whichever host is up (a refused connection or a 5xx is retried
/// with the same activity, which the fan-out de-duplicates per inbox).
struct Producer {
    acked: Arc<Mutex<Vec<Acked>>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

fn spawn_producer(
    http: reqwest::Client,
    ports: Arc<Mutex<Vec<u16>>>,
    key: String,
    plan: &Plan,
    inboxes: Vec<String>,
    gate: Arc<tokio::sync::Semaphore>,
) -> Producer {
    let acked = Arc::new(Mutex::new(Vec::new()));
    let (activities, outboxes) = (plan.activities, plan.outboxes);
    let task = {
        let acked = acked.clone();
        tokio::spawn(async move {
            for n in 0..activities {
                // The run hands out the activities a chunk per host life,
                // so that every fault meets work in flight.
                gate.acquire().await?.forget();
                let outbox = format!("https://faults.laneway.example/actors/{}", n % outboxes);
                let activity = format!("{outbox}/activities/{n}");
                let body = json!({
                    "outbox": outbox,
                    "activity": {"id": activity, "type": "Create", "actor": outbox,
                                 "object": {"id": format!("{activity}/note"), "type": "Note"}},
                    "recipients": inboxes,
                });
                let url = |port| format!("http://127.0.0.1:{port}/api/v1/activitypub/deliveries");
                let (_, answer) = post_until_accepted(&ports, "the fan-out", false, |port| {
                    procs::post_json(&http, url(port), &key, &body)
                })
                .await?;
                let deliveries = answer["deliveries"].as_array().context("deliveries")?;
                ensure!(deliveries.len() == inboxes.len(), "one delivery per inbox: {answer}");
                let mut acked = acked.lock().unwrap_or_else(PoisonError::into_inner);
                for (inbox, delivery) in inboxes.iter().zip(deliveries) {
                    acked.push(Acked {
                        op: delivery["id"].as_i64().context("delivery id")?,
                        outbox: outbox.clone(),
                        inbox: inbox.clone(),
                        activity: activity.clone(),
                    });
                }
            }
            Ok(())
        })
    };
    Producer { acked, task }
}

/// The senders of inbound traffic: each posts its activities one after
/// another to `/inbox` of whichever host is up, signed (draft-cavage, as
/// Mastodon signs) with the key its actor document on the first Node
/// process serves; an activity is retried until a host answers 202, and
/// the same activity id is what laneway de-duplicates by.
/// Who sends inbound traffic, and how much.
struct Senders {
    /// The key every sender signs with (each actor document lists it).
    key: rsa::RsaPrivateKey,
    /// Where the actor documents are served.
    origin: String,
    count: usize,
    each: usize,
}

fn spawn_senders(
    http: reqwest::Client,
    ports: Arc<Mutex<Vec<u16>>>,
    senders: Senders,
    gate: Arc<tokio::sync::Semaphore>,
    acked: Arc<Mutex<Vec<Acked>>>,
) -> Vec<tokio::task::JoinHandle<anyhow::Result<()>>> {
    let Senders {
        key,
        origin,
        count,
        each,
    } = senders;
    let signer = rsa::pkcs1v15::SigningKey::<sha2::Sha256>::new(key);
    (0..count)
        .map(|s| {
            let (http, ports, signer, gate, acked) =
                (http.clone(), ports.clone(), signer.clone(), gate.clone(), acked.clone());
            let actor = format!("{origin}/actors/s{s}");
            tokio::spawn(async move {
                for n in 0..each {
                    gate.acquire().await?.forget();
                    let activity = format!("{actor}/activities/{n}");
                    let body = json!({
                        "@context": "https://www.w3.org/ns/activitystreams",
                        "id": activity, "type": "Create", "actor": actor,
                        "object": {"id": format!("{activity}/note"), "type": "Note", "content": n},
                    })
                    .to_string();
                    let op = post_signed_until_accepted(&http, &ports, &signer, &actor, &body).await?;
                    acked.lock().unwrap_or_else(PoisonError::into_inner).push(Acked {
                        op,
                        outbox: actor.clone(),
                        inbox: APP_PATH.to_owned(),
                        activity: activity.clone(),
                    });
                }
                Ok(())
            })
        })
        .collect()
}

/// A draft-cavage signature over `(request-target) host date digest`.
fn sign_cavage(
    signer: &rsa::pkcs1v15::SigningKey<sha2::Sha256>,
    key_id: &str,
    host: &str,
    date: &str,
    digest: &str,
) -> String {
    use base64::Engine as _;
    use rsa::signature::{SignatureEncoding as _, Signer as _};
    let signed = format!("(request-target): post /inbox\nhost: {host}\ndate: {date}\ndigest: {digest}");
    let signature = base64::engine::general_purpose::STANDARD.encode(signer.sign(signed.as_bytes()).to_bytes());
    format!(
        r#"keyId="{key_id}",algorithm="rsa-sha256",headers="(request-target) host date digest",signature="{signature}""#
    )
}

async fn post_signed_until_accepted(
    http: &reqwest::Client,
    ports: &Mutex<Vec<u16>>,
    signer: &rsa::pkcs1v15::SigningKey<sha2::Sha256>,
    actor: &str,
    body: &str,
) -> anyhow::Result<i64> {
    use base64::Engine as _;
    use sha2::Digest as _;
    let digest = format!(
        "SHA-256={}",
        base64::engine::general_purpose::STANDARD.encode(sha2::Sha256::digest(body.as_bytes()))
    );
    let key_id = format!("{actor}#main-key");
    // A key fetch refused for the moment (429) or a host going down (5xx)
    // is tried again; a refused signature is a bug.
    let (status, answer) = post_until_accepted(ports, "the inbound activity", true, |port| {
        let host = format!("127.0.0.1:{port}");
        let date = httpdate::fmt_http_date(std::time::SystemTime::now());
        http.post(format!("http://{host}/inbox"))
            .header("signature", sign_cavage(signer, &key_id, &host, &date, &digest))
            .header("host", host)
            .header("date", date)
            .header("digest", &digest)
            .header("content-type", "application/activity+json")
            .body(body.to_owned())
    })
    .await?;
    ensure!(
        status == reqwest::StatusCode::ACCEPTED,
        "the inbox answered {status}: {answer}"
    );
    answer["id"].as_i64().with_context(|| format!("no op id in {answer}"))
}

/// Every archive line the pruner wrote under `dir`.
pub(crate) fn pruned(dir: &Path) -> anyhow::Result<Vec<Pruned>> {
    let ms = |v: &Value| -> Option<i64> {
        chrono::DateTime::parse_from_rfc3339(v.as_str()?)
            .ok()
            .map(|t| t.timestamp_millis())
    };
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(out);
    };
    for entry in entries {
        let path = entry?.path();
        let text = std::fs::read_to_string(&path)?;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let record: Value = serde_json::from_str(line).with_context(|| format!("{}: {line}", path.display()))?;
            let op = &record["op"];
            let status = op["status"].as_str().unwrap_or_default();
            out.push(Pruned {
                op: op["id"].as_i64().with_context(|| format!("no op id: {line}"))?,
                status: Status::parse(status).with_context(|| format!("status {status:?}: {line}"))?,
                finished_ms: ms(&op["finished_at"]),
                archived_ms: ms(&record["archived_at"]).with_context(|| format!("archived_at: {line}"))?,
            });
        }
    }
    Ok(out)
}

/// Reads the inbox logs: every request each fake answered, in order, and
/// the `webhook-id`s of the outcome webhooks they accepted.
pub(crate) fn arrivals(logs: &[(u16, PathBuf)], inboxes: &[String]) -> anyhow::Result<(Vec<Arrival>, Vec<String>)> {
    // An inbox's log knows the path, not which port (direct or through the
    // proxy) laneway used: each user's path is unique.
    let by_path: HashMap<&str, &str> = inboxes
        .iter()
        .filter_map(|url| Some((url.get(url.find("/users/")?..)?, url.as_str())))
        .collect();
    let mut all = Vec::new();
    let mut hooks = Vec::new();
    for (port, path) in logs {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let entry: Value = serde_json::from_str(line).with_context(|| format!("{}: {line}", path.display()))?;
            let request = entry["path"].as_str().unwrap_or_default();
            let arrival = Arrival {
                inbox: by_path
                    .get(request)
                    .map_or_else(|| format!("http://127.0.0.1:{port}{request}"), |url| (*url).to_owned()),
                activity: entry["id"].as_str().map(str::to_owned),
                status: entry["status"]
                    .as_u64()
                    .and_then(|s| u16::try_from(s).ok())
                    .unwrap_or(0),
            };
            if request == APP_PATH {
                // An inbound activity handed on: the checker's lane is the
                // app, its activity the one inside the webhook's body.
                all.push(Arrival {
                    inbox: APP_PATH.to_owned(),
                    activity: entry["inner"].as_str().map(str::to_owned),
                    ..arrival
                });
                continue;
            }
            match (request.starts_with("/hooks/"), arrival.status, &arrival.activity) {
                (true, 200..=299, Some(id)) => hooks.push(id.clone()),
                // A refused webhook is a refused request like any other.
                (true, _, _) => all.push(Arrival {
                    activity: None,
                    ..arrival
                }),
                (false, _, _) => all.push(arrival),
            }
        }
    }
    Ok((all, hooks))
}

/// The database side: every op row's status, the lease expiries, and how
/// many ops are still open. (sqlx's `Any` driver is not built: the same
/// three statements on each backend's pool.)
pub(crate) async fn rows(db_url: &str) -> anyhow::Result<(HashMap<i64, Status>, i64, i64)> {
    macro_rules! read {
        ($pool:expr, $tables:expr) => {{
            let pool = $pool;
            let (ops, attempts) = $tables;
            let rows = sqlx::query(&format!("SELECT id, status FROM {ops}"))
                .fetch_all(&pool)
                .await?;
            let expired: i64 = sqlx::query_scalar(&format!(
                "SELECT count(*) FROM {attempts} WHERE outcome = 'lease_expired'"
            ))
            .fetch_one(&pool)
            .await?;
            pool.close().await;
            let statuses = statuses(rows.iter().map(|r| (r.get(0), r.get(1))))?;
            // Counted from the rows read, not by a query of its own: ops
            // that finish between two reads would otherwise end a wait on
            // rows that still show them open (the disk-full run's checker
            // found "stuck" ops that had confirmed).
            let open = statuses
                .values()
                .filter(|s| matches!(s, Status::Pending | Status::Submitted))
                .count();
            (statuses, expired, i64::try_from(open).unwrap_or(i64::MAX))
        }};
    }
    Ok(if db_url.starts_with("sqlite") {
        read!(
            sqlx::SqlitePool::connect(db_url).await?,
            ("laneway_ops", "laneway_attempts")
        )
    } else {
        read!(sqlx::PgPool::connect(db_url).await?, ("ops", "attempts"))
    })
}

/// How many ops are still open (any kind).
pub(crate) async fn open_count(db_url: &str) -> anyhow::Result<i64> {
    count(
        db_url,
        "SELECT count(*) FROM ops WHERE status IN ('pending', 'submitted')",
    )
    .await
}

/// A statement written with laneway's PostgreSQL table names (in its own
/// schema) for SQLite, where they share the application's file and carry
/// the `laneway_` prefix.
pub(crate) fn on_sqlite(sql: &str) -> String {
    const TABLES: [&str; 8] = [
        "ops",
        "attempts",
        "audit_log",
        "api_keys",
        "pauses",
        "halted_subjects",
        "lane_halts",
        "records",
    ];
    let mut out = sql.to_owned();
    for table in TABLES {
        out = out.replace(&format!("FROM {table})"), &format!("FROM laneway_{table})"));
        out = out.replace(&format!("FROM {table} "), &format!("FROM laneway_{table} "));
        if out.ends_with(&format!("FROM {table}")) {
            out = format!("{}laneway_{table}", out.trim_end_matches(table));
        }
    }
    out
}

/// One `SELECT count(*)` on either backend, on a connection of its own.
pub(crate) async fn count(db_url: &str, sql: &str) -> anyhow::Result<i64> {
    use sqlx::Connection as _;
    Ok(if db_url.starts_with("sqlite") {
        let mut db = sqlx::SqliteConnection::connect(db_url).await?;
        sqlx::query_scalar(&on_sqlite(sql)).fetch_one(&mut db).await?
    } else {
        let mut db = sqlx::PgConnection::connect(db_url).await?;
        sqlx::query_scalar(sql).fetch_one(&mut db).await?
    })
}

fn statuses(rows: impl Iterator<Item = (i64, String)>) -> anyhow::Result<HashMap<i64, Status>> {
    rows.map(|(id, status)| {
        Status::parse(&status)
            .map(|s| (id, s))
            .with_context(|| format!("op {id} has status {status:?}"))
    })
    .collect()
}

/// Runs one plan to the end and returns its history.
pub async fn run(plan: &Plan, env: &Env) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let workspace = Workspace::new(env, &plan.backend).await?;
    let (dir, db_url, pg_name) = (&workspace.dir, workspace.db_url.clone(), workspace.pg_name.clone());
    let keys = write_keys(dir)?;

    // The inboxes, as processes of their own.
    let mut fakes: Vec<Proc> = Vec::new();
    let mut logs = Vec::new();
    for n in 0..INBOX_PROCESSES {
        let out = dir.join(format!("inbox-{n}.jsonl"));
        let (proc, port) = procs::node_inbox(&env.repo, &keys.inbox_keys, &out)?;
        fakes.push(proc);
        logs.push((port, out));
    }
    // A third destination: the second inbox behind the fault proxy.
    let proxy = crate::proxy::Proxy::start(logs[1].0).await?;
    let destinations = [logs[0].0, logs[1].0, proxy.port];
    let inboxes: Vec<String> = (0..plan.inboxes)
        .map(|n| {
            format!(
                "http://127.0.0.1:{}/users/u{n}/inbox",
                destinations[n % destinations.len()]
            )
        })
        .collect();

    let faulted = Faulted {
        hooks: format!("http://127.0.0.1:{}/hooks/outcomes", logs[0].0),
        app: format!("http://127.0.0.1:{}{APP_PATH}", logs[0].0),
        archive: dir.join("archive"),
    };
    // The run's own copy of the plugins, of which ReplacePlugin rewrites
    // activitypub's.
    let plugins = dir.join("plugins");
    std::fs::create_dir_all(&plugins)?;
    let built = env.repo.join("plugins/target/wasm32-wasip2/release");
    let wasm =
        std::fs::read(built.join("activitypub.wasm")).context("the activitypub plugin (./dev test builds it)")?;
    std::fs::write(plugins.join("activitypub.wasm"), &wasm)?;
    std::fs::copy(built.join("webhook.wasm"), plugins.join("webhook.wasm"))
        .context("the webhook plugin (./dev test builds it)")?;
    let text = config_text(&db_url, &plugins, &keys.pem, &keys.hook_key, Some(&faulted));
    let laneway = prepare(env, dir, &text)?;
    let config = laneway.config.clone();
    let secret = laneway.api_key("faults", "ops:write")?;

    let http = reqwest::Client::builder().no_proxy().build()?;
    let ports = Arc::new(Mutex::new(Vec::new()));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let producer = spawn_producer(http.clone(), ports.clone(), secret, plan, inboxes.clone(), gate.clone());
    let chunk = plan.activities.div_ceil(plan.faults.len() + 1);
    let inbound_gate = Arc::new(tokio::sync::Semaphore::new(0));
    let senders = spawn_senders(
        http.clone(),
        ports.clone(),
        Senders {
            key: keys.rsa.clone(),
            origin: format!("http://127.0.0.1:{}", logs[0].0),
            count: plan.senders,
            each: plan.inbound_each,
        },
        inbound_gate.clone(),
        producer.acked.clone(),
    );
    let inbound_chunk = plan.inbound_each.div_ceil(plan.faults.len() + 1) * plan.senders;
    let set_ports = |list: &[u16]| *ports.lock().unwrap_or_else(PoisonError::into_inner) = list.to_vec();

    let mut outcome = Outcome::default();
    let mut kills = 0u32;
    let mut stalls = 0u32;
    for fault in &plan.faults {
        let port = procs::free_port()?;
        let failpoint = match fault {
            Fault::Failpoint(point) => Some(point.as_str()),
            _ => None,
        };
        let mut host = laneway.start(port, failpoint)?;
        if let Some(line) = procs::ready_unless_aborted(&http, &mut host, port, failpoint).await? {
            kills += 1;
            gate.add_permits(chunk);
            inbound_gate.add_permits(inbound_chunk);
            outcome.faults.push(line);
            continue;
        }
        set_ports(&[port]);
        // The host first works off what earlier lives left (up to 30 s), so
        // the backlog stays near one chunk: the harness is about faults, and
        // a flood's backlog is a throughput question (BENCHMARKS.md).
        let settle_by = Instant::now() + Duration::from_secs(30);
        while open_count(&db_url).await? > (chunk * plan.inboxes / 2) as i64 && Instant::now() < settle_by {
            if host.exited().is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        gate.add_permits(chunk);
        inbound_gate.add_permits(inbound_chunk);
        let line = match fault {
            Fault::Failpoint(point) => {
                // It aborts by itself at the point; a point never reached
                // (no more work) is reported, and the host is killed.
                kills += 1;
                failpoint_reached(&mut host, point).await
            }
            Fault::Kill { after_ms } => {
                let wait = rand::thread_rng().gen_range(after_ms.0..=after_ms.1);
                tokio::time::sleep(Duration::from_millis(wait)).await;
                host.kill9();
                kills += 1;
                format!("kill -9 {wait} ms after ready")
            }
            Fault::Stall => {
                let line = stall(&laneway, &http, &mut host, set_ports).await?;
                stalls += 1;
                kills += 2;
                line
            }
            Fault::TerminateConnections => {
                tokio::time::sleep(Duration::from_millis(400)).await;
                let (Backend::Postgres(server), Some(name)) = (&plan.backend, &pg_name) else {
                    bail!("pg_terminate_backend needs the PostgreSQL backend");
                };
                let terminated = terminate(server, name).await?;
                tokio::time::sleep(Duration::from_millis(1500)).await;
                survived(&mut host, "when its connections were terminated")?;
                // A settle refused by a dead connection re-runs its op.
                kills += 2;
                format!("{terminated} connections terminated; the host reconnected; then kill -9")
            }
            Fault::RewriteConfig => {
                // As editors and `cat >` do: truncate, a pause, then write.
                let (refused, applied) =
                    rewrite_in_place(&config, b"", text.as_bytes(), 5, (150, 60), &laneway.log).await?;
                survived(&mut host, "while its config was rewritten")?;
                kills += 1;
                format!(
                    "config truncated and rewritten 5 times ({refused} reloads refused, {applied} applied); then kill -9"
                )
            }
            Fault::ThreeHosts => {
                let mut others = Vec::new();
                let mut listening = vec![port];
                for _ in 0..2 {
                    let other_port = procs::free_port()?;
                    let mut other = laneway.start(other_port, None)?;
                    procs::ready(&http, &mut other, other_port).await?;
                    listening.push(other_port);
                    others.push(other);
                }
                set_ports(&listening);
                tokio::time::sleep(Duration::from_millis(1000)).await;
                host.kill9();
                set_ports(&listening[1..]);
                // Its slots lapse and the others take its outboxes.
                tokio::time::sleep(Duration::from_millis(SLOT_TTL_MS + LEASE_MS + 1000)).await;
                for other in &mut others {
                    ensure!(other.exited().is_none(), "a surviving host exited");
                    other.kill9();
                }
                kills += 3;
                "three hosts for 1 s, one killed -9, the other two for 4 s; then kill -9".to_owned()
            }
            Fault::RestartPostgres => {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let version = std::fs::read_dir("/etc/postgresql")
                    .context("/etc/postgresql (pg_ctlcluster's clusters)")?
                    .filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .next()
                    .context("no cluster in /etc/postgresql")?;
                let status = std::process::Command::new("pg_ctlcluster")
                    .args([
                        "--skip-systemctl-redirect",
                        &version,
                        "main",
                        "restart",
                        "--",
                        "-m",
                        "fast",
                    ])
                    .status()
                    .context("pg_ctlcluster")?;
                ensure!(status.success(), "pg_ctlcluster restart: {status}");
                tokio::time::sleep(Duration::from_millis(3000)).await;
                survived(&mut host, "when PostgreSQL restarted")?;
                kills += 2;
                "PostgreSQL restarted (fast) under the host, which rode it out; then kill -9".to_owned()
            }
            Fault::Network => {
                let mut seen = Vec::new();
                for mode in crate::proxy::Mode::FAULTS {
                    proxy.set(mode);
                    tokio::time::sleep(Duration::from_millis(900)).await;
                    seen.push(format!("{mode:?}"));
                }
                proxy.set(crate::proxy::Mode::Pass);
                tokio::time::sleep(Duration::from_millis(500)).await;
                survived(&mut host, "under network faults")?;
                kills += 1;
                format!(
                    "network faults to one destination ({}), 0.9 s each; {} answers lost so far; then kill -9",
                    seen.join(", "),
                    proxy.lost_answers()
                )
            }
            Fault::ReplacePlugin => {
                let path = plugins.join("activitypub.wasm");
                let (refused, applied) =
                    rewrite_in_place(&path, &wasm[..wasm.len() / 2], &wasm, 3, (200, 150), &laneway.log).await?;
                survived(&mut host, "while its plugin was rewritten")?;
                kills += 1;
                format!(
                    ".wasm half-written then whole, 3 times ({refused} reloads refused, {applied} applied); then kill -9"
                )
            }
        };
        outcome.faults.push(line);
    }

    // The clean host: everything enqueued must end terminal.
    let port = procs::free_port()?;
    let mut host = laneway.start(port, None)?;
    procs::ready(&http, &mut host, port).await?;
    set_ports(&[port]);
    gate.add_permits(plan.activities);
    inbound_gate.add_permits(plan.senders * plan.inbound_each);
    // The inboxes' destinations and the app's.
    let in_flight = PER_DESTINATION * (destinations.len() as u32 + 1);
    let acked = || producer.acked.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let history = |rows: HashMap<i64, Status>| -> anyhow::Result<History> {
        let (arrivals, webhooks) = arrivals(&logs, &inboxes)?;
        Ok(History {
            acked: acked(),
            arrivals,
            rows,
            kills,
            stalls,
            in_flight,
            lost_answers: proxy.lost_answers(),
            webhooks: Some(webhooks),
            pruned: pruned(&faulted.archive)?,
            retention_ms: RETENTION_MS as i64,
        })
    };
    let deadline = Instant::now() + plan.drain_deadline;
    loop {
        // Done, or failed: either way nothing more will come. The whole
        // history is read only once nothing is open.
        let sent = producer.task.is_finished() && senders.iter().all(tokio::task::JoinHandle::is_finished);
        if sent && open_count(&db_url).await? == 0 {
            let (rows, _, open) = rows(&db_url).await?;
            let report = crate::check::check(&history(rows)?);
            if open == 0 && report.webhooks_missing == 0 {
                break;
            }
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
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(host);
    for task in senders.into_iter().chain([producer.task]) {
        if task.is_finished() {
            task.await??;
        } else {
            task.abort();
        }
    }
    drop(fakes);

    let (rows, expired, _) = rows(&db_url).await?;
    outcome.history = history(rows)?;
    outcome.lease_expired = expired;
    outcome.elapsed = started.elapsed();
    let passed = crate::check::check(&outcome.history).passed();
    outcome.faults.extend(workspace.finish(passed).await?);
    Ok(outcome)
}

/// The host must still be running after `what`; then it is killed -9, so
/// the next fault starts from a fresh process.
fn survived(host: &mut Proc, what: &str) -> anyhow::Result<()> {
    ensure!(host.exited().is_none(), "the host died {what}");
    host.kill9();
    Ok(())
}

/// Writes `partial` over `path` in place, then `whole`, `times` times
/// (`gaps`: ms before each round and between the two writes), as editors,
/// `cat >` and copies do while a host watches the file; what the hosts' log
/// then says of the reloads: (refused, applied).
async fn rewrite_in_place(
    path: &Path,
    partial: &[u8],
    whole: &[u8],
    times: usize,
    gaps: (u64, u64),
    log: &Path,
) -> anyhow::Result<(usize, usize)> {
    let before = reloads(log);
    for _ in 0..times {
        tokio::time::sleep(Duration::from_millis(gaps.0)).await;
        std::fs::write(path, partial)?;
        tokio::time::sleep(Duration::from_millis(gaps.1)).await;
        std::fs::write(path, whole)?;
    }
    // The debounce and a reload's load, before anyone looks.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = reloads(log);
    Ok((after.0 - before.0, after.1 - before.1))
}

/// How many reloads the hosts' log shows refused and applied so far.
fn reloads(log: &Path) -> (usize, usize) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    (
        text.matches("Reload refused; the previous configuration").count(),
        text.matches("Configuration reloaded.").count(),
    )
}

/// Terminates every connection to `name` but the caller's own.
async fn terminate(server: &str, name: &str) -> anyhow::Result<i64> {
    use sqlx::Connection as _;
    let mut admin = sqlx::PgConnection::connect(server).await?;
    let n: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind(name)
    .fetch_one(&mut admin)
    .await?;
    Ok(n)
}
