//! Reading and replaying a consumer's dead letters (the copies `run.rs` publishes to
//! [`DEAD_LETTER_STREAM`] before terminating a message).

use std::time::SystemTime;

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::{LastRawMessageErrorKind, Stream};

use super::builder::{DEAD_LETTER_STREAM, DEAD_LETTER_SUBJECT_PREFIX};
use super::error::ConsumerError;
use super::run::dead_letter_headers as h;
use crate::record::NATS_MSG_ID;

/// A dead-letter copy of one message, as [`dead_letters`] reads it. Each field but
/// `sequence`, `at`, `payload` and `headers` comes from the copy's `Trellis-Dlq-*` headers
/// ([`dead_letter_headers`](super::dead_letter_headers)) and is `None` when the copy lacks it
/// (a copy written by another tool).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The copy's sequence in [`DEAD_LETTER_STREAM`].
    pub sequence: u64,
    /// When the copy was stored.
    pub at: SystemTime,
    /// The message's `Nats-Msg-Id`.
    pub message_id: Option<String>,
    /// The subject it was published to.
    pub subject: Option<String>,
    /// What failed (`Handler`, `Undecodable`, `MissingId`, `Panic`, `Database`).
    pub kind: Option<String>,
    /// The error that ended it.
    pub error: Option<String>,
    /// How many deliveries it had.
    pub deliveries: Option<u64>,
    /// The stream it was in.
    pub stream: Option<String>,
    /// Its sequence there.
    pub stream_sequence: Option<u64>,
    /// The message's payload.
    pub payload: bytes::Bytes,
    /// The copy's headers: the message's own (without its `Nats-*` headers) and the
    /// `Trellis-Dlq-*` ones.
    pub headers: HeaderMap,
}

impl DeadLetter {
    fn read(message: StreamMessage) -> Self {
        let text = |name: &str| {
            message
                .headers
                .get(name)
                .map(|value| value.as_str().to_owned())
        };
        let number = |name: &str| text(name).and_then(|value| value.parse().ok());
        Self {
            sequence: message.sequence,
            at: SystemTime::from(message.time),
            message_id: text(h::MESSAGE_ID),
            subject: text(h::SUBJECT),
            kind: text(h::KIND),
            error: text(h::ERROR),
            deliveries: number(h::DELIVERIES),
            stream: text(h::STREAM),
            stream_sequence: number(h::STREAM_SEQUENCE),
            payload: message.payload,
            headers: message.headers,
        }
    }

    /// Why replaying this copy would not help, if it would not.
    fn unreplayable(&self) -> Option<String> {
        let Some(id) = &self.message_id else {
            return Some(format!(
                "it has no `{}` header: without the message's id the consumer cannot \
                 de-duplicate it, and would dead-letter it again",
                h::MESSAGE_ID
            ));
        };
        if let Some(problem) = crate::wire::id_problem(id) {
            return Some(format!(
                "its message id {id:?} {problem}: the consumer would dead-letter it again"
            ));
        }
        if self.subject.is_none() {
            return Some(format!(
                "it has no `{}` header: where it was published is unknown",
                h::SUBJECT
            ));
        }
        None
    }

    /// The headers the replayed message carries: the message's own, its `Nats-Msg-Id` back.
    fn replay_headers(&self, id: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, values) in self.headers.iter() {
            let lower = name.to_string().to_ascii_lowercase();
            if lower.starts_with("nats-") || lower.starts_with("trellis-dlq-") {
                continue;
            }
            for value in values {
                headers.append(name.clone(), value.clone());
            }
        }
        headers.insert(NATS_MSG_ID, id);
        headers
    }
}

/// A dead letter [`replay_dead_letters`] left in place, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NotReplayed {
    /// The copy's sequence in [`DEAD_LETTER_STREAM`].
    pub sequence: u64,
    /// The message's id, if the copy has one.
    pub message_id: Option<String>,
    /// Why it was left.
    pub reason: String,
}

