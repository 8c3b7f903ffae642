//! Tests that need a backend's own API: enqueue inside the caller's
//! transaction, the SQL contract for plain-SQL producers, and schema checks
//! against a database this binary did not migrate.

use anyhow::{ensure, Context};
use laneway::op::Status;
use laneway::queue::{Enqueued, NewOp, OpFilter, QueueError};

use crate::support::{self, TestBackend};

fn announce(n: u32) -> NewOp {
    let mut op = NewOp::new("case-manager", "activitypub", format!(r#"{{"entry":{n}}}"#));
    op.lanes = vec!["https://coord.example/inbox".into()];
    op
}

#[tokio::test]
async fn sqlite_enqueue_commits_and_rolls_back_with_the_business_row() -> anyhow::Result<()> {
    let db = support::sqlite().await?;
    let TestBackend::Sqlite(queue) = &db.kind else {
        anyhow::bail!("not sqlite")
    };
    sqlx::query("CREATE TABLE ledger (id INTEGER PRIMARY KEY, entry INTEGER NOT NULL)")
        .execute(queue.pool())
        .await?;

    let mut tx = queue.begin().await?;
    sqlx::query("INSERT INTO ledger (entry) VALUES (1)")
        .execute(&mut *tx)
        .await?;
    let rolled_back = queue.enqueue_in(&mut tx, &[announce(1)]).await?;
    tx.rollback().await?;

    let mut tx = queue.begin().await?;
    sqlx::query("INSERT INTO ledger (entry) VALUES (2)")
        .execute(&mut *tx)
        .await?;
    let committed = queue.enqueue_in(&mut tx, &[announce(2)]).await?;
    tx.commit().await?;

    let ops = db
        .queue
        .list(&OpFilter {
            limit: 10,
            ..OpFilter::default()
        })
        .await?;
    ensure!(ops.len() == 1 && ops[0].payload == r#"{"entry":2}"#, "{ops:?}");
    ensure!(matches!(committed.as_slice(), [Enqueued::Created(id)] if *id == ops[0].id));
    // SQLite hands a rolled-back id out again; what matters is that only the
    // committed payload exists.
    ensure!(rolled_back.len() == 1);
    let entries: Vec<i64> = sqlx::query_scalar("SELECT entry FROM ledger")
        .fetch_all(queue.pool())
        .await?;
    ensure!(entries == vec![2]);
    Ok(())
}

#[tokio::test]
async fn postgres_enqueue_commits_and_rolls_back_with_the_business_row() -> anyhow::Result<()> {
    let db = support::postgres().await?;
    let TestBackend::Postgres(queue) = &db.kind else {
        anyhow::bail!("not postgres")
    };
    sqlx::query("CREATE TABLE ledger (id BIGSERIAL PRIMARY KEY, entry INTEGER NOT NULL)")
        .execute(queue.pool())
        .await?;

    let mut tx = queue.begin().await?;
    sqlx::query("INSERT INTO ledger (entry) VALUES (1)")
        .execute(&mut *tx)
        .await?;
    let rolled_back = queue.enqueue_in(&mut tx, &[announce(1)]).await?;
    tx.rollback().await?;

    let mut tx = queue.begin().await?;
    sqlx::query("INSERT INTO ledger (entry) VALUES (2)")
        .execute(&mut *tx)
        .await?;
    queue.enqueue_in(&mut tx, &[announce(2)]).await?;
    tx.commit().await?;

    let ops = db
        .queue
        .list(&OpFilter {
            limit: 10,
            ..OpFilter::default()
        })
        .await?;
    ensure!(ops.len() == 1 && ops[0].payload == r#"{"entry":2}"#, "{ops:?}");
    ensure!(
        db.queue.get(rolled_back[0].id()).await?.is_none(),
        "a rolled-back op is visible"
    );
    let entries: Vec<i32> = sqlx::query_scalar("SELECT entry FROM ledger")
        .fetch_all(queue.pool())
        .await?;
    ensure!(entries == vec![2]);
    Ok(())
}

#[tokio::test]
async fn sqlite_plain_sql_producers_get_lanes_and_cannot_rewrite_an_op() -> anyhow::Result<()> {
    let db = support::sqlite().await?;
    let TestBackend::Sqlite(queue) = &db.kind else {
        anyhow::bail!("not sqlite")
    };
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('actor', 'activitypub', '[\"A\",\"B\",\"A\"]', '{}') RETURNING id",
    )
    .fetch_one(queue.pool())
    .await?;
    let lanes: Vec<String> = sqlx::query_scalar("SELECT lane FROM op_lanes WHERE op_id = ? ORDER BY lane")
        .bind(id)
        .fetch_all(queue.pool())
        .await?;
    ensure!(lanes == vec!["A".to_owned(), "B".to_owned()], "{lanes:?}");
    let op = db.queue.get(id).await?.context("op")?;
    ensure!(op.status == Status::Pending && op.attempts == 0);
    let rewrite = sqlx::query("UPDATE ops SET payload = '{\"evil\":1}' WHERE id = ?")
        .bind(id)
        .execute(queue.pool())
        .await;
    ensure!(rewrite.is_err(), "payload rewritten");
    let bad = sqlx::query("INSERT INTO ops (outbox, kind, payload) VALUES ('a', 'k', 'not json')")
        .execute(queue.pool())
        .await;
    ensure!(bad.is_err(), "malformed JSON accepted");
    Ok(())
}

#[tokio::test]
async fn postgres_plain_sql_producers_get_lanes_a_notify_and_cannot_rewrite_an_op() -> anyhow::Result<()> {
    let db = support::postgres().await?;
    let TestBackend::Postgres(queue) = &db.kind else {
        anyhow::bail!("not postgres")
    };
    let mut listener = sqlx::postgres::PgListener::connect_with(queue.pool()).await?;
    listener.listen(laneway::queue::postgres::NOTIFY_CHANNEL).await?;
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('actor-x', 'activitypub', ARRAY['A','B','A'], '{}') RETURNING id",
    )
    .fetch_one(queue.pool())
    .await?;
    let note = tokio::time::timeout(std::time::Duration::from_secs(5), listener.recv())
        .await
        .context("no NOTIFY within 5 s")??;
    ensure!(note.payload() == "actor-x", "notified {:?}", note.payload());
    let lanes: Vec<String> = sqlx::query_scalar("SELECT lane FROM op_lanes WHERE op_id = $1 ORDER BY lane")
        .bind(id)
        .fetch_all(queue.pool())
        .await?;
    ensure!(lanes == vec!["A".to_owned(), "B".to_owned()], "{lanes:?}");
    let rewrite = sqlx::query("UPDATE ops SET payload = '{\"evil\":1}' WHERE id = $1")
        .bind(id)
        .execute(queue.pool())
        .await;
    ensure!(rewrite.is_err(), "payload rewritten");
    Ok(())
}

async fn schema_checks(db: support::TestDb, insert_future: &str) -> anyhow::Result<()> {
    match db.queue.check_schema().await {
        Err(QueueError::SchemaBehind { .. }) => {}
        other => anyhow::bail!("unmigrated database gave {other:?}"),
    }
    db.queue.migrate().await?;
    db.queue.check_schema().await?;
    match &db.kind {
        TestBackend::Sqlite(q) => sqlx::query(insert_future).execute(q.pool()).await?.rows_affected(),
        TestBackend::Postgres(q) => sqlx::query(insert_future).execute(q.pool()).await?.rows_affected(),
    };
    match db.queue.check_schema().await {
        Err(
            e @ QueueError::SchemaTooNew {
                found: 99990101000000, ..
            },
        ) => {
            ensure!(e.to_string().contains("upgrade laneway"), "{e}");
        }
        other => anyhow::bail!("newer schema gave {other:?}"),
    }
    // A newer schema also stops `migrate`, so this binary never touches it.
    ensure!(db.queue.migrate().await.is_err());
    Ok(())
}

const FUTURE_MIGRATION: &str =
    "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
     VALUES (99990101000000, 'from the future', TRUE, X'00', 0)";

#[tokio::test]
async fn sqlite_schema_is_checked_before_use() -> anyhow::Result<()> {
    schema_checks(support::sqlite_unmigrated().await?, FUTURE_MIGRATION).await
}

#[tokio::test]
async fn postgres_schema_is_checked_before_use() -> anyhow::Result<()> {
    schema_checks(
        support::postgres_unmigrated().await?,
        &FUTURE_MIGRATION.replace("X'00'", "'\\x00'::bytea"),
    )
    .await
}
