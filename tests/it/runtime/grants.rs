//! Grants: keys and destinations a plugin was not given are refused (and
//! the op is classified as denied), internal addresses need an explicit
//! allowance, and the signer boundary carries signatures, never key bytes.

use std::sync::Arc;

use anyhow::{ensure, Context};
use ed25519_dalek::pkcs8::EncodePrivateKey as _;
use ed25519_dalek::Verifier as _;
use laneway::keys::{Algorithm, Key, KeyStore};
use laneway::runtime::bindings::executor::laneway::plugin::types as wit;
use laneway::runtime::failure::PluginFailure;

use super::{attempt, http_server, load, op, runtime, Recorder, Serve};

const SEED: [u8; 32] = [7u8; 32];

fn keys() -> anyhow::Result<KeyStore> {
    let pem = ed25519_dalek::SigningKey::from_bytes(&SEED).to_pkcs8_pem(Default::default())?;
    let granted = Key::from_pem(Algorithm::Ed25519, &pem).map_err(anyhow::Error::msg)?;
    let other = Key::from_pem(
        Algorithm::Ed25519,
        &ed25519_dalek::SigningKey::from_bytes(&[9u8; 32]).to_pkcs8_pem(Default::default())?,
    )
    .map_err(anyhow::Error::msg)?;
    Ok(KeyStore::from_keys([
        ("granted".to_owned(), granted),
        ("secret-of-another".to_owned(), other),
    ]))
}

async fn run(extra: &str, payload: &str) -> anyhow::Result<Result<wit::Outcome, PluginFailure>> {
    let rt = runtime()?;
    let plugin = load(&rt, "grants", extra, keys()?)?.map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(plugin
        .execute(op(1, payload), attempt(Arc::new(Recorder::default())))
        .await)
}

fn unhex(s: &str) -> anyhow::Result<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2).context("odd hex")?, 16).map_err(anyhow::Error::from))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_granted_key_signs_and_only_the_signature_crosses_the_boundary() -> anyhow::Result<()> {
    let outcome = run("keys = [\"granted\"]", "\"sign:granted:ed25519:hello\"").await?;
    let Ok(wit::Outcome::Confirmed(c)) = outcome else {
        anyhow::bail!("{outcome:?}")
    };
    let signature = unhex(c.detail.as_deref().context("signature")?)?;
    let public = ed25519_dalek::SigningKey::from_bytes(&SEED).verifying_key();
    public.verify(b"hello", &ed25519_dalek::Signature::from_slice(&signature)?)?;
    // What the guest got back is 64 signature bytes; the 32-byte secret is
    // nowhere in it (the signer import has no call that returns it).
    ensure!(signature.len() == 64);
    ensure!(!signature.windows(32).any(|w| w == SEED));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ungranted_key_is_denied_and_the_call_classified_so() -> anyhow::Result<()> {
    let outcome = run("keys = [\"granted\"]", "\"sign:secret-of-another:ed25519:hello\"").await?;
    match outcome {
        Err(PluginFailure::Denied(why)) => ensure!(why.contains("secret-of-another"), "{why}"),
        other => anyhow::bail!("{other:?}"),
    }
    // The denial decides the op: no retries, a dead letter.
    let decision = laneway::retry::decide(
        &laneway::retry::RetryPolicy::default(),
        &PluginFailure::Denied("x".into()).into_outcome(),
        laneway::retry::History {
            attempts: 1,
            fee_bumps: 0,
            checkpointed: false,
        },
        chrono::Utc::now(),
        0.5,
    );
    ensure!(
        matches!(decision, laneway::retry::Decision::DeadLetter { .. }),
        "{decision:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ungranted_host_is_denied() -> anyhow::Result<()> {
    let port = http_server(Serve::Ok).await?;
    let outcome = run(
        "allowed_hosts = [\"https://inbox.example\"]",
        &format!("\"get:http://127.0.0.1:{port}/\""),
    )
    .await?;
    ensure!(
        matches!(&outcome, Err(PluginFailure::Denied(why)) if why.contains("allowed_hosts")),
        "{outcome:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_needs_an_explicit_allowance_even_when_the_host_is_allowed() -> anyhow::Result<()> {
    let port = http_server(Serve::Ok).await?;
    let url = format!("\"get:http://127.0.0.1:{port}/\"");
    let refused = run("allowed_hosts = [\"http://127.0.0.1:*\"]", &url).await?;
    ensure!(
        matches!(&refused, Err(PluginFailure::Denied(why)) if why.contains("internal")),
        "{refused:?}"
    );
    // By name too: localhost resolves to loopback, which the resolver drops.
    let by_name = run(
        "allowed_hosts = [\"http://localhost:*\"]",
        &format!("\"get:http://localhost:{port}/\""),
    )
    .await?;
    ensure!(
        matches!(&by_name, Err(PluginFailure::Denied(why)) if why.contains("internal")),
        "{by_name:?}"
    );
    let allowed = run(
        "allowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1/32\"]",
        &url,
    )
    .await?;
    let Ok(wit::Outcome::Confirmed(c)) = allowed else {
        anyhow::bail!("{allowed:?}")
    };
    ensure!(c.detail.as_deref() == Some("200"));
    Ok(())
}
