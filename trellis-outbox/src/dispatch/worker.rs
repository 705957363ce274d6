//! When to drain: the dispatcher task's loop. It drains at start (after the publisher's
//! start-up checks and the sweep of unfinishable rows), then whenever notified (debounced),
//! when the earliest failed row is due again, and every idle interval; it backs off after
//! repository errors.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use crate::dispatch::engine::{Engine, Wave, deadline};
use crate::dispatch::error::{DispatchError, ErrorCallback, report_error};
use crate::dispatch::handoff::Handoff;
use crate::dispatch::options::{DispatchOptions, DispatchReport};
use crate::dispatch::publisher::Publisher;
use crate::dispatch::repository::{OutboxRepository, PoisonRow};
use crate::dispatch::retry::{MIN_RETRY_DELAY, RetryPolicy};

/// The dispatcher task.
pub(super) struct Worker<R, P> {
    /// Shared with the task that asks for the next due time.
    pub(super) repo: Arc<R>,
    /// Shared with the handoff lane.
    pub(super) publisher: Arc<P>,
    /// Rows handed over at commit, if the repository takes handoffs.
    pub(super) lane: Option<LaneReceiver>,
    pub(super) options: DispatchOptions,
    pub(super) timing: Timing,
    pub(super) on_error: Option<ErrorCallback>,
    pub(super) cancel: CancellationToken,
    /// Notifies from the handle (a one-slot channel: they coalesce).
    pub(super) wake: mpsc::Receiver<()>,
    /// Deleting old dispatched rows, if asked for.
    pub(super) retention: Option<Retention>,
    /// Reporting the backlog gauges: how often, and when next.
    pub(super) backlog: Option<BacklogReport>,
}

/// The task's end of the handoff lane.
pub(super) struct LaneReceiver {
    pub(super) rows: mpsc::UnboundedReceiver<Handoff>,
    /// The token handed-over rows are written with.
    pub(super) token: Arc<str>,
    /// The drains' notify channel: told when handed-over rows failed.
    pub(super) wake: mpsc::Sender<()>,
    /// Rows sent and not yet taken (see [`Lane::queued`](super::handoff::Lane)).
    pub(super) queued: Arc<std::sync::atomic::AtomicUsize>,
}

/// When the task drains besides notifies and retry timers.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timing {
    /// How long a notify waits for more before draining, at most `max_wait` in all.
    pub(super) debounce: Duration,
    pub(super) max_wait: Duration,
    /// The safety-net poll.
    pub(super) idle_interval: Duration,
}

/// [`DispatcherBuilder::retain_dispatched`](crate::DispatcherBuilder::retain_dispatched): how
/// old a dispatched row may get, and when to purge next.
#[derive(Debug)]
pub(super) struct Retention {
    older_than: Duration,
    every: Duration,
    next: Instant,
    /// The purge running on a task of its own: deleting a large backlog of old rows takes
    /// many statements, which must not hold up drains or shutdown.
    running: Option<tokio::task::JoinHandle<crate::Result<u64>>>,
}

/// [`DispatcherBuilder::backlog_every`](crate::DispatcherBuilder::backlog_every): how often
/// to report the backlog gauges, when next, and the count running.
#[derive(Debug)]
pub(super) struct BacklogReport {
    every: Duration,
    next: Instant,
    running: Option<tokio::task::JoinHandle<()>>,
}

impl BacklogReport {
    pub(super) fn new(every: Duration) -> Self {
        Self {
            every,
            next: Instant::now(),
            running: None,
        }
    }
}

/// Rows per purge statement.
const PURGE_BATCH: usize = 1_000;

impl Retention {
    pub(super) fn new(older_than: Duration) -> Self {
        Self {
            older_than,
            every: (older_than / 10).clamp(Duration::from_secs(1), Duration::from_secs(3_600)),
            next: Instant::now(),
            running: None,
        }
    }
}

/// How often a busy dispatcher asks [`OutboxRepository::next_due_in`] at most: in between,
/// notified drains take the due rows.
const DUE_ASK_EVERY: Duration = Duration::from_millis(100);

/// What one drain did.
struct Drained {
    /// How many rows it claimed.
    claimed: u64,
    /// When the earliest row it failed is due again.
    retry_at: Option<Instant>,
}

/// Why the worker's wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    Stop,
    Drain,
}

