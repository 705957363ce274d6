//! Handoffs at commit (`HandoffTransaction`): rows written leased to the in-process
//! dispatcher are published right after the commit without a claim, exactly once; rolled
//! back rows never; rows never handed over (a dead dispatcher, a transaction that outlived
//! its lease) are claimed by a dispatcher once their lease ends, still exactly once.
//! Real Postgres and SQLite.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::collections::HashMap;
use std::time::Duration;

use sqlx::Pool;
use tokio::time::{Instant, sleep};
use trellis_outbox::{
    DispatchError, Error, MemoryOutboxRepository, OutboxDatabase, OutboxDispatcher,
    OutboxRepository, OutboxTransactionExt, PgOutboxRepository, PreparedOutboxRecord,
    SqlOutboxRepository, SqliteOutboxRepository, migrate,
};
use trellis_outbox_tests::crash::{TablePublisher, spawn_child};
use trellis_outbox_tests::publisher::RecordingPublisher;
use trellis_outbox_tests::{TestPg, TestSqlite};

/// Long enough that neither a claim after the lease nor the idle poll can explain a publish.
const HOUR: Duration = Duration::from_secs(3600);
const WAIT: Duration = Duration::from_secs(30);

use trellis_outbox_tests::order_placed as record;

fn keyed(n: usize, key: &str) -> PreparedOutboxRecord {
    record(n).ordered_by(key)
}

/// How many times each row was published.
fn publishes(publisher: &RecordingPublisher) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for id in publisher.successes() {
        *counts.entry(id).or_default() += 1;
    }
    counts
}

async fn undispatched<DB: OutboxDatabase>(pool: &Pool<DB>) -> u64 {
    SqlOutboxRepository::new(pool.clone())
        .backlog()
        .await
        .unwrap()
        .unwrap()
        .undispatched
}

/// Waits until `ids` were each published and no row is left undispatched.
async fn settled<DB: OutboxDatabase>(
    pool: &Pool<DB>,
    publisher: &RecordingPublisher,
    ids: &[&str],
) {
    let start = Instant::now();
    loop {
        let published = publishes(publisher);
        if ids.iter().all(|id| published.contains_key(*id)) && undispatched(pool).await == 0 {
            return;
        }
        assert!(
            start.elapsed() < WAIT,
            "not settled after {WAIT:?}: published {published:?}, {} undispatched",
            undispatched(pool).await
        );
        sleep(Duration::from_millis(5)).await;
    }
}

/// A publisher whose start-up check waits until [`Gated::open`]: the dispatcher's drains
/// (which start after it) do not run until then, while its handoff lane already does.
#[derive(Debug, Clone)]
struct Gated {
    inner: RecordingPublisher,
    open: std::sync::Arc<tokio::sync::watch::Sender<bool>>,
}

impl Gated {
    fn new(inner: &RecordingPublisher) -> Self {
        Self {
            inner: inner.clone(),
            open: std::sync::Arc::new(tokio::sync::watch::Sender::new(false)),
        }
    }

    fn open(&self) {
        self.open.send_replace(true);
    }
}

impl trellis_outbox::Publisher for Gated {
    async fn publish_batch(
        &self,
        messages: &[trellis_outbox::OutboxMessage],
    ) -> Vec<Result<Option<serde_json::Value>, trellis_outbox::PublishError>> {
        self.inner.publish_batch(messages).await
    }

    async fn on_start(&self, _: &trellis_outbox::RetryPolicy) {
        let _ = self.open.subscribe().wait_for(|open| *open).await;
    }
}

/// A dispatcher that neither polls nor gets notified: only handoffs reach it (leases of an
/// hour, so no claim takes a handed-over row either).
fn quiet<DB: OutboxDatabase>(pool: &Pool<DB>, publisher: &RecordingPublisher) -> OutboxDispatcher {
    OutboxDispatcher::builder(SqlOutboxRepository::new(pool.clone()), publisher.clone())
        .lease(HOUR)
        .idle_interval(HOUR)
        .start()
        .unwrap()
}

