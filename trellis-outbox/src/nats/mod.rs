//! NATS JetStream delivery (feature `nats`): [`JetStreamPublisher`], Trellis job dispatch
//! ([`JobDispatcher`], [`JobAdmission`]) and header helpers.

mod jobs;
mod publisher;

use std::error::Error as StdError;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use async_nats::{HeaderName, HeaderValue};

use crate::dispatch::BoxError;
use crate::record::{NATS_MSG_ID, OutboxMessage};

pub use jobs::{JobAdmission, JobDispatcher, JobRef, JobRequest, NoJobDispatcher};
pub use publisher::{
    DEFAULT_ACK_TIMEOUT, DEFAULT_ACK_WINDOW, DEFAULT_JOB_DISPATCH_TIMEOUT, DEFAULT_JOB_MAX_TRIES,
    JetStreamPublisher, JetStreamPublisherBuilder, StreamCheck, StreamCheckError,
};

impl OutboxMessage {
    /// The stored headers as an [`async_nats::HeaderMap`], ready to publish with.
    ///
    /// Every stored header is carried except NATS control headers (`Nats-*` other than
    /// `Nats-Msg-Id`, e.g. `Nats-Rollup`), which are dropped with a `tracing` warning naming
    /// the row and the header. [`JetStreamPublisher`] uses [`OutboxMessage::publish_headers`]
    /// instead, which also forces `Nats-Msg-Id` to the row id.
    ///
    /// # Errors
    ///
    /// A [`JetStreamError`] of kind [`InvalidHeader`](JetStreamErrorKind::InvalidHeader) when
    /// a stored header cannot be sent (a name that is empty or not printable ASCII without
    /// `:`, a value with CR or LF). Enqueue refuses such headers; a row written by another
    /// writer may still hold one. Never panics.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn run(js: async_nats::jetstream::Context, message: trellis_outbox::OutboxMessage) -> Result<(), Box<dyn std::error::Error>> {
    /// js.publish_with_headers(message.subject.clone(), message.nats_headers()?, message.payload.clone().into())
    ///     .await?
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn nats_headers(&self) -> Result<async_nats::HeaderMap, JetStreamError> {
        let mut map = async_nats::HeaderMap::new();
        for (name, value) in &self.headers {
            self.carry(&mut map, name, value)?;
        }
        Ok(map)
    }

    /// The headers an `event.publish` row is published with: every stored header, except
    /// that `Nats-Msg-Id` is always the row id and NATS control headers are dropped. A stored
    /// `Nats-Msg-Id` in any letter case is dropped first, so a stale or hand-edited header
    /// can never change the dedupe id; any other `Nats-*` header (`Nats-Rollup`,
    /// `Nats-Expected-*`, `Nats-TTL`, …, which could purge or alter the stream) is dropped
    /// with a `tracing` warning naming the row id and the header (never the payload).
    ///
    /// # Errors
    ///
    /// A [`JetStreamError`] of kind [`InvalidHeader`](JetStreamErrorKind::InvalidHeader) when
    /// the row id cannot be a `Nats-Msg-Id` (empty, a control character such as CR or LF, or
    /// leading/trailing whitespace) or a stored header cannot be sent (see
    /// [`OutboxMessage::nats_headers`]). Never panics.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn run(message: trellis_outbox::OutboxMessage) -> Result<(), trellis_outbox::JetStreamError> {
    /// let headers = message.publish_headers()?;
    /// assert_eq!(headers.get("Nats-Msg-Id").map(|v| v.as_str()), Some(message.id.as_str()));
    /// # Ok(()) }
    /// ```
    pub fn publish_headers(&self) -> Result<async_nats::HeaderMap, JetStreamError> {
        let mut map = async_nats::HeaderMap::new();
        for (name, value) in &self.headers {
            if !name.eq_ignore_ascii_case(NATS_MSG_ID) {
                self.carry(&mut map, name, value)?;
            }
        }
        if let Some(problem) = crate::wire::id_problem(&self.id) {
            return Err(invalid_header(self, format!("the row id {problem}")));
        }
        let id = HeaderValue::from_str(&self.id).map_err(|e| {
            invalid_header(self, format!("the row id cannot be `{NATS_MSG_ID}`")).source(e)
        })?;
        map.insert(NATS_MSG_ID, id);
        Ok(map)
    }

    /// Adds one stored header to `map` without panicking; drops a control header (logged).
    fn carry(
        &self,
        map: &mut async_nats::HeaderMap,
        name: &str,
        value: &str,
    ) -> Result<(), JetStreamError> {
        if crate::wire::is_control_header(name) {
            tracing::warn!(
                id = ?self.id,
                header = ?name,
                "dropping a NATS control header from an outbox row: only Nats-Msg-Id of the \
                 Nats-* headers is published (others can purge or alter the stream)"
            );
            return Ok(());
        }
        if let Some(problem) = crate::wire::header_name_problem(name)
            .or_else(|| crate::wire::header_value_problem(name, value))
        {
            return Err(invalid_header(self, problem));
        }
        let header_name = HeaderName::from_str(name)
            .map_err(|e| invalid_header(self, format!("name {name:?} is invalid")).source(e))?;
        let header_value = HeaderValue::from_str(value)
            .map_err(|e| invalid_header(self, format!("value of {name:?} is invalid")).source(e))?;
        map.insert(header_name, header_value);
        Ok(())
    }
}

