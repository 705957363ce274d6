use trellis_outbox::OutboxEvent;

const NAME: &str = "Orders.Shipped";

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(name = NAME, subject = "events.v1.Orders.Shipped")]
struct OrderShipped {
    order_id: String,
}

fn main() {
    let _ = NAME;
}
