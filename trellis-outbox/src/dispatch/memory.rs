//! An in-memory [`OutboxRepository`] for tests and examples.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::dispatch::repository::{
    Backlog, Claim, ClaimRequest, Dispatched, Failure, FailureOutcome, OutboxRepository, PoisonRow,
    RetryOutcome,
};
use crate::dispatch::run_limit;
use crate::error::Result;
use crate::record::{
    HeadOfLine, OrderingKey, OutboxMessage, OutboxMessageState, ToOutboxRecord, new_id,
};
use crate::time::add_saturating;

/// An [`OutboxRepository`] that keeps rows in memory, with the same leases, fencing tokens,
/// ordering (including per-key ordering: [`OrderingKey`]) and due rules as the SQL
/// repositories. Like the Postgres claim, a claim takes *runs* of a key (its claimable rows
/// from the head on, up to 1/64 of the limit but at least 16) and the rows behind keyed rows
/// the caller has published ([`ClaimRequest::published`]), ordered for publishing in rounds.
/// Meant for users' tests and examples; nothing is persisted.
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
    /// The record's ordering key: rows are kept in insertion order, which is commit order
    /// here (each enqueue is atomic), so a key's rows are ordered by their place in `rows`.
    ordering: Option<OrderingKey>,
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

    /// Whether this row holds back the later rows of its key: it is not dispatched, and
    /// not a dead row whose policy lets them pass.
    fn holds_key(&self) -> bool {
        match self.message.state {
            OutboxMessageState::Dispatched => false,
            OutboxMessageState::Dead => self
                .ordering
                .as_ref()
                .is_none_or(|o| o.head_of_line != HeadOfLine::SkipDead),
            _ => true,
        }
    }

    fn release_lease(&mut self) {
        self.claimed_until = None;
        self.claim_token = None;
    }

    /// What every mark does besides changing the row: stamps `updated_at` and releases the
    /// lease, so the row is no longer held by the claim that marked it.
    fn settle(&mut self, now: DateTime<Utc>) {
        self.message.updated_at = now;
        self.release_lease();
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
        truncate_millis(add_saturating(self.epoch_wall, elapsed))
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
        let ordering = record.ordering.clone();
        let message = OutboxMessage::pending(record, now);
        let i = inner.rows.len();
        inner.index.insert(message.id.clone(), i);
        inner.rows.push(Row {
            message: message.clone(),
            claimed_until: None,
            claim_token: None,
            poison,
            ordering,
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

    /// Applies `change` to every row of `ids` still held by `claim` (the fence every mark,
    /// extension and release goes through); returns how many rows it changed.
    fn for_held(
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
                changed += 1;
            }
        }
        changed
    }

    /// Marks one failed row as `failure` says; `true` if the claim still held it.
    fn mark_held_failure(&self, claim: &Claim, failure: &Failure) -> bool {
        self.for_held(claim, [&failure.id], |row, now| {
            let m = &mut row.message;
            let (state, counts, next_attempt_at) = match failure.outcome {
                FailureOutcome::Retry { after } => (
                    OutboxMessageState::Failed,
                    true,
                    Some(truncate_millis(add_saturating(now, after))),
                ),
                FailureOutcome::Dead { count_attempt } => {
                    (OutboxMessageState::Dead, count_attempt, None)
                }
            };
            m.state = state;
            if counts {
                m.attempts = m.attempts.saturating_add(1);
            }
            m.last_error = Some(failure.error.clone());
            m.next_attempt_at = next_attempt_at;
            row.settle(now);
        }) == 1
    }
}

