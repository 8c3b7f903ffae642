//! The HTTP API over a running dispatcher, on both backends: the auth
//! matrix, the producer route, bad input (a 4xx with a code, never a 5xx,
//! never a changed row), pauses, bulk recover and `/metrics`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use laneway::api::{self, auth, ApiState};
use laneway::op::Status;
use laneway::queue::{OpFilter, Queue};
use serde_json::Value;

use crate::dispatch::harness::{fast_config, settle, to, Running, Scripted, Step};
use crate::support::TestDb;

crate::on_both_backends!(
    live: every_admin_route_asks_for_its_scope,
    the_producer_route_enqueues_once_per_key_and_refuses_bad_input,
    a_paused_kind_resumes_where_it_stopped_with_no_attempt_used,
    a_bulk_recover_of_ten_thousand_dead_letters_is_spread_and_audited,
    metrics_after_a_workload_carry_the_seed_names_and_labels,
);

/// A dispatcher and its API on a free local port.
struct Served {
    running: Running,
    base: String,
    http: reqwest::Client,
    queue: Arc<dyn Queue>,
}

impl Served {
    async fn start(db: &TestDb, exec: &Scripted, extra: &str) -> anyhow::Result<Self> {
        let config = fast_config(extra)?;
        let running = Running::start(db.queue.clone(), exec.registry(&["activitypub"]), config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let state = ApiState::new(running.dispatcher.clone());
        let stop = running.dispatcher.clone();
        tokio::spawn(async move { api::serve(listener, state, async move { stop.cancelled().await }).await });
        Ok(Self {
            running,
            base,
            http: reqwest::Client::new(),
            queue: db.queue.clone(),
        })
    }

    async fn key(&self, name: &str, scopes: &[&str]) -> anyhow::Result<String> {
        let scopes: Vec<String> = scopes.iter().map(|s| (*s).to_owned()).collect();
        let minted = auth::mint(name, &scopes).map_err(anyhow::Error::msg)?;
        self.queue.create_api_key(&minted.stored).await?;
        Ok(minted.secret)
    }

    /// Sends a request; returns the status and the JSON body (or the text
    /// as a JSON string when it is not JSON).
    async fn call(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: Option<&str>,
    ) -> anyhow::Result<(u16, Value)> {
        let url = format!("{}{path}", self.base);
        let mut request = match method {
            "GET" => self.http.get(&url),
            "POST" => self.http.post(&url),
            "DELETE" => self.http.delete(&url),
            other => anyhow::bail!("method {other}"),
        };
        if let Some(key) = key {
            request = request.header("authorization", format!("Bearer {key}"));
        }
        if let Some(body) = body {
            request = request.header("content-type", "application/json").body(body.to_owned());
        }
        let response = request.send().await?;
        let status = response.status().as_u16();
        let text = response.text().await?;
        let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok((status, value))
    }
}

fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("")
}

