//! The Trellis job `created` lifecycle event (spec §D.3) that [`JetStreamPublisher`]
//! publishes for a job row by default: its JSON body and headers.
//!
//! [`JetStreamPublisher`]: super::JetStreamPublisher

use std::collections::HashMap;
use std::time::Duration;

use serde::Serialize;
use serde_json::value::RawValue;

use super::job_row::{JobParts, UserPayload, malformed};
use crate::dispatch::PublishError;
use crate::event::{TRACEPARENT, TRACESTATE};
use crate::job::REQUEST_ID;
use crate::record::{NATS_MSG_ID, OutboxMessage};
use crate::time::format_timestamp;

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
                .and_then(|after| parts.created_at.checked_add_signed(after))
                .ok_or_else(|| {
                    malformed(
                        message,
                        format!("a deadline {after:?} after the submission time overflows"),
                    )
                })?;
            Some(format_timestamp(after))
        }
        None => None,
    };
    let body = CreatedEvent {
        job_id: &parts.job_id,
        service: &parts.event_service,
        job_type: &parts.event_job_type,
        event_type: "created",
        state: "pending",
        context: WireContext {
            request_id: &parts.request_id,
            trace_id: &parts.trace_id,
            traceparent: &parts.traceparent,
            tracestate: parts.tracestate.as_deref(),
        },
        tries: 0,
        max_tries,
        payload: &parts.payload,
        deadline,
        trigger: parts.trigger.as_deref(),
        lineage: parts.lineage.as_deref(),
        timestamp: format_timestamp(parts.created_at),
    };
    let bytes = serde_json::to_vec(&body)
        .map_err(|e| malformed(message, format!("the event cannot be encoded: {e}")))?;
    let mut headers = async_nats::HeaderMap::new();
    let msg_id = format!("trellis-job-created:{}", parts.submission_id);
    let values = [
        (REQUEST_ID, Some(parts.request_id.as_ref())),
        (TRACEPARENT, Some(parts.traceparent.as_ref())),
        (TRACESTATE, parts.tracestate.as_deref()),
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

/// A header value, refused (never a panic) when NATS cannot carry it: the rule enqueue and
/// the claim check apply to stored headers (tab allowed, as W3C `tracestate` may hold it).
fn header_value(value: &str) -> Result<async_nats::HeaderValue, String> {
    if crate::wire::header_value_problem("", value).is_some() {
        return Err(format!(
            "{value:?} contains a control character (only tab is allowed)"
        ));
    }
    value
        .parse()
        .map_err(|e: async_nats::header::ParseHeaderValueError| e.to_string())
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
    payload: &'a UserPayload,
    #[serde(skip_serializing_if = "Option::is_none")]
    deadline: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    trigger: Option<&'a RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lineage: Option<&'a RawValue>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nats::job_row::tests::job_row;

    /// `jobType` is the queue key (the row's `name`), not the subject's job-type token:
    /// upstream's worker looks the queue binding up by it (`jobs.queues[job.type]`).
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
                r#"{"jobId":"01JOB","service":"billing","jobType":"syncCustomer","eventType":"created","#,
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

    /// Upstream 0.100 stores a `PreparedJobSubmission` (spec §J.2): the created event's
    /// payload is its `payload`, not the wrapper, and its context and time are used.
    #[test]
    fn a_prepared_submission_row_publishes_its_payload_not_the_wrapper() {
        let payload = concat!(
            r#"{"submissionId":"01SUB","mode":"submit","service":"billing","queue":"syncCustomer","#,
            r#""jobId":"01JOB","payload":{"customerId":"c-1","n":[1,2]},"#,
            r#""createdAt":"2026-05-25T00:00:05.000Z","#,
            r#""context":{"requestId":"01CTXREQ","traceId":"0af7651916cd43dd8448eb211c80319c","#,
            r#""traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01","tracestate":"v=1"},"#,
            r#""trigger":{"kind":"rpc","id":"r-1"}}"#
        );
        let subject = "trellis.jobs.billing.sync-customer.01JOB.created";
        let mut settings = CreatedEventSettings::new(3);
        settings
            .deadlines
            .insert("syncCustomer".into(), Duration::from_secs(60));

        // Headers written next to the payload win; the context fills in when they are absent.
        let with_headers = job_row(payload, subject);
        let (body, headers) = created_event(&with_headers, &settings).unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            body["payload"],
            serde_json::json!({"customerId": "c-1", "n": [1, 2]})
        );
        assert_eq!(body["context"]["requestId"], "01REQ");
        assert_eq!(body["timestamp"], "2026-05-25T00:00:05.000Z");
        assert_eq!(body["deadline"], "2026-05-25T00:01:05.000Z");
        assert_eq!(
            body["trigger"],
            serde_json::json!({"kind": "rpc", "id": "r-1"})
        );
        assert!(body.get("lineage").is_none());
        assert_eq!(headers.get(REQUEST_ID).unwrap().as_str(), "01REQ");
        // The submission's service and queue, as upstream's job manager writes them.
        let named = job_row(
            &payload
                .replace(r#""service":"billing""#, r#""service":"billing-svc""#)
                .replace(r#""queue":"syncCustomer""#, r#""queue":"syncAccount""#),
            subject,
        );
        let (body, _) = created_event(&named, &settings).unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["service"], "billing-svc");
        assert_eq!(body["jobType"], "syncAccount");
        // Without a trigger, upstream's default.
        let untriggered = job_row(
            &payload.replace(r#","trigger":{"kind":"rpc","id":"r-1"}"#, ""),
            subject,
        );
        let (body, _) = created_event(&untriggered, &settings).unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["trigger"], serde_json::json!({"kind": "serviceCode"}));

        let mut bare = job_row(payload, subject);
        bare.headers.clear();
        let (body, headers) = created_event(&bare, &settings).unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["context"]["requestId"], "01CTXREQ");
        assert_eq!(
            body["context"]["traceId"],
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(body["context"]["tracestate"], "v=1");
        assert_eq!(headers.get(REQUEST_ID).unwrap().as_str(), "01CTXREQ");
        assert_eq!(headers.get(TRACESTATE).unwrap().as_str(), "v=1");

        // A wrapper that contradicts its row is malformed, not guessed at.
        for (from, to, expected) in [
            (
                r#""mode":"submit""#,
                r#""mode":"create""#,
                "differs from the row kind",
            ),
            (
                r#""createdAt":"2026-05-25T00:00:05.000Z""#,
                r#""createdAt":"yesterday""#,
                "is not RFC 3339",
            ),
            (
                r#""context":{"requestId""#,
                r#""context":{"other""#,
                "context is not",
            ),
        ] {
            let mut row = job_row(&payload.replace(from, to), subject);
            row.headers.clear();
            let err = created_event(&row, &settings).unwrap_err();
            assert!(!err.is_retryable());
            assert!(err.chain().contains(expected), "{}", err.chain());
        }
    }

    #[test]
    fn the_longest_queue_deadline_can_be_written() {
        let row = job_row(
            r#"{"jobId":"01JOB","submissionId":"01SUB"}"#,
            "trellis.jobs.billing.sync.01JOB.created",
        );
        let mut settings = CreatedEventSettings::new(5);
        settings
            .deadlines
            .insert("syncCustomer".into(), crate::nats::MAX_QUEUE_DEADLINE);
        let (body, _) = created_event(&row, &settings).unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let expected = row.created_at + chrono::Duration::days(36_525);
        assert_eq!(body["deadline"], format_timestamp(expected));
        assert!(body["deadline"].as_str().unwrap().starts_with("2126-05-"));
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
        // W3C tracestate allows tabs around its list members.
        let mut row = ok();
        row.headers.insert(TRACESTATE.into(), "a=b,\tc=d".into());
        let (_, headers) = created_event(&row, &settings).unwrap();
        assert_eq!(headers.get(TRACESTATE).unwrap().as_str(), "a=b,\tc=d");
        let mut row = job_row(
            r#"{"jobId":"01JOB","submissionId":"01\r\nSUB"}"#,
            "trellis.jobs.billing.sync.01JOB.created",
        );
        row.id = "01\r\nSUB".into();
        let err = created_event(&row, &settings).unwrap_err();
        assert!(err.chain().contains("Nats-Msg-Id"), "{}", err.chain());
    }
}
