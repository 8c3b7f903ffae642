//! Channel-account pools as the dispatcher uses them: which accounts a
//! kind's transactions may come from, dealing each new op one of them, and
//! recognising an op's channel when it runs.
//!
//! A channel is a Stellar account whose only job is to be the source (and
//! the sequence number) of transactions whose contract calls the kind's
//! signer authorises. The lane of an op is its channel's account, so the
//! lane rule gives exactly one transaction in flight per channel, and a
//! receipt in doubt holds its channel, never the pool. An op is dealt its
//! channel at enqueue because an op's lanes are fixed from then on (the
//! lane guard, the occupancy index and the receipt rule all read them);
//! dealing round-robin over the active channels keeps a burst's backlogs
//! within one op of each other. The turn starts at a random channel, so
//! one-op enqueues from short-lived processes (`laneway enqueue`) spread
//! too. A channel held by a receipt in doubt (a transaction that may
//! still land, waiting to be reconciled: up to its ledger bound) is passed
//! over while another active channel is free of one, as the dispatcher
//! reports them before it deals ([`Pool::hold`]).

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::config::PoolConfig;
use crate::keys::KeyStore;

/// One channel account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Channel {
    /// Its `[keys.ID]`.
    pub key: String,
    /// Its `G…` account (the op's lane).
    pub account: String,
    /// Takes no new ops.
    pub retired: bool,
}

/// A pool, resolved against the loaded keys.
#[derive(Debug)]
pub struct Pool {
    /// `[pools.NAME]`.
    pub name: String,
    /// Every channel, retired ones included (their ops still run).
    pub channels: Vec<Channel>,
    next: AtomicUsize,
    /// Accounts held by a receipt in doubt, as last reported.
    held: Mutex<HashSet<String>>,
}

/// Why a pool cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// A channel's key is not loaded or is not an ed25519 key.
    #[error("pools.{pool}: channel {key:?} is not a loaded ed25519 key")]
    NotAKey {
        /// The pool.
        pool: String,
        /// The key id.
        key: String,
    },
    /// Every channel is retired.
    #[error("pools.{0}: every channel is retired, so no new op can be dealt one")]
    AllRetired(String),
}

