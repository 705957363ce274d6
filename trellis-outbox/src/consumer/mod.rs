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
mod delivered;
mod error;
mod handler;
mod run;

use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use builder::{
    Consumer, ConsumerBuilder, DEAD_LETTER_STREAM, DEAD_LETTER_SUBJECT_PREFIX, DEFAULT_ACK_WAIT,
    DEFAULT_CONSUMER_CONCURRENCY, DEFAULT_MAX_DELIVERIES,
};
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
}

/// A running [`Consumer`]. [`shutdown`](Self::shutdown) stops pulling and waits for the
/// messages in hand; dropping it stops pulling without waiting.
#[derive(Debug)]
pub struct ConsumerHandle {
    cancel: CancellationToken,
    task: Option<JoinHandle<Result<(), ConsumerError>>>,
    stats: Arc<run::Stats>,
}

impl ConsumerHandle {
    fn new(
        cancel: CancellationToken,
        task: JoinHandle<Result<(), ConsumerError>>,
        stats: Arc<run::Stats>,
    ) -> Self {
        Self {
            cancel,
            task: Some(task),
            stats,
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
    /// # Errors
    ///
    /// [`ConsumerError::Pull`] if the consumer had stopped because pulling could not start.
    pub async fn shutdown(mut self) -> Result<ConsumerReport, ConsumerError> {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            match task.await {
                Ok(result) => result?,
                Err(err) => tracing::error!(error = %err, "the consumer task ended abnormally"),
            }
        }
        Ok(self.stats.report())
    }
}

impl Drop for ConsumerHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
