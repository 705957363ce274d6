//! Per-key ordering (issue #15) on real databases: rows of one ordering key reach the stream
//! in commit order, also when transactions commit in another order than they started, with
//! four dispatchers, and across a dispatcher killed mid-batch; a key whose head fails
//! permanently waits (`block`) or moves past it (`skip_dead`) while other keys flow.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use rand::RngExt;
use rand::seq::SliceRandom;
use serde_json::json;
use trellis_outbox::{
    ClaimRequest, DispatchOptions, HeadOfLine, JetStreamPublisher, OutboxDispatcher,
    OutboxRepository, OutboxTransactionExt, PgOutboxRepository, PreparedOutboxRecord, RetryOutcome,
    RetryPolicy, SqliteOutboxRepository, dispatch_outbox, migrate,
};
use trellis_outbox_tests::crash::{TablePublisher, run_child_dispatcher, spawn_child};
use trellis_outbox_tests::nats::{TestStream, jetstream};
use trellis_outbox_tests::publisher::RecordingPublisher;
use trellis_outbox_tests::{TestPg, TestSqlite};

const KEYS: usize = 50;
const PER_KEY: usize = 200;
const WRITERS: usize = 8;

fn keyed(subject: &str, key: &str, n: usize) -> PreparedOutboxRecord {
    PreparedOutboxRecord::event("Orders.Changed", subject, &json!({ "key": key, "n": n }))
        .unwrap()
        .ordered_by(key)
}

/// One writer transaction: its events, in order, each `(key, index of the event)`.
type Tx = Vec<(String, usize)>;

/// The 50 × 200 events cut into transactions of 1–5 events in random order, dealt to the
/// writers.
fn transactions() -> Vec<Vec<Tx>> {
    let mut rng = rand::rng();
    let mut events: Vec<(String, usize)> = (0..KEYS)
        .flat_map(|k| (0..PER_KEY).map(move |i| (format!("k{k}"), i)))
        .collect();
    events.shuffle(&mut rng);
    let mut writers: Vec<Vec<Tx>> = vec![Vec::new(); WRITERS];
    let mut rest = &events[..];
    let mut w = 0;
    while !rest.is_empty() {
        let take = rng.random_range(1..=5).min(rest.len());
        writers[w % WRITERS].push(rest[..take].to_vec());
        rest = &rest[take..];
        w += 1;
    }
    writers
}

/// Runs one writer on Postgres: each transaction enqueues its events, then, for a third of
/// them, waits a little (so that transactions started later commit first), then records its
/// commit position per key and commits.
///
/// The ground truth of commit order is independent of the outbox: per key, a counter row
/// updated just before the commit. Its row lock is held to the commit, so the counter values
/// of one key's transactions are in the order they committed. Counters are locked in key
/// order (no deadlock between writers).
async fn pg_writer(pool: sqlx::PgPool, subject: String, txs: Vec<Tx>) {
    for tx_events in txs {
        let pause = {
            let mut rng = rand::rng();
            rng.random_bool(0.35)
                .then(|| Duration::from_millis(rng.random_range(1..15)))
        };
        let mut tx = pool.begin().await.unwrap();
        let records: Vec<_> = tx_events
            .iter()
            .map(|(key, i)| keyed(&subject, key, *i))
            .collect();
        for record in &records {
            tx.enqueue(record).await.unwrap();
        }
        if let Some(pause) = pause {
            tokio::time::sleep(pause).await;
        }
        let keys: std::collections::BTreeSet<&str> =
            tx_events.iter().map(|(k, _)| k.as_str()).collect();
        for key in keys {
            let n: i64 = sqlx::query_scalar(
                "UPDATE commit_counter SET n = n + 1 WHERE key = $1 RETURNING n",
            )
            .bind(key)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
            for (position, (k, _)) in tx_events.iter().enumerate() {
                if k == key {
                    sqlx::query(
                        "INSERT INTO commit_truth (id, key, n, position) VALUES ($1, $2, $3, $4)",
                    )
                    .bind(&records[position].id)
                    .bind(key)
                    .bind(n)
                    .bind(position as i32)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                }
            }
        }
        tx.commit().await.unwrap();
    }
}

/// Per key, the ids in the order the stream holds them (first occurrence).
fn stream_order(
    messages: &[async_nats::jetstream::message::StreamMessage],
) -> HashMap<String, Vec<String>> {
    let mut seen = HashSet::new();
    let mut order: HashMap<String, Vec<String>> = HashMap::new();
    for message in messages {
        let id = message
            .headers
            .get("Nats-Msg-Id")
            .unwrap()
            .as_str()
            .to_owned();
        let payload: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        let key = payload["key"].as_str().unwrap().to_owned();
        if seen.insert(id.clone()) {
            order.entry(key).or_default().push(id);
        }
    }
    order
}

