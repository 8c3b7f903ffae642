//! Configuration: embedded defaults, then the config file, then `LANEWAY_*`
//! environment variables; unknown keys rejected; every problem reported at
//! once with its key path.
//!
//! Loading is split from validation so a reload can check a new config
//! completely before anything uses it.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;

pub use crate::lanes::LaneMode;
use crate::op::Priority;

mod inbound;
mod load;
mod validate;

pub use inbound::{fetch_actor_problems, FETCH_KEY_FRAGMENT};
pub use load::{env_lookalikes, from_layers, from_toml_str, load, process_env, EnvLookalike, FileSource};
pub use validate::{oracle_egress, oracle_url_unlisted, rpc_egress};

/// The defaults, compiled in: the documented file is the defaults.
pub const DEFAULTS: &str = include_str!("../../../config/default.toml");

/// Environment variables with this prefix set config keys.
pub const ENV_PREFIX: &str = "LANEWAY_";

/// The configuration's top-level sections, in the order the docs give them.
pub const SECTIONS: [&str; 14] = [
    "database",
    "queue",
    "dispatch",
    "runtime",
    "api",
    "retention",
    "outcomes",
    "destinations",
    "inbound",
    "plugins",
    "keys",
    "oracles",
    "pools",
    "kinds",
];

/// `LANEWAY_*` variables that are not config keys (the documented ones; any
/// other name without `__` is not config either, see [`env_lookalikes`]).
const ENV_RESERVED: [&str; 4] = [
    "LANEWAY_CONFIG",
    "LANEWAY_LOG",
    "LANEWAY_LOG_FORMAT",
    "LANEWAY_FAILPOINT",
];

/// The whole configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `[database]`
    pub database: DatabaseConfig,
    /// `[queue]`
    pub queue: QueueConfig,
    /// `[dispatch]`
    pub dispatch: DispatchConfig,
    /// `[runtime]`
    pub runtime: RuntimeConfig,
    /// `[api]`
    pub api: ApiConfig,
    /// `[retention]`
    pub retention: RetentionConfig,
    /// `[outcomes]`
    pub outcomes: OutcomesConfig,
    /// `[destinations]`
    pub destinations: DestinationsConfig,
    /// `[inbound]`
    pub inbound: InboundConfig,
    /// `[plugins.NAME]`
    pub plugins: BTreeMap<String, PluginConfig>,
    /// `[keys.ID]`
    pub keys: BTreeMap<String, crate::keys::KeySource>,
    /// `[oracles.NAME]`
    pub oracles: BTreeMap<String, OracleConfig>,
    /// `[pools.NAME]`
    pub pools: BTreeMap<String, PoolConfig>,
    /// `[kinds.NAME]`
    pub kinds: BTreeMap<String, KindConfig>,
}

/// `[api]`: the HTTP API `laneway run` serves.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ApiConfig {
    /// `HOST:PORT` to listen on; empty serves no API.
    pub listen: String,
    /// `/metrics` asks for a key with the `metrics:read` scope.
    pub metrics_key_required: bool,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// Most ops one page of a listing returns.
    pub max_page: u32,
    /// Dead letters a bulk recover puts back per second (the rest are
    /// spread over the seconds after).
    pub recover_per_second: u32,
    /// Requests per second the public network-conditions route answers.
    pub public_per_second: u32,
    /// A request's headers must arrive within this.
    pub header_timeout_ms: u64,
    /// A request's body must arrive within this of the request's start.
    pub body_timeout_ms: u64,
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections open at once from one client address.
    pub max_connections_per_ip: usize,
    /// `POST /api/v1/ops?wait=` requests held at once (429 past it).
    pub max_waiters: usize,
    /// Serve the operator console at `/console`.
    pub console: bool,
}

/// `[retention]`: how long terminal ops and pruned ops' idempotency keys
/// are kept (a kind may set its own), and how the pruner paces itself.
/// Durations are milliseconds; 0 keeps forever.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RetentionConfig {
    /// Confirmed ops, after they finished.
    pub confirmed_ms: u64,
    /// Cancelled ops.
    pub cancelled_ms: u64,
    /// Dead letters (a dead letter holding a strict lane is never pruned).
    pub failed_ms: u64,
    /// A pruned op's idempotency key, as a tombstone that answers `existing`.
    pub idempotency_ms: u64,
    /// How often the pruner runs.
    pub every_ms: u64,
    /// Ops deleted per transaction (bounded lock time).
    pub batch: u32,
}

/// `[outcomes]`: how outcomes reach producers besides the feed.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct OutcomesConfig {
    /// Where outcome webhooks may be sent (`kinds.NAME.outcome_webhook`),
    /// as plugins' `allowed_hosts` patterns.
    pub allowed_hosts: Vec<String>,
    /// Internal networks webhooks may reach anyway (a receiver on
    /// loopback); every other internal address is refused.
    pub allowed_internal: Vec<String>,
    /// How often the relay reads the feed for outcomes to send.
    pub relay_every_ms: u64,
}

