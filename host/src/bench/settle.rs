//! The `settle` section: what one settle costs per op on PostgreSQL with 10
//! and with 5,000 other ops in flight. The lane-occupants triggers once
//! scanned every op in flight per settle (their plan followed the table's
//! statistics), so a settle grew with the in-flight count; it should not.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use sqlx::Connection as _;

use super::{Scratch, Store};
use crate::lanes::LaneRules;
use crate::op::{AttemptClass, AttemptRecord, OpId};
use crate::queue::{Claimed, Completion, Finish, LeaseSpec, NewOp, Queue};

/// Ops settled per statement, as a drain's round settles them.
const GROUP: usize = 100;

/// Groups measured per in-flight level.
const ROUNDS: usize = 20;

/// Prints settle µs per op at 10 and at 5,000 ops in flight.
pub(super) async fn settles_by_in_flight() -> anyhow::Result<()> {
    println!("\n## settle cost by ops in flight (PostgreSQL, {GROUP} ops a settle, {ROUNDS} settles)\n");
    println!("| ops in flight besides the group | occupants' plan | settle µs/op (median) | min | max |");
    println!("|---|---|---|---|---|");
    // The last row puts back the plan before migration 20261207000005 (the
    // planner free to scan every occupant), for the ratio in one run.
    for (in_flight, shipped) in [(10_usize, true), (5_000, true), (5_000, false)] {
        let scratch = Scratch::new(Store::Postgres, "").await?;
        // Statistics taken while nothing is in flight, as autovacuum leaves
        // them on a table that churns: the case the planner once got wrong.
        if let Some(options) = &scratch.options {
            let mut conn = sqlx::PgConnection::connect_with(options).await?;
            sqlx::query("ANALYZE lane_occupants").execute(&mut conn).await?;
            if !shipped {
                for function in ["laneway_lane_occupants_changed()", "laneway_lane_occupants_deleted()"] {
                    sqlx::query(&format!("ALTER FUNCTION {function} RESET enable_seqscan"))
                        .execute(&mut conn)
                        .await?;
                }
            }
        }
        let result = measure(scratch.queue.as_ref(), in_flight).await;
        scratch.drop().await?;
        let mut per_op = result?;
        per_op.sort_by(f64::total_cmp);
        let median = per_op.get(per_op.len() / 2).copied().unwrap_or_default();
        let (min, max) = (
            per_op.first().copied().unwrap_or_default(),
            per_op.last().copied().unwrap_or_default(),
        );
        let plan = if shipped {
            "by index (shipped)"
        } else {
            "as the statistics say (before)"
        };
        println!("| {in_flight} | {plan} | {median:.0} | {min:.0} | {max:.0} |");
    }
    Ok(())
}

/// Claims `in_flight` ops that stay in flight, then claims and settles
/// groups beside them; µs per op of each settle.
async fn measure(queue: &dyn Queue, in_flight: usize) -> anyhow::Result<Vec<f64>> {
    let lease = LeaseSpec {
        owner: "bench".to_owned(),
        duration: Duration::from_secs(3600),
    };
    let rules = LaneRules::default();
    let mut lane = 0_usize;
    let mut batch = |n: usize| {
        let ops: Vec<NewOp> = (0..n)
            .map(|_| {
                lane += 1;
                NewOp {
                    lanes: vec![format!("https://h{}.example/inbox/{lane}", lane % 97)],
                    ..NewOp::new("bench", "bench", Arc::<str>::from("{}"))
                }
            })
            .collect();
        ops
    };
    let background: Vec<OpId> = queue
        .enqueue(&batch(in_flight))
        .await?
        .into_iter()
        .map(|e| e.id())
        .collect();
    for ids in background.chunks(500) {
        let (_, claimed) = queue.settle_then_claim(&[], ids, &[], &lease, &rules).await?;
        anyhow::ensure!(claimed.len() == ids.len(), "claimed {} of {}", claimed.len(), ids.len());
    }
    let mut per_op = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let ids: Vec<OpId> = queue
            .enqueue(&batch(GROUP))
            .await?
            .into_iter()
            .map(|e| e.id())
            .collect();
        let (_, claimed) = queue.settle_then_claim(&[], &ids, &[], &lease, &rules).await?;
        let completions: Vec<Completion> = claimed.into_iter().map(confirmation).collect();
        let started = Instant::now();
        let (settled, _) = queue.settle_then_claim(&completions, &[], &[], &lease, &rules).await?;
        let took = started.elapsed();
        anyhow::ensure!(settled.iter().all(|c| c.applied()), "a settle did not apply");
        per_op.push(took.as_secs_f64() * 1e6 / GROUP as f64);
    }
    Ok(per_op)
}

fn confirmation(claimed: Claimed) -> Completion {
    let now = Utc::now();
    Completion {
        lease: claimed.lease,
        finish: Finish::Confirm { receipt: None },
        attempt: AttemptRecord {
            started_at: now,
            finished_at: now,
            class: AttemptClass::Confirmed,
            detail: None,
            fee: None,
            error: None,
        },
    }
}
