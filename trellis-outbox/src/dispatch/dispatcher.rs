//! The [`OutboxDispatcher`]: its builder, the handle that wakes it, shutdown, and the
//! Postgres wake-up listener that runs beside it. What the task does is in `worker.rs`;
//! one drain is in `engine.rs`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

#[cfg(feature = "postgres")]
use crate::dispatch::error::report_error;
use crate::dispatch::error::{DispatchError, ErrorCallback};
use crate::dispatch::handoff::Lane;
use crate::dispatch::options::{DispatchOptions, option_setters};
use crate::dispatch::publisher::Publisher;
use crate::dispatch::repository::OutboxRepository;
#[cfg(doc)]
use crate::dispatch::retry::RetryPolicy;
use crate::dispatch::worker::{BacklogReport, LaneReceiver, Retention, Timing, Worker};

/// How many handed-over rows may wait for a dispatcher's handoff lane, by default
/// ([`DispatcherBuilder::max_handoff_backlog`]).
pub const DEFAULT_MAX_HANDOFF_BACKLOG: usize = 10_000;

/// How often a dispatcher reports the backlog gauges, by default.
pub const DEFAULT_BACKLOG_EVERY: Duration = Duration::from_secs(15);

/// Builds an [`OutboxDispatcher`]; see [`OutboxDispatcher::builder`].
pub struct DispatcherBuilder<R, P> {
    repository: R,
    publisher: P,
    options: DispatchOptions,
    debounce: Duration,
    max_wait: Duration,
    idle_interval: Duration,
    on_error: Option<ErrorCallback>,
    retain_dispatched: Option<Duration>,
    backlog_every: Option<Duration>,
    max_handoff_backlog: usize,
    #[cfg(feature = "postgres")]
    listen: Option<(sqlx::PgPool, crate::OutboxTables)>,
}

impl<R, P> fmt::Debug for DispatcherBuilder<R, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DispatcherBuilder")
            .field("options", &self.options)
            .field("debounce", &self.debounce)
            .field("max_wait", &self.max_wait)
            .field("idle_interval", &self.idle_interval)
            .field("on_error", &self.on_error.is_some())
            .finish_non_exhaustive()
    }
}

impl<R: OutboxRepository, P: Publisher> DispatcherBuilder<R, P> {
    option_setters!(options);

    crate::setters::setters! {
        /// Sets batch size, lease and retry policy at once.
        options(options: DispatchOptions) => options;

        /// How long to wait after a [`notify`](OutboxDispatcher::notify) for more notifies
        /// before draining (default zero: drain at once). Each notify restarts the window,
        /// but never beyond [`max_wait`](Self::max_wait) after the first one. Retry wakeups,
        /// the idle poll and the start-up drain skip the debounce.
        debounce(debounce: Duration) => debounce;

        /// The longest a drain can be postponed by a stream of notifies during the debounce
        /// (default 100 ms), so frequent notifies cannot starve the drain. A `max_wait`
        /// shorter than the debounce shortens the debounce to it.
        max_wait(max_wait: Duration) => max_wait;

        /// How often to drain when nothing else triggers it (default 5 s): a safety net for
        /// notifies that never came (another process enqueued, a notify was lost). Must be
        /// at least 1 ms.
        idle_interval(interval: Duration) => idle_interval;
    }

    /// How many rows handed over at commit ([`HandoffTransaction`](crate::HandoffTransaction))
    /// may wait for the dispatcher to publish them (default
    /// [`DEFAULT_MAX_HANDOFF_BACKLOG`]). The queue lives in memory, and it grows while
    /// publishing falls behind (a broker that stalls). A commit that would pass the bound
    /// hands nothing over: its rows stay leased to this dispatcher, and any dispatcher claims
    /// them once the lease ends (counted in
    /// [`HANDOFF_OVERFLOW_ROWS`](crate::metrics::HANDOFF_OVERFLOW_ROWS)). At least 1.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn build(repo: trellis_outbox::PgOutboxRepository, publisher: trellis_outbox::JetStreamPublisher) -> Result<(), trellis_outbox::DispatchError> {
    /// use trellis_outbox::OutboxDispatcher;
    ///
    /// let dispatcher = OutboxDispatcher::builder(repo, publisher)
    ///     .max_handoff_backlog(50_000)
    ///     .start()?;
    /// # Ok(()) }
    /// ```
    pub fn max_handoff_backlog(mut self, rows: usize) -> Self {
        self.max_handoff_backlog = rows;
        self
    }

