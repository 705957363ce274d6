//! Decoding a stored job row (`job.create` / `job.submit`, spec §D.2) into its parts,
//! borrowed where possible and with the payload's keys and values kept verbatim. Both the
//! `created` event and [`JobRequest`](super::JobRequest) are built from these parts.

use std::borrow::Cow;
use std::fmt;

use chrono::{DateTime, Utc};

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;

use super::{JetStreamError, JetStreamErrorKind};
use crate::dispatch::PublishError;
use crate::event::{TRACEPARENT, TRACESTATE, TraceContext};
use crate::job::{JobMode, REQUEST_ID};
use crate::record::{OutboxMessage, OutboxRecordKind};

/// A permanent failure: the row cannot be turned into a job (`problem` says why).
pub(super) fn malformed(message: &OutboxMessage, problem: impl Into<String>) -> PublishError {
    PublishError::permanent(
        JetStreamError::new(JetStreamErrorKind::MalformedJob, message).detail(problem),
    )
}

/// The fields of a job row, borrowed where possible.
pub(super) struct JobParts<'a> {
    pub(super) mode: JobMode,
    /// The subject's service token.
    pub(super) service: &'a str,
    /// The subject's job-type token.
    pub(super) job_type: &'a str,
    /// The `service` of the `created` event: the 0.100 submission's `service`, else the
    /// subject's service token.
    pub(super) event_service: Cow<'a, str>,
    /// The `jobType` of the `created` event: the queue key (the row's `name`, or the 0.100
    /// submission's `queue`), which upstream's worker looks its queue binding up by; the
    /// subject's job-type token only when the row has no name.
    pub(super) event_job_type: Cow<'a, str>,
    pub(super) job_id: String,
    pub(super) submission_id: String,
    /// The job's own payload.
    pub(super) payload: UserPayload,
    pub(super) request_id: Cow<'a, str>,
    pub(super) traceparent: Cow<'a, str>,
    pub(super) trace_id: String,
    pub(super) tracestate: Option<Cow<'a, str>>,
    /// When the submission was made: the payload's `createdAt` in the upstream 0.100 shape,
    /// else the row's `created_at`.
    pub(super) created_at: DateTime<Utc>,
    /// Upstream 0.100's optional `trigger` and `lineage`, verbatim.
    pub(super) trigger: Option<Box<RawValue>>,
    pub(super) lineage: Option<Box<RawValue>>,
}

/// The `context` of an upstream 0.100 `PreparedJobSubmission`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct StoredContext {
    request_id: String,
    traceparent: String,
    #[serde(default)]
    tracestate: Option<String>,
}

impl<'a> JobParts<'a> {
    pub(super) fn parse(message: &'a OutboxMessage) -> Result<Self, String> {
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

        let OrderedObject(mut fields) = serde_json::from_str(&message.payload)
            .map_err(|e| format!("the payload is not a JSON object: {e}"))?;
        let job_id = string_field(&fields, "jobId")?;
        let submission_id = string_field(&fields, "submissionId")?;
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
        let event_job_type = if message.name.is_empty() {
            *job_type
        } else {
            message.name.as_str()
        };
        let mut parts = Self {
            mode,
            service,
            job_type,
            event_service: Cow::Borrowed(service),
            event_job_type: Cow::Borrowed(event_job_type),
            job_id,
            submission_id,
            payload: UserPayload::Fields(Vec::new()),
            request_id: Cow::Borrowed(header(REQUEST_ID).unwrap_or_default()),
            traceparent: Cow::Borrowed(header(TRACEPARENT).unwrap_or_default()),
            trace_id: String::new(),
            tracestate: header(TRACESTATE).map(Cow::Borrowed),
            created_at: message.created_at,
            trigger: None,
            lineage: None,
        };
        if is_prepared_submission(&fields) {
            parts.adopt_prepared_submission(&mut fields)?;
        } else {
            fields.retain(|(key, _)| key != "jobId" && key != "submissionId");
            parts.payload = UserPayload::Fields(fields);
        }

        if parts.request_id.is_empty() {
            return Err(format!("the `{REQUEST_ID}` header is missing"));
        }
        if header(TRACEPARENT).is_none() && parts.traceparent.is_empty() {
            return Err(format!("the `{TRACEPARENT}` header is missing"));
        }
        if !TraceContext::new(parts.traceparent.as_ref(), None).is_valid() {
            return Err(format!(
                "the `{TRACEPARENT}` header {:?} is not a valid W3C traceparent",
                parts.traceparent
            ));
        }
        parts.trace_id = parts.traceparent.get(3..35).unwrap_or_default().to_owned();
        Ok(parts)
    }