async fn every_admin_route_asks_for_its_scope(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(&db, &exec, "").await?;
    let reader = served.key("reader", &["outbox:read"]).await?;
    let writer = served.key("writer", &["outbox:write"]).await?;
    let producer = served.key("producer", &["ops:write"]).await?;
    let op = r#"{"kind":"activitypub","outbox":"o","lanes":["https://a.example/inbox"],"payload":{}}"#;
    let routes: [(&str, &str, Option<&str>, &str); 8] = [
        ("GET", "/api/admin/outbox", None, "outbox:read"),
        ("GET", "/api/admin/outbox/stats", None, "outbox:read"),
        ("GET", "/api/admin/audit", None, "outbox:read"),
        ("GET", "/api/admin/pauses", None, "outbox:read"),
        ("GET", "/api/admin/breakers", None, "outbox:read"),
        (
            "POST",
            "/api/admin/outbox/recover",
            Some(r#"{"dry_run":true}"#),
            "outbox:write",
        ),
        (
            "POST",
            "/api/admin/pauses",
            Some(r#"{"scope":"kind","target":"nothing"}"#),
            "outbox:write",
        ),
        ("POST", "/api/v1/ops", Some(op), "ops:write"),
    ];
    for (method, path, body, scope) in routes {
        let (status, answer) = served.call(method, path, None, body).await?;
        ensure!(
            status == 401 && code(&answer) == "unauthorized",
            "{path} without a key: {status} {answer}"
        );
        let (status, _) = served.call(method, path, Some("lw_nope_nope"), body).await?;
        ensure!(status == 401, "{path} with an unknown key: {status}");
        let forged = format!("{}x", &reader);
        let (status, _) = served.call(method, path, Some(&forged), body).await?;
        ensure!(status == 401, "{path} with a wrong secret: {status}");
        let (right, wrong) = match scope {
            "outbox:read" => (&reader, &writer),
            "outbox:write" => (&writer, &reader),
            _ => (&producer, &reader),
        };
        let (status, answer) = served.call(method, path, Some(wrong), body).await?;
        ensure!(
            status == 403 && code(&answer) == "forbidden",
            "{path} without {scope}: {status} {answer}"
        );
        let (status, answer) = served.call(method, path, Some(right), body).await?;
        ensure!((200..300).contains(&status), "{path} with {scope}: {status} {answer}");
    }
    // A revoked key authenticates nothing.
    ensure!(served.queue.revoke_api_key("reader").await?);
    let (status, _) = served.call("GET", "/api/admin/outbox", Some(&reader), None).await?;
    ensure!(status == 401, "a revoked key: {status}");
    // The open routes need none.
    for path in ["/healthz", "/metrics", "/api/v1/network/conditions"] {
        let (status, answer) = served.call("GET", path, None, None).await?;
        ensure!(status == 200, "{path}: {status} {answer}");
    }
    served.running.stop().await
}

async fn the_producer_route_enqueues_once_per_key_and_refuses_bad_input(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(&db, &exec, "[api]\nmax_body_bytes = 4096\n").await?;
    let producer = served.key("producer", &["ops:write"]).await?;
    let admin = served.key("admin", &["outbox:read", "outbox:write"]).await?;
    let op = r#"{"kind":"activitypub","outbox":"o","lanes":["https://a.example/inbox"],"payload":{"n":1},"idempotency_key":"k1"}"#;
    let (status, first) = served.call("POST", "/api/v1/ops", Some(&producer), Some(op)).await?;
    ensure!(status == 201 && first["status"] == "created", "{status} {first}");
    let id = first["id"].as_i64().context("an id")?;
    ensure!(first["op"]["payload"] == r#"{"n":1}"#, "the op as stored: {first}");
    let (status, again) = served.call("POST", "/api/v1/ops", Some(&producer), Some(op)).await?;
    ensure!(
        status == 200 && again["status"] == "existing" && again["id"] == id,
        "{status} {again}"
    );
    settle(served.queue.as_ref(), Duration::from_secs(10)).await?;
    let batch = r#"{"ops":[{"kind":"activitypub","outbox":"o","lanes":["https://a.example/inbox"],"payload":{"n":2}},{"kind":"activitypub","outbox":"o","lanes":["https://a.example/inbox"],"payload":{"n":3}}]}"#;
    let (status, answer) = served.call("POST", "/api/v1/ops", Some(&producer), Some(batch)).await?;
    ensure!(
        status == 200 && answer["results"].as_array().map(Vec::len) == Some(2),
        "{status} {answer}"
    );
    settle(served.queue.as_ref(), Duration::from_secs(10)).await?;
    let count = |q: Arc<dyn Queue>| async move {
        Ok::<usize, anyhow::Error>(
            q.list(&OpFilter {
                limit: 1000,
                ..OpFilter::default()
            })
            .await?
            .len(),
        )
    };
    let before = count(served.queue.clone()).await?;
    ensure!(before == 3, "three ops, got {before}");
    let big = format!(
        r#"{{"kind":"activitypub","outbox":"o","lanes":["x"],"payload":"{}"}}"#,
        "a".repeat(8000)
    );
    let bad: Vec<(&str, String, u16, &str)> = vec![
        ("/api/v1/ops", "{not json".to_owned(), 400, "invalid_json"),
        ("/api/v1/ops", r#"{"kind":"activitypub","outbox":"o","payload":{},"colour":"red"}"#.to_owned(), 400, "invalid_request"),
        ("/api/v1/ops", r#"{"kind":7,"outbox":"o","payload":{}}"#.to_owned(), 400, "invalid_request"),
        ("/api/v1/ops", r#"{"kind":"teleport","outbox":"o","lanes":["x"],"payload":{}}"#.to_owned(), 422, "unknown_kind"),
        ("/api/v1/ops", r#"{"kind":"activitypub","outbox":"o","payload":{}}"#.to_owned(), 422, "lanes_required"),
        ("/api/v1/ops", r#"{"ops":[{"kind":"activitypub","outbox":"o","lanes":["x"],"payload":{}},{"kind":"teleport","outbox":"o","lanes":["x"],"payload":{}}]}"#.to_owned(), 422, "unknown_kind"),
        ("/api/v1/ops", r#"{"ops":[]}"#.to_owned(), 400, "invalid_request"),
        ("/api/v1/ops", big, 413, "body_too_large"),
    ];
    for (path, body, want, want_code) in &bad {
        let (status, answer) = served.call("POST", path, Some(&producer), Some(body)).await?;
        ensure!(
            status == *want && code(&answer) == *want_code,
            "{body:.80}: {status} {answer}"
        );
    }
    let reads: [(&str, u16, &str); 7] = [
        ("/api/admin/outbox?limit=100000", 400, "invalid_request"),
        ("/api/admin/outbox?limit=abc", 400, "invalid_query"),
        (
            "/api/admin/outbox?status=pending';DROP TABLE ops;--",
            400,
            "invalid_query",
        ),
        ("/api/admin/outbox?colour=red", 400, "invalid_query"),
        ("/api/admin/outbox/1%3BDROP%20TABLE%20ops", 400, "invalid_request"),
        ("/api/admin/outbox/999999", 404, "not_found"),
        ("/api/admin/nothing", 404, "not_found"),
    ];
    for (path, want, want_code) in reads {
        let (status, answer) = served.call("GET", path, Some(&admin), None).await?;
        ensure!(
            status == want && code(&answer) == want_code,
            "{path}: {status} {answer}"
        );
    }
    let (status, answer) = served
        .call(
            "POST",
            "/api/admin/outbox/recover",
            Some(&admin),
            Some(r#"{"dry_run":true,"colour":1}"#),
        )
        .await?;
    ensure!(
        status == 400 && code(&answer) == "invalid_request",
        "recover, unknown field: {status} {answer}"
    );
    let (status, answer) = served
        .call(
            "POST",
            "/api/admin/pauses",
            Some(&admin),
            Some(r#"{"scope":"planet","target":"x"}"#),
        )
        .await?;
    ensure!(
        status == 400 && code(&answer) == "invalid_request",
        "pause, bad scope: {status} {answer}"
    );
    // A subject filter that looks like SQL is only a string that matches nothing.
    let (status, answer) = served
        .call(
            "GET",
            "/api/admin/outbox?subject=x%27%20OR%201%3D1%20--",
            Some(&admin),
            None,
        )
        .await?;
    ensure!(
        status == 200 && answer["ops"].as_array().is_some_and(Vec::is_empty),
        "{status} {answer}"
    );
    // Cancel is for pending ops only: a confirmed op is a 409, unchanged.
    let (status, answer) = served
        .call("POST", &format!("/api/admin/outbox/{id}/cancel"), Some(&admin), None)
        .await?;
    ensure!(status == 409, "cancel of a confirmed op: {status} {answer}");
    let after = count(served.queue.clone()).await?;
    ensure!(after == before, "bad input changed the queue: {before} -> {after} ops");
    let op_now = served.queue.get(id).await?.context("the op")?;
    ensure!(op_now.status == Status::Confirmed, "{:?}", op_now.status);
    // Paging: a page of one, then the next.
    let (_, page) = served
        .call("GET", "/api/admin/outbox?limit=1", Some(&admin), None)
        .await?;
    let next = page["next"].as_i64().context("a cursor")?;
    let (_, page2) = served
        .call(
            "GET",
            &format!("/api/admin/outbox?limit=1&after={next}"),
            Some(&admin),
            None,
        )
        .await?;
    ensure!(page2["ops"][0]["id"].as_i64() > Some(next), "{page2}");
    served.running.stop().await
}

async fn a_paused_kind_resumes_where_it_stopped_with_no_attempt_used(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(&db, &exec, "").await?;
    let admin = served.key("admin", &["outbox:read", "outbox:write"]).await?;
    let (status, answer) = served
        .call(
            "POST",
            "/api/admin/pauses",
            Some(&admin),
            Some(r#"{"scope":"kind","target":"activitypub","reason":"incident"}"#),
        )
        .await?;
    ensure!(status == 200 && answer["paused"] == true, "{status} {answer}");
    let ops: Vec<_> = (0..5).map(|n| to("o", "https://a.example/inbox", n)).collect();
    served.running.dispatcher.enqueue(&ops).await?;
    // Many polls (25 ms) and full reads go by: nothing may start.
    tokio::time::sleep(Duration::from_millis(600)).await;
    ensure!(exec.started().is_empty(), "a paused kind ran: {:?}", exec.started());
    let pending = served
        .queue
        .list(&OpFilter {
            status: Some(Status::Pending),
            limit: 100,
            ..OpFilter::default()
        })
        .await?;
    ensure!(
        pending.len() == 5 && pending.iter().all(|o| o.attempts == 0),
        "{pending:?}"
    );
    let (status, _) = served
        .call("DELETE", "/api/admin/pauses/kind/activitypub", Some(&admin), None)
        .await?;
    ensure!(status == 200, "resume: {status}");
    let (status, answer) = served
        .call("DELETE", "/api/admin/pauses/kind/activitypub", Some(&admin), None)
        .await?;
    ensure!(
        status == 404 && code(&answer) == "not_found",
        "resume twice: {status} {answer}"
    );
    settle(served.queue.as_ref(), Duration::from_secs(10)).await?;
    let order: Vec<i64> = exec.delivered().iter().map(|e| e.op).collect();
    let mut sorted = order.clone();
    sorted.sort_unstable();
    ensure!(
        order.len() == 5 && order == sorted,
        "delivered in enqueue order once each: {order:?}"
    );
    for op in served
        .queue
        .list(&OpFilter {
            limit: 100,
            ..OpFilter::default()
        })
        .await?
    {
        ensure!(op.attempts == 1, "op {} took {} attempts", op.id, op.attempts);
    }
    let (_, audit) = served.call("GET", "/api/admin/audit", Some(&admin), None).await?;
    let actions: Vec<&str> = audit["entries"]
        .as_array()
        .context("entries")?
        .iter()
        .filter_map(|e| e["action"].as_str())
        .collect();
    ensure!(actions == ["resume", "pause"], "{audit}");
    ensure!(audit["entries"][1]["actor"] == "key:admin", "{audit}");
    served.running.stop().await
}

async fn a_bulk_recover_of_ten_thousand_dead_letters_is_spread_and_audited(db: TestDb) -> anyhow::Result<()> {
    const N: usize = 10_000;
    let exec = Scripted::new(0);
    let served = Served::start(
        &db,
        &exec,
        "[kinds.activitypub]\nmax_attempts = 1\n[api]\nrecover_per_second = 1000\n",
    )
    .await?;
    let admin = served.key("admin", &["outbox:read", "outbox:write"]).await?;
    let ops: Vec<_> = (0..N)
        .map(|n| {
            to(
                &format!("o{}", n % 8),
                &format!("https://h{}.example/inbox", n % 500),
                n as u32,
            )
        })
        .collect();
    // Paused while the ops are scripted to fail, so none runs unscripted.
    served
        .queue
        .pause(laneway::queue::PauseScope::Kind, "activitypub", None, "test")
        .await?;
    let mut ids = Vec::new();
    for chunk in ops.chunks(1000) {
        for result in served.running.dispatcher.enqueue(chunk).await? {
            if let laneway::queue::Enqueued::Created(id) = result {
                ids.push(id);
            }
        }
    }
    for id in &ids {
        exec.script(*id, [Step::Permanent]);
    }
    served
        .queue
        .resume(laneway::queue::PauseScope::Kind, "activitypub")
        .await?;
    settle(served.queue.as_ref(), Duration::from_secs(120)).await?;
    // No dispatcher may pick the recovered ops up while this test counts them.
    let (status, _) = served
        .call(
            "POST",
            "/api/admin/pauses",
            Some(&admin),
            Some(r#"{"scope":"kind","target":"activitypub"}"#),
        )
        .await?;
    ensure!(status == 200);
    let (status, dry) = served
        .call(
            "POST",
            "/api/admin/outbox/recover",
            Some(&admin),
            Some(r#"{"kind":"activitypub","dry_run":true}"#),
        )
        .await?;
    ensure!(
        status == 200 && dry["would_recover"].as_array().map(Vec::len) == Some(N),
        "{status}: {} would be recovered, {} left out",
        dry["would_recover"].as_array().map_or(0, Vec::len),
        dry["unknown_left_out"]
    );
    let failed = |q: Arc<dyn Queue>| async move {
        Ok::<usize, anyhow::Error>(
            q.list(&OpFilter {
                status: Some(Status::Failed),
                limit: 20_000,
                ..OpFilter::default()
            })
            .await?
            .len(),
        )
    };
    ensure!(failed(served.queue.clone()).await? == N, "a dry run changed nothing");
    let started = chrono::Utc::now();
    let (status, answer) = served
        .call(
            "POST",
            "/api/admin/outbox/recover",
            Some(&admin),
            Some(r#"{"kind":"activitypub"}"#),
        )
        .await?;
    ensure!(status == 200, "{status} {answer}");
    ensure!(
        answer["recovered"].as_array().map(Vec::len) == Some(N),
        "{}",
        answer["skipped"]
    );
    ensure!(answer["over_seconds"] == N / 1000, "{}", answer["over_seconds"]);
    let pending = served
        .queue
        .list(&OpFilter {
            status: Some(Status::Pending),
            limit: 20_000,
            ..OpFilter::default()
        })
        .await?;
    ensure!(pending.len() == N, "{} pending", pending.len());
    // 1000 a second: at most 1000 are due in any one second of the spread.
    for second in 0..10 {
        let from = started + chrono::Duration::seconds(second);
        let due = pending
            .iter()
            .filter(|o| o.next_attempt_at >= from && o.next_attempt_at < from + chrono::Duration::seconds(1))
            .count();
        ensure!(due <= 1000 + 1000 / 10, "second {second}: {due} due");
    }
    let latest = pending.iter().map(|o| o.next_attempt_at).max().context("a due time")?;
    ensure!(
        latest >= started + chrono::Duration::seconds(8),
        "spread over ~9 s: latest {latest}"
    );
    let entries = served.queue.audit_log(None, 10).await?;
    let recover = entries
        .iter()
        .find(|e| e.action == "op.recover")
        .context("a recover entry")?;
    ensure!(recover.actor == "key:admin");
    ensure!(
        recover
            .after
            .as_ref()
            .and_then(|a| a["recovered"].as_array())
            .map(Vec::len)
            == Some(N)
    );
    served.running.stop().await
}

async fn metrics_after_a_workload_carry_the_seed_names_and_labels(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(&db, &exec, "[kinds.activitypub]\nmax_attempts = 2\n").await?;
    let ops: Vec<_> = (0..3)
        .map(|n| to("o", &format!("https://h{n}.example/inbox"), n))
        .collect();
    let ids: Vec<i64> = served
        .running
        .dispatcher
        .enqueue(&ops)
        .await?
        .into_iter()
        .filter_map(|r| match r {
            laneway::queue::Enqueued::Created(id) => Some(id),
            _ => None,
        })
        .collect();
    ensure!(ids.len() == 3);
    exec.script(ids[0], [Step::Ok]);
    exec.script(ids[1], [Step::Retry, Step::Ok]);
    exec.script(ids[2], [Step::Permanent]);
    settle(served.queue.as_ref(), Duration::from_secs(10)).await?;
    let text = served
        .http
        .get(format!("{}/metrics", served.base))
        .send()
        .await?
        .text()
        .await?;
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).context("parse /metrics")?;
    let samples = |name: &'static str| scrape.samples.iter().filter(move |s| s.metric == name);
    let ops_total = |outcome: &str| -> f64 {
        samples("outbox_ops_total")
            .filter(|s| s.labels.get("kind") == Some("activitypub") && s.labels.get("priority") == Some("normal"))
            .filter(|s| s.labels.get("outcome") == Some(outcome))
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
                _ => 0.0,
            })
            .sum()
    };
    ensure!(
        ops_total("confirmed") == 2.0,
        "confirmed: {}\n{text}",
        ops_total("confirmed")
    );
    ensure!(ops_total("retry") == 1.0, "retry\n{text}");
    ensure!(ops_total("failed") == 1.0, "failed\n{text}");
    ensure!(
        samples("outbox_queue_depth")
            .any(|s| s.labels.get("status") == Some("confirmed") && s.labels.get("priority") == Some("normal")),
        "depth\n{text}"
    );
    ensure!(
        scrape
            .samples
            .iter()
            .any(|s| s.metric.starts_with("outbox_op_latency_seconds") && s.labels.get("kind") == Some("activitypub")),
        "latency\n{text}"
    );
    // Every name of seed 003's list is exported (those with nothing to count
    // yet as their HELP and TYPE lines).
    for name in [
        "outbox_ops",
        "outbox_queue_depth",
        "outbox_op_latency_seconds",
        "outbox_fee_bump",
        "outbox_stuck_submitted",
        "fee_oracle_recommended_base_fee",
        "fee_oracle_aggressive_base_fee",
        "fee_oracle_ledger_capacity_usage",
        "fee_oracle_congestion_level",
        "fee_oracle_staleness_seconds",
        "outbox_low_deferred",
        "outbox_aggressive_fee_used",
        "outbox_max_fee_hit",
    ] {
        ensure!(text.contains(&format!("# TYPE {name} ")), "{name} missing\n{text}");
    }
    served.running.stop().await
}