/// What [`replay_dead_letters`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayReport {
    /// Messages published again and their copies deleted.
    pub replayed: u64,
    /// Copies left in place, oldest first.
    pub left: Vec<NotReplayed>,
}

/// The dead-letter subject of `consumer`, once its name is known to be one subject token.
fn subject_of(consumer: &str) -> Result<String, ConsumerError> {
    let bad = consumer.is_empty()
        || consumer
            .chars()
            .any(|c| c == '.' || c == '*' || c == '>' || c.is_whitespace() || c.is_control());
    if bad {
        return Err(ConsumerError::InvalidOptions {
            option: "consumer",
            problem: format!(
                "{consumer:?} is not a durable consumer's name (one subject token: no `.`, `*`, \
                 `>` or whitespace)"
            ),
        });
    }
    Ok(format!("{DEAD_LETTER_SUBJECT_PREFIX}.{consumer}"))
}

/// The dead-letter stream, or `None` if no consumer ever created it.
async fn dead_letter_stream(jetstream: &Context) -> Result<Option<Stream>, ConsumerError> {
    match jetstream.get_stream(DEAD_LETTER_STREAM).await {
        Ok(stream) => Ok(Some(stream)),
        Err(error) => match error.kind() {
            GetStreamErrorKind::JetStream(inner)
                if inner.error_code() == ErrorCode::STREAM_NOT_FOUND =>
            {
                Ok(None)
            }
            _ => Err(ConsumerError::Stream {
                stream: DEAD_LETTER_STREAM.into(),
                source: error.into(),
            }),
        },
    }
}

/// The first copy on `subject` at or after `from`, if any.
async fn next_copy(
    stream: &Stream,
    subject: &str,
    from: u64,
) -> Result<Option<StreamMessage>, ConsumerError> {
    match stream.get_first_raw_message_by_subject(subject, from).await {
        Ok(message) => Ok(Some(message)),
        Err(error) if matches!(error.kind(), LastRawMessageErrorKind::NoMessageFound) => Ok(None),
        Err(error) => Err(ConsumerError::Stream {
            stream: DEAD_LETTER_STREAM.into(),
            source: error.into(),
        }),
    }
}

/// The dead-letter copies of durable consumer `consumer`, oldest first, at most `limit`.
/// Reads them without consuming them (nothing is acknowledged or removed).
///
/// # Errors
///
/// [`ConsumerError::InvalidOptions`] if `consumer` is not one subject token;
/// [`ConsumerError::Stream`] if the dead-letter stream cannot be read. A server where no
/// consumer ever dead-lettered anything (no [`DEAD_LETTER_STREAM`]) has none: `Ok` and empty.
///
/// # Examples
///
/// ```no_run
/// # async fn run(nats: async_nats::Client) -> Result<(), trellis_outbox::ConsumerError> {
/// let jetstream = async_nats::jetstream::new(nats);
/// for copy in trellis_outbox::dead_letters(&jetstream, "billing", 20).await? {
///     println!("{:?} {:?}: {:?}", copy.message_id, copy.kind, copy.error);
/// }
/// # Ok(()) }
/// ```
pub async fn dead_letters(
    jetstream: &Context,
    consumer: &str,
    limit: usize,
) -> Result<Vec<DeadLetter>, ConsumerError> {
    let subject = subject_of(consumer)?;
    let Some(stream) = dead_letter_stream(jetstream).await? else {
        return Ok(Vec::new());
    };
    let mut copies = Vec::new();
    let mut from = 1;
    while copies.len() < limit {
        let Some(message) = next_copy(&stream, &subject, from).await? else {
            break;
        };
        from = message.sequence.saturating_add(1);
        copies.push(DeadLetter::read(message));
    }
    Ok(copies)
}

