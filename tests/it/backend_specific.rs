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
        "INSERT INTO laneway_ops (outbox, kind, lanes, payload) VALUES ('actor', 'activitypub', '[\"A\",\"B\",\"A\"]', '{}') RETURNING id",
    )
    .fetch_one(queue.pool())
    .await?;
    let lanes: Vec<String> = sqlx::query_scalar("SELECT lane FROM laneway_op_lanes WHERE op_id = ? ORDER BY lane")
        .bind(id)
        .fetch_all(queue.pool())
        .await?;
    ensure!(lanes == vec!["A".to_owned(), "B".to_owned()], "{lanes:?}");
    let op = db.queue.get(id).await?.context("op")?;
    ensure!(op.status == Status::Pending && op.attempts == 0);
    let rewrite = sqlx::query("UPDATE laneway_ops SET payload = '{\"evil\":1}' WHERE id = ?")
        .bind(id)
        .execute(queue.pool())
        .await;
    ensure!(rewrite.is_err(), "payload rewritten");
    // A waiting op's one lane changes only with the re-deal's record.
    let single: i64 = sqlx::query_scalar(
        "INSERT INTO laneway_ops (outbox, kind, lanes, payload) VALUES ('actor', 'activitypub', '[\"A\"]', '{}') RETURNING id",
    )
    .fetch_one(queue.pool())
    .await?;
    let relaned = sqlx::query("UPDATE laneway_ops SET lanes = '[\"Z\"]' WHERE id = ?")
        .bind(single)
        .execute(queue.pool())
        .await;
    ensure!(relaned.is_err(), "lanes rewritten without a re-deal record");
    let bad = sqlx::query("INSERT INTO laneway_ops (outbox, kind, payload) VALUES ('a', 'k', 'not json')")
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
    // A waiting op's one lane changes only with the re-deal's record.
    let single: i64 = sqlx::query_scalar(
        "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('actor-x', 'activitypub', ARRAY['A'], '{}') RETURNING id",
    )
    .fetch_one(queue.pool())
    .await?;
    let relaned = sqlx::query("UPDATE ops SET lanes = ARRAY['Z'] WHERE id = $1")
        .bind(single)
        .execute(queue.pool())
        .await;
    ensure!(relaned.is_err(), "lanes rewritten without a re-deal record");
    Ok(())
}

/// The lane guard's table (PostgreSQL keeps the occupying ops' lanes in
/// `lane_occupants`, written by triggers): every way an op enters or leaves
/// occupancy, by any writer, in one statement or many, shows in what the
/// guard reads.
#[tokio::test]
async fn postgres_lane_occupants_follow_every_writer() -> anyhow::Result<()> {
    let db = support::postgres().await?;
    let TestBackend::Postgres(queue) = &db.kind else {
        anyhow::bail!("not postgres")
    };
    let pool = queue.pool();
    // A receipt is an executor's checkpoint, written after the insert (the
    // producer contract refuses one at insert).
    let insert = |lanes: &'static str, receipt: Option<&'static str>| async move {
        let id = sqlx::query_scalar::<_, i64>(
            "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('o', 'k', $1::text[], '{}') RETURNING id",
        )
        .bind(lanes)
        .fetch_one(pool)
        .await?;
        if receipt.is_some() {
            sqlx::query("UPDATE ops SET receipt = $1 WHERE id = $2")
                .bind(receipt)
                .bind(id)
                .execute(pool)
                .await?;
        }
        Ok::<i64, sqlx::Error>(id)
    };
    let occupants = |lanes: &'static [&'static str]| {
        let queue = db.queue.clone();
        async move {
            let lanes: Vec<String> = lanes.iter().map(|l| (*l).to_owned()).collect();
            let mut ids: Vec<i64> = queue.occupants(&lanes).await?.into_iter().map(|o| o.id).collect();
            ids.sort_unstable();
            anyhow::Ok(ids)
        }
    };
    let rows = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM lane_occupants")
            .fetch_one(pool)
            .await
    };
    let a = insert("{L1,L2,L1}", None).await?;
    let b = insert("{L2}", None).await?;
    ensure!(occupants(&["L1", "L2"]).await?.is_empty(), "pending ops occupy nothing");

    // One statement claims both.
    sqlx::query(
        "UPDATE ops SET status = 'submitted', attempts = 1, lease_token = gen_random_uuid(),
         lease_until = now() + interval '1 minute' WHERE id = ANY($1)",
    )
    .bind(vec![a, b])
    .execute(pool)
    .await?;
    ensure!(occupants(&["L1"]).await? == vec![a], "claimed: L1 is a's");
    ensure!(occupants(&["L2", "L9"]).await? == vec![a, b], "claimed: L2 is both's");
    ensure!(rows().await? == 3, "one row per distinct lane and op");

    // a's outcome is in doubt (pending with a receipt): it keeps its lanes;
    // b settles in the same statement and leaves them.
    sqlx::query(
        "UPDATE ops SET status = CASE WHEN id = $1 THEN 'pending' ELSE 'confirmed' END,
         receipt = CASE WHEN id = $1 THEN 'tx' END, lease_token = NULL, lease_until = NULL WHERE id = ANY($2)",
    )
    .bind(a)
    .bind(vec![a, b])
    .execute(pool)
    .await?;
    ensure!(
        occupants(&["L1", "L2"]).await? == vec![a],
        "in doubt keeps its lanes; confirmed leaves"
    );

    // Reconciled: the receipt goes, the lanes are free.
    sqlx::query("UPDATE ops SET receipt = NULL WHERE id = $1")
        .bind(a)
        .execute(pool)
        .await?;
    ensure!(occupants(&["L1", "L2"]).await?.is_empty(), "reconciled: no occupant");
    ensure!(rows().await? == 0, "no row left behind");

    // A plain-SQL producer may insert an op already in doubt; deleting it
    // (an operator's own SQL) takes its rows too.
    let c = insert("{L3}", Some("tx")).await?;
    ensure!(occupants(&["L3"]).await? == vec![c], "inserted in doubt occupies");
    sqlx::query("DELETE FROM op_lanes WHERE op_id = $1")
        .bind(c)
        .execute(pool)
        .await?;
    sqlx::query("DELETE FROM ops WHERE id = $1")
        .bind(c)
        .execute(pool)
        .await?;
    ensure!(rows().await? == 0, "deleted op's rows stay behind");
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

