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
                tokio::spawn(async move {
                    let stalled = tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => false,
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
        Self { port, down, stalls }
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
