//! A measurement, not a gate: how close three signers come to one
//! transaction per ledger each, at 0.5 s ledgers and the default dispatch
//! poll, with the vault plugin's default confirmation poll (at the ledger's
//! expected close) and with a fixed fast one. It
//! checks that nothing went wrong on the way (every op landed once, no two
//! transactions of a signer in flight, no bad sequence) and prints the
//! cadence; BENCHMARKS.md records it. Ignored by default (it takes ~45 s):
//!
//! ```sh
//! cargo test -p laneway-tests --test it -- --ignored --nocapture three_signers_cadence
//! ```

use std::time::Duration;

use anyhow::ensure;

use super::fake_rpc::{keypair, TxState};
use super::vault::{vault_op, Chain, Host};
use crate::dispatch::harness::settle;

const SIGNED_KINDS: [&str; 3] = ["deposit", "withdraw", "rebalance"];

/// Lands `per_signer` transactions for each of three signers; returns the
/// share of the ledger ceiling reached (one transaction per ledger each).
async fn cadence(vault_poll_ms: Option<u64>, per_signer: i64) -> anyhow::Result<f64> {
    let db = crate::support::sqlite_live().await?;
    let chain = Chain::start(500).await?;
    let dir = tempfile::tempdir()?;
    let mut extra = "[plugins.vault]\nkeys = [\"vault\", \"vault2\", \"vault3\"]\n".to_owned();
    for (i, kind) in SIGNED_KINDS.iter().enumerate() {
        let key = if i == 0 {
            "vault".to_owned()
        } else {
            format!("vault{}", i + 1)
        };
        if i > 0 {
            let (pem, signer) = keypair(42 + u8::try_from(i)?)?;
            chain.fake.fund(signer, 4_294_967_337);
            let file = dir.path().join(format!("{key}.pem"));
            std::fs::write(&file, pem)?;
            extra.push_str(&format!(
                "[keys.{key}]\nalgorithm = \"ed25519\"\nfile = {:?}\n",
                file.display().to_string()
            ));
        }
        extra.push_str(&format!("[kinds.{kind}.config]\nsigner_key = {key:?}\n"));
        if let Some(poll) = vault_poll_ms {
            extra.push_str(&format!("poll_ms = {poll}\n"));
        }
    }
    // The dispatcher's own poll at its default: wake-ups, not the poll,
    // must start each signer's next transaction.
    extra.push_str("[dispatch]\npoll_ms = 1000\n");
    let host = Host::start(db.queue.clone(), chain.config("", &extra)?).await?;
    let mut ops = Vec::new();
    for i in 0..per_signer {
        for kind in SIGNED_KINDS {
            ops.push(vault_op(kind, 1, 1000 + i, None));
        }
    }
    let first = chain.fake.latest_ledger();
    host.enqueue(&ops).await?;
    settle(db.queue.as_ref(), Duration::from_secs(120)).await?;
    host.running.stop().await?;
    let ledgers: Vec<u32> = chain
        .fake
        .submitted()
        .iter()
        .filter_map(|t| match t.state {
            TxState::Success { ledger } => Some(ledger),
            _ => None,
        })
        .collect();
    ensure!(ledgers.len() == ops.len(), "{} of {} landed", ledgers.len(), ops.len());
    ensure!(
        chain.fake.submitted().len() == ops.len(),
        "a transaction was sent twice"
    );
    ensure!(chain.fake.concurrent_sends() == 0, "two in flight for one signer");
    ensure!(chain.fake.bad_seqs() == 0, "a bad sequence");
    let span = ledgers
        .iter()
        .max()
        .copied()
        .unwrap_or(first)
        .saturating_sub(first)
        .max(1);
    Ok(ledgers.len() as f64 / (3.0 * f64::from(span)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement (~45 s); run it by name"]
async fn three_signers_cadence() -> anyhow::Result<()> {
    for poll in [None, Some(20)] {
        let share = cadence(poll, 20).await?;
        let poll = poll.map_or_else(|| "its default".to_owned(), |p| p.to_string());
        println!(
            "3 signers, 0.5 s ledgers, vault poll_ms = {poll}: {:.1}% of one transaction per ledger per signer",
            share * 100.0
        );
    }
    Ok(())
}
