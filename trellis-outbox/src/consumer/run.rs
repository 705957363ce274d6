//! The consuming task: pull, apply each message in its own transaction, acknowledge.

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::message::{AckKind, Message};
use futures_util::{FutureExt as _, StreamExt as _};
use serde::de::DeserializeOwned;
use sqlx::Pool;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::error::{ConsumeFailure, ConsumerError, FailureAction, FailureKind};
use super::{ConsumerReport, Delivered, Handler};
use crate::dispatch::{RetryPolicy, panic_message};
use crate::driver::OutboxDatabase;
use crate::outbox::Outbox;
use crate::record::{InboxReceipt, NATS_MSG_ID, TRELLIS_EVENT_TIME};
use crate::time::parse_timestamp;

/// Headers a dead-letter copy carries besides the message's own.
pub mod dead_letter_headers {
    /// The error that ended the message (one line, at most 4 KiB).
    pub const ERROR: &str = "Trellis-Dlq-Error";
    /// What failed: `MissingId`, `Undecodable`, `Handler`, `Panic`, `Database`.
    pub const KIND: &str = "Trellis-Dlq-Kind";
    /// The consumer that gave up.
    pub const CONSUMER: &str = "Trellis-Dlq-Consumer";
    /// The stream the message is in.
    pub const STREAM: &str = "Trellis-Dlq-Stream";
    /// Its sequence there.
    pub const STREAM_SEQUENCE: &str = "Trellis-Dlq-Stream-Sequence";
    /// The subject it was published to (a replay hands the message its subject back).
    pub const SUBJECT: &str = "Trellis-Dlq-Subject";
    /// How many deliveries it had.
    pub const DELIVERIES: &str = "Trellis-Dlq-Deliveries";
    /// Its `Nats-Msg-Id`, when it had one.
    pub const MESSAGE_ID: &str = "Trellis-Dlq-Msg-Id";
}

/// The longest error text a dead-letter header holds.
const MAX_ERROR_HEADER: usize = 4096;
/// How long publishing a dead-letter copy may take.
const DEAD_LETTER_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest pause between two checks of a database out of reach: the retry policy's
/// delays grow to minutes, but a database that is back should be used soon.
const MAX_DATABASE_WAIT: Duration = Duration::from_secs(10);
/// The shortest: every held message checks on its own, and a server refusing connections
/// should not get one from each of them every few milliseconds.
const MIN_DATABASE_WAIT: Duration = Duration::from_secs(1);
/// How long one check (a connection and a ping) may take.
const DATABASE_CHECK_TIMEOUT: Duration = Duration::from_secs(10);
/// The pause after a pull error before pulling again.
const PULL_RETRY: Duration = Duration::from_millis(500);

/// Counters of a running consumer.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    applied: AtomicU64,
    duplicates: AtomicU64,
    redelivered: AtomicU64,
    dead_lettered: AtomicU64,
    terminated: AtomicU64,
    database_waits: AtomicU64,
    abandoned: AtomicU64,
    /// Messages whose task has started and not yet ended.
    in_hand: AtomicU64,
}

impl Stats {
    /// How many messages are being applied now.
    pub(crate) fn in_hand(&self) -> u64 {
        self.in_hand.load(Ordering::Acquire)
    }

    pub(crate) fn report(&self) -> ConsumerReport {
        ConsumerReport {
            applied: self.applied.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            redelivered: self.redelivered.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            terminated: self.terminated.load(Ordering::Relaxed),
            database_waits: self.database_waits.load(Ordering::Relaxed),
            abandoned: self.abandoned.load(Ordering::Relaxed),
        }
    }
}

tokio::task_local! {
    /// Set by [`Stats::settle`] in a message's task: the message was counted as settled.
    static SETTLED: Arc<AtomicBool>;
}

/// Counts one message task in hand while it lives; dropped before its message was settled
/// (the task was aborted by
/// [`ConsumerHandle::shutdown_timeout`](super::ConsumerHandle::shutdown_timeout)), it counts
/// the message abandoned. A task aborted while it acknowledges a settled message is not
/// counted twice.
struct InHand {
    stats: Arc<Stats>,
    settled: Arc<AtomicBool>,
}

