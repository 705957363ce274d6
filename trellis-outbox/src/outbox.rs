//! Transactional enqueue and inbox recording.

use std::sync::{Arc, LazyLock};

use sqlx::Transaction;
use tracing::Instrument as _;

use crate::driver::OutboxDatabase;
use crate::driver::sealed::{Backend as _, Queries as _};
use crate::error::{Error, Result};
use crate::job::{JobSubmission, OutboxJob};
use crate::record::{InboxReceipt, OutboxMessage, PreparedOutboxRecord, ToOutboxRecord};
use crate::sql::SqlStatements;
use crate::tables::{Dialect, OutboxTables};
use crate::time::now_millis;

/// An outbox and inbox on a given pair of tables.
///
/// Use it when your tables are not the defaults; otherwise the [`OutboxTransactionExt`]
/// methods on the transaction itself are shorter. Cloning is cheap. Every operation takes the
/// caller's transaction: there is deliberately no way to enqueue on a pool or a bare
/// connection, since an outbox row written outside the business transaction is exactly the
/// bug an outbox exists to prevent.
///
/// # Examples
///
/// ```no_run
/// use trellis_outbox::{Outbox, OutboxTables, PreparedOutboxRecord};
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let outbox = Outbox::new(OutboxTables::new("billing_outbox", "billing_inbox")?);
/// trellis_outbox::migrate_with(&pool, outbox.tables()).await?;
///
/// let mut tx = pool.begin().await?;
/// sqlx::query("UPDATE invoices SET paid = true WHERE id = 7").execute(&mut *tx).await?;
/// let event = PreparedOutboxRecord::event("Invoices.Paid", "events.v1.Invoices.Paid", &7)?;
/// outbox.enqueue(&mut tx, &event).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Outbox {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    tables: OutboxTables,
    sqlite: SqlStatements,
    postgres: SqlStatements,
}

static DEFAULT_OUTBOX: LazyLock<Outbox> = LazyLock::new(|| Outbox::new(OutboxTables::default()));

impl Default for Outbox {
    /// The outbox on upstream's default tables, `trellis_outbox` and `trellis_inbox`.
    fn default() -> Self {
        DEFAULT_OUTBOX.clone()
    }
}

impl Outbox {
    /// An outbox on `tables`. Table names were validated when `tables` was built.
    pub fn new(tables: OutboxTables) -> Self {
        Self::build(tables, true)
    }

    /// This outbox, except that enqueues on Postgres send no `NOTIFY`.
    ///
    /// Every Postgres transaction that sends a `NOTIFY` takes a cluster-wide lock from
    /// just before its commit until the commit has been flushed, so notifying commits are
    /// written one at a time (the stock server does not group-commit them). Under many
    /// concurrent writers that adds commit latency. When the dispatcher runs in the same
    /// process and is woken with [`DispatcherHandle::notify`](crate::DispatcherHandle::notify)
    /// after commit, and no other process listens with [`PgWakeups`](crate::PgWakeups),
    /// the notification has no reader: turn it off. (The dispatcher's idle poll still finds
    /// rows enqueued by other processes.) SQLite never notifies; this changes nothing there.
    ///
    /// # Examples
    ///
    /// ```
    /// use trellis_outbox::{Dialect, Outbox};
    ///
    /// let outbox = Outbox::default().without_notify();
    /// assert!(!outbox.sql(Dialect::Postgres).notifies());
    /// assert!(Outbox::default().sql(Dialect::Postgres).notifies());
    /// ```
    pub fn without_notify(&self) -> Self {
        Self::build(self.inner.tables.clone(), false)
    }

    fn build(tables: OutboxTables, notify: bool) -> Self {
        let sqlite = SqlStatements::new(Dialect::Sqlite, &tables, false);
        let postgres = SqlStatements::new(Dialect::Postgres, &tables, notify);
        Self {
            inner: Arc::new(Inner {
                tables,
                sqlite,
                postgres,
            }),
        }
    }

    /// Wakes the dispatchers that listen on this outbox
    /// ([`listen_postgres`](crate::DispatcherBuilder::listen_postgres),
    /// [`PgWakeups`](crate::PgWakeups)) with a `NOTIFY` sent on `pool`, in a transaction of
    /// its own. Call it **after** committing rows enqueued on an outbox built
    /// [`without_notify`](Self::without_notify), in place of the `NOTIFY` each enqueue would
    /// otherwise send inside the business transaction.
    ///
    /// Why: a transaction that sends a `NOTIFY` holds a cluster-wide lock from just before
    /// its commit until its commit record is on disk, so notifying transactions commit one
    /// at a time instead of sharing a WAL flush. This wake-up's own transaction writes
    /// nothing and does not wait for its commit record to be flushed
    /// (`synchronous_commit = off`, for it alone), so it holds that lock only briefly, and
    /// the business transactions commit together again. A wake-up lost in a server crash
    /// costs only time: the dispatcher's idle poll finds the rows.
    ///
    /// Takes a pool, not a connection, so it can never run inside (and change the commit of)
    /// a business transaction.
    ///
    /// # Errors
    ///
    /// [`Error::Repository`] (operation `send a wake-up`) if the statement fails; the rows
    /// are committed either way.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use trellis_outbox::{Outbox, PreparedOutboxRecord};
    ///
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let outbox = Outbox::default().without_notify();
    /// let mut tx = pool.begin().await?;
    /// let event = PreparedOutboxRecord::event("Invoices.Paid", "events.v1.Invoices.Paid", &7)?;
    /// outbox.enqueue(&mut tx, &event).await?;
    /// tx.commit().await?;
    /// outbox.wake(&pool).await?; // the relay process's listener claims the row now
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    pub async fn wake(&self, pool: &sqlx::PgPool) -> Result<()> {
        crate::postgres::wakeup::wake(pool, self.sql(Dialect::Postgres).notify_channel())
            .await
            .map_err(Error::repository("send a wake-up"))
    }

