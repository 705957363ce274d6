//! Relay benchmark: Postgres outbox → NATS JetStream, trellis-outbox against hand-written
//! baselines measured side by side in one run (issue 5, "Benchmark").
//!
//! ```text
//! cargo run --release --example bench -- relay [throughput|latency|rss|sweep|scale|ordered] [--quick] [--batch N] [--window N]
//!     [--dispatchers N[,M…]] [--own-runtime] [--keys N]
//! ```
//!
//! Needs Postgres at `DATABASE_URL` (a fresh database is created and dropped) and a NATS
//! server with JetStream at `NATS_URL` (uniquely named **file**-storage streams are created
//! and deleted).
//!
//! 1. **Throughput** (`throughput`). Rounds alternate the order of the sides. Before each
//!    drain the outbox table is truncated, rows are loaded untimed (`enqueue_all`, 1,000 per
//!    transaction, then `ANALYZE`) and the stream is purged; only the drain is timed, and
//!    after it the stream must hold exactly the loaded number of messages and no row may be
//!    left undispatched (the run fails otherwise).
//!    * ours: `dispatch_outbox(PgOutboxRepository, JetStreamPublisher, batch_size)` until
//!      the outbox is empty (the same engine `OutboxDispatcher` runs);
//!    * (a) naive relay: `BEGIN; SELECT … LIMIT 100 FOR UPDATE SKIP LOCKED`, publish all
//!      with the stored headers and `Nats-Msg-Id` = id, then await all acks, one
//!      `UPDATE … WHERE id = ANY($1)`, `COMMIT`;
//!    * (b) upstream's algorithm: a plain `SELECT … LIMIT 25` (no lock), then per row
//!      publish-and-await-ack and `UPDATE` that row. It is slow, so it drains a smaller
//!      load, and ours drains the same smaller load in the same round for its ratio.
//!
//!    Ratios are medians of the per-round ratios; rates are medians of rows/s.
//! 2. **Latency** (`latency`): a producer starts one transaction with one event every 1 ms
//!    (open loop: each transaction is its own task on a 16-connection pool, as concurrent
//!    request handlers would be, so a slow commit does not lower the offered rate of about
//!    1,000 events/s). Each event's payload carries a sequence number; the producer
//!    records the wall-clock time just before `tx.commit()`, and a core NATS subscription on
//!    the stream's subject (own connection) records when the message arrives. Two modes:
//!    (i) in-process, the producer calls `DispatcherHandle::notify()` after commit, and its
//!    outbox is built `without_notify()` (nobody listens; a `NOTIFY` would only serialize
//!    the commits);
//!    (ii) LISTEN/NOTIFY, the dispatcher is woken only by its `listen_postgres` listener, and
//!    the producer is a **separate process** (this binary re-executed with `--producer`) with
//!    its own pool, opened and warmed before its events are timed; it enqueues
//!    `without_notify()` and calls `Outbox::wake` after each commit.
//!    In both, the dispatcher has its own 4-connection pool, as the README recommends. Each
//!    mode also prints how much of the latency the commit itself took.
//!    First, the floor is measured the same way: a **dual write** (commit a business row,
//!    then publish the event directly and await its ack, no outbox) at the same rate;
//!    `BENCH name=latency_inprocess` and `latency_listen_notify` compare each mode's p99 with
//!    the floor's (ratio = floor / ours, higher is better; targets 0.5 and 0.4).
//!    The three modes run **interleaved**, in segments (quick: 10 of 300 events per mode;
//!    full: 20 of 500), each segment running the modes in a rotated order, so that each mode
//!    sees the same share of this machine's fast and slow spells; a mode's p99 is taken over
//!    its pooled samples. The first 5 % of each segment are dropped as warm-up (the
//!    segment's dispatcher, or producer process, has just started).
//! 3. **Peak RSS** (`rss`): loads 1,000,000 rows (quick: 100,000; untimed, 5,000 per
//!    transaction), then drains them with `dispatch_outbox` to a file-backed JetStream stream
//!    while a task samples `VmRSS` from `/proc/self/status` every 100 ms. When all three
//!    parts run, this part runs in a fresh child process so earlier parts' heap does not
//!    count.
//!
//! 4. **Scale-out** (`scale`, or `--dispatchers N[,M…]`; not in the default run): the same
//!    load drained by one relay and by N relays at once (each `dispatch_outbox` on its own
//!    4-connection pool and NATS connection, like separate relay processes) on one Postgres
//!    and one stream, alternating rounds. `BENCH name=relay_x{N}`: ours = N relays' rows/s,
//!    baseline = one relay's rows/s in the same run. `scale` alone means 2 and 4.
//!
//! 5. **Ordered** (`--keys N` or `ordered`, not in the default run): the same rows drained
//!    with `N` ordering keys (drawn at random per row) and without, alternating; `BENCH
//!    name=relay_ordered` compares ordered with unordered rows/s (target ratio 0.7).
//!
//! `--own-runtime` runs the in-process latency mode's dispatcher (with its pool and NATS
//! connection) on a separate one-worker tokio runtime, entered before
//! `DispatcherBuilder::start`.
//!
//! `sweep` (not in the default run) drains with several batch sizes and ack windows and prints
//! the time per batch spent claiming, publishing and marking; it was used to pick the
//! default `--batch 1000` (the ack window defaults to the library's 256).
//!
//! Machine-readable lines: `BENCH name=… ours=… baseline=… ratio=…`,
//! `LATENCY name=… p50_ms=… p99_ms=…`, `RSS name=drain_1m peak_mb=…`.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use async_nats::jetstream::stream::{Config, StorageType};
use futures::StreamExt;
use sqlx::types::Json;
use sqlx::{PgPool, Postgres};
use trellis_outbox::{
    Claim, ClaimRequest, DispatchOptions, Dispatched, DispatcherBuilder, DispatcherHandle,
    HandoffTarget, JetStreamPublisher, Outbox, OutboxDispatcher, OutboxMessage, OutboxRepository,
    OutboxTables, OutboxTransactionExt, PgOutboxRepository, PreparedOutboxRecord, PublishError,
    Publisher, dispatch_outbox,
};
use trellis_outbox_tests::TestPg;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const NAME: &str = "Orders.Shipped";

/// Settings from the command line.
#[derive(Debug, Clone, Copy)]
struct Settings {
    quick: bool,
    batch: usize,
    window: usize,
    /// `--own-runtime`: the in-process latency run's dispatcher runs on a runtime of its own.
    own_runtime: bool,
}

/// A domain event of realistic size (about 200 bytes of JSON).
fn event(n: u64) -> serde_json::Value {
    serde_json::json!({
        "orderId": format!("ord-{n:012}"),
        "customerId": "cus-0000000000042",
        "carrier": "ACME Freight",
        "trackingNumber": format!("1Z{n:016}"),
        "items": ["sku-123", "sku-456", "sku-789"],
        "totalCents": 129_990 + n,
    })
}

/// A file-storage stream capturing `<token>.>`, deleted by [`BenchStream::delete`].
struct BenchStream {
    js: Context,
    name: String,
    token: String,
}

impl BenchStream {
    async fn create(js: &Context) -> Result<Self, BoxError> {
        let ulid = ulid::Ulid::generate().to_string();
        let token = format!("relay{}", ulid.to_lowercase());
        let name = format!("TRELLIS_RELAY_{ulid}");
        js.create_stream(Config {
            name: name.clone(),
            subjects: vec![format!("{token}.>")],
            storage: StorageType::File,
            ..Config::default()
        })
        .await?;
        Ok(Self {
            js: js.clone(),
            name,
            token,
        })
    }

    fn subject(&self, rest: &str) -> String {
        format!("{}.{rest}", self.token)
    }

    async fn count(&self) -> Result<u64, BoxError> {
        let mut stream = self.js.get_stream(&self.name).await?;
        Ok(stream.info().await?.state.messages)
    }

