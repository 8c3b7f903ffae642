//! The dispatcher: drains outboxes, one drain per outbox at a time, through
//! the lane scheduler, the executors and the retry policy.
//!
//! Wake-ups come from three places: enqueues through [`Dispatcher::enqueue`]
//! or [`Dispatcher::trigger`] (at once), PostgreSQL `NOTIFY` from producers
//! anywhere, and a safety-net poll that also recovers expired leases.

mod attempt;
mod book;
mod handover;
mod load;
mod pass;
mod paused;
mod redeal;
mod share;
pub mod slots;
mod slow;
mod verdict;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::{ArcSwap, ArcSwapOption};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

use crate::breaker::{BreakerConfig, Breakers};
use crate::clock::Clock;
use crate::config::Config;
use crate::events::Metrics;
use crate::executor::Registry;
use crate::pricing::{FeeEstimate, FeePolicies, Pricer, PricingError};
use crate::queue::{Enqueued, ExpireTo, NewOp, Queue, QueueError};
use slots::{LocalSlots, Trigger};

/// Errors that stop the dispatcher (not single ops: those are outcomes).
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    /// The queue failed.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// A round's commit task ended without a result (it panicked, or the
    /// runtime is shutting down): what it claimed is recovered by lease
    /// expiry.
    #[error("a round's commit did not finish: {0}")]
    Commit(#[from] tokio::task::JoinError),
}

/// Shared state of one dispatcher.
pub(crate) struct Inner {
    pub queue: Arc<dyn Queue>,
    /// Plugin notes this host read or wrote lately.
    pub notes: Arc<crate::executor::NoteCache>,
    pub executors: Arc<Registry>,
    pub config: ArcSwap<Config>,
    pub clock: Arc<dyn Clock>,
    pub owner: String,
    pub slots: LocalSlots,
    pub permits: Arc<Semaphore>,
    /// How many permits there are in all (`dispatch.max_in_flight` at start).
    pub permit_total: usize,
    /// Places for slow attempts, which gave their permits back
    /// (`dispatch.max_slow` at start).
    pub slow_places: Arc<Semaphore>,
    /// How many places there are in all.
    pub slow_total: usize,
    pub breakers: Mutex<Breakers>,
    pub cancel: CancellationToken,
    pub tasks: TaskTracker,
    /// Kinds already reported as not runnable (logged once per process).
    pub unrunnable: Mutex<HashSet<String>>,
    /// Prices attempts of kinds with a fee oracle, once fee policies are set.
    pub pricer: ArcSwapOption<Pricer>,
    /// The earliest wake-up timer set per outbox.
    pub timers: Mutex<HashMap<String, tokio::time::Instant>>,
    /// Drain slots this host should hand back (it holds more than its
    /// share), as of the last heartbeat.
    pub hand_back: AtomicUsize,
    /// Outboxes handed back, not to be taken again before the time given
    /// unless no other host took them.
    pub handed_back: Mutex<HashMap<String, tokio::time::Instant>>,
    /// Which outboxes contend for the host's permits.
    pub share: Mutex<share::Share>,
    /// Which outboxes wait on lanes another outbox here occupies.
    pub handover: Mutex<handover::Handover>,
    /// What the events of this dispatcher count.
    pub metrics: Arc<Metrics>,
    /// The shared destination health, read every
    /// `destinations.health_refresh_ms` (and
    /// at once after a change here) by one task, so drains read it without
    /// waiting on the database.
    pub health: ArcSwap<crate::destinations::HealthView>,
    /// Asks that task to read it now.
    pub health_changed: tokio::sync::Notify,
    /// Ops in flight per destination host, for the per-destination cap.
    pub destination_load: Arc<load::DestinationLoad>,
}

impl Inner {
    /// `true` if `kind` was already reported; marks it reported otherwise.
    pub fn warned_kind(&self, kind: &str) -> bool {
        let mut seen = self.unrunnable.lock().unwrap_or_else(PoisonError::into_inner);
        !seen.insert(kind.to_owned())
    }

    pub fn share(&self) -> std::sync::MutexGuard<'_, share::Share> {
        // Plain sets: consistent even if a holder panicked.
        self.share.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn handover(&self) -> std::sync::MutexGuard<'_, handover::Handover> {
        // Plain maps: consistent even if a holder panicked.
        self.handover.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `by` settled ops of `lanes`: wakes the outboxes here waiting on them.
    pub fn lanes_freed(self: &Arc<Self>, by: &str, lanes: &[String]) {
        let wake = self.handover().freed(by, lanes);
        for outbox in wake {
            self.trigger(&outbox);
        }
    }