/// `[destinations]`: destination health over days and per-host rate limits,
/// both shared by every host.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct DestinationsConfig {
    /// Failing this long without an answer makes a host unavailable.
    pub unavailable_after_ms: u64,
    /// One probe op per this interval to an unavailable host.
    pub probe_every_ms: u64,
    /// Requests per second to one destination host; 0 is unlimited.
    pub rate_per_second: f64,
    /// Requests a quiet host may take at once.
    pub rate_burst: u32,
    /// Ops one laneway host keeps in flight to one destination host at
    /// most, so slow or hung servers cannot hold every permit.
    pub max_in_flight: usize,
    /// The same cap for a destination host that has not answered this
    /// laneway host lately (first contact, or its last attempt failed), to
    /// begin with: a server that hangs holds this many permits, not
    /// `max_in_flight`, until its patience earns it more.
    pub max_in_flight_unanswered: usize,
    /// An unanswered destination earns one more request once its requests
    /// have been in flight this long, another after twice this more, and
    /// so on up to `max_in_flight`; an answer gives it the full cap at once.
    pub unanswered_patience_ms: u64,
    /// What laneway keeps per remote host (health, gone and shared inboxes,
    /// plugin notes) is forgotten once nothing has written it this long.
    pub forget_after_ms: u64,
    /// How often each host reads the shared health records again (a
    /// change it makes itself is read at once).
    pub health_refresh_ms: u64,
}

impl DestinationsConfig {
    /// The health rules' settings.
    pub fn health(&self) -> crate::health::HealthConfig {
        crate::health::HealthConfig {
            unavailable_after: std::time::Duration::from_millis(self.unavailable_after_ms),
            probe_every: std::time::Duration::from_millis(self.probe_every_ms),
        }
    }
}

/// `[inbound]`: ActivityPub inboxes on the API listener.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct InboundConfig {
    /// Serve `POST /inbox/{actor}` and `POST /inbox`.
    pub enabled: bool,
    /// The kind inbound activities are enqueued as.
    pub kind: String,
    /// The URL senders post to (behind a proxy); empty: `http://{Host}`.
    pub public_url: String,
    /// Where actors' keys may be fetched from.
    pub allowed_hosts: Vec<String>,
    /// Internal networks key fetches may reach anyway.
    pub allowed_internal: Vec<String>,
    /// A key fetch's time limit.
    pub fetch_timeout_ms: u64,
    /// How long a fetched key is trusted.
    pub key_cache_ms: u64,
    /// How soon a key that stopped verifying may be fetched again.
    pub key_refetch_ms: u64,
    /// How far a signature's time may be from now.
    pub clock_skew_ms: u64,
    /// How long a key that could not be fetched is answered from memory
    /// (one fetch per key id per this, however many requests name it).
    pub key_failure_ms: u64,
    /// The instance actor key and actor fetches are signed as (its id, a
    /// URL); empty: fetches are unsigned.
    pub fetch_actor: String,
    /// The `[keys.ID]` that signs them.
    pub fetch_key: String,
    /// laneway serves the actor's document at its URL's path on the API
    /// listener; off, the application publishes it.
    pub serve_fetch_actor: bool,
}

/// The kind laneway delivers outcome webhooks as.
pub const WEBHOOK_KIND: &str = "outcome_webhook";

/// `[runtime]`: the WebAssembly engine.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RuntimeConfig {
    /// Component instances that may exist at once (pooling allocator slots).
    pub max_instances: u32,
    /// Epoch tick: how finely call deadlines are enforced.
    pub epoch_tick_ms: u64,
    /// Consecutive crashes (traps, exits, resource limits) after which a
    /// plugin version is quarantined until it is reloaded.
    pub quarantine_after: u32,
    /// Debounce for reloads triggered by file changes.
    pub reload_debounce_ms: u64,
    /// Wasm stack per call, for every plugin (an engine-wide setting).
    pub max_wasm_stack_kib: u32,
    /// Keep compiled plugins on disk, so a process that loads a plugin
    /// another one compiled (the CLI, a restart) does not compile it again.
    pub compile_cache: bool,
    /// Where; empty means the engine's per-user cache directory.
    pub compile_cache_dir: String,
}

/// `[pools.NAME]`: Stellar channel accounts that are the source of a
/// kind's transactions, so the kind's signer (who authorises each contract
/// call) is not limited to one transaction in flight. Each channel is a lane
/// of its own: one transaction in flight per channel.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PoolConfig {
    /// The channels' `[keys.ID]` (ed25519), in dealing order.
    pub channels: Vec<String>,
    /// Channels that take no new ops; the ops already dealt to them drain.
    /// A channel leaves `channels` only once `laneway stellar channels list`
    /// shows it empty.
    #[serde(default)]
    pub retired: Vec<String>,
    /// The `[keys.ID]` that funds new channels (`laneway stellar channels fund`).
    #[serde(default)]
    pub funder: Option<String>,
    /// The RPC `laneway stellar channels` talks to (list, fund).
    #[serde(default)]
    pub rpc_url: Option<String>,
    /// The network passphrase for funding transactions.
    #[serde(default)]
    pub network_passphrase: Option<String>,
    /// Who pays each transaction's fee: the channel that is its source, or
    /// the kind's signer through a fee-bump envelope around every
    /// transaction (the Stellar Disbursement Platform's way), so channels
    /// need hold no more than their reserve.
    #[serde(default)]
    pub fee_payer: FeePayer,
}

