//! The dispatcher end to end, with an in-test executor, on both backends:
//! seed 000's incident, head-of-line isolation, ordering under failure,
//! exhaustion across restarts, halts, breakers, lease recovery.

mod crash;
pub mod harness;
mod property;
mod two_hosts;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use laneway::executor::Reconciled;
use laneway::lanes::{LaneMode, LaneRule, LaneRules};
use laneway::op::{AttemptClass, OpId, Status};
use laneway::outcome::Outcome;
use laneway::queue::{Enqueued, LeaseSpec, NewOp};
use tokio::sync::Notify;

use crate::support::{QueueExt, TestDb};
use harness::{fast_config, settle, to, Running, Scripted, Step};

crate::on_both_backends!(
    live:
    seed_000_incident_every_recipient_gets_its_entries_in_chain_order,
    a_hanging_recipient_delays_only_its_own_lane,
    a_transient_failure_holds_its_strict_lane_and_nothing_else,
    a_serial_lane_lets_later_ops_pass_an_op_in_backoff,
    attempts_survive_a_dispatcher_restart_and_exhaustion_dead_letters,
    a_permanent_outcome_dead_letters_on_the_first_attempt,
    a_halted_subject_waits_without_using_attempts,
    a_poisoned_strict_lane_halts_until_skipped,
    an_open_breaker_holds_ops_without_using_attempts,
    an_expired_lease_is_reconciled_before_redelivery,
    shutdown_returns_interrupted_ops_to_the_queue,
    a_critical_op_goes_first_among_lane_heads,
    an_enqueue_through_the_dispatcher_wakes_its_drain_at_once,
    an_op_whose_backoff_ends_after_the_pass_starts_on_a_timer_not_the_poll,
    a_plain_sql_insert_by_another_connection_wakes_the_dispatcher,
    busy_outboxes_leave_a_quiet_one_its_share_of_the_host_permits,
    a_dead_lane_with_a_backlog_past_the_window_does_not_hide_the_other_lanes,
    outboxes_sharing_a_lane_hand_it_over_without_waiting_for_the_poll,
    an_outbox_held_by_its_destinations_cap_is_woken_without_the_poll,
    an_op_stalled_for_the_rest_of_a_pass_runs_again_in_the_next,
);

fn ids(results: Vec<Enqueued>) -> Vec<OpId> {
    results.into_iter().map(Enqueued::id).collect()
}

async fn seed_000_incident_every_recipient_gets_its_entries_in_chain_order(db: TestDb) -> anyhow::Result<()> {
    const FINDER: &str = "https://finder.example/inbox";
    const COORD: &str = "https://coordinator.example/inbox";
    const VENDOR: &str = "https://vendor.example/inbox";
    let exec = Scripted::new(3);
    // The CASE_MANAGER's outbox: a 14-entry backfill to the Coordinator,
    // interleaved with fan-outs of new entries to all three participants.
    let mut ops = Vec::new();
    let mut expected: HashMap<&str, Vec<usize>> = HashMap::new();
    for entry in 0..14u32 {
        ops.push(to("case-manager", COORD, entry));
        expected.entry(COORD).or_default().push(ops.len() - 1);
        if entry % 2 == 1 {
            for lane in [FINDER, COORD, VENDOR] {
                ops.push(to("case-manager", lane, 100 + entry));
                expected.entry(lane).or_default().push(ops.len() - 1);
            }
        }
    }
    ensure!(ops.len() >= 28, "{} ops", ops.len());
    let op_ids = ids(db.queue.enqueue(&ops).await?);
    // Some entries fail once on the way, as a busy receiver would.
    exec.script(op_ids[3], [Step::Retry, Step::Ok]);
    exec.script(op_ids[10], [Step::Retry, Step::Retry, Step::Ok]);
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config("")?).await?;
    // Concurrent drain triggers from every direction.
    let mut triggers = Vec::new();
    for i in 0..10u64 {
        let d = running.dispatcher.clone();
        triggers.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(i * 3)).await;
            d.trigger("case-manager");
        }));
    }
    for t in triggers {
        t.await?;
    }
    settle(db.queue.as_ref(), Duration::from_secs(20)).await?;
    running.stop().await?;

    ensure!(exec.overlap().is_none(), "{:?}", exec.overlap());
    let delivered = exec.delivered_by_lane();
    for (lane, positions) in expected {
        let want: Vec<OpId> = positions.iter().map(|p| op_ids[*p]).collect();
        ensure!(
            delivered.get(lane) == Some(&want),
            "{lane}: delivered {:?}, want {want:?}",
            delivered.get(lane)
        );
    }
    ensure!(exec.delivered().len() == ops.len(), "lost or duplicated deliveries");
    for id in &op_ids {
        ensure!(db.queue.get(*id).await?.map(|o| o.status) == Some(Status::Confirmed));
    }
    Ok(())
}

