//! The metrics the dispatcher records (issue #14), read back with `metrics-util`'s debugging
//! recorder by name, label and value.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::collections::HashMap;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use serde_json::json;
use trellis_outbox::metrics as m;
use trellis_outbox::{
    DispatchOptions, MemoryOutboxRepository, PreparedOutboxRecord, dispatch_outbox,
};
use trellis_outbox_tests::publisher::RecordingPublisher;

/// Held by the tests that read the global recorder: a snapshot resets what it read, so two
/// of them reading at once would take each other's values.
static GLOBAL_READERS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The process-wide recorder, for code that runs on tokio's workers (the dispatcher and
/// consumer tasks); tests of synchronous paths use local recorders, which take precedence.
fn global() -> &'static Snapshotter {
    static SNAPSHOTTER: std::sync::OnceLock<Snapshotter> = std::sync::OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::set_global_recorder(recorder).unwrap();
        snapshotter
    })
}

/// Counters by `(name, labels)`.
type Counters = HashMap<(String, Vec<(String, String)>), u64>;

/// Every counter as `(name, labels) → value`, and every histogram as `name → samples`.
fn read(snapshotter: &Snapshotter) -> (Counters, HashMap<String, usize>) {
    let mut counters = HashMap::new();
    let mut histograms = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let labels: Vec<(String, String)> = key
            .labels()
            .map(|l| (l.key().to_owned(), l.value().to_owned()))
            .collect();
        match value {
            DebugValue::Counter(n) => {
                counters.insert((key.name().to_owned(), labels), n);
            }
            DebugValue::Histogram(samples) => {
                histograms.insert(key.name().to_owned(), samples.len());
            }
            DebugValue::Gauge(_) => {}
        }
    }
    (counters, histograms)
}

/// Runs `body` to completion on a current-thread runtime with a debugging recorder local to
/// this thread (no other test's metrics reach it); that recorder's snapshotter.
fn recorded(body: impl std::future::Future<Output = ()>) -> Snapshotter {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(body)
    });
    snapshotter
}

fn event(name: &str) -> PreparedOutboxRecord {
    PreparedOutboxRecord::event(name, format!("events.v1.{name}"), &json!({})).unwrap()
}

#[test]
fn a_drain_counts_rows_by_name_and_times_each_stage() {
    let snapshotter = recorded(async {
        let repo = MemoryOutboxRepository::new();
        let ok = [
            repo.enqueue(&event("Orders.Placed")).unwrap(),
            repo.enqueue(&event("Orders.Placed")).unwrap(),
        ];
        let flaky = repo.enqueue(&event("Orders.Shipped")).unwrap();
        let broken = repo.enqueue(&event("Orders.Billed")).unwrap();
        repo.enqueue_undecodable(&event("Orders.Lost"), "bad headers")
            .unwrap();
        let publisher = RecordingPublisher::new();
        publisher.fail_always(&flaky.id, "timeout");
        publisher.fail_permanently(&broken.id, "too large");
        let report = dispatch_outbox(&repo, &publisher, DispatchOptions::new())
            .await
            .unwrap();
        assert_eq!((report.dispatched, report.failed, report.dead), (2, 1, 2));
        let _ = ok;
    });
    let (counters, histograms) = read(&snapshotter);
    let by_name = |metric: &str, name: &str| {
        counters
            .get(&(
                metric.to_owned(),
                vec![("name".to_owned(), name.to_owned())],
            ))
            .copied()
    };
    assert_eq!(by_name(m::DISPATCHED, "Orders.Placed"), Some(2));
    assert_eq!(by_name(m::FAILED, "Orders.Shipped"), Some(1));
    assert_eq!(by_name(m::DEAD, "Orders.Billed"), Some(1));
    assert_eq!(by_name(m::DEAD, m::POISON_NAME), Some(1));
    assert_eq!(by_name(m::DISPATCHED, "Orders.Shipped"), None);
    // Two claims (the batch, then the empty one that ends the wave); one publish, one mark.
    assert_eq!(histograms.get(m::CLAIM_SECONDS), Some(&2));
    assert_eq!(histograms.get(m::CLAIMED_ROWS), Some(&2));
    assert_eq!(histograms.get(m::PUBLISH_SECONDS), Some(&1));
    assert_eq!(histograms.get(m::MARK_SECONDS), Some(&1));
}