async fn committed_rows_are_published_at_once<DB: OutboxDatabase>(pool: Pool<DB>) {
    migrate(&pool).await.unwrap();
    let publisher = RecordingPublisher::new();
    let dispatcher = quiet(&pool, &publisher);
    // Drained once at start (nothing there); from now on only a handoff publishes.
    sleep(Duration::from_millis(50)).await;
    let handle = dispatcher.handle();
    let records: Vec<_> = (0..3).map(record).collect();
    let mut tx = handle.begin(&pool).await.unwrap();
    for r in &records {
        tx.enqueue(r).await.unwrap();
    }
    assert_eq!(tx.handed_over(), 3);
    let started = Instant::now();
    tx.commit().await.unwrap();
    let ids: Vec<&str> = records.iter().map(|r| r.id.as_str()).collect();
    settled(&pool, &publisher, &ids).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "published and marked without a claim"
    );
    // Nothing was claimed: one batch, published once per row.
    assert!(publishes(&publisher).values().all(|&n| n == 1));
    assert_eq!(publisher.batches(), 1);
    dispatcher.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_committed_rows_are_published_at_once() {
    let db = TestPg::new().await;
    committed_rows_are_published_at_once(db.pool.clone()).await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_committed_rows_are_published_at_once() {
    let db = TestSqlite::new().await;
    committed_rows_are_published_at_once(db.pool.clone()).await;
}

/// A handoff's statements send no `NOTIFY` (its rows are leased to this process's dispatcher,
/// which the commit wakes in-process for the rest), whether written one by one, together or
/// keyed; a plain enqueue on the same outbox still does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_handoff_sends_no_notify() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let mut listener = sqlx::postgres::PgListener::connect_with(&db.pool)
        .await
        .unwrap();
    listener.listen("trellis_outbox_wakeup").await.unwrap();
    let publisher = RecordingPublisher::new();
    let dispatcher = quiet(&db.pool, &publisher);
    sleep(Duration::from_millis(50)).await;
    let handle = dispatcher.handle();
    let (one, all, key) = (record(0), vec![record(1), record(2)], keyed(3, "k"));
    let mut tx = handle.begin(&db.pool).await.unwrap();
    tx.enqueue(&one).await.unwrap();
    tx.enqueue_all(all.clone()).await.unwrap();
    tx.enqueue(&key).await.unwrap();
    assert_eq!(tx.handed_over(), 3);
    tx.commit().await.unwrap();
    let ids = [&one.id, &all[0].id, &all[1].id, &key.id].map(String::as_str);
    settled(&db.pool, &publisher, &ids).await;
    let heard = tokio::time::timeout(Duration::from_millis(500), listener.try_recv()).await;
    assert!(heard.is_err(), "the handoff notified: {heard:?}");

    let mut tx = db.pool.begin().await.unwrap();
    tx.enqueue(&record(4)).await.unwrap();
    tx.commit().await.unwrap();
    let heard = tokio::time::timeout(Duration::from_secs(5), listener.try_recv()).await;
    assert!(
        matches!(heard, Ok(Ok(Some(_)))),
        "a plain enqueue did not notify: {heard:?}"
    );
    dispatcher.shutdown().await;
}

/// A publisher that holds every publish until [`Stalling::open`], counting the calls that
/// started.
#[derive(Debug, Clone)]
struct Stalling {
    inner: RecordingPublisher,
    open: std::sync::Arc<tokio::sync::watch::Sender<bool>>,
    entered: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl trellis_outbox::Publisher for Stalling {
    async fn publish_batch(
        &self,
        messages: &[trellis_outbox::OutboxMessage],
    ) -> Vec<Result<Option<serde_json::Value>, trellis_outbox::PublishError>> {
        self.entered
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let _ = self.open.subscribe().wait_for(|open| *open).await;
        self.inner.publish_batch(messages).await
    }
}

/// While publishing stalls, handed-over rows queue in memory only up to
/// `max_handoff_backlog`: a commit past it hands nothing over, and its rows wait for their
/// lease like rows of a dead dispatcher (then a drain publishes them once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_handoffs_past_the_backlog_bound_wait_for_their_lease() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let recorded = RecordingPublisher::new();
    let publisher = Stalling {
        inner: recorded.clone(),
        open: std::sync::Arc::new(tokio::sync::watch::Sender::new(false)),
        entered: std::sync::Arc::default(),
    };
    let dispatcher =
        OutboxDispatcher::builder(SqlOutboxRepository::new(db.pool.clone()), publisher.clone())
            .lease(Duration::from_secs(2))
            .idle_interval(Duration::from_millis(100))
            .max_handoff_backlog(5)
            .start()
            .unwrap();
    sleep(Duration::from_millis(50)).await;
    let handle = dispatcher.handle();
    let mut batches = Vec::new();
    for t in 0..3 {
        let records: Vec<_> = (t * 3..t * 3 + 3).map(record).collect();
        let mut tx = handle.begin(&db.pool).await.unwrap();
        tx.enqueue_all(records.clone()).await.unwrap();
        assert_eq!(tx.handed_over(), 3);
        tx.commit().await.unwrap();
        batches.push(records);
        if t == 0 {
            // The lane took the first handoff and is stuck publishing it.
            let start = Instant::now();
            while publisher.entered.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                assert!(start.elapsed() < WAIT, "the lane never published");
                sleep(Duration::from_millis(5)).await;
            }
        }
    }
    // Queued: the second handoff (3 rows); the third would have made 6, past 5.
    let committed = Instant::now();
    publisher.open.send_replace(true);
    sleep_until_after(committed, Duration::from_secs(1)).await;
    let published = publishes(&recorded);
    for r in batches[0].iter().chain(&batches[1]) {
        assert_eq!(published.get(&r.id), Some(&1), "{} was handed over", r.id);
    }
    for r in &batches[2] {
        assert!(!published.contains_key(&r.id), "{} was handed over", r.id);
    }
    let ids: Vec<&str> = batches.iter().flatten().map(|r| r.id.as_str()).collect();
    settled(&db.pool, &recorded, &ids).await;
    assert!(publishes(&recorded).values().all(|&n| n == 1));
    dispatcher.shutdown().await;
}

async fn sleep_until_after(start: Instant, after: Duration) {
    tokio::time::sleep_until(start + after).await;
}

