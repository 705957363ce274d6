//! `Consumer` (issue #13) against real Postgres, SQLite and NATS: every business effect
//! exactly once under duplicate publishes, failed deliveries and redeliveries racing a slow
//! handler across several consumers; follow-up events enqueued once; poison messages and
//! exhausted deliveries dead-lettered; graceful shutdown.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy};
use async_nats::jetstream::stream::Config;
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};
use sqlx::{Postgres, Sqlite, Transaction};
use trellis_outbox::{
    ConsumeFailure, Consumer, ConsumerError, ConsumerHandle, DEAD_LETTER_STREAM,
    DEAD_LETTER_SUBJECT_PREFIX, Delivered, FailureAction, FailureKind, HandlerError, OutboxEvent,
    OutboxTransactionExt, PreparedOutboxRecord, REPLAY_STREAM, REPLAY_SUBJECT_PREFIX, RetryPolicy,
    dead_letter_headers, handler_fn, migrate,
};
use trellis_outbox_tests::nats::{TestStream, jetstream};
use trellis_outbox_tests::{TestPg, TestSqlite};

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(name = "Orders.Shipped", subject = "tconsumer.orders.shipped.{order}")]
struct Shipped {
    #[serde(deserialize_with = "order_or_panic")]
    order: String,
    n: u64,
}

/// A user's `Deserialize` that panics (on the order "explode"), as a buggy one may.
fn order_or_panic<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    let order = String::deserialize(deserializer)?;
    assert_ne!(order, "explode", "a buggy deserializer");
    Ok(order)
}

/// A quick, fixed redelivery delay.
fn quick_retry() -> RetryPolicy {
    RetryPolicy::fixed(Duration::from_millis(50))
}

/// A durable pull consumer on `stream` with explicit acks.
async fn durable(stream: &TestStream, name: &str, ack_wait: Duration, max_deliver: i64) {
    stream
        .context
        .get_stream(&stream.name)
        .await
        .unwrap()
        .create_consumer(PullConfig {
            durable_name: Some(name.to_owned()),
            ack_policy: AckPolicy::Explicit,
            ack_wait,
            max_deliver,
            ..PullConfig::default()
        })
        .await
        .unwrap();
}

async fn publish(js: &Context, subject: String, id: Option<&str>, payload: Vec<u8>) {
    let mut headers = HeaderMap::new();
    if let Some(id) = id {
        headers.insert("Nats-Msg-Id", id);
    }
    headers.insert("Trellis-Event-Time", "2026-12-03T10:00:00.000Z");
    js.publish_with_headers(subject, headers, payload.into())
        .await
        .unwrap()
        .await
        .unwrap();
}

fn shipped(n: u64) -> Vec<u8> {
    serde_json::to_vec(&Shipped {
        order: format!("o-{n}"),
        n,
    })
    .unwrap()
}

