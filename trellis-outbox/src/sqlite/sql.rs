//! Every statement trellis-outbox sends to SQLite (except the schema's DDL, in `schema.rs`),
//! built once per table set from validated identifiers.

#[cfg(feature = "sqlite")]
use std::sync::{Arc, Mutex, PoisonError};

use crate::dispatch::KNOWN_STATES;
use crate::sql::OPEN_STATES;
#[cfg(feature = "sqlite")]
use crate::sql::SqlStatements;
use crate::sql::{COLUMNS, ROW_EXTRAS, Texts};
use crate::tables::OutboxTables;

/// SQLite's current time in the stored format, `YYYY-MM-DDTHH:MM:SS.SSSZ`.
const NOW: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";

/// A row's `created_at` as a julianday, NULL when it is not a stored time. Other writers may
/// store anything: `julianday` answers NULL for text that is not a date (and `min` of the
/// text would pick such a value, `''` say, and answer NULL for the whole table), and reads a
/// number, or numeric text, as a Julian day number (year -4713). Only text that starts with a
/// date counts.
const CREATED_AT_TIME: &str = "CASE WHEN typeof(created_at) = 'text' \
     AND created_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]*' \
     THEN julianday(created_at) END";

/// The `next_attempt_at` of a `dead` row: far enough that an upstream Trellis dispatcher,
/// which claims every undispatched row once it is due, never takes it.
pub(crate) const NEVER: &str = "'9999-12-31T23:59:59.999Z'";