    /// Wakes outboxes that wait for host permits, if any are free.
    pub fn wake_starved(self: &Arc<Self>) {
        let free = self.permits.available_permits();
        if free == 0 {
            return;
        }
        let wake = {
            let share = self.share();
            if !share.has_starved() {
                return;
            }
            share.to_wake(free)
        };
        for outbox in wake {
            self.trigger(&outbox);
        }
    }

    /// The shared destination health as last read.
    pub fn health_view(&self) -> Arc<crate::destinations::HealthView> {
        self.health.load_full()
    }

    /// Asks for the health view to be read again now (this host changed a
    /// record), so every drain here sees the change at its next read.
    pub fn forget_health(&self) {
        self.health_changed.notify_one();
    }

    /// Reads the shared destination health every `health_refresh_ms`, or
    /// at once when asked, until cancelled; a failed read keeps the last.
    pub async fn refresh_health(&self) {
        loop {
            match crate::destinations::HealthView::load(self.queue.as_ref()).await {
                Ok(view) => self.health.store(Arc::new(view)),
                Err(e) => warn!(error = %e, "Could not read destination health; using the last view."),
            }
            let every = Duration::from_millis(self.config.load().destinations.health_refresh_ms);
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                () = self.health_changed.notified() => {}
                () = self.cancel.cancelled() => return,
            }
        }
    }

    pub fn breakers(&self) -> std::sync::MutexGuard<'_, Breakers> {
        // The breaker map stays consistent even if a holder panicked.
        self.breakers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Called by a running pass: `true` if it should end and hand its slot
    /// back, which it then must do (the count is taken).
    pub fn take_hand_back(&self) -> bool {
        self.hand_back
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
    }

    /// Records that the outbox was handed back until `until`.
    pub fn handed_back(&self, outbox: &str, until: tokio::time::Instant) {
        let mut handed = self.handed_back.lock().unwrap_or_else(PoisonError::into_inner);
        handed.retain(|_, t| *t > tokio::time::Instant::now());
        handed.insert(outbox.to_owned(), until);
    }

    /// Whether the outbox was handed back recently: another host should take it.
    pub fn is_handed_back(&self, outbox: &str) -> bool {
        let handed = self.handed_back.lock().unwrap_or_else(PoisonError::into_inner);
        handed.get(outbox).is_some_and(|t| *t > tokio::time::Instant::now())
    }

    /// Wakes the outbox's drain. Never waits: a drain already running looks
    /// once more before it finishes.
    pub fn trigger(self: &Arc<Self>, outbox: &str) {
        if self.cancel.is_cancelled() {
            return;
        }
        if self.slots.trigger(outbox) == Trigger::Start {
            self.tasks.spawn(pass::drain(self.clone(), outbox.to_owned()));
        }
    }

    /// Triggers the outbox at `at` (an op's backoff ends then), unless an
    /// earlier wake-up is already set: due ops start on time, not at the
    /// next poll.
    pub fn wake_at(self: &Arc<Self>, outbox: &str, at: tokio::time::Instant) {
        {
            let mut timers = self.timers.lock().unwrap_or_else(PoisonError::into_inner);
            if timers
                .get(outbox)
                .is_some_and(|set| *set <= at && *set > tokio::time::Instant::now())
            {
                return;
            }
            timers.insert(outbox.to_owned(), at);
        }
        let inner = self.clone();
        let outbox = outbox.to_owned();
        self.tasks.spawn(async move {
            tokio::select! {
                () = tokio::time::sleep_until(at) => {}
                () = inner.cancel.cancelled() => return,
            }
            {
                let mut timers = inner.timers.lock().unwrap_or_else(PoisonError::into_inner);
                if timers.get(&outbox) == Some(&at) {
                    timers.remove(&outbox);
                }
            }
            inner.trigger(&outbox);
        });
    }
}

/// A running dispatcher; cheap to clone.
#[derive(Clone)]
pub struct Dispatcher {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher").field("owner", &self.inner.owner).finish()
    }
}

