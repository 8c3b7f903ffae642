//! A fake Stellar RPC, for the demo and the tests: JSON-RPC 2.0 on `POST /`, params by name
//! or absent (arrays are refused, as stellar-rpc does), with the documented
//! result shapes and types (fees, counts and close times as strings).
//!
//! It is a small ledger, not a canned responder: it decodes envelopes with
//! `stellar-xdr`, hashes them with the network passphrase, verifies the
//! ed25519 signatures against the source account, enforces sequence =
//! current + 1, the minimum inclusion fee, the resource fee, and time and
//! ledger bounds; one queued transaction per account; a ledger closes on a
//! timer and applies what is queued. Faults are injected per call.
//!
//! Fee bumps (CAP-15) are applied as core applies them: the inner
//! transaction's sequence and bounds, both signatures checked, and a bump of
//! a queued transaction replaces it only at ten times its bid per operation
//! (replace-by-fee); `congest` keeps transactions bidding less than a floor
//! queued, unincluded, as surge pricing does.
//!
//! A contract call may require an account's authorisation
//! (`require_auth`), as a vault contract requires its agent's: simulation
//! then records the entry the RPC returns (source-account credentials when
//! that account is the source, address credentials with a fresh nonce
//! when a channel account is), and a transaction whose entry is missing,
//! forged, expired or replayed is applied as failed, fee and sequence
//! spent, as the network does.
//!
//! It forgets applied transactions older than its retention window, as the
//! real RPC does, and serves a Horizon-compatible history under `/history`
//! (`GET /history/transactions/{hash}` and the root's ingested range) that
//! remembers every applied transaction from `history_elder` on.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use ed25519_dalek::{Signature, VerifyingKey};
use serde_json::{json, Value};
use sha2::Digest as _;
use stellar_xdr::{
    AccountEntry, AccountEntryExt, AccountId, HostFunction, LedgerEntryData, LedgerKey, Limits, Memo, MuxedAccount,
    OperationBody, Preconditions, PublicKey, ReadXdr, ScVal, SequenceNumber, SorobanTransactionData, String32,
    Thresholds, TransactionEnvelope, TransactionExt, TransactionMeta, TransactionMetaV3, Uint256, WriteXdr,
};

/// The testnet passphrase.
pub const TESTNET: &str = "Test SDF Network ; September 2015";

/// §A4's simulation `transactionData` (resource fee 90353).
const TRANSACTION_DATA: &str = "AAAAAAAAAAEAAAAGAAAAAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAAAAFAAAAAEAAAABAAAABgAAAAEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQAAABAAAAABAAAAAgAAAA8AAAAHQmFsYW5jZQAAAAASAAAAAAAAAAAHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwAAAAEAHoSAAAAD6AAAAfQAAAAAAAFg8Q==";
const MIN_RESOURCE_FEE: i64 = 90_353;
/// §A4's `TransactionResult`s for rejections. (Its txSUCCESS fixture is
/// three bytes short of a whole hash, so results of applied transactions
/// are encoded here instead: see `applied_result`.)
const TX_BAD_SEQ: &str = "AAAAAAAAAGT////7AAAAAA==";
const TX_INSUFFICIENT_FEE: &str = "AAAAAAAAAGT////3AAAAAA==";
const TX_TOO_LATE: &str = "AAAAAAAAAGT////9AAAAAA==";
const TX_BAD_AUTH: &str = "AAAAAAAAAGT////6AAAAAA==";
const TX_MALFORMED: &str = "AAAAAAAAAGT////wAAAAAA==";
/// §A4's txFEE_BUMP_INNER_FAILED wrapping an inner txBAD_SEQ.
const TX_FEE_BUMP_INNER_BAD_SEQ: &str =
    "AAAAAAAAAMj////zEREREREREREREREREREREREREREREREREREREREREREAAAAAAAAAAP////sAAAAAAAAAAA==";

/// A fault for the next `sendTransaction`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendFault {
    /// `TRY_AGAIN_LATER`, nothing queued.
    TryAgainLater,
    /// HTTP 429 with `Retry-After: 1`.
    Http429,
    /// HTTP 504.
    Http504,
    /// `ERROR` txBAD_SEQ, nothing queued.
    BadSeq,
    /// `ERROR` txINSUFFICIENT_FEE, nothing queued.
    InsufficientFee,
    /// `PENDING`, then the transaction silently never lands.
    AcceptThenLose,
    /// Queued, but `getTransaction` says NOT_FOUND this many more times after it lands.
    HideFor(u32),
    /// Queued and applied as txFAILED (the contract trapped).
    Trap,
    /// Queued, but the HTTP answer never comes (the caller dies waiting).
    AcceptThenHang,
    /// Queued (the network has it), but the answer is HTTP 504 with
    /// `Retry-After: 1`, and it is applied only this many ledgers later.
    AcceptThen504 { apply_after: u32 },
    /// Queued, the answer never comes, and it is applied only this many
    /// ledgers later (a host killed mid-send, its transaction outliving the
    /// op's lease).
    AcceptThenHangFor { apply_after: u32 },
}

/// A transaction the fake accepted.
#[derive(Debug, Clone)]
pub struct Submitted {
    pub hash: String,
    /// The source account (the signer's public key).
    pub source: [u8; 32],
    pub sequence: i64,
    /// The inclusion fee bid per operation: `tx.fee` minus the declared
    /// resource fee (a fee bump's outer fee minus it, over two operations).
    pub inclusion_fee: i64,
    /// For a fee bump: the hash of the transaction it wraps.
    pub inner_hash: Option<String>,
    pub function: Option<String>,
    pub args: Vec<ScVal>,
    pub max_ledger: u32,
    /// The ledger that was latest when it was accepted.
    pub accepted_at_ledger: u32,
    pub state: TxState,
    /// The address-credentials nonce it spends, when it carries one.
    pub nonce: Option<i64>,
    /// Accounts its CreateAccount operations create.
    pub creates: Vec<[u8; 32]>,
    /// The account its AccountMerge operation merges its source into.
    pub merges_into: Option<[u8; 32]>,
    /// Who pays its fee: a fee bump's fee source, else its source.
    pub fee_source: [u8; 32],
    envelope: String,
    hide_for: u32,
    trap: bool,
    lose: bool,
    /// Not applied before this ledger closes (0: the next one).
    apply_at: u32,
}

