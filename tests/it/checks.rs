//! Configuration mistakes that once dead-lettered every op of a kind, each
//! reported by `check-config` with its key path before any op runs, all at
//! once, the way host config errors are.

use std::path::PathBuf;

use anyhow::{ensure, Context};

use crate::cli::Env;

const CONTRACT: &str = "CAAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQCAIBAEAQC526";
const RPC: &str = "http://127.0.0.1:8000";
/// Stellar's documented key pair (SEP-0005 test 1, index 0).
const SEED: &str = "SBGWSG6BTNCKCOB3DIFBGCVMUPQFYPA2G4O34RMTB343OYPXU5DJDVMN";
const ACCOUNT: &str = "GDRXE2BQUC3AZNPVFSCEZ76NJ3WWL25FYFK6RGZGIEKWE4SOOHSUJUJ6";

struct Files {
    _dir: tempfile::TempDir,
    vault_key: PathBuf,
    garbage: PathBuf,
}

fn files() -> anyhow::Result<Files> {
    let dir = tempfile::tempdir()?;
    let vault_key = dir.path().join("vault.seed");
    std::fs::write(&vault_key, format!("{SEED}\n"))?;
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(
        &garbage,
        "-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n",
    )?;
    Ok(Files {
        _dir: dir,
        vault_key,
        garbage,
    })
}

/// A complete, valid setup: the Stellar vault kind priced by an oracle, and
/// ActivityPub delivery, with their keys.
fn base(files: &Files) -> anyhow::Result<String> {
    let (_, actor_pem, _) = crate::activitypub::actor_key()?;
    let wasm = |name| crate::runtime::wasm(name).map(|p| p.display().to_string());
    Ok(format!(
        "[keys.vault]\nalgorithm = \"ed25519\"\nfile = {vault_key:?}\n\
         [keys.actor]\nalgorithm = \"rsa-sha256\"\nfile = {actor:?}\n\
         [plugins.vault]\npath = {vault:?}\nallowed_hosts = [\"{RPC}\"]\nallowed_internal = [\"127.0.0.1\"]\nkeys = [\"vault\"]\n\
         [plugins.ap]\npath = {ap:?}\nallowed_hosts = [\"https://*\"]\nkeys = [\"actor\"]\n\
         [plugins.fees]\npath = {fees:?}\n\
         [oracles.stellar]\npolicy = \"fees\"\nrpc_url = \"{RPC}\"\n\
         [kinds.deposit]\nplugin = \"vault\"\nfee_oracle = \"stellar\"\n\
         [kinds.deposit.config]\nrpc_url = \"{RPC}\"\nnetwork_passphrase = \"Test SDF Network ; September 2015\"\n\
         contract_id = \"{CONTRACT}\"\nfunction = \"deposit\"\nsigner_key = \"vault\"\n\
         args = [{{ field = \"user\", type = \"address\" }}, {{ field = \"amount\", type = \"i128\" }}]\n\
         [kinds.activitypub]\nplugin = \"ap\"\n\
         [kinds.activitypub.config]\nkey = \"actor\"\nkey_id = \"https://example.social/users/alice#main-key\"\n",
        vault_key = files.vault_key.display().to_string(),
        actor = actor_pem.display().to_string(),
        vault = wasm("stellar-vault")?,
        ap = wasm("activitypub")?,
        fees = wasm("fee-policy")?,
    ))
}

/// Replaces `from` (which must occur) with `to`.
fn edit(text: &str, from: &str, to: &str) -> anyhow::Result<String> {
    ensure!(text.contains(from), "the base config has no {from:?}");
    Ok(text.replacen(from, to, 1))
}

/// One mistake: what to change, and the key paths (and a word of the
/// message) `check-config` must report.
struct Mistake {
    what: &'static str,
    from: String,
    to: String,
    expect: Vec<(&'static str, &'static str)>,
}

fn mistake(what: &'static str, from: &str, to: &str, expect: &[(&'static str, &'static str)]) -> Mistake {
    Mistake {
        what,
        from: from.to_owned(),
        to: to.to_owned(),
        expect: expect.to_vec(),
    }
}

