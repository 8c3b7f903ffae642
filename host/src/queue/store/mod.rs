//! The store: every queue operation's Rust, written once. This source is
//! compiled once per dialect (`sqlite/mod.rs` and `postgres/mod.rs` each
//! mount it with `#[path]`), against that dialect's `Db`, `Conn`, `Row`,
//! `sql` constants and `Conns` ([`Dialect`]); binding and decoding go
//! through [`codec`](crate::queue::codec), decisions through
//! [`policy`](crate::queue::policy). Nothing here names a database.

mod dispatch;
mod operator;
mod ops;
mod records;
mod retention;

use std::collections::HashMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::{sql, Conn, Conns, Row};
use crate::clock::Clock;
use crate::op::{AttemptClass, Op, OpId, Transition};
use crate::queue::codec::{get, Lanes, List, Rank, St, Token, Ts};
use crate::queue::dialect::Dialect;
use crate::queue::policy::now_ms;
use crate::queue::{ApiKey, BookRow, Limits, Occupant, QueueError, Record};

/// A statement with its binds so far.
pub(crate) type Query<'q> = sqlx::query::Query<'q, super::Db, <super::Db as sqlx::Database>::Arguments<'q>>;

/// A queue on one database.
#[derive(Debug, Clone)]
pub struct Store {
    /// The dialect's connections.
    pub(crate) conns: Conns,
    pub(crate) limits: Limits,
    pub(crate) clock: Arc<dyn Clock>,
}

impl Store {
    /// A store over open connections.
    pub(crate) fn new(conns: Conns, limits: Limits, clock: Arc<dyn Clock>) -> Self {
        Self { conns, limits, clock }
    }

    /// Now, cut to whole milliseconds so every backend stores the same instant.
    pub(crate) fn now(&self) -> DateTime<Utc> {
        now_ms(self.clock.as_ref())
    }

    /// Runs one statement in a write transaction of its own; the rows it
    /// changed.
    pub(crate) async fn write_one(&self, query: Query<'_>) -> Result<u64, QueueError> {
        let mut tx = self.conns.write().await?;
        let done = query.execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }
}

/// Opens a savepoint: a part of `conn`'s transaction that can fail alone.
pub(crate) async fn begin_savepoint(conn: &mut Conn) -> Result<(), QueueError> {
    sqlx::query(sql::dispatch::SAVEPOINT).execute(&mut *conn).await?;
    Ok(())
}

