//! The storage side of dispatching: claiming due rows under a lease and marking them.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::error::Result;

pub use super::claim::{Claim, ClaimRequest, PoisonRow};
use super::handoff::HandoffTarget;

/// How much is waiting in an outbox: what the dispatcher reports as the
/// [`UNDISPATCHED`](crate::metrics::UNDISPATCHED) and [`LAG_SECONDS`](crate::metrics::LAG_SECONDS)
/// gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Backlog {
    /// Rows not yet dispatched (pending, claimed or failed; not dead).
    pub undispatched: u64,
    /// How long the oldest of them has waited since it was enqueued.
    pub oldest: Option<Duration>,
}

impl Backlog {
    /// A backlog of `undispatched` rows, the oldest enqueued `oldest` ago.
    pub fn new(undispatched: u64, oldest: Option<Duration>) -> Self {
        Self {
            undispatched,
            oldest,
        }
    }
}

/// A successfully dispatched row and what dispatching produced.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Dispatched {
    /// The row's id.
    pub id: String,
    /// Stored in the `outcome` column (e.g. a job admission result); `None` stores NULL.
    pub outcome: Option<serde_json::Value>,
}

impl Dispatched {
    /// A dispatched row with no outcome.
    pub fn new(id: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            outcome: None,
        }
    }

    /// A dispatched row with an outcome.
    pub fn with_outcome(id: impl Into<String>, outcome: serde_json::Value) -> Self {
        Self {
            id: id.into(),
            outcome: Some(outcome),
        }
    }
}

/// What to do with one row of a claim whose attempt failed (or that could not be decoded):
/// an entry of [`OutboxRepository::mark_failures`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Failure {
    /// The row's id.
    pub id: String,
    /// Stored in `last_error`.
    pub error: String,
    /// Whether the row is retried later or moved to `dead`.
    pub outcome: FailureOutcome,
}

/// Where a failed row goes: see [`Failure`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureOutcome {
    /// `failed`, `attempts + 1`, due again this long from now (repository clock).
    Retry {
        /// The delay before the next attempt.
        after: Duration,
    },
    /// `dead`; `count_attempt` adds one to `attempts` (the row was tried and failed, rather
    /// than found undecodable).
    Dead {
        /// Whether the failure counts as an attempt.
        count_attempt: bool,
    },
}

impl Failure {
    /// A row to retry after `after`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use trellis_outbox::{Failure, FailureOutcome};
    ///
    /// let failure = Failure::retry("01J…", "ack timed out", Duration::from_secs(2));
    /// assert_eq!(failure.outcome, FailureOutcome::Retry { after: Duration::from_secs(2) });
    /// ```
    pub fn retry(id: impl Into<String>, error: impl Into<String>, after: Duration) -> Self {
        Self {
            id: id.into(),
            error: error.into(),
            outcome: FailureOutcome::Retry { after },
        }
    }

    /// A row to move to `dead`.
    pub fn dead(id: impl Into<String>, reason: impl Into<String>, count_attempt: bool) -> Self {
        Self {
            id: id.into(),
            error: reason.into(),
            outcome: FailureOutcome::Dead { count_attempt },
        }
    }
}

/// What [`OutboxRepository::retry`] did with a row.
///
/// # Examples
///
/// ```
/// # async fn run() -> Result<(), trellis_outbox::Error> {
/// use trellis_outbox::{MemoryOutboxRepository, OutboxRepository, RetryOutcome};
///
/// let repo = MemoryOutboxRepository::new();
/// match repo.retry("01J0000000000000000000000").await? {
///     RetryOutcome::Retried => println!("due again now"),
///     RetryOutcome::Leased { until } => println!("a dispatcher holds it until {until}"),
///     other => println!("not retried: {other}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryOutcome {
    /// The row was moved back to `pending`, due now, with its attempts reset.
    Retried,
    /// No row has this id.
    NotFound,
    /// The row is not `failed` or `dead` (it is pending, dispatched, or in a state this
    /// version does not know), so there is nothing to retry.
    NotRetryable {
        /// The row's stored state.
        state: String,
    },
    /// The row is `failed` but a dispatcher holds it under a lease that has not expired
    /// (it is retrying it right now): resetting it would fence out that dispatcher's marks
    /// while another one could claim and publish the row again. Retry after `until` if the
    /// row is still failed then.
    Leased {
        /// When the lease expires, on the repository's clock.
        until: DateTime<Utc>,
    },
}