impl Submitted {
    /// Whether this is the transaction `hash` names: its own hash, or for a
    /// fee bump the one it wraps (one sequence: at most one of them lands).
    pub fn carries(&self, hash: &str) -> bool {
        self.hash == hash || self.inner_hash.as_deref() == Some(hash)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxState {
    Queued,
    Success {
        ledger: u32,
    },
    Failed {
        ledger: u32,
    },
    /// Lost or expired: it never landed.
    Dropped,
}

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
    latest_ledger: u32,
    close_time: u64,
    /// The mean ledger time the retention window's close times imply
    /// (what `close_ledgers_every` closes at; Stellar's 5 s otherwise).
    ledger_ms: u64,
    network_id: [u8; 32],
    /// Minimum inclusion fee per operation (surge pricing raises it).
    min_inclusion_fee: i64,
    accounts: HashMap<[u8; 32], i64>,
    txs: Vec<Submitted>,
    queued: HashMap<[u8; 32], usize>,
    send_faults: VecDeque<SendFault>,
    simulate_faults: VecDeque<&'static str>,
    failing: bool,
    requests: usize,
    /// A send found another transaction of the same account already queued
    /// (what a dispatcher without per-signer serialization causes).
    concurrent_sends: usize,
    /// Sends refused for a bad sequence (not injected; a transaction that
    /// already landed, sent again, is not one).
    bad_seqs: usize,
    /// What each of them sent.
    bad_seq_sends: Vec<String>,
    /// The oldest ledger `getTransaction` claims to remember, when set
    /// (as if the retention window had moved on).
    oldest_override: Option<u32>,
    /// The oldest ledger the history source has ingested.
    history_elder: u32,
    /// Queued transactions bidding less than this per operation are not
    /// included (surge pricing).
    inclusion_floor: i64,
    /// The account each contract function's calls must be authorised by.
    authorizers: HashMap<String, [u8; 32]>,
    /// The last nonce handed out in a simulation.
    last_nonce: i64,
    /// Nonces spent by applied transactions.
    used_nonces: std::collections::HashSet<i64>,
    /// Transactions accepted whose authorisation did not hold.
    auth_failures: usize,
}

/// The fake; clones share state.
#[derive(Clone)]
pub struct FakeRpc {
    inner: Arc<Mutex<Inner>>,
}

impl Default for FakeRpc {
    fn default() -> Self {
        // stellar-docs' getFeeStats example and §A4's account fixture numbers.
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
                close_time: unix_now(),
                ledger_ms: 5000,
                network_id: sha2::Sha256::digest(TESTNET.as_bytes()).into(),
                min_inclusion_fee: 100,
                accounts: HashMap::new(),
                txs: Vec::new(),
                queued: HashMap::new(),
                send_faults: VecDeque::new(),
                simulate_faults: VecDeque::new(),
                failing: false,
                requests: 0,
                concurrent_sends: 0,
                bad_seqs: 0,
                bad_seq_sends: Vec::new(),
                oldest_override: None,
                history_elder: 1,
                inclusion_floor: 0,
                authorizers: HashMap::new(),
                last_nonce: 0x5eed_0000,
                used_nonces: std::collections::HashSet::new(),
                auth_failures: 0,
            })),
        }
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn rpc_error(id: &Value, code: i64, message: &str) -> Response {
    axum::Json(json!({ "jsonrpc": "2.0", "id": id, "error": { "code": code, "message": message } })).into_response()
}

