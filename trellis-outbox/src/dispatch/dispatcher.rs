//! Draining the outbox: the one-shot [`dispatch_outbox`] and the [`OutboxDispatcher`] task.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::dispatch::publisher::{PublishError, Publisher};
use crate::dispatch::repository::{Claim, Dispatched, OutboxRepository, PoisonRow, RetryOutcome};
use crate::dispatch::retry::{MIN_RETRY_DELAY, RetryPolicy};
use crate::error::{Error, Result};
use crate::record::OutboxMessage;

/// The callback given to [`DispatcherBuilder::on_error`].
pub type ErrorCallback = Arc<dyn Fn(&DispatchError) + Send + Sync + 'static>;

/// What happens to a row after a failed publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Disposition {
    /// The row is `failed` and due again after this delay.
    RetryAfter(Duration),
    /// The row was moved to `dead`: the error is permanent or the retry policy gave up.
    Dead,
}

impl fmt::Display for Disposition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Disposition::RetryAfter(delay) => write!(f, "retrying in {delay:?}"),
            Disposition::Dead => f.write_str("moved to dead"),
        }
    }
}

/// Something that went wrong while dispatching; what [`DispatcherBuilder::on_error`] sees.
///
/// None of these stop an [`OutboxDispatcher`]: it reports them and carries on (backing off
/// after repository errors).
///
/// # Examples
///
/// ```
/// use trellis_outbox::{DispatchError, Disposition};
///
/// fn alert(error: &DispatchError) {
///     match error {
///         DispatchError::Publish { id, disposition: Disposition::Dead, .. } => {
///             eprintln!("outbox row {id} is dead: {error}");
///         }
///         DispatchError::Repository { .. } => eprintln!("outbox database trouble: {error}"),
///         _ => {}
///     }
/// }
/// # let _ = alert;
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DispatchError {
    /// A repository call failed (claiming, marking, releasing, or asking when rows are due).
    #[error("outbox repository failed to {operation}")]
    Repository {
        /// What the dispatcher was doing, e.g. `claim due rows`.
        operation: &'static str,
        /// The repository's error.
        #[source]
        source: Error,
    },

    /// Publishing one message failed; [`Disposition`] says what was done with the row.
    #[error("publishing outbox message {id:?} failed on attempt {attempt}; {disposition}")]
    Publish {
        /// The row's id.
        id: String,
        /// Which attempt failed (1 for the first).
        attempt: u32,
        /// What was done with the row.
        disposition: Disposition,
        /// The publisher's error; [`PublishError::chain`] is what was stored in the row.
        #[source]
        error: PublishError,
    },

    /// A claimed row could not be decoded and was moved to `dead`.
    #[error("outbox message {id:?} could not be decoded and was moved to dead: {reason}")]
    Poisoned {
        /// The row's id.
        id: String,
        /// Why it could not be decoded.
        reason: String,
    },

    /// Rows could not be marked because their lease had passed to another claim (the lease
    /// is probably shorter than a publish takes); they may be published again.
    #[error(
        "lost the lease on {rows} outbox row(s) before marking them; \
         they may be published again (is the lease shorter than a publish?)"
    )]
    LeaseLost {
        /// How many rows could not be marked.
        rows: u64,
    },

    /// The publisher returned a different number of results than messages it was given.
    /// Messages without a result are treated as retryable failures; extra results are
    /// ignored.
    #[error("the publisher returned {returned} results for {expected} messages")]
    PublisherContract {
        /// How many messages were published.
        expected: usize,
        /// How many results came back.
        returned: usize,
    },

    /// The publisher or the repository panicked. A panicking publisher fails the whole batch
    /// (retryably); a panicking repository is treated like a repository error.
    #[error("the outbox {what} panicked: {message}")]
    Panicked {
        /// `publisher` or `repository`.
        what: &'static str,
        /// The panic message.
        message: String,
    },

    /// An option given to [`DispatchOptions`] or [`DispatcherBuilder`] is out of range.
    #[error("invalid dispatcher option `{option}`: {problem}")]
    InvalidOption {
        /// The option's name.
        option: &'static str,
        /// What is wrong with it.
        problem: &'static str,
    },

    /// [`DispatcherBuilder::start`] was called outside a tokio runtime.
    #[error("OutboxDispatcher::start must be called from within a tokio runtime")]
    NoRuntime,
}

impl DispatchError {
    fn repository(operation: &'static str) -> impl FnOnce(Error) -> Self {
        move |source| DispatchError::Repository { operation, source }
    }
}

