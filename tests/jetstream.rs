//! `JetStreamPublisher` against a real nats-server (`NATS_URL`, default
//! nats://127.0.0.1:4222): events, dedupe, error mapping, job `created` events, job
//! dispatchers and the stream check. Each test uses its own uniquely named stream.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::Config;
use serde_json::{Value, json};
use trellis_outbox::{
    JetStreamError, JetStreamErrorKind, JetStreamPublisher, JobAdmission, JobDispatcher, JobRef,
    JobRequest, OutboxJob, OutboxMessage, OutboxTransactionExt, PreparedOutboxRecord, PublishError,
    Publisher, StreamCheckError, format_timestamp, migrate, outbox_job,
};
use trellis_outbox_tests::TestSqlite;
use trellis_outbox_tests::nats::{TestStream, jetstream};

type Results = Vec<Result<Option<Value>, PublishError>>;

async fn sqlite() -> TestSqlite {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    db
}

/// Enqueues `records` in one transaction and returns the stored rows.
async fn enqueue(db: &TestSqlite, records: Vec<PreparedOutboxRecord>) -> Vec<OutboxMessage> {
    let mut tx = db.pool.begin().await.unwrap();
    let rows = tx.enqueue_all(records).await.unwrap();
    tx.commit().await.unwrap();
    rows
}

fn event(subject: String, n: usize) -> PreparedOutboxRecord {
    let mut record = PreparedOutboxRecord::event(
        "Orders.Placed",
        subject,
        &json!({ "orderId": format!("o-{n}"), "n": n }),
    )
    .unwrap();
    record.headers.insert(
        "traceparent".into(),
        format!("00-{:032x}-{:016x}-01", n + 1, n + 1),
    );
    record
}

fn header<'a>(message: &'a StreamMessage, name: &str) -> Option<&'a str> {
    message.headers.get(name).map(|v| v.as_str())
}

fn js_error(err: &PublishError) -> &JetStreamError {
    err.source_error()
        .downcast_ref::<JetStreamError>()
        .unwrap_or_else(|| panic!("not a JetStreamError: {}", err.chain()))
}

fn assert_all_ok(results: &Results) {
    for (i, result) in results.iter().enumerate() {
        if let Err(e) = result {
            panic!("row {i} failed: {}", e.chain());
        }
    }
}

#[tokio::test]
async fn events_are_published_exactly_as_stored_and_republishing_dedupes() {
    let js = jetstream().await;
    let stream = TestStream::events(&js).await;
    let s = stream.clone();
    stream
        .run(async move {
            let db = sqlite().await;
            const N: usize = 40;
            let mut records: Vec<_> = (0..N)
                .map(|n| event(s.subject("orders.placed"), n))
                .collect();
            // A stale dedupe id (any letter case) must not win over the row id.
            records[3]
                .headers
                .insert("Nats-Msg-Id".into(), "stale".into());
            records[4]
                .headers
                .insert("nats-msg-id".into(), "stale-lower".into());
            let rows = enqueue(&db, records).await;

            // A small window so the sliding window is exercised.
            let publisher = JetStreamPublisher::builder(js.clone())
                .ack_window(7)
                .build();
            let results = publisher.publish_batch(&rows).await;
            assert_eq!(results.len(), N);
            assert_all_ok(&results);
            assert!(results.iter().all(|r| matches!(r, Ok(None))));

            let messages = s.messages().await;
            assert_eq!(messages.len(), N);
            for (row, message) in rows.iter().zip(&messages) {
                assert_eq!(message.subject.as_str(), row.subject);
                assert_eq!(
                    &message.payload[..],
                    row.payload.as_bytes(),
                    "body verbatim"
                );
                let body: Value = serde_json::from_slice(&message.payload).unwrap();
                assert_eq!(body["orderId"], json!(format!("o-{}", body["n"])));
                assert_eq!(header(message, "Nats-Msg-Id"), Some(row.id.as_str()));
                assert_eq!(header(message, "nats-msg-id"), None);
                assert_eq!(
                    header(message, "Trellis-Event-Time"),
                    Some(row.headers["Trellis-Event-Time"].as_str())
                );
                assert_eq!(
                    header(message, "traceparent"),
                    Some(row.headers["traceparent"].as_str())
                );
            }

            // Republish (a dispatcher that crashed before marking): duplicate acks are success.
            let again = publisher.publish_batch(&rows).await;
            assert_all_ok(&again);
            assert_eq!(
                s.count().await,
                N as u64,
                "JetStream de-duplicated by Nats-Msg-Id"
            );
        })
        .await;
}

