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
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::FutureExt;
use tokio::sync::Notify;
use tokio::task::{Id as TaskId, JoinError, JoinSet};
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use super::book::{Book, Filling, PER_SET};
use super::load::{Hold, SlowStart};
use super::paused::Paused;
use super::slow::{self, SlowWatch};
use super::{DispatchError, Inner};
use crate::breaker::{self, Admission};
use crate::clock::chrono_duration;
use crate::config::{Config, KindConfig};
use crate::destinations::HealthView;
use crate::events::{LeaseLost, OpSettled, Priced, Settled};
use crate::executor::{Attempt, Executor, LeaseCheckpoint, Reconciled};
use crate::fees::{FeeBid, FeeDecision};
use crate::health::{Admit, Event};
use crate::lanes::{self, Candidate, Caps, Lane, LaneMode, LaneRules, OpState};
use crate::op::{AttemptRecord, Lease, OpId};
use crate::outcome::{Fault, Outcome};
use crate::pricing::OracleViews;
use crate::queue::{BookRow, Cas, Claimed, Completion, Finish, LeaseSpec, SlotLease};
use crate::retry::{self, Decision, RetryPolicy};

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
    /// Set once the attempt turned slow and gave its permit back.
    slow: Arc<AtomicBool>,
}

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

    /// Whether to send a round now. With none on its way, always (a round
    /// with nothing to do costs no transaction). With some on their way (up
    /// to [`rounds_in_flight`]), only one that carries a batch: half the
    /// drain's share of permits finished or free. Small rounds otherwise
    /// wait for those in flight and grow meanwhile, so the transactions per
    /// op fall as load rises (group commit), and no commit waits on a drain
    /// that is idle.
    fn worth_sending(&self, config: &Config) -> bool {
        match self.commits.len() {
            0 => true,
            n if n >= rounds_in_flight(config) => false,
            _ => {
                let share = self
                    .inner
                    .share()
                    .fair(self.inner.permit_total)
                    .min(config.dispatch.outbox_max_in_flight);
                let busy = self.busy();
                let free = share.saturating_sub(busy).min(self.inner.permits.available_permits());
                let batch = (share / 2).max(1);
                self.finished.len() >= batch || free >= batch
            }
        }
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

    /// Brings the book up to date: in full when it is due (every `poll_ms`,
    /// which bounds how long a change the pass cannot see goes unnoticed) or
    /// when it overflowed and emptied; otherwise only the ops enqueued since
    /// the last trigger.
    async fn read(&mut self, poll: Duration) -> Result<(), DispatchError> {
        let outbox = self.slot.outbox.clone();
        let window = self.inner.config.load().dispatch.window;
        // Lanes other outboxes freed for this one; a full read reads every
        // occupant anew, so it answers them too.
        let freed = self.inner.handover().take(&outbox);
        if Instant::now() >= self.refresh_at || self.book.needs_refill() {
            // A trigger pending now is answered by this read.
            self.inner.slots.take_again(&outbox);
            let mut prefix = self.inner.queue.scan(&outbox, None, window).await?;
            // Pool ops moved to other channels: read again what moved.
            if super::redeal::redeal(&self.inner, &outbox, &prefix).await {
                prefix = self.inner.queue.scan(&outbox, None, window).await?;
            }
            let mut filling = Filling::new(prefix, window as usize);
            if filling.wants_more() && Instant::now() >= self.walk_at {
                self.walk(&mut filling, window, poll).await?;
            }
            let halts = self.inner.queue.lane_halts(Some(&outbox)).await?;
            self.paused = Paused::new(&self.inner.queue.pauses().await?);
            self.health = (*self.inner.health_view()).clone();
            let lanes: Vec<String> = filling
                .rows()
                .iter()
                .flat_map(|r| r.lanes.iter())
                .collect::<HashSet<_>>()
                .into_iter()
                .cloned()
                .collect();
            // Waiting on every lane read before reading who occupies them,
            // then only on those another outbox occupies: a settle between
            // the two is then either in the read or reported to this drain.
            self.inner.handover().rewait(&outbox, &lanes);
            // Those the book holds itself are left out when it schedules.
            let elsewhere = self.inner.queue.occupants(&lanes).await?;
            self.inner.handover().rewait(&outbox, others_lanes(&elsewhere, &outbox));
            let config = self.inner.config.load_full();
            self.log_unrunnable_kinds(filling.rows(), &config);
            self.book
                .fill(filling, halts.into_iter().map(|h| h.lane).collect(), elsewhere);
            for id in &self.claiming {
                self.book.claiming(*id);
            }
            self.refresh_at = Instant::now() + poll;
            return Ok(());
        }
        if !freed.is_empty() {
            // Another outbox here settled ops of lanes this one waits on:
            // who occupies them now? (Waiting again first, as above.)
            self.inner.handover().wait(&outbox, &freed);
            let occupants = self.inner.queue.occupants(&freed).await?;
            self.inner.handover().wait(&outbox, others_lanes(&occupants, &outbox));
            self.book.refresh_elsewhere(&freed, occupants);
        }
        if self.inner.slots.take_again(&outbox) {
            let rows = self
                .inner
                .queue
                .scan(&outbox, Some(self.book.high_water()), window)
                .await?;
            let config = self.inner.config.load_full();
            self.log_unrunnable_kinds(&rows, &config);
            self.book.add(rows);
        }
        Ok(())
    }

    /// Reads on past a prefix crowded by a few lanes for the other lanes'
    /// ops: the first few ops of each lane set behind it, which the database
    /// picks, so a deep backlog costs it a scan of the outbox's index but
    /// costs this process only a few rows per lane set. A walk that finds
    /// nothing (every lane set behind the prefix is crowded) makes the next
    /// one wait twice as long, up to [`WALK_BACKOFF_POLLS`] polls.
    async fn walk(&mut self, filling: &mut Filling, window: u32, poll: Duration) -> Result<(), DispatchError> {
        let rows = self
            .inner
            .queue
            .scan_beyond(&self.slot.outbox, filling.next_from(), PER_SET, window)
            .await?;
        filling.beyond(rows, window as usize);
        self.walk_every = if filling.kept_beyond() == 0 {
            (self.walk_every * 2).clamp(poll, poll * WALK_BACKOFF_POLLS)
        } else {
            Duration::ZERO
        };
        self.walk_at = Instant::now() + self.walk_every;
        debug!(outbox = %self.slot.outbox, walked = filling.walked(), kept = filling.kept_beyond(), "Read past crowded lanes.");
        Ok(())
    }

    /// Sends one round: schedule from the book, then settle what finished
    /// and claim what may start, in one transaction on its way to the
    /// database ([`Pass::land`] starts what it claimed once it committed).
    /// Returns when the earliest waiting op becomes due.
    ///
    /// Ops that finished are still in flight for this round's schedule: the
    /// lanes they hold are free only once their settle has committed, so a
    /// crash between the two can never let a later op of a lane overtake one
    /// whose outcome was not recorded.
    async fn issue(&mut self, lease_for: Duration, stopping: bool) -> Result<Option<Instant>, DispatchError> {
        let config = self.inner.config.load_full();
        let now = self.inner.clock.now();
        let rules = config.lane_rules();
        let finished = std::mem::take(&mut self.finished);
        // Health first, and the decisions read it: an attempt planned on a
        // view older than the record (another host's write, or this host's
        // own not yet read back) never spends its op's last attempt against
        // a host the record holds. A crash before the settle commits counts
        // these failures once more than the attempts recorded; never an
        // outcome.
        self.record_health(health_signals(&finished), &config, now).await;
        let (completions, notes) = self.decide(finished, &config, now);
        // Ops this round confirms or dead-letters leave their lanes when the
        // round commits; the round may start the next op of such a lane,
        // on condition that the settle applies (`follows`).
        // Not where another outbox here waits on the lane: it gets its turn
        // when this settle wakes it, instead of this outbox taking the lane
        // back in the same transaction every time.
        let leaving: HashSet<OpId> = {
            let handover = self.inner.handover();
            completions
                .iter()
                .zip(&notes)
                .filter(|(c, _)| {
                    matches!(
                        c.finish,
                        Finish::Confirm { .. } | Finish::Fail { halt_lanes: false, .. }
                    )
                })
                .filter(|(_, (claimed, _))| {
                    !claimed
                        .op
                        .lanes
                        .iter()
                        .any(|l| handover.others_wait(&self.slot.outbox, l))
                })
                .map(|(c, _)| c.lease.op_id)
                .collect()
        };
        let (start, due_next) = if stopping {
            self.starved = false;
            self.held_by_destinations = false;
            (Vec::new(), None)
        } else {
            self.schedule(&config, &rules, now, &leaving)
        };
        let follows = self.follows(&start, &leaving);
        let (chosen, permits, trials, bids) = self.choose(start, now).await?;
        let due_next = match self.held_wake.take() {
            Some(at) => Some(due_next.map_or(at, |d: DateTime<Utc>| d.min(at))),
            None => due_next,
        };
        let due_at = |at: DateTime<Utc>| Instant::now() + (at - now).to_std().unwrap_or_default();
        if completions.is_empty() && chosen.is_empty() {
            return Ok(due_next.map(due_at));
        }
        if !completions.is_empty() {
            crate::failpoint::hit(crate::failpoint::SETTLING, &self.slot.outbox).await;
        }
        let spec = LeaseSpec {
            owner: self.inner.owner.clone(),
            duration: lease_for,
        };
        // Until the claim lands, the chosen ops count as in flight: no later
        // round picks them, and they hold their lanes and the permits taken.
        for id in &chosen {
            self.book.claiming(*id);
            self.claiming.insert(*id);
        }
        let queue = self.inner.queue.clone();
        let issued = Issued {
            completions,
            notes,
            chosen,
            permits,
            trials,
            bids,
            now,
        };
        self.commits.spawn(async move {
            let result = queue
                .settle_then_claim(&issued.completions, &issued.chosen, &follows, &spec, &rules)
                .await;
            (issued, result)
        });
        Ok(due_next.map(due_at))
    }

    /// A round committed (or failed): records its settles, starts what it
    /// claimed, and parks what it could not claim.
    ///
    /// **Architecture Invariant:** an op's side effect starts only here,
    /// after the transaction that claimed it committed; and an op that
    /// shares a strict lane with one this drain is settling is neither
    /// scheduled nor claimed until that settle committed: either in the same
    /// transaction (`follows`) or in a round sent after this one landed,
    /// because the settling op stays in flight in the book until then.
    async fn land(&mut self, (issued, result): Landed) -> Result<(), DispatchError> {
        let Issued {
            completions,
            notes,
            chosen,
            permits,
            trials,
            bids,
            now,
        } = issued;
        for id in &chosen {
            self.claiming.remove(id);
        }
        let (settled, claimed) = result?;
        if !claimed.is_empty() {
            crate::failpoint::hit(crate::failpoint::CLAIMED, &self.slot.outbox).await;
        }
        let config = self.inner.config.load_full();
        // The pass schedules again as soon as this returns, from a book
        // that holds these settles: a retry's due time and the lanes freed
        // are seen then.
        let freed: Vec<String> = completions
            .iter()
            .zip(&notes)
            .zip(&settled)
            .filter(|(_, cas)| cas.applied())
            .flat_map(|((_, (claimed, _)), _)| claimed.op.lanes.iter().cloned())
            .collect();
        self.record_settles(&completions, notes, settled);
        let claimed_ids: HashSet<OpId> = claimed.iter().map(|c| c.op.id).collect();
        for id in &chosen {
            if claimed_ids.contains(id) {
                self.book.claimed(*id);
            } else {
                // Held by a lane elsewhere, or changed under the book: a
                // full read soon explains it, or the outbox holding the lane
                // here says when it lets go.
                self.probing.remove(id);
                self.book.refused(*id);
                if let Some(entry) = self.book.get(*id) {
                    self.inner.handover().wait(&self.slot.outbox, &entry.row.lanes);
                }
                // The holder may have let go before this drain said it
                // waits: the pass stays for the recheck's full read.
                self.refresh_at = self.refresh_at.min(Instant::now() + PARKED_RECHECK);
                let recheck = now + chrono_duration(PARKED_RECHECK);
                self.held_wake = Some(self.held_wake.map_or(recheck, |w| w.min(recheck)));
            }
        }
        if !freed.is_empty() {
            self.inner.lanes_freed(&self.slot.outbox, &freed);
        }
        // A trial op that could not be claimed must not leave its breaker
        // waiting for a result that never comes.
        {
            let mut breakers = self.inner.breakers();
            for (id, dest) in trials.iter().filter(|(id, _)| !claimed_ids.contains(id)) {
                debug!(op = id, "Breaker trial op was not claimable.");
                breakers.record(dest, None, None, now);
            }
        }
        if !claimed.is_empty() {
            self.favoured = false;
        }
        self.spawn(claimed, permits, &bids, &config);
        // Permits this round freed and left to the share of others.
        self.inner.wake_starved();
        Ok(())
    }

    /// Which ops of the book may start now, and when the earliest waiting
    /// one becomes due.
    fn schedule(
        &mut self,
        config: &Config,
        rules: &LaneRules,
        now: DateTime<Utc>,
        leaving: &HashSet<OpId>,
    ) -> (Vec<OpId>, Option<DateTime<Utc>>) {
        let mut due_next: Option<DateTime<Utc>> = None;
        let halted = self.book.halted_lanes();
        let mut input: Vec<Candidate> = Vec::with_capacity(self.book.len() + halted.len());
        // Host permits: what is free and not left to a starved outbox, and
        // no more than this outbox's fair share while others want them too.
        let starts = {
            let share = self.inner.share();
            let free = self.inner.permits.available_permits();
            let free = if self.favoured { free } else { share.takeable(free) };
            free.min(share.fair(self.inner.permit_total).saturating_sub(self.busy()))
        };
        let clock = std::time::Instant::now();
        let mut load = self
            .inner
            .destination_load
            .snapshot(clock, SlowStart::of(&config.destinations));
        let mut caps = Caps {
            // The slow attempts the book counts in flight are outside the cap.
            global: Some(config.dispatch.outbox_max_in_flight.saturating_add(self.slow_in_book())),
            starts: Some(starts),
            per_destination: Some(config.destinations.max_in_flight),
            destination_load: std::mem::take(&mut load.counts),
            per_unanswered_destination: Some(config.destinations.max_in_flight_unanswered),
            answered: load.answered.clone(),
            earned: std::mem::take(&mut load.earned),
            ..Caps::default()
        };
        for (name, kind) in &config.kinds {
            if let Some(cap) = kind.max_in_flight {
                caps.per_kind.insert(name.clone(), cap);
            }
        }
        {
            let breakers = self.inner.breakers();
            let mut behind = lanes::Behind::with_capacity(self.book.len());
            // The book's rows are mostly of one kind: its rule once.
            let mut rule: Option<(&str, bool)> = None;
            for entry in self.book.entries().filter(|e| !leaving.contains(&e.row.id)) {
                let row = &entry.row;
                let strict = match rule {
                    Some((kind, strict)) if kind == row.kind => strict,
                    _ => {
                        let strict = rules.of(&row.kind).mode == LaneMode::Strict;
                        rule = Some((&row.kind, strict));
                        strict
                    }
                };
                if behind.hides(&row.lanes, strict, row.in_flight || row.in_doubt) {
                    continue;
                }
                let state = if entry.parked || !self.book.in_reach(row) {
                    OpState::Waiting
                } else {
                    self.state_of(row, config.kinds.contains_key(&row.kind), now, &breakers, &mut due_next)
                };
                input.push(Candidate {
                    id: row.id,
                    priority: row.priority,
                    seq: row.id,
                    kind: row.kind.clone(),
                    lanes: rules.lanes(&row.kind, &row.lanes, &mut caps),
                    state,
                    in_doubt: row.in_doubt,
                });
            }
        }
        // Ops that occupy lanes elsewhere (other outboxes, or this one's
        // beyond the book): they never start here, but nothing of their
        // lanes may run beside them where the mode forbids it.
        let elsewhere: Vec<Candidate> = self
            .book
            .elsewhere()
            .iter()
            .filter(|o| self.book.get(o.id).is_none())
            .map(|o| o.candidate(rules, &mut Caps::default()))
            .collect();
        // A lane held by a dead letter (poison = halt) is blocked as if an op
        // waited at its head.
        for (i, lane) in halted.iter().enumerate() {
            input.push(Candidate {
                id: -1 - i as OpId,
                priority: crate::op::Priority::Critical,
                seq: i64::MIN,
                kind: String::new(),
                lanes: vec![Lane {
                    name: lane.clone(),
                    mode: LaneMode::Strict,
                }],
                state: OpState::Waiting,
                in_doubt: false,
            });
        }
        // With no permit to take nothing starts; when nothing runs either,
        // would anything start with one? Then the pass ends starved, and the
        // outbox is woken when permits free.
        let start = if starts == 0 {
            Vec::new()
        } else {
            lanes::schedule(&input, &elsewhere, &caps)
        };
        self.book.permits_idle(start.len() < starts);
        // Permits left idle while ops wait for a destination whose
        // patience runs: the pass is due again when it earns its next
        // request, whoever holds it.
        if start.len() < starts && !load.earns_next.is_empty() {
            let started: HashSet<OpId> = start.iter().copied().collect();
            let waiting = input
                .iter()
                .filter(|c| c.state == OpState::Ready && !started.contains(&c.id))
                .filter_map(lanes::destination);
            if let Some(at) = load.next_earned(waiting) {
                let at = now + chrono_duration(at.saturating_duration_since(clock));
                due_next = Some(due_next.map_or(at, |d| d.min(at)));
            }
        }
        self.starved = starts == 0
            && self.running.is_empty()
            && self.claiming.is_empty()
            && !lanes::schedule(
                &input,
                &elsewhere,
                &Caps {
                    starts: Some(1),
                    ..caps.clone()
                },
            )
            .is_empty();
        // Held only by destinations' counts, with nothing of its own
        // running: the ops in flight there are other outboxes', whose ends
        // wake no one here (no lane is shared, no permit was wanted), so
        // the pass must look again by itself.
        self.held_by_destinations = start.is_empty()
            && starts > 0
            && self.running.is_empty()
            && self.claiming.is_empty()
            && !caps.destination_load.is_empty()
            && !lanes::schedule(
                &input,
                &elsewhere,
                &Caps {
                    starts: Some(1),
                    per_destination: None,
                    ..caps.clone()
                },
            )
            .is_empty();
        debug!(outbox = %self.slot.outbox, candidates = self.book.len(), start = ?start, "Scheduled.");
        (start, due_next)
    }

    /// Which ops of `start` take a lane from an op this round settles as
    /// leaving: each such pair makes the claim depend on the settle.
    fn follows(&self, start: &[OpId], leaving: &HashSet<OpId>) -> Vec<(OpId, OpId)> {
        if leaving.is_empty() || start.is_empty() {
            return Vec::new();
        }
        let mut by_lane: HashMap<&str, Vec<OpId>> = HashMap::new();
        for id in leaving {
            for lane in self.book.get(*id).map(|e| e.row.lanes.as_slice()).unwrap_or_default() {
                by_lane.entry(lane.as_str()).or_default().push(*id);
            }
        }
        let mut follows = Vec::new();
        for id in start {
            for lane in self.book.get(*id).map(|e| e.row.lanes.as_slice()).unwrap_or_default() {
                for before in by_lane.get(lane.as_str()).into_iter().flatten() {
                    follows.push((*id, *before));
                }
            }
        }
        follows
    }

    fn state_of(
        &self,
        row: &BookRow,
        kind_known: bool,
        now: DateTime<Utc>,
        breakers: &breaker::Breakers,
        due_next: &mut Option<DateTime<Utc>>,
    ) -> OpState {
        if row.in_flight {
            return OpState::InFlight;
        }
        let runnable = self.inner.executors.get(&row.kind).is_some_and(|e| e.available());
        if !kind_known || !runnable || row.subject_halted {
            return OpState::Waiting;
        }
        if self.paused.holds(&self.slot.outbox, &row.kind, destination(&row.lanes)) {
            return OpState::Waiting;
        }
        if self.stalled.contains(&row.id) {
            return OpState::Waiting;
        }
        if row.next_attempt_at > now {
            *due_next = Some(due_next.map_or(row.next_attempt_at, |d| d.min(row.next_attempt_at)));
            return OpState::Waiting;
        }
        if let Some(dest) = destination(&row.lanes) {
            if let Some(Admit::Hold { until }) = self.health.get(dest).map(|h| h.admit(now)) {
                if let Some(at) = until {
                    *due_next = Some(due_next.map_or(at, |d| d.min(at)));
                }
                return OpState::Waiting;
            }
            if breakers.peek(dest, now) == Admission::Hold {
                return OpState::Waiting;
            }
        }
        OpState::Ready
    }

    fn log_unrunnable_kinds(&self, rows: &[BookRow], config: &Config) {
        for row in rows {
            let kind = &row.kind;
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
                warn!(kind = %kind, outbox = %self.slot.outbox, "Kind {why}; its ops wait and block their strict lanes.");
            }
        }
    }

    /// Takes host-wide permits and breaker admissions for the ops the
    /// scheduler started, and prices them: what goes to the claim.
    async fn choose(&mut self, start: Vec<OpId>, now: DateTime<Utc>) -> Result<Chosen, DispatchError> {
        let start = self.probes(start, now).await?;
        let start = self.rate_limited(start, now).await?;
        let mut chosen = Vec::with_capacity(start.len());
        let mut permits: HashMap<OpId, Hold> = HashMap::with_capacity(start.len());
        let mut trials: Vec<(OpId, String)> = Vec::new();
        {
            let mut breakers = self.inner.breakers();
            for id in start {
                let Some(entry) = self.book.get(id) else { continue };
                let Ok(permit) = self.inner.permits.clone().try_acquire_owned() else {
                    // Another drain (on another worker thread) took the
                    // permits the schedule counted: if this pass then has
                    // nothing running, it is starved, and must say so to be
                    // woken when permits free, or a poll an hour away
                    // would be its only wake-up.
                    if chosen.is_empty() && self.running.is_empty() && self.claiming.is_empty() {
                        self.starved = true;
                    }
                    break;
                };
                let dest = destination(&entry.row.lanes);
                if let Some(dest) = dest {
                    match breakers.admit(dest, now) {
                        Admission::Hold => continue,
                        Admission::Trial => trials.push((id, dest.to_owned())),
                        Admission::Allow => {}
                    }
                }
                chosen.push(id);
                permits.insert(
                    id,
                    Hold {
                        permit,
                        destination: dest.map(|d| self.inner.destination_load.hold(d)),
                    },
                );
            }
        }
        let bids = self.price(&mut chosen, now).await?;
        // What pricing deferred or could not price gives its permit and its
        // place in its destination's count back now.
        permits.retain(|id, _| chosen.contains(id));
        Ok((chosen, permits, trials, bids))
    }

    /// Keeps, of the ops to unavailable destination hosts, one probe per
    /// host whose probe is due and that this host won (a compare-and-set
    /// on the shared record); the others wait for the probe's outcome.
    async fn probes(&mut self, start: Vec<OpId>, now: DateTime<Utc>) -> Result<Vec<OpId>, DispatchError> {
        let config = self.inner.config.load().destinations.health();
        let mut decided: HashMap<String, bool> = HashMap::new();
        let mut keep = Vec::with_capacity(start.len());
        for id in start {
            let dest = self
                .book
                .get(id)
                .and_then(|e| destination(&e.row.lanes))
                .map(str::to_owned);
            let Some(dest) = dest else {
                keep.push(id);
                continue;
            };
            let Some(health) = self.health.get(&dest).cloned() else {
                keep.push(id);
                continue;
            };
            match health.admit(now) {
                Admit::Go => {
                    keep.push(id);
                    continue;
                }
                // Held, or held since this pass took the host's probe for
                // an earlier op: only the probe goes; the others look again
                // when the next probe may go.
                Admit::Hold { until } => {
                    if let Some(at) = until {
                        self.held_wake = Some(self.held_wake.map_or(at, |w| w.min(at)));
                    }
                    continue;
                }
                Admit::Probe if decided.contains_key(&dest) => {
                    self.wake_for_next_probe(now, &config);
                    continue;
                }
                Admit::Probe => {}
            }
            let won = crate::destinations::take_probe(self.inner.queue.as_ref(), &dest, now, &config).await?;
            decided.insert(dest.clone(), won);
            if let Some(next) = health.take_probe(now, &config) {
                self.health.set(&dest, next);
                self.inner.forget_health();
            }
            if won {
                info!(op = id, destination = %dest, "Probing an unavailable destination with one op.");
                self.probing.insert(id);
                keep.push(id);
            } else {
                self.wake_for_next_probe(now, &config);
            }
        }
        Ok(keep)
    }

    /// Looks again when the probe taken now (here or on another host) is
    /// followed by the next one.
    fn wake_for_next_probe(&mut self, now: DateTime<Utc>, config: &crate::health::HealthConfig) {
        let at = now + chrono_duration(config.probe_every);
        self.held_wake = Some(self.held_wake.map_or(at, |w| w.min(at)));
    }

    /// Keeps, of the ops to each destination host, as many as its shared
    /// token bucket grants now (`destinations.rate_per_second`); the rest
    /// wait, with a wake-up when the next token is there. A token taken for
    /// an op whose claim then fails is spent: the limit errs low.
    async fn rate_limited(&mut self, start: Vec<OpId>, now: DateTime<Utc>) -> Result<Vec<OpId>, DispatchError> {
        let limits = self.inner.config.load().destinations.clone();
        if limits.rate_per_second <= 0.0 || start.is_empty() {
            return Ok(start);
        }
        let mut wanted: Vec<(String, u32)> = Vec::new();
        for id in &start {
            if let Some(dest) = self.book.get(*id).and_then(|e| destination(&e.row.lanes)) {
                match wanted.iter_mut().find(|(d, _)| d == dest) {
                    Some((_, n)) => *n += 1,
                    None => wanted.push((dest.to_owned(), 1)),
                }
            }
        }
        let mut granted: HashMap<String, u32> = HashMap::new();
        for (dest, want) in wanted {
            let (got, next_in) = self
                .draw(&dest, want, limits.rate_per_second, limits.rate_burst, now)
                .await?;
            if let Some(wait) = next_in {
                let at = now + chrono_duration(wait);
                self.held_wake = Some(self.held_wake.map_or(at, |w| w.min(at)));
            }
            granted.insert(dest, got);
        }
        Ok(start
            .into_iter()
            .filter(|id| {
                let Some(dest) = self.book.get(*id).and_then(|e| destination(&e.row.lanes)) else {
                    return true;
                };
                match granted.get_mut(dest) {
                    Some(n) if *n > 0 => {
                        *n -= 1;
                        true
                    }
                    _ => false,
                }
            })
            .collect())
    }

    /// Draws tokens from a destination's shared bucket by compare-and-set.
    async fn draw(
        &self,
        dest: &str,
        want: u32,
        rate: f64,
        burst: u32,
        now: DateTime<Utc>,
    ) -> Result<(u32, Option<Duration>), DispatchError> {
        let drawn = crate::queue::update_record(
            self.inner.queue.as_ref(),
            crate::ratelimit::BUCKETS,
            dest,
            8,
            |stored| {
                let bucket = stored.and_then(|r| serde_json::from_str::<crate::ratelimit::Bucket>(&r.value).ok());
                let draw = crate::ratelimit::take(bucket, want, rate, burst, now);
                let change = if draw.granted == 0 {
                    crate::queue::Change::Keep
                } else {
                    crate::queue::Change::Put(
                        serde_json::to_string(&draw.bucket)
                            .map_err(|e| crate::queue::QueueError::InvalidOp(e.to_string()))?,
                    )
                };
                Ok((change, (draw.granted, draw.next_in)))
            },
        )
        .await?;
        // Contended by other hosts: take nothing this round.
        Ok(drawn.unwrap_or((0, Some(Duration::from_millis(20)))))
    }

    /// Stores what this round's attempts said about their destinations'
    /// health: failures always, answers only for hosts with a record (so
    /// healthy traffic writes nothing), a 410 as a gone inbox or, from a
    /// shared inbox, a suspended host.
    async fn record_health(&mut self, signals: Vec<(String, String, Signal)>, config: &Config, now: DateTime<Utc>) {
        if signals.is_empty() {
            return;
        }
        let health_config = config.destinations.health();
        let queue = self.inner.queue.as_ref();
        let metrics = &self.inner.metrics;
        let mut by_dest: Vec<(String, Vec<Signal>)> = Vec::new();
        for (dest, inbox, signal) in signals {
            if let Signal::Gone = signal {
                match crate::destinations::inbox_gone(queue, metrics, &dest, &inbox, now, &health_config).await {
                    Ok(Some(health)) => {
                        self.inner.forget_health();
                        self.health.set(&dest, health);
                    }
                    Ok(None) => {}
                    Err(e) => warn!(inbox = %inbox, error = %e, "Could not record a gone inbox."),
                }
                continue;
            }
            match by_dest.iter_mut().find(|(d, _)| *d == dest) {
                Some((_, list)) => list.push(signal),
                None => by_dest.push((dest, vec![signal])),
            }
        }
        for (dest, list) in by_dest {
            let failed = list.iter().any(|s| matches!(s, Signal::Failed(_)));
            if !failed && self.health.get(&dest).is_none() {
                continue;
            }
            let events: Vec<Event<'_>> = list
                .iter()
                .map(|s| match s {
                    Signal::Failed(error) => Event::Failed { error },
                    Signal::Answered | Signal::Gone => Event::Answered,
                })
                .collect();
            match crate::destinations::apply(queue, metrics, &dest, &events, "delivery", now, &health_config).await {
                Ok((before, after)) => {
                    if before != after {
                        // Every drain here reads the change at its next read.
                        self.inner.forget_health();
                    }
                    self.health.set(&dest, after);
                }
                Err(e) => warn!(destination = %dest, error = %e, "Could not record destination health."),
            }
        }
    }

    /// Starts an execution task for each claimed op.
    fn spawn(
        &mut self,
        claimed: Vec<Claimed>,
        mut permits: HashMap<OpId, Hold>,
        bids: &HashMap<OpId, FeeBid>,
        config: &Config,
    ) {
        for claimed in claimed {
            // Each op's own hold: its permit and its destination's count.
            let Some(permit) = permits.remove(&claimed.op.id) else {
                continue;
            };
            let kind = config.kinds.get(&claimed.op.kind);
            let timeout = Duration::from_millis(kind.map_or(60_000, |k| k.timeout_ms));
            let executor = self.inner.executors.get(&claimed.op.kind);
            let destination = destination(&claimed.op.lanes).map(str::to_owned);
            let started_at = self.inner.clock.now();
            let fee = bids.get(&claimed.op.id).copied();
            let max_attempts = kind.map_or(RetryPolicy::default().max_attempts, |k| k.max_attempts);
            let max_fee_bumps = kind.and_then(|k| k.max_fee_bumps);
            let slow = Arc::new(AtomicBool::new(false));
            let watch = kind.and_then(|k| k.slow_after_ms).map(|after| SlowWatch {
                after: Duration::from_millis(after),
                places: self.inner.slow_places.clone(),
                flag: slow.clone(),
            });
            let flight = Flight {
                claimed,
                destination,
                fee,
                started_at,
                slow,
            };
            let task = execute(
                self.inner.clone(),
                executor,
                flight.clone(),
                (timeout, max_attempts, max_fee_bumps),
                (permit, watch, self.slowed.clone()),
            );
            let handle = self.running.spawn(task);
            self.flights.insert(handle.id(), flight);
        }
    }

    /// Prices the chosen ops whose kind has a fee oracle: keeps the bids of
    /// those that may go, defers (in the database, without using an
    /// attempt) those the policy defers, and leaves out those that cannot be
    /// priced now. Returns the bids.
    async fn price(
        &mut self,
        chosen: &mut Vec<OpId>,
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
            let Some(op) = self.book.get(id).map(|e| e.row.clone()) else {
                continue;
            };
            match pricer.price(&config, &mut views, &op, now).await {
                Ok(None) => keep.push(id),
                Ok(Some(FeeDecision::Submit { bid, .. })) => {
                    let metrics = &self.inner.metrics;
                    if bid.capped {
                        Priced::Capped {
                            op: id,
                            kind: &op.kind,
                            priority: op.priority,
                            fee: bid.base_fee,
                        }
                        .emit(metrics);
                    } else if bid.aggressive {
                        Priced::Aggressive {
                            op: id,
                            kind: &op.kind,
                            fee: bid.base_fee,
                        }
                        .emit(metrics);
                    }
                    bids.insert(id, bid);
                    keep.push(id);
                }
                Ok(Some(FeeDecision::Defer(wait))) => {
                    let until = now + chrono_duration(wait);
                    if self.inner.queue.defer(id, until).await?.applied() {
                        self.book.deferred(id, until);
                        Priced::Deferred {
                            op: id,
                            kind: &op.kind,
                            priority: op.priority,
                            until,
                        }
                        .emit(&self.inner.metrics);
                    }
                }
                Err(e @ crate::pricing::PricingError::NoSampleYet(_)) => {
                    debug!(op = id, kind = %op.kind, error = %e, "Waiting for the fee oracle's first sample.");
                }
                Err(e) => {
                    // A policy that fails (a crash, its fuel spent) would
                    // fail again on the next pass: the op waits, without
                    // using an attempt, its kind's longest backoff and
                    // longer at each failure in a row, so a broken policy
                    // behind a backlog is not run for every op all the time.
                    let backoff_max = config.kinds.get(&op.kind).map_or(1000, |k| k.backoff_max_ms);
                    let wait = pricer.failed(id, Duration::from_millis(backoff_max));
                    let until = now + chrono_duration(wait);
                    warn!(op = id, kind = %op.kind, error = %e, retry_at = %until, "Cannot price the op; it waits.");
                    if self.inner.queue.defer(id, until).await?.applied() {
                        self.book.deferred(id, until);
                    }
                }
            }
        }
        *chosen = keep;
        Ok(bids)
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

    /// Decides what becomes of each finished attempt (the retry policy over
    /// its classified outcome): the settles to write and what to log once
    /// they are written.
    fn decide(&mut self, batch: Vec<Finished>, config: &Config, now: DateTime<Utc>) -> (Vec<Completion>, Vec<Note>) {
        let in_pass_cap = config.dispatch.in_pass_attempts;
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
            // A probe that finds its destination still down is not a dead
            // letter: its destination is held, and so is it, until the next
            // probe.
            let probe = self.probing.remove(&op.id);
            // Nor is an attempt that failed against a host its record now
            // holds (this failure may be what made it unavailable): the
            // record is written before deciding, so this does not depend
            // on how fresh the view was when the attempt was planned.
            let held = f
                .destination
                .as_deref()
                .and_then(|d| self.health.get(d))
                .is_some_and(crate::health::Health::held);
            let decision = match decision {
                Decision::DeadLetter { error } if (probe || held) && f.outcome.destination_failed() == Some(true) => {
                    Decision::Retry {
                        at: now + chrono_duration(config.destinations.health().probe_every),
                        error,
                        fee_bump: false,
                    }
                }
                other => other,
            };
            let tries = self.in_pass.entry(op.id).or_default();
            *tries += 1;
            if matches!(decision, Decision::Retry { .. }) && *tries >= in_pass_cap {
                self.stalled.insert(op.id);
            }
            if let Some(dest) = &f.destination {
                let error = f.outcome.error();
                self.inner
                    .breakers()
                    .record(dest, f.outcome.destination_failed(), error.as_deref(), now);
            }
            crate::events::PluginCalled {
                kind: &op.kind,
                plugin: kind.and_then(|k| k.plugin.as_deref()),
                outcome: &f.outcome,
                seconds: (f.finished_at - f.started_at)
                    .to_std()
                    .unwrap_or_default()
                    .as_secs_f64(),
            }
            .emit(&self.inner.metrics);
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
        (completions, notes)
    }

    /// Applies written settles to the book and logs them.
    fn record_settles(&mut self, completions: &[Completion], notes: Vec<Note>, results: Vec<Cas>) {
        for ((completion, (claimed, decision)), result) in completions.iter().zip(notes).zip(results) {
            let op = &claimed.op;
            self.book.settled(op.id, &completion.finish, result.applied());
            if !result.applied() {
                self.refresh_at = self.refresh_at.min(Instant::now() + PARKED_RECHECK);
                LeaseLost {
                    op: op.id,
                    attempt: claimed.lease.attempt,
                }
                .emit(&self.inner.metrics);
                continue;
            }
            let decision = match &decision {
                Decision::Confirm { .. } => Settled::Confirmed {
                    latency_seconds: (completion.attempt.finished_at - op.created_at)
                        .to_std()
                        .unwrap_or_default()
                        .as_secs_f64(),
                },
                Decision::Retry { at, error, fee_bump } => Settled::Retry {
                    at: *at,
                    error,
                    fee_bump: *fee_bump,
                },
                Decision::DeadLetter { error } => Settled::DeadLetter {
                    error,
                    class: completion.attempt.class.as_str(),
                    lanes: &op.lanes,
                    correlation_id: op.correlation_id.as_deref(),
                },
            };
            OpSettled {
                op: op.id,
                kind: &op.kind,
                outbox: &op.outbox,
                priority: op.priority,
                attempt: claimed.lease.attempt,
                decision,
            }
            .emit(&self.inner.metrics);
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
fn destination(lanes: &[String]) -> Option<&str> {
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
    (timeout, max_attempts, max_fee_bumps): (Duration, u32, Option<u32>),
    (hold, watch, slowed): (Hold, Option<SlowWatch>, Arc<Notify>),
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
