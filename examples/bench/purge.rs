//! Retention benchmark (issue 14): the relay's throughput while a large purge of old
//! dispatched rows runs, against its throughput without one, in the same run.
//!
//! ```text
//! cargo run --release --example bench -- purge [--quick]
//! ```
//!
//! A fresh Postgres database gets 1,000,000 `dispatched` rows last updated 30 days ago
//! (100,000 with `--quick`), inserted untimed in one `INSERT … SELECT`. Then, three drains of
//! the same number of fresh pending rows to a JetStream file stream, each timed from the
//! first claim until the outbox is empty (`dispatch_outbox`, the engine `OutboxDispatcher`
//! runs): before the purge, during it (`purge_dispatched(7 days, 1,000)` running on its own
//! connection from just before the drain until every old row is gone), and after it. The
//! baseline is the mean of the before and after drains; the purge's own time is printed.
//! Prints `BENCH name=relay_during_purge ours=<rows/s during> baseline=<rows/s without>
//! ratio=<during/without>` (target ≥ 0.7).

use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use trellis_outbox::{
    DispatchOptions, JetStreamPublisher, OutboxTransactionExt, PgOutboxRepository,
    PreparedOutboxRecord, dispatch_outbox, migrate,
};
use trellis_outbox_tests::TestPg;
use trellis_outbox_tests::nats::jetstream;

use crate::BoxError;

/// Loads `rows` pending events (1,000 per transaction) and refreshes the statistics.
async fn load_pending(pool: &PgPool, subject: &str, rows: u64) -> Result<(), BoxError> {
    let mut n = 0;
    while n < rows {
        let take = (rows - n).min(1_000);
        let records = (n..n + take)
            .map(|i| PreparedOutboxRecord::event("Orders.Placed", subject, &json!({ "n": i })))
            .collect::<Result<Vec<_>, _>>()?;
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

/// Drains the outbox to JetStream; rows per second.
async fn drain(
    pool: &PgPool,
    js: &async_nats::jetstream::Context,
    rows: u64,
) -> Result<f64, BoxError> {
    let repo = PgOutboxRepository::new(pool.clone());
    let publisher = JetStreamPublisher::builder(js.clone()).build();
    let started = Instant::now();
    let report = dispatch_outbox(&repo, &publisher, DispatchOptions::new().batch_size(100)).await?;
    let seconds = started.elapsed().as_secs_f64();
    if report.dispatched != rows || report.failed + report.dead > 0 {
        return Err(format!("expected {rows} dispatched, got {report:?}").into());
    }
    Ok(rows as f64 / seconds)
}

pub(crate) async fn main(args: &[String]) -> Result<(), BoxError> {
    let quick = args.iter().any(|a| a == "--quick");
    let (old_rows, fresh_rows) = if quick {
        (100_000u64, 5_000u64)
    } else {
        (1_000_000, 20_000)
    };
    let pg = TestPg::new().await;
    migrate(&pg.pool).await?;
    // The relay's own small pool, as in production; the purge gets its own connection.
    let relay_pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(pg.options.clone())
        .await?;
    let purge_pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(pg.options.clone())
        .await?;
    let js = jetstream().await;
    let stream = format!("BENCH_PURGE_{}", ulid::Ulid::generate());
    let subject = format!("bench.purge.{}", stream.to_lowercase());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![subject.clone()],
        storage: async_nats::jetstream::stream::StorageType::File,
        ..Default::default()
    })
    .await?;

    let started = Instant::now();
    sqlx::query(
        "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, \
         created_at, updated_at) \
         SELECT 'old-' || g, 'event.publish', 'Orders.Placed', $1, '{\"n\":0}', '{}'::jsonb, \
         'dispatched', 1, now() - interval '31 days', now() - interval '30 days' \
         FROM generate_series(1, $2) AS g",
    )
    .bind(&subject)
    .bind(i64::try_from(old_rows)?)
    .execute(&pg.pool)
    .await?;
    sqlx::raw_sql("ANALYZE trellis_outbox")
        .execute(&pg.pool)
        .await?;
    println!(
        "loaded {old_rows} old dispatched rows in {:.1?}",
        started.elapsed()
    );

    load_pending(&pg.pool, &subject, fresh_rows).await?;
    let before = drain(&relay_pool, &js, fresh_rows).await?;

    load_pending(&pg.pool, &subject, fresh_rows).await?;
    let purge = {
        let pool = purge_pool.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let repo = PgOutboxRepository::new(pool);
            let deleted = repo
                .purge_dispatched(Duration::from_secs(7 * 86_400), 1_000)
                .await;
            (deleted, started.elapsed())
        })
    };
    // Let the purge get going before the drain starts.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let during = drain(&relay_pool, &js, fresh_rows).await?;
    let purge_running_after_drain = !purge.is_finished();
    let (deleted, purge_time) = purge.await?;
    let deleted = deleted?;
    if deleted != old_rows {
        return Err(format!("the purge deleted {deleted} of {old_rows} rows").into());
    }

    load_pending(&pg.pool, &subject, fresh_rows).await?;
    let after = drain(&relay_pool, &js, fresh_rows).await?;
    let baseline = (before + after) / 2.0;
    println!(
        "purge: {deleted} rows in {purge_time:.1?} ({:.0} rows/s); it {} the whole drain",
        deleted as f64 / purge_time.as_secs_f64(),
        if purge_running_after_drain {
            "overlapped"
        } else {
            "did NOT overlap"
        }
    );
    println!("relay rows/s: before {before:.0}, during the purge {during:.0}, after {after:.0}");
    println!(
        "BENCH name=relay_during_purge ours={during:.0} baseline={baseline:.0} ratio={:.3} target=0.7",
        during / baseline
    );
    let _ = js.delete_stream(&stream).await;
    relay_pool.close().await;
    purge_pool.close().await;
    pg.close().await;
    Ok(())
}
