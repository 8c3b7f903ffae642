//! Configuration: embedded defaults, then the config file, then `LANEWAY_*`
//! environment variables; unknown keys rejected; every problem reported at
//! once with its key path.
//!
//! Loading is split from validation so a reload can check a new config
//! completely before anything uses it.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::Deserialize;

pub use crate::lanes::LaneMode;
use crate::op::Priority;

/// The defaults, compiled in: the documented file is the defaults.
pub const DEFAULTS: &str = include_str!("../../../config/default.toml");

/// Environment variables with this prefix set config keys.
pub const ENV_PREFIX: &str = "LANEWAY_";

/// `LANEWAY_*` variables that are not config keys.
const ENV_RESERVED: [&str; 3] = ["LANEWAY_CONFIG", "LANEWAY_LOG", "LANEWAY_LOG_FORMAT"];

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
    /// How far a signature's time may be from now.
    pub clock_skew_ms: u64,
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

/// The process environment as UTF-8 pairs, for `LANEWAY_*` config keys.
/// Variables that are not UTF-8 cannot be config keys and are skipped.
pub fn process_env() -> Vec<(String, String)> {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect()
}

/// Where the config file comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileSource {
    /// Named explicitly: it must exist.
    Explicit(PathBuf),
    /// The default path: used if it exists.
    Default(PathBuf),
}

impl FileSource {
    /// The default config file, `./laneway.toml`.
    pub fn default_path() -> Self {
        FileSource::Default(PathBuf::from("laneway.toml"))
    }
}

/// Loads and validates the configuration from all three layers.
///
/// # Errors
///
/// [`ConfigError::Invalid`] with every problem found.
pub fn load(file: &FileSource, env: impl IntoIterator<Item = (String, String)>) -> Result<Config, ConfigError> {
    let mut problems = Vec::new();
    let mut merged = parse_table(DEFAULTS, "built-in defaults", &mut problems);

    let file_text = match file {
        FileSource::Explicit(path) => match std::fs::read_to_string(path) {
            Ok(text) => Some((text, path.clone())),
            Err(e) => {
                problems.push(Problem {
                    path: path.display().to_string(),
                    message: format!("cannot read config file: {e}"),
                });
                None
            }
        },
        FileSource::Default(path) => std::fs::read_to_string(path).ok().map(|t| (t, path.clone())),
    };
    if let Some((text, path)) = file_text {
        let table = parse_table(&text, &path.display().to_string(), &mut problems);
        merge(&mut merged, table);
    }
    let env: Vec<(String, String)> = env.into_iter().collect();
    merge(&mut merged, env_table(env.clone(), &mut problems));

    if !problems.is_empty() {
        return Err(ConfigError::Invalid(problems));
    }
    from_table(merged).map_err(|e| name_env_vars(e, &env))
}

/// A problem with a key an environment variable set names the variable, so
/// a stray or misspelt `LANEWAY_*` is found by its own name.
fn name_env_vars(error: ConfigError, env: &[(String, String)]) -> ConfigError {
    let ConfigError::Invalid(problems) = error;
    let from_env: Vec<(String, &str)> = env
        .iter()
        .filter(|(name, _)| !ENV_RESERVED.contains(&name.as_str()))
        .filter_map(|(name, _)| {
            let rest = name.strip_prefix(ENV_PREFIX)?;
            let path: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
            Some((path.join("."), name.as_str()))
        })
        .collect();
    let problems = problems
        .into_iter()
        .map(|mut p| {
            if let Some((_, name)) = from_env.iter().find(|(path, _)| *path == p.path) {
                p.message = format!("{} (set by the environment variable {name})", p.message);
            }
            p
        })
        .collect();
    ConfigError::Invalid(problems)
}

/// Loads only the defaults plus a TOML string (tests, examples).
///
/// # Errors
///
/// [`ConfigError::Invalid`] with every problem found.
pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
    from_layers(&[text])
}

