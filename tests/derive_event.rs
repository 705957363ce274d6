//! Runtime behaviour of `#[derive(OutboxEvent)]`: subjects, payload, headers, ids, and
//! `tx.enqueue(&event)` end to end on Postgres and SQLite.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use chrono::{DateTime, Utc};
use trellis_outbox::{
    OutboxEvent, OutboxRecordKind, OutboxTransactionExt, ToOutboxRecord, TraceContext, migrate,
};
use trellis_outbox_tests::{TestPg, TestSqlite};

#[derive(serde::Serialize, OutboxEvent)]
#[serde(rename_all = "camelCase")]
#[outbox(
    name = "Orders.Shipped",
    subject = "events.v1.Orders.Shipped.{order_id}"
)]
struct OrderShipped {
    order_id: String,
    carrier: String,
}

fn shipped(order_id: &str) -> OrderShipped {
    OrderShipped {
        order_id: order_id.into(),
        carrier: "ups".into(),
    }
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(
    name = "Invoices.Paid",
    subject = "events.v1.{tenant}.Invoices.Paid.{invoice}"
)]
struct InvoicePaid {
    #[outbox(id)]
    event_id: EventId,
    tenant: String,
    invoice: u64,
    #[serde(skip)]
    #[allow(dead_code)]
    internal: NotSerializable,
}

#[derive(Default)]
struct NotSerializable;

/// An id type rendered with `Display`.
#[derive(Clone, Copy, serde::Serialize)]
struct EventId(u128);

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", ulid::Ulid(self.0))
    }
}

/// A token type with its own `Display`.
struct Region(&'static str);

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "region:{}", self.0)
    }
}

impl serde::Serialize for Region {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0)
    }
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(
    name = "Regions.Opened",
    subject = "events.v1.Regions.Opened.{region}.{r#type}"
)]
struct RegionOpened {
    region: Region,
    r#type: char,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(name = "Docs.Tagged", subject = "events.v1.Docs.Tagged.{doc}")]
struct DocTagged<'a, T> {
    doc: &'a str,
    tags: Vec<T>,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(name = "Health.Ping", subject = "events.v1.Health.Ping")]
struct Ping {}

fn is_iso_millis(text: &str) -> bool {
    let b = text.as_bytes();
    b.len() == 24
        && text.ends_with('Z')
        && b[10] == b'T'
        && b[19] == b'.'
        && text.parse::<DateTime<Utc>>().is_ok()
}

#[test]
fn constants() {
    assert_eq!(OrderShipped::OUTBOX_NAME, "Orders.Shipped");
    assert_eq!(
        OrderShipped::OUTBOX_SUBJECT,
        "events.v1.Orders.Shipped.{order_id}"
    );
    assert_eq!(<OrderShipped as OutboxEvent>::NAME, "Orders.Shipped");
    assert_eq!(
        <OrderShipped as OutboxEvent>::SUBJECT_TEMPLATE,
        OrderShipped::OUTBOX_SUBJECT
    );
    assert_eq!(Ping::OUTBOX_SUBJECT, "events.v1.Health.Ping");
}

#[test]
fn subjects_escape_values_like_trellis() {
    let cases = [
        ("o-42", "o-42"),
        ("a.b", "a~2E~b"),
        ("a b", "a~20~b"),
        ("*", "~2A~"),
        (">", "~3E~"),
        ("~", "~7E~"),
        ("", "_"),
        ("$x", "_$x"),
        ("x$", "x$"),
        ("a\0b", "a~0~b"),
        ("tab\there", "tab~9~here"),
        ("ünïcødé", "ünïcødé"),
        ("日本", "日本"),
        ("\u{3000}", "~3000~"),
        ("a.b.>", "a~2E~b~2E~~3E~"),
    ];
    for (value, token) in cases {
        assert_eq!(
            shipped(value).subject(),
            format!("events.v1.Orders.Shipped.{token}"),
            "value {value:?}"
        );
        // Every rendered subject is accepted by the outbox's own validation.
        shipped(value)
            .to_outbox_record()
            .unwrap()
            .validate()
            .unwrap();
    }
}