impl InHand {
    fn new(stats: Arc<Stats>) -> Self {
        stats.in_hand.fetch_add(1, Ordering::AcqRel);
        Self {
            stats,
            settled: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Runs `work` (the message's processing) where [`Stats::settle`] can mark it settled.
    async fn track<F: Future<Output = ()>>(&self, work: F) {
        SETTLED.scope(self.settled.clone(), work).await;
    }
}

impl Drop for InHand {
    fn drop(&mut self) {
        if !self.settled.load(Ordering::Acquire) {
            bump(&self.stats.abandoned);
        }
        self.stats.in_hand.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How a message was settled, counted in [`Stats`] and in the
/// [`CONSUMED`](crate::metrics::CONSUMED) metric.
#[derive(Debug, Clone, Copy)]
enum Settled {
    Applied,
    Duplicate,
    Redelivered,
    DeadLettered,
    Terminated,
}

impl Stats {
    fn settle(&self, consumer: &str, how: Settled) {
        let (counter, outcome) = match how {
            Settled::Applied => (&self.applied, "applied"),
            Settled::Duplicate => (&self.duplicates, "duplicate"),
            Settled::Redelivered => (&self.redelivered, "redelivered"),
            Settled::DeadLettered => (&self.dead_lettered, "dead_lettered"),
            Settled::Terminated => (&self.terminated, "terminated"),
        };
        bump(counter);
        // Outside a message's task (none today) there is nothing to mark.
        let _ = SETTLED.try_with(|settled| settled.store(true, Ordering::Release));
        metrics::counter!(
            crate::metrics::CONSUMED,
            "consumer" => consumer.to_owned(),
            "outcome" => outcome
        )
        .increment(1);
    }
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// The options a running consumer applies, resolved at start.
#[derive(Debug)]
pub(crate) struct Settings {
    /// The delivery at which a failing message is given up.
    pub(crate) max_deliveries: u32,
    pub(crate) retry: RetryPolicy,
    /// Where dead letters go, when they are enabled.
    pub(crate) dead_letter_subject: Option<String>,
    /// How often an in-progress ack is sent while a handler runs, if at all.
    pub(crate) keep_alive: Option<Duration>,
    /// How often an in-progress ack is sent while waiting for the database (half the ack
    /// wait), whether or not `keep_alive` is on: the wait must not spend a delivery.
    pub(crate) progress_every: Duration,
}

impl Settings {
    /// Whether a message failing at `delivery` gets another one.
    fn redelivers(&self, delivery: u64) -> bool {
        delivery < u64::from(self.max_deliveries)
    }

    /// The delay before the redelivery after `delivery` failed.
    fn delay_after(&self, delivery: u64) -> Duration {
        self.retry
            .delay(u32::try_from(delivery).unwrap_or(u32::MAX))
    }
}

/// What every message task shares.
pub(crate) struct Shared<DB: OutboxDatabase, E, H> {
    pub(crate) pool: Pool<DB>,
    pub(crate) handler: H,
    pub(crate) outbox: Outbox,
    pub(crate) jetstream: Context,
    pub(crate) consumer_name: String,
    /// [`REPLAY_STREAM`](super::REPLAY_STREAM), when dead letters are on: replays are deleted
    /// from it once settled.
    pub(crate) replay_stream: Option<async_nats::jetstream::stream::Stream>,
    pub(crate) settings: Settings,
    pub(crate) on_failure: Option<super::builder::OnFailure>,
    pub(crate) stats: Arc<Stats>,
    /// Cancelled by `shutdown`: ends a wait for the database.
    pub(crate) cancel: CancellationToken,
    pub(crate) _event: PhantomData<fn() -> E>,
}

/// A message stream on `consumer` within its cached limits. It pulls no more than can be
/// worked on (a pulled message's ack wait is running), nor more than the consumer allows per
/// pull (`max_batch`, set by whoever created it): the server refuses a larger pull, and
/// async-nats then ends the message stream.
async fn pull(
    consumer: &PullConsumer,
    concurrency: usize,
) -> Result<
    async_nats::jetstream::consumer::pull::Stream,
    async_nats::jetstream::consumer::StreamError,
> {
    let batch = match usize::try_from(consumer.cached_info().config.max_batch) {
        Ok(max) if max > 0 => concurrency.min(max),
        _ => concurrency,
    };
    consumer
        .stream()
        .max_messages_per_batch(batch)
        .messages()
        .await
}

/// Pulls from `consumer` (and from `replays`, the consumer's durable on the replay stream,
/// when dead letters are on) until cancelled, at most `concurrency` messages in hand from
/// both; then waits for those. The two are pulled by separate loops that share the slots, so
/// that a replay stream in trouble never holds up the consumer's own.
pub(crate) async fn run<DB, E, H>(
    shared: Arc<Shared<DB, E, H>>,
    consumer: PullConsumer,
    replays: Option<PullConsumer>,
    concurrency: usize,
    cancel: CancellationToken,
) -> Result<(), ConsumerError>
where
    DB: OutboxDatabase,
    E: DeserializeOwned + Send + 'static,
    H: Handler<DB, E>,
{
    let own = Pulled::start(consumer, Source::Stream, concurrency, &shared).await?;
    let replayed = match replays {
        // Replays are rare: pulled one at a time.
        Some(replays) => Some(Pulled::start(replays, Source::Replays, 1, &shared).await?),
        None => None,
    };
    let permits = Arc::new(Semaphore::new(concurrency));
    let from_replays = async {
        if let Some(replayed) = replayed {
            replayed.run(&shared, &permits, &cancel).await;
        }
    };
    tokio::join!(own.run(&shared, &permits, &cancel), from_replays);
    // Acks, naks and terms are only queued on the connection: send them before `shutdown`
    // returns, or a process exiting right after it loses them (a lost term dead-letters the
    // message again).
    if let Err(err) = shared.jetstream.client().flush().await {
        tracing::warn!(consumer = %shared.consumer_name, error = %err, "flushing the last acknowledgements failed");
    }
    Ok(())
}

/// Where a message was pulled from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// The consumer's own stream.
    Stream,
    /// Its durable on [`REPLAY_STREAM`](super::REPLAY_STREAM): a dead letter replayed.
    Replays,
}

/// A durable pulled from: the consumer, its message stream and how many messages it pulls at
/// once.
struct Pulled {
    consumer: PullConsumer,
    messages: async_nats::jetstream::consumer::pull::Stream,
    from: Source,
    batch: usize,
}

/// The longest pause between two tries to pull again after the message stream ended.
const MAX_PULL_RETRY: Duration = Duration::from_secs(30);

impl Pulled {
    async fn start<DB: OutboxDatabase, E, H>(
        consumer: PullConsumer,
        from: Source,
        batch: usize,
        shared: &Shared<DB, E, H>,
    ) -> Result<Self, ConsumerError> {
        let messages = pull(&consumer, batch)
            .await
            .map_err(|e| ConsumerError::Pull {
                consumer: match from {
                    Source::Stream => shared.consumer_name.clone(),
                    Source::Replays => format!(
                        "{} (its replays, stream {})",
                        shared.consumer_name,
                        super::REPLAY_STREAM
                    ),
                },
                source: e.into(),
            })?;
        Ok(Self {
            consumer,
            messages,
            from,
            batch,
        })
    }

    /// Pulls until cancelled, each message applied on a task of its own once one of
    /// `permits` is free (taken after the message arrived: a loop waiting for messages holds
    /// no slot); then waits for its tasks.
    async fn run<DB, E, H>(
        mut self,
        shared: &Arc<Shared<DB, E, H>>,
        permits: &Arc<Semaphore>,
        cancel: &CancellationToken,
    ) where
        DB: OutboxDatabase,
        E: DeserializeOwned + Send + 'static,
        H: Handler<DB, E>,
    {
        let from = self.from;
        let mut tasks = JoinSet::new();
        let mut pause = PULL_RETRY;
        // When the current message stream began: one that lasted resets the back-off.
        let mut since = tokio::time::Instant::now();
        loop {
            let next = tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                next = self.messages.next() => next,
            };
            match next {
                Some(Ok(message)) => {
                    let permit = tokio::select! {
                        biased;
                        // Not started: the server redelivers it after its ack wait.
                        () = cancel.cancelled() => break,
                        permit = permits.clone().acquire_owned() => match permit {
                            Ok(permit) => permit,
                            Err(_) => break,
                        },
                    };
                    let shared = shared.clone();
                    let in_hand = InHand::new(shared.stats.clone());
                    tasks.spawn(async move {
                        in_hand.track(process(&shared, message, from)).await;
                        drop(in_hand);
                        drop(permit);
                    });
                }
                Some(Err(err)) => {
                    tracing::warn!(consumer = %shared.consumer_name, ?from, error = %err, "pulling messages failed; pulling again");
                    tokio::select! {
                        biased;
                        () = cancel.cancelled() => break,
                        () = tokio::time::sleep(PULL_RETRY) => {}
                    }
                }
                // async-nats ends the stream for good after some server replies (the consumer
                // was deleted or is push based, a pull it refused) and when the client closes.
                // Ending here would stop consuming while the handle reports nothing: start a
                // new stream instead, as often as it takes (backing off to 30 s), saying so
                // each time.
                None => {
                    tracing::error!(consumer = %shared.consumer_name, ?from, "the message stream ended; starting a new one");
                    if since.elapsed() > MAX_PULL_RETRY {
                        pause = PULL_RETRY;
                    }
                    tokio::select! {
                        biased;
                        () = cancel.cancelled() => break,
                        () = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(MAX_PULL_RETRY);
                    self.restart(shared).await;
                    since = tokio::time::Instant::now();
                }
            }
            while tasks.try_join_next().is_some() {}
        }
        // Messages pulled but not started are redelivered by the server after their ack wait.
        drop(self.messages);
        while let Some(joined) = tasks.join_next().await {
            if let Err(err) = joined {
                tracing::error!(consumer = %shared.consumer_name, error = %err, "a message task ended abnormally");
            }
        }
    }

    /// A new message stream after the last one ended.
    async fn restart<DB: OutboxDatabase, E, H>(&mut self, shared: &Shared<DB, E, H>) {
        let from = self.from;
        // The durable may have been replaced with other limits (`max_batch`, `max_expires`):
        // pulling with the old ones would be refused again, forever.
        if let Err(err) = self.consumer.info().await {
            tracing::warn!(consumer = %shared.consumer_name, ?from, error = %err, "cannot read the consumer's settings; pulling with the last known ones");
        }
        match pull(&self.consumer, self.batch).await {
            Ok(fresh) => self.messages = fresh,
            Err(err) => {
                tracing::error!(consumer = %shared.consumer_name, ?from, error = %err, "cannot pull messages; trying again");
            }
        }
    }
}

/// `headers` (every value of each) without those whose name starts with one of `prefixes`,
/// in any letter case.
pub(super) fn headers_without(headers: &HeaderMap, prefixes: &[&str]) -> HeaderMap {
    let mut kept = HeaderMap::new();
    for (name, values) in headers.iter() {
        let name_text: &str = name.as_ref();
        let dropped = prefixes.iter().any(|prefix| {
            name_text
                .get(..prefix.len())
                .is_some_and(|start| start.eq_ignore_ascii_case(prefix))
        });
        if dropped {
            continue;
        }
        for value in values {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
}

/// Where one message stands.
struct Origin<'m> {
    message: &'m Message,
    id: Option<String>,
    /// The subject the message was published to (a replay's is in its headers).
    subject: String,
    /// Where it was pulled from.
    from: Source,
    /// The stream the message was published to and its sequence there (a replay's are in
    /// its headers).
    original: (String, u64),
    /// The stream it was pulled from (for a replay: the replay stream) and its sequence
    /// there.
    stream: String,
    stream_sequence: u64,
    delivery: u64,
}

/// Why applying failed.
struct Failure {
    kind: FailureKind,
    error: String,
    retryable: bool,
    /// The database could not be reached: not the message's fault, so it is tried again in
    /// place rather than spending a delivery.
    unavailable: bool,
}

impl Failure {
    fn new(kind: FailureKind, error: String, retryable: bool) -> Self {
        Self {
            kind,
            error,
            retryable,
            unavailable: false,
        }
    }

    /// A database failure; `unavailable` when the cause is the database being out of reach.
    fn database(err: &(dyn std::error::Error + 'static)) -> Self {
        Self {
            unavailable: database_unavailable(err),
            ..Self::new(FailureKind::Database, crate::chain::error_chain(err), true)
        }
    }
}

/// Whether `err` or one of its causes is a driver error saying the database is out of reach.
fn database_unavailable(err: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(err), |err| err.source()).any(|err| {
        err.downcast_ref::<sqlx::Error>()
            .is_some_and(crate::error::sqlx_is_unavailable)
    })
}

enum Applied {
    Committed,
    Duplicate,
}

/// Applies one message and settles it; a replay is then deleted from the replay stream.
async fn process<DB, E, H>(shared: &Shared<DB, E, H>, message: Message, from: Source)
where
    DB: OutboxDatabase,
    E: DeserializeOwned + Send + 'static,
    H: Handler<DB, E>,
{
    let done = settle_message(shared, &message, from).await;
    if from == Source::Replays
        && done
        && let Some(replays) = &shared.replay_stream
        && let Ok(info) = message.info()
    {
        // Best effort: a replay left behind is only stored, never delivered again.
        if let Err(err) = replays.delete_message(info.stream_sequence).await {
            tracing::warn!(consumer = %shared.consumer_name, error = %err, "could not delete a settled replay (it stays stored, never delivered again)");
        }
    }
}

/// Applies `message` and acknowledges, naks or terminates it; `true` if it is done with and
/// held nowhere else but where it came from: applied (or a duplicate), or copied to the dead
/// letters. Not when it will be delivered again, nor when it was terminated without a copy.
async fn settle_message<DB, E, H>(
    shared: &Shared<DB, E, H>,
    message: &Message,
    from: Source,
) -> bool
where
    DB: OutboxDatabase,
    E: DeserializeOwned + Send + 'static,
    H: Handler<DB, E>,
{
    let (stream, stream_sequence, delivery) = match message.info() {
        Ok(info) => (
            info.stream.to_owned(),
            info.stream_sequence,
            u64::try_from(info.delivered).unwrap_or(1).max(1),
        ),
        Err(_) => (String::new(), 0, 1),
    };
    let mut headers = first_values(message.headers.as_ref());
    // A replay carries the message's id, subject and stream sequence in its copy's headers;
    // the handler sees the message as it was.
    let (id_header, subject, original) = match from {
        Source::Stream => (
            NATS_MSG_ID,
            message.subject.to_string(),
            (stream.clone(), stream_sequence),
        ),
        Source::Replays => {
            use dead_letter_headers as h;
            let subject = headers
                .get(h::SUBJECT)
                .cloned()
                .unwrap_or_else(|| message.subject.to_string());
            let original = match (
                headers.get(h::STREAM),
                headers
                    .get(h::STREAM_SEQUENCE)
                    .and_then(|sequence| sequence.parse().ok()),
            ) {
                (Some(stream), Some(sequence)) => (stream.clone(), sequence),
                _ => (stream.clone(), stream_sequence),
            };
            (h::MESSAGE_ID, subject, original)
        }
    };
    let original_sequence = original.1;
    let id = headers
        .get(id_header)
        .filter(|id| crate::wire::id_problem(id).is_none())
        .cloned();
    if from == Source::Replays {
        as_replayed(&mut headers, id.as_deref());
    }
    let mut at = Origin {
        message,
        id: id.clone(),
        subject: subject.clone(),
        from,
        original,
        stream,
        stream_sequence,
        delivery,
    };
    let Some(id) = id else {
        let failure = Failure::new(
            FailureKind::MissingId,
            "the message has no usable Nats-Msg-Id header, so it cannot be deduplicated".into(),
            false,
        );
        return give_up(shared, &mut at, failure).await;
    };
    let time = headers
        .get(TRELLIS_EVENT_TIME)
        .and_then(|time| parse_timestamp(time).ok());
    // Whether this delivery was already held for a database outage.
    let mut held = false;
    let mut headers = Some(headers);
    let applied = loop {
        // Decoded for each attempt: the handler takes the event, and an attempt the database
        // turned away is made again once it answers.
        let event: E = match decode(message) {
            Ok(event) => event,
            Err(failure) => return give_up(shared, &mut at, failure).await,
        };
        let delivered = Delivered {
            event,
            id: id.clone(),
            time,
            subject: subject.clone(),
            headers: headers.take().unwrap_or_else(|| {
                let mut headers = first_values(message.headers.as_ref());
                if from == Source::Replays {
                    as_replayed(&mut headers, Some(&id));
                }
                headers
            }),
            delivery,
            stream_sequence: original_sequence,
            replayed: from == Source::Replays,
        };
        let span = consume_span(&shared.consumer_name, &delivered);
        let started = std::time::Instant::now();
        // Once held, the message is kept in progress whatever `keep_alive` says (the hold
        // must not cost a delivery), and shutdown does not wait for the attempt either.
        let keep_alive = match held {
            true => Some(shared.settings.progress_every),
            false => shared.settings.keep_alive,
        };
        let attempt = apply(shared, message, &id, delivered, keep_alive).instrument(span);
        let applied = if held {
            tokio::select! {
                biased;
                () = shared.cancel.cancelled() => Err(Failure::new(
                    FailureKind::Database,
                    "shut down while trying the message again after a database outage".into(),
                    true,
                )),
                applied = attempt => applied,
            }
        } else {
            attempt.await
        };
        metrics::histogram!(crate::metrics::HANDLE_SECONDS, "consumer" => shared.consumer_name.clone())
            .record(started.elapsed().as_secs_f64());
        match applied {
            // A database out of reach is not the message's fault: redelivering would spend
            // its deliveries and, over a long enough outage, dead-letter healthy messages.
            // If the database does not answer the consumer either, hold the message (in
            // progress, so the server does not redeliver it) until it does, then try again.
            // Once per delivery: an attempt that finds it gone again right after it came back
            // (a statement that crashes the server, say) spends the delivery as usual.
            Err(failure)
                if failure.unavailable
                    && !held
                    && !shared.cancel.is_cancelled()
                    && !database_answers(shared, message).await =>
            {
                held = true;
                bump(&shared.stats.database_waits);
                report(shared, &at, &failure, FailureAction::WaitForDatabase);
                if !wait_for_database(shared, message).await {
                    // Shut down meanwhile: settled as any failed delivery.
                    break Err(failure);
                }
                tracing::info!(consumer = %shared.consumer_name, id = %id, "the database answers again; trying the message again");
            }
            applied => break applied,
        }
    };
    match applied {
        Ok(applied) => {
            match applied {
                Applied::Committed => shared.stats.settle(&shared.consumer_name, Settled::Applied),
                Applied::Duplicate => shared
                    .stats
                    .settle(&shared.consumer_name, Settled::Duplicate),
            }
            if let Err(err) = message.ack().await {
                let failure =
                    Failure::new(FailureKind::Ack, crate::chain::error_chain(&*err), true);
                report(shared, &at, &failure, FailureAction::None);
            }
            true
        }
        Err(failure) if failure.retryable && shared.settings.redelivers(delivery) => {
            let after = shared.settings.delay_after(delivery);
            redeliver(shared, &at, &failure, after).await;
            false
        }
        Err(failure) => give_up(shared, &mut at, failure).await,
    }
}

/// The headers a handler sees of a replay: the message's own, without the dead-letter copy's
/// `Trellis-Dlq-*` ones, with the message's id as `Nats-Msg-Id` (the replay's own id is not
/// the message's).
fn as_replayed(headers: &mut BTreeMap<String, String>, id: Option<&str>) {
    const COPY: &str = "Trellis-Dlq-";
    headers.retain(|name, _| {
        !name
            .get(..COPY.len())
            .is_some_and(|start| start.eq_ignore_ascii_case(COPY))
    });
    headers.retain(|name, _| !name.eq_ignore_ascii_case(NATS_MSG_ID));
    if let Some(id) = id {
        headers.insert(NATS_MSG_ID.to_owned(), id.to_owned());
    }
}

/// The event in `message`'s payload; an undecodable one is a permanent failure.
fn decode<E: DeserializeOwned>(message: &Message) -> Result<E, Failure> {
    // A user's `Deserialize` (a `deserialize_with`, say) may panic: the message is then
    // poison like any undecodable one, not lost to a task that ended without settling it.
    let decoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        serde_json::from_slice::<E>(&message.payload)
    }));
    match decoded {
        Ok(Ok(event)) => Ok(event),
        Ok(Err(err)) => Err(Failure::new(
            FailureKind::Undecodable,
            format!(
                "the payload is not a valid {}: {err}",
                std::any::type_name::<E>()
            ),
            false,
        )),
        Err(panic) => Err(Failure::new(
            FailureKind::Undecodable,
            format!(
                "decoding the payload as {} panicked: {}",
                std::any::type_name::<E>(),
                crate::dispatch::panic_message(&*panic)
            ),
            false,
        )),
    }
}

/// Runs `work`, sending an in-progress ack for `message` every `every` (if set) meanwhile.
async fn keeping_alive<F: std::future::Future>(
    message: &Message,
    every: Option<Duration>,
    work: F,
) -> F::Output {
    let Some(every) = every else {
        return work.await;
    };
    tokio::pin!(work);
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            worked = &mut work => break worked,
            _ = ticks.tick() => {
                // Best effort: a lost progress ack only risks a redelivery, which the
                // inbox absorbs.
                let _ = message.ack_with(AckKind::Progress).await;
            }
        }
    }
}

/// Whether the database answers the consumer: a connection from the pool and a ping within
/// [`DATABASE_CHECK_TIMEOUT`], `message` kept in progress meanwhile.
async fn database_answers<DB: OutboxDatabase, E, H>(
    shared: &Shared<DB, E, H>,
    message: &Message,
) -> bool {
    use sqlx::Connection as _;
    let check = async {
        let mut connection = shared.pool.acquire().await?;
        connection.ping().await
    };
    let check = tokio::time::timeout(DATABASE_CHECK_TIMEOUT, check);
    match keeping_alive(message, Some(shared.settings.progress_every), check).await {
        Ok(Ok(())) => true,
        Ok(Err(err)) => {
            tracing::debug!(consumer = %shared.consumer_name, error = %err, "the database does not answer");
            false
        }
        Err(_) => false,
    }
}

/// Holds `message` (in progress) until the database answers, checking the retry policy's
/// delay apart (from 1 to 10 s); `false` if the consumer was shut down first.
async fn wait_for_database<DB: OutboxDatabase, E, H>(
    shared: &Shared<DB, E, H>,
    message: &Message,
) -> bool {
    let mut checks = 0u32;
    loop {
        checks = checks.saturating_add(1);
        let after = shared
            .settings
            .retry
            .delay(checks)
            .clamp(MIN_DATABASE_WAIT, MAX_DATABASE_WAIT);
        if !wait_in_place(shared, message, after).await {
            return false;
        }
        if database_answers(shared, message).await {
            return true;
        }
    }
}

/// Sleeps `after` while telling JetStream the message is still in progress; `false` if the
/// consumer was shut down meanwhile.
async fn wait_in_place<DB: OutboxDatabase, E, H>(
    shared: &Shared<DB, E, H>,
    message: &Message,
    after: Duration,
) -> bool {
    // At once too: the attempt before may have run without keep-alive. Best effort, as the
    // keep-alive: a lost one risks a redelivery the inbox absorbs.
    let _ = message.ack_with(AckKind::Progress).await;
    let sleep = tokio::time::sleep(after);
    tokio::select! {
        biased;
        () = shared.cancel.cancelled() => false,
        () = keeping_alive(message, Some(shared.settings.progress_every), sleep) => true,
    }
}

/// Begin, record the inbox row, run the handler, commit.
async fn apply<DB, E, H>(
    shared: &Shared<DB, E, H>,
    message: &Message,
    id: &str,
    delivered: Delivered<E>,
    keep_alive: Option<Duration>,
) -> Result<Applied, Failure>
where
    DB: OutboxDatabase,
    E: DeserializeOwned + Send + 'static,
    H: Handler<DB, E>,
{
    let database = Failure::database;
    // Waiting for a connection or for another transaction's inbox row lock counts too: the
    // keep-alive covers it, not only the handler.
    let work = async {
        let mut tx = shared.pool.begin().await.map_err(|e| database(&e))?;
        match shared.outbox.record_inbox(&mut tx, id).await {
            Ok(InboxReceipt::Duplicate) => {
                // Nothing was written; ending the transaction is all that is left.
                let _ = tx.rollback().await;
                return Ok(None);
            }
            Ok(_) => {}
            Err(err) => return Err(database(&err)),
        }
        let outcome = AssertUnwindSafe(shared.handler.handle(&mut tx, delivered))
            .catch_unwind()
            .await;
        Ok(Some((tx, outcome)))
    };
    let worked = keeping_alive(message, keep_alive, work).await;
    let Some((mut tx, outcome)) = worked? else {
        return Ok(Applied::Duplicate);
    };
    match outcome {
        Ok(Ok(())) => {
            // A handler that swallowed a failed statement returns `Ok` on a transaction
            // Postgres has aborted: its `COMMIT` would roll back and still report success.
            if let Err(err) = DB::check_committable(&mut tx).await {
                let _ = tx.rollback().await;
                if database_unavailable(&err) {
                    // Not refused: the connection went.
                    return Err(database(&err));
                }
                return Err(Failure::new(
                    FailureKind::Database,
                    format!(
                        "the handler returned Ok, but a statement in its transaction failed and \
                         aborted it: rolled back, not applied ({})",
                        crate::chain::error_chain(&err)
                    ),
                    true,
                ));
            }
            tx.commit().await.map_err(|e| database(&e))?;
            Ok(Applied::Committed)
        }
        Ok(Err(err)) => {
            let _ = tx.rollback().await;
            Err(Failure {
                // `?` on the handler's own statement: the database may be out of reach.
                unavailable: err.is_retryable() && database_unavailable(err.source_error()),
                ..Failure::new(FailureKind::Handler, err.chain(), err.is_retryable())
            })
        }
        Err(panic) => {
            let _ = tx.rollback().await;
            Err(Failure::new(
                FailureKind::Panic,
                format!("the handler panicked: {}", panic_message(&*panic)),
                true,
            ))
        }
    }
}

async fn redeliver<DB: OutboxDatabase, E, H>(
    shared: &Shared<DB, E, H>,
    at: &Origin<'_>,
    failure: &Failure,
    after: Duration,
) {
    shared
        .stats
        .settle(&shared.consumer_name, Settled::Redelivered);
    report(shared, at, failure, FailureAction::Redeliver { after });
    if let Err(err) = at.message.ack_with(AckKind::Nak(Some(after))).await {
        // Without the nak the server redelivers after the ack wait instead.
        tracing::warn!(consumer = %shared.consumer_name, error = %err, "nak failed");
    }
}

/// A dead-letter copy that cannot fit the server's `max_payload`, even with no error text:
/// no later delivery can copy it either.
#[derive(Debug, thiserror::Error)]
#[error(
    "the copy would take {size} bytes with its dead-letter headers, over the server's max_payload of {max_payload}"
)]
struct CopyTooLarge {
    size: usize,
    max_payload: usize,
}

