//! What an operator asks of an SQL outbox (the `trellis-outbox` CLI uses these): counts per
//! state and the lag, rows by state, one row, bulk replay of dead rows.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::dispatch::PoisonRow;
use crate::driver::OutboxDatabase;
use crate::error::{Error, Result};
use crate::record::{OutboxMessage, OutboxMessageState};
use crate::sql_repository::SqlOutboxRepository;

/// How an outbox stands: rows per state, how long the oldest undispatched row has waited, and
/// the ordering keys blocked by a dead head.
///
/// Its JSON form (`trellis-outbox status --json`) always has every field: `counts` with
/// every state (`0` when none), `undispatched`, `oldest_undispatched` (seconds, `null` when
/// nothing waits), `blocked_keys` (at most [`BLOCKED_KEYS_SHOWN`]) and `blocked_keys_total`.
///
/// ```
/// use trellis_outbox::OutboxStatus;
///
/// let status = OutboxStatus::default();
/// assert_eq!(status.undispatched(), 0);
/// assert_eq!(status.count("dead"), 0);
/// let json = serde_json::to_value(&status)?;
/// assert_eq!(json["counts"]["dead"], 0);
/// assert_eq!(json["undispatched"], 0);
/// assert_eq!(json["blocked_keys_total"], 0);
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct OutboxStatus {
    /// Rows per stored state (`pending`, `claimed`, `failed`, `dispatched`, `dead`, or a
    /// state another writer stored). [`SqlOutboxRepository::status`] lists every known state,
    /// with 0 when it has no rows.
    pub counts: BTreeMap<String, u64>,
    /// How long the oldest row not yet dispatched (pending, claimed or failed) has waited
    /// since it was enqueued, on the database's clock: the outbox's lag.
    pub oldest_undispatched: Option<Duration>,
    /// Ordering keys held by a dead head under [`HeadOfLine::Block`](crate::HeadOfLine::Block)
    /// (at most [`BLOCKED_KEYS_SHOWN`]), by key: each waits for an operator's retry of its
    /// head.
    pub blocked_keys: Vec<BlockedKey>,
    /// How many keys are blocked in all: more than `blocked_keys` holds when there are more
    /// than [`BLOCKED_KEYS_SHOWN`].
    pub blocked_keys_total: u64,
}

impl serde::Serialize for OutboxStatus {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;

        // Every known state, also in a status built by hand.
        let mut counts = self.counts.clone();
        for state in STATES {
            counts.entry(state.as_str().to_owned()).or_default();
        }
        let mut out = serializer.serialize_struct("OutboxStatus", 5)?;
        out.serialize_field("counts", &counts)?;
        out.serialize_field("undispatched", &self.undispatched())?;
        out.serialize_field(
            "oldest_undispatched",
            &self.oldest_undispatched.map(|age| age.as_secs_f64()),
        )?;
        out.serialize_field("blocked_keys", &self.blocked_keys)?;
        out.serialize_field(
            "blocked_keys_total",
            &self.blocked_keys_total.max(self.blocked_keys.len() as u64),
        )?;
        out.end()
    }
}

/// One stored row as an operator sees it: the message, and what a message does not carry —
/// the lease a dispatcher holds on it, if any, and its ordering key.
///
/// In JSON, the message's fields and then `claim_token`, `claimed_until` and `ordering_key`
/// (`null` when not set).
///
/// ```
/// # fn show(row: &trellis_outbox::OutboxRow) {
/// match (&row.claim_token, row.claimed_until) {
///     (Some(token), Some(until)) => println!("{} leased to {token} until {until}", row.message.id),
///     _ => println!("{} not leased", row.message.id),
/// }
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct OutboxRow {
    /// The row's content and state.
    #[serde(flatten)]
    pub message: OutboxMessage,
    /// The fencing token of the claim that holds (or last held, if `claimed_until` has
    /// passed) the row; `None` when no dispatcher has it.
    pub claim_token: Option<String>,
    /// When that claim's lease ends, on the database's clock; after it, another dispatcher
    /// may claim the row.
    pub claimed_until: Option<DateTime<Utc>>,
    /// The key the row is published in order with, if any.
    pub ordering_key: Option<String>,
}

