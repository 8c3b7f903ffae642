//! The demo's fake ActivityPub inboxes: each its own server (so one's
//! failures count against its own host only), each checking every POST's
//! HTTP Signature against the actor's public key with the host's own
//! verifier, refusing what does not verify, and recording the ledger
//! positions that arrived, in arrival order.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};

use crate::inbound::{self, PublicKey, Received};

/// How an inbox answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// 202 at once.
    Prompt,
    /// 202 after this long.
    Slow(Duration),
    /// 500 to its first this many requests, then 202.
    FailFirst(u32),
    /// 410 Gone: the actor was deleted.
    Gone,
}

impl Behaviour {
    /// A phrase for the report.
    pub fn describe(self) -> String {
        match self {
            Behaviour::Prompt => "answers at once".to_owned(),
            Behaviour::Slow(d) => format!("answers after {} ms", d.as_millis()),
            Behaviour::FailFirst(n) => format!("fails its first {n} requests"),
            Behaviour::Gone => "answers 410 Gone".to_owned(),
        }
    }
}

/// One fake inbox.
pub struct Inbox {
    /// Its short name (`prompt`, `slow`, …).
    pub name: &'static str,
    /// How it answers.
    pub behaviour: Behaviour,
    /// Its URL.
    pub url: String,
    requests: AtomicU32,
    refused: AtomicU32,
    arrivals: Mutex<Vec<u64>>,
}

impl Inbox {
    /// Ledger positions accepted, in arrival order.
    pub fn arrivals(&self) -> Vec<u64> {
        self.arrivals.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Requests whose signature did not verify (must stay 0).
    pub fn refused(&self) -> u32 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Requests received.
    pub fn requests(&self) -> u32 {
        self.requests.load(Ordering::Relaxed)
    }
}

struct Served {
    inbox: Arc<Inbox>,
    key: PublicKey,
}

/// Starts an inbox on its own loopback port.
///
/// # Errors
///
/// The port cannot be bound.
pub async fn start(name: &'static str, behaviour: Behaviour, key: PublicKey) -> std::io::Result<Arc<Inbox>> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
    let inbox = Arc::new(Inbox {
        name,
        behaviour,
        url: format!("http://{}/users/{name}/inbox", listener.local_addr()?),
        requests: AtomicU32::new(0),
        refused: AtomicU32::new(0),
        arrivals: Mutex::new(Vec::new()),
    });
    let state = Arc::new(Served {
        inbox: inbox.clone(),
        key,
    });
    let app = axum::Router::new().fallback(receive).with_state(state);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "A demo inbox stopped.");
        }
    });
    Ok(inbox)
}

async fn receive(
    State(served): State<Arc<Served>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, &'static str) {
    let inbox = &served.inbox;
    let seen = inbox.requests.fetch_add(1, Ordering::Relaxed);
    if !verified(&served, &uri, &headers, &body) {
        inbox.refused.fetch_add(1, Ordering::Relaxed);
        return (StatusCode::UNAUTHORIZED, "signature did not verify");
    }
    match inbox.behaviour {
        Behaviour::Gone => return (StatusCode::GONE, "this account was deleted"),
        Behaviour::FailFirst(n) if seen < n => return (StatusCode::INTERNAL_SERVER_ERROR, "database is restarting"),
        Behaviour::Slow(d) => tokio::time::sleep(d).await,
        Behaviour::Prompt | Behaviour::FailFirst(_) => {}
    }
    let position = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["object"]["position"].as_u64());
    match position {
        Some(p) => {
            inbox.arrivals.lock().unwrap_or_else(PoisonError::into_inner).push(p);
            (StatusCode::ACCEPTED, "")
        }
        None => (StatusCode::BAD_REQUEST, "no ledger position"),
    }
}

/// Whether the request carries a valid signature by the demo actor's key
/// over this very request (method, target, digest of this body, date).
fn verified(served: &Served, uri: &Uri, headers: &HeaderMap, body: &[u8]) -> bool {
    let pairs = inbound::header_pairs(headers);
    let base = served.inbox.url.split("/users/").next().unwrap_or_default();
    let target = format!("{base}{uri}");
    let request = Received {
        method: "POST",
        target_uri: &target,
        headers: &pairs,
        body,
    };
    let Ok(signature) = inbound::parse(&request) else {
        return false;
    };
    let Ok(signed) = inbound::signed_bytes(&signature, &request, chrono::Utc::now(), Duration::from_secs(300)) else {
        return false;
    };
    let bytes = match &signature {
        inbound::Signature::Cavage { signature, .. } | inbound::Signature::Rfc9421 { signature, .. } => signature,
    };
    served.key.verifies(&signed, bytes)
}