/// The statements both dialects send, in SQLite's words.
pub(crate) fn statements(tables: &OutboxTables) -> Texts {
    let (o, i) = (tables.outbox(), tables.inbox());
    Texts {
        enqueue: format!(
            "INSERT INTO {o} ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO NOTHING"
        )
        .into(),
        // One writer at a time: the number one above the key's highest undispatched row is
        // the key's next in commit order. Dispatched rows no longer take part in the claim's
        // head test, so a number may be used again once every row below it is dispatched.
        enqueue_ordered: format!(
            "INSERT INTO {o} ({COLUMNS}, ordering_key, ordering_seq, ordering_skip_dead) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, \
             (SELECT COALESCE(MAX(ordering_seq), 0) + 1 FROM {o} \
             WHERE ordering_key = ?14 AND state <> 'dispatched'), ?15) ON CONFLICT(id) DO NOTHING"
        )
        .into(),
        enqueue_leased: format!(
            "INSERT INTO {o} ({COLUMNS}, claim_token, claimed_until) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, \
             CASE WHEN ?13 THEN strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?12) END, NULL, NULL, \
             ?11, strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?12)) ON CONFLICT(id) DO NOTHING"
        )
        .into(),
        lease_rows: format!(
            "UPDATE {o} SET claim_token = ?2, claimed_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?3), \
             next_attempt_at = CASE WHEN ?4 THEN strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?3) \
             ELSE next_attempt_at END \
             WHERE id IN (SELECT value FROM json_each(?1)) AND state = 'pending' \
             AND ordering_key IS NULL AND claim_token IS NULL \
             AND (next_attempt_at IS NULL OR next_attempt_at <= {NOW}) RETURNING id"
        )
        .into(),
        select_by_id: format!("SELECT {COLUMNS} FROM {o} WHERE id = ?").into(),
        inbox_insert: format!(
            "INSERT INTO {i} (message_id, received_at) VALUES (?, ?) ON CONFLICT(message_id) DO NOTHING"
        )
        .into(),
        // ?1 JSON array of ids, ?2 token.
        mark_dispatched: format!(
            "UPDATE {o} SET state = 'dispatched', updated_at = {NOW}, next_attempt_at = NULL, \
             last_error = NULL, claimed_until = NULL, claim_token = NULL, outcome = NULL \
             WHERE claim_token = ?2 AND id IN (SELECT value FROM json_each(?1))"
        )
        .into(),
        // ?1 JSON array of [id, outcome-or-null] pairs, ?2 token.
        mark_dispatched_with_outcomes: format!(
            "UPDATE {o} SET state = 'dispatched', updated_at = {NOW}, next_attempt_at = NULL, \
             last_error = NULL, claimed_until = NULL, claim_token = NULL, \
             outcome = (SELECT NULLIF(d.value -> '$[1]', 'null') FROM json_each(?1) AS d \
                        WHERE d.value ->> '$[0]' = {o}.id) \
             WHERE claim_token = ?2 AND id IN (SELECT value ->> '$[0]' FROM json_each(?1))"
        )
        .into(),
        // ?1 JSON array of [id, error, delay modifier or null (dead), attempts to add],
        // ?2 token.
        mark_failures: format!(
            "UPDATE {o} SET \
             state = CASE WHEN f.value ->> '$[2]' IS NULL THEN 'dead' ELSE 'failed' END, \
             attempts = attempts + (f.value ->> '$[3]'), updated_at = {NOW}, \
             next_attempt_at = CASE WHEN f.value ->> '$[2]' IS NULL THEN {NEVER} \
               ELSE strftime('%Y-%m-%dT%H:%M:%fZ', 'now', f.value ->> '$[2]') END, \
             last_error = f.value ->> '$[1]', claimed_until = NULL, claim_token = NULL \
             FROM json_each(?1) AS f \
             WHERE {o}.id = f.value ->> '$[0]' AND {o}.claim_token = ?2 \
             RETURNING {o}.id"
        )
        .into(),
        // ?1 JSON array of ids, ?2 token, ?3 lease modifier.
        extend_lease: format!(
            "UPDATE {o} SET claimed_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?3), \
             next_attempt_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?3) \
             WHERE claim_token = ?2 AND id IN (SELECT value FROM json_each(?1))"
        )
        .into(),
        release: format!(
            "UPDATE {o} SET claimed_until = NULL, claim_token = NULL, next_attempt_at = NULL \
             WHERE claim_token = ?2 AND id IN (SELECT value FROM json_each(?1))"
        )
        .into(),
        // Run in one `BEGIN IMMEDIATE` transaction with `retry_refusal`: a row is reset
        // only if no live lease holds it (the claim's own test: token set and
        // `claimed_until` after now).
        retry: format!(
            "UPDATE {o} SET state = 'pending', attempts = 0, updated_at = {NOW}, next_attempt_at = NULL, \
             claimed_until = NULL, claim_token = NULL \
             WHERE id = ?1 AND state IN ('failed', 'dead') \
             AND NOT (claim_token IS NOT NULL AND claimed_until IS NOT NULL AND claimed_until > {NOW})"
        )
        .into(),
        // Rows no claim can finish: unknown states (any row), and open rows whose id is
        // NULL or not text (never claimed, or claimed but never markable by id) or whose
        // retry or lease time is not a time (never due). Text comes back as bytes: a
        // stored value need not be UTF-8.
        sweep_unfinishable: format!(
            "UPDATE {o} SET state = 'dead', updated_at = {NOW}, next_attempt_at = {NEVER}, \
             claimed_until = NULL, claim_token = NULL, last_error = CASE \
             WHEN typeof(state) <> 'text' THEN 'state is ' || typeof(state) || ', not text' \
             WHEN state NOT IN ({KNOWN_STATES}) THEN 'unknown state ' || json_quote(substr(state, 1, 100)) \
             WHEN id IS NULL THEN 'id is NULL (SQLite rowid ' || rowid || ')' \
             WHEN typeof(id) <> 'text' THEN 'id is ' || typeof(id) || ', not text (SQLite rowid ' || rowid || ')' \
             WHEN next_attempt_at IS NOT NULL AND julianday(next_attempt_at) IS NULL \
             THEN 'next_attempt_at is not a time: ' || quote(substr(next_attempt_at, 1, 100)) \
             ELSE 'claimed_until is not a time: ' || quote(substr(claimed_until, 1, 100)) END \
             WHERE typeof(state) <> 'text' OR state NOT IN ({KNOWN_STATES}) \
             OR (state IN ({OPEN_STATES}) AND (typeof(id) <> 'text' \
             OR (next_attempt_at IS NOT NULL AND julianday(next_attempt_at) IS NULL) \
             OR (claimed_until IS NOT NULL AND julianday(claimed_until) IS NULL))) \
             RETURNING CASE typeof(id) WHEN 'text' THEN CAST(id AS BLOB) ELSE X'' END, \
             CAST(last_error AS BLOB)"
        )
        .into(),
        // ?1 age in seconds, ?2 limit: the oldest first, through `<outbox>_done_idx`.
        purge_dispatched: format!(
            "DELETE FROM {o} WHERE id IN (SELECT id FROM {o} INDEXED BY {o}_done_idx \
             WHERE state = 'dispatched' \
             AND updated_at < strftime('%Y-%m-%dT%H:%M:%fZ', julianday('now') - ?1 / 86400.0) \
             ORDER BY updated_at LIMIT ?2)"
        )
        .into(),
        purge_inbox: format!(
            "DELETE FROM {i} WHERE message_id IN (SELECT message_id FROM {i} INDEXED BY {i}_recv_idx \
             WHERE received_at < strftime('%Y-%m-%dT%H:%M:%fZ', julianday('now') - ?1 / 86400.0) \
             ORDER BY received_at LIMIT ?2)"
        )
        .into(),
        // A state that is not text (another writer's) is counted under its text form. The
        // ages leave out `created_at` values that are not times ([`CREATED_AT_TIME`]).
        status: format!(
            "SELECT COALESCE(CAST(state AS TEXT), '(null)'), count(*), \
             (julianday({NOW}) - min({CREATED_AT_TIME})) * 86400.0 FROM {o} GROUP BY state"
        )
        .into(),
        backlog: format!(
            "SELECT count(*), (julianday({NOW}) - min({CREATED_AT_TIME})) * 86400.0 \
             FROM {o} WHERE state IN ({OPEN_STATES})"
        )
        .into(),
        inspect: format!("SELECT {COLUMNS}, {ROW_EXTRAS} FROM {o} WHERE id = ?").into(),
        // `CAST(state AS TEXT)`: only text matches the list anyway.
        progress: format!(
            "SELECT CAST(state AS TEXT), count(*), \
             (julianday({NOW}) - min({CREATED_AT_TIME})) * 86400.0 \
             FROM {o} WHERE state IN ('pending', 'claimed', 'failed', 'dead') GROUP BY state"
        )
        .into(),
        list: format!(
            "SELECT {COLUMNS}, {ROW_EXTRAS} FROM {o} WHERE state = ?1 AND (?2 IS NULL OR name = ?2) \
             ORDER BY created_at, id LIMIT ?3"
        )
        .into(),
        blocked_keys: crate::sql::blocked_keys(o, "?1").into(),
        blocked_key_count: crate::sql::blocked_key_count(o).into(),
        // ?1 name or NULL, ?2 limit: the oldest first.
        retry_dead: format!(
            "UPDATE {o} SET state = 'pending', attempts = 0, updated_at = {NOW}, \
             next_attempt_at = NULL, claimed_until = NULL, claim_token = NULL \
             WHERE id IN ({dead}) AND state = 'dead'",
            dead = dead_rows(o, "id"),
        )
        .into(),
        count_dead: format!("SELECT count(*) FROM ({}) AS dead", dead_rows(o, "1")).into(),
        // Stored times have millisecond precision, but a julianday is a double of about
        // 2.46 million days, off by up to ~50 µs: the difference is rounded to whole
        // milliseconds, so a row due in 500 ms is never reported due in 500.017 ms.
        // Only the heads of ordering keys count: a row behind its key's head is not due
        // until the head is dispatched (a key blocked by a dead head is never due).
        next_due_in: format!(
            "SELECT round((julianday(min(max(COALESCE(next_attempt_at, {NOW}), COALESCE(claimed_until, {NOW})))) \
             - julianday({NOW})) * 86400000.0) / 1000.0 \
             FROM {o} WHERE state IN ({OPEN_STATES}) AND {head}",
            head = crate::sql::head_test(o, o),
        )
        .into(),
    }
}

