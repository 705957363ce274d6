//! Publishing through a Trellis participant (feature `trellis-participant`).
//!
//! Consumers of Trellis 0.11.0-rc.7 and later accept only events signed by an authorized
//! participant (spec §J.2): a message without a valid `proof` is terminated. This publisher
//! hands each stored event row to `trellis-rs`'s [`TrellisClient::publish_prepared`], which
//! signs it at dispatch with the client's session key and publishes it to JetStream. The
//! row's id and event time are kept ([`PreparedTrellisEvent::restore`]); so are its other
//! headers (trace context, application headers).
//!
//! What a row needs to pass upstream's checks, all made again here before anything is sent:
//! - a `Trellis-Event-Descriptor` header (the derive writes it with `#[outbox(api = "…")]`);
//! - a subject on the current wire, `events.v1.<base64url(api)>.<Event>[.<base64url(param)>…]`
//!   (see [`trellis_event_subject`](crate::trellis_event_subject)), with as many parameter tokens as the descriptor says;
//! - a ULID id and an RFC 3339 `Trellis-Event-Time` (what `enqueue` writes).
//!
//! A row that fails them is poison: it goes `dead` with the reason, the rest of its batch is
//! published. Job rows are not Trellis events and are refused the same way: dispatch them
//! with a [`JetStreamPublisher`](crate::JetStreamPublisher) on their own outbox table.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use trellis_rs::client::{PreparedTrellisEvent, SubjectError, TrellisClient, TrellisClientError};

use crate::descriptor::TRELLIS_EVENT_DESCRIPTOR;
use crate::dispatch::{PublishError, Publisher};
use crate::record::{OutboxMessage, OutboxRecordKind, TRELLIS_EVENT_TIME};

/// How long one signed publish (authorization, signing, JetStream ack) may take, by default.
pub const DEFAULT_PARTICIPANT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);

/// How many publishes of one batch are in flight at once, by default.
pub const DEFAULT_PARTICIPANT_WINDOW: usize = 64;

/// Why a row could not be published through the participant.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ParticipantError {
    /// The row is a job, not a Trellis event.
    #[error(
        "outbox row '{id}' is a {} record; only event.publish rows are Trellis events",
        kind.as_str()
    )]
    NotAnEvent {
        /// The row's id.
        id: String,
        /// The row's kind.
        kind: OutboxRecordKind,
    },
    /// A header upstream requires is missing.
    #[error("outbox row '{id}' has no {header} header (a Trellis event needs it)")]
    MissingHeader {
        /// The row's id.
        id: String,
        /// The header's name.
        header: &'static str,
    },
    /// A stored header NATS cannot carry (a name with a space, `:` or non-ASCII, a value
    /// with a control character other than tab) or a `Nats-*` control header.
    #[error("outbox row '{id}' has a header that cannot be published: {problem}")]
    InvalidHeader {
        /// The row's id.
        id: String,
        /// What is wrong with the header.
        problem: String,
    },
    /// Upstream refused the stored event (descriptor, subject shape, id or event time).
    #[error("outbox row '{id}' is not a valid Trellis event")]
    Restore {
        /// The row's id.
        id: String,
        /// Upstream's reason.
        #[source]
        source: SubjectError,
    },
    /// Publishing (authorization, signing or the JetStream ack) failed.
    #[error("publishing outbox row '{id}' as a Trellis participant failed")]
    Publish {
        /// The row's id.
        id: String,
        /// The client's error.
        #[source]
        source: TrellisClientError,
    },
    /// Publishing did not finish in time.
    #[error("publishing outbox row '{id}' as a Trellis participant timed out after {after:?}")]
    Timeout {
        /// The row's id.
        id: String,
        /// The timeout that passed.
        after: Duration,
    },
}

impl ParticipantError {
    /// Whether a later attempt may succeed: timeouts, broken connections and an
    /// authorization service that does not answer are retried; a row upstream refuses, or a
    /// proof or permission that is rejected, is not.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::NotAnEvent { .. }
            | Self::MissingHeader { .. }
            | Self::InvalidHeader { .. }
            | Self::Restore { .. } => false,
            Self::Timeout { .. } => true,
            Self::Publish { source, .. } => match source {
                // Upstream turns the JetStream publish error into text; a message too large
                // for the server or the stream stays too large.
                TrellisClientError::NatsRequest(text) => !is_oversized(text),
                TrellisClientError::Nats(err) => !is_oversized(&err.to_string()),
                TrellisClientError::Io(_)
                | TrellisClientError::NatsConnect(_)
                | TrellisClientError::ServiceUnavailable(_)
                | TrellisClientError::AuthorizationUnavailable(_)
                | TrellisClientError::TransportUnavailable(_)
                | TrellisClientError::Timeout => true,
                _ => false,
            },
        }
    }
}

