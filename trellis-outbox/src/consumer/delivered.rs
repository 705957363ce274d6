//! One message as the handler sees it.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

/// A decoded message handed to a [`Handler`](super::Handler): the event and where it came
/// from.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Delivered<E> {
    /// The decoded payload.
    pub event: E,
    /// The message id (`Nats-Msg-Id`): the outbox row id of the publisher, and the key of
    /// this consumer's inbox row.
    pub id: String,
    /// The event's time (`Trellis-Event-Time`), when the message carries a valid one.
    pub time: Option<DateTime<Utc>>,
    /// The subject the message was published to.
    pub subject: String,
    /// The message's headers (the first value of each).
    pub headers: BTreeMap<String, String>,
    /// Which delivery this is: 1 the first, more after failures or lost acks (a replay
    /// counts its own deliveries from 1).
    pub delivery: u64,
    /// The message's sequence in its stream (a replay's: the original message's, as its
    /// dead-letter copy recorded it).
    pub stream_sequence: u64,
    /// Whether this is a dead letter handed back by
    /// [`replay_dead_letters`](crate::replay_dead_letters). Its `id`, `subject` and `headers`
    /// are the original message's.
    pub replayed: bool,
}
