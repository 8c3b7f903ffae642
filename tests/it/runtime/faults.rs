//! Every fault fixture yields its exact `PluginFailure`, and while they all
//! misbehave under load, ops of other kinds keep completing.

use std::sync::Arc;
use std::time::Duration;

use anyhow::ensure;
use laneway::keys::KeyStore;
use laneway::op::Status;
use laneway::queue::NewOp;
use laneway::runtime::failure::{PluginFailure, TrapKind};
use laneway::runtime::host::PluginHost;

use super::{attempt, config_with, http_server, load, op, runtime, Recorder, Serve};
use crate::dispatch::harness::{settle, Running};
use crate::support;

async fn execute(fixture: &str, extra: &str, payload: &str) -> anyhow::Result<Result<(), PluginFailure>> {
    let rt = runtime()?;
    let plugin =
        load(&rt, fixture, extra, KeyStore::default())?.map_err(|e| anyhow::anyhow!("{fixture} did not load: {e}"))?;
    Ok(plugin
        .execute(op(1, payload), attempt(Arc::new(Recorder::default())))
        .await
        .map(|_| ()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_is_an_unreachable_trap() -> anyhow::Result<()> {
    ensure!(execute("panic", "", "{}").await? == Err(PluginFailure::Trap(TrapKind::Unreachable)));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_infinite_loop_times_out() -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    ensure!(execute("spin", "timeout_ms = 300", "{}").await? == Err(PluginFailure::Timeout));
    ensure!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_bomb_exceeds_its_limit() -> anyhow::Result<()> {
    match execute("memory-bomb", "memory_mib = 8", "{}").await? {
        Err(PluginFailure::MemoryExceeded { requested, max }) => ensure!(max == 8 << 20 && requested > max),
        other => anyhow::bail!("{other:?}"),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_recursion_overflows_the_stack() -> anyhow::Result<()> {
    ensure!(execute("deep-recursion", "", "{}").await? == Err(PluginFailure::Trap(TrapKind::StackOverflow)));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_1_is_an_exit() -> anyhow::Result<()> {
    ensure!(execute("exit", "", "{}").await? == Err(PluginFailure::Exit(1)));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_host_call_times_out() -> anyhow::Result<()> {
    let port = http_server(Serve::Hang).await?;
    let extra = "timeout_ms = 300\nallowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1\"]";
    let started = std::time::Instant::now();
    let result = execute("slow-host", extra, &format!("\"http://127.0.0.1:{port}/\"")).await?;
    ensure!(result == Err(PluginFailure::Timeout), "{result:?}");
    ensure!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    Ok(())
}

/// `n` calls of `plugin` at once, each asking it to fetch
/// `http://127.0.0.1:{port}/`, and their results in order.
async fn at_once(
    plugin: &Arc<laneway::runtime::plugin::Plugin>,
    n: i64,
    port: u16,
) -> anyhow::Result<Vec<Result<(), PluginFailure>>> {
    let calls: Vec<_> = (0..n)
        .map(|i| {
            let plugin = plugin.clone();
            tokio::spawn(async move {
                plugin
                    .execute(
                        op(i, &format!("\"http://127.0.0.1:{port}/\"")),
                        attempt(Arc::new(Recorder::default())),
                    )
                    .await
                    .map(|_| ())
            })
        })
        .collect();
    let mut results = Vec::new();
    for call in calls {
        results.push(call.await?);
    }
    Ok(results)
}

/// More calls than the engine has instance slots: the extra one waits for
/// a slot (then runs to its own deadline) rather than trap past the pool,
/// which counted against the plugin as a crash and, five times over,
/// quarantined it while a fan-out to hung servers ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_the_instance_slots_waits_for_one() -> anyhow::Result<()> {
    let config =
        laneway::config::from_toml_str("[runtime]\nmax_instances = 2\n[dispatch]\nmax_in_flight = 2\nmax_slow = 0\n")?;
    let rt = laneway::runtime::Runtime::new(&config.runtime).map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let port = http_server(Serve::Hang).await?;
    let extra = "timeout_ms = 400\nallowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1\"]";
    let plugin = Arc::new(load(&rt, "slow-host", extra, KeyStore::default())?.map_err(|e| anyhow::anyhow!("{e}"))?);
    let started = std::time::Instant::now();
    let results = at_once(&plugin, 3, port).await?;
    ensure!(results.iter().all(|r| *r == Err(PluginFailure::Timeout)), "{results:?}");
    ensure!(
        started.elapsed() >= Duration::from_millis(750),
        "the third call waited for a slot: {:?}",
        started.elapsed()
    );
    // Many short calls through the two slots: a slot goes back only once
    // the call's instance is freed, so none of them trap on the pool.
    let port = http_server(Serve::Ok).await?;
    for result in at_once(&plugin, 40, port).await? {
        ensure!(result.is_ok(), "{result:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forbidden_imports_and_wrong_versions_are_refused_at_load() -> anyhow::Result<()> {
    let rt = runtime()?;
    match load(&rt, "forbidden-import", "", KeyStore::default())? {
        Err(PluginFailure::Incompatible(why)) => ensure!(why.contains("wasi:sockets"), "{why}"),
        other => anyhow::bail!("forbidden import loaded: {:?}", other.map(|_| ())),
    }
    match load(&rt, "wrong-version", "", KeyStore::default())? {
        Err(PluginFailure::Incompatible(why)) => ensure!(why.contains("@9.0.0") && why.contains("1.x"), "{why}"),
        other => anyhow::bail!("wrong version loaded: {:?}", other.map(|_| ())),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fuel_hog_exhausts_its_fuel() -> anyhow::Result<()> {
    use laneway::runtime::bindings::fee_policy::exports::laneway::plugin::fee_policy as wit;
    let rt = runtime()?;
    let plugin = load(&rt, "fuel-hog", "fuel = 1000000", KeyStore::default())?.map_err(|e| anyhow::anyhow!("{e}"))?;
    let request = wit::QuoteRequest {
        priority: laneway::runtime::bindings::executor::laneway::plugin::types::Priority::Normal,
        attempts: 1,
        fee_bumps: 0,
        enqueued_at_ms: 0,
        now_ms: 0,
        snapshot: None,
        config: "{}".into(),
    };
    let result = plugin.quote(request).await.map(|_| ());
    ensure!(result == Err(PluginFailure::FuelExhausted), "{result:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashing_version_is_quarantined_and_its_ops_wait() -> anyhow::Result<()> {
    let rt = runtime()?;
    let path = super::wasm("panic")?;
    let bytes = std::fs::read(&path)?;
    let plugin = rt
        .load(
            "panic",
            &bytes,
            &super::plugin_config(&path, "")?,
            Arc::new(KeyStore::default()),
            Arc::default(),
            2,
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for _ in 0..2 {
        ensure!(plugin
            .execute(op(1, "{}"), attempt(Arc::new(Recorder::default())))
            .await
            .is_err());
    }
    ensure!(
        plugin.health.quarantined(),
        "two crashes in a row with quarantine_after = 2"
    );
    Ok(())
}

/// Every fault fixture at once, under load, beside a healthy kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn healthy_kinds_keep_completing_while_every_fault_fixture_misbehaves() -> anyhow::Result<()> {
    let db = support::sqlite_live().await?;
    let port = http_server(Serve::Hang).await?;
    let slow =
        format!("timeout_ms = 300\nallowed_hosts = [\"http://127.0.0.1:{port}\"]\nallowed_internal = [\"127.0.0.1\"]");
    let faults = [
        ("panic", "panic", ""),
        ("spin", "spin", "timeout_ms = 300"),
        ("bomb", "memory-bomb", "memory_mib = 8"),
        ("recursion", "deep-recursion", ""),
        ("exit", "exit", ""),
        ("slow", "slow-host", slow.as_str()),
    ];
    let mut plugins: Vec<(&str, &str, &str)> = faults.to_vec();
    plugins.push(("noop", "noop", ""));
    let kinds: Vec<(&str, &str)> = plugins.iter().map(|(name, _, _)| (*name, *name)).collect();
    // Three ops of two attempts each crash a fixture six times: past the
    // default quarantine (five), the last attempt would wait for a new
    // version instead of dead-lettering, or not, as the attempts happen to
    // overlap. Quarantine has its own test; here every attempt runs.
    let config = config_with(&plugins, &kinds, "[runtime]\nquarantine_after = 100\n")?;
    let host = Arc::new(PluginHost::new(&config)?);
    host.apply(&config).await?;
    let mut ops = Vec::new();
    for round in 0..3 {
        for (kind, _, _) in &faults {
            let payload = if *kind == "slow" {
                format!("\"http://127.0.0.1:{port}/\"")
            } else {
                "{}".to_owned()
            };
            let mut op = NewOp::new(format!("{kind}-outbox-{round}"), *kind, payload);
            op.lanes = vec![format!("{kind}-{round}")];
            ops.push(op);
        }
    }
    for n in 0..40 {
        let mut op = NewOp::new(format!("healthy-{}", n % 4), "noop", "{}");
        op.lanes = vec![format!("lane-{n}")];
        ops.push(op);
    }
    db.queue.enqueue(&ops).await?;
    let running = Running::start(db.queue.clone(), host.registry(), config).await?;
    let started = std::time::Instant::now();
    // The healthy kind finishes while the faulty ones are still failing.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let healthy = db
            .queue
            .list(&laneway::queue::OpFilter {
                kind: Some("noop".into()),
                status: Some(Status::Confirmed),
                limit: 100,
                ..Default::default()
            })
            .await?;
        if healthy.len() == 40 {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "only {} healthy ops confirmed",
            healthy.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let healthy_done = started.elapsed();
    settle(db.queue.as_ref(), Duration::from_secs(30)).await?;
    running.stop().await?;
    for (kind, _, _) in &faults {
        let failed = db
            .queue
            .list(&laneway::queue::OpFilter {
                kind: Some((*kind).into()),
                status: Some(Status::Failed),
                limit: 10,
                ..Default::default()
            })
            .await?;
        ensure!(failed.len() == 3, "{kind}: {} dead letters", failed.len());
        ensure!(failed.iter().all(|o| o.attempts <= 2), "{kind}: too many attempts");
    }
    ensure!(
        healthy_done < Duration::from_secs(10),
        "healthy ops took {healthy_done:?}"
    );
    Ok(())
}
