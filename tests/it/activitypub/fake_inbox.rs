//! A fake ActivityPub server for tests: it verifies every POST's HTTP
//! Signature and Digest as Mastodon does (signed `(request-target)`, `host`,
//! `date`, `digest`; date within an hour; digest equal to the body's), keeps
//! each inbox's arrivals in order, de-duplicates by activity id, and answers
//! as a test scripts it: 500, 401, 410, 429 with Retry-After, or a hang.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use rsa::pkcs1v15::{Signature, VerifyingKey};
use rsa::signature::Verifier as _;
use sha2::{Digest as _, Sha256};

/// How the fake answers one request to an inbox.
#[derive(Debug, Clone)]
pub enum Reply {
    /// 202 Accepted (after the checks pass).
    Accept,
    /// This status, empty body.
    Status(u16),
    /// 429 with this `Retry-After` value.
    TooMany(String),
    /// Do not answer for this long.
    Hang(Duration),
    /// 202 with a body of this many bytes (some servers echo a lot).
    BigAccept(usize),
}

/// One accepted activity.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub body: serde_json::Value,
    /// When it was accepted.
    pub at: std::time::Instant,
}

#[derive(Default)]
struct Inner {
    keys: HashMap<String, rsa::RsaPublicKey>,
    scripts: HashMap<String, VecDeque<Reply>>,
    arrivals: HashMap<String, Vec<Arrival>>,
    seen: HashMap<String, HashSet<String>>,
    duplicates: usize,
    posts: HashMap<String, usize>,
    rejections: Vec<String>,
}

/// The fake server; clones share state.
#[derive(Clone, Default)]
pub struct FakeInbox {
    inner: Arc<Mutex<Inner>>,
}

impl FakeInbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Trusts `key` for signatures with `key_id`.
    pub fn trust(&self, key_id: &str, key: rsa::RsaPublicKey) {
        self.lock().keys.insert(key_id.to_owned(), key);
    }

    /// Queues replies for the next requests to `path`.
    pub fn script(&self, path: &str, replies: impl IntoIterator<Item = Reply>) {
        self.lock().scripts.entry(path.to_owned()).or_default().extend(replies);
    }

    /// Drops the replies still queued for `path` (it accepts again).
    pub fn clear_script(&self, path: &str) {
        self.lock().scripts.remove(path);
    }

    /// Every accepted activity, any path.
    pub fn all_arrivals(&self) -> Vec<Arrival> {
        self.lock().arrivals.values().flatten().cloned().collect()
    }

    /// Accepted activities per inbox path, in arrival order.
    pub fn arrivals(&self, path: &str) -> Vec<Arrival> {
        self.lock().arrivals.get(path).cloned().unwrap_or_default()
    }

    /// POSTs received per path, good or not.
    pub fn posts(&self, path: &str) -> usize {
        self.lock().posts.get(path).copied().unwrap_or(0)
    }

    /// Why requests were refused with 401.
    pub fn rejections(&self) -> Vec<String> {
        self.lock().rejections.clone()
    }

    /// Activities received again after being accepted.
    pub fn duplicates(&self) -> usize {
        self.lock().duplicates
    }

    /// Serves on 127.0.0.1; returns the base URL.
    pub async fn serve(&self) -> anyhow::Result<String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let app = axum::Router::new().fallback(handle).with_state(self.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(base)
    }

    /// Checks a request as Mastodon would; `Err` is the 401 reason.
    pub fn verify(&self, method: &Method, uri: &Uri, headers: &HeaderMap, body: &[u8]) -> Result<(), String> {
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let signature = header("signature").ok_or("no Signature header")?;
        let params: HashMap<String, String> = signature
            .split(',')
            .filter_map(|p| p.split_once('='))
            .map(|(k, v)| (k.trim().to_owned(), v.trim().trim_matches('"').to_owned()))
            .collect();
        if params.get("algorithm").map(String::as_str) != Some("rsa-sha256") {
            return Err("algorithm is not rsa-sha256".into());
        }
        let signed: Vec<&str> = params
            .get("headers")
            .map(|h| h.split(' ').collect())
            .unwrap_or_default();
        for required in ["(request-target)", "host", "date", "digest"] {
            if !signed.contains(&required) {
                return Err(format!("{required} is not signed"));
            }
        }
        let date = header("date").ok_or("no Date header")?;
        let when = httpdate::parse_http_date(&date).map_err(|_| "bad Date header")?;
        let skew = SystemTime::now()
            .duration_since(when)
            .or_else(|e| Ok::<_, String>(e.duration()))?;
        if skew > Duration::from_secs(3600) {
            return Err("date outside the window".into());
        }
        let digest = header("digest").ok_or("no Digest header")?;
        let expected = format!(
            "SHA-256={}",
            base64::engine::general_purpose::STANDARD.encode(Sha256::digest(body))
        );
        if digest != expected {
            return Err("digest mismatch".into());
        }
        let mut lines = Vec::new();
        for name in &signed {
            if *name == "(request-target)" {
                let target = uri.path_and_query().map_or("/", |p| p.as_str());
                lines.push(format!(
                    "(request-target): {} {target}",
                    method.as_str().to_ascii_lowercase()
                ));
            } else {
                lines.push(format!(
                    "{name}: {}",
                    header(name).ok_or(format!("signed header {name} is missing"))?
                ));
            }
        }
        let key_id = params.get("keyId").ok_or("no keyId")?;
        let key = self
            .lock()
            .keys
            .get(key_id)
            .cloned()
            .ok_or(format!("unknown keyId {key_id}"))?;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(params.get("signature").ok_or("no signature")?)
            .map_err(|_| "signature is not base64")?;
        let sig = Signature::try_from(raw.as_slice()).map_err(|_| "malformed signature")?;
        VerifyingKey::<Sha256>::new(key)
            .verify(lines.join("\n").as_bytes(), &sig)
            .map_err(|_| "bad signature".to_owned())
    }
}

