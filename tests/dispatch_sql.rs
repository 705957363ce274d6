//! The dispatcher on real databases: several dispatchers draining one Postgres outbox publish
//! every row exactly once; a dispatcher process killed mid-batch loses nothing; retries end in
//! `dead`; a poison row does not block the rows behind it.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::json;
use trellis_outbox::{
    DispatchOptions, OutboxDispatcher, OutboxRepository, OutboxTransactionExt, PgOutboxRepository,
    RetryPolicy, SqliteOutboxRepository, dispatch_outbox, migrate,
};
use trellis_outbox_tests::crash::{TablePublisher, run_child_dispatcher, spawn_child};
use trellis_outbox_tests::publisher::RecordingPublisher;
use trellis_outbox_tests::{TestPg, TestSqlite};

/// How many times each row was published, from the recording publisher's attempts.
fn attempt_counts(publisher: &RecordingPublisher) -> HashMap<String, u32> {
    let mut counts = HashMap::new();
    for attempt in publisher.attempts() {
        *counts.entry(attempt.id).or_default() += 1;
    }
    counts
}

use trellis_outbox_tests::order_placed as record;

async fn load<DB: trellis_outbox::OutboxDatabase>(
    pool: &sqlx::Pool<DB>,
    rows: usize,
) -> Vec<String> {
    let mut ids = Vec::with_capacity(rows);
    for chunk in (0..rows).collect::<Vec<_>>().chunks(1_000) {
        let records: Vec<_> = chunk.iter().map(|&n| record(n)).collect();
        ids.extend(records.iter().map(|r| r.id.clone()));
        let mut tx = pool.begin().await.unwrap();
        tx.enqueue_all(records).await.unwrap();
        tx.commit().await.unwrap();
    }
    ids
}

async fn pg_states(pool: &sqlx::PgPool) -> HashMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>("SELECT state, count(*) FROM trellis_outbox GROUP BY state")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

async fn wait_until_undispatched_is(pool: &sqlx::PgPool, remaining: i64, timeout: Duration) {
    let start = Instant::now();
    loop {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM trellis_outbox WHERE state <> 'dispatched'")
                .fetch_one(pool)
                .await
                .unwrap();
        if n <= remaining {
            return;
        }
        assert!(
            start.elapsed() < timeout,
            "{n} rows still undispatched after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_postgres_dispatchers_publish_20000_rows_exactly_once() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let ids = load(&db.pool, 20_000).await;
    let publisher = RecordingPublisher::new();
    let dispatchers: Vec<_> = (0..4)
        .map(|_| {
            OutboxDispatcher::builder(PgOutboxRepository::new(db.pool.clone()), publisher.clone())
                .batch_size(100)
                .start()
                .unwrap()
        })
        .collect();
    wait_until_undispatched_is(&db.pool, 0, Duration::from_secs(120)).await;
    for dispatcher in dispatchers {
        dispatcher.shutdown().await;
    }

    let attempts = attempt_counts(&publisher);
    assert_eq!(attempts.len(), 20_000, "every row was published");
    let repeated: Vec<_> = attempts.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        repeated.is_empty(),
        "rows published more than once: {:?}",
        &repeated[..repeated.len().min(5)]
    );
    assert!(ids.iter().all(|id| attempts.contains_key(id)));
    assert_eq!(
        pg_states(&db.pool).await,
        HashMap::from([("dispatched".to_owned(), 20_000)])
    );
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sqlite_dispatchers_publish_every_row_exactly_once() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    load(&db.pool, 3_000).await;
    let publisher = RecordingPublisher::new();
    let dispatchers: Vec<_> = (0..2)
        .map(|_| {
            OutboxDispatcher::builder(
                SqliteOutboxRepository::new(db.pool.clone()),
                publisher.clone(),
            )
            .batch_size(50)
            .start()
            .unwrap()
        })
        .collect();
    let start = Instant::now();
    loop {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM trellis_outbox WHERE state <> 'dispatched'")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        if n == 0 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "{n} rows left");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for dispatcher in dispatchers {
        dispatcher.shutdown().await;
    }
    let attempts = attempt_counts(&publisher);
    assert_eq!(attempts.len(), 3_000);
    assert!(attempts.values().all(|n| *n == 1));
}

async fn retries_end_in_dead_and_poison_does_not_block<DB, R>(
    pool: &sqlx::Pool<DB>,
    repo: R,
    poison_sql: &str,
) where
    DB: trellis_outbox::OutboxDatabase,
    R: trellis_outbox::OutboxRepository,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
{
    sqlx::raw_sql(sqlx::AssertSqlSafe(poison_sql.to_owned()))
        .execute(pool)
        .await
        .unwrap();
    let ids = load(pool, 101).await;
    let publisher = RecordingPublisher::new();
    publisher.fail_always(&ids[0], "no ack within 5 s");
    let policy = RetryPolicy::new()
        .initial_delay(Duration::from_millis(1))
        .max_delay(Duration::from_millis(1))
        .jitter(0.0)
        .max_attempts(3);
    let options = DispatchOptions::new().batch_size(20).retry_policy(policy);

    let first = dispatch_outbox(&repo, &publisher, options.clone())
        .await
        .unwrap();
    assert_eq!(
        first.dispatched, 100,
        "the 100 rows behind the poison row are dispatched"
    );
    assert_eq!(first.dead, 1, "the poison row went dead");
    assert_eq!(first.failed, 1);
    for expected_dead in [0, 1] {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let report = dispatch_outbox(&repo, &publisher, options.clone())
            .await
            .unwrap();
        assert_eq!(report.dead, expected_dead, "{report:?}");
    }
    assert_eq!(
        attempt_counts(&publisher)[&ids[0]],
        3,
        "three attempts, then dead"
    );
    assert!(
        publisher.attempt_count("poison") == 0,
        "an undecodable row is never published"
    );
    let later = dispatch_outbox(&repo, &publisher, options).await.unwrap();
    assert_eq!((later.dispatched, later.failed, later.dead), (0, 0, 0));
}

#[tokio::test]
async fn postgres_retries_end_in_dead_and_poison_does_not_block() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    retries_end_in_dead_and_poison_does_not_block(
        &db.pool,
        PgOutboxRepository::new(db.pool.clone()),
        "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at) \
         VALUES ('poison', 'event.bogus', 'A.B', 'events.v1.A.B', '{}', '{}', 'pending', 0, now() - interval '1 hour', now())",
    )
    .await;
    let (state, attempts, last_error): (String, i32, String) =
        sqlx::query_as("SELECT state, attempts, last_error FROM trellis_outbox WHERE attempts = 3")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), attempts), ("dead", 3));
    assert!(last_error.contains("no ack within 5 s"), "{last_error}");
    let poison: (String, String) =
        sqlx::query_as("SELECT state, last_error FROM trellis_outbox WHERE id = 'poison'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(poison.0, "dead");
    assert!(poison.1.contains("event.bogus"), "{}", poison.1);
    db.close().await;
}

