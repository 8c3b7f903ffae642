//! Soroban authorisation entries a simulation asks for: which ones the
//! kind's signer may give (its own call, nothing a hostile RPC slipped in),
//! and signing an address-credentials entry through the host (when a
//! channel account, not the signer, is the transaction's source).

use stellar_xdr::{
    Hash, HashIdPreimage, HashIdPreimageSorobanAuthorization, InvokeContractArgs, Limits, ReadXdr, ScAddress, ScBytes,
    ScMap, ScMapEntry, ScSymbol, ScVal, ScVec, SorobanAuthorizationEntry, SorobanAuthorizedFunction,
    SorobanAuthorizedInvocation, SorobanCredentials, WriteXdr,
};

fn xdr_err(e: stellar_xdr::Error) -> String {
    format!("xdr: {e}")
}

/// What the signer is asked to authorise, and who it is.
pub struct Request<'a> {
    /// The op's own call: every entry's root invocation must be exactly it.
    pub call: &'a InvokeContractArgs,
    /// Contracts the call may go on to call under the signer's authority.
    pub contracts: &'a [ScAddress],
    /// The signer's account and ed25519 public key.
    pub signer: [u8; 32],
    /// The transaction's source is the signer (no address entry to sign).
    pub signer_is_source: bool,
    /// The last ledger a signature is good for (the transaction's own
    /// ledger bound: it cannot be replayed after the transaction is dead).
    pub until_ledger: u32,
    /// SHA-256 of the network passphrase.
    pub network_id: [u8; 32],
}

/// Checks each entry and signs the signer's address entries with `sign`
/// (the host signs a 32-byte payload by key id); returns the entries to put
/// on the operation, base64.
///
/// # Errors
///
/// An entry authorising anything but the op's own call (and calls it makes
/// into `contracts`), an address other than the signer's, a kind of
/// credentials this plugin does not sign, or a signing failure.
pub fn authorize(
    entries: &[String],
    request: &Request<'_>,
    mut sign: impl FnMut(&[u8; 32]) -> Result<Vec<u8>, String>,
) -> Result<Vec<String>, String> {
    let signer_address = ScAddress::Account(crate::tx::account_id(request.signer));
    entries
        .iter()
        .map(|text| {
            let mut entry = SorobanAuthorizationEntry::from_xdr_base64(text, Limits::none()).map_err(xdr_err)?;
            check_invocation(&entry.root_invocation, request, true)?;
            match &mut entry.credentials {
                // Authorised by the transaction's own signature: only the
                // signer's is one we want to lend.
                SorobanCredentials::SourceAccount if request.signer_is_source => {}
                SorobanCredentials::SourceAccount => {
                    return Err("the simulation asks the channel account to authorise the call".to_owned())
                }
                SorobanCredentials::Address(credentials) => {
                    if credentials.address != signer_address {
                        return Err(format!(
                            "the simulation asks {} to authorise the call; only the kind's signer signs",
                            credentials.address
                        ));
                    }
                    credentials.signature_expiration_ledger = request.until_ledger;
                    let preimage = HashIdPreimage::SorobanAuthorization(HashIdPreimageSorobanAuthorization {
                        network_id: Hash(request.network_id),
                        nonce: credentials.nonce,
                        signature_expiration_ledger: request.until_ledger,
                        invocation: entry.root_invocation.clone(),
                    });
                    let payload = payload(&preimage)?;
                    let signature = sign(&payload)?;
                    credentials.signature = account_signature(request.signer, signature)?;
                }
                other => {
                    return Err(format!(
                        "the simulation asks for {} credentials, which this plugin does not sign",
                        other.name()
                    ))
                }
            }
            entry.to_xdr_base64(Limits::none()).map_err(xdr_err)
        })
        .collect()
}

/// The 32 bytes an address entry's signature covers.
pub fn payload(preimage: &HashIdPreimage) -> Result<[u8; 32], String> {
    use sha2::Digest as _;
    let bytes = preimage.to_xdr(Limits::none()).map_err(xdr_err)?;
    Ok(sha2::Sha256::digest(bytes).into())
}

/// A classic account's signature value: `[{public_key, signature}]`.
pub fn account_signature(public_key: [u8; 32], signature: Vec<u8>) -> Result<ScVal, String> {
    let bytes = |b: Vec<u8>| -> Result<ScVal, String> { Ok(ScVal::Bytes(ScBytes(b.try_into().map_err(xdr_err)?))) };
    let symbol = |s: &str| -> Result<ScVal, String> {
        Ok(ScVal::Symbol(
            ScSymbol::try_from(s).map_err(|_| format!("{s:?} is not a symbol"))?,
        ))
    };
    let map = ScMap(
        vec![
            ScMapEntry {
                key: symbol("public_key")?,
                val: bytes(public_key.to_vec())?,
            },
            ScMapEntry {
                key: symbol("signature")?,
                val: bytes(signature)?,
            },
        ]
        .try_into()
        .map_err(xdr_err)?,
    );
    Ok(ScVal::Vec(Some(ScVec(
        vec![ScVal::Map(Some(map))].try_into().map_err(xdr_err)?,
    ))))
}

