//! Outcome webhooks: the executor of laneway's own `outcome_webhook` kind,
//! and the relay that turns the outcome feed into its ops.
//!
//! The relay (one host at a time, a lease in `singletons`) reads the feed
//! from its stored cursor and, for each terminal transition of a kind with
//! `outcome_webhook`, enqueues one `outcome_webhook` op in the outbox
//! `outcomes:OUTBOX`, lane `outcome:OP_ID` (so one op's outcomes arrive in
//! order), idempotency key `outcome:CURSOR` (so a relay that crashed before
//! storing its cursor enqueues nothing twice). Then it stores the cursor.
//! The op itself is never held up: its webhook is a separate op with its
//! own retries and dead letters.
//!
//! The executor POSTs the body with Standard Webhooks headers
//! (`webhook-id`, `webhook-timestamp`, `webhook-signature: v1,…` over
//! `id.timestamp.body`, HMAC-SHA256 with the kind's `hmac-sha256` key). The
//! key never leaves the host's key store. Where it sends and which key signs
//! come from the config of the kind the outcome is about, never from the
//! op's payload (a payload is data a producer could have written), and the
//! POST goes through the egress guard (`[outcomes] allowed_hosts` and
//! `allowed_internal`).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::config::{Config, WEBHOOK_KIND};
use crate::executor::{Attempt, Executor};
use crate::keys::{Algorithm, KeyStore};
use crate::op::Op;
use crate::outcome::Outcome;
use crate::queue::{NewOp, OutcomeEntry, Queue, QueueError};

/// What an `outcome_webhook` op carries: data only. Where it goes and which
/// key signs it are the config's (`kinds.KIND.outcome_webhook` and
/// `outcome_webhook_key`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivery {
    /// The kind whose outcome this is.
    #[serde(default)]
    pub kind: Option<String>,
    /// Where an op made before the kind was recorded was going: only
    /// matched against the configured webhooks, never sent to as such.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// `webhook-id`: the same on every attempt, so receivers deduplicate.
    pub id: String,
    /// The body, exactly as sent.
    pub body: String,
}

/// A configured webhook: where, and the key that signs.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    url: String,
    key: String,
}

/// The Standard Webhooks `v1` signature of a message.
pub fn signature(keys: &KeyStore, key: &str, id: &str, timestamp: i64, body: &str) -> Result<String, String> {
    let signed = format!("{id}.{timestamp}.{body}");
    let mac = keys
        .sign(key, Algorithm::HmacSha256, signed.as_bytes())
        .map_err(|e| e.to_string())?;
    Ok(format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(mac)))
}

/// The webhook's body for one terminal transition.
pub fn body(entry: &OutcomeEntry, last_attempt: Option<&crate::op::Attempt>) -> serde_json::Value {
    let mut data = entry.summary();
    data["final_attempt"] = json!(last_attempt.map(|a| json!({
        "attempt": a.attempt, "class": a.record.class, "detail": a.record.detail,
        "error": a.record.error, "fee": a.record.fee, "finished_at": a.record.finished_at,
    })));
    json!({
        "type": format!("op.{}", entry.status),
        "timestamp": entry.at,
        "data": data,
    })
}

/// Delivers `outcome_webhook` ops.
pub struct WebhookExecutor {
    keys: Arc<KeyStore>,
    http: Result<crate::egress::Guarded, String>,
    targets: std::collections::BTreeMap<String, Target>,
}

impl WebhookExecutor {
    /// An executor for `config`'s webhooks, signing with `keys`. A policy
    /// that does not parse (`check-config` reports it) leaves every
    /// delivery retrying with that error, so fixing the config delivers.
    pub fn new(keys: Arc<KeyStore>, config: &Config) -> Self {
        let http = crate::egress::Egress::from_config(
            "outcomes",
            &config.outcomes.allowed_hosts,
            &config.outcomes.allowed_internal,
        )
        .and_then(|policy| {
            crate::egress::Guarded::new(
                policy,
                crate::egress::Options {
                    timeout: Duration::from_secs(10),
                    ..crate::egress::Options::default()
                },
            )
        });
        let targets = config
            .kinds
            .iter()
            .filter_map(|(name, kind)| {
                let (url, key) = (kind.outcome_webhook.clone()?, kind.outcome_webhook_key.clone()?);
                Some((name.clone(), Target { url, key }))
            })
            .collect();
        Self { keys, http, targets }
    }

    /// The configured webhook a delivery is for.
    fn target(&self, delivery: &Delivery) -> Option<&Target> {
        match (&delivery.kind, &delivery.url) {
            (Some(kind), _) => self.targets.get(kind),
            // Queued by an older laneway: only a URL the config still names.
            (None, Some(url)) => self.targets.values().find(|t| t.url == *url),
            (None, None) => None,
        }
    }
}

