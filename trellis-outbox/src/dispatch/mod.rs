//! Dispatching: claiming committed rows and delivering them exactly once.

mod dispatcher;
mod engine;
mod error;
mod memory;
mod options;
#[cfg(feature = "postgres")]
mod postgres;
mod publisher;
mod repository;
mod retry;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(feature = "postgres")]
mod wakeup;
mod worker;

pub use dispatcher::{DispatcherBuilder, DispatcherHandle, OutboxDispatcher};
pub use engine::dispatch_outbox;
pub use error::{DispatchError, Disposition, ErrorCallback};
pub use memory::MemoryOutboxRepository;
pub use options::{DispatchOptions, DispatchReport};
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
