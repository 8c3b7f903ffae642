//! Inbound ActivityPub: checking a POSTed activity's HTTP signature, in
//! either scheme the fediverse speaks (draft-cavage `Signature`, or RFC 9421
//! `Signature-Input` + `Signature`), against its actor's public key, as
//! Mastodon does: the body's digest signed and matching, the date or
//! `created` within the clock-skew window, the key's owner being the
//! activity's actor. Keys are fetched from their `keyId` through a guarded
//! HTTP client (the `[inbound]` allow-list, internal networks refused after
//! resolution), cached, and fetched again once when a signature does not
//! verify with the cached key (the actor rotated it).
//!
//! Parsing and verifying are pure functions of the request; only
//! [`keys::KeyCache`] does I/O. The API's `POST /inbox` routes use this, then
//! enqueue the activity as an op of the inbound kind.

pub mod fetch;
pub mod keys;

pub use fetch::FetchSigner;
pub use keys::{key_client, KeyCache, KeySettings};

use std::collections::HashMap;
use std::time::Duration;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use serde_json::Value;
use sha2::Digest as _;

/// Why an inbound request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InboundError {
    /// No signature header at all.
    #[error("the request is not signed (no Signature or Signature-Input header)")]
    Unsigned,
    /// A signature header that does not parse.
    #[error("malformed signature: {0}")]
    Malformed(String),
    /// The signature does not meet the rules (what is signed, its time).
    #[error("signature not acceptable: {0}")]
    Unacceptable(String),
    /// The signature does not verify with the actor's key.
    #[error("signature does not verify: {0}")]
    Unverified(String),
    /// The actor's key could not be had.
    #[error("cannot fetch the signing key {key_id}: {why}")]
    KeyUnavailable {
        /// The key id.
        key_id: String,
        /// Why.
        why: String,
    },
    /// Too many key fetches for the key's origin (or in all) just now:
    /// the sender should retry later.
    #[error("too many key fetches for {0} just now; retry later")]
    Busy(String),
    /// The body is not an activity (not JSON, no id or actor).
    #[error("not an activity: {0}")]
    NotAnActivity(String),
}

/// A request as received.
#[derive(Debug, Clone, Copy)]
pub struct Received<'a> {
    /// `POST`.
    pub method: &'a str,
    /// The full URL it was sent to (`https://host/inbox?q`), as the sender
    /// saw it (`[inbound] public_url` behind a proxy).
    pub target_uri: &'a str,
    /// The header values, names lowercase (repeated headers joined by `, `).
    pub headers: &'a [(String, String)],
    /// The body.
    pub body: &'a [u8],
}

/// A request's headers as [`Received::headers`] wants them: names
/// lowercase (as `http` keeps them), repeated headers joined by `, `.
pub fn header_pairs(headers: &reqwest::header::HeaderMap) -> Vec<(String, String)> {
    let mut list: Vec<(String, String)> = Vec::new();
    for (name, value) in headers {
        let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
        match list.iter_mut().find(|(n, _)| n == name.as_str()) {
            Some((_, v)) => {
                v.push_str(", ");
                v.push_str(&value);
            }
            None => list.push((name.as_str().to_owned(), value)),
        }
    }
    list
}

impl Received<'_> {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    fn url(&self) -> Result<reqwest::Url, InboundError> {
        reqwest::Url::parse(self.target_uri).map_err(|e| InboundError::Malformed(format!("target URI: {e}")))
    }

    fn request_target(&self) -> Result<String, InboundError> {
        let url = self.url()?;
        Ok(match url.query() {
            Some(q) => format!("{}?{q}", url.path()),
            None => url.path().to_owned(),
        })
    }
}

/// A parsed signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Signature {
    /// draft-cavage.
    Cavage {
        /// `keyId`.
        key_id: String,
        /// `headers`, in order.
        headers: Vec<String>,
        /// `(created)`, if given.
        created: Option<i64>,
        /// The signature bytes.
        signature: Vec<u8>,
    },
    /// RFC 9421 (the first signature of the message).
    Rfc9421 {
        /// `keyid`.
        key_id: String,
        /// The covered components, in order.
        components: Vec<String>,
        /// The `Signature-Input` member's value, as sent (the
        /// `@signature-params` line).
        params: String,
        /// `created`.
        created: Option<i64>,
        /// The signature bytes.
        signature: Vec<u8>,
    },
}