/// Loads the defaults with TOML layers on top, later layers winning.
///
/// # Errors
///
/// [`ConfigError::Invalid`] with every problem found.
pub fn from_layers(layers: &[&str]) -> Result<Config, ConfigError> {
    let mut problems = Vec::new();
    let mut merged = parse_table(DEFAULTS, "built-in defaults", &mut problems);
    for (i, text) in layers.iter().enumerate() {
        let table = parse_table(text, &format!("config layer {}", i + 1), &mut problems);
        merge(&mut merged, table);
    }
    if !problems.is_empty() {
        return Err(ConfigError::Invalid(problems));
    }
    from_table(merged)
}

fn parse_table(text: &str, origin: &str, problems: &mut Vec<Problem>) -> toml::Table {
    match text.parse::<toml::Table>() {
        Ok(t) => t,
        Err(e) => {
            problems.push(Problem {
                path: origin.to_owned(),
                message: format!("not valid TOML: {}", e.message()),
            });
            toml::Table::new()
        }
    }
}

/// Turns `LANEWAY_A__B=value` into `{a = {b = value}}`. A value that parses as
/// a TOML value (number, boolean, array, quoted string) is taken as that;
/// anything else is a string.
fn env_table(env: impl IntoIterator<Item = (String, String)>, problems: &mut Vec<Problem>) -> toml::Table {
    let mut table = toml::Table::new();
    for (name, raw) in env {
        let Some(rest) = name.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        if ENV_RESERVED.contains(&name.as_str()) {
            continue;
        }
        let path: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
        if path.iter().any(String::is_empty) {
            problems.push(Problem {
                path: name.clone(),
                message: "environment variable does not name a key path (use LANEWAY_SECTION__KEY)".to_owned(),
            });
            continue;
        }
        let value = format!("v = {raw}")
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or(toml::Value::String(raw));
        if !insert_path(&mut table, &path, value) {
            problems.push(Problem {
                path: name.clone(),
                message: "sets a key inside a value that is not a table".to_owned(),
            });
        }
    }
    table
}

/// Sets `path` in `table`, creating intermediate tables; `false` when a
/// parent on the path is not a table.
fn insert_path(table: &mut toml::Table, path: &[String], value: toml::Value) -> bool {
    match path {
        [] => false,
        [last] => {
            table.insert(last.clone(), value);
            true
        }
        [first, rest @ ..] => match table
            .entry(first.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        {
            toml::Value::Table(inner) => insert_path(inner, rest, value),
            _ => false,
        },
    }
}

/// Deep-merges `over` into `base`; tables merge, anything else replaces.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(key, v);
            }
        }
    }
}

fn from_table(mut table: toml::Table) -> Result<Config, ConfigError> {
    let mut problems = Vec::new();
    let database = section::<DatabaseConfig>(&mut table, "database", &mut problems);
    let queue = section::<QueueConfig>(&mut table, "queue", &mut problems);
    let dispatch = section::<DispatchConfig>(&mut table, "dispatch", &mut problems);
    let runtime = section::<RuntimeConfig>(&mut table, "runtime", &mut problems);
    let api = section::<ApiConfig>(&mut table, "api", &mut problems);
    let retention = section::<RetentionConfig>(&mut table, "retention", &mut problems);
    let outcomes = section::<OutcomesConfig>(&mut table, "outcomes", &mut problems);
    let destinations = section::<DestinationsConfig>(&mut table, "destinations", &mut problems);
    let inbound = section::<InboundConfig>(&mut table, "inbound", &mut problems);
    let plugins = named_tables::<PluginConfig>(&mut table, "plugins", &mut problems);
    let keys = named_tables::<crate::keys::KeySource>(&mut table, "keys", &mut problems);
    let oracles = named_tables::<OracleConfig>(&mut table, "oracles", &mut problems);
    let mut kinds = BTreeMap::new();
    match table.remove("kinds") {
        Some(toml::Value::Table(kind_tables)) => {
            for (name, value) in kind_tables {
                let path = format!("kinds.{name}");
                if let Some(kind) = typed::<KindConfig>(value, &path, &mut problems) {
                    kinds.insert(name, kind);
                }
            }
        }
        Some(_) => problems.push(Problem {
            path: "kinds".to_owned(),
            message: "expected a table of kinds".to_owned(),
        }),
        None => {}
    }
    for key in table.keys() {
        problems.push(Problem {
            path: key.clone(),
            message:
                "unknown key (expected one of: database, queue, dispatch, runtime, api, retention, outcomes, destinations, inbound, plugins, keys, oracles, kinds)"
                    .to_owned(),
        });
    }
    if let (
        Some(database),
        Some(queue),
        Some(dispatch),
        Some(runtime),
        Some(api),
        Some(retention),
        Some(outcomes),
        Some(destinations),
        Some(inbound),
    ) = (
        database,
        queue,
        dispatch,
        runtime,
        api,
        retention,
        outcomes,
        destinations,
        inbound,
    ) {
        let config = Config {
            database,
            queue,
            dispatch,
            runtime,
            api,
            retention,
            outcomes,
            destinations,
            inbound,
            plugins,
            keys,
            oracles,
            kinds,
        };
        problems.extend(validate(&config));
        if problems.is_empty() {
            return Ok(config);
        }
    }
    problems.sort_by(|a, b| a.path.cmp(&b.path));
    Err(ConfigError::Invalid(problems))
}

