//! The HTTP API over a running dispatcher, on both backends: the OpenAPI
//! document against the routes and their scopes, the auth matrix, the
//! producer and fan-out routes, filters and stats, bad input (a 4xx with a
//! code, never a 5xx, never a changed row), pauses, breakers by hand, the
//! plugin routes, bulk recover and `/metrics`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use laneway::api::auth;
use laneway::config::FileSource;
use laneway::op::Status;
use laneway::queue::{prelude::*, OpFilter};
use laneway::runtime::host::PluginHost;
use serde_json::Value;

use crate::dispatch::harness::{fast_config, settle, to, Running, Scripted, Step};
use crate::support::TestDb;

crate::on_both_backends!(
    live: every_admin_route_asks_for_its_scope,
    the_producer_route_enqueues_once_per_key_and_refuses_bad_input,
    a_paused_kind_resumes_where_it_stopped_with_no_attempt_used,
    a_bulk_recover_of_ten_thousand_dead_letters_is_spread_and_audited,
    metrics_after_a_workload_carry_the_seed_names_and_labels,
    the_openapi_document_names_every_route_and_each_asks_for_its_scope,
    the_fanout_route_and_the_list_filters_find_what_was_enqueued,
    a_breaker_opened_by_hand_holds_its_destination_until_closed,
    the_plugin_routes_show_digests_and_a_refused_reload_changes_nothing,
    the_cli_acts_through_the_api_with_a_key_and_no_database,
    hostile_producer_input_is_refused_quickly_and_changes_nothing,
    an_activity_is_stored_and_sent_byte_for_byte,
    slow_and_endless_requests_are_cut_off_and_health_still_answers,
);

/// A dispatcher and its API on a free local port.
pub(crate) struct Served {
    pub(crate) running: Running,
    pub(crate) base: String,
    pub(crate) http: reqwest::Client,
    pub(crate) queue: Arc<dyn Queue>,
}

impl Served {
    pub(crate) async fn start(db: &TestDb, exec: &Scripted, extra: &str) -> anyhow::Result<Self> {
        let config = fast_config(extra)?;
        Self::over(db, exec.registry(&["activitypub"]), config, None).await
    }

    pub(crate) async fn over(
        db: &TestDb,
        executors: Arc<laneway::executor::Registry>,
        config: laneway::config::Config,
        plugins: Option<(Arc<PluginHost>, FileSource)>,
    ) -> anyhow::Result<Self> {
        let (running, addr) = Running::with_api(db.queue.clone(), executors, plugins, config).await?;
        let base = format!("http://{addr}");
        Ok(Self {
            running,
            base,
            http: reqwest::Client::new(),
            queue: db.queue.clone(),
        })
    }

    pub(crate) async fn key(&self, name: &str, scopes: &[&str]) -> anyhow::Result<String> {
        let scopes: Vec<String> = scopes.iter().map(|s| (*s).to_owned()).collect();
        let minted = auth::mint(name, &scopes).map_err(anyhow::Error::msg)?;
        self.queue.create_api_key(&minted.stored).await?;
        Ok(minted.secret)
    }