/// `[pools.NAME] fee_payer`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FeePayer {
    /// The channel pays its own transactions' fees.
    #[default]
    Channel,
    /// The kind's signer pays, as the fee source of a fee bump around every
    /// transaction.
    Signer,
}

/// `[oracles.NAME]`: a fee oracle polling Stellar RPC.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct OracleConfig {
    /// The `[plugins.NAME]` fee policy that folds samples into snapshots.
    pub policy: String,
    /// The Stellar RPC endpoint.
    pub rpc_url: String,
    /// Poll cadence (seed 003: 10 s).
    #[serde(default = "default_oracle_poll_ms")]
    pub poll_ms: u64,
    /// One RPC call's timeout.
    #[serde(default = "default_oracle_timeout_ms")]
    pub timeout_ms: u64,
    /// How long priced ops wait for the oracle's first sample (after the
    /// host starts pricing) before the policy's default fee is used.
    #[serde(default = "default_first_sample_wait_ms")]
    pub first_sample_wait_ms: u64,
    /// Settings handed to the policy (as JSON).
    #[serde(default)]
    pub config: toml::Table,
}

impl OracleConfig {
    /// The policy's settings as JSON.
    pub fn config_json(&self) -> String {
        serde_json::to_string(&self.config).unwrap_or_else(|_| "{}".to_owned())
    }
}

fn default_oracle_poll_ms() -> u64 {
    10_000
}

fn default_oracle_timeout_ms() -> u64 {
    10_000
}

fn default_first_sample_wait_ms() -> u64 {
    30_000
}

/// `[plugins.NAME]`: one WebAssembly component and its sandbox.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct PluginConfig {
    /// The `.wasm` component (relative to the working directory).
    pub path: std::path::PathBuf,
    /// Linear memory cap.
    #[serde(default = "default_memory_mib")]
    pub memory_mib: u32,
    /// Per-call deadline, including host calls.
    #[serde(default = "default_plugin_timeout_ms")]
    pub timeout_ms: u64,
    /// Instruction budget per call (fee policies only).
    #[serde(default = "default_fuel")]
    pub fuel: u64,
    /// The share of one core (percent) the plugin's calls get together
    /// once each has computed past its first 20 ms (`runtime::pacing`).
    #[serde(default = "default_cpu_share_percent")]
    pub cpu_share_percent: u32,
    /// Destinations the plugin may reach over HTTP (`https://*.example.com`).
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// Internal networks (loopback, private) it may reach anyway (`127.0.0.1/32`).
    #[serde(default)]
    pub allowed_internal: Vec<String>,
    /// Signing keys it may use, by id.
    #[serde(default)]
    pub keys: Vec<String>,
    /// HTTP connect timeout.
    #[serde(default = "default_http_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// HTTP request timeout (whole exchange).
    #[serde(default = "default_http_timeout_ms")]
    pub request_timeout_ms: u64,
    /// Largest HTTP response body accepted.
    #[serde(default = "default_max_response_bytes")]
    pub max_response_bytes: u64,
    /// Concurrent HTTP requests (seed 002: 20).
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// Idle connections kept per host (seed 002: 5).
    #[serde(default = "default_idle_connections")]
    pub max_idle_connections: u32,
    /// Log lines a call may write before the rest are suppressed.
    #[serde(default = "default_log_lines")]
    pub log_lines_per_call: u32,
}

fn default_memory_mib() -> u32 {
    64
}

fn default_plugin_timeout_ms() -> u64 {
    60_000
}

fn default_cpu_share_percent() -> u32 {
    10
}

fn default_fuel() -> u64 {
    50_000_000
}

fn default_http_timeout_ms() -> u64 {
    30_000
}

fn default_max_response_bytes() -> u64 {
    1024 * 1024
}

fn default_max_connections() -> u32 {
    20
}

fn default_idle_connections() -> u32 {
    5
}

fn default_log_lines() -> u32 {
    100
}

// The database settings belong to the queue, which owns them; they are read
// here with the rest of the file.
pub use crate::queue::{DatabaseConfig, SqliteConfig, Synchronous};

/// `[queue]`
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct QueueConfig {
    /// Largest payload accepted.
    pub max_payload_bytes: usize,
    /// Payloads at least this long are stored once however many ops carry
    /// them (a fan-out's activity); 0 never.
    pub shared_payload_bytes: usize,
    /// Claim duration.
    pub lease_ms: u64,
    /// Most ops per claim.
    pub claim_batch: u32,
}