async fn a_hanging_recipient_delays_only_its_own_lane(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(1);
    let gate = Arc::new(Notify::new());
    let mut ops = Vec::new();
    for n in 0..5 {
        for lane in [
            "https://slow.example/inbox",
            "https://b.example/inbox",
            "https://c.example/inbox",
        ] {
            ops.push(to("actor", lane, n));
        }
    }
    let op_ids = ids(db.queue.enqueue(&ops).await?);
    // The slow recipient's first delivery hangs until the test lets it go.
    exec.script(op_ids[0], [Step::Gate(gate.clone())]);
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config("")?).await?;
    running.dispatcher.trigger("actor");
    // Every other lane finishes while the slow one hangs.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let by_lane = exec.delivered_by_lane();
        let done = |lane: &str| by_lane.get(lane).map_or(0, Vec::len);
        if done("https://b.example/inbox") == 5 && done("https://c.example/inbox") == 5 {
            ensure!(
                done("https://slow.example/inbox") == 0,
                "the slow lane moved while hanging"
            );
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "other lanes did not finish: {by_lane:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gate.notify_one();
    settle(db.queue.as_ref(), Duration::from_secs(10)).await?;
    running.stop().await?;
    let slow: Vec<OpId> = op_ids.iter().step_by(3).copied().collect();
    ensure!(exec.delivered_by_lane().get("https://slow.example/inbox") == Some(&slow));
    // Completion order: the slow lane's first delivery came after every other lane's last.
    let delivered = exec.delivered();
    let first_slow = delivered
        .iter()
        .position(|e| e.op == op_ids[0])
        .context("slow op delivered")?;
    ensure!(
        first_slow >= 10,
        "the hanging delivery completed at position {first_slow}"
    );
    Ok(())
}

async fn a_transient_failure_holds_its_strict_lane_and_nothing_else(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(1);
    let mut ops = Vec::new();
    for n in 0..5 {
        ops.push(to("actor", "https://a.example/inbox", n));
        ops.push(to("actor", "https://b.example/inbox", n));
    }
    let op_ids = ids(db.queue.enqueue(&ops).await?);
    let a: Vec<OpId> = op_ids.iter().step_by(2).copied().collect();
    let b: Vec<OpId> = op_ids.iter().skip(1).step_by(2).copied().collect();
    exec.script(a[1], [Step::Retry, Step::Retry, Step::Ok]);
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config("")?).await?;
    running.dispatcher.trigger("actor");
    settle(db.queue.as_ref(), Duration::from_secs(10)).await?;
    running.stop().await?;
    // Every attempt in lane A, in start order: a1 three times, nothing behind it meanwhile.
    let a_started: Vec<OpId> = exec
        .started()
        .into_iter()
        .filter(|e| e.lane.contains("a.example"))
        .map(|e| e.op)
        .collect();
    ensure!(
        a_started == vec![a[0], a[1], a[1], a[1], a[2], a[3], a[4]],
        "{a_started:?}"
    );
    ensure!(exec.delivered_by_lane().get("https://b.example/inbox") == Some(&b));
    let history: Vec<AttemptClass> = db.queue.attempts(a[1]).await?.iter().map(|x| x.record.class).collect();
    ensure!(
        history
            == vec![
                AttemptClass::Retryable,
                AttemptClass::Retryable,
                AttemptClass::Confirmed
            ],
        "{history:?}"
    );
    Ok(())
}