fn ok(id: &Value, result: Value) -> Response {
    axum::Json(json!({ "jsonrpc": "2.0", "id": id, "result": result })).into_response()
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

    /// Creates an account with sequence number `sequence`.
    pub fn fund(&self, public_key: [u8; 32], sequence: i64) {
        self.lock().accounts.insert(public_key, sequence);
    }

    /// An account's current sequence number.
    pub fn sequence(&self, public_key: [u8; 32]) -> Option<i64> {
        self.lock().accounts.get(&public_key).copied()
    }

    /// Queues faults for the next `sendTransaction` calls, in order.
    pub fn inject(&self, faults: &[SendFault]) {
        self.lock().send_faults.extend(faults.iter().copied());
    }

    /// The next simulation returns a restore preamble.
    pub fn need_restore(&self) {
        self.lock().simulate_faults.push_back("restore");
    }

    /// The next simulation fails with a contract error.
    pub fn fail_simulation(&self) {
        self.lock().simulate_faults.push_back("error");
    }

    /// Every transaction accepted so far, in order.
    pub fn submitted(&self) -> Vec<Submitted> {
        self.lock().txs.clone()
    }

    /// Transactions that landed successfully.
    pub fn landed(&self) -> Vec<Submitted> {
        self.lock()
            .txs
            .iter()
            .filter(|t| matches!(t.state, TxState::Success { .. }))
            .cloned()
            .collect()
    }

    /// How many applied transactions each account paid the fee of.
    pub fn fees_paid(&self) -> HashMap<[u8; 32], usize> {
        let mut paid = HashMap::new();
        for t in &self.lock().txs {
            if matches!(t.state, TxState::Success { .. } | TxState::Failed { .. }) {
                *paid.entry(t.fee_source).or_insert(0) += 1;
            }
        }
        paid
    }

    /// Sends that met another queued transaction of their account.
    pub fn concurrent_sends(&self) -> usize {
        self.lock().concurrent_sends
    }

    /// Sends refused for a bad sequence that was not injected.
    pub fn bad_seqs(&self) -> usize {
        self.lock().bad_seqs
    }

    /// What each send with a bad sequence sent (hash, source, sequence).
    pub fn bad_seq_sends(&self) -> Vec<String> {
        self.lock().bad_seq_sends.clone()
    }

    /// From now on `getTransaction` remembers nothing before `ledger`.
    pub fn forget_before(&self, ledger: u32) {
        self.lock().oldest_override = Some(ledger);
    }

    /// From now on a ledger includes only queued transactions bidding at
    /// least `floor` per operation; the rest stay queued (0: all).
    pub fn congest(&self, floor: i64) {
        self.lock().inclusion_floor = floor;
    }

    /// From now on the history source has ingested nothing before `ledger`.
    pub fn history_forget_before(&self, ledger: u32) {
        self.lock().history_elder = ledger;
    }

    /// Closes one ledger, then moves the chain on `ledgers` more at once
    /// (empty ledgers), as if that much time had passed: past the retention
    /// window (120,960 ledgers, about 7 days), the RPC forgets what landed.
    pub fn skip_ledgers(&self, ledgers: u32) {
        self.close_ledger();
        self.lock().latest_ledger += ledgers;
    }

    /// Every call of contract function `function` must be authorised by
    /// this account from now on.
    pub fn require_auth(&self, function: &str, public_key: [u8; 32]) {
        self.lock().authorizers.insert(function.to_owned(), public_key);
    }

    /// Transactions accepted whose authorisation did not hold (applied as
    /// failed).
    pub fn auth_failures(&self) -> usize {
        self.lock().auth_failures
    }

    /// The latest ledger.
    pub fn latest_ledger(&self) -> u32 {
        self.lock().latest_ledger
    }

    /// Closes one ledger: applies or drops every queued transaction.
    pub fn close_ledger(&self) {
        let mut inner = self.lock();
        inner.latest_ledger += 1;
        inner.close_time = unix_now();
        let ledger = inner.latest_ledger;
        let close_time = inner.close_time;
        let queued: Vec<([u8; 32], usize)> = inner.queued.drain().collect();
        for (account, index) in queued {
            // Under surge pricing a low bid stays queued, until its bounds
            // pass: then it is dropped like any expired transaction.
            let t = &inner.txs[index];
            let expired = t.max_ledger != 0 && ledger >= t.max_ledger;
            if t.apply_at > ledger || (!expired && t.inclusion_fee < inner.inclusion_floor) {
                // Still in the network's queue, holding the account's slot,
                // unless it cannot be in the next ledger either: core trims
                // such a transaction at this close (a sender that sees the
                // tip reach its bound rightly builds the next one now; found
                // when the fake kept it one ledger longer and counted that
                // send as a second transaction of the account).
                if t.max_ledger == 0 || ledger + 1 < t.max_ledger {
                    inner.queued.insert(account, index);
                } else {
                    inner.txs[index].state = TxState::Dropped;
                }
                continue;
            }
            let (sequence, max_ledger, lose, mut trap, nonce, creates, merges_into) = {
                let t = &inner.txs[index];
                (
                    t.sequence,
                    t.max_ledger,
                    t.lose,
                    t.trap,
                    t.nonce,
                    t.creates.clone(),
                    t.merges_into,
                )
            };
            let current = inner.accounts.get(&account).copied().unwrap_or_default();
            let valid = !lose && (max_ledger == 0 || ledger < max_ledger) && sequence == current + 1;
            let _ = close_time;
            let state = if !valid {
                TxState::Dropped
            } else {
                // The sequence is consumed whether the call succeeds or traps.
                inner.accounts.insert(account, sequence);
                if let Some(nonce) = nonce {
                    // A replayed authorisation fails the call.
                    if !inner.used_nonces.insert(nonce) {
                        inner.auth_failures += 1;
                        trap = true;
                    }
                }
                // All or nothing: an account that exists fails them all.
                if creates.iter().any(|a| inner.accounts.contains_key(a)) {
                    trap = true;
                } else if !trap {
                    for account in &creates {
                        // A new account's sequence starts at its ledger.
                        inner.accounts.insert(*account, i64::from(ledger) << 32);
                    }
                }
                // A merge into an account that does not exist fails; one
                // that succeeds removes the source.
                if let Some(into) = merges_into {
                    if !inner.accounts.contains_key(&into) {
                        trap = true;
                    } else if !trap {
                        inner.accounts.remove(&account);
                    }
                }
                if trap {
                    TxState::Failed { ledger }
                } else {
                    TxState::Success { ledger }
                }
            };
            inner.txs[index].state = state;
        }
    }

    /// Closes a ledger every `every` until the returned handle is aborted.
    pub fn close_ledgers_every(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let fake = self.clone();
        fake.lock().ledger_ms = u64::try_from(every.as_millis()).unwrap_or(u64::MAX).max(1);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                fake.close_ledger();
            }
        })
    }

    /// Serves on 127.0.0.1; returns the URL.
    ///
    /// # Errors
    ///
    /// The port cannot be bound.
    pub async fn serve(&self) -> std::io::Result<String> {
        self.serve_on(0).await
    }

    /// Serves on loopback at `port` (0: any free one); returns the URL.
    ///
    /// # Errors
    ///
    /// The port cannot be bound.
    pub async fn serve_on(&self, port: u16) -> std::io::Result<String> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        let url = format!("http://{}/", listener.local_addr()?);
        let app = axum::Router::new()
            .route("/history/", axum::routing::get(history_root))
            .route("/history/transactions/{hash}", axum::routing::get(history_transaction))
            .fallback(handle)
            .with_state(self.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(url)
    }
}

/// Horizon's root: the ledgers its history has ingested.
async fn history_root(State(fake): State<FakeRpc>) -> Response {
    let inner = fake.lock();
    axum::Json(json!({
        "history_elder_ledger": inner.history_elder,
        "history_latest_ledger": inner.latest_ledger,
        "core_latest_ledger": inner.latest_ledger,
        "network_passphrase": TESTNET,
    }))
    .into_response()
}

