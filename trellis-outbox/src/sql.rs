//! The statements trellis-outbox sends, one set per dialect and table set.
//!
//! The text of each dialect lives in its driver module (`postgres/sql.rs`, `sqlite/sql.rs`),
//! built once per table set from validated identifiers; this module holds the set both
//! dialects share and what every statement is for.

use std::sync::Arc;

use sqlx::AssertSqlSafe;

use crate::tables::{Dialect, OutboxTables};

/// The outbox columns in storage order (spec §B.2).
/// The states a claim takes rows from: ours (`pending`, `failed`) and upstream Trellis'
/// `claimed`, whose claim ends at `next_attempt_at`.
pub(crate) const OPEN_STATES: &str = "'pending', 'failed', 'claimed'";

/// The claim's head test: a keyed row is claimable only if no row of its
/// key with a lower `ordering_seq` is still undispatched, unless that row is `dead` and its
/// policy is `skip_dead`. `{o}` is the claim's own reference to the candidate row; read
/// through `<outbox>_ord_idx`. A keyed row without a sequence (written by a writer
/// without the trigger) is unordered.
pub(crate) fn head_test(o: &str, candidate: &str) -> String {
    format!(
        "({candidate}.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {o} AS ahead \
         WHERE ahead.ordering_key = {candidate}.ordering_key \
         AND ahead.ordering_seq < {candidate}.ordering_seq \
         AND {}))",
        holds_back("ahead")
    )
}

/// Whether the row `row` holds the later rows of its key back: it is not dispatched, and
/// not `dead` under the `skip_dead` policy.
pub(crate) fn holds_back(row: &str) -> String {
    format!(
        "{row}.state <> 'dispatched' \
         AND ({row}.state <> 'dead' OR {row}.ordering_skip_dead IS NOT TRUE)"
    )
}

/// The predicate of `<outbox>_ord_idx`, the undispatched keyed rows: a query that repeats it
/// can read that index.
pub(crate) const UNDISPATCHED_KEYED: &str = "ordering_key IS NOT NULL AND state <> 'dispatched'";

/// The predicate of `<outbox>_ord_open` (Postgres, version 8), the keyed rows a claim may
/// still take ([`OPEN_STATES`]): the key walk and the claim's "any keyed rows?" test repeat
/// it, so that dead rows kept for inspection cost them nothing.
pub(crate) const OPEN_KEYED: &str =
    "ordering_key IS NOT NULL AND state IN ('pending', 'failed', 'claimed')";

/// The keys whose head is dead under the `block` policy ($1/?1 = limit, written by each
/// dialect as `limit`): `(rows waiting behind it, key, head id)`.
pub(crate) fn blocked_keys(o: &str, limit: &str) -> String {
    format!(
        "SELECT (SELECT count(*) FROM {o} AS w WHERE w.ordering_key = d.ordering_key \
         AND w.ordering_seq > d.ordering_seq AND w.state <> 'dispatched') AS waiting, \
         d.ordering_key, d.id FROM {o} AS d \
         WHERE {heads} ORDER BY d.ordering_key LIMIT {limit}",
        heads = blocking_heads(o),
    )
}

/// How many keys [`blocked_keys`] would list without a limit.
pub(crate) fn blocked_key_count(o: &str) -> String {
    format!("SELECT count(*) FROM {o} AS d WHERE {}", blocking_heads(o))
}

/// Whether the row `d` is a dead head that blocks its key (policy `block`).
fn blocking_heads(o: &str) -> String {
    format!(
        "d.ordering_key IS NOT NULL AND d.state = 'dead' AND d.ordering_skip_dead IS NOT TRUE \
         AND {}",
        head_test(o, "d")
    )
}

/// The version 5 index the head test reads: the undispatched rows of each key in sequence
/// order.
pub(crate) fn ordering_index(o: &str) -> String {
    format!(
        "CREATE INDEX IF NOT EXISTS {o}_ord_idx ON {o} (ordering_key, ordering_seq) \
         WHERE {UNDISPATCHED_KEYED}"
    )
}

pub(crate) const COLUMNS: &str = "id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at, next_attempt_at, last_error, outcome";

/// How many columns [`COLUMNS`] names.
pub(crate) const COLUMN_COUNT: usize = 13;

const _: () = {
    // COLUMNS has COLUMN_COUNT names.
    let bytes = COLUMNS.as_bytes();
    let (mut i, mut commas) = (0, 0);
    while i < bytes.len() {
        if bytes[i] == b',' {
            commas += 1;
        }
        i += 1;
    }
    assert!(commas + 1 == COLUMN_COUNT);
};

