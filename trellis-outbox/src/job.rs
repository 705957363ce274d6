//! Trellis job requests made with `#[outbox_job]` (spec §D.2).

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::event::TraceContext;
use crate::record::{OutboxRecordKind, PreparedOutboxRecord, new_id};

/// The header carrying a job request's id.
pub const REQUEST_ID: &str = "request-id";

/// How a job is admitted: Trellis' strict `create` or policy-aware `submit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobMode {
    /// `job.create`: a new job or a typed failure.
    Create,
    /// `job.submit`: accepted, rejected, coalesced or replaced by the queue's policy.
    Submit,
}

impl JobMode {
    /// `create` or `submit`.
    pub const fn as_str(self) -> &'static str {
        match self {
            JobMode::Create => "create",
            JobMode::Submit => "submit",
        }
    }

    /// The outbox record kind: `job.create` or `job.submit`.
    pub const fn record_kind(self) -> OutboxRecordKind {
        match self {
            JobMode::Create => OutboxRecordKind::JobCreate,
            JobMode::Submit => OutboxRecordKind::JobSubmit,
        }
    }
}

impl fmt::Display for JobMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the caller needs to track a job written to the outbox (Trellis'
/// `SqlOutboxJobSubmission`). Returned by `tx.enqueue_job(&job)`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct JobSubmission {
    /// The outbox record id; the admission is idempotent per submission.
    pub submission_id: String,
    /// The id the job will have (its events use `trellis.jobs.<service>.<type>.<jobId>.*`).
    pub job_id: String,
    /// The queue key.
    pub queue: String,
    /// `create` or `submit`.
    pub mode: JobMode,
}

/// A Trellis job request: a serializable struct bound to a queue.
///
/// Implement it with `#[outbox_job(...)]` (feature `macros`, on by default), which also
/// implements [`ToOutboxRecord`](crate::ToOutboxRecord) and adds the inherent constants
/// `OUTBOX_NAME` (the queue) and `OUTBOX_SUBJECT_PREFIX`. Write one with
/// `tx.enqueue_job(&job)`, which returns a [`JobSubmission`].
///
/// # Examples
///
/// ```
/// use trellis_outbox::{outbox_job, JobMode, OutboxJob, OutboxRecordKind};
///
/// #[outbox_job(queue = "syncCustomer", service = "billing", job_type = "sync-customer")]
/// #[derive(serde::Serialize)]
/// #[serde(rename_all = "camelCase")]
/// pub struct SyncCustomer {
///     pub customer_id: String,
/// }
///
/// assert_eq!(SyncCustomer::OUTBOX_NAME, "syncCustomer");
/// assert_eq!(SyncCustomer::OUTBOX_SUBJECT_PREFIX, "trellis.jobs.billing.sync-customer");
/// assert_eq!(SyncCustomer::MODE, JobMode::Create);
///
/// let (record, submission) = SyncCustomer { customer_id: "c-1".into() }.prepare_job()?;
/// assert_eq!(record.kind, OutboxRecordKind::JobCreate);
/// assert_eq!(record.id, submission.submission_id);
/// assert_eq!(
///     record.subject,
///     format!("trellis.jobs.billing.sync-customer.{}.created", submission.job_id),
/// );
/// assert_eq!(
///     record.payload,
///     format!(
///         r#"{{"customerId":"c-1","jobId":"{}","submissionId":"{}"}}"#,
///         submission.job_id, submission.submission_id,
///     ),
/// );
/// assert!(record.headers.contains_key("request-id"));
/// assert!(record.headers.contains_key("traceparent"));
/// # Ok::<(), trellis_outbox::Error>(())
/// ```
///
/// A field that would serialize as `jobId` or `submissionId` is rejected, since those keys
/// are added to the payload:
///
/// ```compile_fail
/// #[trellis_outbox::outbox_job(queue = "q", service = "billing", job_type = "sync")]
/// #[derive(serde::Serialize)]
/// #[serde(rename_all = "camelCase")]
/// struct Sync {
///     job_id: String, // error: serializes as `jobId`
/// }
/// ```
///
/// # Arguments of `#[outbox_job(...)]`
///
/// | argument | meaning |
/// |---|---|
/// | `queue = "..."` (required) | the queue key (record `name`) |
/// | `service = "..."` (required) | the service token of the subject prefix |
/// | `job_type = "..."` (required) | the job-type token of the subject prefix |
/// | `mode = "create" \| "submit"` | record kind `job.create` (default) or `job.submit` |
/// | `crate = "path"` | path to `trellis_outbox` when it is re-exported |
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an outbox job",
    note = "annotate it with `#[trellis_outbox::outbox_job(queue = \"...\", service = \"...\", job_type = \"...\")]` and derive `serde::Serialize`"
)]
pub trait OutboxJob: Serialize {
    /// The queue key, e.g. `syncCustomer`; the record's `name`.
    const QUEUE: &'static str;
    /// The service token, e.g. `billing`.
    const SERVICE: &'static str;
    /// The job-type token, e.g. `sync-customer`.
    const JOB_TYPE: &'static str;
    /// `trellis.jobs.<service>.<job_type>`.
    const SUBJECT_PREFIX: &'static str;
    /// `create` or `submit`.
    const MODE: JobMode;