async fn handle(State(fake): State<FakeInbox>, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let path = uri.path().to_owned();
    *fake.lock().posts.entry(path.clone()).or_default() += 1;
    if method != Method::POST {
        return StatusCode::METHOD_NOT_ALLOWED.into_response();
    }
    if let Err(reason) = fake.verify(&method, &uri, &headers, &body) {
        fake.lock().rejections.push(format!("{path}: {reason}"));
        let body = serde_json::json!({ "error": reason }).to_string();
        return (StatusCode::UNAUTHORIZED, [("content-type", "application/json")], body).into_response();
    }
    let reply = fake
        .lock()
        .scripts
        .get_mut(&path)
        .and_then(VecDeque::pop_front)
        .unwrap_or(Reply::Accept);
    let mut big = None;
    match reply {
        Reply::Accept => {}
        Reply::BigAccept(n) => big = Some(n),
        Reply::Status(code) => {
            return StatusCode::from_u16(code)
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
                .into_response()
        }
        Reply::TooMany(after) => return (StatusCode::TOO_MANY_REQUESTS, [("retry-after", after)]).into_response(),
        Reply::Hang(d) => {
            tokio::time::sleep(d).await;
            return StatusCode::GATEWAY_TIMEOUT.into_response();
        }
    }
    let Ok(activity) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let id = activity
        .get("id")
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_owned();
    let mut inner = fake.lock();
    if !inner.seen.entry(path.clone()).or_default().insert(id.clone()) {
        inner.duplicates += 1;
        return StatusCode::ACCEPTED.into_response();
    }
    inner.arrivals.entry(path).or_default().push(Arrival {
        body: activity,
        at: std::time::Instant::now(),
    });
    match big {
        Some(n) => (StatusCode::ACCEPTED, "x".repeat(n)).into_response(),
        None => StatusCode::ACCEPTED.into_response(),
    }
}
