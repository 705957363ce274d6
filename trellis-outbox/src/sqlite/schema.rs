//! The SQLite schema: the DDL of every migration version and the bookkeeping statements.

use crate::dispatch::KNOWN_STATES;
use crate::sql::Ddl;
use crate::tables::OutboxTables;

/// Creates the bookkeeping table.
#[cfg(feature = "sqlite")]
pub(crate) const BOOKKEEPING: &str = "CREATE TABLE IF NOT EXISTS trellis_outbox_migrations (outbox_table TEXT NOT NULL, version INTEGER NOT NULL, id TEXT NOT NULL, checksum TEXT NOT NULL, applied_at TEXT NOT NULL, PRIMARY KEY (outbox_table, version))";

/// `(version, id, checksum)` of the migrations recorded for the outbox table ?.
#[cfg(feature = "sqlite")]
pub(crate) const RECORDED: &str =
    "SELECT version, id, checksum FROM trellis_outbox_migrations WHERE outbox_table = ?";

/// Records a migration: outbox table, version, id, checksum, time applied.
#[cfg(feature = "sqlite")]
pub(crate) const RECORD: &str = "INSERT INTO trellis_outbox_migrations (outbox_table, version, id, checksum, applied_at) VALUES (?, ?, ?, ?, ?)";

/// The DDL of each version, oldest first.
pub(crate) fn versions(tables: &OutboxTables) -> Vec<Ddl> {
    vec![v1(tables), v2(tables), v3(tables)]
}

/// Version 1: upstream Trellis 0.11's tables and due index, byte for byte.
fn v1(tables: &OutboxTables) -> Ddl {
    let (o, i) = (tables.outbox(), tables.inbox());
    Ddl {
        up: vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {o} (id TEXT PRIMARY KEY, kind TEXT NOT NULL, name TEXT NOT NULL, subject TEXT NOT NULL, payload TEXT NOT NULL, headers TEXT NOT NULL, state TEXT NOT NULL, attempts INTEGER NOT NULL, created_at TEXT NOT NULL, updated_at TEXT NOT NULL, next_attempt_at TEXT, last_error TEXT, outcome TEXT)"
            ),
            Ddl::due_index(o),
            format!(
                "CREATE TABLE IF NOT EXISTS {i} (message_id TEXT PRIMARY KEY, received_at TEXT NOT NULL)"
            ),
        ],
        down: Ddl::v1_down(tables),
    }
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