    async fn purge(&self) -> Result<(), BoxError> {
        let stream = self.js.get_stream(&self.name).await?;
        stream.purge().await?;
        Ok(())
    }

    async fn delete(&self) {
        let _ = self.js.delete_stream(&self.name).await;
    }
}

/// A run's fresh database (migrated), JetStream context and stream.
async fn rig() -> Result<(TestPg, Context, BenchStream), BoxError> {
    let pg = TestPg::new().await;
    trellis_outbox::migrate(&pg.pool).await?;
    let js = trellis_outbox_tests::nats::jetstream().await;
    let stream = BenchStream::create(&js).await?;
    Ok((pg, js, stream))
}

/// Empties the outbox, loads `rows` pending events untimed (`enqueue_all` in chunks of
/// `chunk`), and refreshes the planner's statistics. With `keys`, each event gets one of
/// `keys` ordering keys drawn at random (seeded: both sides of a round see the same mix).
async fn load(
    pool: &PgPool,
    subject: &str,
    rows: u64,
    chunk: u64,
    keys: Option<u64>,
) -> Result<(), BoxError> {
    use rand::{RngExt, SeedableRng};
    sqlx::raw_sql("TRUNCATE trellis_outbox")
        .execute(pool)
        .await?;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(15);
    let mut n = 0;
    while n < rows {
        let take = (rows - n).min(chunk);
        let mut records = Vec::with_capacity(take as usize);
        for i in n..n + take {
            let record = PreparedOutboxRecord::event(NAME, subject, &event(i))?;
            records.push(match keys {
                Some(keys) => {
                    record.ordered_by(format!("order-{}", rng.random_range(0..keys.max(1))))
                }
                None => record,
            });
        }
        let mut tx = pool.begin().await?;
        tx.enqueue_all(records).await?;
        tx.commit().await?;
        n += take;
    }
    sqlx::raw_sql("ANALYZE trellis_outbox")
        .execute(pool)
        .await?;
    Ok(())
}

async fn pending(pool: &PgPool) -> Result<i64, BoxError> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM trellis_outbox WHERE state <> 'dispatched'")
            .fetch_one(pool)
            .await?,
    )
}

/// The headers a relay publishes a row with: the stored ones, `Nats-Msg-Id` = row id.
fn headers(id: &str, stored: &serde_json::Value) -> HeaderMap {
    let mut map = HeaderMap::new();
    if let Some(object) = stored.as_object() {
        for (name, value) in object {
            if let Some(value) = value.as_str()
                && !name.eq_ignore_ascii_case("Nats-Msg-Id")
            {
                map.insert(name.as_str(), value);
            }
        }
    }
    map.insert("Nats-Msg-Id", id);
    map
}

type RowTuple = (String, String, String, Json<serde_json::Value>);

/// Baseline (a): claim 100 with SKIP LOCKED, pipelined publish with msg-id, one UPDATE.
async fn naive_drain(pool: &PgPool, js: &Context) -> Result<u64, BoxError> {
    let mut total = 0;
    loop {
        let mut tx = pool.begin().await?;
        let rows: Vec<RowTuple> = sqlx::query_as(crate::LOCKED_CLAIM_PG)
            .fetch_all(&mut *tx)
            .await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(total);
        }
        let mut acks = Vec::with_capacity(rows.len());
        let mut ids = Vec::with_capacity(rows.len());
        for (id, subject, payload, stored) in rows {
            let ack = js
                .publish_with_headers(subject, headers(&id, &stored), payload.into())
                .await?;
            acks.push(ack);
            ids.push(id);
        }
        for ack in acks {
            ack.await?;
        }
        sqlx::query(
            "UPDATE trellis_outbox SET state = 'dispatched', updated_at = now() WHERE id = ANY($1)",
        )
        .bind(&ids)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        total += ids.len() as u64;
    }
}

/// Baseline (b), upstream's algorithm: claim 25 without a lock, then publish-and-await and
/// update one row at a time.
async fn upstream_drain(pool: &PgPool, js: &Context) -> Result<u64, BoxError> {
    let mut total = 0;
    loop {
        let rows: Vec<RowTuple> = sqlx::query_as(
            "SELECT id, subject, payload, headers FROM trellis_outbox \
             WHERE state IN ('pending', 'failed') AND (next_attempt_at IS NULL OR next_attempt_at <= now()) \
             ORDER BY created_at, id LIMIT 25",
        )
        .fetch_all(pool)
        .await?;
        if rows.is_empty() {
            return Ok(total);
        }
        for (id, subject, payload, stored) in rows {
            js.publish_with_headers(subject, headers(&id, &stored), payload.into())
                .await?
                .await?;
            sqlx::query(
                "UPDATE trellis_outbox SET state = 'dispatched', updated_at = now() WHERE id = $1",
            )
            .bind(&id)
            .execute(pool)
            .await?;
            total += 1;
        }
    }
}

fn publisher(js: &Context, settings: Settings) -> JetStreamPublisher {
    JetStreamPublisher::builder(js.clone())
        .ack_window(settings.window)
        .build()
}

/// Ours: `dispatch_outbox` until a claim comes back empty.
async fn ours_drain(pool: &PgPool, js: &Context, settings: Settings) -> Result<u64, BoxError> {
    let repo = PgOutboxRepository::new(pool.clone());
    let report = dispatch_outbox(
        &repo,
        &publisher(js, settings),
        DispatchOptions::new().batch_size(settings.batch),
    )
    .await?;
    if report.failed + report.dead > 0 {
        return Err(format!("dispatch_outbox reported {report:?}").into());
    }
    Ok(report.dispatched)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Ours,
    Naive,
    Upstream,
    /// Ours with the stage timers of the sweep.
    Timed,
}

static STAGES: std::sync::LazyLock<Arc<Stages>> = std::sync::LazyLock::new(Arc::default);

/// A point in one row's way through the dispatcher.
#[derive(Clone, Copy)]
enum Step {
    ClaimStarted = 0,
    Claimed = 1,
    PublishStarted = 2,
}

/// Per-row steps `(seq, step, wall-clock ns)` recorded by [`Timed`] while the latency part
/// runs (`None`: not recording). Rows are recognised by the `seq` field of their payload.
static ROW_STEPS: Mutex<Option<Vec<(u64, Step, u64)>>> = Mutex::new(None);

fn record_steps(messages: &[OutboxMessage], at: &[(Step, u64)]) {
    let mut steps = ROW_STEPS.lock().expect("not poisoned");
    let Some(steps) = steps.as_mut() else {
        return;
    };
    for message in messages {
        let seq = serde_json::from_str::<serde_json::Value>(&message.payload)
            .ok()
            .and_then(|v| v["seq"].as_u64());
        if let Some(seq) = seq {
            steps.extend(at.iter().map(|&(step, t)| (seq, step, t)));
        }
    }
}

