//! NATS helpers.

use crate::record::OutboxMessage;

impl OutboxMessage {
    /// The stored headers as an [`async_nats::HeaderMap`], ready to publish with.
    ///
    /// Header names and values were validated at enqueue, so every stored header is carried.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn run(js: async_nats::jetstream::Context, message: trellis_outbox::OutboxMessage) -> Result<(), Box<dyn std::error::Error>> {
    /// js.publish_with_headers(message.subject.clone(), message.nats_headers(), message.payload.clone().into())
    ///     .await?
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn nats_headers(&self) -> async_nats::HeaderMap {
        let mut map = async_nats::HeaderMap::new();
        for (name, value) in &self.headers {
            map.insert(name.as_str(), value.as_str());
        }
        map
    }
}
