//! Typed internal events: each is one thing that happened in the dispatcher,
//! and its `emit` writes both its log line and its metrics, so the two cannot
//! drift (Vector's internal events). Also the metrics registry itself, whose
//! counters the events move and whose gauges `/metrics` sets from the
//! database at scrape time.
//!
//! Names and labels follow seed 003's metrics list (`outbox_ops_total{kind,
//! priority,outcome}`, `outbox_op_latency_seconds{kind}`, …).

use std::fmt::Write as _;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tracing::{debug, error, info, warn};

use crate::op::{OpId, Priority};

/// `outcome` of `outbox_ops_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum OutcomeLabel {
    /// Confirmed.
    confirmed,
    /// Retried later.
    retry,
    /// Dead-lettered.
    failed,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OpLabels {
    kind: String,
    priority: String,
    outcome: OutcomeLabel,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PriorityLabels {
    priority: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DeadLetterLabels {
    kind: String,
    reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DepthLabels {
    status: String,
    priority: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OracleLabels {
    oracle: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ScopeLabels {
    scope: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct DueLabels {
    kind: String,
    outbox: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CallLabels {
    plugin: String,
    kind: String,
    class: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PluginLabels {
    plugin: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResultLabels {
    outcome: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BoundLabels {
    bound: String,
}

/// Seconds a plugin call takes: from a no-op's microseconds to a chain
/// submission that waits for its ledger.
const CALL_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0,
];

/// Seconds from creation to confirmation: from a few milliseconds (a local
/// inbox) to hours (a receiver down for a while).
const LATENCY_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Every metric laneway exports.
pub struct Metrics {
    registry: Registry,
    ops: Family<OpLabels, Counter>,
    latency: Family<KindLabels, Histogram>,
    fee_bumps: Family<KindLabels, Counter>,
    dead_letters: Family<DeadLetterLabels, Counter>,
    low_deferred: Counter,
    aggressive_fee_used: Counter,
    max_fee_hit: Family<PriorityLabels, Counter>,
    leases_lost: Counter,
    queue_depth: Family<DepthLabels, Gauge>,
    stuck_submitted: Gauge,
    lanes_held: Gauge,
    subjects_halted: Gauge,
    paused: Family<ScopeLabels, Gauge>,
    breakers_open: Gauge,
    permits_in_use: Gauge,
    slow_attempts: Gauge,
    oldest_due: Family<DueLabels, Gauge<f64, AtomicU64>>,
    plugin_calls: Family<CallLabels, Counter>,
    plugin_duration: Family<PluginLabels, Histogram>,
    plugin_reloads: Family<ResultLabels, Counter>,
    plugin_quarantined: Family<PluginLabels, Gauge>,
    oracle_polls: Family<ResultLabels, Counter>,
    pruned: Family<ResultLabels, Counter>,
    oracle_clamps: Family<BoundLabels, Counter>,
    oracle_recommended: Family<OracleLabels, Gauge>,
    oracle_aggressive: Family<OracleLabels, Gauge>,
    oracle_capacity: Family<OracleLabels, Gauge<f64, AtomicU64>>,
    oracle_congestion: Family<OracleLabels, Gauge>,
    oracle_staleness: Family<OracleLabels, Gauge<f64, AtomicU64>>,
    destination_changes: Family<StateLabels, Counter>,
    destinations_held: Family<StateLabels, Gauge>,
    inboxes_gone: Counter,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StateLabels {
    state: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric registered (at zero).
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let ops = Family::<OpLabels, Counter>::default();
        registry.register(
            "outbox_ops",
            "Attempts settled, by outcome (confirmed, retry, failed)",
            ops.clone(),
        );
        let latency =
            Family::<KindLabels, Histogram>::new_with_constructor(|| Histogram::new(LATENCY_BUCKETS.iter().copied()));
        registry.register(
            "outbox_op_latency_seconds",
            "From an op's creation to its confirmation",
            latency.clone(),
        );
        let fee_bumps = Family::<KindLabels, Counter>::default();
        registry.register(
            "outbox_fee_bump",
            "Retries that resubmit with a bumped fee",
            fee_bumps.clone(),
        );
        let dead_letters = Family::<DeadLetterLabels, Counter>::default();
        registry.register(
            "outbox_dead_letters",
            "Ops dead-lettered, by kind and the last attempt's class",
            dead_letters.clone(),
        );
        let low_deferred = Counter::default();
        registry.register(
            "outbox_low_deferred",
            "LOW ops deferred by the fee policy (congestion)",
            low_deferred.clone(),
        );
        let aggressive_fee_used = Counter::default();
        registry.register(
            "outbox_aggressive_fee_used",
            "CRITICAL ops priced at the aggressive fee",
            aggressive_fee_used.clone(),
        );
        let max_fee_hit = Family::<PriorityLabels, Counter>::default();
        registry.register(
            "outbox_max_fee_hit",
            "Attempts whose fee reached the absolute cap",
            max_fee_hit.clone(),
        );
        let leases_lost = Counter::default();
        registry.register(
            "outbox_leases_lost",
            "Outcomes not recorded because the lease had been taken over",
            leases_lost.clone(),
        );
        let queue_depth = Family::<DepthLabels, Gauge>::default();
        registry.register("outbox_queue_depth", "Ops by status and priority", queue_depth.clone());
        let stuck_submitted = Gauge::default();
        registry.register(
            "outbox_stuck_submitted",
            "Ops submitted whose lease expired unsettled (lost in flight until recovered; counted up to 1000)",
            stuck_submitted.clone(),
        );
        let lanes_held = Gauge::default();
        registry.register(
            "outbox_lanes_held",
            "Strict lanes held by a dead letter",
            lanes_held.clone(),
        );
        let subjects_halted = Gauge::default();
        registry.register("outbox_subjects_halted", "Subjects halted", subjects_halted.clone());
        let paused = Family::<ScopeLabels, Gauge>::default();
        registry.register(
            "outbox_paused_targets",
            "Paused kinds, outboxes and destinations",
            paused.clone(),
        );
        let breakers_open = Gauge::default();
        registry.register(
            "outbox_breakers_open",
            "Destinations whose breaker holds their ops (this host)",
            breakers_open.clone(),
        );
        let permits_in_use = Gauge::default();
        registry.register(
            "outbox_permits_in_use",
            "Host permits (dispatch.max_in_flight) held by ops being claimed or executed (this host)",
            permits_in_use.clone(),
        );
        let slow_attempts = Gauge::default();
        registry.register(
            "outbox_slow_attempts",
            "Attempts waiting past their kind's slow_after_ms outside the permits (dispatch.max_slow; this host)",
            slow_attempts.clone(),
        );
        let oldest_due = Family::<DueLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "outbox_oldest_due_age_seconds",
            "How long the oldest due pending op has waited past its due time, by kind and outbox",
            oldest_due.clone(),
        );
        let plugin_calls = Family::<CallLabels, Counter>::default();
        registry.register(
            "plugin_calls",
            "Executor calls by plugin, kind and outcome class (confirmed, retryable, permanent, or the fault: timeout, crashed, resource_limit, denied, no_executor)",
            plugin_calls.clone(),
        );
        let plugin_duration =
            Family::<PluginLabels, Histogram>::new_with_constructor(|| Histogram::new(CALL_BUCKETS.iter().copied()));
        registry.register(
            "plugin_call_duration_seconds",
            "How long an executor call took",
            plugin_duration.clone(),
        );
        let plugin_reloads = Family::<ResultLabels, Counter>::default();
        registry.register(
            "plugin_reloads",
            "Configuration and plugin reloads, by outcome (loaded, refused)",
            plugin_reloads.clone(),
        );
        let plugin_quarantined = Family::<PluginLabels, Gauge>::default();
        registry.register(
            "plugin_quarantined",
            "1 while a plugin is quarantined after repeated crashes",
            plugin_quarantined.clone(),
        );
        let oracle_polls = Family::<ResultLabels, Counter>::default();
        registry.register(
            "fee_oracle_polls",
            "Fee oracle polls, by outcome (stored, failed)",
            oracle_polls.clone(),
        );
        let pruned = Family::<ResultLabels, Counter>::default();
        registry.register(
            "retention_ops",
            "What the pruner did, by outcome (deleted, archived, tombstoned, tombstone_expired)",
            pruned.clone(),
        );
        let oracle_clamps = Family::<BoundLabels, Counter>::default();
        registry.register(
            "fee_oracle_clamp",
            "Samples whose fees a bound clamped (min, max)",
            oracle_clamps.clone(),
        );
        let oracle_recommended = Family::<OracleLabels, Gauge>::default();
        registry.register(
            "fee_oracle_recommended_base_fee",
            "Current recommended (p70) base fee, stroops",
            oracle_recommended.clone(),
        );
        let oracle_aggressive = Family::<OracleLabels, Gauge>::default();
        registry.register(
            "fee_oracle_aggressive_base_fee",
            "Current aggressive (p95) base fee, stroops",
            oracle_aggressive.clone(),
        );
        let oracle_capacity = Family::<OracleLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "fee_oracle_ledger_capacity_usage",
            "Ledger capacity usage, 0..1",
            oracle_capacity.clone(),
        );
        let oracle_congestion = Family::<OracleLabels, Gauge>::default();
        registry.register(
            "fee_oracle_congestion_level",
            "0 low, 1 elevated, 2 high, 3 severe",
            oracle_congestion.clone(),
        );
        let oracle_staleness = Family::<OracleLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "fee_oracle_staleness_seconds",
            "Seconds since the oracle's last good sample",
            oracle_staleness.clone(),
        );
        let destination_changes = Family::<StateLabels, Counter>::default();
        registry.register(
            "destination_health_changes",
            "Destination hosts entering a health state (available, unavailable, suspended)",
            destination_changes.clone(),
        );
        let destinations_held = Family::<StateLabels, Gauge>::default();
        registry.register(
            "destinations_held",
            "Destination hosts whose ops are held, by state (unavailable, suspended)",
            destinations_held.clone(),
        );
        let inboxes_gone = Counter::default();
        registry.register(
            "inboxes_gone",
            "Personal inboxes remembered as gone after a 410",
            inboxes_gone.clone(),
        );
        Self {
            registry,
            ops,
            latency,
            fee_bumps,
            dead_letters,
            low_deferred,
            aggressive_fee_used,
            max_fee_hit,
            leases_lost,
            queue_depth,
            stuck_submitted,
            lanes_held,
            subjects_halted,
            paused,
            breakers_open,
            permits_in_use,
            slow_attempts,
            oldest_due,
            plugin_calls,
            plugin_duration,
            plugin_reloads,
            plugin_quarantined,
            oracle_polls,
            pruned,
            oracle_clamps,
            oracle_recommended,
            oracle_aggressive,
            oracle_capacity,
            oracle_congestion,
            oracle_staleness,
            destination_changes,
            destinations_held,
            inboxes_gone,
        }
    }

    /// The registry in Prometheus text format.
    pub fn render(&self) -> String {
        let mut text = String::new();
        if prometheus_client::encoding::text::encode(&mut text, &self.registry).is_err() {
            // Encoding into a String cannot fail; say so rather than panic.
            let _ = writeln!(text, "# encoding failed");
        }
        text
    }
}

/// What the database says at scrape time, for the gauges.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// `(status, priority, count)`.
    pub depth: Vec<(String, Priority, i64)>,
    /// Submitted ops with an expired lease.
    pub stuck_submitted: i64,
    /// Lanes held by dead letters.
    pub lanes_held: i64,
    /// Halted subjects.
    pub subjects_halted: i64,
    /// `(scope, count)`.
    pub paused: Vec<(String, i64)>,
    /// Breakers holding ops on this host.
    pub breakers_open: i64,
    /// Host permits held now (this host).
    pub permits_in_use: i64,
    /// Slow attempts waiting outside the permits now (this host).
    pub slow_attempts: i64,
    /// Destination hosts held: `(unavailable, suspended)`.
    pub destinations_held: (i64, i64),
    /// `(kind, outbox, seconds)` the oldest due pending op has waited.
    pub oldest_due: Vec<(String, String, f64)>,
    /// `(plugin, quarantined)` for every loaded plugin.
    pub plugins: Vec<(String, bool)>,
    /// Per oracle: recommended, aggressive, capacity usage, congestion
    /// level, seconds since its sample.
    pub oracles: Vec<OracleGauges>,
}

/// One oracle's gauges.
#[derive(Debug, Clone)]
pub struct OracleGauges {
    /// Its name.
    pub oracle: String,
    /// p70 base fee.
    pub recommended: i64,
    /// p95 base fee.
    pub aggressive: i64,
    /// 0..1.
    pub capacity_usage: f64,
    /// 0..3.
    pub congestion_level: i64,
    /// Since the sample.
    pub staleness_seconds: f64,
}

impl Metrics {
    /// Sets the gauges from a scrape-time snapshot.
    pub fn observe(&self, snapshot: &Snapshot) {
        self.queue_depth.clear();
        for (status, priority, count) in &snapshot.depth {
            self.queue_depth
                .get_or_create(&DepthLabels {
                    status: status.clone(),
                    priority: priority.as_str().to_owned(),
                })
                .set(*count);
        }
        self.stuck_submitted.set(snapshot.stuck_submitted);
        self.lanes_held.set(snapshot.lanes_held);
        self.subjects_halted.set(snapshot.subjects_halted);
        self.paused.clear();
        for scope in ["kind", "outbox", "destination"] {
            let count = snapshot.paused.iter().find(|(s, _)| s == scope).map_or(0, |(_, n)| *n);
            self.paused
                .get_or_create(&ScopeLabels {
                    scope: scope.to_owned(),
                })
                .set(count);
        }
        self.breakers_open.set(snapshot.breakers_open);
        self.permits_in_use.set(snapshot.permits_in_use);
        self.slow_attempts.set(snapshot.slow_attempts);
        for (state, n) in [
            ("unavailable", snapshot.destinations_held.0),
            ("suspended", snapshot.destinations_held.1),
        ] {
            self.destinations_held
                .get_or_create(&StateLabels {
                    state: state.to_owned(),
                })
                .set(n);
        }
        self.oldest_due.clear();
        for (kind, outbox, seconds) in &snapshot.oldest_due {
            self.oldest_due
                .get_or_create(&DueLabels {
                    kind: kind.clone(),
                    outbox: outbox.clone(),
                })
                .set(*seconds);
        }
        self.plugin_quarantined.clear();
        for (plugin, quarantined) in &snapshot.plugins {
            self.plugin_quarantined
                .get_or_create(&PluginLabels { plugin: plugin.clone() })
                .set(i64::from(*quarantined));
        }
        for o in &snapshot.oracles {
            let labels = OracleLabels {
                oracle: o.oracle.clone(),
            };
            self.oracle_recommended.get_or_create(&labels).set(o.recommended);
            self.oracle_aggressive.get_or_create(&labels).set(o.aggressive);
            self.oracle_capacity.get_or_create(&labels).set(o.capacity_usage);
            self.oracle_congestion.get_or_create(&labels).set(o.congestion_level);
            self.oracle_staleness.get_or_create(&labels).set(o.staleness_seconds);
        }
    }
}

/// An attempt's outcome was recorded.
pub struct OpSettled<'a> {
    /// The op.
    pub op: OpId,
    /// Its kind.
    pub kind: &'a str,
    /// Its outbox.
    pub outbox: &'a str,
    /// Its tier.
    pub priority: Priority,
    /// The attempt number.
    pub attempt: i32,
    /// What was decided.
    pub decision: Settled<'a>,
}

/// What a settle decided, as the event reports it.
pub enum Settled<'a> {
    /// Confirmed, this long after the op was created.
    Confirmed {
        /// Seconds from creation.
        latency_seconds: f64,
    },
    /// Retried at a time.
    Retry {
        /// When.
        at: chrono::DateTime<chrono::Utc>,
        /// Why.
        error: &'a str,
        /// With a bumped fee.
        fee_bump: bool,
    },
    /// Dead-lettered.
    DeadLetter {
        /// Why.
        error: &'a str,
        /// The attempt's class (`permanent`, `retryable`, …).
        class: &'a str,
        /// Its lanes.
        lanes: &'a [String],
        /// What it relates to.
        correlation_id: Option<&'a str>,
    },
}

impl OpSettled<'_> {
    /// Logs the settle and counts it.
    pub fn emit(&self, metrics: &Metrics) {
        let (op, attempt) = (self.op, self.attempt);
        let outcome = match &self.decision {
            Settled::Confirmed { latency_seconds } => {
                debug!(op, attempt, "Op confirmed.");
                metrics
                    .latency
                    .get_or_create(&KindLabels {
                        kind: self.kind.to_owned(),
                    })
                    .observe(*latency_seconds);
                OutcomeLabel::confirmed
            }
            Settled::Retry { at, error, fee_bump } => {
                info!(op, attempt, retry_at = %at, error = %error, "Op will be retried.");
                if *fee_bump {
                    metrics
                        .fee_bumps
                        .get_or_create(&KindLabels {
                            kind: self.kind.to_owned(),
                        })
                        .inc();
                }
                OutcomeLabel::retry
            }
            Settled::DeadLetter {
                error,
                class,
                lanes,
                correlation_id,
            } => {
                error!(
                    op,
                    kind = %self.kind,
                    outbox = %self.outbox,
                    attempts = attempt,
                    lanes = ?lanes,
                    correlation_id = ?correlation_id,
                    reason = %error,
                    "Op dead-lettered."
                );
                metrics
                    .dead_letters
                    .get_or_create(&DeadLetterLabels {
                        kind: self.kind.to_owned(),
                        reason: (*class).to_owned(),
                    })
                    .inc();
                OutcomeLabel::failed
            }
        };
        metrics
            .ops
            .get_or_create(&OpLabels {
                kind: self.kind.to_owned(),
                priority: self.priority.as_str().to_owned(),
                outcome,
            })
            .inc();
    }
}

/// An outcome could not be recorded: the lease had been taken over.
pub struct LeaseLost {
    /// The op.
    pub op: OpId,
    /// The attempt that ran.
    pub attempt: i32,
}

impl LeaseLost {
    /// Logs and counts it.
    pub fn emit(&self, metrics: &Metrics) {
        warn!(
            op = self.op,
            attempt = self.attempt,
            "Lease was lost before the outcome was recorded; the op will be delivered again."
        );
        metrics.leases_lost.inc();
    }
}

/// How the fee policy priced an attempt, when that is worth reporting.
pub enum Priced<'a> {
    /// The fee reached the absolute cap (submitted at the cap).
    Capped {
        /// The op.
        op: OpId,
        /// Its kind.
        kind: &'a str,
        /// Its tier.
        priority: Priority,
        /// The fee.
        fee: u64,
    },
    /// A CRITICAL op got the aggressive fee (congestion).
    Aggressive {
        /// The op.
        op: OpId,
        /// Its kind.
        kind: &'a str,
        /// The fee.
        fee: u64,
    },
    /// A LOW op was deferred (congestion).
    Deferred {
        /// The op.
        op: OpId,
        /// Its kind.
        kind: &'a str,
        /// Its tier.
        priority: Priority,
        /// Until when.
        until: chrono::DateTime<chrono::Utc>,
    },
}

impl Priced<'_> {
    /// Logs and counts it.
    pub fn emit(&self, metrics: &Metrics) {
        match self {
            Self::Capped {
                op,
                kind,
                priority,
                fee,
            } => {
                error!(op, kind = %kind, priority = %priority, fee, alert = "max-fee-hit", "Fee reached the absolute cap; submitting at the cap.");
                metrics
                    .max_fee_hit
                    .get_or_create(&PriorityLabels {
                        priority: priority.as_str().to_owned(),
                    })
                    .inc();
            }
            Self::Aggressive { op, kind, fee } => {
                info!(op, kind = %kind, fee, "Congested: using the aggressive fee.");
                metrics.aggressive_fee_used.inc();
            }
            Self::Deferred {
                op,
                kind,
                priority,
                until,
            } => {
                info!(op, kind = %kind, priority = %priority, until = %until, "Deferred by the fee policy (congestion).");
                metrics.low_deferred.inc();
            }
        }
    }
}

