//! ActivityPub fan-out: one activity to many recipients becomes one op per
//! distinct delivery inbox, each ordered in that inbox's lane.
//!
//! Pure. Shared inboxes are de-duplicated as Mastodon does (each recipient's
//! shared inbox if it has one, else its own inbox). The activity id makes
//! the fan-out idempotent per inbox; an `Announce` of an object already
//! pending to an inbox is declined (seed 000 SYNC-15-012); the id of a
//! configured object type (default `CaseLedgerEntry`) becomes the ops'
//! correlation id, so a dead letter names what it failed to replicate.

use serde_json::Value;

use crate::op::Priority;
use crate::queue::NewOp;

/// One addressee.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recipient {
    /// The actor's own inbox.
    pub inbox: String,
    /// The actor's server's shared inbox, if it has one.
    pub shared_inbox: Option<String>,
}

impl Recipient {
    /// Parses `INBOX` or `INBOX=SHARED_INBOX`. It splits at an `=` only
    /// where the right side is itself an absolute http(s) URL and the left
    /// side a complete one: not inside a query parameter that has no value
    /// yet (`…/inbox?next=http://…` is one inbox), so an inbox URL may carry
    /// any query string, `=` signs and all (`?token=abc=` stays as given).
    /// Of several such places the last is taken.
    pub fn parse(text: &str) -> Self {
        let absolute = |url: &str| {
            reqwest::Url::parse(url).is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host_str().is_some())
        };
        let complete = |left: &str| {
            absolute(left)
                && match left.split_once('?') {
                    // The `=` must not be the one that gives the last
                    // query parameter its value.
                    Some((_, query)) => query.rsplit('&').next().is_some_and(|last| last.contains('=')),
                    None => true,
                }
        };
        let split = text
            .rmatch_indices('=')
            .map(|(at, _)| at)
            .find(|&at| at > 0 && complete(&text[..at]) && absolute(&text[at + 1..]));
        match split {
            Some(at) => Recipient {
                inbox: text[..at].to_owned(),
                shared_inbox: Some(text[at + 1..].to_owned()),
            },
            None => Recipient {
                inbox: text.to_owned(),
                shared_inbox: None,
            },
        }
    }

    /// Where a delivery to this recipient goes.
    pub fn delivery_inbox(&self) -> &str {
        self.shared_inbox
            .as_deref()
            .filter(|s| !s.is_empty())
            .unwrap_or(&self.inbox)
    }
}

/// A fan-out request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FanOut {
    /// The executor kind (e.g. `activitypub`).
    pub kind: String,
    /// The sending actor (the outbox).
    pub actor: String,
    /// The activity, as JSON text (sent verbatim).
    pub activity: String,
    /// The addressees.
    pub recipients: Vec<Recipient>,
    /// Priority tier (the kind's default when `None`).
    pub priority: Option<Priority>,
    /// The user or actor the ops act for.
    pub subject: Option<String>,
}

/// Why a fan-out was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FanOutError {
    /// The activity is not a JSON object.
    #[error("the activity is not a JSON object: {0}")]
    NotAnActivity(String),
    /// No recipient was given.
    #[error("the activity has no recipients")]
    NoRecipients,
    /// More recipients than one fan-out may name.
    #[error("a fan-out may name at most {max} recipients, got {got}")]
    TooManyRecipients {
        /// The cap.
        max: usize,
        /// How many were given.
        got: usize,
    },
    /// A recipient's inbox is not an http(s) URL.
    #[error("recipient inbox {0:?} is not an http(s) URL")]
    BadInbox(String),
    /// A recipient's inbox URL does not parse.
    #[error("recipient inbox {inbox:?} is not a valid URL: {why}")]
    UnparsableInbox {
        /// As given.
        inbox: String,
        /// Why.
        why: String,
    },
}

