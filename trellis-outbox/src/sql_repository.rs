//! [`OutboxRepository`] on an SQL database: one implementation over the driver interface;
//! the statements and the dialect's own steps (claim, batched marks, retry, sweep) are the
//! driver's.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Pool;

use crate::dispatch::{
    Backlog, Claim, ClaimRequest, Dispatched, Failure, HandoffTarget, OutboxRepository, PoisonRow,
    RetryOutcome, due_in,
};
use crate::driver::OutboxDatabase;
use crate::driver::sealed::{ClaimDue, Fenced, On};
use crate::error::{Error, Result};
use crate::outbox::Outbox;
use crate::sql::SqlStatements;
use crate::tables::OutboxTables;

/// The outbox repository on an SQL database: claims under a lease and a fencing token, using
/// the database's clock. Name it by its database: [`PgOutboxRepository`](crate::PgOutboxRepository)
/// or [`SqliteOutboxRepository`](crate::SqliteOutboxRepository), whose pages say how each
/// claims.
///
/// Needs migration version 2 ([`migrate`](crate::migrate())).
///
/// # Examples
///
/// Generic over the database, as [`sqlx::Pool`] is:
///
/// ```no_run
/// use std::time::Duration;
/// use trellis_outbox::{OutboxDatabase, OutboxRepository, SqlOutboxRepository};
///
/// # async fn run<DB: OutboxDatabase>(pool: sqlx::Pool<DB>) -> Result<(), trellis_outbox::Error> {
/// let repository = SqlOutboxRepository::new(pool);
/// let claim = repository.claim_due(100, Duration::from_secs(30), None).await?;
/// println!("claimed {} rows", claim.len());
/// # Ok(()) }
/// ```
pub struct SqlOutboxRepository<DB: OutboxDatabase> {
    pool: Pool<DB>,
    sql: Arc<SqlStatements>,
    only: Arc<DB::Only>,
    beside_upstream: bool,
    /// This repository's tables, for the outbox of its handoffs.
    tables: OutboxTables,
}

impl<DB: OutboxDatabase> SqlOutboxRepository<DB> {
    /// A repository on the default tables.
    pub fn new(pool: Pool<DB>) -> Self {
        Self::with_tables(pool, &OutboxTables::default())
    }

    /// A repository on `tables`.
    pub fn with_tables(pool: Pool<DB>, tables: &OutboxTables) -> Self {
        Self {
            pool,
            sql: Arc::new(SqlStatements::new(DB::DIALECT, tables, false)),
            only: Arc::new(DB::only(tables)),
            beside_upstream: false,
            tables: tables.clone(),
        }
    }

    /// For a table that an upstream Trellis (TypeScript, 0.11 final or later) dispatcher
    /// drains at the same time, e.g. during a rollout: claims also write upstream's lease —
    /// `next_attempt_at` = the lease's end, which upstream's claim respects — and move an
    /// adopted upstream claim back to `pending`, which fences out upstream's late marks of it.
    /// Together the two dispatchers then publish every row once.
    ///
    /// Off by default: writing `next_attempt_at` on every claim updates an indexed column
    /// (on Postgres the lease update is no longer HOT), which costs claim throughput.
    /// Without it, expired upstream claims (`claimed` rows) are still adopted, and `dead`
    /// rows are still never due for upstream.
    ///
    /// ```no_run
    /// # fn run(pool: sqlx::PgPool) {
    /// let repository = trellis_outbox::PgOutboxRepository::new(pool).beside_upstream();
    /// # let _ = repository; }
    /// ```
    pub fn beside_upstream(mut self) -> Self {
        self.beside_upstream = true;
        self
    }

    /// The statements this repository sends.
    pub(crate) fn statements(&self) -> &SqlStatements {
        &self.sql
    }

