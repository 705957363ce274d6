//! Trellis job rows (`job.create` / `job.submit`): the `created` lifecycle event (spec §D.3)
//! and pluggable admission through a [`JobDispatcher`].

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;

use super::{JetStreamError, JetStreamErrorKind};
use crate::dispatch::PublishError;
use crate::event::{TRACEPARENT, TRACESTATE, TraceContext};
use crate::job::{JobMode, REQUEST_ID};
use crate::record::{NATS_MSG_ID, OutboxMessage, OutboxRecordKind};
use crate::time::format_timestamp;

/// Admits a job row through a service's own jobs manager instead of publishing the
/// `created` event directly. Plug one in with
/// [`JetStreamPublisherBuilder::job_dispatcher`](super::JetStreamPublisherBuilder::job_dispatcher).
///
/// The outcome is stored in the row's `outcome` column (as the JSON of [`JobAdmission`]) and
/// the row is marked dispatched; an admission that *rejects* the job is still an outcome, not
/// a failure. Return a [`PublishError`] when admission could not be decided
/// ([`PublishError::retryable`] for a jobs manager that is unreachable,
/// [`PublishError::permanent`] for a request that can never be admitted).
///
/// Calls are made one row at a time, in row order, so a keyed queue sees submissions in the
/// order they were enqueued. [`JobRequest::from_message`] decodes the row.
///
/// Admission includes its lifecycle events: as Trellis' job manager does, the jobs manager
/// behind this trait publishes the `created` event of an admitted job and, for a keyed
/// `replace-oldest` queue, the `skipped` event of the job it replaced (`Nats-Msg-Id`
/// `trellis-job-skipped:<submissionId>:<replacedJobId>`, spec §D.3). The publisher only
/// records the returned [`JobAdmission`] in the row's `outcome`.
///
/// # Examples
///
/// ```no_run
/// use trellis_outbox::{JobAdmission, JobDispatcher, JobRef, JobRequest, OutboxMessage, PublishError};
///
/// struct Admit;
///
/// impl JobDispatcher for Admit {
///     async fn dispatch_job(&self, message: &OutboxMessage) -> Result<JobAdmission, PublishError> {
///         let job = JobRequest::from_message(message)?;
///         // … hand `job` to the jobs manager …
///         Ok(JobAdmission::Accepted {
///             job: JobRef::new(job.service, job.job_type, job.job_id),
///         })
///     }
/// }
/// ```
pub trait JobDispatcher: Send + Sync + 'static {
    /// Admits the job of one `job.create`/`job.submit` row.
    fn dispatch_job(
        &self,
        message: &OutboxMessage,
    ) -> impl Future<Output = Result<JobAdmission, PublishError>> + Send;
}

impl<D: JobDispatcher> JobDispatcher for Arc<D> {
    fn dispatch_job(
        &self,
        message: &OutboxMessage,
    ) -> impl Future<Output = Result<JobAdmission, PublishError>> + Send {
        (**self).dispatch_job(message)
    }
}

/// The default job-dispatcher type parameter of [`JetStreamPublisher`](super::JetStreamPublisher):
/// no custom dispatcher (job rows are published as the `created` event, or refused with
/// [`no_job_dispatch`](super::JetStreamPublisherBuilder::no_job_dispatch)). It has no values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoJobDispatcher {}

impl JobDispatcher for NoJobDispatcher {
    async fn dispatch_job(&self, _message: &OutboxMessage) -> Result<JobAdmission, PublishError> {
        match *self {}
    }
}

/// A job's address: `{ service, jobType, id }` on the wire.
///
/// ```
/// let job = trellis_outbox::JobRef::new("billing", "sync-customer", "01J…");
/// assert_eq!(
///     serde_json::to_string(&job)?,
///     r#"{"service":"billing","jobType":"sync-customer","id":"01J…"}"#,
/// );
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobRef {
    /// The service token.
    pub service: String,
    /// The job-type token.
    pub job_type: String,
    /// The job id.
    pub id: String,
}

