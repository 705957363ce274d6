//! The driver interface: what each database module (`postgres/`, `sqlite/`) implements, and
//! all that the front ends (`outbox.rs`, `migrate.rs`, `sql_repository.rs`) know of a database.
//!
//! As in sqlx, one module per driver sits behind shared traits: the front ends are generic over
//! [`OutboxDatabase`] and never name a driver; the drivers never call a front end. Each trait
//! is sealed: users name [`OutboxDatabase`] in bounds but cannot implement or call it.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{Database, Encode, Pool, Transaction, Type};

#[cfg(any(feature = "postgres", feature = "sqlite"))]
use crate::admin::OutboxRow;
use crate::dispatch::{Claim, ClaimRequest, Dispatched, Failure, RetryOutcome};
use crate::error::{Error, Result};
use crate::record::{OutboxMessage, PreparedOutboxRecord, new_id};
use crate::row::{batch_result, existing_row};
use crate::sql::SqlStatements;
use crate::tables::{Dialect, OutboxTables};
use crate::time::now_millis;

/// A database trellis-outbox can store outboxes in: [`sqlx::Postgres`] and [`sqlx::Sqlite`].
///
/// This trait is sealed.
pub trait OutboxDatabase:
    sealed::Backend + sealed::MigrationBackend + sealed::RepositoryBackend
{
}

#[cfg(feature = "postgres")]
impl OutboxDatabase for sqlx::Postgres {}
#[cfg(feature = "sqlite")]
impl OutboxDatabase for sqlx::Sqlite {}

mod queries;

pub(crate) mod sealed {
    use super::*;

    pub(crate) use super::queries::{Column, Queries};

    // The types in these signatures are public in this private module: nameable by no user.

