//! Dispatching: claiming committed rows and delivering them exactly once.

mod dispatcher;
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
mod publisher;
mod repository;
mod retry;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(feature = "postgres")]
mod wakeup;

pub use dispatcher::{
    DispatchError, DispatchOptions, DispatchReport, DispatcherBuilder, DispatcherHandle,
    Disposition, ErrorCallback, OutboxDispatcher, dispatch_outbox,
};
pub use memory::MemoryOutboxRepository;
#[cfg(feature = "postgres")]
pub use postgres::PgOutboxRepository;
pub use publisher::{BoxError, PublishError, Publisher};
pub(crate) use repository::KNOWN_STATES;
pub use repository::{
    Claim, Dispatched, Failure, FailureOutcome, OutboxRepository, PoisonRow, RetryOutcome,
};
pub use retry::{MAX_RETRY_DELAY, MIN_RETRY_DELAY, RetryPolicy};
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteOutboxRepository;
#[cfg(feature = "postgres")]
pub use wakeup::PgWakeups;