/// Rows handed over at commit are counted per batch and by name when marked.
#[test]
fn handed_over_rows_are_counted_per_batch() {
    let snapshotter = recorded(async {
        let db = trellis_outbox_tests::TestSqlite::new().await;
        trellis_outbox::migrate(&db.pool).await.unwrap();
        let publisher = RecordingPublisher::new();
        let dispatcher = trellis_outbox::OutboxDispatcher::builder(
            trellis_outbox::SqliteOutboxRepository::new(db.pool.clone()),
            publisher.clone(),
        )
        .start()
        .unwrap();
        let mut tx = dispatcher.handle().begin(&db.pool).await.unwrap();
        for _ in 0..3 {
            tx.enqueue(&event("Orders.Placed")).await.unwrap();
        }
        tx.commit().await.unwrap();
        for _ in 0..1_000 {
            if publisher.successes().len() == 3 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        // Shutdown lets the gathered mark finish.
        dispatcher.shutdown().await;
    });
    let (counters, histograms) = read(&snapshotter);
    assert_eq!(histograms.get(m::HANDED_OVER_ROWS), Some(&1));
    assert_eq!(
        counters.get(&(
            m::DISPATCHED.to_owned(),
            vec![("name".to_owned(), "Orders.Placed".to_owned())]
        )),
        Some(&3)
    );
}

#[test]
fn inbox_duplicates_are_counted_by_inbox_table() {
    let snapshotter = recorded(async {
        use trellis_outbox::OutboxTransactionExt as _;
        let db = trellis_outbox_tests::TestSqlite::new().await;
        trellis_outbox::migrate(&db.pool).await.unwrap();
        for _ in 0..3 {
            let mut tx = db.pool.begin().await.unwrap();
            tx.record_inbox("evt-1").await.unwrap();
            tx.commit().await.unwrap();
        }
    });
    let (counters, _) = read(&snapshotter);
    assert_eq!(
        counters.get(&(
            m::INBOX_DUPLICATES.to_owned(),
            vec![("inbox".to_owned(), "trellis_inbox".to_owned())]
        )),
        Some(&2),
        "{counters:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_outcomes_are_counted_by_consumer() {
    use async_nats::jetstream::consumer::AckPolicy;
    use async_nats::jetstream::consumer::pull::Config as PullConfig;
    use sqlx::{Sqlite, Transaction};
    use trellis_outbox::{Consumer, DEAD_LETTER_STREAM, Delivered, handler_fn};

    #[derive(serde::Deserialize)]
    struct Placed {
        #[allow(dead_code)]
        n: u64,
    }

    let _serial = GLOBAL_READERS.lock().await;
    let snapshotter = global();

    let db = trellis_outbox_tests::TestSqlite::new().await;
    trellis_outbox::migrate(&db.pool).await.unwrap();
    let js = trellis_outbox_tests::nats::jetstream().await;
    let stream = trellis_outbox_tests::nats::TestStream::events(&js).await;
    let name = format!("m{}", ulid::Ulid::generate().to_string().to_lowercase());
    js.get_stream(&stream.name)
        .await
        .unwrap()
        .create_consumer(PullConfig {
            durable_name: Some(name.clone()),
            ack_policy: AckPolicy::Explicit,
            ..PullConfig::default()
        })
        .await
        .unwrap();
    for (id, payload) in [("ok-1", &b"{\"n\":1}"[..]), ("bad-1", &b"nope"[..])] {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", id);
        js.publish_with_headers(stream.subject("placed"), headers, payload.to_vec().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let consumer = Consumer::builder(
        js.clone(),
        db.pool.clone(),
        handler_fn(
            |_: &mut Transaction<'static, Sqlite>, _: Delivered<Placed>| Box::pin(async { Ok(()) }),
        ),
    )
    .bind(&stream.name, &name)
    .start()
    .await
    .unwrap();
    for _ in 0..100 {
        let report = consumer.report();
        if report.applied + report.dead_lettered == 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    consumer.shutdown().await.unwrap();
    if let Ok(dlq) = js.get_stream(DEAD_LETTER_STREAM).await {
        let _ = dlq
            .purge()
            .filter(format!("_trellis.consumer.dlq.{name}"))
            .await;
    }
    stream.delete().await;

    let mut consumed = HashMap::new();
    let mut handled = 0;
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let label = |l: &str| {
            key.labels()
                .find(|x| x.key() == l)
                .map(|x| x.value().to_owned())
        };
        if label("consumer").as_deref() != Some(name.as_str()) {
            continue;
        }
        match (key.name(), value) {
            (n, DebugValue::Counter(v)) if n == m::CONSUMED => {
                consumed.insert(label("outcome").unwrap(), v);
            }
            (n, DebugValue::Histogram(samples)) if n == m::HANDLE_SECONDS => {
                handled += samples.len()
            }
            _ => {}
        }
    }
    assert_eq!(
        consumed,
        HashMap::from([("applied".to_owned(), 1), ("dead_lettered".to_owned(), 1)])
    );
    assert_eq!(handled, 1, "only the decodable message reached the handler");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dispatcher_reports_the_backlog_as_gauges() {
    use std::sync::Arc;
    use std::time::Duration;
    use trellis_outbox::{OutboxDispatcher, RetryPolicy};

    let _serial = GLOBAL_READERS.lock().await;
    let snapshotter = global();
    let repo = Arc::new(MemoryOutboxRepository::new());
    let publisher = Arc::new(RecordingPublisher::new());
    for n in 0..3 {
        let row = repo.enqueue(&event(&format!("Orders.N{n}"))).unwrap();
        publisher.fail_always(&row.id, "broker down");
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .retry_policy(RetryPolicy::fixed(Duration::from_secs(60)))
        .backlog_metrics(Some(Duration::from_millis(100)))
        .start()
        .unwrap();
    // One snapshot per look: taking a snapshot resets what it read.
    let gauges = || {
        let snapshot = snapshotter.snapshot().into_vec();
        let gauge = |name: &str| {
            snapshot.iter().find_map(|(key, _, _, value)| match value {
                DebugValue::Gauge(v) if key.key().name() == name => Some(v.into_inner()),
                _ => None,
            })
        };
        (gauge(m::UNDISPATCHED), gauge(m::LAG_SECONDS))
    };
    let mut seen = None;
    for _ in 0..100 {
        if let (Some(depth), Some(lag)) = gauges()
            && depth == 3.0
        {
            seen = Some(lag);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    dispatcher.shutdown().await;
    let lag = seen.expect("the gauges reported 3 undispatched rows");
    assert!(lag >= 0.03, "the oldest row waited at least 30 ms: {lag}");
}

#[tokio::test]
async fn sql_repositories_count_the_backlog() {
    use trellis_outbox::{
        OutboxRepository, OutboxTransactionExt, PgOutboxRepository, SqliteOutboxRepository,
    };
    let sqlite = trellis_outbox_tests::TestSqlite::new().await;
    trellis_outbox::migrate(&sqlite.pool).await.unwrap();
    let pg = trellis_outbox_tests::TestPg::new().await;
    trellis_outbox::migrate(&pg.pool).await.unwrap();
    let lite = SqliteOutboxRepository::new(sqlite.pool.clone());
    let post = PgOutboxRepository::new(pg.pool.clone());
    assert_eq!(lite.backlog().await.unwrap().unwrap().undispatched, 0);
    assert_eq!(post.backlog().await.unwrap().unwrap().oldest, None);
    let mut tx = sqlite.pool.begin().await.unwrap();
    tx.enqueue_all([event("A"), event("B")]).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = pg.pool.begin().await.unwrap();
    tx.enqueue_all([event("A"), event("B")]).await.unwrap();
    tx.commit().await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    for backlog in [
        lite.backlog().await.unwrap().unwrap(),
        post.backlog().await.unwrap().unwrap(),
    ] {
        assert_eq!(backlog.undispatched, 2);
        assert!(
            backlog.oldest.unwrap() >= std::time::Duration::from_millis(20),
            "{backlog:?}"
        );
    }
    pg.close().await;
}
