//! When the vault asks for its transaction again: just after the ledger it
//! should land in is expected to close, then briefly and often, instead of
//! at a fixed interval that sees a landed transaction up to a whole
//! interval late (and so delays the signer's next transaction by a ledger);
//! and when a transaction still not included is due for a fee bump.
//!
//! Pure: the tip and the wall clock are arguments.

use std::time::Duration;

use crate::rpc::Tip;

/// The shortest pause between two polls, so a late ledger is not hammered.
const FASTEST_MS: u64 = 20;
/// Polls per ledger while a close is due.
const POLLS_PER_LEDGER: u64 = 25;
/// How much earlier than its expected close a ledger is looked for: the
/// host's and the server's clocks differ, and close times are whole seconds.
const EARLY_MS: u64 = 250;

/// The network's mean ledger time, from the oldest and latest ledgers the
/// server remembers and their close times. Over a retention window of
/// thousands of ledgers the whole-second close times are precise enough.
pub fn ledger_ms(tip: &Tip) -> Option<u64> {
    let ledgers = u64::from(tip.ledger.checked_sub(tip.oldest?)?);
    let seconds = tip.close_time?.checked_sub(tip.oldest_close_time?)?;
    if ledgers < 2 {
        return None;
    }
    Some((seconds.saturating_mul(1000) / ledgers).max(1))
}

/// How long to wait before the next `getTransaction`, given the tip the last
/// one answered at, the wall clock (unix milliseconds) and `poll_ms`, the
/// longest pause allowed. Without a ledger time from the server, `poll_ms`.
pub fn next_poll(tip: &Tip, now_unix_ms: u64, poll_ms: u64) -> Duration {
    let Some(ledger) = ledger_ms(tip) else {
        return Duration::from_millis(poll_ms);
    };
    let often = (ledger / POLLS_PER_LEDGER).clamp(FASTEST_MS, poll_ms.max(FASTEST_MS));
    // The close time is truncated to a second, so the latest ledger closed
    // no earlier than it says, and the next one no earlier than that plus a
    // ledger time. Until then nothing can have landed.
    let quiet_until = tip.close_time.map(|closed| {
        closed
            .saturating_mul(1000)
            .saturating_add(ledger)
            .saturating_sub(EARLY_MS)
    });
    let pause = match quiet_until {
        Some(until) if until > now_unix_ms + often => until - now_unix_ms,
        _ => often,
    };
    Duration::from_millis(pause.min(poll_ms.max(FASTEST_MS)))
}

/// Stellar's queue replaces a transaction still waiting only with a fee bump
/// bidding at least this many times its fee (replace-by-fee): anything less
/// is refused, and the transaction stays queued at its old bid.
pub const REPLACE_FACTOR: u64 = 10;

/// Whether a fee bump bidding `bid` over a transaction still queued at
/// `queued` could replace it and still land: it reaches the replace rule,
/// and the next ledger is inside the transaction's bounds (ledger
/// `max_ledger`, exclusive, and close time `max_time`, unix seconds), that
/// ledger expected one ledger time after the latest closed (a bump sent
/// after its bounds passed is refused `txTOO_LATE`, and teaches nothing).
pub fn bump_can_land(bid: u64, queued: u64, tip: &Tip, max_ledger: u32, max_time: u64, now_unix_ms: u64) -> bool {
    if bid < queued.saturating_mul(REPLACE_FACTOR) {
        return false;
    }
    if tip.ledger.saturating_add(1) >= max_ledger {
        return false;
    }
    let next_close_ms = match (tip.close_time, ledger_ms(tip)) {
        (Some(closed), Some(ledger)) => closed.saturating_mul(1000).saturating_add(ledger).max(now_unix_ms),
        _ => now_unix_ms,
    };
    next_close_ms / 1000 <= max_time
}

/// How long a sent transaction has stayed unincluded, in ledgers the
/// vault saw while polling: due for a fee bump once `after` ledgers have
/// closed since the first it saw (never with `after` 0).
#[derive(Debug, Clone, Copy)]
pub struct Unincluded {
    after: u32,
    first: Option<u32>,
}

impl Unincluded {
    pub fn new(after: u32) -> Self {
        Self { after, first: None }
    }

