//! The plugin host: builds the executor registry from the configuration and
//! keeps it current.
//!
//! Reloading follows Vector's order: load the config, validate it whole,
//! compile only the plugins whose bytes or settings changed (off the async
//! runtime), check each against its world, and only then swap the registry
//! atomically. Any failure keeps the old registry running and is reported;
//! calls in flight finish on the versions they started with.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use notify::Watcher as _;
use serde::Serialize;

use super::executor::WasmExecutor;
use super::failure::PluginFailure;
use super::plugin::{Health, Inspection, Plugin, World};
use super::{digest, Runtime};
use crate::config::{self, Config, ConfigError, FileSource, Problem};
use crate::dispatch::Dispatcher;
use crate::executor::{Executor, Executors, Registry};
use crate::keys::KeyStore;
use wasmtime::component::Component;

/// Why a load or reload was refused; the old registry stays.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The config file is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Plugins or keys could not be loaded.
    #[error("cannot load plugins ({} problem{}):\n{}", .0.len(), if .0.len() == 1 { "" } else { "s" }, .0.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Plugins(Vec<Problem>),
    /// The engines could not be built.
    #[error("cannot start the WebAssembly runtime: {0}")]
    Runtime(String),
    /// The new config would leave kinds with queued ops without an
    /// executor (a half-written file, a deleted section); refused unless
    /// the reload is asked to allow it.
    #[error("refused: the new config drops {}, which still {} queued ops; fix the config, or reload with allow_removal (the API's ?allow_removal=true) to drop them on purpose", .0.iter().map(|(k, n)| format!("kind {k:?} ({n} ops)")).collect::<Vec<_>>().join(", "), if .0.len() == 1 { "has" } else { "have" })]
    WouldRemove(Vec<(String, i64)>),
    /// The queue could not be asked what is queued.
    #[error("cannot check the queue before reloading: {0}")]
    Queue(String),
}

/// The kinds `current` runs with an executor plugin that `next` would
/// leave without one (gone, no plugin, or its plugin gone).
pub fn dropped_kinds(current: &Config, next: &Config) -> Vec<String> {
    current
        .kinds
        .iter()
        .filter(|(_, kind)| kind.plugin.as_ref().is_some_and(|p| current.plugins.contains_key(p)))
        .filter(|(name, _)| {
            next.kinds
                .get(*name)
                .and_then(|k| k.plugin.as_ref())
                .is_none_or(|p| !next.plugins.contains_key(p))
        })
        .map(|(name, _)| name.clone())
        .collect()
}

/// A loaded plugin, for status output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PluginStatus {
    /// The `[plugins.NAME]`.
    pub name: String,
    /// `executor-plugin` or `fee-policy-plugin`.
    pub world: String,
    /// The contract version it was built against.
    pub contract: String,
    /// Content digest of the loaded bytes.
    pub digest: String,
    /// Quarantined after repeated crashes.
    pub quarantined: bool,
}

/// Reload bookkeeping, for operators and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReloadStatus {
    /// Successful loads, the first included.
    pub loads: u64,
    /// Refused reloads.
    pub failures: u64,
    /// Why the last reload was refused (cleared by a good one).
    pub last_error: Option<String>,
    /// Kinds whose config their plugin refused at the last load, with every
    /// problem: they are not activated (their ops wait), or keep the
    /// executor they had before the load.
    pub refused_kinds: Vec<String>,
}

struct Loaded {
    digest: String,
    plugin: Arc<Plugin>,
}

/// Builds and swaps the executor registry.
pub struct PluginHost {
    runtime: Runtime,
    registry: Arc<Registry>,
    loaded: tokio::sync::Mutex<HashMap<String, Loaded>>,
    /// Compiled components by content digest: a reload recompiles only
    /// bytes it has not seen.
    compiled: Mutex<HashMap<String, (Inspection, Component)>>,
    /// Health per (plugin name, digest): kept across reloads of the same
    /// bytes, so touching a file does not lift a quarantine.
    health: Mutex<HashMap<(String, String), Arc<Health>>>,
    status: Mutex<ReloadStatus>,
    fee_policies: arc_swap::ArcSwap<BTreeMap<String, Arc<Plugin>>>,
}

impl std::fmt::Debug for PluginHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginHost")
            .field("registry", &self.registry)
            .finish_non_exhaustive()
    }
}

