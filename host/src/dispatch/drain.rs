//! One outbox's drain: hold its slot, and until nothing more can start, read
//! the candidates, schedule them through the lanes, claim and execute what
//! may start, and settle what finished.
//!
//! A pass is the time one drain holds the slot. Within a pass, an op that has
//! been attempted `in_pass_attempts` times stalls: it waits (blocking its
//! strict lanes, not serial ones) until a later pass, so one bad op cannot
//! take all of a drain's bandwidth (seed 002 OX-13-006/011). Nothing is held
//! only in memory: a stalled op is a pending row in the database, and a crash
//! loses no op, only this pass's stall marks.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::FutureExt;
use tokio::sync::OwnedSemaphorePermit;
use tokio::task::{Id as TaskId, JoinError, JoinSet};
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use super::{DispatchError, Inner};
use crate::breaker::{self, Admission};
use crate::config::{Config, KindConfig};
use crate::executor::{Attempt, Executor, LeaseCheckpoint, Reconciled};
use crate::fees::{FeeBid, FeeDecision};
use crate::lanes::{self, Candidate, Caps, Lane, LaneMode, LaneRules, OpState};
use crate::op::{AttemptRecord, Lease, Op, OpId, Status};
use crate::outcome::{Fault, Outcome};
use crate::pricing::OracleViews;
use crate::queue::{CandidateOp, Claimed, Completion, Finish, LeaseSpec, SlotLease};
use crate::retry::{self, Decision, RetryPolicy};

/// Drains `outbox` until it has nothing more to start and nobody asked it
/// to look again.
pub(super) async fn drain(inner: Arc<Inner>, outbox: String) {
    loop {
        if !inner.cancel.is_cancelled() {
            let ttl = Duration::from_millis(inner.config.load().dispatch.slot_ttl_ms);
            match inner.queue.acquire_slot(&outbox, &inner.owner, ttl).await {
                Ok(Some(slot)) => {
                    debug!(outbox = %outbox, "Drain pass starts.");
                    if let Err(e) = Pass::new(inner.clone(), slot.clone()).run().await {
                        error!(outbox = %outbox, error = %e, "Drain pass failed; in-flight ops will be recovered by lease expiry.");
                    }
                    if let Err(e) = inner.queue.release_slot(&slot).await {
                        warn!(outbox = %outbox, error = %e, "Could not release the drain slot; it will lapse.");
                    }
                }
                Ok(None) => debug!(outbox = %outbox, "Another dispatcher holds this outbox's drain slot."),
                Err(e) => warn!(outbox = %outbox, error = %e, "Could not take the drain slot."),
            }
        }
        if !inner.slots.finish_or_again(&outbox) {
            return;
        }
    }
}

/// What an execution task hands back.
struct Finished {
    claimed: Claimed,
    destination: Option<String>,
    /// The fee the attempt paid (reported by the executor, else the quote).
    fee: Option<u64>,
    /// A receipt was checkpointed during the attempt.
    checkpointed: bool,
    outcome: Outcome,
    started_at: DateTime<Utc>,
    finished_at: DateTime<Utc>,
}

/// An op being executed by this pass.
#[derive(Clone)]
struct Flight {
    claimed: Claimed,
    destination: Option<String>,
    fee: Option<FeeBid>,
    started_at: DateTime<Utc>,
}

struct Pass {
    inner: Arc<Inner>,
    slot: SlotLease,
    /// Attempts per op in this pass.
    in_pass: HashMap<OpId, u32>,
    /// Ops that reached the per-pass cap.
    stalled: HashSet<OpId>,
    running: JoinSet<Finished>,
    flights: HashMap<TaskId, Flight>,
    slot_lost: bool,
}

impl Pass {
    fn new(inner: Arc<Inner>, slot: SlotLease) -> Self {
        Self {
            inner,
            slot,
            in_pass: HashMap::new(),
            stalled: HashSet::new(),
            running: JoinSet::new(),
            flights: HashMap::new(),
            slot_lost: false,
        }
    }