/// An executor call returned (or was cut off).
pub struct PluginCalled<'a> {
    /// The op's kind.
    pub kind: &'a str,
    /// The plugin serving it (`None`: no plugin configured).
    pub plugin: Option<&'a str>,
    /// What it reported.
    pub outcome: &'a crate::outcome::Outcome,
    /// How long it ran.
    pub seconds: f64,
}

impl PluginCalled<'_> {
    /// Counts it (the settle that follows logs it).
    pub fn emit(&self, metrics: &Metrics) {
        let plugin = self.plugin.unwrap_or("").to_owned();
        metrics
            .plugin_calls
            .get_or_create(&CallLabels {
                plugin: plugin.clone(),
                kind: self.kind.to_owned(),
                class: self.outcome.label().to_owned(),
            })
            .inc();
        metrics
            .plugin_duration
            .get_or_create(&PluginLabels { plugin })
            .observe(self.seconds);
    }
}

/// A configuration reload finished.
pub enum Reloaded<'a> {
    /// The new config and plugins are in service.
    Loaded,
    /// Refused; the previous ones stay.
    Refused {
        /// Why.
        error: &'a str,
    },
}

impl Reloaded<'_> {
    /// Logs and counts it.
    pub fn emit(&self, metrics: Option<&Metrics>) {
        let outcome = match self {
            Self::Loaded => {
                info!("Configuration reloaded.");
                "loaded"
            }
            Self::Refused { error } => {
                error!(error = %error, "Reload refused; the previous configuration and plugins stay in service.");
                "refused"
            }
        };
        if let Some(metrics) = metrics {
            metrics
                .plugin_reloads
                .get_or_create(&ResultLabels {
                    outcome: outcome.to_owned(),
                })
                .inc();
        }
    }
}

