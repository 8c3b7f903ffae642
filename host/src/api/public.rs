//! The routes that need no key: `/healthz`, `/readyz`, `/metrics` (unless
//! `[api] metrics_key_required`), seed 003's network conditions (rate
//! limited) and the OpenAPI document.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use serde_json::{json, Value};

use super::{ApiError, ApiState, ErrorBody};
use crate::events::{OracleGauges, Snapshot};
use crate::fees::{Congestion, FeeSnapshot};
use crate::op::Priority;
use crate::queue::Latency;

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "public",
    responses((status = 200, description = "`{\"status\": \"ok\"}`", body = Value)))]
pub(super) async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

/// Ready when the database answers at the current schema, every configured
/// kind with a plugin has its executor loaded, and every fee oracle's
/// snapshot is within its TTL.
#[utoipa::path(get, path = "/readyz", tag = "public",
    responses(
        (status = 200, description = "`{\"status\": \"ready\"}`", body = Value),
        (status = 503, description = "`{\"status\": \"not_ready\", \"problems\": [...]}`, one sentence per problem", body = Value),
    ))]
pub(super) async fn readyz(State(state): State<ApiState>) -> Response {
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

/// Every metric, in the Prometheus (OpenMetrics) text format. Counters
/// are this host's; gauges are read from the shared database at scrape.
#[utoipa::path(get, path = "/metrics", tag = "public",
    security((), ("bearer" = ["metrics:read"])),
    responses(
        (status = 200, description = "OpenMetrics text", body = String, content_type = "application/openmetrics-text"),
        (status = 401, description = "Only with `[api] metrics_key_required = true`", body = ErrorBody),
    ))]
pub(super) async fn metrics(State(state): State<ApiState>, headers: HeaderMap) -> Result<Response, ApiError> {
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
/// host's `/metrics` shows the shared queue), one aggregate query each.
async fn scrape(state: &ApiState) -> Result<Snapshot, ApiError> {
    let queue = state.queue();
    // Seed 003's depth gauge is by status and priority: sum the kinds.
    let mut depth: Vec<(String, Priority, i64)> = Vec::new();
    for d in queue.depth().await? {
        match depth
            .iter_mut()
            .find(|(s, p, _)| s == d.status.as_str() && *p == d.priority)
        {
            Some((_, _, n)) => *n += d.count,
            None => depth.push((d.status.as_str().to_owned(), d.priority, d.count)),
        }
    }
    let gauges = queue.gauges().await?;
    let mut paused: Vec<(String, i64)> = Vec::new();
    for pause in queue.pauses().await? {
        match paused.iter_mut().find(|(s, _)| s == pause.scope.as_str()) {
            Some((_, n)) => *n += 1,
            None => paused.push((pause.scope.as_str().to_owned(), 1)),
        }
    }
    let now = chrono::Utc::now();
    let mut oracles = Vec::new();
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
                staleness_seconds: seconds_since(now, at),
            });
        }
    }
    let plugins = match state.plugins() {
        Some((host, _)) => host
            .plugins()
            .await
            .into_iter()
            .map(|p| (p.name, p.quarantined))
            .collect(),
        None => Vec::new(),
    };
    let destinations_held = crate::destinations::HealthView::load(queue.as_ref())
        .await?
        .held_counts();
    Ok(Snapshot {
        depth,
        destinations_held,
        stuck_submitted: gauges.stuck_submitted,
        lanes_held: gauges.lanes_held,
        subjects_halted: gauges.subjects_halted,
        paused,
        breakers_open: i64::try_from(state.dispatcher().breakers_open().len()).unwrap_or(i64::MAX),
        permits_in_use: i64::try_from(state.dispatcher().permits_in_use()).unwrap_or(i64::MAX),
        slow_attempts: i64::try_from(state.dispatcher().slow_in_use()).unwrap_or(i64::MAX),
        oldest_due: gauges
            .oldest_due
            .into_iter()
            .map(|d| (d.kind, d.outbox, seconds_since(now, d.due_at)))
            .collect(),
        plugins,
        oracles,
    })
}

fn seconds_since(now: chrono::DateTime<chrono::Utc>, then: chrono::DateTime<chrono::Utc>) -> f64 {
    (now - then).to_std().unwrap_or(Duration::ZERO).as_secs_f64()
}

fn congestion_level(c: Congestion) -> i64 {
    match c {
        Congestion::Low => 0,
        Congestion::Elevated => 1,
        Congestion::High => 2,
        Congestion::Severe => 3,
    }
}

