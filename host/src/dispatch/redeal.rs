//! Re-dealing a drain's waiting pool ops across the pool's channels at each
//! full read of its book, so an op takes any free channel rather than the
//! one it was dealt at enqueue: the ops behind a channel a receipt in doubt
//! holds, or on a retired one, move to free channels, an idle channel takes
//! the pool's first waiting op, and backlogs level ([`crate::pool::redeal`]
//! decides; the queue moves each op by compare-and-set and records it).
//!
//! Only this outbox's drain moves this outbox's ops, and only ops waiting
//! with no receipt: nothing of them can be on chain, so which channel sends
//! them is free to change. The claim reads an op's lanes from its row, so
//! a book that read the op before it moved can never start it on the old
//! channel; the drain reads its book again after a move anyway.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use tracing::{debug, warn};

use super::Inner;
use crate::pool::{ChannelLoad, Pool};
use crate::queue::BookRow;

/// Moves this outbox's waiting pool ops where [`crate::pool::redeal`] says;
/// whether any moved. A failure is logged and changes nothing: the ops stay
/// dealt as they were, which is always safe.
pub(super) async fn redeal(inner: &Inner, outbox: &str, rows: &[BookRow]) -> bool {
    // Most hosts have no pool: their full reads pay nothing here.
    if inner.config.load().pools.is_empty() {
        return false;
    }
    let mut pools: BTreeMap<String, (Arc<Pool>, Vec<&BookRow>)> = BTreeMap::new();
    // One registry lookup per kind, not per row.
    let mut pool_of: HashMap<&str, Option<Arc<Pool>>> = HashMap::new();
    for row in rows {
        if row.in_flight || row.in_doubt {
            continue;
        }
        let Some(pool) = pool_of
            .entry(row.kind.as_str())
            .or_insert_with(|| inner.executors.pool_of(&row.kind))
        else {
            continue;
        };
        if pool.channel_of(&row.lanes).is_none() {
            continue;
        }
        pools
            .entry(pool.name.clone())
            .or_insert_with(|| (pool.clone(), Vec::new()))
            .1
            .push(row);
    }
    let mut moved_any = false;
    for (name, (pool, waiting)) in pools {
        match redeal_pool(inner, &pool, &waiting).await {
            Ok(0) => {}
            Ok(moved) => {
                moved_any = true;
                debug!(outbox = %outbox, pool = %name, moved, "Re-dealt waiting ops across the pool's channels.");
            }
            Err(e) => {
                warn!(outbox = %outbox, pool = %name, error = %e, "Could not re-deal the pool's waiting ops; they stay on their channels.")
            }
        }
    }
    moved_any
}

async fn redeal_pool(inner: &Inner, pool: &Pool, waiting: &[&BookRow]) -> Result<usize, crate::queue::QueueError> {
    let accounts: Vec<String> = pool.channels.iter().map(|c| c.account.clone()).collect();
    let occupants = inner.queue.occupants(&accounts).await?;
    // Each occupied channel, and whether a receipt in doubt holds it.
    let mut occupied: HashMap<&str, bool> = HashMap::new();
    for o in &occupants {
        for lane in &o.lanes {
            *occupied.entry(lane.as_str()).or_insert(false) |= o.in_doubt;
        }
    }
    let loads: Vec<ChannelLoad> = pool
        .channels
        .iter()
        .map(|c| ChannelLoad {
            account: c.account.clone(),
            active: !c.retired,
            held: occupied.get(c.account.as_str()).copied().unwrap_or(false),
            busy: occupied.contains_key(c.account.as_str()),
            waiting: waiting
                .iter()
                .filter(|r| r.lanes.first() == Some(&c.account))
                .map(|r| (r.priority, r.id))
                .collect(),
        })
        .collect();
    let moves = crate::pool::redeal(&loads);
    if moves.is_empty() {
        return Ok(0);
    }
    Ok(inner.queue.redeal(&moves).await?.len())
}
