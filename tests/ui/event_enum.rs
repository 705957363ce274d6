use trellis_outbox::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(name = "Orders.Changed", subject = "events.v1.Orders.Changed")]
enum OrderChanged {
    Shipped { order_id: String },
    Cancelled { order_id: String },
}

fn main() {}
