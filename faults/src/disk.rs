//! SQLite on a full disk, from outside: the database on a small tmpfs, the
//! API's answer once it is full, a kill -9 and restart while full, then
//! every acknowledged op delivered from an intact database once space
//! returns.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _};
use serde_json::{json, Value};

use crate::check::{Acked, History};
use crate::procs;
use crate::run::{arrivals, config_text, prepare, rows, start_paused, write_keys, Env, PER_DESTINATION};

/// What the disk-full run saw.
#[derive(Debug, Default)]
pub struct DiskFull {
    /// Why it did not run, when it could not (mounting needs root).
    pub not_run: Option<String>,
    /// Fan-outs acknowledged before the disk filled.
    pub acked_before: usize,
    /// The API's answer once the disk was full.
    pub refusal: String,
    /// What a kill -9 and a restart on the full disk did.
    pub restart: String,
    /// `PRAGMA integrity_check` after space returned.
    pub integrity: String,
    pub history: History,
}

/// SQLite on a full disk: the database on a small tmpfs, a ballast file
/// holding the last of its space, ops enqueued (their kind paused) until
/// the API refuses; a kill -9 and restart while full; then the ballast
/// removed, the kind resumed, and every acknowledged op must be delivered
/// from an intact database.
pub async fn run(env: &Env) -> anyhow::Result<DiskFull> {
    let mut outcome = DiskFull::default();
    let temp = tempfile::tempdir()?;
    let dir = env.keep.clone().unwrap_or_else(|| temp.path().to_owned());
    std::fs::create_dir_all(&dir)?;
    let disk = dir.join("disk");
    std::fs::create_dir_all(&disk)?;
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=12m", "tmpfs"])
        .arg(&disk)
        .output()
        .context("mount(8)")?;
    if !mounted.status.success() {
        outcome.not_run = Some(format!(
            "mounting a 12 MiB tmpfs failed (it needs root): {}",
            String::from_utf8_lossy(&mounted.stderr).trim()
        ));
        return Ok(outcome);
    }
    // Unmounted however the run ends.
    struct Mount(PathBuf);
    impl Drop for Mount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _mount = Mount(disk.clone());

    let keys = write_keys(&dir)?;
    let log = dir.join("inbox.jsonl");
    let (_inbox, inbox_port) = procs::node_inbox(&env.repo, &keys.inbox_keys, &log)?;
    let db_url = format!("sqlite://{}", disk.join("queue.db").display());
    let plugins = env.repo.join("plugins/target/wasm32-wasip2/release");
    let laneway = prepare(
        env,
        &dir,
        &config_text(&db_url, &plugins, &keys.pem, &keys.hook_key, None),
    )?;
    let producer = laneway.api_key("producer", "ops:write")?;
    let admin = laneway.api_key("admin", "outbox:read,outbox:write")?;
    // The ballast: everything the disk has left but 1 MiB, freed later.
    let ballast = disk.join("ballast");
    {
        let free = statvfs_free(&disk)?;
        let size = free.saturating_sub(1 << 20);
        std::fs::write(&ballast, vec![0u8; usize::try_from(size).unwrap_or(0)])?;
    }
    let http = reqwest::Client::builder().no_proxy().build()?;
    let (mut host, port, base) = start_paused(&laneway, &http, &admin, "activitypub").await?;
    let inboxes: Vec<String> = (0..10)
        .map(|n| format!("http://127.0.0.1:{inbox_port}/users/u{n}/inbox"))
        .collect();
    let mut acked = Vec::new();
    let fan_out = |n: usize| {
        let outbox = "https://faults.laneway.example/actors/0".to_owned();
        let activity = format!("{outbox}/activities/{n}");
        let body = json!({"outbox": outbox, "recipients": inboxes,
            "activity": {"id": activity, "type": "Create", "actor": outbox,
                         "object": {"id": format!("{activity}/note"), "type": "Note",
                                    "content": "x".repeat(2000)}}});
        (outbox, activity, body)
    };
    let record = |acked: &mut Vec<Acked>, answer: &Value, outbox: &str, activity: &str| -> anyhow::Result<()> {
        for (inbox, d) in inboxes
            .iter()
            .zip(answer["deliveries"].as_array().context("deliveries")?)
        {
            acked.push(Acked {
                op: d["id"].as_i64().context("id")?,
                outbox: outbox.to_owned(),
                inbox: inbox.clone(),
                activity: activity.to_owned(),
            });
        }
        Ok(())
    };
    let post = |body: &Value| {
        let request = procs::post_json(&http, format!("{base}/api/v1/activitypub/deliveries"), &producer, body)
            .timeout(Duration::from_secs(20))
            .send();
        async move {
            let answer = request.await?;
            let status = answer.status();
            anyhow::Ok((status, answer.text().await?))
        }
    };
    let mut n = 0;
    loop {
        ensure!(n < 5000, "the disk never filled");
        let (outbox, activity, body) = fan_out(n);
        let (status, text) = post(&body).await?;
        if !status.is_success() {
            outcome.refusal = format!("{status}: {text}");
            break;
        }
        let answer: Value = serde_json::from_str(&text)?;
        record(&mut acked, &answer, &outbox, &activity)?;
        outcome.acked_before += 1;
        n += 1;
    }
    // A crash and a restart while the disk is still full.
    host.kill9();
    let mut restarted = laneway.start(port, None)?;
    outcome.restart = match procs::ready(&http, &mut restarted, port).await {
        Ok(()) => "restarted on the full disk and ready".to_owned(),
        Err(e) => format!("did not start on the full disk ({e})"),
    };
    drop(restarted);
    // Space returns.
    std::fs::remove_file(&ballast)?;
    let mut host = laneway.start(port, None)?;
    procs::ready(&http, &mut host, port).await?;
    // The refused fan-out, again: now it is taken.
    let (outbox, activity, body) = fan_out(n);
    let (status, answer) = post(&body).await?;
    ensure!(status.is_success(), "after space returned: {status}: {answer}");
    let answer: Value = serde_json::from_str(&answer).with_context(|| answer.clone())?;
    record(&mut acked, &answer, &outbox, &activity)?;
    let resumed = http
        .delete(format!("{base}/api/admin/pauses/kind/activitypub"))
        .bearer_auth(&admin)
        .send()
        .await?;
    ensure!(resumed.status().is_success(), "resume: {}", resumed.status());
    let deadline = Instant::now() + Duration::from_secs(120);
    let final_rows = loop {
        let (rows, _, open) = rows(&db_url).await?;
        if open == 0 || Instant::now() > deadline {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    drop(host);
    {
        use sqlx::Connection as _;
        let mut db = sqlx::SqliteConnection::connect(&db_url).await?;
        let rows: Vec<String> = sqlx::query_scalar("PRAGMA integrity_check").fetch_all(&mut db).await?;
        outcome.integrity = rows.join("; ");
    }
    let (arrivals, _) = arrivals(&[(inbox_port, log)], &inboxes)?;
    outcome.history = History {
        acked,
        arrivals,
        rows: final_rows,
        // The kill while full: its ops were paused, none in flight.
        kills: 1,
        stalls: 0,
        in_flight: PER_DESTINATION,
        lost_answers: 0,
        webhooks: None,
        ..History::default()
    };
    Ok(outcome)
}

/// Free bytes on the file system holding `dir`, from df(1): the crate
/// forbids the unsafe a statvfs call would need.
fn statvfs_free(dir: &Path) -> anyhow::Result<u64> {
    let out = std::process::Command::new("df")
        .args(["--output=avail", "-B1"])
        .arg(dir)
        .output()
        .context("df(1)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .with_context(|| format!("df printed {text:?}"))
}
