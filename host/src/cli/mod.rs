//! The operator command line: argument parsing, and each command written
//! against the [`Queue`] trait so it works on either backend.
//!
//! Commands take their input and output streams as arguments, so tests run
//! them in-process and read what an operator would see.

mod channels;
mod operator;
mod remote;
mod render;

use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;

use chrono::Utc;
use clap::{Args, Parser, Subcommand};

use crate::clock::SystemClock;
use crate::config::{self, Config, ConfigError, FileSource};
use crate::dispatch::DispatchError;
use crate::enqueue::{self, EnqueueError, EnqueueRequest};
use crate::op::{OpId, Priority, Status};
use crate::queue::{self, Enqueued, OpFilter, Queue, QueueError};
use crate::runtime::host::{LoadError, PluginHost};

/// laneway: a durable, lane-ordered delivery host.
#[derive(Debug, Parser)]
#[command(name = "laneway", version, about)]
pub struct Cli {
    /// Config file (default: ./laneway.toml if it exists).
    #[arg(long, global = true, env = "LANEWAY_CONFIG")]
    pub config: Option<PathBuf>,
    /// Act through a running host's HTTP API (e.g. http://127.0.0.1:7480)
    /// instead of the database: enqueue, fanout, ops, lanes, subjects,
    /// pause, resume, pauses, audit and outcomes. The API key is read from
    /// LW_API_KEY.
    #[arg(long, global = true, value_name = "URL")]
    pub url: Option<String>,
    /// With --url: allow plain http:// to a host that is not loopback (the
    /// API key then crosses the network readable by anyone on the path).
    #[arg(long, global = true)]
    pub insecure: bool,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or upgrade the database schema.
    Migrate(JsonArg),
    /// Put one op on the queue.
    Enqueue(EnqueueArgs),
    /// Fan an activity out to its recipients: one op per distinct inbox.
    Fanout(FanoutArgs),
    /// Inspect and act on ops.
    #[command(subcommand)]
    Ops(OpsCommand),
    /// Run the dispatcher for every outbox until SIGTERM or ctrl-c.
    Run,
    /// Show laneway at work in under a minute: the real plugins against
    /// in-process fake inboxes and a fake Stellar network, on a fresh SQLite
    /// database (--config defaults to config/demo.toml).
    Demo(DemoCmdArgs),
    /// Inspect and release lanes held by dead letters (poison = "halt").
    #[command(subcommand)]
    Lanes(LanesCommand),
    /// Halt or resume every op acting for a subject (compliance guard).
    #[command(subcommand)]
    Subjects(SubjectsCommand),
    /// Inspect WebAssembly plugins.
    #[command(subcommand)]
    Plugin(PluginCommand),
    /// Check the configuration, its keys and plugins, and every kind's config
    /// (asked of its plugin), and say so.
    CheckConfig(JsonArg),
    /// Signing keys held by the host (public parts only).
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Keys for the HTTP API (stored as hashes; scopes).
    #[command(subcommand, name = "api-keys")]
    ApiKeys(operator::ApiKeysCommand),
    /// Pause a kind, an outbox or a destination host: its ops wait on every
    /// host, using no attempts, until resumed.
    Pause(operator::PauseArgs),
    /// Resume a paused kind, outbox or destination.
    Resume(operator::PauseArgs),
    /// What is paused.
    Pauses(JsonArg),
    /// Who changed what: every operator write, newest first.
    Audit(operator::AuditArgs),
    /// Ops that reached a terminal status, oldest first, from a cursor;
    /// --follow keeps printing them as they happen.
    Outcomes(operator::OutcomesArgs),
    /// Read what the pruner archived (kinds with `archive = "DIR"`).
    #[command(subcommand)]
    Archive(ArchiveCommand),
    /// Destination health shared by every host: hosts failing, unavailable
    /// or suspended, and inboxes gone; suspend or resume a host.
    #[command(subcommand)]
    Destinations(operator::DestinationsCommand),
    /// Measure this build: drain throughput beside plain job loops and
    /// graphile-worker, latency, ActivityPub end to end, signing (scratch
    /// databases; PostgreSQL at TEST_PG_URL). Prints Markdown tables.
    Bench(crate::bench::BenchArgs),
    /// Stellar channel-account pools: list them, make channel keys, create
    /// the accounts on chain.
    #[command(subcommand)]
    Stellar(channels::StellarCommand),
}

/// `laneway demo`
#[derive(Debug, Args)]
pub struct DemoCmdArgs {
    /// Fewer ops: the same story in a few seconds.
    #[arg(long)]
    pub short: bool,
    /// Leave the host and its API up after the report, until ctrl-c.
    #[arg(long)]
    pub keep_running: bool,
}

/// `laneway archive …`
#[derive(Debug, Subcommand)]
pub enum ArchiveCommand {
    /// Print a pruned op as archived, with its attempt history (JSON).
    Show(ArchiveShowArgs),
}