impl JobRef {
    /// A job reference.
    pub fn new(
        service: impl Into<String>,
        job_type: impl Into<String>,
        id: impl Into<String>,
    ) -> Self {
        Self {
            service: service.into(),
            job_type: job_type.into(),
            id: id.into(),
        }
    }
}

/// The outcome of admitting a job (Trellis' `submit` outcome union, spec §D.1), stored as
/// JSON in the row's `outcome` column with a `kind` tag.
///
/// ```
/// use trellis_outbox::{JobAdmission, JobRef};
///
/// let outcome = JobAdmission::Coalesced {
///     key: "customer:c-1".into(),
///     existing: JobRef::new("billing", "sync-customer", "01JA"),
///     reason: "already queued".into(),
/// };
/// assert_eq!(
///     serde_json::to_value(&outcome)?,
///     serde_json::json!({
///         "kind": "coalesced",
///         "key": "customer:c-1",
///         "existing": { "service": "billing", "jobType": "sync-customer", "id": "01JA" },
///         "reason": "already queued",
///     }),
/// );
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
#[non_exhaustive]
pub enum JobAdmission {
    /// `{kind:"accepted", ref}`: the job was created.
    Accepted {
        /// The new job (`ref` on the wire).
        #[serde(rename = "ref")]
        job: JobRef,
    },
    /// `{kind:"rejected", key, reason, active, queued, limit}`: the queue's policy refused it.
    Rejected {
        /// The concurrency key.
        key: String,
        /// Why (`active-limit`, `queue-depth`, `stale-blocked`, …).
        reason: String,
        /// Active jobs under the key.
        active: u64,
        /// Queued jobs under the key.
        queued: u64,
        /// The limit that was hit.
        limit: u64,
    },
    /// `{kind:"coalesced", key, existing, reason}`: merged into an existing job.
    Coalesced {
        /// The concurrency key.
        key: String,
        /// The job it was merged into.
        existing: JobRef,
        /// Why.
        reason: String,
    },
    /// `{kind:"replaced", key, replaced, ref}`: created, replacing a queued job.
    Replaced {
        /// The concurrency key.
        key: String,
        /// The job that was replaced (skipped).
        replaced: JobRef,
        /// The new job (`ref` on the wire).
        #[serde(rename = "ref")]
        job: JobRef,
    },
}

/// A `job.create`/`job.submit` row decoded (spec §D.2): what a [`JobDispatcher`] needs to
/// admit the job.
///
/// ```no_run
/// # fn run(message: trellis_outbox::OutboxMessage) -> Result<(), trellis_outbox::PublishError> {
/// let job = trellis_outbox::JobRequest::from_message(&message)?;
/// println!("{}.{} {} for submission {}", job.service, job.job_type, job.job_id, job.submission_id);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct JobRequest {
    /// The row id, the admission's idempotency key.
    pub submission_id: String,
    /// The id the job will have.
    pub job_id: String,
    /// The queue key (the row's `name`).
    pub queue: String,
    /// `create` or `submit`.
    pub mode: JobMode,
    /// The service token of the subject.
    pub service: String,
    /// The job-type token of the subject.
    pub job_type: String,
    /// The job's own fields: the stored payload without `jobId` and `submissionId`.
    pub payload: serde_json::Value,
    /// The `request-id` header.
    pub request_id: String,
    /// The `traceparent` and `tracestate` headers.
    pub trace: TraceContext,
    /// When the row was enqueued.
    pub created_at: DateTime<Utc>,
}

