#[trellis_outbox::outbox_job(
    queue = "syncCustomer",
    service = "billing",
    job_type = "sync-customer",
    mode = "enqueue"
)]
#[derive(serde::Serialize)]
struct SyncCustomer {
    customer_id: String,
}

fn main() {}
