//! SQLite backend.

use std::borrow::Cow;
use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::sqlite::{SqliteConnection, SqliteRow};
use sqlx::{AssertSqlSafe, Row, Sqlite, Transaction};

use crate::error::{Error, Result};
use crate::migrate::SqlOutboxMigration;
use crate::outbox::sealed::Backend;
use crate::record::{InboxReceipt, OutboxMessage, PreparedOutboxRecord};
use crate::row::{COLUMN_NAMES, batch_result, existing_row};
use crate::sql::{COLUMNS, SqlStatements};
use crate::tables::Dialect;
use crate::time::{format_timestamp, now_millis, parse_timestamp};

/// Bind parameters per batch-insert row.
const PARAMS_PER_ROW: usize = 8;
/// Rows per multi-row insert: 8 × 1,000 parameters stays far below SQLite's default limit
/// of 32,766 (and the 999 of SQLite builds before 3.32 would need 124; we require 3.35).
const BATCH_ROWS: usize = 1_000;

fn headers_text(record: &PreparedOutboxRecord) -> Result<String> {
    serde_json::to_string(&record.headers).map_err(|source| Error::Serialize {
        what: "outbox headers",
        source,
    })
}

impl Backend for Sqlite {
    const DIALECT: Dialect = Dialect::Sqlite;

    async fn insert_one(
        conn: &mut SqliteConnection,
        sql: &SqlStatements,
        record: PreparedOutboxRecord,
    ) -> Result<OutboxMessage> {
        let now = now_millis();
        let stamp = format_timestamp(now);
        let headers = headers_text(&record)?;
        let enqueue_error = |source| Error::Enqueue {
            id: record.id.clone(),
            source,
        };
        let inserted = sqlx::query(AssertSqlSafe(sql.enqueue.clone()))
            .bind(&record.id)
            .bind(record.kind.as_str())
            .bind(&record.name)
            .bind(&record.subject)
            .bind(&record.payload)
            .bind(headers)
            .bind("pending")
            .bind(0_i32)
            .bind(&stamp)
            .bind(&stamp)
            .bind(None::<String>)
            .bind(None::<String>)
            .bind(None::<String>)
            .execute(&mut *conn)
            .await
            .map_err(enqueue_error)?
            .rows_affected();
        if inserted == 1 {
            return Ok(OutboxMessage::pending(record, now));
        }
        let row = sqlx::query(AssertSqlSafe(sql.select_by_id.clone()))
            .bind(&record.id)
            .fetch_optional(&mut *conn)
            .await
            .map_err(enqueue_error)?;
        let stored = row.as_ref().map(decode).transpose()?;
        existing_row(&record, stored.as_ref())
    }

    async fn insert_many(
        conn: &mut SqliteConnection,
        sql: &SqlStatements,
        records: Vec<PreparedOutboxRecord>,
    ) -> Result<Vec<OutboxMessage>> {
        let now = now_millis();
        let stamp = format_timestamp(now);
        let mut inserted = 0;
        for chunk in records.chunks(BATCH_ROWS) {
            let mut insert = format!("INSERT INTO {} ({COLUMNS}) VALUES ", sql.outbox_table);
            for i in 0..chunk.len() {
                if i > 0 {
                    insert.push_str(", ");
                }
                insert.push_str("(?, ?, ?, ?, ?, ?, 'pending', 0, ?, ?, NULL, NULL, NULL)");
            }
            insert.push_str(" ON CONFLICT(id) DO NOTHING");
            debug_assert!(chunk.len() * PARAMS_PER_ROW <= 32_766);
            let mut query = sqlx::query(AssertSqlSafe(insert));
            for r in chunk {
                query = query
                    .bind(&r.id)
                    .bind(r.kind.as_str())
                    .bind(&r.name)
                    .bind(&r.subject)
                    .bind(&r.payload)
                    .bind(headers_text(r)?)
                    .bind(&stamp)
                    .bind(&stamp);
            }
            inserted += query
                .execute(&mut *conn)
                .await
                .map_err(|source| Error::Enqueue {
                    id: chunk[0].id.clone(),
                    source,
                })?
                .rows_affected();
        }
        batch_result(records, inserted, now, |ids| read_stored(conn, sql, ids)).await
    }

