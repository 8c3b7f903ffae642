//! `laneway stellar channels …`: an operator's view of channel-account
//! pools (which channel holds how many ops), new channel keys, creating
//! the channel accounts on chain from the pool's funder, and merging a
//! retired, drained channel's account back into the funder.
//!
//! Marking a channel retired is a config change (`pools.NAME.retired`, hot
//! reloaded): laneway never rewrites the operator's file. `list` says when
//! a retired channel has drained; `retire` then closes its account.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Subcommand};
use serde_json::{json, Value};
use stellar_xdr::{
    AccountId, CreateAccountOp, LedgerEntryData, LedgerKey, LedgerKeyAccount, Limits, Memo, MuxedAccount, Operation,
    OperationBody, Preconditions, PublicKey, ReadXdr, SequenceNumber, TimeBounds, TimePoint, Transaction,
    TransactionEnvelope, TransactionExt, TransactionV1Envelope, Uint256, WriteXdr,
};

use super::{open_checked, render, CliError};
use crate::config::{Config, PoolConfig};
use crate::keys::{Algorithm, KeyStore};
use crate::op::Status;
use crate::queue::OpFilter;

/// `laneway stellar …`
#[derive(Debug, Subcommand)]
pub enum StellarCommand {
    /// Channel-account pools (`[pools.NAME]`).
    #[command(subcommand)]
    Channels(ChannelsCommand),
}

/// `laneway stellar channels …`
#[derive(Debug, Subcommand)]
pub enum ChannelsCommand {
    /// Each pool's channels: key, account, active or retired, and the ops
    /// still dealt to it (a retired channel with none may leave the pool).
    List(ListArgs),
    /// Make channel keys (Stellar secret seeds, one file each, mode 0600)
    /// and print the config that adds them to a pool.
    Create(CreateArgs),
    /// Create the pool's channel accounts that do not exist yet, in one
    /// transaction from the pool's funder.
    Fund(FundArgs),
    /// Close a channel the config marks retired once no op is dealt to it:
    /// its account is merged into the pool's funder (its balance returns).
    Retire(RetireArgs),
}

