//! The receipt checkpointed before `sendTransaction`: enough to find the
//! transaction after a crash (its hash), to send the very same bytes again
//! (its envelope), and to know when it can no longer land (its bounds).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    /// Hex transaction hash.
    pub hash: String,
    /// The signed envelope, base64.
    pub envelope: String,
    /// It may land only in ledgers below this one.
    pub max_ledger: u32,
    /// Nor after this unix time.
    pub max_time: u64,
    /// The network rejected it (`ERROR`): it can never land.
    #[serde(default)]
    pub rejected: bool,
    /// A RestoreFootprint transaction, not the op's call: landing it does
    /// not settle the op.
    #[serde(default)]
    pub restore: bool,
    /// The transaction's sequence number.
    #[serde(default)]
    pub sequence: i64,
    /// The inclusion fee (stroops) the envelope bids, so an attempt that
    /// resends it records what it really pays (absent in older receipts).
    #[serde(default)]
    pub inclusion_fee: Option<u64>,
}

impl Receipt {
    pub fn parse(text: &str) -> Result<Self, String> {
        serde_json::from_str(text).map_err(|e| format!("unreadable receipt: {e}"))
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Whether the server still remembers every ledger the transaction
    /// could have landed in, so that NOT_FOUND proves it did not land.
    pub fn within_retention(&self, oldest: Option<u32>) -> bool {
        oldest.is_none_or(|oldest| oldest < self.max_ledger)
    }

    /// Whether a chain tip proves the transaction can no longer land: the
    /// next ledger is past its ledger bound, or the tip closed after its
    /// time bound.
    pub fn expired_at(&self, ledger: u32, close_time: Option<u64>) -> bool {
        ledger.saturating_add(1) >= self.max_ledger || close_time.is_some_and(|t| t > self.max_time)
    }
}