/// Options of one drain: batch size, lease and retry policy. Used by [`dispatch_outbox`]
/// and, through [`DispatcherBuilder`], by [`OutboxDispatcher`].
///
/// Defaults: batches of 100 rows, a 30 s lease, [`RetryPolicy::default`].
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use trellis_outbox::{DispatchOptions, RetryPolicy};
///
/// let options = DispatchOptions::new()
///     .batch_size(500)
///     .lease(Duration::from_secs(60))
///     .retry_policy(RetryPolicy::new().max_attempts(10));
/// # let _ = options;
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct DispatchOptions {
    batch_size: usize,
    lease: Duration,
    retry_policy: RetryPolicy,
}

impl Default for DispatchOptions {
    fn default() -> Self {
        Self {
            batch_size: 100,
            lease: Duration::from_secs(30),
            retry_policy: RetryPolicy::default(),
        }
    }
}

impl DispatchOptions {
    /// The defaults: 100 rows per batch, a 30 s lease, the default retry policy.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many rows each claim takes (default 100). Must be at least 1.
    pub fn batch_size(mut self, rows: usize) -> Self {
        self.batch_size = rows;
        self
    }

    /// How long claimed rows stay reserved for this dispatcher (default 30 s). Must be at
    /// least 1 ms; make it comfortably longer than publishing a batch takes, or rows whose
    /// lease expired may be published twice (JetStream de-duplicates them by `Nats-Msg-Id`
    /// within its duplicate window).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// When failed rows are retried and when they are given up (default
    /// [`RetryPolicy::default`]).
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.retry_policy = policy;
        self
    }

    fn validate(&self) -> Result<(), DispatchError> {
        if self.batch_size == 0 {
            return Err(DispatchError::InvalidOption {
                option: "batch_size",
                problem: "must be at least 1",
            });
        }
        if self.lease < Duration::from_millis(1) {
            return Err(DispatchError::InvalidOption {
                option: "lease",
                problem: "must be at least 1 ms",
            });
        }
        Ok(())
    }
}

/// What a drain did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DispatchReport {
    /// Rows marked `dispatched`.
    pub dispatched: u64,
    /// Rows marked `failed` (to be retried later).
    pub failed: u64,
    /// Rows moved to `dead` (permanent errors, retries exhausted, undecodable rows).
    pub dead: u64,
}

impl DispatchReport {
    fn add(&mut self, other: DispatchReport) {
        self.dispatched += other.dispatched;
        self.failed += other.failed;
        self.dead += other.dead;
    }
}

/// Drains the outbox once: claims due rows batch after batch, publishes them, and marks
/// them, until a claim comes back empty. For applications that schedule dispatching
/// themselves; [`OutboxDispatcher`] runs the same code.
///
/// Rows that fail during this call are not retried within it (they are due again after the
/// retry policy's delay). Publish failures do not make this function fail: they are counted
/// in the report and logged with `tracing`.
///
/// # Errors
///
/// [`DispatchError::InvalidOption`] for out-of-range options, or
/// [`DispatchError::Repository`] if the repository fails (rows already claimed stay leased
/// until their lease expires, then are claimed again).
///
/// # Examples
///
/// ```
/// use trellis_outbox::{
///     DispatchOptions, MemoryOutboxRepository, OutboxMessage, PreparedOutboxRecord,
///     PublishError, Publisher, dispatch_outbox,
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
/// let repo = MemoryOutboxRepository::new();
/// repo.enqueue(&PreparedOutboxRecord::event("A.Happened", "events.v1.A.Happened", &1)?)?;
/// let report = dispatch_outbox(&repo, &Print, DispatchOptions::new()).await?;
/// assert_eq!(report.dispatched, 1);
/// # Ok(()) }
/// ```
pub async fn dispatch_outbox<R: OutboxRepository, P: Publisher>(
    repository: &R,
    publisher: &P,
    options: DispatchOptions,
) -> Result<DispatchReport, DispatchError> {
    options.validate()?;
    let engine = Engine {
        repo: repository,
        publisher,
        options: &options,
        on_error: None,
        cancel: None,
    };
    let mut wave = Wave::default();
    engine.wave(&mut wave).await?;
    Ok(wave.report)
}

/// The state of one drain wave.
#[derive(Debug, Default)]
struct Wave {
    /// The due cutoff of the wave, once the first claim has fixed it.
    cutoff: Option<DateTime<Utc>>,
    /// What was done so far.
    report: DispatchReport,
    /// How many rows were claimed so far.
    claimed: u64,
    /// When the earliest row that failed during the wave is due again (tokio clock).
    retry_at: Option<Instant>,
}