/// Waits until `find` returns a value, or panics after `within` with `what`.
async fn eventually_value<T, F, Fut>(within: Duration, what: &str, mut find: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(value) = find().await {
            return value;
        }
        assert!(start.elapsed() < within, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `done` holds, or panics after `within` with `what`.
async fn eventually<F, Fut>(within: Duration, what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !done().await {
        assert!(start.elapsed() < within, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The consumer's unacknowledged and undelivered message counts.
async fn pending(stream: &TestStream, consumer: &str) -> (u64, usize) {
    let stream = stream.context.get_stream(&stream.name).await.unwrap();
    let info = stream.consumer_info(consumer).await.unwrap();
    (info.num_pending, info.num_ack_pending)
}

/// A dead-letter copy.
struct DeadLetter {
    headers: HeaderMap,
    payload: bytes::Bytes,
}

/// An ephemeral consumer of `stream` reading `subject` (a filter) from the start and
/// acknowledging nothing.
async fn reader_of(
    stream: &async_nats::jetstream::stream::Stream,
    subject: String,
) -> async_nats::jetstream::consumer::PullConsumer {
    stream
        .create_consumer(PullConfig {
            filter_subject: subject,
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::None,
            ..PullConfig::default()
        })
        .await
        .unwrap()
}

/// Every dead-letter copy of `consumer`.
async fn dead_letters(js: &Context, consumer: &str) -> Vec<DeadLetter> {
    let stream = js.get_stream(DEAD_LETTER_STREAM).await.unwrap();
    let reader = reader_of(&stream, format!("{DEAD_LETTER_SUBJECT_PREFIX}.{consumer}")).await;
    let mut batch = reader
        .fetch()
        .max_messages(1000)
        .expires(Duration::from_millis(500))
        .messages()
        .await
        .unwrap();
    let mut out = Vec::new();
    while let Some(message) = batch.next().await {
        let message = message.unwrap();
        out.push(DeadLetter {
            headers: message.headers.clone().unwrap_or_default(),
            payload: message.payload.clone(),
        });
    }
    out
}

async fn purge_dead_letters(js: &Context, consumer: &str) {
    if let Ok(stream) = js.get_stream(DEAD_LETTER_STREAM).await {
        let _ = stream
            .purge()
            .filter(format!("{DEAD_LETTER_SUBJECT_PREFIX}.{consumer}"))
            .await;
    }
}

fn header<'a>(message: &'a DeadLetter, name: &str) -> Option<&'a str> {
    message.headers.get(name).map(|v| v.as_str())
}

fn consumer_name() -> String {
    format!("c{}", ulid::Ulid::generate().to_string().to_lowercase())
}

/// Failures reported to `on_error`.
type Failures = Arc<Mutex<Vec<ConsumeFailure>>>;

/// Which deliveries misbehave in the exactly-once runs: a tenth of the events fail their
/// first delivery; one in fifty is slow on its first delivery (longer than the ack wait, and
/// keep-alive is off), so the server redelivers it to another consumer while it runs.
fn fails_first(n: u64) -> bool {
    n % 10 == 3
}
fn slow_first(n: u64) -> bool {
    n % 50 == 7
}

macro_rules! effects_handler {
    ($db:ty, $insert:literal) => {
        handler_fn(|tx: &mut Transaction<'static, $db>, d: Delivered<Shipped>| {
            Box::pin(async move {
                if d.delivery == 1 && fails_first(d.event.n) {
                    return Err(HandlerError::retryable("first delivery fails"));
                }
                if d.delivery == 1 && slow_first(d.event.n) {
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                }
                sqlx::query($insert)
                    .bind(&d.id)
                    .bind(i64::try_from(d.event.n).unwrap())
                    .execute(&mut **tx)
                    .await?;
                // A follow-up event with a fresh id: applying twice would leave two.
                let follow_up = PreparedOutboxRecord::event(
                    "Orders.Billed",
                    format!("tconsumer.orders.billed.{}", d.event.order),
                    &serde_json::json!({ "of": d.id }),
                )?;
                tx.enqueue(&follow_up).await?;
                Ok(())
            })
        })
    };
}

/// Publishes `events` events, then `duplicates` of them again (after the stream's
/// duplicate window, so they are stored and delivered twice).
async fn publish_with_duplicates(stream: &TestStream, events: u64, duplicates: u64) {
    let js = &stream.context;
    for n in 0..events {
        let id = format!("evt-{n:05}");
        publish(
            js,
            stream.subject(&format!("shipped.o{n}")),
            Some(&id),
            shipped(n),
        )
        .await;
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    for n in (0..events)
        .step_by((events / duplicates.max(1)).max(1) as usize)
        .take(duplicates as usize)
    {
        let id = format!("evt-{n:05}");
        publish(
            js,
            stream.subject(&format!("shipped.o{n}")),
            Some(&id),
            shipped(n),
        )
        .await;
    }
}

async fn dedupe_stream(js: &Context) -> TestStream {
    TestStream::create(js, |token| Config {
        subjects: vec![format!("{token}.>")],
        duplicate_window: Duration::from_millis(500),
        ..Config::default()
    })
    .await
}

/// How many of consumer `name`'s dead letters there are, up to `limit`.
async fn dead_letter_count(js: &Context, name: &str, limit: usize) -> usize {
    trellis_outbox::dead_letters(js, name, limit)
        .await
        .unwrap()
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_exactly_once_across_four_consumers() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::query("CREATE TABLE effects (event_id text NOT NULL, n bigint NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let js = jetstream().await;
    let stream = dedupe_stream(&js).await;
    let name = consumer_name();
    durable(&stream, &name, Duration::from_secs(1), 10).await;
    let (events, duplicates) = (1000u64, 300u64);
    let pool = db.pool.clone();
    let body_stream = stream.clone();
    stream
        .run(async move {
            let stream = body_stream;
            let mut consumers: Vec<ConsumerHandle> = Vec::new();
            for _ in 0..4 {
                consumers.push(
                    Consumer::builder(
                        stream.context.clone(),
                        pool.clone(),
                        effects_handler!(
                            Postgres,
                            "INSERT INTO effects (event_id, n) VALUES ($1, $2)"
                        ),
                    )
                    .bind(&stream.name, &name)
                    .concurrency(8)
                    .retry_policy(quick_retry())
                    .keep_alive(false)
                    .start()
                    .await
                    .unwrap(),
                );
            }
            publish_with_duplicates(&stream, events, duplicates).await;
            assert_eq!(
                stream.count().await,
                events + duplicates,
                "duplicates were stored"
            );
            eventually(
                Duration::from_secs(90),
                "every message to be acknowledged",
                || async { pending(&stream, &name).await == (0, 0) },
            )
            .await;
            let mut total = trellis_outbox::ConsumerReport::default();
            for consumer in consumers {
                let report = consumer.shutdown().await.unwrap();
                total.applied += report.applied;
                total.duplicates += report.duplicates;
                total.redelivered += report.redelivered;
                total.dead_lettered += report.dead_lettered;
            }
            let (rows, distinct): (i64, i64) =
                sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM effects")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            assert_eq!(
                (rows, distinct),
                (events as i64, events as i64),
                "each effect once"
            );
            let follow_ups: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_outbox")
                .fetch_one(&pool)
                .await
                .unwrap();
            assert_eq!(follow_ups, events as i64, "each follow-up event once");
            assert_eq!(total.applied, events);
            assert!(total.duplicates >= duplicates, "{total:?}");
            assert!(total.redelivered >= events / 10, "{total:?}");
            assert_eq!(total.dead_lettered, 0, "{total:?}");
        })
        .await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_exactly_once_across_two_consumers() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::query("CREATE TABLE effects (event_id TEXT NOT NULL, n INTEGER NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let js = jetstream().await;
    let stream = dedupe_stream(&js).await;
    let name = consumer_name();
    durable(&stream, &name, Duration::from_secs(1), 10).await;
    let (events, duplicates) = (300u64, 90u64);
    let pool = db.pool.clone();
    let body_stream = stream.clone();
    stream
        .run(async move {
            let stream = body_stream;
            let mut consumers = Vec::new();
            for _ in 0..2 {
                consumers.push(
                    Consumer::builder(
                        stream.context.clone(),
                        pool.clone(),
                        effects_handler!(Sqlite, "INSERT INTO effects (event_id, n) VALUES (?, ?)"),
                    )
                    .bind(&stream.name, &name)
                    .concurrency(4)
                    .retry_policy(quick_retry())
                    .keep_alive(false)
                    .start()
                    .await
                    .unwrap(),
                );
            }
            publish_with_duplicates(&stream, events, duplicates).await;
            eventually(
                Duration::from_secs(90),
                "every message to be acknowledged",
                || async { pending(&stream, &name).await == (0, 0) },
            )
            .await;
            let mut applied = 0;
            for consumer in consumers {
                applied += consumer.shutdown().await.unwrap().applied;
            }
            let (rows, distinct): (i64, i64) =
                sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM effects")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            assert_eq!(
                (rows, distinct),
                (events as i64, events as i64),
                "each effect once"
            );
            let follow_ups: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_outbox")
                .fetch_one(&pool)
                .await
                .unwrap();
            assert_eq!(follow_ups, events as i64, "each follow-up event once");
            assert_eq!(applied, events);
        })
        .await;
}

/// A consumer on a fresh stream and durable (ack wait 2 s, `max_deliver` 10) over SQLite,
/// with a handler that records each delivery of each id and fails as `fail` says.
struct Harness {
    stream: TestStream,
    name: String,
    db: TestSqlite,
    failures: Failures,
    deliveries: Arc<Mutex<HashMap<String, Vec<u64>>>>,
    /// What the handler saw of each replayed delivery.
    replays: Arc<Mutex<Vec<Replayed>>>,
}

/// A replayed delivery as the handler saw it.
#[derive(Debug, Clone, PartialEq)]
struct Replayed {
    id: String,
    subject: String,
    /// Its `Nats-Msg-Id` header.
    header_id: Option<String>,
    /// Whether any `Trellis-Dlq-*` header reached the handler.
    copy_headers: bool,
    stream_sequence: u64,
}

impl Harness {
    async fn new() -> Self {
        Self::on(TestStream::events(&jetstream().await).await).await
    }

    /// A harness whose consumer reads `stream`.
    async fn on(stream: TestStream) -> Self {
        let db = TestSqlite::new().await;
        migrate(&db.pool).await.unwrap();
        sqlx::query("CREATE TABLE effects (event_id TEXT NOT NULL)")
            .execute(&db.pool)
            .await
            .unwrap();
        let name = consumer_name();
        durable(&stream, &name, Duration::from_secs(2), 10).await;
        Self {
            stream,
            name,
            db,
            failures: Arc::default(),
            deliveries: Arc::default(),
            replays: Arc::default(),
        }
    }

    /// Starts a consumer whose handler fails with `fail(id, delivery)` when it returns one.
    async fn start(
        &self,
        max_deliveries: Option<u32>,
        fail: fn(&str, u64) -> Option<HandlerError>,
    ) -> ConsumerHandle {
        self.start_on(self.db.pool.clone(), max_deliveries, fail)
            .await
    }

    /// [`start`](Self::start) on a pool of the harness' database other than its own.
    async fn start_on(
        &self,
        pool: sqlx::SqlitePool,
        max_deliveries: Option<u32>,
        fail: fn(&str, u64) -> Option<HandlerError>,
    ) -> ConsumerHandle {
        let failures = self.failures.clone();
        let mut builder =
            Consumer::builder(self.stream.context.clone(), pool, self.handler(fail, false))
                .bind(&self.stream.name, &self.name)
                .retry_policy(quick_retry())
                .on_error(move |f| failures.lock().unwrap().push(f.clone()));
        if let Some(max) = max_deliveries {
            builder = builder.max_deliveries(max);
        }
        builder.start().await.unwrap()
    }

    /// The harness' handler: records the delivery, inserts the effect, then never returns if
    /// `hang`, else fails with `fail(id, delivery)` when it returns one.
    fn handler(
        &self,
        fail: fn(&str, u64) -> Option<HandlerError>,
        hang: bool,
    ) -> trellis_outbox::HandlerFn<Sqlite, Shipped> {
        let (deliveries, replays) = (self.deliveries.clone(), self.replays.clone());
        handler_fn(
            move |tx: &mut Transaction<'static, Sqlite>, d: Delivered<Shipped>| {
                let (deliveries, replays) = (deliveries.clone(), replays.clone());
                Box::pin(async move {
                    deliveries
                        .lock()
                        .unwrap()
                        .entry(d.id.clone())
                        .or_default()
                        .push(d.delivery);
                    if d.replayed {
                        replays.lock().unwrap().push(Replayed {
                            id: d.id.clone(),
                            subject: d.subject.clone(),
                            header_id: d.headers.get("Nats-Msg-Id").cloned(),
                            copy_headers: d.headers.keys().any(|k| k.starts_with("Trellis-Dlq-")),
                            stream_sequence: d.stream_sequence,
                        });
                    }
                    sqlx::query("INSERT INTO effects (event_id) VALUES (?)")
                        .bind(&d.id)
                        .execute(&mut **tx)
                        .await?;
                    if hang {
                        std::future::pending::<()>().await;
                    }
                    match fail(&d.id, d.delivery) {
                        Some(err) => Err(err),
                        None => Ok(()),
                    }
                })
            },
        )
    }

    async fn effects(&self, id: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE event_id = ?")
            .bind(id)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    async fn settled(&self) {
        eventually(
            Duration::from_secs(30),
            "every message to be settled",
            || async { pending(&self.stream, &self.name).await == (0, 0) },
        )
        .await;
    }

    async fn end(self) {
        purge_dead_letters(&self.stream.context, &self.name).await;
        // The consumer's durable on the shared replay stream, and its replays.
        if let Ok(replays) = self.stream.context.get_stream(REPLAY_STREAM).await {
            let _ = replays.delete_consumer(&self.name).await;
            let _ = replays
                .purge()
                .filter(format!("{REPLAY_SUBJECT_PREFIX}.{}.>", self.name))
                .await;
        }
        self.stream.delete().await;
    }
}

/// Deletes the harness' durable and creates it again, with `max_batch` (0: no limit).
async fn recreate_durable(stream: &TestStream, name: &str, max_batch: i64) {
    let js_stream = stream.context.get_stream(&stream.name).await.unwrap();
    js_stream.delete_consumer(name).await.unwrap();
    js_stream
        .create_consumer(PullConfig {
            durable_name: Some(name.to_owned()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(2),
            max_deliver: 10,
            max_batch,
            ..PullConfig::default()
        })
        .await
        .unwrap();
}

/// Shuts `consumer` down and checks that events `evt-0` … `evt-{events - 1}` were each
/// applied once, and nothing else; then ends the harness.
async fn each_applied_once(h: Harness, consumer: ConsumerHandle, events: u64) {
    applied_once(&h, events).await;
    let report = consumer.shutdown().await.unwrap();
    assert_eq!(report.applied, events);
    h.end().await;
}

async fn publish_shipped(h: &Harness, from: u64, to: u64) {
    for n in from..to {
        publish(
            &h.stream.context,
            h.stream.subject(&format!("shipped.o{n}")),
            Some(&format!("evt-{n}")),
            shipped(n),
        )
        .await;
    }
}

/// A durable whose creator limited each pull (`max_batch` 4) below the consumer's
/// concurrency (16): the server refuses larger pulls, which used to end the message stream
/// and with it the consumer, silently. Pulls now stay within the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_with_a_small_max_batch_is_consumed() {
    let h = Harness::new().await;
    recreate_durable(&h.stream, &h.name, 4).await;
    let consumer = h.start(None, |_, _| None).await;
    publish_shipped(&h, 0, 10).await;
    h.settled().await;
    each_applied_once(h, consumer, 10).await;
}

/// The durable is deleted and created again while the consumer runs (an operator's fix):
/// async-nats ends the message stream; the consumer starts a new one and goes on, and the
/// inbox absorbs the new durable's redelivery of what was applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_recreated_while_running_is_consumed_again() {
    let h = Harness::new().await;
    let consumer = h.start(None, |_, _| None).await;
    publish_shipped(&h, 0, 2).await;
    h.settled().await;
    recreate_durable(&h.stream, &h.name, 0).await;
    publish_shipped(&h, 2, 4).await;
    eventually(
        Duration::from_secs(30),
        "the later events to be applied",
        || async { h.effects("evt-2").await == 1 && h.effects("evt-3").await == 1 },
    )
    .await;
    h.settled().await;
    each_applied_once(h, consumer, 4).await;
}

/// The durable is recreated with a `max_batch` (4) below the consumer's concurrency (16):
/// the restarted stream must pull within the new limit. With the limits read at start, the
/// server refused every pull and the stream was restarted every half second, forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_recreated_with_a_smaller_max_batch_is_consumed_again() {
    let h = Harness::new().await;
    let consumer = h.start(None, |_, _| None).await;
    publish_shipped(&h, 0, 2).await;
    h.settled().await;
    recreate_durable(&h.stream, &h.name, 4).await;
    publish_shipped(&h, 2, 12).await;
    eventually(
        Duration::from_secs(30),
        "the later events to be applied",
        || async {
            let mut all = true;
            for n in 2..12 {
                all &= h.effects(&format!("evt-{n}")).await == 1;
            }
            all
        },
    )
    .await;
    h.settled().await;
    each_applied_once(h, consumer, 12).await;
}

/// Messages in hand that wait for the pool's only connection are kept alive too: with the
/// handler alone kept alive, they were redelivered (ack wait 2 s) while waiting, and the
/// copies found the inbox row (duplicates).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_waiting_for_a_connection_are_kept_alive() {
    let h = Harness::new().await;
    let pool = trellis_outbox_tests::sqlite_pool(&h.db.path, 1).await;
    let consumer = Consumer::builder(
        h.stream.context.clone(),
        pool,
        handler_fn(
            |tx: &mut Transaction<'static, Sqlite>, d: Delivered<Shipped>| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO effects (event_id) VALUES (?)")
                        .bind(&d.id)
                        .execute(&mut **tx)
                        .await?;
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    Ok(())
                })
            },
        ),
    )
    .bind(&h.stream.name, &h.name)
    .concurrency(3)
    .start()
    .await
    .unwrap();
    publish_shipped(&h, 0, 3).await;
    eventually(Duration::from_secs(30), "three events applied", || async {
        consumer.report().applied == 3
    })
    .await;
    h.settled().await;
    let report = consumer.shutdown().await.unwrap();
    assert_eq!(report.duplicates, 0, "{report:?}");
    assert_eq!(report.redelivered, 0, "{report:?}");
    for n in 0..3 {
        assert_eq!(h.effects(&format!("evt-{n}")).await, 1);
    }
    h.end().await;
}