    /// Sends a request; returns the status and the JSON body (or the text
    /// as a JSON string when it is not JSON).
    pub(crate) async fn call(
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

/// How many ops there are (up to a thousand).
async fn op_count(queue: &dyn Queue) -> anyhow::Result<usize> {
    Ok(queue
        .list(&OpFilter {
            limit: 1000,
            ..OpFilter::default()
        })
        .await?
        .len())
}

pub(crate) fn code(body: &Value) -> &str {
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
    // The same key for another payload, kind or lanes is a mistake, not a
    // repeat: refused, and nothing written.
    for other in [
        op.replace(r#"{"n":1}"#, r#"{"n":2}"#),
        op.replace("a.example", "b.example"),
    ] {
        let (status, refused) = served
            .call("POST", "/api/v1/ops", Some(&producer), Some(&other))
            .await?;
        ensure!(
            status == 409 && refused["error"]["code"] == "idempotency_conflict",
            "{status} {refused}"
        );
    }
    // Whitespace inside the payload is the same payload.
    let spaced = op.replace(r#"{"n":1}"#, r#"{ "n" : 1 }"#);
    let (status, again) = served
        .call("POST", "/api/v1/ops", Some(&producer), Some(&spaced))
        .await?;
    ensure!(status == 200 && again["id"] == id, "{status} {again}");
    settle(served.queue.as_ref(), Duration::from_secs(10)).await?;
    let batch = r#"{"ops":[{"kind":"activitypub","outbox":"o","lanes":["https://a.example/inbox"],"payload":{"n":2}},{"kind":"activitypub","outbox":"o","lanes":["https://a.example/inbox"],"payload":{"n":3}}]}"#;
    let (status, answer) = served.call("POST", "/api/v1/ops", Some(&producer), Some(batch)).await?;
    ensure!(
        status == 200 && answer["results"].as_array().map(Vec::len) == Some(2),
        "{status} {answer}"
    );
    settle(served.queue.as_ref(), Duration::from_secs(10)).await?;
    let before = op_count(served.queue.as_ref()).await?;
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
    // A priority given as the SQL column's rank: the answer says what to write.
    let ranked = r#"{"kind":"activitypub","outbox":"o","lanes":["x"],"payload":{},"priority":0}"#;
    let (status, answer) = served
        .call("POST", "/api/v1/ops", Some(&producer), Some(ranked))
        .await?;
    ensure!(
        status == 400
            && answer["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("\"critical\", \"normal\" or \"low\"")),
        "{status} {answer}"
    );
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
    let after = op_count(served.queue.as_ref()).await?;
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

/// The host's `/metrics` page, as text and parsed.
async fn scrape_metrics(served: &Served) -> anyhow::Result<(String, prometheus_parse::Scrape)> {
    let text = served
        .http
        .get(format!("{}/metrics", served.base))
        .send()
        .await?
        .text()
        .await?;
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).context("parse /metrics")?;
    Ok((text, scrape))
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
    fn outcomes(scrape: &prometheus_parse::Scrape, outcome: &str) -> f64 {
        scrape
            .samples
            .iter()
            .filter(|s| s.metric == "outbox_ops_total")
            .filter(|s| s.labels.get("kind") == Some("activitypub") && s.labels.get("priority") == Some("normal"))
            .filter(|s| s.labels.get("outcome") == Some(outcome))
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
                _ => 0.0,
            })
            .sum()
    }
    // A drain counts a settle once its commit lands back with it, a moment
    // after the rows `settle` reads have changed: scrape until the three
    // settles are counted, or the deadline passes and the checks say what
    // is missing.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let (text, scrape) = loop {
        let (text, scrape) = scrape_metrics(&served).await?;
        let counted = ["confirmed", "failed"]
            .iter()
            .map(|o| outcomes(&scrape, o))
            .sum::<f64>();
        if counted >= 3.0 || std::time::Instant::now() > deadline {
            break (text, scrape);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let samples = |name: &'static str| scrape.samples.iter().filter(move |s| s.metric == name);
    let ops_total = |outcome: &str| outcomes(&scrape, outcome);
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
    ensure!(
        samples("outbox_dead_letters_total")
            .any(|s| s.labels.get("kind") == Some("activitypub") && s.labels.get("reason") == Some("permanent")),
        "dead letters by kind and reason\n{text}"
    );
    for class in ["confirmed", "retryable", "permanent"] {
        ensure!(
            samples("plugin_calls_total")
                .any(|s| s.labels.get("kind") == Some("activitypub") && s.labels.get("class") == Some(class)),
            "plugin calls of class {class}\n{text}"
        );
    }
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
        "fee_oracle_clamp",
        "outbox_oldest_due_age_seconds",
        "outbox_lanes_held",
        "outbox_paused_targets",
        "outbox_breakers_open",
        "outbox_permits_in_use",
        "outbox_slow_attempts",
        "plugin_calls",
        "plugin_call_duration_seconds",
        "plugin_reloads",
        "plugin_quarantined",
    ] {
        ensure!(text.contains(&format!("# TYPE {name} ")), "{name} missing\n{text}");
    }
    served.running.stop().await
}

/// Every route the API must serve, as (method, OpenAPI path).
const ROUTES: [(&str, &str); 38] = [
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
    ("get", "/api/v1/network/conditions"),
    ("get", "/api/openapi.json"),
    ("post", "/api/v1/ops"),
    ("post", "/api/v1/activitypub/deliveries"),
    ("get", "/api/v1/outcomes"),
    ("get", "/api/admin/outbox"),
    ("get", "/api/admin/outbox/stats"),
    ("post", "/api/admin/outbox/recover"),
    ("get", "/api/admin/outbox/{id}"),
    ("post", "/api/admin/outbox/{id}/retry"),
    ("post", "/api/admin/outbox/{id}/cancel"),
    ("get", "/api/admin/audit"),
    ("get", "/api/admin/pauses"),
    ("post", "/api/admin/pauses"),
    ("delete", "/api/admin/pauses/{scope}/{target}"),
    ("get", "/api/admin/lanes"),
    ("post", "/api/admin/lanes/skip"),
    ("get", "/api/admin/subjects"),
    ("post", "/api/admin/subjects/halt"),
    ("post", "/api/admin/subjects/unhalt"),
    ("get", "/api/admin/breakers"),
    ("post", "/api/admin/breakers/{destination}/open"),
    ("post", "/api/admin/breakers/{destination}/close"),
    ("get", "/api/admin/destinations"),
    ("post", "/api/admin/destinations/{destination}/suspend"),
    ("post", "/api/admin/destinations/{destination}/resume"),
    ("post", "/inbox/{actor}"),
    ("post", "/inbox"),
    ("get", "/api/admin/plugins"),
    ("post", "/api/admin/plugins/reload"),
    ("get", "/api/admin/outbox/activity"),
    ("get", "/api/admin/whoami"),
    ("get", "/api/admin/outbox/dead-letters"),
    // Not routes of their own: the same paths' other methods are 405s, and
    // listed here so the count above is every (method, path) served.
    ("get", "/api/admin/outbox/{id}/retry"),
    ("get", "/api/admin/outbox/{id}/cancel"),
];

async fn the_openapi_document_names_every_route_and_each_asks_for_its_scope(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(&db, &exec, "").await?;
    let (status, doc) = served.call("GET", "/api/openapi.json", None, None).await?;
    ensure!(status == 200, "{status} {doc}");
    ensure!(
        doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")),
        "{}",
        doc["openapi"]
    );
    let paths = doc["paths"].as_object().context("paths")?;
    let mut documented: Vec<(String, String)> = Vec::new();
    for (path, item) in paths {
        for (method, _) in item.as_object().context("a path item")? {
            documented.push((method.clone(), path.clone()));
        }
    }
    documented.sort();
    let mut want: Vec<(String, String)> = ROUTES[..36]
        .iter()
        .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
        .collect();
    want.sort();
    ensure!(documented == want, "documented {documented:?}\nwanted {want:?}");
    // Routes with a body say they may answer 413 and 415; the inbox, 413.
    for (method, path, codes) in [
        ("post", "/api/v1/ops", &["413", "415"][..]),
        ("post", "/api/v1/activitypub/deliveries", &["413", "415"][..]),
        ("post", "/api/admin/outbox/recover", &["413", "415"][..]),
        ("post", "/inbox", &["413"][..]),
    ] {
        for code in codes {
            ensure!(
                paths[path][method]["responses"].get(*code).is_some(),
                "{method} {path} does not document {code}"
            );
        }
    }
    // Each documented operation is served (not the fallback's 404), and the
    // scope it names is the one it asks for.
    let mut keys = std::collections::HashMap::new();
    for scope in auth::SCOPES {
        keys.insert(scope, served.key(&format!("only-{scope}"), &[scope]).await?);
    }
    let concrete = |p: &str| {
        p.replace("{id}", "1")
            .replace("{scope}", "kind")
            .replace("{target}", "x")
            .replace("{destination}", "x.example")
            .replace("{actor}", "x")
    };
    for (method, path) in &want {
        let op = &paths[path][method];
        let url = concrete(path);
        let verb = method.to_uppercase();
        let (status, answer) = served.call(&verb, &url, None, Some("{}")).await?;
        ensure!(
            !(status == 404 && answer["error"]["message"] == "no such route") && status != 405,
            "{verb} {path} is documented but not served: {status} {answer}"
        );
        let scopes: Vec<&str> = op["security"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|req| req["bearer"].as_array())
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        let optional = op["security"].as_array().is_some_and(|reqs| {
            reqs.iter()
                .any(|r| r.as_object().is_some_and(serde_json::Map::is_empty))
        });
        let keyed = op["security"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|req| req.get("bearer").is_some());
        match scopes.as_slice() {
            // Any valid key, whatever its scopes.
            [] if keyed => {
                ensure!(status == 401, "{verb} {path} without a key: {status} {answer}");
                for key in keys.values() {
                    let (status, answer) = served.call(&verb, &url, Some(key), None).await?;
                    ensure!(status == 200, "{verb} {path} with a key: {status} {answer}");
                }
            }
            [] => ensure!(status != 401 && status != 403, "{verb} {path} is public: {status}"),
            [scope] if optional => ensure!(status == 200, "{verb} {path}: the key is optional ({scope})"),
            [scope] => {
                ensure!(status == 401, "{verb} {path} without a key: {status} {answer}");
                for (other, key) in &keys {
                    let (status, answer) = served.call(&verb, &url, Some(key), Some("{}")).await?;
                    if other == scope {
                        ensure!(
                            status != 401 && status != 403,
                            "{verb} {path} with {scope}: {status} {answer}"
                        );
                    } else {
                        ensure!(
                            status == 403 && code(&answer) == "forbidden",
                            "{verb} {path} with only {other}: {status} {answer}"
                        );
                    }
                }
            }
            more => anyhow::bail!("{verb} {path} names several scopes: {more:?}"),
        }
    }
    // A method a path does not serve is refused, not answered.
    for (method, path) in &ROUTES[36..] {
        let (status, _) = served.call(&method.to_uppercase(), &concrete(path), None, None).await?;
        ensure!(status == 405, "{method} {path}: {status}");
    }
    served.running.stop().await
}

async fn the_fanout_route_and_the_list_filters_find_what_was_enqueued(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(&db, &exec, "").await?;
    let producer = served.key("producer", &["ops:write"]).await?;
    let admin = served.key("admin", &["outbox:read", "outbox:write"]).await?;
    // Held, so the stats see due ops waiting.
    served
        .queue
        .pause(laneway::queue::PauseScope::Kind, "activitypub", None, "test")
        .await?;
    let before = chrono::Utc::now() - chrono::Duration::seconds(1);
    let body = r#"{
        "outbox": "https://me.example/users/alice",
        "activity": {"id": "https://me.example/a/1", "type": "Create",
                     "object": {"id": "https://me.example/ledger/7", "type": "CaseLedgerEntry"}},
        "recipients": [
            "https://a.example/users/x/inbox",
            {"inbox": "https://b.example/users/y/inbox", "shared_inbox": "https://b.example/inbox"},
            {"inbox": "https://b.example/users/z/inbox", "shared_inbox": "https://b.example/inbox"}
        ]
    }"#;
    let (status, answer) = served
        .call("POST", "/api/v1/activitypub/deliveries", Some(&producer), Some(body))
        .await?;
    ensure!(status == 200 && answer["created"] == 2, "{status} {answer}");
    let inboxes: Vec<&str> = answer["deliveries"]
        .as_array()
        .context("deliveries")?
        .iter()
        .filter_map(|d| d["inbox"].as_str())
        .collect();
    ensure!(
        inboxes == ["https://a.example/users/x/inbox", "https://b.example/inbox"],
        "one op per delivery inbox: {inboxes:?}"
    );
    let (status, again) = served
        .call("POST", "/api/v1/activitypub/deliveries", Some(&producer), Some(body))
        .await?;
    ensure!(
        status == 200 && again["existing"] == 2 && again["created"] == 0,
        "{status} {again}"
    );
    // Bad fan-outs change nothing.
    for (bad, want_status, want_code) in [
        (
            r#"{"outbox":"o","activity":{"id":"x"},"recipients":["ftp://c.example/inbox"]}"#,
            422,
            "invalid_activity",
        ),
        (
            r#"{"outbox":"o","activity":{"id":"x"},"recipients":[]}"#,
            422,
            "invalid_activity",
        ),
        (
            r#"{"outbox":"o","activity":[1],"recipients":["https://c.example/inbox"]}"#,
            422,
            "invalid_activity",
        ),
        (
            r#"{"kind":"teleport","outbox":"o","activity":{},"recipients":["https://c.example/inbox"]}"#,
            422,
            "unknown_kind",
        ),
        // laneway's own kind is refused, as the enqueue route refuses it,
        // before its activity is read.
        (
            r#"{"kind":"outcome_webhook","outbox":"o","activity":[1],"recipients":["https://c.example/inbox"]}"#,
            422,
            "internal_kind",
        ),
        (
            r#"{"kind":"outcome_webhook","outbox":"o","activity":{"id":"x"},"recipients":["https://c.example/inbox"]}"#,
            422,
            "internal_kind",
        ),
        (
            r#"{"outbox":"o","activity":{},"recipients":[7]}"#,
            400,
            "invalid_request",
        ),
    ] {
        let (status, answer) = served
            .call("POST", "/api/v1/activitypub/deliveries", Some(&producer), Some(bad))
            .await?;
        ensure!(
            status == want_status && code(&answer) == want_code,
            "{bad}: {status} {answer}"
        );
    }
    let list = |query: String| {
        let served = &served;
        let admin = admin.clone();
        async move {
            let (status, answer) = served
                .call("GET", &format!("/api/admin/outbox?{query}"), Some(&admin), None)
                .await?;
            ensure!(status == 200, "{query}: {status} {answer}");
            Ok::<usize, anyhow::Error>(answer["ops"].as_array().map_or(0, Vec::len))
        }
    };
    let enc = |s: &str| s.replace(':', "%3A").replace('/', "%2F");
    ensure!(list("".to_owned()).await? == 2);
    ensure!(list(format!("lane={}", enc("https://b.example/inbox"))).await? == 1);
    ensure!(list(format!("lane={}", enc("https://b.example/users/y/inbox"))).await? == 0);
    ensure!(list(format!("correlation_id={}", enc("https://me.example/ledger/7"))).await? == 2);
    ensure!(list("correlation_id=other".to_owned()).await? == 0);
    let at = |t: chrono::DateTime<chrono::Utc>| enc(&t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true));
    let later = chrono::Utc::now() + chrono::Duration::seconds(60);
    ensure!(list(format!("created_after={}", at(before))).await? == 2);
    ensure!(list(format!("created_after={}", at(later))).await? == 0);
    ensure!(list(format!("created_before={}", at(before))).await? == 0);
    ensure!(list(format!("created_after={}&created_before={}", at(before), at(later))).await? == 2);
    let (status, answer) = served
        .call("GET", "/api/admin/outbox?created_after=yesterday", Some(&admin), None)
        .await?;
    ensure!(status == 400 && code(&answer) == "invalid_query", "{status} {answer}");
    // Stats: depth by kind, and the oldest due op's wait.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, stats) = served
        .call("GET", "/api/admin/outbox/stats", Some(&admin), None)
        .await?;
    ensure!(status == 200, "{status} {stats}");
    ensure!(
        stats["depth"].as_array().is_some_and(|d| d
            .iter()
            .any(|r| r["kind"] == "activitypub" && r["status"] == "pending" && r["count"] == 2)),
        "{stats}"
    );
    let oldest = &stats["oldest_due"][0];
    ensure!(
        oldest["kind"] == "activitypub"
            && oldest["outbox"] == "https://me.example/users/alice"
            && oldest["age_seconds"].as_f64().is_some_and(|a| a >= 0.1),
        "{stats}"
    );
    served.running.stop().await
}

