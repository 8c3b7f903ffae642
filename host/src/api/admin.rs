//! The admin routes: seed 003's `/api/admin/outbox` (list, stats, one op,
//! retry, cancel) plus bulk recover, pauses, lanes held by dead letters,
//! halted subjects, breakers and the audit log. Reads need `outbox:read`,
//! writes `outbox:write`; every write is audited with the state before and
//! after.

use std::collections::HashSet;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{ApiError, ApiState};
use crate::op::{OpId, Priority, Status};
use crate::queue::{OpFilter, PauseScope};

pub(super) fn routes() -> Router<ApiState> {
    Router::new()
        .route("/api/admin/outbox", get(list))
        .route("/api/admin/outbox/stats", get(stats))
        .route("/api/admin/outbox/recover", post(recover))
        .route("/api/admin/outbox/{id}", get(show))
        .route("/api/admin/outbox/{id}/retry", post(retry))
        .route("/api/admin/outbox/{id}/cancel", post(cancel))
        .route("/api/admin/pauses", get(pauses).post(pause))
        .route("/api/admin/pauses/{scope}/{target}", delete(resume))
        .route("/api/admin/lanes", get(lanes))
        .route("/api/admin/lanes/skip", post(skip_lane))
        .route("/api/admin/subjects", get(subjects))
        .route("/api/admin/subjects/halt", post(halt_subject))
        .route("/api/admin/subjects/unhalt", post(unhalt_subject))
        .route("/api/admin/breakers", get(breakers))
        .route("/api/admin/audit", get(audit))
}

fn op_id(path: Result<Path<String>, PathRejection>) -> Result<OpId, ApiError> {
    let Path(id) = path?;
    id.parse::<OpId>()
        .ok()
        .filter(|id| *id > 0)
        .ok_or_else(|| ApiError::invalid(format!("op id: expected a positive integer, got {id:?}")))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    status: Option<Status>,
    kind: Option<String>,
    priority: Option<Priority>,
    subject: Option<String>,
    outbox: Option<String>,
    /// The cursor: the `next` of the previous page.
    after: Option<OpId>,
    limit: Option<u32>,
    /// `asc` (default) or `desc`.
    order: Option<String>,
}

async fn list(
    State(state): State<ApiState>,
    headers: HeaderMap,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    let Query(q) = query?;
    let max = state.dispatcher().config().api.max_page;
    let limit = q.limit.unwrap_or(100);
    if !(1..=max).contains(&limit) {
        return Err(ApiError::invalid(format!("limit: expected 1 to {max}, got {limit}")));
    }
    let newest_first = match q.order.as_deref() {
        None | Some("asc") => false,
        Some("desc") => true,
        Some(other) => return Err(ApiError::invalid(format!("order: expected asc or desc, got {other:?}"))),
    };
    let ops = state
        .queue()
        .list(&OpFilter {
            status: q.status,
            kind: q.kind,
            priority: q.priority,
            subject: q.subject,
            outbox: q.outbox,
            after_id: q.after,
            limit,
            newest_first,
        })
        .await?;
    let next = if ops.len() == limit as usize {
        ops.last().map(|o| o.id)
    } else {
        None
    };
    Ok(Json(json!({ "ops": ops, "next": next })))
}

async fn stats(State(state): State<ApiState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    let depth = state.queue().depth().await?;
    Ok(Json(json!({ "depth": depth })))
}