/// A database that cannot serve the consumer (here: its one pooled connection is taken, so
/// every acquire times out) is not the messages' fault. They must not spend their deliveries
/// (two here) and be dead-lettered: each is held in progress and tried again in place, and is
/// applied at its first delivery once the database is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_out_of_reach_spends_no_deliveries() {
    let h = Harness::new().await;
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(200))
        .connect_with(
            sqlx::sqlite::SqliteConnectOptions::new()
                .filename(&h.db.path)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal),
        )
        .await
        .unwrap();
    let held = pool.acquire().await.unwrap();
    let consumer = h.start_on(pool, Some(2), |_, _| None).await;
    publish_shipped(&h, 0, 3).await;
    // Many acquire timeouts each, well past two deliveries' worth.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        consumer.report().database_waits,
        3,
        "{:?}",
        consumer.report()
    );
    drop(held);
    eventually(Duration::from_secs(30), "three events applied", || async {
        consumer.report().applied == 3
    })
    .await;
    h.settled().await;
    let report = consumer.shutdown().await.unwrap();
    assert_eq!(
        (report.redelivered, report.dead_lettered, report.terminated),
        (0, 0, 0),
        "{report:?}"
    );
    for n in 0..3 {
        let id = format!("evt-{n}");
        assert_eq!(h.effects(&id).await, 1, "{id} applied once");
        assert_eq!(
            h.deliveries.lock().unwrap()[&id],
            vec![1],
            "{id}: one delivery"
        );
    }
    let failures = h.failures.lock().unwrap().clone();
    assert_eq!(
        failures.len(),
        3,
        "one report per message held: {failures:?}"
    );
    assert!(
        failures.iter().all(|f| f.kind == FailureKind::Database
            && f.delivery == 1
            && matches!(f.action, FailureAction::WaitForDatabase)
            && f.error.contains("timed out")),
        "{failures:?}"
    );
    assert!(dead_letters(&h.stream.context, &h.name).await.is_empty());
    h.end().await;
}

/// An error that looks like an outage (here a handler returning the pool's acquire timeout)
/// while the database answers the consumer's own check is the message's failure: it spends
/// deliveries and is dead-lettered at the last, not held for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_error_while_the_database_answers_spends_deliveries() {
    let h = Harness::new().await;
    let consumer = h
        .start(Some(2), |_, _| {
            Some(HandlerError::retryable(sqlx::Error::PoolTimedOut))
        })
        .await;
    publish_shipped(&h, 0, 1).await;
    h.settled().await;
    let report = consumer.shutdown().await.unwrap();
    assert_eq!(h.deliveries.lock().unwrap()["evt-0"], vec![1, 2]);
    assert_eq!(
        (
            report.redelivered,
            report.dead_lettered,
            report.database_waits
        ),
        (1, 1, 0),
        "{report:?}"
    );
    assert_eq!(h.effects("evt-0").await, 0);
    assert_eq!(dead_letters(&h.stream.context, &h.name).await.len(), 1);
    h.end().await;
}

/// `shutdown` during a database outage does not wait for the database: a message held for
/// another attempt is handed back to JetStream (a nak) and the consumer stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_does_not_wait_for_a_database_out_of_reach() {
    let h = Harness::new().await;
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(100))
        .connect_with(sqlx::sqlite::SqliteConnectOptions::new().filename(&h.db.path))
        .await
        .unwrap();
    let held = pool.acquire().await.unwrap();
    let consumer = Consumer::builder(
        h.stream.context.clone(),
        pool,
        handler_fn(
            |_: &mut Transaction<'static, Sqlite>, _: Delivered<Shipped>| {
                Box::pin(async { Ok(()) })
            },
        ),
    )
    .bind(&h.stream.name, &h.name)
    // Long waits between attempts: shutdown must not sit them out.
    .retry_policy(RetryPolicy::fixed(Duration::from_secs(60)))
    .start()
    .await
    .unwrap();
    publish_shipped(&h, 0, 1).await;
    eventually(Duration::from_secs(30), "the message held", || async {
        consumer.report().database_waits == 1
    })
    .await;
    let started = Instant::now();
    let report = tokio::time::timeout(Duration::from_secs(10), consumer.shutdown())
        .await
        .expect("shutdown returns without the database")
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!((report.applied, report.redelivered), (0, 1), "{report:?}");
    drop(held);
    h.end().await;
}

/// A consumer over Postgres (`pool`, on `db` with an `effects` table made by `effects`), on a
/// fresh stream and durable (ack wait 2 s, `max_deliver`), with quick retries; its failures
/// go to `failures`.
struct PgConsumer {
    db: TestPg,
    js: Context,
    stream: TestStream,
    name: String,
    failures: Failures,
}

impl PgConsumer {
    async fn new(effects: &'static str, max_deliver: i64) -> Self {
        let db = TestPg::new().await;
        migrate(&db.pool).await.unwrap();
        sqlx::query(effects).execute(&db.pool).await.unwrap();
        let js = jetstream().await;
        let stream = TestStream::events(&js).await;
        let name = consumer_name();
        durable(&stream, &name, Duration::from_secs(2), max_deliver).await;
        Self {
            db,
            js,
            stream,
            name,
            failures: Arc::default(),
        }
    }

