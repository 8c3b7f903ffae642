//! The demo's live progress: one bar per kind (done, retrying, dead) and a
//! line for lanes (busy, held), redrawn from the queue a few times a second
//! on standard error (indicatif draws nothing when it is not a terminal).

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use super::DemoError;
use crate::node::Node;
use crate::op::{Op, OpId, Status};

/// Counts for one kind.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Tally {
    total: u64,
    done: u64,
    sending: u64,
    retrying: u64,
    dead: u64,
}

/// Redraws until every op in `ids` is terminal or waits on a held lane;
/// `Some(what is open)` when `within` runs out first.
pub(super) async fn watch(node: &Node, ids: &[OpId], within: Duration) -> Result<Option<String>, DemoError> {
    let bars = MultiProgress::new();
    let style = ProgressStyle::with_template("{prefix:>16} {bar:32.cyan/blue} {pos:>3}/{len:<3} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    let mut kinds: BTreeMap<String, ProgressBar> = BTreeMap::new();
    let lanes = bars.add(ProgressBar::new_spinner());
    let deadline = tokio::time::Instant::now() + within;
    let queue = node.dispatcher.queue();
    loop {
        let ops = super::ops_of(node, ids).await?;
        let held: HashSet<String> = queue.lane_halts(None).await?.into_iter().map(|h| h.lane).collect();
        let mut tallies: BTreeMap<&str, Tally> = BTreeMap::new();
        for op in &ops {
            let t = tallies.entry(op.kind.as_str()).or_default();
            t.total += 1;
            match op.status {
                Status::Confirmed | Status::Cancelled => t.done += 1,
                Status::Failed => t.dead += 1,
                // The attempt counter moves at claim: a first attempt in
                // flight has 1, a failed one waiting for its retry has 1 too.
                Status::Submitted if op.attempts > 1 => {
                    t.sending += 1;
                    t.retrying += 1;
                }
                Status::Submitted => t.sending += 1,
                Status::Pending if op.attempts > 0 => t.retrying += 1,
                Status::Pending => {}
            }
        }
        for (kind, t) in &tallies {
            let bar = kinds.entry((*kind).to_owned()).or_insert_with(|| {
                let bar = bars.insert_before(&lanes, ProgressBar::new(t.total));
                bar.set_style(style.clone());
                bar.set_prefix((*kind).to_owned());
                bar
            });
            bar.set_length(t.total);
            bar.set_position(t.done + t.dead);
            bar.set_message(format!(
                "{} done · {} in flight · {} retrying · {} dead",
                t.done, t.sending, t.retrying, t.dead
            ));
        }
        let busy: HashSet<&str> = ops
            .iter()
            .filter(|o| o.status == Status::Submitted)
            .flat_map(|o| o.lanes.iter().map(String::as_str))
            .collect();
        lanes.set_message(format!(
            "lanes: {} busy · {} held by a dead letter",
            busy.len(),
            held.len()
        ));
        lanes.tick();
        let open: Vec<&Op> = ops
            .iter()
            .filter(|o| matches!(o.status, Status::Pending | Status::Submitted))
            .filter(|o| !o.lanes.iter().any(|l| held.contains(l)))
            .collect();
        if open.is_empty() && ops.len() == ids.len() {
            for bar in kinds.values() {
                bar.finish();
            }
            lanes.finish();
            return Ok(None);
        }
        if tokio::time::Instant::now() >= deadline {
            let _ = bars.clear();
            let listed: Vec<String> = open
                .iter()
                .take(10)
                .map(|o| format!("op {} ({}, {}, {} attempts)", o.id, o.kind, o.status, o.attempts))
                .collect();
            return Ok(Some(format!("{} ops: {}", open.len(), listed.join("; "))));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
