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
    a_channel_taken_out_of_its_pool_waits_and_once_retired_drains_taking_no_new_ops,
    new_ops_are_dealt_around_a_channel_held_by_a_receipt_in_doubt,
    ops_dealt_behind_a_channel_that_falls_into_doubt_move_to_a_free_one,
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
    // Dealt evenly at enqueue; re-dealt as channels free up, so each ends
    // with about its share.
    ensure!(
        dealt.len() == 8 && dealt.values().all(|n| (OPS / 8 - 3..=OPS / 8 + 3).contains(n)),
        "spread over every channel: {dealt:?}"
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

async fn a_channel_taken_out_of_its_pool_waits_and_once_retired_drains_taking_no_new_ops(
    db: TestDb,
) -> anyhow::Result<()> {
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
    // The operator takes chan-0 out of the pool while it has ops: they
    // wait (a config mistake), they are not dead-lettered.
    let mut removed = config.clone();
    removed.pools.get_mut("payouts").context("pool")?.channels = vec!["chan-1".to_owned()];
    host.plugins.apply(&removed).await?;
    let after = host.enqueue(&deposits(2, 200, 4)).await?;
    for id in &after {
        let op = db.queue.get(*id).await?.context("op")?;
        ensure!(
            op.lanes == [address(channels[1])],
            "a new op avoids the retired channel: {:?}",
            op.lanes
        );
    }
    db.queue.unhalt_subject("user:held").await?;
    let stranded = before[before.len() - 1];
    let mut waiting = None;
    for id in &before {
        if db.queue.get(*id).await?.context("op")?.lanes == [retiring.clone()] {
            waiting = Some(*id);
        }
    }
    let waiting = waiting.unwrap_or(stranded);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let op = db.queue.get(waiting).await?.context("op")?;
        ensure!(!op.status.is_terminal(), "an op of a removed channel ended: {op:?}");
        if op
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("is no longer in pool"))
        {
            break;
        }
        ensure!(tokio::time::Instant::now() < deadline, "never told: {op:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Put back, retired: its ops drain.
    let mut next = config.clone();
    next.pools
        .get_mut("payouts")
        .context("pool")?
        .retired
        .push("chan-0".to_owned());
    host.plugins.apply(&next).await?;
    settle(db.queue.as_ref(), Duration::from_secs(60)).await?;
    for id in before.iter().chain(&after) {
        let op = db.queue.get(*id).await?.context("op")?;
        ensure!(op.status == Status::Confirmed, "{op:?}");
    }
    // Its waiting ops are re-dealt to the active channel; any it had
    // started finished on it. Nothing else came from it.
    let from_retired = chain.fake.landed().iter().filter(|t| t.source == channels[0]).count();
    let mut moved = 0;
    for id in &before {
        moved += usize::from(db.queue.get(*id).await?.context("op")?.lanes == [address(channels[1])]);
    }
    ensure!(
        from_retired + moved == 6 && from_retired <= on_retiring,
        "the retired channel's ops drained: {from_retired} from it, {moved} of the held six on the active one"
    );
    host.running.stop().await
}

/// An operator's round: `create` writes channel seeds (mode 0600) and the
/// config to paste, `fund` creates the accounts from the funder in one
/// transaction the fake checks like any other (and, run again, creates
/// none), `list` shows each channel and its open ops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_creates_funds_and_lists_a_pools_channels() -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let fake = super::fake_rpc::FakeRpc::default();
    let url = fake.serve().await?;
    let _closer = fake.close_ledgers_every(Duration::from_millis(100));
    let dir = tempfile::tempdir()?;
    let (pem, funder) = super::fake_rpc::keypair(251)?;
    fake.fund(funder, 7 << 32);
    let funder_file = dir.path().join("funder.pem");
    std::fs::write(&funder_file, pem)?;
    let seeds = dir.path().join("channels");
    let seeds_arg = seeds.display().to_string();
    let bare = dir.path().join("bare.toml");
    std::fs::write(&bare, "")?;
    let created = crate::api::cli(
        &[
            "--config",
            &bare.display().to_string(),
            "stellar",
            "channels",
            "create",
            "--pool",
            "payouts",
            "--count",
            "3",
            "--dir",
            &seeds_arg,
            "--json",
        ],
        &[],
    )
    .await?
    .map_err(|e| anyhow::anyhow!("create: {e}"))?;
    let created: Vec<serde_json::Value> = serde_json::from_str(&created)?;
    ensure!(created.len() == 3, "{created:?}");
    let mut keys = String::new();
    let mut ids = Vec::new();
    for c in &created {
        let file = c["file"].as_str().context("file")?;
        let mode = std::fs::metadata(file)?.permissions().mode() & 0o777;
        ensure!(mode == 0o600, "{file} is mode {mode:o}");
        let id = c["key"].as_str().context("key")?;
        keys.push_str(&format!("[keys.{id}]\nalgorithm = \"ed25519\"\nfile = {file:?}\n"));
        ids.push(format!("{id:?}"));
    }
    let config = dir.path().join("laneway.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = {db:?}\n{keys}[keys.treasury]\nalgorithm = \"ed25519\"\nfile = {funder:?}\n\
             [plugins.vault]\npath = {vault:?}\nallowed_hosts = [\"http://127.0.0.1:*\"]\n\
             allowed_internal = [\"127.0.0.1\"]\nkeys = [{ids}]\n\
             [pools.payouts]\nchannels = [{ids}]\nfunder = \"treasury\"\nrpc_url = {url:?}\n\
             network_passphrase = {passphrase:?}\n",
            db = format!("sqlite://{}", dir.path().join("q.db").display()),
            funder = funder_file.display().to_string(),
            vault = crate::runtime::wasm("stellar-vault")?.display().to_string(),
            ids = ids.join(", "),
            passphrase = super::fake_rpc::TESTNET,
        ),
    )?;
    let path = config.display().to_string();
    run(&path, &["migrate"]).await?;
    // Another create leaves the seeds it made alone and names new keys.
    let again = run(
        &path,
        &[
            "stellar", "channels", "create", "--pool", "payouts", "--count", "1", "--dir", &seeds_arg,
        ],
    )
    .await?;
    ensure!(
        again.contains("[keys.payouts-4]") && again.contains("channels = ["),
        "{again}"
    );
    let funded: serde_json::Value =
        serde_json::from_str(&run(&path, &["stellar", "channels", "fund", "--pool", "payouts", "--json"]).await?)?;
    ensure!(funded["created"].as_array().map(Vec::len) == Some(3), "{funded}");
    for c in &created {
        let account: stellar_xdr::AccountId = c["account"].as_str().context("account")?.parse()?;
        let stellar_xdr::PublicKey::PublicKeyTypeEd25519(stellar_xdr::Uint256(public)) = account.0;
        ensure!(fake.sequence(public).is_some(), "{c} was not created");
    }
    let landed = fake.landed();
    ensure!(
        landed.len() == 1 && landed[0].source == funder,
        "one funding transaction from the funder"
    );
    let twice: serde_json::Value =
        serde_json::from_str(&run(&path, &["stellar", "channels", "fund", "--pool", "payouts", "--json"]).await?)?;
    ensure!(twice["created"].as_array().is_some_and(Vec::is_empty), "{twice}");
    let listed: Vec<serde_json::Value> =
        serde_json::from_str(&run(&path, &["stellar", "channels", "list", "--json"]).await?)?;
    ensure!(
        listed.len() == 3 && listed.iter().all(|r| r["state"] == "active" && r["open_ops"] == 0),
        "{listed:?}"
    );

    // Retiring the first channel: refused while the config deals it ops,
    // and while an op dealt to it is open; then merged into the funder.
    let (key, account) = (
        created[0]["key"].as_str().context("key")?,
        created[0]["account"].as_str().context("account")?,
    );
    let retire = [
        "stellar", "channels", "retire", "--pool", "payouts", "--key", key, "--json",
    ];
    let active = run(&path, &retire).await;
    ensure!(
        active
            .as_ref()
            .is_err_and(|e| e.to_string().contains("add it to pools.payouts.retired first")),
        "{active:?}"
    );
    let text = std::fs::read_to_string(&config)?.replace(
        "funder = \"treasury\"",
        &format!("retired = [{key:?}]\nfunder = \"treasury\""),
    );
    std::fs::write(&config, text)?;
    let loaded = laneway::config::from_toml_str(&std::fs::read_to_string(&config)?)?;
    let queue = laneway::queue::open(
        &loaded.database,
        loaded.limits(),
        std::sync::Arc::new(laneway::clock::SystemClock),
    )
    .await?;
    let mut dealt = laneway::queue::NewOp::new("vault", "deposit", "{}".to_owned());
    dealt.lanes = vec![account.to_owned()];
    let open = queue.enqueue(&[dealt]).await?[0].id();
    let busy = run(&path, &retire).await;
    ensure!(
        busy.as_ref()
            .is_err_and(|e| e.to_string().contains("1 ops dealt to it are still open")),
        "{busy:?}"
    );
    queue.cancel(open).await?;
    let merged: serde_json::Value = serde_json::from_str(&run(&path, &retire).await?)?;
    ensure!(merged["merged"] == true, "{merged}");
    let merge = fake.landed();
    let stellar_xdr::PublicKey::PublicKeyTypeEd25519(stellar_xdr::Uint256(public)) =
        account.parse::<stellar_xdr::AccountId>()?.0;
    ensure!(
        merge.len() == 2 && merge[1].source == public && merge[1].merges_into == Some(funder),
        "one merge from the channel into the funder: {merge:?}"
    );
    ensure!(fake.sequence(public).is_none(), "the channel account is gone");
    let again: serde_json::Value = serde_json::from_str(&run(&path, &retire).await?)?;
    ensure!(again["merged"] == false, "nothing left to merge: {again}");
    Ok(())
}

