//! The PostgreSQL backend: how laneway scales past one machine.
//!
//! Several hosts share one database. A claim locks candidate rows with
//! `FOR UPDATE SKIP LOCKED` only for the claiming statement and commits them
//! as `submitted` with a lease; no transaction stays open while an op is
//! delivered. An insert trigger fills `op_lanes` and sends
//! `NOTIFY laneway_ops, '<outbox>'`, so producers that insert with plain SQL
//! wake the hosts too.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::{Postgres, QueryBuilder, Row, Transaction};
use uuid::Uuid;

use super::common::{
    admit_claims, cas, check_versions, chrono_duration, due_outboxes_sql, expire_params, host_share,
    is_unique_violation, lane_lock_key, now_ms, parse_priority, parse_status, refusal, scan_from_sql, still_claimable,
    unsent_guard, validate_new_op, FinishParams, BOOK_COLUMNS,
};
use super::common::{
    api_key_name_taken, json_column, json_from_column, pause_scope, scopes_column, scopes_from_column, shared_payload,
};
use super::DatabaseConfig;
use super::{
    new_token, Backend, BookRow, CandidateOp, Cas, ClaimRequest, Claimed, Completion, Depth, Enqueued, ExpireTo,
    HaltedSubject, HostShare, LaneHalt, LeaseSpec, Limits, NewOp, Occupant, OpFilter, Queue, QueueError, SlotLease,
    Subscription,
};
use super::{
    ApiKey, AuditEntry, Latency, NewApiKey, NewAuditEntry, OldestDue, OutcomeEntry, Pause, PauseScope, PruneQuery,
    QueueGauges, Tombstone,
};
use super::{Expect, Record};
use crate::clock::Clock;
use crate::lanes::LaneRules;
use crate::op::Status;
use crate::op::{truncate_error, Attempt, AttemptClass, AttemptRecord, Lease, Op, OpId, Priority, Transition};

static MIGRATOR: Migrator = sqlx::migrate!("../migrations/postgres");

/// The channel the insert trigger notifies, with the outbox as payload.
pub const NOTIFY_CHANNEL: &str = "laneway_ops";

const OP_COLUMNS: &str = "ops.id, ops.outbox, ops.kind, ops.priority, ops.lanes, ops.payload::text AS payload, \
     ops.idempotency_key, ops.coalesce_key, ops.subject, ops.correlation_id, ops.status, ops.attempts, \
     ops.attempt_floor, ops.fee_bumps, ops.next_attempt_at, ops.lease_owner, ops.lease_token, ops.lease_until, \
     ops.receipt, ops.last_error, ops.created_at, ops.updated_at, ops.finished_at, ops.payload_ref";

/// What the lane guard reads of an op.
const OCCUPANT_COLUMNS: &str =
    "id, outbox, kind, priority, lanes, status = 'submitted' AS in_flight, receipt IS NOT NULL AS in_doubt";

/// Ops that occupy their lanes (the `ops_occupying` partial index).
const OCCUPYING: &str = "(status = 'submitted' OR (status = 'pending' AND receipt IS NOT NULL))";

/// The PostgreSQL queue.
#[derive(Debug, Clone)]
pub struct PgQueue {
    pool: PgPool,
    limits: Limits,
    clock: Arc<dyn Clock>,
}

impl PgQueue {
    /// Connects to the database named by `config.url`.
    ///
    /// # Errors
    ///
    /// [`QueueError::Unreachable`] when no connection can be made.
    pub async fn open(config: &DatabaseConfig, limits: Limits, clock: Arc<dyn Clock>) -> Result<Self, QueueError> {
        let unreachable = |source| QueueError::Unreachable {
            url: super::redact_url(&config.url),
            source,
        };
        let options = PgConnectOptions::from_str(&config.url).map_err(unreachable)?;
        Self::open_with(options, config, limits, clock).await
    }

    /// Connects with explicit options (a search path, say) and the pool
    /// settings from `config`.
    ///
    /// # Errors
    ///
    /// [`QueueError::Unreachable`] when no connection can be made.
    pub async fn open_with(
        options: PgConnectOptions,
        config: &DatabaseConfig,
        limits: Limits,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, QueueError> {
        let unreachable = |source| QueueError::Unreachable {
            url: super::redact_url(&config.url),
            source,
        };
        let pool = PgPoolOptions::new()
            .max_connections(config.max_connections)
            .acquire_timeout(Duration::from_millis(config.connect_timeout_ms))
            .connect_with(options)
            .await
            .map_err(unreachable)?;
        Ok(Self { pool, limits, clock })
    }

    /// The pool, for callers' own tables and for `LISTEN`.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Begins a transaction for enqueueing together with the caller's rows.
    ///
    /// # Errors
    ///
    /// A database error.
    pub async fn begin(&self) -> Result<Transaction<'static, Postgres>, QueueError> {
        Ok(self.pool.begin().await?)
    }

    /// Enqueues ops on the caller's connection, inside whatever transaction
    /// the caller has open: they commit or roll back with it.
    ///
    /// # Errors
    ///
    /// [`QueueError::InvalidOp`] (nothing written) or a database error.
    pub async fn enqueue_in(&self, conn: &mut PgConnection, ops: &[NewOp]) -> Result<Vec<Enqueued>, QueueError> {
        let checked = ops
            .iter()
            .map(|op| validate_new_op(op, self.limits))
            .collect::<Result<Vec<_>, _>>()?;
        let now = now_ms(self.clock.as_ref());
        let mut results = Vec::with_capacity(checked.len());
        for op in &checked {
            results.push(insert_one(conn, op, now, self.limits.shared_payload_bytes).await?);
        }
        Ok(results)
    }

    fn now(&self) -> DateTime<Utc> {
        now_ms(self.clock.as_ref())
    }

    async fn claim_where(
        &self,
        lease: &LeaseSpec,
        filter: impl FnOnce(&mut QueryBuilder<'_, Postgres>, DateTime<Utc>),
    ) -> Result<Vec<Claimed>, QueueError> {
        let now = self.now();
        let token = new_token();
        let until = now + chrono_duration(lease.duration);
        let mut q = QueryBuilder::<Postgres>::new("WITH picked AS (");
        filter(&mut q, now);
        q.push(" FOR UPDATE SKIP LOCKED) UPDATE ops SET status = ")
            .push_bind(Transition::Claim.to().as_str())
            .push(", attempts = ops.attempts + 1, lease_owner = ")
            .push_bind(lease.owner.clone())
            .push(", lease_token = ")
            .push_bind(token)
            .push(", lease_until = ")
            .push_bind(until)
            .push(", updated_at = ")
            .push_bind(now)
            // Re-checked here too, so the claim stays a compare-and-set even if
            // the picking query is ever changed to not lock.
            .push(" FROM picked WHERE ops.id = picked.id AND ops.status = 'pending' RETURNING ")
            .push(OP_COLUMNS);
        let rows = q.build().fetch_all(&self.pool).await?;
        let mut claimed = claimed_from_rows(&rows, token)?;
        resolve_payloads(&self.pool, claimed.iter_mut().map(|c| &mut c.op)).await?;
        Ok(claimed)
    }

    /// Claims those of `ids` that are still pending and due and whose lanes
    /// admit them (the lane rule against every occupant), inside `tx`.
    async fn claim_ids_in(
        &self,
        tx: &mut PgConnection,
        ids: &[OpId],
        lease: &LeaseSpec,
        rules: &LaneRules,
    ) -> Result<Vec<Claimed>, QueueError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        // The rows first (another claimer's are skipped, never waited for),
        // then each of their lanes' advisory lock, tried without waiting: a
        // lane another transaction is claiming on right now is left for the
        // next round. Nothing here waits, so nothing can deadlock; and once
        // a lane's lock is held, the occupants read below (a new snapshot)
        // include every claim on it that committed before.
        let picked = sqlx::query(&format!(
            "SELECT {OCCUPANT_COLUMNS} FROM ops WHERE id = ANY($1) AND status = 'pending' AND next_attempt_at <= $2 \
             FOR UPDATE SKIP LOCKED"
        ))
        .bind(ids)
        .bind(self.now())
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(occupant_from_row)
        .collect::<Result<Vec<_>, _>>()?;
        let lanes: Vec<String> = picked
            .iter()
            .flat_map(|o| &o.lanes)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .cloned()
            .collect();
        let keys: Vec<i64> = lanes.iter().map(|l| lane_lock_key(l)).collect();
        let refused: std::collections::HashSet<i64> =
            sqlx::query_scalar("SELECT k FROM unnest($1::bigint[]) AS k WHERE NOT pg_try_advisory_xact_lock(k)")
                .bind(&keys)
                .fetch_all(&mut *tx)
                .await?
                .into_iter()
                .collect();
        let contended: std::collections::HashSet<String> = lanes
            .iter()
            .filter(|l| refused.contains(&lane_lock_key(l)))
            .cloned()
            .collect();
        let occupants = occupants_in(&mut *tx, &lanes).await?;
        let admitted = admit_claims(&picked, &occupants, rules, &contended);
        if admitted.is_empty() {
            return Ok(Vec::new());
        }
        let now = self.now();
        let token = new_token();
        let rows = sqlx::query(&format!(
            "UPDATE ops SET status = 'submitted', attempts = ops.attempts + 1, lease_owner = $1, lease_token = $2, \
             lease_until = $3, updated_at = $4 WHERE ops.id = ANY($5) AND ops.status = 'pending' RETURNING {OP_COLUMNS}"
        ))
        .bind(&lease.owner)
        .bind(token)
        .bind(now + chrono_duration(lease.duration))
        .bind(now)
        .bind(&admitted)
        .fetch_all(&mut *tx)
        .await?;
        let mut claimed = claimed_from_rows(&rows, token)?;
        resolve_payloads(&mut *tx, claimed.iter_mut().map(|c| &mut c.op)).await?;
        Ok(claimed)
    }