async fn wait_until_dispatched(pool: &sqlx::PgPool, total: i64, timeout: Duration) {
    let start = Instant::now();
    loop {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM trellis_outbox WHERE state = 'dispatched'")
                .fetch_one(pool)
                .await
                .unwrap();
        if n >= total {
            return;
        }
        assert!(
            start.elapsed() < timeout,
            "{n} of {total} rows dispatched after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_keys_from_eight_writers_reach_the_stream_in_commit_order_on_postgres() {
    let js = jetstream().await;
    let stream = TestStream::events(&js).await;
    let subject = stream.subject("orders");
    let s = stream.clone();
    stream
        .run(async move {
            let db = TestPg::new().await;
            migrate(&db.pool).await.unwrap();
            sqlx::raw_sql(
                "CREATE TABLE commit_counter (key text PRIMARY KEY, n bigint NOT NULL DEFAULT 0); \
                 CREATE TABLE commit_truth (id text PRIMARY KEY, key text NOT NULL, n bigint NOT NULL, position int NOT NULL)",
            )
            .execute(&db.pool)
            .await
            .unwrap();
            for k in 0..KEYS {
                sqlx::query("INSERT INTO commit_counter (key) VALUES ($1)")
                    .bind(format!("k{k}"))
                    .execute(&db.pool)
                    .await
                    .unwrap();
            }
            // The dispatcher runs while the writers write.
            let dispatcher = OutboxDispatcher::builder(
                PgOutboxRepository::new(db.pool.clone()),
                JetStreamPublisher::new(s.context.clone()),
            )
            .batch_size(100)
            .idle_interval(Duration::from_millis(100))
            .start()
            .unwrap();
            let writers: Vec<_> = transactions()
                .into_iter()
                .map(|txs| tokio::spawn(pg_writer(db.pool.clone(), subject.clone(), txs)))
                .collect();
            for writer in writers {
                writer.await.unwrap();
            }
            let total = (KEYS * PER_KEY) as i64;
            wait_until_dispatched(&db.pool, total, Duration::from_secs(300)).await;
            dispatcher.shutdown().await;

            // Commit order per key: by counter value, then position in the transaction.
            let truth: Vec<(String, String, i64, i32)> =
                sqlx::query_as("SELECT id, key, n, position FROM commit_truth")
                    .fetch_all(&db.pool)
                    .await
                    .unwrap();
            assert_eq!(truth.len(), KEYS * PER_KEY);
            let mut expected: HashMap<String, Vec<(i64, i32, String)>> = HashMap::new();
            for (id, key, n, position) in truth {
                expected.entry(key).or_default().push((n, position, id));
            }
            // Transactions did commit in another order than they started: some key's events
            // were inserted (created_at, id: a ULID made at enqueue) in another order.
            let mut reordered = 0;
            for rows in expected.values_mut() {
                rows.sort();
                let ids: Vec<&String> = rows.iter().map(|(_, _, id)| id).collect();
                let mut by_id = ids.clone();
                by_id.sort();
                if ids != by_id {
                    reordered += 1;
                }
            }
            assert!(
                reordered > 0,
                "no key had transactions committing out of their start order; the test proves nothing"
            );

            let order = stream_order(&s.messages().await);
            assert_eq!(order.values().map(Vec::len).sum::<usize>(), KEYS * PER_KEY);
            for (key, rows) in &expected {
                let want: Vec<&String> = rows.iter().map(|(_, _, id)| id).collect();
                let got: Vec<&String> = order[key].iter().collect();
                if want != got {
                    let at = want.iter().zip(&got).position(|(a, b)| a != b).unwrap_or(0);
                    panic!(
                        "key {key}: the stream's order differs from commit order at {at}: \
                         want {:?}, got {:?}",
                        &want[at..(at + 3).min(want.len())],
                        &got[at..(at + 3).min(got.len())]
                    );
                }
            }
            println!("{reordered} of {KEYS} keys had transactions commit out of start order");
            db.close().await;
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_keys_from_eight_writers_reach_the_stream_in_commit_order_on_sqlite() {
    let js = jetstream().await;
    let stream = TestStream::events(&js).await;
    let subject = stream.subject("orders");
    let s = stream.clone();
    stream
        .run(async move {
            let db = TestSqlite::new().await;
            migrate(&db.pool).await.unwrap();
            sqlx::query("CREATE TABLE commit_truth (id TEXT PRIMARY KEY, n INTEGER NOT NULL)")
                .execute(&db.pool)
                .await
                .unwrap();
            let dispatcher = OutboxDispatcher::builder(
                SqliteOutboxRepository::new(db.pool.clone()),
                JetStreamPublisher::new(s.context.clone()),
            )
            .batch_size(100)
            .idle_interval(Duration::from_millis(100))
            .start()
            .unwrap();
            // SQLite has one writer at a time: a transaction's writes and commit are one
            // step against the others. Commit order is the order of a counter taken in the
            // transaction (its write lock is held to the commit).
            let writers: Vec<_> = transactions()
                .into_iter()
                .map(|txs| {
                    let pool = db.pool.clone();
                    let subject = subject.clone();
                    tokio::spawn(async move {
                        for tx_events in txs {
                            let mut tx = pool.begin().await.unwrap();
                            for (key, i) in &tx_events {
                                let record = keyed(&subject, key, *i);
                                tx.enqueue(&record).await.unwrap();
                                sqlx::query(
                                    "INSERT INTO commit_truth (id, n) \
                                     SELECT ?1, COALESCE(MAX(n), 0) + 1 FROM commit_truth",
                                )
                                .bind(&record.id)
                                .execute(&mut *tx)
                                .await
                                .unwrap();
                            }
                            tx.commit().await.unwrap();
                        }
                    })
                })
                .collect();
            for writer in writers {
                writer.await.unwrap();
            }
            let start = Instant::now();
            loop {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM trellis_outbox WHERE state = 'dispatched'",
                )
                .fetch_one(&db.pool)
                .await
                .unwrap();
                if n == (KEYS * PER_KEY) as i64 {
                    break;
                }
                assert!(start.elapsed() < Duration::from_secs(300), "{n} dispatched");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            dispatcher.shutdown().await;
            let truth: HashMap<String, i64> =
                sqlx::query_as::<_, (String, i64)>("SELECT id, n FROM commit_truth")
                    .fetch_all(&db.pool)
                    .await
                    .unwrap()
                    .into_iter()
                    .collect();
            let order = stream_order(&s.messages().await);
            assert_eq!(order.values().map(Vec::len).sum::<usize>(), KEYS * PER_KEY);
            for (key, ids) in &order {
                let ns: Vec<i64> = ids.iter().map(|id| truth[id]).collect();
                assert!(
                    ns.windows(2).all(|w| w[0] < w[1]),
                    "key {key}: the stream's order is not commit order: {ns:?}"
                );
            }
        })
        .await;
}

// ---- head of line ----

/// The order `publisher` first published each id in.
fn published(publisher: &RecordingPublisher) -> Vec<String> {
    let mut seen = HashSet::new();
    publisher
        .successes()
        .into_iter()
        .filter(|id| seen.insert(id.clone()))
        .collect()
}

/// The ids of a claim's messages, in the claim's order.
fn claimed_ids(claim: &trellis_outbox::Claim) -> Vec<String> {
    claim.messages.iter().map(|m| m.id.clone()).collect()
}

/// Drains until a drain does nothing: on Postgres, which overlaps batches, the claim made
/// while a key's head is in flight cannot take the row behind it, so one `dispatch_outbox`
/// may end with rows still due (the dispatcher drains again at once; see `next_due_in`).
async fn drain<R: OutboxRepository>(repo: &R, publisher: &RecordingPublisher) {
    for _ in 0..50 {
        let report = dispatch_outbox(repo, publisher, options()).await.unwrap();
        if report.dispatched + report.failed + report.dead == 0 {
            return;
        }
    }
    panic!("still dispatching after 50 drains");
}

/// Calls `dispatch_outbox` until `publisher` has published `count` rows (within 20 s), so
/// rows waiting for a retry go out.
async fn dispatch_until_published(
    repo: &PgOutboxRepository,
    publisher: &RecordingPublisher,
    options: &DispatchOptions,
    count: usize,
) {
    let start = Instant::now();
    while publisher.successes().len() < count {
        dispatch_outbox(repo, publisher, options.clone())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "only {} of {count} rows published",
            publisher.successes().len()
        );
    }
}

fn options() -> DispatchOptions {
    DispatchOptions::new()
        .batch_size(10)
        .retry_policy(RetryPolicy::new().max_attempts(1))
}

/// Enqueues `a0..a2` and `b0..b2` interleaved (key `a` with `policy`); `a0` fails
/// permanently. Returns the ids by name.
async fn head_of_line_rows<DB: trellis_outbox::OutboxDatabase>(
    pool: &sqlx::Pool<DB>,
    policy: HeadOfLine,
) -> BTreeMap<String, String> {
    let mut ids = BTreeMap::new();
    for i in 0..3 {
        for key in ["a", "b"] {
            let record = PreparedOutboxRecord::event(
                "Orders.Changed",
                "events.v1.Orders.Changed",
                &json!({ "key": key, "n": i }),
            )
            .unwrap()
            .ordered_by(key)
            .with_head_of_line(policy);
            ids.insert(format!("{key}{i}"), record.id.clone());
            let mut tx = pool.begin().await.unwrap();
            tx.enqueue(&record).await.unwrap();
            tx.commit().await.unwrap();
        }
    }
    ids
}

async fn head_of_line<DB, R>(pool: sqlx::Pool<DB>, repo: R)
where
    DB: trellis_outbox::OutboxDatabase,
    R: OutboxRepository,
{
    // block: a dead head holds its key; the other key flows.
    let ids = head_of_line_rows(&pool, HeadOfLine::Block).await;
    let name = |id: &String| ids.iter().find(|(_, v)| *v == id).unwrap().0.clone();
    let publisher = RecordingPublisher::new();
    publisher.fail_permanently(&ids["a0"], "rejected");
    drain(&repo, &publisher).await;
    let names: Vec<String> = published(&publisher).iter().map(name).collect();
    assert_eq!(
        names,
        ["b0", "b1", "b2"],
        "key a waits behind its dead head"
    );
    // Nothing of key a after the head was even attempted.
    assert_eq!(publisher.attempt_count(&ids["a1"]), 0);
    assert_eq!(publisher.attempt_count(&ids["a2"]), 0);
    // Draining again changes nothing: the key stays blocked.
    drain(&repo, &publisher).await;
    assert_eq!(publisher.attempt_count(&ids["a1"]), 0);
    // A blocked key is not due: the dispatcher does not spin on it.
    assert_eq!(repo.next_due_in().await.unwrap(), None);

    // The operator retries the head: the key resumes, in order.
    publisher.heal(&ids["a0"]);
    assert_eq!(repo.retry(&ids["a0"]).await.unwrap(), RetryOutcome::Retried);
    drain(&repo, &publisher).await;
    let names: Vec<String> = published(&publisher).iter().map(name).collect();
    assert_eq!(names, ["b0", "b1", "b2", "a0", "a1", "a2"]);

    // skip_dead: the dead head no longer blocks; the key continues past it, in order.
    let ids = head_of_line_rows(&pool, HeadOfLine::SkipDead).await;
    let name = |id: &String| ids.iter().find(|(_, v)| *v == id).map(|(k, _)| k.clone());
    let publisher = RecordingPublisher::new();
    publisher.fail_permanently(&ids["a0"], "rejected");
    drain(&repo, &publisher).await;
    let names: Vec<String> = published(&publisher).iter().filter_map(name).collect();
    let a: Vec<&String> = names.iter().filter(|n| n.starts_with('a')).collect();
    let b: Vec<&String> = names.iter().filter(|n| n.starts_with('b')).collect();
    assert_eq!(
        a,
        ["a1", "a2"],
        "key a continues past its dead head, in order"
    );
    assert_eq!(b, ["b0", "b1", "b2"]);
}

#[tokio::test]
async fn a_failed_head_blocks_only_its_key_on_postgres() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    head_of_line(db.pool.clone(), PgOutboxRepository::new(db.pool.clone())).await;
    db.close().await;
}

#[tokio::test]
async fn a_failed_head_blocks_only_its_key_on_sqlite() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    head_of_line(
        db.pool.clone(),
        SqliteOutboxRepository::new(db.pool.clone()),
    )
    .await;
}

/// A retryable failure of a head holds its key too: the row behind it is not published
/// until the head is.
#[tokio::test]
async fn a_retrying_head_holds_its_key_on_postgres() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let ids = head_of_line_rows(&db.pool, HeadOfLine::Block).await;
    let repo = PgOutboxRepository::new(db.pool.clone());
    let publisher = RecordingPublisher::new();
    publisher.fail_times(&ids["a0"], 2, "broker busy");
    let options = DispatchOptions::new().batch_size(10).retry_policy(
        RetryPolicy::new()
            .max_attempts(5)
            .initial_delay(Duration::from_millis(50))
            .max_delay(Duration::from_millis(50)),
    );
    dispatch_until_published(&repo, &publisher, &options, 6).await;
    let first = |id: &str| {
        publisher
            .attempts()
            .iter()
            .position(|a| a.id == id)
            .unwrap()
    };
    assert_eq!(publisher.attempt_count(&ids["a0"]), 3);
    assert!(
        first(&ids["a1"]) > first(&ids["a0"]) + 2,
        "a1 waited for a0's retries"
    );
    assert_eq!(
        published(&publisher)
            .iter()
            .filter(|id| **id == ids["a1"] || **id == ids["a2"] || **id == ids["a0"])
            .cloned()
            .collect::<Vec<_>>(),
        [ids["a0"].clone(), ids["a1"].clone(), ids["a2"].clone()]
    );
    db.close().await;
}

/// A Postgres claim takes a run of a key (several of its rows) in one go and publishes it
/// one row at a time, in order; the rows behind a row that fails are released unattempted,
/// not failed, and go out after it.
#[tokio::test]
async fn a_claim_publishes_a_run_of_a_key_one_row_at_a_time_on_postgres() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let ids = head_of_line_rows(&db.pool, HeadOfLine::Block).await;
    let repo = PgOutboxRepository::new(db.pool.clone());
    let publisher = RecordingPublisher::new();
    publisher.fail_times(&ids["a1"], 1, "broker busy");
    let options = DispatchOptions::new()
        .batch_size(10)
        .retry_policy(RetryPolicy::fixed(Duration::from_millis(50)));
    let report = dispatch_outbox(&repo, &publisher, options.clone())
        .await
        .unwrap();
    // One claim held all six rows: both keys' runs went out in this one call (a claim of
    // heads alone would have held a0 and b0 only).
    assert_eq!((report.dispatched, report.failed), (4, 1), "{report:?}");
    let batch = |id: &str| {
        publisher
            .attempts()
            .iter()
            .find(|a| a.id == id)
            .map(|a| a.batch)
            .unwrap()
    };
    assert_eq!(batch(&ids["a0"]), batch(&ids["b0"]));
    assert!(batch(&ids["a0"]) < batch(&ids["a1"]) && batch(&ids["b0"]) < batch(&ids["b1"]));
    assert!(batch(&ids["b1"]) < batch(&ids["b2"]));
    // a2 waited behind the failed a1: never attempted, released (not leased, no attempt).
    assert_eq!(publisher.attempt_count(&ids["a2"]), 0);
    let (state, attempts, leased): (String, i32, bool) = sqlx::query_as(
        "SELECT state, attempts, claimed_until IS NOT NULL OR claim_token IS NOT NULL \
         FROM trellis_outbox WHERE id = $1",
    )
    .bind(&ids["a2"])
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((state.as_str(), attempts, leased), ("pending", 0, false));
    // Once a1 is due again, the key goes on in order.
    dispatch_until_published(&repo, &publisher, &options, 6).await;
    let a: Vec<String> = published(&publisher)
        .into_iter()
        .filter(|id| [&ids["a0"], &ids["a1"], &ids["a2"]].contains(&id))
        .collect();
    assert_eq!(a, [ids["a0"].clone(), ids["a1"].clone(), ids["a2"].clone()]);
    db.close().await;
}