impl Signature {
    /// The key the request names.
    pub fn key_id(&self) -> &str {
        match self {
            Signature::Cavage { key_id, .. } | Signature::Rfc9421 { key_id, .. } => key_id,
        }
    }

    /// `cavage` or `rfc9421`.
    pub fn scheme(&self) -> &'static str {
        match self {
            Signature::Cavage { .. } => "cavage",
            Signature::Rfc9421 { .. } => "rfc9421",
        }
    }
}

fn unbase64(text: &str) -> Result<Vec<u8>, InboundError> {
    base64::engine::general_purpose::STANDARD
        .decode(text.trim())
        .map_err(|e| InboundError::Malformed(format!("signature is not base64: {e}")))
}

/// `k="v",k2="v2"` (cavage) or `;k="v";k2=1` (structured-field parameters).
fn params(text: &str, separator: char) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut rest = text;
    while !rest.is_empty() {
        rest = rest.trim_start_matches([separator, ' ']);
        let Some((key, after)) = rest.split_once('=') else {
            break;
        };
        let (value, next) = if let Some(quoted) = after.strip_prefix('"') {
            match quoted.find('"') {
                Some(end) => (&quoted[..end], &quoted[end + 1..]),
                None => (quoted, ""),
            }
        } else {
            match after.find(separator) {
                Some(end) => (&after[..end], &after[end..]),
                None => (after, ""),
            }
        };
        out.insert(key.trim().to_ascii_lowercase(), value.to_owned());
        rest = next;
    }
    out
}

/// Reads the request's signature: RFC 9421 when `Signature-Input` is
/// present (as Fedify and Mastodon decide), else draft-cavage.
///
/// # Errors
///
/// [`InboundError::Unsigned`] or [`InboundError::Malformed`].
pub fn parse(request: &Received<'_>) -> Result<Signature, InboundError> {
    if let Some(input) = request.header("signature-input") {
        let (label, member) = input
            .split_once('=')
            .ok_or_else(|| InboundError::Malformed("Signature-Input has no member".into()))?;
        let label = label.trim();
        // One signature, as Mastodon accepts: the first member.
        let member = member.split(", ").next().unwrap_or(member).trim();
        let close = member
            .find(')')
            .filter(|_| member.starts_with('('))
            .ok_or_else(|| InboundError::Malformed("Signature-Input is not an inner list".into()))?;
        let components: Vec<String> = member[1..close]
            .split_whitespace()
            .map(|c| c.trim_matches('"').to_owned())
            .collect();
        let p = params(&member[close + 1..], ';');
        let key_id = p
            .get("keyid")
            .cloned()
            .ok_or_else(|| InboundError::Malformed("Signature-Input has no keyid".into()))?;
        let created = p.get("created").and_then(|c| c.parse().ok());
        let value = request
            .header("signature")
            .ok_or_else(|| InboundError::Malformed("Signature-Input without Signature".into()))?;
        let signature = value
            .split(", ")
            .filter_map(|m| m.split_once('='))
            .find(|(l, _)| l.trim() == label)
            .map(|(_, v)| v.trim().trim_matches(':').to_owned())
            .ok_or_else(|| InboundError::Malformed(format!("Signature has no member {label:?}")))?;
        return Ok(Signature::Rfc9421 {
            key_id,
            components,
            params: member.to_owned(),
            created,
            signature: unbase64(&signature)?,
        });
    }
    let header = request.header("signature").ok_or(InboundError::Unsigned)?;
    let p = params(header, ',');
    let key_id = p
        .get("keyid")
        .cloned()
        .ok_or_else(|| InboundError::Malformed("no keyId".into()))?;
    let signature = p
        .get("signature")
        .ok_or_else(|| InboundError::Malformed("no signature".into()))?;
    let headers = p.get("headers").map_or_else(
        || vec!["date".to_owned()],
        |h| h.split_whitespace().map(str::to_ascii_lowercase).collect(),
    );
    Ok(Signature::Cavage {
        key_id,
        headers,
        created: p.get("created").and_then(|c| c.parse().ok()),
        signature: unbase64(signature)?,
    })
}

