//! Transactions in XDR: the InvokeHostFunction (and RestoreFootprint)
//! transaction with time and ledger bounds, assembling a simulation into it
//! (stellar-cli's rules), its network hash, and reading result codes.

use stellar_xdr::{
    AccountId, DecoratedSignature, ExtensionPoint, HostFunction, InvokeContractArgs, InvokeHostFunctionOp,
    LedgerBounds, LedgerEntryData, LedgerKey, LedgerKeyAccount, Limits, Memo, MuxedAccount, Operation, OperationBody,
    OperationResult, OperationResultTr, Preconditions, PreconditionsV2, PublicKey, ReadXdr, RestoreFootprintOp,
    ScAddress, ScSymbol, ScVal, SequenceNumber, Signature, SignatureHint, SorobanAuthorizationEntry,
    SorobanTransactionData, TimeBounds, TimePoint, Transaction, TransactionEnvelope, TransactionExt, TransactionResult,
    TransactionResultResult, TransactionV1Envelope, Uint256, WriteXdr,
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

/// The signed envelope, base64: one signature whose hint is the last four
/// bytes of the public key.
pub fn signed(tx: Transaction, public_key: [u8; 32], signature: Vec<u8>) -> Result<String, String> {
    let hint = SignatureHint([public_key[28], public_key[29], public_key[30], public_key[31]]);
    let decorated = DecoratedSignature {
        hint,
        signature: Signature(signature.try_into().map_err(xdr_err)?),
    };
    TransactionEnvelope::Tx(TransactionV1Envelope {
        tx,
        signatures: vec![decorated].try_into().map_err(xdr_err)?,
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
        // Soroban transactions carry one operation: its result is the code.
        TransactionResultResult::TxFailed(ops) => ops
            .first()
            .map(|op| match op {
                OperationResult::OpInner(OperationResultTr::InvokeHostFunction(r)) => {
                    format!("invoke_host_function_{}", snake(r.name()))
                }
                OperationResult::OpInner(inner) => snake(inner.name()),
                other => snake(other.name()),
            })
            .unwrap_or_else(|| "tx_failed".to_owned()),
        other => snake(other.name()),
    }
}