/// Runs a CLI command against the config at `path`.
async fn run(path: &str, args: &[&str]) -> anyhow::Result<String> {
    let mut argv = vec!["--config", path];
    argv.extend_from_slice(args);
    crate::api::cli(&argv, &[])
        .await?
        .map_err(|e| anyhow::anyhow!("{args:?}: {e}"))
}

/// A channel's stuck transaction is fee-bumped by the channel (its source
/// pays and signs the bump), lands once under its inner hash, and carries
/// the signer's authorisation inside it.
#[tokio::test]
async fn a_channels_stuck_transaction_is_fee_bumped_by_the_channel_and_lands_once() -> anyhow::Result<()> {
    let db = crate::support::sqlite_live().await?;
    let chain = Chain::start(50).await?;
    let (pool, channels) = chain.pool_layer(2, &["deposit"])?;
    let host = Host::start(db.queue.clone(), chain.config("bump_multiplier = 10.0", &pool)?).await?;
    host.sample_fees(db.queue.clone()).await?;
    chain.fake.congest(500);
    let id = host.enqueue(&[vault_op("deposit", 7, 70, None)]).await?[0];
    settle(db.queue.as_ref(), Duration::from_secs(20)).await?;
    let (op, _, landed) = super::vault::bumped_once(db.queue.as_ref(), &chain, id).await?;
    let channel = channels
        .iter()
        .find(|c| op.lanes == [address(**c)])
        .context("the op's lane is a channel")?;
    ensure!(
        landed[0].source == *channel && landed[0].nonce.is_some(),
        "from the op's channel, with the signer's address entry: {landed:?}"
    );
    ensure!(chain.fake.auth_failures() == 0 && chain.fake.concurrent_sends() == 0);
    host.running.stop().await
}