    /// Deletes `dispatched` rows last updated more than `older_than` ago, from the dispatcher
    /// task after a drain, at most every `older_than / 10` (between 1 s and 1 h), 1,000 rows
    /// per statement ([`OutboxRepository::purge_dispatched`]). Off by default; `dead` rows are
    /// never deleted. Failures go to [`on_error`](Self::on_error) (operation `purge
    /// dispatched rows`).
    ///
    /// ```no_run
    /// # fn run(pool: sqlx::PgPool, publisher: trellis_outbox::JetStreamPublisher) -> Result<(), trellis_outbox::DispatchError> {
    /// use std::time::Duration;
    /// use trellis_outbox::{OutboxDispatcher, PgOutboxRepository};
    ///
    /// let dispatcher = OutboxDispatcher::builder(PgOutboxRepository::new(pool), publisher)
    ///     .retain_dispatched(Duration::from_secs(7 * 86_400))
    ///     .start()?;
    /// # let _ = dispatcher; Ok(()) }
    /// ```
    pub fn retain_dispatched(mut self, older_than: Duration) -> Self {
        self.retain_dispatched = Some(older_than);
        self
    }

    /// How often the dispatcher reads the backlog (undispatched rows, the oldest one's age)
    /// into the [`UNDISPATCHED`](crate::metrics::UNDISPATCHED) and
    /// [`LAG_SECONDS`](crate::metrics::LAG_SECONDS) gauges, between drains: default every
    /// [`DEFAULT_BACKLOG_EVERY`]; `None` turns it off. On SQL it is one indexed count of
    /// the undispatched rows.
    pub fn backlog_metrics(mut self, every: Option<Duration>) -> Self {
        self.backlog_every = every.map(|e| e.max(Duration::from_millis(100)));
        self
    }

    /// Called with every [`DispatchError`]: repository errors, publish failures, rows moved
    /// to dead. It runs on the dispatcher task, so keep it short; a panic in it is caught
    /// and logged and does not stop the dispatcher.
    pub fn on_error(mut self, callback: impl Fn(&DispatchError) + Send + Sync + 'static) -> Self {
        self.on_error = Some(Arc::new(callback));
        self
    }

