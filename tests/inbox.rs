//! Inbox de-duplication on real Postgres and SQLite.

use futures::future::join_all;
use trellis_outbox::{InboxReceipt, OutboxDatabase, OutboxTransactionExt, migrate};
use trellis_outbox_tests::{TestPg, TestSqlite};

async fn accepted_then_duplicate<DB: OutboxDatabase>(pool: &sqlx::Pool<DB>) {
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        tx.record_inbox("evt_1").await.unwrap(),
        InboxReceipt::Accepted
    );
    assert_eq!(
        tx.record_inbox("evt_1").await.unwrap(),
        InboxReceipt::Duplicate
    );
    assert_eq!(
        tx.record_inbox("evt_2").await.unwrap(),
        InboxReceipt::Accepted
    );
    tx.commit().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        tx.record_inbox("evt_1").await.unwrap(),
        InboxReceipt::Duplicate
    );
    // A receipt that is rolled back is forgotten: the message will be handled again.
    assert_eq!(
        tx.record_inbox("evt_3").await.unwrap(),
        InboxReceipt::Accepted
    );
    tx.rollback().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(
        tx.record_inbox("evt_3").await.unwrap(),
        InboxReceipt::Accepted
    );
    tx.commit().await.unwrap();
}

/// Eight transactions record the same id at once and commit: exactly one is told `Accepted`.
async fn concurrent_receipts<DB: OutboxDatabase>(pool: &sqlx::Pool<DB>) -> Vec<InboxReceipt> {
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(8));
    let tasks = (0..8).map(|_| {
        let pool = pool.clone();
        let barrier = barrier.clone();
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            barrier.wait().await;
            let receipt = tx.record_inbox("evt_same").await.unwrap();
            tx.commit().await.unwrap();
            receipt
        })
    });
    join_all(tasks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

#[tokio::test]
async fn pg_inbox_accepts_then_rejects_duplicates() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    accepted_then_duplicate(&db.pool).await;
    db.close().await;
}

#[tokio::test]
async fn sqlite_inbox_accepts_then_rejects_duplicates() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    accepted_then_duplicate(&db.pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_concurrent_duplicates_accept_exactly_one() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let receipts = concurrent_receipts(&db.pool).await;
    assert_eq!(
        receipts.iter().filter(|r| r.is_accepted()).count(),
        1,
        "{receipts:?}"
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_inbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, 1);
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_concurrent_duplicates_accept_exactly_one() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    let receipts = concurrent_receipts(&db.pool).await;
    assert_eq!(
        receipts.iter().filter(|r| r.is_accepted()).count(),
        1,
        "{receipts:?}"
    );
}
