//! The queue's decisions, free of SQL and I/O: what an enqueue accepts, what
//! a settle writes, which claims the lane rule admits, why an operator change
//! was refused. The store calls them on every backend, so both reject the
//! same input in the same words.

use chrono::{DateTime, SubsecRound, Utc};

use std::collections::HashSet;
use std::sync::Arc;

use super::{Cas, Completion, ExpireTo, Finish, Limits, NewOp, Occupant, QueueError};
use crate::lanes::{self, Candidate, Caps, LaneRules, OpState};
use crate::op::{state, truncate_error, OpId, Priority, Status, Transition};

/// Longest outbox, kind, lane, key, subject or correlation id accepted.
const MAX_NAME_BYTES: usize = 2048;

/// Most lanes one op may name (checked before anything else is done with
/// them): an op orders itself behind a recipient, a signer, a subject; a
/// few dozen is generous.
pub const MAX_LANES_PER_OP: usize = 64;

/// Deepest nesting of arrays and objects a payload may have. No activity
/// or transfer nests near this; past it a payload is an attack on whatever
/// parses it next (SQLite's JSON functions stop at 1,000 levels, a
/// recursive parser in a plugin at its stack).
pub const MAX_PAYLOAD_DEPTH: usize = 128;

/// Checks an op before anything is written, and returns it with duplicate
/// lanes dropped (first occurrence kept).
///
/// # Errors
///
/// [`QueueError::InvalidOp`] naming the first problem found.
pub fn validate_new_op(op: &NewOp, limits: Limits) -> Result<NewOp, QueueError> {
    check_op(op, limits, true)
}

/// [`validate_new_op`] over a batch, all or nothing. Ops that share one
/// payload allocation (a fan-out's) have its JSON parsed once, not once per
/// recipient: what a fan-out costs grows with its recipients, not with
/// recipients times the activity's size.
///
/// # Errors
///
/// The first op's [`QueueError::InvalidOp`].
pub fn validate_new_ops(ops: &[NewOp], limits: Limits) -> Result<Vec<NewOp>, QueueError> {
    let mut parsed: Option<&Arc<str>> = None;
    let mut checked = Vec::with_capacity(ops.len());
    for op in ops {
        let fresh = !parsed.is_some_and(|p| Arc::ptr_eq(p, &op.payload));
        checked.push(check_op(op, limits, fresh)?);
        parsed = Some(&op.payload);
    }
    Ok(checked)
}

/// Every check of [`validate_new_op`]; the payload's JSON only when `parse`
/// (a payload shared with an op checked already is known to parse).
fn check_op(op: &NewOp, limits: Limits, parse: bool) -> Result<NewOp, QueueError> {
    let invalid = |msg: String| Err(QueueError::InvalidOp(msg));
    if op.lanes.len() > MAX_LANES_PER_OP {
        return invalid(format!(
            "an op may name at most {MAX_LANES_PER_OP} lanes, got {}",
            op.lanes.len()
        ));
    }
    for (field, value) in [("outbox", Some(&op.outbox)), ("kind", Some(&op.kind))]
        .into_iter()
        .chain([
            ("idempotency_key", op.idempotency_key.as_ref()),
            ("coalesce_key", op.coalesce_key.as_ref()),
            ("subject", op.subject.as_ref()),
            ("correlation_id", op.correlation_id.as_ref()),
        ])
    {
        if let Some(value) = value {
            if value.contains('\0') {
                return invalid(format!("{field} must not contain a NUL byte"));
            }
            if value.trim().is_empty() {
                return invalid(format!("{field} must not be empty"));
            }
            if value.len() > MAX_NAME_BYTES {
                return invalid(format!(
                    "{field} is {} bytes, over the {MAX_NAME_BYTES}-byte limit",
                    value.len()
                ));
            }
        }
    }
    if op.payload.len() > limits.max_payload_bytes {
        return invalid(format!(
            "payload is {} bytes, over the {}-byte limit",
            op.payload.len(),
            limits.max_payload_bytes
        ));
    }
    if parse {
        if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&op.payload) {
            return invalid(format!("payload is not valid JSON: {e}"));
        }
        if let Some(depth) = nesting_over(&op.payload, MAX_PAYLOAD_DEPTH) {
            return invalid(format!(
                "payload nests at least {depth} levels deep, over the {MAX_PAYLOAD_DEPTH}-level limit"
            ));
        }
    }
    let mut lanes: Vec<String> = Vec::with_capacity(op.lanes.len());
    let mut seen: HashSet<&str> = HashSet::with_capacity(op.lanes.len());
    for lane in &op.lanes {
        if lane.trim().is_empty() {
            return invalid("lane names must not be empty".to_owned());
        }
        if lane.contains('\0') {
            return invalid("lane names must not contain a NUL byte".to_owned());
        }
        if lane.len() > MAX_NAME_BYTES {
            return invalid(format!(
                "a lane is {} bytes, over the {MAX_NAME_BYTES}-byte limit",
                lane.len()
            ));
        }
        if seen.insert(lane.as_str()) {
            lanes.push(lane.clone());
        }
    }
    Ok(NewOp { lanes, ..op.clone() })
}