/// Loads `rows`, purges the stream, times one drain, and verifies the result.
async fn timed_drain(
    pool: &PgPool,
    js: &Context,
    stream: &BenchStream,
    side: Side,
    rows: u64,
    settings: Settings,
) -> Result<f64, BoxError> {
    let subject = stream.subject("Orders.Shipped");
    load(pool, &subject, rows, 1_000, None).await?;
    stream.purge().await?;
    let start = Instant::now();
    let drained = match side {
        Side::Ours => ours_drain(pool, js, settings).await?,
        Side::Naive => naive_drain(pool, js).await?,
        Side::Upstream => upstream_drain(pool, js).await?,
        Side::Timed => {
            let stages = Arc::clone(&STAGES);
            let report = dispatch_outbox(
                &Timed {
                    inner: PgOutboxRepository::new(pool.clone()),
                    stages: stages.clone(),
                },
                &Timed {
                    inner: publisher(js, settings),
                    stages,
                },
                DispatchOptions::new().batch_size(settings.batch),
            )
            .await?;
            report.dispatched
        }
    };
    let elapsed = start.elapsed();
    let in_stream = stream.count().await?;
    let left = pending(pool).await?;
    if drained != rows || in_stream != rows || left != 0 {
        return Err(format!(
            "{side:?}: loaded {rows}, drained {drained}, stream holds {in_stream}, {left} rows not dispatched"
        )
        .into());
    }
    let rate = rows as f64 / elapsed.as_secs_f64();
    println!("  {side:?} {rows} rows: {rate:>9.0} rows/s ({elapsed:.2?})");
    Ok(rate)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// One line of the human-readable summary table.
type TableRow = (String, String, String);

async fn bench_throughput(settings: Settings, table: &mut Vec<TableRow>) -> Result<(), BoxError> {
    let (rounds, rows, small) = if settings.quick {
        (3, 20_000, 2_000)
    } else {
        (5, 100_000, 5_000)
    };
    let (pg, js, stream) = rig().await?;
    println!(
        "throughput: {rounds} rounds; {rows} rows for ours vs naive, {small} rows for ours vs upstream; \
         ours = dispatch_outbox batch_size {} ack_window {}; file-backed stream {}",
        settings.batch, settings.window, stream.name
    );
    let outcome = async {
        let (mut ours, mut naive, mut ours_small, mut upstream) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            println!(" round {}", round + 1);
            let flip = round % 2 == 1;
            for side in if flip {
                [Side::Naive, Side::Ours]
            } else {
                [Side::Ours, Side::Naive]
            } {
                let rate = timed_drain(&pg.pool, &js, &stream, side, rows, settings).await?;
                match side {
                    Side::Ours => ours.push(rate),
                    _ => naive.push(rate),
                }
            }
            for side in if flip {
                [Side::Ours, Side::Upstream]
            } else {
                [Side::Upstream, Side::Ours]
            } {
                let rate = timed_drain(&pg.pool, &js, &stream, side, small, settings).await?;
                match side {
                    Side::Ours => ours_small.push(rate),
                    _ => upstream.push(rate),
                }
            }
        }
        Ok::<_, BoxError>((ours, naive, ours_small, upstream))
    }
    .await;
    stream.delete().await;
    pg.close().await;
    let (ours, naive, ours_small, upstream) = outcome?;
    for (name, what, ours, base, target) in [
        (
            "relay_vs_naive",
            format!("{rows} rows: naive SKIP LOCKED relay (100, pipelined)"),
            ours,
            naive,
            1.5,
        ),
        (
            "relay_vs_upstream",
            format!("{small} rows: upstream (claim 25, publish+ack+update per row)"),
            ours_small,
            upstream,
            20.0,
        ),
    ] {
        let ratio = median(ours.iter().zip(&base).map(|(o, b)| o / b).collect());
        let (o, b) = (median(ours), median(base));
        println!("BENCH name={name} ours={o:.0} baseline={b:.0} ratio={ratio:.3}");
        table.push((
            name.to_owned(),
            format!("{what}: baseline {b:.0}/s, ours {o:.0}/s"),
            format!(
                "ratio {ratio:.2} (target >= {target}) {}",
                if ratio >= target { "met" } else { "MISSED" }
            ),
        ));
    }
    Ok(())
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default()
}

/// Starts the task `start(seq)` makes for each of `seqs`, one every `interval` (open loop:
/// each transaction runs in its own task, as concurrent request handlers would, so a slow
/// commit does not lower the offered rate), and returns what the tasks committed, by
/// sequence number.
async fn open_loop<T>(
    seqs: Range<u64>,
    interval: Duration,
    mut start: impl FnMut(u64) -> Result<T, BoxError>,
) -> Result<Vec<Sent>, BoxError>
where
    T: std::future::Future<Output = Result<Sent, BoxError>> + Send + 'static,
{
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = tokio::task::JoinSet::new();
    for seq in seqs {
        ticker.tick().await;
        tasks.spawn(start(seq)?);
    }
    let mut out = Vec::with_capacity(tasks.len());
    while let Some(result) = tasks.join_next().await {
        out.push(result??);
    }
    out.sort_unstable();
    Ok(out)
}

/// Commits the events `seqs`, one per transaction, in an [`open_loop`]; returns `(seq,
/// wall-clock ns just before commit, wall-clock ns just after)`. Calls `after_commit` after
/// each commit.
async fn produce<F>(
    pool: &PgPool,
    outbox: &Outbox,
    subject: &str,
    seqs: Range<u64>,
    interval: Duration,
    after_commit: impl Fn() -> F + Clone + Send + Sync + 'static,
) -> Result<Vec<Sent>, BoxError>
where
    F: std::future::Future<Output = Result<(), BoxError>> + Send,
{
    open_loop(seqs, interval, |seq| {
        let record =
            PreparedOutboxRecord::event(NAME, subject, &serde_json::json!({ "seq": seq }))?;
        let (pool, outbox, after_commit) = (pool.clone(), outbox.clone(), after_commit.clone());
        Ok(async move {
            let mut tx = pool.begin().await?;
            outbox.enqueue(&mut tx, &record).await?;
            let before = now_ns();
            tx.commit().await?;
            let after = now_ns();
            after_commit().await?;
            Ok::<_, BoxError>((seq, before, after))
        })
    })
    .await
}

/// [`produce`] through a `HandoffTransaction` of `handle`'s dispatcher: each row is
/// written leased to it and handed over when the commit returns.
async fn produce_handoff(
    pool: &PgPool,
    handle: &DispatcherHandle,
    subject: &str,
    seqs: Range<u64>,
    interval: Duration,
) -> Result<Vec<Sent>, BoxError> {
    open_loop(seqs, interval, |seq| {
        let record =
            PreparedOutboxRecord::event(NAME, subject, &serde_json::json!({ "seq": seq }))?;
        let (pool, handle) = (pool.clone(), handle.clone());
        Ok(async move {
            let mut tx = handle.begin(&pool).await?;
            tx.enqueue(&record).await?;
            let before = now_ns();
            tx.commit().await?;
            let after = now_ns();
            Ok::<_, BoxError>((seq, before, after))
        })
    })
    .await
}

/// One committed event: `(seq, ns just before commit, ns just after commit)`.
type Sent = (u64, u64, u64);

/// The latency floor, a **dual write** with no outbox: each task commits a business row,
/// then publishes the event itself and awaits the JetStream ack, at the same open-loop rate
/// as [`produce`]. Nothing can deliver an event sooner after its commit (and, unlike the
/// outbox, it loses the event if the process dies between commit and publish).
async fn produce_dual_write(
    pool: &PgPool,
    js: &Context,
    subject: &str,
    seqs: Range<u64>,
    interval: Duration,
) -> Result<Vec<Sent>, BoxError> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS bench_business (seq bigint PRIMARY KEY, body jsonb NOT NULL)",
    )
    .execute(pool)
    .await?;
    open_loop(seqs, interval, |seq| {
        let body = serde_json::json!({ "seq": seq });
        let (pool, js, subject) = (pool.clone(), js.clone(), subject.to_owned());
        Ok(async move {
            let mut tx = pool.begin().await?;
            sqlx::query("INSERT INTO bench_business (seq, body) VALUES ($1, $2)")
                .bind(i64::try_from(seq)?)
                .bind(sqlx::types::Json(&body))
                .execute(&mut *tx)
                .await?;
            let before = now_ns();
            tx.commit().await?;
            let after = now_ns();
            js.publish(subject, body.to_string().into()).await?.await?;
            Ok::<_, BoxError>((seq, before, after))
        })
    })
    .await
}

/// The dispatcher's own small pool, as the README recommends: on the producers' pool its
/// claims would queue behind their transactions.
async fn dispatcher_pool(pg: &TestPg) -> Result<PgPool, BoxError> {
    dispatcher_pool_on(&pg.name).await
}

