//! Destination health over days, shared by every host: consecutive failures
//! to a destination host since its first failure, and whether the host is
//! held. A host failing for longer than the unavailable period becomes
//! *unavailable* (its ops are held, not attempted and not dead-lettered,
//! except one probe op per interval); a 410 from a shared inbox or an
//! operator *suspends* it (held, no probes). A success, an inbound activity
//! from the host or an operator's resume makes it available again, except
//! that an operator's suspension is lifted only by an operator: a server
//! cannot end its own suspension by sending us an activity.
//!
//! Pure: the caller passes the time and stores the result (`destinations`).
//! The per-host breaker (`breaker`) is the short-term counterpart: it
//! reacts within a minute on one host, this over days on all of them.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::clock::chrono_duration;

/// Health settings (`[destinations]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    /// How long a host may fail without a success before it is marked
    /// unavailable (Misskey and Mastodon: 7 days).
    pub unavailable_after: Duration,
    /// How often an unavailable host gets one probe op.
    pub probe_every: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            unavailable_after: Duration::from_secs(7 * 24 * 3600),
            probe_every: Duration::from_secs(3600),
        }
    }
}

/// Whether a destination host's ops go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HealthState {
    /// Attempted as usual (failures may be counting).
    #[default]
    Available,
    /// Failed past the unavailable period: held, one probe per interval.
    Unavailable,
    /// Suspended by a shared-inbox 410 or an operator: held, no probes.
    Suspended,
}

impl HealthState {
    /// The name used in the API, the CLI and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            HealthState::Available => "available",
            HealthState::Unavailable => "unavailable",
            HealthState::Suspended => "suspended",
        }
    }
}

/// One destination host's health, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Health {
    /// Failed attempts since the last success.
    pub failures: u64,
    /// The first failure since the last success.
    pub first_failure_at: Option<DateTime<Utc>>,
    /// The latest failure.
    pub last_failure_at: Option<DateTime<Utc>>,
    /// Why the latest failure failed.
    pub last_error: Option<String>,
    /// Whether its ops go.
    pub state: HealthState,
    /// When the state was entered (unset while available).
    pub since: Option<DateTime<Utc>>,
    /// Why it is held.
    pub reason: Option<String>,
    /// When an unavailable host's next probe may go.
    pub next_probe_at: Option<DateTime<Utc>>,
    /// Suspended by an operator (only an operator resumes it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub by_operator: bool,
}

/// Something that bears on a host's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event<'a> {
    /// The host answered (a delivery, or a refusal that proves it is up).
    Answered,
    /// An attempt failed because of the host (5xx, timeout, no connection).
    Failed {
        /// Why.
        error: &'a str,
    },
    /// A shared inbox of the host answered 410 Gone.
    SharedInboxGone {
        /// Which.
        inbox: &'a str,
    },
    /// The host sent us a verified activity: it is up.
    Inbound,
    /// An operator suspended it.
    Suspend {
        /// The operator's reason.
        reason: &'a str,
    },
    /// An operator resumed it.
    Resume,
}

/// What a drain may do with an op for a host now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Attempt it.
    Go,
    /// Hold it; look again at `until` if set (the next probe).
    Hold {
        /// When a probe may go.
        until: Option<DateTime<Utc>>,
    },
    /// A probe is due: claim it (see [`Health::take_probe`]) and attempt it.
    Probe,
}

impl Health {
    /// `true` when nothing is known against the host (the record can go).
    pub fn is_clear(&self) -> bool {
        *self == Health::default()
    }

    /// Whether the host's ops are held.
    pub fn held(&self) -> bool {
        self.state != HealthState::Available
    }

    /// The health after `event` at `now`.
    #[must_use]
    pub fn after(&self, event: Event<'_>, now: DateTime<Utc>, config: &HealthConfig) -> Health {
        match event {
            // The host is up, but an operator's suspension stands: only
            // what is known against the host is cleared.
            Event::Answered | Event::Inbound if self.by_operator => Health {
                failures: 0,
                first_failure_at: None,
                last_failure_at: None,
                last_error: None,
                ..self.clone()
            },
            Event::Answered | Event::Inbound | Event::Resume => Health::default(),
            Event::Failed { error } => {
                let mut next = self.clone();
                next.failures = next.failures.saturating_add(1);
                let first = *next.first_failure_at.get_or_insert(now);
                next.last_failure_at = Some(now);
                next.last_error = Some(error.to_owned());
                if next.state == HealthState::Available && now - first >= chrono_duration(config.unavailable_after) {
                    next.state = HealthState::Unavailable;
                    next.since = Some(now);
                    next.reason = Some(format!(
                        "failing since {} ({} failures, none answered)",
                        first.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                        next.failures
                    ));
                    next.next_probe_at = Some(now + chrono_duration(config.probe_every));
                }
                next
            }
            Event::SharedInboxGone { .. } if self.by_operator => self.clone(),
            Event::SharedInboxGone { inbox } => {
                self.suspended(format!("410 Gone from shared inbox {inbox}"), now, false)
            }
            Event::Suspend { reason } => self.suspended(reason.to_owned(), now, true),
        }
    }

    fn suspended(&self, reason: String, now: DateTime<Utc>, by_operator: bool) -> Health {
        Health {
            state: HealthState::Suspended,
            since: Some(now),
            reason: Some(reason),
            next_probe_at: None,
            by_operator,
            ..self.clone()
        }
    }