/// A row in the middle of a claimed run that cannot be decoded (another writer stored an
/// unknown kind) goes dead, and the rows of its key behind it are held and released
/// unattempted: with `block` the key then waits behind the dead row; the other key's run
/// goes out in order in the same claim.
#[tokio::test]
async fn a_poisoned_row_in_a_run_holds_the_rows_behind_it_on_postgres() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let ids = head_of_line_rows(&db.pool, HeadOfLine::Block).await;
    sqlx::query("UPDATE trellis_outbox SET kind = 'no-such-kind' WHERE id = $1")
        .bind(&ids["a1"])
        .execute(&db.pool)
        .await
        .unwrap();
    let repo = PgOutboxRepository::new(db.pool.clone());
    let publisher = RecordingPublisher::new();
    let report = dispatch_outbox(&repo, &publisher, options()).await.unwrap();
    assert_eq!((report.dispatched, report.dead), (4, 1), "{report:?}");
    let name = |id: &String| ids.iter().find(|(_, v)| *v == id).unwrap().0.clone();
    let names: Vec<String> = published(&publisher).iter().map(name).collect();
    let b: Vec<&String> = names.iter().filter(|n| n.starts_with('b')).collect();
    assert_eq!(b, ["b0", "b1", "b2"]);
    assert_eq!(names.iter().filter(|n| n.starts_with('a')).count(), 1);
    assert_eq!(publisher.attempt_count(&ids["a2"]), 0);
    let row = |id: String| {
        let pool = db.pool.clone();
        async move {
            let row: (String, i32, bool) = sqlx::query_as(
                "SELECT state, attempts, claimed_until IS NOT NULL OR claim_token IS NOT NULL \
                 FROM trellis_outbox WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
            row
        }
    };
    assert_eq!(row(ids["a1"].clone()).await.0, "dead");
    // a2 was released, not leased and not failed; it waits behind the dead a1.
    assert_eq!(row(ids["a2"].clone()).await, ("pending".into(), 0, false));
    drain(&repo, &publisher).await;
    assert_eq!(publisher.attempt_count(&ids["a2"]), 0);
    db.close().await;
}