/// `timestamptz` values sqlx's own decoder panics on (`infinity`, `-infinity`, a year past
/// chrono's range), written by another writer: each row goes dead with a reason naming the
/// column and value, the rows beside it are dispatched, and an operator's retry of a row
/// leased until `infinity` is an error naming the column, not a panic.
#[tokio::test]
async fn postgres_rows_with_infinite_times_are_poison_not_a_panic() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let insert = |id: &str, created: &str, updated: &str, next: &str| {
        format!(
            "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at, next_attempt_at) \
             VALUES ('{id}', 'event.publish', 'A.B', 'events.v1.A.B', '{{}}', '{{}}', 'pending', 0, {created}, {updated}, {next})"
        )
    };
    for sql in [
        // Sorts first in the claim's `ORDER BY created_at`.
        insert("minus-infinity", "'-infinity'", "now()", "NULL"),
        insert(
            "infinity",
            "now() - interval '1 hour'",
            "'infinity'",
            "NULL",
        ),
        // Due (before now).
        insert(
            "due-minus-infinity",
            "now() - interval '1 hour'",
            "now()",
            "'-infinity'",
        ),
        insert(
            "far-future",
            "now() - interval '1 hour'",
            "'294000-01-01'",
            "NULL",
        ),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let ids = load(&db.pool, 20).await;
    let repo = PgOutboxRepository::new(db.pool.clone());
    // The status and the backlog gauge leave the infinite `created_at` out of the age
    // (Postgres refuses to subtract it) instead of failing.
    let status = repo.status().await.unwrap();
    assert_eq!(status.count("pending"), 24);
    let age = status.oldest_undispatched.unwrap();
    assert!(age >= Duration::from_secs(3_000), "{age:?}");
    let backlog = repo.backlog().await.unwrap().unwrap();
    assert_eq!(backlog.undispatched, 24, "{backlog:?}");
    assert!(
        backlog.oldest.unwrap() >= Duration::from_secs(3_000),
        "{backlog:?}"
    );
    let publisher = RecordingPublisher::new();
    let options = DispatchOptions::new().batch_size(10);
    let report = dispatch_outbox(&repo, &publisher, options).await.unwrap();
    let states: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT id, state, last_error FROM trellis_outbox \
         WHERE id IN ('minus-infinity', 'infinity', 'due-minus-infinity', 'far-future')",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (report.dispatched, report.dead),
        (20, 4),
        "{report:?} {states:?}"
    );
    let counts = attempt_counts(&publisher);
    assert!(
        ids.iter().all(|id| counts.get(id) == Some(&1)),
        "{counts:?}"
    );
    let dead: Vec<(String, String)> = sqlx::query_as(
        "SELECT id, last_error FROM trellis_outbox WHERE state = 'dead' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let reasons: HashMap<String, String> = dead.into_iter().collect();
    let expect = [
        ("far-future", "updated_at"),
        ("due-minus-infinity", "next_attempt_at"),
        ("infinity", "updated_at"),
        ("minus-infinity", "created_at"),
    ];
    assert_eq!(reasons.len(), expect.len(), "{reasons:?}");
    for (id, column) in expect {
        let reason = &reasons[id];
        assert!(reason.contains(column), "{id}: {reason}");
    }
    assert!(reasons["infinity"].contains("'infinity'"), "{reasons:?}");
    assert!(
        reasons["minus-infinity"].contains("'-infinity'"),
        "{reasons:?}"
    );
    assert!(
        reasons["far-future"].contains("out of range"),
        "{reasons:?}"
    );

    // An operator's retry of a failed row leased until 'infinity'.
    sqlx::raw_sql(
        "UPDATE trellis_outbox SET state = 'failed', claim_token = 'someone', \
         claimed_until = 'infinity' WHERE id = 'infinity'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let error = repo.retry("infinity").await.unwrap_err();
    assert!(error.to_string().contains("claimed_until"), "{error}");
    db.close().await;
}

/// A row whose id is text but not UTF-8 (another writer's bytes): no mark by id can reach
/// it, so the claim puts it to rest by the id's bytes; the rows beside it are dispatched and
/// it is not claimed again.
#[tokio::test]
async fn sqlite_a_row_whose_id_is_not_utf8_goes_dead_by_its_bytes() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at) \
         VALUES (CAST(X'6964FF' AS TEXT), 'event.publish', 'A.B', 'events.v1.A.B', '{}', '{}', 'pending', 0, \
         '2000-01-01T00:00:00.000Z', '2000-01-01T00:00:00.000Z')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let ids = load(&db.pool, 5).await;
    let repo = SqliteOutboxRepository::new(db.pool.clone());
    let publisher = RecordingPublisher::new();
    let options = DispatchOptions::new().batch_size(3);
    let report = dispatch_outbox(&repo, &publisher, options.clone())
        .await
        .unwrap();
    assert_eq!(report.dispatched, 5, "{report:?}");
    let counts = attempt_counts(&publisher);
    assert!(
        ids.iter().all(|id| counts.get(id) == Some(&1)),
        "{counts:?}"
    );
    let (state, leased, last_error): (String, bool, String) = sqlx::query_as(
        "SELECT state, claim_token IS NOT NULL, last_error FROM trellis_outbox \
         WHERE CAST(id AS BLOB) = X'6964FF'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((state.as_str(), leased), ("dead", false));
    assert!(last_error.contains("not UTF-8"), "{last_error}");
    let again = dispatch_outbox(&repo, &publisher, options).await.unwrap();
    assert_eq!((again.dispatched, again.failed, again.dead), (0, 0, 0));
}