/// With `fee_payer = "signer"` every transaction from a channel goes out
/// as a fee bump the signer pays and signs (channels need only their
/// reserve); a stuck one is bumped again by the signer, never sent bare,
/// and the op is confirmed under the inner (channel's) hash.
#[tokio::test]
async fn a_pool_whose_signer_pays_sends_every_channel_transaction_in_a_fee_bump_it_signs() -> anyhow::Result<()> {
    let db = crate::support::sqlite_live().await?;
    let chain = Chain::start(50).await?;
    let (pool, channels) = chain.pool_layer(2, &["deposit"])?;
    let pool = pool.replace("[pools.payouts]\n", "[pools.payouts]\nfee_payer = \"signer\"\n");
    let host = Host::start(db.queue.clone(), chain.config("bump_multiplier = 10.0", &pool)?).await?;
    host.sample_fees(db.queue.clone()).await?;
    let ids = host.enqueue(&deposits(3, 300, 4)).await?;
    settle(db.queue.as_ref(), Duration::from_secs(20)).await?;
    // Then a surge: the next one is stuck and bumped at the next bid.
    chain.fake.congest(500);
    let stuck = host.enqueue(&[vault_op("deposit", 7, 70, None)]).await?[0];
    settle(db.queue.as_ref(), Duration::from_secs(20)).await?;

    let (sent, landed) = (chain.fake.submitted(), chain.fake.landed());
    ensure!(landed.len() == 5, "each op landed once: {landed:?}");
    ensure!(
        sent.iter()
            .all(|t| t.inner_hash.is_some() && t.fee_source == chain.signer),
        "every envelope sent is a fee bump paid by the signer: {sent:?}"
    );
    ensure!(
        landed.iter().all(|t| channels.contains(&t.source) && t.nonce.is_some()),
        "the channels are the sources, the signer authorises: {landed:?}"
    );
    let paid = chain.fake.fees_paid();
    ensure!(
        paid.get(&chain.signer) == Some(&5) && channels.iter().all(|c| !paid.contains_key(c)),
        "the signer paid every fee, no channel any: {paid:?}"
    );
    for id in ids.iter().chain([&stuck]) {
        let op = db.queue.get(*id).await?.context("op")?;
        ensure!(op.status == Status::Confirmed, "{op:?}");
        let inner = sent
            .iter()
            .find(|t| t.inner_hash == op.receipt && matches!(t.state, TxState::Success { .. }))
            .with_context(|| format!("confirmed under the inner hash of what landed: {op:?}"))?;
        ensure!(op.lanes == [address(inner.source)], "{op:?}");
    }
    let stuck_sends: Vec<i64> = {
        let op = db.queue.get(stuck).await?.context("op")?;
        sent.iter()
            .filter(|t| t.inner_hash == op.receipt)
            .map(|t| t.inclusion_fee)
            .collect()
    };
    ensure!(
        stuck_sends.len() == 2 && stuck_sends[1] >= 10 * stuck_sends[0],
        "the stuck one: the signer's bump, then its bump at the next bid: {stuck_sends:?}"
    );
    ensure!(chain.fake.auth_failures() == 0 && chain.fake.concurrent_sends() == 0 && chain.fake.bad_seqs() == 0);
    host.running.stop().await
}

