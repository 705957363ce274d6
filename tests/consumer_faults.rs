//! `Consumer` killed with SIGKILL in the middle of its work: a child process (this test
//! binary re-executed) consumes with handlers blocked inside open transactions and with
//! committed messages whose acks never reached the server; the parent kills it, a fresh
//! consumer on the same durable takes over, and every business effect, inbox row and
//! follow-up event must exist exactly once.
//!
//! The child reaches NATS through a small TCP relay of its own that it can freeze (stop
//! forwarding what the client sends): after the freeze, handlers still commit, but their acks
//! are lost. That makes "committed, not acknowledged" certain rather than a matter of timing.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::io::{BufRead, BufReader, Write};
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::AckPolicy;
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::stream::Config;
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Postgres, Transaction};
use trellis_outbox::{
    Consumer, Delivered, OutboxTransactionExt, PreparedOutboxRecord, handler_fn, migrate,
};
use trellis_outbox_tests::nats::{TestStream, connect_reconnecting};
use trellis_outbox_tests::nats_server::NatsServer;
use trellis_outbox_tests::relay::Relay;
use trellis_outbox_tests::{TestPg, database_url};

/// Events published.
const EVENTS: u64 = 500;
/// The child's concurrency (and the survivor's).
const CONCURRENCY: usize = 8;
/// The handler calls (1-based, in the order they start) that block with their transaction
/// open until the child is killed.
const BLOCK_FROM: usize = 150;
const BLOCKERS: usize = 3;
/// The handler call that freezes the relay to NATS: it and the calls still in flight commit,
/// but their acks are lost.
const FREEZE_AT: usize = 250;
/// How long the child waits, once the freezing message's commit is visible, before it says
/// "kill me now" (the other messages in hand commit meanwhile).
const SETTLE_AFTER_FREEZE: Duration = Duration::from_millis(200);
/// The durable consumer's ack wait: what the dead child held comes back after it.
const ACK_WAIT: Duration = Duration::from_secs(1);

const CHILD_DB: &str = "TRELLIS_OUTBOX_CONSUMER_CHILD_DB";
const CHILD_NATS: &str = "TRELLIS_OUTBOX_CONSUMER_CHILD_NATS";
const CHILD_STREAM: &str = "TRELLIS_OUTBOX_CONSUMER_CHILD_STREAM";
const CHILD_DURABLE: &str = "TRELLIS_OUTBOX_CONSUMER_CHILD_DURABLE";
const KILL_MARKER: &str = "TRELLIS-CONSUMER-CHILD: kill me now; blocked:";

#[derive(Debug, Serialize, Deserialize)]
struct Shipped {
    order: String,
    n: u64,
}

/// The business effect and the follow-up event of one message, in the consumer's transaction.
async fn apply(
    tx: &mut Transaction<'static, Postgres>,
    d: &Delivered<Shipped>,
) -> Result<(), trellis_outbox::HandlerError> {
    sqlx::query("INSERT INTO effects (event_id, n) VALUES ($1, $2)")
        .bind(&d.id)
        .bind(i64::try_from(d.event.n).unwrap())
        .execute(&mut **tx)
        .await?;
    // A fresh id each time: applying twice would leave two follow-ups.
    let follow_up = PreparedOutboxRecord::event(
        "Orders.Billed",
        format!("tconsumerfaults.orders.billed.{}", d.event.order),
        &serde_json::json!({ "of": d.id }),
    )?;
    tx.enqueue(&follow_up).await?;
    Ok(())
}

