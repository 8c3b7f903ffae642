//! `validate-config` for the vault kinds: every mistake in a kind's config
//! that would otherwise dead-letter each of its ops, found before any op runs.

use laneway_sdk::check::{self, join, ConfigCheck};
use laneway_sdk::signer::Algorithm;
use laneway_sdk::Problem;
use serde_json::Value;
use stellar_xdr::{ScAddress, ScSymbol};

use crate::settings::{ArgType, Settings, MAX_VALID_SECONDS};

const KEYS: [&str; 15] = [
    "rpc_url",
    "network_passphrase",
    "contract_id",
    "function",
    "signer_key",
    "args",
    "valid_seconds",
    "ledger_window",
    "poll_ms",
    "default_base_fee",
    "try_again_ms",
    "history_url",
    "bump_after_ledgers",
    "auth_contracts",
    "pool",
];

const ARG_KEYS: [&str; 3] = ["field", "value", "type"];
const ARG_TYPES: [&str; 8] = ["address", "i128", "i64", "u64", "u32", "bool", "symbol", "string"];

/// Checks one kind's config, asking the host about its key and RPC URL.
pub fn validate(config: &str) -> Result<(), Vec<Problem>> {
    let value = check::parse(config)?;
    let mut check = ConfigCheck::new();
    let Some(table) = check.table("", &value, &KEYS) else {
        return check.finish();
    };
    if let Some(url) = check.string("", table, "rpc_url", true) {
        check::reachable(&mut check, "rpc_url", url);
    }
    if let Some(url) = check.string("", table, "history_url", false) {
        check::reachable(&mut check, "history_url", url);
    }
    check.string("", table, "network_passphrase", true);
    if let Some(contract) = check.string("", table, "contract_id", true) {
        if !(contract.starts_with('C') && contract.parse::<ScAddress>().is_ok()) {
            check.problem("contract_id", format!("{contract:?} is not a contract address (C…)"));
        }
    }
    if let Some(function) = check.string("", table, "function", true) {
        let symbol_chars = function.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !symbol_chars || ScSymbol::try_from(function).is_err() {
            check.problem(
                "function",
                format!("{function:?} is not a Soroban symbol (at most 32 of a-z, A-Z, 0-9, _)"),
            );
        }
    }
    if let Some(key) = check.string("", table, "signer_key", true) {
        check::key(&mut check, "signer_key", key, Algorithm::Ed25519);
    }
    match table.get("auth_contracts") {
        None => {}
        Some(Value::Array(contracts)) => {
            for (i, contract) in contracts.iter().enumerate() {
                let ok = contract
                    .as_str()
                    .is_some_and(|c| c.starts_with('C') && c.parse::<ScAddress>().is_ok());
                if !ok {
                    check.problem(
                        format!("auth_contracts[{i}]"),
                        format!("{contract} is not a contract address (C…)"),
                    );
                }
            }
        }
        Some(other) => check.problem(
            "auth_contracts",
            format!("expected an array of contract addresses, got {other}"),
        ),
    }
    // The host writes `pool` from `[pools]`; its channels must be keys the
    // plugin may sign with.
    if let Some(Value::Object(pool)) = table.get("pool") {
        if let Some(Value::Object(channels)) = pool.get("channels") {
            for (account, key) in channels {
                let path = format!("pool.channels.{account}");
                let Some(id) = key.as_str() else {
                    check.problem(path, format!("expected a key id, got {key}"));
                    continue;
                };
                let public =
                    check::key(&mut check, &path, id, Algorithm::Ed25519).and_then(|p| <[u8; 32]>::try_from(p).ok());
                if let Some(public) = public {
                    if crate::tx::account_id(public).to_string() != *account {
                        check.problem(path, format!("key {id:?} is not account {account}"));
                    }
                }
            }
        }
    }
    check.integer("", table, "valid_seconds", 1, MAX_VALID_SECONDS);
    check.integer("", table, "ledger_window", 1, 1000);
    check.integer("", table, "poll_ms", 1, 600_000);
    check.integer("", table, "default_base_fee", 100, u64::from(u32::MAX));
    check.integer("", table, "try_again_ms", 0, 3_600_000);
    check.integer("", table, "bump_after_ledgers", 0, 1000);
    match table.get("args") {
        None => {}
        Some(Value::Array(args)) => {
            for (i, arg) in args.iter().enumerate() {
                argument(&mut check, &format!("args[{i}]"), arg);
            }
        }
        Some(other) => check.problem("args", format!("expected an array of arguments, got {other}")),
    }
    if check.is_clean() {
        // Whatever the checks above missed, the executor's own parse sees.
        if let Err(e) = Settings::parse(config) {
            check.problem("", e);
        }
    }
    check.finish()
}

fn argument(check: &mut ConfigCheck, path: &str, arg: &Value) {
    let Some(table) = check.table(path, arg, &ARG_KEYS) else {
        return;
    };
    let ty = match table.get("type") {
        Some(Value::String(t)) if ARG_TYPES.contains(&t.as_str()) => {
            serde_json::from_value::<ArgType>(Value::String(t.clone())).ok()
        }
        Some(other) => {
            check.problem(
                join(path, "type"),
                format!("expected one of {}, got {other}", ARG_TYPES.join(", ")),
            );
            None
        }
        None => {
            check.problem(
                join(path, "type"),
                format!("missing (expected one of {})", ARG_TYPES.join(", ")),
            );
            None
        }
    };
    match (table.get("field"), table.get("value")) {
        (Some(_), Some(_)) | (None, None) => check.problem(path, "give exactly one of `field` or `value`"),
        (Some(field), None) => {
            if field.as_str().is_none_or(str::is_empty) {
                check.problem(
                    join(path, "field"),
                    format!("expected a payload field name, got {field}"),
                );
            }
        }
        (None, Some(value)) => {
            if let Some(ty) = ty {
                if let Err(e) = crate::settings::to_scval(ty, value) {
                    check.problem(join(path, "value"), e);
                }
            }
        }
    }
}
