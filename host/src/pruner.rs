//! The pruner: deletes terminal ops past their retention, in small batches,
//! on one host at a time (a lease in `singletons`). Per pass (from
//! [`crate::retention::passes`]) and batch it archives the ops of archived
//! kinds, commits their idempotency tombstones, then deletes the ops with
//! their attempts, lanes and outcome rows; then it drops expired
//! tombstones; last it forgets what laneway keeps per remote host (health,
//! inboxes, rate buckets, plugin notes) that nothing has written for long,
//! so a flood of distinct hosts cannot grow those records without bound.
//!
//! Crash windows, in order: after the archive line (the op is archived
//! again next time: a repeated line); after the tombstones (the op is
//! still there and its key answers from it: no change); after the delete
//! (done). No window loses an op that was not archived, or a key that
//! should still answer.

use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::config::Config;
use crate::queue::{Backend, Queue, QueueError};
use crate::retention;

/// Why a pruning run stopped.
#[derive(Debug, thiserror::Error)]
pub enum PruneError {
    /// The database failed.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// The archive could not be written; the ops were not deleted.
    #[error(transparent)]
    Archive(#[from] crate::archive::ArchiveError),
}

// What one pass did; an event type, so the events do not depend on the
// pruner.
pub use crate::events::PruneReport;

/// The lease name one-host-at-a-time pruning holds.
const SINGLETON: &str = "pruner";

/// Runs the retention policy against a queue.
pub struct Pruner {
    queue: Arc<dyn Queue>,
    clock: Arc<dyn Clock>,
}

impl Pruner {
    /// A pruner over `queue`.
    pub fn new(queue: Arc<dyn Queue>, clock: Arc<dyn Clock>) -> Self {
        Self { queue, clock }
    }

    /// One run of every pass, as `owner`, if this host holds the pruning
    /// lease (`None` when another host does).
    ///
    /// # Errors
    ///
    /// [`PruneError`]; what was deleted before it stays deleted.
    pub async fn run_once(&self, config: &Config, owner: &str) -> Result<Option<PruneReport>, PruneError> {
        let every = Duration::from_millis(config.retention.every_ms);
        if !self.queue.hold_singleton(SINGLETON, owner, every * 3).await? {
            return Ok(None);
        }
        let batch = config.retention.batch;
        let mut report = PruneReport::default();
        let relayed = self.queue.feed_cursor(crate::webhook::RELAY).await?;
        for pass in retention::passes(config, self.clock.now(), batch, relayed) {
            loop {
                let ops = self.queue.prunable(&pass.query).await?;
                if ops.is_empty() {
                    break;
                }
                let now = self.clock.now();
                if let Some(dir) = &pass.archive {
                    let mut records = Vec::with_capacity(ops.len());
                    for op in &ops {
                        records.push((op.clone(), self.queue.attempts(op.id).await?));
                    }
                    crate::archive::append(dir, &records, now)?;
                    report.archived += records.len() as u64;
                }
                let tombstones: Vec<_> = ops
                    .iter()
                    .filter_map(|op| retention::tombstone(op, pass.tombstones, now))
                    .collect();
                if !tombstones.is_empty() {
                    self.queue.put_tombstones(&tombstones).await?;
                    report.tombstones += tombstones.len() as u64;
                    if self.queue.backend() == Backend::Postgres {
                        // Let statements that began before the tombstones
                        // committed finish before their ops go (see the
                        // retention migration).
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
                crate::failpoint::hit(crate::failpoint::PRUNING, SINGLETON).await;
                let ids: Vec<_> = ops.iter().map(|o| o.id).collect();
                let deleted = self.queue.delete_terminal(&ids, pass.query.status).await?;
                report.deleted += deleted.len() as u64;
                if ops.len() < batch as usize || deleted.is_empty() {
                    break;
                }
            }
        }
        loop {
            let expired = self.queue.expire_tombstones(self.clock.now(), batch).await?;
            report.expired += expired;
            if expired < u64::from(batch) {
                break;
            }
        }
        report.forgotten = self.forget_remote_state(config).await?;
        Ok(Some(report))
    }

    /// Deletes per-remote-host records nothing has written within their
    /// age: destination health and inbox notes after
    /// `destinations.forget_after_ms` (a host an operator suspended is kept
    /// until resumed), plugin notes the same, and a rate bucket once it
    /// would have refilled (deleting a full bucket changes nothing). Each
    /// delete is a compare-and-set on the version read, so a record written
    /// meanwhile stays.
    async fn forget_remote_state(&self, config: &Config) -> Result<u64, QueueError> {
        use crate::destinations::{HEALTH, INBOXES};
        let now = self.clock.now();
        let forget_after = crate::clock::chrono_duration(Duration::from_millis(config.destinations.forget_after_ms));
        let d = &config.destinations;
        let refill = if d.rate_per_second > 0.0 {
            Duration::from_secs_f64((f64::from(d.rate_burst) / d.rate_per_second).min(86_400.0))
        } else {
            Duration::ZERO
        };
        let mut namespaces: Vec<(String, chrono::Duration)> = vec![
            (HEALTH.to_owned(), forget_after),
            (INBOXES.to_owned(), forget_after),
            (
                crate::ratelimit::BUCKETS.to_owned(),
                crate::clock::chrono_duration(refill + Duration::from_secs(60)),
            ),
        ];
        namespaces.extend(
            config
                .plugins
                .keys()
                .map(|p| (crate::executor::note_namespace(p), forget_after)),
        );
        let mut forgotten = 0;
        for (namespace, age) in namespaces {
            for record in self.queue.records(&namespace, None).await? {
                if now - record.updated_at < age {
                    continue;
                }
                if namespace == HEALTH && crate::destinations::is_suspended(&record.key, &record.value) {
                    continue;
                }
                if self
                    .queue
                    .delete_record(&namespace, &record.key, crate::queue::Expect::Version(record.version))
                    .await?
                    .applied()
                {
                    forgotten += 1;
                }
            }
        }
        Ok(forgotten)
    }
}
