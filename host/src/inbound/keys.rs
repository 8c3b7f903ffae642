//! Actors' public keys for inbound signatures: which key a document proves
//! belongs to which actor (pure), and the cache that fetches them through
//! the egress guard with every limit an open inbox needs.
//!
//! The rule, as Mastodon and Fedify apply it: a key belongs to an actor only
//! when that actor's own document, served from the actor's own origin, names
//! the key (in `publicKey` or `assertionMethod`). A key document that merely
//! says `owner: X` proves nothing about X; the owner's document is fetched
//! and must list the key. A document's `id` must be on the origin it was
//! served from, so no server can publish keys in another server's name.
//!
//! The cache is bounded (LRU), fetches each key id once however many
//! requests ask at the same moment, refetches a key that stops verifying
//! at most once per `refetch_after` (a rotation, not every bad
//! signature), remembers a key it could not fetch for `failure_ttl` (so
//! every POST naming it does not fetch again), and limits fetches per
//! origin and in all, so unauthenticated requests naming fresh key ids
//! cannot make laneway fetch without bound. With a [`FetchSigner`], every
//! fetch is signed as laneway's instance actor (authorized-fetch servers
//! serve keys only to signed GETs).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use hashlink::LruCache;
use serde_json::Value;

use super::{origin, FetchSigner, InboundError, PublicKey};
use crate::egress::{self, Guarded};
use crate::ratelimit::LocalBucket;

/// A key and the actor whose document names it.
#[derive(Debug, Clone)]
pub struct ActorKey {
    /// The key.
    pub key: PublicKey,
    /// The actor's id.
    pub owner: String,
}

/// What a fetched document says about a key id.
#[derive(Debug, Clone)]
pub enum Found {
    /// An actor document that names the key: proven.
    Proven(ActorKey),
    /// A key document claiming an owner: the owner's document must name it.
    Claimed(ActorKey),
}

fn as_list(value: Option<&Value>) -> Vec<&Value> {
    match value {
        Some(Value::Array(items)) => items.iter().collect(),
        Some(Value::Null) | None => Vec::new(),
        Some(one) => vec![one],
    }
}

fn id_of(value: &Value) -> Option<&str> {
    value.as_str().or_else(|| value.get("id")?.as_str())
}

/// The key entries an actor document lists (`publicKey`, then
/// `assertionMethod`), each an object or a bare id.
fn listed_keys(document: &Value) -> Vec<&Value> {
    let mut keys = as_list(document.get("publicKey"));
    keys.extend(as_list(document.get("assertionMethod")));
    keys
}

fn pem_key(entry: &Value) -> Result<PublicKey, String> {
    let pem = entry
        .get("publicKeyPem")
        .and_then(Value::as_str)
        .ok_or_else(|| "the key has no publicKeyPem".to_owned())?;
    PublicKey::from_pem(pem)
}

/// The document's `id`, which must be on the origin it was served from.
fn served_id<'a>(document: &'a Value, served_from: &str) -> Result<&'a str, String> {
    let id = document
        .get("id")
        .and_then(Value::as_str)
        .ok_or_else(|| "the document has no id".to_owned())?;
    if origin(id).is_none() || origin(id) != origin(served_from) {
        return Err(format!(
            "the document's id {id:?} is not on the origin it came from ({served_from})"
        ));
    }
    Ok(id)
}

