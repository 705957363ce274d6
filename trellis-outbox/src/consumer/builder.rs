//! Options of a [`Consumer`], binding or creating its JetStream consumer, and starting it.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::context::ConsumerInfoErrorKind;
use async_nats::jetstream::stream::{Config as StreamConfig, DiscardPolicy, Stream};
use serde::de::DeserializeOwned;
use sqlx::Pool;
use tokio_util::sync::CancellationToken;

use super::error::{ConsumeFailure, ConsumerError};
use super::run::{self, Settings, Shared, Stats};
use super::{ConsumerHandle, Handler};
use crate::dispatch::RetryPolicy;
use crate::driver::OutboxDatabase;
use crate::event::OutboxEvent;
use crate::outbox::Outbox;
use crate::setters::setters;

/// How many messages a consumer applies at once, by default.
pub const DEFAULT_CONSUMER_CONCURRENCY: usize = 16;
/// How many deliveries a message gets before it is dead-lettered, by default, when the
/// JetStream consumer itself sets no limit.
pub const DEFAULT_MAX_DELIVERIES: u32 = 5;
/// The ack wait of consumers created by [`ConsumerBuilder::create`], by default.
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
/// The stream dead letters go to (upstream Trellis' convention).
pub const DEAD_LETTER_STREAM: &str = "trellis_consumer_dlq";
/// The prefix of dead-letter subjects: `_trellis.consumer.dlq.<consumer>`.
pub const DEAD_LETTER_SUBJECT_PREFIX: &str = "_trellis.consumer.dlq";
/// The stream [`replay_dead_letters`](crate::replay_dead_letters) publishes to, read by the
/// consumer each replayed message is for only (upstream Trellis' name).
pub const REPLAY_STREAM: &str = "trellis_consumer_replays";
/// The prefix of replay subjects: `_trellis.consumer.replay.<consumer>.<dead-letter sequence>`.
pub const REPLAY_SUBJECT_PREFIX: &str = "_trellis.consumer.replay";

/// The description of the replay durable of the consumer of `stream`: which stream's
/// consumer it serves (durable names are unique per stream only).
pub(crate) fn replay_description(stream: &str) -> String {
    format!("trellis-outbox replays of a consumer of stream {stream}")
}

/// [`REPLAY_STREAM`]'s configuration, as upstream Trellis creates it: one message per subject
/// (each dead letter has a subject of its own), a second one refused while the first is
/// stored.
pub(crate) fn replay_stream_config() -> StreamConfig {
    StreamConfig {
        name: REPLAY_STREAM.into(),
        subjects: vec![format!("{REPLAY_SUBJECT_PREFIX}.>")],
        max_messages_per_subject: 1,
        discard: DiscardPolicy::New,
        discard_new_per_subject: true,
        ..StreamConfig::default()
    }
}

/// The most messages one consumer applies at once.
const MAX_CONCURRENCY: usize = 10_000;

pub(crate) type OnFailure = Arc<dyn Fn(&ConsumeFailure) + Send + Sync>;

/// Consumes events from JetStream exactly once into a database, with the inbox.
///
/// For each message: begin a transaction, record the message id in the inbox, run the
/// [`Handler`] (which writes the effects and may enqueue follow-up events in the same
/// transaction), commit, then acknowledge. A message whose id is already in the inbox is
/// acknowledged without running the handler. A handler error rolls everything back and asks
/// for a redelivery after a backoff; at the last delivery (or for a
/// [`HandlerError::permanent`](super::HandlerError::permanent) error) the message is copied to
/// the dead-letter subject `_trellis.consumer.dlq.<consumer>` (stream `trellis_consumer_dlq`)
/// with the error in a header, and terminated. A message without an id or whose payload is not
/// `E` is dead-lettered at once. A database out of reach spends no delivery: the message is
/// held in progress until the database answers the consumer's checks, then tried again
/// ([`FailureAction::WaitForDatabase`](super::FailureAction::WaitForDatabase)).
///
/// # Examples
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool, nats: async_nats::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use trellis_outbox::{Consumer, Delivered, OutboxEvent, OutboxTransactionExt, handler_fn};
///
/// #[derive(serde::Serialize, serde::Deserialize, OutboxEvent)]
/// #[outbox(name = "Orders.Shipped", subject = "events.v1.Orders.Shipped.{order_id}")]
/// struct OrderShipped { order_id: String }
///
/// let consumer = Consumer::builder(
///     async_nats::jetstream::new(nats),
///     pool,
///     handler_fn(|tx: &mut sqlx::Transaction<'static, sqlx::Postgres>, shipped: Delivered<OrderShipped>| {
///         Box::pin(async move {
///             sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
///                 .bind(&shipped.event.order_id)
///                 .execute(&mut **tx)
///                 .await?;
///             Ok(())
///         })
///     }),
/// )
/// .create("ORDERS", "billing") // the stream over `events.v1.Orders.Shipped.*` and a durable consumer
/// .concurrency(32)
/// .start()
/// .await?;
/// // … on shutdown: stop pulling, finish the messages in hand.
/// let report = consumer.shutdown().await?;
/// # let _ = report; Ok(()) }
/// ```
#[derive(Debug)]
pub struct Consumer {
    _private: (),
}