#[async_trait]
impl Executor for WebhookExecutor {
    async fn execute(&self, op: &Op, _attempt: Attempt) -> Outcome {
        let delivery: Delivery = match serde_json::from_str(&op.payload) {
            Ok(d) => d,
            Err(e) => return Outcome::permanent(format!("not an outcome webhook: {e}")),
        };
        // A webhook removed from the config: retried, so restoring the
        // config delivers it (an operator can cancel it instead).
        let Some(target) = self.target(&delivery) else {
            return Outcome::retry(format!(
                "no outcome_webhook is configured for kind {:?}",
                delivery.kind.as_deref().unwrap_or("?")
            ));
        };
        let http = match &self.http {
            Ok(http) => http,
            Err(e) => return Outcome::retry(format!("cannot send: {e}")),
        };
        let timestamp = chrono::Utc::now().timestamp();
        let signature = match signature(&self.keys, &target.key, &delivery.id, timestamp, &delivery.body) {
            Ok(s) => s,
            // A key gone from the config: retried, so fixing the config delivers it.
            Err(e) => return Outcome::retry(format!("cannot sign: {e}")),
        };
        let request = match http.request(reqwest::Method::POST, &target.url) {
            Ok(request) => request,
            Err(refusal) => return Outcome::permanent(format!("POST {}: refused: {refusal}", target.url)),
        };
        let response = request
            .header("content-type", "application/json")
            .header("webhook-id", &delivery.id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .body(delivery.body)
            .send()
            .await;
        match response {
            Err(e) => match crate::egress::client::refusal(&e) {
                Some(refusal) => Outcome::permanent(format!("POST {}: refused: {refusal}", target.url)),
                None => Outcome::retry(format!("POST {}: {}", target.url, crate::egress::client::describe(&e))),
            },
            Ok(r) => {
                let status = r.status();
                let detail = Some(status.as_u16().to_string());
                if status.is_success() {
                    Outcome::Confirmed { receipt: None, detail }
                } else if status.as_u16() == 429 || status.is_server_error() || status.as_u16() == 408 {
                    Outcome::Retryable {
                        reason: format!("the receiver answered {status}"),
                        retry_after: None,
                        detail,
                        fee_bump: false,
                    }
                } else {
                    Outcome::Permanent {
                        reason: format!("the receiver refused the webhook: {status}"),
                        detail,
                    }
                }
            }
        }
    }
}

/// The relay's lease and cursor name.
pub const RELAY: &str = "outcome-relay";

/// One relay pass as `owner`: every new outcome of a kind with a webhook
/// becomes an `outcome_webhook` op. Returns how many were enqueued (`None`
/// when another host holds the relay).
///
/// # Errors
///
/// The queue's error; the cursor then stays where it was.
pub async fn relay_once(
    queue: &dyn Queue,
    dispatcher: &crate::dispatch::Dispatcher,
    config: &Config,
    owner: &str,
) -> Result<Option<usize>, QueueError> {
    let every = Duration::from_millis(config.outcomes.relay_every_ms);
    if !queue
        .hold_singleton(RELAY, owner, (every * 20).max(Duration::from_secs(5)))
        .await?
    {
        return Ok(None);
    }
    let mut cursor = queue.feed_cursor(RELAY).await?;
    let mut sent = 0;
    loop {
        let entries = queue.outcomes(cursor.as_deref(), 500).await?;
        let Some(last) = entries.last() else {
            return Ok(Some(sent));
        };
        let last = last.cursor.clone();
        let mut ops = Vec::new();
        for entry in &entries {
            let Some(kind) = config.kinds.get(&entry.op.kind) else {
                continue;
            };
            if kind.outcome_webhook.is_none() || kind.outcome_webhook_key.is_none() {
                continue;
            }
            if entry.op.kind == WEBHOOK_KIND {
                continue;
            }
            let attempts = queue.attempts(entry.op.id).await?;
            let delivery = Delivery {
                kind: Some(entry.op.kind.clone()),
                url: None,
                id: format!("msg_{}_{}", entry.op.id, entry.cursor.replace('.', "_")),
                body: body(entry, attempts.last()).to_string(),
            };
            let payload = serde_json::to_string(&delivery).map_err(|e| QueueError::InvalidOp(e.to_string()))?;
            let mut op = NewOp::new(format!("outcomes:{}", entry.op.outbox), WEBHOOK_KIND, payload);
            op.lanes = vec![format!("outcome:{}", entry.op.id)];
            op.idempotency_key = Some(format!("outcome:{}", entry.cursor));
            op.correlation_id = Some(entry.op.id.to_string());
            ops.push(op);
        }
        if !ops.is_empty() {
            sent += ops.len();
            dispatcher.enqueue_internal(&ops).await?;
            crate::failpoint::hit(crate::failpoint::RELAY, RELAY).await;
        }
        queue.set_feed_cursor(RELAY, &last).await?;
        cursor = Some(last);
    }
}
