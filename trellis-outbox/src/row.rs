//! From a stored row to an [`OutboxMessage`], for every database: the one decoder, with the
//! rules that make a row poison, and the checks an enqueue makes against a stored row.

use std::borrow::Cow;
use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::query::Query;

use crate::error::{Error, Result};
use crate::record::{OutboxMessage, PreparedOutboxRecord};
use crate::time::parse_timestamp;

/// A stored value as a driver hands it over: already decoded (Postgres' `timestamptz` and
/// `jsonb`) or as text still to parse (SQLite). Parsing failures name the column.
pub(crate) trait Stored<T> {
    fn into_value(self, id: &str, column: &'static str) -> Result<T>;
}

impl Stored<DateTime<Utc>> for &str {
    fn into_value(self, id: &str, column: &'static str) -> Result<DateTime<Utc>> {
        parse_timestamp(self).map_err(|e| Error::decode(id, column, format!("{self:?}: {e}")))
    }
}

impl<T> Stored<T> for sqlx::types::Json<T> {
    fn into_value(self, _: &str, _: &'static str) -> Result<T> {
        Ok(self.0)
    }
}

impl Stored<BTreeMap<String, String>> for &str {
    fn into_value(self, id: &str, column: &'static str) -> Result<BTreeMap<String, String>> {
        serde_json::from_str(self)
            .map_err(|e| Error::decode(id, column, format!("not a JSON object of strings: {e}")))
    }
}

impl Stored<BTreeMap<String, String>> for BTreeMap<String, String> {
    fn into_value(self, _: &str, _: &'static str) -> Result<BTreeMap<String, String>> {
        Ok(self)
    }
}

impl Stored<serde_json::Value> for Cow<'_, str> {
    fn into_value(self, id: &str, column: &'static str) -> Result<serde_json::Value> {
        serde_json::from_str(&self).map_err(|e| Error::decode(id, column, format!("not JSON: {e}")))
    }
}

impl Stored<serde_json::Value> for &str {
    fn into_value(self, id: &str, column: &'static str) -> Result<serde_json::Value> {
        Cow::Borrowed(self).into_value(id, column)
    }
}

/// Attempts: `integer` (Postgres) or `INTEGER` (SQLite), stored by other writers too.
fn attempts<N>(n: N, id: &str, column: &'static str) -> Result<u32>
where
    N: Copy + std::fmt::Display,
    u32: TryFrom<N>,
{
    u32::try_from(n).map_err(|_| Error::decode(id, column, format!("{n} is out of range")))
}

impl Stored<u32> for i32 {
    fn into_value(self, id: &str, column: &'static str) -> Result<u32> {
        attempts(self, id, column)
    }
}

impl Stored<u32> for i64 {
    fn into_value(self, id: &str, column: &'static str) -> Result<u32> {
        attempts(self, id, column)
    }
}

/// A row's values as read, before the checks every database shares. Text that does not end
/// up in the message as text (kind, state, and on SQLite headers, times and outcome) is
/// borrowed from the row, not copied.
pub(crate) struct RawRow<'r, Time, Headers, Outcome, Attempts> {
    pub(crate) id: String,
    pub(crate) kind: &'r str,
    pub(crate) name: String,
    pub(crate) subject: String,
    pub(crate) payload: String,
    pub(crate) headers: Headers,
    pub(crate) state: &'r str,
    pub(crate) attempts: Attempts,
    pub(crate) created_at: Time,
    pub(crate) updated_at: Time,
    pub(crate) next_attempt_at: Option<Time>,
    pub(crate) last_error: Option<String>,
    pub(crate) outcome: Option<Outcome>,
}

impl<T, H, O, A> RawRow<'_, T, H, O, A>
where
    T: Stored<DateTime<Utc>>,
    H: Stored<BTreeMap<String, String>>,
    O: Stored<serde_json::Value>,
    A: Stored<u32>,
{
    /// The message, or why the row is poison: an unknown kind or state, malformed headers,
    /// attempts out of range, a time or outcome that does not parse.
    pub(crate) fn into_message(self) -> Result<OutboxMessage> {
        let id = self.id.as_str();
        let kind = self
            .kind
            .parse()
            .map_err(|e: Error| Error::decode(id, "kind", e))?;
        let headers = self.headers.into_value(id, "headers")?;
        let state = self
            .state
            .parse()
            .map_err(|e: Error| Error::decode(id, "state", e))?;
        let attempts = self.attempts.into_value(id, "attempts")?;
        let created_at = self.created_at.into_value(id, "created_at")?;
        let updated_at = self.updated_at.into_value(id, "updated_at")?;
        let next_attempt_at = self
            .next_attempt_at
            .map(|t| t.into_value(id, "next_attempt_at"))
            .transpose()?;
        let outcome = self
            .outcome
            .map(|o| o.into_value(id, "outcome"))
            .transpose()?;
        Ok(OutboxMessage {
            id: self.id,
            kind,
            name: self.name,
            subject: self.subject,
            payload: self.payload,
            headers,
            state,
            attempts,
            created_at,
            updated_at,
            next_attempt_at,
            last_error: self.last_error,
            outcome,
        })
    }
}

