//! The plugin routes (scope `plugins:admin`): what is loaded (world,
//! contract, content digest, quarantine), the reload bookkeeping with the
//! last refusal, and a reload on demand, as a file change or SIGHUP makes.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use utoipa::IntoParams;

use super::error::Refusals;
use super::{ApiError, ApiState, ErrorBody};

fn unavailable() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "plugins_unavailable",
        "this API was started without a plugin host",
    )
}

/// Loaded plugins and reloads.
#[utoipa::path(get, path = "/api/admin/plugins", tag = "plugins",
    security(("bearer" = ["plugins:admin"])),
    responses((status = 200, description = "`plugins` ({name, world, contract, digest, quarantined}) and `reloads` ({loads, failures, last_error, refused_kinds})", body = Value), Refusals))]
pub(super) async fn status(State(state): State<ApiState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    state.authorize(&headers, "plugins:admin").await?;
    let (host, _) = state.plugins().ok_or_else(unavailable)?;
    Ok(Json(
        json!({ "plugins": host.plugins().await, "reloads": host.status() }),
    ))
}

/// `?allow_removal=true`: let the reload drop kinds that still have
/// queued ops (they then wait until a config runs them again).
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct ReloadQuery {
    /// Drop kinds that still have queued ops (refused otherwise).
    allow_removal: Option<bool>,
}

/// Reloads the config file and every plugin now. A refused reload changes
/// nothing: the previous config and plugins stay in service. A config that
/// drops a kind with queued ops is refused unless `allow_removal`.
#[utoipa::path(post, path = "/api/admin/plugins/reload", tag = "plugins",
    params(ReloadQuery),
    security(("bearer" = ["plugins:admin"])),
    responses((status = 200, description = "`plugins` now loaded and `reloads`", body = Value),
        (status = 422, description = "`reload_refused`: the message says every problem; nothing changed", body = ErrorBody), Refusals))]
pub(super) async fn reload(
    State(state): State<ApiState>,
    headers: HeaderMap,
    query: Result<Query<ReloadQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let actor = state.authorize(&headers, "plugins:admin").await?;
    let Query(ReloadQuery { allow_removal }) = query?;
    let (host, source) = state.plugins().ok_or_else(unavailable)?;
    let before: Vec<String> = host
        .plugins()
        .await
        .into_iter()
        .map(|p| format!("{}@{}", p.name, p.digest))
        .collect();
    let result = host
        .reload(source, Some(state.dispatcher()), allow_removal.unwrap_or(false))
        .await;
    let after: Vec<String> = host
        .plugins()
        .await
        .into_iter()
        .map(|p| format!("{}@{}", p.name, p.digest))
        .collect();
    let outcome = match &result {
        Ok(()) => json!({ "loaded": after }),
        Err(e) => json!({ "refused": e.to_string() }),
    };
    state
        .audit(
            &actor,
            "plugins.reload",
            "plugins".to_owned(),
            Some(json!(before)),
            Some(outcome),
        )
        .await?;
    if let Err(e) = result {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "reload_refused",
            format!("reload refused; the previous configuration and plugins stay in service: {e}"),
        ));
    }
    Ok(Json(
        json!({ "plugins": host.plugins().await, "reloads": host.status() }),
    ))
}
