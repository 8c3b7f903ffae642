//! Soroban vault calls through Stellar RPC, for the kinds `deposit`,
//! `withdraw`, `rebalance` and `referral_payout` (each kind's config names
//! the contract, the function, how the arguments come from the payload, the
//! signer's host key id, the network and the RPC endpoint).
//!
//! One attempt: read the tip and the signer account's sequence, build the
//! InvokeHostFunction transaction with a time bound (≤ 300 s) and a ledger
//! bound (tip + window, so a lost transaction cannot land later), simulate,
//! assemble (transaction data, auth, and a fee that adds the resource fee
//! to the host's quoted inclusion fee), have the host sign the hash (the key never enters
//! this plugin), checkpoint hash + envelope, and only then send and poll
//! `getTransaction`. `reconcile` finds a checkpointed transaction after a
//! crash or timeout: landed → done; provably dead → build afresh; still
//! possible → send the same bytes again (a duplicate is harmless) and wait.

mod auth;
mod cadence;
mod check;
mod history;
mod receipt;
mod rpc;
mod settings;
mod tx;

use std::time::{Duration, Instant, SystemTime};

use history::{Found, History};
use laneway_sdk::signer::{self, Algorithm};
use laneway_sdk::{checkpoint, fees, log, Confirmation, Executor, Failure, Op, OpInput, Outcome, Reconciled, Retry};
use receipt::Receipt;
use rpc::{Lookup, Rpc, RpcError, Sent};
use settings::Settings;

struct Vault;

fn permanent(reason: impl Into<String>, detail: Option<&str>) -> Outcome {
    Outcome::Permanent(Failure {
        reason: reason.into(),
        detail: detail.map(str::to_owned),
    })
}

fn retry(reason: impl Into<String>, detail: Option<&str>, after: Option<Duration>, fee_bump: bool) -> Outcome {
    Outcome::Retryable(Retry {
        reason: reason.into(),
        retry_after_ms: after.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        detail: detail.map(str::to_owned),
        fee_bump,
    })
}

fn rpc_outcome(e: RpcError) -> Outcome {
    match e {
        // A missing grant is the host's call; say so plainly.
        RpcError::Denied(why) => permanent(format!("stellar rpc denied by the host: {why}"), Some("denied")),
        RpcError::Unavailable { what, retry_after } => retry(what, Some("rpc_unavailable"), retry_after, false),
        RpcError::Protocol(what) => retry(what, Some("rpc_protocol"), None, false),
    }
}

/// The signer's ed25519 public key, from the host.
fn signer_key(settings: &Settings) -> Result<[u8; 32], String> {
    let key =
        signer::public_key(&settings.signer_key).map_err(|e| format!("signer key {:?}: {e:?}", settings.signer_key))?;
    key.try_into()
        .map_err(|_| format!("signer key {:?} is not an ed25519 key", settings.signer_key))
}

fn public_key(settings: &Settings) -> Result<[u8; 32], Outcome> {
    signer_key(settings).map_err(|e| permanent(e, Some("signer")))
}

/// The account a transaction comes from, and the host key that signs it:
/// the kind's signer, or the channel account the op was dealt from its
/// pool (then the signer only authorises the contract call).
struct Source {
    key_id: String,
    public: [u8; 32],
}

impl Source {
    fn signer(settings: &Settings) -> Result<Self, Outcome> {
        Ok(Self {
            key_id: settings.signer_key.clone(),
            public: public_key(settings)?,
        })
    }

    fn key(key_id: &str) -> Result<Self, Outcome> {
        let public = signer::public_key(key_id)
            .ok()
            .and_then(|k| <[u8; 32]>::try_from(k).ok())
            .ok_or_else(|| {
                permanent(
                    format!("channel key {key_id:?} is not an ed25519 key the host grants"),
                    Some("signer"),
                )
            })?;
        Ok(Self {
            key_id: key_id.to_owned(),
            public,
        })
    }

    /// A new transaction's source: the op's channel when its one lane is a
    /// channel of the kind's pool; the signer when its lane is the signer's
    /// (an op enqueued before the kind had a pool). A lane that is neither
    /// (a channel since removed from the pool) waits for the config: using
    /// the signer would step outside the lane that keeps its sequence.
    fn for_op(settings: &Settings, lanes: &[String]) -> Result<Self, Outcome> {
        let signer = Self::signer(settings)?;
        let Some(pool) = &settings.pool else {
            return Ok(signer);
        };
        if let [lane] = lanes {
            if let Some(key_id) = pool.channels.get(lane) {
                let channel = Self::key(key_id)?;
                if tx::account_id(channel.public).to_string() != *lane {
                    return Err(permanent(
                        format!("channel key {key_id:?} is not account {lane}"),
                        Some("signer"),
                    ));
                }
                return Ok(channel);
            }
        }
        let own = tx::account_id(signer.public).to_string();
        if lanes.contains(&own) {
            return Ok(signer);
        }
        Err(retry(
            format!(
                "the op's lane {} is no channel of pool {:?}; put the channel back in the pool (retire it rather than \
                 remove it while it has ops)",
                lanes.join(", "),
                pool.name
            ),
            Some("channel"),
            Some(Duration::from_secs(60)),
            false,
        ))
    }

