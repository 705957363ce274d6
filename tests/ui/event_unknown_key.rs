use trellis_outbox::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(nmae = "Orders.Shipped", subject = "events.v1.Orders.Shipped")]
struct OrderShipped {
    order_id: String,
}

fn main() {}
