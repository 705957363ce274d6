//! [`OutboxRepository`] on PostgreSQL.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, PgPool, Row};

use super::repository::{
    Claim, Dispatched, Failure, FailureOutcome, KNOWN_STATES, MAX_SQL_DURATION, OutboxRepository,
    PoisonRow, RetryOutcome,
};
use crate::error::{Error, Result};
use crate::record::new_id;
use crate::sql::COLUMNS;
use crate::tables::OutboxTables;

/// The outbox repository on PostgreSQL: claims with `FOR UPDATE SKIP LOCKED` in a single
/// statement, under a lease and a fencing token, using the server's clock.
///
/// The claim is `UPDATE … WHERE id = ANY(ARRAY(SELECT id … ORDER BY created_at, id LIMIT n
/// FOR UPDATE SKIP LOCKED)) RETURNING …`: the `ARRAY(…)` form makes the planner update the
/// claimed rows through the primary key, where `id IN (SELECT …)` may become a hash join over
/// a full scan of the table.
///
/// The claim commits with `synchronous_commit = off` (set for that statement's transaction
/// only): a lease is bookkeeping, and losing one in a server crash only makes its rows
/// claimable again, so the claim need not wait for the WAL flush. Marks stay synchronous:
/// a row marked `dispatched` stays marked. The dispatcher [overlaps
/// batches](OutboxRepository::overlaps_batches) on Postgres: while one batch is published,
/// the next is claimed and the previous one marked.
///
/// Needs migration version 2 ([`migrate`](crate::migrate())).
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use trellis_outbox::{OutboxRepository, PgOutboxRepository};
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), trellis_outbox::Error> {
/// let repository = PgOutboxRepository::new(pool);
/// let claim = repository.claim_due(100, Duration::from_secs(30), None).await?;
/// for message in &claim.messages {
///     println!("{} -> {}", message.id, message.subject);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PgOutboxRepository {
    pool: PgPool,
    sql: Arc<Statements>,
}

#[derive(Debug)]
struct Statements {
    claim: String,
    mark_dispatched: String,
    mark_dispatched_with_outcomes: String,
    mark_failed: String,
    mark_dead: String,
    mark_failures: String,
    extend_lease: String,
    release: String,
    retry: String,
    sweep_unfinishable: String,
    next_due_in: String,
}

impl PgOutboxRepository {
    /// A repository on the default tables.
    pub fn new(pool: PgPool) -> Self {
        Self::with_tables(pool, &OutboxTables::default())
    }

