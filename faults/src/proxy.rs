//! A userspace TCP proxy between laneway and an inbox, for network faults:
//! added latency, connections reset at accept, a blackhole, a response
//! dribbled out a byte at a time, and an answer lost on the way back after
//! the inbox accepted the request (the one fault that may deliver twice,
//! so it is counted).

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::Rng as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// What the proxy does to the connections it accepts from now on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    Pass = 0,
    /// 20-100 ms before each chunk, both ways.
    Latency = 1,
    /// Closed at accept: nothing reaches the inbox.
    Reset = 2,
    /// Read and never answered: the client's timeout ends it.
    Blackhole = 3,
    /// The answer one byte per 5 ms.
    Slow = 4,
    /// The request reaches the inbox; its answer is dropped and the
    /// connection closed.
    LoseAnswer = 5,
}

impl Mode {
    pub const FAULTS: [Mode; 5] = [
        Mode::Latency,
        Mode::Reset,
        Mode::Blackhole,
        Mode::Slow,
        Mode::LoseAnswer,
    ];

    fn from_u8(value: u8) -> Mode {
        match value {
            1 => Mode::Latency,
            2 => Mode::Reset,
            3 => Mode::Blackhole,
            4 => Mode::Slow,
            5 => Mode::LoseAnswer,
            _ => Mode::Pass,
        }
    }
}

/// A running proxy; it stops when dropped.
pub struct Proxy {
    pub port: u16,
    mode: Arc<AtomicU8>,
    lost: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on 127.0.0.1 and forwards to `upstream` on 127.0.0.1.
    pub async fn start(upstream: u16) -> anyhow::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let mode = Arc::new(AtomicU8::new(Mode::Pass as u8));
        let lost = Arc::new(AtomicU64::new(0));
        let task = {
            let (mode, lost) = (mode.clone(), lost.clone());
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let mode = Mode::from_u8(mode.load(Ordering::SeqCst));
                    let lost = lost.clone();
                    tokio::spawn(async move {
                        let _ = serve(client, upstream, mode, &lost).await;
                    });
                }
            })
        };
        Ok(Proxy { port, mode, lost, task })
    }

    pub fn set(&self, mode: Mode) {
        self.mode.store(mode as u8, Ordering::SeqCst);
    }

    /// Connections whose request went to the inbox and whose answer was
    /// dropped: each may be delivered again.
    pub fn lost_answers(&self) -> u64 {
        self.lost.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// 20-100 ms (a function, so no `ThreadRng` lives across an await).
fn jitter() -> Duration {
    Duration::from_millis(rand::thread_rng().gen_range(20..100))
}

async fn serve(mut client: TcpStream, upstream: u16, mode: Mode, lost: &AtomicU64) -> std::io::Result<()> {
    match mode {
        Mode::Reset => return Ok(()),
        Mode::Blackhole => {
            let mut sink = [0u8; 4096];
            while client.read(&mut sink).await? > 0 {}
            return Ok(());
        }
        _ => {}
    }
    let server = TcpStream::connect(("127.0.0.1", upstream)).await?;
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let up = async {
        let mut buf = [0u8; 16 * 1024];
        loop {
            let n = client_read.read(&mut buf).await?;
            if n == 0 {
                return server_write.shutdown().await;
            }
            if mode == Mode::Latency {
                tokio::time::sleep(jitter()).await;
            }
            server_write.write_all(&buf[..n]).await?;
        }
    };
    let down = async {
        let mut buf = [0u8; 16 * 1024];
        loop {
            let n = server_read.read(&mut buf).await?;
            if n == 0 {
                return client_write.shutdown().await;
            }
            match mode {
                Mode::LoseAnswer => {
                    // The inbox answered, so it had the whole request.
                    lost.fetch_add(1, Ordering::SeqCst);
                    return Ok(());
                }
                Mode::Latency => {
                    tokio::time::sleep(jitter()).await;
                    client_write.write_all(&buf[..n]).await?;
                }
                Mode::Slow => {
                    for byte in &buf[..n] {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        client_write.write_all(std::slice::from_ref(byte)).await?;
                    }
                }
                _ => client_write.write_all(&buf[..n]).await?,
            }
        }
    };
    // Either side ending ends the connection (dropping both halves).
    tokio::select! {
        r = up => r,
        r = down => r,
    }
}
