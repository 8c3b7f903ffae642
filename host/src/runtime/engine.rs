//! The wasmtime engines: one for executors (epoch deadlines) and one for fee
//! policies (epoch deadlines and fuel, which is an engine-wide setting and
//! costs executors speed they do not need), each with the pooling allocator,
//! and the epoch ticker that makes deadlines work.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use crate::config::RuntimeConfig;

/// Which engine a component is compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// Executors: no fuel.
    Executor,
    /// Fee policies: fuel-metered.
    Policy,
}

/// The engines and their ticker.
#[derive(Clone)]
pub struct Engines {
    executor: Engine,
    policy: Engine,
    /// Each engine's instance slots (`runtime.max_instances`): a call waits
    /// for one before its store is made, rather than instantiate past the
    /// pool, which traps and would count against the plugin as a crash.
    executor_slots: Arc<Semaphore>,
    policy_slots: Arc<Semaphore>,
    /// Whether the pooling allocator could be used (else on-demand).
    pub pooling: bool,
}

impl std::fmt::Debug for Engines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engines")
            .field("pooling", &self.pooling)
            .finish_non_exhaustive()
    }
}

/// Largest memory any plugin may be given, which sizes pooling slots; each
/// plugin's own (smaller) cap is enforced per call by its limiter.
pub const MAX_PLUGIN_MEMORY: usize = 4096 * 1024 * 1024;

fn base_config(fuel: bool, max_stack: usize) -> Config {
    let mut config = Config::new();
    config
        .wasm_component_model(true)
        .epoch_interruption(true)
        .consume_fuel(fuel)
        .max_wasm_stack(max_stack);
    config
}

/// The on-disk cache of compiled plugins, if configured and usable; a cache
/// that cannot be set up costs compile time only, so it is logged, not fatal.
fn compile_cache(runtime: &RuntimeConfig) -> Option<wasmtime::Cache> {
    if !runtime.compile_cache {
        return None;
    }
    let mut config = wasmtime::CacheConfig::new();
    if !runtime.compile_cache_dir.is_empty() {
        config.with_directory(&runtime.compile_cache_dir);
    }
    match wasmtime::Cache::new(config) {
        Ok(cache) => Some(cache),
        Err(e) => {
            tracing::warn!(error = %e, "Compiled-plugin cache unavailable; plugins are compiled at every load.");
            None
        }
    }
}

/// How much of each plugin memory and table a pooling slot keeps resident
/// between calls: the pages a call dirtied are restored in place (found by
/// the kernel's `PAGEMAP_SCAN` where it has it) instead of being handed back
/// with `madvise`, which cost every call copy-on-write faults and a TLB
/// shootdown on every core (the ActivityPub bench: 0.2-0.3 ms of CPU per
/// delivery; peak RSS +10-15 MB with 256 calls in flight).
const KEEP_RESIDENT: usize = 2 << 20;

fn pooling(runtime: &RuntimeConfig) -> PoolingAllocationConfig {
    let mut pool = PoolingAllocationConfig::new();
    let n = runtime.max_instances;
    pool.total_component_instances(n)
        .total_core_instances(n.saturating_mul(4))
        .total_memories(n.saturating_mul(2))
        .total_tables(n.saturating_mul(4))
        .total_stacks(n)
        .max_memories_per_component(2)
        .max_tables_per_component(4)
        .max_memory_size(MAX_PLUGIN_MEMORY)
        .max_component_instance_size(4 << 20)
        .linear_memory_keep_resident(KEEP_RESIDENT)
        .table_keep_resident(KEEP_RESIDENT)
        .pagemap_scan(wasmtime::Enabled::Auto);
    pool
}

impl Engines {
    /// Builds both engines, falling back to on-demand allocation when the
    /// pooling allocator cannot reserve its address space (small hosts).
    ///
    /// # Errors
    ///
    /// wasmtime's error when neither strategy works.
    pub fn new(runtime: &RuntimeConfig) -> wasmtime::Result<Self> {
        let stack = usize::try_from(runtime.max_wasm_stack_kib).unwrap_or(1024) * 1024;
        let cache = compile_cache(runtime);
        let build = |fuel: bool, pool: bool| {
            let mut config = base_config(fuel, stack);
            config.cache(cache.clone());
            if pool {
                config.allocation_strategy(InstanceAllocationStrategy::Pooling(pooling(runtime)));
            }
            Engine::new(&config)
        };
        let (executor, policy, pooling) = match (build(false, true), build(true, true)) {
            (Ok(e), Ok(p)) => (e, p, true),
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(error = %e, "Pooling allocator unavailable; using on-demand instance allocation.");
                (build(false, false)?, build(true, false)?, false)
            }
        };
        let slots = usize::try_from(runtime.max_instances).unwrap_or(usize::MAX);
        let engines = Self {
            executor,
            policy,
            executor_slots: Arc::new(Semaphore::new(slots)),
            policy_slots: Arc::new(Semaphore::new(slots)),
            pooling,
        };
        engines.start_ticker(Duration::from_millis(runtime.epoch_tick_ms));
        Ok(engines)
    }

    /// The engine for `kind`.
    pub fn get(&self, kind: EngineKind) -> &Engine {
        match kind {
            EngineKind::Executor => &self.executor,
            EngineKind::Policy => &self.policy,
        }
    }

    /// The instance slots of the engine for `kind`.
    pub fn slots(&self, kind: EngineKind) -> &Arc<Semaphore> {
        match kind {
            EngineKind::Executor => &self.executor_slots,
            EngineKind::Policy => &self.policy_slots,
        }
    }

    /// Advances both engines' epochs every `tick` on a thread that holds only
    /// weak references, so it ends when the engines are dropped.
    fn start_ticker(&self, tick: Duration) {
        let weak = [self.executor.weak(), self.policy.weak()];
        let spawned = std::thread::Builder::new()
            .name("laneway-epoch".into())
            .spawn(move || loop {
                std::thread::sleep(tick);
                let mut alive = false;
                for engine in weak.iter().filter_map(wasmtime::EngineWeak::upgrade) {
                    engine.increment_epoch();
                    alive = true;
                }
                if !alive {
                    return;
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "Cannot start the epoch ticker; plugin deadlines rely on the outer timeout only.");
        }
    }
}