    async fn start(
        &self,
        pool: sqlx::PgPool,
        handler: trellis_outbox::HandlerFn<Postgres, Shipped>,
    ) -> ConsumerHandle {
        let reported = self.failures.clone();
        Consumer::builder(self.stream.context.clone(), pool, handler)
            .bind(&self.stream.name, &self.name)
            .retry_policy(quick_retry())
            .on_error(move |f| reported.lock().unwrap().push(f.clone()))
            .start()
            .await
            .unwrap()
    }
}

/// The same over a real outage: Postgres behind a relay that cuts every connection and then
/// refuses new ones for a while. Messages published meanwhile are applied once it is back,
/// each at its first delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_outage_spends_no_deliveries() {
    let h = PgConsumer::new(
        "CREATE TABLE effects (event_id text NOT NULL, delivery bigint NOT NULL)",
        3,
    )
    .await;
    let (db, js, stream, name, failures) = (&h.db, &h.js, &h.stream, &h.name, &h.failures);
    let (outage, through) = trellis_outbox_tests::cut::CutRelay::before_postgres(&db.options).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_millis(500))
        .connect_with(through)
        .await
        .unwrap();
    let consumer = h
        .start(
            pool,
            handler_fn(
                |tx: &mut Transaction<'static, Postgres>, d: Delivered<Shipped>| {
                    Box::pin(async move {
                        sqlx::query("INSERT INTO effects (event_id, delivery) VALUES ($1, $2)")
                            .bind(&d.id)
                            .bind(i64::try_from(d.delivery).unwrap())
                            .execute(&mut **tx)
                            .await?;
                        Ok(())
                    })
                },
            ),
        )
        .await;
    publish(js, stream.subject("shipped.o0"), Some("evt-0"), shipped(0)).await;
    eventually(
        Duration::from_secs(30),
        "the first event applied",
        || async { consumer.report().applied == 1 },
    )
    .await;
    outage.down();
    for n in 1..4 {
        let subject = stream.subject(&format!("shipped.o{n}"));
        publish(js, subject, Some(&format!("evt-{n}")), shipped(n)).await;
    }
    // Three ack waits: had the messages not been kept in progress, the server would have
    // spent their last delivery (3) by now.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        consumer.report().database_waits,
        3,
        "{:?}",
        consumer.report()
    );
    outage.up();
    eventually(Duration::from_secs(30), "four events applied", || async {
        consumer.report().applied == 4
    })
    .await;
    eventually(Duration::from_secs(30), "every message settled", || async {
        pending(stream, name).await == (0, 0)
    })
    .await;
    let report = consumer.shutdown().await.unwrap();
    assert_eq!(
        (report.redelivered, report.dead_lettered, report.terminated),
        (0, 0, 0),
        "{report:?}"
    );
    let effects: Vec<(String, i64)> =
        sqlx::query_as("SELECT event_id, delivery FROM effects ORDER BY event_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let expected: Vec<(String, i64)> = (0..4).map(|n| (format!("evt-{n}"), 1)).collect();
    assert_eq!(
        effects, expected,
        "each applied once, at its first delivery"
    );
    let failures = failures.lock().unwrap().clone();
    assert!(
        failures.iter().all(|f| f.kind == FailureKind::Database
            && matches!(f.action, FailureAction::WaitForDatabase)),
        "{failures:?}"
    );
    assert!(dead_letters(js, name).await.is_empty());
    stream.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_failing_twice_then_succeeding_applies_once() {
    let h = Harness::new().await;
    let consumer = h
        .start(None, |_, delivery| {
            (delivery <= 2).then(|| HandlerError::retryable(format!("attempt {delivery} fails")))
        })
        .await;
    publish(
        &h.stream.context,
        h.stream.subject("shipped.o1"),
        Some("evt-1"),
        shipped(1),
    )
    .await;
    h.settled().await;
    let report = consumer.shutdown().await.unwrap();
    assert_eq!(h.deliveries.lock().unwrap()["evt-1"], vec![1, 2, 3]);
    assert_eq!(
        h.effects("evt-1").await,
        1,
        "rolled back twice, committed once"
    );
    assert_eq!(
        (report.applied, report.redelivered, report.dead_lettered),
        (1, 2, 0)
    );
    let failures = h.failures.lock().unwrap().clone();
    assert_eq!(failures.len(), 2);
    assert!(failures.iter().all(|f| f.kind == FailureKind::Handler
        && f.id.as_deref() == Some("evt-1")
        && matches!(f.action, FailureAction::Redeliver { .. })
        && f.error.contains("fails")));
    h.end().await;
}

/// A handler that swallows a failed statement and returns `Ok`: Postgres has aborted the
/// transaction and answers `COMMIT` with `ROLLBACK`, not an error. The message must not be
/// counted applied and acked (nothing was written): it is redelivered and applied then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_postgres_transaction_is_not_acked_as_applied() {
    let h = PgConsumer::new("CREATE TABLE effects (event_id text NOT NULL)", 10).await;
    let (db, js, stream, name, failures) = (&h.db, &h.js, &h.stream, &h.name, &h.failures);
    let consumer = h
        .start(
            db.pool.clone(),
            handler_fn(
                |tx: &mut Transaction<'static, Postgres>, d: Delivered<Shipped>| {
                    Box::pin(async move {
                        sqlx::query("INSERT INTO effects (event_id) VALUES ($1)")
                            .bind(&d.id)
                            .execute(&mut **tx)
                            .await?;
                        if d.delivery == 1 {
                            // "Already done, ignore": the error is swallowed, the transaction
                            // is not.
                            let swallowed = sqlx::query("SELECT 1 / 0").execute(&mut **tx).await;
                            assert!(swallowed.is_err());
                        }
                        Ok(())
                    })
                },
            ),
        )
        .await;
    publish(js, stream.subject("shipped.o1"), Some("evt-1"), shipped(1)).await;
    eventually(
        Duration::from_secs(30),
        "the message to be settled",
        || async { pending(stream, name).await == (0, 0) },
    )
    .await;
    let report = consumer.shutdown().await.unwrap();
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let inbox: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_inbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        (effects, inbox),
        (1, 1),
        "applied once, by the second delivery"
    );
    assert_eq!((report.applied, report.redelivered), (1, 1));
    let failures = failures.lock().unwrap().clone();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].kind, FailureKind::Database);
    assert!(
        failures[0].error.contains("aborted"),
        "{}",
        failures[0].error
    );
    stream.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_dead_lettered_and_the_consumer_keeps_going() {
    let h = Harness::new().await;
    let consumer = h.start(None, |_, _| None).await;
    let js = h.stream.context.clone();
    publish(
        &js,
        h.stream.subject("shipped.bad"),
        Some("evt-bad"),
        b"{not json".to_vec(),
    )
    .await;
    publish(&js, h.stream.subject("shipped.noid"), None, shipped(2)).await;
    // An id that cannot be used (a control character): kept as it came in the copy.
    publish(
        &js,
        h.stream.subject("shipped.ctl"),
        Some("evt\u{1}ctl"),
        shipped(5),
    )
    .await;
    publish(
        &js,
        h.stream.subject("shipped.boom"),
        Some("evt-boom"),
        br#"{"order":"explode","n":4}"#.to_vec(),
    )
    .await;
    publish(
        &js,
        h.stream.subject("shipped.o3"),
        Some("evt-3"),
        shipped(3),
    )
    .await;
    h.settled().await;
    let report = consumer.shutdown().await.unwrap();
    assert_eq!(
        h.effects("evt-3").await,
        1,
        "the good message after the poison is applied"
    );
    assert_eq!(
        (report.applied, report.dead_lettered, report.redelivered),
        (1, 4, 0)
    );
    assert!(
        h.deliveries.lock().unwrap().get("evt-bad").is_none(),
        "never handled"
    );

    let copies = dead_letters(&js, &h.name).await;
    assert_eq!(copies.len(), 4, "one dead-letter copy each");
    let ctl = copies
        .iter()
        .find(|m| {
            header(m, dead_letter_headers::SUBJECT)
                == Some(h.stream.subject("shipped.ctl").as_str())
        })
        .unwrap();
    assert_eq!(header(ctl, dead_letter_headers::KIND), Some("MissingId"));
    assert_eq!(
        header(ctl, dead_letter_headers::MESSAGE_ID),
        Some("evt\u{1}ctl"),
        "the unusable id is kept"
    );
    // A panicking `Deserialize` is poison too, not a message left unsettled.
    let boom = copies
        .iter()
        .find(|m| header(m, dead_letter_headers::MESSAGE_ID) == Some("evt-boom"))
        .unwrap();
    assert_eq!(header(boom, dead_letter_headers::KIND), Some("Undecodable"));
    let error = header(boom, dead_letter_headers::ERROR).unwrap();
    assert!(
        error.contains("panicked") && error.contains("a buggy deserializer"),
        "{error}"
    );
    let bad = copies
        .iter()
        .find(|m| header(m, dead_letter_headers::MESSAGE_ID) == Some("evt-bad"))
        .unwrap();
    assert_eq!(header(bad, dead_letter_headers::KIND), Some("Undecodable"));
    assert!(
        header(bad, dead_letter_headers::ERROR)
            .unwrap()
            .contains("payload is not a valid")
    );
    assert_eq!(
        header(bad, dead_letter_headers::SUBJECT),
        Some(h.stream.subject("shipped.bad").as_str())
    );
    assert_eq!(
        &bad.payload[..],
        b"{not json",
        "the payload is kept for replay"
    );
    let no_id = copies
        .iter()
        .find(|m| header(m, dead_letter_headers::KIND) == Some("MissingId"))
        .unwrap();
    assert!(
        header(no_id, dead_letter_headers::ERROR)
            .unwrap()
            .contains("Nats-Msg-Id")
    );
    assert_eq!(
        header(no_id, "Trellis-Event-Time"),
        Some("2026-12-03T10:00:00.000Z")
    );
    let failures = h.failures.lock().unwrap().clone();
    assert_eq!(failures.len(), 4);
    assert!(
        failures
            .iter()
            .all(|f| f.action == FailureAction::DeadLettered)
    );
    h.end().await;
}

