//! What the application runs for each new message, and how it says a message failed.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;

use futures_util::future::BoxFuture;
use sqlx::{Database, Transaction};

use super::Delivered;
use crate::dispatch::BoxError;

/// Why a handler did not apply a message, and whether a redelivery may succeed.
///
/// Any error converts into a retryable `HandlerError` with `?` (a database error, a
/// downstream call that timed out); say [`HandlerError::permanent`] for a message no retry
/// will fix, so it goes to the dead-letter subject at once instead of after the last delivery.
/// It deliberately does not implement `std::error::Error` itself (that would make the blanket
/// `From` impl overlap), like `anyhow::Error`.
///
/// # Examples
///
/// ```
/// use trellis_outbox::HandlerError;
///
/// fn parse(amount: &str) -> Result<u64, HandlerError> {
///     let cents = amount.parse::<u64>()?; // a ParseIntError: retryable by default
///     if cents == 0 {
///         return Err(HandlerError::permanent("an order of 0 cents cannot be billed"));
///     }
///     Ok(cents)
/// }
///
/// assert!(parse("x").unwrap_err().is_retryable());
/// assert!(!parse("0").unwrap_err().is_retryable());
/// ```
pub struct HandlerError {
    retryable: bool,
    source: BoxError,
}

crate::chain::retry_classified!(
    HandlerError,
    retryable: "A failure a later delivery may not repeat (a lock timeout, a service that was \
                down): the message is redelivered after a backoff, up to the consumer's last \
                delivery.",
    permanent: "A failure no redelivery will fix: the message is dead-lettered and terminated \
                now."
);

impl<E: StdError + Send + Sync + 'static> From<E> for HandlerError {
    fn from(err: E) -> Self {
        Self::retryable(err)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("retryable", &self.retryable)
            .field("source", &self.source)
            .finish()
    }
}

/// Applies one new message inside the consumer's transaction.
///
/// The transaction already holds the message's inbox row; the handler writes the
/// message's effects (and may `tx.enqueue(…)` follow-up events) in it. The consumer commits
/// after `Ok` and rolls back after `Err`. Implement it on a type with an `async fn`, or pass
/// a closure through [`handler_fn`].
///
/// ```
/// use sqlx::{Postgres, Transaction};
/// use trellis_outbox::{Delivered, Handler, HandlerError};
///
/// #[derive(serde::Deserialize)]
/// struct OrderShipped { order_id: String }
///
/// struct RecordShipment;
///
/// impl Handler<Postgres, OrderShipped> for RecordShipment {
///     async fn handle(
///         &self,
///         tx: &mut Transaction<'static, Postgres>,
///         delivered: Delivered<OrderShipped>,
///     ) -> Result<(), HandlerError> {
///         sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
///             .bind(&delivered.event.order_id)
///             .execute(&mut **tx)
///             .await?;
///         Ok(())
///     }
/// }
/// ```
pub trait Handler<DB: Database, E>: Send + Sync + 'static {
    /// Applies `delivered` in `tx`.
    fn handle(
        &self,
        tx: &mut Transaction<'static, DB>,
        delivered: Delivered<E>,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// A [`Handler`] from a closure returning a boxed future (the `sqlx` transaction-closure
/// idiom: the future borrows the transaction, so it is boxed).
///
/// ```
/// use sqlx::Postgres;
/// use trellis_outbox::{Delivered, handler_fn};
///
/// #[derive(serde::Deserialize)]
/// struct OrderShipped { order_id: String }
///
/// let handler = handler_fn(|tx: &mut sqlx::Transaction<'static, Postgres>, d: Delivered<OrderShipped>| {
///     Box::pin(async move {
///         sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
///             .bind(&d.event.order_id)
///             .execute(&mut **tx)
///             .await?;
///         Ok(())
///     })
/// });
/// # let _ = handler;
/// ```
pub fn handler_fn<DB, E, F>(f: F) -> HandlerFn<DB, E>
where
    DB: Database,
    F: for<'t> Fn(&'t mut Transaction<'static, DB>, Delivered<E>) -> HandlerFuture<'t>
        + Send
        + Sync
        + 'static,
{
    HandlerFn(Box::new(f))
}

/// What a [`handler_fn`] closure returns.
pub type HandlerFuture<'t> = BoxFuture<'t, Result<(), HandlerError>>;

/// A closure as a [`Handler`]; made by [`handler_fn`].
pub struct HandlerFn<DB: Database, E>(Box<dyn ClosureHandler<DB, E>>);

/// The closures [`handler_fn`] takes, boxed.
trait ClosureHandler<DB: Database, E>: Send + Sync {
    fn call<'t>(
        &self,
        tx: &'t mut Transaction<'static, DB>,
        delivered: Delivered<E>,
    ) -> HandlerFuture<'t>;
}

impl<DB: Database, E, F> ClosureHandler<DB, E> for F
where
    F: for<'t> Fn(&'t mut Transaction<'static, DB>, Delivered<E>) -> HandlerFuture<'t>
        + Send
        + Sync,
{
    fn call<'t>(
        &self,
        tx: &'t mut Transaction<'static, DB>,
        delivered: Delivered<E>,
    ) -> HandlerFuture<'t> {
        self(tx, delivered)
    }
}

impl<DB: Database, E> fmt::Debug for HandlerFn<DB, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HandlerFn")
    }
}

impl<DB: Database, E: Send + 'static> Handler<DB, E> for HandlerFn<DB, E> {
    fn handle(
        &self,
        tx: &mut Transaction<'static, DB>,
        delivered: Delivered<E>,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        self.0.call(tx, delivered)
    }
}