    /// The tables this outbox uses.
    pub fn tables(&self) -> &OutboxTables {
        &self.inner.tables
    }

    /// The SQL this outbox sends in `dialect`.
    pub fn sql(&self, dialect: Dialect) -> &SqlStatements {
        match dialect {
            Dialect::Sqlite => &self.inner.sqlite,
            Dialect::Postgres => &self.inner.postgres,
        }
    }

    /// Writes `record` to the outbox inside `tx` (a `sqlx::Transaction` on Postgres or
    /// SQLite: the only types that implement [`OutboxTransactionExt`]) and returns the stored
    /// row.
    ///
    /// Idempotent on the record id: when a row with that id already exists with the same
    /// kind, name, subject, payload and headers (the `Trellis-Event-Time`, `traceparent` and
    /// `tracestate` headers may differ: a retried handler re-creates them), nothing is
    /// written and the row already stored is returned. When its content differs, the
    /// enqueue fails with [`Error::DuplicateIdentity`] instead of silently dropping the new
    /// message. Nothing is published before `tx` commits.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidRecord`] before any SQL if the record is invalid (the transaction stays
    /// usable), [`Error::Serialize`] if it cannot be built, [`Error::Enqueue`] if the database
    /// fails, [`Error::DuplicateIdentity`] if a row with the same id and different content
    /// exists, [`Error::StorageConflict`] if the insert conflicted but no row with the id can
    /// be read, [`Error::Decode`] if an existing row with the same id cannot be decoded.
    pub async fn enqueue<T, R>(&self, tx: &mut T, record: &R) -> Result<OutboxMessage>
    where
        T: OutboxTransactionExt + ?Sized,
        R: ToOutboxRecord + ?Sized,
    {
        let record = record.to_outbox_record()?;
        record.validate()?;
        let span = tracing::debug_span!("outbox_enqueue", id = %record.id, name = %record.name);
        T::Database::insert_one(tx.connection(), self.sql(T::Database::DIALECT), record)
            .instrument(span)
            .await
    }

    /// Writes a job request (made with `#[outbox_job]`) inside `tx` and returns what the
    /// caller needs to track it: the submission id (the record id), the job id, the queue and
    /// the mode. See [`OutboxJob::prepare_job`] for the record written (spec §D.2).
    ///
    /// # Errors
    ///
    /// As [`Outbox::enqueue`].
    pub async fn enqueue_job<T, J>(&self, tx: &mut T, job: &J) -> Result<JobSubmission>
    where
        T: OutboxTransactionExt + ?Sized,
        J: OutboxJob + ?Sized,
    {
        let (record, submission) = job.prepare_job()?;
        record.validate()?;
        T::Database::insert_one(tx.connection(), self.sql(T::Database::DIALECT), record).await?;
        Ok(submission)
    }

    /// Writes many records inside `tx` in as few statements as the database's bind-parameter
    /// limits allow, and returns the stored rows in input order.
    ///
    /// Every record is validated before any SQL is sent. Ids that already exist (or repeat
    /// within `records`) are not written again; their stored rows are returned when their
    /// content is the record's, as with [`Outbox::enqueue`].
    ///
    /// # Errors
    ///
    /// As [`Outbox::enqueue`]. On [`Error::DuplicateIdentity`] the other records of the call
    /// may already be written in `tx`: roll it back.
    pub async fn enqueue_all<T, I>(&self, tx: &mut T, records: I) -> Result<Vec<OutboxMessage>>
    where
        T: OutboxTransactionExt + ?Sized,
        I: IntoIterator,
        I::Item: ToOutboxRecord,
    {
        let records = prepare_all(records)?;
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let span = tracing::debug_span!("outbox_enqueue", rows = records.len());
        T::Database::insert_many(tx.connection(), self.sql(T::Database::DIALECT), records)
            .instrument(span)
            .await
    }

