//! What every host knows about destinations, stored as shared records (see
//! `Queue::records`): each destination host's [`Health`], and each inbox
//! known to be a shared inbox or to be gone (a personal inbox that answered
//! 410, which later fan-outs skip and report).
//!
//! Every write is a compare-and-set on the record's version, retried on a
//! conflict, so two hosts settling attempts to one destination at once both
//! count. The rules are in `health`; this module only reads and stores.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::events::{DestinationChanged, Metrics};
use crate::health::{Event, Health, HealthConfig, HealthState};
use crate::queue::{update_record, Change, Expect, Queue, QueueError};

/// The records namespace of destination hosts' health.
pub const HEALTH: &str = "destination";
/// The records namespace of inboxes (shared, or gone).
pub const INBOXES: &str = "inbox";

/// How often a conflicting write is tried again before giving up.
const CAS_TRIES: usize = 8;

/// What is known about one inbox.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InboxNote {
    /// A fan-out used it as some recipients' shared inbox.
    #[serde(default)]
    pub shared: bool,
    /// When it answered 410 Gone (a personal inbox; a shared one suspends
    /// its host instead).
    #[serde(default)]
    pub gone_at: Option<DateTime<Utc>>,
}

/// One destination host as operators see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct DestinationView {
    /// The host (`host[:port]`).
    pub host: String,
    /// `available`, `unavailable` or `suspended`.
    pub state: String,
    /// Failed attempts since the last answer.
    pub failures: u64,
    /// The first failure since the last answer.
    pub first_failure_at: Option<DateTime<Utc>>,
    /// The latest failure.
    pub last_failure_at: Option<DateTime<Utc>>,
    /// Why the latest failure failed.
    pub last_error: Option<String>,
    /// When it was held.
    pub since: Option<DateTime<Utc>>,
    /// Why it is held.
    pub reason: Option<String>,
    /// When an unavailable host's next probe may go.
    pub next_probe_at: Option<DateTime<Utc>>,
}

impl DestinationView {
    fn new(host: String, h: Health) -> Self {
        Self {
            host,
            state: h.state.as_str().to_owned(),
            failures: h.failures,
            first_failure_at: h.first_failure_at,
            last_failure_at: h.last_failure_at,
            last_error: h.last_error,
            since: h.since,
            reason: h.reason,
            next_probe_at: h.next_probe_at,
        }
    }
}

/// Every destination host with a health record (failing or held).
///
/// # Errors
///
/// A queue error; a record that does not parse is reported as
/// [`QueueError::BadRecord`].
pub async fn list(queue: &dyn Queue) -> Result<Vec<(String, Health, i64)>, QueueError> {
    queue
        .records(HEALTH, None)
        .await?
        .into_iter()
        .map(|r| Ok((r.key.clone(), parse_health(&r.key, &r.value)?, r.version)))
        .collect()
}

/// Operators' view of every destination host with a health record.
///
/// # Errors
///
/// As [`list`].
pub async fn views(queue: &dyn Queue) -> Result<Vec<DestinationView>, QueueError> {
    Ok(list(queue)
        .await?
        .into_iter()
        .map(|(host, h, _)| DestinationView::new(host, h))
        .collect())
}

/// One host's view, if it has a record.
///
/// # Errors
///
/// As [`list`].
pub async fn view(queue: &dyn Queue, host: &str) -> Result<Option<DestinationView>, QueueError> {
    Ok(read(queue, host)
        .await?
        .map(|(h, _)| DestinationView::new(host.to_owned(), h)))
}

fn parse_health(host: &str, value: &str) -> Result<Health, QueueError> {
    serde_json::from_str(value).map_err(|e| QueueError::BadRecord {
        namespace: HEALTH,
        key: host.to_owned(),
        why: e.to_string(),
    })
}

