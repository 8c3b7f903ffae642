//! Loading a configuration: the embedded defaults, then the file, then
//! `LANEWAY_*` variables, merged as TOML tables and read section by
//! section, so every problem of every section is reported at once with its
//! key path; then `validate` checks what parses but makes no sense.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::de::DeserializeOwned;

use super::validate::validate;
use super::*;

/// The process environment as UTF-8 pairs, for `LANEWAY_*` config keys.
/// Variables that are not UTF-8 cannot be config keys and are skipped.
pub fn process_env() -> Vec<(String, String)> {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect()
}

/// Where the config file comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileSource {
    /// Named explicitly: it must exist.
    Explicit(PathBuf),
    /// The default path: used if it exists.
    Default(PathBuf),
}

impl FileSource {
    /// The default config file, `./laneway.toml`.
    pub fn default_path() -> Self {
        FileSource::Default(PathBuf::from("laneway.toml"))
    }
}

/// Loads and validates the configuration from all three layers.
///
/// # Errors
///
/// [`ConfigError::Invalid`] with every problem found.
pub fn load(file: &FileSource, env: impl IntoIterator<Item = (String, String)>) -> Result<Config, ConfigError> {
    let mut problems = Vec::new();
    let mut merged = parse_table(DEFAULTS, "built-in defaults", &mut problems);

    let file_text = match file {
        FileSource::Explicit(path) => match std::fs::read_to_string(path) {
            Ok(text) => Some((text, path.clone())),
            Err(e) => {
                problems.push(Problem {
                    path: path.display().to_string(),
                    message: format!("cannot read config file: {e}"),
                });
                None
            }
        },
        FileSource::Default(path) => std::fs::read_to_string(path).ok().map(|t| (t, path.clone())),
    };
    if let Some((text, path)) = file_text {
        let table = parse_table(&text, &path.display().to_string(), &mut problems);
        merge(&mut merged, table);
    }
    let env: Vec<(String, String)> = env.into_iter().collect();
    merge(&mut merged, env_table(env.clone(), &mut problems));

    if !problems.is_empty() {
        return Err(ConfigError::Invalid(problems));
    }
    from_table(merged).map_err(|e| name_env_vars(e, &env))
}

/// A problem with a key an environment variable set names the variable, so
/// a stray or misspelt `LANEWAY_*` is found by its own name.
fn name_env_vars(error: ConfigError, env: &[(String, String)]) -> ConfigError {
    let ConfigError::Invalid(problems) = error;
    let from_env: Vec<(String, &str)> = env
        .iter()
        .filter_map(|(name, _)| {
            let rest = env_key_path(name)?;
            let path: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
            Some((path.join("."), name.as_str()))
        })
        .collect();
    let problems = problems
        .into_iter()
        .map(|mut p| {
            if let Some((_, name)) = from_env.iter().find(|(path, _)| *path == p.path) {
                p.message = format!("{} (set by the environment variable {name})", p.message);
            }
            p
        })
        .collect();
    ConfigError::Invalid(problems)
}

/// Loads only the defaults plus a TOML string (tests, examples).
///
/// # Errors
///
/// [`ConfigError::Invalid`] with every problem found.
pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
    from_layers(&[text])
}

/// Loads the defaults with TOML layers on top, later layers winning.
///
/// # Errors
///
/// [`ConfigError::Invalid`] with every problem found.
pub fn from_layers(layers: &[&str]) -> Result<Config, ConfigError> {
    let mut problems = Vec::new();
    let mut merged = parse_table(DEFAULTS, "built-in defaults", &mut problems);
    for (i, text) in layers.iter().enumerate() {
        let table = parse_table(text, &format!("config layer {}", i + 1), &mut problems);
        merge(&mut merged, table);
    }
    if !problems.is_empty() {
        return Err(ConfigError::Invalid(problems));
    }
    from_table(merged)
}

fn parse_table(text: &str, origin: &str, problems: &mut Vec<Problem>) -> toml::Table {
    match text.parse::<toml::Table>() {
        Ok(t) => t,
        Err(e) => {
            problems.push(Problem {
                path: origin.to_owned(),
                message: format!("not valid TOML: {}", e.message()),
            });
            toml::Table::new()
        }
    }
}