impl PluginHost {
    /// A host with an empty registry.
    ///
    /// # Errors
    ///
    /// [`LoadError::Runtime`] when no engine can be built.
    pub fn new(config: &Config) -> Result<Self, LoadError> {
        let runtime = Runtime::new(&config.runtime).map_err(|e| LoadError::Runtime(format!("{e:#}")))?;
        Ok(Self {
            runtime,
            registry: Arc::new(Registry::default()),
            loaded: tokio::sync::Mutex::new(HashMap::new()),
            compiled: Mutex::new(HashMap::new()),
            health: Mutex::new(HashMap::new()),
            status: Mutex::new(ReloadStatus::default()),
            fee_policies: arc_swap::ArcSwap::from_pointee(BTreeMap::new()),
        })
    }

    /// The registry the dispatcher reads.
    pub fn registry(&self) -> Arc<Registry> {
        self.registry.clone()
    }

    /// The runtime (for `plugin check`).
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// A loaded fee policy, by plugin name.
    pub fn fee_policy(&self, name: &str) -> Option<super::policy::FeePolicy> {
        self.fee_policies
            .load()
            .get(name)
            .cloned()
            .map(super::policy::FeePolicy::new)
    }

    /// Reload bookkeeping.
    pub fn status(&self) -> ReloadStatus {
        self.status.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Loaded plugins.
    pub async fn plugins(&self) -> Vec<PluginStatus> {
        let loaded = self.loaded.lock().await;
        let mut out: Vec<PluginStatus> = loaded
            .iter()
            .map(|(name, l)| PluginStatus {
                name: name.clone(),
                world: l.plugin.inspection.world.name().to_owned(),
                contract: l.plugin.inspection.version.clone(),
                digest: l.digest.clone(),
                quarantined: l.plugin.health.quarantined(),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    fn health_for(&self, name: &str, digest: &str) -> Arc<Health> {
        let mut health = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        health
            .entry((name.to_owned(), digest.to_owned()))
            .or_insert_with(|| Arc::new(Health::default()))
            .clone()
    }

    /// Loads every plugin the config names, asks each executor plugin to
    /// check its kinds' configs, and swaps the registry; or changes nothing
    /// and reports every problem.
    ///
    /// A kind whose config its plugin refuses is not activated: its ops wait
    /// (nothing is dead-lettered), or it keeps the executor it already had.
    /// Those problems are returned, every one with its key path, and are
    /// what `check-config` fails on.
    ///
    /// # Errors
    ///
    /// [`LoadError::Plugins`] with every problem found.
    pub async fn apply(&self, config: &Config) -> Result<Vec<Problem>, LoadError> {
        let result = self.try_apply(config).await;
        let mut status = self.status.lock().unwrap_or_else(PoisonError::into_inner);
        match &result {
            Ok(refused) => {
                status.loads += 1;
                status.last_error = None;
                status.refused_kinds = refused.iter().map(Problem::to_string).collect();
            }
            Err(e) => {
                status.failures += 1;
                status.last_error = Some(e.to_string());
            }
        }
        result
    }

    async fn try_apply(&self, config: &Config) -> Result<Vec<Problem>, LoadError> {
        let mut problems = Vec::new();
        let (keys, key_problems) = KeyStore::load_partial(&config.keys);
        let keys = Arc::new(keys);
        problems.extend(
            key_problems
                .into_iter()
                .map(|(path, message)| Problem { path, message }),
        );
        let mut loaded = self.loaded.lock().await;
        let mut next: HashMap<String, Loaded> = HashMap::new();
        for (name, plugin_config) in &config.plugins {
            let bytes = match tokio::fs::read(&plugin_config.path).await {
                Ok(bytes) => bytes,
                Err(e) => {
                    problems.push(Problem {
                        path: format!("plugins.{name}.path"),
                        message: format!("cannot read {}: {e}", plugin_config.path.display()),
                    });
                    continue;
                }
            };
            let digest = digest(&bytes);
            let cached = self
                .compiled
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&digest)
                .cloned();
            let checked = match cached {
                Some(c) => Ok(c),
                None => {
                    let runtime = self.runtime.clone();
                    tokio::task::spawn_blocking(move || runtime.compile_checked(&bytes))
                        .await
                        .unwrap_or_else(|e| Err(PluginFailure::Incompatible(format!("compiling panicked: {e}"))))
                }
            };
            let plugin = checked.and_then(|(inspection, component)| {
                self.compiled
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(digest.clone(), (inspection.clone(), component.clone()));
                // Grants are rebuilt on every load, so new keys and limits
                // always take effect; only compilation is cached.
                self.runtime.instantiate(
                    name,
                    digest.clone(),
                    inspection,
                    &component,
                    plugin_config,
                    keys.clone(),
                    self.health_for(name, &digest),
                    config.runtime.quarantine_after,
                )
            });
            match plugin {
                Ok(plugin) => {
                    next.insert(
                        name.clone(),
                        Loaded {
                            digest,
                            plugin: Arc::new(plugin),
                        },
                    );
                }
                Err(failure) => problems.push(Problem {
                    path: format!("plugins.{name}"),
                    message: format!("{} ({})", failure, plugin_config.path.display()),
                }),
            }
        }
        for (name, oracle) in &config.oracles {
            if let Some(why) = config::oracle_url_unlisted(&oracle.rpc_url, &config.plugins) {
                problems.push(Problem {
                    path: format!("oracles.{name}.rpc_url"),
                    message: why,
                });
            }
        }
        let mut executors = Executors::new();
        // laneway's own kind, in every registry, so webhooks already queued
        // keep going whatever the config now says.
        executors.insert(
            crate::config::WEBHOOK_KIND.to_owned(),
            Arc::new(crate::webhook::WebhookExecutor::new(keys.clone(), config)) as Arc<dyn Executor>,
        );
        let mut refused = Vec::new();
        for (kind, kind_config) in &config.kinds {
            let Some(plugin_name) = &kind_config.plugin else {
                continue;
            };
            match next.get(plugin_name) {
                Some(l) if l.plugin.inspection.world == World::Executor => {
                    let pool = match kind_config.pool.as_ref().map(|name| {
                        config
                            .pools
                            .get(name)
                            .map(|p| crate::pool::Pool::resolve(name, p, &keys))
                    }) {
                        None => None,
                        Some(Some(Ok(pool))) => Some(Arc::new(pool)),
                        // A pool that does not resolve is the kind's problem:
                        // its ops wait for a config that names loaded keys.
                        Some(Some(Err(e))) => {
                            if let Some(previous) = self.registry.get(kind) {
                                executors.insert(kind.clone(), previous);
                            }
                            refused.push(Problem {
                                path: format!("kinds.{kind}.pool"),
                                message: e.to_string(),
                            });
                            continue;
                        }
                        // Reported by the config's own check.
                        Some(None) => continue,
                    };
                    let config_json = crate::pool::config_json(kind_config, pool.as_deref());
                    let found = kind_problems(&l.plugin, kind, &config_json).await;
                    if found.is_empty() {
                        executors.insert(
                            kind.clone(),
                            Arc::new(WasmExecutor::new(
                                l.plugin.clone(),
                                config_json,
                                kind_config.lanes == crate::config::LanePresence::Plugin,
                                pool,
                            )) as Arc<dyn Executor>,
                        );
                    } else {
                        if let Some(previous) = self.registry.get(kind) {
                            executors.insert(kind.clone(), previous);
                        }
                        refused.extend(found);
                    }
                }
                Some(_) => problems.push(Problem {
                    path: format!("kinds.{kind}.plugin"),
                    message: format!("plugin {plugin_name:?} is a fee policy, not an executor"),
                }),
                // Its loading problem is already reported.
                None => {}
            }
        }
        if !problems.is_empty() {
            // Report the kinds' own problems too: every mistake at once.
            problems.extend(refused);
            return Err(LoadError::Plugins(problems));
        }
        let policies: BTreeMap<String, Arc<Plugin>> = next
            .iter()
            .filter(|(_, l)| l.plugin.inspection.world == World::FeePolicy)
            .map(|(n, l)| (n.clone(), l.plugin.clone()))
            .collect();
        for (name, l) in &next {
            let changed = loaded.get(name).is_none_or(|old| old.digest != l.digest);
            if changed {
                tracing::info!(plugin = %name, digest = %l.digest, world = l.plugin.inspection.world.name(), contract = %l.plugin.inspection.version, "Plugin loaded.");
            }
        }
        self.registry.replace(executors);
        self.fee_policies.store(Arc::new(policies));
        self.compiled
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|d, _| next.values().any(|l| l.digest == *d));
        *loaded = next;
        Ok(refused)
    }

    /// Reloads from the config source: on success the dispatcher's tunables
    /// follow too; on failure nothing changes and the error is logged.
    ///
    /// A config that would leave a kind with queued ops without its
    /// executor is refused ([`LoadError::WouldRemove`]) unless
    /// `allow_removal`: a file caught half-written (an empty file is a valid
    /// config) must never unload every plugin.
    pub async fn reload(
        &self,
        source: &FileSource,
        dispatcher: Option<&Dispatcher>,
        allow_removal: bool,
    ) -> Result<(), LoadError> {
        let result = async {
            let config = config::load(source, config::process_env())?;
            if let (Some(d), false) = (dispatcher, allow_removal) {
                let dropped = dropped_kinds(&d.config(), &config);
                if !dropped.is_empty() {
                    let depth = d.queue().depth().await.map_err(|e| LoadError::Queue(e.to_string()))?;
                    let mut queued: Vec<(String, i64)> = Vec::new();
                    for kind in dropped {
                        let n: i64 = depth
                            .iter()
                            .filter(|row| row.kind == kind && !row.status.is_terminal())
                            .map(|row| row.count)
                            .sum();
                        if n > 0 {
                            queued.push((kind, n));
                        }
                    }
                    if !queued.is_empty() {
                        return Err(LoadError::WouldRemove(queued));
                    }
                }
            }
            log_refused(&self.apply(&config).await?);
            if let Some(d) = dispatcher {
                d.reconfigure(config);
            }
            Ok::<(), LoadError>(())
        }
        .await;
        let metrics = dispatcher.map(|d| d.metrics().as_ref());
        match &result {
            Ok(()) => crate::events::Reloaded::Loaded.emit(metrics),
            Err(e) => {
                // The typed event below is the one log line (and metric).
                if matches!(
                    e,
                    LoadError::Config(_) | LoadError::WouldRemove(_) | LoadError::Queue(_)
                ) {
                    let mut status = self.status.lock().unwrap_or_else(PoisonError::into_inner);
                    status.failures += 1;
                    status.last_error = Some(e.to_string());
                }
                crate::events::Reloaded::Refused { error: &e.to_string() }.emit(metrics);
            }
        }
        result
    }

    /// Watches the config file and every plugin file, and SIGHUP, reloading
    /// on change (debounced) until the dispatcher shuts down.
    pub fn watch(self: &Arc<Self>, source: FileSource, dispatcher: Dispatcher, debounce: Duration) {
        let host = self.clone();
        tokio::spawn(async move {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
            let mut watched: Vec<PathBuf> = Vec::new();
            // Which files matter, by name, as the watcher reports them.
            let names: Arc<Mutex<Vec<std::ffi::OsString>>> = Arc::default();
            let wanted = names.clone();
            let mut watcher = match notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                let Ok(event) = event else { return };
                if !is_change(&event.kind) {
                    return;
                }
                let names = wanted.lock().unwrap_or_else(PoisonError::into_inner);
                let ours = event
                    .paths
                    .iter()
                    .any(|p| p.file_name().is_some_and(|n| names.iter().any(|w| w == n)));
                if ours {
                    let _ = tx.send(());
                }
            }) {
                Ok(w) => Some(w),
                Err(e) => {
                    tracing::error!(error = %e, "Cannot watch files; reload with SIGHUP.");
                    None
                }
            };
            let mut hangup = sighup();
            let mut fingerprint = files_fingerprint(&watch_list(&source));
            loop {
                // (Re)register watches on the directories holding the files,
                // since editors and deploys replace files by rename.
                let files = watch_list(&source);
                *names.lock().unwrap_or_else(PoisonError::into_inner) = files
                    .iter()
                    .filter_map(|f| f.file_name().map(std::ffi::OsStr::to_owned))
                    .collect();
                if let Some(w) = watcher.as_mut() {
                    for dir in parents(&files) {
                        if !watched.contains(&dir) && w.watch(&dir, notify::RecursiveMode::NonRecursive).is_ok() {
                            watched.push(dir);
                        }
                    }
                }
                tokio::select! {
                    () = dispatcher.cancelled() => return,
                    Some(()) = rx.recv() => {}
                    Some(()) = hangup.recv() => {
                        tracing::info!("SIGHUP: reloading.");
                        let _ = host.reload(&source, Some(&dispatcher), false).await;
                        fingerprint = files_fingerprint(&watch_list(&source));
                        continue;
                    }
                }
                // Wait for the writes to stop (a quiet period), so a file
                // written in place (truncate, then write) is read whole;
                // bounded, so a file written without pause still reloads.
                for _ in 0..50 {
                    tokio::time::sleep(debounce).await;
                    let mut more = false;
                    while rx.try_recv().is_ok() {
                        more = true;
                    }
                    if !more {
                        break;
                    }
                }
                let now = files_fingerprint(&watch_list(&source));
                if now != fingerprint {
                    fingerprint = now;
                    let _ = host.reload(&source, Some(&dispatcher), false).await;
                }
            }
        });
    }
}

