//! The one HTTP client every outbound caller builds ([`Guarded`]): its URL
//! judged by the policy before sending and on every redirect hop, every
//! name's resolved addresses judged at connect by [`GuardedResolver`] (the
//! addresses judged are the ones connected to, so there is no DNS-rebinding
//! window), no proxy from the environment, and a refusal kept inside the
//! error so callers can say why.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::{Egress, Refusal};

/// How a client behaves besides its policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Connect time limit.
    pub connect_timeout: Duration,
    /// Whole-request time limit.
    pub timeout: Duration,
    /// Redirects followed (each hop judged again); 0 returns the 3xx.
    pub redirects: usize,
    /// Idle connections kept per host.
    pub max_idle_per_host: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            timeout: Duration::from_secs(10),
            redirects: 0,
            max_idle_per_host: 8,
        }
    }
}

/// An HTTP client bound to one egress policy.
#[derive(Debug, Clone)]
pub struct Guarded {
    http: reqwest::Client,
    policy: Arc<Egress>,
}

impl Guarded {
    /// A client for `policy`.
    ///
    /// # Errors
    ///
    /// The HTTP client could not be built (no TLS roots, say).
    pub fn new(policy: Egress, options: Options) -> Result<Self, String> {
        let policy = Arc::new(policy);
        let hops = policy.clone();
        let max = options.redirects;
        let redirect = if max == 0 {
            reqwest::redirect::Policy::none()
        } else {
            reqwest::redirect::Policy::custom(move |attempt| {
                if attempt.previous().len() > max {
                    return attempt.error(Refusal::TooManyRedirects(max));
                }
                match hops.check_url(attempt.url()) {
                    Ok(()) => attempt.follow(),
                    Err(refusal) => attempt.error(refusal),
                }
            })
        };
        let http = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(options.connect_timeout)
            .timeout(options.timeout)
            .pool_max_idle_per_host(options.max_idle_per_host)
            .redirect(redirect)
            .dns_resolver(Arc::new(GuardedResolver { policy: policy.clone() }))
            .user_agent(concat!("laneway/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("cannot build an HTTP client: {e}"))?;
        Ok(Self { http, policy })
    }

    /// The policy.
    pub fn policy(&self) -> &Egress {
        &self.policy
    }

    /// A request to `url`, judged first.
    ///
    /// # Errors
    ///
    /// The [`Refusal`].
    pub fn request(&self, method: reqwest::Method, url: &str) -> Result<reqwest::RequestBuilder, Refusal> {
        let url = self.policy.check(url)?;
        Ok(self.http.request(method, url))
    }
}

/// The guard's refusal inside a request error (a redirect hop or a resolved
/// address refused), if that is what failed.
pub fn refusal(error: &reqwest::Error) -> Option<Refusal> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if let Some(refusal) = e.downcast_ref::<Refusal>() {
            return Some(refusal.clone());
        }
        source = e.source();
    }
    None
}

/// A request error in full: the refusal when the guard refused, else the
/// whole source chain (reqwest's own text is only "error sending request").
pub fn describe(error: &reqwest::Error) -> String {
    match refusal(error) {
        Some(refusal) => format!("refused: {refusal}"),
        None => chain(error),
    }
}

/// The error and every source under it, joined by `: `.
pub fn chain(error: &reqwest::Error) -> String {
    let mut all = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(e) = source {
        all.push_str(": ");
        all.push_str(&e.to_string());
        source = e.source();
    }
    all
}

/// Why a capped body read failed.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The body is larger than the cap (by its Content-Length, or as read).
    #[error("the body is over {0} bytes")]
    TooLarge(usize),
    /// The transfer failed.
    #[error("{0}")]
    Transfer(String),
}

/// Reads a response body, never holding more than `cap` bytes: a declared
/// length over the cap is refused before reading, and the read stops as
/// soon as the cap is passed.
///
/// # Errors
///
/// [`ReadError`].
pub async fn read_capped(mut response: reqwest::Response, cap: usize) -> Result<Vec<u8>, ReadError> {
    if response
        .content_length()
        .is_some_and(|n| n > u64::try_from(cap).unwrap_or(u64::MAX))
    {
        return Err(ReadError::TooLarge(cap));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| ReadError::Transfer(describe(&e)))? {
        if body.len() + chunk.len() > cap {
            return Err(ReadError::TooLarge(cap));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Resolves names for one client and drops the addresses its policy
/// forbids, so a name pointing at 127.0.0.1 or the metadata service is
/// refused after resolution, where it counts.
struct GuardedResolver {
    policy: Arc<Egress>,
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.policy.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let found: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let allowed: Vec<SocketAddr> = found
                .iter()
                .copied()
                .filter(|a| policy.allows_address(a.ip()))
                .collect();
            if allowed.is_empty() && !found.is_empty() {
                let addresses = found.iter().map(|a| a.ip().to_string()).collect::<Vec<_>>().join(", ");
                return Err(Box::new(Refusal::Internal {
                    host,
                    addresses,
                    list: policy.key("allowed_internal"),
                }) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs)
        })
    }
}
