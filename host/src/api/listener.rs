//! The API's listener: HTTP/1 connections with every bound an
//! internet-facing server needs, since the inbox is open to anyone. A
//! request's headers must arrive within `header_timeout_ms` (slowloris), its
//! body within `body_timeout_ms` of the request's start however slowly it
//! trickles, and connections are capped in all and per client address, so
//! one client holding many slow connections cannot take every slot. At the
//! cap in all, the connection that has waited longest for a request's
//! headers (a slow client, or an idle keep-alive) gives way to the new one,
//! so slow connections from many addresses cannot shut out `/healthz` or a
//! sender; a connection in the middle of a request is never cut. Over its
//! address's cap, a new connection is closed at once.

use std::collections::HashMap;
use std::future::Future as _;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tower::ServiceExt as _;

/// The listener's bounds (`[api]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// A request's headers must be in by then.
    pub header_timeout: Duration,
    /// A request's body must be in by then (from the request's start).
    pub body_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections open at once from one client address.
    pub max_connections_per_ip: usize,
    /// The largest body: a request declaring more is answered 413 before
    /// any of it is read.
    pub max_body_bytes: usize,
}

impl Limits {
    /// The bounds `[api]` sets.
    pub fn of(config: &crate::config::ApiConfig) -> Self {
        Self {
            header_timeout: Duration::from_millis(config.header_timeout_ms),
            body_timeout: Duration::from_millis(config.body_timeout_ms),
            max_connections: config.max_connections,
            max_connections_per_ip: config.max_connections_per_ip,
            max_body_bytes: config.max_body_bytes,
        }
    }
}

type Counts = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// One open connection, as the cap sees it.
struct Live {
    /// Requests it is serving now (headers in, answer not yet sent).
    in_request: std::sync::atomic::AtomicUsize,
    /// Cancelled to make it give way.
    evict: tokio_util::sync::CancellationToken,
}

/// Every open connection by accept order, for choosing one to give way.
#[derive(Default)]
struct Open(Mutex<std::collections::BTreeMap<u64, Arc<Live>>>);

impl Open {
    fn insert(&self, seq: u64, live: Arc<Live>) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).insert(seq, live);
    }

    fn remove(&self, seq: u64) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).remove(&seq);
    }

    /// Makes the oldest connection waiting for a request's headers give
    /// way; whether there was one.
    fn evict_oldest_waiting(&self) -> bool {
        let open = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let waiting = open
            .values()
            .find(|l| l.in_request.load(std::sync::atomic::Ordering::Acquire) == 0 && !l.evict.is_cancelled());
        match waiting {
            Some(live) => {
                live.evict.cancel();
                true
            }
            None => false,
        }
    }
}

/// Counts a request in flight on its connection while alive.
struct InRequest(Arc<Live>);

impl InRequest {
    fn new(live: &Arc<Live>) -> Self {
        live.in_request.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Self(live.clone())
    }
}

impl Drop for InRequest {
    fn drop(&mut self) {
        self.0.in_request.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Raises the process's soft limit on open files to its hard limit, so
/// `max_connections` is not cut short by a service manager's default
/// (1,024 under systemd), and says so.
pub fn raise_open_files_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    let Some(soft) = limit.current else {
        return;
    };
    // No hard limit: a generous one rather than none.
    let wanted = limit.maximum.unwrap_or(soft.max(1 << 20));
    if soft >= wanted {
        return;
    }
    let raised = Rlimit {
        current: Some(wanted),
        maximum: limit.maximum,
    };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => tracing::info!(
            from = soft,
            to = wanted,
            "Raised the open-files limit to its hard limit."
        ),
        Err(e) => tracing::warn!(limit = soft, error = %e, "Could not raise the open-files limit."),
    }
}

/// One connection's place in its address's count, given back on drop.
struct PerAddress {
    counts: Counts,
    ip: IpAddr,
}

impl PerAddress {
    fn take(counts: &Counts, ip: IpAddr, max: usize) -> Option<Self> {
        let mut map = counts.lock().unwrap_or_else(PoisonError::into_inner);
        let n = map.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Self {
            counts: counts.clone(),
            ip,
        })
    }
}

