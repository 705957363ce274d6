//! Decoding stored rows, shared by both backends.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::error::{Error, Result};
use crate::record::{OutboxMessage, PreparedOutboxRecord};

/// A row as read from the database, before the checks every backend shares.
pub(crate) struct RawRow {
    pub(crate) id: String,
    pub(crate) kind: String,
    pub(crate) name: String,
    pub(crate) subject: String,
    pub(crate) payload: String,
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) state: String,
    pub(crate) attempts: i64,
    pub(crate) created_at: DateTime<Utc>,
    pub(crate) updated_at: DateTime<Utc>,
    pub(crate) next_attempt_at: Option<DateTime<Utc>>,
    pub(crate) last_error: Option<String>,
    pub(crate) outcome: Option<serde_json::Value>,
}

impl RawRow {
    pub(crate) fn into_message(self) -> Result<OutboxMessage> {
        let id = self.id;
        let kind = self
            .kind
            .parse()
            .map_err(|e: Error| Error::decode(&id, "kind", e))?;
        let state = self
            .state
            .parse()
            .map_err(|e: Error| Error::decode(&id, "state", e))?;
        let attempts = u32::try_from(self.attempts).map_err(|_| {
            Error::decode(
                &id,
                "attempts",
                format!("{} is out of range", self.attempts),
            )
        })?;
        Ok(OutboxMessage {
            id,
            kind,
            name: self.name,
            subject: self.subject,
            payload: self.payload,
            headers: self.headers,
            state,
            attempts,
            created_at: self.created_at,
            updated_at: self.updated_at,
            next_attempt_at: self.next_attempt_at,
            last_error: self.last_error,
            outcome: self.outcome,
        })
    }
}

/// The position of each column in [`COLUMNS`](crate::sql::COLUMNS), the order every query
/// that decodes a message selects them in. Reading by position avoids a name lookup per
/// column per row.
pub(crate) const COLUMN_NAMES: [&str; 13] = [
    "id",
    "kind",
    "name",
    "subject",
    "payload",
    "headers",
    "state",
    "attempts",
    "created_at",
    "updated_at",
    "next_attempt_at",
    "last_error",
    "outcome",
];

/// Reads the column named `name` (by its position in `COLUMNS`), turning a driver error into
/// [`Error::Decode`].
pub(crate) fn column<'r, R, T>(row: &'r R, id: &str, name: &'static str) -> Result<T>
where
    R: sqlx::Row,
    T: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    let index = COLUMN_NAMES
        .iter()
        .position(|c| *c == name)
        .unwrap_or(usize::MAX);
    row.try_get(index).map_err(|e| Error::decode(id, name, e))
}

/// Headers a retry of the same logical event re-creates with new values, so they are not
/// part of a row's identity: the event time (a handler retried after a crash prepares the
/// event again, at a new time) and the trace context (the retry runs in a new span).
const VOLATILE_HEADERS: [&str; 3] = [
    crate::record::TRELLIS_EVENT_TIME,
    "traceparent",
    "tracestate",
];

fn is_volatile(name: &str) -> bool {
    VOLATILE_HEADERS
        .iter()
        .any(|v| v.eq_ignore_ascii_case(name))
}

/// Which immutable fields of `stored` differ from `record`: kind, name, subject, payload and
/// headers (without [`VOLATILE_HEADERS`]).
fn differing_fields(record: &PreparedOutboxRecord, stored: &OutboxMessage) -> Vec<&'static str> {
    let mut fields = Vec::new();
    if record.kind != stored.kind {
        fields.push("kind");
    }
    if record.name != stored.name {
        fields.push("name");
    }
    if record.subject != stored.subject {
        fields.push("subject");
    }
    if record.payload != stored.payload {
        fields.push("payload");
    }
    let lasting = |headers: &'_ BTreeMap<String, String>| -> Vec<(String, String)> {
        headers
            .iter()
            .filter(|(name, _)| !is_volatile(name))
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect()
    };
    if lasting(&record.headers) != lasting(&stored.headers) {
        fields.push("headers");
    }
    fields
}