async fn a_serial_lane_lets_later_ops_pass_an_op_in_backoff(db: TestDb) -> anyhow::Result<()> {
    let mut exec = Scripted::new(0);
    exec.strict = false;
    let ops: Vec<NewOp> = (0..4)
        .map(|n| {
            let mut op = to("platform", "GSIGNER", n);
            op.kind = "signer".into();
            op
        })
        .collect();
    let op_ids = ids(db.queue.enqueue(&ops).await?);
    // s1 fails once and must wait 150 ms; s2 and s3 go meanwhile.
    exec.script(op_ids[1], [Step::RetryAfter(Duration::from_millis(150)), Step::Ok]);
    let running = Running::start(db.queue.clone(), exec.registry(&["signer"]), fast_config("")?).await?;
    running.dispatcher.trigger("platform");
    settle(db.queue.as_ref(), Duration::from_secs(10)).await?;
    running.stop().await?;
    let started: Vec<OpId> = exec.started().into_iter().map(|e| e.op).collect();
    ensure!(
        started == vec![op_ids[0], op_ids[1], op_ids[2], op_ids[3], op_ids[1]],
        "{started:?}"
    );
    ensure!(exec.overlap().is_none());
    Ok(())
}

async fn attempts_survive_a_dispatcher_restart_and_exhaustion_dead_letters(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let config = "[kinds.flaky]\nmax_attempts = 3\n";
    let mut op = to("actor", "https://down.example/inbox", 1);
    op.kind = "flaky".into();
    op.correlation_id = Some("urn:entry:7".into());
    let id = ids(db.queue.enqueue(&[op]).await?)[0];
    let wait = Step::RetryAfter(Duration::from_millis(300));
    exec.script(id, [wait.clone(), wait.clone(), wait.clone(), wait]);
    let first = Running::start(db.queue.clone(), exec.registry(&["flaky"]), fast_config(config)?).await?;
    first.dispatcher.trigger("actor");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while exec.started().is_empty() {
        ensure!(tokio::time::Instant::now() < deadline, "no attempt");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.stop().await?;
    let op = db.queue.get(id).await?.context("op")?;
    ensure!(op.attempts == 1 && op.status == Status::Pending, "{op:?}");
    // A new dispatcher (a restart) continues the same budget.
    let second = Running::start(db.queue.clone(), exec.registry(&["flaky"]), fast_config(config)?).await?;
    settle(db.queue.as_ref(), Duration::from_secs(10)).await?;
    second.stop().await?;
    let op = db.queue.get(id).await?.context("op")?;
    ensure!(op.status == Status::Failed && op.attempts == 3, "{op:?}");
    ensure!(exec.started().len() == 3, "{} executions", exec.started().len());
    ensure!(
        op.last_error
            .as_deref()
            .is_some_and(|e| e.starts_with("gave up after 3 attempts")),
        "{op:?}"
    );
    ensure!(op.correlation_id.as_deref() == Some("urn:entry:7"));
    ensure!(db.queue.attempts(id).await?.len() == 3);
    Ok(())
}

/// An op that fails `in_pass_attempts` times within one pass stalls until a
/// later pass. The poll that finds it due rang the stalled pass's bell every
/// `poll_ms`, so the pass never ended and the op never ran again (found when
/// fee bumps made quick retries common): now a pass holding stalled ops ends.
async fn an_op_stalled_for_the_rest_of_a_pass_runs_again_in_the_next(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let id = ids(db
        .queue
        .enqueue(&[to("actor", "https://flaky.example/inbox", 1)])
        .await?)[0];
    exec.script(id, [Step::Retry, Step::Retry, Step::Retry, Step::Ok]);
    let config = fast_config("[dispatch]\nin_pass_attempts = 2\n")?;
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), config).await?;
    running.dispatcher.trigger("actor");
    settle(db.queue.as_ref(), Duration::from_secs(10)).await?;
    running.stop().await?;
    let op = db.queue.get(id).await?.context("op")?;
    ensure!(op.status == Status::Confirmed && op.attempts == 4, "{op:?}");
    Ok(())
}

