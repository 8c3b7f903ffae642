//! Lanes handed from one outbox's drain to another's on this host.
//!
//! A lane names a resource shared by outboxes (a shared inbox, a signer
//! account): while an op of outbox A occupies it, outbox B's ops of that
//! lane wait. B's drain learns that from a full read (the occupants) or
//! from a refused claim, and would otherwise look again only at its next
//! full read, up to `poll_ms` later, for every op of the lane: a lane
//! shared by busy outboxes would move a few ops a second. So B registers
//! the lanes it waits on, and A, when it settles an op of such a lane,
//! tells B, which re-reads just those lanes' occupants. Across hosts the
//! full read still bounds the wait.
//!
//! Pure bookkeeping, no I/O: the drains register, report and take; the
//! dispatcher triggers whom it is told to.

use std::collections::{HashMap, HashSet};

/// Who waits on which lane, and what was freed for whom.
#[derive(Debug, Default)]
pub(crate) struct Handover {
    /// Lane → outboxes waiting for it.
    waiting: HashMap<String, HashSet<String>>,
    /// Outbox → lanes freed for it since it last took them.
    freed: HashMap<String, HashSet<String>>,
}

impl Handover {
    /// `outbox` waits on these lanes (in addition to what it waited on).
    pub fn wait<'a>(&mut self, outbox: &str, lanes: impl IntoIterator<Item = &'a String>) {
        for lane in lanes {
            self.waiting.entry(lane.clone()).or_default().insert(outbox.to_owned());
        }
    }

    /// `outbox` read its outbox in full: what it waits on is exactly
    /// `lanes` from now on (so lanes freed on other hosts, which nobody
    /// here reports, do not pile up).
    pub fn rewait<'a>(&mut self, outbox: &str, lanes: impl IntoIterator<Item = &'a String>) {
        self.waiting.retain(|_, waiters| {
            waiters.remove(outbox);
            !waiters.is_empty()
        });
        self.wait(outbox, lanes);
    }

    /// Whether an outbox other than `outbox` waits on `lane`.
    pub fn others_wait(&self, outbox: &str, lane: &str) -> bool {
        self.waiting
            .get(lane)
            .is_some_and(|waiters| waiters.iter().any(|w| w != outbox))
    }

    /// `by` settled ops of these lanes: the outboxes waiting on them (other
    /// than `by`) to wake, each with the lanes recorded as freed for it.
    pub fn freed(&mut self, by: &str, lanes: &[String]) -> Vec<String> {
        let mut wake: HashSet<String> = HashSet::new();
        for lane in lanes {
            let Some(waiters) = self.waiting.get_mut(lane) else {
                continue;
            };
            let others: Vec<String> = waiters.iter().filter(|w| *w != by).cloned().collect();
            for outbox in others {
                waiters.remove(&outbox);
                self.freed.entry(outbox.clone()).or_default().insert(lane.clone());
                wake.insert(outbox);
            }
            if waiters.is_empty() {
                self.waiting.remove(lane);
            }
        }
        let mut wake: Vec<String> = wake.into_iter().collect();
        wake.sort_unstable();
        wake
    }

    /// The lanes freed for `outbox` since it last looked.
    pub fn take(&mut self, outbox: &str) -> Vec<String> {
        let mut lanes: Vec<String> = self.freed.remove(outbox).unwrap_or_default().into_iter().collect();
        lanes.sort_unstable();
        lanes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lanes(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn a_settle_wakes_the_other_outboxes_waiting_on_its_lanes_once() {
        let mut h = Handover::default();
        h.wait("b", &lanes(&["shared"]));
        h.wait("c", &lanes(&["shared", "other"]));
        h.wait("a", &lanes(&["shared"]));
        assert!(h.others_wait("a", "shared"));
        assert!(!h.others_wait("c", "other"));
        assert_eq!(h.freed("a", &lanes(&["shared"])), vec!["b".to_owned(), "c".to_owned()]);
        assert!(h.freed("a", &lanes(&["shared"])).is_empty(), "told once per wait");
        assert_eq!(h.take("c"), vec!["shared".to_owned()]);
        assert!(h.take("c").is_empty());
        assert!(h.take("a").is_empty(), "its own settle frees nothing for itself");
    }

    #[test]
    fn a_full_read_replaces_what_an_outbox_waits_on() {
        let mut h = Handover::default();
        h.wait("b", &lanes(&["x", "y"]));
        h.rewait("b", &lanes(&["z"]));
        assert!(h.freed("a", &lanes(&["x", "y"])).is_empty());
        assert_eq!(h.freed("a", &lanes(&["z"])), vec!["b".to_owned()]);
    }
}