    /// Whether, at `ledger`, the transaction is due for a fee bump.
    pub fn due(&mut self, ledger: u32) -> bool {
        let first = *self.first.get_or_insert(ledger);
        self.after > 0 && ledger >= first.saturating_add(self.after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fee_bump_is_due_after_the_configured_ledgers_counted_from_the_first_seen() {
        let mut clock = Unincluded::new(3);
        assert!(!clock.due(100));
        assert!(!clock.due(102));
        assert!(clock.due(103));
        assert!(clock.due(110));
        let mut off = Unincluded::new(0);
        assert!(!off.due(100) && !off.due(1_000));
    }

    /// A latest close time, unix seconds.
    const T: u64 = 1_700_000_000;

    fn tip(ledger: u32, close_time: u64, oldest: u32, oldest_close_time: u64) -> Tip {
        Tip {
            ledger,
            close_time: Some(close_time),
            oldest: Some(oldest),
            oldest_close_time: Some(oldest_close_time),
        }
    }

    #[test]
    fn a_bump_is_sent_only_where_it_can_replace_and_land() {
        // 5 s ledgers, the latest (ledger 1000) closed at T; bounds: ledger
        // 1010, time T + 30.
        let t = tip(1000, T, 0, T - 5_000);
        let now = T * 1000 + 500;
        assert!(bump_can_land(1000, 100, &t, 1010, T + 30, now), "tenfold, in bounds");
        assert!(
            !bump_can_land(999, 100, &t, 1010, T + 30, now),
            "under tenfold is refused"
        );
        assert!(
            !bump_can_land(800, 100, &t, 1010, T + 30, now),
            "seed 003's 8x never replaces"
        );
        assert!(
            !bump_can_land(1000, 100, &t, 1001, T + 30, now),
            "the next ledger is past the bound"
        );
        assert!(bump_can_land(1000, 100, &t, 1002, T + 30, now));
        assert!(
            !bump_can_land(1000, 100, &t, 1010, T + 4, now),
            "the next close is past the time bound"
        );
        assert!(bump_can_land(1000, 100, &t, 1010, T + 5, now));
        // The wall clock already past the bound, whatever the tip says.
        assert!(!bump_can_land(1000, 100, &t, 1010, T + 30, (T + 31) * 1000));
        // No ledger time from the server: the wall clock alone.
        let bare = Tip {
            ledger: 1000,
            close_time: Some(T),
            oldest: None,
            oldest_close_time: None,
        };
        assert!(bump_can_land(1000, 100, &bare, 1010, T, T * 1000));
    }

    #[test]
    fn the_ledger_time_comes_from_the_retention_window() {
        // The reference's getTransaction sample: 7542 s over 1439 ledgers.
        assert_eq!(
            ledger_ms(&tip(2_540_099, 1_700_086_455, 2_538_660, 1_700_078_913)),
            Some(5241)
        );
        assert_eq!(ledger_ms(&tip(1000, 1000, 0, 500)), Some(500));
    }

    #[test]
    fn without_the_window_the_ledger_time_is_unknown() {
        let mut t = tip(10, 100, 9, 95);
        assert_eq!(ledger_ms(&t), None, "one ledger apart says too little");
        t.oldest = None;
        assert_eq!(ledger_ms(&t), None);
        let t = tip(10, 100, 20, 95);
        assert_eq!(ledger_ms(&t), None, "an oldest ledger past the latest is nonsense");
    }

    #[test]
    fn an_unknown_ledger_time_polls_at_the_configured_interval() {
        let t = Tip {
            ledger: 10,
            close_time: Some(100),
            oldest: None,
            oldest_close_time: None,
        };
        assert_eq!(next_poll(&t, 100_000, 1000), Duration::from_millis(1000));
    }

    #[test]
    fn slow_ledgers_are_left_alone_until_the_next_close_is_due() {
        // 5 s ledgers, the latest closed at T, now T + 0.5 s: nothing can
        // land before T + 4.75 s, but no pause is longer than poll_ms.
        let t = tip(100_000, T, 0, T - 500_000);
        assert_eq!(next_poll(&t, T * 1000 + 500, 10_000), Duration::from_millis(4250));
        assert_eq!(next_poll(&t, T * 1000 + 500, 1000), Duration::from_millis(1000));
    }

    #[test]
    fn a_due_close_is_polled_often() {
        let t = tip(100_000, T, 0, T - 500_000);
        // Past the expected close: 5000 / 25 = 200 ms.
        assert_eq!(next_poll(&t, T * 1000 + 5100, 10_000), Duration::from_millis(200));
        // Half-second ledgers: as often as allowed.
        let fast = tip(100_000, T, 0, T - 50_000);
        assert_eq!(
            next_poll(&fast, T * 1000 + 900, 1000),
            Duration::from_millis(FASTEST_MS)
        );
    }

    #[test]
    fn a_host_clock_behind_the_server_never_waits_past_poll_ms() {
        let t = tip(100_000, T, 0, T - 500_000);
        assert_eq!(next_poll(&t, (T - 100) * 1000, 1000), Duration::from_millis(1000));
    }
}
