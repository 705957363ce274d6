//! Reading and replaying a consumer's dead letters (the copies `run.rs` publishes to
//! [`DEAD_LETTER_STREAM`] before terminating a message).

use std::time::{Duration, SystemTime};

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::{
    ConsumerInfoErrorKind, GetStreamErrorKind, PublishError, PublishErrorKind,
};
use async_nats::jetstream::stream::{
    DeleteMessageErrorKind, LastRawMessageErrorKind, StorageType, Stream,
};
use async_nats::jetstream::{Context, ErrorCode, Message};
use futures_util::StreamExt as _;

use super::builder::{
    DEAD_LETTER_STREAM, DEAD_LETTER_SUBJECT_PREFIX, REPLAY_STREAM, REPLAY_SUBJECT_PREFIX,
    replay_description, replay_stream_config,
};
use super::error::ConsumerError;
use super::run::{dead_letter_headers as h, headers_without};
use crate::dispatch::BoxError;
use crate::record::NATS_MSG_ID;

/// How many copies one fetch asks for.
const FETCH: usize = 256;
/// How long the server may hold a fetch open.
const FETCH_WAIT: Duration = Duration::from_secs(10);
/// How long the client waits for each copy of a fetch (or its end): longer than the server
/// holds it, so that only a reply lost in a reconnect, not a server waiting out the fetch,
/// ends the read with an error.
const RECEIVE_WAIT: Duration = Duration::from_secs(15);
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

    /// The message's subject and id, which the consumer reads from its replay, or why
    /// replaying it would not help.
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

    /// The headers the replay of this copy carries: the copy's, its `Trellis-Dlq-*` ones
    /// but the error text (the consumer reads the message's id and subject from them), and
    /// `id` (see
    /// [`replay_id`](Self::replay_id)) as its `Nats-Msg-Id`.
    fn replay_headers(&self, id: &str) -> HeaderMap {
        // Not the error text either: the consumer does not read it, and a copy whose error
        // was cut to fit `max_payload` must still fit with the replay's longer id.
        let mut headers = headers_without(&self.headers, &["Nats-", h::ERROR]);
        headers.insert(NATS_MSG_ID, id);
        headers
    }

    /// The replay's own `Nats-Msg-Id`: `replay:` and the copy's (`dlq:<consumer>:<stream>:
    /// <sequence>`, one per message), so that one message's replays share it and no other
    /// message's does, whatever the copy's sequence.
    fn replay_id(&self, consumer: &str) -> String {
        match self.headers.get(NATS_MSG_ID) {
            Some(copy) => format!("replay:{}", copy.as_str()),
            // A copy written by another tool: its message's id (one id, one message) and
            // its place.
            None => format!(
                "replay:{consumer}:{}:{}",
                self.message_id.as_deref().unwrap_or_default(),
                self.sequence
            ),
        }
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
    /// Messages handed back to their consumer (stored in [`REPLAY_STREAM`]) and their copies
    /// deleted.
    pub replayed: u64,
    /// Copies left in place, oldest first.
    pub left: Vec<NotReplayed>,
}

/// `consumer`, once it is known to be a durable consumer's name: one subject token.
fn token(consumer: &str) -> Result<&str, ConsumerError> {
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
    Ok(consumer)
}

/// The dead-letter subject of `consumer`.
fn subject_of(consumer: &str) -> Result<String, ConsumerError> {
    Ok(format!("{DEAD_LETTER_SUBJECT_PREFIX}.{}", token(consumer)?))
}

/// The subjects of `consumer`'s replays, which its durable on [`REPLAY_STREAM`] reads.
pub(super) fn replay_filter(consumer: &str) -> Result<String, ConsumerError> {
    Ok(format!("{REPLAY_SUBJECT_PREFIX}.{}.>", token(consumer)?))
}