/// An inbox URL as it will be sent (WHATWG parsing, as the HTTP client
/// does: non-ASCII and spaces percent-encoded, `.`/`..` resolved, the
/// fragment dropped), so the lane, the signature and the request all name
/// the same URL.
///
/// # Errors
///
/// [`FanOutError`] for a URL that is not http(s) or does not parse.
pub fn canonical_inbox(inbox: &str) -> Result<String, FanOutError> {
    if !(inbox.starts_with("https://") || inbox.starts_with("http://")) {
        return Err(FanOutError::BadInbox(inbox.to_owned()));
    }
    let mut url = reqwest::Url::parse(inbox).map_err(|e| FanOutError::UnparsableInbox {
        inbox: inbox.to_owned(),
        why: e.to_string(),
    })?;
    if url.host_str().is_none_or(str::is_empty) {
        return Err(FanOutError::UnparsableInbox {
            inbox: inbox.to_owned(),
            why: "no host".to_owned(),
        });
    }
    url.set_fragment(None);
    Ok(url.to_string())
}

/// The idempotency keys of the Announces an `Undo` takes back, one per
/// planned inbox: their ops stop coalescing (see [`plan`]'s rules), so a
/// new Announce of the same object after the Undo is queued after it
/// instead of being declined as already pending.
pub fn undone_announces(request: &FanOut, ops: &[NewOp]) -> Vec<String> {
    let Ok(activity) = serde_json::from_str::<Value>(&request.activity) else {
        return Vec::new();
    };
    if str_field(&activity, "type") != Some("Undo") {
        return Vec::new();
    }
    let object = activity.get("object");
    let undone = object.and_then(|o| o.as_str().or_else(|| str_field(o, "id")));
    let is_announce = object.is_some_and(|o| o.is_string() || str_field(o, "type") == Some("Announce"));
    match undone {
        Some(id) if is_announce => ops
            .iter()
            .filter_map(|op| op.lanes.first())
            .map(|inbox| format!("{id} -> {inbox}"))
            .collect(),
        _ => Vec::new(),
    }
}

/// Most recipients one fan-out may name (checked before any is parsed).
pub const MAX_RECIPIENTS: usize = 100_000;

/// Object types whose id becomes the correlation id when a kind's config
/// does not say (`correlate_types = [...]`).
pub const DEFAULT_CORRELATE_TYPES: [&str; 1] = ["CaseLedgerEntry"];