    /// Also wakes the dispatcher when **any process** commits an enqueue on this Postgres
    /// outbox: a [`PgWakeups`](crate::PgWakeups) listener runs
    /// beside the dispatcher task and calls [`notify`](OutboxDispatcher::notify) for every
    /// notification, re-`LISTEN`s after a dropped connection and then notifies once to
    /// re-scan. It stops with the dispatcher. A lost connection sqlx could not restore and
    /// every failed connect or `LISTEN`, the first or a later one, go to
    /// [`on_error`](Self::on_error) (operation `listen for wake-ups`) and are retried with
    /// backoff (100 ms doubling to 5 s); polling every [`idle_interval`](Self::idle_interval)
    /// stays the safety net meanwhile. After an idle interval without a notification (at
    /// least 1 s, at most 30 s) the listener checks its connection with `SELECT 1`; one that
    /// does not answer within 5 s (it died without a reset) is reported the same way and
    /// replaced. The listener opens its own connection with `pool`'s connect options (one
    /// more than the pool's `max_connections`), so it never takes one from the pool.
    ///
    /// `tables` must be the outbox's tables (the channel is derived from the outbox table).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use trellis_outbox::{JetStreamPublisher, OutboxDispatcher, OutboxTables, PgOutboxRepository};
    ///
    /// # async fn run(pool: sqlx::PgPool, nats: async_nats::Client) -> Result<(), Box<dyn std::error::Error>> {
    /// let publisher = JetStreamPublisher::new(async_nats::jetstream::new(nats));
    /// let dispatcher = OutboxDispatcher::builder(PgOutboxRepository::new(pool.clone()), publisher)
    ///     .listen_postgres(&pool, &OutboxTables::default())
    ///     .start()?;
    /// // … other processes enqueue; this dispatcher wakes on their commits …
    /// dispatcher.shutdown().await;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    pub fn listen_postgres(mut self, pool: &sqlx::PgPool, tables: &crate::OutboxTables) -> Self {
        self.listen = Some((pool.clone(), tables.clone()));
        self
    }

    /// Validates the options and spawns the dispatcher task on the current tokio runtime.
    /// The task drains once at once (rows left by a previous process go out without waiting
    /// for a notify).
    ///
    /// # Errors
    ///
    /// [`DispatchError::InvalidOption`] for an out-of-range option, or
    /// [`DispatchError::NoRuntime`] outside a tokio runtime.
    pub fn start(self) -> Result<OutboxDispatcher, DispatchError> {
        self.options.validate(&self.publisher)?;
        if self.max_handoff_backlog == 0 {
            return Err(DispatchError::InvalidOption {
                option: "max_handoff_backlog",
                problem: "must be at least 1 row (use a plain transaction to hand nothing over)",
            });
        }
        if self.idle_interval < Duration::from_millis(1) {
            return Err(DispatchError::InvalidOption {
                option: "idle_interval",
                problem: "must be at least 1 ms (zero would poll in a busy loop)",
            });
        }
        let runtime =
            tokio::runtime::Handle::try_current().map_err(|_| DispatchError::NoRuntime)?;
        let (wake_tx, wake_rx) = mpsc::channel(1);
        let cancel = CancellationToken::new();
        let (handoffs, lane) = match self.repository.handoff_target() {
            Some(target) => {
                let (rows_tx, rows_rx) = mpsc::unbounded_channel();
                let token: Arc<str> = crate::record::new_id().into();
                let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
                let lane = Lane {
                    target,
                    token: Arc::clone(&token),
                    lease: self.options.lease,
                    rows: rows_tx,
                    queued: Arc::clone(&queued),
                    max_queued: self.max_handoff_backlog,
                };
                let receiver = LaneReceiver {
                    rows: rows_rx,
                    token,
                    wake: wake_tx.clone(),
                    queued,
                };
                (Some(lane), Some(receiver))
            }
            None => (None, None),
        };
        let worker = Worker {
            repo: Arc::new(self.repository),
            publisher: Arc::new(self.publisher),
            lane,
            options: self.options,
            timing: Timing {
                debounce: self.debounce.min(self.max_wait),
                max_wait: self.max_wait,
                idle_interval: self.idle_interval,
            },
            on_error: self.on_error.clone(),
            cancel: cancel.clone(),
            wake: wake_rx,
            retention: self.retain_dispatched.map(Retention::new),
            backlog: self.backlog_every.map(BacklogReport::new),
        };
        let task = runtime.spawn(
            worker
                .run()
                .instrument(tracing::info_span!("outbox_dispatcher")),
        );
        let handle = DispatcherHandle {
            shared: Arc::new(Shared {
                wake: wake_tx,
                cancel: cancel.clone(),
                handoffs,
            }),
        };
        #[cfg(feature = "postgres")]
        let listener = self.listen.map(|(pool, tables)| {
            runtime.spawn(
                listen(
                    pool,
                    tables,
                    handle.clone(),
                    cancel,
                    self.on_error.clone(),
                    self.idle_interval
                        .clamp(Duration::from_secs(1), Duration::from_secs(30)),
                )
                .instrument(tracing::info_span!("outbox_wakeups")),
            )
        });
        #[cfg(not(feature = "postgres"))]
        let listener = None;
        Ok(OutboxDispatcher {
            handle,
            task: Some(task),
            listener,
        })
    }
}

#[derive(Debug)]
struct Shared {
    wake: mpsc::Sender<()>,
    cancel: CancellationToken,
    /// Where [`HandoffTransaction`](crate::HandoffTransaction)s hand rows over, if the
    /// repository has an SQL outbox.
    handoffs: Option<Lane>,
}

/// A cheap, cloneable handle to wake an [`OutboxDispatcher`] — hand one to request handlers
/// so they can [`notify`](Self::notify) after committing. Holding a handle does not keep
/// the dispatcher running.
#[derive(Debug, Clone)]
pub struct DispatcherHandle {
    shared: Arc<Shared>,
}

impl DispatcherHandle {
    /// Tells the dispatcher that rows were committed. Cheap and non-blocking; notifies that
    /// arrive before the drain starts are coalesced into one drain, and notifies during a
    /// drain cause exactly one more pass after it. Does nothing once the dispatcher is
    /// shutting down. Call it only **after** the transaction committed.
    pub fn notify(&self) {
        if !self.shared.cancel.is_cancelled() {
            // A full channel means a wakeup is already pending: coalesced.
            let _ = self.shared.wake.try_send(());
        }
    }

