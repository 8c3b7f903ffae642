//! A scripted in-test executor and helpers for running a dispatcher against
//! a test database until the queue settles.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use async_trait::async_trait;
use laneway::clock::SystemClock;
use laneway::config::{self, Config, FileSource};
use laneway::dispatch::Dispatcher;
use laneway::executor::{Attempt, Executor, Executors, Reconciled, Registry};
use laneway::node::{Node, Services, Wiring};
use laneway::op::{Op, OpId, Status};
use laneway::outcome::Outcome;
use laneway::queue::{prelude::*, NewOp};
use laneway::runtime::host::PluginHost;
use tokio::sync::Notify;

/// What the executor does with one attempt.
#[derive(Debug, Clone)]
pub enum Step {
    /// Confirm.
    Ok,
    /// Fail, retryable.
    Retry,
    /// Fail, retryable, asking to wait at least this long (Retry-After):
    /// full-jitter backoff alone may retry almost at once.
    RetryAfter(Duration),
    /// Fail for good.
    Permanent,
    /// Sleep this long first (to hit the kind's timeout), then confirm.
    Sleep(Duration),
    /// Wait for the gate, then confirm.
    Gate(Arc<Notify>),
}

/// One execution, as the executor saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Execution {
    pub op: OpId,
    pub lane: String,
    pub confirmed: bool,
}

#[derive(Default)]
struct State {
    /// Scripted steps per op id; an op with no script confirms.
    scripts: HashMap<OpId, VecDeque<Step>>,
    /// Every execution in the order they started.
    started: Vec<Execution>,
    /// Successful deliveries in completion order.
    delivered: Vec<Execution>,
    /// Ops executing now, per lane.
    active: HashMap<String, usize>,
    /// A strict lane was seen with two ops executing at once.
    overlap: Option<String>,
    reconciles: Vec<(OpId, String)>,
    /// Outcomes reconcile reports, per op.
    reconcile_with: HashMap<OpId, Reconciled>,
    /// The payload length of every execution, in start order.
    payload_bytes: Vec<usize>,
}

/// The scripted executor. Cheap to clone; clones share state.
#[derive(Clone, Default)]
pub struct Scripted {
    state: Arc<Mutex<State>>,
    /// Extra random delay per attempt, up to this many milliseconds.
    pub jitter_ms: u64,
    /// Lanes checked for overlap (strict lanes).
    pub strict: bool,
}

impl Scripted {
    pub fn new(jitter_ms: u64) -> Self {
        Self {
            state: Arc::default(),
            jitter_ms,
            strict: true,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn script(&self, op: OpId, steps: impl IntoIterator<Item = Step>) {
        self.lock().scripts.insert(op, steps.into_iter().collect());
    }

    pub fn reconcile_with(&self, op: OpId, result: Reconciled) {
        self.lock().reconcile_with.insert(op, result);
    }

    pub fn started(&self) -> Vec<Execution> {
        self.lock().started.clone()
    }

    pub fn delivered(&self) -> Vec<Execution> {
        self.lock().delivered.clone()
    }

    /// The payload length each execution was handed, in start order.
    pub fn payload_sizes(&self) -> Vec<usize> {
        self.lock().payload_bytes.clone()
    }

    pub fn reconciles(&self) -> Vec<(OpId, String)> {
        self.lock().reconciles.clone()
    }

    pub fn overlap(&self) -> Option<String> {
        self.lock().overlap.clone()
    }

    /// Delivered op ids per lane, in delivery order.
    pub fn delivered_by_lane(&self) -> HashMap<String, Vec<OpId>> {
        let mut by_lane: HashMap<String, Vec<OpId>> = HashMap::new();
        for e in self.delivered() {
            by_lane.entry(e.lane).or_default().push(e.op);
        }
        by_lane
    }

    /// A registry serving this executor for `kinds`.
    pub fn registry(&self, kinds: &[&str]) -> Arc<Registry> {
        let mut executors = Executors::new();
        for kind in kinds {
            executors.insert((*kind).to_owned(), Arc::new(self.clone()) as Arc<dyn Executor>);
        }
        Arc::new(Registry::new(executors))
    }
}

#[async_trait]
impl Executor for Scripted {
    async fn execute(&self, op: &Op, _attempt: Attempt) -> Outcome {
        let lane = op.lanes.first().cloned().unwrap_or_default();
        let step = {
            let mut state = self.lock();
            state.started.push(Execution {
                op: op.id,
                lane: lane.clone(),
                confirmed: false,
            });
            state.payload_bytes.push(op.payload.len());
            let active = state.active.entry(lane.clone()).or_default();
            *active += 1;
            if *active > 1 && self.strict {
                state.overlap = Some(format!("lane {lane} ran two ops at once (op {})", op.id));
            }
            state
                .scripts
                .get_mut(&op.id)
                .and_then(VecDeque::pop_front)
                .unwrap_or(Step::Ok)
        };
        // The dispatcher drops a call that runs past its deadline; the lane
        // is free again then, so the count must go down on drop too.
        let _active = Active {
            exec: self,
            lane: lane.clone(),
        };
        if self.jitter_ms > 0 {
            let ms = rand::random::<u64>() % (self.jitter_ms + 1);
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let outcome = match step {
            Step::Ok => Outcome::confirmed(),
            Step::Retry => Outcome::retry("scripted retryable failure"),
            Step::RetryAfter(wait) => Outcome::Retryable {
                reason: "scripted retryable failure".into(),
                retry_after: Some(wait),
                detail: Some("429".into()),
                fee_bump: false,
            },
            Step::Permanent => Outcome::permanent("scripted permanent failure"),
            Step::Sleep(d) => {
                tokio::time::sleep(d).await;
                Outcome::confirmed()
            }
            Step::Gate(gate) => {
                gate.notified().await;
                Outcome::confirmed()
            }
        };
        if matches!(outcome, Outcome::Confirmed { .. }) {
            self.lock().delivered.push(Execution {
                op: op.id,
                lane,
                confirmed: true,
            });
        }
        outcome
    }

    async fn reconcile(&self, op: &Op, receipt: &str, _attempt: Attempt) -> Reconciled {
        let mut state = self.lock();
        state.reconciles.push((op.id, receipt.to_owned()));
        state
            .reconcile_with
            .get(&op.id)
            .cloned()
            .unwrap_or(Reconciled::Redeliver)
    }
}

/// Counts an execution as active in its lane until dropped.
struct Active<'a> {
    exec: &'a Scripted,
    lane: String,
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        if let Some(active) = self.exec.lock().active.get_mut(&self.lane) {
            *active -= 1;
        }
    }
}

/// Config for dispatcher tests: fast polls and tiny backoffs.
pub fn fast_config(extra: &str) -> anyhow::Result<Config> {
    let base = r#"
        [queue]
        lease_ms = 2000
        [dispatch]
        poll_ms = 25
        slot_ttl_ms = 1000
        shutdown_grace_ms = 2000
        [kinds.activitypub]
        backoff_base_ms = 5
        backoff_max_ms = 20
        [kinds.signer]
        lane_mode = "serial"
        backoff_base_ms = 150
        backoff_max_ms = 150
    "#;
    config::from_layers(&[base, extra]).context("test config")
}

/// A dispatcher running in the background, started by the host's own
/// composition root with the dispatcher alone (no API, oracles, pruner or
/// relay to race a test's assertions).
pub struct Running {
    pub dispatcher: Dispatcher,
    node: Node,
}

impl Running {
    pub async fn start(queue: Arc<dyn Queue>, executors: Arc<Registry>, config: Config) -> anyhow::Result<Self> {
        Self::with(queue, executors, None, config).await
    }