impl Pool {
    /// Resolves a pool's channels to their accounts.
    ///
    /// # Errors
    ///
    /// [`PoolError::NotAKey`] for a channel that is not a loaded ed25519 key.
    pub fn resolve(name: &str, config: &PoolConfig, keys: &KeyStore) -> Result<Self, PoolError> {
        let channels = config
            .channels
            .iter()
            .map(|key| {
                let account = keys
                    .get(key)
                    .and_then(crate::keys::Key::stellar_account)
                    .ok_or_else(|| PoolError::NotAKey {
                        pool: name.to_owned(),
                        key: key.clone(),
                    })?;
                Ok(Channel {
                    key: key.clone(),
                    account,
                    retired: config.retired.contains(key),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::new(name, channels))
    }

    /// A pool of these channels, dealing from a random one on.
    pub fn new(name: &str, channels: Vec<Channel>) -> Self {
        Self {
            name: name.to_owned(),
            channels,
            next: AtomicUsize::new(rand::random::<u16>().into()),
            held: Mutex::new(HashSet::new()),
        }
    }

    /// The channel accounts a receipt in doubt holds now (the dispatcher
    /// reads them from the queue before it deals a batch).
    pub fn hold(&self, accounts: HashSet<String>) {
        *self.held.lock().unwrap_or_else(PoisonError::into_inner) = accounts;
    }

    /// The channel the next op goes to: the active channels in turn.
    ///
    /// # Errors
    ///
    /// [`PoolError::AllRetired`].
    pub fn deal(&self) -> Result<&Channel, PoolError> {
        let active: Vec<&Channel> = self.channels.iter().filter(|c| !c.retired).collect();
        if active.is_empty() {
            return Err(PoolError::AllRetired(self.name.clone()));
        }
        let free: Vec<&Channel> = {
            // A plain set: consistent even if a holder panicked.
            let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
            active.iter().copied().filter(|c| !held.contains(&c.account)).collect()
        };
        let from = if free.is_empty() { active } else { free };
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        Ok(from[turn % from.len()])
    }

    /// The op's channel, when its lanes are exactly one of the pool's
    /// accounts (retired ones included).
    pub fn channel_of(&self, lanes: &[String]) -> Option<&Channel> {
        match lanes {
            [lane] => self.channels.iter().find(|c| &c.account == lane),
            _ => None,
        }
    }

    /// What the plugin is told of the pool, merged into the kind's config
    /// under `pool`: each channel account's key id, so the plugin can have
    /// the host sign with the channel its op was dealt.
    pub fn plugin_view(&self) -> serde_json::Value {
        let channels: serde_json::Map<String, serde_json::Value> = self
            .channels
            .iter()
            .map(|c| (c.account.clone(), serde_json::Value::String(c.key.clone())))
            .collect();
        serde_json::json!({ "name": self.name, "channels": channels })
    }
}

/// The kind's plugin config as JSON, with its pool's view under `pool`.
pub fn config_json(kind: &crate::config::KindConfig, pool: Option<&Pool>) -> String {
    let Some(pool) = pool else {
        return kind.config_json();
    };
    let mut value = serde_json::to_value(&kind.config).unwrap_or_else(|_| serde_json::json!({}));
    if let Some(map) = value.as_object_mut() {
        map.insert("pool".to_owned(), pool.plugin_view());
    }
    value.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn channel(n: u8, retired: bool) -> Channel {
        Channel {
            key: format!("chan-{n}"),
            account: format!("G{n}"),
            retired,
        }
    }

    #[test]
    fn ops_are_dealt_the_active_channels_in_turn() {
        let pool = Pool::new("p", vec![channel(1, false), channel(2, true), channel(3, false)]);
        let dealt: Vec<String> = (0..6)
            .map(|_| pool.deal().map(|c| c.key.clone()).unwrap_or_default())
            .collect();
        let one = dealt[0].as_str();
        let other = if one == "chan-1" { "chan-3" } else { "chan-1" };
        assert_eq!(dealt, [one, other, one, other, one, other], "{dealt:?}");
    }

    #[test]
    fn a_channel_held_by_a_receipt_in_doubt_is_passed_over_while_another_is_free() {
        let pool = Pool::new("p", vec![channel(1, false), channel(2, false), channel(3, false)]);
        pool.hold(HashSet::from(["G2".to_owned()]));
        let dealt: HashSet<String> = (0..6)
            .map(|_| pool.deal().map(|c| c.key.clone()).unwrap_or_default())
            .collect();
        assert_eq!(dealt, HashSet::from(["chan-1".to_owned(), "chan-3".to_owned()]));
        // All held: dealt as if none were (the ops wait their turn).
        pool.hold(HashSet::from(["G1".to_owned(), "G2".to_owned(), "G3".to_owned()]));
        let dealt: HashSet<String> = (0..6)
            .map(|_| pool.deal().map(|c| c.key.clone()).unwrap_or_default())
            .collect();
        assert_eq!(dealt.len(), 3);
    }

    #[test]
    fn a_pool_with_every_channel_retired_deals_none() {
        let pool = Pool::new("p", vec![channel(1, true)]);
        assert_eq!(pool.deal(), Err(PoolError::AllRetired("p".to_owned())));
    }

    #[test]
    fn an_op_belongs_to_a_channel_only_when_its_one_lane_is_one() {
        let pool = Pool::new("p", vec![channel(1, false), channel(2, true)]);
        assert_eq!(
            pool.channel_of(&["G2".to_owned()]).map(|c| c.key.as_str()),
            Some("chan-2")
        );
        assert_eq!(pool.channel_of(&["G9".to_owned()]), None);
        assert_eq!(pool.channel_of(&["G1".to_owned(), "G2".to_owned()]), None);
        assert_eq!(pool.channel_of(&[]), None);
    }
}