/// The config key path a variable names: `LANEWAY_SECTION__KEY` shapes only.
/// An operator's own `LANEWAY_BIN` or `LANEWAY_PLUGINS` (no `__`) is not
/// config, so it cannot break a start; [`env_lookalikes`] names the ones
/// that look like a misspelt key.
fn env_key_path(name: &str) -> Option<&str> {
    let rest = name.strip_prefix(ENV_PREFIX)?;
    (!ENV_RESERVED.contains(&name) && rest.contains("__")).then_some(rest)
}

/// A `LANEWAY_*` variable that is not read as config but looks like a key
/// spelt with one underscore where two belong.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct EnvLookalike {
    /// The variable as set.
    pub name: String,
    /// The variable that would set the key it seems to mean.
    pub did_you_mean: String,
}

/// The `LANEWAY_*` variables ignored as config whose name starts with a
/// section (`LANEWAY_DATABASE_URL` → `LANEWAY_DATABASE__URL`), for
/// `check-config` and the start-up log to name.
pub fn env_lookalikes(env: &[(String, String)]) -> Vec<EnvLookalike> {
    env.iter()
        .filter(|(name, _)| !ENV_RESERVED.contains(&name.as_str()) && !name.contains("__"))
        .filter_map(|(name, _)| {
            let rest = name.strip_prefix(ENV_PREFIX)?.to_ascii_lowercase();
            let section = SECTIONS.iter().find(|s| rest.starts_with(&format!("{s}_")))?;
            let key = &name[ENV_PREFIX.len() + section.len() + 1..];
            Some(EnvLookalike {
                name: name.clone(),
                did_you_mean: format!("{ENV_PREFIX}{}__{key}", section.to_ascii_uppercase()),
            })
        })
        .collect()
}

/// Turns `LANEWAY_A__B=value` into `{a = {b = value}}`. A value that parses as
/// a TOML value (number, boolean, array, quoted string) is taken as that;
/// anything else is a string.
fn env_table(env: impl IntoIterator<Item = (String, String)>, problems: &mut Vec<Problem>) -> toml::Table {
    let mut table = toml::Table::new();
    for (name, raw) in env {
        let Some(rest) = env_key_path(&name) else {
            continue;
        };
        let path: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
        if path.iter().any(String::is_empty) {
            problems.push(Problem {
                path: name.clone(),
                message: "environment variable does not name a key path (use LANEWAY_SECTION__KEY)".to_owned(),
            });
            continue;
        }
        let value = format!("v = {raw}")
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or(toml::Value::String(raw));
        if !insert_path(&mut table, &path, value) {
            problems.push(Problem {
                path: name.clone(),
                message: "sets a key inside a value that is not a table".to_owned(),
            });
        }
    }
    table
}

/// Sets `path` in `table`, creating intermediate tables; `false` when a
/// parent on the path is not a table.
fn insert_path(table: &mut toml::Table, path: &[String], value: toml::Value) -> bool {
    match path {
        [] => false,
        [last] => {
            table.insert(last.clone(), value);
            true
        }
        [first, rest @ ..] => match table
            .entry(first.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        {
            toml::Value::Table(inner) => insert_path(inner, rest, value),
            _ => false,
        },
    }
}

/// Deep-merges `over` into `base`; tables merge, anything else replaces.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(key, v);
            }
        }
    }
}

