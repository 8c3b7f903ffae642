//! Per-destination circuit breakers: after a run of consecutive failures to
//! one destination the breaker opens for a cool-off, its ops are held (not
//! attempted, not dead-lettered, no attempt consumed), then one trial op is
//! let through; its success closes the breaker, its failure re-opens it.
//!
//! Pure state keyed by destination; the caller passes the time. At most
//! [`MAX_BREAKERS`] destinations are remembered: a breaker that closes is
//! forgotten, and past the bound the oldest run of failures (never an
//! operator's) gives way, so a flood of failing hosts cannot grow it.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

/// Destinations with a breaker state remembered at most.
pub const MAX_BREAKERS: usize = 10_000;

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
    /// The first failure of the current run.
    first_failure: Option<DateTime<Utc>>,
    /// Why the last failed attempt failed.
    last_error: Option<String>,
    /// Opened by an operator: stays open until closed by hand.
    manual: bool,
}

/// Where a breaker stands, for operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    /// Failures counted, still letting ops through.
    Closed,
    /// Holding ops until `next_trial`.
    Open,
    /// The cool-off is over: the next op is (or is out as) the trial.
    HalfOpen,
    /// Opened by an operator; holds until closed by hand.
    ForcedOpen,
}

/// One destination's breaker, for operators.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BreakerView {
    /// The destination (a URL authority).
    pub destination: String,
    /// Where it stands.
    pub state: BreakerState,
    /// Consecutive failures.
    pub failures: u32,
    /// When the current run of failures began.
    pub first_failure_at: Option<DateTime<Utc>>,
    /// Why the last failed attempt failed.
    pub last_error: Option<String>,
    /// When the next trial may go (open breakers).
    pub next_trial_at: Option<DateTime<Utc>>,
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
            Some(s) if s.manual => Admission::Hold,
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
    /// says nothing about the destination) only ends a trial. An attempt
    /// that was already out when an operator forced the breaker open does
    /// not close it.
    pub fn record(&mut self, destination: &str, failed: Option<bool>, error: Option<&str>, now: DateTime<Utc>) {
        let threshold = self.config.threshold;
        let cool_off = crate::clock::chrono_duration(self.config.cool_off);
        if failed == Some(true) && !self.states.contains_key(destination) && self.states.len() >= MAX_BREAKERS {
            self.evict_oldest();
        }
        let s = self.states.entry(destination.to_owned()).or_default();
        let was_trial = s.trial_out;
        s.trial_out = false;
        match failed {
            Some(false) if s.manual => {}
            Some(false) => *s = State::default(),
            Some(true) => {
                s.failures = s.failures.saturating_add(1);
                s.first_failure.get_or_insert(now);
                s.last_error = error.map(|e| e.chars().take(500).collect());
                if !s.manual && (was_trial || s.failures >= threshold) {
                    s.open_until = Some(now + cool_off);
                }
            }
            None => {}
        }
        if s.failures == 0 && s.open_until.is_none() && !s.manual {
            self.states.remove(destination);
        }
    }

    /// Forgets the breaker whose run of failures began longest ago, of
    /// those an operator did not open and with no trial out.
    fn evict_oldest(&mut self) {
        let oldest = self
            .states
            .iter()
            .filter(|(_, s)| !s.manual && !s.trial_out)
            .min_by_key(|(_, s)| s.first_failure)
            .map(|(d, _)| d.clone());
        if let Some(destination) = oldest {
            self.states.remove(&destination);
        }
    }

    /// Destinations remembered now (at most [`MAX_BREAKERS`]).
    pub fn len(&self) -> usize {
        self.states.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    /// Opens a destination's breaker by hand: it holds every op until
    /// [`Breakers::close`].
    pub fn force_open(&mut self, destination: &str) {
        let s = self.states.entry(destination.to_owned()).or_default();
        s.manual = true;
        s.trial_out = false;
    }

    /// Closes a destination's breaker by hand, forgetting its failures.
    /// Returns whether there was anything to close or forget.
    pub fn close(&mut self, destination: &str) -> bool {
        self.states.remove(destination).is_some()
    }

    /// Every destination with a failure counted or a breaker open.
    pub fn list(&self, now: DateTime<Utc>) -> Vec<BreakerView> {
        let mut out: Vec<BreakerView> = self
            .states
            .iter()
            .map(|(destination, s)| BreakerView {
                destination: destination.clone(),
                state: match s.open_until {
                    _ if s.manual => BreakerState::ForcedOpen,
                    None => BreakerState::Closed,
                    Some(until) if now >= until || s.trial_out => BreakerState::HalfOpen,
                    Some(_) => BreakerState::Open,
                },
                failures: s.failures,
                first_failure_at: s.first_failure,
                last_error: s.last_error.clone(),
                next_trial_at: if s.manual { None } else { s.open_until },
            })
            .collect();
        out.sort_by(|a, b| a.destination.cmp(&b.destination));
        out
    }

    /// Destinations whose breaker is open now, for operators.
    pub fn open(&self, now: DateTime<Utc>) -> Vec<(String, DateTime<Utc>)> {
        let mut open: Vec<_> = self
            .states
            .iter()
            .filter_map(|(d, s)| {
                if s.manual {
                    // Held until closed by hand.
                    return Some((d.clone(), DateTime::<Utc>::MAX_UTC));
                }
                s.open_until.filter(|u| *u > now).map(|u| (d.clone(), u))
            })
            .collect();
        open.sort();
        open
    }
}

