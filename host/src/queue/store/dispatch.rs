//! Dispatch: the drain's book and the lane guard, claims under a lease,
//! settles, lease compare-and-sets and expiry, drain slots and host shares.
//! Every status a statement here expects or writes is bound from the state
//! machine ([`Transition`]).

use std::collections::BTreeSet;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::{book_row, occupant_from_row, ops_from_rows, reader, sql, Conn, Conns, Query, Store};
use crate::lanes::LaneRules;
use crate::op::{truncate_error, AttemptClass, AttemptRecord, Lease, OpId, Priority, Status, Transition};
use crate::queue::codec::{get, List, Rank, St, Token, Ts};
use crate::queue::dialect::{Dialect, Round, RoundResult};
use crate::queue::policy::{
    admit_claims, cas, chrono_duration, expire_params, host_share, scan_sql, still_claimable, ScanOrder,
};
use crate::queue::{
    new_token, BookRow, Cas, Claimed, Completion, DispatchStore, ExpireTo, Finish, HostShare, LeaseSpec, Occupant,
    QueueError, Redeal, SlotLease,
};

/// The status an op holds its lease in: what every lease compare-and-set
/// expects.
const LEASED: Status = Transition::Claim.to();

/// The status of an op waiting to be claimed.
const WAITING: Status = Transition::Claim.from();

impl Store {
    /// Settles, then claims what is still claimable, inside `conn`'s
    /// transaction: the body of [`DispatchStore::settle_then_claim`], for
    /// one round or (the host's committer) several as one.
    pub(crate) async fn apply_round(&self, conn: &mut Conn, round: &Round) -> RoundResult {
        let now = self.now();
        let settled = Conns::settle(&mut *conn, &round.completions, now).await?;
        for (c, done) in round.completions.iter().zip(&settled) {
            if done.applied() && matches!(c.finish, Finish::Fail { halt_lanes: true, .. }) {
                hold_lanes(&mut *conn, c.lease.op_id, now).await?;
            }
        }
        let ids = still_claimable(&round.ids, &round.follows, &round.completions, &settled);
        let claimed = self.claim_ids_in(&mut *conn, &ids, &round.lease, &round.rules).await?;
        Ok((settled, claimed))
    }

    /// Claims those of `ids` that are still pending and due and whose lanes
    /// admit them (the lane rule against every occupant), inside `conn`'s
    /// transaction.
    async fn claim_ids_in(
        &self,
        conn: &mut Conn,
        ids: &[OpId],
        lease: &LeaseSpec,
        rules: &LaneRules,
    ) -> Result<Vec<Claimed>, QueueError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let now = self.now();
        // The rows first (PostgreSQL skips another claimer's, never waits),
        // then the lanes another transaction is claiming right now, then
        // every op that occupies one of the lanes.
        let picked = sqlx::query(sql::dispatch::PICK_CLAIMABLE)
            .bind(List(ids.to_vec()))
            .bind(St(Transition::Claim.from()))
            .bind(Ts(now))
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(occupant_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        let lanes: Vec<String> = picked
            .iter()
            .flat_map(|o| &o.lanes)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .cloned()
            .collect();
        let contended = Conns::contended(&mut *conn, &lanes).await?;
        let occupants = occupants_in(&mut *conn, &lanes).await?;
        let admitted = admit_claims(&picked, &occupants, rules, &contended);
        if admitted.is_empty() {
            return Ok(Vec::new());
        }
        let token = new_token();
        let rows = sqlx::query(sql::dispatch::CLAIM)
            .bind(St(Transition::Claim.to()))
            .bind(&lease.owner)
            .bind(Token(token))
            .bind(Ts(now + chrono_duration(lease.duration)))
            .bind(Ts(now))
            .bind(List(admitted))
            .bind(St(Transition::Claim.from()))
            .fetch_all(&mut *conn)
            .await?;
        let mut claimed: Vec<Claimed> = ops_from_rows(&mut *conn, &rows)
            .await?
            .into_iter()
            .map(|op| Claimed {
                lease: Lease {
                    op_id: op.id,
                    attempt: op.attempts,
                    token,
                },
                op,
            })
            .collect();
        // RETURNING gives no order; callers get dispatch order.
        claimed.sort_by_key(|c| (c.op.priority, c.op.id));
        Ok(claimed)
    }

