//! Retention: `purge_dispatched` and `purge_inbox` on real Postgres and SQLite (issue #14):
//! bounded batches, oldest first, only rows past the age, never a `dead` (or other open) row.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::time::Duration;

use trellis_outbox::{Error, PgOutboxRepository, SqliteOutboxRepository, migrate};
use trellis_outbox_tests::{TestPg, TestSqlite};

const DAY: Duration = Duration::from_secs(86_400);

/// Inserts `n` rows in `state`, last updated `age_days` ago, and `n` inbox rows received then.
fn pg_rows(state: &'static str, n: usize, age_days: i32) -> String {
    format!(
        "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at) \
         SELECT '{state}-{age_days}-' || g, 'event.publish', 'A.B', 'events.v1.A.B', '{{}}', '{{}}', '{state}', 0, \
         now() - make_interval(days => {age_days}), now() - make_interval(days => {age_days}) \
         FROM generate_series(1, {n}) AS g; \
         INSERT INTO trellis_inbox (message_id, received_at) \
         SELECT 'msg-{state}-{age_days}-' || g, now() - make_interval(days => {age_days}) \
         FROM generate_series(1, {n}) AS g"
    )
}

fn sqlite_rows(state: &'static str, n: usize, age_days: i32) -> String {
    format!(
        "WITH RECURSIVE g(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM g WHERE x < {n}) \
         INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at) \
         SELECT '{state}-{age_days}-' || x, 'event.publish', 'A.B', 'events.v1.A.B', '{{}}', '{{}}', '{state}', 0, \
         strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-{age_days} days'), strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-{age_days} days') FROM g; \
         WITH RECURSIVE g(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM g WHERE x < {n}) \
         INSERT INTO trellis_inbox (message_id, received_at) \
         SELECT 'msg-{state}-{age_days}-' || x, strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-{age_days} days') FROM g"
    )
}

#[tokio::test]
async fn postgres_purges_old_dispatched_and_inbox_rows_only() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    for (state, n, age) in [
        ("dispatched", 2_500, 10),
        ("dispatched", 7, 1),
        ("dead", 5, 30),
        ("failed", 3, 30),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(pg_rows(state, n, age)))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let repo = PgOutboxRepository::new(db.pool.clone());
    assert_eq!(repo.purge_dispatched(7 * DAY, 1_000).await.unwrap(), 2_500);
    assert_eq!(repo.purge_dispatched(7 * DAY, 1_000).await.unwrap(), 0);
    let left: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM trellis_outbox GROUP BY state ORDER BY state")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        left,
        [
            ("dead".into(), 5),
            ("dispatched".into(), 7),
            ("failed".into(), 3)
        ],
        "only dispatched rows past the age go"
    );
    // Inbox: 2,500 + 5 + 3 rows are older than 7 days, 7 are newer.
    assert_eq!(repo.purge_inbox(7 * DAY, 333).await.unwrap(), 2_508);
    let inbox: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_inbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(inbox, 7);
    // The purge goes through the index of dispatched rows, not a scan of the table.
    let plan: Vec<String> = sqlx::query_scalar(
        "EXPLAIN SELECT id FROM trellis_outbox WHERE state = 'dispatched' \
         AND updated_at < now() - make_interval(secs => 1) ORDER BY updated_at LIMIT 1000",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(
        plan.iter()
            .any(|line| line.contains("trellis_outbox_done_idx")),
        "{plan:#?}"
    );
    for batch in [0, 100_001] {
        let err = repo.purge_dispatched(DAY, batch).await.unwrap_err();
        assert!(matches!(err, Error::InvalidRetention { .. }), "{err}");
    }
    db.close().await;
}

#[tokio::test]
async fn sqlite_purges_old_dispatched_and_inbox_rows_only() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    for (state, n, age) in [
        ("dispatched", 2_500, 10),
        ("dispatched", 7, 1),
        ("dead", 5, 30),
        ("failed", 3, 30),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sqlite_rows(state, n, age)))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let repo = SqliteOutboxRepository::new(db.pool.clone());
    assert_eq!(repo.purge_dispatched(7 * DAY, 1_000).await.unwrap(), 2_500);
    let left: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM trellis_outbox GROUP BY state ORDER BY state")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        left,
        [
            ("dead".into(), 5),
            ("dispatched".into(), 7),
            ("failed".into(), 3)
        ]
    );
    assert_eq!(repo.purge_inbox(7 * DAY, 1_000).await.unwrap(), 2_508);
    let inbox: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_inbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(inbox, 7);
}

/// `retain_dispatched` purges from the dispatcher task: dispatched rows disappear once older
/// than the retention, the dead row stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatcher_with_retention_purges_its_old_dispatched_rows() {
    use trellis_outbox::{OutboxDispatcher, OutboxTransactionExt, PreparedOutboxRecord};
    use trellis_outbox_tests::publisher::RecordingPublisher;

    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(sqlite_rows("dead", 1, 30)))
        .execute(&db.pool)
        .await
        .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    for n in 0..20 {
        tx.enqueue(&PreparedOutboxRecord::event("A.B", "events.v1.A.B", &n).unwrap())
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let dispatcher = OutboxDispatcher::builder(
        SqliteOutboxRepository::new(db.pool.clone()),
        RecordingPublisher::new(),
    )
    .retain_dispatched(Duration::from_secs(1))
    .idle_interval(Duration::from_millis(100))
    .start()
    .unwrap();
    let count = |state: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM trellis_outbox WHERE state = ?")
                .bind(state)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut saw_dispatched = false;
    loop {
        let (pending, dispatched) = (count("pending").await, count("dispatched").await);
        saw_dispatched |= dispatched > 0;
        if pending == 0 && dispatched == 0 && saw_dispatched {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{pending} pending, {dispatched} dispatched rows left"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    dispatcher.shutdown().await;
    assert_eq!(count("dead").await, 1, "a dead row was purged");
}