/// `ClaimRequest::published`: rows the claimer published and is still marking count as
/// dispatched, so a claim made while their marks run may take the rows behind them; without
/// it the rows behind a leased row wait.
#[tokio::test]
async fn a_claim_takes_the_rows_behind_published_rows_still_being_marked() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let ids = head_of_line_rows(&db.pool, HeadOfLine::Block).await;
    let repo = PgOutboxRepository::new(db.pool.clone());
    let lease = Duration::from_secs(30);
    // Keys are claimed round-robin: a claim of one row takes key a's head, the next one
    // key b's.
    let first = repo.claim(ClaimRequest::new(1, lease)).await.unwrap();
    assert_eq!(claimed_ids(&first), [ids["a0"].clone()]);
    let second = repo.claim(ClaimRequest::new(1, lease)).await.unwrap();
    assert_eq!(claimed_ids(&second), [ids["b0"].clone()]);
    // a0 and b0 are leased: nothing of their keys may be claimed.
    let blocked = repo.claim(ClaimRequest::new(10, lease)).await.unwrap();
    assert!(blocked.is_empty(), "{:?}", claimed_ids(&blocked));
    // a0 was published and is being marked: a1 and a2 may go; b waits behind b0.
    let next = repo
        .claim(ClaimRequest::new(10, lease).published(vec![ids["a0"].clone()]))
        .await
        .unwrap();
    assert_eq!(claimed_ids(&next), [ids["a1"].clone(), ids["a2"].clone()]);
    db.close().await;
}

