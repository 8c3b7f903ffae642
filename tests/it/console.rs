//! The operator console: its files and their policy, the routes it added
//! (`whoami`, `activity`, `dead-letters`) on both backends, and a real headless
//! Chromium driving it against the `laneway` binary run as its own process
//! with the real noop and ActivityPub plugins and a fake inbox.

use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use serde_json::Value;

use crate::api::Served;
use crate::dispatch::harness::{settle, to, Scripted, Step};
use crate::support::TestDb;

crate::on_both_backends!(
    live: the_console_is_served_under_a_strict_policy_and_only_when_on,
    whoami_names_the_key_and_activity_and_dead_letters_count_outcomes,
);

fn no_redirects() -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?)
}

async fn the_console_is_served_under_a_strict_policy_and_only_when_on(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(&db, &exec, "").await?;
    let http = no_redirects()?;
    let answer = http.get(format!("{}/console", served.base)).send().await?;
    ensure!(
        answer.status().is_redirection() && answer.headers()["location"] == "/console/",
        "{answer:?}"
    );
    let mut texts = Vec::new();
    for (file, kind) in [
        ("", "text/html"),
        ("app.js", "text/javascript"),
        ("app.css", "text/css"),
        ("icon.svg", "image/svg+xml"),
    ] {
        let answer = http.get(format!("{}/console/{file}", served.base)).send().await?;
        ensure!(answer.status() == 200, "{file}: {}", answer.status());
        let header = |name: &str| {
            answer
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        ensure!(
            header("content-type").starts_with(kind),
            "{file}: {}",
            header("content-type")
        );
        let policy = header("content-security-policy");
        for must in [
            "default-src 'none'",
            "script-src 'self'",
            "style-src 'self'",
            "connect-src 'self'",
            "frame-ancestors 'none'",
            "form-action 'none'",
        ] {
            ensure!(policy.contains(must), "{file}: the policy lacks {must}: {policy}");
        }
        ensure!(!policy.contains("unsafe"), "{file}: {policy}");
        ensure!(header("x-content-type-options") == "nosniff", "{file}");
        ensure!(header("x-frame-options") == "DENY", "{file}");
        texts.push(answer.text().await?);
    }
    // Nothing inline for the policy to have to allow, and nothing that
    // parses API data as HTML.
    let html = &texts[0];
    for tag in html.split("<script").skip(1) {
        ensure!(tag.trim_start().starts_with("src="), "an inline script: <script{tag}");
    }
    ensure!(
        !html.contains("style=") && !html.contains(" onclick="),
        "inline style or handler"
    );
    for sink in [
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "new Function",
    ] {
        ensure!(!texts[1].contains(sink), "app.js uses {sink}");
    }
    ensure!(
        !texts[1].contains("document.cookie") && texts[1].contains("sessionStorage"),
        "the key is kept in the tab's session storage, never a cookie"
    );
    served.running.stop().await?;

    // Off by config: no console, the API as before.
    let served = Served::start(&db, &exec, "[api]\nconsole = false\n").await?;
    for path in ["/console", "/console/", "/console/app.js"] {
        let answer = http.get(format!("{}{path}", served.base)).send().await?;
        ensure!(
            answer.status() == 404,
            "{path} with the console off: {}",
            answer.status()
        );
    }
    let (status, _) = served.call("GET", "/healthz", None, None).await?;
    ensure!(status == 200, "{status}");
    served.running.stop().await
}

async fn whoami_names_the_key_and_activity_and_dead_letters_count_outcomes(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(&db, &exec, "").await?;
    let reader = served.key("reader", &["outbox:read"]).await?;
    let producer = served.key("producer", &["ops:write"]).await?;
    let (status, me) = served.call("GET", "/api/admin/whoami", Some(&reader), None).await?;
    ensure!(
        status == 200 && me["actor"] == "key:reader" && me["scopes"] == serde_json::json!(["outbox:read"]),
        "{status} {me}"
    );
    let (status, me) = served.call("GET", "/api/admin/whoami", Some(&producer), None).await?;
    ensure!(status == 200 && me["scopes"][0] == "ops:write", "{status} {me}");
    let (status, _) = served.call("GET", "/api/admin/whoami", None, None).await?;
    ensure!(status == 401, "{status}");
    // Three confirmed, two dead-lettered, one cancelled; paused while the
    // ops are scripted, so none runs unscripted.
    served
        .queue
        .pause(laneway::queue::PauseScope::Kind, "activitypub", None, "test")
        .await?;
    let ids: Vec<_> = served
        .queue
        .enqueue(
            &(0..5)
                .map(|n| to("o", &format!("https://h{n}.example/inbox"), n))
                .collect::<Vec<_>>(),
        )
        .await?
        .into_iter()
        .map(|e| e.id())
        .collect();
    for (i, id) in ids.iter().enumerate() {
        exec.script(*id, [if i % 2 == 1 { Step::Permanent } else { Step::Ok }]);
    }
    served
        .queue
        .resume(laneway::queue::PauseScope::Kind, "activitypub")
        .await?;
    settle(served.queue.as_ref(), Duration::from_secs(20)).await?;
    let mut held = to("o", "https://later.example/inbox", 9);
    held.not_before = Some(chrono::Utc::now() + chrono::Duration::hours(1));
    let later = served.queue.enqueue(&[held]).await?[0].id();
    served.queue.cancel(later).await?;
    let (status, activity) = served
        .call("GET", "/api/admin/outbox/activity", Some(&reader), None)
        .await?;
    ensure!(status == 200, "{status} {activity}");
    let count = |s: &str| {
        activity["counts"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["status"] == s)
            .and_then(|c| c["count"].as_i64())
            .unwrap_or(0)
    };
    ensure!(
        (count("confirmed"), count("failed"), count("cancelled")) == (3, 2, 1),
        "{activity}"
    );
    ensure!(
        activity["window_seconds"] == 3600 && activity["covered_seconds"] == 3600,
        "{activity}"
    );
    ensure!(
        activity["failure_rate"]
            .as_f64()
            .is_some_and(|r| (r - 0.4).abs() < 1e-9),
        "{activity}"
    );
    let (status, _) = served
        .call("GET", "/api/admin/outbox/activity", Some(&producer), None)
        .await?;
    ensure!(status == 403, "{status}");
    // The two dead letters, as one group: their kind, their last attempt's
    // class, a known outcome, the newer of the two.
    let (status, dead) = served
        .call("GET", "/api/admin/outbox/dead-letters", Some(&reader), None)
        .await?;
    ensure!(status == 200, "{status} {dead}");
    ensure!(
        dead["groups"]
            == serde_json::json!([{"kind": "activitypub", "class": "permanent", "unknown": false,
                                   "count": 2, "newest": ids[3]}]),
        "{dead}"
    );
    served.running.stop().await
}

/// An inbox that refuses every delivery (400: permanent) until fixed.
async fn fake_inbox(broken: Arc<AtomicBool>, delivered: Arc<AtomicUsize>) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/inbox",
        axum::routing::post(move || {
            let (broken, delivered) = (broken.clone(), delivered.clone());
            async move {
                if broken.load(Ordering::SeqCst) {
                    axum::http::StatusCode::BAD_REQUEST
                } else {
                    delivered.fetch_add(1, Ordering::SeqCst);
                    axum::http::StatusCode::ACCEPTED
                }
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(format!("http://{addr}/inbox"))
}

/// A process killed (and reaped) when the test ends, however it ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs a command to its end off the async workers.
async fn output(mut command: std::process::Command) -> anyhow::Result<std::process::Output> {
    Ok(tokio::task::spawn_blocking(move || command.output()).await??)
}

async fn cli(bin: &Path, config: &Path, args: &[&str]) -> anyhow::Result<String> {
    let mut command = std::process::Command::new(bin);
    command.arg("--config").arg(config).args(args);
    let out = output(command)
        .await
        .with_context(|| format!("running {}", bin.display()))?;
    ensure!(
        out.status.success(),
        "laneway {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn api_key(bin: &Path, config: &Path, name: &str, scopes: &str) -> anyhow::Result<String> {
    let out = cli(
        bin,
        config,
        &["api-keys", "new", "--name", name, "--scopes", scopes, "--json"],
    )
    .await?;
    let v: Value = serde_json::from_str(&out).with_context(|| out.clone())?;
    v["secret"].as_str().map(str::to_owned).context("secret")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_operator_recovers_a_dead_letter_live_and_a_read_only_key_cannot_write() -> anyhow::Result<()> {
    use rsa::pkcs8::EncodePrivateKey as _;
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".to_owned());
    ensure!(
        Path::new(&chromium).exists(),
        "{chromium} is missing: ./dev test installs Debian's chromium"
    );
    let tool = repo.join("tests/tools/console");
    ensure!(
        tool.join("node_modules/playwright-core").exists(),
        "run npm ci --prefix tests/tools/console (./dev test does)"
    );
    let bin = crate::support::laneway_binary()?;
    let dir = tempfile::tempdir()?;
    let key = rsa::RsaPrivateKey::new(&mut rand::thread_rng(), 2048)?;
    let pem = dir.path().join("actor.pem");
    std::fs::write(&pem, key.to_pkcs8_pem(rsa::pkcs8::LineEnding::LF)?.as_bytes())?;
    let broken = Arc::new(AtomicBool::new(true));
    let delivered = Arc::new(AtomicUsize::new(0));
    let inbox = fake_inbox(broken.clone(), delivered.clone()).await?;
    // An inbox that refuses everything for good, for dead letters the
    // browser run makes itself (one arriving after a preview; lanes held).
    let refusing = fake_inbox(Arc::new(AtomicBool::new(true)), Arc::default()).await?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let plugins = repo.join("plugins/target/wasm32-wasip2/release");
    let config = dir.path().join("laneway.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[database]
url = "sqlite://{db}"
[api]
listen = "127.0.0.1:{port}"
[dispatch]
poll_ms = 50
[keys.actor]
algorithm = "rsa-sha256"
file = "{pem}"
[plugins.activitypub]
path = "{plugins}/activitypub.wasm"
allowed_hosts = ["http://127.0.0.1:*"]
allowed_internal = ["127.0.0.1"]
keys = ["actor"]
[plugins.noop]
path = "{plugins}/noop.wasm"
[kinds.activitypub]
plugin = "activitypub"
poison = "halt"
backoff_base_ms = 50
backoff_max_ms = 200
config = {{ key = "actor", key_id = "https://console.laneway.example/actor#main-key", signature = "cavage" }}
[kinds.noop]
plugin = "noop"
"#,
            db = dir.path().join("queue.db").display(),
            pem = pem.display(),
            plugins = plugins.display(),
        ),
    )?;
    cli(&bin, &config, &["migrate"]).await?;
    let admin = api_key(&bin, &config, "admin", "outbox:read,outbox:write,plugins:admin").await?;
    let reader = api_key(&bin, &config, "reader", "outbox:read").await?;
    let producer = api_key(&bin, &config, "producer", "ops:write").await?;
    let _host = Child(
        std::process::Command::new(&bin)
            .arg("--config")
            .arg(&config)
            .arg("run")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !http
        .get(format!("{base}/readyz"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        ensure!(tokio::time::Instant::now() < deadline, "laneway did not become ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let post = |path: &str, key: &str, body: Value| {
        http.post(format!("{base}{path}"))
            .bearer_auth(key)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
    };
    let json = |text: String| serde_json::from_str::<Value>(&text).with_context(|| text.clone());
    let answer = json(
        post(
            "/api/v1/activitypub/deliveries",
            &producer,
            serde_json::json!({
                "outbox": "https://console.laneway.example/actor",
                "activity": {"id": "https://console.laneway.example/a/1", "type": "Create",
                             "object": {"id": "https://console.laneway.example/n/1", "type": "Note"}},
                "recipients": [inbox],
            }),
        )
        .await?
        .text()
        .await?,
    )?;
    let dead = answer["deliveries"][0]["id"]
        .as_i64()
        .with_context(|| answer.to_string())?;
    for n in 0..3 {
        let answer = post(
            "/api/v1/ops",
            &producer,
            serde_json::json!({"kind": "noop", "outbox": "console", "payload": {"n": n}}),
        )
        .await?;
        ensure!(answer.status().is_success(), "{}", answer.text().await?);
    }
    // Text from producers and the outside world is shown as text.
    let hostile = json(
        post(
            "/api/v1/ops",
            &producer,
            serde_json::json!({"kind": "noop", "outbox": "console", "correlation_id": "<b id=pwned>x</b>",
                               "payload": {"html": "<img src=x onerror=\"window.pwned=1\">"}}),
        )
        .await?
        .text()
        .await?,
    )?;
    let hostile = hostile["id"].as_i64().with_context(|| hostile.to_string())?;
    // The inbox refuses it for good: a dead letter.
    let status = |id: i64| {
        let http = http.clone();
        let url = format!("{base}/api/admin/outbox/{id}");
        let admin = admin.clone();
        async move {
            let text = http.get(url).bearer_auth(admin).send().await?.text().await?;
            let op: Value = serde_json::from_str(&text).with_context(|| text.clone())?;
            anyhow::Ok(op["op"]["status"].as_str().unwrap_or_default().to_owned())
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while status(dead).await? != "failed" {
        ensure!(tokio::time::Instant::now() < deadline, "op {dead} never dead-lettered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A destination failing but not held (available, failures counted): the
    // overview must not count it as held (/metrics does not).
    let shared = laneway::config::from_toml_str(&format!(
        "[database]\nurl = \"sqlite://{}\"\n",
        dir.path().join("queue.db").display()
    ))?;
    let queue = laneway::queue::open(&shared.database, shared.limits(), Arc::new(laneway::clock::SystemClock)).await?;
    laneway::destinations::apply(
        queue.as_ref(),
        &laneway::events::Metrics::default(),
        "failing.example",
        &[laneway::health::Event::Failed {
            error: "connection refused",
        }],
        "test",
        chrono::Utc::now(),
        &shared.destinations.health(),
    )
    .await?;
    // The receiver is fixed; the operator takes over in the browser.
    broken.store(false, Ordering::SeqCst);
    let mut browser = std::process::Command::new("node");
    browser
        .arg(tool.join("console.mjs"))
        .env("LW_BASE", &base)
        .env("LW_ADMIN_KEY", &admin)
        .env("LW_READ_KEY", &reader)
        .env("LW_DEAD_ID", dead.to_string())
        .env("LW_HOSTILE_ID", hostile.to_string())
        .env("LW_PRODUCER_KEY", &producer)
        .env("LW_REFUSING_INBOX", &refusing)
        .env("CHROMIUM", &chromium);
    if let Some(dir) = std::env::var_os("LW_SHOTS") {
        browser.env("LW_SHOTS", dir);
    }
    // The script's own waits are bounded (20 s each); so is the run.
    browser.env("LW_DEADLINE_MS", "240000");
    let out = output(browser).await.context("node")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success() && stdout.contains("step: done"),
        "the browser run failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // What the browser did happened: the op was delivered, and every write
    // is in the audit log under the key that made it.
    ensure!(status(dead).await? == "confirmed", "op {dead}");
    ensure!(delivered.load(Ordering::SeqCst) >= 1, "the inbox got nothing");
    let audit = json(
        http.get(format!("{base}/api/admin/audit"))
            .bearer_auth(&admin)
            .send()
            .await?
            .text()
            .await?,
    )?;
    let actions: Vec<(String, String)> = audit["entries"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            (
                e["actor"].as_str().unwrap_or_default().to_owned(),
                e["action"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    for action in ["op.recover", "pause", "resume"] {
        ensure!(
            actions.iter().any(|(who, what)| who == "key:admin" && what == action),
            "{action} by key:admin is not audited: {actions:?}"
        );
    }
    ensure!(
        !actions.iter().any(|(who, _)| who == "key:reader"),
        "the read-only key wrote: {actions:?}"
    );
    Ok(())
}
