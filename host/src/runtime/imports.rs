//! The host side of the plugin imports: `http`, `signer`, `log`,
//! `checkpoint`, `fees`, `notes` and `mac`. Each enforces the plugin's grants before doing
//! anything.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use super::bindings::executor::laneway::plugin::{checkpoint, fees, http, log, mac, notes, signer, types};
use super::state::HostState;
use crate::egress::Egress;
use crate::executor::CheckpointError;
use crate::keys::{Algorithm, SignError};

/// Longest log message kept.
const LOG_MESSAGE_BYTES: usize = 1024;
/// Most fields per log line, and longest field value.
const LOG_FIELDS: usize = 16;
const LOG_FIELD_BYTES: usize = 256;

fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

impl types::Host for HostState {}

impl HostState {
    /// Checks a URL against the plugin's grants (scheme, allow-list, literal
    /// internal addresses); names are checked again after resolution by
    /// [`GuardedResolver`]. A refusal is not recorded as a denial here: the
    /// caller decides whether it was an attempt to reach it.
    fn check_url(&self, raw: &str) -> Result<reqwest::Url, UrlRefusal> {
        let url = reqwest::Url::parse(raw).map_err(|e| UrlRefusal::Malformed(format!("bad url {raw:?}: {e}")))?;
        let scheme = url.scheme().to_owned();
        let (Some(host), Some(port)) = (url.host_str().map(str::to_owned), url.port_or_known_default()) else {
            return Err(UrlRefusal::Malformed(format!("url {raw:?} has no host")));
        };
        if !(scheme == "http" || scheme == "https") {
            return Err(UrlRefusal::Denied(format!("scheme {scheme} is not allowed")));
        }
        let egress = &self.services.egress;
        if !egress.allows_destination(&scheme, &host, port) {
            return Err(UrlRefusal::Denied(format!(
                "{scheme}://{host}:{port} is not in allowed_hosts"
            )));
        }
        // A literal address never reaches the resolver: check it here.
        if let Ok(ip) = host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
            if !egress.allows_address(ip) {
                return Err(UrlRefusal::Denied(format!(
                    "{ip} is an internal address and not in allowed_internal"
                )));
            }
        }
        Ok(url)
    }
}

/// Why a URL may not be reached.
enum UrlRefusal {
    /// It does not parse or has no host.
    Malformed(String),
    /// The grants forbid it.
    Denied(String),
}

impl http::Host for HostState {
    async fn allowed(&mut self, url: String) -> wasmtime::Result<Result<(), http::Error>> {
        Ok(match self.check_url(&url) {
            Ok(_) => Ok(()),
            Err(UrlRefusal::Malformed(why)) => Err(http::Error::Protocol(why)),
            Err(UrlRefusal::Denied(why)) => Err(http::Error::Denied(why)),
        })
    }

    async fn send(&mut self, request: http::Request) -> wasmtime::Result<Result<http::Response, http::Error>> {
        let services = self.services.clone();
        let url = match self.check_url(&request.url) {
            Ok(url) => url,
            Err(UrlRefusal::Malformed(why)) => return Ok(Err(http::Error::Protocol(why))),
            Err(UrlRefusal::Denied(why)) => return Ok(Err(http::Error::Denied(self.deny(why)))),
        };
        let Ok(permit) =
            tokio::time::timeout(services.connect_timeout, services.http_permits.clone().acquire_owned()).await
        else {
            return Ok(Err(http::Error::Connect(
                "the plugin's connection limit is reached".into(),
            )));
        };
        let Ok(method) = reqwest::Method::from_bytes(request.method.as_bytes()) else {
            return Ok(Err(http::Error::Protocol(format!("bad method {:?}", request.method))));
        };
        let mut builder = services.http.request(method, url);
        for (name, value) in &request.headers {
            builder = builder.header(name.as_str(), value.as_str());
        }
        let result = builder.body(request.body).send().await;
        let response = match result {
            Ok(response) => response,
            Err(e) => {
                let error = classify_http_error(&e);
                if let http::Error::Denied(what) = &error {
                    self.deny(what.clone());
                }
                return Ok(Err(error));
            }
        };
        let status = response.status().as_u16();
        let headers = response
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let cap = services.max_response_bytes;
        let mut body = Vec::new();
        let mut response = response;
        let mut headers: Vec<(String, String)> = headers;
        loop {
            match response.chunk().await {
                Ok(Some(bytes)) => {
                    if body.len() as u64 + bytes.len() as u64 > cap {
                        // A success is a success whatever it says: the
                        // plugin gets the status and the first `cap` bytes,
                        // marked; anything else over the cap is an error.
                        if !(200..300).contains(&status) {
                            return Ok(Err(http::Error::TooLarge(cap)));
                        }
                        let room = usize::try_from(cap).unwrap_or(usize::MAX).saturating_sub(body.len());
                        body.extend_from_slice(&bytes[..room.min(bytes.len())]);
                        headers.push(("x-laneway-body-truncated".to_owned(), cap.to_string()));
                        break;
                    }
                    body.extend_from_slice(&bytes);
                }
                Ok(None) => break,
                Err(e) => return Ok(Err(classify_http_error(&e))),
            }
        }
        drop(permit);
        Ok(Ok(http::Response { status, headers, body }))
    }
}

