//! The driver interface: what each database module (`postgres/`, `sqlite/`) implements, and
//! all that the front ends (`outbox.rs`, `migrate.rs`, `sql_repository.rs`) know of a database.
//!
//! As in sqlx, one module per driver sits behind shared traits: the front ends are generic over
//! [`OutboxDatabase`] and never name a driver; the drivers never call a front end. Each trait
//! is sealed: users name [`OutboxDatabase`] in bounds but cannot implement or call it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{Database, Decode, Encode, Executor, Pool, Transaction, Type};

use crate::dispatch::{Claim, Dispatched, Failure, PoisonRow, RetryOutcome};
use crate::error::{Error, Result};
use crate::record::{OutboxMessage, PreparedOutboxRecord};
use crate::row::existing_row;
use crate::sql::{SqlStatements, statement};
use crate::tables::{Dialect, OutboxTables};

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

pub(crate) mod sealed {
    use super::*;

    /// A boxed future: the [`Queries`] futures are generic over sqlx's higher-ranked bounds,
    /// which rustc cannot always prove `Send` through when a caller's future holds one; boxing
    /// states it once. They run once per statement, not per row.
    pub(crate) type Boxed<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

    // The types in these signatures are public in this private module: nameable by no user.

    /// Statements run the same way on every database: written once, for any sqlx database
    /// that binds text and integers and runs queries on its connections. A supertrait of the
    /// driver traits, so that generic code over [`OutboxDatabase`](super::OutboxDatabase)
    /// may call it without naming sqlx's bounds.
    pub trait Queries: Database {
        /// Runs `sql` binding `ids`, `token` and then `value` if any (a fenced update of
        /// rows) and returns how many rows it changed.
        fn mark_rows<'a, I, V>(
            pool: &'a Pool<Self>,
            sql: &'a Arc<str>,
            ids: I,
            token: &'a str,
            value: Option<V>,
        ) -> Boxed<'a, sqlx::Result<u64>>
        where
            I: for<'q> Encode<'q, Self> + Type<Self> + Send + 'a,
            V: for<'q> Encode<'q, Self> + Type<Self> + Send + 'a;

