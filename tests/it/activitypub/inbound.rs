//! Inbound activities through the API's inboxes and the shipped
//! `webhook` plugin: signatures verified (draft-cavage and RFC
//! 9421, the actor's key fetched, and fetched again after a rotation), one
//! op per activity id in its sender's lane, processed in order with
//! retries and a dead letter, each handed to the application as a Standard
//! Webhook that the reference library verifies.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{ensure, Context};
use base64::Engine as _;
use laneway::runtime::host::PluginHost;
use rsa::pkcs8::EncodePublicKey as _;
use rsa::signature::{SignatureEncoding as _, Signer as _};
use serde_json::{json, Value};
use sha2::Digest as _;

use super::actor_key;
use crate::api::Served;
use crate::dispatch::harness::settle;
use crate::stellar::vault::Receiver;
use crate::support::TestDb;

/// Serves the sender's actor document, whose key can be swapped.
#[derive(Clone)]
struct ActorServer {
    pem: Arc<Mutex<String>>,
    base: String,
}

impl ActorServer {
    async fn start(key: &rsa::RsaPrivateKey) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let server = Self {
            pem: Arc::new(Mutex::new(key.to_public_key().to_public_key_pem(Default::default())?)),
            base,
        };
        let state = server.clone();
        let app = axum::Router::new().route(
            "/users/sender",
            axum::routing::get(move || {
                let state = state.clone();
                async move {
                    let pem = state.pem.lock().unwrap_or_else(PoisonError::into_inner).clone();
                    axum::Json(json!({
                        "id": state.actor(),
                        "type": "Person",
                        "publicKey": { "id": state.key_id(), "owner": state.actor(), "publicKeyPem": pem },
                    }))
                }
            }),
        );
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(server)
    }

    fn actor(&self) -> String {
        format!("{}/users/sender", self.base)
    }

    fn key_id(&self) -> String {
        format!("{}#main-key", self.actor())
    }

    fn rotate(&self, key: &rsa::RsaPrivateKey) -> anyhow::Result<()> {
        *self.pem.lock().unwrap_or_else(PoisonError::into_inner) =
            key.to_public_key().to_public_key_pem(Default::default())?;
        Ok(())
    }
}

/// A server on another origin serving the forger's key two ways: a key
/// document claiming `victim` as its owner (`/key`), and an actor document
/// claiming to be `victim` (`/actor`). Returns its base URL.
async fn forger(key: &rsa::RsaPrivateKey, victim: &str) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let pem = key.to_public_key().to_public_key_pem(Default::default())?;
    let (key_doc, actor_doc) = (
        json!({ "id": format!("{base}/key"), "owner": victim, "publicKeyPem": pem }),
        json!({ "id": victim, "type": "Person",
            "publicKey": { "id": format!("{base}/actor#main-key"), "owner": victim, "publicKeyPem": pem } }),
    );
    let app = axum::Router::new()
        .route("/key", axum::routing::get(move || async move { axum::Json(key_doc) }))
        .route(
            "/actor",
            axum::routing::get(move || async move { axum::Json(actor_doc) }),
        );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(base)
}