impl Wave {
    fn absorb(&mut self, marked: Marked) {
        self.report.add(marked.report);
        if let Some(at) = marked.retry_at {
            self.retry_at = Some(self.retry_at.map_or(at, |t| t.min(at)));
        }
    }
}

/// A claimed batch after publishing, waiting to be marked.
struct Published {
    claim: Claim,
    results: Vec<Result<Option<serde_json::Value>, PublishError>>,
    span: tracing::Span,
}

/// What marking one batch did.
#[derive(Debug, Default)]
struct Marked {
    report: DispatchReport,
    /// When the earliest row this batch marked failed is due again (tokio clock).
    retry_at: Option<Instant>,
}

/// The drain logic shared by [`dispatch_outbox`] and the dispatcher task.
struct Engine<'a, R, P> {
    repo: &'a R,
    publisher: &'a P,
    options: &'a DispatchOptions,
    on_error: Option<&'a (dyn Fn(&DispatchError) + Send + Sync)>,
    cancel: Option<&'a CancellationToken>,
}

impl<R: OutboxRepository, P: Publisher> Engine<'_, R, P> {
    fn cancelled(&self) -> bool {
        self.cancel.is_some_and(CancellationToken::is_cancelled)
    }

    fn emit(&self, error: DispatchError) {
        report_error(self.on_error, &error);
    }

    /// Claims and handles batches until a claim comes back empty (or shutdown begins).
    ///
    /// When the repository [overlaps batches](OutboxRepository::overlaps_batches), batch
    /// `n` is published while batch `n + 1` is claimed and batch `n - 1` is marked, so a
    /// batch costs about as long as its slowest stage instead of the sum of all three.
    async fn wave(&self, wave: &mut Wave) -> Result<(), DispatchError> {
        if self.cancelled() {
            return Ok(());
        }
        let first = self.claim(wave.cutoff).await?;
        wave.cutoff = Some(first.cutoff);
        let overlap = self.repo.overlaps_batches();
        let mut current = Some(first).filter(|claim| !claim.is_empty());
        // The batch published last, waiting to be marked (overlapping only).
        let mut unmarked: Option<Published> = None;
        while let Some(claim) = current.take() {
            if self.cancelled() {
                if let Some(published) = unmarked.take() {
                    self.mark_into(wave, published).await?;
                }
                return self.release(&claim).await;
            }
            wave.claimed += claim.len() as u64;
            let span =
                tracing::debug_span!("outbox_batch", rows = claim.len(), token = %claim.token);
            if !overlap {
                let results = self.publish(&claim.messages).instrument(span.clone()).await;
                self.mark_into(
                    wave,
                    Published {
                        claim,
                        results,
                        span,
                    },
                )
                .await?;
                if !self.cancelled() {
                    current = Some(self.claim(wave.cutoff).await?).filter(|c| !c.is_empty());
                }
                continue;
            }
            let cutoff = wave.cutoff;
            let claim_next = async {
                if self.cancelled() {
                    None
                } else {
                    Some(self.claim(cutoff).await)
                }
            };
            let previous = unmarked.take();
            let mark_previous = async {
                match previous {
                    Some(published) => Some(self.mark(published).await),
                    None => None,
                }
            };
            let (results, next, marked) = tokio::join!(
                self.publish(&claim.messages).instrument(span.clone()),
                claim_next,
                mark_previous,
            );
            let published = Published {
                claim,
                results,
                span,
            };
            let next = match next {
                Some(Ok(next)) => Some(next).filter(|c| !c.is_empty()),
                Some(Err(error)) => {
                    // Mark what was published before giving up on this wave.
                    if let Some(Ok(marked)) = marked {
                        wave.absorb(marked);
                    }
                    self.mark_into(wave, published).await?;
                    return Err(error);
                }
                None => None,
            };
            match marked {
                Some(Ok(marked)) => wave.absorb(marked),
                Some(Err(error)) => {
                    // The store failed; try to settle what is in hand, then report.
                    if let Ok(marked) = self.mark(published).await {
                        wave.absorb(marked);
                    }
                    if let Some(next) = next {
                        let _ = self.release(&next).await;
                    }
                    return Err(error);
                }
                None => {}
            }
            unmarked = Some(published);
            current = next;
        }
        if let Some(published) = unmarked {
            self.mark_into(wave, published).await?;
        }
        Ok(())
    }

    /// Claims one batch.
    async fn claim(&self, cutoff: Option<DateTime<Utc>>) -> Result<Claim, DispatchError> {
        self.repo
            .claim_due(self.options.batch_size, self.options.lease, cutoff)
            .await
            .map_err(DispatchError::repository("claim due rows"))
    }

    /// Releases the leases of a claim that will not be attempted (shutdown).
    async fn release(&self, claim: &Claim) -> Result<(), DispatchError> {
        let ids: Vec<&str> = claim
            .messages
            .iter()
            .map(|m| m.id.as_str())
            .chain(claim.poisoned.iter().map(|p| p.id.as_str()))
            .collect();
        let released = self
            .repo
            .release(claim, &ids)
            .await
            .map_err(DispatchError::repository("release unattempted rows"))?;
        tracing::debug!(released, "shutting down: released rows not attempted");
        Ok(())
    }

    /// Marks a published batch and adds the outcome to the wave.
    async fn mark_into(&self, wave: &mut Wave, published: Published) -> Result<(), DispatchError> {
        let marked = self.mark(published).await?;
        wave.absorb(marked);
        Ok(())
    }

    /// Records the outcome of a published batch: undecodable rows to dead, published rows
    /// dispatched, failed rows failed (or dead when the error is permanent or retries are
    /// exhausted).
    async fn mark(&self, published: Published) -> Result<Marked, DispatchError> {
        let Published {
            claim,
            results,
            span,
        } = published;
        async {
            let mut marked = Marked::default();
            let report = &mut marked.report;
            let mut lost = 0u64;
            for poison in &claim.poisoned {
                let done = self
                    .repo
                    .mark_dead(&claim, &poison.id, &poison.reason, false)
                    .await
                    .map_err(DispatchError::repository("move an undecodable row to dead"))?;
                if done {
                    report.dead += 1;
                    self.emit(DispatchError::Poisoned {
                        id: poison.id.clone(),
                        reason: poison.reason.clone(),
                    });
                } else {
                    lost += 1;
                }
            }
            let mut dispatched = Vec::new();
            let mut failures = Vec::new();
            for (message, result) in claim.messages.iter().zip(results) {
                match result {
                    Ok(outcome) => dispatched.push(Dispatched {
                        id: message.id.clone(),
                        outcome,
                    }),
                    Err(error) => failures.push((message, error)),
                }
            }
            if !dispatched.is_empty() {
                let done = self
                    .repo
                    .mark_dispatched(&claim, &dispatched)
                    .await
                    .map_err(DispatchError::repository("mark rows dispatched"))?;
                report.dispatched += done;
                lost += (dispatched.len() as u64).saturating_sub(done);
            }
            let policy = &self.options.retry_policy;
            for (message, error) in failures {
                let attempt = message.attempts.saturating_add(1);
                let reason = error.chain();
                let (done, disposition) = if !error.is_retryable() || policy.gives_up_after(attempt)
                {
                    let done = self
                        .repo
                        .mark_dead(&claim, &message.id, &reason, true)
                        .await
                        .map_err(DispatchError::repository("move a failed row to dead"))?;
                    report.dead += u64::from(done);
                    (done, Disposition::Dead)
                } else {
                    let delay = policy.delay(attempt);
                    let done = self
                        .repo
                        .mark_failed(&claim, &message.id, &reason, delay)
                        .await
                        .map_err(DispatchError::repository("mark a row failed"))?;
                    if done {
                        report.failed += 1;
                        let at = deadline(Instant::now(), delay);
                        marked.retry_at = Some(marked.retry_at.map_or(at, |t| t.min(at)));
                    }
                    (done, Disposition::RetryAfter(delay))
                };
                if !done {
                    lost += 1;
                    continue;
                }
                self.emit(DispatchError::Publish {
                    id: message.id.clone(),
                    attempt,
                    disposition,
                    error,
                });
            }
            if lost > 0 {
                self.emit(DispatchError::LeaseLost { rows: lost });
            }
            tracing::debug!(
                dispatched = marked.report.dispatched,
                failed = marked.report.failed,
                dead = marked.report.dead,
                "outbox batch done"
            );
            Ok(marked)
        }
        .instrument(span)
        .await
    }

    /// Calls the publisher, turning a panic or a wrong number of results into per-message
    /// retryable errors.
    async fn publish(
        &self,
        messages: &[OutboxMessage],
    ) -> Vec<Result<Option<serde_json::Value>, PublishError>> {
        let publishing = pin!(self.publisher.publish_batch(messages));
        let mut results = match CatchUnwind(publishing).await {
            Ok(results) => results,
            Err(panic) => {
                let message = panic_message(&*panic);
                self.emit(DispatchError::Panicked {
                    what: "publisher",
                    message: message.clone(),
                });
                return messages
                    .iter()
                    .map(|_| {
                        Err(PublishError::retryable(format!(
                            "the publisher panicked: {message}"
                        )))
                    })
                    .collect();
            }
        };
        if results.len() != messages.len() {
            self.emit(DispatchError::PublisherContract {
                expected: messages.len(),
                returned: results.len(),
            });
            results.truncate(messages.len());
            while results.len() < messages.len() {
                results.push(Err(PublishError::retryable(
                    "the publisher returned no result for this message",
                )));
            }
        }
        results
    }
}

