//! ActivityPub delivery: POSTs an op's activity to its inbox (the op's lane),
//! signed with an HTTP Signature (draft-cavage, `rsa-sha256`, headers
//! `(request-target) host date digest content-type`) made by the host's
//! signer, so the actor's private key never enters this plugin. The response
//! is classified as Mastodon does, configurable per kind.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use laneway_sdk::http::{self, Request};
use laneway_sdk::signer::{self, Algorithm};
use laneway_sdk::{Confirmation, Executor, Failure, Op, OpInput, Outcome, Retry};
use serde::Deserialize;
use sha2::Digest as _;

/// How much of a response body an attempt record keeps.
const BODY_KEPT: usize = 1024;

/// The signing identity of one actor.
#[derive(Debug, Clone, Deserialize)]
struct Actor {
    /// The host key id to sign with.
    key: String,
    /// The signature's `keyId` (the actor's public key URL).
    key_id: String,
}

/// The kind's `config` table.
#[derive(Debug, Deserialize)]
struct Config {
    /// Default signing identity.
    #[serde(flatten)]
    default: Option<Actor>,
    /// Per-outbox (actor id) identities.
    #[serde(default)]
    actors: BTreeMap<String, Actor>,
    /// Statuses that dead-letter at once (default: 4xx except the
    /// retryable ones, and 501).
    #[serde(default)]
    permanent_statuses: Option<Vec<u16>>,
    /// Statuses that retry (default: 401, 408, 429 and 5xx except 501).
    #[serde(default)]
    retryable_statuses: Option<Vec<u16>>,
}

impl Config {
    fn actor(&self, outbox: &str) -> Option<&Actor> {
        self.actors.get(outbox).or(self.default.as_ref())
    }

    fn classify(&self, status: u16) -> Class {
        if (200..300).contains(&status) {
            return Class::Delivered;
        }
        if self.permanent_statuses.as_ref().is_some_and(|s| s.contains(&status)) {
            return Class::Permanent;
        }
        if self.retryable_statuses.as_ref().is_some_and(|s| s.contains(&status)) {
            return Class::Retryable;
        }
        match status {
            401 | 408 | 429 => Class::Retryable,
            501 => Class::Permanent,
            400..=499 => Class::Permanent,
            _ => Class::Retryable,
        }
    }
}

enum Class {
    Delivered,
    Retryable,
    Permanent,
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// `https://host:port/path?q` → (`host:port`, `/path?q`).
fn split_url(url: &str) -> Option<(String, String)> {
    let rest = url.split_once("://")?.1;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let authority = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    (!authority.is_empty()).then(|| (authority.to_owned(), path.to_owned()))
}

/// An inbox as it is sent: the URL (WHATWG-normalised, as the host's HTTP
/// client normalises it: non-ASCII and spaces percent-encoded, dot segments
/// resolved, the fragment dropped), the `Host` header and the request
/// target. The signature covers these, so it covers exactly what is sent.
fn target(inbox: &str) -> Result<(String, String, String), String> {
    let mut url = url::Url::parse(inbox).map_err(|e| format!("inbox {inbox:?} is not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("inbox {inbox:?} is not an http(s) URL"));
    }
    url.set_fragment(None);
    let host = url
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| format!("inbox {inbox:?} has no host"))?
        .to_owned();
    let host = match url.port() {
        Some(port) => format!("{host}:{port}"),
        None => host,
    };
    let path = match url.query() {
        Some(query) => format!("{}?{query}", url.path()),
        None => url.path().to_owned(),
    };
    Ok((url.to_string(), host, path))
}

/// `Retry-After` as a wait: delta-seconds or an HTTP date.
fn retry_after(headers: &[(String, String)], now: SystemTime) -> Option<Duration> {
    let value = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("retry-after"))?
        .1
        .trim()
        .to_owned();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(&value).ok()?;
    Some(at.duration_since(now).unwrap_or_default())
}

fn permanent(reason: String, detail: Option<String>) -> Outcome {
    Outcome::Permanent(Failure { reason, detail })
}

fn retryable(reason: String, detail: Option<String>, after: Option<Duration>) -> Outcome {
    Outcome::Retryable(Retry {
        reason,
        retry_after_ms: after.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        detail,
        fee_bump: false,
    })
}

fn body_prefix(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(&body[..body.len().min(BODY_KEPT)]).into_owned();
    text.trim().to_owned()
}

struct ActivityPub;

/// Keys of the kind's config: the signing identity, per-actor identities,
/// the status classification, and `correlate_types` (read by the host's
/// fan-out).
const KEYS: [&str; 6] = [
    "key",
    "key_id",
    "actors",
    "permanent_statuses",
    "retryable_statuses",
    "correlate_types",
];

