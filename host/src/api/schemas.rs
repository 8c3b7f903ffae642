//! The shapes producers' generated clients read, for the OpenAPI document
//! only: what the enqueue route answers, an outcome feed entry, and the
//! outcome webhook's body (an OpenAPI 3.1 `webhooks` entry). The handlers
//! build these documents with `json!`; the tests hold the two together by
//! calling the running binary with a client generated from this document.

#![allow(dead_code)]

use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

/// What one op's enqueue did.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub(super) enum EnqueueStatus {
    Created,
    Existing,
    AlreadyPending,
}

/// One op's enqueue: what happened and the op it concerns.
#[derive(Serialize, ToSchema)]
pub(super) struct EnqueueAnswer {
    status: EnqueueStatus,
    /// The op that carries the intent (new, the key's, or the pending one).
    id: i64,
    /// The op as stored (only `id` and `status` to a key without
    /// `outbox:read` that repeated a key).
    #[schema(value_type = Option<Object>)]
    op: Option<Value>,
    /// For a priced kind: the fee it is expected to pay.
    #[schema(value_type = Option<Object>)]
    estimate: Option<Value>,
    /// With `?wait=`: the op's terminal outcome.
    outcome: Option<WaitOutcome>,
    /// A repeated key whose op was pruned: its tombstone.
    #[schema(value_type = Option<Object>)]
    pruned: Option<Value>,
}

/// A waited-for op's outcome.
#[derive(Serialize, ToSchema)]
pub(super) struct WaitOutcome {
    status: String,
    attempts: Option<i64>,
    receipt: Option<String>,
    last_error: Option<String>,
}

/// A batch's answers, in the batch's order.
#[derive(Serialize, ToSchema)]
pub(super) struct BatchAnswer {
    results: Vec<EnqueueAnswer>,
}

/// What `POST /api/v1/ops` answers with 200: one op's answer, or a batch's.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
pub(super) enum EnqueueResult {
    One(EnqueueAnswer),
    Batch(BatchAnswer),
}

/// The op an outcome concerns (no payload).
#[derive(Serialize, ToSchema)]
pub(super) struct OutcomeOp {
    id: i64,
    kind: String,
    outbox: String,
    lanes: Vec<String>,
    /// critical, normal or low.
    priority: String,
    idempotency_key: Option<String>,
    correlation_id: Option<String>,
    subject: Option<String>,
    /// confirmed, failed or cancelled.
    status: String,
    attempts: i64,
    /// The executor's proof (a transaction hash), or its checkpoint on an
    /// op whose outcome is unknown.
    receipt: Option<String>,
    last_error: Option<String>,
    /// RFC 3339.
    finished_at: Option<String>,
}

/// One terminal transition.
#[derive(Serialize, ToSchema)]
pub(super) struct OutcomeEntry {
    /// Pass back as `after` to read on from here.
    cursor: String,
    /// confirmed, failed or cancelled.
    status: String,
    /// RFC 3339.
    at: String,
    op: OutcomeOp,
}

/// A page of the outcome feed.
#[derive(Serialize, ToSchema)]
pub(super) struct OutcomePage {
    outcomes: Vec<OutcomeEntry>,
    /// The cursor to ask from next time (`after` again when nothing is new).
    next: Option<String>,
}

/// The last attempt of an op whose outcome a webhook reports.
#[derive(Serialize, ToSchema)]
pub(super) struct FinalAttempt {
    attempt: i64,
    /// confirmed, retryable, permanent, plugin_fault, lease_expired or invalid.
    class: String,
    detail: Option<String>,
    error: Option<String>,
    fee: Option<i64>,
    finished_at: String,
}

/// The outcome's data: the feed's entry and the final attempt.
#[derive(Serialize, ToSchema)]
pub(super) struct OutcomeWebhookData {
    cursor: String,
    status: String,
    at: String,
    op: OutcomeOp,
    final_attempt: Option<FinalAttempt>,
}

/// The body of an outcome webhook (Standard Webhooks).
#[derive(Serialize, ToSchema)]
pub(super) struct OutcomeWebhook {
    /// `op.confirmed`, `op.failed` or `op.cancelled`.
    #[serde(rename = "type")]
    kind: String,
    /// RFC 3339: when the op reached it.
    timestamp: String,
    data: OutcomeWebhookData,
}

/// The document's `webhooks` entry (OpenAPI 3.1), which utoipa does not
/// model: the outcome webhook laneway POSTs to `kinds.KIND.outcome_webhook`.
pub(super) fn webhooks() -> Value {
    serde_json::json!({
        "op.outcome": {
            "post": {
                "summary": "An op reached confirmed, failed or cancelled",
                "description": "Sent to `kinds.KIND.outcome_webhook` for each terminal transition, signed as Standard \
                    Webhooks do: verify `webhook-signature` over `webhook-id.webhook-timestamp.body` with the kind's \
                    `outcome_webhook_key`. At least once: deduplicate by `webhook-id` (`msg_<op>_<cursor>`). Any \
                    answer but 2xx is retried with the kind's backoff.",
                "parameters": [
                    {"name": "webhook-id", "in": "header", "required": true, "schema": {"type": "string"}},
                    {"name": "webhook-timestamp", "in": "header", "required": true, "schema": {"type": "string"},
                     "description": "Unix seconds"},
                    {"name": "webhook-signature", "in": "header", "required": true, "schema": {"type": "string"},
                     "description": "`v1,<base64 HMAC-SHA256>`"}
                ],
                "requestBody": {
                    "required": true,
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OutcomeWebhook"}}}
                },
                "responses": {"200": {"description": "Received (any 2xx)"}}
            }
        }
    })
}
