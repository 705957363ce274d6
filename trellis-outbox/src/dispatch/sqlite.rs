//! [`OutboxRepository`] on SQLite.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, Row, SqlitePool};

use super::repository::{Claim, Dispatched, OutboxRepository};
use crate::error::{Error, Result};
use crate::record::new_id;
use crate::sql::COLUMNS;
use crate::tables::OutboxTables;
use crate::time::{format_timestamp, parse_timestamp};

/// SQLite's current time in the stored format, `YYYY-MM-DDTHH:MM:SS.SSSZ`.
const NOW: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";

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
#[derive(Debug, Clone)]
pub struct SqliteOutboxRepository {
    pool: SqlitePool,
    sql: Arc<Statements>,
}

#[derive(Debug)]
struct Statements {
    claim: String,
    mark_dispatched: String,
    mark_dispatched_with_outcomes: String,
    mark_failed: String,
    mark_dead: String,
    release: String,
    retry: String,
    next_due_in: String,
}

impl SqliteOutboxRepository {
    /// A repository on the default tables.
    pub fn new(pool: SqlitePool) -> Self {
        Self::with_tables(pool, &OutboxTables::default())
    }

    /// A repository on `tables`.
    pub fn with_tables(pool: SqlitePool, tables: &OutboxTables) -> Self {
        let o = tables.outbox();
        let sql = Statements {
            // ?1 limit, ?2 lease modifier ('+30.000 seconds'), ?3 token, ?4 cutoff or NULL.
            // Without statistics SQLite prefers the (state, next_attempt_at) index and sorts
            // every undispatched row per claim; the partial claim index yields them in order.
            claim: format!(
                "UPDATE {o} SET claimed_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?2), claim_token = ?3 \
                 WHERE id IN (SELECT id FROM {o} INDEXED BY {o}_claim_idx \
                 WHERE state IN ('pending', 'failed') \
                 AND (next_attempt_at IS NULL OR next_attempt_at <= COALESCE(?4, {NOW})) \
                 AND (claimed_until IS NULL OR claimed_until <= {NOW}) \
                 ORDER BY created_at, id LIMIT ?1) \
                 RETURNING {COLUMNS}, COALESCE(?4, {NOW}) AS claim_cutoff"
            ),
            // ?1 JSON array of ids, ?2 token.
            mark_dispatched: format!(
                "UPDATE {o} SET state = 'dispatched', updated_at = {NOW}, next_attempt_at = NULL, \
                 last_error = NULL, claimed_until = NULL, claim_token = NULL, outcome = NULL \
                 WHERE claim_token = ?2 AND id IN (SELECT value FROM json_each(?1))"
            ),
            // ?1 JSON array of [id, outcome-or-null] pairs, ?2 token.
            mark_dispatched_with_outcomes: format!(
                "UPDATE {o} SET state = 'dispatched', updated_at = {NOW}, next_attempt_at = NULL, \
                 last_error = NULL, claimed_until = NULL, claim_token = NULL, \
                 outcome = (SELECT NULLIF(d.value -> '$[1]', 'null') FROM json_each(?1) AS d \
                            WHERE d.value ->> '$[0]' = {o}.id) \
                 WHERE claim_token = ?2 AND id IN (SELECT value ->> '$[0]' FROM json_each(?1))"
            ),
            mark_failed: format!(
                "UPDATE {o} SET state = 'failed', attempts = attempts + 1, updated_at = {NOW}, \
                 next_attempt_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?3), last_error = ?4, \
                 claimed_until = NULL, claim_token = NULL \
                 WHERE id = ?1 AND claim_token = ?2"
            ),
            mark_dead: format!(
                "UPDATE {o} SET state = 'dead', attempts = attempts + ?3, updated_at = {NOW}, \
                 next_attempt_at = NULL, last_error = ?4, claimed_until = NULL, claim_token = NULL \
                 WHERE id = ?1 AND claim_token = ?2"
            ),
            release: format!(
                "UPDATE {o} SET claimed_until = NULL, claim_token = NULL \
                 WHERE claim_token = ?2 AND id IN (SELECT value FROM json_each(?1))"
            ),
            retry: format!(
                "UPDATE {o} SET state = 'pending', attempts = 0, updated_at = {NOW}, next_attempt_at = NULL, \
                 claimed_until = NULL, claim_token = NULL \
                 WHERE id = ?1 AND state IN ('failed', 'dead')"
            ),
            next_due_in: format!(
                "SELECT (julianday(min(max(COALESCE(next_attempt_at, {NOW}), COALESCE(claimed_until, {NOW})))) \
                 - julianday({NOW})) * 86400.0 \
                 FROM {o} WHERE state IN ('pending', 'failed')"
            ),
        };
        Self {
            pool,
            sql: Arc::new(sql),
        }
    }

