//! Signed key and actor fetches: the instance actor laneway's inbound side
//! signs its GETs as, its actor document, and the two signature schemes.
//!
//! Authorized-fetch servers (Mastodon with `AUTHORIZED_FETCH`, GoToSocial by
//! default, Threads) answer an unsigned GET of an actor or key with 401 and
//! serve it only to a GET signed by a key its own actor document lists.
//! So every fetch is signed, draft-cavage over `(request-target) host date`
//! (what those servers verify), or RFC 9421 over the components a server's
//! 401 names in `Accept-Signature`. The key stays in the host's key store;
//! the actor document is served by laneway or published by the application
//! (`[inbound] fetch_actor`, `fetch_key`, `serve_fetch_actor`).
//!
//! Building the strings and headers is pure; only [`super::KeyCache`] sends.

use std::collections::BTreeMap;
use std::sync::Arc;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use serde_json::{json, Value};

use crate::config::{fetch_actor_problems, Config, FETCH_KEY_FRAGMENT};
use crate::keys::{Algorithm, KeyStore};

/// The instance actor and the key its fetches are signed with.
pub struct FetchSigner {
    actor: String,
    key_id: String,
    key: String,
    algorithm: Algorithm,
    keys: Arc<KeyStore>,
    inbox: String,
}

impl std::fmt::Debug for FetchSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FetchSigner")
            .field("key_id", &self.key_id)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl FetchSigner {
    /// The signer `[inbound]` configures, loading its one key; `None` when
    /// fetches are unsigned (`fetch_actor` empty).
    ///
    /// # Errors
    ///
    /// The configuration's problem or the key's, as `check-config` reports it.
    pub fn from_config(config: &Config) -> Result<Option<Self>, String> {
        let inbound = &config.inbound;
        if inbound.fetch_actor.is_empty() {
            return Ok(None);
        }
        if let Some((path, message)) = fetch_actor_problems(config).into_iter().next() {
            return Err(format!("{path}: {message}"));
        }
        let source = config
            .keys
            .get(&inbound.fetch_key)
            .ok_or_else(|| format!("inbound.fetch_key: no [keys.{}]", inbound.fetch_key))?;
        let only = BTreeMap::from([(inbound.fetch_key.clone(), source.clone())]);
        let keys = KeyStore::load(&only).map_err(|problems| {
            problems
                .into_iter()
                .map(|(path, message)| format!("{path}: {message}"))
                .collect::<Vec<_>>()
                .join("; ")
        })?;
        let actor = inbound.fetch_actor.clone();
        let inbox = match inbound.public_url.trim_end_matches('/') {
            "" => format!("{}/inbox", super::origin(&actor).unwrap_or_default()),
            base => format!("{base}/inbox"),
        };
        Ok(Some(Self {
            key_id: format!("{actor}#{FETCH_KEY_FRAGMENT}"),
            actor,
            key: inbound.fetch_key.clone(),
            algorithm: source.algorithm,
            keys: Arc::new(keys),
            inbox,
        }))
    }

    /// The `keyId` the fetches name.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The actor document's path, for serving it.
    pub fn actor_path(&self) -> String {
        reqwest::Url::parse(&self.actor).map_or_else(|_| String::new(), |u| u.path().to_owned())
    }

    fn sign(&self, data: &[u8]) -> Result<String, String> {
        let signature = self
            .keys
            .sign(&self.key, self.algorithm, data)
            .map_err(|e| format!("cannot sign the fetch: {e}"))?;
        Ok(base64::engine::general_purpose::STANDARD.encode(signature))
    }

    /// `Date` and a draft-cavage `Signature` for a GET of `url` at `now`.
    ///
    /// # Errors
    ///
    /// The key cannot sign.
    pub fn cavage(&self, url: &reqwest::Url, now: DateTime<Utc>) -> Result<Vec<(&'static str, String)>, String> {
        let date = http_date(now);
        let text = cavage_signing_string(&request_target(url), &authority(url), &date);
        let algorithm = match self.algorithm {
            Algorithm::Ed25519 => "ed25519",
            _ => "rsa-sha256",
        };
        let signature = format!(
            "keyId=\"{}\",algorithm=\"{algorithm}\",headers=\"(request-target) host date\",signature=\"{}\"",
            self.key_id,
            self.sign(text.as_bytes())?
        );
        Ok(vec![("date", date), ("signature", signature)])
    }

    /// `Signature-Input`, `Signature` (and `Date`) for an RFC 9421 GET of
    /// `url` covering `components` (those asked for that a GET has).
    ///
    /// # Errors
    ///
    /// The key cannot sign.
    pub fn rfc9421(
        &self,
        url: &reqwest::Url,
        components: &[String],
        now: DateTime<Utc>,
    ) -> Result<Vec<(&'static str, String)>, String> {
        let date = http_date(now);
        let alg = match self.algorithm {
            Algorithm::Ed25519 => "ed25519",
            _ => "rsa-v1_5-sha256",
        };
        let covered: Vec<String> = components
            .iter()
            .filter(|c| component_value(url, &date, c).is_some())
            .cloned()
            .collect();
        let params = format!(
            "({});created={};keyid=\"{}\";alg=\"{alg}\"",
            covered.iter().map(|c| format!("\"{c}\"")).collect::<Vec<_>>().join(" "),
            now.timestamp(),
            self.key_id
        );
        let base = rfc9421_base(url, &date, &covered, &params);
        let signature = self.sign(base.as_bytes())?;
        Ok(vec![
            ("date", date),
            ("signature-input", format!("sig1={params}")),
            ("signature", format!("sig1=:{signature}:")),
        ])
    }

    /// The instance actor's document (an `Application`, as Mastodon's own
    /// instance actor is), listing the fetch key.
    ///
    /// # Errors
    ///
    /// The key has no public half to publish (an HMAC secret).
    pub fn actor_document(&self) -> Result<Value, String> {
        let key = self.keys.get(&self.key).ok_or("the fetch key is not loaded")?;
        let pem = key
            .public_key_pem()
            .ok_or_else(|| format!("[keys.{}] has no public key to publish", self.key))?;
        let name = reqwest::Url::parse(&self.actor)
            .ok()
            .and_then(|u| u.host_str().map(str::to_owned))
            .unwrap_or_default();
        Ok(json!({
            "@context": ["https://www.w3.org/ns/activitystreams", "https://w3id.org/security/v1"],
            "id": self.actor,
            "type": "Application",
            "preferredUsername": name,
            "inbox": self.inbox,
            "manuallyApprovesFollowers": true,
            "publicKey": { "id": self.key_id, "owner": self.actor, "publicKeyPem": pem },
        }))
    }
}

