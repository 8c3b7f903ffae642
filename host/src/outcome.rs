//! How one delivery attempt ended: the single classification every retry,
//! dead-letter, breaker and metrics decision reads.
//!
//! Executors report an [`Outcome`]; the host adds its own (a call that timed
//! out is a [`Fault::Timeout`]). Nothing downstream looks at HTTP statuses or
//! chain result codes: executors map those into an outcome once.

use std::fmt;
use std::time::Duration;

use crate::op::AttemptClass;

/// What went wrong inside an executor itself (not at the destination).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// The call ran past its deadline.
    Timeout,
    /// The executor trapped, panicked or exited; the text says how.
    Crashed(String),
    /// The executor hit a resource limit (memory, fuel).
    ResourceLimit(String),
    /// The executor asked for something it was not granted (a key, a host).
    Denied(String),
    /// No executor is loaded for the op's kind.
    NoExecutor,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::Timeout => f.write_str("executor timed out"),
            Fault::Crashed(why) => write!(f, "executor crashed: {why}"),
            Fault::ResourceLimit(why) => write!(f, "executor hit a resource limit: {why}"),
            Fault::Denied(why) => write!(f, "executor was denied: {why}"),
            Fault::NoExecutor => f.write_str("no executor is loaded for this kind"),
        }
    }
}

/// The result of one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The side effect happened.
    Confirmed {
        /// What proves it (a tx hash, a response id); replaces any checkpoint.
        receipt: Option<String>,
        /// A short detail for the attempt record (e.g. "202").
        detail: Option<String>,
    },
    /// It did not happen; trying again may work.
    Retryable {
        /// Why.
        reason: String,
        /// The destination asked to wait this long (Retry-After).
        retry_after: Option<Duration>,
        /// A short detail (e.g. "503", "TRY_AGAIN_LATER").
        detail: Option<String>,
        /// The next attempt should pay a higher fee.
        fee_bump: bool,
    },
    /// It will never happen with this payload.
    Permanent {
        /// Why.
        reason: String,
        /// A short detail (e.g. "410", "tx_bad_auth").
        detail: Option<String>,
    },
    /// The executor misbehaved.
    Fault(Fault),
}

impl Outcome {
    /// A plain retryable outcome.
    pub fn retry(reason: impl Into<String>) -> Self {
        Outcome::Retryable {
            reason: reason.into(),
            retry_after: None,
            detail: None,
            fee_bump: false,
        }
    }

    /// A plain permanent outcome.
    pub fn permanent(reason: impl Into<String>) -> Self {
        Outcome::Permanent {
            reason: reason.into(),
            detail: None,
        }
    }

    /// A plain confirmation.
    pub fn confirmed() -> Self {
        Outcome::Confirmed {
            receipt: None,
            detail: None,
        }
    }

    /// The class stored in the attempt history and used as the metric label.
    pub fn class(&self) -> AttemptClass {
        match self {
            Outcome::Confirmed { .. } => AttemptClass::Confirmed,
            Outcome::Retryable { .. } => AttemptClass::Retryable,
            Outcome::Permanent { .. } => AttemptClass::Permanent,
            Outcome::Fault(_) => AttemptClass::PluginFault,
        }
    }

    /// The short detail, if any.
    pub fn detail(&self) -> Option<&str> {
        match self {
            Outcome::Confirmed { detail, .. }
            | Outcome::Retryable { detail, .. }
            | Outcome::Permanent { detail, .. } => detail.as_deref(),
            Outcome::Fault(_) => None,
        }
    }

    /// The metrics label of this outcome: its class, and for a fault which
    /// fault (`timeout`, `crashed`, `resource_limit`, `denied`,
    /// `no_executor`).
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Fault(Fault::Timeout) => "timeout",
            Outcome::Fault(Fault::Crashed(_)) => "crashed",
            Outcome::Fault(Fault::ResourceLimit(_)) => "resource_limit",
            Outcome::Fault(Fault::Denied(_)) => "denied",
            Outcome::Fault(Fault::NoExecutor) => "no_executor",
            other => other.class().as_str(),
        }
    }

    /// Human-readable error text, for failures.
    pub fn error(&self) -> Option<String> {
        match self {
            Outcome::Confirmed { .. } => None,
            Outcome::Retryable { reason, .. } | Outcome::Permanent { reason, .. } => Some(reason.clone()),
            Outcome::Fault(fault) => Some(fault.to_string()),
        }
    }

    /// Whether this attempt says the destination is unhealthy (for the
    /// circuit breaker). An answer that rejects the payload (permanent) shows
    /// the destination is up; a fault is the executor's problem, not the
    /// destination's, except a timeout, which usually is the destination's.
    pub fn destination_failed(&self) -> Option<bool> {
        match self {
            Outcome::Confirmed { .. } | Outcome::Permanent { .. } => Some(false),
            Outcome::Retryable { .. } | Outcome::Fault(Fault::Timeout) => Some(true),
            Outcome::Fault(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_and_breaker_signals() {
        assert_eq!(Outcome::confirmed().class(), AttemptClass::Confirmed);
        assert_eq!(Outcome::retry("503").class(), AttemptClass::Retryable);
        assert_eq!(Outcome::permanent("410").class(), AttemptClass::Permanent);
        assert_eq!(Outcome::Fault(Fault::Timeout).class(), AttemptClass::PluginFault);
        assert_eq!(Outcome::retry("503").destination_failed(), Some(true));
        assert_eq!(Outcome::Fault(Fault::Timeout).destination_failed(), Some(true));
        assert_eq!(Outcome::permanent("410").destination_failed(), Some(false));
        assert_eq!(Outcome::Fault(Fault::Crashed("trap".into())).destination_failed(), None);
        assert_eq!(
            Outcome::Fault(Fault::NoExecutor).error().as_deref(),
            Some("no executor is loaded for this kind")
        );
    }
}