impl JobRequest {
    /// Decodes a job row: subject `trellis.jobs.<service>.<job_type>.<jobId>.created`,
    /// payload a JSON object with string `jobId` (matching the subject) and `submissionId`
    /// (matching the row id), headers `request-id` and a valid `traceparent`.
    ///
    /// # Errors
    ///
    /// A permanent [`PublishError`] wrapping a [`JetStreamError`] of kind
    /// [`MalformedJob`](JetStreamErrorKind::MalformedJob) saying what is wrong.
    pub fn from_message(message: &OutboxMessage) -> Result<Self, PublishError> {
        let parts = JobParts::parse(message).map_err(|problem| malformed(message, problem))?;
        let payload = serde_json::to_value(UserPayload(&parts.fields))
            .map_err(|e| malformed(message, format!("the payload cannot be re-encoded: {e}")))?;
        Ok(Self {
            submission_id: parts.submission_id,
            job_id: parts.job_id,
            queue: message.name.clone(),
            mode: parts.mode,
            service: parts.service.to_owned(),
            job_type: parts.job_type.to_owned(),
            payload,
            request_id: parts.request_id.to_owned(),
            trace: TraceContext::new(
                parts.traceparent.to_owned(),
                parts.tracestate.map(str::to_owned),
            ),
            created_at: message.created_at,
        })
    }
}

/// Per-queue settings of the `created` event (not stored in the row).
#[derive(Debug, Clone)]
pub(crate) struct CreatedEventSettings {
    pub(crate) default_max_tries: u64,
    pub(crate) max_tries: HashMap<String, u64>,
    pub(crate) deadlines: HashMap<String, Duration>,
}

impl CreatedEventSettings {
    pub(crate) fn new(default_max_tries: u64) -> Self {
        Self {
            default_max_tries,
            max_tries: HashMap::new(),
            deadlines: HashMap::new(),
        }
    }
}

/// The `created` lifecycle event of a job row: JSON body and headers (spec §D.3).
pub(crate) fn created_event(
    message: &OutboxMessage,
    settings: &CreatedEventSettings,
) -> Result<(Vec<u8>, async_nats::HeaderMap), PublishError> {
    let parts = JobParts::parse(message).map_err(|problem| malformed(message, problem))?;
    let max_tries = settings
        .max_tries
        .get(&message.name)
        .copied()
        .unwrap_or(settings.default_max_tries);
    let deadline = match settings.deadlines.get(&message.name) {
        Some(after) => {
            let after = chrono::Duration::from_std(*after)
                .ok()
                .and_then(|after| message.created_at.checked_add_signed(after))
                .ok_or_else(|| {
                    malformed(
                        message,
                        format!("a deadline {after:?} after created_at overflows"),
                    )
                })?;
            Some(format_timestamp(after))
        }
        None => None,
    };
    let body = CreatedEvent {
        job_id: &parts.job_id,
        service: parts.service,
        job_type: parts.job_type,
        event_type: "created",
        state: "pending",
        context: WireContext {
            request_id: parts.request_id,
            trace_id: parts.trace_id,
            traceparent: parts.traceparent,
            tracestate: parts.tracestate,
        },
        tries: 0,
        max_tries,
        payload: UserPayload(&parts.fields),
        deadline,
        timestamp: format_timestamp(message.created_at),
    };
    let bytes = serde_json::to_vec(&body)
        .map_err(|e| malformed(message, format!("the event cannot be encoded: {e}")))?;
    let mut headers = async_nats::HeaderMap::new();
    let msg_id = format!("trellis-job-created:{}", parts.submission_id);
    let values = [
        (REQUEST_ID, Some(parts.request_id)),
        (TRACEPARENT, Some(parts.traceparent)),
        (TRACESTATE, parts.tracestate),
        (NATS_MSG_ID, Some(msg_id.as_str())),
    ];
    for (name, value) in values {
        if let Some(value) = value {
            let value = header_value(value).map_err(|problem| {
                malformed(message, format!("the `{name}` header value {problem}"))
            })?;
            headers.insert(name, value);
        }
    }
    Ok((bytes, headers))
}

/// A header value, refused (never a panic) when NATS cannot carry it.
fn header_value(value: &str) -> Result<async_nats::HeaderValue, String> {
    if value.contains(char::is_control) {
        return Err(format!("{value:?} contains a control character"));
    }
    value
        .parse()
        .map_err(|e: async_nats::header::ParseHeaderValueError| e.to_string())
}