async fn a_breaker_opened_by_hand_holds_its_destination_until_closed(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(&db, &exec, "").await?;
    let admin = served.key("admin", &["outbox:read", "outbox:write"]).await?;
    let (status, answer) = served
        .call("POST", "/api/admin/breakers/a.example/open", Some(&admin), None)
        .await?;
    ensure!(
        status == 200 && answer["breaker"]["state"] == "forced_open",
        "{status} {answer}"
    );
    let ops = [
        to("o", "https://a.example/inbox", 1),
        to("o", "https://b.example/inbox", 2),
    ];
    let ids: Vec<i64> = served
        .running
        .dispatcher
        .enqueue(&ops)
        .await?
        .into_iter()
        .map(laneway::queue::Enqueued::id)
        .collect();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let delivered: Vec<i64> = exec.delivered().iter().map(|e| e.op).collect();
    ensure!(delivered == [ids[1]], "only b.example's op ran: {delivered:?}");
    let held = served.queue.get(ids[0]).await?.context("the held op")?;
    ensure!(
        held.status == Status::Pending && held.attempts == 0,
        "held, no attempt used: {held:?}"
    );
    let (_, listed) = served.call("GET", "/api/admin/breakers", Some(&admin), None).await?;
    ensure!(
        listed["breakers"][0]["destination"] == "a.example" && listed["breakers"][0]["state"] == "forced_open",
        "{listed}"
    );
    for bad in ["/api/admin/breakers/a%20b/open", "/api/admin/breakers/a%2Fb/close"] {
        let (status, answer) = served.call("POST", bad, Some(&admin), None).await?;
        ensure!(
            status == 400 && code(&answer) == "invalid_request",
            "{bad}: {status} {answer}"
        );
    }
    let (status, _) = served
        .call("POST", "/api/admin/breakers/a.example/close", Some(&admin), None)
        .await?;
    ensure!(status == 200);
    settle(served.queue.as_ref(), Duration::from_secs(5)).await?;
    let done = served.queue.get(ids[0]).await?.context("the op")?;
    ensure!(done.status == Status::Confirmed && done.attempts == 1, "{done:?}");
    let (status, answer) = served
        .call("POST", "/api/admin/breakers/a.example/close", Some(&admin), None)
        .await?;
    ensure!(
        status == 404 && code(&answer) == "not_found",
        "closing twice: {status} {answer}"
    );
    let actions: Vec<String> = served
        .queue
        .audit_log(None, 10)
        .await?
        .into_iter()
        .map(|e| format!("{} {}", e.action, e.target))
        .collect();
    ensure!(
        actions
            == [
                "breaker.close destination:a.example",
                "breaker.open destination:a.example"
            ],
        "{actions:?}"
    );
    served.running.stop().await
}

