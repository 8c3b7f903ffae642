//! Hot reload while ops flow: a new plugin version serves within 2 s with
//! no failed op, and a corrupt file keeps the old version and says why.

use std::sync::Arc;
use std::time::Duration;

use anyhow::ensure;
use laneway::config::FileSource;
use laneway::op::Status;
use laneway::queue::{NewOp, OpFilter};
use laneway::runtime::host::PluginHost;
use tokio::time::Instant;

use super::wasm;
use crate::dispatch::harness::{settle, Running};
use crate::support;

/// No op was dead-lettered.
async fn no_failed_ops(queue: &dyn laneway::queue::Queue) -> anyhow::Result<()> {
    let failed = queue
        .list(&OpFilter {
            status: Some(Status::Failed),
            limit: 10,
            ..Default::default()
        })
        .await?;
    ensure!(failed.is_empty(), "ops failed: {failed:?}");
    Ok(())
}

/// Replaces `to` by `from` the way deploys do: write aside, then rename.
fn replace(from: &[u8], to: &std::path::Path) -> anyhow::Result<()> {
    let tmp = to.with_extension("tmp");
    std::fs::write(&tmp, from)?;
    std::fs::rename(&tmp, to)?;
    Ok(())
}

async fn details(queue: &dyn laneway::queue::Queue, ids: &[i64]) -> anyhow::Result<Vec<Option<String>>> {
    let mut out = Vec::new();
    for id in ids {
        out.push(queue.attempts(*id).await?.last().and_then(|a| a.record.detail.clone()));
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_version_serves_within_two_seconds_and_a_corrupt_one_is_refused() -> anyhow::Result<()> {
    let db = support::sqlite_live().await?;
    let dir = tempfile::tempdir()?;
    let plugin_path = dir.path().join("noop.wasm");
    std::fs::copy(wasm("noop")?, &plugin_path)?;
    let config_path = dir.path().join("laneway.toml");
    std::fs::write(
        &config_path,
        format!(
            "[queue]\nlease_ms = 5000\n[dispatch]\npoll_ms = 25\n[runtime]\nreload_debounce_ms = 100\n\
             [plugins.noop]\npath = {:?}\n[kinds.noop]\nplugin = \"noop\"\nlanes = \"optional\"\n",
            plugin_path.display().to_string()
        ),
    )?;
    let source = FileSource::Explicit(config_path.clone());
    let config = laneway::config::load(&source, Vec::new())?;
    let host = Arc::new(PluginHost::new(&config)?);
    host.apply(&config).await?;
    let running = Running::watching(db.queue.clone(), host.clone(), source, config).await?;

    // A producer enqueues steadily throughout.
    let producer = {
        let dispatcher = running.dispatcher.clone();
        tokio::spawn(async move {
            let mut ids = Vec::new();
            for n in 0..150 {
                let op = NewOp::new(format!("o{}", n % 5), "noop", "{}");
                if let Ok(r) = dispatcher.enqueue(&[op]).await {
                    ids.push((Instant::now(), r[0].id()));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            ids
        })
    };
    tokio::time::sleep(Duration::from_millis(600)).await;
    replace(&std::fs::read(wasm("noop-v2")?)?, &plugin_path)?;
    let swapped_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after_swap = host.status();
    replace(b"\0asm this is not a component", &plugin_path)?;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let after_corrupt = host.status();
    let ids = producer.await?;
    settle(db.queue.as_ref(), Duration::from_secs(10)).await?;
    running.stop().await?;

    // No op failed during either change.
    no_failed_ops(db.queue.as_ref()).await?;
    let all: Vec<i64> = ids.iter().map(|(_, id)| *id).collect();
    let served = details(db.queue.as_ref(), &all).await?;
    ensure!(
        served
            .iter()
            .all(|d| d.as_deref() == Some("noop v1") || d.as_deref() == Some("noop v2")),
        "{served:?}"
    );
    // Ops enqueued 2 s after the swap are all served by v2, and so is
    // everything after the corrupt file (the old version stays).
    for ((at, _), detail) in ids.iter().zip(&served) {
        if *at > swapped_at + Duration::from_secs(2) {
            ensure!(
                detail.as_deref() == Some("noop v2"),
                "an op enqueued {:?} after the swap was served by {detail:?}",
                *at - swapped_at
            );
        }
    }
    ensure!(
        served.first().is_some_and(|d| d.as_deref() == Some("noop v1")),
        "v1 never served"
    );
    ensure!(
        after_swap.loads >= 2 && after_swap.last_error.is_none(),
        "{after_swap:?}"
    );
    ensure!(after_corrupt.failures >= 1, "{after_corrupt:?}");
    ensure!(
        after_corrupt
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("plugins.noop") && e.contains("not a valid WebAssembly component")),
        "{after_corrupt:?}"
    );
    Ok(())
}

/// The plugin authors' example (`examples/webhook-plugin`, written with the
/// SDK) dropped into a running host by editing its config: an op of a kind
/// the host did not know waits, and once the config names the plugin and
/// the kind it is delivered, as a Standard Webhook the reference library
/// verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_example_plugin_is_dropped_into_a_running_host_by_editing_its_config() -> anyhow::Result<()> {
    use base64::Engine as _;
    let db = support::sqlite_live().await?;
    let dir = tempfile::tempdir()?;
    let secret = format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode([3u8; 32]));
    let receiver = crate::stellar::vault::Receiver::start(&secret)?;
    let key_file = dir.path().join("hooks.secret");
    std::fs::write(&key_file, &secret)?;
    let before = format!(
        "[queue]\nlease_ms = 5000\n[dispatch]\npoll_ms = 25\n[runtime]\nreload_debounce_ms = 100\n\
         [keys.hooks]\nalgorithm = \"hmac-sha256\"\nfile = {:?}\n",
        key_file.display().to_string()
    );
    let config_path = dir.path().join("laneway.toml");
    std::fs::write(&config_path, &before)?;
    let source = FileSource::Explicit(config_path.clone());
    let config = laneway::config::load(&source, Vec::new())?;
    let host = Arc::new(PluginHost::new(&config)?);
    host.apply(&config).await?;
    let running = Running::watching(db.queue.clone(), host.clone(), source, config).await?;

    // A producer's op for a kind nobody serves yet waits, using no attempt.
    let id = db
        .queue
        .enqueue(&[NewOp::new("app", "hook", r#"{"event":"signed-up","user":7}"#)])
        .await?[0]
        .id();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let waiting = db.queue.get(id).await?.ok_or_else(|| anyhow::anyhow!("op {id}"))?;
    ensure!(
        waiting.status == Status::Pending && waiting.attempts == 0,
        "{waiting:?}"
    );

    // The operator drops the plugin in: one config edit.
    let plugin = dir.path().join("webhook.wasm");
    std::fs::copy(wasm("webhook")?, &plugin)?;
    let after = format!(
        "{before}[plugins.webhook]\npath = {:?}\nallowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1\"]\nkeys = [\"hooks\"]\n\
         [kinds.hook]\nplugin = \"webhook\"\nlanes = \"optional\"\n\
         config = {{ url = \"http://127.0.0.1:{}/hooks\", key = \"hooks\" }}\n",
        plugin.display().to_string(),
        receiver.port
    );
    replace(after.as_bytes(), &config_path)?;
    settle(db.queue.as_ref(), Duration::from_secs(10)).await?;
    running.stop().await?;
    let done = db.queue.get(id).await?.ok_or_else(|| anyhow::anyhow!("op {id}"))?;
    ensure!(done.status == Status::Confirmed, "{done:?}");
    let got = receiver.requests();
    ensure!(
        got.len() == 1 && got[0]["ok"] == true && got[0]["payload"]["event"] == "signed-up",
        "{got:?}"
    );
    Ok(())
}

/// A config rewritten in place (truncated, then written in pieces, as
/// editors and `cat >` do) while ops flow: the empty and the half-written
/// file are refused (the empty one would unload a kind with queued ops),
/// the kind is never unloaded, nothing fails, and an idle host does not
/// reload on its own reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_config_rewritten_in_place_is_never_applied_half_written() -> anyhow::Result<()> {
    use std::io::Write as _;
    let db = support::sqlite_live().await?;
    let dir = tempfile::tempdir()?;
    let plugin_path = dir.path().join("noop.wasm");
    std::fs::copy(wasm("noop")?, &plugin_path)?;
    let config_path = dir.path().join("laneway.toml");
    let text = format!(
        "[queue]\nlease_ms = 5000\n[dispatch]\npoll_ms = 25\n[runtime]\nreload_debounce_ms = 100\n\
         [plugins.noop]\npath = {:?}\n[kinds.noop]\nplugin = \"noop\"\nlanes = \"optional\"\n",
        plugin_path.display().to_string()
    );
    std::fs::write(&config_path, &text)?;
    let source = FileSource::Explicit(config_path.clone());
    let config = laneway::config::load(&source, Vec::new())?;
    let host = Arc::new(PluginHost::new(&config)?);
    host.apply(&config).await?;
    let running = Running::watching(db.queue.clone(), host.clone(), source, config).await?;
    // One op is always queued (due in an hour), so dropping the kind is a loss.
    let mut later = NewOp::new("later", "noop", "{}");
    later.not_before = Some(chrono::Utc::now() + chrono::Duration::hours(1));
    db.queue.enqueue(&[later]).await?;

    // Idle: the watcher's own reads do not wake it.
    let idle = host.status();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let still = host.status();
    ensure!(
        still.loads == idle.loads && still.failures == idle.failures,
        "reloads while idle: {idle:?} -> {still:?}"
    );

    let producer = {
        let dispatcher = running.dispatcher.clone();
        tokio::spawn(async move {
            let mut ids = Vec::new();
            for n in 0..100 {
                if let Ok(r) = dispatcher
                    .enqueue(&[NewOp::new(format!("o{}", n % 4), "noop", "{}")])
                    .await
                {
                    ids.push(r[0].id());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            ids
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Truncate, wait past the debounce, write half, wait, write the rest.
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&config_path)?;
    file.flush()?;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let empty_seen = host.status();
    let half = text.len() / 2;
    file.write_all(&text.as_bytes()[..half])?;
    file.flush()?;
    tokio::time::sleep(Duration::from_millis(400)).await;
    file.write_all(&text.as_bytes()[half..])?;
    file.flush()?;
    drop(file);
    let ids = producer.await?;
    // Every produced op is served (the one due in an hour stays queued).
    let deadline = Instant::now() + Duration::from_secs(10);
    for id in &ids {
        while db
            .queue
            .get(*id)
            .await?
            .is_some_and(|op| op.status != Status::Confirmed)
        {
            ensure!(Instant::now() < deadline, "op {id} was not served");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    running.stop().await?;

    ensure!(
        empty_seen
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("drops") && e.contains("noop")),
        "the empty file was not refused for dropping the kind: {empty_seen:?}"
    );
    ensure!(host.registry().get("noop").is_some(), "the kind was unloaded");
    for id in &ids {
        let op = db.queue.get(*id).await?.ok_or_else(|| anyhow::anyhow!("op {id}"))?;
        ensure!(op.status == Status::Confirmed, "{op:?}");
    }
    no_failed_ops(db.queue.as_ref()).await?;
    Ok(())
}
