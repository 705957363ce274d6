//! [`JetStreamPublisher`]: pipelined JetStream delivery of outbox rows.

use std::collections::VecDeque;
use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use async_nats::jetstream::context::{
    PublishAckFuture, PublishError as NatsPublishError, PublishErrorKind,
};
use async_nats::jetstream::message::PublishMessage as Publish;
use tokio::time::Instant;

use super::jobs::{CreatedEventSettings, JobDispatcher, NoJobDispatcher, created_event};
use super::{JetStreamError, JetStreamErrorKind};
use crate::dispatch::{BoxError, PublishError, Publisher, RetryPolicy};
use crate::record::{OutboxMessage, OutboxRecordKind};
use crate::subject::subject_problem;

/// Default for [`JetStreamPublisherBuilder::ack_window`]: publishes in flight at once.
pub const DEFAULT_ACK_WINDOW: usize = 256;
/// Default for [`JetStreamPublisherBuilder::ack_timeout`].
pub const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// Default for [`JetStreamPublisherBuilder::job_dispatch_timeout`].
pub const DEFAULT_JOB_DISPATCH_TIMEOUT: Duration = Duration::from_secs(30);
/// Default `maxTries` of the job `created` event when no per-queue value is configured
/// (see [`JetStreamPublisherBuilder::job_max_tries`]).
pub const DEFAULT_JOB_MAX_TRIES: u64 = 5;

type BatchResult = Vec<Result<Option<serde_json::Value>, PublishError>>;

/// What the publisher does with `job.create`/`job.submit` rows.
enum JobRoute<D> {
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
///   [`job_max_tries`](JetStreamPublisherBuilder::job_max_tries) /
///   [`queue_max_tries`](JetStreamPublisherBuilder::queue_max_tries), context from the stored
///   headers, `timestamp` = the row's `created_at`), headers `request-id`, `traceparent`,
///   `tracestate` and `Nats-Msg-Id: trellis-job-created:<submissionId>`. Plug in a
///   [`JobDispatcher`] to admit through a jobs manager instead, or call
///   [`no_job_dispatch`](JetStreamPublisherBuilder::no_job_dispatch) to make job rows fail
///   (retryably, loudly). Job rows are never silently marked dispatched.
///
/// Publishing is pipelined: up to [`ack_window`](JetStreamPublisherBuilder::ack_window)
/// publishes are in flight before the oldest acknowledgement is awaited, and each row gets
/// its own result. Failures are [`PublishError`]s wrapping a [`JetStreamError`]: a payload
/// over the server's `max_payload` (or the stream's `max_msg_size`), an invalid subject and a
/// malformed job row are permanent; timeouts, no stream (no responders), a lost connection
/// and anything else are retryable.
///
/// The async-nats [`Context`](async_nats::jetstream::Context) has its own ack limits: keep its
/// `max_ack_inflight` (5,000 by default) at or above the window, and note that an ack wait is
/// bounded by the smaller of [`ack_timeout`](JetStreamPublisherBuilder::ack_timeout) and the
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
    context: async_nats::jetstream::Context,
    window: usize,
    ack_timeout: Duration,
    job_dispatch_timeout: Duration,
    allowed_prefixes: Option<Vec<String>>,
    jobs: JobRoute<D>,
    startup_subjects: Vec<String>,
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

/// Configures a [`JetStreamPublisher`]; made by [`JetStreamPublisher::builder`].
pub struct JetStreamPublisherBuilder<D = NoJobDispatcher> {
    context: async_nats::jetstream::Context,
    window: usize,
    ack_timeout: Duration,
    job_dispatch_timeout: Duration,
    allowed_prefixes: Option<Vec<String>>,
    created: CreatedEventSettings,
    jobs: BuilderJobs<D>,
    startup_subjects: Vec<String>,
}

enum BuilderJobs<D> {
    CreatedEvent,
    Dispatcher(D),
    Disabled,
}

impl<D> fmt::Debug for JetStreamPublisherBuilder<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStreamPublisherBuilder")
            .field("window", &self.window)
            .field("ack_timeout", &self.ack_timeout)
            .finish_non_exhaustive()
    }
}

