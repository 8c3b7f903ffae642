//! Inbound activities from authorized-fetch servers (Mastodon's
//! `AUTHORIZED_FETCH`, GoToSocial, Threads), which serve an actor's key only
//! to a signed GET: the Node server (`tests/tools/ap-inbox --secure-fetch`,
//! its own process) refuses unsigned fetches and verifies signed ones with
//! joyent's `http-signature` and `http-message-signatures`, finding
//! laneway's key in the instance actor document laneway serves. laneway
//! runs as the release-shaped binary, a process of its own.

use std::process::Stdio;
use std::time::Duration;

use anyhow::ensure;
use laneway::inbound::{InboundError, KeyCache, KeySettings};
use rsa::pkcs8::{EncodePrivateKey as _, EncodePublicKey as _};
use serde_json::{json, Value};

use super::actor_key;
use super::inbound::{activity, signed};
use super::independent::NodeInbox;
use crate::support::{migrate_with, wait_healthy, Process};

/// A migrated SQLite host with the inboxes on, its key fetches unsigned;
/// its base URL, config file, and the lines that make it sign them as
/// `/actor` (served by itself) with a fresh RSA key.
async fn start_host(dir: &std::path::Path) -> anyhow::Result<(Process, String, std::path::PathBuf, String)> {
    let bin = crate::support::laneway_binary()?;
    let instance = rsa::RsaPrivateKey::new(&mut rand::thread_rng(), 2048)?;
    let instance_pem = dir.join("instance.pem");
    std::fs::write(&instance_pem, instance.to_pkcs8_pem(Default::default())?.as_bytes())?;
    let hooks = dir.join("hooks.secret");
    std::fs::write(&hooks, "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let base = format!("http://127.0.0.1:{port}");
    let config = dir.join("laneway.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[database]
url = "sqlite://{db}"
[api]
listen = "127.0.0.1:{port}"
[inbound]
enabled = true
allowed_hosts = ["http://127.0.0.1:*"]
allowed_internal = ["127.0.0.1"]
[keys.instance]
algorithm = "rsa-sha256"
file = "{instance}"
[keys.hooks]
algorithm = "hmac-sha256"
file = "{hooks}"
[plugins.inbound]
path = "{webhook}"
allowed_hosts = ["http://127.0.0.1:*"]
allowed_internal = ["127.0.0.1"]
keys = ["hooks"]
[kinds.activitypub_inbound]
plugin = "inbound"
config = {{ url = "http://127.0.0.1:9/app", key = "hooks" }}
"#,
            db = dir.join("queue.db").display(),
            instance = instance_pem.display(),
            hooks = hooks.display(),
            webhook = crate::runtime::wasm("webhook")?.display(),
        ),
    )?;
    migrate_with(&bin, &config)?;
    let host = Process(
        std::process::Command::new(&bin)
            .arg("--config")
            .arg(&config)
            .arg("run")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    wait_healthy(&base).await?;
    let signing = format!("fetch_actor = \"{base}/actor\"\nfetch_key = \"instance\"\n");
    let _ = &instance;
    Ok((host, base, config, signing))
}

/// The instance actor laneway serves: an Application listing `key`.
async fn served_actor(base: &str, key: &rsa::RsaPublicKey) -> anyhow::Result<bool> {
    let http = reqwest::Client::new();
    let answer = http.get(format!("{base}/actor")).send().await?;
    if !answer.status().is_success() {
        return Ok(false);
    }
    let document: Value = serde_json::from_str(&http.get(format!("{base}/actor")).send().await?.text().await?)?;
    ensure!(
        document["id"] == format!("{base}/actor")
            && document["publicKey"]["id"] == format!("{base}/actor#main-key")
            && document["publicKey"]["publicKeyPem"] == key.to_public_key_pem(Default::default())?.as_str(),
        "{document}"
    );
    Ok(true)
}

/// The GETs the Node server answered, as (scheme, status).
fn fetches(node: &NodeInbox) -> Vec<(String, u64)> {
    node.requests()
        .iter()
        .filter(|r| r["method"] == "GET")
        .map(|r| {
            (
                r["scheme"].as_str().unwrap_or("").to_owned(),
                r["status"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn activities_from_authorized_fetch_servers_verify_through_signed_key_fetches() -> anyhow::Result<()> {
    let (_, _, sender_key) = actor_key()?;
    let trusted = json!({ "actor_pem": sender_key.to_public_key().to_public_key_pem(Default::default())? });

    // Unsigned, as laneway fetched before: 401, said so, and remembered:
    // the second request naming the key does not fetch again.
    let node = NodeInbox::start(&trusted, &["--secure-fetch"])?;
    let config = laneway::config::from_toml_str(
        "[inbound]\nallowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1\"]\n",
    )?;
    let unsigned = KeyCache::new(
        laneway::inbound::key_client(&config.inbound).map_err(anyhow::Error::msg)?,
        KeySettings::of(&config.inbound),
    );
    let key_id = format!("{}/actors/alice#main-key", node.base);
    for _ in 0..3 {
        match unsigned.verify(&key_id, b"data", b"sig").await {
            Err(InboundError::KeyUnavailable { why, .. }) => {
                ensure!(why.contains("401") && why.contains("fetch_actor"), "{why}");
            }
            other => anyhow::bail!("an unsigned fetch from a secure server: {other:?}"),
        }
    }
    ensure!(
        fetches(&node) == [("none".to_owned(), 401)],
        "one fetch, then the failure remembered: {:?}",
        fetches(&node)
    );
    ensure!(unsigned.failures_len() == 1);

    // The laneway process, unsigned: refused, and told what to set.
    let dir = tempfile::tempdir()?;
    let (_host, base, config, signing) = start_host(dir.path()).await?;
    let http = reqwest::Client::new();
    let actor = format!("{}/actors/alice", node.base);
    let inbox = format!("{base}/inbox/alice");
    let answer = signed(&http, &inbox, &activity(&actor, 1), sender_key, &key_id, false)?
        .send()
        .await?;
    let status = answer.status();
    let text = answer.text().await?;
    ensure!(status == 401 && text.contains("fetch_actor"), "{status}: {text}");
    ensure!(fetches(&node).len() == 2, "{:?}", fetches(&node));

    // The operator edits the config in place to sign fetches: the reload
    // serves the actor, and signed fetches (draft-cavage) verify.
    let instance_key = {
        use rsa::pkcs8::DecodePrivateKey as _;
        rsa::RsaPrivateKey::from_pkcs8_pem(&std::fs::read_to_string(dir.path().join("instance.pem"))?)?.to_public_key()
    };
    let text = std::fs::read_to_string(&config)?;
    std::fs::write(
        &config,
        text.replace(
            "allowed_internal = [\"127.0.0.1\"]\n[keys.instance]",
            &format!("allowed_internal = [\"127.0.0.1\"]\n{signing}[keys.instance]"),
        ),
    )?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !served_actor(&base, &instance_key).await? {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the edited config was not applied"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let answer = signed(&http, &inbox, &activity(&actor, 1), sender_key, &key_id, false)?
        .send()
        .await?;
    let status = answer.status();
    ensure!(status == 202, "{status}: {}", answer.text().await?);
    ensure!(
        fetches(&node)[2..] == [("cavage".to_owned(), 200)],
        "{:?}",
        fetches(&node)
    );

    // A server that takes only RFC 9421 and says so in Accept-Signature:
    // the fetch is sent again so signed, and verifies.
    let strict = NodeInbox::start(&trusted, &["--secure-fetch", "--accept", "rfc9421", "--challenge"])?;
    let actor = format!("{}/actors/bob", strict.base);
    let answer = signed(
        &http,
        &inbox,
        &activity(&actor, 2),
        sender_key,
        &format!("{actor}#main-key"),
        false,
    )?
    .send()
    .await?;
    let status = answer.status();
    ensure!(status == 202, "{status}: {}", answer.text().await?);
    ensure!(
        fetches(&strict) == [("cavage".to_owned(), 401), ("rfc9421".to_owned(), 200)],
        "{:?}",
        fetches(&strict)
    );
    // That origin is then fetched with RFC 9421 from the first try.
    let actor = format!("{}/actors/carol", strict.base);
    let answer = signed(
        &http,
        &inbox,
        &activity(&actor, 3),
        sender_key,
        &format!("{actor}#main-key"),
        false,
    )?
    .send()
    .await?;
    ensure!(answer.status() == 202, "{}", answer.status());
    ensure!(fetches(&strict).len() == 3 && fetches(&strict)[2] == ("rfc9421".to_owned(), 200));

    // A forged instance signature is refused by the server: a fetch signed
    // with another key than the one laneway's actor lists.
    let forged = http
        .get(format!("{}/actors/alice", node.base))
        .header("date", httpdate::fmt_http_date(std::time::SystemTime::now()))
        .header(
            "signature",
            format!("keyId=\"{base}/actor#main-key\",algorithm=\"rsa-sha256\",headers=\"(request-target) host date\",signature=\"AAAA\""),
        )
        .send()
        .await?;
    ensure!(forged.status() == 401, "{}", forged.status());
    Ok(())
}