    async fn cas_each(
        &self,
        leases: &[Lease],
        set: &str,
        bind: impl Fn(&Lease) -> Vec<SqlValue>,
    ) -> Result<Vec<Cas>, QueueError> {
        let mut tx = self.pool.begin().await?;
        let mut out = Vec::with_capacity(leases.len());
        for lease in leases {
            let values = bind(lease);
            let n = values.len();
            let sql = format!(
                "UPDATE ops SET {set} WHERE id = ${} AND status = 'submitted' AND attempts = ${} AND lease_token = ${}",
                n + 1,
                n + 2,
                n + 3
            );
            let mut query = sqlx::query(&sql);
            for value in values {
                query = match value {
                    SqlValue::Time(v) => query.bind(v),
                    SqlValue::Text(v) => query.bind(v),
                };
            }
            let done = query
                .bind(lease.op_id)
                .bind(lease.attempt)
                .bind(lease.token)
                .execute(&mut *tx)
                .await?;
            out.push(cas(done.rows_affected()));
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn operator_change(
        &self,
        id: OpId,
        transition: Transition,
        set: &str,
        after: Option<&str>,
    ) -> Result<Op, QueueError> {
        let now = self.now();
        let mut tx = self.pool.begin().await?;
        // $1 status, $2 now, $3 id, $4 expected status.
        let sql = format!(
            "UPDATE ops SET status = $1, {set} WHERE id = $3 AND status = $4{} RETURNING {OP_COLUMNS}",
            unsent_guard(transition)
        );
        let row = sqlx::query(&sql)
            .bind(transition.to().as_str())
            .bind(now)
            .bind(id)
            .bind(transition.from().as_str())
            .fetch_optional(&mut *tx)
            .await;
        let row = match row {
            Ok(row) => row,
            Err(e) if is_unique_violation(&e) => {
                return Err(QueueError::Conflict {
                    id,
                    message: "another op with the same coalesce key is pending in this outbox".to_owned(),
                })
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(row) = row {
            let mut op = op_from_row(&row)?;
            resolve_payloads(&mut *tx, [&mut op]).await?;
            if let Some(after) = after {
                sqlx::query(after).bind(id).execute(&mut *tx).await?;
            }
            tx.commit().await?;
            return Ok(op);
        }
        let found: Option<(String, bool)> = sqlx::query_as("SELECT status, receipt IS NOT NULL FROM ops WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        tx.rollback().await?;
        Err(refusal(id, found.as_ref().map(|(s, d)| (s.as_str(), *d)), transition))
    }
}

/// A bind value for the generic CAS helper.
enum SqlValue {
    Time(DateTime<Utc>),
    Text(Option<String>),
}

async fn insert_one(
    conn: &mut PgConnection,
    op: &NewOp,
    now: DateTime<Utc>,
    shared_from: usize,
) -> Result<Enqueued, QueueError> {
    let due = op.not_before.map_or(now, |t| t.max(now));
    let (payload, payload_ref) = match shared_payload(&op.payload, shared_from) {
        Some(hash) => {
            sqlx::query("INSERT INTO payloads (hash, body) VALUES ($1, $2::json) ON CONFLICT DO NOTHING")
                .bind(&hash)
                .bind(&op.payload)
                .execute(&mut *conn)
                .await?;
            ("null", Some(hash))
        }
        None => (op.payload.as_str(), None),
    };
    // A conflicting op can reach a terminal state between the insert and the
    // look-up that explains the conflict; then the insert is simply retried.
    for _ in 0..3 {
        let inserted: Option<i64> = sqlx::query_scalar(
            "INSERT INTO ops (outbox, kind, priority, lanes, payload, idempotency_key, coalesce_key, subject, \
             correlation_id, next_attempt_at, created_at, updated_at, payload_ref) \
             VALUES ($1, $2, $3, $4, $5::json, $6, $7, $8, $9, $10, $11, $11, $12) ON CONFLICT DO NOTHING RETURNING id",
        )
        .bind(&op.outbox)
        .bind(&op.kind)
        .bind(op.priority.rank())
        .bind(&op.lanes)
        .bind(payload)
        .bind(&op.idempotency_key)
        .bind(&op.coalesce_key)
        .bind(&op.subject)
        .bind(&op.correlation_id)
        .bind(due)
        .bind(now)
        .bind(&payload_ref)
        .fetch_optional(&mut *conn)
        .await?;
        if let Some(id) = inserted {
            return Ok(Enqueued::Created(id));
        }
        if let Some(key) = &op.idempotency_key {
            let existing: Option<i64> =
                sqlx::query_scalar("SELECT id FROM ops WHERE outbox = $1 AND idempotency_key = $2")
                    .bind(&op.outbox)
                    .bind(key)
                    .fetch_optional(&mut *conn)
                    .await?;
            if let Some(id) = existing {
                return Ok(Enqueued::Existing(id));
            }
            // Its op was pruned: the tombstone's trigger skipped the insert.
            let pruned: Option<i64> = sqlx::query_scalar(
                "SELECT op_id FROM idempotency_tombstones WHERE outbox = $1 AND idempotency_key = $2",
            )
            .bind(&op.outbox)
            .bind(key)
            .fetch_optional(&mut *conn)
            .await?;
            if let Some(id) = pruned {
                return Ok(Enqueued::Existing(id));
            }
        }
        if let Some(key) = &op.coalesce_key {
            let pending: Option<i64> = sqlx::query_scalar(
                "SELECT id FROM ops WHERE outbox = $1 AND coalesce_key = $2 AND status IN ('pending', 'submitted')",
            )
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
impl Queue for PgQueue {
    fn backend(&self) -> Backend {
        Backend::Postgres
    }

    async fn migrate(&self) -> Result<(), QueueError> {
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    async fn check_schema(&self) -> Result<(), QueueError> {
        let has_table: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
            .fetch_one(&self.pool)
            .await?;
        let applied: Vec<i64> = if has_table {
            sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
                .fetch_all(&self.pool)
                .await?
        } else {
            Vec::new()
        };
        let known: Vec<i64> = MIGRATOR.iter().map(|m| m.version).collect();
        check_versions(&applied, &known)
    }

    async fn enqueue(&self, ops: &[NewOp]) -> Result<Vec<Enqueued>, QueueError> {
        let mut tx = self.pool.begin().await?;
        let results = self.enqueue_in(&mut tx, ops).await?;
        tx.commit().await?;
        Ok(results)
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Claimed>, QueueError> {
        let outbox = request.outbox.clone();
        let kinds = request.kinds.clone();
        let limit = i64::from(request.limit);
        self.claim_where(&request.lease, move |q, now| {
            q.push("SELECT id FROM ops WHERE status = 'pending' AND next_attempt_at <= ")
                .push_bind(now);
            if let Some(outbox) = outbox {
                q.push(" AND outbox = ").push_bind(outbox);
            }
            if let Some(kinds) = kinds {
                q.push(" AND kind = ANY(").push_bind(kinds).push(")");
            }
            q.push(" ORDER BY priority, id LIMIT ").push_bind(limit);
        })
        .await
    }

    async fn settle_then_claim(
        &self,
        completions: &[Completion],
        ids: &[OpId],
        follows: &[(OpId, OpId)],
        lease: &LeaseSpec,
        rules: &LaneRules,
    ) -> Result<(Vec<Cas>, Vec<Claimed>), QueueError> {
        if completions.is_empty() && ids.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        // One transaction settles a batch and claims the next: the settles
        // free their lanes before the claim's occupant read sees them.
        let mut tx = self.pool.begin().await?;
        let settled = complete_in(&mut tx, completions, self.now()).await?;
        let ids = still_claimable(ids, follows, completions, &settled);
        let claimed = self.claim_ids_in(&mut tx, &ids, lease, rules).await?;
        tx.commit().await?;
        Ok((settled, claimed))
    }

    async fn occupants(&self, lanes: &[String]) -> Result<Vec<Occupant>, QueueError> {
        let mut conn = self.pool.acquire().await?;
        occupants_in(&mut conn, lanes).await
    }

    async fn complete(&self, completions: &[Completion]) -> Result<Vec<Cas>, QueueError> {
        let mut tx = self.pool.begin().await?;
        let settled = complete_in(&mut tx, completions, self.now()).await?;
        tx.commit().await?;
        Ok(settled)
    }

    async fn checkpoint(&self, lease: &Lease, receipt: &str) -> Result<Cas, QueueError> {
        let now = self.now();
        let receipt = receipt.to_owned();
        let results = self
            .cas_each(std::slice::from_ref(lease), "receipt = $1, updated_at = $2", |_| {
                vec![SqlValue::Text(Some(receipt.clone())), SqlValue::Time(now)]
            })
            .await?;
        Ok(results.first().copied().unwrap_or(Cas::Stale))
    }

    async fn extend_leases(&self, leases: &[Lease], duration: Duration) -> Result<Vec<Cas>, QueueError> {
        let until = self.now() + chrono_duration(duration);
        self.cas_each(leases, "lease_until = $1", |_| vec![SqlValue::Time(until)])
            .await
    }

    async fn release(&self, leases: &[Lease]) -> Result<Vec<Cas>, QueueError> {
        let now = self.now();
        let set = format!(
            "status = '{}', attempts = attempts - 1, lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
             updated_at = $1",
            Transition::Release.to()
        );
        self.cas_each(leases, &set, |_| vec![SqlValue::Time(now)]).await
    }

    async fn expired_leases(&self, limit: u32) -> Result<Vec<Claimed>, QueueError> {
        let rows = sqlx::query(&format!(
            "SELECT {OP_COLUMNS} FROM ops WHERE status = 'submitted' AND lease_until < $1 ORDER BY lease_until LIMIT $2"
        ))
        .bind(self.now())
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        let mut claimed: Vec<Claimed> = rows
            .iter()
            .map(op_from_row)
            .filter_map(|op| match op {
                Ok(op) => op.lease().map(|lease| Ok(Claimed { op, lease })),
                Err(e) => Some(Err(e)),
            })
            .collect::<Result<_, QueueError>>()?;
        resolve_payloads(&self.pool, claimed.iter_mut().map(|c| &mut c.op)).await?;
        Ok(claimed)
    }

    async fn expire(&self, lease: &Lease, to: ExpireTo) -> Result<Cas, QueueError> {
        let now = self.now();
        let (transition, next_attempt_at, halt) = expire_params(to, now);
        let finished_at = transition.to().is_terminal().then_some(now);
        let mut tx = self.pool.begin().await?;
        // The CTE reads the row as claimed (when, by whom) before the update
        // overwrites it; the attempt row is written from that.
        let row = sqlx::query(
            "WITH old AS (SELECT id, updated_at, lease_owner FROM ops \
             WHERE id = $5 AND status = 'submitted' AND attempts = $6 AND lease_token = $7 FOR UPDATE) \
             UPDATE ops SET status = $1, next_attempt_at = $2, last_error = 'lease expired', lease_owner = NULL, \
             lease_token = NULL, lease_until = NULL, updated_at = $3, finished_at = $4 \
             FROM old WHERE ops.id = old.id RETURNING old.updated_at AS claimed_at, old.lease_owner AS owner",
        )
        .bind(transition.to().as_str())
        .bind(next_attempt_at)
        .bind(now)
        .bind(finished_at)
        .bind(lease.op_id)
        .bind(lease.attempt)
        .bind(lease.token)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            tx.rollback().await?;
            return Ok(Cas::Stale);
        };
        let owner: Option<String> = row.try_get("owner")?;
        let record = AttemptRecord {
            started_at: row.try_get("claimed_at")?,
            finished_at: now,
            class: AttemptClass::LeaseExpired,
            detail: None,
            fee: None,
            error: Some(format!("lease held by {} expired", owner.as_deref().unwrap_or("?"))),
        };
        insert_attempt(&mut tx, lease.op_id, lease.attempt, &record).await?;
        if halt {
            halt_lanes(&mut tx, lease.op_id, now).await?;
        }
        tx.commit().await?;
        Ok(Cas::Applied)
    }

    async fn cancel(&self, id: OpId) -> Result<Op, QueueError> {
        self.operator_change(id, Transition::Cancel, "updated_at = $2, finished_at = $2", None)
            .await
    }

    async fn force_retry(&self, id: OpId) -> Result<Op, QueueError> {
        self.operator_change(
            id,
            Transition::ForceRetry,
            "attempt_floor = attempts, next_attempt_at = $2, updated_at = $2, finished_at = NULL",
            // A retried dead letter goes back to being its lanes' head, so
            // any hold it placed on them is no longer needed.
            Some("DELETE FROM lane_halts WHERE op_id = $1"),
        )
        .await
    }

    async fn get(&self, id: OpId) -> Result<Option<Op>, QueueError> {
        let row = sqlx::query(&format!("SELECT {OP_COLUMNS} FROM ops WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        let mut op = row.as_ref().map(op_from_row).transpose()?;
        resolve_payloads(&self.pool, op.iter_mut()).await?;
        Ok(op)
    }

    async fn attempts(&self, id: OpId) -> Result<Vec<Attempt>, QueueError> {
        let rows = sqlx::query(
            "SELECT op_id, attempt, started_at, finished_at, outcome, detail, fee, error FROM attempts \
             WHERE op_id = $1 ORDER BY attempt",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                let op_id: i64 = row.try_get("op_id")?;
                let outcome: String = row.try_get("outcome")?;
                Ok(Attempt {
                    op_id,
                    attempt: row.try_get("attempt")?,
                    record: AttemptRecord {
                        started_at: row.try_get("started_at")?,
                        finished_at: row.try_get("finished_at")?,
                        class: AttemptClass::parse(&outcome).ok_or(QueueError::Corrupt {
                            id: op_id,
                            column: "attempts.outcome",
                            value: outcome.clone(),
                        })?,
                        detail: row.try_get("detail")?,
                        fee: row.try_get("fee")?,
                        error: row.try_get("error")?,
                    },
                })
            })
            .collect()
    }

    async fn list(&self, filter: &OpFilter) -> Result<Vec<Op>, QueueError> {
        let mut q = QueryBuilder::<Postgres>::new(format!("SELECT {OP_COLUMNS} FROM ops WHERE TRUE"));
        if let Some(status) = filter.status {
            q.push(" AND status = ").push_bind(status.as_str());
        }
        if let Some(kind) = &filter.kind {
            q.push(" AND kind = ").push_bind(kind.clone());
        }
        if let Some(priority) = filter.priority {
            q.push(" AND priority = ").push_bind(priority.rank());
        }
        if let Some(subject) = &filter.subject {
            q.push(" AND subject = ").push_bind(subject.clone());
        }
        if let Some(outbox) = &filter.outbox {
            q.push(" AND outbox = ").push_bind(outbox.clone());
        }
        if let Some(lane) = &filter.lane {
            q.push(" AND id IN (SELECT op_id FROM op_lanes WHERE lane = ")
                .push_bind(lane.clone())
                .push(")");
        }
        if let Some(correlation) = &filter.correlation_id {
            q.push(" AND correlation_id = ").push_bind(correlation.clone());
        }
        if let Some(t) = &filter.created_after {
            q.push(" AND created_at >= ").push_bind(*t);
        }
        if let Some(t) = &filter.created_before {
            q.push(" AND created_at < ").push_bind(*t);
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
        let rows = q.build().fetch_all(&self.pool).await?;
        let mut ops = rows.iter().map(op_from_row).collect::<Result<Vec<_>, _>>()?;
        resolve_payloads(&self.pool, ops.iter_mut()).await?;
        Ok(ops)
    }

    async fn depth(&self) -> Result<Vec<Depth>, QueueError> {
        let rows = sqlx::query(
            "SELECT status, priority, kind, COUNT(*) AS n FROM ops GROUP BY status, priority, kind \
             ORDER BY status, priority, kind",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                let status: String = row.try_get("status")?;
                let priority: i16 = row.try_get("priority")?;
                Ok(Depth {
                    status: parse_status(0, &status)?,
                    priority: parse_priority(0, i64::from(priority))?,
                    kind: row.try_get("kind")?,
                    count: row.try_get("n")?,
                })
            })
            .collect()
    }

    async fn candidates(&self, outbox: &str, limit: u32) -> Result<Vec<CandidateOp>, QueueError> {
        let rows = sqlx::query(&format!(
            "SELECT {OP_COLUMNS}, h.subject IS NOT NULL AS subject_halted FROM ops \
             LEFT JOIN halted_subjects h ON h.subject = ops.subject \
             WHERE ops.outbox = $1 AND ops.status IN ('pending', 'submitted') ORDER BY ops.priority, ops.id LIMIT $2"
        ))
        .bind(outbox)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        let mut candidates = rows
            .iter()
            .map(|row| {
                Ok(CandidateOp {
                    op: op_from_row(row)?,
                    subject_halted: row.try_get("subject_halted")?,
                })
            })
            .collect::<Result<Vec<_>, QueueError>>()?;
        resolve_payloads(&self.pool, candidates.iter_mut().map(|c| &mut c.op)).await?;
        Ok(candidates)
    }

    async fn scan(&self, outbox: &str, after: Option<OpId>, limit: u32) -> Result<Vec<BookRow>, QueueError> {
        let active = "outbox = $1 AND status IN ('pending', 'submitted')";
        let sql = if after.is_some() {
            // One index range per tier, from `after` on: a delta read never
            // walks the backlog.
            let tier = |p: i16| {
                format!("(SELECT {BOOK_COLUMNS} FROM ops WHERE {active} AND priority = {p} AND id > $2 ORDER BY id LIMIT $3)")
            };
            format!(
                "SELECT * FROM ({} UNION ALL {} UNION ALL {}) AS t ORDER BY id LIMIT $3",
                tier(0),
                tier(1),
                tier(2)
            )
        } else {
            format!("SELECT {BOOK_COLUMNS} FROM ops WHERE {active} AND $2::bigint IS NOT NULL ORDER BY priority, id LIMIT $3")
        };
        sqlx::query(&sql)
            .bind(outbox)
            .bind(after.unwrap_or(0))
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(book_row)
            .collect()
    }

    async fn scan_from(&self, outbox: &str, from: (Priority, OpId), limit: u32) -> Result<Vec<BookRow>, QueueError> {
        sqlx::query(&scan_from_sql(from.0, "$1", "$2", "$3"))
            .bind(outbox)
            .bind(from.1)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(book_row)
            .collect()
    }

    async fn due_outboxes(&self, limit: u32) -> Result<Vec<String>, QueueError> {
        Ok(sqlx::query_scalar(&due_outboxes_sql("$1", "$2"))
            .bind(self.now())
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?)
    }

    async fn acquire_slot(&self, outbox: &str, owner: &str, ttl: Duration) -> Result<Option<SlotLease>, QueueError> {
        let now = self.now();
        let token = new_token();
        let taken: Option<Uuid> = sqlx::query_scalar(
            "INSERT INTO drain_slots (outbox, owner, token, lease_until) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (outbox) DO UPDATE SET owner = excluded.owner, token = excluded.token, \
             lease_until = excluded.lease_until WHERE drain_slots.lease_until < $5 RETURNING token",
        )
        .bind(outbox)
        .bind(owner)
        .bind(token)
        .bind(now + chrono_duration(ttl))
        .bind(now)
        .fetch_optional(&self.pool)
        .await?;
        Ok(taken.map(|token| SlotLease {
            outbox: outbox.to_owned(),
            token,
        }))
    }

    async fn renew_slot(&self, slot: &SlotLease, ttl: Duration) -> Result<Cas, QueueError> {
        let done = sqlx::query("UPDATE drain_slots SET lease_until = $1 WHERE outbox = $2 AND token = $3")
            .bind(self.now() + chrono_duration(ttl))
            .bind(&slot.outbox)
            .bind(slot.token)
            .execute(&self.pool)
            .await?;
        Ok(cas(done.rows_affected()))
    }

    async fn release_slot(&self, slot: &SlotLease) -> Result<(), QueueError> {
        sqlx::query("DELETE FROM drain_slots WHERE outbox = $1 AND token = $2")
            .bind(&slot.outbox)
            .bind(slot.token)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn heartbeat(&self, owner: &str, ttl: Duration) -> Result<HostShare, QueueError> {
        let now = self.now();
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO hosts (owner, seen_until) VALUES ($1, $2) \
             ON CONFLICT (owner) DO UPDATE SET seen_until = excluded.seen_until",
        )
        .bind(owner)
        .bind(now + chrono_duration(ttl))
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM hosts WHERE seen_until < $1")
            .bind(now)
            .execute(&mut *tx)
            .await?;
        let (hosts, slots, mine): (i64, i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM hosts), \
                 (SELECT count(*) FROM drain_slots WHERE lease_until >= $1), \
                 (SELECT count(*) FROM drain_slots WHERE lease_until >= $1 AND owner = $2)",
        )
        .bind(now)
        .bind(owner)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(host_share(hosts, slots, mine))
    }

    async fn lane_halts(&self, outbox: Option<&str>) -> Result<Vec<LaneHalt>, QueueError> {
        let rows = sqlx::query(
            "SELECT outbox, lane, op_id, halted_at FROM lane_halts WHERE $1::text IS NULL OR outbox = $1 \
             ORDER BY outbox, lane, op_id",
        )
        .bind(outbox)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(LaneHalt {
                    outbox: row.try_get("outbox")?,
                    lane: row.try_get("lane")?,
                    op_id: row.try_get("op_id")?,
                    halted_at: row.try_get("halted_at")?,
                })
            })
            .collect()
    }

    async fn skip_lane(&self, outbox: &str, lane: &str) -> Result<u64, QueueError> {
        let done = sqlx::query("DELETE FROM lane_halts WHERE outbox = $1 AND lane = $2")
            .bind(outbox)
            .bind(lane)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn defer(&self, id: OpId, until: DateTime<Utc>) -> Result<Cas, QueueError> {
        let done =
            sqlx::query("UPDATE ops SET next_attempt_at = $1, updated_at = $2 WHERE id = $3 AND status = 'pending'")
                .bind(until)
                .bind(self.now())
                .bind(id)
                .execute(&self.pool)
                .await?;
        Ok(if done.rows_affected() == 1 {
            Cas::Applied
        } else {
            Cas::Stale
        })
    }

    async fn halt_subject(&self, subject: &str, reason: Option<&str>) -> Result<(), QueueError> {
        sqlx::query(
            "INSERT INTO halted_subjects (subject, reason, halted_at) VALUES ($1, $2, $3) \
             ON CONFLICT (subject) DO UPDATE SET reason = excluded.reason",
        )
        .bind(subject)
        .bind(reason)
        .bind(self.now())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn unhalt_subject(&self, subject: &str) -> Result<bool, QueueError> {
        let done = sqlx::query("DELETE FROM halted_subjects WHERE subject = $1")
            .bind(subject)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn halted_subjects(&self) -> Result<Vec<HaltedSubject>, QueueError> {
        let rows = sqlx::query("SELECT subject, reason, halted_at FROM halted_subjects ORDER BY subject")
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|row| {
                Ok(HaltedSubject {
                    subject: row.try_get("subject")?,
                    reason: row.try_get("reason")?,
                    halted_at: row.try_get("halted_at")?,
                })
            })
            .collect()
    }

    async fn subscribe(&self) -> Result<Option<Box<dyn Subscription>>, QueueError> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen(NOTIFY_CHANNEL).await?;
        Ok(Some(Box::new(PgSubscription { listener })))
    }

    async fn set_kind_defaults(&self, defaults: &[(String, Priority)]) -> Result<(), QueueError> {
        // Upserts, and a delete of only what is no longer listed: hosts
        // starting or reloading at the same moment each write the same
        // rows without colliding (a delete-then-insert let two concurrent
        // inserts of one kind fail on its primary key).
        // Hosts mid-rollout may disagree about a kind: one deleting the row
        // another upserts could deadlock them, so the writers take turns.
        let kinds: Vec<&str> = defaults.iter().map(|(k, _)| k.as_str()).collect();
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('laneway.kind_defaults'))")
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM kind_defaults WHERE kind <> ALL($1)")
            .bind(&kinds)
            .execute(&mut *tx)
            .await?;
        for (kind, priority) in defaults {
            sqlx::query(
                "INSERT INTO kind_defaults (kind, priority) VALUES ($1, $2) \
                 ON CONFLICT (kind) DO UPDATE SET priority = excluded.priority",
            )
            .bind(kind)
            .bind(priority.rank())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn put_fee_snapshot(
        &self,
        oracle: &str,
        snapshot: &str,
        sampled_at: DateTime<Utc>,
    ) -> Result<Cas, QueueError> {
        let done = sqlx::query(
            "INSERT INTO fee_snapshots (oracle, snapshot, sampled_at) VALUES ($1, $2::json, $3) \
             ON CONFLICT (oracle) DO UPDATE SET snapshot = excluded.snapshot, sampled_at = excluded.sampled_at \
             WHERE fee_snapshots.sampled_at < excluded.sampled_at",
        )
        .bind(oracle)
        .bind(snapshot)
        .bind(sampled_at)
        .execute(&self.pool)
        .await?;
        Ok(cas(done.rows_affected()))
    }

    async fn fee_snapshot(&self, oracle: &str) -> Result<Option<(String, DateTime<Utc>)>, QueueError> {
        let row = sqlx::query("SELECT snapshot::text AS snapshot, sampled_at FROM fee_snapshots WHERE oracle = $1")
            .bind(oracle)
            .fetch_optional(&self.pool)
            .await?;
        row.map(|row| Ok((row.try_get("snapshot")?, row.try_get("sampled_at")?)))
            .transpose()
    }

    async fn retry_dead_letters(&self, due: &[(OpId, DateTime<Utc>)]) -> Result<Vec<OpId>, QueueError> {
        let t = Transition::ForceRetry;
        let ids: Vec<OpId> = due.iter().map(|(id, _)| *id).collect();
        let ats: Vec<DateTime<Utc>> = due.iter().map(|(_, at)| *at).collect();
        let mut tx = self.pool.begin().await?;
        let retried: Vec<OpId> = sqlx::query_scalar(
            "UPDATE ops SET status = $1, attempt_floor = attempts, next_attempt_at = d.at, updated_at = $2, \
             finished_at = NULL FROM UNNEST($3::bigint[], $4::timestamptz[]) AS d(id, at) \
             WHERE ops.id = d.id AND ops.status = $5 AND ops.coalesce_key IS NULL RETURNING ops.id",
        )
        .bind(t.to().as_str())
        .bind(self.now())
        .bind(&ids)
        .bind(&ats)
        .bind(t.from().as_str())
        .fetch_all(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM lane_halts WHERE op_id = ANY($1)")
            .bind(&retried)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(retried)
    }

    async fn create_api_key(&self, key: &NewApiKey) -> Result<ApiKey, QueueError> {
        let now = self.now();
        let done =
            sqlx::query("INSERT INTO api_keys (id, name, secret_hash, scopes, created_at) VALUES ($1, $2, $3, $4, $5)")
                .bind(&key.id)
                .bind(&key.name)
                .bind(&key.secret_hash)
                .bind(scopes_column(&key.scopes))
                .bind(now)
                .execute(&self.pool)
                .await;
        match done {
            Err(e) if is_unique_violation(&e) => return Err(api_key_name_taken(&key.name)),
            other => other?,
        };
        Ok(ApiKey {
            id: key.id.clone(),
            name: key.name.clone(),
            scopes: key.scopes.clone(),
            created_at: now,
            revoked_at: None,
        })
    }

    async fn api_keys(&self) -> Result<Vec<ApiKey>, QueueError> {
        let rows = sqlx::query("SELECT id, name, scopes, created_at, revoked_at FROM api_keys ORDER BY name")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(api_key_from_row).collect()
    }

    async fn api_key(&self, id: &str) -> Result<Option<(ApiKey, Vec<u8>)>, QueueError> {
        let row =
            sqlx::query("SELECT id, name, scopes, created_at, revoked_at, secret_hash FROM api_keys WHERE id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await?;
        row.map(|row| Ok((api_key_from_row(&row)?, row.try_get("secret_hash")?)))
            .transpose()
    }

    async fn revoke_api_key(&self, name: &str) -> Result<bool, QueueError> {
        let done = sqlx::query("UPDATE api_keys SET revoked_at = $1 WHERE name = $2 AND revoked_at IS NULL")
            .bind(self.now())
            .bind(name)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn record_audit(&self, entry: &NewAuditEntry) -> Result<(), QueueError> {
        sqlx::query("INSERT INTO audit_log (at, actor, action, target, before, after) VALUES ($1, $2, $3, $4, $5, $6)")
            .bind(self.now())
            .bind(&entry.actor)
            .bind(&entry.action)
            .bind(&entry.target)
            .bind(json_column(entry.before.as_ref()))
            .bind(json_column(entry.after.as_ref()))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn audit_log(&self, before: Option<i64>, limit: u32) -> Result<Vec<AuditEntry>, QueueError> {
        let rows = sqlx::query(
            "SELECT id, at, actor, action, target, before, after FROM audit_log \
             WHERE $1::bigint IS NULL OR id < $1 ORDER BY id DESC LIMIT $2",
        )
        .bind(before)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                let id: i64 = row.try_get("id")?;
                Ok(AuditEntry {
                    id,
                    at: row.try_get("at")?,
                    actor: row.try_get("actor")?,
                    action: row.try_get("action")?,
                    target: row.try_get("target")?,
                    before: json_from_column(id, "audit_log.before", row.try_get("before")?)?,
                    after: json_from_column(id, "audit_log.after", row.try_get("after")?)?,
                })
            })
            .collect()
    }

    async fn pause(
        &self,
        scope: PauseScope,
        target: &str,
        reason: Option<&str>,
        actor: &str,
    ) -> Result<bool, QueueError> {
        let done = sqlx::query(
            "INSERT INTO pauses (scope, target, reason, actor, paused_at) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (scope, target) DO NOTHING",
        )
        .bind(scope.as_str())
        .bind(target)
        .bind(reason)
        .bind(actor)
        .bind(self.now())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn resume(&self, scope: PauseScope, target: &str) -> Result<bool, QueueError> {
        let done = sqlx::query("DELETE FROM pauses WHERE scope = $1 AND target = $2")
            .bind(scope.as_str())
            .bind(target)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn pauses(&self) -> Result<Vec<Pause>, QueueError> {
        let rows = sqlx::query("SELECT scope, target, reason, actor, paused_at FROM pauses ORDER BY scope, target")
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|row| {
                let scope: String = row.try_get("scope")?;
                Ok(Pause {
                    scope: pause_scope(&scope)?,
                    target: row.try_get("target")?,
                    reason: row.try_get("reason")?,
                    actor: row.try_get("actor")?,
                    paused_at: row.try_get("paused_at")?,
                })
            })
            .collect()
    }
    async fn gauges(&self) -> Result<QueueGauges, QueueError> {
        let now = self.now();
        let row = sqlx::query(
            "SELECT (SELECT COUNT(*) FROM ops WHERE status = 'submitted' AND lease_until < $1) AS stuck, \
             (SELECT COUNT(*) FROM lane_halts) AS held, (SELECT COUNT(*) FROM halted_subjects) AS halted",
        )
        .bind(now)
        .fetch_one(&self.pool)
        .await?;
        let rows = sqlx::query(
            "SELECT kind, outbox, MIN(next_attempt_at) AS due FROM ops \
             WHERE status = 'pending' AND next_attempt_at <= $1 GROUP BY kind, outbox ORDER BY kind, outbox",
        )
        .bind(now)
        .fetch_all(&self.pool)
        .await?;
        let oldest_due = rows
            .iter()
            .map(|r| {
                Ok(OldestDue {
                    kind: r.try_get("kind")?,
                    outbox: r.try_get("outbox")?,
                    due_at: r.try_get("due")?,
                })
            })
            .collect::<Result<_, QueueError>>()?;
        Ok(QueueGauges {
            stuck_submitted: row.try_get("stuck")?,
            lanes_held: row.try_get("held")?,
            subjects_halted: row.try_get("halted")?,
            oldest_due,
        })
    }

    async fn recent_latencies(&self, since: DateTime<Utc>, limit: u32) -> Result<Vec<Latency>, QueueError> {
        let rows = sqlx::query(
            "SELECT id, kind, priority, EXTRACT(EPOCH FROM finished_at - created_at)::float8 AS seconds FROM ops \
             WHERE status = 'confirmed' AND finished_at >= $1 ORDER BY id DESC LIMIT $2",
        )
        .bind(since)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let id: i64 = r.try_get("id")?;
                let priority: i16 = r.try_get("priority")?;
                let seconds: f64 = r.try_get("seconds")?;
                Ok(Latency {
                    kind: r.try_get("kind")?,
                    priority: parse_priority(id, i64::from(priority))?,
                    seconds: seconds.max(0.0),
                })
            })
            .collect()
    }
    async fn outcomes(&self, after: Option<&str>, limit: u32) -> Result<Vec<OutcomeEntry>, QueueError> {
        // The cursor is "xid.seq": see the migration for why both.
        let (xid, seq): (i64, i64) = match after {
            None => (0, 0),
            Some(c) => parse_feed_cursor(c)?,
        };
        let rows = sqlx::query(&format!(
            "SELECT f.seq, f.xid::text::bigint AS fxid, f.status AS fstatus, f.at AS fat, {OP_COLUMNS} FROM ops JOIN \
             (SELECT seq, xid, op_id, status, at FROM outcomes \
              WHERE xid < pg_snapshot_xmin(pg_current_snapshot()) AND (xid, seq) > ($1::text::xid8, $2) \
              ORDER BY xid, seq LIMIT $3) f \
             ON f.op_id = ops.id ORDER BY f.xid, f.seq"
        ))
        .bind(xid.to_string())
        .bind(seq)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        let mut entries = rows
            .iter()
            .map(|r| {
                let op = op_from_row(r)?;
                let seq: i64 = r.try_get("seq")?;
                let xid: i64 = r.try_get("fxid")?;
                let status: String = r.try_get("fstatus")?;
                Ok(OutcomeEntry {
                    cursor: format!("{xid}.{seq}"),
                    status: parse_status(op.id, &status)?,
                    at: r.try_get("fat")?,
                    op,
                })
            })
            .collect::<Result<Vec<_>, QueueError>>()?;
        resolve_payloads(&self.pool, entries.iter_mut().map(|e| &mut e.op)).await?;
        Ok(entries)
    }
    async fn prunable(&self, query: &PruneQuery) -> Result<Vec<Op>, QueueError> {
        let mut q = QueryBuilder::<Postgres>::new(format!("SELECT {OP_COLUMNS} FROM ops WHERE ops.status = "));
        q.push_bind(query.status.as_str());
        q.push(" AND ops.finished_at < ").push_bind(query.finished_before);
        match &query.kind {
            Some(kind) => {
                q.push(" AND ops.kind = ").push_bind(kind.clone());
            }
            None => {
                q.push(" AND NOT (ops.kind = ANY(")
                    .push_bind(query.except_kinds.clone())
                    .push("))");
            }
        }
        if let Some(after) = &query.unrelayed_after {
            let (xid, seq) = match after {
                None => (0, 0),
                Some(c) => parse_feed_cursor(c)?,
            };
            q.push(" AND ops.id NOT IN (SELECT op_id FROM outcomes WHERE (xid, seq) > (")
                .push_bind(xid.to_string())
                .push("::text::xid8, ")
                .push_bind(seq)
                .push("))");
        }
        q.push(" AND ops.id NOT IN (SELECT op_id FROM lane_halts) ORDER BY ops.id LIMIT ")
            .push_bind(i64::from(query.limit));
        let rows = q.build().fetch_all(&self.pool).await?;
        let mut ops = rows.iter().map(op_from_row).collect::<Result<Vec<_>, _>>()?;
        resolve_payloads(&self.pool, ops.iter_mut()).await?;
        Ok(ops)
    }

    async fn put_tombstones(&self, tombstones: &[Tombstone]) -> Result<(), QueueError> {
        let mut tx = self.pool.begin().await?;
        for t in tombstones {
            sqlx::query(
                "INSERT INTO idempotency_tombstones \
                 (outbox, idempotency_key, op_id, kind, status, receipt, finished_at, expires_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
            )
            .bind(&t.outbox)
            .bind(&t.idempotency_key)
            .bind(t.op_id)
            .bind(&t.kind)
            .bind(t.status.as_str())
            .bind(&t.receipt)
            .bind(t.finished_at)
            .bind(t.expires_at)
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
        let mut tx = self.pool.begin().await?;
        // Locked, so an operator's retry cannot move one of them meanwhile;
        // skipped when another pruner holds it.
        let doomed: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM ops WHERE id = ANY($1) AND status = $2 \
             AND id NOT IN (SELECT op_id FROM lane_halts) ORDER BY id FOR UPDATE SKIP LOCKED",
        )
        .bind(ids)
        .bind(status.as_str())
        .fetch_all(&mut *tx)
        .await?;
        let shared: Vec<String> =
            sqlx::query_scalar("SELECT DISTINCT payload_ref FROM ops WHERE id = ANY($1) AND payload_ref IS NOT NULL")
                .bind(&doomed)
                .fetch_all(&mut *tx)
                .await?;
        for table in ["attempts", "op_lanes", "outcomes"] {
            sqlx::query(&format!("DELETE FROM {table} WHERE op_id = ANY($1)"))
                .bind(&doomed)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query("DELETE FROM ops WHERE id = ANY($1)")
            .bind(&doomed)
            .execute(&mut *tx)
            .await?;
        // A shared payload goes with the last op that carries it (a
        // concurrent enqueue of the same payload finds the row it keeps
        // or inserts it again: ON CONFLICT DO NOTHING on both sides).
        sqlx::query(
            "DELETE FROM payloads WHERE hash = ANY($1) \
             AND NOT EXISTS (SELECT 1 FROM ops WHERE ops.payload_ref = payloads.hash)",
        )
        .bind(&shared)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(doomed)
    }

    async fn expire_tombstones(&self, now: DateTime<Utc>, limit: u32) -> Result<u64, QueueError> {
        let done = sqlx::query(
            "DELETE FROM idempotency_tombstones WHERE (outbox, idempotency_key) IN \
             (SELECT outbox, idempotency_key FROM idempotency_tombstones \
              WHERE expires_at IS NOT NULL AND expires_at < $1 LIMIT $2)",
        )
        .bind(now)
        .bind(i64::from(limit))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    async fn tombstone(&self, outbox: &str, idempotency_key: &str) -> Result<Option<Tombstone>, QueueError> {
        let row = sqlx::query(
            "SELECT outbox, idempotency_key, op_id, kind, status, receipt, finished_at, expires_at \
             FROM idempotency_tombstones WHERE outbox = $1 AND idempotency_key = $2",
        )
        .bind(outbox)
        .bind(idempotency_key)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|r| {
            let op_id: i64 = r.try_get("op_id")?;
            let status: String = r.try_get("status")?;
            Ok(Tombstone {
                outbox: r.try_get("outbox")?,
                idempotency_key: r.try_get("idempotency_key")?,
                op_id,
                kind: r.try_get("kind")?,
                status: parse_status(op_id, &status)?,
                receipt: r.try_get("receipt")?,
                finished_at: r.try_get("finished_at")?,
                expires_at: r.try_get("expires_at")?,
            })
        })
        .transpose()
    }

    async fn hold_singleton(&self, name: &str, owner: &str, ttl: std::time::Duration) -> Result<bool, QueueError> {
        let now = self.now();
        let until = now + crate::clock::chrono_duration(ttl);
        let held: Option<String> = sqlx::query_scalar(
            "INSERT INTO singletons (name, owner, until) VALUES ($1, $2, $3) \
             ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, until = excluded.until \
             WHERE singletons.until < $4 OR singletons.owner = excluded.owner RETURNING owner",
        )
        .bind(name)
        .bind(owner)
        .bind(until)
        .bind(now)
        .fetch_optional(&self.pool)
        .await?;
        Ok(held.is_some())
    }

    async fn release_coalesce(&self, outbox: &str, idempotency_keys: &[String]) -> Result<u64, QueueError> {
        if idempotency_keys.is_empty() {
            return Ok(0);
        }
        let done = sqlx::query(
            "UPDATE ops SET coalesce_key = NULL, updated_at = $1 WHERE outbox = $2 AND coalesce_key IS NOT NULL \
             AND status IN ('pending', 'submitted') AND idempotency_key = ANY($3)",
        )
        .bind(self.now())
        .bind(outbox)
        .bind(idempotency_keys)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    async fn feed_cursor(&self, name: &str) -> Result<Option<String>, QueueError> {
        Ok(sqlx::query_scalar("SELECT cursor FROM feed_cursors WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.pool)
            .await?)
    }

    async fn set_feed_cursor(&self, name: &str, cursor: &str) -> Result<(), QueueError> {
        sqlx::query(
            "INSERT INTO feed_cursors (name, cursor) VALUES ($1, $2) ON CONFLICT (name) DO UPDATE SET cursor = $2",
        )
        .bind(name)
        .bind(cursor)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn record(&self, namespace: &str, key: &str) -> Result<Option<Record>, QueueError> {
        let row = sqlx::query("SELECT key, value, version, updated_at FROM records WHERE namespace = $1 AND key = $2")
            .bind(namespace)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    async fn records(&self, namespace: &str, keys: Option<&[String]>) -> Result<Vec<Record>, QueueError> {
        let rows = match keys {
            None => {
                sqlx::query("SELECT key, value, version, updated_at FROM records WHERE namespace = $1 ORDER BY key")
                    .bind(namespace)
                    .fetch_all(&self.pool)
                    .await?
            }
            Some([]) => return Ok(Vec::new()),
            Some(keys) => {
                sqlx::query(
                    "SELECT key, value, version, updated_at FROM records WHERE namespace = $1 \
                     AND key = ANY($2) ORDER BY key",
                )
                .bind(namespace)
                .bind(keys)
                .fetch_all(&self.pool)
                .await?
            }
        };
        rows.iter().map(record_from_row).collect()
    }

    async fn put_record(&self, namespace: &str, key: &str, value: &str, expect: Expect) -> Result<Cas, QueueError> {
        let now = self.now();
        let done = match expect {
            Expect::Absent => {
                sqlx::query(
                    "INSERT INTO records (namespace, key, value, version, updated_at) VALUES ($1, $2, $3, 1, $4) \
                     ON CONFLICT (namespace, key) DO NOTHING",
                )
                .bind(namespace)
                .bind(key)
                .bind(value)
                .bind(now)
                .execute(&self.pool)
                .await?
            }
            Expect::Version(version) => {
                sqlx::query(
                    "UPDATE records SET value = $3, version = version + 1, updated_at = $4 \
                     WHERE namespace = $1 AND key = $2 AND version = $5",
                )
                .bind(namespace)
                .bind(key)
                .bind(value)
                .bind(now)
                .bind(version)
                .execute(&self.pool)
                .await?
            }
            Expect::Any => {
                sqlx::query(
                    "INSERT INTO records (namespace, key, value, version, updated_at) VALUES ($1, $2, $3, 1, $4) \
                     ON CONFLICT (namespace, key) DO UPDATE SET value = EXCLUDED.value, \
                     version = records.version + 1, updated_at = EXCLUDED.updated_at",
                )
                .bind(namespace)
                .bind(key)
                .bind(value)
                .bind(now)
                .execute(&self.pool)
                .await?
            }
        };
        Ok(cas(done.rows_affected()))
    }

    async fn delete_record(&self, namespace: &str, key: &str, expect: Expect) -> Result<Cas, QueueError> {
        let version = match expect {
            Expect::Absent => return Ok(Cas::Stale),
            Expect::Version(v) => Some(v),
            Expect::Any => None,
        };
        let done = sqlx::query(
            "DELETE FROM records WHERE namespace = $1 AND key = $2 AND ($3::BIGINT IS NULL OR version = $3)",
        )
        .bind(namespace)
        .bind(key)
        .bind(version)
        .execute(&self.pool)
        .await?;
        Ok(cas(done.rows_affected()))
    }

    async fn table_rows(&self) -> Result<Vec<(String, i64)>, QueueError> {
        let mut out = Vec::new();
        for table in super::common::SIZED_TABLES {
            let n: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {table}"))
                .fetch_one(&self.pool)
                .await?;
            out.push((table.to_owned(), n));
        }
        Ok(out)
    }
}

fn record_from_row(row: &PgRow) -> Result<Record, QueueError> {
    Ok(Record {
        key: row.try_get("key")?,
        value: row.try_get("value")?,
        version: row.try_get("version")?,
        updated_at: row.try_get("updated_at")?,
    })
}

fn api_key_from_row(row: &PgRow) -> Result<ApiKey, QueueError> {
    let scopes: String = row.try_get("scopes")?;
    Ok(ApiKey {
        id: row.try_get("id")?,
        name: row.try_get("name")?,
        scopes: scopes_from_column(&scopes),
        created_at: row.try_get("created_at")?,
        revoked_at: row.try_get("revoked_at")?,
    })
}

/// `LISTEN laneway_ops`, yielding the outbox each insert names.
struct PgSubscription {
    listener: PgListener,
}

#[async_trait]
impl Subscription for PgSubscription {
    async fn next(&mut self) -> Result<String, QueueError> {
        // PgListener reconnects by itself after a dropped connection;
        // notifications sent meanwhile are lost, which the safety-net poll covers.
        Ok(self.listener.recv().await?.payload().to_owned())
    }
}

/// A batch of settles as one array per column, for `unnest`.
#[derive(Default)]
struct SettleColumns {
    id: Vec<i64>,
    attempt: Vec<i32>,
    token: Vec<Uuid>,
    from_status: Vec<&'static str>,
    to_status: Vec<&'static str>,
    clear_receipt: Vec<bool>,
    receipt: Vec<Option<String>>,
    error: Vec<Option<String>>,
    next_at: Vec<Option<DateTime<Utc>>>,
    bump: Vec<i32>,
    finished_at: Vec<Option<DateTime<Utc>>>,
    halt: Vec<bool>,
    started: Vec<DateTime<Utc>>,
    ended: Vec<DateTime<Utc>>,
    outcome: Vec<&'static str>,
    detail: Vec<Option<String>>,
    fee: Vec<Option<i64>>,
    attempt_error: Vec<Option<String>>,
}

impl SettleColumns {
    fn of(completions: &[Completion], now: DateTime<Utc>) -> Self {
        let mut b = Self::default();
        for c in completions {
            let p = FinishParams::of(&c.finish);
            b.id.push(c.lease.op_id);
            b.attempt.push(c.lease.attempt);
            b.token.push(c.lease.token);
            b.from_status.push(p.transition.from().as_str());
            b.to_status.push(p.transition.to().as_str());
            b.clear_receipt.push(p.clear_receipt);
            b.receipt.push(p.receipt);
            b.error.push(p.error);
            b.next_at.push(p.next_attempt_at);
            b.bump.push(p.fee_bump);
            b.finished_at.push(p.transition.to().is_terminal().then_some(now));
            b.halt.push(p.halt_lanes);
            b.started.push(c.attempt.started_at);
            b.ended.push(c.attempt.finished_at);
            b.outcome.push(c.attempt.class.as_str());
            b.detail.push(c.attempt.detail.clone());
            b.fee.push(c.attempt.fee);
            b.attempt_error.push(c.attempt.error.as_deref().map(truncate_error));
        }
        b
    }
}

/// Settles finished attempts inside `tx` in one statement.
async fn complete_in(
    tx: &mut PgConnection,
    completions: &[Completion],
    now: DateTime<Utc>,
) -> Result<Vec<Cas>, QueueError> {
    if completions.is_empty() {
        return Ok(Vec::new());
    }
    let batch = SettleColumns::of(completions, now);
    // One statement settles the whole batch, each row still a
    // compare-and-set on status, attempt and lease token; the attempt
    // rows are written only for the settles that applied.
    let applied: Vec<(i64, Uuid)> = sqlx::query_as(
        "WITH input AS ( \
             SELECT * FROM unnest($1::bigint[], $2::int[], $3::uuid[], $4::text[], $5::text[], $6::bool[], \
                 $7::text[], $8::text[], $9::timestamptz[], $10::int[], $11::timestamptz[]) \
             AS t(id, attempt, token, from_status, to_status, clear_receipt, receipt, error, next_at, bump, \
                 finished_at)), \
         done AS ( \
             UPDATE ops SET status = i.to_status, \
                 receipt = CASE WHEN i.clear_receipt THEN NULL ELSE COALESCE(i.receipt, ops.receipt) END, \
                 last_error = COALESCE(i.error, ops.last_error), \
                 next_attempt_at = COALESCE(i.next_at, ops.next_attempt_at), fee_bumps = ops.fee_bumps + i.bump, \
                 lease_owner = NULL, lease_token = NULL, lease_until = NULL, updated_at = $12, \
                 finished_at = i.finished_at \
             FROM input i \
             WHERE ops.id = i.id AND ops.status = i.from_status AND ops.attempts = i.attempt \
                 AND ops.lease_token = i.token \
             RETURNING i.id, i.token), \
         recorded AS ( \
             INSERT INTO attempts (op_id, attempt, started_at, finished_at, outcome, detail, fee, error) \
             SELECT a.op_id, a.attempt, a.started_at, a.finished_at, a.outcome, a.detail, a.fee, a.error \
             FROM unnest($1::bigint[], $2::int[], $3::uuid[], $13::timestamptz[], $14::timestamptz[], \
                 $15::text[], $16::text[], $17::bigint[], $18::text[]) \
                 AS a(op_id, attempt, token, started_at, finished_at, outcome, detail, fee, error) \
             JOIN done d ON d.id = a.op_id AND d.token = a.token) \
         SELECT id, token FROM done",
    )
    .bind(&batch.id)
    .bind(&batch.attempt)
    .bind(&batch.token)
    .bind(&batch.from_status)
    .bind(&batch.to_status)
    .bind(&batch.clear_receipt)
    .bind(&batch.receipt)
    .bind(&batch.error)
    .bind(&batch.next_at)
    .bind(&batch.bump)
    .bind(&batch.finished_at)
    .bind(now)
    .bind(&batch.started)
    .bind(&batch.ended)
    .bind(&batch.outcome)
    .bind(&batch.detail)
    .bind(&batch.fee)
    .bind(&batch.attempt_error)
    .fetch_all(&mut *tx)
    .await?;
    // A settle is known by its op and lease token: a batch may hold a stale
    // settle of an op beside its current one.
    let applied: std::collections::HashSet<(i64, Uuid)> = applied.into_iter().collect();
    let mut out = Vec::with_capacity(batch.id.len());
    for ((id, token), halt) in batch.id.iter().zip(&batch.token).zip(&batch.halt) {
        let done = applied.contains(&(*id, *token));
        if done && *halt {
            halt_lanes(&mut *tx, *id, now).await?;
        }
        out.push(if done { Cas::Applied } else { Cas::Stale });
    }
    Ok(out)
}

async fn halt_lanes(conn: &mut PgConnection, op_id: OpId, now: DateTime<Utc>) -> Result<(), QueueError> {
    sqlx::query(
        "INSERT INTO lane_halts (outbox, lane, op_id, halted_at) \
         SELECT o.outbox, l.lane, o.id, $1 FROM ops o JOIN op_lanes l ON l.op_id = o.id WHERE o.id = $2 \
         ON CONFLICT DO NOTHING",
    )
    .bind(now)
    .bind(op_id)
    .execute(conn)
    .await?;
    Ok(())
}

async fn insert_attempt(
    conn: &mut PgConnection,
    op_id: OpId,
    attempt: i32,
    record: &AttemptRecord,
) -> Result<(), QueueError> {
    sqlx::query(
        "INSERT INTO attempts (op_id, attempt, started_at, finished_at, outcome, detail, fee, error) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(op_id)
    .bind(attempt)
    .bind(record.started_at)
    .bind(record.finished_at)
    .bind(record.class.as_str())
    .bind(&record.detail)
    .bind(record.fee)
    .bind(record.error.as_deref().map(truncate_error))
    .execute(conn)
    .await?;
    Ok(())
}

/// The ops a claim returned, with the lease they were taken under, in
/// dispatch order (RETURNING gives none).
fn claimed_from_rows(rows: &[PgRow], token: Uuid) -> Result<Vec<Claimed>, QueueError> {
    let mut claimed = rows
        .iter()
        .map(|row| {
            op_from_row(row).map(|op| Claimed {
                lease: Lease {
                    op_id: op.id,
                    attempt: op.attempts,
                    token,
                },
                op,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    claimed.sort_by_key(|c| (c.op.priority, c.op.id));
    Ok(claimed)
}

/// Every op that occupies one of `lanes` (the occupying ops are few: the
/// `ops_occupying` index; the array overlap keeps only the ones that matter).
async fn occupants_in(conn: &mut sqlx::PgConnection, lanes: &[String]) -> Result<Vec<Occupant>, QueueError> {
    if lanes.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query(&format!(
        "SELECT {OCCUPANT_COLUMNS} FROM ops WHERE {OCCUPYING} AND lanes && $1::text[]"
    ))
    .bind(lanes)
    .fetch_all(&mut *conn)
    .await?
    .iter()
    .map(occupant_from_row)
    .collect()
}

/// A row read with [`BOOK_COLUMNS`].
fn book_row(row: &PgRow) -> Result<BookRow, QueueError> {
    let id: i64 = row.try_get("id")?;
    Ok(BookRow {
        id,
        kind: row.try_get("kind")?,
        priority: parse_priority(id, i64::from(row.try_get::<i16, _>("priority")?))?,
        lanes: row.try_get("lanes")?,
        in_flight: row.try_get("in_flight")?,
        in_doubt: row.try_get("in_doubt")?,
        next_attempt_at: row.try_get("next_attempt_at")?,
        budget_attempts: row.try_get("budget_attempts")?,
        fee_bumps: row.try_get("fee_bumps")?,
        created_at: row.try_get("created_at")?,
        subject_halted: row.try_get("subject_halted")?,
    })
}

fn occupant_from_row(row: &PgRow) -> Result<Occupant, QueueError> {
    let id: i64 = row.try_get("id")?;
    Ok(Occupant {
        id,
        outbox: row.try_get("outbox")?,
        kind: row.try_get("kind")?,
        priority: parse_priority(id, i64::from(row.try_get::<i16, _>("priority")?))?,
        lanes: row.try_get("lanes")?,
        in_flight: row.try_get("in_flight")?,
        in_doubt: row.try_get("in_doubt")?,
    })
}

/// A feed cursor as this backend makes them: "xid.seq".
fn parse_feed_cursor(cursor: &str) -> Result<(i64, i64), QueueError> {
    cursor
        .split_once('.')
        .and_then(|(x, s)| Some((x.parse().ok()?, s.parse().ok()?)))
        .ok_or_else(|| QueueError::BadCursor(cursor.to_owned()))
}

/// Reads shared payloads (`payloads`) into the ops that point at them, so
/// every reader sees the payload as enqueued whichever way it is stored.
async fn resolve_payloads<'a, 'c, E>(exec: E, ops: impl IntoIterator<Item = &'a mut Op>) -> Result<(), QueueError>
where
    E: sqlx::Executor<'c, Database = Postgres>,
{
    let mut wanting: Vec<&'a mut Op> = ops.into_iter().filter(|o| o.payload_ref.is_some()).collect();
    if wanting.is_empty() {
        return Ok(());
    }
    let mut hashes: Vec<String> = wanting.iter().filter_map(|o| o.payload_ref.clone()).collect();
    hashes.sort_unstable();
    hashes.dedup();
    let bodies: std::collections::HashMap<String, String> =
        sqlx::query_as("SELECT hash, body::text FROM payloads WHERE hash = ANY($1)")
            .bind(&hashes)
            .fetch_all(exec)
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

fn op_from_row(row: &PgRow) -> Result<Op, QueueError> {
    let id: i64 = row.try_get("id")?;
    let status: String = row.try_get("status")?;
    let lease_token: Option<Uuid> = row.try_get("lease_token")?;
    Ok(Op {
        id,
        outbox: row.try_get("outbox")?,
        kind: row.try_get("kind")?,
        priority: parse_priority(id, i64::from(row.try_get::<i16, _>("priority")?))?,
        lanes: row.try_get("lanes")?,
        payload: row.try_get("payload")?,
        payload_ref: row.try_get("payload_ref")?,
        idempotency_key: row.try_get("idempotency_key")?,
        coalesce_key: row.try_get("coalesce_key")?,
        subject: row.try_get("subject")?,
        correlation_id: row.try_get("correlation_id")?,
        status: parse_status(id, &status)?,
        attempts: row.try_get("attempts")?,
        attempt_floor: row.try_get("attempt_floor")?,
        fee_bumps: row.try_get("fee_bumps")?,
        next_attempt_at: row.try_get("next_attempt_at")?,
        lease_owner: row.try_get("lease_owner")?,
        lease_token,
        lease_until: row.try_get("lease_until")?,
        receipt: row.try_get("receipt")?,
        last_error: row.try_get("last_error")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
        finished_at: row.try_get("finished_at")?,
    })
}