/// A row in the middle of a key's run that cannot be claimed (another writer left it
/// `failed` and not yet due, or another transaction holds its lock) ends the run there: the
/// Postgres claim takes the rows of the key before it and none after it.
#[tokio::test]
async fn a_row_that_cannot_be_claimed_ends_its_keys_run() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let ids = head_of_line_rows(&db.pool, HeadOfLine::Block).await;
    let repo = PgOutboxRepository::new(db.pool.clone());
    let lease = Duration::from_secs(30);
    let claimed = |claim: &trellis_outbox::Claim| -> Vec<String> {
        let mut ids = claimed_ids(claim);
        ids.sort();
        ids
    };
    let sorted = |names: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = names.iter().map(|n| ids[*n].clone()).collect();
        v.sort();
        v
    };
    // a1 failed and is not due for an hour (as another writer could leave it).
    sqlx::query(
        "UPDATE trellis_outbox SET state = 'failed', next_attempt_at = now() + interval '1 hour' \
         WHERE id = $1",
    )
    .bind(&ids["a1"])
    .execute(&db.pool)
    .await
    .unwrap();
    // Another transaction holds b1's lock while the claim runs.
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM trellis_outbox WHERE id = $1 FOR UPDATE")
        .bind(&ids["b1"])
        .execute(&mut *holder)
        .await
        .unwrap();
    let claim = repo.claim(ClaimRequest::new(10, lease)).await.unwrap();
    assert_eq!(claimed(&claim), sorted(&["a0", "b0"]));
    holder.rollback().await.unwrap();
    // a2 and b2 were not leased: once b1's lock is gone and the claim's rows are published,
    // b goes on; a still waits behind a1.
    let next = repo
        .claim(ClaimRequest::new(10, lease).published(vec![ids["a0"].clone(), ids["b0"].clone()]))
        .await
        .unwrap();
    assert_eq!(claimed(&next), sorted(&["b1", "b2"]));
    db.close().await;
}

/// The empty ordering key, which enqueue refuses but another writer can store, is walked
/// too, also by a claim with no cursor yet (a fresh repository).
#[tokio::test]
async fn rows_of_the_empty_ordering_key_are_claimed() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let record = keyed("events.v1.A.B", "k", 0);
    let id = record.id.clone();
    tx.enqueue(&record).await.unwrap();
    tx.commit().await.unwrap();
    sqlx::query("UPDATE trellis_outbox SET ordering_key = '' WHERE id = $1")
        .bind(&id)
        .execute(&db.pool)
        .await
        .unwrap();
    let repo = PgOutboxRepository::new(db.pool.clone());
    let claim = repo
        .claim(ClaimRequest::new(10, Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(claimed_ids(&claim), [id]);
    db.close().await;
}

// ---- four dispatchers ----

/// Enqueues `record` in a transaction of its own; its id.
async fn committed(pool: &sqlx::PgPool, record: PreparedOutboxRecord) -> String {
    let mut tx = pool.begin().await.unwrap();
    tx.enqueue(&record).await.unwrap();
    tx.commit().await.unwrap();
    record.id
}

/// The Postgres claim: unkeyed rows oldest first; keyed rows key by key, round-robin (each
/// claim goes on after the last key the previous one reached, wrapping around), each key's
/// run in sequence order; keyed rows written after a claim that saw none are found.
#[tokio::test]
async fn the_postgres_claim_serves_keys_round_robin() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let enqueue = |record: PreparedOutboxRecord| committed(&db.pool, record);
    let unkeyed = |n: usize| {
        PreparedOutboxRecord::event(
            "Orders.Changed",
            "events.v1.Orders.Changed",
            &json!({ "n": n }),
        )
        .unwrap()
    };
    let repo = PgOutboxRepository::new(db.pool.clone());
    let lease = Duration::from_secs(30);
    let claim = |limit: usize| {
        let repo = &repo;
        async move { claimed_ids(&repo.claim(ClaimRequest::new(limit, lease)).await.unwrap()) }
    };
    let mut first = Vec::new();
    for n in 0..3 {
        first.push(enqueue(unkeyed(n)).await);
    }
    assert_eq!(claim(10).await, first);
    // Keyed rows, then one more unkeyed row: five keys of two rows each.
    let mut runs = BTreeMap::new();
    for n in 0..2 {
        for key in ["k0", "k1", "k2", "k3", "k4"] {
            let id = enqueue(keyed("events.v1.Orders.Changed", key, n)).await;
            runs.entry(key).or_insert_with(Vec::new).push(id);
        }
    }
    let late = enqueue(unkeyed(3)).await;
    // The last claim saw no keyed rows, so this one claims unkeyed rows only (without the
    // key walk) and learns that keyed rows wait.
    assert_eq!(claim(2).await, [late]);
    // Each claim of two takes one key's run, key after key.
    for (key, run) in &runs {
        assert_eq!(&claim(2).await, run, "{key}");
    }
    // Every key is leased: the walk wraps around and finds none free.
    assert!(claim(2).await.is_empty());
    // The leases end (rows released): the walk goes on after k4, wrapping to k0.
    sqlx::query("UPDATE trellis_outbox SET claimed_until = NULL, claim_token = NULL WHERE ordering_key IS NOT NULL")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(claim(2).await, runs["k0"]);
    assert_eq!(claim(2).await, runs["k1"]);
    // A claim takes at most 16 rows of one key (its batch of 100 would hold 20), so that
    // it spans many keys and publishes in few rounds.
    let mut long = Vec::new();
    for n in 0..20 {
        long.push(enqueue(keyed("events.v1.Orders.Changed", "long", n)).await);
    }
    sqlx::query("UPDATE trellis_outbox SET claimed_until = now() + interval '1 hour', claim_token = 'held' WHERE ordering_key <> 'long'")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(claim(100).await, long[..16]);
    db.close().await;
}