fn mistakes(files: &Files) -> Vec<Mistake> {
    let garbage = format!("file = {:?}", files.garbage.display().to_string());
    let vault_file = format!("file = {:?}", files.vault_key.display().to_string());
    vec![
        // Stellar kind config.
        mistake(
            "a contract id that is not one",
            &format!("contract_id = \"{CONTRACT}\""),
            "contract_id = \"CBOGUS\"",
            &[("kinds.deposit.config.contract_id", "not a contract address")],
        ),
        mistake(
            "a missing signer_key",
            "signer_key = \"vault\"\n",
            "",
            &[("kinds.deposit.config.signer_key", "missing")],
        ),
        mistake(
            "a signer key that is not loaded",
            "signer_key = \"vault\"",
            "signer_key = \"treasury\"",
            &[("kinds.deposit.config.signer_key", "not granted")],
        ),
        mistake(
            "a signer key not granted to the plugin",
            "keys = [\"vault\"]",
            "keys = []",
            &[("kinds.deposit.config.signer_key", "not granted")],
        ),
        mistake(
            "a misspelt config key",
            "function = \"deposit\"",
            "functon = \"deposit\"",
            &[
                ("kinds.deposit.config.functon", "unknown key"),
                ("kinds.deposit.config.function", "missing"),
            ],
        ),
        mistake(
            "an argument of an unknown type",
            "type = \"i128\"",
            "type = \"int128\"",
            &[("kinds.deposit.config.args[1].type", "expected one of")],
        ),
        mistake(
            "a function that is not a Soroban symbol",
            "function = \"deposit\"",
            "function = \"deposit-now!\"",
            &[("kinds.deposit.config.function", "Soroban symbol")],
        ),
        mistake(
            "a history source the plugin may not reach",
            "signer_key = \"vault\"\n",
            "signer_key = \"vault\"\nhistory_url = \"https://horizon.example\"\n",
            &[("kinds.deposit.config.history_url", "allowed_hosts")],
        ),
        mistake(
            "a history source that is not a string",
            "signer_key = \"vault\"\n",
            "signer_key = \"vault\"\nhistory_url = 8000\n",
            &[("kinds.deposit.config.history_url", "expected a string")],
        ),
        mistake(
            "a fee-bump delay out of range",
            "signer_key = \"vault\"\n",
            "signer_key = \"vault\"\nbump_after_ledgers = 5000\n",
            &[("kinds.deposit.config.bump_after_ledgers", "1000")],
        ),
        // Egress.
        mistake(
            "allowed_hosts without the RPC's scheme and port",
            &format!("allowed_hosts = [\"{RPC}\"]"),
            "allowed_hosts = [\"https://127.0.0.1\"]",
            &[
                ("kinds.deposit.config.rpc_url", "allowed_hosts"),
                ("oracles.stellar.rpc_url", "allowed_hosts"),
            ],
        ),
        mistake(
            "a loopback RPC without allowed_internal",
            "allowed_internal = [\"127.0.0.1\"]\n",
            "",
            &[("kinds.deposit.config.rpc_url", "allowed_internal")],
        ),
        // ActivityPub kind config.
        mistake(
            "a missing key_id",
            "key_id = \"https://example.social/users/alice#main-key\"\n",
            "",
            &[("kinds.activitypub.config.key_id", "missing")],
        ),
        mistake(
            "an actor key not granted to the plugin",
            "keys = [\"actor\"]",
            "keys = []",
            &[("kinds.activitypub.config.key", "not granted")],
        ),
        mistake(
            "an unknown ActivityPub config key",
            "key = \"actor\"\n",
            "key = \"actor\"\nkeyid = \"https://example.social/users/alice#main-key\"\n",
            &[("kinds.activitypub.config.keyid", "unknown key")],
        ),
        mistake(
            "an Ed25519 key where HTTP Signatures need RSA",
            "keys = [\"actor\"]",
            "keys = [\"actor\", \"vault\"]\n[kinds.activitypub.config.actors.\"https://example.social/users/bob\"]\nkey = \"vault\"\nkey_id = \"https://example.social/users/bob#main-key\"",
            &[("kinds.activitypub.config.actors.\"https://example.social/users/bob\".key", "not a rsa-sha256 key")],
        ),
        // Host config.
        mistake(
            "a key file that does not exist",
            &vault_file,
            "file = \"/nonexistent/vault.seed\"",
            &[("keys.vault", "cannot read")],
        ),
        mistake(
            "a key file that does not parse",
            &vault_file,
            &garbage,
            &[("keys.vault", "not a PKCS#8")],
        ),
        mistake(
            "a granted key that is not configured",
            "keys = [\"vault\"]",
            "keys = [\"vault\", \"ghost\"]",
            &[("plugins.vault.keys", "no [keys.ghost]")],
        ),
        mistake(
            "an oracle polling a node no plugin may reach",
            &format!("rpc_url = \"{RPC}\"\n[kinds.deposit]"),
            "rpc_url = \"http://soroban-mainnet.example:8000\"\n[kinds.deposit]",
            &[("oracles.stellar.rpc_url", "allowed_hosts")],
        ),
    ]
}

fn reported(error: &str, path: &str, word: &str) -> bool {
    error
        .lines()
        .any(|line| line.trim_start().starts_with(&format!("- {path}: ")) && line.contains(word))
}

/// The base is valid (with an `S…` seed as the vault key); every mistake is
/// reported by `check-config` with its key path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_reports_every_mistake_that_would_dead_letter_ops() -> anyhow::Result<()> {
    let files = files()?;
    let base = base(&files)?;
    let env = Env::new(&base)?;
    let ok = env.ok(&["check-config"], "").await?;
    ensure!(ok.contains("configuration is valid"), "{ok}");
    let mut failures = Vec::new();
    for m in mistakes(&files) {
        let env = Env::new(&edit(&base, &m.from, &m.to)?)?;
        let error = match env.run(&["check-config"], "").await? {
            Ok(out) => {
                failures.push(format!("{}: check-config passed: {out}", m.what));
                continue;
            }
            Err(e) => e.to_string(),
        };
        for (path, word) in &m.expect {
            if !reported(&error, path, word) {
                failures.push(format!("{}: expected {path} ({word}) in:\n{error}", m.what));
            }
        }
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n\n"));
    Ok(())
}

