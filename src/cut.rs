//! A TCP relay that can cut every connection through it and refuse new ones for a while:
//! a database outage, for fault tests.

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A relay from a loopback port to `upstream`. Clients connect to `127.0.0.1:`[`port`](Self::port).
#[derive(Debug)]
pub struct CutRelay {
    /// The relay's loopback port.
    pub port: u16,
    down: watch::Sender<bool>,
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
                tokio::spawn(async move {
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut.wait_for(|down| *down) => {}
                    }
                    // Both sockets are dropped here: the client sees its connection end.
                });
            }
        });
        Self { port, down }
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