/// Logs the kinds a load left inactive (or on their previous config), one
/// line per problem with its key path, for `run` and reloads.
pub fn log_refused(refused: &[Problem]) {
    for problem in refused {
        tracing::error!(path = %problem.path, problem = %problem.message, "Kind config refused by its plugin; the kind is not activated (its ops wait) or keeps its previous config.");
    }
}

/// What a kind's plugin finds wrong with its config, as config problems
/// under `kinds.KIND.config`; a plugin that does not validate finds nothing.
async fn kind_problems(plugin: &Plugin, kind: &str, config_json: &str) -> Vec<Problem> {
    let at = |path: &str| {
        if path.is_empty() {
            format!("kinds.{kind}.config")
        } else if path.starts_with('[') {
            format!("kinds.{kind}.config{path}")
        } else {
            format!("kinds.{kind}.config.{path}")
        }
    };
    match plugin.validate_config(kind, config_json).await {
        Ok(None) => Vec::new(),
        Ok(Some(found)) => found
            .into_iter()
            .map(|p| Problem {
                path: at(&p.path),
                message: p.message,
            })
            .collect(),
        Err(failure) => vec![Problem {
            path: at(""),
            message: format!("the plugin could not check it: {failure}"),
        }],
    }
}

/// Whether a file event is a change of content or name: opens, reads and
/// closes without writing (the watcher's own reads among them) are not.
fn is_change(kind: &notify::EventKind) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind};
    match kind {
        EventKind::Create(_) | EventKind::Remove(_) => true,
        EventKind::Modify(ModifyKind::Metadata(_)) => false,
        EventKind::Modify(_) => true,
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        _ => false,
    }
}

