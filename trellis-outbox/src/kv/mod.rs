//! Outbox and inbox in NATS KV buckets (feature `nats`), for services without SQL state:
//! [`NatsKvOutboxRepository`] (`outbox.rs`) and [`NatsKvInboxRepository`] (`inbox.rs`); the
//! stored value and the key of an id are in `record.rs`. Neither is transactional with
//! anything else.

mod inbox;
mod outbox;
mod record;

pub use inbox::NatsKvInboxRepository;
pub use outbox::NatsKvOutboxRepository;

use async_nats::jetstream::Context;
use async_nats::jetstream::kv::Store;
use async_nats::jetstream::stream::{Config, DiscardPolicy};

use crate::error::{Error, Result};

/// The bucket `bucket`, created (file storage, one value per key) if missing.
///
/// The bucket's stream is created directly, with the settings of a KV bucket: async-nats'
/// `create_key_value` first reads account information in a shape servers before 2.10 do not
/// send, and this works with those too.
pub(crate) async fn open_bucket(jetstream: &Context, bucket: &str) -> Result<Store> {
    let failed = |operation: &'static str| {
        move |e: Box<dyn std::error::Error + Send + Sync>| Error::Kv {
            operation,
            key: bucket.to_owned(),
            source: e,
            retryable: true,
        }
    };
    if let Ok(store) = jetstream.get_key_value(bucket).await {
        return Ok(store);
    }
    jetstream
        .get_or_create_stream(Config {
            name: format!("KV_{bucket}"),
            subjects: vec![format!("$KV.{bucket}.>")],
            max_messages_per_subject: 1,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: DiscardPolicy::New,
            ..Config::default()
        })
        .await
        .map_err(|e| failed("open")(Box::new(e)))?;
    jetstream
        .get_key_value(bucket)
        .await
        .map_err(|e| failed("open")(Box::new(e)))
}
