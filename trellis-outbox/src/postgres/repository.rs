//! The PostgreSQL steps of [`SqlOutboxRepository`](crate::SqlOutboxRepository): the claim with
//! `FOR UPDATE SKIP LOCKED`, the batched failure marks over `UNNEST` arrays, and retry; what
//! the shared steps bind (arrays) and read (text) on Postgres.

use std::sync::atomic::Ordering;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{Postgres, Row};

use super::sql::PgOnly;
use super::time::PgTime;
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
        let only = on.only;
        let mut rows = if only.keyed.load(Ordering::Relaxed) {
            Vec::new()
        } else {
            let mut rows = claim_query(&only.claim_unkeyed, &on, &due)
                .fetch_all(on.pool)
                .await
                .map_err(Error::repository("claim"))?;
            // Nothing claimed: its one row has NULL claimed columns (a claimed row always has
            // an id), and says whether keyed rows wait.
            if let [answer] = rows.as_slice()
                && matches!(answer.try_get::<Option<String>, _>("id"), Ok(None))
            {
                if !answer.try_get::<bool, _>("keyed").unwrap_or(true) {
                    return Ok(due.nothing_due());
                }
                rows.clear();
            }
            rows
        };
        // Keyed rows are waiting (or may have been written since the last claim saw none):
        // the claim of both kinds.
        if rows.is_empty() {
            let cursor = only
                .cursor
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone();
            rows = claim_keyed(&on, &due, cursor)
                .await
                .map_err(Error::repository("claim"))?;
        }
        let Some(first) = rows.first() else {
            return Ok(due.nothing_due());
        };
        let cutoff: DateTime<Utc> = first
            .try_get("claim_cutoff")
            .map_err(|e| Error::decode("", "claim_cutoff", e))?;
        // A NULL (not reached: EXISTS is never NULL) keeps the claim of both kinds.
        let keyed = first.try_get::<bool, _>("keyed").unwrap_or(true);
        only.keyed.store(keyed, Ordering::Relaxed);
        let mut claim = Claim::empty(due.token, cutoff);
        claim.extend(&rows, Self::decode, |row| row.try_get("id").ok());
        // A keyed row without a sequence is unordered (the claim's tests treat it so too).
        let keys: Vec<(String, String, i64)> = rows
            .iter()
            .filter_map(|row| {
                let key: Option<String> = row.try_get("ordering_key").ok()?;
                let seq: Option<i64> = row.try_get("ordering_seq").ok()?;
                Some((row.try_get("id").ok()?, key?, seq?))
            })
            .collect();
        let mut cursor = only
            .cursor
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *cursor = next_cursor(
            cursor.as_deref(),
            keys.iter().map(|(_, key, _)| key.as_str()),
        )
        .map(str::to_owned);
        drop(cursor);
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

    async fn wake(on: On<'_, Self>) -> sqlx::Result<()> {
        super::wakeup::wake(on.pool, on.sql.notify_channel()).await
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
        let until: Option<PgTime> = row
            .try_get("claimed_until")
            .map_err(|e| Error::decode(id, "claimed_until", e))?;
        match until {
            Some(PgTime(until)) => Ok(RetryOutcome::Leased { until }),
            // Not reached: a failed or dead row is refused only under a lease.
            None => Ok(RetryOutcome::NotRetryable { state }),
        }
    }
}

/// A claim statement with its first five parameters bound (limit, lease, token, cutoff,
/// whether to write upstream Trellis' lease too).
fn claim_query<'q>(
    sql: &'q std::sync::Arc<str>,
    on: &On<'_, Postgres>,
    due: &'q ClaimDue,
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(statement(sql))
        .bind(due.limit)
        .bind(sql_seconds(due.lease))
        .bind(&due.token)
        .bind(due.cutoff)
        .bind(on.beside_upstream)
}

/// The claim of both kinds, in a transaction that turns JIT compilation off and runs the
/// statement's generic plan. The planner cannot know how many keys the walk visits and
/// estimates it high enough that a server with JIT on (the default) compiled the statement
/// on every claim, which took longer (over 100 ms here) than running it. Planning it for its
/// parameters each time (a custom plan) cost about 1 ms for a claim of 10 rows and 2–3 ms
/// for one of 1,000, and the custom plans ran no faster: backend CPU per claim, generic
/// against custom, 0.5 / 1.5 ms (limit 10), 1.5 / 2.75 ms (100), 12.5–15 / 15–17 ms (1,000),
/// 19 / 22 ms with 974 of 1,000 keys in flight, 15–16 / 17–19 ms with half the rows unkeyed.
/// (With `plan_cache_mode = auto` Postgres would keep planning it five times before it
/// tried the generic plan, and might never switch.)
async fn claim_keyed(
    on: &On<'_, Postgres>,
    due: &ClaimDue,
    cursor: Option<String>,
) -> sqlx::Result<Vec<sqlx::postgres::PgRow>> {
    let mut tx = on.pool.begin().await?;
    sqlx::query(
        "SELECT set_config('jit', 'off', true), \
         set_config('plan_cache_mode', 'force_generic_plan', true)",
    )
    .execute(&mut *tx)
    .await?;
    let rows = claim_query(&on.only.claim, on, due)
        .bind(&*due.published)
        .bind(cursor)
        .bind(run_limit(due.limit))
        .fetch_all(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(rows)
}

/// [`crate::dispatch::run_limit`] for the claim's `i64` limit.
fn run_limit(limit: i64) -> i64 {
    let limit = usize::try_from(limit.max(0)).unwrap_or(usize::MAX);
    i64::try_from(crate::dispatch::run_limit(limit)).unwrap_or(i64::MAX)
}

/// Where the next key walk starts, given where this one started (`from`) and the keys it
/// claimed rows of: the last key it reached, so that the next walk goes on round-robin.
/// The walk visits the keys above `from` in order, then wraps to the lowest: the last key
/// reached is the greatest claimed key at or below `from` if the walk wrapped, else the
/// greatest claimed key. No keyed rows claimed: the walk starts where it did.
fn next_cursor<'a>(from: Option<&'a str>, keys: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let (mut above, mut wrapped) = (None, None);
    for key in keys {
        let side = if from.is_some_and(|from| key <= from) {
            &mut wrapped
        } else {
            &mut above
        };
        if side.is_none_or(|last| key > last) {
            *side = Some(key);
        }
    }
    wrapped.or(above).or(from)
}

#[cfg(test)]
mod tests {
    use super::next_cursor;

    #[test]
    fn the_key_walk_goes_on_from_the_last_key_it_reached() {
        let keys = |k: &'static [&'static str]| k.iter().copied();
        assert_eq!(next_cursor(None, keys(&["b", "d", "a"])), Some("d"));
        assert_eq!(next_cursor(Some("b"), keys(&["c", "e"])), Some("e"));
        // Wrapped past the end: the last key reached is below where it started.
        assert_eq!(
            next_cursor(Some("c"), keys(&["d", "e", "a", "b"])),
            Some("b")
        );
        assert_eq!(next_cursor(Some("c"), keys(&["c"])), Some("c"));
        assert_eq!(next_cursor(Some("c"), keys(&[])), Some("c"));
        assert_eq!(next_cursor(None, keys(&[])), None);
    }

    #[test]
    fn a_claim_takes_at_most_a_share_of_its_limit_from_one_key() {
        use super::run_limit;
        assert_eq!(run_limit(1), 1);
        assert_eq!(run_limit(100), 16);
        assert_eq!(run_limit(1_000), 16);
        assert_eq!(run_limit(10_000), 156);
    }
}