fn str_field<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// The ops a fan-out makes, one per distinct delivery inbox, in the order
/// recipients were given.
///
/// Coalescing follows ActivityPub's meaning, per inbox:
/// - every activity with an `id` is idempotent per inbox (its key is
///   `ID -> INBOX`): the same activity is never delivered twice;
/// - an `Announce` of an object is declined while another Announce of the
///   same object is pending or in flight to that inbox (a replayed boost);
/// - an `Undo` of an Announce is delivered after it, and releases that
///   Announce's coalescing ([`undone_announces`]): a new Announce of the
///   object after the Undo is queued after the Undo, so the inbox ends on
///   the re-boost;
/// - every other type (Create, Update, Delete, Follow, …) is delivered in
///   enqueue order with no coalescing.
///
/// # Errors
///
/// [`FanOutError`] for a malformed activity or recipient list.
pub fn plan(
    request: &FanOut,
    correlate_types: &[String],
    default_priority: Priority,
) -> Result<Vec<NewOp>, FanOutError> {
    let activity: Value =
        serde_json::from_str(&request.activity).map_err(|e| FanOutError::NotAnActivity(e.to_string()))?;
    if !activity.is_object() {
        return Err(FanOutError::NotAnActivity("expected an object".into()));
    }
    if request.recipients.is_empty() {
        return Err(FanOutError::NoRecipients);
    }
    if request.recipients.len() > MAX_RECIPIENTS {
        return Err(FanOutError::TooManyRecipients {
            max: MAX_RECIPIENTS,
            got: request.recipients.len(),
        });
    }
    let id = str_field(&activity, "id");
    let kind = str_field(&activity, "type");
    let object = activity.get("object");
    let object_id = object.and_then(|o| o.as_str().or_else(|| str_field(o, "id")));
    let object_type = object.and_then(|o| str_field(o, "type"));
    let correlation_id = match (object_type, object_id) {
        (Some(t), Some(oid)) if correlate_types.iter().any(|c| c == t) => Some(oid.to_owned()),
        _ => None,
    };
    let mut inboxes: Vec<String> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for r in &request.recipients {
        let inbox = canonical_inbox(r.delivery_inbox())?;
        if seen.insert(inbox.clone()) {
            inboxes.push(inbox);
        }
    }
    // One allocation for every op: the ops share the activity, however
    // many inboxes it goes to.
    let payload: std::sync::Arc<str> = request.activity.as_str().into();
    Ok(inboxes
        .into_iter()
        .map(|inbox| NewOp {
            outbox: request.actor.clone(),
            kind: request.kind.clone(),
            priority: request.priority.unwrap_or(default_priority),
            lanes: vec![inbox.to_owned()],
            payload: payload.clone(),
            idempotency_key: id.map(|id| format!("{id} -> {inbox}")),
            coalesce_key: match (kind, object_id) {
                (Some("Announce"), Some(oid)) => Some(format!("announce {oid} -> {inbox}")),
                _ => None,
            },
            subject: request.subject.clone(),
            correlation_id: correlation_id.clone(),
            not_before: None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(activity: &str, recipients: &[&str]) -> FanOut {
        FanOut {
            kind: "activitypub".into(),
            actor: "https://cm.example/actor".into(),
            activity: activity.into(),
            recipients: recipients.iter().map(|r| Recipient::parse(r)).collect(),
            priority: None,
            subject: None,
        }
    }

    const ANNOUNCE: &str =
        r#"{"id":"https://cm.example/a/15","type":"Announce","object":{"type":"CaseLedgerEntry","id":"urn:entry:15"}}"#;

    #[test]
    fn a_recipient_splits_at_its_shared_inbox_url_not_at_any_equals_sign() {
        let r = Recipient::parse("https://a.example/inbox?user=1&x=2");
        assert_eq!(
            (r.inbox.as_str(), r.shared_inbox),
            ("https://a.example/inbox?user=1&x=2", None)
        );
        let r = Recipient::parse("https://a.example/u/x/inbox?k=v=https://a.example/inbox?s=1");
        assert_eq!(r.inbox, "https://a.example/u/x/inbox?k=v");
        assert_eq!(r.shared_inbox.as_deref(), Some("https://a.example/inbox?s=1"));
        let r = Recipient::parse("http://a.example/u=http://a.example/shared");
        assert_eq!(r.shared_inbox.as_deref(), Some("http://a.example/shared"));
        // An inbox whose query ends in `=` is sent as given.
        let r = Recipient::parse("https://a.example/inbox?token=abc=");
        assert_eq!(
            (r.inbox.as_str(), r.shared_inbox),
            ("https://a.example/inbox?token=abc=", None)
        );
        // A query parameter whose value is a URL is not a shared inbox.
        let r = Recipient::parse("https://a.example/inbox?next=http://b.example/inbox");
        assert_eq!(
            (r.inbox.as_str(), r.shared_inbox),
            ("https://a.example/inbox?next=http://b.example/inbox", None)
        );
        // ... but one after a complete inbox is.
        let r = Recipient::parse("https://a.example/inbox?next=http://b.example/x=https://a.example/shared");
        assert_eq!(r.inbox, "https://a.example/inbox?next=http://b.example/x");
        assert_eq!(r.shared_inbox.as_deref(), Some("https://a.example/shared"));
    }

    #[test]
    fn inboxes_are_planned_as_they_will_be_sent() {
        for (given, sent) in [
            (
                "https://a.example/users/josé/inbox",
                "https://a.example/users/jos%C3%A9/inbox",
            ),
            (
                "https://a.example/users/a b/inbox",
                "https://a.example/users/a%20b/inbox",
            ),
            (
                "https://a.example/users/x/../y/inbox",
                "https://a.example/users/y/inbox",
            ),
            (
                "https://a.example/users/z/inbox#main",
                "https://a.example/users/z/inbox",
            ),
            ("https://A.Example:443/inbox", "https://a.example/inbox"),
        ] {
            assert_eq!(canonical_inbox(given).as_deref(), Ok(sent), "{given}");
        }
        assert!(matches!(
            canonical_inbox("ftp://a.example/inbox"),
            Err(FanOutError::BadInbox(_))
        ));
        assert!(matches!(
            canonical_inbox("https://exa mple.com/inbox"),
            Err(FanOutError::UnparsableInbox { .. })
        ));
        // Two spellings of one inbox are one delivery.
        let ops = plan(
            &request(
                ANNOUNCE,
                &["https://a.example/users/x/inbox", "https://a.example/users/./x/inbox#k"],
            ),
            &[],
            Priority::Normal,
        )
        .unwrap_or_default();
        assert_eq!(ops.len(), 1);
    }

    #[test]
    fn only_an_undo_of_an_announce_releases_its_coalescing() {
        let to = ["https://a.example/inbox"];
        let undo = r#"{"id":"u1","type":"Undo","object":{"id":"https://cm.example/a/15","type":"Announce"}}"#;
        let r = request(undo, &to);
        let ops = plan(&r, &[], Priority::Normal).unwrap_or_default();
        assert_eq!(
            undone_announces(&r, &ops),
            vec!["https://cm.example/a/15 -> https://a.example/inbox".to_owned()]
        );
        let follow = r#"{"id":"u2","type":"Undo","object":{"id":"f1","type":"Follow"}}"#;
        let r = request(follow, &to);
        let ops = plan(&r, &[], Priority::Normal).unwrap_or_default();
        assert!(undone_announces(&r, &ops).is_empty());
        let r = request(ANNOUNCE, &to);
        let ops = plan(&r, &[], Priority::Normal).unwrap_or_default();
        assert!(undone_announces(&r, &ops).is_empty());
    }

    #[test]
    fn shared_inboxes_are_delivered_to_once() {
        let shared = "https://big.example/inbox";
        let recipients: Vec<String> = (0..5)
            .map(|i| format!("https://big.example/users/u{i}/inbox={shared}"))
            .collect();
        let mut all: Vec<&str> = recipients.iter().map(String::as_str).collect();
        all.push("https://small.example/users/a/inbox");
        let ops = plan(&request(ANNOUNCE, &all), &["CaseLedgerEntry".into()], Priority::Normal).unwrap();
        let lanes: Vec<&str> = ops.iter().map(|o| o.lanes[0].as_str()).collect();
        assert_eq!(lanes, vec![shared, "https://small.example/users/a/inbox"]);
    }

    #[test]
    fn ledger_entries_correlate_and_announces_coalesce_per_inbox() {
        let ops = plan(
            &request(ANNOUNCE, &["https://a.example/inbox"]),
            &["CaseLedgerEntry".into()],
            Priority::Normal,
        )
        .unwrap();
        assert_eq!(ops[0].correlation_id.as_deref(), Some("urn:entry:15"));
        assert_eq!(
            ops[0].coalesce_key.as_deref(),
            Some("announce urn:entry:15 -> https://a.example/inbox")
        );
        assert_eq!(
            ops[0].idempotency_key.as_deref(),
            Some("https://cm.example/a/15 -> https://a.example/inbox")
        );
        assert_eq!(&*ops[0].payload, ANNOUNCE);
        let create = r#"{"id":"x","type":"Create","object":{"type":"Note","id":"n"}}"#;
        let ops = plan(
            &request(create, &["https://a.example/inbox"]),
            &["CaseLedgerEntry".into()],
            Priority::Low,
        )
        .unwrap();
        assert_eq!(
            (ops[0].correlation_id.as_deref(), ops[0].coalesce_key.as_deref()),
            (None, None)
        );
        assert_eq!(ops[0].priority, Priority::Low);
    }

    #[test]
    fn every_op_of_a_fan_out_shares_one_payload() {
        let ops = plan(
            &request(ANNOUNCE, &["https://a.example/inbox", "https://b.example/inbox"]),
            &[],
            Priority::Normal,
        )
        .unwrap();
        assert_eq!(ops.len(), 2);
        assert!(std::sync::Arc::ptr_eq(&ops[0].payload, &ops[1].payload));
    }

    #[test]
    fn bad_requests_are_refused() {
        assert!(matches!(
            plan(&request("[1]", &["https://a/i"]), &[], Priority::Normal),
            Err(FanOutError::NotAnActivity(_))
        ));
        assert_eq!(
            plan(&request("{}", &[]), &[], Priority::Normal),
            Err(FanOutError::NoRecipients)
        );
        assert!(matches!(
            plan(&request("{}", &["ftp://x"]), &[], Priority::Normal),
            Err(FanOutError::BadInbox(_))
        ));
    }
}
