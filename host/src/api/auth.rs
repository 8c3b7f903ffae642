//! API keys: their format (`lw_<id>_<secret>`), how they are made and
//! checked, and the scopes a route asks for. Only the secret's SHA-256 is
//! stored; a request's key is found by its public id and its secret's hash
//! compared in constant time, so neither the database nor the timing of a
//! refusal gives a key away. A producer's key may be limited to named
//! outboxes (an `only:<outbox>` entry each, beside its scopes): it enqueues
//! into those and reads their outcomes, and nothing else.

use axum::http::HeaderMap;
use rand::RngCore as _;
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;

use super::error::ApiError;
use crate::queue::{NewApiKey, Queue};

/// Every scope a key may carry.
pub const SCOPES: [&str; 6] = [
    "ops:write",
    "outcomes:read",
    "outbox:read",
    "outbox:write",
    "plugins:admin",
    "metrics:read",
];

/// The entry, beside a key's scopes, that limits it to one outbox (the
/// outbox form-encoded: the column separates entries by white space).
const ONLY: &str = "only:";

/// The scopes a key limited to outboxes may carry: the operator's routes
/// read and change every outbox, so such a key is a producer's.
const OUTBOX_SCOPES: [&str; 2] = ["ops:write", "outcomes:read"];

/// A freshly made key: what to store, and the whole key to show once.
#[derive(Debug)]
pub struct Minted {
    /// What the database keeps.
    pub stored: NewApiKey,
    /// `lw_<id>_<secret>`, shown to the operator once and never again.
    pub secret: String,
}

/// Makes a key for `name` with `scopes`.
///
/// # Errors
///
/// A message naming an unknown scope or an empty name.
pub fn mint(name: &str, scopes: &[String]) -> Result<Minted, String> {
    mint_for(name, scopes, &[])
}