impl<R: OutboxRepository, P: Publisher> Worker<R, P> {
    /// Runs the drains and, beside them in the same task, the handoff lane, until shutdown.
    pub(super) async fn run(mut self) {
        let Some(mut lane) = self.lane.take() else {
            return self.drains().await;
        };
        let repo = Arc::clone(&self.repo);
        let publisher = Arc::clone(&self.publisher);
        let (options, on_error, cancel) = (
            self.options.clone(),
            self.on_error.clone(),
            self.cancel.clone(),
        );
        let handoffs = async move {
            let engine = Engine {
                repo: &*repo,
                publisher: &*publisher,
                options: &options,
                on_error: on_error.as_deref(),
                cancel: Some(&cancel),
            };
            // A panic (in the repository: the publisher's are caught) ends one batch, not
            // the lane: the rows of that batch wait for their lease.
            while !cancel.is_cancelled() {
                let lane =
                    engine.handoff_lane(&mut lane.rows, &lane.queued, &lane.token, &lane.wake);
                match guarded("handoff lane", async {
                    lane.await;
                    Ok(())
                })
                .await
                {
                    Ok(()) => break,
                    Err(error) => report_error(on_error.as_deref(), &error),
                }
            }
        };
        tokio::join!(self.drains(), handoffs);
    }

    /// The drains: at start, then when notified, due or idle, until shutdown.
    async fn drains(&mut self) {
        tracing::debug!("outbox dispatcher started");
        if !self.start_up().await {
            return;
        }
        // Consecutive failed drains (repository errors): drives the backoff.
        let mut errors: u32 = 0;
        // Consecutive drains that claimed nothing although the repository said a row was due.
        let mut idle_due: u32 = 0;
        // When `next_due_in` was last asked.
        let mut due_asked: Option<Instant> = None;
        loop {
            let drained = match guarded("repository", self.drain()).await {
                Ok(drained) => {
                    errors = 0;
                    Some(drained)
                }
                Err(error) => {
                    errors = errors.saturating_add(1);
                    self.report(&error);
                    None
                }
            };
            if self.cancel.is_cancelled() {
                break;
            }
            self.purge_if_due().await;
            self.report_backlog_if_due();
            let retry_at = match drained {
                None => Some(deadline(Instant::now(), repository_backoff(errors))),
                Some(Drained { claimed, retry_at }) => {
                    let busy = due_asked.filter(|at| claimed > 0 && at.elapsed() < DUE_ASK_EVERY);
                    if let Some(asked) = busy {
                        // Busy (this drain found rows, and the due time was asked a moment
                        // ago): notifies keep draining, and a drain takes every row that is
                        // due, so asking again after each drain would only double the
                        // queries. The timer goes to the earliest row this drain failed, or
                        // to when it is time to ask again.
                        let ask_at = deadline(asked, DUE_ASK_EVERY);
                        Some(retry_at.map_or(ask_at, |retry| retry.min(ask_at)))
                    } else {
                        due_asked = Some(Instant::now());
                        // On a task of its own, so a notify can start the next drain without
                        // dropping the query mid-flight (that would cost its connection, and
                        // the pool's next one a new session with every statement parsed
                        // again).
                        let repo = Arc::clone(&self.repo);
                        let mut asking = tokio::spawn(async move { next_due_in(&*repo).await });
                        let due = tokio::select! {
                            biased;
                            // Shutdown does not wait for a slow query (nor leaves it running).
                            () = self.cancel.cancelled() => {
                                asking.abort();
                                break;
                            }
                            // Committed meanwhile: drain now (unless notifies are debounced);
                            // the query ends on its own, its answer stale. The timer is armed
                            // after that drain.
                            Some(()) = self.wake.recv(), if self.timing.debounce.is_zero() => continue,
                            due = &mut asking => due.unwrap_or_else(|stopped| {
                                match stopped.try_into_panic() {
                                    Ok(panic) => Err(DispatchError::panicked("repository", &*panic)),
                                    // The runtime is shutting down.
                                    Err(_) => Ok(None),
                                }
                            }),
                        };
                        self.timer(claimed, due, &mut idle_due, &mut errors)
                    }
                }
            };
            if let Some(at) = retry_at {
                tracing::trace!(in_ms = ?at.saturating_duration_since(Instant::now()), "retry timer armed");
            }
            if self.wait(retry_at, errors > 0).await == Wake::Stop {
                break;
            }
        }
        // A purge still running does not outlive the dispatcher (its pool connection would).
        if let Some(purge) = self.retention.as_mut().and_then(|r| r.running.take()) {
            purge.abort();
        }
        if let Some(count) = self.backlog.as_mut().and_then(|b| b.running.take()) {
            count.abort();
        }
        tracing::debug!("outbox dispatcher stopped");
    }

