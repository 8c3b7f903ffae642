//! The outcome feed for pollers (scope `outcomes:read`):
//! `GET /api/v1/outcomes?after=CURSOR` pages through every transition of an
//! op into a terminal status, in order, from a cursor that survives
//! restarts (the `outcomes` table). A producer keeps the last `next` it
//! processed and asks again from there; nothing is skipped or reordered.
//! Filters (outbox, kind, status) and laneway's own kinds (left out unless
//! asked for) apply to each page as read: a page may hold fewer than
//! `limit` entries, or none, and `next` still moves past what was read, so
//! a filtered poll costs what an unfiltered one does.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use utoipa::IntoParams;

use super::error::Refusals;
use super::{ApiError, ApiState};
use crate::queue::{FeedFilter, OutcomeEntry};

/// A page of the feed.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct FeedQuery {
    /// The cursor: the `next` of the previous page (from the start when
    /// absent).
    after: Option<String>,
    /// Read at most this many transitions (≤ `api.max_page`; default 100);
    /// the filters then keep those that match.
    limit: Option<u32>,
    /// Only this outbox's ops.
    outbox: Option<String>,
    /// Only ops of this kind.
    kind: Option<String>,
    /// Only transitions to this status (`confirmed`, `failed`, `cancelled`).
    status: Option<String>,
    /// Also laneway's own ops (outcome webhooks, inbound activities); left
    /// out by default.
    #[serde(default)]
    internal: bool,
}

/// Terminal transitions after the cursor, oldest first.
#[utoipa::path(get, path = "/api/v1/outcomes", tag = "producer",
    params(FeedQuery),
    security(("bearer" = ["outcomes:read"])),
    responses((status = 200, description = "`outcomes` ({cursor, status, at, op: {id, kind, outbox, lanes, idempotency_key, correlation_id, status, attempts, receipt, last_error, …}}) that pass the filters, and `next`: the cursor to ask from next time, past every transition read (the same as `after` when nothing is new)", body = super::schemas::OutcomePage), Refusals))]
pub(super) async fn feed(
    State(state): State<ApiState>,
    headers: HeaderMap,
    query: Result<Query<FeedQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let actor = state.authorize(&headers, "outcomes:read").await?;
    let Query(q) = query?;
    if let Some(outbox) = &q.outbox {
        actor.must_cover(outbox)?;
    }
    let limit = state.page_limit(q.limit)?;
    let status: Option<crate::op::Status> = match q.status.as_deref() {
        None => None,
        Some(s @ ("confirmed" | "failed" | "cancelled")) => s.parse().ok(),
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "status: expected confirmed, failed or cancelled, got {other:?}"
            )))
        }
    };
    let entries = state.queue().outcomes(q.after.as_deref(), limit).await?;
    let next = entries.last().map(|e| e.cursor.clone()).or(q.after);
    let config = state.dispatcher().config();
    let filter = FeedFilter {
        outbox: q.outbox,
        kind: q.kind,
        status,
        internal: q.internal,
    };
    let wanted =
        |e: &&OutcomeEntry| actor.covers(&e.op.outbox) && filter.wants(e, |kind| config.is_internal_kind(kind));
    let outcomes: Vec<Value> = entries.iter().filter(wanted).map(OutcomeEntry::summary).collect();
    Ok(Json(json!({ "outcomes": outcomes, "next": next })))
}
