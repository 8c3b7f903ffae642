//! ActivityPub delivery: POSTs an op's activity to its inbox (the op's lane),
//! signed by the host's signer (the actor's private key never enters this
//! plugin) with draft-cavage or RFC 9421 HTTP signatures, chosen per
//! destination host: configured, learnt from an `Accept-Signature`
//! challenge, or by double-knocking (try one scheme, on 401 the other, and
//! remember in a host note what worked). The response is classified as
//! Mastodon does, configurable per kind.

mod signing;

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use laneway_sdk::http::{self, Request};
use laneway_sdk::signer::{self, Algorithm};
use laneway_sdk::{Confirmation, Executor, Failure, Op, OpInput, Outcome, Retry};
use serde::Deserialize;
use sha2::Digest as _;
use signing::{b64, Post, Rfc9421, Scheme};

/// How much of a response body an attempt record keeps.
const BODY_KEPT: usize = 1024;

/// The signing identity of one actor.
#[derive(Debug, Clone, Deserialize)]
struct Actor {
    /// The host key id to sign with.
    key: String,
    /// The signature's `keyId` (the actor's public key URL).
    key_id: String,
    /// `rsa-sha256` (default) or `ed25519` (RFC 9421 only).
    #[serde(default)]
    algorithm: Option<String>,
}

impl Actor {
    fn ed25519(&self) -> bool {
        self.algorithm.as_deref() == Some("ed25519")
    }
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
    /// `cavage`, `rfc9421` or `double-knock` (default).
    #[serde(default)]
    signature: Option<String>,
    /// Per destination host (`host[:port]`): `cavage` or `rfc9421`.
    #[serde(default)]
    signature_hosts: BTreeMap<String, String>,
}

/// The note under which the scheme a host accepted is remembered.
const NOTE_SCHEME: &str = "signature";
/// The note holding the RFC 9421 components a host's challenge asked for.
const NOTE_COMPONENTS: &str = "rfc9421-components";
/// The claim one lane takes to knock with RFC 9421 on first contact: the
/// others start with draft-cavage meanwhile, so a fan-out's first contact
/// costs one refused knock per server, not one per inbox.
const CLAIM_KNOCK: &str = "knock";
/// How long a first-contact knock holds its claim.
const KNOCK_CLAIM_MS: u64 = 60_000;