/// Reads `key_id` from the document fetched for it (served from
/// `served_from`, after redirects).
///
/// # Errors
///
/// Why the document proves nothing about the key.
pub fn key_from_document(document: &Value, served_from: &str, key_id: &str) -> Result<Found, String> {
    let id = served_id(document, served_from)?;
    let listed = listed_keys(document);
    if !listed.is_empty() {
        // An actor document: the key must be among its own.
        let entry = listed
            .into_iter()
            .find(|k| id_of(k) == Some(key_id))
            .ok_or_else(|| format!("the actor {id} does not list the key {key_id:?}"))?;
        let claimed = entry
            .get("owner")
            .or_else(|| entry.get("controller"))
            .and_then(Value::as_str);
        if claimed.is_some_and(|c| c != id) {
            return Err(format!("the key {key_id:?} listed by {id} names another owner"));
        }
        return Ok(Found::Proven(ActorKey {
            key: pem_key(entry)?,
            owner: id.to_owned(),
        }));
    }
    // A key document: its id is the key id, and it claims an owner.
    if id != key_id.split('#').next().unwrap_or(key_id) && id != key_id {
        return Err(format!("the document is {id:?}, not the key {key_id:?}"));
    }
    let owner = document
        .get("owner")
        .or_else(|| document.get("controller"))
        .and_then(Value::as_str)
        .ok_or_else(|| "the key names no owner".to_owned())?;
    Ok(Found::Claimed(ActorKey {
        key: pem_key(document)?,
        owner: owner.to_owned(),
    }))
}

/// Whether the owner's own document (served from `served_from`) is the
/// owner and names `key_id`.
///
/// # Errors
///
/// Why not.
pub fn owner_names_key(document: &Value, served_from: &str, owner: &str, key_id: &str) -> Result<(), String> {
    let id = served_id(document, served_from)?;
    if id != owner {
        return Err(format!("the owner's document is {id:?}, not {owner:?}"));
    }
    if listed_keys(document).iter().any(|k| id_of(k) == Some(key_id)) {
        Ok(())
    } else {
        Err(format!("the actor {owner} does not list the key {key_id:?}"))
    }
}

/// The largest document read (Mastodon's actors are a few KiB); read as
/// it streams, never whole first.
pub const MAX_KEY_DOCUMENT: usize = 256 * 1024;

/// Origins whose fetch rate is remembered.
const MAX_ORIGINS: usize = 10_000;

/// The cache's bounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeySettings {
    /// How long a fetched key is trusted.
    pub ttl: Duration,
    /// How soon a key that stopped verifying may be fetched again (a
    /// rotation is seen within this; a flood of bad signatures costs one
    /// fetch per key per this).
    pub refetch_after: Duration,
    /// Keys cached at most; the least recently used go first.
    pub capacity: usize,
    /// Fetches per second to one origin, and the burst a quiet one takes.
    pub origin_rate: f64,
    /// See `origin_rate`.
    pub origin_burst: u32,
    /// Fetches per second in all, and the burst.
    pub total_rate: f64,
    /// See `total_rate`.
    pub total_burst: u32,
    /// How long a key that could not be fetched is answered from memory.
    pub failure_ttl: Duration,
}

impl KeySettings {
    /// `[inbound]`'s settings, with the fixed fetch limits.
    pub fn of(config: &crate::config::InboundConfig) -> Self {
        Self {
            ttl: Duration::from_millis(config.key_cache_ms),
            refetch_after: Duration::from_millis(config.key_refetch_ms),
            failure_ttl: Duration::from_millis(config.key_failure_ms),
            ..Self::default()
        }
    }
}

impl Default for KeySettings {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(3600),
            refetch_after: Duration::from_secs(30),
            capacity: 10_000,
            origin_rate: 5.0,
            origin_burst: 20,
            total_rate: 50.0,
            total_burst: 200,
            failure_ttl: Duration::from_secs(60),
        }
    }
}

struct Limits {
    origins: LruCache<String, LocalBucket>,
    total: LocalBucket,
}

/// Actor keys by key id.
pub struct KeyCache {
    http: Guarded,
    settings: KeySettings,
    keys: Mutex<LruCache<String, (Arc<ActorKey>, Instant)>>,
    /// Key ids that could not be fetched: why, and when (bounded as `keys`).
    failures: Mutex<LruCache<String, (String, Instant)>>,
    /// Signs every fetch as laneway's instance actor, when configured.
    signer: Option<Arc<FetchSigner>>,
    /// Origins whose 401 asked for RFC 9421: fetched so from then on.
    wants_rfc9421: Mutex<LruCache<String, Vec<String>>>,
    /// One fetch per key id at a time: later askers wait for it.
    flights: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    limits: Mutex<Limits>,
}

