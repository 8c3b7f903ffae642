//! Fee oracle values in laneway's own types: a network sample, the snapshot
//! every host shares through the database (as JSON), and a fee policy's
//! decision for one attempt.

use serde::{Deserialize, Serialize};

/// Network congestion, as the fee policy grades it (ordered by severity).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Congestion {
    /// Fees at the floor.
    Low,
    /// Busy: CRITICAL ops bid aggressively.
    Elevated,
    /// LOW ops are deferred.
    High,
    /// Everything but CRITICAL waits where it can.
    Severe,
}

/// One poll of the network: the Soroban inclusion-fee distribution (stroops).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FeeSample {
    pub min: u64,
    pub mode: u64,
    pub p50: u64,
    pub p70: u64,
    pub p90: u64,
    pub p95: u64,
    pub p99: u64,
    pub max: u64,
    pub transaction_count: u32,
    pub ledger_count: u32,
    pub latest_ledger: u32,
}

/// The oracle's snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FeeSnapshot {
    pub recommended_base_fee: u64,
    pub aggressive_base_fee: u64,
    pub congestion: Congestion,
    pub ledger_capacity_usage: f64,
    pub sampled_at_ms: i64,
    pub congestion_since_ms: i64,
    /// A bound that clamped the fees this sample: "min", "max" or empty.
    pub clamped: String,
}

/// The fee an attempt bids, as the fee policy quoted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FeeBid {
    /// Inclusion fee per operation (stroops), bumps and the cap applied.
    pub base_fee: u64,
    /// The aggressive (p95) base was used.
    pub aggressive: bool,
    /// The absolute cap was hit.
    pub capped: bool,
}

/// What the fee policy decided for one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeeDecision {
    /// Go ahead with this bid.
    Submit {
        /// The bid.
        bid: FeeBid,
        /// Expected seconds to confirmation at this bid.
        est_confirmation_seconds: u32,
    },
    /// Leave the op pending this much longer (LOW under congestion).
    Defer(std::time::Duration),
}

/// What a quote is asked about: one op's next attempt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuoteInput<'a> {
    /// The op's tier.
    pub priority: crate::op::Priority,
    /// Attempts in the current budget, counting the one being quoted.
    pub attempts: u32,
    /// Fee bumps so far.
    pub fee_bumps: u32,
    /// When the op was enqueued (ms since the epoch).
    pub enqueued_at_ms: i64,
    /// Now (ms since the epoch): policies have no clock of their own.
    pub now_ms: i64,
    /// The shared snapshot, if the oracle has stored one.
    pub snapshot: Option<&'a FeeSnapshot>,
    /// The policy's config, as JSON.
    pub config: &'a str,
}