    /// The pool this repository uses.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

/// An SQLite date modifier adding `duration`: `+1.500 seconds`.
fn modifier(duration: Duration) -> String {
    format!("+{:.3} seconds", duration.as_secs_f64())
}

fn json_array<T: serde::Serialize>(value: &T) -> Result<String> {
    serde_json::to_string(value).map_err(|source| Error::Serialize {
        what: "id list",
        source,
    })
}

impl OutboxRepository for SqliteOutboxRepository {
    async fn claim_due(
        &self,
        limit: usize,
        lease: Duration,
        cutoff: Option<DateTime<Utc>>,
    ) -> Result<Claim> {
        let token = new_id();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        // One autocommit UPDATE: SQLite takes the write lock when the statement starts, so
        // the claim is atomic and concurrent claimers queue on the busy timeout (the same
        // guarantee as BEGIN IMMEDIATE, in one round trip).
        let rows = sqlx::query(AssertSqlSafe(self.sql.claim.as_str()))
            .bind(limit)
            .bind(modifier(lease))
            .bind(&token)
            .bind(cutoff.map(format_timestamp))
            .fetch_all(&self.pool)
            .await
            .map_err(Error::repository("claim"))?;
        let Some(first) = rows.first() else {
            return Ok(Claim::empty(token, cutoff.unwrap_or_else(Utc::now)));
        };
        let cutoff_text: String = first
            .try_get("claim_cutoff")
            .map_err(|e| Error::decode("", "claim_cutoff", e))?;
        let cutoff = parse_timestamp(&cutoff_text)
            .map_err(|e| Error::decode("", "claim_cutoff", format!("{cutoff_text:?}: {e}")))?;
        let mut claim = Claim::empty(token, cutoff);
        claim.extend(&rows, crate::sqlite::decode, |row| row.try_get("id").ok());
        Ok(claim)
    }

    async fn mark_dispatched(&self, claim: &Claim, rows: &[Dispatched]) -> Result<u64> {
        if rows.is_empty() {
            return Ok(0);
        }
        // Events carry no outcome: the plain statement avoids a per-row JSON lookup.
        let (sql, list) = if rows.iter().all(|r| r.outcome.is_none()) {
            let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
            (&self.sql.mark_dispatched, json_array(&ids)?)
        } else {
            let pairs: Vec<(&str, &Option<serde_json::Value>)> =
                rows.iter().map(|r| (r.id.as_str(), &r.outcome)).collect();
            (&self.sql.mark_dispatched_with_outcomes, json_array(&pairs)?)
        };
        let result = sqlx::query(AssertSqlSafe(sql.as_str()))
            .bind(list)
            .bind(&claim.token)
            .execute(&self.pool)
            .await
            .map_err(Error::repository("mark dispatched"))?;
        Ok(result.rows_affected())
    }

    async fn mark_failed(
        &self,
        claim: &Claim,
        id: &str,
        error: &str,
        retry_after: Duration,
    ) -> Result<bool> {
        let result = sqlx::query(AssertSqlSafe(self.sql.mark_failed.as_str()))
            .bind(id)
            .bind(&claim.token)
            .bind(modifier(retry_after))
            .bind(error)
            .execute(&self.pool)
            .await
            .map_err(Error::repository("mark failed"))?;
        Ok(result.rows_affected() == 1)
    }

    async fn mark_dead(
        &self,
        claim: &Claim,
        id: &str,
        reason: &str,
        count_attempt: bool,
    ) -> Result<bool> {
        let result = sqlx::query(AssertSqlSafe(self.sql.mark_dead.as_str()))
            .bind(id)
            .bind(&claim.token)
            .bind(i32::from(count_attempt))
            .bind(reason)
            .execute(&self.pool)
            .await
            .map_err(Error::repository("mark dead"))?;
        Ok(result.rows_affected() == 1)
    }

    async fn release(&self, claim: &Claim, ids: &[&str]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let result = sqlx::query(AssertSqlSafe(self.sql.release.as_str()))
            .bind(json_array(&ids)?)
            .bind(&claim.token)
            .execute(&self.pool)
            .await
            .map_err(Error::repository("release"))?;
        Ok(result.rows_affected())
    }

    async fn retry(&self, id: &str) -> Result<bool> {
        let result = sqlx::query(AssertSqlSafe(self.sql.retry.as_str()))
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(Error::repository("retry"))?;
        Ok(result.rows_affected() == 1)
    }

    async fn next_due_in(&self) -> Result<Option<Duration>> {
        let seconds: Option<f64> = sqlx::query_scalar(AssertSqlSafe(self.sql.next_due_in.as_str()))
            .fetch_one(&self.pool)
            .await
            .map_err(Error::repository("next due"))?;
        Ok(seconds.map(|s| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::ZERO)))
    }
}