/// A resolved name that led only to addresses the plugin may not reach.
#[derive(Debug, thiserror::Error)]
#[error("{name} resolves only to internal addresses ({addresses}), which are not in allowed_internal")]
pub struct BlockedAddress {
    name: String,
    addresses: String,
}

fn classify_http_error(error: &reqwest::Error) -> http::Error {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if let Some(blocked) = e.downcast_ref::<BlockedAddress>() {
            return http::Error::Denied(blocked.to_string());
        }
        source = e.source();
    }
    let text = format!("{error:#}");
    let chain = {
        let mut all = text.clone();
        let mut s = std::error::Error::source(error);
        while let Some(e) = s {
            all.push_str(": ");
            all.push_str(&e.to_string());
            s = e.source();
        }
        all.to_ascii_lowercase()
    };
    if error.is_timeout() {
        http::Error::Timeout
    } else if chain.contains("dns") || chain.contains("failed to lookup") || chain.contains("name or service") {
        http::Error::Dns(chain)
    } else if chain.contains("certificate") || chain.contains("tls") || chain.contains("handshake") {
        http::Error::Tls(chain)
    } else if error.is_connect() {
        http::Error::Connect(chain)
    } else {
        http::Error::Protocol(chain)
    }
}

/// Resolves names for one plugin's HTTP client and drops addresses its
/// egress policy forbids, so a name pointing at 127.0.0.1 or the metadata
/// service is refused after resolution, where it counts.
pub struct GuardedResolver {
    egress: Arc<Egress>,
}

impl GuardedResolver {
    /// A resolver enforcing `egress`.
    pub fn new(egress: Arc<Egress>) -> Self {
        Self { egress }
    }
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let egress = self.egress.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let found: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let allowed: Vec<SocketAddr> = found
                .iter()
                .copied()
                .filter(|a| egress.allows_address(a.ip()))
                .collect();
            if allowed.is_empty() && !found.is_empty() {
                let addresses = found.iter().map(|a| a.ip().to_string()).collect::<Vec<_>>().join(", ");
                return Err(
                    Box::new(BlockedAddress { name: host, addresses }) as Box<dyn std::error::Error + Send + Sync>
                );
            }
            Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

impl signer::Host for HostState {
    async fn sign(
        &mut self,
        key_id: String,
        algorithm: signer::Algorithm,
        data: Vec<u8>,
    ) -> wasmtime::Result<Result<Vec<u8>, signer::Error>> {
        if !self.services.granted_keys.contains(&key_id) {
            return Ok(Err(signer::Error::Denied(
                self.deny(format!("key {key_id:?} is not granted to this plugin")),
            )));
        }
        let algorithm = match algorithm {
            signer::Algorithm::Ed25519 => Algorithm::Ed25519,
            signer::Algorithm::RsaSha256 => Algorithm::RsaSha256,
        };
        Ok(self.services.keys.sign(&key_id, algorithm, &data).map_err(sign_error))
    }

    async fn public_key(&mut self, key_id: String) -> wasmtime::Result<Result<Vec<u8>, signer::Error>> {
        if !self.services.granted_keys.contains(&key_id) {
            return Ok(Err(signer::Error::Denied(
                self.deny(format!("key {key_id:?} is not granted to this plugin")),
            )));
        }
        Ok(self.services.keys.public_key(&key_id).map_err(sign_error))
    }
}

fn sign_error(e: SignError) -> signer::Error {
    match e {
        SignError::UnknownKey(k) => signer::Error::UnknownKey(k),
        e @ SignError::WrongAlgorithm { .. } => signer::Error::WrongAlgorithm(e.to_string()),
        SignError::Failed(s) => signer::Error::Failed(s),
    }
}

/// Longest note key and value, and most notes written per call: notes are
/// small facts about a server, not storage.
const NOTE_KEY_BYTES: usize = 128;
const NOTE_VALUE_BYTES: usize = 4096;
const NOTE_HOST_BYTES: usize = 300;
const NOTES_PER_CALL: u32 = 8;

impl notes::Host for HostState {
    async fn get(&mut self, host: String, key: String) -> wasmtime::Result<Option<String>> {
        let Some(notes) = self.notes.clone() else {
            return Ok(None);
        };
        match notes.get(&self.services.plugin, &host, &key).await {
            Ok(value) => Ok(value),
            Err(e) => {
                // A note is a hint: without it the plugin does what it does
                // on first contact.
                tracing::warn!(plugin = %self.services.plugin, error = %e, "Could not read a plugin note.");
                Ok(None)
            }
        }
    }