impl JetStreamPublisher {
    /// A publisher with the defaults: a window of [`DEFAULT_ACK_WINDOW`], an ack timeout of
    /// [`DEFAULT_ACK_TIMEOUT`], and job rows published as the `created` event with
    /// `maxTries` [`DEFAULT_JOB_MAX_TRIES`].
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), async_nats::ConnectError> {
    /// let client = async_nats::connect("nats://127.0.0.1:4222").await?;
    /// let publisher = trellis_outbox::JetStreamPublisher::new(async_nats::jetstream::new(client));
    /// # Ok(()) }
    /// ```
    pub fn new(context: async_nats::jetstream::Context) -> Self {
        Self::builder(context).build()
    }

    /// A builder starting from the defaults of [`JetStreamPublisher::new`].
    pub fn builder(context: async_nats::jetstream::Context) -> JetStreamPublisherBuilder {
        JetStreamPublisherBuilder {
            context,
            window: DEFAULT_ACK_WINDOW,
            ack_timeout: DEFAULT_ACK_TIMEOUT,
            job_dispatch_timeout: DEFAULT_JOB_DISPATCH_TIMEOUT,
            allowed_prefixes: None,
            created: CreatedEventSettings::new(DEFAULT_JOB_MAX_TRIES),
            jobs: BuilderJobs::CreatedEvent,
            startup_subjects: Vec::new(),
        }
    }
}

impl<D: JobDispatcher> JetStreamPublisherBuilder<D> {
    /// How many publishes may await their acknowledgement at once (at least 1; default
    /// [`DEFAULT_ACK_WINDOW`]). Larger windows are faster (limits.md: 256 in flight ≈ 125k
    /// msg/s with `Nats-Msg-Id` vs ≈ 9k one at a time) and hold more unacknowledged rows.
    /// Memory is bounded by the batch, not the window: `ack_window(usize::MAX)` allocates
    /// for at most the rows of one batch.
    pub fn ack_window(mut self, window: usize) -> Self {
        self.window = window.max(1);
        self
    }

