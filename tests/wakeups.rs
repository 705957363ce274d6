//! Postgres LISTEN/NOTIFY wake-ups: sent by enqueue, delivered only on commit, the
//! listener survives a terminated connection (re-LISTEN, then one re-scan wake-up), an
//! outbox built without NOTIFY sends none, and a dispatcher built with `listen_postgres`
//! wakes on commits nobody told it about (and reports every failed attempt to listen).

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::json;
use trellis_outbox::{
    Outbox, OutboxDispatcher, OutboxMessageState, OutboxTables, OutboxTransactionExt,
    PgOutboxRepository, PgWakeups, PreparedOutboxRecord, migrate,
};
use trellis_outbox_tests::TestPg;
use trellis_outbox_tests::publisher::RecordingPublisher;

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

#[tokio::test]
async fn an_outbox_without_notify_wakes_nobody_but_still_stores() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let (wakeups, count) = listening(&db).await;
    let quiet = Outbox::default().without_notify();

    let mut tx = db.pool.begin().await.unwrap();
    let one = quiet.enqueue(&mut tx, &record()).await.unwrap();
    let many = quiet
        .enqueue_all(&mut tx, [record(), record()])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    count.stays(0).await;
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(stored, 3);
    assert_eq!(one.state, OutboxMessageState::Pending);
    assert_eq!(many.len(), 2);

    // The same enqueue through the default outbox does notify.
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::default().enqueue(&mut tx, &record()).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count.above(0).await, 1);

    wakeups.stop().await;
    db.close().await;
}

/// `Outbox::wake` after the commit wakes the listeners of that outbox's tables (and only
/// those), and leaves the pool's connections committing synchronously.
#[tokio::test]
async fn a_wake_after_the_commit_wakes_the_outboxs_listeners() {
    let db = TestPg::new().await;
    let billing = OutboxTables::new("billing_outbox", "billing_inbox").unwrap();
    trellis_outbox::migrate_with(&db.pool, &billing)
        .await
        .unwrap();
    let (wakeups, default_count) = listening(&db).await;
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    let billing_wakeups = PgWakeups::listen(&db.pool, &billing, move || {
        c.fetch_add(1, Ordering::SeqCst);
    })
    .await
    .unwrap();
    let billing_count = Counter(count);

    let outbox = Outbox::new(billing).without_notify();
    let mut tx = db.pool.begin().await.unwrap();
    outbox.enqueue(&mut tx, &record()).await.unwrap();
    tx.commit().await.unwrap();
    billing_count.stays(0).await;
    outbox.wake(&db.pool).await.unwrap();
    assert_eq!(billing_count.above(0).await, 1);
    default_count.stays(0).await;
    // The wake-up's `synchronous_commit = off` was its transaction's alone.
    for _ in 0..4 {
        let setting: String = sqlx::query_scalar("SHOW synchronous_commit")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(setting, "on");
    }

    billing_wakeups.stop().await;
    wakeups.stop().await;
    db.close().await;
}

/// The number of this database's connections that are listening (idle after `LISTEN`).
async fn listeners(db: &TestPg) -> i64 {
    db.listening_connections().await.unwrap()
}

/// Waits up to 10 s for exactly one listening connection; fails with `what` otherwise.
async fn until_listening(db: &TestPg, what: &str) {
    for _ in 0..1000 {
        if listeners(db).await == 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(listeners(db).await, 1, "{what}");
}

/// Starts a dispatcher on `pool` that listens on `pool` and never polls, commits a row
/// through another pool ("another process", nobody calls `notify()`), checks that the row is
/// published, and shuts the dispatcher down.
async fn a_commit_wakes_a_listening_dispatcher(db: &TestPg, pool: &sqlx::PgPool) {
    let publisher = RecordingPublisher::new();
    let dispatcher =
        OutboxDispatcher::builder(PgOutboxRepository::new(pool.clone()), publisher.clone())
            .idle_interval(Duration::from_secs(3600)) // no polling: only NOTIFY can wake it
            .listen_postgres(pool, &OutboxTables::default())
            .start()
            .unwrap();
    until_listening(db, "the dispatcher is not listening").await;

    let mut tx = db.pool.begin().await.unwrap();
    let row = tx.enqueue(&record()).await.unwrap();
    tx.commit().await.unwrap();
    assert!(
        publisher.wait_for_attempts(1, Duration::from_secs(5)).await,
        "the commit did not wake the dispatcher"
    );
    assert_eq!(publisher.successes(), [row.id]);
    dispatcher.shutdown().await;
}

#[tokio::test]
async fn a_listening_dispatcher_wakes_on_commits_it_was_not_told_about() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    a_commit_wakes_a_listening_dispatcher(&db, &db.pool).await;
    assert_eq!(
        listeners(&db).await,
        0,
        "shutdown left the listener running"
    );
    db.close().await;
}

