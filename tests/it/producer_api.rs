//! The HTTP API as a producer's tenant sees it: a key limited to named
//! outboxes enqueues there and reads those outcomes, and nothing of any
//! other outbox, on both backends.

use std::time::Duration;

use anyhow::{ensure, Context};
use laneway::api::auth;
use serde_json::Value;

use crate::api::Served;
use crate::dispatch::harness::{settle, Scripted};
use crate::support::TestDb;

async fn a_key_limited_to_outboxes_enqueues_and_reads_only_there(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(&db, &exec, "").await?;
    let scopes = ["ops:write".to_owned(), "outcomes:read".to_owned()];
    let minted = auth::mint_for("shop", &scopes, &["shop".to_owned()]).map_err(anyhow::Error::msg)?;
    served.queue.create_api_key(&minted.stored).await?;
    let shop = minted.secret;
    let other = served.key("billing", &["ops:write", "outcomes:read"]).await?;
    let op = |outbox: &str, n: u32| {
        format!(
            r#"{{"kind":"activitypub","outbox":"{outbox}","lanes":["https://a.example/inbox"],"payload":{{"n":{n}}}}}"#
        )
    };
    let (status, created) = served
        .call("POST", "/api/v1/ops", Some(&shop), Some(&op("shop", 1)))
        .await?;
    ensure!(status == 201, "{status} {created}");
    for body in [
        op("billing", 2),
        format!(r#"{{"ops":[{},{}]}}"#, op("shop", 3), op("billing", 4)),
    ] {
        let (status, refused) = served.call("POST", "/api/v1/ops", Some(&shop), Some(&body)).await?;
        ensure!(
            status == 403 && refused["error"]["code"] == "forbidden",
            "{status} {refused}"
        );
    }
    let fanout = r#"{"outbox":"billing","activity":{"id":"https://b.example/1","type":"Note"},"recipients":["https://c.example/inbox"]}"#;
    let (status, refused) = served
        .call("POST", "/api/v1/activitypub/deliveries", Some(&shop), Some(fanout))
        .await?;
    ensure!(status == 403, "{status} {refused}");
    // Another tenant's op, and both settle.
    let (status, _) = served
        .call("POST", "/api/v1/ops", Some(&other), Some(&op("billing", 5)))
        .await?;
    ensure!(status == 201);
    settle(served.queue.as_ref(), Duration::from_secs(10)).await?;
    let outboxes_seen = |page: &Value| -> anyhow::Result<Vec<String>> {
        Ok(page["outcomes"]
            .as_array()
            .context("outcomes")?
            .iter()
            .filter_map(|e| e["op"]["outbox"].as_str().map(str::to_owned))
            .collect())
    };
    // The feed shows the limited key its own outbox's outcomes only (on
    // PostgreSQL a row is served once older transactions on the cluster end).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (_, everything) = served
            .call("GET", "/api/v1/outcomes?limit=100", Some(&other), None)
            .await?;
        if outboxes_seen(&everything)?.len() == 2 {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the feed never showed both: {everything}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, page) = served
        .call("GET", "/api/v1/outcomes?limit=100", Some(&shop), None)
        .await?;
    ensure!(status == 200 && outboxes_seen(&page)? == ["shop"], "{status} {page}");
    let (status, refused) = served
        .call("GET", "/api/v1/outcomes?outbox=billing", Some(&shop), None)
        .await?;
    ensure!(status == 403, "{status} {refused}");
    // An operator's scope cannot be limited: refused when the key is made.
    let admin = auth::mint_for("x", &["outbox:read".to_owned()], &["shop".to_owned()]);
    ensure!(admin.is_err(), "a limited key with an operator's scope");
    served.running.stop().await
}

crate::on_both_backends!(live: a_key_limited_to_outboxes_enqueues_and_reads_only_there);
