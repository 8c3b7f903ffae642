//! How many ops this host has in flight to each destination host, counted
//! from the moment a drain takes a permit for one until its attempt ends,
//! so the scheduler's per-destination cap holds across every drain here;
//! and which destinations answered this host lately, so one that has not
//! (first contact, or failing) starts with the smaller cap and earns more
//! by patience or by an answer.

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
    in_flight: HashMap<String, InFlight>,
    /// When each destination last answered.
    answered_at: HashMap<String, Instant>,
    /// The same destinations, shared with every schedule without a copy
    /// (changed only when a destination is first answered, fails or is
    /// swept).
    answered: Arc<HashSet<String>>,
    swept_at: Instant,
}

/// One destination's ops in flight on this host.
#[derive(Debug)]
struct InFlight {
    count: usize,
    /// Since when it has had ops in flight without a failure: what its
    /// patience is measured from.
    since: Instant,
}

impl Default for DestinationLoad {
    fn default() -> Self {
        Self(Mutex::new(State {
            in_flight: HashMap::new(),
            answered_at: HashMap::new(),
            answered: Arc::default(),
            swept_at: Instant::now(),
        }))
    }
}

/// How a destination that has not answered earns requests: `first` at
/// once, one more after `patience`, another after twice `patience` more,
/// and so on up to `cap`. A server that hangs then holds one or two permits
/// for most of its timeout, and one slow inbox delays the other inboxes on
/// its server by a `patience`, not by the timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlowStart {
    pub first: usize,
    pub patience: Duration,
    pub cap: usize,
}

impl SlowStart {
    /// The `[destinations]` settings (config sits below dispatch, so the
    /// conversion lives here).
    pub fn of(config: &crate::config::DestinationsConfig) -> Self {
        Self {
            first: config.max_in_flight_unanswered,
            patience: Duration::from_millis(config.unanswered_patience_ms),
            cap: config.max_in_flight,
        }
    }

    /// The extra requests earned by waiting `waited`: the largest `k` with
    /// `patience × k(k+1)/2 <= waited`, no more than `first` short of `cap`.
    pub fn earned(&self, waited: Duration) -> usize {
        let most = self.cap.saturating_sub(self.first);
        let Some(units) = waited.as_nanos().checked_div(self.patience.as_nanos()) else {
            return most;
        };
        let mut k: usize = 0;
        while k < most && ((k as u128) + 1) * ((k as u128) + 2) / 2 <= units {
            k += 1;
        }
        k
    }

    /// How long after its patience began a destination earns its `k`-th
    /// extra request.
    fn earns_at(&self, k: usize) -> Duration {
        let steps = u32::try_from(k * (k + 1) / 2).unwrap_or(u32::MAX);
        self.patience.saturating_mul(steps)
    }
}

/// The load as one schedule sees it.
#[derive(Debug, Default)]
pub(crate) struct Snapshot {
    pub counts: HashMap<String, usize>,
    pub answered: Arc<HashSet<String>>,
    /// Requests earned by patience, per destination in flight that has not
    /// answered.
    pub earned: HashMap<String, usize>,
    /// When each of those earns one more (none once it is at `cap`).
    pub earns_next: HashMap<String, Instant>,
}

impl Snapshot {
    /// When the first of `destinations` earns one more request.
    pub fn next_earned<'a>(&self, destinations: impl IntoIterator<Item = &'a str>) -> Option<Instant> {
        destinations
            .into_iter()
            .filter_map(|d| self.earns_next.get(d))
            .min()
            .copied()
    }
}

impl DestinationLoad {
    fn state(&self) -> MutexGuard<'_, State> {
        // Plain counts and times: consistent even if a holder panicked.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The counts now, the destinations that answered lately and what the
    /// others earned by patience, for one schedule.
    pub fn snapshot(&self, now: Instant, slow: SlowStart) -> Snapshot {
        let state = self.state();
        let mut counts = HashMap::with_capacity(state.in_flight.len());
        let mut earned = HashMap::new();
        let mut earns_next = HashMap::new();
        for (destination, flight) in &state.in_flight {
            counts.insert(destination.clone(), flight.count);
            if state.answered.contains(destination) {
                continue;
            }
            let k = slow.earned(now.saturating_duration_since(flight.since));
            if k > 0 {
                earned.insert(destination.clone(), k);
            }
            if slow.first + k < slow.cap {
                earns_next.insert(destination.clone(), flight.since + slow.earns_at(k + 1));
            }
        }
        Snapshot {
            counts,
            answered: state.answered.clone(),
            earned,
            earns_next,
        }
    }

    /// Counts one op to `destination` until the returned guard is dropped.
    pub fn hold(self: &Arc<Self>, destination: &str) -> Holding {
        self.hold_at(destination, Instant::now())
    }

    fn hold_at(self: &Arc<Self>, destination: &str, now: Instant) -> Holding {
        self.state()
            .in_flight
            .entry(destination.to_owned())
            .or_insert(InFlight { count: 0, since: now })
            .count += 1;
        Holding {
            load: self.clone(),
            destination: destination.to_owned(),
        }
    }

