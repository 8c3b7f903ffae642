//! Steering: pauses of kinds, outboxes and destinations (rows every host
//! obeys), strict lanes held by dead letters, halted subjects, and this
//! host's breakers. Reads need `outbox:read`, writes `outbox:write`; every
//! write is audited.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use utoipa::{IntoParams, ToSchema};

use super::error::{BodyRefusals, Refusals};
use super::{ApiError, ApiState, ErrorBody};
use crate::queue::PauseScope;

/// Every pause.
#[utoipa::path(get, path = "/api/admin/pauses", tag = "steering",
    security(("bearer" = ["outbox:read"])),
    responses((status = 200, description = "`pauses` ({scope, target, reason, actor, paused_at})", body = Value), Refusals))]
pub(super) async fn pauses(State(state): State<ApiState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    Ok(Json(json!({ "pauses": state.queue().pauses().await? })))
}

/// What to pause.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct PauseBody {
    /// kind, outbox or destination (a URL authority, `host[:port]`).
    #[schema(value_type = String)]
    scope: PauseScope,
    target: String,
    reason: Option<String>,
}

/// Pauses a kind, an outbox or a destination on every host: its ops wait,
/// holding their strict lanes, and use no attempt.
#[utoipa::path(post, path = "/api/admin/pauses", tag = "steering",
    request_body = PauseBody,
    security(("bearer" = ["outbox:write"])),
    responses((status = 200, description = "`paused`: false when it already was", body = Value), Refusals, BodyRefusals))]
pub(super) async fn pause(
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

/// Lifts a pause; the ops go on where they stopped.
#[utoipa::path(delete, path = "/api/admin/pauses/{scope}/{target}", tag = "steering",
    params(("scope" = String, Path, description = "kind, outbox or destination"), ("target" = String, Path, description = "What is paused")),
    security(("bearer" = ["outbox:write"])),
    responses((status = 200, description = "`resumed`", body = Value),
        (status = 404, description = "`not_found`: not paused", body = ErrorBody), Refusals))]
pub(super) async fn resume(
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

/// A page of held lanes.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct LanesQuery {
    /// Only this outbox's.
    outbox: Option<String>,
    /// The cursor: the `next` of the previous page.
    after: Option<String>,
    limit: Option<u32>,
}

/// A held-lanes cursor: the last row's (outbox, lane, op id) as JSON, in
/// base64url, so a lane's own characters need no escaping.
fn lane_cursor(halt: &crate::queue::LaneHalt) -> String {
    use base64::Engine as _;
    let text = json!([halt.outbox, halt.lane, halt.op_id]).to_string();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text)
}

fn parse_lane_cursor(cursor: &str) -> Result<(String, String, crate::op::OpId), ApiError> {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(cursor)
        .ok()
        .and_then(|bytes| serde_json::from_slice::<(String, String, crate::op::OpId)>(&bytes).ok())
        .ok_or_else(|| ApiError::invalid("after: not a cursor this API handed out"))
}

/// Strict lanes held by a dead letter, a page at a time (by outbox, lane).
#[utoipa::path(get, path = "/api/admin/lanes", tag = "steering",
    params(LanesQuery),
    security(("bearer" = ["outbox:read"])),
    responses((status = 200, description = "`held` ({outbox, lane, op_id, halted_at}) and `next` (the cursor for `after`, null on the last page)", body = Value), Refusals))]
pub(super) async fn lanes(
    State(state): State<ApiState>,
    headers: HeaderMap,
    query: Result<Query<LanesQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    let Query(q) = query?;
    let limit = state.page_limit(q.limit)?;
    let after = q.after.as_deref().map(parse_lane_cursor).transpose()?;
    let held = state
        .queue()
        .lane_halts_page(
            q.outbox.as_deref(),
            after.as_ref().map(|(o, l, id)| (o.as_str(), l.as_str(), *id)),
            limit,
        )
        .await?;
    let next = (held.len() == limit as usize)
        .then(|| held.last().map(lane_cursor))
        .flatten();
    Ok(Json(json!({ "held": held, "next": next })))
}

/// A held lane.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct LaneBody {
    outbox: String,
    lane: String,
}

/// Releases a held lane past its dead letter.
#[utoipa::path(post, path = "/api/admin/lanes/skip", tag = "steering",
    request_body = LaneBody,
    security(("bearer" = ["outbox:write"])),
    responses((status = 200, description = "`released`: how many holds were lifted", body = Value),
        (status = 404, description = "`not_found`: not held", body = ErrorBody), Refusals, BodyRefusals))]
