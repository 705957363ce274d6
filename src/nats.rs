//! NATS JetStream test support: a connection to the test server and uniquely named streams
//! that are deleted at the end of the test, even when it panics.

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::{Config, StorageType};

use crate::nats_url;

/// How to start the NATS server the tests expect.
pub const NATS_HINT: &str = "start it with `start-stop-daemon --start --oknodo --background \
     --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server \
     -l /var/log/nats-server.log` or point NATS_URL at a server with JetStream enabled";

/// A JetStream context on the server at [`nats_url`].
///
/// # Panics
///
/// If the server cannot be reached or has no JetStream, with a message saying how to start it.
pub async fn jetstream() -> Context {
    let url = nats_url();
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(3))
        .max_reconnects(Some(3))
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach NATS at {url}: {e}; {NATS_HINT}"));
    let js = async_nats::jetstream::new(client);
    // Any JetStream API answer (here: "stream not found") proves JetStream is enabled.
    match js.get_stream("TRELLIS_T_PROBE_NONEXISTENT").await {
        Ok(_) => {}
        Err(e) if matches!(e.kind(), GetStreamErrorKind::JetStream(_)) => {}
        Err(e) => panic!("NATS at {url} does not answer JetStream requests: {e}; {NATS_HINT}"),
    }
    sweep_stale(&js).await;
    js
}

/// Streams (and KV buckets) tests create are named `TRELLIS_T_<ulid>` (`KV_trellis_t_<ulid>`);
/// a test that panics before its cleanup leaves its own behind. Stale ones
/// ([`is_stale`](crate::is_stale)) are deleted, as the Postgres test databases are.
async fn sweep_stale(js: &Context) {
    use futures::TryStreamExt as _;
    let Ok(names) = js.stream_names().try_collect::<Vec<String>>().await else {
        return;
    };
    for name in names {
        let id = name
            .strip_prefix("TRELLIS_T_")
            .or_else(|| name.strip_prefix("KV_trellis_t_"));
        if id.is_some_and(crate::is_stale) {
            let _ = js.delete_stream(&name).await;
        }
    }
    // Each consumer a test starts with dead letters on makes a durable of its name on the
    // shared replay stream; test consumers are named `<letters><ulid>`.
    if let Ok(replays) = js.get_stream(trellis_outbox::REPLAY_STREAM).await {
        let Ok(names) = replays.consumer_names().try_collect::<Vec<String>>().await else {
            return;
        };
        for name in names {
            let id = name.get(name.len().saturating_sub(26)..);
            if id.is_some_and(|id| name.len() > 26 && crate::is_stale(id)) {
                let _ = replays.delete_consumer(&name).await;
                let _ = replays
                    .purge()
                    .filter(format!(
                        "{}.{name}.>",
                        trellis_outbox::REPLAY_SUBJECT_PREFIX
                    ))
                    .await;
            }
        }
    }
}

/// A JetStream context on `url` that reconnects forever, every 100 ms: for a private
/// [`NatsServer`](crate::nats_server::NatsServer) a test stops and restarts.
///
/// # Panics
///
/// If the server cannot be reached at first.
pub async fn connect_reconnecting(url: &str) -> Context {
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(2))
        .max_reconnects(None)
        .reconnect_delay_callback(|_| Duration::from_millis(100))
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("cannot reach the test's own nats-server at {url}: {e}"));
    async_nats::jetstream::new(client)
}

/// A uniquely named stream for one test.
#[derive(Debug, Clone)]
pub struct TestStream {
    /// The context it was created with.
    pub context: Context,
    /// The stream name, `TRELLIS_T_<ULID>`.
    pub name: String,
    /// A subject token unique to this stream, `t<ulid>`; [`TestStream::events`] captures
    /// `<token>.>`.
    pub token: String,
}

impl TestStream {
    /// A memory-storage stream capturing `<token>.>`, with the server's default duplicate
    /// window.
    pub async fn events(context: &Context) -> Self {
        Self::create(context, |token| Config {
            subjects: vec![format!("{token}.>")],
            ..Config::default()
        })
        .await
    }

    /// A memory-storage stream configured by `configure(token)` (name and storage are
    /// filled in).
    ///
    /// # Panics
    ///
    /// If the stream cannot be created.
    pub async fn create(context: &Context, configure: impl FnOnce(&str) -> Config) -> Self {
        Self::create_stored(context, StorageType::Memory, configure).await
    }

    /// Like [`TestStream::create`], with file storage: the stream and its messages survive a
    /// restart of the server (see [`NatsServer`](crate::nats_server::NatsServer)).
    pub async fn create_file(context: &Context, configure: impl FnOnce(&str) -> Config) -> Self {
        Self::create_stored(context, StorageType::File, configure).await
    }

    async fn create_stored(
        context: &Context,
        storage: StorageType,
        configure: impl FnOnce(&str) -> Config,
    ) -> Self {
        let ulid = ulid::Ulid::generate().to_string();
        let token = format!("t{}", ulid.to_lowercase());
        let name = format!("TRELLIS_T_{ulid}");
        let config = Config {
            name: name.clone(),
            storage,
            ..configure(&token)
        };
        context
            .create_stream(config)
            .await
            .unwrap_or_else(|e| panic!("cannot create test stream {name}: {e}"));
        Self {
            context: context.clone(),
            name,
            token,
        }
    }

    /// `<token>.<rest>`: a subject this stream captures (for [`TestStream::events`]).
    pub fn subject(&self, rest: &str) -> String {
        format!("{}.{rest}", self.token)
    }

    /// How many messages the stream holds.
    pub async fn count(&self) -> u64 {
        let mut stream = self
            .context
            .get_stream(&self.name)
            .await
            .unwrap_or_else(|e| panic!("cannot get stream {}: {e}", self.name));
        stream
            .info()
            .await
            .unwrap_or_else(|e| panic!("cannot get info of stream {}: {e}", self.name))
            .state
            .messages
    }

    /// Every message of the stream, in sequence order.
    pub async fn messages(&self) -> Vec<StreamMessage> {
        let mut stream = self
            .context
            .get_stream(&self.name)
            .await
            .unwrap_or_else(|e| panic!("cannot get stream {}: {e}", self.name));
        let state = stream
            .info()
            .await
            .unwrap_or_else(|e| panic!("cannot get info of stream {}: {e}", self.name))
            .state
            .clone();
        if state.messages == 0 {
            return Vec::new();
        }
        let mut messages = Vec::with_capacity(state.messages as usize);
        for sequence in state.first_sequence..=state.last_sequence {
            match stream.get_raw_message(sequence).await {
                Ok(message) => messages.push(message),
                Err(e) if e.kind() == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound => {}
                Err(e) => panic!("cannot read message {sequence} of {}: {e}", self.name),
            }
        }
        messages
    }

    /// Deletes the stream (errors are ignored: it may already be gone).
    pub async fn delete(&self) {
        let _ = self.context.delete_stream(&self.name).await;
    }

    /// Runs `body` in its own task, deletes the stream, then re-raises a panic of `body`.
    pub async fn run<F>(&self, body: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let outcome = tokio::spawn(body).await;
        self.delete().await;
        if let Err(e) = outcome {
            match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(e) => panic!("test task failed: {e}"),
            }
        }
    }
}