/// Dead-letters (when enabled) and terminates a message that will not be applied; `true` if
/// it was copied to the dead letters (a replay of it may then be deleted: the copy holds it).
async fn give_up<DB: OutboxDatabase, E, H>(
    shared: &Shared<DB, E, H>,
    at: &mut Origin<'_>,
    failure: Failure,
) -> bool {
    let action = match &shared.settings.dead_letter_subject {
        None => FailureAction::Terminated,
        Some(subject) => match dead_letter(shared, at, &failure, subject).await {
            Ok(()) => FailureAction::DeadLettered,
            Err(err) => {
                let copy_failed = Failure::new(
                    FailureKind::DeadLetter,
                    format!(
                        "copying to {subject} failed: {err}; the message failed with: {}",
                        failure.error
                    ),
                    true,
                );
                // A copy that can never fit is not worth the remaining deliveries.
                if !err.is::<CopyTooLarge>() && shared.settings.redelivers(at.delivery) {
                    // Try the whole message again later rather than lose the copy.
                    let after = shared.settings.delay_after(at.delivery);
                    redeliver(shared, at, &copy_failed, after).await;
                    return false;
                }
                report(shared, at, &copy_failed, FailureAction::Terminated);
                shared
                    .stats
                    .settle(&shared.consumer_name, Settled::Terminated);
                let _ = at.message.ack_with(AckKind::Term).await;
                return false;
            }
        },
    };
    report(shared, at, &failure, action);
    match action {
        FailureAction::DeadLettered => shared
            .stats
            .settle(&shared.consumer_name, Settled::DeadLettered),
        _ => shared
            .stats
            .settle(&shared.consumer_name, Settled::Terminated),
    }
    if let Err(err) = at.message.ack_with(AckKind::Term).await {
        tracing::warn!(consumer = %shared.consumer_name, error = %err, "terminating a message failed");
    }
    matches!(action, FailureAction::DeadLettered)
}

