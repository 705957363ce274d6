//! A private `nats-server` for fault tests: started on a free loopback port with JetStream
//! and a file store in its own temporary directory, stopped and restarted on the same port
//! and store, and killed on drop. Only the child process it started is ever signalled.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The nats-server binary (`NATS_SERVER_BIN`, default `/usr/sbin/nats-server`).
pub fn nats_server_bin() -> PathBuf {
    std::env::var_os("NATS_SERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/sbin/nats-server"))
}

/// A nats-server child process owned by one test.
#[derive(Debug)]
pub struct NatsServer {
    port: u16,
    store: tempfile::TempDir,
    extra_args: Vec<String>,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts a server with JetStream on a free loopback port and waits until it answers.
    ///
    /// # Panics
    ///
    /// If the binary cannot be started or the port does not answer within 10 s.
    pub fn start() -> Self {
        Self::start_with_args(&[])
    }

    /// Like [`NatsServer::start`], with extra command-line arguments for nats-server.
    pub fn start_with_args(extra_args: &[&str]) -> Self {
        let port = free_port();
        let store = tempfile::tempdir().expect("create a temporary directory for the store");
        let mut server = Self {
            port,
            store,
            extra_args: extra_args.iter().map(|s| (*s).to_owned()).collect(),
            child: None,
        };
        server.spawn();
        server
    }

    /// The client URL, `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The JetStream store directory (kept across restarts).
    pub fn store_dir(&self) -> &Path {
        self.store.path()
    }

    /// The pid of the running server, if it is running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the server is running (started and not stopped).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Stops the server gracefully (SIGTERM to its own pid, so the file store is flushed),
    /// falling back to SIGKILL after 10 s, and waits for it to exit.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = child.id().to_string();
        let signalled = Command::new("kill")
            .args(["-TERM", &pid])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if signalled {
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = child.try_wait() {
                    self.wait_port_closed();
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        self.wait_port_closed();
    }

    /// Kills the server without warning (SIGKILL to its own pid) and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            self.wait_port_closed();
        }
    }

    /// Starts the server again on the same port with the same store directory.
    ///
    /// # Panics
    ///
    /// If it is still running, or does not answer within 10 s.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "restart() of a running nats-server");
        self.spawn();
    }

    fn spawn(&mut self) {
        let bin = nats_server_bin();
        let port = self.port.to_string();
        let store = self.store.path().to_owned();
        let child = Command::new(&bin)
            .args(["-a", "127.0.0.1", "-p", &port, "-js", "-sd"])
            .arg(&store)
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {}: {e}; install nats-server (apt-get install nats-server) \
                     or set NATS_SERVER_BIN",
                    bin.display()
                )
            });
        self.child = Some(child);
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let start = Instant::now();
        loop {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return;
            }
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                panic!(
                    "{} exited at start ({status}) on port {}",
                    bin.display(),
                    self.port
                );
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "nats-server on port {} did not answer within 10 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_port_closed(&self) {
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5)
            && TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_ok()
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A loopback port nobody listens on right now.
fn free_port() -> u16 {
    let listener = TcpListener::bind(("127.0.0.1", 0)).expect("bind a free loopback port");
    listener
        .local_addr()
        .expect("local address of a bound listener")
        .port()
}
