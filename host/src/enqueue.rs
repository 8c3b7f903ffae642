//! Turns a producer's enqueue request into a [`NewOp`] under its kind's
//! config: the kind must exist, its default priority applies, and a kind
//! that needs lanes gets them.
//!
//! The CLI, the Rust API and (later) the HTTP API all enqueue through here, so
//! they accept and refuse the same things. Payload checks live in the queue,
//! which applies them to every writer.

use chrono::{DateTime, Utc};

use crate::config::{Config, LanePresence};
use crate::op::Priority;
use crate::queue::NewOp;

/// What a producer asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnqueueRequest {
    /// The executor kind.
    pub kind: String,
    /// The outbox.
    pub outbox: String,
    /// Priority; the kind's default when `None`.
    pub priority: Option<Priority>,
    /// Lanes.
    pub lanes: Vec<String>,
    /// JSON payload text.
    pub payload: String,
    /// Idempotency key.
    pub idempotency_key: Option<String>,
    /// Coalesce key.
    pub coalesce_key: Option<String>,
    /// Subject (halt guard).
    pub subject: Option<String>,
    /// Correlation id.
    pub correlation_id: Option<String>,
    /// Earliest delivery.
    pub not_before: Option<DateTime<Utc>>,
}

/// Why a request was refused before reaching the queue.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnqueueError {
    /// The kind is not configured.
    #[error("{0}")]
    UnknownKind(String),
    /// The kind is laneway's own (outcome webhooks, inbound activities).
    #[error("{0}")]
    InternalKind(String),
    /// The kind's plugin owns its lanes and the op names lanes without
    /// every one the plugin names.
    #[error("kind {kind:?}: its plugin owns its lanes; the op's lanes must include {missing:?} (or name none)")]
    LanesNotOwned {
        /// The kind.
        kind: String,
        /// The plugin's lanes the op left out.
        missing: Vec<String>,
    },
    /// The kind's plugin owns its lanes but named none (it is not loaded,
    /// or it refused the op).
    #[error("kind {kind:?}: its plugin owns its lanes but named none for this op ({why})")]
    NoPluginLanes {
        /// The kind.
        kind: String,
        /// Why.
        why: String,
    },
    /// The kind orders its ops by lane and none was given.
    #[error("kind {kind:?} needs at least one lane (a recipient inbox or signer account): `lanes` in the API, --lane on the command line")]
    LanesRequired {
        /// The kind.
        kind: String,
    },
}

/// Applies the kind's rules to a request.
///
/// # Errors
///
/// [`EnqueueError`] when the kind is unknown or lanes are missing.
pub fn prepare(request: EnqueueRequest, config: &Config) -> Result<NewOp, EnqueueError> {
    config
        .refuse_internal_kind(&request.kind)
        .map_err(EnqueueError::InternalKind)?;
    let kind = config.kind(&request.kind).map_err(EnqueueError::UnknownKind)?;
    if kind.lanes == LanePresence::Required && request.lanes.iter().all(|l| l.trim().is_empty()) {
        return Err(EnqueueError::LanesRequired { kind: request.kind });
    }
    Ok(NewOp {
        outbox: request.outbox,
        priority: request.priority.unwrap_or(kind.priority),
        kind: request.kind,
        lanes: request.lanes,
        payload: request.payload.into(),
        idempotency_key: request.idempotency_key,
        coalesce_key: request.coalesce_key,
        subject: request.subject,
        correlation_id: request.correlation_id,
        not_before: request.not_before,
    })
}

/// When an op delayed `delay_ms` from now may go: checked arithmetic on the
/// producer's number, `None` past the calendar's range (never a panic).
pub fn not_before(delay_ms: u64) -> Option<DateTime<Utc>> {
    let ms = i64::try_from(delay_ms).ok()?;
    Utc::now().checked_add_signed(chrono::Duration::try_milliseconds(ms)?)
}