/// The bytes the signature covers, after checking that what must be signed
/// is (the body's digest on a POST, the target, a time) and that the
/// digest and the time are right.
///
/// # Errors
///
/// [`InboundError::Unacceptable`] or [`InboundError::Malformed`].
pub fn signed_bytes(
    signature: &Signature,
    request: &Received<'_>,
    now: DateTime<Utc>,
    skew: Duration,
) -> Result<Vec<u8>, InboundError> {
    let skew = crate::clock::chrono_duration(skew);
    let hash = sha2::Sha256::digest(request.body);
    let b64 = base64::engine::general_purpose::STANDARD.encode(hash);
    match signature {
        Signature::Cavage { headers, created, .. } => {
            let covers = |h: &str| headers.iter().any(|x| x == h);
            if !covers("digest") {
                return Err(InboundError::Unacceptable("a POST must sign its Digest".into()));
            }
            if !(covers("date") || covers("(created)")) {
                return Err(InboundError::Unacceptable(
                    "neither Date nor (created) is signed".into(),
                ));
            }
            if !(covers("(request-target)") || covers("host")) {
                return Err(InboundError::Unacceptable(
                    "neither (request-target) nor Host is signed".into(),
                ));
            }
            let digest = request
                .header("digest")
                .ok_or_else(|| InboundError::Unacceptable("no Digest header".into()))?;
            let matches = digest.split(',').any(|d| {
                d.trim()
                    .split_once('=')
                    .is_some_and(|(alg, v)| alg.eq_ignore_ascii_case("sha-256") && v == b64)
            });
            if !matches {
                return Err(InboundError::Unacceptable("the Digest does not match the body".into()));
            }
            // Only what the signature covers counts: an unsigned
            // `created=` must not stand in for the signed Date (replay).
            let mut times = Vec::new();
            if covers("(created)") {
                let c =
                    created.ok_or_else(|| InboundError::Unacceptable("(created) is signed but not given".into()))?;
                times.push(
                    DateTime::from_timestamp(c, 0)
                        .ok_or_else(|| InboundError::Unacceptable("created is out of range".into()))?,
                );
            }
            if covers("date") {
                let date = request
                    .header("date")
                    .ok_or_else(|| InboundError::Unacceptable("Date is signed but missing".into()))?;
                times.push(
                    httpdate::parse_http_date(date)
                        .map(DateTime::<Utc>::from)
                        .map_err(|_| InboundError::Unacceptable("no readable Date".into()))?,
                );
            }
            for when in times {
                if (now - when).abs() > skew {
                    return Err(InboundError::Unacceptable(format!(
                        "signed at {when}, outside the window"
                    )));
                }
            }
            let mut lines = Vec::with_capacity(headers.len());
            for h in headers {
                let value = match h.as_str() {
                    "(request-target)" => {
                        format!("{} {}", request.method.to_ascii_lowercase(), request.request_target()?)
                    }
                    "(created)" => created.map(|c| c.to_string()).unwrap_or_default(),
                    name => request
                        .header(name)
                        .ok_or_else(|| InboundError::Unacceptable(format!("signed header {name} is missing")))?
                        .trim()
                        .to_owned(),
                };
                lines.push(format!("{h}: {value}"));
            }
            Ok(lines.join("\n").into_bytes())
        }
        Signature::Rfc9421 {
            components,
            params,
            created,
            ..
        } => {
            let covers = |c: &str| components.iter().any(|x| x == c);
            if !(covers("@method") && covers("@target-uri")) {
                return Err(InboundError::Unacceptable(
                    "@method and @target-uri must be signed".into(),
                ));
            }
            if !covers("content-digest") {
                return Err(InboundError::Unacceptable("a POST must sign its Content-Digest".into()));
            }
            let digest = request
                .header("content-digest")
                .ok_or_else(|| InboundError::Unacceptable("no Content-Digest header".into()))?;
            let matches = digest.split(',').any(|d| {
                d.trim()
                    .split_once('=')
                    .is_some_and(|(alg, v)| alg.trim() == "sha-256" && v.trim().trim_matches(':') == b64)
            });
            if !matches {
                return Err(InboundError::Unacceptable(
                    "the Content-Digest does not match the body".into(),
                ));
            }
            let when = created
                .and_then(|c| DateTime::from_timestamp(c, 0))
                .ok_or_else(|| InboundError::Unacceptable("created is required".into()))?;
            if (now - when).abs() > skew {
                return Err(InboundError::Unacceptable(format!(
                    "created {when}, outside the window"
                )));
            }
            let url = request.url()?;
            let mut lines = Vec::with_capacity(components.len() + 1);
            for c in components {
                let value = match c.as_str() {
                    "@method" => request.method.to_owned(),
                    "@target-uri" => request.target_uri.to_owned(),
                    "@authority" => match url.port() {
                        Some(port) => format!("{}:{port}", url.host_str().unwrap_or_default()),
                        None => url.host_str().unwrap_or_default().to_owned(),
                    },
                    "@scheme" => url.scheme().to_owned(),
                    "@path" => url.path().to_owned(),
                    "@query" => format!("?{}", url.query().unwrap_or("")),
                    "@request-target" => request.request_target()?,
                    name if name.starts_with('@') => {
                        return Err(InboundError::Unacceptable(format!("component {name} is not supported")));
                    }
                    name => request
                        .header(name)
                        .ok_or_else(|| InboundError::Unacceptable(format!("signed field {name} is missing")))?
                        .trim()
                        .to_owned(),
                };
                lines.push(format!("\"{c}\": {value}"));
            }
            lines.push(format!("\"@signature-params\": {params}"));
            Ok(lines.join("\n").into_bytes())
        }
    }
}

