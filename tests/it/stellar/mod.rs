//! Stellar: the fee oracle and the vault executor against a fake Stellar
//! RPC that speaks the documented JSON-RPC shapes and checks transactions
//! like the network does, through the real plugins.

mod cadence;
mod channels;
mod conformance;
pub(crate) mod vault;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use laneway::clock::SystemClock;
use laneway::fees::Congestion;
use laneway::oracle::{FeeOracle, StellarRpc};
use laneway::runtime::host::PluginHost;

use crate::support::TestDb;
use laneway::demo::fake_rpc::{self, FakeRpc};

crate::on_both_backends!(live: the_oracle_polls_fee_stats_and_stores_a_shared_snapshot, a_running_oracle_takes_reloaded_policy_settings_at_its_next_sample);

/// A fake RPC and an oracle named `name` on it, folding samples through the
/// real fee-policy plugin with `settings`.
async fn oracle_on_fake(db: &TestDb, name: &str, settings: &str) -> anyhow::Result<(FakeRpc, FeeOracle)> {
    let rpc = FakeRpc::default();
    let url = rpc.serve().await?;
    let config = laneway::config::from_toml_str(&format!(
        "[plugins.fees]\npath = {:?}\n",
        crate::runtime::wasm("fee-policy")?.display().to_string()
    ))?;
    let host = Arc::new(PluginHost::new(&config)?);
    host.apply(&config).await?;
    host.fee_policy("fees").context("fee policy loaded")?;
    let oracle = FeeOracle::new(
        name,
        StellarRpc::new(&url, Duration::from_secs(5), loopback_egress(&url)?)?,
        host,
        "fees",
        settings.to_owned(),
        db.queue.clone(),
        Arc::new(SystemClock),
    );
    Ok((rpc, oracle))
}

async fn the_oracle_polls_fee_stats_and_stores_a_shared_snapshot(db: TestDb) -> anyhow::Result<()> {
    let (rpc, oracle) = oracle_on_fake(&db, "stellar-testnet", r#"{"dwell_ms": 300}"#).await?;
    // The documented example: p70 100, p95 200, 371 transactions over 50 ledgers.
    let first = oracle.poll_once().await?;
    ensure!(
        first.recommended_base_fee == 100 && first.aggressive_base_fee == 200,
        "{first:?}"
    );
    ensure!(
        first.congestion == Congestion::Low,
        "the documented distribution (a 2x spread) is an ordinary network: {first:?}"
    );
    let stored = oracle.snapshot().await?.context("stored")?;
    ensure!(stored == first, "{stored:?}");
    // Congestion rises sharply: fees follow at once, but one sample cannot
    // move the level before the dwell (300 ms here) has passed.
    rpc.set_fees(100, 900, 15_000, 15_000, 50);
    let noisy = oracle.poll_once().await?;
    ensure!(
        noisy.congestion == Congestion::Low && noisy.recommended_base_fee == 900,
        "{noisy:?}"
    );
    tokio::time::sleep(Duration::from_millis(350)).await;
    let second = oracle.poll_once().await?;
    ensure!(second.congestion == Congestion::Severe, "{second:?}");
    // The RPC goes away: the poll fails and the snapshot stays as it was.
    rpc.fail();
    ensure!(oracle.poll_once().await.is_err());
    ensure!(oracle.snapshot().await?.context("kept")? == second);
    ensure!(rpc.requests() >= 3);
    Ok(())
}

async fn a_running_oracle_takes_reloaded_policy_settings_at_its_next_sample(db: TestDb) -> anyhow::Result<()> {
    let (_rpc, oracle) = oracle_on_fake(&db, "stellar", "{}").await?;
    let oracle = Arc::new(oracle);
    let settings = Arc::new(std::sync::Mutex::new("{}".to_owned()));
    // The task is aborted at the end instead of stopped.
    let stop = std::future::pending::<()>();
    let (running, current) = (oracle.clone(), settings.clone());
    let task = tokio::spawn(async move {
        let read = move || current.lock().ok().map(|s| s.clone());
        running
            .run(Duration::from_millis(50), stop, read, &laneway::events::Metrics::new())
            .await;
    });
    let wait_for = |want: u64| {
        let oracle = oracle.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            loop {
                if let Some(s) = oracle.snapshot().await? {
                    if s.recommended_base_fee == want {
                        return anyhow::Ok(());
                    }
                }
                ensure!(tokio::time::Instant::now() < deadline, "no snapshot with {want}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    wait_for(100).await?;
    // An operator raises the floor in the config; the next sample obeys it.
    *settings.lock().map_err(|_| anyhow::anyhow!("poisoned"))? = r#"{"min_fee": 700}"#.to_owned();
    wait_for(700).await?;
    task.abort();
    Ok(())
}

/// An egress policy that lets a test client reach its fake on loopback.
pub(crate) fn loopback_egress(url: &str) -> anyhow::Result<laneway::egress::Egress> {
    let parsed = reqwest::Url::parse(url)?;
    let pattern = format!("{}://{}:*", parsed.scheme(), parsed.host_str().unwrap_or("127.0.0.1"));
    laneway::egress::Egress::from_config("test", &[pattern], &["127.0.0.1".to_owned()]).map_err(anyhow::Error::msg)
}
