//! `http`: outbound requests through the host, checked against the
//! plugin's allow-list before sending and against internal networks after
//! name resolution (`GuardedResolver`), size-capped, with the host's
//! timeouts and connection limits.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use super::super::bindings::executor::laneway::plugin::http;
use super::super::state::HostState;
use crate::egress::Egress;

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
