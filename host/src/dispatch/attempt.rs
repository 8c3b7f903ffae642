//! One op's attempt, from its claim to what it hands back: reconcile an
//! earlier receipt first, then execute, bounded by the kind's deadline, a
//! panic caught, the permit given back early when the attempt turns slow.
//! The only caller of an executor; the pass spawns attempts here and reads
//! their [`Finished`] back.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::FutureExt;
use tokio::sync::Notify;
use tokio::task::{Id as TaskId, JoinSet};

use super::load::Hold;
use super::slow::{self, SlowWatch};
use super::Inner;
use crate::config::Config;
use crate::executor::{Attempt, Executor, LeaseCheckpoint, Reconciled};
use crate::fees::FeeBid;
use crate::op::OpId;
use crate::outcome::{Fault, Outcome};
use crate::queue::Claimed;
use crate::retry::RetryPolicy;

/// What an execution task hands back.
pub(super) struct Finished {
    pub(super) claimed: Claimed,
    pub(super) destination: Option<String>,
    /// The fee the attempt paid (reported by the executor, else the quote).
    pub(super) fee: Option<u64>,
    /// A receipt was checkpointed during the attempt.
    pub(super) checkpointed: bool,
    pub(super) outcome: Outcome,
    pub(super) started_at: DateTime<Utc>,
    pub(super) finished_at: DateTime<Utc>,
}

/// An op being executed by this pass.
#[derive(Clone)]
pub(super) struct Flight {
    pub(super) claimed: Claimed,
    pub(super) destination: Option<String>,
    pub(super) fee: Option<FeeBid>,
    pub(super) started_at: DateTime<Utc>,
    /// Set once the attempt turned slow and gave its permit back.
    pub(super) slow: Arc<AtomicBool>,
}

/// The kind's bounds on one attempt.
struct AttemptSpec {
    /// The attempt's deadline.
    timeout: Duration,
    /// The kind's attempt budget: an op past it only reconciles.
    max_attempts: u32,
    /// The kind's fee-bump cap, if any.
    max_fee_bumps: Option<u32>,
}

/// What an attempt holds while it runs, and what it rings when it turns
/// slow and gives its permit back.
struct AttemptHold {
    hold: Hold,
    watch: Option<SlowWatch>,
    slowed: Arc<Notify>,
}

/// Starts an execution task on `running` for each claimed op that has its
/// permit in `permits`, recording each in `flights` under its task's id.
pub(super) fn spawn(
    inner: &Arc<Inner>,
    (running, flights): (&mut JoinSet<Finished>, &mut HashMap<TaskId, Flight>),
    claimed: Vec<Claimed>,
    mut permits: HashMap<OpId, Hold>,
    bids: &HashMap<OpId, FeeBid>,
    config: &Config,
    slowed: &Arc<Notify>,
) {
    for claimed in claimed {
        // Each op's own hold: its permit and its destination's count.
        let Some(permit) = permits.remove(&claimed.op.id) else {
            continue;
        };
        let kind = config.kinds.get(&claimed.op.kind);
        let spec = AttemptSpec {
            timeout: Duration::from_millis(kind.map_or(60_000, |k| k.timeout_ms)),
            max_attempts: kind.map_or(RetryPolicy::default().max_attempts, |k| k.max_attempts),
            max_fee_bumps: kind.and_then(|k| k.max_fee_bumps),
        };
        let executor = inner.executors.get(&claimed.op.kind);
        let destination = super::pass::destination(&claimed.op.lanes).map(str::to_owned);
        let started_at = inner.clock.now();
        let fee = bids.get(&claimed.op.id).copied();
        let slow = Arc::new(AtomicBool::new(false));
        let watch = kind.and_then(|k| k.slow_after_ms).map(|after| SlowWatch {
            after: Duration::from_millis(after),
            places: inner.slow_places.clone(),
            flag: slow.clone(),
        });
        let flight = Flight {
            claimed,
            destination,
            fee,
            started_at,
            slow,
        };
        let hold = AttemptHold {
            hold: permit,
            watch,
            slowed: slowed.clone(),
        };
        let task = execute(inner.clone(), executor, flight.clone(), spec, hold);
        let handle = running.spawn(task);
        flights.insert(handle.id(), flight);
    }
}