    async fn run(mut self) -> Result<(), DispatchError> {
        let config = self.inner.config.load_full();
        let lease_for = Duration::from_millis(config.queue.lease_ms);
        let renew_every = lease_for / 3;
        let poll = Duration::from_millis(config.dispatch.poll_ms);
        let grace = Duration::from_millis(config.dispatch.shutdown_grace_ms);
        let mut next_renew = Instant::now() + renew_every;
        let mut grace_deadline: Option<Instant> = None;
        loop {
            if self.inner.cancel.is_cancelled() && grace_deadline.is_none() {
                grace_deadline = Some(Instant::now() + grace);
            }
            let stopping = grace_deadline.is_some() || self.slot_lost;
            let wake_at = if stopping {
                None
            } else {
                self.schedule(lease_for).await?
            };
            if self.running.is_empty() {
                // Nothing in flight. Wait here for an op whose backoff ends
                // soon rather than leave it to the next poll; otherwise end
                // the pass.
                match wake_at {
                    Some(at) if at <= Instant::now() + poll => {
                        tokio::select! {
                            () = tokio::time::sleep_until(at) => continue,
                            () = self.inner.cancel.cancelled() => break,
                        }
                    }
                    _ => break,
                }
            }
            let deadline = [Some(next_renew), wake_at, grace_deadline]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(next_renew);
            tokio::select! {
                biased;
                Some(joined) = self.running.join_next_with_id() => {
                    let mut batch = vec![self.settle_join(joined)];
                    while let Some(joined) = self.running.try_join_next_with_id() {
                        batch.push(self.settle_join(joined));
                    }
                    self.finish(batch.into_iter().flatten().collect()).await?;
                }
                () = tokio::time::sleep_until(deadline) => {}
                () = self.inner.cancel.cancelled(), if grace_deadline.is_none() => {}
            }
            if Instant::now() >= next_renew {
                self.renew(lease_for, Duration::from_millis(config.dispatch.slot_ttl_ms))
                    .await;
                next_renew = Instant::now() + renew_every;
            }
            if grace_deadline.is_some_and(|d| Instant::now() >= d) {
                self.interrupt().await?;
                break;
            }
        }
        Ok(())
    }

