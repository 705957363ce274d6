//! The consuming side (feature `nats`): [`Consumer`] applies JetStream messages exactly once
//! into a database with the inbox, and lets the handler enqueue follow-up events atomically.
//!
//! One message's path: `run.rs` pulls it, decodes the id and payload (a message without an
//! id, or whose payload is not the event, is dead-lettered), begins a transaction, records the
//! id in the inbox (a duplicate is acknowledged and skipped), runs the [`Handler`]
//! (`handler.rs`), commits and acknowledges; a failure rolls back and naks with a backoff, and
//! the last delivery copies the message to the dead-letter subject and terminates it.
//! `builder.rs` binds or creates the JetStream consumer; `error.rs` holds what is reported.

mod builder;
mod dead_letters;
mod delivered;
mod error;
mod handler;
mod run;

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use builder::{
    Consumer, ConsumerBuilder, DEAD_LETTER_STREAM, DEAD_LETTER_SUBJECT_PREFIX, DEFAULT_ACK_WAIT,
    DEFAULT_CONSUMER_CONCURRENCY, DEFAULT_MAX_DELIVERIES, REPLAY_STREAM, REPLAY_SUBJECT_PREFIX,
};
pub use dead_letters::{DeadLetter, NotReplayed, ReplayReport, dead_letters, replay_dead_letters};
pub use delivered::Delivered;
pub use error::{ConsumeFailure, ConsumerError, FailureAction, FailureKind};
pub use handler::{Handler, HandlerError, HandlerFn, HandlerFuture, handler_fn};
pub use run::dead_letter_headers;

/// What a consumer has done since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerReport {
    /// Messages applied (handler ran, transaction committed).
    pub applied: u64,
    /// Messages found in the inbox and acknowledged without running the handler.
    pub duplicates: u64,
    /// Failed deliveries handed back for redelivery.
    pub redelivered: u64,
    /// Messages copied to the dead-letter subject and terminated.
    pub dead_lettered: u64,
    /// Messages terminated without a dead-letter copy.
    pub terminated: u64,
    /// Messages held, in progress, until the database answered again, and then tried again
    /// without a redelivery ([`FailureAction::WaitForDatabase`](crate::FailureAction::WaitForDatabase)).
    pub database_waits: u64,
    /// Messages still being applied when [`ConsumerHandle::shutdown_timeout`] gave up on
    /// them (or whose task ended without settling them): their transactions were rolled
    /// back, and the server delivers them again after their ack wait unless that was their
    /// last delivery.
    pub abandoned: u64,
}

/// A running [`Consumer`]. [`shutdown`](Self::shutdown) stops pulling and waits for the
/// messages in hand; dropping it stops pulling without waiting.
#[derive(Debug)]
pub struct ConsumerHandle {
    cancel: CancellationToken,
    task: Option<JoinHandle<Result<(), ConsumerError>>>,
    stats: Arc<run::Stats>,
    /// The consumer's NATS connection, flushed after an aborted shutdown.
    client: async_nats::Client,
}

/// How long [`ConsumerHandle::shutdown_timeout`] waits, after aborting, for the message tasks
/// to be dropped and for the last acknowledgements to be sent.
const ABORT_GRACE: Duration = Duration::from_secs(1);

impl ConsumerHandle {
    fn new(
        cancel: CancellationToken,
        task: JoinHandle<Result<(), ConsumerError>>,
        stats: Arc<run::Stats>,
        client: async_nats::Client,
    ) -> Self {
        Self {
            cancel,
            task: Some(task),
            stats,
            client,
        }
    }

    /// The counters so far.
    pub fn report(&self) -> ConsumerReport {
        self.stats.report()
    }

