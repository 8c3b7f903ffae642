//! SQLite's settle: a batch of settles as one JSON parameter, so the cost
//! per settle is SQLite's, not a statement's; two statements whatever the
//! batch's size (the updates, then the attempt rows of those that applied).

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use serde_json::json;

use super::{sql, Conn};
use crate::op::{truncate_error, OpId};
use crate::queue::policy::FinishParams;
use crate::queue::{Cas, Completion, QueueError};

/// Settles completions, one result per completion in order.
pub async fn settle(conn: &mut Conn, completions: &[Completion], now: DateTime<Utc>) -> Result<Vec<Cas>, QueueError> {
    if completions.is_empty() {
        return Ok(Vec::new());
    }
    let ids: HashSet<OpId> = completions.iter().map(|c| c.lease.op_id).collect();
    if ids.len() < completions.len() {
        // One op twice (a stale settle beside the current one): settle one
        // at a time, so each is matched to its own lease (RETURNING names
        // the op, not the lease).
        let mut out = Vec::with_capacity(completions.len());
        for c in completions {
            out.extend(settle_distinct(conn, std::slice::from_ref(c), now).await?);
        }
        return Ok(out);
    }
    settle_distinct(conn, completions, now).await
}

async fn settle_distinct(
    conn: &mut Conn,
    completions: &[Completion],
    now: DateTime<Utc>,
) -> Result<Vec<Cas>, QueueError> {
    let ms = |t: DateTime<Utc>| t.timestamp_millis();
    let rows: Vec<serde_json::Value> = completions
        .iter()
        .map(|c| {
            let p = FinishParams::of(&c.finish);
            json!({
                "id": c.lease.op_id,
                "attempt": c.lease.attempt,
                "token": c.lease.token.to_string(),
                "from": p.transition.from().as_str(),
                "to": p.transition.to().as_str(),
                "clear": i32::from(p.clear_receipt),
                "receipt": p.receipt,
                "error": p.error,
                "next_at": p.next_attempt_at.map(ms),
                "bump": p.fee_bump,
                "finished_at": p.transition.to().is_terminal().then_some(ms(now)),
            })
        })
        .collect();
    let applied: HashSet<OpId> = sqlx::query_scalar(sql::dispatch::SETTLE)
        .bind(serde_json::Value::Array(rows).to_string())
        .bind(ms(now))
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .collect();
    let attempts: Vec<serde_json::Value> = completions
        .iter()
        .filter(|c| applied.contains(&c.lease.op_id))
        .map(|c| {
            let r = &c.attempt;
            json!({
                "op_id": c.lease.op_id,
                "attempt": c.lease.attempt,
                "started_at": ms(r.started_at),
                "finished_at": ms(r.finished_at),
                "outcome": r.class.as_str(),
                "detail": r.detail,
                "fee": r.fee,
                "error": r.error.as_deref().map(truncate_error),
            })
        })
        .collect();
    if !attempts.is_empty() {
        sqlx::query(sql::dispatch::RECORD_ATTEMPTS)
            .bind(serde_json::Value::Array(attempts).to_string())
            .execute(&mut *conn)
            .await?;
    }
    Ok(completions
        .iter()
        .map(|c| {
            if applied.contains(&c.lease.op_id) {
                Cas::Applied
            } else {
                Cas::Stale
            }
        })
        .collect())
}