async fn dispatcher_pool_on(db: &str) -> Result<PgPool, BoxError> {
    let options: sqlx::postgres::PgConnectOptions = trellis_outbox_tests::database_url().parse()?;
    Ok(sqlx::pool::PoolOptions::<Postgres>::new()
        .max_connections(4)
        .connect_with(options.database(db))
        .await?)
}

/// Collects `(seq, receive ns)` from a core NATS subscription until `count` arrived.
async fn receive(mut sub: async_nats::Subscriber, count: u64, seen: Arc<Mutex<Vec<(u64, u64)>>>) {
    let mut n = 0;
    while n < count {
        let Some(message) = sub.next().await else {
            return;
        };
        let t = now_ns();
        let seq = serde_json::from_slice::<serde_json::Value>(&message.payload)
            .ok()
            .and_then(|v| v["seq"].as_u64());
        if let Some(seq) = seq {
            seen.lock().expect("not poisoned").push((seq, t));
            n += 1;
        }
    }
}

/// Latency samples in ms, sorted; fails if an event never arrived.
fn latencies(mode: &str, sent: &[Sent], seen: &[(u64, u64)]) -> Result<Vec<f64>, BoxError> {
    let mut received: HashMap<u64, u64> = HashMap::with_capacity(seen.len());
    for &(seq, t) in seen {
        received.entry(seq).or_insert(t);
    }
    let mut out = Vec::with_capacity(sent.len());
    for &(seq, t0, _) in sent {
        let t1 = received
            .get(&seq)
            .ok_or_else(|| format!("{mode}: event {seq} never arrived on the subscription"))?;
        out.push(t1.saturating_sub(t0) as f64 / 1e6);
    }
    out.sort_by(f64::total_cmp);
    Ok(out)
}

/// When each row's first claim began, ended, and its publish began (wall-clock ns), by seq.
type RowSteps = HashMap<u64, [u64; 3]>;

fn report_latency(run: &ModeRun, samples: &[f64], steps: &RowSteps, table: &mut Vec<TableRow>) {
    let name = run.mode.name();
    let (p50, p99, max) = (
        percentile(samples, 50.0),
        percentile(samples, 99.0),
        samples[samples.len() - 1],
    );
    let rate = run.sent.len() as f64 / (run.active_ns.max(1) as f64 / 1e9);
    println!("LATENCY name={name} p50_ms={p50:.3} p99_ms={p99:.3}");
    // Where the time goes: the commit itself is part of the latency.
    let mut commit: Vec<f64> = run
        .sent
        .iter()
        .map(|&(_, before, after)| after.saturating_sub(before) as f64 / 1e6)
        .collect();
    commit.sort_by(f64::total_cmp);
    println!(
        "  {name}: of which the commit alone: p50 {:.2} ms, p99 {:.2} ms",
        percentile(&commit, 50.0),
        percentile(&commit, 99.0)
    );
    if run.mode == Mode::DualWrite {
        return;
    }
    println!("  {name}: dispatcher {}", run.stages.take());
    // Where each row's time after its commit went (first claim and publish of the row).
    let mut parts: [Vec<f64>; 3] = Default::default();
    for &(seq, _, committed) in &run.sent {
        let Some(&[claim_started, claimed, publish_started]) = steps.get(&seq) else {
            continue;
        };
        if publish_started == 0 {
            continue;
        }
        let ms = |from: u64, to: u64| to.saturating_sub(from) as f64 / 1e6;
        // A handed-over row is published without a claim.
        if claim_started != 0 {
            parts[0].push(ms(committed, claim_started));
            parts[1].push(ms(claim_started, claimed));
        }
        parts[2].push(ms(committed, publish_started));
    }
    let mut line = format!("  {name}: after the commit returned (p50/p99 ms):");
    for (label, part) in ["until a claim began", "that claim", "until published"]
        .iter()
        .zip(&mut parts)
    {
        part.sort_by(f64::total_cmp);
        if !part.is_empty() {
            line += &format!(
                " {label} {:.2}/{:.2};",
                percentile(part, 50.0),
                percentile(part, 99.0)
            );
        }
    }
    println!("{}", line.trim_end_matches(';'));
    let (what, target_p99) = match run.mode {
        Mode::InProcess => ("same process, HandoffTransaction", 10.0),
        Mode::Notify => ("same process, notify() after commit", 10.0),
        _ => ("producer in another process, listen_postgres", 25.0),
    };
    table.push((
        name.to_owned(),
        format!(
            "{what}: {} events at {rate:.0}/s, p50 {p50:.2} ms, max {max:.2} ms",
            samples.len()
        ),
        format!(
            "p99 {p99:.2} ms (target < {target_p99} ms) {}",
            if p99 < target_p99 { "met" } else { "MISSED" }
        ),
    ));
}

async fn wait_for(seen: &Mutex<Vec<(u64, u64)>>, count: u64) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = seen.lock().expect("not poisoned").len() as u64;
        if n >= count {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("only {n} of {count} events arrived within 30 s").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The latency runs' dispatcher: the given pool and stage timers, the run's batch size.
fn latency_dispatcher(
    pool: &PgPool,
    js: &Context,
    settings: Settings,
    stages: &Arc<Stages>,
) -> DispatcherBuilder<Timed<PgOutboxRepository>, Timed<JetStreamPublisher>> {
    OutboxDispatcher::builder(
        Timed {
            inner: PgOutboxRepository::new(pool.clone()),
            stages: Arc::clone(stages),
        },
        Timed {
            inner: publisher(js, settings),
            stages: Arc::clone(stages),
        },
    )
    .batch_size(settings.batch)
}

/// The three ways an event reaches the stream in the latency part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Mode {
    /// The floor: commit, then publish directly (no outbox).
    DualWrite,
    /// The outbox; the producer writes through a `HandoffTransaction`, which hands the
    /// row to the dispatcher at commit.
    InProcess,
    /// The outbox; the producer calls `DispatcherHandle::notify()` after its commit, and the
    /// dispatcher claims the row.
    Notify,
    /// The outbox; the producer is another process, the dispatcher listens.
    ListenNotify,
}

impl Mode {
    const ALL: [Mode; 4] = [
        Mode::DualWrite,
        Mode::InProcess,
        Mode::Notify,
        Mode::ListenNotify,
    ];

    fn name(self) -> &'static str {
        match self {
            Mode::DualWrite => "dual_write",
            Mode::InProcess => "inprocess",
            Mode::Notify => "inprocess_notify",
            Mode::ListenNotify => "listen_notify",
        }
    }
}

/// One mode of the latency part across its segments.
struct ModeRun {
    mode: Mode,
    subject: String,
    /// `(seq, receive ns)` from the mode's own subscription.
    seen: Arc<Mutex<Vec<(u64, u64)>>>,
    receiver: tokio::task::JoinHandle<()>,
    /// What the producer committed, each segment's warm-up dropped.
    sent: Vec<Sent>,
    /// Events produced so far (warm-up included).
    produced: u64,
    /// Producing time summed over segments, for the offered rate.
    active_ns: u64,
    stages: Arc<Stages>,
    /// The dispatcher's pool (and NATS context, on `--own-runtime` made on that runtime).
    pool: Option<(PgPool, Context)>,
}

/// Everything a segment needs besides its mode.
struct LatencyRig<'a> {
    pg: &'a TestPg,
    js: &'a Context,
    settings: Settings,
    interval: Duration,
    own: Option<&'a tokio::runtime::Runtime>,
}

