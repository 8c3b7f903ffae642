//! What laneway keeps per remote host stays bounded (Fedify's CVE-2026-69132
//! was unbounded per-remote-host state): the records shared through the
//! database are forgotten once nothing writes them (an operator's
//! suspension excepted), and the in-memory maps keyed by host, key id or
//! origin have a ceiling a flood of distinct names cannot pass.

use std::sync::Arc;

use anyhow::{ensure, Context};
use laneway::clock::Clock as _;
use laneway::queue::Expect;

use crate::support::{self, TestDb};

/// Records of every per-host namespace, written at day 0; one host
/// suspended by an operator; then 31 days on, one host written again: the
/// pruner forgets the rest and keeps those two.
async fn stale_remote_state_is_forgotten(db: TestDb) -> anyhow::Result<()> {
    let config = laneway::config::from_toml_str(
        "[plugins.ap]\npath = \"/nonexistent/ap.wasm\"\n[destinations]\nrate_per_second = 10.0\n",
    )?;
    let metrics = laneway::events::Metrics::default();
    let health = config.destinations.health();
    let apply = |host: String, event: laneway::health::Event<'static>| {
        let (queue, metrics, health) = (db.queue.clone(), &metrics, &health);
        let now = db.clock.now();
        async move { laneway::destinations::apply(queue.as_ref(), metrics, &host, &[event], "test", now, health).await }
    };
    let failed = laneway::health::Event::Failed { error: "refused" };
    // 500 distinct failing hosts, as a flood would leave them.
    for n in 0..500 {
        apply(format!("h{n}.example"), failed).await?;
    }
    apply(
        "held.example".to_owned(),
        laneway::health::Event::Suspend { reason: "abuse" },
    )
    .await?;
    laneway::destinations::inbox_gone(
        db.queue.as_ref(),
        &metrics,
        "g.example",
        "https://g.example/users/x/inbox",
        db.clock.now(),
        &health,
    )
    .await?;
    let put = |ns: &'static str, key: &'static str| db.queue.put_record(ns, key, "{}", Expect::Any);
    put("rate", "h1.example").await?;
    put("note:ap", "h1.example\u{1f}scheme").await?;
    put("note:other", "kept: not a configured plugin").await?;
    db.clock.advance(chrono::Duration::days(31));
    apply("h7.example".to_owned(), failed).await?;
    let pruner = laneway::pruner::Pruner::new(db.queue.clone(), Arc::new(db.clock.clone()));
    let report = pruner.run_once(&config, "host-a").await?.context("the lease")?;
    let left: Vec<String> = db
        .queue
        .records(laneway::destinations::HEALTH, None)
        .await?
        .into_iter()
        .map(|r| r.key)
        .collect();
    ensure!(left == ["h7.example", "held.example"], "{left:?}");
    ensure!(db.queue.records(laneway::destinations::INBOXES, None).await?.is_empty());
    ensure!(db.queue.records("rate", None).await?.is_empty());
    ensure!(db.queue.records("note:ap", None).await?.is_empty());
    ensure!(db.queue.records("note:other", None).await?.len() == 1);
    ensure!(report.forgotten == 499 + 1 + 1 + 1, "{report:?}");
    Ok(())
}

#[tokio::test]
async fn sqlite_stale_remote_state_is_forgotten() -> anyhow::Result<()> {
    stale_remote_state_is_forgotten(support::sqlite().await?).await
}

#[tokio::test]
async fn postgres_stale_remote_state_is_forgotten() -> anyhow::Result<()> {
    stale_remote_state_is_forgotten(support::postgres().await?).await
}

/// Key ids that cannot be fetched are remembered (so a flood naming one
/// costs one fetch), but no more of them than keys are cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfetchable_key_ids_are_remembered_within_the_cache_bound() -> anyhow::Result<()> {
    let config = laneway::config::from_toml_str(
        "[inbound]\nallowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1\"]\n",
    )?;
    // Nothing listens: every fetch fails at once.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let cache = laneway::inbound::KeyCache::new(
        laneway::inbound::key_client(&config.inbound).map_err(anyhow::Error::msg)?,
        laneway::inbound::KeySettings {
            capacity: 16,
            origin_rate: 1000.0,
            origin_burst: 1000,
            total_rate: 1000.0,
            total_burst: 1000,
            ..laneway::inbound::KeySettings::default()
        },
    );
    for n in 0..200 {
        let answer = cache
            .verify(&format!("http://127.0.0.1:{port}/users/u{n}#k"), b"d", b"s")
            .await;
        ensure!(answer.is_err());
    }
    ensure!(cache.failures_len() == 16, "{} remembered", cache.failures_len());
    ensure!(cache.is_empty());
    Ok(())
}
