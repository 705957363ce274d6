//! [`NatsKvOutboxRepository`]: an outbox in a NATS KV bucket, claimed under leases.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::kv::{self, CreateErrorKind, Operation, UpdateErrorKind};
use base64::Engine as _;
use chrono::{DateTime, TimeDelta, Utc};
use futures_util::{StreamExt as _, TryStreamExt as _};
use serde_json::{Map, Value};

use super::record::{KvRecord, NEVER, key_of};
use crate::dispatch::{
    Claim, ClaimRequest, Dispatched, Failure, FailureOutcome, OutboxRepository, PoisonRow,
    RetryOutcome,
};
use crate::error::{Error, Result};
use crate::record::{OutboxMessage, OutboxMessageState, ToOutboxRecord, new_id};
use crate::row::existing_row;
use crate::time::{add_saturating, format_timestamp, now_millis, parse_timestamp};

/// How many keys are read or written at once during a scan or a batch of marks.
const PARALLEL: usize = 32;
/// How often a mark re-reads a record whose revision moved under it.
const CAS_ATTEMPTS: usize = 3;

/// An outbox stored in a NATS KV bucket (upstream's `NatsKvOutboxRepository`, spec §E), for
/// services that keep no SQL state.
///
/// **Enqueue is not atomic with anything else**: a KV `create` is one write, so there is no
/// transaction that also holds your business change. Use it when the event *is* the change,
/// or when a lost or orphaned event is acceptable; otherwise use the SQL outbox.
///
/// Fixed from upstream:
/// - **Claims carry a lease.** A claim writes `state: "claimed"`, a fencing `claimToken` and
///   `nextAttemptAt` = the lease's end, with a revision check (two claimers never both win a
///   record). A record whose dispatcher died is claimable again when the lease ends (upstream
///   0.11.0-rc.1 left it `claimed` forever, §H 2).
/// - **Marks cannot strand a record.** A mark re-reads the record when its revision moved,
///   and applies only while the record is still held by the claim's token (§H 25).
/// - **Keys are escaped once** (§H 26): an id NATS accepts as a key is its own key, any other
///   is stored under `_b64.<base64url(id)>`; scans read keys as listed.
/// - **Poison is isolated.** A value that is not a record, or a record with an unknown kind or
///   state, is claimed like any other and goes `dead` with the reason.
///
/// Times are the dispatcher's wall clock (a KV bucket has none): keep hosts' clocks in sync,
/// and leases well above their skew. Every claim lists and reads the whole bucket, so the cost
/// of a claim grows with the bucket: purge dispatched records
/// ([`OutboxRepository::purge_dispatched`] or
/// [`DispatcherBuilder::retain_dispatched`](crate::DispatcherBuilder::retain_dispatched)) and
/// keep the KV outbox for modest volumes.
///
/// # Examples
///
/// ```no_run
/// # async fn run(nats: async_nats::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use trellis_outbox::{JetStreamPublisher, NatsKvOutboxRepository, OutboxDispatcher, PreparedOutboxRecord};
///
/// let js = async_nats::jetstream::new(nats);
/// let outbox = NatsKvOutboxRepository::open(&js, "orders_outbox").await?;
/// outbox
///     .enqueue(&PreparedOutboxRecord::event("Orders.Placed", "events.v1.Orders.Placed.o-1", &serde_json::json!({"id": "o-1"}))?)
///     .await?;
/// let dispatcher = OutboxDispatcher::builder(outbox, JetStreamPublisher::builder(js).build()).start()?;
/// # dispatcher.shutdown().await; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct NatsKvOutboxRepository {
    store: kv::Store,
}

fn kv_error(
    operation: &'static str,
    key: &str,
    source: impl std::error::Error + Send + Sync + 'static,
) -> Error {
    Error::Kv {
        operation,
        key: key.to_owned(),
        source: Box::new(source),
        retryable: true,
    }
}