/// `what` of the oldest `dead` rows of `?1` (a name, or NULL for any), at most `?2`.
fn dead_rows(o: &str, what: &str) -> String {
    format!(
        "SELECT {what} FROM {o} WHERE state = 'dead' AND (?1 IS NULL OR name = ?1) \
         ORDER BY created_at, id LIMIT ?2"
    )
}

/// The statements only SQLite sends.
#[derive(Debug)]
#[cfg(feature = "sqlite")]
pub struct SqliteOnly {
    /// The claim, split around its `LIMIT` (see [`ClaimSql`]).
    pub(crate) claim: ClaimSql,
    /// The claim that also writes upstream Trellis' lease (`next_attempt_at`) and moves an
    /// adopted `claimed` row back to `pending`.
    pub(crate) claim_beside_upstream: ClaimSql,
    /// Reads claimed rows column by column (rows whose packed values were unreadable).
    pub(crate) read_claimed: Arc<str>,
    /// Why `retry` changed nothing: the row's state (as text) and lease, if any.
    pub(crate) retry_refusal: Arc<str>,
    /// Puts a claimed row to rest by its id's bytes: an id that is text but not UTF-8 cannot
    /// be decoded, so no mark by id (a JSON array of strings) can reach it. ?1 the id's
    /// bytes, ?2 token, ?3 the reason.
    pub(crate) dead_by_id_bytes: Arc<str>,
}