#[test]
fn placeholders_use_display_and_raw_identifiers() {
    let event = RegionOpened {
        region: Region("eu west"),
        r#type: '*',
    };
    assert_eq!(
        event.subject(),
        "events.v1.Regions.Opened.region:eu~20~west.~2A~"
    );
    assert_eq!(
        event.to_outbox_record().unwrap().payload,
        r#"{"region":"eu west","type":"*"}"#
    );
}

#[test]
fn generic_events() {
    let event = DocTagged {
        doc: "d.1",
        tags: vec![1, 2],
    };
    assert_eq!(event.subject(), "events.v1.Docs.Tagged.d~2E~1");
    let record = event.to_outbox_record().unwrap();
    assert_eq!(record.payload, r#"{"doc":"d.1","tags":[1,2]}"#);
}

#[test]
fn record_is_an_event_publish_with_trellis_headers() {
    let record = shipped("o-1").to_outbox_record().unwrap();
    assert_eq!(record.kind, OutboxRecordKind::EventPublish);
    assert_eq!(record.name, "Orders.Shipped");
    assert_eq!(record.subject, "events.v1.Orders.Shipped.o-1");
    assert_eq!(record.payload, r#"{"orderId":"o-1","carrier":"ups"}"#);
    assert_eq!(record.id.len(), 26);
    assert!(ulid::Ulid::from_string(&record.id).is_ok());
    let names: Vec<&str> = record.headers.keys().map(String::as_str).collect();
    assert_eq!(names, ["Nats-Msg-Id", "Trellis-Event-Time"]);
    assert_eq!(record.headers["Nats-Msg-Id"], record.id);
    assert!(is_iso_millis(&record.headers["Trellis-Event-Time"]));
    record.validate().unwrap();
}

#[test]
fn ids_are_new_unique_ulids() {
    let event = shipped("o-1");
    let ids: HashSet<String> = (0..1000)
        .map(|_| event.to_outbox_record().unwrap().id)
        .collect();
    assert_eq!(ids.len(), 1000);
}

#[test]
fn id_field_is_honoured() {
    let event_id = EventId(ulid::Ulid::generate().0);
    let event = InvoicePaid {
        event_id,
        tenant: "acme".into(),
        invoice: 7,
        internal: NotSerializable,
    };
    assert_eq!(event.event_id(), Some(event_id.to_string()));
    let a = event.to_outbox_record().unwrap();
    let b = event.to_outbox_record().unwrap();
    assert_eq!(a.id, event_id.to_string());
    assert_eq!(a.headers["Nats-Msg-Id"], a.id);
    assert_eq!(a.id, b.id);
    assert_eq!(a.subject, "events.v1.acme.Invoices.Paid.7");
    assert_eq!(
        a.payload,
        format!(
            r#"{{"event_id":{},"tenant":"acme","invoice":7}}"#,
            event_id.0
        )
    );
}

#[test]
fn trace_headers_come_from_the_current_context() {
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let record = TraceContext::new(parent, Some("congo=t61rcWkgMzE".into()))
        .sync_scope(|| shipped("o-1").to_outbox_record())
        .unwrap();
    let expected: BTreeMap<&str, &str> = [
        ("Nats-Msg-Id", record.id.as_str()),
        (
            "Trellis-Event-Time",
            record.headers["Trellis-Event-Time"].as_str(),
        ),
        ("traceparent", parent),
        ("tracestate", "congo=t61rcWkgMzE"),
    ]
    .into();
    let actual: BTreeMap<&str, &str> = record
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(actual, expected);

    // An invalid current context adds nothing.
    let record = TraceContext::new("00-zz-00-01", Some("x=1".into()))
        .sync_scope(|| shipped("o-1").to_outbox_record())
        .unwrap();
    assert!(!record.headers.contains_key("traceparent"));
    assert!(!record.headers.contains_key("tracestate"));
}

#[tokio::test]
async fn trace_scope_covers_async_handlers() {
    let context = TraceContext::random();
    let record = context
        .clone()
        .scope(async {
            tokio::task::yield_now().await;
            shipped("o-1").to_outbox_record()
        })
        .await
        .unwrap();
    assert_eq!(record.headers["traceparent"], context.traceparent());
}

#[tokio::test]
async fn enqueue_on_postgres() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let event = shipped("o.1");
    let mut tx = db.pool.begin().await.unwrap();
    let stored = tx.enqueue(&event).await.unwrap();
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
    assert_eq!(id, stored.id);
    assert_eq!(kind, "event.publish");
    assert_eq!(name, "Orders.Shipped");
    assert_eq!(subject, "events.v1.Orders.Shipped.o~2E~1");
    assert_eq!(payload, r#"{"orderId":"o.1","carrier":"ups"}"#);
    assert_eq!(headers["Nats-Msg-Id"], id.as_str());
    assert_eq!(serde_json::to_value(&stored.headers).unwrap(), headers);

    // An `#[outbox(id)]` event is stored once however often it is enqueued.
    let paid = InvoicePaid {
        event_id: EventId(ulid::Ulid::generate().0),
        tenant: "acme".into(),
        invoice: 1,
        internal: NotSerializable,
    };
    let mut tx = db.pool.begin().await.unwrap();
    let first = tx.enqueue(&paid).await.unwrap();
    let second = tx.enqueue(&paid).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(first.id, second.id);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_outbox WHERE id = $1")
        .bind(&first.id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
    db.close().await;
}

#[tokio::test]
async fn enqueue_on_sqlite() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let stored = tx.enqueue(&shipped("$sys")).await.unwrap();
    let ping = tx.enqueue(&Ping {}).await.unwrap();
    tx.commit().await.unwrap();

    let rows: Vec<(String, String, String, String, String, String)> = sqlx::query_as(
        "SELECT id, kind, name, subject, payload, headers FROM trellis_outbox ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 2);
    let (id, kind, name, subject, payload, headers) = &rows[0];
    assert_eq!(id, &stored.id);
    assert_eq!(kind, "event.publish");
    assert_eq!(name, "Orders.Shipped");
    assert_eq!(subject, "events.v1.Orders.Shipped._$sys");
    assert_eq!(payload, r#"{"orderId":"$sys","carrier":"ups"}"#);
    let headers: BTreeMap<String, String> = serde_json::from_str(headers).unwrap();
    assert_eq!(headers, stored.headers);
    assert_eq!(rows[1].0, ping.id);
    assert_eq!(rows[1].3, "events.v1.Health.Ping");
    assert_eq!(rows[1].4, "{}");
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(
    name = "Documents.Changed",
    subject = "events.v1.ZG9jdW1lbnRzQHYx.Documents.Changed.{id}",
    api = "documents@v1"
)]
struct DocumentChanged {
    id: String,
}

/// `api = "…"` adds the `Trellis-Event-Descriptor` header, computed at compile time with one
/// parameter per subject placeholder, the same as the runtime function; events without it
/// send no descriptor.
#[test]
fn api_adds_the_descriptor_header() {
    let expected = "v1.ZG9jdW1lbnRzQHYx.RG9jdW1lbnRzLkNoYW5nZWQ.1";
    assert_eq!(DocumentChanged::OUTBOX_DESCRIPTOR, expected);
    assert_eq!(
        trellis_outbox::event_descriptor_identity("documents@v1", "Documents.Changed", 1).unwrap(),
        expected
    );
    let record = DocumentChanged { id: "doc-1".into() }
        .to_outbox_record()
        .unwrap();
    assert_eq!(
        record
            .headers
            .get(trellis_outbox::TRELLIS_EVENT_DESCRIPTOR)
            .map(String::as_str),
        Some(expected)
    );
    record.validate().unwrap();
    // On the current wire its placeholder is an event parameter (base64url), as upstream
    // builds it and `TrellisParticipantPublisher` checks it.
    assert_eq!(
        record.subject,
        trellis_outbox::trellis_event_subject("documents@v1", "Documents.Changed", &["doc-1"])
    );
    assert_eq!(
        record.subject,
        "events.v1.ZG9jdW1lbnRzQHYx.Documents.Changed.ZG9jLTE"
    );
    let plain = shipped("o-1").to_outbox_record().unwrap();
    assert!(!plain.headers.contains_key("Trellis-Event-Descriptor"));
}