/// The depth at which valid JSON first goes past `limit` levels of arrays
/// and objects, if it does: one pass over the bytes, brackets inside
/// strings skipped, so a 100,000-deep payload costs what its size costs.
fn nesting_over(json: &str, limit: usize) -> Option<usize> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for b in json.bytes() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > limit {
                    return Some(depth);
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    None
}

/// Compares the migrations applied to a database with those this binary
/// carries.
///
/// # Errors
///
/// [`QueueError::SchemaTooNew`] when the database has a version this binary
/// does not know; [`QueueError::SchemaBehind`] when one it knows is missing.
pub fn check_versions(applied: &[i64], known: &[i64]) -> Result<(), QueueError> {
    let newest_known = known.iter().copied().max().unwrap_or(0);
    if let Some(found) = applied.iter().copied().filter(|v| !known.contains(v)).max() {
        return Err(QueueError::SchemaTooNew {
            found,
            known: newest_known,
        });
    }
    if let Some(missing) = known.iter().copied().filter(|v| !applied.contains(v)).min() {
        return Err(QueueError::SchemaBehind { missing });
    }
    Ok(())
}

/// Now, cut to whole milliseconds so both backends store the same instant.
pub fn now_ms(clock: &dyn crate::clock::Clock) -> DateTime<Utc> {
    clock.now().trunc_subsecs(3)
}

pub use crate::clock::chrono_duration;

/// What a [`Finish`] writes, the same on both backends.
pub struct FinishParams {
    /// The transition (its `from` is the expected status).
    pub transition: Transition,
    /// A receipt replacing the checkpointed one.
    pub receipt: Option<String>,
    /// Error text, truncated.
    pub error: Option<String>,
    /// The next attempt time (retries only).
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// 1 when the next attempt pays a bumped fee.
    pub fee_bump: i32,
    /// Clear the stored receipt: nothing is in doubt any more.
    pub clear_receipt: bool,
}

impl FinishParams {
    /// The parameters of one finish.
    pub fn of(finish: &Finish) -> Self {
        match finish {
            Finish::Confirm { receipt } => Self {
                transition: Transition::Confirm,
                receipt: receipt.clone(),
                error: None,
                next_attempt_at: None,
                fee_bump: 0,
                clear_receipt: false,
            },
            Finish::Retry {
                next_attempt_at,
                error,
                fee_bump,
                receipt_settled,
            } => Self {
                transition: Transition::Retry,
                receipt: None,
                error: Some(truncate_error(error)),
                next_attempt_at: Some(*next_attempt_at),
                fee_bump: i32::from(*fee_bump),
                clear_receipt: *receipt_settled,
            },
            // A dead letter keeps its receipt for the audit trail; it holds
            // nothing once terminal, and a force-retry brings the doubt back.
            Finish::Fail { error, .. } => Self {
                transition: Transition::Fail,
                receipt: None,
                error: Some(truncate_error(error)),
                next_attempt_at: None,
                fee_bump: 0,
                clear_receipt: false,
            },
        }
    }
}