/// What an operator sees of a row beyond [`COLUMNS`]: its lease and its ordering key, selected
/// after them by `list` and `inspect` and read by `Backend::decode_row`.
pub(crate) const ROW_EXTRAS: &str = "claim_token, claimed_until, ordering_key";

/// The SQL trellis-outbox sends for one dialect and table set.
///
/// The enqueue and inbox statements are byte-for-byte upstream Trellis' (spec §B.5), so rows
/// written by either implementation are indistinguishable.
///
/// # Examples
///
/// ```
/// use trellis_outbox::{Dialect, Outbox};
///
/// let outbox = Outbox::default();
/// let sql = outbox.sql(Dialect::Postgres);
/// assert!(sql.enqueue().contains("VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) ON CONFLICT (id) DO NOTHING"));
/// assert_eq!(sql.notify_channel(), "trellis_outbox_wakeup");
/// assert_eq!(
///     sql.inbox_insert(),
///     "INSERT INTO trellis_inbox (message_id, received_at) VALUES ($1, $2) ON CONFLICT (message_id) DO NOTHING",
/// );
/// ```
#[derive(Debug, Clone)]
// Without a driver, nothing sends the dispatch statements.
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub struct SqlStatements {
    pub(crate) dialect: Dialect,
    pub(crate) outbox_table: Arc<str>,
    pub(crate) notify_channel: Arc<str>,
    /// Whether Postgres enqueues send `NOTIFY` (see [`Outbox::without_notify`](crate::Outbox::without_notify)).
    pub(crate) notify: bool,
    /// The statements themselves, in the dialect's words.
    pub(crate) text: Texts,
}

