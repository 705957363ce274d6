//! Draining the outbox: the one-shot [`dispatch_outbox`] and the [`OutboxDispatcher`] task.

use std::any::Any;
use std::collections::HashSet;
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
use crate::dispatch::repository::{
    Claim, Dispatched, Failure, OutboxRepository, PoisonRow, RetryOutcome,
};
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

    /// Several rows of one batch failed to publish: one report per batch (an outage would
    /// otherwise report every row of every batch). `first` is the first row's
    /// [`DispatchError::Publish`].
    #[error(
        "publishing {rows} outbox messages of one batch failed ({retrying} to retry, {dead} moved to dead; ids {}{})",
        ids.join(", "),
        if (ids.len() as u64) < *rows { ", …" } else { "" }
    )]
    PublishBatch {
        /// How many rows failed.
        rows: u64,
        /// How many of them are `failed`, to be retried.
        retrying: u64,
        /// How many of them were moved to `dead`.
        dead: u64,
        /// The ids of the first failed rows (at most 10).
        ids: Vec<String>,
        /// The first row's failure.
        #[source]
        first: Box<DispatchError>,
    },

    /// A claimed row could not be decoded and was moved to `dead`.
    #[error("outbox message {id:?} could not be decoded and was moved to dead: {reason}")]
    Poisoned {
        /// The row's id.
        id: String,
        /// Why it could not be decoded.
        reason: String,
    },

    /// Rows could not be marked, or their publish was stopped, because their lease passed to
    /// another claim or could not be extended before it ended; they may be published again
    /// (and are de-duplicated by `Nats-Msg-Id` within the stream's duplicate window).
    #[error(
        "lost the lease on {rows} outbox row(s) before marking them; \
         they may be published again"
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

