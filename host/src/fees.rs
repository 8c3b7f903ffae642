//! Fee oracle values in laneway's own types: a network sample and the
//! snapshot every host shares through the database (as JSON).

use serde::{Deserialize, Serialize};

/// Network congestion, as the fee policy grades it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