/// A table of named sub-tables (`[plugins.NAME]`), each deserialized alone.
fn named_tables<T: DeserializeOwned>(
    table: &mut toml::Table,
    key: &str,
    problems: &mut Vec<Problem>,
) -> BTreeMap<String, T> {
    let mut out = BTreeMap::new();
    match table.remove(key) {
        Some(toml::Value::Table(entries)) => {
            for (name, value) in entries {
                if let Some(v) = typed::<T>(value, &format!("{key}.{name}"), problems) {
                    out.insert(name, v);
                }
            }
        }
        Some(_) => problems.push(Problem {
            path: key.to_owned(),
            message: format!("expected a table of {key}"),
        }),
        None => {}
    }
    out
}

fn section<T: DeserializeOwned>(table: &mut toml::Table, key: &str, problems: &mut Vec<Problem>) -> Option<T> {
    match table.remove(key) {
        Some(value) => typed(value, key, problems),
        None => {
            problems.push(Problem {
                path: key.to_owned(),
                message: "missing section".to_owned(),
            });
            None
        }
    }
}

/// Deserializes one value, recording a type error with its full path and
/// every unknown key beneath it (not only the first).
fn typed<T: DeserializeOwned>(value: toml::Value, prefix: &str, problems: &mut Vec<Problem>) -> Option<T> {
    let mut unknown = Vec::new();
    let result: Result<T, _> = {
        let mut record = |path: serde_ignored::Path<'_>| unknown.push(path.to_string());
        let de = serde_ignored::Deserializer::new(value, &mut record);
        serde_path_to_error::deserialize(de)
    };
    let join = |inner: &str| {
        if inner.is_empty() || inner == "." {
            prefix.to_owned()
        } else {
            format!("{prefix}.{inner}")
        }
    };
    for path in &unknown {
        problems.push(Problem {
            path: join(path),
            message: "unknown key".to_owned(),
        });
    }
    match result {
        Ok(v) => Some(v),
        Err(e) => {
            let path = join(&e.path().to_string());
            problems.push(Problem {
                path,
                message: e.into_inner().to_string(),
            });
            None
        }
    }
}

