//! Consume benchmark: JetStream → Postgres, `Consumer` against a hand-written inbox loop.
//!
//! ```text
//! cargo run --release --example bench -- consume [--quick] [--concurrency N]
//! ```
//!
//! M events (20,000; `--quick` 5,000; about 200 bytes of JSON each, unique `Nats-Msg-Id`) are
//! published once, untimed, to a file-storage stream. Each round runs both sides, alternating
//! which goes first; before each side's run the inbox and business tables are truncated
//! (untimed) and a fresh durable pull consumer (explicit ack, deliver all) is created, so both
//! read the same M messages under the same conditions. Both pull with
//! `max_messages_per_batch(concurrency)` and apply `concurrency` (default 16) messages at
//! once on the same 16-connection pool:
//!
//! * ours: `Consumer::builder(…).bind(stream, durable).concurrency(16)` with its default
//!   options (keep-alive and dead letters on), a handler inserting the business row;
//! * baseline: a hand-written loop on its own task that takes a semaphore permit, pulls the
//!   next message and spawns a task doing exactly: begin, `INSERT INTO trellis_inbox … ON
//!   CONFLICT DO NOTHING` (checking the affected rows), the business insert, commit, ack.
//!
//! A side's clock runs from binding the consumer until a poll every millisecond sees its M-th
//! commit (the consumer's `report().applied`; the baseline's counter, bumped at the same
//! point), so both stop the same way. (A first version ran the baseline as
//! `for_each_concurrent` on `main`'s own thread, where every future shares one task, and
//! stopped only ours by polling: that made ours look 10–20 % faster, an artifact.) After each
//! run the business table must hold exactly M rows (the run fails otherwise). Each round line
//! also shows the process's CPU time per event on each side (`/proc/self/stat`, 10 ms ticks).
//!
//! Prints `BENCH name=consume_pg ours=<events/s> baseline=<events/s> ratio=<ours/baseline>`
//! (medians; the ratio is the median of the per-round ratios).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::stream::{Config, StorageType};
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres, Transaction};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use trellis_outbox::{Consumer, Delivered, HandlerError, handler_fn};
use trellis_outbox_tests::TestPg;

use crate::{BoxError, Rates};

/// The event, about 200 bytes of JSON (the other benches' `OrderShipped`).
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Shipped {
    order_id: String,
    customer_id: String,
    carrier: String,
    tracking_number: String,
    items: Vec<String>,
    total_cents: i64,
}

fn event(n: u64) -> Shipped {
    Shipped {
        order_id: format!("ord-{n:012}"),
        customer_id: "cus-0000000000042".into(),
        carrier: "ACME Freight".into(),
        tracking_number: format!("1Z{n:016}"),
        items: vec!["sku-123".into(), "sku-456".into(), "sku-789".into()],
        total_cents: 129_990 + n as i64,
    }
}

const BUSINESS_INSERT: &str = "INSERT INTO shipments (event_id, order_id, tracking_number, total_cents) VALUES ($1, $2, $3, $4)";
const INBOX_INSERT: &str = "INSERT INTO trellis_inbox (message_id, received_at) VALUES ($1, $2) \
     ON CONFLICT DO NOTHING";

