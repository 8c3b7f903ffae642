//! Stellar RPC over the host's HTTP import: JSON-RPC 2.0 with by-name
//! params, and the few result shapes the vault flow reads. Transaction-level
//! outcomes (`status`, `error`) are results, not JSON-RPC errors.

use std::time::Duration;

use laneway_sdk::http::{self, Request};
use serde_json::{json, Value};

/// Why a call returned no result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RpcError {
    /// The host refused the destination: a grant is missing.
    Denied(String),
    /// The server is busy or down (429, 503, 504, a transport error).
    Unavailable {
        /// What happened.
        what: String,
        /// The server's `Retry-After`, if any.
        retry_after: Option<Duration>,
    },
    /// A JSON-RPC error or an answer that does not parse.
    Protocol(String),
}

impl std::fmt::Display for RpcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RpcError::Denied(why) => write!(f, "denied by the host: {why}"),
            RpcError::Unavailable { what, .. } => write!(f, "rpc unavailable: {what}"),
            RpcError::Protocol(what) => write!(f, "rpc protocol error: {what}"),
        }
    }
}

/// What `sendTransaction` said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sent {
    /// Accepted into the queue (`PENDING`), or already there (`DUPLICATE`).
    Queued,
    /// Another transaction of the account is queued; send again later.
    TryAgainLater,
    /// Rejected; the `errorResultXdr` (a `TransactionResult`).
    Error(Option<String>),
}

/// What `getTransaction` said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// Applied successfully in `ledger`.
    Success { ledger: u64 },
    /// Applied but failed; the result code (`invoke_host_function_trapped`).
    Failed { code: String },
    /// Not in any ledger the server remembers (yet).
    NotFound,
}

/// The chain's tip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tip {
    /// Latest closed ledger.
    pub ledger: u32,
    /// Its close time (unix seconds), when the server says.
    pub close_time: Option<u64>,
    /// The oldest ledger the server still remembers, when it says.
    pub oldest: Option<u32>,
    /// That oldest ledger's close time (unix seconds), when the server says.
    pub oldest_close_time: Option<u64>,
}

/// What `simulateTransaction` said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Simulation {
    pub error: Option<String>,
    pub transaction_data: Option<String>,
    pub min_resource_fee: u64,
    pub auth: Vec<String>,
    /// Archived entries must be restored first: (transactionData, minResourceFee).
    pub restore: Option<(String, u64)>,
}

/// A client for one endpoint.
pub struct Rpc {
    url: String,
    next_id: u64,
}

/// A count or ledger: some fields are strings on the wire (Go `,string`
/// tags, Horizon's), some numbers.
pub fn number(value: &Value) -> Option<u64> {
    match value {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_u64(),
        _ => None,
    }
}

fn retry_after(headers: &[(String, String)]) -> Option<Duration> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("retry-after"))
        .and_then(|(_, v)| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
}