/// How this attempt chooses its scheme.
#[derive(Clone, Copy)]
enum Choice {
    /// This one, no second try.
    Fixed(Scheme),
    /// Start with this one; on 401, try the other and remember.
    Knock(Scheme),
    /// First contact while another lane knocks: start with this one (what
    /// the fediverse accepts), on 401 try the other; remember only what a
    /// 401 taught, so the knock's answer (RFC 9421 first) is what is kept.
    Alongside(Scheme),
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

/// The `signature` setting, if it is a string.
fn scheme_setting(value: Option<&serde_json::Value>) -> Option<&str> {
    value.and_then(serde_json::Value::as_str)
}

/// Keys of the kind's config: the signing identity, per-actor identities,
/// the status classification, the signature scheme (per host), and
/// `correlate_types` (read by the host's fan-out).
const KEYS: [&str; 9] = [
    "key",
    "key_id",
    "algorithm",
    "actors",
    "permanent_statuses",
    "retryable_statuses",
    "signature",
    "signature_hosts",
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
    let table_signature = table.get("signature");
    match table_signature {
        None => {}
        Some(Value::String(s)) if matches!(s.as_str(), "cavage" | "rfc9421" | "double-knock") => {}
        Some(other) => check.problem(
            "signature",
            format!("expected \"cavage\", \"rfc9421\" or \"double-knock\", got {other}"),
        ),
    }
    match table.get("signature_hosts") {
        None => {}
        Some(Value::Object(hosts)) => {
            for (host, scheme) in hosts {
                if scheme.as_str().and_then(Scheme::parse).is_none() {
                    check.problem(
                        format!("signature_hosts.{host:?}"),
                        format!("expected \"cavage\" or \"rfc9421\", got {scheme}"),
                    );
                }
            }
        }
        Some(other) => check.problem(
            "signature_hosts",
            format!("expected a table of host = scheme, got {other}"),
        ),
    }
    let identity = |check: &mut ConfigCheck, path: &str, table: &serde_json::Map<String, Value>| {
        let algorithm = match check.string(path, table, "algorithm", false) {
            None | Some("rsa-sha256") => Algorithm::RsaSha256,
            Some("ed25519") => Algorithm::Ed25519,
            Some(other) => {
                check.problem(
                    join(path, "algorithm"),
                    format!("expected \"rsa-sha256\" or \"ed25519\", got {other:?}"),
                );
                Algorithm::RsaSha256
            }
        };
        if let Some(key) = check.string(path, table, "key", true) {
            check::key(check, &join(path, "key"), key, algorithm);
        }
        if let Some(key_id) = check.string(path, table, "key_id", true) {
            if split_url(key_id).is_none() {
                check.problem(
                    join(path, "key_id"),
                    format!("{key_id:?} is not an http(s) URL (the actor's public key id)"),
                );
            } else if !signing::key_id_is_plain(key_id) {
                check.problem(
                    join(path, "key_id"),
                    format!("{key_id:?} has a character a signature header cannot carry (non-ASCII, a quote or a backslash)"),
                );
            }
        }
        if matches!(algorithm, Algorithm::Ed25519) && scheme_setting(table_signature) == Some("cavage") {
            check.problem(
                join(path, "algorithm"),
                "an ed25519 key signs RFC 9421 only, but signature = \"cavage\"".to_owned(),
            );
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
                if let Some(entry) = check.table(&path, entry, &["key", "key_id", "algorithm"]) {
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
        let choice = choose(&config, actor, &host);
        let first = match choice {
            Choice::Fixed(s) | Choice::Knock(s) | Choice::Alongside(s) => s,
        };
        let components = recalled_components(&host);
        let now = SystemTime::now();
        let sent = match send(first, actor, &url, &host, &path, &body, &components, now) {
            Ok(sent) => sent,
            Err(outcome) => return outcome,
        };
        let mut knocked = false;
        let (scheme, response) = match (choice, &sent) {
            (Choice::Knock(first) | Choice::Alongside(first), Ok(response)) if response.status == 401 => {
                knocked = true;
                // The other scheme, or RFC 9421 with what a challenge asks for.
                let challenge = response
                    .headers
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case("accept-signature"))
                    .and_then(|(_, v)| signing::challenge(v));
                let (second, components) = match challenge {
                    Some((asked, _)) => (Scheme::Rfc9421, asked),
                    None => (first.other(), components.clone()),
                };
                if (second == first && components == recalled_components(&host))
                    || (second == Scheme::Cavage && actor.ed25519())
                {
                    (first, sent)
                } else {
                    match send(second, actor, &url, &host, &path, &body, &components, now) {
                        Ok(again) => {
                            if again.as_ref().is_ok_and(|r| (200..300).contains(&r.status)) && second == Scheme::Rfc9421
                            {
                                remember(&host, NOTE_COMPONENTS, &components.join(" "));
                            }
                            (second, again)
                        }
                        Err(outcome) => return outcome,
                    }
                }
            }
            _ => (first, sent),
        };
        if let (Choice::Knock(_) | Choice::Alongside(_), Ok(response)) = (choice, &response) {
            // A 2xx proves the scheme; so does any answer but 401 to the
            // second knock (the first was refused for its signature, this
            // one was not), so a failing host is not knocked twice again.
            let proved = (200..300).contains(&response.status) || (knocked && response.status != 401);
            let accepted = proved && (knocked || matches!(choice, Choice::Knock(_)));
            if accepted && recalled_scheme(&host) != Some(scheme) {
                remember(&host, NOTE_SCHEME, scheme.as_str());
            }
        }
        match response {
            Ok(response) => {
                let status = response.status;
                let detail = Some(status.to_string());
                match config.classify(status) {
                    Class::Delivered => Outcome::Confirmed(Confirmation { receipt: None, detail }),
                    Class::Permanent => permanent(format!("HTTP {status}: {}", body_prefix(&response.body)), detail),
                    Class::Retryable => retryable(
                        format!(
                            "HTTP {status} ({} signature): {}",
                            scheme.as_str(),
                            body_prefix(&response.body)
                        ),
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

/// The scheme this attempt starts with, and whether it may knock twice.
fn choose(config: &Config, actor: &Actor, host: &str) -> Choice {
    if actor.ed25519() {
        return Choice::Fixed(Scheme::Rfc9421);
    }
    if let Some(scheme) = config.signature_hosts.get(host).and_then(|s| Scheme::parse(s)) {
        return Choice::Fixed(scheme);
    }
    match config.signature.as_deref() {
        Some("cavage") => Choice::Fixed(Scheme::Cavage),
        Some("rfc9421") => Choice::Fixed(Scheme::Rfc9421),
        // Fedify's order: RFC 9421 first on first contact, then what the
        // host accepted last time. One lane knocks at a time: while its
        // knock is in flight the others start with draft-cavage, which the
        // fediverse's servers accept, and knock only if it is refused.
        // (They do not wait for the knock: in a fan-out every other inbox
        // of a new server would sit out a round trip holding its permit;
        // the bench's slow fediverse measured attempts of 2-3 answers'
        // time that way.)
        _ => match recalled_scheme(host) {
            Some(scheme) => Choice::Knock(scheme),
            None if laneway_sdk::notes::claim(host, CLAIM_KNOCK, KNOCK_CLAIM_MS) => Choice::Knock(Scheme::Rfc9421),
            None => Choice::Alongside(Scheme::Cavage),
        },
    }
}

fn recalled_scheme(host: &str) -> Option<Scheme> {
    laneway_sdk::notes::get(host, NOTE_SCHEME).and_then(|s| Scheme::parse(&s))
}

/// The RFC 9421 components to sign for a host: what its challenge asked
/// for, if it did, else the defaults.
fn recalled_components(host: &str) -> Vec<String> {
    laneway_sdk::notes::get(host, NOTE_COMPONENTS)
        .map(|c| c.split(' ').map(str::to_owned).collect::<Vec<_>>())
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| signing::DEFAULT_COMPONENTS.iter().map(|c| (*c).to_owned()).collect())
}

fn remember(host: &str, key: &str, value: &str) {
    if let Err(why) = laneway_sdk::notes::set(host, key, value) {
        laneway_sdk::log::log(
            laneway_sdk::log::Level::Warn,
            "could not remember a host's signature scheme",
            &[("host".into(), host.into()), ("why".into(), why)],
        );
    }
}

/// Signs the POST with `scheme` and sends it. `Err` is an outcome decided
/// before anything was sent (the key cannot sign).
#[allow(clippy::too_many_arguments)]
fn send(
    scheme: Scheme,
    actor: &Actor,
    url: &str,
    host: &str,
    path: &str,
    body: &[u8],
    components: &[String],
    now: SystemTime,
) -> Result<Result<http::Response, http::Error>, Outcome> {
    let content_type = "application/activity+json";
    let hash = sha2::Sha256::digest(body);
    let (path_only, query) = match path.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (path, None),
    };
    let mut headers: Vec<(String, String)> = vec![
        ("content-type".into(), content_type.into()),
        ("accept".into(), "application/activity+json".into()),
        ("date".into(), httpdate::fmt_http_date(now)),
        ("host".into(), host.into()),
        ("digest".into(), format!("SHA-256={}", b64(&hash))),
        ("content-digest".into(), format!("sha-256=:{}:", b64(&hash))),
    ];
    let post = Post {
        url,
        authority: host,
        path: path_only,
        query,
        headers: &headers,
    };
    let algorithm = if actor.ed25519() {
        Algorithm::Ed25519
    } else {
        Algorithm::RsaSha256
    };
    let sign = |data: &[u8]| {
        signer::sign(&actor.key, algorithm, data)
            .map_err(|e| permanent(format!("cannot sign with key {:?}: {e:?}", actor.key), None))
    };
    let signed: Vec<(String, String)> = match scheme {
        Scheme::Cavage => {
            let signature = sign(signing::cavage_input(&post).as_bytes())?;
            vec![("signature".into(), signing::cavage_header(&actor.key_id, &signature))]
        }
        Scheme::Rfc9421 => {
            let created = now
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default();
            let params = Rfc9421 {
                components: components.to_vec(),
                created,
                key_id: &actor.key_id,
                alg: if actor.ed25519() { "ed25519" } else { "rsa-v1_5-sha256" },
            };
            let base = params.base(&post).map_err(|why| permanent(why, None))?;
            let signature = sign(base.as_bytes())?;
            let (input, value) = params.headers(&signature);
            vec![("signature-input".into(), input), ("signature".into(), value)]
        }
    };
    headers.extend(signed);
    Ok(http::send(&Request {
        method: "POST".into(),
        url: url.to_owned(),
        headers,
        body: body.to_vec(),
    }))
}

laneway_sdk::executor!(ActivityPub);
