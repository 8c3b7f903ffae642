//! Operators: changes to one op (a compare-and-set on its status), bulk
//! retries of dead letters, lane holds, halted subjects, pauses, API keys,
//! the audit log, and the counts `/metrics` and `/stats` read.

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::{api_key_from_row, attempt_class, ops_from_rows, reader, sql, Store};
use crate::op::{Op, OpId, Transition};
use crate::queue::codec::{get, List, Rank, St, Times, Ts};
use crate::queue::dialect::Dialect;
use crate::queue::policy::{
    api_key_name_taken, is_unique_violation, json_column, json_from_column, pause_scope, refusal, scopes_column,
};
use crate::queue::{
    ApiKey, AuditEntry, DeadLetterGroup, HaltedSubject, LaneHalt, Latency, NewApiKey, NewAuditEntry, OldestDue,
    OperatorStore, Pause, PauseScope, QueueError, QueueGauges,
};

impl Store {
    /// An operator's change of one op: `statement` binds (new status, now,
    /// id, expected status), both from `transition`, and returns the op.
    /// When it matches nothing, the op is read again to say why.
    async fn operator_change(&self, id: OpId, transition: Transition, statement: &str) -> Result<Op, QueueError> {
        let mut tx = self.conns.write().await?;
        let row = sqlx::query(statement)
            .bind(St(transition.to()))
            .bind(Ts(self.now()))
            .bind(id)
            .bind(St(transition.from()))
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
            let op = ops_from_rows(&mut tx, std::slice::from_ref(&row)).await?.pop();
            if transition == Transition::ForceRetry {
                // A retried dead letter is its lanes' head again.
                sqlx::query(sql::operator::UNHOLD_LANES_OF_OPS)
                    .bind(List(vec![id]))
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            return op.ok_or(QueueError::NotFound(id));
        }
        let found = sqlx::query(sql::operator::STATUS_OF_OP)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        tx.rollback().await?;
        let found = match found {
            Some(row) => Some((get::<St, _>(&row, id, "status")?.0, get(&row, id, "in_doubt")?)),
            None => None,
        };
        Err(refusal(id, found, transition))
    }
}

#[async_trait]
impl OperatorStore for Store {
    async fn cancel(&self, id: OpId) -> Result<Op, QueueError> {
        self.operator_change(id, Transition::Cancel, sql::operator::CANCEL)
            .await
    }

    async fn force_retry(&self, id: OpId) -> Result<Op, QueueError> {
        self.operator_change(id, Transition::ForceRetry, sql::operator::FORCE_RETRY)
            .await
    }

    async fn retry_dead_letters(&self, due: &[(OpId, DateTime<Utc>)]) -> Result<Vec<OpId>, QueueError> {
        let t = Transition::ForceRetry;
        let mut tx = self.conns.write().await?;
        let retried: Vec<OpId> = sqlx::query_scalar(sql::operator::RETRY_DEAD_LETTERS)
            .bind(St(t.to()))
            .bind(Ts(self.now()))
            .bind(List(due.iter().map(|(id, _)| *id).collect()))
            .bind(Times(due.iter().map(|(_, at)| *at).collect()))
            .bind(St(t.from()))
            .fetch_all(&mut *tx)
            .await?;
        sqlx::query(sql::operator::UNHOLD_LANES_OF_OPS)
            .bind(List(retried.clone()))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        // In the order asked for, whatever order the database returned.
        let retried: std::collections::HashSet<OpId> = retried.into_iter().collect();
        Ok(due
            .iter()
            .map(|(id, _)| *id)
            .filter(|id| retried.contains(id))
            .collect())
    }

