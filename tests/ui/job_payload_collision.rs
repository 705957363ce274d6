#[trellis_outbox::outbox_job(
    queue = "syncCustomer",
    service = "billing",
    job_type = "sync-customer"
)]
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct SyncCustomer {
    customer_id: String,
    job_id: String,
}

fn main() {}