/// Declares [`Texts`]: every statement is a shared text (`Arc<str>`, handed to each query
/// without a copy), one field per name.
macro_rules! texts {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        /// The statements that differ by dialect, written by its `statements` function.
        #[derive(Debug, Clone)]
        // Without a driver, nothing sends the dispatch statements.
        #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
        pub(crate) struct Texts {
            $($(#[$doc])* pub(crate) $name: Arc<str>,)*
        }
    };
}

texts! {
    /// One row; on Postgres also notifies ($14 = channel, NULL for none).
    enqueue,
    /// `enqueue` of a record with an ordering key: also writes `ordering_key` and
    /// `ordering_skip_dead` (Postgres $15, $16; SQLite ?14, ?15) and on SQLite numbers the row.
    /// Records without a key use `enqueue`, upstream's statement.
    enqueue_ordered,
    /// `enqueue` of a row leased at once to a dispatcher that publishes it after the commit
    /// ([`HandoffTransaction`](crate::HandoffTransaction)): also writes `claim_token` and
    /// `claimed_until` (the database's clock at the insert plus the lease), and upstream's
    /// lease (`next_attempt_at`) when asked. Postgres: $1–$10 as `enqueue`, $11 token,
    /// $12 lease in seconds, $13 whether to write upstream's lease; SQLite: ?1–?10, ?11
    /// token, ?12 lease modifier, ?13 the same flag. No `NOTIFY`: no other dispatcher
    /// could claim the row before its lease ends.
    enqueue_leased,
    /// Leases rows of a list of ids to a dispatcher's handoff token (`enqueue_all` of a
    /// [`HandoffTransaction`](crate::HandoffTransaction)): those `pending`, unkeyed, not
    /// leased and due; returns their ids. Postgres: $1 ids, $2 token, $3 lease in seconds,
    /// $4 whether to write upstream's lease; SQLite: ?1 JSON array of ids, ?2, ?3 the lease
    /// modifier, ?4.
    lease_rows,
    /// One stored row by id, [`COLUMNS`] in order.
    select_by_id,
    inbox_insert,
    /// Fenced by the claim token, like every mark below.
    mark_dispatched,
    /// `mark_dispatched` storing an outcome per row (events have none: the plain form saves
    /// the per-row lookup).
    mark_dispatched_with_outcomes,
    /// Many rows, each `failed` or `dead`; returns the ids marked.
    mark_failures,
    /// Ids, token, lease.
    extend_lease,
    /// Ids, token.
    release,
    /// An operator's retry of one `failed` or `dead` row not under a live lease.
    retry,
    /// Moves rows no claim can finish to `dead`; returns (id, reason).
    sweep_unfinishable,
    /// Seconds until the next row is due (NULL when no row is open).
    next_due_in,
    /// Deletes up to a limit of `dispatched` rows last updated before an age (age, limit).
    purge_dispatched,
    /// Deletes up to a limit of inbox rows received before an age (age, limit).
    purge_inbox,
    /// Per state: the state, its row count, the age in seconds of its oldest row.
    status,
    /// Undispatched rows and the age in seconds of the oldest (NULL when none).
    backlog,
    /// `status` of the rows not dispatched only (`pending`, `claimed`, `failed`, `dead`),
    /// read through the index on `state` (`<outbox>_due_idx`): it never reads the dispatched
    /// rows, however many the table keeps.
    progress,
    /// Rows in a state (state, name or NULL for any, limit), oldest first, [`COLUMNS`] and
    /// [`ROW_EXTRAS`].
    list,
    /// One stored row by id, [`COLUMNS`] and [`ROW_EXTRAS`].
    inspect,
    /// Moves the oldest `dead` rows (of a name, or NULL for all; at most a limit) back to
    /// `pending`, due now.
    retry_dead,
    /// How many rows `retry_dead` would move (name or NULL, limit).
    count_dead,
    /// Keys held by a dead head under the `block` policy (limit): rows waiting behind it,
    /// the key, the head's id; by key.
    blocked_keys,
    /// How many keys are held by a dead head under the `block` policy.
    blocked_key_count,
}

impl SqlStatements {
    pub(crate) fn new(dialect: Dialect, tables: &OutboxTables, notify: bool) -> Self {
        let text = match dialect {
            Dialect::Postgres => crate::postgres::sql::statements(tables),
            Dialect::Sqlite => crate::sqlite::sql::statements(tables),
        };
        Self {
            dialect,
            outbox_table: tables.outbox().into(),
            notify_channel: notify_channel(tables).into(),
            // Only Postgres has `NOTIFY`.
            notify: notify && dialect == Dialect::Postgres,
            text,
        }
    }

    /// The dialect these statements are written in.
    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// The single-row enqueue: upstream's `INSERT … ON CONFLICT … DO NOTHING`; on Postgres
    /// wrapped so that an inserted row also notifies [`SqlStatements::notify_channel`].
    pub fn enqueue(&self) -> &str {
        &self.text.enqueue
    }

    /// The Postgres `LISTEN`/`NOTIFY` channel that enqueues on this outbox notify:
    /// `<outbox table>_wakeup`. Notifications carry no payload; they are only a hint.
    pub fn notify_channel(&self) -> &str {
        &self.notify_channel
    }

    /// Whether enqueues send a `NOTIFY` on [`notify_channel`](Self::notify_channel): on
    /// Postgres unless the outbox was built [`without_notify`](crate::Outbox::without_notify);
    /// never on SQLite.
    pub fn notifies(&self) -> bool {
        self.notify
    }

    /// The channel to bind to the enqueue statements: `None` sends no notification.
    #[cfg(feature = "postgres")]
    pub(crate) fn notify_bind(&self) -> Option<&str> {
        self.notify.then_some(&*self.notify_channel)
    }

    /// Reads one stored row by id (used when an enqueue hits an existing id).
    pub fn select_by_id(&self) -> &str {
        &self.text.select_by_id
    }

    /// The inbox insert: upstream's statement; its affected-row count decides the receipt.
    pub fn inbox_insert(&self) -> &str {
        &self.text.inbox_insert
    }

    /// What the relay's progress line reads
    /// ([`SqlOutboxRepository::progress`](crate::SqlOutboxRepository::progress)): per state
    /// other than `dispatched`, the rows and the age in seconds of the oldest, through the
    /// index on `state`.
    ///
    /// ```
    /// use trellis_outbox::{Dialect, Outbox};
    ///
    /// let sql = Outbox::default().sql(Dialect::Postgres).progress().to_owned();
    /// assert!(sql.contains("WHERE state IN ('pending', 'claimed', 'failed', 'dead')"));
    /// ```
    pub fn progress(&self) -> &str {
        &self.text.progress
    }
}

/// A statement for `sqlx::query`: shares the text instead of copying it per query.
pub(crate) fn statement(text: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(Arc::clone(text))
}

/// The wake-up channel of an outbox table.
///
/// In lower case: Postgres folds the unquoted table name to lower case, so `Orders_Outbox` and
/// `orders_outbox` are one table, and their writers and listeners must share one channel.
pub(crate) fn notify_channel(tables: &OutboxTables) -> String {
    format!("{}_wakeup", tables.outbox().to_ascii_lowercase())
}

/// The statements of one schema version in one dialect: [`Schema`] writes them,
/// [`migrate`](crate::migrate) numbers and checksums them.
pub(crate) struct Ddl {
    /// Statements that apply the version, without trailing semicolons.
    pub(crate) up: Vec<String>,
    /// Statements that revert it.
    pub(crate) down: Vec<String>,
}

/// The column types a dialect writes version 1's tables in.
pub(crate) struct ColumnTypes {
    pub(crate) text: &'static str,
    pub(crate) json: &'static str,
    pub(crate) integer: &'static str,
    pub(crate) time: &'static str,
}

/// What one dialect's schema (its `schema.rs`) differs in; every version is built from it
/// alike.
pub(crate) struct Schema {
    /// The column types of version 1.
    pub(crate) types: ColumnTypes,
    /// How version 2 adds and drops its columns: `ADD COLUMN IF NOT EXISTS` and
    /// `DROP COLUMN IF EXISTS` where the dialect has them.
    pub(crate) add_column: &'static str,
    pub(crate) drop_column: &'static str,
    /// Version 2's storage parameters for the claim's updates, if the dialect has any.
    pub(crate) storage: Option<fn(&str) -> Ddl>,
    /// Version 3's check that `state` (and on SQLite `id`) is one a claim can finish.
    pub(crate) checks: fn(&str) -> Ddl,
    /// The `next_attempt_at` of a `dead` row from version 3 on: never due.
    pub(crate) never: &'static str,
    /// Version 5: per-key ordering (the columns, the index the claim's head test reads, and
    /// on Postgres the trigger that numbers a key's rows in commit order).
    pub(crate) ordering: fn(&str) -> Ddl,
    /// Version 6: on Postgres the claim index holds only rows without an ordering key (the
    /// claim finds keyed rows key by key, through `<outbox>_ord_idx`); none on SQLite.
    pub(crate) unkeyed_claim: fn(&str) -> Ddl,
    /// Version 7: on Postgres the ordering trigger locks one of 1,024 buckets per key, not
    /// one lock per key (a transaction with thousands of keys ran out of lock table); none
    /// on SQLite.
    pub(crate) ordering_locks: fn(&str) -> Ddl,
    /// Version 8: on Postgres an index of the keys with open rows, for the key walk; none
    /// on SQLite.
    pub(crate) open_keys: fn(&str) -> Ddl,
    /// Version 9: on Postgres that index without deduplication, so a scan can mark the
    /// entries of dispatched rows dead one by one; none on SQLite.
    pub(crate) open_keys_undeduplicated: fn(&str) -> Ddl,
}

impl Schema {
    /// The schema of `dialect`.
    pub(crate) fn of(dialect: Dialect) -> &'static Schema {
        match dialect {
            Dialect::Postgres => &crate::postgres::schema::SCHEMA,
            Dialect::Sqlite => &crate::sqlite::schema::SCHEMA,
        }
    }

    /// The DDL of each version, oldest first.
    pub(crate) fn versions(&self, tables: &OutboxTables) -> Vec<Ddl> {
        let o = tables.outbox();
        vec![
            Ddl::v1(tables, &self.types),
            self.v2(o),
            self.v3(o),
            Ddl::v4(tables),
            (self.ordering)(o),
            (self.unkeyed_claim)(o),
            (self.ordering_locks)(o),
            (self.open_keys)(o),
            (self.open_keys_undeduplicated)(o),
        ]
    }

    /// Trellis 0.10's outbox table (column `event` instead of `name`, no `kind`, no
    /// `outcome`) brought to version 1's columns in place, as upstream 0.11.0-rc.3 did: 0.10
    /// rows were all events.
    pub(crate) fn upgrade_0_10(&self, tables: &OutboxTables) -> Vec<String> {
        let o = tables.outbox();
        vec![
            format!("ALTER TABLE {o} RENAME COLUMN event TO name"),
            format!(
                "ALTER TABLE {o} ADD COLUMN kind {} NOT NULL DEFAULT 'event.publish'",
                self.types.text
            ),
            format!("ALTER TABLE {o} ADD COLUMN outcome {}", self.types.json),
        ]
    }

    /// Version 2: claim leases, fencing tokens and the claim index, then the storage
    /// parameters (reverted first).
    fn v2(&self, o: &str) -> Ddl {
        let (add, drop) = (self.add_column, self.drop_column);
        let ColumnTypes { text, time, .. } = self.types;
        let mut up = vec![
            format!("ALTER TABLE {o} {add} claimed_until {time}"),
            format!("ALTER TABLE {o} {add} claim_token {text}"),
            Ddl::claim_index(o),
        ];
        let mut down = vec![
            format!("DROP INDEX IF EXISTS {o}_claim_idx"),
            format!("ALTER TABLE {o} {drop} claim_token"),
            format!("ALTER TABLE {o} {drop} claimed_until"),
        ];
        if let Some(storage) = self.storage {
            let storage = storage(o);
            up.extend(storage.up);
            down.splice(0..0, storage.down);
        }
        Ddl { up, down }
    }

    /// Version 3: the dialect's checks; upstream Trellis' `claimed` rows in the claim index;
    /// dead rows never due. Reverted in the opposite order.
    fn v3(&self, o: &str) -> Ddl {
        let Ddl { mut up, mut down } = (self.checks)(o);
        up.extend(Ddl::claim_index_v3(o));
        // Dead rows are never due, for an upstream dispatcher too (it claims every row
        // not dispatched once `next_attempt_at` has passed).
        up.push(format!(
            "UPDATE {o} SET next_attempt_at = {} WHERE state = 'dead'",
            self.never
        ));
        let reverted = [
            format!("UPDATE {o} SET next_attempt_at = NULL WHERE state = 'dead'"),
            format!("DROP INDEX IF EXISTS {o}_claim_idx"),
            Ddl::claim_index(o),
        ];
        down.splice(0..0, reverted);
        Ddl { up, down }
    }
}

