//! laneway's own namespace in a PostgreSQL database an application shares:
//! a schema of its own beside the application's `ops` and `api_keys`; the
//! producer functions called from the application's search path, in its
//! transaction; and a laneway installed before schemas (in `public`) moved
//! into its schema whole, with nothing lost.

use std::sync::Arc;

use anyhow::{ensure, Context};
use laneway::op::Status;
use laneway::queue::{Enqueued, NewOp, OpFilter, Queue};
use sqlx::Connection;

use crate::support;

/// A database of its own, dropped afterwards: `public` is the
/// application's, as in a real deployment.
async fn scratch_database<F, Fut>(test: F) -> anyhow::Result<()>
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let name = format!("lwtest_ns_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(&support::pg_url()).await?;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await?;
    let base = support::pg_url();
    let base = base.split('?').next().unwrap_or_default();
    let url = format!("{}/{name}", base.rsplit_once('/').map_or(base, |(b, _)| b));
    let result = test(url).await;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(&mut admin)
        .await?;
    result
}

async fn open(url: &str, schema: Option<&str>) -> anyhow::Result<Arc<dyn Queue>> {
    let mut config = laneway::config::from_toml_str(&format!("[database]\nurl = {url:?}\n"))?;
    config.database.schema = schema.map(str::to_owned);
    config.database.max_connections = 2;
    Ok(laneway::queue::open(&config.database, config.limits(), Arc::new(laneway::clock::SystemClock)).await?)
}

/// An application with its own `ops` and `api_keys` tables: `laneway
/// migrate` leaves them alone, and the application enqueues with
/// `laneway.enqueue(...)` from its own search path, in its own transaction.
#[tokio::test]
async fn postgres_laneway_lives_beside_an_application_that_has_its_own_ops() -> anyhow::Result<()> {
    scratch_database(|url| async move {
        let mut app = sqlx::PgConnection::connect(&url).await?;
        sqlx::query("CREATE TABLE ops (id serial PRIMARY KEY, what text)").execute(&mut app).await?;
        sqlx::query("CREATE TABLE api_keys (id serial PRIMARY KEY, owner text)").execute(&mut app).await?;
        sqlx::query("CREATE TABLE orders (id text PRIMARY KEY)").execute(&mut app).await?;
        sqlx::query("INSERT INTO ops (what) VALUES ('the app''s own')").execute(&mut app).await?;

        let queue = open(&url, None).await?;
        queue.migrate().await?;
        queue.migrate().await?; // again: nothing to do
        let mut registry = laneway::queue::KindRegistry::priorities(&[("email", laneway::op::Priority::Normal)]);
        registry.max_payload_bytes = Some(1 << 20);
        queue.register_kinds(&registry).await?;
        let version: i32 = sqlx::query_scalar("SELECT laneway.contract_version()").fetch_one(&mut app).await?;
        ensure!(version == 1, "{version}");

        // Committed with the business row; rolled back with it.
        for (order, commit) in [("o-1", true), ("o-2", false)] {
            let mut tx = app.begin().await?;
            sqlx::query("INSERT INTO orders (id) VALUES ($1)").bind(order).execute(&mut *tx).await?;
            let id: i64 = sqlx::query_scalar(
                "SELECT laneway.enqueue(kind => 'email', outbox => 'shop', payload => $1::json, \
                 idempotency_key => 'order:' || $2)",
            )
            .bind(serde_json::json!({ "order": order }).to_string())
            .bind(order)
            .fetch_one(&mut *tx)
            .await?;
            ensure!(id > 0);
            if commit {
                tx.commit().await?;
            } else {
                tx.rollback().await?;
            }
        }
        let ops = queue
            .list(&OpFilter {
                outbox: Some("shop".to_owned()),
                limit: 10,
                ..OpFilter::default()
            })
            .await?;
        ensure!(ops.len() == 1 && ops[0].idempotency_key.as_deref() == Some("order:o-1"), "{ops:?}");
        // The application's tables are its own still.
        let what: String = sqlx::query_scalar("SELECT what FROM public.ops").fetch_one(&mut app).await?;
        ensure!(what == "the app's own");
        let stray: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename NOT IN ('ops', 'api_keys', 'orders')",
        )
        .fetch_one(&mut app)
        .await?;
        ensure!(stray == 0, "laneway left {stray} tables in public");
        // A refusal from the application's connection names what to change.
        let refused = sqlx::query("SELECT laneway.enqueue(kind => 'emial', outbox => 'shop', payload => '{}')")
            .execute(&mut app)
            .await
            .err()
            .context("an unknown kind was enqueued")?;
        let db = refused.as_database_error().context("a database error")?;
        ensure!(db.code().as_deref() == Some("LW002") && db.message().contains("unknown_kind"), "{db}");
        Ok(())
    })
    .await
}

