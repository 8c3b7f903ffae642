//! ActivityPub delivery end to end: the real `activitypub` plugin in the
//! host, signing through the host signer, against a fake inbox that checks
//! every signature, on SQLite and PostgreSQL.

mod authorized_fetch;
mod fake_inbox;
mod inbound;
mod inbound_keys;
mod independent;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{ensure, Context};
use axum::http::{HeaderMap, HeaderValue, Method, Uri};
use base64::Engine as _;
use laneway::fanout::{FanOut, Recipient};
use laneway::op::{AttemptClass, OpId, Status};
use laneway::queue::Enqueued;
use laneway::runtime::host::PluginHost;
use rsa::pkcs8::EncodePrivateKey as _;
use rsa::signature::{SignatureEncoding as _, Signer as _};
use sha2::Digest as _;

use crate::dispatch::harness::{settle, Running};
use crate::support::TestDb;
use fake_inbox::{FakeInbox, Reply};
use inbound::inbound_activities_are_verified_processed_once_in_sender_order_with_retries_and_dead_letters;
use independent::{
    an_accept_signature_challenge_is_learnt_and_an_ed25519_actor_signs_rfc9421,
    rewritten_urls_verify_with_third_party_libraries_and_the_knock_is_remembered,
};

const KEY_ID: &str = "https://cm.example/actor#main-key";
const ACTOR: &str = "https://cm.example/actor";

/// One RSA key for the whole run (generating one is slow): its PEM file and key.
pub(crate) fn actor_key() -> anyhow::Result<&'static (tempfile::TempDir, PathBuf, rsa::RsaPrivateKey)> {
    static KEY: OnceLock<(tempfile::TempDir, PathBuf, rsa::RsaPrivateKey)> = OnceLock::new();
    if let Some(k) = KEY.get() {
        return Ok(k);
    }
    let key = rsa::RsaPrivateKey::new(&mut rand::thread_rng(), 2048)?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("actor.pem");
    std::fs::write(&path, key.to_pkcs8_pem(Default::default())?.as_bytes())?;
    Ok(KEY.get_or_init(|| (dir, path, key)))
}

struct Ap {
    db: TestDb,
    fake: FakeInbox,
    base: String,
    running: Running,
    registry: std::sync::Arc<laneway::executor::Registry>,
    config: laneway::config::Config,
}

async fn setup(db: TestDb, kind_extra: &str) -> anyhow::Result<Ap> {
    setup_with(db, "", kind_extra).await
}

/// As [`setup`], with more top-level config (`[destinations]`, …).
async fn setup_with(db: TestDb, extra: &str, kind_extra: &str) -> anyhow::Result<Ap> {
    setup_signing(db, extra, kind_extra, "cavage").await
}

/// As [`setup_with`], choosing the plugin's `signature` setting.
async fn setup_signing(db: TestDb, extra: &str, kind_extra: &str, signature: &str) -> anyhow::Result<Ap> {
    let (_, pem, key) = actor_key()?;
    let fake = FakeInbox::default();
    fake.trust(KEY_ID, key.to_public_key());
    let base = fake.serve().await?;
    let config = laneway::config::from_layers(&[
        "[queue]\nlease_ms = 5000\n[dispatch]\npoll_ms = 25\nslot_ttl_ms = 2000\nshutdown_grace_ms = 300\n",
        extra,
        &format!(
            "[keys.actor]\nalgorithm = \"rsa-sha256\"\nfile = {:?}\n\
             [plugins.ap]\npath = {:?}\nallowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1\"]\nkeys = [\"actor\"]\n\
             [kinds.activitypub]\nplugin = \"ap\"\nbackoff_base_ms = 20\nbackoff_max_ms = 50\n\
             config = {{ key = \"actor\", key_id = \"{KEY_ID}\", signature = \"{signature}\" }}\n{kind_extra}",
            pem.display().to_string(),
            crate::runtime::wasm("activitypub")?.display().to_string(),
        ),
    ])?;
    let host = PluginHost::new(&config)?;
    host.apply(&config).await?;
    let running = Running::start(db.queue.clone(), host.registry(), config.clone()).await?;
    Ok(Ap {
        db,
        fake,
        base,
        running,
        registry: host.registry(),
        config,
    })
}

fn announce(id: &str, entry: u32) -> String {
    serde_json::json!({
        "@context": "https://www.w3.org/ns/activitystreams",
        "id": id,
        "type": "Announce",
        "actor": ACTOR,
        "object": { "type": "CaseLedgerEntry", "id": format!("urn:ledger:entry:{entry}"), "position": entry },
    })
    .to_string()
}

impl Ap {
    fn inbox(&self, who: &str) -> String {
        format!("{}/users/{who}/inbox", self.base)
    }

    async fn fan_out(&self, activity: String, to: &[String]) -> anyhow::Result<Vec<Enqueued>> {
        Ok(self
            .running
            .dispatcher
            .fan_out(&FanOut {
                kind: "activitypub".into(),
                actor: ACTOR.into(),
                activity,
                recipients: to.iter().map(|r| Recipient::parse(r)).collect(),
                priority: None,
                subject: None,
            })
            .await?
            .0)
    }
}