/// A plain-SQL insert that leaves `priority` out gets its kind's configured
/// default (laneway writes the defaults at migrate, start and reload); a
/// kind laneway does not know is normal; an explicit priority is kept.
async fn plain_sql_inserts_get_the_kind_default_priority(db: support::TestDb) -> anyhow::Result<()> {
    use laneway::op::Priority;
    db.queue
        .register_kinds(&laneway::queue::KindRegistry::priorities(&[
            ("withdraw", Priority::Critical),
            ("rebalance", Priority::Low),
        ]))
        .await?;
    let insert = match &db.kind {
        TestBackend::Sqlite(_) => {
            "INSERT INTO laneway_ops (outbox, kind, lanes, payload) VALUES ('vault', ?, '[\"G\"]', '{}') RETURNING id"
        }
        TestBackend::Postgres(_) => {
            "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('vault', $1, ARRAY['G'], '{}') RETURNING id"
        }
    };
    let mut got = Vec::new();
    for kind in ["withdraw", "rebalance", "unconfigured"] {
        let id: i64 = match &db.kind {
            TestBackend::Sqlite(q) => sqlx::query_scalar(insert).bind(kind).fetch_one(q.pool()).await?,
            TestBackend::Postgres(q) => sqlx::query_scalar(insert).bind(kind).fetch_one(q.pool()).await?,
        };
        got.push(db.queue.get(id).await?.context("op")?.priority);
    }
    ensure!(
        got == vec![Priority::Critical, Priority::Low, Priority::Normal],
        "{got:?}"
    );
    let explicit =
        "INSERT INTO ops (outbox, kind, priority, payload) VALUES ('vault', 'withdraw', 2, '{}') RETURNING id";
    let id: i64 = match &db.kind {
        TestBackend::Sqlite(q) => {
            sqlx::query_scalar(&explicit.replace("INTO ops", "INTO laneway_ops"))
                .fetch_one(q.pool())
                .await?
        }
        TestBackend::Postgres(q) => sqlx::query_scalar(explicit).fetch_one(q.pool()).await?,
    };
    ensure!(db.queue.get(id).await?.context("op")?.priority == Priority::Low);
    // Replacing the defaults replaces them all.
    db.queue
        .register_kinds(&laneway::queue::KindRegistry::default())
        .await?;
    let id: i64 = match &db.kind {
        TestBackend::Sqlite(q) => sqlx::query_scalar(insert).bind("withdraw").fetch_one(q.pool()).await?,
        TestBackend::Postgres(q) => sqlx::query_scalar(insert).bind("withdraw").fetch_one(q.pool()).await?,
    };
    ensure!(db.queue.get(id).await?.context("op")?.priority == Priority::Normal);
    Ok(())
}

