//! Cross-process wake-ups on PostgreSQL: `LISTEN` for the notifications enqueues send.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::error::{Error, Result};
use crate::sql::notify_channel;
use crate::tables::OutboxTables;

const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How long [`PgWakeups::listen`]'s listener may hear nothing before it checks its
/// connection.
const HEALTH_EVERY: Duration = Duration::from_secs(30);
/// How long the check may take before the connection is taken for dead.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

/// [`Outbox::wake`](crate::Outbox::wake)'s statement: a `NOTIFY` on `$1` in a transaction of
/// its own that does not wait for its commit record to reach the disk
/// (`synchronous_commit = off` for that transaction only; the setting is read at commit,
/// before the transaction's settings are undone).
const WAKE: &str = "SELECT pg_notify($1, '')::text \
     FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit";

/// Sends [`WAKE`] on `channel` in an autocommit statement on `pool`.
pub(crate) async fn wake(pool: &PgPool, channel: &str) -> sqlx::Result<()> {
    sqlx::query(WAKE).bind(channel).execute(pool).await?;
    Ok(())
}
const UNLISTEN_TIMEOUT: Duration = Duration::from_secs(1);
/// The least time the listener's connect may take (see `own_connection`).
const MIN_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Calls a wake-up function whenever a transaction that enqueued rows on this outbox commits,
/// in any process (Postgres `LISTEN`/`NOTIFY`).
///
/// Every [`enqueue`](crate::OutboxTransactionExt::enqueue) on Postgres sends a payload-less
/// notification on [`SqlStatements::notify_channel`](crate::SqlStatements::notify_channel);
/// Postgres delivers it only if the transaction commits. Notifications are hints: after the
/// listening connection drops, the listener connects and `LISTEN`s again and **then** calls
/// the wake-up function once, so rows committed while it was deaf are found by the re-scan.
/// Keep polling as the safety net (the dispatcher's idle interval).
///
/// A connection can also die without either side being told (a host or a network path
/// gone: no reset ever arrives), and a listener waiting on it would hear nothing from then
/// on. So after 30 s without a notification the listener sends `SELECT 1` on its connection;
/// without an answer within 5 s it drops the connection and connects again (then wakes). A
/// `LISTEN` gets the same 5 s.
///
/// The listener opens a connection of its own with `pool`'s connect options and holds it
/// while it runs; it takes no connection from `pool` (and so counts outside its
/// `max_connections`). Each reconnect opens a fresh one: a connection that went silent is
/// dropped without waiting for TCP to give up on it.
///
/// # Examples
///
/// ```no_run
/// use trellis_outbox::{
///     JetStreamPublisher, OutboxDispatcher, OutboxTables, PgOutboxRepository, PgWakeups,
/// };
///
/// # async fn run(pool: sqlx::PgPool, nats: async_nats::Client) -> Result<(), Box<dyn std::error::Error>> {
/// let publisher = JetStreamPublisher::new(async_nats::jetstream::new(nats));
/// let dispatcher =
///     OutboxDispatcher::builder(PgOutboxRepository::new(pool.clone()), publisher).start()?;
/// let handle = dispatcher.handle();
/// let wakeups =
///     PgWakeups::listen(&pool, &OutboxTables::default(), move || handle.notify()).await?;
/// // …
/// wakeups.stop().await;
/// dispatcher.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct PgWakeups {
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl PgWakeups {
    /// Starts listening. Returns once the first `LISTEN` is in place, so every commit after
    /// this returns is noticed.
    ///
    /// # Errors
    ///
    /// [`Error::Repository`] (operation `listen`) if the first connection or `LISTEN` fails.
    pub async fn listen<F>(pool: &PgPool, tables: &OutboxTables, wake: F) -> Result<Self>
    where
        F: Fn() + Send + Sync + 'static,
    {
        let channel = notify_channel(tables);
        let listener = connect(pool, &channel).await?;
        Ok(Self::spawn(
            pool,
            channel,
            Arc::new(wake),
            Some(listener),
            None,
            HEALTH_EVERY,
        ))
    }

    /// Starts listening in the background without waiting for the first `LISTEN`: the task
    /// connects (retrying with backoff), calls `wake` once it listens, and reports every
    /// failed connect or `LISTEN`, and every lost connection sqlx could not restore, to
    /// `on_error` (operation `listen`). It checks its connection after `health_every`
    /// without a notification.
    pub(crate) fn start(
        pool: &PgPool,
        tables: &OutboxTables,
        wake: impl Fn() + Send + Sync + 'static,
        on_error: impl Fn(Error) + Send + Sync + 'static,
        health_every: Duration,
    ) -> Self {
        Self::spawn(
            pool,
            notify_channel(tables),
            Arc::new(wake),
            None,
            Some(Arc::new(on_error)),
            health_every,
        )
    }

    fn spawn(
        pool: &PgPool,
        channel: String,
        wake: Arc<dyn Fn() + Send + Sync>,
        first: Option<Listener>,
        on_error: Option<Arc<dyn Fn(Error) + Send + Sync>>,
        health_every: Duration,
    ) -> Self {
        let (stop, stopped) = watch::channel(false);
        let listening = Listening {
            pool: pool.clone(),
            channel,
            wake,
            on_error,
            health_every,
        };
        let task = tokio::spawn(run(listening, first, stopped));
        Self {
            stop,
            task: Some(task),
        }
    }

    /// Stops listening and waits for the listener task to end.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take()
            && let Err(error) = task.await
            && error.is_panic()
        {
            tracing::error!(%error, "the outbox wake-up listener task panicked");
        }
    }
}