impl KeyCache {
    /// A cache fetching through `http`, within `settings`.
    pub fn new(http: Guarded, settings: KeySettings) -> Self {
        Self {
            http,
            settings,
            keys: Mutex::new(LruCache::new(settings.capacity.max(1))),
            failures: Mutex::new(LruCache::new(settings.capacity.max(1))),
            signer: None,
            wants_rfc9421: Mutex::new(LruCache::new(MAX_ORIGINS)),
            flights: Mutex::new(HashMap::new()),
            limits: Mutex::new(Limits {
                origins: LruCache::new(MAX_ORIGINS),
                total: LocalBucket::default(),
            }),
        }
    }

    /// The same cache, signing every fetch with `signer`.
    #[must_use]
    pub fn signed_by(mut self, signer: Option<Arc<FetchSigner>>) -> Self {
        self.signer = signer;
        self
    }

    /// Key ids remembered as unfetchable now (bounded as the keys are).
    pub fn failures_len(&self) -> usize {
        self.failures.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Keys held now (bounded by the settings' capacity).
    pub fn len(&self) -> usize {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn cached(&self, key_id: &str) -> Option<(Arc<ActorKey>, Instant)> {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key_id)
            .cloned()
    }

    fn admit_fetch(&self, url: &str) -> Result<(), InboundError> {
        let origin = origin(url).unwrap_or_default();
        let mut limits = self.limits.lock().unwrap_or_else(PoisonError::into_inner);
        let s = self.settings;
        let now = chrono::Utc::now();
        let mut bucket = limits.origins.get(&origin).copied().unwrap_or_default();
        let ok = bucket.admit(s.origin_rate, s.origin_burst, now);
        limits.origins.insert(origin.clone(), bucket);
        if !ok {
            return Err(InboundError::Busy(origin));
        }
        if !limits.total.admit(s.total_rate, s.total_burst, now) {
            return Err(InboundError::Busy("all origins".to_owned()));
        }
        Ok(())
    }

    /// One GET of `url`, signed as the instance actor when there is one:
    /// RFC 9421 over `rfc9421` when given, else draft-cavage.
    async fn get(&self, url: &reqwest::Url, rfc9421: Option<&[String]>) -> Result<reqwest::Response, String> {
        let mut request = self
            .http
            .request(reqwest::Method::GET, url.as_str())
            .map_err(|refusal| format!("refused: {refusal}"))?
            .header("accept", "application/activity+json, application/ld+json");
        if let Some(signer) = &self.signer {
            let now = chrono::Utc::now();
            let headers = match rfc9421 {
                Some(components) => signer.rfc9421(url, components, now)?,
                None => signer.cavage(url, now)?,
            };
            for (name, value) in headers {
                request = request.header(name, value);
            }
        }
        request.send().await.map_err(|e| egress::client::describe(&e))
    }

    /// GETs a document (rate-limited, guarded, capped), with the URL it
    /// was finally served from. A signed fetch a server refuses with 401
    /// and an `Accept-Signature` asking for RFC 9421 is sent once more so
    /// signed, and that origin is fetched so from then on.
    async fn document(&self, url: &str) -> Result<(Value, String), String> {
        let mut url = reqwest::Url::parse(url).map_err(|e| format!("{url:?}: {e}"))?;
        url.set_fragment(None);
        let origin = origin(url.as_str()).unwrap_or_default();
        let remembered = self
            .wants_rfc9421
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&origin)
            .cloned();
        let mut response = self.get(&url, remembered.as_deref()).await?;
        if response.status() == reqwest::StatusCode::UNAUTHORIZED && self.signer.is_some() && remembered.is_none() {
            let asked = response
                .headers()
                .get("accept-signature")
                .and_then(|v| v.to_str().ok())
                .and_then(super::fetch::asked_components);
            if let Some(components) = asked {
                response = self.get(&url, Some(&components)).await?;
                if response.status().is_success() {
                    self.wants_rfc9421
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(origin, components);
                }
            }
        }
        if !response.status().is_success() {
            let unsigned = if self.signer.is_none() && response.status() == reqwest::StatusCode::UNAUTHORIZED {
                " (the server serves keys only to signed fetches: set [inbound] fetch_actor and fetch_key)"
            } else {
                ""
            };
            return Err(format!("HTTP {}{unsigned}", response.status()));
        }
        let served_from = response.url().to_string();
        let body = egress::client::read_capped(response, MAX_KEY_DOCUMENT)
            .await
            .map_err(|e| e.to_string())?;
        let document = serde_json::from_slice(&body).map_err(|e| format!("not JSON: {e}"))?;
        Ok((document, served_from))
    }

    /// Why `key_id` could not be fetched, if that is still fresh.
    fn failed(&self, key_id: &str) -> Option<InboundError> {
        let mut failures = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
        let (why, at) = failures.get(key_id)?.clone();
        if at.elapsed() >= self.settings.failure_ttl {
            failures.remove(key_id);
            return None;
        }
        let left = self.settings.failure_ttl.saturating_sub(at.elapsed()).as_secs();
        Some(InboundError::KeyUnavailable {
            key_id: key_id.to_owned(),
            why: format!("{why} (remembered; fetched again in {left} s at most)"),
        })
    }

    async fn fetch(&self, key_id: &str) -> Result<Arc<ActorKey>, InboundError> {
        let unavailable = |why: String| InboundError::KeyUnavailable {
            key_id: key_id.to_owned(),
            why,
        };
        self.admit_fetch(key_id)?;
        let (document, served_from) = self.document(key_id).await.map_err(unavailable)?;
        let key = match key_from_document(&document, &served_from, key_id).map_err(unavailable)? {
            Found::Proven(key) => key,
            Found::Claimed(key) => {
                self.admit_fetch(&key.owner)?;
                let (actor, served_from) = self.document(&key.owner).await.map_err(unavailable)?;
                owner_names_key(&actor, &served_from, &key.owner, key_id).map_err(unavailable)?;
                key
            }
        };
        let key = Arc::new(key);
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key_id.to_owned(), (key.clone(), Instant::now()));
        Ok(key)
    }

