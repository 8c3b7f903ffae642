//! What producers learn after enqueueing, on both backends: the outcome
//! feed pages every terminal transition once and in order, `?wait=` answers
//! a fast op's outcome and lets a slow one go on, and on PostgreSQL each
//! transition is NOTIFYed and a transaction that commits late is not
//! skipped by a cursor already past it.

use std::time::Duration;

use anyhow::{ensure, Context};
use laneway::op::Status;
use laneway::queue::{Enqueued, PauseScope};
use serde_json::Value;

use crate::api::{cli, code, Served};
use crate::dispatch::harness::{fast_config, settle, to, Running, Scripted, Step};
use crate::support::{self, TestBackend, TestDb};

crate::on_both_backends!(
    live: the_outcome_feed_pages_every_terminal_transition_once_in_order,
    wait_answers_a_fast_op_with_its_outcome_and_lets_a_slow_one_go_on,
    the_pruner_removes_and_archives_exactly_what_its_policy_says,
    a_fanout_to_a_thousand_inboxes_stores_its_payload_once,
    the_pruner_keeps_an_op_until_the_relay_has_sent_its_webhook,
    a_host_reads_its_own_notes_at_once_and_another_hosts_within_the_cache_ttl,
);

/// Plugin notes are read through a per-host cache: what this host writes it
/// reads back at once; what another host writes it sees within
/// `NOTE_CACHE_TTL`, read from the database, not before; claims stay
/// compare-and-sets in the database.
async fn a_host_reads_its_own_notes_at_once_and_another_hosts_within_the_cache_ttl(db: TestDb) -> anyhow::Result<()> {
    use laneway::executor::{NoteCache, Notes, QueueNotes, NOTE_CACHE_TTL};
    let here = QueueNotes::new(db.queue.clone(), std::sync::Arc::new(NoteCache::default()));
    let there = QueueNotes::new(db.queue.clone(), std::sync::Arc::new(NoteCache::default()));
    let (plugin, host) = ("ap", "mastodon.example");
    ensure!(here.get(plugin, host, "scheme").await?.is_none());
    there.set(plugin, host, "scheme", "rfc9421").await?;
    ensure!(
        here.get(plugin, host, "scheme").await?.is_none(),
        "another host's note is not seen before the cache's TTL"
    );
    ensure!(there.get(plugin, host, "scheme").await?.as_deref() == Some("rfc9421"));
    here.set(plugin, host, "scheme", "cavage").await?;
    ensure!(
        here.get(plugin, host, "scheme").await?.as_deref() == Some("cavage"),
        "own write at once"
    );
    ensure!(
        there.get(plugin, host, "scheme").await?.as_deref() == Some("rfc9421"),
        "still the other host's own cached write"
    );
    tokio::time::sleep(NOTE_CACHE_TTL + Duration::from_millis(100)).await;
    ensure!(
        there.get(plugin, host, "scheme").await?.as_deref() == Some("cavage"),
        "read again from the database after the TTL"
    );
    // Claims: of two hosts one wins, at once (a compare-and-set in the
    // database).
    let ttl = Duration::from_secs(60);
    ensure!(here.claim(plugin, host, "knock", ttl).await? && !there.claim(plugin, host, "knock", ttl).await?);
    // Of many asking on one host at once, one takes it.
    let asks = (0..20).map(|_| here.claim(plugin, "new.example", "knock", ttl));
    let taken = futures::future::join_all(asks)
        .await
        .into_iter()
        .collect::<Result<Vec<bool>, _>>()?;
    ensure!(taken.iter().filter(|t| **t).count() == 1, "{taken:?}");
    // A claim a host knows is held (its own, or another's until it ends)
    // is refused there without asking the database again: with the record
    // gone, a third host takes it, but neither of these two does.
    db.queue
        .delete_record("claim:ap", "mastodon.example\u{1f}knock", laneway::queue::Expect::Any)
        .await?;
    ensure!(!here.claim(plugin, host, "knock", ttl).await? && !there.claim(plugin, host, "knock", ttl).await?);
    let third = QueueNotes::new(db.queue.clone(), std::sync::Arc::new(NoteCache::default()));
    ensure!(third.claim(plugin, host, "knock", ttl).await?);
    // A short claim lapses here as in the database.
    let short = Duration::from_millis(200);
    ensure!(here.claim(plugin, host, "brief", short).await?);
    ensure!(!here.claim(plugin, host, "brief", short).await?);
    tokio::time::sleep(short + Duration::from_millis(100)).await;
    ensure!(here.claim(plugin, host, "brief", short).await?);
    Ok(())
}

