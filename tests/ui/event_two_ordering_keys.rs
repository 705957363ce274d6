use trellis_outbox::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(name = "Orders.Shipped", subject = "events.v1.Orders.Shipped")]
struct OrderShipped {
    #[outbox(ordering_key)]
    order_id: String,
    #[outbox(ordering_key)]
    customer_id: String,
}

fn main() {}