fn invalid_header(message: &OutboxMessage, problem: impl Into<String>) -> JetStreamError {
    JetStreamError::new(JetStreamErrorKind::InvalidHeader, message).detail(problem)
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
    /// The row id cannot be sent as `Nats-Msg-Id`, or a stored header cannot be sent (see
    /// [`OutboxMessage::publish_headers`]). Permanent.
    InvalidHeader,
    /// The subject matches none of the publisher's
    /// [`allow_subject_prefixes`](JetStreamPublisherBuilder::allow_subject_prefixes).
    /// Permanent.
    SubjectNotAllowed,
    /// The [`JobDispatcher`] did not decide within the publisher's
    /// [`job_dispatch_timeout`](JetStreamPublisherBuilder::job_dispatch_timeout). Retryable.
    JobDispatchTimedOut,
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
                | JetStreamErrorKind::InvalidHeader
                | JetStreamErrorKind::SubjectNotAllowed
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
            JetStreamErrorKind::InvalidHeader => write!(
                f,
                "outbox row {id:?} has an id or header that cannot be sent to NATS; no retry can deliver it"
            ),
            JetStreamErrorKind::SubjectNotAllowed => write!(
                f,
                "outbox row {id:?} has subject `{subject}`, which no allowed subject prefix of this publisher matches"
            ),
            JetStreamErrorKind::JobDispatchTimedOut => write!(
                f,
                "the job dispatcher did not decide on outbox row {id} ({})",
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
            (
                Some(after),
                JetStreamErrorKind::TimedOut | JetStreamErrorKind::JobDispatchTimedOut,
            ) => {
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::record::PreparedOutboxRecord;

    fn row(id: &str, headers: &[(&str, &str)]) -> OutboxMessage {
        let record = PreparedOutboxRecord {
            id: id.into(),
            kind: crate::OutboxRecordKind::EventPublish,
            name: "A.B".into(),
            subject: "events.v1.A.B".into(),
            payload: "{}".into(),
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>(),
        };
        OutboxMessage::pending(record, chrono::Utc::now())
    }

    #[test]
    fn control_headers_are_stripped_and_the_id_overlaid() {
        let message = row(
            "01ROW",
            &[
                ("Nats-Rollup", "all"),
                ("nats-expected-last-sequence", "7"),
                ("Nats-TTL", "1s"),
                ("NATS-MSG-ID", "stale"),
                ("traceparent", "00-a-b-01"),
            ],
        );
        let headers = message.publish_headers().unwrap();
        assert_eq!(headers.len(), 2, "{headers:?}");
        assert_eq!(headers.get(NATS_MSG_ID).unwrap().as_str(), "01ROW");
        assert_eq!(headers.get("traceparent").unwrap().as_str(), "00-a-b-01");
        assert!(headers.get("Nats-Rollup").is_none());
        assert!(headers.get("Nats-TTL").is_none());

        let carried = message.nats_headers().unwrap();
        assert!(carried.get("Nats-Rollup").is_none());
        assert!(carried.get("nats-expected-last-sequence").is_none());
        assert_eq!(carried.get("NATS-MSG-ID").unwrap().as_str(), "stale");
    }

    /// These rows made `HeaderMap::insert` panic before: the whole batch failed.
    #[test]
    fn unsendable_ids_and_headers_are_permanent_errors_not_panics() {
        let cases = [
            row("01ROW", &[("X", "a\r\nNats-Rollup: all")]),
            row("01ROW", &[("X", "a\nb")]),
            row("01ROW", &[("a b", "v")]),
            row("01ROW", &[("é", "v")]),
            row("01ROW", &[("", "v")]),
            row("01\r\nROW", &[]),
            row("", &[]),
        ];
        for message in cases {
            let err = message.publish_headers().unwrap_err();
            assert_eq!(err.kind(), JetStreamErrorKind::InvalidHeader, "{err}");
            assert!(!err.is_retryable());
            assert!(
                err.to_string()
                    .contains("has an id or header that cannot be sent to NATS"),
                "{err}"
            );
        }
        let err = row("01ROW", &[("X", "a\r\nb")]).nats_headers().unwrap_err();
        assert!(err.to_string().contains("line break"), "{err}");
        let err = row("01\nROW", &[]).publish_headers().unwrap_err();
        assert!(
            err.to_string()
                .contains("the row id contains the control character"),
            "{err}"
        );
    }
}
