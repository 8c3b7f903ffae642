//! The kind's `config` table: where the vault is, which function a kind
//! calls and how its arguments come from the payload, which host key signs,
//! and the submission tunables.

use serde::Deserialize;
use serde_json::Value;
use stellar_xdr::{Int128Parts, ScAddress, ScSymbol, ScVal, StringM};

/// Longest time bound laneway puts on a transaction (seconds), so a lost
/// transaction is provably dead soon.
pub const MAX_VALID_SECONDS: u64 = 300;

/// One contract argument.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Arg {
    /// The payload field it comes from.
    #[serde(default)]
    pub field: Option<String>,
    /// A constant, when it does not come from the payload.
    #[serde(default)]
    pub value: Option<Value>,
    /// Its Soroban type.
    #[serde(rename = "type")]
    pub ty: ArgType,
}

/// The Soroban types a payload value can become.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ArgType {
    /// A `G…` account or `C…` contract address.
    Address,
    /// A signed 128-bit integer (string or number in the payload).
    I128,
    I64,
    U64,
    U32,
    Bool,
    Symbol,
    String,
}

/// The kind's settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Stellar RPC endpoint (JSON-RPC 2.0).
    pub rpc_url: String,
    /// The network's passphrase: it is hashed into every signature.
    pub network_passphrase: String,
    /// The vault contract (`C…`).
    pub contract_id: String,
    /// The contract function this kind calls.
    pub function: String,
    /// The host key (ed25519) that signs; its account is the source and the lane.
    pub signer_key: String,
    /// The function's arguments, in order.
    #[serde(default)]
    pub args: Vec<Arg>,
    /// The transaction's time bound, from now (at most 300 s).
    #[serde(default = "default_valid_seconds")]
    pub valid_seconds: u64,
    /// Ledgers after the current one the transaction may land in.
    #[serde(default = "default_ledger_window")]
    pub ledger_window: u32,
    /// The longest pause between two `getTransaction` polls. Within it the
    /// vault polls at the ledger's expected close (`cadence`).
    #[serde(default = "default_poll_ms")]
    pub poll_ms: u64,
    /// Inclusion fee when the host quotes none (no fee oracle).
    #[serde(default = "default_base_fee")]
    pub default_base_fee: u64,
    /// Pause asked for after `TRY_AGAIN_LATER`.
    #[serde(default = "default_try_again_ms")]
    pub try_again_ms: u64,
    /// A Horizon-compatible history source, consulted when a transaction is
    /// older than the RPC's retention (or the RPC contradicts the signer's
    /// sequence), before an op is called outcome unknown.
    #[serde(default)]
    pub history_url: Option<String>,
    /// Ledgers a sent transaction may stay unincluded before it is
    /// fee-bumped at the next attempt's bid (0: never; only kinds priced by
    /// a fee oracle are bumped).
    #[serde(default = "default_bump_after_ledgers")]
    pub bump_after_ledgers: u32,
    /// Contracts (`C…`) besides `contract_id` whose calls, made by the
    /// kind's own call, the signer may authorise (a vault paying through a
    /// token contract). Any other authorisation a simulation asks for is
    /// refused, never signed.
    #[serde(default)]
    pub auth_contracts: Vec<String>,
    /// The kind's channel-account pool, as the host resolved it (`[pools]`
    /// and the kind's `pool`): never written by hand.
    #[serde(default)]
    pub pool: Option<Pool>,
}

/// A channel-account pool, from the host.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pool {
    /// `[pools.NAME]`.
    pub name: String,
    /// Each channel's `G…` account and its host key id.
    pub channels: std::collections::BTreeMap<String, String>,
    /// Who pays a channel's transactions' fees.
    #[serde(default)]
    pub fee_payer: FeePayer,
}

/// `[pools.NAME] fee_payer`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FeePayer {
    /// The channel, its transaction's source.
    #[default]
    Channel,
    /// The kind's signer, as the fee source of a fee bump around every
    /// transaction from a channel.
    Signer,
}

fn default_bump_after_ledgers() -> u32 {
    3
}

fn default_valid_seconds() -> u64 {
    MAX_VALID_SECONDS
}

fn default_ledger_window() -> u32 {
    10
}