/// Ends the open savepoint, keeping its writes or undoing them. An error
/// here leaves the transaction unusable.
pub(crate) async fn end_savepoint(conn: &mut Conn, keep: bool) -> Result<(), QueueError> {
    if !keep {
        sqlx::query(sql::dispatch::ROLLBACK_TO_SAVEPOINT)
            .execute(&mut *conn)
            .await?;
    }
    sqlx::query(sql::dispatch::RELEASE_SAVEPOINT)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// An op read with the `op_columns` block.
pub(crate) fn op_from_row(row: &Row) -> Result<Op, QueueError> {
    let id: OpId = get(row, 0, "id")?;
    Ok(Op {
        id,
        outbox: get(row, id, "outbox")?,
        kind: get(row, id, "kind")?,
        priority: get::<Rank, _>(row, id, "priority")?.0,
        lanes: get::<Lanes, _>(row, id, "lanes")?.0,
        payload: get(row, id, "payload")?,
        payload_ref: get(row, id, "payload_ref")?,
        idempotency_key: get(row, id, "idempotency_key")?,
        coalesce_key: get(row, id, "coalesce_key")?,
        subject: get(row, id, "subject")?,
        correlation_id: get(row, id, "correlation_id")?,
        status: get::<St, _>(row, id, "status")?.0,
        attempts: get(row, id, "attempts")?,
        attempt_floor: get(row, id, "attempt_floor")?,
        fee_bumps: get(row, id, "fee_bumps")?,
        next_attempt_at: get::<Ts, _>(row, id, "next_attempt_at")?.0,
        lease_owner: get(row, id, "lease_owner")?,
        lease_token: get::<Option<Token>, _>(row, id, "lease_token")?.map(|t| t.0),
        lease_until: get::<Option<Ts>, _>(row, id, "lease_until")?.map(|t| t.0),
        receipt: get(row, id, "receipt")?,
        last_error: get(row, id, "last_error")?,
        created_at: get::<Ts, _>(row, id, "created_at")?.0,
        updated_at: get::<Ts, _>(row, id, "updated_at")?.0,
        finished_at: get::<Option<Ts>, _>(row, id, "finished_at")?.map(|t| t.0),
    })
}

/// Ops read with the `op_columns` block, their shared payloads filled in.
pub(crate) async fn ops_from_rows(conn: &mut Conn, rows: &[Row]) -> Result<Vec<Op>, QueueError> {
    let mut ops = rows.iter().map(op_from_row).collect::<Result<Vec<_>, _>>()?;
    resolve_payloads(conn, ops.iter_mut()).await?;
    Ok(ops)
}

/// A row read with the `book_columns` block.
pub(crate) fn book_row(row: &Row) -> Result<BookRow, QueueError> {
    let id: OpId = get(row, 0, "id")?;
    Ok(BookRow {
        id,
        kind: get(row, id, "kind")?,
        priority: get::<Rank, _>(row, id, "priority")?.0,
        lanes: get::<Lanes, _>(row, id, "lanes")?.0,
        in_flight: get::<St, _>(row, id, "status")?.0 == Transition::Claim.to(),
        in_doubt: get(row, id, "in_doubt")?,
        next_attempt_at: get::<Ts, _>(row, id, "next_attempt_at")?.0,
        budget_attempts: get(row, id, "budget_attempts")?,
        fee_bumps: get(row, id, "fee_bumps")?,
        created_at: get::<Ts, _>(row, id, "created_at")?.0,
        subject_halted: get(row, id, "subject_halted")?,
    })
}

/// A row read with the `occupant_columns` block.
pub(crate) fn occupant_from_row(row: &Row) -> Result<Occupant, QueueError> {
    let id: OpId = get(row, 0, "id")?;
    Ok(Occupant {
        id,
        outbox: get(row, id, "outbox")?,
        kind: get(row, id, "kind")?,
        priority: get::<Rank, _>(row, id, "priority")?.0,
        lanes: get::<Lanes, _>(row, id, "lanes")?.0,
        in_flight: get::<St, _>(row, id, "status")?.0 == Transition::Claim.to(),
        in_doubt: get(row, id, "in_doubt")?,
    })
}

/// An attempt's class as stored in `attempts.outcome`.
pub(crate) fn attempt_class(id: OpId, stored: String) -> Result<AttemptClass, QueueError> {
    AttemptClass::parse(&stored).ok_or(QueueError::Corrupt {
        id,
        column: "attempts.outcome",
        value: stored,
    })
}

pub(crate) fn record_from_row(row: &Row) -> Result<Record, QueueError> {
    Ok(Record {
        key: get(row, 0, "key")?,
        value: get(row, 0, "value")?,
        version: get(row, 0, "version")?,
        updated_at: get::<Ts, _>(row, 0, "updated_at")?.0,
    })
}

pub(crate) fn api_key_from_row(row: &Row) -> Result<ApiKey, QueueError> {
    let scopes: String = get(row, 0, "scopes")?;
    Ok(ApiKey {
        id: get(row, 0, "id")?,
        name: get(row, 0, "name")?,
        scopes: crate::queue::policy::scopes_from_column(&scopes),
        created_at: get::<Ts, _>(row, 0, "created_at")?.0,
        revoked_at: get::<Option<Ts>, _>(row, 0, "revoked_at")?.map(|t| t.0),
    })
}

/// Reads shared payloads (`payloads`) into the ops that point at them, so
/// every reader sees the payload as enqueued whichever way it is stored.
pub(crate) async fn resolve_payloads<'a>(
    conn: &mut Conn,
    ops: impl IntoIterator<Item = &'a mut Op>,
) -> Result<(), QueueError> {
    let mut wanting: Vec<&'a mut Op> = ops.into_iter().filter(|o| o.payload_ref.is_some()).collect();
    if wanting.is_empty() {
        return Ok(());
    }
    let mut hashes: Vec<String> = wanting.iter().filter_map(|o| o.payload_ref.clone()).collect();
    hashes.sort_unstable();
    hashes.dedup();
    let bodies: HashMap<String, String> = sqlx::query_as(sql::ops::PAYLOADS_BY_HASH)
        .bind(List(hashes))
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .collect();
    for op in &mut wanting {
        let hash = op.payload_ref.clone().unwrap_or_default();
        op.payload = bodies.get(&hash).cloned().ok_or(QueueError::Corrupt {
            id: op.id,
            column: "payload_ref",
            value: hash,
        })?;
    }
    Ok(())
}

/// A read connection from the dialect's read pool.
pub(crate) async fn reader(conns: &Conns) -> Result<sqlx::pool::PoolConnection<super::Db>, QueueError> {
    Ok(conns.read().acquire().await?)
}