fn malformed(message: &OutboxMessage, problem: impl Into<String>) -> PublishError {
    PublishError::permanent(
        JetStreamError::new(JetStreamErrorKind::MalformedJob, message).detail(problem),
    )
}

/// The fields of a job row, borrowed where possible.
struct JobParts<'a> {
    mode: JobMode,
    service: &'a str,
    job_type: &'a str,
    job_id: String,
    submission_id: String,
    /// Every top-level payload field, in stored order, values verbatim.
    fields: Vec<(String, Box<RawValue>)>,
    request_id: &'a str,
    traceparent: &'a str,
    trace_id: &'a str,
    tracestate: Option<&'a str>,
}

impl<'a> JobParts<'a> {
    fn parse(message: &'a OutboxMessage) -> Result<Self, String> {
        let mode = match message.kind {
            OutboxRecordKind::JobCreate => JobMode::Create,
            OutboxRecordKind::JobSubmit => JobMode::Submit,
            OutboxRecordKind::EventPublish => {
                return Err("it is an `event.publish` row, not a job".into());
            }
        };
        let tokens: Vec<&str> = message.subject.split('.').collect();
        let [
            "trellis",
            "jobs",
            service,
            job_type,
            subject_job_id,
            "created",
        ] = tokens.as_slice()
        else {
            return Err(format!(
                "subject `{}` is not `trellis.jobs.<service>.<job_type>.<jobId>.created`",
                message.subject
            ));
        };
        if service.is_empty() || job_type.is_empty() {
            return Err(format!(
                "subject `{}` has an empty service or job type",
                message.subject
            ));
        }

        let OrderedObject(fields) = serde_json::from_str(&message.payload)
            .map_err(|e| format!("the payload is not a JSON object: {e}"))?;
        let string_field = |key: &str| -> Result<String, String> {
            let raw = fields
                .iter()
                .rev()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v)
                .ok_or_else(|| format!("the payload has no `{key}`"))?;
            serde_json::from_str::<String>(raw.get())
                .map_err(|_| format!("the payload's `{key}` is not a string: {}", raw.get()))
        };
        let job_id = string_field("jobId")?;
        let submission_id = string_field("submissionId")?;
        if job_id != *subject_job_id {
            return Err(format!(
                "the payload's jobId {job_id:?} differs from the subject's `{subject_job_id}`"
            ));
        }
        if submission_id != message.id {
            return Err(format!(
                "the payload's submissionId {submission_id:?} differs from the row id"
            ));
        }

        let header = |name: &str| message.headers.get(name).map(String::as_str);
        let request_id = header(REQUEST_ID)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| format!("the `{REQUEST_ID}` header is missing"))?;
        let traceparent =
            header(TRACEPARENT).ok_or_else(|| format!("the `{TRACEPARENT}` header is missing"))?;
        if !TraceContext::new(traceparent, None).is_valid() {
            return Err(format!(
                "the `{TRACEPARENT}` header {traceparent:?} is not a valid W3C traceparent"
            ));
        }
        let trace_id = traceparent.get(3..35).unwrap_or_default();
        Ok(Self {
            mode,
            service,
            job_type,
            job_id,
            submission_id,
            fields,
            request_id,
            traceparent,
            trace_id,
            tracestate: header(TRACESTATE),
        })
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct CreatedEvent<'a> {
    job_id: &'a str,
    service: &'a str,
    job_type: &'a str,
    event_type: &'static str,
    state: &'static str,
    context: WireContext<'a>,
    tries: u64,
    max_tries: u64,
    payload: UserPayload<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    deadline: Option<String>,
    timestamp: String,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct WireContext<'a> {
    request_id: &'a str,
    trace_id: &'a str,
    traceparent: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    tracestate: Option<&'a str>,
}

/// The stored payload without `jobId`/`submissionId`, keys in stored order, values verbatim.
struct UserPayload<'a>(&'a [(String, Box<RawValue>)]);

