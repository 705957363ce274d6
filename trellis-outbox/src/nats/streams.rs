//! The start-up stream check: does a JetStream stream capture each subject the outbox
//! publishes to, with a duplicate window long enough for re-publishes to stay de-duplicated?

use std::time::Duration;

use super::jobs::JobDispatcher;
use super::publisher::JetStreamPublisher;
use crate::dispatch::{BoxError, RetryPolicy};

/// How long the start-up stream check may delay the first drain.
const STARTUP_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

impl<D: JobDispatcher> JetStreamPublisher<D> {
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

    /// The check of [`check_streams_at_start`](super::JetStreamPublisherBuilder::check_streams_at_start):
    /// logs what it finds and never stops the dispatcher.
    pub(super) async fn check_streams_at_start(&self, retry_policy: &RetryPolicy) {
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
            // The whole chain: a `Lookup` error's async-nats source is not in its Display.
            Ok(Err(error)) => tracing::error!(
                error = %crate::chain::error_chain(&error),
                "outbox stream check failed at start"
            ),
            Err(_) => tracing::warn!(
                timeout = ?STARTUP_CHECK_TIMEOUT,
                "outbox stream check did not finish in time; dispatching anyway"
            ),
        }
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

/// `subjects` in backticks, comma-separated, for error messages.
pub(super) fn quoted(subjects: &[String]) -> String {
    subjects
        .iter()
        .map(|s| format!("`{s}`"))
        .collect::<Vec<_>>()
        .join(", ")
}
