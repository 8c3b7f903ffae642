//! A host killed at each crash window of the drain's pipeline (a failpoint
//! stops its drain there, then its runtime is dropped: no settle, no
//! release, leases stay, as after kill -9), and a second host on the same
//! database: nothing lost, no lane out of order, and re-runs only where the
//! window says (ARCHITECTURE.md, "Pipelined drain").

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use laneway::clock::SystemClock;
use laneway::config::Config;
use laneway::failpoint;
use laneway::op::{OpId, Status};
use laneway::queue::NewOp;

use super::harness::{fast_config, settle, to, Running, Scripted};
use crate::support::{doomed_host, with_own_pg_schema};

const LANES: u32 = 6;
const PER_LANE: u32 = 20;

/// Host A, killable mid-drain: starts the dispatcher with `exec` and
/// enqueues `ops`.
fn doomed(config: Config, exec: Scripted, ops: Vec<NewOp>) -> anyhow::Result<(tokio::runtime::Runtime, Vec<OpId>)> {
    doomed_host(config, move |queue, config| async move {
        let running = Running::start(queue, exec.registry(&["activitypub"]), config).await?;
        let ids: Vec<OpId> = running
            .dispatcher
            .enqueue(&ops)
            .await?
            .into_iter()
            .map(|e| e.id())
            .collect();
        std::mem::forget(running);
        anyhow::Ok(ids)
    })
}

async fn killed_at(point: &str, url: String) -> anyhow::Result<()> {
    let outbox = format!("crash-{point}-{}", uuid::Uuid::new_v4().simple());
    let config = fast_config(&format!("[database]\nurl = {url:?}\n[queue]\nlease_ms = 1000\n"))?;
    let ops: Vec<NewOp> = (0..PER_LANE)
        .flat_map(|n| (0..LANES).map(move |l| (l, n)))
        .map(|(l, n)| to(&outbox, &format!("https://peer{l}.example/inbox"), n))
        .collect();
    // Stop at the fourth time: some rounds have committed before.
    failpoint::arm(point, &outbox, 4);
    let exec_a = Scripted::new(2);
    let (runtime_a, ids) = doomed(config.clone(), exec_a.clone(), ops)?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !failpoint::reached(point, &outbox) {
        ensure!(tokio::time::Instant::now() < deadline, "host A never reached {point}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    runtime_a.shutdown_background();
    failpoint::disarm(&outbox);
    let ran_by_a = exec_a.delivered();

    let queue = laneway::queue::open(&config.database, config.limits(), Arc::new(SystemClock)).await?;
    let exec_b = Scripted::new(2);
    let running = Running::start(queue.clone(), exec_b.registry(&["activitypub"]), config).await?;
    running.dispatcher.trigger(&outbox);
    settle(queue.as_ref(), Duration::from_secs(30)).await?;
    running.stop().await?;

    // Nothing lost.
    for id in &ids {
        let op = queue.get(*id).await?.context("op gone")?;
        ensure!(op.status == Status::Confirmed, "op {id} ended {:?}", op.status);
    }
    ensure!(exec_b.overlap().is_none(), "{:?}", exec_b.overlap());
    // Lane order: each lane's first runs, host A's then host B's, are in
    // enqueue order; a second run is only of an op host A ran last on its
    // lane (its settle was in the window).
    let position: HashMap<OpId, usize> = ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    let mut by_lane: HashMap<String, Vec<OpId>> = HashMap::new();
    for e in ran_by_a.iter().chain(&exec_b.delivered()) {
        by_lane.entry(e.lane.clone()).or_default().push(e.op);
    }
    let mut reruns = 0;
    for (lane, runs) in &by_lane {
        let mut seen = HashSet::new();
        let mut last: Option<usize> = None;
        for (i, op) in runs.iter().enumerate() {
            if !seen.insert(*op) {
                reruns += 1;
                let a_last = ran_by_a.iter().rev().find(|e| &e.lane == lane).map(|e| e.op);
                ensure!(
                    a_last == Some(*op),
                    "{lane}: op {op} ran twice but was not host A's last: {runs:?}"
                );
                ensure!(
                    i > 0 && runs[i - 1] == *op,
                    "{lane}: op {op} re-ran after another op: {runs:?}"
                );
                continue;
            }
            let at = position[op];
            ensure!(last.is_none_or(|l| l < at), "{lane}: out of order: {runs:?}");
            last = Some(at);
        }
        ensure!(
            seen.len() == PER_LANE as usize,
            "{lane}: {} of {PER_LANE} ran",
            seen.len()
        );
    }
    // Ran, not settled (in the window, or still running when the drain
    // stopped): at most one op per strict lane runs again.
    ensure!(reruns <= LANES as usize, "{reruns} re-runs: more than one per lane");
    Ok(())
}

fn sqlite_url(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}", dir.path().join("queue.db").display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_a_claim_commits_loses_nothing_sqlite() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    killed_at(failpoint::CLAIMED, sqlite_url(&dir)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_side_effects_and_their_settle_reruns_in_lane_order_sqlite() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    killed_at(failpoint::SETTLING, sqlite_url(&dir)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_a_claim_commits_loses_nothing_postgres() -> anyhow::Result<()> {
    with_own_pg_schema(|url| killed_at(failpoint::CLAIMED, url)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_side_effects_and_their_settle_reruns_in_lane_order_postgres() -> anyhow::Result<()> {
    with_own_pg_schema(|url| killed_at(failpoint::SETTLING, url)).await
}
