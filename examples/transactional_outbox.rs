//! The transactional outbox with laneway as a library: a business row and the
//! op that delivers its side effect commit together, or not at all.
//!
//! Run with `cargo run --example transactional_outbox`; it uses a throwaway
//! SQLite file in the system temp directory.

use std::sync::Arc;

use anyhow::Context;
use laneway::clock::SystemClock;
use laneway::config;
use laneway::enqueue::{prepare, EnqueueRequest};
use laneway::op::Status;
use laneway::queue::sqlite::SqliteQueue;
use laneway::queue::{prelude::*, OpFilter};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("laneway-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut config = config::from_toml_str("")?;
    config.database.url = format!("sqlite://{}", dir.join("example.db").display());
    let queue = SqliteQueue::open(&config.database, config.limits(), Arc::new(SystemClock)).await?;
    queue.migrate().await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS ledger (id INTEGER PRIMARY KEY, entry TEXT NOT NULL)")
        .execute(queue.pool())
        .await?;

    // Commit a ledger entry and its fan-out to two participants in one transaction.
    let mut tx = queue.begin().await?;
    sqlx::query("INSERT INTO ledger (entry) VALUES ('entry-1')")
        .execute(&mut *tx)
        .await?;
    let mut ops = Vec::new();
    for inbox in ["https://finder.example/inbox", "https://vendor.example/inbox"] {
        ops.push(prepare(
            EnqueueRequest {
                kind: "activitypub".into(),
                outbox: "https://cm.example/actor".into(),
                lanes: vec![inbox.into()],
                payload: r#"{"type":"Announce","object":{"type":"CaseLedgerEntry","id":"urn:entry:1"}}"#.into(),
                coalesce_key: Some(format!("announce:entry-1:{inbox}")),
                correlation_id: Some("urn:entry:1".into()),
                ..EnqueueRequest::default()
            },
            &config,
        )?);
    }
    let enqueued = queue.enqueue_in(&mut tx, &ops).await?;
    tx.commit().await?;
    println!(
        "committed entry-1 with ops {:?}",
        enqueued.iter().map(|e| e.id()).collect::<Vec<_>>()
    );

    // A business transaction that fails takes its op with it.
    let mut tx = queue.begin().await?;
    sqlx::query("INSERT INTO ledger (entry) VALUES ('entry-2')")
        .execute(&mut *tx)
        .await?;
    queue.enqueue_in(&mut tx, &ops[..1]).await?;
    tx.rollback().await?;

    let pending = queue
        .list(&OpFilter {
            status: Some(Status::Pending),
            limit: 100,
            ..OpFilter::default()
        })
        .await?;
    println!("pending ops: {}", pending.len());
    anyhow::ensure!(pending.len() == 2, "expected exactly the committed fan-out");
    std::fs::remove_dir_all(&dir).context("removing the example database")?;
    Ok(())
}