    /// Reads the candidates, starts what may start; returns when the
    /// earliest waiting op becomes due.
    async fn schedule(&mut self, lease_for: Duration) -> Result<Option<Instant>, DispatchError> {
        let config = self.inner.config.load_full();
        let outbox = self.slot.outbox.clone();
        let candidates = self.inner.queue.candidates(&outbox, config.dispatch.window).await?;
        let halts = self.inner.queue.lane_halts(Some(&outbox)).await?;
        let now = self.inner.clock.now();
        let mut due_next: Option<DateTime<Utc>> = None;
        let mut input: Vec<Candidate> = Vec::with_capacity(candidates.len() + halts.len());
        let mut caps = Caps {
            global: Some(config.dispatch.outbox_max_in_flight),
            starts: Some(self.inner.permits.available_permits()),
            ..Caps::default()
        };
        for (name, kind) in &config.kinds {
            if let Some(cap) = kind.max_in_flight {
                caps.per_kind.insert(name.clone(), cap);
            }
        }
        let rules = config.lane_rules();
        {
            let breakers = self.inner.breakers();
            for c in &candidates {
                let state = self.state_of(c, config.kinds.contains_key(&c.op.kind), now, &breakers, &mut due_next);
                input.push(Candidate {
                    id: c.op.id,
                    priority: c.op.priority,
                    seq: c.op.id,
                    kind: c.op.kind.clone(),
                    lanes: rules.lanes(&c.op.kind, &c.op.lanes, &mut caps),
                    state,
                    in_doubt: c.op.receipt.is_some(),
                });
            }
        }
        // Ops that occupy lanes elsewhere (other outboxes, or this one's
        // beyond the window): they never start here, but nothing of their
        // lanes may run beside them where the mode forbids it.
        let seen: HashSet<OpId> = candidates.iter().map(|c| c.op.id).collect();
        let lanes: Vec<String> = candidates
            .iter()
            .flat_map(|c| c.op.lanes.iter())
            .collect::<HashSet<_>>()
            .into_iter()
            .cloned()
            .collect();
        let elsewhere: Vec<Candidate> = self
            .inner
            .queue
            .occupants(&lanes)
            .await?
            .into_iter()
            .filter(|o| !seen.contains(&o.id))
            .map(|o| o.candidate(&rules, &mut Caps::default()))
            .collect();
        // A lane held by a dead letter (poison = halt) is blocked as if an op
        // waited at its head.
        for (i, halt) in halts.iter().enumerate() {
            input.push(Candidate {
                id: -1 - i as OpId,
                priority: crate::op::Priority::Critical,
                seq: i64::MIN,
                kind: String::new(),
                lanes: vec![Lane {
                    name: halt.lane.clone(),
                    mode: LaneMode::Strict,
                }],
                state: OpState::Waiting,
                in_doubt: false,
            });
        }
        self.log_unrunnable_kinds(&candidates, &config);

        let start = lanes::schedule(&input, &elsewhere, &caps);
        debug!(outbox = %outbox, candidates = candidates.len(), start = ?start, "Scheduled.");
        if !start.is_empty() {
            self.start(start, &candidates, (lease_for, &rules), now).await?;
        }
        Ok(due_next.map(|at| Instant::now() + (at - now).to_std().unwrap_or_default()))
    }

    fn state_of(
        &self,
        c: &CandidateOp,
        kind_known: bool,
        now: DateTime<Utc>,
        breakers: &breaker::Breakers,
        due_next: &mut Option<DateTime<Utc>>,
    ) -> OpState {
        if c.op.status == Status::Submitted {
            return OpState::InFlight;
        }
        let runnable = self.inner.executors.get(&c.op.kind).is_some_and(|e| e.available());
        if !kind_known || !runnable || c.subject_halted {
            return OpState::Waiting;
        }
        if self.stalled.contains(&c.op.id) {
            return OpState::Waiting;
        }
        if c.op.next_attempt_at > now {
            *due_next = Some(due_next.map_or(c.op.next_attempt_at, |d| d.min(c.op.next_attempt_at)));
            return OpState::Waiting;
        }
        if let Some(dest) = destination(&c.op) {
            if breakers.peek(dest, now) == Admission::Hold {
                return OpState::Waiting;
            }
        }
        OpState::Ready
    }

    fn log_unrunnable_kinds(&self, candidates: &[CandidateOp], config: &Config) {
        for c in candidates {
            let kind = &c.op.kind;
            let why = if !config.kinds.contains_key(kind) {
                "is not configured"
            } else if self.inner.executors.get(kind).is_none() {
                "has no executor loaded"
            } else {
                continue;
            };
            // Only an unrunnable kind is marked, so one that loses its
            // executor later is still reported.
            if !self.inner.warned_kind(kind) {
                warn!(kind = %kind, outbox = %c.op.outbox, "Kind {why}; its ops wait and block their strict lanes.");
            }
        }
    }