impl Consumer {
    /// Starts building a consumer that applies messages with `handler` in transactions on
    /// `pool`. Say which JetStream consumer with [`bind`](ConsumerBuilder::bind) or
    /// [`create`](ConsumerBuilder::create).
    pub fn builder<DB, E, H>(
        jetstream: Context,
        pool: Pool<DB>,
        handler: H,
    ) -> ConsumerBuilder<DB, E, H>
    where
        DB: OutboxDatabase,
        E: DeserializeOwned + Send + 'static,
        H: Handler<DB, E>,
    {
        ConsumerBuilder {
            jetstream,
            pool,
            handler,
            outbox: Outbox::default(),
            target: None,
            options: Options {
                concurrency: DEFAULT_CONSUMER_CONCURRENCY,
                max_deliveries: None,
                ack_wait: DEFAULT_ACK_WAIT,
                retry: RetryPolicy::new(),
                dead_letters: true,
                replays: true,
                keep_alive: true,
            },
            on_failure: None,
            _event: PhantomData,
        }
    }
}

#[derive(Debug, Clone)]
struct Target {
    stream: String,
    consumer: String,
    /// The filter subject to create the stream and consumer with; `None` binds existing ones.
    create: Option<String>,
}

/// The plain options of a consumer (see the setters of [`ConsumerBuilder`]).
#[derive(Debug, Clone)]
struct Options {
    concurrency: usize,
    max_deliveries: Option<u32>,
    ack_wait: Duration,
    retry: RetryPolicy,
    dead_letters: bool,
    replays: bool,
    keep_alive: bool,
}

/// Options of a [`Consumer`]; made by [`Consumer::builder`].
pub struct ConsumerBuilder<DB: OutboxDatabase, E, H> {
    jetstream: Context,
    pool: Pool<DB>,
    handler: H,
    outbox: Outbox,
    target: Option<Target>,
    options: Options,
    on_failure: Option<OnFailure>,
    _event: PhantomData<fn() -> E>,
}

impl<DB: OutboxDatabase, E, H> fmt::Debug for ConsumerBuilder<DB, E, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("target", &self.target)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<DB, E, H> ConsumerBuilder<DB, E, H>
where
    DB: OutboxDatabase,
    E: OutboxEvent + DeserializeOwned + Send + 'static,
    H: Handler<DB, E>,
{
    /// Creates, if they do not exist, the stream `stream` over the event's subjects (its
    /// subject template with `*` for each placeholder) and the durable pull consumer
    /// `consumer` on them (explicit ack, the [`ack_wait`](Self::ack_wait) and
    /// [`max_deliveries`](Self::max_deliveries) of this builder).
    pub fn create(mut self, stream: impl Into<String>, consumer: impl Into<String>) -> Self {
        self.target = Some(Target {
            stream: stream.into(),
            consumer: consumer.into(),
            create: Some(subject_filter(E::SUBJECT_TEMPLATE)),
        });
        self
    }
}

