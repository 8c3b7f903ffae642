//! The tests' fake Stellar RPC as a process of its own, for trying laneway
//! as an operator would (the release binary, the shipped configs, kill -9):
//! it checks every envelope's signature, sequence, fees and bounds exactly
//! as in the tests, closes ledgers on a timer, and takes faults on stdin.
//!
//! ```sh
//! cargo run -p laneway-tests --example fake_stellar_rpc -- --port 8000 --close-ms 1000 --fund GABC… \
//!     --require-auth pay_referral=GXYZ…
//! ```
//!
//! `--require-auth FUNCTION=G…` makes every call of that contract function
//! need that account's authorisation (its own source-account signature, or
//! a signed address entry when a channel account is the source).
//!
//! Faults for the next `sendTransaction`s, one per stdin line:
//! `504 N` (accepted, answered 504, applied N ledgers later), `hang N`
//! (accepted, never answered, applied N ledgers later), `busy`, `bad-seq`,
//! `lose`, `trap`, `hide` (lands, but `getTransaction` never says so).
//! Other stdin lines move the chain: `skip N` closes a ledger and jumps N
//! ledgers on (`skip 138240`: eight days, past the RPC's retention, so it
//! forgets what landed); `history-from N` makes the Horizon-compatible
//! history at `/history` forget everything before ledger N; `congest N`
//! includes only transactions bidding at least N per operation (0 ends it),
//! so a fee bump can be watched replacing a stuck one. Every second it prints what it saw when that changed:
//! transactions sent and landed, sends while the signer already had one
//! queued (must stay 0), and bad sequences. With `--state FILE` it also
//! rewrites FILE (write, then rename) whenever that changes: those counts
//! and every landed transaction (hash, source `G…`, sequence, function,
//! i128 arguments as decimal text), for a harness to check from outside.

use std::str::FromStr as _;
use std::time::Duration;

use anyhow::Context as _;
use laneway::demo::fake_rpc::{self, FakeRpc, SendFault};
use tokio::io::AsyncBufReadExt as _;

fn fault(line: &str) -> anyhow::Result<SendFault> {
    let mut words = line.split_whitespace();
    let name = words.next().unwrap_or_default();
    let ledgers = || -> anyhow::Result<u32> {
        Ok(line
            .split_whitespace()
            .nth(1)
            .map(str::parse)
            .transpose()
            .context("ledgers")?
            .unwrap_or(6))
    };
    Ok(match name {
        "504" => SendFault::AcceptThen504 {
            apply_after: ledgers()?,
        },
        "hang" => SendFault::AcceptThenHangFor {
            apply_after: ledgers()?,
        },
        "busy" => SendFault::TryAgainLater,
        "bad-seq" => SendFault::BadSeq,
        "lose" => SendFault::AcceptThenLose,
        "trap" => SendFault::Trap,
        "hide" => SendFault::HideFor(u32::MAX),
        other => anyhow::bail!(
            "unknown line {other:?} (faults: 504 N, hang N, busy, bad-seq, lose, trap, hide; \
             skip N, history-from N, congest N)"
        ),
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut port = 0u16;
    let mut close_ms = 1000u64;
    let mut state: Option<std::path::PathBuf> = None;
    let fake = FakeRpc::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--port" => port = value()?.parse()?,
            "--close-ms" => close_ms = value()?.parse()?,
            "--state" => state = Some(value()?.into()),
            "--fund" => {
                let account = stellar_xdr::AccountId::from_str(&value()?).context("--fund takes a G… account")?;
                let stellar_xdr::PublicKey::PublicKeyTypeEd25519(stellar_xdr::Uint256(key)) = account.0;
                fake.fund(key, 4_294_967_296);
            }
            "--require-auth" => {
                let spec = value()?;
                let (function, account) = spec.split_once('=').context("--require-auth takes FUNCTION=G…")?;
                let account = stellar_xdr::AccountId::from_str(account).context("--require-auth takes FUNCTION=G…")?;
                let stellar_xdr::PublicKey::PublicKeyTypeEd25519(stellar_xdr::Uint256(key)) = account.0;
                fake.require_auth(function, key);
            }
            other => anyhow::bail!(
                "unknown argument {other} (--port, --close-ms, --fund G…, --require-auth FUNCTION=G…, --state FILE)"
            ),
        }
    }
    let url = fake.serve_on(port).await?;
    println!("fake Stellar RPC at {url} (passphrase {:?})", fake_rpc::TESTNET);
    let _closer = fake.close_ledgers_every(Duration::from_millis(close_ms));
    let injector = fake.clone();
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let mut words = line.split_whitespace();
            let (command, ledger) = (words.next(), words.next().map(str::parse::<u32>));
            match (command, ledger) {
                (Some("skip"), Some(Ok(n))) => {
                    injector.skip_ledgers(n);
                    println!("skipped to ledger {}", injector.latest_ledger());
                    continue;
                }
                (Some("congest"), Some(Ok(n))) => {
                    injector.congest(i64::from(n));
                    println!("including only bids of {n} and up");
                    continue;
                }
                (Some("history-from"), Some(Ok(n))) => {
                    injector.history_forget_before(n);
                    println!("history starts at ledger {n}");
                    continue;
                }
                _ => {}
            }
            match fault(&line) {
                Ok(f) => {
                    injector.inject(&[f]);
                    println!("next send: {f:?}");
                }
                Err(e) => println!("{e}"),
            }
        }
    });
    let mut last = String::new();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = format!(
            "sent {} landed {} concurrent_sends {} bad_seqs {} auth_failures {}",
            fake.submitted().len(),
            fake.landed().len(),
            fake.concurrent_sends(),
            fake.bad_seqs(),
            fake.auth_failures()
        );
        if now != last {
            println!("ledger {}: {now}", fake.latest_ledger());
            if let Some(path) = &state {
                write_state(&fake, path)?;
            }
            last = now;
        }
    }
}

/// The counts, every landed transaction and every accepted one, as JSON, replacing `path`
/// whole (a reader never sees half of it).
fn write_state(fake: &FakeRpc, path: &std::path::Path) -> anyhow::Result<()> {
    let describe = |txs: Vec<fake_rpc::Submitted>| -> Vec<serde_json::Value> {
        txs.iter()
            .map(|tx| {
                let args: Vec<String> = tx
                    .args
                    .iter()
                    .map(|arg| match arg {
                        stellar_xdr::ScVal::I128(parts) => {
                            (i128::from(parts.hi) << 64 | i128::from(parts.lo)).to_string()
                        }
                        other => format!("{other:?}"),
                    })
                    .collect();
                serde_json::json!({
                    "hash": tx.hash,
                    "inner_hash": tx.inner_hash,
                    "source": fake_rpc::address(tx.source),
                    "fee_source": fake_rpc::address(tx.fee_source),
                    "sequence": tx.sequence,
                    "function": tx.function,
                    "args": args,
                    "accepted_at_ledger": tx.accepted_at_ledger,
                    "max_ledger": tx.max_ledger,
                    "state": format!("{:?}", tx.state),
                })
            })
            .collect()
    };
    let text = serde_json::json!({
        "sent": fake.submitted().len(),
        "concurrent_sends": fake.concurrent_sends(),
        "bad_seqs": fake.bad_seqs(),
        "auth_failures": fake.auth_failures(),
        "bad_seq_sends": fake.bad_seq_sends(),
        "landed": describe(fake.landed()),
        "submitted": describe(fake.submitted()),
    })
    .to_string();
    let partial = path.with_extension("partial");
    std::fs::write(&partial, text)?;
    std::fs::rename(&partial, path)?;
    Ok(())
}