impl Serialize for UserPayload<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let fields = self
            .0
            .iter()
            .filter(|(key, _)| key != "jobId" && key != "submissionId");
        let mut map = serializer.serialize_map(None)?;
        for (key, value) in fields {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

/// A JSON object read without reordering its keys or re-encoding its values.
struct OrderedObject(Vec<(String, Box<RawValue>)>);

impl<'de> Deserialize<'de> for OrderedObject {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ObjectVisitor;

        impl<'de> Visitor<'de> for ObjectVisitor {
            type Value = OrderedObject;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<OrderedObject, A::Error> {
                let mut fields = Vec::with_capacity(map.size_hint().unwrap_or(4));
                while let Some(key) = map.next_key::<String>()? {
                    let value = map.next_value::<Box<RawValue>>()?;
                    fields.push((key, value));
                }
                Ok(OrderedObject(fields))
            }
        }

        deserializer.deserialize_map(ObjectVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::PreparedOutboxRecord;
    use std::collections::BTreeMap;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn job_row(payload: &str, subject: &str) -> OutboxMessage {
        let record = PreparedOutboxRecord {
            id: "01SUB".into(),
            kind: OutboxRecordKind::JobSubmit,
            name: "syncCustomer".into(),
            subject: subject.into(),
            payload: payload.into(),
            headers: BTreeMap::from([
                (REQUEST_ID.to_owned(), "01REQ".to_owned()),
                (TRACEPARENT.to_owned(), TP.to_owned()),
            ]),
        };
        let created = DateTime::from_timestamp_millis(1_779_667_200_123).unwrap();
        OutboxMessage::pending(record, created)
    }

    #[test]
    fn created_event_matches_the_wire_shape() {
        let row = job_row(
            r#"{"zeta":1,"alpha":{"b":2,"a":1},"jobId":"01JOB","submissionId":"01SUB"}"#,
            "trellis.jobs.billing.sync-customer.01JOB.created",
        );
        let mut settings = CreatedEventSettings::new(7);
        settings
            .deadlines
            .insert("syncCustomer".into(), Duration::from_secs(60));
        let (body, headers) = created_event(&row, &settings).unwrap();
        let body = String::from_utf8(body).unwrap();
        assert_eq!(
            body,
            concat!(
                r#"{"jobId":"01JOB","service":"billing","jobType":"sync-customer","eventType":"created","#,
                r#""state":"pending","context":{"requestId":"01REQ","traceId":"4bf92f3577b34da6a3ce929d0e0e4736","#,
                r#""traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},"tries":0,"maxTries":7,"#,
                r#""payload":{"zeta":1,"alpha":{"b":2,"a":1}},"deadline":"2026-05-25T00:01:00.123Z","#,
                r#""timestamp":"2026-05-25T00:00:00.123Z"}"#
            )
        );
        assert_eq!(
            headers.get(NATS_MSG_ID).unwrap().as_str(),
            "trellis-job-created:01SUB"
        );
        assert_eq!(headers.get(REQUEST_ID).unwrap().as_str(), "01REQ");
        assert!(headers.get(TRACESTATE).is_none());
    }

    #[test]
    fn malformed_rows_are_permanent_with_reasons() {
        let cases = [
            (
                r#"{"jobId":"01JOB","submissionId":"01SUB"}"#,
                "trellis.jobs.billing.01JOB.created",
                "is not `trellis.jobs.<service>.<job_type>.<jobId>.created`",
            ),
            (
                r#"[1]"#,
                "trellis.jobs.billing.sync.01JOB.created",
                "the payload is not a JSON object",
            ),
            (
                r#"{"submissionId":"01SUB"}"#,
                "trellis.jobs.billing.sync.01JOB.created",
                "the payload has no `jobId`",
            ),
            (
                r#"{"jobId":"OTHER","submissionId":"01SUB"}"#,
                "trellis.jobs.billing.sync.01JOB.created",
                "differs from the subject's `01JOB`",
            ),
            (
                r#"{"jobId":"01JOB","submissionId":"X"}"#,
                "trellis.jobs.billing.sync.01JOB.created",
                "differs from the row id",
            ),
        ];
        let settings = CreatedEventSettings::new(5);
        for (payload, subject, expected) in cases {
            let err = created_event(&job_row(payload, subject), &settings).unwrap_err();
            assert!(!err.is_retryable());
            assert!(err.chain().contains(expected), "{}", err.chain());
            assert!(
                err.chain()
                    .contains("cannot be turned into a Trellis job `created` event"),
                "{}",
                err.chain()
            );
        }
        let mut row = job_row(
            r#"{"jobId":"01JOB","submissionId":"01SUB"}"#,
            "trellis.jobs.billing.sync.01JOB.created",
        );
        row.headers.insert(TRACEPARENT.into(), "garbage".into());
        let err = created_event(&row, &settings).unwrap_err();
        assert!(err.chain().contains("not a valid W3C traceparent"));
    }

    /// These rows made `HeaderMap::insert` panic before.
    #[test]
    fn unsendable_job_headers_are_permanent_errors_not_panics() {
        let settings = CreatedEventSettings::new(5);
        let ok = || {
            job_row(
                r#"{"jobId":"01JOB","submissionId":"01SUB"}"#,
                "trellis.jobs.billing.sync.01JOB.created",
            )
        };
        for (name, value) in [
            (REQUEST_ID, "01REQ\r\nNats-Rollup: all"),
            (TRACESTATE, "a=b\nc"),
            (REQUEST_ID, "01\0REQ"),
        ] {
            let mut row = ok();
            row.headers.insert(name.into(), value.into());
            let err = created_event(&row, &settings).unwrap_err();
            assert!(!err.is_retryable());
            assert!(
                err.chain().contains(&format!("the `{name}` header value")),
                "{}",
                err.chain()
            );
        }
        let mut row = job_row(
            r#"{"jobId":"01JOB","submissionId":"01\r\nSUB"}"#,
            "trellis.jobs.billing.sync.01JOB.created",
        );
        row.id = "01\r\nSUB".into();
        let err = created_event(&row, &settings).unwrap_err();
        assert!(err.chain().contains("Nats-Msg-Id"), "{}", err.chain());
    }

    #[test]
    fn job_request_decodes_the_row() {
        let row = job_row(
            r#"{"customerId":"c-1","jobId":"01JOB","submissionId":"01SUB"}"#,
            "trellis.jobs.billing.sync-customer.01JOB.created",
        );
        let job = JobRequest::from_message(&row).unwrap();
        assert_eq!(job.mode, JobMode::Submit);
        assert_eq!(job.service, "billing");
        assert_eq!(job.job_type, "sync-customer");
        assert_eq!(job.queue, "syncCustomer");
        assert_eq!(job.payload, serde_json::json!({ "customerId": "c-1" }));
        assert_eq!(
            job.trace.trace_id(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
    }

    #[test]
    fn admission_wire_shapes() {
        let job = JobRef::new("s", "t", "1");
        assert_eq!(
            serde_json::to_value(JobAdmission::Accepted { job: job.clone() }).unwrap(),
            serde_json::json!({ "kind": "accepted", "ref": { "service": "s", "jobType": "t", "id": "1" } })
        );
        let rejected = JobAdmission::Rejected {
            key: "k".into(),
            reason: "active-limit".into(),
            active: 1,
            queued: 2,
            limit: 1,
        };
        let text = serde_json::to_string(&rejected).unwrap();
        assert_eq!(
            text,
            r#"{"kind":"rejected","key":"k","reason":"active-limit","active":1,"queued":2,"limit":1}"#
        );
        assert_eq!(
            serde_json::from_str::<JobAdmission>(&text).unwrap(),
            rejected
        );
        let replaced = JobAdmission::Replaced {
            key: "k".into(),
            replaced: JobRef::new("s", "t", "0"),
            job,
        };
        assert_eq!(
            serde_json::to_value(replaced).unwrap()["ref"]["id"],
            serde_json::json!("1")
        );
    }
}
