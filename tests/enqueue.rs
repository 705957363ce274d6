//! Transactional enqueue on real Postgres and SQLite.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde_json::json;
use trellis_outbox::{
    Error, Outbox, OutboxMessageState, OutboxRecordKind, OutboxTables, OutboxTransactionExt,
    PreparedOutboxRecord, migrate, migrate_with,
};
use trellis_outbox_tests::{TestPg, TestSqlite};

fn record(n: usize) -> PreparedOutboxRecord {
    PreparedOutboxRecord::event(
        "Document.Processed",
        "events.v1.Document.Processed",
        &json!({ "documentId": format!("doc-{n}") }),
    )
    .unwrap()
}

fn is_iso_millis(text: &str) -> bool {
    let b = text.as_bytes();
    b.len() == 24
        && text.ends_with('Z')
        && b[4] == b'-'
        && b[10] == b'T'
        && b[19] == b'.'
        && text.parse::<DateTime<Utc>>().is_ok()
}

async fn pg() -> TestPg {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    db
}

async fn sqlite() -> TestSqlite {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    db
}

#[tokio::test]
async fn pg_commit_stores_exact_columns() {
    let db = pg().await;
    let rec = record(1);
    let mut tx = db.pool.begin().await.unwrap();
    let stored = tx.enqueue(&rec).await.unwrap();
    tx.commit().await.unwrap();

    assert_eq!(stored.id, rec.id);
    assert_eq!(stored.kind, OutboxRecordKind::EventPublish);
    assert_eq!(stored.state, OutboxMessageState::Pending);
    assert_eq!(stored.attempts, 0);
    assert_eq!(stored.created_at, stored.updated_at);

    type Row = (
        String,
        String,
        String,
        String,
        String,
        serde_json::Value,
        String,
        i32,
        DateTime<Utc>,
        DateTime<Utc>,
        Option<DateTime<Utc>>,
        Option<String>,
        Option<serde_json::Value>,
    );
    let row: Row = sqlx::query_as("SELECT id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at, next_attempt_at, last_error, outcome FROM trellis_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(row.0, rec.id);
    assert_eq!(row.1, "event.publish");
    assert_eq!(row.2, "Document.Processed");
    assert_eq!(row.3, "events.v1.Document.Processed");
    assert_eq!(row.4, r#"{"documentId":"doc-1"}"#);
    assert_eq!(
        row.5,
        json!({ "Nats-Msg-Id": rec.id, "Trellis-Event-Time": rec.headers["Trellis-Event-Time"] })
    );
    assert_eq!(row.6, "pending");
    assert_eq!(row.7, 0);
    assert_eq!(row.8, stored.created_at);
    assert_eq!(row.9, stored.created_at);
    assert_eq!(
        row.8.timestamp_subsec_nanos() % 1_000_000,
        0,
        "millisecond precision"
    );
    assert_eq!((row.10, row.11, row.12), (None, None, None));
    db.close().await;
}

#[tokio::test]
async fn sqlite_commit_stores_exact_columns() {
    let db = sqlite().await;
    let rec = record(1);
    let mut tx = db.pool.begin().await.unwrap();
    let stored = tx.enqueue(&rec).await.unwrap();
    tx.commit().await.unwrap();

    type Row = (
        String,
        String,
        String,
        String,
        String,
        String,
        String,
        i64,
        String,
        String,
        Option<String>,
        Option<String>,
        Option<String>,
    );
    let row: Row = sqlx::query_as("SELECT id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at, next_attempt_at, last_error, outcome FROM trellis_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(row.0, rec.id);
    assert_eq!(row.1, "event.publish");
    assert_eq!(row.2, "Document.Processed");
    assert_eq!(row.3, "events.v1.Document.Processed");
    assert_eq!(row.4, r#"{"documentId":"doc-1"}"#);
    let headers: BTreeMap<String, String> = serde_json::from_str(&row.5).unwrap();
    assert_eq!(headers, rec.headers);
    assert!(
        row.5.starts_with("{\"Nats-Msg-Id\":"),
        "a JSON object of strings: {}",
        row.5
    );
    assert_eq!(row.6, "pending");
    assert_eq!(row.7, 0);
    assert!(is_iso_millis(&row.8), "created_at {:?}", row.8);
    assert_eq!(row.8, trellis_outbox::format_timestamp(stored.created_at));
    assert_eq!(row.9, row.8);
    assert_eq!((row.10, row.11, row.12), (None, None, None));
}

#[tokio::test]
async fn pg_rollback_leaves_no_row() {
    let db = pg().await;
    let mut tx = db.pool.begin().await.unwrap();
    tx.enqueue(&record(1)).await.unwrap();
    tx.rollback().await.unwrap();
    {
        // Dropping an open transaction rolls back too.
        let mut tx = db.pool.begin().await.unwrap();
        tx.enqueue(&record(2)).await.unwrap();
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
    db.close().await;
}

#[tokio::test]
async fn sqlite_rollback_leaves_no_row() {
    let db = sqlite().await;
    let mut tx = db.pool.begin().await.unwrap();
    tx.enqueue(&record(1)).await.unwrap();
    tx.rollback().await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
}

fn same_id_other_payload(first: &PreparedOutboxRecord) -> PreparedOutboxRecord {
    let mut second = record(99);
    second.id = first.id.clone();
    second.name = "Other.Name".into();
    second
}

const DUPLICATE_TEXT: &str = "already exists with different immutable content";

/// The same event prepared again by a retried handler: same id and content, a new event time.
fn retried(first: &PreparedOutboxRecord) -> PreparedOutboxRecord {
    let mut again = first.clone();
    again.headers.insert(
        "Trellis-Event-Time".into(),
        "2031-02-03T04:05:06.789Z".into(),
    );
    again
}

fn assert_duplicate_identity(err: &Error, id: &str) {
    assert_eq!(
        err.to_string(),
        format!("Outbox message '{id}' {DUPLICATE_TEXT}"),
        "upstream's exact text"
    );
    assert!(
        matches!(err, Error::DuplicateIdentity { id: i, fields } if i == id && fields.contains(&"name")),
        "{err:?}"
    );
    assert!(!err.is_retryable());
}

#[tokio::test]
async fn pg_duplicate_id_with_other_content_is_refused_and_keeps_the_first_row() {
    let db = pg().await;
    let first = record(1);
    let mut tx = db.pool.begin().await.unwrap();
    let a = tx.enqueue(&first).await.unwrap();
    tx.commit().await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    let err = tx
        .enqueue(&same_id_other_payload(&first))
        .await
        .unwrap_err();
    assert_duplicate_identity(&err, &first.id);
    // Identical content, or only a new event time: idempotent, the stored row is returned.
    assert_eq!(tx.enqueue(&first).await.unwrap(), a);
    assert_eq!(tx.enqueue(&retried(&first)).await.unwrap(), a);
    tx.commit().await.unwrap();

    let rows: Vec<(String, String)> = sqlx::query_as("SELECT name, payload FROM trellis_outbox")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        rows,
        [(
            "Document.Processed".to_owned(),
            r#"{"documentId":"doc-1"}"#.to_owned()
        )]
    );
    db.close().await;
}

#[tokio::test]
async fn sqlite_duplicate_id_with_other_content_is_refused_and_keeps_the_first_row() {
    let db = sqlite().await;
    let first = record(1);
    let mut tx = db.pool.begin().await.unwrap();
    let a = tx.enqueue(&first).await.unwrap();
    // Within the same transaction too.
    let err = tx
        .enqueue(&same_id_other_payload(&first))
        .await
        .unwrap_err();
    assert_duplicate_identity(&err, &first.id);
    let mut other_payload = first.clone();
    other_payload.payload = r#"{"documentId":"doc-2"}"#.into();
    let err = tx.enqueue(&other_payload).await.unwrap_err();
    assert!(
        matches!(&err, Error::DuplicateIdentity { fields, .. } if fields == &["payload"]),
        "{err:?}"
    );
    assert_eq!(tx.enqueue(&first).await.unwrap(), a);
    assert_eq!(tx.enqueue(&retried(&first)).await.unwrap(), a);
    tx.commit().await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
}

#[tokio::test]
async fn pg_enqueue_all_writes_1000_records_in_order() {
    let db = pg().await;
    let records: Vec<_> = (0..1000).map(record).collect();
    let mut tx = db.pool.begin().await.unwrap();
    let stored = tx.enqueue_all(&records).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(stored.len(), 1000);
    assert!(
        stored
            .iter()
            .zip(&records)
            .all(|(s, r)| s.id == r.id && s.payload == r.payload)
    );
    let ids: Vec<String> =
        sqlx::query_scalar("SELECT id FROM trellis_outbox ORDER BY created_at, id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let expected: Vec<String> = records.iter().map(|r| r.id.clone()).collect();
    assert_eq!(
        ids, expected,
        "ULIDs keep enqueue order within a millisecond"
    );
    let headers: serde_json::Value =
        sqlx::query_scalar("SELECT headers FROM trellis_outbox WHERE id = $1")
            .bind(&records[500].id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(headers["Nats-Msg-Id"], records[500].id);
    db.close().await;
}

#[tokio::test]
async fn sqlite_enqueue_all_writes_2500_records_across_batches() {
    let db = sqlite().await;
    let records: Vec<_> = (0..2500).map(record).collect();
    let mut tx = db.pool.begin().await.unwrap();
    let stored = tx.enqueue_all(records.iter()).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(stored.len(), 2500);
    let ids: Vec<String> =
        sqlx::query_scalar("SELECT id FROM trellis_outbox ORDER BY created_at, id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let expected: Vec<String> = records.iter().map(|r| r.id.clone()).collect();
    assert_eq!(ids, expected);
}

async fn check_enqueue_all_with_duplicates<DB: trellis_outbox::OutboxDatabase>(
    pool: &sqlx::Pool<DB>,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let existing = record(0);
    let mut tx = pool.begin().await.unwrap();
    let stored_existing = tx.enqueue(&existing).await.unwrap();
    tx.commit().await.unwrap();

    let fresh = record(1);
    let batch = vec![
        retried(&existing), // already stored, only the event time differs
        fresh.clone(),
        fresh.clone(), // repeats within the batch
    ];
    let mut tx = pool.begin().await.unwrap();
    let stored = tx.enqueue_all(batch).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(stored.len(), 3);
    assert_eq!(stored[0], stored_existing);
    assert_eq!(stored[1].payload, fresh.payload);
    assert_eq!(stored[2], stored[1], "the first occurrence wins");
    assert_eq!(stored[2].name, "Document.Processed");

    // Other content under a stored id, or under an id repeated within the batch: refused.
    for batch in [vec![record(5), same_id_other_payload(&existing)], {
        let repeated = record(6);
        vec![repeated.clone(), same_id_other_payload(&repeated)]
    }] {
        let id = batch[1].id.clone();
        let mut tx = pool.begin().await.unwrap();
        let err = tx.enqueue_all(batch).await.unwrap_err();
        assert_duplicate_identity(&err, &id);
        tx.rollback().await.unwrap();
    }
}

#[tokio::test]
async fn pg_enqueue_all_returns_stored_rows_for_duplicates() {
    let db = pg().await;
    check_enqueue_all_with_duplicates(&db.pool).await;
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 2);
    db.close().await;
}

#[tokio::test]
async fn sqlite_enqueue_all_returns_stored_rows_for_duplicates() {
    let db = sqlite().await;
    check_enqueue_all_with_duplicates(&db.pool).await;
}

#[tokio::test]
async fn pg_custom_tables() {
    let db = TestPg::new().await;
    let outbox = Outbox::new(OutboxTables::new("billing_outbox", "billing_inbox").unwrap());
    migrate_with(&db.pool, outbox.tables()).await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let rec = record(1);
    outbox.enqueue(&mut tx, &rec).await.unwrap();
    outbox
        .enqueue_all(&mut tx, [record(2), record(3)])
        .await
        .unwrap();
    assert!(
        outbox
            .record_inbox(&mut tx, "m-1")
            .await
            .unwrap()
            .is_accepted()
    );
    tx.commit().await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM billing_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 3);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM billing_inbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
    // The default tables were never created, let alone written.
    let default_exists: bool =
        sqlx::query_scalar("SELECT to_regclass('trellis_outbox') IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(!default_exists);
    db.close().await;
}

#[tokio::test]
async fn sqlite_custom_tables() {
    let db = TestSqlite::new().await;
    let outbox = Outbox::new(OutboxTables::new("billing_outbox", "billing_inbox").unwrap());
    migrate_with(&db.pool, outbox.tables()).await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    outbox.enqueue(&mut tx, &record(1)).await.unwrap();
    tx.commit().await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM billing_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
}

fn invalid_records() -> Vec<(PreparedOutboxRecord, &'static str)> {
    let base = record(1);
    let mut out = Vec::new();
    let mut r = base.clone();
    r.id.clear();
    out.push((r, "id"));
    let mut r = base.clone();
    r.name.clear();
    out.push((r, "name"));
    let mut r = base.clone();
    r.subject = "events.v1. Bad".into();
    out.push((r, "subject"));
    let mut r = base.clone();
    r.subject = "events..v1".into();
    out.push((r, "subject"));
    let mut r = base.clone();
    r.subject = "events.v1.>".into();
    out.push((r, "subject"));
    let mut r = base.clone();
    r.payload = "{not json".into();
    out.push((r, "payload"));
    let mut r = base.clone();
    r.headers.insert("Bad Header".into(), "x".into());
    out.push((r, "headers"));
    let mut r = base.clone();
    r.headers.insert("X-Ok".into(), "line\nbreak".into());
    out.push((r, "headers"));
    let mut r = base.clone();
    r.headers
        .insert("X-Ok".into(), "a\r\nNats-Rollup: all".into());
    out.push((r, "headers"));
    let mut r = base.clone();
    r.id = "01ID\r\nNats-Rollup: all".into();
    out.push((r, "id"));
    // Other control characters in values (tab is allowed).
    for value in ["a\0b", "\u{1b}[2J", "a\u{7f}"] {
        let mut r = base.clone();
        r.headers.insert("X-Ok".into(), value.into());
        out.push((r, "headers"));
    }
    // Subjects reaching the server's control plane.
    for subject in [
        "$JS.API.STREAM.DELETE.x",
        "$KV.config.key",
        "$SYS.REQ.SERVER.PING",
        "$O.store.x",
        "_INBOX.abc",
    ] {
        let mut r = base.clone();
        r.subject = subject.into();
        out.push((r, "subject"));
    }
    // Job records are checked the same way.
    let mut r = base.clone();
    r.kind = OutboxRecordKind::JobSubmit;
    r.subject = "$JS.API.STREAM.PURGE.jobs".into();
    out.push((r, "subject"));
    // NATS control headers, in any letter case.
    for name in [
        "Nats-Rollup",
        "nats-expected-stream",
        "Nats-Expected-Last-Sequence",
        "Nats-TTL",
        "Nats-Marker-Reason",
    ] {
        let mut r = base.clone();
        r.headers.insert(name.into(), "all".into());
        out.push((r, "headers"));
    }
    out
}

async fn check_invalid_input_keeps_tx_usable<DB: trellis_outbox::OutboxDatabase>(
    pool: &sqlx::Pool<DB>,
) {
    let mut tx = pool.begin().await.unwrap();
    for (bad, field) in invalid_records() {
        let err = tx.enqueue(&bad).await.unwrap_err();
        assert!(
            matches!(&err, Error::InvalidRecord { field: f, .. } if *f == field),
            "{err:?} should name {field}"
        );
        if field == "subject" && bad.subject.starts_with(['$', '_']) {
            assert!(err.to_string().contains(&bad.subject[..2]), "{err}");
        }
        assert!(!err.is_retryable());
        // One bad record in a batch rejects the whole batch before any SQL.
        let err = tx.enqueue_all([record(7), bad]).await.unwrap_err();
        assert!(matches!(err, Error::InvalidRecord { .. }));
    }
    let err = tx.record_inbox("").await.unwrap_err();
    assert!(matches!(err, Error::InvalidMessageId { .. }), "{err:?}");
    // The transaction is still usable.
    tx.enqueue(&record(2)).await.unwrap();
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn pg_invalid_input_is_rejected_before_sql() {
    let db = pg().await;
    check_invalid_input_keeps_tx_usable(&db.pool).await;
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 1, "only the valid record was written");
    db.close().await;
}

#[tokio::test]
async fn sqlite_invalid_input_is_rejected_before_sql() {
    let db = sqlite().await;
    check_invalid_input_keeps_tx_usable(&db.pool).await;
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
}

#[tokio::test]
async fn pg_enqueue_without_migration_names_the_operation() {
    let db = TestPg::new().await;
    let rec = record(1);
    let mut tx = db.pool.begin().await.unwrap();
    let err = tx.enqueue(&rec).await.unwrap_err();
    assert!(
        matches!(&err, Error::Enqueue { id, .. } if *id == rec.id),
        "{err:?}"
    );
    assert!(err.to_string().contains("enqueueing outbox record"));
    assert!(std::error::Error::source(&err).is_some());
    drop(tx);
    db.close().await;
}

// §G 16: the Postgres SQL uses numbered placeholders, never `?`.
#[test]
fn postgres_statements_use_numbered_placeholders() {
    let outbox = Outbox::default();
    let pg = outbox.sql(trellis_outbox::Dialect::Postgres);
    for sql in [pg.enqueue(), pg.select_by_id(), pg.inbox_insert()] {
        assert!(!sql.contains('?'), "{sql}");
    }
    assert!(pg.enqueue().contains("$11") && pg.enqueue().contains("$13"));
    // Upstream's statement, wrapped to notify the dispatcher ($14) when a row is inserted.
    assert!(pg.enqueue().contains(
        "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at, next_attempt_at, last_error, outcome) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) ON CONFLICT (id) DO NOTHING"
    ));
    assert!(pg.enqueue().contains("pg_notify($14, '')"));
    assert_eq!(pg.notify_channel(), "trellis_outbox_wakeup");
    let sqlite = outbox.sql(trellis_outbox::Dialect::Sqlite);
    assert_eq!(
        sqlite.enqueue(),
        "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at, next_attempt_at, last_error, outcome) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO NOTHING"
    );
    assert_eq!(
        sqlite.inbox_insert(),
        "INSERT INTO trellis_inbox (message_id, received_at) VALUES (?, ?) ON CONFLICT(message_id) DO NOTHING"
    );
}

/// `tx.enqueue(…)` and the other [`OutboxTransactionExt`] methods can be awaited in spawned
/// tasks: their futures are `Send` for concrete transactions and in code generic over the
/// database. Checked by the compiler: this test does not build if one is not.
#[tokio::test]
async fn transaction_futures_are_send() {
    fn spawnable<F: std::future::Future + Send>(future: F) -> F {
        future
    }
    async fn generic<DB: trellis_outbox::OutboxDatabase>(
        tx: &mut sqlx::Transaction<'_, DB>,
        record: &PreparedOutboxRecord,
    ) -> trellis_outbox::Result<()> {
        spawnable(tx.enqueue(record)).await?;
        spawnable(tx.enqueue_all([record.clone()])).await?;
        spawnable(tx.record_inbox("message-1")).await?;
        Ok(())
    }
    async fn concrete(
        pool: sqlx::PgPool,
        record: PreparedOutboxRecord,
    ) -> trellis_outbox::Result<()> {
        let mut tx = pool.begin().await.map_err(|e| Error::Repository {
            operation: "begin",
            source: e,
        })?;
        spawnable(tx.enqueue(&record)).await?;
        spawnable(generic(&mut tx, &record)).await?;
        Ok(())
    }
    let pool = sqlx::PgPool::connect_lazy("postgres://localhost/unused").unwrap();
    // Built, never polled: the assertion is the bound.
    drop(spawnable(concrete(pool, record(1))));
}
