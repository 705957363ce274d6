//! [`JetStreamPublisher`]: pipelined JetStream delivery of outbox rows.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::message::PublishMessage as Publish;
use futures_util::future::BoxFuture;
use tokio::time::Instant;
use tracing::Instrument as _;

use super::created::{CreatedEventSettings, created_event};
use super::error::classify;
use super::jobs::{JobDispatcher, NoJobDispatcher};
use super::streams::quoted;
use super::{JetStreamError, JetStreamErrorKind};

use crate::dispatch::{PublishError, Publisher, RetryPolicy};
use crate::record::{OutboxMessage, OutboxRecordKind};
use crate::subject::subject_problem;

type RowResult = Result<Option<serde_json::Value>, PublishError>;
type BatchResult = Vec<RowResult>;

/// What the publisher does with `job.create`/`job.submit` rows.
pub(super) enum JobRoute<D> {
    /// Publish the Trellis job `created` lifecycle event (spec §D.3).
    CreatedEvent(CreatedEventSettings),
    /// Admit through a service's jobs manager.
    Dispatcher(D),
    /// Refuse, retryably.
    Disabled,
}

/// A [`Publisher`] that delivers outbox rows to NATS JetStream.
///
/// * **Events** (`event.publish`) are published to the row's subject with the stored payload
///   bytes verbatim and the stored headers, with `Nats-Msg-Id` always set to the row id
///   (see [`OutboxMessage::publish_headers`]). A `duplicate` acknowledgement — JetStream
///   already had the id within the stream's duplicate window — counts as success.
/// * **Jobs** (`job.create`/`job.submit`) are, by default, published as the Trellis job
///   `created` lifecycle event (spec §D.3): subject = the stored subject
///   `trellis.jobs.<service>.<job_type>.<jobId>.created`, body = the `JobEvent` wire JSON
///   (`state: "pending"`, `tries: 0`, `maxTries` from
///   [`job_max_tries`](super::JetStreamPublisherBuilder::job_max_tries) /
///   [`queue_max_tries`](super::JetStreamPublisherBuilder::queue_max_tries), context from the stored
///   headers, `timestamp` = the row's `created_at`), headers `request-id`, `traceparent`,
///   `tracestate` and `Nats-Msg-Id: trellis-job-created:<submissionId>`. Plug in a
///   [`JobDispatcher`] to admit through a jobs manager instead, or call
///   [`no_job_dispatch`](super::JetStreamPublisherBuilder::no_job_dispatch) to make job rows fail
///   (retryably, loudly). Job rows are never silently marked dispatched.
///
/// Publishing is pipelined: up to [`ack_window`](super::JetStreamPublisherBuilder::ack_window)
/// publishes are in flight before the oldest acknowledgement is awaited, and each row gets
/// its own result. Failures are [`PublishError`]s wrapping a [`JetStreamError`]: a payload
/// over the server's `max_payload` (or the stream's `max_msg_size`), an invalid subject and a
/// malformed job row are permanent; timeouts, no stream (no responders), a lost connection
/// and anything else are retryable.
///
/// The async-nats [`Context`](async_nats::jetstream::Context) has its own ack limits: its
/// `max_ack_inflight` (5,000 by default, shared by everything publishing through the context)
/// caps the window in effect — a send that finds no free permit waits while this batch's
/// oldest acks complete, so a smaller limit slows the batch but never stalls it — and an ack
/// wait is bounded by the smaller of [`ack_timeout`](super::JetStreamPublisherBuilder::ack_timeout) and the
/// context's timeout (5 s unless set with `ContextBuilder::timeout`).
///
/// # Examples
///
/// ```no_run
/// use std::time::Duration;
/// use trellis_outbox::JetStreamPublisher;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let client = async_nats::connect("nats://127.0.0.1:4222").await?;
/// let publisher = JetStreamPublisher::builder(async_nats::jetstream::new(client))
///     .ack_window(512)
///     .queue_max_tries("syncCustomer", 10)
///     .build();
/// // At start: fail fast when no stream captures what we publish.
/// publisher
///     .check_streams(["events.v1.Orders.Placed"], Duration::from_secs(300))
///     .await?;
/// # Ok(()) }
/// ```
pub struct JetStreamPublisher<D = NoJobDispatcher> {
    pub(super) context: async_nats::jetstream::Context,
    /// Publishes awaiting their acknowledgement at once (at least 1).
    pub(super) window: usize,
    pub(super) ack_timeout: Duration,
    pub(super) job_dispatch_timeout: Duration,
    pub(super) allowed_prefixes: Option<Vec<String>>,
    pub(super) jobs: JobRoute<D>,
    /// Subjects [`Publisher::on_start`] checks.
    pub(super) startup_subjects: Vec<String>,
}

