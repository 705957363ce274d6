use trellis_outbox::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(
    name = "Orders.Shipped",
    subject = "events.v1.Orders.Shipped",
    ordering = "skip"
)]
struct OrderShipped {
    #[outbox(ordering_key)]
    order_id: String,
}

fn main() {}