#[tokio::test]
async fn subject_without_stream_is_retryable_and_the_rest_is_delivered() {
    let js = jetstream().await;
    let stream = TestStream::events(&js).await;
    let s = stream.clone();
    stream
        .run(async move {
            let db = sqlite().await;
            let orphan = format!("{}x.nobody.listens", s.token); // no stream captures it
            let rows = enqueue(
                &db,
                vec![
                    event(s.subject("a"), 0),
                    event(orphan.clone(), 1),
                    event(s.subject("b"), 2),
                ],
            )
            .await;
            let results = JetStreamPublisher::new(js.clone())
                .publish_batch(&rows)
                .await;
            assert!(results[0].is_ok() && results[2].is_ok());
            let err = results[1].as_ref().unwrap_err();
            assert!(err.is_retryable(), "{}", err.chain());
            assert_eq!(js_error(err).kind(), JetStreamErrorKind::StreamNotFound);
            assert_eq!(js_error(err).row_id(), rows[1].id);
            let chain = err.chain();
            assert!(
                chain.contains(&format!("no JetStream stream captures subject `{orphan}`")),
                "{chain}"
            );
            assert!(
                chain.contains("no stream found for given subject"),
                "{chain}"
            );
            assert_eq!(s.count().await, 2);
        })
        .await;
}

#[tokio::test]
async fn oversized_payload_is_permanent_and_the_rest_is_delivered() {
    let js = jetstream().await;
    let stream = TestStream::events(&js).await;
    let s = stream.clone();
    stream
        .run(async move {
            let db = sqlite().await;
            let big = PreparedOutboxRecord::event(
                "Blob.Stored",
                s.subject("blob"),
                &json!({ "data": "x".repeat(2 * 1024 * 1024) }),
            )
            .unwrap();
            let rows = enqueue(
                &db,
                vec![event(s.subject("a"), 0), big, event(s.subject("b"), 1)],
            )
            .await;
            let results = JetStreamPublisher::new(js.clone())
                .publish_batch(&rows)
                .await;
            assert!(results[0].is_ok() && results[2].is_ok());
            let err = results[1].as_ref().unwrap_err();
            assert!(!err.is_retryable(), "{}", err.chain());
            assert_eq!(js_error(err).kind(), JetStreamErrorKind::MaxPayloadExceeded);
            let chain = err.chain();
            assert!(chain.contains("is too large to publish"), "{chain}");
            assert!(chain.contains("max payload size exceeded"), "{chain}");
            assert!(chain.contains("Payload size limit of"), "{chain}");
            assert_eq!(s.count().await, 2);
        })
        .await;
}