    async fn set(&mut self, host: String, key: String, value: String) -> wasmtime::Result<Result<(), String>> {
        let Some(notes) = self.notes.clone() else {
            return Ok(Err("notes are kept only while an op is executed".into()));
        };
        if host.is_empty() || host.len() > NOTE_HOST_BYTES || key.is_empty() || key.len() > NOTE_KEY_BYTES {
            return Ok(Err(format!(
                "a note needs a host of 1 to {NOTE_HOST_BYTES} bytes and a key of 1 to {NOTE_KEY_BYTES} bytes"
            )));
        }
        if value.len() > NOTE_VALUE_BYTES {
            return Ok(Err(format!("a note's value is at most {NOTE_VALUE_BYTES} bytes")));
        }
        if self.notes_written >= NOTES_PER_CALL {
            return Ok(Err(format!("at most {NOTES_PER_CALL} notes are written per call")));
        }
        self.notes_written += 1;
        Ok(notes
            .set(&self.services.plugin, &host, &key, &value)
            .await
            .map_err(|e| e.to_string()))
    }
}

impl mac::Host for HostState {
    async fn hmac_sha256(&mut self, key_id: String, data: Vec<u8>) -> wasmtime::Result<Result<Vec<u8>, signer::Error>> {
        if !self.services.granted_keys.contains(&key_id) {
            return Ok(Err(signer::Error::Denied(
                self.deny(format!("key {key_id:?} is not granted to this plugin")),
            )));
        }
        Ok(self
            .services
            .keys
            .sign(&key_id, Algorithm::HmacSha256, &data)
            .map_err(sign_error))
    }
}

impl log::Host for HostState {
    async fn log(&mut self, level: log::Level, message: String, fields: Vec<(String, String)>) -> wasmtime::Result<()> {
        self.log_lines += 1;
        let limit = self.services.log_lines_per_call;
        if self.log_lines > limit {
            if self.log_lines == limit + 1 {
                tracing::warn!(plugin = %self.services.plugin, op = ?self.op_id, "Plugin log limit reached; further lines of this call are dropped.");
            }
            return Ok(());
        }
        let message = cut(&message, LOG_MESSAGE_BYTES);
        let fields: Vec<String> = fields
            .iter()
            .take(LOG_FIELDS)
            .map(|(k, v)| format!("{}={}", cut(k, 64), cut(v, LOG_FIELD_BYTES)))
            .collect();
        let fields = fields.join(" ");
        let plugin = self.services.plugin.as_str();
        let op = self.op_id;
        match level {
            log::Level::Trace => tracing::trace!(target: "laneway::plugin", plugin, op, fields, "{message}"),
            log::Level::Debug => tracing::debug!(target: "laneway::plugin", plugin, op, fields, "{message}"),
            log::Level::Info => tracing::info!(target: "laneway::plugin", plugin, op, fields, "{message}"),
            log::Level::Warn => tracing::warn!(target: "laneway::plugin", plugin, op, fields, "{message}"),
            log::Level::Error => tracing::error!(target: "laneway::plugin", plugin, op, fields, "{message}"),
        }
        Ok(())
    }
}

impl checkpoint::Host for HostState {
    async fn save(&mut self, receipt: String) -> wasmtime::Result<Result<(), checkpoint::Error>> {
        let Some(target) = self.checkpoint.clone() else {
            return Ok(Err(checkpoint::Error::Failed("no op is being executed".into())));
        };
        Ok(match target.checkpoint(&receipt).await {
            Ok(()) => Ok(()),
            Err(CheckpointError::LeaseLost) => Err(checkpoint::Error::LeaseLost),
            Err(CheckpointError::Queue(e)) => Err(checkpoint::Error::Failed(e.to_string())),
        })
    }
}

impl fees::Host for HostState {
    async fn current(&mut self) -> wasmtime::Result<Option<fees::Bid>> {
        Ok(self.fee.map(|b| fees::Bid {
            base_fee: b.base_fee,
            aggressive: b.aggressive,
            capped: b.capped,
        }))
    }

    async fn spent(&mut self, base_fee: u64) -> wasmtime::Result<()> {
        if let Some(spent) = &self.spent {
            spent.report(base_fee);
        }
        Ok(())
    }
}