/// Logs `error` and hands it to the callback, surviving a panicking callback.
fn report_error(on_error: Option<&(dyn Fn(&DispatchError) + Send + Sync)>, error: &DispatchError) {
    match error {
        DispatchError::Publish {
            id,
            attempt,
            disposition: Disposition::Dead,
            error: cause,
        } => tracing::error!(%id, attempt, error = %cause.chain(), "outbox message moved to dead"),
        DispatchError::Publish {
            id,
            attempt,
            disposition,
            error: cause,
        } => {
            tracing::warn!(%id, attempt, error = %cause.chain(), %disposition, "outbox publish failed")
        }
        DispatchError::Poisoned { id, reason } => {
            tracing::error!(%id, %reason, "undecodable outbox row moved to dead");
        }
        other => tracing::error!(error = %ErrorChain(other), "outbox dispatch error"),
    }
    if let Some(callback) = on_error
        && let Err(panic) = catch_unwind(AssertUnwindSafe(|| callback(error)))
    {
        tracing::error!(
            panic = %panic_message(&*panic),
            "the outbox on_error callback panicked; the dispatcher keeps running"
        );
    }
}

/// Displays an error with its sources, `outer: inner`.
struct ErrorChain<'a>(&'a (dyn std::error::Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(cause) = next {
            write!(f, ": {cause}")?;
            next = cause.source();
        }
        Ok(())
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_owned()
    }
}

