//! The queue conformance suite: every test runs unchanged against SQLite and
//! PostgreSQL (River's driver-test idea), through the `Queue` trait only.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use chrono::Duration as Span;
use laneway::lanes::{LaneMode, LaneRule, LaneRules};
use laneway::op::{AttemptClass, AttemptRecord, Lease, Priority, Status};
use laneway::queue::prelude::*;
use laneway::queue::{Cas, Claimed, Completion, Enqueued, ExpireTo, Finish, LeaseSpec, NewOp, OpFilter, QueueError};

use crate::support::{ClaimRequest, QueueExt, TestDb};

crate::on_both_backends!(
    redeal_moves_only_a_waiting_op_with_one_lane_by_compare_and_set,
    enqueue_stores_every_field_and_the_payload_text_exactly,
    idempotency_key_returns_the_existing_op_forever,
    coalesce_key_declines_while_pending_and_frees_at_terminal,
    an_invalid_op_in_a_batch_writes_nothing,
    claim_takes_due_ops_by_priority_then_sequence,
    claim_filters_by_outbox_and_kind,
    claim_ids_takes_only_ops_still_pending,
    eight_claimers_never_share_an_op,
    a_stale_lease_cannot_complete_or_checkpoint,
    a_batch_of_settles_records_the_attempts_of_those_that_apply,
    retry_backs_off_and_counts_attempts_across_claims,
    permanent_failure_dead_letters_and_force_retry_grants_a_fresh_budget,
    cancel_only_applies_to_pending_ops,
    extended_leases_do_not_expire,
    checkpointed_receipt_survives_lease_expiry,
    expiry_at_the_budget_dead_letters,
    list_filters_and_depth,
    candidates_are_the_outbox_non_terminal_ops_in_dispatch_order,
    due_outboxes_lists_only_outboxes_with_due_work,
    a_drain_slot_has_one_holder_until_it_lapses,
    a_halting_dead_letter_holds_its_lanes_until_skipped_or_retried,
    halted_subjects_are_flagged_on_their_candidates,
    fee_snapshots_only_move_forward,
    a_lane_occupied_in_another_outbox_refuses_the_claim,
    serial_caps_count_across_outboxes,
    a_receipt_in_doubt_holds_its_lanes_until_settled,
    concurrent_claimers_never_share_a_lane_across_outboxes,
    scan_reads_the_book_in_dispatch_order_or_the_ops_since_an_id,
    scan_beyond_goes_on_in_dispatch_order_with_a_few_ops_per_lane_set,
    settle_and_claim_settles_first_in_one_transaction,
    a_claim_that_follows_a_settle_is_made_only_if_the_settle_applies,
    kind_defaults_written_by_many_hosts_at_once_never_collide,
    a_value_no_laneway_wrote_is_the_same_error_everywhere,
    an_unreachable_database_is_named_without_its_password,
    a_lane_hold_that_cannot_be_written_fails_the_settle,
    an_expired_lease_records_its_attempt_the_same_way_everywhere,
    retried_dead_letters_come_back_in_the_order_asked,
    rounds_queued_behind_a_commit_apply_together_and_a_failing_one_fails_alone,
    a_batch_sharing_large_payloads_reads_each_back_exactly,
    a_batch_stores_what_one_by_one_stores_and_answers_conflicts_the_same,
    a_batch_past_one_statement_keeps_its_order_and_answers_conflicts_per_op,
);