    /// Whether the dispatcher has been told to stop (shut down or dropped).
    pub fn is_stopped(&self) -> bool {
        self.shared.cancel.is_cancelled()
    }

    /// The dispatcher's handoff lane, if its repository has an SQL outbox.
    pub(super) fn handoffs(&self) -> Option<&Lane> {
        self.shared.handoffs.as_ref()
    }
}

/// Publishes committed outbox rows from a background tokio task.
///
/// - Drains once at start, then whenever [`notify`](Self::notify)d (with an optional
///   debounce bounded by a maximum wait), when the earliest failed row becomes due again
///   (the retry timer is re-armed from [`OutboxRepository::next_due_in`] after a drain, at
///   most every 100 ms while drains keep finding rows, and from the rows a drain failed
///   itself), and every `idle_interval` as a safety net.
/// - A drain claims batch after batch under a lease until a claim comes back empty. A row
///   that fails during a drain is not retried within it.
/// - Only one claim is ever in flight per dispatcher. Several dispatchers (in one process or
///   many) can share a database: leases and fencing tokens keep each row with one of them.
/// - Errors are logged with `tracing` and passed to [`DispatcherBuilder::on_error`]; a
///   repository error makes the task back off (100 ms doubling to 5 s, with jitter,
///   whatever the rows' retry policy and the idle interval) and try again.
///
/// # Stopping
///
/// [`shutdown`](Self::shutdown) stops claiming, lets the in-flight batch finish (rows claimed
/// but not yet attempted are released), and returns once the task has ended. **Dropping** the
/// dispatcher also stops the task the same way, but does not wait for it.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use trellis_outbox::{
///     MemoryOutboxRepository, OutboxDispatcher, OutboxMessage, OutboxMessageState,
///     PreparedOutboxRecord, PublishError, Publisher,
/// };
///
/// struct Print;
///
/// impl Publisher for Print {
///     async fn publish_batch(
///         &self,
///         messages: &[OutboxMessage],
///     ) -> Vec<Result<Option<serde_json::Value>, PublishError>> {
///         messages.iter().map(|m| { println!("{} {}", m.subject, m.payload); Ok(None) }).collect()
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let repo = Arc::new(MemoryOutboxRepository::new());
/// let dispatcher = OutboxDispatcher::builder(repo.clone(), Print)
///     .debounce(Duration::from_millis(5))
///     .on_error(|error| eprintln!("outbox: {error}"))
///     .start()?;
/// let handle = dispatcher.handle(); // give clones to request handlers
///
/// // … in a handler, after the transaction committed:
/// let row = repo.enqueue(&PreparedOutboxRecord::event("A.Happened", "events.v1.A.Happened", &1)?)?;
/// handle.notify();
///
/// # for _ in 0..1000 {
/// #     if repo.get(&row.id).unwrap().state == OutboxMessageState::Dispatched { break; }
/// #     tokio::time::sleep(Duration::from_millis(1)).await;
/// # }
/// dispatcher.shutdown().await;
/// assert_eq!(repo.get(&row.id).unwrap().state, OutboxMessageState::Dispatched);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct OutboxDispatcher {
    handle: DispatcherHandle,
    task: Option<JoinHandle<()>>,
    /// The `LISTEN` task of [`DispatcherBuilder::listen_postgres`].
    listener: Option<JoinHandle<()>>,
}

impl OutboxDispatcher {
    /// Starts building a dispatcher over `repository` and `publisher`. Pass an `Arc` of
    /// either to keep using it elsewhere.
    ///
    /// Defaults: batches of 100, 30 s lease, no debounce (100 ms max wait), 5 s idle
    /// interval, [`RetryPolicy::default`], no error callback.
    pub fn builder<R: OutboxRepository, P: Publisher>(
        repository: R,
        publisher: P,
    ) -> DispatcherBuilder<R, P> {
        DispatcherBuilder {
            repository,
            publisher,
            options: DispatchOptions::default(),
            debounce: Duration::ZERO,
            max_wait: Duration::from_millis(100),
            idle_interval: Duration::from_secs(5),
            on_error: None,
            retain_dispatched: None,
            backlog_every: Some(DEFAULT_BACKLOG_EVERY),
            max_handoff_backlog: DEFAULT_MAX_HANDOFF_BACKLOG,
            #[cfg(feature = "postgres")]
            listen: None,
        }
    }