impl Rpc {
    pub fn new(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            next_id: 1,
        }
    }

    /// Calls `method` with by-name `params` and returns its `result`.
    pub fn call(&mut self, method: &str, params: Value) -> Result<Value, RpcError> {
        let id = self.next_id;
        self.next_id += 1;
        let body = json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params });
        let request = Request {
            method: "POST".to_owned(),
            url: self.url.clone(),
            headers: vec![("content-type".to_owned(), "application/json".to_owned())],
            body: body.to_string().into_bytes(),
        };
        let response = match http::send(&request) {
            Ok(r) => r,
            Err(http::Error::Denied(why)) => return Err(RpcError::Denied(why)),
            Err(e) => {
                return Err(RpcError::Unavailable {
                    what: format!("{method}: {e:?}"),
                    retry_after: None,
                })
            }
        };
        if matches!(response.status, 429 | 502 | 503 | 504) {
            return Err(RpcError::Unavailable {
                what: format!("{method}: HTTP {}", response.status),
                retry_after: retry_after(&response.headers),
            });
        }
        if response.status != 200 {
            return Err(RpcError::Protocol(format!("{method}: HTTP {}", response.status)));
        }
        let reply: Value = serde_json::from_slice(&response.body)
            .map_err(|e| RpcError::Protocol(format!("{method}: response is not JSON: {e}")))?;
        if let Some(error) = reply.get("error") {
            return Err(RpcError::Protocol(format!("{method}: {error}")));
        }
        reply
            .get("result")
            .cloned()
            .ok_or_else(|| RpcError::Protocol(format!("{method}: no result")))
    }

    pub fn latest_ledger(&mut self) -> Result<Tip, RpcError> {
        let result = self.call("getLatestLedger", json!({}))?;
        let ledger = number(&result["sequence"])
            .and_then(|l| u32::try_from(l).ok())
            .ok_or_else(|| RpcError::Protocol("getLatestLedger: no sequence".to_owned()))?;
        Ok(Tip {
            ledger,
            close_time: number(&result["closeTime"]),
            oldest: None,
            oldest_close_time: None,
        })
    }

    /// `getLedgerEntries` for the keys; the entries' `xdr` (LedgerEntryData).
    pub fn ledger_entries(&mut self, keys: &[String]) -> Result<Vec<String>, RpcError> {
        let result = self.call("getLedgerEntries", json!({ "keys": keys }))?;
        Ok(result["entries"]
            .as_array()
            .map(|entries| {
                entries
                    .iter()
                    .filter_map(|e| e["xdr"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default())
    }

    pub fn simulate(&mut self, envelope: &str) -> Result<Simulation, RpcError> {
        let result = self.call("simulateTransaction", json!({ "transaction": envelope }))?;
        let auth = result["results"][0]["auth"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
            .unwrap_or_default();
        let restore = result.get("restorePreamble").and_then(|p| {
            Some((
                p["transactionData"].as_str()?.to_owned(),
                number(&p["minResourceFee"]).unwrap_or(0),
            ))
        });
        Ok(Simulation {
            error: result["error"].as_str().map(str::to_owned),
            transaction_data: result["transactionData"].as_str().map(str::to_owned),
            min_resource_fee: number(&result["minResourceFee"]).unwrap_or(0),
            auth,
            restore,
        })
    }

    pub fn send(&mut self, envelope: &str) -> Result<Sent, RpcError> {
        let result = self.call("sendTransaction", json!({ "transaction": envelope }))?;
        match result["status"].as_str() {
            Some("PENDING" | "DUPLICATE") => Ok(Sent::Queued),
            Some("TRY_AGAIN_LATER") => Ok(Sent::TryAgainLater),
            Some("ERROR") => Ok(Sent::Error(result["errorResultXdr"].as_str().map(str::to_owned))),
            other => Err(RpcError::Protocol(format!("sendTransaction: unknown status {other:?}"))),
        }
    }

    /// `getTransaction`, and the tip the server answered at.
    pub fn transaction(&mut self, hash: &str) -> Result<(Lookup, Tip), RpcError> {
        let result = self.call("getTransaction", json!({ "hash": hash }))?;
        let tip = Tip {
            ledger: number(&result["latestLedger"])
                .and_then(|l| u32::try_from(l).ok())
                .unwrap_or(0),
            close_time: number(&result["latestLedgerCloseTime"]),
            oldest: number(&result["oldestLedger"]).and_then(|l| u32::try_from(l).ok()),
            oldest_close_time: number(&result["oldestLedgerCloseTime"]),
        };
        let lookup = match result["status"].as_str() {
            Some("SUCCESS") => Lookup::Success {
                ledger: number(&result["ledger"]).unwrap_or(0),
            },
            Some("FAILED") => Lookup::Failed {
                code: result["resultXdr"]
                    .as_str()
                    .map_or_else(|| "tx_failed".to_owned(), crate::tx::result_code),
            },
            Some("NOT_FOUND") => Lookup::NotFound,
            other => return Err(RpcError::Protocol(format!("getTransaction: unknown status {other:?}"))),
        };
        Ok((lookup, tip))
    }
}
