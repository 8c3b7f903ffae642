//! `http`: outbound requests through the host, on the plugin's guarded
//! client (`egress`: the allow-list and IP literals before sending, resolved
//! addresses at connect), size-capped, with the host's timeouts and
//! connection limits.

use super::super::bindings::executor::laneway::plugin::http;
use super::super::state::HostState;
use crate::egress::Refusal;

impl HostState {
    /// Checks a URL against the plugin's egress policy (scheme, allow-list,
    /// IP literals in any spelling); names are judged again on what they
    /// resolve to, at connect. A refusal is not recorded as a denial here:
    /// the caller decides whether it was an attempt to reach it.
    fn check_url(&self, raw: &str) -> Result<reqwest::Url, UrlRefusal> {
        self.services.http.policy().check(raw).map_err(|refusal| match refusal {
            Refusal::Malformed(why) => UrlRefusal::Malformed(format!("bad url {raw:?}: {why}")),
            other => UrlRefusal::Denied(other.to_string()),
        })
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
        let mut builder = match services.http.request(method, url.as_str()) {
            Ok(builder) => builder,
            Err(refusal) => return Ok(Err(http::Error::Denied(self.deny(refusal.to_string())))),
        };
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

fn classify_http_error(error: &reqwest::Error) -> http::Error {
    if let Some(refusal) = crate::egress::client::refusal(error) {
        return http::Error::Denied(refusal.to_string());
    }
    let chain = crate::egress::client::chain(error).to_ascii_lowercase();
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