    /// Whether an op for this host may go at `now`.
    pub fn admit(&self, now: DateTime<Utc>) -> Admit {
        match self.state {
            HealthState::Available => Admit::Go,
            HealthState::Suspended => Admit::Hold { until: None },
            HealthState::Unavailable => match self.next_probe_at {
                Some(at) if at > now => Admit::Hold { until: Some(at) },
                _ => Admit::Probe,
            },
        }
    }

    /// Takes the due probe: the health with the next one an interval away,
    /// or `None` if no probe is due. Stored by compare-and-set, so of all
    /// the hosts that try, one sends it.
    pub fn take_probe(&self, now: DateTime<Utc>, config: &HealthConfig) -> Option<Health> {
        (self.admit(now) == Admit::Probe).then(|| Health {
            next_probe_at: Some(now + chrono_duration(config.probe_every)),
            ..self.clone()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn t(hours: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_800_000_000 + hours * 3600, 0)
            .single()
            .unwrap_or_default()
    }

    fn failed(h: &Health, at: DateTime<Utc>) -> Health {
        h.after(Event::Failed { error: "HTTP 503" }, at, &HealthConfig::default())
    }

    #[test]
    fn a_host_failing_past_the_period_is_unavailable_and_probed_hourly() {
        let config = HealthConfig::default();
        let mut h = Health::default();
        for hour in 0..=167 {
            h = failed(&h, t(hour));
            assert_eq!(h.state, HealthState::Available, "hour {hour}");
            assert_eq!(h.admit(t(hour)), Admit::Go);
        }
        assert_eq!(h.failures, 168);
        assert_eq!(h.first_failure_at, Some(t(0)));
        h = failed(&h, t(168));
        assert_eq!(h.state, HealthState::Unavailable);
        assert_eq!(h.since, Some(t(168)));
        assert!(
            h.reason.as_deref().is_some_and(|r| r.contains("169 failures")),
            "{:?}",
            h.reason
        );
        assert_eq!(h.admit(t(168)), Admit::Hold { until: Some(t(169)) });
        assert_eq!(h.take_probe(t(168), &config), None);
        let probing = h.take_probe(t(169), &config);
        assert_eq!(
            probing.as_ref().map(|p| p.admit(t(169))),
            Some(Admit::Hold { until: Some(t(170)) })
        );
        // A failed probe keeps it unavailable; a success clears it.
        let after_probe = probing.map(|p| failed(&p, t(169))).unwrap_or_default();
        assert_eq!(after_probe.state, HealthState::Unavailable);
        assert_eq!(after_probe.next_probe_at, Some(t(170)));
        let back = after_probe.after(Event::Answered, t(170), &config);
        assert!(back.is_clear());
        assert_eq!(back.admit(t(170)), Admit::Go);
    }

    #[test]
    fn one_answer_restarts_the_count() {
        let config = HealthConfig::default();
        let h = failed(&Health::default(), t(0));
        let h = h.after(Event::Answered, t(100), &config);
        let h = failed(&h, t(167));
        let h = failed(&h, t(200));
        assert_eq!(h.state, HealthState::Available, "first failure is t(167), not t(0)");
        assert_eq!(h.failures, 2);
    }

    #[test]
    fn a_shared_inbox_410_or_an_operator_suspends_without_probes() {
        let config = HealthConfig::default();
        let gone = Health::default().after(
            Event::SharedInboxGone {
                inbox: "https://a.example/inbox",
            },
            t(0),
            &config,
        );
        assert_eq!(gone.state, HealthState::Suspended);
        assert_eq!(gone.admit(t(1000)), Admit::Hold { until: None });
        assert_eq!(gone.take_probe(t(1000), &config), None);
        // Failures while suspended do not turn it into a probed host.
        assert_eq!(failed(&gone, t(2000)).state, HealthState::Suspended);
        let inbound = gone.after(Event::Inbound, t(3), &config);
        assert!(inbound.is_clear());
        let by_hand = Health::default().after(Event::Suspend { reason: "abuse" }, t(0), &config);
        assert_eq!(by_hand.reason.as_deref(), Some("abuse"));
        assert!(by_hand.after(Event::Resume, t(1), &config).is_clear());
    }

    #[test]
    fn only_an_operator_lifts_an_operator_suspension() {
        let config = HealthConfig::default();
        let by_hand = failed(&Health::default(), t(0)).after(Event::Suspend { reason: "abuse" }, t(1), &config);
        assert!(by_hand.by_operator);
        for event in [
            Event::Inbound,
            Event::Answered,
            Event::SharedInboxGone {
                inbox: "https://a/inbox",
            },
        ] {
            let after = by_hand.after(event, t(2), &config);
            assert_eq!(after.state, HealthState::Suspended, "{event:?}");
            assert_eq!(after.reason.as_deref(), Some("abuse"), "{event:?}");
            assert_eq!(after.admit(t(3)), Admit::Hold { until: None }, "{event:?}");
        }
        assert_eq!(by_hand.after(Event::Inbound, t(2), &config).failures, 0);
        assert!(by_hand.after(Event::Resume, t(2), &config).is_clear());
        let text = serde_json::to_string(&by_hand).unwrap_or_default();
        assert_eq!(serde_json::from_str::<Health>(&text).ok(), Some(by_hand));
    }

    #[test]
    fn stored_form_round_trips() {
        let h = failed(&Health::default(), t(0));
        let text = serde_json::to_string(&h).unwrap_or_default();
        assert_eq!(serde_json::from_str::<Health>(&text).ok(), Some(h));
    }
}
