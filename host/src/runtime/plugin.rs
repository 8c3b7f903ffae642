//! One loaded plugin version: the compiled component, checked against its
//! world, pre-instantiated once, and called with a fresh store per call.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::OwnedSemaphorePermit;
use wasmtime::component::Component;
use wasmtime::{Store, UpdateDeadline};

use super::bindings::executor::exports::laneway::plugin::executor as wit_executor;
use super::bindings::executor::laneway::plugin::types as wit;
use super::bindings::executor::ExecutorPluginPre;
use super::bindings::fee_policy::exports::laneway::plugin::fee_policy as wit_fee;
use super::bindings::fee_policy::FeePolicyPluginPre;
use super::bindings::validating::ValidatingExecutorPluginPre;
use super::engine::EngineKind;
use super::failure::PluginFailure;
use super::pacing::{Overtime, Pace, Pacer};
use super::state::{HostState, Services};
use super::Runtime;
use crate::config::Problem;
use crate::executor::Attempt;

/// The major version of `laneway:plugin` this host implements.
pub const CONTRACT_MAJOR: u64 = 1;

/// Which world a component implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum World {
    /// Exports `laneway:plugin/executor`.
    Executor,
    /// Exports `laneway:plugin/fee-policy`.
    FeePolicy,
}

impl World {
    /// The world's WIT name.
    pub fn name(self) -> &'static str {
        match self {
            World::Executor => "executor-plugin",
            World::FeePolicy => "fee-policy-plugin",
        }
    }

    fn engine(self) -> EngineKind {
        match self {
            World::Executor => EngineKind::Executor,
            World::FeePolicy => EngineKind::Policy,
        }
    }

    /// Interfaces of `laneway:plugin` this world may import.
    fn own_imports(self) -> &'static [&'static str] {
        match self {
            World::Executor => &["types", "http", "signer", "log", "checkpoint", "fees", "notes", "mac"],
            World::FeePolicy => &["types", "log"],
        }
    }
}

/// WASI interfaces the Rust `wasm32-wasip2` standard library imports. They
/// are linked with an empty context, so they give no authority.
const WASI_ALLOWED: [&str; 5] = [
    "wasi:cli/",
    "wasi:io/",
    "wasi:clocks/",
    "wasi:random/",
    "wasi:filesystem/",
];

/// What a component declares, read before anything runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inspection {
    /// The world its exports implement.
    pub world: World,
    /// The contract version it was built against (`1.0.0`).
    pub version: String,
    /// Everything it imports.
    pub imports: Vec<String>,
    /// Everything it exports.
    pub exports: Vec<String>,
}

/// Reads a component's exports to find its world and contract version, and
/// refuses imports its world does not allow.
///
/// # Errors
///
/// [`PluginFailure::Incompatible`] with every reason.
pub fn inspect(
    runtime: &Runtime,
    component_for: impl Fn(EngineKind) -> Result<Component, PluginFailure>,
) -> Result<(Inspection, Component), PluginFailure> {
    // The world decides the engine, but the exports are only readable once
    // compiled; compile for executors first (no fuel instrumentation) and
    // recompile for the policy engine if that is what it turns out to be.
    let component = component_for(EngineKind::Executor)?;
    let engine = runtime.engines.get(EngineKind::Executor);
    let ty = component.component_type();
    let imports: Vec<String> = ty.imports(engine).map(|(n, _)| n.to_owned()).collect();
    let exports: Vec<String> = ty.exports(engine).map(|(n, _)| n.to_owned()).collect();
    let mut found = None;
    for name in &exports {
        for (world, iface) in [(World::Executor, "executor"), (World::FeePolicy, "fee-policy")] {
            if let Some(version) = name.strip_prefix(&format!("laneway:plugin/{iface}@")) {
                found = Some((world, version.to_owned()));
            }
        }
    }
    let Some((world, version)) = found else {
        return Err(PluginFailure::Incompatible(format!(
            "exports no laneway:plugin interface (exports: {})",
            if exports.is_empty() {
                "none".to_owned()
            } else {
                exports.join(", ")
            }
        )));
    };
    let major = version.split('.').next().and_then(|m| m.parse::<u64>().ok());
    if major != Some(CONTRACT_MAJOR) {
        return Err(PluginFailure::Incompatible(format!(
            "built against laneway:plugin@{version}; this laneway supports {CONTRACT_MAJOR}.x"
        )));
    }
    let refused: Vec<&String> = imports
        .iter()
        .filter(|name| {
            let own = world
                .own_imports()
                .iter()
                .any(|iface| name.starts_with(&format!("laneway:plugin/{iface}@{CONTRACT_MAJOR}.")));
            !own && !WASI_ALLOWED.iter().any(|p| name.starts_with(p))
        })
        .collect();
    if !refused.is_empty() {
        return Err(PluginFailure::Incompatible(format!(
            "imports {} which the {} world does not allow",
            refused.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", "),
            world.name()
        )));
    }
    let component = if world.engine() == EngineKind::Executor {
        component
    } else {
        component_for(world.engine())?
    };
    Ok((
        Inspection {
            world,
            version,
            imports,
            exports,
        },
        component,
    ))
}