fn from_table(mut table: toml::Table) -> Result<Config, ConfigError> {
    let mut problems = Vec::new();
    let database = section::<DatabaseConfig>(&mut table, "database", &mut problems);
    let queue = section::<QueueConfig>(&mut table, "queue", &mut problems);
    let dispatch = section::<DispatchConfig>(&mut table, "dispatch", &mut problems);
    let runtime = section::<RuntimeConfig>(&mut table, "runtime", &mut problems);
    let api = section::<ApiConfig>(&mut table, "api", &mut problems);
    let retention = section::<RetentionConfig>(&mut table, "retention", &mut problems);
    let outcomes = section::<OutcomesConfig>(&mut table, "outcomes", &mut problems);
    let destinations = section::<DestinationsConfig>(&mut table, "destinations", &mut problems);
    let inbound = section::<InboundConfig>(&mut table, "inbound", &mut problems);
    let plugins = named_tables::<PluginConfig>(&mut table, "plugins", &mut problems);
    let keys = named_tables::<crate::keys::KeySource>(&mut table, "keys", &mut problems);
    let oracles = named_tables::<OracleConfig>(&mut table, "oracles", &mut problems);
    let pools = named_tables::<PoolConfig>(&mut table, "pools", &mut problems);
    let mut kinds = BTreeMap::new();
    match table.remove("kinds") {
        Some(toml::Value::Table(kind_tables)) => {
            for (name, value) in kind_tables {
                let path = format!("kinds.{name}");
                if let Some(kind) = typed::<KindConfig>(value, &path, &mut problems) {
                    kinds.insert(name, kind);
                }
            }
        }
        Some(_) => problems.push(Problem {
            path: "kinds".to_owned(),
            message: "expected a table of kinds".to_owned(),
        }),
        None => {}
    }
    for key in table.keys() {
        problems.push(Problem {
            path: key.clone(),
            message: format!("unknown key (expected one of: {})", SECTIONS.join(", ")),
        });
    }
    if let (
        Some(database),
        Some(queue),
        Some(dispatch),
        Some(runtime),
        Some(api),
        Some(retention),
        Some(outcomes),
        Some(destinations),
        Some(inbound),
    ) = (
        database,
        queue,
        dispatch,
        runtime,
        api,
        retention,
        outcomes,
        destinations,
        inbound,
    ) {
        let config = Config {
            database,
            queue,
            dispatch,
            runtime,
            api,
            retention,
            outcomes,
            destinations,
            inbound,
            plugins,
            keys,
            oracles,
            pools,
            kinds,
        };
        problems.extend(validate(&config));
        if problems.is_empty() {
            return Ok(config);
        }
    }
    problems.sort_by(|a, b| a.path.cmp(&b.path));
    Err(ConfigError::Invalid(problems))
}

/// A table of named sub-tables (`[plugins.NAME]`), each deserialized alone.
fn named_tables<T: DeserializeOwned>(
    table: &mut toml::Table,
    key: &str,
    problems: &mut Vec<Problem>,
) -> BTreeMap<String, T> {
    let mut out = BTreeMap::new();
    match table.remove(key) {
        Some(toml::Value::Table(entries)) => {
            for (name, value) in entries {
                if let Some(v) = typed::<T>(value, &format!("{key}.{name}"), problems) {
                    out.insert(name, v);
                }
            }
        }
        Some(_) => problems.push(Problem {
            path: key.to_owned(),
            message: format!("expected a table of {key}"),
        }),
        None => {}
    }
    out
}

fn section<T: DeserializeOwned>(table: &mut toml::Table, key: &str, problems: &mut Vec<Problem>) -> Option<T> {
    match table.remove(key) {
        Some(value) => typed(value, key, problems),
        None => {
            problems.push(Problem {
                path: key.to_owned(),
                message: "missing section".to_owned(),
            });
            None
        }
    }
}

/// Deserializes one value, recording a type error with its full path and
/// every unknown key beneath it (not only the first).
fn typed<T: DeserializeOwned>(value: toml::Value, prefix: &str, problems: &mut Vec<Problem>) -> Option<T> {
    let mut unknown = Vec::new();
    let result: Result<T, _> = {
        let mut record = |path: serde_ignored::Path<'_>| unknown.push(path.to_string());
        let de = serde_ignored::Deserializer::new(value, &mut record);
        serde_path_to_error::deserialize(de)
    };
    let join = |inner: &str| {
        if inner.is_empty() || inner == "." {
            prefix.to_owned()
        } else {
            format!("{prefix}.{inner}")
        }
    };
    for path in &unknown {
        problems.push(Problem {
            path: join(path),
            message: "unknown key".to_owned(),
        });
    }
    match result {
        Ok(v) => Some(v),
        Err(e) => {
            let path = join(&e.path().to_string());
            problems.push(Problem {
                path,
                message: e.into_inner().to_string(),
            });
            None
        }
    }
}
