//! The quick start: an order handler that writes its business row and its event in one
//! transaction, on an embedded SQLite file, then a dispatcher that publishes the committed
//! events: to NATS JetStream when `NATS_URL` (default `nats://127.0.0.1:4222`) answers,
//! otherwise to an in-process publisher that prints them. No service needed.
//!
//! ```text
//! cargo run --example quickstart
//! ```

use serde::Serialize;
use sqlx::Row;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use std::time::Duration;

use trellis_outbox::{
    DispatchOptions, JetStreamPublisher, OutboxEvent, OutboxMessage, OutboxTransactionExt,
    PublishError, Publisher, SqliteOutboxRepository, dispatch_outbox,
};

/// The event: its payload is serde's output, its subject is rendered from the template.
#[derive(Serialize, OutboxEvent)]
#[serde(rename_all = "camelCase")]
#[outbox(name = "Orders.Placed", subject = "events.v1.Orders.Placed.{order_id}")]
struct OrderPlaced {
    order_id: String,
    total_cents: i64,
}

/// A request handler: the order row and its event commit together or not at all.
async fn place_order(
    pool: &sqlx::SqlitePool,
    order_id: &str,
    total_cents: i64,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO orders (id, total_cents) VALUES (?, ?)")
        .bind(order_id)
        .bind(total_cents)
        .execute(&mut *tx)
        .await?;
    let event = OrderPlaced {
        order_id: order_id.to_owned(),
        total_cents,
    };
    let stored = tx.enqueue(&event).await?;
    tx.commit().await?;
    println!(
        "committed order {order_id} with outbox row {} ({})",
        stored.id, stored.state
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("quickstart.db");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal);
    let pool = sqlx::SqlitePool::connect_with(options).await?;
    println!("database: {}", path.display());

    let report = trellis_outbox::migrate(&pool).await?;
    println!("applied migrations: {:?}", report.applied);
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, total_cents INTEGER NOT NULL)",
    )
    .execute(&pool)
    .await?;

    place_order(&pool, "ord-1001", 4_999).await?;
    place_order(&pool, "ord-1002", 1_250).await?;

    // A failing handler rolls back: neither its order nor its event is stored.
    match place_order(&pool, "ord-1001", 1).await {
        Ok(()) => println!("unexpected: the duplicate order was accepted"),
        Err(e) => println!("duplicate order rejected, nothing enqueued: {e}"),
    }

    println!("\nstored outbox rows:");
    let rows = sqlx::query("SELECT id, kind, name, subject, payload, headers, state, attempts, created_at FROM trellis_outbox ORDER BY created_at, id")
        .fetch_all(&pool)
        .await?;
    for row in &rows {
        println!(
            "  {} {} {} -> {}\n    payload {}\n    headers {}\n    state {} attempts {} created {}",
            row.get::<String, _>("id"),
            row.get::<String, _>("kind"),
            row.get::<String, _>("name"),
            row.get::<String, _>("subject"),
            row.get::<String, _>("payload"),
            row.get::<String, _>("headers"),
            row.get::<String, _>("state"),
            row.get::<i64, _>("attempts"),
            row.get::<String, _>("created_at"),
        );
    }

    // After commit, a dispatcher publishes each row once and marks it dispatched.
    let repository = SqliteOutboxRepository::new(pool.clone());
    let report = match jetstream().await {
        Some(js) => {
            println!(
                "\ndispatching to NATS JetStream at {} (stream QUICKSTART)",
                nats_url()
            );
            js.get_or_create_stream(async_nats::jetstream::stream::Config {
                name: "QUICKSTART".into(),
                subjects: vec!["events.v1.Orders.>".into()],
                max_messages: 10_000,
                ..Default::default()
            })
            .await?;
            let publisher = JetStreamPublisher::new(js);
            dispatch_outbox(&repository, &publisher, DispatchOptions::new()).await?
        }
        None => {
            println!(
                "\nNATS is not answering at {}: dispatching to an in-process publisher that prints each message",
                nats_url()
            );
            dispatch_outbox(&repository, &Print, DispatchOptions::new()).await?
        }
    };
    println!(
        "dispatched {}, failed {}, dead {}",
        report.dispatched, report.failed, report.dead
    );
    let states: Vec<(String, String)> =
        sqlx::query_as("SELECT id, state FROM trellis_outbox ORDER BY created_at, id")
            .fetch_all(&pool)
            .await?;
    for (id, state) in states {
        println!("  {id} {state}");
    }
    Ok(())
}

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// JetStream at `NATS_URL`, if it answers within a second.
async fn jetstream() -> Option<async_nats::jetstream::Context> {
    let connect = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(1))
        .max_reconnects(Some(0))
        .connect(nats_url());
    let client = tokio::time::timeout(Duration::from_secs(2), connect)
        .await
        .ok()?
        .ok()?;
    Some(async_nats::jetstream::new(client))
}

/// Stands in for NATS when no server answers: prints what would be published.
struct Print;

impl Publisher for Print {
    async fn publish_batch(
        &self,
        messages: &[OutboxMessage],
    ) -> Vec<Result<Option<serde_json::Value>, PublishError>> {
        messages
            .iter()
            .map(|m| {
                println!(
                    "  publish {} {} (Nats-Msg-Id {})",
                    m.subject, m.payload, m.id
                );
                Ok(None)
            })
            .collect()
    }
}
