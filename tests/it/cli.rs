//! The CLI, run in-process against a SQLite file: what an operator types and
//! reads, and that bad input gets one clear error and changes nothing.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context};
use laneway::cli::{self, CliError, Io};

pub(crate) struct Env {
    dir: tempfile::TempDir,
    config: PathBuf,
}

impl Env {
    /// A config on a fresh SQLite file. The connect timeout is generous: the
    /// whole suite runs in parallel on two cores, and an unreachable server
    /// is refused at once anyway.
    pub(crate) fn new(extra: &str) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let config = dir.path().join("laneway.toml");
        let db = dir.path().join("queue.db");
        std::fs::write(
            &config,
            format!(
                "[database]\nurl = \"sqlite://{}\"\nconnect_timeout_ms = 10000\n{extra}",
                db.display()
            ),
        )?;
        Ok(Self { dir, config })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Runs `laneway --config <file> args…` with `stdin`; returns stdout or the error.
    pub(crate) async fn run(&self, args: &[&str], stdin: &str) -> anyhow::Result<Result<String, CliError>> {
        run_with(&self.config, args, stdin, Vec::new()).await
    }

    pub(crate) async fn ok(&self, args: &[&str], stdin: &str) -> anyhow::Result<String> {
        self.run(args, stdin)
            .await?
            .map_err(|e| anyhow::anyhow!("{args:?} failed: {e}"))
    }

    pub(crate) async fn err(&self, args: &[&str], stdin: &str) -> anyhow::Result<String> {
        match self.run(args, stdin).await? {
            Ok(out) => anyhow::bail!("{args:?} succeeded: {out}"),
            Err(e) => Ok(e.to_string()),
        }
    }
}

async fn run_with(
    config: &Path,
    args: &[&str],
    stdin: &str,
    env: Vec<(String, String)>,
) -> anyhow::Result<Result<String, CliError>> {
    let mut argv = vec![
        "laneway".to_owned(),
        "--config".to_owned(),
        config.display().to_string(),
    ];
    argv.extend(args.iter().map(|a| (*a).to_owned()));
    let parsed = cli::parse(argv.into_iter().map(Into::into)).context("arguments")?;
    let mut input = stdin.as_bytes();
    let mut output = Vec::new();
    let result = cli::run(
        parsed,
        Io {
            env,
            stdin: &mut input,
            stdout: &mut output,
        },
    )
    .await;
    Ok(result.map(|()| String::from_utf8_lossy(&output).into_owned()))
}

const ANNOUNCE: &str = r#"{"type":"Announce","object":{"type":"CaseLedgerEntry","id":"urn:entry:1"}}"#;

