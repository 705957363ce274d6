//! [`OutboxRepository`] on SQLite.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, Row, SqlitePool};

use super::repository::{
    Claim, Dispatched, Failure, FailureOutcome, KNOWN_STATES, MAX_SQL_DURATION, OutboxRepository,
    PoisonRow, RetryOutcome,
};
use crate::error::{Error, Result};
use crate::record::new_id;
use crate::sql::COLUMNS;
use crate::sqlite::{CLAIM_COLUMN_COUNT, CLAIM_COLUMNS, decode_claimed};
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
    /// The claim, split around its `LIMIT` (see [`ClaimSql`]).
    claim: ClaimSql,
    /// Reads claimed rows column by column (rows whose packed values were unreadable).
    read_claimed: Arc<str>,
    mark_dispatched: Arc<str>,
    mark_dispatched_with_outcomes: Arc<str>,
    mark_failed: Arc<str>,
    mark_dead: Arc<str>,
    mark_failures: Arc<str>,
    extend_lease: Arc<str>,
    release: Arc<str>,
    retry: Arc<str>,
    retry_refusal: Arc<str>,
    sweep_unfinishable: Arc<str>,
    next_due_in: Arc<str>,
}

/// The claim statement, built per batch size.
///
/// The limit is written into the SQL as a literal: SQLite re-prepares a statement whose
/// `LIMIT` is a bound parameter every time that parameter is bound (the planner may use the
/// value), which for a claim means parsing and planning it again on every batch. A
/// dispatcher uses one batch size, so the texts for the last limit are kept.
#[derive(Debug)]
struct ClaimSql {
    /// Up to and including `LIMIT `.
    head: String,
    /// After the limit: `RETURNING` the columns.
    tail: String,
    /// `tail` plus the cutoff the claim used (for the first claim of a wave).
    tail_with_cutoff: String,
    /// The texts for the last limit.
    last: Mutex<Option<ClaimTexts>>,
}

/// The claim statements for one limit.
#[derive(Debug)]
struct ClaimTexts {
    limit: i64,
    plain: Arc<str>,
    with_cutoff: Arc<str>,
}