    /// Builds the `job.create`/`job.submit` record exactly as Trellis does (spec §D.2) and
    /// the matching [`JobSubmission`]:
    ///
    /// - id = a new submission ULID; a separate new job ULID;
    /// - subject `<SUBJECT_PREFIX>.<jobId>.created`;
    /// - payload = the struct's fields followed by `jobId` and `submissionId`;
    /// - headers `request-id` (a new ULID), `traceparent` (the current valid one, or a
    ///   synthesized `00-<32 hex>-<16 hex>-01`) and `tracestate` when the current context has
    ///   one. No `Nats-Msg-Id`.
    ///
    /// # Errors
    ///
    /// [`Error::Serialize`] if the job cannot be serialized as a JSON object;
    /// [`Error::InvalidRecord`] if it already has a `jobId` or `submissionId` key (possible
    /// only through `#[serde(flatten)]` or a hand-written `Serialize`).
    fn prepare_job(&self) -> Result<(PreparedOutboxRecord, JobSubmission)> {
        prepare(self)
    }
}

/// The payload: the job's own keys, then `jobId` and `submissionId` (Trellis'
/// `{...payload, jobId, submissionId}`), in that order whatever serde_json's map type.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Payload<'a, J: ?Sized> {
    #[serde(flatten)]
    job: &'a J,
    job_id: &'a str,
    submission_id: &'a str,
}

fn prepare<J: OutboxJob + ?Sized>(job: &J) -> Result<(PreparedOutboxRecord, JobSubmission)> {
    let submission_id = new_id();
    let job_id = new_id();
    let request_id = new_id();
    let serialize_error = |source| Error::Serialize {
        what: "job payload",
        source,
    };

    match serde_json::to_value(job).map_err(serialize_error)? {
        serde_json::Value::Object(map) => {
            if let Some(key) = ["jobId", "submissionId"]
                .into_iter()
                .find(|k| map.contains_key(*k))
            {
                return Err(Error::InvalidRecord {
                    id: submission_id,
                    field: "payload",
                    problem: format!(
                        "the job already has a `{key}` key, which trellis-outbox adds itself"
                    ),
                });
            }
        }
        other => {
            return Err(Error::InvalidRecord {
                id: submission_id,
                field: "payload",
                problem: format!(
                    "a job must serialize as a JSON object, not {}",
                    json_kind(&other)
                ),
            });
        }
    }
    let payload = serde_json::to_string(&Payload {
        job,
        job_id: &job_id,
        submission_id: &submission_id,
    })
    .map_err(serialize_error)?;

    let mut headers = BTreeMap::new();
    headers.insert(REQUEST_ID.to_owned(), request_id);
    TraceContext::current()
        .filter(TraceContext::is_valid)
        .unwrap_or_else(TraceContext::random)
        .insert_headers(&mut headers);

    let record = PreparedOutboxRecord {
        id: submission_id.clone(),
        kind: J::MODE.record_kind(),
        name: J::QUEUE.to_owned(),
        subject: format!("{}.{job_id}.created", J::SUBJECT_PREFIX),
        payload,
        headers,
        ordering: None,
    };
    let submission = JobSubmission {
        submission_id,
        job_id,
        queue: J::QUEUE.to_owned(),
        mode: J::MODE,
    };
    Ok((record, submission))
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A hand-written [`OutboxJob`] (no macro) around any serializable payload.
    #[derive(Serialize)]
    #[serde(transparent)]
    struct Manual<T>(T);

    impl<T: Serialize> OutboxJob for Manual<T> {
        const QUEUE: &'static str = "manual";
        const SERVICE: &'static str = "svc";
        const JOB_TYPE: &'static str = "kind";
        const SUBJECT_PREFIX: &'static str = "trellis.jobs.svc.kind";
        const MODE: JobMode = JobMode::Submit;
    }

    #[derive(Serialize)]
    struct Fields {
        b: u8,
        a: u8,
    }

    #[test]
    fn keeps_field_order_and_appends_ids() {
        let (record, submission) = Manual(Fields { b: 1, a: 2 }).prepare_job().unwrap();
        assert_eq!(
            record.payload,
            format!(
                r#"{{"b":1,"a":2,"jobId":"{}","submissionId":"{}"}}"#,
                submission.job_id, submission.submission_id
            )
        );
        assert_eq!(record.kind, OutboxRecordKind::JobSubmit);
        assert_eq!(submission.mode, JobMode::Submit);
        assert_ne!(submission.job_id, submission.submission_id);
        record.validate().unwrap();
    }

    #[derive(Serialize)]
    struct Flattened {
        #[serde(flatten)]
        extra: BTreeMap<String, String>,
    }

    #[test]
    fn runtime_collisions_are_rejected() {
        let extra = BTreeMap::from([("jobId".to_owned(), "x".to_owned())]);
        let err = Manual(Flattened { extra }).prepare_job().unwrap_err();
        assert!(
            err.to_string()
                .contains("the job already has a `jobId` key"),
            "{err}"
        );
    }

    #[test]
    fn modes() {
        assert_eq!(JobMode::Create.to_string(), "create");
        assert_eq!(JobMode::Submit.record_kind().as_str(), "job.submit");
        assert_eq!(
            serde_json::to_string(&JobMode::Submit).unwrap(),
            r#""submit""#
        );
    }
}
