//! Decoding stored rows, shared by both backends.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::error::{Error, Result};
use crate::record::OutboxMessage;

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

/// The result of a batch insert that wrote `inserted` rows: the records themselves when every
/// one was written (then no id repeated or pre-existed), otherwise the stored rows, read back
/// by `read`, in input order.
pub(crate) async fn batch_result<F, Fut>(
    records: Vec<crate::record::PreparedOutboxRecord>,
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
        .map(|r| {
            stored
                .get(&r.id)
                .cloned()
                .ok_or_else(|| Error::decode(&r.id, "id", "row vanished between insert and read"))
        })
        .collect()
}