async fn rolled_back_rows_are_never_published<DB: OutboxDatabase>(pool: Pool<DB>) {
    migrate(&pool).await.unwrap();
    let publisher = RecordingPublisher::new();
    let dispatcher = quiet(&pool, &publisher);
    let handle = dispatcher.handle();
    let mut tx = handle.begin(&pool).await.unwrap();
    tx.enqueue(&record(1)).await.unwrap();
    tx.rollback().await.unwrap();
    {
        let mut tx = handle.begin(&pool).await.unwrap();
        tx.enqueue(&record(2)).await.unwrap();
        // Dropped: rolled back.
    }
    let kept = record(3);
    let mut tx = handle.begin(&pool).await.unwrap();
    tx.enqueue(&kept).await.unwrap();
    tx.commit().await.unwrap();
    settled(&pool, &publisher, &[&kept.id]).await;
    dispatcher.shutdown().await;
    assert_eq!(publisher.successes(), vec![kept.id]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rolled_back_rows_are_never_published() {
    let db = TestPg::new().await;
    rolled_back_rows_are_never_published(db.pool.clone()).await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_rolled_back_rows_are_never_published() {
    let db = TestSqlite::new().await;
    rolled_back_rows_are_never_published(db.pool.clone()).await;
}

/// A statement that failed after the enqueue, its error swallowed: Postgres has aborted the
/// transaction, and its `COMMIT` would roll back while sqlx reports success. The commit
/// fails instead, and the row (never stored) is not published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_aborted_transaction_hands_nothing_over() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let publisher = RecordingPublisher::new();
    let dispatcher = quiet(&db.pool, &publisher);
    let handle = dispatcher.handle();
    let mut tx = handle.begin(&db.pool).await.unwrap();
    tx.enqueue(&record(1)).await.unwrap();
    assert!(sqlx::query("SELECT 1 / 0").execute(&mut *tx).await.is_err());
    let err = tx.commit().await.unwrap_err();
    let code = err.as_database_error().and_then(|e| e.code());
    assert_eq!(code.as_deref(), Some("25P02"), "{err}");
    let kept = record(2);
    let mut tx = handle.begin(&db.pool).await.unwrap();
    tx.enqueue(&kept).await.unwrap();
    tx.commit().await.unwrap();
    settled(&db.pool, &publisher, &[&kept.id]).await;
    dispatcher.shutdown().await;
    assert_eq!(publisher.successes(), vec![kept.id]);
    db.close().await;
}

/// A savepoint commits nothing until its outer transaction does, which may roll back: it
/// cannot be handed over.
async fn a_savepoint_is_not_handed_over<DB: OutboxDatabase>(pool: Pool<DB>) {
    use sqlx::Acquire as _;
    migrate(&pool).await.unwrap();
    let publisher = RecordingPublisher::new();
    let dispatcher = quiet(&pool, &publisher);
    let handle = dispatcher.handle();
    let mut outer = pool.begin().await.unwrap();
    let savepoint = outer.begin().await.unwrap();
    match handle.handoff(savepoint) {
        Err(Error::Handoff { problem }) => assert!(problem.contains("savepoint"), "{problem}"),
        other => panic!("expected Error::Handoff, got {other:?}"),
    }
    outer.rollback().await.unwrap();
    let tx = pool.begin().await.unwrap();
    handle.handoff(tx).unwrap().rollback().await.unwrap();
    dispatcher.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_savepoint_is_not_handed_over() {
    let db = TestPg::new().await;
    a_savepoint_is_not_handed_over(db.pool.clone()).await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_savepoint_is_not_handed_over() {
    let db = TestSqlite::new().await;
    a_savepoint_is_not_handed_over(db.pool.clone()).await;
}

/// A dispatcher that dies holding handed-over rows (aborted while its publisher hangs)
/// leaves them leased; another dispatcher claims them once the lease ends, not before,
/// and publishes each once.
async fn rows_of_a_dead_dispatcher_are_claimed_after_their_lease<DB: OutboxDatabase>(
    pool: Pool<DB>,
) {
    migrate(&pool).await.unwrap();
    let lease = Duration::from_secs(2);
    let hung = RecordingPublisher::new();
    let records: Vec<_> = (0..3).map(record).collect();
    let gate = hung.hold(&records[0].id);
    let dying = OutboxDispatcher::builder(SqlOutboxRepository::new(pool.clone()), hung.clone())
        .lease(lease)
        .idle_interval(HOUR)
        .start()
        .unwrap();
    let mut tx = dying.handle().begin(&pool).await.unwrap();
    for r in &records {
        tx.enqueue(r).await.unwrap();
    }
    let committed = Instant::now();
    tx.commit().await.unwrap();
    // The lane has called the publisher, which hangs: the rows are in flight.
    let start = Instant::now();
    while hung.total_attempts() == 0 {
        assert!(
            start.elapsed() < WAIT,
            "the handoff never reached the publisher"
        );
        sleep(Duration::from_millis(5)).await;
    }
    assert!(
        !dying.shutdown_timeout(Duration::ZERO).await,
        "aborted, as a kill would"
    );
    drop(gate);

    let publisher = RecordingPublisher::new();
    let survivor =
        OutboxDispatcher::builder(SqlOutboxRepository::new(pool.clone()), publisher.clone())
            .idle_interval(Duration::from_millis(20))
            .start()
            .unwrap();
    let ids: Vec<&str> = records.iter().map(|r| r.id.as_str()).collect();
    settled(&pool, &publisher, &ids).await;
    let first = publisher
        .attempts()
        .into_iter()
        .map(|a| a.at)
        .min()
        .unwrap();
    assert!(
        first.duration_since(committed) >= lease - Duration::from_millis(100),
        "claimed {:?} after the commit, before the lease of {lease:?} ended",
        first.duration_since(committed)
    );
    assert!(publishes(&publisher).values().all(|&n| n == 1));
    assert_eq!(hung.successes(), Vec::<String>::new());
    survivor.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rows_of_a_dead_dispatcher_are_claimed_after_their_lease() {
    let db = TestPg::new().await;
    rows_of_a_dead_dispatcher_are_claimed_after_their_lease(db.pool.clone()).await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_rows_of_a_dead_dispatcher_are_claimed_after_their_lease() {
    let db = TestSqlite::new().await;
    rows_of_a_dead_dispatcher_are_claimed_after_their_lease(db.pool.clone()).await;
}

/// Published handed-over rows wait a little to be marked together. While they wait, the
/// lane publishes the next handoff; if that publish outlasts their lease, they must still be
/// marked in time, not claimed by a drain and published again.
async fn rows_waiting_for_their_mark_keep_their_lease<DB: OutboxDatabase>(pool: Pool<DB>) {
    migrate(&pool).await.unwrap();
    let lease = Duration::from_millis(600);
    let publisher = RecordingPublisher::new();
    let (first, second) = (record(1), record(2));
    let gate = publisher.hold(&first.id);
    publisher.delay(&second.id, Duration::from_secs(2));
    let dispatcher =
        OutboxDispatcher::builder(SqlOutboxRepository::new(pool.clone()), publisher.clone())
            .lease(lease)
            .idle_interval(Duration::from_millis(20))
            .start()
            .unwrap();
    let handle = dispatcher.handle();
    let mut tx = handle.begin(&pool).await.unwrap();
    tx.enqueue(&first).await.unwrap();
    tx.commit().await.unwrap();
    let start = Instant::now();
    while publisher.attempt_count(&first.id) == 0 {
        assert!(
            start.elapsed() < WAIT,
            "the first handoff never reached the publisher"
        );
        sleep(Duration::from_millis(5)).await;
    }
    // Queued behind the first: the lane takes it as soon as the first is published.
    let mut tx = handle.begin(&pool).await.unwrap();
    tx.enqueue(&second).await.unwrap();
    tx.commit().await.unwrap();
    gate.open();
    settled(&pool, &publisher, &[&first.id, &second.id]).await;
    dispatcher.shutdown().await;
    assert_eq!(
        publishes(&publisher),
        HashMap::from([(first.id.clone(), 1), (second.id.clone(), 1)])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rows_waiting_for_their_mark_keep_their_lease() {
    let db = TestPg::new().await;
    rows_waiting_for_their_mark_keep_their_lease(db.pool.clone()).await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_rows_waiting_for_their_mark_keep_their_lease() {
    let db = TestSqlite::new().await;
    rows_waiting_for_their_mark_keep_their_lease(db.pool.clone()).await;
}

/// A transaction that commits after its rows' lease ended: another dispatcher may claim
/// them at once, while the handoff arrives past its deadline. Each row is still
/// published once (the handoff re-takes the lease by its token only if nobody claimed the
/// row meanwhile).
async fn a_transaction_that_outlived_its_lease_publishes_once<DB: OutboxDatabase>(pool: Pool<DB>) {
    migrate(&pool).await.unwrap();
    let publisher = RecordingPublisher::new();
    let slow = OutboxDispatcher::builder(SqlOutboxRepository::new(pool.clone()), publisher.clone())
        .lease(Duration::from_millis(300))
        .idle_interval(HOUR)
        .start()
        .unwrap();
    let poller =
        OutboxDispatcher::builder(SqlOutboxRepository::new(pool.clone()), publisher.clone())
            .idle_interval(Duration::from_millis(10))
            .start()
            .unwrap();
    let mut all = Vec::new();
    for round in 0..5 {
        let records: Vec<_> = (0..4).map(|n| record(round * 10 + n)).collect();
        let mut tx = slow.handle().begin(&pool).await.unwrap();
        for r in &records {
            tx.enqueue(r).await.unwrap();
        }
        // Past the lease before the commit.
        sleep(Duration::from_millis(400)).await;
        tx.commit().await.unwrap();
        // Settled before the next round: on SQLite the next long transaction holds the only
        // write lock for longer than a lease, so a mark waiting behind it would find the
        // rows claimed again by then (any leased dispatcher's would: JetStream's
        // de-duplication covers that case, this test counts publishes).
        let ids: Vec<&str> = records.iter().map(|r| r.id.as_str()).collect();
        settled(&pool, &publisher, &ids).await;
        all.extend(records.into_iter().map(|r| r.id));
    }
    let ids: Vec<&str> = all.iter().map(String::as_str).collect();
    settled(&pool, &publisher, &ids).await;
    // Late publishes would show up now.
    sleep(Duration::from_millis(500)).await;
    let counts = publishes(&publisher);
    assert_eq!(counts.len(), all.len());
    assert!(
        counts.values().all(|&n| n == 1),
        "published twice: {counts:?}"
    );
    slow.shutdown().await;
    poller.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_transaction_that_outlived_its_lease_publishes_once() {
    let db = TestPg::new().await;
    a_transaction_that_outlived_its_lease_publishes_once(db.pool.clone()).await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_transaction_that_outlived_its_lease_publishes_once() {
    let db = TestSqlite::new().await;
    a_transaction_that_outlived_its_lease_publishes_once(db.pool.clone()).await;
}

/// A handoff whose lease could not be kept (it ended before the commit, and one of its rows
/// is held by another claim now) is released, not published: the lane wakes the drains,
/// which claim the released rows at once, not at the next idle poll.
async fn a_released_handoff_is_claimed_at_once<DB: OutboxDatabase>(pool: Pool<DB>)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    migrate(&pool).await.unwrap();
    let publisher = RecordingPublisher::new();
    let dispatcher =
        OutboxDispatcher::builder(SqlOutboxRepository::new(pool.clone()), publisher.clone())
            .lease(Duration::from_millis(300))
            .idle_interval(HOUR)
            .start()
            .unwrap();
    sleep(Duration::from_millis(100)).await;
    let records: Vec<_> = (0..4).map(|n| record(900 + n)).collect();
    let mut tx = dispatcher.handle().begin(&pool).await.unwrap();
    for r in &records {
        tx.enqueue(r).await.unwrap();
    }
    // One row is another claim's now (its lease ended too), and the handoff's lease ends
    // before the commit: the lane cannot extend it, so it releases the batch.
    let other = records[0].id.clone();
    sqlx::query("UPDATE trellis_outbox SET claim_token = 'another-claim' WHERE id = $1")
        .bind(other)
        .execute(&mut *tx)
        .await
        .unwrap();
    sleep(Duration::from_millis(400)).await;
    tx.commit().await.unwrap();
    let ids: Vec<&str> = records.iter().map(|r| r.id.as_str()).collect();
    let start = Instant::now();
    while !ids.iter().all(|id| publishes(&publisher).contains_key(*id)) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "released rows not claimed: {:?}",
            publishes(&publisher)
        );
        sleep(Duration::from_millis(20)).await;
    }
    dispatcher.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_released_handoff_is_claimed_at_once() {
    let db = TestPg::new().await;
    a_released_handoff_is_claimed_at_once(db.pool.clone()).await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_released_handoff_is_claimed_at_once() {
    let db = TestSqlite::new().await;
    a_released_handoff_is_claimed_at_once(db.pool.clone()).await;
}

/// Stores `done` dispatched (by a one-shot drain) and `waiting` pending, then starts a
/// dispatcher whose drains wait for the returned gate (so `waiting` stays unclaimed) while
/// its handoff lane runs.
async fn dispatched_and_waiting<DB: OutboxDatabase>(
    pool: &Pool<DB>,
    publisher: &RecordingPublisher,
    done: &PreparedOutboxRecord,
    waiting: &PreparedOutboxRecord,
) -> (OutboxDispatcher, Gated) {
    let mut tx = pool.begin().await.unwrap();
    tx.enqueue(done).await.unwrap();
    tx.commit().await.unwrap();
    let repo = SqlOutboxRepository::new(pool.clone());
    let report = trellis_outbox::dispatch_outbox(&repo, publisher, Default::default())
        .await
        .unwrap();
    assert_eq!(report.dispatched, 1);
    let mut tx = pool.begin().await.unwrap();
    tx.enqueue(waiting).await.unwrap();
    tx.commit().await.unwrap();
    let gate = Gated::new(publisher);
    let dispatcher = OutboxDispatcher::builder(repo, gate.clone())
        .lease(HOUR)
        .idle_interval(HOUR)
        .start()
        .unwrap();
    (dispatcher, gate)
}

/// Keyed records and ids already dispatched take the usual path: not handed over, published
/// after the commit's notify, in key order. An id stored and still waiting is handed over.
async fn keyed_and_existing_rows_take_the_usual_path<DB: OutboxDatabase>(pool: Pool<DB>) {
    migrate(&pool).await.unwrap();
    let publisher = RecordingPublisher::new();
    let (existing, waiting) = (record(0), record(4));
    let (dispatcher, gate) = dispatched_and_waiting(&pool, &publisher, &existing, &waiting).await;
    let handle = dispatcher.handle();

    let (a, b, plain) = (keyed(1, "order-1"), keyed(2, "order-1"), record(3));
    let mut tx = handle.begin(&pool).await.unwrap();
    tx.enqueue(&existing).await.unwrap();
    tx.enqueue(&a).await.unwrap();
    tx.enqueue(&b).await.unwrap();
    assert_eq!(
        tx.handed_over(),
        0,
        "keyed and dispatched rows are not handed over"
    );
    tx.enqueue(&waiting).await.unwrap();
    assert_eq!(tx.handed_over(), 1, "a stored row still waiting is");
    tx.enqueue(&plain).await.unwrap();
    assert_eq!(tx.handed_over(), 2);
    tx.commit().await.unwrap();
    gate.open();
    settled(&pool, &publisher, &[&a.id, &b.id, &plain.id, &waiting.id]).await;
    dispatcher.shutdown().await;
    let order = publisher.successes();
    let pos = |id: &str| order.iter().position(|x| x == id).unwrap();
    assert!(pos(&a.id) < pos(&b.id), "key order kept: {order:?}");
    assert!(publishes(&publisher).values().all(|&n| n == 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_keyed_and_existing_rows_take_the_usual_path() {
    let db = TestPg::new().await;
    keyed_and_existing_rows_take_the_usual_path(db.pool.clone()).await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_keyed_and_existing_rows_take_the_usual_path() {
    let db = TestSqlite::new().await;
    keyed_and_existing_rows_take_the_usual_path(db.pool.clone()).await;
}

/// `enqueue_all` writes the batch and leases its unkeyed rows in one more statement: those
/// just written and a stored row of the same id still waiting are handed over; keyed rows
/// and a row already dispatched are not.
async fn enqueue_all_hands_over_the_unkeyed_rows<DB: OutboxDatabase>(pool: Pool<DB>) {
    migrate(&pool).await.unwrap();
    let publisher = RecordingPublisher::new();
    let (done, waiting) = (record(100), record(101));
    let (dispatcher, gate) = dispatched_and_waiting(&pool, &publisher, &done, &waiting).await;
    let handle = dispatcher.handle();

    let fresh: Vec<_> = (0..5).map(record).collect();
    let (k1, k2) = (keyed(10, "order-9"), keyed(11, "order-9"));
    let mut batch = fresh.clone();
    batch.extend([
        k1.clone(),
        k2.clone(),
        done.clone(),
        waiting.clone(),
        fresh[0].clone(),
    ]);
    let mut tx = handle.begin(&pool).await.unwrap();
    let stored = tx.enqueue_all(batch.clone()).await.unwrap();
    assert_eq!(
        stored.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(),
        batch.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        "stored rows in input order"
    );
    assert_eq!(tx.handed_over(), 6, "five fresh rows and the waiting one");
    tx.commit().await.unwrap();
    gate.open();
    let mut ids: Vec<&str> = fresh.iter().map(|r| r.id.as_str()).collect();
    ids.extend([k1.id.as_str(), k2.id.as_str(), waiting.id.as_str()]);
    settled(&pool, &publisher, &ids).await;
    dispatcher.shutdown().await;
    let counts = publishes(&publisher);
    assert_eq!(counts.len(), 9, "{counts:?}");
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");
    let order = publisher.successes();
    let pos = |id: &str| order.iter().position(|x| x == id).unwrap();
    assert!(pos(&k1.id) < pos(&k2.id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_enqueue_all_hands_over_the_unkeyed_rows() {
    let db = TestPg::new().await;
    enqueue_all_hands_over_the_unkeyed_rows(db.pool.clone()).await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_enqueue_all_hands_over_the_unkeyed_rows() {
    let db = TestSqlite::new().await;
    enqueue_all_hands_over_the_unkeyed_rows(db.pool.clone()).await;
}

/// A handed-over row whose publish fails is marked failed and retried by the drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_handoff_is_retried_by_the_drains() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let publisher = RecordingPublisher::new();
    let r = record(1);
    publisher.fail_times(&r.id, 1, "no responders");
    let dispatcher =
        OutboxDispatcher::builder(PgOutboxRepository::new(db.pool.clone()), publisher.clone())
            .idle_interval(HOUR)
            .retry_policy(trellis_outbox::RetryPolicy::fixed(Duration::from_millis(
                100,
            )))
            .start()
            .unwrap();
    let mut tx = dispatcher.handle().begin(&db.pool).await.unwrap();
    tx.enqueue(&r).await.unwrap();
    tx.commit().await.unwrap();
    settled(&db.pool, &publisher, &[&r.id]).await;
    assert_eq!(publisher.attempts_of(&r.id), vec![0, 1]);
    dispatcher.shutdown().await;
    db.close().await;
}

/// Four dispatchers on one Postgres, each handed rows by its own writers, while also
/// draining rows enqueued the usual way and keyed rows: every row is published once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_dispatchers_with_handoffs_publish_every_row_once() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let publisher = RecordingPublisher::new();
    let dispatchers: Vec<_> = (0..4)
        .map(|_| {
            OutboxDispatcher::builder(PgOutboxRepository::new(db.pool.clone()), publisher.clone())
                .batch_size(7)
                .lease(Duration::from_millis(500))
                .idle_interval(Duration::from_millis(20))
                .start()
                .unwrap()
        })
        .collect();
    let mut writers = Vec::new();
    for w in 0..8 {
        let pool = db.pool.clone();
        let handle = dispatchers[w % 4].handle();
        writers.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            for t in 0..40 {
                let n = w * 1000 + t;
                let records = [record(n), keyed(n + 500, &format!("k{}", n % 5))];
                if t % 4 == 0 {
                    let mut tx = pool.begin().await.unwrap();
                    tx.enqueue(&records[0]).await.unwrap();
                    tx.commit().await.unwrap();
                    handle.notify();
                } else {
                    let mut tx = handle.begin(&pool).await.unwrap();
                    for r in &records {
                        tx.enqueue(r).await.unwrap();
                    }
                    if t % 7 == 0 {
                        tx.rollback().await.unwrap();
                        continue;
                    }
                    tx.commit().await.unwrap();
                }
                ids.extend(records.iter().map(|r| r.id.clone()).take(if t % 4 == 0 {
                    1
                } else {
                    2
                }));
            }
            ids
        }));
    }
    let mut all = Vec::new();
    for writer in writers {
        all.extend(writer.await.unwrap());
    }
    let ids: Vec<&str> = all.iter().map(String::as_str).collect();
    settled(&db.pool, &publisher, &ids).await;
    sleep(Duration::from_millis(300)).await;
    let counts = publishes(&publisher);
    assert_eq!(counts.len(), all.len(), "only committed rows are published");
    assert!(
        counts.values().all(|&n| n == 1),
        "a row was published twice"
    );
    for dispatcher in dispatchers {
        dispatcher.shutdown().await;
    }
    db.close().await;
}

/// Handoffs need the dispatcher's SQL outbox on the transaction's kind of database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_the_dispatcher_cannot_take_is_a_typed_error() {
    let sqlite = TestSqlite::new().await;
    migrate(&sqlite.pool).await.unwrap();
    let memory =
        OutboxDispatcher::builder(MemoryOutboxRepository::new(), RecordingPublisher::new())
            .start()
            .unwrap();
    let err = memory.handle().begin(&sqlite.pool).await.unwrap_err();
    assert!(matches!(err, Error::Handoff { .. }), "{err}");
    assert!(err.to_string().contains("no SQL outbox table"), "{err}");
    let on_sqlite = OutboxDispatcher::builder(
        SqliteOutboxRepository::new(sqlite.pool.clone()),
        RecordingPublisher::new(),
    )
    .start()
    .unwrap();
    let pg = TestPg::new().await;
    let tx = pg.pool.begin().await.unwrap();
    let err = on_sqlite.handle().handoff(tx).unwrap_err();
    assert!(
        err.to_string().contains("another kind of database"),
        "{err}"
    );
    memory.shutdown().await;
    on_sqlite.shutdown().await;
    pg.close().await;
}

/// Shutdown releases rows handed over but not yet published: another dispatcher takes
/// them at once, not after their lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_releases_rows_not_yet_published() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let hung = RecordingPublisher::new();
    let (first, second) = (record(1), record(2));
    let gate = hung.hold(&first.id);
    let errors = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen = errors.clone();
    let stopping =
        OutboxDispatcher::builder(PgOutboxRepository::new(db.pool.clone()), hung.clone())
            .lease(HOUR)
            .idle_interval(HOUR)
            .on_error(move |e: &DispatchError| seen.lock().unwrap().push(e.to_string()))
            .start()
            .unwrap();
    let handle = stopping.handle();
    for r in [&first, &second] {
        let mut tx = handle.begin(&db.pool).await.unwrap();
        tx.enqueue(r).await.unwrap();
        tx.commit().await.unwrap();
        while hung.total_attempts() == 0 {
            sleep(Duration::from_millis(5)).await;
        }
    }
    // The first batch hangs in the publisher; the second waits in the lane.
    let stop = tokio::spawn(stopping.shutdown());
    sleep(Duration::from_millis(100)).await;
    gate.open();
    stop.await.unwrap();
    let publisher = RecordingPublisher::new();
    let other =
        OutboxDispatcher::builder(PgOutboxRepository::new(db.pool.clone()), publisher.clone())
            .start()
            .unwrap();
    settled(&db.pool, &publisher, &[&second.id]).await;
    assert_eq!(hung.successes(), vec![first.id.clone()]);
    assert_eq!(publisher.successes(), vec![second.id.clone()]);
    other.shutdown().await;
    db.close().await;
}

/// Beside an upstream Trellis dispatcher, a handed-over row also carries upstream's lease
/// (`next_attempt_at` = the lease's end), so upstream does not take it meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beside_upstream_a_handed_over_row_carries_upstreams_lease() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let hung = RecordingPublisher::new();
    let r = record(1);
    let gate = hung.hold(&r.id);
    let dispatcher = OutboxDispatcher::builder(
        PgOutboxRepository::new(db.pool.clone()).beside_upstream(),
        hung.clone(),
    )
    .lease(Duration::from_secs(60))
    .idle_interval(HOUR)
    .start()
    .unwrap();
    let mut tx = dispatcher.handle().begin(&db.pool).await.unwrap();
    tx.enqueue(&r).await.unwrap();
    tx.commit().await.unwrap();
    let (token, lease_s, upstream_s): (Option<String>, f64, f64) = sqlx::query_as(
        "SELECT claim_token, EXTRACT(EPOCH FROM claimed_until - now())::float8, \
         EXTRACT(EPOCH FROM next_attempt_at - now())::float8 FROM trellis_outbox WHERE id = $1",
    )
    .bind(&r.id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(token.is_some());
    assert!((55.0..=61.0).contains(&lease_s), "lease {lease_s} s");
    assert!(
        (lease_s - upstream_s).abs() < 1.0,
        "upstream's lease {upstream_s} s"
    );
    gate.open();
    settled(&db.pool, &hung, &[&r.id]).await;
    let next: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT next_attempt_at FROM trellis_outbox WHERE id = $1")
            .bind(&r.id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(next, None, "cleared by the mark");
    dispatcher.shutdown().await;
    db.close().await;
}

/// Business statements run on the handoff transaction itself (`&mut *tx`): they commit or
/// roll back together with its events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn business_rows_share_the_handoff_transaction() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::raw_sql("CREATE TABLE orders (id text PRIMARY KEY)")
        .execute(&db.pool)
        .await
        .unwrap();
    let publisher = RecordingPublisher::new();
    let dispatcher = quiet(&db.pool, &publisher);
    let handle = dispatcher.handle();
    let (kept, dropped) = (record(1), record(2));
    let mut tx = handle.handoff(db.pool.begin().await.unwrap()).unwrap();
    sqlx::query("INSERT INTO orders (id) VALUES ('o-1')")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.enqueue(&kept).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = handle.begin(&db.pool).await.unwrap();
    sqlx::query("INSERT INTO orders (id) VALUES ('o-2')")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.enqueue(&dropped).await.unwrap();
    tx.rollback().await.unwrap();
    settled(&db.pool, &publisher, &[&kept.id]).await;
    let orders: Vec<String> = sqlx::query_scalar("SELECT id FROM orders")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(orders, vec!["o-1".to_owned()]);
    dispatcher.shutdown().await;
    assert_eq!(publisher.successes(), vec![kept.id]);
}

const CHILD_ENV: &str = "TRELLIS_HANDOFF_CHILD_DB";
/// How many one-row handoff transactions the child commits.
const CHILD_ROWS: i64 = 20;

/// Not a test: the body of the child process `a_killed_process_s_handoffs_…` kills. It
/// commits `CHILD_ROWS` handoff transactions to a dispatcher (2 s lease) whose broker stalls
/// for a minute, then waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "entry point of the handoff crash test's child process"]
async fn handoff_child_process() {
    let Ok(db_name) = std::env::var(CHILD_ENV) else {
        return;
    };
    let options: sqlx::postgres::PgConnectOptions = trellis_outbox_tests::database_url()
        .parse()
        .expect("DATABASE_URL is a Postgres URL");
    let pool = sqlx::PgPool::connect_with(options.database(&db_name))
        .await
        .expect("the child connects to the parent's database");
    let dispatcher = OutboxDispatcher::builder(
        PgOutboxRepository::new(pool.clone()),
        TablePublisher {
            pool: pool.clone(),
            pause: Duration::from_secs(60),
        },
    )
    .lease(Duration::from_secs(2))
    .idle_interval(HOUR)
    .start()
    .expect("the child's dispatcher starts");
    for n in 0..CHILD_ROWS {
        let mut tx = dispatcher.handle().begin(&pool).await.unwrap();
        tx.enqueue(&record(n as usize)).await.unwrap();
        tx.commit().await.unwrap();
    }
    sleep(Duration::from_secs(120)).await;
}

/// A process killed (SIGKILL) after committing handoffs, while its dispatcher is still
/// publishing them: the rows stay leased until their lease ends, then another dispatcher
/// publishes each exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_process_s_handoffs_are_published_once_after_their_lease() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE published (id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut child = spawn_child("handoff_child_process", CHILD_ENV, &db.name);
    let start = Instant::now();
    loop {
        let leased: i64 =
            sqlx::query_scalar("SELECT count(*) FROM trellis_outbox WHERE claim_token IS NOT NULL")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        if leased == CHILD_ROWS {
            break;
        }
        assert!(start.elapsed() < WAIT, "the child committed {leased} rows");
        sleep(Duration::from_millis(20)).await;
    }
    // Handed over and stuck in the stalled broker.
    sleep(Duration::from_millis(200)).await;
    child.kill().unwrap();
    assert!(!child.wait().unwrap().success(), "killed, not finished");
    let (open, lease_end): (i64, chrono::DateTime<chrono::Utc>) = sqlx::query_as(
        "SELECT count(*), min(claimed_until) FROM trellis_outbox \
         WHERE state = 'pending' AND claimed_until > now()",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(open, CHILD_ROWS, "all still leased to the dead process");

    let survivor = OutboxDispatcher::builder(
        PgOutboxRepository::new(db.pool.clone()),
        TablePublisher {
            pool: db.pool.clone(),
            pause: Duration::ZERO,
        },
    )
    .idle_interval(Duration::from_millis(20))
    .start()
    .unwrap();
    let start = Instant::now();
    while undispatched(&db.pool).await > 0 {
        assert!(start.elapsed() < WAIT, "not dispatched after {WAIT:?}");
        sleep(Duration::from_millis(20)).await;
    }
    survivor.shutdown().await;
    let (rows, distinct, first): (i64, i64, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as("SELECT count(*), count(DISTINCT id), min(at) FROM published")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (rows, distinct),
        (CHILD_ROWS, CHILD_ROWS),
        "each row published once"
    );
    assert!(
        first >= lease_end,
        "published at {first}, before the lease ended at {lease_end}"
    );
    db.close().await;
}