/// Makes a key for `name` with `scopes`, limited to `outboxes` when any
/// are named.
///
/// # Errors
///
/// A message naming an unknown scope, an empty name, a blank outbox, or an
/// operator's scope on a key limited to outboxes.
pub fn mint_for(name: &str, scopes: &[String], outboxes: &[String]) -> Result<Minted, String> {
    if !outboxes.is_empty() {
        if let Some(scope) = scopes.iter().find(|s| !OUTBOX_SCOPES.contains(&s.as_str())) {
            return Err(format!(
                "a key limited to outboxes carries only {}; {scope:?} reads or changes every outbox",
                OUTBOX_SCOPES.join(" and ")
            ));
        }
        if let Some(bad) = outboxes.iter().find(|o| o.trim().is_empty() || o.len() > 2048) {
            return Err(format!("outbox {bad:?}: expected 1 to 2048 bytes, not blank"));
        }
    }
    if name.trim().is_empty() || name.len() > 100 {
        return Err("a key needs a name of 1 to 100 characters".to_owned());
    }
    if scopes.is_empty() {
        return Err(format!(
            "a key needs at least one scope (one of: {})",
            SCOPES.join(", ")
        ));
    }
    for scope in scopes {
        if !SCOPES.contains(&scope.as_str()) {
            return Err(format!(
                "unknown scope {scope:?} (expected one of: {})",
                SCOPES.join(", ")
            ));
        }
    }
    let mut id = [0u8; 6];
    let mut secret = [0u8; 24];
    rand::thread_rng().fill_bytes(&mut id);
    rand::thread_rng().fill_bytes(&mut secret);
    let id = hex(&id);
    let secret = hex(&secret);
    Ok(Minted {
        stored: NewApiKey {
            id: id.clone(),
            name: name.to_owned(),
            secret_hash: Sha256::digest(secret.as_bytes()).to_vec(),
            scopes: scopes
                .iter()
                .cloned()
                .chain(outboxes.iter().map(|o| {
                    format!(
                        "{ONLY}{}",
                        url::form_urlencoded::byte_serialize(o.as_bytes()).collect::<String>()
                    )
                }))
                .collect(),
        },
        secret: format!("lw_{id}_{secret}"),
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Who made a request: what the audit log records, and the key's scopes
/// (a route may show more to a key that may read more).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor(pub String, pub Vec<String>);

impl Actor {
    /// Whether the key also carries `scope`.
    pub fn may(&self, scope: &str) -> bool {
        self.1.iter().any(|s| s == scope)
    }

    /// The outboxes the key is limited to; `None`: every outbox.
    pub fn outboxes(&self) -> Option<Vec<String>> {
        let only: Vec<String> = self
            .1
            .iter()
            .filter_map(|s| s.strip_prefix(ONLY))
            .map(|o| {
                url::form_urlencoded::parse(format!("o={o}").as_bytes())
                    .map(|(_, v)| v.into_owned())
                    .next()
                    .unwrap_or_default()
            })
            .collect();
        (!only.is_empty()).then_some(only)
    }

    /// Whether the key may act on `outbox`.
    pub fn covers(&self, outbox: &str) -> bool {
        self.outboxes().is_none_or(|only| only.iter().any(|o| o == outbox))
    }

    /// 403 unless the key may act on `outbox`.
    ///
    /// # Errors
    ///
    /// [`ApiError::forbidden`] naming the outboxes it may use.
    pub fn must_cover(&self, outbox: &str) -> Result<(), ApiError> {
        match self.outboxes() {
            Some(only) if !only.iter().any(|o| o == outbox) => Err(ApiError::forbidden(format!(
                "this key is limited to outboxes {only:?}; not {outbox:?}"
            ))),
            _ => Ok(()),
        }
    }
}

/// Checks the request's key (`Authorization: Bearer lw_…`) and that it
/// carries `scope`.
///
/// # Errors
///
/// 401 for a missing, malformed, unknown or revoked key; 403 for a key
/// without the scope.
pub async fn authorize(queue: &dyn Queue, headers: &HeaderMap, scope: &str) -> Result<Actor, ApiError> {
    let (name, scopes) = key(queue, headers).await?;
    if !scopes.iter().any(|s| s == scope) {
        return Err(ApiError::forbidden(format!("key {name:?} lacks the {scope} scope")));
    }
    Ok(Actor(format!("key:{name}"), scopes))
}

/// Checks the request's key whatever its scopes: who is asking, for a
/// client that shows only what the key may do (the API still checks every
/// route's scope).
///
/// # Errors
///
/// 401 for a missing, malformed, unknown or revoked key.
pub async fn identify(queue: &dyn Queue, headers: &HeaderMap) -> Result<Actor, ApiError> {
    let (name, scopes) = key(queue, headers).await?;
    Ok(Actor(format!("key:{name}"), scopes))
}

/// The name and scopes of the request's valid, unrevoked key.
async fn key(queue: &dyn Queue, headers: &HeaderMap) -> Result<(String, Vec<String>), ApiError> {
    let header = headers
        .get(axum::http::header::AUTHORIZATION)
        .ok_or_else(|| ApiError::unauthorized("an API key is required: Authorization: Bearer lw_…"))?;
    let key = header
        .to_str()
        .ok()
        .and_then(|h| h.strip_prefix("Bearer "))
        .ok_or_else(|| ApiError::unauthorized("expected Authorization: Bearer lw_…"))?;
    let unknown = || ApiError::unauthorized("unknown or revoked API key");
    let (id, secret) = key
        .strip_prefix("lw_")
        .and_then(|rest| rest.split_once('_'))
        .ok_or_else(unknown)?;
    let (stored, hash) = queue.api_key(id).await?.ok_or_else(unknown)?;
    let presented = Sha256::digest(secret.as_bytes());
    if !bool::from(presented.as_slice().ct_eq(&hash)) || stored.revoked_at.is_some() {
        return Err(unknown());
    }
    Ok((stored.name, stored.scopes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minted_key_stores_only_the_hash_of_its_secret() {
        let minted = mint("ci", &["outbox:read".to_owned()]).expect("valid");
        let (id, secret) = minted
            .secret
            .strip_prefix("lw_")
            .and_then(|r| r.split_once('_'))
            .expect("lw_<id>_<secret>");
        assert_eq!(id, minted.stored.id);
        assert_eq!(minted.stored.secret_hash, Sha256::digest(secret.as_bytes()).to_vec());
        assert!(!minted
            .stored
            .secret_hash
            .windows(secret.len())
            .any(|w| w == secret.as_bytes()));
        let again = mint("ci", &["outbox:read".to_owned()]).expect("valid");
        assert_ne!(again.secret, minted.secret);
    }

    #[test]
    fn unknown_scopes_and_empty_names_are_refused() {
        assert!(mint("x", &["outbox:delete".to_owned()])
            .unwrap_err()
            .contains("unknown scope"));
        assert!(mint("x", &[]).is_err());
        let producer = |scopes: &[&str], outboxes: &[&str]| {
            let own = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
            mint_for("p", &own(scopes), &own(outboxes))
        };
        assert!(
            producer(&["ops:write", "outbox:read"], &["shop"]).is_err(),
            "an operator's scope"
        );
        assert!(producer(&["ops:write"], &[" "]).is_err(), "a blank outbox");
        let limited = producer(&["ops:write", "outcomes:read"], &["shop", "a b+c/d"]).expect("valid");
        let actor = Actor("key:p".to_owned(), limited.stored.scopes.clone());
        assert!(actor.may("ops:write") && actor.covers("shop") && actor.covers("a b+c/d"));
        assert!(!actor.covers("billing") && actor.must_cover("billing").is_err());
        assert!(
            limited.stored.scopes.iter().all(|s| !s.contains(' ')),
            "{:?}",
            limited.stored.scopes
        );
        let open = Actor("key:q".to_owned(), vec!["ops:write".to_owned()]);
        assert!(open.outboxes().is_none() && open.covers("anything"));
        assert!(mint(" ", &["outbox:read".to_owned()]).is_err());
    }
}