/// A message a few KB under the server's `max_payload` fails permanently with a long
/// error: the dead-letter copy (payload, headers and its own headers) must still fit, so its
/// error header is shortened instead of the copy being refused at every delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_near_the_size_limit_is_dead_lettered_with_a_shorter_error() {
    let h = Harness::new().await;
    let consumer = h
        .start(None, |_, _| {
            Some(HandlerError::permanent("x".repeat(5_000)))
        })
        .await;
    let js = h.stream.context.clone();
    let max_payload = js.client().server_info().max_payload;
    let order = "o".repeat(max_payload - 3_000);
    let payload = serde_json::to_vec(&Shipped { order, n: 1 }).unwrap();
    publish(
        &js,
        h.stream.subject("shipped.big"),
        Some("evt-big"),
        payload.clone(),
    )
    .await;
    h.settled().await;
    let report = consumer.shutdown().await.unwrap();
    assert_eq!(
        (report.dead_lettered, report.redelivered),
        (1, 0),
        "{report:?}"
    );
    let copies = dead_letters(&js, &h.name).await;
    assert_eq!(copies.len(), 1);
    assert_eq!(
        copies[0].payload.len(),
        payload.len(),
        "the payload is kept whole"
    );
    let error = header(&copies[0], dead_letter_headers::ERROR).unwrap();
    assert!(
        error.len() > 1_000 && error.len() < 3_000 && error.bytes().all(|b| b == b'x'),
        "{} bytes",
        error.len()
    );
    h.end().await;
}

/// A poison message so close to `max_payload` that no copy fits, even without the error
/// text: it is terminated (and reported) at once, not redelivered until its deliveries run
/// out, each time failing to copy it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_too_large_to_copy_is_terminated_at_once() {
    let h = Harness::new().await;
    let consumer = h.start(None, |_, _| None).await;
    let js = h.stream.context.clone();
    let max_payload = js.client().server_info().max_payload;
    // Not a `Shipped`: poison, for the dead letters at once.
    let payload = vec![b'x'; max_payload - 200];
    publish(
        &js,
        h.stream.subject("shipped.huge"),
        Some("evt-huge"),
        payload,
    )
    .await;
    h.settled().await;
    let failures = h.failures.lock().unwrap().clone();
    let report = consumer.shutdown().await.unwrap();
    assert_eq!(
        (report.terminated, report.redelivered, report.dead_lettered),
        (1, 0, 0),
        "{report:?}"
    );
    assert!(dead_letters(&js, &h.name).await.is_empty());
    assert!(
        failures
            .iter()
            .any(|f| f.error.contains("over the server's max_payload")),
        "{failures:?}"
    );
    h.end().await;
}