impl ClaimSql {
    /// The claim for `limit` rows; `with_cutoff` also returns the cutoff as `claim_cutoff`.
    fn get(&self, limit: i64, with_cutoff: bool) -> Arc<str> {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let texts = match &mut *last {
            Some(texts) if texts.limit == limit => texts,
            slot => slot.insert(ClaimTexts {
                limit,
                plain: format!("{}{limit}{}", self.head, self.tail).into(),
                with_cutoff: format!("{}{limit}{}", self.head, self.tail_with_cutoff).into(),
            }),
        };
        Arc::clone(if with_cutoff {
            &texts.with_cutoff
        } else {
            &texts.plain
        })
    }
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
            // ?1 lease modifier ('+30.000 seconds'), ?2 token, ?3 cutoff or NULL; the limit is
            // a literal. Without statistics SQLite prefers the (state, next_attempt_at) index
            // and sorts every undispatched row per claim; the partial claim index yields them
            // in order.
            claim: ClaimSql {
                head: format!(
                    "UPDATE {o} SET claimed_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?1), claim_token = ?2 \
                     WHERE id IN (SELECT id FROM {o} INDEXED BY {o}_claim_idx \
                     WHERE state IN ('pending', 'failed') \
                     AND (next_attempt_at IS NULL OR next_attempt_at <= COALESCE(?3, {NOW})) \
                     AND (claimed_until IS NULL OR claimed_until <= {NOW}) \
                     ORDER BY created_at, id LIMIT "
                ),
                tail: format!(") RETURNING {CLAIM_COLUMNS}"),
                tail_with_cutoff: format!(
                    ") RETURNING {CLAIM_COLUMNS}, COALESCE(?3, {NOW}) AS claim_cutoff"
                ),
                last: Mutex::new(None),
            },
            // ?1 JSON array of ids, ?2 token.
            read_claimed: format!(
                "SELECT {COLUMNS} FROM {o} \
                 WHERE claim_token = ?2 AND id IN (SELECT value FROM json_each(?1))"
            )
            .into(),
            // ?1 JSON array of ids, ?2 token.
            mark_dispatched: format!(
                "UPDATE {o} SET state = 'dispatched', updated_at = {NOW}, next_attempt_at = NULL, \
                 last_error = NULL, claimed_until = NULL, claim_token = NULL, outcome = NULL \
                 WHERE claim_token = ?2 AND id IN (SELECT value FROM json_each(?1))"
            )
            .into(),
            // ?1 JSON array of [id, outcome-or-null] pairs, ?2 token.
            mark_dispatched_with_outcomes: format!(
                "UPDATE {o} SET state = 'dispatched', updated_at = {NOW}, next_attempt_at = NULL, \
                 last_error = NULL, claimed_until = NULL, claim_token = NULL, \
                 outcome = (SELECT NULLIF(d.value -> '$[1]', 'null') FROM json_each(?1) AS d \
                            WHERE d.value ->> '$[0]' = {o}.id) \
                 WHERE claim_token = ?2 AND id IN (SELECT value ->> '$[0]' FROM json_each(?1))"
            )
            .into(),
            mark_failed: format!(
                "UPDATE {o} SET state = 'failed', attempts = attempts + 1, updated_at = {NOW}, \
                 next_attempt_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?3), last_error = ?4, \
                 claimed_until = NULL, claim_token = NULL \
                 WHERE id = ?1 AND claim_token = ?2"
            )
            .into(),
            mark_dead: format!(
                "UPDATE {o} SET state = 'dead', attempts = attempts + ?3, updated_at = {NOW}, \
                 next_attempt_at = NULL, last_error = ?4, claimed_until = NULL, claim_token = NULL \
                 WHERE id = ?1 AND claim_token = ?2"
            )
            .into(),
            // ?1 JSON array of [id, error, delay modifier or null (dead), attempts to add],
            // ?2 token.
            mark_failures: format!(
                "UPDATE {o} SET \
                 state = CASE WHEN f.value ->> '$[2]' IS NULL THEN 'dead' ELSE 'failed' END, \
                 attempts = attempts + (f.value ->> '$[3]'), updated_at = {NOW}, \
                 next_attempt_at = CASE WHEN f.value ->> '$[2]' IS NULL THEN NULL \
                   ELSE strftime('%Y-%m-%dT%H:%M:%fZ', 'now', f.value ->> '$[2]') END, \
                 last_error = f.value ->> '$[1]', claimed_until = NULL, claim_token = NULL \
                 FROM json_each(?1) AS f \
                 WHERE {o}.id = f.value ->> '$[0]' AND {o}.claim_token = ?2 \
                 RETURNING {o}.id"
            )
            .into(),
            // ?1 JSON array of ids, ?2 token, ?3 lease modifier.
            extend_lease: format!(
                "UPDATE {o} SET claimed_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?3) \
                 WHERE claim_token = ?2 AND id IN (SELECT value FROM json_each(?1))"
            )
            .into(),
            release: format!(
                "UPDATE {o} SET claimed_until = NULL, claim_token = NULL \
                 WHERE claim_token = ?2 AND id IN (SELECT value FROM json_each(?1))"
            )
            .into(),
            // Run in one `BEGIN IMMEDIATE` transaction with `retry_refusal`: a row is reset
            // only if no live lease holds it (the claim's own test: token set and
            // `claimed_until` after now).
            retry: format!(
                "UPDATE {o} SET state = 'pending', attempts = 0, updated_at = {NOW}, next_attempt_at = NULL, \
                 claimed_until = NULL, claim_token = NULL \
                 WHERE id = ?1 AND state IN ('failed', 'dead') \
                 AND NOT (claim_token IS NOT NULL AND claimed_until IS NOT NULL AND claimed_until > {NOW})"
            )
            .into(),
            // Why `retry` changed nothing: the row's state (as text) and lease, if any.
            retry_refusal: format!(
                "SELECT CASE typeof(state) WHEN 'text' THEN CAST(state AS BLOB) \
                 ELSE CAST('<' || typeof(state) || '>' AS BLOB) END, \
                 CASE WHEN claim_token IS NOT NULL AND claimed_until > {NOW} THEN claimed_until END \
                 FROM {o} WHERE id = ?1"
            )
            .into(),
            // Rows no claim can finish: unknown states (any row), and open rows whose id is
            // NULL or not text (never claimed, or claimed but never markable by id) or whose
            // retry or lease time is not a time (never due). Text comes back as bytes: a
            // stored value need not be UTF-8.
            sweep_unfinishable: format!(
                "UPDATE {o} SET state = 'dead', updated_at = {NOW}, next_attempt_at = NULL, \
                 claimed_until = NULL, claim_token = NULL, last_error = CASE \
                 WHEN typeof(state) <> 'text' THEN 'state is ' || typeof(state) || ', not text' \
                 WHEN state NOT IN ({KNOWN_STATES}) THEN 'unknown state ' || json_quote(substr(state, 1, 100)) \
                 WHEN id IS NULL THEN 'id is NULL (SQLite rowid ' || rowid || ')' \
                 WHEN typeof(id) <> 'text' THEN 'id is ' || typeof(id) || ', not text (SQLite rowid ' || rowid || ')' \
                 WHEN next_attempt_at IS NOT NULL AND julianday(next_attempt_at) IS NULL \
                 THEN 'next_attempt_at is not a time: ' || quote(substr(next_attempt_at, 1, 100)) \
                 ELSE 'claimed_until is not a time: ' || quote(substr(claimed_until, 1, 100)) END \
                 WHERE typeof(state) <> 'text' OR state NOT IN ({KNOWN_STATES}) \
                 OR (state IN ('pending', 'failed') AND (typeof(id) <> 'text' \
                 OR (next_attempt_at IS NOT NULL AND julianday(next_attempt_at) IS NULL) \
                 OR (claimed_until IS NOT NULL AND julianday(claimed_until) IS NULL))) \
                 RETURNING CASE typeof(id) WHEN 'text' THEN CAST(id AS BLOB) ELSE X'' END, \
                 CAST(last_error AS BLOB)"
            )
            .into(),
            next_due_in: format!(
                "SELECT (julianday(min(max(COALESCE(next_attempt_at, {NOW}), COALESCE(claimed_until, {NOW})))) \
                 - julianday({NOW})) * 86400.0 \
                 FROM {o} WHERE state IN ('pending', 'failed')"
            )
            .into(),
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