        /// Runs `sql`, which answers one nullable number.
        fn fetch_seconds<'a>(
            pool: &'a Pool<Self>,
            sql: &'a Arc<str>,
        ) -> Boxed<'a, sqlx::Result<Option<f64>>>;

        /// Runs `sql` binding an age in seconds and a limit; the rows it deleted.
        fn delete_older<'a>(
            pool: &'a Pool<Self>,
            sql: &'a Arc<str>,
            seconds: f64,
            limit: i64,
        ) -> Boxed<'a, sqlx::Result<u64>>;

        /// Runs `sql` binding `first` and `second`; the rows it changed.
        fn execute_pair<'a, V>(
            conn: &'a mut Self::Connection,
            sql: &'a Arc<str>,
            first: &'a str,
            second: V,
        ) -> Boxed<'a, sqlx::Result<u64>>
        where
            V: for<'q> Encode<'q, Self> + Type<Self> + Send + 'a;

        /// Runs `sql` binding `id`; the row it returns, if any.
        fn fetch_by_id<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a Arc<str>,
            id: &'a str,
        ) -> Boxed<'a, sqlx::Result<Option<Self::Row>>>;

        /// `(version, id, checksum)` of the migrations `sql` reads for `outbox`.
        fn fetch_migrations<'a>(
            tx: &'a mut Transaction<'static, Self>,
            sql: &'static str,
            outbox: &'a str,
        ) -> Boxed<'a, sqlx::Result<Vec<(i64, String, String)>>>;

        /// Runs one DDL statement.
        fn run_ddl<'a>(
            tx: &'a mut Transaction<'static, Self>,
            statement: &'a str,
        ) -> Boxed<'a, sqlx::Result<()>>;

        /// The single text column of every row `sql` returns for `outbox`.
        fn fetch_names<'a>(
            tx: &'a mut Transaction<'static, Self>,
            sql: &'static str,
            outbox: &'a str,
        ) -> Boxed<'a, sqlx::Result<Vec<String>>>;
    }

    impl<DB> Queries for DB
    where
        DB: Database,
        DB::Arguments: sqlx::IntoArguments<DB>,
        for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
        for<'q> &'q str: Encode<'q, DB> + Type<DB>,
        for<'q> i32: Encode<'q, DB> + Type<DB>,
        for<'q> i64: Encode<'q, DB> + Type<DB>,
        for<'q> f64: Encode<'q, DB> + Type<DB>,
        for<'r> Option<f64>: Decode<'r, DB> + Type<DB>,
        for<'r> (i64, String, String): sqlx::FromRow<'r, DB::Row>,
        for<'r> String: Decode<'r, DB> + Type<DB>,
        usize: sqlx::ColumnIndex<DB::Row>,
        DB::QueryResult: RowsAffected,
    {
        fn mark_rows<'a, I, V>(
            pool: &'a Pool<Self>,
            sql: &'a Arc<str>,
            ids: I,
            token: &'a str,
            value: Option<V>,
        ) -> Boxed<'a, sqlx::Result<u64>>
        where
            I: for<'q> Encode<'q, Self> + Type<Self> + Send + 'a,
            V: for<'q> Encode<'q, Self> + Type<Self> + Send + 'a,
        {
            Box::pin(async move {
                let mut query = sqlx::query(statement(sql)).bind(ids).bind(token);
                if let Some(value) = value {
                    query = query.bind(value);
                }
                Ok(query.execute(pool).await?.rows_affected())
            })
        }

        fn fetch_seconds<'a>(
            pool: &'a Pool<Self>,
            sql: &'a Arc<str>,
        ) -> Boxed<'a, sqlx::Result<Option<f64>>> {
            Box::pin(async move { sqlx::query_scalar(statement(sql)).fetch_one(pool).await })
        }

        fn delete_older<'a>(
            pool: &'a Pool<Self>,
            sql: &'a Arc<str>,
            seconds: f64,
            limit: i64,
        ) -> Boxed<'a, sqlx::Result<u64>> {
            Box::pin(async move {
                let query = sqlx::query(statement(sql)).bind(seconds).bind(limit);
                Ok(query.execute(pool).await?.rows_affected())
            })
        }

        fn execute_pair<'a, V>(
            conn: &'a mut Self::Connection,
            sql: &'a Arc<str>,
            first: &'a str,
            second: V,
        ) -> Boxed<'a, sqlx::Result<u64>>
        where
            V: for<'q> Encode<'q, Self> + Type<Self> + Send + 'a,
        {
            Box::pin(async move {
                let query = sqlx::query(statement(sql)).bind(first).bind(second);
                Ok(query.execute(&mut *conn).await?.rows_affected())
            })
        }

        fn fetch_by_id<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a Arc<str>,
            id: &'a str,
        ) -> Boxed<'a, sqlx::Result<Option<Self::Row>>> {
            Box::pin(async move {
                sqlx::query(statement(sql))
                    .bind(id)
                    .fetch_optional(&mut *conn)
                    .await
            })
        }

        fn fetch_migrations<'a>(
            tx: &'a mut Transaction<'static, Self>,
            sql: &'static str,
            outbox: &'a str,
        ) -> Boxed<'a, sqlx::Result<Vec<(i64, String, String)>>> {
            Box::pin(async move { sqlx::query_as(sql).bind(outbox).fetch_all(&mut **tx).await })
        }

        fn run_ddl<'a>(
            tx: &'a mut Transaction<'static, Self>,
            statement: &'a str,
        ) -> Boxed<'a, sqlx::Result<()>> {
            Box::pin(async move {
                sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            })
        }

        fn fetch_names<'a>(
            tx: &'a mut Transaction<'static, Self>,
            sql: &'static str,
            outbox: &'a str,
        ) -> Boxed<'a, sqlx::Result<Vec<String>>> {
            Box::pin(async move {
                sqlx::query_scalar(sql)
                    .bind(outbox)
                    .fetch_all(&mut **tx)
                    .await
            })
        }
    }

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

    /// Enqueue and inbox: what [`Outbox`](crate::Outbox) asks of a database.
    pub trait Backend: Queries {
        const DIALECT: Dialect;

        /// A time as this database stores it.
        type Time: for<'q> Encode<'q, Self> + Type<Self> + Send;

        fn time(time: DateTime<Utc>) -> Self::Time;

        /// Decodes a row that selected [`COLUMNS`](crate::sql::COLUMNS) first, in order.
        fn decode(row: &Self::Row) -> Result<OutboxMessage>;

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
                    .map_err(|source| Error::Enqueue {
                        id: record.id.clone(),
                        source,
                    })?;
                let stored = row.as_ref().map(Self::decode).transpose()?;
                existing_row(record, stored.as_ref())
            }
        }

        fn insert_one<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a SqlStatements,
            record: PreparedOutboxRecord,
        ) -> impl Future<Output = Result<OutboxMessage>> + Send + 'a;

        fn insert_many<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a SqlStatements,
            records: Vec<PreparedOutboxRecord>,
        ) -> impl Future<Output = Result<Vec<OutboxMessage>>> + Send + 'a;
    }

    /// Schema migrations: what [`migrate`](crate::migrate()) asks of a database.
    pub trait MigrationBackend: Backend {
        /// Creates the bookkeeping table.
        const BOOKKEEPING: &'static str;
        /// `(version, id, checksum)` of the migrations recorded for an outbox table.
        const RECORDED: &'static str;
        /// The column names of an outbox table (none if it does not exist).
        const COLUMNS: &'static str;

        /// Begins the migration transaction, serialised against concurrent migrators.
        fn begin_migration(
            pool: &Pool<Self>,
        ) -> impl Future<Output = sqlx::Result<Transaction<'static, Self>>> + Send;

        /// Records a migration as applied to `outbox`.
        fn record_migration<'a>(
            tx: &'a mut Transaction<'static, Self>,
            outbox: &'a str,
            migration: Applied<'a>,
        ) -> impl Future<Output = sqlx::Result<()>> + Send + 'a;
    }

    /// Dispatch: what [`SqlOutboxRepository`](crate::SqlOutboxRepository) asks of a database.
    pub trait RepositoryBackend: Backend {
        /// The statements only this database sends, next to its [`SqlStatements`].
        type Only: std::fmt::Debug + Send + Sync + 'static;
        /// A duration as this database adds it to its clock.
        type Interval: for<'q> Encode<'q, Self> + Type<Self> + Send + 'static;
        /// A list of ids as this database binds it.
        type Ids<'a>: for<'q> Encode<'q, Self> + Type<Self> + Send + 'a;

        /// Whether the dispatcher may overlap batches
        /// ([`OutboxRepository::overlaps_batches`](crate::OutboxRepository::overlaps_batches)).
        const OVERLAPS_BATCHES: bool;

        fn only(tables: &OutboxTables) -> Self::Only;

        fn interval(duration: Duration) -> Self::Interval;

        fn ids<'a>(ids: &'a [&'a str]) -> Result<Self::Ids<'a>>;

        fn claim_due<'a>(
            on: On<'a, Self>,
            limit: usize,
            lease: Duration,
            cutoff: Option<DateTime<Utc>>,
        ) -> impl Future<Output = Result<Claim>> + Send + 'a;

        fn mark_dispatched<'a>(
            on: On<'a, Self>,
            token: &'a str,
            rows: &'a [Dispatched],
        ) -> impl Future<Output = Result<u64>> + Send + 'a;

        fn mark_failures<'a>(
            on: On<'a, Self>,
            token: &'a str,
            failures: &'a [Failure],
        ) -> impl Future<Output = Result<Vec<String>>> + Send + 'a;

        fn retry<'a>(
            on: On<'a, Self>,
            id: &'a str,
        ) -> impl Future<Output = Result<RetryOutcome>> + Send + 'a;

        fn sweep_unfinishable<'a>(
            on: On<'a, Self>,
        ) -> impl Future<Output = Result<Vec<PoisonRow>>> + Send + 'a;
    }
}

/// Seconds to add to the database's clock for `duration`, capped at [`MAX_SQL_DURATION`]: a
/// longer lease or retry delay (say `Duration::MAX`) would overflow an SQL interval (Postgres
/// fails the statement) or a date (SQLite answers NULL past the year 9999, which would make
/// the row claimable at once).
///
/// [`MAX_SQL_DURATION`]: crate::dispatch::MAX_SQL_DURATION
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn sql_seconds(duration: Duration) -> f64 {
    duration
        .min(crate::dispatch::MAX_SQL_DURATION)
        .as_secs_f64()
}
