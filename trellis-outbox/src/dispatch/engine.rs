//! One drain: claim a batch under a lease, publish it while keeping the lease, mark what
//! happened, and go on until a claim comes back empty — the one-shot [`dispatch_outbox`]
//! and every drain of the [`OutboxDispatcher`](crate::OutboxDispatcher) task run this code.
//!
//! Like River's producer / executor / completer split, each stage has its own file: this
//! one claims and sequences batches (overlapping them where the repository allows),
//! [`publish`] runs the publisher under the lease, [`mark`] records the outcome.

mod handoff;
mod mark;
mod publish;

use std::collections::HashSet;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::StreamExt as _;
use futures_util::stream::FuturesUnordered;
use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

#[cfg(doc)]
use crate::dispatch::OutboxDispatcher;
use crate::dispatch::error::{DispatchError, report_error};
use crate::dispatch::options::{DispatchOptions, DispatchReport};
use crate::dispatch::publisher::{PublishError, Publisher};
use crate::dispatch::repository::{Claim, ClaimRequest, OutboxRepository};
use crate::metrics;

/// Drains the outbox once: claims due rows batch after batch, publishes them, and marks
/// them, until a claim comes back empty. For applications that schedule dispatching
/// themselves; [`OutboxDispatcher`] runs the same code.
///
/// Rows that fail during this call are not retried within it (they are due again after the
/// retry policy's delay). With ordering keys on a repository that
/// [overlaps batches](OutboxRepository::overlaps_batches), the call can end while rows wait
/// behind their keys' heads that were in flight during its last claim: call it again until it
/// dispatches nothing (the dispatcher does so by itself). Publish failures do not make this function fail: they are counted
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
    engine.wave(&mut wave, None).await?;
    Ok(wave.report)
}

/// How many published batches may be marked at once while later ones are claimed and
/// published. Each mark holds a connection; two cover one slow commit without letting
/// marks pile up behind a stalled database. A published batch waiting for one of these
/// slots keeps its lease meanwhile.
const MARKS_IN_FLIGHT: usize = 2;

/// The state of one drain wave.
#[derive(Debug, Default)]
pub(super) struct Wave {
    /// The due cutoff of the wave, once the first claim has fixed it.
    pub(super) cutoff: Option<DateTime<Utc>>,
    /// What was done so far.
    pub(super) report: DispatchReport,
    /// How many rows were claimed so far.
    pub(super) claimed: u64,
    /// When the earliest row that failed during the wave is due again (tokio clock).
    pub(super) retry_at: Option<Instant>,
    /// Keyed rows published whose marks are still running: claims may take the rows behind
    /// them ([`ClaimRequest::published`](crate::ClaimRequest::published)).
    pub(super) settled: HashSet<String>,
}

impl Wave {
    /// Notes the keyed rows of `published` that were published, until their mark ends.
    fn settling(&mut self, published: &Published) -> Vec<String> {
        let Some(results) = &published.results else {
            return Vec::new();
        };
        let claim = &published.claim;
        let ids: Vec<String> = claim
            .messages
            .iter()
            .zip(results)
            .enumerate()
            .filter(|(i, (_, result))| matches!(result, Some(Ok(_))) && claim.place(*i).is_keyed())
            .map(|(_, (m, _))| m.id.clone())
            .collect();
        self.settled.extend(ids.iter().cloned());
        ids
    }

    /// The rows [`settling`](Self::settling) noted, for a claim.
    fn published(&self) -> Arc<[String]> {
        self.settled.iter().cloned().collect()
    }