/// `[dispatch]`
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct DispatchConfig {
    /// Safety-net poll interval.
    pub poll_ms: u64,
    /// Host-wide in-flight cap.
    pub max_in_flight: usize,
    /// Per-outbox in-flight cap.
    pub outbox_max_in_flight: usize,
    /// Most slow attempts (past their kind's `slow_after_ms`) this host
    /// keeps waiting outside `max_in_flight` and `outbox_max_in_flight`;
    /// 0 keeps every attempt under them. Read at start.
    pub max_slow: usize,
    /// Ops the scheduler reads per pass.
    pub window: u32,
    /// Attempts per op per drain pass before its lanes stall for the pass.
    pub in_pass_attempts: u32,
    /// Drain slot lease.
    pub slot_ttl_ms: u64,
    /// Shutdown grace for in-flight ops.
    pub shutdown_grace_ms: u64,
    /// `[dispatch.breaker]`
    pub breaker: BreakerSettings,
}

/// `[dispatch.breaker]`
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct BreakerSettings {
    /// Consecutive failures that open a destination's breaker.
    pub threshold: u32,
    /// How long it stays open before one trial op.
    pub cool_off_ms: u64,
}

/// What a strict lane does after one of its ops is dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Poison {
    /// The lane continues with the next op (default).
    Skip,
    /// The lane stays blocked until an operator skips or retries the op.
    Halt,
}

/// Whether a kind's ops must name lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LanePresence {
    /// At least one lane.
    Required,
    /// Zero lanes allowed (the op gets a lane of its own).
    Optional,
    /// The kind's plugin names the lanes (a Stellar kind's signer account):
    /// an op gets them when it names none, and an op that names lanes must
    /// include every one of them, so no producer can step outside the
    /// plugin's ordering (one transaction per signer).
    Plugin,
}

/// `[kinds.NAME]`
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct KindConfig {
    /// Default priority for enqueues that do not name one.
    #[serde(default = "default_priority")]
    pub priority: Priority,
    /// Whether lanes are required.
    #[serde(default = "default_lanes")]
    pub lanes: LanePresence,
    /// Lane ordering.
    #[serde(default = "default_lane_mode")]
    pub lane_mode: LaneMode,
    /// Serial lanes: ops in flight per lane.
    #[serde(default = "one")]
    pub lane_cap: usize,
    /// Ops of this kind in flight per outbox (no cap when absent).
    #[serde(default)]
    pub max_in_flight: Option<usize>,
    /// Attempts before a retryable failure is dead-lettered.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// Attempts before an executor fault is dead-lettered.
    #[serde(default = "default_fault_attempts")]
    pub fault_attempts: u32,
    /// First backoff.
    #[serde(default = "default_backoff_base_ms")]
    pub backoff_base_ms: u64,
    /// Longest backoff.
    #[serde(default = "default_backoff_max_ms")]
    pub backoff_max_ms: u64,
    /// Longest Retry-After honoured.
    #[serde(default = "default_retry_after_max_ms")]
    pub retry_after_max_ms: u64,
    /// `full` (a wait anywhere below the backoff) or `equal` (in its upper
    /// half, so the whole schedule has a guaranteed span).
    #[serde(default)]
    pub jitter: crate::retry::Jitter,
    /// One executor call's deadline.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// An attempt still waiting this long is slow: it gives its host permit
    /// and its place under `outbox_max_in_flight` back (while
    /// `dispatch.max_slow` has room), keeping its lanes, its destination's
    /// count and its place under this kind's `max_in_flight`. For kinds
    /// whose attempts wait on remote servers; absent, never (a kind whose
    /// outbox cap is a rule, like seed 003's ten in flight).
    #[serde(default)]
    pub slow_after_ms: Option<u64>,
    /// Poison policy for strict lanes.
    #[serde(default = "default_poison")]
    pub poison: Poison,
    /// The `[plugins.NAME]` that executes this kind.
    #[serde(default)]
    pub plugin: Option<String>,
    /// Per-kind settings handed to the plugin (as JSON).
    #[serde(default)]
    pub config: toml::Table,
    /// The `[oracles.NAME]` whose snapshot and fee policy price every
    /// attempt of this kind (chain kinds); unpriced when absent.
    #[serde(default)]
    pub fee_oracle: Option<String>,
    /// The `[pools.NAME]` whose channel accounts are the source of this
    /// kind's transactions; each op is dealt one channel at enqueue, its
    /// lane.
    #[serde(default)]
    pub pool: Option<String>,
    /// Fee bumps (attempts that ended asking for a higher fee) after which
    /// the op is dead-lettered with its attempt history (seed 003: 3).
    #[serde(default)]
    pub max_fee_bumps: Option<u32>,
    /// This kind's confirmed ops are kept this long (ms, 0 forever);
    /// `retention.confirmed_ms` when absent.
    #[serde(default)]
    pub retention_confirmed_ms: Option<u64>,
    /// As `retention_confirmed_ms`, for cancelled ops.
    #[serde(default)]
    pub retention_cancelled_ms: Option<u64>,
    /// As `retention_confirmed_ms`, for dead letters.
    #[serde(default)]
    pub retention_failed_ms: Option<u64>,
    /// A pruned op's idempotency key answers `existing` this long (ms, 0
    /// forever); `retention.idempotency_ms` when absent.
    #[serde(default)]
    pub idempotency_retention_ms: Option<u64>,
    /// When an op of this kind reaches a terminal status, POST its outcome
    /// here (Standard Webhooks, signed with `outcome_webhook_key`), as an
    /// `outcome_webhook` op with its own retries and dead letters.
    #[serde(default)]
    pub outcome_webhook: Option<String>,
    /// The `[keys.ID]` (algorithm `hmac-sha256`) that signs the webhooks.
    #[serde(default)]
    pub outcome_webhook_key: Option<String>,
    /// A directory each op of this kind is written to, with its attempts,
    /// before it is pruned (JSON lines, one file a day; `laneway archive
    /// show ID` reads it). No archive when absent.
    #[serde(default)]
    pub archive: Option<String>,
}