/// The config file and every plugin file it names now.
fn watch_list(source: &FileSource) -> Vec<PathBuf> {
    let path = match source {
        FileSource::Explicit(p) | FileSource::Default(p) => p.clone(),
    };
    let mut files = vec![path];
    if let Ok(config) = config::load(source, config::process_env()) {
        files.extend(config.plugins.values().map(|p| p.path.clone()));
    }
    files
}

fn parents(files: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = files
        .iter()
        .map(|f| match f.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        })
        .collect();
    dirs.sort();
    dirs.dedup();
    dirs
}

/// Size and modification time of each file: a change worth a reload.
fn files_fingerprint(files: &[PathBuf]) -> Vec<Option<(u64, SystemTime)>> {
    files
        .iter()
        .map(|f| {
            std::fs::metadata(f)
                .ok()
                .and_then(|m| Some((m.len(), m.modified().ok()?)))
        })
        .collect()
}

/// SIGHUP as a stream of unit events (never fires off Unix).
fn sighup() -> tokio::sync::mpsc::UnboundedReceiver<()> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    #[cfg(unix)]
    tokio::spawn(async move {
        let Ok(mut sig) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else {
            return;
        };
        while sig.recv().await.is_some() {
            if tx.send(()).is_err() {
                return;
            }
        }
    });
    #[cfg(not(unix))]
    drop(tx);
    rx
}