/// The replay subject of `consumer`'s dead letter `sequence`: one per dead letter, so the
/// stream's one message per subject makes a replay published twice stored once.
fn replay_subject(consumer: &str, sequence: u64) -> String {
    format!("{REPLAY_SUBJECT_PREFIX}.{consumer}.{sequence}")
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
        // No copy of this consumer's: nothing to fetch (a fetch would wait out its time).
        let done = consumer.cached_info().num_pending == 0;
        Ok(Some(Self {
            stream,
            consumer,
            end,
            done,
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
            let message = match tokio::time::timeout(RECEIVE_WAIT, batch.next()).await {
                Ok(Some(message)) => message.map_err(stream_error)?,
                Ok(None) => break,
                Err(_) => {
                    return Err(stream_error(format!(
                        "no answer to a read of dead letters within {RECEIVE_WAIT:?}"
                    )));
                }
            };
            any = true;
            let last = message.info().map_or(true, |info| info.pending == 0);
            match DeadLetter::read(message) {
                Some(copy) if copy.sequence <= self.end => copies.push(copy),
                _ => self.done = true,
            }
            // The last copy there is: the rest of the fetch would only wait out its time.
            if last {
                self.done = true;
                break;
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

/// Hands durable consumer `consumer`'s dead letters back to it, oldest first, and deletes
/// each copy once the replay is stored. Run it once the cause is fixed (a handler's bug, a
/// missing table). At most `limit` messages are published (copies without a usable id or
/// subject, or dead-lettered by a consumer of the same name on another stream, are passed
/// over without counting). Only the copies stored when the replay starts are replayed: a
/// message that fails again is dead-lettered again, not replayed in a loop. Copies are read
/// through an ephemeral consumer of [`DEAD_LETTER_STREAM`] that acknowledges nothing,
/// deleted at the end.
///
/// Each message goes to `consumer` **only**: to
/// `_trellis.consumer.replay.<consumer>.<copy's sequence>` in [`REPLAY_STREAM`] (created if
/// missing), which that consumer reads beside its own stream (see
/// [`ConsumerBuilder::replays`](super::ConsumerBuilder::replays)). The other
/// consumers of the message's subject do not see it again. The consumer applies it as the
/// message it was: its id (the inbox key), subject and headers are the original's, and
/// [`Delivered::replayed`](super::Delivered::replayed) is `true`. A replay waits in the stream
/// until the consumer runs; once settled, the consumer deletes it.
///
/// A replay published again (a run stopped before it could delete a copy, then run again)
/// while the first is still stored, or within the stream's duplicate window, is not stored
/// twice: each copy has its own replay subject, the stream keeps one message per subject, and
/// the replay's `Nats-Msg-Id` is `replay:` and the copy's. The copy is then deleted and
/// counted as replayed. (Once the consumer has settled and deleted the first, a second one is
/// stored and delivered, and the consumer's inbox finds it applied.)
///
/// A copy is left in place, with the reason in [`ReplayReport::left`], when it has no usable
/// message id (the consumer could not de-duplicate it and would dead-letter it again) or no
/// subject; when it was dead-lettered by a consumer of the same name on another stream than
/// the one whose consumer reads the replays; when its replay would exceed the server's
/// `max_payload`; or when its replay subject holds another message (possible only after the
/// dead-letter stream was deleted and its sequences began again).
///
/// # Errors
///
/// [`ConsumerError::InvalidOptions`] if `consumer` is not one subject token;
/// [`ConsumerError::ReplayRefused`], before anything is replayed, if no durable of
/// `consumer`'s name reads its replays (the consumer never ran with
/// [`replays`](super::ConsumerBuilder::replays) on) or the existing replay stream would not
/// keep a replay until it is read (not one message per subject, an age limit, memory
/// storage, or deletes denied);
/// [`ConsumerError::Stream`] if the dead-letter stream cannot be read, a copy deleted, or the
/// replay stream created; [`ConsumerError::Replay`] if a message cannot be published (no
/// answer from the server), with how many were replayed before it. Copies replayed before an
/// error stay replayed; the rest stay in place.
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
    if copies.done {
        // No copy of this consumer's: nothing to check either.
        copies.close().await;
        return Ok(report);
    }
    let outcome = async {
        let (replays, serves) = replay_stream(jetstream, consumer).await?;
        let to = Reader {
            consumer,
            replays: &replays,
            serves: serves.as_deref(),
        };
        replay(jetstream, &to, &mut copies, limit, &mut report).await
    }
    .await;
    copies.close().await;
    outcome.map(|()| report)
}

/// [`REPLAY_STREAM`] (created if missing), once it is known to keep every replay until
/// `consumer` has read it (one message per subject, no age limit, file storage, deletes
/// allowed) and that a durable of `consumer`'s name reads its replay subjects; with that
/// durable's description, which names the stream of the consumer it serves.
async fn replay_stream(
    jetstream: &Context,
    consumer: &str,
) -> Result<(Stream, Option<String>), ConsumerError> {
    let refused = |problem: String| ConsumerError::ReplayRefused {
        consumer: consumer.to_owned(),
        problem,
    };
    let stream_error = |e: BoxError| ConsumerError::Stream {
        stream: REPLAY_STREAM.into(),
        source: e,
    };
    let stream = jetstream
        .get_or_create_stream(replay_stream_config())
        .await
        .map_err(|e| stream_error(e.into()))?;
    let config = &stream.cached_info().config;
    if config.max_messages_per_subject != 1 || !config.discard_new_per_subject {
        return Err(refused(format!(
            "stream {REPLAY_STREAM} does not keep one message per subject (max_messages_per_subject \
             {}, discard_new_per_subject {}): a replay could be stored twice or replaced",
            config.max_messages_per_subject, config.discard_new_per_subject
        )));
    }
    if !config.max_age.is_zero() {
        return Err(refused(format!(
            "stream {REPLAY_STREAM} drops messages after {:?}: a replay could expire unread",
            config.max_age
        )));
    }
    if config.storage != StorageType::File {
        return Err(refused(format!(
            "stream {REPLAY_STREAM} keeps messages in {:?} storage: a server restart would lose \
             the replays waiting there",
            config.storage
        )));
    }
    if config.deny_delete {
        return Err(refused(format!(
            "stream {REPLAY_STREAM} denies deletes: its consumers could not delete the replays \
             they settled"
        )));
    }
    let filter = replay_filter(consumer)?;
    match stream.consumer_info(consumer).await {
        Ok(info) if info.config.filter_subject == filter => Ok((stream, info.config.description)),
        Ok(info) => Err(refused(format!(
            "the durable `{consumer}` on {REPLAY_STREAM} reads `{}`, not `{filter}`",
            info.config.filter_subject
        ))),
        Err(error) if matches!(error.kind(), ConsumerInfoErrorKind::NotFound) => {
            Err(refused(format!(
                "no durable `{consumer}` on {REPLAY_STREAM} reads its replays: start the consumer \
             (this version, dead letters and replays on) first; the copies stay"
            )))
        }
        Err(error) => Err(stream_error(error.into())),
    }
}

/// Whether `error` is the replay stream refusing a second message on a replay subject.
fn stored_before(error: &PublishError) -> bool {
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<async_nats::jetstream::Error>())
        .is_some_and(|error| {
            error.error_code() == ErrorCode::STREAM_STORE_FAILED
                && error.to_string().contains("per subject")
        })
}

/// Whether the replay stored on `subject` is the one with id `id`; `None` if there is none
/// (gone meanwhile: read and deleted by the consumer).
async fn stored_is(
    replays: &Stream,
    subject: &str,
    id: &str,
) -> Result<Option<bool>, ConsumerError> {
    match replays.get_last_raw_message_by_subject(subject).await {
        Ok(stored) => Ok(Some(
            stored
                .headers
                .get(NATS_MSG_ID)
                .is_some_and(|stored| stored.as_str() == id),
        )),
        Err(error) if matches!(error.kind(), LastRawMessageErrorKind::NoMessageFound) => Ok(None),
        Err(error) => Err(ConsumerError::Stream {
            stream: REPLAY_STREAM.into(),
            source: error.into(),
        }),
    }
}

/// Who reads the replays: the consumer's name, the replay stream, and the description of the
/// durable reading them (which names the stream of the consumer it serves; `None`: a durable
/// not made by a trellis-outbox consumer, taken to serve any).
struct Reader<'a> {
    consumer: &'a str,
    replays: &'a Stream,
    serves: Option<&'a str>,
}

impl Reader<'_> {
    /// Why the durable must not get the replay of `copy`: it serves the consumer of the same
    /// name on another stream.
    fn refuses(&self, copy: &DeadLetter) -> Option<String> {
        let (serves, stream) = (self.serves?, copy.stream.as_deref()?);
        (serves != replay_description(stream)).then(|| {
            format!(
                "it was dead-lettered by the consumer `{}` of stream `{stream}`, and the durable \
                 reading replays for that name serves another ({serves:?})",
                self.consumer
            )
        })
    }
}

/// The loop of [`replay_dead_letters`] over `copies`.
async fn replay(
    jetstream: &Context,
    to: &Reader<'_>,
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
            let (subject, id) = match copy.replay_target() {
                Ok(target) => target,
                Err(reason) => {
                    report.left.push(leave(reason));
                    continue;
                }
            };
            if let Some(reason) = to.refuses(&copy) {
                report.left.push(leave(reason));
                continue;
            }
            published += 1;
            let consumer = to.consumer;
            let target = replay_subject(consumer, copy.sequence);
            let replay_id = copy.replay_id(consumer);
            let replay_error = |source: BoxError| ConsumerError::Replay {
                sequence: copy.sequence,
                subject: target.clone(),
                replayed: report.replayed,
                source,
            };
            let sent = match jetstream
                .publish_with_headers(
                    target.clone(),
                    copy.replay_headers(&replay_id),
                    copy.payload.clone(),
                )
                .await
            {
                Ok(ack) => ack.await,
                Err(error) if matches!(error.kind(), PublishErrorKind::MaxPayloadExceeded) => {
                    report.left.push(leave(format!(
                        "its replay would be larger than the server's max_payload: {error}"
                    )));
                    continue;
                }
                Err(error) => return Err(replay_error(error.into())),
            };
            // A duplicate (same id within the stream's window) is this message's replay,
            // stored before. A refusal (a message on the subject already) is too only if the
            // stored one has this id: after the dead-letter stream was recreated, a sequence
            // may name another message.
            let again = match sent {
                Ok(ack) => ack.duplicate,
                Err(error) if stored_before(&error) => {
                    match stored_is(to.replays, &target, &replay_id).await? {
                        Some(true) => true,
                        Some(false) => {
                            report.left.push(leave(format!(
                                "its replay subject `{target}` holds another message (the \
                                 dead-letter stream was recreated?); the copy stays"
                            )));
                            continue;
                        }
                        None => {
                            report.left.push(leave(format!(
                                "its replay subject `{target}` refused it while holding a \
                                 message that is gone now; replay again"
                            )));
                            continue;
                        }
                    }
                }
                Err(error) => return Err(replay_error(error.into())),
            };
            copies.delete(copy.sequence).await?;
            report.replayed += 1;
            tracing::info!(
                consumer,
                message_id = %id,
                subject = %subject,
                replay_subject = %target,
                stored_before = again,
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
