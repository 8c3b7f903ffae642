//! Transactions in XDR: the InvokeHostFunction (and RestoreFootprint)
//! transaction with time and ledger bounds, assembling a simulation into it
//! (stellar-cli's rules), its network hash, and reading result codes.

use stellar_xdr::{
    AccountId, DecoratedSignature, ExtensionPoint, FeeBumpTransaction, FeeBumpTransactionEnvelope,
    FeeBumpTransactionExt, FeeBumpTransactionInnerTx, HostFunction, InnerTransactionResultResult, InvokeContractArgs,
    InvokeHostFunctionOp, LedgerBounds, LedgerEntryData, LedgerKey, LedgerKeyAccount, Limits, Memo, MuxedAccount,
    Operation, OperationBody, OperationResult, OperationResultTr, Preconditions, PreconditionsV2, PublicKey, ReadXdr,
    RestoreFootprintOp, ScAddress, ScSymbol, ScVal, SequenceNumber, Signature, SignatureHint,
    SorobanAuthorizationEntry, SorobanTransactionData, TimeBounds, TimePoint, Transaction, TransactionEnvelope,
    TransactionExt, TransactionResult, TransactionResultResult, TransactionV1Envelope, Uint256, WriteXdr,
};

/// The network id: SHA-256 of the passphrase.
pub fn network_id(passphrase: &str) -> [u8; 32] {
    use sha2::Digest as _;
    sha2::Sha256::digest(passphrase.as_bytes()).into()
}

fn xdr_err(e: stellar_xdr::Error) -> String {
    format!("xdr: {e}")
}

/// The account behind an ed25519 public key.
pub fn account_id(public_key: [u8; 32]) -> AccountId {
    AccountId(PublicKey::PublicKeyTypeEd25519(Uint256(public_key)))
}

/// `LedgerKey::Account` for `getLedgerEntries`, base64.
pub fn account_key(public_key: [u8; 32]) -> Result<String, String> {
    LedgerKey::Account(LedgerKeyAccount {
        account_id: account_id(public_key),
    })
    .to_xdr_base64(Limits::none())
    .map_err(xdr_err)
}

/// The sequence number in a `LedgerEntryData::Account`, base64.
pub fn account_sequence(entry_xdr: &str) -> Result<i64, String> {
    match LedgerEntryData::from_xdr_base64(entry_xdr, Limits::none()).map_err(xdr_err)? {
        LedgerEntryData::Account(account) => Ok(account.seq_num.0),
        other => Err(format!("expected an account entry, got {}", other.name())),
    }
}

/// Where and when a transaction may land.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// The first ledger it may land in (the one after the tip it was built at).
    pub first_ledger: u32,
    /// Unix seconds after which it cannot land.
    pub max_time: u64,
    /// It may land only in ledgers below this one.
    pub max_ledger: u32,
}

/// An unsigned transaction from `source` with one operation.
pub fn transaction(
    public_key: [u8; 32],
    sequence: i64,
    fee: u32,
    bounds: Bounds,
    body: OperationBody,
) -> Result<Transaction, String> {
    Ok(Transaction {
        source_account: MuxedAccount::Ed25519(Uint256(public_key)),
        fee,
        seq_num: SequenceNumber(sequence),
        cond: Preconditions::V2(PreconditionsV2 {
            time_bounds: Some(TimeBounds {
                min_time: TimePoint(0),
                max_time: TimePoint(bounds.max_time),
            }),
            ledger_bounds: Some(LedgerBounds {
                min_ledger: 0,
                max_ledger: bounds.max_ledger,
            }),
            min_seq_num: None,
            min_seq_age: stellar_xdr::Duration(0),
            min_seq_ledger_gap: 0,
            extra_signers: Vec::new().try_into().map_err(xdr_err)?,
        }),
        memo: Memo::None,
        operations: vec![Operation {
            source_account: None,
            body,
        }]
        .try_into()
        .map_err(xdr_err)?,
        ext: TransactionExt::V0,
    })
}

/// `InvokeHostFunction(InvokeContract(contract.function(args)))`.
pub fn invoke(contract: &str, function: &str, args: Vec<ScVal>) -> Result<OperationBody, String> {
    let contract_address: ScAddress = contract
        .parse()
        .map_err(|_| format!("{contract:?} is not an address"))?;
    Ok(OperationBody::InvokeHostFunction(InvokeHostFunctionOp {
        host_function: HostFunction::InvokeContract(InvokeContractArgs {
            contract_address,
            function_name: ScSymbol::try_from(function).map_err(|_| format!("{function:?} is not a symbol"))?,
            args: args.try_into().map_err(xdr_err)?,
        }),
        auth: Vec::new().try_into().map_err(xdr_err)?,
    }))
}

/// `RestoreFootprint`, for a simulation's restore preamble.
pub fn restore() -> OperationBody {
    OperationBody::RestoreFootprint(RestoreFootprintOp {
        ext: ExtensionPoint::V0,
    })
}