fn one() -> usize {
    1
}

fn default_max_attempts() -> u32 {
    12
}

fn default_fault_attempts() -> u32 {
    3
}

fn default_backoff_base_ms() -> u64 {
    2_000
}

fn default_backoff_max_ms() -> u64 {
    120_000
}

fn default_retry_after_max_ms() -> u64 {
    3_600_000
}

fn default_timeout_ms() -> u64 {
    60_000
}

fn default_poison() -> Poison {
    Poison::Skip
}

impl KindConfig {
    /// The retry policy this kind's settings describe.
    pub fn retry_policy(&self) -> crate::retry::RetryPolicy {
        crate::retry::RetryPolicy {
            max_attempts: self.max_attempts,
            max_fault_attempts: self.fault_attempts,
            backoff_base: std::time::Duration::from_millis(self.backoff_base_ms),
            backoff_max: std::time::Duration::from_millis(self.backoff_max_ms),
            retry_after_max: std::time::Duration::from_millis(self.retry_after_max_ms),
            max_fee_bumps: self.max_fee_bumps,
            jitter: self.jitter,
        }
    }

    /// Object types whose id becomes a fan-out's correlation id
    /// (`config.correlate_types`, default `["CaseLedgerEntry"]`).
    pub fn correlate_types(&self) -> Vec<String> {
        match self.config.get("correlate_types").and_then(toml::Value::as_array) {
            Some(types) => types.iter().filter_map(|t| t.as_str().map(str::to_owned)).collect(),
            None => crate::fanout::DEFAULT_CORRELATE_TYPES
                .iter()
                .map(|t| (*t).to_owned())
                .collect(),
        }
    }

    /// The kind's plugin settings as JSON text, for the plugin.
    pub fn config_json(&self) -> String {
        serde_json::to_string(&self.config).unwrap_or_else(|_| "{}".to_owned())
    }

    /// Whether a dead letter of this kind holds its lanes.
    pub fn halts_lanes(&self) -> bool {
        self.poison == Poison::Halt && self.lane_mode == LaneMode::Strict
    }
}

fn default_priority() -> Priority {
    Priority::Normal
}

fn default_lanes() -> LanePresence {
    LanePresence::Required
}

fn default_lane_mode() -> LaneMode {
    LaneMode::Strict
}

/// One thing wrong with the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Dotted key path (`database.sqlite.synchronous`), or the file or
    /// variable when the problem is not a key.
    pub path: String,
    /// What was wrong and what was expected.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Errors from loading configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// Every problem found, in key order.
    #[error("invalid configuration ({} problem{}):\n{}", .0.len(), if .0.len() == 1 { "" } else { "s" }, list(.0))]
    Invalid(Vec<Problem>),
}

impl ConfigError {
    /// The problems found.
    pub fn problems(&self) -> &[Problem] {
        match self {
            ConfigError::Invalid(p) => p,
        }
    }
}