/// Not a test: the body of the child process `a_consumer_killed_mid_handler…` kills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "entry point of the consumer fault test's child process"]
async fn consumer_fault_child_process() {
    let (Ok(db_name), Ok(nats_url), Ok(stream), Ok(durable)) = (
        std::env::var(CHILD_DB),
        std::env::var(CHILD_NATS),
        std::env::var(CHILD_STREAM),
        std::env::var(CHILD_DURABLE),
    ) else {
        return;
    };
    let options = PgConnectOptions::from_str(&database_url())
        .unwrap()
        .database(&db_name);
    let pool = PgPoolOptions::new()
        .max_connections(CONCURRENCY as u32 + 2)
        .connect_with(options)
        .await
        .unwrap();
    let upstream = nats_url.trim_start_matches("nats://").to_owned();
    let relay = Relay::start(upstream).await;
    let frozen = relay.frozen.clone();
    let js = async_nats::jetstream::new(async_nats::connect(&relay.url).await.unwrap());

    let calls = Arc::new(AtomicUsize::new(0));
    let blocked = Arc::new(Mutex::new(Vec::<u64>::new()));
    let watch = pool.clone();
    let consumer = Consumer::builder(
        js,
        pool,
        handler_fn(
            move |tx: &mut Transaction<'static, Postgres>, d: Delivered<Shipped>| {
                let (calls, blocked, frozen) = (calls.clone(), blocked.clone(), frozen.clone());
                let watch = watch.clone();
                Box::pin(async move {
                    let call = calls.fetch_add(1, Ordering::SeqCst) + 1;
                    apply(tx, &d).await?;
                    if (BLOCK_FROM..BLOCK_FROM + BLOCKERS).contains(&call) {
                        // Effects written, transaction open: hang here until killed.
                        blocked.lock().unwrap().push(d.event.n);
                        tokio::time::sleep(Duration::from_secs(120)).await;
                    }
                    if call == FREEZE_AT {
                        // From here on nothing the child sends reaches NATS: this message
                        // and the ones in flight commit, their acks are lost.
                        frozen.store(true, Ordering::SeqCst);
                        let id = d.id.clone();
                        tokio::spawn(async move {
                            // Certain: this message is committed and its ack is lost.
                            let query = "SELECT count(*) FROM effects WHERE event_id = $1";
                            while sqlx::query_scalar::<_, i64>(query)
                                .bind(&id)
                                .fetch_one(&watch)
                                .await
                                .unwrap()
                                == 0
                            {
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                            tokio::time::sleep(SETTLE_AFTER_FREEZE).await;
                            let blocked = blocked.lock().unwrap().clone();
                            let list: Vec<String> = blocked.iter().map(u64::to_string).collect();
                            let mut out = std::io::stdout().lock();
                            writeln!(out, "{KILL_MARKER} {}", list.join(",")).unwrap();
                            out.flush().unwrap();
                        });
                    }
                    Ok(())
                })
            },
        ),
    )
    .bind(&stream, &durable)
    .concurrency(CONCURRENCY)
    .start()
    .await
    .unwrap();
    // Run until killed.
    tokio::time::sleep(Duration::from_secs(120)).await;
    drop(consumer);
}

async fn publish_all(stream: &TestStream) {
    let mut acks = Vec::with_capacity(EVENTS as usize);
    for n in 0..EVENTS {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("evt-{n:05}").as_str());
        let payload = serde_json::to_vec(&Shipped {
            order: format!("o-{n}"),
            n,
        })
        .unwrap();
        acks.push(
            stream
                .context
                .publish_with_headers(
                    stream.subject(&format!("shipped.o{n}")),
                    headers,
                    payload.into(),
                )
                .await
                .unwrap(),
        );
    }
    for ack in acks {
        ack.await.unwrap();
    }
}