/// Checks values that parse but make no sense.
fn validate(config: &Config) -> Vec<Problem> {
    let mut problems = Vec::new();
    let mut bad = |path: &str, message: String| {
        problems.push(Problem {
            path: path.to_owned(),
            message,
        })
    };
    let url = &config.database.url;
    if !(url.starts_with("sqlite:") || url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        bad(
            "database.url",
            format!(
                "expected sqlite:FILE or postgres://…, got {:?}",
                crate::queue::redact_url(url)
            ),
        );
    }
    if config.database.max_connections == 0 {
        bad("database.max_connections", "expected at least 1".to_owned());
    }
    if config.database.connect_timeout_ms == 0 {
        bad("database.connect_timeout_ms", "expected at least 1".to_owned());
    }
    const MAX_PAYLOAD: usize = 64 * 1024 * 1024;
    if !(1..=MAX_PAYLOAD).contains(&config.queue.max_payload_bytes) {
        bad(
            "queue.max_payload_bytes",
            format!("expected 1 to {MAX_PAYLOAD}, got {}", config.queue.max_payload_bytes),
        );
    }
    if config.queue.lease_ms < 1000 {
        bad(
            "queue.lease_ms",
            format!(
                "expected at least 1000 (a lease shorter than a second expires under load), got {}",
                config.queue.lease_ms
            ),
        );
    }
    if !(1..=10_000).contains(&config.queue.claim_batch) {
        bad(
            "queue.claim_batch",
            format!("expected 1 to 10000, got {}", config.queue.claim_batch),
        );
    }
    let d = &config.dispatch;
    let positive: [(&str, u64); 8] = [
        ("dispatch.poll_ms", d.poll_ms),
        ("dispatch.max_in_flight", d.max_in_flight as u64),
        ("dispatch.outbox_max_in_flight", d.outbox_max_in_flight as u64),
        ("dispatch.window", u64::from(d.window)),
        ("dispatch.in_pass_attempts", u64::from(d.in_pass_attempts)),
        ("dispatch.shutdown_grace_ms", d.shutdown_grace_ms),
        ("dispatch.breaker.threshold", u64::from(d.breaker.threshold)),
        ("dispatch.breaker.cool_off_ms", d.breaker.cool_off_ms),
    ];
    for (path, value) in positive {
        if value == 0 {
            bad(path, "expected at least 1".to_owned());
        }
    }
    if config.database.sqlite.watch_ms > 10_000 {
        bad(
            "database.sqlite.watch_ms",
            format!("expected 0 (off) to 10000, got {}", config.database.sqlite.watch_ms),
        );
    }
    if d.slot_ttl_ms < 1000 {
        bad(
            "dispatch.slot_ttl_ms",
            format!("expected at least 1000, got {}", d.slot_ttl_ms),
        );
    }
    let api = &config.api;
    if !api.listen.is_empty() && api.listen.parse::<std::net::SocketAddr>().is_err() {
        bad(
            "api.listen",
            format!(
                "expected HOST:PORT with an IP address (e.g. 127.0.0.1:7480) or \"\" for no API, got {:?}",
                api.listen
            ),
        );
    }
    for (path, value, max) in [
        ("api.max_body_bytes", api.max_body_bytes as u64, 64 * 1024 * 1024),
        ("api.max_page", u64::from(api.max_page), 10_000),
        ("api.recover_per_second", u64::from(api.recover_per_second), 100_000),
        ("api.public_per_second", u64::from(api.public_per_second), 100_000),
    ] {
        if !(1..=max).contains(&value) {
            bad(path, format!("expected 1 to {max}, got {value}"));
        }
    }
    let r = &config.retention;
    // A retention shorter than the lease could prune an op whose outcome a
    // stalled dispatcher has yet to record.
    let lease = config.queue.lease_ms;
    let short = |value: u64| value != 0 && value < lease;
    for (path, value) in [
        ("retention.confirmed_ms", r.confirmed_ms),
        ("retention.cancelled_ms", r.cancelled_ms),
        ("retention.failed_ms", r.failed_ms),
        ("retention.idempotency_ms", r.idempotency_ms),
    ] {
        if short(value) {
            bad(
                path,
                format!("expected 0 (forever) or at least queue.lease_ms ({lease}), got {value}"),
            );
        }
    }
    for entry in &config.outcomes.allowed_hosts {
        if let Err(e) = crate::egress::HostPattern::parse(entry) {
            bad("outcomes.allowed_hosts", e);
        }
    }
    let d = &config.destinations;
    if d.probe_every_ms < 1000 {
        bad(
            "destinations.probe_every_ms",
            format!("expected at least 1000 (one probe a second), got {}", d.probe_every_ms),
        );
    }
    if d.unavailable_after_ms == 0 {
        bad(
            "destinations.unavailable_after_ms",
            "expected more than 0 (one failure would suspend a host)".to_owned(),
        );
    }
    if !(d.rate_per_second.is_finite() && d.rate_per_second >= 0.0) {
        bad(
            "destinations.rate_per_second",
            format!("expected 0 (unlimited) or a positive number, got {}", d.rate_per_second),
        );
    }
    if d.rate_burst == 0 {
        bad("destinations.rate_burst", "expected at least 1".to_owned());
    }
    let inbound = &config.inbound;
    for entry in &inbound.allowed_hosts {
        if let Err(e) = crate::egress::HostPattern::parse(entry) {
            bad("inbound.allowed_hosts", e);
        }
    }
    for entry in &inbound.allowed_internal {
        if let Err(e) = crate::egress::Cidr::parse(entry) {
            bad("inbound.allowed_internal", e);
        }
    }
    if !inbound.public_url.is_empty()
        && !reqwest::Url::parse(&inbound.public_url).is_ok_and(|u| matches!(u.scheme(), "http" | "https"))
    {
        bad(
            "inbound.public_url",
            format!("expected an http(s) URL or empty, got {:?}", inbound.public_url),
        );
    }
    if inbound.enabled {
        match config.kinds.get(&inbound.kind) {
            None => bad(
                "inbound.kind",
                format!("{:?} is not a configured kind ([kinds.{}])", inbound.kind, inbound.kind),
            ),
            Some(kind) if kind.plugin.is_none() => bad(
                &format!("kinds.{}.plugin", inbound.kind),
                "inbound activities need a handler plugin (the shipped `webhook`, for one)".to_owned(),
            ),
            Some(_) => {}
        }
        if config.api.listen.is_empty() {
            bad(
                "inbound.enabled",
                "the inboxes are served on the API listener, but api.listen is empty".to_owned(),
            );
        }
    }
    if config.outcomes.relay_every_ms < 10 {
        bad(
            "outcomes.relay_every_ms",
            format!("expected at least 10, got {}", config.outcomes.relay_every_ms),
        );
    }
    if r.every_ms < 100 {
        bad(
            "retention.every_ms",
            format!("expected at least 100, got {}", r.every_ms),
        );
    }
    if !(1..=10_000).contains(&r.batch) {
        bad("retention.batch", format!("expected 1 to 10000, got {}", r.batch));
    }
    for (name, kind) in &config.kinds {
        let path = |key: &str| format!("kinds.{name}.{key}");
        for (key, value) in [
            ("retention_confirmed_ms", kind.retention_confirmed_ms),
            ("retention_cancelled_ms", kind.retention_cancelled_ms),
            ("retention_failed_ms", kind.retention_failed_ms),
            ("idempotency_retention_ms", kind.idempotency_retention_ms),
        ] {
            if let Some(value) = value.filter(|v| short(*v)) {
                bad(
                    &path(key),
                    format!("expected 0 (forever) or at least queue.lease_ms ({lease}), got {value}"),
                );
            }
        }
        match (&kind.outcome_webhook, &kind.outcome_webhook_key) {
            (Some(url), key) => {
                if let Some(why) = webhook_url_refused(url, &config.outcomes.allowed_hosts) {
                    bad(&path("outcome_webhook"), why);
                }
                match key.as_ref().map(|k| (k, config.keys.get(k))) {
                    None => bad(
                        &path("outcome_webhook_key"),
                        "expected the [keys.ID] that signs this kind's webhooks".to_owned(),
                    ),
                    Some((k, None)) => bad(&path("outcome_webhook_key"), format!("no [keys.{k}] is configured")),
                    Some((k, Some(source))) if source.algorithm != crate::keys::Algorithm::HmacSha256 => bad(
                        &path("outcome_webhook_key"),
                        format!("[keys.{k}] is {}, expected hmac-sha256", source.algorithm),
                    ),
                    Some(_) => {}
                }
                if name == WEBHOOK_KIND {
                    bad(
                        &path("outcome_webhook"),
                        "the webhook kind's own outcomes are not sent on".to_owned(),
                    );
                }
            }
            (None, Some(_)) => bad(&path("outcome_webhook_key"), "set only with outcome_webhook".to_owned()),
            (None, None) => {}
        }
        if name == WEBHOOK_KIND && kind.plugin.is_some() {
            bad(&path("plugin"), "laneway delivers this kind itself".to_owned());
        }
        if let Some(dir) = &kind.archive {
            let at = std::path::Path::new(dir);
            if dir.trim().is_empty() {
                bad(&path("archive"), "expected a directory path".to_owned());
            } else if at.exists() && !at.is_dir() {
                bad(&path("archive"), format!("{dir:?} exists and is not a directory"));
            }
        }
        if kind.lane_cap == 0 {
            bad(&path("lane_cap"), "expected at least 1".to_owned());
        }
        if kind.max_in_flight == Some(0) {
            bad(
                &path("max_in_flight"),
                "expected at least 1 (leave it out for no cap)".to_owned(),
            );
        }
        if kind.max_attempts == 0 {
            bad(&path("max_attempts"), "expected at least 1".to_owned());
        }
        if kind.fault_attempts == 0 {
            bad(&path("fault_attempts"), "expected at least 1".to_owned());
        }
        if kind.timeout_ms == 0 {
            bad(&path("timeout_ms"), "expected at least 1".to_owned());
        }
        if kind.backoff_base_ms > kind.backoff_max_ms {
            bad(
                &path("backoff_base_ms"),
                format!(
                    "expected at most backoff_max_ms ({}), got {}",
                    kind.backoff_max_ms, kind.backoff_base_ms
                ),
            );
        }
        if kind.poison == Poison::Halt && kind.lane_mode == LaneMode::Serial {
            bad(
                &path("poison"),
                "\"halt\" applies to strict lanes; this kind's lanes are serial".to_owned(),
            );
        }
    }
    let r = &config.runtime;
    for (path, value) in [
        ("runtime.max_instances", u64::from(r.max_instances)),
        ("runtime.epoch_tick_ms", r.epoch_tick_ms),
        ("runtime.quarantine_after", u64::from(r.quarantine_after)),
    ] {
        if value == 0 {
            bad(path, "expected at least 1".to_owned());
        }
    }
    if !(64..=8192).contains(&r.max_wasm_stack_kib) {
        bad(
            "runtime.max_wasm_stack_kib",
            format!("expected 64 to 8192, got {}", r.max_wasm_stack_kib),
        );
    }
    for (name, plugin) in &config.plugins {
        let path = |key: &str| format!("plugins.{name}.{key}");
        if !(1..=4096).contains(&plugin.memory_mib) {
            bad(
                &path("memory_mib"),
                format!("expected 1 to 4096, got {}", plugin.memory_mib),
            );
        }
        for (key, value) in [
            ("timeout_ms", plugin.timeout_ms),
            ("fuel", plugin.fuel),
            ("connect_timeout_ms", plugin.connect_timeout_ms),
            ("request_timeout_ms", plugin.request_timeout_ms),
            ("max_response_bytes", plugin.max_response_bytes),
            ("max_connections", u64::from(plugin.max_connections)),
        ] {
            if value == 0 {
                bad(&path(key), "expected at least 1".to_owned());
            }
        }
        for entry in &plugin.allowed_hosts {
            if let Err(e) = crate::egress::HostPattern::parse(entry) {
                bad(&path("allowed_hosts"), e);
            }
        }
        for entry in &plugin.allowed_internal {
            if let Err(e) = crate::egress::Cidr::parse(entry) {
                bad(&path("allowed_internal"), e);
            }
        }
        for key in &plugin.keys {
            if !config.keys.contains_key(key) {
                bad(&path("keys"), format!("no [keys.{key}] is configured"));
            }
        }
    }
    for (id, key) in &config.keys {
        if key.file.is_some() == key.env.is_some() {
            bad(
                &format!("keys.{id}"),
                "give exactly one of `file` or `env` (never the key itself)".to_owned(),
            );
        }
    }
    for (name, oracle) in &config.oracles {
        let path = |key: &str| format!("oracles.{name}.{key}");
        if !config.plugins.contains_key(&oracle.policy) {
            bad(&path("policy"), format!("no [plugins.{}] is configured", oracle.policy));
        }
        if !(oracle.rpc_url.starts_with("https://") || oracle.rpc_url.starts_with("http://")) {
            bad(
                &path("rpc_url"),
                format!("expected an http(s) URL, got {:?}", oracle.rpc_url),
            );
        }
        if oracle.poll_ms < 100 {
            bad(
                &path("poll_ms"),
                format!("expected at least 100, got {}", oracle.poll_ms),
            );
        }
        if oracle.timeout_ms == 0 {
            bad(&path("timeout_ms"), "expected at least 1".to_owned());
        }
    }
    for (name, kind) in &config.kinds {
        if let Some(plugin) = &kind.plugin {
            if !config.plugins.contains_key(plugin) {
                bad(
                    &format!("kinds.{name}.plugin"),
                    format!("no [plugins.{plugin}] is configured"),
                );
            }
        }
        if let Some(oracle) = &kind.fee_oracle {
            if !config.oracles.contains_key(oracle) {
                bad(
                    &format!("kinds.{name}.fee_oracle"),
                    format!("no [oracles.{oracle}] is configured"),
                );
            }
        }
    }
    for name in config.kinds.keys() {
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
            bad(
                &format!("kinds.{name}"),
                "kind names are letters, digits, '_' and '-'".to_owned(),
            );
        }
    }
    problems
}

