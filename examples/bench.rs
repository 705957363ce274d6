//! Benchmarks: trellis-outbox against raw baselines measured side by side in the same run.
//!
//! ```text
//! cargo run --release --example bench -- enqueue [--quick]
//! ```
//!
//! Each comparison alternates rounds of the baseline and of trellis-outbox on the same
//! database and table, so drift (fsync latency, autovacuum, cache) hits both alike, and
//! reports the median of the per-round throughputs. Besides the table it prints one line per
//! comparison: `BENCH name=<name> ours=<ops/s> baseline=<ops/s> ratio=<ours/baseline>`.
//!
//! Needs Postgres at `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`; a
//! fresh database is created and dropped). SQLite runs on a file under `target/`.

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
    let (mut base_rates, mut our_rates) = (Vec::new(), Vec::new());
    for round in 0..plan.rounds {
        // Alternate which side goes first so neither always follows the other.
        for side in [round % 2, 1 - round % 2] {
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
            if side == 0 {
                base_rates.push(rate)
            } else {
                our_rates.push(rate)
            }
        }
    }
    let ratios = our_rates
        .iter()
        .zip(&base_rates)
        .map(|(o, b)| o / b)
        .collect();
    Ok(Outcome {
        baseline: median(base_rates),
        ours: median(our_rates),
        ratio: median(ratios),
    })
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

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let which: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let started = Instant::now();
    match which.as_slice() {
        [] | ["enqueue"] => bench_enqueue(quick).await?,
        other => {
            eprintln!("unknown benchmark {other:?}; available: enqueue");
            std::process::exit(2);
        }
    }
    println!("done in {:.1?}", started.elapsed().max(Duration::ZERO));
    Ok(())
}
