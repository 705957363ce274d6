use trellis_outbox::OutboxEvent;

#[derive(OutboxEvent)]
#[outbox(
    name = "Orders.Shipped",
    subject = "events.v1.Orders.Shipped.{order_id}"
)]
struct OrderShipped {
    order_id: String,
}

fn main() {}
