//! An in-memory [`OutboxRepository`] for tests and examples.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

use crate::dispatch::repository::{Claim, Dispatched, OutboxRepository, PoisonRow, RetryOutcome};
use crate::error::Result;
use crate::record::{OutboxMessage, OutboxMessageState, ToOutboxRecord, new_id};

/// An [`OutboxRepository`] that keeps rows in memory, with the same leases, fencing tokens,
/// ordering and due rules as the SQL repositories. Meant for users' tests and examples;
/// nothing is persisted.
///
/// # Clock
///
/// The repository's clock follows **tokio's** clock: it is the wall time captured when the
/// repository was created (or the time given to [`starting_at`](Self::starting_at)) plus the
/// [`tokio::time::Instant`] time elapsed since then, truncated to milliseconds. Under
/// `tokio::time::pause()` it therefore stands still and moves only with
/// `tokio::time::advance()` (or auto-advance), so retry schedules, leases and debounces can
/// be tested deterministically. Outside a paused runtime it moves like the system clock.
///
/// # Examples
///
/// ```
/// use trellis_outbox::{MemoryOutboxRepository, OutboxMessageState, PreparedOutboxRecord};
///
/// let repo = MemoryOutboxRepository::new();
/// let record = PreparedOutboxRecord::event("Orders.Placed", "events.v1.Orders.Placed", &1)?;
/// let stored = repo.enqueue(&record)?;
/// assert_eq!(stored.state, OutboxMessageState::Pending);
/// // Enqueueing the same id again returns the stored row and changes nothing.
/// assert_eq!(repo.enqueue(&record)?, stored);
/// assert_eq!(repo.snapshot().len(), 1);
/// # Ok::<(), trellis_outbox::Error>(())
/// ```
#[derive(Debug)]
pub struct MemoryOutboxRepository {
    epoch_wall: DateTime<Utc>,
    epoch_instant: tokio::time::Instant,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Rows in insertion order.
    rows: Vec<Row>,
    /// Row id → index in `rows`.
    index: HashMap<String, usize>,
}

#[derive(Debug)]
struct Row {
    message: OutboxMessage,
    claimed_until: Option<DateTime<Utc>>,
    claim_token: Option<String>,
    /// Set for rows stored with [`MemoryOutboxRepository::enqueue_undecodable`].
    poison: Option<String>,
}

impl Row {
    fn is_open(&self) -> bool {
        matches!(
            self.message.state,
            OutboxMessageState::Pending | OutboxMessageState::Failed
        )
    }

    /// Whether `token` still holds this row.
    fn held_by(&self, token: &str) -> bool {
        self.is_open() && self.claim_token.as_deref() == Some(token)
    }

    /// When the row becomes claimable: the later of its retry time and lease expiry.
    fn claimable_at(&self) -> Option<DateTime<Utc>> {
        match (self.message.next_attempt_at, self.claimed_until) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    fn release_lease(&mut self) {
        self.claimed_until = None;
        self.claim_token = None;
    }
}

impl Default for MemoryOutboxRepository {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryOutboxRepository {
    /// An empty repository whose clock starts at the current wall time.
    pub fn new() -> Self {
        Self::starting_at(Utc::now())
    }

