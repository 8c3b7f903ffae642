//! The demo's final report, as pure functions of what the queue and the
//! fakes recorded: per lane what was delivered, retried and dead-lettered
//! and whether arrival order kept the lane rule; per kind fees and latency.
//! The demo fails when an order check fails, so the table cannot claim an
//! order the run did not keep.

use std::fmt::Write as _;

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{CellAlignment, Table};

use crate::op::{Op, Priority, Status};

/// Whether a lane's deliveries arrived in the order the lane rule demands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Order {
    /// They did.
    Kept,
    /// Nothing arrived, so there is no order to check.
    Nothing,
    /// They did not: what was wrong.
    Broken(String),
}

impl Order {
    fn cell(&self) -> String {
        match self {
            Order::Kept => "✓ in order".to_owned(),
            Order::Nothing => "— nothing arrived".to_owned(),
            Order::Broken(why) => format!("✗ {why}"),
        }
    }
}

/// One lane's line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneRow {
    /// What the lane is, for a reader (`inbox slow`, `signer vault-agent`).
    pub label: String,
    /// The kinds on it.
    pub kinds: String,
    /// Confirmed ops.
    pub delivered: usize,
    /// Ops that needed more than one attempt.
    pub retried: usize,
    /// Dead-lettered ops.
    pub dead: usize,
    /// The order check.
    pub order: Order,
}

/// One kind's line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KindRow {
    /// The kind.
    pub kind: String,
    /// Ops of the kind.
    pub ops: usize,
    /// Inclusion fees bid by the confirmed attempts (stroops), when priced.
    pub fees: Option<i64>,
    /// The mean of those fees.
    pub fee_per_op: Option<i64>,
    /// Median enqueue-to-terminal time (ms).
    pub p50_ms: i64,
    /// Slowest enqueue-to-terminal time (ms).
    pub max_ms: i64,
}

/// The lane rule on one inbox: the ledger positions that arrived are the
/// confirmed ops' positions, in enqueue order. A position repeated at once
/// is a redelivery (at-least-once), not disorder.
pub fn inbox_order(confirmed_in_enqueue_order: &[u64], arrived: &[u64]) -> Order {
    let mut seen: Vec<u64> = arrived.to_vec();
    seen.dedup();
    if seen.is_empty() && confirmed_in_enqueue_order.is_empty() {
        return Order::Nothing;
    }
    if seen == confirmed_in_enqueue_order {
        Order::Kept
    } else {
        Order::Broken(format!("arrived {seen:?}, enqueued {confirmed_in_enqueue_order:?}"))
    }
}

/// One transaction as it landed on a signer's account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Landed {
    /// Its sequence number.
    pub sequence: i64,
    /// The op's priority.
    pub priority: Priority,
    /// The op's place in enqueue order.
    pub enqueued: usize,
    /// It was re-dealt to this channel from another: a pool's waiting op
    /// takes any free channel, so it keeps the pool's order, not the order
    /// of ops dealt to its new channel before it moved (some of which may
    /// have started already).
    pub redealt: bool,
}

/// The lane rule on one signer: sequence numbers with no gap and no
/// reuse (one transaction in flight at a time), and within a priority tier
/// enqueue order (a higher tier may overtake a lower one; that is the point)
/// among the ops dealt to it (a pool's re-dealt ops are left out of the order).
pub fn signer_order(landed: &[Landed]) -> Order {
    if landed.is_empty() {
        return Order::Nothing;
    }
    for pair in landed.windows(2) {
        if pair[1].sequence != pair[0].sequence + 1 {
            return Order::Broken(format!(
                "sequence {} followed by {}",
                pair[0].sequence, pair[1].sequence
            ));
        }
    }
    for tier in Priority::ALL {
        let order: Vec<usize> = landed
            .iter()
            .filter(|l| l.priority == tier && !l.redealt)
            .map(|l| l.enqueued)
            .collect();
        if order.windows(2).any(|w| w[1] < w[0]) {
            return Order::Broken(format!("{tier} ops landed out of enqueue order: {order:?}"));
        }
    }
    Order::Kept
}

/// Counts for `ops` (all of one lane).
pub fn lane_row(label: String, ops: &[&Op], order: Order) -> LaneRow {
    let mut kinds: Vec<&str> = ops.iter().map(|o| o.kind.as_str()).collect();
    kinds.sort_unstable();
    kinds.dedup();
    LaneRow {
        label,
        kinds: kinds.join(", "),
        delivered: ops.iter().filter(|o| o.status == Status::Confirmed).count(),
        retried: ops.iter().filter(|o| o.attempts > 1).count(),
        dead: ops.iter().filter(|o| o.status == Status::Failed).count(),
        order,
    }
}