/// Applies a simulation (stellar-cli `assembled.rs`): the transaction data,
/// the auth entries when the operation has none, and fee = inclusion fee +
/// minimum resource fee.
pub fn assemble(
    tx: &mut Transaction,
    transaction_data: &str,
    auth: &[String],
    inclusion_fee: u64,
    resource_fee: u64,
) -> Result<(), String> {
    let data = SorobanTransactionData::from_xdr_base64(transaction_data, Limits::none()).map_err(xdr_err)?;
    tx.ext = TransactionExt::V1(data);
    let mut ops: Vec<Operation> = tx.operations.to_vec();
    if let Some(Operation {
        body: OperationBody::InvokeHostFunction(op),
        ..
    }) = ops.first_mut()
    {
        if op.auth.is_empty() && !auth.is_empty() {
            let entries = auth
                .iter()
                .map(|a| SorobanAuthorizationEntry::from_xdr_base64(a, Limits::none()).map_err(xdr_err))
                .collect::<Result<Vec<_>, _>>()?;
            op.auth = entries.try_into().map_err(xdr_err)?;
        }
    }
    tx.operations = ops.try_into().map_err(xdr_err)?;
    // A fee that overflows u32 would need a fee-bump envelope; laneway caps
    // fees far below that, so it is refused rather than silently wrapped.
    tx.fee = u32::try_from(inclusion_fee.saturating_add(resource_fee))
        .map_err(|_| format!("fee {inclusion_fee} + {resource_fee} does not fit a transaction fee"))?;
    Ok(())
}

/// An unsigned envelope (for simulation), base64.
pub fn unsigned(tx: &Transaction) -> Result<String, String> {
    TransactionEnvelope::Tx(TransactionV1Envelope {
        tx: tx.clone(),
        signatures: Vec::new().try_into().map_err(xdr_err)?,
    })
    .to_xdr_base64(Limits::none())
    .map_err(xdr_err)
}

/// The transaction's hash on the network named by `passphrase`.
pub fn hash(tx: &Transaction, passphrase: &str) -> Result<[u8; 32], String> {
    tx.hash(network_id(passphrase)).map_err(xdr_err)
}

/// One signature whose hint is the last four bytes of the public key.
fn decorated(public_key: [u8; 32], signature: Vec<u8>) -> Result<DecoratedSignature, String> {
    Ok(DecoratedSignature {
        hint: SignatureHint([public_key[28], public_key[29], public_key[30], public_key[31]]),
        signature: Signature(signature.try_into().map_err(xdr_err)?),
    })
}

/// The signed envelope, base64.
pub fn signed(tx: Transaction, public_key: [u8; 32], signature: Vec<u8>) -> Result<String, String> {
    TransactionEnvelope::Tx(TransactionV1Envelope {
        tx,
        signatures: vec![decorated(public_key, signature)?].try_into().map_err(xdr_err)?,
    })
    .to_xdr_base64(Limits::none())
    .map_err(xdr_err)
}

/// A fee bump (CAP-15) around the signed envelope `inner` (base64): the
/// same transaction, same sequence and inner hash, with `fee_source`
/// paying `2 × inclusion_fee + resource fee` (the inner operation and the
/// bump each bid `inclusion_fee`; stellar-cli's rule).
pub fn fee_bump(inner: &str, fee_source: [u8; 32], inclusion_fee: u64) -> Result<FeeBumpTransaction, String> {
    let TransactionEnvelope::Tx(inner) =
        TransactionEnvelope::from_xdr_base64(inner, Limits::none()).map_err(xdr_err)?
    else {
        return Err("only a v1 transaction envelope can be fee-bumped".to_owned());
    };
    let resource_fee = match &inner.tx.ext {
        TransactionExt::V1(data) => u64::try_from(data.resource_fee).unwrap_or(0),
        TransactionExt::V0 => 0,
    };
    let fee = inclusion_fee
        .checked_mul(2)
        .and_then(|f| f.checked_add(resource_fee))
        .and_then(|f| i64::try_from(f).ok())
        .ok_or_else(|| format!("fee bump of {inclusion_fee} overflows"))?;
    Ok(FeeBumpTransaction {
        fee_source: MuxedAccount::Ed25519(Uint256(fee_source)),
        fee,
        inner_tx: FeeBumpTransactionInnerTx::Tx(inner),
        ext: FeeBumpTransactionExt::V0,
    })
}

/// A fee bump's own (outer) hash on the network named by `passphrase`.
pub fn fee_bump_hash(tx: &FeeBumpTransaction, passphrase: &str) -> Result<[u8; 32], String> {
    tx.hash(network_id(passphrase)).map_err(xdr_err)
}