#[cfg(feature = "sqlite")]
impl SqliteOnly {
    pub(crate) fn new(tables: &OutboxTables) -> Self {
        let o = tables.outbox();
        Self {
            claim: ClaimSql::new(o, ""),
            claim_beside_upstream: ClaimSql::new(
                o,
                "next_attempt_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?1), \
                 state = CASE WHEN state = 'claimed' THEN 'pending' ELSE state END, ",
            ),
            // ?1 JSON array of ids, ?2 token.
            read_claimed: format!(
                "SELECT {COLUMNS} FROM {o} \
                 WHERE claim_token = ?2 AND id IN (SELECT value FROM json_each(?1))"
            )
            .into(),
            retry_refusal: format!(
                "SELECT CASE typeof(state) WHEN 'text' THEN CAST(state AS BLOB) \
                 ELSE CAST('<' || typeof(state) || '>' AS BLOB) END, \
                 CASE WHEN claim_token IS NOT NULL AND claimed_until > {NOW} THEN claimed_until END \
                 FROM {o} WHERE id = ?1"
            )
            .into(),
            dead_by_id_bytes: format!(
                "UPDATE {o} SET state = 'dead', updated_at = {NOW}, next_attempt_at = {NEVER}, \
                 claimed_until = NULL, claim_token = NULL, last_error = ?3 \
                 WHERE CAST(id AS BLOB) = ?1 AND claim_token = ?2"
            )
            .into(),
        }
    }
}

/// The claim statement, built per batch size.
///
/// The limit is written into the SQL as a literal: SQLite re-prepares a statement whose
/// `LIMIT` is a bound parameter every time that parameter is bound (the planner may use the
/// value), which for a claim means parsing and planning it again on every batch. A
/// dispatcher uses one batch size, so the texts for the last limit are kept.
#[cfg(feature = "sqlite")]
#[derive(Debug)]
pub(crate) struct ClaimSql {
    /// Up to and including `LIMIT `.
    head: String,
    /// After the limit: `RETURNING` the columns.
    tail: String,
    /// `tail` plus the cutoff the claim used (for the first claim of a wave).
    tail_with_cutoff: String,
    /// The texts for the last limit.
    last: Mutex<Option<ClaimTexts>>,
}

/// The claim statements for one limit.
#[cfg(feature = "sqlite")]
#[derive(Debug)]
struct ClaimTexts {
    limit: i64,
    plain: Arc<str>,
    with_cutoff: Arc<str>,
}

