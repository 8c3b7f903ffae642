//! Failpoints: named places in the dispatcher where a crash costs the most,
//! so that tests and the fault harness can stop the host exactly there and
//! prove what it costs.
//!
//! Off unless armed, and then a hit costs one atomic load. Two ways to arm:
//! - `LANEWAY_FAILPOINT=name` (or `name@N`, the Nth hit) in the environment
//!   aborts the process at that point: a kill -9 there, for harnesses that
//!   drive the `laneway` binary.
//! - [`arm`], for tests in one process: the task that hits the point for the
//!   given outbox never returns; the test then drops the host's runtime,
//!   which is a kill -9 as far as the database can tell (no settle, no
//!   release; leases just stay).
//!
//! The points: [`CLAIMED`] and [`SETTLING`], the two crash windows of the
//! drain's pipeline (ARCHITECTURE.md says what each costs); [`RELAY`], the
//! outcome relay's window between its enqueue and its cursor; [`PRUNING`],
//! the pruner's between an archived batch and its delete; [`INBOUND`] and
//! [`ACCEPTED`], an inbound activity verified but not enqueued, and
//! enqueued but not answered.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

/// A round's claims committed; none of its ops has started.
pub const CLAIMED: &str = "claimed";
/// A round with settles (their side effects done) is about to be sent;
/// none of them is committed.
pub const SETTLING: &str = "settling";
/// The outcome relay enqueued a page's webhook ops; its cursor is not
/// stored yet.
pub const RELAY: &str = "relay";
/// The pruner archived a batch and committed its tombstones; the ops are
/// not deleted yet.
pub const PRUNING: &str = "pruning";
/// An inbound activity's signature verified; it is not enqueued yet.
pub const INBOUND: &str = "inbound";
/// An inbound activity enqueued; the sender has not had its answer.
pub const ACCEPTED: &str = "accepted";

/// One armed point.
struct Armed {
    name: String,
    /// Only this outbox's drain stops (tests share one process).
    outbox: Option<String>,
    /// Hits still to pass before the one that stops.
    skip: u64,
    reached: bool,
}

static ANY: AtomicBool = AtomicBool::new(false);
static TABLE: Mutex<Vec<Armed>> = Mutex::new(Vec::new());
static FROM_ENV: OnceLock<Option<(String, u64)>> = OnceLock::new();
static ENV_HITS: AtomicU64 = AtomicU64::new(0);

fn table() -> std::sync::MutexGuard<'static, Vec<Armed>> {
    // Plain data: consistent even if a holder panicked.
    TABLE.lock().unwrap_or_else(PoisonError::into_inner)
}

fn from_env() -> Option<&'static (String, u64)> {
    FROM_ENV
        .get_or_init(|| {
            let value = std::env::var("LANEWAY_FAILPOINT").ok()?;
            let (name, nth) = match value.split_once('@') {
                Some((name, n)) => (name.to_owned(), n.parse().unwrap_or(1)),
                None => (value, 1),
            };
            ANY.store(true, Ordering::Release);
            Some((name, nth))
        })
        .as_ref()
}

/// Arms `name` for `outbox`'s drain: its `nth` hit (from 1) stops there.
pub fn arm(name: &str, outbox: &str, nth: u64) {
    table().push(Armed {
        name: name.to_owned(),
        outbox: Some(outbox.to_owned()),
        skip: nth.saturating_sub(1),
        reached: false,
    });
    ANY.store(true, Ordering::Release);
}

/// Whether `outbox`'s drain has stopped at `name`.
pub fn reached(name: &str, outbox: &str) -> bool {
    table()
        .iter()
        .any(|a| a.reached && a.name == name && a.outbox.as_deref() == Some(outbox))
}

/// Disarms every point armed for `outbox`.
pub fn disarm(outbox: &str) {
    table().retain(|a| a.outbox.as_deref() != Some(outbox));
}

/// The drain of `outbox` is at point `name`.
pub async fn hit(name: &str, outbox: &str) {
    if FROM_ENV.get().is_none() {
        from_env();
    }
    if !ANY.load(Ordering::Acquire) {
        return;
    }
    if let Some((armed, nth)) = from_env() {
        if armed == name && ENV_HITS.fetch_add(1, Ordering::AcqRel) + 1 == *nth {
            eprintln!("laneway: failpoint {name} reached; aborting as a crash would");
            std::process::abort();
        }
    }
    let stop = {
        let mut table = table();
        let mut stop = false;
        for a in table
            .iter_mut()
            .filter(|a| a.name == name && !a.reached && a.outbox.as_deref().is_none_or(|o| o == outbox))
        {
            if a.skip == 0 {
                a.reached = true;
                stop = true;
            } else {
                a.skip -= 1;
            }
        }
        stop
    };
    if stop {
        std::future::pending::<()>().await;
    }
}