    /// Reads the claimed rows `ids`, whose packed values could not be decoded, column by
    /// column, adding each to `claim` as a message or, with the exact reason, a poison row.
    async fn read_claimed(&self, claim: &mut Claim, ids: &[String]) -> Result<()> {
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.read_claimed)))
            .bind(json_array(&ids)?)
            .bind(&claim.token)
            .fetch_all(&self.pool)
            .await
            .map_err(Error::repository("claim"))?;
        // A row deleted by hand since the claim is simply not there any more.
        for row in &rows {
            match crate::sqlite::decode(row) {
                Ok(message) => claim.push_message(message),
                Err(error) => claim.poisoned.push(PoisonRow {
                    id: row.try_get(0).unwrap_or_default(),
                    reason: error.to_string(),
                }),
            }
        }
        Ok(())
    }
}

/// An SQLite date modifier adding `duration`: `+1.500 seconds`. Durations are capped at
/// [`MAX_SQL_DURATION`] (about 100 years): SQLite's date functions answer NULL past the year
/// 9999, and a NULL lease or retry time would make the row claimable at once.
fn modifier(duration: Duration) -> String {
    format!(
        "+{:.3} seconds",
        duration.min(MAX_SQL_DURATION).as_secs_f64()
    )
}

fn lossy(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
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
        // The first claim of a wave learns the cutoff (the database's clock) from the claim
        // itself; later claims pass it in and need not read it back.
        let sql = self.sql.claim.get(limit, cutoff.is_none());
        // One autocommit UPDATE: SQLite takes the write lock when the statement starts, so
        // the claim is atomic and concurrent claimers queue on the busy timeout (the same
        // guarantee as BEGIN IMMEDIATE, in one round trip).
        let rows = sqlx::query(AssertSqlSafe(sql))
            .bind(modifier(lease))
            .bind(&token)
            .bind(cutoff.map(format_timestamp))
            .fetch_all(&self.pool)
            .await
            .map_err(Error::repository("claim"))?;
        let Some(first) = rows.first() else {
            return Ok(Claim::empty(token, cutoff.unwrap_or_else(Utc::now)));
        };
        let cutoff = match cutoff {
            Some(cutoff) => cutoff,
            None => {
                let text: &str = first
                    .try_get(CLAIM_COLUMN_COUNT)
                    .map_err(|e| Error::decode("", "claim_cutoff", e))?;
                parse_timestamp(text)
                    .map_err(|e| Error::decode("", "claim_cutoff", format!("{text:?}: {e}")))?
            }
        };
        let mut claim = Claim::empty(token, cutoff);
        // Rows whose packed values are unusual, to be read column by column.
        let mut unread = Vec::new();
        for row in &rows {
            match decode_claimed(row) {
                Ok(Some(message)) => claim.push_message(message),
                // decode_claimed read the id before answering None.
                Ok(None) => unread.push(row.try_get::<String, _>(0).unwrap_or_default()),
                Err(error) => claim.poisoned.push(PoisonRow {
                    id: row.try_get(0).unwrap_or_default(),
                    reason: error.to_string(),
                }),
            }
        }
        drop(rows);
        if !unread.is_empty() {
            self.read_claimed(&mut claim, &unread).await?;
        }
        // Dispatch order (as `Claim::extend` sorts): RETURNING does not keep the claim
        // subquery's order.
        claim
            .messages
            .sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
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
        let result = sqlx::query(AssertSqlSafe(Arc::clone(sql)))
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
        let result = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.mark_failed)))
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
        let result = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.mark_dead)))
            .bind(id)
            .bind(&claim.token)
            .bind(i32::from(count_attempt))
            .bind(reason)
            .execute(&self.pool)
            .await
            .map_err(Error::repository("mark dead"))?;
        Ok(result.rows_affected() == 1)
    }

    async fn mark_failures(&self, claim: &Claim, failures: &[Failure]) -> Result<Vec<String>> {
        if failures.is_empty() {
            return Ok(Vec::new());
        }
        let entries: Vec<(&str, &str, Option<String>, i32)> = failures
            .iter()
            .map(|f| match f.outcome {
                FailureOutcome::Retry { after } => {
                    (f.id.as_str(), f.error.as_str(), Some(modifier(after)), 1)
                }
                FailureOutcome::Dead { count_attempt } => (
                    f.id.as_str(),
                    f.error.as_str(),
                    None,
                    i32::from(count_attempt),
                ),
            })
            .collect();
        sqlx::query_scalar(AssertSqlSafe(Arc::clone(&self.sql.mark_failures)))
            .bind(json_array(&entries)?)
            .bind(&claim.token)
            .fetch_all(&self.pool)
            .await
            .map_err(Error::repository("mark failures"))
    }

    fn extends_leases(&self) -> bool {
        true
    }

    async fn extend_lease(&self, claim: &Claim, ids: &[&str], lease: Duration) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let result = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.extend_lease)))
            .bind(json_array(&ids)?)
            .bind(&claim.token)
            .bind(modifier(lease))
            .execute(&self.pool)
            .await
            .map_err(Error::repository("extend lease"))?;
        Ok(result.rows_affected())
    }

    async fn release(&self, claim: &Claim, ids: &[&str]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let result = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.release)))
            .bind(json_array(&ids)?)
            .bind(&claim.token)
            .execute(&self.pool)
            .await
            .map_err(Error::repository("release"))?;
        Ok(result.rows_affected())
    }

    async fn retry(&self, id: &str) -> Result<RetryOutcome> {
        // BEGIN IMMEDIATE takes the write lock first: no claim can come between the update
        // and the read of why it changed nothing.
        let mut tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(Error::repository("retry"))?;
        let result = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.retry)))
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(Error::repository("retry"))?;
        let outcome = if result.rows_affected() > 0 {
            RetryOutcome::Retried
        } else {
            let found: Option<(Vec<u8>, Option<String>)> =
                sqlx::query_as(AssertSqlSafe(Arc::clone(&self.sql.retry_refusal)))
                    .bind(id)
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(Error::repository("retry"))?;
            match found {
                None => RetryOutcome::NotFound,
                Some((state, until)) => {
                    let state = lossy(state);
                    match until {
                        Some(until) if matches!(state.as_str(), "failed" | "dead") => {
                            RetryOutcome::Leased {
                                until: parse_timestamp(&until).map_err(|e| {
                                    Error::decode(id, "claimed_until", format!("{until:?}: {e}"))
                                })?,
                            }
                        }
                        _ => RetryOutcome::NotRetryable { state },
                    }
                }
            }
        };
        tx.commit().await.map_err(Error::repository("retry"))?;
        Ok(outcome)
    }

    async fn sweep_unfinishable(&self) -> Result<Vec<PoisonRow>> {
        let rows: Vec<(Vec<u8>, Option<Vec<u8>>)> =
            sqlx::query_as(AssertSqlSafe(Arc::clone(&self.sql.sweep_unfinishable)))
                .fetch_all(&self.pool)
                .await
                .map_err(Error::repository("sweep unfinishable rows"))?;
        Ok(rows
            .into_iter()
            .map(|(id, reason)| PoisonRow {
                id: lossy(id),
                reason: reason.map(lossy).unwrap_or_default(),
            })
            .collect())
    }

    async fn next_due_in(&self) -> Result<Option<Duration>> {
        let seconds: Option<f64> =
            sqlx::query_scalar(AssertSqlSafe(Arc::clone(&self.sql.next_due_in)))
                .fetch_one(&self.pool)
                .await
                .map_err(Error::repository("next due"))?;
        Ok(seconds.map(super::repository::due_in))
    }
}
