//! Stellar payouts through a channel-account pool, measured: the real
//! `stellar-vault` plugin against the fake RPC in this process (which
//! checks every signature, sequence and authorisation entry), a burst of
//! referral payouts through pools of 1, 4 and 8 channels and through the
//! signer alone. One transaction per source account lands per ledger, so a
//! pool's ceiling is its size per ledger; the figure is how close it gets.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::SystemClock;
use crate::demo::fake_rpc::{self, FakeRpc, TxState};
use crate::dispatch::Dispatcher;
use crate::queue::NewOp;
use crate::runtime::host::PluginHost;

const CONTRACT: &str = "CAAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQC526";

/// What one burst saw.
struct Burst {
    landed: usize,
    /// First to last ledger a payout landed in, inclusive.
    span: u32,
    most_in_one: usize,
    seconds: f64,
    concurrent: usize,
    twice: usize,
    /// Transactions that landed from the first one's source account.
    from_first_source: usize,
    /// Waiting ops the drain moved from one channel to another.
    moved: i64,
}

/// How a burst is run.
#[derive(Clone, Copy)]
struct Shape {
    /// Channels in the pool (0: the signer's own account).
    channels: u8,
    /// Every channel transaction in a fee bump the signer pays.
    signer_pays: bool,
    /// The first send is taken and answered 504, landing this many ledgers
    /// later: its channel is held in doubt meanwhile.
    doubt: Option<u32>,
}