pub(super) async fn skip_lane(
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

/// Halted subjects.
#[utoipa::path(get, path = "/api/admin/subjects", tag = "steering",
    security(("bearer" = ["outbox:read"])),
    responses((status = 200, description = "`halted` ({subject, reason, halted_at})", body = Value), Refusals))]
pub(super) async fn subjects(State(state): State<ApiState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    Ok(Json(json!({ "halted": state.queue().halted_subjects().await? })))
}

/// A subject (the user or account ops act for).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct SubjectBody {
    subject: String,
    reason: Option<String>,
}

/// Halts a subject: its ops wait until it is unhalted.
#[utoipa::path(post, path = "/api/admin/subjects/halt", tag = "steering",
    request_body = SubjectBody,
    security(("bearer" = ["outbox:write"])),
    responses((status = 200, description = "`halted`", body = Value), Refusals, BodyRefusals))]
pub(super) async fn halt_subject(
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

/// Unhalts a subject.
#[utoipa::path(post, path = "/api/admin/subjects/unhalt", tag = "steering",
    request_body = SubjectBody,
    security(("bearer" = ["outbox:write"])),
    responses((status = 200, description = "`unhalted`", body = Value),
        (status = 404, description = "`not_found`: not halted", body = ErrorBody), Refusals, BodyRefusals))]
pub(super) async fn unhalt_subject(
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

/// This host's breakers: every destination with a failure counted or a
/// breaker open (open, half-open or forced open by hand).
#[utoipa::path(get, path = "/api/admin/breakers", tag = "steering",
    security(("bearer" = ["outbox:read"])),
    responses((status = 200, description = "`breakers` ({destination, state, failures, first_failure_at, last_error, next_trial_at}) of this host; `paused_destinations` (pauses every host obeys)", body = Value), Refusals))]
pub(super) async fn breakers(State(state): State<ApiState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    let breakers = state.dispatcher().breakers(chrono::Utc::now());
    let paused: Vec<String> = state
        .queue()
        .pauses()
        .await?
        .into_iter()
        .filter(|p| p.scope == PauseScope::Destination)
        .map(|p| p.target)
        .collect();
    Ok(Json(json!({ "breakers": breakers, "paused_destinations": paused })))
}

fn destination(path: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    let Path(destination) = path?;
    if destination.is_empty() || destination.len() > 300 || destination.contains(['/', ' ']) {
        return Err(ApiError::invalid(format!(
            "destination: expected a URL authority (host[:port]), got {destination:?}"
        )));
    }
    Ok(destination)
}

/// Opens a destination's breaker on this host by hand: its ops are held
/// (no attempt used) until it is closed. To hold a destination on every
/// host, pause it (`POST /api/admin/pauses` with scope `destination`).
#[utoipa::path(post, path = "/api/admin/breakers/{destination}/open", tag = "steering",
    params(("destination" = String, Path, description = "A URL authority, host[:port]")),
    security(("bearer" = ["outbox:write"])),
    responses((status = 200, description = "`breaker`, forced open", body = Value), Refusals))]
pub(super) async fn open_breaker(
    State(state): State<ApiState>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<Value>, ApiError> {
    let actor = state.authorize(&headers, "outbox:write").await?;
    let destination = destination(path)?;
    let before = state.dispatcher().breaker(&destination, chrono::Utc::now());
    state.dispatcher().force_open_breaker(&destination);
    let after = state.dispatcher().breaker(&destination, chrono::Utc::now());
    state
        .audit(
            &actor,
            "breaker.open",
            format!("destination:{destination}"),
            Some(json!(before)),
            Some(json!(after)),
        )
        .await?;
    Ok(Json(json!({ "breaker": after })))
}

/// Closes a destination's breaker on this host, forgetting its failures;
/// its held ops go at once.
#[utoipa::path(post, path = "/api/admin/breakers/{destination}/close", tag = "steering",
    params(("destination" = String, Path, description = "A URL authority, host[:port]")),
    security(("bearer" = ["outbox:write"])),
    responses((status = 200, description = "`closed`", body = Value),
        (status = 404, description = "`not_found`: no failure counted and nothing open", body = ErrorBody), Refusals))]