impl OutboxRow {
    pub(crate) fn new(
        message: OutboxMessage,
        claim_token: Option<String>,
        claimed_until: Option<DateTime<Utc>>,
        ordering_key: Option<String>,
    ) -> Self {
        Self {
            message,
            claim_token,
            claimed_until,
            ordering_key,
        }
    }
}

/// How many blocked keys [`SqlOutboxRepository::status`] reports at most.
pub const BLOCKED_KEYS_SHOWN: usize = 100;

/// An ordering key whose head (its earliest undispatched row) is `dead` under the `block`
/// policy: nothing behind it is published until the head is retried.
///
/// ```
/// use trellis_outbox::OutboxStatus;
///
/// assert!(OutboxStatus::default().blocked_keys.is_empty());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct BlockedKey {
    /// The ordering key.
    pub key: String,
    /// The id of the dead head (retry it to unblock the key).
    pub head_id: String,
    /// Undispatched rows of the key behind the head.
    pub waiting: u64,
}

/// Every state trellis-outbox writes or knows (upstream Trellis writes `claimed`).
const STATES: [OutboxMessageState; 5] = [
    OutboxMessageState::Pending,
    OutboxMessageState::Claimed,
    OutboxMessageState::Failed,
    OutboxMessageState::Dispatched,
    OutboxMessageState::Dead,
];

/// The states whose rows are still to be dispatched.
const UNDISPATCHED: [OutboxMessageState; 3] = [
    OutboxMessageState::Pending,
    OutboxMessageState::Claimed,
    OutboxMessageState::Failed,
];

impl OutboxStatus {
    /// The counts and lag of the `(state, rows, age of the oldest)` a status query answered,
    /// with 0 for each of `states` it did not list.
    fn from_rows(states: &[OutboxMessageState], rows: Vec<(String, i64, Option<f64>)>) -> Self {
        let mut status = Self::default();
        for state in states {
            status.counts.insert(state.as_str().to_owned(), 0);
        }
        for (state, count, age) in rows {
            let undispatched = UNDISPATCHED.iter().any(|s| s.as_str() == state);
            let age = age.map(crate::dispatch::due_in);
            if undispatched && let Some(age) = age {
                status.oldest_undispatched =
                    Some(status.oldest_undispatched.map_or(age, |o| o.max(age)));
            }
            *status.counts.entry(state).or_default() += u64::try_from(count).unwrap_or(0);
        }
        status
    }

    /// Rows in `state`.
    pub fn count(&self, state: &str) -> u64 {
        self.counts.get(state).copied().unwrap_or(0)
    }

    /// Rows not yet dispatched: pending, claimed or failed (not dead).
    pub fn undispatched(&self) -> u64 {
        UNDISPATCHED.iter().map(|s| self.count(s.as_str())).sum()
    }
}

impl<DB: OutboxDatabase> SqlOutboxRepository<DB> {
    /// Rows per state and the lag (one `GROUP BY` over the table), and when there are dead
    /// rows, the blocked ordering keys ([`blocked_keys`](Self::blocked_keys)).
    ///
    /// # Errors
    ///
    /// [`Error::Repository`] if the query fails.
    pub async fn status(&self) -> Result<OutboxStatus> {
        let rows = DB::fetch_status(self.pool(), &self.statements().text.status)
            .await
            .map_err(Error::repository("status"))?;
        let mut status = OutboxStatus::from_rows(&STATES, rows);
        if status.count("dead") > 0 {
            status.blocked_keys = self.blocked_keys(BLOCKED_KEYS_SHOWN).await?;
            status.blocked_keys_total = status.blocked_keys.len() as u64;
            if status.blocked_keys.len() >= BLOCKED_KEYS_SHOWN {
                status.blocked_keys_total = self.blocked_key_count().await?;
            }
        }
        Ok(status)
    }