#[tokio::test]
async fn an_operator_enqueues_lists_shows_cancels_and_retries() -> anyhow::Result<()> {
    let env = Env::new("")?;
    ensure!(env.ok(&["migrate"], "").await?.contains("current schema"));
    let enqueue = [
        "enqueue",
        "--kind",
        "activitypub",
        "--outbox",
        "https://cm.example/actor",
        "--lane",
        "https://coord.example/inbox",
        "--coalesce-key",
        "announce:1:coord",
        "--correlation-id",
        "urn:entry:1",
    ];
    ensure!(env.ok(&enqueue, ANNOUNCE).await? == "enqueued op 1\n");
    let declined = env.ok(&enqueue, ANNOUNCE).await?;
    ensure!(
        declined.starts_with("declined: op 1 with this coalesce key is already pending"),
        "{declined}"
    );

    std::fs::write(env.path("payload.json"), r#"{"amount":"10"}"#)?;
    let payload = env.path("payload.json").display().to_string();
    let json = env
        .ok(
            &[
                "enqueue",
                "--kind",
                "withdraw",
                "--outbox",
                "platform",
                "--lane",
                "GSIGNER",
                "--payload",
                &payload,
                "--idempotency-key",
                "withdraw:u1:t1",
                "--json",
            ],
            "",
        )
        .await?;
    let created: serde_json::Value = serde_json::from_str(&json)?;
    ensure!(created["result"] == "created", "{json}");
    // Ids are a monotonic sequence with gaps: the declined enqueue used one.
    let id = created["id"].as_i64().context("id")?;
    ensure!(id > 1, "{json}");
    let id_text = id.to_string();
    let again = env
        .ok(
            &[
                "enqueue",
                "--kind",
                "withdraw",
                "--outbox",
                "platform",
                "--lane",
                "GSIGNER",
                "--payload",
                &payload,
                "--idempotency-key",
                "withdraw:u1:t1",
            ],
            "",
        )
        .await?;
    ensure!(again.contains(&format!("op {id} already exists")), "{again}");

    let table = env.ok(&["ops", "list"], "").await?;
    ensure!(
        table.contains("activitypub") && table.contains("withdraw") && table.contains("critical"),
        "{table}"
    );
    let listed: serde_json::Value =
        serde_json::from_str(&env.ok(&["ops", "list", "--priority", "critical", "--json"], "").await?)?;
    ensure!(
        listed.as_array().map(Vec::len) == Some(1) && listed[0]["id"] == id,
        "{listed}"
    );

    let shown = env.ok(&["ops", "show", "1"], "").await?;
    ensure!(
        shown.contains("urn:entry:1") && shown.contains("no attempts yet"),
        "{shown}"
    );
    let shown: serde_json::Value = serde_json::from_str(&env.ok(&["ops", "show", "1", "--json"], "").await?)?;
    ensure!(
        shown["op"]["payload"] == ANNOUNCE && shown["attempts"].as_array().map(Vec::len) == Some(0),
        "{shown}"
    );

    ensure!(env.ok(&["ops", "cancel", "1"], "").await? == "op 1 cancelled\n");
    let refused = env.err(&["ops", "cancel", "1"], "").await?;
    ensure!(
        refused == "op 1: cannot cancel an op that is cancelled: cancel needs a pending op",
        "{refused}"
    );
    let refused = env.err(&["ops", "retry", &id_text], "").await?;
    ensure!(refused.contains("force-retry needs a failed op"), "{refused}");
    let missing = env.err(&["ops", "show", "99"], "").await?;
    ensure!(
        missing.starts_with("op 99 not found") && missing.contains("laneway archive show 99"),
        "{missing}"
    );
    let stats = env.ok(&["ops", "stats", "--json"], "").await?;
    ensure!(
        stats.contains("\"cancelled\"") && stats.contains("\"pending\""),
        "{stats}"
    );
    Ok(())
}

#[tokio::test]
async fn bad_input_gets_one_clear_error_and_changes_nothing() -> anyhow::Result<()> {
    let env = Env::new("[queue]\nmax_payload_bytes = 64\n")?;
    env.ok(&["migrate"], "").await?;
    let base = ["enqueue", "--kind", "activitypub", "--outbox", "o", "--lane", "l"];
    env.ok(&base, "{}").await?;
    let before = env.ok(&["ops", "list", "--json"], "").await?;

    let cases: Vec<(Vec<&str>, &str, &str)> = vec![
        (base.to_vec(), "{\"unterminated\": ", "payload is not valid JSON"),
        (
            base.to_vec(),
            "[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25]",
            "over the 64-byte limit",
        ),
        (
            [&base[..], &["--priority", "urgent"]].concat(),
            "{}",
            "unknown priority \"urgent\"",
        ),
        (
            vec!["enqueue", "--kind", "activitypub", "--outbox", "o"],
            "{}",
            "needs at least one lane",
        ),
        (
            vec!["enqueue", "--kind", "activitypub", "--outbox", "o", "--lane", " "],
            "{}",
            "needs at least one lane",
        ),
        (
            vec!["enqueue", "--kind", "fax", "--outbox", "o", "--lane", "l"],
            "{}",
            "unknown kind \"fax\"",
        ),
        (
            vec!["enqueue", "--kind", "activitypub", "--outbox", "", "--lane", "l"],
            "{}",
            "outbox must not be empty",
        ),
        (
            [&base[..], &["--payload", "/nonexistent/p.json"]].concat(),
            "",
            "cannot read payload file",
        ),
        (vec!["ops", "list", "--status", "done"], "", "unknown status \"done\""),
    ];
    for (args, stdin, expected) in cases {
        let message = env.err(&args, stdin).await?;
        ensure!(message.contains(expected), "{args:?}: {message:?} lacks {expected:?}");
        ensure!(
            !message.contains('\n'),
            "{args:?}: the error is not one line: {message:?}"
        );
    }
    ensure!(
        env.ok(&["ops", "list", "--json"], "").await? == before,
        "bad input changed the queue"
    );
    Ok(())
}

#[tokio::test]
async fn an_unreachable_or_unmigrated_or_newer_database_is_refused() -> anyhow::Result<()> {
    let env = Env::new("")?;
    let unmigrated = env.err(&["ops", "list"], "").await?;
    ensure!(unmigrated.contains("run `laneway migrate`"), "{unmigrated}");
    let nowhere = run_with(
        &env.config,
        &["ops", "list"],
        "",
        vec![(
            "LANEWAY_DATABASE__URL".into(),
            "postgres://nobody@127.0.0.1:1/none".into(),
        )],
    )
    .await?
    .err()
    .context("an unreachable database was accepted")?
    .to_string();
    ensure!(
        nowhere.starts_with("cannot open database postgres://nobody@127.0.0.1:1/none"),
        "{nowhere}"
    );

    env.ok(&["migrate"], "").await?;
    env.ok(
        &["enqueue", "--kind", "activitypub", "--outbox", "o", "--lane", "l"],
        "{}",
    )
    .await?;
    let db = env.path("queue.db");
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", db.display())).await?;
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (99990101000000, 'from the future', TRUE, X'00', 0)",
    )
    .execute(&pool)
    .await?;
    pool.close().await;
    let newer = env
        .err(
            &["enqueue", "--kind", "activitypub", "--outbox", "o", "--lane", "l"],
            "{}",
        )
        .await?;
    ensure!(newer.contains("newer than this laneway knows"), "{newer}");
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", db.display())).await?;
    let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM laneway_ops")
        .fetch_one(&pool)
        .await?;
    ensure!(count == 1, "an op was written to a newer schema");
    Ok(())
}

