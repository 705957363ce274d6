//! The PostgreSQL schema: what its DDL differs in ([`Schema`]).

use crate::dispatch::KNOWN_STATES;
use crate::sql::{ColumnTypes, Ddl, Schema};

pub(crate) const SCHEMA: Schema = Schema {
    // Upstream Trellis 0.11's tables, byte for byte.
    types: ColumnTypes {
        text: "text",
        json: "jsonb",
        integer: "integer",
        time: "timestamptz",
    },
    add_column: "ADD COLUMN IF NOT EXISTS",
    drop_column: "DROP COLUMN IF EXISTS",
    storage: Some(storage),
    checks,
    never: super::sql::NEVER,
};

/// Version 2's storage parameters: a fillfactor of 50 for HOT lease updates and autovacuum
/// after every 10,000 dead rows (not 20 % of a table that only grows). The storage parameter
/// applies to pages written from now on; `VACUUM FULL` rewrites existing ones.
fn storage(o: &str) -> Ddl {
    Ddl {
        up: vec![
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
        down: vec![format!(
            "ALTER TABLE {o} RESET (fillfactor, autovacuum_vacuum_scale_factor, \
             autovacuum_vacuum_threshold)"
        )],
    }
}

/// Version 3's check: a `CHECK` constraint on `state`, added `NOT VALID` so existing rows
/// are not checked (the dispatcher moves them to `dead` when it starts).
fn checks(o: &str) -> Ddl {
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
