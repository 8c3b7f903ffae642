//! Checking a kind's `config` (JSON) for `validate-config`: every problem is
//! collected with its key path, so an operator sees them all at once.

use serde_json::{Map, Value};

use crate::Problem;

/// Collects the problems of one kind's config.
#[derive(Debug, Default)]
pub struct ConfigCheck {
    problems: Vec<Problem>,
}

/// `parent.key`, or `key` at the top.
pub fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_owned()
    } else {
        format!("{parent}.{key}")
    }
}

impl ConfigCheck {
    /// A fresh check.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a problem at `path`.
    pub fn problem(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.problems.push(crate::problem(path, message));
    }

    /// Whether anything was found so far.
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }

    /// The value at `path` as a table whose keys are all in `known` (each
    /// other key is a problem of its own).
    pub fn table<'a>(&mut self, path: &str, value: &'a Value, known: &[&str]) -> Option<&'a Map<String, Value>> {
        let Some(table) = value.as_object() else {
            self.problem(path, format!("expected a table, got {value}"));
            return None;
        };
        for key in table.keys().filter(|k| !known.contains(&k.as_str())) {
            self.problem(
                join(path, key),
                format!("unknown key (expected one of: {})", known.join(", ")),
            );
        }
        Some(table)
    }

    /// A string at `table.key`; a missing one is a problem when `required`.
    pub fn string<'a>(
        &mut self,
        path: &str,
        table: &'a Map<String, Value>,
        key: &str,
        required: bool,
    ) -> Option<&'a str> {
        match table.get(key) {
            None if required => {
                self.problem(join(path, key), "missing (expected a string)");
                None
            }
            None => None,
            Some(Value::String(s)) if s.trim().is_empty() => {
                self.problem(join(path, key), "must not be empty");
                None
            }
            Some(Value::String(s)) => Some(s),
            Some(other) => {
                self.problem(join(path, key), format!("expected a string, got {other}"));
                None
            }
        }
    }

    /// An integer in `min..=max` at `table.key`, if present.
    pub fn integer(&mut self, path: &str, table: &Map<String, Value>, key: &str, min: u64, max: u64) -> Option<u64> {
        let value = table.get(key)?;
        match value.as_u64() {
            Some(n) if (min..=max).contains(&n) => Some(n),
            _ => {
                self.problem(
                    join(path, key),
                    format!("expected an integer from {min} to {max}, got {value}"),
                );
                None
            }
        }
    }

    /// The problems, or `Ok` when there are none.
    pub fn finish(self) -> Result<(), Vec<Problem>> {
        if self.problems.is_empty() {
            Ok(())
        } else {
            Err(self.problems)
        }
    }
}

/// Parses the config JSON the host hands over.
pub fn parse(config: &str) -> Result<Value, Vec<Problem>> {
    serde_json::from_str(config).map_err(|e| vec![crate::problem("", format!("not valid JSON: {e}"))])
}

/// Asks the host for a key's public half: a key that is not granted to the
/// plugin, not loaded, or of another algorithm is a problem at `path`.
/// Returns the public key (32 bytes for ed25519, PKCS#1 DER for RSA).
pub fn key(check: &mut ConfigCheck, path: &str, key_id: &str, algorithm: crate::signer::Algorithm) -> Option<Vec<u8>> {
    use crate::signer::{self, Algorithm, Error};
    match signer::public_key(key_id) {
        Ok(public) => {
            let is_ed25519 = public.len() == 32;
            let fits = match algorithm {
                Algorithm::Ed25519 => is_ed25519,
                Algorithm::RsaSha256 => !is_ed25519,
            };
            if !fits {
                let want = match algorithm {
                    Algorithm::Ed25519 => "ed25519",
                    Algorithm::RsaSha256 => "rsa-sha256",
                };
                check.problem(path, format!("key {key_id:?} is not a {want} key"));
                return None;
            }
            Some(public)
        }
        Err(Error::Denied(_)) => {
            check.problem(
                path,
                format!("key {key_id:?} is not granted to this plugin (add it to the plugin's `keys`)"),
            );
            None
        }
        Err(Error::UnknownKey(_)) => {
            check.problem(path, format!("no key {key_id:?} is loaded (configure [keys.{key_id}])"));
            None
        }
        Err(Error::WrongAlgorithm(why) | Error::Failed(why)) => {
            check.problem(path, format!("key {key_id:?}: {why}"));
            None
        }
    }
}

/// Asks the host whether the plugin may reach `url`: one outside its
/// `allowed_hosts` (or an internal address outside `allowed_internal`) is a
/// problem at `path`.
pub fn reachable(check: &mut ConfigCheck, path: &str, url: &str) {
    use crate::http::{self, Error};
    match http::allowed(url) {
        Ok(()) => {}
        Err(Error::Denied(why)) => check.problem(
            path,
            format!("{url} cannot be reached: {why} (list it in the plugin's allowed_hosts, and an internal address in allowed_internal)"),
        ),
        Err(e) => check.problem(path, format!("{url} is not a usable URL: {e:?}")),
    }
}