/// Polls a future, turning a panic during a poll into an `Err`.
struct CatchUnwind<'a, F: ?Sized>(Pin<&'a mut F>);

impl<F: Future + ?Sized> Future for CatchUnwind<'_, F> {
    type Output = std::result::Result<F::Output, Box<dyn Any + Send>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.get_mut().0.as_mut();
        match catch_unwind(AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}

/// `from + duration`, or about 30 years from `from` if that overflows.
fn deadline(from: Instant, duration: Duration) -> Instant {
    from.checked_add(duration)
        .unwrap_or_else(|| from + Duration::from_secs(86_400 * 365 * 30))
}

// Sharing: a dispatcher can run over an `Arc` of a repository or publisher the application
// also uses elsewhere (e.g. a `MemoryOutboxRepository` a test inspects).

impl<R: OutboxRepository> OutboxRepository for Arc<R> {
    fn claim_due(
        &self,
        limit: usize,
        lease: Duration,
        cutoff: Option<DateTime<Utc>>,
    ) -> impl Future<Output = Result<Claim>> + Send {
        (**self).claim_due(limit, lease, cutoff)
    }

    fn mark_dispatched(
        &self,
        claim: &Claim,
        rows: &[Dispatched],
    ) -> impl Future<Output = Result<u64>> + Send {
        (**self).mark_dispatched(claim, rows)
    }

    fn mark_failed(
        &self,
        claim: &Claim,
        id: &str,
        error: &str,
        retry_after: Duration,
    ) -> impl Future<Output = Result<bool>> + Send {
        (**self).mark_failed(claim, id, error, retry_after)
    }

    fn mark_dead(
        &self,
        claim: &Claim,
        id: &str,
        reason: &str,
        count_attempt: bool,
    ) -> impl Future<Output = Result<bool>> + Send {
        (**self).mark_dead(claim, id, reason, count_attempt)
    }

    fn release(&self, claim: &Claim, ids: &[&str]) -> impl Future<Output = Result<u64>> + Send {
        (**self).release(claim, ids)
    }

    fn retry(&self, id: &str) -> impl Future<Output = Result<RetryOutcome>> + Send {
        (**self).retry(id)
    }

    fn sweep_unfinishable(&self) -> impl Future<Output = Result<Vec<PoisonRow>>> + Send {
        (**self).sweep_unfinishable()
    }

