use trellis_outbox::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(name = "Orders.Shipped", subject = "events.v1.Orders.Shipped")]
struct OrderShipped {
    #[outbox(id)]
    event_id: String,
    #[outbox(id)]
    order_id: String,
}

fn main() {}