impl RetryOutcome {
    /// Whether the row was retried.
    pub fn is_retried(&self) -> bool {
        matches!(self, RetryOutcome::Retried)
    }
}

impl std::fmt::Display for RetryOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RetryOutcome::Retried => f.write_str("retried"),
            RetryOutcome::NotFound => f.write_str("no such row"),
            RetryOutcome::NotRetryable { state } => {
                write!(f, "the row is {state:?}, not failed or dead")
            }
            RetryOutcome::Leased { until } => write!(
                f,
                "a dispatcher holds the row under a lease until {}",
                until.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
            ),
        }
    }
}

/// Where dispatchers claim due rows and record what happened to them.
///
/// Implemented by [`PgOutboxRepository`](crate::PgOutboxRepository),
/// [`SqliteOutboxRepository`](crate::SqliteOutboxRepository) and
/// [`MemoryOutboxRepository`](crate::MemoryOutboxRepository). Times that decide who owns a row
/// (lease expiry, due times) are computed with the **repository's** clock (`now()` on
/// Postgres), so dispatchers on hosts with skewed clocks still agree.
///
/// Due rows are those in state `pending` or `failed` whose `next_attempt_at` is unset or not
/// after the cutoff, and whose lease (if any) has expired. Rows in `dispatched` or `dead` are
/// never claimed.
pub trait OutboxRepository: Send + Sync + 'static {
    /// Claims up to [`ClaimRequest::limit`] due rows for [`ClaimRequest::lease`], oldest first
    /// (`created_at`, then `id`). This is the method an implementation provides; callers
    /// usually write [`claim_due`](Self::claim_due).
    fn claim(&self, request: ClaimRequest) -> impl Future<Output = Result<Claim>> + Send;

    /// Claims up to `limit` due rows for `lease`: a [`claim`](Self::claim) of
    /// `ClaimRequest::new(limit, lease).cutoff(cutoff)`.
    ///
    /// `cutoff`: the due cutoff; `None` means the repository's current time. Pass the previous
    /// claim's [`Claim::cutoff`] to stay in one drain wave.
    fn claim_due(
        &self,
        limit: usize,
        lease: Duration,
        cutoff: Option<DateTime<Utc>>,
    ) -> impl Future<Output = Result<Claim>> + Send {
        self.claim(ClaimRequest::new(limit, lease).cutoff(cutoff))
    }

    /// Marks rows of `claim` dispatched (clearing `next_attempt_at`, `last_error` and the
    /// lease; storing each outcome). Returns how many rows were still held by the claim and so
    /// were marked; rows whose lease was lost are left alone.
    fn mark_dispatched(
        &self,
        claim: &Claim,
        rows: &[Dispatched],
    ) -> impl Future<Output = Result<u64>> + Send;

    /// Releases the lease on rows of `claim` that were not attempted (on shutdown), making
    /// them claimable at once. Returns how many were released.
    fn release(&self, claim: &Claim, ids: &[&str]) -> impl Future<Output = Result<u64>> + Send;

    /// Marks several failed rows of `claim` at once (each `failed` or `dead` as its
    /// [`FailureOutcome`] says: `failed` adds one to `attempts`, stores the error and makes
    /// the row due again after the delay on the repository's clock; `dead` stores the reason
    /// and adds one to `attempts` when the failure counts as an attempt) and returns the ids
    /// that were still held by the claim and so were marked; rows whose lease was lost are
    /// left alone. The SQL repositories mark the whole list in one statement.
    fn mark_failures(
        &self,
        claim: &Claim,
        failures: &[Failure],
    ) -> impl Future<Output = Result<Vec<String>>> + Send;

    /// Marks one row of `claim` as `failure` says (retry later, or `dead`): a
    /// [`mark_failures`](Self::mark_failures) of one. Returns `false` if the lease was lost
    /// (nothing changed).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use trellis_outbox::{Failure, MemoryOutboxRepository, OutboxRepository, PreparedOutboxRecord};
    ///
    /// # async fn run() -> trellis_outbox::Result<()> {
    /// let repo = MemoryOutboxRepository::new();
    /// let record = PreparedOutboxRecord::event("Orders.Placed", "events.v1.Orders.Placed", &1)?;
    /// repo.enqueue(&record)?;
    /// let claim = repo.claim_due(10, Duration::from_secs(30), None).await?;
    /// let failure = Failure::retry(&record.id, "no ack", Duration::from_secs(5));
    /// assert!(repo.mark_failure(&claim, failure).await?);
    /// # Ok(()) }
    /// ```
    fn mark_failure(
        &self,
        claim: &Claim,
        failure: Failure,
    ) -> impl Future<Output = Result<bool>> + Send {
        async move { Ok(!self.mark_failures(claim, &[failure]).await?.is_empty()) }
    }

    /// Extends the lease on rows of `claim` to `lease` from now (repository clock), for a
    /// publish that takes longer than expected. Fenced like the marks: only rows the claim
    /// still holds are extended. Returns how many were.
    ///
    /// Only called when [`extends_leases`](Self::extends_leases) returns `true`; the default
    /// extends nothing (returns 0).
    fn extend_lease(
        &self,
        claim: &Claim,
        ids: &[&str],
        lease: Duration,
    ) -> impl Future<Output = Result<u64>> + Send {
        let _ = (claim, ids, lease);
        std::future::ready(Ok(0))
    }

    /// Moves a `dead` or `failed` row back to `pending`, due now, with `attempts` reset to 0
    /// (an operator's retry), unless a dispatcher holds it under a live lease (claim token
    /// set, lease not expired on the repository's clock). Says what was done: see
    /// [`RetryOutcome`]. Atomic: a row is never reset while a claim holds it.
    fn retry(&self, id: &str) -> impl Future<Output = Result<RetryOutcome>> + Send;

    /// Deletes `dispatched` rows last updated more than `older_than` ago, `batch` rows per
    /// statement, and returns how many; used by
    /// [`DispatcherBuilder::retain_dispatched`](crate::DispatcherBuilder::retain_dispatched).
    /// Never deletes rows in any other state. The default deletes nothing; the SQL
    /// repositories implement it (see `SqlOutboxRepository::purge_dispatched`).
    fn purge_dispatched(
        &self,
        older_than: Duration,
        batch: usize,
    ) -> impl Future<Output = Result<u64>> + Send {
        let _ = (older_than, batch);
        std::future::ready(Ok(0))
    }

    /// Moves rows no claim can ever finish to `dead`, with a reason in `last_error`, and
    /// returns them (id, reason): rows in a state this crate does not know (anything but
    /// `pending`, `claimed`, `dispatched`, `failed` and `dead`; `claimed`, upstream Trellis'
    /// state, is left alone), and on SQLite open rows whose id is NULL or not text (the id is
    /// empty in the returned row; the reason names the rowid). Such rows come from other
    /// writers; schema version 3 refuses new ones.
    ///
    /// Scans the table: the dispatcher calls it once when it starts and reports each row to
    /// `on_error` as [`DispatchError::Poisoned`](crate::DispatchError::Poisoned). A swept
    /// row is `dead`, so it is not returned again. The default finds nothing.
    fn sweep_unfinishable(&self) -> impl Future<Output = Result<Vec<PoisonRow>>> + Send {
        std::future::ready(Ok(Vec::new()))
    }

    /// How long until the next row becomes claimable: the earliest `next_attempt_at` of a
    /// failed row or lease expiry of a leased row; `Some(Duration::ZERO)` if a row is due now,
    /// `None` if no undispatched row exists.
    fn next_due_in(&self) -> impl Future<Output = Result<Option<Duration>>> + Send;

    /// How many rows wait to be dispatched and how long the oldest has waited, for the
    /// dispatcher's backlog gauges. The default reports nothing (`None`).
    fn backlog(&self) -> impl Future<Output = Result<Option<Backlog>>> + Send {
        std::future::ready(Ok(None))
    }

    /// Whether [`extend_lease`](Self::extend_lease) is implemented. When it is not (the
    /// default, `false`), the dispatcher releases a batch that has too little lease left
    /// instead of publishing it, and stops a publish that is about to outlive its lease, so
    /// two holders never publish a row at once; keep leases well above a publish's duration.
    fn extends_leases(&self) -> bool {
        false
    }

    /// Whether the dispatcher may overlap consecutive batches: claim the next batch and mark
    /// the previous one while the current one is being published. Return `true` when the
    /// store lets several writers proceed at once (Postgres: the claim skips locked rows, and
    /// the three statements touch disjoint rows); keep the default `false` when writers queue
    /// behind one lock (SQLite), where overlapping only adds lock waits.
    ///
    /// Overlapping never runs two claims at once and never claims a row twice: the next
    /// claim only finds rows that no lease holds.
    fn overlaps_batches(&self) -> bool {
        false
    }

    /// Where a [`HandoffTransaction`](crate::HandoffTransaction) of a dispatcher over this
    /// repository writes its rows: the SQL repositories answer their outbox and database;
    /// the default, `None`, means handoffs are not supported (a dispatcher's
    /// [`handoff`](crate::DispatcherHandle::handoff) then fails). Only this crate can build a
    /// [`HandoffTarget`].
    fn handoff_target(&self) -> Option<HandoffTarget> {
        None
    }
}