fn default_poll_ms() -> u64 {
    1_000
}

fn default_base_fee() -> u64 {
    100
}

fn default_try_again_ms() -> u64 {
    5_000
}

impl Settings {
    /// Parses and checks the kind's config.
    pub fn parse(json: &str) -> Result<Self, String> {
        let settings: Settings = serde_json::from_str(json).map_err(|e| format!("kind config: {e}"))?;
        let mut problems = Vec::new();
        if settings.valid_seconds == 0 || settings.valid_seconds > MAX_VALID_SECONDS {
            problems.push(format!("valid_seconds: expected 1..={MAX_VALID_SECONDS}"));
        }
        if settings.ledger_window == 0 {
            problems.push("ledger_window: expected at least 1".to_owned());
        }
        if settings.contract_id.parse::<ScAddress>().is_err() {
            problems.push(format!(
                "contract_id: {:?} is not a contract address",
                settings.contract_id
            ));
        }
        if ScSymbol::try_from(settings.function.as_str()).is_err() {
            problems.push(format!("function: {:?} is not a Soroban symbol", settings.function));
        }
        for (i, contract) in settings.auth_contracts.iter().enumerate() {
            if !(contract.starts_with('C') && contract.parse::<ScAddress>().is_ok()) {
                problems.push(format!("auth_contracts[{i}]: {contract:?} is not a contract address"));
            }
        }
        for (i, arg) in settings.args.iter().enumerate() {
            if arg.field.is_some() == arg.value.is_some() {
                problems.push(format!("args[{i}]: give exactly one of `field` or `value`"));
            }
        }
        if problems.is_empty() {
            Ok(settings)
        } else {
            Err(format!("kind config: {}", problems.join("; ")))
        }
    }

    /// The contract arguments for one payload.
    pub fn arguments(&self, payload: &Value) -> Result<Vec<ScVal>, String> {
        self.args
            .iter()
            .map(|arg| {
                let (name, value) = match (&arg.field, &arg.value) {
                    (Some(field), _) => (
                        field.as_str(),
                        payload
                            .get(field)
                            .ok_or_else(|| format!("payload has no field {field:?}"))?,
                    ),
                    (None, Some(value)) => ("constant", value),
                    (None, None) => return Err("an argument has neither field nor value".to_owned()),
                };
                to_scval(arg.ty, value).map_err(|e| format!("{name}: {e}"))
            })
            .collect()
    }
}

fn integer(value: &Value) -> Result<i128, String> {
    match value {
        Value::String(s) => s.parse::<i128>().map_err(|_| format!("{s:?} is not an integer")),
        Value::Number(n) => n
            .as_i64()
            .map(i128::from)
            .or_else(|| n.as_u64().map(i128::from))
            .ok_or_else(|| format!("{n} is not an integer")),
        other => Err(format!("expected an integer, got {other}")),
    }
}

pub fn to_scval(ty: ArgType, value: &Value) -> Result<ScVal, String> {
    let text = || value.as_str().ok_or_else(|| format!("expected a string, got {value}"));
    Ok(match ty {
        ArgType::Address => ScVal::Address(
            text()?
                .parse::<ScAddress>()
                .map_err(|_| format!("{value} is not a Stellar address"))?,
        ),
        ArgType::I128 => {
            let v = integer(value)?;
            ScVal::I128(Int128Parts {
                hi: (v >> 64) as i64,
                lo: v as u64,
            })
        }
        ArgType::I64 => ScVal::I64(i64::try_from(integer(value)?).map_err(|_| "out of range for i64")?),
        ArgType::U64 => ScVal::U64(u64::try_from(integer(value)?).map_err(|_| "out of range for u64")?),
        ArgType::U32 => ScVal::U32(u32::try_from(integer(value)?).map_err(|_| "out of range for u32")?),
        ArgType::Bool => ScVal::Bool(
            value
                .as_bool()
                .ok_or_else(|| format!("expected a boolean, got {value}"))?,
        ),
        ArgType::Symbol => ScVal::Symbol(ScSymbol::try_from(text()?).map_err(|_| "not a Soroban symbol")?),
        ArgType::String => ScVal::String(StringM::try_from(text()?).map_err(|_| "string too long")?.into()),
    })
}
