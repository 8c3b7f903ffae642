//! The fee oracle: polls Stellar RPC (`getFeeStats`) on a cadence, folds
//! each sample into the shared snapshot through the fee-policy plugin, and
//! stores the result in the database so every host quotes from the same
//! view. A failed poll leaves the snapshot to go stale; the policy then falls
//! back to the default base fee.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::clock::Clock;
use crate::fees::{FeeSample, FeeSnapshot};
use crate::queue::{Queue, QueueError};
use crate::runtime::host::PluginHost;
use crate::runtime::policy::PolicyError;

/// Why a poll did not store a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum OracleError {
    /// The RPC call failed or answered something unexpected.
    #[error("stellar rpc: {0}")]
    Rpc(String),
    /// The policy failed.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The database failed.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// The stored snapshot could not be read.
    #[error(transparent)]
    Stored(#[from] crate::pricing::PricingError),
}

/// A minimal Stellar RPC client: JSON-RPC 2.0 over HTTP POST, named params,
/// through the egress guard.
#[derive(Debug)]
pub struct StellarRpc {
    http: crate::egress::Guarded,
    url: String,
    next_id: AtomicU64,
}

/// The largest RPC answer read (`getFeeStats` is under 2 KiB).
const MAX_RPC_RESPONSE: usize = 1024 * 1024;

fn fee_field(dist: &Value, key: &str) -> Result<u64, OracleError> {
    // Fees and the transaction count are strings on the wire (Go `,string` tags).
    match &dist[key] {
        Value::String(s) => s
            .parse()
            .map_err(|_| OracleError::Rpc(format!("{key} is not a number: {s:?}"))),
        Value::Number(n) => n
            .as_u64()
            .ok_or_else(|| OracleError::Rpc(format!("{key} is not a u64"))),
        other => Err(OracleError::Rpc(format!("{key} missing or malformed: {other}"))),
    }
}

impl StellarRpc {
    /// A client for the RPC server at `url`, reaching what `policy` allows
    /// (`config::oracle_egress`: the plugins that list the URL).
    ///
    /// # Errors
    ///
    /// [`OracleError::Rpc`] when the HTTP client cannot be built or the
    /// policy refuses the URL.
    pub fn new(url: &str, timeout: Duration, policy: crate::egress::Egress) -> Result<Self, OracleError> {
        policy
            .check(url)
            .map_err(|refusal| OracleError::Rpc(format!("refused: {refusal}")))?;
        let options = crate::egress::Options {
            connect_timeout: timeout,
            timeout,
            ..crate::egress::Options::default()
        };
        let http = crate::egress::Guarded::new(policy, options).map_err(OracleError::Rpc)?;
        Ok(Self {
            http,
            url: url.to_owned(),
            next_id: AtomicU64::new(1),
        })
    }

    /// Calls `method` and returns its `result`.
    ///
    /// # Errors
    ///
    /// [`OracleError::Rpc`] for transport errors and JSON-RPC errors.
    pub async fn call(&self, method: &str, params: Option<Value>) -> Result<Value, OracleError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut request = json!({ "jsonrpc": "2.0", "id": id, "method": method });
        if let Some(params) = params {
            request["params"] = params;
        }
        let response = self
            .http
            .request(reqwest::Method::POST, &self.url)
            .map_err(|refusal| OracleError::Rpc(format!("{method}: refused: {refusal}")))?
            .header("content-type", "application/json")
            .body(request.to_string())
            .send()
            .await
            .map_err(|e| OracleError::Rpc(format!("{method}: {}", crate::egress::client::describe(&e))))?;
        let body = crate::egress::client::read_capped(response, MAX_RPC_RESPONSE)
            .await
            .map_err(|e| OracleError::Rpc(format!("{method}: {e}")))?;
        let response: Value =
            serde_json::from_slice(&body).map_err(|e| OracleError::Rpc(format!("{method}: bad response: {e}")))?;
        if let Some(error) = response.get("error") {
            return Err(OracleError::Rpc(format!("{method}: {error}")));
        }
        response
            .get("result")
            .cloned()
            .ok_or_else(|| OracleError::Rpc(format!("{method}: no result")))
    }

    /// `getFeeStats`: the Soroban inclusion-fee distribution.
    ///
    /// # Errors
    ///
    /// [`OracleError::Rpc`].
    pub async fn fee_sample(&self) -> Result<FeeSample, OracleError> {
        let result = self.call("getFeeStats", None).await?;
        let dist = &result["sorobanInclusionFee"];
        let count = |key: &str| fee_field(dist, key).map(|v| u32::try_from(v).unwrap_or(u32::MAX));
        Ok(FeeSample {
            min: fee_field(dist, "min")?,
            mode: fee_field(dist, "mode")?,
            p50: fee_field(dist, "p50")?,
            p70: fee_field(dist, "p70")?,
            p90: fee_field(dist, "p90")?,
            p95: fee_field(dist, "p95")?,
            p99: fee_field(dist, "p99")?,
            max: fee_field(dist, "max")?,
            transaction_count: count("transactionCount")?,
            ledger_count: count("ledgerCount")?,
            latest_ledger: result["latestLedger"]
                .as_u64()
                .and_then(|l| u32::try_from(l).ok())
                .ok_or_else(|| OracleError::Rpc("latestLedger missing".into()))?,
        })
    }
}