/// An actor's public key.
#[derive(Debug, Clone)]
pub enum PublicKey {
    /// RSA (`rsa-sha256`, `rsa-v1_5-sha256`).
    Rsa(rsa::RsaPublicKey),
    /// Ed25519.
    Ed25519(ed25519_dalek::VerifyingKey),
}

impl PublicKey {
    /// Reads an SPKI (or PKCS#1 RSA) PEM.
    ///
    /// # Errors
    ///
    /// What is wrong with it.
    pub fn from_pem(pem: &str) -> Result<Self, String> {
        use ed25519_dalek::pkcs8::DecodePublicKey as _;
        use rsa::pkcs1::DecodeRsaPublicKey as _;
        if let Ok(k) = rsa::RsaPublicKey::from_public_key_pem(pem) {
            return Ok(PublicKey::Rsa(k));
        }
        if let Ok(k) = rsa::RsaPublicKey::from_pkcs1_pem(pem) {
            return Ok(PublicKey::Rsa(k));
        }
        ed25519_dalek::VerifyingKey::from_public_key_pem(pem)
            .map(PublicKey::Ed25519)
            .map_err(|_| "not an RSA or Ed25519 public key PEM".to_owned())
    }

    /// Whether `signature` is this key's over `data`.
    pub fn verifies(&self, data: &[u8], signature: &[u8]) -> bool {
        use rsa::signature::Verifier as _;
        match self {
            PublicKey::Rsa(k) => {
                let Ok(sig) = rsa::pkcs1v15::Signature::try_from(signature) else {
                    return false;
                };
                rsa::pkcs1v15::VerifyingKey::<sha2::Sha256>::new(k.clone())
                    .verify(data, &sig)
                    .is_ok()
            }
            PublicKey::Ed25519(k) => {
                let Ok(sig) = ed25519_dalek::Signature::from_slice(signature) else {
                    return false;
                };
                k.verify_strict(data, &sig).is_ok()
            }
        }
    }
}