/// Several mistakes at once are reported together, not one per run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_reports_all_mistakes_at_once() -> anyhow::Result<()> {
    let files = files()?;
    let mut config = base(&files)?;
    let chosen = mistakes(&files);
    let picks = [0usize, 7, 9, 14];
    for i in picks {
        let m = &chosen[i];
        config = edit(&config, &m.from, &m.to)?;
    }
    let error = Env::new(&config)?.err(&["check-config"], "").await?;
    for i in picks {
        for (path, word) in &chosen[i].expect {
            ensure!(
                reported(&error, path, word),
                "{}: {path} missing from:\n{error}",
                chosen[i].what
            );
        }
    }
    Ok(())
}

/// `keys show` prints the public half of an `S…` seed and its `G…` account,
/// for plain-SQL producers filling `lanes`; never the seed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_show_prints_the_stellar_account_of_a_seed() -> anyhow::Result<()> {
    let files = files()?;
    let env = Env::new(&base(&files)?)?;
    let text = env.ok(&["keys", "show", "vault"], "").await?;
    ensure!(
        text.contains(ACCOUNT) && text.contains("ed25519") && !text.contains(SEED),
        "{text}"
    );
    let json: serde_json::Value = serde_json::from_str(&env.ok(&["keys", "show", "vault", "--json"], "").await?)?;
    ensure!(json["stellar_account"] == ACCOUNT, "{json}");
    let rsa = env.ok(&["keys", "show", "actor"], "").await?;
    ensure!(rsa.contains("rsa-sha256") && !rsa.contains("account:"), "{rsa}");
    let unknown = env.err(&["keys", "show", "nope"], "").await?;
    ensure!(
        unknown.contains("no [keys.nope]") && unknown.contains("actor, vault"),
        "{unknown}"
    );
    Ok(())
}

/// A payload that lacks a field the kind's argument mapping reads is refused
/// at enqueue, with the field's name, and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_missing_a_mapped_field_is_refused_at_enqueue() -> anyhow::Result<()> {
    let files = files()?;
    let env = Env::new(&base(&files)?)?;
    env.ok(&["migrate"], "").await?;
    let args = ["enqueue", "--kind", "deposit", "--outbox", "vault"];
    let refused = env
        .err(&args, &format!(r#"{{"user":"{ACCOUNT}"}}"#))
        .await
        .context("a deposit without an amount")?;
    ensure!(refused.contains("amount"), "{refused}");
    let listed = env.ok(&["ops", "list", "--json"], "").await?;
    ensure!(listed.trim() == "[]", "{listed}");
    // With the field, the op is enqueued on the signer's account lane.
    let ok = env
        .ok(&args, &format!(r#"{{"user":"{ACCOUNT}","amount":"5"}}"#))
        .await?;
    ensure!(ok.contains("enqueued op"), "{ok}");
    let listed = env.ok(&["ops", "list", "--json"], "").await?;
    ensure!(listed.contains(ACCOUNT), "the signer's account is the lane: {listed}");
    // A kind whose config is refused says so, instead of a puzzling
    // "lanes required".
    let broken = Env::new(&edit(
        &base(&files)?,
        &format!("contract_id = \"{CONTRACT}\""),
        "contract_id = \"CBOGUS\"",
    )?)?;
    broken.ok(&["migrate"], "").await?;
    let refused = broken
        .err(&args, &format!(r#"{{"user":"{ACCOUNT}","amount":"5"}}"#))
        .await?;
    ensure!(
        refused.contains("not active") && refused.contains("kinds.deposit.config.contract_id"),
        "{refused}"
    );
    Ok(())
}

/// The shipped starting config is valid as shipped, and with its inbound
/// block uncommented.
#[test]
fn the_shipped_example_config_is_valid_with_and_without_its_inbound_block() -> anyhow::Result<()> {
    let text = std::fs::read_to_string(
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/laneway.example.toml"),
    )?;
    let config = laneway::config::from_toml_str(&text)?;
    ensure!(!config.inbound.enabled && config.kinds["activitypub"].plugin.as_deref() == Some("activitypub"));
    let (head, inbound) = text
        .split_once("# Inbound activities")
        .ok_or_else(|| anyhow::anyhow!("the inbound block is gone"))?;
    let uncommented: String = inbound
        .lines()
        .skip(1)
        .map(|l| l.strip_prefix("# ").unwrap_or(l))
        .filter(|l| !l.starts_with("Money on Stellar"))
        .collect::<Vec<_>>()
        .join("\n");
    let config = laneway::config::from_toml_str(&format!("{head}\n{uncommented}\n"))?;
    ensure!(
        config.inbound.enabled && config.kinds["activitypub_inbound"].plugin.as_deref() == Some("webhook"),
        "{:?}",
        config.inbound
    );
    Ok(())
}