async fn a_permanent_outcome_dead_letters_on_the_first_attempt(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let op_ids = ids(db
        .queue
        .enqueue(&[
            to("actor", "https://gone.example/inbox", 1),
            to("actor", "https://gone.example/inbox", 2),
        ])
        .await?);
    exec.script(op_ids[0], [Step::Permanent]);
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config("")?).await?;
    running.dispatcher.trigger("actor");
    settle(db.queue.as_ref(), Duration::from_secs(10)).await?;
    running.stop().await?;
    let dead = db.queue.get(op_ids[0]).await?.context("op")?;
    ensure!(dead.status == Status::Failed && dead.attempts == 1, "{dead:?}");
    ensure!(dead.last_error.as_deref() == Some("scripted permanent failure"));
    // poison = "skip" (the default): the lane continues.
    ensure!(db.queue.get(op_ids[1]).await?.map(|o| o.status) == Some(Status::Confirmed));
    Ok(())
}

async fn a_halted_subject_waits_without_using_attempts(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let mut frozen = to("platform", "https://x.example/inbox", 1);
    frozen.subject = Some("user-9".into());
    let free = to("platform", "https://y.example/inbox", 2);
    db.queue.halt_subject("user-9", Some("compliance")).await?;
    let op_ids = ids(db.queue.enqueue(&[frozen, free]).await?);
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config("")?).await?;
    running.dispatcher.trigger("platform");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while db.queue.get(op_ids[1]).await?.map(|o| o.status) != Some(Status::Confirmed) {
        ensure!(tokio::time::Instant::now() < deadline, "the free op did not go");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Several polls go by; the halted op is never attempted.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let held = db.queue.get(op_ids[0]).await?.context("op")?;
    ensure!(held.status == Status::Pending && held.attempts == 0, "{held:?}");
    db.queue.unhalt_subject("user-9").await?;
    settle(db.queue.as_ref(), Duration::from_secs(5)).await?;
    running.stop().await?;
    let done = db.queue.get(op_ids[0]).await?.context("op")?;
    ensure!(done.status == Status::Confirmed && done.attempts == 1, "{done:?}");
    Ok(())
}