#[tokio::test]
async fn sqlite_plain_sql_inserts_get_the_kind_default_priority() -> anyhow::Result<()> {
    plain_sql_inserts_get_the_kind_default_priority(support::sqlite().await?).await
}

#[tokio::test]
async fn postgres_plain_sql_inserts_get_the_kind_default_priority() -> anyhow::Result<()> {
    plain_sql_inserts_get_the_kind_default_priority(support::postgres().await?).await
}

/// The SQLite migration that rebuilds `ops` keeps every row, id, lane,
/// attempt and hold of a database that was in use, and new ids continue
/// after the old ones.
#[tokio::test]
async fn sqlite_rebuilding_ops_keeps_a_used_database_intact() -> anyhow::Result<()> {
    use sqlx::migrate::Migrator;
    let dir = tempfile::tempdir()?;
    // The migrations before the rebuild, applied as an older laneway would.
    let older = dir.path().join("older");
    std::fs::create_dir(&older)?;
    let all = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../migrations/sqlite");
    let mut names: Vec<String> = std::fs::read_dir(&all)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()?;
    names.sort();
    for name in names.iter().filter(|n| n.as_str() < "20261201000002") {
        std::fs::copy(all.join(name), older.join(name))?;
    }
    let url = format!("sqlite://{}", dir.path().join("queue.db").display());
    let options = url
        .parse::<sqlx::sqlite::SqliteConnectOptions>()?
        .create_if_missing(true);
    let pool = sqlx::SqlitePool::connect_with(options).await?;
    Migrator::new(older.as_path()).await?.run(&pool).await?;
    for n in 1..=3 {
        sqlx::query("INSERT INTO ops (outbox, kind, lanes, payload, status, attempts, receipt) VALUES ('o', 'k', '[\"L\"]', ?, 'failed', 1, 'tx')")
            .bind(format!("{{\"n\":{n}}}"))
            .execute(&pool)
            .await?;
        sqlx::query(
            "INSERT INTO attempts (op_id, attempt, started_at, finished_at, outcome) VALUES (?, 1, 0, 0, 'permanent')",
        )
        .bind(n)
        .execute(&pool)
        .await?;
    }
    sqlx::query("INSERT INTO lane_halts (outbox, lane, op_id, halted_at) VALUES ('o', 'L', 3, 0)")
        .execute(&pool)
        .await?;
    pool.close().await;

    let mut config = laneway::config::from_toml_str(&format!("[database]\nurl = {url:?}\n"))?;
    config.database.max_connections = 2;
    let queue = laneway::queue::open(
        &config.database,
        config.limits(),
        std::sync::Arc::new(laneway::clock::SystemClock),
    )
    .await?;
    queue.migrate().await?;
    queue.check_schema().await?;
    for n in 1..=3 {
        let op = queue.get(n).await?.context("op kept")?;
        ensure!(
            op.payload == format!("{{\"n\":{n}}}") && op.lanes == vec!["L".to_owned()] && op.status == Status::Failed,
            "{op:?}"
        );
        ensure!(queue.attempts(n).await?.len() == 1);
    }
    ensure!(queue.lane_halts(None).await?.len() == 1);
    let next = queue.enqueue(&[announce(4)]).await?;
    ensure!(next == vec![Enqueued::Created(4)], "{next:?}");
    let lanes = queue.get(4).await?.context("op")?.lanes;
    ensure!(lanes == vec!["https://coord.example/inbox".to_owned()], "{lanes:?}");
    Ok(())
}