async fn the_plugin_routes_show_digests_and_a_refused_reload_changes_nothing(db: TestDb) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let plugin_path = dir.path().join("noop.wasm");
    std::fs::copy(crate::runtime::wasm("noop")?, &plugin_path)?;
    let config_path = dir.path().join("laneway.toml");
    let good = format!(
        "[dispatch]\npoll_ms = 25\n[plugins.noop]\npath = {:?}\n[kinds.noop]\nplugin = \"noop\"\nlanes = \"optional\"\n",
        plugin_path.display().to_string()
    );
    std::fs::write(&config_path, &good)?;
    let source = FileSource::Explicit(config_path.clone());
    let config = laneway::config::load(&source, Vec::new())?;
    let host = Arc::new(PluginHost::new(&config)?);
    host.apply(&config).await?;
    let served = Served::over(&db, host.registry(), config, Some((host.clone(), source))).await?;
    let admin = served.key("plugins", &["plugins:admin"]).await?;
    let (status, first) = served.call("GET", "/api/admin/plugins", Some(&admin), None).await?;
    ensure!(status == 200, "{status} {first}");
    let digest = first["plugins"][0]["digest"].as_str().context("a digest")?.to_owned();
    ensure!(
        first["plugins"][0]["name"] == "noop" && first["plugins"][0]["quarantined"] == false && digest.len() >= 16,
        "{first}"
    );
    // A config mistake: refused with the key path, nothing changes.
    std::fs::write(&config_path, format!("{good}[kinds.noop.retry]\ncolour = 1\n"))?;
    let (status, answer) = served
        .call("POST", "/api/admin/plugins/reload", Some(&admin), None)
        .await?;
    ensure!(status == 422 && code(&answer) == "reload_refused", "{status} {answer}");
    ensure!(
        answer["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("kinds.noop")),
        "names the key: {answer}"
    );
    let (_, after) = served.call("GET", "/api/admin/plugins", Some(&admin), None).await?;
    ensure!(after["plugins"][0]["digest"] == digest.as_str(), "{after}");
    ensure!(
        after["reloads"]["failures"] == 1 && after["reloads"]["last_error"].is_string(),
        "{after}"
    );
    served
        .running
        .dispatcher
        .enqueue(&[laneway::queue::NewOp::new("o", "noop", "{}")])
        .await?;
    settle(served.queue.as_ref(), Duration::from_secs(10)).await?;
    // A new version: loaded, with its own digest.
    std::fs::copy(crate::runtime::wasm("noop-v2")?, &plugin_path)?;
    std::fs::write(&config_path, &good)?;
    let (status, answer) = served
        .call("POST", "/api/admin/plugins/reload", Some(&admin), None)
        .await?;
    ensure!(status == 200, "{status} {answer}");
    ensure!(
        answer["plugins"][0]["digest"].as_str().is_some_and(|d| d != digest),
        "a new digest: {answer}"
    );
    let entries = served.queue.audit_log(None, 10).await?;
    ensure!(
        entries.iter().filter(|e| e.action == "plugins.reload").count() == 2,
        "{entries:?}"
    );
    let (text, scrape) = scrape_metrics(&served).await?;
    let value = |name: &str, label: &str, want: &str| -> f64 {
        scrape
            .samples
            .iter()
            .filter(|s| s.metric == name && s.labels.get(label) == Some(want))
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => 0.0,
            })
            .sum()
    };
    ensure!(value("plugin_reloads_total", "outcome", "refused") == 1.0, "{text}");
    ensure!(value("plugin_reloads_total", "outcome", "loaded") == 1.0, "{text}");
    ensure!(value("plugin_calls_total", "class", "confirmed") == 1.0, "{text}");
    ensure!(value("plugin_quarantined", "plugin", "noop") == 0.0, "{text}");
    ensure!(
        text.contains("plugin_call_duration_seconds_count{plugin=\"noop\"} 1"),
        "{text}"
    );
    served.running.stop().await
}

