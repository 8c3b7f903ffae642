//! Re-dealing a drain's waiting pool ops across the pool's channels at each
//! full read of its book, so an op takes any free channel rather than the
//! one it was dealt at enqueue: the ops behind a channel a receipt in doubt
//! holds, or on a retired one, move to free channels, and an idle channel
//! takes the pool's first waiting op ([`crate::pool::redeal`] decides; the
//! queue moves each op by compare-and-set and records it).
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
use crate::queue::{BookRow, Occupant};

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
    let moves = crate::pool::redeal(&loads(pool, &occupants, waiting));
    if moves.is_empty() {
        return Ok(0);
    }
    Ok(inner.queue.redeal(&moves).await?.len())
}

/// Each channel of the pool as the planner sees it: busy while an op
/// occupies it, held only while one waits in doubt (an op in flight has
/// usually checkpointed its receipt already: that is not doubt).
fn loads(pool: &Pool, occupants: &[Occupant], waiting: &[&BookRow]) -> Vec<ChannelLoad> {
    let mut occupied: HashMap<&str, bool> = HashMap::new();
    for o in occupants {
        for lane in &o.lanes {
            *occupied.entry(lane.as_str()).or_insert(false) |= o.waits_in_doubt();
        }
    }
    pool.channels
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
        .collect()
}

#[cfg(test)]
mod tests {
    use chrono::Utc;

    use super::*;
    use crate::op::Priority;
    use crate::pool::Channel;

    fn occupant(id: i64, lane: &str, in_flight: bool, in_doubt: bool) -> Occupant {
        Occupant {
            id,
            outbox: "o".to_owned(),
            kind: "k".to_owned(),
            priority: Priority::Normal,
            lanes: vec![lane.to_owned()],
            in_flight,
            in_doubt,
        }
    }

    fn row(id: i64, lane: &str) -> BookRow {
        BookRow {
            id,
            kind: "k".to_owned(),
            priority: Priority::Normal,
            lanes: vec![lane.to_owned()],
            in_flight: false,
            in_doubt: false,
            next_attempt_at: Utc::now(),
            budget_attempts: 0,
            fee_bumps: 0,
            created_at: Utc::now(),
            subject_halted: false,
        }
    }

    #[test]
    fn a_channel_is_held_only_by_an_op_waiting_in_doubt_not_by_one_in_flight_with_its_receipt() {
        let channel = |n: u8, retired: bool| Channel {
            key: format!("c{n}"),
            account: format!("G{n}"),
            retired,
        };
        let pool = Pool::new("p", vec![channel(1, false), channel(2, false), channel(3, true)]);
        let occupants = [
            // A transaction checkpointed and sent, its attempt running.
            occupant(1, "G1", true, true),
            // One answered 504: pending until reconciled.
            occupant(2, "G2", false, true),
        ];
        let rows = [row(5, "G1"), row(6, "G3")];
        let waiting: Vec<&BookRow> = rows.iter().collect();
        let seen: Vec<(bool, bool, bool, usize)> = loads(&pool, &occupants, &waiting)
            .iter()
            .map(|l| (l.active, l.busy, l.held, l.waiting.len()))
            .collect();
        assert_eq!(
            seen,
            [(true, true, false, 1), (true, true, true, 0), (false, false, false, 1)]
        );
    }
}
