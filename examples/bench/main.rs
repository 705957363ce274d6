//! Benchmarks: trellis-outbox against raw baselines measured side by side in the same run.
//!
//! ```text
//! cargo run --release --example bench -- [enqueue|dispatch|relay|consume] [--quick]
//! ```
//!
//! `relay` (Postgres → NATS JetStream, needs NATS) has parts of its own; see `relay.rs`.
//! `consume` (NATS JetStream → Postgres with the inbox, needs NATS) is in `consume.rs`.
//! Without a name, all four run.
//!
//! Each comparison alternates rounds of the baseline and of trellis-outbox on the same
//! database and table, so drift (fsync latency, autovacuum, cache) hits both alike, and
//! reports the median of the per-round throughputs. Besides the table it prints one line per
//! comparison: `BENCH name=<name> ours=<ops/s> baseline=<ops/s> ratio=<ours/baseline>`.
//!
//! Needs Postgres at `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`; a
//! fresh database is created and dropped). SQLite runs on a file under `target/`.

mod consume;
mod purge;
mod relay;

use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::types::Json;
use sqlx::{Database, Pool, Postgres, Sqlite};
use trellis_outbox::{OutboxTransactionExt, PreparedOutboxRecord, format_timestamp};
use trellis_outbox_tests::{TestPg, sqlite_pool};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A domain event of realistic size (about 200 bytes of JSON).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct OrderShipped {
    order_id: String,
    customer_id: String,
    carrier: String,
    tracking_number: String,
    items: Vec<&'static str>,
    total_cents: u64,
}

fn event(n: u64) -> OrderShipped {
    OrderShipped {
        order_id: format!("ord-{n:012}"),
        customer_id: "cus-0000000000042".into(),
        carrier: "ACME Freight".into(),
        tracking_number: format!("1Z{n:016}"),
        items: vec!["sku-123", "sku-456", "sku-789"],
        total_cents: 129_990 + n,
    }
}

const NAME: &str = "Orders.Shipped";
const SUBJECT: &str = "events.v1.Orders.Shipped";

/// What a careful hand-written outbox insert needs: an id, the JSON payload, the headers.
struct RawRow {
    id: String,
    payload: String,
    headers: String,
    headers_json: serde_json::Value,
    now: chrono::DateTime<chrono::Utc>,
}

fn raw_row(n: u64) -> Result<RawRow, BoxError> {
    let id = ulid::Ulid::generate().to_string();
    let now = chrono::Utc::now();
    let headers_json =
        serde_json::json!({ "Nats-Msg-Id": id, "Trellis-Event-Time": format_timestamp(now) });
    Ok(RawRow {
        payload: serde_json::to_string(&event(n))?,
        headers: headers_json.to_string(),
        headers_json,
        id,
        now,
    })
}

const INSERT_PG: &str = "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at, next_attempt_at, last_error, outcome) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, NULL, NULL, NULL)";
const INSERT_SQLITE: &str = "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at, next_attempt_at, last_error, outcome) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, NULL)";

trait Side: Database {
    async fn raw_one(pool: &Pool<Self>, n: u64) -> Result<(), BoxError>;
    async fn raw_many(pool: &Pool<Self>, n: u64, rows: usize) -> Result<(), BoxError>;
}

