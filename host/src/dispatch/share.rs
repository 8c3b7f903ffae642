//! The host-wide in-flight cap shared fairly among outboxes.
//!
//! `dispatch.max_in_flight` permits serve every drain of a host. Taken
//! first come, first served, two busy outboxes at `outbox_max_in_flight`
//! each can hold every permit for as long as they have work, and a third
//! outbox's ops then wait however short its backlog is: its drain finds no
//! permit, ends, and the permits freed later go straight back to the busy
//! two. So drains that want permits split them evenly: a drain in a pass,
//! or one that ended for want of a permit (*starved*), counts as a
//! contender; no drain starts more than its share while others contend; a
//! drain leaves one free permit for each starved outbox instead of taking it
//! back, and wakes the starved ones. Starved drains so take turns even when
//! there are fewer permits than busy outboxes.
//!
//! Pure bookkeeping, no I/O: the drain asks and reports, the dispatcher
//! triggers whom it is told to.

use std::collections::{HashSet, VecDeque};

/// Who contends for the host's permits.
#[derive(Debug, Default)]
pub(crate) struct Share {
    /// Outboxes whose drain is in a pass.
    draining: HashSet<String>,
    /// Outboxes whose last pass ended with ops it could not start for want
    /// of a host permit, oldest first.
    starved: VecDeque<String>,
}

impl Share {
    /// A pass of `outbox` starts: it contends, and is no longer starved.
    /// Returns whether it was: such a pass may take the permits left free
    /// for it (see [`Share::takeable`]).
    pub fn join(&mut self, outbox: &str) -> bool {
        let before = self.starved.len();
        self.starved.retain(|o| o != outbox);
        self.draining.insert(outbox.to_owned());
        self.starved.len() < before
    }

    /// A pass of `outbox` ends; `starved` when it left ops it could not
    /// start for want of a host permit (it keeps contending until it runs).
    pub fn leave(&mut self, outbox: &str, starved: bool) {
        self.draining.remove(outbox);
        if starved && !self.starved.iter().any(|o| o == outbox) {
            self.starved.push_back(outbox.to_owned());
        }
    }

    /// How many permits one contender may hold: an even split of `total`
    /// (at least one).
    pub fn fair(&self, total: usize) -> usize {
        let contenders = self.draining.len() + self.starved.len();
        (total / contenders.max(1)).max(1)
    }

    /// Whether any outbox waits for permits.
    pub fn has_starved(&self) -> bool {
        !self.starved.is_empty()
    }

    /// Of `free` permits, how many a drain in a pass may take: one is left
    /// for each starved outbox, so that permits a drain frees go to an
    /// outbox that waits rather than back to the drain (even shares alone
    /// cannot help when there are fewer permits than contenders).
    pub fn takeable(&self, free: usize) -> usize {
        free.saturating_sub(self.starved.len())
    }

    /// The starved outboxes to wake now that `free` permits are free, oldest
    /// first (at most one per free permit). They stay counted as
    /// contenders until their pass starts.
    pub fn to_wake(&self, free: usize) -> Vec<String> {
        self.starved.iter().take(free).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contenders_split_the_permits_and_the_starved_count() {
        let mut share = Share::default();
        assert_eq!(share.fair(64), 64, "alone, a drain may take everything");
        share.join("a");
        share.join("b");
        assert_eq!(share.fair(64), 32);
        share.leave("c", true);
        assert_eq!(share.fair(64), 21, "a starved outbox keeps its claim to a share");
        assert!(share.has_starved());
        assert_eq!(share.takeable(1), 0, "a freed permit is left to the starved outbox");
        assert_eq!(share.takeable(5), 4);
        assert!(share.join("c"), "it was starved");
        assert!(!share.join("c"));
        assert!(!share.has_starved(), "a pass that starts is no longer starved");
        assert_eq!(share.fair(64), 21);
        share.leave("a", false);
        share.leave("b", false);
        share.leave("c", false);
        assert_eq!(share.fair(2), 2);
        assert_eq!(share.fair(0), 1, "a share is never zero");
    }

    #[test]
    fn the_starved_are_woken_oldest_first_one_per_free_permit() {
        let mut share = Share::default();
        for o in ["x", "y", "z"] {
            share.leave(o, true);
        }
        share.leave("y", true);
        assert_eq!(share.to_wake(2), vec!["x".to_owned(), "y".to_owned()]);
        assert_eq!(share.to_wake(9).len(), 3, "each outbox once");
        assert!(share.to_wake(0).is_empty());
    }
}