    fn absorb(&mut self, (marked, settled): (Marked, Vec<String>)) {
        for id in &settled {
            self.settled.remove(id);
        }
        self.report.add(marked.report);
        if let Some(at) = marked.retry_at {
            earliest(&mut self.retry_at, at);
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

/// A claimed batch after publishing, waiting to be marked.
struct Published {
    claim: Claim,
    /// One result per message (`None`: held back behind a failed row of its key, and
    /// released); `None` when the batch was not published (or not to the end) because its
    /// lease could not be kept: nothing of it is marked.
    results: Option<Vec<Option<PublishResult>>>,
    /// When the lease ends after publishing (tokio clock): the mark keeps it from there.
    lease_end: Instant,
    span: tracing::Span,
}

/// What publishing one message did.
type PublishResult = Result<Option<serde_json::Value>, PublishError>;

/// What marking one batch did.
#[derive(Debug, Default)]
struct Marked {
    report: DispatchReport,
    /// When the earliest row this batch marked failed is due again (tokio clock).
    retry_at: Option<Instant>,
}

/// The drain logic shared by [`dispatch_outbox`] and the dispatcher task.
pub(super) struct Engine<'a, R, P> {
    pub(super) repo: &'a R,
    pub(super) publisher: &'a P,
    pub(super) options: &'a DispatchOptions,
    pub(super) on_error: Option<&'a (dyn Fn(&DispatchError) + Send + Sync)>,
    pub(super) cancel: Option<&'a CancellationToken>,
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
    /// `n` is published while batch `n + 1` is claimed, and the marks of earlier batches run
    /// beside both (up to [`MARKS_IN_FLIGHT`] of them): a batch costs about as long as the
    /// slower of its claim and its publish, and a mark that waits for a slow commit holds
    /// up neither the next claim nor the next publish. `wake` (the dispatcher's notify
    /// channel) lets a notify that arrives while the last marks are still running start the
    /// next claim at once instead of after them.
    pub(super) async fn wave(
        &self,
        wave: &mut Wave,
        mut wake: Option<&mut mpsc::Receiver<()>>,
    ) -> Result<(), DispatchError> {
        if self.cancelled() {
            return Ok(());
        }
        let first = self.claim(wave.cutoff, wave.published()).await?;
        wave.cutoff = Some(first.claim.cutoff);
        let mut current = Some(first).filter(|leased| !leased.claim.is_empty());
        if !self.repo.overlaps_batches() {
            while let Some(leased) = current.take() {
                if self.cancelled() {
                    self.release(&leased.claim).await;
                    return Ok(());
                }
                wave.claimed += leased.claim.len() as u64;
                let span = batch_span(&leased.claim);
                let published = self.publish(leased, span).await;
                self.mark_into(wave, published).await;
                if !self.cancelled() {
                    current = Some(self.claim(wave.cutoff, wave.published()).await?)
                        .filter(|l| !l.claim.is_empty());
                }
            }
            return Ok(());
        }
        // Published batches being marked, beside the claim and publish of the next ones.
        let slots = Semaphore::new(MARKS_IN_FLIGHT);
        let marking = |published: Published, settled: Vec<String>| {
            let slots = &slots;
            async move { (self.mark(published, Some(slots)).await, settled) }
        };
        let mut marks = FuturesUnordered::new();
        let outcome = loop {
            let Some(leased) = current.take() else {
                // The last claim found nothing. A notify while earlier marks still run
                // means rows were committed since that claim: claim again now.
                let Some(wake) = wake.as_deref_mut().filter(|_| !marks.is_empty()) else {
                    break Ok(());
                };
                let notified = tokio::select! {
                    biased;
                    Some(marked) = marks.next() => {
                        wave.absorb(marked);
                        false
                    }
                    Some(()) = wake.recv(), if !self.cancelled() => true,
                    else => false,
                };
                if !notified {
                    continue;
                }
                let claiming = self.claim(wave.cutoff, wave.published());
                let next = beside_marks(claiming, &mut marks, |m| wave.absorb(m)).await;
                match next {
                    Ok(next) => current = Some(next).filter(|l| !l.claim.is_empty()),
                    Err(error) => break Err(error),
                }
                continue;
            };
            if self.cancelled() {
                self.release(&leased.claim).await;
                break Ok(());
            }
            wave.claimed += leased.claim.len() as u64;
            let span = batch_span(&leased.claim);
            let (cutoff, settled) = (wave.cutoff, wave.published());
            let claim_next = async {
                if self.cancelled() {
                    None
                } else {
                    Some(self.claim(cutoff, settled).await)
                }
            };
            // The batch's mark starts as soon as it is published, not after the next claim,
            // and keeps the batch's lease while it waits for a slot (`slots`): the lease
            // must last until the mark.
            let mut publishing = pin!(self.publish(leased, span));
            let mut claiming = pin!(claim_next);
            let mut publish_done = false;
            let mut claimed: Option<Option<Result<Leased, DispatchError>>> = None;
            while !(publish_done && claimed.is_some()) {
                tokio::select! {
                    biased;
                    Some(marked) = marks.next(), if !marks.is_empty() => wave.absorb(marked),
                    published = &mut publishing, if !publish_done => {
                        publish_done = true;
                        let settled = wave.settling(&published);
                        marks.push(marking(published, settled));
                    }
                    next = &mut claiming, if claimed.is_none() => claimed = Some(next),
                }
            }
            // No more than MARKS_IN_FLIGHT marks outstanding when the next publish starts.
            finish_marks(&mut marks, MARKS_IN_FLIGHT, |m| wave.absorb(m)).await;
            match claimed.flatten() {
                Some(Ok(next)) => current = Some(next).filter(|l| !l.claim.is_empty()),
                // Marks still finish below before the wave gives up.
                Some(Err(error)) => break Err(error),
                None => {}
            }
        };
        finish_marks(&mut marks, 0, |m| wave.absorb(m)).await;
        outcome
    }

    /// Claims one batch.
    async fn claim(
        &self,
        cutoff: Option<DateTime<Utc>>,
        published: Arc<[String]>,
    ) -> Result<Leased, DispatchError> {
        let started = Instant::now();
        let timer = std::time::Instant::now();
        let request = ClaimRequest::new(self.options.batch_size, self.options.lease)
            .cutoff(cutoff)
            .published(published);
        let claim = self
            .repo
            .claim(request)
            .instrument(tracing::debug_span!(
                "outbox_claim",
                limit = self.options.batch_size
            ))
            .await
            .map_err(DispatchError::repository("claim due rows"))?;
        metrics::seconds(metrics::CLAIM_SECONDS, timer);
        ::metrics::histogram!(metrics::CLAIMED_ROWS).record(claim.len() as f64);
        Ok(Leased {
            claim,
            deadline: deadline(started, self.options.lease),
        })
    }

    /// Releases the leases of a claim that will not be attempted (shutdown, or a lease that
    /// could not be kept), reporting a failure.
    async fn release(&self, claim: &Claim) {
        match self.repo.release(claim, &claim.leased_ids()).await {
            Ok(released) => tracing::debug!(released, "released rows not attempted"),
            // The rows stay leased until their lease ends, then are claimed again.
            Err(source) => self.emit(DispatchError::Repository {
                operation: "release unattempted rows",
                source,
            }),
        }
    }
}

/// The tracing span of one batch.
fn batch_span(claim: &Claim) -> tracing::Span {
    tracing::debug_span!("outbox_batch", rows = claim.len(), token = %claim.token)
}

/// `from + duration`, or about 30 years from `from` if that overflows.
pub(super) fn deadline(from: Instant, duration: Duration) -> Instant {
    from.checked_add(duration)
        .unwrap_or_else(|| from + Duration::from_secs(86_400 * 365 * 30))
}

/// Runs `work` to its end while the marks in flight go on beside it, handing each one that
/// finishes meanwhile to `absorb`.
async fn beside_marks<T, M: Future>(
    work: impl Future<Output = T>,
    marks: &mut FuturesUnordered<M>,
    mut absorb: impl FnMut(M::Output),
) -> T {
    let mut work = pin!(work);
    loop {
        tokio::select! {
            biased;
            out = &mut work => return out,
            Some(marked) = marks.next() => absorb(marked),
        }
    }
}

/// Waits until at most `keep` marks are in flight, handing each one that finishes to
/// `absorb` (`MARKS_IN_FLIGHT - 1` makes room for one more; 0 waits for all).
async fn finish_marks<M: Future>(
    marks: &mut FuturesUnordered<M>,
    keep: usize,
    mut absorb: impl FnMut(M::Output),
) {
    while marks.len() > keep {
        match marks.next().await {
            Some(marked) => absorb(marked),
            None => break,
        }
    }
}

/// Keeps in `slot` the earlier of its instant and `at`.
fn earliest(slot: &mut Option<Instant>, at: Instant) {
    *slot = Some(slot.map_or(at, |t| t.min(at)));
}
