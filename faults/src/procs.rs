//! The processes a run drives: the `laneway` binary (started, killed -9,
//! stopped and continued) and the repository's Node inbox. Every child is
//! killed and reaped when its handle drops, however the run ends.

use std::io::BufRead as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context as _};

/// A child killed (SIGKILL) and reaped on drop.
pub struct Proc {
    child: Child,
    pub name: String,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// kill -9, then reap.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends a signal by name (`STOP`, `CONT`, `TERM`) through kill(1): the
    /// crate forbids the unsafe a libc call would need.
    pub fn signal(&self, name: &str) -> anyhow::Result<()> {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status()
            .context("kill(1)")?;
        if !status.success() {
            bail!("kill -{name} {} failed: {status}", self.pid());
        }
        Ok(())
    }

    /// Starts `command` with a pipe to its stdin, which the caller keeps.
    pub fn spawn_with_stdin(mut command: Command, name: &str) -> anyhow::Result<(Self, std::process::ChildStdin)> {
        let mut child = command.stdin(Stdio::piped()).spawn()?;
        let stdin = child.stdin.take().context("the child's stdin")?;
        Ok((
            Self {
                child,
                name: name.to_owned(),
            },
            stdin,
        ))
    }

    /// Whether it has exited (and how).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The Node inbox (`tests/tools/ap-inbox/inbox.js`), which verifies every
/// signature with libraries laneway did not write and appends each request
/// it answered to `out` before answering.
pub fn node_inbox(repo: &Path, keys: &Path, out: &Path) -> anyhow::Result<(Proc, u16)> {
    let script = repo.join("tests/tools/ap-inbox/inbox.js");
    if !repo.join("tests/tools/ap-inbox/node_modules").exists() {
        bail!("run `npm ci --prefix tests/tools/ap-inbox` first (./dev test does)");
    }
    let mut child = Command::new("node")
        .arg(&script)
        .arg(keys)
        .arg(out)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("node (the fake inbox)")?;
    let stdout = child.stdout.take().context("the inbox's stdout")?;
    let mut proc = Proc {
        child,
        name: "inbox".to_owned(),
    };
    let mut line = String::new();
    std::io::BufReader::new(stdout)
        .read_line(&mut line)
        .context("reading the inbox's port")?;
    let port = match line.trim().parse() {
        Ok(port) => port,
        Err(_) => {
            proc.kill9();
            bail!("the inbox printed {line:?}, not its port");
        }
    };
    Ok((proc, port))
}

/// How to run the binary under test.
#[derive(Clone)]
pub struct Laneway {
    pub bin: PathBuf,
    pub config: PathBuf,
    /// stderr of every host, appended, for the post-mortem.
    pub log: PathBuf,
}

impl Laneway {
    /// One CLI command to completion; its stdout.
    pub fn cli(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new(&self.bin)
            .arg("--config")
            .arg(&self.config)
            .args(args)
            .output()
            .with_context(|| format!("running {}", self.bin.display()))?;
        if !out.status.success() {
            bail!(
                "laneway {args:?}: {}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// A new API key with `scopes`; its secret.
    pub fn api_key(&self, name: &str, scopes: &str) -> anyhow::Result<String> {
        let out = self.cli(&["api-keys", "new", "--name", name, "--scopes", scopes, "--json"])?;
        let v: serde_json::Value = serde_json::from_str(&out).with_context(|| out.clone())?;
        Ok(v["secret"].as_str().context("the key's secret")?.to_owned())
    }

    /// `laneway run` as its own process, listening on `port`, with a
    /// failpoint armed when given.
    pub fn start(&self, port: u16, failpoint: Option<&str>) -> anyhow::Result<Proc> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .context("the hosts' log")?;
        let mut command = Command::new(&self.bin);
        command
            .arg("--config")
            .arg(&self.config)
            .arg("run")
            // The API's port: each host of a run has its own.
            .env("LANEWAY_API__LISTEN", format!("127.0.0.1:{port}"))
            // LW_HOST_LOG (e.g. "info") when a failed run needs more.
            .env(
                "RUST_LOG",
                std::env::var("LW_HOST_LOG").unwrap_or_else(|_| "warn".to_owned()),
            )
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(point) = failpoint {
            command.env("LANEWAY_FAILPOINT", point);
        }
        let child = command.spawn().context("starting laneway")?;
        Ok(Proc {
            child,
            name: format!("laneway:{port}"),
        })
    }
}

/// As [`ready`], for a host started with `failpoint` armed: a failpoint
/// can fire while the host still starts (the relay, the pruner and the
/// drains work off what earlier lives left before `/readyz` answers), and
/// then the fault happened, only sooner. `Some(line)` says so for the
/// fault list; any other failure to start is an error.
pub async fn ready_unless_aborted(
    http: &reqwest::Client,
    host: &mut Proc,
    port: u16,
    failpoint: Option<&str>,
) -> anyhow::Result<Option<String>> {
    use std::os::unix::process::ExitStatusExt as _;
    let Err(e) = ready(http, host, port).await else {
        return Ok(None);
    };
    match (failpoint, host.exited()) {
        // SIGABRT: the failpoint's `abort()`.
        (Some(point), Some(status)) if status.signal() == Some(6) => Ok(Some(format!(
            "failpoint {point}: aborted before it was ready ({status})"
        ))),
        _ => Err(e),
    }
}

/// Waits until `GET /readyz` answers 2xx, or the process exits, or 30 s.
pub async fn ready(http: &reqwest::Client, host: &mut Proc, port: u16) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = host.exited() {
            bail!("{} exited before it was ready: {status}", host.name);
        }
        let answer = http.get(format!("http://127.0.0.1:{port}/readyz")).send().await;
        if answer.is_ok_and(|a| a.status().is_success()) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{} was not ready within 30 s", host.name);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A POST of `body` as JSON to the API at `url`, with `key` as bearer.
pub fn post_json(http: &reqwest::Client, url: String, key: &str, body: &serde_json::Value) -> reqwest::RequestBuilder {
    http.post(url)
        .bearer_auth(key)
        .header("content-type", "application/json")
        .body(body.to_string())
}

/// A free port on 127.0.0.1 (bound, then released for the child).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