    /// Takes the payload, context, time, trigger and lineage of an upstream 0.100
    /// `PreparedJobSubmission` (spec §J.2). Its context fills in what the row's headers lack
    /// (upstream writes both; the headers win when both are present).
    fn adopt_prepared_submission(
        &mut self,
        fields: &mut Vec<(String, Box<RawValue>)>,
    ) -> Result<(), String> {
        let mode = string_field(fields, "mode")?;
        if mode != self.mode.as_str() {
            return Err(format!(
                "the payload's mode {mode:?} differs from the row kind (`{}`)",
                self.mode.as_str()
            ));
        }
        let service = string_field(fields, "service")?;
        let queue = string_field(fields, "queue")?;
        if service.is_empty() || queue.is_empty() {
            return Err("the payload's `service` or `queue` is empty".into());
        }
        self.event_service = Cow::Owned(service);
        self.event_job_type = Cow::Owned(queue);
        let take = |fields: &mut Vec<(String, Box<RawValue>)>, key: &str| {
            fields
                .iter()
                .rposition(|(k, _)| k == key)
                .map(|at| fields.remove(at).1)
        };
        let created_at = string_field(fields, "createdAt")?;
        self.created_at = DateTime::parse_from_rfc3339(&created_at)
            .map(|at| at.with_timezone(&Utc))
            .map_err(|e| format!("the payload's createdAt {created_at:?} is not RFC 3339: {e}"))?;
        let context = take(fields, "context").ok_or("the payload has no `context`")?;
        let context: StoredContext = serde_json::from_str(context.get()).map_err(|e| {
            format!("the payload's context is not {{requestId, traceparent, tracestate?}}: {e}")
        })?;
        if self.request_id.is_empty() {
            self.request_id = Cow::Owned(context.request_id);
        }
        if self.traceparent.is_empty() {
            self.traceparent = Cow::Owned(context.traceparent);
            if self.tracestate.is_none() {
                self.tracestate = context.tracestate.map(Cow::Owned);
            }
        }
        // Upstream's job manager defaults a submission's trigger to service code.
        self.trigger = Some(match take(fields, "trigger") {
            Some(trigger) => trigger,
            None => RawValue::from_string(r#"{"kind":"serviceCode"}"#.to_owned())
                .map_err(|e| format!("the default trigger: {e}"))?,
        });
        self.lineage = take(fields, "lineage");
        let payload = take(fields, "payload").ok_or("the payload has no `payload`")?;
        self.payload = UserPayload::Raw(payload);
        Ok(())
    }
}

/// Whether a job row's payload is upstream 0.100's `PreparedJobSubmission`
/// (`{submissionId, mode, service, queue, jobId, payload, createdAt, context, …}`) rather
/// than 0.11's `{...payload, jobId, submissionId}`: it has every one of those keys.
fn is_prepared_submission(fields: &[(String, Box<RawValue>)]) -> bool {
    [
        "mode",
        "service",
        "queue",
        "payload",
        "createdAt",
        "context",
    ]
    .iter()
    .all(|key| fields.iter().any(|(k, _)| k == key))
}

/// The string value of the last `key` of a payload.
fn string_field(fields: &[(String, Box<RawValue>)], key: &str) -> Result<String, String> {
    let raw = fields
        .iter()
        .rev()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v)
        .ok_or_else(|| format!("the payload has no `{key}`"))?;
    serde_json::from_str::<String>(raw.get())
        .map_err(|_| format!("the payload's `{key}` is not a string: {}", raw.get()))
}

/// The job's own payload, keys in stored order, values verbatim: the 0.11 row payload
/// without `jobId`/`submissionId`, or the `payload` of a 0.100 `PreparedJobSubmission`.
pub(super) enum UserPayload {
    /// The fields of a 0.11 row.
    Fields(Vec<(String, Box<RawValue>)>),
    /// A 0.100 submission's `payload`, any JSON value.
    Raw(Box<RawValue>),
}

impl Serialize for UserPayload {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Fields(fields) => {
                let mut map = serializer.serialize_map(Some(fields.len()))?;
                for (key, value) in fields {
                    map.serialize_entry(key, value)?;
                }
                map.end()
            }
            Self::Raw(value) => value.serialize(serializer),
        }
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
pub(super) mod tests {
    use std::collections::BTreeMap;

    use chrono::DateTime;

    use super::*;
    use crate::record::PreparedOutboxRecord;

    pub(crate) const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    /// A `job.submit` row with the given payload and subject.
    pub(crate) fn job_row(payload: &str, subject: &str) -> OutboxMessage {
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
            ordering: None,
        };
        let created = DateTime::from_timestamp_millis(1_779_667_200_123).unwrap();
        OutboxMessage::pending(record, created)
    }
}
