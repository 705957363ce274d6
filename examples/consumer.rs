//! The consuming side, end to end on the local Postgres and NATS: a shipping service
//! enqueues `OrderShipped` events in its outbox and a dispatcher publishes them; a billing
//! consumer applies each one exactly once — it writes an invoice row and enqueues an
//! `InvoiceIssued` follow-up event in the same transaction as its inbox row.
//!
//! ```text
//! cargo run --example consumer    # DATABASE_URL, NATS_URL override the local defaults
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Postgres, Transaction};
use trellis_outbox::{
    Consumer, Delivered, JetStreamPublisher, OutboxDispatcher, OutboxEvent, OutboxTransactionExt,
    PgOutboxRepository, handler_fn, migrate,
};

#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[serde(rename_all = "camelCase")]
#[outbox(name = "Orders.Shipped", subject = "example.orders.shipped.{order_id}")]
struct OrderShipped {
    order_id: String,
    total_cents: i64,
}

#[derive(Debug, Serialize, OutboxEvent)]
#[serde(rename_all = "camelCase")]
#[outbox(
    name = "Invoices.Issued",
    subject = "example.invoices.issued.{order_id}"
)]
struct InvoiceIssued {
    order_id: String,
    total_cents: i64,
}

/// Billing's handler: the invoice row and the follow-up event commit with the inbox row, or
/// not at all.
async fn issue_invoice(
    tx: &mut Transaction<'static, Postgres>,
    shipped: Delivered<OrderShipped>,
) -> Result<(), trellis_outbox::HandlerError> {
    let order = &shipped.event;
    sqlx::query("INSERT INTO invoices (order_id, total_cents, event_id) VALUES ($1, $2, $3)")
        .bind(&order.order_id)
        .bind(order.total_cents)
        .bind(&shipped.id)
        .execute(&mut **tx)
        .await?;
    tx.enqueue(&InvoiceIssued {
        order_id: order.order_id.clone(),
        total_cents: order.total_cents,
    })
    .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let pool = PgPool::connect(&database_url).await?;
    migrate(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS invoices \
         (order_id text NOT NULL, total_cents bigint NOT NULL, event_id text NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let jetstream = async_nats::jetstream::new(async_nats::connect(&nats_url).await?);

    // Where the follow-up events go (the dispatcher publishes them too).
    jetstream
        .get_or_create_stream(async_nats::jetstream::stream::Config {
            name: "EXAMPLE_INVOICES".into(),
            subjects: vec!["example.invoices.>".into()],
            ..Default::default()
        })
        .await?;

    // Billing: the stream over `example.orders.shipped.*` and a durable consumer are created
    // if missing.
    let billing = Consumer::builder(
        jetstream.clone(),
        pool.clone(),
        handler_fn(|tx, shipped| Box::pin(issue_invoice(tx, shipped))),
    )
    .create("EXAMPLE_ORDERS", "billing")
    .start()
    .await?;

    // Shipping: events go into the outbox with the business write; the dispatcher publishes.
    let dispatcher = OutboxDispatcher::builder(
        PgOutboxRepository::new(pool.clone()),
        JetStreamPublisher::builder(jetstream.clone()).build(),
    )
    .start()?;
    let run = ulid::Ulid::generate().to_string().to_lowercase();
    for n in 1..=3 {
        let mut tx = pool.begin().await?;
        tx.enqueue(&OrderShipped {
            order_id: format!("{run}-{n}"),
            total_cents: 1000 * n,
        })
        .await?;
        tx.commit().await?;
    }
    dispatcher.handle().notify();

    let like = format!("{run}-%");
    for _ in 0..100 {
        let invoices: i64 =
            sqlx::query_scalar("SELECT count(*) FROM invoices WHERE order_id LIKE $1")
                .bind(&like)
                .fetch_one(&pool)
                .await?;
        if invoices == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rows: Vec<(String, i64, String)> = sqlx::query_as(
        "SELECT order_id, total_cents, event_id FROM invoices WHERE order_id LIKE $1 ORDER BY order_id",
    )
    .bind(&like)
    .fetch_all(&pool)
    .await?;
    for (order, cents, event) in &rows {
        println!("invoice for {order}: {cents} cents (from event {event})");
    }
    let report = billing.shutdown().await?;
    dispatcher.shutdown().await;
    println!(
        "billing applied {} events ({} duplicates skipped) and enqueued {} InvoiceIssued events",
        report.applied,
        report.duplicates,
        rows.len()
    );
    if rows.len() != 3 {
        return Err(format!("expected 3 invoices, found {}", rows.len()).into());
    }
    Ok(())
}