async fn dead_letter<DB: OutboxDatabase, E, H>(
    shared: &Shared<DB, E, H>,
    at: &Origin<'_>,
    failure: &Failure,
    subject: &str,
) -> Result<(), async_nats::Error> {
    use dead_letter_headers as h;
    // Control headers (`Nats-Msg-Id`, `Nats-Expected-*`, …) must not act on the copy.
    let mut headers = match at.message.headers.as_ref() {
        Some(original) => headers_without(original, &["Nats-"]),
        None => HeaderMap::new(),
    };
    headers.insert(h::KIND, format!("{:?}", failure.kind).as_str());
    headers.insert(h::CONSUMER, shared.consumer_name.as_str());
    headers.insert(h::STREAM, at.original.0.as_str());
    headers.insert(h::STREAM_SEQUENCE, at.original.1.to_string().as_str());
    headers.insert(h::SUBJECT, at.subject.as_str());
    headers.insert(h::DELIVERIES, at.delivery.to_string().as_str());
    if let Some(id) = &at.id {
        headers.insert(h::MESSAGE_ID, id.as_str());
    } else if at.from == Source::Stream
        && let Some(raw) = at.message.headers.as_ref().and_then(|original| {
            original
                .iter()
                .find(|(name, _)| name.to_string().eq_ignore_ascii_case(NATS_MSG_ID))
                .and_then(|(_, values)| values.first())
        })
    {
        // An id that could not be used (blank, surrounded by spaces, …) is kept as it came:
        // the copy drops every `Nats-*` header.
        headers.insert(h::MESSAGE_ID, raw.clone());
    }
    // One copy per message and consumer, even if this publish is repeated (a failed replay
    // gets a copy of its own: its place in the replay stream names it).
    headers.insert(
        NATS_MSG_ID,
        format!(
            "dlq:{}:{}:{}",
            shared.consumer_name, at.stream, at.stream_sequence
        )
        .as_str(),
    );
    // The copy must fit the server's `max_payload` (headers and payload together): a message
    // near the limit gets a shorter error, not a copy that can never be published.
    let mut error = one_line(&failure.error);
    let max_payload = shared.jetstream.client().server_info().max_payload;
    if max_payload > 0 {
        let used = at.message.payload.len() + wire_len(&headers) + h::ERROR.len() + 4;
        if used > max_payload {
            return Err(Box::new(CopyTooLarge {
                size: used,
                max_payload,
            }));
        }
        truncate_to(&mut error, max_payload - used);
    }
    headers.insert(h::ERROR, error.as_str());
    let publish = async {
        shared
            .jetstream
            .publish_with_headers(subject.to_owned(), headers, at.message.payload.clone())
            .await?
            .await?;
        Ok::<(), async_nats::Error>(())
    };
    match tokio::time::timeout(DEAD_LETTER_TIMEOUT, publish).await {
        Ok(result) => result,
        Err(_) => Err(format!("no acknowledgement within {DEAD_LETTER_TIMEOUT:?}").into()),
    }
}