/// `laneway stellar channels retire`
#[derive(Debug, Args)]
pub struct RetireArgs {
    /// The pool.
    #[arg(long)]
    pub pool: String,
    /// The channel's key id.
    #[arg(long)]
    pub key: String,
    /// How long to wait for the merge to land, in seconds.
    #[arg(long, default_value_t = 60)]
    pub wait: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `laneway stellar channels list`
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only this pool.
    #[arg(long)]
    pub pool: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `laneway stellar channels create`
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// The pool the keys are for (it names the key ids).
    #[arg(long)]
    pub pool: String,
    /// How many channels.
    #[arg(long, default_value_t = 8)]
    pub count: u32,
    /// Where the seed files go (created if missing; a file never overwritten).
    #[arg(long)]
    pub dir: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `laneway stellar channels fund`
#[derive(Debug, Args)]
pub struct FundArgs {
    /// The pool whose missing channel accounts are created.
    #[arg(long)]
    pub pool: String,
    /// Each new account's starting balance, in stroops (default 20 XLM).
    #[arg(long, default_value_t = 200_000_000)]
    pub starting_balance: i64,
    /// How long to wait for the funding transaction to land, in seconds.
    #[arg(long, default_value_t = 60)]
    pub wait: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Most channels one `create` or one funding transaction handles (a
/// transaction holds at most 100 operations).
const MAX_CHANNELS: u32 = 100;

pub(super) async fn run(config: &Config, command: StellarCommand, out: &mut dyn Write) -> Result<(), CliError> {
    match command {
        StellarCommand::Channels(ChannelsCommand::List(args)) => list(config, &args, out).await,
        StellarCommand::Channels(ChannelsCommand::Create(args)) => create(config, &args, out),
        StellarCommand::Channels(ChannelsCommand::Fund(args)) => fund(config, &args, out).await,
        StellarCommand::Channels(ChannelsCommand::Retire(args)) => retire(config, &args, out).await,
    }
}

fn pool<'a>(config: &'a Config, name: &str) -> Result<&'a PoolConfig, CliError> {
    config.pools.get(name).ok_or_else(|| {
        CliError::Input(format!(
            "no [pools.{name}] is configured (configured: {})",
            config.pools.keys().cloned().collect::<Vec<_>>().join(", ")
        ))
    })
}

/// The pool's keys (and its funder's), loaded.
fn pool_keys(config: &Config, pool: &PoolConfig) -> Result<KeyStore, CliError> {
    let sources: BTreeMap<String, crate::keys::KeySource> = pool
        .channels
        .iter()
        .chain(&pool.funder)
        .filter_map(|id| config.keys.get(id).map(|s| (id.clone(), s.clone())))
        .collect();
    super::load_keys(&sources)
}

fn account_of(keys: &KeyStore, id: &str) -> Result<String, CliError> {
    keys.get(id)
        .and_then(crate::keys::Key::stellar_account)
        .ok_or_else(|| CliError::Input(format!("[keys.{id}] is not a loaded ed25519 key")))
}

/// Ops still dealt to a channel and not terminal, counted up to `CAP`.
const CAP: u32 = 10_000;

/// Ops dealt to the channel `account` that are not terminal (pending,
/// in flight, or holding a receipt), counted up to [`CAP`] per state.
async fn open_ops(queue: &dyn crate::queue::Queue, account: &str) -> Result<usize, CliError> {
    let mut open = 0usize;
    for status in [Status::Pending, Status::Submitted] {
        let filter = OpFilter {
            lane: Some(account.to_owned()),
            status: Some(status),
            limit: CAP,
            ..OpFilter::default()
        };
        open += queue.list(&filter).await?.len();
    }
    Ok(open)
}

async fn list(config: &Config, args: &ListArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let queue = open_checked(config).await?;
    let mut rows = Vec::new();
    for (name, pool) in &config.pools {
        if args.pool.as_ref().is_some_and(|p| p != name) {
            continue;
        }
        let keys = pool_keys(config, pool)?;
        for id in &pool.channels {
            let account = account_of(&keys, id)?;
            let open = open_ops(queue.as_ref(), &account).await?;
            let retired = pool.retired.contains(id);
            rows.push(json!({
                "pool": name, "key": id, "account": account,
                "state": if retired { "retired" } else { "active" },
                "open_ops": open,
                "drained": retired && open == 0,
            }));
        }
    }
    if args.pool.is_some() && rows.is_empty() {
        return Err(CliError::Input(format!(
            "no [pools.{}] is configured",
            args.pool.as_deref().unwrap_or_default()
        )));
    }
    if args.json {
        return render::json(out, &rows);
    }
    if rows.is_empty() {
        writeln!(out, "no [pools] are configured")?;
        return Ok(());
    }
    // A retired channel with no open ops may leave `channels`.
    writeln!(
        out,
        "{:<12} {:<16} {:<56} {:<8} {:>8}",
        "POOL", "KEY", "ACCOUNT", "STATE", "OPEN OPS"
    )?;
    for r in &rows {
        let open = r["open_ops"].as_u64().unwrap_or(0);
        let shown = if open >= u64::from(CAP) {
            format!("≥{CAP}")
        } else {
            open.to_string()
        };
        let state = match (r["state"].as_str(), r["drained"].as_bool()) {
            (Some("retired"), Some(true)) => "retired, drained".to_owned(),
            (state, _) => state.unwrap_or_default().to_owned(),
        };
        writeln!(
            out,
            "{:<12} {:<16} {:<56} {:<17} {:>8}",
            r["pool"].as_str().unwrap_or_default(),
            r["key"].as_str().unwrap_or_default(),
            r["account"].as_str().unwrap_or_default(),
            state,
            shown
        )?;
    }
    Ok(())
}

fn create(config: &Config, args: &CreateArgs, out: &mut dyn Write) -> Result<(), CliError> {
    if !(1..=MAX_CHANNELS).contains(&args.count) {
        return Err(CliError::Input(format!(
            "--count: expected 1 to {MAX_CHANNELS}, got {}",
            args.count
        )));
    }
    if args.pool.is_empty()
        || !args
            .pool
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(CliError::Input(format!(
            "--pool: letters, digits, '-' and '_', got {:?}",
            args.pool
        )));
    }
    std::fs::create_dir_all(&args.dir)?;
    let dir = std::fs::canonicalize(&args.dir)?;
    let mut made = Vec::new();
    let mut n = 0u32;
    while made.len() < args.count as usize {
        n += 1;
        let id = format!("{}-{n}", args.pool);
        let file = dir.join(format!("{id}.seed"));
        if config.keys.contains_key(&id) || file.exists() {
            continue;
        }
        let account = write_seed(&file)?;
        made.push((id, file, account));
    }
    if args.json {
        let rows: Vec<Value> = made
            .iter()
            .map(|(id, file, account)| json!({ "key": id, "file": file.display().to_string(), "account": account }))
            .collect();
        return render::json(out, &rows);
    }
    writeln!(
        out,
        "# {} channel keys for pool {:?}; add this to the config (it hot-reloads),",
        made.len(),
        args.pool
    )?;
    writeln!(
        out,
        "# grant the keys to the kinds' plugin, then create the accounts with\n# `laneway stellar channels fund --pool {}`.\n",
        args.pool
    )?;
    for (id, file, account) in &made {
        writeln!(out, "# {account}")?;
        writeln!(
            out,
            "[keys.{id}]\nalgorithm = \"ed25519\"\nfile = {:?}\n",
            file.display().to_string()
        )?;
    }
    let ids: Vec<String> = made.iter().map(|(id, _, _)| format!("{id:?}")).collect();
    let existing = config
        .pools
        .get(&args.pool)
        .map(|p| p.channels.clone())
        .unwrap_or_default();
    let all: Vec<String> = existing
        .iter()
        .map(|id| format!("{id:?}"))
        .chain(ids.iter().cloned())
        .collect();
    writeln!(out, "[pools.{}]\nchannels = [{}]", args.pool, all.join(", "))?;
    writeln!(out, "\n# and in [plugins.<the kinds' plugin>] keys: {}", ids.join(", "))?;
    Ok(())
}

