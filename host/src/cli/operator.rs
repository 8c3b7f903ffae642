//! The operator-surface commands: API keys (`laneway api-keys`), pauses
//! (`laneway pause|resume|pauses`) and the audit log (`laneway audit`), and
//! the audit record every CLI write leaves (actor `cli:$USER`).

use std::io::Write;

use clap::{Args, Subcommand};
use serde_json::Value;

use super::{render, CliError};
use crate::api::auth;
use crate::queue::{NewAuditEntry, PauseScope, Queue};

/// `laneway api-keys …` (keys for the HTTP API; `laneway keys` shows the
/// signing keys the host holds).
#[derive(Debug, Subcommand)]
pub enum ApiKeysCommand {
    /// Make a key; its secret is printed once and stored only as a hash.
    New(ApiKeyNewArgs),
    /// Every key (never a secret).
    List(super::JsonArg),
    /// Revoke a key by name; requests with it get 401 from then on.
    Revoke(ApiKeyNameArgs),
}

/// `laneway api-keys new`
#[derive(Debug, Args)]
pub struct ApiKeyNewArgs {
    /// Its name (who or what uses it), unique.
    #[arg(long)]
    pub name: String,
    /// Comma-separated: ops:write, outcomes:read, outbox:read, outbox:write, plugins:admin, metrics:read.
    #[arg(long, value_delimiter = ',', required = true)]
    pub scopes: Vec<String>,
    /// Limit the key to this outbox (repeat for several): it enqueues there
    /// and reads those outboxes' outcomes only (ops:write and outcomes:read).
    #[arg(long = "outbox")]
    pub outboxes: Vec<String>,
    /// Print JSON (the secret in `secret`) instead of text.
    #[arg(long)]
    pub json: bool,
}

/// A key's name.
#[derive(Debug, Args)]
pub struct ApiKeyNameArgs {
    /// The key's name.
    pub name: String,
    /// Print JSON instead of a sentence.
    #[arg(long)]
    pub json: bool,
}

/// `laneway pause` / `laneway resume`
#[derive(Debug, Args)]
pub struct PauseArgs {
    /// kind, outbox or destination (an inbox's host, e.g. social.example).
    pub scope: String,
    /// The kind, outbox or host.
    pub target: String,
    /// Why, for the record (pause only).
    #[arg(long)]
    pub reason: Option<String>,
    /// Print JSON instead of a sentence.
    #[arg(long)]
    pub json: bool,
}

/// `laneway audit`
#[derive(Debug, Args)]
pub struct AuditArgs {
    /// Entries before this id (paging).
    #[arg(long)]
    pub before: Option<i64>,
    /// How many.
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `laneway outcomes`
#[derive(Debug, Clone, Args)]
pub struct OutcomesArgs {
    /// Start after this cursor (the first field of a line printed before).
    #[arg(long)]
    pub after: Option<String>,
    /// Keep printing new outcomes as they happen, until ctrl-c.
    #[arg(long)]
    pub follow: bool,
    /// Exit after this many (default: one page of 100; with --follow, never).
    #[arg(long)]
    pub count: Option<u64>,
    /// Only this outbox's outcomes.
    #[arg(long)]
    pub outbox: Option<String>,
    /// Only ops of this kind.
    #[arg(long)]
    pub kind: Option<String>,
    /// Only transitions to this status.
    #[arg(long, value_parser = ["confirmed", "failed", "cancelled"])]
    pub status: Option<String>,
    /// Also laneway's own ops (outcome webhooks, inbound activities).
    #[arg(long)]
    pub internal: bool,
    /// One JSON object per line instead of text.
    #[arg(long)]
    pub json: bool,
}

impl OutcomesArgs {
    /// The filters as the feed route's query parameters.
    pub(super) fn query(&self) -> Vec<(&'static str, Option<String>)> {
        vec![
            ("outbox", self.outbox.clone()),
            ("kind", self.kind.clone()),
            ("status", self.status.clone()),
            ("internal", self.internal.then(|| "true".to_owned())),
        ]
    }

