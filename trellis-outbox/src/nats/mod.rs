//! NATS JetStream delivery (feature `nats`): [`JetStreamPublisher`], Trellis job dispatch
//! ([`JobDispatcher`], [`JobAdmission`]) and header helpers.

mod jobs;
mod publisher;

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use crate::dispatch::BoxError;
use crate::record::{NATS_MSG_ID, OutboxMessage};

pub use jobs::{JobAdmission, JobDispatcher, JobRef, JobRequest, NoJobDispatcher};
pub use publisher::{
    DEFAULT_ACK_TIMEOUT, DEFAULT_ACK_WINDOW, DEFAULT_JOB_MAX_TRIES, JetStreamPublisher,
    JetStreamPublisherBuilder, StreamCheck, StreamCheckError,
};

impl OutboxMessage {
    /// The stored headers as an [`async_nats::HeaderMap`], ready to publish with.
    ///
    /// Header names and values were validated at enqueue, so every stored header is carried.
    /// [`JetStreamPublisher`] uses [`OutboxMessage::publish_headers`] instead, which also
    /// forces `Nats-Msg-Id` to the row id.
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

    /// The headers an `event.publish` row is published with: every stored header, except
    /// that `Nats-Msg-Id` is always the row id. A stored `Nats-Msg-Id` in any letter case
    /// is dropped first, so a stale or hand-edited header can never change the dedupe id.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn run(message: trellis_outbox::OutboxMessage) {
    /// let headers = message.publish_headers();
    /// assert_eq!(headers.get("Nats-Msg-Id").map(|v| v.as_str()), Some(message.id.as_str()));
    /// # }
    /// ```
    pub fn publish_headers(&self) -> async_nats::HeaderMap {
        let mut map = async_nats::HeaderMap::new();
        for (name, value) in &self.headers {
            if !name.eq_ignore_ascii_case(NATS_MSG_ID) {
                map.insert(name.as_str(), value.as_str());
            }
        }
        map.insert(NATS_MSG_ID, self.id.as_str());
        map
    }
}

/// What went wrong publishing one outbox row to JetStream.
///
/// [`JetStreamPublisher`] wraps every failure in a [`JetStreamError`] inside the
/// [`PublishError`](crate::PublishError) it returns; recover it with
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
    /// A job row met a publisher configured with
    /// [`no_job_dispatch`](JetStreamPublisherBuilder::no_job_dispatch). Retryable.
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
                | JetStreamErrorKind::InvalidSubject
                | JetStreamErrorKind::MalformedJob
        )
    }
}

impl fmt::Display for JetStreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (id, subject) = (&self.row_id, &self.subject);
        match self.kind {
            JetStreamErrorKind::StreamNotFound => write!(
                f,
                "no JetStream stream captures subject `{subject}` (outbox row {id}); create a stream whose subjects include it"
            ),
            JetStreamErrorKind::MaxPayloadExceeded => write!(
                f,
                "outbox row {id} is too large to publish to `{subject}`; no retry can deliver it"
            ),
            JetStreamErrorKind::InvalidSubject => write!(
                f,
                "outbox row {id} has a subject that cannot be published to: `{subject}`"
            ),
            JetStreamErrorKind::TimedOut => write!(
                f,
                "JetStream did not acknowledge outbox row {id} on `{subject}`"
            ),
            JetStreamErrorKind::Disconnected => write!(
                f,
                "the NATS connection was lost before JetStream acknowledged outbox row {id} on `{subject}`"
            ),
            JetStreamErrorKind::MaxAckPending => write!(
                f,
                "too many JetStream acknowledgements pending to publish outbox row {id} to `{subject}`"
            ),
            JetStreamErrorKind::MalformedJob => write!(
                f,
                "outbox row {id} ({}) cannot be turned into a Trellis job `created` event",
                self.record_kind
            ),
            JetStreamErrorKind::NoJobDispatch => write!(
                f,
                "outbox row {id} is a `{}` record but no job dispatcher is configured \
                 (the JetStreamPublisher was built with `no_job_dispatch()`); it stays retryable \
                 until a publisher with job dispatch runs",
                self.record_kind
            ),
            JetStreamErrorKind::Other => write!(
                f,
                "JetStream publish of outbox row {id} to `{subject}` failed"
            ),
        }?;
        match (&self.detail, self.kind) {
            (Some(after), JetStreamErrorKind::TimedOut) => write!(f, " within {after}"),
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