/// A Postgres claim of unkeyed rows that finds none answers whether keyed rows wait, in the
/// same statement: none, and the claim is empty; some, and it claims them (no claim before
/// saw them).
#[tokio::test]
async fn a_postgres_claim_that_finds_no_unkeyed_rows_finds_keyed_ones() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let enqueue = |record: PreparedOutboxRecord| committed(&db.pool, record);
    let repo = PgOutboxRepository::new(db.pool.clone());
    let claim = || {
        let repo = &repo;
        async move {
            claimed_ids(
                &repo
                    .claim(ClaimRequest::new(10, Duration::from_secs(30)))
                    .await
                    .unwrap(),
            )
        }
    };
    let unkeyed = PreparedOutboxRecord::event(
        "Orders.Changed",
        "events.v1.Orders.Changed",
        &json!({ "n": 0 }),
    )
    .unwrap();
    let first = enqueue(unkeyed).await;
    assert_eq!(claim().await, [first]);
    assert!(claim().await.is_empty());
    let mut keyed_ids = Vec::new();
    for n in 0..3 {
        keyed_ids.push(enqueue(keyed("events.v1.Orders.Changed", "k", n)).await);
    }
    assert_eq!(claim().await, keyed_ids);
    assert!(claim().await.is_empty(), "the key's rows are leased");
    db.close().await;
}

/// Loads 50 keys × `per_key` rows, keys interleaved at random, in transactions of 100.
async fn load_keyed(pool: &sqlx::PgPool, per_key: usize) -> HashMap<String, Vec<String>> {
    let mut events: Vec<(String, usize)> = (0..KEYS)
        .flat_map(|k| (0..per_key).map(move |i| (format!("k{k}"), i)))
        .collect();
    // Shuffle, then restore each key's own order: keys interleave at random.
    events.shuffle(&mut rand::rng());
    let mut next: HashMap<String, usize> = HashMap::new();
    for (key, i) in &mut events {
        let n = next.entry(key.clone()).or_default();
        *i = *n;
        *n += 1;
    }
    let mut order: HashMap<String, Vec<String>> = HashMap::new();
    for chunk in events.chunks(100) {
        let records: Vec<_> = chunk
            .iter()
            .map(|(key, i)| keyed("events.v1.Orders.Changed", key, *i))
            .collect();
        for (record, (key, _)) in records.iter().zip(chunk) {
            order
                .entry(key.clone())
                .or_default()
                .push(record.id.clone());
        }
        let mut tx = pool.begin().await.unwrap();
        tx.enqueue_all(records).await.unwrap();
        tx.commit().await.unwrap();
    }
    order
}