    /// As [`Running::start`], with the plugin host's fee policies.
    pub async fn with(
        queue: Arc<dyn Queue>,
        executors: Arc<Registry>,
        plugins: Option<Arc<PluginHost>>,
        config: Config,
    ) -> anyhow::Result<Self> {
        Self::wired(queue, executors, plugins, None, Services::DISPATCH_ONLY, config).await
    }

    /// The dispatcher and its HTTP API on a free loopback port (what
    /// `api.listen` says is replaced); `plugins` and their config file
    /// serve the reload routes.
    pub async fn with_api(
        queue: Arc<dyn Queue>,
        executors: Arc<Registry>,
        plugins: Option<(Arc<PluginHost>, FileSource)>,
        mut config: Config,
    ) -> anyhow::Result<(Self, std::net::SocketAddr)> {
        config.api.listen = "127.0.0.1:0".to_owned();
        let (plugins, source) = plugins.unzip();
        let api = Services {
            api: true,
            ..Services::DISPATCH_ONLY
        };
        let running = Self::wired(queue, executors, plugins, source, api, config).await?;
        let addr = running.node.api_addr().context("the API did not start")?;
        Ok((running, addr))
    }

    /// The plugins' dispatcher, hot-reloading when `source` or a plugin
    /// file changes, as `laneway run` does.
    pub async fn watching(
        queue: Arc<dyn Queue>,
        plugins: Arc<PluginHost>,
        source: FileSource,
        config: Config,
    ) -> anyhow::Result<Self> {
        let watch = Services {
            watch: true,
            ..Services::DISPATCH_ONLY
        };
        Self::wired(queue, plugins.registry(), Some(plugins), Some(source), watch, config).await
    }

    async fn wired(
        queue: Arc<dyn Queue>,
        executors: Arc<Registry>,
        plugins: Option<Arc<PluginHost>>,
        source: Option<FileSource>,
        services: Services,
        config: Config,
    ) -> anyhow::Result<Self> {
        let wiring = Wiring {
            queue,
            executors,
            plugins,
            source,
            clock: Arc::new(SystemClock),
            services,
        };
        let node = Node::start(config, wiring).await?;
        Ok(Self {
            dispatcher: node.dispatcher.clone(),
            node,
        })
    }

    pub async fn stop(self) -> anyhow::Result<()> {
        tokio::time::timeout(Duration::from_secs(10), self.node.stop())
            .await
            .context("dispatcher did not stop")??;
        Ok(())
    }
}

/// Waits until no op is pending or submitted.
pub async fn settle(queue: &dyn Queue, within: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let depth = queue.depth().await?;
        let open: i64 = depth
            .iter()
            .filter(|d| matches!(d.status, Status::Pending | Status::Submitted))
            .map(|d| d.count)
            .sum();
        if open == 0 {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!("queue did not settle within {within:?}: {depth:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// An activitypub op to one lane.
pub fn to(outbox: &str, lane: &str, n: u32) -> NewOp {
    let mut op = NewOp::new(outbox, "activitypub", format!(r#"{{"n":{n}}}"#));
    op.lanes = vec![lane.to_owned()];
    op
}
