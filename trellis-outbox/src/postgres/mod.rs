//! PostgreSQL: its statements and schema (always compiled: [`SqlStatements`] and
//! [`migrations`](crate::migrations) show them whatever the features), and with the `postgres`
//! feature its driver: enqueue and inbox, migrations, the repository's steps and wake-ups.
//!
//! [`SqlStatements`]: crate::SqlStatements

#[cfg(feature = "postgres")]
mod database;
#[cfg(feature = "postgres")]
mod repository;
pub(crate) mod schema;
pub(crate) mod sql;
#[cfg(feature = "postgres")]
mod time;
#[cfg(feature = "postgres")]
pub(crate) mod wakeup;

#[cfg(feature = "postgres")]
pub use wakeup::PgWakeups;

/// The outbox repository on PostgreSQL: claims with `FOR UPDATE SKIP LOCKED` in a single
/// statement, under a lease and a fencing token, using the server's clock.
///
/// The claim is `UPDATE … WHERE id = ANY(ARRAY(SELECT id … ORDER BY created_at, id LIMIT n
/// FOR UPDATE SKIP LOCKED)) RETURNING …`: the `ARRAY(…)` form makes the planner update the
/// claimed rows through the primary key, where `id IN (SELECT …)` may become a hash join over
/// a full scan of the table.
///
/// The claim commits with `synchronous_commit = off` (set for that statement's transaction
/// only): a lease is bookkeeping, and losing one in a server crash only makes its rows
/// claimable again, so the claim need not wait for the WAL flush. Marks stay synchronous:
/// a row marked `dispatched` stays marked. The dispatcher [overlaps
/// batches](crate::OutboxRepository::overlaps_batches) on Postgres: while one batch is
/// published, the next is claimed and the previous one marked.
///
/// Needs migration version 2 ([`migrate`](crate::migrate())).
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use trellis_outbox::{OutboxRepository, PgOutboxRepository};
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), trellis_outbox::Error> {
/// let repository = PgOutboxRepository::new(pool);
/// let claim = repository.claim_due(100, Duration::from_secs(30), None).await?;
/// for message in &claim.messages {
///     println!("{} -> {}", message.id, message.subject);
/// }
/// # Ok(()) }
/// ```
#[cfg(feature = "postgres")]
pub type PgOutboxRepository = crate::SqlOutboxRepository<sqlx::Postgres>;