fn report<DB: OutboxDatabase, E, H>(
    shared: &Shared<DB, E, H>,
    at: &Origin<'_>,
    failure: &Failure,
    action: FailureAction,
) {
    let report = ConsumeFailure {
        consumer: shared.consumer_name.clone(),
        id: at.id.clone(),
        stream_sequence: at.original.1,
        replay_sequence: (at.from == Source::Replays).then_some(at.stream_sequence),
        delivery: at.delivery,
        kind: failure.kind,
        error: failure.error.clone(),
        action,
    };
    match action {
        FailureAction::Redeliver { .. } | FailureAction::WaitForDatabase | FailureAction::None => {
            tracing::warn!(consumer = %report.consumer, id = ?report.id, "{report}");
        }
        _ => tracing::error!(consumer = %report.consumer, id = ?report.id, "{report}"),
    }
    if let Some(callback) = &shared.on_failure
        && let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(|| callback(&report)))
    {
        tracing::error!(panic = %panic_message(&*panic), "the consumer's on_error callback panicked");
    }
}

/// The first value of each header.
fn first_values(headers: Option<&HeaderMap>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Some(headers) = headers {
        for (name, values) in headers.iter() {
            if let Some(value) = values.first() {
                out.entry(name.to_string())
                    .or_insert_with(|| value.as_str().to_owned());
            }
        }
    }
    out
}

