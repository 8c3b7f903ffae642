//! Ops: the schema, enqueue (the insert, its retries and the explanation of
//! a conflict), reads of ops, kind defaults and producers' wake-ups.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::QueryBuilder;

use super::{attempt_class, begin_savepoint, end_savepoint, ops_from_rows, reader, sql, Conn, Conns, Store};
use crate::op::{Attempt, AttemptRecord, Op, OpId, Status};
use crate::queue::codec::{get, Lanes, List, Rank, St, Ts};
use crate::queue::dialect::Dialect;
use crate::queue::policy::{check_versions, shared_payload, validate_new_ops};
use crate::queue::{
    Backend, Depth, Enqueued, KindRegistry, MinuteCount, NewOp, OpFilter, OpStore, QueueError, Subscription, RETRIED,
};

impl Store {
    /// Enqueues ops on the caller's connection, inside whatever transaction
    /// the caller has open: they commit or roll back with it.
    ///
    /// # Errors
    ///
    /// [`QueueError::InvalidOp`] (nothing written) or a database error.
    pub async fn enqueue_in(&self, conn: &mut Conn, ops: &[NewOp]) -> Result<Vec<Enqueued>, QueueError> {
        let checked = validate_new_ops(ops, self.limits)?;
        let now = self.now();
        // A fan-out's ops share one payload: it is hashed and written once
        // per batch, not once per recipient.
        let mut stored = SharedPayloads::default();
        let shared_from = self.limits.shared_payload_bytes;
        let mut results = Vec::with_capacity(checked.len());
        for chunk in checked.chunks(BATCH_MAX) {
            if chunk.len() >= BATCH_FROM {
                if let Some(created) = insert_batch(conn, chunk, now, shared_from, &mut stored).await? {
                    results.extend(created);
                    continue;
                }
            }
            for op in chunk {
                results.push(insert_one(conn, op, now, shared_from, &mut stored).await?);
            }
        }
        Ok(results)
    }
}

/// Batches at least this long are first tried as one statement (a fan-out:
/// 5,000 inserts one by one took 0.6-0.8 s on SQLite, most of it per
/// statement rather than per row).
const BATCH_FROM: usize = 4;

/// Ops per statement: a larger batch is inserted as several, in the same
/// transaction. One statement's rows travel as one JSON parameter, so this
/// bounds what it holds in memory (a fan-out to 100,000 inboxes was one
/// parameter of every row at once); past a few hundred rows a statement
/// costs no more per row.
const BATCH_MAX: usize = 1_000;

/// The shared payloads a batch has written, and the last one hashed: the
/// ops of a fan-out share one payload allocation, so it is hashed once.
#[derive(Default)]
struct SharedPayloads {
    stored: std::collections::HashSet<String>,
    last: Option<(std::sync::Arc<str>, Option<String>)>,
}

impl SharedPayloads {
    /// The hash a payload is shared under (`None`: stored in its row), and
    /// whether this batch has yet to write it. Marking it before the write
    /// is safe: a failed write fails the whole batch.
    fn share(&mut self, payload: &std::sync::Arc<str>, shared_from: usize) -> Option<(String, bool)> {
        let hash = match &self.last {
            Some((last, hash)) if std::sync::Arc::ptr_eq(last, payload) => hash.clone(),
            _ => {
                let hash = shared_payload(payload, shared_from);
                self.last = Some((payload.clone(), hash.clone()));
                hash
            }
        }?;
        let unwritten = self.stored.insert(hash.clone());
        Some((hash, unwritten))
    }
}

/// Writes an op's shared payload once per batch; the payload and reference
/// its row stores.
async fn store_payload<'a>(
    conn: &mut Conn,
    op: &'a NewOp,
    shared_from: usize,
    stored: &mut SharedPayloads,
) -> Result<(&'a str, Option<String>), QueueError> {
    match stored.share(&op.payload, shared_from) {
        Some((hash, unwritten)) => {
            if unwritten {
                sqlx::query(sql::ops::INSERT_PAYLOAD)
                    .bind(&hash)
                    .bind(&*op.payload)
                    .execute(&mut *conn)
                    .await?;
            }
            Ok(("null", Some(hash)))
        }
        None => Ok((&op.payload, None)),
    }
}