    /// The pool this repository uses.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// Deletes `dispatched` rows last updated more than `older_than` ago (database clock),
    /// oldest first, `batch` rows per statement until none is left; returns how many were
    /// deleted. Each statement is its own short transaction through an index of dispatched
    /// rows (migration version 4), so it neither scans the table nor holds locks for long.
    /// Rows in any other state — `dead` ones included — are never deleted.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidRetention`] for a `batch` of 0 or over 100,000;
    /// [`Error::Repository`] if a statement fails (rows deleted before it stay deleted).
    ///
    /// ```no_run
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), trellis_outbox::Error> {
    /// use std::time::Duration;
    ///
    /// let repository = trellis_outbox::PgOutboxRepository::new(pool);
    /// let week = Duration::from_secs(7 * 86_400);
    /// let deleted = repository.purge_dispatched(week, 1_000).await?;
    /// println!("deleted {deleted} dispatched rows older than a week");
    /// # Ok(()) }
    /// ```
    pub async fn purge_dispatched(&self, older_than: Duration, batch: usize) -> Result<u64> {
        self.purge(
            &self.sql.text.purge_dispatched,
            older_than,
            batch,
            "purge dispatched rows",
        )
        .await
    }

    /// Deletes inbox rows received more than `older_than` ago, like
    /// [`purge_dispatched`](Self::purge_dispatched). Keep inbox rows longer than a message
    /// can be redelivered (the stream's retention and the consumer's redelivery window): a
    /// purged id is no longer recognised as a duplicate.
    ///
    /// # Errors
    ///
    /// As [`purge_dispatched`](Self::purge_dispatched).
    pub async fn purge_inbox(&self, older_than: Duration, batch: usize) -> Result<u64> {
        self.purge(
            &self.sql.text.purge_inbox,
            older_than,
            batch,
            "purge inbox rows",
        )
        .await
    }

    async fn purge(
        &self,
        sql: &Arc<str>,
        older_than: Duration,
        batch: usize,
        operation: &'static str,
    ) -> Result<u64> {
        let limit = match i64::try_from(batch) {
            Ok(limit @ 1..=100_000) => limit,
            _ => {
                return Err(Error::InvalidRetention {
                    problem: "the batch must be between 1 and 100,000 rows",
                });
            }
        };
        let seconds = crate::driver::sql_seconds(older_than);
        let mut total = 0;
        loop {
            let deleted = DB::delete_older(&self.pool, sql, seconds, limit)
                .await
                .map_err(Error::repository(operation))?;
            total += deleted;
            if deleted < limit.unsigned_abs() {
                return Ok(total);
            }
        }
    }

    /// Wakes running dispatchers after rows were made due by an operator ([`DB::wake`]). A
    /// failure is logged, not returned: the rows are due either way, and dispatchers find
    /// them at their next poll.
    pub(crate) async fn wake_dispatchers(&self) {
        if let Err(error) = DB::wake(self.on()).await {
            tracing::warn!(
                error = %crate::chain::error_chain(&error),
                "could not wake the dispatchers after a retry; they find the rows at their next poll"
            );
        }
    }

    fn on(&self) -> On<'_, DB> {
        On {
            pool: &self.pool,
            sql: &self.sql,
            only: &self.only,
            beside_upstream: self.beside_upstream,
        }
    }
}

impl<DB: OutboxDatabase> Clone for SqlOutboxRepository<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            sql: Arc::clone(&self.sql),
            only: Arc::clone(&self.only),
            beside_upstream: self.beside_upstream,
            tables: self.tables.clone(),
        }
    }
}

impl<DB: OutboxDatabase> std::fmt::Debug for SqlOutboxRepository<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlOutboxRepository")
            .field("pool", &self.pool)
            .field("sql", &self.sql)
            .field("only", &self.only)
            .field("beside_upstream", &self.beside_upstream)
            .finish()
    }
}

impl<DB: OutboxDatabase> OutboxRepository for SqlOutboxRepository<DB> {
    async fn claim(&self, request: ClaimRequest) -> Result<Claim> {
        DB::claim_due(self.on(), ClaimDue::new(request)).await
    }

    async fn mark_dispatched(&self, claim: &Claim, rows: &[Dispatched]) -> Result<u64> {
        if rows.is_empty() {
            return Ok(0);
        }
        let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
        let (sql, list, outcomes) = if rows.iter().all(|r| r.outcome.is_none()) {
            // Events carry no outcome: the plain statement saves the per-row lookup.
            (&self.sql.text.mark_dispatched, DB::ids(&ids)?, None)
        } else {
            let (list, outcomes) = DB::outcomes(&ids, rows)?;
            (&self.sql.text.mark_dispatched_with_outcomes, list, outcomes)
        };
        DB::mark_rows(&self.pool, sql, list, &claim.token, outcomes)
            .await
            .map_err(Error::repository("mark dispatched"))
    }

