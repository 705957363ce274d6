//! Reading and replaying a consumer's dead letters (the copies `run.rs` publishes to
//! [`DEAD_LETTER_STREAM`] before terminating a message).

use std::time::{Duration, SystemTime};

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::{GetStreamErrorKind, PublishErrorKind};
use async_nats::jetstream::stream::{DeleteMessageErrorKind, Stream};
use async_nats::jetstream::{Context, ErrorCode, Message};
use futures_util::StreamExt as _;

use super::builder::{DEAD_LETTER_STREAM, DEAD_LETTER_SUBJECT_PREFIX};
use super::error::ConsumerError;
use super::run::{dead_letter_headers as h, headers_without};
use crate::dispatch::BoxError;
use crate::record::NATS_MSG_ID;

/// How many copies one fetch asks for.
const FETCH: usize = 256;
/// How long the server may take to answer a fetch, and the client to receive each copy: a
/// reply lost in a reconnect must not hang the read.
const FETCH_WAIT: Duration = Duration::from_secs(10);
/// How long the reading consumer may sit unused before the server deletes it (a replay
/// publishes and deletes each copy of a batch before it fetches again); `close` deletes it
/// sooner.
const READER_IDLE: Duration = Duration::from_secs(300);

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
    /// The copy's headers: the message's own but its `Nats-*` ones, the `Trellis-Dlq-*`
    /// ones, and the copy's own `Nats-Msg-Id` (`dlq:<consumer>:<stream>:<sequence>`, which
    /// makes the copy's publish idempotent).
    pub headers: HeaderMap,
}

impl DeadLetter {
    /// The copy `message`, or `None` if it is not one (no stream sequence).
    fn read(message: Message) -> Option<Self> {
        let (sequence, at) = match message.info() {
            Ok(info) => (info.stream_sequence, SystemTime::from(info.published)),
            Err(_) => return None,
        };
        let headers = message.message.headers.unwrap_or_default();
        let text = |name: &str| headers.get(name).map(|value| value.as_str().to_owned());
        let number = |name: &str| text(name).and_then(|value| value.parse().ok());
        Some(Self {
            sequence,
            at,
            message_id: text(h::MESSAGE_ID),
            subject: text(h::SUBJECT),
            kind: text(h::KIND),
            error: text(h::ERROR),
            deliveries: number(h::DELIVERIES),
            stream: text(h::STREAM),
            stream_sequence: number(h::STREAM_SEQUENCE),
            payload: message.message.payload,
            headers,
        })
    }

    /// Where to replay this copy and with which id, or why replaying it would not help.
    fn replay_target(&self) -> Result<(&str, &str), String> {
        let Some(id) = &self.message_id else {
            return Err(format!(
                "it has no `{}` header: without the message's id the consumer cannot \
                 de-duplicate it, and would dead-letter it again",
                h::MESSAGE_ID
            ));
        };
        if let Some(problem) = crate::wire::id_problem(id) {
            return Err(format!(
                "its message id {id:?} {problem}: the consumer would dead-letter it again"
            ));
        }
        let Some(subject) = &self.subject else {
            return Err(format!(
                "it has no `{}` header: where it was published is unknown",
                h::SUBJECT
            ));
        };
        Ok((subject, id))
    }