/// `examples/plain_sql_producer.sql` runs with psql against a migrated
/// PostgreSQL schema: it enqueues one op with the kind's default priority,
/// psql prints the NOTIFY that wakes running hosts, and a second run adds
/// nothing (the idempotency key).
#[tokio::test]
async fn the_plain_sql_producer_example_runs_with_psql_and_wakes_hosts() -> anyhow::Result<()> {
    let db = crate::support::postgres().await?;
    let TestBackend::Postgres(queue) = &db.kind else {
        anyhow::bail!("not PostgreSQL");
    };
    db.queue
        .register_kinds(&laneway::queue::KindRegistry::priorities(&[(
            "withdraw",
            laneway::op::Priority::Critical,
        )]))
        .await?;
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(queue.pool())
        .await?;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/plain_sql_producer.sql");
    let run = || {
        std::process::Command::new("psql")
            .arg(crate::support::pg_url())
            .args(["-X", "-v", "ON_ERROR_STOP=1", "-v"])
            .arg(format!("laneway_schema={schema}"))
            .arg("-f")
            .arg(&script)
            .output()
            .context("psql")
    };
    let first = run()?;
    let out = String::from_utf8_lossy(&first.stdout).into_owned();
    anyhow::ensure!(
        first.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&first.stderr)
    );
    anyhow::ensure!(
        out.contains("Asynchronous notification \"laneway_ops\" with payload \"platform\""),
        "no wake-up printed:\n{out}"
    );
    let second = run()?;
    anyhow::ensure!(second.status.success(), "{}", String::from_utf8_lossy(&second.stderr));
    let ops = db
        .queue
        .list(&laneway::queue::OpFilter {
            limit: 10,
            ..Default::default()
        })
        .await?;
    anyhow::ensure!(ops.len() == 1, "{ops:?}");
    let op = &ops[0];
    anyhow::ensure!(
        op.kind == "withdraw"
            && op.priority == laneway::op::Priority::Critical
            && op.lanes == vec!["GSIGNEREXAMPLE".to_owned()]
            && op.status == laneway::op::Status::Pending,
        "{op:?}"
    );
    Ok(())
}

/// A dialect's shipped `due_outboxes` statement, as the store runs it.
fn due_outboxes_block(dialect: &str) -> anyhow::Result<String> {
    crate::tidy::sql_blocks(dialect)?
        .remove("dispatch")
        .into_iter()
        .flatten()
        .find(|(name, _)| name == "due_outboxes")
        .and_then(|(_, text)| text)
        .context("the due_outboxes block")
}

/// The safety-net poll stays one seek per outbox with a deep backlog:
/// SQLite's planner, left to itself, took `ops_status` and sorted every
/// pending op once per outbox (0.98 s a poll at 86,000 waiting).
#[tokio::test]
async fn sqlite_due_outboxes_seeks_its_index_with_a_deep_backlog() -> anyhow::Result<()> {
    let db = support::sqlite().await?;
    let TestBackend::Sqlite(queue) = &db.kind else {
        anyhow::bail!("not sqlite")
    };
    // 20,000 pending ops in four outboxes; the fourth's are all in the future.
    sqlx::query(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20000)
         INSERT INTO laneway_ops (outbox, kind, priority, lanes, payload, next_attempt_at)
         SELECT 'outbox-' || (i % 4), 'noop', 1, '[]', '{}',
                CASE WHEN i % 4 = 3 THEN 9999999999999 ELSE 100000000000 END FROM n",
    )
    .execute(queue.pool())
    .await?;
    let block = due_outboxes_block("sqlite")?;
    let plan = {
        use sqlx::Row as _;
        sqlx::query(&format!("EXPLAIN QUERY PLAN {block}"))
            .bind(200_000_000_000_i64)
            .bind(100_i64)
            .fetch_all(queue.pool())
            .await?
            .iter()
            .map(|row| row.try_get::<String, _>("detail"))
            .collect::<Result<Vec<_>, _>>()?
    };
    let lookups: Vec<&String> = plan.iter().filter(|d| d.contains(" ops ")).collect();
    ensure!(lookups.len() == 3, "three lookups of ops: {plan:#?}");
    ensure!(
        lookups.iter().all(|d| d.contains("INDEX ops_due")) && !plan.iter().any(|d| d.contains("TEMP B-TREE")),
        "the poll must seek ops_due, never sort: {plan:#?}"
    );
    let due: Vec<String> = sqlx::query_scalar(&block)
        .bind(200_000_000_000_i64)
        .bind(100_i64)
        .fetch_all(queue.pool())
        .await?;
    ensure!(due == ["outbox-0", "outbox-1", "outbox-2"], "{due:?}");
    Ok(())
}