    /// Stops pulling, lets the messages being applied finish (commit and acknowledge, or
    /// roll back and nak), and returns the final counters. Messages pulled but not started
    /// are redelivered by the server after their ack wait.
    ///
    /// This waits for every handler in hand, however long it runs; to bound the wait, use
    /// [`shutdown_timeout`](Self::shutdown_timeout).
    ///
    /// # Errors
    ///
    /// [`ConsumerError::Pull`] if the consumer had stopped because pulling could not start.
    pub async fn shutdown(mut self) -> Result<ConsumerReport, ConsumerError> {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            log_join(task.await)?;
        }
        Ok(self.stats.report())
    }

    /// Like [`shutdown`](Self::shutdown), but gives the messages in hand at most `timeout`
    /// to finish. Past it, their tasks are aborted: each handler's transaction is dropped
    /// and so rolled back, nothing is acknowledged for them, and the server delivers them
    /// again after their ack wait (the inbox absorbs the redelivery of one whose commit had
    /// gone through). [`ConsumerReport::abandoned`] counts them. Use it where the process has
    /// a deadline to stop, such as a container's grace period after `SIGTERM`; it returns at
    /// most about 2 s after `timeout` (the aborted tasks' clean-up and a flush of the
    /// acknowledgements already queued, 1 s each at most).
    ///
    /// What an abort cannot undo:
    /// * A message aborted at the JetStream consumer's last delivery (`max_deliver`) is not
    ///   delivered again, and no dead-letter copy is made; it is only counted. Each abort
    ///   spends one delivery, so leave the consumer deliveries to spare (the default
    ///   `max_deliveries` is one less than `max_deliver`).
    /// * An abort stops waiting for a statement, not the statement: on Postgres a statement
    ///   in progress (a lock wait, a slow query) runs on until it ends, and its connection
    ///   and row locks stay taken meanwhile (a redelivery elsewhere may wait on them). Give
    ///   the handler's statements a `statement_timeout`.
    /// * A handler blocking its thread (not awaiting) is not stopped at all.
    ///
    /// # Errors
    ///
    /// As [`shutdown`](Self::shutdown).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn run(consumer: trellis_outbox::ConsumerHandle) -> Result<(), trellis_outbox::ConsumerError> {
    /// use std::time::Duration;
    ///
    /// let report = consumer.shutdown_timeout(Duration::from_secs(20)).await?;
    /// if report.abandoned > 0 {
    ///     eprintln!("{} messages left for redelivery", report.abandoned);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn shutdown_timeout(
        mut self,
        timeout: Duration,
    ) -> Result<ConsumerReport, ConsumerError> {
        self.cancel.cancel();
        let Some(mut task) = self.task.take() else {
            return Ok(self.stats.report());
        };
        if let Ok(joined) = tokio::time::timeout(timeout, &mut task).await {
            log_join(joined)?;
            return Ok(self.stats.report());
        }
        let in_hand = self.stats.in_hand();
        task.abort();
        // Dropping the task drops its message tasks' set, which aborts them; each is dropped
        // at its next await. Give them a moment, then send what the finished ones queued.
        let ended = task.await;
        let grace = tokio::time::Instant::now() + ABORT_GRACE;
        while self.stats.in_hand() > 0 && tokio::time::Instant::now() < grace {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        match tokio::time::timeout(ABORT_GRACE, self.client.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                tracing::warn!(error = %err, "flushing the last acknowledgements failed")
            }
            Err(_) => tracing::warn!("flushing the last acknowledgements timed out"),
        }
        tracing::warn!(
            ?timeout,
            in_hand,
            "the consumer did not stop in time; the messages in hand were abandoned to redelivery"
        );
        // The task may have ended on its own just as it was aborted.
        match ended {
            Err(err) if err.is_cancelled() => {}
            ended => log_join(ended)?,
        }
        Ok(self.stats.report())
    }
}

/// The run task's result, or its panic logged.
fn log_join(
    joined: Result<Result<(), ConsumerError>, tokio::task::JoinError>,
) -> Result<(), ConsumerError> {
    match joined {
        Ok(result) => result,
        Err(err) => {
            tracing::error!(error = %err, "the consumer task ended abnormally");
            Ok(())
        }
    }
}

impl Drop for ConsumerHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
