use trellis_outbox::OutboxEvent;

#[derive(serde::Serialize)]
struct OrderRef {
    id: u64,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(name = "Orders.Shipped", subject = "events.v1.Orders.Shipped")]
struct OrderShipped {
    #[outbox(ordering_key)]
    order: OrderRef,
}

fn main() {}