/// The statements both dialects write alike.
impl Ddl {
    /// Version 1: upstream Trellis 0.11's tables and due index, in `types`.
    fn v1(tables: &OutboxTables, types: &ColumnTypes) -> Self {
        let (o, i) = (tables.outbox(), tables.inbox());
        let ColumnTypes {
            text: t,
            json: j,
            integer: n,
            time: ts,
        } = types;
        Self {
            up: vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {o} (id {t} PRIMARY KEY, kind {t} NOT NULL, name {t} NOT NULL, subject {t} NOT NULL, payload {t} NOT NULL, headers {j} NOT NULL, state {t} NOT NULL, attempts {n} NOT NULL, created_at {ts} NOT NULL, updated_at {ts} NOT NULL, next_attempt_at {ts}, last_error {t}, outcome {j})"
                ),
                format!("CREATE INDEX IF NOT EXISTS {o}_due_idx ON {o} (state, next_attempt_at)"),
                format!(
                    "CREATE TABLE IF NOT EXISTS {i} (message_id {t} PRIMARY KEY, received_at {ts} NOT NULL)"
                ),
            ],
            down: vec![
                format!("DROP INDEX IF EXISTS {o}_due_idx"),
                format!("DROP TABLE IF EXISTS {i}"),
                format!("DROP TABLE IF EXISTS {o}"),
            ],
        }
    }

    /// The partial index of version 2 that yields claimable rows in claim order.
    fn claim_index(o: &str) -> String {
        format!(
            "CREATE INDEX IF NOT EXISTS {o}_claim_idx ON {o} (created_at, id) WHERE state IN ('pending', 'failed')"
        )
    }

    /// Version 4: the indexes retention deletes through, oldest first: dispatched rows by
    /// `updated_at` (partial, so open rows never enter it) and inbox rows by `received_at`.
    fn v4(tables: &OutboxTables) -> Self {
        let (o, i) = (tables.outbox(), tables.inbox());
        Ddl {
            up: vec![
                format!(
                    "CREATE INDEX IF NOT EXISTS {o}_done_idx ON {o} (updated_at) WHERE state = 'dispatched'"
                ),
                format!("CREATE INDEX IF NOT EXISTS {i}_recv_idx ON {i} (received_at)"),
            ],
            down: vec![
                format!("DROP INDEX IF EXISTS {i}_recv_idx"),
                format!("DROP INDEX IF EXISTS {o}_done_idx"),
            ],
        }
    }

    /// Version 3's claim index: also upstream Trellis' `claimed` rows, which become
    /// claimable when their claim (`next_attempt_at`) ends.
    pub(crate) fn claim_index_v3(o: &str) -> [String; 2] {
        [
            format!("DROP INDEX IF EXISTS {o}_claim_idx"),
            format!(
                "CREATE INDEX IF NOT EXISTS {o}_claim_idx ON {o} (created_at, id) WHERE state IN ({OPEN_STATES})"
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_keyed_rows_are_the_open_states() {
        assert_eq!(
            OPEN_KEYED,
            format!("ordering_key IS NOT NULL AND state IN ({OPEN_STATES})")
        );
    }
}
