//! Channel-account pools through the real vault plugin and the fake RPC:
//! the channels are the transactions' sources, the signer authorises each
//! contract call with a signed address entry, one transaction is in flight
//! per channel, and a burst goes out as many transactions a ledger as the
//! pool has channels.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use laneway::op::Status;

use super::fake_rpc::{address, TxState};
use super::vault::{amount_of, vault_op, Chain, Host};
use crate::dispatch::harness::settle;
use crate::support::TestDb;

crate::on_both_backends!(
    live:
    a_burst_through_a_pool_of_eight_channels_lands_once_each_one_transaction_per_channel,
    a_retired_channel_drains_its_ops_and_takes_no_new_ones,
);

async fn a_burst_through_a_pool_of_eight_channels_lands_once_each_one_transaction_per_channel(
    db: TestDb,
) -> anyhow::Result<()> {
    const CLOSE_MS: u64 = 400;
    const OPS: usize = 64;
    let chain = Chain::start(CLOSE_MS).await?;
    let (pool, channels) = chain.pool_layer(8, &["referral_payout"])?;
    let host = Host::start(db.queue.clone(), chain.config("", &pool)?).await?;
    let ops: Vec<_> = (0..OPS)
        .map(|i| vault_op("referral_payout", 1 + (i % 200) as u8, 10_000 + i as i64, None))
        .collect();
    let first_ledger = chain.fake.latest_ledger();
    let started = Instant::now();
    let ids = host.enqueue(&ops).await?;
    settle(db.queue.as_ref(), Duration::from_secs(120)).await?;
    let elapsed = started.elapsed();
    let ledgers = chain.fake.latest_ledger() - first_ledger;

    let accounts: HashSet<String> = channels.iter().map(|c| address(*c)).collect();
    let mut dealt: BTreeMap<String, usize> = BTreeMap::new();
    for id in &ids {
        let op = db.queue.get(*id).await?.context("op")?;
        ensure!(op.status == Status::Confirmed, "{op:?}");
        ensure!(
            op.lanes.len() == 1 && accounts.contains(&op.lanes[0]),
            "an op's one lane is a channel: {:?}",
            op.lanes
        );
        *dealt.entry(op.lanes[0].clone()).or_default() += 1;
    }
    ensure!(
        dealt.len() == 8 && dealt.values().all(|n| *n == OPS / 8),
        "dealt evenly: {dealt:?}"
    );
    let landed = chain.fake.landed();
    ensure!(
        landed.len() == OPS && chain.fake.submitted().len() == OPS,
        "each op sent and landed once: {} landed of {} sent",
        landed.len(),
        chain.fake.submitted().len()
    );
    let mut amounts: Vec<i128> = landed.iter().filter_map(|t| amount_of(&t.args)).collect();
    amounts.sort_unstable();
    ensure!(
        amounts == (10_000..10_000 + OPS as i128).collect::<Vec<_>>(),
        "every payout once: {amounts:?}"
    );
    ensure!(
        landed.iter().all(|t| channels.contains(&t.source) && t.nonce.is_some()),
        "every transaction comes from a channel with the signer's signed authorisation"
    );
    ensure!(chain.fake.auth_failures() == 0, "an authorisation did not hold");
    ensure!(
        chain.fake.concurrent_sends() == 0,
        "two transactions of one channel in flight"
    );
    ensure!(chain.fake.bad_seqs() == 0, "a bad sequence");
    // A figure, not a timed assertion: the bench measures throughput.
    let mut per_ledger: BTreeMap<u32, usize> = BTreeMap::new();
    for t in &landed {
        if let TxState::Success { ledger } = t.state {
            *per_ledger.entry(ledger).or_default() += 1;
        }
    }
    println!(
        "pool of 8: {OPS} payouts in {elapsed:?} over {ledgers} ledgers of {CLOSE_MS} ms ({:.2} a ledger); landed per ledger {:?}",
        OPS as f64 / f64::from(ledgers.max(1)),
        per_ledger.values().collect::<Vec<_>>()
    );
    host.running.stop().await
}

async fn a_retired_channel_drains_its_ops_and_takes_no_new_ones(db: TestDb) -> anyhow::Result<()> {
    let chain = Chain::start(50).await?;
    let (pool, channels) = chain.pool_layer(2, &["deposit"])?;
    let config = chain.config("", &pool)?;
    let host = Host::start(db.queue.clone(), config.clone()).await?;
    // Held (a halted subject) until the channel is retired.
    db.queue.halt_subject("user:held", None).await?;
    let held: Vec<_> = (0..6)
        .map(|i| {
            let mut op = vault_op("deposit", 1, 100 + i, None);
            op.subject = Some("user:held".into());
            op
        })
        .collect();
    let before = host.enqueue(&held).await?;
    let retiring = address(channels[0]);
    let mut on_retiring = 0;
    for id in &before {
        let op = db.queue.get(*id).await?.context("op")?;
        on_retiring += usize::from(op.lanes == [retiring.clone()]);
    }
    ensure!(
        on_retiring == 3,
        "dealt in turn: {on_retiring} of 6 on the first channel"
    );
    // The operator retires chan-0.
    let mut next = config.clone();
    next.pools
        .get_mut("payouts")
        .context("pool")?
        .retired
        .push("chan-0".to_owned());
    host.plugins.apply(&next).await?;
    let after = host
        .enqueue(
            &(0..4)
                .map(|i| vault_op("deposit", 2, 200 + i, None))
                .collect::<Vec<_>>(),
        )
        .await?;
    for id in &after {
        let op = db.queue.get(*id).await?.context("op")?;
        ensure!(
            op.lanes == [address(channels[1])],
            "a new op avoids the retired channel: {:?}",
            op.lanes
        );
    }
    db.queue.unhalt_subject("user:held").await?;
    settle(db.queue.as_ref(), Duration::from_secs(60)).await?;
    for id in before.iter().chain(&after) {
        let op = db.queue.get(*id).await?.context("op")?;
        ensure!(op.status == Status::Confirmed, "{op:?}");
    }
    let from_retired = chain.fake.landed().iter().filter(|t| t.source == channels[0]).count();
    ensure!(
        from_retired == 3,
        "the retired channel's own ops drained: {from_retired}"
    );
    host.running.stop().await
}