    /// The key, fetched once however many ask at once: `newer_than` set,
    /// a cached key fetched before then does not do.
    async fn key(&self, key_id: &str, newer_than: Option<Instant>) -> Result<Arc<ActorKey>, InboundError> {
        let usable = |(key, at): (Arc<ActorKey>, Instant)| {
            (at.elapsed() < self.settings.ttl && newer_than.is_none_or(|t| at >= t)).then_some(key)
        };
        if let Some(key) = self.cached(key_id).and_then(usable) {
            return Ok(key);
        }
        if let Some(failed) = self.failed(key_id) {
            return Err(failed);
        }
        let gate = self
            .flights
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key_id.to_owned())
            .or_default()
            .clone();
        let result = {
            let _turn = gate.lock().await;
            // Whoever held the gate before may have fetched it for us.
            match (self.cached(key_id).and_then(usable), self.failed(key_id)) {
                (Some(key), _) => Ok(key),
                (None, Some(failed)) => Err(failed),
                (None, None) => {
                    let fetched = self.fetch(key_id).await;
                    if let Err(InboundError::KeyUnavailable { why, .. }) = &fetched {
                        self.failures
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .insert(key_id.to_owned(), (why.clone(), Instant::now()));
                    }
                    fetched
                }
            }
        };
        let mut flights = self.flights.lock().unwrap_or_else(PoisonError::into_inner);
        if flights
            .get(key_id)
            .is_some_and(|g| Arc::ptr_eq(g, &gate) && Arc::strong_count(g) == 2)
        {
            flights.remove(key_id);
        }
        result
    }

    /// Verifies `data` against the key `key_id` names, fetching it if it is
    /// not cached or stale, and once more (at most every `refetch_after`)
    /// if the cached key does not verify. Returns the
    /// actor the key belongs to.
    ///
    /// # Errors
    ///
    /// [`InboundError::KeyUnavailable`], [`InboundError::Busy`] or
    /// [`InboundError::Unverified`].
    pub async fn verify(&self, key_id: &str, data: &[u8], signature: &[u8]) -> Result<String, InboundError> {
        let key = self.key(key_id, None).await?;
        if key.key.verifies(data, signature) {
            return Ok(key.owner.clone());
        }
        let fetched_at = self.cached(key_id).map(|(_, at)| at);
        if fetched_at.is_some_and(|at| at.elapsed() >= self.settings.refetch_after) {
            let again = self.key(key_id, Some(Instant::now())).await?;
            if again.key.verifies(data, signature) {
                return Ok(again.owner.clone());
            }
        }
        Err(InboundError::Unverified(format!("not signed by {key_id}")))
    }
}

