//! The operator console: a page for a browser at `/console`, its files
//! embedded in the binary, and `whoami`, which it asks first.
//!
//! The console keeps no state and does nothing the API does not: its script
//! calls the API with the key the operator signs in with. The key lives in
//! the tab's `sessionStorage` and travels as `Authorization: Bearer`, never
//! as a cookie, so a page on another site cannot make the browser send it
//! (no CSRF), and the API checks every route's scope as for any client.
//! Every file is served with a Content-Security-Policy that allows only this
//! origin's script and style, no inline code, no framing.

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};

use super::error::Refusals;
use super::{ApiError, ApiState};

/// What the console's files may load and do: this origin's script, style
/// and API only; nothing inline, no forms posted anywhere, no frames.
pub const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
     connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

const INDEX: &str = include_str!("../../console/index.html");
const SCRIPT: &str = include_str!("../../console/app.js");
const STYLE: &str = include_str!("../../console/app.css");
const ICON: &str = include_str!("../../console/icon.svg");

/// The console's routes (not API routes: not in the OpenAPI document).
pub(super) fn router() -> Router<ApiState> {
    Router::new()
        .route("/console", get(|| async { Redirect::permanent("/console/") }))
        .route("/console/", get(|| async { file(INDEX, "text/html; charset=utf-8") }))
        .route(
            "/console/app.js",
            get(|| async { file(SCRIPT, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/console/app.css",
            get(|| async { file(STYLE, "text/css; charset=utf-8") }),
        )
        .route("/console/icon.svg", get(|| async { file(ICON, "image/svg+xml") }))
}

fn file(body: &'static str, content_type: &'static str) -> Response {
    let mut response = (StatusCode::OK, body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(POLICY));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    // A new binary's files replace the old at once.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// The request's key: its name and scopes (any valid key may ask), so a
/// client can hide what the key may not do. The API still enforces it.
#[utoipa::path(get, path = "/api/admin/whoami", tag = "outbox",
    security(("bearer" = [])),
    responses((status = 200, description = "`actor` (as the audit log names it) and `scopes`", body = Value), Refusals))]
pub(super) async fn whoami(State(state): State<ApiState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    let actor = super::auth::identify(state.queue().as_ref(), &headers).await?;
    Ok(Json(json!({ "actor": actor.0, "scopes": actor.1 })))
}
