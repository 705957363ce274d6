//! Feature `trellis-participant` (issue #12): stored event rows are handed to upstream's
//! `trellis-rs` as prepared events. What this checks is that rows as our enqueue stores them
//! (SQLite round trip) pass upstream's own `PreparedTrellisEvent::restore` — descriptor
//! identity, current-wire subject, ULID id, RFC 3339 event time — keep their id, time and
//! trace headers, and that rows upstream would refuse are refused here as poison (not
//! retried). Signing and publishing need a connected, authorized `TrellisClient` (a Trellis
//! auth service), which this machine does not have: that step is not tested here.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::time::Duration;

use serde::Serialize;
use trellis_outbox::{
    OutboxEvent, OutboxMessage, OutboxRepository, OutboxTransactionExt, ParticipantError,
    PreparedOutboxRecord, PublishError, SqliteOutboxRepository, TRELLIS_EVENT_DESCRIPTOR,
    ToOutboxRecord, TraceContext, migrate, outbox_job, prepared_event, trellis_event_subject,
};
use trellis_outbox_tests::TestSqlite;

/// A parameterless event on the current wire: `events.v1.<base64url("orders@v1")>.<name>`.
#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(
    name = "Orders.Reindexed",
    subject = "events.v1.b3JkZXJzQHYx.Orders.Reindexed",
    api = "orders@v1"
)]
struct Reindexed {
    shards: u32,
}

/// The same event on a 0.11.0-rc.1-style subject, which current consumers refuse.
#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(
    name = "Orders.Reindexed",
    subject = "events.v1.Orders.Reindexed",
    api = "orders@v1"
)]
struct OldWire {
    shards: u32,
}

/// A derived event on the current wire with placeholders: its parameters are base64url.
#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(
    name = "Orders.Created",
    subject = "events.v1.b3JkZXJzQHYx.Orders.Created.{order}.{tenant}",
    api = "orders@v1"
)]
struct Created {
    order: String,
    tenant: String,
}

/// A job row: not a Trellis event.
#[outbox_job(queue = "reindex", service = "orders", job_type = "reindex")]
#[derive(Serialize)]
struct Reindex {
    shard: u32,
}

/// Enqueues `records` into a fresh SQLite outbox and claims them back as stored.
async fn stored(records: Vec<PreparedOutboxRecord>) -> (TestSqlite, Vec<OutboxMessage>) {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    tx.enqueue_all(&records).await.unwrap();
    tx.commit().await.unwrap();
    let repo = SqliteOutboxRepository::new(db.pool.clone());
    let mut messages = repo
        .claim_due(100, Duration::from_secs(30), None)
        .await
        .unwrap()
        .messages;
    let order: Vec<&str> = records.iter().map(|r| r.id.as_str()).collect();
    messages.sort_by_key(|m| order.iter().position(|id| *id == m.id));
    (db, messages)
}