/// Horizon's `GET /transactions/{hash}`: an applied transaction in the
/// ingested range, or Horizon's 404 problem.
async fn history_transaction(
    State(fake): State<FakeRpc>,
    axum::extract::Path(hash): axum::extract::Path<String>,
) -> Response {
    let inner = fake.lock();
    // Horizon finds a fee bump by its own hash and by its inner one.
    let found = inner.txs.iter().rev().find_map(|t| match t.state {
        TxState::Success { ledger } if t.carries(&hash) => Some((t, ledger, true)),
        TxState::Failed { ledger } if t.carries(&hash) => Some((t, ledger, false)),
        _ => None,
    });
    match found {
        Some((t, ledger, successful)) if ledger >= inner.history_elder => {
            let mut tx = json!({
                "id": t.hash, "hash": t.hash, "ledger": ledger, "successful": successful,
                "source_account": address(t.source), "source_account_sequence": t.sequence.to_string(),
                "envelope_xdr": t.envelope, "result_xdr": applied_result(successful),
                "operation_count": 1,
            });
            if let Some(inner_hash) = &t.inner_hash {
                tx["inner_transaction"] = json!({ "hash": inner_hash });
                tx["fee_bump_transaction"] = json!({ "hash": t.hash });
            }
            axum::Json(tx).into_response()
        }
        _ => (
            StatusCode::NOT_FOUND,
            axum::Json(json!({
                "type": "https://stellar.org/horizon-errors/not_found",
                "title": "Resource Missing",
                "status": 404,
                "detail": "The resource at the url requested was not found.",
            })),
        )
            .into_response(),
    }
}

