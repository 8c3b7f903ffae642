//! The Stellar vault end to end: the real `stellar-vault` and `fee-policy`
//! plugins in the host, signing through the host signer, the fee oracle
//! feeding quotes, against the fake Stellar RPC (which checks every
//! signature, sequence, fee and bound).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use laneway::clock::SystemClock;
use laneway::config::Config;
use laneway::op::{OpId, Priority, Status};
use laneway::oracle::{FeeOracle, StellarRpc};
use laneway::queue::{prelude::*, Enqueued, NewOp};
use laneway::runtime::host::PluginHost;
use stellar_xdr::{Int128Parts, ScVal};

use super::fake_rpc::{address, keypair, FakeRpc, SendFault, TxState};
use crate::dispatch::harness::{settle, Running};
use crate::support::{with_own_pg_schema, TestDb};

/// Where the vault lives (any valid contract address does for the fake).
const CONTRACT: &str = "CAAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQC526";
const KINDS: [(&str, &str); 4] = [
    ("deposit", "deposit"),
    ("withdraw", "withdraw"),
    ("rebalance", "rebalance"),
    ("referral_payout", "pay_referral"),
];

pub struct Chain {
    pub fake: FakeRpc,
    pub url: String,
    pub signer: [u8; 32],
    _dir: tempfile::TempDir,
    key_file: PathBuf,
    closer: tokio::task::JoinHandle<()>,
}

impl Drop for Chain {
    fn drop(&mut self) {
        self.closer.abort();
    }
}

impl Chain {
    /// A fake network closing a ledger every `close_ms`, with a funded signer.
    pub async fn start(close_ms: u64) -> anyhow::Result<Self> {
        let fake = FakeRpc::default();
        let url = fake.serve().await?;
        // A signer of its own per chain: tests run at once on one
        // PostgreSQL database, and hosts of different tests sharing a lane
        // name contend for its advisory lock. With one signer for every
        // test, a claim refused by another test's host let the next payment
        // of the signer go first, as a serial lane allows (exclusion, not
        // order: GUARANTEES.md), and the tests that check sequences in op
        // order failed now and then.
        static NEXT_SIGNER: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(100);
        let seed = NEXT_SIGNER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (pem, signer) = keypair(seed)?;
        fake.fund(signer, 4_294_967_337);
        let dir = tempfile::tempdir()?;
        let key_file = dir.path().join("vault.pem");
        std::fs::write(&key_file, pem)?;
        let closer = fake.close_ledgers_every(Duration::from_millis(close_ms));
        Ok(Self {
            fake,
            url,
            signer,
            _dir: dir,
            key_file,
            closer,
        })
    }

    /// A laneway config serving the four kinds through the vault plugin,
    /// priced by an oracle on the fake; `policy` and `extra` are TOML.
    pub fn config(&self, policy: &str, extra: &str) -> anyhow::Result<Config> {
        let mut kinds = String::new();
        for (kind, function) in KINDS {
            kinds.push_str(&format!(
                "[kinds.{kind}]\nplugin = \"vault\"\nfee_oracle = \"stellar\"\nmax_fee_bumps = 3\n\
                 backoff_base_ms = 20\nbackoff_max_ms = 100\nretry_after_max_ms = 1000\ntimeout_ms = 20000\n\
                 [kinds.{kind}.config]\nrpc_url = {url:?}\nnetwork_passphrase = {passphrase:?}\n\
                 contract_id = {CONTRACT:?}\nfunction = {function:?}\nsigner_key = \"vault\"\npoll_ms = 20\n\
                 try_again_ms = 50\n\
                 args = [{{ field = \"user\", type = \"address\" }}, {{ field = \"amount\", type = \"i128\" }}]\n",
                url = self.url,
                passphrase = super::fake_rpc::TESTNET,
            ));
        }
        Ok(laneway::config::from_layers(&[
            "[queue]\nlease_ms = 3000\n[dispatch]\npoll_ms = 25\nslot_ttl_ms = 2000\nshutdown_grace_ms = 300\n",
            &format!(
                "[keys.vault]\nalgorithm = \"ed25519\"\nfile = {key:?}\n\
                 [plugins.vault]\npath = {vault:?}\nallowed_hosts = [\"http://127.0.0.1:*\"]\n\
                 allowed_internal = [\"127.0.0.1\"]\nkeys = [\"vault\"]\n\
                 [plugins.fees]\npath = {fees:?}\n\
                 [oracles.stellar]\npolicy = \"fees\"\nrpc_url = {url:?}\npoll_ms = 100\nfirst_sample_wait_ms = 0\n\
                 [oracles.stellar.config]\n{policy}\n",
                key = self.key_file.display().to_string(),
                vault = crate::runtime::wasm("stellar-vault")?.display().to_string(),
                fees = crate::runtime::wasm("fee-policy")?.display().to_string(),
                url = self.url,
            ),
            &kinds,
            extra,
        ])?)
    }
}

impl Chain {
    /// Funds `count` channel accounts (keys of their own, written beside
    /// the signer's), has every contract call require the signer's
    /// authorisation, and returns a config layer putting them in pool
    /// `payouts` for `kinds`, with their public keys.
    pub fn pool_layer(&self, count: usize, kinds: &[&str]) -> anyhow::Result<(String, Vec<[u8; 32]>)> {
        // Channels of their own per chain, like signers (see `start`).
        static NEXT_CHANNEL: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(140);
        let mut layer = String::new();
        let mut ids = Vec::new();
        let mut publics = Vec::new();
        for i in 0..count {
            let seed = NEXT_CHANNEL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            ensure!(seed < 250, "out of channel seeds");
            let (pem, public) = keypair(seed)?;
            self.fake.fund(public, i64::from(seed) << 32);
            let file = self.key_file.with_file_name(format!("chan-{i}.pem"));
            std::fs::write(&file, pem)?;
            layer.push_str(&format!(
                "[keys.chan-{i}]\nalgorithm = \"ed25519\"\nfile = {:?}\n",
                file.display().to_string()
            ));
            ids.push(format!("\"chan-{i}\""));
            publics.push(public);
        }
        for (_, function) in KINDS {
            self.fake.require_auth(function, self.signer);
        }
        layer.push_str(&format!(
            "[plugins.vault]\nkeys = [\"vault\", {ids}]\n[pools.payouts]\nchannels = [{ids}]\n",
            ids = ids.join(", ")
        ));
        for kind in kinds {
            layer.push_str(&format!("[kinds.{kind}]\npool = \"payouts\"\n"));
        }
        Ok((layer, publics))
    }

    /// A config layer giving every kind the fake's Horizon-compatible
    /// history source.
    pub fn history_layer(&self) -> String {
        KINDS
            .iter()
            .map(|(kind, _)| format!("[kinds.{kind}.config]\nhistory_url = \"{}history\"\n", self.url))
            .collect()
    }
}

/// Eight days of five-second ledgers: past the RPC's ~7-day retention.
const EIGHT_DAYS: u32 = 8 * 86_400 / 5;

/// A host: the plugins loaded, the dispatcher running with fee policies.
pub struct Host {
    pub plugins: Arc<PluginHost>,
    pub running: Running,
    pub config: Config,
}

impl Host {
    pub async fn start(queue: Arc<dyn Queue>, config: Config) -> anyhow::Result<Self> {
        let plugins = Arc::new(PluginHost::new(&config)?);
        plugins.apply(&config).await?;
        let running = Running::with(queue, plugins.registry(), Some(plugins.clone()), config.clone()).await?;
        Ok(Self {
            plugins,
            running,
            config,
        })
    }

    /// Polls the oracle once, storing a snapshot every host shares.
    pub async fn sample_fees(&self, queue: Arc<dyn Queue>) -> anyhow::Result<laneway::fees::FeeSnapshot> {
        let oracle = &self.config.oracles["stellar"];
        let fee_oracle = FeeOracle::new(
            "stellar",
            StellarRpc::new(
                &oracle.rpc_url,
                Duration::from_secs(5),
                laneway::config::oracle_egress("stellar", &oracle.rpc_url, &self.config.plugins),
            )?,
            self.plugins.clone(),
            &oracle.policy,
            oracle.config_json(),
            queue,
            Arc::new(SystemClock),
        );
        Ok(fee_oracle.poll_once().await?)
    }

    pub async fn enqueue(&self, ops: &[NewOp]) -> anyhow::Result<Vec<OpId>> {
        Ok(self
            .running
            .dispatcher
            .enqueue(ops)
            .await?
            .into_iter()
            .map(Enqueued::id)
            .collect())
    }
}

/// A vault op: `kind` for `user`, `amount` stroops, at the kind's shipped
/// default priority (withdraw critical, rebalance low, others normal)
/// unless `priority` says otherwise.
pub fn vault_op(kind: &str, user: u8, amount: i64, priority: Option<Priority>) -> NewOp {
    let shipped = match kind {
        "withdraw" => Priority::Critical,
        "rebalance" => Priority::Low,
        _ => Priority::Normal,
    };
    let mut op = NewOp::new(
        "vault",
        kind,
        serde_json::json!({ "user": address([user; 32]), "amount": amount.to_string() }).to_string(),
    );
    op.priority = priority.unwrap_or(shipped);
    op
}

