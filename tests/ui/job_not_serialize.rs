#[trellis_outbox::outbox_job(
    queue = "syncCustomer",
    service = "billing",
    job_type = "sync-customer"
)]
struct SyncCustomer {
    customer_id: String,
}

fn main() {}
