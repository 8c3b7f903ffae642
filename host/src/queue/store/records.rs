//! Shared records (versioned JSON values hosts change by compare-and-set),
//! one-host-at-a-time leases, feed cursors and fee snapshots.

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::{reader, record_from_row, sql, Conn, Store};
use crate::queue::codec::{get, List, Ts};
use crate::queue::dialect::{Dialect, RecordPut};
use crate::queue::policy::{cas, chrono_duration};
use crate::queue::{Cas, Expect, QueueError, Record, RecordStore};

impl Store {
    /// A record write inside `conn`'s transaction: the committer's, or one
    /// of its own.
    pub(crate) async fn apply_put(&self, conn: &mut Conn, put: &RecordPut) -> Result<Cas, QueueError> {
        let (statement, version) = match put.expect {
            Expect::Absent => (sql::records::INSERT_RECORD, None),
            Expect::Version(v) => (sql::records::UPDATE_RECORD, Some(v)),
            Expect::Any => (sql::records::UPSERT_RECORD, None),
        };
        let mut query = sqlx::query(statement)
            .bind(&put.namespace)
            .bind(&put.key)
            .bind(&put.value)
            .bind(Ts(self.now()));
        if let Some(version) = version {
            query = query.bind(version);
        }
        Ok(cas(query.execute(&mut *conn).await?.rows_affected()))
    }
}

#[async_trait]
impl RecordStore for Store {
    async fn record(&self, namespace: &str, key: &str) -> Result<Option<Record>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let row = sqlx::query(sql::records::RECORD)
            .bind(namespace)
            .bind(key)
            .fetch_optional(&mut *conn)
            .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    async fn records(&self, namespace: &str, keys: Option<&[String]>) -> Result<Vec<Record>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let rows = match keys {
            None => {
                sqlx::query(sql::records::RECORDS)
                    .bind(namespace)
                    .fetch_all(&mut *conn)
                    .await?
            }
            Some([]) => return Ok(Vec::new()),
            Some(keys) => {
                sqlx::query(sql::records::RECORDS_BY_KEYS)
                    .bind(namespace)
                    .bind(List(keys.to_vec()))
                    .fetch_all(&mut *conn)
                    .await?
            }
        };
        rows.iter().map(record_from_row).collect()
    }

    async fn put_record(&self, namespace: &str, key: &str, value: &str, expect: Expect) -> Result<Cas, QueueError> {
        let put = RecordPut {
            namespace: namespace.to_owned(),
            key: key.to_owned(),
            value: value.to_owned(),
            expect,
        };
        match self.conns.hand_off_put(put).await {
            Ok(done) => done,
            Err(put) => {
                let mut tx = self.conns.write().await?;
                let done = self.apply_put(&mut tx, &put).await?;
                tx.commit().await?;
                Ok(done)
            }
        }
    }

    async fn delete_record(&self, namespace: &str, key: &str, expect: Expect) -> Result<Cas, QueueError> {
        let version = match expect {
            Expect::Absent => return Ok(Cas::Stale),
            Expect::Version(v) => Some(v),
            Expect::Any => None,
        };
        let done = self
            .write_one(
                sqlx::query(sql::records::DELETE_RECORD)
                    .bind(namespace)
                    .bind(key)
                    .bind(version),
            )
            .await?;
        Ok(cas(done))
    }

    async fn hold_singleton(&self, name: &str, owner: &str, ttl: std::time::Duration) -> Result<bool, QueueError> {
        let now = self.now();
        let mut tx = self.conns.write().await?;
        let held: Option<String> = sqlx::query_scalar(sql::records::HOLD_SINGLETON)
            .bind(name)
            .bind(owner)
            .bind(Ts(now + chrono_duration(ttl)))
            .bind(Ts(now))
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(held.is_some())
    }

    async fn feed_cursor(&self, name: &str) -> Result<Option<String>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        Ok(sqlx::query_scalar(sql::records::FEED_CURSOR)
            .bind(name)
            .fetch_optional(&mut *conn)
            .await?)
    }

    async fn set_feed_cursor(&self, name: &str, cursor: &str) -> Result<(), QueueError> {
        self.write_one(sqlx::query(sql::records::SET_FEED_CURSOR).bind(name).bind(cursor))
            .await?;
        Ok(())
    }

    async fn put_fee_snapshot(
        &self,
        oracle: &str,
        snapshot: &str,
        sampled_at: DateTime<Utc>,
    ) -> Result<Cas, QueueError> {
        let done = self
            .write_one(
                sqlx::query(sql::records::PUT_FEE_SNAPSHOT)
                    .bind(oracle)
                    .bind(snapshot)
                    .bind(Ts(sampled_at)),
            )
            .await?;
        Ok(cas(done))
    }

    async fn fee_snapshot(&self, oracle: &str) -> Result<Option<(String, DateTime<Utc>)>, QueueError> {
        let mut conn = reader(&self.conns).await?;
        let row = sqlx::query(sql::records::FEE_SNAPSHOT)
            .bind(oracle)
            .fetch_optional(&mut *conn)
            .await?;
        row.map(|row| Ok((get(&row, 0, "snapshot")?, get::<Ts, _>(&row, 0, "sampled_at")?.0)))
            .transpose()
    }
}
