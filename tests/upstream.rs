//! Running beside upstream Trellis' TypeScript outbox (0.11 final and later) on one table
//! (issue #12). The test models upstream's SQL itself — the claim, `markDispatched`, its state
//! decoder — exactly as upstream renders it, on Postgres and SQLite.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;
use trellis_outbox::{
    DispatchOptions, OutboxDispatcher, OutboxRepository, OutboxTransactionExt, PgOutboxRepository,
    PreparedOutboxRecord, RetryPolicy, SqliteOutboxRepository, dispatch_outbox, migrate,
};
use trellis_outbox_tests::publisher::RecordingPublisher;
use trellis_outbox_tests::{TestPg, TestSqlite};

/// Upstream's claim lease (`outboxClaimMs`).
const UPSTREAM_LEASE: chrono::TimeDelta = chrono::TimeDelta::seconds(30);

fn iso(time: DateTime<Utc>) -> String {
    time.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// The database both sides share, and upstream's statements for it.
trait Shared {
    /// Upstream's `claimDue(limit, now)`: `(id, attempts)` of the claimed rows.
    fn upstream_claim(
        &self,
        limit: i64,
        now: DateTime<Utc>,
    ) -> impl Future<Output = Vec<(String, i64)>> + Send;
    /// Upstream's `markDispatched(claim, now)`: whether it won.
    fn upstream_mark_dispatched(
        &self,
        id: &str,
        attempts: i64,
        now: DateTime<Utc>,
    ) -> impl Future<Output = bool> + Send;
    /// Moves every upstream claim back by `by` (the database time that passed).
    fn age_claims(&self, by: chrono::TimeDelta) -> impl Future<Output = ()> + Send;
    /// `(id, state)` of every row.
    fn states(&self) -> impl Future<Output = Vec<(String, String)>> + Send;
    /// How many `dead` rows upstream's claim would take at `now`.
    fn dead_due_for_upstream(&self, now: DateTime<Utc>) -> impl Future<Output = i64> + Send;
    fn enqueue(&self, records: &[PreparedOutboxRecord]) -> impl Future<Output = ()> + Send;
}

impl Shared for TestPg {
    async fn upstream_claim(&self, limit: i64, now: DateTime<Utc>) -> Vec<(String, i64)> {
        // Upstream binds ISO strings; the Postgres driver it uses sends them untyped, so they
        // are read as timestamptz. sqlx binds typed values: the same times.
        sqlx::query_as::<_, (String, i32)>(
            "UPDATE trellis_outbox SET state = $1, attempts = attempts + 1, updated_at = $2, next_attempt_at = $3 WHERE id IN (\n        SELECT id FROM trellis_outbox WHERE state != $4\n        AND (next_attempt_at IS NULL OR next_attempt_at <= $5)\n        ORDER BY created_at LIMIT $6 FOR UPDATE SKIP LOCKED\n      ) RETURNING id, attempts",
        )
        .bind("claimed")
        .bind(now)
        .bind(now + UPSTREAM_LEASE)
        .bind("dispatched")
        .bind(now)
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .unwrap()
        .into_iter()
        .map(|(id, attempts)| (id, i64::from(attempts)))
        .collect()
    }

    async fn upstream_mark_dispatched(&self, id: &str, attempts: i64, now: DateTime<Utc>) -> bool {
        sqlx::query_scalar::<_, String>(
            "UPDATE trellis_outbox SET state = $1, updated_at = $2, next_attempt_at = NULL, last_error = NULL, outcome = $3 WHERE id = $4 AND state = 'claimed' AND attempts = $5 RETURNING id",
        )
        .bind("dispatched")
        .bind(now)
        .bind(None::<sqlx::types::Json<serde_json::Value>>)
        .bind(id)
        .bind(i32::try_from(attempts).unwrap())
        .fetch_optional(&self.pool)
        .await
        .unwrap()
        .is_some()
    }

    async fn age_claims(&self, by: chrono::TimeDelta) {
        sqlx::query(
            "UPDATE trellis_outbox SET next_attempt_at = next_attempt_at - make_interval(secs => $1) \
             WHERE state = 'claimed'",
        )
        .bind(by.as_seconds_f64())
        .execute(&self.pool)
        .await
        .unwrap();
    }

    async fn states(&self) -> Vec<(String, String)> {
        sqlx::query_as("SELECT id, state FROM trellis_outbox")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    async fn dead_due_for_upstream(&self, now: DateTime<Utc>) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM trellis_outbox WHERE state = 'dead' \
             AND (next_attempt_at IS NULL OR next_attempt_at <= $1)",
        )
        .bind(now)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    async fn enqueue(&self, records: &[PreparedOutboxRecord]) {
        let mut tx = self.pool.begin().await.unwrap();
        tx.enqueue_all(records).await.unwrap();
        tx.commit().await.unwrap();
    }
}

impl Shared for TestSqlite {
    async fn upstream_claim(&self, limit: i64, now: DateTime<Utc>) -> Vec<(String, i64)> {
        sqlx::query_as(
            "UPDATE trellis_outbox SET state = ?, attempts = attempts + 1, updated_at = ?, next_attempt_at = ? WHERE id IN (\n        SELECT id FROM trellis_outbox WHERE state != ?\n        AND (next_attempt_at IS NULL OR next_attempt_at <= ?)\n        ORDER BY created_at LIMIT ?\n      ) RETURNING id, attempts",
        )
        .bind("claimed")
        .bind(iso(now))
        .bind(iso(now + UPSTREAM_LEASE))
        .bind("dispatched")
        .bind(iso(now))
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }

    async fn upstream_mark_dispatched(&self, id: &str, attempts: i64, now: DateTime<Utc>) -> bool {
        sqlx::query_scalar::<_, String>(
            "UPDATE trellis_outbox SET state = ?, updated_at = ?, next_attempt_at = NULL, last_error = NULL, outcome = ? WHERE id = ? AND state = 'claimed' AND attempts = ? RETURNING id",
        )
        .bind("dispatched")
        .bind(iso(now))
        .bind(None::<String>)
        .bind(id)
        .bind(attempts)
        .fetch_optional(&self.pool)
        .await
        .unwrap()
        .is_some()
    }

    async fn age_claims(&self, by: chrono::TimeDelta) {
        sqlx::query(
            "UPDATE trellis_outbox SET next_attempt_at = \
             strftime('%Y-%m-%dT%H:%M:%fZ', next_attempt_at, ?) WHERE state = 'claimed'",
        )
        .bind(format!("-{:.3} seconds", by.as_seconds_f64()))
        .execute(&self.pool)
        .await
        .unwrap();
    }

    async fn states(&self) -> Vec<(String, String)> {
        sqlx::query_as("SELECT id, state FROM trellis_outbox")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    async fn dead_due_for_upstream(&self, now: DateTime<Utc>) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM trellis_outbox WHERE state = 'dead' \
             AND (next_attempt_at IS NULL OR next_attempt_at <= ?)",
        )
        .bind(iso(now))
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    async fn enqueue(&self, records: &[PreparedOutboxRecord]) {
        let mut tx = self.pool.begin().await.unwrap();
        tx.enqueue_all(records).await.unwrap();
        tx.commit().await.unwrap();
    }
}

fn records(n: usize) -> Vec<PreparedOutboxRecord> {
    (0..n)
        .map(|i| {
            PreparedOutboxRecord::event(
                "Orders.Placed",
                "events.v1.Orders.Placed",
                &json!({ "n": i }),
            )
            .unwrap()
            .with_event_descriptor("orders@v1", 0)
            .unwrap()
        })
        .collect()
}

fn options() -> DispatchOptions {
    DispatchOptions::new().retry_policy(RetryPolicy::fixed(Duration::from_secs(3600)))
}

/// A claim upstream took and abandoned is left alone while it lasts and dispatched by ours
/// once it ended (30 s of database time, shifted instead of waited for); upstream's late mark
/// of it is fenced out (with `beside_upstream`).
async fn abandoned_upstream_claims_are_adopted<R: OutboxRepository>(db: &impl Shared, repo: R) {
    db.enqueue(&records(5)).await;
    let claimed = db.upstream_claim(3, Utc::now()).await;
    assert_eq!(claimed.len(), 3);
    let publisher = RecordingPublisher::new();
    let report = dispatch_outbox(&repo, &publisher, options()).await.unwrap();
    assert_eq!(report.dispatched, 2, "the live upstream claims were taken");
    for (id, _) in &claimed {
        assert_eq!(
            publisher.attempt_count(id),
            0,
            "{id} is under upstream's claim"
        );
    }

    db.age_claims(chrono::TimeDelta::seconds(31)).await;
    // Ours takes the expired claims; upstream's late marks no longer win.
    let claim = repo
        .claim_due(10, Duration::from_secs(30), None)
        .await
        .unwrap();
    assert_eq!(claim.messages.len(), 3);
    for (id, attempts) in &claimed {
        assert!(
            !db.upstream_mark_dispatched(id, *attempts, Utc::now()).await,
            "upstream's stale mark of {id} won over our claim"
        );
    }
    repo.release(
        &claim,
        &claim
            .messages
            .iter()
            .map(|m| m.id.as_str())
            .collect::<Vec<_>>(),
    )
    .await
    .unwrap();
    let report = dispatch_outbox(&repo, &publisher, options()).await.unwrap();
    assert_eq!(report.dispatched, 3);
    assert!(db.states().await.iter().all(|(_, s)| s == "dispatched"));
    assert_eq!(publisher.total_attempts(), 5);
}

#[tokio::test]
async fn postgres_abandoned_upstream_claims_are_adopted() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let repo = PgOutboxRepository::new(db.pool.clone()).beside_upstream();
    abandoned_upstream_claims_are_adopted(&db, repo).await;
    db.close().await;
}