#[async_trait::async_trait]
impl crate::pricing::FeePolicies for PluginHost {
    async fn quote(
        &self,
        policy: &str,
        input: crate::fees::QuoteInput<'_>,
    ) -> Result<crate::fees::FeeDecision, crate::pricing::PricingError> {
        let plugin = self
            .fee_policy(policy)
            .ok_or_else(|| crate::pricing::PricingError::PolicyNotLoaded(policy.to_owned()))?;
        plugin
            .quote(input)
            .await
            .map_err(|e| crate::pricing::PricingError::Policy {
                policy: policy.to_owned(),
                reason: e.to_string(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kind_left_without_its_plugin_is_dropped() {
        let with = config::from_toml_str(
            "[plugins.p]\npath = \"p.wasm\"\n[kinds.k]\nplugin = \"p\"\nlanes = \"optional\"\n\
             [kinds.other]\nlanes = \"optional\"\n",
        )
        .expect("valid");
        let empty = config::from_toml_str("").expect("valid");
        assert_eq!(dropped_kinds(&with, &empty), vec!["k".to_owned()]);
        assert!(dropped_kinds(&with, &with).is_empty());
        let no_plugin = config::from_toml_str("[kinds.k]\nlanes = \"optional\"\n").expect("valid");
        assert_eq!(dropped_kinds(&with, &no_plugin), vec!["k".to_owned()]);
        assert!(dropped_kinds(&empty, &with).is_empty(), "adding is not dropping");
    }
}
