// Other crates' attributes are ignored, and an error in the derive does not cascade into
// every use of the type: only the real mistake (the missing `name`) is reported.
use trellis_outbox::{OutboxEvent, ToOutboxRecord};

#[derive(serde::Serialize, OutboxEvent)]
#[serde(rename_all = "camelCase")]
#[outbox(subject = "events.v1.Orders.Shipped.{order_id}")]
struct OrderShipped {
    #[serde(rename = "id")]
    order_id: String,
}

fn main() {
    let event = OrderShipped {
        order_id: "o-1".into(),
    };
    let _ = event.to_outbox_record();
    let _ = (OrderShipped::OUTBOX_NAME, event.subject());
}