/// `text` on one line (CR, LF and other controls as spaces), at most 4 KiB.
fn one_line(text: &str) -> String {
    let mut out: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    truncate_to(&mut out, MAX_ERROR_HEADER);
    out
}

/// Cuts `text` to at most `max` bytes, at a character boundary.
fn truncate_to(text: &mut String, max: usize) {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

/// The bytes `headers` take on the wire (`NATS/1.0\r\n`, `name: value\r\n` each, `\r\n`),
/// which NATS counts against `max_payload` with the payload.
fn wire_len(headers: &HeaderMap) -> usize {
    let mut len = "NATS/1.0\r\n\r\n".len();
    for (name, values) in headers.iter() {
        let name: &str = name.as_ref();
        for value in values {
            len += name.len() + ": \r\n".len() + value.as_str().len();
        }
    }
    len
}

/// The span of applying one message: with the `opentelemetry` feature a child of the trace
/// context the message carries (the enqueuing handler's span), otherwise none.
fn consume_span<E>(consumer: &str, delivered: &Delivered<E>) -> tracing::Span {
    #[cfg(feature = "opentelemetry")]
    {
        let span = tracing::info_span!(
            "outbox_consume",
            otel.kind = "consumer",
            consumer = %consumer,
            id = %delivered.id,
            subject = %delivered.subject,
            delivery = delivered.delivery,
        );
        crate::otel::adopt_stored(&span, &delivered.headers);
        span
    }
    #[cfg(not(feature = "opentelemetry"))]
    {
        let _ = (consumer, delivered);
        tracing::Span::none()
    }
}

#[cfg(test)]
mod tests {
    use super::{one_line, wire_len};

    #[test]
    fn header_wire_length_counts_the_block_as_nats_sends_it() {
        let mut headers = async_nats::HeaderMap::new();
        assert_eq!(wire_len(&headers), "NATS/1.0\r\n\r\n".len());
        headers.insert("A", "b");
        headers.append("A", "cd");
        headers.insert("Trellis-Dlq-Kind", "Handler");
        assert_eq!(
            wire_len(&headers),
            "NATS/1.0\r\nA: b\r\nA: cd\r\nTrellis-Dlq-Kind: Handler\r\n\r\n".len()
        );
    }

    #[test]
    fn errors_fit_one_header_line() {
        assert_eq!(one_line("a\r\nb\0c"), "a  b c");
        let long = "é".repeat(5000);
        let line = one_line(&long);
        assert!(line.len() <= 4096 && line.chars().all(|c| c == 'é'));
    }
}