async fn handle(State(fake): State<FakeRpc>, body: Bytes) -> Response {
    let (response, hang) = fake.answer(&body);
    if hang {
        // The transaction is queued, but its submitter never hears so.
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
    response
}

impl FakeRpc {
    fn answer(&self, body: &[u8]) -> (Response, bool) {
        let mut inner = self.lock();
        inner.requests += 1;
        if inner.failing {
            return (StatusCode::SERVICE_UNAVAILABLE.into_response(), false);
        }
        let Ok(request) = serde_json::from_slice::<Value>(body) else {
            return (rpc_error(&Value::Null, -32700, "parse error"), false);
        };
        let id = request.get("id").cloned().unwrap_or(Value::Null);
        if request.get("jsonrpc") != Some(&json!("2.0")) {
            return (rpc_error(&id, -32600, "invalid request"), false);
        }
        let params = match request.get("params") {
            None => json!({}),
            Some(p) if p.is_object() => p.clone(),
            Some(_) => {
                return (
                    rpc_error(&id, -32602, "invalid parameters: params must be an object"),
                    false,
                )
            }
        };
        let method = request.get("method").and_then(Value::as_str).unwrap_or_default();
        match method {
            "getFeeStats" => (ok(&id, inner.fee_stats()), false),
            "getLatestLedger" => (
                ok(
                    &id,
                    json!({
                        "id": hex::encode(sha2::Sha256::digest(inner.latest_ledger.to_be_bytes())),
                        "protocolVersion": 27,
                        "sequence": inner.latest_ledger,
                        "closeTime": inner.close_time.to_string(),
                    }),
                ),
                false,
            ),
            "getNetwork" => (
                ok(
                    &id,
                    json!({ "passphrase": TESTNET, "protocolVersion": 27, "friendbotUrl": "https://friendbot-testnet.stellar.org/" }),
                ),
                false,
            ),
            "getHealth" => (
                ok(
                    &id,
                    json!({
                        "status": "healthy", "latestLedger": inner.latest_ledger,
                        "latestLedgerCloseTime": inner.close_time.to_string(),
                        "oldestLedger": inner.oldest_ledger(),
                        "oldestLedgerCloseTime": inner.oldest_close_time().to_string(),
                        "ledgerRetentionWindow": 120_960,
                    }),
                ),
                false,
            ),
            "getLedgerEntries" => (inner.ledger_entries(&id, &params), false),
            "simulateTransaction" => (inner.simulate(&id, &params), false),
            "sendTransaction" => inner.send(&id, &params),
            "getTransaction" => (inner.transaction(&id, &params), false),
            _ => (rpc_error(&id, -32601, "method not found"), false),
        }
    }
}

impl Inner {
    /// The oldest ledger `getTransaction` and `getHealth` say they remember.
    fn oldest_ledger(&self) -> u32 {
        self.oldest_override
            .unwrap_or(self.latest_ledger.saturating_sub(120_960))
    }

    /// Its close time, one ledger time per ledger before the latest's, so a
    /// client can read the ledger time off the window as on the network.
    fn oldest_close_time(&self) -> u64 {
        let ledgers = u64::from(self.latest_ledger.saturating_sub(self.oldest_ledger()));
        self.close_time
            .saturating_sub(ledgers.saturating_mul(self.ledger_ms) / 1000)
    }

    fn fee_stats(&self) -> Value {
        let f = &self.fees;
        let dist = |count: u64, ledgers: u64| {
            json!({
                "max": f.max.to_string(), "min": f.min.to_string(), "mode": f.min.to_string(),
                "p10": f.min.to_string(), "p20": f.min.to_string(), "p30": f.min.to_string(), "p40": f.min.to_string(),
                "p50": f.min.to_string(), "p60": f.min.to_string(), "p70": f.p70.to_string(), "p80": f.p70.to_string(),
                "p90": f.p95.to_string(), "p95": f.p95.to_string(), "p99": f.max.to_string(),
                "transactionCount": count.to_string(), "ledgerCount": ledgers,
            })
        };
        json!({
            "sorobanInclusionFee": dist(f.transaction_count, f.ledger_count),
            "inclusionFee": dist(28, 10),
            "latestLedger": self.latest_ledger,
        })
    }

    fn ledger_entries(&self, id: &Value, params: &Value) -> Response {
        let Some(keys) = params["keys"].as_array() else {
            return rpc_error(id, -32602, "invalid parameters: keys");
        };
        if keys.len() > 200 {
            return rpc_error(
                id,
                -32602,
                &format!("key count ({}) exceeds maximum supported (200)", keys.len()),
            );
        }
        let mut entries = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let text = key.as_str().unwrap_or_default();
            let Ok(decoded) = LedgerKey::from_xdr_base64(text, Limits::none()) else {
                return rpc_error(id, -32602, &format!("cannot unmarshal key value {text} at index {i}"));
            };
            let LedgerKey::Account(account) = decoded else { continue };
            let AccountId(PublicKey::PublicKeyTypeEd25519(Uint256(bytes))) = account.account_id.clone();
            let Some(sequence) = self.accounts.get(&bytes) else {
                continue;
            };
            let entry = LedgerEntryData::Account(AccountEntry {
                account_id: account.account_id,
                balance: 10_000_000_000,
                seq_num: SequenceNumber(*sequence),
                num_sub_entries: 0,
                inflation_dest: None,
                flags: 0,
                home_domain: String32::default(),
                thresholds: Thresholds([1, 0, 0, 0]),
                signers: Vec::new().try_into().unwrap_or_default(),
                ext: AccountEntryExt::V0,
            });
            entries.push(json!({
                "key": text,
                "xdr": entry.to_xdr_base64(Limits::none()).unwrap_or_default(),
                "lastModifiedLedgerSeq": self.latest_ledger,
            }));
        }
        ok(id, json!({ "entries": entries, "latestLedger": self.latest_ledger }))
    }

    fn simulate(&mut self, id: &Value, params: &Value) -> Response {
        let latest = self.latest_ledger;
        let fail = |error: &str| ok(id, json!({ "error": error, "latestLedger": latest }));
        let Ok(envelope) =
            TransactionEnvelope::from_xdr_base64(params["transaction"].as_str().unwrap_or_default(), Limits::none())
        else {
            return fail("Could not unmarshal transaction");
        };
        let TransactionEnvelope::Tx(v1) = envelope else {
            return fail("Could not unmarshal transaction");
        };
        if v1.tx.operations.len() != 1 {
            return fail("Transaction contains more than one operation");
        }
        if v1.tx.memo != Memo::None {
            return fail("Transaction contains a memo. Soroban transactions do not support memos.");
        }
        match &v1.tx.operations[0].body {
            OperationBody::InvokeHostFunction(_) | OperationBody::RestoreFootprint(_) => {}
            other => {
                return fail(&format!(
                    "Transaction contains unsupported operation type: {}",
                    other.name()
                ))
            }
        }
        match self.simulate_faults.pop_front() {
            Some("restore") => ok(
                id,
                json!({
                    "restorePreamble": { "transactionData": TRANSACTION_DATA, "minResourceFee": MIN_RESOURCE_FEE.to_string() },
                    "latestLedger": latest,
                }),
            ),
            Some(_) => fail("host invocation failed\n\nCaused by:\n    HostError: Error(Contract, #3)"),
            None => {
                let auth: Vec<String> = self.auth_entry(&v1.tx).into_iter().collect();
                ok(
                    id,
                    json!({
                        "transactionData": TRANSACTION_DATA,
                        "minResourceFee": MIN_RESOURCE_FEE.to_string(),
                        "events": [],
                        "results": [{ "auth": auth, "xdr": "AAAAAQ==" }],
                        "latestLedger": latest,
                    }),
                )
            }
        }
    }

    /// The account a contract call must be authorised by, if any.
    fn authorizer_of(&self, call: &stellar_xdr::InvokeContractArgs) -> Option<[u8; 32]> {
        self.authorizers
            .get(call.function_name.0.to_utf8_string_lossy().as_str())
            .copied()
    }

    /// The authorisation entry a simulation records for a contract call,
    /// when an authoriser is required.
    fn auth_entry(&mut self, tx: &stellar_xdr::Transaction) -> Option<String> {
        let call = contract_call(tx)?;
        let authorizer = self.authorizer_of(call)?;
        let source = match tx.source_account {
            MuxedAccount::Ed25519(Uint256(s)) => s,
            MuxedAccount::MuxedEd25519(_) => return None,
        };
        let credentials = if source == authorizer {
            stellar_xdr::SorobanCredentials::SourceAccount
        } else {
            self.last_nonce += 1;
            stellar_xdr::SorobanCredentials::Address(stellar_xdr::SorobanAddressCredentials {
                address: stellar_xdr::ScAddress::Account(AccountId(PublicKey::PublicKeyTypeEd25519(Uint256(
                    authorizer,
                )))),
                nonce: self.last_nonce,
                signature_expiration_ledger: 0,
                signature: ScVal::Void,
            })
        };
        stellar_xdr::SorobanAuthorizationEntry {
            credentials,
            root_invocation: stellar_xdr::SorobanAuthorizedInvocation {
                function: stellar_xdr::SorobanAuthorizedFunction::ContractFn(call.clone()),
                sub_invocations: Vec::new().try_into().unwrap_or_default(),
            },
        }
        .to_xdr_base64(Limits::none())
        .ok()
    }

    /// Whether a contract call carries the required authorisation: the
    /// source's own when the authoriser is the source, otherwise an
    /// address entry for exactly this call, signed by the authoriser over
    /// this network, not yet expired. `Ok` carries the nonce it spends.
    fn authorised(&self, tx: &stellar_xdr::Transaction, source: [u8; 32]) -> Result<Option<i64>, ()> {
        let Some(call) = contract_call(tx) else {
            return Ok(None);
        };
        let Some(authorizer) = self.authorizer_of(call) else {
            return Ok(None);
        };
        let Some(OperationBody::InvokeHostFunction(op)) = tx.operations.first().map(|o| &o.body) else {
            return Ok(None);
        };
        let for_call = |e: &&stellar_xdr::SorobanAuthorizationEntry| {
            e.root_invocation.function == stellar_xdr::SorobanAuthorizedFunction::ContractFn(call.clone())
        };
        for entry in op.auth.iter().filter(for_call) {
            match &entry.credentials {
                stellar_xdr::SorobanCredentials::SourceAccount if source == authorizer => return Ok(None),
                stellar_xdr::SorobanCredentials::Address(c)
                    if c.address
                        == stellar_xdr::ScAddress::Account(AccountId(PublicKey::PublicKeyTypeEd25519(Uint256(
                            authorizer,
                        )))) =>
                {
                    if c.signature_expiration_ledger <= self.latest_ledger {
                        return Err(());
                    }
                    let preimage = stellar_xdr::HashIdPreimage::SorobanAuthorization(
                        stellar_xdr::HashIdPreimageSorobanAuthorization {
                            network_id: stellar_xdr::Hash(self.network_id),
                            nonce: c.nonce,
                            signature_expiration_ledger: c.signature_expiration_ledger,
                            invocation: entry.root_invocation.clone(),
                        },
                    );
                    let Ok(bytes) = preimage.to_xdr(Limits::none()) else {
                        return Err(());
                    };
                    let payload: [u8; 32] = sha2::Sha256::digest(bytes).into();
                    return if account_signed(authorizer, &payload, &c.signature) {
                        Ok(Some(c.nonce))
                    } else {
                        Err(())
                    };
                }
                _ => {}
            }
        }
        Err(())
    }

    fn send_answer(&self, id: &Value, status: &str, hash: &str, error: Option<&str>) -> Response {
        let mut result = json!({
            "status": status, "hash": hash, "latestLedger": self.latest_ledger,
            "latestLedgerCloseTime": self.close_time.to_string(),
        });
        if let Some(e) = error {
            result["errorResultXdr"] = json!(e);
        }
        ok(id, result)
    }

    fn send(&mut self, id: &Value, params: &Value) -> (Response, bool) {
        let Ok(envelope) =
            TransactionEnvelope::from_xdr_base64(params["transaction"].as_str().unwrap_or_default(), Limits::none())
        else {
            return (rpc_error(id, -32602, "invalid_xdr"), false);
        };
        let Ok(hash) = envelope.hash(self.network_id) else {
            return (rpc_error(id, -32602, "invalid_hash"), false);
        };
        let hash_hex = hex::encode(hash);
        // A fee bump carries the transaction it pays for: that one's
        // sequence, bounds and signature are checked as for any other.
        let (v1, bump) = match &envelope {
            TransactionEnvelope::Tx(v1) => (v1, None),
            TransactionEnvelope::TxFeeBump(bump) => {
                let stellar_xdr::FeeBumpTransactionInnerTx::Tx(inner) = &bump.tx.inner_tx;
                (inner, Some(bump))
            }
            TransactionEnvelope::TxV0(_) => {
                return (self.send_answer(id, "ERROR", &hash_hex, Some(TX_MALFORMED)), false);
            }
        };
        let Ok(inner_hash) = v1.hash(self.network_id) else {
            return (rpc_error(id, -32602, "invalid_hash"), false);
        };
        let fault = self.send_faults.pop_front();
        match fault {
            Some(SendFault::Http429) => {
                let mut r = StatusCode::TOO_MANY_REQUESTS.into_response();
                r.headers_mut()
                    .insert("retry-after", axum::http::HeaderValue::from_static("1"));
                return (r, false);
            }
            Some(SendFault::Http504) => return (StatusCode::GATEWAY_TIMEOUT.into_response(), false),
            Some(SendFault::TryAgainLater) => return (self.send_answer(id, "TRY_AGAIN_LATER", &hash_hex, None), false),
            Some(SendFault::BadSeq) => return (self.send_answer(id, "ERROR", &hash_hex, Some(TX_BAD_SEQ)), false),
            Some(SendFault::InsufficientFee) => {
                return (
                    self.send_answer(id, "ERROR", &hash_hex, Some(TX_INSUFFICIENT_FEE)),
                    false,
                )
            }
            _ => {}
        }
        let tx = &v1.tx;
        let MuxedAccount::Ed25519(Uint256(source)) = tx.source_account else {
            return (self.send_answer(id, "ERROR", &hash_hex, Some(TX_MALFORMED)), false);
        };
        // Any queued copy: an earlier copy of the same bytes may have been
        // dropped, and the network knows the hash by its live one.
        if self
            .txs
            .iter()
            .any(|t| t.hash == hash_hex && t.state == TxState::Queued)
        {
            return (self.send_answer(id, "DUPLICATE", &hash_hex, None), false);
        }
        // Signatures: a wrong passphrase or key gives a different hash or
        // a signature that does not verify: txBAD_AUTH.
        let fee_source_signed = bump.is_none_or(|b| match b.tx.fee_source {
            MuxedAccount::Ed25519(Uint256(payer)) => signed_by(payer, &hash, &b.signatures),
            MuxedAccount::MuxedEd25519(_) => false,
        });
        if !(fee_source_signed && signed_by(source, &inner_hash, &v1.signatures)) {
            return (self.send_answer(id, "ERROR", &hash_hex, Some(TX_BAD_AUTH)), false);
        }
        let resource_fee = match &tx.ext {
            TransactionExt::V1(SorobanTransactionData { resource_fee, .. }) => *resource_fee,
            TransactionExt::V0 => 0,
        };
        // Per operation: a fee bump bids for the inner one and itself.
        let inclusion_fee = match bump {
            None => i64::from(tx.fee) - resource_fee,
            Some(b) if b.tx.fee >= i64::from(tx.fee) => (b.tx.fee - resource_fee) / 2,
            Some(_) => {
                return (
                    self.send_answer(id, "ERROR", &hash_hex, Some(TX_INSUFFICIENT_FEE)),
                    false,
                )
            }
        };
        // Bounds first (core checks them before the sequence): a
        // transaction past its bounds is too late whatever else holds, so
        // a host frozen past them, waking to send it, is neither a second
        // transaction of the account nor a bad sequence: nothing it sends
        // can land.
        let (max_time, max_ledger) = match &tx.cond {
            Preconditions::None => (0, 0),
            Preconditions::Time(t) => (t.max_time.0, 0),
            Preconditions::V2(v2) => (
                v2.time_bounds.as_ref().map_or(0, |t| t.max_time.0),
                v2.ledger_bounds.as_ref().map_or(0, |l| l.max_ledger),
            ),
        };
        if (max_time != 0 && max_time < unix_now()) || (max_ledger != 0 && self.latest_ledger + 1 >= max_ledger) {
            return (self.send_answer(id, "ERROR", &hash_hex, Some(TX_TOO_LATE)), false);
        }
        let inner_hex = hex::encode(inner_hash);
        let mut replaces = None;
        if let Some(&queued) = self.queued.get(&source) {
            if !(bump.is_some() && self.txs[queued].carries(&inner_hex)) {
                self.concurrent_sends += 1;
                return (self.send_answer(id, "TRY_AGAIN_LATER", &hash_hex, None), false);
            }
            // Replace-by-fee: a fee bump of a queued transaction replaces
            // it only at ten times its bid.
            if inclusion_fee < self.txs[queued].inclusion_fee.saturating_mul(10) {
                return (
                    self.send_answer(id, "ERROR", &hash_hex, Some(TX_INSUFFICIENT_FEE)),
                    false,
                );
            }
            replaces = Some(queued);
        }
        let current = self.accounts.get(&source).copied().unwrap_or_default();
        if tx.seq_num.0 != current + 1 {
            // A transaction that has already landed, sent again (a host
            // frozen between its checkpoint and its send, waking after
            // another host's reconcile landed the same envelope), or a fee
            // bump of it, is refused for its sequence: the sender sent
            // nothing stale, so it is not counted as a bad sequence.
            let inner_landed = self
                .txs
                .iter()
                .any(|t| matches!(t.state, TxState::Success { .. } | TxState::Failed { .. }) && t.carries(&inner_hex));
            if !inner_landed {
                self.bad_seqs += 1;
                self.bad_seq_sends.push(format!(
                    "{hash_hex} from {} at sequence {} (current {current}){}",
                    address(source),
                    tx.seq_num.0,
                    if bump.is_some() { ", a fee bump" } else { "" }
                ));
            }
            let code = if bump.is_some() {
                TX_FEE_BUMP_INNER_BAD_SEQ
            } else {
                TX_BAD_SEQ
            };
            return (self.send_answer(id, "ERROR", &hash_hex, Some(code)), false);
        }
        if resource_fee > i64::from(tx.fee) {
            return (self.send_answer(id, "ERROR", &hash_hex, Some(TX_MALFORMED)), false);
        }
        if inclusion_fee < self.min_inclusion_fee * i64::try_from(tx.operations.len()).unwrap_or(1) {
            return (
                self.send_answer(id, "ERROR", &hash_hex, Some(TX_INSUFFICIENT_FEE)),
                false,
            );
        }
        let (function, args) = contract_call(tx).map_or((None, Vec::new()), |call| {
            (Some(call.function_name.0.to_utf8_string_lossy()), call.args.to_vec())
        });
        let (nonce, unauthorised) = match self.authorised(tx, source) {
            Ok(nonce) => (nonce, false),
            Err(()) => {
                self.auth_failures += 1;
                (None, true)
            }
        };
        if let Some(replaced) = replaces {
            self.txs[replaced].state = TxState::Dropped;
            self.queued.remove(&source);
        }
        let index = self.txs.len();
        self.txs.push(Submitted {
            hash: hash_hex.clone(),
            source,
            sequence: tx.seq_num.0,
            inclusion_fee,
            inner_hash: bump.map(|_| inner_hex.clone()),
            function,
            args,
            max_ledger,
            accepted_at_ledger: self.latest_ledger,
            state: TxState::Queued,
            envelope: params["transaction"].as_str().unwrap_or_default().to_owned(),
            hide_for: match fault {
                Some(SendFault::HideFor(n)) => n,
                _ => 0,
            },
            trap: fault == Some(SendFault::Trap) || unauthorised,
            nonce,
            creates: tx
                .operations
                .iter()
                .filter_map(|o| match &o.body {
                    OperationBody::CreateAccount(c) => {
                        let AccountId(PublicKey::PublicKeyTypeEd25519(Uint256(new))) = c.destination.clone();
                        Some(new)
                    }
                    _ => None,
                })
                .collect(),
            merges_into: tx.operations.iter().find_map(|o| match &o.body {
                OperationBody::AccountMerge(MuxedAccount::Ed25519(Uint256(into))) => Some(*into),
                _ => None,
            }),
            fee_source: match bump.map(|b| &b.tx.fee_source) {
                Some(MuxedAccount::Ed25519(Uint256(payer))) => *payer,
                _ => source,
            },
            lose: fault == Some(SendFault::AcceptThenLose),
            apply_at: match fault {
                Some(SendFault::AcceptThen504 { apply_after } | SendFault::AcceptThenHangFor { apply_after }) => {
                    self.latest_ledger + apply_after
                }
                _ => 0,
            },
        });
        self.queued.insert(source, index);
        match fault {
            Some(SendFault::AcceptThen504 { .. }) => {
                // A gateway asking for a second: the sender backs off for
                // certain, so a test sees what happens while it waits.
                let mut r = StatusCode::GATEWAY_TIMEOUT.into_response();
                r.headers_mut()
                    .insert("retry-after", axum::http::HeaderValue::from_static("1"));
                (r, false)
            }
            Some(SendFault::AcceptThenHang | SendFault::AcceptThenHangFor { .. }) => {
                (self.send_answer(id, "PENDING", &hash_hex, None), true)
            }
            _ => (self.send_answer(id, "PENDING", &hash_hex, None), false),
        }
    }

    fn transaction(&mut self, id: &Value, params: &Value) -> Response {
        let hash = params["hash"].as_str().unwrap_or_default().to_owned();
        if hash.len() != 64 {
            return rpc_error(id, -32602, &format!("unexpected hash length ({})", hash.len()));
        }
        if hex::decode(&hash).is_err() {
            return rpc_error(id, -32602, &format!("incorrect hash: {hash}"));
        }
        let mut result = json!({
            "status": "NOT_FOUND", "txHash": hash,
            "latestLedger": self.latest_ledger, "latestLedgerCloseTime": self.close_time.to_string(),
            "oldestLedger": self.oldest_ledger(),
            "oldestLedgerCloseTime": self.oldest_close_time().to_string(),
        });
        let oldest = self.oldest_ledger();
        if self.txs.iter().any(|t| {
            t.hash == hash
                && matches!(t.state, TxState::Success { ledger } | TxState::Failed { ledger } if ledger < oldest)
        }) {
            return ok(id, result);
        }
        // The newest copy: the same bytes sent again after a copy was
        // dropped are what landed (found by the fault harness: the first,
        // dropped copy answered NOT_FOUND for a transaction that had landed).
        let Some(tx) = self.txs.iter_mut().rev().find(|t| t.hash == hash) else {
            return ok(id, result);
        };
        let (status, ledger, result_xdr) = match tx.state {
            TxState::Success { ledger } => ("SUCCESS", ledger, applied_result(true)),
            TxState::Failed { ledger } => ("FAILED", ledger, applied_result(false)),
            TxState::Queued | TxState::Dropped => return ok(id, result),
        };
        if tx.hide_for > 0 {
            tx.hide_for -= 1;
            return ok(id, result);
        }
        let meta = TransactionMeta::V3(TransactionMetaV3 {
            ext: stellar_xdr::ExtensionPoint::V0,
            tx_changes_before: Vec::new().try_into().unwrap_or_default(),
            operations: Vec::new().try_into().unwrap_or_default(),
            tx_changes_after: Vec::new().try_into().unwrap_or_default(),
            soroban_meta: None,
        });
        result["status"] = json!(status);
        result["applicationOrder"] = json!(1);
        result["feeBump"] = json!(tx.inner_hash.is_some());
        result["envelopeXdr"] = json!(tx.envelope);
        result["resultXdr"] = json!(result_xdr);
        result["resultMetaXdr"] = json!(meta.to_xdr_base64(Limits::none()).unwrap_or_default());
        result["ledger"] = json!(ledger);
        result["createdAt"] = json!(unix_now().to_string());
        ok(id, result)
    }
}

