//! Channel-account pools as the dispatcher uses them: which accounts a
//! kind's transactions may come from, dealing each new op one of them,
//! re-dealing waiting ops as channels free up, and recognising an op's
//! channel when it runs.
//!
//! A channel is a Stellar account whose only job is to be the source (and
//! the sequence number) of transactions whose contract calls the kind's
//! signer authorises. The lane of an op is its channel's account, so the
//! lane rule gives exactly one transaction in flight per channel, and a
//! receipt in doubt holds its channel, never the pool. An op is dealt its
//! channel at enqueue (the lane guard, the occupancy index and the receipt
//! rule all read an op's lanes): round-robin over the active channels from
//! a random start, passing over a channel a receipt in doubt holds
//! ([`Pool::hold`]). From then on [`redeal`] moves ops that wait with no
//! receipt to whichever channel is free, so an op takes any free channel
//! and the pool's priorities hold across its channels.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::config::{FeePayer, PoolConfig};
use crate::keys::KeyStore;
use crate::op::{OpId, Priority};
use crate::queue::Redeal;

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
    /// Who pays the transactions' fees.
    pub fee_payer: FeePayer,
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
        Ok(Self {
            fee_payer: config.fee_payer,
            ..Self::new(name, channels)
        })
    }

    /// A pool of these channels, dealing from a random one on.
    pub fn new(name: &str, channels: Vec<Channel>) -> Self {
        Self {
            name: name.to_owned(),
            channels,
            next: AtomicUsize::new(rand::random::<u16>().into()),
            fee_payer: FeePayer::Channel,
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
    /// the host sign with the channel its op was dealt, and who pays.
    pub fn plugin_view(&self) -> serde_json::Value {
        let channels: serde_json::Map<String, serde_json::Value> = self
            .channels
            .iter()
            .map(|c| (c.account.clone(), serde_json::Value::String(c.key.clone())))
            .collect();
        serde_json::json!({ "name": self.name, "channels": channels, "fee_payer": self.fee_payer })
    }
}

/// One channel as a re-deal sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelLoad {
    /// Its account (the lane).
    pub account: String,
    /// Takes ops (not retired).
    pub active: bool,
    /// A receipt in doubt holds it: its next transaction waits for the
    /// reconcile, up to the ledger bound.
    pub held: bool,
    /// An op occupies it now (in flight or in doubt).
    pub busy: bool,
    /// The ops waiting on it with no receipt, in dispatch order.
    pub waiting: Vec<(Priority, OpId)>,
}