#[tokio::test]
async fn stored_event_rows_pass_upstreams_restore() {
    let trace = TraceContext::new(
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        Some("vendor=1".to_owned()),
    );
    let derived = trace
        .scope(async { Reindexed { shards: 4 }.to_outbox_record() })
        .await
        .unwrap();
    let mut parameterized = PreparedOutboxRecord::event(
        "Orders.Created",
        trellis_event_subject("orders@v1", "Orders.Created", &["o-1", "tenant.a"]),
        &serde_json::json!({"order": "o-1"}),
    )
    .unwrap()
    .with_event_descriptor("orders@v1", 2)
    .unwrap();
    parameterized
        .headers
        .insert("app-header".to_owned(), "kept".to_owned());
    let created = Created {
        order: "o-2".into(),
        tenant: "tenant.b".into(),
    }
    .to_outbox_record()
    .unwrap();
    let (_db, rows) = stored(vec![derived, parameterized, created]).await;
    assert_eq!(rows.len(), 3);

    for row in &rows {
        let event = prepared_event(row).unwrap_or_else(|e| panic!("{}: {e:?}", row.id));
        assert_eq!(event.event_id(), row.id, "the row id is the event id");
        assert_eq!(event.subject(), row.subject);
        assert_eq!(event.payload(), row.payload.as_bytes());
        assert_eq!(
            event.event_time(),
            row.headers["Trellis-Event-Time"],
            "the enqueue time is kept, not replaced by the dispatch time"
        );
        assert_eq!(
            event.descriptor_identity(),
            row.headers[TRELLIS_EVENT_DESCRIPTOR]
        );
        let headers = event.publish_headers();
        assert_eq!(
            headers.get("Nats-Msg-Id").map(|v| v.as_str()),
            Some(row.id.as_str())
        );
    }
    assert_eq!(
        rows[0].headers[TRELLIS_EVENT_DESCRIPTOR],
        "v1.b3JkZXJzQHYx.T3JkZXJzLlJlaW5kZXhlZA.0"
    );
    let derived = prepared_event(&rows[0]).unwrap().publish_headers();
    assert_eq!(
        derived.get("traceparent").map(|v| v.as_str()),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    assert_eq!(
        derived.get("tracestate").map(|v| v.as_str()),
        Some("vendor=1")
    );
    let parameterized = prepared_event(&rows[1]).unwrap();
    assert_eq!(
        parameterized.subject(),
        "events.v1.b3JkZXJzQHYx.Orders.Created.by0x.dGVuYW50LmE"
    );
    assert_eq!(
        parameterized
            .publish_headers()
            .get("app-header")
            .map(|v| v.as_str()),
        Some("kept")
    );

    // Headers upstream sets itself, stored in another letter case, are not sent twice
    // (upstream's header map is case-sensitive): the row id stays the only `Nats-Msg-Id`.
    let mut edited = rows[1].clone();
    for (name, value) in [
        ("nats-msg-id", "stale-id"),
        ("trellis-event-time", "2020-01-01T00:00:00Z"),
        ("PROOF", "forged"),
    ] {
        edited.headers.insert(name.to_owned(), value.to_owned());
    }
    let headers = prepared_event(&edited).unwrap().publish_headers();
    for (name, expected) in [
        ("Nats-Msg-Id", Some(edited.id.as_str())),
        (
            "Trellis-Event-Time",
            Some(edited.headers["Trellis-Event-Time"].as_str()),
        ),
        ("proof", None),
    ] {
        let values: Vec<&str> = headers
            .iter()
            .filter(|(n, _)| n.to_string().eq_ignore_ascii_case(name))
            .flat_map(|(_, values)| values.iter().map(|v| v.as_str()))
            .collect();
        assert_eq!(values, Vec::from_iter(expected), "{name}");
    }
    assert_eq!(headers.get("app-header").map(|v| v.as_str()), Some("kept"));

    // A message edited by hand (or read from a table another writer filled) with a header
    // NATS cannot carry is an error naming it, not a panic inside the header map.
    for (name, value, expected) in [
        ("bad name", "x", "printable ASCII"),
        ("app-header", "two\r\nlines", "app-header"),
        ("Nats-Rollup", "all", "control header"),
    ] {
        let mut edited = rows[1].clone();
        edited.headers.insert(name.to_owned(), value.to_owned());
        let text = permanent(prepared_event(&edited).unwrap_err());
        assert!(
            text.contains(&edited.id)
                && text.contains("cannot be published")
                && text.contains(expected),
            "{name}: {text}"
        );
    }
}

/// The error's text, after checking that neither it nor the dispatcher's view of it is
/// retryable (the row goes dead with the reason instead of being retried).
fn permanent(err: ParticipantError) -> String {
    assert!(!err.is_retryable(), "{err} must not be retried");
    let text = err.to_string();
    let publish: PublishError = err.into();
    assert!(!publish.is_retryable(), "{text}");
    text
}

#[tokio::test]
async fn rows_upstream_would_refuse_are_poison_with_the_reason() {
    let old_wire = OldWire { shards: 1 }.to_outbox_record().unwrap();
    let wrong_count = PreparedOutboxRecord::event(
        "Orders.Created",
        trellis_event_subject("orders@v1", "Orders.Created", &["o-1"]),
        &serde_json::json!({}),
    )
    .unwrap()
    .with_event_descriptor("orders@v1", 2)
    .unwrap();
    let no_descriptor = PreparedOutboxRecord::event(
        "Orders.Created",
        trellis_event_subject("orders@v1", "Orders.Created", &[]),
        &serde_json::json!({}),
    )
    .unwrap();
    // Upstream's event ids are ULIDs; an application-chosen id is refused by its restore.
    let mut custom_id = PreparedOutboxRecord::event(
        "Orders.Reindexed",
        "events.v1.b3JkZXJzQHYx.Orders.Reindexed",
        &serde_json::json!({}),
    )
    .unwrap()
    .with_event_descriptor("orders@v1", 0)
    .unwrap();
    custom_id.id = "order-7-reindexed".to_owned();
    custom_id
        .headers
        .insert("Nats-Msg-Id".to_owned(), custom_id.id.clone());
    let job = Reindex { shard: 3 }.to_outbox_record().unwrap();
    let (_db, rows) = stored(vec![old_wire, wrong_count, no_descriptor, custom_id, job]).await;
    assert_eq!(rows.len(), 5);

    for (row, expected) in rows.iter().zip([
        "is not a valid Trellis event",
        "is not a valid Trellis event",
        "has no Trellis-Event-Descriptor header",
        "is not a valid Trellis event",
        "only event.publish rows are Trellis events",
    ]) {
        let text = permanent(prepared_event(row).unwrap_err());
        assert!(
            text.contains(&row.id) && text.contains(expected),
            "{}: {text}",
            row.id
        );
    }
    // Upstream's reason is carried as the source, so it reaches `last_error`.
    let err: PublishError = prepared_event(&rows[0]).unwrap_err().into();
    assert!(
        err.chain()
            .contains("must match the signed event descriptor identity"),
        "{}",
        err.chain()
    );
}