impl Side for Postgres {
    async fn raw_one(pool: &Pool<Self>, n: u64) -> Result<(), BoxError> {
        let row = raw_row(n)?;
        let mut tx = pool.begin().await?;
        sqlx::query(INSERT_PG)
            .bind(&row.id)
            .bind("event.publish")
            .bind(NAME)
            .bind(SUBJECT)
            .bind(&row.payload)
            .bind(Json(&row.headers_json))
            .bind("pending")
            .bind(0_i32)
            .bind(row.now)
            .bind(row.now)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn raw_many(pool: &Pool<Self>, n: u64, rows: usize) -> Result<(), BoxError> {
        let mut builder = sqlx::QueryBuilder::<Postgres>::new(
            "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at) ",
        );
        let batch: Vec<RawRow> = (0..rows as u64)
            .map(|i| raw_row(n + i))
            .collect::<Result<_, _>>()?;
        builder.push_values(&batch, |mut b, row| {
            b.push_bind(&row.id)
                .push_bind("event.publish")
                .push_bind(NAME)
                .push_bind(SUBJECT)
                .push_bind(&row.payload)
                .push_bind(Json(&row.headers_json))
                .push_bind("pending")
                .push_bind(0_i32)
                .push_bind(row.now)
                .push_bind(row.now);
        });
        let mut tx = pool.begin().await?;
        builder.build().execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }
}

impl Side for Sqlite {
    async fn raw_one(pool: &Pool<Self>, n: u64) -> Result<(), BoxError> {
        let row = raw_row(n)?;
        let stamp = format_timestamp(row.now);
        let mut tx = pool.begin().await?;
        sqlx::query(INSERT_SQLITE)
            .bind(&row.id)
            .bind("event.publish")
            .bind(NAME)
            .bind(SUBJECT)
            .bind(&row.payload)
            .bind(&row.headers)
            .bind("pending")
            .bind(0_i32)
            .bind(&stamp)
            .bind(&stamp)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn raw_many(pool: &Pool<Self>, n: u64, rows: usize) -> Result<(), BoxError> {
        let mut builder = sqlx::QueryBuilder::<Sqlite>::new(
            "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at) ",
        );
        let batch: Vec<RawRow> = (0..rows as u64)
            .map(|i| raw_row(n + i))
            .collect::<Result<_, _>>()?;
        builder.push_values(&batch, |mut b, row| {
            let stamp = format_timestamp(row.now);
            b.push_bind(row.id.clone())
                .push_bind("event.publish")
                .push_bind(NAME)
                .push_bind(SUBJECT)
                .push_bind(row.payload.clone())
                .push_bind(row.headers.clone())
                .push_bind("pending")
                .push_bind(0_i32)
                .push_bind(stamp.clone())
                .push_bind(stamp);
        });
        let mut tx = pool.begin().await?;
        builder.build().execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }
}

async fn ours_one<DB: trellis_outbox::OutboxDatabase>(
    pool: &Pool<DB>,
    n: u64,
) -> Result<(), BoxError> {
    let record = PreparedOutboxRecord::event(NAME, SUBJECT, &event(n))?;
    let mut tx = pool.begin().await?;
    tx.enqueue(&record).await?;
    tx.commit().await?;
    Ok(())
}

async fn ours_many<DB: trellis_outbox::OutboxDatabase>(
    pool: &Pool<DB>,
    n: u64,
    rows: usize,
) -> Result<(), BoxError> {
    let records = (0..rows as u64)
        .map(|i| PreparedOutboxRecord::event(NAME, SUBJECT, &event(n + i)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut tx = pool.begin().await?;
    tx.enqueue_all(records).await?;
    tx.commit().await?;
    Ok(())
}

struct Plan {
    rounds: usize,
    ops_per_round: u64,
}

/// Medians over the rounds: baseline rows/s, ours rows/s, and ours/baseline of each round.
struct Outcome {
    baseline: f64,
    ours: f64,
    ratio: f64,
}

/// Runs `rounds` pairs of (baseline, ours) back to back, alternating which goes first.
/// The ratio is the median of the per-pair ratios, so slow drift cancels out.
async fn compare<B, O, FB, FO>(
    plan: &Plan,
    rows_per_op: usize,
    mut baseline: B,
    mut ours: O,
) -> Result<Outcome, BoxError>
where
    B: FnMut(u64) -> FB,
    O: FnMut(u64) -> FO,
    FB: Future<Output = Result<(), BoxError>>,
    FO: Future<Output = Result<(), BoxError>>,
{
    let mut n = 0_u64;
    // Warm up statement caches and the pool.
    for _ in 0..20 {
        baseline(n).await?;
        ours(n + 1_000_000_000).await?;
        n += rows_per_op as u64;
    }
    let mut rates = Rates::default();
    for round in 0..plan.rounds {
        for side in sides(round) {
            let start = Instant::now();
            for _ in 0..plan.ops_per_round {
                if side == 0 {
                    baseline(n).await?;
                } else {
                    ours(n).await?;
                }
                n += rows_per_op as u64;
            }
            let rate =
                (plan.ops_per_round as usize * rows_per_op) as f64 / start.elapsed().as_secs_f64();
            rates.push(side, rate);
        }
    }
    Ok(rates.outcome())
}

/// The order of the two sides (0 = baseline, 1 = ours) in `round`: alternating, so neither
/// always runs right after the other.
fn sides(round: usize) -> [usize; 2] {
    [round % 2, 1 - round % 2]
}

/// Per-round rates of both sides.
#[derive(Default)]
struct Rates {
    baseline: Vec<f64>,
    ours: Vec<f64>,
}

impl Rates {
    fn push(&mut self, side: usize, rate: f64) {
        if side == 0 {
            self.baseline.push(rate);
        } else {
            self.ours.push(rate);
        }
    }

    /// Medians of each side's rates, and the median of the per-round ratios, so slow drift
    /// cancels out.
    fn outcome(self) -> Outcome {
        let ratios = self
            .ours
            .iter()
            .zip(&self.baseline)
            .map(|(o, b)| o / b)
            .collect();
        Outcome {
            baseline: median(self.baseline),
            ours: median(self.ours),
            ratio: median(ratios),
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn report(name: &str, what: &str, outcome: Outcome, target: &str) {
    let Outcome {
        baseline,
        ours,
        ratio,
    } = outcome;
    println!(
        "{name:<20} {what:<52} baseline {baseline:>10.0}/s  ours {ours:>10.0}/s  ratio {ratio:.3}  (target {target})"
    );
    println!("BENCH name={name} ours={ours:.0} baseline={baseline:.0} ratio={ratio:.3}");
}

async fn bench_enqueue(quick: bool) -> Result<(), BoxError> {
    let single = if quick {
        Plan {
            rounds: 11,
            ops_per_round: 100,
        }
    } else {
        Plan {
            rounds: 41,
            ops_per_round: 200,
        }
    };
    let batched = if quick {
        Plan {
            rounds: 11,
            ops_per_round: 15,
        }
    } else {
        Plan {
            rounds: 41,
            ops_per_round: 40,
        }
    };

    let pg = TestPg::new().await;
    trellis_outbox::migrate(&pg.pool).await?;
    let sqlite_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-sqlite");
    let _ = std::fs::remove_dir_all(&sqlite_dir);
    std::fs::create_dir_all(&sqlite_dir)?;
    let sqlite = sqlite_pool(&sqlite_dir.join("bench.db"), 1).await;
    trellis_outbox::migrate(&sqlite).await?;

    println!(
        "enqueue: {} rounds, alternating baseline and trellis-outbox, median rows/s",
        single.rounds
    );
    report(
        "enqueue_pg",
        "BEGIN; INSERT 1 row; COMMIT  vs  tx.enqueue",
        compare(
            &single,
            1,
            |n| Postgres::raw_one(&pg.pool, n),
            |n| ours_one(&pg.pool, n),
        )
        .await?,
        ">= 0.95",
    );
    report(
        "enqueue_sqlite",
        "BEGIN; INSERT 1 row; COMMIT  vs  tx.enqueue",
        compare(
            &single,
            1,
            |n| Sqlite::raw_one(&sqlite, n),
            |n| ours_one(&sqlite, n),
        )
        .await?,
        ">= 0.95",
    );
    report(
        "enqueue_all_pg",
        "100 rows/tx: multi-row INSERT  vs  tx.enqueue_all",
        compare(
            &batched,
            100,
            |n| Postgres::raw_many(&pg.pool, n, 100),
            |n| ours_many(&pg.pool, n, 100),
        )
        .await?,
        ">= 0.9",
    );
    report(
        "enqueue_all_sqlite",
        "100 rows/tx: multi-row INSERT  vs  tx.enqueue_all",
        compare(
            &batched,
            100,
            |n| Sqlite::raw_many(&sqlite, n, 100),
            |n| ours_many(&sqlite, n, 100),
        )
        .await?,
        ">= 0.9",
    );

    sqlite.close().await;
    pg.close().await;
    Ok(())
}

/// Empties the outbox, loads `rows` pending rows (untimed) with `enqueue_all` in chunks,
/// then refreshes the planner's statistics so neither side runs on a plan made for an empty
/// backlog. Starting from an empty table makes rounds independent: the claim index's
/// entries of rows dispatched earlier are only skipped once no open transaction (in any
/// database of the server) is older than their update, which on a shared server is not
/// always so soon.
async fn load<DB: trellis_outbox::OutboxDatabase>(
    pool: &Pool<DB>,
    rows: u64,
) -> Result<(), BoxError>
where
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    let empty = if DB::NAME == "SQLite" {
        "DELETE FROM trellis_outbox"
    } else {
        "TRUNCATE trellis_outbox"
    };
    sqlx::raw_sql(empty).execute(pool).await?;
    let mut n = 0;
    while n < rows {
        let take = (rows - n).min(1_000);
        ours_many(pool, n, take as usize).await?;
        n += take;
    }
    sqlx::raw_sql("ANALYZE trellis_outbox")
        .execute(pool)
        .await?;
    Ok(())
}

/// The issue's baseline, written by hand: the single-statement leased claim of 100 rows
/// (`UPDATE … WHERE id IN (SELECT … FOR UPDATE SKIP LOCKED LIMIT 100) RETURNING …`),
/// "publish", one `UPDATE … = ANY($1)`. Same SQL shape as trellis-outbox: the ratio is the
/// library's overhead.
async fn raw_drain_pg(pool: &Pool<Postgres>, publisher: &Recorder) -> Result<u64, BoxError> {
    let mut total = 0;
    loop {
        let token = ulid::Ulid::generate().to_string();
        let rows: Vec<(String, String, String, Json<serde_json::Value>)> = sqlx::query_as(
            "UPDATE trellis_outbox SET claimed_until = now() + interval '30 seconds', claim_token = $1 \
             WHERE id = ANY(ARRAY(SELECT id FROM trellis_outbox WHERE state IN ('pending', 'failed', 'claimed') \
             AND ordering_key IS NULL AND (next_attempt_at IS NULL OR next_attempt_at <= now()) \
             AND (claimed_until IS NULL OR claimed_until <= now()) \
             ORDER BY created_at, id LIMIT 100 FOR UPDATE SKIP LOCKED)) \
             RETURNING id, subject, payload, headers",
        )
        .bind(&token)
        .fetch_all(pool)
        .await?;
        if rows.is_empty() {
            return Ok(total);
        }
        let ids: Vec<String> = rows.into_iter().map(|(id, ..)| id).collect();
        publisher.record(&ids);
        sqlx::query(
            "UPDATE trellis_outbox SET state = 'dispatched', updated_at = now(), claimed_until = NULL, \
             claim_token = NULL WHERE id = ANY($1) AND claim_token = $2",
        )
        .bind(&ids)
        .bind(&token)
        .execute(pool)
        .await?;
        total += ids.len() as u64;
    }
}

/// The same on SQLite: one `UPDATE … RETURNING` leased claim, one UPDATE.
async fn raw_drain_sqlite(pool: &Pool<Sqlite>, publisher: &Recorder) -> Result<u64, BoxError> {
    let mut total = 0;
    loop {
        let token = ulid::Ulid::generate().to_string();
        let rows: Vec<(String, String, String, String)> = sqlx::query_as(
            "UPDATE trellis_outbox SET claimed_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+30 seconds'), claim_token = ?1 \
             WHERE id IN (SELECT id FROM trellis_outbox INDEXED BY trellis_outbox_claim_idx \
             WHERE state IN ('pending', 'failed', 'claimed') \
             AND (next_attempt_at IS NULL OR next_attempt_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) \
             AND (claimed_until IS NULL OR claimed_until <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) \
             ORDER BY created_at, id LIMIT 100) \
             RETURNING id, subject, payload, headers",
        )
        .bind(&token)
        .fetch_all(pool)
        .await?;
        if rows.is_empty() {
            return Ok(total);
        }
        let ids: Vec<String> = rows.into_iter().map(|(id, ..)| id).collect();
        publisher.record(&ids);
        sqlx::query(
            "UPDATE trellis_outbox SET state = 'dispatched', updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), \
             claimed_until = NULL, claim_token = NULL \
             WHERE claim_token = ?2 AND id IN (SELECT value FROM json_each(?1))",
        )
        .bind(serde_json::to_string(&ids)?)
        .bind(&token)
        .execute(pool)
        .await?;
        total += ids.len() as u64;
    }
}

/// The claim of the hand-written lock-holding loops (here and in `relay`): 100 due rows,
/// oldest first, locked with `FOR UPDATE SKIP LOCKED` for the rest of the transaction. The
/// rows have no ordering key; saying so lets the query use `<outbox>_claim_idx`, which since
/// schema version 6 holds only such rows.
const LOCKED_CLAIM_PG: &str = "SELECT id, subject, payload, headers FROM trellis_outbox \
     WHERE state IN ('pending', 'failed') AND ordering_key IS NULL \
     AND (next_attempt_at IS NULL OR next_attempt_at <= now()) \
     ORDER BY created_at, id LIMIT 100 FOR UPDATE SKIP LOCKED";

/// The ceiling (`dispatch_pg_vs_ceiling`), the classic loop without a lease: in one
/// transaction, lock 100 rows with `FOR UPDATE SKIP LOCKED`, "publish" while holding the
/// locks, one `UPDATE … = ANY($1)`.
/// It writes each row once instead of twice, but holds row locks (and a transaction) across
/// the broker round trip.
async fn locking_drain_pg(pool: &Pool<Postgres>, publisher: &Recorder) -> Result<u64, BoxError> {
    locked_drain(
        pool,
        publisher,
        LOCKED_CLAIM_PG,
        "UPDATE trellis_outbox SET state = 'dispatched', updated_at = now() WHERE id = ANY($1)",
        |(id, ..): (String, String, String, Json<serde_json::Value>)| id,
    )
    .await
}

/// The loop both ceilings run until `claim` finds nothing: in one transaction, `claim` (rows
/// decoded as `R`, `id` of each), "publish" while holding the locks, `mark` (`$1` the ids).
async fn locked_drain<R>(
    pool: &Pool<Postgres>,
    publisher: &Recorder,
    claim: &'static str,
    mark: &'static str,
    id: fn(R) -> String,
) -> Result<u64, BoxError>
where
    R: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
{
    let mut total = 0;
    loop {
        let mut tx = pool.begin().await?;
        let rows: Vec<R> = sqlx::query_as(claim).fetch_all(&mut *tx).await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(total);
        }
        let ids: Vec<String> = rows.into_iter().map(id).collect();
        publisher.record(&ids);
        sqlx::query(mark).bind(&ids).execute(&mut *tx).await?;
        tx.commit().await?;
        total += ids.len() as u64;
    }
}

/// The same on SQLite (`dispatch_sqlite_vs_ceiling`): `BEGIN IMMEDIATE`, select 100, "publish"
/// holding the database's only write lock, one UPDATE.
async fn locking_drain_sqlite(pool: &Pool<Sqlite>, publisher: &Recorder) -> Result<u64, BoxError> {
    let mut total = 0;
    loop {
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let rows: Vec<(String, String, String, String)> = sqlx::query_as(
            "SELECT id, subject, payload, headers FROM trellis_outbox INDEXED BY trellis_outbox_claim_idx \
             WHERE state IN ('pending', 'failed', 'claimed') AND (next_attempt_at IS NULL OR next_attempt_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) \
             ORDER BY created_at, id LIMIT 100",
        )
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(total);
        }
        let ids: Vec<String> = rows.into_iter().map(|(id, ..)| id).collect();
        publisher.record(&ids);
        sqlx::query("UPDATE trellis_outbox SET state = 'dispatched', updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE id IN (SELECT value FROM json_each(?))")
            .bind(serde_json::to_string(&ids)?)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        total += ids.len() as u64;
    }
}

/// The narrow table of the machine's measured drain limit (`limits.md`, 1d): the columns a
/// minimal outbox needs, one claim index, a payload of the same size as ours.
const NARROW_TABLE: &str = "DROP TABLE IF EXISTS bench_narrow; \
     CREATE TABLE bench_narrow (id text PRIMARY KEY, subject text NOT NULL, payload text NOT NULL, \
     headers text, state text NOT NULL DEFAULT 'pending', attempts int NOT NULL DEFAULT 0, \
     created_at timestamptz NOT NULL DEFAULT now(), next_attempt_at timestamptz NOT NULL DEFAULT now(), \
     dispatched_at timestamptz); \
     CREATE INDEX bench_narrow_claim ON bench_narrow (state, next_attempt_at)";

/// Refills the narrow table with `rows` pending rows (untimed).
async fn load_narrow(pool: &Pool<Postgres>, rows: u64) -> Result<(), BoxError> {
    sqlx::raw_sql(NARROW_TABLE).execute(pool).await?;
    let payload = serde_json::to_string(&event(0))?;
    sqlx::query(
        "INSERT INTO bench_narrow (id, subject, payload, headers) \
         SELECT lpad(i::text, 26, '0'), $2, $3, '{\"Nats-Msg-Id\":\"x\"}' FROM generate_series(1, $1) AS i",
    )
    .bind(i64::try_from(rows)?)
    .bind(SUBJECT)
    .bind(payload)
    .execute(pool)
    .await?;
    sqlx::raw_sql("ANALYZE bench_narrow").execute(pool).await?;
    Ok(())
}

/// The measured limit's drain (`limits.md`, 1d) on the narrow table: in one transaction,
/// `SELECT … FOR UPDATE SKIP LOCKED LIMIT 100`, one `UPDATE … = ANY($1)`.
async fn narrow_drain_pg(pool: &Pool<Postgres>, publisher: &Recorder) -> Result<u64, BoxError> {
    locked_drain(
        pool,
        publisher,
        "SELECT id, subject, payload FROM bench_narrow WHERE state = 'pending' \
         AND next_attempt_at <= now() ORDER BY next_attempt_at LIMIT 100 FOR UPDATE SKIP LOCKED",
        "UPDATE bench_narrow SET state = 'dispatched', dispatched_at = now() WHERE id = ANY($1)",
        |(id, ..): (String, String, String)| id,
    )
    .await
}

/// Where the gap to the machine's measured drain limit lies: the ceiling loop on the Trellis
/// table (ours here) against the same loop on the narrow table, alternating rounds.
async fn compare_with_narrow(
    pool: &Pool<Postgres>,
    rounds: usize,
    rows: u64,
    publisher: &Recorder,
) -> Result<Outcome, BoxError> {
    let mut rates = Rates::default();
    for round in 0..rounds {
        for side in sides(round) {
            let start;
            let drained = if side == 0 {
                load_narrow(pool, rows).await?;
                start = Instant::now();
                narrow_drain_pg(pool, publisher).await?
            } else {
                load(pool, rows).await?;
                start = Instant::now();
                locking_drain_pg(pool, publisher).await?
            };
            let rate = drained as f64 / start.elapsed().as_secs_f64();
            if drained != rows {
                return Err(format!("drained {drained} rows, loaded {rows}").into());
            }
            rates.push(side, rate);
        }
    }
    sqlx::raw_sql("DROP TABLE bench_narrow")
        .execute(pool)
        .await?;
    Ok(rates.outcome())
}

/// An in-memory publisher that acknowledges everything and counts what it saw.
#[derive(Default)]
struct Recorder {
    seen: std::sync::atomic::AtomicU64,
}

impl Recorder {
    fn record(&self, ids: &[String]) {
        self.seen
            .fetch_add(ids.len() as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

impl trellis_outbox::Publisher for Recorder {
    async fn publish_batch(
        &self,
        messages: &[trellis_outbox::OutboxMessage],
    ) -> Vec<Result<Option<serde_json::Value>, trellis_outbox::PublishError>> {
        self.seen
            .fetch_add(messages.len() as u64, std::sync::atomic::Ordering::Relaxed);
        messages.iter().map(|_| Ok(None)).collect()
    }
}

/// Alternates (load, baseline drain) and (load, trellis-outbox drain) rounds; rows/s medians.
async fn compare_drains<DB, B, O, FB, FO>(
    pool: &Pool<DB>,
    rounds: usize,
    rows: u64,
    mut baseline: B,
    mut ours: O,
) -> Result<Outcome, BoxError>
where
    DB: trellis_outbox::OutboxDatabase,
    for<'c> &'c Pool<DB>: sqlx::Executor<'c, Database = DB>,
    B: FnMut() -> FB,
    O: FnMut() -> FO,
    FB: Future<Output = Result<u64, BoxError>>,
    FO: Future<Output = Result<u64, BoxError>>,
{
    let mut rates = Rates::default();
    for round in 0..rounds {
        for side in sides(round) {
            load(pool, rows).await?;
            let start = Instant::now();
            let drained = if side == 0 {
                baseline().await?
            } else {
                ours().await?
            };
            let rate = drained as f64 / start.elapsed().as_secs_f64();
            if drained != rows {
                return Err(format!("drained {drained} rows, loaded {rows}").into());
            }
            rates.push(side, rate);
        }
    }
    Ok(rates.outcome())
}

/// trellis-outbox's one-shot drain with the same batch size (100).
async fn drain_ours<R: trellis_outbox::OutboxRepository>(
    repo: &R,
    publisher: &Recorder,
) -> Result<u64, BoxError> {
    let report = trellis_outbox::dispatch_outbox(
        repo,
        publisher,
        trellis_outbox::DispatchOptions::default(),
    )
    .await?;
    Ok(report.dispatched)
}

async fn bench_dispatch(quick: bool) -> Result<(), BoxError> {
    let (rounds, rows) = if quick { (3, 5_000) } else { (7, 20_000) };
    let pg = TestPg::new().await;
    trellis_outbox::migrate(&pg.pool).await?;
    let sqlite_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-sqlite");
    let _ = std::fs::remove_dir_all(&sqlite_dir);
    std::fs::create_dir_all(&sqlite_dir)?;
    let sqlite = sqlite_pool(&sqlite_dir.join("dispatch.db"), 2).await;
    trellis_outbox::migrate(&sqlite).await?;
    let recorder = Recorder::default();

    println!(
        "dispatch: {rounds} rounds of {rows} rows, claim -> publish (in memory) -> mark, median rows/s"
    );
    let pg_repo = trellis_outbox::PgOutboxRepository::new(pg.pool.clone());
    report(
        "dispatch_pg",
        "leased SKIP LOCKED claim + UPDATE ANY  vs  dispatch_outbox",
        compare_drains(
            &pg.pool,
            rounds,
            rows,
            || raw_drain_pg(&pg.pool, &recorder),
            || drain_ours(&pg_repo, &recorder),
        )
        .await?,
        ">= 0.8",
    );
    let sqlite_repo = trellis_outbox::SqliteOutboxRepository::new(sqlite.clone());
    report(
        "dispatch_sqlite",
        "leased UPDATE RETURNING claim + UPDATE  vs  dispatch_outbox",
        compare_drains(
            &sqlite,
            rounds,
            rows,
            || raw_drain_sqlite(&sqlite, &recorder),
            || drain_ours(&sqlite_repo, &recorder),
        )
        .await?,
        ">= 0.8",
    );
    println!(
        "against the ceiling, loops without a lease that hold locks while publishing (one transaction per batch):"
    );
    report(
        "dispatch_pg_vs_ceiling",
        "tx: SELECT FOR UPDATE SKIP LOCKED + UPDATE  vs  ours",
        compare_drains(
            &pg.pool,
            rounds,
            rows,
            || locking_drain_pg(&pg.pool, &recorder),
            || drain_ours(&pg_repo, &recorder),
        )
        .await?,
        ">= 0.8",
    );
    report(
        "dispatch_sqlite_vs_ceiling",
        "BEGIN IMMEDIATE; SELECT + UPDATE  vs  ours",
        compare_drains(
            &sqlite,
            rounds,
            rows,
            || locking_drain_sqlite(&sqlite, &recorder),
            || drain_ours(&sqlite_repo, &recorder),
        )
        .await?,
        ">= 0.8",
    );
    println!("where the rest of the machine's limit goes (the table itself):");
    report(
        "dispatch_pg_table_vs_narrow",
        "ceiling loop: narrow table  vs  the Trellis table",
        compare_with_narrow(&pg.pool, rounds, rows, &recorder).await?,
        "none: the table's cost",
    );
    sqlite.close().await;
    pg.close().await;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("relay") {
        return relay::main(&args[1..]).await;
    }
    if args.first().map(String::as_str) == Some("purge") {
        return purge::main(&args[1..]).await;
    }
    if args.first().map(String::as_str) == Some("consume") {
        return consume::bench(&args[1..]).await;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let which: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let started = Instant::now();
    match which.as_slice() {
        ["enqueue"] => bench_enqueue(quick).await?,
        ["dispatch"] => bench_dispatch(quick).await?,
        [] => {
            bench_enqueue(quick).await?;
            bench_dispatch(quick).await?;
            let relay_args: Vec<String> =
                args.iter().filter(|a| *a == "--quick").cloned().collect();
            relay::main(&relay_args).await?;
            consume::bench(&relay_args).await?;
        }
        other => {
            eprintln!(
                "unknown benchmark {other:?}; available: enqueue, dispatch, relay, consume, purge"
            );
            std::process::exit(2);
        }
    }
    println!("done in {:.1?}", started.elapsed().max(Duration::ZERO));
    Ok(())
}
