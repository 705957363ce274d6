//! The completer stage of a drain: records what publishing a batch did — rows
//! `dispatched`, `failed` (to retry) or `dead` — and reports the failures.

use std::collections::HashSet;

use tokio::sync::Semaphore;
use tokio::time::Instant;
use tracing::Instrument;

use super::{Engine, Marked, Published, Wave, deadline, earliest};
use crate::chain::error_chain;
use crate::dispatch::error::{DispatchError, Disposition};
use crate::dispatch::publisher::{PublishError, Publisher};
use crate::dispatch::repository::{Claim, Dispatched, Failure, OutboxRepository};
use crate::error::Error;
use crate::metrics;
use crate::record::OutboxMessage;

/// How many ids a [`DispatchError::PublishBatch`] report lists.
const REPORTED_IDS: usize = 10;

impl<R: OutboxRepository, P: Publisher> Engine<'_, R, P> {
    /// Marks a published batch and adds the outcome to the wave.
    pub(super) async fn mark_into(&self, wave: &mut Wave, published: Published) {
        wave.absorb((self.mark(published, None).await, Vec::new()));
    }

    /// Records the outcome of a published batch: published rows `dispatched` first, then
    /// undecodable and failed rows `dead` or `failed` in one call. Repository errors are
    /// reported (a batch statement that fails for a reason other than the connection is
    /// retried row by row); rows left unmarked stay leased until their lease ends.
    ///
    /// With `slots`, the mark first waits for one of them (marks in flight at once). The
    /// batch's lease is kept from the start of the wait to the end of the mark.
    pub(super) async fn mark(&self, published: Published, slots: Option<&Semaphore>) -> Marked {
        let Published {
            claim,
            results,
            lease_end,
            span,
        } = published;
        let was_published = results.is_some();
        let marking = async {
            let mut marked = Marked::default();
            // Not published (the lease could not be kept): the claim was released.
            let Some(results) = results else {
                return marked;
            };
            // Never closed: `None` only if it were, and the mark goes ahead then.
            let _slot = match slots {
                Some(slots) => slots.acquire().await.ok(),
                None => None,
            };
            let started = std::time::Instant::now();
            let mut lost = 0u64;
            let mut dispatched = Vec::new();
            let mut dispatched_names: Vec<&str> = Vec::new();
            let mut failures: Vec<(&OutboxMessage, PublishError)> = Vec::new();
            for (message, result) in claim.messages.iter().zip(results) {
                // Held back by its key (and released): not attempted.
                let Some(result) = result else {
                    continue;
                };
                match result {
                    Ok(outcome) => {
                        dispatched_names.push(&message.name);
                        dispatched.push(Dispatched {
                            id: message.id.clone(),
                            outcome: outcome.map(sanitize_outcome),
                        });
                    }
                    Err(error) => failures.push((message, error)),
                }
            }
            if !dispatched.is_empty() {
                let marks = self.mark_dispatched(&claim, &dispatched).await;
                let (done, dead) = (marks.done, marks.dead);
                marked.report.dispatched = marked.report.dispatched.saturating_add(done);
                marked.report.dead = marked.report.dead.saturating_add(dead);
                lost += (dispatched.len() as u64).saturating_sub(done.saturating_add(dead));
                match marks.rows {
                    // Marked one by one: each row's name is known.
                    Some(rows) => {
                        for (name, mark) in dispatched_names.iter().zip(rows) {
                            match mark {
                                RowMark::Dispatched => metrics::count(metrics::DISPATCHED, name, 1),
                                RowMark::Dead => metrics::count(metrics::DEAD, name, 1),
                                RowMark::Unmarked => {}
                            }
                        }
                    }
                    None if done == dispatched.len() as u64 => {
                        for name in &dispatched_names {
                            metrics::count(metrics::DISPATCHED, name, 1);
                        }
                    }
                    // The statement marked fewer rows than it was given (leases lost): which
                    // ones is not known.
                    None => metrics::count(metrics::DISPATCHED, metrics::UNATTRIBUTED_NAME, done),
                }
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
            // The rows the repository did not confirm (a custom repository may answer ids it
            // was not asked about: they are not counted).
            lost += rows.iter().filter(|row| !done.contains(&row.id)).count() as u64;

            for poison in claim.poisoned.iter().filter(|p| done.contains(&p.id)) {
                marked.report.dead += 1;
                metrics::count(metrics::DEAD, metrics::POISON_NAME, 1);
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
                    Disposition::Dead => {
                        marked.report.dead += 1;
                        metrics::count(metrics::DEAD, &message.name, 1);
                    }
                    Disposition::RetryAfter(delay) => {
                        marked.report.failed += 1;
                        metrics::count(metrics::FAILED, &message.name, 1);
                        let at = deadline(Instant::now(), delay);
                        earliest(&mut marked.retry_at, at);
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
            metrics::seconds(metrics::MARK_SECONDS, started);
            tracing::debug!(
                dispatched = marked.report.dispatched,
                failed = marked.report.failed,
                dead = marked.report.dead,
                "outbox batch done"
            );
            marked
        }
        .instrument(span);
        if was_published {
            self.keep_lease_while(&claim, lease_end, marking).await
        } else {
            marking.await
        }
    }

    /// Reports the publish failures of one batch: a single failure as itself, several as
    /// one [`DispatchError::PublishBatch`], so an outage makes one report per batch.
    fn report_failures(&self, reported: Vec<DispatchError>) {
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
        let Some(first) = reported.into_iter().next() else {
            return;
        };
        if rows == 1 {
            self.emit(first);
            return;
        }
        self.emit(DispatchError::PublishBatch {
            rows,
            retrying: rows - dead,
            dead,
            ids,
            first: Box::new(first),
        });
    }

    /// Marks `rows` dispatched; returns how many were marked. A failed batch statement is
    /// tried once more when the failure is transient, or row by row otherwise; a row that
    /// still cannot be marked `dispatched` is moved to `dead` (it was published: retrying it
    /// by itself would publish it again and again). Failures are reported.
    ///
    /// Returns how many rows were marked `dispatched` and how many `dead`, and each row's
    /// outcome when they were marked one by one.
    async fn mark_dispatched(&self, claim: &Claim, rows: &[Dispatched]) -> DispatchedMarks {
        let batch = |done| DispatchedMarks {
            done,
            dead: 0,
            rows: None,
        };
        let error = match self.repo.mark_dispatched(claim, rows).await {
            Ok(done) => return batch(done),
            Err(error) => error,
        };
        if error.is_retryable() {
            match self.repo.mark_dispatched(claim, rows).await {
                Ok(done) => return batch(done),
                Err(source) => {
                    self.emit(DispatchError::Repository {
                        operation: "mark rows dispatched",
                        source,
                    });
                    return batch(0);
                }
            }
        }
        self.emit(DispatchError::Repository {
            operation: "mark rows dispatched (retrying row by row)",
            source: error,
        });
        let (mut done, mut dead) = (0, 0);
        let mut marks = Vec::with_capacity(rows.len());
        for row in rows {
            let one = std::slice::from_ref(row);
            let mut marked = self.repo.mark_dispatched(claim, one).await;
            if marked.as_ref().is_err_and(Error::is_retryable) {
                marked = self.repo.mark_dispatched(claim, one).await;
            }
            let mark = match marked {
                Ok(0) => RowMark::Unmarked,
                Ok(n) => {
                    done += n;
                    RowMark::Dispatched
                }
                // Still transient: the row stays leased and is claimed again after its
                // lease (and published again, which the stream's de-duplication drops).
                // Moving a published row to `dead` for a passing fault would stop its key.
                Err(source) if source.is_retryable() => {
                    self.emit(DispatchError::Repository {
                        operation: "mark a published row dispatched",
                        source,
                    });
                    RowMark::Unmarked
                }
                Err(source) => {
                    let reason = sanitize_text(&format!(
                        "published, but it could not be marked dispatched: {}",
                        error_chain(&source)
                    ));
                    let failure = Failure::dead(row.id.clone(), reason, false);
                    match self.repo.mark_failures(claim, &[failure]).await {
                        // A custom repository may answer ids it was not asked about.
                        Ok(ids) if ids.contains(&row.id) => {
                            dead += 1;
                            RowMark::Dead
                        }
                        Ok(_) => RowMark::Unmarked,
                        Err(source) => {
                            self.emit(DispatchError::Repository {
                                operation: "mark a published row",
                                source,
                            });
                            RowMark::Unmarked
                        }
                    }
                }
            };
            marks.push(mark);
        }
        DispatchedMarks {
            done,
            dead,
            rows: Some(marks),
        }
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
}

/// What marking published rows `dispatched` did.
struct DispatchedMarks {
    /// Rows marked `dispatched`.
    done: u64,
    /// Rows moved to `dead` because they could not be marked `dispatched`.
    dead: u64,
    /// Each row's outcome, in the order given, when they were marked one by one.
    rows: Option<Vec<RowMark>>,
}

/// How one published row ended when marked by itself.
#[derive(Debug, Clone, Copy)]
enum RowMark {
    Dispatched,
    Dead,
    /// Still leased (its lease was lost, or the mark failed): claimed again later.
    Unmarked,
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