    /// An empty repository whose clock reads `start` now (truncated to milliseconds) and
    /// then advances with tokio's clock. Useful for exact timestamps in tests.
    ///
    /// ```
    /// use chrono::{TimeZone, Utc};
    /// use trellis_outbox::MemoryOutboxRepository;
    ///
    /// let start = Utc.with_ymd_and_hms(2026, 5, 25, 0, 0, 0).unwrap();
    /// let repo = MemoryOutboxRepository::starting_at(start);
    /// assert!(repo.now() >= start);
    /// ```
    pub fn starting_at(start: DateTime<Utc>) -> Self {
        Self {
            epoch_wall: truncate_millis(start),
            epoch_instant: tokio::time::Instant::now(),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// The repository's current time (see [Clock](Self#clock)), in whole milliseconds.
    pub fn now(&self) -> DateTime<Utc> {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.epoch_instant);
        truncate_millis(add(self.epoch_wall, elapsed))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves every row in a consistent state (each
        // mutation is a plain field assignment), so the poison is ignored.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Stores `record` as a `pending` row, or returns the stored row unchanged if its id
    /// already exists (idempotent on id). Returns a copy of the stored row. `created_at` and
    /// `updated_at` are the repository's [clock](Self#clock).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidRecord`](crate::Error::InvalidRecord) if the record fails
    /// [`PreparedOutboxRecord::validate`](crate::PreparedOutboxRecord::validate), or the
    /// record's own error if it cannot be built.
    pub fn enqueue(&self, record: &impl ToOutboxRecord) -> Result<OutboxMessage> {
        self.insert(record, None)
    }

    /// Stores `record` as a row that every claim reports as undecodable (in
    /// [`Claim::poisoned`] with `reason`), as a corrupt SQL row would be. For testing how a
    /// dispatcher isolates poison rows. Idempotent on id like [`enqueue`](Self::enqueue).
    ///
    /// # Errors
    ///
    /// As [`enqueue`](Self::enqueue).
    pub fn enqueue_undecodable(
        &self,
        record: &impl ToOutboxRecord,
        reason: impl Into<String>,
    ) -> Result<OutboxMessage> {
        self.insert(record, Some(reason.into()))
    }

    fn insert(
        &self,
        record: &impl ToOutboxRecord,
        poison: Option<String>,
    ) -> Result<OutboxMessage> {
        let record = record.to_outbox_record()?;
        record.validate()?;
        let now = self.now();
        let mut inner = self.lock();
        if let Some(&i) = inner.index.get(&record.id) {
            return Ok(inner.rows[i].message.clone());
        }
        let message = OutboxMessage::pending(record, now);
        let i = inner.rows.len();
        inner.index.insert(message.id.clone(), i);
        inner.rows.push(Row {
            message: message.clone(),
            claimed_until: None,
            claim_token: None,
            poison,
        });
        Ok(message)
    }

    /// Copies of every row, in insertion order.
    pub fn snapshot(&self) -> Vec<OutboxMessage> {
        self.lock().rows.iter().map(|r| r.message.clone()).collect()
    }

    /// A copy of the row with `id`, if any.
    pub fn get(&self, id: &str) -> Option<OutboxMessage> {
        let inner = self.lock();
        inner.index.get(id).map(|&i| inner.rows[i].message.clone())
    }

    /// Whether the row with `id` is currently leased (claimed and its lease not expired).
    pub fn is_leased(&self, id: &str) -> bool {
        let now = self.now();
        let inner = self.lock();
        inner.index.get(id).is_some_and(|&i| {
            let row = &inner.rows[i];
            row.is_open() && row.claimed_until.is_some_and(|until| until > now)
        })
    }

    /// Applies `change` to every row of `ids` still held by `claim`; returns how many.
    fn with_held(
        &self,
        claim: &Claim,
        ids: impl IntoIterator<Item = impl AsRef<str>>,
        mut change: impl FnMut(&mut Row, DateTime<Utc>),
    ) -> u64 {
        let now = self.now();
        let mut inner = self.lock();
        let mut changed = 0;
        for id in ids {
            let Some(&i) = inner.index.get(id.as_ref()) else {
                continue;
            };
            let row = &mut inner.rows[i];
            if row.held_by(&claim.token) {
                change(row, now);
                row.message.updated_at = now;
                row.release_lease();
                changed += 1;
            }
        }
        changed
    }
}

impl OutboxRepository for MemoryOutboxRepository {
    async fn claim_due(
        &self,
        limit: usize,
        lease: Duration,
        cutoff: Option<DateTime<Utc>>,
    ) -> Result<Claim> {
        let now = self.now();
        let cutoff = cutoff.unwrap_or(now);
        let token = new_id();
        let mut inner = self.lock();
        let mut due: Vec<usize> = inner
            .rows
            .iter()
            .enumerate()
            .filter(|(_, row)| {
                row.is_open()
                    && row.message.next_attempt_at.is_none_or(|at| at <= cutoff)
                    && row.claimed_until.is_none_or(|until| until <= now)
            })
            .map(|(i, _)| i)
            .collect();
        due.sort_by(|&a, &b| {
            let (a, b) = (&inner.rows[a].message, &inner.rows[b].message);
            (a.created_at, &a.id).cmp(&(b.created_at, &b.id))
        });
        due.truncate(limit);
        let mut claim = Claim::empty(token, cutoff);
        let until = add(now, lease);
        for i in due {
            let row = &mut inner.rows[i];
            row.claimed_until = Some(until);
            row.claim_token = Some(claim.token.clone());
            match &row.poison {
                Some(reason) => claim.poisoned.push(PoisonRow {
                    id: row.message.id.clone(),
                    reason: reason.clone(),
                }),
                None => claim.push_message(row.message.clone()),
            }
        }
        Ok(claim)
    }

    async fn mark_dispatched(&self, claim: &Claim, rows: &[Dispatched]) -> Result<u64> {
        let outcomes: HashMap<&str, &Option<serde_json::Value>> =
            rows.iter().map(|r| (r.id.as_str(), &r.outcome)).collect();
        Ok(self.with_held(claim, rows.iter().map(|r| &r.id), |row, _| {
            let m = &mut row.message;
            m.state = OutboxMessageState::Dispatched;
            m.next_attempt_at = None;
            m.last_error = None;
            m.outcome = outcomes.get(m.id.as_str()).copied().cloned().flatten();
        }))
    }

    async fn mark_failed(
        &self,
        claim: &Claim,
        id: &str,
        error: &str,
        retry_after: Duration,
    ) -> Result<bool> {
        Ok(self.with_held(claim, [id], |row, now| {
            let m = &mut row.message;
            m.state = OutboxMessageState::Failed;
            m.attempts = m.attempts.saturating_add(1);
            m.last_error = Some(error.to_owned());
            m.next_attempt_at = Some(truncate_millis(add(now, retry_after)));
        }) == 1)
    }

    async fn mark_dead(
        &self,
        claim: &Claim,
        id: &str,
        reason: &str,
        count_attempt: bool,
    ) -> Result<bool> {
        Ok(self.with_held(claim, [id], |row, _| {
            let m = &mut row.message;
            m.state = OutboxMessageState::Dead;
            if count_attempt {
                m.attempts = m.attempts.saturating_add(1);
            }
            m.last_error = Some(reason.to_owned());
            m.next_attempt_at = None;
        }) == 1)
    }

    fn extends_leases(&self) -> bool {
        true
    }

    async fn extend_lease(&self, claim: &Claim, ids: &[&str], lease: Duration) -> Result<u64> {
        let until = add(self.now(), lease);
        let mut inner = self.lock();
        let mut extended = 0;
        for id in ids {
            if let Some(&i) = inner.index.get(*id) {
                let row = &mut inner.rows[i];
                if row.held_by(&claim.token) {
                    row.claimed_until = Some(until);
                    extended += 1;
                }
            }
        }
        Ok(extended)
    }

    async fn release(&self, claim: &Claim, ids: &[&str]) -> Result<u64> {
        let mut inner = self.lock();
        let mut released = 0;
        for id in ids {
            if let Some(&i) = inner.index.get(*id) {
                let row = &mut inner.rows[i];
                if row.held_by(&claim.token) {
                    row.release_lease();
                    released += 1;
                }
            }
        }
        Ok(released)
    }

    async fn retry(&self, id: &str) -> Result<RetryOutcome> {
        let now = self.now();
        let mut inner = self.lock();
        let Some(&i) = inner.index.get(id) else {
            return Ok(RetryOutcome::NotFound);
        };
        let row = &mut inner.rows[i];
        if !matches!(
            row.message.state,
            OutboxMessageState::Dead | OutboxMessageState::Failed
        ) {
            return Ok(RetryOutcome::NotRetryable {
                state: row.message.state.as_str().to_owned(),
            });
        }
        if let (Some(until), Some(_)) = (row.claimed_until, &row.claim_token)
            && until > now
        {
            return Ok(RetryOutcome::Leased { until });
        }
        row.message.state = OutboxMessageState::Pending;
        row.message.attempts = 0;
        row.message.next_attempt_at = None;
        row.message.updated_at = now;
        row.poison = None;
        row.release_lease();
        Ok(RetryOutcome::Retried)
    }

    async fn next_due_in(&self) -> Result<Option<Duration>> {
        let now = self.now();
        let inner = self.lock();
        let mut earliest: Option<Duration> = None;
        for row in inner.rows.iter().filter(|r| r.is_open()) {
            let wait = match row.claimable_at() {
                Some(at) if at > now => (at - now).to_std().unwrap_or(Duration::MAX),
                _ => Duration::ZERO,
            };
            earliest = Some(earliest.map_or(wait, |e| e.min(wait)));
            if wait.is_zero() {
                break;
            }
        }
        Ok(earliest)
    }

    /// `true`: claims and marks take a lock for microseconds, so the dispatcher overlaps
    /// batches here as it does on Postgres (tests exercise the same pipeline).
    fn overlaps_batches(&self) -> bool {
        true
    }
}

/// `time + duration`, saturating at the largest representable time.
fn add(time: DateTime<Utc>, duration: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(duration)
        .ok()
        .and_then(|d| time.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

fn truncate_millis(time: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(time.timestamp_millis()).unwrap_or(time)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::PreparedOutboxRecord;
    use chrono::TimeZone;

    const LEASE: Duration = Duration::from_secs(30);
    const SEC: Duration = Duration::from_secs(1);

    fn start() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 5, 25, 0, 0, 0).unwrap()
    }

    fn record(id: &str) -> PreparedOutboxRecord {
        let mut r =
            PreparedOutboxRecord::event("Thing.Changed", "events.v1.Thing.Changed", &1).unwrap();
        r.id = id.to_owned();
        r
    }

    fn ids(claim: &Claim) -> Vec<&str> {
        claim.messages.iter().map(|m| m.id.as_str()).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn clock_follows_tokio_time() {
        let repo = MemoryOutboxRepository::starting_at(start());
        assert_eq!(repo.now(), start());
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(repo.now(), start() + TimeDelta::milliseconds(1500));
    }

    #[tokio::test(start_paused = true)]
    async fn enqueue_is_idempotent_and_validates() {
        let repo = MemoryOutboxRepository::starting_at(start());
        let first = repo.enqueue(&record("a")).unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        let mut changed = record("a");
        changed.payload = "2".into();
        assert_eq!(repo.enqueue(&changed).unwrap(), first);
        assert_eq!(repo.get("a").unwrap().payload, "1");
        let mut bad = record("b");
        bad.subject = "a.*".into();
        assert!(matches!(
            repo.enqueue(&bad),
            Err(crate::Error::InvalidRecord { .. })
        ));
        assert_eq!(repo.snapshot().len(), 1);
        assert!(repo.get("b").is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn claims_in_created_at_then_id_order_and_leases() {
        let repo = MemoryOutboxRepository::starting_at(start());
        repo.enqueue(&record("z-old")).unwrap();
        tokio::time::advance(Duration::from_millis(1)).await;
        for id in ["c", "a", "b"] {
            repo.enqueue(&record(id)).unwrap();
        }
        let first = repo.claim_due(3, LEASE, None).await.unwrap();
        assert_eq!(ids(&first), ["z-old", "a", "b"]);
        assert!(repo.is_leased("a"));
        let second = repo.claim_due(10, LEASE, None).await.unwrap();
        assert_eq!(ids(&second), ["c"]);
        assert_ne!(first.token, second.token);
        assert!(repo.claim_due(10, LEASE, None).await.unwrap().is_empty());
        assert!(repo.claim_due(0, LEASE, None).await.unwrap().is_empty());
        // Every row is leased: the next one is claimable when the leases expire.
        assert_eq!(repo.next_due_in().await.unwrap(), Some(LEASE));
        tokio::time::advance(LEASE).await;
        assert_eq!(repo.next_due_in().await.unwrap(), Some(Duration::ZERO));
        assert_eq!(repo.claim_due(10, LEASE, None).await.unwrap().len(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn expired_lease_is_reclaimed_and_stale_token_cannot_mark() {
        let repo = MemoryOutboxRepository::starting_at(start());
        repo.enqueue(&record("a")).unwrap();
        let stale = repo.claim_due(10, LEASE, None).await.unwrap();
        tokio::time::advance(LEASE).await;
        let fresh = repo.claim_due(10, LEASE, None).await.unwrap();
        assert_eq!(ids(&fresh), ["a"]);
        assert_eq!(
            repo.mark_dispatched(&stale, &[Dispatched::new("a")])
                .await
                .unwrap(),
            0
        );
        assert!(!repo.mark_failed(&stale, "a", "x", LEASE).await.unwrap());
        assert!(!repo.mark_dead(&stale, "a", "x", true).await.unwrap());
        assert_eq!(repo.release(&stale, &["a"]).await.unwrap(), 0);
        assert_eq!(repo.get("a").unwrap().state, OutboxMessageState::Pending);
        let outcome = serde_json::json!({"ok": true});
        assert_eq!(
            repo.mark_dispatched(&fresh, &[Dispatched::with_outcome("a", outcome.clone())])
                .await
                .unwrap(),
            1
        );
        let row = repo.get("a").unwrap();
        assert_eq!(row.state, OutboxMessageState::Dispatched);
        assert_eq!(row.outcome, Some(outcome));
        assert_eq!(row.updated_at, start() + TimeDelta::seconds(30));
        assert!(!repo.is_leased("a"));
        // A second mark with the same token changes nothing: the lease is gone.
        assert_eq!(
            repo.mark_dispatched(&fresh, &[Dispatched::new("a")])
                .await
                .unwrap(),
            0
        );
        assert_eq!(repo.next_due_in().await.unwrap(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn failed_rows_respect_next_attempt_and_cutoff() {
        let repo = MemoryOutboxRepository::starting_at(start());
        repo.enqueue(&record("a")).unwrap();
        let claim = repo.claim_due(10, LEASE, None).await.unwrap();
        assert_eq!(claim.cutoff, start());
        assert!(
            repo.mark_failed(&claim, "a", "boom", Duration::from_secs(5))
                .await
                .unwrap()
        );
        let row = repo.get("a").unwrap();
        assert_eq!(row.state, OutboxMessageState::Failed);
        assert_eq!(row.attempts, 1);
        assert_eq!(row.last_error.as_deref(), Some("boom"));
        assert_eq!(row.next_attempt_at, Some(start() + TimeDelta::seconds(5)));
        assert_eq!(
            repo.next_due_in().await.unwrap(),
            Some(Duration::from_secs(5))
        );
        tokio::time::advance(Duration::from_secs(5)).await;
        // Due now, but not for a claim that keeps the old wave's cutoff.
        assert!(
            repo.claim_due(10, LEASE, Some(claim.cutoff))
                .await
                .unwrap()
                .is_empty()
        );
        assert_eq!(repo.next_due_in().await.unwrap(), Some(Duration::ZERO));
        let again = repo.claim_due(10, LEASE, None).await.unwrap();
        assert_eq!(ids(&again), ["a"]);
        assert_eq!(again.messages[0].attempts, 1);
        assert!(repo.mark_dead(&again, "a", "gave up", true).await.unwrap());
        let row = repo.get("a").unwrap();
        assert_eq!(
            (row.state, row.attempts, row.last_error.as_deref()),
            (OutboxMessageState::Dead, 2, Some("gave up"))
        );
        assert!(repo.claim_due(10, LEASE, None).await.unwrap().is_empty());
        assert_eq!(repo.next_due_in().await.unwrap(), None);
        // An operator's retry makes it pending and due at once.
        assert_eq!(repo.retry("a").await.unwrap(), RetryOutcome::Retried);
        assert_eq!(
            repo.retry("a").await.unwrap(),
            RetryOutcome::NotRetryable {
                state: "pending".into()
            }
        );
        assert_eq!(repo.retry("missing").await.unwrap(), RetryOutcome::NotFound);
        let row = repo.get("a").unwrap();
        assert_eq!((row.state, row.attempts), (OutboxMessageState::Pending, 0));
        assert_eq!(repo.next_due_in().await.unwrap(), Some(Duration::ZERO));
    }

    // Issue #10 defect 7: an operator's retry must not reset a failed row a dispatcher
    // holds again, or the holder's marks are fenced out while another claim publishes it.
    #[tokio::test(start_paused = true)]
    async fn retry_refuses_a_row_under_a_live_lease() {
        let repo = MemoryOutboxRepository::starting_at(start());
        repo.enqueue(&record("a")).unwrap();
        let first = repo.claim_due(10, LEASE, None).await.unwrap();
        assert!(repo.mark_failed(&first, "a", "boom", SEC).await.unwrap());
        tokio::time::advance(SEC).await;
        let holder = repo.claim_due(10, LEASE, None).await.unwrap();
        assert_eq!(ids(&holder), ["a"]);
        let until = start() + TimeDelta::seconds(31);
        assert_eq!(
            repo.retry("a").await.unwrap(),
            RetryOutcome::Leased { until }
        );
        assert!(repo.claim_due(10, LEASE, None).await.unwrap().is_empty());
        // The holder still owns the row: its mark lands.
        assert!(repo.mark_failed(&holder, "a", "again", SEC).await.unwrap());
        assert_eq!(repo.get("a").unwrap().attempts, 2);
        // A lease that expired does not hold the row.
        tokio::time::advance(SEC).await;
        let lapsed = repo.claim_due(10, LEASE, None).await.unwrap();
        assert_eq!(ids(&lapsed), ["a"]);
        tokio::time::advance(LEASE).await;
        assert_eq!(repo.retry("a").await.unwrap(), RetryOutcome::Retried);
        let row = repo.get("a").unwrap();
        assert_eq!((row.state, row.attempts), (OutboxMessageState::Pending, 0));
        assert!(!repo.mark_failed(&lapsed, "a", "late", SEC).await.unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn next_due_in_is_the_earliest_deadline() {
        let repo = MemoryOutboxRepository::starting_at(start());
        for id in ["late", "early"] {
            repo.enqueue(&record(id)).unwrap();
        }
        let claim = repo.claim_due(10, LEASE, None).await.unwrap();
        assert!(
            repo.mark_failed(&claim, "late", "x", Duration::from_secs(9))
                .await
                .unwrap()
        );
        assert!(
            repo.mark_failed(&claim, "early", "x", Duration::from_secs(2))
                .await
                .unwrap()
        );
        assert_eq!(
            repo.next_due_in().await.unwrap(),
            Some(Duration::from_secs(2))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn poisoned_rows_and_release() {
        let repo = MemoryOutboxRepository::starting_at(start());
        repo.enqueue_undecodable(&record("a-bad"), "unknown kind \"job.cancel\"")
            .unwrap();
        repo.enqueue(&record("b")).unwrap();
        let claim = repo.claim_due(10, LEASE, None).await.unwrap();
        assert_eq!(ids(&claim), ["b"]);
        assert_eq!(claim.poisoned.len(), 1);
        assert_eq!(claim.poisoned[0].id, "a-bad");
        assert_eq!(claim.len(), 2);
        assert_eq!(repo.release(&claim, &["b", "missing"]).await.unwrap(), 1);
        assert!(!repo.is_leased("b"));
        assert!(
            repo.mark_dead(&claim, "a-bad", "unknown kind", false)
                .await
                .unwrap()
        );
        assert_eq!(repo.get("a-bad").unwrap().attempts, 0);
        let again = repo.claim_due(10, LEASE, None).await.unwrap();
        assert_eq!(ids(&again), ["b"]);
        assert!(again.poisoned.is_empty());
    }
}
