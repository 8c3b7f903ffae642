//! Per-destination rate limits: a token bucket per destination host,
//! refilled at `rate` tokens a second up to `burst`, stored as a shared
//! record so every host draws from the same bucket (a compare-and-set on
//! its version, as `destinations` does).
//!
//! Pure: the caller reads the stored bucket, asks [`take`] and stores the
//! result. [`LocalBucket`] is the same bucket held in one process's memory
//! (the public route's limit, inbound key fetches).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// The records namespace of the buckets.
pub const BUCKETS: &str = "rate";

/// A bucket as stored.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Bucket {
    /// Tokens left at `at`.
    pub tokens: f64,
    /// When `tokens` was computed.
    pub at: DateTime<Utc>,
}

/// What a draw of tokens got.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Draw {
    /// Tokens granted (at most the number asked for).
    pub granted: u32,
    /// The bucket after the draw.
    pub bucket: Bucket,
    /// When the next token is there, if the draw did not get all it asked.
    pub next_in: Option<Duration>,
}

/// Draws up to `want` tokens from `bucket` (full when there is none yet).
pub fn take(bucket: Option<Bucket>, want: u32, rate: f64, burst: u32, now: DateTime<Utc>) -> Draw {
    let burst = f64::from(burst.max(1));
    let start = bucket.unwrap_or(Bucket { tokens: burst, at: now });
    let elapsed = (now - start.at).to_std().unwrap_or_default().as_secs_f64();
    let tokens = (start.tokens + elapsed * rate).min(burst);
    // `as` saturates: a negative or huge count cannot wrap.
    let granted = want.min(tokens.floor().max(0.0) as u32);
    let left = tokens - f64::from(granted);
    let next_in = (granted < want && rate > 0.0).then(|| Duration::from_secs_f64(((1.0 - left) / rate).max(0.001)));
    Draw {
        granted,
        bucket: Bucket { tokens: left, at: now },
        next_in,
    }
}

/// A bucket one process keeps in memory, drawn a token at a time (full
/// when new).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LocalBucket(Option<Bucket>);

impl LocalBucket {
    /// Takes one token at `now` if there is one.
    pub fn admit(&mut self, rate: f64, burst: u32, now: DateTime<Utc>) -> bool {
        let draw = take(self.0, 1, rate, burst, now);
        self.0 = Some(draw.bucket);
        draw.granted == 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_800_000_000_000 + ms).unwrap_or_default()
    }

    #[test]
    fn a_full_bucket_grants_its_burst_then_one_token_per_interval() {
        let first = take(None, 10, 5.0, 3, t(0));
        assert_eq!(first.granted, 3);
        assert_eq!(first.next_in, Some(Duration::from_millis(200)));
        let early = take(Some(first.bucket), 1, 5.0, 3, t(100));
        assert_eq!(early.granted, 0);
        let wait = early.next_in.unwrap_or_default().as_secs_f64();
        assert!((wait - 0.1).abs() < 1e-6, "{wait}");
        let on_time = take(Some(early.bucket), 2, 5.0, 3, t(200));
        assert_eq!(on_time.granted, 1);
        // A long quiet refills to the burst, not beyond.
        let later = take(Some(on_time.bucket), 10, 5.0, 3, t(60_000));
        assert_eq!(later.granted, 3);
    }

    #[test]
    fn over_a_second_the_rate_holds() {
        let mut bucket = None;
        let mut granted = 0;
        for ms in (0..=1000).step_by(10) {
            let d = take(bucket, 100, 5.0, 1, t(ms));
            granted += d.granted;
            bucket = Some(d.bucket);
        }
        // One at once (the burst), then one every 200 ms.
        assert_eq!(granted, 6);
    }

    #[test]
    fn a_local_bucket_admits_its_burst_then_refills() {
        let mut b = LocalBucket::default();
        assert!(b.admit(1.0, 2, t(0)));
        assert!(b.admit(1.0, 2, t(0)));
        assert!(!b.admit(1.0, 2, t(0)));
        assert!(!b.admit(1.0, 2, t(500)));
        assert!(b.admit(1.0, 2, t(1000)));
    }
}
