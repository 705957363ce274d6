//! The PostgreSQL steps of [`SqlOutboxRepository`](crate::SqlOutboxRepository): the claim with
//! `FOR UPDATE SKIP LOCKED`, the batched failure marks over `UNNEST` arrays, and retry; what
//! the shared steps bind (arrays) and read (text) on Postgres.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{Postgres, Row};

use super::sql::PgOnly;
use crate::dispatch::{Claim, Dispatched, Failure, FailureOutcome, RetryOutcome};
use crate::driver::sealed::{Backend, ClaimDue, Fenced, On, RepositoryBackend};
use crate::driver::sql_seconds;
use crate::error::{Error, Result};
use crate::sql::statement;
use crate::tables::OutboxTables;

impl RepositoryBackend for Postgres {
    type Only = PgOnly;
    /// Seconds, for `make_interval(secs => …)`.
    type Interval = f64;
    type Ids<'a> = &'a [&'a str];
    /// One per id, in the ids' order.
    type Outcomes = Vec<Option<String>>;
    type Text = String;

    // The claim skips locked rows, and claim, publish and mark touch disjoint rows.
    const OVERLAPS_BATCHES: bool = true;

    fn only(tables: &OutboxTables) -> PgOnly {
        PgOnly::new(tables)
    }

    fn interval(duration: Duration) -> f64 {
        sql_seconds(duration)
    }

    fn ids<'a>(ids: &'a [&'a str]) -> Result<&'a [&'a str]> {
        Ok(ids)
    }

    fn outcomes<'a>(
        ids: &'a [&'a str],
        rows: &'a [Dispatched],
    ) -> Result<(&'a [&'a str], Option<Vec<Option<String>>>)> {
        let outcomes = rows
            .iter()
            .map(|r| r.outcome.as_ref().map(serde_json::Value::to_string))
            .collect();
        Ok((ids, Some(outcomes)))
    }

    fn text(text: String) -> String {
        text
    }

    async fn claim_due(on: On<'_, Self>, due: ClaimDue) -> Result<Claim> {
        let rows = sqlx::query(statement(&on.only.claim))
            .bind(due.limit)
            .bind(sql_seconds(due.lease))
            .bind(&due.token)
            .bind(due.cutoff)
            .bind(on.beside_upstream)
            .bind(&*due.published)
            .fetch_all(on.pool)
            .await
            .map_err(Error::repository("claim"))?;
        let Some(first) = rows.first() else {
            return Ok(due.nothing_due());
        };
        let cutoff: DateTime<Utc> = first
            .try_get("claim_cutoff")
            .map_err(|e| Error::decode("", "claim_cutoff", e))?;
        let mut claim = Claim::empty(due.token, cutoff);
        claim.extend(&rows, Self::decode, |row| row.try_get("id").ok());
        // A keyed row without a sequence is unordered (the claim's tests treat it so too).
        let keys = rows
            .iter()
            .filter_map(|row| {
                let key: Option<String> = row.try_get("ordering_key").ok()?;
                let seq: Option<i64> = row.try_get("ordering_seq").ok()?;
                Some((row.try_get("id").ok()?, key?, seq?))
            })
            .collect();
        claim.order_runs(keys);
        Ok(claim)
    }

    async fn mark_failures(on: Fenced<'_, Self>, failures: &[Failure]) -> Result<Vec<String>> {
        let mut ids = Vec::with_capacity(failures.len());
        let mut errors = Vec::with_capacity(failures.len());
        let mut delays = Vec::with_capacity(failures.len());
        let mut adds = Vec::with_capacity(failures.len());
        for failure in failures {
            ids.push(failure.id.as_str());
            errors.push(failure.error.as_str());
            let (delay, add) = match failure.outcome {
                FailureOutcome::Retry { after } => (Some(sql_seconds(after)), 1),
                FailureOutcome::Dead { count_attempt } => (None, i32::from(count_attempt)),
            };
            delays.push(delay);
            adds.push(add);
        }
        sqlx::query_scalar(statement(&on.sql.text.mark_failures))
            .bind(ids)
            .bind(errors)
            .bind(delays)
            .bind(adds)
            .bind(on.token)
            .fetch_all(on.pool)
            .await
            .map_err(Error::repository("mark failures"))
    }

    async fn retry(on: On<'_, Self>, id: &str) -> Result<RetryOutcome> {
        let row = sqlx::query(statement(&on.sql.text.retry))
            .bind(id)
            .fetch_optional(on.pool)
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
}