    /// Applies a lease compare-and-set statement (binds: its own values,
    /// then id, expected status, attempt, token) to each lease in one
    /// transaction.
    async fn each_lease(
        &self,
        leases: &[Lease],
        statement: &'static str,
        bind: impl for<'q> Fn(Query<'q>) -> Query<'q>,
    ) -> Result<Vec<Cas>, QueueError> {
        let mut tx = self.conns.write().await?;
        let mut out = Vec::with_capacity(leases.len());
        for lease in leases {
            let done = bind(sqlx::query(statement))
                .bind(lease.op_id)
                .bind(St(LEASED))
                .bind(lease.attempt)
                .bind(Token(lease.token))
                .execute(&mut *tx)
                .await?;
            out.push(cas(done.rows_affected()));
        }
        tx.commit().await?;
        Ok(out)
    }
}

/// Every op that occupies one of `lanes`, in any outbox.
async fn occupants_in(conn: &mut Conn, lanes: &[String]) -> Result<Vec<Occupant>, QueueError> {
    if lanes.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query(sql::dispatch::OCCUPANTS)
        .bind(List(lanes.to_vec()))
        .fetch_all(&mut *conn)
        .await?
        .iter()
        .map(occupant_from_row)
        .collect()
}

/// A dead letter's hold on its lanes (`poison = "halt"`), in the
/// transaction that dead-letters it. A failure here fails the settle: the
/// lanes must never be left open behind a dead letter that should hold them.
pub(crate) async fn hold_lanes(conn: &mut Conn, op_id: OpId, now: DateTime<Utc>) -> Result<(), QueueError> {
    sqlx::query(sql::dispatch::HOLD_LANES)
        .bind(Ts(now))
        .bind(op_id)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Records one attempt row.
pub(crate) async fn insert_attempt(
    conn: &mut Conn,
    op_id: OpId,
    attempt: i32,
    record: &AttemptRecord,
) -> Result<(), QueueError> {
    sqlx::query(sql::dispatch::INSERT_ATTEMPT)
        .bind(op_id)
        .bind(attempt)
        .bind(Ts(record.started_at))
        .bind(Ts(record.finished_at))
        .bind(record.class.as_str())
        .bind(&record.detail)
        .bind(record.fee)
        .bind(record.error.as_deref().map(truncate_error))
        .execute(&mut *conn)
        .await?;
    Ok(())
}

#[async_trait]
impl DispatchStore for Store {
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
        let round = Round {
            completions: completions.to_vec(),
            ids: ids.to_vec(),
            follows: follows.to_vec(),
            lease: lease.clone(),
            rules: rules.clone(),
        };
        match self.conns.hand_off(round).await {
            Ok(result) => result,
            Err(round) => {
                let mut tx = self.conns.write().await?;
                let result = self.apply_round(&mut tx, &round).await?;
                tx.commit().await?;
                Ok(result)
            }
        }
    }

    async fn scan(&self, outbox: &str, after: Option<OpId>, limit: u32) -> Result<Vec<BookRow>, QueueError> {
        // From a position: what was enqueued since; from the start: the
        // whole book in dispatch order.
        let order = if after.is_some() {
            ScanOrder::Enqueue
        } else {
            ScanOrder::Dispatch
        };
        let statement = scan_sql(sql::dispatch::SCAN_TIER, Priority::Critical, order);
        self.read_book(
            outbox,
            sqlx::query(&statement)
                .bind(outbox)
                .bind(after.unwrap_or(0))
                .bind(i64::from(limit)),
        )
        .await
    }

    async fn scan_beyond(
        &self,
        outbox: &str,
        from: (Priority, OpId),
        per_set: u32,
        limit: u32,
    ) -> Result<Vec<BookRow>, QueueError> {
        self.read_book(
            outbox,
            sqlx::query(sql::dispatch::SCAN_BEYOND)
                .bind(outbox)
                .bind(Rank(from.0))
                .bind(from.1)
                .bind(i64::from(per_set))
                .bind(i64::from(limit)),
        )
        .await
    }

    async fn occupants(&self, lanes: &[String]) -> Result<Vec<Occupant>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        occupants_in(&mut conn, lanes).await
    }

    async fn checkpoint(&self, lease: &Lease, receipt: &str) -> Result<Cas, QueueError> {
        let now = Ts(self.now());
        let results = self
            .each_lease(std::slice::from_ref(lease), sql::dispatch::CHECKPOINT, |q| {
                q.bind(receipt.to_owned()).bind(now)
            })
            .await?;
        Ok(results.first().copied().unwrap_or(Cas::Stale))
    }

    async fn defer(&self, id: OpId, until: DateTime<Utc>) -> Result<Cas, QueueError> {
        let done = self
            .write_one(
                sqlx::query(sql::dispatch::DEFER)
                    .bind(Ts(until))
                    .bind(Ts(self.now()))
                    .bind(id)
                    .bind(St(WAITING)),
            )
            .await?;
        Ok(cas(done))
    }

    async fn redeal(&self, moves: &[Redeal]) -> Result<Vec<OpId>, QueueError> {
        if moves.is_empty() {
            return Ok(Vec::new());
        }
        let now = Ts(self.now());
        // In id order, as every multi-row writer locks, so two never wait
        // on each other in a cycle.
        let mut moves: Vec<&Redeal> = moves.iter().filter(|m| m.from != m.to).collect();
        moves.sort_by_key(|m| m.op);
        let mut tx = self.conns.write().await?;
        let mut moved = Vec::new();
        for m in moves {
            let waiting = sqlx::query(sql::dispatch::LOCK_REDEALABLE)
                .bind(m.op)
                .bind(St(WAITING))
                .bind(&m.from)
                .fetch_optional(&mut *tx)
                .await?;
            if waiting.is_none() {
                continue;
            }
            sqlx::query(sql::dispatch::RECORD_REDEAL)
                .bind(m.op)
                .bind(&m.from)
                .bind(&m.to)
                .bind(now)
                .execute(&mut *tx)
                .await?;
            let done = sqlx::query(sql::dispatch::REDEAL)
                .bind(m.op)
                .bind(&m.from)
                .bind(&m.to)
                .bind(now)
                .bind(St(WAITING))
                .execute(&mut *tx)
                .await?;
            if done.rows_affected() != 1 {
                // Locked above: cannot happen; never commit a record of a
                // move that was not made.
                return Err(QueueError::InvalidOp(format!(
                    "op {}: re-deal found the row moved on",
                    m.op
                )));
            }
            sqlx::query(sql::dispatch::DROP_OP_LANE)
                .bind(m.op)
                .bind(&m.from)
                .execute(&mut *tx)
                .await?;
            sqlx::query(sql::dispatch::ADD_OP_LANE)
                .bind(m.op)
                .bind(&m.to)
                .execute(&mut *tx)
                .await?;
            moved.push(m.op);
        }
        tx.commit().await?;
        Ok(moved)
    }

    async fn extend_leases(&self, leases: &[Lease], duration: Duration) -> Result<Vec<Cas>, QueueError> {
        let until = Ts(self.now() + chrono_duration(duration));
        self.each_lease(leases, sql::dispatch::EXTEND_LEASE, |q| q.bind(until))
            .await
    }

    async fn expired_leases(&self, limit: u32) -> Result<Vec<Claimed>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let rows = sqlx::query(sql::dispatch::EXPIRED_LEASES)
            .bind(Ts(self.now()))
            .bind(i64::from(limit))
            .fetch_all(&mut *conn)
            .await?;
        Ok(ops_from_rows(&mut conn, &rows)
            .await?
            .into_iter()
            .filter_map(|op| op.lease().map(|lease| Claimed { op, lease }))
            .collect())
    }

    async fn expire(&self, lease: &Lease, to: ExpireTo) -> Result<Cas, QueueError> {
        let now = self.now();
        let (transition, next_attempt_at, halt) = expire_params(to, now);
        let mut tx = self.conns.write().await?;
        // The row as claimed (when, by whom) first, for the attempt row; then
        // the change, a compare-and-set on the same lease (PostgreSQL holds
        // the row locked in between; SQLite has one writer).
        let claimed = sqlx::query(sql::dispatch::EXPIRING_LEASE)
            .bind(lease.op_id)
            .bind(St(transition.from()))
            .bind(lease.attempt)
            .bind(Token(lease.token))
            .fetch_optional(&mut *tx)
            .await?;
        let Some(claimed) = claimed else {
            tx.rollback().await?;
            return Ok(Cas::Stale);
        };
        let claimed_at = get::<Ts, _>(&claimed, lease.op_id, "updated_at")?.0;
        let owner: Option<String> = get(&claimed, lease.op_id, "lease_owner")?;
        let done = sqlx::query(sql::dispatch::EXPIRE)
            .bind(St(transition.to()))
            .bind(Ts(next_attempt_at))
            .bind("lease expired")
            .bind(Ts(now))
            .bind(transition.to().is_terminal().then_some(Ts(now)))
            .bind(lease.op_id)
            .bind(St(transition.from()))
            .bind(lease.attempt)
            .bind(Token(lease.token))
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() != 1 {
            tx.rollback().await?;
            return Ok(Cas::Stale);
        }
        let record = AttemptRecord {
            started_at: claimed_at,
            finished_at: now,
            class: AttemptClass::LeaseExpired,
            detail: None,
            fee: None,
            error: Some(format!("lease held by {} expired", owner.as_deref().unwrap_or("?"))),
        };
        insert_attempt(&mut tx, lease.op_id, lease.attempt, &record).await?;
        if halt {
            hold_lanes(&mut tx, lease.op_id, now).await?;
        }
        tx.commit().await?;
        Ok(Cas::Applied)
    }

    async fn due_outboxes(&self, limit: u32) -> Result<Vec<String>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        Ok(sqlx::query_scalar(sql::dispatch::DUE_OUTBOXES)
            .bind(Ts(self.now()))
            .bind(i64::from(limit))
            .fetch_all(&mut *conn)
            .await?)
    }

    async fn acquire_slot(&self, outbox: &str, owner: &str, ttl: Duration) -> Result<Option<SlotLease>, QueueError> {
        let now = self.now();
        let token = new_token();
        let mut tx = self.conns.write().await?;
        let taken: Option<Token> = sqlx::query_scalar(sql::dispatch::ACQUIRE_SLOT)
            .bind(outbox)
            .bind(owner)
            .bind(Token(token))
            .bind(Ts(now + chrono_duration(ttl)))
            .bind(Ts(now))
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(taken.map(|_| SlotLease {
            outbox: outbox.to_owned(),
            token,
        }))
    }

    async fn renew_slot(&self, slot: &SlotLease, ttl: Duration) -> Result<Cas, QueueError> {
        let done = self
            .write_one(
                sqlx::query(sql::dispatch::RENEW_SLOT)
                    .bind(Ts(self.now() + chrono_duration(ttl)))
                    .bind(&slot.outbox)
                    .bind(Token(slot.token)),
            )
            .await?;
        Ok(cas(done))
    }

    async fn release_slot(&self, slot: &SlotLease) -> Result<(), QueueError> {
        self.write_one(
            sqlx::query(sql::dispatch::RELEASE_SLOT)
                .bind(&slot.outbox)
                .bind(Token(slot.token)),
        )
        .await?;
        Ok(())
    }

    async fn heartbeat(&self, owner: &str, ttl: Duration) -> Result<HostShare, QueueError> {
        let now = self.now();
        let mut tx = self.conns.write().await?;
        sqlx::query(sql::dispatch::ANNOUNCE_HOST)
            .bind(owner)
            .bind(Ts(now + chrono_duration(ttl)))
            .execute(&mut *tx)
            .await?;
        sqlx::query(sql::dispatch::FORGET_HOSTS)
            .bind(Ts(now))
            .execute(&mut *tx)
            .await?;
        let row = sqlx::query(sql::dispatch::HOST_SHARE)
            .bind(Ts(now))
            .bind(owner)
            .fetch_one(&mut *tx)
            .await?;
        let share = host_share(get(&row, 0, "hosts")?, get(&row, 0, "slots")?, get(&row, 0, "mine")?);
        tx.commit().await?;
        Ok(share)
    }
}

impl Store {
    /// Runs a read of `outbox`'s book rows (the dialect's `book_columns`) on
    /// a reader, below the outbox's horizon: asked first, in a statement of
    /// its own (before the read's snapshot), and bound as the read's last
    /// parameter.
    async fn read_book(&self, outbox: &str, query: Query<'_>) -> Result<Vec<BookRow>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let horizon = Conns::ops_horizon(&mut conn, outbox).await?;
        query
            .bind(horizon)
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(book_row)
            .collect()
    }
}