    /// When to drain next, from what `next_due_in` said after a drain that claimed
    /// `claimed` rows.
    fn timer(
        &self,
        claimed: u64,
        due: Result<Option<Duration>, DispatchError>,
        idle_due: &mut u32,
        errors: &mut u32,
    ) -> Option<Instant> {
        match due {
            Ok(None) => {
                *idle_due = 0;
                None
            }
            Ok(Some(due_in)) => {
                let due_in = if claimed == 0 && due_in.is_zero() {
                    // Due now, yet the drain found nothing: a row became due in between
                    // (try again at once), or the repository disagrees with itself (back off
                    // instead of spinning).
                    *idle_due = idle_due.saturating_add(1);
                    if *idle_due == 1 {
                        MIN_RETRY_DELAY
                    } else {
                        repository_backoff(*idle_due - 1)
                    }
                } else {
                    *idle_due = 0;
                    due_in.max(MIN_RETRY_DELAY)
                };
                Some(deadline(Instant::now(), due_in))
            }
            Err(error) => {
                *errors = 1;
                self.report(&error);
                Some(deadline(Instant::now(), repository_backoff(*errors)))
            }
        }
    }

    /// What the task does once before its first drain: the publisher's start-up checks,
    /// then the sweep of rows no claim can finish (unknown state, NULL id), which go dead,
    /// each reported once. Returns `false` if shutdown began meanwhile.
    async fn start_up(&self) -> bool {
        let starting = guarded("publisher", async {
            self.publisher.on_start(&self.options.retry_policy).await;
            Ok(())
        });
        tokio::select! {
            biased;
            () = self.cancel.cancelled() => return false,
            started = starting => if let Err(error) = started {
                self.report(&error);
            },
        }
        let sweeping = guarded("repository", async {
            self.repo
                .sweep_unfinishable()
                .await
                .map_err(DispatchError::repository("sweep unfinishable rows"))
        });
        match sweeping.await {
            Ok(rows) => rows.into_iter().for_each(|PoisonRow { id, reason, .. }| {
                self.report(&DispatchError::Poisoned { id, reason });
            }),
            Err(error) => self.report(&error),
        }
        true
    }

    fn report(&self, error: &DispatchError) {
        report_error(self.on_error.as_deref(), error);
    }

    /// Starts deleting old dispatched rows when the retention's time has come, on a task of
    /// its own (checked after each drain): a purge never delays a drain or shutdown, and
    /// the next one starts only after the last has finished.
    async fn purge_if_due(&mut self) {
        let Some(retention) = &mut self.retention else {
            return;
        };
        let finished = match &retention.running {
            Some(running) if !running.is_finished() => return,
            Some(_) => retention.running.take(),
            None => None,
        };
        let start = Instant::now() >= retention.next;
        if start {
            retention.next = deadline(Instant::now(), retention.every);
            let (repo, older_than) = (Arc::clone(&self.repo), retention.older_than);
            retention.running = Some(tokio::spawn(async move {
                repo.purge_dispatched(older_than, PURGE_BATCH).await
            }));
        }
        let Some(finished) = finished else {
            return;
        };
        match finished.await {
            Ok(Ok(0)) => {}
            Ok(Ok(deleted)) => tracing::debug!(deleted, "purged old dispatched outbox rows"),
            Ok(Err(source)) => self.report(&DispatchError::Repository {
                operation: "purge dispatched rows",
                source,
            }),
            Err(stopped) => {
                if let Ok(panic) = stopped.try_into_panic() {
                    self.report(&DispatchError::panicked("repository", &*panic));
                }
            }
        }
    }

    /// Sets the [`UNDISPATCHED`](crate::metrics::UNDISPATCHED) and
    /// [`LAG_SECONDS`](crate::metrics::LAG_SECONDS) gauges, at most once per interval, on a
    /// task of its own: counting a large backlog must not hold up the next drain (notifies
    /// would wait behind it). A count still running when the next is due skips that one.
    fn report_backlog_if_due(&mut self) {
        let Some(backlog) = &mut self.backlog else {
            return;
        };
        if Instant::now() < backlog.next
            || backlog
                .running
                .as_ref()
                .is_some_and(|running| !running.is_finished())
        {
            return;
        }
        backlog.next = deadline(Instant::now(), backlog.every);
        let (repo, on_error) = (Arc::clone(&self.repo), self.on_error.clone());
        backlog.running = Some(tokio::spawn(async move {
            // A panicking repository is reported, not the end of the task.
            let reading = async {
                repo.backlog()
                    .await
                    .map_err(|source| DispatchError::Repository {
                        operation: "read the backlog",
                        source,
                    })
            };
            match guarded("repository", reading).await {
                Ok(Some(backlog)) => {
                    metrics::gauge!(crate::metrics::UNDISPATCHED).set(backlog.undispatched as f64);
                    metrics::gauge!(crate::metrics::LAG_SECONDS)
                        .set(backlog.oldest.map_or(0.0, |age| age.as_secs_f64()));
                }
                Ok(None) => {}
                Err(error) => report_error(on_error.as_deref(), &error),
            }
        }));
    }