    /// Tells the dispatcher that rows were committed; see [`DispatcherHandle::notify`].
    pub fn notify(&self) {
        self.handle.notify();
    }

    /// A cloneable handle for notifying from elsewhere (request handlers).
    pub fn handle(&self) -> DispatcherHandle {
        self.handle.clone()
    }

    /// Stops claiming, lets the in-flight batch finish (releasing rows of a claim that were
    /// not attempted), and returns once the task has ended.
    ///
    /// This waits for an in-flight publish; to bound the wait, use
    /// [`shutdown_timeout`](Self::shutdown_timeout).
    pub async fn shutdown(mut self) {
        self.handle.shared.cancel.cancel();
        if let Some(task) = self.task.take() {
            join(task).await;
        }
        if let Some(listener) = self.listener.take() {
            join(listener).await;
        }
    }

    /// Like [`shutdown`](Self::shutdown), but aborts the task if it has not ended after
    /// `timeout` (rows it held stay leased until their lease expires, then are claimed
    /// again). Returns `true` if the task ended cleanly in time.
    pub async fn shutdown_timeout(mut self, timeout: Duration) -> bool {
        self.handle.shared.cancel.cancel();
        let Some(mut task) = self.task.take() else {
            return true;
        };
        let started = Instant::now();
        match tokio::time::timeout(timeout, &mut task).await {
            Ok(result) => {
                log_join(result);
                if let Some(mut listener) = self.listener.take() {
                    let left = timeout.saturating_sub(started.elapsed());
                    match tokio::time::timeout(left, &mut listener).await {
                        Ok(result) => log_join(result),
                        Err(_) => listener.abort(),
                    }
                }
                true
            }
            Err(_) => {
                task.abort();
                tracing::warn!(?timeout, "outbox dispatcher did not stop in time; aborted");
                false
            }
        }
    }
}

impl Drop for OutboxDispatcher {
    /// Stops the task (as `shutdown` does) without waiting for it.
    fn drop(&mut self) {
        self.handle.shared.cancel.cancel();
    }
}

async fn join(task: JoinHandle<()>) {
    log_join(task.await);
}

fn log_join(result: std::result::Result<(), tokio::task::JoinError>) {
    if let Err(error) = result
        && error.is_panic()
    {
        tracing::error!(%error, "outbox dispatcher task panicked");
    }
}

/// The task of [`DispatcherBuilder::listen_postgres`]: runs a [`PgWakeups`] listener that
/// notifies `handle` (connecting and re-connecting with backoff, each failure reported as
/// a repository error of operation "listen for wake-ups") until `cancel`. The listener checks
/// its connection after `health_every` (the idle interval, from 1 to 30 s) without a
/// notification.
///
/// [`PgWakeups`]: crate::PgWakeups
#[cfg(feature = "postgres")]
async fn listen(
    pool: sqlx::PgPool,
    tables: crate::OutboxTables,
    handle: DispatcherHandle,
    cancel: CancellationToken,
    on_error: Option<ErrorCallback>,
    health_every: Duration,
) {
    let wakeups = crate::PgWakeups::start(
        &pool,
        &tables,
        move || handle.notify(),
        move |error| {
            report_error(
                on_error.as_deref(),
                &DispatchError::Repository {
                    operation: "listen for wake-ups",
                    source: error,
                },
            );
        },
        health_every,
    );
    cancel.cancelled().await;
    wakeups.stop().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::publisher::TestPublisher;

    #[test]
    fn start_outside_a_runtime_is_an_error() {
        let repo = crate::MemoryOutboxRepository::new();
        let err = OutboxDispatcher::builder(repo, TestPublisher(None))
            .start()
            .unwrap_err();
        assert!(matches!(err, DispatchError::NoRuntime));
    }

    #[test]
    fn an_empty_handoff_backlog_is_refused() {
        let repo = crate::MemoryOutboxRepository::new();
        let err = OutboxDispatcher::builder(repo, TestPublisher(None))
            .max_handoff_backlog(0)
            .start()
            .unwrap_err();
        assert!(
            matches!(
                err,
                DispatchError::InvalidOption {
                    option: "max_handoff_backlog",
                    ..
                }
            ),
            "{err}"
        );
    }
}