/// Per key, whether `published` (first publications, in order) holds its ids in `want`'s
/// order.
fn assert_in_key_order(want: &HashMap<String, Vec<String>>, published: &[String]) {
    let position: HashMap<&str, usize> = published
        .iter()
        .enumerate()
        .map(|(i, id)| (id.as_str(), i))
        .collect();
    for (key, ids) in want {
        let at: Vec<usize> = ids.iter().map(|id| position[id.as_str()]).collect();
        assert!(
            at.windows(2).all(|w| w[0] < w[1]),
            "key {key} published out of order: positions {:?}",
            &at[..at.len().min(10)]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_dispatchers_keep_every_key_in_order() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let want = load_keyed(&db.pool, 100).await;
    let publisher = RecordingPublisher::new();
    // Slow, uneven batches: dispatchers overtake each other.
    publisher.delay_every_batch(Duration::from_millis(3));
    let dispatchers: Vec<_> = (0..4)
        .map(|i| {
            OutboxDispatcher::builder(PgOutboxRepository::new(db.pool.clone()), publisher.clone())
                .batch_size(10 + 7 * i)
                .start()
                .unwrap()
        })
        .collect();
    wait_until_dispatched(&db.pool, (KEYS * 100) as i64, Duration::from_secs(180)).await;
    for dispatcher in dispatchers {
        dispatcher.shutdown().await;
    }
    let published = published(&publisher);
    assert_eq!(published.len(), KEYS * 100);
    assert_in_key_order(&want, &published);
    db.close().await;
}

// ---- crash: a dispatcher process killed mid-batch ----

const CHILD_ENV: &str = "TRELLIS_OUTBOX_ORDERING_CHILD_DB";

/// Not a test: the body of the child process the crash test starts and kills.
#[tokio::test]
#[ignore = "entry point of the ordering crash test's child process"]
async fn ordering_crash_child_process() {
    // A slow broker on both sides of the write: a kill often finds a batch claimed but not
    // yet published, whose keys' later rows must then wait for its lease to end.
    run_child_dispatcher(CHILD_ENV, 25, Duration::from_millis(15)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_holds_across_a_killed_dispatcher() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::query("CREATE TABLE published (seq bigserial PRIMARY KEY, id text NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let want = load_keyed(&db.pool, 40).await;
    let total = (KEYS * 40) as i64;

    let mut child = spawn_child("ordering_crash_child_process", CHILD_ENV, &db.name);
    wait_until_dispatched(&db.pool, total / 4, Duration::from_secs(60)).await;
    // SIGKILL, our own child by pid.
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success(), "the child was killed: {status:?}");
    let dispatched: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trellis_outbox WHERE state = 'dispatched'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(dispatched < total, "the child must not have finished");
    let leased: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM trellis_outbox WHERE state <> 'dispatched' AND claimed_until > now()",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    println!("killed with {dispatched} dispatched, {leased} leased");

    let survivor = OutboxDispatcher::builder(
        PgOutboxRepository::new(db.pool.clone()),
        TablePublisher {
            pool: db.pool.clone(),
            pause: Duration::ZERO,
        },
    )
    .batch_size(30)
    .idle_interval(Duration::from_millis(200))
    .start()
    .unwrap();
    wait_until_dispatched(&db.pool, total, Duration::from_secs(120)).await;
    survivor.shutdown().await;

    // What a consumer sees after JetStream's de-duplication: first publications in order.
    let rows: Vec<String> = sqlx::query_scalar("SELECT id FROM published ORDER BY seq")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let mut seen = HashSet::new();
    let first: Vec<String> = rows
        .into_iter()
        .filter(|id| seen.insert(id.clone()))
        .collect();
    assert_eq!(first.len(), total as usize);
    assert_in_key_order(&want, &first);
    db.close().await;
}

// ---- Postgres: the commit-order mechanism itself ----

/// Two transactions of one key: the one that started (and inserted) first commits last;
/// its row gets the higher number and is published second.
#[tokio::test]
async fn a_later_commit_gets_the_later_number_on_postgres() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let first = keyed("events.v1.Orders.Changed", "o-1", 0);
    let second = keyed("events.v1.Orders.Changed", "o-1", 1);
    let mut early = db.pool.begin().await.unwrap();
    early.enqueue(&first).await.unwrap();
    let mut late = db.pool.begin().await.unwrap();
    late.enqueue(&second).await.unwrap();
    late.commit().await.unwrap();
    early.commit().await.unwrap();
    let seqs: HashMap<String, i64> =
        sqlx::query_as::<_, (String, i64)>("SELECT id, ordering_seq FROM trellis_outbox")
            .fetch_all(&db.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert!(seqs[&second.id] < seqs[&first.id], "{seqs:?}");

    let publisher = RecordingPublisher::new();
    let repo = PgOutboxRepository::new(db.pool.clone());
    drain(&repo, &publisher).await;
    assert_eq!(published(&publisher), [second.id.clone(), first.id.clone()]);

    // Two transactions with the same two keys in opposite order commit without deadlock.
    let mut t1 = db.pool.begin().await.unwrap();
    let mut t2 = db.pool.begin().await.unwrap();
    t1.enqueue(&keyed("events.v1.X", "x", 0)).await.unwrap();
    t1.enqueue(&keyed("events.v1.X", "y", 0)).await.unwrap();
    t2.enqueue(&keyed("events.v1.X", "y", 1)).await.unwrap();
    t2.enqueue(&keyed("events.v1.X", "x", 1)).await.unwrap();
    let (a, b) = tokio::join!(t1.commit(), t2.commit());
    a.unwrap();
    b.unwrap();
    // Unkeyed rows get no number.
    let unordered: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM trellis_outbox WHERE ordering_key IS NULL AND ordering_seq IS NOT NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(unordered, 0);
    db.close().await;
}

// ---- the memory repository honours the same rule ----

#[tokio::test]
async fn the_memory_repository_keeps_keys_in_order_with_both_policies() {
    for policy in [HeadOfLine::Block, HeadOfLine::SkipDead] {
        let repo = trellis_outbox::MemoryOutboxRepository::new();
        let mut ids = BTreeMap::new();
        for i in 0..3 {
            for key in ["a", "b"] {
                let record = keyed("events.v1.Orders.Changed", key, i).with_head_of_line(policy);
                ids.insert(format!("{key}{i}"), record.id.clone());
                repo.enqueue(&record).unwrap();
            }
        }
        let name = |id: &String| ids.iter().find(|(_, v)| *v == id).unwrap().0.clone();
        let publisher = RecordingPublisher::new();
        publisher.fail_permanently(&ids["a0"], "rejected");
        drain(&repo, &publisher).await;
        let names: Vec<String> = published(&publisher).iter().map(name).collect();
        match policy {
            HeadOfLine::Block => {
                assert_eq!(names, ["b0", "b1", "b2"]);
                // A blocked key is not due: the dispatcher does not spin on it.
                assert_eq!(repo.next_due_in().await.unwrap(), None);
                publisher.heal(&ids["a0"]);
                assert_eq!(repo.retry(&ids["a0"]).await.unwrap(), RetryOutcome::Retried);
                drain(&repo, &publisher).await;
                let names: Vec<String> = published(&publisher).iter().map(name).collect();
                assert_eq!(names, ["b0", "b1", "b2", "a0", "a1", "a2"]);
            }
            _ => {
                let a: Vec<&String> = names.iter().filter(|n| n.starts_with('a')).collect();
                assert_eq!(a, ["a1", "a2"]);
            }
        }
    }
}

// ---- the derive ----

#[derive(serde::Serialize, trellis_outbox::OutboxEvent)]
#[outbox(
    name = "Orders.Changed",
    subject = "events.v1.Orders.Changed.{order_id}",
    ordering = "skip_dead"
)]
struct OrderChanged {
    #[outbox(ordering_key)]
    order_id: u64,
}

#[derive(serde::Serialize, trellis_outbox::OutboxEvent)]
#[outbox(name = "Orders.Noted", subject = "events.v1.Orders.Noted")]
struct OrderNoted {
    #[outbox(ordering_key)]
    order_id: String,
}

#[derive(serde::Serialize, trellis_outbox::OutboxEvent)]
#[outbox(name = "Orders.Seen", subject = "events.v1.Orders.Seen")]
struct OrderSeen {
    order_id: String,
}

#[test]
fn the_derive_sets_the_ordering_key_and_policy() {
    use trellis_outbox::{OrderingKey, ToOutboxRecord};
    let record = OrderChanged { order_id: 42 }.to_outbox_record().unwrap();
    assert_eq!(
        record.ordering,
        Some(OrderingKey::new("42").with_head_of_line(HeadOfLine::SkipDead))
    );
    let record = OrderNoted {
        order_id: "o-1".into(),
    }
    .to_outbox_record()
    .unwrap();
    assert_eq!(record.ordering, Some(OrderingKey::new("o-1")));
    let record = OrderSeen {
        order_id: "o-1".into(),
    }
    .to_outbox_record()
    .unwrap();
    assert_eq!(record.ordering, None);
}

// ---- the operator's view: blocked keys ----

#[tokio::test]
async fn status_lists_keys_blocked_by_a_dead_head() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    let ids = head_of_line_rows(&db.pool, HeadOfLine::Block).await;
    let repo = SqliteOutboxRepository::new(db.pool.clone());
    let publisher = RecordingPublisher::new();
    publisher.fail_permanently(&ids["a0"], "rejected");
    drain(&repo, &publisher).await;
    let status = repo.status().await.unwrap();
    assert_eq!(status.blocked_keys.len(), 1, "{status:?}");
    let blocked = &status.blocked_keys[0];
    assert_eq!(
        (
            blocked.key.as_str(),
            blocked.head_id.as_str(),
            blocked.waiting
        ),
        ("a", ids["a0"].as_str(), 2)
    );
    // The CLI prints it.
    let url = format!("sqlite://{}", db.path.display());
    let out = tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        trellis_outbox::cli::run(
            ["trellis-outbox", "--database-url", &url, "status"],
            &mut out,
        )
        .map_err(|e| e.to_string())?;
        String::from_utf8(out).map_err(|e| e.to_string())
    })
    .await
    .unwrap()
    .unwrap();
    assert!(
        out.contains(&format!(
            "blocked    key a behind dead {} (2 waiting)",
            ids["a0"]
        )),
        "{out}"
    );
    // The same on Postgres.
    let pg = TestPg::new().await;
    migrate(&pg.pool).await.unwrap();
    let pg_ids = head_of_line_rows(&pg.pool, HeadOfLine::Block).await;
    let pg_repo = PgOutboxRepository::new(pg.pool.clone());
    publisher.fail_permanently(&pg_ids["a0"], "rejected");
    drain(&pg_repo, &publisher).await;
    let blocked = pg_repo.blocked_keys(10).await.unwrap();
    assert_eq!(blocked.len(), 1, "{blocked:?}");
    assert_eq!(
        (
            blocked[0].key.as_str(),
            blocked[0].head_id.as_str(),
            blocked[0].waiting
        ),
        ("a", pg_ids["a0"].as_str(), 2)
    );
    pg.close().await;

    // A dead head under skip_dead blocks nothing.
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    let ids = head_of_line_rows(&db.pool, HeadOfLine::SkipDead).await;
    let repo = SqliteOutboxRepository::new(db.pool.clone());
    publisher.fail_permanently(&ids["a0"], "rejected");
    drain(&repo, &publisher).await;
    assert!(repo.status().await.unwrap().blocked_keys.is_empty());
}