/// Writes a fresh Stellar secret seed to `file` (new, mode 0600); returns
/// its account.
fn write_seed(file: &Path) -> Result<String, CliError> {
    let mut seed = [0u8; 32];
    aws_lc_rs::rand::fill(&mut seed)
        .map_err(|_| CliError::Input("the system random number generator failed".into()))?;
    let secret = stellar_strkey::ed25519::PrivateKey(seed);
    let public = ed25519_dalek::SigningKey::from_bytes(&seed).verifying_key().to_bytes();
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    let mut handle = options.open(file)?;
    handle.write_all(format!("{}\n", secret.as_unredacted()).as_bytes())?;
    handle.sync_all()?;
    Ok(stellar_strkey::ed25519::PublicKey(public)
        .to_string()
        .as_str()
        .to_owned())
}

fn rpc_err(e: impl std::fmt::Display) -> CliError {
    CliError::Input(format!("stellar rpc: {e}"))
}

fn xdr_err(e: stellar_xdr::Error) -> CliError {
    CliError::Input(format!("xdr: {e}"))
}

fn account_key(public: [u8; 32]) -> Result<String, CliError> {
    LedgerKey::Account(LedgerKeyAccount {
        account_id: AccountId(PublicKey::PublicKeyTypeEd25519(Uint256(public))),
    })
    .to_xdr_base64(Limits::none())
    .map_err(xdr_err)
}

fn public_of(keys: &KeyStore, id: &str) -> Result<[u8; 32], CliError> {
    keys.get(id)
        .filter(|k| k.algorithm() == Algorithm::Ed25519)
        .and_then(|k| <[u8; 32]>::try_from(k.public_key()).ok())
        .ok_or_else(|| CliError::Input(format!("[keys.{id}] is not a loaded ed25519 key")))
}

/// A pool setting `command` cannot do without.
fn required<'a>(name: &str, key: &str, value: Option<&'a String>, command: &str) -> Result<&'a str, CliError> {
    value
        .map(String::as_str)
        .ok_or_else(|| CliError::Input(format!("pools.{name}.{key} is not set; {command} needs it")))
}

/// The pool's RPC, through the plugins' egress guard, and its network id.
fn connect(
    config: &Config,
    name: &str,
    pool: &PoolConfig,
    command: &str,
) -> Result<(crate::oracle::StellarRpc, [u8; 32]), CliError> {
    let url = required(name, "rpc_url", pool.rpc_url.as_ref(), command)?;
    let passphrase = required(name, "network_passphrase", pool.network_passphrase.as_ref(), command)?;
    let rpc = crate::oracle::StellarRpc::new(
        url,
        Duration::from_secs(10),
        crate::config::rpc_egress(&format!("pools.{name}"), url, &config.plugins),
    )
    .map_err(rpc_err)?;
    let network_id: [u8; 32] = {
        use sha2::Digest as _;
        sha2::Sha256::digest(passphrase.as_bytes()).into()
    };
    Ok((rpc, network_id))
}

/// The sequence number of each of these accounts that exists on chain.
async fn sequences(rpc: &crate::oracle::StellarRpc, publics: &[[u8; 32]]) -> Result<BTreeMap<[u8; 32], i64>, CliError> {
    let wanted = publics.iter().map(|p| account_key(*p)).collect::<Result<Vec<_>, _>>()?;
    let entries = rpc
        .call("getLedgerEntries", Some(json!({ "keys": wanted })))
        .await
        .map_err(rpc_err)?;
    let mut sequences = BTreeMap::new();
    for entry in entries["entries"].as_array().into_iter().flatten() {
        let data = LedgerEntryData::from_xdr_base64(entry["xdr"].as_str().unwrap_or_default(), Limits::none())
            .map_err(xdr_err)?;
        if let LedgerEntryData::Account(account) = data {
            let AccountId(PublicKey::PublicKeyTypeEd25519(Uint256(public))) = account.account_id;
            sequences.insert(public, account.seq_num.0);
        }
    }
    Ok(sequences)
}