    async fn record_inbox(
        conn: &mut SqliteConnection,
        sql: &SqlStatements,
        message_id: &str,
    ) -> Result<InboxReceipt> {
        let affected = sqlx::query(AssertSqlSafe(sql.inbox_insert.clone()))
            .bind(message_id)
            .bind(format_timestamp(now_millis()))
            .execute(&mut *conn)
            .await
            .map_err(|source| Error::RecordInbox {
                message_id: message_id.to_owned(),
                source,
            })?
            .rows_affected();
        Ok(if affected == 1 {
            InboxReceipt::Accepted
        } else {
            InboxReceipt::Duplicate
        })
    }

    async fn begin_migration(
        pool: &sqlx::SqlitePool,
    ) -> sqlx::Result<Transaction<'static, Sqlite>> {
        // BEGIN IMMEDIATE takes the write lock up front, serialising concurrent callers.
        pool.begin_with("BEGIN IMMEDIATE").await
    }

    async fn recorded_migrations(
        tx: &mut Transaction<'static, Sqlite>,
        outbox: &str,
    ) -> sqlx::Result<Vec<(i64, String, String)>> {
        sqlx::query_as(
            "SELECT version, id, checksum FROM trellis_outbox_migrations WHERE outbox_table = ?",
        )
        .bind(outbox)
        .fetch_all(&mut **tx)
        .await
    }

    async fn run_ddl(tx: &mut Transaction<'static, Sqlite>, statement: &str) -> sqlx::Result<()> {
        sqlx::raw_sql(AssertSqlSafe(statement))
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn record_migration(
        tx: &mut Transaction<'static, Sqlite>,
        outbox: &str,
        migration: &SqlOutboxMigration,
    ) -> sqlx::Result<()> {
        sqlx::query(
            "INSERT INTO trellis_outbox_migrations (outbox_table, version, id, checksum, applied_at) VALUES (?, ?, ?, ?, ?)",
        )
        .bind(outbox)
        .bind(i64::from(migration.version))
        .bind(&migration.id)
        .bind(&migration.checksum)
        .bind(format_timestamp(now_millis()))
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

/// Reads the stored rows of `ids`.
async fn read_stored(
    conn: &mut SqliteConnection,
    sql: &SqlStatements,
    ids: Vec<String>,
) -> Result<BTreeMap<String, OutboxMessage>> {
    let mut stored = BTreeMap::new();
    for chunk in ids.chunks(BATCH_ROWS) {
        let mut select = format!("SELECT {COLUMNS} FROM {} WHERE id IN (", sql.outbox_table);
        for i in 0..chunk.len() {
            select.push_str(if i > 0 { ", ?" } else { "?" });
        }
        select.push(')');
        let mut query = sqlx::query(AssertSqlSafe(select));
        for id in chunk {
            query = query.bind(id.as_str());
        }
        let rows = query
            .fetch_all(&mut *conn)
            .await
            .map_err(|source| Error::Enqueue {
                id: chunk[0].clone(),
                source,
            })?;
        for row in &rows {
            let message = decode(row)?;
            stored.insert(message.id.clone(), message);
        }
    }
    Ok(stored)
}

fn timestamp(id: &str, column: &'static str, text: &str) -> Result<DateTime<Utc>> {
    parse_timestamp(text).map_err(|e| Error::decode(id, column, format!("{text:?}: {e}")))
}

/// Reads column `index` (by position: no name lookup), turning a driver error into
/// [`Error::Decode`] about the column `name`.
fn get<'r, T>(row: &'r SqliteRow, id: &str, index: usize, name: &'static str) -> Result<T>
where
    T: sqlx::Decode<'r, Sqlite> + sqlx::Type<Sqlite>,
{
    row.try_get(index).map_err(|e| Error::decode(id, name, e))
}

/// Reads column `index` of [`COLUMNS`].
fn column<'r, T>(row: &'r SqliteRow, id: &str, index: usize) -> Result<T>
where
    T: sqlx::Decode<'r, Sqlite> + sqlx::Type<Sqlite>,
{
    get(row, id, index, COLUMN_NAMES[index])
}

/// A row's values as read, before the checks. Text that does not end up in the message as
/// text (kind, state, headers, times, outcome) is borrowed from the row, not copied.
struct Values<'r> {
    id: String,
    kind: &'r str,
    name: String,
    subject: String,
    payload: String,
    headers: &'r str,
    state: &'r str,
    attempts: i64,
    created_at: &'r str,
    updated_at: &'r str,
    next_attempt_at: Option<&'r str>,
    last_error: Option<String>,
    outcome: Option<Cow<'r, str>>,
}