fn op(outbox: &str, lanes: &[&str]) -> NewOp {
    let mut op = NewOp::new(outbox, "activitypub", r#"{"type":"Announce"}"#);
    op.lanes = lanes.iter().map(|l| (*l).to_owned()).collect();
    op
}

fn lease_spec(owner: &str) -> LeaseSpec {
    LeaseSpec {
        owner: owner.to_owned(),
        duration: Duration::from_secs(30),
    }
}

fn claim_all(limit: u32) -> ClaimRequest {
    ClaimRequest {
        outbox: None,
        kinds: None,
        limit,
        lease: lease_spec("test-host"),
    }
}

fn record(db: &TestDb, class: AttemptClass) -> AttemptRecord {
    let now = laneway::clock::Clock::now(&db.clock);
    AttemptRecord {
        started_at: now,
        finished_at: now,
        class,
        detail: Some("202".to_owned()),
        fee: None,
        error: None,
    }
}

fn confirm(db: &TestDb, lease: Lease) -> Completion {
    confirm_at(laneway::clock::Clock::now(&db.clock), lease)
}

/// A confirmation of the attempt under `lease`, at `now`.
fn confirm_at(now: chrono::DateTime<chrono::Utc>, lease: Lease) -> Completion {
    Completion {
        lease,
        finish: Finish::Confirm { receipt: None },
        attempt: AttemptRecord {
            started_at: now,
            finished_at: now,
            class: AttemptClass::Confirmed,
            detail: Some("202".to_owned()),
            fee: None,
            error: None,
        },
    }
}

async fn claim_one(q: &dyn Queue) -> anyhow::Result<Claimed> {
    let mut claimed = q.claim(&claim_all(1)).await?;
    claimed.pop().context("expected one claimable op")
}

/// An op's attempt rows as (attempt, class), as the store lists them.
async fn history(q: &dyn Queue, id: i64) -> anyhow::Result<Vec<(i32, AttemptClass)>> {
    Ok(q.attempts(id)
        .await?
        .iter()
        .map(|a| (a.attempt, a.record.class))
        .collect())
}

async fn enqueue_one(q: &dyn Queue, op: NewOp) -> anyhow::Result<i64> {
    let results = q.enqueue(&[op]).await?;
    match results.as_slice() {
        [Enqueued::Created(id)] => Ok(*id),
        other => anyhow::bail!("expected a created op, got {other:?}"),
    }
}

async fn enqueue_stores_every_field_and_the_payload_text_exactly(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    // Key order and white space are the producer's; the store must not normalise them.
    let payload = "{ \"z\": 1,  \"a\": [true, null] }";
    let mut new = NewOp::new("https://a.example/actor", "activitypub", payload);
    new.priority = Priority::Critical;
    new.lanes = vec![
        "https://b.example/inbox".into(),
        "https://c.example/inbox".into(),
        "https://b.example/inbox".into(),
    ];
    new.idempotency_key = Some("idem-1".into());
    new.coalesce_key = Some("announce:entry-1:b".into());
    new.subject = Some("user-7".into());
    new.correlation_id = Some("urn:ledger:1".into());
    let id = enqueue_one(q, new).await?;
    let op = q.get(id).await?.context("stored op")?;
    ensure!(op.payload == payload, "payload changed: {:?}", op.payload);
    ensure!(op.priority == Priority::Critical);
    ensure!(
        op.lanes
            == vec![
                "https://b.example/inbox".to_owned(),
                "https://c.example/inbox".to_owned()
            ],
        "{:?}",
        op.lanes
    );
    ensure!(op.status == Status::Pending && op.attempts == 0 && op.lease_token.is_none());
    ensure!(op.idempotency_key.as_deref() == Some("idem-1"));
    ensure!(op.coalesce_key.as_deref() == Some("announce:entry-1:b"));
    ensure!(op.subject.as_deref() == Some("user-7"));
    ensure!(op.correlation_id.as_deref() == Some("urn:ledger:1"));
    ensure!(
        op.created_at == laneway::clock::Clock::now(&db.clock),
        "created_at {}",
        op.created_at
    );
    ensure!(q.get(id + 1000).await?.is_none());
    Ok(())
}

async fn idempotency_key_returns_the_existing_op_forever(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let mut first = op("outbox-a", &["L"]);
    first.idempotency_key = Some("deposit:u1:tx9".into());
    let id = enqueue_one(q, first.clone()).await?;
    // Within one batch too.
    let again = q.enqueue(&[first.clone(), first.clone()]).await?;
    ensure!(
        again == vec![Enqueued::Existing(id), Enqueued::Existing(id)],
        "{again:?}"
    );
    // Still the same op after it has been delivered: keys never expire.
    let claimed = claim_one(q).await?;
    ensure!(q.complete(&[confirm(&db, claimed.lease)]).await? == vec![Cas::Applied]);
    ensure!(q.enqueue(&[first.clone()]).await? == vec![Enqueued::Existing(id)]);
    // The key is per outbox.
    let mut other = first;
    other.outbox = "outbox-b".into();
    ensure!(matches!(q.enqueue(&[other]).await?.as_slice(), [Enqueued::Created(o)] if *o != id));
    Ok(())
}

async fn coalesce_key_declines_while_pending_and_frees_at_terminal(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let mut announce = op("case-manager", &["https://coord/inbox"]);
    announce.coalesce_key = Some("announce:entry-4:coord".into());
    let id = enqueue_one(q, announce.clone()).await?;
    ensure!(q.enqueue(&[announce.clone()]).await? == vec![Enqueued::AlreadyPending(id)]);
    // Still declined while it is in flight.
    let claimed = claim_one(q).await?;
    ensure!(q.enqueue(&[announce.clone()]).await? == vec![Enqueued::AlreadyPending(id)]);
    // Once delivered, a replay is a new op.
    q.complete(&[confirm(&db, claimed.lease)]).await?;
    ensure!(matches!(q.enqueue(&[announce]).await?.as_slice(), [Enqueued::Created(n)] if *n > id));
    ensure!(
        q.list(&OpFilter {
            limit: 10,
            ..OpFilter::default()
        })
        .await?
        .len()
            == 2
    );
    Ok(())
}

async fn an_invalid_op_in_a_batch_writes_nothing(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let good = op("o", &["L"]);
    let mut bad = op("o", &["L"]);
    bad.payload = "{not json".into();
    let err = q
        .enqueue(&[good.clone(), bad])
        .await
        .err()
        .context("expected an error")?;
    ensure!(matches!(err, QueueError::InvalidOp(_)), "{err}");
    let mut big = good.clone();
    big.payload = format!("\"{}\"", "x".repeat(1024 * 1024)).into();
    ensure!(matches!(q.enqueue(&[good, big]).await, Err(QueueError::InvalidOp(_))));
    ensure!(q
        .list(&OpFilter {
            limit: 10,
            ..OpFilter::default()
        })
        .await?
        .is_empty());
    Ok(())
}

async fn claim_takes_due_ops_by_priority_then_sequence(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let mut ops = Vec::new();
    for (i, priority) in [
        Priority::Low,
        Priority::Normal,
        Priority::Critical,
        Priority::Normal,
        Priority::Low,
    ]
    .into_iter()
    .enumerate()
    {
        let mut o = op("o", &[&format!("L{i}")]);
        o.priority = priority;
        ops.push(o);
    }
    let mut later = op("o", &["later"]);
    later.priority = Priority::Critical;
    later.not_before = Some(laneway::clock::Clock::now(&db.clock) + Span::seconds(60));
    ops.push(later);
    let ids: Vec<i64> = q.enqueue(&ops).await?.into_iter().map(Enqueued::id).collect();
    let claimed = q.claim(&claim_all(10)).await?;
    let order: Vec<i64> = claimed.iter().map(|c| c.op.id).collect();
    ensure!(
        order == vec![ids[2], ids[1], ids[3], ids[0], ids[4]],
        "order {order:?} ids {ids:?}"
    );
    for c in &claimed {
        ensure!(c.op.status == Status::Submitted && c.op.attempts == 1 && c.lease.attempt == 1);
        ensure!(c.op.lease_owner.as_deref() == Some("test-host"));
        ensure!(c.op.lease_token == Some(c.lease.token));
    }
    ensure!(
        q.claim(&claim_all(10)).await?.is_empty(),
        "the delayed op is not due yet"
    );
    db.clock.advance(Span::seconds(61));
    ensure!(
        q.claim(&claim_all(10))
            .await?
            .iter()
            .map(|c| c.op.id)
            .collect::<Vec<_>>()
            == vec![ids[5]]
    );
    Ok(())
}

async fn claim_filters_by_outbox_and_kind(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let a = enqueue_one(q, op("a", &["L"])).await?;
    let mut deposit = op("b", &["G"]);
    deposit.kind = "deposit".into();
    let b = enqueue_one(q, deposit).await?;
    let only_b = ClaimRequest {
        outbox: Some("b".into()),
        ..claim_all(10)
    };
    ensure!(q.claim(&only_b).await?.iter().map(|c| c.op.id).collect::<Vec<_>>() == vec![b]);
    let _ = a;
    let only_kind = ClaimRequest {
        kinds: Some(vec!["deposit".into(), "withdraw".into()]),
        ..claim_all(10)
    };
    ensure!(q.claim(&only_kind).await?.is_empty(), "the deposit is already claimed");
    let ap = ClaimRequest {
        kinds: Some(vec!["activitypub".into()]),
        ..claim_all(10)
    };
    ensure!(q.claim(&ap).await?.iter().map(|c| c.op.id).collect::<Vec<_>>() == vec![a]);
    Ok(())
}

async fn claim_ids_takes_only_ops_still_pending(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let ids: Vec<i64> = q
        .enqueue(&[op("o", &["A"]), op("o", &["B"]), op("o", &["C"])])
        .await?
        .into_iter()
        .map(Enqueued::id)
        .collect();
    let first = q
        .claim_ids(&[ids[0], ids[2]], &lease_spec("h1"), &LaneRules::default())
        .await?;
    ensure!(first.iter().map(|c| c.op.id).collect::<Vec<_>>() == vec![ids[0], ids[2]]);
    q.cancel(ids[1]).await?;
    let second = q.claim_ids(&ids, &lease_spec("h2"), &LaneRules::default()).await?;
    ensure!(second.is_empty(), "claimed {second:?}");
    ensure!(q
        .claim_ids(&[], &lease_spec("h2"), &LaneRules::default())
        .await?
        .is_empty());
    Ok(())
}

/// A channel pool's re-deal: an op moves only while it waits (not claimed,
/// no receipt) with exactly the one lane the move expects; its lane index
/// follows, so listings by lane find it on its new channel.
async fn redeal_moves_only_a_waiting_op_with_one_lane_by_compare_and_set(db: TestDb) -> anyhow::Result<()> {
    use laneway::queue::Redeal;
    let q = db.queue.as_ref();
    let ids: Vec<i64> = q
        .enqueue(&[op("o", &["GA"]), op("o", &["GA"]), op("o", &["GA", "GB"])])
        .await?
        .into_iter()
        .map(Enqueued::id)
        .collect();
    let claimed = q.claim_ids(&[ids[1]], &lease_spec("h1"), &LaneRules::default()).await?;
    ensure!(claimed.len() == 1);
    let to_b = |id: i64| Redeal {
        op: id,
        from: "GA".to_owned(),
        to: "GB".to_owned(),
    };
    let moved = q.redeal(&[to_b(ids[2]), to_b(ids[1]), to_b(ids[0])]).await?;
    ensure!(moved == vec![ids[0]], "only the waiting one-lane op moves: {moved:?}");
    ensure!(q.get(ids[0]).await?.context("op")?.lanes == ["GB"]);
    ensure!(
        q.get(ids[1]).await?.context("op")?.lanes == ["GA"],
        "a claimed op keeps its lane"
    );
    ensure!(q.get(ids[2]).await?.context("op")?.lanes == ["GA", "GB"]);
    let on = |lane: &str| OpFilter {
        lane: Some(lane.to_owned()),
        limit: 10,
        ..OpFilter::default()
    };
    let on_b: Vec<i64> = q.list(&on("GB")).await?.iter().map(|o| o.id).collect();
    let on_a: Vec<i64> = q.list(&on("GA")).await?.iter().map(|o| o.id).collect();
    ensure!(
        on_b.contains(&ids[0]) && !on_a.contains(&ids[0]),
        "lane index: A {on_a:?}, B {on_b:?}"
    );
    // The move already made: its `from` no longer holds.
    ensure!(q.redeal(&[to_b(ids[0])]).await?.is_empty());
    let redealt = q.redealt(&ids).await?;
    ensure!(redealt == vec![ids[0]], "the moves are on record: {redealt:?}");
    ensure!(q.redealt(&[]).await?.is_empty());
    Ok(())
}

async fn eight_claimers_never_share_an_op(db: TestDb) -> anyhow::Result<()> {
    const OPS: usize = 10_000;
    let q = db.queue.clone();
    let batch: Vec<NewOp> = (0..1000)
        .map(|i| op(&format!("outbox-{}", i % 7), &[&format!("lane-{i}")]))
        .collect();
    for _ in 0..OPS / 1000 {
        q.enqueue(&batch).await?;
    }
    let mut workers = Vec::new();
    for w in 0..8 {
        let q: Arc<dyn Queue> = q.clone();
        let clock = db.clock.clone();
        workers.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            let request = ClaimRequest {
                lease: lease_spec(&format!("claimer-{w}")),
                ..claim_all(64)
            };
            loop {
                let claimed = q.claim(&request).await?;
                if claimed.is_empty() {
                    break;
                }
                let now = laneway::clock::Clock::now(&clock);
                let completions: Vec<Completion> = claimed.iter().map(|c| confirm_at(now, c.lease)).collect();
                let results = q.complete(&completions).await?;
                anyhow::ensure!(results.iter().all(|r| r.applied()), "a fresh lease was refused");
                mine.extend(claimed.iter().map(|c| c.op.id));
            }
            anyhow::Ok(mine)
        }));
    }
    let mut seen = HashSet::new();
    let mut total = 0;
    for w in workers {
        for id in w.await?? {
            total += 1;
            ensure!(seen.insert(id), "op {id} was claimed twice");
        }
    }
    ensure!(total == OPS, "claimed {total} of {OPS}");
    let depth = q.depth().await?;
    let confirmed: i64 = depth
        .iter()
        .filter(|d| d.status == Status::Confirmed)
        .map(|d| d.count)
        .sum();
    ensure!(confirmed == OPS as i64, "{depth:?}");
    Ok(())
}