    async fn mark_failures(&self, claim: &Claim, failures: &[Failure]) -> Result<Vec<String>> {
        if failures.is_empty() {
            return Ok(Vec::new());
        }
        DB::mark_failures(self.fenced(claim), failures).await
    }

    fn extends_leases(&self) -> bool {
        true
    }

    async fn extend_lease(&self, claim: &Claim, ids: &[&str], lease: Duration) -> Result<u64> {
        self.update_leases(
            "extend lease",
            &self.sql.text.extend_lease,
            claim,
            ids,
            Some(lease),
        )
        .await
    }

    async fn release(&self, claim: &Claim, ids: &[&str]) -> Result<u64> {
        self.update_leases("release", &self.sql.text.release, claim, ids, None)
            .await
    }

    /// Also wakes running dispatchers when the row was retried (on Postgres, a `NOTIFY` on
    /// the outbox's channel, as an enqueue sends), so one listening picks it up at once.
    async fn retry(&self, id: &str) -> Result<RetryOutcome> {
        let outcome = DB::retry(self.on(), id).await?;
        if outcome.is_retried() {
            self.wake_dispatchers().await;
        }
        Ok(outcome)
    }

    async fn purge_dispatched(&self, older_than: Duration, batch: usize) -> Result<u64> {
        SqlOutboxRepository::purge_dispatched(self, older_than, batch).await
    }

    async fn sweep_unfinishable(&self) -> Result<Vec<PoisonRow>> {
        let rows = DB::fetch_texts::<DB::Text>(&self.pool, &self.sql.text.sweep_unfinishable)
            .await
            .map_err(Error::repository("sweep unfinishable rows"))?;
        Ok(rows
            .into_iter()
            .map(|(id, reason)| PoisonRow {
                id: DB::text(id),
                reason: reason.map(DB::text).unwrap_or_default(),
            })
            .collect())
    }

    async fn next_due_in(&self) -> Result<Option<Duration>> {
        let seconds = DB::fetch_seconds(&self.pool, &self.sql.text.next_due_in)
            .await
            .map_err(Error::repository("next due"))?;
        Ok(seconds.map(due_in))
    }

    async fn backlog(&self) -> Result<Option<Backlog>> {
        let (count, age) = DB::fetch_count_age(&self.pool, &self.sql.text.backlog)
            .await
            .map_err(Error::repository("backlog"))?;
        Ok(Some(Backlog::new(
            u64::try_from(count).unwrap_or(0),
            age.map(due_in),
        )))
    }

    fn overlaps_batches(&self) -> bool {
        DB::OVERLAPS_BATCHES
    }

    fn handoff_target(&self) -> Option<HandoffTarget> {
        // No `NOTIFY`: handed-over rows are leased to this process's dispatcher, and the
        // commit wakes it in-process for rows that take the usual path. A `NOTIFY` would
        // only serialise the commit behind every other notifying one and wake listeners
        // to claim nothing.
        Some(HandoffTarget::new(
            Outbox::new(self.tables.clone()).without_notify(),
            DB::DIALECT,
            self.beside_upstream,
        ))
    }
}

impl<DB: OutboxDatabase> SqlOutboxRepository<DB> {
    /// Runs `sql` on the rows `ids` still held by `claim`, with the new `lease` if any.
    async fn update_leases(
        &self,
        operation: &'static str,
        sql: &Arc<str>,
        claim: &Claim,
        ids: &[&str],
        lease: Option<Duration>,
    ) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let lease = lease.map(DB::interval);
        DB::mark_rows(&self.pool, sql, DB::ids(ids)?, &claim.token, lease)
            .await
            .map_err(Error::repository(operation))
    }

    fn fenced<'a>(&'a self, claim: &'a Claim) -> Fenced<'a, DB> {
        Fenced {
            pool: &self.pool,
            sql: &self.sql,
            token: &claim.token,
        }
    }
}