async fn scalar(pool: &sqlx::PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_mid_handler_leaves_every_effect_exactly_once() {
    let started = Instant::now();
    let server = NatsServer::start();
    let js = connect_reconnecting(&server.url()).await;
    let stream = TestStream::create_file(&js, |token| Config {
        subjects: vec![format!("{token}.>")],
        ..Config::default()
    })
    .await;
    let durable = "billing";
    js.get_stream(&stream.name)
        .await
        .unwrap()
        .create_consumer(PullConfig {
            durable_name: Some(durable.to_owned()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: ACK_WAIT,
            max_deliver: 20,
            ..PullConfig::default()
        })
        .await
        .unwrap();
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::query("CREATE TABLE effects (event_id text NOT NULL, n bigint NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    publish_all(&stream).await;
    assert_eq!(stream.count().await, EVENTS);

    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "consumer_fault_child_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DB, &db.name)
        .env(CHILD_NATS, server.url())
        .env(CHILD_STREAM, &stream.name)
        .env(CHILD_DURABLE, durable)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<Vec<u64>>();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // libtest may have printed `test consumer_fault_child_process ... ` on the line.
            if let Some((_, rest)) = line.split_once(KILL_MARKER)
                && let Some(tx) = tx.take()
            {
                let blocked = rest
                    .trim()
                    .split(',')
                    .filter_map(|n| n.parse().ok())
                    .collect();
                let _ = tx.send(blocked);
            }
        }
    });
    let marker = tokio::time::timeout(Duration::from_secs(60), rx).await;
    // SIGKILL to our own child, whatever happened.
    child.kill().unwrap();
    let status = child.wait().unwrap();
    let blocked = marker
        .expect("the child did not reach its kill point within 60 s")
        .expect("the child exited before its kill point");
    // What the child left: its commits; its blocked handlers' writes were never committed.
    let committed_at_kill = scalar(&db.pool, "SELECT count(*) FROM effects").await;
    let blocked_ns: Vec<i64> = blocked.iter().map(|n| *n as i64).collect();
    let blocked_rows = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects WHERE n = ANY($1)")
            .bind(&blocked_ns)
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    let blocked_visible = blocked_rows().await;
    assert!(!status.success(), "the child was killed: {status:?}");
    assert_eq!(blocked.len(), BLOCKERS, "handlers blocked in the child");
    assert_eq!(blocked_visible, 0, "the blocked handlers had not committed");
    assert!(
        (FREEZE_AT as i64 / 2..EVENTS as i64).contains(&committed_at_kill),
        "the child committed up to the freeze, not everything: {committed_at_kill}"
    );

    // A survivor on the same durable consumer: what the child held comes back after the ack
    // wait, committed or not.
    let survivor = Consumer::builder(
        js.clone(),
        db.pool.clone(),
        handler_fn(
            |tx: &mut Transaction<'static, Postgres>, d: Delivered<Shipped>| {
                Box::pin(async move { apply(tx, &d).await })
            },
        ),
    )
    .bind(&stream.name, durable)
    .concurrency(CONCURRENCY)
    .start()
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info = js
            .get_stream(&stream.name)
            .await
            .unwrap()
            .consumer_info(durable)
            .await
            .unwrap()
            .clone();
        let effects = scalar(&db.pool, "SELECT count(*) FROM effects").await;
        if info.num_pending == 0 && info.num_ack_pending == 0 && effects >= EVENTS as i64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not settled after 30 s: {} pending, {} ack pending, {effects} effects",
            info.num_pending,
            info.num_ack_pending
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let report = survivor.shutdown().await.unwrap();

    let (rows, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM effects")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (rows, distinct),
        (EVENTS as i64, EVENTS as i64),
        "each business effect exactly once"
    );
    assert_eq!(
        blocked_rows().await,
        BLOCKERS as i64,
        "the killed handlers' messages applied once, by the survivor"
    );
    assert_eq!(
        scalar(&db.pool, "SELECT count(*) FROM trellis_inbox").await,
        EVENTS as i64,
        "one inbox row per message"
    );
    assert_eq!(
        scalar(&db.pool, "SELECT count(*) FROM trellis_outbox").await,
        EVENTS as i64,
        "each follow-up event exactly once"
    );
    assert_eq!(
        report.applied,
        EVENTS - committed_at_kill as u64,
        "the survivor applied what the child had not committed: {report:?}"
    );
    assert!(
        report.duplicates >= 1,
        "messages the child committed without its ack arriving were redelivered and found in \
         the inbox: {report:?}"
    );
    assert_eq!(
        (report.dead_lettered, report.terminated),
        (0, 0),
        "{report:?}"
    );
    stream.delete().await;
    db.close().await;
    eprintln!(
        "consumer SIGKILL test: child committed {committed_at_kill}, blocked {blocked:?}; survivor {report:?}; {:.1?}",
        started.elapsed()
    );
}
