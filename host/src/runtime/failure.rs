//! How a plugin call can fail, classified once from wasmtime's errors.
//!
//! The classification walks the error for the typed causes the sandbox
//! produces (a trap code, a WASI exit, the memory limiter's own error), so
//! tests assert variants, not message text. [`PluginFailure::into_outcome`]
//! maps each into the retry core's [`Outcome`].

use std::fmt;

use crate::outcome::{Fault, Outcome};

/// What kind of trap ended a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrapKind {
    /// The guest panicked (Rust panics abort through `unreachable`).
    Unreachable,
    /// Recursion ran past the stack limit.
    StackOverflow,
    /// An out-of-bounds memory access.
    MemoryOutOfBounds,
    /// Anything else, as wasmtime described it.
    Other(String),
}

impl fmt::Display for TrapKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrapKind::Unreachable => f.write_str("unreachable code reached (a panic)"),
            TrapKind::StackOverflow => f.write_str("stack overflow"),
            TrapKind::MemoryOutOfBounds => f.write_str("out-of-bounds memory access"),
            TrapKind::Other(s) => f.write_str(s),
        }
    }
}

/// Why a plugin call did not produce an outcome of its own.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PluginFailure {
    /// The call ran past its deadline (guest code or a host call).
    #[error("plugin call exceeded its deadline")]
    Timeout,
    /// The guest asked for more memory than its limit.
    #[error("plugin exceeded its memory limit ({requested} bytes requested, {max} allowed)")]
    MemoryExceeded {
        /// Bytes the guest tried to grow to.
        requested: usize,
        /// Its limit.
        max: usize,
    },
    /// The guest used up its instruction budget (fee policies).
    #[error("plugin exhausted its fuel budget")]
    FuelExhausted,
    /// The guest trapped.
    #[error("plugin trapped: {0}")]
    Trap(TrapKind),
    /// The guest called `exit` with a status.
    #[error("plugin exited with status {0}")]
    Exit(i32),
    /// The guest asked for a key or destination it was not granted.
    #[error("plugin was denied: {0}")]
    Denied(String),
    /// A host import failed in a way that is not the guest's business.
    #[error("host import failed: {0}")]
    HostImport(String),
    /// The component cannot be used by this laneway (load time).
    #[error("incompatible component: {0}")]
    Incompatible(String),
}

/// The memory limiter's refusal; carried through wasmtime as the trap cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("memory limit exceeded: {requested} > {max}")]
pub struct MemoryLimitExceeded {
    /// Bytes requested.
    pub requested: usize,
    /// The limit.
    pub max: usize,
}

/// A host import's own failure, raised as a trap.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct HostImportTrap(pub String);

impl PluginFailure {
    /// Classifies an error from a call into a component.
    pub fn classify(error: &wasmtime::Error) -> Self {
        if let Some(limit) = error.downcast_ref::<MemoryLimitExceeded>() {
            return PluginFailure::MemoryExceeded {
                requested: limit.requested,
                max: limit.max,
            };
        }
        if let Some(exit) = error.downcast_ref::<wasmtime_wasi::I32Exit>() {
            return PluginFailure::Exit(exit.0);
        }
        if let Some(host) = error.downcast_ref::<HostImportTrap>() {
            return PluginFailure::HostImport(host.0.clone());
        }
        if let Some(trap) = error.downcast_ref::<wasmtime::Trap>() {
            return match trap {
                wasmtime::Trap::Interrupt => PluginFailure::Timeout,
                wasmtime::Trap::OutOfFuel => PluginFailure::FuelExhausted,
                wasmtime::Trap::StackOverflow => PluginFailure::Trap(TrapKind::StackOverflow),
                wasmtime::Trap::UnreachableCodeReached => PluginFailure::Trap(TrapKind::Unreachable),
                wasmtime::Trap::MemoryOutOfBounds => PluginFailure::Trap(TrapKind::MemoryOutOfBounds),
                other => PluginFailure::Trap(TrapKind::Other(other.to_string())),
            };
        }
        PluginFailure::Trap(TrapKind::Other(format!("{error:#}")))
    }

    /// Whether this failure counts towards quarantining the plugin version:
    /// the guest itself misbehaved (not a slow destination, not a denial).
    pub fn is_crash(&self) -> bool {
        matches!(
            self,
            PluginFailure::MemoryExceeded { .. }
                | PluginFailure::FuelExhausted
                | PluginFailure::Trap(_)
                | PluginFailure::Exit(_)
        )
    }

    /// The retry core's view of this failure.
    pub fn into_outcome(self) -> Outcome {
        let text = self.to_string();
        Outcome::Fault(match self {
            PluginFailure::Timeout => Fault::Timeout,
            PluginFailure::MemoryExceeded { .. } | PluginFailure::FuelExhausted => Fault::ResourceLimit(text),
            PluginFailure::Denied(_) => Fault::Denied(text),
            PluginFailure::Trap(_)
            | PluginFailure::Exit(_)
            | PluginFailure::HostImport(_)
            | PluginFailure::Incompatible(_) => Fault::Crashed(text),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_causes_are_found_through_the_error() {
        let e = wasmtime::Error::new(MemoryLimitExceeded { requested: 10, max: 5 });
        assert_eq!(
            PluginFailure::classify(&e),
            PluginFailure::MemoryExceeded { requested: 10, max: 5 }
        );
        let e = wasmtime::Error::new(wasmtime_wasi::I32Exit(3));
        assert_eq!(PluginFailure::classify(&e), PluginFailure::Exit(3));
        let e = wasmtime::Error::new(wasmtime::Trap::OutOfFuel);
        assert_eq!(PluginFailure::classify(&e), PluginFailure::FuelExhausted);
        let e = wasmtime::Error::new(wasmtime::Trap::Interrupt);
        assert_eq!(PluginFailure::classify(&e), PluginFailure::Timeout);
    }

    #[test]
    fn failures_map_into_fault_outcomes() {
        assert_eq!(PluginFailure::Timeout.into_outcome(), Outcome::Fault(Fault::Timeout));
        assert!(matches!(
            PluginFailure::Denied("key".into()).into_outcome(),
            Outcome::Fault(Fault::Denied(_))
        ));
        assert!(matches!(
            PluginFailure::FuelExhausted.into_outcome(),
            Outcome::Fault(Fault::ResourceLimit(_))
        ));
        assert!(PluginFailure::Exit(1).is_crash() && !PluginFailure::Timeout.is_crash());
    }
}