    /// How long after sending a publish its acknowledgement may take before the row fails
    /// (retryably) as timed out. Default [`DEFAULT_ACK_TIMEOUT`]; the context's own timeout
    /// also applies.
    ///
    /// Any value is accepted and none panics: a timeout whose deadline cannot be represented
    /// (e.g. `Duration::MAX`) means "no deadline of this publisher's own" (the context's
    /// timeout still applies), and [`publish_budget`](JetStreamPublisher::publish_budget)
    /// then saturates at `Duration::MAX`, which no dispatcher lease can cover.
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout;
        self
    }

    /// How long a [`JobDispatcher`] may take to decide on one job row before the row fails
    /// (retryably) with [`JobDispatchTimedOut`](super::JetStreamErrorKind::JobDispatchTimedOut).
    /// Default [`DEFAULT_JOB_DISPATCH_TIMEOUT`]. Calls are made one row at a time, so a batch
    /// of `n` job rows can take up to `n` times this; see
    /// [`publish_budget`](JetStreamPublisher::publish_budget).
    pub fn job_dispatch_timeout(mut self, timeout: Duration) -> Self {
        self.job_dispatch_timeout = timeout;
        self
    }

    /// Restricts the subjects rows may be published to: a row (event or job) whose subject
    /// starts with none of `prefixes` fails permanently (it goes `dead`) with
    /// [`SubjectNotAllowed`](super::JetStreamErrorKind::SubjectNotAllowed), and nothing is
    /// sent. Prefixes are plain string prefixes, so end them with `.` to match whole tokens.
    /// Default: every subject that enqueue accepts (never `$…` or `_INBOX.…`, whatever the
    /// prefixes). Calling it again replaces the list; an empty list refuses every row.
    ///
    /// ```no_run
    /// # fn run(context: async_nats::jetstream::Context) {
    /// let publisher = trellis_outbox::JetStreamPublisher::builder(context)
    ///     .allow_subject_prefixes(["events.", "trellis.jobs."])
    ///     .build();
    /// # }
    /// ```
    pub fn allow_subject_prefixes<I>(mut self, prefixes: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.allowed_prefixes = Some(prefixes.into_iter().map(Into::into).collect());
        self
    }

    /// The `maxTries` of the job `created` event for queues without a
    /// [`queue_max_tries`](Self::queue_max_tries) value. Default [`DEFAULT_JOB_MAX_TRIES`].
    ///
    /// The row does not store the queue binding's `maxDeliver`, which Trellis puts here, so
    /// set this (or per queue) to match your binding; the default 5 is only a conservative
    /// placeholder.
    pub fn job_max_tries(mut self, max_tries: u64) -> Self {
        self.created.default_max_tries = max_tries;
        self
    }

    /// The `maxTries` of the `created` event for the queue `queue` (the row's `name`, e.g.
    /// `syncCustomer`).
    pub fn queue_max_tries(mut self, queue: impl Into<String>, max_tries: u64) -> Self {
        self.created.max_tries.insert(queue.into(), max_tries);
        self
    }

    /// Gives jobs of `queue` a `deadline` of the row's `created_at` + `after` in their
    /// `created` event (Trellis' binding `defaultDeadlineMs`). Without it the event has no
    /// `deadline`.
    pub fn queue_deadline(mut self, queue: impl Into<String>, after: Duration) -> Self {
        self.created.deadlines.insert(queue.into(), after);
        self
    }

    /// Admits job rows through `dispatcher` instead of publishing the `created` event; its
    /// [`JobAdmission`](super::JobAdmission) is stored in the row's `outcome`.
    ///
    /// ```no_run
    /// # use trellis_outbox::{JobAdmission, JobDispatcher, OutboxMessage, PublishError};
    /// # struct JobsManager;
    /// # impl JobDispatcher for JobsManager {
    /// #     async fn dispatch_job(&self, _: &OutboxMessage) -> Result<JobAdmission, PublishError> { todo!() }
    /// # }
    /// # fn run(context: async_nats::jetstream::Context) {
    /// let publisher = trellis_outbox::JetStreamPublisher::builder(context)
    ///     .job_dispatcher(JobsManager)
    ///     .build();
    /// # }
    /// ```
    pub fn job_dispatcher<D2: JobDispatcher>(
        self,
        dispatcher: D2,
    ) -> JetStreamPublisherBuilder<D2> {
        JetStreamPublisherBuilder {
            context: self.context,
            window: self.window,
            ack_timeout: self.ack_timeout,
            job_dispatch_timeout: self.job_dispatch_timeout,
            allowed_prefixes: self.allowed_prefixes,
            created: self.created,
            jobs: BuilderJobs::Dispatcher(dispatcher),
            startup_subjects: self.startup_subjects,
        }
    }

    /// Subjects to check when an [`OutboxDispatcher`](crate::OutboxDispatcher) using this
    /// publisher starts: [`check_streams`](JetStreamPublisher::check_streams) runs with them
    /// and the dispatcher's [`RetryPolicy::longest_delay`](crate::RetryPolicy::longest_delay)
    /// before the first drain. A subject no stream captures is logged as an error
    /// (`tracing`), a duplicate window shorter than the longest retry gap as a warning;
    /// neither stops the dispatcher (rows to a missing stream fail retryably until it
    /// exists). Default: none.
    ///
    /// ```no_run
    /// # async fn run(nats: async_nats::Client) {
    /// use trellis_outbox::JetStreamPublisher;
    ///
    /// let publisher = JetStreamPublisher::builder(async_nats::jetstream::new(nats))
    ///     .check_streams_at_start(["events.v1.Orders.Placed", "events.v1.Orders.Shipped"])
    ///     .build();
    /// # let _ = publisher; }
    /// ```
    pub fn check_streams_at_start<I>(mut self, subjects: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.startup_subjects = subjects.into_iter().map(Into::into).collect();
        self
    }

    /// No job dispatch: every job row fails with a retryable error saying that no job
    /// dispatcher is configured, so it stays in the outbox (visible in `last_error`) until a
    /// publisher that can dispatch jobs runs. For services that must not create jobs from
    /// this process.
    pub fn no_job_dispatch(mut self) -> Self {
        self.jobs = BuilderJobs::Disabled;
        self
    }

    /// The publisher.
    pub fn build(self) -> JetStreamPublisher<D> {
        JetStreamPublisher {
            context: self.context,
            window: self.window,
            ack_timeout: self.ack_timeout,
            job_dispatch_timeout: self.job_dispatch_timeout,
            allowed_prefixes: self.allowed_prefixes,
            jobs: match self.jobs {
                BuilderJobs::CreatedEvent => JobRoute::CreatedEvent(self.created),
                BuilderJobs::Dispatcher(dispatcher) => JobRoute::Dispatcher(dispatcher),
                BuilderJobs::Disabled => JobRoute::Disabled,
            },
            startup_subjects: self.startup_subjects,
        }
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

    /// Checks, at start, that a stream captures each subject in `subjects`, and warns
    /// (`tracing::warn!`) for each stream whose duplicate window is shorter than
    /// `longest_retry_gap` — the largest delay between two attempts of a row (the retry
    /// policy's maximum backoff, or the longest outage you want re-publishes to stay
    /// de-duplicated across). Past the window, a re-publish after a crash between publish and
    /// mark is a second message (spec §H 22).
    ///
    /// Pass literal subjects you publish to; for job rows, one subject of each queue such as
    /// `trellis.jobs.billing.sync-customer.x.created` (a pattern matches any stream that
    /// overlaps it, which does not prove the stream captures every subject of the pattern).
    /// Nothing is checked when `subjects` is empty.
    ///
    /// # Errors
    ///
    /// [`StreamCheckError::NoStream`] listing every subject no stream captures;
    /// [`StreamCheckError::Lookup`] if the server could not be asked.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn run(publisher: trellis_outbox::JetStreamPublisher) -> Result<(), trellis_outbox::StreamCheckError> {
    /// let checks = publisher
    ///     .check_streams(["events.v1.Orders.Placed"], std::time::Duration::from_secs(60))
    ///     .await?;
    /// for check in checks {
    ///     println!("{} -> {} (window {:?})", check.subject, check.stream, check.duplicate_window);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn check_streams<I>(
        &self,
        subjects: I,
        longest_retry_gap: Duration,
    ) -> Result<Vec<StreamCheck>, StreamCheckError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let mut checks = Vec::new();
        let mut missing = Vec::new();
        for subject in subjects {
            let subject = subject.as_ref();
            let stream = match self.context.stream_by_subject(subject).await {
                Ok(stream) => stream,
                Err(err)
                    if err.kind()
                        == async_nats::jetstream::context::GetStreamByNameErrorKind::NotFound =>
                {
                    missing.push(subject.to_owned());
                    continue;
                }
                Err(err) => {
                    return Err(StreamCheckError::Lookup {
                        subject: subject.to_owned(),
                        source: Box::new(err),
                    });
                }
            };
            let info =
                self.context
                    .get_stream(&stream)
                    .await
                    .map_err(|err| StreamCheckError::Lookup {
                        subject: subject.to_owned(),
                        source: Box::new(err),
                    })?;
            let duplicate_window = info.cached_info().config.duplicate_window;
            let covers_retry_gap = duplicate_window >= longest_retry_gap;
            if !covers_retry_gap {
                tracing::warn!(
                    stream = %stream,
                    subject,
                    duplicate_window = ?duplicate_window,
                    longest_retry_gap = ?longest_retry_gap,
                    "the stream's duplicate window is shorter than the longest retry gap: a row \
                     re-published after that long is not de-duplicated by Nats-Msg-Id"
                );
            }
            checks.push(StreamCheck {
                subject: subject.to_owned(),
                stream,
                duplicate_window,
                covers_retry_gap,
            });
        }
        if missing.is_empty() {
            Ok(checks)
        } else {
            Err(StreamCheckError::NoStream { subjects: missing })
        }
    }

    async fn publish_all(&self, messages: &[OutboxMessage]) -> BatchResult {
        let mut results: Vec<Option<Result<Option<serde_json::Value>, PublishError>>> =
            std::iter::repeat_with(|| None)
                .take(messages.len())
                .collect();
        let mut pending: VecDeque<(usize, Instant, PublishAckFuture)> =
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
                if let Some((done, sent, ack)) = pending.pop_front() {
                    results[done] = Some(self.await_ack(&messages[done], sent, ack).await);
                }
            }
            let sent = Instant::now();
            match self
                .context
                .send_publish(outgoing.subject, outgoing.publish)
                .await
            {
                Ok(ack) => pending.push_back((index, sent, ack)),
                Err(err) => results[index] = Some(Err(classify(message, err))),
            }
        }
        while let Some((done, sent, ack)) = pending.pop_front() {
            results[done] = Some(self.await_ack(&messages[done], sent, ack).await);
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
        if self.startup_subjects.is_empty() {
            return;
        }
        let gap = retry_policy.longest_delay();
        let checking = self.check_streams(&self.startup_subjects, gap);
        match tokio::time::timeout(STARTUP_CHECK_TIMEOUT, checking).await {
            Ok(Ok(checks)) => {
                for check in checks {
                    tracing::debug!(
                        subject = %check.subject,
                        stream = %check.stream,
                        duplicate_window = ?check.duplicate_window,
                        "outbox subject is captured by a stream"
                    );
                }
            }
            Ok(Err(error)) => tracing::error!(%error, "outbox stream check failed at start"),
            Err(_) => tracing::warn!(
                timeout = ?STARTUP_CHECK_TIMEOUT,
                "outbox stream check did not finish in time; dispatching anyway"
            ),
        }
    }
}

