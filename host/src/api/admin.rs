//! The outbox routes: seed 003's `/api/admin/outbox` (list, stats, one op,
//! retry, cancel), bulk recover, and the audit log. Reads need
//! `outbox:read`, writes `outbox:write`; every write is audited with the
//! state before and after.

use std::collections::HashSet;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::Json;
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::{json, Value};

use utoipa::{IntoParams, ToSchema};

use super::error::{BodyRefusals, Refusals};
use super::{ApiError, ApiState, ErrorBody};
use crate::op::{OpId, Priority, Status};
use crate::queue::OpFilter;

fn op_id(path: Result<Path<String>, PathRejection>) -> Result<OpId, ApiError> {
    let Path(id) = path?;
    id.parse::<OpId>()
        .ok()
        .filter(|id| *id > 0)
        .ok_or_else(|| ApiError::invalid(format!("op id: expected a positive integer, got {id:?}")))
}

/// The list's filters; each given one narrows it.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct ListQuery {
    /// pending, submitted, confirmed, failed or cancelled.
    #[param(value_type = Option<String>)]
    status: Option<Status>,
    kind: Option<String>,
    /// critical, normal or low.
    #[param(value_type = Option<String>)]
    priority: Option<Priority>,
    subject: Option<String>,
    outbox: Option<String>,
    /// Only ops in this lane (a recipient's inbox, a signer account).
    lane: Option<String>,
    correlation_id: Option<String>,
    /// Only ops enqueued at or after this time (RFC 3339).
    created_after: Option<DateTime<Utc>>,
    /// Only ops enqueued before this time (RFC 3339).
    created_before: Option<DateTime<Utc>>,
    /// The cursor: the `next` of the previous page.
    after: Option<OpId>,
    limit: Option<u32>,
    /// `asc` (default) or `desc`.
    order: Option<String>,
}

/// Ops matching the filters, in id order, a page at a time.
#[utoipa::path(get, path = "/api/admin/outbox", tag = "outbox",
    params(ListQuery),
    security(("bearer" = ["outbox:read"])),
    responses((status = 200, description = "`ops` (a page) and `next` (the cursor for `after`, null on the last page)", body = Value), Refusals))]
pub(super) async fn list(
    State(state): State<ApiState>,
    headers: HeaderMap,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    let Query(q) = query?;
    let limit = state.page_limit(q.limit)?;
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
            lane: q.lane,
            correlation_id: q.correlation_id,
            created_after: q.created_after,
            created_before: q.created_before,
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

/// Queue depth by status, priority and kind, and per kind and outbox how
/// long the oldest due op has waited.
#[utoipa::path(get, path = "/api/admin/outbox/stats", tag = "outbox",
    security(("bearer" = ["outbox:read"])),
    responses((status = 200, description = "`depth` ({status, priority, kind, count}), `oldest_due` ({kind, outbox, due_at, age_seconds}), `stuck_submitted`, `lanes_held`, `subjects_halted`", body = Value), Refusals))]
pub(super) async fn stats(State(state): State<ApiState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    let depth = state.queue().depth().await?;
    let gauges = state.queue().gauges().await?;
    let now = Utc::now();
    let oldest: Vec<Value> = gauges
        .oldest_due
        .iter()
        .map(|d| {
            let age = (now - d.due_at).num_milliseconds().max(0);
            #[allow(clippy::cast_precision_loss)]
            let age_seconds = age as f64 / 1000.0;
            json!({ "kind": d.kind, "outbox": d.outbox, "due_at": d.due_at, "age_seconds": age_seconds })
        })
        .collect();
    Ok(Json(json!({
        "depth": depth,
        "oldest_due": oldest,
        "stuck_submitted": gauges.stuck_submitted,
        "lanes_held": gauges.lanes_held,
        "subjects_halted": gauges.subjects_halted,
    })))
}

/// How far back `activity` looks, and the most outcomes it counts.
const ACTIVITY_WINDOW: chrono::TimeDelta = chrono::TimeDelta::hours(1);
const ACTIVITY_ROWS: u32 = 100_000;

/// Ops that reached each terminal status in the last hour (counted over
/// the newest outcomes only, so the answer costs the same at any size).
#[utoipa::path(get, path = "/api/admin/outbox/activity", tag = "outbox",
    security(("bearer" = ["outbox:read"])),
    responses((status = 200, description = "`window_seconds` (3600), `counts` ({status, count, since}), `covered_seconds` (less than the window when more outcomes came than are counted), `failure_rate` (failed of confirmed and failed), `per_minute` (60 of {minute, confirmed, failed, cancelled, retried}, oldest first; retried: attempts that failed short of a confirmation)", body = Value), Refusals))]
