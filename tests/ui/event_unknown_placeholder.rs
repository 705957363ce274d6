use trellis_outbox::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(
    name = "Orders.Shipped",
    subject = "events.v1.Orders.Shipped.{orderid}"
)]
struct OrderShipped {
    order_id: String,
}

fn main() {}
