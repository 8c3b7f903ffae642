//! [`WasmExecutor`]: a plugin serving one kind, as the dispatcher's
//! [`Executor`], converting between laneway's types and the WIT ones.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::bindings::executor::laneway::plugin::types as wit;
use super::plugin::Plugin;
use crate::executor::{Attempt, Executor, Reconciled};
use crate::op::{Op, Priority};
use crate::outcome::Outcome;

/// One kind served by one loaded plugin version.
#[derive(Debug)]
pub struct WasmExecutor {
    plugin: Arc<Plugin>,
    config_json: String,
    /// The plugin owns the kind's lanes (`lanes = "plugin"`): an op whose
    /// lanes leave out the plugin's is refused before anything is sent,
    /// however it was written (plain SQL included).
    owns_lanes: bool,
    /// The kind's channel-account pool: its ops' lanes are channels dealt
    /// from it, not the plugin's.
    pool: Option<Arc<crate::pool::Pool>>,
}

impl WasmExecutor {
    /// Serves a kind whose `config` table is `config_json`.
    pub fn new(
        plugin: Arc<Plugin>,
        config_json: String,
        owns_lanes: bool,
        pool: Option<Arc<crate::pool::Pool>>,
    ) -> Self {
        Self {
            plugin,
            config_json,
            owns_lanes,
            pool,
        }
    }

    /// The plugin version behind it.
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.plugin
    }

    fn op(&self, op: &Op) -> wit::Op {
        wit::Op {
            id: op.id,
            kind: op.kind.clone(),
            outbox: op.outbox.clone(),
            priority: match op.priority {
                Priority::Critical => wit::Priority::Critical,
                Priority::Normal => wit::Priority::Normal,
                Priority::Low => wit::Priority::Low,
            },
            attempt: u32::try_from(op.budget_attempts()).unwrap_or(0),
            fee_bumps: u32::try_from(op.fee_bumps).unwrap_or(0),
            lanes: op.lanes.clone(),
            payload: op.payload.clone(),
            receipt: op.receipt.clone(),
            subject: op.subject.clone(),
            correlation_id: op.correlation_id.clone(),
            config: self.config_json.clone(),
        }
    }
}

/// The WIT outcome in laneway's terms.
pub fn outcome(o: wit::Outcome) -> Outcome {
    match o {
        wit::Outcome::Confirmed(c) => Outcome::Confirmed {
            receipt: c.receipt,
            detail: c.detail,
        },
        wit::Outcome::Retryable(r) => Outcome::Retryable {
            reason: r.reason,
            retry_after: r.retry_after_ms.map(Duration::from_millis),
            detail: r.detail,
            fee_bump: r.fee_bump,
        },
        wit::Outcome::Permanent(p) => Outcome::Permanent {
            reason: p.reason,
            detail: p.detail,
        },
    }
}

#[async_trait]
impl Executor for WasmExecutor {
    async fn execute(&self, op: &Op, attempt: Attempt) -> Outcome {
        if self.owns_lanes {
            // Every way laneway enqueues fills them in: an op without
            // lanes was written around it and would run outside the lane
            // that keeps the plugin's one transaction in flight.
            if op.lanes.is_empty() {
                return Outcome::permanent(
                    "refused before sending: the kind's plugin owns its lanes and the op carries none (written \
                     around laneway)",
                );
            }
            let named = match self.plugin_lanes(&op.kind, &op.outbox, &op.payload).await {
                Ok(named) => named,
                Err(why) => return Outcome::permanent(format!("the plugin refused the op's lanes: {why}")),
            };
            // A pool's op runs on the one channel it was dealt; an op
            // enqueued before the kind had a pool keeps the plugin's lanes.
            let dealt = self.pool.as_ref().is_some_and(|p| p.channel_of(&op.lanes).is_some());
            if let (false, Some(pool), [lane]) = (dealt, &self.pool, op.lanes.as_slice()) {
                // Dealt a channel the operator has since taken out of the
                // pool: a config mistake, so it waits rather than failing
                // (`laneway stellar channels list` shows a channel's open
                // ops; retire it, and remove it once drained).
                if !named.contains(lane) && stellar_strkey::ed25519::PublicKey::from_string(lane).is_ok() {
                    return Outcome::Retryable {
                        reason: format!(
                            "its channel {lane} is no longer in pool {:?}: put it back (retired, it drains) or \
                             cancel the op",
                            pool.name
                        ),
                        retry_after: Some(Duration::from_secs(60)),
                        detail: Some("channel".to_owned()),
                        fee_bump: false,
                    };
                }
            }
            if !dealt {
                if let Err(e) = crate::enqueue::owned_lanes(&op.kind, op.lanes.clone(), named) {
                    return Outcome::permanent(format!("refused before sending: {e}"));
                }
            }
        }
        match self.plugin.execute(self.op(op), attempt).await {
            Ok(o) => outcome(o),
            Err(failure) => failure.into_outcome(),
        }
    }

    async fn reconcile(&self, op: &Op, receipt: &str, attempt: Attempt) -> Reconciled {
        match self.plugin.reconcile(self.op(op), receipt.to_owned(), attempt).await {
            Ok(wit::Reconciled::Settled(o)) => Reconciled::Settled(outcome(o)),
            Ok(wit::Reconciled::Redeliver) => Reconciled::Redeliver,
            Err(failure) => Reconciled::Settled(failure.into_outcome()),
        }
    }

    /// The plugin's lanes for a new op; for a kind with a pool, the plugin
    /// still judges the payload, and the op is dealt a channel.
    async fn lanes(&self, kind: &str, outbox: &str, payload: &str) -> Result<Vec<String>, String> {
        let named = self.plugin_lanes(kind, outbox, payload).await?;
        match &self.pool {
            None => Ok(named),
            Some(pool) => pool
                .deal()
                .map(|channel| vec![channel.account.clone()])
                .map_err(|e| e.to_string()),
        }
    }

    fn available(&self) -> bool {
        !self.plugin.health.quarantined()
    }

    fn pool(&self) -> Option<Arc<crate::pool::Pool>> {
        self.pool.clone()
    }
}

impl WasmExecutor {
    async fn plugin_lanes(&self, kind: &str, outbox: &str, payload: &str) -> Result<Vec<String>, String> {
        let input = wit::OpInput {
            kind: kind.to_owned(),
            outbox: outbox.to_owned(),
            payload: payload.to_owned(),
            config: self.config_json.clone(),
        };
        match self.plugin.lanes(input).await {
            Ok(result) => result,
            Err(failure) => Err(failure.to_string()),
        }
    }
}
