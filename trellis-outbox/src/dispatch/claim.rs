//! What a claim asks for and what it holds: [`ClaimRequest`], [`Claim`] (its rows, decoded
//! or poisoned, in dispatch order and, for runs of ordering keys, in publish rounds).

use std::collections::HashMap;
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

/// Where a claimed message stands in its ordering key's run ([`Claim::order_runs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Place {
    /// The publish round: the message's position in its key's run (0 for unkeyed rows).
    pub(crate) round: u32,
    /// What must have been published before it.
    pub(crate) ahead: Ahead,
}

impl Place {
    const UNKEYED: Place = Place {
        round: 0,
        ahead: Ahead::Unkeyed,
    };

    /// Whether the message has an ordering key (and a sequence).
    pub(crate) fn is_keyed(self) -> bool {
        self.ahead != Ahead::Unkeyed
    }
}

/// What a claimed message waits for before it may be published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ahead {
    /// Nothing: it has no ordering key.
    Unkeyed,
    /// Nothing: it is the first row of its key in the claim.
    Head,
    /// The message at this index of [`Claim::messages`], the row just ahead of it.
    Behind(usize),
    /// A row ahead of it could not be decoded (it goes dead): it is held, never published.
    Held,
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
    /// Where each message stands in its ordering key's run, by index into
    /// [`messages`](Self::messages) ([`Claim::order_runs`]); shorter than `messages` (empty:
    /// no keyed rows), the messages past its end are unkeyed.
    pub(crate) places: Vec<Place>,
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
            places: Vec::new(),
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
    ///
    /// Each message's place refers to the message ahead of it by index, so publishing the
    /// rounds looks nothing up by id: looking ids up per round and per comparison of the
    /// sort took about a third of the relay's CPU time in `bench relay --keys 1000`.
    pub(crate) fn order_runs(&mut self, mut keys: Vec<(String, String, i64)>) {
        if keys.is_empty() {
            return;
        }
        // Each key's rows next to each other, in sequence order.
        keys.sort_unstable_by(|a, b| a.1.cmp(&b.1).then(a.2.cmp(&b.2)));
        let index: HashMap<&str, usize> = self
            .messages
            .iter()
            .enumerate()
            .map(|(i, message)| (message.id.as_str(), i))
            .collect();
        let mut places = vec![Place::UNKEYED; self.messages.len()];
        for run in keys.chunk_by(|a, b| a.1 == b.1) {
            let mut ahead = Ahead::Head;
            for (round, (id, _, _)) in run.iter().enumerate() {
                let at = index.get(id.as_str()).copied();
                if let Some(i) = at {
                    places[i] = Place {
                        round: u32::try_from(round).unwrap_or(u32::MAX),
                        ahead,
                    };
                }
                ahead = match (ahead, at) {
                    (Ahead::Held, _) | (_, None) => Ahead::Held,
                    (_, Some(i)) => Ahead::Behind(i),
                };
            }
        }
        drop(index);
        if places.iter().any(|place| place.round > 0) {
            // Stable, so each round stays in dispatch order, and next to each other; each
            // message keeps its place, and the row ahead it names moves with its message.
            let mut placed: Vec<(usize, Place, OutboxMessage)> = places
                .into_iter()
                .zip(std::mem::take(&mut self.messages))
                .enumerate()
                .map(|(from, (place, message))| (from, place, message))
                .collect();
            placed.sort_by_key(|(_, place, _)| place.round);
            let mut moved_to = vec![0; placed.len()];
            for (to, (from, _, _)) in placed.iter().enumerate() {
                moved_to[*from] = to;
            }
            (places, self.messages) = placed
                .into_iter()
                .map(|(_, mut place, message)| {
                    if let Ahead::Behind(i) = place.ahead {
                        place.ahead = Ahead::Behind(moved_to[i]);
                    }
                    (place, message)
                })
                .unzip();
        }
        self.places = places;
    }

    /// Where message `i` stands in its key's run ([`Claim::order_runs`]).
    pub(crate) fn place(&self, i: usize) -> Place {
        self.places.get(i).copied().unwrap_or(Place::UNKEYED)
    }

    /// Whether the claim holds several rows of a key, to be published in rounds.
    pub(crate) fn has_runs(&self) -> bool {
        self.places.iter().any(|place| place.round > 0)
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

#[cfg(test)]
impl Claim {
    /// The id of the message just ahead of message `id` in its key's run.
    pub(crate) fn ahead_of(&self, id: &str) -> Option<&str> {
        let i = self.messages.iter().position(|m| m.id == id)?;
        match self.place(i).ahead {
            Ahead::Behind(ahead) => Some(self.messages[ahead].id.as_str()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim_of(ids: &[&str]) -> Claim {
        let mut claim = Claim::empty("token".into(), Utc::now());
        for id in ids {
            let record = crate::PreparedOutboxRecord::event("A.Happened", "events.v1.A", &1)
                .expect("a valid record");
            let mut message = OutboxMessage::pending(record, Utc::now());
            message.id = (*id).into();
            claim.messages.push(message);
        }
        claim
    }

    fn keys(rows: &[(&str, &str, i64)]) -> Vec<(String, String, i64)> {
        rows.iter()
            .map(|&(id, key, seq)| (id.into(), key.into(), seq))
            .collect()
    }

    fn ids(claim: &Claim) -> Vec<&str> {
        claim.messages.iter().map(|m| m.id.as_str()).collect()
    }

    #[test]
    fn runs_are_ordered_in_rounds_with_the_row_ahead_by_index() {
        // Dispatch order as claimed; keys out of order and sequences not by id.
        let mut claim = claim_of(&["b2", "u1", "a1", "b1", "a3", "a2", "c1"]);
        claim.order_runs(keys(&[
            ("a1", "a", 10),
            ("b2", "b", 7),
            ("a3", "a", 30),
            ("b1", "b", 5),
            ("a2", "a", 20),
            ("c1", "c", 1),
        ]));
        // Round 0 keeps the dispatch order of heads and unkeyed rows, then b2 and a2, then a3.
        assert_eq!(ids(&claim), ["u1", "a1", "b1", "c1", "b2", "a2", "a3"]);
        let rounds: Vec<u32> = (0..7).map(|i| claim.place(i).round).collect();
        assert_eq!(rounds, [0, 0, 0, 0, 1, 1, 2]);
        assert_eq!(claim.ahead_of("b2"), Some("b1"));
        assert_eq!(claim.ahead_of("a2"), Some("a1"));
        assert_eq!(claim.ahead_of("a3"), Some("a2"));
        assert_eq!(claim.place(0).ahead, Ahead::Unkeyed);
        assert_eq!(claim.place(1).ahead, Ahead::Head);
        assert!(claim.has_runs());
        assert!(!claim.place(0).is_keyed());
        assert!((1..7).all(|i| claim.place(i).is_keyed()));
    }

    #[test]
    fn a_row_behind_a_poisoned_row_is_held_and_so_are_the_rows_behind_it() {
        // a2 could not be decoded: it is in `keys` but not among the messages.
        let mut claim = claim_of(&["a1", "a3", "a4", "b1"]);
        claim.order_runs(keys(&[
            ("a1", "a", 1),
            ("a2", "a", 2),
            ("a3", "a", 3),
            ("a4", "a", 4),
            ("b1", "b", 1),
        ]));
        assert_eq!(ids(&claim), ["a1", "b1", "a3", "a4"]);
        assert_eq!(claim.place(2).ahead, Ahead::Held);
        assert_eq!(claim.place(3).ahead, Ahead::Held);
    }

    #[test]
    fn one_row_per_key_keeps_the_order_and_still_marks_rows_keyed() {
        let mut claim = claim_of(&["b1", "u1", "a1"]);
        claim.order_runs(keys(&[("a1", "a", 1), ("b1", "b", 1)]));
        assert_eq!(ids(&claim), ["b1", "u1", "a1"]);
        assert!(!claim.has_runs());
        assert!(claim.place(0).is_keyed());
        assert!(!claim.place(1).is_keyed());
        assert!(claim.place(2).is_keyed());
        // Past the places' end (rows merged in later): unkeyed.
        assert!(!claim.place(9).is_keyed());
    }
}