#[tokio::test]
async fn sqlite_retries_end_in_dead_and_poison_does_not_block() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    retries_end_in_dead_and_poison_does_not_block(
        &db.pool,
        SqliteOutboxRepository::new(db.pool.clone()),
        "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at) \
         VALUES ('poison', 'event.publish', 'A.B', 'events.v1.A.B', '{}', 'not json', 'pending', 0, '2000-01-01T00:00:00.000Z', '2000-01-01T00:00:00.000Z')",
    )
    .await;
}

// ---- marks: text Postgres refuses, oversized text ----

/// `(id, state, last_error, outcome, leased)`.
type MarkedRow = (
    String,
    String,
    Option<String>,
    Option<serde_json::Value>,
    bool,
);

/// A NUL in an error message or an outcome (Postgres `text` and `jsonb` refuse it) and a
/// 100 KB error message are stored sanitized and bounded; the rest of the batch is marked.
#[tokio::test]
async fn postgres_marks_store_nul_and_huge_errors_sanitized() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let ids = load(&db.pool, 10).await;
    let publisher = RecordingPublisher::new();
    publisher.fail_always(&ids[0], "broker said \0 here");
    publisher.fail_always(&ids[1], &"x".repeat(100_000));
    publisher.outcome(&ids[2], json!({ "note": "nul \0 inside", "k\0ey": 1 }));
    let repo = PgOutboxRepository::new(db.pool.clone());
    let options =
        DispatchOptions::new().retry_policy(RetryPolicy::fixed(Duration::from_secs(3600)));
    let report = dispatch_outbox(&repo, &publisher, options).await.unwrap();
    assert_eq!((report.dispatched, report.failed, report.dead), (8, 2, 0));
    let rows: Vec<MarkedRow> = sqlx::query_as(
        "SELECT id, state, last_error, outcome, claim_token IS NOT NULL FROM trellis_outbox ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let row = |id: &str| rows.iter().find(|r| r.0 == id).unwrap().clone();
    let nul = row(&ids[0]);
    assert_eq!((nul.1.as_str(), nul.4), ("failed", false));
    assert_eq!(nul.2.as_deref(), Some("broker said \u{fffd} here"));
    let huge = row(&ids[1]);
    assert_eq!(huge.1, "failed");
    let text = huge.2.unwrap();
    assert!(
        text.len() < 9_000 && text.ends_with("more bytes)"),
        "{} bytes",
        text.len()
    );
    let outcome = row(&ids[2]);
    assert_eq!(outcome.1, "dispatched");
    assert_eq!(
        outcome.3,
        Some(json!({ "note": "nul \u{fffd} inside", "k\u{fffd}ey": 1 }))
    );
    assert_eq!(pg_states(&db.pool).await.get("dispatched"), Some(&8));
    db.close().await;
}