    async fn start(
        &mut self,
        start: Vec<OpId>,
        candidates: &[CandidateOp],
        (lease_for, rules): (Duration, &LaneRules),
        now: DateTime<Utc>,
    ) -> Result<(), DispatchError> {
        let by_id: HashMap<OpId, &Op> = candidates.iter().map(|c| (c.op.id, &c.op)).collect();
        let mut chosen = Vec::with_capacity(start.len());
        let mut permits: Vec<OwnedSemaphorePermit> = Vec::with_capacity(start.len());
        let mut trials: Vec<(OpId, String)> = Vec::new();
        {
            let mut breakers = self.inner.breakers();
            for id in start {
                let Some(op) = by_id.get(&id) else { continue };
                let Ok(permit) = self.inner.permits.clone().try_acquire_owned() else {
                    break;
                };
                if let Some(dest) = destination(op) {
                    match breakers.admit(dest, now) {
                        Admission::Hold => continue,
                        Admission::Trial => trials.push((id, dest.to_owned())),
                        Admission::Allow => {}
                    }
                }
                chosen.push(id);
                permits.push(permit);
            }
        }
        let bids = self.price(&mut chosen, &by_id, now).await?;
        if chosen.is_empty() {
            return Ok(());
        }
        let spec = LeaseSpec {
            owner: self.inner.owner.clone(),
            duration: lease_for,
        };
        let claimed = self.inner.queue.claim_ids(&chosen, &spec, rules).await?;
        // A trial op that could not be claimed must not leave its breaker
        // waiting for a result that never comes.
        let claimed_ids: HashSet<OpId> = claimed.iter().map(|c| c.op.id).collect();
        {
            let mut breakers = self.inner.breakers();
            for (id, dest) in trials.iter().filter(|(id, _)| !claimed_ids.contains(id)) {
                debug!(op = id, "Breaker trial op was not claimable.");
                breakers.record(dest, None, now);
            }
        }
        let config = self.inner.config.load_full();
        let mut permits = permits.into_iter();
        for claimed in claimed {
            let Some(permit) = permits.next() else { break };
            let kind = config.kinds.get(&claimed.op.kind);
            let timeout = Duration::from_millis(kind.map_or(60_000, |k| k.timeout_ms));
            let executor = self.inner.executors.get(&claimed.op.kind);
            let destination = destination(&claimed.op).map(str::to_owned);
            let started_at = self.inner.clock.now();
            let fee = bids.get(&claimed.op.id).copied();
            let max_attempts = kind.map_or(RetryPolicy::default().max_attempts, |k| k.max_attempts);
            let flight = Flight {
                claimed,
                destination,
                fee,
                started_at,
            };
            let task = execute(
                self.inner.clone(),
                executor,
                flight.clone(),
                (timeout, max_attempts),
                permit,
            );
            let handle = self.running.spawn(task);
            self.flights.insert(handle.id(), flight);
        }
        Ok(())
    }

    /// Prices the chosen ops whose kind has a fee oracle: keeps the bids of
    /// those that may go, defers (in the database, without using an
    /// attempt) those the policy defers, and leaves out those that cannot be
    /// priced now. Returns the bids.
    async fn price(
        &mut self,
        chosen: &mut Vec<OpId>,
        by_id: &HashMap<OpId, &Op>,
        now: DateTime<Utc>,
    ) -> Result<HashMap<OpId, FeeBid>, DispatchError> {
        let mut bids = HashMap::new();
        let Some(pricer) = self.inner.pricer.load_full() else {
            return Ok(bids);
        };
        let config = self.inner.config.load_full();
        let mut views = OracleViews::default();
        let mut keep = Vec::with_capacity(chosen.len());
        for id in chosen.drain(..) {
            let Some(op) = by_id.get(&id) else { continue };
            match pricer.price(&config, &mut views, op, now).await {
                Ok(None) => keep.push(id),
                Ok(Some(FeeDecision::Submit { bid, .. })) => {
                    if bid.capped {
                        error!(op = id, kind = %op.kind, priority = %op.priority, fee = bid.base_fee, alert = "max-fee-hit", "Fee reached the absolute cap; submitting at the cap.");
                    } else if bid.aggressive {
                        info!(op = id, kind = %op.kind, fee = bid.base_fee, "Congested: using the aggressive fee.");
                    }
                    bids.insert(id, bid);
                    keep.push(id);
                }
                Ok(Some(FeeDecision::Defer(wait))) => {
                    let until = now + chrono::Duration::from_std(wait).unwrap_or(chrono::Duration::MAX);
                    if self.inner.queue.defer(id, until).await?.applied() {
                        info!(op = id, kind = %op.kind, priority = %op.priority, until = %until, "Deferred by the fee policy (congestion).");
                    }
                }
                Err(e @ crate::pricing::PricingError::NoSampleYet(_)) => {
                    debug!(op = id, kind = %op.kind, error = %e, "Waiting for the fee oracle's first sample.");
                }
                Err(e) => warn!(op = id, kind = %op.kind, error = %e, "Cannot price the op; it waits."),
            }
        }
        *chosen = keep;
        Ok(bids)
    }