async fn show(
    State(state): State<ApiState>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    let id = op_id(path)?;
    let op = state
        .queue()
        .get(id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no op {id}")))?;
    let attempts = state.queue().attempts(id).await?;
    Ok(Json(json!({ "op": op, "attempts": attempts })))
}

async fn retry(
    State(state): State<ApiState>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<Value>, ApiError> {
    let actor = state.authorize(&headers, "outbox:write").await?;
    let id = op_id(path)?;
    let before = state.queue().get(id).await?;
    let op = state.queue().force_retry(id).await?;
    state.dispatcher().trigger(&op.outbox);
    state
        .audit(
            &actor,
            "op.retry",
            format!("op:{id}"),
            before.map(|o| json!(o)),
            Some(json!(op)),
        )
        .await?;
    Ok(Json(json!({ "op": op })))
}

async fn cancel(
    State(state): State<ApiState>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<Value>, ApiError> {
    let actor = state.authorize(&headers, "outbox:write").await?;
    let id = op_id(path)?;
    let before = state.queue().get(id).await?;
    let op = state.queue().cancel(id).await?;
    state
        .audit(
            &actor,
            "op.cancel",
            format!("op:{id}"),
            before.map(|o| json!(o)),
            Some(json!(op)),
        )
        .await?;
    Ok(Json(json!({ "op": op })))
}

/// Most dead letters one recover puts back.
const MAX_RECOVER: usize = 100_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecoverBody {
    kind: Option<String>,
    outbox: Option<String>,
    /// Only dead letters that failed at or after this time.
    failed_after: Option<DateTime<Utc>>,
    /// Only dead letters that failed before this time.
    failed_before: Option<DateTime<Utc>>,
    /// Report what would be recovered; change nothing.
    #[serde(default)]
    dry_run: bool,
    /// Dead letters whose outcome is unknown (a receipt never proven landed
    /// or dead) to recover anyway, by id; others like them are left out.
    #[serde(default)]
    include_unknown: Vec<OpId>,
    /// At most this many.
    limit: Option<usize>,
}

/// Bulk retry of dead letters by filter and time window. The first
/// `recover_per_second` are due at once, the rest spread over the seconds
/// after, so a redrive cannot stampede a receiver that just came back.
async fn recover(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Result<Json<RecoverBody>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let actor = state.authorize(&headers, "outbox:write").await?;
    let Json(body) = body?;
    let limit = body.limit.unwrap_or(MAX_RECOVER);
    if !(1..=MAX_RECOVER).contains(&limit) {
        return Err(ApiError::invalid(format!(
            "limit: expected 1 to {MAX_RECOVER}, got {limit}"
        )));
    }
    if let (Some(a), Some(b)) = (body.failed_after, body.failed_before) {
        if a >= b {
            return Err(ApiError::invalid("failed_after must be before failed_before"));
        }
    }
    let named: HashSet<OpId> = body.include_unknown.iter().copied().collect();
    let mut chosen = Vec::new();
    let mut unknown_left_out = Vec::new();
    let mut after = None;
    'pages: loop {
        let page = state
            .queue()
            .list(&OpFilter {
                status: Some(Status::Failed),
                kind: body.kind.clone(),
                outbox: body.outbox.clone(),
                after_id: after,
                limit: 1000,
                ..OpFilter::default()
            })
            .await?;
        let Some(last) = page.last() else {
            break;
        };
        after = Some(last.id);
        for op in page {
            let failed_at = op.finished_at.unwrap_or(op.updated_at);
            if body.failed_after.is_some_and(|a| failed_at < a) || body.failed_before.is_some_and(|b| failed_at >= b) {
                continue;
            }
            if op.receipt.is_some() && !named.contains(&op.id) {
                unknown_left_out.push(op.id);
                continue;
            }
            chosen.push((op.id, op.outbox));
            if chosen.len() >= limit {
                break 'pages;
            }
        }
    }
    let ids: Vec<OpId> = chosen.iter().map(|(id, _)| *id).collect();
    if body.dry_run {
        return Ok(Json(json!({
            "dry_run": true, "would_recover": ids, "unknown_left_out": unknown_left_out,
        })));
    }
    let rate = usize::try_from(state.dispatcher().config().api.recover_per_second)
        .unwrap_or(1)
        .max(1);
    let now = Utc::now();
    let due_at = |i: usize| now + chrono::Duration::seconds(i64::try_from(i / rate).unwrap_or(i64::MAX / 1000));
    let mut recovered = Vec::with_capacity(ids.len());
    let mut skipped = Vec::new();
    let mut outboxes = HashSet::new();
    // A thousand per transaction: one commit each, bounded lock time.
    for (c, chunk) in chosen.chunks(1000).enumerate() {
        let due: Vec<(OpId, DateTime<Utc>)> = chunk
            .iter()
            .enumerate()
            .map(|(j, (id, _))| (*id, due_at(c * 1000 + j)))
            .collect();
        let retried: HashSet<OpId> = state.queue().retry_dead_letters(&due).await?.into_iter().collect();
        for (j, (id, outbox)) in chunk.iter().enumerate() {
            if retried.contains(id) {
                recovered.push(*id);
                outboxes.insert(outbox.clone());
                continue;
            }
            // Not retried in the batch: a coalesce key (whose retry may
            // conflict with a pending op) or a change since the listing.
            match state.queue().force_retry(*id).await {
                Ok(_) => {
                    let at = due_at(c * 1000 + j);
                    if at > now {
                        state.queue().defer(*id, at).await?;
                    }
                    recovered.push(*id);
                    outboxes.insert(outbox.clone());
                }
                Err(crate::queue::QueueError::Illegal { .. } | crate::queue::QueueError::Conflict { .. }) => {
                    skipped.push(*id);
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    for outbox in &outboxes {
        state.dispatcher().trigger(outbox);
    }
    let target = json!({
        "kind": body.kind, "outbox": body.outbox,
        "failed_after": body.failed_after, "failed_before": body.failed_before,
    });
    let seconds = recovered.len().div_ceil(rate);
    state
        .audit(
            &actor,
            "op.recover",
            format!("dead letters {target}"),
            None,
            Some(json!({ "recovered": recovered, "skipped": skipped, "over_seconds": seconds })),
        )
        .await?;
    Ok(Json(json!({
        "recovered": recovered, "skipped": skipped, "unknown_left_out": unknown_left_out,
        "over_seconds": seconds,
    })))
}

async fn pauses(State(state): State<ApiState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    Ok(Json(json!({ "pauses": state.queue().pauses().await? })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    scope: PauseScope,
    target: String,
    reason: Option<String>,
}

async fn pause(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Result<Json<PauseBody>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let actor = state.authorize(&headers, "outbox:write").await?;
    let Json(body) = body?;
    if body.target.trim().is_empty() || body.target.len() > 1000 {
        return Err(ApiError::invalid("target: expected 1 to 1000 characters"));
    }
    let paused = state
        .queue()
        .pause(body.scope, &body.target, body.reason.as_deref(), &actor.0)
        .await?;
    if paused {
        state
            .audit(
                &actor,
                "pause",
                format!("{}:{}", body.scope.as_str(), body.target),
                None,
                Some(json!({ "reason": body.reason })),
            )
            .await?;
    }
    Ok(Json(json!({ "paused": paused })))
}

async fn resume(
    State(state): State<ApiState>,
    headers: HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<Value>, ApiError> {
    let actor = state.authorize(&headers, "outbox:write").await?;
    let Path((scope, target)) = path?;
    let scope = PauseScope::parse(&scope)
        .ok_or_else(|| ApiError::invalid(format!("scope: expected kind, outbox or destination, got {scope:?}")))?;
    if !state.queue().resume(scope, &target).await? {
        return Err(ApiError::not_found(format!(
            "{} {target:?} is not paused",
            scope.as_str()
        )));
    }
    state
        .audit(&actor, "resume", format!("{}:{target}", scope.as_str()), None, None)
        .await?;
    // The next full read of every host sees it; this host's outbox at once.
    if scope == PauseScope::Outbox {
        state.dispatcher().trigger(&target);
    }
    Ok(Json(json!({ "resumed": true })))
}

async fn lanes(State(state): State<ApiState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    Ok(Json(json!({ "held": state.queue().lane_halts(None).await? })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LaneBody {
    outbox: String,
    lane: String,
}

async fn skip_lane(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Result<Json<LaneBody>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let actor = state.authorize(&headers, "outbox:write").await?;
    let Json(body) = body?;
    let released = state.queue().skip_lane(&body.outbox, &body.lane).await?;
    if released == 0 {
        return Err(ApiError::not_found(format!(
            "lane {:?} of outbox {:?} is not held",
            body.lane, body.outbox
        )));
    }
    state.dispatcher().trigger(&body.outbox);
    state
        .audit(
            &actor,
            "lane.skip",
            format!("lane:{}:{}", body.outbox, body.lane),
            None,
            Some(json!({ "released": released })),
        )
        .await?;
    Ok(Json(json!({ "released": released })))
}

async fn subjects(State(state): State<ApiState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    Ok(Json(json!({ "halted": state.queue().halted_subjects().await? })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SubjectBody {
    subject: String,
    reason: Option<String>,
}

async fn halt_subject(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Result<Json<SubjectBody>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let actor = state.authorize(&headers, "outbox:write").await?;
    let Json(body) = body?;
    if body.subject.trim().is_empty() {
        return Err(ApiError::invalid("subject: expected a non-empty string"));
    }
    state
        .queue()
        .halt_subject(&body.subject, body.reason.as_deref())
        .await?;
    state
        .audit(
            &actor,
            "subject.halt",
            format!("subject:{}", body.subject),
            None,
            Some(json!({ "reason": body.reason })),
        )
        .await?;
    Ok(Json(json!({ "halted": true })))
}

async fn unhalt_subject(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Result<Json<SubjectBody>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let actor = state.authorize(&headers, "outbox:write").await?;
    let Json(body) = body?;
    if !state.queue().unhalt_subject(&body.subject).await? {
        return Err(ApiError::not_found(format!("subject {:?} is not halted", body.subject)));
    }
    state
        .audit(
            &actor,
            "subject.unhalt",
            format!("subject:{}", body.subject),
            None,
            None,
        )
        .await?;
    Ok(Json(json!({ "unhalted": true })))
}

async fn breakers(State(state): State<ApiState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    let open: Vec<Value> = state
        .dispatcher()
        .breakers_open()
        .into_iter()
        .map(|(destination, until)| json!({ "destination": destination, "open_until": until }))
        .collect();
    Ok(Json(json!({ "open": open })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditQuery {
    before: Option<i64>,
    limit: Option<u32>,
}

async fn audit(
    State(state): State<ApiState>,
    headers: HeaderMap,
    query: Result<Query<AuditQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    let Query(q) = query?;
    let max = state.dispatcher().config().api.max_page;
    let limit = q.limit.unwrap_or(100);
    if !(1..=max).contains(&limit) {
        return Err(ApiError::invalid(format!("limit: expected 1 to {max}, got {limit}")));
    }
    let entries = state.queue().audit_log(q.before, limit).await?;
    let next = if entries.len() == limit as usize {
        entries.last().map(|e| e.id)
    } else {
        None
    };
    Ok(Json(json!({ "entries": entries, "next": next })))
}
