//! [`JetStreamPublisherBuilder`]: the options of a [`JetStreamPublisher`] and their defaults.

use std::fmt;
use std::time::Duration;

use super::created::CreatedEventSettings;
use super::jobs::{JobDispatcher, NoJobDispatcher};
use super::publisher::{JetStreamPublisher, JobRoute};

/// Default for [`JetStreamPublisherBuilder::ack_window`]: publishes in flight at once.
pub const DEFAULT_ACK_WINDOW: usize = 256;
/// Default for [`JetStreamPublisherBuilder::ack_timeout`].
pub const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// Default for [`JetStreamPublisherBuilder::job_dispatch_timeout`].
pub const DEFAULT_JOB_DISPATCH_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest [`JetStreamPublisherBuilder::queue_deadline`]: 100 years (of 365.25 days).
pub const MAX_QUEUE_DEADLINE: Duration = Duration::from_secs(36_525 * 24 * 60 * 60);
/// Default `maxTries` of the job `created` event when no per-queue value is configured
/// (see [`JetStreamPublisherBuilder::job_max_tries`]).
pub const DEFAULT_JOB_MAX_TRIES: u64 = 5;

/// Configures a [`JetStreamPublisher`]; made by [`JetStreamPublisher::builder`].
///
/// It holds the publisher it will build, so every option lives in one place.
pub struct JetStreamPublisherBuilder<D = NoJobDispatcher> {
    publisher: JetStreamPublisher<D>,
}

impl<D> fmt::Debug for JetStreamPublisherBuilder<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("JetStreamPublisherBuilder")
            .field(&self.publisher)
            .finish()
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
            publisher: JetStreamPublisher {
                context,
                window: DEFAULT_ACK_WINDOW,
                ack_timeout: DEFAULT_ACK_TIMEOUT,
                job_dispatch_timeout: DEFAULT_JOB_DISPATCH_TIMEOUT,
                allowed_prefixes: None,
                jobs: JobRoute::CreatedEvent(CreatedEventSettings::new(DEFAULT_JOB_MAX_TRIES)),
                startup_subjects: Vec::new(),
            },
        }
    }
}

impl<D: JobDispatcher> JetStreamPublisherBuilder<D> {
    /// How many publishes may await their acknowledgement at once (at least 1; default
    /// [`DEFAULT_ACK_WINDOW`]). A larger window is faster, since each acknowledgement is a
    /// server round trip and a window overlaps them instead of waiting for one before sending
    /// the next; it also holds more rows sent but not yet acknowledged.
    /// Memory is bounded by the batch, not the window: `ack_window(usize::MAX)` allocates
    /// for at most the rows of one batch.
    pub fn ack_window(mut self, window: usize) -> Self {
        self.publisher.window = window.max(1);
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
        self.publisher.ack_timeout = timeout;
        self
    }

    /// How long a [`JobDispatcher`] may take to decide on one job row before the row fails
    /// (retryably) with [`JobDispatchTimedOut`](super::JetStreamErrorKind::JobDispatchTimedOut).
    /// Default [`DEFAULT_JOB_DISPATCH_TIMEOUT`]. Calls are made one row at a time, so a batch
    /// of `n` job rows can take up to `n` times this; see
    /// [`publish_budget`](JetStreamPublisher::publish_budget).
    pub fn job_dispatch_timeout(mut self, timeout: Duration) -> Self {
        self.publisher.job_dispatch_timeout = timeout;
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
        self.publisher.allowed_prefixes = Some(prefixes.into_iter().map(Into::into).collect());
        self
    }

    /// The `maxTries` of the job `created` event for queues without a
    /// [`queue_max_tries`](Self::queue_max_tries) value. Default [`DEFAULT_JOB_MAX_TRIES`].
    ///
    /// The row does not store the queue binding's `maxDeliver`, which Trellis puts here, so
    /// set this (or per queue) to match your binding; the default 5 is only a conservative
    /// placeholder.
    pub fn job_max_tries(mut self, max_tries: u64) -> Self {
        if let Some(created) = self.created_event() {
            created.default_max_tries = max_tries;
        }
        self
    }