/// A fee oracle poll finished.
pub enum OraclePolled<'a> {
    /// A snapshot was stored.
    Stored {
        /// The oracle.
        oracle: &'a str,
        /// What was stored.
        snapshot: &'a crate::fees::FeeSnapshot,
    },
    /// Nothing was stored; the snapshot goes stale.
    Failed {
        /// The oracle.
        oracle: &'a str,
        /// Why.
        error: &'a str,
    },
}

impl OraclePolled<'_> {
    /// Logs and counts it.
    pub fn emit(&self, metrics: &Metrics) {
        let outcome = match self {
            Self::Stored { oracle, snapshot } => {
                debug!(oracle = %oracle, congestion = ?snapshot.congestion, recommended = snapshot.recommended_base_fee, "Fee snapshot stored.");
                for bound in snapshot.clamped.split(',').map(str::trim).filter(|b| !b.is_empty()) {
                    metrics
                        .oracle_clamps
                        .get_or_create(&BoundLabels {
                            bound: bound.to_owned(),
                        })
                        .inc();
                }
                "stored"
            }
            Self::Failed { oracle, error } => {
                warn!(oracle = %oracle, error = %error, "Fee oracle poll failed; the snapshot will go stale.");
                "failed"
            }
        };
        metrics
            .oracle_polls
            .get_or_create(&ResultLabels {
                outcome: outcome.to_owned(),
            })
            .inc();
    }
}

