use trellis_outbox::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(name = "Orders.Shipped", subject = "events.v1.Orders.Shipped")]
struct OrderShipped {
    #[outbox(id)]
    event_id: Vec<u8>,
}

fn main() {}