    /// Records `message_id` in the inbox inside `tx`: [`InboxReceipt::Accepted`] the first
    /// time, [`InboxReceipt::Duplicate`] after that.
    ///
    /// Atomic (`INSERT … ON CONFLICT DO NOTHING` and the affected-row count), so of several
    /// concurrent transactions recording the same id, exactly one that commits was told
    /// `Accepted`. Write your handler's effects in the same transaction.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidMessageId`] for an empty id, [`Error::RecordInbox`] if the database
    /// fails.
    pub async fn record_inbox<T>(&self, tx: &mut T, message_id: &str) -> Result<InboxReceipt>
    where
        T: OutboxTransactionExt + ?Sized,
    {
        check_message_id(message_id)?;
        let sql = &self.sql(T::Database::DIALECT).text.inbox_insert;
        let received_at = T::Database::time(now_millis());
        let affected = T::Database::execute_pair(tx.connection(), sql, message_id, received_at)
            .await
            .map_err(|source| Error::RecordInbox {
                message_id: message_id.to_owned(),
                source,
            })?;
        Ok(if affected == 1 {
            InboxReceipt::Accepted
        } else {
            metrics::counter!(crate::metrics::INBOX_DUPLICATES, "inbox" => self.tables().inbox().to_owned())
                .increment(1);
            InboxReceipt::Duplicate
        })
    }
}

pub(crate) fn prepare_all<I>(records: I) -> Result<Vec<PreparedOutboxRecord>>
where
    I: IntoIterator,
    I::Item: ToOutboxRecord,
{
    records
        .into_iter()
        .map(|r| {
            let record = r.to_outbox_record()?;
            record.validate()?;
            Ok(record)
        })
        .collect()
}

pub(crate) fn check_message_id(message_id: &str) -> Result<()> {
    let problem = if message_id.is_empty() {
        "is empty"
    } else if message_id.chars().any(char::is_control) {
        "contains control characters"
    } else {
        return Ok(());
    };
    Err(Error::InvalidMessageId {
        message_id: message_id.to_owned(),
        problem,
    })
}

/// Outbox operations on a transaction, using the default tables
/// (`trellis_outbox` / `trellis_inbox`). For other tables use an [`Outbox`].
///
/// Implemented for `sqlx::Transaction<'_, Postgres>` and `sqlx::Transaction<'_, Sqlite>` only,
/// never for a pool or a bare connection, so an event cannot be written outside the
/// transaction that writes the business change:
///
/// ```compile_fail
/// use trellis_outbox::{OutboxTransactionExt, PreparedOutboxRecord};
///
/// async fn wrong(pool: sqlx::PgPool, record: PreparedOutboxRecord) {
///     pool.enqueue(&record).await; // no `enqueue` on a pool
/// }
/// ```
///
/// # Examples
///
/// ```no_run
/// use trellis_outbox::{OutboxTransactionExt, PreparedOutboxRecord};
///
/// # async fn run(pool: sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO orders (id) VALUES ('o-1')").execute(&mut *tx).await?;
/// let event = PreparedOutboxRecord::event("Orders.Placed", "events.v1.Orders.Placed", &"o-1")?;
/// let stored = tx.enqueue(&event).await?;
/// tx.commit().await?;
/// assert_eq!(stored.id, event.id);
/// # Ok(()) }
/// ```
// `async fn` here is safe to call from spawned tasks: the trait is sealed, implemented for
// sqlx transactions only, and the futures of these bodies are `Send` for those (asserted by
// the tests' `transaction_futures_are_send`).
#[allow(async_fn_in_trait)]
pub trait OutboxTransactionExt: sealed_ext::Sealed {
    /// See [`Outbox::enqueue`].
    async fn enqueue<R>(&mut self, record: &R) -> Result<OutboxMessage>
    where
        R: ToOutboxRecord + ?Sized + Sync,
    {
        DEFAULT_OUTBOX.enqueue(self, record).await
    }

    /// See [`Outbox::enqueue_all`].
    async fn enqueue_all<I>(&mut self, records: I) -> Result<Vec<OutboxMessage>>
    where
        I: IntoIterator + Send,
        I::Item: ToOutboxRecord,
    {
        DEFAULT_OUTBOX.enqueue_all(self, records).await
    }

    /// See [`Outbox::record_inbox`].
    async fn record_inbox(&mut self, message_id: &str) -> Result<InboxReceipt> {
        DEFAULT_OUTBOX.record_inbox(self, message_id).await
    }

    /// See [`Outbox::enqueue_job`].
    async fn enqueue_job<J>(&mut self, job: &J) -> Result<JobSubmission>
    where
        J: OutboxJob + ?Sized + Sync,
    {
        DEFAULT_OUTBOX.enqueue_job(self, job).await
    }
}

impl<DB: OutboxDatabase> OutboxTransactionExt for Transaction<'_, DB> {}

mod sealed_ext {
    use crate::driver::OutboxDatabase;

    /// What the outbox needs of a transaction: its database and its connection. Only
    /// `sqlx::Transaction` has it, so nothing else can be written to.
    pub trait Sealed: Send {
        type Database: OutboxDatabase;
        fn connection(&mut self) -> &mut <Self::Database as sqlx::Database>::Connection;
    }

    impl<DB: OutboxDatabase> Sealed for sqlx::Transaction<'_, DB> {
        type Database = DB;
        fn connection(&mut self) -> &mut DB::Connection {
            self
        }
    }
}