    /// The filters as the feed's one reading of them (`--status` takes
    /// only terminal statuses, by clap).
    fn filter(&self) -> crate::queue::FeedFilter {
        crate::queue::FeedFilter {
            outbox: self.outbox.clone(),
            kind: self.kind.clone(),
            status: self.status.as_deref().and_then(|s| s.parse().ok()),
            internal: self.internal,
        }
    }
}

/// How often `outcomes --follow` asks for more.
pub(super) const FOLLOW_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// Prints one outcome as `outcomes` does.
pub(super) fn print_outcome(out: &mut dyn Write, entry: &serde_json::Value, json: bool) -> Result<(), CliError> {
    if json {
        writeln!(out, "{entry}")?;
    } else {
        let op = &entry["op"];
        let what = op["receipt"]
            .as_str()
            .or_else(|| op["last_error"].as_str())
            .unwrap_or("");
        writeln!(
            out,
            "{}\t{}\top {}\t{}\t{}\t{}",
            entry["cursor"].as_str().unwrap_or(""),
            entry["status"].as_str().unwrap_or(""),
            op["id"],
            op["kind"].as_str().unwrap_or(""),
            op["outbox"].as_str().unwrap_or(""),
            what
        )?;
    }
    out.flush()?;
    Ok(())
}

/// The `outcomes` loop over any source: `fetch(after, limit)` answers a
/// page of outcome summaries and the cursor after it. Prints until the
/// count is reached, or without `--follow` until a page comes back empty.
pub(super) async fn follow_outcomes(
    args: OutcomesArgs,
    out: &mut dyn Write,
    mut fetch: impl AsyncFnMut(Option<String>, u32) -> Result<(Vec<serde_json::Value>, Option<String>), CliError>,
) -> Result<(), CliError> {
    let limit = args.count.unwrap_or(if args.follow { u64::MAX } else { 100 });
    let mut cursor = args.after.clone();
    let mut printed = 0u64;
    while printed < limit {
        let page = u32::try_from((limit - printed).min(500)).unwrap_or(500);
        let (entries, next) = fetch(cursor.clone(), page).await?;
        for entry in entries
            .iter()
            .take(usize::try_from(limit - printed).unwrap_or(usize::MAX))
        {
            print_outcome(out, entry, args.json)?;
            printed += 1;
        }
        // A filtered page can be empty while the feed moved on: the cursor
        // says whether there was anything to read.
        let moved = next.is_some() && next != cursor;
        cursor = next.or(cursor);
        if !moved {
            if !args.follow {
                break;
            }
            tokio::time::sleep(FOLLOW_EVERY).await;
        }
    }
    Ok(())
}

pub(super) async fn outcomes_cmd(
    queue: &dyn Queue,
    config: &crate::config::Config,
    args: OutcomesArgs,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let filter = args.filter();
    follow_outcomes(args, out, async |after: Option<String>, limit: u32| {
        let entries = queue.outcomes(after.as_deref(), limit).await?;
        let next = entries.last().map(|e| e.cursor.clone());
        let wanted = entries
            .iter()
            .filter(|e| filter.wants(e, |kind| config.is_internal_kind(kind)))
            .map(crate::queue::OutcomeEntry::summary)
            .collect();
        Ok((wanted, next))
    })
    .await
}

/// Who the CLI acts as in the audit log: `$USER` or `$LOGNAME`, else the
/// account the process runs as (a cron job or a container often has no
/// `$USER`), so the audit never says `cli:unknown` for a known account.
pub fn cli_actor() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .ok()
        .filter(|u| !u.is_empty())
        .or_else(process_account)
        .unwrap_or_else(|| "unknown".to_owned());
    format!("cli:{user}")
}

/// The process's account name from `/etc/passwd`, else `uid:N`.
fn process_account() -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    let uid = std::fs::metadata("/proc/self").ok()?.uid();
    let name = std::fs::read_to_string("/etc/passwd").ok().and_then(|passwd| {
        passwd.lines().find_map(|line| {
            let mut fields = line.split(':');
            let name = fields.next()?;
            (fields.nth(1)?.parse::<u32>().ok()? == uid).then(|| name.to_owned())
        })
    });
    Some(name.unwrap_or_else(|| format!("uid:{uid}")))
}

/// Records a CLI write.
pub async fn audit(
    queue: &dyn Queue,
    action: &str,
    target: String,
    before: Option<Value>,
    after: Option<Value>,
) -> Result<(), CliError> {
    queue
        .record_audit(&NewAuditEntry {
            actor: cli_actor(),
            action: action.to_owned(),
            target,
            before,
            after,
        })
        .await?;
    Ok(())
}

fn scope(text: &str) -> Result<PauseScope, CliError> {
    PauseScope::parse(text)
        .ok_or_else(|| CliError::Input(format!("expected kind, outbox or destination, got {text:?}")))
}

