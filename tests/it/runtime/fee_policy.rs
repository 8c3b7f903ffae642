//! The fee policy plugin (seed 003's oracle and quote rules) through the
//! real runtime: golden inputs and outputs.

use std::sync::Arc;

use anyhow::{ensure, Context};
use laneway::keys::KeyStore;
use laneway::runtime::bindings::executor::laneway::plugin::types::Priority;
use laneway::runtime::bindings::fee_policy::exports::laneway::plugin::fee_policy::{
    Congestion, Decision, FeeQuote, FeeSample, QuoteRequest, Snapshot,
};
use laneway::runtime::plugin::Plugin;

use super::{load, runtime};

fn policy() -> anyhow::Result<Arc<Plugin>> {
    let rt = runtime()?;
    Ok(Arc::new(
        load(&rt, "fee-policy", "", KeyStore::default())?.map_err(|e| anyhow::anyhow!("{e}"))?,
    ))
}

fn sample(min: u64, p70: u64, p95: u64, tx: u32) -> FeeSample {
    FeeSample {
        min,
        mode: min,
        p50: min,
        p70,
        p90: p95,
        p95,
        p99: p95,
        max: p95,
        transaction_count: tx,
        ledger_count: 1,
        latest_ledger: 1000,
    }
}

async fn observe(p: &Plugin, prev: Option<Snapshot>, s: FeeSample, now: i64) -> anyhow::Result<Snapshot> {
    p.observe(prev, s, now, String::new())
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .map_err(anyhow::Error::msg)
}

fn request(priority: Priority, attempts: u32, snapshot: Option<Snapshot>, enqueued: i64, now: i64) -> QuoteRequest {
    QuoteRequest {
        priority,
        attempts,
        fee_bumps: 0,
        enqueued_at_ms: enqueued,
        now_ms: now,
        snapshot,
        config: String::new(),
    }
}

async fn quote(p: &Plugin, r: QuoteRequest) -> anyhow::Result<Decision> {
    p.quote(r)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .map_err(anyhow::Error::msg)
}