/// A destination host's health changed state, or a personal inbox was
/// found gone.
pub enum DestinationChanged<'a> {
    /// The host entered `to` (from another state).
    Health {
        /// The destination host.
        host: &'a str,
        /// The new state.
        to: crate::health::HealthState,
        /// Why (unset when it became available).
        reason: Option<&'a str>,
        /// Who or what changed it (`delivery`, `probe`, `inbound`, an operator).
        by: &'a str,
    },
    /// A personal inbox answered 410: later fan-outs skip it.
    InboxGone {
        /// The inbox.
        inbox: &'a str,
    },
}

impl DestinationChanged<'_> {
    /// Logs and counts it.
    pub fn emit(&self, metrics: &Metrics) {
        match self {
            Self::Health { host, to, reason, by } => {
                let state = to.as_str();
                match to {
                    crate::health::HealthState::Available => {
                        info!(destination = %host, by = %by, "Destination available again; its held ops go.");
                    }
                    _ => warn!(
                        destination = %host, state, by = %by, reason = reason.unwrap_or(""),
                        "Destination held: its ops wait (not attempted, not dead-lettered)."
                    ),
                }
                metrics
                    .destination_changes
                    .get_or_create(&StateLabels {
                        state: state.to_owned(),
                    })
                    .inc();
            }
            Self::InboxGone { inbox } => {
                warn!(inbox = %inbox, "Inbox answered 410 Gone; later fan-outs skip it.");
                metrics.inboxes_gone.inc();
            }
        }
    }
}

