//! The composition root: the one place a running host is put together from
//! a config (queue, plugins, dispatcher, fee oracles, pruner, outcome relay,
//! hot reload, HTTP API) and taken apart again. `laneway run`, `laneway
//! demo` and the tests' harnesses all start a [`Node`], so what they run is
//! what ships; each subsystem still reads only its own part of the config.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, SystemClock};
use crate::config::{Config, FileSource, OracleConfig};
use crate::dispatch::{DispatchError, Dispatcher};
use crate::executor::Registry;
use crate::oracle::{FeeOracle, StellarRpc};
use crate::queue::{self, Queue, QueueError};
use crate::runtime::host::{LoadError, PluginHost};

/// Why a host could not start or stopped badly.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The queue cannot be opened, is behind the schema, or failed.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// Plugins or keys could not be loaded.
    #[error(transparent)]
    Plugins(#[from] LoadError),
    /// The dispatcher stopped with an error.
    #[error(transparent)]
    Dispatch(#[from] DispatchError),
    /// `api.listen` cannot be bound (a port in use is the operator's to fix,
    /// before anything runs).
    #[error("api.listen: cannot listen on {listen}: {source}")]
    Listen {
        /// The address configured.
        listen: String,
        /// Why.
        source: std::io::Error,
    },
    /// An oracle's RPC client cannot be built.
    #[error("oracles.{name}: {why}")]
    Oracle {
        /// The oracle.
        name: String,
        /// Why.
        why: String,
    },
    /// The dispatcher's task did not finish (it panicked or was aborted).
    #[error("the dispatcher task ended abnormally: {0}")]
    Joined(String),
}

/// Which of the host's services beside the dispatcher to start. A test of
/// the dispatcher alone leaves out what would race its assertions (an
/// oracle sampling on its own, an API on the configured port).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Services {
    /// The HTTP API on `api.listen` (when it is not empty).
    pub api: bool,
    /// One fee oracle per `[oracles.*]`.
    pub oracles: bool,
    /// The retention pruner.
    pub pruner: bool,
    /// The outcome webhook relay.
    pub relay: bool,
    /// Hot reload: watching the config file and the plugins it names.
    pub watch: bool,
}

impl Services {
    /// Everything `laneway run` starts.
    pub const ALL: Self = Self {
        api: true,
        oracles: true,
        pruner: true,
        relay: true,
        watch: true,
    };
    /// The dispatcher only.
    pub const DISPATCH_ONLY: Self = Self {
        api: false,
        oracles: false,
        pruner: false,
        relay: false,
        watch: false,
    };
}

/// What a node is built from besides its config.
pub struct Wiring {
    /// The queue, open and at the current schema.
    pub queue: Arc<dyn Queue>,
    /// The executors: the plugin host's registry, or scripted ones in tests.
    pub executors: Arc<Registry>,
    /// The plugin host (fee policies, oracles, reloads), when there is one.
    pub plugins: Option<Arc<PluginHost>>,
    /// Where the config came from: watched for hot reload and reloaded by
    /// the admin API. `None` for a config built in memory.
    pub source: Option<FileSource>,
    /// The clock.
    pub clock: Arc<dyn Clock>,
    /// The services to start.
    pub services: Services,
}

/// A running host.
pub struct Node {
    /// The dispatcher (cloning it is cheap; every clone drives the same host).
    pub dispatcher: Dispatcher,
    /// The plugin host, when the node was built with one.
    pub plugins: Option<Arc<PluginHost>>,
    api: Option<SocketAddr>,
    run: tokio::task::JoinHandle<Result<(), DispatchError>>,
}

impl Node {
    /// Opens the database the config names (refusing a schema that is not
    /// current), loads every configured plugin before anything is
    /// dispatched, and starts all services: what `laneway run` does.
    ///
    /// # Errors
    ///
    /// [`NodeError`] for what must be fixed before the host can run.
    pub async fn open(config: Config, source: Option<FileSource>) -> Result<Self, NodeError> {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let queue = queue::open(&config.database, config.limits(), clock.clone()).await?;
        queue.check_schema().await?;
        queue.register_kinds(&config.kind_registry()).await?;
        // A kind without a plugin has its ops wait (and says so in the log).
        let plugins = Arc::new(PluginHost::new(&config)?);
        crate::runtime::host::log_refused(&plugins.apply(&config).await?);
        let wiring = Wiring {
            queue,
            executors: plugins.registry(),
            plugins: Some(plugins),
            source,
            clock,
            services: Services::ALL,
        };
        Self::start(config, wiring).await
    }