/// Which waiting ops move to which channel, so that ops take any free
/// channel: every op waiting behind a channel a receipt in doubt holds, or
/// on a retired channel, moves to an active free one; an idle channel takes
/// the pool's first waiting op (priority order kept across the pool, not
/// only per channel). Backlogs of channels that are sending are not
/// levelled: an idle channel taking work is enough to finish a burst
/// together, and levelling busy channels moved ops on every ledger's
/// one-op jitter: at 250 ms ledgers it cost a signer-paying pool of 8 up to
/// a third of its throughput (`laneway bench --only stellar-pool`). Only
/// waiting ops with no receipt are ever given (nothing of them can be on
/// chain, so their channel says only which account will send them). Each op
/// moves at most once per plan.
pub fn redeal(channels: &[ChannelLoad]) -> Vec<Redeal> {
    let targets: Vec<usize> = (0..channels.len())
        .filter(|&i| channels[i].active && !channels[i].held)
        .collect();
    if targets.is_empty() {
        return Vec::new();
    }
    let mut queues: Vec<Vec<(Priority, OpId)>> = channels
        .iter()
        .map(|c| {
            let mut w = c.waiting.clone();
            w.sort_unstable();
            w
        })
        .collect();
    let load = |queues: &[Vec<(Priority, OpId)>], i: usize| queues[i].len() + usize::from(channels[i].busy);
    // Ops on channels that cannot send them soon, in dispatch order.
    let mut donors: Vec<((Priority, OpId), usize)> = Vec::new();
    for (i, c) in channels.iter().enumerate() {
        if c.held || !c.active {
            donors.extend(queues[i].drain(..).map(|k| (k, i)));
        }
    }
    donors.sort_unstable();
    let mut donors: std::collections::VecDeque<_> = donors.into();
    let mut home: std::collections::HashMap<OpId, usize> = std::collections::HashMap::new();
    let mut place = |queues: &mut Vec<Vec<(Priority, OpId)>>, key: (Priority, OpId), from: usize, to: usize| {
        home.entry(key.1).or_insert(from);
        let at = queues[to].partition_point(|k| *k < key);
        queues[to].insert(at, key);
    };
    // An idle channel takes the first op that would otherwise wait: a
    // donor's, or one queued behind another channel's next op.
    for &t in &targets {
        if load(&queues, t) > 0 {
            continue;
        }
        let behind = targets
            .iter()
            .filter(|&&o| o != t && load(&queues, o) >= 2)
            .map(|&o| {
                let skip = usize::from(!channels[o].busy);
                (queues[o][skip], o, skip)
            })
            .min();
        match (donors.front().copied(), behind) {
            (Some((key, from)), Some((other, _, _))) if key <= other => {
                donors.pop_front();
                place(&mut queues, key, from, t);
            }
            (_, Some((key, from, at))) => {
                queues[from].remove(at);
                place(&mut queues, key, from, t);
            }
            (Some((key, from)), None) => {
                donors.pop_front();
                place(&mut queues, key, from, t);
            }
            (None, None) => {}
        }
    }
    // The rest of the donors' ops, each to the least loaded channel.
    while let Some((key, from)) = donors.pop_front() {
        if let Some(&t) = targets.iter().min_by_key(|&&t| load(&queues, t)) {
            place(&mut queues, key, from, t);
        }
    }
    let mut moves: Vec<Redeal> = Vec::new();
    for (to, queue) in queues.iter().enumerate() {
        for (_, op) in queue {
            if let Some(&from) = home.get(op) {
                if from != to {
                    moves.push(Redeal {
                        op: *op,
                        from: channels[from].account.clone(),
                        to: channels[to].account.clone(),
                    });
                }
            }
        }
    }
    moves.sort_by_key(|m| m.op);
    moves
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

    fn load(account: &str, held: bool, busy: bool, waiting: &[(Priority, OpId)]) -> ChannelLoad {
        ChannelLoad {
            account: account.to_owned(),
            active: true,
            held,
            busy,
            waiting: waiting.to_vec(),
        }
    }

    fn moves(plan: &[Redeal]) -> Vec<(OpId, &str, &str)> {
        plan.iter().map(|m| (m.op, m.from.as_str(), m.to.as_str())).collect()
    }

    const N: Priority = Priority::Normal;

    #[test]
    fn ops_behind_a_channel_in_doubt_move_to_the_free_ones_first_ops_to_idle_channels() {
        let plan = redeal(&[
            load("A", true, true, &[(N, 1), (N, 4), (N, 7)]),
            load("B", false, false, &[]),
            load("C", false, true, &[]),
        ]);
        // B is idle: it takes op 1; then each to the least loaded (B and C
        // tie at one: the first), so 4 to B and 7 to C.
        assert_eq!(moves(&plan), [(1, "A", "B"), (4, "A", "B"), (7, "A", "C")]);
    }

    #[test]
    fn an_idle_channel_takes_the_pools_first_waiting_op_whatever_channel_it_was_dealt() {
        // A critical op dealt behind A's transaction in flight; B idle.
        let plan = redeal(&[
            load("A", false, true, &[(Priority::Critical, 9), (Priority::Low, 2)]),
            load("B", false, false, &[]),
        ]);
        assert_eq!(moves(&plan), [(9, "A", "B")]);
    }

    #[test]
    fn a_channels_next_op_stays_when_the_channel_is_free_to_send_it() {
        let plan = redeal(&[load("A", false, false, &[(N, 1)]), load("B", false, false, &[])]);
        assert!(plan.is_empty(), "{plan:?}");
        let plan = redeal(&[load("A", false, false, &[(N, 1), (N, 2)]), load("B", false, false, &[])]);
        assert_eq!(moves(&plan), [(2, "A", "B")]);
    }

    #[test]
    fn a_retired_channels_waiting_ops_move_to_the_active_ones() {
        let mut retired = load("A", false, true, &[(N, 1), (N, 2)]);
        retired.active = false;
        let plan = redeal(&[retired, load("B", false, true, &[]), load("C", false, true, &[])]);
        assert_eq!(moves(&plan), [(1, "A", "B"), (2, "A", "C")]);
    }

    #[test]
    fn busy_channels_keep_uneven_backlogs_and_an_idle_one_takes_one_op_a_read() {
        let uneven_and_sending = [
            load("A", false, true, &[(N, 1), (N, 2), (N, 3), (N, 4), (N, 5)]),
            load("B", false, true, &[(N, 6)]),
        ];
        assert!(redeal(&uneven_and_sending).is_empty());
        let one_idle = [
            load("A", false, true, &[(N, 1), (N, 2), (N, 3), (N, 4), (N, 5)]),
            load("B", false, false, &[]),
        ];
        // The first op that would wait, not the tail: it goes next.
        assert_eq!(moves(&redeal(&one_idle)), [(1, "A", "B")]);
    }

    #[test]
    fn nothing_moves_when_every_channel_is_held_or_retired() {
        let mut retired = load("B", false, false, &[]);
        retired.active = false;
        assert!(redeal(&[load("A", true, true, &[(N, 1)]), retired]).is_empty());
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