/// Ledger positions that reached `who`, in arrival order.
fn positions(fake: &FakeInbox, who: &str) -> Vec<u64> {
    fake.arrivals(&format!("/users/{who}/inbox"))
        .iter()
        .filter_map(|a| a.body["object"]["position"].as_u64())
        .collect()
}

crate::on_both_backends!(
    live:
    seed_000_fvcv_every_participant_gets_the_ledger_in_chain_order,
    a_hanging_inbox_delays_only_itself,
    a_server_that_never_answers_earns_requests_only_by_patience,
    hung_servers_past_slow_after_leave_their_places_to_live_inboxes,
    two_500s_then_202_keep_order_and_record_the_failures,
    gone_dead_letters_with_its_ledger_entry_and_429_waits_as_asked,
    a_shared_inbox_gets_one_post_for_five_recipients,
    a_replayed_announce_already_pending_is_declined,
    inbox_urls_the_client_rewrites_are_signed_as_sent_and_a_big_202_confirms,
    a_reboost_after_an_undo_of_a_pending_announce_is_delivered_last,
    a_host_failing_past_the_unavailable_period_is_held_probed_and_resumes_on_success,
    an_attempt_planned_on_a_stale_view_never_dead_letters_an_op_of_a_held_host,
    a_personal_inbox_410_is_skipped_later_and_a_shared_inbox_410_suspends_its_host,
    rewritten_urls_verify_with_third_party_libraries_and_the_knock_is_remembered,
    an_accept_signature_challenge_is_learnt_and_an_ed25519_actor_signs_rfc9421,
    inbound_activities_are_verified_processed_once_in_sender_order_with_retries_and_dead_letters,
    a_destination_rate_limit_is_shared_by_every_host,
    a_probe_lets_only_itself_through_to_a_held_host,
    first_contact_knocks_once_per_host_and_a_failing_host_is_not_knocked_twice,
);

async fn seed_000_fvcv_every_participant_gets_the_ledger_in_chain_order(db: TestDb) -> anyhow::Result<()> {
    let ap = setup(db, "").await?;
    let (finder, coord, vendor) = (ap.inbox("finder"), ap.inbox("coordinator"), ap.inbox("vendor"));
    // A 14-entry backfill to the Coordinator, then new entries to everyone.
    for n in 0..14 {
        ap.fan_out(
            announce(&format!("{ACTOR}/backfill/{n}"), n),
            std::slice::from_ref(&coord),
        )
        .await?;
    }
    for n in 14..20 {
        ap.fan_out(
            announce(&format!("{ACTOR}/announce/{n}"), n),
            &[finder.clone(), coord.clone(), vendor.clone()],
        )
        .await?;
    }
    // A busy Coordinator fails a couple of times on the way.
    ap.fake.script(
        "/users/coordinator/inbox",
        [
            Reply::Accept,
            Reply::Accept,
            Reply::Status(500),
            Reply::Accept,
            Reply::Status(503),
        ],
    );
    for _ in 0..8 {
        ap.running.dispatcher.trigger(ACTOR);
    }
    settle(ap.db.queue.as_ref(), Duration::from_secs(30)).await?;
    ap.running.stop().await?;
    ensure!(
        ap.fake.rejections().is_empty(),
        "signature checks failed: {:?}",
        ap.fake.rejections()
    );
    ensure!(
        positions(&ap.fake, "coordinator") == (0..20).collect::<Vec<_>>(),
        "{:?}",
        positions(&ap.fake, "coordinator")
    );
    ensure!(
        positions(&ap.fake, "finder") == (14..20).collect::<Vec<_>>(),
        "{:?}",
        positions(&ap.fake, "finder")
    );
    ensure!(
        positions(&ap.fake, "vendor") == (14..20).collect::<Vec<_>>(),
        "{:?}",
        positions(&ap.fake, "vendor")
    );
    ensure!(ap.fake.duplicates() == 0, "{} duplicates", ap.fake.duplicates());
    Ok(())
}