/// Reads column `index` (by position: no name lookup per column per row), turning a driver
/// error into [`Error::Decode`] about the column `name`.
pub(crate) fn get<'r, R, T>(row: &'r R, id: &str, index: usize, name: &'static str) -> Result<T>
where
    R: sqlx::Row,
    T: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    row.try_get(index).map_err(|e| Error::decode(id, name, e))
}

/// Reads a row that selected [`COLUMNS`](crate::sql::COLUMNS) first, in order, as the
/// database's types `T` (times), `H` (headers), `O` (outcome) and `A` (attempts).
pub(crate) fn read<'r, R, T, H, O, A>(row: &'r R) -> Result<RawRow<'r, T, H, O, A>>
where
    R: sqlx::Row,
    usize: sqlx::ColumnIndex<R>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    &'r str: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    T: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Option<T>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    H: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Option<O>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    A: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let id: String = get(row, "", 0, "id")?;
    let raw = columns!(row, id; kind, name, subject, payload, headers, state, attempts,
        created_at, updated_at, next_attempt_at, last_error, outcome);
    Ok(raw)
}

/// A [`RawRow`] of `$row`'s columns after `$id`, each read by position (see [`get`]) and
/// named after its field. The names must be [`COLUMNS`](crate::sql::COLUMNS) in order, which
/// is checked at compile time.
macro_rules! columns {
    ($row:ident, $id:ident; $($column:ident),+ $(,)?) => {{
        const _: () = assert!(same_text(
            crate::sql::COLUMNS,
            concat!(stringify!($id), $(", ", stringify!($column)),+),
        ));
        let i = $id.as_str();
        let mut index = 0;
        RawRow {
            $($column: {
                index += 1;
                get($row, i, index, stringify!($column))?
            },)+
            $id,
        }
    }};
}
use columns;

/// `a == b`, in a constant.
const fn same_text(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
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

/// A record's headers as the JSON text both databases store.
pub(crate) fn headers_json(record: &PreparedOutboxRecord) -> Result<String> {
    serde_json::to_string(&record.headers).map_err(|source| Error::Serialize {
        what: "outbox headers",
        source,
    })
}

/// The id of a batch's first record, naming a failed batch insert.
pub(crate) fn first_id(batch: &[PreparedOutboxRecord]) -> &str {
    batch.first().map_or("", |r| &r.id)
}

/// Binds what a record says of itself, the first five [`COLUMNS`](crate::sql::COLUMNS): id,
/// kind, name, subject and payload.
pub(crate) fn bind_content<'q, DB>(
    query: Query<'q, DB, DB::Arguments>,
    record: &PreparedOutboxRecord,
) -> Query<'q, DB, DB::Arguments>
where
    DB: sqlx::Database,
    for<'t> &'t str: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    query
        .bind(record.id.as_str())
        .bind(record.kind.as_str())
        .bind(record.name.as_str())
        .bind(record.subject.as_str())
        .bind(record.payload.as_str())
}

/// Binds a keyed record's ordering columns (its key, then whether a dead head stops
/// blocking it) after the others; a record without a key binds nothing, since it is written
/// with upstream's statement, which has no such columns.
pub(crate) fn bind_ordering<'q, DB: sqlx::Database>(
    query: Query<'q, DB, DB::Arguments>,
    record: &PreparedOutboxRecord,
) -> Query<'q, DB, DB::Arguments>
where
    bool: for<'t> sqlx::Encode<'t, DB> + sqlx::Type<DB>,
    for<'t> &'t str: sqlx::Encode<'t, DB> + sqlx::Type<DB>,
{
    match &record.ordering {
        Some(ordering) => query.bind(ordering.key.as_str()).bind(ordering.skip_dead()),
        None => query,
    }
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