/// By default a message is dead-lettered one delivery before the durable's `max_deliver`
/// (10 here): the server's last delivery is a spare for one spent without an attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_the_last_attempt_leaves_one_server_delivery_spare() {
    let h = Harness::new().await;
    let consumer = h
        .start(None, |_, _| Some(HandlerError::retryable("still failing")))
        .await;
    publish_shipped(&h, 0, 1).await;
    h.settled().await;
    let report = consumer.shutdown().await.unwrap();
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert_eq!(
        h.deliveries.lock().unwrap()["evt-0"],
        (1..=9).collect::<Vec<u64>>()
    );
    h.end().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_delivery_dead_letters_and_a_permanent_error_at_once() {
    let h = Harness::new().await;
    let consumer = h
        .start(Some(3), |id, _| {
            Some(if id == "evt-perm" {
                HandlerError::permanent("order o-9 does not exist")
            } else {
                HandlerError::retryable("billing is down")
            })
        })
        .await;
    let js = h.stream.context.clone();
    publish(
        &js,
        h.stream.subject("shipped.o8"),
        Some("evt-down"),
        shipped(8),
    )
    .await;
    publish(
        &js,
        h.stream.subject("shipped.o9"),
        Some("evt-perm"),
        shipped(9),
    )
    .await;
    h.settled().await;
    let report = consumer.shutdown().await.unwrap();
    let deliveries = h.deliveries.lock().unwrap().clone();
    assert_eq!(deliveries["evt-down"], vec![1, 2, 3], "max_deliveries(3)");
    assert_eq!(
        deliveries["evt-perm"],
        vec![1],
        "a permanent error is not retried"
    );
    assert_eq!(
        h.effects("evt-down").await + h.effects("evt-perm").await,
        0,
        "rolled back"
    );
    assert_eq!(
        (report.applied, report.dead_lettered, report.redelivered),
        (0, 2, 2)
    );
    let copies = dead_letters(&js, &h.name).await;
    assert_eq!(copies.len(), 2);
    let down = copies
        .iter()
        .find(|m| header(m, dead_letter_headers::MESSAGE_ID) == Some("evt-down"))
        .unwrap();
    assert_eq!(header(down, dead_letter_headers::DELIVERIES), Some("3"));
    assert_eq!(header(down, dead_letter_headers::KIND), Some("Handler"));
    assert_eq!(
        header(down, dead_letter_headers::ERROR),
        Some("billing is down")
    );
    assert_eq!(
        header(down, dead_letter_headers::CONSUMER),
        Some(h.name.as_str())
    );
    let perm = copies
        .iter()
        .find(|m| header(m, dead_letter_headers::MESSAGE_ID) == Some("evt-perm"))
        .unwrap();
    assert_eq!(header(perm, dead_letter_headers::DELIVERIES), Some("1"));
    h.end().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_the_messages_in_hand() {
    let h = Harness::new().await;
    let consumer = h
        .start(None, |_, _| {
            // Slow, not failing: the handler is still running when shutdown is asked for.
            std::thread::sleep(Duration::from_millis(400));
            None
        })
        .await;
    publish(
        &h.stream.context,
        h.stream.subject("shipped.o5"),
        Some("evt-5"),
        shipped(5),
    )
    .await;
    eventually(Duration::from_secs(10), "the handler to start", || async {
        h.deliveries.lock().unwrap().contains_key("evt-5")
    })
    .await;
    let report = consumer.shutdown().await.unwrap();
    assert_eq!(report.applied, 1, "the message in hand was finished");
    assert_eq!(h.effects("evt-5").await, 1);
    h.settled().await;
    h.end().await;
}

/// A handler that never returns (a call without a timeout): `shutdown` would wait for it
/// forever; `shutdown_timeout` aborts it after the timeout. Its transaction is rolled back,
/// the report counts the message abandoned, and the server's redelivery applies it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_timeout_abandons_a_hung_handler_to_redelivery() {
    let h = Harness::new().await;
    let hung = Consumer::builder(
        h.stream.context.clone(),
        h.db.pool.clone(),
        h.handler(|_, _| None, true),
    )
    .bind(&h.stream.name, &h.name)
    .start()
    .await
    .unwrap();
    publish_shipped(&h, 0, 1).await;
    eventually(Duration::from_secs(10), "the handler to start", || async {
        h.deliveries.lock().unwrap().len() == 1
    })
    .await;

    let asked = Instant::now();
    let report = hung
        .shutdown_timeout(Duration::from_millis(300))
        .await
        .unwrap();
    assert!(
        asked.elapsed() < Duration::from_secs(3),
        "shutdown_timeout returned after {:?}",
        asked.elapsed()
    );
    assert_eq!(report.abandoned, 1, "{report:?}");
    assert_eq!(report.applied, 0, "{report:?}");
    assert_eq!(
        h.effects("evt-0").await,
        0,
        "the hung handler's insert was rolled back"
    );
    // And its transaction is over: SQLite's one write lock is free again.
    tokio::time::timeout(
        Duration::from_secs(2),
        sqlx::query("INSERT INTO effects (event_id) VALUES ('probe')").execute(&h.db.pool),
    )
    .await
    .expect("the aborted handler's transaction still holds the write lock")
    .unwrap();

    // The server delivers it again after the ack wait (2 s); a working consumer applies
    // it once.
    let consumer = h.start(None, |_, _| None).await;
    h.settled().await;
    assert_eq!(h.deliveries.lock().unwrap()["evt-0"], [1, 2]);
    let report = consumer
        .shutdown_timeout(Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!((report.applied, report.abandoned), (1, 0), "{report:?}");
    applied_once(&h, 1).await;
    h.end().await;
}

/// Checks that events `evt-0` … `evt-{events - 1}` were each applied once.
async fn applied_once(h: &Harness, events: u64) {
    for n in 0..events {
        assert_eq!(
            h.effects(&format!("evt-{n}")).await,
            1,
            "evt-{n} applied once"
        );
    }
}

/// Whether the handler of
/// `dead_letters_are_listed_and_replayed_to_their_consumer_once_the_cause_is_fixed` still has
/// its bug.
static BROKEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// How many messages `stream` holds on `subject` (a filter), read through an ephemeral
/// consumer that acknowledges nothing.
async fn held_on(js: &Context, stream: &str, subject: String) -> u64 {
    let stream = js.get_stream(stream).await.unwrap();
    let mut reader = reader_of(&stream, subject).await;
    let pending = reader.info().await.unwrap().num_pending;
    let name = reader.cached_info().name.clone();
    let _ = stream.delete_consumer(&name).await;
    pending
}

/// Dead letters are listed with what the copy records and replayed to their consumer only:
/// its stream gets no new message, so no other consumer of the subject sees it again. A
/// replay while the handler still fails is dead-lettered again as the original message
/// (its id, subject and sequence); once the handler is fixed, the next replay is applied
/// once, the handler seeing the message as it was (id, subject, headers). Settled replays
/// are deleted from the replay stream; a copy without an id is left with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_and_replayed_to_their_consumer_once_the_cause_is_fixed() {
    use std::sync::atomic::Ordering::SeqCst;
    let js = jetstream().await;
    let h = Harness::new().await;
    let consumer = h
        .start(None, |id, _| {
            (id == "evt-1" && BROKEN.load(SeqCst))
                .then(|| HandlerError::permanent("the handler has a bug"))
        })
        .await;
    publish_shipped(&h, 0, 2).await;
    publish(&js, h.stream.subject("shipped.o9"), None, shipped(9)).await;
    h.settled().await;

    let copies = trellis_outbox::dead_letters(&js, &h.name, 10)
        .await
        .unwrap();
    assert_eq!(copies.len(), 2, "{copies:?}");
    let by_kind = |copies: &[trellis_outbox::DeadLetter], kind: &str| {
        copies
            .iter()
            .find(|c| c.kind.as_deref() == Some(kind))
            .unwrap_or_else(|| panic!("no {kind} copy in {copies:?}"))
            .clone()
    };
    let (bug, no_id) = (by_kind(&copies, "Handler"), by_kind(&copies, "MissingId"));
    let original = h.stream.subject("shipped.o1");
    assert_eq!(bug.message_id.as_deref(), Some("evt-1"));
    assert_eq!(bug.subject.as_deref(), Some(original.as_str()));
    assert_eq!(bug.stream.as_deref(), Some(h.stream.name.as_str()));
    let sequence = bug.stream_sequence.unwrap();
    assert_eq!(bug.deliveries, Some(1));
    assert!(
        bug.error
            .as_deref()
            .unwrap()
            .contains("the handler has a bug"),
        "{bug:?}"
    );
    assert_eq!(no_id.message_id, None);
    assert!(
        copies.windows(2).all(|w| w[0].sequence < w[1].sequence),
        "oldest first: {copies:?}"
    );
    assert_eq!(dead_letter_count(&js, &h.name, 1).await, 1, "the limit");

    // Replayed while the bug is still there: it fails again and is dead-lettered again, as
    // the message it was. Nothing was published to the consumer's own stream.
    let again = trellis_outbox::replay_dead_letters(&js, &h.name, 10)
        .await
        .unwrap();
    assert_eq!(again.replayed, 1, "{again:?}");
    assert_eq!(again.left.len(), 1, "{again:?}");
    assert_eq!(again.left[0].sequence, no_id.sequence);
    assert!(
        again.left[0].reason.contains("no `Trellis-Dlq-Msg-Id`"),
        "{again:?}"
    );
    assert_eq!(
        h.stream.count().await,
        3,
        "a replay adds nothing to the stream"
    );
    let replays = format!("{REPLAY_SUBJECT_PREFIX}.{}.>", h.name);
    let copy_again = eventually_value(
        Duration::from_secs(10),
        "the replay to fail again",
        || async {
            let copies = trellis_outbox::dead_letters(&js, &h.name, 10)
                .await
                .unwrap();
            copies
                .iter()
                .find(|c| c.kind.as_deref() == Some("Handler") && c.sequence != bug.sequence)
                .cloned()
        },
    )
    .await;
    assert_eq!(copy_again.message_id.as_deref(), Some("evt-1"));
    assert_eq!(copy_again.subject.as_deref(), Some(original.as_str()));
    assert_eq!(copy_again.stream.as_deref(), Some(h.stream.name.as_str()));
    assert_eq!(copy_again.stream_sequence, Some(sequence));
    assert_eq!(copy_again.deliveries, Some(1));
    assert_eq!(
        trellis_outbox::dead_letters(&js, &h.name, 10)
            .await
            .unwrap()
            .iter()
            .map(|c| c.sequence)
            .collect::<Vec<_>>(),
        [no_id.sequence, copy_again.sequence],
        "the first copy was deleted"
    );

    // Fixed: the next replay is applied once.
    BROKEN.store(false, SeqCst);
    let report = trellis_outbox::replay_dead_letters(&js, &h.name, 10)
        .await
        .unwrap();
    assert_eq!(report.replayed, 1, "{report:?}");
    assert_eq!(report.left.len(), 1, "{report:?}");
    eventually(
        Duration::from_secs(10),
        "the replayed message to be applied",
        || async { h.effects("evt-1").await == 1 },
    )
    .await;
    assert_eq!(
        h.deliveries.lock().unwrap()["evt-1"],
        [1, 1, 1],
        "each replay a first delivery"
    );
    let seen = Replayed {
        id: "evt-1".into(),
        subject: original.clone(),
        header_id: Some("evt-1".into()),
        copy_headers: false,
        stream_sequence: sequence,
    };
    assert_eq!(*h.replays.lock().unwrap(), [seen.clone(), seen]);
    eventually(
        Duration::from_secs(10),
        "settled replays to be deleted",
        || async { held_on(&js, REPLAY_STREAM, replays.clone()).await == 0 },
    )
    .await;
    let left = trellis_outbox::dead_letters(&js, &h.name, 10)
        .await
        .unwrap();
    assert_eq!(
        left.iter().map(|c| c.sequence).collect::<Vec<_>>(),
        [no_id.sequence]
    );
    assert_eq!(h.stream.count().await, 3);
    assert!(matches!(
        trellis_outbox::replay_dead_letters(&js, "a.b", 10).await,
        Err(ConsumerError::InvalidOptions {
            option: "consumer",
            ..
        })
    ));
    each_applied_once(h, consumer, 2).await;
}