/// Whether a NATS publish error's text says the message is too large: the client's
/// `max payload size exceeded`, or JetStream's error 10054 (message over the stream's
/// `max_msg_size`) or 10097 (headers over 64 KiB), shown as `error code <n>`.
fn is_oversized(text: &str) -> bool {
    text.contains("max payload size exceeded")
        || text.contains("error code 10054)")
        || text.contains("error code 10097)")
}

impl From<ParticipantError> for PublishError {
    fn from(err: ParticipantError) -> Self {
        if err.is_retryable() {
            PublishError::retryable(err)
        } else {
            PublishError::permanent(err)
        }
    }
}

/// The headers `trellis-rs` sets on every event it publishes (id, time, descriptor, signing
/// context and proof); a stored header with one of these names, in any letter case, is not
/// passed on.
const UPSTREAM_HEADERS: [&str; 7] = [
    crate::record::NATS_MSG_ID,
    TRELLIS_EVENT_TIME,
    TRELLIS_EVENT_DESCRIPTOR,
    "authorization-context",
    "session-key",
    "Trellis-Session-Event",
    "proof",
];

/// A header of `headers` by name, in either case (upstream accepts both on read).
fn header<'a>(headers: &'a BTreeMap<String, String>, name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(key, _)| key.eq_ignore_ascii_case(name))
        .map(|(_, value)| value.as_str())
}

/// The stored event row `message` as upstream's prepared event: its subject, payload,
/// descriptor identity, id and event time, checked by [`PreparedTrellisEvent::restore`], with
/// the row's other headers kept.
///
/// # Errors
///
/// [`ParticipantError::NotAnEvent`] for job rows, [`ParticipantError::MissingHeader`]
/// without a descriptor or event time, [`ParticipantError::InvalidHeader`] for a header NATS
/// cannot carry (the message may have been built or edited by hand, or read from a table
/// another writer filled), [`ParticipantError::Restore`] when upstream refuses what is
/// stored.
pub fn prepared_event(message: &OutboxMessage) -> Result<PreparedTrellisEvent, ParticipantError> {
    if message.kind != OutboxRecordKind::EventPublish {
        return Err(ParticipantError::NotAnEvent {
            id: message.id.clone(),
            kind: message.kind,
        });
    }
    let required = |name: &'static str| {
        header(&message.headers, name).ok_or_else(|| ParticipantError::MissingHeader {
            id: message.id.clone(),
            header: name,
        })
    };
    let descriptor = required(TRELLIS_EVENT_DESCRIPTOR)?;
    let event_time = required(TRELLIS_EVENT_TIME)?;
    let restored = PreparedTrellisEvent::restore(
        message.subject.as_str(),
        bytes::Bytes::from(message.payload.clone()),
        descriptor,
        message.id.as_str(),
        event_time,
    )
    .map_err(|source| ParticipantError::Restore {
        id: message.id.clone(),
        source,
    })?;
    // The rest of the row's headers (trace context, application headers) travel along;
    // upstream overlays its own id, time, descriptor and proof headers on them. Its header
    // map is case-sensitive, so a stored `nats-msg-id` or `trellis-event-time` would be sent
    // next to upstream's own: the headers upstream sets are dropped here in any letter case.
    // `HeaderMap::insert` panics on a name or value NATS cannot carry: check first.
    let mut headers = trellis_nats::HeaderMap::new();
    for (name, value) in &message.headers {
        if let Some(problem) = crate::wire::header_problem(name, value) {
            return Err(ParticipantError::InvalidHeader {
                id: message.id.clone(),
                problem,
            });
        }
        if !UPSTREAM_HEADERS
            .iter()
            .any(|upstream| upstream.eq_ignore_ascii_case(name))
        {
            headers.insert(name.as_str(), value.as_str());
        }
    }
    Ok(restored.with_headers(headers))
}

