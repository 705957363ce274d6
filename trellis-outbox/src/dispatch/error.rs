//! What goes wrong while dispatching, and how it is reported: [`DispatchError`], its
//! [`Disposition`]s, and the [`ErrorCallback`] every stage reports through.

use std::any::Any;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use crate::chain::error_chain;
use crate::dispatch::publisher::PublishError;
#[cfg(doc)]
use crate::dispatch::{DispatchOptions, DispatcherBuilder, OutboxDispatcher};
use crate::error::Error;

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
    pub(super) fn repository(operation: &'static str) -> impl FnOnce(Error) -> Self {
        move |source| DispatchError::Repository { operation, source }
    }

    /// The report of a panic caught in the publisher or the repository.
    pub(super) fn panicked(what: &'static str, panic: &(dyn Any + Send)) -> Self {
        DispatchError::Panicked {
            what,
            message: panic_message(panic),
        }
    }
}

/// Logs `error` and hands it to the callback, surviving a panicking callback.
pub(super) fn report_error(
    on_error: Option<&(dyn Fn(&DispatchError) + Send + Sync)>,
    error: &DispatchError,
) {
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
        other => tracing::error!(error = %error_chain(other), "outbox dispatch error"),
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

pub(crate) fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_chain_and_panic_messages() {
        let err = DispatchError::Repository {
            operation: "claim due rows",
            source: Error::UnknownKind("x".into()),
        };
        assert_eq!(
            error_chain(&err),
            "outbox repository failed to claim due rows: unknown outbox record kind \"x\" \
             (expected event.publish, job.create or job.submit)"
        );
        let panic = catch_unwind(|| panic!("boom {}", 1)).unwrap_err();
        assert_eq!(panic_message(&*panic), "boom 1");
        let panic = catch_unwind(|| std::panic::panic_any(7)).unwrap_err();
        assert_eq!(panic_message(&*panic), "(non-string panic payload)");
    }
}
