// Several mistakes are all reported in one compile, each at its own span.
use trellis_outbox::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(name = "Orders.Shipped", subject = "events..Orders.Shipped.{order}")]
struct OrderShipped {
    #[outbox(id)]
    event_id: String,
    #[outbox(id)]
    order_id: String,
}

fn main() {}
