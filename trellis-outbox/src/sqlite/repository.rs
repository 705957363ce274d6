//! The SQLite steps of [`SqlOutboxRepository`](crate::SqlOutboxRepository): the claim (one
//! `UPDATE … RETURNING` of packed rows), the batched failure marks over JSON arrays, and
//! retry; what the shared steps bind (JSON arrays) and read (bytes) on SQLite.

use std::time::Duration;

use sqlx::sqlite::SqliteRow;
use sqlx::{AssertSqlSafe, Row, Sqlite};

use super::database::decode_claimed;
use super::sql::{CLAIM_COLUMN_COUNT, SqliteOnly};
use crate::dispatch::{Claim, Dispatched, Failure, FailureOutcome, PoisonRow, RetryOutcome};
use crate::driver::sealed::{Backend, ClaimDue, Fenced, On, RepositoryBackend};
use crate::driver::sql_seconds;
use crate::error::{Error, Result};
use crate::sql::statement;
use crate::tables::OutboxTables;
use crate::time::{format_timestamp, parse_timestamp};

impl RepositoryBackend for Sqlite {
    type Only = SqliteOnly;
    /// A date modifier: `+1.500 seconds`.
    type Interval = String;
    /// A JSON array.
    type Ids<'a> = String;
    /// None: the outcomes go in the list, as `[id, outcome]` pairs.
    type Outcomes = String;
    /// Bytes: a stored value need not be UTF-8.
    type Text = Vec<u8>;

    // Writers queue behind one lock: overlapping batches would only add lock waits.
    const OVERLAPS_BATCHES: bool = false;

    fn only(tables: &OutboxTables) -> SqliteOnly {
        SqliteOnly::new(tables)
    }

    fn interval(duration: Duration) -> String {
        format!("+{:.3} seconds", sql_seconds(duration))
    }

    fn ids<'a>(ids: &'a [&'a str]) -> Result<String> {
        json_array(&ids)
    }

    fn outcomes<'a>(_: &'a [&'a str], rows: &'a [Dispatched]) -> Result<(String, Option<String>)> {
        let pairs: Vec<(&str, &Option<serde_json::Value>)> =
            rows.iter().map(|r| (r.id.as_str(), &r.outcome)).collect();
        Ok((json_array(&pairs)?, None))
    }

    fn text(text: Vec<u8>) -> String {
        String::from_utf8(text)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }

    async fn claim_due(on: On<'_, Self>, due: ClaimDue) -> Result<Claim> {
        // The first claim of a wave learns the cutoff (the database's clock) from the claim
        // itself; later claims pass it in and need not read it back.
        let claim = if on.beside_upstream {
            &on.only.claim_beside_upstream
        } else {
            &on.only.claim
        };
        let sql = claim.get(due.limit, due.cutoff.is_none());
        // One autocommit UPDATE: SQLite takes the write lock when the statement starts, so
        // the claim is atomic and concurrent claimers queue on the busy timeout (the same
        // guarantee as BEGIN IMMEDIATE, in one round trip).
        let rows = sqlx::query(AssertSqlSafe(sql))
            .bind(Self::interval(due.lease))
            .bind(&due.token)
            .bind(due.cutoff.map(format_timestamp))
            .fetch_all(on.pool)
            .await
            .map_err(Error::repository("claim"))?;
        let Some(first) = rows.first() else {
            return Ok(due.nothing_due());
        };
        let cutoff = match due.cutoff {
            Some(cutoff) => cutoff,
            None => {
                let text: &str = first
                    .try_get(CLAIM_COLUMN_COUNT)
                    .map_err(|e| Error::decode("", "claim_cutoff", e))?;
                parse_timestamp(text)
                    .map_err(|e| Error::decode("", "claim_cutoff", format!("{text:?}: {e}")))?
            }
        };
        let mut claim = Claim::empty(due.token, cutoff);
        // Rows whose packed values are unusual, to be read column by column.
        let mut unread = Vec::new();
        // Rows whose id is not UTF-8 text: (its bytes, why the row is poison).
        let mut unnamed = Vec::new();
        for row in &rows {
            match decode_claimed(row) {
                Ok(Some(message)) => claim.push_message(message),
                // decode_claimed read the id before answering None.
                Ok(None) => unread.push(row.try_get::<String, _>(0).unwrap_or_default()),
                Err(error) => match row.try_get::<String, _>(0) {
                    Ok(id) => claim.poisoned.push(PoisonRow {
                        id,
                        reason: error.to_string(),
                    }),
                    Err(_) => unnamed.push((
                        row.try_get::<Vec<u8>, _>(0).unwrap_or_default(),
                        error.to_string(),
                    )),
                },
            }
        }
        drop(rows);
        // No mark by id reaches them: put them to rest here, by their bytes. They do not
        // appear in the claim (it has no id to give them).
        for (bytes, reason) in unnamed {
            let reason = format!("the id is not UTF-8 text ({reason})");
            let done = sqlx::query(statement(&on.only.dead_by_id_bytes))
                .bind(&bytes)
                .bind(&claim.token)
                .bind(&reason)
                .execute(on.pool)
                .await
                .map_err(Error::repository("mark a row whose id is not UTF-8 dead"))?;
            tracing::warn!(
                id = %String::from_utf8_lossy(&bytes),
                marked = done.rows_affected(),
                "a claimed row's id is not UTF-8 text: marked dead by its bytes"
            );
        }
        let unread = if unread.is_empty() {
            Vec::new()
        } else {
            read_claimed(on, &claim.token, &unread).await?
        };
        // Also puts every message in dispatch order: RETURNING does not keep the claim
        // subquery's order.
        claim.extend(&unread, Self::decode, |row| row.try_get(0).ok());
        Ok(claim)
    }