/// How far back the confirmation-time bands look, and how many ops at most.
const BAND_WINDOW: chrono::TimeDelta = chrono::TimeDelta::hours(1);
const BAND_SAMPLES: u32 = 5000;

/// Seed 003's public route: each oracle's snapshot, what a new op of each
/// tier of a priced kind is expected to cost and take, and per kind and
/// tier the confirmation times observed over the last hour.
#[utoipa::path(get, path = "/api/v1/network/conditions", tag = "public",
    responses(
        (status = 200, description = "`oracles` (snapshot per oracle), `estimates` (per priced kind and tier) and `eta_bands` (per kind and tier: p50, p90, p99 seconds from creation to confirmation over the last hour, and the sample count)", body = Value),
        (status = 429, description = "`rate_limited`: more than `[api] public_per_second`", body = ErrorBody),
    ))]
pub(super) async fn network_conditions(State(state): State<ApiState>) -> Result<Json<Value>, ApiError> {
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
    let mut estimates = serde_json::Map::new();
    for (name, kind) in &config.kinds {
        if kind.fee_oracle.is_none() {
            continue;
        }
        let mut tiers = serde_json::Map::new();
        for priority in Priority::ALL {
            let estimate = state.dispatcher().estimate(name, priority).await.ok().flatten();
            tiers.insert(priority.as_str().to_owned(), json!(estimate));
        }
        estimates.insert(name.clone(), Value::Object(tiers));
    }
    let since = chrono::Utc::now() - BAND_WINDOW;
    let samples = state.queue().recent_latencies(since, BAND_SAMPLES).await?;
    Ok(Json(json!({
        "oracles": oracles,
        "estimates": estimates,
        "eta_bands": eta_bands(&samples),
    })))
}

/// Confirmation times of one kind and tier.
#[derive(Debug, Clone, PartialEq, Serialize)]
struct Band {
    p50: f64,
    p90: f64,
    p99: f64,
    samples: usize,
}

/// Per kind and tier, nearest-rank percentiles of the samples.
fn eta_bands(samples: &[Latency]) -> BTreeMap<String, BTreeMap<&'static str, Band>> {
    let mut grouped: BTreeMap<(String, Priority), Vec<f64>> = BTreeMap::new();
    for s in samples {
        grouped.entry((s.kind.clone(), s.priority)).or_default().push(s.seconds);
    }
    let mut out: BTreeMap<String, BTreeMap<&'static str, Band>> = BTreeMap::new();
    for ((kind, priority), mut times) in grouped {
        times.sort_by(f64::total_cmp);
        let rank = |p: f64| {
            // Nearest rank: the smallest value with at least p of the samples at or below it.
            #[allow(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                clippy::cast_precision_loss
            )]
            let i = ((p * times.len() as f64).ceil() as usize).clamp(1, times.len()) - 1;
            times[i]
        };
        let band = Band {
            p50: rank(0.5),
            p90: rank(0.9),
            p99: rank(0.99),
            samples: times.len(),
        };
        out.entry(kind).or_default().insert(priority.as_str(), band);
    }
    out
}

/// This document.
#[utoipa::path(get, path = "/api/openapi.json", tag = "public",
    responses((status = 200, description = "The OpenAPI 3.1 document of every route", body = Value)))]
pub(super) async fn openapi_json() -> Json<serde_json::Value> {
    Json(super::openapi_document())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(kind: &str, priority: Priority, seconds: f64) -> Latency {
        Latency {
            kind: kind.to_owned(),
            priority,
            seconds,
        }
    }

    #[test]
    fn bands_are_nearest_rank_percentiles_per_kind_and_tier() {
        let mut samples: Vec<Latency> = (1..=100)
            .map(|i| sample("deposit", Priority::Normal, f64::from(i)))
            .collect();
        samples.push(sample("deposit", Priority::Critical, 2.0));
        let bands = eta_bands(&samples);
        let normal = &bands["deposit"]["normal"];
        assert_eq!(
            (normal.p50, normal.p90, normal.p99, normal.samples),
            (50.0, 90.0, 99.0, 100)
        );
        let critical = &bands["deposit"]["critical"];
        assert_eq!((critical.p50, critical.p99, critical.samples), (2.0, 2.0, 1));
        assert!(!bands["deposit"].contains_key("low"), "no samples, no band");
        assert!(eta_bands(&[]).is_empty());
    }
}