    async fn lane_halts(&self, outbox: Option<&str>) -> Result<Vec<LaneHalt>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let rows = sqlx::query(sql::operator::LANE_HALTS)
            .bind(outbox)
            .fetch_all(&mut *conn)
            .await?;
        rows.iter().map(lane_halt).collect()
    }

    async fn lane_halts_page(
        &self,
        outbox: Option<&str>,
        after: Option<(&str, &str, OpId)>,
        limit: u32,
    ) -> Result<Vec<LaneHalt>, QueueError> {
        let (after_outbox, after_lane, after_op) = after.unwrap_or(("", "", 0));
        let mut conn = reader(&self.conns).await?;
        let rows = sqlx::query(sql::operator::LANE_HALTS_PAGE)
            .bind(outbox)
            .bind(after_outbox)
            .bind(after_lane)
            .bind(after_op)
            .bind(i64::from(limit))
            .fetch_all(&mut *conn)
            .await?;
        rows.iter().map(lane_halt).collect()
    }

    async fn skip_lane(&self, outbox: &str, lane: &str) -> Result<u64, QueueError> {
        self.write_one(sqlx::query(sql::operator::SKIP_LANE).bind(outbox).bind(lane))
            .await
    }

    async fn halt_subject(&self, subject: &str, reason: Option<&str>) -> Result<(), QueueError> {
        self.write_one(
            sqlx::query(sql::operator::HALT_SUBJECT)
                .bind(subject)
                .bind(reason)
                .bind(Ts(self.now())),
        )
        .await?;
        Ok(())
    }

    async fn unhalt_subject(&self, subject: &str) -> Result<bool, QueueError> {
        let done = self
            .write_one(sqlx::query(sql::operator::UNHALT_SUBJECT).bind(subject))
            .await?;
        Ok(done > 0)
    }

    async fn halted_subjects(&self) -> Result<Vec<HaltedSubject>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let rows = sqlx::query(sql::operator::HALTED_SUBJECTS)
            .fetch_all(&mut *conn)
            .await?;
        rows.iter()
            .map(|row| {
                Ok(HaltedSubject {
                    subject: get(row, 0, "subject")?,
                    reason: get(row, 0, "reason")?,
                    halted_at: get::<Ts, _>(row, 0, "halted_at")?.0,
                })
            })
            .collect()
    }

    async fn create_api_key(&self, key: &NewApiKey) -> Result<ApiKey, QueueError> {
        let now = self.now();
        let mut tx = self.conns.write().await?;
        let done = sqlx::query(sql::operator::INSERT_API_KEY)
            .bind(&key.id)
            .bind(&key.name)
            .bind(&key.secret_hash)
            .bind(scopes_column(&key.scopes))
            .bind(Ts(now))
            .execute(&mut *tx)
            .await;
        match done {
            Err(e) if is_unique_violation(&e) => return Err(api_key_name_taken(&key.name)),
            other => other?,
        };
        tx.commit().await?;
        Ok(ApiKey {
            id: key.id.clone(),
            name: key.name.clone(),
            scopes: key.scopes.clone(),
            created_at: now,
            revoked_at: None,
        })
    }

    async fn api_keys(&self) -> Result<Vec<ApiKey>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let rows = sqlx::query(sql::operator::API_KEYS).fetch_all(&mut *conn).await?;
        rows.iter().map(api_key_from_row).collect()
    }

    async fn api_key(&self, id: &str) -> Result<Option<(ApiKey, Vec<u8>)>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let row = sqlx::query(sql::operator::API_KEY)
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
        row.map(|row| Ok((api_key_from_row(&row)?, get(&row, 0, "secret_hash")?)))
            .transpose()
    }

    async fn revoke_api_key(&self, name: &str) -> Result<bool, QueueError> {
        let done = self
            .write_one(
                sqlx::query(sql::operator::REVOKE_API_KEY)
                    .bind(Ts(self.now()))
                    .bind(name),
            )
            .await?;
        Ok(done == 1)
    }

    async fn record_audit(&self, entry: &NewAuditEntry) -> Result<(), QueueError> {
        self.write_one(
            sqlx::query(sql::operator::INSERT_AUDIT)
                .bind(Ts(self.now()))
                .bind(&entry.actor)
                .bind(&entry.action)
                .bind(&entry.target)
                .bind(json_column(entry.before.as_ref()))
                .bind(json_column(entry.after.as_ref())),
        )
        .await?;
        Ok(())
    }

    async fn audit_log(&self, before: Option<i64>, limit: u32) -> Result<Vec<AuditEntry>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let rows = sqlx::query(sql::operator::AUDIT_LOG)
            .bind(before)
            .bind(i64::from(limit))
            .fetch_all(&mut *conn)
            .await?;
        rows.iter()
            .map(|row| {
                let id: i64 = get(row, 0, "id")?;
                Ok(AuditEntry {
                    id,
                    at: get::<Ts, _>(row, id, "at")?.0,
                    actor: get(row, id, "actor")?,
                    action: get(row, id, "action")?,
                    target: get(row, id, "target")?,
                    before: json_from_column(id, "audit_log.before", get(row, id, "before")?)?,
                    after: json_from_column(id, "audit_log.after", get(row, id, "after")?)?,
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
        let done = self
            .write_one(
                sqlx::query(sql::operator::INSERT_PAUSE)
                    .bind(scope.as_str())
                    .bind(target)
                    .bind(reason)
                    .bind(actor)
                    .bind(Ts(self.now())),
            )
            .await?;
        Ok(done == 1)
    }

    async fn resume(&self, scope: PauseScope, target: &str) -> Result<bool, QueueError> {
        let done = self
            .write_one(
                sqlx::query(sql::operator::DELETE_PAUSE)
                    .bind(scope.as_str())
                    .bind(target),
            )
            .await?;
        Ok(done == 1)
    }

    async fn pauses(&self) -> Result<Vec<Pause>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let rows = sqlx::query(sql::operator::PAUSES).fetch_all(&mut *conn).await?;
        rows.iter()
            .map(|row| {
                let scope: String = get(row, 0, "scope")?;
                Ok(Pause {
                    scope: pause_scope(&scope)?,
                    target: get(row, 0, "target")?,
                    reason: get(row, 0, "reason")?,
                    actor: get(row, 0, "actor")?,
                    paused_at: get::<Ts, _>(row, 0, "paused_at")?.0,
                })
            })
            .collect()
    }

    async fn gauges(&self) -> Result<QueueGauges, QueueError> {
        let now = Ts(self.now());
        let mut conn = reader(&self.conns).await?;
        let row = sqlx::query(sql::operator::GAUGE_COUNTS)
            .bind(now)
            .fetch_one(&mut *conn)
            .await?;
        let rows = sqlx::query(sql::operator::OLDEST_DUE)
            .bind(now)
            .fetch_all(&mut *conn)
            .await?;
        let oldest_due = rows
            .iter()
            .map(|r| {
                Ok(OldestDue {
                    kind: get(r, 0, "kind")?,
                    outbox: get(r, 0, "outbox")?,
                    due_at: get::<Ts, _>(r, 0, "due")?.0,
                })
            })
            .collect::<Result<_, QueueError>>()?;
        Ok(QueueGauges {
            stuck_submitted: get(&row, 0, "stuck")?,
            lanes_held: get(&row, 0, "held")?,
            subjects_halted: get(&row, 0, "halted")?,
            oldest_due,
        })
    }

    async fn dead_letter_groups(&self) -> Result<Vec<DeadLetterGroup>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let rows = sqlx::query(sql::operator::DEAD_LETTER_GROUPS)
            .bind(St(Transition::Fail.to()))
            .fetch_all(&mut *conn)
            .await?;
        rows.iter()
            .map(|r| {
                let newest: OpId = get(r, 0, "newest")?;
                let class: Option<String> = get(r, newest, "class")?;
                Ok(DeadLetterGroup {
                    kind: get(r, newest, "kind")?,
                    class: class.map(|c| attempt_class(newest, c)).transpose()?,
                    unknown: get(r, newest, "unknown")?,
                    count: get(r, newest, "n")?,
                    newest,
                })
            })
            .collect()
    }

    async fn recent_latencies(&self, since: DateTime<Utc>, limit: u32) -> Result<Vec<Latency>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let rows = sqlx::query(sql::operator::RECENT_LATENCIES)
            .bind(Ts(since))
            .bind(i64::from(limit))
            .bind(St(Transition::Confirm.to()))
            .fetch_all(&mut *conn)
            .await?;
        rows.iter()
            .map(|r| {
                let id: OpId = get(r, 0, "id")?;
                let millis: i64 = get(r, id, "ms")?;
                Ok(Latency {
                    kind: get(r, id, "kind")?,
                    priority: get::<Rank, _>(r, id, "priority")?.0,
                    #[allow(clippy::cast_precision_loss)]
                    seconds: millis.max(0) as f64 / 1000.0,
                })
            })
            .collect()
    }
}

/// A held lane as read.
fn lane_halt(row: &super::Row) -> Result<LaneHalt, QueueError> {
    let op_id: OpId = get(row, 0, "op_id")?;
    Ok(LaneHalt {
        outbox: get(row, op_id, "outbox")?,
        lane: get(row, op_id, "lane")?,
        op_id,
        halted_at: get::<Ts, _>(row, op_id, "halted_at")?.0,
    })
}