/// Limits applied to every call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallLimits {
    /// Linear memory cap.
    pub memory: usize,
    /// Deadline for the whole call, host calls included.
    pub timeout: Duration,
    /// Instruction budget (fee policies).
    pub fuel: u64,
    /// Share of a core for compute past the grace (`pacing`).
    pub cpu_share_percent: u32,
}

enum Pre {
    /// An executor, and its `validation` export when it has one (1.2.0).
    Executor(
        ExecutorPluginPre<HostState>,
        Option<ValidatingExecutorPluginPre<HostState>>,
    ),
    FeePolicy(FeePolicyPluginPre<HostState>),
}

/// Consecutive crashes of one plugin version, and whether it is quarantined.
#[derive(Debug, Default)]
pub struct Health {
    crashes: AtomicU32,
    quarantined: AtomicBool,
}

impl Health {
    /// Whether the version is quarantined.
    pub fn quarantined(&self) -> bool {
        self.quarantined.load(Ordering::Relaxed)
    }

    fn record(&self, plugin: &str, digest: &str, result: Result<(), &PluginFailure>, quarantine_after: u32) {
        match result {
            Ok(()) => self.crashes.store(0, Ordering::Relaxed),
            Err(f) if f.is_crash() => {
                let n = self.crashes.fetch_add(1, Ordering::Relaxed) + 1;
                if n >= quarantine_after && !self.quarantined.swap(true, Ordering::Relaxed) {
                    tracing::error!(plugin, digest, crashes = n, failure = %f, "Plugin version quarantined after repeated crashes; its ops wait until a new version is loaded.");
                }
            }
            Err(_) => {}
        }
    }
}

/// A loaded, checked plugin version.
pub struct Plugin {
    /// What the component declared.
    pub inspection: Inspection,
    /// Services granted to it.
    pub services: Arc<Services>,
    /// Per-call limits.
    pub limits: CallLimits,
    /// Crash accounting.
    pub health: Arc<Health>,
    quarantine_after: u32,
    /// Its calls' compute past their grace, paced together.
    overtime: Arc<Overtime>,
    pre: Pre,
    runtime: Runtime,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("plugin", &self.services.plugin)
            .field("world", &self.inspection.world)
            .field("version", &self.inspection.version)
            .field("digest", &self.services.digest)
            .finish_non_exhaustive()
    }
}

/// One call's store and the engine instance slot it holds. The store is
/// declared first, so it (and its instance) is dropped before the slot is
/// given back: wasmtime drops a store's data before it frees the store's
/// instances, so a slot kept in `HostState` would let a waiting call
/// instantiate into a pool not yet freed.
struct Call {
    store: Store<HostState>,
    _slot: OwnedSemaphorePermit,
}

impl Plugin {
    /// Pre-instantiates an inspected component against its world's linker.
    ///
    /// # Errors
    ///
    /// [`PluginFailure::Incompatible`] when the component's imports or
    /// exports do not type-check against the contract.
    pub fn new(
        runtime: &Runtime,
        inspection: Inspection,
        component: &Component,
        services: Arc<Services>,
        limits: CallLimits,
        health: Arc<Health>,
        quarantine_after: u32,
    ) -> Result<Self, PluginFailure> {
        let incompatible = |e: wasmtime::Error| PluginFailure::Incompatible(format!("{e:#}"));
        let pre = match inspection.world {
            World::Executor => {
                let pre = runtime
                    .executor_linker
                    .instantiate_pre(component)
                    .map_err(incompatible)?;
                let validates = inspection
                    .exports
                    .iter()
                    .any(|e| e.starts_with(&format!("laneway:plugin/validation@{CONTRACT_MAJOR}.")));
                let validator = if validates {
                    Some(ValidatingExecutorPluginPre::new(pre.clone()).map_err(incompatible)?)
                } else {
                    None
                };
                Pre::Executor(ExecutorPluginPre::new(pre).map_err(incompatible)?, validator)
            }
            World::FeePolicy => {
                let pre = runtime.policy_linker.instantiate_pre(component).map_err(incompatible)?;
                Pre::FeePolicy(FeePolicyPluginPre::new(pre).map_err(incompatible)?)
            }
        };
        Ok(Self {
            inspection,
            services,
            limits,
            health,
            quarantine_after,
            overtime: Arc::default(),
            pre,
            runtime: runtime.clone(),
        })
    }