impl LatencyRig<'_> {
    /// Produces the events `seqs` in `run`'s mode, waits until all arrived, and keeps the
    /// commit times after the segment's warm-up (its first 5 %).
    async fn segment(&self, run: &mut ModeRun, seqs: Range<u64>) -> Result<(), BoxError> {
        let count = seqs.end - seqs.start;
        let subject = run.subject.clone();
        // What the producer committed, and the dispatcher to stop once all arrived.
        let (sent, dispatcher) = match run.mode {
            Mode::DualWrite => (
                produce_dual_write(&self.pg.pool, self.js, &subject, seqs, self.interval).await,
                None,
            ),
            Mode::InProcess => {
                let (pool, js) = run.pool.clone().ok_or("the in-process mode has a pool")?;
                let builder = latency_dispatcher(&pool, &js, self.settings, &run.stages);
                let dispatcher = {
                    let _entered = self.own.map(tokio::runtime::Runtime::enter);
                    builder.start()?
                };
                let sent = produce_handoff(
                    &self.pg.pool,
                    &dispatcher.handle(),
                    &subject,
                    seqs,
                    self.interval,
                )
                .await;
                (sent, Some(dispatcher))
            }
            Mode::Notify => {
                let (pool, js) = run.pool.clone().ok_or("the in-process mode has a pool")?;
                let builder = latency_dispatcher(&pool, &js, self.settings, &run.stages);
                // On `--own-runtime`: pool, NATS connection and task all on that runtime, so
                // its worker drives their I/O instead of the producers' workers.
                let dispatcher = {
                    let _entered = self.own.map(tokio::runtime::Runtime::enter);
                    builder.start()?
                };
                let notify = dispatcher.handle();
                // Nobody LISTENs in this mode: the producer's outbox sends no NOTIFY.
                let quiet = Outbox::default().without_notify();
                let sent = produce(
                    &self.pg.pool,
                    &quiet,
                    &subject,
                    seqs,
                    self.interval,
                    move || {
                        notify.notify();
                        async { Ok(()) }
                    },
                )
                .await;
                (sent, Some(dispatcher))
            }
            Mode::ListenNotify => {
                let (pool, js) = run.pool.clone().ok_or("the listen mode has a pool")?;
                let dispatcher = latency_dispatcher(&pool, &js, self.settings, &run.stages)
                    .listen_postgres(&self.pg.pool, &OutboxTables::default())
                    .start()?;
                // The listener is up once its connection is idle in LISTEN.
                for _ in 0..500 {
                    if self.pg.listening_connections().await? > 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                (
                    self.producer_process(&subject, seqs).await,
                    Some(dispatcher),
                )
            }
        };
        // Waits only if the producer succeeded: its error is the one to report.
        let arrived = match &sent {
            Ok(_) => wait_for(&run.seen, run.produced + count).await,
            Err(_) => Ok(()),
        };
        if let Some(dispatcher) = dispatcher {
            dispatcher.shutdown().await;
        }
        let sent = sent?;
        arrived?;
        if sent.len() as u64 != count {
            return Err(format!("{}: {} of {count} commits", run.mode.name(), sent.len()).into());
        }
        run.produced += count;
        run.active_ns += sent
            .last()
            .map_or(0, |l| l.1)
            .saturating_sub(sent.first().map_or(0, |f| f.1));
        run.sent.extend_from_slice(&sent[sent.len() / 20..]);
        Ok(())
    }

    /// Runs the producer in a child process (this binary with `--producer`).
    async fn producer_process(
        &self,
        subject: &str,
        seqs: Range<u64>,
    ) -> Result<Vec<Sent>, BoxError> {
        let output = tokio::process::Command::new(std::env::current_exe()?)
            .args([
                "relay",
                "--producer",
                &self.pg.name,
                subject,
                &seqs.start.to_string(),
                &seqs.end.to_string(),
                &self.interval.as_micros().to_string(),
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()?
            .wait_with_output()
            .await?;
        if !output.status.success() {
            return Err(format!("producer process failed: {}", output.status).into());
        }
        Ok(String::from_utf8(output.stdout)?
            .lines()
            .filter_map(|line| {
                let mut fields = line.split(' ').map(str::parse::<u64>);
                Some((
                    fields.next()?.ok()?,
                    fields.next()?.ok()?,
                    fields.next()?.ok()?,
                ))
            })
            .collect())
    }
}

/// The latency part: the three modes in interleaved segments (each segment runs the modes
/// in a rotated order), so that each mode sees the same share of this machine's fast and
/// slow spells; each mode's samples are pooled over its segments.
async fn bench_latency(settings: Settings, table: &mut Vec<TableRow>) -> Result<(), BoxError> {
    let (count, segments): (u64, u64) = if settings.quick {
        (3_000, 10)
    } else {
        (10_000, 20)
    };
    let per_segment = count / segments;
    let interval = Duration::from_millis(1);
    let (pg, js, stream) = rig().await?;
    let sub_client = async_nats::connect(trellis_outbox_tests::nats_url()).await?;
    println!(
        "latency: {count} events per mode, one per transaction every {interval:?}, in {segments} \
         interleaved segments; commit -> core NATS subscription; dispatcher batch_size {} \
         ack_window {}{}",
        settings.batch,
        settings.window,
        if settings.own_runtime {
            "; in-process dispatcher on its own 1-worker runtime"
        } else {
            ""
        }
    );
    *ROW_STEPS.lock().expect("not poisoned") = Some(Vec::new());
    let own = if settings.own_runtime {
        Some(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("outbox-dispatcher")
                .enable_all()
                .build()?,
        )
    } else {
        None
    };
    let outcome = async {
        let mut runs = Vec::new();
        for mode in Mode::ALL {
            let subject = stream.subject(&format!("lat.{}", mode.name()));
            let seen = Arc::new(Mutex::new(Vec::new()));
            let sub = sub_client.subscribe(subject.clone()).await?;
            sub_client.flush().await?;
            let receiver = tokio::spawn(receive(sub, count, seen.clone()));
            let pool = match (mode, &own) {
                (Mode::DualWrite, _) => None,
                (Mode::InProcess | Mode::Notify, Some(runtime)) => {
                    let db = pg.name.clone();
                    Some(
                        runtime
                            .spawn(async move {
                                let js = trellis_outbox_tests::nats::jetstream().await;
                                Ok::<_, BoxError>((dispatcher_pool_on(&db).await?, js))
                            })
                            .await??,
                    )
                }
                _ => Some((dispatcher_pool(&pg).await?, js.clone())),
            };
            runs.push(ModeRun {
                mode,
                subject,
                seen,
                receiver,
                sent: Vec::new(),
                produced: 0,
                active_ns: 0,
                stages: Arc::default(),
                pool,
            });
        }
        let rig = LatencyRig {
            pg: &pg,
            js: &js,
            settings,
            interval,
            own: own.as_ref(),
        };
        // Each mode's events get their own range of sequence numbers.
        let base = |mode: usize| mode as u64 * 1_000_000_000;
        for segment in 0..segments {
            for k in 0..runs.len() {
                let m = (k + segment as usize) % runs.len();
                if runs[m].mode != Mode::DualWrite {
                    // Each outbox segment starts from an empty table.
                    sqlx::raw_sql("TRUNCATE trellis_outbox")
                        .execute(&pg.pool)
                        .await?;
                }
                let start = base(m) + segment * per_segment;
                rig.segment(&mut runs[m], start..start + per_segment)
                    .await?;
            }
        }
        let steps: RowSteps = {
            let recorded = ROW_STEPS.lock().expect("not poisoned").replace(Vec::new());
            let mut steps = RowSteps::new();
            for (seq, step, t) in recorded.into_iter().flatten() {
                let slot = &mut steps.entry(seq).or_default()[step as usize];
                if *slot == 0 {
                    *slot = t;
                }
            }
            steps
        };
        let mut p99 = HashMap::new();
        for run in &runs {
            run.receiver.abort();
            let samples = latencies(
                run.mode.name(),
                &run.sent,
                &run.seen.lock().expect("not poisoned"),
            )?;
            p99.insert(run.mode, percentile(&samples, 99.0));
            report_latency(run, &samples, &steps, table);
        }
        // Against the floor: baseline / ours, so higher is better (1.0 = as fast as a dual
        // write). Targets: >= 0.5 in-process, >= 0.4 over LISTEN/NOTIFY.
        let floor_p99 = p99[&Mode::DualWrite];
        // `latency_inprocess_notify` (the claim path a notify starts) has no target: it is
        // printed for comparison with the handoff.
        for (name, mode, target) in [
            ("latency_inprocess", Mode::InProcess, Some(0.5)),
            ("latency_inprocess_notify", Mode::Notify, None),
            ("latency_listen_notify", Mode::ListenNotify, Some(0.4)),
        ] {
            let ours = p99[&mode];
            let ratio = floor_p99 / ours.max(f64::MIN_POSITIVE);
            println!("BENCH name={name} ours={ours:.3} baseline={floor_p99:.3} ratio={ratio:.3}");
            table.push((
                name.to_owned(),
                format!("p99 {ours:.2} ms vs dual write p99 {floor_p99:.2} ms"),
                match target {
                    Some(target) => format!(
                        "ratio {ratio:.3} (target >= {target}) {}",
                        if ratio >= target { "met" } else { "MISSED" }
                    ),
                    None => format!("ratio {ratio:.3} (for comparison)"),
                },
            ));
        }
        Ok::<_, BoxError>(())
    }
    .await;
    if let Some(runtime) = own {
        runtime.shutdown_background();
    }
    *ROW_STEPS.lock().expect("not poisoned") = None;
    stream.delete().await;
    pg.close().await;
    outcome
}

/// Opens all of a just-started producer's connections and runs its statement once on each,
/// in a transaction rolled back (nothing is committed or published), so that its events do
/// not pay for connections being opened, statements prepared and catalog caches filled
/// while they are timed; the other modes' producers use the run's long-lived pool.
async fn warm(pool: &PgPool, outbox: &Outbox, subject: &str) -> Result<(), BoxError> {
    let connections = pool.options().get_max_connections();
    let mut held = Vec::new();
    for _ in 0..connections {
        // An id of its own each: an uncommitted row's id makes the next insert of it wait.
        let record = PreparedOutboxRecord::event(NAME, subject, &serde_json::json!({ "seq": 0 }))?;
        let mut tx = pool.begin().await?;
        outbox.enqueue(&mut tx, &record).await?;
        held.push(tx);
    }
    for tx in held {
        tx.rollback().await?;
    }
    Ok(())
}

/// The child process of the LISTEN/NOTIFY latency run: commits the events `start..end` on
/// its own pool and prints `seq before_commit_ns after_commit_ns` per event.
async fn producer_child(args: &[String]) -> Result<(), BoxError> {
    let [db, subject, start, end, interval_us] = args else {
        return Err("usage: --producer <database> <subject> <start> <end> <interval_us>".into());
    };
    let options: sqlx::postgres::PgConnectOptions = trellis_outbox_tests::database_url().parse()?;
    let pool = sqlx::pool::PoolOptions::<Postgres>::new()
        .max_connections(16)
        .connect_with(options.database(db))
        .await?;
    // No NOTIFY inside the transactions (notifying commits are flushed one at a time): a
    // wake-up of its own after each commit.
    let outbox = Outbox::default().without_notify();
    warm(&pool, &outbox, subject).await?;
    let waking = (outbox.clone(), pool.clone());
    let sent = produce(
        &pool,
        &outbox,
        subject,
        start.parse()?..end.parse()?,
        Duration::from_micros(interval_us.parse()?),
        move || {
            let (outbox, pool) = waking.clone();
            async move { Ok(outbox.wake(&pool).await?) }
        },
    )
    .await?;
    pool.close().await;
    let mut out = String::with_capacity(sent.len() * 24);
    for (seq, before, after) in sent {
        out.push_str(&format!("{seq} {before} {after}\n"));
    }
    print!("{out}");
    Ok(())
}

/// `VmRSS` and `VmHWM` of this process in MiB.
fn rss_mb() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next()?.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

async fn bench_rss(settings: Settings, table: &mut Vec<TableRow>) -> Result<(), BoxError> {
    let rows: u64 = if settings.quick { 100_000 } else { 1_000_000 };
    let (pg, js, stream) = rig().await?;
    println!(
        "rss: load {rows} rows (untimed), then dispatch_outbox (batch_size {}, ack_window {}) to \
         file-backed JetStream stream {}, sampling VmRSS every 100 ms",
        settings.batch, settings.window, stream.name
    );
    let outcome = async {
        let load_start = Instant::now();
        load(&pg.pool, &stream.subject("Orders.Shipped"), rows, 5_000, None).await?;
        let (before, hwm_load) = rss_mb();
        println!(
            "  loaded in {:.1?}; RSS before drain {before:.1} MB (VmHWM so far {hwm_load:.1} MB)",
            load_start.elapsed()
        );
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sampler = tokio::spawn({
            let done = done.clone();
            async move {
                let mut samples = Vec::new();
                let mut ticker = tokio::time::interval(Duration::from_millis(100));
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    ticker.tick().await;
                    samples.push(rss_mb().0);
                }
                samples
            }
        });
        let start = Instant::now();
        let drained = ours_drain(&pg.pool, &js, settings).await?;
        let elapsed = start.elapsed();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let samples = sampler.await?;
        let in_stream = stream.count().await?;
        if drained != rows || in_stream != rows {
            return Err(
                format!("rss: loaded {rows}, drained {drained}, stream holds {in_stream}").into(),
            );
        }
        let peak = samples.iter().copied().fold(before, f64::max);
        let tenth = samples.len() / 10;
        let trace: Vec<String> = (0..10)
            .map(|i| format!("{:.0}", samples[(i * tenth).min(samples.len() - 1)]))
            .collect();
        println!(
            "  drained {rows} rows in {elapsed:.1?} ({:.0} rows/s); {} samples; RSS at each tenth (MB): {}",
            rows as f64 / elapsed.as_secs_f64(),
            samples.len(),
            trace.join(" ")
        );
        println!("RSS name=drain_1m peak_mb={peak:.1}");
        table.push((
            "drain_1m".to_owned(),
            format!(
                "{rows} rows to JetStream: RSS {before:.0} MB before drain, at tenths {} MB",
                trace.join("/")
            ),
            format!(
                "peak {peak:.1} MB (target < 100 MB, flat) {}",
                if peak < 100.0 { "met" } else { "MISSED" }
            ),
        ));
        Ok::<_, BoxError>(())
    }
    .await;
    stream.delete().await;
    pg.close().await;
    outcome
}

/// Wall time spent in each stage of the dispatcher, for the sweep's breakdown.
#[derive(Default)]
struct Stages {
    claim_ns: AtomicU64,
    publish_ns: AtomicU64,
    mark_ns: AtomicU64,
    batches: AtomicU64,
}

impl Stages {
    fn add(counter: &AtomicU64, since: Instant) {
        counter.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    fn take(&self) -> String {
        let ms = |c: &AtomicU64| c.swap(0, Ordering::Relaxed) as f64 / 1e6;
        let batches = self.batches.swap(0, Ordering::Relaxed).max(1) as f64;
        let (claim, publish, mark) = (ms(&self.claim_ns), ms(&self.publish_ns), ms(&self.mark_ns));
        format!(
            "{batches} claims; per claim: claim {:.2} ms, publish {:.2} ms, mark {:.2} ms",
            claim / batches,
            publish / batches,
            mark / batches
        )
    }
}

/// A repository and publisher wrapper that times each stage.
struct Timed<T> {
    inner: T,
    stages: Arc<Stages>,
}

impl<R: OutboxRepository> OutboxRepository for Timed<R> {
    async fn claim(&self, request: ClaimRequest) -> trellis_outbox::Result<Claim> {
        let start = Instant::now();
        let started = now_ns();
        let claim = self.inner.claim(request).await;
        Stages::add(&self.stages.claim_ns, start);
        if let Ok(claim) = &claim {
            record_steps(
                &claim.messages,
                &[(Step::ClaimStarted, started), (Step::Claimed, now_ns())],
            );
        }
        self.stages.batches.fetch_add(1, Ordering::Relaxed);
        claim
    }

    async fn mark_dispatched(
        &self,
        claim: &Claim,
        rows: &[Dispatched],
    ) -> trellis_outbox::Result<u64> {
        let start = Instant::now();
        let n = self.inner.mark_dispatched(claim, rows).await;
        Stages::add(&self.stages.mark_ns, start);
        n
    }

    fn mark_failures(
        &self,
        claim: &Claim,
        failures: &[trellis_outbox::Failure],
    ) -> impl Future<Output = trellis_outbox::Result<Vec<String>>> + Send {
        self.inner.mark_failures(claim, failures)
    }

    fn release(
        &self,
        claim: &Claim,
        ids: &[&str],
    ) -> impl Future<Output = trellis_outbox::Result<u64>> + Send {
        self.inner.release(claim, ids)
    }

    fn retry(
        &self,
        id: &str,
    ) -> impl Future<Output = trellis_outbox::Result<trellis_outbox::RetryOutcome>> + Send {
        self.inner.retry(id)
    }

    fn sweep_unfinishable(
        &self,
    ) -> impl Future<Output = trellis_outbox::Result<Vec<trellis_outbox::PoisonRow>>> + Send {
        self.inner.sweep_unfinishable()
    }

    fn next_due_in(&self) -> impl Future<Output = trellis_outbox::Result<Option<Duration>>> + Send {
        self.inner.next_due_in()
    }

    fn overlaps_batches(&self) -> bool {
        self.inner.overlaps_batches()
    }

    fn handoff_target(&self) -> Option<HandoffTarget> {
        self.inner.handoff_target()
    }
}

impl<P: Publisher> Publisher for Timed<P> {
    async fn publish_batch(
        &self,
        messages: &[OutboxMessage],
    ) -> Vec<Result<Option<serde_json::Value>, PublishError>> {
        let start = Instant::now();
        record_steps(messages, &[(Step::PublishStarted, now_ns())]);
        let out = self.inner.publish_batch(messages).await;
        Stages::add(&self.stages.publish_ns, start);
        out
    }
}

/// One relay process's worth of `dispatch_outbox`: its own 4-connection pool and its own
/// NATS connection.
struct Relay {
    repo: PgOutboxRepository,
    publisher: JetStreamPublisher,
}

impl Relay {
    async fn connect(pg: &TestPg, settings: Settings) -> Result<Self, BoxError> {
        let js = trellis_outbox_tests::nats::jetstream().await;
        Ok(Self {
            repo: PgOutboxRepository::new(dispatcher_pool(pg).await?),
            publisher: publisher(&js, settings),
        })
    }
}

/// Drains the loaded outbox with `relays` running `dispatch_outbox` at once; returns the
/// rows/s of the whole drain (until the last of them found nothing more to claim).
async fn scaled_drain(
    pg: &TestPg,
    stream: &BenchStream,
    relays: &[Relay],
    rows: u64,
    settings: Settings,
) -> Result<f64, BoxError> {
    load(
        &pg.pool,
        &stream.subject("Orders.Shipped"),
        rows,
        1_000,
        None,
    )
    .await?;
    stream.purge().await?;
    let start = Instant::now();
    let reports = futures::future::join_all(relays.iter().map(|relay| {
        dispatch_outbox(
            &relay.repo,
            &relay.publisher,
            DispatchOptions::new().batch_size(settings.batch),
        )
    }))
    .await;
    let elapsed = start.elapsed();
    let mut drained = 0;
    let mut each = Vec::new();
    for report in reports {
        let report = report?;
        drained += report.dispatched;
        each.push(report.dispatched.to_string());
    }
    let in_stream = stream.count().await?;
    let left = pending(&pg.pool).await?;
    if drained != rows || in_stream != rows || left != 0 {
        return Err(format!(
            "{} relays: loaded {rows}, drained {drained}, stream holds {in_stream}, {left} rows not dispatched",
            relays.len()
        )
        .into());
    }
    let rate = rows as f64 / elapsed.as_secs_f64();
    println!(
        "  {} relay(s) {rows} rows: {rate:>9.0} rows/s ({elapsed:.2?}; rows each: {})",
        relays.len(),
        each.join(", ")
    );
    Ok(rate)
}

/// `--dispatchers N[,M…]`: how the drain rate grows with N relays (each `dispatch_outbox`
/// on its own pool and NATS connection, as separate relay processes would be) on one
/// Postgres and one stream. Rounds alternate one relay and N relays on the same load;
/// `relay_x{N}`: ours = N relays' rows/s, baseline = one relay's in the same round.
async fn bench_scale(
    settings: Settings,
    counts: &[usize],
    table: &mut Vec<TableRow>,
) -> Result<(), BoxError> {
    let (rounds, rows) = if settings.quick {
        (3, 20_000)
    } else {
        (5, 100_000)
    };
    let (pg, _js, stream) = rig().await?;
    println!(
        "scale: {rounds} rounds of {rows} rows; 1 relay vs {counts:?} relays at once, each          dispatch_outbox batch_size {} ack_window {} on its own pool and NATS connection",
        settings.batch, settings.window
    );
    let outcome = async {
        let most = counts.iter().copied().max().unwrap_or(1);
        let mut relays = Vec::with_capacity(most);
        for _ in 0..most {
            relays.push(Relay::connect(&pg, settings).await?);
        }
        for &n in counts {
            let (mut ours, mut base) = (Vec::new(), Vec::new());
            for round in 0..rounds {
                for many in if round % 2 == 0 {
                    [false, true]
                } else {
                    [true, false]
                } {
                    let take = if many { n } else { 1 };
                    let rate = scaled_drain(&pg, &stream, &relays[..take], rows, settings).await?;
                    if many {
                        ours.push(rate);
                    } else {
                        base.push(rate);
                    }
                }
            }
            let ratio = median(ours.iter().zip(&base).map(|(o, b)| o / b).collect());
            let (o, b) = (median(ours), median(base));
            println!("BENCH name=relay_x{n} ours={o:.0} baseline={b:.0} ratio={ratio:.3}");
            table.push((
                format!("relay_x{n}"),
                format!("{rows} rows: {n} relays {o:.0}/s vs 1 relay {b:.0}/s"),
                format!("ratio {ratio:.2}"),
            ));
        }
        Ok::<_, BoxError>(())
    }
    .await;
    stream.delete().await;
    pg.close().await;
    outcome
}

/// Ours at several batch sizes and ack windows, with the naive relay between them for
/// reference (to choose the defaults; not part of the default run).
async fn sweep(settings: Settings) -> Result<(), BoxError> {
    let rows = if settings.quick { 20_000 } else { 50_000 };
    let (pg, js, stream) = rig().await?;
    let outcome = async {
        for round in 0..2 {
            println!(" sweep round {}", round + 1);
            timed_drain(&pg.pool, &js, &stream, Side::Naive, rows, settings).await?;
            for batch in [100, 250, 500, 1000, 2000] {
                for window in [256, 1024] {
                    let s = Settings {
                        batch,
                        window,
                        ..settings
                    };
                    print!("  batch {batch:>4} window {window:>4}:");
                    timed_drain(&pg.pool, &js, &stream, Side::Timed, rows, s).await?;
                    println!("      {}", STAGES.take());
                }
            }
        }
        Ok::<_, BoxError>(())
    }
    .await;
    stream.delete().await;
    pg.close().await;
    outcome
}

/// Runs the RSS part in a fresh copy of this binary and passes its lines through.
async fn rss_in_child(settings: Settings, table: &mut Vec<TableRow>) -> Result<(), BoxError> {
    let mut args = vec![
        "relay".to_owned(),
        "rss".to_owned(),
        "--batch".to_owned(),
        settings.batch.to_string(),
        "--window".to_owned(),
        settings.window.to_string(),
        "--no-table".to_owned(),
    ];
    if settings.quick {
        args.push("--quick".to_owned());
    }
    let output = tokio::process::Command::new(std::env::current_exe()?)
        .args(&args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()?
        .wait_with_output()
        .await?;
    let text = String::from_utf8(output.stdout)?;
    for line in text.lines() {
        if line.starts_with("done in") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("TABLE ") {
            let mut parts = rest.splitn(3, '\t');
            if let (Some(a), Some(b), Some(c)) = (parts.next(), parts.next(), parts.next()) {
                table.push((a.to_owned(), b.to_owned(), c.to_owned()));
            }
        } else {
            println!("{line}");
        }
    }
    if !output.status.success() {
        return Err(format!("rss child process failed: {}", output.status).into());
    }
    Ok(())
}

/// Loads `rows` (keyed or not), purges the stream, and times `dispatch_outbox` called until
/// no row is left: one call drains an unordered outbox; with ordering keys a call can end
/// while rows wait behind heads that were in flight, and the next call takes them (the
/// dispatcher does the same by itself). Returns rows/s.
async fn timed_ordered_drain(
    pool: &PgPool,
    js: &Context,
    stream: &BenchStream,
    rows: u64,
    keys: Option<u64>,
    settings: Settings,
) -> Result<f64, BoxError> {
    let subject = stream.subject("Orders.Shipped");
    load(pool, &subject, rows, 1_000, keys).await?;
    stream.purge().await?;
    let repo = Timed {
        inner: PgOutboxRepository::new(pool.clone()),
        stages: Arc::clone(&STAGES),
    };
    let publisher = Timed {
        inner: publisher(js, settings),
        stages: Arc::clone(&STAGES),
    };
    let options = DispatchOptions::new().batch_size(settings.batch);
    STAGES.take();
    let start = Instant::now();
    let (mut drained, mut calls) = (0, 0);
    loop {
        let report = dispatch_outbox(&repo, &publisher, options.clone()).await?;
        calls += 1;
        if report.failed + report.dead > 0 {
            return Err(format!("dispatch_outbox reported {report:?}").into());
        }
        drained += report.dispatched;
        if report.dispatched == 0 {
            break;
        }
    }
    let elapsed = start.elapsed();
    let in_stream = stream.count().await?;
    let left = pending(pool).await?;
    let side = if keys.is_some() {
        "ordered"
    } else {
        "unordered"
    };
    if drained != rows || in_stream != rows || left != 0 {
        return Err(format!(
            "{side}: loaded {rows}, drained {drained}, stream holds {in_stream}, {left} rows not dispatched"
        )
        .into());
    }
    let rate = rows as f64 / elapsed.as_secs_f64();
    println!(
        "  {side} {rows} rows: {rate:>9.0} rows/s ({elapsed:.2?}, {calls} dispatch_outbox calls; {})",
        STAGES.take()
    );
    Ok(rate)
}

/// `--keys N`: per-key ordering (issue #15). Rounds alternate the order of the sides; each
/// drains the same rows, once with `N` ordering keys drawn at random and once without, with
/// the same batch size and ack window. `BENCH name=relay_ordered ours=<ordered rows/s>
/// baseline=<unordered rows/s>` (target ratio >= 0.7).
async fn bench_ordered(
    settings: Settings,
    keys: u64,
    table: &mut Vec<TableRow>,
) -> Result<(), BoxError> {
    let (rounds, rows) = if settings.quick {
        (3, 20_000)
    } else {
        (5, 100_000)
    };
    let (pg, js, stream) = rig().await?;
    println!(
        "ordered: {rounds} rounds of {rows} rows, {keys} ordering keys vs none; \
         dispatch_outbox batch_size {} ack_window {}; file-backed stream {}",
        settings.batch, settings.window, stream.name
    );
    let outcome = async {
        let (mut ordered, mut unordered) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            println!(" round {}", round + 1);
            let sides = if round % 2 == 1 {
                [None, Some(keys)]
            } else {
                [Some(keys), None]
            };
            for side in sides {
                let rate =
                    timed_ordered_drain(&pg.pool, &js, &stream, rows, side, settings).await?;
                match side {
                    Some(_) => ordered.push(rate),
                    None => unordered.push(rate),
                }
            }
        }
        Ok::<_, BoxError>((ordered, unordered))
    }
    .await;
    stream.delete().await;
    pg.close().await;
    let (ordered, unordered) = outcome?;
    let ratio = median(ordered.iter().zip(&unordered).map(|(o, u)| o / u).collect());
    let (o, u) = (median(ordered), median(unordered));
    println!("BENCH name=relay_ordered ours={o:.0} baseline={u:.0} ratio={ratio:.3}");
    table.push((
        "relay_ordered".to_owned(),
        format!("{rows} rows, {keys} ordering keys: unordered {u:.0}/s, ordered {o:.0}/s"),
        format!(
            "ratio {ratio:.2} (target >= 0.7) {}",
            if ratio >= 0.7 { "met" } else { "MISSED" }
        ),
    ));
    Ok(())
}

fn arg_value(args: &[String], name: &str, default: usize) -> Result<usize, BoxError> {
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(args
            .get(i + 1)
            .ok_or_else(|| format!("{name} needs a value"))?
            .parse()?),
        None => Ok(default),
    }
}

/// `bench relay …`: `args` are the arguments after `relay`.
pub(crate) async fn main(args: &[String]) -> Result<(), BoxError> {
    if args.first().map(String::as_str) == Some("--producer") {
        return producer_child(&args[1..]).await;
    }
    let settings = Settings {
        quick: args.iter().any(|a| a == "--quick"),
        batch: arg_value(args, "--batch", 1000)?,
        window: arg_value(args, "--window", trellis_outbox::DEFAULT_ACK_WINDOW)?,
        own_runtime: args.iter().any(|a| a == "--own-runtime"),
    };
    let dispatchers: Vec<usize> = match args.iter().position(|a| a == "--dispatchers") {
        Some(i) => args
            .get(i + 1)
            .ok_or("--dispatchers needs a value, e.g. 2 or 2,4")?
            .split(',')
            .map(str::parse)
            .collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    let no_table = args.iter().any(|a| a == "--no-table");
    let keys = match arg_value(args, "--keys", 0)? {
        0 => None,
        keys => Some(keys as u64),
    };
    let mut which = Vec::new();
    let mut skip = false;
    for a in args {
        if skip {
            skip = false;
        } else if a == "--batch" || a == "--window" || a == "--dispatchers" || a == "--keys" {
            skip = true;
        } else if !a.starts_with("--") {
            which.push(a.as_str());
        }
    }
    let started = Instant::now();
    let mut table = Vec::new();
    match which.as_slice() {
        [] | ["scale"] if !dispatchers.is_empty() => {
            bench_scale(settings, &dispatchers, &mut table).await?;
        }
        ["scale"] => bench_scale(settings, &[2, 4], &mut table).await?,
        ["throughput"] => bench_throughput(settings, &mut table).await?,
        ["latency"] => bench_latency(settings, &mut table).await?,
        ["rss"] => bench_rss(settings, &mut table).await?,
        ["sweep"] => sweep(settings).await?,
        ["ordered"] | [] if keys.is_some() || which.first() == Some(&"ordered") => {
            bench_ordered(settings, keys.unwrap_or(1_000), &mut table).await?;
        }
        [] => {
            bench_throughput(settings, &mut table).await?;
            bench_latency(settings, &mut table).await?;
            rss_in_child(settings, &mut table).await?;
        }
        other => {
            eprintln!(
                "unknown part {other:?}; available: throughput, latency, rss, scale, ordered, sweep"
            );
            std::process::exit(2);
        }
    }
    if no_table {
        for (a, b, c) in &table {
            println!("TABLE {a}\t{b}\t{c}");
        }
    } else {
        println!();
        println!("{:<18} {:<100} result", "name", "measured");
        for (a, b, c) in &table {
            println!("{a:<18} {b:<100} {c}");
        }
    }
    println!("done in {:.1?}", started.elapsed());
    Ok(())
}
