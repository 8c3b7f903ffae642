//! How much of a core a plugin's guest code may take once a call has
//! computed for a while: the pacing rule its epoch callbacks follow (no
//! clock of its own; the caller passes the time).
//!
//! Guests run on the host's async workers and yield at every epoch tick.
//! Yielding alone is not enough: a few guests that never stop computing
//! (an endless loop, a hostile plugin) re-queue behind every short task of
//! the host, whose many small steps (claim, sign, send, settle) each wait
//! a whole slice behind them; deliveries of healthy kinds slowed from
//! 15 ms to seconds (the fault harness's neighbours run measured it). So a
//! call's first [`GRACE`] of compute runs at full speed (a healthy plugin
//! computes for a few milliseconds a call), plus [`GRACE_PER_MIB`] for each
//! MiB of input the call was handed, since hashing, copying and parsing its
//! payload is work any plugin must do (a 1 MiB activity costs an
//! ActivityPub delivery about 12 ms of CPU, host and guest together; with
//! the flat grace, a fan-out of one paced the whole plugin to a tenth of a
//! core and its deliveries timed out). Past it, every tick of compute takes a turn on its plugin's
//! [`Overtime`] timeline, which gives all the plugin's calls together at
//! most `cpu_share_percent` of one core (10 by default) until their
//! deadlines end them. One plugin's overtime never slows another's.
//!
//! A tick is counted at each epoch callback, which comes at most a tick
//! after the guest last resumed: half a tick of compute on average, so
//! the grace is spent about twice as fast as the guest computes. That errs
//! on the side of pacing, which is the side a host facing hostile plugins
//! wants; the allowances are sized for it.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Compute a call may do at full speed.
pub const GRACE: Duration = Duration::from_millis(20);

/// Compute a call may do at full speed besides [`GRACE`], per MiB of input
/// (its op's payload and config): generous next to what a MiB costs the
/// shipped plugins, since a call paced past it slows every call of its
/// plugin for [`GRACE_LOST_FOR`]. Producers, not plugins, choose the input,
/// and `queue.max_payload_bytes` bounds it.
pub const GRACE_PER_MIB: Duration = Duration::from_millis(100);

/// How long a plugin whose calls ran past their grace gets none: a loop
/// retried again and again is paced from its first tick.
pub const GRACE_LOST_FOR: Duration = Duration::from_secs(5);

/// What the epoch callback does at a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    /// Yield to other tasks and carry on.
    Yield,
    /// Yield, and resume only after this pause.
    Pause(Duration),
}

/// One plugin version's timeline of overtime: when the next tick of
/// compute past a grace may run. Shared by all its calls.
#[derive(Debug, Default)]
pub struct Overtime {
    next_free: Mutex<Option<Instant>>,
}

impl Overtime {
    /// Whether the plugin's calls ran past their grace within the last
    /// [`GRACE_LOST_FOR`].
    fn recent(&self, now: Instant) -> bool {
        let next_free = self.next_free.lock().unwrap_or_else(PoisonError::into_inner);
        next_free.is_some_and(|free| free + GRACE_LOST_FOR > now)
    }

    /// Books a turn of `turn` (a tick of compute and the pause that keeps
    /// the plugin to its share) at the earliest free time after `now`: how
    /// long the caller waits for it.
    fn book(&self, now: Instant, turn: Duration) -> Duration {
        let mut next_free = self.next_free.lock().unwrap_or_else(PoisonError::into_inner);
        let start = next_free.map_or(now, |free| free.max(now));
        *next_free = Some(start + turn);
        start - now
    }
}

/// One call's pacing: counts the ticks it has computed through.
#[derive(Debug)]
pub struct Pacer {
    tick: Duration,
    /// A tick of compute and its pause: `tick x 100 / share`.
    turn: Duration,
    grace: u32,
    ticks: u32,
}

impl Pacer {
    /// A pacer for a call handed `input_bytes` of input, under an engine
    /// ticking every `tick`, of a plugin allowed `share_percent` of a core
    /// past the grace.
    pub fn new(tick: Duration, share_percent: u32, input_bytes: usize) -> Self {
        let tick = tick.max(Duration::from_millis(1));
        let per_input = GRACE_PER_MIB.as_micros().saturating_mul(input_bytes as u128) / (1 << 20);
        let grace = u32::try_from((GRACE.as_micros() + per_input) / tick.as_micros()).unwrap_or(u32::MAX);
        let turn = tick * 100 / share_percent.clamp(1, 100);
        Self {
            tick,
            turn,
            grace,
            ticks: 0,
        }
    }

    /// Ticks of compute at full speed.
    pub fn grace(&self) -> u32 {
        self.grace
    }