fn http_date(now: DateTime<Utc>) -> String {
    now.format("%a, %d %b %Y %H:%M:%S GMT").to_string()
}

/// `host` as the request sends it: the port only when not the scheme's.
fn authority(url: &reqwest::Url) -> String {
    let host = url.host_str().unwrap_or_default();
    match url.port() {
        Some(port) => format!("{host}:{port}"),
        None => host.to_owned(),
    }
}

fn request_target(url: &reqwest::Url) -> String {
    match url.query() {
        Some(q) => format!("{}?{q}", url.path()),
        None => url.path().to_owned(),
    }
}

/// draft-cavage's signing string for a GET over `(request-target) host date`.
pub fn cavage_signing_string(request_target: &str, host: &str, date: &str) -> String {
    format!("(request-target): get {request_target}\nhost: {host}\ndate: {date}")
}

/// A component's value for a GET of `url`, if a GET has it.
fn component_value(url: &reqwest::Url, date: &str, component: &str) -> Option<String> {
    Some(match component {
        "@method" => "GET".to_owned(),
        "@target-uri" => {
            let mut target = url.clone();
            target.set_fragment(None);
            target.to_string()
        }
        "@authority" => authority(url),
        "@scheme" => url.scheme().to_owned(),
        "@path" => url.path().to_owned(),
        "@request-target" => request_target(url),
        "@query" => format!("?{}", url.query().unwrap_or_default()),
        "host" => authority(url),
        "date" => date.to_owned(),
        _ => return None,
    })
}

/// RFC 9421's signature base for a GET over `covered`, ending with the
/// `@signature-params` line (`params` as `Signature-Input` carries it).
pub fn rfc9421_base(url: &reqwest::Url, date: &str, covered: &[String], params: &str) -> String {
    let mut base = String::new();
    for component in covered {
        if let Some(value) = component_value(url, date, component) {
            base.push_str(&format!("\"{component}\": {value}\n"));
        }
    }
    base.push_str(&format!("\"@signature-params\": {params}"));
    base
}

/// The components an `Accept-Signature` header asks for, if it asks for
/// an RFC 9421 signature at all (`sig1=("@method" "@target-uri");…`).
pub fn asked_components(accept_signature: &str) -> Option<Vec<String>> {
    let open = accept_signature.find('(')?;
    let close = open + accept_signature[open..].find(')')?;
    let components: Vec<String> = accept_signature[open + 1..close]
        .split_whitespace()
        .map(|c| c.trim_matches('"').to_ascii_lowercase())
        .filter(|c| !c.is_empty())
        .take(16)
        .collect();
    Some(if components.is_empty() {
        vec!["@method".to_owned(), "@target-uri".to_owned()]
    } else {
        components
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cavage_string_covers_target_host_and_date() {
        let url = reqwest::Url::parse("https://a.example:8443/users/x?y=1#main-key").expect("url");
        assert_eq!(
            cavage_signing_string(&request_target(&url), &authority(&url), "Mon, 07 Dec 2026 12:00:00 GMT"),
            "(request-target): get /users/x?y=1\nhost: a.example:8443\ndate: Mon, 07 Dec 2026 12:00:00 GMT"
        );
        let default_port = reqwest::Url::parse("https://a.example/u").expect("url");
        assert_eq!(authority(&default_port), "a.example");
    }

    #[test]
    fn accept_signature_names_the_components_to_cover() {
        assert_eq!(
            asked_components(r#"sig1=("@method" "@target-uri" "content-digest");alg="rsa-v1_5-sha256""#),
            Some(vec!["@method".into(), "@target-uri".into(), "content-digest".into()])
        );
        assert_eq!(
            asked_components("sig1=();alg=\"ed25519\""),
            Some(vec!["@method".into(), "@target-uri".into()])
        );
        assert_eq!(asked_components("nonsense"), None);
        let url = reqwest::Url::parse("https://a.example/users/x#main-key").expect("url");
        let covered = vec!["@method".to_owned(), "@target-uri".to_owned()];
        assert_eq!(
            rfc9421_base(&url, "d", &covered, "(\"@method\" \"@target-uri\");created=1"),
            "\"@method\": GET\n\"@target-uri\": https://a.example/users/x\n\"@signature-params\": (\"@method\" \"@target-uri\");created=1"
        );
    }
}