/// Where an expired lease sends its op: the transition, when it is due
/// again, and whether its lanes are held.
pub fn expire_params(to: ExpireTo, now: DateTime<Utc>) -> (Transition, DateTime<Utc>, bool) {
    match to {
        ExpireTo::Retry(at) => (Transition::Expire, at, false),
        ExpireTo::DeadLetter { halt_lanes } => (Transition::Fail, now, halt_lanes),
    }
}

/// Which of the `picked` ops (pending, due, about to be claimed) their lanes
/// admit, given every op that occupies a lane anywhere: the lane scheduler
/// run over the picked ops as ready and the occupants as in flight or
/// holding. Ops with a lane in `contended` (another transaction is claiming
/// it right now) are left for the next round. The picked ops were admitted
/// by their drain's scheduler already; this is the same rule, checked again
/// where it cannot race.
pub fn admit_claims(
    picked: &[Occupant],
    occupants: &[Occupant],
    rules: &LaneRules,
    contended: &HashSet<String>,
) -> Vec<OpId> {
    let mut caps = Caps::default();
    let ready: Vec<Candidate> = picked
        .iter()
        .filter(|o| !o.lanes.iter().any(|l| contended.contains(l)))
        .map(|o| Candidate {
            state: OpState::Ready,
            ..o.candidate(rules, &mut caps)
        })
        .collect();
    let mine: HashSet<OpId> = picked.iter().map(|o| o.id).collect();
    let others: Vec<Candidate> = occupants
        .iter()
        .filter(|o| !mine.contains(&o.id))
        .map(|o| o.candidate(rules, &mut Caps::default()))
        .collect();
    lanes::schedule(&ready, &others, &caps)
}

/// The ids a claim may still take once the settles before it are known:
/// an id that follows an op whose settle did not apply (or was not in the
/// batch) is left out.
pub fn still_claimable(
    ids: &[OpId],
    follows: &[(OpId, OpId)],
    completions: &[Completion],
    settled: &[Cas],
) -> Vec<OpId> {
    if follows.is_empty() {
        return ids.to_vec();
    }
    let applied: HashSet<OpId> = completions
        .iter()
        .zip(settled)
        .filter(|(_, cas)| cas.applied())
        .map(|(c, _)| c.lease.op_id)
        .collect();
    let blocked: HashSet<OpId> = follows
        .iter()
        .filter(|(_, before)| !applied.contains(before))
        .map(|(op, _)| *op)
        .collect();
    ids.iter().copied().filter(|id| !blocked.contains(id)).collect()
}

/// The advisory-lock key of a lane (PostgreSQL): the first eight bytes of a
/// SHA-256 of its name, the same on every host and every build.
pub fn lane_lock_key(lane: &str) -> i64 {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(format!("laneway lane\0{lane}").as_bytes());
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(bytes)
}

/// Explains why an operator change matched no row, given the op's status
/// and whether it carries a receipt, as read afterwards (`None`: no such op).
pub fn refusal(id: OpId, found: Option<(Status, bool)>, transition: Transition) -> QueueError {
    let Some((status, in_doubt)) = found else {
        return QueueError::NotFound(id);
    };
    if transition == Transition::Cancel && in_doubt && status == Status::Pending {
        return QueueError::InDoubt(id);
    }
    match state::apply(status, transition) {
        Err(source) => QueueError::Illegal { id, source },
        // The status allowed it, so another writer changed the row between
        // the update and this read.
        Ok(_) => QueueError::Conflict {
            id,
            message: "the op changed concurrently; try again".to_owned(),
        },
    }
}

/// How a scan orders the book it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanOrder {
    /// Dispatch order: priority, then id.
    Dispatch,
    /// Enqueue order (id): the ops enqueued since a position.
    Enqueue,
}