    /// [`status`](Self::status) without the dispatched rows, and so cheap on a table that
    /// keeps millions of them: rows per state other than `dispatched` (`pending`, `claimed`,
    /// `failed`, `dead`; `counts` has no `dispatched` entry), the lag, and no blocked keys.
    /// One query through the index on `state`: what `trellis-outbox relay` prints its
    /// progress line from.
    ///
    /// ```no_run
    /// # async fn run(repository: trellis_outbox::PgOutboxRepository) -> trellis_outbox::Result<()> {
    /// let now = repository.progress().await?;
    /// println!("{} waiting, {} dead", now.undispatched(), now.count("dead"));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Repository`] if the query fails.
    pub async fn progress(&self) -> Result<OutboxStatus> {
        let rows = DB::fetch_status(self.pool(), &self.statements().text.progress)
            .await
            .map_err(Error::repository("progress"))?;
        let not_dispatched: Vec<OutboxMessageState> = STATES
            .into_iter()
            .filter(|state| *state != OutboxMessageState::Dispatched)
            .collect();
        Ok(OutboxStatus::from_rows(&not_dispatched, rows))
    }

    /// How many ordering keys are held by a dead head under
    /// [`HeadOfLine::Block`](crate::HeadOfLine::Block) (all of them, unlike
    /// [`blocked_keys`](Self::blocked_keys)).
    ///
    /// ```no_run
    /// # async fn run(repository: trellis_outbox::PgOutboxRepository) -> trellis_outbox::Result<()> {
    /// let shown = repository.blocked_keys(10).await?;
    /// let total = repository.blocked_key_count().await?;
    /// println!("{} of {total} blocked keys", shown.len());
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Repository`] if the query fails.
    pub async fn blocked_key_count(&self) -> Result<u64> {
        let count = DB::fetch_count(self.pool(), &self.statements().text.blocked_key_count)
            .await
            .map_err(Error::repository("count blocked keys"))?;
        Ok(u64::try_from(count).unwrap_or(0))
    }

    /// Up to `limit` ordering keys held by a dead head under
    /// [`HeadOfLine::Block`](crate::HeadOfLine::Block), by key.
    ///
    /// # Errors
    ///
    /// [`Error::Repository`] if the query fails.
    pub async fn blocked_keys(&self, limit: usize) -> Result<Vec<BlockedKey>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows =
            DB::fetch_counted_pairs(self.pool(), &self.statements().text.blocked_keys, limit)
                .await
                .map_err(Error::repository("blocked keys"))?;
        Ok(rows
            .into_iter()
            .map(|(waiting, key, head_id)| BlockedKey {
                key,
                head_id,
                waiting: u64::try_from(waiting).unwrap_or(0),
            })
            .collect())
    }

    /// Up to `limit` rows in `state` (of event name or queue `name`, if given), oldest
    /// first; a row that cannot be decoded comes back as a [`PoisonRow`] with the reason.
    /// [`list_rows`](Self::list_rows) also gives each row's lease and ordering key.
    ///
    /// # Errors
    ///
    /// [`Error::Repository`] if the query fails.
    pub async fn list(
        &self,
        state: OutboxMessageState,
        name: Option<&str>,
        limit: usize,
    ) -> Result<Vec<std::result::Result<OutboxMessage, PoisonRow>>> {
        let rows = self.list_rows(state, name, limit).await?;
        Ok(rows
            .into_iter()
            .map(|row| row.map(|row| row.message))
            .collect())
    }

    /// [`list`](Self::list) with each row's lease (`claim_token`, `claimed_until`) and
    /// ordering key: what `trellis-outbox list` prints.
    ///
    /// ```no_run
    /// # async fn run(repository: trellis_outbox::PgOutboxRepository) -> trellis_outbox::Result<()> {
    /// use trellis_outbox::OutboxMessageState;
    ///
    /// for row in repository.list_rows(OutboxMessageState::Pending, None, 20).await? {
    ///     match row {
    ///         Ok(row) => println!("{} lease until {:?}", row.message.id, row.claimed_until),
    ///         Err(poison) => println!("{} undecodable: {}", poison.id, poison.reason),
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Repository`] if the query fails.
    pub async fn list_rows(
        &self,
        state: OutboxMessageState,
        name: Option<&str>,
        limit: usize,
    ) -> Result<Vec<std::result::Result<OutboxRow, PoisonRow>>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = DB::fetch_rows(
            self.pool(),
            &self.statements().text.list,
            state.as_str(),
            name,
            limit,
        )
        .await
        .map_err(Error::repository("list"))?;
        Ok(rows
            .iter()
            .map(|row| {
                DB::decode_row(row).map_err(|err| PoisonRow {
                    id: match &err {
                        Error::Decode { id, .. } => id.clone(),
                        _ => String::new(),
                    },
                    reason: err.to_string(),
                })
            })
            .collect())
    }

    /// The row `id`, if there is one.
    ///
    /// # Errors
    ///
    /// [`Error::Repository`] if the query fails, [`Error::Decode`] if the row cannot be
    /// decoded (the error says which column and why).
    pub async fn get(&self, id: &str) -> Result<Option<OutboxMessage>> {
        let mut conn = self
            .pool()
            .acquire()
            .await
            .map_err(Error::repository("get"))?;
        let row = DB::fetch_by_id(&mut conn, &self.statements().text.select_by_id, id)
            .await
            .map_err(Error::repository("get"))?;
        row.as_ref().map(DB::decode).transpose()
    }

    /// The row `id` with its lease and ordering key, if there is one: what
    /// `trellis-outbox inspect` prints.
    ///
    /// ```no_run
    /// # async fn run(repository: trellis_outbox::PgOutboxRepository) -> trellis_outbox::Result<()> {
    /// if let Some(row) = repository.get_row("01J9ZK3V8Q2W4E6R8T0Y1U3I5O").await? {
    ///     println!("{:?}, ordering key {:?}", row.message.state, row.ordering_key);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Repository`] if the query fails, [`Error::Decode`] if the row cannot be
    /// decoded (the error says which column and why).
    pub async fn get_row(&self, id: &str) -> Result<Option<OutboxRow>> {
        let mut conn = self
            .pool()
            .acquire()
            .await
            .map_err(Error::repository("inspect"))?;
        let row = DB::fetch_by_id(&mut conn, &self.statements().text.inspect, id)
            .await
            .map_err(Error::repository("inspect"))?;
        row.as_ref().map(DB::decode_row).transpose()
    }