/// A database laneway set up before schemas (everything in `public`, its
/// history in a `_sqlx_migrations` the application shares) moves into
/// `laneway` on `migrate`: every op, attempt, hold, tombstone, outcome and
/// key comes along, ids continue, and the application's history stays.
#[tokio::test]
async fn postgres_a_laneway_from_before_schemas_moves_into_its_own() -> anyhow::Result<()> {
    use sqlx::migrate::Migrator;
    scratch_database(|url| async move {
        let dir = tempfile::tempdir()?;
        let all = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../migrations/postgres");
        for entry in std::fs::read_dir(&all)? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if name.as_str() < "20261207000001" {
                std::fs::copy(all.join(&name), dir.path().join(&name))?;
            }
        }
        let pool = sqlx::PgPool::connect(&url).await?;
        Migrator::new(dir.path()).await?.run(&pool).await?;
        // The application's own migration in the same history table.
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES (1, 'app', true, '\\x00', 0)",
        )
        .execute(&pool)
        .await?;
        for statement in [
            "INSERT INTO ops (outbox, kind, lanes, payload, idempotency_key) VALUES ('o', 'k', '{L}', '{\"n\":1}', 'a')",
            "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('o', 'k', '{L}', '{\"n\":2}')",
            "INSERT INTO ops (outbox, kind, lanes, payload) VALUES ('o', 'k', '{M}', '{\"n\":3}')",
            "UPDATE ops SET status = 'failed', attempts = 1, finished_at = now() WHERE payload::text = '{\"n\":1}'",
            "INSERT INTO attempts (op_id, attempt, started_at, finished_at, outcome) \
             SELECT id, 1, now(), now(), 'permanent' FROM ops WHERE payload::text = '{\"n\":1}'",
            "INSERT INTO lane_halts (outbox, lane, op_id, halted_at) SELECT 'o', 'L', id, now() FROM ops WHERE payload::text = '{\"n\":1}'",
            "UPDATE ops SET status = 'submitted', lease_token = gen_random_uuid(), lease_until = now() + interval '1 min' \
             WHERE payload::text = '{\"n\":3}'",
            "INSERT INTO idempotency_tombstones (outbox, idempotency_key, op_id, kind, status, finished_at) \
             VALUES ('o', 'gone', 0, 'k', 'confirmed', now())",
        ] {
            sqlx::query(statement).execute(&pool).await?;
        }
        pool.close().await;

        let queue = open(&url, None).await?;
        queue.migrate().await?;
        queue.check_schema().await?;
        let ops = queue
            .list(&OpFilter {
                limit: 10,
                ..OpFilter::default()
            })
            .await?;
        let mut status: Vec<(i64, String, Status)> = ops.iter().map(|o| (o.id, o.payload.clone(), o.status)).collect();
        status.sort_unstable_by_key(|(id, _, _)| *id);
        let states: Vec<(&str, Status)> = status.iter().map(|(_, p, s)| (p.as_str(), *s)).collect();
        ensure!(
            states == vec![(r#"{"n":1}"#, Status::Failed), (r#"{"n":2}"#, Status::Pending), (r#"{"n":3}"#, Status::Submitted)],
            "{status:?}"
        );
        let first = status[0].0;
        let last = status[2].0;
        ensure!(queue.attempts(first).await?.len() == 1);
        ensure!(queue.lane_halts(None).await?.len() == 1);
        let next = queue
            .enqueue(&[NewOp {
                lanes: vec!["L".into()],
                ..NewOp::new("o", "k", "{}")
            }])
            .await?;
        ensure!(matches!(next[..], [Enqueued::Created(id)] if id > last), "{next:?}");
        let pruned = queue
            .enqueue(&[NewOp {
                idempotency_key: Some("gone".into()),
                ..NewOp::new("o", "k", "{}")
            }])
            .await?;
        ensure!(pruned == vec![Enqueued::Existing(0)], "the tombstone moved: {pruned:?}");

        let mut app = sqlx::PgConnection::connect(&url).await?;
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
            .fetch_one(&mut app)
            .await?;
        ensure!(left == 1, "public keeps only the application's history table, has {left}");
        let history: Vec<i64> = sqlx::query_scalar("SELECT version FROM public._sqlx_migrations")
            .fetch_all(&mut app)
            .await?;
        ensure!(history == vec![1], "{history:?}");
        // (Read directly: the feed serves a row only once no older
        // transaction is open on the cluster, and the parallel tests' are.)
        let outcomes: i64 = sqlx::query_scalar("SELECT count(*) FROM laneway.outcomes")
            .fetch_one(&mut app)
            .await?;
        ensure!(outcomes == 1, "the outcome feed's rows moved: {outcomes}");
        let functions: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_proc WHERE pronamespace = 'public'::regnamespace")
                .fetch_one(&mut app)
                .await?;
        ensure!(functions == 0, "{functions} functions left in public");
        // A plain insert from the application's search path runs laneway's
        // triggers against laneway's tables.
        let id: i64 = sqlx::query_scalar("SELECT laneway.enqueue(kind => 'k', outbox => 'o', payload => '{}')")
            .fetch_one(&mut app)
            .await?;
        ensure!(queue.get(id).await?.is_some());
        Ok(())
    })
    .await
}
