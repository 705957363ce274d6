//! [`JetStreamError`]: what went wrong publishing one row, and how an async-nats publish
//! error is classified into it (retryable or permanent).

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use async_nats::jetstream::context::{PublishError as NatsPublishError, PublishErrorKind};

use crate::dispatch::{BoxError, PublishError};
use crate::record::OutboxMessage;

/// What went wrong publishing one outbox row to JetStream.
///
/// [`JetStreamPublisher`](super::JetStreamPublisher) wraps every failure in a [`JetStreamError`] inside the
/// [`PublishError`] it returns; recover it with
/// `publish_error.source_error().downcast_ref::<JetStreamError>()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum JetStreamErrorKind {
    /// No stream captures the subject (the server answered "no responders"). Retryable: the
    /// stream may be created later.
    StreamNotFound,
    /// The message is larger than the server's `max_payload` (or the stream's
    /// `max_msg_size`). Permanent.
    MaxPayloadExceeded,
    /// The message's headers are larger than the stream accepts (JetStream error 10097,
    /// over 64 KiB of headers). Permanent.
    HeadersTooLarge,
    /// The subject cannot be published to. Permanent.
    InvalidSubject,
    /// No acknowledgement arrived in time. Retryable.
    TimedOut,
    /// The connection was lost before the acknowledgement arrived. Retryable.
    Disconnected,
    /// Too many acknowledgements pending in the async-nats context (only when its
    /// backpressure is disabled). Retryable.
    MaxAckPending,
    /// A job row cannot be turned into a Trellis job `created` event. Permanent.
    MalformedJob,
    /// The row id cannot be sent as `Nats-Msg-Id`, or a stored header cannot be sent (see
    /// [`OutboxMessage::publish_headers`]). Permanent.
    InvalidHeader,
    /// The subject matches none of the publisher's
    /// [`allow_subject_prefixes`](super::JetStreamPublisherBuilder::allow_subject_prefixes).
    /// Permanent.
    SubjectNotAllowed,
    /// The [`JobDispatcher`](super::JobDispatcher) did not decide within the publisher's
    /// [`job_dispatch_timeout`](super::JetStreamPublisherBuilder::job_dispatch_timeout). Retryable.
    JobDispatchTimedOut,
    /// A job row met a publisher configured with
    /// [`no_job_dispatch`](super::JetStreamPublisherBuilder::no_job_dispatch). Retryable.
    NoJobDispatch,
    /// Any other failure (a server-side JetStream error, a broken response). Retryable.
    Other,
}

/// One outbox row's JetStream failure: what failed, for which row and subject, and the
/// async-nats error as [`source`](StdError::source).
///
/// # Examples
///
/// ```no_run
/// use trellis_outbox::{JetStreamError, JetStreamErrorKind, PublishError};
///
/// # fn run(err: PublishError) {
/// if let Some(js) = err.source_error().downcast_ref::<JetStreamError>() {
///     if js.kind() == JetStreamErrorKind::StreamNotFound {
///         eprintln!("create a stream for {}", js.subject());
///     }
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct JetStreamError {
    kind: JetStreamErrorKind,
    row_id: String,
    record_kind: &'static str,
    subject: String,
    detail: Option<String>,
    source: Option<BoxError>,
}

impl JetStreamError {
    pub(crate) fn new(kind: JetStreamErrorKind, message: &OutboxMessage) -> Self {
        Self {
            kind,
            row_id: message.id.clone(),
            record_kind: message.kind.as_str(),
            subject: message.subject.clone(),
            detail: None,
            source: None,
        }
    }

    pub(crate) fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    pub(crate) fn source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }

    pub(crate) fn timeout(message: &OutboxMessage, after: Duration) -> Self {
        Self::new(JetStreamErrorKind::TimedOut, message).detail(format!("{after:?}"))
    }

    /// What failed.
    pub fn kind(&self) -> JetStreamErrorKind {
        self.kind
    }

    /// The outbox row's id.
    pub fn row_id(&self) -> &str {
        &self.row_id
    }

    /// The subject the row was published to.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Whether a later attempt may succeed.
    pub fn is_retryable(&self) -> bool {
        !matches!(
            self.kind,
            JetStreamErrorKind::MaxPayloadExceeded
                | JetStreamErrorKind::HeadersTooLarge
                | JetStreamErrorKind::InvalidSubject
                | JetStreamErrorKind::MalformedJob
                | JetStreamErrorKind::InvalidHeader
                | JetStreamErrorKind::SubjectNotAllowed
        )
    }
}

