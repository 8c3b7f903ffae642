//! One outbox's drain: hold its slot, and until nothing more can start, read
//! the candidates, schedule them through the lanes, claim and execute what
//! may start, and settle what finished. This file holds the pass's state
//! and its loop; each step is a file of its own: `read` (the book),
//! `schedule` (which ops may start, and why the others wait), `admit`
//! (permits, breakers, probes, rate limits, prices), `round` (send and
//! land a round, decide and record what finished).
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
use tokio::sync::Notify;
use tokio::task::{Id as TaskId, JoinError, JoinSet};
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use super::attempt::{self, Finished, Flight};
use super::book::{Book, Filling, PER_SET};
use super::load::{Hold, SlowStart};
use super::paused::Paused;
use super::slow::SlowWatch;
use super::verdict;
use super::{DispatchError, Inner};
use crate::breaker::{self, Admission};
use crate::clock::chrono_duration;
use crate::config::{Config, KindConfig};
use crate::destinations::HealthView;
use crate::events::{LeaseLost, OpSettled, Priced, Settled};
use crate::fees::{FeeBid, FeeDecision};
use crate::health::{Admit, Event};
use crate::lanes::{self, Candidate, Caps, Lane, LaneMode, LaneRules, OpState};
use crate::op::{AttemptRecord, Lease, OpId};
use crate::outcome::Outcome;
use crate::pricing::OracleViews;
use crate::queue::{BookRow, Cas, Claimed, Completion, Finish, LeaseSpec, SlotLease};
use crate::retry::{self, Decision, RetryPolicy};

mod admit;
mod read;
mod round;
mod schedule;

