//! The PostgreSQL driver: enqueue, the row decoder's Postgres types, and migrations.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::{PgQueryResult, PgRow};
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, Transaction};

use super::sql;
use super::time::PgTime;
use crate::driver::sealed::{
    Backend, Enqueue, Lease, MigrationBackend, RepositoryBackend, RowExtras, RowsAffected,
};
use crate::error::{Error, Result};
use crate::record::{OutboxMessage, PreparedOutboxRecord};
use crate::row::{bind_content, bind_ordering, first_id, get, headers_json, read};
use crate::sql::{SqlStatements, statement};
use crate::tables::Dialect;

/// Rows per `UNNEST` insert: bounds the size of one statement's arrays.
const BATCH_ROWS: usize = 5_000;

/// Advisory lock key serialising `migrate` calls: the ASCII bytes of "trellism".
const MIGRATE_LOCK_KEY: i64 = 0x7472_656c_6c69_736d;

/// `text` with a fresh `pending` row of `record` bound as its first ten parameters (content,
/// headers, state, attempts, created and updated at `now`): the start of both single-row
/// enqueues.
fn bind_new_row<'q>(
    text: AssertSqlSafe<std::sync::Arc<str>>,
    record: &'q PreparedOutboxRecord,
    now: DateTime<Utc>,
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    bind_content(sqlx::query(text), record)
        .bind(Json(&record.headers))
        .bind("pending")
        .bind(0_i32)
        .bind(now)
        .bind(now)
}

impl RowsAffected for PgQueryResult {
    fn rows_affected(&self) -> u64 {
        PgQueryResult::rows_affected(self)
    }
}

impl Backend for Postgres {
    const DIALECT: Dialect = Dialect::Postgres;

    type Time = DateTime<Utc>;

    fn time(time: DateTime<Utc>) -> DateTime<Utc> {
        time
    }

    fn decode(row: &PgRow) -> Result<OutboxMessage> {
        read::<_, PgTime, Json<BTreeMap<String, String>>, Json<serde_json::Value>, i32>(row)?
            .into_message()
    }

    fn decode_extras(row: &PgRow, id: &str) -> Result<RowExtras> {
        let first = crate::sql::COLUMN_COUNT;
        let claimed_until: Option<PgTime> = get(row, id, first + 1, "claimed_until")?;
        Ok((
            get(row, id, first, "claim_token")?,
            claimed_until.map(|PgTime(time)| time),
            get(row, id, first + 2, "ordering_key")?,
        ))
    }

    async fn insert_row(on: &mut Enqueue<'_, Self>, record: &PreparedOutboxRecord) -> Result<bool> {
        // The statement answers a row only when it inserted one. A record without an
        // ordering key is written with upstream's statement.
        let text = match record.ordering {
            Some(_) => &on.sql.text.enqueue_ordered,
            None => &on.sql.text.enqueue,
        };
        let query = bind_new_row(statement(text), record, on.now)
            .bind(None::<DateTime<Utc>>)
            .bind(None::<String>)
            .bind(None::<Json<serde_json::Value>>)
            .bind(on.sql.notify_bind());
        let inserted = bind_ordering(query, record)
            .fetch_optional(&mut *on.conn)
            .await
            .map_err(Error::enqueue(&record.id))?;
        Ok(inserted.is_some())
    }

    async fn insert_leased_row(
        on: &mut Enqueue<'_, Self>,
        record: &PreparedOutboxRecord,
        lease: Lease<'_>,
    ) -> Result<bool> {
        let result = bind_new_row(statement(&on.sql.text.enqueue_leased), record, on.now)
            .bind(lease.token)
            .bind(Self::interval(lease.lease))
            .bind(lease.beside_upstream)
            .execute(&mut *on.conn)
            .await
            .map_err(Error::enqueue(&record.id))?;
        Ok(result.rows_affected() == 1)
    }