pub(super) async fn api_keys_cmd(
    queue: &dyn Queue,
    command: ApiKeysCommand,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    match command {
        ApiKeysCommand::New(args) => {
            let minted = auth::mint_for(&args.name, &args.scopes, &args.outboxes).map_err(CliError::Input)?;
            let key = queue.create_api_key(&minted.stored).await?;
            audit(
                queue,
                "api_key.new",
                format!("api_key:{}", key.name),
                None,
                Some(serde_json::json!({ "id": key.id, "scopes": key.scopes })),
            )
            .await?;
            if args.json {
                let value = serde_json::json!({ "name": key.name, "id": key.id, "scopes": key.scopes, "secret": minted.secret });
                writeln!(out, "{value}")?;
                return Ok(());
            }
            writeln!(out, "{}", minted.secret)?;
            writeln!(
                out,
                "# key {:?} ({}); shown once: store it now (send it as Authorization: Bearer …)",
                key.name,
                key.scopes.join(", ")
            )?;
            Ok(())
        }
        ApiKeysCommand::List(args) => {
            let keys = queue.api_keys().await?;
            if args.json {
                return render::json(out, &keys);
            }
            for key in keys {
                let state = key
                    .revoked_at
                    .map_or_else(|| "live".to_owned(), |at| format!("revoked {at}"));
                writeln!(
                    out,
                    "{}\tlw_{}_…\t{}\t{}",
                    key.name,
                    key.id,
                    key.scopes.join(","),
                    state
                )?;
            }
            Ok(())
        }
        ApiKeysCommand::Revoke(args) => {
            if !queue.revoke_api_key(&args.name).await? {
                return Err(CliError::Input(format!("no live API key named {:?}", args.name)));
            }
            audit(queue, "api_key.revoke", format!("api_key:{}", args.name), None, None).await?;
            render::done(
                out,
                args.json,
                &serde_json::json!({ "name": args.name, "revoked": true }),
                &format!("API key {:?} revoked", args.name),
            )
        }
    }
}

pub(super) async fn pause_cmd(queue: &dyn Queue, args: PauseArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let scope = scope(&args.scope)?;
    if args.target.trim().is_empty() {
        return Err(CliError::Input("the target must not be empty".to_owned()));
    }
    if queue
        .pause(scope, &args.target, args.reason.as_deref(), &cli_actor())
        .await?
    {
        audit(
            queue,
            "pause",
            format!("{}:{}", scope.as_str(), args.target),
            None,
            Some(serde_json::json!({ "reason": args.reason })),
        )
        .await?;
        render::done(
            out,
            args.json,
            &serde_json::json!({ "scope": scope.as_str(), "target": args.target, "paused": true }),
            &format!(
                "{} {} paused: its ops wait, using no attempts, on every host within its poll",
                scope.as_str(),
                args.target
            ),
        )
    } else {
        render::done(
            out,
            args.json,
            &serde_json::json!({ "scope": scope.as_str(), "target": args.target, "paused": false }),
            &format!("{} {} was already paused", scope.as_str(), args.target),
        )
    }
}

pub(super) async fn resume_cmd(queue: &dyn Queue, args: PauseArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let scope = scope(&args.scope)?;
    if !queue.resume(scope, &args.target).await? {
        return Err(CliError::Input(format!(
            "{} {:?} is not paused",
            scope.as_str(),
            args.target
        )));
    }
    audit(
        queue,
        "resume",
        format!("{}:{}", scope.as_str(), args.target),
        None,
        None,
    )
    .await?;
    render::done(
        out,
        args.json,
        &serde_json::json!({ "scope": scope.as_str(), "target": args.target, "resumed": true }),
        &format!("{} {} resumed", scope.as_str(), args.target),
    )
}

pub(super) async fn pauses_cmd(queue: &dyn Queue, json: bool, out: &mut dyn Write) -> Result<(), CliError> {
    let pauses = queue.pauses().await?;
    if json {
        return render::json(out, &pauses);
    }
    if pauses.is_empty() {
        writeln!(out, "nothing is paused")?;
    }
    for p in pauses {
        writeln!(
            out,
            "{}\t{}\tby {} since {}\t{}",
            p.scope.as_str(),
            p.target,
            p.actor,
            p.paused_at,
            p.reason.unwrap_or_default()
        )?;
    }
    Ok(())
}

pub(super) async fn audit_cmd(queue: &dyn Queue, args: AuditArgs, out: &mut dyn Write) -> Result<(), CliError> {
    if !(1..=10_000).contains(&args.limit) {
        return Err(CliError::Input(format!(
            "--limit: expected 1 to 10000, got {}",
            args.limit
        )));
    }
    let entries = queue.audit_log(args.before, args.limit).await?;
    if args.json {
        return render::json(out, &entries);
    }
    for e in entries {
        writeln!(out, "{}\t{}\t{}\t{}\t{}", e.id, e.at, e.actor, e.action, e.target)?;
    }
    Ok(())
}

