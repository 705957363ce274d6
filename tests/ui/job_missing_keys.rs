#[trellis_outbox::outbox_job(queue = "syncCustomer")]
#[derive(serde::Serialize)]
struct SyncCustomer {
    customer_id: String,
}

fn main() {}