/// JetStream refuses more than 64 KiB of headers (error 10097) although the message is
/// well under `max_payload`: no retry can deliver it, so it fails permanently.
#[tokio::test]
async fn oversized_headers_are_permanent_and_the_rest_is_delivered() {
    let js = jetstream().await;
    let stream = TestStream::events(&js).await;
    let s = stream.clone();
    stream
        .run(async move {
            let db = sqlite().await;
            let mut big = event(s.subject("big"), 9);
            big.headers.insert("X-Big".into(), "h".repeat(70 * 1024));
            let rows = enqueue(
                &db,
                vec![event(s.subject("a"), 0), big, event(s.subject("b"), 1)],
            )
            .await;
            let results = JetStreamPublisher::new(js.clone())
                .publish_batch(&rows)
                .await;
            assert!(results[0].is_ok() && results[2].is_ok());
            let err = results[1].as_ref().unwrap_err();
            assert_eq!(js_error(err).kind(), JetStreamErrorKind::HeadersTooLarge);
            assert!(!err.is_retryable(), "{}", err.chain());
            assert!(err.chain().contains("headers too large"), "{}", err.chain());
            assert_eq!(s.count().await, 2);
        })
        .await;
}

/// A window larger than the context's `max_ack_inflight` used to hang: the publisher held
/// every permit in unawaited acks while waiting for one more.
#[tokio::test]
async fn a_window_larger_than_the_contexts_ack_limit_does_not_hang() {
    let js = jetstream().await;
    let stream = TestStream::events(&js).await;
    let s = stream.clone();
    let context = async_nats::jetstream::ContextBuilder::new()
        .max_ack_inflight(2)
        .build(js.client());
    stream
        .run(async move {
            let db = sqlite().await;
            let rows = enqueue(&db, (0..20).map(|n| event(s.subject("a"), n)).collect()).await;
            let publisher = JetStreamPublisher::builder(context).ack_window(8).build();
            let results =
                tokio::time::timeout(Duration::from_secs(20), publisher.publish_batch(&rows))
                    .await
                    .expect("the batch hung waiting for an ack permit");
            assert_all_ok(&results);
            assert_eq!(s.count().await, 20);
        })
        .await;
}

#[tokio::test]
async fn invalid_subject_is_permanent() {
    let js = jetstream().await;
    let db = sqlite().await;
    let mut rows = enqueue(&db, vec![event("events.v1.Ok".into(), 0)]).await;
    // Rows are validated at enqueue; a row edited in the database can still be broken.
    rows[0].subject = "events..broken".into();
    let results = JetStreamPublisher::new(js).publish_batch(&rows).await;
    let err = results[0].as_ref().unwrap_err();
    assert!(!err.is_retryable());
    assert_eq!(js_error(err).kind(), JetStreamErrorKind::InvalidSubject);
    assert!(
        err.chain().contains("has an empty token"),
        "{}",
        err.chain()
    );
}

#[tokio::test]
async fn unanswered_publishes_time_out_retryably_and_together() {
    let js = jetstream().await;
    let db = sqlite().await;
    // A core subscriber that never answers: the publish has a responder but no ack comes.
    let token = format!("t{}", ulid::Ulid::generate().to_string().to_lowercase());
    let subject = format!("{token}.silent");
    let _silent = js.client().subscribe(subject.clone()).await.unwrap();
    js.client().flush().await.unwrap();
    let rows = enqueue(&db, (0..20).map(|n| event(subject.clone(), n)).collect()).await;

    let publisher = JetStreamPublisher::builder(js.clone())
        .ack_timeout(Duration::from_millis(300))
        .build();
    let start = Instant::now();
    let results = publisher.publish_batch(&rows).await;
    let elapsed = start.elapsed();
    for result in &results {
        let err = result.as_ref().unwrap_err();
        assert!(err.is_retryable());
        assert_eq!(js_error(err).kind(), JetStreamErrorKind::TimedOut);
        assert!(
            err.chain().contains("did not acknowledge"),
            "{}",
            err.chain()
        );
        assert!(err.chain().contains("within 300ms"), "{}", err.chain());
    }
    // Each ack's deadline runs from its own send, so 20 timeouts cost ~one timeout, not 20.
    assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
}

#[outbox_job(
    queue = "syncCustomer",
    service = "billing",
    job_type = "sync-customer",
    mode = "submit"
)]
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct SyncCustomer {
    customer_id: String,
    force: bool,
}

