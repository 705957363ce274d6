#[trellis_outbox::outbox_job(
    queue = "syncCustomer",
    service = "billing",
    job_type = "sync-customer"
)]
#[derive(serde::Serialize)]
enum SyncCustomer {
    One { customer_id: String },
}

fn main() {}
