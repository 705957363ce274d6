//! The PostgreSQL schema: the DDL of every migration version and the bookkeeping statements.

use crate::dispatch::KNOWN_STATES;
use crate::sql::Ddl;
use crate::tables::OutboxTables;

/// Creates the bookkeeping table.
#[cfg(feature = "postgres")]
pub(crate) const BOOKKEEPING: &str = "CREATE TABLE IF NOT EXISTS trellis_outbox_migrations (outbox_table text NOT NULL, version integer NOT NULL, id text NOT NULL, checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (outbox_table, version))";

/// `(version, id, checksum)` of the migrations recorded for the outbox table $1.
#[cfg(feature = "postgres")]
pub(crate) const RECORDED: &str =
    "SELECT version::int8, id, checksum FROM trellis_outbox_migrations WHERE outbox_table = $1";

/// Records a migration: outbox table, version, id, checksum.
#[cfg(feature = "postgres")]
pub(crate) const RECORD: &str = "INSERT INTO trellis_outbox_migrations (outbox_table, version, id, checksum) VALUES ($1, $2, $3, $4)";

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
                "CREATE TABLE IF NOT EXISTS {o} (id text PRIMARY KEY, kind text NOT NULL, name text NOT NULL, subject text NOT NULL, payload text NOT NULL, headers jsonb NOT NULL, state text NOT NULL, attempts integer NOT NULL, created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL, next_attempt_at timestamptz, last_error text, outcome jsonb)"
            ),
            Ddl::due_index(o),
            format!(
                "CREATE TABLE IF NOT EXISTS {i} (message_id text PRIMARY KEY, received_at timestamptz NOT NULL)"
            ),
        ],
        down: Ddl::v1_down(tables),
    }
}

/// Version 2: claim leases, fencing tokens and the claim index; a fillfactor of 50 for HOT
/// lease updates and autovacuum after every 10,000 dead rows (not 20 % of a table that only
/// grows). The storage parameter applies to pages written from now on; `VACUUM FULL`
/// rewrites existing ones.
fn v2(tables: &OutboxTables) -> Ddl {
    let o = tables.outbox();
    Ddl {
        up: vec![
            format!("ALTER TABLE {o} ADD COLUMN IF NOT EXISTS claimed_until timestamptz"),
            format!("ALTER TABLE {o} ADD COLUMN IF NOT EXISTS claim_token text"),
            Ddl::claim_index(o),
            // A claim leases consecutive rows, so every row of a page gets a new version at
            // once: half of each page kept free lets all of them be HOT updates (no index
            // entries), where a fuller page makes part of them cold updates.
            // Vacuum after a fixed number of dead rows, not 20 % of the table: dispatched
            // rows stay, so the table only grows, and until a vacuum every claim scans the
            // claim index entries of all rows dispatched since the last one.
            format!(
                "ALTER TABLE {o} SET (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, \
                 autovacuum_vacuum_threshold = 10000)"
            ),
        ],
        down: vec![
            format!(
                "ALTER TABLE {o} RESET (fillfactor, autovacuum_vacuum_scale_factor, \
                 autovacuum_vacuum_threshold)"
            ),
            format!("DROP INDEX IF EXISTS {o}_claim_idx"),
            format!("ALTER TABLE {o} DROP COLUMN IF EXISTS claim_token"),
            format!("ALTER TABLE {o} DROP COLUMN IF EXISTS claimed_until"),
        ],
    }
}

/// Version 3: a `CHECK` constraint on `state`, added `NOT VALID` so existing rows are not
/// checked (the dispatcher moves them to `dead` when it starts).
fn v3(tables: &OutboxTables) -> Ddl {
    let o = tables.outbox();
    Ddl {
        up: vec![
            // Dropped first so that the script can be run again.
            format!("ALTER TABLE {o} DROP CONSTRAINT IF EXISTS {o}_state_ck"),
            format!(
                "ALTER TABLE {o} ADD CONSTRAINT {o}_state_ck CHECK (state IN ({KNOWN_STATES})) NOT VALID"
            ),
        ],
        down: vec![format!(
            "ALTER TABLE {o} DROP CONSTRAINT IF EXISTS {o}_state_ck"
        )],
    }
}