    /// The headers the replayed message carries: the message's own (every value of each),
    /// its `Nats-Msg-Id` back.
    fn replay_headers(&self, id: &str) -> HeaderMap {
        let mut headers = headers_without(&self.headers, &["Nats-", "Trellis-Dlq-"]);
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

/// The copies on one dead-letter subject as the stream held them when reading began, oldest
/// first, read through an ephemeral consumer that acknowledges nothing (a direct get would
/// keep only the last value of a header that has several). Copies stored after the start are
/// not read: a replay does not meet the copies of its own failed messages again.
struct Copies {
    stream: Stream,
    consumer: PullConsumer,
    /// The stream's last sequence when reading began.
    end: u64,
    /// Read up to `end`, or the stream had no more.
    done: bool,
}

impl Copies {
    /// `None` if the dead-letter stream does not exist or holds nothing.
    async fn open(jetstream: &Context, subject: String) -> Result<Option<Self>, ConsumerError> {
        let Some(stream) = dead_letter_stream(jetstream).await? else {
            return Ok(None);
        };
        let state = &stream.cached_info().state;
        if state.messages == 0 {
            return Ok(None);
        }
        let end = state.last_sequence;
        let consumer = stream
            .create_consumer(PullConfig {
                filter_subject: subject,
                deliver_policy: DeliverPolicy::All,
                ack_policy: AckPolicy::None,
                inactive_threshold: READER_IDLE,
                memory_storage: true,
                ..PullConfig::default()
            })
            .await
            .map_err(stream_error)?;
        Ok(Some(Self {
            stream,
            consumer,
            end,
            done: false,
        }))
    }

    /// The next copies, at most `max` (none once every copy up to `end` was read).
    async fn next(&mut self, max: usize) -> Result<Vec<DeadLetter>, ConsumerError> {
        let mut copies = Vec::new();
        if self.done || max == 0 {
            return Ok(copies);
        }
        let mut batch = self
            .consumer
            .fetch()
            .max_messages(max.min(FETCH))
            .expires(FETCH_WAIT)
            .messages()
            .await
            .map_err(stream_error)?;
        let mut any = false;
        loop {
            let message = match tokio::time::timeout(FETCH_WAIT, batch.next()).await {
                Ok(Some(message)) => message.map_err(stream_error)?,
                Ok(None) => break,
                Err(_) => {
                    return Err(stream_error(format!(
                        "no answer to a read of dead letters within {FETCH_WAIT:?}"
                    )));
                }
            };
            any = true;
            let last = message.info().map_or(true, |info| info.pending == 0);
            match DeadLetter::read(message) {
                Some(copy) if copy.sequence <= self.end => copies.push(copy),
                _ => self.done = true,
            }
            if last {
                self.done = true;
            }
        }
        if !any {
            self.done = true;
        }
        Ok(copies)
    }

    /// Deletes the copy `sequence` from the stream; one already gone (another replay took it)
    /// is deleted too.
    async fn delete(&self, sequence: u64) -> Result<(), ConsumerError> {
        match self.stream.delete_message(sequence).await {
            Ok(_) => Ok(()),
            Err(error)
                if matches!(error.kind(), DeleteMessageErrorKind::JetStream(inner)
                    if inner.error_code() == ErrorCode::NO_MESSAGE_FOUND) =>
            {
                Ok(())
            }
            Err(error) => Err(stream_error(error)),
        }
    }

    /// Deletes the reading consumer (else the server does after [`READER_IDLE`] unused).
    async fn close(self) {
        let name = self.consumer.cached_info().name.clone();
        if let Err(error) = self.stream.delete_consumer(&name).await {
            tracing::debug!(%error, "could not delete the dead-letter reader; the server will");
        }
    }
}

fn stream_error(error: impl Into<BoxError>) -> ConsumerError {
    ConsumerError::Stream {
        stream: DEAD_LETTER_STREAM.into(),
        source: error.into(),
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
    let Some(mut copies) = Copies::open(jetstream, subject).await? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    let read = async {
        while out.len() < limit {
            let next = copies.next(limit - out.len()).await?;
            if next.is_empty() {
                break;
            }
            out.extend(next);
        }
        Ok::<_, ConsumerError>(())
    }
    .await;
    copies.close().await;
    read?;
    Ok(out)
}

/// Publishes durable consumer `consumer`'s dead letters again, oldest first, each to the
/// subject it was first published to with its own `Nats-Msg-Id` and headers, and deletes each
/// copy once the stream has acknowledged the message. Run it once the cause is fixed (a
/// handler's bug, a missing table). At most `limit` messages are published (copies without
/// a usable id or subject are passed over without counting). Only the copies stored when the
/// replay starts are replayed: a message that fails again is dead-lettered again, not
/// replayed in a loop. Copies are read through an ephemeral consumer of
/// [`DEAD_LETTER_STREAM`] that acknowledges nothing, deleted at the end.
///
/// The message goes back to **every** consumer of that subject, not only to `consumer`. A
/// trellis-outbox [`Consumer`](super::Consumer) that applied it already finds its id in its
/// inbox and skips it; a consumer without an inbox would apply it again.
///
/// A copy is left in place, with the reason in [`ReplayReport::left`], when:
/// * it has no usable message id, or no subject (the consumer would dead-letter it again,
///   or there is nowhere to send it);
/// * no stream answered for its subject (none takes it any more, or it is unavailable);
/// * the stream still holds its id in its duplicate window and drops the publish (replay
///   it after the window; the id may also be that of an earlier replay whose copy could
///   not be deleted, which the consumer's inbox absorbs).
///
/// # Errors
///
/// [`ConsumerError::InvalidOptions`] if `consumer` is not one subject token;
/// [`ConsumerError::Stream`] if the dead-letter stream cannot be read or a copy deleted;
/// [`ConsumerError::Replay`] if a message cannot be published (no answer from the server),
/// with how many were replayed before it. Copies replayed before an error stay replayed;
/// the rest stay in place.
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
    let Some(mut copies) = Copies::open(jetstream, subject).await? else {
        return Ok(report);
    };
    let outcome = replay(jetstream, consumer, &mut copies, limit, &mut report).await;
    copies.close().await;
    outcome.map(|()| report)
}

/// The loop of [`replay_dead_letters`] over `copies`.
async fn replay(
    jetstream: &Context,
    consumer: &str,
    copies: &mut Copies,
    limit: usize,
    report: &mut ReplayReport,
) -> Result<(), ConsumerError> {
    let mut published = 0;
    while published < limit {
        let batch = copies.next(limit - published).await?;
        if batch.is_empty() {
            return Ok(());
        }
        for copy in batch {
            if published == limit {
                // Read ahead of the limit: left as it is, and not reported.
                break;
            }
            let leave = |reason: String| NotReplayed {
                sequence: copy.sequence,
                message_id: copy.message_id.clone(),
                reason,
            };
            let (target, id) = match copy.replay_target() {
                Ok(target) => target,
                Err(reason) => {
                    report.left.push(leave(reason));
                    continue;
                }
            };
            published += 1;
            let replay_error = |source: BoxError| ConsumerError::Replay {
                sequence: copy.sequence,
                subject: target.to_owned(),
                replayed: report.replayed,
                source,
            };
            let sent = jetstream
                .publish_with_headers(
                    target.to_owned(),
                    copy.replay_headers(id),
                    copy.payload.clone(),
                )
                .await
                .map_err(|e| replay_error(e.into()))?
                .await;
            let ack = match sent {
                Ok(ack) => ack,
                Err(error) if matches!(error.kind(), PublishErrorKind::StreamNotFound) => {
                    report.left.push(leave(format!(
                        "no stream answered for subject `{target}` (none takes it any more, or \
                         it is unavailable)"
                    )));
                    continue;
                }
                Err(error) => return Err(replay_error(error.into())),
            };
            if ack.duplicate {
                report.left.push(leave(format!(
                    "stream `{}` still holds id {id:?} in its duplicate window and dropped the \
                     publish; replay it after the window",
                    ack.stream
                )));
                continue;
            }
            copies.delete(copy.sequence).await?;
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
    }
    Ok(())
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