/// The listener's connection is its own: a dispatcher whose repository and listener share a
/// pool of one connection still claims. (The listener used to hold that one connection for
/// good, and every claim timed out waiting for it.)
#[tokio::test]
async fn the_listener_takes_no_connection_from_the_pool() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(db.options.clone())
        .await
        .unwrap();
    a_commit_wakes_a_listening_dispatcher(&db, &pool).await;
    pool.close().await;
    db.close().await;
}

#[tokio::test]
async fn a_listener_that_cannot_connect_reports_every_attempt_and_the_dispatcher_still_works() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    // A pool on a database that does not exist: every connect fails.
    let deaf = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(
            db.options
                .clone()
                .database("trellis_outbox_no_such_database"),
        );
    let errors = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen = errors.clone();
    let publisher = RecordingPublisher::new();
    let dispatcher =
        OutboxDispatcher::builder(PgOutboxRepository::new(db.pool.clone()), publisher.clone())
            .idle_interval(Duration::from_secs(3600))
            .listen_postgres(&deaf, &OutboxTables::default())
            .on_error(move |error| {
                if let trellis_outbox::DispatchError::Repository { operation, .. } = error {
                    seen.lock().unwrap().push((*operation).to_owned());
                }
            })
            .start()
            .unwrap();
    // Backoff 100, 200, 400 ms …: three failed attempts well within 10 s.
    for _ in 0..100 {
        if errors.lock().unwrap().len() >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reported = errors.lock().unwrap().clone();
    assert!(
        reported.len() >= 3,
        "failed attempts reported: {reported:?}"
    );
    assert!(
        reported.iter().all(|op| op == "listen for wake-ups"),
        "{reported:?}"
    );

    // The dispatcher itself is unaffected: an in-process notify still dispatches.
    let mut tx = db.pool.begin().await.unwrap();
    let row = tx.enqueue(&record()).await.unwrap();
    tx.commit().await.unwrap();
    dispatcher.notify();
    assert!(publisher.wait_for_attempts(1, Duration::from_secs(5)).await);
    assert_eq!(publisher.successes(), [row.id]);

    tokio::time::timeout(Duration::from_secs(5), dispatcher.shutdown())
        .await
        .expect("shutdown waits for a listener that never connected");
    db.close().await;
}

#[tokio::test]
async fn a_listener_that_loses_its_database_reports_each_failed_reconnect_then_recovers() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let errors = Arc::new(AtomicUsize::new(0));
    let seen = errors.clone();
    let publisher = RecordingPublisher::new();
    let dispatcher =
        OutboxDispatcher::builder(PgOutboxRepository::new(db.pool.clone()), publisher.clone())
            .idle_interval(Duration::from_secs(3600))
            .listen_postgres(&db.pool, &OutboxTables::default())
            .on_error(move |error| {
                if matches!(
                    error,
                    trellis_outbox::DispatchError::Repository {
                        operation: "listen for wake-ups",
                        ..
                    }
                ) {
                    seen.fetch_add(1, Ordering::SeqCst);
                }
            })
            .start()
            .unwrap();
    until_listening(&db, "the dispatcher is not listening").await;
    assert_eq!(errors.load(Ordering::SeqCst), 0);

    // New connections are refused, then the listening one is cut.
    let admin = sqlx::PgPool::connect(&trellis_outbox_tests::database_url())
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE \"{}\" WITH ALLOW_CONNECTIONS false",
        db.name
    )))
    .execute(&admin)
    .await
    .unwrap();
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = $1 AND query LIKE 'LISTEN%'",
    )
    .bind(&db.name)
    .execute(&admin)
    .await
    .unwrap();
    for _ in 0..100 {
        if errors.load(Ordering::SeqCst) >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let failed = errors.load(Ordering::SeqCst);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE \"{}\" WITH ALLOW_CONNECTIONS true",
        db.name
    )))
    .execute(&admin)
    .await
    .unwrap();
    assert!(failed >= 2, "failed reconnects reported: {failed}");

    // It listens again, and a commit nobody announced is dispatched.
    until_listening(&db, "the listener did not come back").await;
    let mut tx = db.pool.begin().await.unwrap();
    let row = tx.enqueue(&record()).await.unwrap();
    tx.commit().await.unwrap();
    assert!(publisher.wait_for_attempts(1, Duration::from_secs(5)).await);
    assert_eq!(publisher.successes(), [row.id]);

    dispatcher.shutdown().await;
    admin.close().await;
    db.close().await;
}