// Sharing: a dispatcher can run over an `Arc` of a repository the application also uses
// elsewhere (e.g. a `MemoryOutboxRepository` a test inspects).

impl<R: OutboxRepository> OutboxRepository for Arc<R> {
    fn claim(&self, request: ClaimRequest) -> impl Future<Output = Result<Claim>> + Send {
        (**self).claim(request)
    }

    fn mark_dispatched(
        &self,
        claim: &Claim,
        rows: &[Dispatched],
    ) -> impl Future<Output = Result<u64>> + Send {
        (**self).mark_dispatched(claim, rows)
    }

    fn release(&self, claim: &Claim, ids: &[&str]) -> impl Future<Output = Result<u64>> + Send {
        (**self).release(claim, ids)
    }

    fn mark_failures(
        &self,
        claim: &Claim,
        failures: &[Failure],
    ) -> impl Future<Output = Result<Vec<String>>> + Send {
        (**self).mark_failures(claim, failures)
    }

    async fn extend_lease(&self, claim: &Claim, ids: &[&str], lease: Duration) -> Result<u64> {
        (**self).extend_lease(claim, ids, lease).await
    }

    fn retry(&self, id: &str) -> impl Future<Output = Result<RetryOutcome>> + Send {
        (**self).retry(id)
    }