    /// A repository on `tables`.
    pub fn with_tables(pool: PgPool, tables: &OutboxTables) -> Self {
        let o = tables.outbox();
        let sql = Statements {
            claim: format!(
                "UPDATE {o} SET claimed_until = now() + make_interval(secs => $2), claim_token = $3 \
                 WHERE id = ANY(ARRAY(SELECT id FROM {o} \
                 WHERE state IN ('pending', 'failed') \
                 AND (next_attempt_at IS NULL OR next_attempt_at <= COALESCE($4, now())) \
                 AND (claimed_until IS NULL OR claimed_until <= now()) \
                 ORDER BY created_at, id LIMIT $1 FOR UPDATE SKIP LOCKED)) \
                 AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL \
                 RETURNING {COLUMNS}, COALESCE($4, now()) AS claim_cutoff"
            ),
            // Events have no outcome: the plain form saves the UNNEST join and the jsonb cast.
            mark_dispatched: format!(
                "UPDATE {o} SET state = 'dispatched', updated_at = now(), next_attempt_at = NULL, \
                 last_error = NULL, outcome = NULL, claimed_until = NULL, claim_token = NULL \
                 WHERE id = ANY($1) AND claim_token = $2"
            ),
            mark_dispatched_with_outcomes: format!(
                "UPDATE {o} AS o SET state = 'dispatched', updated_at = now(), next_attempt_at = NULL, \
                 last_error = NULL, outcome = d.outcome::jsonb, claimed_until = NULL, claim_token = NULL \
                 FROM UNNEST($1::text[], $2::text[]) AS d(id, outcome) \
                 WHERE o.id = d.id AND o.claim_token = $3"
            ),
            mark_failed: format!(
                "UPDATE {o} SET state = 'failed', attempts = attempts + 1, updated_at = now(), \
                 next_attempt_at = now() + make_interval(secs => $3), last_error = $4, \
                 claimed_until = NULL, claim_token = NULL \
                 WHERE id = $1 AND claim_token = $2"
            ),
            mark_dead: format!(
                "UPDATE {o} SET state = 'dead', attempts = attempts + $3, updated_at = now(), \
                 next_attempt_at = NULL, last_error = $4, claimed_until = NULL, claim_token = NULL \
                 WHERE id = $1 AND claim_token = $2"
            ),
            // $1 ids, $2 errors, $3 retry delays in seconds (NULL: dead), $4 attempts to add,
            // $5 token.
            mark_failures: format!(
                "UPDATE {o} AS o SET \
                 state = CASE WHEN f.delay IS NULL THEN 'dead' ELSE 'failed' END, \
                 attempts = LEAST(o.attempts::int8 + f.add, 2147483647)::int4, updated_at = now(), \
                 next_attempt_at = now() + make_interval(secs => f.delay), last_error = f.error, \
                 claimed_until = NULL, claim_token = NULL \
                 FROM UNNEST($1::text[], $2::text[], $3::float8[], $4::int4[]) AS f(id, error, delay, add) \
                 WHERE o.id = f.id AND o.claim_token = $5 \
                 RETURNING o.id"
            ),
            extend_lease: format!(
                "UPDATE {o} SET claimed_until = now() + make_interval(secs => $3) \
                 WHERE id = ANY($1) AND claim_token = $2"
            ),
            release: format!(
                "UPDATE {o} SET claimed_until = NULL, claim_token = NULL \
                 WHERE id = ANY($1) AND claim_token = $2"
            ),
            // One statement: `found` locks the row (FOR UPDATE reads its latest committed
            // version) and decides; `reset` updates it only if no live lease holds it; the
            // result says what was found either way (no result: no such row).
            retry: format!(
                "WITH found AS (SELECT id, state, claimed_until, \
                 (claim_token IS NOT NULL AND claimed_until IS NOT NULL AND claimed_until > now()) AS leased \
                 FROM {o} WHERE id = $1 FOR UPDATE), \
                 reset AS (UPDATE {o} AS o SET state = 'pending', attempts = 0, updated_at = now(), \
                 next_attempt_at = NULL, claimed_until = NULL, claim_token = NULL \
                 FROM found WHERE o.id = found.id AND found.state IN ('failed', 'dead') AND NOT found.leased \
                 RETURNING o.id) \
                 SELECT found.state, found.claimed_until, EXISTS (SELECT 1 FROM reset) AS retried \
                 FROM found"
            ),
            // Rows no claim can finish: unknown states, and open rows never due or never
            // claimable again.
            sweep_unfinishable: format!(
                "UPDATE {o} SET state = 'dead', updated_at = now(), next_attempt_at = NULL, \
                 claimed_until = NULL, claim_token = NULL, \
                 last_error = CASE WHEN state IS NULL THEN 'state is NULL' \
                 WHEN state NOT IN ({KNOWN_STATES}) THEN 'unknown state ' || to_json(left(state, 100))::text \
                 WHEN next_attempt_at = 'infinity' THEN 'next_attempt_at is infinity (never due)' \
                 ELSE 'claimed_until is infinity (never claimable)' END \
                 WHERE state IS NULL OR state NOT IN ({KNOWN_STATES}) \
                 OR (state IN ('pending', 'failed') \
                 AND (next_attempt_at = 'infinity' OR claimed_until = 'infinity')) \
                 RETURNING id, last_error"
            ),
            // Clamped to [now, now + 100 years]: an infinite time (written by another
            // writer) cannot be subtracted from now() and would fail every call.
            next_due_in: format!(
                "SELECT CASE WHEN at IS NOT NULL THEN EXTRACT(EPOCH FROM \
                 (LEAST(GREATEST(at, now()), now() + interval '100 years') - now()))::float8 END \
                 FROM (SELECT min(GREATEST(COALESCE(next_attempt_at, now()), COALESCE(claimed_until, now()))) AS at \
                 FROM {o} WHERE state IN ('pending', 'failed')) AS due"
            ),
        };
        Self {
            pool,
            sql: Arc::new(sql),
        }
    }

    /// The pool this repository uses.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// Seconds for `make_interval`, capped at [`MAX_SQL_DURATION`]: a longer lease or retry
/// delay (say `Duration::MAX`) would overflow the interval and fail the statement.
fn secs(duration: Duration) -> f64 {
    duration.min(MAX_SQL_DURATION).as_secs_f64()
}

impl OutboxRepository for PgOutboxRepository {
    async fn claim_due(
        &self,
        limit: usize,
        lease: Duration,
        cutoff: Option<DateTime<Utc>>,
    ) -> Result<Claim> {
        let token = new_id();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = sqlx::query(AssertSqlSafe(self.sql.claim.as_str()))
            .bind(limit)
            .bind(secs(lease))
            .bind(&token)
            .bind(cutoff)
            .fetch_all(&self.pool)
            .await
            .map_err(Error::repository("claim"))?;
        let Some(first) = rows.first() else {
            return Ok(Claim::empty(token, cutoff.unwrap_or_else(Utc::now)));
        };
        let cutoff: DateTime<Utc> = first
            .try_get("claim_cutoff")
            .map_err(|e| Error::decode("", "claim_cutoff", e))?;
        let mut claim = Claim::empty(token, cutoff);
        claim.extend(&rows, crate::postgres::decode, |row| row.try_get("id").ok());
        Ok(claim)
    }

