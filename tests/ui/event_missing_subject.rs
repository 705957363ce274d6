use trellis_outbox::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(name = "Orders.Shipped")]
struct OrderShipped {
    order_id: String,
}

fn main() {}
