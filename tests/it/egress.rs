//! One egress guard for every outbound client: the same hostile-target
//! table through the plugin `http` import, the inbound key fetch, outcome
//! webhooks and the fee oracle's RPC client, and through a redirect.
//!
//! Only loopback spellings are ever sent (a listener on this machine counts
//! what reaches it, and must count nothing). Internal ranges off this
//! machine (169.254.169.254, private networks) are judged by the guard's
//! check that every client makes before it connects, never sent to, so no
//! packet can leave the machine even if a client were broken.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use laneway::egress::{Egress, Guarded, Options, Refusal};
use laneway::executor::Executor as _;
use laneway::queue::NewOp;

use crate::runtime::{attempt, load, op, runtime, Recorder};

/// Counts the connections that reach it, on every local address (v4 and
/// v6 where the machine has it).
struct Sink {
    port: u16,
    hits: Arc<AtomicUsize>,
}

impl Sink {
    async fn start() -> anyhow::Result<Self> {
        let listener = match tokio::net::TcpListener::bind("[::]:0").await {
            Ok(l) => l,
            Err(_) => tokio::net::TcpListener::bind("0.0.0.0:0").await?,
        };
        let port = listener.local_addr()?.port();
        let hits = Arc::new(AtomicUsize::new(0));
        let counted = hits.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                drop(socket);
            }
        });
        Ok(Self { port, hits })
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

/// Every spelling of this machine that was seen to get through: IP
/// literals in decimal, octal, hex and short forms, IPv4-mapped IPv6, the
/// unspecified addresses, and a name that resolves to loopback.
fn loopback_spellings(port: u16) -> Vec<String> {
    [
        "127.0.0.1",
        "[::1]",
        "0.0.0.0",
        "[::]",
        "2130706433",
        "0177.0.0.1",
        "0x7f.1",
        "127.1",
        "[::ffff:127.0.0.1]",
        "[::ffff:7f00:1]",
        "[0:0:0:0:0:ffff:127.0.0.1]",
        "localhost",
    ]
    .iter()
    .map(|host| format!("http://{host}:{port}/x"))
    .collect()
}

/// Internal targets off this machine: judged, never sent to.
const OFF_MACHINE: &[&str] = &[
    "http://169.254.169.254/latest/meta-data/",
    "http://[::ffff:169.254.169.254]/",
    "http://[::ffff:a9fe:a9fe]/",
    "http://2852039166/",
    "http://0251.0376.0251.0376/",
    "http://10.0.0.1/",
    "http://172.16.0.1/",
    "http://192.168.1.1/",
    "http://100.64.0.1/",
    "http://[fd00::1]/",
    "http://[fe80::1]/",
    "http://[64:ff9b::a9fe:a9fe]/",
    "http://[2002:a9fe:a9fe::]/",
    "http://[::169.254.169.254]/",
];

fn open_policy(section: &str) -> anyhow::Result<Egress> {
    Egress::from_config(section, &["http://*:*".to_owned(), "https://*:*".to_owned()], &[]).map_err(anyhow::Error::msg)
}