/// Every op (a listing's default limit is 0).
fn all_ops() -> laneway::queue::OpFilter {
    laneway::queue::OpFilter {
        limit: 1000,
        ..Default::default()
    }
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A signed POST of `body` to `url`, as a fediverse server sends it.
pub(super) fn signed(
    http: &reqwest::Client,
    url: &str,
    body: &str,
    key: &rsa::RsaPrivateKey,
    key_id: &str,
    rfc9421: bool,
) -> anyhow::Result<reqwest::RequestBuilder> {
    let parsed = reqwest::Url::parse(url)?;
    let host = format!(
        "{}:{}",
        parsed.host_str().unwrap_or_default(),
        parsed.port().unwrap_or(80)
    );
    let hash = sha2::Sha256::digest(body.as_bytes());
    let signer = rsa::pkcs1v15::SigningKey::<sha2::Sha256>::new(key.clone());
    let date = httpdate::fmt_http_date(std::time::SystemTime::now());
    let mut request = http
        .post(url)
        .header("content-type", "application/activity+json")
        .header("date", &date)
        .body(body.to_owned());
    if rfc9421 {
        let digest = format!("sha-256=:{}:", b64(&hash));
        let params = format!(
            "(\"@method\" \"@target-uri\" \"content-type\" \"content-digest\");created={};keyid=\"{key_id}\";alg=\"rsa-v1_5-sha256\"",
            chrono::Utc::now().timestamp()
        );
        let base = format!(
            "\"@method\": POST\n\"@target-uri\": {url}\n\"content-type\": application/activity+json\n\"content-digest\": {digest}\n\"@signature-params\": {params}"
        );
        let signature = signer.sign(base.as_bytes()).to_vec();
        request = request
            .header("content-digest", digest)
            .header("signature-input", format!("sig1={params}"))
            .header("signature", format!("sig1=:{}:", b64(&signature)));
    } else {
        let digest = format!("SHA-256={}", b64(&hash));
        let text = format!(
            "(request-target): post {}\nhost: {host}\ndate: {date}\ndigest: {digest}",
            parsed.path()
        );
        let signature = signer.sign(text.as_bytes()).to_vec();
        request = request.header("digest", digest).header(
            "signature",
            format!(
                "keyId=\"{key_id}\",algorithm=\"rsa-sha256\",headers=\"(request-target) host date digest\",signature=\"{}\"",
                b64(&signature)
            ),
        );
    }
    Ok(request)
}

pub(super) fn activity(actor: &str, n: u32) -> String {
    json!({
        "@context": "https://www.w3.org/ns/activitystreams",
        "id": format!("{actor}/activities/{n}"),
        "type": "Create",
        "actor": actor,
        "object": { "type": "Note", "content": format!("note {n}") },
    })
    .to_string()
}

pub(super) async fn inbound_activities_are_verified_processed_once_in_sender_order_with_retries_and_dead_letters(
    db: TestDb,
) -> anyhow::Result<()> {
    let secret = format!("whsec_{}", b64(&[5u8; 32]));
    // The first four hand-offs fail: the first activity uses its three
    // attempts and is dead-lettered, the second succeeds on its second.
    let app = Receiver::start_failing(&secret, 4)?;
    let (_, _, key) = actor_key()?;
    let sender = ActorServer::start(key).await?;
    let dir = tempfile::tempdir()?;
    let key_file = dir.path().join("hooks.secret");
    std::fs::write(&key_file, &secret)?;
    let config = laneway::config::from_layers(&[
        "[queue]\nlease_ms = 5000\n[dispatch]\npoll_ms = 25\nslot_ttl_ms = 2000\nshutdown_grace_ms = 300\n[api]\nlisten = \"127.0.0.1:0\"\n",
        &format!(
            "[inbound]\nenabled = true\nallowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1\"]\nkey_refetch_ms = 1000\n\
             [keys.hooks]\nalgorithm = \"hmac-sha256\"\nfile = {:?}\n\
             [plugins.inbound]\npath = {:?}\nallowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1\"]\nkeys = [\"hooks\"]\n\
             [kinds.activitypub_inbound]\nplugin = \"inbound\"\nmax_attempts = 3\nbackoff_base_ms = 20\nbackoff_max_ms = 50\n\
             config = {{ url = \"http://127.0.0.1:{}/app/inbound\", key = \"hooks\" }}\n",
            key_file.display().to_string(),
            crate::runtime::wasm("webhook")?.display().to_string(),
            app.port
        ),
    ])?;
    let host = PluginHost::new(&config)?;
    host.apply(&config).await?;
    let served = Served::over(&db, host.registry(), config, None).await?;
    let queue = served.queue.clone();
    let http = reqwest::Client::new();
    let inbox = format!("{}/inbox/alice", served.base);
    let actor = sender.actor();
    let key_id = sender.key_id();
    // An operator suspended the sender's server: hearing from it does not
    // lift that (only an operator does).
    let sender_host = sender.base.trim_start_matches("http://").to_owned();
    served
        .running
        .dispatcher
        .suspend_destination(&sender_host, "test", "test")
        .await?;

    // Refused: unsigned, signed by a key that is not the actor's, signed
    // over another body, and an actor who is not the key's owner.
    let unsigned = http.post(&inbox).body(activity(&actor, 0)).send().await?;
    ensure!(unsigned.status() == 401, "{}", unsigned.status());
    let stranger = rsa::RsaPrivateKey::new(&mut rand::thread_rng(), 1024)?;
    let forged = signed(&http, &inbox, &activity(&actor, 0), &stranger, &key_id, false)?
        .send()
        .await?;
    ensure!(forged.status() == 401, "{}", forged.status());
    let tampered = signed(&http, &inbox, &activity(&actor, 0), key, &key_id, false)?
        .body(activity(&actor, 99))
        .send()
        .await?;
    ensure!(tampered.status() == 401, "{}", tampered.status());
    let impostor = signed(
        &http,
        &inbox,
        &activity("https://elsewhere.example/u", 0),
        key,
        &key_id,
        false,
    )?
    .send()
    .await?;
    let impostor_status = impostor.status();
    let impostor_body: Value = serde_json::from_slice(&impostor.bytes().await?)?;
    ensure!(impostor_status == 401, "{impostor_status} {impostor_body}");
    // Impersonation: a key served by another origin that claims the
    // sender as its owner, and a document on another origin claiming to be
    // the sender; neither is the sender's own document naming the key.
    let evil = rsa::RsaPrivateKey::new(&mut rand::thread_rng(), 1024)?;
    let evil_base = forger(&evil, &actor).await?;
    for key_id in [format!("{evil_base}/key"), format!("{evil_base}/actor#main-key")] {
        let forged = signed(&http, &inbox, &activity(&actor, 0), &evil, &key_id, false)?
            .send()
            .await?;
        let status = forged.status();
        let body = forged.text().await?;
        ensure!(status == 401, "{key_id}: {status} {body}");
    }
    // An activity whose id is on another origin than its actor.
    let foreign_id =
        json!({ "id": "https://elsewhere.example/activities/1", "type": "Create", "actor": actor }).to_string();
    let answer = signed(&http, &inbox, &foreign_id, key, &key_id, false)?.send().await?;
    ensure!(answer.status() == 400, "{}", answer.status());
    ensure!(queue.list(&all_ops()).await?.is_empty(), "nothing refused was enqueued");

    // Accepted: three cavage-signed activities, a replay, one RFC 9421 one
    // to the shared inbox, and one signed with a rotated key.
    for n in 1..=3 {
        let answer = signed(&http, &inbox, &activity(&actor, n), key, &key_id, false)?
            .send()
            .await?;
        ensure!(answer.status() == 202, "activity {n}: {}", answer.status());
    }
    let replay = signed(&http, &inbox, &activity(&actor, 2), key, &key_id, false)?
        .send()
        .await?;
    let replay: Value = serde_json::from_slice(&replay.bytes().await?)?;
    ensure!(replay["result"] == "existing", "{replay}");
    let shared = format!("{}/inbox", served.base);
    let answer = signed(&http, &shared, &activity(&actor, 4), key, &key_id, true)?
        .send()
        .await?;
    ensure!(answer.status() == 202, "RFC 9421: {}", answer.status());
    // The cached key is refetched once when a signature does not verify.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let rotated = rsa::RsaPrivateKey::new(&mut rand::thread_rng(), 1024)?;
    sender.rotate(&rotated)?;
    let answer = signed(&http, &inbox, &activity(&actor, 5), &rotated, &key_id, false)?
        .send()
        .await?;
    ensure!(answer.status() == 202, "after rotation: {}", answer.status());
    ensure!(
        laneway::destinations::views(queue.as_ref())
            .await?
            .iter()
            .any(|v| v.host == sender_host && v.state == "suspended"),
        "an inbound activity lifted an operator's suspension"
    );

    settle(queue.as_ref(), Duration::from_secs(20)).await?;
    served.running.stop().await?;
    let ops = queue.list(&all_ops()).await?;
    ensure!(ops.len() == 5, "one op per activity id: {ops:?}");
    ensure!(
        ops.iter().all(|o| o.lanes == vec![format!("sender:{actor}")]),
        "{ops:?}"
    );
    let by_activity = |n: u32| {
        ops.iter()
            .find(|o| o.idempotency_key.as_deref() == Some(&format!("{actor}/activities/{n}")))
            .cloned()
    };
    let first = by_activity(1).context("activity 1")?;
    ensure!(
        first.status == laneway::op::Status::Failed && first.attempts == 3,
        "{first:?}\n{:?}\n{:?}",
        app.requests(),
        queue.attempts(first.id).await?
    );
    let second = by_activity(2).context("activity 2")?;
    ensure!(
        second.status == laneway::op::Status::Confirmed && second.attempts == 2,
        "{second:?}"
    );
    let handed: Vec<String> = app
        .requests()
        .iter()
        .filter(|r| r["ok"] == true)
        .filter_map(|r| r["payload"]["activity"]["id"].as_str().map(str::to_owned))
        .collect();
    let want: Vec<String> = (2..=5).map(|n| format!("{actor}/activities/{n}")).collect();
    ensure!(handed == want, "in sender order, each once: {handed:?}");
    let refused = app
        .requests()
        .iter()
        .filter(|r| r["ok"] == false && r["error"] != "503")
        .count();
    ensure!(refused == 0, "every hand-off verifies with the reference library");
    Ok(())
}