/// The subjects of a template: each `{placeholder}` token becomes `*`.
fn subject_filter(template: &str) -> String {
    template
        .split('.')
        .map(|token| {
            if token.starts_with('{') && token.ends_with('}') {
                "*"
            } else {
                token
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

impl<DB, E, H> ConsumerBuilder<DB, E, H>
where
    DB: OutboxDatabase,
    E: DeserializeOwned + Send + 'static,
    H: Handler<DB, E>,
{
    /// Consumes through the existing durable pull consumer `consumer` of stream `stream`
    /// (it must use explicit acks).
    pub fn bind(mut self, stream: impl Into<String>, consumer: impl Into<String>) -> Self {
        self.target = Some(Target {
            stream: stream.into(),
            consumer: consumer.into(),
            create: None,
        });
        self
    }

    setters! {
        /// The outbox whose inbox table records message ids (default: the `trellis_inbox`
        /// table). The inbox key is the message id alone: consumers that apply the same
        /// events for different purposes need an inbox each, or the second skips each
        /// message the first recorded as a duplicate. Replicas of one consumer share one.
        outbox(outbox: Outbox) => outbox;
        /// How many messages are applied at once (default [`DEFAULT_CONSUMER_CONCURRENCY`],
        /// 1 to 10,000). Each holds a database connection while it runs.
        concurrency(concurrency: usize) => options.concurrency;
        /// The ack wait of a consumer this builder [`create`](Self::create)s (default
        /// [`DEFAULT_ACK_WAIT`]). A bound consumer keeps its own.
        ack_wait(ack_wait: Duration) => options.ack_wait;
        /// The delays before redeliveries after failures: delivery `n` failing waits
        /// `policy.delay(n)` (default [`RetryPolicy::new`]: 1 s doubling to 5 min, ±20 %). Its
        /// attempt limit is not used: [`max_deliveries`](Self::max_deliveries) is.
        retry_policy(policy: RetryPolicy) => options.retry;
        /// Whether failed messages are copied to `_trellis.consumer.dlq.<consumer>` before
        /// they are terminated (default `true`; the stream `trellis_consumer_dlq` is created at
        /// start if missing). Off, they are only reported and terminated.
        dead_letters(enabled: bool) => options.dead_letters;
        /// Whether the consumer reads its replays (default `true`, with
        /// [`dead_letters`](Self::dead_letters) on): the messages
        /// [`replay_dead_letters`](crate::replay_dead_letters) hands back to it on
        /// `_trellis.consumer.replay.<consumer>.>`. At start it creates the stream
        /// `trellis_consumer_replays` if missing and creates (or updates) a durable of the
        /// consumer's name there; while running it deletes each replay it settled. Its NATS
        /// credentials need those rights (stream info and create, consumer create, message
        /// delete, pulls and acks on that stream). Off, no durable is made, and
        /// `replay_dead_letters` refuses to replay the consumer's dead letters while none
        /// exists (a durable left from an earlier start with replays on still takes them:
        /// delete it when the consumer is retired). A consumer of the same name on another
        /// stream cannot have replays on too: the durable serves one stream's consumer.
        replays(enabled: bool) => options.replays;
        /// Whether a handler that runs long tells JetStream it is still working (an
        /// in-progress ack every half ack wait, from the moment the message is started:
        /// waiting for a pool connection or for the inbox row's lock counts), so the message
        /// is not redelivered meanwhile (default `true`). A redelivery would find the inbox row once this one commits, so
        /// turning it off costs work, not correctness.
        keep_alive(enabled: bool) => options.keep_alive;
    }

    /// How many deliveries a message gets before it is dead-lettered. Default: one less than
    /// the JetStream consumer's `max_deliver` (at least 1), or [`DEFAULT_MAX_DELIVERIES`]
    /// when it sets none; more than the consumer's `max_deliver` is refused (the server would
    /// stop delivering first). A durable this consumer creates gets `max_deliver` one above
    /// this. The spare delivery matters: a delivery can be spent without an attempt (pulled
    /// ahead of a free handler slot and expired, or dropped at shutdown), and a message whose
    /// last server delivery is spent so is never delivered again, copied or reported.
    pub fn max_deliveries(mut self, deliveries: u32) -> Self {
        self.options.max_deliveries = Some(deliveries);
        self
    }

    /// Called with every message that failed (after it is logged with `tracing`).
    pub fn on_error(mut self, f: impl Fn(&ConsumeFailure) + Send + Sync + 'static) -> Self {
        self.on_failure = Some(Arc::new(f));
        self
    }

    /// Binds or creates the JetStream consumer (and, with dead letters on, the dead-letter
    /// stream, and with [`replays`](Self::replays) the replay stream and its durable), then
    /// starts consuming on a tokio task.
    ///
    /// # Errors
    ///
    /// [`ConsumerError::InvalidOptions`] for options out of range or no `bind`/`create`;
    /// [`ConsumerError::Stream`] / [`ConsumerError::Consumer`] when JetStream cannot be
    /// reached or refuses (credentials without the rights [`replays`](Self::replays) needs:
    /// turn replays off); [`ConsumerError::Unsuitable`] for a consumer without explicit acks,
    /// or a replay durable whose `max_deliver` could not be raised above `max_deliveries`.
    pub async fn start(self) -> Result<ConsumerHandle, ConsumerError> {
        let target = self.target.clone().ok_or(ConsumerError::InvalidOptions {
            option: "bind/create",
            problem: "say which JetStream consumer to use with `bind(stream, consumer)` or \
                      `create(stream, consumer)`"
                .into(),
        })?;
        if !(1..=MAX_CONCURRENCY).contains(&self.options.concurrency) {
            return Err(ConsumerError::InvalidOptions {
                option: "concurrency",
                problem: format!(
                    "must be 1 to {MAX_CONCURRENCY}, got {}",
                    self.options.concurrency
                ),
            });
        }
        if self.options.max_deliveries == Some(0) {
            return Err(ConsumerError::InvalidOptions {
                option: "max_deliveries",
                problem: "must be at least 1".into(),
            });
        }
        if self.options.ack_wait < Duration::from_millis(100) {
            return Err(ConsumerError::InvalidOptions {
                option: "ack_wait",
                problem: format!("must be at least 100 ms, got {:?}", self.options.ack_wait),
            });
        }
        self.options
            .retry
            .validate()
            .map_err(|err| ConsumerError::InvalidOptions {
                option: "retry_policy",
                problem: err.to_string(),
            })?;
        let consumer = self.consumer(&target).await?;
        let config = &consumer.cached_info().config;
        if config.ack_policy != AckPolicy::Explicit {
            return Err(ConsumerError::Unsuitable {
                stream: target.stream,
                consumer: target.consumer,
                problem: format!(
                    "its ack policy is {:?}; it needs explicit acks",
                    config.ack_policy
                ),
            });
        }
        let server_limit = u32::try_from(config.max_deliver).ok().filter(|n| *n > 0);
        let max_deliveries = match (self.options.max_deliveries, server_limit) {
            (Some(ours), Some(server)) if ours > server => {
                return Err(ConsumerError::InvalidOptions {
                    option: "max_deliveries",
                    problem: format!(
                        "{ours} is more than the JetStream consumer's max_deliver of {server}"
                    ),
                });
            }
            (Some(ours), _) => ours,
            (None, Some(server)) => server.saturating_sub(1).max(1),
            (None, None) => DEFAULT_MAX_DELIVERIES,
        };
        let progress_every = (config.ack_wait / 2).max(Duration::from_millis(50));
        let keep_alive = self.options.keep_alive.then_some(progress_every);
        let (dead_letter_subject, replays) = if self.options.dead_letters {
            self.dead_letter_stream().await?;
            let replays = match self.options.replays {
                true => Some(
                    self.replay_durable(&target, config.ack_wait, max_deliveries)
                        .await?,
                ),
                false => None,
            };
            (
                Some(format!("{DEAD_LETTER_SUBJECT_PREFIX}.{}", target.consumer)),
                replays,
            )
        } else {
            (None, None)
        };
        let stats = Arc::new(Stats::default());
        let cancel = CancellationToken::new();
        let client = self.jetstream.client();
        let shared = Arc::new(Shared {
            pool: self.pool,
            handler: self.handler,
            outbox: self.outbox,
            jetstream: self.jetstream,
            consumer_name: target.consumer,
            replay_stream: replays.as_ref().map(|(_, stream)| stream.clone()),
            settings: Settings {
                max_deliveries,
                retry: self.options.retry,
                dead_letter_subject,
                keep_alive,
                progress_every,
            },
            on_failure: self.on_failure,
            stats: stats.clone(),
            cancel: cancel.clone(),
            _event: PhantomData,
        });
        let task = tokio::spawn(run::run(
            shared,
            consumer,
            replays.map(|(consumer, _)| consumer),
            self.options.concurrency,
            cancel.clone(),
        ));
        Ok(ConsumerHandle::new(cancel, task, stats, client))
    }

    async fn consumer(&self, target: &Target) -> Result<PullConsumer, ConsumerError> {
        let consumer_error = |source: async_nats::Error| ConsumerError::Consumer {
            stream: target.stream.clone(),
            consumer: target.consumer.clone(),
            source,
        };
        let stream_error = |source: async_nats::Error| ConsumerError::Stream {
            stream: target.stream.clone(),
            source,
        };
        match &target.create {
            None => self
                .jetstream
                .get_consumer_from_stream::<PullConfig, _, _>(&target.consumer, &target.stream)
                .await
                .map_err(|e| consumer_error(e.into())),
            Some(filter) => {
                let stream = self
                    .jetstream
                    .get_or_create_stream(StreamConfig {
                        name: target.stream.clone(),
                        subjects: vec![filter.clone()],
                        ..StreamConfig::default()
                    })
                    .await
                    .map_err(|e| stream_error(e.into()))?;
                // One spare delivery beyond ours (see `max_deliveries`).
                let max_deliver = self
                    .options
                    .max_deliveries
                    .map_or(i64::from(DEFAULT_MAX_DELIVERIES), i64::from)
                    + 1;
                stream
                    .get_or_create_consumer(
                        &target.consumer,
                        PullConfig {
                            durable_name: Some(target.consumer.clone()),
                            filter_subject: filter.clone(),
                            ack_policy: AckPolicy::Explicit,
                            ack_wait: self.options.ack_wait,
                            max_deliver,
                            ..PullConfig::default()
                        },
                    )
                    .await
                    .map_err(|e| consumer_error(e.into()))
            }
        }
    }

    /// Creates, if they do not exist, [`REPLAY_STREAM`] and the durable `consumer` on it that
    /// reads this consumer's replays (explicit ack, `ack_wait` and one delivery more than
    /// `max_deliveries`, as the consumers [`create`](Self::create) makes).
    async fn replay_durable(
        &self,
        target: &Target,
        ack_wait: Duration,
        max_deliveries: u32,
    ) -> Result<(PullConsumer, Stream), ConsumerError> {
        let consumer = target.consumer.as_str();
        let filter = super::dead_letters::replay_filter(consumer)?;
        let stream = self
            .jetstream
            .get_or_create_stream(replay_stream_config())
            .await
            .map_err(|e| ConsumerError::Stream {
                stream: REPLAY_STREAM.into(),
                source: e.into(),
            })?;
        let unsuitable = |problem: String| ConsumerError::Unsuitable {
            stream: REPLAY_STREAM.into(),
            consumer: consumer.to_owned(),
            problem,
        };
        // Durable names are unique per stream only: a consumer of the same name on another
        // stream must not read (and apply) this one's replays, nor this one its.
        let description = replay_description(&target.stream);
        match stream.consumer_info(consumer).await {
            Ok(info) => {
                if let Some(other) = info
                    .config
                    .description
                    .as_deref()
                    .filter(|other| *other != description)
                {
                    return Err(unsuitable(format!(
                        "it is the replay durable of another consumer of that name ({other:?}); \
                         give one of them another name, or start this one with replays off"
                    )));
                }
            }
            Err(error) if matches!(error.kind(), ConsumerInfoErrorKind::NotFound) => {}
            Err(error) => {
                return Err(ConsumerError::Consumer {
                    stream: REPLAY_STREAM.into(),
                    consumer: consumer.to_owned(),
                    source: error.into(),
                });
            }
        }
        // Created or brought up to date: a durable left by an earlier start with fewer
        // deliveries would give up on a replay before this consumer does.
        let durable = stream
            .create_consumer(PullConfig {
                durable_name: Some(consumer.to_owned()),
                description: Some(description),
                filter_subject: filter,
                ack_policy: AckPolicy::Explicit,
                ack_wait,
                max_deliver: i64::from(max_deliveries) + 1,
                ..PullConfig::default()
            })
            .await
            .map_err(|e| ConsumerError::Consumer {
                stream: REPLAY_STREAM.into(),
                consumer: consumer.to_owned(),
                source: e.into(),
            })?;
        let config = &durable.cached_info().config;
        if config.ack_policy != AckPolicy::Explicit {
            return Err(unsuitable(format!(
                "its ack policy is {:?}; it needs explicit acks",
                config.ack_policy
            )));
        }
        if config.max_deliver > 0 && config.max_deliver <= i64::from(max_deliveries) {
            return Err(unsuitable(format!(
                "its max_deliver of {} is not above max_deliveries ({max_deliveries}), and it \
                 could not be raised",
                config.max_deliver
            )));
        }
        Ok((durable, stream))
    }

    async fn dead_letter_stream(&self) -> Result<(), ConsumerError> {
        self.jetstream
            .get_or_create_stream(StreamConfig {
                name: DEAD_LETTER_STREAM.into(),
                subjects: vec![format!("{DEAD_LETTER_SUBJECT_PREFIX}.>")],
                ..StreamConfig::default()
            })
            .await
            .map(|_| ())
            .map_err(|e| ConsumerError::Stream {
                stream: DEAD_LETTER_STREAM.into(),
                source: e.into(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::subject_filter;

    #[test]
    fn placeholders_become_wildcards() {
        assert_eq!(
            subject_filter("events.v1.Orders.Shipped.{order_id}"),
            "events.v1.Orders.Shipped.*"
        );
        assert_eq!(subject_filter("a.{x}.b.{y}"), "a.*.b.*");
        assert_eq!(subject_filter("plain.subject"), "plain.subject");
    }
}