/// The destination a lane names, for breaker purposes: the authority
/// (host and port) of a URL lane. Lanes that are not URLs (signer accounts)
/// have no breaker.
pub fn destination(lane: &str) -> Option<&str> {
    // Only URL lanes name a destination: an inbound op's lane
    // (`sender:https://…`) or a signer account does not.
    let rest = lane.strip_prefix("https://").or_else(|| lane.strip_prefix("http://"))?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    (!authority.is_empty()).then_some(authority)
}

/// The destination of an op with these lanes: its first URL lane's
/// authority (what breakers, health and the per-destination cap count).
pub fn first_destination<'a>(lanes: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    lanes.into_iter().find_map(destination)
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
            b.record("inbox.example", Some(true), None, t(i));
        }
        assert_eq!(b.peek("inbox.example", t(2)), Admission::Allow);
        b.record("inbox.example", Some(true), None, t(2));
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
        b.record("inbox.example", Some(true), None, t(63));
        assert_eq!(b.admit("inbox.example", t(64)), Admission::Hold);
        assert_eq!(b.admit("inbox.example", t(123)), Admission::Trial);
        b.record("inbox.example", Some(false), None, t(124));
        assert_eq!(b.admit("inbox.example", t(124)), Admission::Allow);
        assert!(b.open(t(124)).is_empty());
    }

    #[test]
    fn a_success_resets_the_count() {
        let mut b = Breakers::new(BreakerConfig {
            threshold: 2,
            cool_off: Duration::from_secs(60),
        });
        b.record("d", Some(true), Some("503"), t(0));
        b.record("d", Some(false), Some("503"), t(1));
        b.record("d", Some(true), Some("503"), t(2));
        assert_eq!(b.admit("d", t(3)), Admission::Allow);
    }

    #[test]
    fn an_operator_holds_a_destination_until_closing_it_by_hand() {
        let mut b = Breakers::new(BreakerConfig {
            threshold: 2,
            cool_off: Duration::from_secs(60),
        });
        b.record("d", Some(true), Some("503 busy"), t(0));
        let view = b.list(t(1));
        assert_eq!(view.len(), 1);
        assert_eq!(view[0].state, BreakerState::Closed);
        assert_eq!(view[0].failures, 1);
        assert_eq!(view[0].first_failure_at, Some(t(0)));
        assert_eq!(view[0].last_error.as_deref(), Some("503 busy"));
        b.force_open("d");
        assert_eq!(b.admit("d", t(500)), Admission::Hold, "no cool-off ends a forced open");
        // An attempt already out when it was forced open does not close it.
        b.record("d", Some(false), None, t(501));
        assert_eq!(b.admit("d", t(502)), Admission::Hold);
        assert_eq!(b.list(t(502))[0].state, BreakerState::ForcedOpen);
        assert_eq!(b.open(t(502)).len(), 1);
        assert!(b.close("d"));
        assert_eq!(b.admit("d", t(503)), Admission::Allow);
        assert!(b.list(t(503)).is_empty());
        assert!(!b.close("d"), "nothing left to close");
    }

    #[test]
    fn the_view_shows_open_then_half_open_with_the_next_trial() {
        let mut b = Breakers::new(BreakerConfig {
            threshold: 1,
            cool_off: Duration::from_secs(60),
        });
        b.record("d", Some(true), Some("timeout"), t(0));
        let open = &b.list(t(10))[0];
        assert_eq!((open.state, open.next_trial_at), (BreakerState::Open, Some(t(60))));
        assert_eq!(b.list(t(60))[0].state, BreakerState::HalfOpen);
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

    #[test]
    fn a_flood_of_failing_destinations_stays_bounded_and_keeps_the_operators() {
        let mut b = Breakers::new(BreakerConfig::default());
        let t0 = chrono::Utc::now();
        b.force_open("held.example");
        for n in 0..(MAX_BREAKERS + 5_000) {
            let at = t0 + chrono::Duration::milliseconds(i64::try_from(n).unwrap_or(0));
            b.record(&format!("h{n}.example"), Some(true), Some("refused"), at);
        }
        assert_eq!(b.len(), MAX_BREAKERS);
        assert_eq!(
            b.peek("held.example", t0),
            Admission::Hold,
            "an operator's breaker stays"
        );
        let listed = b.list(t0);
        assert!(
            listed.iter().all(|v| v.destination != "h0.example"),
            "the oldest run gave way"
        );
        assert!(listed
            .iter()
            .any(|v| v.destination == format!("h{}.example", MAX_BREAKERS + 4_999)));
    }
}