impl OutboxRepository for MemoryOutboxRepository {
    async fn claim(&self, request: ClaimRequest) -> Result<Claim> {
        let now = self.now();
        let cutoff = request.cutoff.unwrap_or(now);
        let token = new_id();
        let published: HashSet<&str> = request.published.iter().map(String::as_str).collect();
        let run_limit = run_limit(request.limit);
        let mut inner = self.lock();
        // As the Postgres claim: a key's *run*, its rows that hold it back from the head on,
        // as long as each is claimable, at most `run_limit` of them. The keys whose run has
        // ended (a row holding the key back that is not claimable now) and each open key's
        // run so far.
        let mut ended: HashSet<&str> = HashSet::new();
        let mut runs: HashMap<&str, Vec<usize>> = HashMap::new();
        // Keys in the order their first row was written (the walk's order here).
        let mut walk: Vec<&str> = Vec::new();
        let mut due: Vec<usize> = Vec::new();
        for (i, row) in inner.rows.iter().enumerate() {
            let claimable = row.is_open()
                && row.message.next_attempt_at.is_none_or(|at| at <= cutoff)
                && row.claimed_until.is_none_or(|until| until <= now);
            let Some(key) = row.ordering.as_ref().map(|o| o.key.as_str()) else {
                if claimable {
                    due.push(i);
                }
                continue;
            };
            if ended.contains(key) {
                continue;
            }
            // Published rows still being marked count as dispatched.
            let holds = row.holds_key() && !published.contains(row.message.id.as_str());
            let run = runs.entry(key).or_insert_with(|| {
                walk.push(key);
                Vec::new()
            });
            if claimable && run.len() < run_limit {
                run.push(i);
            } else if holds {
                ended.insert(key);
            }
        }
        // The runs take at most `limit` rows in all, key by key, as the SQL claim's do:
        // otherwise runs of keys whose rows were not written in `created_at` order could cut
        // each other out of every claim.
        let mut room = request.limit;
        for key in &walk {
            let Some(run) = runs.get_mut(key) else {
                continue;
            };
            run.truncate(room);
            room -= run.len();
            due.extend_from_slice(run);
        }
        due.sort_by(|&a, &b| {
            let (a, b) = (&inner.rows[a].message, &inner.rows[b].message);
            (a.created_at, &a.id).cmp(&(b.created_at, &b.id))
        });
        due.truncate(request.limit);
        // A run cut by the limit keeps only the rows before its first row left out.
        let kept: HashSet<usize> = due.iter().copied().collect();
        let cut: HashSet<usize> = runs
            .values()
            .flat_map(|run| {
                let first_left = run.iter().position(|i| !kept.contains(i));
                first_left
                    .map_or(&run[..0], |at| &run[at..])
                    .iter()
                    .copied()
            })
            .collect();
        due.retain(|i| !cut.contains(i));
        let mut claim = Claim::empty(token, cutoff);
        let until = add_saturating(now, request.lease);
        let mut keys = Vec::new();
        for i in due {
            let row = &mut inner.rows[i];
            row.claimed_until = Some(until);
            row.claim_token = Some(claim.token.clone());
            if let Some(ordering) = &row.ordering {
                // Rows are kept in commit order: the index is the key's sequence.
                let seq = i64::try_from(i).unwrap_or(i64::MAX);
                keys.push((row.message.id.clone(), ordering.key.clone(), seq));
            }
            match &row.poison {
                Some(reason) => claim.poisoned.push(PoisonRow {
                    id: row.message.id.clone(),
                    reason: reason.clone(),
                }),
                None => claim.push_message(row.message.clone()),
            }
        }
        claim.order_runs(keys);
        Ok(claim)
    }

    async fn mark_dispatched(&self, claim: &Claim, rows: &[Dispatched]) -> Result<u64> {
        let outcomes: HashMap<&str, &Option<serde_json::Value>> =
            rows.iter().map(|r| (r.id.as_str(), &r.outcome)).collect();
        Ok(
            self.for_held(claim, rows.iter().map(|r| &r.id), |row, now| {
                let m = &mut row.message;
                m.state = OutboxMessageState::Dispatched;
                m.next_attempt_at = None;
                m.last_error = None;
                m.outcome = outcomes.get(m.id.as_str()).copied().cloned().flatten();
                row.settle(now);
            }),
        )
    }

    async fn mark_failures(&self, claim: &Claim, failures: &[Failure]) -> Result<Vec<String>> {
        Ok(failures
            .iter()
            .filter(|failure| self.mark_held_failure(claim, failure))
            .map(|failure| failure.id.clone())
            .collect())
    }

    fn extends_leases(&self) -> bool {
        true
    }

    async fn extend_lease(&self, claim: &Claim, ids: &[&str], lease: Duration) -> Result<u64> {
        Ok(self.for_held(claim, ids, |row, now| {
            row.claimed_until = Some(add_saturating(now, lease));
        }))
    }

    async fn release(&self, claim: &Claim, ids: &[&str]) -> Result<u64> {
        Ok(self.for_held(claim, ids, |row, _| row.release_lease()))
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
        // As in the claim: a row behind its key's head is not due.
        let mut held: HashSet<&str> = HashSet::new();
        for row in &inner.rows {
            let key = row.ordering.as_ref().map(|o| o.key.as_str());
            let behind = key.is_some_and(|key| held.contains(key));
            if let Some(key) = key
                && row.holds_key()
            {
                held.insert(key);
            }
            if behind || !row.is_open() {
                continue;
            }
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
    async fn backlog(&self) -> Result<Option<Backlog>> {
        let now = self.now();
        let inner = self.lock();
        let open = inner.rows.iter().filter(|r| r.is_open());
        let (count, oldest) = open.fold((0u64, None::<DateTime<Utc>>), |(n, oldest), row| {
            let at = row.message.created_at;
            (n + 1, Some(oldest.map_or(at, |o| o.min(at))))
        });
        Ok(Some(Backlog::new(
            count,
            oldest.map(|at| (now - at).to_std().unwrap_or(Duration::ZERO)),
        )))
    }

    fn overlaps_batches(&self) -> bool {
        true
    }
}

fn truncate_millis(time: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(time.timestamp_millis()).unwrap_or(time)
}

#[cfg(test)]
mod tests;
