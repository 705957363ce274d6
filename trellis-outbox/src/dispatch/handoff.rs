//! Handing rows over at commit: a [`HandoffTransaction`] writes each unkeyed row already
//! leased to its dispatcher, and after the commit gives the rows to the dispatcher task,
//! which publishes them without claiming them first (`engine/handoff.rs`).
//!
//! Why it is safe:
//! - The row is written with the dispatcher's handoff token and a lease counted by the
//!   database's clock from the insert, so no other dispatcher claims it before the lease
//!   ends. The process counts the same lease from just before the insert was sent, so its
//!   deadline is never later than the database's.
//! - Rows are handed over only after the commit returned `Ok`: a rolled-back row is never
//!   published. The task publishes them under the lease like a claimed batch (extending it,
//!   fenced by the token, if it has too little left, and giving up if another dispatcher
//!   holds a row now) and marks them with the token.
//! - A row that is never handed over (the process died between commit and handoff, or the
//!   dispatcher stopped) is claimed by any dispatcher once its lease ends.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::{Pool, Transaction};
use sqlx_core::transaction::TransactionManager as _;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::Instrument as _;

use crate::dispatch::dispatcher::DispatcherHandle;
use crate::driver::OutboxDatabase;
use crate::driver::sealed::Lease;
use crate::error::{Error, Result};
use crate::job::{JobSubmission, OutboxJob};
use crate::outbox::Outbox;
use crate::record::{OutboxMessage, PreparedOutboxRecord, ToOutboxRecord};
use crate::tables::Dialect;

/// Where a dispatcher's [`HandoffTransaction`]s write: the outbox of its repository, on
/// which database, and whether rows also carry upstream Trellis' lease. Answered by
/// [`OutboxRepository::handoff_target`](crate::OutboxRepository::handoff_target) of the SQL
/// repositories; only this crate can build one.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HandoffTarget {
    pub(crate) outbox: Outbox,
    pub(crate) dialect: Dialect,
    pub(crate) beside_upstream: bool,
}

impl HandoffTarget {
    pub(crate) fn new(outbox: Outbox, dialect: Dialect, beside_upstream: bool) -> Self {
        Self {
            outbox,
            dialect,
            beside_upstream,
        }
    }

    /// The outbox (tables) handed-over rows are written to (without `NOTIFY`: the commit
    /// wakes the in-process dispatcher instead).
    pub fn outbox(&self) -> &Outbox {
        &self.outbox
    }

    /// The database the outbox is on.
    pub fn dialect(&self) -> Dialect {
        self.dialect
    }
}

/// Rows of one committed transaction, handed to the dispatcher task.
#[derive(Debug)]
pub(crate) struct Handoff {
    pub(crate) messages: Vec<OutboxMessage>,
    /// When their lease ends on this process's (tokio) clock: counted from before the first
    /// insert was sent.
    pub(crate) deadline: Instant,
}

/// The dispatcher's side of handoffs, shared by its handles.
#[derive(Debug)]
pub(crate) struct Lane {
    pub(crate) target: HandoffTarget,
    /// The fencing token every handed-over row is written with (one per dispatcher).
    pub(crate) token: Arc<str>,
    pub(crate) lease: Duration,
    pub(crate) rows: mpsc::UnboundedSender<Handoff>,
    /// Rows sent on `rows` and not yet taken by the lane.
    pub(crate) queued: Arc<AtomicUsize>,
    /// The most rows `queued` may reach; a commit that would pass it hands nothing over.
    pub(crate) max_queued: usize,
}

impl Lane {
    /// The lease handed-over rows are written with.
    fn lease(&self) -> Lease<'_> {
        Lease {
            token: &self.token,
            lease: self.lease,
            beside_upstream: self.target.beside_upstream,
        }
    }
}