/// The listener's errors (operation `listen for wake-ups`) a dispatcher reports, each with
/// its causes, and the `on_error` that collects them.
fn listen_errors() -> (
    Arc<std::sync::Mutex<Vec<String>>>,
    impl Fn(&trellis_outbox::DispatchError) + Send + Sync + 'static,
) {
    let errors = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen = errors.clone();
    let on_error = move |error: &trellis_outbox::DispatchError| {
        if let trellis_outbox::DispatchError::Repository {
            operation: "listen for wake-ups",
            source,
        } = error
        {
            let mut chain = source.to_string();
            let mut cause = std::error::Error::source(source);
            while let Some(next) = cause {
                chain = format!("{chain}: {next}");
                cause = next.source();
            }
            seen.lock().unwrap().push(chain);
        }
    };
    (errors, on_error)
}

/// A listening connection that dies without a reset (a peer or a network path gone: the
/// relay stalls it, open but silent) is found by the listener's health check, after the
/// dispatcher's idle interval of quiet, reported, and replaced.
#[tokio::test]
async fn a_listener_whose_connection_goes_silent_checks_it_and_connects_again() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let (relay, through) = trellis_outbox_tests::cut::CutRelay::before_postgres(&db.options).await;
    // One connection, and the dispatcher's listener takes none of it: the stalled
    // connection, whose `UNLISTEN` never gets an answer, is not the pool's either.
    let listen_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(through)
        .await
        .unwrap();
    let (errors, on_error) = listen_errors();
    let publisher = RecordingPublisher::new();
    let dispatcher =
        OutboxDispatcher::builder(PgOutboxRepository::new(db.pool.clone()), publisher.clone())
            .idle_interval(Duration::from_secs(1))
            .listen_postgres(&listen_pool, &OutboxTables::default())
            .on_error(on_error)
            .start()
            .unwrap();
    until_listening(&db, "the dispatcher is not listening").await;
    relay.stall();
    // Quiet for 1 s, then a health check that gets no answer within 5 s.
    for _ in 0..150 {
        if !errors.lock().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reported = errors.lock().unwrap().clone();
    assert_eq!(reported.len(), 1, "{reported:?}");
    // The server shows the `LISTEN` once it runs it, maybe before its answer passed the
    // relay: then the stall silences the `LISTEN` itself, not a later health check.
    assert!(
        reported[0].contains("did not answer a health check within")
            || reported[0].contains("did not answer `LISTEN` within"),
        "{reported:?}"
    );
    // The stalled backend still counts as listening on the server; a second one joins it.
    for _ in 0..500 {
        if listeners(&db).await == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        listeners(&db).await,
        2,
        "the listener did not connect again"
    );
    relay.down();
    dispatcher.shutdown().await;
    db.close().await;
}

/// A connection that goes silent just as the listener sends its `LISTEN` (the answer never
/// comes) does not hold the listener there: it reports the unanswered `LISTEN` and connects
/// again.
#[tokio::test]
async fn a_listen_that_gets_no_answer_is_given_up_and_the_listener_connects_again() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let (relay, through) = trellis_outbox_tests::cut::CutRelay::before_postgres(&db.options).await;
    relay.stall_when_a_client_sends(b"LISTEN");
    let listen_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with(through);
    let (errors, on_error) = listen_errors();
    let dispatcher = OutboxDispatcher::builder(
        PgOutboxRepository::new(db.pool.clone()),
        RecordingPublisher::new(),
    )
    .idle_interval(Duration::from_secs(3600))
    .listen_postgres(&listen_pool, &OutboxTables::default())
    .on_error(on_error)
    .start()
    .unwrap();
    // The `LISTEN` was held back: the server never saw it.
    for _ in 0..150 {
        if !errors.lock().unwrap().is_empty() {
            break;
        }
        assert_eq!(listeners(&db).await, 0);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reported = errors.lock().unwrap().clone();
    assert_eq!(reported.len(), 1, "{reported:?}");
    assert!(
        reported[0].contains("did not answer `LISTEN` within 5s"),
        "{reported:?}"
    );
    until_listening(&db, "the listener did not connect again").await;
    relay.down();
    dispatcher.shutdown().await;
    db.close().await;
}

/// `shutdown` does not wait for the listener's connect to a server that never answers (here a
/// socket nobody accepts on: the connection's start-up hangs until the pool's 60 s acquire
/// timeout).
#[tokio::test]
async fn shutdown_does_not_wait_for_a_listener_connecting_to_a_silent_server() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let deaf = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(60))
        .connect_lazy_with(db.options.clone().host("127.0.0.1").port(port));
    let dispatcher = OutboxDispatcher::builder(
        PgOutboxRepository::new(db.pool.clone()),
        RecordingPublisher::new(),
    )
    .idle_interval(Duration::from_secs(3600))
    .listen_postgres(&deaf, &OutboxTables::default())
    .start()
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    tokio::time::timeout(Duration::from_secs(5), dispatcher.shutdown())
        .await
        .expect("shutdown waited for the listener's connect");
    drop(silent);
    db.close().await;
}