impl Values<'_> {
    fn into_message(self) -> Result<OutboxMessage> {
        let id = self.id.as_str();
        let kind = self
            .kind
            .parse()
            .map_err(|e: Error| Error::decode(id, "kind", e))?;
        let headers = serde_json::from_str(self.headers).map_err(|e| {
            Error::decode(id, "headers", format!("not a JSON object of strings: {e}"))
        })?;
        let state = self
            .state
            .parse()
            .map_err(|e: Error| Error::decode(id, "state", e))?;
        let attempts = u32::try_from(self.attempts).map_err(|_| {
            Error::decode(id, "attempts", format!("{} is out of range", self.attempts))
        })?;
        let created_at = timestamp(id, "created_at", self.created_at)?;
        let updated_at = timestamp(id, "updated_at", self.updated_at)?;
        let next_attempt_at = self
            .next_attempt_at
            .map(|t| timestamp(id, "next_attempt_at", t))
            .transpose()?;
        let outcome = self
            .outcome
            .map(|text| serde_json::from_str(&text))
            .transpose()
            .map_err(|e| Error::decode(id, "outcome", format!("not JSON: {e}")))?;
        Ok(OutboxMessage {
            id: self.id,
            kind,
            name: self.name,
            subject: self.subject,
            payload: self.payload,
            headers,
            state,
            attempts,
            created_at,
            updated_at,
            next_attempt_at,
            last_error: self.last_error,
            outcome,
        })
    }
}

/// Decodes a row that selected [`COLUMNS`] first, in order.
pub(crate) fn decode(row: &SqliteRow) -> Result<OutboxMessage> {
    let id: String = column(row, "", 0)?;
    let id_ref = id.as_str();
    Values {
        kind: column(row, id_ref, 1)?,
        name: column(row, id_ref, 2)?,
        subject: column(row, id_ref, 3)?,
        payload: column(row, id_ref, 4)?,
        headers: column(row, id_ref, 5)?,
        state: column(row, id_ref, 6)?,
        attempts: column(row, id_ref, 7)?,
        created_at: column(row, id_ref, 8)?,
        updated_at: column(row, id_ref, 9)?,
        next_attempt_at: column(row, id_ref, 10)?,
        last_error: column(row, id_ref, 11)?,
        outcome: column::<Option<&str>>(row, id_ref, 12)?.map(Cow::Borrowed),
        id,
    }
    .into_message()
}

/// What a claim returns per row: the values that become the message's strings, one column
/// each, then the other eight packed into one JSON array.
///
/// The SQLite driver copies every returned value into its own allocation before handing the
/// row over, and a claim returns a hundred rows: six values per row instead of thirteen make
/// the claim markedly cheaper. [`decode_claimed`] reads this shape.
///
/// `json_array` fails the whole statement on a BLOB argument, so a row holding one in a packed
/// column (never written by trellis-outbox or Trellis) packs NULL instead, and is then read
/// column by column like any other unusual row: one bad row must not block the claim.
pub(crate) const CLAIM_COLUMNS: &str = "id, name, subject, payload, headers, \
    CASE WHEN 'blob' IN (typeof(kind), typeof(state), typeof(attempts), typeof(created_at), \
    typeof(updated_at), typeof(next_attempt_at), typeof(last_error), typeof(outcome)) THEN NULL \
    ELSE json_array(kind, state, attempts, created_at, updated_at, next_attempt_at, last_error, outcome) END";

/// How many values [`CLAIM_COLUMNS`] has.
pub(crate) const CLAIM_COLUMN_COUNT: usize = 6;

/// The packed values of [`CLAIM_COLUMNS`], in order.
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

/// Decodes a row a claim returned ([`CLAIM_COLUMNS`]).
///
/// `Ok(None)`: the packed values are not what a decodable row holds (say `attempts` is text,
/// a time holds a character JSON escapes, or a column holds a BLOB); read the row's columns
/// one by one ([`decode`]) to learn exactly what is wrong with it.
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
    Values {
        kind,
        name: get(row, id_ref, 1, "name")?,
        subject: get(row, id_ref, 2, "subject")?,
        payload: get(row, id_ref, 3, "payload")?,
        headers: get(row, id_ref, 4, "headers")?,
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