/// `laneway destinations …`
#[derive(Debug, Subcommand)]
pub enum DestinationsCommand {
    /// Hosts with failures counted or held, and inboxes gone (410).
    List(super::JsonArg),
    /// Hold a host's ops on every host (no attempts, no probes) until resumed.
    Suspend {
        /// The destination host (`host[:port]`).
        host: String,
        /// Why (kept in the health record and the audit log).
        #[arg(long)]
        reason: String,
        /// Print JSON instead of a sentence.
        #[arg(long)]
        json: bool,
    },
    /// Let a host's ops go again, whatever held it, and forget its inboxes' 410s.
    Resume {
        /// The destination host (`host[:port]`).
        host: String,
        /// Print JSON instead of a sentence.
        #[arg(long)]
        json: bool,
    },
}

fn destination_host(host: &str) -> Result<&str, CliError> {
    if host.is_empty() || host.contains(['/', ' ']) {
        return Err(CliError::Input(format!(
            "expected a destination host (host[:port], as `destinations list` shows it), got {host:?}"
        )));
    }
    Ok(host)
}

pub(super) async fn destinations_cmd(
    config: &crate::config::Config,
    queue: &dyn Queue,
    command: DestinationsCommand,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let health = config.destinations.health();
    let metrics = crate::events::Metrics::new();
    let now = chrono::Utc::now();
    match command {
        DestinationsCommand::List(args) => {
            let hosts = crate::destinations::views(queue).await?;
            let gone = crate::destinations::gone_inboxes(queue).await?;
            if args.json {
                let gone: Vec<Value> = gone
                    .iter()
                    .map(|(inbox, at)| serde_json::json!({ "inbox": inbox, "gone_at": at }))
                    .collect();
                return super::render::json(out, &serde_json::json!({ "destinations": hosts, "gone_inboxes": gone }));
            }
            if hosts.is_empty() && gone.is_empty() {
                writeln!(out, "every destination is healthy")?;
            }
            for h in &hosts {
                let first = h.first_failure_at.map(|t| t.to_rfc3339()).unwrap_or_default();
                writeln!(
                    out,
                    "{}  {}  failures {}  since first failure {}  {}",
                    h.host,
                    h.state,
                    h.failures,
                    if first.is_empty() { "-" } else { &first },
                    h.reason.as_deref().or(h.last_error.as_deref()).unwrap_or("")
                )?;
                if let Some(at) = h.next_probe_at {
                    writeln!(out, "    next probe {}", at.to_rfc3339())?;
                }
            }
            for (inbox, at) in &gone {
                writeln!(out, "{inbox}  gone (410) since {}", at.to_rfc3339())?;
            }
        }
        DestinationsCommand::Suspend { host, reason, json } => {
            let host = destination_host(&host)?;
            let actor = cli_actor();
            let (before, after) = crate::destinations::apply(
                queue,
                &metrics,
                host,
                &[crate::health::Event::Suspend { reason: &reason }],
                &actor,
                now,
                &health,
            )
            .await?;
            audit(
                queue,
                "destination.suspend",
                format!("destination:{host}"),
                Some(serde_json::json!(before)),
                Some(serde_json::json!(after)),
            )
            .await?;
            render::done(
                out,
                json,
                &serde_json::json!({ "host": host, "health": after }),
                &format!("{host}: suspended on every host ({reason})"),
            )?;
        }
        DestinationsCommand::Resume { host, json } => {
            let host = destination_host(&host)?;
            let (before, after, forgotten) =
                crate::destinations::resume(queue, &metrics, host, &cli_actor(), now, &health).await?;
            audit(
                queue,
                "destination.resume",
                format!("destination:{host}"),
                Some(serde_json::json!({ "health": before, "gone_inboxes": forgotten })),
                Some(serde_json::json!(after)),
            )
            .await?;
            if json {
                let value = serde_json::json!({ "host": host, "before": before, "health": after, "gone_inboxes_forgotten": forgotten });
                writeln!(out, "{value}")?;
            } else if before.is_clear() && forgotten.is_empty() {
                writeln!(out, "{host}: nothing was held or counted")?;
            } else {
                writeln!(
                    out,
                    "{host}: available again (was {}); {} gone inbox(es) forgotten",
                    before.state.as_str(),
                    forgotten.len()
                )?;
            }
        }
    }
    Ok(())
}
