//! The API's listener: HTTP/1 connections with every bound an
//! internet-facing server needs, since the inbox is open to anyone. A
//! request's headers must arrive within `header_timeout_ms` (slowloris), its
//! body within `body_timeout_ms` of the request's start however slowly it
//! trickles, and connections are capped in all and per client address, so
//! one client holding many slow connections cannot take every slot (a
//! connection over a cap is closed at once).

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
        let Ok(permit) = total.clone().try_acquire_owned() else {
            tracing::debug!(peer = %peer, "API connection refused: the connection limit is reached.");
            continue;
        };
        let Some(place) = PerAddress::take(&counts, peer.ip(), limits.max_connections_per_ip) else {
            tracing::debug!(peer = %peer, "API connection refused: the per-address limit is reached.");
            continue;
        };
        let router = router.clone();
        let (body_timeout, max_body) = (limits.body_timeout, limits.max_body_bytes);
        let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let router = router.clone();
            async move {
                if declared_length(&request).is_some_and(|n| n > max_body) {
                    return Ok(too_large(max_body));
                }
                let request = request.map(|body| Body::new(Deadline::new(body, body_timeout)));
                router.oneshot(request).await
            }
        });
        let stopping = shutdown.clone();
        let header_timeout = limits.header_timeout;
        tracker.spawn(async move {
            let _held = (permit, place);
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
            };
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