/// The batch inserted by one statement, inside a savepoint: every op
/// created, in order; or `None`, with nothing of the statement left, when
/// any op conflicted (an idempotency or coalesce key, a tombstone), for
/// [`insert_one`] to answer op by op.
async fn insert_batch(
    conn: &mut Conn,
    ops: &[NewOp],
    now: DateTime<Utc>,
    shared_from: usize,
    stored: &mut SharedPayloads,
) -> Result<Option<Vec<Enqueued>>, QueueError> {
    let mut rows = Vec::with_capacity(ops.len());
    for op in ops {
        let (payload, payload_ref) = store_payload(conn, op, shared_from, stored).await?;
        let due = op.not_before.map_or(now, |t| t.max(now));
        // A tuple is written as a JSON array, in the order `insert_ops`
        // reads its elements.
        rows.push((
            op.outbox.as_str(),
            op.kind.as_str(),
            op.priority.rank(),
            serde_json::to_string(&op.lanes).map_err(|e| QueueError::InvalidOp(e.to_string()))?,
            payload,
            op.idempotency_key.as_deref(),
            op.coalesce_key.as_deref(),
            op.subject.as_deref(),
            op.correlation_id.as_deref(),
            due.timestamp_micros(),
            payload_ref,
        ));
    }
    let rows = serde_json::to_string(&rows).map_err(|e| QueueError::InvalidOp(e.to_string()))?;
    begin_savepoint(conn).await?;
    let inserted: Result<Vec<i64>, sqlx::Error> = sqlx::query_scalar(sql::ops::INSERT_OPS)
        .bind(rows)
        .bind(Ts(now))
        .fetch_all(&mut *conn)
        .await;
    let mut ids = match inserted {
        Ok(ids) => {
            let all = ids.len() == ops.len();
            end_savepoint(conn, all).await?;
            if !all {
                return Ok(None);
            }
            ids
        }
        Err(e) => {
            // Best effort: the caller's transaction is left as it was before
            // the batch, and the statement's own error is the one reported.
            let _ = end_savepoint(conn, false).await;
            return Err(e.into());
        }
    };
    // Inserted in the batch's order, so their ids ascend in it (SQLite's
    // rowids, PostgreSQL's insert trigger): RETURNING's own order is not
    // promised.
    ids.sort_unstable();
    Ok(Some(ids.into_iter().map(Enqueued::Created).collect()))
}

async fn insert_one(
    conn: &mut Conn,
    op: &NewOp,
    now: DateTime<Utc>,
    shared_from: usize,
    stored: &mut SharedPayloads,
) -> Result<Enqueued, QueueError> {
    let due = op.not_before.map_or(now, |t| t.max(now));
    let (payload, payload_ref) = store_payload(conn, op, shared_from, stored).await?;
    // A conflicting op can reach a terminal state between the insert and the
    // look-up that explains the conflict; then the insert is simply retried.
    // An idempotency key's first conflict is retried at once: the op it
    // met may have committed while the insert waited for it, unseen by the
    // contract's check, which the second insert makes (a key reused for
    // another op is refused, not answered with that op).
    for round in 0..3 {
        let inserted: Option<i64> = sqlx::query_scalar(sql::ops::INSERT_OP)
            .bind(&op.outbox)
            .bind(&op.kind)
            .bind(Rank(op.priority))
            .bind(Lanes(op.lanes.clone()))
            .bind(payload)
            .bind(&op.idempotency_key)
            .bind(&op.coalesce_key)
            .bind(&op.subject)
            .bind(&op.correlation_id)
            .bind(Ts(due))
            .bind(Ts(now))
            .bind(&payload_ref)
            .fetch_optional(&mut *conn)
            .await?;
        if let Some(id) = inserted {
            return Ok(Enqueued::Created(id));
        }
        if round == 0 && op.idempotency_key.is_some() {
            continue;
        }
        if let Some(key) = &op.idempotency_key {
            for statement in [sql::ops::OP_BY_IDEMPOTENCY_KEY, sql::ops::TOMBSTONE_BY_IDEMPOTENCY_KEY] {
                // The second: its op was pruned, and the tombstone's trigger
                // skipped the insert.
                let existing: Option<i64> = sqlx::query_scalar(statement)
                    .bind(&op.outbox)
                    .bind(key)
                    .fetch_optional(&mut *conn)
                    .await?;
                if let Some(id) = existing {
                    return Ok(Enqueued::Existing(id));
                }
            }
        }
        if let Some(key) = &op.coalesce_key {
            let pending: Option<i64> = sqlx::query_scalar(sql::ops::LIVE_OP_BY_COALESCE_KEY)
                .bind(&op.outbox)
                .bind(key)
                .fetch_optional(&mut *conn)
                .await?;
            if let Some(id) = pending {
                return Ok(Enqueued::AlreadyPending(id));
            }
        }
    }
    Err(QueueError::Conflict {
        id: 0,
        message: "enqueue kept conflicting with concurrent changes; try again".to_owned(),
    })
}