/// Runs the CLI in-process with `env` and no config file.
pub(crate) async fn cli(args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Result<String, laneway::cli::CliError>> {
    let mut argv = vec!["laneway".to_owned()];
    argv.extend(args.iter().map(|a| (*a).to_owned()));
    let parsed = laneway::cli::parse(argv.into_iter().map(Into::into)).context("arguments")?;
    let mut input: &[u8] = b"";
    let mut output = Vec::new();
    let result = laneway::cli::run(
        parsed,
        laneway::cli::Io {
            env: env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            stdin: &mut input,
            stdout: &mut output,
        },
    )
    .await;
    Ok(result.map(|()| String::from_utf8_lossy(&output).into_owned()))
}

async fn the_cli_acts_through_the_api_with_a_key_and_no_database(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(&db, &exec, "").await?;
    let admin = served.key("oncall", &["outbox:read", "outbox:write"]).await?;
    let reader = served.key("viewer", &["outbox:read"]).await?;
    let url = served.base.clone();
    let lane = "https://a.example/inbox?x=1&y";
    let ids: Vec<i64> = served
        .running
        .dispatcher
        .enqueue(&[to("o", lane, 1), to("o", "https://b.example/inbox", 2)])
        .await?
        .into_iter()
        .map(laneway::queue::Enqueued::id)
        .collect();
    settle(served.queue.as_ref(), Duration::from_secs(10)).await?;
    // A stray LANEWAY_* variable and no config file: remote mode reads neither.
    let env = [("LW_API_KEY", admin.as_str()), ("LANEWAY_NOT_A_KEY", "1")];
    let listed = cli(&["--url", &url, "ops", "list", "--lane", lane, "--json"], &env)
        .await?
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let listed: Value = serde_json::from_str(listed.trim())?;
    let found: Vec<i64> = listed["ops"]
        .as_array()
        .context("ops")?
        .iter()
        .filter_map(|o| o["id"].as_i64())
        .collect();
    ensure!(found == [ids[0]], "the lane filter through the API: {listed}");
    let paused = cli(
        &["--url", &url, "pause", "kind", "activitypub", "--reason", "drill"],
        &env,
    )
    .await?
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    ensure!(paused.contains("\"paused\": true"), "{paused}");
    let pauses = served.queue.pauses().await?;
    ensure!(pauses.len() == 1 && pauses[0].actor == "key:oncall", "{pauses:?}");
    cli(&["--url", &url, "resume", "kind", "activitypub"], &env)
        .await?
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    ensure!(served.queue.pauses().await?.is_empty());
    let audit = cli(&["--url", &url, "audit", "--json"], &env)
        .await?
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    ensure!(audit.contains("key:oncall") && audit.contains("\"resume\""), "{audit}");
    // Refusals come back as the API's code; nothing changes.
    match cli(
        &["--url", &url, "pause", "kind", "activitypub"],
        &[("LW_API_KEY", reader.as_str())],
    )
    .await?
    {
        Err(laneway::cli::CliError::Remote { status: 403, code, .. }) if code == "forbidden" => {}
        other => anyhow::bail!("a reader pausing: {other:?}"),
    }
    match cli(&["--url", &url, "ops", "cancel", &ids[1].to_string()], &env).await? {
        Err(laneway::cli::CliError::Remote { status: 409, .. }) => {}
        other => anyhow::bail!("cancelling a confirmed op: {other:?}"),
    }
    ensure!(served.queue.pauses().await?.is_empty());
    match cli(&["--url", &url, "ops", "stats"], &[]).await? {
        Err(e) => ensure!(e.to_string().contains("LW_API_KEY"), "{e}"),
        Ok(out) => anyhow::bail!("no key, yet: {out}"),
    }
    match cli(&["--url", &url, "migrate"], &env).await? {
        Err(e) => ensure!(e.to_string().contains("--url applies to"), "{e}"),
        Ok(out) => anyhow::bail!("migrate over the API: {out}"),
    }
    // A producer enqueues and fans out through the API with its key.
    let producer = served.key("producer", &["ops:write"]).await?;
    let files = tempfile::tempdir()?;
    let payload = files.path().join("payload.json");
    std::fs::write(&payload, r#"{"note": "remote"}"#)?;
    let activity = files.path().join("activity.json");
    std::fs::write(&activity, r#"{"id": "https://a.example/remote/1", "type": "Create"}"#)?;
    let env = [("LW_API_KEY", producer.as_str())];
    let payload_arg = payload.display().to_string();
    let enqueued = cli(
        &[
            "--url",
            &url,
            "enqueue",
            "--kind",
            "activitypub",
            "--outbox",
            "o",
            "--lane",
            "https://r.example/inbox",
            "--payload",
            &payload_arg,
            "--json",
        ],
        &env,
    )
    .await?
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let enqueued: Value = serde_json::from_str(enqueued.trim())?;
    let id = enqueued["id"].as_i64().with_context(|| enqueued.to_string())?;
    let op = served.queue.get(id).await?.context("the op")?;
    ensure!(op.payload == r#"{"note":"remote"}"#, "{op:?}");
    let activity_arg = activity.display().to_string();
    let fanned = cli(
        &[
            "--url",
            &url,
            "fanout",
            "--outbox",
            "o",
            "--to",
            "https://x.example/inbox",
            "--to",
            "https://y.example/u/inbox=https://y.example/inbox",
            "--activity",
            &activity_arg,
            "--json",
        ],
        &env,
    )
    .await?
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let fanned: Value = serde_json::from_str(fanned.trim())?;
    ensure!(
        fanned["deliveries"].as_array().is_some_and(|d| d.len() == 2),
        "{fanned}"
    );
    served.running.stop().await
}

async fn hostile_producer_input_is_refused_quickly_and_changes_nothing(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(&db, &exec, "[api]\nmax_body_bytes = 16777216\n").await?;
    let producer = served.key("producer", &["ops:write"]).await?;
    let reader = served.key("reader", &["ops:write", "outbox:read"]).await?;
    let admin = served.key("admin", &["outbox:read"]).await?;
    // laneway's own kinds are not producer kinds: a signed webhook to any
    // URL, or a forged "verified" inbound activity.
    for (kind, outbox) in [("outcome_webhook", "outcomes:o"), ("activitypub_inbound", "inbound")] {
        let body = format!(
            r#"{{"kind":"{kind}","outbox":"{outbox}","lanes":["x"],"payload":{{"url":"http://127.0.0.1:9/","key":"hooks","id":"m","body":"{{}}"}}}}"#
        );
        let (status, answer) = served.call("POST", "/api/v1/ops", Some(&producer), Some(&body)).await?;
        ensure!(
            status == 422 && code(&answer) == "internal_kind",
            "{kind}: {status} {answer}"
        );
        let fan = format!(
            r#"{{"kind":"{kind}","outbox":"o","activity":{{"id":"https://a/1"}},"recipients":["https://b.example/inbox"]}}"#
        );
        let (status, answer) = served
            .call("POST", "/api/v1/activitypub/deliveries", Some(&producer), Some(&fan))
            .await?;
        ensure!(status == 422, "fan-out as {kind}: {status} {answer}");
    }
    // The library refuses them too, and plain SQL outside their outboxes.
    let lib = served
        .running
        .dispatcher
        .enqueue(&[laneway::queue::NewOp::new("o", "outcome_webhook", "{}".to_owned())])
        .await;
    ensure!(lib.is_err(), "the library enqueued an internal kind");
    let sql = served
        .queue
        .enqueue(&[laneway::queue::NewOp {
            lanes: vec!["x".into()],
            ..laneway::queue::NewOp::new("orders", "outcome_webhook", "{}".to_owned())
        }])
        .await;
    ensure!(
        matches!(sql, Err(laneway::queue::QueueError::InvalidOp(_))),
        "the database took an internal kind outside its outboxes: {sql:?}"
    );

    // A repeated idempotency key answers the id and status, not the op,
    // to a key that may not read ops.
    let op = r#"{"kind":"activitypub","outbox":"o","lanes":["https://a.example/inbox"],"payload":{"secret":"s3"},"idempotency_key":"k"}"#;
    let (status, first) = served.call("POST", "/api/v1/ops", Some(&reader), Some(op)).await?;
    ensure!(status == 201, "{status} {first}");
    let (status, replay) = served.call("POST", "/api/v1/ops", Some(&producer), Some(op)).await?;
    ensure!(status == 200 && replay["status"] == "existing", "{status} {replay}");
    ensure!(
        !replay.to_string().contains("s3"),
        "the replay read the payload: {replay}"
    );
    ensure!(
        replay["op"]["status"].is_string() && replay["op"]["payload"].is_null(),
        "{replay}"
    );
    let (_, full) = served.call("POST", "/api/v1/ops", Some(&reader), Some(op)).await?;
    ensure!(full.to_string().contains("s3"), "a reader sees the op: {full}");

    let before = op_count(served.queue.as_ref()).await?;
    // 120,000 lanes: refused by count before any de-duplication.
    let lanes: Vec<String> = (0..120_000).map(|n| format!("lane-{n}")).collect();
    let body = serde_json::json!({ "kind": "activitypub", "outbox": "o", "lanes": lanes, "payload": {} }).to_string();
    let started = std::time::Instant::now();
    let (status, answer) = served.call("POST", "/api/v1/ops", Some(&producer), Some(&body)).await?;
    ensure!(status == 422 && code(&answer) == "invalid_op", "{status} {answer}");
    ensure!(
        started.elapsed() < Duration::from_secs(5),
        "{:?} for a lane list",
        started.elapsed()
    );
    // 100,001 recipients: refused by count.
    let recipients: Vec<String> = (0..100_001).map(|n| format!("https://h{n}.example/inbox")).collect();
    let body =
        serde_json::json!({ "outbox": "o", "activity": { "id": "https://a/2" }, "recipients": recipients }).to_string();
    let (status, answer) = served
        .call("POST", "/api/v1/activitypub/deliveries", Some(&producer), Some(&body))
        .await?;
    ensure!(status == 400 || status == 422, "{status} {answer}");
    // A delay past any date: a 400, not a panic.
    let body = r#"{"kind":"activitypub","outbox":"o","lanes":["x"],"payload":{},"delay_ms":18446744073709551615}"#;
    let (status, answer) = served.call("POST", "/api/v1/ops", Some(&producer), Some(body)).await?;
    ensure!(status == 400, "{status} {answer}");
    // NUL bytes and dates out of the database's range are bad input on both backends.
    let body = "{\"kind\":\"activitypub\",\"outbox\":\"o\\u0000\",\"lanes\":[\"x\"],\"payload\":{}}";
    let (status, answer) = served.call("POST", "/api/v1/ops", Some(&producer), Some(body)).await?;
    ensure!(status == 422, "NUL in outbox: {status} {answer}");
    let body = "{\"kind\":\"activitypub\",\"outbox\":\"o\",\"lanes\":[\"x\\u0000\"],\"payload\":{}}";
    let (status, answer) = served.call("POST", "/api/v1/ops", Some(&producer), Some(body)).await?;
    ensure!(status == 422, "NUL in a lane: {status} {answer}");
    let body = "{\"kind\":\"activitypub\",\"outbox\":\"o\",\"lanes\":[\"x\"],\"payload\":{\"a\":\"\\u0000\"}}";
    let (status, answer) = served.call("POST", "/api/v1/ops", Some(&producer), Some(body)).await?;
    ensure!(status < 500, "NUL in a payload: {status} {answer}");
    // Deep nesting is bad input, not an outage (a client retries a 503 for
    // ever): refused at the API, in the op and in a fan-out's activity.
    for depth in [129usize, 5_000, 100_000] {
        let nested = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        let body = format!(r#"{{"kind":"activitypub","outbox":"o","lanes":["x"],"payload":{nested}}}"#);
        let (status, answer) = served.call("POST", "/api/v1/ops", Some(&producer), Some(&body)).await?;
        ensure!(
            status == 422 && code(&answer) == "invalid_op" && answer.to_string().contains("level"),
            "{depth} deep: {status} {answer}"
        );
        let body = format!(
            r#"{{"outbox":"o","activity":{{"id":"https://a/3","x":{nested}}},"recipients":["https://b.example/inbox"]}}"#
        );
        let (status, answer) = served
            .call("POST", "/api/v1/activitypub/deliveries", Some(&producer), Some(&body))
            .await?;
        ensure!(
            (400..500).contains(&status),
            "a fan-out {depth} deep: {status} {answer}"
        );
    }
    for path in [
        "/api/admin/outbox?subject=a%00b",
        "/api/admin/outbox?lane=a%00b",
        "/api/admin/outbox?created_after=%2B262142-01-01T00:00:00Z",
        "/api/admin/outbox?created_before=-262143-01-01T00:00:00Z",
    ] {
        let (status, answer) = served.call("GET", path, Some(&admin), None).await?;
        ensure!(
            (400..500).contains(&status) || status == 200,
            "{path}: {status} {answer}"
        );
    }
    let after = op_count(served.queue.as_ref()).await?;
    ensure!(
        after <= before + 1,
        "hostile input changed the queue: {before} -> {after}"
    );
    served.running.stop().await
}

async fn an_activity_is_stored_and_sent_byte_for_byte(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(&db, &exec, "").await?;
    let producer = served.key("producer", &["ops:write"]).await?;
    // Keys out of order, a 30-digit integer, a float with trailing zeros,
    // escapes: what a JSON re-encoder would change.
    let activity =
        r#"{"type":"Create","id":"https://a.example/1","n":123456789012345678901234567890,"f":1.50,"z":"\u00e9\/"}"#;
    let body = format!(r#"{{"outbox":"o","activity":{activity},"recipients":["https://b.example/inbox"]}}"#);
    let (status, answer) = served
        .call("POST", "/api/v1/activitypub/deliveries", Some(&producer), Some(&body))
        .await?;
    ensure!(status == 200, "{status} {answer}");
    let id = answer["deliveries"][0]["id"].as_i64().context("an op")?;
    let stored = served.queue.get(id).await?.context("op")?;
    ensure!(stored.payload == activity, "stored as {}", stored.payload);
    let op =
        format!(r#"{{"kind":"activitypub","outbox":"o","lanes":["https://c.example/inbox"],"payload":{activity}}}"#);
    let (status, answer) = served.call("POST", "/api/v1/ops", Some(&producer), Some(&op)).await?;
    ensure!(status == 201, "{status} {answer}");
    let stored = served
        .queue
        .get(answer["id"].as_i64().context("id")?)
        .await?
        .context("op")?;
    ensure!(stored.payload == activity, "stored as {}", stored.payload);
    served.running.stop().await
}

async fn slow_and_endless_requests_are_cut_off_and_health_still_answers(db: TestDb) -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let exec = Scripted::new(0);
    let served = Served::start(
        &db,
        &exec,
        "[api]\nheader_timeout_ms = 500\nbody_timeout_ms = 1000\nmax_connections_per_ip = 50\npublic_per_second = 3\n",
    )
    .await?;
    let addr = served.base.trim_start_matches("http://").to_owned();
    // Slowloris from 127.0.0.1: headers that never end, more than the cap.
    let mut slow = Vec::new();
    for _ in 0..60 {
        let mut s = tokio::net::TcpStream::connect(&addr).await?;
        s.write_all(b"POST /api/v1/ops HTTP/1.1\r\nHost: x\r\nX-Slow: ").await?;
        slow.push(s);
    }
    // Another client (another loopback address) is still answered at once.
    let other = reqwest::Client::builder()
        .local_address(std::net::IpAddr::from([127, 0, 0, 2]))
        .timeout(Duration::from_secs(2))
        .build()?;
    let port = addr.rsplit(':').next().context("port")?;
    let health = other.get(format!("http://127.0.0.1:{port}/healthz")).send().await?;
    ensure!(health.status() == 200, "{}", health.status());
    // Every slow connection is closed within the header timeout (those over
    // the per-address cap at once).
    let started = std::time::Instant::now();
    for s in &mut slow {
        let mut buf = [0u8; 256];
        let read = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf)).await;
        ensure!(read.is_ok(), "a slow connection was held open past the header timeout");
    }
    ensure!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    // A 10 GB body that never comes: answered or cut within the body timeout.
    let mut s = tokio::net::TcpStream::connect(&addr).await?;
    s.write_all(
        b"POST /api/v1/ops HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n{\"kind\":",
    )
    .await?;
    let started = std::time::Instant::now();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(4), s.read_to_end(&mut answer)).await;
    ensure!(read.is_ok(), "a 10 GB Content-Length was held open");
    let text = String::from_utf8_lossy(&answer);
    ensure!(
        text.starts_with("HTTP/1.1 413") && started.elapsed() < Duration::from_millis(900),
        "{:?} after {:?}: a declared length over the limit is refused before reading",
        text.lines().next(),
        started.elapsed()
    );
    // And after all that, 127.0.0.1 is served again.
    let (status, _) = served.call("GET", "/healthz", None, None).await?;
    ensure!(status == 200, "{status}");
    // The public route takes its burst (public_per_second) at once, then
    // refuses until its bucket refills.
    let mut statuses = Vec::new();
    for _ in 0..10 {
        statuses.push(served.call("GET", "/api/v1/network/conditions", None, None).await?.0);
    }
    ensure!(
        statuses[..3] == [200, 200, 200] && statuses.contains(&429),
        "{statuses:?}"
    );
    served.running.stop().await
}
