//! The inbound key cache's limits, from outside: one fetch per key id
//! however many requests ask at once, documents read as they stream and cut
//! at the cap (a huge one costs no memory), a bounded cache, and a per-origin
//! fetch rate, so unauthenticated requests cannot make laneway fetch
//! without bound.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use axum::extract::Path;
use laneway::inbound::{InboundError, KeyCache, KeySettings};
use rsa::pkcs8::EncodePublicKey as _;
use serde_json::json;

use super::actor_key;

struct Server {
    base: String,
    declared: String,
    gets: Arc<AtomicUsize>,
    streamed: Arc<AtomicUsize>,
}

async fn server() -> anyhow::Result<Server> {
    let (_, _, key) = actor_key()?;
    let pem = key.to_public_key().to_public_key_pem(Default::default())?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let gets = Arc::new(AtomicUsize::new(0));
    let streamed = Arc::new(AtomicUsize::new(0));
    let (b, g, s) = (base.clone(), gets.clone(), streamed.clone());
    let app = axum::Router::new()
        .route(
            "/users/{n}",
            axum::routing::get(move |Path(n): Path<String>| {
                let (base, gets, pem) = (b.clone(), g.clone(), pem.clone());
                async move {
                    gets.fetch_add(1, Ordering::SeqCst);
                    // Slow enough that concurrent askers overlap.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let id = format!("{base}/users/{n}");
                    axum::Json(json!({ "id": id, "type": "Person",
                        "publicKey": { "id": format!("{id}#k"), "owner": id, "publicKeyPem": pem } }))
                }
            }),
        )
        .route(
            "/huge",
            axum::routing::get(move || {
                let streamed = s.clone();
                async move {
                    // 64 MiB, made as it is read, with no Content-Length.
                    let chunks = futures::stream::iter(0..1024).map(move |_| {
                        streamed.fetch_add(65536, Ordering::SeqCst);
                        Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![b' '; 65536]))
                    });
                    axum::body::Body::from_stream(chunks)
                }
            }),
        );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    // A server declaring a 1 GiB body it never sends (axum would refuse to
    // send a length it does not have, so this one is raw).
    let raw = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let declared = format!("http://{}/declared", raw.local_addr()?);
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        while let Ok((mut socket, _)) = raw.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 2048];
                let _ = socket.read(&mut buf).await;
                let _ = socket
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1073741824\r\n\r\n{",
                    )
                    .await;
                tokio::time::sleep(Duration::from_secs(30)).await;
            });
        }
    });
    Ok(Server {
        base,
        gets,
        streamed,
        declared,
    })
}

fn cache(settings: KeySettings) -> anyhow::Result<KeyCache> {
    let config = laneway::config::from_toml_str(
        "[inbound]\nallowed_hosts = [\"http://127.0.0.1:*\"]\nallowed_internal = [\"127.0.0.1\"]\n",
    )?;
    Ok(KeyCache::new(
        laneway::inbound::key_client(&config.inbound).map_err(anyhow::Error::msg)?,
        settings,
    ))
}

use futures::StreamExt as _;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_fetched_once_however_many_ask_at_once() -> anyhow::Result<()> {
    let s = server().await?;
    let keys = Arc::new(cache(KeySettings::default())?);
    let key_id = format!("{}/users/1#k", s.base);
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (keys, key_id) = (keys.clone(), key_id.clone());
        tasks.push(tokio::spawn(async move { keys.verify(&key_id, b"data", b"bad").await }));
    }
    for task in tasks {
        let result = task.await?;
        ensure!(matches!(result, Err(InboundError::Unverified(_))), "{result:?}");
    }
    ensure!(
        s.gets.load(Ordering::SeqCst) == 1,
        "{} fetches",
        s.gets.load(Ordering::SeqCst)
    );
    // A flood of bad signatures does not refetch within refetch_after.
    for _ in 0..10 {
        let _ = keys.verify(&key_id, b"data", b"bad").await;
    }
    ensure!(s.gets.load(Ordering::SeqCst) == 1, "refetched on every failure");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_document_is_cut_as_it_streams() -> anyhow::Result<()> {
    let s = server().await?;
    let keys = cache(KeySettings::default())?;
    let started = Instant::now();
    let result = keys.verify(&format!("{}/huge#k", s.base), b"d", b"s").await;
    let why = format!("{result:?}");
    ensure!(why.contains("over") && why.contains("bytes"), "{why}");
    ensure!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let streamed = s.streamed.load(Ordering::SeqCst);
    ensure!(
        streamed < 16 * 1024 * 1024,
        "{streamed} bytes were produced before the read stopped"
    );
    // A declared length over the cap is refused before reading.
    let started = Instant::now();
    let result = keys.verify(&format!("{}#k", s.declared), b"d", b"s").await;
    ensure!(format!("{result:?}").contains("over"), "{result:?}");
    ensure!(
        started.elapsed() < Duration::from_secs(5),
        "the declared length was read: {:?}",
        started.elapsed()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetches_are_rate_limited_per_origin_and_the_cache_is_bounded() -> anyhow::Result<()> {
    let s = server().await?;
    let limited = cache(KeySettings {
        origin_burst: 3,
        origin_rate: 0.01,
        ..KeySettings::default()
    })?;
    let mut busy = 0;
    for n in 0..6 {
        if let Err(InboundError::Busy(_)) = limited.verify(&format!("{}/users/r{n}#k", s.base), b"d", b"s").await {
            busy += 1;
        }
    }
    ensure!(busy == 3, "{busy} of 6 refused as busy");
    let bounded = cache(KeySettings {
        capacity: 2,
        ..KeySettings::default()
    })?;
    for n in 0..5 {
        let _ = bounded.verify(&format!("{}/users/b{n}#k", s.base), b"d", b"s").await;
    }
    ensure!(bounded.len() == 2, "{} keys cached", bounded.len());
    let answer = limited.verify(&format!("{}/users/r9#k", s.base), b"d", b"s").await;
    let InboundError::Busy(origin) = answer.err().context("not busy")? else {
        anyhow::bail!("not busy")
    };
    ensure!(origin.starts_with("http://127.0.0.1"), "{origin}");
    Ok(())
}