#[async_trait]
impl OpStore for Store {
    fn backend(&self) -> Backend {
        Conns::BACKEND
    }

    async fn migrate(&self) -> Result<(), QueueError> {
        self.conns.migrate().await
    }

    async fn check_schema(&self) -> Result<(), QueueError> {
        let mut conn = reader(&self.conns).await?;
        let has_table: bool = sqlx::query_scalar(sql::schema::MIGRATIONS_TABLE_EXISTS)
            .fetch_one(&mut *conn)
            .await?;
        let applied: Vec<i64> = if has_table {
            sqlx::query_scalar(sql::schema::APPLIED_MIGRATIONS)
                .fetch_all(&mut *conn)
                .await?
        } else {
            Vec::new()
        };
        check_versions(&applied, &Conns::known_migrations())
    }

    async fn enqueue(&self, ops: &[NewOp]) -> Result<Vec<Enqueued>, QueueError> {
        let mut tx = self.conns.write().await?;
        // A producer's open transaction inserting the same idempotency key
        // holds it until it ends: answer busy after a bounded wait.
        self.conns.bound_lock_waits(&mut tx).await?;
        let results = self.enqueue_in(&mut tx, ops).await?;
        tx.commit().await?;
        Ok(results)
    }

    async fn get(&self, id: OpId) -> Result<Option<Op>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let row = sqlx::query(sql::ops::OP_BY_ID)
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
        Ok(ops_from_rows(&mut conn, row.as_slice()).await?.pop())
    }

    async fn redealt(&self, ids: &[OpId]) -> Result<Vec<OpId>, QueueError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = reader(&self.conns).await?;
        Ok(sqlx::query_scalar(sql::ops::REDEALT)
            .bind(List(ids.to_vec()))
            .fetch_all(&mut *conn)
            .await?)
    }

    async fn attempts(&self, id: OpId) -> Result<Vec<Attempt>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let rows = sqlx::query(sql::ops::ATTEMPTS_OF_OP)
            .bind(id)
            .fetch_all(&mut *conn)
            .await?;
        rows.iter()
            .map(|row| {
                let op_id: i64 = get(row, id, "op_id")?;
                Ok(Attempt {
                    op_id,
                    attempt: get(row, op_id, "attempt")?,
                    record: AttemptRecord {
                        started_at: get::<Ts, _>(row, op_id, "started_at")?.0,
                        finished_at: get::<Ts, _>(row, op_id, "finished_at")?.0,
                        class: attempt_class(op_id, get(row, op_id, "outcome")?)?,
                        detail: get(row, op_id, "detail")?,
                        fee: get(row, op_id, "fee")?,
                        error: get(row, op_id, "error")?,
                    },
                })
            })
            .collect()
    }

    async fn list(&self, filter: &OpFilter) -> Result<Vec<Op>, QueueError> {
        // Each filter is a plain column comparison, the same SQL on every
        // dialect; only the placeholders differ, and QueryBuilder writes them.
        let mut q = QueryBuilder::new(sql::ops::LIST_OPS);
        if let Some(status) = filter.status {
            q.push(" AND status = ").push_bind(St(status));
        }
        if let Some(kind) = &filter.kind {
            q.push(" AND kind = ").push_bind(kind.clone());
        }
        if let Some(priority) = filter.priority {
            q.push(" AND priority = ").push_bind(Rank(priority));
        }
        if let Some(subject) = &filter.subject {
            q.push(" AND subject = ").push_bind(subject.clone());
        }
        if let Some(outbox) = &filter.outbox {
            q.push(" AND outbox = ").push_bind(outbox.clone());
        }
        if let Some(lane) = &filter.lane {
            q.push(sql::ops::LIST_LANE_FILTER).push_bind(lane.clone()).push(")");
        }
        if let Some(correlation) = &filter.correlation_id {
            q.push(" AND correlation_id = ").push_bind(correlation.clone());
        }
        if let Some(t) = filter.created_after {
            q.push(" AND created_at >= ").push_bind(Ts(t));
        }
        if let Some(t) = filter.created_before {
            q.push(" AND created_at < ").push_bind(Ts(t));
        }
        if let Some(after) = filter.after_id {
            q.push(if filter.newest_first {
                " AND id < "
            } else {
                " AND id > "
            })
            .push_bind(after);
        }
        q.push(if filter.newest_first {
            " ORDER BY id DESC"
        } else {
            " ORDER BY id"
        });
        q.push(" LIMIT ").push_bind(i64::from(filter.limit));
        let mut conn = reader(&self.conns).await?;
        let rows = q.build().fetch_all(&mut *conn).await?;
        ops_from_rows(&mut conn, &rows).await
    }

    async fn depth(&self) -> Result<Vec<Depth>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let rows = sqlx::query(sql::ops::DEPTH).fetch_all(&mut *conn).await?;
        rows.iter()
            .map(|row| {
                Ok(Depth {
                    status: get::<St, _>(row, 0, "status")?.0,
                    priority: get::<Rank, _>(row, 0, "priority")?.0,
                    kind: get(row, 0, "kind")?,
                    count: get(row, 0, "n")?,
                })
            })
            .collect()
    }

    async fn recent_minutes(&self, since: DateTime<Utc>, max_rows: u32) -> Result<Vec<MinuteCount>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let outcomes = sqlx::query(sql::ops::RECENT_OUTCOMES_BY_MINUTE)
            .bind(Ts(since))
            .bind(i64::from(max_rows))
            .fetch_all(&mut *conn)
            .await?;
        let retries = sqlx::query(sql::ops::RECENT_RETRIES_BY_MINUTE)
            .bind(Ts(since))
            .bind(i64::from(max_rows))
            .fetch_all(&mut *conn)
            .await?;
        let mut minutes = Vec::with_capacity(outcomes.len() + retries.len());
        for row in &outcomes {
            minutes.push(MinuteCount {
                minute: get::<Ts, _>(row, 0, "minute")?.0,
                what: get::<St, _>(row, 0, "status")?.0.as_str().to_owned(),
                count: get(row, 0, "n")?,
                since: get::<Ts, _>(row, 0, "since")?.0,
            });
        }
        for row in &retries {
            minutes.push(MinuteCount {
                minute: get::<Ts, _>(row, 0, "minute")?.0,
                what: RETRIED.to_owned(),
                count: get(row, 0, "n")?,
                since: get::<Ts, _>(row, 0, "since")?.0,
            });
        }
        minutes.sort_by(|a, b| a.minute.cmp(&b.minute).then_with(|| a.what.cmp(&b.what)));
        Ok(minutes)
    }

    async fn subscribe(&self) -> Result<Option<Box<dyn Subscription>>, QueueError> {
        self.conns.subscribe().await
    }

    async fn register_kinds(&self, registry: &KindRegistry) -> Result<(), QueueError> {
        // Upserts, and a delete of only what is no longer listed: hosts
        // starting or reloading at the same moment each write the same rows
        // without colliding (a delete-then-insert let two concurrent inserts
        // of one kind fail on its primary key).
        let kinds: Vec<String> = registry.kinds.iter().map(|k| k.kind.clone()).collect();
        let mut tx = self.conns.write().await?;
        sqlx::query(sql::ops::LOCK_KIND_DEFAULTS).execute(&mut *tx).await?;
        sqlx::query(sql::ops::DELETE_UNLISTED_KIND_DEFAULTS)
            .bind(List(kinds))
            .execute(&mut *tx)
            .await?;
        for kind in &registry.kinds {
            sqlx::query(sql::ops::UPSERT_KIND_DEFAULT)
                .bind(&kind.kind)
                .bind(Rank(kind.priority))
                .bind(kind.lanes.as_str())
                .execute(&mut *tx)
                .await?;
        }
        let limit = registry.max_payload_bytes.map(|b| i64::try_from(b).unwrap_or(i64::MAX));
        let at = limit.map(|_| Ts(self.now()));
        sqlx::query(sql::ops::REGISTER_CONTRACT)
            .bind(limit)
            .bind(at)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn release_coalesce(&self, outbox: &str, idempotency_keys: &[String]) -> Result<u64, QueueError> {
        if idempotency_keys.is_empty() {
            return Ok(0);
        }
        self.write_one(
            sqlx::query(sql::ops::RELEASE_COALESCE)
                .bind(Ts(self.now()))
                .bind(outbox)
                .bind(St(Status::Pending))
                .bind(St(Status::Submitted))
                .bind(List(idempotency_keys.to_vec())),
        )
        .await
    }
}
