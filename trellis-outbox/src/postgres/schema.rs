//! The PostgreSQL schema: what its DDL differs in ([`Schema`]).

use crate::dispatch::KNOWN_STATES;
use crate::sql::{ColumnTypes, Ddl, OPEN_KEYED, OPEN_STATES, Schema};

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
    ordering,
    unkeyed_claim,
    ordering_locks,
    open_keys,
    open_keys_undeduplicated,
};

/// Version 9: `<outbox>_ord_open` without deduplication. A btree keeps one posting list per
/// key for the entries of that key's rows, and a scan can mark an entry dead (so the next
/// scan skips it without reading the heap) only when **every** row in its posting list is
/// dead. A key's posting list mixes its dispatched rows with its open ones, so none was ever
/// marked: until a vacuum, each step of the key walk read the heap for every row its key had
/// dispatched since the last one (in the relay bench's 100,000-row drain, up to 11,000 heap
/// reads for the walk of one claim, and up to a third of its time or more). Without posting
/// lists each entry is marked on the first scan that finds its row dead. Posting lists
/// already built stay until a vacuum removes their dead rows; nothing is rebuilt. Reverted
/// by resetting the option.
fn open_keys_undeduplicated(o: &str) -> Ddl {
    Ddl {
        up: vec![format!(
            "ALTER INDEX IF EXISTS {o}_ord_open SET (deduplicate_items = off)"
        )],
        down: vec![format!(
            "ALTER INDEX IF EXISTS {o}_ord_open RESET (deduplicate_items)"
        )],
    }
}

/// Version 8: `<outbox>_ord_open`, the keys that have rows a claim may still take. The key
/// walk and the claim's "any keyed rows?" test read it instead of `<outbox>_ord_idx`, which
/// also holds dead rows: under `skip_dead` those are kept for inspection and block nothing,
/// yet every claim walked their keys, and a table whose keyed rows were all dispatched or
/// dead never went back to the plain unkeyed claim. Reverted by dropping it.
fn open_keys(o: &str) -> Ddl {
    Ddl {
        up: vec![format!(
            "CREATE INDEX IF NOT EXISTS {o}_ord_open ON {o} (ordering_key) WHERE {OPEN_KEYED}"
        )],
        down: vec![format!("DROP INDEX IF EXISTS {o}_ord_open")],
    }
}

/// How many advisory locks the ordering trigger spreads keys over from version 7 on.
const ORDERING_LOCKS: u32 = 1024;

/// Version 7: the ordering trigger locks a key's **bucket** (one of [`ORDERING_LOCKS`], by
/// the key's hash) instead of the key's own hash. A transaction holds its advisory locks to
/// its commit, and they come out of the server's shared lock table
/// (`max_locks_per_transaction` × connections, 6,400 entries on a stock server): version 5's
/// lock per distinct key made a transaction with more keys than that fail at commit with
/// "out of shared memory", losing the business transaction with it. Now one holds at most
/// 1,024. Two keys in one bucket serialise their commits (as two keys with one hash did
/// before), nothing worse. Reverted to version 5's function.
fn ordering_locks(o: &str) -> Ddl {
    Ddl {
        up: vec![ordering_function(o, &format!(" & {}", ORDERING_LOCKS - 1))],
        down: vec![ordering_function(o, "")],
    }
}

/// The ordering trigger's function: it takes the advisory lock `hashtext(key)<bucket>` of each
/// key (`bucket` is empty for version 5's lock per key hash, ` & 1023` for version 7's).
fn ordering_function(o: &str, bucket: &str) -> String {
    format!(
        "CREATE OR REPLACE FUNCTION {o}_ord_fn() RETURNS trigger LANGUAGE plpgsql AS $fn$ \
         DECLARE k int4; \
         BEGIN \
         IF current_setting('trellis_outbox.ordering_{o}', true) IS DISTINCT FROM 'locked' THEN \
         FOR k IN SELECT DISTINCT hashtext(ordering_key){bucket} FROM {o} \
         WHERE ordering_key IS NOT NULL AND ordering_seq IS NULL ORDER BY 1 LOOP \
         PERFORM pg_advisory_xact_lock(hashtext('{o}'), k); \
         END LOOP; \
         PERFORM set_config('trellis_outbox.ordering_{o}', 'locked', true); \
         END IF; \
         PERFORM pg_advisory_xact_lock(hashtext('{o}'), hashtext(NEW.ordering_key){bucket}); \
         UPDATE {o} SET ordering_seq = nextval('{o}_ord_seq') \
         WHERE id = NEW.id AND ordering_seq IS NULL; \
         RETURN NULL; \
         END $fn$"
    )
}

