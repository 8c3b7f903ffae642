//! The producer contract (docs/producers.md) as a plain-SQL producer meets
//! it, on both backends: every row the drain could not read or run is
//! refused at insert with `laneway: CODE: …`, nothing of it is written, and
//! the outbox, its listing and its other ops go on; rows written before the
//! contract are set aside by the migration.

use anyhow::{ensure, Context};
use laneway::op::{AttemptClass, Priority, Status};
use laneway::queue::{Enqueued, KindLanes, KindRegistry, NewOp, OpFilter, QueueError, RegisteredKind};

use crate::support::{TestBackend, TestDb};

/// What the hosts of these tests register: `email` needs lanes, `note`
/// does not, `vault`'s plugin names them; payloads up to 1 KiB.
fn registry() -> KindRegistry {
    let kind = |kind: &str, lanes| RegisteredKind {
        kind: kind.to_owned(),
        priority: Priority::Normal,
        lanes,
    };
    KindRegistry {
        kinds: vec![
            kind("email", KindLanes::Required),
            kind("note", KindLanes::Optional),
            kind("vault", KindLanes::Plugin),
        ],
        max_payload_bytes: Some(1024),
    }
}

/// Runs one raw insert; the refusal's `laneway: CODE` or `None` when the
/// database took it.
async fn refusal(db: &TestDb, sqlite: &str, postgres: &str) -> anyhow::Result<Option<String>> {
    match db.tamper(&[sqlite], &[postgres]).await {
        Ok(()) => Ok(None),
        Err(e) => {
            let text = e.to_string();
            let code = text
                .split("laneway: ")
                .nth(1)
                .and_then(|rest| rest.split(':').next())
                .map(str::to_owned);
            code.map(Some)
                .with_context(|| format!("refused, but not by the contract: {text}"))
        }
    }
}

async fn ops_in(db: &TestDb, outbox: &str) -> anyhow::Result<Vec<laneway::op::Op>> {
    Ok(db
        .queue
        .list(&OpFilter {
            outbox: Some(outbox.to_owned()),
            limit: 100,
            ..OpFilter::default()
        })
        .await?)
}