    /// The `maxTries` of the `created` event for the queue `queue` (the row's `name`, e.g.
    /// `syncCustomer`).
    pub fn queue_max_tries(mut self, queue: impl Into<String>, max_tries: u64) -> Self {
        if let Some(created) = self.created_event() {
            created.max_tries.insert(queue.into(), max_tries);
        }
        self
    }

    /// Gives jobs of `queue` a `deadline` of the row's `created_at` + `after` in their
    /// `created` event (Trellis' binding `defaultDeadlineMs`). Without it the event has no
    /// `deadline`.
    ///
    /// `after` is capped at [`MAX_QUEUE_DEADLINE`] (100 years, logged as a warning when
    /// capped): a longer one could not be written as an RFC 3339 timestamp, and every job row
    /// of the queue would fail.
    ///
    /// ```no_run
    /// # fn run(context: async_nats::jetstream::Context) {
    /// use std::time::Duration;
    ///
    /// let publisher = trellis_outbox::JetStreamPublisher::builder(context)
    ///     .queue_deadline("syncCustomer", Duration::from_secs(15 * 60))
    ///     .build();
    /// # }
    /// ```
    pub fn queue_deadline(mut self, queue: impl Into<String>, after: Duration) -> Self {
        let queue = queue.into();
        let after = if after > MAX_QUEUE_DEADLINE {
            tracing::warn!(
                queue = %queue,
                requested = ?after,
                "queue_deadline capped at MAX_QUEUE_DEADLINE (100 years)"
            );
            MAX_QUEUE_DEADLINE
        } else {
            after
        };
        if let Some(created) = self.created_event() {
            created.deadlines.insert(queue, after);
        }
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
        let publisher = self.publisher;
        JetStreamPublisherBuilder {
            publisher: JetStreamPublisher {
                context: publisher.context,
                window: publisher.window,
                ack_timeout: publisher.ack_timeout,
                job_dispatch_timeout: publisher.job_dispatch_timeout,
                allowed_prefixes: publisher.allowed_prefixes,
                jobs: JobRoute::Dispatcher(dispatcher),
                startup_subjects: publisher.startup_subjects,
            },
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
        self.publisher.startup_subjects = subjects.into_iter().map(Into::into).collect();
        self
    }

    /// No job dispatch: every job row fails with a retryable error saying that no job
    /// dispatcher is configured, so it stays in the outbox (visible in `last_error`) until a
    /// publisher that can dispatch jobs runs. For services that must not create jobs from
    /// this process.
    pub fn no_job_dispatch(mut self) -> Self {
        self.publisher.jobs = JobRoute::Disabled;
        self
    }

    /// The publisher.
    pub fn build(self) -> JetStreamPublisher<D> {
        self.publisher
    }

    /// The `created` event settings, while job rows are still published as that event
    /// (after [`job_dispatcher`](Self::job_dispatcher) or
    /// [`no_job_dispatch`](Self::no_job_dispatch) they would never be used).
    fn created_event(&mut self) -> Option<&mut CreatedEventSettings> {
        match &mut self.publisher.jobs {
            JobRoute::CreatedEvent(settings) => Some(settings),
            JobRoute::Dispatcher(_) | JobRoute::Disabled => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_huge_queue_deadline_is_capped() {
        let client = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect("127.0.0.1:1")
            .await
            .expect("a lazy client");
        let publisher = JetStreamPublisher::builder(async_nats::jetstream::new(client))
            .queue_deadline("a", Duration::MAX)
            .queue_deadline("b", Duration::from_secs(60))
            .build();
        let JobRoute::CreatedEvent(settings) = &publisher.jobs else {
            panic!("created events expected");
        };
        assert_eq!(settings.deadlines["a"], MAX_QUEUE_DEADLINE);
        assert_eq!(settings.deadlines["b"], Duration::from_secs(60));
    }
}
