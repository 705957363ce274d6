//! The PostgreSQL schema: the DDL of every migration version.

use crate::dispatch::KNOWN_STATES;
use crate::sql::{ColumnTypes, Ddl};
use crate::tables::OutboxTables;

/// The column types of version 1 (upstream Trellis 0.11's tables, byte for byte).
const TYPES: ColumnTypes = ColumnTypes {
    text: "text",
    json: "jsonb",
    integer: "integer",
    time: "timestamptz",
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
/// checked (the dispatcher moves them to `dead` when it starts); upstream Trellis' `claimed`
/// rows in the claim index; dead rows never due.
fn v3(tables: &OutboxTables) -> Ddl {
    let o = tables.outbox();
    let claim_index = Ddl::claim_index_v3(o);
    Ddl {
        up: vec![
            // Dropped first so that the script can be run again.
            format!("ALTER TABLE {o} DROP CONSTRAINT IF EXISTS {o}_state_ck"),
            format!(
                "ALTER TABLE {o} ADD CONSTRAINT {o}_state_ck CHECK (state IN ({KNOWN_STATES})) NOT VALID"
            ),
            claim_index[0].clone(),
            claim_index[1].clone(),
            // Dead rows are never due, for an upstream dispatcher too (it claims every row
            // not dispatched once `next_attempt_at` has passed).
            format!(
                "UPDATE {o} SET next_attempt_at = '9999-12-31 23:59:59.999+00' WHERE state = 'dead'"
            ),
        ],
        down: vec![
            format!("UPDATE {o} SET next_attempt_at = NULL WHERE state = 'dead'"),
            format!("DROP INDEX IF EXISTS {o}_claim_idx"),
            Ddl::claim_index(o),
            format!("ALTER TABLE {o} DROP CONSTRAINT IF EXISTS {o}_state_ck"),
        ],
    }
}