/// The same poll on PostgreSQL, since `ops_outbox_claim` (which its skip
/// scan used to seek) was dropped: `ops_due`, led by the outbox, answers
/// both "the next outbox" and "has it a due op", one seek each, and no plan
/// sorts the pending ops.
#[tokio::test]
async fn postgres_due_outboxes_seeks_its_index_with_a_deep_backlog() -> anyhow::Result<()> {
    let db = support::postgres().await?;
    let TestBackend::Postgres(queue) = &db.kind else {
        anyhow::bail!("not postgres")
    };
    // 20,000 pending ops in four outboxes; the fourth's are all in the future.
    sqlx::query(
        "INSERT INTO ops (outbox, kind, priority, lanes, payload, next_attempt_at)
         SELECT 'outbox-' || (i % 4), 'noop', 1, '{}', '{}',
                CASE WHEN i % 4 = 3 THEN now() + interval '1 day' ELSE now() - interval '1 minute' END
         FROM generate_series(1, 20000) AS i",
    )
    .execute(queue.pool())
    .await?;
    sqlx::query("ANALYZE ops").execute(queue.pool()).await?;
    let block = due_outboxes_block("postgres")?;
    let now = chrono::Utc::now();
    let plan: Vec<String> = sqlx::query_scalar(&format!(
        "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) {block}"
    ))
    .bind(now)
    .bind(100_i64)
    .fetch_all(queue.pool())
    .await?;
    let seeks = plan.iter().filter(|line| line.contains("using ops_due on ops")).count();
    ensure!(seeks == 3, "three seeks of ops_due: {plan:#?}");
    ensure!(
        !plan
            .iter()
            .any(|line| line.contains("Sort") || line.contains("Seq Scan")),
        "the poll must seek, never sort or scan: {plan:#?}"
    );
    let due: Vec<String> = sqlx::query_scalar(&block)
        .bind(now)
        .bind(100_i64)
        .fetch_all(queue.pool())
        .await?;
    ensure!(due == ["outbox-0", "outbox-1", "outbox-2"], "{due:?}");
    Ok(())
}

/// PostgreSQL: a read of an outbox's book never passes an op still to
/// commit, whoever writes it. With many writers an id taken first can
/// commit last; the drain's book reads new ops as `id > high-water mark`,
/// would skip it, and let the next op of its strict lane start first (found
/// by the fault harness: two inbound activities of one sender, acknowledged
/// in order, handed on out of order). Writers no longer wait for each other
/// for this (an API enqueue waited behind a producer's open transaction,
/// and two producers inserting into two outboxes in opposite orders
/// deadlocked): the read stops at the first id an open writer of the outbox
/// may still commit (migration 20261208000001).
#[tokio::test]
async fn postgres_a_read_of_an_outbox_never_passes_an_op_still_to_commit() -> anyhow::Result<()> {
    use std::time::Duration;
    let db = support::postgres().await?;
    let TestBackend::Postgres(queue) = &db.kind else {
        anyhow::bail!("not postgres")
    };
    let ids = |rows: Vec<laneway::queue::BookRow>| rows.into_iter().map(|r| r.id).collect::<Vec<_>>();
    let before = db.queue.enqueue(&[announce(0)]).await?[0].id();
    for rollback in [false, true] {
        let mut first = queue.begin().await?;
        let a = queue.enqueue_in(&mut first, &[announce(1)]).await?[0].id();
        // Neither writer waits for the open transaction now.
        let b = tokio::time::timeout(Duration::from_secs(2), db.queue.enqueue(&[announce(2)]))
            .await
            .context("an enqueue through laneway waited for a producer's open transaction")??[0]
            .id();
        let c: i64 = tokio::time::timeout(
            Duration::from_secs(2),
            sqlx::query_scalar(
                "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('case-manager', 'activitypub', ARRAY['https://coord.example/inbox'], '{}') RETURNING id",
            )
            .fetch_one(queue.pool()),
        )
        .await
        .context("a plain SQL insert waited for a producer's open transaction")??;
        ensure!(a < b && b < c, "ids {a}, {b}, {c}");
        let mut elsewhere = announce(3);
        elsewhere.outbox = "another-actor".into();
        let other = db.queue.enqueue(&[elsewhere]).await?[0].id();
        // b and c have committed, but a read stops before a: from the start
        // and from a high-water mark, in both scans the drain makes.
        let whole = ids(db.queue.scan("case-manager", None, 100).await?);
        ensure!(whole.iter().all(|id| *id < a), "read past the open op {a}: {whole:?}");
        ensure!(whole.contains(&before), "{whole:?}");
        let since = ids(db.queue.scan("case-manager", Some(before), 100).await?);
        ensure!(since.is_empty(), "read past the open op {a}: {since:?}");
        let beyond = ids(db
            .queue
            .scan_beyond("case-manager", (laneway::op::Priority::Critical, 0), 8, 100)
            .await?);
        ensure!(
            beyond.iter().all(|id| *id < a),
            "walked past the open op {a}: {beyond:?}"
        );
        ensure!(
            ids(db.queue.scan("another-actor", None, 100).await?).contains(&other),
            "another outbox is not held back"
        );
        if rollback {
            first.rollback().await?;
        } else {
            first.commit().await?;
        }
        let since = ids(db.queue.scan("case-manager", Some(before), 100).await?);
        let expected = if rollback { vec![b, c] } else { vec![a, b, c] };
        ensure!(
            since.iter().filter(|id| **id >= a).copied().collect::<Vec<_>>() == expected,
            "rollback {rollback}: {since:?}"
        );
        for id in since {
            sqlx::query("UPDATE ops SET status = 'cancelled', finished_at = now() WHERE id = $1")
                .bind(id)
                .execute(queue.pool())
                .await?;
        }
    }
    // One transaction's many inserts into an outbox announce it once: the
    // lock table (a few thousand entries in all) is never filled by them.
    let mut bulk = queue.begin().await?;
    let many: Vec<NewOp> = (0..5_000).map(announce).collect();
    queue.enqueue_in(&mut bulk, &many).await?;
    let announced: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()")
            .fetch_one(&mut *bulk)
            .await?;
    ensure!(announced == 1, "{announced} announcements for one outbox");
    bulk.rollback().await?;
    Ok(())
}

