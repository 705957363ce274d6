//! Feature `opentelemetry` (issue #14): one trace runs from the handler that enqueued an
//! event, through the outbox, to the consumer that applied it. Spans are exported to
//! OpenTelemetry's in-memory exporter through tracing-opentelemetry.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::time::Duration;

use async_nats::jetstream::consumer::AckPolicy;
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::stream::Config;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, Transaction};
use tracing::Instrument as _;
use tracing_subscriber::layer::SubscriberExt as _;
use trellis_outbox::{
    Consumer, Delivered, DispatchOptions, JetStreamPublisher, OutboxEvent, OutboxTransactionExt,
    SqliteOutboxRepository, dispatch_outbox, handler_fn, migrate, use_opentelemetry_trace_context,
};
use trellis_outbox_tests::TestSqlite;
use trellis_outbox_tests::nats::jetstream;

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(name = "Orders.Traced", subject = "ttracedotel.orders.{order}")]
struct Traced {
    order: String,
}

fn span<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
    spans.iter().find(|s| s.name == name).unwrap_or_else(|| {
        panic!(
            "no span {name}: {:?}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_runs_from_the_handler_through_the_outbox_to_the_consumer() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    tracing::subscriber::set_global_default(subscriber).unwrap();
    assert!(use_opentelemetry_trace_context());

    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    let js = jetstream().await;
    let stream_name = format!("TRELLIS_T_{}", ulid::Ulid::generate());
    // Unique: the name's replay durable on the shared replay stream serves one stream.
    let durable = format!(
        "traced{}",
        ulid::Ulid::generate().to_string().to_lowercase()
    );
    js.create_stream(Config {
        name: stream_name.clone(),
        subjects: vec!["ttracedotel.>".into()],
        storage: async_nats::jetstream::stream::StorageType::Memory,
        ..Config::default()
    })
    .await
    .unwrap();

    // The handler: its span's context is stored in the row.
    let row = async {
        let mut tx = db.pool.begin().await.unwrap();
        let row = tx
            .enqueue(&Traced {
                order: "o-1".into(),
            })
            .await
            .unwrap();
        tx.commit().await.unwrap();
        row
    }
    .instrument(tracing::info_span!("place_order"))
    .await;
    assert!(row.headers.contains_key("traceparent"), "{:?}", row.headers);

    let report = dispatch_outbox(
        &SqliteOutboxRepository::new(db.pool.clone()),
        &JetStreamPublisher::builder(js.clone()).build(),
        DispatchOptions::new(),
    )
    .await
    .unwrap();
    assert_eq!(report.dispatched, 1);

    js.get_stream(&stream_name)
        .await
        .unwrap()
        .create_consumer(PullConfig {
            durable_name: Some(durable.clone()),
            ack_policy: AckPolicy::Explicit,
            ..PullConfig::default()
        })
        .await
        .unwrap();
    let consumer = Consumer::builder(
        js.clone(),
        db.pool.clone(),
        handler_fn(
            |_: &mut Transaction<'static, Sqlite>, _: Delivered<Traced>| Box::pin(async { Ok(()) }),
        ),
    )
    .bind(&stream_name, &durable)
    .start()
    .await
    .unwrap();
    for _ in 0..100 {
        if consumer.report().applied == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(consumer.shutdown().await.unwrap().applied, 1);
    let _ = js.delete_stream(&stream_name).await;
    if let Ok(replays) = js.get_stream(trellis_outbox::REPLAY_STREAM).await {
        let _ = replays.delete_consumer(&durable).await;
    }

    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let handler = span(&spans, "place_order");
    let trace = handler.span_context.trace_id();
    assert_eq!(
        row.headers["traceparent"],
        format!("00-{trace}-{}-01", handler.span_context.span_id()),
        "the row carries the handler's context"
    );
    for name in ["outbox_publish", "outbox_consume"] {
        let child = span(&spans, name);
        assert_eq!(
            child.span_context.trace_id(),
            trace,
            "{name} is in the handler's trace"
        );
        assert_eq!(
            child.parent_span_id,
            handler.span_context.span_id(),
            "{name}'s parent"
        );
    }
}
