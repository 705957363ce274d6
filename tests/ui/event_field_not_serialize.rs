use trellis_outbox::OutboxEvent;

struct Carrier;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(
    name = "Orders.Shipped",
    subject = "events.v1.Orders.Shipped.{order_id}"
)]
struct OrderShipped {
    order_id: String,
    carrier: Carrier,
}

fn main() {}