pub(super) async fn close_breaker(
    State(state): State<ApiState>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<Value>, ApiError> {
    let actor = state.authorize(&headers, "outbox:write").await?;
    let destination = destination(path)?;
    let before = state.dispatcher().breaker(&destination, chrono::Utc::now());
    if !state.dispatcher().close_breaker(&destination) {
        return Err(ApiError::not_found(format!(
            "destination {destination:?} has no breaker state on this host"
        )));
    }
    state
        .audit(
            &actor,
            "breaker.close",
            format!("destination:{destination}"),
            Some(json!(before)),
            None,
        )
        .await?;
    Ok(Json(json!({ "closed": true })))
}

/// Destination health shared by every host: each destination host with
/// failures counted or held (unavailable after failing past
/// `destinations.unavailable_after_ms`, or suspended), and the personal
/// inboxes remembered as gone after a 410.
#[utoipa::path(get, path = "/api/admin/destinations", tag = "steering",
    security(("bearer" = ["outbox:read"])),
    responses((status = 200, description = "`destinations` ({host, state, failures, first_failure_at, last_failure_at, last_error, since, reason, next_probe_at}); `gone_inboxes` ({inbox, gone_at})", body = Value), Refusals))]
pub(super) async fn destinations(State(state): State<ApiState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "outbox:read").await?;
    let queue = state.queue();
    let hosts = crate::destinations::views(queue.as_ref()).await?;
    let gone: Vec<Value> = crate::destinations::gone_inboxes(queue.as_ref())
        .await?
        .into_iter()
        .map(|(inbox, at)| json!({ "inbox": inbox, "gone_at": at }))
        .collect();
    Ok(Json(json!({ "destinations": hosts, "gone_inboxes": gone })))
}

/// Why a destination is suspended.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct SuspendBody {
    reason: String,
}

/// Suspends a destination host on every host: its ops are held (not
/// attempted, not dead-lettered, no probes) until it is resumed.
#[utoipa::path(post, path = "/api/admin/destinations/{destination}/suspend", tag = "steering",
    params(("destination" = String, Path, description = "A URL authority, host[:port]")),
    request_body = SuspendBody,
    security(("bearer" = ["outbox:write"])),
    responses((status = 200, description = "`destination`, suspended", body = Value), Refusals, BodyRefusals))]
pub(super) async fn suspend_destination(
    State(state): State<ApiState>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
    body: Result<Json<SuspendBody>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let actor = state.authorize(&headers, "outbox:write").await?;
    let host = destination(path)?;
    let Json(body) = body?;
    if body.reason.trim().is_empty() || body.reason.len() > 500 {
        return Err(ApiError::invalid("reason: expected 1 to 500 characters"));
    }
    let (before, after) = state
        .dispatcher()
        .suspend_destination(&host, &body.reason, &actor.0)
        .await?;
    state
        .audit(
            &actor,
            "destination.suspend",
            format!("destination:{host}"),
            Some(json!(before)),
            Some(json!(after)),
        )
        .await?;
    Ok(Json(
        json!({ "destination": crate::destinations::view(state.queue().as_ref(), &host).await? }),
    ))
}

/// Makes a destination host available again on every host, whatever held
/// it (failing past the period, a shared-inbox 410, an operator), and
/// forgets its inboxes' 410s; its held ops go at once.
#[utoipa::path(post, path = "/api/admin/destinations/{destination}/resume", tag = "steering",
    params(("destination" = String, Path, description = "A URL authority, host[:port]")),
    security(("bearer" = ["outbox:write"])),
    responses((status = 200, description = "`resumed`: whether anything was held or counted; `inboxes_forgotten`", body = Value), Refusals))]
pub(super) async fn resume_destination(
    State(state): State<ApiState>,
    headers: HeaderMap,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<Value>, ApiError> {
    let actor = state.authorize(&headers, "outbox:write").await?;
    let host = destination(path)?;
    let (before, after, forgotten) = state.dispatcher().resume_destination(&host, &actor.0).await?;
    state
        .audit(
            &actor,
            "destination.resume",
            format!("destination:{host}"),
            Some(json!({ "health": before, "gone_inboxes": forgotten })),
            Some(json!(after)),
        )
        .await?;
    Ok(Json(
        json!({ "resumed": !before.is_clear() || !forgotten.is_empty(), "inboxes_forgotten": forgotten }),
    ))
}