async fn business_insert(
    tx: &mut Transaction<'static, Postgres>,
    id: &str,
    event: &Shipped,
) -> Result<(), sqlx::Error> {
    sqlx::query(BUSINESS_INSERT)
        .bind(id)
        .bind(&event.order_id)
        .bind(&event.tracking_number)
        .bind(event.total_cents)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// One message by hand: begin, inbox insert (checking the affected rows), business insert,
/// commit (then `applied` is bumped, where the consumer bumps its own count), ack.
async fn apply_by_hand(
    pool: &PgPool,
    message: async_nats::jetstream::Message,
    applied: &AtomicU64,
) -> Result<(), BoxError> {
    let id = message
        .headers
        .as_ref()
        .and_then(|h| h.get("Nats-Msg-Id"))
        .ok_or("a message without Nats-Msg-Id")?
        .as_str()
        .to_owned();
    let event: Shipped = serde_json::from_slice(&message.payload)?;
    let mut tx = pool.begin().await?;
    let inserted = sqlx::query(INBOX_INSERT)
        .bind(&id)
        .bind(chrono::Utc::now())
        .execute(&mut *tx)
        .await?
        .rows_affected();
    if inserted == 1 {
        business_insert(&mut tx, &id, &event).await?;
        tx.commit().await?;
        applied.fetch_add(1, Ordering::Relaxed);
    } else {
        tx.rollback().await?;
    }
    message.ack().await?;
    Ok(())
}

/// The hand-written loop: at most `concurrency` messages in hand, each applied by
/// [`apply_by_hand`] on its own task (a semaphore permit taken before pulling the next).
async fn pull_by_hand(
    pool: PgPool,
    consumer: PullConsumer,
    events: u64,
    concurrency: usize,
    applied: Arc<AtomicU64>,
) -> Result<(), BoxError> {
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(concurrency)
        .messages()
        .await?;
    let permits = Arc::new(Semaphore::new(concurrency));
    let mut tasks = JoinSet::new();
    for _ in 0..events {
        let permit = permits.clone().acquire_owned().await?;
        let message = messages.next().await.ok_or("the message stream ended")??;
        let (pool, applied) = (pool.clone(), applied.clone());
        tasks.spawn(async move {
            let outcome = apply_by_hand(&pool, message, &applied).await;
            drop(permit);
            outcome
        });
        while let Some(done) = tasks.try_join_next() {
            done??;
        }
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(())
}

/// Waits until `applied()` reaches `events`, looking every millisecond (both sides alike).
async fn wait_applied(events: u64, applied: impl Fn() -> u64) {
    while applied() < events {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The baseline on its own task (as the consumer runs on its own), timed from binding the
/// consumer until `events` are applied.
async fn baseline(
    pool: &PgPool,
    js: &Context,
    stream: &str,
    durable: &str,
    events: u64,
    concurrency: usize,
) -> Result<Duration, BoxError> {
    let start = Instant::now();
    let consumer: PullConsumer = js.get_consumer_from_stream(durable, stream).await?;
    let applied = Arc::new(AtomicU64::new(0));
    let puller = tokio::spawn(pull_by_hand(
        pool.clone(),
        consumer,
        events,
        concurrency,
        applied.clone(),
    ));
    wait_applied(events, || applied.load(Ordering::Relaxed)).await;
    let elapsed = start.elapsed();
    puller.await??;
    Ok(elapsed)
}

/// trellis-outbox's `Consumer` with the same concurrency, timed from binding the consumer
/// until it has applied `events`.
async fn ours(
    pool: &PgPool,
    js: &Context,
    stream: &str,
    durable: &str,
    events: u64,
    concurrency: usize,
) -> Result<Duration, BoxError> {
    let start = Instant::now();
    let consumer = Consumer::builder(
        js.clone(),
        pool.clone(),
        handler_fn(
            |tx: &mut Transaction<'static, Postgres>, d: Delivered<Shipped>| {
                Box::pin(async move {
                    business_insert(tx, &d.id, &d.event).await?;
                    Ok::<(), HandlerError>(())
                })
            },
        ),
    )
    .bind(stream, durable)
    .concurrency(concurrency)
    .start()
    .await?;
    wait_applied(events, || consumer.report().applied).await;
    let elapsed = start.elapsed();
    let report = consumer.shutdown().await?;
    if report.applied != events || report.duplicates != 0 {
        return Err(format!("expected {events} applied, no duplicates: {report:?}").into());
    }
    Ok(elapsed)
}

/// The CPU time this process has used so far (user + system), from `/proc/self/stat`; 0
/// where that cannot be read.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name (which is in parentheses and may hold spaces).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of stat(5), 12 and 13 after the name; 100 ticks/s.
    (ticks(11) + ticks(12)) / 100.0
}

/// Publishes `events` events (pipelined, 1,000 acks in flight at most).
async fn publish(js: &Context, token: &str, events: u64) -> Result<(), BoxError> {
    let mut n = 0;
    while n < events {
        let take = (events - n).min(1_000);
        let mut acks = Vec::with_capacity(take as usize);
        for i in n..n + take {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", ulid::Ulid::generate().to_string().as_str());
            headers.insert(
                "Trellis-Event-Time",
                trellis_outbox::format_timestamp(chrono::Utc::now()).as_str(),
            );
            acks.push(
                js.publish_with_headers(
                    format!("{token}.orders.shipped.o{i}"),
                    headers,
                    serde_json::to_vec(&event(i))?.into(),
                )
                .await?,
            );
        }
        for ack in acks {
            ack.await?;
        }
        n += take;
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Baseline,
    Ours,
}

pub(crate) async fn bench(args: &[String]) -> Result<(), BoxError> {
    let quick = args.iter().any(|a| a == "--quick");
    let concurrency = match args.iter().position(|a| a == "--concurrency") {
        Some(i) => args
            .get(i + 1)
            .ok_or("--concurrency needs a value")?
            .parse()?,
        None => 16,
    };
    let (rounds, events) = if quick { (3, 5_000) } else { (5, 20_000) };
    let pg = TestPg::new().await;
    trellis_outbox::migrate(&pg.pool).await?;
    sqlx::raw_sql(
        "CREATE TABLE shipments (event_id text PRIMARY KEY, order_id text NOT NULL, \
         tracking_number text NOT NULL, total_cents bigint NOT NULL)",
    )
    .execute(&pg.pool)
    .await?;
    let pool = PgPoolOptions::new()
        .max_connections(16.max(concurrency as u32))
        .connect_with(pg.options.clone())
        .await?;
    let js = trellis_outbox_tests::nats::jetstream().await;
    let ulid = ulid::Ulid::generate().to_string();
    let token = format!("consume{}", ulid.to_lowercase());
    let stream = format!("TRELLIS_CONSUME_{ulid}");
    js.create_stream(Config {
        name: stream.clone(),
        subjects: vec![format!("{token}.>")],
        storage: StorageType::File,
        ..Config::default()
    })
    .await?;
    println!(
        "consume: {rounds} rounds of {events} events from file-backed stream {stream}, \
         concurrency {concurrency} on both sides, median events/s"
    );
    let outcome = async {
        publish(&js, &token, events).await?;
        let mut rates = Rates::default();
        let mut runs = 0_u32;
        for round in 0..rounds {
            let order = if round % 2 == 0 {
                [Side::Baseline, Side::Ours]
            } else {
                [Side::Ours, Side::Baseline]
            };
            let mut line = format!(" round {}:", round + 1);
            for side in order {
                sqlx::raw_sql("TRUNCATE trellis_inbox, shipments")
                    .execute(&pool)
                    .await?;
                runs += 1;
                // Unique: a consumer's replay durable (on the shared replay stream) serves one
                // stream's consumer of that name.
                let durable = format!("bench{runs}{}", ulid.to_lowercase());
                let js_stream = js.get_stream(&stream).await?;
                js_stream
                    .create_consumer(PullConfig {
                        durable_name: Some(durable.clone()),
                        ack_policy: AckPolicy::Explicit,
                        deliver_policy: DeliverPolicy::All,
                        ..PullConfig::default()
                    })
                    .await?;
                let cpu_before = cpu_seconds();
                let elapsed = match side {
                    Side::Baseline => {
                        baseline(&pool, &js, &stream, &durable, events, concurrency).await?
                    }
                    Side::Ours => ours(&pool, &js, &stream, &durable, events, concurrency).await?,
                };
                let rate = events as f64 / elapsed.as_secs_f64();
                let cpu_us = (cpu_seconds() - cpu_before) * 1e6 / events as f64;
                let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM shipments")
                    .fetch_one(&pool)
                    .await?;
                if rows != events as i64 {
                    return Err(format!("applied {rows} rows, expected {events}").into());
                }
                let _ = js_stream.delete_consumer(&durable).await;
                if let Ok(replays) = js.get_stream(trellis_outbox::REPLAY_STREAM).await {
                    let _ = replays.delete_consumer(&durable).await;
                }
                let (name, index) = match side {
                    Side::Baseline => ("baseline", 0),
                    Side::Ours => ("ours", 1),
                };
                line.push_str(&format!(" {name} {rate:.0}/s ({cpu_us:.0} µs CPU/event)"));
                rates.push(index, rate);
            }
            println!("{line}");
        }
        Ok::<_, BoxError>(rates)
    }
    .await;
    let _ = js.delete_stream(&stream).await;
    pool.close().await;
    pg.close().await;
    let rates = outcome?;
    let outcome = rates.outcome();
    crate::report(
        "consume_pg",
        &format!("{events} events, c={concurrency}: begin/inbox/insert/commit/ack  vs  Consumer"),
        outcome,
        ">= 0.9",
    );
    Ok(())
}
