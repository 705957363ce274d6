//! The SQLite driver: enqueue, the row decoder's SQLite types (and the packed claim rows),
//! and migrations.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::sqlite::{SqliteQueryResult, SqliteRow};
use sqlx::{AssertSqlSafe, Row, Sqlite, SqliteConnection, SqlitePool, Transaction};

use super::sql;
use crate::driver::sealed::{
    Backend, Enqueue, Lease, MigrationBackend, RepositoryBackend, RowExtras, RowsAffected,
};
use crate::error::{Error, Result};
use crate::record::{OutboxMessage, PreparedOutboxRecord};
use crate::row::{RawRow, Stored, bind_content, bind_ordering, first_id, get, headers_json, read};
use crate::sql::{SqlStatements, statement};
use crate::tables::Dialect;
use crate::time::format_timestamp;

/// Bind parameters per batch-insert row.
const PARAMS_PER_ROW: usize = 8;
/// Rows per multi-row insert: 8 × 1,000 parameters stays far below SQLite's default limit
/// of 32,766 (and the 999 of SQLite builds before 3.32 would need 124; we require 3.35).
pub(crate) const BATCH_ROWS: usize = 1_000;

/// `text` with a fresh `pending` row of `record` bound as its first ten parameters (content,
/// headers, state, attempts, created and updated at `stamp`): the start of both single-row
/// enqueues.
fn bind_new_row<'q>(
    text: AssertSqlSafe<std::sync::Arc<str>>,
    record: &'q PreparedOutboxRecord,
    stamp: &'q str,
) -> Result<sqlx::query::Query<'q, Sqlite, sqlx::sqlite::SqliteArguments>> {
    Ok(bind_content(sqlx::query(text), record)
        .bind(headers_json(record)?)
        .bind("pending")
        .bind(0_i32)
        .bind(stamp)
        .bind(stamp))
}

impl RowsAffected for SqliteQueryResult {
    fn rows_affected(&self) -> u64 {
        SqliteQueryResult::rows_affected(self)
    }
}

impl Backend for Sqlite {
    const DIALECT: Dialect = Dialect::Sqlite;

    /// Trellis' text format ([`format_timestamp`]).
    type Time = String;

    fn time(time: DateTime<Utc>) -> String {
        format_timestamp(time)
    }

    fn decode(row: &SqliteRow) -> Result<OutboxMessage> {
        read::<_, &str, &str, &str, i64>(row)?.into_message()
    }

    fn decode_extras(row: &SqliteRow, id: &str) -> Result<RowExtras> {
        let first = crate::sql::COLUMN_COUNT;
        let claimed_until: Option<&str> = get(row, id, first + 1, "claimed_until")?;
        Ok((
            get(row, id, first, "claim_token")?,
            claimed_until
                .map(|time| Stored::into_value(time, id, "claimed_until"))
                .transpose()?,
            get(row, id, first + 2, "ordering_key")?,
        ))
    }

    async fn insert_row(on: &mut Enqueue<'_, Self>, record: &PreparedOutboxRecord) -> Result<bool> {
        let stamp = format_timestamp(on.now);
        // A record without an ordering key is written with upstream's statement.
        let text = match record.ordering {
            Some(_) => &on.sql.text.enqueue_ordered,
            None => &on.sql.text.enqueue,
        };
        let query = bind_new_row(statement(text), record, &stamp)?
            .bind(None::<String>)
            .bind(None::<String>)
            .bind(None::<String>);
        let result = bind_ordering(query, record)
            .execute(&mut *on.conn)
            .await
            .map_err(Error::enqueue(&record.id))?;
        Ok(result.rows_affected() == 1)
    }

    async fn insert_leased_row(
        on: &mut Enqueue<'_, Self>,
        record: &PreparedOutboxRecord,
        lease: Lease<'_>,
    ) -> Result<bool> {
        let stamp = format_timestamp(on.now);
        let result = bind_new_row(statement(&on.sql.text.enqueue_leased), record, &stamp)?
            .bind(lease.token)
            .bind(Self::interval(lease.lease))
            .bind(lease.beside_upstream)
            .execute(&mut *on.conn)
            .await
            .map_err(Error::enqueue(&record.id))?;
        Ok(result.rows_affected() == 1)
    }

    async fn lease_rows(
        conn: &mut SqliteConnection,
        sql: &SqlStatements,
        ids: &[&str],
        lease: Lease<'_>,
    ) -> Result<Vec<String>> {
        sqlx::query_scalar(statement(&sql.text.lease_rows))
            .bind(Self::ids(ids)?)
            .bind(lease.token)
            .bind(Self::interval(lease.lease))
            .bind(lease.beside_upstream)
            .fetch_all(&mut *conn)
            .await
            .map_err(Error::enqueue(ids.first().copied().unwrap_or_default()))
    }

    async fn check_committable(_conn: &mut SqliteConnection) -> sqlx::Result<()> {
        Ok(())
    }

