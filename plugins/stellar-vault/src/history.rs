//! A history source past the RPC's retention: Horizon's `GET /transactions/{hash}`
//! and its root's ingested ledger range (`history_elder_ledger` ..
//! `history_latest_ledger`), over the host's HTTP import.
//!
//! The RPC forgets a transaction after its retention window (about 7 days);
//! from then on its NOT_FOUND proves nothing, and the vault consults this
//! source before it calls an op's outcome unknown. Found is final either way
//! (landed or failed on chain). Missing proves the transaction never landed
//! only when the source has ingested every ledger it could have landed in;
//! otherwise the source cannot say either.

use laneway_sdk::http::{self, Request};
use serde_json::Value;

use crate::rpc::{number, RpcError};

/// What the history source knows of one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// Applied in `ledger`: successfully, or failed with the result's code.
    Applied { ledger: u64, failed_code: Option<String> },
    /// Not in the source's history.
    Missing,
}

/// The ledgers a history source has ingested, inclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coverage {
    pub elder: u32,
    pub latest: u32,
}

impl Coverage {
    /// Whether every ledger in `first ..= last` is ingested, so that a
    /// transaction that could land only there and is missing never landed.
    pub fn covers(self, first: u32, last: u32) -> bool {
        self.elder <= first && last <= self.latest
    }
}

/// A history source at a base URL.
pub struct History {
    base: String,
}

/// Reads a `/transactions/{hash}` answer: 200 with the transaction, or 404.
pub fn parse_transaction(status: u16, body: &[u8], hash: &str) -> Result<Found, RpcError> {
    match status {
        404 => return Ok(Found::Missing),
        200 => {}
        429 | 502 | 503 | 504 => {
            return Err(RpcError::Unavailable {
                what: format!("history: HTTP {status}"),
                retry_after: None,
            })
        }
        other => return Err(RpcError::Protocol(format!("history: HTTP {other}"))),
    }
    let tx: Value =
        serde_json::from_slice(body).map_err(|e| RpcError::Protocol(format!("history: answer is not JSON: {e}")))?;
    // Horizon answers an inner hash with its fee-bump transaction; either
    // hash naming the one asked for is the transaction.
    let named = |v: &Value| v.as_str().is_some_and(|h| h.eq_ignore_ascii_case(hash));
    if !(named(&tx["hash"]) || named(&tx["inner_transaction"]["hash"])) {
        return Err(RpcError::Protocol(format!(
            "history: asked for {hash}, answered {}",
            tx["hash"]
        )));
    }
    let ledger = number(&tx["ledger"]).ok_or_else(|| RpcError::Protocol("history: no ledger".to_owned()))?;
    match tx["successful"].as_bool() {
        Some(true) => Ok(Found::Applied {
            ledger,
            failed_code: None,
        }),
        Some(false) => Ok(Found::Applied {
            ledger,
            failed_code: Some(
                tx["result_xdr"]
                    .as_str()
                    .map_or_else(|| "tx_failed".to_owned(), crate::tx::result_code),
            ),
        }),
        None => Err(RpcError::Protocol("history: no `successful`".to_owned())),
    }
}

/// Reads the root's ingested range.
pub fn parse_coverage(body: &[u8]) -> Result<Coverage, RpcError> {
    let root: Value =
        serde_json::from_slice(body).map_err(|e| RpcError::Protocol(format!("history root: not JSON: {e}")))?;
    let field = |name: &str| {
        number(&root[name])
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| RpcError::Protocol(format!("history root: no {name}")))
    };
    Ok(Coverage {
        elder: field("history_elder_ledger")?,
        latest: field("history_latest_ledger")?,
    })
}

impl History {
    pub fn new(base: &str) -> Self {
        Self {
            base: base.trim_end_matches('/').to_owned(),
        }
    }

    fn get(&self, path: &str) -> Result<http::Response, RpcError> {
        let request = Request {
            method: "GET".to_owned(),
            url: format!("{}{path}", self.base),
            headers: vec![("accept".to_owned(), "application/json".to_owned())],
            body: Vec::new(),
        };
        http::send(&request).map_err(|e| match e {
            http::Error::Denied(why) => RpcError::Denied(why),
            other => RpcError::Unavailable {
                what: format!("history: {other:?}"),
                retry_after: None,
            },
        })
    }