/// The signed fee-bump envelope, base64.
pub fn signed_fee_bump(tx: FeeBumpTransaction, public_key: [u8; 32], signature: Vec<u8>) -> Result<String, String> {
    TransactionEnvelope::TxFeeBump(FeeBumpTransactionEnvelope {
        tx,
        signatures: vec![decorated(public_key, signature)?].try_into().map_err(xdr_err)?,
    })
    .to_xdr_base64(Limits::none())
    .map_err(xdr_err)
}

fn snake(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// The code of a `TransactionResult` (base64): the transaction's, or for
/// `tx_failed` its first failing operation's (`invoke_host_function_trapped`).
pub fn result_code(result_xdr: &str) -> String {
    let Ok(result) = TransactionResult::from_xdr_base64(result_xdr, Limits::none()) else {
        return "unreadable_result".to_owned();
    };
    match &result.result {
        // A fee bump's code is its inner transaction's.
        TransactionResultResult::TxFeeBumpInnerFailed(pair) | TransactionResultResult::TxFeeBumpInnerSuccess(pair) => {
            inner_result_code(&pair.result.result)
        }
        TransactionResultResult::TxFailed(ops) => failed_code(ops),
        other => snake(other.name()),
    }
}

/// The code of a `tx_failed`: Soroban transactions carry one operation, and
/// its result is the code.
fn failed_code(ops: &[OperationResult]) -> String {
    ops.first()
        .map(|op| match op {
            OperationResult::OpInner(OperationResultTr::InvokeHostFunction(r)) => {
                format!("invoke_host_function_{}", snake(r.name()))
            }
            OperationResult::OpInner(inner) => snake(inner.name()),
            other => snake(other.name()),
        })
        .unwrap_or_else(|| "tx_failed".to_owned())
}

/// The code of a fee bump's inner result (`tx_bad_seq`, or the failing
/// operation's for `tx_failed`).
fn inner_result_code(result: &InnerTransactionResultResult) -> String {
    match result {
        InnerTransactionResultResult::TxFailed(ops) => failed_code(ops),
        other => snake(other.name()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSPHRASE: &str = "Test SDF Network ; September 2015";

    fn signed_inner(resource_fee: i64) -> String {
        let key = [9u8; 32];
        let bounds = Bounds {
            first_ledger: 11,
            max_time: 1_000,
            max_ledger: 20,
        };
        let mut tx = transaction(key, 43, 0, bounds, restore()).expect("tx");
        let data = SorobanTransactionData {
            ext: stellar_xdr::SorobanTransactionDataExt::V0,
            resources: stellar_xdr::SorobanResources {
                footprint: stellar_xdr::LedgerFootprint {
                    read_only: Vec::new().try_into().expect("empty"),
                    read_write: Vec::new().try_into().expect("empty"),
                },
                instructions: 0,
                disk_read_bytes: 0,
                write_bytes: 0,
            },
            resource_fee,
        };
        let data = data.to_xdr_base64(Limits::none()).expect("xdr");
        assemble(&mut tx, &data, &[], 100, u64::try_from(resource_fee).expect("fee")).expect("assembled");
        signed(tx, key, vec![1; 64]).expect("signed")
    }

    #[test]
    fn a_fee_bump_pays_twice_the_bid_plus_the_resource_fee_around_the_same_transaction() {
        let inner = signed_inner(90_353);
        let bump = fee_bump(&inner, [9u8; 32], 1_000).expect("bump");
        assert_eq!(bump.fee, 2 * 1_000 + 90_353);
        let FeeBumpTransactionInnerTx::Tx(wrapped) = &bump.inner_tx;
        let TransactionEnvelope::Tx(original) =
            TransactionEnvelope::from_xdr_base64(&inner, Limits::none()).expect("xdr")
        else {
            panic!("v1");
        };
        assert_eq!(
            wrapped, &original,
            "the inner transaction and its signature are untouched"
        );
        let outer = fee_bump_hash(&bump, PASSPHRASE).expect("hash");
        assert_ne!(outer, hash(&original.tx, PASSPHRASE).expect("hash"));
        let envelope = signed_fee_bump(bump, [9u8; 32], vec![2; 64]).expect("signed");
        assert!(matches!(
            TransactionEnvelope::from_xdr_base64(&envelope, Limits::none()),
            Ok(TransactionEnvelope::TxFeeBump(_))
        ));
        assert!(
            fee_bump(&envelope, [9u8; 32], 1_000).is_err(),
            "a fee bump is not bumped again"
        );
    }

    #[test]
    fn a_refused_fee_bump_reports_its_inner_code() {
        // §A4: txFEE_BUMP_INNER_FAILED wrapping an inner txBAD_SEQ.
        let result = "AAAAAAAAAMj////zEREREREREREREREREREREREREREREREREREREREREREAAAAAAAAAAP////sAAAAAAAAAAA==";
        assert_eq!(result_code(result), "tx_bad_seq");
    }
}