async fn a_poisoned_strict_lane_halts_until_skipped(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let config = "[kinds.ledger]\npoison = \"halt\"\n";
    let ops: Vec<NewOp> = (0..3)
        .map(|n| {
            let mut op = to("cm", "https://p.example/inbox", n);
            op.kind = "ledger".into();
            op
        })
        .collect();
    let op_ids = ids(db.queue.enqueue(&ops).await?);
    exec.script(op_ids[0], [Step::Permanent]);
    let running = Running::start(db.queue.clone(), exec.registry(&["ledger"]), fast_config(config)?).await?;
    running.dispatcher.trigger("cm");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while db.queue.lane_halts(Some("cm")).await?.is_empty() {
        ensure!(tokio::time::Instant::now() < deadline, "no halt");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    ensure!(exec.started().len() == 1, "the lane moved past a halting dead letter");
    ensure!(db.queue.get(op_ids[1]).await?.map(|o| o.status) == Some(Status::Pending));
    ensure!(db.queue.skip_lane("cm", "https://p.example/inbox").await? == 1);
    running.dispatcher.trigger("cm");
    settle(db.queue.as_ref(), Duration::from_secs(5)).await?;
    running.stop().await?;
    ensure!(exec.delivered_by_lane().get("https://p.example/inbox") == Some(&vec![op_ids[1], op_ids[2]]));
    ensure!(db.queue.get(op_ids[0]).await?.map(|o| o.status) == Some(Status::Failed));
    Ok(())
}

async fn an_open_breaker_holds_ops_without_using_attempts(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let config = "[dispatch.breaker]\nthreshold = 2\ncool_off_ms = 400\n";
    // Two inboxes on one server: the breaker is per destination host.
    let op_ids = ids(db
        .queue
        .enqueue(&[
            to("o", "https://down.example/a", 1),
            to("o", "https://down.example/b", 2),
        ])
        .await?);
    // Each failure asks for a pause long enough that both first failures
    // land before any retry.
    let pause = Step::RetryAfter(Duration::from_millis(100));
    exec.script(op_ids[0], [pause.clone(), pause.clone(), Step::Ok]);
    exec.script(op_ids[1], [pause, Step::Ok]);
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config(config)?).await?;
    running.dispatcher.trigger("o");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while exec.started().len() < 2 {
        ensure!(tokio::time::Instant::now() < deadline, "no failures");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // Open: nothing for down.example is attempted during the cool-off.
    tokio::time::sleep(Duration::from_millis(250)).await;
    ensure!(exec.started().len() == 2, "attempted while open: {:?}", exec.started());
    settle(db.queue.as_ref(), Duration::from_secs(5)).await?;
    running.stop().await?;
    for id in &op_ids {
        let op = db.queue.get(*id).await?.context("op")?;
        ensure!(op.status == Status::Confirmed, "{op:?}");
    }
    // Held time used no attempts: 2 failures, then one trial, then the rest.
    // Two failures open it, a failed trial re-opens it, a good trial closes it.
    let mut total = 0;
    for id in &op_ids {
        total += db.queue.get(*id).await?.map_or(0, |o| o.attempts);
    }
    ensure!(
        total == 5 && exec.started().len() == 5,
        "{total} attempts, {} executions",
        exec.started().len()
    );
    Ok(())
}

async fn an_expired_lease_is_reconciled_before_redelivery(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let op_ids = ids(db
        .queue
        .enqueue(&[to("o", "GSIGNER-lane", 1), to("o", "GSIGNER-lane", 2)])
        .await?);
    // A previous host, whose lanes admitted two at once, claimed both,
    // checkpointed a transaction hash for each, and died before reporting.
    let spec = LeaseSpec {
        owner: "dead-host".into(),
        duration: Duration::from_millis(50),
    };
    let two_at_once = LaneRules(HashMap::from([(
        "activitypub".to_owned(),
        LaneRule {
            mode: LaneMode::Serial,
            cap: 2,
        },
    )]));
    for claimed in db.queue.claim_ids(&op_ids, &spec, &two_at_once).await? {
        db.queue
            .checkpoint(&claimed.lease, &format!("tx-{}", claimed.op.id))
            .await?;
    }
    tokio::time::sleep(Duration::from_millis(80)).await;
    // The first landed on chain; the second was lost and may be rebuilt.
    exec.reconcile_with(
        op_ids[0],
        Reconciled::Settled(Outcome::Confirmed {
            receipt: Some("tx-landed".into()),
            detail: None,
        }),
    );
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config("")?).await?;
    settle(db.queue.as_ref(), Duration::from_secs(5)).await?;
    running.stop().await?;
    ensure!(
        exec.reconciles()
            == vec![
                (op_ids[0], format!("tx-{}", op_ids[0])),
                (op_ids[1], format!("tx-{}", op_ids[1]))
            ],
        "{:?}",
        exec.reconciles()
    );
    let started: Vec<OpId> = exec.started().into_iter().map(|e| e.op).collect();
    ensure!(started == vec![op_ids[1]], "redelivered {started:?}");
    let first = db.queue.get(op_ids[0]).await?.context("op")?;
    ensure!(
        first.status == Status::Confirmed && first.receipt.as_deref() == Some("tx-landed"),
        "{first:?}"
    );
    let history: Vec<AttemptClass> = db
        .queue
        .attempts(op_ids[0])
        .await?
        .iter()
        .map(|a| a.record.class)
        .collect();
    ensure!(
        history == vec![AttemptClass::LeaseExpired, AttemptClass::Confirmed],
        "{history:?}"
    );
    Ok(())
}

async fn shutdown_returns_interrupted_ops_to_the_queue(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let config = "[dispatch]\nshutdown_grace_ms = 100\n";
    let op_ids = ids(db
        .queue
        .enqueue(&[to("o", "https://a.example/i", 1), to("o", "https://b.example/i", 2)])
        .await?);
    exec.script(op_ids[0], [Step::Sleep(Duration::from_secs(30)), Step::Ok]);
    exec.script(op_ids[1], [Step::Sleep(Duration::from_millis(20)), Step::Ok]);
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config(config)?).await?;
    running.dispatcher.trigger("o");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while exec.started().len() < 2 {
        ensure!(tokio::time::Instant::now() < deadline, "not started");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    running.stop().await?;
    // The quick op finished within the grace; the slow one went back to the queue.
    ensure!(db.queue.get(op_ids[1]).await?.map(|o| o.status) == Some(Status::Confirmed));
    let back = db.queue.get(op_ids[0]).await?.context("op")?;
    ensure!(back.status == Status::Pending && back.lease_token.is_none(), "{back:?}");
    let history = db.queue.attempts(op_ids[0]).await?;
    ensure!(
        history.len() == 1 && history[0].record.error.as_deref() == Some("interrupted by shutdown"),
        "{history:?}"
    );
    Ok(())
}

