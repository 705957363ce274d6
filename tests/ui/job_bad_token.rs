#[trellis_outbox::outbox_job(
    queue = "syncCustomer",
    service = "billing.v2",
    job_type = "sync-customer"
)]
#[derive(serde::Serialize)]
struct SyncCustomer {
    customer_id: String,
}

fn main() {}