/// Dropping the handle stops the listener too (without waiting for it).
impl Drop for PgWakeups {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// A listening connection and the pool of one it came from.
struct Listener {
    listener: PgListener,
    own: PgPool,
}

impl Listener {
    /// Stops listening and closes the connection (a `Terminate`, not a dropped socket),
    /// each step bounded, in case the connection is gone.
    async fn close(mut self) {
        let _ = tokio::time::timeout(UNLISTEN_TIMEOUT, self.listener.unlisten_all()).await;
        // Dropping it hands the connection back to `own` (after an `UNLISTEN` sent from a
        // task), which `close` then closes.
        drop(self.listener);
        let _ = tokio::time::timeout(UNLISTEN_TIMEOUT, self.own.close()).await;
    }
}

async fn connect(pool: &PgPool, channel: &str) -> Result<Listener> {
    let listen_error = Error::repository("listen");
    let own = own_connection(pool);
    let mut listener = PgListener::connect_with(&own)
        .await
        .map_err(&listen_error)?;
    // A lost connection ends `try_recv` at once (`Ok(None)`) instead of reconnecting inside
    // it: the task reconnects itself, and wakes once it listens again. (Reconnecting inside
    // `try_recv` could be cut short by the health check, whose query would then reconnect
    // silently, and the re-scan wake-up would be lost.)
    listener.eager_reconnect(false);
    // Bounded like the health check: a connection that goes silent after the server ran the
    // `LISTEN` but before its answer arrived would otherwise hold the listener here for good,
    // where no health check runs.
    if let Err(error) = answered("`LISTEN`", listener.listen(channel)).await {
        Listener { listener, own }.close().await;
        return Err(listen_error(error));
    }
    Ok(Listener { listener, own })
}

/// A pool of one connection, opened on demand with `pool`'s connect options, for one
/// listener. `PgListener` keeps its connection for good, so on `pool` it would take one of
/// the application's connections away. And when the listener drops a connection (lost, or
/// silent to the health check), sqlx sends `UNLISTEN` on it from a background task before
/// returning it: on a silent connection that task waits until TCP gives up, minutes later,
/// and the connection would stay taken from `pool` all that time. A pool per connect keeps
/// both out of the application's way.
///
/// The connect may take the pool's `acquire_timeout`, but at least [`MIN_CONNECT_TIMEOUT`]: a
/// fail-fast setting meant for request handlers (250 ms, say) would make every connect of a
/// new connection fail. The pool's `after_connect` hooks do not run on it (its connect
/// options do apply: `search_path`, TLS, application name).
fn own_connection(pool: &PgPool) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(
            pool.options()
                .get_acquire_timeout()
                .max(MIN_CONNECT_TIMEOUT),
        )
        .max_lifetime(None)
        .idle_timeout(None)
        .connect_lazy_with((*pool.connect_options()).clone())
}