/// What an inbound activity says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Activity {
    /// Its `id` (replays are de-duplicated by it).
    pub id: String,
    /// Its `actor`'s id.
    pub actor: String,
    /// Its `type`.
    pub kind: String,
}

/// Reads an activity's id, actor and type.
///
/// # Errors
///
/// [`InboundError::NotAnActivity`].
pub fn activity(body: &[u8]) -> Result<Activity, InboundError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| InboundError::NotAnActivity(format!("not JSON: {e}")))?;
    let field = |v: &Value| {
        v.as_str()
            .map(str::to_owned)
            .or_else(|| v.get("id")?.as_str().map(str::to_owned))
    };
    let id = value
        .get("id")
        .and_then(Value::as_str)
        .ok_or_else(|| InboundError::NotAnActivity("no id".into()))?;
    let actor = value
        .get("actor")
        .and_then(field)
        .ok_or_else(|| InboundError::NotAnActivity("no actor".into()))?;
    // An activity speaks for its actor's server only: its id must be on
    // the actor's origin (as Mastodon and Fedify require), so a server
    // cannot mint activities in another server's name.
    if origin(id).is_none() || origin(id) != origin(&actor) {
        return Err(InboundError::NotAnActivity(format!(
            "its id {id:?} is not on its actor's origin ({actor:?})"
        )));
    }
    Ok(Activity {
        id: id.to_owned(),
        actor,
        kind: value.get("type").and_then(Value::as_str).unwrap_or("").to_owned(),
    })
}

