//! A TCP relay that can cut every connection through it and refuse new ones for a while (a
//! database outage), or stall the connections it has without closing them (a peer gone
//! without a reset), for fault tests.

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A relay from a loopback port to `upstream`. Clients connect to `127.0.0.1:`[`port`](Self::port).
#[derive(Debug)]
pub struct CutRelay {
    /// The relay's loopback port.
    pub port: u16,
    down: watch::Sender<bool>,
    stalls: watch::Sender<u64>,
    trigger: watch::Sender<Option<Vec<u8>>>,
}

impl CutRelay {
    /// Starts a relay to `upstream` (`host:port`) on a free loopback port.
    ///
    /// # Panics
    ///
    /// If no loopback port can be bound.
    pub async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let port = listener.local_addr().expect("the relay's address").port();
        let (down, watching) = watch::channel(false);
        let (stalls, stalled) = watch::channel(0_u64);
        let (trigger, _) = watch::channel(None::<Vec<u8>>);
        let (triggers, stall_all) = (trigger.clone(), stalls.clone());
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if *watching.borrow() {
                    // Refused: closed at once.
                    drop(client);
                    continue;
                }
                let Ok(mut server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                let mut cut = watching.clone();
                let mut stall = stalled.clone();
                let born = *stall.borrow();
                let (triggers, stall_all) = (triggers.clone(), stall_all.clone());
                tokio::spawn(async move {
                    let stalled = tokio::select! {
                        () = relay(&mut client, &mut server, &triggers, &stall_all) => false,
                        () = async { let _ = cut.wait_for(|down| *down).await; } => false,
                        () = async { let _ = stall.wait_for(|stalls| *stalls > born).await; } => true,
                    };
                    if stalled {
                        // Nothing passes any more, and nobody is told: held open until the
                        // relay is taken down.
                        let _ = cut.wait_for(|down| *down).await;
                    }
                    // Both sockets are dropped here: the client sees its connection end.
                });
            }
        });
        Self {
            port,
            down,
            stalls,
            trigger,
        }
    }

    /// Stalls every connection, as [`stall`](Self::stall) does, at the moment a client sends
    /// bytes that contain `pattern`: those bytes never reach the server (a connection that
    /// went silent just as that request was sent). Once.
    pub fn stall_when_a_client_sends(&self, pattern: &[u8]) {
        self.trigger.send_replace(Some(pattern.to_vec()));
    }

    /// Stops forwarding on every connection open now, in both directions, without closing
    /// any (until [`down`](Self::down)); later connections pass.
    pub fn stall(&self) {
        self.stalls.send_modify(|stalls| *stalls += 1);
    }

    /// Starts a relay in front of the Postgres server of `options`; returns it with the same
    /// options pointed through it.
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start).
    pub async fn before_postgres(
        options: &sqlx::postgres::PgConnectOptions,
    ) -> (Self, sqlx::postgres::PgConnectOptions) {
        let relay = Self::start(format!("{}:{}", options.get_host(), options.get_port())).await;
        let through = options.clone().host("127.0.0.1").port(relay.port);
        (relay, through)
    }

    /// Cuts every connection through the relay and refuses new ones until [`up`](Self::up).
    pub fn down(&self) {
        self.down.send_replace(true);
    }

    /// Lets connections through again.
    pub fn up(&self) {
        self.down.send_replace(false);
    }
}

/// Forwards both ways until either side closes; the first client read that contains the
/// pattern `triggers` holds (taken: once) is not forwarded but stalls every connection.
async fn relay(
    client: &mut TcpStream,
    server: &mut TcpStream,
    triggers: &watch::Sender<Option<Vec<u8>>>,
    stall_all: &watch::Sender<u64>,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (mut client_read, mut client_write) = client.split();
    let (mut server_read, mut server_write) = server.split();
    let upstream = async {
        let mut buffer = vec![0_u8; 16 * 1024];
        loop {
            let n = match client_read.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let chunk = &buffer[..n];
            let hit = triggers.send_if_modified(|pattern| {
                let hit = pattern.as_ref().is_some_and(|pattern| {
                    !pattern.is_empty() && chunk.windows(pattern.len()).any(|w| w == &pattern[..])
                });
                if hit {
                    *pattern = None;
                }
                hit
            });
            if hit {
                stall_all.send_modify(|stalls| *stalls += 1);
                std::future::pending::<()>().await;
            }
            if server_write.write_all(chunk).await.is_err() {
                return;
            }
        }
    };
    let downstream = async {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
    };
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
    }
}
