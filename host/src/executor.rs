//! The executor boundary: the one trait the dispatcher calls to deliver an
//! op, and the registry mapping kinds to executors.
//!
//! The wasm runtime implements [`Executor`] for plugins; tests implement it
//! directly. The registry is swapped atomically, so a reload never disturbs
//! calls already running on the executors they started with.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;

use crate::fees::FeeBid;
use crate::op::{Lease, Op};
use crate::outcome::Outcome;
use crate::queue::{Cas, Queue, QueueError};

/// What a reconcile found for a checkpointed receipt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reconciled {
    /// The side effect's fate is known (it landed, or it failed for good).
    Settled(Outcome),
    /// It did not happen and cannot happen any more: deliver afresh.
    Redeliver,
}

/// Why a checkpoint was not stored.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The op's lease is no longer this call's: the side effect must not go ahead.
    #[error("the op's lease was taken over; do not perform the side effect")]
    LeaseLost,
    /// The database failed.
    #[error(transparent)]
    Queue(#[from] QueueError),
}

/// Lets an executor persist a receipt before its side effect.
#[async_trait]
pub trait Checkpoint: Send + Sync {
    /// Stores `receipt` durably; returns only once it is committed.
    async fn checkpoint(&self, receipt: &str) -> Result<(), CheckpointError>;
}

/// Where a plugin's per-destination notes live (WIT `notes`), shared by
/// every host.
#[async_trait]
pub trait Notes: Send + Sync {
    /// The note `key` of `plugin` for destination `host`.
    async fn get(&self, plugin: &str, host: &str, key: &str) -> Result<Option<String>, QueueError>;
    /// Stores it.
    async fn set(&self, plugin: &str, host: &str, key: &str, value: &str) -> Result<(), QueueError>;
    /// Takes the claim `key` of `plugin` on `host` for `ttl` unless someone
    /// (on any host) holds it: `true` when taken.
    async fn claim(&self, plugin: &str, host: &str, key: &str, ttl: Duration) -> Result<bool, QueueError>;
}

/// Notes kept as shared records, one namespace per plugin, read through a
/// per-host [`NoteCache`].
pub struct QueueNotes {
    queue: Arc<dyn Queue>,
    cache: Arc<NoteCache>,
}

/// How long a note read from the database is used before it is read again.
pub const NOTE_CACHE_TTL: Duration = Duration::from_secs(2);
/// Notes cached at most; past it the cache starts afresh.
const NOTE_CACHE_ENTRIES: usize = 10_000;

/// The notes this host read or wrote lately. A note is a hint about a server
/// (the signature scheme it accepts), read several times by every delivery
/// to it: three database reads per ActivityPub delivery took about a third
/// of each attempt under load (BENCHMARKS.md). A note another host writes
/// is seen here within [`NOTE_CACHE_TTL`]; one this host writes, at once.
///
/// Claims are taken in the database (a compare-and-set, so of hosts racing
/// one wins), but a claim this host knows to be held (taken here, being
/// taken here, or seen held by another host until its end) is refused here
/// without a database round trip: in a fan-out every inbox of a new server
/// asked for the same knock claim, and each ask was a write transaction
/// queued on SQLite's one writer beside the dispatcher's commits (the slow
/// fediverse bench: 4,852 claim inserts for 1,000 servers).
#[derive(Default)]
pub struct NoteCache {
    entries: std::sync::Mutex<NoteEntries>,
    claims: std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>,
}

/// Each note by plugin, host and key: its value (or its absence) and when
/// it was read or written.
type NoteEntries = std::collections::HashMap<String, (Option<String>, std::time::Instant)>;

impl NoteCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, NoteEntries> {
        self.entries.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn fresh(&self, key: &str) -> Option<Option<String>> {
        self.lock()
            .get(key)
            .filter(|(_, at)| at.elapsed() < NOTE_CACHE_TTL)
            .map(|(value, _)| value.clone())
    }