    async fn insert_rows(
        on: &mut Enqueue<'_, Self>,
        records: &[PreparedOutboxRecord],
    ) -> Result<u64> {
        let stamp = format_timestamp(on.now);
        let mut inserted = 0;
        for chunk in records.chunks(BATCH_ROWS) {
            // Keyed records are numbered by their own insert (`enqueue_ordered` reads the
            // key's rows inserted before it), so a chunk holding one is inserted row by row.
            if chunk.iter().any(|r| r.ordering.is_some()) {
                for record in chunk {
                    inserted += u64::from(Self::insert_row(on, record).await?);
                }
                continue;
            }
            debug_assert!(chunk.len() * PARAMS_PER_ROW <= 32_766);
            let mut query = sqlx::query(AssertSqlSafe(sql::insert_rows(on.sql, chunk.len())));
            for r in chunk {
                query = bind_content(query, r)
                    .bind(headers_json(r)?)
                    .bind(&stamp)
                    .bind(&stamp);
            }
            inserted += query
                .execute(&mut *on.conn)
                .await
                .map_err(Error::enqueue(first_id(chunk)))?
                .rows_affected();
        }
        Ok(inserted)
    }

    async fn read_stored(
        on: &mut Enqueue<'_, Self>,
        ids: Vec<String>,
    ) -> Result<BTreeMap<String, OutboxMessage>> {
        let mut stored = BTreeMap::new();
        for chunk in ids.chunks(BATCH_ROWS) {
            let mut query = sqlx::query(AssertSqlSafe(sql::select_stored(on.sql, chunk.len())));
            for id in chunk {
                query = query.bind(id.as_str());
            }
            let rows = query
                .fetch_all(&mut *on.conn)
                .await
                .map_err(Error::enqueue(chunk.first().map_or("", String::as_str)))?;
            for row in &rows {
                let message = Self::decode(row)?;
                stored.insert(message.id.clone(), message);
            }
        }
        Ok(stored)
    }
}

impl MigrationBackend for Sqlite {
    const BOOKKEEPING: &'static str = "CREATE TABLE IF NOT EXISTS trellis_outbox_migrations (outbox_table TEXT NOT NULL, version INTEGER NOT NULL, id TEXT NOT NULL, checksum TEXT NOT NULL, applied_at TEXT NOT NULL, PRIMARY KEY (outbox_table, version))";
    /// Table names are compared without case, as SQLite compares them.
    const RECORDED: &'static str = "SELECT version, id, checksum, outbox_table FROM trellis_outbox_migrations \
         WHERE lower(outbox_table) = lower(?)";
    const COLUMNS: &'static str = "SELECT name FROM pragma_table_info(?)";
    /// SQLite's clock writes `applied_at` ([`format_timestamp`]'s format).
    const RECORD: &'static str = "INSERT INTO trellis_outbox_migrations (outbox_table, version, id, checksum, applied_at) VALUES (?, ?, ?, ?, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))";

    const BEGIN_STEP: &'static str = "begin immediate (the write lock)";

    async fn begin_migration(pool: &SqlitePool) -> sqlx::Result<Transaction<'static, Sqlite>> {
        // BEGIN IMMEDIATE takes the write lock up front, serialising concurrent callers; it
        // waits for the lock as long as the connection's busy timeout.
        pool.begin_with("BEGIN IMMEDIATE").await
    }

    async fn lock_migration(
        _: &mut Transaction<'static, Sqlite>,
        _: Duration,
    ) -> std::result::Result<(), (&'static str, sqlx::Error)> {
        // Locked by BEGIN IMMEDIATE already; the whole database, so no statement waits later.
        Ok(())
    }
}

/// The packed values of [`CLAIM_COLUMNS`](sql::CLAIM_COLUMNS), in order.
type Packed<'r> = (
    &'r str,
    &'r str,
    i64,
    &'r str,
    &'r str,
    Option<&'r str>,
    Option<String>,
    Option<Cow<'r, str>>,
);

/// Decodes a row a claim returned ([`CLAIM_COLUMNS`](sql::CLAIM_COLUMNS)).
///
/// `Ok(None)`: the packed values are not what a decodable row holds (say `attempts` is text,
/// a time holds a character JSON escapes, or a column holds a BLOB); read the row's columns
/// one by one ([`Backend::decode`]) to learn exactly what is wrong with it.
pub(crate) fn decode_claimed(row: &SqliteRow) -> Result<Option<OutboxMessage>> {
    let id: String = get(row, "", 0, "id")?;
    let id_ref = id.as_str();
    let packed = row
        .try_get::<&str, _>(5)
        .ok()
        .and_then(|text| serde_json::from_str::<Packed<'_>>(text).ok());
    let Some((kind, state, attempts, created_at, updated_at, next_attempt_at, last_error, outcome)) =
        packed
    else {
        return Ok(None);
    };
    RawRow {
        kind,
        name: get(row, id_ref, 1, "name")?,
        subject: get(row, id_ref, 2, "subject")?,
        payload: get(row, id_ref, 3, "payload")?,
        headers: get::<_, &str>(row, id_ref, 4, "headers")?,
        state,
        attempts,
        created_at,
        updated_at,
        next_attempt_at,
        last_error,
        outcome,
        id,
    }
    .into_message()
    .map(Some)
}
