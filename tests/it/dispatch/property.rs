//! The lane guarantees under random load: random fan-outs, random failures
//! (retryable, permanent, timeouts), random drain triggers, on both backends.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::ensure;
use laneway::op::{OpId, Status};
use laneway::queue::{Enqueued, NewOp};
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestRunner};

use super::harness::{fast_config, settle, Running, Scripted, Step};
use crate::support::{self, TestDb};

#[derive(Debug, Clone)]
struct Case {
    /// Per op: its lanes (indices into LANES) and its scripted attempts.
    ops: Vec<(Vec<usize>, Vec<Step>)>,
    /// Delays (ms) at which extra drain triggers fire.
    triggers: Vec<u64>,
}

const LANES: [&str; 4] = [
    "https://a.example/inbox",
    "https://b.example/inbox",
    "https://c.example/inbox",
    "https://d.example/inbox",
];
const MAX_ATTEMPTS: usize = 4;

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => Just(Step::Ok),
        3 => Just(Step::Retry),
        1 => Just(Step::Permanent),
        1 => Just(Step::Sleep(Duration::from_millis(120))),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    let op = (
        proptest::sample::subsequence(vec![0usize, 1, 2, 3], 1..3),
        proptest::collection::vec(step(), 0..5),
    );
    (
        proptest::collection::vec(op, 1..24),
        proptest::collection::vec(0u64..40, 0..6),
    )
        .prop_map(|(ops, triggers)| Case { ops, triggers })
}

async fn check(db: TestDb, case: Case) -> anyhow::Result<()> {
    let exec = Scripted::new(2);
    let config = fast_config(&format!(
        "[kinds.activitypub]\nmax_attempts = {MAX_ATTEMPTS}\nfault_attempts = {MAX_ATTEMPTS}\ntimeout_ms = 60\nbackoff_base_ms = 2\nbackoff_max_ms = 8\n"
    ))?;
    let ops: Vec<NewOp> = case
        .ops
        .iter()
        .enumerate()
        .map(|(n, (lanes, _))| {
            let mut op = NewOp::new("actor", "activitypub", format!(r#"{{"n":{n}}}"#));
            op.lanes = lanes.iter().map(|l| LANES[*l].to_owned()).collect();
            op
        })
        .collect();
    let ids: Vec<OpId> = db.queue.enqueue(&ops).await?.into_iter().map(Enqueued::id).collect();
    for (id, (_, steps)) in ids.iter().zip(&case.ops) {
        exec.script(*id, steps.clone());
    }
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), config).await?;
    for delay in &case.triggers {
        let d = running.dispatcher.clone();
        let delay = *delay;
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            d.trigger("actor");
        });
    }
    settle(db.queue.as_ref(), Duration::from_secs(30)).await?;
    running.stop().await?;

    ensure!(exec.overlap().is_none(), "{:?}", exec.overlap());
    // Per strict lane, executions start in enqueue order: an op is never
    // attempted while an earlier op of its lane is unfinished.
    let lanes_of: HashMap<OpId, &Vec<usize>> = ids.iter().copied().zip(case.ops.iter().map(|(l, _)| l)).collect();
    let mut last_started: HashMap<usize, OpId> = HashMap::new();
    for e in exec.started() {
        for lane in lanes_of[&e.op] {
            if let Some(prev) = last_started.insert(*lane, e.op) {
                ensure!(prev <= e.op, "lane {lane}: op {} started after op {prev}", e.op);
            }
        }
    }
    for id in &ids {
        let op = db
            .queue
            .get(*id)
            .await?
            .ok_or_else(|| anyhow::anyhow!("op {id} lost"))?;
        ensure!(
            matches!(op.status, Status::Confirmed | Status::Failed),
            "op {id} ended {:?}",
            op.status
        );
        ensure!(
            op.attempts as usize <= MAX_ATTEMPTS,
            "op {id} took {} attempts",
            op.attempts
        );
    }
    Ok(())
}

fn run_cases(
    cases: u32,
    make: fn() -> futures::future::BoxFuture<'static, anyhow::Result<TestDb>>,
) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut runner = TestRunner::new(PropConfig {
        cases,
        max_shrink_iters: 16,
        ..PropConfig::default()
    });
    runner
        .run(&case(), |case| {
            runtime
                .block_on(async { check(make().await?, case).await })
                .map_err(|e| TestCaseError::fail(format!("{e:#}")))
        })
        .map_err(|e| anyhow::anyhow!("{e}"))
}

#[test]
fn sqlite_lanes_hold_under_random_failures_and_triggers() -> anyhow::Result<()> {
    run_cases(10, || Box::pin(support::sqlite_live()))
}

#[test]
fn postgres_lanes_hold_under_random_failures_and_triggers() -> anyhow::Result<()> {
    run_cases(6, || Box::pin(support::postgres_live()))
}