/// The op's contract call, when it is one.
fn contract_call(tx: &stellar_xdr::Transaction) -> Option<&stellar_xdr::InvokeContractArgs> {
    match tx.operations.first().map(|o| &o.body) {
        Some(OperationBody::InvokeHostFunction(op)) => match &op.host_function {
            HostFunction::InvokeContract(call) => Some(call),
            _ => None,
        },
        _ => None,
    }
}

/// Whether a classic account's signature value (`[{public_key,
/// signature}]`) is `key`'s over `payload`.
fn account_signed(key: [u8; 32], payload: &[u8; 32], value: &ScVal) -> bool {
    let ScVal::Vec(Some(signatures)) = value else {
        return false;
    };
    let field = |map: &stellar_xdr::ScMap, name: &str| {
        map.iter().find_map(|e| match (&e.key, &e.val) {
            (ScVal::Symbol(s), ScVal::Bytes(b)) if s.0.as_slice() == name.as_bytes() => Some(b.0.to_vec()),
            _ => None,
        })
    };
    let Ok(verifying) = VerifyingKey::from_bytes(&key) else {
        return false;
    };
    signatures.iter().any(|s| {
        let ScVal::Map(Some(map)) = s else { return false };
        field(map, "public_key").as_deref() == Some(key.as_slice())
            && field(map, "signature")
                .and_then(|sig| Signature::from_slice(&sig).ok())
                .is_some_and(|sig| verifying.verify_strict(payload, &sig).is_ok())
    })
}