    /// Moves every `dead` row — of event name or queue `name`, if given — back to `pending`,
    /// due now with its attempts reset (bulk replay); returns how many. Dead rows hold no
    /// lease, so no dispatcher is publishing them. Running dispatchers are woken (on
    /// Postgres, a `NOTIFY` on the outbox's channel, as an enqueue sends), so one listening
    /// picks the rows up at once.
    ///
    /// # Errors
    ///
    /// [`Error::Repository`] if the statement fails.
    pub async fn retry_dead(&self, name: Option<&str>) -> Result<u64> {
        self.retry_dead_at_most(name, usize::MAX).await
    }

    /// [`retry_dead`](Self::retry_dead) of at most `limit` rows, the oldest first.
    ///
    /// ```no_run
    /// # async fn run(repository: trellis_outbox::PgOutboxRepository) -> trellis_outbox::Result<()> {
    /// let waiting = repository.count_dead(Some("Orders.Shipped"), 500).await?;
    /// let retried = repository.retry_dead_at_most(Some("Orders.Shipped"), 500).await?;
    /// println!("retried {retried} of the {waiting} oldest dead rows");
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Repository`] if the statement fails.
    pub async fn retry_dead_at_most(&self, name: Option<&str>, limit: usize) -> Result<u64> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let retried =
            DB::execute_named(self.pool(), &self.statements().text.retry_dead, name, limit)
                .await
                .map_err(Error::repository("retry dead rows"))?;
        if retried > 0 {
            self.wake_dispatchers().await;
        }
        Ok(retried)
    }

    /// How many rows [`retry_dead_at_most`](Self::retry_dead_at_most) would retry now: `dead`
    /// rows of `name` (if given), at most `limit`. Changes nothing.
    ///
    /// # Errors
    ///
    /// [`Error::Repository`] if the query fails.
    pub async fn count_dead(&self, name: Option<&str>, limit: usize) -> Result<u64> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let count = DB::count_named(self.pool(), &self.statements().text.count_dead, name, limit)
            .await
            .map_err(Error::repository("count dead rows"))?;
        Ok(u64::try_from(count).unwrap_or(0))
    }
}