impl JetStreamError {
    /// The first part of the message: what failed, for which row — the kind's
    /// [`template`](JetStreamErrorKind::template) filled in.
    fn headline(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.kind.template();
        while let Some(open) = rest.find('{') {
            f.write_str(&rest[..open])?;
            let (name, after) = rest[open + 1..].split_once('}').unwrap_or(("", ""));
            match name {
                "id" => f.write_str(&self.row_id)?,
                "id:?" => write!(f, "{:?}", self.row_id)?,
                "subject" => f.write_str(&self.subject)?,
                "record" => f.write_str(self.record_kind)?,
                other => write!(f, "{{{other}}}")?,
            }
            rest = after;
        }
        f.write_str(rest)
    }
}

impl JetStreamErrorKind {
    /// The message of a failure of this kind: `{id}` (`{id:?}` quoted), `{subject}` and
    /// `{record}` stand for the row's id, subject and record kind.
    fn template(self) -> &'static str {
        match self {
            Self::StreamNotFound => {
                "no JetStream stream captures subject `{subject}` (outbox row {id}); create a stream whose subjects include it"
            }
            Self::MaxPayloadExceeded => {
                "outbox row {id} is too large to publish to `{subject}`; no retry can deliver it"
            }
            Self::HeadersTooLarge => {
                "outbox row {id} has headers too large for the stream capturing `{subject}` (JetStream allows 64 KiB); no retry can deliver it"
            }
            Self::InvalidSubject => {
                "outbox row {id} has a subject that cannot be published to: `{subject}`"
            }
            Self::TimedOut => "JetStream did not acknowledge outbox row {id} on `{subject}`",
            Self::Disconnected => {
                "the NATS connection was lost before JetStream acknowledged outbox row {id} on `{subject}`"
            }
            Self::MaxAckPending => {
                "too many JetStream acknowledgements pending to publish outbox row {id} to `{subject}`"
            }
            Self::MalformedJob => {
                "outbox row {id} ({record}) cannot be turned into a Trellis job `created` event"
            }
            Self::InvalidHeader => {
                "outbox row {id:?} has an id or header that cannot be sent to NATS; no retry can deliver it"
            }
            Self::SubjectNotAllowed => {
                "outbox row {id:?} has subject `{subject}`, which no allowed subject prefix of this publisher matches"
            }
            Self::JobDispatchTimedOut => {
                "the job dispatcher did not decide on outbox row {id} ({record})"
            }
            Self::NoJobDispatch => {
                "outbox row {id} is a `{record}` record but no job dispatcher is configured (the JetStreamPublisher was built with `no_job_dispatch()`); it stays retryable until a publisher with job dispatch runs"
            }
            Self::Other => "JetStream publish of outbox row {id} to `{subject}` failed",
        }
    }
}

impl fmt::Display for JetStreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use JetStreamErrorKind as Kind;
        self.headline(f)?;
        match (&self.detail, self.kind) {
            (Some(after), Kind::TimedOut | Kind::JobDispatchTimedOut) => {
                write!(f, " within {after}")
            }
            (Some(detail), _) => write!(f, ": {detail}"),
            (None, _) => Ok(()),
        }
    }
}

impl StdError for JetStreamError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|source| source as &(dyn StdError + 'static))
    }
}

