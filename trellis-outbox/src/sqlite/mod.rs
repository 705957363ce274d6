//! SQLite: its statements and schema (always compiled: [`SqlStatements`] and
//! [`migrations`](crate::migrations) show them whatever the features), and with the `sqlite`
//! feature its driver: enqueue and inbox, migrations and the repository's steps.
//!
//! [`SqlStatements`]: crate::SqlStatements

#[cfg(feature = "sqlite")]
mod database;
#[cfg(feature = "sqlite")]
mod repository;
pub(crate) mod schema;
pub(crate) mod sql;

/// The outbox repository on SQLite: claims with one `UPDATE … RETURNING` (SQLite has a single
/// writer and no `SKIP LOCKED`; the statement takes the write lock when it starts, like
/// `BEGIN IMMEDIATE`), under a lease and a fencing token, using SQLite's clock.
///
/// Needs migration version 2 ([`migrate`](crate::migrate())).
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use trellis_outbox::{OutboxRepository, SqliteOutboxRepository};
///
/// # async fn run(pool: sqlx::SqlitePool) -> Result<(), trellis_outbox::Error> {
/// let repository = SqliteOutboxRepository::new(pool);
/// let claim = repository.claim_due(100, Duration::from_secs(30), None).await?;
/// println!("claimed {} rows", claim.len());
/// # Ok(()) }
/// ```
#[cfg(feature = "sqlite")]
pub type SqliteOutboxRepository = crate::SqlOutboxRepository<sqlx::Sqlite>;
