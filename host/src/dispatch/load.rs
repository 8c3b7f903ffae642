//! How many ops this host has in flight to each destination host, counted
//! from the moment a drain takes a permit for one until its attempt ends,
//! so the scheduler's per-destination cap holds across every drain here;
//! and which destinations answered this host lately, so one that has not
//! (first contact, or failing) gets the smaller cap until it does.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::OwnedSemaphorePermit;

/// A destination silent this long counts as unanswered again: the record
/// of answers stays as small as the destinations in use.
const ANSWERED_FOR: Duration = Duration::from_secs(15 * 60);

/// How often the record of answers is swept of silent destinations.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// The host-wide count per destination (only destinations with ops in
/// flight have an entry, so a copy is as small as what is in flight), and
/// the destinations that answered lately.
#[derive(Debug)]
pub(crate) struct DestinationLoad(Mutex<State>);

#[derive(Debug)]
struct State {
    counts: HashMap<String, usize>,
    /// When each destination last answered.
    answered_at: HashMap<String, Instant>,
    /// The same destinations, shared with every schedule without a copy
    /// (changed only when a destination is first answered, fails or is
    /// swept).
    answered: Arc<HashSet<String>>,
    swept_at: Instant,
}

impl Default for DestinationLoad {
    fn default() -> Self {
        Self(Mutex::new(State {
            counts: HashMap::new(),
            answered_at: HashMap::new(),
            answered: Arc::default(),
            swept_at: Instant::now(),
        }))
    }
}

impl DestinationLoad {
    fn state(&self) -> MutexGuard<'_, State> {
        // Plain counts and times: consistent even if a holder panicked.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The counts now, and the destinations that answered lately, for one
    /// schedule.
    pub fn snapshot(&self) -> (HashMap<String, usize>, Arc<HashSet<String>>) {
        let state = self.state();
        (state.counts.clone(), state.answered.clone())
    }

    /// Counts one op to `destination` until the returned guard is dropped.
    pub fn hold(self: &Arc<Self>, destination: &str) -> Holding {
        *self.state().counts.entry(destination.to_owned()).or_default() += 1;
        Holding {
            load: self.clone(),
            destination: destination.to_owned(),
        }
    }

    /// Records what an attempt to `destination` said: it answered (the
    /// full cap from now on), or it failed because of the destination (the
    /// smaller cap again until one answers).
    pub fn heard(&self, destination: &str, answered: bool, now: Instant) {
        let mut state = self.state();
        if answered {
            match state.answered_at.get_mut(destination) {
                Some(at) => *at = now,
                None => {
                    state.answered_at.insert(destination.to_owned(), now);
                }
            }
            if !state.answered.contains(destination) {
                Arc::make_mut(&mut state.answered).insert(destination.to_owned());
            }
        } else if state.answered_at.remove(destination).is_some() {
            Arc::make_mut(&mut state.answered).remove(destination);
        }
        if now.saturating_duration_since(state.swept_at) >= SWEEP_EVERY {
            state.swept_at = now;
            let before = state.answered_at.len();
            state
                .answered_at
                .retain(|_, at| now.saturating_duration_since(*at) < ANSWERED_FOR);
            if state.answered_at.len() != before {
                let kept: HashSet<String> = state.answered_at.keys().cloned().collect();
                state.answered = Arc::new(kept);
            }
        }
    }
}

/// One op counted against its destination.
#[derive(Debug)]
pub(crate) struct Holding {
    load: Arc<DestinationLoad>,
    destination: String,
}

impl Drop for Holding {
    fn drop(&mut self) {
        let mut state = self.load.state();
        if let Some(n) = state.counts.get_mut(&self.destination) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                state.counts.remove(&self.destination);
            }
        }
    }
}

/// What an op holds while it is claimed and executed: a host permit and
/// its place in its destination's count. Both are given back when the
/// attempt ends (or its claim is refused).
#[derive(Debug)]
pub(crate) struct Hold {
    pub _permit: OwnedSemaphorePermit,
    pub _destination: Option<Holding>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_the_guards_and_empty_entries_go() {
        let load = Arc::new(DestinationLoad::default());
        let a = load.hold("a.example");
        let b = load.hold("a.example");
        let c = load.hold("b.example");
        assert_eq!(load.snapshot().0.get("a.example"), Some(&2));
        drop(a);
        drop(c);
        assert_eq!(load.snapshot().0, HashMap::from([("a.example".to_owned(), 1)]));
        drop(b);
        assert!(load.snapshot().0.is_empty());
    }

    #[test]
    fn a_destination_counts_as_answered_until_it_fails_or_falls_silent() {
        let load = DestinationLoad::default();
        let t0 = Instant::now();
        load.heard("a.example", true, t0);
        load.heard("b.example", true, t0);
        let (_, before) = load.snapshot();
        load.heard("b.example", false, t0);
        assert_eq!(*before, HashSet::from(["a.example".to_owned(), "b.example".to_owned()]));
        assert_eq!(*load.snapshot().1, HashSet::from(["a.example".to_owned()]));
        // Silent past ANSWERED_FOR: swept at the next record.
        load.heard("c.example", true, t0 + ANSWERED_FOR);
        assert_eq!(*load.snapshot().1, HashSet::from(["c.example".to_owned()]));
        load.heard("c.example", false, t0 + ANSWERED_FOR);
        assert!(load.snapshot().1.is_empty());
    }
}
