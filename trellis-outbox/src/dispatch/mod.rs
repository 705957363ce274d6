//! Dispatching: claiming committed rows and delivering them exactly once.

mod publisher;
mod repository;

pub use publisher::{BoxError, PublishError, Publisher};
pub use repository::{Claim, Dispatched, OutboxRepository, PoisonRow};
