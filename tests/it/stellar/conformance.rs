//! Proof that the fake Stellar RPC speaks the protocol: SDF's own client
//! (`stellar-rpc-client`, native) drives every method the plugins use,
//! including a full simulate → assemble → sign → send → poll round and a
//! rejected resubmission.

use anyhow::{ensure, Context};
use ed25519_dalek::Signer as _;
use sha2::Digest as _;
use stellar_xdr::{
    DecoratedSignature, HostFunction, InvokeContractArgs, InvokeHostFunctionOp, Limits, Memo, MuxedAccount, Operation,
    OperationBody, Preconditions, ScAddress, ScSymbol, ScVal, SequenceNumber, Signature, SignatureHint, Transaction,
    TransactionEnvelope, TransactionExt, TransactionV1Envelope, Uint256, WriteXdr as _,
};

use super::fake_rpc::{address, FakeRpc, TESTNET};

#[tokio::test]
async fn sdfs_own_rpc_client_understands_the_fake() -> anyhow::Result<()> {
    let fake = FakeRpc::default();
    let url = fake.serve().await?;
    let signing = ed25519_dalek::SigningKey::from_bytes(&[5; 32]);
    let public = signing.verifying_key().to_bytes();
    fake.fund(public, 4_294_967_337);
    let client = stellar_rpc_client::Client::new(&url)?;

    ensure!(client.get_network().await?.passphrase == TESTNET);
    ensure!(client.get_health().await?.status == "healthy");
    let latest = client.get_latest_ledger().await?;
    ensure!(latest.sequence == fake.latest_ledger(), "{latest:?}");
    let fees = client.get_fee_stats().await?;
    ensure!(
        fees.soroban_inclusion_fee.p70 == "100" && fees.soroban_inclusion_fee.transaction_count == 371,
        "{fees:?}"
    );
    let account = client.get_account(&address(public)).await.context("get_account")?;
    ensure!(account.seq_num.0 == 4_294_967_337, "{account:?}");

    let contract: ScAddress = "CAAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQC526"
        .parse()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let mut tx = Transaction {
        source_account: MuxedAccount::Ed25519(Uint256(public)),
        fee: 100,
        seq_num: SequenceNumber(account.seq_num.0 + 1),
        cond: Preconditions::None,
        memo: Memo::None,
        operations: vec![Operation {
            source_account: None,
            body: OperationBody::InvokeHostFunction(InvokeHostFunctionOp {
                host_function: HostFunction::InvokeContract(InvokeContractArgs {
                    contract_address: contract,
                    function_name: ScSymbol::try_from("deposit").map_err(|e| anyhow::anyhow!("{e:?}"))?,
                    args: vec![ScVal::from(1000i128)].try_into()?,
                }),
                auth: Vec::new().try_into()?,
            }),
        }]
        .try_into()?,
        ext: TransactionExt::V0,
    };
    let unsigned = TransactionEnvelope::Tx(TransactionV1Envelope {
        tx: tx.clone(),
        signatures: Vec::new().try_into()?,
    });
    let simulation = client
        .simulate_transaction_envelope(&unsigned, None)
        .await
        .context("simulate")?;
    ensure!(
        simulation.error.is_none() && simulation.min_resource_fee == 90_353,
        "{simulation:?}"
    );
    ensure!(simulation.results().context("results")?.len() == 1);
    tx.ext = TransactionExt::V1(simulation.transaction_data().context("transaction data")?);
    tx.fee = 100 + u32::try_from(simulation.min_resource_fee)?;
    let network_id: [u8; 32] = sha2::Sha256::digest(TESTNET.as_bytes()).into();
    let hash = tx.hash(network_id)?;
    let signature = signing.sign(&hash).to_bytes().to_vec();
    let envelope = TransactionEnvelope::Tx(TransactionV1Envelope {
        tx,
        signatures: vec![DecoratedSignature {
            hint: SignatureHint([public[28], public[29], public[30], public[31]]),
            signature: Signature(signature.try_into()?),
        }]
        .try_into()?,
    });
    let sent = client.send_transaction(&envelope).await.context("send")?;
    ensure!(
        sent.0 == hash,
        "the fake hashes with the passphrase as the network does"
    );
    ensure!(
        client
            .get_transaction(&sent)
            .await
            .context("get_transaction NOT_FOUND")?
            .status
            == "NOT_FOUND"
    );
    fake.close_ledger();
    let landed = client.get_transaction(&sent).await.context("get_transaction SUCCESS")?;
    ensure!(
        landed.status == "SUCCESS" && landed.ledger == Some(fake.latest_ledger()),
        "{landed:?}"
    );
    ensure!(landed.result.is_some() && landed.envelope.is_some(), "{landed:?}");
    ensure!(fake.sequence(public) == Some(4_294_967_338));

    // The same envelope again: its sequence is used, and SDF's client reads
    // the ERROR's result as txBAD_SEQ.
    let again = client.send_transaction(&envelope).await;
    let message = format!("{:?}", again.err().context("a resubmission must be refused")?);
    ensure!(message.contains("TxBadSeq"), "{message}");
    // A wrong network's signature is refused as bad auth.
    let mut forged = envelope.clone();
    if let TransactionEnvelope::Tx(v1) = &mut forged {
        v1.tx.seq_num = SequenceNumber(4_294_967_339);
    }
    let refused = format!("{:?}", client.send_transaction(&forged).await.err().context("forged")?);
    ensure!(refused.contains("TxBadAuth"), "{refused}");
    ensure!(!envelope.to_xdr_base64(Limits::none())?.is_empty());
    Ok(())
}