/// A classic transaction from `source`, bounded by `wait` (10–300 s) so a
/// lost one is provably dead and the command can simply be run again.
fn classic(source: [u8; 32], sequence: i64, ops: Vec<Operation>, wait: u64) -> Result<Transaction, CliError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(Transaction {
        source_account: MuxedAccount::Ed25519(Uint256(source)),
        fee: 100 * u32::try_from(ops.len()).unwrap_or(MAX_CHANNELS),
        seq_num: SequenceNumber(sequence + 1),
        cond: Preconditions::Time(TimeBounds {
            min_time: TimePoint(0),
            max_time: TimePoint(now + wait.clamp(10, 300)),
        }),
        memo: Memo::None,
        operations: ops.try_into().map_err(xdr_err)?,
        ext: TransactionExt::V0,
    })
}

/// Signs `transaction` with `key`, sends it, and waits up to `wait`
/// seconds for it to land; returns its hash. `what` names it in errors.
async fn submit(
    (rpc, network_id): &(crate::oracle::StellarRpc, [u8; 32]),
    (keys, key, public): (&KeyStore, &str, [u8; 32]),
    transaction: Transaction,
    wait: u64,
    what: &str,
) -> Result<String, CliError> {
    let hash = transaction.hash(*network_id).map_err(xdr_err)?;
    let signature = keys
        .sign(key, Algorithm::Ed25519, &hash)
        .map_err(|e| CliError::Input(format!("signing with {key:?}: {e}")))?;
    let envelope = TransactionEnvelope::Tx(TransactionV1Envelope {
        tx: transaction,
        signatures: vec![stellar_xdr::DecoratedSignature {
            hint: stellar_xdr::SignatureHint([public[28], public[29], public[30], public[31]]),
            signature: stellar_xdr::Signature(signature.try_into().map_err(xdr_err)?),
        }]
        .try_into()
        .map_err(xdr_err)?,
    })
    .to_xdr_base64(Limits::none())
    .map_err(xdr_err)?;
    let hash_hex = hex::encode(hash);
    let sent = rpc
        .call("sendTransaction", Some(json!({ "transaction": envelope })))
        .await
        .map_err(rpc_err)?;
    match sent["status"].as_str() {
        Some("PENDING" | "DUPLICATE") => {}
        status => {
            return Err(CliError::Input(format!(
                "the network did not take the {what} transaction {hash_hex}: {} {}",
                status.unwrap_or("?"),
                sent["errorResultXdr"].as_str().unwrap_or_default()
            )))
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(wait.clamp(10, 300));
    loop {
        let found = rpc
            .call("getTransaction", Some(json!({ "hash": hash_hex })))
            .await
            .map_err(rpc_err)?;
        match found["status"].as_str() {
            Some("SUCCESS") => return Ok(hash_hex),
            Some("FAILED") => {
                return Err(CliError::Input(format!(
                    "{what} transaction {hash_hex} failed on chain: {}",
                    found["resultXdr"].as_str().unwrap_or_default()
                )))
            }
            _ if tokio::time::Instant::now() >= deadline => {
                return Err(CliError::Input(format!(
                    "{what} transaction {hash_hex} has not landed within {wait} s; run the command again once it \
                     is past its time bound (it does only what is still undone)"
                )))
            }
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

async fn fund(config: &Config, args: &FundArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let pool = pool(config, &args.pool)?;
    let chain = connect(config, &args.pool, pool, "fund")?;
    let funder = required(&args.pool, "funder", pool.funder.as_ref(), "fund")?;
    if args.starting_balance <= 0 {
        return Err(CliError::Input(
            "--starting-balance: expected a positive number of stroops".into(),
        ));
    }
    let keys = pool_keys(config, pool)?;
    let funder_public = public_of(&keys, funder)?;
    let mut channels = Vec::new();
    for id in &pool.channels {
        channels.push((id.clone(), public_of(&keys, id)?));
    }
    let publics: Vec<[u8; 32]> = std::iter::once(funder_public)
        .chain(channels.iter().map(|(_, p)| *p))
        .collect();
    let sequences = sequences(&chain.0, &publics).await?;
    let funder_sequence = sequences
        .get(&funder_public)
        .copied()
        .ok_or_else(|| CliError::Input(format!("the funder {funder:?} has no account on this network")))?;
    let new: Vec<&(String, [u8; 32])> = channels.iter().filter(|(_, p)| !sequences.contains_key(p)).collect();
    if new.is_empty() {
        let note = format!("every channel of pool {} exists on chain", args.pool);
        return render::done(out, args.json, &json!({ "pool": args.pool, "created": [] }), &note);
    }
    let ops: Vec<Operation> = new
        .iter()
        .map(|(_, public)| Operation {
            source_account: None,
            body: OperationBody::CreateAccount(CreateAccountOp {
                destination: AccountId(PublicKey::PublicKeyTypeEd25519(Uint256(*public))),
                starting_balance: args.starting_balance,
            }),
        })
        .collect();
    let transaction = classic(funder_public, funder_sequence, ops, args.wait)?;
    let hash_hex = submit(
        &chain,
        (&keys, funder, funder_public),
        transaction,
        args.wait,
        "funding",
    )
    .await?;
    let created: Vec<Value> = new
        .iter()
        .map(|(id, public)| json!({ "key": id, "account": stellar_strkey::ed25519::PublicKey(*public).to_string().as_str() }))
        .collect();
    let note = format!(
        "created {} channel accounts of pool {} in transaction {hash_hex}",
        created.len(),
        args.pool
    );
    render::done(
        out,
        args.json,
        &json!({ "pool": args.pool, "transaction": hash_hex, "created": created }),
        &note,
    )
}

/// Merges a retired channel's account into the pool's funder, once no op is
/// dealt to it. Refused, saying what to do, while the config still deals it
/// ops or any op of it is open: an op whose channel account is gone could
/// never be sent.
async fn retire(config: &Config, args: &RetireArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let pool = pool(config, &args.pool)?;
    if !pool.channels.contains(&args.key) {
        return Err(CliError::Input(format!(
            "{:?} is not a channel of pools.{} (channels: {})",
            args.key,
            args.pool,
            pool.channels.join(", ")
        )));
    }
    let keys = pool_keys(config, pool)?;
    let account = account_of(&keys, &args.key)?;
    let queue = open_checked(config).await?;
    let open = open_ops(queue.as_ref(), &account).await?;
    if !pool.retired.contains(&args.key) {
        return Err(CliError::Input(format!(
            "channel {:?} is active: add it to pools.{}.retired first (the config hot-reloads; it then takes no new \
             op and its {open} open ops drain), and run retire again once `laneway stellar channels list` shows it \
             drained",
            args.key, args.pool
        )));
    }
    if open > 0 {
        return Err(CliError::Input(format!(
            "channel {:?} is retired but {open} ops dealt to it are still open; run retire again once `laneway \
             stellar channels list` shows it drained",
            args.key
        )));
    }
    let chain = connect(config, &args.pool, pool, "retire")?;
    let funder = required(&args.pool, "funder", pool.funder.as_ref(), "retire")?;
    let funder_public = public_of(&keys, funder)?;
    let public = public_of(&keys, &args.key)?;
    let sequences = sequences(&chain.0, &[public, funder_public]).await?;
    let remove = format!(
        "now remove {:?} from pools.{pool}.channels and pools.{pool}.retired (and its [keys.{key}] when nothing \
         else uses it)",
        args.key,
        pool = args.pool,
        key = args.key
    );
    let Some(&sequence) = sequences.get(&public) else {
        let note = format!(
            "channel {:?} has no account on chain (already merged?); {remove}",
            args.key
        );
        return render::done(
            out,
            args.json,
            &json!({ "pool": args.pool, "key": args.key, "account": account, "merged": false }),
            &note,
        );
    };
    if !sequences.contains_key(&funder_public) {
        return Err(CliError::Input(format!(
            "the funder {funder:?} has no account on this network to merge into"
        )));
    }
    let merge = Operation {
        source_account: None,
        body: OperationBody::AccountMerge(MuxedAccount::Ed25519(Uint256(funder_public))),
    };
    let transaction = classic(public, sequence, vec![merge], args.wait)?;
    let hash_hex = submit(&chain, (&keys, &args.key, public), transaction, args.wait, "merge").await?;
    let note = format!(
        "merged channel {:?} ({account}) into the funder {funder:?} in transaction {hash_hex}; {remove}",
        args.key
    );
    render::done(
        out,
        args.json,
        &json!({ "pool": args.pool, "key": args.key, "account": account, "merged": true, "transaction": hash_hex }),
        &note,
    )
}
