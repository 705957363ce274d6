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

/// Upgrades a Trellis 0.10 outbox table to version 1's columns.
pub(crate) fn upgrade_0_10(tables: &OutboxTables) -> Vec<String> {
    Ddl::upgrade_0_10(tables.outbox(), &TYPES)
}

/// The DDL of each version, oldest first.
pub(crate) fn versions(tables: &OutboxTables) -> Vec<Ddl> {
    vec![
        Ddl::v1(tables, &TYPES),
        v2(tables),
        v3(tables),
        Ddl::v4(tables),
    ]
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
    let claim_index = Ddl::claim_index_v3(o);
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
            claim_index[0].clone(),
            claim_index[1].clone(),
            // Dead rows are never due, for an upstream dispatcher too (it claims every row
            // not dispatched once `next_attempt_at` has passed).
            format!(
                "UPDATE {o} SET next_attempt_at = '9999-12-31T23:59:59.999Z' WHERE state = 'dead'"
            ),
        ],
        down: vec![
            format!("UPDATE {o} SET next_attempt_at = NULL WHERE state = 'dead'"),
            format!("DROP INDEX IF EXISTS {o}_claim_idx"),
            Ddl::claim_index(o),
            format!("DROP TRIGGER IF EXISTS {o}_update_ck"),
            format!("DROP TRIGGER IF EXISTS {o}_insert_ck"),
        ],
    }
}
