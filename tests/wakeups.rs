//! Postgres LISTEN/NOTIFY wake-ups: sent by enqueue, delivered only on commit, and the
//! listener survives a terminated connection (re-LISTEN, then one re-scan wake-up).

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::json;
use trellis_outbox::{
    OutboxTables, OutboxTransactionExt, PgWakeups, PreparedOutboxRecord, migrate,
};
use trellis_outbox_tests::TestPg;

fn record() -> PreparedOutboxRecord {
    PreparedOutboxRecord::event("A.B", "events.v1.A.B", &json!({})).unwrap()
}

struct Counter(Arc<AtomicUsize>);

impl Counter {
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    /// Waits until the count exceeds `than` (up to 5 s); returns the count.
    async fn above(&self, than: usize) -> usize {
        for _ in 0..500 {
            let n = self.get();
            if n > than {
                return n;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no wake-up within 5 s (count stayed {})", self.get());
    }

    /// Asserts the count stays at `n` for a while.
    async fn stays(&self, n: usize) {
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(self.get(), n);
    }
}

async fn listening(db: &TestPg) -> (PgWakeups, Counter) {
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    let wakeups = PgWakeups::listen(&db.pool, &OutboxTables::default(), move || {
        c.fetch_add(1, Ordering::SeqCst);
    })
    .await
    .unwrap();
    (wakeups, Counter(count))
}

#[tokio::test]
async fn enqueue_wakes_listeners_only_on_commit() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let (wakeups, count) = listening(&db).await;

    let first = record();
    let mut tx = db.pool.begin().await.unwrap();
    tx.enqueue(&first).await.unwrap();
    tx.enqueue(&record()).await.unwrap();
    count.stays(0).await; // not before commit
    tx.commit().await.unwrap();
    let after_commit = count.above(0).await;
    assert_eq!(after_commit, 1, "one notification per transaction");

    let mut tx = db.pool.begin().await.unwrap();
    tx.enqueue(&record()).await.unwrap();
    tx.rollback().await.unwrap();
    count.stays(1).await; // a rolled-back enqueue wakes nobody

    let mut tx = db.pool.begin().await.unwrap();
    tx.enqueue(&first).await.unwrap(); // already stored: nothing inserted
    tx.commit().await.unwrap();
    count.stays(1).await;

    let mut tx = db.pool.begin().await.unwrap();
    tx.enqueue_all([record(), record(), record()])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count.above(1).await, 2);

    wakeups.stop().await;
    db.close().await;
}

#[tokio::test]
async fn listener_relistens_and_rescans_after_its_connection_is_terminated() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let (wakeups, count) = listening(&db).await;

    let terminated: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND query LIKE 'LISTEN%' AND pid <> pg_backend_pid()) t",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        terminated, 1,
        "the listener's connection was found and terminated"
    );

    // The listener notices, re-LISTENs, and wakes once to re-scan.
    let rescan = count.above(0).await;
    assert_eq!(rescan, 1);

    // And it is really listening again.
    let mut tx = db.pool.begin().await.unwrap();
    tx.enqueue(&record()).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count.above(1).await, 2);

    wakeups.stop().await;
    db.close().await;
}
