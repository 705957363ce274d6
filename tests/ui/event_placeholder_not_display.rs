use trellis_outbox::OutboxEvent;

#[derive(serde::Serialize)]
struct OrderId(u64);

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(
    name = "Orders.Shipped",
    subject = "events.v1.Orders.Shipped.{order_id}"
)]
struct OrderShipped {
    order_id: OrderId,
}

fn main() {}
