// An outbox row written outside the caller's transaction is the bug an outbox exists to
// prevent: there is no `enqueue` on a pool.
use trellis_outbox::{OutboxTransactionExt, PreparedOutboxRecord};

async fn handler(pool: sqlx::PgPool, record: PreparedOutboxRecord) {
    let _ = pool.enqueue(&record).await;
}

fn main() {
    let _ = handler;
}