    /// Starts a dispatcher on `wiring` with the services it asks for.
    ///
    /// # Errors
    ///
    /// [`NodeError::Listen`] or [`NodeError::Oracle`]; nothing is left
    /// running when it fails.
    pub async fn start(config: Config, wiring: Wiring) -> Result<Self, NodeError> {
        let Wiring {
            queue,
            executors,
            plugins,
            source,
            clock,
            services,
        } = wiring;
        // Everything that can fail is checked before any task starts.
        let listener = match config.api.listen.as_str() {
            listen if services.api && !listen.is_empty() => Some(tokio::net::TcpListener::bind(listen).await.map_err(
                |source| NodeError::Listen {
                    listen: listen.to_owned(),
                    source,
                },
            )?),
            _ => None,
        };
        let mut oracles = Vec::new();
        if let (true, Some(plugins)) = (services.oracles, &plugins) {
            for (name, oracle) in &config.oracles {
                let policy = crate::config::oracle_egress(name, &oracle.rpc_url, &config.plugins);
                let rpc = StellarRpc::new(&oracle.rpc_url, Duration::from_millis(oracle.timeout_ms), policy).map_err(
                    |e| NodeError::Oracle {
                        name: name.clone(),
                        why: e.to_string(),
                    },
                )?;
                let fee_oracle = FeeOracle::new(
                    name,
                    rpc,
                    plugins.clone(),
                    &oracle.policy,
                    oracle.config_json(),
                    queue.clone(),
                    clock.clone(),
                );
                oracles.push((name.clone(), Duration::from_millis(oracle.poll_ms), fee_oracle));
            }
        }
        let debounce = Duration::from_millis(config.runtime.reload_debounce_ms);
        let dispatcher = Dispatcher::new(queue, executors, config, clock.clone());
        if let Some(plugins) = &plugins {
            dispatcher.set_fee_policies(plugins.clone());
        }
        for (name, every, fee_oracle) in oracles {
            let (stop, live) = (dispatcher.clone(), dispatcher.clone());
            tokio::spawn(async move {
                // Settings are read live, so a reload retunes the next sample.
                let settings = move || live.config().oracles.get(&name).map(OracleConfig::config_json);
                let metrics = stop.metrics().clone();
                fee_oracle
                    .run(every, async move { stop.cancelled().await }, settings, &metrics)
                    .await;
            });
        }
        if let (true, Some(plugins), Some(source)) = (services.watch, &plugins, &source) {
            plugins.watch(source.clone(), dispatcher.clone(), debounce);
        }
        if services.pruner {
            spawn_pruner(&dispatcher, clock);
        }
        if services.relay {
            spawn_relay(&dispatcher);
        }
        let mut api = None;
        if let Some(listener) = listener {
            api = listener.local_addr().ok();
            tracing::info!(listen = ?api, "HTTP API listening (/api/v1, /api/admin, /metrics, /healthz, /readyz).");
            let reload = plugins.clone().zip(source);
            let state = crate::api::ApiState::new(dispatcher.clone(), reload);
            let stop = dispatcher.clone();
            tokio::spawn(async move {
                if let Err(e) = crate::api::serve(listener, state, async move { stop.cancelled().await }).await {
                    tracing::error!(error = %e, "The HTTP API stopped.");
                }
            });
        }
        let runner = dispatcher.clone();
        let run = tokio::spawn(async move { runner.run().await });
        Ok(Self {
            dispatcher,
            plugins,
            api,
            run,
        })
    }

    /// Where the HTTP API listens, when it was started.
    pub fn api_addr(&self) -> Option<SocketAddr> {
        self.api
    }

    /// Waits until the dispatcher stops (after [`Dispatcher::shutdown`],
    /// from a signal handler or an API call).
    ///
    /// # Errors
    ///
    /// The dispatcher's error, or [`NodeError::Joined`].
    pub async fn stopped(self) -> Result<(), NodeError> {
        self.run.await.map_err(|e| NodeError::Joined(e.to_string()))??;
        Ok(())
    }

    /// Asks the dispatcher to finish in-flight ops and stop, and waits.
    ///
    /// # Errors
    ///
    /// As [`Node::stopped`].
    pub async fn stop(self) -> Result<(), NodeError> {
        self.dispatcher.shutdown();
        self.stopped().await
    }
}

/// Runs `tick` now and then every `every(config)` (read live, so a reload
/// retunes it) until the dispatcher stops.
fn every<F, Fut>(dispatcher: &Dispatcher, period: fn(&Config) -> u64, tick: F)
where
    F: Fn(Dispatcher, Arc<Config>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let dispatcher = dispatcher.clone();
    tokio::spawn(async move {
        loop {
            let config = dispatcher.config();
            let wait = Duration::from_millis(period(&config));
            tick(dispatcher.clone(), config).await;
            tokio::select! {
                () = dispatcher.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
    });
}

/// Relays outcomes to webhooks every `outcomes.relay_every_ms`, on
/// whichever host holds the relay's lease.
fn spawn_relay(dispatcher: &Dispatcher) {
    every(
        dispatcher,
        |c| c.outcomes.relay_every_ms,
        |dispatcher, config| async move {
            if !config.kinds.values().any(|k| k.outcome_webhook.is_some()) {
                return;
            }
            let relayed =
                crate::webhook::relay_once(dispatcher.queue().as_ref(), &dispatcher, &config, dispatcher.owner()).await;
            if let Err(e) = relayed {
                tracing::warn!(error = %e, "Outcome relay failed; it goes on from its cursor next time.");
            }
        },
    );
}

/// Prunes past retention every `retention.every_ms`, on whichever host
/// holds the pruner's lease.
fn spawn_pruner(dispatcher: &Dispatcher, clock: Arc<dyn Clock>) {
    let pruner = Arc::new(crate::pruner::Pruner::new(dispatcher.queue().clone(), clock));
    every(
        dispatcher,
        |c| c.retention.every_ms,
        move |dispatcher, config| {
            let pruner = pruner.clone();
            async move {
                match pruner.run_once(&config, dispatcher.owner()).await {
                    Ok(Some(report)) => crate::events::PruneRan::Done(&report).emit(dispatcher.metrics()),
                    Ok(None) => {}
                    Err(e) => crate::events::PruneRan::Failed(&e.to_string()).emit(dispatcher.metrics()),
                }
            }
        },
    );
}

/// Resolves on ctrl-c or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut sig) => {
                sig.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