#[tokio::test]
async fn config_problems_are_reported_together() -> anyhow::Result<()> {
    let env = Env::new("[queue]\nlease_ms = 5\nclaim_batch = 0\nturbo = true\n")?;
    let message = env.err(&["check-config"], "").await?;
    for expected in [
        "3 problems",
        "queue.lease_ms",
        "queue.claim_batch",
        "queue.turbo: unknown key",
    ] {
        ensure!(message.contains(expected), "{message} lacks {expected}");
    }
    Ok(())
}

#[tokio::test]
async fn fanout_makes_one_op_per_delivery_inbox_and_is_idempotent() -> anyhow::Result<()> {
    let env = Env::new("")?;
    env.ok(&["migrate"], "").await?;
    let activity =
        r#"{"id":"https://cm.example/a/1","type":"Announce","object":{"type":"CaseLedgerEntry","id":"urn:e:1"}}"#;
    let args = [
        "fanout",
        "--outbox",
        "https://cm.example/actor",
        "--to",
        "https://big.example/users/a/inbox=https://big.example/inbox",
        "--to",
        "https://big.example/users/b/inbox=https://big.example/inbox",
        "--to",
        "https://small.example/users/c/inbox",
    ];
    let out = env.ok(&args, activity).await?;
    let lines: Vec<&str> = out.lines().collect();
    ensure!(lines.len() == 2, "{out}");
    ensure!(
        lines[0].starts_with("https://big.example/inbox: op ")
            && lines[1].starts_with("https://small.example/users/c/inbox: op "),
        "{out}"
    );
    let again = env.ok(&args, activity).await?;
    ensure!(again.lines().all(|l| l.ends_with("(already enqueued)")), "{again}");
    let ops: serde_json::Value = serde_json::from_str(&env.ok(&["ops", "list", "--json"], "").await?)?;
    ensure!(ops.as_array().map(Vec::len) == Some(2), "{ops}");
    ensure!(ops[0]["correlation_id"] == "urn:e:1", "{ops}");
    let refused = env.err(&["fanout", "--outbox", "a", "--to", "ftp://x"], "{}").await?;
    ensure!(refused.contains("not an http(s) URL"), "{refused}");
    Ok(())
}

#[tokio::test]
async fn plugin_check_describes_a_good_component_and_refuses_a_bad_one() -> anyhow::Result<()> {
    let env = Env::new("")?;
    let noop = crate::runtime::wasm("noop")?.display().to_string();
    let out = env.ok(&["plugin", "check", &noop], "").await?;
    ensure!(
        out.contains("world:    executor-plugin")
            && out.contains("laneway:plugin@1.4.0")
            && out.contains("laneway:plugin/validation@1.4.0"),
        "{out}"
    );
    let bad = crate::runtime::wasm("forbidden-import")?.display().to_string();
    let refused = env.err(&["plugin", "check", &bad], "").await?;
    ensure!(
        refused.contains("wasi:sockets") && refused.contains("does not allow"),
        "{refused}"
    );
    let missing = env.err(&["plugin", "check", "/nonexistent.wasm"], "").await?;
    ensure!(missing.contains("cannot read"), "{missing}");
    Ok(())
}