/// A kind's line from its ops and the fee each confirmed one paid.
pub fn kind_row(kind: &str, ops: &[&Op], fees: &[i64]) -> KindRow {
    let mut took: Vec<i64> = ops
        .iter()
        .filter_map(|o| o.finished_at.map(|f| (f - o.created_at).num_milliseconds()))
        .collect();
    took.sort_unstable();
    KindRow {
        kind: kind.to_owned(),
        ops: ops.len(),
        fees: (!fees.is_empty()).then(|| fees.iter().sum()),
        fee_per_op: i64::try_from(fees.len())
            .ok()
            .filter(|n| *n > 0)
            .map(|n| fees.iter().sum::<i64>() / n),
        p50_ms: took.get(took.len() / 2).copied().unwrap_or_default(),
        max_ms: took.last().copied().unwrap_or_default(),
    }
}

/// A table in the CLI's style, columns from `right` on right-aligned.
fn table<const N: usize>(header: [&str; N], rows: Vec<[String; N]>, right: std::ops::Range<usize>) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(header);
    for row in rows {
        t.add_row(row);
    }
    for i in right {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    t.to_string()
}

/// The lane table.
pub fn lanes_table(rows: &[LaneRow]) -> String {
    let cells = rows
        .iter()
        .map(|r| {
            [
                r.label.clone(),
                r.kinds.clone(),
                r.delivered.to_string(),
                r.retried.to_string(),
                r.dead.to_string(),
                r.order.cell(),
            ]
        })
        .collect();
    table(
        [
            "lane",
            "kinds",
            "delivered",
            "retried",
            "dead-lettered",
            "arrival order",
        ],
        cells,
        2..5,
    )
}

/// The kind table.
pub fn kinds_table(rows: &[KindRow]) -> String {
    let dash = || "—".to_owned();
    let cells = rows
        .iter()
        .map(|r| {
            [
                r.kind.clone(),
                r.ops.to_string(),
                r.fees.map_or_else(dash, |f| f.to_string()),
                r.fee_per_op.map_or_else(dash, |f| f.to_string()),
                format!("{} ms", r.p50_ms),
                format!("{} ms", r.max_ms),
            ]
        })
        .collect();
    table(
        [
            "kind",
            "ops",
            "fees paid (stroops)",
            "fee per op",
            "latency p50",
            "latency max",
        ],
        cells,
        1..6,
    )
}

/// Every broken order, one line each (empty when all held).
pub fn broken(rows: &[LaneRow]) -> String {
    let mut out = String::new();
    for r in rows {
        if let Order::Broken(why) = &r.order {
            let _ = writeln!(out, "{}: {why}", r.label);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn landed(sequence: i64, priority: Priority, enqueued: usize) -> Landed {
        Landed {
            sequence,
            priority,
            enqueued,
            redealt: false,
        }
    }

    #[test]
    fn an_inbox_must_get_its_confirmed_positions_in_enqueue_order() {
        assert_eq!(inbox_order(&[1, 2, 3], &[1, 2, 3]), Order::Kept);
        assert_eq!(
            inbox_order(&[1, 2, 3], &[1, 1, 2, 3]),
            Order::Kept,
            "a redelivery is not disorder"
        );
        assert!(matches!(inbox_order(&[1, 2, 3], &[1, 3, 2]), Order::Broken(_)));
        assert!(
            matches!(inbox_order(&[1, 2, 3], &[1, 2]), Order::Broken(_)),
            "a lost delivery"
        );
        assert!(matches!(inbox_order(&[1, 2, 3], &[1, 2, 1, 3]), Order::Broken(_)));
        assert_eq!(inbox_order(&[], &[]), Order::Nothing);
    }

    #[test]
    fn a_signer_keeps_contiguous_sequences_and_fifo_within_a_tier() {
        let ok = [
            landed(11, Priority::Normal, 0),
            landed(12, Priority::Critical, 5),
            landed(13, Priority::Critical, 6),
            landed(14, Priority::Normal, 1),
            landed(15, Priority::Low, 2),
        ];
        assert_eq!(signer_order(&ok), Order::Kept, "critical overtaking normal is the rule");
        let gap = [landed(11, Priority::Normal, 0), landed(13, Priority::Normal, 1)];
        assert!(matches!(signer_order(&gap), Order::Broken(_)));
        let fifo = [landed(11, Priority::Normal, 1), landed(12, Priority::Normal, 0)];
        assert!(matches!(signer_order(&fifo), Order::Broken(_)));
        // A pool's op re-dealt to the channel after a later one started
        // there keeps the pool's order, not the channel's; a gap still counts.
        let mut moved = [landed(11, Priority::Normal, 1), landed(12, Priority::Normal, 0)];
        moved[1].redealt = true;
        assert_eq!(signer_order(&moved), Order::Kept);
        moved[1].sequence = 13;
        assert!(matches!(signer_order(&moved), Order::Broken(_)));
        assert_eq!(signer_order(&[]), Order::Nothing);
    }
}