async fn a_stale_lease_cannot_complete_or_checkpoint(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let id = enqueue_one(q, op("o", &["L"])).await?;
    let stale = claim_one(q).await?;
    // The holder stalls past its lease; recovery takes the op back.
    db.clock.advance(Span::seconds(31));
    let expired = q.expired_leases(10).await?;
    ensure!(
        expired.iter().map(|c| c.lease).collect::<Vec<_>>() == vec![stale.lease],
        "{expired:?}"
    );
    ensure!(
        q.expire(&stale.lease, ExpireTo::Retry(laneway::clock::Clock::now(&db.clock)))
            .await?
            == Cas::Applied
    );
    ensure!(
        q.expire(&stale.lease, ExpireTo::Retry(laneway::clock::Clock::now(&db.clock)))
            .await?
            == Cas::Stale
    );
    let fresh = claim_one(q).await?;
    ensure!(fresh.lease.attempt == 2 && fresh.lease.token != stale.lease.token);
    // The stalled dispatcher wakes up and reports: every change is refused.
    ensure!(q.complete(&[confirm(&db, stale.lease)]).await? == vec![Cas::Stale]);
    ensure!(q.checkpoint(&stale.lease, "tx-old").await? == Cas::Stale);
    ensure!(q.extend_leases(&[stale.lease], Duration::from_secs(30)).await? == vec![Cas::Stale]);
    // A forged token for the current attempt is refused too.
    let forged = Lease {
        token: uuid::Uuid::new_v4(),
        ..fresh.lease
    };
    ensure!(q.complete(&[confirm(&db, forged)]).await? == vec![Cas::Stale]);
    ensure!(q.complete(&[confirm(&db, fresh.lease)]).await? == vec![Cas::Applied]);
    // Completing twice is refused: confirmed is terminal.
    ensure!(q.complete(&[confirm(&db, fresh.lease)]).await? == vec![Cas::Stale]);
    let op = q.get(id).await?.context("op")?;
    ensure!(op.status == Status::Confirmed && op.finished_at.is_some() && op.lease_token.is_none());
    let history = history(q, id).await?;
    ensure!(
        history == vec![(1, AttemptClass::LeaseExpired), (2, AttemptClass::Confirmed)],
        "{history:?}"
    );
    Ok(())
}

/// One batch holding a forged settle beside two good ones: the good ones
/// apply with one attempt row each, the forged one changes nothing and
/// writes no row (SQLite writes the attempt rows of the settles that
/// applied in a statement of their own, after the batch's updates).
async fn a_batch_of_settles_records_the_attempts_of_those_that_apply(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let ids = [
        enqueue_one(q, op("o", &["A"])).await?,
        enqueue_one(q, op("o", &["B"])).await?,
        enqueue_one(q, op("o", &["C"])).await?,
    ];
    let claimed = q.claim(&claim_all(3)).await?;
    let lease = |id: i64| {
        claimed
            .iter()
            .find(|c| c.op.id == id)
            .map(|c| c.lease)
            .context("claimed")
    };
    let forged = Lease {
        token: uuid::Uuid::new_v4(),
        ..lease(ids[0])?
    };
    let batch = [
        confirm(&db, forged),
        confirm(&db, lease(ids[1])?),
        confirm(&db, lease(ids[2])?),
    ];
    let done = q.complete(&batch).await?;
    ensure!(done == vec![Cas::Stale, Cas::Applied, Cas::Applied], "{done:?}");
    let forged_history = history(q, ids[0]).await?;
    ensure!(forged_history.is_empty(), "{forged_history:?}");
    for id in &ids[1..] {
        let rows = history(q, *id).await?;
        ensure!(rows == vec![(1, AttemptClass::Confirmed)], "{rows:?}");
    }
    let op = q.get(ids[0]).await?.context("op")?;
    ensure!(op.status == Status::Submitted && op.lease_token == Some(lease(ids[0])?.token));
    // The holder's own settle still applies, and records its one row.
    ensure!(q.complete(&[confirm(&db, lease(ids[0])?)]).await? == vec![Cas::Applied]);
    ensure!(history(q, ids[0]).await? == vec![(1, AttemptClass::Confirmed)]);
    Ok(())
}

async fn retry_backs_off_and_counts_attempts_across_claims(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let id = enqueue_one(q, op("o", &["L"])).await?;
    for attempt in 1..=3 {
        let c = claim_one(q).await?;
        ensure!(c.lease.attempt == attempt);
        let next = laneway::clock::Clock::now(&db.clock) + Span::seconds(10);
        let retry = Completion {
            lease: c.lease,
            finish: Finish::Retry {
                next_attempt_at: next,
                error: format!("HTTP 503 on attempt {attempt}"),
                fee_bump: true,
                receipt_settled: false,
            },
            attempt: AttemptRecord {
                detail: Some("503".into()),
                error: Some("service unavailable".into()),
                ..record(&db, AttemptClass::Retryable)
            },
        };
        ensure!(q.complete(&[retry]).await? == vec![Cas::Applied]);
        let op = q.get(id).await?.context("op")?;
        ensure!(op.status == Status::Pending && op.next_attempt_at == next && op.attempts == attempt);
        ensure!(op.last_error.as_deref() == Some(format!("HTTP 503 on attempt {attempt}").as_str()));
        ensure!(q.claim(&claim_all(1)).await?.is_empty(), "claimed during backoff");
        db.clock.advance(Span::seconds(10));
    }
    let op = q.get(id).await?.context("op")?;
    ensure!(op.fee_bumps == 3 && op.budget_attempts() == 3);
    let history = q.attempts(id).await?;
    ensure!(history.len() == 3 && history.iter().all(|a| a.record.class == AttemptClass::Retryable));
    ensure!(history[2].record.detail.as_deref() == Some("503"));
    Ok(())
}

async fn permanent_failure_dead_letters_and_force_retry_grants_a_fresh_budget(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let mut new = op("o", &["L"]);
    new.correlation_id = Some("urn:ledger:entry-9".into());
    let id = enqueue_one(q, new).await?;
    let c = claim_one(q).await?;
    let fail = Completion {
        lease: c.lease,
        finish: Finish::Fail {
            error: "HTTP 410 Gone".into(),
            halt_lanes: false,
        },
        attempt: AttemptRecord {
            detail: Some("410".into()),
            ..record(&db, AttemptClass::Permanent)
        },
    };
    ensure!(q.complete(&[fail]).await? == vec![Cas::Applied]);
    let dead = q.get(id).await?.context("op")?;
    ensure!(dead.status == Status::Failed && dead.finished_at.is_some());
    ensure!(
        dead.last_error.as_deref() == Some("HTTP 410 Gone")
            && dead.correlation_id.as_deref() == Some("urn:ledger:entry-9")
    );
    ensure!(q.claim(&claim_all(1)).await?.is_empty(), "a dead letter was claimed");
    let retried = q.force_retry(id).await?;
    ensure!(retried.status == Status::Pending && retried.finished_at.is_none());
    ensure!(retried.attempts == 1 && retried.attempt_floor == 1 && retried.budget_attempts() == 0);
    match q.force_retry(id).await {
        Err(QueueError::Illegal { id: got, .. }) if got == id => {}
        other => anyhow::bail!("force-retry of a pending op gave {other:?}"),
    }
    let again = claim_one(q).await?;
    ensure!(again.lease.attempt == 2, "attempt numbers are never reused");
    ensure!(matches!(q.force_retry(id + 99).await, Err(QueueError::NotFound(_))));
    Ok(())
}

async fn cancel_only_applies_to_pending_ops(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let a = enqueue_one(q, op("o", &["A"])).await?;
    let b = enqueue_one(q, op("o", &["B"])).await?;
    let cancelled = q.cancel(a).await?;
    ensure!(cancelled.status == Status::Cancelled && cancelled.finished_at.is_some());
    let claimed = claim_one(q).await?;
    ensure!(claimed.op.id == b);
    match q.cancel(b).await {
        Err(QueueError::Illegal { source, .. }) => ensure!(source.from == Status::Submitted),
        other => anyhow::bail!("cancel of a submitted op gave {other:?}"),
    }
    ensure!(matches!(q.cancel(a).await, Err(QueueError::Illegal { .. })));
    ensure!(matches!(q.cancel(b + 50).await, Err(QueueError::NotFound(_))));
    ensure!(q.get(b).await?.map(|o| o.status) == Some(Status::Submitted));
    Ok(())
}

async fn extended_leases_do_not_expire(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    enqueue_one(q, op("o", &["A"])).await?;
    enqueue_one(q, op("o", &["B"])).await?;
    let claimed = q.claim(&claim_all(2)).await?;
    db.clock.advance(Span::seconds(20));
    ensure!(q.extend_leases(&[claimed[0].lease], Duration::from_secs(30)).await? == vec![Cas::Applied]);
    db.clock.advance(Span::seconds(20));
    let expired: Vec<Lease> = q.expired_leases(10).await?.iter().map(|c| c.lease).collect();
    ensure!(expired == vec![claimed[1].lease], "{expired:?}");
    Ok(())
}