/// Enqueueing a priced kind answers with seed 003's estimate: the base fee
/// it would bid now and the expected confirmation time. With no snapshot
/// stored yet the policy quotes its default base fee.
#[tokio::test]
async fn enqueue_of_a_priced_kind_reports_the_fee_estimate() -> anyhow::Result<()> {
    let fees = crate::runtime::wasm("fee-policy")?.display().to_string();
    let noop = crate::runtime::wasm("noop")?.display().to_string();
    let env = Env::new(&format!(
        "[plugins.fees]\npath = {fees:?}\n\
         [plugins.chain]\npath = {noop:?}\nallowed_hosts = [\"http://127.0.0.1:9\"]\n\
         [oracles.stellar]\npolicy = \"fees\"\nrpc_url = \"http://127.0.0.1:9/\"\n\
         [oracles.stellar.config]\ndefault_base_fee = 250\n\
         [kinds.deposit]\nfee_oracle = \"stellar\"\n"
    ))?;
    env.ok(&["migrate"], "").await?;
    let args = ["enqueue", "--kind", "deposit", "--outbox", "vault", "--lane", "GSIGNER"];
    let text = env.ok(&args, "{}").await?;
    ensure!(
        text.contains("enqueued op 1") && text.contains("estimate: base fee 250 stroops"),
        "{text}"
    );
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let out: serde_json::Value = serde_json::from_str(&env.ok(&json_args, r#"{"n":2}"#).await?)?;
    ensure!(
        out["result"] == "created" && out["id"] == 2 && out["estimate"]["base_fee"] == 250,
        "{out}"
    );
    ensure!(
        out["estimate"]["est_confirmation_seconds"]
            .as_u64()
            .is_some_and(|s| s > 0),
        "{out}"
    );
    Ok(())
}

#[tokio::test]
async fn api_keys_are_shown_once_listed_without_secrets_and_audited() -> anyhow::Result<()> {
    let env = Env::new("")?;
    env.ok(&["migrate"], "").await?;
    let made = env
        .ok(
            &[
                "api-keys",
                "new",
                "--name",
                "oncall",
                "--scopes",
                "outbox:read,outbox:write",
            ],
            "",
        )
        .await?;
    let secret = made.lines().next().context("the key")?.trim().to_owned();
    ensure!(secret.starts_with("lw_") && secret.len() > 40, "{made}");
    let listed = env.ok(&["api-keys", "list"], "").await?;
    ensure!(listed.contains("oncall") && listed.contains("outbox:write"), "{listed}");
    let hidden = secret.rsplit('_').next().context("the secret part")?;
    ensure!(!listed.contains(hidden), "the list shows the secret: {listed}");
    let again = env
        .err(&["api-keys", "new", "--name", "oncall", "--scopes", "outbox:read"], "")
        .await?;
    ensure!(
        again.contains("an API key named \"oncall\" already exists") && !again.contains("op 0"),
        "{again}"
    );
    let bad = env
        .err(&["api-keys", "new", "--name", "x", "--scopes", "outbox:everything"], "")
        .await?;
    ensure!(bad.contains("unknown scope") && bad.contains("outbox:read"), "{bad}");
    env.ok(&["api-keys", "revoke", "oncall"], "").await?;
    let audit = env.ok(&["audit", "--json"], "").await?;
    ensure!(
        audit.contains("\"cli:") && audit.contains("api_key.new") && audit.contains("api_key.revoke"),
        "{audit}"
    );
    ensure!(!audit.contains(hidden), "the audit log holds the secret: {audit}");
    Ok(())
}

#[tokio::test]
async fn outcomes_prints_terminal_transitions_from_a_cursor() -> anyhow::Result<()> {
    let env = Env::new("[kinds.note]\nlanes = \"optional\"\n")?;
    env.ok(&["migrate"], "").await?;
    let made = env
        .ok(&["enqueue", "--kind", "note", "--outbox", "o", "--json"], "{}")
        .await?;
    let id = serde_json::from_str::<serde_json::Value>(&made)?["id"]
        .as_i64()
        .context("an id")?;
    ensure!(env.ok(&["outcomes"], "").await?.is_empty(), "nothing terminal yet");
    env.ok(&["ops", "cancel", &id.to_string()], "").await?;
    let printed = env.ok(&["outcomes"], "").await?;
    let line = printed.lines().next().context("one line")?;
    let fields: Vec<&str> = line.split('\t').collect();
    ensure!(
        fields.len() >= 5 && fields[1] == "cancelled" && fields[2] == format!("op {id}") && fields[3] == "note",
        "{printed}"
    );
    let after = env.ok(&["outcomes", "--after", fields[0]], "").await?;
    ensure!(after.is_empty(), "nothing after the last cursor: {after}");
    let bad = env.err(&["outcomes", "--after", "yesterday"], "").await?;
    ensure!(bad.contains("cursor"), "{bad}");
    Ok(())
}

#[tokio::test]
async fn check_config_refuses_a_retention_shorter_than_the_lease_and_a_bad_archive() -> anyhow::Result<()> {
    let file = tempfile::NamedTempFile::new()?;
    let env = Env::new(&format!(
        "[queue]\nlease_ms = 30000\n[retention]\nconfirmed_ms = 1000\nbatch = 0\n\
         [kinds.note]\nlanes = \"optional\"\nretention_failed_ms = 5\narchive = {:?}\n",
        file.path().display().to_string()
    ))?;
    let error = env.err(&["check-config"], "").await?;
    for (path, word) in [
        ("retention.confirmed_ms", "queue.lease_ms"),
        ("retention.batch", "1 to 10000"),
        ("kinds.note.retention_failed_ms", "queue.lease_ms"),
        ("kinds.note.archive", "not a directory"),
    ] {
        ensure!(
            error.lines().any(|l| l.contains(path) && l.contains(word)),
            "{path} ({word}) not reported:\n{error}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn check_config_refuses_a_webhook_outside_the_allow_list_or_with_an_unknown_secret() -> anyhow::Result<()> {
    let env = Env::new(
        "[outcomes]\nallowed_hosts = [\"https://hooks.example.com\"]\n\
         [keys.signer]\nalgorithm = \"ed25519\"\nenv = \"NOPE\"\n\
         [kinds.a]\nlanes = \"optional\"\noutcome_webhook = \"https://evil.example/hook\"\noutcome_webhook_key = \"hooks\"\n\
         [kinds.b]\nlanes = \"optional\"\noutcome_webhook = \"https://hooks.example.com/x\"\noutcome_webhook_key = \"signer\"\n\
         [kinds.c]\nlanes = \"optional\"\noutcome_webhook = \"https://hooks.example.com/x\"\n",
    )?;
    let error = env.err(&["check-config"], "").await?;
    for (path, word) in [
        ("kinds.a.outcome_webhook", "outcomes.allowed_hosts"),
        ("kinds.a.outcome_webhook_key", "no [keys.hooks]"),
        ("kinds.b.outcome_webhook_key", "hmac-sha256"),
        ("kinds.c.outcome_webhook_key", "expected the [keys.ID]"),
    ] {
        ensure!(
            error.lines().any(|l| l.contains(path) && l.contains(word)),
            "{path} ({word}) not reported:\n{error}"
        );
    }
    Ok(())
}

/// The remote CLI as a process: an API key is not sent over plain http:// to
/// a host that is not this machine unless the operator says `--insecure`.
/// It runs in a network namespace of its own, so nothing could leave the
/// machine even if the refusal were gone (then the error would be "cannot
/// reach", and the test fails).
#[test]
fn the_remote_cli_keeps_a_key_off_plain_http_to_another_machine() -> anyhow::Result<()> {
    let bin = crate::support::laneway_binary()?;
    let run = |args: &[&str]| {
        std::process::Command::new("unshare")
            .arg("-n")
            .arg(&bin)
            .args(args)
            .env("LW_API_KEY", "lw_1_secret")
            .output()
    };
    let refused = run(&["--url", "http://192.0.2.10:7480", "ops", "stats"])?;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    ensure!(!refused.status.success(), "plain http to another machine: {stderr}");
    ensure!(
        stderr.contains("--insecure") && stderr.contains("192.0.2.10"),
        "the refusal says what to do: {stderr}"
    );
    // With --insecure it tries (and, with no network in here, cannot reach).
    let tried = run(&["--url", "http://192.0.2.10:7480", "--insecure", "ops", "stats"])?;
    let stderr = String::from_utf8_lossy(&tried.stderr);
    ensure!(
        !tried.status.success() && stderr.contains("cannot reach"),
        "--insecure sends: {stderr}"
    );
    Ok(())
}