/// The lanes an op of a kind whose plugin owns its lanes
/// ([`LanePresence::Plugin`]) is enqueued with: the plugin's when the
/// producer names none; the producer's when they include every one of the
/// plugin's; refused otherwise.
///
/// # Errors
///
/// [`EnqueueError::NoPluginLanes`] or [`EnqueueError::LanesNotOwned`].
pub fn owned_lanes(kind: &str, given: Vec<String>, plugin: Vec<String>) -> Result<Vec<String>, EnqueueError> {
    if plugin.is_empty() {
        return Err(EnqueueError::NoPluginLanes {
            kind: kind.to_owned(),
            why: "the plugin named no lane".to_owned(),
        });
    }
    if given.is_empty() {
        return Ok(plugin);
    }
    let missing: Vec<String> = plugin.into_iter().filter(|l| !given.contains(l)).collect();
    if missing.is_empty() {
        Ok(given)
    } else {
        Err(EnqueueError::LanesNotOwned {
            kind: kind.to_owned(),
            missing,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;

    fn request(kind: &str, lanes: &[&str]) -> EnqueueRequest {
        EnqueueRequest {
            kind: kind.to_owned(),
            outbox: "o".to_owned(),
            lanes: lanes.iter().map(|l| (*l).to_owned()).collect(),
            payload: "{}".to_owned(),
            ..EnqueueRequest::default()
        }
    }

    #[test]
    fn the_kind_default_priority_applies_unless_the_request_names_one() {
        let config = config::from_toml_str("").expect("defaults");
        let op = prepare(request("withdraw", &["G1"]), &config).expect("valid");
        assert_eq!(op.priority, Priority::Critical);
        let mut low = request("withdraw", &["G1"]);
        low.priority = Some(Priority::Low);
        assert_eq!(prepare(low, &config).map(|o| o.priority), Ok(Priority::Low));
    }

    #[test]
    fn unknown_kinds_and_missing_lanes_are_refused() {
        let config = config::from_toml_str("").expect("defaults");
        let err = prepare(request("teleport", &["x"]), &config).unwrap_err();
        assert!(err.to_string().contains("unknown kind \"teleport\""), "{err}");
        assert!(err.to_string().contains("activitypub"), "{err}");
        assert_eq!(
            prepare(request("activitypub", &[]), &config),
            Err(EnqueueError::LanesRequired {
                kind: "activitypub".to_owned()
            })
        );
    }

    #[test]
    fn internal_kinds_are_refused() {
        let config = config::from_toml_str("[inbound]\nkind = \"hear\"\n[kinds.hear]\n").expect("valid");
        for kind in ["outcome_webhook", "hear"] {
            let err = prepare(request(kind, &["x"]), &config).unwrap_err();
            assert!(matches!(err, EnqueueError::InternalKind(_)), "{kind}: {err}");
        }
        assert!(prepare(request("activitypub", &["x"]), &config).is_ok());
    }

    #[test]
    fn a_plugin_that_owns_its_lanes_decides_them() {
        let lanes = |v: &[&str]| v.iter().map(|l| (*l).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            owned_lanes("w", lanes(&[]), lanes(&["GSIGNER"])),
            Ok(lanes(&["GSIGNER"]))
        );
        assert_eq!(
            owned_lanes("w", lanes(&["user:7", "GSIGNER"]), lanes(&["GSIGNER"])),
            Ok(lanes(&["user:7", "GSIGNER"]))
        );
        assert!(matches!(
            owned_lanes("w", lanes(&["user:7"]), lanes(&["GSIGNER"])),
            Err(EnqueueError::LanesNotOwned { missing, .. }) if missing == lanes(&["GSIGNER"])
        ));
        assert!(matches!(
            owned_lanes("w", lanes(&["user:7"]), lanes(&[])),
            Err(EnqueueError::NoPluginLanes { .. })
        ));
    }

    #[test]
    fn optional_lanes_may_be_empty() {
        let config = config::from_toml_str("[kinds.webhook]\nlanes = \"optional\"\n").expect("valid");
        assert!(prepare(request("webhook", &[]), &config).is_ok());
    }
}
