//! The delivery side of dispatching.

use std::error::Error as StdError;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::dispatch::retry::RetryPolicy;
use crate::record::OutboxMessage;

/// A boxed error from a publisher.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Why one message could not be delivered, and whether trying again may help.
///
/// # Examples
///
/// ```
/// use trellis_outbox::PublishError;
///
/// let err = PublishError::permanent("maximum payload exceeded");
/// assert!(!err.is_retryable());
/// assert_eq!(err.to_string(), "maximum payload exceeded");
/// ```
#[derive(Debug)]
pub struct PublishError {
    retryable: bool,
    source: BoxError,
}

crate::chain::retry_classified!(
    PublishError,
    retryable: "A failure that may pass on a later attempt (timeouts, broken connections, no \
                responders, a stream not created yet).",
    permanent: "A failure that no retry will fix (payload larger than the server allows, an \
                invalid subject): the row goes straight to `dead`. Its [`chain`](Self::chain) \
                is what is stored in `last_error` (upstream stores only a generic message)."
);

impl StdError for PublishError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source.source()
    }
}

/// Delivers claimed outbox messages (to JetStream, or anywhere else).
///
/// `publish_batch` receives a whole claimed batch so it can pipeline: send every message,
/// then await the acknowledgements. It returns one result per message, in order; `Ok` may
/// carry an outcome to store in the row's `outcome` column.
pub trait Publisher: Send + Sync + 'static {
    /// Delivers `messages`, returning one result per message, in the same order.
    fn publish_batch(
        &self,
        messages: &[OutboxMessage],
    ) -> impl Future<Output = Vec<Result<Option<serde_json::Value>, PublishError>>> + Send;

    /// Called once by an [`OutboxDispatcher`](crate::OutboxDispatcher) when its task starts,
    /// before the first drain, with the dispatcher's retry policy: a place for start-up
    /// checks (the JetStream publisher checks its streams here when asked to, see
    /// `JetStreamPublisherBuilder::check_streams_at_start`). It should report problems
    /// (e.g. with `tracing`) rather than block: the first drain waits for it. The default
    /// does nothing.
    fn on_start(&self, retry_policy: &RetryPolicy) -> impl Future<Output = ()> + Send {
        let _ = retry_policy;
        std::future::ready(())
    }

    /// The longest [`publish_batch`](Self::publish_batch) of `rows` messages may take (its
    /// timeouts added up), if the publisher bounds it. The dispatcher refuses a lease not
    /// longer than the budget of a full batch, and extends a batch's lease before publishing
    /// it when less than the budget is left. The default, `None`, means unknown: the
    /// dispatcher then keeps at least a third of the lease in hand instead.
    ///
    /// ```
    /// use std::time::Duration;
    /// use trellis_outbox::{OutboxMessage, PublishError, Publisher};
    ///
    /// struct OneSecondEach;
    ///
    /// impl Publisher for OneSecondEach {
    ///     async fn publish_batch(
    ///         &self,
    ///         messages: &[OutboxMessage],
    ///     ) -> Vec<Result<Option<serde_json::Value>, PublishError>> {
    ///         messages.iter().map(|_| Ok(None)).collect()
    ///     }
    ///
    ///     fn publish_budget(&self, rows: usize) -> Option<Duration> {
    ///         Some(Duration::from_secs(1).saturating_mul(u32::try_from(rows).unwrap_or(u32::MAX)))
    ///     }
    /// }
    ///
    /// assert_eq!(OneSecondEach.publish_budget(3), Some(Duration::from_secs(3)));
    /// ```
    fn publish_budget(&self, rows: usize) -> Option<Duration> {
        let _ = rows;
        None
    }
}

// Sharing: a dispatcher can run over an `Arc` of a publisher the application also uses
// elsewhere.
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

/// A publisher for unit tests: every message is published; the budget, when set, is this
/// much per row.
#[cfg(test)]
pub(crate) struct TestPublisher(pub(crate) Option<Duration>);

#[cfg(test)]
impl Publisher for TestPublisher {
    async fn publish_batch(
        &self,
        messages: &[OutboxMessage],
    ) -> Vec<Result<Option<serde_json::Value>, PublishError>> {
        messages.iter().map(|_| Ok(None)).collect()
    }

    fn publish_budget(&self, rows: usize) -> Option<Duration> {
        let rows = u32::try_from(rows).unwrap_or(u32::MAX);
        self.0.map(|per_row| per_row.saturating_mul(rows))
    }
}