    /// One drain: passes of waves until no notify arrived during the last pass.
    async fn drain(&mut self) -> Result<Drained, DispatchError> {
        let engine = Engine {
            repo: &*self.repo,
            publisher: &*self.publisher,
            options: &self.options,
            on_error: self.on_error.as_deref(),
            cancel: Some(&self.cancel),
        };
        let mut wave = Wave::default();
        let mut total = DispatchReport::default();
        let mut claimed = 0;
        loop {
            // Notifies that arrived before this pass are served by it.
            while self.wake.try_recv().is_ok() {}
            // Every pass takes a fresh cutoff (its first claim's `now()`); within a pass the
            // cutoff stays, so a row failed in it is not retried in it. Upstream keeps one
            // cutoff for the whole drain and renews it only when a row this dispatcher failed
            // comes due (spec §A.5, `retryDue`): while notifies kept a drain going, rows
            // failed by other dispatchers or earlier drains, and rows whose lease ran out
            // (their `next_attempt_at` follows the lease), waited for the drain to end.
            wave = Wave {
                cutoff: None,
                retry_at: wave.retry_at.filter(|at| *at > Instant::now()),
                ..Wave::default()
            };
            engine.wave(&mut wave, Some(&mut self.wake)).await?;
            total.add(wave.report);
            claimed += wave.claimed;
            // One more pass if notified during this one.
            if self.cancel.is_cancelled() || self.wake.try_recv().is_err() {
                break;
            }
        }
        if claimed > 0 {
            tracing::debug!(
                dispatched = total.dispatched,
                failed = total.failed,
                dead = total.dead,
                "outbox drained"
            );
        }
        Ok(Drained {
            claimed,
            retry_at: wave.retry_at,
        })
    }

    /// Waits for the next reason to drain: the retry timer, the idle poll, or a notify
    /// (debounced). Notifies and the idle poll are ignored (notifies kept pending) while
    /// backing off after errors: the backoff alone says when to try again.
    async fn wait(&mut self, retry_at: Option<Instant>, backing_off: bool) -> Wake {
        let mut retry = pin!(async move {
            match retry_at {
                Some(at) => sleep_until(at).await,
                None => std::future::pending().await,
            }
        });
        let idle = sleep_until(deadline(Instant::now(), self.timing.idle_interval));
        tokio::select! {
            biased;
            () = self.cancel.cancelled() => return Wake::Stop,
            () = &mut retry => return Wake::Drain,
            () = idle, if !backing_off => return Wake::Drain,
            Some(()) = self.wake.recv(), if !backing_off => {}
        }
        if self.timing.debounce.is_zero() {
            return Wake::Drain;
        }
        let first = Instant::now();
        let latest = deadline(first, self.timing.max_wait);
        let mut at = deadline(first, self.timing.debounce).min(latest);
        loop {
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => return Wake::Stop,
                // A retry wakeup skips the debounce.
                () = &mut retry => return Wake::Drain,
                () = sleep_until(at) => return Wake::Drain,
                Some(()) = self.wake.recv() => {
                    at = deadline(Instant::now(), self.timing.debounce).min(latest);
                }
            }
        }
    }
}

/// How long to wait after `failures` consecutive repository failures (or drains that found
/// nothing although a row was said to be due) before trying again: 100 ms doubling to 5 s,
/// ±20 % jitter, as the wake-up listener backs off. Independent of the rows' retry policy, so
/// a policy such as `RetryPolicy::fixed(1 ms)` does not hammer a database that is down, and
/// of `idle_interval`.
fn repository_backoff(failures: u32) -> Duration {
    RetryPolicy::new()
        .initial_delay(Duration::from_millis(100))
        .max_delay(Duration::from_secs(5))
        .delay(failures)
}

/// When the earliest open row is due, as [`OutboxRepository::next_due_in`] says.
async fn next_due_in(repo: &impl OutboxRepository) -> Result<Option<Duration>, DispatchError> {
    guarded("repository", async {
        repo.next_due_in()
            .await
            .map_err(DispatchError::repository("compute the next due time"))
    })
    .await
}

/// Runs `future`, turning a panic in it into [`DispatchError::Panicked`] naming `what`
/// panicked, so a panicking publisher or repository cannot end the task.
async fn guarded<T>(
    what: &'static str,
    future: impl Future<Output = Result<T, DispatchError>>,
) -> Result<T, DispatchError> {
    match AssertUnwindSafe(future).catch_unwind().await {
        Ok(result) => result,
        Err(panic) => Err(DispatchError::panicked(what, &*panic)),
    }
}