/// Why an oracle's RPC URL is suspect: the host polls it itself, but the
/// chain kinds it prices reach their RPC through a plugin's allow-list, so an
/// oracle URL that no plugin may reach is a typo or another network's node,
/// and its quotes would price the wrong network. Checked where plugins are
/// loaded, so it is reported together with the kinds' own problems.
/// Why a webhook URL cannot be used, if it cannot.
fn webhook_url_refused(url: &str, allowed: &[String]) -> Option<String> {
    let Ok(parsed) = reqwest::Url::parse(url) else {
        return Some(format!("expected an http(s) URL, got {url:?}"));
    };
    let (Some(host), Some(port)) = (parsed.host_str(), parsed.port_or_known_default()) else {
        return Some(format!("expected an http(s) URL with a host, got {url:?}"));
    };
    if !matches!(parsed.scheme(), "http" | "https") {
        return Some(format!("expected an http(s) URL, got {url:?}"));
    }
    let listed = crate::egress::listed(allowed, parsed.scheme(), host, port);
    (!listed).then(|| format!("{}://{host}:{port} is not in outcomes.allowed_hosts", parsed.scheme()))
}

pub fn oracle_url_unlisted(rpc_url: &str, plugins: &BTreeMap<String, PluginConfig>) -> Option<String> {
    let url = reqwest::Url::parse(rpc_url).ok()?;
    let (host, port) = (url.host_str()?, url.port_or_known_default()?);
    let listed = plugins
        .values()
        .any(|p| crate::egress::listed(&p.allowed_hosts, url.scheme(), host, port));
    (!listed).then(|| {
        format!(
            "{}://{host}:{port} is in no plugin's allowed_hosts; list it on the executor plugin whose kinds this \
             oracle prices (an oracle polling another network quotes the wrong fees)",
            url.scheme()
        )
    })
}

impl Config {
    /// The queue limits this config sets.
    pub fn limits(&self) -> crate::queue::Limits {
        crate::queue::Limits {
            max_payload_bytes: self.queue.max_payload_bytes,
            shared_payload_bytes: self.queue.shared_payload_bytes,
        }
    }

    /// Every kind's default priority, for plain-SQL producers (the
    /// database's `kind_defaults`).
    pub fn kind_defaults(&self) -> Vec<(String, Priority)> {
        self.kinds
            .iter()
            .map(|(name, kind)| (name.clone(), kind.priority))
            .collect()
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

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn a_stray_environment_variable_is_named_in_its_error() {
        let err = load(
            &FileSource::Default(PathBuf::from("/nonexistent/laneway.toml")),
            env(&[
                ("LANEWAY_DATABASE_URL", "postgres://u@h/db"),
                ("LANEWAY_LOG_FORMAT", "json"),
            ]),
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("database_url"), "{text}");
        assert!(text.contains("LANEWAY_DATABASE_URL"), "{text}");
        assert!(
            !text.contains("LANEWAY_LOG_FORMAT"),
            "a reserved variable is not a key: {text}"
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
