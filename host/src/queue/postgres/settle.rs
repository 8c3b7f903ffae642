//! PostgreSQL's settle: a batch of settles as one array per column through
//! `unnest`, one statement whatever the batch's size (the updates, and the
//! attempt rows of those that applied).

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{sql, Conn};
use crate::op::truncate_error;
use crate::queue::policy::FinishParams;
use crate::queue::{Cas, Completion, QueueError};

/// Settles completions, one result per completion in order.
pub async fn settle(conn: &mut Conn, completions: &[Completion], now: DateTime<Utc>) -> Result<Vec<Cas>, QueueError> {
    if completions.is_empty() {
        return Ok(Vec::new());
    }
    let params: Vec<FinishParams> = completions.iter().map(|c| FinishParams::of(&c.finish)).collect();
    let column = |f: &dyn Fn(&Completion, &FinishParams) -> Option<String>| -> Vec<Option<String>> {
        completions.iter().zip(&params).map(|(c, p)| f(c, p)).collect()
    };
    let id: Vec<i64> = completions.iter().map(|c| c.lease.op_id).collect();
    let attempt: Vec<i32> = completions.iter().map(|c| c.lease.attempt).collect();
    let token: Vec<Uuid> = completions.iter().map(|c| c.lease.token).collect();
    // A settle is known by its op and lease token: a batch may hold a stale
    // settle of an op beside its current one.
    let applied: HashSet<(i64, Uuid)> = sqlx::query_as(sql::dispatch::SETTLE)
        .bind(&id)
        .bind(&attempt)
        .bind(&token)
        .bind(params.iter().map(|p| p.transition.from().as_str()).collect::<Vec<_>>())
        .bind(params.iter().map(|p| p.transition.to().as_str()).collect::<Vec<_>>())
        .bind(params.iter().map(|p| p.clear_receipt).collect::<Vec<_>>())
        .bind(column(&|_, p| p.receipt.clone()))
        .bind(column(&|_, p| p.error.clone()))
        .bind(params.iter().map(|p| p.next_attempt_at).collect::<Vec<_>>())
        .bind(params.iter().map(|p| p.fee_bump).collect::<Vec<_>>())
        .bind(
            params
                .iter()
                .map(|p| p.transition.to().is_terminal().then_some(now))
                .collect::<Vec<_>>(),
        )
        .bind(now)
        .bind(completions.iter().map(|c| c.attempt.started_at).collect::<Vec<_>>())
        .bind(completions.iter().map(|c| c.attempt.finished_at).collect::<Vec<_>>())
        .bind(completions.iter().map(|c| c.attempt.class.as_str()).collect::<Vec<_>>())
        .bind(completions.iter().map(|c| c.attempt.detail.clone()).collect::<Vec<_>>())
        .bind(completions.iter().map(|c| c.attempt.fee).collect::<Vec<_>>())
        .bind(
            completions
                .iter()
                .map(|c| c.attempt.error.as_deref().map(truncate_error))
                .collect::<Vec<_>>(),
        )
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .collect();
    Ok(completions
        .iter()
        .map(|c| {
            if applied.contains(&(c.lease.op_id, c.lease.token)) {
                Cas::Applied
            } else {
                Cas::Stale
            }
        })
        .collect())
}
