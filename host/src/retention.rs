//! The retention policy: for each kind, how long each terminal status is
//! kept, how long a pruned op's idempotency key lives on as a tombstone,
//! and where the op is archived first. Pure: the pruner asks it which
//! passes to run now and what each pruned op's tombstone should say.

use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::config::Config;
use crate::op::{Op, Status};
use crate::queue::{PruneQuery, Tombstone};

/// How long something is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Never deleted.
    Forever,
    /// Deleted this long after the op finished.
    For(Duration),
}

impl Keep {
    /// From a config value in milliseconds, where 0 is forever.
    pub fn from_ms(ms: u64) -> Self {
        if ms == 0 {
            Keep::Forever
        } else {
            Keep::For(Duration::from_millis(ms))
        }
    }
}

/// One pruning pass: which ops, and what to do with each before deleting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pass {
    /// The ops it may delete.
    pub query: PruneQuery,
    /// How long their idempotency keys answer `existing`.
    pub tombstones: Keep,
    /// Where they are archived first, if anywhere.
    pub archive: Option<PathBuf>,
}

const TERMINAL: [Status; 3] = [Status::Confirmed, Status::Cancelled, Status::Failed];

/// Every pass due at `now`: per configured kind and terminal status, and
/// one per status for the kinds the config does not name (ops of a kind
/// removed from the config, say) under `[retention]`. Statuses kept
/// forever have no pass. For kinds with an outcome webhook, ops whose
/// outcome is past `relay_cursor` (the webhook relay's place in the feed)
/// are kept until the relay has sent it.
pub fn passes(config: &Config, now: DateTime<Utc>, batch: u32, relay_cursor: Option<String>) -> Vec<Pass> {
    let r = &config.retention;
    let global = |status: Status| match status {
        Status::Confirmed => r.confirmed_ms,
        Status::Cancelled => r.cancelled_ms,
        _ => r.failed_ms,
    };
    let pass = |kind: Option<String>, keep: Keep, status: Status, tombstones: Keep, archive: Option<PathBuf>| {
        let Keep::For(age) = keep else {
            return None;
        };
        Some(Pass {
            query: PruneQuery {
                except_kinds: if kind.is_none() {
                    config.kinds.keys().cloned().collect()
                } else {
                    Vec::new()
                },
                kind,
                status,
                finished_before: now - crate::clock::chrono_duration(age),
                limit: batch,
                unrelayed_after: None,
            },
            tombstones,
            archive,
        })
    };
    let mut out = Vec::new();
    for (name, kind) in &config.kinds {
        for status in TERMINAL {
            let own = match status {
                Status::Confirmed => kind.retention_confirmed_ms,
                Status::Cancelled => kind.retention_cancelled_ms,
                _ => kind.retention_failed_ms,
            };
            let keep = Keep::from_ms(own.unwrap_or_else(|| global(status)));
            let tombstones = Keep::from_ms(kind.idempotency_retention_ms.unwrap_or(r.idempotency_ms));
            if let Some(mut p) = pass(
                Some(name.clone()),
                keep,
                status,
                tombstones,
                kind.archive.as_ref().map(PathBuf::from),
            ) {
                if kind.outcome_webhook.is_some() {
                    p.query.unrelayed_after = Some(relay_cursor.clone());
                }
                out.push(p);
            }
        }
    }
    for status in TERMINAL {
        out.extend(pass(
            None,
            Keep::from_ms(global(status)),
            status,
            Keep::from_ms(r.idempotency_ms),
            None,
        ));
    }
    out
}

/// The tombstone a pruned op leaves, if it has an idempotency key whose
/// keeping has not already run out by `now`.
pub fn tombstone(op: &Op, keep: Keep, now: DateTime<Utc>) -> Option<Tombstone> {
    let key = op.idempotency_key.clone()?;
    let finished_at = op.finished_at.unwrap_or(op.updated_at);
    let expires_at = match keep {
        Keep::Forever => None,
        Keep::For(d) => {
            let at = finished_at + crate::clock::chrono_duration(d);
            if at <= now {
                return None;
            }
            Some(at)
        }
    };
    Some(Tombstone {
        outbox: op.outbox.clone(),
        idempotency_key: key,
        op_id: op.id,
        kind: op.kind.clone(),
        status: op.status,
        receipt: op.receipt.clone(),
        finished_at,
        expires_at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Config {
        crate::config::from_layers(&["[kinds.note]\nlanes = \"optional\"\n", extra]).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn each_kind_gets_its_own_passes_and_the_rest_share_the_defaults() {
        let c =
            config("[retention]\nconfirmed_ms = 60000\ncancelled_ms = 0\n[kinds.note]\nretention_failed_ms = 120000\n");
        let now = DateTime::<Utc>::UNIX_EPOCH + chrono::Duration::days(100);
        let passes = passes(&c, now, 10, None);
        let note: Vec<&Pass> = passes
            .iter()
            .filter(|p| p.query.kind.as_deref() == Some("note"))
            .collect();
        assert_eq!(note.len(), 2, "cancelled is kept forever: {note:?}");
        let failed = note
            .iter()
            .find(|p| p.query.status == Status::Failed)
            .unwrap_or_else(|| panic!("a failed pass"));
        assert_eq!(failed.query.finished_before, now - chrono::Duration::seconds(120));
        let rest: Vec<&Pass> = passes.iter().filter(|p| p.query.kind.is_none()).collect();
        assert!(rest.iter().all(|p| p.query.except_kinds.contains(&"note".to_owned())));
        assert!(rest.iter().all(|p| p.query.status != Status::Cancelled));
        // The shipped defaults archive the money kinds and keep their keys.
        let deposit = passes
            .iter()
            .find(|p| p.query.kind.as_deref() == Some("deposit"))
            .unwrap_or_else(|| panic!("a deposit pass"));
        assert_eq!(deposit.tombstones, Keep::Forever);
        assert!(deposit.archive.is_some());
        let ap = passes
            .iter()
            .find(|p| p.query.kind.as_deref() == Some("activitypub"))
            .unwrap_or_else(|| panic!("an activitypub pass"));
        assert_eq!(ap.tombstones, Keep::For(Duration::from_millis(2_592_000_000)));
        assert!(ap.archive.is_none());
        assert_eq!(ap.query.unrelayed_after, None, "no webhook, nothing to wait for");
    }

    #[test]
    fn a_kind_with_a_webhook_keeps_what_the_relay_has_not_sent() {
        let c = config(
            "[keys.h]\nalgorithm = \"hmac-sha256\"\nenv = \"H\"\n[outcomes]\nallowed_hosts = [\"https://h.example\"]\n\
             [kinds.note]\noutcome_webhook = \"https://h.example/x\"\noutcome_webhook_key = \"h\"\n",
        );
        let now = DateTime::<Utc>::UNIX_EPOCH + chrono::Duration::days(100);
        for (cursor, want) in [(None, Some(None)), (Some("7".to_owned()), Some(Some("7".to_owned())))] {
            let passes = passes(&c, now, 10, cursor);
            let note: Vec<&Pass> = passes
                .iter()
                .filter(|p| p.query.kind.as_deref() == Some("note"))
                .collect();
            assert!(!note.is_empty());
            assert!(note.iter().all(|p| p.query.unrelayed_after == want), "{note:?}");
        }
    }
}
