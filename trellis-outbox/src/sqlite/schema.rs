//! The SQLite schema: the DDL of every migration version.

use crate::dispatch::KNOWN_STATES;
use crate::sql::{ColumnTypes, Ddl};
use crate::tables::OutboxTables;

/// The column types of version 1 (upstream Trellis 0.11's tables, byte for byte).
const TYPES: ColumnTypes = ColumnTypes {
    text: "TEXT",
    json: "TEXT",
    integer: "INTEGER",
    time: "TEXT",
};

/// The DDL of each version, oldest first.
pub(crate) fn versions(tables: &OutboxTables) -> Vec<Ddl> {
    vec![Ddl::v1(tables, &TYPES), v2(tables), v3(tables)]
}

/// Version 2: claim leases, fencing tokens and the claim index.
fn v2(tables: &OutboxTables) -> Ddl {
    let o = tables.outbox();
    Ddl {
        up: vec![
            format!("ALTER TABLE {o} ADD COLUMN claimed_until TEXT"),
            format!("ALTER TABLE {o} ADD COLUMN claim_token TEXT"),
            Ddl::claim_index(o),
        ],
        down: vec![
            format!("DROP INDEX IF EXISTS {o}_claim_idx"),
            format!("ALTER TABLE {o} DROP COLUMN claim_token"),
            format!("ALTER TABLE {o} DROP COLUMN claimed_until"),
        ],
    }
}

/// Version 3: triggers that abort inserts and updates leaving a row with an unknown state or
/// a NULL id (SQLite lets a `TEXT PRIMARY KEY` hold NULL). An existing row with a NULL id
/// may still be moved to `dead` (or given an id).
fn v3(tables: &OutboxTables) -> Ddl {
    let o = tables.outbox();
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