async fn a_critical_op_goes_first_among_lane_heads(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let config = "[dispatch]\noutbox_max_in_flight = 1\n";
    let mut ops: Vec<NewOp> = (0..20)
        .map(|n| to("platform", &format!("https://r{n}.example/i"), n))
        .collect();
    let mut urgent = to("platform", "https://urgent.example/i", 99);
    urgent.priority = laneway::op::Priority::Critical;
    ops.push(urgent);
    let op_ids = ids(db.queue.enqueue(&ops).await?);
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config(config)?).await?;
    running.dispatcher.trigger("platform");
    settle(db.queue.as_ref(), Duration::from_secs(10)).await?;
    running.stop().await?;
    let started: Vec<OpId> = exec.started().into_iter().map(|e| e.op).collect();
    ensure!(started.first() == op_ids.last(), "started {started:?}");
    ensure!(
        started[1..] == op_ids[..20],
        "the rest went in enqueue order: {started:?}"
    );
    Ok(())
}

async fn an_enqueue_through_the_dispatcher_wakes_its_drain_at_once(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    // The safety-net poll is an hour away: only the wake-up can deliver.
    let config = "[dispatch]\npoll_ms = 3600000\n";
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config(config)?).await?;
    // Let the dispatcher's first (immediate) poll go by.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = tokio::time::Instant::now();
    running.dispatcher.enqueue(&[to("o", "https://a.example/i", 1)]).await?;
    settle(db.queue.as_ref(), Duration::from_secs(5)).await?;
    let took = started.elapsed();
    running.stop().await?;
    ensure!(exec.delivered().len() == 1);
    ensure!(took < Duration::from_secs(2), "took {took:?}");
    Ok(())
}

/// Two outboxes of one host deliver to one shared inbox (a strict lane
/// across outboxes): each settle of one wakes the other, so the lane moves
/// at the executors' pace, not one op per poll (an hour away here), never
/// with two in flight and in order within each outbox.
async fn outboxes_sharing_a_lane_hand_it_over_without_waiting_for_the_poll(db: TestDb) -> anyhow::Result<()> {
    const SHARED: &str = "https://big.example/inbox";
    let exec = Scripted::new(1);
    let config = "[dispatch]\npoll_ms = 3600000\n";
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config(config)?).await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut ops = Vec::new();
    for n in 0..30u32 {
        ops.push(to("actor-a", SHARED, n));
        ops.push(to("actor-b", SHARED, n));
    }
    let ids = ids(running.dispatcher.enqueue(&ops).await?);
    settle(db.queue.as_ref(), Duration::from_secs(10))
        .await
        .context("the shared lane waited for the poll")?;
    running.stop().await?;
    ensure!(exec.overlap().is_none(), "two ops of the shared lane at once");
    let started: Vec<OpId> = exec.started().iter().map(|e| e.op).collect();
    for outbox in 0..2 {
        let mine: Vec<OpId> = ids.iter().skip(outbox).step_by(2).copied().collect();
        let order: Vec<OpId> = started.iter().filter(|id| mine.contains(id)).copied().collect();
        ensure!(order == mine, "outbox {outbox} out of order: {order:?}");
    }
    Ok(())
}