    fn claims(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, std::time::Instant>> {
        self.claims.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Marks the claim `key` held here until `ttl` from now, unless it is
    /// known to be held already: `false` then.
    fn hold_claim(&self, key: &str, ttl: Duration) -> bool {
        let now = std::time::Instant::now();
        let mut claims = self.claims();
        if claims.get(key).is_some_and(|until| *until > now) {
            return false;
        }
        if claims.len() >= NOTE_CACHE_ENTRIES {
            claims.retain(|_, until| *until > now);
        }
        // Still full (a flood of claims on distinct hosts, each held up to
        // an hour): the database alone decides, and nothing more is kept.
        if claims.len() < NOTE_CACHE_ENTRIES {
            claims.insert(key.to_owned(), now + ttl);
        }
        true
    }

    /// The claim `key` is known held (here or elsewhere) until `until`, or
    /// not at all (`None`: the database could not say).
    fn claim_held_until(&self, key: &str, until: Option<std::time::Instant>) {
        let mut claims = self.claims();
        match until {
            Some(until) if claims.len() < NOTE_CACHE_ENTRIES || claims.contains_key(key) => {
                claims.insert(key.to_owned(), until);
            }
            Some(_) => {}
            None => {
                claims.remove(key);
            }
        }
    }

    fn remember(&self, key: String, value: Option<String>) {
        let mut entries = self.lock();
        if entries.len() >= NOTE_CACHE_ENTRIES && !entries.contains_key(&key) {
            entries.clear();
        }
        entries.insert(key, (value, std::time::Instant::now()));
    }
}

/// The records namespace of a plugin's notes.
pub fn note_namespace(plugin: &str) -> String {
    format!("note:{plugin}")
}

impl QueueNotes {
    /// Notes in `queue`, read through `cache` (one per host).
    pub fn new(queue: Arc<dyn Queue>, cache: Arc<NoteCache>) -> Self {
        Self { queue, cache }
    }

    /// The claim taken in the database, or how long another holds it (a
    /// lost race: the cache's TTL, as a hint).
    async fn claim_in_database(
        &self,
        plugin: &str,
        host: &str,
        key: &str,
        ttl: Duration,
    ) -> Result<Result<(), Duration>, QueueError> {
        // The record holds when the claim ends (Unix ms); taking it is a
        // compare-and-set on its version, so of hosts racing one wins.
        let namespace = format!("claim:{plugin}");
        let key = Self::key(host, key);
        let now = chrono::Utc::now().timestamp_millis();
        let until = now.saturating_add(i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX));
        let expect = match self.queue.record(&namespace, &key).await? {
            None => crate::queue::Expect::Absent,
            Some(held) => match held.value.parse::<i64>() {
                Ok(end) if end > now => {
                    let left = u64::try_from(end - now).unwrap_or(0);
                    return Ok(Err(Duration::from_millis(left).min(ttl.max(NOTE_CACHE_TTL))));
                }
                _ => crate::queue::Expect::Version(held.version),
            },
        };
        let applied = self
            .queue
            .put_record(&namespace, &key, &until.to_string(), expect)
            .await?
            .applied();
        Ok(if applied { Ok(()) } else { Err(NOTE_CACHE_TTL) })
    }

    fn cached(plugin: &str, host: &str, key: &str) -> String {
        format!("{plugin}\u{1f}{host}\u{1f}{key}")
    }

    fn key(host: &str, key: &str) -> String {
        // A unit separator cannot occur in a host name.
        format!("{host}\u{1f}{key}")
    }
}

#[async_trait]
impl Notes for QueueNotes {
    async fn get(&self, plugin: &str, host: &str, key: &str) -> Result<Option<String>, QueueError> {
        let cached = Self::cached(plugin, host, key);
        if let Some(value) = self.cache.fresh(&cached) {
            return Ok(value);
        }
        let value = self
            .queue
            .record(&note_namespace(plugin), &Self::key(host, key))
            .await?
            .map(|r| r.value);
        self.cache.remember(cached, value.clone());
        Ok(value)
    }

    async fn set(&self, plugin: &str, host: &str, key: &str, value: &str) -> Result<(), QueueError> {
        self.queue
            .put_record(
                &note_namespace(plugin),
                &Self::key(host, key),
                value,
                crate::queue::Expect::Any,
            )
            .await?;
        self.cache
            .remember(Self::cached(plugin, host, key), Some(value.to_owned()));
        Ok(())
    }

    async fn claim(&self, plugin: &str, host: &str, key: &str, ttl: Duration) -> Result<bool, QueueError> {
        // The record holds when the claim ends (Unix ms); taking it is a
        // compare-and-set on its version, so of hosts racing one wins.
        let local = format!("claim\u{1f}{}", Self::cached(plugin, host, key));
        if !self.cache.hold_claim(&local, ttl) {
            return Ok(false);
        }
        let taken = self.claim_in_database(plugin, host, key, ttl).await;
        match &taken {
            Ok(Ok(())) => {}
            Ok(Err(held_for)) => self
                .cache
                .claim_held_until(&local, Some(std::time::Instant::now() + *held_for)),
            Err(_) => self.cache.claim_held_until(&local, None),
        }
        Ok(taken?.is_ok())
    }
}

/// What the host hands one attempt besides the op itself.
#[derive(Clone)]
pub struct Attempt {
    /// Where the executor persists a receipt before its side effect.
    pub checkpoint: Arc<dyn Checkpoint>,
    /// The fee the host quoted for this attempt, for kinds with a fee oracle.
    pub fee: Option<FeeBid>,
    /// The fee the attempt actually paid, when the executor reports one
    /// (a resubmitted envelope carries the fee it was built with).
    pub spent: Arc<SpentFee>,
    /// Where the plugin's per-destination notes are kept; without one,
    /// notes are neither read nor kept.
    pub notes: Option<Arc<dyn Notes>>,
}

impl Attempt {
    /// An attempt with a fresh fee report and no notes.
    pub fn new(checkpoint: Arc<dyn Checkpoint>, fee: Option<FeeBid>) -> Self {
        Self {
            checkpoint,
            fee,
            spent: Arc::new(SpentFee::default()),
            notes: None,
        }
    }

    /// The same attempt, keeping notes in `notes`.
    #[must_use]
    pub fn with_notes(self, notes: Arc<dyn Notes>) -> Self {
        Self {
            notes: Some(notes),
            ..self
        }
    }

