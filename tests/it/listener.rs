//! The API listener past its connection cap, as a process: `laneway run`
//! started under a service manager's default soft open-files limit (1,024)
//! raises it to the hard limit and says so, and with more slow connections
//! than `max_connections` trickling header bytes from many addresses (each
//! under its own cap), `/healthz` on a new connection still answers within
//! a second: a connection still waiting for its headers gives way.

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use tokio::io::AsyncWriteExt as _;

/// The soft and hard open-files limits of process `pid`.
fn open_files_limits(pid: u32) -> anyhow::Result<(String, String)> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits"))?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .context("no open-files line")?;
    let fields: Vec<&str> = line.split_whitespace().collect();
    Ok((fields[3].to_owned(), fields[4].to_owned()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_cap_health_still_answers_within_a_second() -> anyhow::Result<()> {
    let bin = crate::support::laneway_binary()?;
    let dir = tempfile::tempdir()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let config = dir.path().join("laneway.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"sqlite://{}\"\n[api]\nlisten = \"127.0.0.1:{port}\"\n\
             max_connections = 1024\nmax_connections_per_ip = 100\nheader_timeout_ms = 60000\n\
             [kinds.parked]\nlanes = \"optional\"\n",
            dir.path().join("queue.db").display()
        ),
    )?;
    crate::support::migrate_with(&bin, &config)?;
    let minted = std::process::Command::new(&bin)
        .args(["--config"])
        .arg(&config)
        .args([
            "api-keys",
            "new",
            "--name",
            "producer",
            "--scopes",
            "ops:write",
            "--json",
        ])
        .output()?;
    let minted: serde_json::Value = serde_json::from_slice(&minted.stdout)?;
    let key = minted["secret"].as_str().context("a key")?.to_owned();
    let (_, hard) = open_files_limits(std::process::id())?;
    let log = dir.path().join("laneway.log");
    // As systemd starts a service: a soft limit of 1,024 under the hard one.
    let host = crate::support::Process(
        std::process::Command::new("sh")
            .arg("-c")
            .arg("ulimit -Sn 1024 && exec \"$0\" --config \"$1\" run")
            .arg(&bin)
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?,
    );
    let base = format!("http://127.0.0.1:{port}");
    crate::support::wait_healthy(&base).await?;
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build()?;
    let (soft_now, hard_now) = open_files_limits(host.0.id())?;
    ensure!(
        soft_now == hard && hard_now == hard,
        "the soft limit was not raised: {soft_now}/{hard_now} (hard {hard})"
    );
    let logged = std::fs::read_to_string(&log)?;
    ensure!(logged.contains("Raised the open-files limit"), "{logged}");

    // A request in progress when the cap is reached (an enqueue waiting up
    // to 4 s for an outcome that never comes: `parked` has no plugin) must
    // not be the connection that gives way.
    let waiting = {
        let http = http.clone();
        let url = format!("{base}/api/v1/ops?wait=4");
        tokio::spawn(async move {
            http.post(url)
                .bearer_auth(key)
                .header("content-type", "application/json")
                .body(r#"{"kind":"parked","outbox":"o","payload":{}}"#)
                .send()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // 1,116 slow connections from 12 addresses, 93 each (under the
    // per-address cap of 100), each sending part of a request line.
    let mut slow = Vec::new();
    for address in 2..14u8 {
        for _ in 0..93 {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(std::net::SocketAddr::from(([127, 0, 0, address], 0)))?;
            let Ok(mut stream) = socket.connect(([127, 0, 0, 1], port).into()).await else {
                continue;
            };
            let _ = stream.write_all(b"GET /healthz HTTP/1.1\r\nHo").await;
            slow.push(stream);
        }
    }
    ensure!(slow.len() > 1_024, "only {} slow connections opened", slow.len());
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..5 {
        let started = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(1), http.get(format!("{base}/healthz")).send())
            .await
            .context("/healthz took over a second past the cap")?
            .context("/healthz refused past the cap")?;
        ensure!(answer.status().is_success(), "{}", answer.status());
        ensure!(started.elapsed() < Duration::from_secs(1));
    }
    let answered = waiting.await?.context("the request in progress was cut")?;
    ensure!(answered.status() == 202, "the waiting enqueue: {}", answered.status());
    drop(slow);
    Ok(())
}
