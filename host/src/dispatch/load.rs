//! How many ops this host has in flight to each destination host, counted
//! from the moment a drain takes a permit for one until its attempt ends,
//! so the scheduler's per-destination cap holds across every drain here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::OwnedSemaphorePermit;

/// The host-wide count per destination; only destinations with ops in
/// flight have an entry, so a copy is as small as what is in flight.
#[derive(Debug, Default)]
pub(crate) struct DestinationLoad(Mutex<HashMap<String, usize>>);

impl DestinationLoad {
    fn counts(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        // Plain counts: consistent even if a holder panicked.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The counts now, for one schedule.
    pub fn snapshot(&self) -> HashMap<String, usize> {
        self.counts().clone()
    }

    /// Counts one op to `destination` until the returned guard is dropped.
    pub fn hold(self: &Arc<Self>, destination: &str) -> Holding {
        *self.counts().entry(destination.to_owned()).or_default() += 1;
        Holding {
            load: self.clone(),
            destination: destination.to_owned(),
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
        let mut counts = self.load.counts();
        if let Some(n) = counts.get_mut(&self.destination) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.destination);
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
        assert_eq!(load.snapshot().get("a.example"), Some(&2));
        drop(a);
        drop(c);
        assert_eq!(load.snapshot(), HashMap::from([("a.example".to_owned(), 1)]));
        drop(b);
        assert!(load.snapshot().is_empty());
    }
}
