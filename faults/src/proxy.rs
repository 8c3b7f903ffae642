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

/// Which way a [`pump`] copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Request,
    Answer,
}

/// Copies one direction of a connection under `mode` until either end
/// closes.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mode: Mode,
    direction: Direction,
    lost: &AtomicU64,
) -> std::io::Result<()> {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return to.shutdown().await;
        }
        match (mode, direction) {
            (Mode::LoseAnswer, Direction::Answer) => {
                // The inbox answered, so it had the whole request.
                lost.fetch_add(1, Ordering::SeqCst);
                return Ok(());
            }
            (Mode::Slow, Direction::Answer) => {
                for byte in &buf[..n] {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    to.write_all(std::slice::from_ref(byte)).await?;
                }
            }
            (Mode::Latency, _) => {
                tokio::time::sleep(jitter()).await;
                to.write_all(&buf[..n]).await?;
            }
            _ => to.write_all(&buf[..n]).await?,
        }
    }
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
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pump(client_read, server_write, mode, Direction::Request, lost);
    let down = pump(server_read, client_write, mode, Direction::Answer, lost);
    // Either side ending ends the connection (dropping both halves).
    tokio::select! {
        r = up => r,
        r = down => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upstream that answers every connection's first read with `ok`,
    /// then closes it.
    /// Counts the requests it received.
    async fn upstream(received: Arc<AtomicU64>) -> anyhow::Result<u16> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let received = received.clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    if conn.read(&mut buf).await.is_ok_and(|n| n > 0) {
                        received.fetch_add(1, Ordering::SeqCst);
                        let _ = conn.write_all(b"ok").await;
                    }
                });
            }
        });
        Ok(port)
    }

    async fn exchange(port: u16) -> anyhow::Result<Vec<u8>> {
        let mut conn = TcpStream::connect(("127.0.0.1", port)).await?;
        conn.write_all(b"hello").await?;
        let mut answer = Vec::new();
        // A proxy that drops the connection with the request unread
        // resets it: to the client, as empty an answer as a close.
        match tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut answer)).await? {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(Vec::new()),
            other => Ok(other.map(|_| answer)?),
        }
    }

    #[tokio::test]
    async fn pass_slow_and_latency_deliver_and_lose_answer_drops_and_counts() -> anyhow::Result<()> {
        let received = Arc::new(AtomicU64::new(0));
        let proxy = Proxy::start(upstream(received.clone()).await?).await?;
        for mode in [Mode::Pass, Mode::Slow, Mode::Latency] {
            proxy.set(mode);
            assert_eq!(exchange(proxy.port).await?, b"ok", "{mode:?}");
        }
        assert_eq!(received.load(Ordering::SeqCst), 3);
        // The request reaches the inbox; its answer does not come back.
        proxy.set(Mode::LoseAnswer);
        assert_eq!(exchange(proxy.port).await?, b"");
        assert_eq!((received.load(Ordering::SeqCst), proxy.lost_answers()), (4, 1));
        proxy.set(Mode::Reset);
        assert_eq!(exchange(proxy.port).await?, b"");
        assert_eq!(
            (received.load(Ordering::SeqCst), proxy.lost_answers()),
            (4, 1),
            "a reset reaches no inbox"
        );
        Ok(())
    }
}