/// Two producers inserting into the same two outboxes in opposite orders,
/// each statement on its own (the case `enqueue_many` could not cover), in
/// transactions open at once: nothing waits, nothing deadlocks (PostgreSQL
/// failed one with 40P01 after its deadlock timeout), and every op is read
/// once both commit.
#[tokio::test]
async fn postgres_producers_inserting_into_outboxes_in_opposite_orders_never_wait() -> anyhow::Result<()> {
    use std::time::Duration;
    let db = support::postgres().await?;
    let TestBackend::Postgres(queue) = &db.kind else {
        anyhow::bail!("not postgres")
    };
    let insert = "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ($1, 'activitypub', ARRAY['https://coord.example/inbox'], '{}') RETURNING id";
    for _ in 0..3 {
        let mut a = queue.pool().begin().await?;
        let mut b = queue.pool().begin().await?;
        for (first, outbox) in [(true, "o-1"), (false, "o-2"), (true, "o-2"), (false, "o-1")] {
            let tx = if first { &mut a } else { &mut b };
            tokio::time::timeout(
                Duration::from_secs(2),
                sqlx::query_scalar::<_, i64>(insert).bind(outbox).fetch_one(&mut **tx),
            )
            .await
            .with_context(|| format!("an insert into {outbox} waited"))??;
        }
        // Laneway's own enqueue into both, meanwhile, waits for neither.
        let mut both = announce(9);
        both.outbox = "o-2".into();
        let mut first = announce(9);
        first.outbox = "o-1".into();
        tokio::time::timeout(Duration::from_secs(2), db.queue.enqueue(&[both, first]))
            .await
            .context("laneway's enqueue waited")??;
        b.commit().await?;
        a.commit().await?;
    }
    for outbox in ["o-1", "o-2"] {
        let read = db.queue.scan(outbox, None, 100).await?;
        ensure!(read.len() == 9, "{outbox}: {} ops read", read.len());
    }
    Ok(())
}

/// A value the database itself refuses, past every check laneway makes
/// first (a CHECK or NOT NULL constraint, JSON its functions refuse, a
/// statement too deep), is the caller's bad input: never `database
/// unavailable`, which a client retries for ever. Through the real drivers.
async fn database_refusals_read_as_bad_input(db: support::TestDb, statements: &[&str]) -> anyhow::Result<()> {
    let setup = "CREATE TABLE refusals_probe (x INTEGER CHECK (x > 0), y TEXT NOT NULL)";
    db.tamper(&[setup], &[setup]).await?;
    for statement in statements {
        let error = match &db.kind {
            support::TestBackend::Sqlite(q) => sqlx::query(statement).execute(q.pool()).await.err(),
            support::TestBackend::Postgres(q) => sqlx::query(statement).execute(q.pool()).await.err(),
        }
        .with_context(|| format!("{statement} succeeded"))?;
        let mapped = laneway::queue::QueueError::from(error);
        ensure!(
            matches!(mapped, laneway::queue::QueueError::InvalidOp(_)),
            "{statement}: {mapped:?}"
        );
    }
    Ok(())
}

