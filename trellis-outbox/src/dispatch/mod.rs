//! Dispatching: claiming committed rows and delivering them exactly once.

#[cfg(feature = "postgres")]
mod postgres;
mod publisher;
mod repository;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(feature = "postgres")]
mod wakeup;

pub use publisher::{BoxError, PublishError, Publisher};
pub use repository::{Claim, Dispatched, OutboxRepository, PoisonRow};
#[cfg(feature = "postgres")]
pub use postgres::PgOutboxRepository;
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteOutboxRepository;
#[cfg(feature = "postgres")]
pub use wakeup::PgWakeups;