    /// What a repository hook runs on: the pool and the statements.
    #[derive(Debug)]
    pub struct On<'a, DB: RepositoryBackend> {
        pub pool: &'a Pool<DB>,
        pub sql: &'a SqlStatements,
        pub only: &'a DB::Only,
        /// Whether claims also write upstream Trellis' lease (see
        /// [`SqlOutboxRepository::beside_upstream`](crate::SqlOutboxRepository::beside_upstream)).
        pub beside_upstream: bool,
    }

    impl<DB: RepositoryBackend> Clone for On<'_, DB> {
        fn clone(&self) -> Self {
            *self
        }
    }

    impl<DB: RepositoryBackend> Copy for On<'_, DB> {}

    /// What a fenced statement runs on: the pool, the statements, and the claim token that
    /// every row it changes must still hold.
    #[derive(Debug)]
    pub struct Fenced<'a, DB: Database> {
        pub pool: &'a Pool<DB>,
        pub sql: &'a SqlStatements,
        pub token: &'a str,
    }

    /// A claim to make: a new fencing token, at most `limit` rows, leased for `lease`, due by
    /// `cutoff` (or the database's now).
    #[derive(Debug)]
    pub struct ClaimDue {
        pub token: String,
        pub limit: i64,
        pub lease: Duration,
        pub cutoff: Option<DateTime<Utc>>,
        /// Keyed rows published and being marked by the claimer ([`ClaimRequest::published`]).
        pub published: Arc<[String]>,
    }

    impl ClaimDue {
        pub(crate) fn new(request: ClaimRequest) -> Self {
            Self {
                token: new_id(),
                limit: i64::try_from(request.limit).unwrap_or(i64::MAX),
                lease: request.lease,
                cutoff: request.cutoff,
                published: request.published,
            }
        }

        /// The claim when no row was due.
        pub(crate) fn nothing_due(self) -> Claim {
            Claim::empty(self.token, self.cutoff.unwrap_or_else(Utc::now))
        }
    }

    /// `(claim_token, claimed_until, ordering_key)` of a stored row.
    pub(crate) type RowExtras = (Option<String>, Option<DateTime<Utc>>, Option<String>);

    /// A migration being recorded.
    #[derive(Debug, Clone, Copy)]
    pub struct Applied<'a> {
        pub version: u32,
        pub id: &'a str,
        pub checksum: &'a str,
    }

    /// A query result's affected-row count (an inherent method of each driver's result).
    pub trait RowsAffected {
        fn rows_affected(&self) -> u64;
    }

    /// What an enqueue step runs on: the caller's connection, the statements, and the time
    /// the records are enqueued at.
    #[derive(Debug)]
    pub struct Enqueue<'a, DB: Database> {
        pub conn: &'a mut DB::Connection,
        pub sql: &'a SqlStatements,
        pub now: DateTime<Utc>,
    }

    impl<'a, DB: Database> Enqueue<'a, DB> {
        /// An enqueue at the current time (millisecond precision, as stored).
        fn new(conn: &'a mut DB::Connection, sql: &'a SqlStatements) -> Self {
            let now = now_millis();
            Self { conn, sql, now }
        }
    }

    /// The lease a [handed-over](crate::HandoffTransaction) row is written with: the
    /// dispatcher's token for handoffs, how long, and whether to write upstream Trellis'
    /// lease (`next_attempt_at`) too.
    #[derive(Debug, Clone, Copy)]
    pub struct Lease<'a> {
        pub token: &'a str,
        pub lease: Duration,
        pub beside_upstream: bool,
    }

    /// Enqueue and inbox: what [`Outbox`](crate::Outbox) asks of a database.
    ///
    /// Each driver writes the statements of an enqueue ([`insert_row`](Self::insert_row),
    /// [`insert_rows`](Self::insert_rows), [`read_stored`](Self::read_stored)); what an
    /// enqueue returns is decided here, once.
    pub trait Backend: Queries {
        const DIALECT: Dialect;

        /// A time as this database stores it.
        type Time: for<'q> Encode<'q, Self> + Type<Self> + Send;

        fn time(time: DateTime<Utc>) -> Self::Time;

        /// Decodes a row that selected [`COLUMNS`](crate::sql::COLUMNS) first, in order.
        fn decode(row: &Self::Row) -> Result<OutboxMessage>;

        /// Reads the lease and ordering key of a row that selected
        /// [`ROW_EXTRAS`](crate::sql::ROW_EXTRAS) right after [`COLUMNS`](crate::sql::COLUMNS):
        /// `(claim_token, claimed_until, ordering_key)`. `id` names the row in errors.
        fn decode_extras(row: &Self::Row, id: &str) -> Result<RowExtras>;

        /// Decodes a row that selected [`COLUMNS`](crate::sql::COLUMNS) and then
        /// [`ROW_EXTRAS`](crate::sql::ROW_EXTRAS).
        #[cfg(any(feature = "postgres", feature = "sqlite"))]
        fn decode_row(row: &Self::Row) -> Result<OutboxRow> {
            let message = Self::decode(row)?;
            let (claim_token, claimed_until, ordering_key) = Self::decode_extras(row, &message.id)?;
            Ok(OutboxRow::new(
                message,
                claim_token,
                claimed_until,
                ordering_key,
            ))
        }

        /// Runs the single-row `enqueue` of `record`, a `pending` row at `on.now`: whether it
        /// inserted the row (false: a row with its id exists).
        fn insert_row<'a>(
            on: &'a mut Enqueue<'_, Self>,
            record: &'a PreparedOutboxRecord,
        ) -> impl Future<Output = Result<bool>> + Send + 'a;

        /// Runs the leased enqueue of `record` (which has no ordering key): a `pending` row at
        /// `on.now` held by `lease` from the database's clock at the insert. Whether it
        /// inserted the row.
        fn insert_leased_row<'a>(
            on: &'a mut Enqueue<'_, Self>,
            record: &'a PreparedOutboxRecord,
            lease: Lease<'a>,
        ) -> impl Future<Output = Result<bool>> + Send + 'a;

        /// Leases the rows of `ids` that are `pending`, unkeyed, not leased and due to `lease`
        /// (from the database's clock at the update); their ids.
        fn lease_rows<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a SqlStatements,
            ids: &'a [&'a str],
            lease: Lease<'a>,
        ) -> impl Future<Output = Result<Vec<String>>> + Send + 'a;

        /// Fails if the transaction on `conn` can no longer commit. On Postgres a failed
        /// statement aborts the whole transaction, and `COMMIT` then answers `ROLLBACK`
        /// without an error (sqlx reports success): a `SELECT 1`, which an aborted
        /// transaction refuses, tells first (one round trip). On SQLite a failed statement
        /// undoes only itself, and `COMMIT` after a rollback fails: nothing to ask.
        fn check_committable<'a>(
            conn: &'a mut Self::Connection,
        ) -> impl Future<Output = sqlx::Result<()>> + Send + 'a;

        /// Inserts `records` in as few statements as the database's limits allow; how many
        /// rows were inserted.
        fn insert_rows<'a>(
            on: &'a mut Enqueue<'_, Self>,
            records: &'a [PreparedOutboxRecord],
        ) -> impl Future<Output = Result<u64>> + Send + 'a;

        /// The stored rows of `ids`, by id.
        fn read_stored<'a>(
            on: &'a mut Enqueue<'_, Self>,
            ids: Vec<String>,
        ) -> impl Future<Output = Result<BTreeMap<String, OutboxMessage>>> + Send + 'a;

        /// What an enqueue of `record` returns when its insert wrote nothing: the stored row
        /// with its id, if its content is the record's ([`existing_row`]).
        fn stored<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a SqlStatements,
            record: &'a PreparedOutboxRecord,
        ) -> impl Future<Output = Result<OutboxMessage>> + Send + 'a {
            async move {
                let row = Self::fetch_by_id(conn, &sql.text.select_by_id, &record.id)
                    .await
                    .map_err(Error::enqueue(&record.id))?;
                let stored = row.as_ref().map(Self::decode).transpose()?;
                existing_row(record, stored.as_ref())
            }
        }

        /// Writes `record`; the row as stored: the record itself, or the row with its id if
        /// its content is the record's ([`stored`](Self::stored)).
        fn insert_one<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a SqlStatements,
            record: PreparedOutboxRecord,
        ) -> impl Future<Output = Result<OutboxMessage>> + Send + 'a {
            async move {
                let mut on = Enqueue::new(conn, sql);
                if Self::insert_row(&mut on, &record).await? {
                    return Ok(OutboxMessage::pending(record, on.now));
                }
                Self::stored(on.conn, sql, &record).await
            }
        }

        /// Writes `record` (no ordering key) leased to `lease`; the row as stored, and whether
        /// this call wrote it (and so holds its lease): otherwise the row with its id, if
        /// its content is the record's ([`stored`](Self::stored)).
        fn insert_leased<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a SqlStatements,
            record: PreparedOutboxRecord,
            lease: Lease<'a>,
        ) -> impl Future<Output = Result<(OutboxMessage, bool)>> + Send + 'a {
            async move {
                let mut on = Enqueue::new(conn, sql);
                if Self::insert_leased_row(&mut on, &record, lease).await? {
                    return Ok((OutboxMessage::pending(record, on.now), true));
                }
                Ok((Self::stored(on.conn, sql, &record).await?, false))
            }
        }

        /// Writes `records`; the rows as stored, in input order ([`batch_result`]).
        fn insert_many<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a SqlStatements,
            records: Vec<PreparedOutboxRecord>,
        ) -> impl Future<Output = Result<Vec<OutboxMessage>>> + Send + 'a {
            async move {
                let mut on = Enqueue::new(conn, sql);
                let inserted = Self::insert_rows(&mut on, &records).await?;
                let now = on.now;
                batch_result(records, inserted, now, |ids| {
                    Self::read_stored(&mut on, ids)
                })
                .await
            }
        }
    }

    /// Schema migrations: what [`migrate`](crate::migrate()) asks of a database.
    pub trait MigrationBackend: Backend {
        /// Creates the bookkeeping table.
        const BOOKKEEPING: &'static str;
        /// `(version, id, checksum)` of the migrations recorded for an outbox table.
        const RECORDED: &'static str;
        /// The column names of an outbox table (none if it does not exist).
        const COLUMNS: &'static str;
        /// Records a migration as applied to an outbox table: binds the table, the version,
        /// the migration's id and its checksum.
        const RECORD: &'static str;

        /// The name of [`begin_migration`](Self::begin_migration)'s step in errors.
        const BEGIN_STEP: &'static str;

        /// Begins the migration transaction (on SQLite, `BEGIN IMMEDIATE`, which also
        /// serialises concurrent migrators).
        fn begin_migration(
            pool: &Pool<Self>,
        ) -> impl Future<Output = sqlx::Result<Transaction<'static, Self>>> + Send;

        /// Serialises the transaction `tx` against concurrent migrators (waiting as long as
        /// they take), then bounds how long each later statement may wait for a lock to
        /// `lock_timeout` (zero: no bound). The name of the step that failed, and its error.
        fn lock_migration<'a>(
            tx: &'a mut Transaction<'static, Self>,
            lock_timeout: Duration,
        ) -> impl Future<Output = std::result::Result<(), (&'static str, sqlx::Error)>> + Send + 'a;
    }

    /// Dispatch: what [`SqlOutboxRepository`](crate::SqlOutboxRepository) asks of a database:
    /// the statements it sends its own way. Marking rows dispatched, lease updates, the sweep
    /// and retention run alike ([`Queries`]) over what these types bind and read.
    pub trait RepositoryBackend: Backend {
        /// The statements only this database sends, next to its [`SqlStatements`].
        type Only: std::fmt::Debug + Send + Sync + 'static;
        /// A duration as this database adds it to its clock.
        type Interval: for<'q> Encode<'q, Self> + Type<Self> + Send + 'static;
        /// A list of ids as this database binds it.
        type Ids<'a>: for<'q> Encode<'q, Self> + Type<Self> + Send + 'a;
        /// The outcomes `mark_dispatched_with_outcomes` binds after the token, if any.
        type Outcomes: for<'q> Encode<'q, Self> + Type<Self> + Send + 'static;
        /// Text as this database returns it from rows other writers may have written.
        type Text: Column<Self>;

        /// Whether the dispatcher may overlap batches
        /// ([`OutboxRepository::overlaps_batches`](crate::OutboxRepository::overlaps_batches)).
        const OVERLAPS_BATCHES: bool;

        fn only(tables: &OutboxTables) -> Self::Only;

        fn interval(duration: Duration) -> Self::Interval;

        fn ids<'a>(ids: &'a [&'a str]) -> Result<Self::Ids<'a>>;

        /// What `mark_dispatched_with_outcomes` binds for `rows` (whose ids are `ids`): the
        /// list before the token and the outcomes after it, if they are not in the list.
        fn outcomes<'a>(
            ids: &'a [&'a str],
            rows: &'a [Dispatched],
        ) -> Result<(Self::Ids<'a>, Option<Self::Outcomes>)>;

        fn text(text: Self::Text) -> String;

        fn claim_due<'a>(
            on: On<'a, Self>,
            due: ClaimDue,
        ) -> impl Future<Output = Result<Claim>> + Send + 'a;

        fn mark_failures<'a>(
            on: Fenced<'a, Self>,
            failures: &'a [Failure],
        ) -> impl Future<Output = Result<Vec<String>>> + Send + 'a;

        fn retry<'a>(
            on: On<'a, Self>,
            id: &'a str,
        ) -> impl Future<Output = Result<RetryOutcome>> + Send + 'a;

        /// Tells running dispatchers that rows are due now (after an operator's retry), as an
        /// enqueue does: on Postgres a `NOTIFY` on the outbox's channel; nothing on SQLite,
        /// which has no notifications between processes.
        fn wake<'a>(on: On<'a, Self>) -> impl Future<Output = sqlx::Result<()>> + Send + 'a;
    }
}

/// Seconds to add to the database's clock for `duration`, capped at [`MAX_SQL_DURATION`]: a
/// longer lease or retry delay (say `Duration::MAX`) would overflow an SQL interval (Postgres
/// fails the statement) or a date (SQLite answers NULL past the year 9999, which would make
/// the row claimable at once).
///
/// [`MAX_SQL_DURATION`]: crate::dispatch::MAX_SQL_DURATION
pub(crate) fn sql_seconds(duration: Duration) -> f64 {
    duration
        .min(crate::dispatch::MAX_SQL_DURATION)
        .as_secs_f64()
}