/// The guarded client key fetches go through: `[inbound]`'s allow-list and
/// internal allowances, up to three redirects, each hop judged again.
///
/// # Errors
///
/// A pattern that does not parse (`check-config` reports it first).
pub fn key_client(config: &crate::config::InboundConfig) -> Result<Guarded, String> {
    let policy = egress::Egress::from_config("inbound", &config.allowed_hosts, &config.allowed_internal)?;
    let timeout = Duration::from_millis(config.fetch_timeout_ms);
    Guarded::new(
        policy,
        egress::Options {
            connect_timeout: timeout,
            timeout,
            redirects: 3,
            max_idle_per_host: 4,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const PEM: &str = "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEAGb9ECWmEzf6FQbrBZ9w7lshQhqowtrbLDFw4rXAxZuE=\n-----END PUBLIC KEY-----\n";

    fn actor(id: &str, key_id: &str) -> Value {
        json!({ "id": id, "type": "Person",
            "publicKey": { "id": key_id, "owner": id, "publicKeyPem": PEM } })
    }

    #[test]
    fn an_actor_document_proves_its_own_keys() {
        let a = "https://a.example/users/alice";
        let k = format!("{a}#main-key");
        let found = key_from_document(&actor(a, &k), a, &k);
        assert!(
            matches!(found, Ok(Found::Proven(ref key)) if key.owner == a),
            "{found:?}"
        );
        // In assertionMethod too.
        let doc = json!({ "id": a, "assertionMethod": [{ "id": k, "controller": a, "publicKeyPem": PEM }] });
        assert!(matches!(key_from_document(&doc, a, &k), Ok(Found::Proven(_))));
    }

    #[test]
    fn a_document_cannot_speak_for_another_origin() {
        let victim = "https://victim.example/users/alice";
        // Served by evil.example, claiming to be the victim.
        let forged = actor(victim, "https://evil.example/key");
        let err = key_from_document(&forged, "https://evil.example/key", "https://evil.example/key");
        assert!(err.as_ref().is_err_and(|e| e.contains("not on the origin")), "{err:?}");
        // A key document on evil.example claiming the victim as owner is
        // only a claim: the victim's own document must name the key.
        let key_doc = json!({ "id": "https://evil.example/key", "owner": victim, "publicKeyPem": PEM });
        let claim = key_from_document(&key_doc, "https://evil.example/key", "https://evil.example/key");
        assert!(
            matches!(claim, Ok(Found::Claimed(ref key)) if key.owner == victim),
            "{claim:?}"
        );
        let victim_doc = actor(victim, &format!("{victim}#main-key"));
        assert!(owner_names_key(&victim_doc, victim, victim, "https://evil.example/key").is_err());
        // When the owner does list a key served elsewhere, it is theirs.
        let listing = json!({ "id": victim, "publicKey": ["https://keys.example/k1"] });
        assert!(owner_names_key(&listing, victim, victim, "https://keys.example/k1").is_ok());
        // An owner document served from another origin proves nothing.
        assert!(owner_names_key(&listing, "https://evil.example/x", victim, "https://keys.example/k1").is_err());
    }

    #[test]
    fn an_actor_that_does_not_list_the_key_or_names_another_owner_is_refused() {
        let a = "https://a.example/users/alice";
        assert!(key_from_document(&actor(a, &format!("{a}#k1")), a, &format!("{a}#k2")).is_err());
        let doc = json!({ "id": a, "publicKey": { "id": format!("{a}#k"), "owner": "https://a.example/users/bob", "publicKeyPem": PEM } });
        assert!(key_from_document(&doc, a, &format!("{a}#k")).is_err());
    }
}
