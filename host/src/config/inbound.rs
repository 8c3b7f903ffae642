//! `[inbound]`'s instance actor: the checks on `fetch_actor` and
//! `fetch_key` that `check-config` runs and the signer repeats at start.

use super::Config;
use crate::keys::Algorithm;

/// The fragment naming the instance actor's key in its document.
pub const FETCH_KEY_FRAGMENT: &str = "main-key";

/// Paths laneway serves itself, which the actor document must not shadow.
const RESERVED_PATHS: [&str; 6] = ["/api/", "/inbox", "/metrics", "/healthz", "/readyz", "/console"];

/// What is wrong with `[inbound]`'s fetch actor, by key path.
pub fn fetch_actor_problems(config: &Config) -> Vec<(String, String)> {
    let inbound = &config.inbound;
    let mut found = Vec::new();
    let mut bad = |path: &str, message: String| found.push((format!("inbound.{path}"), message));
    if inbound.fetch_actor.is_empty() {
        if !inbound.fetch_key.is_empty() {
            bad(
                "fetch_actor",
                "expected the instance actor's URL, since fetch_key is set".to_owned(),
            );
        }
        return found;
    }
    match reqwest::Url::parse(&inbound.fetch_actor) {
        Ok(url) if matches!(url.scheme(), "http" | "https") && url.fragment().is_none() && url.query().is_none() => {
            let path = url.path();
            if inbound.serve_fetch_actor && (path == "/" || RESERVED_PATHS.iter().any(|r| path.starts_with(r))) {
                bad(
                    "fetch_actor",
                    format!("laneway serves {path} itself; give the actor a path of its own (e.g. /actor)"),
                );
            }
        }
        _ => bad(
            "fetch_actor",
            format!(
                "expected an http(s) URL without query or fragment (the key id adds #{FETCH_KEY_FRAGMENT}), got {:?}",
                inbound.fetch_actor
            ),
        ),
    }
    match config.keys.get(&inbound.fetch_key) {
        None if inbound.fetch_key.is_empty() => {
            bad("fetch_key", "expected the [keys.ID] that signs fetches".to_owned());
        }
        None => bad("fetch_key", format!("no [keys.{}] is configured", inbound.fetch_key)),
        Some(source) if !matches!(source.algorithm, Algorithm::RsaSha256 | Algorithm::Ed25519) => bad(
            "fetch_key",
            format!(
                "[keys.{}] is {}; expected rsa-sha256 (what Mastodon verifies) or ed25519",
                inbound.fetch_key, source.algorithm
            ),
        ),
        Some(_) => {}
    }
    found
}