impl<D> fmt::Debug for JetStreamPublisher<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let jobs = match &self.jobs {
            JobRoute::CreatedEvent(_) => "created event",
            JobRoute::Dispatcher(_) => std::any::type_name::<D>(),
            JobRoute::Disabled => "disabled",
        };
        f.debug_struct("JetStreamPublisher")
            .field("window", &self.window)
            .field("ack_timeout", &self.ack_timeout)
            .field("job_dispatch_timeout", &self.job_dispatch_timeout)
            .field("allowed_prefixes", &self.allowed_prefixes)
            .field("jobs", &jobs)
            .finish_non_exhaustive()
    }
}

/// A publish ready to send.
struct Outgoing {
    subject: String,
    publish: Publish,
}

enum Step {
    Send(Outgoing),
    Done(Result<Option<serde_json::Value>, PublishError>),
}

impl<D: JobDispatcher> JetStreamPublisher<D> {
    /// The JetStream context publishes go through.
    pub fn context(&self) -> &async_nats::jetstream::Context {
        &self.context
    }

    /// The longest [`publish_batch`](Publisher::publish_batch) of `rows` rows may take: the
    /// ack timeout once per window of rows (`ack_timeout × ceil(rows / ack_window)`: a window
    /// is awaited before the next one is sent), plus, when job rows go through a
    /// [`JobDispatcher`], `rows × job_dispatch_timeout` (every row could be a job, decided
    /// one at a time). Saturates at `Duration::MAX`.
    ///
    /// ```no_run
    /// # fn run(context: async_nats::jetstream::Context) {
    /// use std::time::Duration;
    ///
    /// let publisher = trellis_outbox::JetStreamPublisher::builder(context)
    ///     .ack_window(100)
    ///     .ack_timeout(Duration::from_secs(2))
    ///     .build();
    /// assert_eq!(publisher.publish_budget(250), Duration::from_secs(6));
    /// # }
    /// ```
    pub fn publish_budget(&self, rows: usize) -> Duration {
        let windows = rows.div_ceil(self.window.max(1));
        let acks = self
            .ack_timeout
            .saturating_mul(u32::try_from(windows).unwrap_or(u32::MAX));
        match self.jobs {
            JobRoute::Dispatcher(_) => acks.saturating_add(
                self.job_dispatch_timeout
                    .saturating_mul(u32::try_from(rows).unwrap_or(u32::MAX)),
            ),
            JobRoute::CreatedEvent(_) | JobRoute::Disabled => acks,
        }
    }