/// A transaction whose events the in-process dispatcher publishes **right after its
/// commit**, without waiting for a claim: started by [`DispatcherHandle::begin`] or
/// [`DispatcherHandle::handoff`].
///
/// It dereferences to the connection, as [`sqlx::Transaction`] does, so business
/// statements run on `&mut *tx`. [`enqueue`](Self::enqueue) writes a record already leased
/// to the dispatcher; [`commit`](Self::commit) commits and then hands the rows over. On
/// Postgres that saves the claim between commit and publish (one round trip and a row
/// update per batch); the rows still go through the outbox table, so nothing is lost if the
/// process dies: a row never handed over is claimed by any dispatcher once its lease
/// ([`DispatchOptions::lease`](crate::DispatchOptions::lease), 30 s by default) ends.
///
/// Records with an ordering key take the usual path (a row may go only when it is its
/// key's head), and the commit then notifies the dispatcher. So do enqueues after the
/// dispatcher stopped.
///
/// Dropping the transaction without committing rolls it back, as sqlx does; nothing is
/// handed over.
///
/// # Examples
///
/// ```no_run
/// use trellis_outbox::{JetStreamPublisher, OutboxDispatcher, PgOutboxRepository, PreparedOutboxRecord};
///
/// # async fn run(pool: sqlx::PgPool, publisher: JetStreamPublisher) -> Result<(), Box<dyn std::error::Error>> {
/// let dispatcher = OutboxDispatcher::builder(PgOutboxRepository::new(pool.clone()), publisher).start()?;
/// let handle = dispatcher.handle(); // give clones to request handlers
///
/// // In a handler:
/// let mut tx = handle.begin(&pool).await?;
/// sqlx::query("UPDATE orders SET placed = true WHERE id = 7").execute(&mut *tx).await?;
/// tx.enqueue(&PreparedOutboxRecord::event("Orders.Placed", "events.v1.Orders.Placed", &7)?).await?;
/// tx.commit().await?; // published by the dispatcher right away
/// # Ok(()) }
/// ```
pub struct HandoffTransaction<'c, DB: OutboxDatabase> {
    tx: Transaction<'c, DB>,
    handle: DispatcherHandle,
    /// Rows written leased to the dispatcher.
    leased: Vec<OutboxMessage>,
    /// Just before the first leased insert was sent.
    since: Option<Instant>,
    /// Whether the commit should notify the dispatcher (rows that took the usual path).
    notify: bool,
}

impl<DB: OutboxDatabase> fmt::Debug for HandoffTransaction<'_, DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandoffTransaction")
            .field("leased", &self.leased.len())
            .field("notify", &self.notify)
            .finish_non_exhaustive()
    }
}

impl DispatcherHandle {
    /// Begins a transaction on `pool` whose events this dispatcher publishes right after the
    /// commit; see [`HandoffTransaction`].
    ///
    /// # Errors
    ///
    /// [`Error::Handoff`] if the dispatcher's repository is not an SQL repository on this
    /// kind of database; [`Error::Repository`] (operation `begin a handoff transaction`) if
    /// the transaction cannot be begun.
    pub async fn begin<DB: OutboxDatabase>(
        &self,
        pool: &Pool<DB>,
    ) -> Result<HandoffTransaction<'static, DB>> {
        self.lane::<DB>()?;
        let tx = pool
            .begin()
            .await
            .map_err(Error::repository("begin a handoff transaction"))?;
        self.handoff(tx)
    }

    /// Turns `tx` into a transaction whose events this dispatcher publishes right after the
    /// commit; see [`HandoffTransaction`]. `tx` must be on the dispatcher's database.
    ///
    /// # Errors
    ///
    /// [`Error::Handoff`] if the dispatcher's repository is not an SQL repository on this
    /// kind of database, or if `tx` is a savepoint (begun inside another transaction): its
    /// commit commits nothing until the outer transaction does, which may still roll back.
    /// The transaction is dropped, which rolls it back.
    pub fn handoff<'c, DB: OutboxDatabase>(
        &self,
        tx: Transaction<'c, DB>,
    ) -> Result<HandoffTransaction<'c, DB>> {
        self.lane::<DB>()?;
        if DB::TransactionManager::get_transaction_depth(&tx) > 1 {
            return Err(Error::Handoff {
                problem: "the transaction is a savepoint inside another transaction, whose \
                          rollback would undo rows already published: hand over the outer one",
            });
        }
        Ok(HandoffTransaction {
            tx,
            handle: self.clone(),
            leased: Vec::new(),
            since: None,
            notify: false,
        })
    }

    /// The dispatcher's handoff lane, if it takes handoffs on `DB`.
    fn lane<DB: OutboxDatabase>(&self) -> Result<&Lane> {
        let lane = self.handoffs().ok_or(Error::Handoff {
            problem: "its repository has no SQL outbox table (OutboxRepository::handoff_target is None)",
        })?;
        if lane.target.dialect != DB::DIALECT {
            return Err(Error::Handoff {
                problem: "the transaction is on another kind of database than the dispatcher's repository",
            });
        }
        Ok(lane)
    }
}

