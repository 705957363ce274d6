use trellis_outbox::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(name = "Orders.Shipped", subject = "events.v1.Orders.Shipped")]
#[outbox(subject = "events.v2.Orders.Shipped")]
struct OrderShipped {
    order_id: String,
}

fn main() {}