/// Runs one attempt: reconcile first if an earlier attempt checkpointed a
/// receipt, then execute; bounded by the kind's deadline; panics caught.
///
/// An op whose budget or fee-bump cap is already spent reaches here only to
/// reconcile (its lease expired with a receipt, or its last attempt asked
/// for a bump past the cap with a receipt that might still land, which
/// counts one bump past the cap): if the side effect provably did not
/// happen, it is dead-lettered rather than attempted beyond its budget or
/// cap.
async fn execute(
    inner: Arc<Inner>,
    executor: Option<Arc<dyn Executor>>,
    flight: Flight,
    AttemptSpec {
        timeout,
        max_attempts,
        max_fee_bumps,
    }: AttemptSpec,
    AttemptHold { hold, watch, slowed }: AttemptHold,
) -> Finished {
    // The destination's count is given back last (see the end); the permit
    // when the attempt ends or turns slow.
    let Hold {
        permit,
        destination: _destination,
    } = hold;
    let Flight {
        claimed,
        destination,
        fee,
        ..
    } = flight;
    let started_at = inner.clock.now();
    let checkpoint = Arc::new(LeaseCheckpoint::new(inner.queue.clone(), claimed.lease));
    // An earlier attempt's receipt stays in doubt until reconcile settles it
    // or proves it dead.
    let earlier_receipt_open = std::sync::atomic::AtomicBool::new(claimed.op.receipt.is_some());
    let context = Attempt::new(checkpoint.clone(), fee).with_notes(Arc::new(crate::executor::QueueNotes::new(
        inner.queue.clone(),
        inner.notes.clone(),
    )));
    let outcome = match executor {
        None => Outcome::Fault(Fault::NoExecutor),
        Some(executor) => {
            let context = context.clone();
            let op = &claimed.op;
            let spent = u32::try_from(op.budget_attempts()).unwrap_or(u32::MAX) > max_attempts;
            // One bump past the cap was asked for and refused (`retry::decide`).
            let capped = max_fee_bumps.filter(|cap| u32::try_from(op.fee_bumps).unwrap_or(0) > *cap);
            let earlier = &earlier_receipt_open;
            let attempt = async {
                if let Some(receipt) = &op.receipt {
                    match executor.reconcile(op, receipt, context.clone()).await {
                        Reconciled::Settled(outcome) => return outcome,
                        Reconciled::Redeliver if spent => {
                            return Outcome::permanent(format!(
                                "gave up after {max_attempts} attempts; the last one provably did not take effect"
                            ))
                        }
                        Reconciled::Redeliver => {
                            if let Some(cap) = capped {
                                return Outcome::permanent(format!(
                                    "fee-bump cap reached after {cap} bumps; the last transaction provably did not land"
                                ));
                            }
                            earlier.store(false, std::sync::atomic::Ordering::Release);
                        }
                    }
                }
                executor.execute(op, context).await
            };
            let attempt = tokio::time::timeout(timeout, std::panic::AssertUnwindSafe(attempt).catch_unwind());
            let waker = inner.clone();
            let freed = move || {
                slowed.notify_one();
                waker.wake_starved();
            };
            match slow::watch(attempt, permit, watch, freed).await {
                Ok(Ok(outcome)) => outcome,
                Ok(Err(panic)) => {
                    let why = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "panic".to_owned());
                    Outcome::Fault(Fault::Crashed(why))
                }
                Err(_) => Outcome::Fault(Fault::Timeout),
            }
        }
    };
    // Before the hold is given back: the next schedule that sees this
    // destination's count fall sees its cap as this attempt left it.
    if let (Some(dest), Some(failed)) = (destination.as_deref(), outcome.destination_failed()) {
        inner.destination_load.heard(dest, !failed, std::time::Instant::now());
    }
    Finished {
        claimed,
        destination,
        fee: context.recorded_fee(),
        checkpointed: checkpoint.saved() || earlier_receipt_open.load(std::sync::atomic::Ordering::Acquire),
        outcome,
        started_at,
        finished_at: inner.clock.now(),
    }
}