impl Dispatcher {
    /// A dispatcher over `queue` with `executors`. The host-wide in-flight
    /// cap and breaker settings are read once here; every other setting is
    /// read per pass and follows [`Dispatcher::reconfigure`].
    pub fn new(queue: Arc<dyn Queue>, executors: Arc<Registry>, config: Config, clock: Arc<dyn Clock>) -> Self {
        let owner = format!(
            "{}:{}:{}",
            std::env::var("HOSTNAME").unwrap_or_else(|_| "laneway".to_owned()),
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let breakers = Breakers::new(BreakerConfig {
            threshold: config.dispatch.breaker.threshold,
            cool_off: Duration::from_millis(config.dispatch.breaker.cool_off_ms),
        });
        let permits = Arc::new(Semaphore::new(config.dispatch.max_in_flight));
        let permit_total = config.dispatch.max_in_flight;
        let slow_total = config.dispatch.max_slow;
        Self {
            inner: Arc::new(Inner {
                queue,
                notes: Arc::default(),
                executors,
                config: ArcSwap::from_pointee(config),
                clock,
                owner,
                slots: LocalSlots::default(),
                permits,
                permit_total,
                slow_places: Arc::new(Semaphore::new(slow_total)),
                slow_total,
                breakers: Mutex::new(breakers),
                cancel: CancellationToken::new(),
                tasks: TaskTracker::new(),
                unrunnable: Mutex::new(HashSet::new()),
                pricer: ArcSwapOption::empty(),
                timers: Mutex::new(HashMap::new()),
                hand_back: AtomicUsize::new(0),
                handed_back: Mutex::new(HashMap::new()),
                share: Mutex::new(share::Share::default()),
                handover: Mutex::new(handover::Handover::default()),
                metrics: Arc::new(Metrics::new()),
                health: ArcSwap::from_pointee(crate::destinations::HealthView::default()),
                health_changed: tokio::sync::Notify::new(),
                destination_load: Arc::default(),
            }),
        }
    }

    /// The executors it runs (and asks for an op's lanes).
    pub fn executors(&self) -> &Arc<Registry> {
        &self.inner.executors
    }

    /// Host permits taken now: ops scheduled, being claimed or executing
    /// (what `laneway bench` compares with the requests servers see).
    pub fn permits_in_use(&self) -> usize {
        self.inner
            .permit_total
            .saturating_sub(self.inner.permits.available_permits())
    }

    /// Slow attempts waiting now, outside the permits (`dispatch::slow`).
    pub fn slow_in_use(&self) -> usize {
        self.inner
            .slow_total
            .saturating_sub(self.inner.slow_places.available_permits())
    }

    /// What its events count (what `/metrics` shows).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    /// Destinations whose breaker holds their ops now, on this host, and
    /// until when.
    pub fn breakers_open(&self) -> Vec<(String, chrono::DateTime<chrono::Utc>)> {
        let now = self.inner.clock.now();
        self.inner
            .breakers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .open(now)
    }

    /// Waits up to `wait` for op `id` to reach a terminal status, and
    /// returns it then; `None` when the wait ends first (the op goes on).
    /// It polls the op's row (every host's settles land there), starting
    /// at 5 ms and backing off to 200 ms, so a fast op answers fast and a
    /// slow one costs a few reads a second.
    ///
    /// # Errors
    ///
    /// The queue's error; [`QueueError::NotFound`] if there is no such op.
    pub async fn wait_terminal(
        &self,
        id: crate::op::OpId,
        wait: Duration,
    ) -> Result<Option<crate::op::Op>, QueueError> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut pause = Duration::from_millis(5);
        loop {
            let op = self.inner.queue.get(id).await?.ok_or(QueueError::NotFound(id))?;
            if op.status.is_terminal() {
                return Ok(Some(op));
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }

    /// Enqueues one op and waits up to `wait` for its outcome: the
    /// synchronous caller's enqueue. A repeated idempotency key waits for
    /// the op it names.
    ///
    /// # Errors
    ///
    /// As [`Self::enqueue`] and [`Self::wait_terminal`].
    pub async fn enqueue_and_wait(
        &self,
        op: &NewOp,
        wait: Duration,
    ) -> Result<(Enqueued, Option<crate::op::Op>), QueueError> {
        let results = self.enqueue(std::slice::from_ref(op)).await?;
        let result = results
            .first()
            .copied()
            .ok_or_else(|| QueueError::InvalidOp("the queue returned no result".to_owned()))?;
        let done = match result {
            Enqueued::Created(id) | Enqueued::Existing(id) => self.wait_terminal(id, wait).await?,
            Enqueued::AlreadyPending(_) => None,
        };
        Ok((result, done))
    }

    /// This host's breakers, for operators.
    pub fn breakers(&self, now: chrono::DateTime<chrono::Utc>) -> Vec<crate::breaker::BreakerView> {
        self.inner.breakers().list(now)
    }

    /// One destination's breaker on this host, if it has any state.
    pub fn breaker(
        &self,
        destination: &str,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Option<crate::breaker::BreakerView> {
        self.inner
            .breakers()
            .list(now)
            .into_iter()
            .find(|b| b.destination == destination)
    }

    /// Holds a destination's ops on this host until [`Self::close_breaker`].
    pub fn force_open_breaker(&self, destination: &str) {
        self.inner.breakers().force_open(destination);
    }

    /// Closes a destination's breaker on this host and wakes every outbox
    /// with due work, so its held ops go now rather than at the next poll.
    /// Returns whether it had any state.
    pub fn close_breaker(&self, destination: &str) -> bool {
        let closed = self.inner.breakers().close(destination);
        if closed {
            self.wake_due();
        }
        closed
    }

    /// A destination's health as this host's drains see it now (the shared
    /// records as last read; `None`: nothing known against it).
    pub fn destination_health(&self, host: &str) -> Option<crate::health::Health> {
        self.inner.health_view().get(host).cloned()
    }

    /// Suspends a destination host on every host (an operator's hold with
    /// no probes) until [`Self::resume_destination`]. Returns its health
    /// before and after.
    ///
    /// # Errors
    ///
    /// A queue error.
    pub async fn suspend_destination(
        &self,
        host: &str,
        reason: &str,
        actor: &str,
    ) -> Result<(crate::health::Health, crate::health::Health), QueueError> {
        self.change_destination(host, crate::health::Event::Suspend { reason }, actor)
            .await
    }

    /// Makes a destination host available again on every host (whatever
    /// held it) and forgets its inboxes' 410s, then wakes every outbox with
    /// due work. Returns its health before and after, and the inboxes
    /// forgotten.
    ///
    /// # Errors
    ///
    /// A queue error.
    pub async fn resume_destination(
        &self,
        host: &str,
        actor: &str,
    ) -> Result<(crate::health::Health, crate::health::Health, Vec<String>), QueueError> {
        let config = self.inner.config.load().destinations.health();
        let now = self.inner.clock.now();
        let (before, after, forgotten) = crate::destinations::resume(
            self.inner.queue.as_ref(),
            &self.inner.metrics,
            host,
            actor,
            now,
            &config,
        )
        .await?;
        self.inner.forget_health();
        if !self.close_breaker(host) {
            self.wake_due();
        }
        Ok((before, after, forgotten))
    }

    /// An inbound activity came from `host`: if it was held, it is
    /// available again (the server is evidently up).
    ///
    /// # Errors
    ///
    /// A queue error.
    pub async fn destination_heard_from(&self, host: &str) -> Result<(), QueueError> {
        if self.inner.health_view().get(host).is_none() {
            return Ok(());
        }
        let (before, after) = self
            .change_destination(host, crate::health::Event::Inbound, "inbound")
            .await?;
        if before.held() && !after.held() {
            self.wake_due();
        }
        Ok(())
    }

    async fn change_destination(
        &self,
        host: &str,
        event: crate::health::Event<'_>,
        by: &str,
    ) -> Result<(crate::health::Health, crate::health::Health), QueueError> {
        let config = self.inner.config.load().destinations.health();
        let now = self.inner.clock.now();
        let changed = crate::destinations::apply(
            self.inner.queue.as_ref(),
            &self.inner.metrics,
            host,
            &[event],
            by,
            now,
            &config,
        )
        .await?;
        self.inner.forget_health();
        Ok(changed)
    }

    /// Wakes every outbox with due work (after a hold was lifted), so its
    /// held ops go now rather than at the next poll.
    fn wake_due(&self) {
        let queue = self.inner.queue.clone();
        let me = self.clone();
        tokio::spawn(async move {
            match queue.due_outboxes(1000).await {
                Ok(outboxes) => outboxes.iter().for_each(|o| me.trigger(o)),
                Err(e) => warn!(error = %e, "Could not wake outboxes after lifting a hold; the poll will."),
            }
        });
    }

    /// The lease owner name this dispatcher claims under.
    pub fn owner(&self) -> &str {
        &self.inner.owner
    }

    /// The queue it drains.
    pub fn queue(&self) -> &Arc<dyn Queue> {
        &self.inner.queue
    }

    /// Prices attempts of kinds that name a fee oracle with these policies.
    /// Until this is called such kinds are not priced (their executors get
    /// no bid and use their own default).
    pub fn set_fee_policies(&self, policies: Arc<dyn FeePolicies>) {
        let pricer = Pricer::new(policies, self.inner.queue.clone());
        self.inner.pricer.store(Some(Arc::new(pricer)));
    }

    /// The fee a new op of `kind` at `priority` would bid now and its
    /// expected confirmation time (seed 003's enqueue estimate); `None` when
    /// the kind is not priced.
    ///
    /// # Errors
    ///
    /// [`PricingError`].
    pub async fn estimate(
        &self,
        kind: &str,
        priority: crate::op::Priority,
    ) -> Result<Option<FeeEstimate>, PricingError> {
        let Some(pricer) = self.inner.pricer.load_full() else {
            return Ok(None);
        };
        let config = self.inner.config.load_full();
        let now = self.inner.clock.now();
        Ok(pricer
            .estimate(&config, kind, priority, now)
            .await?
            .map(FeeEstimate::from))
    }

    /// The config of the moment (reloads replace it).
    pub fn config(&self) -> Arc<Config> {
        self.inner.config.load_full()
    }

    /// Applies new tunables (priorities, retry policy, caps) from the next pass on.
    pub fn reconfigure(&self, config: Config) {
        let registry = config.kind_registry();
        self.inner.config.store(Arc::new(config));
        // Plain-SQL producers see the new kinds, lane rules and default
        // priorities from now on.
        let queue = self.inner.queue.clone();
        self.inner.tasks.spawn(async move {
            if let Err(e) = queue.register_kinds(&registry).await {
                tracing::warn!(error = %e, "Could not register the kinds for plain-SQL producers; their inserts are checked against the previous ones.");
            }
        });
    }

    /// Wakes the outbox's drain. Never waits: a drain already running looks
    /// once more before it finishes.
    pub fn trigger(&self, outbox: &str) {
        self.inner.trigger(outbox);
    }

    /// Enqueues ops and wakes their outboxes. An op without lanes gets the
    /// lanes its kind's executor names for it.
    ///
    /// # Errors
    ///
    /// The queue's error, or [`QueueError::InvalidOp`] when an executor
    /// refuses an op; nothing was enqueued.
    pub async fn enqueue(&self, ops: &[NewOp]) -> Result<Vec<Enqueued>, QueueError> {
        let config = self.inner.config.load();
        for op in ops {
            config.refuse_internal_kind(&op.kind).map_err(QueueError::InvalidOp)?;
        }
        self.enqueue_internal(ops).await
    }

    /// [`Dispatcher::enqueue`] for laneway's own kinds too: the outcome
    /// relay and the verified inbox, never a producer.
    pub(crate) async fn enqueue_internal(&self, ops: &[NewOp]) -> Result<Vec<Enqueued>, QueueError> {
        let ops = self.with_lanes(ops).await?;
        let ops = ops.as_slice();
        let results = self.inner.queue.enqueue(ops).await?;
        let outboxes: BTreeSet<&str> = ops
            .iter()
            .zip(&results)
            .filter(|(_, r)| matches!(r, Enqueued::Created(_)))
            .map(|(op, _)| op.outbox.as_str())
            .collect();
        for outbox in outboxes {
            self.trigger(outbox);
        }
        Ok(results)
    }

    /// The ops with the lanes their kinds' executors name: a kind whose
    /// plugin owns its lanes gets the plugin's (or a pool's channel); any
    /// other op without lanes gets what its executor names. What a Rust
    /// producer's transactional enqueue passes to `enqueue_in`, so it gets
    /// the lanes the API's enqueue would.
    ///
    /// # Errors
    ///
    /// [`QueueError::InvalidOp`] when an executor refuses an op or names
    /// lanes that the op's own leave out.
    pub async fn with_lanes(&self, ops: &[NewOp]) -> Result<Vec<NewOp>, QueueError> {
        let config = self.inner.config.load();
        let mut ops = ops.to_vec();
        self.report_held_channels(&ops).await?;
        for op in &mut ops {
            let plugin_lanes = config
                .kinds
                .get(&op.kind)
                .is_some_and(|k| k.lanes == crate::config::LanePresence::Plugin);
            // With no executor loaded the plugin cannot say; the executor
            // checks the op's lanes before sending once one is.
            let loaded = self.inner.executors.get(&op.kind).is_some();
            if plugin_lanes && !loaded && op.lanes.is_empty() {
                return Err(QueueError::InvalidOp(format!(
                    "kind {}: its plugin owns its lanes and none is loaded to name them",
                    op.kind
                )));
            }
            if let Some(pool) = config.kinds.get(&op.kind).and_then(|k| k.pool.as_ref()) {
                if !op.lanes.is_empty() {
                    return Err(QueueError::InvalidOp(format!(
                        "kind {}: its ops are dealt channels from pool {pool:?}; an op names no lanes",
                        op.kind
                    )));
                }
            }
            let owned = plugin_lanes && loaded;
            if !owned && !op.lanes.is_empty() {
                continue;
            }
            let named = self
                .inner
                .executors
                .lanes_for(&op.kind, &op.outbox, &op.payload)
                .await
                .map_err(|e| QueueError::InvalidOp(format!("kind {}: the executor refused the op: {e}", op.kind)))?;
            op.lanes = if owned {
                crate::enqueue::owned_lanes(&op.kind, std::mem::take(&mut op.lanes), named)
                    .map_err(|e| QueueError::InvalidOp(e.to_string()))?
            } else {
                named
            };
        }
        Ok(ops)
    }

    /// Tells each pool the ops' kinds are dealt from which of its channels
    /// a receipt in doubt holds now, so new ops are not dealt behind it
    /// while another channel is free.
    async fn report_held_channels(&self, ops: &[NewOp]) -> Result<(), QueueError> {
        let kinds: BTreeSet<&str> = ops.iter().map(|o| o.kind.as_str()).collect();
        for kind in kinds {
            let Some(pool) = self.inner.executors.pool_of(kind) else {
                continue;
            };
            let accounts: Vec<String> = pool.channels.iter().map(|c| c.account.clone()).collect();
            let held = self
                .inner
                .queue
                .occupants(&accounts)
                .await?
                .into_iter()
                .filter(crate::queue::Occupant::waits_in_doubt)
                .flat_map(|o| o.lanes)
                .filter(|lane| accounts.contains(lane))
                .collect();
            pool.hold(held);
        }
        Ok(())
    }

    /// Fans an activity out to its recipients: one op per distinct delivery
    /// inbox (see [`crate::fanout`]) except those remembered as gone,
    /// enqueued in one transaction. Returns each op's result and the plan
    /// (with the gone inboxes skipped).
    ///
    /// # Errors
    ///
    /// [`crate::destinations::FanOutFailure`].
    pub async fn fan_out(
        &self,
        request: &crate::fanout::FanOut,
    ) -> Result<(Vec<Enqueued>, crate::destinations::PlannedFanOut), crate::destinations::FanOutFailure> {
        let config = self.inner.config.load_full();
        let planned = crate::destinations::plan_fan_out(self.inner.queue.as_ref(), &config, request).await?;
        let results = self.enqueue(&planned.ops).await?;
        Ok((results, planned))
    }

    /// Runs until [`Dispatcher::shutdown`]: listens for wake-ups, polls for
    /// due work and expired leases, and on shutdown waits for every drain to
    /// finish its in-flight ops (up to the grace period).
    ///
    /// # Errors
    ///
    /// A queue error while subscribing to wake-ups.
    pub async fn run(&self) -> Result<(), DispatchError> {
        let subscription = self.inner.queue.subscribe().await?;
        let listen = async {
            let Some(mut subscription) = subscription else {
                return std::future::pending::<()>().await;
            };
            loop {
                match subscription.next().await {
                    Ok(outbox) => self.trigger(&outbox),
                    Err(e) => {
                        warn!(error = %e, "Wake-up listener failed; relying on the poll until it recovers.");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        };
        let poll = async {
            loop {
                if let Err(e) = self.poll_once().await {
                    warn!(error = %e, "Safety-net poll failed.");
                }
                let every = Duration::from_millis(self.inner.config.load().dispatch.poll_ms);
                tokio::time::sleep(every).await;
            }
        };
        info!(owner = %self.inner.owner, backend = ?self.inner.queue.backend(), "Dispatcher started.");
        // Its own task: it ends with the dispatcher's cancellation.
        let inner = self.inner.clone();
        let refresher = tokio::spawn(async move { inner.refresh_health().await });
        tokio::select! {
            () = self.inner.cancel.cancelled() => {}
            () = listen => {}
            () = poll => {}
        }
        refresher.abort();
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
        info!(owner = %self.inner.owner, "Dispatcher stopped.");
        Ok(())
    }

    /// Stops claiming; drains finish in-flight ops within the grace period,
    /// interrupt the rest (returning them to the queue) and release their slots.
    pub fn shutdown(&self) {
        self.inner.cancel.cancel();
    }

    /// Whether [`Dispatcher::shutdown`] has been called.
    pub fn is_cancelled(&self) -> bool {
        self.inner.cancel.is_cancelled()
    }

    /// Resolves once [`Dispatcher::shutdown`] has been called.
    pub async fn cancelled(&self) {
        self.inner.cancel.cancelled().await;
    }

    /// Waits until every drain task has ended (after [`Dispatcher::shutdown`]).
    pub async fn stopped(&self) {
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
    }

    /// One safety-net round: recover expired leases, wake outboxes with due work.
    ///
    /// # Errors
    ///
    /// The queue's error.
    pub async fn poll_once(&self) -> Result<(), QueueError> {
        self.recover_expired().await?;
        for outbox in self.inner.queue.due_outboxes(1000).await? {
            debug!(outbox = %outbox, "Poll found due work.");
            self.trigger(&outbox);
        }
        // Announce this host and learn its share of the busy outboxes: a host
        // holding more than its share hands some back, so N hosts all work.
        // Last, so a failing heartbeat never keeps due work from its drain.
        let poll = Duration::from_millis(self.inner.config.load().dispatch.poll_ms);
        let share = self.inner.queue.heartbeat(&self.inner.owner, poll * 3).await?;
        let excess = share.excess();
        if excess > 0 {
            debug!(
                hosts = share.hosts,
                slots = share.slots,
                mine = share.mine,
                "Holding more than this host's share of drain slots."
            );
        }
        self.inner.hand_back.store(excess, Ordering::Release);
        Ok(())
    }

    /// Returns ops whose lease ran out (their dispatcher crashed or stalled)
    /// to the queue, or dead-letters them if that was their last attempt.
    ///
    /// # Errors
    ///
    /// The queue's error.
    pub async fn recover_expired(&self) -> Result<usize, QueueError> {
        let expired = self.inner.queue.expired_leases(100).await?;
        let mut recovered = 0;
        for claimed in expired {
            let config = self.inner.config.load();
            let (max_attempts, halt) = config
                .kinds
                .get(&claimed.op.kind)
                .map_or((crate::retry::RetryPolicy::default().max_attempts, false), |k| {
                    (k.max_attempts, k.halts_lanes())
                });
            let used = u32::try_from(claimed.op.budget_attempts()).unwrap_or(0);
            // An op with a receipt may have taken effect: it goes back so its
            // executor reconciles it, whatever its budget; dead-lettering it
            // unseen could record a landed payment as failed.
            let to = if used >= max_attempts && claimed.op.receipt.is_none() {
                ExpireTo::DeadLetter { halt_lanes: halt }
            } else {
                ExpireTo::Retry(self.inner.clock.now())
            };
            if self.inner.queue.expire(&claimed.lease, to).await?.applied() {
                recovered += 1;
                match to {
                    ExpireTo::DeadLetter { .. } => error!(
                        op = claimed.op.id,
                        kind = %claimed.op.kind,
                        attempts = claimed.op.attempts,
                        lanes = ?claimed.op.lanes,
                        correlation_id = ?claimed.op.correlation_id,
                        owner = ?claimed.op.lease_owner,
                        "Op dead-lettered: its lease expired on its last attempt."
                    ),
                    ExpireTo::Retry(_) => warn!(
                        op = claimed.op.id,
                        owner = ?claimed.op.lease_owner,
                        has_receipt = claimed.op.receipt.is_some(),
                        "Lease expired; the op goes back to the queue."
                    ),
                }
                self.trigger(&claimed.op.outbox);
            } else {
                debug!(op = claimed.op.id, "Expired lease was settled concurrently.");
            }
        }
        Ok(recovered)
    }

    /// Outboxes this process is draining right now.
    pub fn draining(&self) -> Vec<String> {
        self.inner.slots.running()
    }
}
