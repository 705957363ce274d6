//! The executor stage of a drain: runs the publisher on a claimed batch while keeping the
//! batch's lease, so a row is never published by two holders at once.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::time::{Instant, sleep_until};
use tracing::Instrument;

use super::{Engine, Leased, PublishResult, Published, deadline};
use crate::dispatch::claim::Ahead;
use crate::dispatch::error::{DispatchError, panic_message};
use crate::dispatch::publisher::{PublishError, Publisher};
use crate::dispatch::repository::{Claim, OutboxRepository};
use crate::error::Error;
use crate::record::OutboxMessage;

/// Why the lease keeper stopped a publish.
enum LeaseTrouble {
    /// Rows of the claim are held by another claim now: the lease was lost.
    Lost,
    /// The lease could not be extended and is about to end.
    Expiring,
}

impl<R: OutboxRepository, P: Publisher> Engine<'_, R, P> {
    /// Extends the lease on `ids` of `claim` to a full lease from now. Returns when the
    /// lease now ends (tokio clock), or `None` when a row is no longer held by the claim.
    async fn extend(&self, claim: &Claim, ids: &[&str]) -> Result<Option<Instant>, Error> {
        let started = Instant::now();
        let lease = self.options.lease;
        let extended = self.repo.extend_lease(claim, ids, lease).await?;
        Ok((extended == ids.len() as u64).then(|| deadline(started, lease)))
    }

    fn extend_failed(&self, source: Error) {
        self.emit(DispatchError::Repository {
            operation: "extend a lease",
            source,
        });
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
    pub(super) async fn publish(&self, leased: Leased, span: tracing::Span) -> Published {
        let Leased {
            claim,
            deadline: mut lease_end,
        } = leased;
        if claim.messages.is_empty() {
            return Published {
                results: Some(Vec::new()),
                claim,
                lease_end,
                span,
            };
        }
        let kept = async {
            // Undecodable rows too: they go dead with the batch's mark, after the publish.
            let ids = claim.leased_ids();
            let extends = self.repo.extends_leases();
            let needed = self.lease_needed(claim.messages.len());
            if lease_end.saturating_duration_since(Instant::now()) < needed {
                if !extends {
                    return Err(LeaseTrouble::Expiring);
                }
                match self.extend(&claim, &ids).await {
                    Ok(Some(at)) => lease_end = at,
                    Ok(None) => return Err(LeaseTrouble::Lost),
                    Err(source) => {
                        self.extend_failed(source);
                        return Err(LeaseTrouble::Expiring);
                    }
                }
            }
            let lease = self.options.lease;
            let keeper = async {
                if !extends {
                    // Stop before the lease ends rather than publish past it.
                    sleep_until(lease_end.checked_sub(lease / 10).unwrap_or(lease_end)).await;
                    return LeaseTrouble::Expiring;
                }
                loop {
                    sleep_until(lease_end.checked_sub(lease / 3).unwrap_or(lease_end)).await;
                    // An extension that hangs (a pool with no free connection, a lock wait)
                    // must not let the publish run past the lease: give up where a dispatcher
                    // that cannot extend would stop.
                    let stop = lease_end.checked_sub(lease / 10).unwrap_or(lease_end);
                    let Ok(extended) =
                        tokio::time::timeout_at(stop, self.extend(&claim, &ids)).await
                    else {
                        tracing::warn!("extending a lease did not finish before it ended");
                        return LeaseTrouble::Expiring;
                    };
                    match extended {
                        Ok(Some(at)) => lease_end = at,
                        Ok(None) => return LeaseTrouble::Lost,
                        Err(source) => {
                            self.extend_failed(source);
                            let left = lease_end.saturating_duration_since(Instant::now());
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
                results = self.publish_rounds(&claim) => Ok(results),
                trouble = keeper => Err(trouble),
            }
        }
        .instrument(span.clone())
        .await;
        let results = match kept {
            Ok((results, held)) => {
                self.release_held(&claim, &held).await;
                Some(results)
            }
            Err(trouble) => {
                let rows = claim.messages.len() as u64;
                self.emit(DispatchError::LeaseLost { rows });
                if matches!(trouble, LeaseTrouble::Lost) {
                    tracing::warn!(
                        rows,
                        "lost the lease of a batch while publishing it; stopped"
                    );
                }
                // Rows this claim still holds become claimable at once.
                self.release(&claim).await;
                None
            }
        };
        Published {
            claim,
            results,
            lease_end,
            span,
        }
    }

    /// Runs `mark` (the mark of a published batch) while keeping the batch's lease, which
    /// ends at `lease_end`: a row whose lease ended before its mark committed could be
    /// claimed and published again by another dispatcher (and a keyed row published again
    /// after the row behind it). With less than a third of the lease left (the batch waited
    /// for earlier marks) the lease is extended first; then, for as long as the mark runs,
    /// whenever two thirds of the lease have passed. Unlike a publish, a mark is never
    /// stopped: its rows are published, and recording that is what ends their lease.
    pub(super) async fn keep_lease_while<T>(
        &self,
        claim: &Claim,
        mut lease_end: Instant,
        mark: impl Future<Output = T>,
    ) -> T {
        if !self.repo.extends_leases() || claim.is_empty() {
            return mark.await;
        }
        let ids = claim.leased_ids();
        let lease = self.options.lease;
        // Extends the lease of the rows still held; `None` once none is (all marked or
        // taken over): nothing is left to keep.
        let extend = async |lease_end: Instant| -> Option<Instant> {
            let started = Instant::now();
            let limit = (lease / 3).max(Duration::from_millis(10));
            match tokio::time::timeout(limit, self.repo.extend_lease(claim, &ids, lease)).await {
                Ok(Ok(0)) => None,
                Ok(Ok(_)) => Some(deadline(started, lease)),
                Ok(Err(source)) => {
                    self.extend_failed(source);
                    Some(lease_end)
                }
                Err(_) => {
                    tracing::warn!("extending the lease of a batch being marked timed out");
                    Some(lease_end)
                }
            }
        };
        if lease_end.saturating_duration_since(Instant::now()) < lease / 3 {
            match extend(lease_end).await {
                Some(at) => lease_end = at,
                None => return mark.await,
            }
        }
        let keeper = async {
            loop {
                sleep_until(lease_end.checked_sub(lease / 3).unwrap_or(lease_end)).await;
                match extend(lease_end).await {
                    Some(at) if at > lease_end => lease_end = at,
                    // Failed: try again a little later, as long as the mark runs.
                    Some(_) => {
                        tokio::time::sleep((lease / 10).max(Duration::from_millis(10))).await
                    }
                    None => std::future::pending::<()>().await,
                }
            }
        };
        let mut mark = std::pin::pin!(mark);
        tokio::select! {
            biased;
            marked = &mut mark => marked,
            never = keeper => never,
        }
    }

    /// Publishes a claim's messages round by round (one round unless the claim holds runs of
    /// ordering keys, see `Claim::order_runs`): a message of a later round goes out only once
    /// the row of its key ahead of it was published, so a key never has two rows in flight.
    /// Messages held back by a failure are released, not attempted: `None` in the result.
    ///
    /// Also returns the held rows (their indexes in the claim's messages), for the caller to
    /// release once the lease keeper has stopped: released while it runs, they would make
    /// its next extension look like a lost lease.
    async fn publish_rounds(&self, claim: &Claim) -> (Vec<Option<PublishResult>>, Vec<usize>) {
        let messages = &claim.messages;
        if !claim.has_runs() {
            let results = self
                .call_publisher(messages)
                .await
                .into_iter()
                .map(Some)
                .collect();
            return (results, Vec::new());
        }
        let mut results: Vec<Option<PublishResult>> = messages.iter().map(|_| None).collect();
        // A row goes once the row ahead of it was published (an earlier round). Rows whose
        // row ahead failed or was held, or is not in the claim as a message (it was
        // poisoned), are held.
        let mut held = Vec::new();
        let mut start = 0;
        while start < messages.len() {
            let round = claim.place(start).round;
            let end = (start..messages.len())
                .find(|&i| claim.place(i).round != round)
                .unwrap_or(messages.len());
            let (ready, waiting): (Vec<usize>, Vec<usize>) =
                (start..end).partition(|&i| match claim.place(i).ahead {
                    Ahead::Unkeyed | Ahead::Head => true,
                    Ahead::Behind(ahead) => matches!(results.get(ahead), Some(Some(Ok(_)))),
                    Ahead::Held => false,
                });
            held.extend(waiting);
            start = end;
            let Some((&first, &last)) = ready.first().zip(ready.last()) else {
                continue;
            };
            // `Claim::order_runs` put each round next to each other: no copy then.
            let outcomes = if last - first + 1 == ready.len() {
                self.call_publisher(&messages[first..=last]).await
            } else {
                let round: Vec<OutboxMessage> =
                    ready.iter().map(|&i| messages[i].clone()).collect();
                self.call_publisher(&round).await
            };
            for (&i, outcome) in ready.iter().zip(outcomes) {
                results[i] = Some(outcome);
            }
        }
        (results, held)
    }

    /// Releases the rows `publish_rounds` held back behind a failed row of their key.
    async fn release_held(&self, claim: &Claim, held: &[usize]) {
        if !held.is_empty() {
            let held: Vec<&str> = held
                .iter()
                .map(|&i| claim.messages[i].id.as_str())
                .collect();
            match self.repo.release(claim, &held).await {
                Ok(released) => {
                    tracing::debug!(
                        released,
                        "released rows held back behind a failed row of their key"
                    );
                }
                // They stay leased until their lease ends, then are claimed again.
                Err(source) => self.emit(DispatchError::Repository {
                    operation: "release rows held back by their ordering key",
                    source,
                }),
            }
        }
    }

    /// Calls the publisher, turning a panic or a wrong number of results into per-message
    /// retryable errors.
    async fn call_publisher(&self, messages: &[OutboxMessage]) -> Vec<PublishResult> {
        let publishing = AssertUnwindSafe(self.publisher.publish_batch(messages)).catch_unwind();
        let started = std::time::Instant::now();
        let outcome = publishing.await;
        crate::metrics::seconds(crate::metrics::PUBLISH_SECONDS, started);
        let mut results = match outcome {
            Ok(results) => results,
            Err(panic) => {
                let message = panic_message(&*panic);
                let results = messages
                    .iter()
                    .map(|_| {
                        Err(PublishError::retryable(format!(
                            "the publisher panicked: {message}"
                        )))
                    })
                    .collect();
                self.emit(DispatchError::Panicked {
                    what: "publisher",
                    message,
                });
                return results;
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