/// Replays wait in the replay stream while their consumer is down and are applied when it
/// starts. A replay stored before (a replay run stopped before it deleted the copy) is not
/// stored twice: the copy is deleted and counted. A copy whose replay subject holds another
/// message (the dead-letter stream was recreated, its sequences began again) is left. A
/// restart with other deliveries brings the replay durable's `max_deliver` up to date.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_wait_for_their_consumer_and_are_stored_once() {
    use std::sync::atomic::Ordering::SeqCst;
    static FAILING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
    let js = jetstream().await;
    let h = Harness::new().await;
    let consumer = h
        .start(None, |id, _| {
            (id != "evt-0" && FAILING.load(SeqCst)).then(|| HandlerError::permanent("not yet"))
        })
        .await;
    publish_shipped(&h, 0, 4).await;
    h.settled().await;
    consumer.shutdown().await.unwrap();
    let copies = trellis_outbox::dead_letters(&js, &h.name, 10)
        .await
        .unwrap();
    assert_eq!(copies.len(), 3, "{copies:?}");
    let id_of = |n: usize| copies[n].message_id.clone().unwrap();
    let (two, three) = (id_of(1), id_of(2));
    let on = |n: usize| format!("{REPLAY_SUBJECT_PREFIX}.{}.{}", h.name, copies[n].sequence);
    let store = |subject: String, headers: HeaderMap, payload: bytes::Bytes| {
        let js = js.clone();
        async move {
            js.publish_with_headers(subject, headers, payload)
                .await
                .unwrap()
                .await
                .unwrap();
        }
    };
    // An earlier replay run stored the second copy's replay, then stopped before deleting
    // the copy: the same id, `replay:` and the copy's.
    let copy_id = copies[1].headers.get("Nats-Msg-Id").unwrap().as_str();
    let earlier = format!("replay:{copy_id}");
    let mut headers = copies[1].headers.clone();
    headers.insert("Nats-Msg-Id", earlier.as_str());
    store(on(1), headers, copies[1].payload.clone()).await;
    // The third copy's replay subject holds another message.
    let mut other = HeaderMap::new();
    other.insert("Nats-Msg-Id", format!("other-{}", h.name).as_str());
    other.insert(dead_letter_headers::MESSAGE_ID, "evt-other");
    other.insert(
        dead_letter_headers::SUBJECT,
        h.stream.subject("shipped.o99").as_str(),
    );
    store(on(2), other, shipped(99).into()).await;

    let report = trellis_outbox::replay_dead_letters(&js, &h.name, 10)
        .await
        .unwrap();
    assert_eq!(report.replayed, 2, "{report:?}");
    assert_eq!(report.left.len(), 1, "{report:?}");
    assert_eq!(report.left[0].message_id.as_deref(), Some(three.as_str()));
    assert!(
        report.left[0].reason.contains("holds another message"),
        "{report:?}"
    );
    let left = trellis_outbox::dead_letters(&js, &h.name, 10)
        .await
        .unwrap();
    assert_eq!(
        left.iter().map(|c| c.sequence).collect::<Vec<_>>(),
        [copies[2].sequence]
    );
    let replays = format!("{REPLAY_SUBJECT_PREFIX}.{}.>", h.name);
    assert_eq!(held_on(&js, REPLAY_STREAM, replays.clone()).await, 3);
    assert_eq!(held_on(&js, REPLAY_STREAM, on(1)).await, 1, "stored once");
    let kept = js
        .get_stream(REPLAY_STREAM)
        .await
        .unwrap()
        .get_last_raw_message_by_subject(&on(1))
        .await
        .unwrap();
    assert_eq!(
        kept.headers.get("Nats-Msg-Id").map(|v| v.as_str()),
        Some(earlier.as_str()),
        "the replay stored before is kept, not replaced"
    );

    // The consumer starts again, fixed and with other deliveries: the replays are applied,
    // once each.
    FAILING.store(false, SeqCst);
    let consumer = h.start(Some(7), |_, _| None).await;
    let durable = js
        .get_stream(REPLAY_STREAM)
        .await
        .unwrap()
        .consumer_info(&h.name)
        .await
        .unwrap();
    assert_eq!(durable.config.max_deliver, 8, "brought up to date");
    eventually(
        Duration::from_secs(10),
        "the replays to be applied",
        || async {
            h.effects(&id_of(0)).await == 1
                && h.effects(&two).await == 1
                && h.effects("evt-other").await == 1
        },
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "settled replays to be deleted",
        || async { held_on(&js, REPLAY_STREAM, replays.clone()).await == 0 },
    )
    .await;
    assert_eq!(h.effects(&three).await, 0, "its copy stays");
    assert_eq!(
        h.stream.count().await,
        4,
        "a replay adds nothing to the stream"
    );
    let report = consumer.shutdown().await.unwrap();
    assert_eq!(report.applied, 3);
    h.end().await;
}

/// A consumer started with replays off has no durable reading them: its dead letters are
/// not replayed (the copies stay), with the reason. A consumer without dead letters is read
/// at once, without waiting out a fetch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_not_replayed_where_nothing_would_read_them() {
    let js = jetstream().await;
    let h = Harness::new().await;
    let failures = h.failures.clone();
    let consumer = Consumer::builder(
        h.stream.context.clone(),
        h.db.pool.clone(),
        h.handler(|_, _| Some(HandlerError::permanent("always")), false),
    )
    .bind(&h.stream.name, &h.name)
    .replays(false)
    .on_error(move |f| failures.lock().unwrap().push(f.clone()))
    .start()
    .await
    .unwrap();
    publish_shipped(&h, 0, 1).await;
    h.settled().await;
    consumer.shutdown().await.unwrap();
    assert_eq!(dead_letter_count(&js, &h.name, 10).await, 1);
    match trellis_outbox::replay_dead_letters(&js, &h.name, 10).await {
        Err(ConsumerError::ReplayRefused { consumer, problem }) => {
            assert_eq!(consumer, h.name);
            assert!(problem.contains("no durable"), "{problem}");
        }
        other => panic!("expected ReplayRefused, got {other:?}"),
    }
    assert_eq!(
        dead_letter_count(&js, &h.name, 10).await,
        1,
        "the copy stays"
    );
    // The dead-letter stream holds copies (this test's), none of this consumer's.
    let started = Instant::now();
    let nobody = consumer_name();
    assert!(
        trellis_outbox::dead_letters(&js, &nobody, 10)
            .await
            .unwrap()
            .is_empty()
    );
    let report = trellis_outbox::replay_dead_letters(&js, &nobody, 10)
        .await
        .unwrap();
    assert_eq!(report.replayed, 0);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "read without waiting out a fetch: {:?}",
        started.elapsed()
    );
    h.end().await;
}

/// Durable names are unique per stream only: a consumer of the same name on another stream
/// cannot start with replays on (the replay durable serves the first one's stream), and a
/// copy that consumer dead-lettered is not replayed to the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_durable_serves_the_consumer_of_one_stream() {
    let js = jetstream().await;
    let h = Harness::new().await;
    let consumer = h.start(None, |_, _| None).await;
    let other = TestStream::events(&js).await;
    durable(&other, &h.name, Duration::from_secs(2), 10).await;
    let refused = Consumer::builder(js.clone(), h.db.pool.clone(), h.handler(|_, _| None, false))
        .bind(&other.name, &h.name)
        .start()
        .await;
    match refused {
        Err(ConsumerError::Unsuitable {
            stream, problem, ..
        }) => {
            assert_eq!(stream, REPLAY_STREAM);
            assert!(
                problem.contains("another consumer of that name"),
                "{problem}"
            );
        }
        other => panic!("expected Unsuitable, got {other:?}"),
    }
    // With replays off it starts.
    let second = Consumer::builder(js.clone(), h.db.pool.clone(), h.handler(|_, _| None, false))
        .bind(&other.name, &h.name)
        .replays(false)
        .start()
        .await
        .unwrap();
    // A copy the consumer of the other stream made.
    let mut headers = HeaderMap::new();
    headers.insert(
        "Nats-Msg-Id",
        format!("dlq:{}:{}:1", h.name, other.name).as_str(),
    );
    headers.insert(dead_letter_headers::MESSAGE_ID, "evt-elsewhere");
    headers.insert(
        dead_letter_headers::SUBJECT,
        other.subject("shipped.o1").as_str(),
    );
    headers.insert(dead_letter_headers::STREAM, other.name.as_str());
    headers.insert(dead_letter_headers::STREAM_SEQUENCE, "1");
    js.publish_with_headers(
        format!("{DEAD_LETTER_SUBJECT_PREFIX}.{}", h.name),
        headers,
        shipped(1).into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let report = trellis_outbox::replay_dead_letters(&js, &h.name, 10)
        .await
        .unwrap();
    assert_eq!(report.replayed, 0, "{report:?}");
    assert_eq!(report.left.len(), 1, "{report:?}");
    assert!(
        report.left[0].reason.contains("serves another"),
        "{report:?}"
    );
    assert_eq!(
        dead_letter_count(&js, &h.name, 10).await,
        1,
        "the copy stays"
    );
    second.shutdown().await.unwrap();
    consumer.shutdown().await.unwrap();
    other.delete().await;
    h.end().await;
}

/// A replay stored before, found on its subject once the stream's duplicate window has
/// passed (the publish is refused, not dropped as a duplicate), is recognised by its id: the
/// copy is deleted and counted, the stored replay kept. On a private server, whose replay
/// stream has a short duplicate window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_stored_before_is_recognised_after_the_duplicate_window() {
    use trellis_outbox_tests::nats_server::NatsServer;
    let server = NatsServer::start();
    let js = private_dead_letters(&server).await;
    let window = Duration::from_millis(200);
    replay_stream(&js, "billing", |config| config.duplicate_window = window).await;
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", "dlq:billing:ORDERS:7");
    headers.insert(dead_letter_headers::SUBJECT, "orders.shipped.o7");
    let sequence = store_copy(&js, "evt-7", headers.clone(), shipped(7)).await;
    // The earlier run's replay of that copy.
    let subject = format!("{REPLAY_SUBJECT_PREFIX}.billing.{sequence}");
    headers.insert(dead_letter_headers::MESSAGE_ID, "evt-7");
    headers.insert("Nats-Msg-Id", "replay:dlq:billing:ORDERS:7");
    js.publish_with_headers(subject.clone(), headers, shipped(7).into())
        .await
        .unwrap()
        .await
        .unwrap();
    tokio::time::sleep(window * 3).await;

    let report = trellis_outbox::replay_dead_letters(&js, "billing", 10)
        .await
        .unwrap();
    assert_eq!(report.replayed, 1, "{report:?}");
    assert!(report.left.is_empty(), "{report:?}");
    assert!(
        trellis_outbox::dead_letters(&js, "billing", 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(held_on(&js, REPLAY_STREAM, subject).await, 1, "stored once");
}

/// A replay stream that would not keep replays until they are read and settled (memory
/// storage: gone in a server restart; deletes denied: settled replays could not be deleted)
/// gets no replay, and the copy stays. On a private server, whose replay stream the test
/// makes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_are_refused_where_the_replay_stream_would_lose_or_keep_them() {
    use async_nats::jetstream::stream::StorageType;
    use trellis_outbox_tests::nats_server::NatsServer;
    let server = NatsServer::start();
    let js = private_dead_letters(&server).await;
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", "dlq:billing:ORDERS:7");
    store_copy(&js, "evt-7", headers, shipped(7)).await;
    for (storage, deny_delete, why) in [
        (StorageType::Memory, false, "Memory storage"),
        (StorageType::File, true, "denies deletes"),
    ] {
        replay_stream(&js, "billing", |config| {
            config.storage = storage;
            config.deny_delete = deny_delete;
        })
        .await;
        match trellis_outbox::replay_dead_letters(&js, "billing", 10).await {
            Err(ConsumerError::ReplayRefused { consumer, problem }) => {
                assert_eq!(consumer, "billing");
                assert!(problem.contains(why), "{problem}");
            }
            other => panic!("expected ReplayRefused ({why}), got {other:?}"),
        }
        assert_eq!(
            dead_letter_count(&js, "billing", 10).await,
            1,
            "the copy stays"
        );
        js.delete_stream(REPLAY_STREAM).await.unwrap();
    }
}

