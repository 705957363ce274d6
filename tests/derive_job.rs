//! Runtime behaviour of `#[outbox_job]` against spec §D.2, and `tx.enqueue_job(&job)` end to
//! end on Postgres and SQLite.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::collections::{BTreeMap, HashSet};

use trellis_outbox::{
    JobMode, JobSubmission, OutboxJob, OutboxRecordKind, OutboxTransactionExt,
    PreparedOutboxRecord, ToOutboxRecord, TraceContext, migrate, outbox_job,
};
use trellis_outbox_tests::{TestPg, TestSqlite};

#[outbox_job(
    queue = "syncCustomer",
    service = "billing",
    job_type = "sync-customer"
)]
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct SyncCustomer {
    customer_id: String,
    full_sync: bool,
}

#[outbox_job(
    queue = "reindex",
    service = "search",
    job_type = "reindex",
    mode = "submit"
)]
#[derive(serde::Serialize)]
struct Reindex {
    // Serializes as `job_id` (no rename_all): no collision with `jobId`.
    job_id: u32,
}

fn sync() -> SyncCustomer {
    SyncCustomer {
        customer_id: "c.1".into(),
        full_sync: true,
    }
}

fn is_ulid(s: &str) -> bool {
    s.len() == 26 && ulid::Ulid::from_string(s).is_ok()
}

/// `^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$`, not all-zero.
fn is_traceparent(s: &str) -> bool {
    TraceContext::new(s, None).is_valid()
}

fn check_record(record: &PreparedOutboxRecord, submission: &JobSubmission) {
    assert_eq!(record.kind, OutboxRecordKind::JobCreate);
    assert_eq!(record.name, "syncCustomer");
    assert_eq!(record.id, submission.submission_id);
    assert!(is_ulid(&submission.submission_id));
    assert!(is_ulid(&submission.job_id));
    assert_ne!(submission.job_id, submission.submission_id);
    assert_eq!(
        record.subject,
        format!(
            "trellis.jobs.billing.sync-customer.{}.created",
            submission.job_id
        )
    );
    assert_eq!(
        record.payload,
        format!(
            r#"{{"customerId":"c.1","fullSync":true,"jobId":"{}","submissionId":"{}"}}"#,
            submission.job_id, submission.submission_id
        )
    );
    let names: Vec<&str> = record.headers.keys().map(String::as_str).collect();
    assert_eq!(names, ["request-id", "traceparent"]); // no Nats-Msg-Id, no tracestate
    assert!(is_ulid(&record.headers["request-id"]));
    assert_ne!(record.headers["request-id"], submission.submission_id);
    assert_ne!(record.headers["request-id"], submission.job_id);
    let traceparent = &record.headers["traceparent"];
    assert!(is_traceparent(traceparent), "{traceparent}");
    assert!(traceparent.starts_with("00-") && traceparent.ends_with("-01"));
    assert_eq!(submission.queue, "syncCustomer");
    assert_eq!(submission.mode, JobMode::Create);
}

#[test]
fn constants() {
    assert_eq!(SyncCustomer::OUTBOX_NAME, "syncCustomer");
    assert_eq!(
        SyncCustomer::OUTBOX_SUBJECT_PREFIX,
        "trellis.jobs.billing.sync-customer"
    );
    assert_eq!(<SyncCustomer as OutboxJob>::QUEUE, "syncCustomer");
    assert_eq!(<SyncCustomer as OutboxJob>::SERVICE, "billing");
    assert_eq!(<SyncCustomer as OutboxJob>::JOB_TYPE, "sync-customer");
    assert_eq!(<SyncCustomer as OutboxJob>::MODE, JobMode::Create);
    assert_eq!(<Reindex as OutboxJob>::MODE, JobMode::Submit);
    assert_eq!(
        Reindex::OUTBOX_SUBJECT_PREFIX,
        "trellis.jobs.search.reindex"
    );
}

#[test]
fn record_follows_the_spec() {
    let (record, submission) = sync().prepare_job().unwrap();
    check_record(&record, &submission);
    record.validate().unwrap();
}

#[test]
fn to_outbox_record_builds_the_same_shape() {
    let record = sync().to_outbox_record().unwrap();
    let payload: serde_json::Value = serde_json::from_str(&record.payload).unwrap();
    let submission = JobSubmission {
        submission_id: record.id.clone(),
        job_id: payload["jobId"].as_str().unwrap().to_owned(),
        queue: "syncCustomer".into(),
        mode: JobMode::Create,
    };
    check_record(&record, &submission);
}

