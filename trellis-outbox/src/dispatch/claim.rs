//! What a claim asks for and what it holds: [`ClaimRequest`], [`Claim`] (its rows, decoded
//! or poisoned, in dispatch order and, for runs of ordering keys, in publish rounds).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::error::{Error, Result};
use crate::record::OutboxMessage;

/// The most rows of one ordering key a claim of `limit` takes: at least 16, and 1/64 of the
/// limit (at most the limit). The engine publishes a key's run one row per round, so a claim
/// spread over many keys publishes in few rounds: with 100 rows waiting per key, runs
/// without a cap filled a claim of 1,000 from ten keys and took a hundred rounds to publish.
pub(crate) fn run_limit(limit: usize) -> usize {
    (limit / 64).max(16).min(limit)
}

/// A row a claim returned that could not be decoded (unknown kind or state, malformed
/// headers, …). The dispatcher moves it to `dead` with `reason` instead of letting it block
/// the rows behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoisonRow {
    /// The row's id.
    pub id: String,
    /// Why it could not be decoded.
    pub reason: String,
}

/// What to claim: at most [`limit`](Self::limit) due rows, each leased for
/// [`lease`](Self::lease), due by [`cutoff`](Self::cutoff). The argument of
/// [`OutboxRepository::claim`](crate::OutboxRepository::claim); a struct so that claim options can be added without
/// changing the trait.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use trellis_outbox::ClaimRequest;
///
/// let request = ClaimRequest::new(100, Duration::from_secs(30));
/// assert_eq!(request.limit, 100);
/// assert_eq!(request.cutoff, None);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimRequest {
    /// The most rows to claim.
    pub limit: usize,
    /// How long the claim holds its rows before another dispatcher may claim them.
    pub lease: Duration,
    /// The due cutoff, on the repository's clock; `None` means its current time. Pass the
    /// previous claim's [`Claim::cutoff`] to stay in one drain wave.
    pub cutoff: Option<DateTime<Utc>>,
    /// Keyed rows the caller has published (acknowledged) and is still marking: for per-key
    /// ordering they count as dispatched, so the claim may take the rows behind them. A
    /// repository that claims only heads may ignore it.
    pub published: Arc<[String]>,
}

impl ClaimRequest {
    /// A claim of at most `limit` rows leased for `lease`, due by the repository's now.
    pub fn new(limit: usize, lease: Duration) -> Self {
        Self {
            limit,
            lease,
            cutoff: None,
            published: Arc::from([]),
        }
    }

    /// The same claim, taking the rows behind `ids` (keyed rows published and being marked).
    #[must_use]
    pub fn published(mut self, ids: impl Into<Arc<[String]>>) -> Self {
        self.published = ids.into();
        self
    }

    /// The same claim with a due cutoff (`None`: the repository's current time).
    #[must_use]
    pub fn cutoff(mut self, cutoff: Option<DateTime<Utc>>) -> Self {
        self.cutoff = cutoff;
        self
    }
}

/// Rows claimed together under one lease.
///
/// Every mark is fenced by [`Claim::token`]: once the lease expires and another dispatcher
/// claims a row, marks made with the old token change nothing.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Claim {
    /// The fencing token written to every claimed row (a new ULID per claim).
    pub token: String,
    /// The due cutoff this claim used, on the database's clock. Pass it as `cutoff` to the
    /// next claim of the same drain wave so a row that failed during the wave is not retried
    /// within it (spec §A.5), however short its retry delay.
    pub cutoff: DateTime<Utc>,
    /// The decoded rows, in dispatch order: `created_at`, then `id` (a Postgres claim holding
    /// several rows of an ordering key: the first row of each key first, then the second, …).
    pub messages: Vec<OutboxMessage>,
    /// Claimed rows that could not be decoded.
    pub poisoned: Vec<PoisonRow>,
    /// For a row behind another row of its ordering key in this claim: the id of the row
    /// just ahead of it, which must have been published before it may be
    /// ([`Claim::order_runs`]); empty: every message may go at once.
    pub(crate) after: HashMap<String, String>,
    /// The ids of the keyed rows of the claim.
    pub(crate) keyed: HashSet<String>,
    /// Where a row was claimed from when its id does not name it: the NATS KV outbox's key
    /// of a record whose stored `id` does not map back to its key (another writer's), so
    /// that the marks find the record they claimed.
    #[cfg_attr(not(feature = "nats"), allow(dead_code))]
    pub(crate) stored_at: HashMap<String, String>,
}

