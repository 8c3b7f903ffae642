//! The HTTP API `laneway run` serves (`[api] listen`): the producer routes
//! (`/api/v1/ops`), the admin routes (`/api/admin/…`, seed 003's paths),
//! `/metrics`, `/healthz` and `/readyz`, and the public network conditions.
//!
//! Every route but the last four asks for an API key with a scope
//! ([`auth`]); every write records who did it in the audit log; every
//! failure is an [`ApiError`] with a stable code. The handlers only call the
//! [`Dispatcher`] and its [`Queue`], as the CLI does, so both accept and
//! refuse the same things.

mod admin;
pub mod auth;
mod error;
mod producer;

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::time::Instant;

pub use error::ApiError;

use crate::dispatch::Dispatcher;
use crate::events::{OracleGauges, Snapshot};
use crate::fees::{Congestion, FeeSnapshot};
use crate::queue::{NewAuditEntry, Queue};
use auth::Actor;

/// What every handler shares.
#[derive(Clone)]
pub struct ApiState {
    inner: Arc<StateInner>,
}

struct StateInner {
    dispatcher: Dispatcher,
    /// The public route's token bucket: (tokens, last refill).
    public_bucket: Mutex<(f64, Instant)>,
}

impl ApiState {
    /// State over a dispatcher (its queue, config, executors and metrics).
    pub fn new(dispatcher: Dispatcher) -> Self {
        Self {
            inner: Arc::new(StateInner {
                dispatcher,
                // Full at start (the first refill clamps it to the rate).
                public_bucket: Mutex::new((f64::MAX, Instant::now())),
            }),
        }
    }

    fn dispatcher(&self) -> &Dispatcher {
        &self.inner.dispatcher
    }

    fn queue(&self) -> &Arc<dyn Queue> {
        self.inner.dispatcher.queue()
    }

    async fn authorize(&self, headers: &HeaderMap, scope: &str) -> Result<Actor, ApiError> {
        auth::authorize(self.queue().as_ref(), headers, scope).await
    }

    /// Records an operator write.
    async fn audit(
        &self,
        actor: &Actor,
        action: &str,
        target: String,
        before: Option<Value>,
        after: Option<Value>,
    ) -> Result<(), ApiError> {
        self.queue()
            .record_audit(&NewAuditEntry {
                actor: actor.0.clone(),
                action: action.to_owned(),
                target,
                before,
                after,
            })
            .await?;
        Ok(())
    }

    /// Takes a token from the public route's bucket (`public_per_second`
    /// per second, bursts of as many).
    fn public_admit(&self) -> bool {
        let rate = f64::from(self.dispatcher().config().api.public_per_second);
        let mut bucket = self.inner.public_bucket.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        let refill = now.duration_since(bucket.1).as_secs_f64() * rate;
        bucket.0 = (bucket.0 + refill).min(rate);
        bucket.1 = now;
        if bucket.0 >= 1.0 {
            bucket.0 -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Every route.
pub fn router(state: ApiState) -> Router {
    let limit = state.dispatcher().config().api.max_body_bytes;
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/api/v1/network/conditions", get(network_conditions))
        .route("/api/v1/ops", post(producer::enqueue))
        .merge(admin::routes())
        .fallback(|| async { ApiError::not_found("no such route") })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Serves the API on `listener` until `stop` resolves.
///
/// # Errors
///
/// The server's I/O error.
pub async fn serve(
    listener: TcpListener,
    state: ApiState,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state)).with_graceful_shutdown(stop).await
}

async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

/// Ready when the database answers at the current schema, every configured
/// kind with a plugin has its executor loaded, and every fee oracle's
/// snapshot is within its TTL.
async fn readyz(State(state): State<ApiState>) -> Response {
    let config = state.dispatcher().config();
    let mut problems = Vec::new();
    if let Err(e) = state.queue().check_schema().await {
        problems.push(format!("database: {e}"));
    }
    for (name, kind) in &config.kinds {
        if kind.plugin.is_some() && !state.dispatcher().executors().get(name).is_some_and(|e| e.available()) {
            problems.push(format!("kinds.{name}: no executor loaded"));
        }
    }
    let now = chrono::Utc::now();
    for name in config.oracles.keys() {
        match state.queue().fee_snapshot(name).await {
            Ok(Some((_, at))) if (now - at).num_milliseconds() <= oracle_ttl_ms(&config, name) => {}
            Ok(Some((_, at))) => problems.push(format!("oracles.{name}: stale since {at}")),
            Ok(None) => problems.push(format!("oracles.{name}: no sample yet")),
            Err(e) => problems.push(format!("oracles.{name}: {e}")),
        }
    }
    if problems.is_empty() {
        Json(json!({ "status": "ready" })).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "status": "not_ready", "problems": problems })),
        )
            .into_response()
    }
}