impl<'c, DB: OutboxDatabase> HandoffTransaction<'c, DB> {
    /// Writes `record` to the outbox inside the transaction, leased to the dispatcher, and
    /// returns the stored row; after [`commit`](Self::commit) the dispatcher publishes it.
    ///
    /// Idempotent on the record id like [`Outbox::enqueue`]: a row already stored with the
    /// same content is returned as it is, and handed over too if it is still waiting
    /// (`pending`, not leased, due: taking it is what a claim would do). A record with an
    /// ordering key is written as [`Outbox::enqueue`] writes it.
    ///
    /// # Errors
    ///
    /// As [`Outbox::enqueue`].
    pub async fn enqueue<R>(&mut self, record: &R) -> Result<OutboxMessage>
    where
        R: ToOutboxRecord + ?Sized,
    {
        let record = record.to_outbox_record()?;
        record.validate()?;
        self.write(record).await
    }

    /// Writes a job request (made with `#[outbox_job]`) inside the transaction, leased to
    /// the dispatcher; see [`Outbox::enqueue_job`].
    ///
    /// # Errors
    ///
    /// As [`Outbox::enqueue`].
    pub async fn enqueue_job<J>(&mut self, job: &J) -> Result<JobSubmission>
    where
        J: OutboxJob + ?Sized,
    {
        let (record, submission) = job.prepare_job()?;
        record.validate()?;
        self.write(record).await?;
        Ok(submission)
    }

    /// Writes many records inside the transaction in as few statements as the database's
    /// limits allow (as [`Outbox::enqueue_all`]), then leases the unkeyed ones to the
    /// dispatcher in one more statement; returns the stored rows in input order. After
    /// [`commit`](Self::commit) the dispatcher publishes the leased rows.
    ///
    /// The lease statement takes every row of the call that is `pending`, not leased and due:
    /// the rows just written, and a row already stored with the same id and content that is
    /// still waiting (taking it is what a claim would do). Rows it cannot take (keyed, or
    /// stored and leased elsewhere, failed or done) take the usual path, and the commit then
    /// notifies the dispatcher.
    ///
    /// # Errors
    ///
    /// As [`Outbox::enqueue_all`].
    pub async fn enqueue_all<I>(&mut self, records: I) -> Result<Vec<OutboxMessage>>
    where
        I: IntoIterator,
        I::Item: ToOutboxRecord,
    {
        let records = crate::outbox::prepare_all(records)?;
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let lane = self.handle.lane::<DB>()?;
        let sql = lane.target.outbox.sql(DB::DIALECT);
        let span = tracing::debug_span!("outbox_enqueue", rows = records.len());
        let stopped = self.handle.is_stopped();
        let mut unkeyed: Vec<String> = records
            .iter()
            .filter(|r| r.ordering.is_none())
            .map(|r| r.id.clone())
            .collect();
        unkeyed.sort_unstable();
        unkeyed.dedup();
        let stored = DB::insert_many(&mut self.tx, sql, records)
            .instrument(span)
            .await?;
        if stopped || unkeyed.is_empty() {
            self.notify = true;
            return Ok(stored);
        }
        self.since.get_or_insert_with(Instant::now);
        let lease = lane.lease();
        let ids: Vec<&str> = unkeyed.iter().map(String::as_str).collect();
        let leased = DB::lease_rows(&mut self.tx, sql, &ids, lease).await?;
        if leased.len() < stored.len() {
            self.notify = true;
        }
        let leased: std::collections::HashSet<String> = leased.into_iter().collect();
        let mut handed = std::collections::HashSet::new();
        for message in &stored {
            if leased.contains(&message.id) && handed.insert(message.id.as_str()) {
                self.leased.push(message.clone());
            }
        }
        Ok(stored)
    }

