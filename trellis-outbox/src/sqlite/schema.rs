//! The SQLite schema: what its DDL differs in ([`Schema`]).

use crate::dispatch::KNOWN_STATES;
use crate::sql::{ColumnTypes, Ddl, Schema};

pub(crate) const SCHEMA: Schema = Schema {
    // Upstream Trellis 0.11's tables, byte for byte.
    types: ColumnTypes {
        text: "TEXT",
        json: "TEXT",
        integer: "INTEGER",
        time: "TEXT",
    },
    // SQLite has no `IF [NOT] EXISTS` for columns.
    add_column: "ADD COLUMN",
    drop_column: "DROP COLUMN",
    storage: None,
    checks,
    never: super::sql::NEVER,
    ordering,
    unkeyed_claim,
    ordering_locks: unkeyed_claim,
    open_keys: unkeyed_claim,
    open_keys_undeduplicated: unkeyed_claim,
};

/// Versions 6, 7, 8 and 9: nothing on SQLite. Its claim takes the heads of keys through
/// `<outbox>_claim_idx`, so that index keeps the keyed rows (on Postgres version 6 drops
/// them from it); it has one writer and no advisory locks (version 7 on Postgres spreads
/// the ordering trigger's locks over buckets; version 8 indexes the keys with open rows for
/// its key walk, which SQLite does not have, and version 9 turns that index's deduplication
/// off).
fn unkeyed_claim(_: &str) -> Ddl {
    Ddl {
        up: Vec::new(),
        down: Vec::new(),
    }
}

/// Version 5: per-key ordering. Three nullable columns (upstream Trellis' writer sets none,
/// so its rows stay unordered) and the index the claim's head test reads. SQLite has one
/// writer at a time, so insertion order is commit order: the keyed enqueue numbers a row
/// when it inserts it (one more than the key's highest undispatched number).
fn ordering(o: &str) -> Ddl {
    Ddl {
        up: vec![
            format!("ALTER TABLE {o} ADD COLUMN ordering_key TEXT"),
            format!("ALTER TABLE {o} ADD COLUMN ordering_seq INTEGER"),
            format!("ALTER TABLE {o} ADD COLUMN ordering_skip_dead INTEGER"),
            crate::sql::ordering_index(o),
        ],
        down: vec![
            format!("DROP INDEX IF EXISTS {o}_ord_idx"),
            format!("ALTER TABLE {o} DROP COLUMN ordering_skip_dead"),
            format!("ALTER TABLE {o} DROP COLUMN ordering_seq"),
            format!("ALTER TABLE {o} DROP COLUMN ordering_key"),
        ],
    }
}

/// Version 3's checks: triggers that abort inserts and updates leaving a row with an unknown
/// state or a NULL id (SQLite lets a `TEXT PRIMARY KEY` hold NULL). An existing row with a
/// NULL id may still be moved to `dead` (or given an id).
fn checks(o: &str) -> Ddl {
    let state_message =
        format!("{o}.state must be one of pending, claimed, dispatched, failed, dead");
    Ddl {
        up: vec![
            format!(
                "CREATE TRIGGER IF NOT EXISTS {o}_insert_ck BEFORE INSERT ON {o} \
                 WHEN NEW.id IS NULL OR NEW.state IS NULL OR NEW.state NOT IN ({KNOWN_STATES}) BEGIN \
                 SELECT RAISE(ABORT, '{o}.id must not be NULL') WHERE NEW.id IS NULL; \
                 SELECT RAISE(ABORT, '{state_message}'); END"
            ),
            format!(
                "CREATE TRIGGER IF NOT EXISTS {o}_update_ck BEFORE UPDATE OF id, state ON {o} \
                 WHEN (NEW.id IS NULL AND (OLD.id IS NOT NULL OR NEW.state IS NOT 'dead')) \
                 OR NEW.state IS NULL OR NEW.state NOT IN ({KNOWN_STATES}) BEGIN \
                 SELECT RAISE(ABORT, '{o}.id must not be NULL (a row whose id is NULL may only be moved to dead)') \
                 WHERE NEW.id IS NULL AND (OLD.id IS NOT NULL OR NEW.state IS NOT 'dead'); \
                 SELECT RAISE(ABORT, '{state_message}'); END"
            ),
        ],
        down: vec![
            format!("DROP TRIGGER IF EXISTS {o}_update_ck"),
            format!("DROP TRIGGER IF EXISTS {o}_insert_ck"),
        ],
    }
}