    /// The guest computed through another tick (the callback only runs
    /// while guest code runs, and at most a tick after it last resumed);
    /// past the grace, the tick it is about to compute is booked on its
    /// plugin's `overtime`.
    pub fn tick(&mut self, overtime: &Overtime, now: Instant) -> Pace {
        self.ticks = self.ticks.saturating_add(1);
        if self.turn <= self.tick || (self.ticks <= self.grace && !overtime.recent(now)) {
            return Pace::Yield;
        }
        // The pause that keeps one call to its share, or longer while the
        // plugin's other calls hold the earlier turns.
        let wait = overtime.book(now, self.turn);
        Pace::Pause(wait.max(self.turn - self.tick))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICK: Duration = Duration::from_millis(1);

    #[test]
    fn a_short_call_is_never_paused() {
        let (overtime, start) = (Overtime::default(), Instant::now());
        let mut pacer = Pacer::new(TICK, 10, 0);
        assert_eq!(pacer.grace(), 20);
        for n in 0..20 {
            assert_eq!(pacer.tick(&overtime, start + TICK * n), Pace::Yield);
        }
    }

    #[test]
    fn past_the_grace_one_call_computes_one_tick_in_four_at_25_percent() {
        let (overtime, start) = (Overtime::default(), Instant::now());
        let mut pacer = Pacer::new(Duration::from_millis(10), 25, 0);
        assert_eq!(pacer.grace(), 2);
        let mut now = start;
        for _ in 0..2 {
            assert_eq!(pacer.tick(&overtime, now), Pace::Yield);
            now += Duration::from_millis(10);
        }
        for _ in 0..100 {
            let Pace::Pause(pause) = pacer.tick(&overtime, now) else {
                panic!("not paused past the grace");
            };
            assert_eq!(pause, Duration::from_millis(30));
            // It pauses, then computes one tick.
            now += pause + Duration::from_millis(10);
        }
    }

    #[test]
    fn a_plugin_recently_past_its_grace_gets_none_until_it_rests() {
        let (overtime, start) = (Overtime::default(), Instant::now());
        let mut first = Pacer::new(TICK, 10, 0);
        let mut now = start;
        for _ in 0..=20 {
            first.tick(&overtime, now);
            now += TICK;
        }
        let mut second = Pacer::new(TICK, 10, 0);
        assert!(matches!(second.tick(&overtime, now), Pace::Pause(_)));
        let mut rested = Pacer::new(TICK, 10, 0);
        assert_eq!(rested.tick(&overtime, now + GRACE_LOST_FOR + TICK * 100), Pace::Yield);
    }

    #[test]
    fn a_calls_grace_grows_with_its_input() {
        let (overtime, now) = (Overtime::default(), Instant::now());
        assert_eq!(Pacer::new(TICK, 10, 512).grace(), 20);
        assert_eq!(Pacer::new(TICK, 10, 1 << 19).grace(), 70);
        let mut pacer = Pacer::new(TICK, 10, 1 << 20);
        assert_eq!(pacer.grace(), 120);
        for _ in 0..120 {
            assert_eq!(pacer.tick(&overtime, now), Pace::Yield);
        }
        assert!(matches!(pacer.tick(&overtime, now), Pace::Pause(_)));
        assert_eq!(Pacer::new(TICK, 10, usize::MAX).grace(), u32::MAX, "saturates");
    }

    #[test]
    fn a_full_share_is_never_paused() {
        let (overtime, now) = (Overtime::default(), Instant::now());
        let mut pacer = Pacer::new(TICK, 100, 0);
        for _ in 0..1000 {
            assert_eq!(pacer.tick(&overtime, now), Pace::Yield);
        }
    }

    /// Four calls spinning at once get a tenth of a core between them, not
    /// a tenth each.
    #[test]
    fn a_plugins_calls_share_its_tenth_of_a_core() {
        let (overtime, start) = (Overtime::default(), Instant::now());
        let mut calls: Vec<(Pacer, Instant)> = (0..4).map(|_| (Pacer::new(TICK, 10, 0), start)).collect();
        let mut computed = Duration::ZERO;
        let end = start + Duration::from_secs(2);
        // Each call, in turn of who resumes first: a tick, then its pause.
        while let Some((pacer, at)) = calls.iter_mut().min_by_key(|(_, at)| *at) {
            if *at >= end {
                break;
            }
            match pacer.tick(&overtime, *at) {
                Pace::Yield => *at += TICK,
                Pace::Pause(pause) => *at += pause + TICK,
            }
            computed += TICK;
        }
        // All four start together, each in its grace.
        let grace = GRACE * 4;
        let overtime_share = (computed - grace).as_secs_f64() / (Duration::from_secs(2) - GRACE).as_secs_f64();
        assert!(
            (0.08..=0.105).contains(&overtime_share),
            "four calls computed {overtime_share:.3} of a core past their grace"
        );
    }

    #[test]
    fn one_plugins_overtime_does_not_delay_another() {
        let (busy, idle, now) = (Overtime::default(), Overtime::default(), Instant::now());
        for _ in 0..100 {
            busy.book(now, TICK * 10);
        }
        assert_eq!(idle.book(now, TICK * 10), Duration::ZERO);
    }

    #[test]
    fn a_tick_below_a_millisecond_is_read_as_one() {
        let (overtime, now) = (Overtime::default(), Instant::now());
        let mut pacer = Pacer::new(Duration::ZERO, 10, 0);
        assert_eq!(pacer.grace(), 20);
        for _ in 0..20 {
            pacer.tick(&overtime, now);
        }
        assert_eq!(pacer.tick(&overtime, now), Pace::Pause(Duration::from_millis(9)));
    }
}