/// An op held only by its destination's cap, where the op in flight to that
/// destination is another outbox's, must start soon after that op ends:
/// no lane is shared, so no handover wakes its outbox, and the poll is an
/// hour away.
async fn an_outbox_held_by_its_destinations_cap_is_woken_without_the_poll(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let config = "[dispatch]\npoll_ms = 3600000\n[destinations]\nmax_in_flight = 1\n";
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config(config)?).await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let first = ids(running
        .dispatcher
        .enqueue(&[to("first", "https://one.example/users/a/inbox", 0)])
        .await?)[0];
    exec.script(first, [Step::Sleep(Duration::from_millis(300))]);
    running.dispatcher.trigger("first");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = ids(running
        .dispatcher
        .enqueue(&[to("second", "https://one.example/users/b/inbox", 0)])
        .await?)[0];
    settle(db.queue.as_ref(), Duration::from_secs(5))
        .await
        .context("the second outbox waited for the poll")?;
    running.stop().await?;
    let started: Vec<OpId> = exec.started().iter().map(|e| e.op).collect();
    ensure!(started == vec![first, second], "{started:?}");
    Ok(())
}

/// A dead recipient's backlog, 250 windows long and ahead of every other
/// lane in dispatch order, must not keep the other lanes' ops from being
/// seen: the full read goes past the crowded lane however deep it is (a
/// read that paged through it stopped after 100 windows).
async fn a_dead_lane_with_a_backlog_past_the_window_does_not_hide_the_other_lanes(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let config = "[dispatch]\nwindow = 10\n";
    let dead: Vec<NewOp> = (0..2_500u32).map(|i| to("o", "https://dead.example/i", i)).collect();
    let dead_ids = ids(db.queue.enqueue(&dead).await?);
    exec.script(dead_ids[0], [Step::RetryAfter(Duration::from_secs(3600))]);
    let others: Vec<NewOp> = (0..10u32)
        .map(|i| to("o", &format!("https://alive{i}.example/i"), i))
        .collect();
    let other_ids = ids(db.queue.enqueue(&others).await?);
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config(config)?).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let delivered = loop {
        let delivered: Vec<OpId> = exec.delivered().iter().map(|e| e.op).collect();
        if other_ids.iter().all(|id| delivered.contains(id)) || tokio::time::Instant::now() > deadline {
            break delivered;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    running.stop().await?;
    ensure!(
        other_ids.iter().all(|id| delivered.contains(id)),
        "the other lanes waited behind the dead one: delivered {delivered:?}"
    );
    ensure!(
        !dead_ids.iter().any(|id| delivered.contains(id)),
        "the dead lane's order held: {delivered:?}"
    );
    Ok(())
}

/// Two busy outboxes could hold every host permit for as long as they have
/// work; a third outbox's op must still go soon (its fair share), not wait
/// for their backlogs or the poll (an hour away here).
async fn busy_outboxes_leave_a_quiet_one_its_share_of_the_host_permits(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let config = "[dispatch]
poll_ms = 3600000
max_in_flight = 2
outbox_max_in_flight = 2
";
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config(config)?).await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let busy: Vec<NewOp> = (0..60u32)
        .map(|i| to(&format!("busy-{}", i % 2), &format!("https://b{i}.example/i"), i))
        .collect();
    let busy_ids = ids(db.queue.enqueue(&busy).await?);
    for id in &busy_ids {
        exec.script(*id, [Step::Sleep(Duration::from_millis(10))]);
    }
    running.dispatcher.trigger("busy-0");
    running.dispatcher.trigger("busy-1");
    tokio::time::sleep(Duration::from_millis(40)).await;
    let quiet = ids(running
        .dispatcher
        .enqueue(&[to("quiet", "https://q.example/i", 0)])
        .await?)[0];
    settle(db.queue.as_ref(), Duration::from_secs(10))
        .await
        .context("the quiet outbox's op was left waiting")?;
    running.stop().await?;
    let started: Vec<OpId> = exec.started().iter().map(|e| e.op).collect();
    let at = started
        .iter()
        .position(|id| *id == quiet)
        .context("quiet op never ran")?;
    ensure!(
        at + 20 < started.len(),
        "the quiet op started only after {at} of {} busy ops",
        started.len() - 1
    );
    Ok(())
}