/// Version 6: `<outbox>_claim_idx` holds only the open rows **without** an ordering key, so
/// that the claim of unkeyed rows never reads past keyed ones (which it does not take: the
/// claim finds those key by key, through `<outbox>_ord_idx`). Rebuilt under the same name,
/// as version 3 did; reverted to version 3's.
fn unkeyed_claim(o: &str) -> Ddl {
    Ddl {
        up: vec![
            format!("DROP INDEX IF EXISTS {o}_claim_idx"),
            format!(
                "CREATE INDEX IF NOT EXISTS {o}_claim_idx ON {o} (created_at, id) \
                 WHERE state IN ({OPEN_STATES}) AND ordering_key IS NULL"
            ),
        ],
        down: Ddl::claim_index_v3(o).into(),
    }
}

/// Version 5: per-key ordering. Three nullable columns (upstream Trellis' writer sets none,
/// so its rows stay unordered), the index the claim's head test reads, and a sequence
/// number per keyed row taken **at commit**:
///
/// A deferred constraint trigger fires for each keyed row just before its transaction
/// commits. It takes a transaction-level advisory lock on the row's key and then numbers the
/// row from `<outbox>_ord_seq`. The lock is held from that moment to the commit, so the
/// next transaction with the same key can take its number only after this one has committed
/// (or rolled back): within a key, number order is commit order. Same-key writers wait for
/// each other only for the few statements between pre-commit and commit, not for their
/// whole transactions.
///
/// A transaction with rows of several keys locks all of its keys in one global order (by
/// hash) on the first firing, so two such transactions cannot deadlock on each other's
/// keys. (After `SET CONSTRAINTS … IMMEDIATE` the trigger fires per statement and a later
/// statement's keys are locked as they come, which can deadlock; Postgres then aborts one.)
/// The hash's 32 bits may give two keys the same lock: they then serialise their commits,
/// nothing worse. Until the trigger fires a row's `ordering_seq` is NULL, but no other
/// transaction can see the row before its commit anyway.
fn ordering(o: &str) -> Ddl {
    let add = "ADD COLUMN IF NOT EXISTS";
    Ddl {
        up: vec![
            format!("ALTER TABLE {o} {add} ordering_key text"),
            format!("ALTER TABLE {o} {add} ordering_seq bigint"),
            format!("ALTER TABLE {o} {add} ordering_skip_dead boolean"),
            format!("CREATE SEQUENCE IF NOT EXISTS {o}_ord_seq"),
            crate::sql::ordering_index(o),
            // The rows still to number (this transaction's own: committed rows are numbered).
            format!(
                "CREATE INDEX IF NOT EXISTS {o}_ord_new ON {o} (ordering_key) \
                 WHERE ordering_key IS NOT NULL AND ordering_seq IS NULL"
            ),
            ordering_function(o, ""),
            format!("DROP TRIGGER IF EXISTS {o}_ord_trg ON {o}"),
            format!(
                "CREATE CONSTRAINT TRIGGER {o}_ord_trg AFTER INSERT ON {o} \
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW \
                 WHEN (NEW.ordering_key IS NOT NULL) EXECUTE FUNCTION {o}_ord_fn()"
            ),
        ],
        down: vec![
            format!("DROP TRIGGER IF EXISTS {o}_ord_trg ON {o}"),
            format!("DROP FUNCTION IF EXISTS {o}_ord_fn()"),
            format!("DROP INDEX IF EXISTS {o}_ord_new"),
            format!("DROP INDEX IF EXISTS {o}_ord_idx"),
            format!("DROP SEQUENCE IF EXISTS {o}_ord_seq"),
            format!("ALTER TABLE {o} DROP COLUMN IF EXISTS ordering_skip_dead"),
            format!("ALTER TABLE {o} DROP COLUMN IF EXISTS ordering_seq"),
            format!("ALTER TABLE {o} DROP COLUMN IF EXISTS ordering_key"),
        ],
    }
}

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