#[test]
fn the_guard_refuses_every_internal_target_before_connecting() -> anyhow::Result<()> {
    let policy = open_policy("test")?;
    for url in loopback_spellings(80)
        .iter()
        .map(String::as_str)
        .chain(OFF_MACHINE.iter().copied())
    {
        if url.contains("localhost") {
            continue; // a name: judged on what it resolves to, at connect
        }
        let refused = policy.check(url);
        ensure!(matches!(refused, Err(Refusal::Internal { .. })), "{url}: {refused:?}");
    }
    for url in [
        "http://93.184.216.34/",
        "https://[2606:4700::1111]/",
        "https://example.com/",
    ] {
        ensure!(policy.check(url).is_ok(), "{url}");
    }
    // An explicit allowance lets exactly that network through.
    let allowed = Egress::from_config("t", &["http://*:*".to_owned()], &["127.0.0.1/32".to_owned()])
        .map_err(anyhow::Error::msg)?;
    ensure!(allowed.check("http://2130706433:80/").is_ok());
    ensure!(allowed.check("http://127.0.0.2:80/").is_err());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_client_reaches_no_loopback_spelling_and_says_why() -> anyhow::Result<()> {
    let sink = Sink::start().await?;
    let client = Guarded::new(open_policy("test")?, Options::default()).map_err(anyhow::Error::msg)?;
    for url in loopback_spellings(sink.port) {
        let why = match client.request(reqwest::Method::GET, &url) {
            Err(refusal) => refusal.to_string(),
            Ok(request) => match request.send().await {
                Ok(response) => anyhow::bail!("{url} was reached: {}", response.status()),
                Err(e) => laneway::egress::client::describe(&e),
            },
        };
        ensure!(why.contains("internal"), "{url}: {why}");
    }
    ensure!(sink.hits() == 0, "{} connections reached the machine", sink.hits());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_to_an_internal_address_is_refused_at_the_hop() -> anyhow::Result<()> {
    let sink = Sink::start().await?;
    // The first hop is allowed (127.0.0.1 is listed); it redirects to
    // 127.0.0.2, which is not.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let first = listener.local_addr()?.port();
    let target = format!("http://127.0.0.2:{}/key", sink.port);
    let app = axum::Router::new().route(
        "/moved",
        axum::routing::get(move || {
            let target = target.clone();
            async move { (axum::http::StatusCode::FOUND, [("location", target)]) }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let policy = Egress::from_config("inbound", &["http://*:*".to_owned()], &["127.0.0.1".to_owned()])
        .map_err(anyhow::Error::msg)?;
    let client = Guarded::new(
        policy,
        Options {
            redirects: 3,
            ..Options::default()
        },
    )
    .map_err(anyhow::Error::msg)?;
    let sent = client
        .request(reqwest::Method::GET, &format!("http://127.0.0.1:{first}/moved"))
        .map_err(|r| anyhow::anyhow!("{r}"))?
        .send()
        .await;
    let err = sent.err().context("the redirect was followed")?;
    let refusal = laneway::egress::client::refusal(&err).context("no refusal in the error")?;
    ensure!(matches!(refusal, Refusal::Internal { .. }), "{refusal:?}");
    ensure!(sink.hits() == 0, "the hop reached 127.0.0.2");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_client_refuses_the_same_targets() -> anyhow::Result<()> {
    let sink = Sink::start().await?;
    let targets = loopback_spellings(sink.port);

    // The plugin `http` import (the grants fixture GETs what it is told).
    let rt = runtime()?;
    let plugin = load(
        &rt,
        "grants",
        "allowed_hosts = [\"http://*:*\"]",
        laneway::keys::KeyStore::default(),
    )?
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    for url in &targets {
        let outcome = plugin
            .execute(op(1, &format!("\"get:{url}\"")), attempt(Arc::new(Recorder::default())))
            .await;
        ensure!(
            matches!(&outcome, Err(laneway::runtime::failure::PluginFailure::Denied(why)) if why.contains("internal")),
            "plugin http, {url}: {outcome:?}"
        );
    }

    // The inbound key fetch.
    let inbound = laneway::config::from_toml_str("[inbound]\nallowed_hosts = [\"http://*:*\"]\n")?;
    let keys = laneway::inbound::KeyCache::new(
        laneway::inbound::key_client(&inbound.inbound).map_err(anyhow::Error::msg)?,
        laneway::inbound::KeySettings::default(),
    );
    for url in &targets {
        let result = keys.verify(&format!("{url}#main-key"), b"data", b"sig").await;
        let why = format!("{:?}", result.err());
        ensure!(why.contains("internal"), "key fetch, {url}: {why}");
    }

    // The fee oracle's RPC client.
    for url in &targets {
        let why = match laneway::oracle::StellarRpc::new(url, Duration::from_secs(2), open_policy("oracles.x")?) {
            Err(e) => e.to_string(),
            Ok(rpc) => format!("{:?}", rpc.call("getHealth", None).await.err()),
        };
        ensure!(why.contains("internal"), "oracle, {url}: {why}");
    }

    // Outcome webhooks: the URL is the config's, sent through the guard.
    let dir = tempfile::tempdir()?;
    let key_file = dir.path().join("hooks.secret");
    std::fs::write(
        &key_file,
        format!("whsec_{}", "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUE="),
    )?;
    let db = crate::support::sqlite().await?;
    for url in &targets {
        let config = laneway::config::from_toml_str(&format!(
            "[outcomes]\nallowed_hosts = [\"http://*:*\"]\n[keys.hooks]\nalgorithm = \"hmac-sha256\"\nfile = {:?}\n\
             [kinds.note]\noutcome_webhook = {url:?}\noutcome_webhook_key = \"hooks\"\n",
            key_file.display().to_string()
        ));
        // check-config refuses the literals already; the names are judged at send.
        let Ok(config) = config else { continue };
        let keys = Arc::new(laneway::keys::KeyStore::load(&config.keys).map_err(|e| anyhow::anyhow!("{e:?}"))?);
        let executor = laneway::webhook::WebhookExecutor::new(keys, &config);
        let payload = serde_json::json!({ "kind": "note", "id": "msg_1", "body": "{}" }).to_string();
        let mut new = NewOp::new("outcomes:o", "outcome_webhook", payload);
        new.lanes = vec![format!("outcome:{url}")];
        let id = db.queue.enqueue(&[new]).await?[0].id();
        let stored = db.queue.get(id).await?.context("op")?;
        let outcome = executor
            .execute(
                &stored,
                laneway::executor::Attempt::new(Arc::new(Recorder::default()), None),
            )
            .await;
        let text = format!("{outcome:?}");
        ensure!(text.contains("internal"), "webhook, {url}: {text}");
    }
    ensure!(sink.hits() == 0, "{} connections reached the machine", sink.hits());
    Ok(())
}

#[test]
fn check_config_refuses_an_internal_webhook_literal() -> anyhow::Result<()> {
    for url in [
        "http://127.0.0.1:9/x",
        "http://2130706433/x",
        "http://169.254.169.254/x",
        "http://[::]:9/x",
    ] {
        let err = laneway::config::from_toml_str(&format!(
            "[outcomes]\nallowed_hosts = [\"http://*:*\"]\n[keys.hooks]\nalgorithm = \"hmac-sha256\"\nfile = \"/dev/null\"\n\
             [kinds.note]\noutcome_webhook = {url:?}\noutcome_webhook_key = \"hooks\"\n"
        ))
        .err()
        .with_context(|| format!("{url} accepted"))?;
        ensure!(err.to_string().contains("internal"), "{url}: {err}");
    }
    Ok(())
}

/// No outbound HTTP client is built outside the egress module (the CLI's
/// remote mode talks to the operator's own API, and the demo's fakes to
/// themselves).
#[test]
fn every_outbound_client_is_built_by_the_egress_module() -> anyhow::Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../host/src");
    let mut offenders = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let relative = path.strip_prefix(&root)?.to_string_lossy().replace('\\', "/");
            let exempt = relative == "egress/client.rs" || relative == "cli/remote.rs" || relative.starts_with("demo/");
            let text = std::fs::read_to_string(&path)?;
            if !exempt && (text.contains("Client::builder") || text.contains("reqwest::Client::new")) {
                offenders.push(relative);
            }
        }
    }
    ensure!(offenders.is_empty(), "HTTP clients built outside egress: {offenders:?}");
    Ok(())
}