/// A scan of an outbox's non-terminal ops from `from` on: one index range
/// per tier (the dialect's `scan_tier` with `{rank}` and `{after}` filled
/// in), the starting tier after `$2` and the later ones from the start, so
/// a read starts where the last one stopped instead of walking what it read
/// already. Binds: `$1` outbox, `$2` the id to start after, `$3` the limit.
pub fn scan_sql(tier: &str, from: Priority, order: ScanOrder) -> String {
    let tiers: Vec<String> = Priority::ALL
        .iter()
        .filter(|p| order == ScanOrder::Enqueue || p.rank() >= from.rank())
        .map(|p| {
            let after = if order == ScanOrder::Enqueue || *p == from {
                "$2"
            } else {
                "0"
            };
            tier.replace("{rank}", &p.rank().to_string()).replace("{after}", after)
        })
        .collect();
    let by = match order {
        ScanOrder::Dispatch => "priority, id",
        ScanOrder::Enqueue => "id",
    };
    format!("{} ORDER BY {by} LIMIT $3", tiers.join(" UNION ALL "))
}

/// A host share from the counts a heartbeat read.
pub fn host_share(hosts: i64, slots: i64, mine: i64) -> super::HostShare {
    let count = |n: i64| usize::try_from(n).unwrap_or(0);
    super::HostShare {
        hosts: count(hosts),
        slots: count(slots),
        mine: count(mine),
    }
}

/// A compare-and-set's result from the rows it changed.
pub fn cas(rows: u64) -> Cas {
    if rows == 1 {
        Cas::Applied
    } else {
        Cas::Stale
    }
}

/// The tables whose size retention bounds, counted by `RetentionStore::table_rows`
/// (the columns of the `table_rows` statement).
pub const SIZED_TABLES: [&str; 6] = [
    "ops",
    "attempts",
    "op_lanes",
    "outcomes",
    "idempotency_tombstones",
    "payloads",
];

/// The `payloads` key a payload is stored under when it is long enough to
/// be shared (`shared_from` bytes, 0 never): its SHA-256, hex.
pub fn shared_payload(payload: &str, shared_from: usize) -> Option<String> {
    use sha2::Digest as _;
    if shared_from == 0 || payload.len() < shared_from {
        return None;
    }
    let digest = sha2::Sha256::digest(payload.as_bytes());
    Some(digest.iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether an error is a unique-constraint violation.
pub fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.is_unique_violation())
}

/// What a second key of the same name gets.
pub fn api_key_name_taken(name: &str) -> QueueError {
    QueueError::KeyNameTaken(name.to_owned())
}

/// Scopes as stored: one space-separated column.
pub fn scopes_column(scopes: &[String]) -> String {
    scopes.join(" ")
}

/// Scopes as read back.
pub fn scopes_from_column(column: &str) -> Vec<String> {
    column.split_whitespace().map(str::to_owned).collect()
}

/// An audit entry's before/after as stored (JSON text).
pub fn json_column(value: Option<&serde_json::Value>) -> Option<String> {
    value.map(serde_json::Value::to_string)
}

/// An audit entry's before/after as read back.
pub fn json_from_column(
    id: i64,
    column: &'static str,
    text: Option<String>,
) -> Result<Option<serde_json::Value>, QueueError> {
    text.map(|t| serde_json::from_str(&t).map_err(|_| QueueError::Corrupt { id, column, value: t }))
        .transpose()
}