/// A job record exactly as `#[outbox_job]` writes it, moved to a service token unique to the
/// test so its stream captures nothing of other tests.
fn job_record(service: &str, n: usize) -> (PreparedOutboxRecord, String, String) {
    let (mut record, submission) = SyncCustomer {
        customer_id: format!("c-{n}"),
        force: n.is_multiple_of(2),
    }
    .prepare_job()
    .unwrap();
    record.subject = format!(
        "trellis.jobs.{service}.sync-customer.{}.created",
        submission.job_id
    );
    (record, submission.job_id, submission.submission_id)
}

async fn jobs_stream(js: &async_nats::jetstream::Context) -> (TestStream, String) {
    let stream = TestStream::create(js, |token| Config {
        subjects: vec![format!("trellis.jobs.{token}.>")],
        ..Config::default()
    })
    .await;
    let service = stream.token.clone();
    (stream, service)
}

#[tokio::test]
async fn job_row_publishes_the_created_event_once() {
    let js = jetstream().await;
    let (stream, service) = jobs_stream(&js).await;
    let s = stream.clone();
    stream
        .run(async move {
            let db = sqlite().await;
            let (mut record, job_id, submission_id) = job_record(&service, 0);
            record
                .headers
                .insert("tracestate".into(), "vendor=abc".into());
            let rows = enqueue(&db, vec![record]).await;
            let row = &rows[0];

            let publisher = JetStreamPublisher::builder(js.clone())
                .queue_max_tries("syncCustomer", 9)
                .build();
            let results = publisher.publish_batch(&rows).await;
            assert_all_ok(&results);

            let messages = s.messages().await;
            assert_eq!(messages.len(), 1);
            let message = &messages[0];
            assert_eq!(
                message.subject.as_str(),
                format!("trellis.jobs.{service}.sync-customer.{job_id}.created")
            );
            let traceparent = row.headers["traceparent"].clone();
            assert_eq!(
                header(message, "Nats-Msg-Id"),
                Some(format!("trellis-job-created:{submission_id}").as_str())
            );
            assert_eq!(
                header(message, "request-id"),
                Some(row.headers["request-id"].as_str())
            );
            assert_eq!(header(message, "traceparent"), Some(traceparent.as_str()));
            assert_eq!(header(message, "tracestate"), Some("vendor=abc"));
            let body: Value = serde_json::from_slice(&message.payload).unwrap();
            assert_eq!(
                body,
                json!({
                    "jobId": job_id,
                    "service": service,
                    "jobType": "syncCustomer",
                    "eventType": "created",
                    "state": "pending",
                    "context": {
                        "requestId": row.headers["request-id"],
                        "traceId": &traceparent[3..35],
                        "traceparent": traceparent,
                        "tracestate": "vendor=abc",
                    },
                    "tries": 0,
                    "maxTries": 9,
                    "payload": { "customerId": "c-0", "force": true },
                    "timestamp": format_timestamp(row.created_at),
                })
            );
            // Key order of the wire body: the JobEvent field order, payload fields as stored.
            let text = std::str::from_utf8(&message.payload).unwrap();
            assert!(text.starts_with(r#"{"jobId":"#), "{text}");
            assert!(
                text.contains(r#""payload":{"customerId":"c-0","force":true}"#),
                "{text}"
            );

            // Dispatching the row again (crash before mark) is deduplicated.
            let again = publisher.publish_batch(&rows).await;
            assert_all_ok(&again);
            assert_eq!(s.count().await, 1);
        })
        .await;
}

#[tokio::test]
async fn malformed_job_row_is_permanent() {
    let js = jetstream().await;
    let db = sqlite().await;
    let (record, _, _) = job_record("svc", 0);
    let mut rows = enqueue(&db, vec![record]).await;
    rows[0].payload = r#"{"customerId":"c-0"}"#.into();
    let results = JetStreamPublisher::new(js).publish_batch(&rows).await;
    let err = results[0].as_ref().unwrap_err();
    assert!(!err.is_retryable());
    assert_eq!(js_error(err).kind(), JetStreamErrorKind::MalformedJob);
    assert!(
        err.chain().contains("the payload has no `jobId`"),
        "{}",
        err.chain()
    );
}

/// A jobs manager stand-in: records what it was asked and answers from the payload.
#[derive(Default)]
struct Manager {
    seen: Mutex<Vec<JobRequest>>,
}

impl JobDispatcher for Manager {
    async fn dispatch_job(&self, message: &OutboxMessage) -> Result<JobAdmission, PublishError> {
        let job = JobRequest::from_message(message)?;
        self.seen.lock().unwrap().push(job.clone());
        if job.payload["force"] == json!(true) {
            Ok(JobAdmission::Accepted {
                job: JobRef::new(job.service, job.job_type, job.job_id),
            })
        } else {
            Ok(JobAdmission::Rejected {
                key: job.payload["customerId"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                reason: "active-limit".into(),
                active: 1,
                queued: 0,
                limit: 1,
            })
        }
    }
}

#[tokio::test]
async fn job_dispatcher_outcome_is_returned_and_events_still_publish() {
    let js = jetstream().await;
    let (stream, service) = jobs_stream(&js).await;
    let events = TestStream::events(&js).await;
    let (s, e) = (stream.clone(), events.clone());
    stream
        .run(async move {
            let db = sqlite().await;
            let (job0, job0_id, _) = job_record(&service, 0);
            let (job1, _, _) = job_record(&service, 1);
            let rows = enqueue(
                &db,
                vec![
                    event(e.subject("a"), 0),
                    job0,
                    job1,
                    event(e.subject("b"), 1),
                ],
            )
            .await;

            let manager = Arc::new(Manager::default());
            let publisher = JetStreamPublisher::builder(js.clone())
                .job_dispatcher(Arc::clone(&manager))
                .build();
            let results = publisher.publish_batch(&rows).await;
            assert_all_ok(&results);
            assert!(matches!(results[0], Ok(None)) && matches!(results[3], Ok(None)));
            assert_eq!(
                results[1].as_ref().unwrap(),
                &Some(json!({
                    "kind": "accepted",
                    "ref": { "service": service, "jobType": "sync-customer", "id": job0_id },
                }))
            );
            assert_eq!(
                results[2].as_ref().unwrap(),
                &Some(json!({
                    "kind": "rejected", "key": "c-1", "reason": "active-limit",
                    "active": 1, "queued": 0, "limit": 1,
                }))
            );
            let seen = manager.seen.lock().unwrap().clone();
            assert_eq!(seen.len(), 2);
            assert_eq!(seen[0].submission_id, rows[1].id);
            assert_eq!(seen[0].queue, "syncCustomer");
            assert_eq!(
                seen[1].payload,
                json!({ "customerId": "c-1", "force": false })
            );
            // The dispatcher admitted the jobs: the publisher itself published no job event.
            assert_eq!(s.count().await, 0);
            assert_eq!(e.count().await, 2);
        })
        .await;
    events.delete().await;
}

#[tokio::test]
async fn no_job_dispatch_fails_job_rows_retryably() {
    let js = jetstream().await;
    let (stream, service) = jobs_stream(&js).await;
    let s = stream.clone();
    stream
        .run(async move {
            let db = sqlite().await;
            let (job, _, _) = job_record(&service, 0);
            let rows = enqueue(&db, vec![job]).await;
            let publisher = JetStreamPublisher::builder(js.clone())
                .no_job_dispatch()
                .build();
            let results = publisher.publish_batch(&rows).await;
            let err = results[0].as_ref().unwrap_err();
            assert!(err.is_retryable());
            assert_eq!(js_error(err).kind(), JetStreamErrorKind::NoJobDispatch);
            assert!(
                err.chain().contains("no job dispatcher is configured"),
                "{}",
                err.chain()
            );
            assert!(err.chain().contains("job.submit"), "{}", err.chain());
            assert_eq!(s.count().await, 0);
        })
        .await;
}

#[tokio::test]
async fn check_streams_finds_missing_streams_and_short_duplicate_windows() {
    let js = jetstream().await;
    let stream = TestStream::create(&js, |token| Config {
        subjects: vec![format!("{token}.>")],
        duplicate_window: Duration::from_secs(2),
        ..Config::default()
    })
    .await;
    let s = stream.clone();
    stream
        .run(async move {
            let publisher = JetStreamPublisher::new(js.clone());
            let captured = s.subject("orders.placed");

            let checks = publisher
                .check_streams([&captured], Duration::from_secs(60))
                .await
                .unwrap();
            assert_eq!(checks.len(), 1);
            assert_eq!(checks[0].stream, s.name);
            assert_eq!(checks[0].duplicate_window, Duration::from_secs(2));
            assert!(
                !checks[0].covers_retry_gap,
                "a 2 s window does not cover a 60 s gap"
            );

            let checks = publisher
                .check_streams([&captured], Duration::from_secs(1))
                .await
                .unwrap();
            assert!(checks[0].covers_retry_gap);

            let missing = format!("{}x.orders.placed", s.token);
            let err = publisher
                .check_streams([captured.clone(), missing.clone()], Duration::from_secs(1))
                .await
                .unwrap_err();
            match &err {
                StreamCheckError::NoStream { subjects } => {
                    assert_eq!(subjects, &vec![missing.clone()])
                }
                other => panic!("unexpected {other}"),
            }
            assert!(
                err.to_string()
                    .contains(&format!("no JetStream stream captures `{missing}`"))
            );
        })
        .await;
}

#[test]
fn headers_overlay_the_row_id() {
    // Pure: no server needed.
    let mut record = PreparedOutboxRecord::event("A.B", "events.v1.A.B", &1).unwrap();
    record.headers.insert("NATS-MSG-ID".into(), "stale".into());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let db = sqlite().await;
        let rows = enqueue(&db, vec![record]).await;
        let headers = rows[0].publish_headers().unwrap();
        assert_eq!(
            headers.get("Nats-Msg-Id").map(|v| v.as_str()),
            Some(rows[0].id.as_str())
        );
        assert!(headers.get("NATS-MSG-ID").is_none());
        assert!(headers.get("Trellis-Event-Time").is_some());
    });
}

#[tokio::test]
async fn a_dispatcher_checks_its_streams_at_start_without_blocking_on_a_missing_one() {
    let js = jetstream().await;
    let stream = TestStream::events(&js).await;
    let s = stream.clone();
    stream
        .run(async move {
            let db = sqlite().await;
            let captured = s.subject("orders.placed");
            let missing = format!("{}x.orders.placed", s.token);
            let publisher = JetStreamPublisher::builder(js.clone())
                .check_streams_at_start([captured.clone(), missing])
                .build();
            let rows = enqueue(&db, vec![event(captured.clone(), 1)]).await;
            let started = Instant::now();
            let dispatcher = trellis_outbox::OutboxDispatcher::builder(
                trellis_outbox::SqliteOutboxRepository::new(db.pool.clone()),
                publisher,
            )
            .start()
            .unwrap();
            // The start-up drain runs after the check and delivers the left-over row.
            while s.count().await < 1 && started.elapsed() < Duration::from_secs(10) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(
                s.count().await,
                1,
                "the row was not delivered after the check"
            );
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "the stream check held up the first drain for {:?}",
                started.elapsed()
            );
            dispatcher.shutdown().await;
            let messages = s.messages().await;
            assert_eq!(
                header(&messages[0], "Nats-Msg-Id"),
                Some(rows[0].id.as_str())
            );
        })
        .await;
}

/// A row that reaches the publisher without passing a claim's wire check (a custom
/// repository, a hand-built message) still cannot purge the stream: `Nats-*` control
/// headers are stripped at publish, and a bad header or id fails that row only.
#[tokio::test]
async fn control_headers_are_stripped_at_publish_and_bad_headers_fail_only_their_row() {
    let js = jetstream().await;
    let stream = TestStream::create(&js, |token| Config {
        subjects: vec![format!("{token}.>")],
        allow_rollup: true,
        ..Config::default()
    })
    .await;
    let s = stream.clone();
    stream
        .run(async move {
            let db = sqlite().await;
            let mut rows = enqueue(
                &db,
                (0..4)
                    .map(|n| event(s.subject("orders.placed"), n))
                    .collect(),
            )
            .await;
            rows[1].headers.insert("Nats-Rollup".into(), "all".into());
            rows[1]
                .headers
                .insert("nats-expected-last-sequence".into(), "999".into());
            rows[2].headers.insert("X-Note".into(), "a\r\nb".into());
            rows[3].id = "bad\nid".into();
            let results = JetStreamPublisher::new(js.clone())
                .publish_batch(&rows)
                .await;
            assert!(matches!(results[0], Ok(None)));
            assert!(matches!(results[1], Ok(None)), "stripped, then published");
            for bad in &results[2..] {
                let err = bad.as_ref().unwrap_err();
                assert!(!err.is_retryable());
                assert_eq!(js_error(err).kind(), JetStreamErrorKind::InvalidHeader);
            }
            let messages = s.messages().await;
            assert_eq!(messages.len(), 2, "the rollup purged nothing");
            assert!(header(&messages[1], "Nats-Rollup").is_none());
            assert_eq!(
                header(&messages[1], "Nats-Msg-Id"),
                Some(rows[1].id.as_str())
            );
        })
        .await;
}

#[tokio::test]
async fn allowed_subject_prefixes_fail_other_subjects_permanently() {
    let js = jetstream().await;
    let stream = TestStream::events(&js).await;
    let s = stream.clone();
    stream
        .run(async move {
            let db = sqlite().await;
            let rows = enqueue(
                &db,
                vec![
                    event(s.subject("allowed.a"), 0),
                    event(s.subject("other.b"), 1),
                ],
            )
            .await;
            let publisher = JetStreamPublisher::builder(js.clone())
                .allow_subject_prefixes([s.subject("allowed.")])
                .build();
            let results = publisher.publish_batch(&rows).await;
            assert!(matches!(results[0], Ok(None)));
            let err = results[1].as_ref().unwrap_err();
            assert!(!err.is_retryable());
            assert_eq!(js_error(err).kind(), JetStreamErrorKind::SubjectNotAllowed);
            assert!(
                err.chain().contains(&s.subject("other.b")),
                "{}",
                err.chain()
            );
            assert!(err.chain().contains("allowed prefixes"), "{}", err.chain());
            assert_eq!(s.count().await, 1);
        })
        .await;
}

/// `ack_timeout(Duration::MAX)` panicked (`Instant + Duration` overflow) on the first ack.
#[tokio::test]
async fn huge_ack_timeout_and_window_do_not_panic_and_the_budget_saturates() {
    let js = jetstream().await;
    let stream = TestStream::events(&js).await;
    let s = stream.clone();
    let context = js.clone();
    stream
        .run(async move {
            let db = sqlite().await;
            let rows = enqueue(&db, (0..3).map(|n| event(s.subject("a"), n)).collect()).await;
            let publisher = JetStreamPublisher::builder(context)
                .ack_timeout(Duration::MAX)
                .ack_window(usize::MAX)
                .build();
            assert_all_ok(&publisher.publish_batch(&rows).await);
            assert_eq!(s.count().await, 3);
            assert_eq!(publisher.publish_budget(10), Duration::MAX);
            assert_eq!(
                Publisher::publish_budget(&publisher, 10),
                Some(Duration::MAX)
            );
        })
        .await;

    let publisher = JetStreamPublisher::builder(js.clone())
        .ack_window(100)
        .ack_timeout(Duration::from_secs(2))
        .build();
    assert_eq!(publisher.publish_budget(0), Duration::ZERO);
    assert_eq!(publisher.publish_budget(1), Duration::from_secs(2));
    assert_eq!(publisher.publish_budget(100), Duration::from_secs(2));
    assert_eq!(publisher.publish_budget(250), Duration::from_secs(6));
    let arc: Arc<JetStreamPublisher> = Arc::new(publisher);
    assert_eq!(
        Publisher::publish_budget(&arc, 250),
        Some(Duration::from_secs(6))
    );
    // Job rows through a dispatcher are decided one at a time.
    let with_jobs = JetStreamPublisher::builder(js)
        .ack_window(100)
        .ack_timeout(Duration::from_secs(2))
        .job_dispatcher(Manager::default())
        .job_dispatch_timeout(Duration::from_secs(1))
        .build();
    assert_eq!(with_jobs.publish_budget(250), Duration::from_secs(6 + 250));
}

/// A job dispatcher that never answers.
struct Stuck;

impl JobDispatcher for Stuck {
    async fn dispatch_job(&self, _: &OutboxMessage) -> Result<JobAdmission, PublishError> {
        std::future::pending().await
    }
}

/// A stuck jobs manager held the whole batch forever.
#[tokio::test]
async fn a_stuck_job_dispatcher_times_out_retryably_and_events_still_publish() {
    let js = jetstream().await;
    let (stream, service) = jobs_stream(&js).await;
    let events = TestStream::events(&js).await;
    let e = events.clone();
    stream
        .run(async move {
            let db = sqlite().await;
            let (job, _, _) = job_record(&service, 0);
            let rows = enqueue(&db, vec![job, event(e.subject("a"), 0)]).await;
            let publisher = JetStreamPublisher::builder(js.clone())
                .job_dispatcher(Stuck)
                .job_dispatch_timeout(Duration::from_millis(200))
                .build();
            let results =
                tokio::time::timeout(Duration::from_secs(10), publisher.publish_batch(&rows))
                    .await
                    .expect("the batch finishes");
            let err = results[0].as_ref().unwrap_err();
            assert!(err.is_retryable());
            assert_eq!(
                js_error(err).kind(),
                JetStreamErrorKind::JobDispatchTimedOut
            );
            assert!(err.chain().contains("within 200ms"), "{}", err.chain());
            assert!(matches!(results[1], Ok(None)));
            assert_eq!(e.count().await, 1);
        })
        .await;
    events.delete().await;
}

/// The test support's `jetstream()` deletes test streams left behind by a test that
/// panicked before its cleanup (named `TRELLIS_T_<ulid>`), once they are over an hour old,
/// and leaves younger ones (another test may be using them) and other streams alone.
#[tokio::test]
async fn stale_test_streams_are_swept() {
    let js = jetstream().await;
    let two_hours_ago = std::time::SystemTime::now() - Duration::from_secs(2 * 3600);
    let stale = format!("TRELLIS_T_{}", ulid::Ulid::from_datetime(two_hours_ago));
    let fresh = format!("TRELLIS_T_{}", ulid::Ulid::generate());
    for name in [&stale, &fresh] {
        js.create_stream(Config {
            name: name.clone(),
            subjects: vec![format!("swept.{name}.>")],
            storage: async_nats::jetstream::stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let js = jetstream().await;
    assert!(js.get_stream(&stale).await.is_err(), "{stale} was swept");
    assert!(js.get_stream(&fresh).await.is_ok(), "{fresh} was kept");
    js.delete_stream(&fresh).await.unwrap();
}
