//! SQLite backend.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::sqlite::{SqliteConnection, SqliteRow};
use sqlx::{AssertSqlSafe, Sqlite, Transaction};

use crate::error::{Error, Result};
use crate::migrate::SqlOutboxMigration;
use crate::outbox::sealed::Backend;
use crate::record::{InboxReceipt, OutboxMessage, PreparedOutboxRecord};
use crate::row::{RawRow, batch_result, column};
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
            .fetch_one(&mut *conn)
            .await
            .map_err(enqueue_error)?;
        decode(&row)
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

pub(crate) fn decode(row: &SqliteRow) -> Result<OutboxMessage> {
    let id: String = column(row, "", "id")?;
    let headers_text: String = column(row, &id, "headers")?;
    let headers: BTreeMap<String, String> = serde_json::from_str(&headers_text)
        .map_err(|e| Error::decode(&id, "headers", format!("not a JSON object of strings: {e}")))?;
    let outcome = column::<_, Option<String>>(row, &id, "outcome")?
        .map(|text| serde_json::from_str(&text))
        .transpose()
        .map_err(|e| Error::decode(&id, "outcome", format!("not JSON: {e}")))?;
    let created_at: String = column(row, &id, "created_at")?;
    let updated_at: String = column(row, &id, "updated_at")?;
    let next_attempt_at: Option<String> = column(row, &id, "next_attempt_at")?;
    RawRow {
        kind: column(row, &id, "kind")?,
        name: column(row, &id, "name")?,
        subject: column(row, &id, "subject")?,
        payload: column(row, &id, "payload")?,
        headers,
        state: column(row, &id, "state")?,
        attempts: column(row, &id, "attempts")?,
        created_at: timestamp(&id, "created_at", &created_at)?,
        updated_at: timestamp(&id, "updated_at", &updated_at)?,
        next_attempt_at: next_attempt_at
            .map(|t| timestamp(&id, "next_attempt_at", &t))
            .transpose()?,
        last_error: column(row, &id, "last_error")?,
        outcome,
        id,
    }
    .into_message()
}