    fn next_due_in(&self) -> impl Future<Output = Result<Option<Duration>>> + Send {
        (**self).next_due_in()
    }

    fn overlaps_batches(&self) -> bool {
        (**self).overlaps_batches()
    }
}

impl<P: Publisher> Publisher for Arc<P> {
    fn publish_batch(
        &self,
        messages: &[OutboxMessage],
    ) -> impl Future<Output = Vec<Result<Option<serde_json::Value>, PublishError>>> + Send {
        (**self).publish_batch(messages)
    }

    fn on_start(&self, retry_policy: &RetryPolicy) -> impl Future<Output = ()> + Send {
        (**self).on_start(retry_policy)
    }
}

/// Builds an [`OutboxDispatcher`]; see [`OutboxDispatcher::builder`].
pub struct DispatcherBuilder<R, P> {
    repository: R,
    publisher: P,
    options: DispatchOptions,
    debounce: Duration,
    max_wait: Duration,
    idle_interval: Duration,
    on_error: Option<ErrorCallback>,
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
    /// How many rows each claim takes (default 100). Must be at least 1.
    pub fn batch_size(mut self, rows: usize) -> Self {
        self.options = self.options.batch_size(rows);
        self
    }

    /// How long claimed rows stay reserved (default 30 s); see [`DispatchOptions::lease`].
    pub fn lease(mut self, lease: Duration) -> Self {
        self.options = self.options.lease(lease);
        self
    }

    /// Retry schedule and give-up rule (default [`RetryPolicy::default`]).
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.options = self.options.retry_policy(policy);
        self
    }

    /// Sets batch size, lease and retry policy at once.
    pub fn options(mut self, options: DispatchOptions) -> Self {
        self.options = options;
        self
    }

    /// How long to wait after a [`notify`](OutboxDispatcher::notify) for more notifies
    /// before draining (default zero: drain at once). Each notify restarts the window, but
    /// never beyond [`max_wait`](Self::max_wait) after the first one. Retry wakeups, the
    /// idle poll and the start-up drain skip the debounce.
    pub fn debounce(mut self, debounce: Duration) -> Self {
        self.debounce = debounce;
        self
    }

    /// The longest a drain can be postponed by a stream of notifies during the debounce
    /// (default 100 ms), so frequent notifies cannot starve the drain. A `max_wait` shorter
    /// than the debounce shortens the debounce to it.
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        self.max_wait = max_wait;
        self
    }

    /// How often to drain when nothing else triggers it (default 5 s): a safety net for
    /// notifies that never came (another process enqueued, a notify was lost). Must be at
    /// least 1 ms.
    pub fn idle_interval(mut self, interval: Duration) -> Self {
        self.idle_interval = interval;
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
    /// outbox: a [`PgWakeups`](crate::PgWakeups) listener on `pool` (one connection) runs
    /// beside the dispatcher task and calls [`notify`](OutboxDispatcher::notify) for every
    /// notification, re-`LISTEN`s after a dropped connection and then notifies once to
    /// re-scan. It stops with the dispatcher. A lost connection sqlx could not restore and
    /// every failed connect or `LISTEN`, the first or a later one, go to
    /// [`on_error`](Self::on_error) (operation `listen for wake-ups`) and are retried with
    /// backoff (100 ms doubling to 5 s); polling every [`idle_interval`](Self::idle_interval)
    /// stays the safety net meanwhile.
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
        self.options.validate()?;
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
        let worker = Worker {
            repo: self.repository,
            publisher: self.publisher,
            options: self.options,
            debounce: self.debounce.min(self.max_wait),
            max_wait: self.max_wait,
            idle_interval: self.idle_interval,
            on_error: self.on_error.clone(),
            cancel: cancel.clone(),
            wake: wake_rx,
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
            }),
        };
        #[cfg(feature = "postgres")]
        let listener = self.listen.map(|(pool, tables)| {
            runtime.spawn(
                listen(pool, tables, handle.clone(), cancel, self.on_error.clone())
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
}

/// Publishes committed outbox rows from a background tokio task.
///
/// - Drains once at start, then whenever [`notify`](Self::notify)d (with an optional
///   debounce bounded by a maximum wait), when the earliest failed row becomes due again
///   (the retry timer is re-armed from [`OutboxRepository::next_due_in`] after every drain),
///   and every `idle_interval` as a safety net.
/// - A drain claims batch after batch under a lease until a claim comes back empty. A row
///   that fails during a drain is not retried within it.
/// - Only one claim is ever in flight per dispatcher. Several dispatchers (in one process or
///   many) can share a database: leases and fencing tokens keep each row with one of them.
/// - Errors are logged with `tracing` and passed to [`DispatcherBuilder::on_error`]; a
///   repository error makes the task back off (the retry policy's schedule) and try again.
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
/// a repository error of operation "listen for wake-ups") until `cancel`.
///
/// [`PgWakeups`]: crate::PgWakeups
#[cfg(feature = "postgres")]
async fn listen(
    pool: sqlx::PgPool,
    tables: crate::OutboxTables,
    handle: DispatcherHandle,
    cancel: CancellationToken,
    on_error: Option<ErrorCallback>,
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
    );
    cancel.cancelled().await;
    wakeups.stop().await;
}

/// The dispatcher task.
struct Worker<R, P> {
    repo: R,
    publisher: P,
    options: DispatchOptions,
    debounce: Duration,
    max_wait: Duration,
    idle_interval: Duration,
    on_error: Option<ErrorCallback>,
    cancel: CancellationToken,
    wake: mpsc::Receiver<()>,
}

/// Why the worker's wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    Stop,
    Drain,
}