/// A [`Publisher`] that publishes event rows as an authorized Trellis participant, signing
/// each at dispatch through `trellis-rs`. A row needs a `Trellis-Event-Descriptor` header
/// (`#[outbox(api = "…")]` writes it), a subject on the current wire
/// ([`trellis_event_subject`](crate::trellis_event_subject)), a ULID id and an RFC 3339
/// `Trellis-Event-Time`; one without them goes `dead` with the reason, and so do job rows.
///
/// ```no_run
/// # async fn run(client: trellis_rs::client::TrellisClient, pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use trellis_outbox::{OutboxDispatcher, PgOutboxRepository, TrellisParticipantPublisher};
///
/// let publisher = TrellisParticipantPublisher::new(Arc::new(client));
/// let dispatcher = OutboxDispatcher::builder(PgOutboxRepository::new(pool), publisher).start()?;
/// // … on shutdown:
/// dispatcher.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct TrellisParticipantPublisher {
    client: Arc<TrellisClient>,
    timeout: Duration,
    window: usize,
}

impl std::fmt::Debug for TrellisParticipantPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrellisParticipantPublisher")
            .field("timeout", &self.timeout)
            .field("window", &self.window)
            .finish_non_exhaustive()
    }
}

impl TrellisParticipantPublisher {
    /// Publishes through `client`, a connected and authorized Trellis participant.
    pub fn new(client: Arc<TrellisClient>) -> Self {
        Self {
            client,
            timeout: DEFAULT_PARTICIPANT_PUBLISH_TIMEOUT,
            window: DEFAULT_PARTICIPANT_WINDOW,
        }
    }

    /// How long one publish may take before it counts as a retryable failure (default
    /// [`DEFAULT_PARTICIPANT_PUBLISH_TIMEOUT`]; at least 1 ms).
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// How many publishes of a batch are in flight at once (default
    /// [`DEFAULT_PARTICIPANT_WINDOW`]; at least 1).
    pub fn window(mut self, window: usize) -> Self {
        self.window = window.max(1);
        self
    }

    async fn publish_one(
        &self,
        message: &OutboxMessage,
    ) -> Result<Option<serde_json::Value>, PublishError> {
        let event = prepared_event(message)?;
        match tokio::time::timeout(self.timeout, self.client.publish_prepared(&event)).await {
            Ok(Ok(())) => Ok(None),
            Ok(Err(source)) => Err(ParticipantError::Publish {
                id: message.id.clone(),
                source,
            }
            .into()),
            Err(_) => Err(ParticipantError::Timeout {
                id: message.id.clone(),
                after: self.timeout,
            }
            .into()),
        }
    }
}

impl Publisher for TrellisParticipantPublisher {
    async fn publish_batch(
        &self,
        messages: &[OutboxMessage],
    ) -> Vec<Result<Option<serde_json::Value>, PublishError>> {
        // The futures are built first: a `map` closure over borrowed rows inside the stream
        // is not general enough for the `Send` bound on this future.
        let publishes: Vec<_> = messages.iter().map(|m| self.publish_one(m)).collect();
        futures_util::stream::iter(publishes)
            .buffered(self.window)
            .collect()
            .await
    }

    fn publish_budget(&self, rows: usize) -> Option<Duration> {
        let rounds = rows.div_ceil(self.window).max(1);
        Some(
            self.timeout
                .saturating_mul(u32::try_from(rounds).unwrap_or(u32::MAX)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_publishes_are_permanent_other_nats_failures_retried() {
        let publish = |source| ParticipantError::Publish {
            id: "01ID".into(),
            source,
        };
        for text in [
            "max payload size exceeded",
            "other: message size exceeds maximum allowed (code 400, error code 10054)",
            "other: header size exceeds maximum allowed of 64k (code 400, error code 10097)",
        ] {
            assert!(
                !publish(TrellisClientError::NatsRequest(text.into())).is_retryable(),
                "{text}"
            );
            assert!(
                !publish(TrellisClientError::Nats(text.into())).is_retryable(),
                "{text}"
            );
        }
        for text in [
            "timed out",
            "other: stream store failed (code 503, error code 10077)",
            "broken pipe",
        ] {
            assert!(
                publish(TrellisClientError::NatsRequest(text.into())).is_retryable(),
                "{text}"
            );
        }
        assert!(publish(TrellisClientError::Timeout).is_retryable());
    }
}