    async fn mark_dispatched(&self, claim: &Claim, rows: &[Dispatched]) -> Result<u64> {
        if rows.is_empty() {
            return Ok(0);
        }
        let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
        let query = if rows.iter().all(|r| r.outcome.is_none()) {
            sqlx::query(AssertSqlSafe(self.sql.mark_dispatched.as_str()))
                .bind(ids)
                .bind(&claim.token)
        } else {
            let outcomes: Vec<Option<String>> = rows
                .iter()
                .map(|r| r.outcome.as_ref().map(serde_json::Value::to_string))
                .collect();
            sqlx::query(AssertSqlSafe(
                self.sql.mark_dispatched_with_outcomes.as_str(),
            ))
            .bind(ids)
            .bind(outcomes)
            .bind(&claim.token)
        };
        let result = query
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
            .bind(secs(retry_after))
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

    async fn mark_failures(&self, claim: &Claim, failures: &[Failure]) -> Result<Vec<String>> {
        if failures.is_empty() {
            return Ok(Vec::new());
        }
        let mut ids = Vec::with_capacity(failures.len());
        let mut errors = Vec::with_capacity(failures.len());
        let mut delays = Vec::with_capacity(failures.len());
        let mut adds = Vec::with_capacity(failures.len());
        for failure in failures {
            ids.push(failure.id.as_str());
            errors.push(failure.error.as_str());
            let (delay, add) = match failure.outcome {
                FailureOutcome::Retry { after } => (Some(secs(after)), 1),
                FailureOutcome::Dead { count_attempt } => (None, i32::from(count_attempt)),
            };
            delays.push(delay);
            adds.push(add);
        }
        sqlx::query_scalar(AssertSqlSafe(self.sql.mark_failures.as_str()))
            .bind(ids)
            .bind(errors)
            .bind(delays)
            .bind(adds)
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
        let result = sqlx::query(AssertSqlSafe(self.sql.extend_lease.as_str()))
            .bind(ids)
            .bind(&claim.token)
            .bind(secs(lease))
            .execute(&self.pool)
            .await
            .map_err(Error::repository("extend lease"))?;
        Ok(result.rows_affected())
    }

    async fn release(&self, claim: &Claim, ids: &[&str]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let result = sqlx::query(AssertSqlSafe(self.sql.release.as_str()))
            .bind(ids)
            .bind(&claim.token)
            .execute(&self.pool)
            .await
            .map_err(Error::repository("release"))?;
        Ok(result.rows_affected())
    }

    async fn retry(&self, id: &str) -> Result<RetryOutcome> {
        let row = sqlx::query(AssertSqlSafe(self.sql.retry.as_str()))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(Error::repository("retry"))?;
        let Some(row) = row else {
            return Ok(RetryOutcome::NotFound);
        };
        let retried: bool = row
            .try_get("retried")
            .map_err(|e| Error::decode(id, "retried", e))?;
        if retried {
            return Ok(RetryOutcome::Retried);
        }
        let state: Option<String> = row
            .try_get("state")
            .map_err(|e| Error::decode(id, "state", e))?;
        let state = state.unwrap_or_default();
        if !matches!(state.as_str(), "failed" | "dead") {
            return Ok(RetryOutcome::NotRetryable { state });
        }
        let until: Option<DateTime<Utc>> = row
            .try_get("claimed_until")
            .map_err(|e| Error::decode(id, "claimed_until", e))?;
        match until {
            Some(until) => Ok(RetryOutcome::Leased { until }),
            // Not reached: a failed or dead row is refused only under a lease.
            None => Ok(RetryOutcome::NotRetryable { state }),
        }
    }

    async fn sweep_unfinishable(&self) -> Result<Vec<PoisonRow>> {
        let rows: Vec<(String, Option<String>)> =
            sqlx::query_as(AssertSqlSafe(self.sql.sweep_unfinishable.as_str()))
                .fetch_all(&self.pool)
                .await
                .map_err(Error::repository("sweep unfinishable rows"))?;
        Ok(rows
            .into_iter()
            .map(|(id, reason)| PoisonRow {
                id,
                reason: reason.unwrap_or_default(),
            })
            .collect())
    }

    async fn next_due_in(&self) -> Result<Option<Duration>> {
        let seconds: Option<f64> = sqlx::query_scalar(AssertSqlSafe(self.sql.next_due_in.as_str()))
            .fetch_one(&self.pool)
            .await
            .map_err(Error::repository("next due"))?;
        Ok(seconds.map(super::repository::due_in))
    }

    fn overlaps_batches(&self) -> bool {
        true
    }
}