impl Claim {
    /// An empty claim (nothing was due).
    pub fn empty(token: String, cutoff: DateTime<Utc>) -> Self {
        Self {
            token,
            cutoff,
            messages: Vec::new(),
            poisoned: Vec::new(),
            after: HashMap::new(),
            keyed: HashSet::new(),
            stored_at: HashMap::new(),
        }
    }

    /// Whether the claim holds no rows at all.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty() && self.poisoned.is_empty()
    }

    /// How many rows the claim holds, decodable or not.
    pub fn len(&self) -> usize {
        self.messages.len() + self.poisoned.len()
    }

    /// The ids of every row the claim holds, decodable or not: what its lease covers.
    pub(crate) fn leased_ids(&self) -> Vec<&str> {
        self.messages
            .iter()
            .map(|m| m.id.as_str())
            .chain(self.poisoned.iter().map(|p| p.id.as_str()))
            .collect()
    }

    /// Adds claimed rows (decoded, or poisoned with their id), and puts the messages in
    /// dispatch order: `RETURNING` does not keep the claim subquery's order.
    ///
    /// Every decoded row also passes [`Claim::push_message`]'s wire check.
    pub(crate) fn extend<R>(
        &mut self,
        rows: &[R],
        decode: impl Fn(&R) -> Result<OutboxMessage>,
        id: impl Fn(&R) -> Option<String>,
    ) {
        for row in rows {
            match decode(row) {
                Ok(message) => self.push_message(message),
                Err(error) => self.poisoned.push(PoisonRow {
                    id: id(row).unwrap_or_default(),
                    reason: error.to_string(),
                }),
            }
        }
        self.messages
            .sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
    }

    /// Orders a claim that holds runs of ordering keys (several rows of a key) for publishing
    /// in rounds: round `r` holds the `r`-th claimed row of each key (and, in the first
    /// round, every unkeyed row), so a key never has two rows in flight and its rows go out
    /// in `ordering_seq` order. `keys` gives each keyed row's id its key and sequence,
    /// undecodable rows included: a poisoned row ahead of a message holds it back.
    pub(crate) fn order_runs(&mut self, keys: Vec<(String, String, i64)>) {
        let mut by_key: HashMap<String, Vec<(i64, String)>> = HashMap::new();
        for (id, key, seq) in keys {
            self.keyed.insert(id.clone());
            by_key.entry(key).or_default().push((seq, id));
        }
        let mut rank: HashMap<String, usize> = HashMap::new();
        for mut run in by_key.into_values().filter(|run| run.len() > 1) {
            run.sort_unstable();
            for (position, pair) in run.windows(2).enumerate() {
                self.after.insert(pair[1].1.clone(), pair[0].1.clone());
                rank.insert(pair[1].1.clone(), position + 1);
            }
        }
        if rank.is_empty() {
            return;
        }
        let rank_of = |message: &OutboxMessage| rank.get(&message.id).copied().unwrap_or(0);
        // Stable, so each round stays in dispatch order, and next to each other.
        self.messages.sort_by_key(rank_of);
    }

    /// Adds one decoded row: to [`Claim::messages`] if it may be sent to NATS, otherwise to
    /// [`Claim::poisoned`] with the reason, whatever its kind. A row whose id (sent as
    /// `Nats-Msg-Id`) holds a control character, whose header name or value could not be
    /// sent (a CR/LF in a value would end the header block; other control characters
    /// except tab are refused too), that carries a NATS control
    /// header such as `Nats-Rollup`, or whose subject is not a literal subject outside the
    /// server's control plane (`$JS.…`, `$KV.…`, `_INBOX.…`) is exactly what enqueue refuses;
    /// written by another writer, it goes dead after one attempt instead of failing its batch.
    pub(crate) fn push_message(&mut self, message: OutboxMessage) {
        match crate::wire::message_problem(&message.id, &message.subject, &message.headers) {
            None => self.messages.push(message),
            Some(problem) => self.poisoned.push(PoisonRow {
                reason: Error::decode(
                    &message.id,
                    problem.field.as_str(),
                    format!("{}; the row cannot be published", problem.problem),
                )
                .to_string(),
                id: message.id,
            }),
        }
    }
}
