//! Time as the queue and the dispatcher see it: a trait, so tests can move
//! time by hand instead of sleeping.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use chrono::{DateTime, Duration, TimeZone, Utc};

/// A std duration as a chrono one, saturating instead of failing (a
/// configured wait too long for chrono is as good as forever).
pub fn chrono_duration(d: std::time::Duration) -> Duration {
    Duration::from_std(d).unwrap_or(Duration::MAX)
}

/// A source of the current time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current time.
    fn now(&self) -> DateTime<Utc>;
}

/// The wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that only moves when told to, for tests of leases and backoff.
#[derive(Debug, Clone)]
pub struct ManualClock {
    millis: Arc<AtomicI64>,
}

impl ManualClock {
    /// A clock frozen at `start`.
    pub fn new(start: DateTime<Utc>) -> Self {
        Self {
            millis: Arc::new(AtomicI64::new(start.timestamp_millis())),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.millis.fetch_add(by.num_milliseconds(), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        let ms = self.millis.load(Ordering::SeqCst);
        // Every value stored came from a valid DateTime plus whole milliseconds,
        // so it is representable; fall back to the epoch rather than panic.
        Utc.timestamp_millis_opt(ms).single().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced() {
        let start = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).single().unwrap_or_default();
        let clock = ManualClock::new(start);
        assert_eq!(clock.now(), start);
        clock.advance(Duration::seconds(90));
        assert_eq!(clock.now(), start + Duration::seconds(90));
    }
}