impl<R: OutboxRepository, P: Publisher> Worker<R, P> {
    async fn run(mut self) {
        tracing::debug!("outbox dispatcher started");
        {
            let starting = pin!(self.publisher.on_start(&self.options.retry_policy));
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => return,
                started = CatchUnwind(starting) => if let Err(panic) = started {
                    report_error(self.on_error.as_deref(), &DispatchError::Panicked {
                        what: "publisher",
                        message: panic_message(&*panic),
                    });
                },
            }
        }
        // Rows no claim can finish (unknown state, NULL id) go dead, each reported once.
        match CatchUnwind(pin!(self.repo.sweep_unfinishable())).await {
            Ok(Ok(rows)) => rows.into_iter().for_each(|PoisonRow { id, reason, .. }| {
                report_error(
                    self.on_error.as_deref(),
                    &DispatchError::Poisoned { id, reason },
                );
            }),
            Ok(Err(source)) => report_error(
                self.on_error.as_deref(),
                &DispatchError::Repository {
                    operation: "sweep unfinishable rows",
                    source,
                },
            ),
            Err(panic) => report_error(
                self.on_error.as_deref(),
                &DispatchError::Panicked {
                    what: "repository",
                    message: panic_message(&*panic),
                },
            ),
        }
        // Consecutive failed drains (repository errors): drives the backoff.
        let mut errors: u32 = 0;
        // Consecutive drains that claimed nothing although the repository said a row was due.
        let mut idle_due: u32 = 0;
        loop {
            let drained = {
                let drain = pin!(self.drain());
                CatchUnwind(drain).await
            };
            let claimed = match drained {
                Ok(Ok(claimed)) => {
                    errors = 0;
                    Some(claimed)
                }
                Ok(Err(error)) => {
                    errors = errors.saturating_add(1);
                    report_error(self.on_error.as_deref(), &error);
                    None
                }
                Err(panic) => {
                    errors = errors.saturating_add(1);
                    let error = DispatchError::Panicked {
                        what: "repository",
                        message: panic_message(&*panic),
                    };
                    report_error(self.on_error.as_deref(), &error);
                    None
                }
            };
            if self.cancel.is_cancelled() {
                break;
            }
            let retry_at = match claimed {
                Some(claimed) => match self.next_due_in().await {
                    Ok(None) => {
                        idle_due = 0;
                        None
                    }
                    Ok(Some(due_in)) => {
                        let due_in = if claimed == 0 && due_in.is_zero() {
                            // Due now, yet the drain found nothing: a row became due in
                            // between (try again at once), or the repository disagrees with
                            // itself (back off instead of spinning).
                            idle_due = idle_due.saturating_add(1);
                            if idle_due == 1 {
                                MIN_RETRY_DELAY
                            } else {
                                self.options.retry_policy.delay(idle_due - 1)
                            }
                        } else {
                            idle_due = 0;
                            due_in.max(MIN_RETRY_DELAY)
                        };
                        Some(deadline(Instant::now(), due_in))
                    }
                    Err(error) => {
                        errors = 1;
                        report_error(self.on_error.as_deref(), &error);
                        Some(deadline(
                            Instant::now(),
                            self.options.retry_policy.delay(errors),
                        ))
                    }
                },
                None => Some(deadline(
                    Instant::now(),
                    self.options.retry_policy.delay(errors),
                )),
            };
            if let Some(at) = retry_at {
                tracing::trace!(in_ms = ?at.saturating_duration_since(Instant::now()), "retry timer armed");
            }
            if self.wait(retry_at, errors > 0).await == Wake::Stop {
                break;
            }
        }
        tracing::debug!("outbox dispatcher stopped");
    }

    async fn next_due_in(&self) -> Result<Option<Duration>, DispatchError> {
        let asking = pin!(self.repo.next_due_in());
        match CatchUnwind(asking).await {
            Ok(result) => result.map_err(DispatchError::repository("compute the next due time")),
            Err(panic) => Err(DispatchError::Panicked {
                what: "repository",
                message: panic_message(&*panic),
            }),
        }
    }

    /// One drain: passes of waves until no notify arrived during the last pass. Returns how
    /// many rows were claimed.
    async fn drain(&mut self) -> Result<u64, DispatchError> {
        let engine = Engine {
            repo: &self.repo,
            publisher: &self.publisher,
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
            // A failed row came due during the drain: this pass gets a fresh cutoff, so it
            // is retried (spec §A.5: retryDue).
            let cutoff = if wave.retry_at.is_some_and(|at| at <= Instant::now()) {
                None
            } else {
                wave.cutoff
            };
            wave = Wave {
                cutoff,
                retry_at: wave.retry_at.filter(|at| *at > Instant::now()),
                ..Wave::default()
            };
            engine.wave(&mut wave).await?;
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
        Ok(claimed)
    }

    /// Waits for the next reason to drain: the retry timer, the idle poll, or a notify
    /// (debounced). Notifies are ignored (kept pending) while backing off after errors.
    async fn wait(&mut self, retry_at: Option<Instant>, backing_off: bool) -> Wake {
        let mut retry = pin!(async move {
            match retry_at {
                Some(at) => sleep_until(at).await,
                None => std::future::pending().await,
            }
        });
        let idle = sleep_until(deadline(Instant::now(), self.idle_interval));
        tokio::select! {
            biased;
            () = self.cancel.cancelled() => return Wake::Stop,
            () = &mut retry => return Wake::Drain,
            () = idle => return Wake::Drain,
            Some(()) = self.wake.recv(), if !backing_off => {}
        }
        if self.debounce.is_zero() {
            return Wake::Drain;
        }
        let first = Instant::now();
        let latest = deadline(first, self.max_wait);
        let mut at = deadline(first, self.debounce).min(latest);
        loop {
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => return Wake::Stop,
                // A retry wakeup skips the debounce.
                () = &mut retry => return Wake::Drain,
                () = sleep_until(at) => return Wake::Drain,
                Some(()) = self.wake.recv() => {
                    at = deadline(Instant::now(), self.debounce).min(latest);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_validated() {
        assert!(matches!(
            DispatchOptions::new().batch_size(0).validate(),
            Err(DispatchError::InvalidOption {
                option: "batch_size",
                ..
            })
        ));
        assert!(matches!(
            DispatchOptions::new().lease(Duration::ZERO).validate(),
            Err(DispatchError::InvalidOption {
                option: "lease",
                ..
            })
        ));
        assert!(DispatchOptions::new().validate().is_ok());
    }

    #[test]
    fn start_outside_a_runtime_is_an_error() {
        let repo = crate::MemoryOutboxRepository::new();
        struct Never;
        impl Publisher for Never {
            async fn publish_batch(
                &self,
                messages: &[OutboxMessage],
            ) -> Vec<Result<Option<serde_json::Value>, PublishError>> {
                messages.iter().map(|_| Ok(None)).collect()
            }
        }
        let err = OutboxDispatcher::builder(repo, Never).start().unwrap_err();
        assert!(matches!(err, DispatchError::NoRuntime));
    }

    #[test]
    fn error_chain_and_panic_messages() {
        let err = DispatchError::Repository {
            operation: "claim due rows",
            source: Error::UnknownKind("x".into()),
        };
        assert_eq!(
            ErrorChain(&err).to_string(),
            "outbox repository failed to claim due rows: unknown outbox record kind \"x\" \
             (expected event.publish, job.create or job.submit)"
        );
        let panic = catch_unwind(|| panic!("boom {}", 1)).unwrap_err();
        assert_eq!(panic_message(&*panic), "boom 1");
        let panic = catch_unwind(|| std::panic::panic_any(7)).unwrap_err();
        assert_eq!(panic_message(&*panic), "(non-string panic payload)");
    }
}
