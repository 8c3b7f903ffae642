//! In-process drain slots: at most one drain task per outbox in this process,
//! and the "look once more" flag (seed 000 OX-01-004).
//!
//! A trigger that finds the outbox's drain running does not wait for it (the
//! seed explains the deadlock class waiting creates); it marks the slot so
//! the running drain looks at the queue once more before it finishes. The
//! check-and-clear is atomic, so no trigger is ever lost between a drain's
//! last look and its exit. Exclusivity across processes and hosts is the
//! database's drain-slot lease; this only avoids needless contention for it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;

/// The drain slots of one process.
#[derive(Debug, Default)]
pub struct LocalSlots {
    /// Outboxes with a running drain.
    running: Mutex<HashMap<String, Slot>>,
}

/// A running drain's flag and its doorbell.
#[derive(Debug, Default)]
struct Slot {
    /// It must look once more.
    again: bool,
    /// Rung on every trigger, so a drain waiting on its in-flight ops reads
    /// new ops at once instead of after them.
    bell: Arc<Notify>,
}

/// What a trigger should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// No drain was running: the caller must start one.
    Start,
    /// A drain is running and will look once more.
    Marked,
}

impl LocalSlots {
    /// Records a trigger for `outbox`.
    pub fn trigger(&self, outbox: &str) -> Trigger {
        // A poisoned lock only means another thread panicked mid-update of a
        // plain map of flags; the map is still consistent, so carry on.
        let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        match running.get_mut(outbox) {
            Some(slot) => {
                slot.again = true;
                slot.bell.notify_one();
                Trigger::Marked
            }
            None => {
                running.insert(outbox.to_owned(), Slot::default());
                Trigger::Start
            }
        }
    }

    /// Called by a running drain: `true` if it was triggered since it last
    /// asked (it should read new ops); clears the mark.
    pub fn take_again(&self, outbox: &str) -> bool {
        let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        running
            .get_mut(outbox)
            .is_some_and(|slot| std::mem::take(&mut slot.again))
    }

    /// The doorbell a running drain waits on for triggers.
    pub fn bell(&self, outbox: &str) -> Arc<Notify> {
        let running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        running.get(outbox).map(|slot| slot.bell.clone()).unwrap_or_default()
    }

    /// Called by a drain that finished a pass: `true` means it was triggered
    /// meanwhile and must look again; `false` means the slot is now free.
    pub fn finish_or_again(&self, outbox: &str) -> bool {
        let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        match running.get_mut(outbox) {
            Some(slot) if slot.again => {
                slot.again = false;
                true
            }
            _ => {
                running.remove(outbox);
                false
            }
        }
    }

    /// Outboxes being drained now.
    pub fn running(&self) -> Vec<String> {
        let running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        let mut names: Vec<String> = running.keys().cloned().collect();
        names.sort();
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt as _;

    #[test]
    fn a_trigger_during_a_drain_makes_it_look_once_more_never_twice() {
        let slots = LocalSlots::default();
        assert_eq!(slots.trigger("a"), Trigger::Start);
        assert_eq!(slots.trigger("a"), Trigger::Marked);
        assert_eq!(slots.trigger("a"), Trigger::Marked);
        assert_eq!(slots.trigger("b"), Trigger::Start);
        assert!(slots.finish_or_again("a"), "marked: look again");
        assert!(!slots.finish_or_again("a"), "no trigger since: free the slot");
        assert_eq!(slots.running(), vec!["b".to_owned()]);
        assert_eq!(slots.trigger("a"), Trigger::Start, "a freed slot starts a new drain");
    }

    #[test]
    fn a_running_drain_takes_its_marks_and_hears_its_bell() {
        let slots = LocalSlots::default();
        assert_eq!(slots.trigger("a"), Trigger::Start);
        let bell = slots.bell("a");
        assert!(!slots.take_again("a"));
        assert_eq!(slots.trigger("a"), Trigger::Marked);
        assert!(
            bell.notified().now_or_never().is_some(),
            "the trigger rang the bell before anyone waited"
        );
        assert!(slots.take_again("a"), "the mark is taken once");
        assert!(!slots.take_again("a"));
        assert!(
            !slots.finish_or_again("a"),
            "a taken mark does not keep the drain alive"
        );
    }
}
