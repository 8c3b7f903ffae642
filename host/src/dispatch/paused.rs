//! The pauses a drain obeys: kinds, outboxes and destination hosts an
//! operator paused. Read from the database at every full read (so every host
//! obeys a pause within `poll_ms`); a paused op waits, holding its strict
//! lanes like any waiting op, and uses no attempt.

use std::collections::HashSet;

use crate::queue::{Pause, PauseScope};

/// The pauses in force, as of the last full read.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Paused {
    kinds: HashSet<String>,
    outboxes: HashSet<String>,
    destinations: HashSet<String>,
}

impl Paused {
    /// The set a read of the pauses table gives.
    pub fn new(pauses: &[Pause]) -> Self {
        let mut paused = Self::default();
        for pause in pauses {
            let set = match pause.scope {
                PauseScope::Kind => &mut paused.kinds,
                PauseScope::Outbox => &mut paused.outboxes,
                PauseScope::Destination => &mut paused.destinations,
            };
            set.insert(pause.target.clone());
        }
        paused
    }

    /// `true` if an op of `kind` in `outbox` to `destination` must wait.
    pub fn holds(&self, outbox: &str, kind: &str, destination: Option<&str>) -> bool {
        self.outboxes.contains(outbox)
            || self.kinds.contains(kind)
            || destination.is_some_and(|d| self.destinations.contains(d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pause(scope: PauseScope, target: &str) -> Pause {
        Pause {
            scope,
            target: target.to_owned(),
            reason: None,
            actor: "cli:test".to_owned(),
            paused_at: chrono::DateTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn each_scope_holds_only_its_own_targets() {
        let paused = Paused::new(&[
            pause(PauseScope::Kind, "deposit"),
            pause(PauseScope::Outbox, "alice"),
            pause(PauseScope::Destination, "slow.example"),
        ]);
        assert!(paused.holds("bob", "deposit", None));
        assert!(paused.holds("alice", "withdraw", None));
        assert!(paused.holds("bob", "withdraw", Some("slow.example")));
        assert!(!paused.holds("bob", "withdraw", Some("fast.example")));
        assert!(!paused.holds("bob", "withdraw", None));
        // A kind named like a paused outbox is not paused.
        assert!(!paused.holds("bob", "alice", None));
    }

    #[test]
    fn nothing_paused_holds_nothing() {
        assert!(!Paused::new(&[]).holds("a", "b", Some("c")));
    }
}