const REFUSED_ROWS: [&str; 2] = [
    "INSERT INTO refusals_probe (x, y) VALUES (0, 'a')",
    "INSERT INTO refusals_probe (x, y) VALUES (1, NULL)",
];

#[tokio::test]
async fn sqlite_database_refusals_read_as_bad_input() -> anyhow::Result<()> {
    let deep = format!("SELECT json('{}{}')", "[".repeat(5000), "]".repeat(5000));
    let statements = [REFUSED_ROWS[0], REFUSED_ROWS[1], "SELECT json('[1,')", deep.as_str()];
    database_refusals_read_as_bad_input(support::sqlite().await?, &statements).await
}

#[tokio::test]
async fn postgres_database_refusals_read_as_bad_input() -> anyhow::Result<()> {
    let statements = [
        REFUSED_ROWS[0],
        REFUSED_ROWS[1],
        "SELECT '[1,'::jsonb",
        "SELECT 'x'::int",
    ];
    database_refusals_read_as_bad_input(support::postgres().await?, &statements).await
}

/// A settle's cost does not grow with the ops in flight: the occupants
/// triggers reach `lane_occupants` by its primary key whatever the table's
/// statistics say. The statistics are taken while the table is empty (as
/// autovacuum may leave them), then 20,000 ops occupy their lanes, and one
/// settles: the table must not be scanned whole.
#[tokio::test]
async fn postgres_settles_reach_lane_occupants_by_index_whatever_the_statistics() -> anyhow::Result<()> {
    let db = support::postgres().await?;
    let TestBackend::Postgres(queue) = &db.kind else {
        anyhow::bail!("not postgres")
    };
    // Every statement on one connection, whose counters it flushes itself
    // before reading them (another backend's flush could land at any time).
    let mut conn = queue.pool().acquire().await?;
    let conn = &mut *conn;
    for statement in [
        "ANALYZE lane_occupants",
        "INSERT INTO ops (outbox, kind, lanes, payload)
         SELECT 'o', 'k', ARRAY['lane-' || n, 'shared-' || (n % 50)], '{}' FROM generate_series(1, 20000) AS n",
        "UPDATE ops SET status = 'submitted', attempts = 1, lease_token = gen_random_uuid(),
         lease_until = now() + interval '1 hour'",
    ] {
        sqlx::query(statement).execute(&mut *conn).await?;
    }
    let before = seq_scans(conn).await?;
    for batch in [1_i64, 400] {
        sqlx::query(
            "UPDATE ops SET status = 'confirmed', lease_token = NULL, lease_until = NULL
             WHERE id IN (SELECT id FROM ops WHERE status = 'submitted' ORDER BY id LIMIT $1)",
        )
        .bind(batch)
        .execute(&mut *conn)
        .await?;
    }
    for statement in [
        "DELETE FROM op_lanes WHERE op_id IN (SELECT id FROM ops WHERE status = 'submitted' ORDER BY id LIMIT 10)",
        "DELETE FROM ops WHERE id IN (SELECT id FROM ops WHERE status = 'submitted' ORDER BY id LIMIT 10)",
    ] {
        sqlx::query(statement).execute(&mut *conn).await?;
    }
    let after = seq_scans(conn).await?;
    ensure!(
        after == before,
        "settles and deletes scanned every occupant {} times",
        after - before
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM lane_occupants")
        .fetch_one(&mut *conn)
        .await?;
    ensure!(
        left == 2 * (20_000 - 411),
        "the settled and deleted ops left their lanes: {left} rows"
    );
    Ok(())
}

/// How many times `lane_occupants` has been read whole, this connection's
/// own counts flushed first.
async fn seq_scans(conn: &mut sqlx::PgConnection) -> anyhow::Result<i64> {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await?;
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *conn)
        .await?;
    Ok(
        sqlx::query_scalar("SELECT seq_scan FROM pg_stat_user_tables WHERE relid = 'lane_occupants'::regclass")
            .fetch_one(&mut *conn)
            .await?,
    )
}
