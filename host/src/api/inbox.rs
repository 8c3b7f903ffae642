//! The ActivityPub inboxes (`[inbound] enabled`): `POST /inbox/{actor}` and
//! the shared `POST /inbox`. Each request's signature is verified
//! (`inbound`), its key's owner must be the activity's actor, and the
//! activity becomes an op of the inbound kind in its sender's lane
//! (`sender:ACTOR`, strict, so one sender's activities are processed in
//! order), keyed by its id (a replay answers 202 and adds nothing). The
//! op is then processed, retried and dead-lettered like any other. A
//! verified activity also tells destination health that its server is up.

use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::{ApiError, ApiState, ErrorBody};
use crate::inbound::{self, InboundError, Received};
use crate::queue::{Enqueued, NewOp};

/// Delivers an activity to one actor's inbox.
#[utoipa::path(post, path = "/inbox/{actor}", tag = "inbound",
    params(("actor" = String, Path, description = "The local actor the activity is addressed to")),
    request_body(content = Value, content_type = "application/activity+json",
        description = "An activity, signed with an HTTP signature (draft-cavage or RFC 9421)"),
    responses((status = 202, description = "Accepted: `id` (the op) and `result` (`created`, or `existing` for a replay)", body = Value),
        (status = 400, description = "`not_an_activity`", body = ErrorBody),
        (status = 401, description = "`bad_signature`: unsigned, malformed, not verifiable or not the actor's", body = ErrorBody),
        (status = 429, description = "`busy`: too many key fetches for the sender's origin just now", body = ErrorBody),
        (status = 404, description = "`not_found`: inboxes are not enabled", body = ErrorBody),
        (status = 413, description = "`body_too_large`: over `[api] max_body_bytes`", body = ErrorBody)))]
pub(super) async fn personal(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let Path(actor) = path?;
    receive(&state, Some(actor), &uri, &headers, &body).await
}

/// Delivers an activity to the shared inbox.
#[utoipa::path(post, path = "/inbox", tag = "inbound",
    request_body(content = Value, content_type = "application/activity+json",
        description = "An activity, signed with an HTTP signature (draft-cavage or RFC 9421)"),
    responses((status = 202, description = "Accepted: `id` (the op) and `result` (`created`, or `existing` for a replay)", body = Value),
        (status = 400, description = "`not_an_activity`", body = ErrorBody),
        (status = 401, description = "`bad_signature`", body = ErrorBody),
        (status = 429, description = "`busy`: too many key fetches for the sender's origin just now", body = ErrorBody),
        (status = 404, description = "`not_found`: inboxes are not enabled", body = ErrorBody),
        (status = 413, description = "`body_too_large`: over `[api] max_body_bytes`", body = ErrorBody)))]
pub(super) async fn shared(
    State(state): State<ApiState>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    receive(&state, None, &uri, &headers, &body).await
}

/// The outbox inbound ops are enqueued in (the recipient is in the payload).
pub const INBOUND_OUTBOX: &str = "inbound";

fn refused(e: &InboundError) -> ApiError {
    match e {
        InboundError::NotAnActivity(_) => ApiError::new(StatusCode::BAD_REQUEST, "not_an_activity", e.to_string()),
        InboundError::Busy(_) => ApiError::new(StatusCode::TOO_MANY_REQUESTS, "busy", e.to_string()),
        _ => ApiError::new(StatusCode::UNAUTHORIZED, "bad_signature", e.to_string()),
    }
}