/// Drains `outbox` until it has nothing more to start and nobody asked it
/// to look again.
pub(super) async fn drain(inner: Arc<Inner>, outbox: String) {
    loop {
        if inner.is_handed_back(&outbox) {
            debug!(outbox = %outbox, "This host handed the outbox back; another host should drain it.");
        } else if !inner.cancel.is_cancelled() {
            let ttl = Duration::from_millis(inner.config.load().dispatch.slot_ttl_ms);
            match inner.queue.acquire_slot(&outbox, &inner.owner, ttl).await {
                Ok(Some(slot)) => {
                    debug!(outbox = %outbox, "Drain pass starts.");
                    let favoured = inner.share().join(&outbox);
                    let mut pass = Pass::new(inner.clone(), slot.clone());
                    pass.favoured = favoured;
                    let result = pass.run().await;
                    inner.share().leave(&outbox, pass.starved);
                    // Permits this pass leaves free go to whoever waits.
                    inner.wake_starved();
                    if let Err(e) = result {
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

/// The longest a pass with nothing in flight stays open for an op whose
/// backoff ends soon; a longer wait ends the pass and sets a timer.
const HOLD_PASS_FOR: Duration = Duration::from_secs(1);

/// How long a pass with nothing left to do keeps its slot for new ops. An op
/// that arrives meanwhile starts without a new pass: no slot to take (a
/// write transaction, one fsync on SQLite) and no full read of the book, the
/// larger part of enqueue-to-start latency for ops that arrive one by one.
/// Short, so a host that goes quiet hands its outboxes on quickly.
const LINGER: Duration = Duration::from_millis(100);

/// The longest a walk that found nothing waits before the next, in polls.
const WALK_BACKOFF_POLLS: u32 = 8;

/// How soon a pass reads its book in full again after parking an op it
/// could not claim (at most `poll_ms`).
const PARKED_RECHECK: Duration = Duration::from_millis(250);

struct Pass {
    inner: Arc<Inner>,
    slot: SlotLease,
    /// What the pass knows of its outbox's ops between rounds.
    book: Book,
    /// When the book is next read in full.
    refresh_at: Instant,
    /// When a full read may next walk past crowded lanes, and how long the
    /// last walk made it wait.
    walk_at: Instant,
    walk_every: Duration,
    /// Attempts per op in this pass.
    in_pass: HashMap<OpId, u32>,
    /// Ops that reached the per-pass cap.
    stalled: HashSet<OpId>,
    running: JoinSet<Finished>,
    flights: HashMap<TaskId, Flight>,
    /// Attempts that ended and wait for the next round's settle.
    finished: Vec<Finished>,
    slot_lost: bool,
    /// Handing the slot to another host: finish what runs, start nothing.
    yielding: bool,
    /// The last schedule left ready ops waiting for a host permit.
    starved: bool,
    /// The last schedule started nothing only because of destinations'
    /// counts held by other outboxes' ops.
    held_by_destinations: bool,
    /// The pass was woken from starvation: until it starts something, it
    /// may take the permits other drains leave free for starved outboxes.
    favoured: bool,
    /// The operator's pauses, as of the last full read.
    paused: Paused,
    /// Destination health shared by every host, as of the last full read
    /// (and the probes this pass took since).
    health: HealthView,
    /// When an op `choose` held back may go: a rate-limited destination's
    /// next token, or a held destination's next probe.
    held_wake: Option<DateTime<Utc>>,
    /// Ops sent as an unavailable destination's probe, until they settle.
    probing: HashSet<OpId>,
    /// Rounds on their way to the database: tasks of their own, so a commit
    /// proceeds while the drain awaits anything else.
    commits: JoinSet<Landed>,
    /// Ops whose claim is on its way (a full read meanwhile sees them
    /// pending: they are marked in flight again); each holds a host permit
    /// until its claim lands.
    claiming: HashSet<OpId>,
    /// Rung when one of its attempts turns slow: a permit and a place under
    /// the outbox's cap are free for the ops waiting here.
    slowed: Arc<Notify>,
}

/// A round on its way: what the drain needs once it lands.
struct Issued {
    completions: Vec<Completion>,
    notes: Vec<Note>,
    chosen: Vec<OpId>,
    permits: HashMap<OpId, Hold>,
    trials: Vec<(OpId, String)>,
    bids: HashMap<OpId, FeeBid>,
    now: DateTime<Utc>,
}

/// A round and what the database said.
type Landed = (Issued, Result<(Vec<Cas>, Vec<Claimed>), crate::queue::QueueError>);

/// Rounds one drain keeps on their way at once: more go while earlier ones
/// commit, so neither the drain nor the database waits for the other. The
/// rounds that queue behind a group commit are merged into the next one, so
/// a deeper queue costs no transactions; what it saves is the wait of an
/// attempt that finished while the queue was full (the ActivityPub bench,
/// one outbox of 50 lanes: two rounds 1,110-1,160 ops/s on SQLite, four
/// 1,150-1,540, the drain no slower).
const ROUNDS_IN_FLIGHT: usize = 4;

/// Rounds on their way while a destination rate limit is configured. A
/// round draws its destinations' tokens when it is sent, and its ops start
/// when its commit lands, so every round queued ahead of it widens the gap
/// between a draw and its request: with four, a destination limited to 5 a
/// second saw 7 requests in one (CI). Two keep the pacing as drawn.
const ROUNDS_IN_FLIGHT_RATE_LIMITED: usize = 2;

/// How many rounds a drain keeps on their way under `config`.
fn rounds_in_flight(config: &Config) -> usize {
    if config.destinations.rate_per_second > 0.0 {
        ROUNDS_IN_FLIGHT_RATE_LIMITED
    } else {
        ROUNDS_IN_FLIGHT
    }
}

/// What one attempt said about its destination host's health.
#[derive(Debug, Clone)]
enum Signal {
    /// It answered.
    Answered,
    /// It failed because of the host.
    Failed(String),
    /// The inbox answered 410 Gone.
    Gone,
}

impl Pass {
    fn new(inner: Arc<Inner>, slot: SlotLease) -> Self {
        let window = usize::try_from(inner.config.load().dispatch.window).unwrap_or(usize::MAX);
        Self {
            inner,
            slot,
            book: Book::new(window),
            refresh_at: Instant::now(),
            walk_at: Instant::now(),
            walk_every: Duration::ZERO,
            in_pass: HashMap::new(),
            stalled: HashSet::new(),
            running: JoinSet::new(),
            flights: HashMap::new(),
            finished: Vec::new(),
            slot_lost: false,
            yielding: false,
            starved: false,
            held_by_destinations: false,
            favoured: false,
            paused: Paused::default(),
            health: HealthView::default(),
            held_wake: None,
            probing: HashSet::new(),
            commits: JoinSet::new(),
            claiming: HashSet::new(),
            slowed: Arc::default(),
        }
    }

    async fn run(&mut self) -> Result<(), DispatchError> {
        let config = self.inner.config.load_full();
        let lease_for = Duration::from_millis(config.queue.lease_ms);
        let renew_every = lease_for / 3;
        let poll = Duration::from_millis(config.dispatch.poll_ms);
        let grace = Duration::from_millis(config.dispatch.shutdown_grace_ms);
        let bell = self.inner.slots.bell(&self.slot.outbox);
        let mut next_renew = Instant::now() + renew_every;
        let mut grace_deadline: Option<Instant> = None;
        loop {
            if self.inner.cancel.is_cancelled() && grace_deadline.is_none() {
                grace_deadline = Some(Instant::now() + grace);
            }
            if !self.yielding && self.inner.take_hand_back() {
                info!(outbox = %self.slot.outbox, "This host holds more than its share of drain slots; handing this one back.");
                self.inner.handed_back(&self.slot.outbox, Instant::now() + poll * 3);
                self.yielding = true;
            }
            let stopping = grace_deadline.is_some() || self.slot_lost || self.yielding;
            if !stopping {
                self.read(poll).await?;
            }
            // A drain never waits for its own commit: while rounds are on
            // their way to the database it keeps scheduling, and sends the
            // next round (settles of what finished since, claims for the
            // permits still free) as soon as there is one, up to
            // [`rounds_in_flight`].
            let wake_at = if self.worth_sending(&config) {
                self.issue(lease_for, stopping).await?
            } else {
                None
            };
            let wake_at = if self.held_by_destinations && !stopping {
                let recheck = Instant::now() + PARKED_RECHECK.min(poll);
                Some(wake_at.map_or(recheck, |at| at.min(recheck)))
            } else {
                wake_at
            };
            if self.running.is_empty() && self.finished.is_empty() && self.commits.is_empty() {
                // Nothing in flight. Wait here for an op whose backoff ends
                // soon, or for new ops, rather than leave them to the next
                // pass; otherwise end the pass (a timer wakes the outbox
                // when its next op is due).
                match wake_at {
                    Some(at) if !stopping && at <= Instant::now() + poll.min(HOLD_PASS_FOR) => {
                        tokio::select! {
                            () = tokio::time::sleep_until(at) => continue,
                            () = bell.notified() => continue,
                            () = self.inner.cancel.cancelled() => break,
                        }
                    }
                    Some(at) if !stopping => {
                        self.inner.wake_at(&self.slot.outbox, at);
                        break;
                    }
                    // A starved pass is woken when permits free; a timer as
                    // well, so a wake-up lost in a race with another drain
                    // costs a recheck, not the wait for the poll.
                    _ if self.starved && !stopping => {
                        self.inner
                            .wake_at(&self.slot.outbox, Instant::now() + PARKED_RECHECK.min(poll));
                        break;
                    }
                    // Nothing waits at all: keep the slot a moment for the
                    // next arrival. (A pass with ops waiting on a timer ends,
                    // so the timer's pass reads the book and health anew.)
                    // A pass with stalled ops ends instead: they wait for a
                    // later pass, and the poll that finds them due would
                    // ring the bell of this one for ever.
                    None if !stopping && self.stalled.is_empty() && self.linger(&bell).await => continue,
                    _ => break,
                }
            }
            // A stopping pass reads nothing more, so its refresh time stays
            // in the past: waiting for it would spin through the whole grace
            // period (the slow fediverse bench: a core busy for the ten
            // seconds its hanging requests took to time out).
            let refresh = (!stopping).then_some(self.refresh_at);
            let deadline = [Some(next_renew), wake_at, grace_deadline, refresh]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(next_renew);
            tokio::select! {
                biased;
                Some(landed) = self.commits.join_next() => {
                    self.land(landed.map_err(DispatchError::Commit)?).await?;
                }
                Some(joined) = self.running.join_next_with_id() => {
                    if let Some(f) = self.settle_join(joined) {
                        self.finished.push(f);
                    }
                    while let Some(joined) = self.running.try_join_next_with_id() {
                        if let Some(f) = self.settle_join(joined) {
                            self.finished.push(f);
                        }
                    }
                }
                () = bell.notified(), if !stopping => {}
                () = self.slowed.notified(), if !stopping => {}
                () = tokio::time::sleep_until(deadline) => {}
                () = self.inner.cancel.cancelled(), if grace_deadline.is_none() => {}
            }
            if Instant::now() >= next_renew {
                self.renew(lease_for, Duration::from_millis(config.dispatch.slot_ttl_ms))
                    .await;
                next_renew = Instant::now() + renew_every;
            }
            if grace_deadline.is_some_and(|d| Instant::now() >= d) {
                // Claims on their way start (and are interrupted at once)
                // so that they are settled now, not by lease expiry.
                self.land_all().await?;
                self.interrupt().await;
                break;
            }
        }
        // Whatever finished while the pass wound down is settled before the
        // slot is released.
        self.land_all().await?;
        if !self.finished.is_empty() {
            self.issue(lease_for, true).await?;
            self.land_all().await?;
        }
        Ok(())
    }

    /// An idle pass keeps its slot for [`LINGER`] in case more ops arrive:
    /// `true` if the bell rang (go on), `false` to end the pass.
    async fn linger(&self, bell: &tokio::sync::Notify) -> bool {
        tokio::select! {
            () = bell.notified() => !self.inner.cancel.is_cancelled(),
            () = tokio::time::sleep(LINGER) => false,
            () = self.inner.cancel.cancelled() => false,
        }
    }

    /// Lands every round still on its way.
    async fn land_all(&mut self) -> Result<(), DispatchError> {
        while let Some(landed) = self.commits.join_next().await {
            self.land(landed.map_err(DispatchError::Commit)?).await?;
        }
        Ok(())
    }

    /// Attempts of this pass that turned slow and gave their permits back.
    fn slow_now(&self) -> usize {
        self.flights.values().filter(|f| SlowWatch::is_slow(&f.slow)).count()
    }

    /// Slow attempts whose op the book holds (and so counts in flight).
    fn slow_in_book(&self) -> usize {
        self.flights
            .values()
            .filter(|f| SlowWatch::is_slow(&f.slow) && self.book.get(f.claimed.op.id).is_some())
            .count()
    }

    /// What this pass holds host permits for: ops being claimed, and
    /// attempts running that have not turned slow.
    fn busy(&self) -> usize {
        (self.running.len() + self.claiming.len()).saturating_sub(self.slow_now())
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
    async fn interrupt(&mut self) {
        self.running.abort_all();
        let mut batch = Vec::new();
        while let Some(joined) = self.running.join_next_with_id().await {
            batch.extend(self.settle_join(joined));
        }
        if !batch.is_empty() {
            warn!(ops = batch.len(), outbox = %self.slot.outbox, "Interrupting in-flight ops at shutdown.");
        }
        self.finished.extend(batch);
    }
}

/// The lanes of occupants that belong to other outboxes than `outbox`.
fn others_lanes<'a>(occupants: &'a [crate::queue::Occupant], outbox: &'a str) -> impl Iterator<Item = &'a String> {
    occupants
        .iter()
        .filter(move |o| o.outbox != outbox)
        .flat_map(|o| o.lanes.iter())
}

/// What each finished attempt says about its destination's health.
fn health_signals(finished: &[Finished]) -> Vec<(String, String, Signal)> {
    finished
        .iter()
        .filter_map(|f| {
            let dest = f.destination.clone()?;
            let inbox = f.claimed.op.lanes.first().cloned().unwrap_or_default();
            let signal = match (&f.outcome, f.outcome.destination_failed()?) {
                (Outcome::Permanent { detail, .. }, _) if detail.as_deref() == Some("410") => Signal::Gone,
                (_, true) => Signal::Failed(f.outcome.error().unwrap_or_else(|| f.outcome.label().to_owned())),
                (_, false) => Signal::Answered,
            };
            Some((dest, inbox, signal))
        })
        .collect()
}

/// The breaker destination of an op: its first URL lane's authority.
pub(super) fn destination(lanes: &[String]) -> Option<&str> {
    breaker::first_destination(lanes.iter().map(String::as_str))
}

/// A settle's claim and decision, logged once it is written.
type Note = (Claimed, Decision);

/// What goes to a claim: the ops, their host-wide permits, the breaker
/// trials among them, and their fee bids.
type Chosen = (
    Vec<OpId>,
    HashMap<OpId, Hold>,
    Vec<(OpId, String)>,
    HashMap<OpId, FeeBid>,
);