/// A channel whose transaction is in doubt (the network took it and
/// answered 504) holds it until reconciled; ops enqueued meanwhile are
/// dealt to the other channel instead of queueing behind it.
async fn new_ops_are_dealt_around_a_channel_held_by_a_receipt_in_doubt(db: TestDb) -> anyhow::Result<()> {
    let (chain, _, host) = two_channels_first_send_in_doubt(&db, 8).await?;
    let first = host.enqueue(&[vault_op("deposit", 1, 100, None)]).await?[0];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let held = loop {
        let op = db.queue.get(first).await?.context("op")?;
        if op.status == Status::Pending && op.receipt.is_some() {
            break op.lanes;
        }
        ensure!(tokio::time::Instant::now() < deadline, "never in doubt: {op:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let later = host.enqueue(&deposits(2, 200, 4)).await?;
    for id in &later {
        let op = db.queue.get(*id).await?.context("op")?;
        ensure!(op.lanes != held, "dealt behind the channel in doubt: {op:?}");
    }
    settle(db.queue.as_ref(), Duration::from_secs(60)).await?;
    for id in later.iter().chain([&first]) {
        let op = db.queue.get(*id).await?.context("op")?;
        ensure!(op.status == Status::Confirmed, "{op:?}");
    }
    ensure!(chain.fake.landed().len() == 5 && chain.fake.concurrent_sends() == 0);
    host.running.stop().await
}

/// Ops already dealt behind a channel whose transaction falls into doubt
/// (the network took it and answered 504; it lands only 40 ledgers later)
/// are re-dealt to the free channel and land from it while the doubt lasts.
async fn ops_dealt_behind_a_channel_that_falls_into_doubt_move_to_a_free_one(db: TestDb) -> anyhow::Result<()> {
    let (chain, channels, host) = two_channels_first_send_in_doubt(&db, 40).await?;
    let ids = host.enqueue(&deposits(4, 400, 6)).await?;
    let mut dealt = BTreeMap::new();
    for id in &ids {
        dealt.insert(*id, db.queue.get(*id).await?.context("op")?.lanes);
    }
    settle(db.queue.as_ref(), Duration::from_secs(60)).await?;
    let sent = chain.fake.submitted();
    let held = sent.first().context("nothing sent")?.source;
    let free = *channels.iter().find(|c| **c != held).context("the other channel")?;
    let landed = chain.fake.landed();
    ensure!(landed.len() == 6, "each op landed once: {landed:?}");
    let from_held = landed.iter().filter(|t| t.source == held).count();
    ensure!(
        from_held == 1,
        "only the transaction in doubt came from its channel ({from_held} did)"
    );
    let mut moved = 0;
    for id in &ids {
        let op = db.queue.get(*id).await?.context("op")?;
        ensure!(op.status == Status::Confirmed, "{op:?}");
        if dealt[id] == [address(held)] && op.lanes == [address(free)] {
            moved += 1;
        }
    }
    ensure!(moved == 2, "the two ops dealt behind it moved: {moved}");
    ensure!(chain.fake.concurrent_sends() == 0 && chain.fake.bad_seqs() == 0);
    host.running.stop().await
}

/// A host whose deposits come from a pool of two channels, 100 ms ledgers;
/// the first send is taken and answered 504, landing `apply_after` ledgers
/// later (its channel is held in doubt meanwhile).
async fn two_channels_first_send_in_doubt(
    db: &TestDb,
    apply_after: u32,
) -> anyhow::Result<(Chain, Vec<[u8; 32]>, Host)> {
    let chain = Chain::start(100).await?;
    let (pool, channels) = chain.pool_layer(2, &["deposit"])?;
    let host = Host::start(db.queue.clone(), chain.config("", &pool)?).await?;
    chain
        .fake
        .inject(&[super::fake_rpc::SendFault::AcceptThen504 { apply_after }]);
    Ok((chain, channels, host))
}

/// `n` deposits for user `user`, amounts from `from` on.
fn deposits(user: u8, from: i64, n: i64) -> Vec<laneway::queue::NewOp> {
    (0..n).map(|i| vault_op("deposit", user, from + i, None)).collect()
}
