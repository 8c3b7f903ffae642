//! The Stellar fee policy of seed 003, as pure functions of their inputs:
//! `observe` folds a `getFeeStats` sample into the oracle snapshot
//! (recommended = p70, aggressive = p95, floored at 100 and clamped to
//! [min, max]; congestion from ledger capacity usage and the min→p95 spread,
//! with hysteresis and a dwell), and `quote` prices one op (NORMAL at the
//! recommended fee; LOW deferred under high congestion up to a bound;
//! CRITICAL aggressive from elevated congestion and never deferred; a
//! compounding bump per attempt; an absolute cap). Every number is a config
//! tunable.

use laneway_sdk::{
    Congestion, Decision, FeePolicy, FeeQuote, FeeSample, PolicyPriority as Priority, QuoteRequest, Snapshot,
};
use serde::Deserialize;

/// The policy's config (every field optional; defaults are seed 003's).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
struct Config {
    min_fee: u64,
    max_fee: u64,
    default_base_fee: u64,
    ttl_ms: i64,
    stale_grace_ms: i64,
    dwell_ms: i64,
    hysteresis: f64,
    /// Soroban transactions a ledger can hold, for capacity usage.
    ledger_max_tx: u32,
    /// Usage at which each level starts: elevated, high, severe.
    usage_levels: [f64; 3],
    /// p95/min spread at which each level starts: elevated, high, severe.
    /// An ordinary network has some wallets bidding twice the minimum (the
    /// distribution Stellar's docs show: min 100, p95 200), so the spread
    /// grades elevated only from 5x; surge pricing moves it by orders of
    /// magnitude.
    spread_levels: [f64; 3],
    low_defer_ms: u64,
    low_max_defer_ms: u64,
    /// Each attempt after the first bids this many times the last
    /// (compounding, at most `max_bumps` times, at most `max_abs_fee`).
    bump_multiplier: f64,
    max_bumps: u32,
    max_abs_fee: u64,
    /// Expected confirmation (seconds) per congestion level.
    eta_seconds: [u32; 4],
}

impl Default for Config {
    fn default() -> Self {
        Self {
            min_fee: 100,
            max_fee: 50_000,
            default_base_fee: 100,
            ttl_ms: 30_000,
            stale_grace_ms: 1_000,
            dwell_ms: 30_000,
            hysteresis: 0.05,
            ledger_max_tx: 100,
            usage_levels: [0.5, 0.75, 0.9],
            spread_levels: [5.0, 20.0, 100.0],
            low_defer_ms: 15_000,
            low_max_defer_ms: 300_000,
            // Stellar's queue replaces a stuck transaction only for ten
            // times its bid: seed 003's 2x (2, 4, 8x over three bumps)
            // never did, and a stuck payment waited out its bounds.
            bump_multiplier: 10.0,
            max_bumps: 3,
            max_abs_fee: 100_000,
            eta_seconds: [6, 12, 30, 60],
        }
    }
}

fn level_index(c: Congestion) -> usize {
    match c {
        Congestion::Low => 0,
        Congestion::Elevated => 1,
        Congestion::High => 2,
        Congestion::Severe => 3,
    }
}

fn level_of(i: usize) -> Congestion {
    match i {
        0 => Congestion::Low,
        1 => Congestion::Elevated,
        2 => Congestion::High,
        _ => Congestion::Severe,
    }
}

impl Config {
    fn parse(text: &str) -> Result<Self, String> {
        if text.trim().is_empty() {
            return Ok(Self::default());
        }
        serde_json::from_str(text).map_err(|e| format!("bad fee policy config: {e}"))
    }

    /// The level the signals call for, leaving the current level only past
    /// its threshold by the hysteresis margin (so noise at a boundary does
    /// not flap).
    fn level(&self, usage: f64, spread: f64, current: usize) -> usize {
        let raw = |margin: f64| {
            (0..3)
                .rev()
                .find(|&i| usage >= self.usage_levels[i] - margin || spread >= self.spread_levels[i] * (1.0 - margin))
                .map_or(0, |i| i + 1)
        };
        let up = raw(0.0);
        if up > current {
            return up;
        }
        // Going down needs the signals clearly below the current level's
        // threshold, not just below it: judge them against lowered thresholds.
        let down = raw(self.hysteresis);
        down.min(current)
    }

    fn clamp(&self, fee: u64, clamped: &mut Vec<&'static str>) -> u64 {
        let floored = fee.max(100);
        if floored < self.min_fee {
            clamped.push("min");
            self.min_fee
        } else if floored > self.max_fee {
            clamped.push("max");
            self.max_fee
        } else {
            floored
        }
    }
}

struct Policy;

impl FeePolicy for Policy {
    fn observe(previous: Option<Snapshot>, sample: FeeSample, now_ms: i64, config: String) -> Result<Snapshot, String> {
        let config = Config::parse(&config)?;
        let mut clamped = Vec::new();
        let recommended = config.clamp(sample.p70, &mut clamped);
        let aggressive = config.clamp(sample.p95, &mut clamped).max(recommended);
        let capacity = f64::from(config.ledger_max_tx.max(1)) * f64::from(sample.ledger_count.max(1));
        let usage = (f64::from(sample.transaction_count) / capacity).clamp(0.0, 1.0);
        let spread = sample.p95 as f64 / sample.min.max(1) as f64;
        let (current, since) = match &previous {
            Some(p) => (level_index(p.congestion), p.congestion_since_ms),
            None => (0, now_ms),
        };
        let wanted = config.level(usage, spread, current);
        // A level is held at least the dwell time before it changes again;
        // the first sample sets it at once.
        let (level, since) = if previous.is_none() || (wanted != current && now_ms - since >= config.dwell_ms) {
            (wanted, now_ms)
        } else {
            (current, since)
        };
        clamped.dedup();
        Ok(Snapshot {
            recommended_base_fee: recommended,
            aggressive_base_fee: aggressive,
            congestion: level_of(level),
            ledger_capacity_usage: usage,
            sampled_at_ms: now_ms,
            congestion_since_ms: since,
            clamped: clamped.join(","),
        })
    }

    fn quote(request: QuoteRequest) -> Result<Decision, String> {
        let config = Config::parse(&request.config)?;
        let fresh = request
            .snapshot
            .as_ref()
            .filter(|s| request.now_ms - s.sampled_at_ms <= config.ttl_ms + config.stale_grace_ms);
        let level = fresh.map_or(0, |s| level_index(s.congestion));
        if request.priority == Priority::Low && level >= 2 {
            let waited = u64::try_from(request.now_ms - request.enqueued_at_ms).unwrap_or(0);
            if waited < config.low_max_defer_ms {
                let left = config.low_max_defer_ms - waited;
                return Ok(Decision::Defer(config.low_defer_ms.min(left)));
            }
        }
        let (base, aggressive) = match fresh {
            None => (config.default_base_fee, false),
            Some(s) if request.priority == Priority::Critical && level >= 1 => (s.aggressive_base_fee, true),
            Some(s) => (s.recommended_base_fee, false),
        };
        let bumps = request.attempts.saturating_sub(1).min(config.max_bumps);
        let multiplied = base as f64 * config.bump_multiplier.powi(i32::try_from(bumps).unwrap_or(0));
        let capped = multiplied >= config.max_abs_fee as f64;
        let fee = if capped {
            config.max_abs_fee
        } else {
            multiplied.ceil() as u64
        };
        Ok(Decision::Submit(FeeQuote {
            fee,
            aggressive,
            capped,
            est_confirmation_seconds: config.eta_seconds[level.min(3)],
        }))
    }
}

laneway_sdk::fee_policy!(Policy);
