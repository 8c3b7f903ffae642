//! ActivityPub signatures checked by code laneway did not write: a Node
//! inbox (`tests/tools/ap-inbox`, run as its own process) verifying
//! draft-cavage with joyent's `http-signature` and RFC 9421 with
//! `http-message-signatures`. Covers the URL shapes a client rewrites, the
//! double-knock and its memory, an `Accept-Signature` challenge, and an
//! Ed25519 actor.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{ensure, Context};
use ed25519_dalek::pkcs8::{EncodePrivateKey as _, EncodePublicKey as _};
use laneway::fanout::{FanOut, Recipient};
use laneway::runtime::host::PluginHost;
use serde_json::Value;

use super::{actor_key, announce, ACTOR, KEY_ID};
use crate::dispatch::harness::{settle, Running};
use crate::support::TestDb;

const ED_ACTOR: &str = "https://cm.example/ed";
const ED_KEY_ID: &str = "https://cm.example/ed#main-key";

/// The Node inbox, killed when dropped.
pub(super) struct NodeInbox {
    child: std::process::Child,
    pub(super) base: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for NodeInbox {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl NodeInbox {
    pub(super) fn start(keys: &Value, flags: &[&str]) -> anyhow::Result<Self> {
        use std::io::BufRead as _;
        let dir = tempfile::tempdir()?;
        let keys_file = dir.path().join("keys.json");
        std::fs::write(&keys_file, keys.to_string())?;
        let log = dir.path().join("requests.jsonl");
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tools/ap-inbox/inbox.js");
        let mut child = std::process::Command::new("node")
            .arg(script)
            .arg(&keys_file)
            .arg(&log)
            .args(flags)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .context("node for the independent inbox")?;
        let stdout = child.stdout.take().context("its stdout")?;
        let mut line = String::new();
        std::io::BufReader::new(stdout).read_line(&mut line)?;
        let port: u16 = line.trim().parse().with_context(|| {
            format!("the Node inbox did not start (./dev test installs its packages with npm ci): {line:?}")
        })?;
        Ok(Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            log,
            _dir: dir,
        })
    }

    fn host(&self) -> &str {
        self.base.trim_start_matches("http://")
    }

    pub(super) fn requests(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

/// Both actors' public keys, as the Node inbox looks them up by keyId.
fn trusted(ed: &ed25519_dalek::SigningKey) -> anyhow::Result<Value> {
    let (_, _, rsa) = actor_key()?;
    Ok(serde_json::json!({
        KEY_ID: { "pem": rsa.to_public_key().to_public_key_pem(Default::default())?, "alg": "rsa-sha256" },
        ED_KEY_ID: { "pem": ed.verifying_key().to_public_key_pem(Default::default())?, "alg": "ed25519" },
    }))
}

struct Setup {
    db: TestDb,
    running: Running,
    _dir: tempfile::TempDir,
}

/// A host with the real plugin in its default `double-knock` mode, an RSA
/// actor (the default) and an Ed25519 one.
async fn start(db: TestDb, ed: &ed25519_dalek::SigningKey) -> anyhow::Result<Setup> {
    let (_, pem, _) = actor_key()?;
    let dir = tempfile::tempdir()?;
    let ed_pem = dir.path().join("ed.pem");
    std::fs::write(&ed_pem, ed.to_pkcs8_pem(Default::default())?.as_bytes())?;
    let config = laneway::config::from_layers(&[
        "[queue]\nlease_ms = 5000\n[dispatch]\npoll_ms = 25\nslot_ttl_ms = 2000\nshutdown_grace_ms = 300\n",
        &format!(
            "[keys.actor]\nalgorithm = \"rsa-sha256\"\nfile = {:?}\n\
             [keys.ed]\nalgorithm = \"ed25519\"\nfile = {:?}\n\
             [plugins.ap]\npath = {:?}\nallowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1\"]\nkeys = [\"actor\", \"ed\"]\n\
             [kinds.activitypub]\nplugin = \"ap\"\nbackoff_base_ms = 20\nbackoff_max_ms = 50\n\
             [kinds.activitypub.config]\nkey = \"actor\"\nkey_id = \"{KEY_ID}\"\n\
             [kinds.activitypub.config.actors.\"{ED_ACTOR}\"]\nkey = \"ed\"\nkey_id = \"{ED_KEY_ID}\"\nalgorithm = \"ed25519\"\n",
            pem.display().to_string(),
            ed_pem.display().to_string(),
            crate::runtime::wasm("activitypub")?.display().to_string(),
        ),
    ])?;
    let host = PluginHost::new(&config)?;
    host.apply(&config).await?;
    let running = Running::start(db.queue.clone(), host.registry(), config).await?;
    Ok(Setup { db, running, _dir: dir })
}

impl Setup {
    async fn fan_out(&self, actor: &str, activity: String, to: &[String]) -> anyhow::Result<()> {
        self.running
            .dispatcher
            .fan_out(&FanOut {
                kind: "activitypub".into(),
                actor: actor.into(),
                activity,
                recipients: to.iter().map(|r| Recipient::parse(r)).collect(),
                priority: None,
                subject: None,
            })
            .await?;
        Ok(())
    }
}

/// Inbox URLs as given (the shapes an HTTP client rewrites, and a query)
/// and the path the inbox sees.
fn shapes(base: &str) -> Vec<(String, &'static str)> {
    vec![
        (format!("{base}/users/josé/inbox"), "/users/jos%C3%A9/inbox"),
        (format!("{base}/users/a b/inbox"), "/users/a%20b/inbox"),
        (format!("{base}/users/x/../dots/inbox"), "/users/dots/inbox"),
        (format!("{base}/users/frag/inbox#main"), "/users/frag/inbox"),
        (format!("{base}/users/q/inbox?a=1&b=2"), "/users/q/inbox?a=1&b=2"),
    ]
}

fn accepted<'a>(requests: &'a [Value], path: &str) -> Vec<&'a Value> {
    requests
        .iter()
        .filter(|r| r["path"] == path && r["status"] == 202)
        .collect()
}

pub(super) async fn rewritten_urls_verify_with_third_party_libraries_and_the_knock_is_remembered(
    db: TestDb,
) -> anyhow::Result<()> {
    let ed = ed25519_dalek::SigningKey::from_bytes(&[9u8; 32]);
    let keys = trusted(&ed)?;
    let cavage_only = NodeInbox::start(&keys, &["--accept", "cavage"])?;
    let rfc_only = NodeInbox::start(&keys, &["--accept", "rfc9421"])?;
    let setup = start(db, &ed).await?;
    for round in 1..=2u32 {
        let to: Vec<String> = shapes(&cavage_only.base)
            .into_iter()
            .chain(shapes(&rfc_only.base))
            .map(|(url, _)| url)
            .collect();
        setup
            .fan_out(ACTOR, announce(&format!("{ACTOR}/announce/{round}"), round), &to)
            .await?;
        settle(setup.db.queue.as_ref(), Duration::from_secs(20)).await?;
    }
    setup.running.stop().await?;
    let from_rfc = rfc_only.requests();
    let from_cavage = cavage_only.requests();
    for (_, path) in shapes("") {
        for (inbox, requests, scheme) in [
            ("rfc9421-only", &from_rfc, "rfc9421"),
            ("cavage-only", &from_cavage, "cavage"),
        ] {
            let ok = accepted(requests, path);
            ensure!(
                ok.len() == 2 && ok.iter().all(|r| r["scheme"] == scheme),
                "{inbox} {path}: {ok:?}\nall: {requests:?}"
            );
        }
    }
    // RFC 9421 goes first: the RFC 9421 inbox refused only draft-cavage
    // requests of the first round, from lanes that started alongside the
    // knock (one each at most, every other lane), and nothing once the
    // knock's answer was remembered.
    // (A refused request is answered before its body is read, so it has no
    // id: round 2 is everything from its first accepted request on.)
    let round_two_from = from_rfc
        .iter()
        .position(|r| r["id"].as_str().is_some_and(|id| id.ends_with("/announce/2")))
        .context("round 2 reached the RFC 9421 inbox")?;
    let refused_rfc: Vec<(usize, &Value)> = from_rfc
        .iter()
        .enumerate()
        .filter(|(_, r)| r["status"] != 202)
        .collect();
    ensure!(
        refused_rfc.len() < shapes("").len()
            && refused_rfc
                .iter()
                .all(|(i, r)| *i < round_two_from && r["status"] == 401 && r["scheme"] == "cavage"),
        "{from_rfc:?}"
    );
    // The cavage inbox refused RFC 9421 once: one lane knocked on first
    // contact while the others started with draft-cavage, and the knock
    // that worked was remembered for its host, so round 2 went straight to
    // cavage.
    let refused: Vec<&Value> = from_cavage.iter().filter(|r| r["status"] == 401).collect();
    ensure!(
        refused.len() == 1 && refused.iter().all(|r| r["scheme"] == "rfc9421"),
        "{from_cavage:?}"
    );
    let round_two: Vec<&Value> = from_cavage
        .iter()
        .filter(|r| r["id"].as_str().is_some_and(|id| id.ends_with("/announce/2")))
        .collect();
    ensure!(
        round_two.len() == 5 && round_two.iter().all(|r| r["scheme"] == "cavage"),
        "{round_two:?}"
    );
    let note = setup
        .db
        .queue
        .record("note:ap", &format!("{}\u{1f}signature", cavage_only.host()))
        .await?;
    ensure!(note.map(|r| r.value).as_deref() == Some("cavage"));
    Ok(())
}

pub(super) async fn an_accept_signature_challenge_is_learnt_and_an_ed25519_actor_signs_rfc9421(
    db: TestDb,
) -> anyhow::Result<()> {
    let ed = ed25519_dalek::SigningKey::from_bytes(&[11u8; 32]);
    let keys = trusted(&ed)?;
    let inbox = NodeInbox::start(&keys, &["--accept", "rfc9421", "--challenge"])?;
    let setup = start(db, &ed).await?;
    // The host accepted cavage before; now it wants RFC 9421 and says so.
    let note_key = format!("{}\u{1f}signature", inbox.host());
    setup
        .db
        .queue
        .put_record("note:ap", &note_key, "cavage", laneway::queue::Expect::Any)
        .await?;
    let to = format!("{}/users/alice/inbox", inbox.base);
    setup
        .fan_out(
            ACTOR,
            announce(&format!("{ACTOR}/announce/1"), 1),
            std::slice::from_ref(&to),
        )
        .await?;
    settle(setup.db.queue.as_ref(), Duration::from_secs(20)).await?;
    let requests = inbox.requests();
    let schemes: Vec<(&str, u64)> = requests
        .iter()
        .map(|r| (r["scheme"].as_str().unwrap_or(""), r["status"].as_u64().unwrap_or(0)))
        .collect();
    ensure!(schemes == vec![("cavage", 401), ("rfc9421", 202)], "{requests:?}");
    let note = setup.db.queue.record("note:ap", &note_key).await?;
    ensure!(note.map(|r| r.value).as_deref() == Some("rfc9421"));
    // An Ed25519 actor signs RFC 9421 with `alg="ed25519"`, verified by the library.
    setup
        .fan_out(
            ED_ACTOR,
            announce(&format!("{ED_ACTOR}/announce/2"), 2),
            std::slice::from_ref(&to),
        )
        .await?;
    settle(setup.db.queue.as_ref(), Duration::from_secs(20)).await?;
    setup.running.stop().await?;
    let last = inbox.requests().pop().context("a request")?;
    ensure!(
        last["status"] == 202 && last["scheme"] == "rfc9421" && last["id"] == format!("{ED_ACTOR}/announce/2"),
        "{last}"
    );
    Ok(())
}