    fn purge_dispatched(
        &self,
        older_than: Duration,
        batch: usize,
    ) -> impl Future<Output = Result<u64>> + Send {
        (**self).purge_dispatched(older_than, batch)
    }

    fn sweep_unfinishable(&self) -> impl Future<Output = Result<Vec<PoisonRow>>> + Send {
        (**self).sweep_unfinishable()
    }

    fn next_due_in(&self) -> impl Future<Output = Result<Option<Duration>>> + Send {
        (**self).next_due_in()
    }

    fn backlog(&self) -> impl Future<Output = Result<Option<Backlog>>> + Send {
        (**self).backlog()
    }

    fn extends_leases(&self) -> bool {
        (**self).extends_leases()
    }

    fn overlaps_batches(&self) -> bool {
        (**self).overlaps_batches()
    }

    fn handoff_target(&self) -> Option<HandoffTarget> {
        (**self).handoff_target()
    }
}

/// The states a stored row may be in, as an SQL list: this crate's four and upstream
/// Trellis' `claimed` (left alone here). Any other state is unknown.
pub(crate) const KNOWN_STATES: &str = "'pending', 'claimed', 'dispatched', 'failed', 'dead'";

/// The longest duration the SQL repositories add to a time: about 100 years. A longer lease
/// or retry delay means "practically never" and is stored as this: as an SQL interval it
/// would overflow (Postgres fails the statement, SQLite answers NULL past the year 9999,
/// which would make the row claimable at once).
pub(crate) const MAX_SQL_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// A wait in seconds as the database computed it, as a [`Duration`]: negative or NaN is
/// zero (due now), too large or infinite is [`Duration::MAX`] (not due in any foreseeable
/// time, not "due now", which would make the dispatcher spin).
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) fn due_in(seconds: f64) -> Duration {
    if seconds.is_nan() || seconds <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX)
}