/// `laneway archive show`
#[derive(Debug, Args)]
pub struct ArchiveShowArgs {
    /// The op id.
    pub id: OpId,
    /// The archive directory (default: every kind's `archive`).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Print the record as one line of JSON (it is JSON either way).
    #[arg(long)]
    pub json: bool,
}

/// `laneway keys …`
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Print a key's public half, and for Ed25519 its Stellar account (`G…`),
    /// which plain-SQL producers put in `lanes` for the signer's kinds.
    Show(KeyShowArgs),
}

/// `laneway keys show`
#[derive(Debug, Args)]
pub struct KeyShowArgs {
    /// The key id (`[keys.ID]`).
    pub id: String,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `laneway plugin …`
#[derive(Debug, Subcommand)]
pub enum PluginCommand {
    /// Load and validate a component; print its world, contract version,
    /// exports and imports, or why laneway would refuse it.
    Check(PluginCheckArgs),
}

/// `laneway plugin check`
#[derive(Debug, Args)]
pub struct PluginCheckArgs {
    /// The `.wasm` component.
    pub file: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `laneway lanes …`
#[derive(Debug, Subcommand)]
pub enum LanesCommand {
    /// Lanes held by dead letters.
    List(LanesListArgs),
    /// Let a held lane continue past its dead letter (which stays failed).
    Skip(LaneArgs),
}

/// `laneway lanes list`
#[derive(Debug, Args)]
pub struct LanesListArgs {
    /// Only this outbox.
    #[arg(long)]
    pub outbox: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One lane of one outbox.
#[derive(Debug, Args)]
pub struct LaneArgs {
    /// The outbox.
    #[arg(long)]
    pub outbox: String,
    /// The lane.
    #[arg(long)]
    pub lane: String,
    /// Print JSON instead of a sentence.
    #[arg(long)]
    pub json: bool,
}

/// `laneway subjects …`
#[derive(Debug, Subcommand)]
pub enum SubjectsCommand {
    /// Stop the subject's ops from being attempted (they wait, no attempt is used).
    Halt(HaltArgs),
    /// Let the subject's ops go again.
    Unhalt(SubjectArgs),
    /// Halted subjects.
    List(JsonArg),
}

/// `laneway subjects halt`
#[derive(Debug, Args)]
pub struct HaltArgs {
    /// The subject (user or actor id).
    pub subject: String,
    /// Why, for the record.
    #[arg(long)]
    pub reason: Option<String>,
    /// Print JSON instead of a sentence.
    #[arg(long)]
    pub json: bool,
}

/// A subject argument.
#[derive(Debug, Args)]
pub struct SubjectArgs {
    /// The subject (user or actor id).
    pub subject: String,
    /// Print JSON instead of a sentence.
    #[arg(long)]
    pub json: bool,
}

/// `laneway enqueue`
#[derive(Debug, Args)]
pub struct EnqueueArgs {
    /// Executor kind (a [kinds.NAME] in the config).
    #[arg(long)]
    pub kind: String,
    /// Outbox the op belongs to (an actor, a platform account).
    #[arg(long)]
    pub outbox: String,
    /// critical, normal or low (default: the kind's).
    #[arg(long)]
    pub priority: Option<String>,
    /// A lane (recipient inbox, signer account); repeat for several.
    #[arg(long = "lane")]
    pub lanes: Vec<String>,
    /// JSON payload file, or - for standard input.
    #[arg(long, default_value = "-")]
    pub payload: String,
    /// Idempotency key: a repeat returns the existing op.
    #[arg(long)]
    pub idempotency_key: Option<String>,
    /// Coalesce key: declined while an op with this key is pending.
    #[arg(long)]
    pub coalesce_key: Option<String>,
    /// The user or actor the op acts for.
    #[arg(long)]
    pub subject: Option<String>,
    /// What a dead letter relates to.
    #[arg(long)]
    pub correlation_id: Option<String>,
    /// Do not deliver before this many milliseconds from now.
    #[arg(long)]
    pub delay_ms: Option<u64>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `laneway fanout`
#[derive(Debug, Args)]
pub struct FanoutArgs {
    /// Executor kind (default: activitypub).
    #[arg(long, default_value = "activitypub")]
    pub kind: String,
    /// The sending actor (the outbox).
    #[arg(long)]
    pub outbox: String,
    /// A recipient: INBOX, or INBOX=SHARED_INBOX; repeat for each.
    #[arg(long = "to", required = true)]
    pub recipients: Vec<String>,
    /// The activity JSON file, or - for standard input.
    #[arg(long, default_value = "-")]
    pub activity: String,
    /// critical, normal or low (default: the kind's).
    #[arg(long)]
    pub priority: Option<String>,
    /// The user or actor the ops act for.
    #[arg(long)]
    pub subject: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `laneway ops …`
#[derive(Debug, Subcommand)]
pub enum OpsCommand {
    /// List ops, oldest first (newest first with --newest).
    List(ListArgs),
    /// Show one op and its attempt history.
    Show(IdArgs),
    /// Send a failed op back to the queue with a fresh attempt budget.
    Retry(IdArgs),
    /// Cancel a pending op.
    Cancel(IdArgs),
    /// Queue depth by status and priority.
    Stats(JsonArg),
}

/// Filters for `ops list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// pending, submitted, confirmed, failed or cancelled.
    #[arg(long)]
    pub status: Option<String>,
    /// Only this kind.
    #[arg(long)]
    pub kind: Option<String>,
    /// critical, normal or low.
    #[arg(long)]
    pub priority: Option<String>,
    /// Only ops for this subject.
    #[arg(long)]
    pub subject: Option<String>,
    /// Only this outbox.
    #[arg(long)]
    pub outbox: Option<String>,
    /// Only ops in this lane.
    #[arg(long)]
    pub lane: Option<String>,
    /// Only ops with this correlation id.
    #[arg(long)]
    pub correlation: Option<String>,
    /// Only ops after this id (before it with --newest).
    #[arg(long)]
    pub after: Option<OpId>,
    /// At most this many.
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    /// Newest first.
    #[arg(long)]
    pub newest: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// An op id argument.
#[derive(Debug, Args)]
pub struct IdArgs {
    /// The op id.
    pub id: OpId,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Just `--json`.
#[derive(Debug, Args)]
pub struct JsonArg {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Errors a command reports to the operator, one line each.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The queue refused or failed.
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// The enqueue request broke its kind's rules.
    #[error(transparent)]
    Enqueue(#[from] EnqueueError),
    /// An argument or input was malformed.
    #[error("{0}")]
    Input(String),
    /// Writing output failed.
    #[error("cannot write output: {0}")]
    Output(#[from] std::io::Error),
    /// The dispatcher stopped with an error.
    #[error(transparent)]
    Dispatch(#[from] DispatchError),
    /// Plugins could not be loaded.
    #[error(transparent)]
    Plugins(#[from] LoadError),
    /// The host could not start.
    #[error(transparent)]
    Node(#[from] crate::node::NodeError),
    /// The demo could not run or finish.
    #[error(transparent)]
    Demo(#[from] crate::demo::DemoError),
    /// The API refused a remote command.
    #[error("the API answered {status} {code}: {message}")]
    Remote {
        /// The HTTP status.
        status: u16,
        /// The API's error code.
        code: String,
        /// Its sentence.
        message: String,
    },
    /// `plugin check` refused a component.
    #[error("{file}: {reason}")]
    Refused {
        /// The file.
        file: String,
        /// Why.
        reason: String,
    },
}

/// The standard streams and environment a command runs with.
pub struct Io<'a> {
    /// Environment variables (for `LANEWAY_*` config).
    pub env: Vec<(String, String)>,
    /// Standard input (payloads).
    pub stdin: &'a mut dyn Read,
    /// Standard output.
    pub stdout: &'a mut dyn Write,
}

/// Parses arguments and runs the command.
///
/// # Errors
///
/// [`CliError`] for anything the operator must fix. Usage errors come from
/// [`parse`] before this runs.
pub async fn run(cli: Cli, io: Io<'_>) -> Result<(), CliError> {
    // The demo makes its own database and config from config/demo.toml.
    if let Command::Demo(args) = &cli.command {
        let demo = crate::demo::DemoArgs {
            config: cli.config.clone().unwrap_or_else(|| PathBuf::from("config/demo.toml")),
            short: args.short,
            keep_running: args.keep_running,
            env: io.env.clone(),
        };
        return Ok(crate::demo::run(demo, io.stdout).await?);
    }
    // The bench builds its own scratch databases and configs.
    if let Command::Bench(args) = &cli.command {
        return crate::bench::run(args.clone())
            .await
            .map_err(|e| CliError::Input(format!("bench: {e:#}")));
    }
    // Remote mode needs no config file or database: only the API and a key.
    if let Some(url) = &cli.url {
        return remote::run(url, cli.insecure, cli.command, &io.env, (io.stdin, io.stdout)).await;
    }
    let file = match &cli.config {
        Some(path) => FileSource::Explicit(path.clone()),
        None => FileSource::default_path(),
    };
    let config = config::load(&file, io.env.clone())?;
    match cli.command {
        Command::CheckConfig(args) => {
            check_plugins(&config).await?;
            let database = queue::redact_url(&config.database.url);
            let lookalikes = config::env_lookalikes(&io.env);
            let mut text = format!(
                "configuration is valid (database: {database}; {} plugin{}, {} kind{})",
                config.plugins.len(),
                if config.plugins.len() == 1 { "" } else { "s" },
                config.kinds.len(),
                if config.kinds.len() == 1 { "" } else { "s" },
            );
            for l in &lookalikes {
                text.push_str(&format!(
                    "\nnote: {} is not read as config (keys are LANEWAY_SECTION__KEY); did you mean {}?",
                    l.name, l.did_you_mean
                ));
            }
            render::done(
                io.stdout,
                args.json,
                &serde_json::json!({
                    "valid": true, "database": database,
                    "plugins": config.plugins.len(), "kinds": config.kinds.len(),
                    "ignored_env": lookalikes,
                }),
                &text,
            )
        }
        Command::Migrate(args) => {
            let queue = open(&config).await?;
            queue.migrate().await?;
            queue.register_kinds(&config.kind_registry()).await?;
            let database = queue::redact_url(&config.database.url);
            render::done(
                io.stdout,
                args.json,
                &serde_json::json!({ "migrated": true, "database": database }),
                &format!("database is at the current schema ({database})"),
            )
        }
        Command::Enqueue(args) => enqueue_cmd(&config, args, io).await,
        Command::Fanout(args) => fanout_cmd(&config, args, io).await,
        Command::Ops(ops) => ops_cmd(&config, ops, io.stdout).await,
        Command::Run => {
            for l in config::env_lookalikes(&io.env) {
                tracing::warn!(variable = %l.name, did_you_mean = %l.did_you_mean, "An environment variable is not read as config (keys are LANEWAY_SECTION__KEY).");
            }
            run_cmd(config, file).await
        }
        // Handled above, before any config is loaded.
        Command::Demo(_) | Command::Bench(_) => Ok(()),
        Command::Plugin(PluginCommand::Check(args)) => plugin_check(&config, args, io.stdout).await,
        Command::Lanes(command) => lanes_cmd(&config, command, io.stdout).await,
        Command::Subjects(command) => subjects_cmd(&config, command, io.stdout).await,
        Command::Keys(KeysCommand::Show(args)) => keys_show(&config, &args, io.stdout),
        Command::ApiKeys(command) => {
            operator::api_keys_cmd(open_checked(&config).await?.as_ref(), command, io.stdout).await
        }
        Command::Pause(args) => operator::pause_cmd(open_checked(&config).await?.as_ref(), args, io.stdout).await,
        Command::Resume(args) => operator::resume_cmd(open_checked(&config).await?.as_ref(), args, io.stdout).await,
        Command::Pauses(args) => {
            operator::pauses_cmd(open_checked(&config).await?.as_ref(), args.json, io.stdout).await
        }
        Command::Audit(args) => operator::audit_cmd(open_checked(&config).await?.as_ref(), args, io.stdout).await,
        Command::Outcomes(args) => {
            operator::outcomes_cmd(open_checked(&config).await?.as_ref(), &config, args, io.stdout).await
        }
        Command::Archive(ArchiveCommand::Show(args)) => archive_show(&config, &args, io.stdout),
        Command::Destinations(command) => {
            operator::destinations_cmd(&config, open_checked(&config).await?.as_ref(), command, io.stdout).await
        }
        Command::Stellar(command) => channels::run(&config, command, io.stdout).await,
    }
}

/// Loads what the config names the way `laneway run` would (keys, plugins)
/// and has every executor plugin check its kinds' configs, so a mistake is
/// reported here, with its key path, instead of dead-lettering a backlog.
async fn check_plugins(config: &Config) -> Result<(), CliError> {
    if config.plugins.is_empty() && config.keys.is_empty() {
        return Ok(());
    }
    let host = PluginHost::new(config)?;
    let problems = match host.apply(config).await {
        Ok(refused) => refused,
        Err(crate::runtime::host::LoadError::Plugins(problems)) => problems,
        Err(e) => return Err(e.into()),
    };
    if problems.is_empty() {
        Ok(())
    } else {
        let mut problems = problems;
        problems.sort_by(|a, b| a.path.cmp(&b.path));
        Err(config::ConfigError::Invalid(problems).into())
    }
}

/// Parses command-line arguments.
///
/// # Errors
///
/// clap's error, which knows how to print itself (usage or help).
pub fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Cli, clap::Error> {
    Cli::try_parse_from(args)
}

async fn open(config: &Config) -> Result<Arc<dyn Queue>, QueueError> {
    queue::open(&config.database, config.limits(), Arc::new(SystemClock)).await
}

/// Opens the queue and refuses to go on unless the schema is current.
async fn open_checked(config: &Config) -> Result<Arc<dyn Queue>, QueueError> {
    let queue = open(config).await?;
    queue.check_schema().await?;
    Ok(queue)
}

fn parse_priority(s: Option<&str>) -> Result<Option<Priority>, CliError> {
    s.map(|p| p.parse::<Priority>().map_err(|e| CliError::Input(e.to_string())))
        .transpose()
}

fn parse_status(s: Option<&str>) -> Result<Option<Status>, CliError> {
    s.map(|p| p.parse::<Status>().map_err(|e| CliError::Input(e.to_string())))
        .transpose()
}

/// Reads a JSON document from a file, or from standard input for `-`.
fn read_input(source: &str, what: &str, stdin: &mut dyn Read) -> Result<String, CliError> {
    if source == "-" {
        let mut text = String::new();
        stdin
            .read_to_string(&mut text)
            .map_err(|e| CliError::Input(format!("cannot read the {what} from standard input: {e}")))?;
        Ok(text)
    } else {
        std::fs::read_to_string(source).map_err(|e| CliError::Input(format!("cannot read {what} file {source}: {e}")))
    }
}

async fn fanout_cmd(config: &Config, args: FanoutArgs, io: Io<'_>) -> Result<(), CliError> {
    let priority = parse_priority(args.priority.as_deref())?;
    let activity = read_input(&args.activity, "activity", io.stdin)?;
    let kind = config.kind(&args.kind).map_err(CliError::Input)?;
    let request = crate::fanout::FanOut {
        kind: args.kind.clone(),
        actor: args.outbox,
        activity,
        recipients: args
            .recipients
            .iter()
            .map(|r| crate::fanout::Recipient::parse(r))
            .collect(),
        priority,
        subject: args.subject,
    };
    // Refuse a malformed request before touching the database.
    crate::fanout::plan(&request, &kind.correlate_types(), kind.priority)
        .map_err(|e| CliError::Input(e.to_string()))?;
    let queue = open_checked(config).await?;
    let planned = crate::destinations::plan_fan_out(queue.as_ref(), config, &request)
        .await
        .map_err(|e| match e {
            crate::destinations::FanOutFailure::Activity(e) => CliError::Input(e.to_string()),
            crate::destinations::FanOutFailure::InternalKind(why)
            | crate::destinations::FanOutFailure::UnknownKind(why)
            | crate::destinations::FanOutFailure::Refused(why) => CliError::Input(why),
            crate::destinations::FanOutFailure::Queue(e) => CliError::from(e),
        })?;
    let ops = planned.ops;
    let results = queue.enqueue(&ops).await?;
    if args.json {
        let mut rows: Vec<_> = ops
            .iter()
            .zip(&results)
            .map(|(op, r)| serde_json::json!({ "inbox": op.lanes[0], "enqueued": r }))
            .collect();
        rows.extend(
            planned
                .gone
                .iter()
                .map(|inbox| serde_json::json!({ "inbox": inbox, "skipped": "gone" })),
        );
        return render::json(io.stdout, &rows);
    }
    for inbox in &planned.gone {
        writeln!(io.stdout, "{inbox}: skipped: it answered 410 Gone before")?;
    }
    for (op, result) in ops.iter().zip(results) {
        let what = match result {
            Enqueued::Created(id) => format!("op {id}"),
            Enqueued::Existing(id) => format!("op {id} (already enqueued)"),
            Enqueued::AlreadyPending(id) => format!("declined: op {id} is already pending"),
        };
        writeln!(io.stdout, "{}: {what}", op.lanes[0])?;
    }
    Ok(())
}

/// `laneway enqueue --json` output: the result, and for priced kinds the
/// fee estimate (seed 003's `estFee` / `estConfirmationSeconds`).
#[derive(serde::Serialize)]
struct EnqueueOutput {
    #[serde(flatten)]
    result: Enqueued,
    #[serde(skip_serializing_if = "Option::is_none")]
    estimate: Option<crate::pricing::FeeEstimate>,
}

async fn enqueue_cmd(config: &Config, args: EnqueueArgs, io: Io<'_>) -> Result<(), CliError> {
    let priority = parse_priority(args.priority.as_deref())?;
    let payload = read_input(&args.payload, "payload", io.stdin)?;
    let not_before = match args.delay_ms {
        None => None,
        Some(ms) => Some(
            enqueue::not_before(ms)
                .ok_or_else(|| CliError::Input(format!("--delay-ms {ms} is too far in the future")))?,
        ),
    };
    config.refuse_internal_kind(&args.kind).map_err(CliError::Input)?;
    // Plugins are loaded only when the op needs one (its lanes come from the
    // kind's executor, or its kind is priced), and then once for both.
    let kind_config = config.kinds.get(&args.kind);
    let owned = kind_config.is_some_and(|k| k.lanes == config::LanePresence::Plugin);
    if let Some(pool) = kind_config.and_then(|k| k.pool.as_ref()) {
        if !args.lanes.is_empty() {
            return Err(CliError::Input(format!(
                "kind {}: its ops are dealt channels from pool {pool:?}; give no --lane",
                args.kind
            )));
        }
    }
    let needs_lanes = (args.lanes.is_empty() || owned) && kind_config.is_some_and(|k| k.plugin.is_some());
    let priced = kind_config.is_some_and(|k| k.fee_oracle.is_some());
    let host = if needs_lanes || priced {
        let host = Arc::new(PluginHost::new(config)?);
        let prefix = format!("kinds.{}.", args.kind);
        let refused: Vec<String> = host
            .apply(config)
            .await?
            .iter()
            .filter(|p| p.path.starts_with(&prefix))
            .map(config::Problem::to_string)
            .collect();
        if !refused.is_empty() {
            return Err(CliError::Input(format!(
                "kind {} is not active: its plugin refuses its config ({}); run `laneway check-config`",
                args.kind,
                refused.join("; ")
            )));
        }
        Some(host)
    } else {
        None
    };
    let mut lanes = args.lanes;
    if let (true, Some(host)) = (needs_lanes, &host) {
        // No lanes given, or the plugin owns them: the kind's plugin says
        // which (the inbox, the signer's account).
        let named = host
            .registry()
            .lanes_for(&args.kind, &args.outbox, &payload)
            .await
            .map_err(|e| CliError::Input(format!("kind {}: the plugin refused the op: {e}", args.kind)))?;
        lanes = if owned {
            enqueue::owned_lanes(&args.kind, lanes, named)?
        } else {
            named
        };
    }
    let request = EnqueueRequest {
        kind: args.kind,
        outbox: args.outbox,
        priority,
        lanes,
        payload,
        idempotency_key: args.idempotency_key,
        coalesce_key: args.coalesce_key,
        subject: args.subject,
        correlation_id: args.correlation_id,
        not_before,
    };
    // Refuse bad input before touching the database.
    let op = enqueue::prepare(request, config)?;
    queue::validate_new_op(&op, config.limits())?;
    let queue = open_checked(config).await?;
    let result = queue
        .enqueue(std::slice::from_ref(&op))
        .await?
        .pop()
        .ok_or_else(|| CliError::Input("the queue returned no result".to_owned()))?;
    let estimate = match (&result, host) {
        (Enqueued::Created(_), Some(host)) if priced => {
            let pricer = crate::pricing::Pricer::new(host, queue.clone());
            pricer
                .estimate(config, &op.kind, op.priority, Utc::now())
                .await
                .map_err(|e| CliError::Input(format!("enqueued, but the fee estimate failed: {e}")))?
                .map(crate::pricing::FeeEstimate::from)
        }
        _ => None,
    };
    if args.json {
        let output = EnqueueOutput { result, estimate };
        serde_json::to_writer(&mut *io.stdout, &output).map_err(|e| CliError::Output(e.into()))?;
        writeln!(io.stdout)?;
    } else {
        match result {
            Enqueued::Created(id) => {
                writeln!(io.stdout, "enqueued op {id}")?;
                match estimate {
                    Some(e) if e.deferred_ms > 0 => writeln!(
                        io.stdout,
                        "estimate: deferred {} ms by the fee policy (congestion)",
                        e.deferred_ms
                    )?,
                    Some(e) => writeln!(
                        io.stdout,
                        "estimate: base fee {} stroops, confirmation in about {} s",
                        e.base_fee, e.est_confirmation_seconds
                    )?,
                    None => {}
                }
            }
            Enqueued::Existing(id) => writeln!(
                io.stdout,
                "op {id} already exists with this idempotency key; nothing enqueued"
            )?,
            Enqueued::AlreadyPending(id) => writeln!(
                io.stdout,
                "declined: op {id} with this coalesce key is already pending in outbox {}",
                op.outbox
            )?,
        }
    }
    Ok(())
}

async fn ops_cmd(config: &Config, command: OpsCommand, out: &mut dyn Write) -> Result<(), CliError> {
    let queue = open_checked(config).await?;
    match command {
        OpsCommand::List(args) => {
            let filter = OpFilter {
                status: parse_status(args.status.as_deref())?,
                kind: args.kind,
                priority: parse_priority(args.priority.as_deref())?,
                subject: args.subject,
                outbox: args.outbox,
                lane: args.lane,
                correlation_id: args.correlation,
                after_id: args.after,
                limit: args.limit,
                newest_first: args.newest,
                ..OpFilter::default()
            };
            let ops = queue.list(&filter).await?;
            if args.json {
                render::json(out, &ops)
            } else {
                render::op_table(out, &ops)
            }
        }
        OpsCommand::Show(args) => {
            let Some(op) = queue.get(args.id).await? else {
                // Past its retention an op is gone from the queue; say where
                // it may still be.
                return Err(CliError::Input(format!(
                    "op {} not found (an op past its retention is pruned; kinds with an archive keep it: \
                     `laneway archive show {}`)",
                    args.id, args.id
                )));
            };
            let attempts = queue.attempts(args.id).await?;
            if args.json {
                render::json(out, &serde_json::json!({ "op": op, "attempts": attempts }))
            } else {
                render::op_detail(out, &op, &attempts)
            }
        }
        OpsCommand::Retry(args) => {
            let before = queue.get(args.id).await?;
            let op = queue.force_retry(args.id).await?;
            operator::audit(
                queue.as_ref(),
                "op.retry",
                format!("op:{}", op.id),
                before.map(|o| serde_json::json!(o)),
                Some(serde_json::json!(op)),
            )
            .await?;
            if args.json {
                render::json(out, &op)
            } else {
                writeln!(out, "op {} is pending again with a fresh attempt budget", op.id)?;
                Ok(())
            }
        }
        OpsCommand::Cancel(args) => {
            let before = queue.get(args.id).await?;
            let op = queue.cancel(args.id).await?;
            operator::audit(
                queue.as_ref(),
                "op.cancel",
                format!("op:{}", op.id),
                before.map(|o| serde_json::json!(o)),
                Some(serde_json::json!(op)),
            )
            .await?;
            if args.json {
                render::json(out, &op)
            } else {
                writeln!(out, "op {} cancelled", op.id)?;
                Ok(())
            }
        }
        OpsCommand::Stats(args) => {
            let depth = queue.depth().await?;
            if args.json {
                render::json(out, &depth)
            } else {
                render::depth_table(out, &depth)
            }
        }
    }
}

async fn run_cmd(config: Config, source: FileSource) -> Result<(), CliError> {
    // Every connection, database handle and plugin file is a descriptor:
    // a service manager's default soft limit (1,024) is under the API's own
    // connection cap.
    crate::api::listener::raise_open_files_limit();
    let node = crate::node::Node::open(config, Some(source)).await?;
    let stopper = node.dispatcher.clone();
    tokio::spawn(async move {
        crate::node::shutdown_signal().await;
        tracing::info!("Shutdown requested; finishing in-flight ops.");
        stopper.shutdown();
    });
    node.stopped().await?;
    Ok(())
}

fn archive_show(config: &Config, args: &ArchiveShowArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let mut dirs: Vec<PathBuf> = match &args.dir {
        Some(dir) => vec![dir.clone()],
        None => config
            .kinds
            .values()
            .filter_map(|k| k.archive.as_ref().map(PathBuf::from))
            .collect(),
    };
    dirs.sort();
    dirs.dedup();
    let mut found = None;
    for dir in dirs.iter().filter(|d| d.is_dir()) {
        if let Some(record) = crate::archive::find(dir, args.id).map_err(|e| CliError::Input(e.to_string()))? {
            found = Some(record);
        }
    }
    match found {
        Some(record) if args.json => {
            writeln!(
                out,
                "{}",
                serde_json::to_string(&record).map_err(|e| CliError::Input(e.to_string()))?
            )?;
            Ok(())
        }
        Some(record) => render::json(out, &record),
        None => Err(CliError::Input(format!(
            "op {} is not in the archive (searched: {})",
            args.id,
            if dirs.is_empty() {
                "no kind has an archive; give --dir".to_owned()
            } else {
                dirs.iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        ))),
    }
}

async fn lanes_cmd(config: &Config, command: LanesCommand, out: &mut dyn Write) -> Result<(), CliError> {
    let queue = open_checked(config).await?;
    match command {
        LanesCommand::List(args) => {
            let halts = queue.lane_halts(args.outbox.as_deref()).await?;
            if args.json {
                render::json(out, &halts)
            } else {
                render::halts_table(out, &halts)
            }
        }
        LanesCommand::Skip(args) => {
            let removed = queue.skip_lane(&args.outbox, &args.lane).await?;
            if removed == 0 {
                return Err(CliError::Input(format!(
                    "lane {:?} of outbox {:?} is not held",
                    args.lane, args.outbox
                )));
            }
            operator::audit(
                queue.as_ref(),
                "lane.skip",
                format!("lane:{}:{}", args.outbox, args.lane),
                None,
                Some(serde_json::json!({ "released": removed })),
            )
            .await?;
            render::done(
                out,
                args.json,
                &serde_json::json!({ "outbox": args.outbox, "lane": args.lane, "released": removed }),
                &format!(
                    "lane {} of outbox {} continues past its dead letter",
                    args.lane, args.outbox
                ),
            )
        }
    }
}

async fn subjects_cmd(config: &Config, command: SubjectsCommand, out: &mut dyn Write) -> Result<(), CliError> {
    let queue = open_checked(config).await?;
    match command {
        SubjectsCommand::Halt(args) => {
            queue.halt_subject(&args.subject, args.reason.as_deref()).await?;
            operator::audit(
                queue.as_ref(),
                "subject.halt",
                format!("subject:{}", args.subject),
                None,
                Some(serde_json::json!({ "reason": args.reason })),
            )
            .await?;
            render::done(
                out,
                args.json,
                &serde_json::json!({ "subject": args.subject, "halted": true, "reason": args.reason }),
                &format!("subject {} halted: its ops wait without using attempts", args.subject),
            )?;
        }
        SubjectsCommand::Unhalt(args) => {
            if !queue.unhalt_subject(&args.subject).await? {
                return Err(CliError::Input(format!("subject {:?} is not halted", args.subject)));
            }
            operator::audit(
                queue.as_ref(),
                "subject.unhalt",
                format!("subject:{}", args.subject),
                None,
                None,
            )
            .await?;
            render::done(
                out,
                args.json,
                &serde_json::json!({ "subject": args.subject, "halted": false }),
                &format!("subject {} resumed", args.subject),
            )?;
        }
        SubjectsCommand::List(args) => {
            let halted = queue.halted_subjects().await?;
            return if args.json {
                render::json(out, &halted)
            } else {
                render::subjects_table(out, &halted)
            };
        }
    }
    Ok(())
}

/// Loads these keys, each that cannot be loaded reported with its path.
fn load_keys(
    sources: &std::collections::BTreeMap<String, crate::keys::KeySource>,
) -> Result<crate::keys::KeyStore, CliError> {
    crate::keys::KeyStore::load(sources).map_err(|problems| {
        config::ConfigError::Invalid(
            problems
                .into_iter()
                .map(|(path, message)| config::Problem { path, message })
                .collect(),
        )
        .into()
    })
}

fn keys_show(config: &Config, args: &KeyShowArgs, out: &mut dyn Write) -> Result<(), CliError> {
    use base64::Engine as _;
    let source = config.keys.get(&args.id).ok_or_else(|| {
        CliError::Input(format!(
            "no [keys.{}] is configured (configured: {})",
            args.id,
            config.keys.keys().cloned().collect::<Vec<_>>().join(", ")
        ))
    })?;
    let only = std::collections::BTreeMap::from([(args.id.clone(), source.clone())]);
    let store = load_keys(&only)?;
    let key = store
        .get(&args.id)
        .ok_or_else(|| CliError::Input(format!("key {} did not load", args.id)))?;
    let public = base64::engine::general_purpose::STANDARD.encode(key.public_key());
    let account = key.stellar_account();
    if args.json {
        return render::json(
            out,
            &serde_json::json!({
                "id": args.id,
                "algorithm": key.algorithm().to_string(),
                "public_key": public,
                "public_key_pem": key.public_key_pem(),
                "stellar_account": account,
            }),
        );
    }
    writeln!(out, "key:        {}", args.id)?;
    writeln!(out, "algorithm:  {}", key.algorithm())?;
    match key.algorithm() {
        crate::keys::Algorithm::Ed25519 => writeln!(out, "public key: {public} (32 bytes, base64)")?,
        crate::keys::Algorithm::RsaSha256 => writeln!(out, "public key: {public} (PKCS#1 DER, base64)")?,
        crate::keys::Algorithm::HmacSha256 => writeln!(out, "public key: none (a shared secret)")?,
    }
    if let Some(account) = account {
        writeln!(out, "account:    {account}")?;
    }
    // What an actor document's publicKeyPem carries.
    if let Some(pem) = key.public_key_pem() {
        write!(out, "{pem}")?;
    }
    Ok(())
}

async fn plugin_check(config: &Config, args: PluginCheckArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let file = args.file.display().to_string();
    let bytes = std::fs::read(&args.file).map_err(|e| CliError::Refused {
        file: file.clone(),
        reason: format!("cannot read: {e}"),
    })?;
    let host = PluginHost::new(config)?;
    let runtime = host.runtime().clone();
    let inspected = tokio::task::spawn_blocking(move || runtime.inspect(&bytes))
        .await
        .map_err(|e| CliError::Refused {
            file: file.clone(),
            reason: format!("inspection panicked: {e}"),
        })?;
    let inspection = inspected.map_err(|failure| CliError::Refused {
        file: file.clone(),
        reason: failure.to_string(),
    })?;
    if args.json {
        return render::json(
            out,
            &serde_json::json!({
                "file": file,
                "world": inspection.world.name(),
                "contract": format!("laneway:plugin@{}", inspection.version),
                "exports": inspection.exports,
                "imports": inspection.imports,
            }),
        );
    }
    writeln!(out, "{file}: ok")?;
    writeln!(out, "  world:    {}", inspection.world.name())?;
    writeln!(out, "  contract: laneway:plugin@{}", inspection.version)?;
    writeln!(out, "  exports:  {}", inspection.exports.join(", "))?;
    writeln!(out, "  imports:")?;
    for import in &inspection.imports {
        writeln!(out, "    {import}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    /// The README's promise: every command takes `--json`.
    #[test]
    fn every_command_takes_json() {
        fn leaves(command: &clap::Command, path: String, out: &mut Vec<(String, bool)>) {
            let subcommands: Vec<&clap::Command> =
                command.get_subcommands().filter(|c| c.get_name() != "help").collect();
            if subcommands.is_empty() {
                let json = command.get_arguments().any(|a| a.get_long() == Some("json"));
                out.push((path, json));
                return;
            }
            for sub in subcommands {
                leaves(sub, format!("{path} {}", sub.get_name()), out);
            }
        }
        let mut found = Vec::new();
        leaves(&super::Cli::command(), "laneway".to_owned(), &mut found);
        // `run` and `demo` are processes, not answers: their output is logs
        // (LANEWAY_LOG_FORMAT=json) and a live display; `bench` prints the
        // Markdown tables BENCHMARKS.md is made of.
        let missing: Vec<&str> = found
            .iter()
            .filter(|(path, json)| !json && path != "laneway run" && path != "laneway demo" && path != "laneway bench")
            .map(|(p, _)| p.as_str())
            .collect();
        assert!(missing.is_empty(), "commands without --json: {missing:?}");
    }
}