// ---- the NATS KV outbox refuses keyed records ----

#[tokio::test]
async fn the_kv_outbox_refuses_keyed_records() {
    let js = jetstream().await;
    let name = format!(
        "trellis_t_{}",
        ulid::Ulid::generate().to_string().to_lowercase()
    );
    let outbox = trellis_outbox::NatsKvOutboxRepository::open(&js, &name)
        .await
        .unwrap();
    let keyed_record = keyed("events.v1.Orders.Changed", "o-1", 0);
    let refused = outbox.enqueue(&keyed_record).await;
    let plain = outbox
        .enqueue(
            &PreparedOutboxRecord::event("Orders.Changed", "events.v1.Orders.Changed", &1).unwrap(),
        )
        .await;
    let stored = outbox.get(&keyed_record.id).await;
    let _ = js.delete_key_value(&name).await;
    let err = refused.unwrap_err();
    assert!(
        matches!(
            &err,
            trellis_outbox::Error::InvalidRecord {
                field: "ordering key",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("not supported by the NATS KV outbox"),
        "{err}"
    );
    assert!(plain.is_ok());
    assert_eq!(stored.unwrap(), None, "nothing was written");
}

/// One transaction with more distinct keys than Postgres' shared lock table holds (6,400
/// entries on a stock server): version 5's trigger took one advisory lock per key and held
/// them all to the commit, which then failed with "out of shared memory" and took the
/// business transaction with it. Version 7 locks at most 1,024 buckets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_transaction_with_twenty_thousand_keys_commits() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let records: Vec<_> = (0..20_000)
        .map(|n| keyed("orders.placed", &format!("order-{n}"), n))
        .collect();
    let mut tx = db.pool.begin().await.unwrap();
    tx.enqueue_all(records).await.unwrap();
    tx.commit()
        .await
        .expect("the commit takes one advisory lock per bucket, not per key");
    let (rows, numbered): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(ordering_seq) FROM trellis_outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((rows, numbered), (20_000, 20_000));
    db.close().await;
}