    async fn write(&mut self, record: PreparedOutboxRecord) -> Result<OutboxMessage> {
        let lane = self.handle.lane::<DB>()?;
        let sql = lane.target.outbox.sql(DB::DIALECT);
        let span = tracing::debug_span!("outbox_enqueue", id = %record.id, name = %record.name);
        if record.ordering.is_some() || self.handle.is_stopped() {
            self.notify = true;
            return DB::insert_one(&mut self.tx, sql, record)
                .instrument(span)
                .await;
        }
        self.since.get_or_insert_with(Instant::now);
        let lease = lane.lease();
        let (message, inserted) = DB::insert_leased(&mut self.tx, sql, record, lease)
            .instrument(span)
            .await?;
        // A row already stored with this id and content: taken too if it is still waiting,
        // as a claim would take it.
        let leased = inserted
            || !DB::lease_rows(&mut self.tx, sql, &[message.id.as_str()], lease)
                .await?
                .is_empty();
        if leased {
            self.leased.push(message.clone());
        } else {
            self.notify = true;
        }
        Ok(message)
    }

    /// The underlying transaction, for other outbox calls (e.g.
    /// [`record_inbox`](crate::OutboxTransactionExt::record_inbox)). Rows written through it
    /// take the usual path: the commit then also notifies the dispatcher.
    pub fn transaction(&mut self) -> &mut Transaction<'c, DB> {
        self.notify = true;
        &mut self.tx
    }

    /// How many rows the commit will hand over.
    pub fn handed_over(&self) -> usize {
        self.leased.len()
    }

    /// Commits the transaction, then hands its leased rows to the dispatcher (and notifies
    /// it if rows took the usual path). Nothing is handed over if the commit fails: the
    /// rows, if the commit did happen, are claimed once their lease ends.
    ///
    /// On Postgres, with rows to hand over, the commit first checks that no statement failed
    /// in the transaction: Postgres answers the `COMMIT` of an aborted transaction with a
    /// rollback that sqlx reports as success, and its rows must not be published.
    ///
    /// # Errors
    ///
    /// The commit's error, as [`sqlx::Transaction::commit`]; on Postgres, the server's
    /// `current transaction is aborted` error (SQLSTATE `25P02`) if a statement failed in
    /// the transaction (it is rolled back).
    pub async fn commit(self) -> std::result::Result<(), sqlx::Error> {
        let Self {
            mut tx,
            handle,
            leased,
            since,
            notify,
        } = self;
        if !leased.is_empty() {
            DB::check_committable(&mut tx).await?;
        }
        tx.commit().await?;
        if let (Some(since), false) = (since, leased.is_empty())
            && let Some(lane) = handle.handoffs()
        {
            let handoff = Handoff {
                messages: leased,
                deadline: crate::dispatch::engine::deadline(since, lane.lease),
            };
            // Memory stays bounded while the lane falls behind (a broker that stalls):
            // past the bound, the rows are left to whoever claims them after their lease.
            let rows = handoff.messages.len();
            if lane.queued.fetch_add(rows, Ordering::AcqRel) + rows > lane.max_queued {
                lane.queued.fetch_sub(rows, Ordering::AcqRel);
                ::metrics::counter!(crate::metrics::HANDOFF_OVERFLOW_ROWS).increment(rows as u64);
                tracing::debug!(
                    rows,
                    "outbox dispatcher has too many handed-over rows waiting: these wait for their lease"
                );
            } else if lane.rows.send(handoff).is_err() {
                // A stopped dispatcher leaves the rows to whoever claims them after the lease.
                lane.queued.fetch_sub(rows, Ordering::AcqRel);
                tracing::debug!("outbox dispatcher stopped: handed-over rows wait for their lease");
            }
        }
        if notify {
            handle.notify();
        }
        Ok(())
    }

    /// Rolls the transaction back; nothing is handed over.
    ///
    /// # Errors
    ///
    /// The rollback's error, as [`sqlx::Transaction::rollback`].
    pub async fn rollback(self) -> std::result::Result<(), sqlx::Error> {
        self.tx.rollback().await
    }
}

impl<DB: OutboxDatabase> Deref for HandoffTransaction<'_, DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &Self::Target {
        &self.tx
    }
}

impl<DB: OutboxDatabase> DerefMut for HandoffTransaction<'_, DB> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.tx
    }
}