/// Publishes durable consumer `consumer`'s dead letters again (at most `limit`, oldest
/// first), each to the subject it was first published to with its own `Nats-Msg-Id` and
/// headers, and deletes each copy once the stream has acknowledged the message. Run it once
/// the cause is fixed (a handler's bug, a missing table).
///
/// The message goes back to **every** consumer of that subject, not only to `consumer`. A
/// trellis-outbox [`Consumer`](super::Consumer) that applied it already finds its id in its
/// inbox and skips it; a consumer without an inbox would apply it again.
///
/// A copy is left in place, with the reason in [`ReplayReport::left`], when:
/// * it has no usable message id, or no subject (the consumer would dead-letter it again,
///   or there is nowhere to send it);
/// * the stream still holds its id in its duplicate window and drops the publish (replay
///   it after the window; the id may also be that of an earlier replay whose copy could
///   not be deleted, which the consumer's inbox absorbs).
///
/// # Errors
///
/// [`ConsumerError::InvalidOptions`] if `consumer` is not one subject token;
/// [`ConsumerError::Stream`] if the dead-letter stream cannot be read or a copy deleted;
/// [`ConsumerError::Replay`] if a message cannot be published (no stream for its subject,
/// no answer). Copies replayed before the error stay replayed; the rest stay in place.
///
/// # Examples
///
/// ```no_run
/// # async fn run(nats: async_nats::Client) -> Result<(), trellis_outbox::ConsumerError> {
/// let jetstream = async_nats::jetstream::new(nats);
/// let report = trellis_outbox::replay_dead_letters(&jetstream, "billing", 1_000).await?;
/// println!("replayed {}", report.replayed);
/// for left in &report.left {
///     println!("left {:?}: {}", left.message_id, left.reason);
/// }
/// # Ok(()) }
/// ```
pub async fn replay_dead_letters(
    jetstream: &Context,
    consumer: &str,
    limit: usize,
) -> Result<ReplayReport, ConsumerError> {
    let subject = subject_of(consumer)?;
    let mut report = ReplayReport::default();
    let Some(stream) = dead_letter_stream(jetstream).await? else {
        return Ok(report);
    };
    let mut from = 1;
    let mut seen = 0;
    while seen < limit {
        let Some(message) = next_copy(&stream, &subject, from).await? else {
            break;
        };
        seen += 1;
        from = message.sequence.saturating_add(1);
        let copy = DeadLetter::read(message);
        let leave = |reason: String| NotReplayed {
            sequence: copy.sequence,
            message_id: copy.message_id.clone(),
            reason,
        };
        if let Some(reason) = copy.unreplayable() {
            report.left.push(leave(reason));
            continue;
        }
        let (Some(id), Some(target)) = (&copy.message_id, &copy.subject) else {
            continue;
        };
        let replay_error = |source: async_nats::Error| ConsumerError::Replay {
            sequence: copy.sequence,
            subject: target.clone(),
            source,
        };
        let ack = jetstream
            .publish_with_headers(
                target.clone(),
                copy.replay_headers(id),
                copy.payload.clone(),
            )
            .await
            .map_err(|e| replay_error(e.into()))?
            .await
            .map_err(|e| replay_error(e.into()))?;
        if ack.duplicate {
            report.left.push(leave(format!(
                "stream `{}` still holds id {id:?} in its duplicate window and dropped the \
                 publish; replay it after the window",
                ack.stream
            )));
            continue;
        }
        stream
            .delete_message(copy.sequence)
            .await
            .map_err(|e| ConsumerError::Stream {
                stream: DEAD_LETTER_STREAM.into(),
                source: e.into(),
            })?;
        report.replayed += 1;
        tracing::info!(
            consumer,
            message_id = %id,
            subject = %target,
            stream = %ack.stream,
            sequence = ack.sequence,
            "dead letter replayed"
        );
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consumer_name_must_be_one_subject_token() {
        assert_eq!(
            subject_of("billing").unwrap_or_default(),
            "_trellis.consumer.dlq.billing"
        );
        for bad in ["", "a.b", "a*", ">", "a b", "a\nb"] {
            assert!(
                matches!(
                    subject_of(bad),
                    Err(ConsumerError::InvalidOptions {
                        option: "consumer",
                        ..
                    })
                ),
                "{bad:?}"
            );
        }
    }
}
