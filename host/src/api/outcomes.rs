//! The outcome feed for pollers (scope `outcomes:read`):
//! `GET /api/v1/outcomes?after=CURSOR` pages through every transition of an
//! op into a terminal status, in order, from a cursor that survives
//! restarts (the `outcomes` table). A producer keeps the last `next` it
//! processed and asks again from there; nothing is skipped or reordered.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use utoipa::IntoParams;

use super::error::Refusals;
use super::{ApiError, ApiState};
use crate::queue::OutcomeEntry;

/// A page of the feed.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct FeedQuery {
    /// The cursor: the `next` of the previous page (from the start when
    /// absent).
    after: Option<String>,
    /// At most this many (≤ `api.max_page`; default 100).
    limit: Option<u32>,
}

/// Terminal transitions after the cursor, oldest first.
#[utoipa::path(get, path = "/api/v1/outcomes", tag = "producer",
    params(FeedQuery),
    security(("bearer" = ["outcomes:read"])),
    responses((status = 200, description = "`outcomes` ({cursor, status, at, op: {id, kind, outbox, lanes, idempotency_key, correlation_id, status, attempts, receipt, last_error, …}}) and `next`: the cursor to ask from next time (the same as `after` when nothing is new)", body = Value), Refusals))]
pub(super) async fn feed(
    State(state): State<ApiState>,
    headers: HeaderMap,
    query: Result<Query<FeedQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outcomes:read").await?;
    let Query(q) = query?;
    let limit = state.page_limit(q.limit)?;
    let entries = state.queue().outcomes(q.after.as_deref(), limit).await?;
    let next = entries.last().map(|e| e.cursor.clone()).or(q.after);
    let outcomes: Vec<Value> = entries.iter().map(OutcomeEntry::summary).collect();
    Ok(Json(json!({ "outcomes": outcomes, "next": next })))
}