/// Checks a kind's config: a signing identity that exists, whose key is
/// granted, loaded and RSA; well-formed status lists; no unknown keys.
fn validate(config: &str) -> Result<(), Vec<laneway_sdk::Problem>> {
    use laneway_sdk::check::{self, join, ConfigCheck};
    use serde_json::Value;
    let value = check::parse(config)?;
    let mut check = ConfigCheck::new();
    let Some(table) = check.table("", &value, &KEYS) else {
        return check.finish();
    };
    let identity = |check: &mut ConfigCheck, path: &str, table: &serde_json::Map<String, Value>| {
        if let Some(key) = check.string(path, table, "key", true) {
            check::key(check, &join(path, "key"), key, Algorithm::RsaSha256);
        }
        if let Some(key_id) = check.string(path, table, "key_id", true) {
            if split_url(key_id).is_none() {
                check.problem(
                    join(path, "key_id"),
                    format!("{key_id:?} is not an http(s) URL (the actor's public key id)"),
                );
            }
        }
    };
    let has_default = table.contains_key("key") || table.contains_key("key_id");
    if has_default {
        identity(&mut check, "", table);
    }
    match table.get("actors") {
        None if !has_default => check.problem(
            "key",
            "no signing identity: set key and key_id, or actors.\"ACTOR\".key and key_id",
        ),
        None => {}
        Some(Value::Object(actors)) => {
            for (actor, entry) in actors {
                let path = format!("actors.{actor:?}");
                if let Some(entry) = check.table(&path, entry, &["key", "key_id"]) {
                    identity(&mut check, &path, entry);
                }
            }
        }
        Some(other) => check.problem("actors", format!("expected a table of actors, got {other}")),
    }
    for key in ["permanent_statuses", "retryable_statuses"] {
        match table.get(key) {
            None => {}
            Some(Value::Array(statuses)) => {
                for (i, status) in statuses.iter().enumerate() {
                    if !status.as_u64().is_some_and(|s| (100..=599).contains(&s)) {
                        check.problem(
                            format!("{key}[{i}]"),
                            format!("expected an HTTP status (100 to 599), got {status}"),
                        );
                    }
                }
            }
            Some(other) => check.problem(key, format!("expected an array of HTTP statuses, got {other}")),
        }
    }
    match table.get("correlate_types") {
        None => {}
        Some(Value::Array(types)) if types.iter().all(Value::is_string) => {}
        Some(other) => check.problem(
            "correlate_types",
            format!("expected an array of type names, got {other}"),
        ),
    }
    check.finish()
}

impl Executor for ActivityPub {
    fn describe() -> laneway_sdk::Description {
        laneway_sdk::describe("activitypub", env!("CARGO_PKG_VERSION"), &["activitypub"])
    }

    fn lanes(_input: OpInput) -> Result<Vec<String>, String> {
        Err(
            "an activitypub op is ordered by its inbox: give the inbox as the op's lane (laneway's fan-out does)"
                .into(),
        )
    }

    fn validate_config(_kind: String, config: String) -> Result<(), Vec<laneway_sdk::Problem>> {
        validate(&config)
    }

    fn execute(op: Op) -> Outcome {
        let config: Config = match serde_json::from_str(&op.config) {
            Ok(c) => c,
            Err(e) => return permanent(format!("bad kind config: {e}"), None),
        };
        let Some(inbox) = op.lanes.first().cloned() else {
            return permanent("the op has no inbox lane".into(), None);
        };
        let (url, host, path) = match target(&inbox) {
            Ok(t) => t,
            Err(why) => return permanent(why, None),
        };
        let Some(actor) = config.actor(&op.outbox) else {
            return permanent(format!("no signing key is configured for actor {}", op.outbox), None);
        };
        let body = op.payload.into_bytes();
        let now = SystemTime::now();
        let date = httpdate::fmt_http_date(now);
        let digest = format!("SHA-256={}", b64(&sha2::Sha256::digest(&body)));
        let content_type = "application/activity+json";
        let signing_string = format!(
            "(request-target): post {path}\nhost: {host}\ndate: {date}\ndigest: {digest}\ncontent-type: {content_type}"
        );
        let signature = match signer::sign(&actor.key, Algorithm::RsaSha256, signing_string.as_bytes()) {
            Ok(s) => s,
            Err(e) => return permanent(format!("cannot sign with key {:?}: {e:?}", actor.key), None),
        };
        let header = format!(
            "keyId=\"{}\",algorithm=\"rsa-sha256\",headers=\"(request-target) host date digest content-type\",signature=\"{}\"",
            actor.key_id,
            b64(&signature)
        );
        let request = Request {
            method: "POST".into(),
            url,
            headers: vec![
                ("content-type".into(), content_type.into()),
                ("accept".into(), "application/activity+json".into()),
                ("date".into(), date),
                ("host".into(), host),
                ("digest".into(), digest),
                ("signature".into(), header),
            ],
            body,
        };
        match http::send(&request) {
            Ok(response) => {
                let status = response.status;
                let detail = Some(status.to_string());
                match config.classify(status) {
                    Class::Delivered => Outcome::Confirmed(Confirmation { receipt: None, detail }),
                    Class::Permanent => permanent(format!("HTTP {status}: {}", body_prefix(&response.body)), detail),
                    Class::Retryable => retryable(
                        format!("HTTP {status}: {}", body_prefix(&response.body)),
                        detail,
                        retry_after(&response.headers, now),
                    ),
                }
            }
            Err(http::Error::Denied(why)) => permanent(format!("destination refused by the host: {why}"), None),
            Err(e) => retryable(format!("{e:?}"), None, None),
        }
    }
}

laneway_sdk::executor!(ActivityPub);