/// Each input the issue found stalling an outbox (SQLite) or accepted where
/// the API refuses it (both), refused at insert with its code.
async fn raw_inserts_are_held_to_the_contract(db: TestDb) -> anyhow::Result<()> {
    db.queue.register_kinds(&registry()).await?;
    let big = format!("'\"{}\"'", "x".repeat(2000));
    let cases: Vec<(&str, String, String)> = vec![
        // SQLite stores whatever it is given; these stopped the outbox.
        ("invalid_op", "INSERT INTO laneway_ops (outbox, kind, lanes, payload) VALUES ('o', 'email', '[null]', '{}')".into(),
            "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('o', 'email', ARRAY[NULL]::text[], '{}')".into()),
        ("invalid_op", "INSERT INTO laneway_ops (outbox, kind, lanes, payload) VALUES ('o', 'email', '[7]', '{}')".into(),
            "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('o', 'email', '{\"\"}', '{}')".into()),
        ("invalid_op", "INSERT INTO laneway_ops (outbox, kind, lanes, payload, next_attempt_at) VALUES ('o', 'email', '[\"a\"]', '{}', '2026-12-07T00:00:00Z')".into(),
            "INSERT INTO ops (outbox, kind, lanes, payload, next_attempt_at) VALUES ('o', 'email', '{a}', '{}', 'infinity')".into()),
        ("invalid_op", "INSERT INTO laneway_ops (outbox, kind, lanes, payload, subject) VALUES ('o', 'email', '[\"a\"]', '{}', x'75736572')".into(),
            "INSERT INTO ops (outbox, kind, lanes, payload, subject) VALUES ('o', 'email', '{a}', '{}', '  ')".into()),
        ("invalid_op", "INSERT INTO laneway_ops (outbox, kind, lanes, payload, idempotency_key) VALUES ('o', 'email', '[\"a\"]', '{}', x'6b')".into(),
            "INSERT INTO ops (outbox, kind, lanes, payload, idempotency_key) VALUES ('o', 'email', '{a}', '{}', '')".into()),
        // Seconds where milliseconds are meant: ran at once before.
        ("invalid_op", "INSERT INTO laneway_ops (outbox, kind, lanes, payload, next_attempt_at) VALUES ('o', 'email', '[\"a\"]', '{}', 1796000000)".into(),
            "INSERT INTO ops (outbox, kind, lanes, payload, next_attempt_at) VALUES ('o', 'email', '{a}', '{}', '0001-01-01')".into()),
        ("invalid_op", "INSERT INTO laneway_ops (outbox, kind, lanes, payload) VALUES ('o', 'email', '[\"\"]', '{}')".into(),
            "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('o', 'email', '{\" \"}', '{}')".into()),
        ("invalid_op", "INSERT INTO laneway_ops (outbox, kind, lanes, payload, status) VALUES ('o', 'email', '[\"a\"]', '{}', 'confirmed')".into(),
            "INSERT INTO ops (outbox, kind, lanes, payload, status) VALUES ('o', 'email', '{a}', '{}', 'confirmed')".into()),
        ("invalid_op", "INSERT INTO laneway_ops (outbox, kind, lanes, payload) VALUES ('o', 'email', '[\"a\"]', x'7b7d')".into(),
            "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('', 'email', '{a}', '{}')".into()),
        // What the API refuses, refused in SQL too.
        ("unknown_kind", "INSERT INTO laneway_ops (outbox, kind, lanes, payload) VALUES ('o', 'emial', '[\"a\"]', '{}')".into(),
            "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('o', 'emial', '{a}', '{}')".into()),
        ("lanes_required", "INSERT INTO laneway_ops (outbox, kind, payload) VALUES ('o', 'email', '{}')".into(),
            "INSERT INTO ops (outbox, kind, payload) VALUES ('o', 'email', '{}')".into()),
        ("lanes_required", "INSERT INTO laneway_ops (outbox, kind, payload) VALUES ('o', 'vault', '{}')".into(),
            "INSERT INTO ops (outbox, kind, payload) VALUES ('o', 'vault', '{}')".into()),
        ("payload_too_large", format!("INSERT INTO laneway_ops (outbox, kind, lanes, payload) VALUES ('o', 'note', '[]', {big})"),
            format!("INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('o', 'note', '{{}}', {big})")),
    ];
    for (want, sqlite, postgres) in &cases {
        let got = refusal(&db, sqlite, postgres).await?;
        ensure!(
            got.as_deref() == Some(*want),
            "{sqlite} / {postgres}: {got:?}, expected {want}"
        );
    }
    ensure!(ops_in(&db, "o").await?.is_empty(), "a refused insert left a row");
    // A good row beside them goes in, and the outbox reads.
    let good = refusal(
        &db,
        "INSERT INTO laneway_ops (outbox, kind, lanes, payload, idempotency_key) VALUES ('o', 'email', '[\"a\"]', '{\"n\": 1}', 'k')",
        "INSERT INTO ops (outbox, kind, lanes, payload, idempotency_key) VALUES ('o', 'email', '{a}', '{\"n\": 1}', 'k')",
    )
    .await?;
    ensure!(good.is_none(), "{good:?}");
    let ops = ops_in(&db, "o").await?;
    ensure!(ops.len() == 1 && ops[0].status == Status::Pending, "{ops:?}");
    // The key again for another payload: a conflict, not a duplicate.
    let again = refusal(
        &db,
        "INSERT INTO laneway_ops (outbox, kind, lanes, payload, idempotency_key) VALUES ('o', 'email', '[\"a\"]', '{\"n\": 2}', 'k')",
        "INSERT INTO ops (outbox, kind, lanes, payload, idempotency_key) VALUES ('o', 'email', '{a}', '{\"n\": 2}', 'k')",
    )
    .await?;
    ensure!(again.as_deref() == Some("idempotency_conflict"), "{again:?}");
    // The same op again is the duplicate it always was (the unique index).
    let same = db
        .tamper(
            &["INSERT INTO laneway_ops (outbox, kind, lanes, payload, idempotency_key) VALUES ('o', 'email', '[\"a\"]', '{\"n\":1}', 'k') ON CONFLICT DO NOTHING"],
            &["INSERT INTO ops (outbox, kind, lanes, payload, idempotency_key) VALUES ('o', 'email', '{a}', '{\"n\":1}', 'k') ON CONFLICT DO NOTHING"],
        )
        .await;
    ensure!(same.is_ok(), "{same:?}");
    // A hand edit of a column the drain reads keeps its type (SQLite; the
    // column types do it on PostgreSQL).
    if matches!(db.kind, TestBackend::Sqlite(_)) {
        let edit = refusal(&db, "UPDATE laneway_ops SET next_attempt_at = 'soon'", "SELECT 1").await?;
        ensure!(edit.as_deref() == Some("invalid_op"), "{edit:?}");
    }
    ensure!(ops_in(&db, "o").await?.len() == 1);
    Ok(())
}