/// The largest [`DispatchOptions::batch_size`].
const MAX_BATCH_SIZE: usize = 100_000;
/// The longest [`DispatchOptions::lease`].
const MAX_LEASE: Duration = Duration::from_secs(24 * 3600);

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

    /// How many rows each claim takes (default 100). Must be between 1 and 100,000.
    pub fn batch_size(mut self, rows: usize) -> Self {
        self.batch_size = rows;
        self
    }

    /// How long claimed rows stay reserved for this dispatcher (default 30 s). Must be
    /// between 1 ms and 24 h, and longer than the publisher's
    /// [`publish_budget`](Publisher::publish_budget) for a full batch.
    ///
    /// The dispatcher keeps the lease while it publishes: a batch that has less than its
    /// budget (or a third of the lease) left when its publish starts is extended first, and
    /// a running publish extends it whenever two thirds have passed. If the lease cannot be
    /// kept — another claim took a row, or the repository cannot extend it before it ends —
    /// the publish is stopped and the batch released, so two dispatchers never publish a
    /// row at the same time. A crashed dispatcher's rows wait for their lease to end.
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

    /// Checks the options on their own and against `publisher`'s
    /// [`publish_budget`](Publisher::publish_budget).
    fn validate(&self, publisher: &impl Publisher) -> Result<(), DispatchError> {
        if self.batch_size == 0 {
            return Err(DispatchError::InvalidOption {
                option: "batch_size",
                problem: "must be at least 1",
            });
        }
        if self.batch_size > MAX_BATCH_SIZE {
            return Err(DispatchError::InvalidOption {
                option: "batch_size",
                problem: "must be at most 100,000 rows (a claim holds its whole batch in memory)",
            });
        }
        if self.lease < Duration::from_millis(1) {
            return Err(DispatchError::InvalidOption {
                option: "lease",
                problem: "must be at least 1 ms",
            });
        }
        if self.lease > MAX_LEASE {
            return Err(DispatchError::InvalidOption {
                option: "lease",
                problem: "must be at most 24 hours (a crashed dispatcher's rows wait that long)",
            });
        }
        if let Err(problem) = self.retry_policy.validate() {
            return Err(DispatchError::InvalidOption {
                option: "retry_policy",
                problem,
            });
        }
        if publisher
            .publish_budget(self.batch_size)
            .is_some_and(|budget| budget >= self.lease)
        {
            return Err(DispatchError::InvalidOption {
                option: "lease",
                problem: "must be longer than the publisher's publish budget for a full batch \
                          (its timeouts added up); raise the lease or lower the batch size",
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
    options.validate(publisher)?;
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

/// A claim and when its lease ends on this process's (tokio) clock.
///
/// The deadline is counted from just **before** the claim was sent, so it is never later
/// than the lease the repository recorded (the repository's clock started counting after).
struct Leased {
    claim: Claim,
    deadline: Instant,
}

impl Leased {
    fn ids(&self) -> Vec<&str> {
        self.claim.messages.iter().map(|m| m.id.as_str()).collect()
    }
}

/// A claimed batch after publishing, waiting to be marked.
struct Published {
    claim: Claim,
    /// One result per message; `None` when the batch was not published (or not to the end)
    /// because its lease could not be kept: nothing of it is marked.
    results: Option<Vec<Result<Option<serde_json::Value>, PublishError>>>,
    span: tracing::Span,
}

/// What marking one batch did.
#[derive(Debug, Default)]
struct Marked {
    report: DispatchReport,
    /// When the earliest row this batch marked failed is due again (tokio clock).
    retry_at: Option<Instant>,
}

/// Why the lease keeper stopped a publish.
enum LeaseTrouble {
    /// Rows of the claim are held by another claim now: the lease was lost.
    Lost,
    /// The lease could not be extended and is about to end.
    Expiring,
}

/// How many ids a [`DispatchError::PublishBatch`] report lists.
const REPORTED_IDS: usize = 10;

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
        wave.cutoff = Some(first.claim.cutoff);
        let overlap = self.repo.overlaps_batches();
        let mut current = Some(first).filter(|leased| !leased.claim.is_empty());
        // The batch published last, waiting to be marked (overlapping only).
        let mut unmarked: Option<Published> = None;
        while let Some(leased) = current.take() {
            if self.cancelled() {
                if let Some(published) = unmarked.take() {
                    self.mark_into(wave, published).await;
                }
                self.release(&leased.claim).await;
                return Ok(());
            }
            wave.claimed += leased.claim.len() as u64;
            let span = tracing::debug_span!(
                "outbox_batch",
                rows = leased.claim.len(),
                token = %leased.claim.token
            );
            if !overlap {
                let published = self.publish(leased, span).await;
                self.mark_into(wave, published).await;
                if !self.cancelled() {
                    current = Some(self.claim(wave.cutoff).await?).filter(|l| !l.claim.is_empty());
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
            let (published, next, marked) =
                tokio::join!(self.publish(leased, span), claim_next, mark_previous);
            if let Some(marked) = marked {
                wave.absorb(marked);
            }
            match next {
                Some(Ok(next)) => {
                    unmarked = Some(published);
                    current = Some(next).filter(|l| !l.claim.is_empty());
                }
                Some(Err(error)) => {
                    // Mark what was published before giving up on this wave.
                    self.mark_into(wave, published).await;
                    return Err(error);
                }
                None => unmarked = Some(published),
            }
        }
        if let Some(published) = unmarked {
            self.mark_into(wave, published).await;
        }
        Ok(())
    }

    /// Claims one batch.
    async fn claim(&self, cutoff: Option<DateTime<Utc>>) -> Result<Leased, DispatchError> {
        let started = Instant::now();
        let claim = self
            .repo
            .claim_due(self.options.batch_size, self.options.lease, cutoff)
            .await
            .map_err(DispatchError::repository("claim due rows"))?;
        Ok(Leased {
            claim,
            deadline: deadline(started, self.options.lease),
        })
    }

    /// Releases the leases of a claim that will not be attempted (shutdown, or a lease that
    /// could not be kept), reporting a failure.
    async fn release(&self, claim: &Claim) {
        let ids: Vec<&str> = claim
            .messages
            .iter()
            .map(|m| m.id.as_str())
            .chain(claim.poisoned.iter().map(|p| p.id.as_str()))
            .collect();
        match self.repo.release(claim, &ids).await {
            Ok(released) => tracing::debug!(released, "released rows not attempted"),
            // The rows stay leased until their lease ends, then are claimed again.
            Err(source) => self.emit(DispatchError::Repository {
                operation: "release unattempted rows",
                source,
            }),
        }
    }

    /// Extends the lease of `leased` to a full lease from now; `Ok(true)` when every row of
    /// it is still held.
    async fn extend(&self, leased: &mut Leased, ids: &[&str]) -> Result<bool, Error> {
        let started = Instant::now();
        let extended = self
            .repo
            .extend_lease(&leased.claim, ids, self.options.lease)
            .await?;
        if extended == ids.len() as u64 {
            leased.deadline = deadline(started, self.options.lease);
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// How much lease a publish must have left when it starts: the publisher's budget for
    /// the batch, and at least a third of the lease.
    fn lease_needed(&self, rows: usize) -> Duration {
        let third = self.options.lease / 3;
        self.publisher
            .publish_budget(rows)
            .map_or(third, |budget| budget.max(third))
    }

    /// Publishes a claimed batch while keeping its lease.
    ///
    /// A batch whose lease has less left than [`lease_needed`](Self::lease_needed) (it waited
    /// behind the previous batch, or the broker is slow) has its lease extended first; while
    /// the publisher runs, the lease is extended whenever two thirds of it have passed. If
    /// the lease cannot be kept (another claim holds a row now, or the repository cannot
    /// extend it before it ends), the publish is stopped and nothing of the batch is marked:
    /// this dispatcher never publishes rows another holder may be publishing.
    async fn publish(&self, mut leased: Leased, span: tracing::Span) -> Published {
        if leased.claim.messages.is_empty() {
            return Published {
                results: Some(Vec::new()),
                claim: leased.claim,
                span,
            };
        }
        let kept = async {
            let ids_owned: Vec<String> = leased.ids().into_iter().map(str::to_owned).collect();
            let ids: Vec<&str> = ids_owned.iter().map(String::as_str).collect();
            let needed = self.lease_needed(ids.len());
            let extends = self.repo.extends_leases();
            if leased.deadline.saturating_duration_since(Instant::now()) < needed {
                if !extends {
                    return Err(LeaseTrouble::Expiring);
                }
                match self.extend(&mut leased, &ids).await {
                    Ok(true) => {}
                    Ok(false) => return Err(LeaseTrouble::Lost),
                    Err(source) => {
                        self.emit(DispatchError::Repository {
                            operation: "extend a lease",
                            source,
                        });
                        return Err(LeaseTrouble::Expiring);
                    }
                }
            }
            let claim = &leased.claim;
            let mut deadline_at = leased.deadline;
            let lease = self.options.lease;
            let keeper = async {
                if !extends {
                    // Stop before the lease ends rather than publish past it.
                    sleep_until(deadline_at.checked_sub(lease / 10).unwrap_or(deadline_at)).await;
                    return LeaseTrouble::Expiring;
                }
                loop {
                    sleep_until(deadline_at.checked_sub(lease / 3).unwrap_or(deadline_at)).await;
                    let started = Instant::now();
                    match self.repo.extend_lease(claim, &ids, lease).await {
                        Ok(n) if n == ids.len() as u64 => deadline_at = deadline(started, lease),
                        Ok(_) => return LeaseTrouble::Lost,
                        Err(source) => {
                            self.emit(DispatchError::Repository {
                                operation: "extend a lease",
                                source,
                            });
                            let left = deadline_at.saturating_duration_since(Instant::now());
                            let pause = (lease / 10).max(Duration::from_millis(10));
                            if left <= pause {
                                return LeaseTrouble::Expiring;
                            }
                            tokio::time::sleep(pause).await;
                        }
                    }
                }
            };
            tokio::select! {
                biased;
                results = self.call_publisher(&claim.messages) => Ok(results),
                trouble = keeper => Err(trouble),
            }
        }
        .instrument(span.clone())
        .await;
        let results = match kept {
            Ok(results) => Some(results),
            Err(trouble) => {
                let rows = leased.claim.messages.len() as u64;
                self.emit(DispatchError::LeaseLost { rows });
                if matches!(trouble, LeaseTrouble::Lost) {
                    tracing::warn!(
                        rows,
                        "lost the lease of a batch while publishing it; stopped"
                    );
                }
                // Rows this claim still holds become claimable at once.
                self.release(&leased.claim).await;
                None
            }
        };
        Published {
            claim: leased.claim,
            results,
            span,
        }
    }

    /// Marks a published batch and adds the outcome to the wave.
    async fn mark_into(&self, wave: &mut Wave, published: Published) {
        wave.absorb(self.mark(published).await);
    }

    /// Records the outcome of a published batch: published rows `dispatched` first, then
    /// undecodable and failed rows `dead` or `failed` in one call. Repository errors are
    /// reported (a batch statement that fails for a reason other than the connection is
    /// retried row by row); rows left unmarked stay leased until their lease ends.
    async fn mark(&self, published: Published) -> Marked {
        let Published {
            claim,
            results,
            span,
        } = published;
        async {
            let mut marked = Marked::default();
            // Not published (the lease could not be kept): the claim was released.
            let Some(results) = results else {
                return marked;
            };
            let mut lost = 0u64;
            let mut dispatched = Vec::new();
            let mut failures: Vec<(&OutboxMessage, PublishError)> = Vec::new();
            for (message, result) in claim.messages.iter().zip(results) {
                match result {
                    Ok(outcome) => dispatched.push(Dispatched {
                        id: message.id.clone(),
                        outcome: outcome.map(sanitize_outcome),
                    }),
                    Err(error) => failures.push((message, error)),
                }
            }
            if !dispatched.is_empty() {
                let (done, dead) = self.mark_dispatched(&claim, &dispatched).await;
                marked.report.dispatched += done;
                marked.report.dead += dead;
                lost += (dispatched.len() as u64).saturating_sub(done + dead);
            }

            let policy = &self.options.retry_policy;
            let mut rows: Vec<Failure> = Vec::new();
            for poison in &claim.poisoned {
                rows.push(Failure::dead(
                    poison.id.clone(),
                    sanitize_text(&poison.reason),
                    false,
                ));
            }
            let mut dispositions = Vec::with_capacity(failures.len());
            for (message, error) in &failures {
                let attempt = message.attempts.saturating_add(1);
                let reason = sanitize_text(&error.chain());
                if !error.is_retryable() || policy.gives_up_after(attempt) {
                    rows.push(Failure::dead(message.id.clone(), reason, true));
                    dispositions.push(Disposition::Dead);
                } else {
                    let delay = policy.delay(attempt);
                    rows.push(Failure::retry(message.id.clone(), reason, delay));
                    dispositions.push(Disposition::RetryAfter(delay));
                }
            }
            let done: HashSet<String> = self.mark_failures(&claim, &rows).await;
            lost += (rows.len() - done.len()) as u64;

            for poison in claim.poisoned.iter().filter(|p| done.contains(&p.id)) {
                marked.report.dead += 1;
                self.emit(DispatchError::Poisoned {
                    id: poison.id.clone(),
                    reason: poison.reason.clone(),
                });
            }
            let mut reported = Vec::new();
            for ((message, error), disposition) in failures.into_iter().zip(dispositions) {
                if !done.contains(&message.id) {
                    continue;
                }
                match disposition {
                    Disposition::Dead => marked.report.dead += 1,
                    Disposition::RetryAfter(delay) => {
                        marked.report.failed += 1;
                        let at = deadline(Instant::now(), delay);
                        marked.retry_at = Some(marked.retry_at.map_or(at, |t| t.min(at)));
                    }
                }
                reported.push(DispatchError::Publish {
                    id: message.id.clone(),
                    attempt: message.attempts.saturating_add(1),
                    disposition,
                    error,
                });
            }
            self.report_failures(reported);
            if lost > 0 {
                self.emit(DispatchError::LeaseLost { rows: lost });
            }
            tracing::debug!(
                dispatched = marked.report.dispatched,
                failed = marked.report.failed,
                dead = marked.report.dead,
                "outbox batch done"
            );
            marked
        }
        .instrument(span)
        .await
    }

    /// Reports the publish failures of one batch: a single failure as itself, several as
    /// one [`DispatchError::PublishBatch`], so an outage makes one report per batch.
    fn report_failures(&self, mut reported: Vec<DispatchError>) {
        if reported.len() <= 1 {
            if let Some(error) = reported.pop() {
                self.emit(error);
            }
            return;
        }
        let rows = reported.len() as u64;
        let mut dead = 0;
        let mut ids = Vec::new();
        for report in &reported {
            if let DispatchError::Publish {
                id, disposition, ..
            } = report
            {
                if *disposition == Disposition::Dead {
                    dead += 1;
                }
                if ids.len() < REPORTED_IDS {
                    ids.push(id.clone());
                }
            }
        }
        if let Some(DispatchError::Publish {
            id,
            attempt,
            disposition,
            error,
        }) = reported.into_iter().next()
        {
            self.emit(DispatchError::PublishBatch {
                rows,
                retrying: rows - dead,
                dead,
                ids,
                first: Box::new(DispatchError::Publish {
                    id,
                    attempt,
                    disposition,
                    error,
                }),
            });
        }
    }

    /// Marks `rows` dispatched; returns how many were marked. A failed batch statement is
    /// tried once more when the failure is transient, or row by row otherwise; a row that
    /// still cannot be marked `dispatched` is moved to `dead` (it was published: retrying it
    /// by itself would publish it again and again). Failures are reported.
    ///
    /// Returns how many rows were marked `dispatched` and how many `dead`.
    async fn mark_dispatched(&self, claim: &Claim, rows: &[Dispatched]) -> (u64, u64) {
        let error = match self.repo.mark_dispatched(claim, rows).await {
            Ok(done) => return (done, 0),
            Err(error) => error,
        };
        if error.is_retryable() {
            match self.repo.mark_dispatched(claim, rows).await {
                Ok(done) => return (done, 0),
                Err(source) => {
                    self.emit(DispatchError::Repository {
                        operation: "mark rows dispatched",
                        source,
                    });
                    return (0, 0);
                }
            }
        }
        self.emit(DispatchError::Repository {
            operation: "mark rows dispatched (retrying row by row)",
            source: error,
        });
        let (mut done, mut dead) = (0, 0);
        for row in rows {
            match self
                .repo
                .mark_dispatched(claim, std::slice::from_ref(row))
                .await
            {
                Ok(n) => done += n,
                Err(source) => {
                    let reason = sanitize_text(&format!(
                        "published, but it could not be marked dispatched: {}",
                        ErrorChain(&source)
                    ));
                    let failure = Failure::dead(row.id.clone(), reason, false);
                    match self.repo.mark_failures(claim, &[failure]).await {
                        Ok(ids) => dead += ids.len() as u64,
                        Err(source) => self.emit(DispatchError::Repository {
                            operation: "mark a published row",
                            source,
                        }),
                    }
                }
            }
        }
        (done, dead)
    }

    /// Marks failed and undecodable rows in one call; returns the ids marked. A failed call
    /// is tried once more when the failure is transient, or row by row otherwise.
    async fn mark_failures(&self, claim: &Claim, rows: &[Failure]) -> HashSet<String> {
        if rows.is_empty() {
            return HashSet::new();
        }
        let error = match self.repo.mark_failures(claim, rows).await {
            Ok(done) => return done.into_iter().collect(),
            Err(error) => error,
        };
        if error.is_retryable() {
            match self.repo.mark_failures(claim, rows).await {
                Ok(done) => return done.into_iter().collect(),
                Err(source) => {
                    self.emit(DispatchError::Repository {
                        operation: "mark failed rows",
                        source,
                    });
                    return HashSet::new();
                }
            }
        }
        self.emit(DispatchError::Repository {
            operation: "mark failed rows (retrying row by row)",
            source: error,
        });
        let mut done = HashSet::new();
        let mut first_error = None;
        for row in rows {
            match self
                .repo
                .mark_failures(claim, std::slice::from_ref(row))
                .await
            {
                Ok(ids) => done.extend(ids),
                Err(source) => {
                    first_error.get_or_insert(source);
                }
            }
        }
        if let Some(source) = first_error {
            self.emit(DispatchError::Repository {
                operation: "mark a failed row",
                source,
            });
        }
        done
    }

    /// Calls the publisher, turning a panic or a wrong number of results into per-message
    /// retryable errors.
    async fn call_publisher(
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

/// The longest `last_error` stored, in bytes.
const MAX_ERROR_BYTES: usize = 8 * 1024;
/// The longest outcome stored, in bytes of JSON text.
const MAX_OUTCOME_BYTES: usize = 64 * 1024;

/// Text fit to store: NUL characters (which Postgres `text` and `jsonb` refuse) replaced
/// with U+FFFD, and at most [`MAX_ERROR_BYTES`] long (cut at a character boundary).
fn sanitize_text(text: &str) -> String {
    let mut clean = text.replace('\0', "\u{fffd}");
    if clean.len() > MAX_ERROR_BYTES {
        let mut cut = MAX_ERROR_BYTES;
        while !clean.is_char_boundary(cut) {
            cut -= 1;
        }
        let dropped = clean.len() - cut;
        clean.truncate(cut);
        clean.push_str(&format!("… ({dropped} more bytes)"));
    }
    clean
}

/// An outcome fit to store: NUL characters in strings and keys replaced with U+FFFD; one
/// whose JSON text is longer than [`MAX_OUTCOME_BYTES`] replaced by a note saying so.
fn sanitize_outcome(outcome: serde_json::Value) -> serde_json::Value {
    fn clean(value: serde_json::Value) -> serde_json::Value {
        use serde_json::Value;
        match value {
            Value::String(s) if s.contains('\0') => Value::String(s.replace('\0', "\u{fffd}")),
            Value::Array(items) => Value::Array(items.into_iter().map(clean).collect()),
            Value::Object(map) => Value::Object(
                map.into_iter()
                    .map(|(k, v)| (k.replace('\0', "\u{fffd}"), clean(v)))
                    .collect(),
            ),
            other => other,
        }
    }
    let outcome = clean(outcome);
    let bytes = outcome.to_string().len();
    if bytes > MAX_OUTCOME_BYTES {
        serde_json::json!({
            "truncated": true,
            "bytes": bytes,
            "note": "the outcome was too large to store",
        })
    } else {
        outcome
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

    fn mark_failures(
        &self,
        claim: &Claim,
        failures: &[Failure],
    ) -> impl Future<Output = Result<Vec<String>>> + Send {
        (**self).mark_failures(claim, failures)
    }

    fn extend_lease(
        &self,
        claim: &Claim,
        ids: &[&str],
        lease: Duration,
    ) -> impl Future<Output = Result<u64>> + Send {
        (**self).extend_lease(claim, ids, lease)
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

    fn extends_leases(&self) -> bool {
        (**self).extends_leases()
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

    fn publish_budget(&self, rows: usize) -> Option<Duration> {
        (**self).publish_budget(rows)
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
        self.options.validate(&self.publisher)?;
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

    /// A publisher whose publish budget is one second per row.
    struct SlowPublisher;

    impl Publisher for SlowPublisher {
        async fn publish_batch(
            &self,
            messages: &[OutboxMessage],
        ) -> Vec<Result<Option<serde_json::Value>, PublishError>> {
            messages.iter().map(|_| Ok(None)).collect()
        }

        fn publish_budget(&self, rows: usize) -> Option<Duration> {
            Some(Duration::from_secs(rows as u64))
        }
    }

    #[test]
    fn options_are_validated() {
        let invalid = |options: DispatchOptions| match options.validate(&SlowPublisher) {
            Err(DispatchError::InvalidOption { option, .. }) => option,
            other => panic!("{other:?} is not an invalid option"),
        };
        assert_eq!(invalid(DispatchOptions::new().batch_size(0)), "batch_size");
        assert_eq!(
            invalid(DispatchOptions::new().batch_size(usize::MAX)),
            "batch_size"
        );
        assert_eq!(
            invalid(DispatchOptions::new().lease(Duration::ZERO)),
            "lease"
        );
        assert_eq!(
            invalid(DispatchOptions::new().lease(Duration::MAX)),
            "lease"
        );
        assert_eq!(
            invalid(
                DispatchOptions::new()
                    .batch_size(20)
                    .retry_policy(RetryPolicy::new().max_delay(Duration::MAX))
            ),
            "retry_policy"
        );
        // 100 rows at one second each do not fit a 30 s lease …
        assert_eq!(invalid(DispatchOptions::new()), "lease");
        // … 20 rows do.
        assert!(
            DispatchOptions::new()
                .batch_size(20)
                .validate(&SlowPublisher)
                .is_ok()
        );
        let error = DispatchOptions::new()
            .validate(&SlowPublisher)
            .unwrap_err()
            .to_string();
        assert!(error.contains("publish budget"), "{error}");
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