/// One oracle: an RPC endpoint, a policy, and the snapshot's name.
pub struct FeeOracle {
    name: String,
    rpc: StellarRpc,
    /// Looked up on every poll, so a reloaded policy takes effect.
    plugins: Arc<PluginHost>,
    policy: String,
    /// The policy's settings (JSON); replaced when the config reloads.
    config: arc_swap::ArcSwap<String>,
    queue: Arc<dyn Queue>,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for FeeOracle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FeeOracle")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl FeeOracle {
    /// An oracle storing its snapshot as `name`, folding samples through
    /// the fee policy `policy` loaded by `plugins`.
    pub fn new(
        name: &str,
        rpc: StellarRpc,
        plugins: Arc<PluginHost>,
        policy: &str,
        config: String,
        queue: Arc<dyn Queue>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Self {
            name: name.to_owned(),
            rpc,
            plugins,
            policy: policy.to_owned(),
            config: arc_swap::ArcSwap::from_pointee(config),
            queue,
            clock,
        }
    }

    /// The stored snapshot, if any.
    ///
    /// # Errors
    ///
    /// A database error, or a stored snapshot that does not parse.
    pub async fn snapshot(&self) -> Result<Option<FeeSnapshot>, OracleError> {
        Ok(crate::pricing::stored_snapshot(self.queue.as_ref(), &self.name).await?)
    }

    /// One poll: sample, fold, store.
    ///
    /// # Errors
    ///
    /// [`OracleError`]; nothing is stored then.
    pub async fn poll_once(&self) -> Result<FeeSnapshot, OracleError> {
        let sample = self.rpc.fee_sample().await?;
        let previous = self.snapshot().await?;
        let now = self.clock.now();
        let policy = self
            .plugins
            .fee_policy(&self.policy)
            .ok_or_else(|| OracleError::Rpc(format!("fee policy {:?} is not loaded", self.policy)))?;
        let snapshot = policy
            .observe(previous.as_ref(), sample, now.timestamp_millis(), &self.config.load())
            .await?;
        let json = serde_json::to_string(&snapshot).map_err(|e| OracleError::Rpc(e.to_string()))?;
        self.queue.put_fee_snapshot(&self.name, &json, now).await?;
        Ok(snapshot)
    }

    /// Polls every `every` until `stop` resolves, logging failures. Before
    /// each poll `settings` is asked for the policy's current settings, so
    /// a reloaded config takes effect at the next sample.
    pub async fn run(
        &self,
        every: Duration,
        stop: impl std::future::Future<Output = ()>,
        settings: impl Fn() -> Option<String>,
        metrics: &crate::events::Metrics,
    ) {
        tokio::pin!(stop);
        loop {
            if let Some(json) = settings() {
                self.config.store(Arc::new(json));
            }
            match self.poll_once().await {
                Ok(snapshot) => crate::events::OraclePolled::Stored {
                    oracle: &self.name,
                    snapshot: &snapshot,
                }
                .emit(metrics),
                Err(e) => crate::events::OraclePolled::Failed {
                    oracle: &self.name,
                    error: &e.to_string(),
                }
                .emit(metrics),
            }
            tokio::select! {
                () = &mut stop => return,
                () = tokio::time::sleep(every) => {}
            }
        }
    }
}