#[test]
fn submit_mode_and_ids_are_unique() {
    let mut ids = HashSet::new();
    for _ in 0..500 {
        let (record, submission) = Reindex { job_id: 7 }.prepare_job().unwrap();
        assert_eq!(record.kind, OutboxRecordKind::JobSubmit);
        assert_eq!(submission.mode, JobMode::Submit);
        assert_eq!(
            record.payload,
            format!(
                r#"{{"job_id":7,"jobId":"{}","submissionId":"{}"}}"#,
                submission.job_id, submission.submission_id
            )
        );
        assert!(ids.insert(submission.submission_id));
        assert!(ids.insert(submission.job_id));
        assert!(ids.insert(record.headers["request-id"].clone()));
    }
}

#[test]
fn synthesized_traceparents_differ() {
    let a = sync().to_outbox_record().unwrap();
    let b = sync().to_outbox_record().unwrap();
    assert_ne!(a.headers["traceparent"], b.headers["traceparent"]);
}

#[test]
fn current_trace_context_is_used() {
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let record = TraceContext::new(parent, Some("rojo=00f067aa0ba902b7".into()))
        .sync_scope(|| sync().to_outbox_record())
        .unwrap();
    assert_eq!(record.headers["traceparent"], parent);
    assert_eq!(record.headers["tracestate"], "rojo=00f067aa0ba902b7");

    // An invalid current traceparent is replaced by a synthesized one, without tracestate.
    let record = TraceContext::new(
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        Some("x=1".into()),
    )
    .sync_scope(|| sync().to_outbox_record())
    .unwrap();
    assert!(is_traceparent(&record.headers["traceparent"]));
    assert!(!record.headers["traceparent"].contains("00000000000000000000000000000000"));
    assert!(!record.headers.contains_key("tracestate"));
}

#[test]
fn submission_serializes_like_trellis() {
    let submission = JobSubmission {
        submission_id: "S".into(),
        job_id: "J".into(),
        queue: "q".into(),
        mode: JobMode::Submit,
    };
    assert_eq!(
        serde_json::to_value(&submission).unwrap(),
        serde_json::json!({ "submissionId": "S", "jobId": "J", "queue": "q", "mode": "submit" })
    );
}

#[tokio::test]
async fn enqueue_job_on_postgres() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let submission = tx.enqueue_job(&sync()).await.unwrap();
    tx.commit().await.unwrap();

    let (id, kind, name, subject, payload, headers): (
        String,
        String,
        String,
        String,
        String,
        serde_json::Value,
    ) = sqlx::query_as("SELECT id, kind, name, subject, payload, headers FROM trellis_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let headers: BTreeMap<String, String> = serde_json::from_value(headers).unwrap();
    let record = PreparedOutboxRecord {
        id,
        kind: kind.parse().unwrap(),
        name,
        subject,
        payload,
        headers,
        ordering: None,
    };
    check_record(&record, &submission);

    // Rolled back: nothing stored.
    let mut tx = db.pool.begin().await.unwrap();
    tx.enqueue_job(&Reindex { job_id: 1 }).await.unwrap();
    tx.rollback().await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
    db.close().await;
}

#[tokio::test]
async fn enqueue_job_on_sqlite() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let submission = tx.enqueue_job(&sync()).await.unwrap();
    let submit = tx.enqueue_job(&Reindex { job_id: 2 }).await.unwrap();
    tx.commit().await.unwrap();

    let (id, kind, name, subject, payload, headers): (
        String,
        String,
        String,
        String,
        String,
        String,
    ) = sqlx::query_as(
        "SELECT id, kind, name, subject, payload, headers FROM trellis_outbox WHERE id = ?",
    )
    .bind(&submission.submission_id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let record = PreparedOutboxRecord {
        id,
        kind: kind.parse().unwrap(),
        name,
        subject,
        payload,
        headers: serde_json::from_str(&headers).unwrap(),
        ordering: None,
    };
    check_record(&record, &submission);

    let kind: String = sqlx::query_scalar("SELECT kind FROM trellis_outbox WHERE id = ?")
        .bind(&submit.submission_id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(kind, "job.submit");
}
