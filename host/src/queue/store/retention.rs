//! Retention and the outcome feed: which terminal ops a pruning pass may
//! delete, idempotency tombstones, the deletes in one transaction, and the
//! feed of terminal transitions with its cursor.

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::{op_from_row, ops_from_rows, reader, resolve_payloads, sql, Conns, Store};
use crate::op::{Op, OpId, Status};
use crate::queue::codec::{get, List, St, Ts};
use crate::queue::dialect::Dialect;
use crate::queue::policy::SIZED_TABLES;
use crate::queue::{OutcomeEntry, PruneQuery, QueueError, RetentionStore, Tombstone};

/// A cursor's (xid, seq), `(0, 0)` for the start.
fn position(cursor: Option<&str>) -> Result<(i64, i64), QueueError> {
    match cursor {
        None => Ok((0, 0)),
        Some(c) => Conns::parse_cursor(c).ok_or_else(|| QueueError::BadCursor(c.to_owned())),
    }
}

#[async_trait]
impl RetentionStore for Store {
    async fn outcomes(&self, after: Option<&str>, limit: u32) -> Result<Vec<OutcomeEntry>, QueueError> {
        let (xid, seq) = position(after)?;
        let mut conn = reader(&self.conns).await?;
        let rows = sqlx::query(sql::retention::OUTCOMES)
            .bind(xid.to_string())
            .bind(seq)
            .bind(i64::from(limit))
            .fetch_all(&mut *conn)
            .await?;
        let mut entries = rows
            .iter()
            .map(|r| {
                let op = op_from_row(r)?;
                Ok(OutcomeEntry {
                    cursor: Conns::cursor(get(r, op.id, "fxid")?, get(r, op.id, "seq")?),
                    status: get::<St, _>(r, op.id, "fstatus")?.0,
                    at: get::<Ts, _>(r, op.id, "fat")?.0,
                    op,
                })
            })
            .collect::<Result<Vec<_>, QueueError>>()?;
        resolve_payloads(&mut conn, entries.iter_mut().map(|e| &mut e.op)).await?;
        Ok(entries)
    }

    async fn prunable(&self, query: &PruneQuery) -> Result<Vec<Op>, QueueError> {
        let unrelayed = query.unrelayed_after.is_some();
        let (xid, seq) = position(query.unrelayed_after.as_ref().and_then(Option::as_deref))?;
        let mut conn = reader(&self.conns).await?;
        let rows = sqlx::query(sql::retention::PRUNABLE)
            .bind(St(query.status))
            .bind(Ts(query.finished_before))
            .bind(query.kind.as_deref())
            .bind(List(query.except_kinds.clone()))
            .bind(unrelayed)
            .bind(xid.to_string())
            .bind(seq)
            .bind(i64::from(query.limit))
            .fetch_all(&mut *conn)
            .await?;
        ops_from_rows(&mut conn, &rows).await
    }

    async fn put_tombstones(&self, tombstones: &[Tombstone]) -> Result<(), QueueError> {
        let mut tx = self.conns.write().await?;
        for t in tombstones {
            sqlx::query(sql::retention::INSERT_TOMBSTONE)
                .bind(&t.outbox)
                .bind(&t.idempotency_key)
                .bind(t.op_id)
                .bind(&t.kind)
                .bind(St(t.status))
                .bind(&t.receipt)
                .bind(Ts(t.finished_at))
                .bind(t.expires_at.map(Ts))
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn delete_terminal(&self, ids: &[OpId], status: Status) -> Result<Vec<OpId>, QueueError> {
        if !status.is_terminal() {
            return Err(QueueError::InvalidOp(format!("{status} is not a terminal status")));
        }
        let mut tx = self.conns.write().await?;
        let doomed: Vec<OpId> = sqlx::query_scalar(sql::retention::DOOMED_OPS)
            .bind(List(ids.to_vec()))
            .bind(St(status))
            .fetch_all(&mut *tx)
            .await?;
        let shared: Vec<String> = sqlx::query_scalar(sql::retention::SHARED_PAYLOADS_OF_OPS)
            .bind(List(doomed.clone()))
            .fetch_all(&mut *tx)
            .await?;
        for statement in [
            sql::retention::DELETE_ATTEMPTS_OF_OPS,
            sql::retention::DELETE_LANES_OF_OPS,
            sql::retention::DELETE_REDEALS_OF_OPS,
            sql::retention::DELETE_OUTCOMES_OF_OPS,
            sql::retention::DELETE_OPS,
        ] {
            sqlx::query(statement)
                .bind(List(doomed.clone()))
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query(sql::retention::DELETE_UNSHARED_PAYLOADS)
            .bind(List(shared))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(doomed)
    }

    async fn expire_tombstones(&self, now: DateTime<Utc>, limit: u32) -> Result<u64, QueueError> {
        self.write_one(
            sqlx::query(sql::retention::EXPIRE_TOMBSTONES)
                .bind(Ts(now))
                .bind(i64::from(limit)),
        )
        .await
    }

    async fn tombstone(&self, outbox: &str, idempotency_key: &str) -> Result<Option<Tombstone>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let row = sqlx::query(sql::retention::TOMBSTONE)
            .bind(outbox)
            .bind(idempotency_key)
            .fetch_optional(&mut *conn)
            .await?;
        row.map(|r| {
            let op_id: OpId = get(&r, 0, "op_id")?;
            Ok(Tombstone {
                outbox: get(&r, op_id, "outbox")?,
                idempotency_key: get(&r, op_id, "idempotency_key")?,
                op_id,
                kind: get(&r, op_id, "kind")?,
                status: get::<St, _>(&r, op_id, "status")?.0,
                receipt: get(&r, op_id, "receipt")?,
                finished_at: get::<Ts, _>(&r, op_id, "finished_at")?.0,
                expires_at: get::<Option<Ts>, _>(&r, op_id, "expires_at")?.map(|t| t.0),
            })
        })
        .transpose()
    }

    async fn table_rows(&self) -> Result<Vec<(String, i64)>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let row = sqlx::query(sql::retention::TABLE_ROWS).fetch_one(&mut *conn).await?;
        SIZED_TABLES
            .iter()
            .map(|table| Ok(((*table).to_owned(), get(&row, 0, table)?)))
            .collect()
    }
}