    /// A fresh store with the deadline and limits armed, for a call handed
    /// `input_bytes` of input (its compute grace grows with it), with one
    /// of its engine's instance slots. The wait for a slot comes first,
    /// outside the call's deadline and its health: a host with every slot
    /// busy is not the plugin's failure.
    async fn store(
        &self,
        attempt: Option<Attempt>,
        op_id: Option<i64>,
        input_bytes: usize,
    ) -> Result<Call, PluginFailure> {
        let kind = self.inspection.world.engine();
        let slot = self
            .runtime
            .engines
            .slots(kind)
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| PluginFailure::HostImport("the engine's instance slots are closed".into()))?;
        let engine = self.runtime.engines.get(kind);
        let deterministic = self.inspection.world == World::FeePolicy;
        let state = HostState::new(self.services.clone(), self.limits.memory, attempt, op_id, deterministic);
        let mut store = Store::new(engine, state);
        store.limiter(|s| &mut s.limiter);
        if self.inspection.world == World::FeePolicy {
            store
                .set_fuel(self.limits.fuel)
                .map_err(|e| PluginFailure::HostImport(format!("cannot set fuel: {e}")))?;
        }
        // Guest code yields to the async runtime every epoch tick, is paced
        // to a share of a core once it has computed past its grace (so a
        // spinning guest cannot starve other work; see `pacing`), and traps
        // at the deadline.
        let deadline = Instant::now() + self.limits.timeout;
        let mut pacer = Pacer::new(self.runtime.epoch_tick, self.limits.cpu_share_percent, input_bytes);
        let overtime = self.overtime.clone();
        store.epoch_deadline_callback(move |_| {
            let now = Instant::now();
            if now >= deadline {
                return Ok(UpdateDeadline::Interrupt);
            }
            Ok(match pacer.tick(&overtime, now) {
                Pace::Yield => UpdateDeadline::Yield(1),
                Pace::Pause(pause) => UpdateDeadline::YieldCustom(
                    1,
                    Box::pin(tokio::time::sleep(pause.min(deadline.saturating_duration_since(now)))),
                ),
            })
        });
        store.set_epoch_deadline(1);
        Ok(Call { store, _slot: slot })
    }

    /// Runs `call` under the deadline. Epochs only interrupt guest code, so
    /// an outer timeout also bounds time spent in host calls.
    async fn bounded<T>(
        &self,
        store: &mut Store<HostState>,
        call: impl AsyncFnOnce(&mut Store<HostState>) -> wasmtime::Result<T>,
    ) -> Result<T, PluginFailure> {
        let outer = self.limits.timeout + Duration::from_millis(50);
        let result = match tokio::time::timeout(outer, call(store)).await {
            Err(_) => Err(PluginFailure::Timeout),
            Ok(Err(e)) => Err(PluginFailure::classify(&e)),
            Ok(Ok(v)) => Ok(v),
        };
        // A denial decides the call, whatever the guest made of it.
        let result = match (result, store.data().denied.clone()) {
            (Ok(_), Some(denied)) => Err(PluginFailure::Denied(denied)),
            (other, _) => other,
        };
        self.health.record(
            &self.services.plugin,
            &self.services.digest,
            result.as_ref().map(|_| ()),
            self.quarantine_after,
        );
        result
    }

    fn executor_pre(&self) -> Result<&ExecutorPluginPre<HostState>, PluginFailure> {
        match &self.pre {
            Pre::Executor(pre, _) => Ok(pre),
            Pre::FeePolicy(_) => Err(PluginFailure::Incompatible("a fee policy cannot execute ops".into())),
        }
    }

    fn policy_pre(&self) -> Result<&FeePolicyPluginPre<HostState>, PluginFailure> {
        match &self.pre {
            Pre::FeePolicy(pre) => Ok(pre),
            Pre::Executor(..) => Err(PluginFailure::Incompatible("an executor cannot quote fees".into())),
        }
    }

    /// `executor.execute`.
    ///
    /// # Errors
    ///
    /// [`PluginFailure`] when the call did not return an outcome.
    pub async fn execute(&self, op: wit::Op, attempt: Attempt) -> Result<wit::Outcome, PluginFailure> {
        let pre = self.executor_pre()?.clone();
        let mut call = self
            .store(Some(attempt), Some(op.id), op.payload.len() + op.config.len())
            .await?;
        self.bounded(&mut call.store, async move |store| {
            let bindings = pre.instantiate_async(&mut *store).await?;
            bindings.laneway_plugin_executor().call_execute(&mut *store, &op).await
        })
        .await
    }

    /// `executor.reconcile`.
    ///
    /// # Errors
    ///
    /// [`PluginFailure`] when the call did not return.
    pub async fn reconcile(
        &self,
        op: wit::Op,
        receipt: String,
        attempt: Attempt,
    ) -> Result<wit::Reconciled, PluginFailure> {
        let pre = self.executor_pre()?.clone();
        let input = op.payload.len() + op.config.len() + receipt.len();
        let mut call = self.store(Some(attempt), Some(op.id), input).await?;
        self.bounded(&mut call.store, async move |store| {
            let bindings = pre.instantiate_async(&mut *store).await?;
            bindings
                .laneway_plugin_executor()
                .call_reconcile(&mut *store, &op, &receipt)
                .await
        })
        .await
    }

    /// `executor.lanes`.
    ///
    /// # Errors
    ///
    /// [`PluginFailure`], or the plugin's own refusal as `Ok(Err(..))`.
    pub async fn lanes(&self, input: wit::OpInput) -> Result<Result<Vec<String>, String>, PluginFailure> {
        let pre = self.executor_pre()?.clone();
        let mut call = self.store(None, None, input.payload.len() + input.config.len()).await?;
        self.bounded(&mut call.store, async move |store| {
            let bindings = pre.instantiate_async(&mut *store).await?;
            bindings.laneway_plugin_executor().call_lanes(&mut *store, &input).await
        })
        .await
    }

    /// Whether the plugin checks kind configs (exports `validation`).
    pub fn validates(&self) -> bool {
        matches!(&self.pre, Pre::Executor(_, Some(_)))
    }

    /// `validation.validate-config`: `Ok(None)` when the plugin does not
    /// export it (its kinds' configs are checked only when an op runs). Each
    /// problem's path is relative to the kind's `config` table.
    ///
    /// # Errors
    ///
    /// [`PluginFailure`] when the call did not return.
    pub async fn validate_config(&self, kind: &str, config: &str) -> Result<Option<Vec<Problem>>, PluginFailure> {
        let Pre::Executor(_, Some(pre)) = &self.pre else {
            return Ok(None);
        };
        let pre = pre.clone();
        let (kind, config) = (kind.to_owned(), config.to_owned());
        let mut call = self.store(None, None, config.len()).await?;
        call.store.data_mut().probing = true;
        let result = self
            .bounded(&mut call.store, async move |store| {
                let bindings = pre.instantiate_async(&mut *store).await?;
                bindings
                    .laneway_plugin_validation()
                    .call_validate_config(&mut *store, &kind, &config)
                    .await
            })
            .await?;
        Ok(Some(match result {
            Ok(()) => Vec::new(),
            Err(problems) => problems
                .into_iter()
                .map(|p| Problem {
                    path: p.path,
                    message: p.message,
                })
                .collect(),
        }))
    }

    /// `executor.describe`.
    ///
    /// # Errors
    ///
    /// [`PluginFailure`] when the call did not return.
    pub async fn describe(&self) -> Result<wit_executor::Description, PluginFailure> {
        let pre = self.executor_pre()?.clone();
        let mut call = self.store(None, None, 0).await?;
        self.bounded(&mut call.store, async move |store| {
            let bindings = pre.instantiate_async(&mut *store).await?;
            bindings.laneway_plugin_executor().call_describe(&mut *store).await
        })
        .await
    }

    /// `fee-policy.quote`.
    ///
    /// # Errors
    ///
    /// [`PluginFailure`], or the policy's own refusal as `Ok(Err(..))`.
    pub async fn quote(
        &self,
        request: wit_fee::QuoteRequest,
    ) -> Result<Result<wit_fee::Decision, String>, PluginFailure> {
        let pre = self.policy_pre()?.clone();
        let mut call = self.store(None, None, 0).await?;
        self.bounded(&mut call.store, async move |store| {
            let bindings = pre.instantiate_async(&mut *store).await?;
            bindings
                .laneway_plugin_fee_policy()
                .call_quote(&mut *store, &request)
                .await
        })
        .await
    }

    /// `fee-policy.observe`.
    ///
    /// # Errors
    ///
    /// [`PluginFailure`], or the policy's own refusal as `Ok(Err(..))`.
    pub async fn observe(
        &self,
        previous: Option<wit_fee::Snapshot>,
        sample: wit_fee::FeeSample,
        now_ms: i64,
        config: String,
    ) -> Result<Result<wit_fee::Snapshot, String>, PluginFailure> {
        let pre = self.policy_pre()?.clone();
        let mut call = self.store(None, None, config.len()).await?;
        self.bounded(&mut call.store, async move |store| {
            let bindings = pre.instantiate_async(&mut *store).await?;
            bindings
                .laneway_plugin_fee_policy()
                .call_observe(&mut *store, previous.as_ref(), sample, now_ms, &config)
                .await
        })
        .await
    }
}