/// `ops` payouts shaped by `shape`, a ledger every `ledger`.
async fn burst(shape: Shape, ops: usize, ledger: Duration) -> anyhow::Result<Burst> {
    let Shape {
        channels,
        signer_pays,
        doubt,
    } = shape;
    let dir = tempfile::tempdir()?;
    let fake = FakeRpc::default();
    let url = fake.serve().await?;
    let closer = fake.close_ledgers_every(ledger);
    let mut keys = String::new();
    let mut write_key = |id: &str, seed: u8| -> anyhow::Result<[u8; 32]> {
        let (pem, public) = fake_rpc::keypair(seed)?;
        let file = dir.path().join(format!("{id}.pem"));
        std::fs::write(&file, pem)?;
        keys.push_str(&format!(
            "[keys.{id}]\nalgorithm = \"ed25519\"\nfile = {:?}\n",
            file.display().to_string()
        ));
        fake.fund(public, 1 << 32);
        Ok(public)
    };
    let signer = write_key("rewards", 1)?;
    fake.require_auth("pay_referral", signer);
    let mut ids = vec!["\"rewards\"".to_owned()];
    let mut channel_ids = Vec::new();
    for c in 0..channels {
        write_key(&format!("chan-{c}"), 10 + c)?;
        channel_ids.push(format!("\"chan-{c}\""));
    }
    ids.extend(channel_ids.iter().cloned());
    let pool = if channels == 0 {
        String::new()
    } else {
        format!(
            "[pools.payouts]\nchannels = [{}]\nfee_payer = {:?}\n[kinds.referral_payout]\npool = \"payouts\"\n",
            channel_ids.join(", "),
            if signer_pays { "signer" } else { "channel" }
        )
    };
    let base = format!(
        "[database]\nurl = {db:?}\n[dispatch]\npoll_ms = 50\n{keys}\
         [plugins.vault]\npath = {plugin:?}\nallowed_hosts = [\"http://127.0.0.1:*\"]\n\
         allowed_internal = [\"127.0.0.1\"]\nkeys = [{ids}]\n\
         [kinds.referral_payout]\nplugin = \"vault\"\n\
         [kinds.referral_payout.config]\nrpc_url = {url:?}\nnetwork_passphrase = {passphrase:?}\n\
         contract_id = {CONTRACT:?}\nfunction = \"pay_referral\"\nsigner_key = \"rewards\"\npoll_ms = 50\n\
         args = [{{ field = \"referrer\", type = \"address\" }}, {{ field = \"amount\", type = \"i128\" }}]\n",
        db = format!("sqlite://{}", dir.path().join("bench.db").display()),
        plugin = super::plugin("stellar_vault")?.display().to_string(),
        ids = ids.join(", "),
        passphrase = fake_rpc::TESTNET,
    );
    let config = crate::config::from_layers(&[&base, &pool])?;
    let queue = crate::queue::open(&config.database, config.limits(), Arc::new(SystemClock)).await?;
    queue.migrate().await?;
    let host = PluginHost::new(&config)?;
    let refused = host.apply(&config).await?;
    anyhow::ensure!(refused.is_empty(), "the vault plugin refused its config: {refused:?}");
    let dispatcher = Dispatcher::new(queue.clone(), host.registry(), config.clone(), Arc::new(SystemClock));
    let runner = dispatcher.clone();
    let handle = tokio::spawn(async move { runner.run().await });
    let payouts: Vec<NewOp> = (0..ops)
        .map(|i| {
            let referrer = fake_rpc::address([u8::try_from(i % 200).unwrap_or(0) + 30; 32]);
            NewOp::new(
                "vault",
                "referral_payout",
                serde_json::json!({ "referrer": referrer, "amount": (1_000 + i).to_string() }).to_string(),
            )
        })
        .collect();
    if let Some(apply_after) = doubt {
        fake.inject(&[fake_rpc::SendFault::AcceptThen504 { apply_after }]);
    }
    let start = Instant::now();
    dispatcher.enqueue(&payouts).await?;
    let deadline = Instant::now() + ledger * u32::try_from(ops * 3 + 20).unwrap_or(u32::MAX);
    while super::open_ops(queue.as_ref()).await? > 0 {
        anyhow::ensure!(Instant::now() < deadline, "the burst did not finish");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seconds = start.elapsed().as_secs_f64();
    dispatcher.shutdown();
    handle.await??;
    let moved: i64 = {
        let db = sqlx::SqlitePool::connect(&format!("sqlite://{}", dir.path().join("bench.db").display())).await?;
        let n = sqlx::query_scalar("SELECT COUNT(*) FROM laneway_lane_redeals")
            .fetch_one(&db)
            .await?;
        db.close().await;
        n
    };
    closer.abort();
    let mut per_ledger: BTreeMap<u32, usize> = BTreeMap::new();
    let landed = fake.landed();
    for t in &landed {
        if let TxState::Success { ledger } = t.state {
            *per_ledger.entry(ledger).or_default() += 1;
        }
    }
    let span = match (per_ledger.keys().next(), per_ledger.keys().last()) {
        (Some(first), Some(last)) => last - first + 1,
        _ => 0,
    };
    let from_first_source = fake
        .submitted()
        .first()
        .map_or(0, |first| landed.iter().filter(|t| t.source == first.source).count());
    let mut amounts: Vec<String> = landed.iter().map(|t| format!("{:?}", t.args)).collect();
    amounts.sort_unstable();
    let distinct = {
        let mut d = amounts.clone();
        d.dedup();
        d.len()
    };
    anyhow::ensure!(fake.auth_failures() == 0, "an authorisation did not hold");
    Ok(Burst {
        landed: landed.len(),
        span,
        most_in_one: per_ledger.values().max().copied().unwrap_or(0),
        seconds,
        concurrent: fake.concurrent_sends(),
        twice: amounts.len() - distinct,
        from_first_source,
        moved,
    })
}

/// The section: the signer alone, then pools of 1, 4 and 8 channels.
pub(super) async fn pools(quick: bool, ledger: Duration) -> anyhow::Result<()> {
    println!(
        "\n## Stellar payouts through a channel pool: a ledger every {ledger:?}, one transaction per source account a ledger"
    );
    println!("| source | payouts | ledgers (first..last landed) | a ledger | of the ceiling | seconds | two in flight on one account | landed twice | moved between channels |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let rounds: u32 = if quick { 4 } else { 10 };
    for (channels, signer_pays) in [(0u8, false), (1, false), (4, false), (8, false), (8, true)] {
        let ops = usize::from(channels.max(1)) * usize::try_from(rounds).unwrap_or(10);
        let shape = Shape {
            channels,
            signer_pays,
            doubt: None,
        };
        let b = burst(shape, ops, ledger).await?;
        let ceiling = f64::from(channels.max(1));
        let rate = b.landed as f64 / f64::from(b.span.max(1));
        println!(
            "| {} | {} | {} | {rate:.2} (most {}) | {:.0}% | {:.1} | {} | {} | {} |",
            match (channels, signer_pays) {
                (0, _) => "the signer".to_owned(),
                (n, false) => format!("pool of {n}"),
                (n, true) => format!("pool of {n}, the signer paying (fee bumps)"),
            },
            b.landed,
            b.span,
            b.most_in_one,
            100.0 * rate / ceiling,
            b.seconds,
            b.concurrent,
            b.twice,
            b.moved
        );
    }
    // One channel's first transaction in doubt (taken, answered 504, landing
    // `hold` ledgers later, inside its ledger bound): the ops dealt behind it
    // are re-dealt to the free channels, so the burst does not wait for the
    // reconcile. Dealt at enqueue only, they would land one a ledger after
    // it: the burst would last `hold` + the channel's share of ledgers.
    let hold = rounds.saturating_sub(2).max(2);
    let shape = Shape {
        channels: 8,
        signer_pays: false,
        doubt: Some(hold),
    };
    let ops = 8 * usize::try_from(rounds).unwrap_or(10);
    let b = burst(shape, ops, ledger).await?;
    println!(
        "\npool of 8, one channel held in doubt for {hold} ledgers: {} payouts in {} ledgers ({rounds} with no \
         doubt; dealt at enqueue only, at least {}), {} of them from the held channel ({} moved between channels); two in flight \
         on one account {}, landed twice {}",
        b.landed,
        b.span,
        hold + rounds - 1,
        b.from_first_source,
        b.moved,
        b.concurrent,
        b.twice
    );
    Ok(())
}
