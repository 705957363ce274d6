//! Dispatching: claiming committed rows and delivering them exactly once.
//!
//! - `repository.rs`, `publisher.rs`: the two traits a dispatcher runs over (storage and
//!   delivery); `claim.rs`: what a claim holds; `memory.rs` is the in-memory repository.
//! - `options.rs`: what one drain may do, and what it did; `retry.rs`: the retry policy.
//! - `engine.rs`: one drain — claim, then `engine/publish.rs` under the lease, then
//!   `engine/mark.rs` — used by [`dispatch_outbox`] and by every drain of the task.
//! - `worker.rs`: when the task drains; `dispatcher.rs`: building, waking and stopping it.
//! - `handoff.rs`: rows written leased and handed to the task at commit
//!   ([`HandoffTransaction`]); `engine/handoff.rs` publishes them.
//! - `error.rs`: what goes wrong and how it is reported.

mod claim;
mod dispatcher;
mod engine;
mod error;
mod handoff;
mod memory;
mod options;
mod publisher;
mod repository;
mod retry;
mod worker;

pub(crate) use claim::run_limit;
pub use dispatcher::{
    DEFAULT_BACKLOG_EVERY, DEFAULT_MAX_HANDOFF_BACKLOG, DispatcherBuilder, DispatcherHandle,
    OutboxDispatcher,
};
pub use engine::dispatch_outbox;
#[cfg(feature = "nats")]
pub(crate) use error::panic_message;
pub use error::{DispatchError, Disposition, ErrorCallback};
pub use handoff::{HandoffTarget, HandoffTransaction};
pub use memory::MemoryOutboxRepository;
pub use options::{DispatchOptions, DispatchReport};
pub use publisher::{BoxError, PublishError, Publisher};
pub(crate) use repository::MAX_SQL_DURATION;
pub use repository::{
    Backlog, Claim, ClaimRequest, Dispatched, Failure, FailureOutcome, OutboxRepository, PoisonRow,
    RetryOutcome,
};
pub(crate) use repository::{KNOWN_STATES, due_in};
pub use retry::{MAX_RETRY_DELAY, MIN_RETRY_DELAY, RetryPolicy};