#[tokio::test]
async fn sqlite_abandoned_upstream_claims_are_adopted() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    let repo = SqliteOutboxRepository::new(db.pool.clone()).beside_upstream();
    abandoned_upstream_claims_are_adopted(&db, repo).await;
}

/// Upstream's claimer and our dispatcher drain one table at once: every row is published
/// exactly once, by one of them.
async fn both_claimers_publish_each_row_once<R: OutboxRepository>(
    db: Arc<impl Shared + Send + Sync + 'static>,
    repo: R,
    rows: usize,
) {
    for chunk in records(rows).chunks(1_000) {
        db.enqueue(chunk).await;
    }
    let upstream_published: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let upstream = {
        let db = db.clone();
        let published = upstream_published.clone();
        tokio::spawn(async move {
            let mut empty = 0;
            while empty < 3 {
                let claimed = db.upstream_claim(100, Utc::now()).await;
                if claimed.is_empty() {
                    empty += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                empty = 0;
                for (id, attempts) in claimed {
                    *published.lock().unwrap().entry(id.clone()).or_default() += 1;
                    assert!(
                        db.upstream_mark_dispatched(&id, attempts, Utc::now()).await,
                        "upstream lost its own claim of {id}"
                    );
                }
            }
        })
    };
    let publisher = RecordingPublisher::new();
    let dispatcher = OutboxDispatcher::builder(repo, publisher.clone())
        .batch_size(100)
        .idle_interval(Duration::from_millis(20))
        .start()
        .unwrap();
    upstream.await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while db.states().await.iter().any(|(_, s)| s != "dispatched") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "rows left undispatched"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    dispatcher.shutdown().await;

    let upstream_published = upstream_published.lock().unwrap().clone();
    let mut ours: HashMap<String, u32> = HashMap::new();
    for attempt in publisher.attempts() {
        *ours.entry(attempt.id).or_default() += 1;
    }
    let states = db.states().await;
    assert_eq!(states.len(), rows);
    for (id, _) in &states {
        let total =
            upstream_published.get(id).copied().unwrap_or(0) + ours.get(id).copied().unwrap_or(0);
        assert_eq!(total, 1, "{id} published {total} times");
    }
    assert!(
        !upstream_published.is_empty() && !ours.is_empty(),
        "one side published nothing ({} upstream, {} ours): not a race",
        upstream_published.len(),
        ours.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_both_claimers_publish_each_row_once() {
    let db = Arc::new(TestPg::new().await);
    migrate(&db.pool).await.unwrap();
    let repo = PgOutboxRepository::new(db.pool.clone()).beside_upstream();
    both_claimers_publish_each_row_once(db.clone(), repo, 10_000).await;
    if let Ok(db) = Arc::try_unwrap(db) {
        db.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_both_claimers_publish_each_row_once() {
    let db = Arc::new(TestSqlite::new().await);
    migrate(&db.pool).await.unwrap();
    let repo = SqliteOutboxRepository::new(db.pool.clone()).beside_upstream();
    both_claimers_publish_each_row_once(db, repo, 10_000).await;
}

/// What upstream's decoder and claim see of our rows: only its own states, apart from
/// `dead`, which is never due for it; event rows carry the headers it requires.
async fn our_rows_pass_upstreams_rules<R: OutboxRepository>(db: &impl Shared, repo: R) {
    let rows = records(6);
    db.enqueue(&rows).await;
    let publisher = RecordingPublisher::new();
    publisher.fail_permanently(&rows[0].id, "maximum payload exceeded");
    publisher.fail_always(&rows[1].id, "no responders");
    let report = dispatch_outbox(&repo, &publisher, options()).await.unwrap();
    assert_eq!((report.dispatched, report.failed, report.dead), (4, 1, 1));
    for (id, state) in db.states().await {
        assert!(
            ["pending", "claimed", "dispatched", "failed", "dead"].contains(&state.as_str()),
            "{id}: {state}"
        );
    }
    // A year from now upstream would still not take the dead row.
    assert_eq!(
        db.dead_due_for_upstream(Utc::now() + chrono::TimeDelta::days(365))
            .await,
        0
    );
    let claimed = db
        .upstream_claim(100, Utc::now() + chrono::TimeDelta::days(365))
        .await;
    assert_eq!(
        claimed
            .iter()
            .map(|(id, _)| id.as_str())
            .collect::<Vec<_>>(),
        [rows[1].id.as_str()],
        "upstream takes the failed row once due, never the dead one"
    );
    for record in &rows {
        for header in [
            "Nats-Msg-Id",
            "Trellis-Event-Time",
            "Trellis-Event-Descriptor",
        ] {
            assert!(record.headers.contains_key(header), "{header} missing");
        }
        assert_eq!(record.headers["Nats-Msg-Id"], record.id);
    }
}

#[tokio::test]
async fn postgres_rows_pass_upstreams_rules() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    our_rows_pass_upstreams_rules(&db, PgOutboxRepository::new(db.pool.clone())).await;
    db.close().await;
}

#[tokio::test]
async fn sqlite_rows_pass_upstreams_rules() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    our_rows_pass_upstreams_rules(&db, SqliteOutboxRepository::new(db.pool.clone())).await;
}

/// Without `beside_upstream` (upstream no longer runs), expired upstream claims are still
/// adopted and published once; live ones are left alone.
async fn expired_upstream_claims_are_adopted_by_default<R: OutboxRepository>(
    db: &impl Shared,
    repo: R,
) {
    db.enqueue(&records(4)).await;
    let claimed = db.upstream_claim(2, Utc::now()).await;
    let publisher = RecordingPublisher::new();
    let report = dispatch_outbox(&repo, &publisher, options()).await.unwrap();
    assert_eq!(report.dispatched, 2);
    db.age_claims(chrono::TimeDelta::seconds(31)).await;
    let report = dispatch_outbox(&repo, &publisher, options()).await.unwrap();
    assert_eq!(report.dispatched, 2);
    for (id, _) in &claimed {
        assert_eq!(publisher.attempt_count(id), 1, "{id}");
    }
    assert!(db.states().await.iter().all(|(_, s)| s == "dispatched"));
}

#[tokio::test]
async fn postgres_expired_upstream_claims_are_adopted_by_default() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    expired_upstream_claims_are_adopted_by_default(&db, PgOutboxRepository::new(db.pool.clone()))
        .await;
    db.close().await;
}

#[tokio::test]
async fn sqlite_expired_upstream_claims_are_adopted_by_default() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    expired_upstream_claims_are_adopted_by_default(
        &db,
        SqliteOutboxRepository::new(db.pool.clone()),
    )
    .await;
}