/// Maps an async-nats publish error to a retryable or permanent [`PublishError`].
pub(super) fn classify(message: &OutboxMessage, err: NatsPublishError) -> PublishError {
    let kind = match err.kind() {
        PublishErrorKind::MaxPayloadExceeded => JetStreamErrorKind::MaxPayloadExceeded,
        PublishErrorKind::StreamNotFound => JetStreamErrorKind::StreamNotFound,
        PublishErrorKind::TimedOut => JetStreamErrorKind::TimedOut,
        PublishErrorKind::BrokenPipe => JetStreamErrorKind::Disconnected,
        PublishErrorKind::MaxAckPending => JetStreamErrorKind::MaxAckPending,
        PublishErrorKind::WrongLastMessageId
        | PublishErrorKind::WrongLastSequence
        | PublishErrorKind::Other => classify_other(&err),
    };
    let error = JetStreamError::new(kind, message).source(err);
    if error.is_retryable() {
        PublishError::retryable(error)
    } else {
        PublishError::permanent(error)
    }
}

/// `Other` covers an invalid subject (client-side check) and server-side JetStream errors.
fn classify_other(err: &NatsPublishError) -> JetStreamErrorKind {
    let Some(source) = StdError::source(err) else {
        return JetStreamErrorKind::Other;
    };
    if source.is::<async_nats::SubjectError>() {
        return JetStreamErrorKind::InvalidSubject;
    }
    match source.downcast_ref::<async_nats::jetstream::Error>() {
        Some(js) => kind_of_code(js.error_code()),
        None => JetStreamErrorKind::Other,
    }
}

/// The kind of a JetStream API error code returned for a publish.
fn kind_of_code(code: async_nats::jetstream::ErrorCode) -> JetStreamErrorKind {
    use async_nats::jetstream::ErrorCode;
    match code {
        ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM => JetStreamErrorKind::MaxPayloadExceeded,
        ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM => JetStreamErrorKind::HeadersTooLarge,
        _ => JetStreamErrorKind::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::PreparedOutboxRecord;

    const KINDS: [JetStreamErrorKind; 13] = {
        use JetStreamErrorKind as K;
        [
            K::StreamNotFound,
            K::MaxPayloadExceeded,
            K::HeadersTooLarge,
            K::InvalidSubject,
            K::TimedOut,
            K::Disconnected,
            K::MaxAckPending,
            K::MalformedJob,
            K::InvalidHeader,
            K::SubjectNotAllowed,
            K::JobDispatchTimedOut,
            K::NoJobDispatch,
            K::Other,
        ]
    };

    #[test]
    fn every_message_fills_in_all_its_placeholders() {
        let record = PreparedOutboxRecord::event("A.Happened", "events.v1.A.Happened", &1).unwrap();
        let message = OutboxMessage::pending(record, chrono::Utc::now());
        for kind in KINDS {
            let text = JetStreamError::new(kind, &message).to_string();
            assert!(!text.contains(['{', '}']), "{kind:?}: {text}");
            assert!(text.contains(&message.id), "{kind:?} names no row: {text}");
        }
        let text = JetStreamError::new(JetStreamErrorKind::InvalidHeader, &message).to_string();
        assert!(
            text.starts_with(&format!("outbox row {:?} has", message.id)),
            "{text}"
        );
        let text = JetStreamError::new(JetStreamErrorKind::NoJobDispatch, &message).to_string();
        assert!(text.contains("is a `event.publish` record"), "{text}");
    }

    #[test]
    fn server_codes_for_oversized_messages_are_permanent() {
        use async_nats::jetstream::ErrorCode;
        assert_eq!(
            kind_of_code(ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM),
            JetStreamErrorKind::MaxPayloadExceeded
        );
        assert_eq!(
            kind_of_code(ErrorCode(10097)),
            JetStreamErrorKind::HeadersTooLarge
        );
        assert_eq!(
            kind_of_code(ErrorCode::STREAM_STORE_FAILED),
            JetStreamErrorKind::Other
        );
        let record = PreparedOutboxRecord::event("A.Happened", "events.v1.A.Happened", &1).unwrap();
        let message = OutboxMessage::pending(record, chrono::Utc::now());
        for kind in [
            JetStreamErrorKind::MaxPayloadExceeded,
            JetStreamErrorKind::HeadersTooLarge,
        ] {
            assert!(
                !JetStreamError::new(kind, &message).is_retryable(),
                "{kind:?}"
            );
        }
        assert!(JetStreamError::new(JetStreamErrorKind::Other, &message).is_retryable());
    }
}