/// The library's own enqueue meets the same fingerprint: a reused key for
/// another payload is `IdempotencyConflict`, the same op is `Existing`.
async fn a_reused_idempotency_key_is_a_conflict_for_every_writer(db: TestDb) -> anyhow::Result<()> {
    db.queue.register_kinds(&registry()).await?;
    let op = |payload: &str| NewOp {
        lanes: vec!["a".to_owned()],
        idempotency_key: Some("k".to_owned()),
        ..NewOp::new("o", "email", payload.to_owned())
    };
    let first = db.queue.enqueue(&[op(r#"{"n":1}"#)]).await?;
    ensure!(matches!(first[..], [Enqueued::Created(_)]), "{first:?}");
    let same = db.queue.enqueue(&[op(r#"{"n":1}"#)]).await?;
    ensure!(same == vec![Enqueued::Existing(first[0].id())], "{same:?}");
    let other = db.queue.enqueue(&[op(r#"{"n":2}"#)]).await;
    ensure!(matches!(other, Err(QueueError::IdempotencyConflict(_))), "{other:?}");
    // In a batch (one statement), all or nothing.
    let batch: Vec<NewOp> = (0..6)
        .map(|n| NewOp {
            idempotency_key: Some(if n == 3 { "k".to_owned() } else { format!("b{n}") }),
            ..op(&format!("{{\"b\":{n}}}"))
        })
        .collect();
    let refused = db.queue.enqueue(&batch).await;
    ensure!(
        matches!(refused, Err(QueueError::IdempotencyConflict(_))),
        "{refused:?}"
    );
    ensure!(ops_in(&db, "o").await?.len() == 1, "the refused batch left rows");
    Ok(())
}

/// A database no configured host has registered with checks each row's
/// shape but not its kind (the library's own tests and tools enqueue kinds
/// no config names).
async fn before_a_host_registers_only_shapes_are_checked(db: TestDb) -> anyhow::Result<()> {
    let kind = refusal(
        &db,
        "INSERT INTO laneway_ops (outbox, kind, lanes, payload) VALUES ('o', 'anything', '[]', '{}')",
        "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('o', 'anything', '{}', '{}')",
    )
    .await?;
    ensure!(kind.is_none(), "{kind:?}");
    let shape = refusal(
        &db,
        "INSERT INTO laneway_ops (outbox, kind, lanes, payload) VALUES ('o', 'anything', '[1]', '{}')",
        "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('o', 'anything', '{\"\"}', '{}')",
    )
    .await?;
    ensure!(shape.as_deref() == Some("invalid_op"), "{shape:?}");
    Ok(())
}

crate::on_both_backends!(
    a_hand_edit_cannot_make_an_op_unreadable,
    contract_version_1_statements_keep_working,
    raw_inserts_are_held_to_the_contract,
    a_reused_idempotency_key_is_a_conflict_for_every_writer,
    before_a_host_registers_only_shapes_are_checked,
);

/// Rows an older laneway's SQLite accepted and could not read are set aside
/// by the contract's migration: each a dead letter whose error says what was
/// found, the outbox's good op still pending, and the listing, the outcome
/// feed and new enqueues working.
#[tokio::test]
async fn sqlite_rows_from_before_the_contract_are_set_aside() -> anyhow::Result<()> {
    use sqlx::migrate::Migrator;
    let dir = tempfile::tempdir()?;
    let older = dir.path().join("older");
    std::fs::create_dir(&older)?;
    let all = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../migrations/sqlite");
    for entry in std::fs::read_dir(&all)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.as_str() < "20261207000001" {
            std::fs::copy(all.join(&name), older.join(&name))?;
        }
    }
    let url = format!("sqlite://{}", dir.path().join("queue.db").display());
    let options = url
        .parse::<sqlx::sqlite::SqliteConnectOptions>()?
        .create_if_missing(true);
    let pool = sqlx::SqlitePool::connect_with(options).await?;
    Migrator::new(older.as_path()).await?.run(&pool).await?;
    let now = chrono::Utc::now().timestamp_millis();
    let insert = "INSERT INTO ops (outbox, kind, lanes, payload, subject, idempotency_key, next_attempt_at) \
                  VALUES ('o', 'email', ?, '{}', ?, ?, ?)";
    // Values bound as the producers' drivers bound them: Python `bytes` as
    // BLOBs, a date as text.
    let bytes = |s: &str| Some(s.as_bytes().to_vec());
    for (lanes, subject, key) in [
        ("[null]", None, None),
        ("[7]", None, None),
        ("[\"a\"]", bytes("user-7"), bytes("k")),
    ] {
        sqlx::query(insert)
            .bind(lanes)
            .bind(subject)
            .bind(key)
            .bind(now)
            .execute(&pool)
            .await?;
    }
    sqlx::query(insert)
        .bind("[\"a\"]")
        .bind(None::<Vec<u8>>)
        .bind(None::<Vec<u8>>)
        .bind("2026-12-07T00:00:00Z")
        .execute(&pool)
        .await?;
    sqlx::query("INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('o', 'email', '[\"a\"]', '{\"good\":1}')")
        .execute(&pool)
        .await?;
    pool.close().await;

    let config = laneway::config::from_toml_str(&format!("[database]\nurl = {url:?}\n"))?;
    let queue = laneway::queue::open(
        &config.database,
        config.limits(),
        std::sync::Arc::new(laneway::clock::SystemClock),
    )
    .await?;
    queue.migrate().await?;
    let ops = queue
        .list(&OpFilter {
            outbox: Some("o".to_owned()),
            limit: 10,
            ..OpFilter::default()
        })
        .await?;
    ensure!(ops.len() == 5, "{ops:?}");
    for op in ops.iter().filter(|o| o.id <= 4) {
        let why = op.last_error.as_deref().unwrap_or_default();
        ensure!(
            op.status == Status::Failed && why.starts_with("invalid: "),
            "op {} not set aside: {op:?}",
            op.id
        );
        // A dead letter of its own class, never tried.
        let attempts = queue.attempts(op.id).await?;
        ensure!(
            attempts.len() == 1 && attempts[0].record.class == AttemptClass::Invalid,
            "op {}: {attempts:?}",
            op.id
        );
    }
    let groups = queue.dead_letter_groups().await?;
    ensure!(
        groups
            .iter()
            .any(|g| g.class == Some(AttemptClass::Invalid) && g.count == 4),
        "{groups:?}"
    );
    let why = |id: i64| {
        ops.iter()
            .find(|o| o.id == id)
            .and_then(|o| o.last_error.clone())
            .unwrap_or_default()
    };
    ensure!(why(1).contains("lanes '[null]'"), "{}", why(1));
    ensure!(why(3).contains("subject X'757365722D37'"), "{}", why(3));
    ensure!(why(4).contains("next_attempt_at '2026-12-07T00:00:00Z'"), "{}", why(4));
    let good = ops.iter().find(|o| o.id == 5).context("the good op")?;
    ensure!(good.status == Status::Pending, "{good:?}");
    let feed = queue.outcomes(None, 10).await?;
    ensure!(feed.len() == 4, "{feed:?}");
    let next = queue.enqueue(&[NewOp::new("o", "email", "{}".to_owned())]).await?;
    ensure!(next == vec![Enqueued::Created(6)], "{next:?}");
    Ok(())
}

/// A second queue on the test's PostgreSQL schema, with its own
/// `lock_timeout_ms`.
async fn pg_queue_with_lock_timeout(db: &TestDb, ms: u64) -> anyhow::Result<laneway::queue::postgres::PgQueue> {
    use std::str::FromStr;
    let TestBackend::Postgres(queue) = &db.kind else {
        anyhow::bail!("not PostgreSQL");
    };
    let schema: String = sqlx::query_scalar("SELECT current_schema()::text")
        .fetch_one(queue.pool())
        .await?;
    let mut config = laneway::config::from_toml_str("")?.database;
    config.url = crate::support::pg_url();
    config.lock_timeout_ms = ms;
    let options = sqlx::postgres::PgConnectOptions::from_str(&config.url)?.options([("search_path", schema.as_str())]);
    Ok(laneway::queue::postgres::PgQueue::open_with(
        options,
        &config,
        laneway::queue::Limits::default(),
        std::sync::Arc::new(laneway::clock::SystemClock),
    )
    .await?)
}

/// An enqueue through laneway never waits behind a producer's open
/// transaction on the same outbox (it waited as long as the transaction
/// stayed open: 34 s in the issue's try). Where a wait is unavoidable, the
/// same idempotency key being inserted by both, it is answered busy within
/// `lock_timeout_ms`, and the same enqueue is answered with the producer's
/// op once that commits.
#[tokio::test]
async fn postgres_an_enqueue_behind_a_producers_open_transaction_is_answered_busy_in_bounded_time() -> anyhow::Result<()>
{
    use laneway::queue::OpStore as _;
    let db = crate::support::postgres().await?;
    let TestBackend::Postgres(queue) = &db.kind else {
        anyhow::bail!("not PostgreSQL");
    };
    let api = pg_queue_with_lock_timeout(&db, 300).await?;
    let mut producer = queue.pool().begin().await?;
    let theirs: i64 = sqlx::query_scalar(
        "SELECT enqueue(kind => 'k', outbox => 'held', payload => '{}', idempotency_key => 'order-1')",
    )
    .fetch_one(&mut *producer)
    .await?;
    let started = std::time::Instant::now();
    let same_outbox = api.enqueue(&[NewOp::new("held", "k", "{}")]).await?;
    ensure!(matches!(same_outbox[..], [Enqueued::Created(_)]), "{same_outbox:?}");
    ensure!(
        started.elapsed() < std::time::Duration::from_millis(250),
        "waited {:?}",
        started.elapsed()
    );
    let mut same_key = NewOp::new("held", "k", "{}");
    same_key.idempotency_key = Some("order-1".into());
    let started = std::time::Instant::now();
    let busy = api.enqueue(std::slice::from_ref(&same_key)).await;
    let waited = started.elapsed();
    ensure!(matches!(busy, Err(QueueError::Busy(_))), "{busy:?}");
    ensure!(waited < std::time::Duration::from_secs(3), "waited {waited:?}");
    let message = busy.err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(message.contains("producer's transaction"), "{message}");
    producer.commit().await?;
    let after = api.enqueue(&[same_key]).await?;
    ensure!(after == vec![Enqueued::Existing(theirs)], "{after:?}");
    Ok(())
}

/// Two producers inserting one idempotency key at once, with different
/// payloads: the second waits for the first at the unique index and is then
/// refused (LW005 through `laneway.enqueue`, `idempotency_conflict` through
/// laneway), never answered with the first's op. The contract's check could
/// not see the first's uncommitted op; the retried insert's check does.
#[tokio::test]
async fn postgres_a_key_raced_for_another_op_is_refused_not_answered() -> anyhow::Result<()> {
    let db = crate::support::postgres().await?;
    let TestBackend::Postgres(queue) = &db.kind else {
        anyhow::bail!("not PostgreSQL");
    };
    for through_laneway in [false, true] {
        let key = format!("race-{through_laneway}");
        let mut first = queue.pool().begin().await?;
        sqlx::query("SELECT enqueue(kind => 'k', outbox => 'race', payload => '{\"n\": 1}', idempotency_key => $1)")
            .bind(&key)
            .execute(&mut *first)
            .await?;
        let second = {
            let pool = queue.pool().clone();
            let queue = db.queue.clone();
            let key = key.clone();
            tokio::spawn(async move {
                if through_laneway {
                    let mut op = NewOp::new("race", "k", r#"{"n": 2}"#);
                    op.idempotency_key = Some(key);
                    queue.enqueue(&[op]).await.map(|_| ()).map_err(|e| e.to_string())
                } else {
                    sqlx::query(
                        "SELECT enqueue(kind => 'k', outbox => 'race', payload => '{\"n\": 2}', idempotency_key => $1)",
                    )
                    .bind(&key)
                    .execute(&pool)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
                }
            })
        };
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        ensure!(!second.is_finished(), "the second did not wait for the first's key");
        first.commit().await?;
        let refused = tokio::time::timeout(std::time::Duration::from_secs(10), second).await??;
        let message = refused.err().unwrap_or_default();
        ensure!(
            message.contains("idempotency"),
            "through laneway {through_laneway}: {message:?}"
        );
    }
    Ok(())
}

/// Two producers enqueueing into the same two outboxes in opposite orders,
/// each with `laneway.enqueue_many` in its own transaction: neither waits
/// for the other (the function no longer locks outboxes), so neither can
/// deadlock.
#[tokio::test]
async fn postgres_two_producers_batching_outboxes_in_opposite_orders_do_not_deadlock() -> anyhow::Result<()> {
    let db = crate::support::postgres().await?;
    let TestBackend::Postgres(queue) = &db.kind else {
        anyhow::bail!("not PostgreSQL");
    };
    let batch = |first: &str, second: &str| {
        serde_json::json!([
            {"kind": "k", "outbox": first, "payload": {"n": 1}},
            {"kind": "k", "outbox": second, "payload": {"n": 2}},
        ])
        .to_string()
    };
    for _ in 0..5 {
        let mut a = queue.pool().begin().await?;
        let mut b = queue.pool().begin().await?;
        sqlx::query("SELECT * FROM enqueue_many($1::jsonb)")
            .bind(batch("x", "y"))
            .execute(&mut *a)
            .await?;
        let ids: Vec<i64> = tokio::time::timeout(
            std::time::Duration::from_secs(2),
            sqlx::query_scalar("SELECT * FROM enqueue_many($1::jsonb)")
                .bind(batch("y", "x"))
                .fetch_all(&mut *b),
        )
        .await
        .context("B waited for A")??;
        ensure!(ids.len() == 2 && ids[0] > 0, "{ids:?}");
        b.commit().await?;
        a.commit().await?;
    }
    Ok(())
}

/// Statements written against the contract's first version keep working
/// after every later migration (the compatibility window docs/producers.md
/// promises): each must still be accepted, or refused with its code.
async fn contract_version_1_statements_keep_working(db: TestDb) -> anyhow::Result<()> {
    db.queue.register_kinds(&registry()).await?;
    let accepted: &[(&str, &str)] = &[
        (
            "INSERT INTO laneway_ops (kind, outbox, payload, lanes, idempotency_key) VALUES ('email', 'shop', '{\"order\":\"o-17\"}', '[\"customer:c-3\"]', 'order-confirmed:o-17') ON CONFLICT DO NOTHING RETURNING id",
            "SELECT enqueue(kind => 'email', outbox => 'shop', payload => '{\"order\":\"o-17\"}', lanes => ARRAY['customer:c-3'], idempotency_key => 'order-confirmed:o-17')",
        ),
        (
            "INSERT INTO laneway_ops (kind, outbox, payload, lanes, priority, next_attempt_at, subject, correlation_id, coalesce_key) VALUES ('note', 'shop', 'null', '[]', 2, 4102444800000, 'user-7', 'tx-1', 'c-1')",
            "SELECT enqueue(kind => 'note', outbox => 'shop', payload => 'null', priority => 'low', not_before => '2100-01-01T00:00:00Z', delay_ms => 1000, subject => 'user-7', correlation_id => 'tx-1', coalesce_key => 'c-1')",
        ),
        (
            "SELECT version FROM laneway_contract WHERE id = 1",
            "SELECT * FROM enqueue_many('[{\"kind\":\"note\",\"outbox\":\"b\",\"payload\":[1]},{\"kind\":\"email\",\"outbox\":\"a\",\"payload\":{},\"lanes\":[\"l\"]}]')",
        ),
    ];
    for (sqlite, postgres) in accepted {
        let got = refusal(&db, sqlite, postgres).await?;
        ensure!(got.is_none(), "{sqlite} / {postgres}: {got:?}");
    }
    let version: i64 = match &db.kind {
        TestBackend::Sqlite(q) => {
            sqlx::query_scalar("SELECT version FROM laneway_contract")
                .fetch_one(q.pool())
                .await?
        }
        TestBackend::Postgres(q) => i64::from(
            sqlx::query_scalar::<_, i32>("SELECT contract_version()")
                .fetch_one(q.pool())
                .await?,
        ),
    };
    ensure!(version == 1, "{version}");
    Ok(())
}

/// A hand edit of any column laneway reads cannot make an op unreadable:
/// the database refuses it (SQLite's update trigger; PostgreSQL's types and
/// the times' CHECK), and the outbox reads on.
async fn a_hand_edit_cannot_make_an_op_unreadable(db: TestDb) -> anyhow::Result<()> {
    let id = db.queue.enqueue(&[NewOp::new("o", "k", "{}")]).await?[0].id();
    let edits: &[(&str, &str)] = &[
        (
            "UPDATE laneway_ops SET updated_at = 9223372036854775807",
            "UPDATE ops SET updated_at = 'infinity'",
        ),
        (
            "UPDATE laneway_ops SET next_attempt_at = '2026-12-07'",
            "UPDATE ops SET next_attempt_at = '-infinity'",
        ),
        (
            "UPDATE laneway_ops SET lease_until = 'soon'",
            "UPDATE ops SET finished_at = '10000-01-01'",
        ),
        (
            "UPDATE laneway_ops SET receipt = x'00'",
            "UPDATE ops SET lease_until = 'infinity'",
        ),
        (
            "UPDATE laneway_ops SET attempts = 'many'",
            "UPDATE ops SET next_attempt_at = '294276-01-01'",
        ),
    ];
    for (sqlite, postgres) in edits {
        let edit = db.tamper(&[sqlite], &[postgres]).await;
        ensure!(edit.is_err(), "{sqlite} / {postgres} was written");
    }
    ensure!(ops_in(&db, "o").await?.len() == 1);
    ensure!(db.queue.get(id).await?.is_some());
    Ok(())
}

/// Times a PostgreSQL laneway accepted before the contract and cannot read
/// ('infinity') are set aside by the migration that forbids them.
#[tokio::test]
async fn postgres_unreadable_times_from_before_the_contract_are_set_aside() -> anyhow::Result<()> {
    use sqlx::migrate::Migrator;
    let db = crate::support::postgres_unmigrated().await?;
    let TestBackend::Postgres(queue) = &db.kind else {
        anyhow::bail!("not PostgreSQL");
    };
    let dir = tempfile::tempdir()?;
    let all = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../migrations/postgres");
    for entry in std::fs::read_dir(&all)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.as_str() < "20261207000004" {
            std::fs::copy(all.join(&name), dir.path().join(&name))?;
        }
    }
    Migrator::new(dir.path()).await?.run(queue.pool()).await?;
    for statement in [
        "INSERT INTO ops (outbox, kind, payload, lanes) VALUES ('o', 'k', '{\"n\":1}', '{a}'), ('o', 'k', '{\"n\":2}', '{b}')",
        "UPDATE ops SET updated_at = 'infinity' WHERE payload::text = '{\"n\":1}'",
    ] {
        sqlx::query(statement).execute(queue.pool()).await?;
    }
    db.queue.migrate().await?;
    let ops = ops_in(&db, "o").await?;
    ensure!(ops.len() == 2, "{ops:?}");
    let bad = ops.iter().find(|o| o.payload == r#"{"n":1}"#).context("the bad op")?;
    ensure!(
        bad.status == Status::Failed && bad.last_error.as_deref().is_some_and(|e| e.starts_with("invalid: ")),
        "{bad:?}"
    );
    let attempts = db.queue.attempts(bad.id).await?;
    ensure!(
        attempts.len() == 1 && attempts[0].record.class == AttemptClass::Invalid,
        "{attempts:?}"
    );
    let groups = db.queue.dead_letter_groups().await?;
    ensure!(
        groups
            .iter()
            .any(|g| g.class == Some(AttemptClass::Invalid) && g.count == 1),
        "{groups:?}"
    );
    let good = ops.iter().find(|o| o.payload == r#"{"n":2}"#).context("the good op")?;
    ensure!(good.status == Status::Pending, "{good:?}");
    Ok(())
}