async fn read(queue: &dyn Queue, host: &str) -> Result<Option<(Health, i64)>, QueueError> {
    match queue.record(HEALTH, host).await? {
        Some(r) => Ok(Some((parse_health(host, &r.value)?, r.version))),
        None => Ok(None),
    }
}

/// Applies `event` to a host's health and stores the result (deleting the
/// record once nothing is held against the host). Returns the health
/// before and after; emits a [`DestinationChanged`] when the state changed.
///
/// # Errors
///
/// A queue error, or [`QueueError::RecordContended`] after [`CAS_TRIES`] lost races.
pub async fn apply(
    queue: &dyn Queue,
    metrics: &Metrics,
    host: &str,
    events: &[Event<'_>],
    by: &str,
    now: DateTime<Utc>,
    config: &HealthConfig,
) -> Result<(Health, Health), QueueError> {
    let changed = update_record(queue, HEALTH, host, CAS_TRIES, |stored| {
        let before = match stored {
            Some(r) => parse_health(host, &r.value)?,
            None => Health::default(),
        };
        let after = events.iter().fold(before.clone(), |h, e| h.after(*e, now, config));
        let change = if after == before {
            Change::Keep
        } else if after.is_clear() {
            Change::Delete
        } else {
            Change::Put(serde_json::to_string(&after).map_err(|e| QueueError::InvalidOp(e.to_string()))?)
        };
        Ok((change, (before, after)))
    })
    .await?;
    let Some((before, after)) = changed else {
        return Err(QueueError::RecordContended(format!(
            "destination {host:?}: the health record kept changing under {CAS_TRIES} writes"
        )));
    };
    if after.state != before.state {
        DestinationChanged::Health {
            host,
            to: after.state,
            reason: after.reason.as_deref(),
            by,
        }
        .emit(metrics);
    }
    Ok((before, after))
}

/// Makes a host available again, whatever held it, and forgets its
/// inboxes' 410s: an operator's resume. Returns the health before and
/// after, and the inboxes forgotten.
///
/// # Errors
///
/// As [`apply`].
pub async fn resume(
    queue: &dyn Queue,
    metrics: &Metrics,
    host: &str,
    by: &str,
    now: DateTime<Utc>,
    config: &HealthConfig,
) -> Result<(Health, Health, Vec<String>), QueueError> {
    let mut forgotten = Vec::new();
    for (inbox, _) in gone_inboxes(queue).await? {
        if crate::breaker::destination(&inbox) == Some(host) {
            update_inbox(queue, &inbox, |n| n.gone_at = None).await?;
            forgotten.push(inbox);
        }
    }
    let (before, after) = apply(queue, metrics, host, &[Event::Resume], by, now, config).await?;
    Ok((before, after, forgotten))
}

/// Takes an unavailable host's due probe; `true` if this caller won it (of
/// every host that tries, one does).
///
/// # Errors
///
/// A queue error.
pub async fn take_probe(
    queue: &dyn Queue,
    host: &str,
    now: DateTime<Utc>,
    config: &HealthConfig,
) -> Result<bool, QueueError> {
    let Some((health, version)) = read(queue, host).await? else {
        // Cleared meanwhile: the op goes as an ordinary one.
        return Ok(true);
    };
    let Some(next) = health.take_probe(now, config) else {
        return Ok(!health.held());
    };
    let value = serde_json::to_string(&next).map_err(|e| QueueError::InvalidOp(e.to_string()))?;
    Ok(queue
        .put_record(HEALTH, host, &value, Expect::Version(version))
        .await?
        .applied())
}

/// The health records a drain consults, read at most once a second per
/// host process.
#[derive(Debug, Clone, Default)]
pub struct HealthView {
    hosts: HashMap<String, Health>,
}

impl HealthView {
    /// A view of the stored records.
    ///
    /// # Errors
    ///
    /// As [`list`].
    pub async fn load(queue: &dyn Queue) -> Result<Self, QueueError> {
        Ok(Self {
            hosts: list(queue)
                .await?
                .into_iter()
                .map(|(h, health, _)| (h, health))
                .collect(),
        })
    }

    /// A host's health, if it has a record.
    pub fn get(&self, host: &str) -> Option<&Health> {
        self.hosts.get(host)
    }

    /// Replaces a host's health in this view (after this host wrote it).
    pub fn set(&mut self, host: &str, health: Health) {
        if health.is_clear() {
            self.hosts.remove(host);
        } else {
            self.hosts.insert(host.to_owned(), health);
        }
    }

    /// `(unavailable, suspended)` counts.
    pub fn held_counts(&self) -> (i64, i64) {
        let count =
            |s: HealthState| i64::try_from(self.hosts.values().filter(|h| h.state == s).count()).unwrap_or(i64::MAX);
        (count(HealthState::Unavailable), count(HealthState::Suspended))
    }
}

/// Whether a stored health record holds its host suspended (an
/// operator's decision, never forgotten by age).
pub fn is_suspended(host: &str, value: &str) -> bool {
    parse_health(host, value).is_ok_and(|h| h.state == HealthState::Suspended)
}

/// Marks inboxes as shared inboxes (a fan-out delivers to them for several
/// recipients), so a 410 from one suspends its host.
///
/// # Errors
///
/// A queue error.
pub async fn note_shared(queue: &dyn Queue, inboxes: &[String]) -> Result<(), QueueError> {
    if inboxes.is_empty() {
        return Ok(());
    }
    let known: HashSet<String> = queue
        .records(INBOXES, Some(inboxes))
        .await?
        .into_iter()
        .filter(|r| serde_json::from_str::<InboxNote>(&r.value).is_ok_and(|n| n.shared))
        .map(|r| r.key)
        .collect();
    for inbox in inboxes.iter().filter(|i| !known.contains(*i)) {
        update_inbox(queue, inbox, |n| n.shared = true).await?;
    }
    Ok(())
}

/// Which of `inboxes` are remembered as gone.
///
/// # Errors
///
/// A queue error.
pub async fn gone(queue: &dyn Queue, inboxes: &[String]) -> Result<HashSet<String>, QueueError> {
    Ok(queue
        .records(INBOXES, Some(inboxes))
        .await?
        .into_iter()
        .filter(|r| serde_json::from_str::<InboxNote>(&r.value).is_ok_and(|n| n.gone_at.is_some()))
        .map(|r| r.key)
        .collect())
}

/// Every inbox remembered as gone, with when.
///
/// # Errors
///
/// A queue error.
pub async fn gone_inboxes(queue: &dyn Queue) -> Result<Vec<(String, DateTime<Utc>)>, QueueError> {
    Ok(queue
        .records(INBOXES, None)
        .await?
        .into_iter()
        .filter_map(|r| {
            let note = serde_json::from_str::<InboxNote>(&r.value).ok()?;
            Some((r.key, note.gone_at?))
        })
        .collect())
}

/// A 410 Gone from `inbox` (of destination `host`): a shared inbox
/// suspends the host, a personal one is remembered as gone. Returns the
/// host's new health when it changed.
///
/// # Errors
///
/// A queue error.
pub async fn inbox_gone(
    queue: &dyn Queue,
    metrics: &Metrics,
    host: &str,
    inbox: &str,
    now: DateTime<Utc>,
    config: &HealthConfig,
) -> Result<Option<Health>, QueueError> {
    let note = queue
        .record(INBOXES, inbox)
        .await?
        .and_then(|r| serde_json::from_str::<InboxNote>(&r.value).ok())
        .unwrap_or_default();
    if note.shared {
        let (before, after) = apply(
            queue,
            metrics,
            host,
            &[Event::SharedInboxGone { inbox }],
            "delivery",
            now,
            config,
        )
        .await?;
        return Ok((before != after).then_some(after));
    }
    if note.gone_at.is_none() {
        update_inbox(queue, inbox, |n| n.gone_at = Some(now)).await?;
        DestinationChanged::InboxGone { inbox }.emit(metrics);
    }
    Ok(None)
}

async fn update_inbox(queue: &dyn Queue, inbox: &str, change: impl Fn(&mut InboxNote)) -> Result<(), QueueError> {
    let written = update_record(queue, INBOXES, inbox, CAS_TRIES, |stored| {
        let mut note = stored
            .and_then(|r| serde_json::from_str::<InboxNote>(&r.value).ok())
            .unwrap_or_default();
        change(&mut note);
        let value = serde_json::to_string(&note).map_err(|e| QueueError::InvalidOp(e.to_string()))?;
        Ok((Change::Put(value), ()))
    })
    .await?;
    written.ok_or_else(|| QueueError::RecordContended(format!("inbox {inbox:?}: the record kept changing")))
}

/// A fan-out ready to enqueue: its ops, and the recipients' inboxes left
/// out because they are remembered as gone.
#[derive(Debug, Clone)]
pub struct PlannedFanOut {
    /// One op per delivery inbox, gone ones left out.
    pub ops: Vec<crate::queue::NewOp>,
    /// Delivery inboxes skipped: each answered 410 Gone before.
    pub gone: Vec<String>,
}

/// Why a fan-out was not planned.
#[derive(Debug, thiserror::Error)]
pub enum FanOutFailure {
    /// The activity or its recipients are malformed (the pure plan refused
    /// them); nothing was written.
    #[error(transparent)]
    Activity(#[from] crate::fanout::FanOutError),
    /// The kind is laneway's own (outcome webhooks, verified inbound
    /// activities): producers cannot enqueue it; nothing was written.
    #[error("{0}")]
    InternalKind(String),
    /// No such kind is configured; nothing was written.
    #[error("{0}")]
    UnknownKind(String),
    /// An op past the queue's limits; nothing was written.
    #[error("{0}")]
    Refused(String),
    /// The queue failed.
    #[error(transparent)]
    Queue(#[from] QueueError),
}

/// Plans a fan-out as every producer path does (the CLI, the API, the Rust
/// API): the pure plan, each op checked against the queue's limits, gone
/// inboxes left out and reported, shared inboxes marked as such (so their
/// 410 suspends their host), and the coalescing an Undo takes back
/// released. The caller enqueues the ops.
///
/// # Errors
///
/// [`FanOutFailure`].
pub async fn plan_fan_out(
    queue: &dyn Queue,
    config: &crate::config::Config,
    request: &crate::fanout::FanOut,
) -> Result<PlannedFanOut, FanOutFailure> {
    config
        .refuse_internal_kind(&request.kind)
        .map_err(FanOutFailure::InternalKind)?;
    let kind = config.kind(&request.kind).map_err(FanOutFailure::UnknownKind)?;
    let ops = crate::fanout::plan(request, &kind.correlate_types(), kind.priority)?;
    crate::queue::validate_new_ops(&ops, config.limits()).map_err(|e| FanOutFailure::Refused(e.to_string()))?;
    let inboxes: Vec<String> = ops.iter().filter_map(|op| op.lanes.first().cloned()).collect();
    let gone = gone(queue, &inboxes).await?;
    let (ops, skipped): (Vec<_>, Vec<_>) = ops
        .into_iter()
        .partition(|op| op.lanes.first().is_none_or(|inbox| !gone.contains(inbox)));
    let shared: Vec<String> = request
        .recipients
        .iter()
        .filter_map(|r| r.shared_inbox.as_deref().filter(|s| !s.is_empty()))
        .filter_map(|s| crate::fanout::canonical_inbox(s).ok())
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    note_shared(queue, &shared).await?;
    queue
        .release_coalesce(&request.actor, &crate::fanout::undone_announces(request, &ops))
        .await?;
    Ok(PlannedFanOut {
        ops,
        gone: skipped
            .into_iter()
            .filter_map(|op| op.lanes.into_iter().next())
            .collect(),
    })
}
