//! A TCP relay in front of a NATS server, for fault tests: it can swallow what clients send
//! from some moment on, or hold back what the server sends for a while.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

/// A relay from a loopback port to a NATS server. Clients connect to [`url`](Self::url).
#[derive(Debug)]
pub struct Relay {
    /// `nats://127.0.0.1:<port>`.
    pub url: String,
    /// Once set, what clients send is swallowed, from then on for good (acks, pulls, pings
    /// never reach the server); the server's side still reaches the clients.
    pub frozen: Arc<AtomicBool>,
    /// While set, what the server sends is held back; it is delivered, in order, once cleared.
    pub paused: Arc<AtomicBool>,
}

impl Relay {
    /// Starts a relay to `upstream` (`host:port`) on a free loopback port.
    ///
    /// # Panics
    ///
    /// If no loopback port can be bound.
    pub async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let url = format!(
            "nats://{}",
            listener.local_addr().expect("the relay's address")
        );
        let (frozen, paused) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let never = Arc::new(AtomicBool::new(false));
        let (f, p) = (frozen.clone(), paused.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    return;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(forward(client_read, server_write, f.clone(), never.clone()));
                tokio::spawn(forward(server_read, client_write, never.clone(), p.clone()));
            }
        });
        Self {
            url,
            frozen,
            paused,
        }
    }
}

/// Copies `from` to `to` until either ends: swallowing everything once `frozen` is set,
/// holding each read back while `paused` is set.
async fn forward(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
) {
    let mut buf = vec![0_u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.load(Ordering::SeqCst) {
            // Swallow this and everything after.
            std::future::pending::<()>().await;
        }
        while paused.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