async fn checkpointed_receipt_survives_lease_expiry(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let id = enqueue_one(q, op("o", &["signer"])).await?;
    let c = claim_one(q).await?;
    ensure!(q.checkpoint(&c.lease, r#"{"hash":"d8ec9b68"}"#).await? == Cas::Applied);
    db.clock.advance(Span::seconds(31));
    ensure!(
        q.expire(&c.lease, ExpireTo::Retry(laneway::clock::Clock::now(&db.clock)))
            .await?
            == Cas::Applied
    );
    let reclaimed = claim_one(q).await?;
    ensure!(
        reclaimed.op.receipt.as_deref() == Some(r#"{"hash":"d8ec9b68"}"#),
        "the receipt must reach reconcile"
    );
    let done = Completion {
        lease: reclaimed.lease,
        finish: Finish::Confirm {
            receipt: Some(r#"{"hash":"d8ec9b68","ledger":42}"#.into()),
        },
        attempt: record(&db, AttemptClass::Confirmed),
    };
    q.complete(&[done]).await?;
    ensure!(q.get(id).await?.and_then(|o| o.receipt).as_deref() == Some(r#"{"hash":"d8ec9b68","ledger":42}"#));
    Ok(())
}

async fn expiry_at_the_budget_dead_letters(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let id = enqueue_one(q, op("o", &["L"])).await?;
    let c = claim_one(q).await?;
    db.clock.advance(Span::seconds(31));
    ensure!(q.expire(&c.lease, ExpireTo::DeadLetter { halt_lanes: false }).await? == Cas::Applied);
    let op = q.get(id).await?.context("op")?;
    ensure!(
        op.status == Status::Failed && op.finished_at.is_some() && op.last_error.as_deref() == Some("lease expired")
    );
    Ok(())
}

async fn list_filters_and_depth(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let mut a = op("alice", &["L1"]);
    a.subject = Some("u1".into());
    let mut b = op("bob", &["L2"]);
    b.kind = "withdraw".into();
    b.priority = Priority::Critical;
    let c = op("alice", &["L3"]);
    let ids: Vec<i64> = q.enqueue(&[a, b, c]).await?.into_iter().map(Enqueued::id).collect();
    let all = |f: OpFilter| OpFilter { limit: 100, ..f };
    let ids_of = |ops: Vec<laneway::op::Op>| ops.into_iter().map(|o| o.id).collect::<Vec<_>>();
    ensure!(ids_of(q.list(&all(OpFilter::default())).await?) == ids);
    ensure!(
        ids_of(
            q.list(&all(OpFilter {
                outbox: Some("alice".into()),
                ..OpFilter::default()
            }))
            .await?
        ) == vec![ids[0], ids[2]]
    );
    ensure!(
        ids_of(
            q.list(&all(OpFilter {
                kind: Some("withdraw".into()),
                ..OpFilter::default()
            }))
            .await?
        ) == vec![ids[1]]
    );
    ensure!(
        ids_of(
            q.list(&all(OpFilter {
                priority: Some(Priority::Critical),
                ..OpFilter::default()
            }))
            .await?
        ) == vec![ids[1]]
    );
    ensure!(
        ids_of(
            q.list(&all(OpFilter {
                subject: Some("u1".into()),
                ..OpFilter::default()
            }))
            .await?
        ) == vec![ids[0]]
    );
    ensure!(
        ids_of(
            q.list(&all(OpFilter {
                newest_first: true,
                ..OpFilter::default()
            }))
            .await?
        ) == vec![ids[2], ids[1], ids[0]]
    );
    ensure!(
        ids_of(
            q.list(&OpFilter {
                limit: 1,
                after_id: Some(ids[0]),
                ..OpFilter::default()
            })
            .await?
        ) == vec![ids[1]]
    );
    q.cancel(ids[2]).await?;
    ensure!(
        ids_of(
            q.list(&all(OpFilter {
                status: Some(Status::Cancelled),
                ..OpFilter::default()
            }))
            .await?
        ) == vec![ids[2]]
    );
    let depth: Vec<(Status, Priority, i64)> = q
        .depth()
        .await?
        .iter()
        .map(|d| (d.status, d.priority, d.count))
        .collect();
    for want in [
        (Status::Pending, Priority::Critical, 1),
        (Status::Pending, Priority::Normal, 1),
        (Status::Cancelled, Priority::Normal, 1),
    ] {
        ensure!(depth.contains(&want), "{want:?} not in {depth:?}");
    }
    ensure!(depth.len() == 3, "{depth:?}");
    Ok(())
}

async fn candidates_are_the_outbox_non_terminal_ops_in_dispatch_order(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let mut crit = op("o", &["A"]);
    crit.priority = Priority::Critical;
    let ids: Vec<i64> = q
        .enqueue(&[
            op("o", &["A"]),
            op("o", &["B"]),
            crit,
            op("other", &["A"]),
            op("o", &["C"]),
        ])
        .await?
        .into_iter()
        .map(Enqueued::id)
        .collect();
    q.cancel(ids[4]).await?;
    q.claim_ids(&[ids[1]], &lease_spec("h"), &LaneRules::default()).await?;
    let got: Vec<(i64, Status)> = q
        .candidates("o", 100)
        .await?
        .iter()
        .map(|c| (c.op.id, c.op.status))
        .collect();
    ensure!(
        got == vec![
            (ids[2], Status::Pending),
            (ids[0], Status::Pending),
            (ids[1], Status::Submitted)
        ],
        "{got:?}"
    );
    ensure!(q.candidates("o", 1).await?.len() == 1);
    Ok(())
}

async fn due_outboxes_lists_only_outboxes_with_due_work(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let mut later = op("later", &["L"]);
    later.not_before = Some(laneway::clock::Clock::now(&db.clock) + Span::seconds(5));
    q.enqueue(&[op("now", &["A"]), op("now", &["B"]), later, op("claimed", &["C"])])
        .await?;
    q.claim(&ClaimRequest {
        outbox: Some("claimed".into()),
        ..claim_all(10)
    })
    .await?;
    ensure!(q.due_outboxes(10).await? == vec!["now".to_owned()]);
    db.clock.advance(Span::seconds(5));
    let mut due = q.due_outboxes(10).await?;
    due.sort();
    ensure!(due == vec!["later".to_owned(), "now".to_owned()], "{due:?}");
    Ok(())
}

async fn a_drain_slot_has_one_holder_until_it_lapses(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let ttl = Duration::from_secs(10);
    let first = q.acquire_slot("o", "host-a", ttl).await?.context("free slot")?;
    ensure!(q.acquire_slot("o", "host-b", ttl).await?.is_none(), "two holders");
    ensure!(
        q.acquire_slot("p", "host-b", ttl).await?.is_some(),
        "slots are per outbox"
    );
    db.clock.advance(Span::seconds(8));
    ensure!(q.renew_slot(&first, ttl).await? == Cas::Applied);
    db.clock.advance(Span::seconds(8));
    ensure!(
        q.acquire_slot("o", "host-b", ttl).await?.is_none(),
        "a renewed slot was taken"
    );
    // The holder dies without releasing: the slot lapses and another host takes it.
    db.clock.advance(Span::seconds(3));
    let second = q.acquire_slot("o", "host-b", ttl).await?.context("lapsed slot")?;
    ensure!(
        q.renew_slot(&first, ttl).await? == Cas::Stale,
        "the old holder renewed a taken slot"
    );
    q.release_slot(&first).await?;
    ensure!(
        q.acquire_slot("o", "host-a", ttl).await?.is_none(),
        "a stale release freed the slot"
    );
    q.release_slot(&second).await?;
    ensure!(q.acquire_slot("o", "host-a", ttl).await?.is_some());
    Ok(())
}

async fn a_halting_dead_letter_holds_its_lanes_until_skipped_or_retried(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let id = enqueue_one(q, op("o", &["A", "B"])).await?;
    let c = claim_one(q).await?;
    let fail = Completion {
        lease: c.lease,
        finish: Finish::Fail {
            error: "poison".into(),
            halt_lanes: true,
        },
        attempt: record(&db, AttemptClass::Permanent),
    };
    ensure!(q.complete(&[fail]).await? == vec![Cas::Applied]);
    let halts: Vec<(String, i64)> = q
        .lane_halts(Some("o"))
        .await?
        .into_iter()
        .map(|h| (h.lane, h.op_id))
        .collect();
    ensure!(halts == vec![("A".to_owned(), id), ("B".to_owned(), id)], "{halts:?}");
    ensure!(q.lane_halts(Some("elsewhere")).await?.is_empty());
    ensure!(q.lane_halts(None).await?.len() == 2);
    ensure!(q.skip_lane("o", "A").await? == 1);
    ensure!(
        q.lane_halts(None)
            .await?
            .iter()
            .map(|h| h.lane.as_str())
            .collect::<Vec<_>>()
            == vec!["B"]
    );
    q.force_retry(id).await?;
    ensure!(
        q.lane_halts(None).await?.is_empty(),
        "a retried dead letter still holds its lanes"
    );
    // A lease that lapses at the budget halts too.
    let c = claim_one(q).await?;
    db.clock.advance(Span::seconds(31));
    ensure!(q.expire(&c.lease, ExpireTo::DeadLetter { halt_lanes: true }).await? == Cas::Applied);
    ensure!(q.lane_halts(Some("o")).await?.len() == 2);
    Ok(())
}

async fn halted_subjects_are_flagged_on_their_candidates(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let mut frozen = op("o", &["A"]);
    frozen.subject = Some("user-1".into());
    let mut free = op("o", &["B"]);
    free.subject = Some("user-2".into());
    q.enqueue(&[frozen, free]).await?;
    q.halt_subject("user-1", Some("compliance hold")).await?;
    q.halt_subject("user-1", Some("still held")).await?;
    let flags: Vec<(Option<String>, bool)> = q
        .candidates("o", 10)
        .await?
        .into_iter()
        .map(|c| (c.op.subject, c.subject_halted))
        .collect();
    ensure!(
        flags == vec![(Some("user-1".into()), true), (Some("user-2".into()), false)],
        "{flags:?}"
    );
    let halted = q.halted_subjects().await?;
    ensure!(
        halted.len() == 1 && halted[0].reason.as_deref() == Some("still held"),
        "{halted:?}"
    );
    ensure!(q.unhalt_subject("user-1").await?);
    ensure!(!q.unhalt_subject("user-1").await?);
    ensure!(q.candidates("o", 10).await?.iter().all(|c| !c.subject_halted));
    Ok(())
}

async fn fee_snapshots_only_move_forward(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let t0 = laneway::clock::Clock::now(&db.clock);
    ensure!(q.fee_snapshot("stellar").await?.is_none());
    ensure!(q.put_fee_snapshot("stellar", r#"{"v":1}"#, t0).await? == Cas::Applied);
    ensure!(
        q.put_fee_snapshot("stellar", r#"{"v":2}"#, t0 + Span::seconds(10))
            .await?
            == Cas::Applied
    );
    // A host with an older sample must not overwrite a newer one.
    ensure!(
        q.put_fee_snapshot("stellar", r#"{"v":0}"#, t0 + Span::seconds(5))
            .await?
            == Cas::Stale
    );
    let (json, at) = q.fee_snapshot("stellar").await?.context("snapshot")?;
    ensure!(
        json.replace(' ', "") == r#"{"v":2}"# && at == t0 + Span::seconds(10),
        "{json} {at}"
    );
    ensure!(q.fee_snapshot("other").await?.is_none());
    Ok(())
}

fn serial(cap: usize) -> LaneRules {
    LaneRules(std::collections::HashMap::from([(
        "activitypub".to_owned(),
        LaneRule {
            mode: LaneMode::Serial,
            cap,
        },
    )]))
}

async fn claimed_ids(q: &dyn Queue, ids: &[i64], rules: &LaneRules) -> anyhow::Result<Vec<i64>> {
    Ok(q.claim_ids(ids, &lease_spec("h"), rules)
        .await?
        .into_iter()
        .map(|c| c.op.id)
        .collect())
}

/// A lane names a resource, not a position in one outbox: an op in flight in
/// one outbox keeps another outbox's op of the same lane from being claimed.
async fn a_lane_occupied_in_another_outbox_refuses_the_claim(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let a = enqueue_one(q, op("outbox-a", &["GSIGNER"])).await?;
    let b = enqueue_one(q, op("outbox-b", &["GSIGNER"])).await?;
    let c = enqueue_one(q, op("outbox-b", &["OTHER"])).await?;
    let rules = LaneRules::default();
    let first = q.claim_ids(&[a], &lease_spec("h1"), &rules).await?;
    ensure!(first.len() == 1);
    ensure!(claimed_ids(q, &[b, c], &rules).await? == vec![c], "b shares a's lane");
    let occupants = q.occupants(&["GSIGNER".to_owned()]).await?;
    let other: Vec<i64> = q.occupants(&["OTHER".to_owned()]).await?.iter().map(|o| o.id).collect();
    ensure!(other == vec![c], "only the ops of the lanes asked for: {other:?}");
    ensure!(
        occupants.iter().any(|o| o.id == a && o.in_flight && !o.in_doubt),
        "{occupants:?}"
    );
    ensure!(q.complete(&[confirm(&db, first[0].lease)]).await? == vec![Cas::Applied]);
    ensure!(claimed_ids(q, &[b], &rules).await? == vec![b]);
    Ok(())
}

async fn serial_caps_count_across_outboxes(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let mut ids = Vec::new();
    for outbox in ["o1", "o2", "o3"] {
        ids.push(enqueue_one(q, op(outbox, &["L"])).await?);
    }
    let rules = serial(2);
    ensure!(claimed_ids(q, &[ids[0]], &rules).await? == vec![ids[0]]);
    ensure!(claimed_ids(q, &[ids[1]], &rules).await? == vec![ids[1]]);
    ensure!(
        claimed_ids(q, &[ids[2]], &rules).await?.is_empty(),
        "a third op on a lane capped at 2"
    );
    Ok(())
}

/// An op whose attempt checkpointed a receipt and ended without a verdict
/// holds its lanes, in every outbox, until a later attempt settles it; it
/// cannot be cancelled meanwhile; once settled it holds nothing.
async fn a_receipt_in_doubt_holds_its_lanes_until_settled(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let holder = enqueue_one(q, op("o1", &["GSIGNER"])).await?;
    let next = enqueue_one(q, op("o1", &["GSIGNER"])).await?;
    let elsewhere = enqueue_one(q, op("o2", &["GSIGNER"])).await?;
    let rules = serial(3);
    let c = q.claim_ids(&[holder], &lease_spec("h"), &rules).await?;
    let lease = c.first().context("claimed")?.lease;
    ensure!(q.checkpoint(&lease, "tx-1").await? == Cas::Applied);
    let retry = |lease, settled| Completion {
        lease,
        finish: Finish::Retry {
            next_attempt_at: laneway::clock::Clock::now(&db.clock),
            error: "504 after the send".into(),
            fee_bump: false,
            receipt_settled: settled,
        },
        attempt: record(&db, AttemptClass::Retryable),
    };
    ensure!(q.complete(&[retry(lease, false)]).await? == vec![Cas::Applied]);
    let op = q.get(holder).await?.context("op")?;
    ensure!(
        op.status == Status::Pending && op.receipt.as_deref() == Some("tx-1"),
        "{op:?}"
    );
    ensure!(
        q.occupants(&["GSIGNER".to_owned()])
            .await?
            .iter()
            .any(|o| o.id == holder && !o.in_flight && o.in_doubt),
        "a pending op in doubt occupies its lanes"
    );
    // Whatever the cap, nothing else of the lane starts, here or elsewhere.
    ensure!(claimed_ids(q, &[next, elsewhere], &rules).await?.is_empty());
    match q.cancel(holder).await {
        Err(QueueError::InDoubt(id)) => ensure!(id == holder),
        other => anyhow::bail!("cancel of an op in doubt gave {other:?}"),
    }
    // The holder itself goes, and settles: the lane is free again.
    let c = q.claim_ids(&[holder, next], &lease_spec("h"), &rules).await?;
    ensure!(c.iter().map(|c| c.op.id).collect::<Vec<_>>() == vec![holder], "{c:?}");
    ensure!(q.complete(&[retry(c[0].lease, true)]).await? == vec![Cas::Applied]);
    let op = q.get(holder).await?.context("op")?;
    ensure!(op.receipt.is_none(), "a settled receipt is cleared: {op:?}");
    ensure!(q.occupants(&["GSIGNER".to_owned()]).await?.is_empty());
    ensure!(claimed_ids(q, &[next, elsewhere], &rules).await? == vec![next, elsewhere]);
    // A receipt kept at a dead letter is evidence, and holds nothing.
    Ok(())
}

/// Eight claimers, each draining its own outbox, all on one lane: the lane
/// never has two ops in flight, on either backend (SQLite serializes the
/// claiming transactions; PostgreSQL takes the lane's advisory lock).
async fn concurrent_claimers_never_share_a_lane_across_outboxes(db: TestDb) -> anyhow::Result<()> {
    let mut outboxes = Vec::new();
    for i in 0..8 {
        let outbox = format!("outbox-{i}");
        let mut ids = Vec::new();
        for _ in 0..4 {
            ids.push(enqueue_one(db.queue.as_ref(), op(&outbox, &["GSHARED"])).await?);
        }
        outboxes.push(ids);
    }
    let overlaps = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for ids in outboxes {
        let queue = db.queue.clone();
        let clock = db.clock.clone();
        let overlaps = overlaps.clone();
        tasks.spawn(async move {
            let mut left = ids;
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while !left.is_empty() && std::time::Instant::now() < deadline {
                let claimed = queue.claim_ids(&left, &lease_spec("h"), &LaneRules::default()).await?;
                for c in claimed {
                    let busy = queue
                        .occupants(&["GSHARED".to_owned()])
                        .await?
                        .iter()
                        .filter(|o| o.in_flight)
                        .count();
                    if busy != 1 {
                        overlaps.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    tokio::task::yield_now().await;
                    queue
                        .complete(&[confirm_at(laneway::clock::Clock::now(&clock), c.lease)])
                        .await?;
                    left.retain(|id| *id != c.op.id);
                }
                tokio::task::yield_now().await;
            }
            anyhow::Ok(left.len())
        });
    }
    let mut unfinished = 0;
    while let Some(joined) = tasks.join_next().await {
        unfinished += joined??;
    }
    ensure!(unfinished == 0, "{unfinished} ops never claimed");
    let overlaps = overlaps.load(std::sync::atomic::Ordering::SeqCst);
    ensure!(overlaps == 0, "{overlaps} claims saw another op of the lane in flight");
    Ok(())
}

/// A drain's book: the first ops in dispatch order (no payload), or the ops
/// enqueued after an id, by id, whatever their tier.
async fn scan_reads_the_book_in_dispatch_order_or_the_ops_since_an_id(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let mut crit = op("o", &["A"]);
    crit.priority = Priority::Critical;
    crit.subject = Some("frozen".to_owned());
    let mut low = op("o", &["D"]);
    low.priority = Priority::Low;
    let ids: Vec<i64> = q
        .enqueue(&[
            op("o", &["A"]),
            op("o", &["B"]),
            crit,
            op("other", &["A"]),
            low,
            op("o", &["C"]),
        ])
        .await?
        .into_iter()
        .map(Enqueued::id)
        .collect();
    q.halt_subject("frozen", None).await?;
    q.cancel(ids[5]).await?;
    q.claim_ids(&[ids[1]], &lease_spec("h"), &LaneRules::default()).await?;
    let all = q.scan("o", None, 100).await?;
    let got: Vec<(i64, bool)> = all.iter().map(|r| (r.id, r.in_flight)).collect();
    ensure!(
        got == vec![(ids[2], false), (ids[0], false), (ids[1], true), (ids[4], false)],
        "dispatch order, non-terminal, this outbox only: {got:?}"
    );
    let crit_row = &all[0];
    ensure!(crit_row.subject_halted && crit_row.lanes == vec!["A".to_owned()] && crit_row.budget_attempts == 0);
    ensure!(all[2].budget_attempts == 1, "a claim counts an attempt");
    ensure!(q.scan("o", None, 2).await?.len() == 2, "the limit holds");
    let since: Vec<i64> = q.scan("o", Some(ids[0]), 100).await?.iter().map(|r| r.id).collect();
    ensure!(
        since == vec![ids[1], ids[2], ids[4]],
        "ops after an id come by id whatever their tier: {since:?}"
    );
    ensure!(q.scan("o", Some(ids[5]), 100).await?.is_empty());
    Ok(())
}

/// A read that goes on past a prefix starts right after the position it
/// is given, in dispatch order, across tiers, skipping terminal ops, and
/// takes only the first few ops of each lane set (the same lanes in the
/// same order).
async fn scan_beyond_goes_on_in_dispatch_order_with_a_few_ops_per_lane_set(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let tier = |p: Priority, lanes: &[&str]| {
        let mut o = op("o", lanes);
        o.priority = p;
        o
    };
    let ids: Vec<i64> = q
        .enqueue(&[
            tier(Priority::Normal, &["A"]),
            tier(Priority::Low, &["B"]),
            tier(Priority::Critical, &["C"]),
            tier(Priority::Normal, &["D"]),
            op("other", &["E"]),
            tier(Priority::Normal, &["F"]),
            tier(Priority::Normal, &["A"]),
            tier(Priority::Normal, &["A"]),
            tier(Priority::Normal, &["A", "F"]),
            tier(Priority::Critical, &["A"]),
        ])
        .await?
        .into_iter()
        .map(Enqueued::id)
        .collect();
    q.cancel(ids[3]).await?;
    let from = |p, id, per_set| async move {
        Ok::<Vec<i64>, anyhow::Error>(
            q.scan_beyond("o", (p, id), per_set, 100)
                .await?
                .iter()
                .map(|r| r.id)
                .collect(),
        )
    };
    let all = from(Priority::Critical, 0, 10).await?;
    ensure!(
        all == vec![ids[2], ids[9], ids[0], ids[5], ids[6], ids[7], ids[8], ids[1]],
        "from the start: {all:?}"
    );
    let two_each = from(Priority::Critical, 0, 2).await?;
    ensure!(
        two_each == vec![ids[2], ids[9], ids[0], ids[5], ids[8], ids[1]],
        "A's third and fourth ops are left out, [A, F] is a set of its own: {two_each:?}"
    );
    let after_first_normal = from(Priority::Normal, ids[0], 1).await?;
    ensure!(
        after_first_normal == vec![ids[5], ids[6], ids[8], ids[1]],
        "{after_first_normal:?}"
    );
    let after_critical = from(Priority::Critical, ids[9], 10).await?;
    ensure!(
        after_critical == vec![ids[0], ids[5], ids[6], ids[7], ids[8], ids[1]],
        "the next tier from its start: {after_critical:?}"
    );
    ensure!(from(Priority::Low, ids[1], 10).await?.is_empty());
    ensure!(
        q.scan_beyond("o", (Priority::Critical, 0), 10, 2).await?.len() == 2,
        "the limit holds"
    );
    Ok(())
}

/// One transaction settles a batch and then claims: the claim sees the
/// lanes the settles freed, a stale settle changes nothing, and every
/// settle is still a compare-and-set on its lease.
/// The next op of a lane may be claimed in the transaction that settles
/// the op before it, only if that settle applies: when the earlier op's
/// lease was lost (it expired back to pending), its successor must not
/// overtake it, although nothing occupies the lane.
async fn a_claim_that_follows_a_settle_is_made_only_if_the_settle_applies(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let rules = LaneRules::default();
    let first = enqueue_one(q, op("o", &["L"])).await?;
    let second = enqueue_one(q, op("o", &["L"])).await?;
    let lost = q
        .claim_ids(&[first], &lease_spec("h"), &rules)
        .await?
        .first()
        .context("claimed")?
        .lease;
    ensure!(q
        .expire(&lost, ExpireTo::Retry(laneway::clock::Clock::now(&db.clock)))
        .await?
        .applied());
    let (settled, got) = q
        .settle_then_claim(
            &[confirm(&db, lost)],
            &[second],
            &[(second, first)],
            &lease_spec("h"),
            &rules,
        )
        .await?;
    ensure!(
        settled == vec![Cas::Stale] && got.is_empty(),
        "the successor overtook: {got:?}"
    );
    ensure!(q.get(second).await?.context("second")?.status == Status::Pending);
    let lease = q
        .claim_ids(&[first], &lease_spec("h"), &rules)
        .await?
        .first()
        .context("again")?
        .lease;
    let (settled, got) = q
        .settle_then_claim(
            &[confirm(&db, lease)],
            &[second],
            &[(second, first)],
            &lease_spec("h"),
            &rules,
        )
        .await?;
    ensure!(settled == vec![Cas::Applied], "{settled:?}");
    ensure!(
        got.iter().map(|c| c.op.id).collect::<Vec<_>>() == vec![second],
        "{got:?}"
    );
    Ok(())
}

async fn settle_and_claim_settles_first_in_one_transaction(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let rules = LaneRules::default();
    let first = enqueue_one(q, op("o", &["L"])).await?;
    let second = enqueue_one(q, op("o", &["L"])).await?;
    let other = enqueue_one(q, op("o", &["M"])).await?;
    let claimed = q.claim_ids(&[first], &lease_spec("h"), &rules).await?;
    let lease = claimed.first().context("first claimed")?.lease;
    ensure!(claimed_ids(q, &[second], &rules).await?.is_empty(), "L is occupied");
    let mut stale = lease;
    stale.token = uuid::Uuid::new_v4();
    let (settled, got) = q
        .settle_and_claim(
            &[confirm(&db, stale), confirm(&db, lease)],
            &[second, other],
            &lease_spec("h"),
            &rules,
        )
        .await?;
    ensure!(settled == vec![Cas::Stale, Cas::Applied], "{settled:?}");
    let got: Vec<i64> = got.iter().map(|c| c.op.id).collect();
    ensure!(got == vec![second, other], "the settle freed L for the claim: {got:?}");
    ensure!(q.get(first).await?.context("first")?.status == Status::Confirmed);
    ensure!(
        q.attempts(first).await?.len() == 1,
        "one attempt row, for the settle that applied"
    );
    let (settled, got) = q.settle_and_claim(&[], &[], &lease_spec("h"), &rules).await?;
    ensure!(settled.is_empty() && got.is_empty());
    Ok(())
}

/// Hosts starting or reloading together each write the kind defaults: the
/// writes must never collide (two hosts once exited on a duplicate key).
async fn kind_defaults_written_by_many_hosts_at_once_never_collide(db: TestDb) -> anyhow::Result<()> {
    use laneway::op::Priority;
    let defaults: Vec<(String, Priority)> = (0..12)
        .map(|n| {
            (
                format!("kind{n}"),
                if n % 2 == 0 {
                    Priority::Normal
                } else {
                    Priority::Critical
                },
            )
        })
        .collect();
    for round in 0..10 {
        let mut tasks = Vec::new();
        for host in 0..6 {
            let queue = db.queue.clone();
            let mut mine = defaults.clone();
            // Hosts mid-rollout disagree about one kind.
            if host % 2 == 1 {
                mine.push((format!("extra{round}"), Priority::Low));
            }
            let pairs: Vec<(&str, Priority)> = mine.iter().map(|(k, p)| (k.as_str(), *p)).collect();
            let mut registry = laneway::queue::KindRegistry::priorities(&pairs);
            registry.max_payload_bytes = Some(1024 * 1024);
            tasks.push(tokio::spawn(async move { queue.register_kinds(&registry).await }));
        }
        for task in tasks {
            task.await??;
        }
    }
    Ok(())
}

/// A stored value no laneway writes (a hand edit, a restore gone wrong) is
/// `Corrupt`, naming the op and the column, on every backend: not an outage
/// on one and a bad row on the other.
async fn a_value_no_laneway_wrote_is_the_same_error_everywhere(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let id = enqueue_one(q, op("o", &["A"])).await?;
    let fine = enqueue_one(q, op("o", &["B"])).await?;
    let set = format!("UPDATE TABLE SET updated_at = {{}} WHERE id = {id}");
    let sqlite = set.replace("TABLE", "laneway_ops").replace("{}", "9223372036854775807");
    let postgres = set.replace("TABLE", "ops").replace("{}", "'infinity'");
    // The database refuses the value (laneway's update trigger; the times'
    // CHECK constraint)...
    let refused = db.tamper(&[&sqlite], &[&postgres]).await;
    ensure!(refused.is_err(), "an unreadable time was written");
    ensure!(q.get(id).await?.is_some(), "the refused edit left the op readable");
    // ...so only a hand that also lifts laneway's guards gets one in, and
    // then reading it is the same error on every backend.
    db.tamper(
        &["DROP TRIGGER ops_contract_update", &sqlite],
        &["ALTER TABLE ops DROP CONSTRAINT ops_times_readable", &postgres],
    )
    .await?;
    for (what, got) in [
        ("get", q.get(id).await.map(|_| ())),
        (
            "list",
            q.list(&OpFilter {
                limit: 10,
                ..OpFilter::default()
            })
            .await
            .map(|_| ()),
        ),
    ] {
        match got {
            Err(QueueError::Corrupt { id: bad, column, .. }) => {
                ensure!(bad == id && column == "updated_at", "{what}: op {bad} column {column}")
            }
            other => anyhow::bail!("{what} of an unreadable op gave {other:?}"),
        }
    }
    ensure!(q.get(fine).await?.is_some(), "the other op reads as before");
    Ok(())
}

/// The error that says a database cannot be opened names it without its
/// password, whichever backend it is.
async fn an_unreachable_database_is_named_without_its_password(db: TestDb) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let url = match db.kind {
        crate::support::TestBackend::Sqlite(_) => format!(
            "sqlite://{}?password=hunter2",
            dir.path().join("missing").join("laneway.db").display()
        ),
        crate::support::TestBackend::Postgres(_) => "postgres://laneway:hunter2@127.0.0.1:1/test".to_owned(),
    };
    let mut config = laneway::config::from_toml_str("")?.database;
    config.url = url;
    config.connect_timeout_ms = 2_000;
    let clock: Arc<dyn laneway::clock::Clock> = Arc::new(db.clock.clone());
    match laneway::queue::open(&config, laneway::queue::Limits::default(), clock).await {
        Ok(_) => anyhow::bail!("opened {}", config.url),
        Err(e) => {
            let text = format!("{e} {e:?}");
            ensure!(!text.contains("hunter2"), "the password leaked: {text}");
            ensure!(matches!(e, QueueError::Unreachable { .. }), "{e:?}");
        }
    }
    Ok(())
}

/// A dead letter that must hold its lanes and cannot (here: a lane_halts
/// table some tool changed) fails its settle, which leaves the op as it
/// was: the lanes are never left open behind it without anyone knowing.
async fn a_lane_hold_that_cannot_be_written_fails_the_settle(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let id = enqueue_one(q, op("o", &["A"])).await?;
    let c = claim_one(q).await?;
    db.tamper(
        &[
            "ALTER TABLE laneway_lane_halts RENAME TO laneway_lane_halts_before",
            "CREATE TABLE laneway_lane_halts (outbox TEXT NOT NULL, lane TEXT NOT NULL, op_id INTEGER NOT NULL, \
             halted_at INTEGER NOT NULL, note TEXT NOT NULL, PRIMARY KEY (outbox, lane, op_id))",
        ],
        &[
            "ALTER TABLE lane_halts ADD COLUMN note TEXT NOT NULL DEFAULT 'x'",
            "ALTER TABLE lane_halts ALTER COLUMN note DROP DEFAULT",
        ],
    )
    .await?;
    let fail = Completion {
        lease: c.lease,
        finish: Finish::Fail {
            error: "rejected".into(),
            halt_lanes: true,
        },
        attempt: record(&db, AttemptClass::Permanent),
    };
    let settled = q.complete(&[fail]).await;
    ensure!(settled.is_err(), "the settle applied without its hold: {settled:?}");
    let op = q.get(id).await?.context("op")?;
    ensure!(
        op.status == Status::Submitted && op.lease_token == Some(c.lease.token),
        "{op:?}"
    );
    ensure!(q.attempts(id).await?.is_empty(), "an attempt row outlived its settle");
    Ok(())
}

/// A lease that ran out is recorded by the same rule on every backend: its
/// class, and an error text truncated like every other.
async fn an_expired_lease_records_its_attempt_the_same_way_everywhere(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let id = enqueue_one(q, op("o", &["A"])).await?;
    let owner = "h".repeat(20_000);
    let c = q
        .claim(&ClaimRequest {
            lease: lease_spec(&owner),
            ..claim_all(1)
        })
        .await?
        .pop()
        .context("claimed")?;
    db.clock.advance(Span::seconds(31));
    let now = laneway::clock::Clock::now(&db.clock);
    ensure!(q.expire(&c.lease, ExpireTo::Retry(now)).await? == Cas::Applied);
    let history = q.attempts(id).await?;
    let [expired] = history.as_slice() else {
        anyhow::bail!("{history:?}");
    };
    ensure!(expired.record.class == AttemptClass::LeaseExpired);
    let want = laneway::op::truncate_error(&format!("lease held by {owner} expired"));
    ensure!(
        expired.record.error.as_deref() == Some(want.as_str()),
        "error of {} bytes",
        expired.record.error.as_ref().map_or(0, String::len)
    );
    ensure!(expired.record.started_at <= expired.record.finished_at);
    Ok(())
}

/// A bulk retry answers the ops it retried in the order they were asked
/// for, on every backend.
async fn retried_dead_letters_come_back_in_the_order_asked(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let mut ids = Vec::new();
    for lane in ["A", "B", "C"] {
        ids.push(enqueue_one(q, op("o", &[lane])).await?);
    }
    for c in q.claim(&claim_all(3)).await? {
        let fail = Completion {
            lease: c.lease,
            finish: Finish::Fail {
                error: "no".into(),
                halt_lanes: false,
            },
            attempt: record(&db, AttemptClass::Permanent),
        };
        ensure!(q.complete(&[fail]).await? == vec![Cas::Applied]);
    }
    let now = laneway::clock::Clock::now(&db.clock);
    let asked = vec![(ids[2], now), (ids[0], now), (ids[1] + 1000, now), (ids[1], now)];
    let retried = q.retry_dead_letters(&asked).await?;
    ensure!(retried == vec![ids[2], ids[0], ids[1]], "{retried:?}");
    Ok(())
}

/// The host's committer (`queue/committer.rs`): rounds that arrive while a
/// commit runs are applied in the next transaction together; when one of
/// them fails, it fails alone and the others still commit. The commit is
/// held up from outside (SQLite: another writer; PostgreSQL: a row lock on
/// the op the first round settles) so the later rounds queue behind it.
async fn rounds_queued_behind_a_commit_apply_together_and_a_failing_one_fails_alone(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let first = enqueue_one(q, op("a", &["La"])).await?;
    let ids = [
        enqueue_one(q, op("b", &["Lb"])).await?,
        enqueue_one(q, op("c", &["Lc"])).await?,
        enqueue_one(q, op("d", &["Ld"])).await?,
    ];
    // Claims go in enqueue order: this is `first`.
    let lease = claim_one(q).await?.lease;
    ensure!(lease.op_id == first, "claimed {lease:?}");
    db.tamper(
        &[&format!(
            "CREATE TRIGGER refuse BEFORE UPDATE ON laneway_ops WHEN OLD.id = {} BEGIN SELECT RAISE(ABORT, 'refused'); END",
            ids[1]
        )],
        &[
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'refused'; END $$",
            &format!(
                "CREATE TRIGGER refuse BEFORE UPDATE ON ops FOR EACH ROW WHEN (OLD.id = {}) EXECUTE FUNCTION refuse()",
                ids[1]
            ),
        ],
    )
    .await?;
    let blocker = Blocker::hold(&db, first).await?;
    let settle = {
        let queue = db.queue.clone();
        let done = confirm(&db, lease);
        tokio::spawn(async move {
            queue
                .settle_then_claim(&[done], &[], &[], &lease_spec("h"), &LaneRules::default())
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let rounds: Vec<_> = ids
        .iter()
        .map(|id| {
            let queue = db.queue.clone();
            let id = *id;
            tokio::spawn(async move {
                queue
                    .settle_then_claim(&[], &[id], &[], &lease_spec("h"), &LaneRules::default())
                    .await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    ensure!(!settle.is_finished(), "the first round committed while held up");
    blocker.release().await?;
    let (settled, _) = settle.await??;
    ensure!(settled == vec![Cas::Applied], "{settled:?}");
    let mut results = Vec::new();
    for round in rounds {
        results.push(round.await?);
    }
    let claimed = |r: &Result<(Vec<Cas>, Vec<Claimed>), QueueError>| match r {
        Ok((_, claims)) => Some(claims.iter().map(|c| c.op.id).collect::<Vec<_>>()),
        Err(_) => None,
    };
    ensure!(
        results.iter().map(claimed).collect::<Vec<_>>() == vec![Some(vec![ids[0]]), None, Some(vec![ids[2]])],
        "{results:?}"
    );
    let mut statuses = Vec::new();
    for id in [first, ids[0], ids[1], ids[2]] {
        statuses.push(q.get(id).await?.context("op")?.status);
    }
    ensure!(
        statuses == [Status::Confirmed, Status::Submitted, Status::Pending, Status::Submitted],
        "{statuses:?}"
    );
    Ok(())
}

/// A writer outside the queue that holds up its next commit: SQLite's
/// write lock, or PostgreSQL's row lock on one op.
enum Blocker {
    Sqlite(sqlx::SqliteConnection),
    Postgres(sqlx::Transaction<'static, sqlx::Postgres>),
}

impl Blocker {
    async fn hold(db: &TestDb, op: i64) -> anyhow::Result<Self> {
        use sqlx::Connection;
        Ok(match &db.kind {
            crate::support::TestBackend::Sqlite(_) => {
                let path = db.sqlite_path().context("sqlite file")?;
                let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display())).await?;
                sqlx::query("BEGIN IMMEDIATE").execute(&mut conn).await?;
                Self::Sqlite(conn)
            }
            crate::support::TestBackend::Postgres(q) => {
                let mut tx = q.pool().begin().await?;
                sqlx::query("SELECT id FROM ops WHERE id = $1 FOR UPDATE")
                    .bind(op)
                    .execute(&mut *tx)
                    .await?;
                Self::Postgres(tx)
            }
        })
    }

    async fn release(self) -> anyhow::Result<()> {
        match self {
            Self::Sqlite(mut conn) => {
                sqlx::query("ROLLBACK").execute(&mut conn).await?;
            }
            Self::Postgres(tx) => tx.rollback().await?,
        }
        Ok(())
    }
}

/// Large payloads are stored once by hash, and once per batch (a fan-out's
/// recipients share one): every op still reads back its own text.
async fn a_batch_sharing_large_payloads_reads_each_back_exactly(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let big = |tag: &str| format!(r#"{{"type":"Create","content":"{}"}}"#, tag.repeat(2048));
    let payloads = [big("a"), big("b"), big("a"), big("a"), big("b")];
    let batch: Vec<NewOp> = payloads
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut op = NewOp::new("fan", "activitypub", p.clone());
            op.lanes = vec![format!("inbox-{i}")];
            op
        })
        .collect();
    let ids: Vec<i64> = q.enqueue(&batch).await?.iter().map(|e| e.id()).collect();
    ensure!(ids.len() == payloads.len(), "{ids:?}");
    for (id, payload) in ids.iter().zip(&payloads) {
        let op = q.get(*id).await?.context("op")?;
        ensure!(&op.payload == payload, "op {id} read back another payload");
    }
    // A second batch with a payload already stored.
    let again = q.enqueue(&batch[..1]).await?;
    let op = q.get(again[0].id()).await?.context("op")?;
    ensure!(op.payload == payloads[0]);
    Ok(())
}

/// A batch long enough to go as one statement stores each op exactly as
/// enqueuing it alone does, with ids ascending in the batch's order; a
/// batch with any conflict (an existing key, a pending coalesce key, a key
/// twice in the batch) is answered op by op as before, and one refused by
/// the database writes nothing.
async fn a_batch_stores_what_one_by_one_stores_and_answers_conflicts_the_same(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let now = laneway::clock::Clock::now(&db.clock);
    let variants = |outbox: &str| -> Vec<NewOp> {
        (0..6)
            .map(|i| {
                // White space and key order are the producer's.
                let mut op = NewOp::new(outbox, "activitypub", format!("{{ \"n\": {i},  \"a\": [true, null] }}"));
                op.priority = [Priority::Low, Priority::Critical, Priority::Normal][i % 3];
                op.lanes = match i {
                    0 => Vec::new(),
                    1 => vec!["https://b.example/inbox".into(), "https://c.example/inbox".into()],
                    _ => vec![format!("lane-\u{e9}-\"{i}\"")],
                };
                op.idempotency_key = (i % 2 == 0).then(|| format!("idem-{i}"));
                op.coalesce_key = (i == 3).then(|| "announce:3".to_owned());
                op.subject = (i == 4).then(|| "user-7".to_owned());
                op.correlation_id = (i == 5).then(|| "urn:ledger:5".to_owned());
                // Microseconds: stored as each backend stores a time.
                op.not_before = (i == 2).then(|| now + Span::microseconds(1_234_567));
                op
            })
            .collect()
    };
    let mut alone = Vec::new();
    for op in variants("one-by-one") {
        alone.push(enqueue_one(q, op).await?);
    }
    let batch = q.enqueue(&variants("batch")).await?;
    let ids: Vec<i64> = batch
        .iter()
        .map(|e| match e {
            Enqueued::Created(id) => Ok(*id),
            other => Err(anyhow::anyhow!("expected created ops, got {other:?}")),
        })
        .collect::<anyhow::Result<_>>()?;
    ensure!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "ids not in the batch's order: {ids:?}"
    );
    for (one, many) in alone.iter().zip(&ids) {
        let (mut one, mut many) = (q.get(*one).await?.context("op")?, q.get(*many).await?.context("op")?);
        ensure!(many.outbox == "batch", "{many:?}");
        (one.id, one.outbox, many.id, many.outbox) = (0, String::new(), 0, String::new());
        ensure!(
            one == many,
            "stored differently:\n one by one {one:?}\n in a batch {many:?}"
        );
    }
    // Conflicts: an existing key and a pending coalesce key; then a key
    // twice in one batch.
    let mut conflicted: Vec<NewOp> = variants("batch").into_iter().take(4).collect();
    conflicted[1].idempotency_key = Some("new-1".into());
    conflicted[2].idempotency_key = Some("new-2".into());
    conflicted[3] = op("batch", &["L"]);
    conflicted[3].coalesce_key = Some("announce:3".into());
    let answered = q.enqueue(&conflicted).await?;
    ensure!(answered[0] == Enqueued::Existing(ids[0]), "{answered:?}");
    ensure!(
        matches!(answered[1], Enqueued::Created(n) if n > ids[5]),
        "{answered:?}"
    );
    ensure!(
        matches!(answered[2], Enqueued::Created(n) if n > answered[1].id()),
        "{answered:?}"
    );
    ensure!(answered[3] == Enqueued::AlreadyPending(ids[3]), "{answered:?}");
    let mut twice: Vec<NewOp> = (0..4).map(|i| op("batch", &[&format!("t{i}")])).collect();
    twice[1].idempotency_key = Some("twice".into());
    twice[3] = twice[1].clone();
    let answered = q.enqueue(&twice).await?;
    ensure!(
        matches!(answered[..], [Enqueued::Created(a), Enqueued::Created(b), Enqueued::Created(c), Enqueued::Existing(d)]
            if a < b && b < c && d == b),
        "{answered:?}"
    );
    // The key twice for two different ops: the batch is refused whole.
    let mut reused: Vec<NewOp> = (0..4).map(|i| op("batch", &[&format!("r{i}")])).collect();
    reused[1].idempotency_key = Some("reused".into());
    reused[3].idempotency_key = Some("reused".into());
    let refused = q.enqueue(&reused).await;
    ensure!(
        matches!(refused, Err(QueueError::IdempotencyConflict(_))),
        "{refused:?}"
    );
    let all = OpFilter {
        limit: 100,
        ..OpFilter::default()
    };
    ensure!(q.list(&all).await?.len() == 17, "{:?}", q.list(&all).await?);
    // The database refuses one op of a batch (an internal kind in a
    // producer's outbox): nothing of the batch is written.
    let mut refused = variants("refused");
    for (i, op) in refused.iter_mut().enumerate() {
        op.idempotency_key = Some(format!("refused-{i}"));
        op.coalesce_key = None;
    }
    refused[4].kind = "outcome_webhook".into();
    ensure!(q.enqueue(&refused).await.is_err());
    ensure!(q.list(&all).await?.len() == 17);
    Ok(())
}

/// A batch longer than one statement takes (a fan-out to thousands) is
/// inserted as several in one transaction: ids still ascend in the batch's
/// order, and a conflict in a later statement, or a key repeated across
/// two of them, is answered for that op alone, as in a short batch.
async fn a_batch_past_one_statement_keeps_its_order_and_answers_conflicts_per_op(db: TestDb) -> anyhow::Result<()> {
    let q = db.queue.as_ref();
    let mut earlier = op("big", &["inbox-1700"]);
    earlier.idempotency_key = Some("k-1700".into());
    let existing = enqueue_one(q, earlier).await?;
    let mut batch: Vec<NewOp> = (0..2_500).map(|i| op("big", &[&format!("inbox-{i}")])).collect();
    batch[1_700].idempotency_key = Some("k-1700".into());
    batch[10].idempotency_key = Some("twice".into());
    batch[1_500] = batch[10].clone();
    let answered = q.enqueue(&batch).await?;
    ensure!(answered.len() == 2_500, "{} answers", answered.len());
    ensure!(answered[1_700] == Enqueued::Existing(existing), "{:?}", answered[1_700]);
    ensure!(
        answered[1_500] == Enqueued::Existing(answered[10].id()),
        "{:?} against {:?}",
        answered[1_500],
        answered[10]
    );
    let created: Vec<i64> = answered
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 1_500 && *i != 1_700)
        .map(|(i, e)| match e {
            Enqueued::Created(id) => Ok(*id),
            other => Err(anyhow::anyhow!("op {i}: expected created, got {other:?}")),
        })
        .collect::<anyhow::Result<_>>()?;
    ensure!(created.windows(2).all(|w| w[0] < w[1]), "ids not in the batch's order");
    let stored = |outbox: &'static str| async move {
        let filter = OpFilter {
            outbox: Some(outbox.into()),
            limit: 5_000,
            ..OpFilter::default()
        };
        q.list(&filter).await.map(|ops| ops.len())
    };
    let big = stored("big").await?;
    ensure!(big == 2_499, "{big} ops stored");
    for (id, lane) in [(answered[0].id(), "inbox-0"), (answered[2_499].id(), "inbox-2499")] {
        let op = q.get(id).await?.context("op")?;
        ensure!(op.lanes == vec![lane.to_owned()], "op {id}: {:?}", op.lanes);
    }
    // The database refuses an op in the second statement (an internal kind
    // in a producer's outbox): the first statement's rows go too.
    let mut refused: Vec<NewOp> = (0..1_500).map(|i| op("big-refused", &[&format!("r-{i}")])).collect();
    refused[1_200].kind = "outcome_webhook".into();
    ensure!(q.enqueue(&refused).await.is_err(), "the refused batch was accepted");
    let left = stored("big-refused").await?;
    ensure!(left == 0, "{left} ops of a refused batch stored");
    Ok(())
}
