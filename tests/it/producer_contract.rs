//! The producer contract (docs/producers.md) as a plain-SQL producer meets
//! it, on both backends: every row the drain could not read or run is
//! refused at insert with `laneway: CODE: …`, nothing of it is written, and
//! the outbox, its listing and its other ops go on; rows written before the
//! contract are set aside by the migration.

use anyhow::{ensure, Context};
use laneway::op::{Priority, Status};
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
    }
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
