//! The handoff lane of the dispatcher task: publishes the rows a
//! [`HandoffTransaction`](crate::HandoffTransaction) handed over at commit, without claiming
//! them (they were written leased to this dispatcher), then marks them with the handoff
//! token. Runs beside the drains in the same task: the rows are leased to the lane, so no
//! drain can claim them meanwhile.

use std::pin::pin;
use std::time::Duration;

use chrono::Utc;
use futures_util::StreamExt as _;
use futures_util::stream::FuturesUnordered;
use tokio::sync::{Semaphore, mpsc};
use tokio::time::{Instant, sleep_until};

use super::{
    Engine, Leased, MARKS_IN_FLIGHT, Marked, Published, batch_span, deadline, finish_marks,
};
use crate::dispatch::handoff::Handoff;
use crate::dispatch::publisher::Publisher;
use crate::dispatch::repository::{Claim, OutboxRepository};
use crate::metrics;

/// How long published handed-over rows wait to be marked together. Transactions of one row
/// each are handed over one by one: marking each as soon as it is published would commit
/// once per row, and those commits compete with the producers' own for the WAL.
const MARK_WINDOW: Duration = Duration::from_millis(5);

impl<R: OutboxRepository, P: Publisher> Engine<'_, R, P> {
    /// Publishes handed-over rows as they arrive (what arrived together, up to the batch
    /// size in transactions, as one batch under the earliest of their leases), until
    /// shutdown. Published rows are marked together once the first of them has waited
    /// [`MARK_WINDOW`] or they fill a batch, or when a third of their lease is left (even
    /// while the next handoff publishes), beside the next publishes (at most
    /// [`MARKS_IN_FLIGHT`] marks at once). On shutdown, rows not yet published are released
    /// (claimable at once) and the marks finish. `wake` (the drains' notify channel) is told
    /// when a batch left failed rows, so the dispatcher arms its retry timer for them.
    ///
    /// The channel is unbounded: while the broker is slow, rows handed over wait in memory
    /// (and in the table, leased) for the lane, as many as producers commit meanwhile.
    pub(in crate::dispatch) async fn handoff_lane(
        &self,
        rows: &mut mpsc::UnboundedReceiver<Handoff>,
        queued: &std::sync::atomic::AtomicUsize,
        token: &str,
        wake: &mpsc::Sender<()>,
    ) {
        // Marks hitting the repository at once; a mark waiting for a slot keeps its lease.
        let slots = Semaphore::new(MARKS_IN_FLIGHT);
        let mut marks = FuturesUnordered::new();
        let mut received: Vec<Handoff> = Vec::new();
        let stopped = async {
            match self.cancel {
                Some(cancel) => cancel.cancelled().await,
                None => std::future::pending().await,
            }
        };
        let mut stopped = pin!(stopped);
        let settle = |marked: Marked| {
            if marked.report.failed > 0 || marked.retry_at.is_some() {
                let _ = wake.try_send(());
            }
        };
        // Published rows not yet marked, and when the first of them was published.
        let mut unmarked: Option<(Published, Instant)> = None;
        loop {
            // Published rows are marked once they waited MARK_WINDOW and a mark slot is free,
            // or when a third of their lease is left, slot or not (the mark keeps the lease
            // while it waits for one).
            let mark_at = unmarked.as_ref().map(|(published, since)| {
                let keep = self.mark_by(published);
                if marks.len() < MARKS_IN_FLIGHT {
                    keep.min(deadline(*since, MARK_WINDOW))
                } else {
                    keep
                }
            });
            tokio::select! {
                biased;
                () = &mut stopped => break,
                Some(marked) = marks.next() => {
                    settle(marked);
                    continue;
                }
                () = sleep_until(mark_at.unwrap_or_else(Instant::now)), if mark_at.is_some() => {
                    if let Some((published, _)) = unmarked.take() {
                        marks.push(self.mark(published, Some(&slots)));
                    }
                    continue;
                }
                got = rows.recv_many(&mut received, self.options.batch_size) => {
                    if got == 0 {
                        break;
                    }
                }
            }
            let taken = received.iter().map(|handoff| handoff.messages.len()).sum();
            queued.fetch_sub(taken, std::sync::atomic::Ordering::AcqRel);
            let leased = leased(token, received.drain(..));
            ::metrics::histogram!(metrics::HANDED_OVER_ROWS).record(leased.claim.len() as f64);
            let span = batch_span(&leased.claim);
            // Rows waiting for their mark do not wait through the whole publish: once a third
            // of their lease is left, their mark starts beside it (and keeps their lease).
            let keep_until = unmarked
                .as_ref()
                .map(|(published, _)| self.mark_by(published));
            let published = {
                let mut publish = pin!(self.publish(leased, span));
                loop {
                    tokio::select! {
                        biased;
                        published = &mut publish => break published,
                        Some(marked) = marks.next() => settle(marked),
                        () = sleep_until(keep_until.unwrap_or_else(Instant::now)),
                            if unmarked.is_some() =>
                        {
                            if let Some((waiting, _)) = unmarked.take() {
                                marks.push(self.mark(waiting, Some(&slots)));
                            }
                        }
                    }
                }
            };
            // Not published (the lease could not be kept): released, nothing to mark. The
            // rows are claimable at once, and no commit will announce them: wake the drains.
            if published.results.is_none() {
                let _ = wake.try_send(());
                continue;
            }
            let rows_unmarked = match &mut unmarked {
                Some((waiting, _)) => {
                    merge(waiting, published);
                    waiting.claim.len()
                }
                None => {
                    let rows = published.claim.len();
                    unmarked = Some((published, Instant::now()));
                    rows
                }
            };
            if rows_unmarked >= self.options.batch_size {
                if let Some((published, _)) = unmarked.take() {
                    marks.push(self.mark(published, Some(&slots)));
                }
                finish_marks(&mut marks, MARKS_IN_FLIGHT, settle).await;
            }
        }
        if let Some((published, _)) = unmarked.take() {
            marks.push(self.mark(published, Some(&slots)));
        }
        // Stopping: rows handed over but not published become claimable at once.
        rows.close();
        while let Ok(handoff) = rows.try_recv() {
            received.push(handoff);
        }
        if !received.is_empty() {
            self.release(&leased(token, received.drain(..)).claim).await;
        }
        finish_marks(&mut marks, 0, settle).await;
    }

    /// When published rows waiting to be marked must start their mark, slot or not: with a
    /// third of their lease left (the mark keeps the lease while it waits for a slot).
    fn mark_by(&self, published: &Published) -> Instant {
        let end = published.lease_end;
        end.checked_sub(self.options.lease / 3).unwrap_or(end)
    }
}

/// Adds the rows of `more` (published, like `into`) to `into`, to be marked in one go: all
/// handed-over rows carry the same token.
fn merge(into: &mut Published, more: Published) {
    let (Some(results), Some(more_results)) = (&mut into.results, more.results) else {
        return;
    };
    results.extend(more_results);
    into.lease_end = into.lease_end.min(more.lease_end);
    into.claim.messages.extend(more.claim.messages);
    into.claim.poisoned.extend(more.claim.poisoned);
}

/// The handed-over rows as one claim of `token`, its lease ending at the earliest of their
/// deadlines.
fn leased(token: &str, handoffs: impl Iterator<Item = Handoff>) -> Leased {
    let mut claim = Claim::empty(token.to_owned(), Utc::now());
    let mut deadline: Option<Instant> = None;
    for handoff in handoffs {
        deadline = Some(deadline.map_or(handoff.deadline, |d| d.min(handoff.deadline)));
        for message in handoff.messages {
            // The same wire check as a claim's rows: enqueue refused anything it fails.
            claim.push_message(message);
        }
    }
    Leased {
        claim,
        deadline: deadline.unwrap_or_else(Instant::now),
    }
}