/// A pause's stored scope.
pub fn pause_scope(column: &str) -> Result<super::PauseScope, QueueError> {
    super::PauseScope::parse(column).ok_or_else(|| QueueError::Corrupt {
        id: 0,
        column: "pauses.scope",
        value: column.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(payload: &str) -> NewOp {
        NewOp::new("actor", "activitypub", payload)
    }

    #[test]
    fn a_payload_nested_past_the_limit_is_refused_whatever_its_depth() {
        let nested = |depth: usize| format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        let limits = Limits {
            max_payload_bytes: 1 << 20,
            ..Limits::default()
        };
        assert!(validate_new_op(&op(&nested(MAX_PAYLOAD_DEPTH)), limits).is_ok());
        for depth in [MAX_PAYLOAD_DEPTH + 1, 5_000, 100_000] {
            let err = validate_new_op(&op(&nested(depth)), limits).unwrap_err().to_string();
            assert!(err.contains("128-level limit"), "{depth}: {err}");
        }
        // Brackets inside strings (escaped quotes too) are not nesting.
        let text = format!(r#"{{"a":"{}\"{}","b":[[1]]}}"#, "[".repeat(500), "{".repeat(500));
        assert!(validate_new_op(&op(&text), limits).is_ok(), "{text}");
        let deep_objects = format!("{}1{}", r#"{"a":"#.repeat(200), "}".repeat(200));
        assert!(validate_new_op(&op(&deep_objects), limits).is_err());
    }

    #[test]
    fn valid_op_keeps_first_occurrence_of_each_lane() {
        let mut o = op(r#"{"a":1}"#);
        o.lanes = vec!["b".into(), "a".into(), "b".into()];
        let checked = validate_new_op(&o, Limits::default()).expect("valid");
        assert_eq!(checked.lanes, vec!["b".to_owned(), "a".to_owned()]);
    }

    #[test]
    fn malformed_json_is_rejected_with_the_parser_message() {
        let err = validate_new_op(&op("{nope"), Limits::default()).unwrap_err();
        assert!(
            err.to_string().starts_with("invalid op: payload is not valid JSON"),
            "{err}"
        );
    }

    #[test]
    fn payload_over_the_limit_is_rejected_before_parsing() {
        let limits = Limits {
            max_payload_bytes: 8,
            ..Limits::default()
        };
        let err = validate_new_op(&op(r#"{"long":"value"}"#), limits).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid op: payload is 16 bytes, over the 8-byte limit"
        );
    }

    #[test]
    fn a_batch_checks_every_payload_it_does_not_share() {
        let shared: Arc<str> = r#"{"type":"Create"}"#.into();
        let mut ops: Vec<NewOp> = (0..3)
            .map(|i| {
                let mut o = NewOp::new("actor", "activitypub", shared.clone());
                o.lanes = vec![format!("https://s{i}.example/inbox")];
                o
            })
            .collect();
        let checked = validate_new_ops(&ops, Limits::default()).expect("one shared, valid payload");
        assert_eq!(checked.len(), 3);
        assert!(checked.iter().all(|o| Arc::ptr_eq(&o.payload, &shared)));
        // Equal text in another allocation is not known to parse: a batch of
        // separate ops (the API's batch enqueue) is checked op by op.
        ops.push(op("{nope"));
        ops.push(NewOp::new("actor", "activitypub", shared.clone()));
        let err = validate_new_ops(&ops, Limits::default()).unwrap_err();
        assert!(err.to_string().contains("not valid JSON"), "{err}");
        // The size limit and the names are still checked for every op.
        let tight = Limits {
            max_payload_bytes: 4,
            ..Limits::default()
        };
        assert!(validate_new_ops(&ops[..1], tight).is_err());
        ops[1] = NewOp::new("actor", "activitypub", shared.clone());
        ops[1].lanes = vec![String::new()];
        assert!(validate_new_ops(&ops[..2], Limits::default()).is_err());
    }

    #[test]
    fn empty_names_are_rejected() {
        let mut o = op("{}");
        o.outbox = " ".into();
        assert!(validate_new_op(&o, Limits::default()).is_err());
        let mut o = op("{}");
        o.lanes = vec![String::new()];
        assert!(validate_new_op(&o, Limits::default()).is_err());
        let mut o = op("{}");
        o.idempotency_key = Some(String::new());
        assert!(validate_new_op(&o, Limits::default()).is_err());
    }

    #[test]
    fn schema_versions_are_compared_both_ways() {
        assert!(check_versions(&[1, 2], &[1, 2]).is_ok());
        assert!(matches!(
            check_versions(&[1], &[1, 2]),
            Err(QueueError::SchemaBehind { missing: 2 })
        ));
        assert!(matches!(
            check_versions(&[1, 2, 3], &[1, 2]),
            Err(QueueError::SchemaTooNew { found: 3, known: 2 })
        ));
        assert!(matches!(
            check_versions(&[], &[1]),
            Err(QueueError::SchemaBehind { missing: 1 })
        ));
    }
}