    /// The transaction `hash` (hex), as the source knows it.
    pub fn transaction(&self, hash: &str) -> Result<Found, RpcError> {
        let response = self.get(&format!("/transactions/{hash}"))?;
        parse_transaction(response.status, &response.body, hash)
    }

    /// The ledgers the source has ingested.
    pub fn coverage(&self) -> Result<Coverage, RpcError> {
        let response = self.get("/")?;
        if response.status != 200 {
            return Err(RpcError::Unavailable {
                what: format!("history root: HTTP {}", response.status),
                retry_after: None,
            });
        }
        parse_coverage(&response.body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HASH: &str = "3389e9f0f1a65f19736cacf544c2e825313e8447f569233bb8db39aa607c8889";

    #[test]
    fn a_successful_transaction_is_applied_in_its_ledger() {
        let body = format!(r#"{{"hash":"{HASH}","ledger":7840,"successful":true}}"#);
        assert_eq!(
            parse_transaction(200, body.as_bytes(), HASH),
            Ok(Found::Applied {
                ledger: 7840,
                failed_code: None
            })
        );
    }

    #[test]
    fn a_failed_transaction_carries_its_result_code() {
        use stellar_xdr::{
            InvokeHostFunctionResult, Limits, OperationResult, OperationResultTr, TransactionResult,
            TransactionResultExt, TransactionResultResult, WriteXdr,
        };
        let ops = vec![OperationResult::OpInner(OperationResultTr::InvokeHostFunction(
            InvokeHostFunctionResult::Trapped,
        ))];
        let result = TransactionResult {
            fee_charged: 100,
            result: TransactionResultResult::TxFailed(ops.try_into().expect("one op")),
            ext: TransactionResultExt::V0,
        }
        .to_xdr_base64(Limits::none())
        .expect("xdr");
        let body = format!(r#"{{"hash":"{HASH}","ledger":"12","successful":false,"result_xdr":"{result}"}}"#);
        match parse_transaction(200, body.as_bytes(), HASH) {
            Ok(Found::Applied {
                ledger: 12,
                failed_code: Some(code),
            }) => assert_eq!(code, "invoke_host_function_trapped"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_fee_bump_found_by_its_inner_hash_is_the_transaction() {
        let body = format!(
            r#"{{"hash":"{}","inner_transaction":{{"hash":"{HASH}"}},"ledger":5,"successful":true}}"#,
            "ab".repeat(32)
        );
        assert!(matches!(
            parse_transaction(200, body.as_bytes(), HASH),
            Ok(Found::Applied { ledger: 5, .. })
        ));
    }

    #[test]
    fn another_transaction_or_a_bad_answer_is_not_an_answer() {
        let other = format!(r#"{{"hash":"{}","ledger":5,"successful":true}}"#, "ab".repeat(32));
        assert!(matches!(
            parse_transaction(200, other.as_bytes(), HASH),
            Err(RpcError::Protocol(_))
        ));
        assert!(matches!(
            parse_transaction(200, b"<html>", HASH),
            Err(RpcError::Protocol(_))
        ));
        let undecided = format!(r#"{{"hash":"{HASH}","ledger":5}}"#);
        assert!(matches!(
            parse_transaction(200, undecided.as_bytes(), HASH),
            Err(RpcError::Protocol(_))
        ));
        assert!(matches!(
            parse_transaction(503, b"", HASH),
            Err(RpcError::Unavailable { .. })
        ));
        assert_eq!(parse_transaction(404, b"{}", HASH), Ok(Found::Missing));
    }

    #[test]
    fn missing_proves_nothing_outside_the_ingested_range() {
        let coverage =
            parse_coverage(br#"{"history_elder_ledger":100,"history_latest_ledger":"200","core_latest_ledger":201}"#)
                .expect("coverage");
        assert!(coverage.covers(100, 200));
        assert!(coverage.covers(150, 160));
        assert!(!coverage.covers(99, 160), "a ledger before the elder one");
        assert!(!coverage.covers(150, 201), "a ledger not yet ingested");
        assert!(parse_coverage(br#"{"history_latest_ledger":200}"#).is_err());
    }
}
