//! The job admission contract: a [`JobDispatcher`] admits a job row through a service's own
//! jobs manager and answers with a [`JobAdmission`]; [`JobRequest`] is the decoded row it
//! reads.

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::job_row::{JobParts, malformed};
use crate::dispatch::PublishError;
use crate::event::TraceContext;
use crate::job::JobMode;
use crate::record::OutboxMessage;

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
    /// The job's own payload: the stored payload without `jobId` and `submissionId`, or the
    /// `payload` field of an upstream 0.100 `PreparedJobSubmission` row.
    pub payload: serde_json::Value,
    /// The `request-id` header (or the 0.100 payload's `context.requestId`).
    pub request_id: String,
    /// The `traceparent` and `tracestate` headers (or the 0.100 payload's `context`).
    pub trace: TraceContext,
    /// When the job was submitted: a 0.100 row's `createdAt`, else when the row was
    /// enqueued.
    pub created_at: DateTime<Utc>,
}

impl JobRequest {
    /// Decodes a job row: subject `trellis.jobs.<service>.<job_type>.<jobId>.created`,
    /// payload a JSON object with string `jobId` (matching the subject) and `submissionId`
    /// (matching the row id), headers `request-id` and a valid `traceparent`.
    ///
    /// Both stored shapes are read: 0.11's `{...payload, jobId, submissionId}` and upstream
    /// 0.100's `PreparedJobSubmission` (`{submissionId, mode, service, queue, jobId, payload,
    /// createdAt, context, trigger?, lineage?}`, spec §J.2), recognized by having all of
    /// `mode`, `service`, `queue`, `payload`, `createdAt` and `context`. For the latter,
    /// `mode` must match the row kind, `createdAt` must be RFC 3339, and `context` supplies
    /// the request id and trace context when the headers lack them.
    ///
    /// # Errors
    ///
    /// A permanent [`PublishError`] wrapping a [`JetStreamError`](super::JetStreamError) of kind
    /// [`MalformedJob`](super::JetStreamErrorKind::MalformedJob) saying what is wrong.
    pub fn from_message(message: &OutboxMessage) -> Result<Self, PublishError> {
        let parts = JobParts::parse(message).map_err(|problem| malformed(message, problem))?;
        let payload = serde_json::to_value(&parts.payload)
            .map_err(|e| malformed(message, format!("the payload cannot be re-encoded: {e}")))?;
        Ok(Self {
            submission_id: parts.submission_id,
            job_id: parts.job_id,
            queue: message.name.clone(),
            mode: parts.mode,
            service: parts.service.to_owned(),
            job_type: parts.job_type.to_owned(),
            payload,
            request_id: parts.request_id.into_owned(),
            trace: TraceContext::new(
                parts.traceparent.into_owned(),
                parts.tracestate.map(Cow::into_owned),
            ),
            created_at: parts.created_at,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nats::job_row::tests::job_row;

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
    fn job_request_decodes_a_prepared_submission_row() {
        let row = job_row(
            concat!(
                r#"{"submissionId":"01SUB","mode":"submit","service":"billing","queue":"syncCustomer","#,
                r#""jobId":"01JOB","payload":[1,"two"],"createdAt":"2026-05-25T00:00:05Z","#,
                r#""context":{"requestId":"r","traceId":"4bf92f3577b34da6a3ce929d0e0e4736","#,
                r#""traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}"#
            ),
            "trellis.jobs.billing.sync-customer.01JOB.created",
        );
        let job = JobRequest::from_message(&row).unwrap();
        assert_eq!(job.payload, serde_json::json!([1, "two"]));
        assert_eq!(job.request_id, "01REQ", "the header wins over the context");
        assert_eq!(
            job.created_at,
            DateTime::parse_from_rfc3339("2026-05-25T00:00:05Z").unwrap()
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