/// What one pruning run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PruneReport {
    /// Ops deleted.
    pub deleted: u64,
    /// Ops archived before deletion.
    pub archived: u64,
    /// Tombstones written.
    pub tombstones: u64,
    /// Expired tombstones dropped.
    pub expired: u64,
    /// Per-remote-host records forgotten (destination health, inboxes,
    /// rate buckets, plugin notes) that nothing had written for long.
    pub forgotten: u64,
}

/// A pruning run ended.
pub enum PruneRan<'a> {
    /// It ran (on this host, which held the lease).
    Done(&'a PruneReport),
    /// It failed; what it deleted stays deleted, the rest waits.
    Failed(&'a str),
}

impl PruneRan<'_> {
    /// Logs and counts it.
    pub fn emit(&self, metrics: &Metrics) {
        match self {
            Self::Done(r) => {
                if r.deleted + r.expired + r.forgotten > 0 {
                    info!(
                        deleted = r.deleted,
                        archived = r.archived,
                        tombstones = r.tombstones,
                        expired = r.expired,
                        forgotten = r.forgotten,
                        "Pruned terminal ops past their retention."
                    );
                }
                for (outcome, n) in [
                    ("deleted", r.deleted),
                    ("archived", r.archived),
                    ("tombstoned", r.tombstones),
                    ("tombstone_expired", r.expired),
                    ("remote_state_forgotten", r.forgotten),
                ] {
                    metrics
                        .pruned
                        .get_or_create(&ResultLabels {
                            outcome: outcome.to_owned(),
                        })
                        .inc_by(n);
                }
            }
            Self::Failed(error) => {
                error!(error = %error, "Pruning failed; it is tried again at the next interval.");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_settle_moves_the_seed_counters_with_their_labels() {
        let metrics = Metrics::new();
        OpSettled {
            op: 1,
            kind: "deposit",
            outbox: "vault",
            priority: Priority::Normal,
            attempt: 1,
            decision: Settled::Retry {
                at: chrono::DateTime::UNIX_EPOCH,
                error: "busy",
                fee_bump: true,
            },
        }
        .emit(&metrics);
        OpSettled {
            op: 1,
            kind: "deposit",
            outbox: "vault",
            priority: Priority::Normal,
            attempt: 2,
            decision: Settled::Confirmed { latency_seconds: 0.2 },
        }
        .emit(&metrics);
        let text = metrics.render();
        for line in [
            "outbox_ops_total{kind=\"deposit\",priority=\"normal\",outcome=\"retry\"} 1",
            "outbox_ops_total{kind=\"deposit\",priority=\"normal\",outcome=\"confirmed\"} 1",
            "outbox_fee_bump_total{kind=\"deposit\"} 1",
            "outbox_op_latency_seconds_count{kind=\"deposit\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }

    #[test]
    fn fee_events_carry_the_seed_labels() {
        let metrics = Metrics::new();
        Priced::Capped {
            op: 1,
            kind: "withdraw",
            priority: Priority::Critical,
            fee: 100_000,
        }
        .emit(&metrics);
        Priced::Aggressive {
            op: 2,
            kind: "withdraw",
            fee: 900,
        }
        .emit(&metrics);
        Priced::Deferred {
            op: 3,
            kind: "rebalance",
            priority: Priority::Low,
            until: chrono::DateTime::UNIX_EPOCH,
        }
        .emit(&metrics);
        let snapshot = crate::fees::FeeSnapshot {
            recommended_base_fee: 100,
            aggressive_base_fee: 5000,
            congestion: crate::fees::Congestion::High,
            ledger_capacity_usage: 0.9,
            sampled_at_ms: 0,
            congestion_since_ms: 0,
            clamped: "min,max".to_owned(),
        };
        OraclePolled::Stored {
            oracle: "stellar",
            snapshot: &snapshot,
        }
        .emit(&metrics);
        OraclePolled::Failed {
            oracle: "stellar",
            error: "timeout",
        }
        .emit(&metrics);
        let text = metrics.render();
        for line in [
            "outbox_max_fee_hit_total{priority=\"critical\"} 1",
            "outbox_aggressive_fee_used_total 1",
            "outbox_low_deferred_total 1",
            "fee_oracle_clamp_total{bound=\"min\"} 1",
            "fee_oracle_clamp_total{bound=\"max\"} 1",
            "fee_oracle_polls_total{outcome=\"stored\"} 1",
            "fee_oracle_polls_total{outcome=\"failed\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }

    #[test]
    fn gauges_show_what_the_last_scrape_saw() {
        let metrics = Metrics::new();
        metrics.observe(&Snapshot {
            depth: vec![("pending".to_owned(), Priority::Low, 7)],
            ..Snapshot::default()
        });
        metrics.observe(&Snapshot {
            depth: vec![("failed".to_owned(), Priority::Low, 2)],
            ..Snapshot::default()
        });
        let text = metrics.render();
        assert!(
            text.contains("outbox_queue_depth{status=\"failed\",priority=\"low\"} 2"),
            "{text}"
        );
        assert!(
            !text.contains("status=\"pending\""),
            "a status gone from the queue leaves the gauge:\n{text}"
        );
    }
}
