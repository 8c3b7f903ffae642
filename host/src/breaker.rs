//! Per-destination circuit breakers: after a run of consecutive failures to
//! one destination the breaker opens for a cool-off, its ops are held (not
//! attempted, not dead-lettered, no attempt consumed), then one trial op is
//! let through; its success closes the breaker, its failure re-opens it.
//!
//! Pure state keyed by destination; the caller passes the time.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

/// Breaker settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker (Mastodon: 10).
    pub threshold: u32,
    /// How long it stays open before a trial (Mastodon: 60 s).
    pub cool_off: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            threshold: 10,
            cool_off: Duration::from_secs(60),
        }
    }
}

/// Whether an op for a destination may be attempted now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Closed: go.
    Allow,
    /// Half-open: this one op is the trial.
    Trial,
    /// Open (or a trial is already out): hold the op.
    Hold,
}

#[derive(Debug, Clone, Default)]
struct State {
    failures: u32,
    open_until: Option<DateTime<Utc>>,
    trial_out: bool,
}

/// All breakers of one host process.
#[derive(Debug, Clone, Default)]
pub struct Breakers {
    config: BreakerConfig,
    states: HashMap<String, State>,
}

impl Breakers {
    /// Breakers with the given settings, all closed.
    pub fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            states: HashMap::new(),
        }
    }

    /// Would an op for `destination` be admitted? Does not change state.
    pub fn peek(&self, destination: &str, now: DateTime<Utc>) -> Admission {
        match self.states.get(destination) {
            None => Admission::Allow,
            Some(s) => match s.open_until {
                None => Admission::Allow,
                Some(_) if s.trial_out => Admission::Hold,
                Some(until) if now >= until => Admission::Trial,
                Some(_) => Admission::Hold,
            },
        }
    }

    /// Admits an op for `destination`, marking the trial as out if this is it.
    pub fn admit(&mut self, destination: &str, now: DateTime<Utc>) -> Admission {
        let admission = self.peek(destination, now);
        if admission == Admission::Trial {
            if let Some(s) = self.states.get_mut(destination) {
                s.trial_out = true;
            }
        }
        admission
    }

    /// Records how an admitted attempt went. `None` (an executor fault that
    /// says nothing about the destination) only ends a trial.
    pub fn record(&mut self, destination: &str, failed: Option<bool>, now: DateTime<Utc>) {
        let threshold = self.config.threshold;
        let cool_off = crate::clock::chrono_duration(self.config.cool_off);
        let s = self.states.entry(destination.to_owned()).or_default();
        let was_trial = s.trial_out;
        s.trial_out = false;
        match failed {
            Some(false) => *s = State::default(),
            Some(true) => {
                s.failures = s.failures.saturating_add(1);
                if was_trial || s.failures >= threshold {
                    s.open_until = Some(now + cool_off);
                }
            }
            None => {}
        }
        if s.failures == 0 && s.open_until.is_none() {
            self.states.remove(destination);
        }
    }

    /// Destinations whose breaker is open now, for operators.
    pub fn open(&self, now: DateTime<Utc>) -> Vec<(String, DateTime<Utc>)> {
        let mut open: Vec<_> = self
            .states
            .iter()
            .filter_map(|(d, s)| s.open_until.filter(|u| *u > now).map(|u| (d.clone(), u)))
            .collect();
        open.sort();
        open
    }
}

/// The destination a lane names, for breaker purposes: the authority
/// (host and port) of a URL lane. Lanes that are not URLs (signer accounts)
/// have no breaker.
pub fn destination(lane: &str) -> Option<&str> {
    let (_, rest) = lane.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    (!authority.is_empty()).then_some(authority)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn t(secs: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_800_000_000 + secs, 0).single().unwrap_or_default()
    }

    #[test]
    fn opens_after_the_threshold_holds_then_trials_once() {
        let mut b = Breakers::new(BreakerConfig {
            threshold: 3,
            cool_off: Duration::from_secs(60),
        });
        for i in 0..2 {
            assert_eq!(b.admit("inbox.example", t(i)), Admission::Allow);
            b.record("inbox.example", Some(true), t(i));
        }
        assert_eq!(b.peek("inbox.example", t(2)), Admission::Allow);
        b.record("inbox.example", Some(true), t(2));
        assert_eq!(b.admit("inbox.example", t(3)), Admission::Hold);
        assert_eq!(b.admit("other.example", t(3)), Admission::Allow);
        assert_eq!(b.open(t(3)), vec![("inbox.example".to_owned(), t(62))]);
        assert_eq!(b.admit("inbox.example", t(62)), Admission::Trial);
        assert_eq!(
            b.admit("inbox.example", t(62)),
            Admission::Hold,
            "only one trial at a time"
        );
        // A failed trial re-opens at once.
        b.record("inbox.example", Some(true), t(63));
        assert_eq!(b.admit("inbox.example", t(64)), Admission::Hold);
        assert_eq!(b.admit("inbox.example", t(123)), Admission::Trial);
        b.record("inbox.example", Some(false), t(124));
        assert_eq!(b.admit("inbox.example", t(124)), Admission::Allow);
        assert!(b.open(t(124)).is_empty());
    }

    #[test]
    fn a_success_resets_the_count() {
        let mut b = Breakers::new(BreakerConfig {
            threshold: 2,
            cool_off: Duration::from_secs(60),
        });
        b.record("d", Some(true), t(0));
        b.record("d", Some(false), t(1));
        b.record("d", Some(true), t(2));
        assert_eq!(b.admit("d", t(3)), Admission::Allow);
    }

    #[test]
    fn url_lanes_name_their_authority() {
        assert_eq!(
            destination("https://coord.example/users/a/inbox"),
            Some("coord.example")
        );
        assert_eq!(destination("http://127.0.0.1:8080/inbox"), Some("127.0.0.1:8080"));
        assert_eq!(destination("https://u:p@h.example?x"), Some("h.example"));
        assert_eq!(destination("GABCDEF"), None);
    }
}
