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
    /// Its newest envelope waited `bump_after_ledgers` ledgers valid and not
    /// included: the next attempt may fee-bump it. An attempt that only
    /// lost its answer (a timeout, a 504, a lease) resends, never bumps.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stuck: bool,
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
    /// The first ledger it may land in (absent in older receipts), so a
    /// history source can be asked whether it saw every ledger it could
    /// have landed in.
    #[serde(default)]
    pub first_ledger: Option<u32>,
    /// Fee bumps sent for it, oldest first: each wraps `envelope` at a
    /// higher bid, and any one of them, or the envelope itself, may be what
    /// lands (one sequence: at most one does).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bumps: Vec<Bump>,
    /// The host key of the channel account that is the transaction's
    /// source (its sequence was used), when it is not the kind's signer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_key: Option<String>,
    /// The host key that pays the fee through a fee bump around every
    /// envelope of this transaction (the pool's `fee_payer = "signer"`):
    /// the bare transaction is never sent, and later bumps are signed by
    /// the same payer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fee_key: Option<String>,
}

/// A fee-bump envelope around a receipt's transaction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bump {
    /// Its own (outer) hash, hex: the RPC knows a landed fee bump by it.
    pub hash: String,
    /// The signed fee-bump envelope, base64.
    pub envelope: String,
    /// The inclusion fee it bids per operation.
    pub inclusion_fee: u64,
    /// The network refused it (`ERROR`, e.g. a bid under replace-by-fee's
    /// tenfold): it can never land and is not sent again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub refused: bool,
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

    /// Every hash it may have landed under: the newest fee bump first (the
    /// likeliest), the inner transaction last.
    pub fn hashes(&self) -> impl Iterator<Item = &str> {
        self.bumps
            .iter()
            .rev()
            .map(|b| b.hash.as_str())
            .chain(std::iter::once(self.hash.as_str()))
    }

    /// What to send (again): the newest fee bump the network did not
    /// refuse, or the transaction; when someone else pays its fee, never
    /// the bare transaction (its source would pay), but the payer's first
    /// bump again.
    pub fn latest_envelope(&self) -> &str {
        let newest = self.bumps.iter().rev().find(|b| !b.refused);
        let paid_for = self.fee_key.as_ref().and_then(|_| self.bumps.first());
        newest
            .or(paid_for)
            .map_or(self.envelope.as_str(), |b| b.envelope.as_str())
    }

    /// The inclusion fee of what may be waiting in the network's queue: the
    /// newest envelope it did not refuse (the one [`Self::latest_envelope`]
    /// sends). A fee bump replaces it only at ten times this.
    pub fn queued_bid(&self) -> Option<u64> {
        match self.bumps.iter().rev().find(|b| !b.refused) {
            Some(bump) => Some(bump.inclusion_fee),
            None if self.fee_key.is_some() => self.bumps.first().map(|b| b.inclusion_fee),
            None => self.inclusion_fee,
        }
    }

    /// The highest inclusion fee bid for it so far (refused bumps too: a
    /// new bump must outbid them).
    pub fn bid(&self) -> Option<u64> {
        self.bumps.last().map(|b| b.inclusion_fee).or(self.inclusion_fee)
    }

    /// What the envelope that may land bids (what the attempt pays).
    pub fn paying(&self) -> Option<u64> {
        self.bumps
            .iter()
            .rev()
            .find(|b| !b.refused)
            .map(|b| b.inclusion_fee)
            .or(self.inclusion_fee)
    }

    /// The ledgers it could have landed in, inclusive, when known.
    pub fn landing_ledgers(&self) -> Option<(u32, u32)> {
        self.first_ledger
            .map(|first| (first, self.max_ledger.saturating_sub(1)))
    }

    /// Whether a chain tip proves the transaction can no longer land: the
    /// next ledger is past its ledger bound, or the tip closed after its
    /// time bound.
    pub fn expired_at(&self, ledger: u32, close_time: Option<u64>) -> bool {
        ledger.saturating_add(1) >= self.max_ledger || close_time.is_some_and(|t| t > self.max_time)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bump(hash: &str, fee: u64, refused: bool) -> Bump {
        Bump {
            hash: hash.to_owned(),
            envelope: format!("envelope-{hash}"),
            inclusion_fee: fee,
            refused,
        }
    }

    fn receipt(bumps: Vec<Bump>) -> Receipt {
        Receipt {
            hash: "inner".to_owned(),
            envelope: "envelope-inner".to_owned(),
            max_ledger: 110,
            max_time: 0,
            rejected: false,
            stuck: false,
            restore: false,
            sequence: 7,
            inclusion_fee: Some(100),
            first_ledger: Some(101),
            bumps,
            source_key: None,
            fee_key: None,
        }
    }

    #[test]
    fn a_fee_bumped_transaction_is_looked_up_under_every_hash_newest_first() {
        let r = receipt(vec![bump("b1", 200, true), bump("b2", 1000, false)]);
        assert_eq!(r.hashes().collect::<Vec<_>>(), ["b2", "b1", "inner"]);
        assert_eq!(r.latest_envelope(), "envelope-b2");
        assert_eq!((r.bid(), r.paying()), (Some(1000), Some(1000)));
    }

    #[test]
    fn a_transaction_paid_for_by_another_account_is_never_sent_bare() {
        let mut r = receipt(vec![bump("paid", 100, false)]);
        r.fee_key = Some("signer".to_owned());
        assert_eq!(r.latest_envelope(), "envelope-paid");
        r.bumps[0].refused = true;
        assert_eq!(
            r.latest_envelope(),
            "envelope-paid",
            "refused or not, the payer's bump is what is sent: the bare one would make its source pay"
        );
        r.bumps.push(bump("higher", 1000, false));
        assert_eq!(r.latest_envelope(), "envelope-higher");
        let parsed = Receipt::parse(&r.to_json()).expect("round trip");
        assert_eq!(parsed.fee_key.as_deref(), Some("signer"));
    }

    #[test]
    fn a_refused_bump_is_outbid_but_never_sent_again_nor_paid() {
        let r = receipt(vec![bump("b1", 1000, false), bump("b2", 2000, true)]);
        assert_eq!(r.latest_envelope(), "envelope-b1");
        assert_eq!(r.bid(), Some(2000), "the next bump must outbid the refused one");
        assert_eq!(r.paying(), Some(1000), "what may land is what is paid");
        let only_refused = receipt(vec![bump("b1", 200, true)]);
        assert_eq!(only_refused.latest_envelope(), "envelope-inner");
        assert_eq!(only_refused.paying(), Some(100));
    }

    #[test]
    fn an_older_receipt_reads_without_bumps_or_first_ledger() {
        let old = r#"{"hash":"h","envelope":"e","max_ledger":9,"max_time":1}"#;
        let r = Receipt::parse(old).expect("parses");
        assert!(r.bumps.is_empty() && r.first_ledger.is_none() && r.landing_ledgers().is_none());
        assert_eq!(r.hashes().collect::<Vec<_>>(), ["h"]);
        // And a receipt without bumps is written as before.
        assert!(!receipt(Vec::new()).to_json().contains("bumps"));
    }
}