/// The root must be the op's own call; what it calls under the signer's
/// authority must go to the op's contract or one the kind lists.
fn check_invocation(invocation: &SorobanAuthorizedInvocation, request: &Request<'_>, root: bool) -> Result<(), String> {
    match &invocation.function {
        SorobanAuthorizedFunction::ContractFn(call) if root && call != request.call => Err(format!(
            "the simulation asks the signer to authorise {}.{} instead of the op's own call",
            call.contract_address,
            call.function_name.0.to_utf8_string_lossy()
        )),
        SorobanAuthorizedFunction::ContractFn(call)
            if !root
                && call.contract_address != request.call.contract_address
                && !request.contracts.contains(&call.contract_address) =>
        {
            Err(format!(
                "the call asks the signer to authorise a call into {}, which is not in the kind's auth_contracts",
                call.contract_address
            ))
        }
        SorobanAuthorizedFunction::ContractFn(_) => invocation
            .sub_invocations
            .iter()
            .try_for_each(|sub| check_invocation(sub, request, false)),
        _ => Err("the simulation asks the signer to authorise creating a contract".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stellar_xdr::{SorobanAddressCredentials, VecM};

    fn call(function: &str) -> InvokeContractArgs {
        InvokeContractArgs {
            contract_address: "CAAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQC526"
                .parse()
                .unwrap_or_else(|_| ScAddress::Account(crate::tx::account_id([0; 32]))),
            function_name: ScSymbol::try_from(function).unwrap_or_default(),
            args: VecM::default(),
        }
    }

    fn entry(credentials: SorobanCredentials, function: &str) -> String {
        SorobanAuthorizationEntry {
            credentials,
            root_invocation: SorobanAuthorizedInvocation {
                function: SorobanAuthorizedFunction::ContractFn(call(function)),
                sub_invocations: VecM::default(),
            },
        }
        .to_xdr_base64(Limits::none())
        .unwrap_or_default()
    }

    fn address(signer: [u8; 32]) -> SorobanCredentials {
        SorobanCredentials::Address(SorobanAddressCredentials {
            address: ScAddress::Account(crate::tx::account_id(signer)),
            nonce: 42,
            signature_expiration_ledger: 0,
            signature: ScVal::Void,
        })
    }

    fn request(call: &InvokeContractArgs, signer_is_source: bool) -> Request<'_> {
        Request {
            call,
            contracts: &[],
            signer: [7; 32],
            signer_is_source,
            until_ledger: 1234,
            network_id: [1; 32],
        }
    }

    #[test]
    fn the_signers_address_entry_is_signed_until_the_transactions_ledger_bound() {
        let deposit = call("deposit");
        let mut signed_payload = None;
        let out = authorize(&[entry(address([7; 32]), "deposit")], &request(&deposit, false), |p| {
            signed_payload = Some(*p);
            Ok(vec![9; 64])
        })
        .expect("signed");
        let back = SorobanAuthorizationEntry::from_xdr_base64(&out[0], Limits::none()).expect("xdr");
        let SorobanCredentials::Address(c) = back.credentials else {
            panic!("address credentials")
        };
        assert_eq!(c.signature_expiration_ledger, 1234);
        assert_eq!(c.signature, account_signature([7; 32], vec![9; 64]).expect("value"));
        let preimage = HashIdPreimage::SorobanAuthorization(HashIdPreimageSorobanAuthorization {
            network_id: Hash([1; 32]),
            nonce: 42,
            signature_expiration_ledger: 1234,
            invocation: back.root_invocation,
        });
        assert_eq!(signed_payload, Some(payload(&preimage).expect("payload")));
    }

    #[test]
    fn anything_but_the_ops_own_call_by_its_own_signer_is_refused_unsigned() {
        let deposit = call("deposit");
        let never = |_: &[u8; 32]| -> Result<Vec<u8>, String> { panic!("signed a refused entry") };
        let other_call = authorize(&[entry(address([7; 32]), "withdraw")], &request(&deposit, false), never);
        assert!(other_call.is_err_and(|e| e.contains("instead of the op's own call")));
        let other_address = authorize(&[entry(address([8; 32]), "deposit")], &request(&deposit, false), never);
        assert!(other_address.is_err_and(|e| e.contains("only the kind's signer signs")));
        let channel = authorize(
            &[entry(SorobanCredentials::SourceAccount, "deposit")],
            &request(&deposit, false),
            never,
        );
        assert!(channel.is_err_and(|e| e.contains("channel account")));
        let own = authorize(
            &[entry(SorobanCredentials::SourceAccount, "deposit")],
            &request(&deposit, true),
            never,
        );
        assert!(own.is_ok());
    }
}