/// What the listener task works with.
struct Listening {
    pool: PgPool,
    channel: String,
    wake: Arc<dyn Fn() + Send + Sync>,
    on_error: Option<Arc<dyn Fn(Error) + Send + Sync>>,
    health_every: Duration,
}

/// Whether `listener`'s connection still answers: `SELECT 1` within [`HEALTH_TIMEOUT`].
/// (Notifications that arrive meanwhile are buffered by the listener, not lost.)
async fn healthy(listener: &mut PgListener) -> std::result::Result<(), sqlx::Error> {
    answered("a health check", sqlx::query("SELECT 1").execute(listener))
        .await
        .map(drop)
}

/// `request`'s answer on the listening connection, or a timed-out error naming `what` once
/// [`HEALTH_TIMEOUT`] has passed without one.
async fn answered<T>(
    what: &str,
    request: impl std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
) -> std::result::Result<T, sqlx::Error> {
    match tokio::time::timeout(HEALTH_TIMEOUT, request).await {
        Ok(answer) => answer,
        Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the listening connection did not answer {what} within {HEALTH_TIMEOUT:?}"),
        ))),
    }
}

async fn run(listening: Listening, first: Option<Listener>, mut stopped: watch::Receiver<bool>) {
    let Listening {
        pool,
        channel,
        wake,
        on_error,
        health_every,
    } = listening;
    let mut listener = first;
    let mut backoff = Duration::from_millis(100);
    loop {
        if *stopped.borrow() {
            break;
        }
        let Some(active) = listener.as_mut() else {
            // Shutdown does not wait for a connect to a database that is down.
            let connected = tokio::select! {
                connected = connect(&pool, &channel) => connected,
                _ = stopped.changed() => break,
            };
            match connected {
                Ok(fresh) => {
                    tracing::info!(%channel, "outbox wake-up listener is listening");
                    listener = Some(fresh);
                    backoff = Duration::from_millis(100);
                    // Listening again: now re-scan for what was committed meanwhile.
                    wake();
                }
                Err(error) => {
                    tracing::warn!(%channel, %error, ?backoff, "outbox wake-up listener cannot reconnect");
                    if let Some(on_error) = &on_error {
                        on_error(error);
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = stopped.changed() => return,
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
            continue;
        };
        tokio::select! {
            _ = stopped.changed() => break,
            // Quiet for a while: a connection that died without a reset would stay quiet
            // for ever. (`try_recv` is cancel-safe: a message half read stays buffered.)
            () = tokio::time::sleep(health_every) => {
                if let Err(error) = healthy(&mut active.listener).await {
                    tracing::warn!(%channel, %error, "outbox wake-up listener's connection does not answer; connecting again");
                    if let Some(on_error) = &on_error {
                        on_error(Error::repository("listen")(error));
                    }
                    listener = None;
                }
            }
            received = active.listener.try_recv() => match received {
                Ok(Some(_)) => wake(),
                // The connection dropped: connect and `LISTEN` again, then re-scan for
                // what was committed meanwhile.
                Ok(None) => {
                    tracing::info!(%channel, "outbox wake-up listener lost its connection; connecting again");
                    listener = None;
                }
                Err(error) => {
                    tracing::warn!(%channel, %error, "outbox wake-up listener lost its connection");
                    if let Some(on_error) = &on_error {
                        on_error(Error::repository("listen")(error));
                    }
                    listener = None;
                }
            },
        }
    }
    // Stop listening before `stop()` returns (dropping a `PgListener` only queues its
    // `UNLISTEN` on a background task).
    if let Some(listener) = listener {
        listener.close().await;
    }
}