/// Whether one of `signatures` is `key`'s over `hash`.
fn signed_by(key: [u8; 32], hash: &[u8; 32], signatures: &[stellar_xdr::DecoratedSignature]) -> bool {
    VerifyingKey::from_bytes(&key).is_ok_and(|verifying| {
        signatures.iter().any(|s| {
            s.hint.0 == key[28..32]
                && Signature::from_slice(s.signature.0.as_slice())
                    .is_ok_and(|sig| verifying.verify_strict(hash, &sig).is_ok())
        })
    })
}

/// The `TransactionResult` of an applied InvokeHostFunction transaction:
/// success (with a result hash), or failed because the contract trapped.
fn applied_result(success: bool) -> String {
    use stellar_xdr::{
        Hash, InvokeHostFunctionResult, OperationResult, OperationResultTr, TransactionResult, TransactionResultExt,
        TransactionResultResult,
    };
    let (op, result): (
        InvokeHostFunctionResult,
        fn(stellar_xdr::VecM<OperationResult>) -> TransactionResultResult,
    ) = if success {
        (
            InvokeHostFunctionResult::Success(Hash([0xab; 32])),
            TransactionResultResult::TxSuccess,
        )
    } else {
        (InvokeHostFunctionResult::Trapped, TransactionResultResult::TxFailed)
    };
    let ops = vec![OperationResult::OpInner(OperationResultTr::InvokeHostFunction(op))];
    TransactionResult {
        fee_charged: 90_453,
        result: result(ops.try_into().unwrap_or_default()),
        ext: TransactionResultExt::V0,
    }
    .to_xdr_base64(Limits::none())
    .unwrap_or_default()
}

/// An ed25519 key pair for tests: the signing key's PKCS#8 PEM (for the
/// host's key store) and its public key.
///
/// # Errors
///
/// The key cannot be encoded (it always can).
pub fn keypair(seed: u8) -> Result<(String, [u8; 32]), ed25519_dalek::pkcs8::Error> {
    use ed25519_dalek::pkcs8::EncodePrivateKey as _;
    let signing = ed25519_dalek::SigningKey::from_bytes(&[seed; 32]);
    let pem = signing.to_pkcs8_pem(ed25519_dalek::pkcs8::spki::der::pem::LineEnding::LF)?;
    Ok((pem.to_string(), signing.verifying_key().to_bytes()))
}

/// The `G…` address of a public key.
pub fn address(public_key: [u8; 32]) -> String {
    AccountId(PublicKey::PublicKeyTypeEd25519(Uint256(public_key))).to_string()
}