    async fn mark_failures(on: Fenced<'_, Self>, failures: &[Failure]) -> Result<Vec<String>> {
        let entries: Vec<(&str, &str, Option<String>, i32)> = failures
            .iter()
            .map(|f| match f.outcome {
                FailureOutcome::Retry { after } => (
                    f.id.as_str(),
                    f.error.as_str(),
                    Some(Self::interval(after)),
                    1,
                ),
                FailureOutcome::Dead { count_attempt } => (
                    f.id.as_str(),
                    f.error.as_str(),
                    None,
                    i32::from(count_attempt),
                ),
            })
            .collect();
        sqlx::query_scalar(statement(&on.sql.text.mark_failures))
            .bind(json_array(&entries)?)
            .bind(on.token)
            .fetch_all(on.pool)
            .await
            .map_err(Error::repository("mark failures"))
    }

    async fn wake(_: On<'_, Self>) -> sqlx::Result<()> {
        // No notifications between processes: dispatchers find the rows at their next poll.
        Ok(())
    }

    async fn retry(on: On<'_, Self>, id: &str) -> Result<RetryOutcome> {
        // BEGIN IMMEDIATE takes the write lock first: no claim can come between the update
        // and the read of why it changed nothing.
        let mut tx = on
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(Error::repository("retry"))?;
        let result = sqlx::query(statement(&on.sql.text.retry))
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(Error::repository("retry"))?;
        let outcome = if result.rows_affected() > 0 {
            RetryOutcome::Retried
        } else {
            let found: Option<(Vec<u8>, Option<String>)> =
                sqlx::query_as(statement(&on.only.retry_refusal))
                    .bind(id)
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(Error::repository("retry"))?;
            match found {
                None => RetryOutcome::NotFound,
                Some((state, until)) => {
                    let state = Self::text(state);
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
}

/// Reads the claimed rows `ids`, whose packed values could not be decoded, column by column.
/// A row deleted by hand since the claim is simply not there any more.
async fn read_claimed(on: On<'_, Sqlite>, token: &str, ids: &[String]) -> Result<Vec<SqliteRow>> {
    sqlx::query(statement(&on.only.read_claimed))
        .bind(json_array(&ids)?)
        .bind(token)
        .fetch_all(on.pool)
        .await
        .map_err(Error::repository("claim"))
}

fn json_array<T: serde::Serialize>(value: &T) -> Result<String> {
    serde_json::to_string(value).map_err(|source| Error::Serialize {
        what: "id list",
        source,
    })
}