pub(super) async fn activity(State(state): State<ApiState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    let now = Utc::now();
    let minutes = state
        .queue()
        .recent_minutes(now - ACTIVITY_WINDOW, ACTIVITY_ROWS)
        .await?;
    let counts = status_counts(&minutes);
    let total: i64 = counts.iter().map(|c| c.count).sum();
    let covered = if total >= i64::from(ACTIVITY_ROWS) {
        counts
            .iter()
            .map(|c| c.since)
            .min()
            .map_or(0, |since| (now - since).num_seconds())
    } else {
        ACTIVITY_WINDOW.num_seconds()
    };
    let of = |status: Status| {
        counts
            .iter()
            .filter(|c| c.status == status)
            .map(|c| c.count)
            .sum::<i64>()
    };
    let (confirmed, failed) = (of(Status::Confirmed), of(Status::Failed));
    #[allow(clippy::cast_precision_loss)]
    let failure_rate = if confirmed + failed > 0 {
        Some(failed as f64 / (confirmed + failed) as f64)
    } else {
        None
    };
    Ok(Json(json!({
        "window_seconds": ACTIVITY_WINDOW.num_seconds(),
        "covered_seconds": covered,
        "counts": counts,
        "failure_rate": failure_rate,
        "per_minute": per_minute(&minutes, now),
    })))
}

/// The minutes' terminal transitions summed per status (the earliest of
/// each kept), in status order.
fn status_counts(minutes: &[crate::queue::MinuteCount]) -> Vec<crate::queue::OutcomeCount> {
    let mut by_status: std::collections::BTreeMap<&str, (i64, DateTime<Utc>)> = std::collections::BTreeMap::new();
    for m in minutes.iter().filter(|m| m.what != crate::queue::RETRIED) {
        let entry = by_status.entry(m.what.as_str()).or_insert((0, m.since));
        entry.0 += m.count;
        entry.1 = entry.1.min(m.since);
    }
    by_status
        .into_iter()
        .filter_map(|(what, (count, since))| {
            Some(crate::queue::OutcomeCount {
                status: what.parse().ok()?,
                count,
                since,
            })
        })
        .collect()
}

/// The last hour as 60 minutes, oldest first, each with its confirmed,
/// dead-lettered (`failed`), `cancelled` and `retried` counts (zeros where
/// nothing happened), for the overview's chart.
fn per_minute(counts: &[crate::queue::MinuteCount], now: DateTime<Utc>) -> Vec<Value> {
    let minutes = ACTIVITY_WINDOW.num_minutes();
    let this_minute = now.timestamp() / 60;
    (0..minutes)
        .map(|i| {
            let start = this_minute - (minutes - 1 - i);
            let of = |what: &str| {
                counts
                    .iter()
                    .filter(|c| c.minute.timestamp() / 60 == start && c.what == what)
                    .map(|c| c.count)
                    .sum::<i64>()
            };
            json!({
                "minute": DateTime::<Utc>::from_timestamp(start * 60, 0),
                "confirmed": of("confirmed"), "failed": of("failed"),
                "cancelled": of("cancelled"), "retried": of("retried"),
            })
        })
        .collect()
}

/// Every dead letter counted by kind, last attempt class and whether its
/// outcome is unknown (what the console's dead-letter page groups by).
#[utoipa::path(get, path = "/api/admin/outbox/dead-letters", tag = "outbox",
    security(("bearer" = ["outbox:read"])),
    responses((status = 200, description = "`groups` ({kind, class, unknown, count, newest}), largest first; `class` is the last attempt's (permanent, retryable, plugin_fault, lease_expired, invalid) or null", body = Value), Refusals))]
pub(super) async fn dead_letters(State(state): State<ApiState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    Ok(Json(json!({ "groups": state.queue().dead_letter_groups().await? })))
}

/// One op: the row, its lanes, and every attempt.
#[utoipa::path(get, path = "/api/admin/outbox/{id}", tag = "outbox",
    params(("id" = i64, Path, description = "The op id")),
    security(("bearer" = ["outbox:read"])),
    responses((status = 200, description = "`op` and `attempts` (oldest first)", body = Value),
        (status = 404, description = "`not_found`", body = ErrorBody), Refusals))]
pub(super) async fn show(
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

/// Puts a dead letter back to pending with a fresh attempt budget.
#[utoipa::path(post, path = "/api/admin/outbox/{id}/retry", tag = "outbox",
    params(("id" = i64, Path, description = "The op id")),
    security(("bearer" = ["outbox:write"])),
    responses((status = 200, description = "`op`, pending again", body = Value),
        (status = 404, description = "`not_found`", body = ErrorBody),
        (status = 409, description = "`illegal_transition` (not failed), `conflict` (its coalesce key is pending again)", body = ErrorBody), Refusals))]
