//! [`Queries`]: the statements every database runs the same way, written once for any sqlx
//! database that binds and decodes what they need.

use std::future::Future;
use std::sync::Arc;

use sqlx::{Database, Decode, Encode, Executor, Pool, Transaction, Type};

use super::sealed::{Applied, RowsAffected};
use crate::sql::statement;

/// A boxed future: the [`Queries`] futures are generic over sqlx's higher-ranked bounds,
/// which rustc cannot always prove `Send` through when a caller's future holds one; boxing
/// states it once. They run once per statement, not per row.
pub(crate) type Boxed<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A value a statement of `DB` binds, held for `'a`.
pub trait Bind<'a, DB: Database>: for<'q> Encode<'q, DB> + Type<DB> + Send + 'a {}

impl<'a, DB: Database, T> Bind<'a, DB> for T where T: for<'q> Encode<'q, DB> + Type<DB> + Send + 'a {}

/// A column a statement of `DB` returns, read into a value of its own.
pub trait Column<DB: Database>: for<'r> Decode<'r, DB> + Type<DB> + Send + Unpin {}

impl<DB: Database, T> Column<DB> for T where T: for<'r> Decode<'r, DB> + Type<DB> + Send + Unpin {}

/// Declares [`Queries`] and implements it for every database with the bounds below: each
/// statement's signature and body are written once, for both.
macro_rules! queries {
    ($(
        $(#[$doc:meta])*
        fn $name:ident<$lt:lifetime $(, $generic:ident: $bound:path)*>(
            $($param:ident: $type:ty),* $(,)?
        ) -> $output:ty $body:block
    )*) => {
        /// Statements run the same way on every database. A supertrait of the driver traits,
        /// so that generic code over [`OutboxDatabase`](crate::OutboxDatabase) may call it
        /// without naming sqlx's bounds (rustc does not carry a trait's bounds on other types
        /// to its users, so the bounds stay on the one implementation).
        pub trait Queries: Database {
            $(
                $(#[$doc])*
                fn $name<$lt $(, $generic: $bound)*>($($param: $type),*) -> Boxed<$lt, $output>;
            )*
        }

        impl<DB> Queries for DB
        where
            DB: Database,
            DB::Arguments: sqlx::IntoArguments<DB>,
            for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
            for<'q> &'q str: Encode<'q, DB> + Type<DB>,
            for<'q> Option<&'q str>: Encode<'q, DB> + Type<DB>,
            for<'q> i32: Encode<'q, DB> + Type<DB>,
            for<'q> i64: Encode<'q, DB> + Type<DB>,
            for<'q> f64: Encode<'q, DB> + Type<DB>,
            for<'r> Option<f64>: Decode<'r, DB> + Type<DB>,
            for<'r> (i64, String, String): sqlx::FromRow<'r, DB::Row>,
            for<'r> (i64, String, String, String): sqlx::FromRow<'r, DB::Row>,
            for<'r> (String, i64, Option<f64>): sqlx::FromRow<'r, DB::Row>,
            for<'r> (i64, Option<f64>): sqlx::FromRow<'r, DB::Row>,
            for<'r> (i64,): sqlx::FromRow<'r, DB::Row>,
            for<'r> String: Decode<'r, DB> + Type<DB>,
            usize: sqlx::ColumnIndex<DB::Row>,
            DB::QueryResult: RowsAffected,
        {
            $(
                fn $name<$lt $(, $generic: $bound)*>($($param: $type),*) -> Boxed<$lt, $output> {
                    Box::pin(async move $body)
                }
            )*
        }
    };
}

queries! {
    /// Runs `sql` binding `ids`, `token` and then `value` if any (a fenced update of rows)
    /// and returns how many rows it changed.
    fn mark_rows<'a, I: Bind<'a, Self>, V: Bind<'a, Self>>(
        pool: &'a Pool<Self>,
        sql: &'a Arc<str>,
        ids: I,
        token: &'a str,
        value: Option<V>,
    ) -> sqlx::Result<u64> {
        let mut query = sqlx::query(statement(sql)).bind(ids).bind(token);
        if let Some(value) = value {
            query = query.bind(value);
        }
        Ok(query.execute(pool).await?.rows_affected())
    }

    /// Runs `sql`, which answers one nullable number.
    fn fetch_seconds<'a>(pool: &'a Pool<Self>, sql: &'a Arc<str>) -> sqlx::Result<Option<f64>> {
        sqlx::query_scalar::<_, Option<f64>>(statement(sql)).fetch_one(pool).await
    }

    /// Runs `sql`, which answers pairs of a text and a nullable text, read as `T`.
    fn fetch_texts<'a, T: Column<Self>>(
        pool: &'a Pool<Self>,
        sql: &'a Arc<str>,
    ) -> sqlx::Result<Vec<(T, Option<T>)>> {
        sqlx::query_as(statement(sql)).fetch_all(pool).await
    }

    /// Runs `sql`, which answers `(state, rows, age of the oldest in seconds)` per state.
    fn fetch_status<'a>(
        pool: &'a Pool<Self>,
        sql: &'a Arc<str>,
    ) -> sqlx::Result<Vec<(String, i64, Option<f64>)>> {
        sqlx::query_as(statement(sql)).fetch_all(pool).await
    }

    /// Runs `sql`, which answers one count.
    fn fetch_count<'a>(pool: &'a Pool<Self>, sql: &'a Arc<str>) -> sqlx::Result<i64> {
        let (count,): (i64,) = sqlx::query_as(statement(sql)).fetch_one(pool).await?;
        Ok(count)
    }

    /// Runs `sql`, which answers one row of a count and a nullable number of seconds.
    fn fetch_count_age<'a>(
        pool: &'a Pool<Self>,
        sql: &'a Arc<str>,
    ) -> sqlx::Result<(i64, Option<f64>)> {
        sqlx::query_as(statement(sql)).fetch_one(pool).await
    }

    /// Runs `sql` binding `first`, `second` (NULL for none) and a limit; the rows it returns.
    fn fetch_rows<'a>(
        pool: &'a Pool<Self>,
        sql: &'a Arc<str>,
        first: &'a str,
        second: Option<&'a str>,
        limit: i64,
    ) -> sqlx::Result<Vec<Self::Row>> {
        let query = sqlx::query(statement(sql)).bind(first).bind(second).bind(limit);
        query.fetch_all(pool).await
    }

    /// Runs `sql` binding a limit; rows of `(count, text, text)`.
    fn fetch_counted_pairs<'a>(
        pool: &'a Pool<Self>,
        sql: &'a Arc<str>,
        limit: i64,
    ) -> sqlx::Result<Vec<(i64, String, String)>> {
        sqlx::query_as(statement(sql)).bind(limit).fetch_all(pool).await
    }

    /// Runs `sql` binding a name (NULL for any) and a limit; the rows it changed.
    fn execute_named<'a>(
        pool: &'a Pool<Self>,
        sql: &'a Arc<str>,
        name: Option<&'a str>,
        limit: i64,
    ) -> sqlx::Result<u64> {
        let query = sqlx::query(statement(sql)).bind(name).bind(limit);
        Ok(query.execute(pool).await?.rows_affected())
    }

    /// Runs `sql` binding a name (NULL for any) and a limit; the count it answers.
    fn count_named<'a>(
        pool: &'a Pool<Self>,
        sql: &'a Arc<str>,
        name: Option<&'a str>,
        limit: i64,
    ) -> sqlx::Result<i64> {
        let query = sqlx::query_as(statement(sql)).bind(name).bind(limit);
        let (count,): (i64,) = query.fetch_one(pool).await?;
        Ok(count)
    }

    /// Runs `sql` binding an age in seconds and a limit; the rows it deleted.
    fn delete_older<'a>(
        pool: &'a Pool<Self>,
        sql: &'a Arc<str>,
        seconds: f64,
        limit: i64,
    ) -> sqlx::Result<u64> {
        let query = sqlx::query(statement(sql)).bind(seconds).bind(limit);
        Ok(query.execute(pool).await?.rows_affected())
    }

    /// Runs `sql` binding `first` and `second`; the rows it changed.
    fn execute_pair<'a, V: Bind<'a, Self>>(
        conn: &'a mut Self::Connection,
        sql: &'a Arc<str>,
        first: &'a str,
        second: V,
    ) -> sqlx::Result<u64> {
        let query = sqlx::query(statement(sql)).bind(first).bind(second);
        Ok(query.execute(&mut *conn).await?.rows_affected())
    }

    /// Runs `sql` binding `id`; the row it returns, if any.
    fn fetch_by_id<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a Arc<str>,
        id: &'a str,
    ) -> sqlx::Result<Option<Self::Row>> {
        sqlx::query(statement(sql)).bind(id).fetch_optional(&mut *conn).await
    }

    /// `(version, id, checksum, outbox table)` of the migrations `sql` reads for `outbox`.
    fn fetch_migrations<'a>(
        tx: &'a mut Transaction<'static, Self>,
        sql: &'static str,
        outbox: &'a str,
    ) -> sqlx::Result<Vec<(i64, String, String, String)>> {
        sqlx::query_as(sql).bind(outbox).fetch_all(&mut **tx).await
    }

    /// Runs `sql`, which records `migration` as applied to `outbox`.
    fn record_migration<'a>(
        tx: &'a mut Transaction<'static, Self>,
        sql: &'static str,
        outbox: &'a str,
        migration: Applied<'a>,
    ) -> sqlx::Result<()> {
        sqlx::query(sql)
            .bind(outbox)
            .bind(i32::try_from(migration.version).unwrap_or(i32::MAX))
            .bind(migration.id)
            .bind(migration.checksum)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// Runs one DDL statement.
    fn run_ddl<'a>(tx: &'a mut Transaction<'static, Self>, statement: &'a str) -> sqlx::Result<()> {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement)).execute(&mut **tx).await?;
        Ok(())
    }

    /// The single text column of every row `sql` returns for `outbox`.
    fn fetch_names<'a>(
        tx: &'a mut Transaction<'static, Self>,
        sql: &'static str,
        outbox: &'a str,
    ) -> sqlx::Result<Vec<String>> {
        sqlx::query_scalar::<_, String>(sql).bind(outbox).fetch_all(&mut **tx).await
    }
}