    async fn publish_all(&self, messages: &[OutboxMessage]) -> BatchResult {
        let mut results: Vec<Option<Result<Option<serde_json::Value>, PublishError>>> =
            std::iter::repeat_with(|| None)
                .take(messages.len())
                .collect();
        // Acks in send order. Each is a boxed future so the oldest can be polled while a
        // send waits and be put back, half-polled, when the send wins.
        let mut pending: VecDeque<(usize, BoxFuture<'_, RowResult>)> =
            VecDeque::with_capacity(self.window.min(messages.len()));

        for (index, message) in messages.iter().enumerate() {
            let outgoing = match self.prepare(message).await {
                Step::Send(outgoing) => outgoing,
                Step::Done(result) => {
                    results[index] = Some(result);
                    continue;
                }
            };
            while pending.len() >= self.window {
                if let Some((done, ack)) = pending.pop_front() {
                    results[done] = Some(ack.await);
                }
            }
            let sent = Instant::now();
            let span = publish_span(message);
            let send = self
                .context
                .send_publish(outgoing.subject, outgoing.publish)
                .instrument(span.clone());
            tokio::pin!(send);
            // With backpressure on (the default), a send waits for one of the context's
            // `max_ack_inflight` permits, and the unawaited acks of this batch hold permits
            // until they complete. Resolve acks while the send waits, or a window larger than
            // the context's limit (or other publishers on a shared context) would hang here.
            let outcome = loop {
                let Some((_, oldest)) = pending.front_mut() else {
                    break send.as_mut().await;
                };
                let acked = tokio::select! {
                    biased;
                    outcome = send.as_mut() => Err(outcome),
                    acked = oldest.as_mut() => Ok(acked),
                };
                match acked {
                    Err(outcome) => break outcome,
                    Ok(acked) => {
                        if let Some((done, _)) = pending.pop_front() {
                            results[done] = Some(acked);
                        }
                    }
                }
            };
            match outcome {
                Ok(ack) => pending.push_back((
                    index,
                    Box::pin(self.await_ack(message, sent, ack).instrument(span)),
                )),
                Err(err) => results[index] = Some(Err(classify(message, err))),
            }
        }
        while let Some((done, ack)) = pending.pop_front() {
            results[done] = Some(ack.await);
        }

        results
            .into_iter()
            .map(|result| {
                result.unwrap_or_else(|| {
                    Err(PublishError::retryable(
                        "internal error: the JetStream publisher produced no result for this row",
                    ))
                })
            })
            .collect()
    }

    /// Turns one row into a publish, or into its result when there is nothing to send.
    async fn prepare(&self, message: &OutboxMessage) -> Step {
        if let Some(problem) = subject_problem(&message.subject) {
            return Step::Done(Err(PublishError::permanent(
                JetStreamError::new(JetStreamErrorKind::InvalidSubject, message).detail(problem),
            )));
        }
        if let Some(prefixes) = &self.allowed_prefixes
            && !prefixes
                .iter()
                .any(|p| message.subject.starts_with(p.as_str()))
        {
            return Step::Done(Err(PublishError::permanent(
                JetStreamError::new(JetStreamErrorKind::SubjectNotAllowed, message)
                    .detail(format!("allowed prefixes: {}", quoted(prefixes))),
            )));
        }
        match message.kind {
            OutboxRecordKind::EventPublish => match message.publish_headers() {
                Ok(headers) => Step::Send(Outgoing {
                    subject: message.subject.clone(),
                    publish: Publish::build()
                        .payload(message.payload.clone().into())
                        .headers(headers),
                }),
                Err(err) => Step::Done(Err(PublishError::permanent(err))),
            },
            OutboxRecordKind::JobCreate | OutboxRecordKind::JobSubmit => match &self.jobs {
                JobRoute::CreatedEvent(settings) => match created_event(message, settings) {
                    Ok((body, headers)) => Step::Send(Outgoing {
                        subject: message.subject.clone(),
                        publish: Publish::build().payload(body.into()).headers(headers),
                    }),
                    Err(err) => Step::Done(Err(err)),
                },
                JobRoute::Dispatcher(dispatcher) => Step::Done(
                    match tokio::time::timeout(
                        self.job_dispatch_timeout,
                        dispatcher.dispatch_job(message),
                    )
                    .await
                    {
                        Ok(Ok(admission)) => {
                            serde_json::to_value(&admission).map(Some).map_err(|e| {
                                PublishError::permanent(
                                    JetStreamError::new(JetStreamErrorKind::Other, message)
                                        .detail("the job admission outcome cannot be encoded")
                                        .source(e),
                                )
                            })
                        }
                        Ok(Err(err)) => Err(err),
                        Err(_elapsed) => Err(PublishError::retryable(
                            JetStreamError::new(JetStreamErrorKind::JobDispatchTimedOut, message)
                                .detail(format!("{:?}", self.job_dispatch_timeout)),
                        )),
                    },
                ),
                JobRoute::Disabled => Step::Done(Err(PublishError::retryable(
                    JetStreamError::new(JetStreamErrorKind::NoJobDispatch, message),
                ))),
            },
        }
    }

    async fn await_ack(
        &self,
        message: &OutboxMessage,
        sent: Instant,
        ack: PublishAckFuture,
    ) -> Result<Option<serde_json::Value>, PublishError> {
        // A deadline past what `Instant` can hold (e.g. `ack_timeout(Duration::MAX)`) is no
        // deadline: the context's own ack timeout still ends the wait.
        let acked = match sent.checked_add(self.ack_timeout) {
            Some(deadline) => tokio::time::timeout_at(deadline, ack.into_future()).await,
            None => Ok(ack.into_future().await),
        };
        match acked {
            Ok(Ok(ack)) => {
                if ack.duplicate {
                    tracing::debug!(
                        id = %message.id,
                        stream = %ack.stream,
                        sequence = ack.sequence,
                        "JetStream already had this message id (duplicate ack): delivered"
                    );
                }
                Ok(None)
            }
            Ok(Err(err)) => Err(classify(message, err)),
            Err(_elapsed) => Err(PublishError::retryable(JetStreamError::timeout(
                message,
                self.ack_timeout,
            ))),
        }
    }
}

impl<D: JobDispatcher> Publisher for JetStreamPublisher<D> {
    fn publish_batch(
        &self,
        messages: &[OutboxMessage],
    ) -> impl std::future::Future<Output = BatchResult> + Send {
        self.publish_all(messages)
    }

    fn publish_budget(&self, rows: usize) -> Option<Duration> {
        Some(JetStreamPublisher::publish_budget(self, rows))
    }

    async fn on_start(&self, retry_policy: &RetryPolicy) {
        self.check_streams_at_start(retry_policy).await;
    }
}

/// The span of one row's publish, from send to ack: with the `opentelemetry` feature a child
/// of the trace context stored in the row (the enqueuing handler's span), otherwise none.
fn publish_span(message: &OutboxMessage) -> tracing::Span {
    #[cfg(feature = "opentelemetry")]
    {
        let span = tracing::info_span!(
            "outbox_publish",
            otel.kind = "producer",
            id = %message.id,
            name = %message.name,
            subject = %message.subject,
        );
        crate::otel::adopt_stored(&span, &message.headers);
        span
    }
    #[cfg(not(feature = "opentelemetry"))]
    {
        let _ = message;
        tracing::Span::none()
    }
}
