//! What a plugin's store holds during one call: an empty WASI context, the
//! memory limiter, the plugin's granted services, and the attempt's
//! checkpoint and fee quote.

use std::collections::HashSet;
use std::sync::Arc;

use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::failure::MemoryLimitExceeded;
use crate::executor::{Attempt, Checkpoint};
use crate::fees::FeeBid;
use crate::keys::KeyStore;

/// What a plugin may use, shared by all its calls.
pub struct Services {
    /// The plugin's name (for logs and metrics).
    pub plugin: String,
    /// Short content digest of the component (its version, for operators).
    pub digest: String,
    /// Its HTTP client: its egress policy, pool, limits and resolver.
    pub http: crate::egress::Guarded,
    /// Limits concurrent requests.
    pub http_permits: Arc<tokio::sync::Semaphore>,
    /// How long to wait for a connection slot.
    pub connect_timeout: std::time::Duration,
    /// Largest response body.
    pub max_response_bytes: u64,
    /// The host's keys.
    pub keys: Arc<KeyStore>,
    /// The key ids granted to this plugin.
    pub granted_keys: HashSet<String>,
    /// Log lines per call.
    pub log_lines_per_call: u32,
}

impl std::fmt::Debug for Services {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Services")
            .field("plugin", &self.plugin)
            .field("digest", &self.digest)
            .field("granted_keys", &self.granted_keys)
            .finish_non_exhaustive()
    }
}

/// A clock that never moves: policies get time as an argument, never from WASI.
struct StoppedClock;

impl wasmtime_wasi::HostWallClock for StoppedClock {
    fn resolution(&self) -> std::time::Duration {
        std::time::Duration::from_secs(1)
    }

    fn now(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
}

impl wasmtime_wasi::HostMonotonicClock for StoppedClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }

    fn now(&self) -> u64 {
        0
    }
}

/// Caps linear memory with a typed error, so running out is classified as
/// such rather than as whatever the guest's allocator does next.
#[derive(Debug)]
pub struct Limiter {
    /// Bytes any one memory may grow to.
    pub max_memory: usize,
    /// The largest memory seen this call.
    pub peak: usize,
}

impl wasmtime::ResourceLimiter for Limiter {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.max_memory {
            return Err(wasmtime::Error::new(MemoryLimitExceeded {
                requested: desired,
                max: self.max_memory,
            }));
        }
        self.peak = self.peak.max(desired);
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 1_000_000)
    }
}

/// The data of one call's store.
pub struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    /// Memory cap.
    pub limiter: Limiter,
    /// The plugin's services.
    pub services: Arc<Services>,
    /// Where `checkpoint.save` writes, when an op is being executed.
    pub checkpoint: Option<Arc<dyn Checkpoint>>,
    /// What `fees.current` answers: the attempt's quote, if any.
    pub fee: Option<FeeBid>,
    /// Where `fees.spent` reports what the attempt paid.
    pub spent: Option<Arc<crate::executor::SpentFee>>,
    /// The op being executed, for logs.
    pub op_id: Option<i64>,
    /// The first thing the plugin was denied this call: a denial decides the
    /// outcome whatever the plugin returns afterwards.
    pub denied: Option<String>,
    /// Log lines written this call.
    pub log_lines: u32,
    /// A `validate-config` call: the plugin probes its grants (a key, a URL)
    /// to report what its config gets wrong, so a refusal is an answer, not
    /// a denial that fails the call.
    pub probing: bool,
    /// Where `notes` reads and writes, when an op is being executed.
    pub notes: Option<Arc<dyn crate::executor::Notes>>,
    /// Notes written in this call (capped per call).
    pub notes_written: u32,
}

impl HostState {
    /// State for one call. WASI is linked with an empty context: no
    /// preopened directories, environment, arguments or inherited stdio.
    /// A `deterministic` context (fee policies) also has clocks stopped at
    /// the epoch and a fixed insecure-random seed, so a quote depends only
    /// on its arguments, time included.
    pub fn new(
        services: Arc<Services>,
        max_memory: usize,
        attempt: Option<Attempt>,
        op_id: Option<i64>,
        deterministic: bool,
    ) -> Self {
        let (checkpoint, fee, spent, notes) = attempt.map_or((None, None, None, None), |a| {
            (Some(a.checkpoint), a.fee, Some(a.spent), a.notes)
        });
        let mut wasi = WasiCtx::builder();
        if deterministic {
            wasi.wall_clock(StoppedClock)
                .monotonic_clock(StoppedClock)
                .insecure_random_seed(0);
        }
        Self {
            wasi: wasi.build(),
            table: ResourceTable::new(),
            limiter: Limiter { max_memory, peak: 0 },
            services,
            checkpoint,
            fee,
            spent,
            op_id,
            denied: None,
            log_lines: 0,
            probing: false,
            notes,
            notes_written: 0,
        }
    }

    /// Records a denial (the first one wins) and returns its text.
    pub fn deny(&mut self, what: String) -> String {
        if self.probing {
            return what;
        }
        tracing::warn!(plugin = %self.services.plugin, op = ?self.op_id, denied = %what, "Plugin was denied a host capability.");
        self.denied.get_or_insert(what).clone()
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}
