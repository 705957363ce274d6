//! Hostile rows written by another writer (raw SQL on Postgres) dispatched through the real
//! `JetStreamPublisher` on the local NATS server: each goes `dead` at its first claim with a
//! reason naming the problem, nothing is published for it, and the good rows of the same
//! batch reach the stream exactly once.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::collections::HashMap;

use async_nats::jetstream::stream::Config;
use serde_json::json;
use trellis_outbox::{
    DispatchOptions, JetStreamPublisher, OutboxTransactionExt, PgOutboxRepository,
    PreparedOutboxRecord, dispatch_outbox, migrate,
};
use trellis_outbox_tests::TestPg;
use trellis_outbox_tests::nats::{TestStream, jetstream};

/// Inserts a pending row by SQL, as another writer would, due an hour ago.
async fn insert_raw(
    pool: &sqlx::PgPool,
    id: &str,
    kind: &str,
    subject: &str,
    headers: serde_json::Value,
) {
    sqlx::query(
        "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at) \
         VALUES ($1, $2, 'Orders.Placed', $3, '{\"hostile\":true}', $4, 'pending', 0, now() - interval '1 hour', now())",
    )
    .bind(id)
    .bind(kind)
    .bind(subject)
    .bind(headers)
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn hostile_rows_go_dead_once_and_the_rest_of_the_batch_is_published_once() {
    let js = jetstream().await;
    // Rollups allowed: a `Nats-Rollup: all` that reached the stream would purge it.
    let stream = TestStream::create(&js, |token| Config {
        subjects: vec![format!("{token}.>")],
        allow_rollup: true,
        ..Config::default()
    })
    .await;
    let s = stream.clone();
    stream
        .run(async move {
            let db = TestPg::new().await;
            migrate(&db.pool).await.unwrap();

            // Good rows, interleaved in claim order with the hostile ones below.
            const GOOD: usize = 12;
            let records: Vec<PreparedOutboxRecord> = (0..GOOD)
                .map(|n| {
                    PreparedOutboxRecord::event(
                        "Orders.Placed",
                        s.subject("orders.placed"),
                        &json!({ "n": n }),
                    )
                    .unwrap()
                })
                .collect();
            let mut tx = db.pool.begin().await.unwrap();
            tx.enqueue_all(&records[..GOOD / 2]).await.unwrap();
            tx.commit().await.unwrap();

            let good_subject = s.subject("orders.placed");
            // (id, kind, subject, headers, what last_error must name)
            let hostile: Vec<(&str, &str, String, serde_json::Value, &str)> = vec![
                (
                    "hostile-crlf-header",
                    "event.publish",
                    good_subject.clone(),
                    json!({ "X-Note": "a\r\nNats-Rollup: all" }),
                    "value of \"X-Note\" contains a line break",
                ),
                (
                    "hostile\r\nid",
                    "event.publish",
                    good_subject.clone(),
                    json!({}),
                    "contains the control character '\\r'",
                ),
                (
                    "hostile-js-api",
                    "event.publish",
                    // Would delete the test stream itself if it were ever published.
                    format!("$JS.API.STREAM.DELETE.{}", s.name),
                    json!({}),
                    "starts with the system token `$JS`",
                ),
                (
                    "hostile-rollup",
                    "event.publish",
                    good_subject.clone(),
                    json!({ "Nats-Rollup": "all" }),
                    "\"Nats-Rollup\" is a NATS control header",
                ),
                (
                    "hostile-escape-header",
                    "event.publish",
                    good_subject.clone(),
                    json!({ "X-Note": "\u{1b}[2J" }),
                    "value of \"X-Note\" contains the control character",
                ),
                (
                    "hostile-job-kv",
                    "job.submit",
                    "$KV.jobs.x".to_owned(),
                    json!({ "request-id": "r" }),
                    "starts with the system token `$KV`",
                ),
                (
                    "hostile-inbox",
                    "event.publish",
                    "_INBOX.steal.replies".to_owned(),
                    json!({}),
                    "`_INBOX` reply namespace",
                ),
            ];
            for (id, kind, subject, headers, _) in &hostile {
                insert_raw(&db.pool, id, kind, subject, headers.clone()).await;
            }
            let mut tx = db.pool.begin().await.unwrap();
            tx.enqueue_all(&records[GOOD / 2..]).await.unwrap();
            tx.commit().await.unwrap();

            let repo = PgOutboxRepository::new(db.pool.clone());
            let publisher = JetStreamPublisher::new(js.clone());
            let options = DispatchOptions::new().batch_size(100);
            let report = dispatch_outbox(&repo, &publisher, options.clone())
                .await
                .unwrap();
            assert_eq!(report.dispatched, GOOD as u64, "{report:?}");
            assert_eq!(report.dead, hostile.len() as u64, "{report:?}");
            assert_eq!(report.failed, 0, "{report:?}");

            // One dispatch settled everything: nothing is left to retry.
            let again = dispatch_outbox(&repo, &publisher, options).await.unwrap();
            assert_eq!((again.dispatched, again.failed, again.dead), (0, 0, 0));

            let rows: Vec<(String, String, i32, Option<String>)> =
                sqlx::query_as("SELECT id, state, attempts, last_error FROM trellis_outbox")
                    .fetch_all(&db.pool)
                    .await
                    .unwrap();
            let rows: HashMap<_, _> = rows
                .into_iter()
                .map(|(id, state, attempts, error)| (id, (state, attempts, error)))
                .collect();
            for record in &records {
                assert_eq!(rows[&record.id].0, "dispatched");
            }
            for (id, _, _, _, reason) in &hostile {
                let (state, attempts, error) = &rows[*id];
                assert_eq!(state, "dead", "{id:?}");
                assert!(*attempts <= 1, "{id:?}: {attempts} attempts");
                let error = error.as_deref().unwrap_or_default();
                assert!(error.contains(reason), "{id:?}: {error}");
                assert!(error.contains("cannot be published"), "{id:?}: {error}");
            }

            // The stream still exists, holds each good row exactly once and nothing else.
            let messages = s.messages().await;
            let mut seen: HashMap<String, usize> = HashMap::new();
            for message in &messages {
                let id = message
                    .headers
                    .get("Nats-Msg-Id")
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default();
                *seen.entry(id).or_default() += 1;
                assert!(
                    message.headers.get("Nats-Rollup").is_none(),
                    "no rollup header reached the stream"
                );
            }
            assert_eq!(messages.len(), GOOD, "{seen:?}");
            for record in &records {
                assert_eq!(seen.get(&record.id), Some(&1), "{}", record.id);
            }
            db.close().await;
        })
        .await;
}