    /// Records what an attempt to `destination` said: it answered (the
    /// full cap from now on), or it failed because of the destination (the
    /// smaller cap again, and its patience starts over, until one answers).
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
        } else {
            if state.answered_at.remove(destination).is_some() {
                Arc::make_mut(&mut state.answered).remove(destination);
            }
            if let Some(flight) = state.in_flight.get_mut(destination) {
                flight.since = now;
            }
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
        if let Some(flight) = state.in_flight.get_mut(&self.destination) {
            flight.count = flight.count.saturating_sub(1);
            if flight.count == 0 {
                state.in_flight.remove(&self.destination);
            }
        }
    }
}

/// What an op holds while it is claimed and executed: a host permit and
/// its place in its destination's count. Both are given back when the
/// attempt ends (or its claim is refused); the permit earlier if the
/// attempt turns slow (`dispatch::slow`).
#[derive(Debug)]
pub(crate) struct Hold {
    pub permit: OwnedSemaphorePermit,
    pub destination: Option<Holding>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLOW: SlowStart = SlowStart {
        first: 1,
        patience: Duration::from_secs(1),
        cap: 8,
    };

    #[test]
    fn counts_follow_the_guards_and_empty_entries_go() {
        let load = Arc::new(DestinationLoad::default());
        let now = Instant::now();
        let a = load.hold("a.example");
        let b = load.hold("a.example");
        let c = load.hold("b.example");
        assert_eq!(load.snapshot(now, SLOW).counts.get("a.example"), Some(&2));
        drop(a);
        drop(c);
        assert_eq!(
            load.snapshot(now, SLOW).counts,
            HashMap::from([("a.example".to_owned(), 1)])
        );
        drop(b);
        let empty = load.snapshot(now, SLOW);
        assert!(empty.counts.is_empty());
        assert!(empty.earns_next.is_empty());
    }

    #[test]
    fn a_destination_counts_as_answered_until_it_fails_or_falls_silent() {
        let load = DestinationLoad::default();
        let t0 = Instant::now();
        load.heard("a.example", true, t0);
        load.heard("b.example", true, t0);
        let before = load.snapshot(t0, SLOW).answered;
        load.heard("b.example", false, t0);
        assert_eq!(*before, HashSet::from(["a.example".to_owned(), "b.example".to_owned()]));
        assert_eq!(
            *load.snapshot(t0, SLOW).answered,
            HashSet::from(["a.example".to_owned()])
        );
        // Silent past ANSWERED_FOR: swept at the next record.
        load.heard("c.example", true, t0 + ANSWERED_FOR);
        assert_eq!(
            *load.snapshot(t0, SLOW).answered,
            HashSet::from(["c.example".to_owned()])
        );
        load.heard("c.example", false, t0 + ANSWERED_FOR);
        assert!(load.snapshot(t0, SLOW).answered.is_empty());
    }

    #[test]
    fn patience_earns_one_more_after_one_two_three_patiences_more() {
        let at = |ms: u64| SLOW.earned(Duration::from_millis(ms));
        assert_eq!(
            [
                at(0),
                at(999),
                at(1000),
                at(2999),
                at(3000),
                at(5999),
                at(6000),
                at(10_000)
            ],
            [0, 0, 1, 1, 2, 2, 3, 4]
        );
        // Never past the cap, however long the wait.
        assert_eq!(SLOW.earned(Duration::from_secs(86_400 * 365)), 7);
        assert_eq!(SLOW.earns_at(3), Duration::from_secs(6));
    }

    #[test]
    fn an_unanswered_destination_earns_by_waiting_and_starts_over_when_it_fails() {
        let load = Arc::new(DestinationLoad::default());
        let t0 = Instant::now();
        let _hung = load.hold_at("hung.example", t0);
        let _known = load.hold_at("known.example", t0);
        load.heard("known.example", true, t0);
        let s = load.snapshot(t0 + Duration::from_millis(500), SLOW);
        assert!(s.earned.is_empty());
        // Only the unanswered one is due to earn more, a patience after it began.
        assert_eq!(
            s.earns_next,
            HashMap::from([("hung.example".to_owned(), t0 + Duration::from_secs(1))])
        );
        assert_eq!(s.next_earned(["known.example"]), None);
        assert_eq!(
            s.next_earned(["known.example", "hung.example"]),
            Some(t0 + Duration::from_secs(1))
        );
        let s = load.snapshot(t0 + Duration::from_millis(3500), SLOW);
        assert_eq!(s.earned, HashMap::from([("hung.example".to_owned(), 2)]));
        assert_eq!(s.next_earned(["hung.example"]), Some(t0 + Duration::from_secs(6)));
        // Its first request times out: what it earned is gone.
        let t1 = t0 + Duration::from_secs(10);
        let _second = load.hold_at("hung.example", t1);
        load.heard("hung.example", false, t1);
        let s = load.snapshot(t1, SLOW);
        assert!(s.earned.is_empty());
        assert_eq!(s.next_earned(["hung.example"]), Some(t1 + Duration::from_secs(1)));
        // At its cap it is due for nothing more.
        let s = load.snapshot(t1 + Duration::from_secs(60), SlowStart { cap: 3, ..SLOW });
        assert_eq!(s.earned, HashMap::from([("hung.example".to_owned(), 2)]));
        assert!(s.earns_next.is_empty());
    }
}