#[cfg(feature = "sqlite")]
impl ClaimSql {
    /// The claim for `limit` rows; `with_cutoff` also returns the cutoff as `claim_cutoff`.
    /// ?1 lease modifier ('+30.000 seconds'), ?2 token, ?3 cutoff or NULL; the limit is a
    /// literal. `also_set` is more of the `SET` list (ending in `, `). Without statistics
    /// SQLite prefers the (state, next_attempt_at) index and sorts every undispatched row per
    /// claim; the partial claim index yields them in order.
    fn new(o: &str, also_set: &str) -> Self {
        Self {
            head: format!(
                "UPDATE {o} SET {also_set}claimed_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?1), \
                 claim_token = ?2 \
                 WHERE id IN (SELECT id FROM {o} INDEXED BY {o}_claim_idx \
                 WHERE state IN ({OPEN_STATES}) \
                 AND (next_attempt_at IS NULL OR next_attempt_at <= COALESCE(?3, {NOW})) \
                 AND (claimed_until IS NULL OR claimed_until <= {NOW}) \
                 AND {head} \
                 ORDER BY created_at, id LIMIT ",
                head = crate::sql::head_test(o, o),
            ),
            tail: format!(") RETURNING {CLAIM_COLUMNS}"),
            tail_with_cutoff: format!(
                ") RETURNING {CLAIM_COLUMNS}, COALESCE(?3, {NOW}) AS claim_cutoff"
            ),
            last: Mutex::new(None),
        }
    }

    pub(crate) fn get(&self, limit: i64, with_cutoff: bool) -> Arc<str> {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let texts = match &mut *last {
            Some(texts) if texts.limit == limit => texts,
            slot => slot.insert(ClaimTexts {
                limit,
                plain: format!("{}{limit}{}", self.head, self.tail).into(),
                with_cutoff: format!("{}{limit}{}", self.head, self.tail_with_cutoff).into(),
            }),
        };
        Arc::clone(if with_cutoff {
            &texts.with_cutoff
        } else {
            &texts.plain
        })
    }
}

/// What a claim returns per row: the values that become the message's strings, one column
/// each, then the other eight packed into one JSON array.
///
/// The SQLite driver copies every returned value into its own allocation before handing the
/// row over, and a claim returns a hundred rows: six values per row instead of thirteen make
/// the claim markedly cheaper. `database::decode_claimed` reads this shape.
///
/// `json_array` fails the whole statement on a BLOB argument, so a row holding one in a packed
/// column (never written by trellis-outbox or Trellis) packs NULL instead, and is then read
/// column by column like any other unusual row: one bad row must not block the claim.
#[cfg(feature = "sqlite")]
pub(crate) const CLAIM_COLUMNS: &str = "id, name, subject, payload, headers, \
    CASE WHEN 'blob' IN (typeof(kind), typeof(state), typeof(attempts), typeof(created_at), \
    typeof(updated_at), typeof(next_attempt_at), typeof(last_error), typeof(outcome)) THEN NULL \
    ELSE json_array(kind, state, attempts, created_at, updated_at, next_attempt_at, last_error, outcome) END";

/// How many values [`CLAIM_COLUMNS`] has.
#[cfg(feature = "sqlite")]
pub(crate) const CLAIM_COLUMN_COUNT: usize = 6;

/// The batch enqueue of `rows` records: eight parameters per row (id, kind, name, subject,
/// payload, headers, created_at, updated_at).
#[cfg(feature = "sqlite")]
pub(crate) fn insert_rows(sql: &SqlStatements, rows: usize) -> String {
    let mut insert = format!("INSERT INTO {} ({COLUMNS}) VALUES ", sql.outbox_table);
    for i in 0..rows {
        if i > 0 {
            insert.push_str(", ");
        }
        insert.push_str("(?, ?, ?, ?, ?, ?, 'pending', 0, ?, ?, NULL, NULL, NULL)");
    }
    insert.push_str(" ON CONFLICT(id) DO NOTHING");
    insert
}

/// The stored rows of `ids` ids, one parameter each.
#[cfg(feature = "sqlite")]
pub(crate) fn select_stored(sql: &SqlStatements, ids: usize) -> String {
    let mut select = format!("SELECT {COLUMNS} FROM {} WHERE id IN (", sql.outbox_table);
    for i in 0..ids {
        select.push_str(if i > 0 { ", ?" } else { "?" });
    }
    select.push(')');
    select
}