    /// The source a receipt's transaction was built from.
    fn of_receipt(settings: &Settings, receipt: &Receipt) -> Result<Self, Outcome> {
        match &receipt.source_key {
            Some(key_id) => Self::key(key_id),
            None => Self::signer(settings),
        }
    }

    fn is_signer(&self, settings: &Settings) -> bool {
        self.key_id == settings.signer_key
    }

    /// Who pays a transaction from this source, when not the source itself:
    /// the signer, for a channel of a pool whose `fee_payer` is the signer.
    fn fee_payer(&self, settings: &Settings) -> Result<Option<Self>, Outcome> {
        match &settings.pool {
            Some(pool) if pool.fee_payer == settings::FeePayer::Signer && !self.is_signer(settings) => {
                Self::signer(settings).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Who signs a fee bump of a receipt's transaction: its payer.
    fn payer_of_receipt(settings: &Settings, receipt: &Receipt) -> Result<Self, Outcome> {
        match &receipt.fee_key {
            Some(key_id) if *key_id == settings.signer_key => Self::signer(settings),
            Some(key_id) => Self::key(key_id),
            None => Self::of_receipt(settings, receipt),
        }
    }
}

/// A transaction that was applied and failed: final.
fn failed_on_chain(code: &str) -> Outcome {
    permanent(format!("transaction failed on chain: {code}"), Some(code))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn unix_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// How a sent transaction ended, as far as one wait could tell.
enum Fate {
    /// Applied successfully, under `hash` (the transaction's or a fee bump's).
    Landed {
        ledger: u64,
        hash: String,
    },
    Failed {
        code: String,
    },
    /// Past its bounds and not in the ledger: it can never land.
    Expired,
    /// The network refused it (`ERROR`): it can never land.
    Rejected {
        code: String,
    },
    /// `TRY_AGAIN_LATER`: not accepted now.
    Busy,
    /// Still valid but not included after `bump_after_ledgers` ledgers, in a
    /// kind a fee oracle prices: worth a fee bump at the next bid.
    Stuck,
    /// The RPC could not be asked.
    Unreachable(RpcError),
}

/// Sends the receipt's envelope and waits for its fate.
fn send_and_wait(rpc: &mut Rpc, receipt: &Receipt, settings: &Settings) -> Fate {
    match rpc.send(receipt.latest_envelope()) {
        Ok(Sent::Queued) => wait(rpc, receipt, settings),
        Ok(Sent::TryAgainLater) => Fate::Busy,
        Ok(Sent::Error(result)) => Fate::Rejected {
            code: result.as_deref().map_or_else(|| "error".to_owned(), tx::result_code),
        },
        Err(e) => Fate::Unreachable(e),
    }
}

/// `getTransaction` for every hash the receipt may have landed under (its
/// fee bumps and itself): the first that applied, or NOT_FOUND and the
/// earliest tip answered. A NOT_FOUND proves its hash absent only up to the
/// tip it came with, and a ledger may close between two calls: judged by
/// the last call's tip, a bump that landed in that ledger, looked up before
/// it, passed for absent past the transaction's bounds (found by the fault
/// harness: a landed payment dead-lettered as outcome unknown).
fn lookup(rpc: &mut Rpc, receipt: &Receipt) -> Result<(Lookup, rpc::Tip, String), RpcError> {
    let mut earliest: Option<rpc::Tip> = None;
    for hash in receipt.hashes() {
        let (found, tip) = rpc.transaction(hash)?;
        if found != Lookup::NotFound {
            return Ok((found, tip, hash.to_owned()));
        }
        earliest = Some(match earliest {
            Some(seen) if seen.ledger <= tip.ledger => seen,
            _ => tip,
        });
    }
    let tip = earliest.ok_or_else(|| RpcError::Protocol("a receipt without a hash".to_owned()))?;
    Ok((Lookup::NotFound, tip, receipt.hash.clone()))
}

/// Polls `getTransaction` until the transaction lands, fails, provably
/// cannot land any more, or (when its kind is priced) has waited
/// `bump_after_ledgers` ledgers unincluded.
fn wait(rpc: &mut Rpc, receipt: &Receipt, settings: &Settings) -> Fate {
    let give_up = Instant::now() + Duration::from_secs(settings.valid_seconds + 30);
    // Only a priced kind has a higher bid to bump to; a restore is not bumped.
    let bumpable = !receipt.restore && fees::current().is_some();
    let mut unincluded = cadence::Unincluded::new(if bumpable { settings.bump_after_ledgers } else { 0 });
    loop {
        let pause = match lookup(rpc, receipt) {
            Ok((Lookup::Success { ledger }, _, hash)) => return Fate::Landed { ledger, hash },
            Ok((Lookup::Failed { code }, _, _)) => return Fate::Failed { code },
            Ok((Lookup::NotFound, tip, _)) if receipt.expired_at(tip.ledger, tip.close_time) => return Fate::Expired,
            Ok((Lookup::NotFound, tip, _)) if unincluded.due(tip.ledger) => return Fate::Stuck,
            Ok((Lookup::NotFound, tip, _)) => cadence::next_poll(&tip, unix_now_ms(), settings.poll_ms),
            Err(RpcError::Denied(why)) => return Fate::Unreachable(RpcError::Denied(why)),
            Err(e) if Instant::now() >= give_up => return Fate::Unreachable(e),
            Err(_) => Duration::from_millis(settings.poll_ms),
        };
        if Instant::now() >= give_up {
            return Fate::Unreachable(RpcError::Unavailable {
                what: "transaction still pending".to_owned(),
                retry_after: None,
            });
        }
        std::thread::sleep(pause);
    }
}

/// Confirmed under the transaction's (inner) hash, whatever envelope landed.
fn landed(receipt: &Receipt, ledger: u64, hash: &str) -> Outcome {
    let paid_by = receipt
        .fee_key
        .as_ref()
        .filter(|_| receipt.bumps.first().is_some_and(|b| b.hash == hash));
    let detail = if hash == receipt.hash {
        format!("SUCCESS in ledger {ledger}")
    } else if let Some(payer) = paid_by {
        format!("SUCCESS in ledger {ledger} (fee paid by {payer} as {hash})")
    } else {
        format!("SUCCESS in ledger {ledger} (fee-bumped as {hash})")
    };
    Outcome::Confirmed(Confirmation {
        receipt: Some(receipt.hash.clone()),
        detail: Some(detail),
    })
}

/// Classifies a rejection (`ERROR` from `sendTransaction`).
fn rejected(code: &str) -> Outcome {
    match code {
        "tx_bad_seq" => retry(
            "tx_bad_seq: the sequence is read afresh next attempt",
            Some(code),
            None,
            false,
        ),
        "tx_insufficient_fee" => retry(
            "tx_insufficient_fee: retrying with a bumped fee",
            Some(code),
            None,
            true,
        ),
        "tx_too_late" | "tx_too_early" => retry(format!("{code}: rebuilding with new bounds"), Some(code), None, false),
        "error" => retry(
            "sendTransaction returned ERROR without a result",
            Some(code),
            None,
            false,
        ),
        _ => permanent(format!("transaction rejected: {code}"), Some(code)),
    }
}

/// Marks a checkpointed receipt as rejected, so a reconcile rebuilds at once.
fn mark_rejected(receipt: &Receipt) {
    let mut rejected = receipt.clone();
    rejected.rejected = true;
    resave(
        &rejected,
        "could not mark the receipt rejected; the next attempt will look it up",
    );
}

/// Saves what the attempt learnt about an already-checkpointed receipt.
/// Not saving it only costs the next attempt a lookup or a refused send,
/// so a failure is logged, not returned.
fn resave(receipt: &Receipt, failed: &str) {
    if let Err(e) = checkpoint::save(&receipt.to_json()) {
        log::log(log::Level::Warn, failed, &[("error".to_owned(), format!("{e:?}"))]);
    }
}

/// What one wait means for `execute`.
fn execute_outcome(fate: Fate, receipt: &Receipt, settings: &Settings) -> Outcome {
    match fate {
        Fate::Landed { ledger, hash } => landed(receipt, ledger, &hash),
        Fate::Failed { code } => failed_on_chain(&code),
        Fate::Stuck => {
            // Only a transaction seen stuck is bumped by the next attempt.
            let mut stuck = receipt.clone();
            stuck.stuck = true;
            resave(
                &stuck,
                "could not mark the transaction stuck; the next attempt resends it unbumped",
            );
            retry(
                format!(
                    "not included after {} ledgers; fee-bumping at the next bid",
                    settings.bump_after_ledgers
                ),
                Some("stuck"),
                Some(Duration::ZERO),
                true,
            )
        }
        Fate::Expired => retry(
            "not included before its ledger bound; resubmitting with a bumped fee",
            Some("expired"),
            None,
            true,
        ),
        Fate::Rejected { code } => {
            mark_rejected(receipt);
            rejected(&code)
        }
        Fate::Busy => retry(
            "TRY_AGAIN_LATER",
            Some("TRY_AGAIN_LATER"),
            Some(Duration::from_millis(settings.try_again_ms)),
            false,
        ),
        Fate::Unreachable(e) => rpc_outcome(e),
    }
}

/// The account's next sequence number, read fresh for every transaction,
/// and the bounds of a transaction built now.
fn next_sequence(rpc: &mut Rpc, settings: &Settings, source: &Source) -> Result<(i64, tx::Bounds), Outcome> {
    let tip = rpc.latest_ledger().map_err(rpc_outcome)?;
    let account_key = tx::account_key(source.public).map_err(|e| permanent(e, Some("xdr")))?;
    let entries = rpc.ledger_entries(&[account_key]).map_err(rpc_outcome)?;
    let Some(entry) = entries.first() else {
        let account = tx::account_id(source.public);
        // A channel not funded yet (or merged by `retire` under a config
        // the host had not reloaded) is the operator's to fix: its ops
        // wait rather than dead-letter a backlog.
        if !source.is_signer(settings) {
            return Err(retry(
                format!(
                    "channel account {account} does not exist on this network: fund it (`laneway stellar channels \
                     fund`), or cancel the ops dealt to it"
                ),
                Some("tx_no_account"),
                Some(Duration::from_secs(60)),
                false,
            ));
        }
        return Err(permanent(
            format!("the source account {account} does not exist on this network"),
            Some("tx_no_account"),
        ));
    };
    let sequence = tx::account_sequence(entry).map_err(|e| retry(e, Some("rpc_protocol"), None, false))?;
    let bounds = tx::Bounds {
        first_ledger: tip.ledger.saturating_add(1),
        max_time: unix_now() + settings.valid_seconds,
        max_ledger: tip.ledger.saturating_add(settings.ledger_window),
    };
    Ok((sequence + 1, bounds))
}

/// Builds, simulates, assembles, signs and checkpoints a transaction for
/// `body`; returns its receipt, or the outcome that ends the attempt.
fn prepare(
    rpc: &mut Rpc,
    settings: &Settings,
    source: &Source,
    inclusion_fee: u64,
    body: stellar_xdr::OperationBody,
) -> Result<Prepared, Outcome> {
    let (sequence, bounds) = next_sequence(rpc, settings, source)?;
    let fee = u32::try_from(inclusion_fee).map_err(|_| permanent("inclusion fee out of range", Some("fee")))?;
    let call = match &body {
        stellar_xdr::OperationBody::InvokeHostFunction(stellar_xdr::InvokeHostFunctionOp {
            host_function: stellar_xdr::HostFunction::InvokeContract(call),
            ..
        }) => call.clone(),
        _ => return Err(permanent("only a contract call is prepared here", Some("xdr"))),
    };
    let mut transaction =
        tx::transaction(source.public, sequence, fee, bounds, body).map_err(|e| permanent(e, Some("xdr")))?;
    let draft = tx::unsigned(&transaction).map_err(|e| permanent(e, Some("xdr")))?;
    let simulation = rpc.simulate(&draft).map_err(rpc_outcome)?;
    if let Some(error) = simulation.error {
        return Err(permanent(format!("simulation failed: {error}"), Some("simulation")));
    }
    if let Some((data, resource_fee)) = simulation.restore {
        return Ok(Prepared::Restore { data, resource_fee });
    }
    let data = simulation.transaction_data.ok_or_else(|| {
        retry(
            "simulation returned no transactionData",
            Some("rpc_protocol"),
            None,
            false,
        )
    })?;
    let auth = authorize(settings, source, &call, &simulation.auth, bounds.max_ledger)?;
    tx::assemble(
        &mut transaction,
        &data,
        &auth,
        inclusion_fee,
        simulation.min_resource_fee,
    )
    .map_err(|e| permanent(e, Some("assemble")))?;
    seal(settings, source, transaction, (bounds, inclusion_fee), false).map(Prepared::Ready)
}

/// The simulation's authorisation entries, checked (the op's own call,
/// nothing else) and, for the signer's address entries, signed by the host
/// until the transaction's ledger bound.
fn authorize(
    settings: &Settings,
    source: &Source,
    call: &stellar_xdr::InvokeContractArgs,
    entries: &[String],
    until_ledger: u32,
) -> Result<Vec<String>, Outcome> {
    let contracts: Vec<stellar_xdr::ScAddress> =
        settings.auth_contracts.iter().filter_map(|c| c.parse().ok()).collect();
    let request = auth::Request {
        call,
        contracts: &contracts,
        signer: public_key(settings)?,
        signer_is_source: source.is_signer(settings),
        until_ledger,
        network_id: tx::network_id(&settings.network_passphrase),
    };
    auth::authorize(entries, &request, |payload| {
        signer::sign(&settings.signer_key, Algorithm::Ed25519, payload).map_err(|e| format!("signing failed: {e:?}"))
    })
    .map_err(|e| permanent(format!("authorisation refused: {e}"), Some("auth")))
}

enum Prepared {
    Ready(Receipt),
    /// Archived entries must be restored first.
    Restore {
        data: String,
        resource_fee: u64,
    },
}

/// Signs through the host and checkpoints the receipt before anything is sent.
fn seal(
    settings: &Settings,
    source: &Source,
    transaction: stellar_xdr::Transaction,
    (bounds, inclusion_fee): (tx::Bounds, u64),
    restore: bool,
) -> Result<Receipt, Outcome> {
    let sequence = transaction.seq_num.0;
    let hash = tx::hash(&transaction, &settings.network_passphrase).map_err(|e| permanent(e, Some("xdr")))?;
    let signature = signer::sign(&source.key_id, Algorithm::Ed25519, &hash)
        .map_err(|e| permanent(format!("signing failed: {e:?}"), Some("signer")))?;
    let envelope = tx::signed(transaction, source.public, signature).map_err(|e| permanent(e, Some("xdr")))?;
    let payer = source.fee_payer(settings)?;
    let mut receipt = Receipt {
        hash: hex::encode(hash),
        envelope,
        max_ledger: bounds.max_ledger,
        max_time: bounds.max_time,
        rejected: false,
        stuck: false,
        restore,
        sequence,
        inclusion_fee: Some(inclusion_fee),
        first_ledger: Some(bounds.first_ledger),
        bumps: Vec::new(),
        source_key: (!source.is_signer(settings)).then(|| source.key_id.clone()),
        fee_key: payer.as_ref().map(|p| p.key_id.clone()),
    };
    // Paid by another account: every envelope sent is a fee bump it signs,
    // the first at the transaction's own bid.
    if let Some(payer) = payer {
        let paid = fee_bump(settings, &receipt, &payer, inclusion_fee)?;
        receipt.bumps.push(paid);
    }
    checkpointed(receipt, inclusion_fee)
}

/// Checkpoints the receipt before its newest envelope is sent; the attempt
/// pays `inclusion_fee` from then on.
fn checkpointed(receipt: Receipt, inclusion_fee: u64) -> Result<Receipt, Outcome> {
    match checkpoint::save(&receipt.to_json()) {
        Ok(()) => {
            fees::spent(inclusion_fee);
            Ok(receipt)
        }
        Err(checkpoint::Error::LeaseLost) => Err(retry(
            "lease lost before sending; not sent",
            Some("lease_lost"),
            None,
            false,
        )),
        Err(checkpoint::Error::Failed(e)) => Err(retry(
            format!("checkpoint failed; not sent: {e}"),
            Some("checkpoint"),
            None,
            false,
        )),
    }
}

/// Submits a RestoreFootprint transaction for a simulation's preamble.
fn restore(
    rpc: &mut Rpc,
    settings: &Settings,
    source: &Source,
    inclusion_fee: u64,
    (data, resource_fee): (&str, u64),
) -> Result<Outcome, Outcome> {
    let (sequence, bounds) = next_sequence(rpc, settings, source)?;
    let mut transaction =
        tx::transaction(source.public, sequence, 0, bounds, tx::restore()).map_err(|e| permanent(e, Some("xdr")))?;
    tx::assemble(&mut transaction, data, &[], inclusion_fee, resource_fee)
        .map_err(|e| permanent(e, Some("assemble")))?;
    let receipt = seal(settings, source, transaction, (bounds, inclusion_fee), true)?;
    Ok(match send_and_wait(rpc, &receipt, settings) {
        // The call itself still has to be made: go again at once.
        Fate::Landed { .. } => retry(
            "restored archived entries; invoking next",
            Some("restored"),
            Some(Duration::ZERO),
            false,
        ),
        other => execute_outcome(other, &receipt, settings),
    })
}

/// A transaction past its bounds that the server does not know. The
/// signer's sequence decides: still below the transaction's, it was never
/// applied and the op is built afresh. Used, and one signer has one
/// transaction in flight, so the one that used it may be this one: if the
/// server remembers every ledger it could have landed in, it contradicts
/// itself (a lagging or faulty RPC; the fault harness's fake once did); if
/// not (older than the RPC's retention), it may have landed long ago.
/// Either way the history source decides (`used_sequence`).
fn dead_or_unknown(rpc: &mut Rpc, receipt: &Receipt, settings: &Settings, oldest: Option<u32>) -> Reconciled {
    let source = match Source::of_receipt(settings, receipt) {
        Ok(s) => s,
        Err(o) => return Reconciled::Settled(o),
    };
    let account_key = match tx::account_key(source.public) {
        Ok(k) => k,
        Err(e) => return Reconciled::Settled(permanent(e, Some("xdr"))),
    };
    let current = match rpc.ledger_entries(&[account_key]) {
        Ok(entries) => entries.first().map(|e| tx::account_sequence(e)),
        Err(e) => return Reconciled::Settled(rpc_outcome(e)),
    };
    match current {
        Some(Ok(sequence)) if sequence < receipt.sequence => Reconciled::Redeliver,
        Some(Ok(_)) => used_sequence(receipt, settings, receipt.within_retention(oldest)),
        Some(Err(e)) => Reconciled::Settled(retry(e, Some("rpc_protocol"), None, false)),
        None => Reconciled::Settled(permanent("the source account does not exist", Some("tx_no_account"))),
    }
}

/// The RPC does not know a transaction past its bounds whose sequence was
/// used. The kind's history source, when it has one, is asked: found, the
/// op settles as the chain settled it; missing, and the source has ingested
/// every ledger the transaction could have landed in, it never landed and
/// the op is built afresh. Otherwise, rather than risk paying twice, the op
/// is dead-lettered as outcome unknown for an operator to check the hash.
/// A source that cannot be reached now is asked again on the next attempt.
fn used_sequence(receipt: &Receipt, settings: &Settings, within_retention: bool) -> Reconciled {
    let rpc_says = if within_retention {
        format!(
            "outcome unknown: the RPC does not know transaction {}, yet remembers every ledger it could have \
             landed in and the signer's sequence {} was used",
            receipt.hash, receipt.sequence
        )
    } else {
        format!(
            "outcome unknown: transaction {} is older than the RPC's retention and its sequence was used",
            receipt.hash
        )
    };
    let unknown = |why: String| Reconciled::Settled(permanent(why, Some("outcome_unknown")));
    let Some(url) = settings.history_url.as_deref() else {
        return unknown(format!(
            "{rpc_says}; check it on a history server (or set the kind's history_url) before retrying"
        ));
    };
    let source = History::new(url);
    match source.transaction(&receipt.hash) {
        Ok(Found::Applied {
            ledger,
            failed_code: None,
        }) => Reconciled::Settled(Outcome::Confirmed(Confirmation {
            receipt: Some(receipt.hash.clone()),
            detail: Some(format!("SUCCESS in ledger {ledger} (from the history source)")),
        })),
        Ok(Found::Applied {
            failed_code: Some(code),
            ..
        }) => Reconciled::Settled(failed_on_chain(&code)),
        Ok(Found::Missing) => {
            let Some((first, last)) = receipt.landing_ledgers() else {
                return unknown(format!(
                    "{rpc_says}; the history source does not have it, and this receipt does not record the \
                     first ledger it could have landed in"
                ));
            };
            match source.coverage() {
                Ok(coverage) if coverage.covers(first, last) => Reconciled::Redeliver,
                Ok(coverage) => unknown(format!(
                    "{rpc_says}; the history source does not have it, but has ingested only ledgers {}..={} of \
                     {first}..={last}",
                    coverage.elder, coverage.latest
                )),
                Err(e) => Reconciled::Settled(rpc_outcome(e)),
            }
        }
        Err(e) => Reconciled::Settled(rpc_outcome(e)),
    }
}

/// A checkpointed RestoreFootprint: once it has landed, failed or expired,
/// the op's own call is still to be made, so it is delivered afresh.
fn reconcile_restore(rpc: &mut Rpc, receipt: &Receipt, settings: &Settings) -> Reconciled {
    match rpc.transaction(&receipt.hash) {
        Ok((Lookup::NotFound, tip)) if !receipt.expired_at(tip.ledger, tip.close_time) => {
            match send_and_wait(rpc, receipt, settings) {
                Fate::Busy | Fate::Unreachable(_) => {
                    Reconciled::Settled(retry("restore still pending", Some("restore"), None, false))
                }
                _ => Reconciled::Redeliver,
            }
        }
        Ok(_) => Reconciled::Redeliver,
        Err(e) => Reconciled::Settled(rpc_outcome(e)),
    }
}

impl Executor for Vault {
    fn describe() -> laneway_sdk::Description {
        laneway_sdk::describe(
            "stellar-vault",
            env!("CARGO_PKG_VERSION"),
            &["deposit", "withdraw", "rebalance", "referral_payout"],
        )
    }

    /// The signer's account: one sequence number, so one transaction at a
    /// time. A payload the kind's argument mapping cannot read is refused
    /// here, at enqueue, rather than dead-lettered when it runs.
    fn lanes(input: OpInput) -> Result<Vec<String>, String> {
        let settings = Settings::parse(&input.config)?;
        let payload: serde_json::Value =
            serde_json::from_str(&input.payload).map_err(|e| format!("payload is not JSON: {e}"))?;
        settings.arguments(&payload).map_err(|e| format!("payload: {e}"))?;
        Ok(vec![tx::account_id(signer_key(&settings)?).to_string()])
    }

    fn validate_config(_kind: String, config: String) -> Result<(), Vec<laneway_sdk::Problem>> {
        check::validate(&config)
    }

    fn execute(op: Op) -> Outcome {
        let settings = match Settings::parse(&op.config) {
            Ok(s) => s,
            Err(e) => return permanent(e, Some("config")),
        };
        let payload: serde_json::Value = match serde_json::from_str(&op.payload) {
            Ok(p) => p,
            Err(e) => return permanent(format!("payload is not JSON: {e}"), Some("payload")),
        };
        let args = match settings.arguments(&payload) {
            Ok(a) => a,
            Err(e) => return permanent(format!("payload: {e}"), Some("payload")),
        };
        let source = match Source::for_op(&settings, &op.lanes) {
            Ok(s) => s,
            Err(o) => return o,
        };
        let inclusion_fee = fees::current().map_or(settings.default_base_fee, |bid| bid.base_fee);
        let body = match tx::invoke(&settings.contract_id, &settings.function, args) {
            Ok(b) => b,
            Err(e) => return permanent(e, Some("xdr")),
        };
        let mut rpc = Rpc::new(&settings.rpc_url);
        match prepare(&mut rpc, &settings, &source, inclusion_fee, body) {
            Err(outcome) => outcome,
            Ok(Prepared::Restore { data, resource_fee }) => {
                restore(&mut rpc, &settings, &source, inclusion_fee, (&data, resource_fee)).unwrap_or_else(|o| o)
            }
            Ok(Prepared::Ready(receipt)) => {
                let fate = send_and_wait(&mut rpc, &receipt, &settings);
                execute_outcome(fate, &receipt, &settings)
            }
        }
    }

    fn reconcile(op: Op, receipt: String) -> Reconciled {
        let settings = match Settings::parse(&op.config) {
            Ok(s) => s,
            Err(e) => return Reconciled::Settled(permanent(e, Some("config"))),
        };
        let receipt = match Receipt::parse(&receipt) {
            Ok(r) => r,
            // Not a receipt this plugin wrote: nothing proves it did not land.
            Err(e) => return Reconciled::Settled(permanent(e, Some("receipt"))),
        };
        if receipt.rejected {
            return Reconciled::Redeliver;
        }
        // Whatever settles now settles this envelope, at the fee it carries.
        if let Some(fee) = receipt.paying() {
            fees::spent(fee);
        }
        let mut rpc = Rpc::new(&settings.rpc_url);
        if receipt.restore {
            return reconcile_restore(&mut rpc, &receipt, &settings);
        }
        let (found, tip, hash) = match lookup(&mut rpc, &receipt) {
            Ok(found) => found,
            Err(e) => return Reconciled::Settled(rpc_outcome(e)),
        };
        match found {
            Lookup::Success { ledger } => return Reconciled::Settled(landed(&receipt, ledger, &hash)),
            Lookup::Failed { code } => return Reconciled::Settled(failed_on_chain(&code)),
            Lookup::NotFound if receipt.expired_at(tip.ledger, tip.close_time) => {
                return dead_or_unknown(&mut rpc, &receipt, &settings, tip.oldest)
            }
            Lookup::NotFound => {}
        }
        // It may still land. Stuck (not included while valid), priced so
        // that a fee bump replaces the queued envelope (tenfold its bid) and
        // with time left for the bump to land, it is fee-bumped; either way the newest envelope is sent (again:
        // a queued copy makes this a DUPLICATE) and its fate awaited. A bump
        // under tenfold would only be refused, and one past the bounds too.
        let worth_bumping = |bid: u64| {
            receipt.stuck
                && receipt.bid().is_some_and(|b| bid > b)
                && receipt.queued_bid().is_some_and(|queued| {
                    cadence::bump_can_land(bid, queued, &tip, receipt.max_ledger, receipt.max_time, unix_now_ms())
                })
        };
        let receipt = match fees::current() {
            Some(bid) if settings.bump_after_ledgers > 0 && worth_bumping(bid.base_fee) => {
                match bump(&settings, receipt, bid.base_fee) {
                    Ok(bumped) => bumped,
                    Err(outcome) => return Reconciled::Settled(outcome),
                }
            }
            _ => receipt,
        };
        match send_and_wait(&mut rpc, &receipt, &settings) {
            Fate::Landed { ledger, hash } => Reconciled::Settled(landed(&receipt, ledger, &hash)),
            Fate::Failed { code } => Reconciled::Settled(failed_on_chain(&code)),
            Fate::Expired => dead_or_unknown(&mut rpc, &receipt, &settings, None),
            // A bad sequence on a resubmission (or under a fee bump) means
            // the sequence was used, perhaps by this very transaction: look
            // the hashes up. Not found (an RPC that has not indexed it yet,
            // or another transaction of the account), it is never rebuilt
            // while it may have landed: the receipt stays open until its
            // bounds pass, and then the used sequence decides
            // (`dead_or_unknown`).
            Fate::Rejected { code } if code == "tx_bad_seq" => match lookup(&mut rpc, &receipt) {
                Ok((Lookup::Success { ledger }, _, hash)) => Reconciled::Settled(landed(&receipt, ledger, &hash)),
                Ok((Lookup::Failed { code }, _, _)) => Reconciled::Settled(failed_on_chain(&code)),
                Ok((Lookup::NotFound, _, _)) => Reconciled::Settled(retry(
                    "tx_bad_seq on a resend: the sequence was used; the transaction is looked up again once its \
                     bounds pass",
                    Some("tx_bad_seq"),
                    None,
                    false,
                )),
                Err(e) => Reconciled::Settled(rpc_outcome(e)),
            },
            // A refused fee bump says nothing of the transaction it wraps,
            // which may still be queued and land: the receipt stays open.
            // Too low (replace-by-fee asks 10x the queued bid), the next
            // attempt bids higher.
            Fate::Rejected { code } if !receipt.bumps.is_empty() => {
                refuse_newest_bump(receipt);
                Reconciled::Settled(retry(
                    format!("fee bump refused: {code}; the transaction it wraps may still land"),
                    Some(&code),
                    None,
                    code == "tx_insufficient_fee",
                ))
            }
            Fate::Rejected { .. } => {
                mark_rejected(&receipt);
                Reconciled::Redeliver
            }
            other => Reconciled::Settled(execute_outcome(other, &receipt, &settings)),
        }
    }
}

/// Marks the newest fee bump refused, so it is not sent again (if this
/// cannot be saved, the next attempt sends it once more and is refused
/// again: harmless).
fn refuse_newest_bump(mut receipt: Receipt) {
    if let Some(bump) = receipt.bumps.last_mut() {
        bump.refused = true;
    }
    resave(&receipt, "could not mark the fee bump refused");
}

/// Wraps the receipt's transaction in a fee bump bidding `inclusion_fee`,
/// signed by whoever pays (its payer, else its source: the signer or the
/// channel), and checkpoints it before it is sent.
fn bump(settings: &Settings, mut receipt: Receipt, inclusion_fee: u64) -> Result<Receipt, Outcome> {
    let payer = Source::payer_of_receipt(settings, &receipt)?;
    let bump = fee_bump(settings, &receipt, &payer, inclusion_fee)?;
    receipt.bumps.push(bump);
    // The bump waits its own ledgers before it counts as stuck.
    receipt.stuck = false;
    checkpointed(receipt, inclusion_fee)
}

/// A fee bump of the receipt's transaction, paid and signed by `payer`.
fn fee_bump(
    settings: &Settings,
    receipt: &Receipt,
    payer: &Source,
    inclusion_fee: u64,
) -> Result<receipt::Bump, Outcome> {
    let bump = tx::fee_bump(&receipt.envelope, payer.public, inclusion_fee).map_err(|e| permanent(e, Some("xdr")))?;
    let hash = tx::fee_bump_hash(&bump, &settings.network_passphrase).map_err(|e| permanent(e, Some("xdr")))?;
    let signature = signer::sign(&payer.key_id, Algorithm::Ed25519, &hash)
        .map_err(|e| permanent(format!("signing failed: {e:?}"), Some("signer")))?;
    let envelope = tx::signed_fee_bump(bump, payer.public, signature).map_err(|e| permanent(e, Some("xdr")))?;
    Ok(receipt::Bump {
        hash: hex::encode(hash),
        envelope,
        inclusion_fee,
        refused: false,
    })
}

laneway_sdk::executor!(Vault);
