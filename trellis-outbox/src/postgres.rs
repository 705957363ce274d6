//! PostgreSQL backend.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::postgres::{PgConnection, PgRow};
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, Postgres, Transaction};

use crate::error::{Error, Result};
use crate::migrate::SqlOutboxMigration;
use crate::outbox::sealed::Backend;
use crate::record::{InboxReceipt, OutboxMessage, PreparedOutboxRecord};
use crate::row::{RawRow, batch_result, column, existing_row};
use crate::sql::{COLUMNS, SqlStatements};
use crate::tables::Dialect;
use crate::time::now_millis;

/// Rows per `UNNEST` insert: bounds the size of one statement's arrays.
const BATCH_ROWS: usize = 5_000;

impl Backend for Postgres {
    const DIALECT: Dialect = Dialect::Postgres;

    async fn insert_one(
        conn: &mut PgConnection,
        sql: &SqlStatements,
        record: PreparedOutboxRecord,
    ) -> Result<OutboxMessage> {
        let now = now_millis();
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
            .bind(Json(&record.headers))
            .bind("pending")
            .bind(0_i32)
            .bind(now)
            .bind(now)
            .bind(None::<DateTime<Utc>>)
            .bind(None::<String>)
            .bind(None::<Json<serde_json::Value>>)
            .bind(sql.notify_bind())
            .fetch_optional(&mut *conn)
            .await
            .map_err(enqueue_error)?
            .map_or(0, |_| 1);
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
        conn: &mut PgConnection,
        sql: &SqlStatements,
        records: Vec<PreparedOutboxRecord>,
    ) -> Result<Vec<OutboxMessage>> {
        let now = now_millis();
        let o = &*sql.outbox_table;
        let insert = format!(
            "WITH inserted AS (INSERT INTO {o} ({COLUMNS}) \
             SELECT t.id, t.kind, t.name, t.subject, t.payload, t.headers::jsonb, 'pending', 0, $7, $7, NULL, NULL, NULL \
             FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[]) \
             AS t(id, kind, name, subject, payload, headers) \
             ON CONFLICT (id) DO NOTHING RETURNING 1), \
             counted AS (SELECT count(*) AS n FROM inserted) \
             SELECT n, CASE WHEN n > 0 AND $8::text IS NOT NULL THEN pg_notify($8, '')::text END FROM counted"
        );
        let mut inserted = 0;
        for chunk in records.chunks(BATCH_ROWS) {
            let mut columns: [Vec<&str>; 5] = Default::default();
            let mut headers = Vec::with_capacity(chunk.len());
            for r in chunk {
                columns[0].push(&r.id);
                columns[1].push(r.kind.as_str());
                columns[2].push(&r.name);
                columns[3].push(&r.subject);
                columns[4].push(&r.payload);
                headers.push(serde_json::to_string(&r.headers).map_err(|source| {
                    Error::Serialize {
                        what: "outbox headers",
                        source,
                    }
                })?);
            }
            let [ids, kinds, names, subjects, payloads] = columns;
            let (count, _): (i64, Option<String>) = sqlx::query_as(AssertSqlSafe(insert.as_str()))
                .bind(ids)
                .bind(kinds)
                .bind(names)
                .bind(subjects)
                .bind(payloads)
                .bind(headers)
                .bind(now)
                .bind(sql.notify_bind())
                .fetch_one(&mut *conn)
                .await
                .map_err(|source| Error::Enqueue {
                    id: chunk[0].id.clone(),
                    source,
                })?;
            inserted += u64::try_from(count).unwrap_or(0);
        }
        batch_result(records, inserted, now, |ids| read_stored(conn, sql, ids)).await
    }

    async fn record_inbox(
        conn: &mut PgConnection,
        sql: &SqlStatements,
        message_id: &str,
    ) -> Result<InboxReceipt> {
        let affected = sqlx::query(AssertSqlSafe(sql.inbox_insert.clone()))
            .bind(message_id)
            .bind(now_millis())
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

    async fn begin_migration(pool: &sqlx::PgPool) -> sqlx::Result<Transaction<'static, Postgres>> {
        let mut tx = pool.begin().await?;
        // Serialises concurrent migrate calls; released at commit or rollback.
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATE_LOCK_KEY)
            .execute(&mut *tx)
            .await?;
        Ok(tx)
    }

    async fn recorded_migrations(
        tx: &mut Transaction<'static, Postgres>,
        outbox: &str,
    ) -> sqlx::Result<Vec<(i64, String, String)>> {
        sqlx::query_as(
            "SELECT version::int8, id, checksum FROM trellis_outbox_migrations WHERE outbox_table = $1",
        )
        .bind(outbox)
        .fetch_all(&mut **tx)
        .await
    }

    async fn run_ddl(tx: &mut Transaction<'static, Postgres>, statement: &str) -> sqlx::Result<()> {
        sqlx::raw_sql(AssertSqlSafe(statement))
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    async fn record_migration(
        tx: &mut Transaction<'static, Postgres>,
        outbox: &str,
        migration: &SqlOutboxMigration,
    ) -> sqlx::Result<()> {
        sqlx::query(
            "INSERT INTO trellis_outbox_migrations (outbox_table, version, id, checksum) VALUES ($1, $2, $3, $4)",
        )
        .bind(outbox)
        .bind(i32::try_from(migration.version).unwrap_or(i32::MAX))
        .bind(&migration.id)
        .bind(&migration.checksum)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

/// Advisory lock key serialising `migrate` calls: the ASCII bytes of "trellism".
const MIGRATE_LOCK_KEY: i64 = 0x7472_656c_6c69_736d;

/// Reads the stored rows of `ids`.
async fn read_stored(
    conn: &mut PgConnection,
    sql: &SqlStatements,
    ids: Vec<String>,
) -> Result<BTreeMap<String, OutboxMessage>> {
    let mut stored = BTreeMap::new();
    let select = format!(
        "SELECT {COLUMNS} FROM {} WHERE id = ANY($1)",
        sql.outbox_table
    );
    let rows = sqlx::query(AssertSqlSafe(select))
        .bind(&ids)
        .fetch_all(&mut *conn)
        .await
        .map_err(|source| Error::Enqueue {
            id: ids.first().cloned().unwrap_or_default(),
            source,
        })?;
    for row in &rows {
        let message = decode(row)?;
        stored.insert(message.id.clone(), message);
    }
    Ok(stored)
}

pub(crate) fn decode(row: &PgRow) -> Result<OutboxMessage> {
    let id: String = column(row, "", "id")?;
    let headers: Json<BTreeMap<String, String>> = column(row, &id, "headers")?;
    let outcome: Option<Json<serde_json::Value>> = column(row, &id, "outcome")?;
    let attempts: i32 = column(row, &id, "attempts")?;
    RawRow {
        kind: column(row, &id, "kind")?,
        name: column(row, &id, "name")?,
        subject: column(row, &id, "subject")?,
        payload: column(row, &id, "payload")?,
        headers: headers.0,
        state: column(row, &id, "state")?,
        attempts: i64::from(attempts),
        created_at: column(row, &id, "created_at")?,
        updated_at: column(row, &id, "updated_at")?,
        next_attempt_at: column(row, &id, "next_attempt_at")?,
        last_error: column(row, &id, "last_error")?,
        outcome: outcome.map(|j| j.0),
        id,
    }
    .into_message()
}
