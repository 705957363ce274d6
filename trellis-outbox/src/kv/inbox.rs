//! [`NatsKvInboxRepository`]: message ids seen, in a NATS KV bucket.

use async_nats::jetstream::kv::{self, CreateErrorKind};

use super::record::key_of;
use crate::error::{Error, Result};
use crate::record::{InboxReceipt, new_id};
use crate::time::{format_timestamp, now_millis};

/// An inbox in a NATS KV bucket (upstream's `NatsKvInboxRepository`, spec §E.2): `record(id)`
/// creates the key `id` if absent, atomically, so of several consumers recording one id
/// exactly one is told [`InboxReceipt::Accepted`].
///
/// **Not transactional with anything else**: record the id, apply the effect, and a crash
/// between the two leaves the message marked seen but not applied (or, applied first, applied
/// twice). Use it only for effects that are idempotent themselves; otherwise use the SQL inbox
/// with `tx.record_inbox(id)` in the effect's transaction (what [`Consumer`](crate::Consumer)
/// does). Keys are escaped once, as in
/// [`NatsKvOutboxRepository`](crate::NatsKvOutboxRepository). For retention, give the bucket a
/// `max_age` (ids older than it are forgotten; keep it above the stream's redelivery horizon).
///
/// # Examples
///
/// ```no_run
/// # async fn run(js: async_nats::jetstream::Context) -> trellis_outbox::Result<()> {
/// use trellis_outbox::{InboxReceipt, NatsKvInboxRepository};
///
/// let inbox = NatsKvInboxRepository::open(&js, "billing_inbox").await?;
/// if inbox.record("01J9ZK3V8Q2W4E6R8T0Y1U3I5O").await? == InboxReceipt::Accepted {
///     // first time: apply the (idempotent) effect
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct NatsKvInboxRepository {
    store: kv::Store,
}

impl NatsKvInboxRepository {
    /// An inbox in `store`.
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

    /// Records `message_id`: [`InboxReceipt::Accepted`] the first time,
    /// [`InboxReceipt::Duplicate`] after that.
    ///
    /// The stored value is upstream's `{messageId, receivedAt}` plus `writer`, a fresh id of
    /// this call: when the write's acknowledgement is late, async-nats reads the key back, and
    /// a value this call wrote itself is still `Accepted`, not taken for another consumer's.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidMessageId`] for an empty id or one with control characters;
    /// [`Error::Kv`] if the bucket fails.
    pub async fn record(&self, message_id: &str) -> Result<InboxReceipt> {
        crate::outbox::check_message_id(message_id)?;
        let key = key_of(message_id);
        // `writer` tells this call's own write from another's: async-nats' `create` reads the
        // key back when its write is not acknowledged in time, and then finds the value this
        // very call stored (the write landed, its acknowledgement was late).
        let writer = new_id();
        let value = serde_json::json!({
            "messageId": message_id,
            "receivedAt": format_timestamp(now_millis()),
            "writer": writer,
        });
        let bytes = serde_json::to_vec(&value).map_err(|source| Error::Serialize {
            what: "inbox KV record",
            source,
        })?;
        let failed = |e: Box<dyn std::error::Error + Send + Sync>, retryable| Error::Kv {
            operation: "record inbox",
            key: key.clone(),
            retryable,
            source: e,
        };
        match self.store.create(&key, bytes.into()).await {
            Ok(_) => Ok(InboxReceipt::Accepted),
            Err(e) if e.kind() == CreateErrorKind::AlreadyExists => {
                let stored = self
                    .store
                    .get(&key)
                    .await
                    .map_err(|e| failed(Box::new(e), true))?;
                Ok(
                    if stored.as_deref().is_some_and(|v| written_by(v, &writer)) {
                        InboxReceipt::Accepted
                    } else {
                        InboxReceipt::Duplicate
                    },
                )
            }
            Err(e) => {
                let retryable = e.kind() != CreateErrorKind::InvalidKey;
                Err(failed(Box::new(e), retryable))
            }
        }
    }
}

/// Whether the stored inbox value `value` was written by the call that generated `writer`.
fn written_by(value: &[u8], writer: &str) -> bool {
    #[derive(serde::Deserialize)]
    struct Stored {
        writer: Option<String>,
    }
    serde_json::from_slice::<Stored>(value)
        .is_ok_and(|stored| stored.writer.as_deref() == Some(writer))
}