/// Whether a failed write was refused for its size (the client's `max_payload` check, or
/// JetStream's 10054 for the bucket's `max_value_size`): no retry of the same value fits.
fn too_large(err: &(dyn std::error::Error + 'static)) -> bool {
    use async_nats::jetstream::context::{PublishError, PublishErrorKind};
    let mut next = Some(err);
    while let Some(err) = next {
        if let Some(publish) = err.downcast_ref::<PublishError>()
            && publish.kind() == PublishErrorKind::MaxPayloadExceeded
        {
            return true;
        }
        if let Some(js) = err.downcast_ref::<async_nats::jetstream::Error>()
            && js.error_code() == async_nats::jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
        {
            return true;
        }
        next = err.source();
    }
    false
}

/// A record as read: its revision and its value as a JSON object (whatever it holds).
struct Read {
    key: String,
    revision: u64,
    value: Map<String, Value>,
    /// The raw value, when it was not a JSON object.
    raw: Option<Vec<u8>>,
    /// The header of upstream's `TRKV` envelope the value came in, if it did: the record is
    /// written back in it, so that upstream can still read it.
    envelope: Option<[u8; ENVELOPE_HEADER]>,
}

/// Upstream's typed-KV envelope (`kv.ts`): `TRKV`, format 1, a big-endian `u32`
/// representation version, then the JSON value.
const ENVELOPE_MAGIC: &[u8; 4] = b"TRKV";
const ENVELOPE_FORMAT: u8 = 1;
const ENVELOPE_HEADER: usize = 9;

/// Splits a value in upstream's `TRKV` envelope into its header and body.
fn unwrap_envelope(bytes: &[u8]) -> Option<([u8; ENVELOPE_HEADER], &[u8])> {
    let (header, body) = bytes.split_first_chunk::<ENVELOPE_HEADER>()?;
    (header.starts_with(ENVELOPE_MAGIC) && header[4] == ENVELOPE_FORMAT).then_some((*header, body))
}

impl Read {
    fn str(&self, field: &str) -> Option<&str> {
        self.value.get(field).and_then(Value::as_str)
    }

    /// Whether the claim `token` still holds the record. `attempts` is the count the claim
    /// read (`None` for a record it could not decode): upstream's claimer keeps every field
    /// it does not set (our `claimToken` too) and counts its claim in `attempts`, so a record
    /// upstream re-claimed after our lease ran out has our token but not our count.
    fn held_by(&self, token: &str, attempts: Option<u64>) -> bool {
        self.str("state") == Some(OutboxMessageState::Claimed.as_str())
            && self.str("claimToken") == Some(token)
            && attempts
                .is_none_or(|n| self.value.get("attempts").and_then(Value::as_u64) == Some(n))
    }

    fn id(&self) -> String {
        self.str("id")
            .map_or_else(|| self.key.clone(), str::to_owned)
    }
}

fn set(map: &mut Map<String, Value>, field: &str, value: impl Into<String>) {
    map.insert(field.to_owned(), Value::String(value.into()));
}

impl NatsKvOutboxRepository {
    /// An outbox in `store`.
    pub fn new(store: kv::Store) -> Self {
        Self { store }
    }

    /// Opens the bucket `bucket`, creating it (file storage, one value per key) if missing.
    ///
    /// # Errors
    ///
    /// [`Error::Kv`] if JetStream refuses or cannot be reached.
    pub async fn open(jetstream: &async_nats::jetstream::Context, bucket: &str) -> Result<Self> {
        Ok(Self::new(super::open_bucket(jetstream, bucket).await?))
    }

    /// The bucket.
    pub fn store(&self) -> &kv::Store {
        &self.store
    }

    /// Stores `record` as `pending`, once: an existing record with the same id and the same
    /// content is returned as stored (idempotent), one with different content is
    /// [`Error::DuplicateIdentity`].
    ///
    /// # Errors
    ///
    /// [`Error::InvalidRecord`] before anything is written, also for a record with an
    /// ordering key: a KV bucket has no commit order across keys to number them by, so this
    /// repository refuses keyed records rather than publish them unordered (use Postgres or
    /// SQLite for per-key ordering). [`Error::Kv`] if the bucket fails.
    pub async fn enqueue(&self, record: &impl ToOutboxRecord) -> Result<OutboxMessage> {
        let record = record.to_outbox_record()?;
        record.validate()?;
        if record.ordering.is_some() {
            return Err(Error::invalid_record(
                &record.id,
                "ordering key",
                "is not supported by the NATS KV outbox (use the Postgres or SQLite outbox)",
            ));
        }
        let key = key_of(&record.id);
        let message = OutboxMessage::pending(record.clone(), now_millis());
        let value = KvRecord::from_message(&message).to_bytes()?;
        match self.store.create(&key, value.into()).await {
            Ok(_) => Ok(message),
            Err(e) if e.kind() == CreateErrorKind::AlreadyExists => {
                let stored = self.get(&record.id).await?;
                existing_row(&record, stored.as_ref())
            }
            Err(e) => Err(kv_error("enqueue", &key, e)),
        }
    }

    /// The record `id`, if there is one (an undecodable one is [`Error::Decode`]).
    ///
    /// # Errors
    ///
    /// [`Error::Kv`] if the bucket fails, [`Error::Decode`] for a value that is not a record.
    pub async fn get(&self, id: &str) -> Result<Option<OutboxMessage>> {
        let key = key_of(id);
        match self.read(&key).await? {
            None => Ok(None),
            Some(read) if read.raw.is_some() => {
                Err(Error::decode(id, "value", "not a JSON object"))
            }
            Some(read) => KvRecord::from_map(&key, read.value)?.to_message().map(Some),
        }
    }

    async fn read(&self, key: &str) -> Result<Option<Read>> {
        let entry = self
            .store
            .entry(key)
            .await
            .map_err(|e| kv_error("read", key, e))?;
        Ok(entry.filter(|e| e.operation == Operation::Put).map(|e| {
            let (envelope, body) = match unwrap_envelope(&e.value) {
                Some((header, body)) => (Some(header), body),
                None => (None, &e.value[..]),
            };
            match serde_json::from_slice::<Value>(body) {
                Ok(Value::Object(value)) => Read {
                    key: e.key,
                    revision: e.revision,
                    value,
                    raw: None,
                    envelope,
                },
                _ => Read {
                    key: e.key,
                    revision: e.revision,
                    value: Map::new(),
                    raw: Some(e.value.to_vec()),
                    envelope: None,
                },
            }
        }))
    }

    async fn read_all(&self) -> Result<Vec<Read>> {
        let keys: Vec<String> = self
            .store
            .keys()
            .await
            .map_err(|e| kv_error("list keys", "", e))?
            .try_collect()
            .await
            .map_err(|e| kv_error("list keys", "", e))?;
        // The futures are built first: a `map` closure over borrowed data inside the stream
        // is not general enough for the `Send` bound of the trait's futures.
        let reads: Vec<_> = keys.iter().map(|key| self.read(key)).collect();
        let reads: Vec<Result<Option<Read>>> = futures_util::stream::iter(reads)
            .buffer_unordered(PARALLEL)
            .collect()
            .await;
        let mut out = Vec::with_capacity(reads.len());
        for read in reads {
            out.extend(read?);
        }
        Ok(out)
    }

    /// Writes `read`'s value over its revision (in the envelope it came in, if any):
    /// `Ok(false)` when another writer came first.
    async fn write(&self, read: &Read) -> Result<bool> {
        let (key, revision) = (read.key.as_str(), read.revision);
        let mut bytes = Vec::new();
        if let Some(header) = &read.envelope {
            bytes.extend_from_slice(header);
        }
        serde_json::to_writer(&mut bytes, &read.value).map_err(|source| Error::Serialize {
            what: "outbox KV record",
            source,
        })?;
        match self.store.update(key, bytes.into(), revision).await {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => Ok(false),
            Err(e) if too_large(&e) => Err(Error::Kv {
                operation: "write",
                key: key.to_owned(),
                source: Box::new(e),
                retryable: false,
            }),
            Err(e) => Err(kv_error("write", key, e)),
        }
    }

    /// Applies `change` to the record `id` while `claim` holds it, re-reading when its
    /// revision moved. Whether it was applied.
    async fn change_held(
        &self,
        claim: &Claim,
        id: &str,
        attempts: Option<u64>,
        change: impl Fn(&mut Map<String, Value>, DateTime<Utc>),
    ) -> Result<bool> {
        let key = claim
            .stored_at
            .get(id)
            .cloned()
            .unwrap_or_else(|| key_of(id));
        for _ in 0..CAS_ATTEMPTS {
            let Some(mut read) = self.read(&key).await? else {
                return Ok(false);
            };
            if !read.held_by(&claim.token, attempts) {
                return Ok(false);
            }
            change(&mut read.value, now_millis());
            if self.write(&read).await? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    async fn change_all_held<'a>(
        &self,
        claim: &Claim,
        ids: impl IntoIterator<Item = &'a str>,
        change: impl Fn(&str, &mut Map<String, Value>, DateTime<Utc>) + Sync,
    ) -> Result<Vec<String>> {
        let change = &change;
        // The attempts each record had when claimed (the claim does not change them).
        let claimed: HashMap<&str, u64> = claim
            .messages
            .iter()
            .map(|m| (m.id.as_str(), u64::from(m.attempts)))
            .collect();
        let claimed = &claimed;
        let changes: Vec<_> = ids
            .into_iter()
            .map(|id| async move {
                let attempts = claimed.get(id).copied();
                let applied = self
                    .change_held(claim, id, attempts, |value, now| change(id, value, now))
                    .await?;
                Ok::<_, Error>(applied.then(|| id.to_owned()))
            })
            .collect();
        let results: Vec<Result<Option<String>>> = futures_util::stream::iter(changes)
            .buffer_unordered(PARALLEL)
            .collect()
            .await;
        let mut changed = Vec::new();
        for result in results {
            changed.extend(result?);
        }
        Ok(changed)
    }

    /// Claims `read` for `token` until `until`: `Ok(false)` if another claimer won it.
    async fn claim_one(
        &self,
        read: &mut Read,
        token: &str,
        now: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> Result<bool> {
        if let Some(raw) = read.raw.take() {
            // Not a record: keep what was there, so the dead record shows it (the bucket keeps
            // one revision: this is the only copy). Bytes that are not UTF-8 are kept exactly,
            // in standard base64.
            set(&mut read.value, "id", read.key.clone());
            match String::from_utf8(raw) {
                Ok(text) => set(&mut read.value, "raw", text),
                Err(bytes) => set(
                    &mut read.value,
                    "rawBase64",
                    base64::engine::general_purpose::STANDARD.encode(bytes.as_bytes()),
                ),
            }
        }
        set(
            &mut read.value,
            "state",
            OutboxMessageState::Claimed.as_str(),
        );
        set(&mut read.value, "claimToken", token);
        set(&mut read.value, "nextAttemptAt", format_timestamp(until));
        set(&mut read.value, "updatedAt", format_timestamp(now));
        self.write(read).await
    }
}

/// When an open record may be claimed: its due time, or its lease's end. `None` for records
/// that are finished (`dispatched`, `dead`) or that no scan should touch.
fn claimable_at(read: &Read) -> Option<DateTime<Utc>> {
    if read.raw.is_some() {
        return Some(DateTime::<Utc>::MIN_UTC);
    }
    let state = read.str("state");
    if matches!(state, Some("dispatched" | "dead")) {
        return None;
    }
    match read.str("nextAttemptAt") {
        None => Some(DateTime::<Utc>::MIN_UTC),
        // An unreadable time makes the record poison: claim it to put it to rest.
        Some(at) => Some(parse_timestamp(at).unwrap_or(DateTime::<Utc>::MIN_UTC)),
    }
}

impl OutboxRepository for NatsKvOutboxRepository {
    async fn claim(&self, request: ClaimRequest) -> Result<Claim> {
        let now = now_millis();
        let cutoff = request.cutoff.unwrap_or(now);
        let mut claim = Claim::empty(new_id(), cutoff);
        let until = add_saturating(now, request.lease);
        let mut due: Vec<(Read, Result<OutboxMessage>)> = self
            .read_all()
            .await?
            .into_iter()
            .filter_map(|read| {
                let at = claimable_at(&read)?;
                // A lease ends on `now`; a due time is compared with the wave's cutoff.
                let claimed = read.str("state") == Some(OutboxMessageState::Claimed.as_str());
                if at > if claimed { now } else { cutoff } {
                    return None;
                }
                let message = match &read.raw {
                    Some(_) => Err(Error::decode(&read.key, "value", "not a JSON object")),
                    None => KvRecord::from_map(&read.key, read.value.clone())
                        .and_then(|record| record.to_message()),
                };
                Some((read, message))
            })
            .collect();
        // Poison first (it is cheap to put to rest), then the oldest records.
        due.sort_by(|(a, ma), (b, mb)| match (ma, mb) {
            (Ok(x), Ok(y)) => (x.created_at, &x.id).cmp(&(y.created_at, &y.id)),
            (Err(_), Ok(_)) => std::cmp::Ordering::Less,
            (Ok(_), Err(_)) => std::cmp::Ordering::Greater,
            (Err(_), Err(_)) => a.key.cmp(&b.key),
        });
        for (mut read, message) in due {
            if claim.len() >= request.limit {
                break;
            }
            match self.claim_one(&mut read, &claim.token, now, until).await {
                Ok(true) => {}
                Ok(false) => continue,
                // A record that grew past what the bucket accepts with its lease fields (or
                // a foreign value, wrapped to keep it) cannot be claimed, and so not be put
                // to rest either: leave it as it is, say so, and claim the others.
                Err(
                    err @ Error::Kv {
                        retryable: false, ..
                    },
                ) => {
                    tracing::error!(
                        key = %read.key,
                        error = %crate::chain::error_chain(&err),
                        "outbox KV record cannot be claimed: it is too large to store with its lease; fix or delete it"
                    );
                    continue;
                }
                Err(err) => return Err(err),
            }
            let id = match &message {
                Ok(message) => message.id.clone(),
                Err(_) => read.id(),
            };
            if key_of(&id) != read.key {
                claim.stored_at.insert(id.clone(), read.key.clone());
            }
            match message {
                Ok(mut message) => {
                    // Report the state it was claimed from.
                    if message.state == OutboxMessageState::Claimed {
                        message.state = if message.attempts == 0 {
                            OutboxMessageState::Pending
                        } else {
                            OutboxMessageState::Failed
                        };
                    }
                    claim.push_message(message);
                }
                Err(err) => claim.poisoned.push(PoisonRow {
                    id,
                    reason: err.to_string(),
                }),
            }
        }
        claim
            .messages
            .sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        Ok(claim)
    }

    async fn mark_dispatched(&self, claim: &Claim, rows: &[Dispatched]) -> Result<u64> {
        let outcomes: std::collections::HashMap<&str, &Option<Value>> =
            rows.iter().map(|r| (r.id.as_str(), &r.outcome)).collect();
        let marked = self
            .change_all_held(
                claim,
                rows.iter().map(|r| r.id.as_str()),
                |id, value, now| {
                    set(value, "state", OutboxMessageState::Dispatched.as_str());
                    set(value, "updatedAt", format_timestamp(now));
                    value.remove("nextAttemptAt");
                    value.remove("lastError");
                    value.remove("claimToken");
                    match outcomes.get(id).copied().cloned().flatten() {
                        Some(outcome) => set(value, "outcome", outcome.to_string()),
                        None => {
                            value.remove("outcome");
                        }
                    }
                },
            )
            .await?;
        Ok(marked.len() as u64)
    }

    async fn mark_failures(&self, claim: &Claim, failures: &[Failure]) -> Result<Vec<String>> {
        let by_id: std::collections::HashMap<&str, &Failure> =
            failures.iter().map(|f| (f.id.as_str(), f)).collect();
        self.change_all_held(
            claim,
            failures.iter().map(|f| f.id.as_str()),
            |id, value, now| {
                let Some(failure) = by_id.get(id) else { return };
                let attempts = value.get("attempts").and_then(Value::as_u64).unwrap_or(0);
                let (state, counts, next) = match failure.outcome {
                    FailureOutcome::Retry { after } => (
                        OutboxMessageState::Failed,
                        true,
                        format_timestamp(add_saturating(now, after)),
                    ),
                    FailureOutcome::Dead { count_attempt } => {
                        (OutboxMessageState::Dead, count_attempt, NEVER.to_owned())
                    }
                };
                set(value, "state", state.as_str());
                set(value, "updatedAt", format_timestamp(now));
                set(value, "nextAttemptAt", next);
                set(value, "lastError", failure.error.clone());
                value.remove("claimToken");
                if counts {
                    value.insert("attempts".into(), Value::from(attempts.saturating_add(1)));
                }
            },
        )
        .await
    }

    fn extends_leases(&self) -> bool {
        true
    }

    async fn extend_lease(&self, claim: &Claim, ids: &[&str], lease: Duration) -> Result<u64> {
        let extended = self
            .change_all_held(claim, ids.iter().copied(), |_, value, now| {
                set(
                    value,
                    "nextAttemptAt",
                    format_timestamp(add_saturating(now, lease)),
                );
            })
            .await?;
        Ok(extended.len() as u64)
    }

    async fn release(&self, claim: &Claim, ids: &[&str]) -> Result<u64> {
        let released = self
            .change_all_held(claim, ids.iter().copied(), |_, value, now| {
                let tried = value.get("attempts").and_then(Value::as_u64).unwrap_or(0) > 0;
                let state = if tried {
                    OutboxMessageState::Failed
                } else {
                    OutboxMessageState::Pending
                };
                set(value, "state", state.as_str());
                set(value, "updatedAt", format_timestamp(now));
                value.remove("nextAttemptAt");
                value.remove("claimToken");
            })
            .await?;
        Ok(released.len() as u64)
    }

    async fn retry(&self, id: &str) -> Result<RetryOutcome> {
        let key = key_of(id);
        for _ in 0..CAS_ATTEMPTS {
            let Some(mut read) = self.read(&key).await? else {
                return Ok(RetryOutcome::NotFound);
            };
            let now = now_millis();
            match read.str("state") {
                Some("failed" | "dead") => {}
                Some("claimed") => {
                    let until = read
                        .str("nextAttemptAt")
                        .and_then(|at| parse_timestamp(at).ok())
                        .unwrap_or(now);
                    if until > now {
                        return Ok(RetryOutcome::Leased { until });
                    }
                }
                other => {
                    return Ok(RetryOutcome::NotRetryable {
                        state: other.unwrap_or("").to_owned(),
                    });
                }
            }
            set(
                &mut read.value,
                "state",
                OutboxMessageState::Pending.as_str(),
            );
            set(&mut read.value, "updatedAt", format_timestamp(now));
            read.value.insert("attempts".into(), Value::from(0));
            read.value.remove("nextAttemptAt");
            read.value.remove("claimToken");
            if self.write(&read).await? {
                return Ok(RetryOutcome::Retried);
            }
        }
        Err(Error::Kv {
            operation: "retry",
            key,
            source: "the record kept changing while it was being retried".into(),
            retryable: true,
        })
    }

    async fn purge_dispatched(&self, older_than: Duration, batch: usize) -> Result<u64> {
        let cutoff = TimeDelta::from_std(older_than)
            .ok()
            .and_then(|d| now_millis().checked_sub_signed(d))
            .unwrap_or(DateTime::<Utc>::MIN_UTC);
        let mut purged = 0;
        for read in self.read_all().await? {
            if purged as usize >= batch {
                break;
            }
            let old = read
                .str("updatedAt")
                .and_then(|at| parse_timestamp(at).ok())
                .is_some_and(|at| at < cutoff);
            if read.str("state") == Some("dispatched") && old {
                match self
                    .store
                    .purge_expect_revision(&read.key, Some(read.revision))
                    .await
                {
                    Ok(()) => purged += 1,
                    // Changed since it was read: leave it for the next purge.
                    Err(e) if e.kind() == kv::PurgeErrorKind::WrongLastRevision => {}
                    Err(e) => return Err(kv_error("purge", &read.key, e)),
                }
            }
        }
        Ok(purged)
    }

    async fn next_due_in(&self) -> Result<Option<Duration>> {
        let now = now_millis();
        Ok(self
            .read_all()
            .await?
            .iter()
            .filter_map(claimable_at)
            .map(|at| (at - now).to_std().unwrap_or(Duration::ZERO))
            .min())
    }
}