/// A URL's origin (scheme, host, port), `None` for text that is not an
/// absolute http(s) URL.
pub fn origin(url: &str) -> Option<String> {
    let url = reqwest::Url::parse(url).ok()?;
    matches!(url.scheme(), "http" | "https").then_some(())?;
    let origin = url.origin();
    origin.is_tuple().then(|| origin.ascii_serialization())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn cavage_rules_and_signing_string() {
        let body = br#"{"id":"x"}"#;
        let digest = format!(
            "SHA-256={}",
            base64::engine::general_purpose::STANDARD.encode(sha2::Sha256::digest(body))
        );
        let now = Utc::now();
        let date = httpdate::fmt_http_date(now.into());
        let h = headers(&[
            ("host", "a.example"),
            ("date", &date),
            ("digest", &digest),
            (
                "signature",
                r#"keyId="https://b.example/u#k",algorithm="rsa-sha256",headers="(request-target) host date digest",signature="AAAA""#,
            ),
        ]);
        let req = Received {
            method: "POST",
            target_uri: "https://a.example/inbox?x=1",
            headers: &h,
            body,
        };
        let sig = parse(&req).unwrap();
        assert_eq!(sig.key_id(), "https://b.example/u#k");
        let text = String::from_utf8(signed_bytes(&sig, &req, now, Duration::from_secs(3600)).unwrap()).unwrap();
        assert_eq!(
            text,
            format!("(request-target): post /inbox?x=1\nhost: a.example\ndate: {date}\ndigest: {digest}")
        );
        // A body that is not the digested one, or a date outside the window.
        let tampered = Received { body: b"{}", ..req };
        assert!(matches!(
            signed_bytes(&sig, &tampered, now, Duration::from_secs(3600)),
            Err(InboundError::Unacceptable(_))
        ));
        let late = now + chrono::Duration::hours(2);
        assert!(signed_bytes(&sig, &req, late, Duration::from_secs(3600)).is_err());
        // The digest must be signed.
        let h2 = headers(&[
            ("date", &date),
            ("digest", &digest),
            (
                "signature",
                r#"keyId="k",headers="(request-target) date",signature="AAAA""#,
            ),
        ]);
        let unsigned_digest = Received { headers: &h2, ..req };
        let sig = parse(&unsigned_digest).unwrap();
        assert!(signed_bytes(&sig, &unsigned_digest, now, Duration::from_secs(3600)).is_err());
    }

    #[test]
    fn an_unsigned_created_does_not_stand_in_for_the_signed_date() {
        let body = br#"{"id":"x"}"#;
        let digest = format!(
            "SHA-256={}",
            base64::engine::general_purpose::STANDARD.encode(sha2::Sha256::digest(body))
        );
        let now = Utc::now();
        let old = httpdate::fmt_http_date((now - chrono::Duration::days(2)).into());
        // A two-day-old signed request, replayed with `created=<now>` added:
        // `(created)` is not among the signed headers, so it must not count.
        let signature = format!(
            r#"keyId="https://b.example/u#k",headers="(request-target) host date digest",created={},signature="AAAA""#,
            now.timestamp()
        );
        let h = headers(&[
            ("host", "a.example"),
            ("date", &old),
            ("digest", &digest),
            ("signature", &signature),
        ]);
        let req = Received {
            method: "POST",
            target_uri: "https://a.example/inbox",
            headers: &h,
            body,
        };
        let sig = parse(&req).unwrap();
        let refused = signed_bytes(&sig, &req, now, Duration::from_secs(3600));
        assert!(
            matches!(refused, Err(InboundError::Unacceptable(ref why)) if why.contains("outside")),
            "{refused:?}"
        );
        // Signed `(created)` counts, and must be in the window too.
        let signed_created = format!(
            r#"keyId="k",headers="(request-target) (created) digest",created={},signature="AAAA""#,
            (now - chrono::Duration::days(2)).timestamp()
        );
        let h = headers(&[("digest", &digest), ("signature", &signed_created)]);
        let req = Received { headers: &h, ..req };
        let sig = parse(&req).unwrap();
        assert!(signed_bytes(&sig, &req, now, Duration::from_secs(3600)).is_err());
    }

    #[test]
    fn activities_must_come_from_their_actors_origin() {
        assert!(activity(br#"{"id":"https://b.example/a/1","actor":"https://b.example/u"}"#).is_ok());
        for body in [
            &br#"{"id":"https://evil.example/a/1","actor":"https://b.example/u"}"#[..],
            br#"{"id":"https://b.example:444/a/1","actor":"https://b.example/u"}"#,
            br#"{"id":"urn:x","actor":"https://b.example/u"}"#,
        ] {
            assert!(activity(body).is_err(), "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn rfc9421_base_uses_the_params_as_sent() {
        let body = br#"{"id":"x"}"#;
        let digest = format!(
            "sha-256=:{}:",
            base64::engine::general_purpose::STANDARD.encode(sha2::Sha256::digest(body))
        );
        let now = Utc::now();
        let input = format!(
            r#"sig1=("@method" "@target-uri" "content-digest");created={};keyid="https://b.example/u#k";alg="rsa-v1_5-sha256""#,
            now.timestamp()
        );
        let h = headers(&[
            ("content-digest", &digest),
            ("signature-input", &input),
            ("signature", "sig1=:AAAA:"),
        ]);
        let req = Received {
            method: "POST",
            target_uri: "https://a.example/users/b/inbox",
            headers: &h,
            body,
        };
        let sig = parse(&req).unwrap();
        assert_eq!(sig.scheme(), "rfc9421");
        let text = String::from_utf8(signed_bytes(&sig, &req, now, Duration::from_secs(60)).unwrap()).unwrap();
        let params = input.trim_start_matches("sig1=");
        assert_eq!(
            text,
            format!(
                "\"@method\": POST\n\"@target-uri\": https://a.example/users/b/inbox\n\"content-digest\": {digest}\n\"@signature-params\": {params}"
            )
        );
    }

    #[test]
    fn activities_need_an_id_and_an_actor() {
        let a = activity(br#"{"id":"https://b/1","type":"Follow","actor":{"id":"https://b/u"}}"#).unwrap();
        assert_eq!(
            (a.id.as_str(), a.actor.as_str(), a.kind.as_str()),
            ("https://b/1", "https://b/u", "Follow")
        );
        assert!(activity(br#"{"type":"Follow","actor":"https://b/u"}"#).is_err());
        assert!(activity(b"nope").is_err());
    }
}