async fn receive(
    state: &ApiState,
    recipient: Option<String>,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let config = state.dispatcher().config();
    let inbound_config = &config.inbound;
    let inbound = state.inbound();
    let Some(keys) = inbound.keys.as_deref().filter(|_| inbound_config.enabled) else {
        return Err(ApiError::not_found(
            "inboxes are not enabled ([inbound] enabled = true)",
        ));
    };
    let header_list = crate::inbound::header_pairs(headers);
    let path_and_query = uri.path_and_query().map_or("/", |p| p.as_str());
    let target_uri = if inbound_config.public_url.is_empty() {
        let host = headers.get("host").and_then(|h| h.to_str().ok()).unwrap_or("localhost");
        format!("http://{host}{path_and_query}")
    } else {
        format!("{}{path_and_query}", inbound_config.public_url.trim_end_matches('/'))
    };
    let request = Received {
        method: "POST",
        target_uri: &target_uri,
        headers: &header_list,
        body,
    };
    let activity = inbound::activity(body).map_err(|e| refused(&e))?;
    let signature = inbound::parse(&request).map_err(|e| refused(&e))?;
    let skew = std::time::Duration::from_millis(inbound_config.clock_skew_ms);
    let signed = inbound::signed_bytes(&signature, &request, chrono::Utc::now(), skew).map_err(|e| refused(&e))?;
    let signature_bytes = match &signature {
        inbound::Signature::Cavage { signature, .. } | inbound::Signature::Rfc9421 { signature, .. } => signature,
    };
    let owner = keys
        .verify(signature.key_id(), &signed, signature_bytes)
        .await
        .map_err(|e| refused(&e))?;
    if owner != activity.actor {
        return Err(refused(&InboundError::Unverified(format!(
            "signed by {owner}, but the activity's actor is {}",
            activity.actor
        ))));
    }
    let kind = config.kind(&inbound_config.kind).map_err(ApiError::not_found)?;
    // The activity is handed on byte for byte as the sender signed it.
    #[derive(serde::Serialize)]
    struct Payload<'a> {
        recipient: Option<String>,
        sender: &'a str,
        key_id: &'a str,
        signature: &'a str,
        activity: &'a serde_json::value::RawValue,
    }
    let raw: &serde_json::value::RawValue = std::str::from_utf8(body)
        .ok()
        .and_then(|text| serde_json::from_str(text).ok())
        .ok_or_else(|| refused(&InboundError::NotAnActivity("not UTF-8 JSON".into())))?;
    let payload = serde_json::to_string(&Payload {
        recipient,
        sender: &activity.actor,
        key_id: signature.key_id(),
        signature: signature.scheme(),
        activity: raw,
    })
    .map_err(|e| refused(&InboundError::NotAnActivity(e.to_string())))?;
    // One outbox for every inbox: a lane orders an outbox's ops, so one
    // sender's activities to several inboxes stay in order.
    crate::failpoint::hit(crate::failpoint::INBOUND, INBOUND_OUTBOX).await;
    let mut op = NewOp::new(INBOUND_OUTBOX, inbound_config.kind.clone(), payload);
    op.priority = kind.priority;
    op.lanes = vec![format!("sender:{}", activity.actor)];
    op.idempotency_key = Some(activity.id.clone());
    op.correlation_id = Some(activity.id.clone());
    let result = state
        .dispatcher()
        .enqueue_internal(std::slice::from_ref(&op))
        .await?
        .first()
        .copied()
        .ok_or_else(|| ApiError::from(crate::queue::QueueError::InvalidOp("no enqueue result".into())))?;
    crate::failpoint::hit(crate::failpoint::ACCEPTED, INBOUND_OUTBOX).await;
    // The sender's server is evidently up: a held destination goes again.
    if let Some(host) = crate::breaker::destination(&activity.actor) {
        if let Err(e) = state.dispatcher().destination_heard_from(host).await {
            tracing::warn!(destination = %host, error = %e, "Could not record an inbound activity's host as up.");
        }
    }
    let (id, what) = match result {
        Enqueued::Created(id) => (id, "created"),
        Enqueued::Existing(id) | Enqueued::AlreadyPending(id) => (id, "existing"),
    };
    tracing::info!(activity = %activity.id, sender = %activity.actor, op = id, result = what, scheme = signature.scheme(), "Inbound activity accepted.");
    Ok((StatusCode::ACCEPTED, Json(json!({ "id": id, "result": what }))).into_response())
}