impl Drop for PerAddress {
    fn drop(&mut self) {
        let mut map = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

/// Serves `router` on `listener` until `stop` resolves, then lets the open
/// connections finish their requests.
///
/// # Errors
///
/// None today; the signature leaves room for a listener that can fail.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let total = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let counts: Counts = Arc::default();
    let open = Arc::new(Open::default());
    let mut seq: u64 = 0;
    let tracker = tokio_util::task::TaskTracker::new();
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, say: pause rather than spin.
                    tracing::warn!(error = %e, "The API listener could not accept a connection.");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let Some(place) = PerAddress::take(&counts, peer.ip(), limits.max_connections_per_ip) else {
            tracing::debug!(peer = %peer, "API connection refused: the per-address limit is reached.");
            continue;
        };
        let permit = match total.clone().try_acquire_owned() {
            Ok(permit) => permit,
            // At the cap: the oldest connection still waiting for headers
            // gives way (its task drops it and its permit at once).
            Err(_) if open.evict_oldest_waiting() => {
                match tokio::time::timeout(Duration::from_millis(200), total.clone().acquire_owned()).await {
                    Ok(Ok(permit)) => permit,
                    _ => continue,
                }
            }
            Err(_) => {
                tracing::debug!(peer = %peer, "API connection refused: every connection is in a request.");
                continue;
            }
        };
        seq += 1;
        let id = seq;
        let live = Arc::new(Live {
            in_request: std::sync::atomic::AtomicUsize::new(0),
            evict: tokio_util::sync::CancellationToken::new(),
        });
        open.insert(id, live.clone());
        let router = router.clone();
        let (body_timeout, max_body) = (limits.body_timeout, limits.max_body_bytes);
        let serving = live.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let router = router.clone();
            let busy = InRequest::new(&serving);
            async move {
                if declared_length(&request).is_some_and(|n| n > max_body) {
                    return Ok::<_, std::convert::Infallible>(too_large(max_body));
                }
                let request = request.map(|body| Body::new(Deadline::new(body, body_timeout)));
                // The request counts until its answer's last byte is sent,
                // not when the handler returns.
                let response = router.oneshot(request).await?;
                Ok(response.map(|body| {
                    Body::new(Counted {
                        inner: body,
                        _busy: busy,
                    })
                }))
            }
        });
        let stopping = shutdown.clone();
        let header_timeout = limits.header_timeout;
        let open = open.clone();
        tracker.spawn(async move {
            let _held = (permit, place);
            let evicted = live.evict.clone();
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(header_timeout);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            let result = tokio::select! {
                result = connection.as_mut() => result,
                () = stopping.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
                // Chosen to give way: dropped if still waiting for headers
                // (no request has begun, nothing was answered); a request
                // that began meanwhile is finished first.
                () = evicted.cancelled() => {
                    if live.in_request.load(std::sync::atomic::Ordering::Acquire) == 0 {
                        Ok(())
                    } else {
                        connection.as_mut().graceful_shutdown();
                        connection.await
                    }
                }
            };
            open.remove(id);
            if let Err(e) = result {
                tracing::debug!(peer = %peer, error = %e, "API connection ended with an error.");
            }
        });
    }
    shutdown.cancel();
    tracker.close();
    tracker.wait().await;
    Ok(())
}

/// The Content-Length a request declares, if it declares one.
fn declared_length<B>(request: &hyper::Request<B>) -> Option<usize> {
    request
        .headers()
        .get(hyper::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
}

/// The answer to a body declared over the limit, as the API words it.
fn too_large(max: usize) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let mut response = super::ApiError::new(
        axum::http::StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("the request declares a body over [api] max_body_bytes ({max} bytes)"),
    )
    .into_response();
    // The body is never read: the connection cannot carry another request.
    response.headers_mut().insert(
        hyper::header::CONNECTION,
        hyper::header::HeaderValue::from_static("close"),
    );
    response
}

/// An answer's body that keeps its request counted until it is sent whole
/// (or dropped), so a connection streaming an answer never gives way.
struct Counted {
    inner: Body,
    _busy: InRequest,
}

impl http_body::Body for Counted {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that fails once its deadline passes, however slowly its
/// bytes trickle in.
struct Deadline {
    inner: hyper::body::Incoming,
    sleep: Pin<Box<tokio::time::Sleep>>,
}

impl Deadline {
    fn new(inner: hyper::body::Incoming, timeout: Duration) -> Self {
        Self {
            inner,
            sleep: Box::pin(tokio::time::sleep(timeout)),
        }
    }
}

/// The body's error: the transport's, or the deadline passed.
#[derive(Debug, thiserror::Error)]
enum BodyError {
    #[error(transparent)]
    Transport(#[from] hyper::Error),
    #[error("the request body did not arrive in time")]
    TooSlow,
}

impl http_body::Body for Deadline {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BodyError>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame.map(|f| f.map_err(BodyError::from))),
            Poll::Pending => match self.sleep.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(BodyError::TooSlow))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
