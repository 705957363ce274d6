//! Dispatching: claiming committed rows and delivering them exactly once.

mod dispatcher;
mod memory;
mod publisher;
mod repository;
mod retry;

pub use dispatcher::{
    DispatchError, DispatchOptions, DispatchReport, DispatcherBuilder, DispatcherHandle,
    Disposition, ErrorCallback, OutboxDispatcher, dispatch_outbox,
};
pub use memory::MemoryOutboxRepository;
pub use publisher::{BoxError, PublishError, Publisher};
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) use repository::MAX_SQL_DURATION;
pub use repository::{
    Claim, Dispatched, Failure, FailureOutcome, OutboxRepository, PoisonRow, RetryOutcome,
};
pub(crate) use repository::{KNOWN_STATES, due_in};
pub use retry::{MAX_RETRY_DELAY, MIN_RETRY_DELAY, RetryPolicy};