fn list(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| format!("  - {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

impl Config {
    /// The queue limits this config sets.
    pub fn limits(&self) -> crate::queue::Limits {
        crate::queue::Limits {
            max_payload_bytes: self.queue.max_payload_bytes,
            shared_payload_bytes: self.queue.shared_payload_bytes,
        }
    }

    /// What this config registers in the database for plain-SQL producers
    /// (the producer contract): every kind's default priority and lane
    /// rule, and the payload limit.
    pub fn kind_registry(&self) -> crate::queue::KindRegistry {
        use crate::queue::{KindLanes, RegisteredKind};
        crate::queue::KindRegistry {
            kinds: self
                .kinds
                .iter()
                .map(|(name, kind)| RegisteredKind {
                    kind: name.clone(),
                    priority: kind.priority,
                    lanes: match kind.lanes {
                        LanePresence::Required => KindLanes::Required,
                        LanePresence::Optional => KindLanes::Optional,
                        // A pool's kind is dealt its channel by the host,
                        // which SQL cannot ask for either.
                        LanePresence::Plugin => KindLanes::Plugin,
                    },
                })
                .collect(),
            max_payload_bytes: Some(self.queue.max_payload_bytes),
        }
    }

    /// How every configured kind's ops use their lanes.
    pub fn lane_rules(&self) -> crate::lanes::LaneRules {
        crate::lanes::LaneRules(
            self.kinds
                .iter()
                .map(|(name, kind)| {
                    let cap = if kind.lane_mode == LaneMode::Serial {
                        kind.lane_cap
                    } else {
                        1
                    };
                    (
                        name.clone(),
                        crate::lanes::LaneRule {
                            mode: kind.lane_mode,
                            cap,
                        },
                    )
                })
                .collect(),
        )
    }

    /// The config a kind runs with.
    ///
    /// # Errors
    ///
    /// A message listing the configured kinds when `kind` is not one.
    /// Whether `kind` is one only laneway itself enqueues: its outcome
    /// webhooks and the inbound activities it verified. Producers (the API,
    /// the CLI, the library's enqueue and fan-out) are refused them, since
    /// their ops speak with laneway's authority.
    pub fn is_internal_kind(&self, kind: &str) -> bool {
        kind == WEBHOOK_KIND || kind == self.inbound.kind
    }

    /// The refusal a producer gets for an internal kind.
    pub fn refuse_internal_kind(&self, kind: &str) -> Result<(), String> {
        if self.is_internal_kind(kind) {
            return Err(format!(
                "kind {kind:?} is laneway's own (outcome webhooks and verified inbound activities are enqueued by \
                 laneway itself); producers cannot enqueue it"
            ));
        }
        Ok(())
    }

    pub fn kind(&self, kind: &str) -> Result<&KindConfig, String> {
        self.kinds.get(kind).ok_or_else(|| {
            format!(
                "unknown kind {kind:?} (configured kinds: {})",
                self.kinds.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn a_key_refetch_on_every_bad_signature_is_refused() {
        let err = from_toml_str("[inbound]\nkey_refetch_ms = 0\n").unwrap_err();
        assert!(err.to_string().contains("inbound.key_refetch_ms"), "{err}");
        assert!(from_toml_str("[inbound]\nkey_refetch_ms = 1000\n").is_ok());
    }

    #[test]
    fn a_misspelt_key_path_in_the_environment_is_named_in_its_error() {
        let err = load(
            &FileSource::Default(PathBuf::from("/nonexistent/laneway.toml")),
            env(&[
                ("LANEWAY_DATABASE__URLL", "postgres://u@h/db"),
                ("LANEWAY_LOG_FORMAT", "json"),
                ("LANEWAY_FAILPOINT", "settling@3"),
            ]),
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("database.urll"), "{text}");
        assert!(text.contains("LANEWAY_DATABASE__URLL"), "{text}");
        for reserved in ["LANEWAY_LOG_FORMAT", "LANEWAY_FAILPOINT"] {
            assert!(!text.contains(reserved), "a reserved variable is not a key: {text}");
        }
    }

    #[test]
    fn only_section_key_shaped_variables_are_config() {
        // An operator's own LANEWAY_BIN or LANEWAY_PLUGINS is not a key.
        let vars = env(&[
            ("LANEWAY_BIN", "/usr/local/bin/laneway"),
            ("LANEWAY_PLUGINS", "/srv/plugins"),
            ("LANEWAY_DATABASE_URL", "postgres://u@h/db"),
            ("LANEWAY_QUEUE__LEASE_MS", "7000"),
        ]);
        let config = load(
            &FileSource::Default(PathBuf::from("/nonexistent/laneway.toml")),
            vars.clone(),
        )
        .expect("unrelated variables are ignored");
        assert_eq!(config.queue.lease_ms, 7000);
        assert_eq!(
            config.database.url, "sqlite://laneway.db",
            "LANEWAY_DATABASE_URL is not config"
        );
        // A section name alone (LANEWAY_PLUGINS) is not a misspelt key, and
        // LANEWAY_BIN names no section.
        assert_eq!(
            env_lookalikes(&vars),
            vec![EnvLookalike {
                name: "LANEWAY_DATABASE_URL".to_owned(),
                did_you_mean: "LANEWAY_DATABASE__URL".to_owned()
            }]
        );
    }

    #[test]
    fn defaults_alone_are_valid() {
        let config = from_toml_str("").expect("defaults");
        assert_eq!(config.database.url, "sqlite://laneway.db");
        assert_eq!(config.database.sqlite.synchronous, Synchronous::Full);
        assert_eq!(config.queue.max_payload_bytes, 1024 * 1024);
        assert_eq!(config.kind("withdraw").map(|k| k.priority), Ok(Priority::Critical));
        assert_eq!(config.kind("rebalance").map(|k| k.lane_mode), Ok(LaneMode::Serial));
    }

    #[test]
    fn file_then_env_override_defaults() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("laneway.toml");
        std::fs::write(&path, "[queue]\nlease_ms = 5000\n[database]\nurl = \"sqlite://a.db\"\n").expect("write");
        let config = load(
            &FileSource::Explicit(path),
            env(&[
                ("LANEWAY_DATABASE__URL", "postgres://u@h/db"),
                ("LANEWAY_DATABASE__SQLITE__SYNCHRONOUS", "normal"),
                ("LANEWAY_CONFIG", "ignored"),
                ("HOME", "/root"),
            ]),
        )
        .expect("valid");
        assert_eq!(config.queue.lease_ms, 5000);
        assert_eq!(config.database.url, "postgres://u@h/db");
        assert_eq!(config.database.sqlite.synchronous, Synchronous::Normal);
    }

    #[test]
    fn every_problem_is_reported_at_once_with_its_path() {
        let err = from_toml_str(
            r#"
            colour = "blue"
            [database]
            url = "mysql://nope"
            max_connections = 0
            [database.sqlite]
            synchronous = "sometimes"
            [queue]
            lease_ms = 10
            claim_btach = 5
            [kinds.fancy]
            priority = "urgent"
            "#,
        )
        .unwrap_err();
        let paths: Vec<&str> = err.problems().iter().map(|p| p.path.as_str()).collect();
        assert!(paths.contains(&"colour"), "{err}");
        assert!(paths.contains(&"database.sqlite.synchronous"), "{err}");
        assert!(paths.contains(&"queue.claim_btach"), "{err}");
        assert!(paths.contains(&"kinds.fancy.priority"), "{err}");
        let text = err.to_string();
        assert!(text.contains("sometimes"), "{text}");
        assert!(text.contains("urgent"), "{text}");
    }

    #[test]
    fn semantic_problems_are_all_reported() {
        let err = from_toml_str("[database]\nurl = \"mysql://x\"\nmax_connections = 0\n[queue]\nlease_ms = 10\n")
            .unwrap_err();
        let paths: Vec<&str> = err.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            vec!["database.max_connections", "database.url", "queue.lease_ms"],
            "{err}"
        );
    }

    #[test]
    fn activitypub_attempts_turn_slow_after_a_second_and_zero_is_refused() {
        let config = from_toml_str("").unwrap();
        assert_eq!(config.dispatch.max_slow, 512);
        assert_eq!(config.kinds["activitypub"].slow_after_ms, Some(1000));
        // A money kind's outbox cap is a rule: its attempts never turn slow.
        assert_eq!(config.kinds["deposit"].slow_after_ms, None);
        let err = from_toml_str("[kinds.activitypub]\nslow_after_ms = 0\n").unwrap_err();
        let paths: Vec<&str> = err.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, vec!["kinds.activitypub.slow_after_ms"], "{err}");
        // Past the timeout it is never reached, and allowed.
        let config = from_toml_str("[kinds.activitypub]\ntimeout_ms = 500\n").unwrap();
        assert_eq!(config.kinds["activitypub"].slow_after_ms, Some(1000));
        assert_eq!(
            from_toml_str("[dispatch]\nmax_slow = 0\n").unwrap().dispatch.max_slow,
            0
        );
    }

    #[test]
    fn every_attempt_in_flight_slow_ones_included_has_an_instance() {
        let config = from_toml_str("").unwrap();
        assert!(config.runtime.max_instances as usize >= config.dispatch.max_in_flight + config.dispatch.max_slow);
        let err = from_toml_str("[dispatch]\nmax_in_flight = 600\n").unwrap_err();
        let paths: Vec<&str> = err.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, vec!["runtime.max_instances"], "{err}");
        assert!(err.to_string().contains("600 + 512 = 1112"), "{err}");
        from_toml_str("[dispatch]\nmax_in_flight = 600\nmax_slow = 0\n").unwrap();
    }

    #[test]
    fn the_unanswered_destination_cap_is_one_to_the_full_cap() {
        for bad in [
            "[destinations]\nmax_in_flight_unanswered = 0\n",
            "[destinations]\nmax_in_flight = 4\nmax_in_flight_unanswered = 5\n",
        ] {
            let err = from_toml_str(bad).unwrap_err();
            let paths: Vec<&str> = err.problems().iter().map(|p| p.path.as_str()).collect();
            assert_eq!(paths, vec!["destinations.max_in_flight_unanswered"], "{err}");
        }
        let config = from_toml_str("[destinations]\nmax_in_flight = 4\nmax_in_flight_unanswered = 4\n").unwrap();
        assert_eq!(config.destinations.max_in_flight_unanswered, 4);
        assert_eq!(from_toml_str("").unwrap().destinations.max_in_flight_unanswered, 1);
        let err = from_toml_str("[destinations]\nunanswered_patience_ms = 0\n").unwrap_err();
        let paths: Vec<&str> = err.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, vec!["destinations.unanswered_patience_ms"], "{err}");
    }

    #[test]
    fn a_plugins_cpu_share_is_a_percentage() {
        let err = from_toml_str(
            "[plugins.a]\npath = \"a.wasm\"\ncpu_share_percent = 0\n[plugins.b]\npath = \"b.wasm\"\ncpu_share_percent = 101\n",
        )
        .unwrap_err();
        let paths: Vec<&str> = err.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            vec!["plugins.a.cpu_share_percent", "plugins.b.cpu_share_percent"],
            "{err}"
        );
        let config = from_toml_str("[plugins.a]\npath = \"a.wasm\"\n").unwrap();
        assert_eq!(config.plugins["a"].cpu_share_percent, 10);
    }

    #[test]
    fn a_missing_explicit_file_is_an_error_but_a_missing_default_is_not() {
        let missing = PathBuf::from("/nonexistent/laneway.toml");
        assert!(load(&FileSource::Explicit(missing.clone()), env(&[])).is_err());
        assert!(load(&FileSource::Default(missing), env(&[])).is_ok());
    }

    #[test]
    fn oracles_need_a_policy_plugin_and_an_http_url() {
        let err = from_toml_str("[oracles.main]\npolicy = \"fees\"\nrpc_url = \"ftp://x\"\npoll_ms = 5\n").unwrap_err();
        let paths: Vec<&str> = err.problems().iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            vec!["oracles.main.policy", "oracles.main.poll_ms", "oracles.main.rpc_url"],
            "{err}"
        );
    }

    /// A pool's mistakes, all at once: a channel that is no ed25519 key, a
    /// funder without a key, a retired channel outside the pool, channels
    /// the plugin may not sign with, and a pool shared by kinds with
    /// different signers.
    #[test]
    fn a_pool_is_checked_against_its_keys_its_plugin_and_the_kinds_sharing_it() {
        let keys = "[keys.vault]\nalgorithm = \"ed25519\"\nenv = \"V\"\n\
                    [keys.other]\nalgorithm = \"ed25519\"\nenv = \"O\"\n\
                    [keys.c1]\nalgorithm = \"ed25519\"\nenv = \"C1\"\n\
                    [keys.hook]\nalgorithm = \"hmac-sha256\"\nenv = \"H\"\n\
                    [plugins.vault]\npath = \"v.wasm\"\nkeys = [\"vault\", \"other\", \"c1\"]\n";
        let good = format!(
            "{keys}[pools.p]\nchannels = [\"c1\"]\n\
             [kinds.deposit]\nplugin = \"vault\"\npool = \"p\"\n[kinds.deposit.config]\nsigner_key = \"vault\"\n\
             [kinds.withdraw]\nplugin = \"vault\"\npool = \"p\"\n[kinds.withdraw.config]\nsigner_key = \"vault\"\n"
        );
        from_toml_str(&good).unwrap();
        let bad = format!(
            "{keys}[pools.p]\nchannels = [\"c1\", \"hook\", \"missing\"]\nretired = [\"stranger\"]\nfunder = \"nobody\"\n\
             [kinds.deposit]\nplugin = \"vault\"\npool = \"p\"\n[kinds.deposit.config]\nsigner_key = \"vault\"\n\
             [kinds.withdraw]\nplugin = \"vault\"\npool = \"p\"\n[kinds.withdraw.config]\nsigner_key = \"other\"\n\
             [kinds.rebalance]\nplugin = \"vault\"\npool = \"nope\"\n"
        );
        let err = from_toml_str(&bad).unwrap_err();
        let text = err.to_string();
        for expected in [
            "pools.p.channels: [keys.hook] is hmac-sha256, expected ed25519",
            "pools.p.channels: no [keys.missing] is configured",
            "pools.p.retired: \"stranger\" is not one of the pool's channels",
            "pools.p.funder: no [keys.nobody] is configured",
            "kinds.rebalance.pool: no [pools.nope] is configured",
            "kinds.withdraw.pool: pool \"p\" is shared with kinds.deposit, whose plugin or signer_key differs",
            "plugins.vault.keys must grant the pool's channels to sign with; missing hook, missing",
        ] {
            assert!(text.contains(expected), "{expected:?} missing from:\n{text}");
        }
        let lanes = format!(
            "{keys}[pools.p]\nchannels = [\"c1\", \"vault\"]\n\
             [kinds.deposit]\nplugin = \"vault\"\npool = \"p\"\nlanes = \"required\"\nlane_cap = 2\n\
             [kinds.deposit.config]\nsigner_key = \"vault\"\n"
        );
        let text = from_toml_str(&lanes).unwrap_err().to_string();
        for expected in [
            "kinds.deposit.lanes: expected \"plugin\"",
            "kinds.deposit.lane_cap: expected 1",
            "the kind's signer_key \"vault\" is one of the pool's channels",
        ] {
            assert!(text.contains(expected), "{expected:?} missing from:\n{text}");
        }
    }

    #[test]
    fn an_oracle_url_no_plugin_may_reach_is_suspect() {
        let config = from_toml_str(
            "[plugins.fees]\npath = \"f.wasm\"\n\
             [plugins.vault]\npath = \"v.wasm\"\nallowed_hosts = [\"https://rpc.example\"]\n",
        )
        .unwrap();
        assert_eq!(oracle_url_unlisted("https://rpc.example", &config.plugins), None);
        let why = oracle_url_unlisted("https://rpc.other.example", &config.plugins).unwrap();
        assert!(why.contains("allowed_hosts"), "{why}");
        assert!(
            oracle_url_unlisted("http://rpc.example", &config.plugins).is_some(),
            "scheme counts"
        );
    }

    #[test]
    fn unknown_env_keys_are_rejected_with_the_variable_path() {
        let err = load(
            &FileSource::Default(PathBuf::from("/nonexistent")),
            env(&[("LANEWAY_QUEUE__LEASE", "1")]),
        )
        .unwrap_err();
        assert_eq!(err.problems()[0].path, "queue.lease", "{err}");
    }
}