    fn settle_join(&mut self, joined: Result<(TaskId, Finished), JoinError>) -> Option<Finished> {
        match joined {
            Ok((id, finished)) => {
                self.flights.remove(&id);
                Some(finished)
            }
            Err(e) => {
                // Only an abort (shutdown) ends a task without a result:
                // execution panics are caught inside the task.
                let flight = self.flights.remove(&e.id())?;
                let now = self.inner.clock.now();
                Some(Finished {
                    claimed: flight.claimed,
                    destination: flight.destination,
                    fee: flight.fee.map(|b| b.base_fee),
                    // Unknown after an abort: assume the worst.
                    checkpointed: true,
                    outcome: Outcome::retry("interrupted by shutdown"),
                    started_at: flight.started_at,
                    finished_at: now,
                })
            }
        }
    }

    /// Settles finished attempts in one batch.
    async fn finish(&mut self, batch: Vec<Finished>) -> Result<(), DispatchError> {
        if batch.is_empty() {
            return Ok(());
        }
        let config = self.inner.config.load_full();
        let in_pass_cap = config.dispatch.in_pass_attempts;
        let now = self.inner.clock.now();
        let mut completions = Vec::with_capacity(batch.len());
        let mut notes = Vec::with_capacity(batch.len());
        for f in batch {
            let op = &f.claimed.op;
            let kind: Option<&KindConfig> = config.kinds.get(&op.kind);
            let policy = kind.map_or_else(RetryPolicy::default, KindConfig::retry_policy);
            let history = retry::History {
                attempts: u32::try_from(op.budget_attempts()).unwrap_or(u32::MAX),
                fee_bumps: u32::try_from(op.fee_bumps).unwrap_or(u32::MAX),
                checkpointed: f.checkpointed,
            };
            let decision = retry::decide(&policy, &f.outcome, history, now, rand::random::<f64>());
            let tries = self.in_pass.entry(op.id).or_default();
            *tries += 1;
            if matches!(decision, Decision::Retry { .. }) && *tries >= in_pass_cap {
                self.stalled.insert(op.id);
            }
            if let Some(dest) = &f.destination {
                self.inner.breakers().record(dest, f.outcome.destination_failed(), now);
            }
            let finish = match &decision {
                Decision::Confirm { receipt } => Finish::Confirm {
                    receipt: receipt.clone(),
                },
                Decision::Retry { at, error, fee_bump } => Finish::Retry {
                    next_attempt_at: *at,
                    error: error.clone(),
                    fee_bump: *fee_bump,
                    receipt_settled: !f.checkpointed,
                },
                Decision::DeadLetter { error } => Finish::Fail {
                    error: error.clone(),
                    halt_lanes: kind.is_some_and(KindConfig::halts_lanes),
                },
            };
            completions.push(Completion {
                lease: f.claimed.lease,
                finish,
                attempt: AttemptRecord {
                    started_at: f.started_at,
                    finished_at: f.finished_at,
                    class: f.outcome.class(),
                    detail: f.outcome.detail().map(str::to_owned),
                    fee: f.fee.and_then(|fee| i64::try_from(fee).ok()),
                    error: f.outcome.error(),
                },
            });
            notes.push((f.claimed, decision));
        }
        let results = self.inner.queue.complete(&completions).await?;
        for ((claimed, decision), result) in notes.into_iter().zip(results) {
            let op = &claimed.op;
            if !result.applied() {
                warn!(
                    op = op.id,
                    attempt = claimed.lease.attempt,
                    "Lease was lost before the outcome was recorded; the op will be delivered again."
                );
                continue;
            }
            match decision {
                Decision::Confirm { .. } => debug!(op = op.id, attempt = claimed.lease.attempt, "Op confirmed."),
                Decision::Retry { at, error, .. } => {
                    info!(op = op.id, attempt = claimed.lease.attempt, retry_at = %at, error = %error, "Op will be retried.");
                }
                Decision::DeadLetter { error } => error!(
                    op = op.id,
                    kind = %op.kind,
                    outbox = %op.outbox,
                    attempts = claimed.lease.attempt,
                    lanes = ?op.lanes,
                    correlation_id = ?op.correlation_id,
                    reason = %error,
                    "Op dead-lettered."
                ),
            }
        }
        Ok(())
    }

