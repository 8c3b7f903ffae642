//! A fake Stellar RPC: JSON-RPC 2.0 on `POST /`, params by name or absent
//! (arrays are refused, as stellar-rpc does), with the documented result
//! shapes and types (fees and counts as strings). Only the methods laneway
//! uses so far.

use std::sync::{Arc, Mutex, PoisonError};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

struct Fees {
    min: u64,
    p70: u64,
    p95: u64,
    max: u64,
    transaction_count: u64,
    ledger_count: u64,
}

struct Inner {
    fees: Fees,
    latest_ledger: u64,
    failing: bool,
    requests: usize,
}

/// The fake; clones share state.
#[derive(Clone)]
pub struct FakeRpc {
    inner: Arc<Mutex<Inner>>,
}

impl Default for FakeRpc {
    fn default() -> Self {
        // stellar-docs' getFeeStats example.
        Self {
            inner: Arc::new(Mutex::new(Inner {
                fees: Fees {
                    min: 100,
                    p70: 100,
                    p95: 200,
                    max: 200,
                    transaction_count: 371,
                    ledger_count: 50,
                },
                latest_ledger: 3_730_870,
                failing: false,
                requests: 0,
            })),
        }
    }
}

fn rpc_error(id: &Value, code: i64, message: &str) -> Response {
    axum::Json(json!({ "jsonrpc": "2.0", "id": id, "error": { "code": code, "message": message } })).into_response()
}

impl FakeRpc {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets the Soroban inclusion-fee distribution.
    pub fn set_fees(&self, min: u64, p70: u64, p95: u64, max: u64, transaction_count: u64) {
        self.lock().fees = Fees {
            min,
            p70,
            p95,
            max,
            transaction_count,
            ledger_count: 1,
        };
    }

    /// Answers every call with HTTP 503 from now on.
    pub fn fail(&self) {
        self.lock().failing = true;
    }

    /// Requests served.
    pub fn requests(&self) -> usize {
        self.lock().requests
    }

    /// Serves on 127.0.0.1; returns the URL.
    pub async fn serve(&self) -> anyhow::Result<String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/", listener.local_addr()?);
        let app = axum::Router::new().fallback(handle).with_state(self.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(url)
    }
}

async fn handle(State(fake): State<FakeRpc>, body: Bytes) -> Response {
    let mut inner = fake.lock();
    inner.requests += 1;
    if inner.failing {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return rpc_error(&Value::Null, -32700, "parse error");
    };
    let id = request.get("id").cloned().unwrap_or(Value::Null);
    if request.get("jsonrpc") != Some(&json!("2.0")) {
        return rpc_error(&id, -32600, "invalid request");
    }
    if request.get("params").is_some_and(|p| !p.is_object()) {
        return rpc_error(&id, -32602, "invalid parameters: params must be an object");
    }
    let f = &inner.fees;
    let dist = |count: u64, ledgers: u64| {
        json!({
            "max": f.max.to_string(), "min": f.min.to_string(), "mode": f.min.to_string(),
            "p10": f.min.to_string(), "p20": f.min.to_string(), "p30": f.min.to_string(), "p40": f.min.to_string(),
            "p50": f.min.to_string(), "p60": f.min.to_string(), "p70": f.p70.to_string(), "p80": f.p70.to_string(),
            "p90": f.p95.to_string(), "p95": f.p95.to_string(), "p99": f.max.to_string(),
            "transactionCount": count.to_string(), "ledgerCount": ledgers,
        })
    };
    let result = match request.get("method").and_then(Value::as_str) {
        Some("getFeeStats") => json!({
            "sorobanInclusionFee": dist(f.transaction_count, f.ledger_count),
            "inclusionFee": dist(28, 10),
            "latestLedger": inner.latest_ledger,
        }),
        Some("getLatestLedger") => json!({
            "id": "0a00a9cf845f7af7cff09c66f8ae6480e9971e6e2c7fa4afd8d6266ee13c987b",
            "protocolVersion": 27,
            "sequence": inner.latest_ledger,
        }),
        _ => return rpc_error(&id, -32601, "method not found"),
    };
    axum::Json(json!({ "jsonrpc": "2.0", "id": id, "result": result })).into_response()
}