/// An oracle's snapshot TTL (`ttl_ms` in its config; seed 003's 30 s).
fn oracle_ttl_ms(config: &crate::config::Config, oracle: &str) -> i64 {
    config
        .oracles
        .get(oracle)
        .and_then(|o| o.config.get("ttl_ms"))
        .and_then(toml::Value::as_integer)
        .unwrap_or(30_000)
}

async fn metrics(State(state): State<ApiState>, headers: HeaderMap) -> Result<Response, ApiError> {
    if state.dispatcher().config().api.metrics_key_required {
        state.authorize(&headers, "metrics:read").await?;
    }
    let snapshot = scrape(&state).await?;
    let metrics = state.dispatcher().metrics();
    metrics.observe(&snapshot);
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        metrics.render(),
    )
        .into_response())
}

/// What the gauges show, read from the database at scrape time (so every
/// host's `/metrics` shows the shared queue).
async fn scrape(state: &ApiState) -> Result<Snapshot, ApiError> {
    let queue = state.queue();
    let depth = queue
        .depth()
        .await?
        .into_iter()
        .map(|d| (d.status.as_str().to_owned(), d.priority, d.count))
        .collect();
    let stuck = queue.expired_leases(1000).await?.len();
    let lanes_held = queue.lane_halts(None).await?.len();
    let subjects = queue.halted_subjects().await?.len();
    let mut paused: Vec<(String, i64)> = Vec::new();
    for pause in queue.pauses().await? {
        match paused.iter_mut().find(|(s, _)| s == pause.scope.as_str()) {
            Some((_, n)) => *n += 1,
            None => paused.push((pause.scope.as_str().to_owned(), 1)),
        }
    }
    let mut oracles = Vec::new();
    let now = chrono::Utc::now();
    for name in state.dispatcher().config().oracles.keys() {
        if let Some((json, at)) = queue.fee_snapshot(name).await? {
            let Ok(s) = serde_json::from_str::<FeeSnapshot>(&json) else {
                continue;
            };
            oracles.push(OracleGauges {
                oracle: name.clone(),
                recommended: i64::try_from(s.recommended_base_fee).unwrap_or(i64::MAX),
                aggressive: i64::try_from(s.aggressive_base_fee).unwrap_or(i64::MAX),
                capacity_usage: s.ledger_capacity_usage,
                congestion_level: congestion_level(s.congestion),
                staleness_seconds: (now - at).to_std().unwrap_or(Duration::ZERO).as_secs_f64(),
            });
        }
    }
    let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    Ok(Snapshot {
        depth,
        stuck_submitted: count(stuck),
        lanes_held: count(lanes_held),
        subjects_halted: count(subjects),
        paused,
        breakers_open: count(state.dispatcher().breakers_open().len()),
        oracles,
    })
}

fn congestion_level(c: Congestion) -> i64 {
    match c {
        Congestion::Low => 0,
        Congestion::Elevated => 1,
        Congestion::High => 2,
        Congestion::Severe => 3,
    }
}

/// Seed 003's public route: each oracle's snapshot and what a new op of each
/// tier is expected to cost and take.
async fn network_conditions(State(state): State<ApiState>) -> Result<Json<Value>, ApiError> {
    if !state.public_admit() {
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            "too many requests; try again in a second",
        ));
    }
    let config = state.dispatcher().config();
    let mut oracles = serde_json::Map::new();
    for name in config.oracles.keys() {
        let snapshot = match state.queue().fee_snapshot(name).await? {
            Some((json, at)) => {
                let value: Value = serde_json::from_str(&json).unwrap_or(Value::Null);
                json!({ "snapshot": value, "sampled_at": at })
            }
            None => json!({ "snapshot": null }),
        };
        oracles.insert(name.clone(), snapshot);
    }
    let mut kinds = serde_json::Map::new();
    for (name, kind) in &config.kinds {
        if kind.fee_oracle.is_none() {
            continue;
        }
        let mut bands = serde_json::Map::new();
        for priority in crate::op::Priority::ALL {
            let estimate = state.dispatcher().estimate(name, priority).await.ok().flatten();
            bands.insert(priority.as_str().to_owned(), json!(estimate));
        }
        kinds.insert(name.clone(), Value::Object(bands));
    }
    Ok(Json(json!({ "oracles": oracles, "estimates": kinds })))
}
