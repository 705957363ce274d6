//! Decoding a stored job row (`job.create` / `job.submit`, spec §D.2) into its parts,
//! borrowed where possible and with the payload's keys and values kept verbatim. Both the
//! `created` event and [`JobRequest`](super::JobRequest) are built from these parts.

use std::fmt;

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
    pub(super) service: &'a str,
    pub(super) job_type: &'a str,
    pub(super) job_id: String,
    pub(super) submission_id: String,
    /// Every top-level payload field, in stored order, values verbatim.
    pub(super) fields: Vec<(String, Box<RawValue>)>,
    pub(super) request_id: &'a str,
    pub(super) traceparent: &'a str,
    pub(super) trace_id: &'a str,
    pub(super) tracestate: Option<&'a str>,
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

/// The stored payload without `jobId`/`submissionId`, keys in stored order, values verbatim.
pub(super) struct UserPayload<'a>(pub(super) &'a [(String, Box<RawValue>)]);

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
