//! The WebAssembly plugin runtime, and the only module that touches
//! wasmtime.
//!
//! One engine per world kind (executors; fuel-metered fee policies), one
//! linker per world, one `InstancePre` per loaded plugin version, and a fresh
//! `Store` per call with an empty WASI context, a memory limiter and an epoch
//! deadline. Plugins reach the outside only through the host imports in
//! [`imports`], which enforce each plugin's grants.

pub mod bindings;
pub mod engine;
pub mod executor;
pub mod failure;
pub mod host;
pub mod imports;
pub mod pacing;
pub mod plugin;
pub mod policy;
pub mod state;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use sha2::Digest as _;
use wasmtime::component::{Component, HasSelf, Linker};

use crate::config::{PluginConfig, RuntimeConfig};
use crate::egress::Egress;
use crate::keys::KeyStore;
use engine::{EngineKind, Engines};
use failure::PluginFailure;
use plugin::{CallLimits, Health, Inspection, Plugin};
use state::{HostState, Services};

/// Engines and linkers, shared by every plugin; cheap to clone.
#[derive(Clone)]
pub struct Runtime {
    engines: Engines,
    /// How often the engines' epochs advance: the unit of guest pacing.
    epoch_tick: std::time::Duration,
    executor_linker: Arc<Linker<HostState>>,
    policy_linker: Arc<Linker<HostState>>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("engines", &self.engines)
            .finish_non_exhaustive()
    }
}

/// A stable digest of a component's bytes (hex SHA-256, first 16 chars).
pub fn digest(bytes: &[u8]) -> String {
    let full = sha2::Sha256::digest(bytes);
    full.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

impl Runtime {
    /// Builds the engines and linkers.
    ///
    /// # Errors
    ///
    /// wasmtime's error if no engine can be created.
    pub fn new(config: &RuntimeConfig) -> wasmtime::Result<Self> {
        let engines = Engines::new(config)?;
        let mut executor_linker = Linker::new(engines.get(EngineKind::Executor));
        wasmtime_wasi::p2::add_to_linker_async(&mut executor_linker)?;
        bindings::executor::ExecutorPlugin::add_to_linker::<_, HasSelf<_>>(&mut executor_linker, |s| s)?;
        let mut policy_linker = Linker::new(engines.get(EngineKind::Policy));
        wasmtime_wasi::p2::add_to_linker_async(&mut policy_linker)?;
        bindings::fee_policy::FeePolicyPlugin::add_to_linker::<_, HasSelf<_>>(&mut policy_linker, |s| s)?;
        Ok(Self {
            engines,
            epoch_tick: std::time::Duration::from_millis(config.epoch_tick_ms),
            executor_linker: Arc::new(executor_linker),
            policy_linker: Arc::new(policy_linker),
        })
    }

    /// Whether the pooling allocator is in use.
    pub fn pooling(&self) -> bool {
        self.engines.pooling
    }

    /// Compiles and checks a component without granting it anything (for
    /// `laneway plugin check`).
    ///
    /// # Errors
    ///
    /// [`PluginFailure::Incompatible`] with the reason.
    pub fn inspect(&self, bytes: &[u8]) -> Result<Inspection, PluginFailure> {
        plugin::inspect(self, |kind| self.compile(bytes, kind)).map(|(i, _)| i)
    }

    fn compile(&self, bytes: &[u8], kind: EngineKind) -> Result<Component, PluginFailure> {
        Component::new(self.engines.get(kind), bytes)
            .map_err(|e| PluginFailure::Incompatible(format!("not a valid WebAssembly component: {e:#}")))
    }

    /// Compiles a component and checks it against its world. CPU heavy: call
    /// it off the async runtime.
    ///
    /// # Errors
    ///
    /// [`PluginFailure::Incompatible`] when the component cannot be used.
    pub fn compile_checked(&self, bytes: &[u8]) -> Result<(Inspection, Component), PluginFailure> {
        plugin::inspect(self, |kind| self.compile(bytes, kind))
    }

    /// Pre-instantiates a checked component with the grants `config` gives.
    ///
    /// # Errors
    ///
    /// [`PluginFailure::Incompatible`] naming the setting or the type error.
    #[allow(clippy::too_many_arguments)]
    pub fn instantiate(
        &self,
        name: &str,
        digest: String,
        inspection: Inspection,
        component: &Component,
        config: &PluginConfig,
        keys: Arc<KeyStore>,
        health: Arc<Health>,
        quarantine_after: u32,
    ) -> Result<Plugin, PluginFailure> {
        let services = Arc::new(services(name, digest, config, keys)?);
        let limits = CallLimits {
            memory: usize::try_from(config.memory_mib)
                .unwrap_or(usize::MAX)
                .saturating_mul(1024 * 1024),
            timeout: Duration::from_millis(config.timeout_ms),
            fuel: config.fuel,
            cpu_share_percent: config.cpu_share_percent,
        };
        Plugin::new(self, inspection, component, services, limits, health, quarantine_after)
    }

    /// Compiles, checks and pre-instantiates in one step.
    ///
    /// # Errors
    ///
    /// As [`Runtime::compile_checked`] and [`Runtime::instantiate`].
    pub fn load(
        &self,
        name: &str,
        bytes: &[u8],
        config: &PluginConfig,
        keys: Arc<KeyStore>,
        health: Arc<Health>,
        quarantine_after: u32,
    ) -> Result<Plugin, PluginFailure> {
        let (inspection, component) = self.compile_checked(bytes)?;
        self.instantiate(
            name,
            digest(bytes),
            inspection,
            &component,
            config,
            keys,
            health,
            quarantine_after,
        )
    }
}

/// The services a plugin's config grants.
fn services(name: &str, digest: String, config: &PluginConfig, keys: Arc<KeyStore>) -> Result<Services, PluginFailure> {
    let bad = |what: String| PluginFailure::Incompatible(format!("plugins.{name}: {what}"));
    let policy = Egress::from_config(
        &format!("plugins.{name}"),
        &config.allowed_hosts,
        &config.allowed_internal,
    )
    .map_err(PluginFailure::Incompatible)?;
    let connect_timeout = Duration::from_millis(config.connect_timeout_ms);
    let http = crate::egress::Guarded::new(
        policy,
        crate::egress::Options {
            connect_timeout,
            timeout: Duration::from_millis(config.request_timeout_ms),
            redirects: 0,
            max_idle_per_host: usize::try_from(config.max_idle_connections).unwrap_or(5),
        },
    )
    .map_err(bad)?;
    // A granted key that failed to load is reported at its `[keys.ID]` by
    // the key store; the plugin still loads, so that its kinds' configs can
    // be checked too, and its signing requests get `unknown-key`.
    Ok(Services {
        plugin: name.to_owned(),
        digest,
        http,
        http_permits: Arc::new(tokio::sync::Semaphore::new(
            usize::try_from(config.max_connections).unwrap_or(20),
        )),
        connect_timeout,
        max_response_bytes: config.max_response_bytes,
        keys,
        granted_keys: config.keys.iter().cloned().collect::<HashSet<_>>(),
        log_lines_per_call: config.log_lines_per_call,
    })
}