    async fn lease_rows(
        conn: &mut PgConnection,
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

    async fn check_committable(conn: &mut PgConnection) -> sqlx::Result<()> {
        sqlx::raw_sql("SELECT 1")
            .execute(&mut *conn)
            .await
            .map(drop)
    }

    async fn insert_rows(
        on: &mut Enqueue<'_, Self>,
        records: &[PreparedOutboxRecord],
    ) -> Result<u64> {
        let insert = sql::insert_batch(on.sql);
        let mut inserted = 0;
        for chunk in records.chunks(BATCH_ROWS) {
            let mut columns: [Vec<&str>; 5] = Default::default();
            let mut headers = Vec::with_capacity(chunk.len());
            let mut keys = Vec::with_capacity(chunk.len());
            let mut skip_dead = Vec::with_capacity(chunk.len());
            for r in chunk {
                let (key, skip) = r.ordering_columns();
                keys.push(key);
                skip_dead.push(skip);
                columns[0].push(&r.id);
                columns[1].push(r.kind.as_str());
                columns[2].push(&r.name);
                columns[3].push(&r.subject);
                columns[4].push(&r.payload);
                headers.push(headers_json(r)?);
            }
            let [ids, kinds, names, subjects, payloads] = columns;
            let (count, _): (i64, Option<String>) = sqlx::query_as(AssertSqlSafe(insert.as_str()))
                .bind(ids)
                .bind(kinds)
                .bind(names)
                .bind(subjects)
                .bind(payloads)
                .bind(headers)
                .bind(on.now)
                .bind(on.sql.notify_bind())
                .bind(keys)
                .bind(skip_dead)
                .fetch_one(&mut *on.conn)
                .await
                .map_err(Error::enqueue(first_id(chunk)))?;
            inserted += u64::try_from(count).unwrap_or(0);
        }
        Ok(inserted)
    }

    async fn read_stored(
        on: &mut Enqueue<'_, Self>,
        ids: Vec<String>,
    ) -> Result<BTreeMap<String, OutboxMessage>> {
        let rows = sqlx::query(AssertSqlSafe(sql::select_stored(on.sql)))
            .bind(&ids)
            .fetch_all(&mut *on.conn)
            .await
            .map_err(Error::enqueue(ids.first().map_or("", String::as_str)))?;
        rows.iter()
            .map(|row| Self::decode(row).map(|message| (message.id.clone(), message)))
            .collect()
    }
}

impl MigrationBackend for Postgres {
    /// Created only when missing: `CREATE TABLE IF NOT EXISTS` checks the CREATE privilege
    /// on the schema even when the table exists, which an application role without it
    /// (Postgres 15's default on `public`) lacks.
    const BOOKKEEPING: &'static str = "DO $$ BEGIN IF to_regclass('trellis_outbox_migrations') IS NULL THEN \
         CREATE TABLE trellis_outbox_migrations (outbox_table text NOT NULL, version integer NOT NULL, id text NOT NULL, checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (outbox_table, version)); \
         END IF; END $$";
    /// Table names are compared in lower case, as Postgres folds the unquoted names.
    const RECORDED: &'static str = "SELECT version::int8, id, checksum, outbox_table FROM trellis_outbox_migrations \
         WHERE lower(outbox_table) = lower($1)";
    const COLUMNS: &'static str = "SELECT column_name::text FROM information_schema.columns \
         WHERE table_schema = current_schema() AND table_name = lower($1)";
    /// The database's clock writes `applied_at`.
    const RECORD: &'static str = "INSERT INTO trellis_outbox_migrations (outbox_table, version, id, checksum) VALUES ($1, $2, $3, $4)";

    const BEGIN_STEP: &'static str = "begin";

    async fn begin_migration(pool: &PgPool) -> sqlx::Result<Transaction<'static, Postgres>> {
        pool.begin().await
    }

    async fn lock_migration(
        tx: &mut Transaction<'static, Postgres>,
        lock_timeout: Duration,
    ) -> std::result::Result<(), (&'static str, sqlx::Error)> {
        // Serialises concurrent migrate calls; released at commit or rollback. Taken before
        // the timeout is set: a replica waits for another's migration however long it takes.
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATE_LOCK_KEY)
            .execute(&mut **tx)
            .await
            .map_err(|e| ("advisory lock", e))?;
        // For this transaction only (`is_local`). A DDL statement queued behind a long
        // transaction holds up every query on its table after it: give up instead.
        // Rounded up: Postgres reads `0ms` as no limit, which a timeout under a millisecond
        // must not become.
        let millis = lock_timeout
            .as_nanos()
            .div_ceil(1_000_000)
            .min(i32::MAX as u128);
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(format!("{millis}ms"))
            .execute(&mut **tx)
            .await
            .map_err(|e| ("set lock_timeout", e))?;
        Ok(())
    }
}