    /// The fee to record for the attempt: what the executor says it paid,
    /// else the quote.
    pub fn recorded_fee(&self) -> Option<u64> {
        self.spent.get().or(self.fee.map(|b| b.base_fee))
    }
}

/// The inclusion fee an attempt actually paid, reported by its executor; the
/// last report wins.
#[derive(Debug)]
pub struct SpentFee(std::sync::atomic::AtomicU64);

impl Default for SpentFee {
    fn default() -> Self {
        Self(std::sync::atomic::AtomicU64::new(u64::MAX))
    }
}

impl SpentFee {
    /// Records what was paid.
    pub fn report(&self, base_fee: u64) {
        self.0
            .store(base_fee.min(u64::MAX - 1), std::sync::atomic::Ordering::Release);
    }

    /// What was reported, if anything.
    pub fn get(&self) -> Option<u64> {
        let v = self.0.load(std::sync::atomic::Ordering::Acquire);
        (v != u64::MAX).then_some(v)
    }
}

impl std::fmt::Debug for Attempt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attempt")
            .field("fee", &self.fee)
            .finish_non_exhaustive()
    }
}

/// Delivers ops of one or more kinds.
#[async_trait]
pub trait Executor: Send + Sync {
    /// Performs the op's side effect once.
    async fn execute(&self, op: &Op, attempt: Attempt) -> Outcome;

    /// Called instead of a blind redelivery when the op carries a receipt
    /// checkpointed by an earlier attempt that never reported (crash,
    /// timeout): look the side effect up. The default has nothing to look up.
    async fn reconcile(&self, _op: &Op, _receipt: &str, _attempt: Attempt) -> Reconciled {
        Reconciled::Redeliver
    }

    /// The lanes an op will be ordered in, asked at enqueue when the producer
    /// named none (inbox URLs, a signer account). Empty means no opinion.
    ///
    /// # Errors
    ///
    /// The executor's refusal of the op, as text.
    async fn lanes(&self, _kind: &str, _outbox: &str, _payload: &str) -> Result<Vec<String>, String> {
        Ok(Vec::new())
    }

    /// Whether the executor can take work now; a quarantined plugin version
    /// cannot, and its ops wait (without using attempts) for a new version.
    fn available(&self) -> bool {
        true
    }

    /// The channel-account pool the kind's ops are dealt from, if any.
    fn pool(&self) -> Option<Arc<crate::pool::Pool>> {
        None
    }
}

/// Executors by kind.
pub type Executors = HashMap<String, Arc<dyn Executor>>;

/// The live registry; replaced whole on reload.
#[derive(Default)]
pub struct Registry {
    current: ArcSwap<Executors>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kinds: Vec<String> = self.current.load().keys().cloned().collect();
        f.debug_struct("Registry").field("kinds", &kinds).finish()
    }
}

impl Registry {
    /// A registry serving `executors`.
    pub fn new(executors: Executors) -> Self {
        Self {
            current: ArcSwap::from_pointee(executors),
        }
    }

    /// The executor for `kind` right now.
    pub fn get(&self, kind: &str) -> Option<Arc<dyn Executor>> {
        self.current.load().get(kind).cloned()
    }

    /// The lanes `kind`'s executor names for an op; empty when the kind has
    /// no executor or the executor has no opinion.
    ///
    /// # Errors
    ///
    /// The executor's refusal of the op, as text.
    pub async fn lanes_for(&self, kind: &str, outbox: &str, payload: &str) -> Result<Vec<String>, String> {
        match self.get(kind) {
            Some(executor) => executor.lanes(kind, outbox, payload).await,
            None => Ok(Vec::new()),
        }
    }

    /// The channel-account pool of a kind, if it has one.
    pub fn pool_of(&self, kind: &str) -> Option<Arc<crate::pool::Pool>> {
        self.get(kind).and_then(|e| e.pool())
    }

    /// Replaces every executor at once.
    pub fn replace(&self, executors: Executors) {
        self.current.store(Arc::new(executors));
    }
}

/// A [`Checkpoint`] that writes under one lease, and remembers whether it did.
pub struct LeaseCheckpoint {
    queue: Arc<dyn Queue>,
    lease: Lease,
    saved: std::sync::atomic::AtomicBool,
}

impl LeaseCheckpoint {
    /// Checkpoints for the op held under `lease`.
    pub fn new(queue: Arc<dyn Queue>, lease: Lease) -> Self {
        Self {
            queue,
            lease,
            saved: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whether a receipt was stored through it.
    pub fn saved(&self) -> bool {
        self.saved.load(std::sync::atomic::Ordering::Acquire)
    }
}

#[async_trait]
impl Checkpoint for LeaseCheckpoint {
    async fn checkpoint(&self, receipt: &str) -> Result<(), CheckpointError> {
        match self.queue.checkpoint(&self.lease, receipt).await? {
            Cas::Applied => {
                self.saved.store(true, std::sync::atomic::Ordering::Release);
                Ok(())
            }
            Cas::Stale => Err(CheckpointError::LeaseLost),
        }
    }
}