/// A retry due later than a pass stays open ends the pass; a timer, not the
/// poll (an hour away here), starts it at its time.
async fn an_op_whose_backoff_ends_after_the_pass_starts_on_a_timer_not_the_poll(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let config = "[dispatch]\npoll_ms = 3600000\n";
    let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config(config)?).await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let id = ids(db.queue.enqueue(&[to("o", "https://a.example/i", 1)]).await?)[0];
    exec.script(id, [Step::RetryAfter(Duration::from_millis(1500)), Step::Ok]);
    running.dispatcher.trigger("o");
    settle(db.queue.as_ref(), Duration::from_secs(8))
        .await
        .context("the retry was left to the poll")?;
    running.stop().await?;
    let attempts = db.queue.attempts(id).await?;
    ensure!(attempts.len() == 2, "{attempts:?}");
    ensure!(
        attempts[1].record.started_at - attempts[0].record.finished_at >= chrono::Duration::milliseconds(1400),
        "the Retry-After was honoured: {attempts:?}"
    );
    Ok(())
}

/// A producer in another program inserts with plain SQL on a connection of
/// its own: PostgreSQL's `NOTIFY`, or SQLite's `data_version` watcher, wakes
/// the dispatcher (the poll is an hour away).
async fn a_plain_sql_insert_by_another_connection_wakes_the_dispatcher(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let running = Running::start(
        db.queue.clone(),
        exec.registry(&["activitypub"]),
        fast_config("[dispatch]\npoll_ms = 3600000\n")?,
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let insert = "INSERT INTO TABLE (outbox, kind, lanes, payload) VALUES ('sql-producer', 'activitypub', LANES, '{}')";
    match &db.kind {
        crate::support::TestBackend::Postgres(pg) => {
            sqlx::query(
                &insert
                    .replace("TABLE", "ops")
                    .replace("LANES", "ARRAY['https://x.example/i']"),
            )
            .execute(pg.pool())
            .await?;
        }
        crate::support::TestBackend::Sqlite(_) => {
            let path = db.sqlite_path().context("sqlite")?;
            let producer = sqlx::SqlitePool::connect(&format!("sqlite://{}", path.display())).await?;
            sqlx::query(
                &insert
                    .replace("TABLE", "laneway_ops")
                    .replace("LANES", "'[\"https://x.example/i\"]'"),
            )
            .execute(&producer)
            .await?;
        }
    }
    settle(db.queue.as_ref(), Duration::from_secs(3))
        .await
        .context("the producer's insert did not wake the dispatcher")?;
    running.stop().await?;
    ensure!(exec.delivered().len() == 1);
    Ok(())
}

/// CPU time this thread has run, from the kernel's scheduler statistics.
fn thread_cpu() -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat")?;
    let ns: u64 = stat.split_whitespace().next().context("schedstat")?.parse()?;
    Ok(Duration::from_nanos(ns))
}

/// A host waiting out its shutdown grace for a hung op sleeps: with every
/// task on one thread, that thread's CPU over the grace is a sliver of it (a
/// stopping pass once spun on a refresh time it never moved, a core busy for
/// as long as hung requests took to time out).
#[test]
fn a_host_waiting_out_its_shutdown_grace_sleeps() -> anyhow::Result<()> {
    std::thread::spawn(|| -> anyhow::Result<()> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        runtime.block_on(async {
            let db = crate::support::sqlite_live().await?;
            let exec = Scripted::new(0);
            let config = "[dispatch]\nshutdown_grace_ms = 1500\n";
            let op_ids = ids(db.queue.enqueue(&[to("o", "https://a.example/i", 1)]).await?);
            exec.script(op_ids[0], [Step::Sleep(Duration::from_secs(30)), Step::Ok]);
            let running =
                Running::start(db.queue.clone(), exec.registry(&["activitypub"]), fast_config(config)?).await?;
            running.dispatcher.trigger("o");
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while exec.started().is_empty() {
                ensure!(tokio::time::Instant::now() < deadline, "not started");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let (cpu, wall) = (thread_cpu()?, std::time::Instant::now());
            running.stop().await?;
            let (cpu, wall) = (thread_cpu()? - cpu, wall.elapsed());
            ensure!(
                wall >= Duration::from_millis(1400),
                "stopped before the grace ran out: {wall:?}"
            );
            ensure!(cpu * 5 < wall, "{cpu:?} of CPU over a {wall:?} stop");
            let back = db.queue.get(op_ids[0]).await?.context("op")?;
            ensure!(back.status == Status::Pending, "{back:?}");
            Ok(())
        })
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the test thread panicked"))?
}