// ---- crash: a dispatcher process killed mid-batch ----

const CHILD_ENV: &str = "TRELLIS_OUTBOX_CRASH_CHILD_DB";

/// Not a test: the body of the child process the crash test starts and kills.
#[tokio::test]
#[ignore = "entry point of the crash test's child process"]
async fn crash_child_process() {
    // A slow broker: gives the parent time to kill us between publish and mark.
    run_child_dispatcher(CHILD_ENV, 50, Duration::from_millis(15)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatcher_killed_mid_batch_loses_nothing() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::query("CREATE TABLE published (id text NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let ids = load(&db.pool, 3_000).await;

    let mut child = spawn_child("crash_child_process", CHILD_ENV, &db.name);
    // Let it dispatch part of the backlog, then kill it without warning (SIGKILL, our pid).
    wait_until_undispatched_is(&db.pool, 2_500, Duration::from_secs(60)).await;
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "the child was killed, not finished: {status:?}"
    );

    let leased: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM trellis_outbox WHERE state <> 'dispatched' AND claimed_until > now()",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let remaining: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trellis_outbox WHERE state <> 'dispatched'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(remaining > 0, "the child must not have finished");

    // Another dispatcher takes over; rows leased by the dead process come back after the lease.
    let survivor = OutboxDispatcher::builder(
        PgOutboxRepository::new(db.pool.clone()),
        TablePublisher {
            pool: db.pool.clone(),
            pause: Duration::ZERO,
        },
    )
    .batch_size(100)
    .idle_interval(Duration::from_millis(200))
    .start()
    .unwrap();
    wait_until_undispatched_is(&db.pool, 0, Duration::from_secs(60)).await;
    survivor.shutdown().await;

    let published: HashMap<String, i64> =
        sqlx::query_as::<_, (String, i64)>("SELECT id, count(*) FROM published GROUP BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert!(
        ids.iter().all(|id| published.contains_key(id)),
        "every row was published"
    );
    let twice = published.values().filter(|n| **n > 1).count();
    // Only rows the child had published but not yet marked when it died go out again (the
    // JetStream Nats-Msg-Id de-duplicates those). The dispatcher marks batch n - 1 while it
    // publishes batch n, so that is at most two batches.
    assert!(
        twice <= 100,
        "{twice} rows published twice; at most two batches (2 x 50) may be"
    );
    assert!(published.values().all(|n| *n <= 2));
    println!(
        "killed with {remaining} rows left ({leased} leased by the dead process); {twice} republished"
    );
    db.close().await;
}
