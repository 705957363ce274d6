//! `trellis-outbox dead-letters`: a consumer's dead letters, listed or replayed.

use std::io::Write;
use std::time::SystemTime;

use super::relay::connect_nats;
use super::{CliError, Global};
use crate::consumer::{DeadLetter, dead_letters, replay_dead_letters};

/// What to do.
pub(super) struct Listing {
    pub(super) consumer: String,
    pub(super) limit: usize,
    pub(super) replay: bool,
    pub(super) json: bool,
}

pub(super) async fn run(
    global: &Global,
    listing: Listing,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let client = connect_nats(global, "trellis-outbox dead-letters").await?;
    let jetstream = async_nats::jetstream::new(client);
    let Listing {
        consumer,
        limit,
        replay,
        json,
    } = listing;
    if replay {
        let report = replay_dead_letters(&jetstream, &consumer, limit).await?;
        if json {
            let left: Vec<_> = report
                .left
                .iter()
                .map(|left| {
                    serde_json::json!({
                        "sequence": left.sequence,
                        "messageId": left.message_id,
                        "reason": left.reason,
                    })
                })
                .collect();
            let value = serde_json::json!({ "replayed": report.replayed, "left": left });
            writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
        } else {
            writeln!(out, "replayed {}", report.replayed)?;
            for left in &report.left {
                writeln!(
                    out,
                    "left {} {}: {}",
                    left.sequence,
                    left.message_id.as_deref().unwrap_or("(no id)"),
                    left.reason
                )?;
            }
        }
        return Ok(());
    }
    let copies = dead_letters(&jetstream, &consumer, limit).await?;
    if json {
        let copies: Vec<_> = copies.iter().map(as_json).collect();
        writeln!(out, "{}", serde_json::to_string_pretty(&copies)?)?;
        return Ok(());
    }
    if copies.is_empty() {
        writeln!(out, "no dead letters for consumer {consumer}")?;
    }
    for copy in &copies {
        writeln!(
            out,
            "{} {} {} kind={} deliveries={} subject={} error={}",
            copy.sequence,
            timestamp(copy.at),
            copy.message_id.as_deref().unwrap_or("(no id)"),
            copy.kind.as_deref().unwrap_or("?"),
            copy.deliveries
                .map_or_else(|| "?".to_owned(), |n| n.to_string()),
            copy.subject.as_deref().unwrap_or("?"),
            copy.error.as_deref().unwrap_or(""),
        )?;
    }
    Ok(())
}

fn timestamp(at: SystemTime) -> String {
    crate::time::format_timestamp(at.into())
}

fn as_json(copy: &DeadLetter) -> serde_json::Value {
    serde_json::json!({
        "sequence": copy.sequence,
        "at": timestamp(copy.at),
        "messageId": copy.message_id,
        "subject": copy.subject,
        "kind": copy.kind,
        "error": copy.error,
        "deliveries": copy.deliveries,
        "stream": copy.stream,
        "streamSequence": copy.stream_sequence,
        "payload": String::from_utf8_lossy(&copy.payload),
    })
}