/// How long the start-up stream check may delay the first drain.
const STARTUP_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// Maps an async-nats publish error to a retryable or permanent [`PublishError`].
fn classify(message: &OutboxMessage, err: NatsPublishError) -> PublishError {
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
        Some(js)
            if js.error_code()
                == async_nats::jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM =>
        {
            JetStreamErrorKind::MaxPayloadExceeded
        }
        _ => JetStreamErrorKind::Other,
    }
}

/// The result of [`JetStreamPublisher::check_streams`] for one subject.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamCheck {
    /// The subject checked.
    pub subject: String,
    /// The stream that captures it.
    pub stream: String,
    /// The stream's duplicate window.
    pub duplicate_window: Duration,
    /// Whether the duplicate window is at least the longest retry gap (if not, a warning was
    /// logged).
    pub covers_retry_gap: bool,
}

/// Why [`JetStreamPublisher::check_streams`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StreamCheckError {
    /// No stream captures these subjects: publishing to them fails until one is created.
    #[error(
        "no JetStream stream captures {}: create a stream whose subjects include them before dispatching",
        quoted(subjects)
    )]
    NoStream {
        /// The subjects without a stream.
        subjects: Vec<String>,
    },
    /// The server could not be asked about the stream of `subject`.
    #[error("looking up the JetStream stream for `{subject}` failed")]
    Lookup {
        /// The subject being checked.
        subject: String,
        /// The async-nats error.
        #[source]
        source: BoxError,
    },
}

fn quoted(subjects: &[String]) -> String {
    subjects
        .iter()
        .map(|s| format!("`{s}`"))
        .collect::<Vec<_>>()
        .join(", ")
}