/// A copy that fits the server's `max_payload` but whose replay would not (written by
/// another tool without a `Nats-Msg-Id`, so the replay's id is longer than anything the copy
/// loses) is left in place with the reason, and the run goes on to replay the next copy.
/// On a private server whose `max_payload` (4 KiB) is set in a configuration file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_whose_replay_would_exceed_max_payload_is_left_and_the_rest_replayed() {
    use trellis_outbox_tests::nats_server::NatsServer;
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(config.path(), "max_payload: 4096\n").unwrap();
    let server = NatsServer::start_with_args(&["-c", config.path().to_str().unwrap()]);
    let js = private_dead_letters(&server).await;
    let max_payload = js.client().server_info().max_payload;
    assert_eq!(max_payload, 4096, "the configuration file set max_payload");
    // The copy's headers as NATS counts them ("NATS/1.0\r\n", "<name>: <value>\r\n" each,
    // "\r\n"): the payload fills the rest, so the copy fits exactly.
    let big = {
        let mut headers = HeaderMap::new();
        headers.insert(dead_letter_headers::MESSAGE_ID, "evt-big");
        headers.insert(dead_letter_headers::SUBJECT, "orders.shipped.big");
        headers
    };
    let wire = 10
        + 2
        + big.iter().fold(0, |sum, (name, values)| {
            sum + values
                .iter()
                .map(|v| AsRef::<str>::as_ref(name).len() + 2 + v.as_str().len() + 2)
                .sum::<usize>()
        });
    store_copy(&js, "evt-big", big, vec![b'x'; max_payload - wire]).await;
    let mut small = HeaderMap::new();
    small.insert("Nats-Msg-Id", "dlq:billing:ORDERS:8");
    store_copy(&js, "evt-8", small, shipped(8)).await;
    replay_stream(&js, "billing", |_| {}).await;

    let report = trellis_outbox::replay_dead_letters(&js, "billing", 10)
        .await
        .unwrap();
    assert_eq!(report.replayed, 1, "{report:?}");
    assert_eq!(report.left.len(), 1, "{report:?}");
    assert_eq!(report.left[0].message_id.as_deref(), Some("evt-big"));
    assert!(
        report.left[0].reason.contains("max_payload"),
        "{}",
        report.left[0].reason
    );
    let left = trellis_outbox::dead_letters(&js, "billing", 10)
        .await
        .unwrap();
    assert_eq!(
        left.len(),
        1,
        "the large copy stays, the replayed one is gone"
    );
    assert_eq!(left[0].message_id.as_deref(), Some("evt-big"));
    let mut replays = js.get_stream(REPLAY_STREAM).await.unwrap();
    assert_eq!(replays.info().await.unwrap().state.messages, 1);
}

/// A connection to a private server whose dead-letter stream the test makes.
async fn private_dead_letters(server: &trellis_outbox_tests::nats_server::NatsServer) -> Context {
    let js = trellis_outbox_tests::nats::connect_reconnecting(&server.url()).await;
    js.create_stream(Config {
        name: DEAD_LETTER_STREAM.into(),
        subjects: vec![format!("{DEAD_LETTER_SUBJECT_PREFIX}.>")],
        ..Config::default()
    })
    .await
    .unwrap();
    js
}

/// Stores a dead-letter copy of consumer `billing`'s message `id` (subject
/// `orders.shipped.<id>` unless `headers` names one) with `headers`, as a tool would; returns
/// its sequence.
async fn store_copy(js: &Context, id: &str, mut headers: HeaderMap, payload: Vec<u8>) -> u64 {
    headers.insert(dead_letter_headers::MESSAGE_ID, id);
    if headers.get(dead_letter_headers::SUBJECT).is_none() {
        headers.insert(
            dead_letter_headers::SUBJECT,
            format!("orders.shipped.{id}").as_str(),
        );
    }
    js.publish_with_headers(
        format!("{DEAD_LETTER_SUBJECT_PREFIX}.billing"),
        headers,
        payload.into(),
    )
    .await
    .unwrap()
    .await
    .unwrap()
    .sequence
}

/// Makes the replay stream as `replay_dead_letters` wants it, changed by `adjust`, and
/// `consumer`'s durable on it.
async fn replay_stream(js: &Context, consumer: &str, adjust: impl FnOnce(&mut Config)) {
    let mut config = Config {
        name: REPLAY_STREAM.into(),
        subjects: vec![format!("{REPLAY_SUBJECT_PREFIX}.>")],
        max_messages_per_subject: 1,
        discard: async_nats::jetstream::stream::DiscardPolicy::New,
        discard_new_per_subject: true,
        ..Config::default()
    };
    adjust(&mut config);
    let replays = js.create_stream(config).await.unwrap();
    replays
        .create_consumer(PullConfig {
            durable_name: Some(consumer.into()),
            filter_subject: format!("{REPLAY_SUBJECT_PREFIX}.{consumer}.>"),
            ack_policy: AckPolicy::Explicit,
            ..PullConfig::default()
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn create_builds_the_stream_from_the_subject_template_and_bad_options_are_refused() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    let js = jetstream().await;
    let stream_name = format!("TRELLIS_T_{}", ulid::Ulid::generate());
    // Unique: the name's replay durable on the shared replay stream serves one stream.
    let name = consumer_name();
    let noop = || {
        handler_fn(
            |_: &mut Transaction<'static, Sqlite>, _: Delivered<Shipped>| {
                Box::pin(async { Ok(()) })
            },
        )
    };
    let consumer = Consumer::builder(js.clone(), db.pool.clone(), noop())
        .create(&stream_name, &name)
        .max_deliveries(4)
        .start()
        .await
        .unwrap();
    let mut stream = js.get_stream(&stream_name).await.unwrap();
    let info = stream.info().await.unwrap().clone();
    assert_eq!(
        info.config.subjects,
        vec![Shipped::SUBJECT_TEMPLATE.replace("{order}", "*")]
    );
    let consumer_info = stream.consumer_info(&name).await.unwrap();
    // One spare server delivery beyond ours.
    assert_eq!(consumer_info.config.max_deliver, 5);
    assert_eq!(consumer_info.config.ack_policy, AckPolicy::Explicit);
    consumer.shutdown().await.unwrap();

    // More deliveries than the server's max_deliver, no consumer named, no concurrency.
    let refused = |result: Result<ConsumerHandle, ConsumerError>, option: &str| match result {
        Err(ConsumerError::InvalidOptions {
            option: got,
            problem,
        }) => {
            assert_eq!(got, option, "{problem}");
        }
        Err(other) => panic!("expected InvalidOptions({option}), got {other}"),
        Ok(_) => panic!("expected InvalidOptions({option})"),
    };
    refused(
        Consumer::builder(js.clone(), db.pool.clone(), noop())
            .bind(&stream_name, &name)
            .max_deliveries(6)
            .start()
            .await,
        "max_deliveries",
    );
    refused(
        Consumer::builder(js.clone(), db.pool.clone(), noop())
            .start()
            .await,
        "bind/create",
    );
    refused(
        Consumer::builder(js.clone(), db.pool.clone(), noop())
            .bind(&stream_name, &name)
            .concurrency(0)
            .start()
            .await,
        "concurrency",
    );
    match Consumer::builder(js.clone(), db.pool.clone(), noop())
        .bind(&stream_name, "nobody")
        .start()
        .await
    {
        Err(err @ ConsumerError::Consumer { .. }) => {
            assert!(err.to_string().contains("nobody"), "{err}");
        }
        other => panic!(
            "expected ConsumerError::Consumer, got {:?}",
            other.map(|_| ())
        ),
    }
    let _ = js.delete_stream(&stream_name).await;
    if let Ok(replays) = js.get_stream(REPLAY_STREAM).await {
        let _ = replays.delete_consumer(&name).await;
    }
}