pub(super) async fn retry(
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

/// Cancels a pending op.
#[utoipa::path(post, path = "/api/admin/outbox/{id}/cancel", tag = "outbox",
    params(("id" = i64, Path, description = "The op id")),
    security(("bearer" = ["outbox:write"])),
    responses((status = 200, description = "`op`, cancelled", body = Value),
        (status = 404, description = "`not_found`", body = ErrorBody),
        (status = 409, description = "`illegal_transition` (not pending), `in_doubt` (a receipt is not proven)", body = ErrorBody), Refusals))]
pub(super) async fn cancel(
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

/// Which dead letters to recover.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RecoverBody {
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
    /// At most this many, the oldest (by id) first; absent: no limit
    /// (up to 100,000).
    limit: Option<usize>,
    /// What a preview (`dry_run`) answered in `would_recover`: then only
    /// these are recovered, each if it still matches, and nothing else; the
    /// answer says how the set changed since (`changed`: named but no longer
    /// a matching dead letter; `not_in_preview`: matching but not named).
    #[serde(default)]
    ids: Option<Vec<OpId>>,
}

/// Bulk retry of dead letters by filter and time window. The first
/// `recover_per_second` are due at once, the rest spread over the seconds
/// after, so a redrive cannot stampede a receiver that just came back.
#[utoipa::path(post, path = "/api/admin/outbox/recover", tag = "outbox",
    request_body = RecoverBody,
    security(("bearer" = ["outbox:write"])),
    responses((status = 200, description = "`recovered`, `skipped` (changed meanwhile or coalesce conflict), `unknown_left_out`, `over_seconds`; with `ids`, `changed` (named, no longer matching) and `not_in_preview` (matching, not named, left alone); with `dry_run`, `would_recover`", body = Value), Refusals, BodyRefusals))]
pub(super) async fn recover(
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
    if body.ids.as_ref().is_some_and(|ids| ids.len() > MAX_RECOVER) {
        return Err(ApiError::invalid(format!("ids: at most {MAX_RECOVER}")));
    }
    let named: HashSet<OpId> = body.include_unknown.iter().copied().collect();
    let previewed: Option<HashSet<OpId>> = body.ids.as_ref().map(|ids| ids.iter().copied().collect());
    // Named ids define the set: every matching dead letter is looked at
    // (to count those not named), up to twice the most one recover takes.
    let (limit, scan_max) = match &previewed {
        Some(ids) => (ids.len(), 2 * MAX_RECOVER),
        None => (limit, usize::MAX),
    };
    let mut not_in_preview = 0usize;
    let mut scanned = 0usize;
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
            scanned += 1;
            if scanned > scan_max {
                break 'pages;
            }
            let failed_at = op.finished_at.unwrap_or(op.updated_at);
            if body.failed_after.is_some_and(|a| failed_at < a) || body.failed_before.is_some_and(|b| failed_at >= b) {
                continue;
            }
            if previewed.as_ref().is_some_and(|ids| !ids.contains(&op.id)) {
                not_in_preview += 1;
                continue;
            }
            if op.receipt.is_some() && !named.contains(&op.id) {
                unknown_left_out.push(op.id);
                continue;
            }
            if chosen.len() < limit {
                chosen.push((op.id, op.outbox));
            } else if previewed.is_none() {
                break 'pages;
            }
        }
    }
    let changed: Vec<OpId> = previewed.as_ref().map_or_else(Vec::new, |ids| {
        let found: HashSet<OpId> = chosen
            .iter()
            .map(|(id, _)| *id)
            .chain(unknown_left_out.iter().copied())
            .collect();
        let mut gone: Vec<OpId> = ids.iter().copied().filter(|id| !found.contains(id)).collect();
        gone.sort_unstable();
        gone
    });
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
        "over_seconds": seconds, "changed": changed, "not_in_preview": not_in_preview,
    })))
}

/// A page of the audit log, newest first.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct AuditQuery {
    /// The cursor: the `next` of the previous page.
    before: Option<i64>,
    limit: Option<u32>,
}

/// Every operator write (API and CLI): who, what, on what, before and after.
#[utoipa::path(get, path = "/api/admin/audit", tag = "outbox",
    params(AuditQuery),
    security(("bearer" = ["outbox:read"])),
    responses((status = 200, description = "`entries` (newest first) and `next` (the cursor for `before`)", body = Value), Refusals))]
pub(super) async fn audit(
    State(state): State<ApiState>,
    headers: HeaderMap,
    query: Result<Query<AuditQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    let Query(q) = query?;
    let limit = state.page_limit(q.limit)?;
    let entries = state.queue().audit_log(q.before, limit).await?;
    let next = if entries.len() == limit as usize {
        entries.last().map(|e| e.id)
    } else {
        None
    };
    Ok(Json(json!({ "entries": entries, "next": next })))
}