/// Waits up to `within` until `done` holds; `what` names it in the failure.
async fn eventually(within: Duration, what: &str, mut done: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + within;
    while !done() {
        ensure!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// Waits (up to 20 s) until op `id` is confirmed.
pub(crate) async fn confirmed(queue: &dyn Queue, id: OpId) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let op = queue.get(id).await?.context("op")?;
        if op.status == Status::Confirmed {
            return Ok(());
        }
        ensure!(tokio::time::Instant::now() < deadline, "not confirmed: {op:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub(crate) fn amount_of(args: &[ScVal]) -> Option<i128> {
    args.iter().find_map(|a| match a {
        ScVal::I128(Int128Parts { hi, lo }) => Some((i128::from(*hi) << 64) | i128::from(*lo)),
        _ => None,
    })
}

crate::on_both_backends!(
    live:
    all_four_kinds_land_signed_and_serialized_per_signer,
    a_critical_withdrawal_overtakes_ten_thousand_queued_ops,
    a_lost_transaction_is_resubmitted_with_a_bumped_fee_only_after_its_ledger_bound,
    a_halted_subject_waits_without_using_attempts_and_completes_after_unhalt,
    congestion_defers_low_prices_critical_aggressively_and_never_exceeds_the_cap,
    two_hosts_on_one_queue_never_have_two_transactions_of_a_signer_in_flight,
    an_accepted_send_answered_504_holds_the_signer_until_it_lands,
    two_outboxes_sharing_a_signer_on_two_hosts_never_overlap,
    a_refused_kind_config_leaves_its_ops_waiting_until_it_is_fixed,
    priced_ops_wait_for_the_oracles_first_sample,
    a_failing_fee_policy_defers_its_ops_without_using_attempts,
    a_fee_policy_failing_again_and_again_is_tried_ever_more_rarely,
    a_confirmed_deposit_reaches_a_signed_webhook_verified_by_the_reference_library,
    a_producer_cannot_step_outside_the_signers_lane,
);

/// The vault plugin owns its kinds' lanes (the signer's account): lanes
/// that leave the signer out are refused at enqueue, lanes that include it
/// are kept, and an op written around laneway (plain SQL) is refused before
/// anything is sent, so one transaction per signer holds whoever writes.
async fn a_producer_cannot_step_outside_the_signers_lane(db: TestDb) -> anyhow::Result<()> {
    let chain = Chain::start(25).await?;
    let host = Host::start(db.queue.clone(), chain.config("", "")?).await?;
    let signer = address(chain.signer);
    let mut stray = vault_op("deposit", 1, 100, None);
    stray.lanes = vec!["user:1".into()];
    let refused = host.enqueue(&[stray]).await;
    ensure!(
        refused.as_ref().is_err_and(|e| e.to_string().contains("must include")),
        "{refused:?}"
    );
    let mut both = vault_op("deposit", 2, 100, None);
    both.lanes = vec!["user:2".into(), signer.clone()];
    let kept = host.enqueue(&[both]).await?[0];
    let mut around = vault_op("deposit", 3, 100, None);
    around.lanes = vec!["user:3".into()];
    // No lanes at all would be a lane of its own: outside the signer's.
    let laneless = vault_op("deposit", 4, 100, None);
    let bypasses: Vec<_> = db
        .queue
        .enqueue(&[around, laneless])
        .await?
        .into_iter()
        .map(Enqueued::id)
        .collect();
    host.running.dispatcher.trigger("vault");
    confirmed(db.queue.as_ref(), kept).await?;
    for bypass in bypasses {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let op = loop {
            let op = db.queue.get(bypass).await?.context("op")?;
            if op.status.is_terminal() {
                break op;
            }
            ensure!(tokio::time::Instant::now() < deadline, "never refused: {op:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        ensure!(
            op.status == Status::Failed
                && op
                    .last_error
                    .as_deref()
                    .is_some_and(|e| e.contains("refused before sending")),
            "{op:?}"
        );
    }
    one_at_a_time(&chain, 1)?;
    host.running.stop().await
}

/// An op claimed before the fee oracle's first sample waits for it (up to
/// `first_sample_wait_ms`) instead of going out at the policy's made-up
/// default fee, and uses no attempt meanwhile.
async fn priced_ops_wait_for_the_oracles_first_sample(db: TestDb) -> anyhow::Result<()> {
    let chain = Chain::start(25).await?;
    chain.fake.set_fees(100, 700, 900, 900, 50);
    let config = chain.config("", "[oracles.stellar]\nfirst_sample_wait_ms = 60000\n")?;
    let host = Host::start(db.queue.clone(), config).await?;
    let id = host.enqueue(&[vault_op("deposit", 1, 100, None)]).await?[0];
    tokio::time::sleep(Duration::from_millis(400)).await;
    let op = db.queue.get(id).await?.context("op")?;
    ensure!(op.status == Status::Pending && op.attempts == 0, "{op:?}");
    ensure!(chain.fake.submitted().is_empty());
    host.sample_fees(db.queue.clone()).await?;
    host.running.dispatcher.trigger("vault");
    confirmed(db.queue.as_ref(), id).await?;
    let fees: Vec<Option<i64>> = db.queue.attempts(id).await?.iter().map(|a| a.record.fee).collect();
    ensure!(fees == vec![Some(700)], "bid {fees:?}, the first sample's p70 is 700");
    host.running.stop().await
}

/// A host whose deposits are priced by the fuel hog (every quote fails,
/// its fuel spent), the kind's longest backoff `backoff_max_ms`, and one
/// deposit enqueued.
async fn priced_by_the_fuel_hog(db: &TestDb, backoff_max_ms: u64) -> anyhow::Result<(Chain, Host, OpId)> {
    let chain = Chain::start(25).await?;
    let hog = crate::runtime::wasm("fuel-hog")?.display().to_string();
    let extra =
        format!("[plugins.fees]\npath = {hog:?}\nfuel = 1000000\n[kinds.deposit]\nbackoff_max_ms = {backoff_max_ms}\n");
    let host = Host::start(db.queue.clone(), chain.config("", &extra)?).await?;
    host.sample_fees(db.queue.clone()).await?;
    let id = host.enqueue(&[vault_op("deposit", 1, 100, None)]).await?[0];
    Ok((chain, host, id))
}

/// A fee policy that fails every quote (the fuel hog spends its fuel)
/// leaves the op pending with no attempt used and nothing sent, deferred by
/// the kind's longest backoff rather than priced again on every pass.
async fn a_failing_fee_policy_defers_its_ops_without_using_attempts(db: TestDb) -> anyhow::Result<()> {
    let (chain, host, id) = priced_by_the_fuel_hog(&db, 5000).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let op = loop {
        let op = db.queue.get(id).await?.context("op")?;
        if op.next_attempt_at > op.created_at + chrono::Duration::seconds(4) {
            break op;
        }
        ensure!(tokio::time::Instant::now() < deadline, "never deferred: {op:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    ensure!(op.status == Status::Pending && op.attempts == 0, "{op:?}");
    ensure!(chain.fake.submitted().is_empty(), "sent at a made-up fee");
    host.running.stop().await
}

/// Each failure in a row doubles the op's wait before it is priced again
/// (from the kind's longest backoff): a broken policy behind a backlog is
/// not run for every pending op at a steady rate.
async fn a_fee_policy_failing_again_and_again_is_tried_ever_more_rarely(db: TestDb) -> anyhow::Result<()> {
    let (chain, host, id) = priced_by_the_fuel_hog(&db, 200).await?;
    // The op's successive deferrals: 200, 400, 800 ms after each failure.
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while seen.len() < 3 {
        let op = db.queue.get(id).await?.context("op")?;
        ensure!(op.status == Status::Pending && op.attempts == 0, "{op:?}");
        if op.next_attempt_at > op.created_at && seen.last() != Some(&op.next_attempt_at) {
            seen.push(op.next_attempt_at);
        }
        ensure!(tokio::time::Instant::now() < deadline, "deferred only at {seen:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let first = (seen[1] - seen[0]).num_milliseconds();
    let second = (seen[2] - seen[1]).num_milliseconds();
    // Without the doubling both gaps are the 200 ms backoff plus the
    // time to price again.
    ensure!(
        first >= 380 && second >= 780 && second > first + 250,
        "gaps between deferrals {first} ms then {second} ms: {seen:?}"
    );
    ensure!(chain.fake.submitted().is_empty(), "sent at a made-up fee");
    host.running.stop().await
}

/// A kind whose config its plugin refuses (a typo in `contract_id`) is not
/// activated: its ops wait without using an attempt and nothing is
/// dead-lettered, while other kinds run; once the config is fixed and
/// reloaded, they land.
async fn a_refused_kind_config_leaves_its_ops_waiting_until_it_is_fixed(db: TestDb) -> anyhow::Result<()> {
    let chain = Chain::start(25).await?;
    let broken = chain.config("", "[kinds.deposit.config]\ncontract_id = \"CBOGUS\"\n")?;
    let host = Host::start(db.queue.clone(), broken).await?;
    let refused = host.plugins.status().refused_kinds;
    ensure!(
        refused.len() == 1 && refused[0].starts_with("kinds.deposit.config.contract_id: "),
        "{refused:?}"
    );
    let mut deposit = vault_op("deposit", 1, 100, None);
    deposit.lanes = vec![address(chain.signer)];
    let deposit = host.enqueue(&[deposit]).await?[0];
    let withdraw = host.enqueue(&[vault_op("withdraw", 2, 100, None)]).await?[0];
    confirmed(db.queue.as_ref(), withdraw).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let op = db.queue.get(deposit).await?.context("op")?;
    ensure!(op.status == Status::Pending && op.attempts == 0, "{op:?}");
    let fixed = chain.config("", "")?;
    ensure!(host.plugins.apply(&fixed).await?.is_empty());
    host.running.dispatcher.reconfigure(fixed);
    host.running.dispatcher.trigger("vault");
    confirmed(db.queue.as_ref(), deposit).await?;
    one_at_a_time(&chain, 2)?;
    host.running.stop().await
}

/// What the fake saw of one signer, checked after every signer test: never
/// two of its transactions queued at once, never a sequence out of turn,
/// every op's transaction exactly once.
fn one_at_a_time(chain: &Chain, landed: usize) -> anyhow::Result<()> {
    ensure!(
        chain.fake.concurrent_sends() == 0,
        "a transaction of the signer was sent while another was still queued ({} times)",
        chain.fake.concurrent_sends()
    );
    ensure!(chain.fake.bad_seqs() == 0, "{} bad sequences", chain.fake.bad_seqs());
    let sent = chain.fake.submitted();
    ensure!(
        sent.len() == landed && chain.fake.landed().len() == landed,
        "{} sent and {} landed, expected {landed} of each: {sent:?}",
        sent.len(),
        chain.fake.landed().len()
    );
    Ok(())
}

/// The network accepts the first deposit's transaction but the RPC answers
/// 504, and applies it six ledgers later. The op's receipt is in doubt, so
/// it holds the signer's lane: the next two deposits are built only after
/// it lands, each with the next sequence, and every one lands once.
async fn an_accepted_send_answered_504_holds_the_signer_until_it_lands(db: TestDb) -> anyhow::Result<()> {
    let chain = Chain::start(40).await?;
    chain
        .fake
        .inject(&[super::fake_rpc::SendFault::AcceptThen504 { apply_after: 6 }]);
    let host = Host::start(db.queue.clone(), chain.config("", "")?).await?;
    let mut ids = Vec::new();
    for user in 1..=3u8 {
        ids.extend(host.enqueue(&[vault_op("deposit", user, 100, None)]).await?);
    }
    for id in &ids {
        confirmed(db.queue.as_ref(), *id).await?;
    }
    one_at_a_time(&chain, 3)?;
    // In op order, one sequence after another; the first is the one the 504 hid.
    let mut sequences = Vec::new();
    for id in &ids {
        let op = db.queue.get(*id).await?.context("op")?;
        let sent = chain.fake.submitted();
        let tx = sent
            .iter()
            .find(|t| Some(t.hash.as_str()) == op.receipt.as_deref())
            .with_context(|| format!("op {id}'s transaction"))?;
        sequences.push(tx.sequence);
    }
    ensure!(
        sequences.windows(2).all(|w| w[1] == w[0] + 1),
        "sequences out of op order: {sequences:?}"
    );
    let first = history(db.queue.as_ref(), ids[0]).await?;
    ensure!(first.len() == 2 && first[0].0 == "retryable", "{first:?}");
    // Both attempts paid for the one envelope: the second, which resent it
    // (and was quoted a bumped fee it never used), records what it carries.
    let op = db.queue.get(ids[0]).await?.context("op")?;
    let envelope_fee = chain
        .fake
        .submitted()
        .iter()
        .find(|t| Some(t.hash.as_str()) == op.receipt.as_deref())
        .map(|t| t.inclusion_fee)
        .context("the first op's transaction")?;
    let fees: Vec<Option<i64>> = db.queue.attempts(ids[0]).await?.iter().map(|a| a.record.fee).collect();
    ensure!(
        fees == vec![Some(envelope_fee), Some(envelope_fee)],
        "recorded fees {fees:?}, the envelope carries {envelope_fee}"
    );
    host.running.stop().await
}

/// A signer's lane is the signer's account, not a position in one outbox:
/// two outboxes whose ops sign with the same key, drained by two hosts on
/// one queue, still send one transaction at a time.
async fn two_outboxes_sharing_a_signer_on_two_hosts_never_overlap(db: TestDb) -> anyhow::Result<()> {
    let chain = Chain::start(25).await?;
    let config = chain.config("", "")?;
    let a = Host::start(db.queue.clone(), config.clone()).await?;
    let b = Host::start(db.queue.clone(), config).await?;
    let mut ids = Vec::new();
    for i in 0..20u8 {
        let mut op = vault_op("deposit", 1 + i, 100, None);
        op.outbox = if i % 2 == 0 { "vault-a" } else { "vault-b" }.to_owned();
        let host = if i % 3 == 0 { &a } else { &b };
        ids.extend(host.enqueue(&[op]).await?);
    }
    settle(db.queue.as_ref(), Duration::from_secs(60)).await?;
    for id in &ids {
        let op = db.queue.get(*id).await?.context("op")?;
        ensure!(op.status == Status::Confirmed, "{op:?}");
    }
    one_at_a_time(&chain, 20)?;
    a.running.stop().await?;
    b.running.stop().await
}

/// Host A is killed right after sending a deposit whose transaction stays
/// queued longer than the op's lease; a CRITICAL withdrawal of the same
/// signer is enqueued meanwhile. Host B recovers the deposit from its
/// expired lease and, since its receipt is in doubt, reconciles it (the
/// same envelope, answered DUPLICATE, waited for) before the withdrawal is
/// built: the withdrawal gets the next sequence, and nothing overlaps.
async fn a_recovered_receipt_goes_before_a_critical_op(url: String) -> anyhow::Result<()> {
    let chain = Chain::start(150).await?;
    // Lease 1 s, drain slot 2 s; the transaction is applied 30 ledgers
    // (4.5 s) after it is accepted, past both, well inside its ledger bound
    // (60 ledgers here).
    // The transaction waits 30 ledgers queued, so it is seen stuck and the
    // shipped policy's tenfold bid would replace it; bids doubling cannot
    // (under the replace rule no bump is sent), so the same envelope is
    // what lands, which is what this test follows.
    let config = chain.config(
        "bump_multiplier = 2.0",
        &format!("[database]\nurl = {url:?}\n[queue]\nlease_ms = 1000\n[kinds.deposit.config]\nledger_window = 60\n"),
    )?;
    chain
        .fake
        .inject(&[super::fake_rpc::SendFault::AcceptThenHangFor { apply_after: 30 }]);
    let (runtime_a, deposit) = doomed_host(config.clone(), vault_op("deposit", 9, 1_234, None))?;
    eventually(Duration::from_secs(20), "host A never sent its transaction", || {
        !chain.fake.submitted().is_empty()
    })
    .await?;
    runtime_a.shutdown_background();

    let queue = laneway::queue::open(&config.database, config.limits(), Arc::new(SystemClock)).await?;
    let host_b = Host::start(queue.clone(), config).await?;
    let withdraw = host_b.enqueue(&[vault_op("withdraw", 7, 50, None)]).await?[0];
    confirmed(queue.as_ref(), deposit).await?;
    confirmed(queue.as_ref(), withdraw).await?;
    one_at_a_time(&chain, 2)?;
    let sent = chain.fake.submitted();
    let (first, second) = (&sent[0], &sent[1]);
    let deposit_op = queue.get(deposit).await?.context("deposit")?;
    ensure!(
        deposit_op.receipt.as_deref() == Some(first.hash.as_str()) && second.sequence == first.sequence + 1,
        "the withdrawal did not follow the recovered deposit: {sent:?}"
    );
    let TxState::Success { ledger } = first.state else {
        anyhow::bail!("the deposit did not land: {first:?}");
    };
    ensure!(
        second.accepted_at_ledger >= ledger,
        "the withdrawal was sent (ledger {}) before the deposit landed (ledger {ledger})",
        second.accepted_at_ledger
    );
    let attempts = queue.attempts(deposit).await?;
    ensure!(
        attempts.first().map(|a| a.record.class) == Some(laneway::op::AttemptClass::LeaseExpired),
        "{attempts:?}"
    );
    host_b.running.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovered_receipt_goes_before_a_critical_op_sqlite() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    a_recovered_receipt_goes_before_a_critical_op(format!("sqlite://{}", dir.path().join("queue.db").display())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovered_receipt_goes_before_a_critical_op_postgres() -> anyhow::Result<()> {
    with_own_pg_schema(a_recovered_receipt_goes_before_a_critical_op).await
}

/// Seed 003 ran one dispatcher with an in-process signer lock. Here two
/// hosts share the queue (on PostgreSQL they could be two machines): the
/// drain slot and the signer's serial lane keep one transaction per signer
/// in flight across both, and every op lands once.
async fn two_hosts_on_one_queue_never_have_two_transactions_of_a_signer_in_flight(db: TestDb) -> anyhow::Result<()> {
    let chain = Chain::start(25).await?;
    let config = chain.config("", "")?;
    let a = Host::start(db.queue.clone(), config.clone()).await?;
    let b = Host::start(db.queue.clone(), config).await?;
    let mut ids = Vec::new();
    for i in 0..16 {
        let (kind, _) = KINDS[i % 4];
        let host = if i % 2 == 0 { &a } else { &b };
        ids.extend(
            host.enqueue(&[vault_op(kind, 1 + i as u8, 100 + i as i64, None)])
                .await?,
        );
    }
    settle(db.queue.as_ref(), Duration::from_secs(60)).await?;
    for id in &ids {
        let op = db.queue.get(*id).await?.context("op")?;
        ensure!(op.status == Status::Confirmed, "{op:?}");
    }
    ensure!(
        chain.fake.landed().len() == 16 && chain.fake.submitted().len() == 16,
        "{:?}",
        chain.fake.submitted()
    );
    ensure!(
        chain.fake.concurrent_sends() == 0,
        "two transactions of one signer were in flight"
    );
    ensure!(chain.fake.bad_seqs() == 0, "a bad sequence between hosts");
    a.running.stop().await?;
    b.running.stop().await
}

async fn all_four_kinds_land_signed_and_serialized_per_signer(db: TestDb) -> anyhow::Result<()> {
    let chain = Chain::start(40).await?;
    let host = Host::start(db.queue.clone(), chain.config("", "")?).await?;
    let mut ops = Vec::new();
    for round in 0..3 {
        for (i, (kind, _)) in KINDS.iter().enumerate() {
            ops.push(vault_op(kind, 1 + i as u8, 1_000 * (round + 1) + i as i64, None));
        }
    }
    let ids = host.enqueue(&ops).await?;
    settle(db.queue.as_ref(), Duration::from_secs(60)).await?;
    let landed = chain.fake.landed();
    ensure!(
        landed.len() == 12,
        "{} landed: {:?}",
        landed.len(),
        chain.fake.submitted()
    );
    for (id, op) in ids.iter().zip(&ops) {
        let stored = db.queue.get(*id).await?.context("op")?;
        ensure!(stored.status == Status::Confirmed, "{stored:?}");
        let receipt = stored.receipt.context("receipt")?;
        let tx = landed
            .iter()
            .find(|t| t.hash == receipt)
            .context("the receipt is a landed hash")?;
        let function = KINDS.iter().find(|(k, _)| *k == op.kind).map(|(_, f)| *f);
        ensure!(tx.function.as_deref() == function, "{op:?} → {tx:?}");
        let payload: serde_json::Value = serde_json::from_str(&op.payload)?;
        ensure!(
            amount_of(&tx.args).map(|a| a.to_string()) == payload["amount"].as_str().map(str::to_owned),
            "{tx:?}"
        );
        ensure!(
            stored.lanes == vec![address(chain.signer)],
            "the lane is the signer: {:?}",
            stored.lanes
        );
    }
    // One sequence after another, never two queued at once, never a bad
    // sequence: the lane serialized the signer across kinds and priorities.
    let mut sequences: Vec<i64> = landed.iter().map(|t| t.sequence).collect();
    sequences.sort_unstable();
    ensure!(
        sequences == (4_294_967_338..4_294_967_350).collect::<Vec<_>>(),
        "{sequences:?}"
    );
    ensure!(chain.fake.concurrent_sends() == 0, "two in flight for one signer");
    ensure!(chain.fake.bad_seqs() == 0, "a bad sequence on the normal path");
    ensure!(chain.fake.submitted().len() == 12, "no transaction was sent twice");
    host.running.stop().await
}

async fn a_critical_withdrawal_overtakes_ten_thousand_queued_ops(db: TestDb) -> anyhow::Result<()> {
    let chain = Chain::start(30).await?;
    let host = Host::start(db.queue.clone(), chain.config("", "")?).await?;
    let lane = address(chain.signer);
    let backlog: Vec<NewOp> = (0..10_000)
        .map(|i| {
            let (kind, priority) = if i % 2 == 0 {
                ("rebalance", Priority::Low)
            } else {
                ("deposit", Priority::Normal)
            };
            let mut op = vault_op(kind, 3, 1 + i, Some(priority));
            op.lanes = vec![lane.clone()];
            op
        })
        .collect();
    host.enqueue(&backlog).await?;
    // Let the backlog start moving, then a withdrawal arrives.
    eventually(Duration::from_secs(20), "the backlog never started", || {
        chain.fake.landed().len() >= 2
    })
    .await?;
    let sent_before = chain.fake.submitted().len();
    let withdraw = host.enqueue(&[vault_op("withdraw", 9, 777, None)]).await?[0];
    confirmed(db.queue.as_ref(), withdraw).await?;
    let sent = chain.fake.submitted();
    let position = sent
        .iter()
        .position(|t| t.function.as_deref() == Some("withdraw"))
        .context("withdrawal sent")?;
    // Only the op already in flight on the signer's lane (lane cap 1) and
    // the one a round already under way chose before it read the withdrawal
    // (a round settles an op and claims its lane's next in one transaction)
    // may go between the enqueue and the withdrawal.
    ensure!(
        position <= sent_before + 2,
        "withdrawal was transaction {position}, {sent_before} had been sent when it was enqueued"
    );
    host.running.stop().await
}

async fn a_lost_transaction_is_resubmitted_with_a_bumped_fee_only_after_its_ledger_bound(
    db: TestDb,
) -> anyhow::Result<()> {
    let chain = Chain::start(30).await?;
    // Without fee bumps of a transaction still valid (they keep its
    // sequence and cannot pay twice: `a_stuck_transaction_is_fee_bumped…`),
    // a new transaction waits for the lost one's ledger bound.
    let host = Host::start(
        db.queue.clone(),
        chain.config("", "[kinds.deposit.config]\nbump_after_ledgers = 0\n")?,
    )
    .await?;
    host.sample_fees(db.queue.clone()).await?;
    chain.fake.inject(&[SendFault::AcceptThenLose]);
    let id = host.enqueue(&[vault_op("deposit", 4, 5_000, None)]).await?[0];
    settle(db.queue.as_ref(), Duration::from_secs(30)).await?;
    let sent = chain.fake.submitted();
    ensure!(sent.len() == 2, "{sent:?}");
    let (lost, again) = (&sent[0], &sent[1]);
    ensure!(lost.state == TxState::Dropped, "{lost:?}");
    ensure!(matches!(again.state, TxState::Success { .. }), "{again:?}");
    ensure!(
        again.accepted_at_ledger + 1 >= lost.max_ledger,
        "resubmitted at ledger {} while the lost one could still land (max ledger {})",
        again.accepted_at_ledger,
        lost.max_ledger
    );
    ensure!(again.sequence == lost.sequence, "the lost one never used its sequence");
    ensure!(
        again.inclusion_fee > lost.inclusion_fee,
        "fee not bumped: {} then {}",
        lost.inclusion_fee,
        again.inclusion_fee
    );
    let op = db.queue.get(id).await?.context("op")?;
    ensure!(op.status == Status::Confirmed && op.fee_bumps == 1, "{op:?}");
    ensure!(op.receipt.as_deref() == Some(again.hash.as_str()), "{op:?}");
    let attempts = db.queue.attempts(id).await?;
    ensure!(attempts.len() == 2, "{attempts:?}");
    ensure!(
        attempts[0].record.fee == Some(lost.inclusion_fee) && attempts[1].record.fee == Some(again.inclusion_fee),
        "the attempts record the bids: {attempts:?}"
    );
    host.running.stop().await
}

async fn a_halted_subject_waits_without_using_attempts_and_completes_after_unhalt(db: TestDb) -> anyhow::Result<()> {
    let chain = Chain::start(30).await?;
    let host = Host::start(db.queue.clone(), chain.config("", "")?).await?;
    db.queue.halt_subject("user:frozen", Some("compliance review")).await?;
    let mut frozen = vault_op("withdraw", 5, 900, None);
    frozen.subject = Some("user:frozen".into());
    let mut other = vault_op("deposit", 6, 100, None);
    other.subject = Some("user:fine".into());
    let ids = host.enqueue(&[frozen, other]).await?;
    confirmed(db.queue.as_ref(), ids[1]).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waiting = db.queue.get(ids[0]).await?.context("op")?;
    ensure!(
        waiting.status == Status::Pending && waiting.attempts == 0,
        "a halted subject's op must wait unattempted: {waiting:?}"
    );
    ensure!(
        chain.fake.submitted().len() == 1,
        "nothing was sent for the halted subject"
    );
    db.queue.unhalt_subject("user:frozen").await?;
    settle(db.queue.as_ref(), Duration::from_secs(20)).await?;
    let done = db.queue.get(ids[0]).await?.context("op")?;
    ensure!(done.status == Status::Confirmed && done.attempts == 1, "{done:?}");
    host.running.stop().await
}

async fn congestion_defers_low_prices_critical_aggressively_and_never_exceeds_the_cap(
    db: TestDb,
) -> anyhow::Result<()> {
    let chain = Chain::start(30).await?;
    let policy = "dwell_ms = 0\nlow_defer_ms = 150\nlow_max_defer_ms = 1200\nmax_abs_fee = 3000\n";
    let host = Host::start(db.queue.clone(), chain.config(policy, "")?).await?;
    // Severe congestion: 100 → 2000 spread, full ledgers.
    chain.fake.set_fees(100, 900, 2_000, 2_000, 500);
    let snapshot = host.sample_fees(db.queue.clone()).await?;
    ensure!(
        snapshot.congestion >= laneway::fees::Congestion::High && snapshot.aggressive_base_fee == 2_000,
        "{snapshot:?}"
    );
    let estimate = host
        .running
        .dispatcher
        .estimate("rebalance", Priority::Low)
        .await?
        .context("priced")?;
    ensure!(
        estimate.deferred_ms > 0,
        "a LOW op is estimated as deferred: {estimate:?}"
    );
    let estimate = host
        .running
        .dispatcher
        .estimate("withdraw", Priority::Critical)
        .await?
        .context("priced")?;
    ensure!(
        estimate.base_fee == 2_000 && estimate.est_confirmation_seconds > 0,
        "{estimate:?}"
    );

    // The withdrawal's first send is refused for its fee: the retry bumps
    // 2000 × 2 = 4000, which the cap holds at 3000.
    chain.fake.inject(&[SendFault::InsufficientFee]);
    let started = tokio::time::Instant::now();
    let ids = host
        .enqueue(&[vault_op("rebalance", 7, 50, None), vault_op("withdraw", 8, 60, None)])
        .await?;
    let (rebalance, withdraw) = (ids[0], ids[1]);
    confirmed(db.queue.as_ref(), withdraw).await?;
    let low = db.queue.get(rebalance).await?.context("op")?;
    if started.elapsed() < Duration::from_millis(1_000) {
        ensure!(
            low.status == Status::Pending && low.attempts == 0,
            "LOW waits under congestion without using attempts: {low:?}"
        );
    }
    settle(db.queue.as_ref(), Duration::from_secs(20)).await?;
    ensure!(
        started.elapsed() >= Duration::from_millis(1_200),
        "the LOW op went before its max defer"
    );
    let low = db.queue.get(rebalance).await?.context("op")?;
    ensure!(
        low.status == Status::Confirmed && low.attempts == 1,
        "deferral used no attempts: {low:?}"
    );
    let attempts = db.queue.attempts(withdraw).await?;
    let bids: Vec<Option<i64>> = attempts.iter().map(|a| a.record.fee).collect();
    ensure!(
        bids == vec![Some(2_000), Some(3_000)],
        "aggressive, then bumped to the cap: {bids:?}"
    );
    for tx in chain.fake.submitted() {
        ensure!(tx.inclusion_fee <= 3_000, "the cap was exceeded: {tx:?}");
    }
    host.running.stop().await
}

/// Host A, killable mid-call (`support::doomed_host`): starts and enqueues
/// `op`.
fn doomed_host(config: Config, op: NewOp) -> anyhow::Result<(tokio::runtime::Runtime, OpId)> {
    crate::support::doomed_host(config, move |queue, config| async move {
        let host = Host::start(queue, config).await?;
        let id = host.enqueue(&[op]).await?[0];
        std::mem::forget(host);
        anyhow::Ok(id)
    })
}

/// A host killed between `sendTransaction` and the answer (its runtime is
/// dropped mid-call: no graceful shutdown, no settle, the lease just stays)
/// is replaced by another; the op's lease expires, the new host reconciles
/// the checkpointed hash, and the chain sees the transaction exactly once.
async fn killed_between_send_and_ack(url: String) -> anyhow::Result<()> {
    crate::support::init_logs();
    let chain = Chain::start(30).await?;
    let config = chain.config("", &format!("[database]\nurl = {url:?}\n[queue]\nlease_ms = 1000\n"))?;
    chain.fake.inject(&[super::fake_rpc::SendFault::AcceptThenHang]);

    let (runtime_a, id) = doomed_host(config.clone(), vault_op("withdraw", 9, 1_234, None))?;
    eventually(
        Duration::from_secs(20),
        "host A never got its transaction onto the chain",
        || !chain.fake.landed().is_empty(),
    )
    .await?;
    // Killed: the transaction landed, host A never heard.
    runtime_a.shutdown_background();

    let queue = laneway::queue::open(&config.database, config.limits(), Arc::new(SystemClock)).await?;
    let op = queue.get(id).await?.context("op")?;
    ensure!(op.status == Status::Submitted && op.receipt.is_some(), "{op:?}");
    let host_b = Host::start(queue.clone(), config).await?;
    settle(queue.as_ref(), Duration::from_secs(20)).await?;
    let op = queue.get(id).await?.context("op")?;
    let sent = chain.fake.submitted();
    ensure!(sent.len() == 1, "the chain saw {} transactions: {sent:?}", sent.len());
    ensure!(op.status == Status::Confirmed, "{op:?}");
    ensure!(op.receipt.as_deref() == Some(sent[0].hash.as_str()), "{op:?}");
    let attempts = queue.attempts(id).await?;
    ensure!(
        attempts.first().map(|a| a.record.class) == Some(laneway::op::AttemptClass::LeaseExpired),
        "{attempts:?}"
    );
    host_b.running.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_killed_between_send_and_ack_reconciles_by_hash_without_a_duplicate_sqlite() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    killed_between_send_and_ack(format!("sqlite://{}", dir.path().join("queue.db").display())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_killed_between_send_and_ack_reconciles_by_hash_without_a_duplicate_postgres() -> anyhow::Result<()> {
    with_own_pg_schema(killed_between_send_and_ack).await
}

/// What one op's attempts recorded: (class, detail) per attempt.
async fn history(queue: &dyn Queue, id: OpId) -> anyhow::Result<Vec<(String, Option<String>)>> {
    Ok(queue
        .attempts(id)
        .await?
        .into_iter()
        .map(|a| (a.record.class.as_str().to_owned(), a.record.detail))
        .collect())
}

/// Seed 003's error classes, one op at a time through the real plugin:
/// busy and rate-limited answers retry and resend the very same envelope;
/// a bad sequence rebuilds; NOT_FOUND before a late SUCCESS keeps waiting;
/// a trapped contract, a failed simulation and a wrong network dead-letter
/// with their message; a restore preamble restores first.
#[tokio::test]
async fn error_classes_retry_rebuild_or_dead_letter_as_seed_003_says() -> anyhow::Result<()> {
    let db = crate::support::sqlite_live().await?;
    let chain = Chain::start(30).await?;
    let wrong_network = format!(
        "[kinds.referral_payout]\nmax_attempts = 1\n[kinds.mainnet_deposit]\nplugin = \"vault\"\nlanes = \"required\"\nlane_mode = \"serial\"\n\
         [kinds.mainnet_deposit.config]\nrpc_url = {:?}\nnetwork_passphrase = \"Public Global Stellar Network ; September 2015\"\n\
         contract_id = {CONTRACT:?}\nfunction = \"deposit\"\nsigner_key = \"vault\"\npoll_ms = 20\n\
         args = [{{ field = \"user\", type = \"address\" }}, {{ field = \"amount\", type = \"i128\" }}]\n\
         [kinds.deposit.config]\nbump_after_ledgers = 0\n",
        chain.url
    );
    // (Fee bumps off: a NOT_FOUND lasting three 30 ms ledgers is what this
    // asks to be waited out, not bumped.)
    let host = Host::start(db.queue.clone(), chain.config("", &wrong_network)?).await?;
    let q = db.queue.as_ref();
    let run = |op: NewOp| {
        let host = &host;
        async move {
            let id = host.enqueue(&[op]).await?[0];
            settle(q, Duration::from_secs(20)).await?;
            anyhow::Ok((q.get(id).await?.context("op")?, history(q, id).await?))
        }
    };

    // Busy, rate-limited, gateway timeout: the same envelope goes again.
    chain
        .fake
        .inject(&[SendFault::TryAgainLater, SendFault::Http429, SendFault::Http504]);
    let (op, tried) = run(vault_op("deposit", 1, 10, None)).await?;
    ensure!(op.status == Status::Confirmed && tried.len() == 4, "{op:?} {tried:?}");
    ensure!(tried[0].1.as_deref() == Some("TRY_AGAIN_LATER"), "{tried:?}");
    ensure!(chain.fake.submitted().len() == 1, "one envelope, sent until it stuck");

    // A bad sequence: read it afresh and rebuild.
    chain.fake.inject(&[SendFault::BadSeq]);
    let (op, tried) = run(vault_op("deposit", 1, 11, None)).await?;
    ensure!(op.status == Status::Confirmed && tried.len() == 2, "{op:?} {tried:?}");
    ensure!(tried[0].1.as_deref() == Some("tx_bad_seq"), "{tried:?}");

    // NOT_FOUND for a while after landing: still one attempt.
    chain.fake.inject(&[SendFault::HideFor(3)]);
    let (op, tried) = run(vault_op("deposit", 1, 12, None)).await?;
    ensure!(op.status == Status::Confirmed && tried.len() == 1, "{op:?} {tried:?}");

    // The contract traps on chain: permanent, with the code kept.
    chain.fake.inject(&[SendFault::Trap]);
    let (op, tried) = run(vault_op("deposit", 1, 13, None)).await?;
    ensure!(op.status == Status::Failed && tried.len() == 1, "{op:?} {tried:?}");
    ensure!(
        op.last_error
            .as_deref()
            .is_some_and(|e| e.contains("invoke_host_function_trapped")),
        "{op:?}"
    );

    // Simulation refuses the call: permanent, with the host error kept.
    chain.fake.fail_simulation();
    let (op, _) = run(vault_op("deposit", 1, 14, None)).await?;
    ensure!(
        op.status == Status::Failed
            && op
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("simulation failed") && e.contains("HostError")),
        "{op:?}"
    );

    // Archived state: a RestoreFootprint transaction first, then the call.
    chain.fake.need_restore();
    let before = chain.fake.submitted().len();
    let (op, tried) = run(vault_op("deposit", 1, 15, None)).await?;
    let sent = chain.fake.submitted();
    ensure!(op.status == Status::Confirmed && tried.len() == 2, "{op:?} {tried:?}");
    ensure!(
        sent.len() == before + 2
            && sent[before].function.is_none()
            && sent[before + 1].function.as_deref() == Some("deposit"),
        "restore, then deposit: {:?}",
        &sent[before..]
    );

    // The budget runs out with the outcome unknown (the gateway timed out
    // after the receipt was checkpointed): the op is not dead-lettered
    // blind, it goes back to be reconciled, and lands.
    chain.fake.inject(&[SendFault::Http504]);
    let (op, tried) = run(vault_op("referral_payout", 1, 17, None)).await?;
    ensure!(
        op.status == Status::Confirmed && tried.len() == 2,
        "max_attempts = 1, yet reconciled: {op:?} {tried:?}"
    );

    // Signed for another network: the signature cannot verify here.
    let (op, _) = run(vault_op("mainnet_deposit", 1, 16, None)).await?;
    ensure!(
        op.status == Status::Failed && op.last_error.as_deref().is_some_and(|e| e.contains("tx_bad_auth")),
        "{op:?}"
    );
    ensure!(chain.fake.bad_seqs() == 0 && chain.fake.concurrent_sends() == 0);
    host.running.stop().await
}

/// The shipped example is a valid config, and the shipped defaults carry
/// seed 003's priorities and caps for the four kinds.
#[test]
fn the_shipped_stellar_config_is_valid_and_follows_seed_003() -> anyhow::Result<()> {
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/stellar-vault.example.toml"),
    )?;
    let config = laneway::config::from_toml_str(&text)?;
    for (kind, priority) in [
        ("withdraw", Priority::Critical),
        ("deposit", Priority::Normal),
        ("referral_payout", Priority::Normal),
        ("rebalance", Priority::Low),
    ] {
        let k = config.kind(kind).map_err(anyhow::Error::msg)?;
        ensure!(k.priority == priority, "{kind}: {:?}", k.priority);
        ensure!(
            k.lane_mode == laneway::lanes::LaneMode::Serial && k.lane_cap == 1,
            "{kind}: serial, one per signer"
        );
        ensure!(
            k.max_in_flight == Some(10) && k.max_fee_bumps == Some(3),
            "{kind}: {k:?}"
        );
        ensure!(k.fee_oracle.as_deref() == Some("stellar") && k.plugin.as_deref() == Some("vault"));
    }
    ensure!(config.dispatch.outbox_max_in_flight == 10, "seed 003's global cap");
    Ok(())
}

/// A transaction that keeps getting lost is resubmitted with a bigger fee
/// each time, and after `max_fee_bumps` (3) bumps the op is dead-lettered
/// with every attempt and the fee it bid on record (seed 003's bump cap).
/// The fourth bump, asked for past the cap, is counted but not granted: its
/// attempt only reconciles the last transaction, and the op is given up
/// because that one provably did not land. (Fee bumps of a transaction
/// still queued are off here: each one is lost and waits out its bounds.)
#[tokio::test]
async fn after_the_fee_bump_cap_the_op_fails_with_its_whole_history() -> anyhow::Result<()> {
    let db = crate::support::sqlite_live().await?;
    let chain = Chain::start(20).await?;
    let host = Host::start(
        db.queue.clone(),
        chain.config("", "[kinds.deposit.config]\nbump_after_ledgers = 0\n")?,
    )
    .await?;
    host.sample_fees(db.queue.clone()).await?;
    chain.fake.inject(&[SendFault::AcceptThenLose; 4]);
    let id = host.enqueue(&[vault_op("deposit", 2, 42, None)]).await?[0];
    settle(db.queue.as_ref(), Duration::from_secs(30)).await?;
    let op = db.queue.get(id).await?.context("op")?;
    ensure!(
        op.status == Status::Failed && op.fee_bumps == 4,
        "dead-lettered at the cap, one bump past it asked for: {op:?}"
    );
    ensure!(
        op.last_error.as_deref().is_some_and(|e| {
            e.contains("fee-bump cap reached after 3 bumps") && e.contains("provably did not land")
        }),
        "{op:?}"
    );
    let bids: Vec<Option<i64>> = db.queue.attempts(id).await?.iter().map(|a| a.record.fee).collect();
    ensure!(
        bids.len() == 5 && bids[..4] == [Some(100), Some(1_000), Some(10_000), Some(100_000)],
        "every attempt, each bid tenfold (the shipped policy) up to the cap, then one that only reconciled: {bids:?}"
    );
    let sent = chain.fake.submitted();
    ensure!(sent.len() == 4 && chain.fake.landed().is_empty(), "{sent:?}");
    host.running.stop().await
}

/// One deposit, priced by the oracle (`policy`), sent while the network
/// includes only bids of 500 and up (the oracle quotes 100).
async fn one_deposit_in_a_surge(policy: &str, extra: &str) -> anyhow::Result<(TestDb, Chain, Host, OpId)> {
    let db = crate::support::sqlite_live().await?;
    let chain = Chain::start(50).await?;
    let host = Host::start(db.queue.clone(), chain.config(policy, extra)?).await?;
    host.sample_fees(db.queue.clone()).await?;
    chain.fake.congest(500);
    let id = host.enqueue(&[vault_op("deposit", 7, 70, None)]).await?[0];
    Ok((db, chain, host, id))
}

/// A transaction valid but not included (surge pricing: the network takes
/// only bids of 500 and up) is fee-bumped after `bump_after_ledgers` (3)
/// ledgers at the next attempt's bid, which replaces the queued transaction
/// (ten times its bid, replace-by-fee) and lands once, same sequence; the op
/// is confirmed under the inner hash with the bump's hash in its detail.
#[tokio::test]
async fn a_stuck_transaction_is_fee_bumped_and_lands_once_under_its_inner_hash() -> anyhow::Result<()> {
    // The shipped policy: no multiplier set (it used to take 10 here, and
    // the shipped 2 never reached the replace rule).
    let (db, chain, host, id) = one_deposit_in_a_surge("", "").await?;
    settle(db.queue.as_ref(), Duration::from_secs(20)).await?;
    let (_, sent, landed) = bumped_once(db.queue.as_ref(), &chain, id).await?;
    ensure!(
        sent[0].state == TxState::Dropped,
        "the queued original replaced: {sent:?}"
    );
    let attempts = history(db.queue.as_ref(), id).await?;
    ensure!(
        attempts
            .last()
            .and_then(|(_, d)| d.as_deref())
            .is_some_and(|d| d.contains(&format!("fee-bumped as {}", landed[0].hash))),
        "{attempts:?}"
    );
    let bids: Vec<Option<i64>> = db.queue.attempts(id).await?.iter().map(|a| a.record.fee).collect();
    ensure!(bids == vec![Some(100), Some(1000)], "{bids:?}");
    ensure!(chain.fake.concurrent_sends() == 0 && chain.fake.bad_seqs() == 0);
    host.running.stop().await
}

/// Op `id` confirmed under its transaction's (inner) hash after one fee
/// bump of it landed: the op, what was sent, what landed.
pub(crate) async fn bumped_once(
    queue: &dyn Queue,
    chain: &Chain,
    id: OpId,
) -> anyhow::Result<(
    laneway::op::Op,
    Vec<super::fake_rpc::Submitted>,
    Vec<super::fake_rpc::Submitted>,
)> {
    let op = queue.get(id).await?.context("op")?;
    let (sent, landed) = (chain.fake.submitted(), chain.fake.landed());
    ensure!(op.status == Status::Confirmed, "{op:?}");
    ensure!(
        sent.len() == 2 && landed.len() == 1 && landed[0].inner_hash.as_deref() == Some(sent[0].hash.as_str()),
        "the transaction, then its fee bump, which landed: {sent:?}"
    );
    ensure!(
        op.receipt.as_deref() == Some(sent[0].hash.as_str()),
        "confirmed under the inner hash: {op:?}"
    );
    Ok((op, sent, landed))
}

/// Without fee bumps, a surge is outbid the old way: the transaction waits
/// out its bounds unincluded (the network drops it then: found by an
/// operator run, where the fake kept it queued for ever and every rebuilt
/// transaction met it as a second one of the signer's), and each rebuild
/// bids the next price until one clears the surge.
#[tokio::test]
async fn under_a_surge_an_expired_transaction_is_dropped_and_a_rebuild_outbids_it() -> anyhow::Result<()> {
    let (db, chain, host, id) = one_deposit_in_a_surge("", "[kinds.deposit.config]\nbump_after_ledgers = 0\n").await?;
    settle(db.queue.as_ref(), Duration::from_secs(20)).await?;
    let op = db.queue.get(id).await?.context("op")?;
    let (sent, landed) = (chain.fake.submitted(), chain.fake.landed());
    ensure!(op.status == Status::Confirmed, "{op:?}");
    let bids: Vec<i64> = sent.iter().map(|t| t.inclusion_fee).collect();
    // A loaded machine may skip a price step (seen in CI: 100, 400, 800);
    // each bid is still higher than the last, and the first over the surge
    // (500) is the one that lands.
    let under = &bids[..bids.len().saturating_sub(1)];
    ensure!(
        bids.first() == Some(&100)
            && bids.windows(2).all(|w| w[1] > w[0])
            && under.iter().all(|&b| b < 500)
            && landed.len() == 1
            && Some(&landed[0].inclusion_fee) == bids.last()
            && landed[0].inclusion_fee >= 500,
        "each rebuild bid more, the one over the surge landed: {bids:?}"
    );
    // Every bid before the one that landed was dropped at its bound.
    ensure!(
        sent[..sent.len() - 1].iter().all(|t| t.state == TxState::Dropped),
        "{sent:?}"
    );
    ensure!(chain.fake.concurrent_sends() == 0 && chain.fake.bad_seqs() == 0);
    host.running.stop().await
}

/// A fee bump under replace-by-fee's tenfold (a policy doubling its bids:
/// 200, 400, 800 against a queued 100) is not sent (the network would
/// refuse it), and the transaction stays queued and valid. At the bump cap the op is not given up while that
/// transaction may still land: its receipt is reconciled, and when the
/// surge passes it lands, once, and the op is confirmed (it used to be
/// dead-lettered at the cap with its transaction still queued).
#[tokio::test]
async fn at_the_bump_cap_a_transaction_still_queued_is_awaited_not_given_up() -> anyhow::Result<()> {
    let (db, chain, host, id) =
        one_deposit_in_a_surge("bump_multiplier = 2.0", "[kinds.deposit.config]\nledger_window = 60\n").await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let op = db.queue.get(id).await?.context("op")?;
        ensure!(!op.status.is_terminal(), "given up with its transaction queued: {op:?}");
        if op.fee_bumps > 3 {
            break;
        }
        ensure!(tokio::time::Instant::now() < deadline, "never reached the cap: {op:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    chain.fake.congest(0);
    settle(db.queue.as_ref(), Duration::from_secs(20)).await?;
    let op = db.queue.get(id).await?.context("op")?;
    let (sent, landed) = (chain.fake.submitted(), chain.fake.landed());
    ensure!(
        op.status == Status::Confirmed && op.receipt.as_deref() == Some(sent[0].hash.as_str()),
        "{op:?}"
    );
    ensure!(
        sent.len() == 1 && landed.len() == 1,
        "every bump refused, the original landed: {sent:?}"
    );
    ensure!(chain.fake.concurrent_sends() == 0 && chain.fake.bad_seqs() == 0);
    host.running.stop().await
}

/// NOT_FOUND proves a transaction never landed only while the RPC still
/// remembers every ledger it could have landed in. Past that window the
/// signer's sequence decides: unused, the op is rebuilt and lands; used
/// (the transaction may have landed long ago), the op is dead-lettered for
/// an operator, and nothing is sent twice.
#[tokio::test]
async fn past_the_rpc_retention_window_the_sequence_decides_and_nothing_is_paid_twice() -> anyhow::Result<()> {
    let db = crate::support::sqlite_live().await?;
    let chain = Chain::start(20).await?;
    let host = Host::start(db.queue.clone(), chain.config("", "")?).await?;
    // Landed, but the server forgets it before the host hears: unknown.
    chain.fake.inject(&[SendFault::HideFor(u32::MAX)]);
    let id = host.enqueue(&[vault_op("deposit", 3, 30, None)]).await?[0];
    eventually(Duration::from_secs(10), "nothing sent", || {
        !chain.fake.submitted().is_empty()
    })
    .await?;
    // The server's window moves past everything sent so far.
    chain.fake.forget_before(chain.fake.latest_ledger() + 10_000);
    settle(db.queue.as_ref(), Duration::from_secs(20)).await?;
    let op = db.queue.get(id).await?.context("op")?;
    ensure!(
        op.status == Status::Failed && op.last_error.as_deref().is_some_and(|e| e.contains("outcome unknown")),
        "{op:?}"
    );
    ensure!(
        chain.fake.submitted().len() == 1 && chain.fake.landed().len() == 1,
        "sent once, landed once"
    );
    host.running.stop().await
}

/// Past the RPC's retention a used sequence no longer ends the story when
/// the kind names a history source: the transaction landed eight days ago
/// (the host never heard, and the RPC has forgotten it), the source has it,
/// and the op is confirmed with that hash, paid once.
#[tokio::test]
async fn a_transaction_older_than_the_rpc_retention_is_confirmed_from_the_history_source() -> anyhow::Result<()> {
    let db = crate::support::sqlite_live().await?;
    let chain = Chain::start(50).await?;
    let host = Host::start(db.queue.clone(), chain.config("", &chain.history_layer())?).await?;
    chain.fake.inject(&[SendFault::HideFor(u32::MAX)]);
    let id = host.enqueue(&[vault_op("deposit", 5, 50, None)]).await?[0];
    eventually(Duration::from_secs(10), "nothing landed", || {
        !chain.fake.landed().is_empty()
    })
    .await?;
    chain.fake.skip_ledgers(EIGHT_DAYS);
    settle(db.queue.as_ref(), Duration::from_secs(20)).await?;
    let op = db.queue.get(id).await?.context("op")?;
    let landed = chain.fake.landed();
    ensure!(
        op.status == Status::Confirmed && op.receipt.as_deref() == landed.first().map(|t| t.hash.as_str()),
        "{op:?}"
    );
    let attempts = history(db.queue.as_ref(), id).await?;
    ensure!(
        attempts
            .last()
            .and_then(|(_, detail)| detail.as_deref())
            .is_some_and(|d| d.contains("from the history source")),
        "{attempts:?}"
    );
    ensure!(
        chain.fake.submitted().len() == 1 && landed.len() == 1,
        "sent once, landed once"
    );
    host.running.stop().await
}

/// The other side of the history source: a transaction past its bounds that
/// never landed, while its sequence was used by another transaction of the
/// account. The RPC has forgotten that range, so only the history source can
/// tell: missing from a history that has every ledger it could have landed
/// in, it provably never landed, and the op is built afresh and lands once.
/// When the source's history starts after those ledgers it cannot say either,
/// and the op is dead-lettered as outcome unknown, naming the gap.
#[tokio::test]
async fn a_history_source_that_saw_every_ledger_proves_a_transaction_never_landed() -> anyhow::Result<()> {
    for complete in [true, false] {
        let db = crate::support::sqlite_live().await?;
        let chain = Chain::start(50).await?;
        let host = Host::start(db.queue.clone(), chain.config("", &chain.history_layer())?).await?;
        let before = chain.fake.sequence(chain.signer).context("funded")?;
        chain.fake.inject(&[SendFault::AcceptThenLose]);
        let id = host.enqueue(&[vault_op("deposit", 6, 60, None)]).await?[0];
        eventually(Duration::from_secs(10), "nothing sent", || {
            !chain.fake.submitted().is_empty()
        })
        .await?;
        // Someone else's transaction takes the sequence; then eight days pass.
        chain.fake.fund(chain.signer, before + 1);
        chain.fake.skip_ledgers(EIGHT_DAYS);
        if !complete {
            chain.fake.history_forget_before(chain.fake.latest_ledger() - 10);
        }
        settle(db.queue.as_ref(), Duration::from_secs(20)).await?;
        let op = db.queue.get(id).await?.context("op")?;
        let (sent, landed) = (chain.fake.submitted(), chain.fake.landed());
        if complete {
            ensure!(op.status == Status::Confirmed, "{op:?}");
            ensure!(
                sent.len() == 2 && landed.len() == 1 && landed[0].sequence == before + 2,
                "built afresh on the next sequence and landed once: {sent:?}"
            );
        } else {
            ensure!(
                op.status == Status::Failed
                    && op
                        .last_error
                        .as_deref()
                        .is_some_and(|e| e.contains("outcome unknown") && e.contains("has ingested only ledgers")),
                "{op:?}"
            );
            ensure!(sent.len() == 1 && landed.is_empty(), "nothing sent again: {sent:?}");
        }
        host.running.stop().await?;
    }
    Ok(())
}

/// An RPC that contradicts itself: the transaction landed (the signer's
/// sequence moved) but `getTransaction` answers NOT_FOUND past its bounds,
/// while the server claims to remember every ledger. (The fault harness's
/// fake once did exactly this for a resent copy, and the op was paid twice.)
/// The op is dead-lettered as outcome unknown; nothing is built afresh.
#[tokio::test]
async fn a_used_sequence_outweighs_a_not_found_inside_the_retention_window() -> anyhow::Result<()> {
    let db = crate::support::sqlite_live().await?;
    let chain = Chain::start(20).await?;
    let host = Host::start(db.queue.clone(), chain.config("", "")?).await?;
    chain.fake.inject(&[SendFault::HideFor(u32::MAX)]);
    let id = host.enqueue(&[vault_op("deposit", 4, 40, None)]).await?[0];
    settle(db.queue.as_ref(), Duration::from_secs(30)).await?;
    let op = db.queue.get(id).await?.context("op")?;
    ensure!(
        op.status == Status::Failed
            && op
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("outcome unknown") && e.contains("sequence")),
        "{op:?}"
    );
    ensure!(
        chain.fake.submitted().len() == 1 && chain.fake.landed().len() == 1,
        "sent once, landed once: {:?}",
        chain.fake.submitted()
    );
    host.running.stop().await
}

/// The Standard Webhooks reference receiver (`tests/tools/webhook_receiver.py`)
/// as a process: its port and the file it records requests in.
pub(crate) struct Receiver {
    child: std::process::Child,
    pub(crate) port: u16,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Receiver {
    pub(crate) fn start(secret: &str) -> anyhow::Result<Self> {
        Self::start_failing(secret, 0)
    }

    /// A receiver that answers its first `fail_first` requests 503.
    pub(crate) fn start_failing(secret: &str, fail_first: u32) -> anyhow::Result<Self> {
        use std::io::BufRead as _;
        let dir = tempfile::tempdir()?;
        let log = dir.path().join("requests.jsonl");
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tools/webhook_receiver.py");
        let mut child = std::process::Command::new("python3")
            .arg(script)
            .arg(secret)
            .arg(&log)
            .arg(fail_first.to_string())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .context("python3 for the webhook receiver")?;
        let stdout = child.stdout.take().context("its stdout")?;
        let mut line = String::new();
        std::io::BufReader::new(stdout).read_line(&mut line)?;
        let port = line.trim().parse().with_context(|| {
            format!("the receiver did not start (is the standardwebhooks package installed? ./dev test installs it): {line:?}")
        })?;
        Ok(Self {
            child,
            port,
            log,
            _dir: dir,
        })
    }

    pub(crate) fn requests(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

/// A deposit's confirmation reaches the producer's webhook, signed so that
/// the Standard Webhooks reference implementation accepts it, with the
/// transaction hash as the receipt; the op itself is in the outcome feed.
async fn a_confirmed_deposit_reaches_a_signed_webhook_verified_by_the_reference_library(
    db: TestDb,
) -> anyhow::Result<()> {
    use base64::Engine as _;
    let secret = format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode([7u8; 32]));
    let receiver = Receiver::start(&secret)?;
    let dir = tempfile::tempdir()?;
    let key_file = dir.path().join("hooks.secret");
    std::fs::write(&key_file, &secret)?;
    let chain = Chain::start(25).await?;
    let config = chain.config(
        "",
        &format!(
            "[keys.hooks]\nalgorithm = \"hmac-sha256\"\nfile = {:?}\n\
             [outcomes]\nallowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1\"]\nrelay_every_ms = 20\n\
             [kinds.deposit]\noutcome_webhook = \"http://127.0.0.1:{}/hooks/laneway\"\noutcome_webhook_key = \"hooks\"\n",
            key_file.display().to_string(),
            receiver.port
        ),
    )?;
    let host = Host::start(db.queue.clone(), config.clone()).await?;
    host.sample_fees(db.queue.clone()).await?;
    // On PostgreSQL a listener hears the confirmation too.
    let mut listener = match &db.kind {
        crate::support::TestBackend::Postgres(q) => {
            let mut l = sqlx::postgres::PgListener::connect_with(q.pool()).await?;
            l.listen("laneway_outcomes").await?;
            Some(l)
        }
        crate::support::TestBackend::Sqlite(_) => None,
    };
    let id = host.enqueue(&[vault_op("deposit", 3, 5_000, None)]).await?[0];
    confirmed(db.queue.as_ref(), id).await?;
    let hash = db.queue.get(id).await?.and_then(|o| o.receipt).context("a receipt")?;
    if let Some(listener) = listener.as_mut() {
        // The channel is the database's: tests running beside this one, on
        // schemas of their own, notify on it too.
        let want = format!("{id} confirmed");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let note = tokio::time::timeout_at(deadline, listener.recv())
                .await
                .with_context(|| format!("no NOTIFY {want:?} within 5 s"))??;
            if note.payload() == want {
                break;
            }
        }
    }
    // The relay, as `laneway run` runs it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while receiver.requests().is_empty() {
        laneway::webhook::relay_once(db.queue.as_ref(), &host.running.dispatcher, &config, "host-a").await?;
        ensure!(tokio::time::Instant::now() < deadline, "no webhook arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let requests = receiver.requests();
    ensure!(requests.len() == 1, "one webhook: {requests:?}");
    let hook = &requests[0];
    ensure!(
        hook["ok"] == true,
        "the reference library refused the signature: {hook}"
    );
    let payload = &hook["payload"];
    ensure!(payload["type"] == "op.confirmed", "{payload}");
    ensure!(
        payload["data"]["op"]["id"] == id && payload["data"]["op"]["receipt"] == hash.as_str(),
        "the op and its transaction hash: {payload}"
    );
    ensure!(
        payload["data"]["op"]["kind"] == "deposit" && payload["data"]["final_attempt"]["class"] == "confirmed",
        "{payload}"
    );
    // The webhook was an op of its own, confirmed, in its own outbox and lane.
    // The receiver answers before the dispatcher records the answer, so the
    // op is confirmed a moment after the request arrived.
    let filter = laneway::queue::OpFilter {
        kind: Some("outcome_webhook".to_owned()),
        limit: 10,
        ..Default::default()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut hooks = db.queue.list(&filter).await?;
    while hooks.iter().any(|h| h.status == Status::Submitted) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
        hooks = db.queue.list(&filter).await?;
    }
    ensure!(
        hooks.len() == 1
            && hooks[0].status == Status::Confirmed
            && hooks[0].outbox == "outcomes:vault"
            && hooks[0].lanes == vec![format!("outcome:{id}")],
        "{hooks:?}"
    );
    // A second relay pass sends nothing again.
    laneway::webhook::relay_once(db.queue.as_ref(), &host.running.dispatcher, &config, "host-a").await?;
    settle(db.queue.as_ref(), Duration::from_secs(10)).await?;
    ensure!(receiver.requests().len() == 1, "sent twice: {:?}", receiver.requests());
    // The receiver is no rubber stamp: a forged signature is refused.
    let forged = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{}/hooks/laneway", receiver.port))
        .header("webhook-id", "msg_forged")
        .header("webhook-timestamp", chrono::Utc::now().timestamp().to_string())
        .header("webhook-signature", "v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=")
        .body("{}")
        .send()
        .await?;
    ensure!(forged.status().as_u16() == 400);
    ensure!(receiver.requests().last().is_some_and(|r| r["ok"] == false));
    // And the outcome is in the feed.
    let feed = crate::lifecycle::feed_until(db.queue.as_ref(), None, 2).await?;
    ensure!(
        feed.iter().any(|e| e.op.id == id && e.status == Status::Confirmed),
        "{feed:?}"
    );
    host.running.stop().await
}