async fn a_hanging_inbox_delays_only_itself(db: TestDb) -> anyhow::Result<()> {
    let ap = setup(db, "").await?;
    ap.fake
        .script("/users/slow/inbox", [Reply::Hang(Duration::from_secs(30))]);
    let to = [ap.inbox("slow"), ap.inbox("b"), ap.inbox("c")];
    for n in 0..5 {
        ap.fan_out(announce(&format!("{ACTOR}/announce/{n}"), n), &to).await?;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while positions(&ap.fake, "b").len() < 5 || positions(&ap.fake, "c").len() < 5 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "b {:?} c {:?}",
            positions(&ap.fake, "b"),
            positions(&ap.fake, "c")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ensure!(positions(&ap.fake, "slow").is_empty(), "the hanging inbox moved");
    ensure!(
        ap.fake.posts("/users/slow/inbox") == 1,
        "only the hanging request went to it"
    );
    ap.running.stop().await?;
    Ok(())
}

/// Six inboxes on one server that never answers: one request goes at
/// once, a second after the default patience of 1 s, a third after 2 s
/// more, never more than that schedule allows, instead of all six (under
/// the cap of 8) held until the timeout.
async fn a_server_that_never_answers_earns_requests_only_by_patience(db: TestDb) -> anyhow::Result<()> {
    let ap = setup(db, "").await?;
    let to: Vec<String> = (0..6).map(|i| ap.inbox(&format!("hung{i}"))).collect();
    for i in 0..6 {
        ap.fake
            .script(&format!("/users/hung{i}/inbox"), [Reply::Hang(Duration::from_secs(30))]);
    }
    let posts = || {
        (0..6)
            .map(|i| ap.fake.posts(&format!("/users/hung{i}/inbox")))
            .sum::<usize>()
    };
    // The patience runs from the first request, which is no earlier than this.
    let start = tokio::time::Instant::now();
    ap.fan_out(announce(&format!("{ACTOR}/announce/0"), 0), &to).await?;
    let allowed = |waited: Duration| match waited.as_millis() {
        0..1000 => 1,
        1000..3000 => 2,
        _ => 3,
    };
    let mut seen = 0;
    while start.elapsed() < Duration::from_secs(6) {
        let now = posts();
        let waited = start.elapsed();
        ensure!(
            now <= allowed(waited),
            "{now} requests after {waited:?}, {} allowed",
            allowed(waited)
        );
        seen = now;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ensure!(seen == 3, "after 6 s the server had {seen} requests, not 3");
    ap.running.stop().await?;
    Ok(())
}

/// Four servers that never answer, each on a host of its own, fill an
/// outbox's cap of four before eight live inboxes: past the kind's
/// `slow_after_ms` their attempts give the places back, and the live
/// inboxes are delivered while the hung requests still wait (without it,
/// not before the 20 s timeout).
async fn hung_servers_past_slow_after_leave_their_places_to_live_inboxes(db: TestDb) -> anyhow::Result<()> {
    let ap = setup_with(
        db,
        "[dispatch]\noutbox_max_in_flight = 4\nmax_slow = 16\n",
        "slow_after_ms = 300\ntimeout_ms = 20000\n",
    )
    .await?;
    let mut to = Vec::new();
    for i in 0..4 {
        let path = format!("/users/hung{i}/inbox");
        ap.fake.script(&path, [Reply::Hang(Duration::from_secs(30))]);
        to.push(format!("{}{path}", ap.fake.serve().await?));
    }
    let live: Vec<String> = (0..8).map(|i| format!("live{i}")).collect();
    to.extend(live.iter().map(|who| ap.inbox(who)));
    let start = tokio::time::Instant::now();
    ap.fan_out(announce(&format!("{ACTOR}/announce/0"), 0), &to).await?;
    let delivered = || live.iter().filter(|who| !positions(&ap.fake, who).is_empty()).count();
    while delivered() < live.len() && start.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = start.elapsed();
    ensure!(
        delivered() == live.len(),
        "{} of {} live inboxes delivered in {took:?}",
        delivered(),
        live.len()
    );
    let hung: Vec<usize> = (0..4)
        .map(|i| ap.fake.posts(&format!("/users/hung{i}/inbox")))
        .collect();
    ensure!(
        hung == vec![1; 4],
        "each hung server has its one request, still waiting: {hung:?}"
    );
    ensure!(
        ap.running.dispatcher.slow_in_use() == 4,
        "the four hung attempts wait among the slow, not the permits: {}",
        ap.running.dispatcher.slow_in_use()
    );
    ap.running.stop().await?;
    Ok(())
}

async fn two_500s_then_202_keep_order_and_record_the_failures(db: TestDb) -> anyhow::Result<()> {
    let ap = setup(db, "").await?;
    ap.fake
        .script("/users/a/inbox", [Reply::Status(500), Reply::Status(500)]);
    let mut first: Option<OpId> = None;
    for n in 0..3 {
        let r = ap
            .fan_out(announce(&format!("{ACTOR}/announce/{n}"), n), &[ap.inbox("a")])
            .await?;
        first.get_or_insert(r[0].id());
    }
    settle(ap.db.queue.as_ref(), Duration::from_secs(15)).await?;
    ap.running.stop().await?;
    ensure!(
        positions(&ap.fake, "a") == vec![0, 1, 2],
        "{:?}",
        positions(&ap.fake, "a")
    );
    let history = ap.db.queue.attempts(first.context("op")?).await?;
    let summary: Vec<(AttemptClass, Option<String>)> = history
        .iter()
        .map(|a| (a.record.class, a.record.detail.clone()))
        .collect();
    ensure!(
        summary
            == vec![
                (AttemptClass::Retryable, Some("500".into())),
                (AttemptClass::Retryable, Some("500".into())),
                (AttemptClass::Confirmed, Some("202".into()))
            ],
        "{summary:?}"
    );
    ensure!(ap.fake.rejections().is_empty());
    Ok(())
}

async fn gone_dead_letters_with_its_ledger_entry_and_429_waits_as_asked(db: TestDb) -> anyhow::Result<()> {
    let ap = setup(db, "").await?;
    ap.fake.script("/users/gone/inbox", [Reply::Status(410)]);
    ap.fake.script("/users/busy/inbox", [Reply::TooMany("2".into())]);
    let gone = ap
        .fan_out(announce(&format!("{ACTOR}/announce/7"), 7), &[ap.inbox("gone")])
        .await?[0]
        .id();
    let busy = ap
        .fan_out(announce(&format!("{ACTOR}/announce/8"), 8), &[ap.inbox("busy")])
        .await?[0]
        .id();
    settle(ap.db.queue.as_ref(), Duration::from_secs(15)).await?;
    ap.running.stop().await?;
    let dead = ap.db.queue.get(gone).await?.context("op")?;
    ensure!(dead.status == Status::Failed && dead.attempts == 1, "{dead:?}");
    ensure!(dead.correlation_id.as_deref() == Some("urn:ledger:entry:7"), "{dead:?}");
    ensure!(
        dead.last_error.as_deref().is_some_and(|e| e.starts_with("HTTP 410")),
        "{dead:?}"
    );
    let history = ap.db.queue.attempts(busy).await?;
    ensure!(
        history.len() == 2 && history[0].record.detail.as_deref() == Some("429"),
        "{history:?}"
    );
    let waited = history[1].record.started_at - history[0].record.finished_at;
    ensure!(waited >= chrono::Duration::seconds(2), "retried after {waited}");
    Ok(())
}

async fn a_shared_inbox_gets_one_post_for_five_recipients(db: TestDb) -> anyhow::Result<()> {
    let ap = setup(db, "").await?;
    let shared = format!("{}/inbox", ap.base);
    let recipients: Vec<String> = (0..5)
        .map(|i| format!("{}={shared}", ap.inbox(&format!("u{i}"))))
        .collect();
    let ops = ap
        .fan_out(announce(&format!("{ACTOR}/announce/1"), 1), &recipients)
        .await?;
    ensure!(ops.len() == 1, "{ops:?}");
    settle(ap.db.queue.as_ref(), Duration::from_secs(10)).await?;
    ap.running.stop().await?;
    ensure!(ap.fake.posts("/inbox") == 1);
    ensure!((0..5).all(|i| ap.fake.posts(&format!("/users/u{i}/inbox")) == 0));
    Ok(())
}

async fn a_replayed_announce_already_pending_is_declined(db: TestDb) -> anyhow::Result<()> {
    let ap = setup(db, "").await?;
    ap.fake
        .script("/users/coordinator/inbox", [Reply::Hang(Duration::from_secs(30))]);
    let coord = ap.inbox("coordinator");
    let first = ap
        .fan_out(
            announce(&format!("{ACTOR}/announce/5"), 5),
            std::slice::from_ref(&coord),
        )
        .await?;
    ensure!(matches!(first.as_slice(), [Enqueued::Created(_)]), "{first:?}");
    // A Reject-triggered replay of the same entry while it is still pending.
    let replay = ap
        .fan_out(announce(&format!("{ACTOR}/replay/5"), 5), std::slice::from_ref(&coord))
        .await?;
    ensure!(replay == vec![Enqueued::AlreadyPending(first[0].id())], "{replay:?}");
    // The same activity again is the same op (idempotent per inbox).
    let again = ap
        .fan_out(announce(&format!("{ACTOR}/announce/5"), 5), &[coord])
        .await?;
    ensure!(again == vec![Enqueued::Existing(first[0].id())], "{again:?}");
    ap.running.stop().await?;
    Ok(())
}

/// The fake's check can fail: a correctly signed request passes, a tampered
/// body, a different path or an unknown key does not.
#[test]
fn the_fake_inbox_rejects_wrongly_signed_requests() -> anyhow::Result<()> {
    let (_, _, key) = actor_key()?;
    let fake = FakeInbox::default();
    fake.trust(KEY_ID, key.to_public_key());
    let body = br#"{"id":"x","type":"Create"}"#;
    let sign = |path: &str, body: &[u8], key_id: &str| -> anyhow::Result<HeaderMap> {
        let date = httpdate::fmt_http_date(std::time::SystemTime::now());
        let digest = format!(
            "SHA-256={}",
            base64::engine::general_purpose::STANDARD.encode(sha2::Sha256::digest(body))
        );
        let text = format!("(request-target): post {path}\nhost: inbox.example\ndate: {date}\ndigest: {digest}");
        let signer = rsa::pkcs1v15::SigningKey::<sha2::Sha256>::new(key.clone());
        let signature = base64::engine::general_purpose::STANDARD.encode(signer.sign(text.as_bytes()).to_vec());
        let mut headers = HeaderMap::new();
        headers.insert("host", HeaderValue::from_static("inbox.example"));
        headers.insert("date", HeaderValue::from_str(&date)?);
        headers.insert("digest", HeaderValue::from_str(&digest)?);
        headers.insert(
            "signature",
            HeaderValue::from_str(&format!(
                "keyId=\"{key_id}\",algorithm=\"rsa-sha256\",headers=\"(request-target) host date digest\",signature=\"{signature}\""
            ))?,
        );
        Ok(headers)
    };
    let uri: Uri = "/users/a/inbox".parse()?;
    let good = sign("/users/a/inbox", body, KEY_ID)?;
    ensure!(fake.verify(&Method::POST, &uri, &good, body).is_ok());
    ensure!(fake.verify(&Method::POST, &uri, &good, br#"{"id":"y"}"#) == Err("digest mismatch".into()));
    let elsewhere = sign("/users/b/inbox", body, KEY_ID)?;
    ensure!(fake.verify(&Method::POST, &uri, &elsewhere, body) == Err("bad signature".into()));
    let stranger = sign("/users/a/inbox", body, "https://evil.example/key")?;
    ensure!(fake
        .verify(&Method::POST, &uri, &stranger, body)
        .is_err_and(|e| e.contains("unknown keyId")));
    Ok(())
}

/// Inbox URLs an HTTP client rewrites before sending (non-ASCII, a space,
/// a dot segment, a fragment) are signed as they are sent, so the inbox
/// verifies every one; and a 202 whose body is over the host's response cap
/// (2 MiB against 1 MiB) is a delivery, not a failure.
async fn inbox_urls_the_client_rewrites_are_signed_as_sent_and_a_big_202_confirms(db: TestDb) -> anyhow::Result<()> {
    let ap = setup(db, "").await?;
    let shapes = [
        ("/users/josé/inbox", "/users/jos%C3%A9/inbox"),
        ("/users/a b/inbox", "/users/a%20b/inbox"),
        ("/users/x/../y/inbox", "/users/y/inbox"),
        ("/users/z/inbox#main-key", "/users/z/inbox"),
        ("/users/q/inbox?tenant=1&b=2", "/users/q/inbox"),
    ];
    ap.fake.script("/users/big/inbox", [Reply::BigAccept(2 * 1024 * 1024)]);
    let mut to: Vec<String> = shapes.iter().map(|(given, _)| format!("{}{given}", ap.base)).collect();
    to.push(ap.inbox("big"));
    let results = ap.fan_out(announce("https://cm.example/a/url-shapes", 1), &to).await?;
    ensure!(results.len() == shapes.len() + 1, "{results:?}");
    // An op enqueued with a raw lane (as a plain-SQL producer may) too.
    let mut raw = laneway::queue::NewOp::new(ACTOR, "activitypub", announce("https://cm.example/a/raw", 2));
    raw.lanes = vec![format!("{}/users/r/./inbox#frag", ap.base)];
    ap.running.dispatcher.enqueue(&[raw]).await?;
    settle(ap.db.queue.as_ref(), Duration::from_secs(20)).await?;
    ensure!(ap.fake.rejections().is_empty(), "refused: {:?}", ap.fake.rejections());
    for (given, sent) in shapes {
        ensure!(ap.fake.arrivals(sent).len() == 1, "{given} did not arrive as {sent}");
    }
    ensure!(ap.fake.arrivals("/users/r/inbox").len() == 1, "the raw lane's op");
    let ops = ap
        .db
        .queue
        .list(&laneway::queue::OpFilter {
            limit: 100,
            ..Default::default()
        })
        .await?;
    for op in &ops {
        ensure!(
            op.status == Status::Confirmed && op.attempts == 1,
            "every op delivered on its first attempt: {op:?}"
        );
    }
    let big = ops
        .iter()
        .find(|o| o.lanes[0].ends_with("/users/big/inbox"))
        .context("the big inbox's op")?;
    let attempts = ap.db.queue.attempts(big.id).await?;
    ensure!(attempts[0].record.detail.as_deref() == Some("202"), "{attempts:?}");
    ap.running.stop().await
}

/// Announce#1 of an entry is still pending to a slow inbox when it is
/// undone and the entry boosted again: the Undo releases Announce#1's
/// coalescing, so Announce#2 is queued (not declined as already pending)
/// and the inbox ends on the re-boost.
async fn a_reboost_after_an_undo_of_a_pending_announce_is_delivered_last(db: TestDb) -> anyhow::Result<()> {
    let ap = setup(db, "").await?;
    ap.fake
        .script("/users/slow/inbox", [Reply::Hang(Duration::from_millis(800))]);
    let slow = ap.inbox("slow");
    let first_id = format!("{ACTOR}/announce/7");
    let first = ap.fan_out(announce(&first_id, 7), std::slice::from_ref(&slow)).await?;
    ensure!(matches!(first.as_slice(), [Enqueued::Created(_)]), "{first:?}");
    let undo = serde_json::json!({
        "@context": "https://www.w3.org/ns/activitystreams",
        "id": format!("{ACTOR}/undo/7"),
        "type": "Undo",
        "actor": ACTOR,
        "object": { "id": first_id, "type": "Announce" },
    })
    .to_string();
    let undone = ap.fan_out(undo, std::slice::from_ref(&slow)).await?;
    ensure!(matches!(undone.as_slice(), [Enqueued::Created(_)]), "{undone:?}");
    let again = ap
        .fan_out(
            announce(&format!("{ACTOR}/announce/7b"), 7),
            std::slice::from_ref(&slow),
        )
        .await?;
    ensure!(
        matches!(again.as_slice(), [Enqueued::Created(_)]),
        "the re-boost was declined: {again:?}"
    );
    settle(ap.db.queue.as_ref(), Duration::from_secs(20)).await?;
    let arrived: Vec<(String, String)> = ap
        .fake
        .arrivals("/users/slow/inbox")
        .iter()
        .map(|a| {
            (
                a.body["type"].as_str().unwrap_or("").to_owned(),
                a.body["id"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    let types: Vec<&str> = arrived.iter().map(|(t, _)| t.as_str()).collect();
    ensure!(types == ["Announce", "Undo", "Announce"], "{arrived:?}");
    ensure!(
        arrived[2].1 == format!("{ACTOR}/announce/7b"),
        "ends on the re-boost: {arrived:?}"
    );
    ap.running.stop().await
}

/// Settings that make the unavailable period short and the breaker inert,
/// so the shared health alone decides.
const HEALTH_FAST: &str = "[destinations]\nunavailable_after_ms = 400\nprobe_every_ms = 1000\n\
                           [dispatch.breaker]\nthreshold = 100000\n";

async fn a_host_failing_past_the_unavailable_period_is_held_probed_and_resumes_on_success(
    db: TestDb,
) -> anyhow::Result<()> {
    // The budget is spent before the host is unavailable: the probes go
    // past it and the op is still not dead-lettered.
    let fast = "[destinations]\nunavailable_after_ms = 1\nprobe_every_ms = 1000\n\
                [dispatch.breaker]\nthreshold = 100000\n";
    let ap = setup_with(db, fast, "max_attempts = 3\n").await?;
    ap.fake
        .script("/users/down/inbox", std::iter::repeat_n(Reply::Status(503), 100_000));
    let mut ops = Vec::new();
    for n in 1..=3 {
        ops.push(
            ap.fan_out(announce(&format!("{ACTOR}/announce/{n}"), n), &[ap.inbox("down")])
                .await?[0]
                .id(),
        );
    }
    let queue = ap.db.queue.as_ref();
    let host = ap.base.trim_start_matches("http://").to_owned();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let unavailable = loop {
        let views = laneway::destinations::views(queue).await?;
        if let Some(v) = views.into_iter().find(|v| v.host == host && v.state == "unavailable") {
            break v;
        }
        ensure!(tokio::time::Instant::now() < deadline, "never marked unavailable");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    ensure!(
        unavailable.failures >= 2 && unavailable.next_probe_at.is_some(),
        "{unavailable:?}"
    );
    // Held: only the probes, 1 s apart, go; they go on past the attempt
    // budget (the head passes 3 attempts) and nothing is dead-lettered.
    let before = ap.fake.posts("/users/down/inbox");
    let started = tokio::time::Instant::now();
    let deadline = started + Duration::from_secs(10);
    loop {
        let head = queue.get(ops[0]).await?.context("op")?;
        if head.attempts > 4 {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the probes did not go past the budget: {head:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let probes = ap.fake.posts("/users/down/inbox") - before;
    let allowed = usize::try_from(started.elapsed().as_secs()).unwrap_or(usize::MAX) + 2;
    ensure!(
        (1..=allowed).contains(&probes),
        "{probes} posts while held in {:?}",
        started.elapsed()
    );
    for id in &ops {
        let op = queue.get(*id).await?.context("op")?;
        ensure!(!op.status.is_terminal(), "held, not dead-lettered: {op:?}");
    }
    // The host comes back: the next probe succeeds and the backlog goes in order.
    ap.fake.clear_script("/users/down/inbox");
    settle(queue, Duration::from_secs(15)).await?;
    ap.running.stop().await?;
    ensure!(
        positions(&ap.fake, "down") == vec![1, 2, 3],
        "{:?}",
        positions(&ap.fake, "down")
    );
    ensure!(
        laneway::destinations::views(queue)
            .await?
            .iter()
            .all(|v| v.host != host),
        "the health record is cleared by the success"
    );
    Ok(())
}

/// The intermittent failure of the test above, made deterministic: an
/// attempt planned on a view of destination health older than the record
/// (here another host marked the destination unavailable, and this host's
/// view is read again only hourly; in CI it was this host's own write not
/// yet read back) fails against it with the op's last attempt. The record
/// holds the host, so the op waits for its probe: it is not dead-lettered.
async fn an_attempt_planned_on_a_stale_view_never_dead_letters_an_op_of_a_held_host(db: TestDb) -> anyhow::Result<()> {
    let stale = "[destinations]\nunavailable_after_ms = 1\nprobe_every_ms = 60000\nhealth_refresh_ms = 3600000\n\
                 [dispatch.breaker]\nthreshold = 100000\n";
    let ap = setup_with(db, stale, "max_attempts = 1\n").await?;
    ap.fake
        .script("/users/down/inbox", std::iter::repeat_n(Reply::Status(503), 1_000));
    let queue = ap.db.queue.as_ref();
    let host = ap.base.trim_start_matches("http://").to_owned();
    // This host's view is read once more (a change of its own asks for
    // that), and then not for an hour.
    ap.running
        .dispatcher
        .suspend_destination("marker.example", "test", "test")
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while ap.running.dispatcher.destination_health("marker.example").is_none() {
        ensure!(tokio::time::Instant::now() < deadline, "the view was never read");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A read asked for while the start-up read ran follows it at once.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Another host saw it fail, then fail again: unavailable in the record.
    let metrics = laneway::events::Metrics::default();
    let health = ap.config.destinations.health();
    let t0 = chrono::Utc::now();
    for at in [t0, t0 + chrono::Duration::milliseconds(5)] {
        laneway::destinations::apply(
            queue,
            &metrics,
            &host,
            &[laneway::health::Event::Failed { error: "503" }],
            "another host",
            at,
            &health,
        )
        .await?;
    }
    ensure!(
        laneway::destinations::view(queue, &host)
            .await?
            .is_some_and(|v| v.state == "unavailable"),
        "the record does not hold the host"
    );
    let id = ap
        .fan_out(announce(&format!("{ACTOR}/announce/stale"), 1), &[ap.inbox("down")])
        .await?[0]
        .id();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let op = loop {
        let op = queue.get(id).await?.context("op")?;
        if op.attempts >= 1 && op.status != Status::Submitted {
            break op;
        }
        ensure!(tokio::time::Instant::now() < deadline, "never attempted: {op:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    ensure!(
        op.status == Status::Pending,
        "an op of a held host was dead-lettered on a stale view: {op:?}"
    );
    ap.running.stop().await
}

/// Many inboxes on one unavailable host: each probe interval lets exactly
/// one op through (the probe), not every lane that was ready with it.
async fn a_probe_lets_only_itself_through_to_a_held_host(db: TestDb) -> anyhow::Result<()> {
    let fast = "[destinations]\nunavailable_after_ms = 1\nprobe_every_ms = 1000\n\
                [dispatch.breaker]\nthreshold = 100000\n";
    let ap = setup_with(db, fast, "max_attempts = 50\n").await?;
    let who: Vec<String> = (1..=8).map(|n| format!("down{n}")).collect();
    for w in &who {
        ap.fake.script(
            &format!("/users/{w}/inbox"),
            std::iter::repeat_n(Reply::Status(503), 100_000),
        );
    }
    let inboxes: Vec<String> = who.iter().map(|w| ap.inbox(w)).collect();
    for n in 1..=3 {
        ap.fan_out(announce(&format!("{ACTOR}/announce/{n}"), n), &inboxes)
            .await?;
    }
    let queue = ap.db.queue.as_ref();
    let host = ap.base.trim_start_matches("http://").to_owned();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while !laneway::destinations::views(queue)
        .await?
        .iter()
        .any(|v| v.host == host && v.state == "unavailable")
    {
        ensure!(tokio::time::Instant::now() < deadline, "never marked unavailable");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let in-flight attempts that started before the hold finish.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let total = |ap: &Ap| {
        who.iter()
            .map(|w| ap.fake.posts(&format!("/users/{w}/inbox")))
            .sum::<usize>()
    };
    let before = total(&ap);
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let during = total(&ap) - before;
    ap.running.stop().await?;
    ensure!(
        (1..=4).contains(&during),
        "{during} posts to a held host in 3.2 s (probes 1 s apart)"
    );
    Ok(())
}

/// A fan-out's first contact with a host that accepts only draft-cavage
/// costs one refused RFC 9421 knock, not one per inbox; and a host that
/// refuses RFC 9421 and then fails is not knocked twice on every attempt.
async fn first_contact_knocks_once_per_host_and_a_failing_host_is_not_knocked_twice(db: TestDb) -> anyhow::Result<()> {
    let ap = setup_signing(db, "", "max_attempts = 3\n", "double-knock").await?;
    let inboxes: Vec<String> = (1..=30).map(|n| ap.inbox(&format!("u{n}"))).collect();
    ap.fan_out(announce(&format!("{ACTOR}/announce/1"), 1), &inboxes)
        .await?;
    settle(ap.db.queue.as_ref(), Duration::from_secs(20)).await?;
    let knocks = ap.fake.rejections().len();
    let delivered: usize = (1..=30)
        .map(|n| ap.fake.arrivals(&format!("/users/u{n}/inbox")).len())
        .sum();
    ensure!(delivered == 30, "{delivered} of 30 delivered");
    ensure!(
        knocks == 1,
        "{knocks} refused knocks for one host: {:?}",
        ap.fake.rejections()
    );

    // Another host: refuses RFC 9421 (401), and answers draft-cavage with 503.
    let (_, _, key) = actor_key()?;
    let failing = FakeInbox::default();
    failing.trust(KEY_ID, key.to_public_key());
    let base = failing.serve().await?;
    failing.script("/users/f/inbox", std::iter::repeat_n(Reply::Status(503), 100));
    let id = ap
        .fan_out(
            announce(&format!("{ACTOR}/announce/2"), 2),
            &[format!("{base}/users/f/inbox")],
        )
        .await?[0]
        .id();
    settle(ap.db.queue.as_ref(), Duration::from_secs(20)).await?;
    ap.running.stop().await?;
    let op = ap.db.queue.get(id).await?.context("op")?;
    ensure!(op.attempts == 3, "{op:?}");
    let posts = failing.posts("/users/f/inbox");
    ensure!(
        failing.rejections().len() == 1 && posts == 4,
        "{posts} requests for 3 attempts ({} knocks refused)",
        failing.rejections().len()
    );
    Ok(())
}

async fn a_personal_inbox_410_is_skipped_later_and_a_shared_inbox_410_suspends_its_host(
    db: TestDb,
) -> anyhow::Result<()> {
    let ap = setup_with(db, HEALTH_FAST, "").await?;
    let queue = ap.db.queue.as_ref();
    ap.fake.script("/users/gone/inbox", [Reply::Status(410)]);
    ap.fan_out(announce(&format!("{ACTOR}/announce/1"), 1), &[ap.inbox("gone")])
        .await?;
    settle(queue, Duration::from_secs(10)).await?;
    // Health is recorded just after the settle commits.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while laneway::destinations::gone_inboxes(queue).await?.is_empty() {
        ensure!(tokio::time::Instant::now() < deadline, "the 410 was never remembered");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Remembered: the next fan-out leaves it out and says so.
    let (results, planned) = ap
        .running
        .dispatcher
        .fan_out(&FanOut {
            kind: "activitypub".into(),
            actor: ACTOR.into(),
            activity: announce(&format!("{ACTOR}/announce/2"), 2),
            recipients: vec![
                Recipient::parse(&ap.inbox("gone")),
                Recipient::parse(&ap.inbox("alive")),
            ],
            priority: None,
            subject: None,
        })
        .await?;
    ensure!(planned.gone == vec![ap.inbox("gone")], "{planned:?}");
    ensure!(
        results.len() == 1 && planned.ops[0].lanes == vec![ap.inbox("alive")],
        "{planned:?}"
    );
    settle(queue, Duration::from_secs(10)).await?;
    ensure!(ap.fake.posts("/users/gone/inbox") == 1);
    let host = ap.base.trim_start_matches("http://").to_owned();
    ensure!(
        laneway::destinations::views(queue)
            .await?
            .iter()
            .all(|v| v.host != host),
        "a personal inbox's 410 does not hold its host"
    );
    // A shared inbox's 410 suspends the whole host.
    let shared = format!("{}/inbox", ap.base);
    ap.fake.script("/inbox", [Reply::Status(410)]);
    let to = format!("{}={shared}", ap.inbox("u1"));
    ap.fan_out(announce(&format!("{ACTOR}/announce/3"), 3), std::slice::from_ref(&to))
        .await?;
    settle(queue, Duration::from_secs(10)).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let views = laneway::destinations::views(queue).await?;
        if views.iter().any(|v| v.host == host && v.state == "suspended") {
            break;
        }
        ensure!(tokio::time::Instant::now() < deadline, "never suspended: {views:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Held while suspended: a new op waits, with no attempt.
    let held = ap
        .fan_out(announce(&format!("{ACTOR}/announce/4"), 4), &[ap.inbox("alive")])
        .await?[0]
        .id();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let op = queue.get(held).await?.context("op")?;
    ensure!(op.status == Status::Pending && op.attempts == 0, "{op:?}");
    // The operator resumes it: the held op goes, and the gone inbox is forgotten.
    let (_, after, forgotten) = ap.running.dispatcher.resume_destination(&host, "test").await?;
    ensure!(
        after.is_clear() && forgotten == vec![ap.inbox("gone")],
        "{after:?} {forgotten:?}"
    );
    settle(queue, Duration::from_secs(10)).await?;
    ap.running.stop().await?;
    ensure!(
        positions(&ap.fake, "alive") == vec![2, 4],
        "{:?}",
        positions(&ap.fake, "alive")
    );
    Ok(())
}

async fn a_destination_rate_limit_is_shared_by_every_host(db: TestDb) -> anyhow::Result<()> {
    let ap = setup_with(db, "[destinations]\nrate_per_second = 5.0\nrate_burst = 1\n", "").await?;
    // A second host on the same database, drawing from the same buckets.
    let other = Running::start(ap.db.queue.clone(), ap.registry.clone(), ap.config.clone()).await?;
    let second_actor = "https://cm.example/second";
    for n in 0..6u32 {
        ap.fan_out(
            announce(&format!("{ACTOR}/announce/{n}"), n),
            &[ap.inbox(&format!("a{n}"))],
        )
        .await?;
        other
            .dispatcher
            .fan_out(&FanOut {
                kind: "activitypub".into(),
                actor: second_actor.into(),
                activity: announce(&format!("{second_actor}/announce/{n}"), n),
                recipients: vec![Recipient::parse(&ap.inbox(&format!("b{n}")))],
                priority: None,
                subject: None,
            })
            .await?;
    }
    settle(ap.db.queue.as_ref(), Duration::from_secs(20)).await?;
    other.stop().await?;
    ap.running.stop().await?;
    let mut times: Vec<std::time::Instant> = ap.fake.all_arrivals().iter().map(|a| a.at).collect();
    times.sort();
    ensure!(times.len() == 12, "{} arrivals", times.len());
    // Twelve requests at 5 a second with a burst of one take 11 intervals of
    // 200 ms; no second ever saw more than six.
    let span = times[11] - times[0];
    ensure!(span >= Duration::from_millis(2000), "12 requests in {span:?}");
    for (i, start) in times.iter().enumerate() {
        let in_window = times[i..]
            .iter()
            .take_while(|t| **t - *start < Duration::from_secs(1))
            .count();
        ensure!(in_window <= 6, "{in_window} requests within one second");
    }
    Ok(())
}