    async fn renew(&mut self, lease_for: Duration, slot_ttl: Duration) {
        let leases: Vec<Lease> = self.flights.values().map(|f| f.claimed.lease).collect();
        if !leases.is_empty() {
            match self.inner.queue.extend_leases(&leases, lease_for).await {
                Ok(results) => {
                    for (lease, result) in leases.iter().zip(results) {
                        if !result.applied() {
                            warn!(op = lease.op_id, "Lease was taken over while the op was executing.");
                        }
                    }
                }
                Err(e) => warn!(error = %e, "Could not extend leases."),
            }
        }
        match self.inner.queue.renew_slot(&self.slot, slot_ttl).await {
            Ok(result) if !result.applied() => {
                warn!(outbox = %self.slot.outbox, "Drain slot lapsed and was taken; finishing in-flight ops only.");
                self.slot_lost = true;
            }
            Ok(_) => {}
            Err(e) => warn!(outbox = %self.slot.outbox, error = %e, "Could not renew the drain slot."),
        }
    }

    /// Shutdown grace is over: stop what still runs and return it to the queue.
    async fn interrupt(&mut self) -> Result<(), DispatchError> {
        self.running.abort_all();
        let mut batch = Vec::new();
        while let Some(joined) = self.running.join_next_with_id().await {
            batch.extend(self.settle_join(joined));
        }
        if !batch.is_empty() {
            warn!(ops = batch.len(), outbox = %self.slot.outbox, "Interrupting in-flight ops at shutdown.");
        }
        self.finish(batch).await
    }
}

/// The breaker destination of an op: its first URL lane's authority.
fn destination(op: &Op) -> Option<&str> {
    op.lanes.iter().find_map(|lane| breaker::destination(lane))
}

/// Runs one attempt: reconcile first if an earlier attempt checkpointed a
/// receipt, then execute; bounded by the kind's deadline; panics caught.
///
/// An op whose budget is already spent reaches here only to reconcile (its
/// lease expired with a receipt): if the side effect provably did not
/// happen, it is dead-lettered rather than attempted beyond its budget.
async fn execute(
    inner: Arc<Inner>,
    executor: Option<Arc<dyn Executor>>,
    flight: Flight,
    (timeout, max_attempts): (Duration, u32),
    _permit: OwnedSemaphorePermit,
) -> Finished {
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
    let context = Attempt::new(checkpoint.clone(), fee);
    let outcome = match executor {
        None => Outcome::Fault(Fault::NoExecutor),
        Some(executor) => {
            let context = context.clone();
            let op = &claimed.op;
            let spent = u32::try_from(op.budget_attempts()).unwrap_or(u32::MAX) > max_attempts;
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
                        Reconciled::Redeliver => earlier.store(false, std::sync::atomic::Ordering::Release),
                    }
                }
                executor.execute(op, context).await
            };
            match tokio::time::timeout(timeout, std::panic::AssertUnwindSafe(attempt).catch_unwind()).await {
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