fn submitted(d: Decision) -> anyhow::Result<FeeQuote> {
    match d {
        Decision::Submit(q) => Ok(q),
        Decision::Defer(ms) => anyhow::bail!("deferred {ms} ms"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oracle_takes_p70_and_p95_floors_clamps_and_grades_congestion() -> anyhow::Result<()> {
    let p = policy()?;
    let s = observe(&p, None, sample(100, 150, 300, 20), 0).await?;
    ensure!(s.recommended_base_fee == 150 && s.aggressive_base_fee == 300, "{s:?}");
    ensure!(s.congestion == Congestion::Low, "spread 3x is ordinary noise: {s:?}");
    ensure!((s.ledger_capacity_usage - 0.2).abs() < 1e-9 && s.clamped.is_empty());
    let s = observe(&p, None, sample(100, 150, 600, 20), 0).await?;
    ensure!(s.congestion == Congestion::Elevated, "spread 6x is elevated: {s:?}");
    let s = observe(&p, None, sample(100, 150, 2_500, 20), 0).await?;
    ensure!(s.congestion == Congestion::High, "spread 25x is high: {s:?}");
    let s = observe(&p, None, sample(10, 50, 90_000, 95), 0).await?;
    ensure!(
        s.recommended_base_fee == 100 && s.aggressive_base_fee == 50_000,
        "{s:?}"
    );
    ensure!(s.clamped == "max" && s.congestion == Congestion::Severe, "{s:?}");
    Ok(())
}

/// The distributions Stellar's docs show for `getFeeStats` (stellar-docs
/// `methods/getFeeStats.json`) are an ordinary network: graded low, so a
/// CRITICAL withdrawal bids the recommended fee, not p95.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_distributions_grade_an_ordinary_network_low() -> anyhow::Result<()> {
    let p = policy()?;
    let soroban = FeeSample {
        min: 100,
        mode: 100,
        p50: 100,
        p70: 100,
        p90: 200,
        p95: 200,
        p99: 200,
        max: 200,
        transaction_count: 371,
        ledger_count: 50,
        latest_ledger: 3_730_870,
    };
    let classic = FeeSample {
        min: 100,
        mode: 100,
        p50: 100,
        p70: 100,
        p90: 100,
        p95: 100,
        p99: 133,
        max: 133,
        transaction_count: 28,
        ledger_count: 10,
        latest_ledger: 3_730_870,
    };
    for documented in [soroban, classic] {
        let s = observe(&p, None, documented, 0).await?;
        ensure!(s.congestion == Congestion::Low, "{s:?}");
        let withdraw = submitted(quote(&p, request(Priority::Critical, 1, Some(s.clone()), 0, 1_000)).await?)?;
        ensure!(
            withdraw.fee == s.recommended_base_fee && !withdraw.aggressive,
            "a withdrawal on an ordinary network bid {withdraw:?}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn congestion_dwells_and_does_not_flap_at_a_boundary() -> anyhow::Result<()> {
    let p = policy()?;
    let high = observe(&p, None, sample(100, 100, 100, 80), 0).await?;
    ensure!(high.congestion == Congestion::High, "{high:?}");
    // A quiet sample 10 s later: still within the 30 s dwell.
    let s = observe(&p, Some(high.clone()), sample(100, 100, 100, 10), 10_000).await?;
    ensure!(s.congestion == Congestion::High && s.congestion_since_ms == 0, "{s:?}");
    // Past the dwell but only just under the threshold: hysteresis holds.
    let s = observe(&p, Some(s), sample(100, 100, 100, 72), 31_000).await?;
    ensure!(s.congestion == Congestion::High, "{s:?}");
    // Clearly lower: it steps down and the dwell restarts.
    let s = observe(&p, Some(s), sample(100, 100, 100, 55), 32_000).await?;
    ensure!(
        s.congestion == Congestion::Elevated && s.congestion_since_ms == 32_000,
        "{s:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotes_follow_priority_bumps_caps_defers_and_staleness() -> anyhow::Result<()> {
    let p = policy()?;
    let now = 1_000_000;
    let calm = Snapshot {
        recommended_base_fee: 150,
        aggressive_base_fee: 400,
        congestion: Congestion::Low,
        ledger_capacity_usage: 0.1,
        sampled_at_ms: now - 5_000,
        congestion_since_ms: 0,
        clamped: String::new(),
    };
    let q = submitted(quote(&p, request(Priority::Normal, 1, Some(calm.clone()), now, now)).await?)?;
    ensure!(q.fee == 150 && !q.aggressive && !q.capped, "{q:?}");
    // Bumps compound tenfold by default (Stellar replaces a queued
    // transaction only for ten times its bid): attempt 2 pays 10x, attempt
    // 3 100x; past max_bumps they stop, and max_abs_fee caps them.
    ensure!(submitted(quote(&p, request(Priority::Normal, 2, Some(calm.clone()), now, now)).await?)?.fee == 1_500);
    ensure!(submitted(quote(&p, request(Priority::Normal, 3, Some(calm.clone()), now, now)).await?)?.fee == 15_000);
    let q = submitted(quote(&p, request(Priority::Normal, 9, Some(calm.clone()), now, now)).await?)?;
    ensure!(q.fee == 100_000 && q.capped, "{q:?}");
    // An operator's own multiplier compounds the same way.
    let doubling = QuoteRequest {
        config: r#"{"bump_multiplier":2.0}"#.to_owned(),
        ..request(Priority::Normal, 3, Some(calm.clone()), now, now)
    };
    ensure!(submitted(quote(&p, doubling.clone()).await?)?.fee == 600);
    ensure!(
        submitted(
            quote(
                &p,
                QuoteRequest {
                    attempts: 9,
                    ..doubling
                }
            )
            .await?
        )?
        .fee == 1_200,
        "past max_bumps"
    );
    // CRITICAL uses the aggressive fee once congestion is elevated, and at
    // the absolute cap it still submits, flagged.
    let busy = Snapshot {
        congestion: Congestion::High,
        recommended_base_fee: 40_000,
        aggressive_base_fee: 45_000,
        ..calm.clone()
    };
    let q = submitted(quote(&p, request(Priority::Critical, 1, Some(busy.clone()), now, now)).await?)?;
    ensure!(q.fee == 45_000 && q.aggressive && !q.capped, "{q:?}");
    let q = submitted(quote(&p, request(Priority::Critical, 3, Some(busy.clone()), now, now)).await?)?;
    ensure!(q.fee == 100_000 && q.capped, "{q:?}");
    // LOW waits while congestion is high, never past the max defer.
    ensure!(matches!(
        quote(&p, request(Priority::Low, 1, Some(busy.clone()), now, now)).await?,
        Decision::Defer(15_000)
    ));
    ensure!(matches!(
        quote(&p, request(Priority::Low, 1, Some(busy.clone()), now - 299_000, now)).await?,
        Decision::Defer(1_000)
    ));
    ensure!(matches!(
        quote(&p, request(Priority::Low, 1, Some(busy.clone()), now - 300_000, now)).await?,
        Decision::Submit(_)
    ));
    // A stale snapshot falls back to the default base fee.
    let stale = Snapshot {
        sampled_at_ms: now - 32_000,
        ..calm
    };
    let q = submitted(quote(&p, request(Priority::Normal, 1, Some(stale), now, now)).await?)?;
    ensure!(q.fee == 100, "{q:?}");
    let q = submitted(quote(&p, request(Priority::Normal, 1, None, now, now)).await?).context("no snapshot")?;
    ensure!(q.fee == 100);
    Ok(())
}

/// Fee policies are pure functions of their arguments: the WASI clocks they
/// could read are stopped at the epoch, so a policy that peeks at time sees
/// nothing move and its quotes stay reproducible.
#[tokio::test]
async fn fee_policies_see_stopped_clocks() -> anyhow::Result<()> {
    let rt = runtime()?;
    let p = load(&rt, "clock-policy", "", KeyStore::default())?.map_err(|e| anyhow::anyhow!("{e}"))?;
    let first = observe(&p, None, sample(100, 100, 100, 1), 0).await?;
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let second = observe(&p, None, sample(100, 100, 100, 1), 0).await?;
    ensure!(
        first.sampled_at_ms == 0 && second.sampled_at_ms == 0,
        "wall clock moved: {first:?} {second:?}"
    );
    ensure!(first.congestion_since_ms == 0, "monotonic clock moved: {first:?}");
    // Executors keep the real clock: they need it for transaction time bounds.
    Ok(())
}
