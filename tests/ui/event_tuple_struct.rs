use trellis_outbox::OutboxEvent;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(name = "Orders.Shipped", subject = "events.v1.Orders.Shipped")]
struct OrderShipped(String);

fn main() {}