/// The row to return for `record` when an insert of it conflicted with `stored`: the stored
/// row when its immutable content is the record's (idempotent enqueue), otherwise
/// [`Error::DuplicateIdentity`]; [`Error::StorageConflict`] when no row was found.
pub(crate) fn existing_row(
    record: &PreparedOutboxRecord,
    stored: Option<&OutboxMessage>,
) -> Result<OutboxMessage> {
    let Some(stored) = stored else {
        return Err(Error::StorageConflict {
            id: record.id.clone(),
        });
    };
    let fields = differing_fields(record, stored);
    if fields.is_empty() {
        Ok(stored.clone())
    } else {
        Err(Error::DuplicateIdentity {
            id: record.id.clone(),
            fields,
        })
    }
}

/// The result of a batch insert that wrote `inserted` rows: the records themselves when every
/// one was written (then no id repeated or pre-existed), otherwise the stored rows, read back
/// by `read`, in input order, each checked against its record with [`existing_row`] (a
/// repeated id within `records` is compared with the row its first occurrence wrote).
pub(crate) async fn batch_result<F, Fut>(
    records: Vec<PreparedOutboxRecord>,
    inserted: u64,
    now: DateTime<Utc>,
    read: F,
) -> Result<Vec<OutboxMessage>>
where
    F: FnOnce(Vec<String>) -> Fut,
    Fut: std::future::Future<Output = Result<BTreeMap<String, OutboxMessage>>>,
{
    if inserted == records.len() as u64 {
        return Ok(records
            .into_iter()
            .map(|r| OutboxMessage::pending(r, now))
            .collect());
    }
    let ids: Vec<String> = records.iter().map(|r| r.id.clone()).collect();
    let stored = read(ids).await?;
    records
        .iter()
        .map(|r| existing_row(r, stored.get(&r.id)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::TRELLIS_EVENT_TIME;

    fn record() -> PreparedOutboxRecord {
        let mut r =
            PreparedOutboxRecord::event("Orders.Shipped", "events.v1.Orders.Shipped", &1).unwrap();
        r.id = "order-shipped:o-1".into();
        r.headers
            .insert(crate::record::NATS_MSG_ID.into(), r.id.clone());
        r.headers.insert("traceparent".into(), "00-a-b-01".into());
        r
    }

    #[test]
    fn identical_content_is_idempotent_whatever_the_event_time() {
        let stored = OutboxMessage::pending(record(), Utc::now());
        let mut again = record();
        again
            .headers
            .insert(TRELLIS_EVENT_TIME.into(), "2030-01-01T00:00:00.000Z".into());
        again
            .headers
            .insert("traceparent".into(), "00-c-d-01".into());
        assert_eq!(existing_row(&again, Some(&stored)).unwrap(), stored);
        // A volatile header present on one side only does not count either.
        again.headers.remove(TRELLIS_EVENT_TIME);
        assert!(existing_row(&again, Some(&stored)).is_ok());
    }

    #[test]
    fn different_content_is_a_duplicate_identity() {
        let stored = OutboxMessage::pending(record(), Utc::now());
        type Mutation = fn(&mut PreparedOutboxRecord);
        let cases: [(Mutation, &[&str]); 6] = [
            (|r| r.payload = "2".into(), &["payload"]),
            (|r| r.name = "Orders.Placed".into(), &["name"]),
            (
                |r| r.subject = "events.v1.Orders.Placed".into(),
                &["subject"],
            ),
            (|r| r.kind = crate::OutboxRecordKind::JobCreate, &["kind"]),
            (
                |r| {
                    r.headers.insert("x-tenant".into(), "t".into());
                },
                &["headers"],
            ),
            (
                |r| {
                    r.name = "A.B".into();
                    r.payload = "{}".into();
                },
                &["name", "payload"],
            ),
        ];
        for (mutate, expected) in cases {
            let mut r = record();
            mutate(&mut r);
            let err = existing_row(&r, Some(&stored)).unwrap_err();
            assert_eq!(
                err.to_string(),
                "Outbox message 'order-shipped:o-1' already exists with different immutable content"
            );
            assert!(
                matches!(&err, Error::DuplicateIdentity { fields, .. } if fields == expected),
                "{err:?}"
            );
            assert!(!err.is_retryable());
        }
        let err = existing_row(&record(), None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Outbox message 'order-shipped:o-1' conflicted but no stored row was found"
        );
    }
}
