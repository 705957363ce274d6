#[trellis_outbox::outbox_job(
    queue = "syncCustomer",
    service = "billing",
    jobtype = "sync-customer"
)]
#[derive(serde::Serialize)]
struct SyncCustomer {
    customer_id: String,
}

fn main() {}