async fn the_outcome_feed_pages_every_terminal_transition_once_in_order(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(&db, &exec, "[kinds.activitypub]\nmax_attempts = 1\n").await?;
    let reader = served.key("producer", &["outcomes:read"]).await?;
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
        .map(Enqueued::id)
        .collect();
    exec.script(ids[0], [Step::Ok]);
    exec.script(ids[1], [Step::Permanent, Step::Ok]);
    settle(served.queue.as_ref(), Duration::from_secs(10)).await?;
    // A dead letter retried by hand that then confirms: a second entry.
    served.queue.force_retry(ids[1]).await?;
    served.running.dispatcher.trigger("o");
    // A cancelled op, held by a pause so it cannot run first.
    served.queue.pause(PauseScope::Outbox, "p", None, "test").await?;
    let held = served
        .running
        .dispatcher
        .enqueue(&[to("p", "https://c.example/inbox", 3)])
        .await?[0]
        .id();
    served.queue.cancel(held).await?;
    settle(served.queue.as_ref(), Duration::from_secs(10)).await?;
    // Page two at a time from the start, as a follower does: on PostgreSQL
    // a row is served only once every older transaction on the cluster has
    // ended (the parallel tests' included), so an empty page means "not
    // yet", not "nothing".
    let mut seen: Vec<(i64, String)> = Vec::new();
    let mut cursor: Option<String> = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while seen.len() < 4 {
        ensure!(tokio::time::Instant::now() < deadline, "the feed stopped at {seen:?}");
        let path = match &cursor {
            Some(c) => format!("/api/v1/outcomes?limit=2&after={c}"),
            None => "/api/v1/outcomes?limit=2".to_owned(),
        };
        let (status, page) = served.call("GET", &path, Some(&reader), None).await?;
        ensure!(status == 200, "{status} {page}");
        let entries = page["outcomes"].as_array().context("outcomes")?;
        if entries.is_empty() {
            ensure!(
                page["next"].as_str() == cursor.as_deref(),
                "an empty page keeps the cursor: {page}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        ensure!(entries.len() <= 2, "a page of at most its limit: {page}");
        for e in entries {
            ensure!(e["op"].get("payload").is_none(), "the feed leaves payloads out: {e}");
            seen.push((
                e["op"]["id"].as_i64().context("op id")?,
                e["status"].as_str().context("status")?.to_owned(),
            ));
        }
        cursor = page["next"].as_str().map(str::to_owned);
    }
    let want = vec![
        (ids[0], "confirmed".to_owned()),
        (ids[1], "failed".to_owned()),
        (ids[1], "confirmed".to_owned()),
        (held, "cancelled".to_owned()),
    ];
    // The settles of one drain round commit together; within the round
    // their order is the round's. Compare as the feed's order per op.
    let mut sorted_seen = seen.clone();
    sorted_seen.sort();
    let mut sorted_want = want.clone();
    sorted_want.sort();
    ensure!(sorted_seen == sorted_want, "every transition once: {seen:?}");
    let second = seen.iter().position(|e| *e == (ids[1], "confirmed".to_owned()));
    let first = seen.iter().position(|e| *e == (ids[1], "failed".to_owned()));
    ensure!(first < second, "an op's transitions in order: {seen:?}");
    // A cursor survives: asking again from the last one finds nothing new.
    let last = cursor.context("a cursor")?;
    let (_, again) = served
        .call("GET", &format!("/api/v1/outcomes?after={last}"), Some(&reader), None)
        .await?;
    ensure!(again["outcomes"].as_array().is_some_and(Vec::is_empty), "{again}");
    // The CLI follows the same feed through the API, line for line.
    let lines = cli(
        &["--url", &served.base, "outcomes", "--json", "--follow", "--count", "4"],
        &[("LW_API_KEY", reader.as_str())],
    )
    .await?
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let printed: Vec<(i64, String)> = lines
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l)?;
            Ok((
                v["op"]["id"].as_i64().context("id")?,
                v["status"].as_str().context("status")?.to_owned(),
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    ensure!(printed == seen, "the CLI saw {printed:?}, the API {seen:?}");
    // Filters keep what matches from each page read; the cursor moves past
    // everything read, so a filtered follower never rereads or stalls.
    for (query, want) in [
        ("outbox=p", vec![(held, "cancelled")]),
        ("status=failed", vec![(ids[1], "failed")]),
        (
            "kind=activitypub&outbox=o&status=confirmed",
            vec![(ids[0], "confirmed"), (ids[1], "confirmed")],
        ),
        ("kind=outcome_webhook", vec![]),
        ("outbox=nowhere", vec![]),
    ] {
        let (status, page) = served
            .call(
                "GET",
                &format!("/api/v1/outcomes?limit=100&{query}"),
                Some(&reader),
                None,
            )
            .await?;
        ensure!(status == 200, "{query}: {status} {page}");
        let mut got: Vec<(i64, String)> = page["outcomes"]
            .as_array()
            .context("outcomes")?
            .iter()
            .map(|e| {
                (
                    e["op"]["id"].as_i64().unwrap_or(0),
                    e["status"].as_str().unwrap_or("").to_owned(),
                )
            })
            .collect();
        got.sort();
        let mut want: Vec<(i64, String)> = want.into_iter().map(|(i, s)| (i, s.to_owned())).collect();
        want.sort();
        ensure!(got == want, "{query}: {got:?}, expected {want:?}");
        ensure!(
            page["next"] == Value::String(last.clone()),
            "{query}: the cursor moved past the page: {page}"
        );
    }
    // The CLI's filters are the route's (through the API here).
    let lines = cli(
        &["--url", &served.base, "outcomes", "--json", "--status", "failed"],
        &[("LW_API_KEY", reader.as_str())],
    )
    .await?
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let ids_printed: Vec<i64> = lines
        .lines()
        .map(|l| Ok(serde_json::from_str::<Value>(l)?["op"]["id"].as_i64().unwrap_or(0)))
        .collect::<anyhow::Result<_>>()?;
    ensure!(
        ids_printed == [ids[1]],
        "the CLI's --status failed printed {ids_printed:?}"
    );
    for bad in [
        "/api/v1/outcomes?after=yesterday",
        "/api/v1/outcomes?limit=0",
        "/api/v1/outcomes?status=pending",
    ] {
        let (status, answer) = served.call("GET", bad, Some(&reader), None).await?;
        ensure!(
            status == 400 && code(&answer) == "invalid_request",
            "{bad}: {status} {answer}"
        );
    }
    served.running.stop().await
}

async fn wait_answers_a_fast_op_with_its_outcome_and_lets_a_slow_one_go_on(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(&db, &exec, "").await?;
    let producer = served.key("producer", &["ops:write"]).await?;
    let fast = r#"{"kind":"activitypub","outbox":"o","lanes":["https://a.example/inbox"],"payload":{},"idempotency_key":"fast"}"#;
    let (status, answer) = served
        .call("POST", "/api/v1/ops?wait=10", Some(&producer), Some(fast))
        .await?;
    ensure!(
        status == 200 && answer["outcome"]["status"] == "confirmed" && answer["status"] == "created",
        "{status} {answer}"
    );
    // A repeat of the key answers the outcome at once.
    let (status, again) = served
        .call("POST", "/api/v1/ops?wait=10", Some(&producer), Some(fast))
        .await?;
    ensure!(
        status == 200 && again["status"] == "existing" && again["outcome"]["status"] == "confirmed",
        "{status} {again}"
    );
    // Slow: its outbox is paused, so it cannot finish within the wait.
    served.queue.pause(PauseScope::Outbox, "slow", None, "test").await?;
    let slow = r#"{"kind":"activitypub","outbox":"slow","lanes":["https://a.example/inbox"],"payload":{}}"#;
    let started = std::time::Instant::now();
    let (status, answer) = served
        .call("POST", "/api/v1/ops?wait=0.5", Some(&producer), Some(slow))
        .await?;
    let took = started.elapsed();
    ensure!(
        status == 202 && answer["op"]["status"] == "pending",
        "{status} {answer}"
    );
    ensure!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(5),
        "held for the wait: {took:?}"
    );
    let id = answer["id"].as_i64().context("id")?;
    served.queue.resume(PauseScope::Outbox, "slow").await?;
    let done = served
        .running
        .dispatcher
        .wait_terminal(id, Duration::from_secs(10))
        .await?
        .context("the slow op finishes after its wait")?;
    ensure!(done.status == Status::Confirmed, "{done:?}");
    for (path, body) in [
        ("/api/v1/ops?wait=0", slow.to_owned()),
        ("/api/v1/ops?wait=100000", slow.to_owned()),
        ("/api/v1/ops?wait=soon", slow.to_owned()),
        ("/api/v1/ops?wait=1", format!(r#"{{"ops":[{slow}]}}"#)),
    ] {
        let (status, answer) = served.call("POST", path, Some(&producer), Some(&body)).await?;
        ensure!(status == 400, "{path}: {status} {answer}");
    }
    served.running.stop().await
}

/// The feed after `after` once it holds at least `want` entries (20 s at most).
pub(crate) async fn feed_until(
    queue: &dyn laneway::queue::Queue,
    after: Option<&str>,
    want: usize,
) -> anyhow::Result<Vec<laneway::queue::OutcomeEntry>> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let page = queue.outcomes(after, 100).await?;
        if page.len() >= want || tokio::time::Instant::now() >= deadline {
            return Ok(page);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_notifies_each_outcome_and_a_late_commit_is_not_skipped() -> anyhow::Result<()> {
    let db = support::postgres_live().await?;
    let TestBackend::Postgres(queue) = &db.kind else {
        anyhow::bail!("not postgres")
    };
    let mut listener = sqlx::postgres::PgListener::connect_with(queue.pool()).await?;
    listener.listen("laneway_outcomes").await?;
    // The producer's channel names the op's outbox, kind and keys too.
    let mut producer = sqlx::postgres::PgListener::connect_with(queue.pool()).await?;
    producer.listen("laneway_op_outcomes").await?;
    let ids: Vec<i64> = db
        .queue
        .enqueue(&[to("o", "a", 1), to("o", "b", 2), to("o", "c", 3)])
        .await?
        .into_iter()
        .map(Enqueued::id)
        .collect();
    // A: cancels the first op and stays open, holding the smaller seq.
    let mut late = queue.pool().begin().await?;
    sqlx::query("UPDATE ops SET status = 'cancelled', finished_at = now(), updated_at = now() WHERE id = $1")
        .bind(ids[0])
        .execute(&mut *late)
        .await?;
    // B: cancels the second and commits.
    db.queue.cancel(ids[1]).await?;
    let note = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .context("no NOTIFY within 5 s")??;
    ensure!(note.payload() == format!("{} cancelled", ids[1]), "{}", note.payload());
    // (The channel is the database's: the parallel tests' outcomes pass by.)
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let named = loop {
        let note = tokio::time::timeout_at(deadline, producer.recv())
            .await
            .context("no laneway_op_outcomes NOTIFY within 5 s")??;
        let v: Value = serde_json::from_str(note.payload())?;
        if v["id"] == ids[1] {
            break v;
        }
    };
    ensure!(
        named["outbox"] == "o" && named["status"] == "cancelled" && named["kind"] == "activitypub",
        "{named}"
    );
    // While A is open, the feed serves neither: B's row waits behind A.
    let early = db.queue.outcomes(None, 100).await?;
    ensure!(early.is_empty(), "served past a running transaction: {early:?}");
    late.commit().await?;
    // Other tests' transactions on the cluster can hold rows back a moment.
    let page = feed_until(db.queue.as_ref(), None, 2).await?;
    let got: Vec<i64> = page.iter().map(|e| e.op.id).collect();
    ensure!(got == [ids[0], ids[1]], "both, in commit order: {got:?}");
    let cursor = page.last().context("a page")?.cursor.clone();
    db.queue.cancel(ids[2]).await?;
    let next = feed_until(db.queue.as_ref(), Some(&cursor), 1).await?;
    ensure!(next.iter().map(|e| e.op.id).collect::<Vec<_>>() == [ids[2]], "{next:?}");
    let value: Value = serde_json::json!(next[0].status);
    ensure!(value == "cancelled");
    Ok(())
}

/// An idle transaction in another database of the same server (one that
/// has written, so it holds an xid) delayed every webhook for as long as it
/// stayed open: the feed's horizon was the cluster-wide xmin. It is now the
/// oldest transaction of laneway's own database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_idle_transaction_in_another_database_does_not_hold_the_feed_back() -> anyhow::Result<()> {
    use sqlx::Connection as _;
    let db = support::postgres_live().await?;
    let elsewhere_url = match support::pg_url().rsplit_once('/') {
        Some((server, _)) => format!("{server}/postgres"),
        None => anyhow::bail!("no database in the test URL"),
    };
    let mut elsewhere = sqlx::PgConnection::connect(&elsewhere_url).await?;
    let mut idle = elsewhere.begin().await?;
    sqlx::query("SELECT pg_current_xact_id()").execute(&mut *idle).await?;
    let id = db.queue.enqueue(&[to("o", "a", 1)]).await?[0].id();
    db.queue.cancel(id).await?;
    // Other tests' short transactions on this database may hold it a moment.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let page = db.queue.outcomes(None, 10).await?;
        if page.iter().any(|e| e.op.id == id) {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the outcome waited behind another database's open transaction"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    idle.rollback().await?;
    Ok(())
}

async fn the_pruner_removes_and_archives_exactly_what_its_policy_says(db: TestDb) -> anyhow::Result<()> {
    let archive = tempfile::tempdir()?;
    let config = fast_config(&format!(
        "[retention]\nconfirmed_ms = 2000\ncancelled_ms = 0\nfailed_ms = 2000\nidempotency_ms = 0\nevery_ms = 100\nbatch = 2\n\
         [kinds.activitypub]\nmax_attempts = 1\narchive = {:?}\n\
         [kinds.held]\nlanes = \"required\"\npoison = \"halt\"\nmax_attempts = 1\n\
         [kinds.note]\nlanes = \"optional\"\nretention_confirmed_ms = 0\n",
        archive.path().display().to_string()
    ))?;
    let exec = Scripted::new(0);
    let running = Running::start(
        db.queue.clone(),
        exec.registry(&["activitypub", "held", "note"]),
        config.clone(),
    )
    .await?;
    let mut confirmed = Vec::new();
    for n in 0..5 {
        let mut op = to("o", &format!("https://h{n}.example/inbox"), n);
        op.idempotency_key = Some(format!("k{n}"));
        confirmed.push(running.dispatcher.enqueue(&[op]).await?[0].id());
    }
    let failed = running
        .dispatcher
        .enqueue(&[to("o", "https://dead.example/inbox", 9)])
        .await?[0]
        .id();
    exec.script(failed, [Step::Permanent]);
    let mut held_op = to("o", "https://held.example/inbox", 10);
    held_op.kind = "held".to_owned();
    let held = running.dispatcher.enqueue(&[held_op]).await?[0].id();
    exec.script(held, [Step::Permanent]);
    let notes: Vec<i64> = running
        .dispatcher
        .enqueue(&[
            laneway::queue::NewOp::new("o", "note", "{}"),
            laneway::queue::NewOp::new("o", "note", "{}"),
        ])
        .await?
        .into_iter()
        .map(Enqueued::id)
        .collect();
    db.queue.pause(PauseScope::Outbox, "p", None, "test").await?;
    let cancelled = running
        .dispatcher
        .enqueue(&[to("p", "https://c.example/inbox", 11)])
        .await?[0]
        .id();
    db.queue.cancel(cancelled).await?;
    settle(db.queue.as_ref(), Duration::from_secs(10)).await?;
    // Nothing is old enough yet.
    let pruner = laneway::pruner::Pruner::new(db.queue.clone(), std::sync::Arc::new(laneway::clock::SystemClock));
    let early = pruner.run_once(&config, "host-a").await?.context("the lease")?;
    ensure!(early.deleted == 0, "{early:?}");
    ensure!(
        pruner.run_once(&config, "host-b").await?.is_none(),
        "another host holds the pruning lease"
    );
    tokio::time::sleep(Duration::from_millis(2300)).await;
    let report = pruner.run_once(&config, "host-a").await?.context("the lease")?;
    ensure!(
        report.deleted == 6 && report.archived == 6 && report.tombstones == 5,
        "five confirmed and one dead letter, all archived, five keys: {report:?}"
    );
    // Exactly those are gone, with their attempts and outcome rows.
    for id in confirmed.iter().chain([&failed]) {
        ensure!(db.queue.get(*id).await?.is_none(), "op {id} is still there");
        ensure!(
            db.queue.attempts(*id).await?.is_empty(),
            "op {id}'s attempts are still there"
        );
        let record = laneway::archive::find(archive.path(), *id)?.with_context(|| format!("op {id} archived"))?;
        ensure!(
            record["op"]["payload"].is_string() && record["attempts"].as_array().is_some_and(|a| a.len() == 1),
            "{record}"
        );
    }
    for id in notes.iter().chain([&held, &cancelled]) {
        ensure!(db.queue.get(*id).await?.is_some(), "op {id} should have been kept");
    }
    let feed: Vec<i64> = db.queue.outcomes(None, 100).await?.iter().map(|e| e.op.id).collect();
    ensure!(
        !feed.contains(&confirmed[0]),
        "a pruned op's outcome row stays: {feed:?}"
    );
    // A repeated key answers the pruned op, and nothing new is enqueued.
    let mut again = to("o", "https://h0.example/inbox", 0);
    again.idempotency_key = Some("k0".to_owned());
    let result = running.dispatcher.enqueue(&[again]).await?;
    ensure!(result == [Enqueued::Existing(confirmed[0])], "{result:?}");
    let tombstone = db.queue.tombstone("o", "k0").await?.context("a tombstone")?;
    ensure!(
        tombstone.status == Status::Confirmed && tombstone.expires_at.is_none(),
        "{tombstone:?}"
    );
    // So is a plain-SQL producer's insert of it.
    let inserted = match &db.kind {
        TestBackend::Sqlite(q) => sqlx::query(
            "INSERT INTO laneway_ops (outbox, kind, lanes, payload, idempotency_key) VALUES ('o', 'activitypub', '[\"x\"]', '{}', 'k1')",
        )
        .execute(q.pool())
        .await?
        .rows_affected(),
        TestBackend::Postgres(q) => sqlx::query(
            "INSERT INTO ops (outbox, kind, lanes, payload, idempotency_key) VALUES ('o', 'activitypub', ARRAY['x'], '{}', 'k1')",
        )
        .execute(q.pool())
        .await?
        .rows_affected(),
    };
    ensure!(inserted == 0, "a tombstoned key was inserted again");
    let later = pruner.run_once(&config, "host-a").await?.context("the lease")?;
    ensure!(later.deleted == 0, "{later:?}");
    let rows = db.queue.table_rows().await?;
    ensure!(
        rows.iter().any(|(t, n)| t == "ops" && *n == 4),
        "four ops kept: {rows:?}"
    );
    running.stop().await
}

async fn a_fanout_to_a_thousand_inboxes_stores_its_payload_once(db: TestDb) -> anyhow::Result<()> {
    let exec = Scripted::new(0);
    let served = Served::start(
        &db,
        &exec,
        "[queue]\nlease_ms = 2000\n[retention]\nconfirmed_ms = 2000\nbatch = 500\n",
    )
    .await?;
    let producer = served.key("producer", &["ops:write", "outbox:read"]).await?;
    let note = "x".repeat(40_000);
    let activity = serde_json::json!({
        "id": "https://me.example/a/big", "type": "Create",
        "object": {"type": "Note", "content": note},
    });
    let recipients: Vec<String> = (0..1000).map(|i| format!("https://h{i}.example/inbox")).collect();
    let body = serde_json::json!({
        "outbox": "https://me.example/users/alice",
        "activity": activity,
        "recipients": recipients,
    })
    .to_string();
    let (status, answer) = served
        .call("POST", "/api/v1/activitypub/deliveries", Some(&producer), Some(&body))
        .await?;
    ensure!(
        status == 200 && answer["created"] == 1000,
        "{status} {}",
        answer["created"]
    );
    let rows = served.queue.table_rows().await?;
    let count = |t: &str| rows.iter().find(|(n, _)| n == t).map_or(-1, |(_, n)| *n);
    ensure!(count("ops") == 1000 && count("payloads") == 1, "{rows:?}");
    settle(served.queue.as_ref(), Duration::from_secs(60)).await?;
    // Every reader sees the activity as sent: the API, and the executor.
    let first = answer["deliveries"][0]["id"].as_i64().context("an id")?;
    let (_, shown) = served
        .call("GET", &format!("/api/admin/outbox/{first}"), Some(&producer), None)
        .await?;
    let shown: Value = serde_json::from_str(shown["op"]["payload"].as_str().context("a payload")?)?;
    ensure!(shown == activity, "the stored payload reads back as the activity");
    ensure!(
        exec.delivered().len() == 1000 && exec.payload_sizes().iter().all(|n| *n > 40_000),
        "the executor got the whole activity every time"
    );
    // A plain-SQL op keeps its own copy and reads back the same way.
    let own = served
        .running
        .dispatcher
        .enqueue(&[to("o", "https://solo.example/inbox", 1)])
        .await?[0]
        .id();
    ensure!(served.queue.get(own).await?.context("op")?.payload == r#"{"n":1}"#);
    settle(served.queue.as_ref(), Duration::from_secs(10)).await?;
    // Pruned with its last op, the payload goes too.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let config = fast_config("[queue]\nlease_ms = 2000\n[retention]\nconfirmed_ms = 2000\nbatch = 500\n")?;
    let pruner = laneway::pruner::Pruner::new(served.queue.clone(), std::sync::Arc::new(laneway::clock::SystemClock));
    let report = pruner.run_once(&config, "host-a").await?.context("the lease")?;
    ensure!(report.deleted == 1001, "{report:?}");
    let rows = served.queue.table_rows().await?;
    ensure!(
        rows.iter().all(|(t, n)| !(t == "ops" || t == "payloads") || *n == 0),
        "{rows:?}"
    );
    served.running.stop().await
}

async fn the_pruner_keeps_an_op_until_the_relay_has_sent_its_webhook(db: TestDb) -> anyhow::Result<()> {
    // Found by an operator run: a host restarted after a kill -9 pruned
    // ops whose outcomes its relay (still waiting for the dead host's
    // lease) had not yet turned into webhooks.
    let secret = tempfile::NamedTempFile::new()?;
    std::fs::write(
        secret.path(),
        format!("whsec_{}", "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0NTY3ODk="),
    )?;
    let config = fast_config(&format!(
        "[queue]\nlease_ms = 1000\n[retention]\nconfirmed_ms = 1000\n\
         [keys.hooks]\nalgorithm = \"hmac-sha256\"\nfile = {:?}\n\
         [outcomes]\nallowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1\"]\n\
         [kinds.note]\nlanes = \"optional\"\noutcome_webhook = \"http://127.0.0.1:9/hook\"\noutcome_webhook_key = \"hooks\"\n",
        secret.path().display().to_string()
    ))?;
    let exec = Scripted::new(0);
    let running = Running::start(db.queue.clone(), exec.registry(&["note"]), config.clone()).await?;
    let id = running
        .dispatcher
        .enqueue(&[laneway::queue::NewOp::new("o", "note", "{}")])
        .await?[0]
        .id();
    settle(db.queue.as_ref(), Duration::from_secs(10)).await?;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let pruner = laneway::pruner::Pruner::new(db.queue.clone(), std::sync::Arc::new(laneway::clock::SystemClock));
    let report = pruner.run_once(&config, "host-a").await?.context("the lease")?;
    ensure!(report.deleted == 0, "pruned before its webhook was relayed: {report:?}");
    ensure!(db.queue.get(id).await?.is_some());
    // The relay sees the outcome once the feed serves it (on PostgreSQL,
    // once older transactions on the cluster have ended).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut sent = 0;
    while sent == 0 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the relay never sent the webhook"
        );
        sent = laneway::webhook::relay_once(db.queue.as_ref(), &running.dispatcher, &config, "host-a")
            .await?
            .context("the relay's lease")?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ensure!(sent == 1, "one webhook: {sent}");
    let report = pruner.run_once(&config, "host-a").await?.context("the lease")?;
    ensure!(report.deleted >= 1 && db.queue.get(id).await?.is_none(), "{report:?}");
    running.stop().await
}
