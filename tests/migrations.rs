//! Migration artifacts (spec §B.2–§B.4, §G 17–19) and `migrate` on real databases.

use futures::future::join_all;
use trellis_outbox::{
    Dialect, Error, OutboxTables, TableKind, migrate, migrate_with, migration_script, migrations,
};
use trellis_outbox_tests::{TestPg, TestSqlite};

fn service_tables() -> OutboxTables {
    OutboxTables::new("service_outbox", "service_inbox").unwrap()
}

// Expected checksums were computed with the reference Python implementation in the spec
// (§B.4), not with this crate.
#[test]
fn ids_versions_and_checksums_match_upstream() {
    let cases = [
        (
            Dialect::Sqlite,
            OutboxTables::default(),
            "trellis_sql_outbox_inbox_sqlite_v1",
            "fnv1a64:8178e5295d0acfeb",
        ),
        (
            Dialect::Postgres,
            OutboxTables::default(),
            "trellis_sql_outbox_inbox_postgres_v1",
            "fnv1a64:475148d1080cf8cf",
        ),
        (
            Dialect::Sqlite,
            service_tables(),
            "trellis_sql_outbox_inbox_sqlite_v1",
            "fnv1a64:d10ccc8ff04a835d",
        ),
        (
            Dialect::Postgres,
            service_tables(),
            "trellis_sql_outbox_inbox_postgres_v1",
            "fnv1a64:cb095f4939d76a4d",
        ),
    ];
    for (dialect, tables, id, checksum) in cases {
        let all = migrations(dialect, &tables);
        let v1 = &all[0];
        assert_eq!(v1.id, id);
        assert_eq!(v1.version, 1);
        assert_eq!(v1.dialect, dialect);
        assert_eq!(v1.checksum, checksum, "{dialect} {tables:?}");
        assert_eq!(v1.up.len(), 3);
        assert_eq!(v1.down.len(), 3);
        assert!(all.windows(2).all(|w| w[0].version < w[1].version));
    }
}

// Later versions never change: their checksums are pinned here (computed independently).
#[test]
fn v2_is_pinned_and_additive() {
    for (dialect, checksum) in [
        (Dialect::Sqlite, "fnv1a64:94cf470321c5fd96"),
        (Dialect::Postgres, "fnv1a64:8dbbb57ee3346707"),
    ] {
        let all = migrations(dialect, &OutboxTables::default());
        let v2 = &all[1];
        assert_eq!(v2.id, format!("trellis_sql_outbox_inbox_{dialect}_v2"));
        assert_eq!(v2.version, 2);
        assert_eq!(v2.checksum, checksum, "{dialect}");
        assert!(
            v2.up
                .iter()
                .all(|s| s.starts_with("ALTER TABLE trellis_outbox ADD COLUMN")
                    || s.starts_with("CREATE INDEX IF NOT EXISTS")
                    || s == "ALTER TABLE trellis_outbox SET (fillfactor = 50, \
                             autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000)")
        );
    }
}

// Checksums computed independently (FNV-1a 64 over code points, in Python).
#[test]
fn v3_is_pinned() {
    for (dialect, checksum) in [
        (Dialect::Sqlite, "fnv1a64:33ea789a4bfc5df9"),
        (Dialect::Postgres, "fnv1a64:60a1bb47a8cb8d22"),
    ] {
        let all = migrations(dialect, &OutboxTables::default());
        assert_eq!(all.len(), 9);
        let v3 = &all[2];
        assert_eq!(v3.id, format!("trellis_sql_outbox_inbox_{dialect}_v3"));
        assert_eq!(v3.version, 3);
        assert_eq!(v3.checksum, checksum, "{dialect}");
    }
    let pg = &migrations(Dialect::Postgres, &OutboxTables::default())[2];
    assert_eq!(
        pg.up[1],
        "ALTER TABLE trellis_outbox ADD CONSTRAINT trellis_outbox_state_ck CHECK (state IN \
         ('pending', 'claimed', 'dispatched', 'failed', 'dead')) NOT VALID"
    );
    assert_eq!(
        pg.up[3],
        "CREATE INDEX IF NOT EXISTS trellis_outbox_claim_idx ON trellis_outbox (created_at, id) \
         WHERE state IN ('pending', 'failed', 'claimed')"
    );
    assert_eq!(
        pg.up[4],
        "UPDATE trellis_outbox SET next_attempt_at = '9999-12-31 23:59:59.999+00' WHERE state = 'dead'"
    );
    assert_eq!(
        pg.down.last().map(String::as_str),
        Some("ALTER TABLE trellis_outbox DROP CONSTRAINT IF EXISTS trellis_outbox_state_ck")
    );
}

// Both dialects share version 4's text, so its checksum too.
#[test]
fn v4_is_pinned() {
    for dialect in [Dialect::Sqlite, Dialect::Postgres] {
        let v4 = &migrations(dialect, &OutboxTables::default())[3];
        assert_eq!(v4.id, format!("trellis_sql_outbox_inbox_{dialect}_v4"));
        assert_eq!(v4.version, 4);
        assert_eq!(v4.checksum, "fnv1a64:41dc50606feba327", "{dialect}");
        assert_eq!(
            v4.up,
            [
                "CREATE INDEX IF NOT EXISTS trellis_outbox_done_idx ON trellis_outbox (updated_at) WHERE state = 'dispatched'",
                "CREATE INDEX IF NOT EXISTS trellis_inbox_recv_idx ON trellis_inbox (received_at)",
            ]
        );
    }
}

// Version 5: per-key ordering (issue #15). Checksums computed independently (Python).
#[test]
fn v5_is_pinned() {
    for (dialect, checksum, statements) in [
        (Dialect::Sqlite, "fnv1a64:889ae571c38b567a", 4),
        (Dialect::Postgres, "fnv1a64:f4e56595a45db5fe", 9),
    ] {
        let all = migrations(dialect, &OutboxTables::default());
        assert_eq!(all.len(), 9);
        let v5 = &all[4];
        assert_eq!(v5.id, format!("trellis_sql_outbox_inbox_{dialect}_v5"));
        assert_eq!(v5.version, 5);
        assert_eq!(v5.checksum, checksum, "{dialect}");
        assert_eq!(v5.up.len(), statements, "{dialect}");
        assert!(v5.up.contains(
            &"CREATE INDEX IF NOT EXISTS trellis_outbox_ord_idx ON trellis_outbox (ordering_key, ordering_seq) \
              WHERE ordering_key IS NOT NULL AND state <> 'dispatched'"
                .to_owned()
        ));
    }
    let pg = &migrations(Dialect::Postgres, &OutboxTables::default())[4];
    assert_eq!(
        pg.up[8],
        "CREATE CONSTRAINT TRIGGER trellis_outbox_ord_trg AFTER INSERT ON trellis_outbox \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL) \
         EXECUTE FUNCTION trellis_outbox_ord_fn()"
    );
}

#[test]
fn v1_sql_is_upstreams_text() {
    let m = &migrations(Dialect::Sqlite, &OutboxTables::default())[0];
    assert_eq!(
        m.up,
        [
            "CREATE TABLE IF NOT EXISTS trellis_outbox (id TEXT PRIMARY KEY, kind TEXT NOT NULL, name TEXT NOT NULL, subject TEXT NOT NULL, payload TEXT NOT NULL, headers TEXT NOT NULL, state TEXT NOT NULL, attempts INTEGER NOT NULL, created_at TEXT NOT NULL, updated_at TEXT NOT NULL, next_attempt_at TEXT, last_error TEXT, outcome TEXT)",
            "CREATE INDEX IF NOT EXISTS trellis_outbox_due_idx ON trellis_outbox (state, next_attempt_at)",
            "CREATE TABLE IF NOT EXISTS trellis_inbox (message_id TEXT PRIMARY KEY, received_at TEXT NOT NULL)",
        ]
    );
    assert_eq!(
        m.down,
        [
            "DROP INDEX IF EXISTS trellis_outbox_due_idx",
            "DROP TABLE IF EXISTS trellis_inbox",
            "DROP TABLE IF EXISTS trellis_outbox",
        ]
    );
}

// §G 18.
#[test]
fn migrations_include_table_names_and_key_columns() {
    let sqlite = migrations(Dialect::Sqlite, &service_tables())[0]
        .up
        .join("\n");
    for needle in [
        "CREATE TABLE IF NOT EXISTS service_outbox",
        "id TEXT PRIMARY KEY",
        "kind TEXT NOT NULL",
        "name TEXT NOT NULL",
        "subject TEXT NOT NULL",
        "payload TEXT NOT NULL",
        "headers TEXT NOT NULL",
        "CREATE TABLE IF NOT EXISTS service_inbox (message_id TEXT PRIMARY KEY",
    ] {
        assert!(sqlite.contains(needle), "sqlite up lacks {needle}");
    }
    let pg = migrations(Dialect::Postgres, &OutboxTables::default())[0]
        .up
        .join("\n");
    for needle in [
        "id text PRIMARY KEY",
        "headers jsonb NOT NULL",
        "created_at timestamptz NOT NULL",
        "message_id text PRIMARY KEY",
    ] {
        assert!(pg.contains(needle), "postgres up lacks {needle}");
    }
}

// §G 19, plus the list. A rejected name never reaches SQL: every API takes
// `OutboxTables`, which cannot be built from it.
#[test]
fn unsafe_table_names_are_rejected() {
    for bad in [
        "tenant.trellis_outbox",
        "tenant.x",
        "a b",
        "x;drop table y",
        "",
        "1abc",
        "abc\n",
    ] {
        let err = OutboxTables::new(bad, "trellis_inbox").unwrap_err();
        assert!(
            matches!(&err, Error::InvalidTableName { kind: TableKind::Outbox, name } if name == bad),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "Invalid SQL outbox table name \"{bad}\". Use a simple identifier matching ^[A-Za-z_][A-Za-z0-9_]*$."
            )
        );
    }
    let err = OutboxTables::new("trellis_outbox", "trellis-inbox").unwrap_err();
    assert_eq!(
        err.to_string(),
        "Invalid SQL inbox table name \"trellis-inbox\". Use a simple identifier matching ^[A-Za-z_][A-Za-z0-9_]*$."
    );
}

// Version 8: on Postgres an index of the keys with open rows, which the key walk reads (dead
// rows no longer cost every claim); nothing on SQLite. Checksums computed independently
// (Python).
#[test]
fn v8_is_pinned() {
    for (dialect, checksum, statements) in [
        (Dialect::Sqlite, "fnv1a64:439101d5f448b098", 0),
        (Dialect::Postgres, "fnv1a64:7212eb1432a97a6d", 1),
    ] {
        let all = migrations(dialect, &OutboxTables::default());
        assert_eq!(all.len(), 9);
        let v8 = &all[7];
        assert_eq!(v8.id, format!("trellis_sql_outbox_inbox_{dialect}_v8"));
        assert_eq!(v8.version, 8);
        assert_eq!(v8.checksum, checksum, "{dialect}");
        assert_eq!(v8.up.len(), statements, "{dialect}");
    }
}

// Version 9: on Postgres that index without deduplication (a posting list that mixed a key's
// dispatched rows with its open ones was never marked dead, so the key walk read the heap for
// every dispatched row until a vacuum); nothing on SQLite. Checksums computed independently
// (Python).
#[test]
fn v9_is_pinned() {
    for (dialect, checksum, statements) in [
        (Dialect::Sqlite, "fnv1a64:439101d5f448b098", 0),
        (Dialect::Postgres, "fnv1a64:08ca84e37266e491", 1),
    ] {
        let all = migrations(dialect, &OutboxTables::default());
        assert_eq!(all.len(), 9);
        let v9 = &all[8];
        assert_eq!(v9.id, format!("trellis_sql_outbox_inbox_{dialect}_v9"));
        assert_eq!(v9.version, 9);
        assert_eq!(v9.checksum, checksum, "{dialect}");
        assert_eq!(v9.up.len(), statements, "{dialect}");
    }
    let pg = &migrations(Dialect::Postgres, &OutboxTables::default())[8];
    assert_eq!(
        pg.up,
        ["ALTER INDEX IF EXISTS trellis_outbox_ord_open SET (deduplicate_items = off)"]
    );
    assert_eq!(
        pg.down,
        ["ALTER INDEX IF EXISTS trellis_outbox_ord_open RESET (deduplicate_items)"]
    );
}

// Version 7: the Postgres ordering trigger locks one of 1,024 buckets per key instead of a
// lock per key (a transaction with more keys than the lock table holds failed at commit);
// nothing on SQLite. Checksums computed independently (Python).
#[test]
fn v7_is_pinned() {
    for (dialect, checksum, statements) in [
        (Dialect::Sqlite, "fnv1a64:439101d5f448b098", 0),
        (Dialect::Postgres, "fnv1a64:761cd5a2ac749a92", 1),
    ] {
        let all = migrations(dialect, &OutboxTables::default());
        let v7 = &all[6];
        assert_eq!(v7.id, format!("trellis_sql_outbox_inbox_{dialect}_v7"));
        assert_eq!(v7.version, 7);
        assert_eq!(v7.checksum, checksum, "{dialect}");
        assert_eq!(v7.up.len(), statements, "{dialect}");
    }
    let all = migrations(Dialect::Postgres, &OutboxTables::default());
    let v7 = &all[6];
    assert_eq!(v7.up[0].matches("& 1023").count(), 2, "{}", v7.up[0]);
    // Reverting puts back version 5's function, statement for statement.
    assert!(all[4].up.contains(&v7.down[0]), "{}", v7.down[0]);
}

// Version 6: the Postgres claim index loses the keyed rows (issue #15); nothing on SQLite.
// Checksums computed independently (Python).
#[test]
fn v6_is_pinned() {
    for (dialect, checksum, statements) in [
        (Dialect::Sqlite, "fnv1a64:439101d5f448b098", 0),
        (Dialect::Postgres, "fnv1a64:a3ceb0d5a5216ec6", 2),
    ] {
        let all = migrations(dialect, &OutboxTables::default());
        let v6 = &all[5];
        assert_eq!(v6.id, format!("trellis_sql_outbox_inbox_{dialect}_v6"));
        assert_eq!(v6.version, 6);
        assert_eq!(v6.checksum, checksum, "{dialect}");
        assert_eq!(v6.up.len(), statements, "{dialect}");
    }
    let pg = &migrations(Dialect::Postgres, &OutboxTables::default())[5];
    assert_eq!(
        pg.up[1],
        "CREATE INDEX IF NOT EXISTS trellis_outbox_claim_idx ON trellis_outbox (created_at, id) \
         WHERE state IN ('pending', 'failed', 'claimed') AND ordering_key IS NULL"
    );
    // Reverted to version 3's index.
    assert_eq!(
        pg.down[1],
        "CREATE INDEX IF NOT EXISTS trellis_outbox_claim_idx ON trellis_outbox (created_at, id) \
         WHERE state IN ('pending', 'failed', 'claimed')"
    );
}

#[test]
fn script_is_pasteable() {
    let sql = migration_script(Dialect::Sqlite, &OutboxTables::default());
    assert!(sql.starts_with(
        "-- trellis_sql_outbox_inbox_sqlite_v1 (up), version 1, fnv1a64:8178e5295d0acfeb\n"
    ));
    assert_eq!(
        sql.matches(";\n").count(),
        17,
        "SQLite: 3 statements in v1 and v2, 5 in v3, 2 in v4, 4 in v5, none in v6 to v9"
    );
}

async fn pg_table_exists(pool: &sqlx::PgPool, name: &str) -> bool {
    sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NOT NULL")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn sqlite_table_exists(pool: &sqlx::SqlitePool, name: &str) -> bool {
    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM sqlite_master WHERE name = ?")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
        == 1
}

#[tokio::test]
async fn pg_migrate_twice_is_a_no_op() {
    let db = TestPg::new().await;
    let first = migrate(&db.pool).await.unwrap();
    assert_eq!(
        first.applied,
        [
            "trellis_sql_outbox_inbox_postgres_v1",
            "trellis_sql_outbox_inbox_postgres_v2",
            "trellis_sql_outbox_inbox_postgres_v3",
            "trellis_sql_outbox_inbox_postgres_v4",
            "trellis_sql_outbox_inbox_postgres_v5",
            "trellis_sql_outbox_inbox_postgres_v6",
            "trellis_sql_outbox_inbox_postgres_v7",
            "trellis_sql_outbox_inbox_postgres_v8",
            "trellis_sql_outbox_inbox_postgres_v9"
        ]
    );
    assert!(first.already_applied.is_empty());
    for table in [
        "trellis_outbox",
        "trellis_inbox",
        "trellis_outbox_due_idx",
        "trellis_outbox_migrations",
    ] {
        assert!(pg_table_exists(&db.pool, table).await, "{table} missing");
    }
    let options: Vec<String> = sqlx::query_scalar(
        "SELECT unnest(reloptions) FROM pg_class WHERE relname = 'trellis_outbox'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        options,
        [
            "fillfactor=50",
            "autovacuum_vacuum_scale_factor=0",
            "autovacuum_vacuum_threshold=10000"
        ]
    );
    let second = migrate(&db.pool).await.unwrap();
    assert!(second.applied.is_empty());
    assert_eq!(
        second.already_applied,
        [
            "trellis_sql_outbox_inbox_postgres_v1",
            "trellis_sql_outbox_inbox_postgres_v2",
            "trellis_sql_outbox_inbox_postgres_v3",
            "trellis_sql_outbox_inbox_postgres_v4",
            "trellis_sql_outbox_inbox_postgres_v5",
            "trellis_sql_outbox_inbox_postgres_v6",
            "trellis_sql_outbox_inbox_postgres_v7",
            "trellis_sql_outbox_inbox_postgres_v8",
            "trellis_sql_outbox_inbox_postgres_v9"
        ]
    );
    let (id, checksum): (String, String) = sqlx::query_as(
        "SELECT id, checksum FROM trellis_outbox_migrations WHERE outbox_table = 'trellis_outbox' AND version = 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(id, "trellis_sql_outbox_inbox_postgres_v1");
    assert_eq!(checksum, "fnv1a64:475148d1080cf8cf");
    db.close().await;
}

#[tokio::test]
async fn sqlite_migrate_twice_is_a_no_op() {
    let db = TestSqlite::new().await;
    let first = migrate(&db.pool).await.unwrap();
    assert_eq!(
        first.applied,
        [
            "trellis_sql_outbox_inbox_sqlite_v1",
            "trellis_sql_outbox_inbox_sqlite_v2",
            "trellis_sql_outbox_inbox_sqlite_v3",
            "trellis_sql_outbox_inbox_sqlite_v4",
            "trellis_sql_outbox_inbox_sqlite_v5",
            "trellis_sql_outbox_inbox_sqlite_v6",
            "trellis_sql_outbox_inbox_sqlite_v7",
            "trellis_sql_outbox_inbox_sqlite_v8",
            "trellis_sql_outbox_inbox_sqlite_v9"
        ]
    );
    for table in [
        "trellis_outbox",
        "trellis_inbox",
        "trellis_outbox_due_idx",
        "trellis_outbox_migrations",
    ] {
        assert!(
            sqlite_table_exists(&db.pool, table).await,
            "{table} missing"
        );
    }
    let second = migrate(&db.pool).await.unwrap();
    assert!(second.applied.is_empty());
    assert_eq!(
        second.already_applied,
        [
            "trellis_sql_outbox_inbox_sqlite_v1",
            "trellis_sql_outbox_inbox_sqlite_v2",
            "trellis_sql_outbox_inbox_sqlite_v3",
            "trellis_sql_outbox_inbox_sqlite_v4",
            "trellis_sql_outbox_inbox_sqlite_v5",
            "trellis_sql_outbox_inbox_sqlite_v6",
            "trellis_sql_outbox_inbox_sqlite_v7",
            "trellis_sql_outbox_inbox_sqlite_v8",
            "trellis_sql_outbox_inbox_sqlite_v9"
        ]
    );
}

#[tokio::test]
async fn pg_tampered_checksum_is_refused() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::query("UPDATE trellis_outbox_migrations SET checksum = 'fnv1a64:0000000000000000'")
        .execute(&db.pool)
        .await
        .unwrap();
    let err = migrate(&db.pool).await.unwrap_err();
    match &err {
        Error::ChecksumMismatch {
            id,
            version,
            recorded,
            expected,
        } => {
            assert_eq!(id, "trellis_sql_outbox_inbox_postgres_v1");
            assert_eq!(*version, 1);
            assert_eq!(recorded, "fnv1a64:0000000000000000");
            assert_eq!(expected, "fnv1a64:475148d1080cf8cf");
        }
        other => panic!("expected ChecksumMismatch, got {other:?}"),
    }
    assert!(
        err.to_string()
            .contains("trellis_sql_outbox_inbox_postgres_v1")
    );
    assert!(!err.is_retryable());
    db.close().await;
}

#[tokio::test]
async fn sqlite_tampered_checksum_is_refused() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::query("UPDATE trellis_outbox_migrations SET checksum = 'fnv1a64:1111111111111111'")
        .execute(&db.pool)
        .await
        .unwrap();
    let err = migrate(&db.pool).await.unwrap_err();
    assert!(
        matches!(&err, Error::ChecksumMismatch { id, .. } if id == "trellis_sql_outbox_inbox_sqlite_v1"),
        "{err:?}"
    );
}

#[tokio::test]
async fn pg_concurrent_migrations_apply_once() {
    let db = TestPg::new().await;
    let reports = join_all((0..4).map(|_| migrate(&db.pool))).await;
    let applied: usize = reports.into_iter().map(|r| r.unwrap().applied.len()).sum();
    assert_eq!(applied, 9, "each version applied by exactly one caller");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_outbox_migrations")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, 9, "one bookkeeping row per version");
    db.close().await;
}

#[tokio::test]
async fn sqlite_concurrent_migrations_apply_once() {
    let db = TestSqlite::new().await;
    let reports = join_all((0..4).map(|_| migrate(&db.pool))).await;
    let applied: usize = reports.into_iter().map(|r| r.unwrap().applied.len()).sum();
    assert_eq!(applied, 9, "each version applied by exactly one caller");
}

#[tokio::test]
async fn pg_custom_tables_are_separate_and_default_ones_untouched() {
    let db = TestPg::new().await;
    let report = migrate_with(&db.pool, &service_tables()).await.unwrap();
    assert_eq!(report.applied.len(), 9);
    assert!(pg_table_exists(&db.pool, "service_outbox").await);
    assert!(pg_table_exists(&db.pool, "service_inbox").await);
    assert!(!pg_table_exists(&db.pool, "trellis_outbox").await);
    // The default tables are migrated independently in the same database.
    assert_eq!(migrate(&db.pool).await.unwrap().applied.len(), 9);
    assert!(pg_table_exists(&db.pool, "trellis_outbox").await);
    db.close().await;
}

// A database prepared by the TypeScript service with upstream's DDL keeps its rows and is
// recognised as being at version 1.
#[tokio::test]
async fn sqlite_adopts_a_table_created_by_trellis_ts() {
    let db = TestSqlite::new().await;
    for statement in &migrations(Dialect::Sqlite, &OutboxTables::default())[0].up {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement.clone()))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    sqlx::query("INSERT INTO trellis_outbox VALUES ('ts-1', 'event.publish', 'A.B', 'events.v1.A.B', '{}', '{}', 'pending', 0, '2026-05-25T00:00:00.000Z', '2026-05-25T00:00:00.000Z', NULL, NULL, NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let report = migrate(&db.pool).await.unwrap();
    assert_eq!(
        report.applied,
        [
            "trellis_sql_outbox_inbox_sqlite_v1",
            "trellis_sql_outbox_inbox_sqlite_v2",
            "trellis_sql_outbox_inbox_sqlite_v3",
            "trellis_sql_outbox_inbox_sqlite_v4",
            "trellis_sql_outbox_inbox_sqlite_v5",
            "trellis_sql_outbox_inbox_sqlite_v6",
            "trellis_sql_outbox_inbox_sqlite_v7",
            "trellis_sql_outbox_inbox_sqlite_v8",
            "trellis_sql_outbox_inbox_sqlite_v9"
        ]
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM trellis_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, 1);
}

/// Trellis 0.10's tables (column `event`, no `kind`, no `outcome`, no migration record), as
/// 0.10 created them, with one 0.10 row.
const LEGACY_0_10: [(&str, &str); 2] = [
    (
        "CREATE TABLE IF NOT EXISTS trellis_outbox (id TEXT PRIMARY KEY, event TEXT NOT NULL, subject TEXT NOT NULL, payload TEXT NOT NULL, headers TEXT NOT NULL, state TEXT NOT NULL, attempts INTEGER NOT NULL, created_at TEXT NOT NULL, updated_at TEXT NOT NULL, next_attempt_at TEXT, last_error TEXT)",
        "INSERT INTO trellis_outbox VALUES ('legacy-1', 'Document.Processed', 'events.v1.Integration.Outbox.Document.Processed.legacy', '{\"documentId\":\"legacy-doc\"}', '{}', 'pending', 0, '2026-01-01T00:00:00.000Z', '2026-01-01T00:00:00.000Z', NULL, NULL)",
    ),
    (
        "CREATE TABLE IF NOT EXISTS trellis_outbox (id text PRIMARY KEY, event text NOT NULL, subject text NOT NULL, payload text NOT NULL, headers jsonb NOT NULL, state text NOT NULL, attempts integer NOT NULL, created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL, next_attempt_at timestamptz, last_error text)",
        "INSERT INTO trellis_outbox VALUES ('legacy-1', 'Document.Processed', 'events.v1.Integration.Outbox.Document.Processed.legacy', '{\"documentId\":\"legacy-doc\"}', '{}', 'pending', 0, '2026-01-01T00:00:00.000Z', '2026-01-01T00:00:00.000Z', NULL, NULL)",
    ),
];

/// A 0.10 table is upgraded in place at `migrate` (never recorded as version 1 with inserts
/// failing later): its rows keep their data, become events named by their old `event`, and
/// are dispatched; new records enqueue.
async fn legacy_0_10_table_is_upgraded<DB, R>(pool: &sqlx::Pool<DB>, legacy: (&str, &str), repo: R)
where
    DB: trellis_outbox::OutboxDatabase,
    R: trellis_outbox::OutboxRepository,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    for statement in [legacy.0, legacy.1] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_owned()))
            .execute(pool)
            .await
            .unwrap();
    }
    let report = migrate(pool).await.unwrap();
    assert!(report.upgraded_from_0_10);
    assert_eq!(report.applied.len(), 9);
    let again = migrate(pool).await.unwrap();
    assert!(!again.upgraded_from_0_10 && again.applied.is_empty());

    let mut tx = pool.begin().await.unwrap();
    trellis_outbox::OutboxTransactionExt::enqueue(
        &mut tx,
        &trellis_outbox::PreparedOutboxRecord::event("A.B", "events.v1.A.B", &1).unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let publisher = trellis_outbox_tests::publisher::RecordingPublisher::new();
    let report = trellis_outbox::dispatch_outbox(&repo, &publisher, Default::default())
        .await
        .unwrap();
    assert_eq!(report.dispatched, 2);
    let legacy_attempt = publisher
        .attempts()
        .into_iter()
        .find(|a| a.id == "legacy-1")
        .expect("the 0.10 row was not published");
    assert_eq!(legacy_attempt.attempts, 0);
}

#[tokio::test]
async fn sqlite_legacy_0_10_table_is_upgraded() {
    let db = TestSqlite::new().await;
    let repo = trellis_outbox::SqliteOutboxRepository::new(db.pool.clone());
    legacy_0_10_table_is_upgraded(&db.pool, LEGACY_0_10[0], repo).await;
    let (name, kind): (String, String) =
        sqlx::query_as("SELECT name, kind FROM trellis_outbox WHERE id = 'legacy-1'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (name.as_str(), kind.as_str()),
        ("Document.Processed", "event.publish")
    );
}

#[tokio::test]
async fn postgres_legacy_0_10_table_is_upgraded() {
    let db = TestPg::new().await;
    let repo = trellis_outbox::PgOutboxRepository::new(db.pool.clone());
    legacy_0_10_table_is_upgraded(&db.pool, LEGACY_0_10[1], repo).await;
    let (name, kind): (String, String) =
        sqlx::query_as("SELECT name, kind FROM trellis_outbox WHERE id = 'legacy-1'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (name.as_str(), kind.as_str()),
        ("Document.Processed", "event.publish")
    );
    db.close().await;
}

/// Postgres folds unquoted names to lower case: `Mixed_Outbox` is the table `mixed_outbox`.
/// A 0.10 table under it is found and upgraded, and the other spelling finds the record.
#[tokio::test]
async fn pg_mixed_case_names_are_one_table() {
    let db = TestPg::new().await;
    for statement in [LEGACY_0_10[1].0, LEGACY_0_10[1].1] {
        let statement = statement.replace("trellis_outbox", "mixed_outbox");
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let mixed = OutboxTables::new("Mixed_Outbox", "Mixed_Inbox").unwrap();
    let report = migrate_with(&db.pool, &mixed).await.unwrap();
    assert!(report.upgraded_from_0_10, "{report:?}");
    assert_eq!(report.applied.len(), 9);
    let lower = OutboxTables::new("mixed_outbox", "mixed_inbox").unwrap();
    let again = migrate_with(&db.pool, &lower).await.unwrap();
    assert!(again.applied.is_empty(), "{again:?}");
    assert_eq!(again.already_applied.len(), 9);
    let outbox = trellis_outbox::Outbox::new(mixed);
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .enqueue(
            &mut tx,
            &trellis_outbox::PreparedOutboxRecord::event("A.B", "events.v1.A.B", &1).unwrap(),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM mixed_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, 2);
    db.close().await;
}

/// SQLite compares table names without case: the second spelling finds the first's record
/// instead of applying version 2's `ADD COLUMN`s again.
#[tokio::test]
async fn sqlite_mixed_case_names_share_their_record() {
    let db = TestSqlite::new().await;
    let mixed = OutboxTables::new("Mixed_Outbox", "Mixed_Inbox").unwrap();
    assert_eq!(
        migrate_with(&db.pool, &mixed).await.unwrap().applied.len(),
        9
    );
    let lower = OutboxTables::new("mixed_outbox", "mixed_inbox").unwrap();
    let again = migrate_with(&db.pool, &lower).await.unwrap();
    assert!(again.applied.is_empty(), "{again:?}");
}

/// Tables set up from `migration_script` (pasted into another tool, which records nothing
/// here) can be migrated later: SQLite has no `ADD COLUMN IF NOT EXISTS`, so the runner
/// skips the columns that are there. Postgres' versions are idempotent.
async fn tables_from_the_script_can_be_migrated<DB: trellis_outbox::OutboxDatabase>(
    pool: &sqlx::Pool<DB>,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let script = migration_script(DB::DIALECT, &OutboxTables::default());
    sqlx::raw_sql(sqlx::AssertSqlSafe(script))
        .execute(pool)
        .await
        .unwrap();
    let report = migrate(pool).await.unwrap();
    assert_eq!(report.applied.len(), 9, "{report:?}");
    assert!(migrate(pool).await.unwrap().applied.is_empty());
}

#[tokio::test]
async fn sqlite_tables_from_the_script_can_be_migrated() {
    let db = TestSqlite::new().await;
    tables_from_the_script_can_be_migrated(&db.pool).await;
}

#[tokio::test]
async fn pg_tables_from_the_script_can_be_migrated() {
    let db = TestPg::new().await;
    tables_from_the_script_can_be_migrated(&db.pool).await;
    db.close().await;
}

/// A migration recorded by a newer version is reported (and logged), not an error.
#[tokio::test]
async fn sqlite_a_newer_schema_is_reported() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::query(
        "INSERT INTO trellis_outbox_migrations VALUES \
         ('trellis_outbox', 99, 'trellis_sql_outbox_inbox_sqlite_v99', 'fnv1a64:0', '2026-01-01')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let report = migrate(&db.pool).await.unwrap();
    assert!(report.applied.is_empty());
    assert_eq!(report.unknown, ["trellis_sql_outbox_inbox_sqlite_v99"]);
}

/// An application role without CREATE on the schema (Postgres 15's default on `public`) can
/// call `migrate` once the schema is migrated: nothing is created then.
#[tokio::test]
async fn pg_migrate_needs_no_create_privilege_when_nothing_is_pending() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let role = format!("{}_app", db.name).to_ascii_lowercase();
    for statement in [
        format!("CREATE ROLE {role} LOGIN"),
        "REVOKE CREATE ON SCHEMA public FROM PUBLIC".to_owned(),
        format!("GRANT SELECT, INSERT ON trellis_outbox_migrations TO {role}"),
        format!("GRANT SELECT ON trellis_outbox TO {role}"),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let app = sqlx::PgPool::connect_with(db.options.clone().username(&role))
        .await
        .unwrap();
    let outcome = migrate(&app).await;
    app.close().await;
    for statement in [format!("DROP OWNED BY {role}"), format!("DROP ROLE {role}")] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let report = outcome.unwrap();
    assert!(report.applied.is_empty() && report.already_applied.len() == 9);
    db.close().await;
}

/// Runs `migrate_with_options` with a lock timeout of `timeout` while another connection holds
/// an `ACCESS SHARE` lock on the outbox table (a long query) and version 6 is pending: its
/// `DROP INDEX` needs an `ACCESS EXCLUSIVE` lock. Gives up after 30 s (no timeout applied).
async fn pg_migrate_behind_a_lock(
    db: &TestPg,
    timeout: std::time::Duration,
) -> Result<trellis_outbox::MigrationReport, Error> {
    use sqlx::Connection as _;

    let mut holder = sqlx::PgConnection::connect_with(&db.options).await.unwrap();
    sqlx::raw_sql("BEGIN; LOCK TABLE trellis_outbox IN ACCESS SHARE MODE")
        .execute(&mut holder)
        .await
        .unwrap();
    let options = trellis_outbox::MigrateOptions::default().with_lock_timeout(timeout);
    let outcome = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        trellis_outbox::migrate_with_options(&db.pool, &OutboxTables::default(), &options),
    )
    .await;
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    holder.close().await.unwrap();
    outcome.expect("the migration still waited for the lock after 30 s")
}

// Postgres reads `lock_timeout = 0` as no limit: a timeout under a millisecond is rounded up
// to one, not down to "wait for ever".
#[tokio::test]
async fn pg_a_lock_timeout_under_a_millisecond_still_times_out() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::query("DELETE FROM trellis_outbox_migrations WHERE version = 6")
        .execute(&db.pool)
        .await
        .unwrap();
    let err = pg_migrate_behind_a_lock(&db, std::time::Duration::from_micros(500))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::MigrationLockTimeout { .. }), "{err:?}");
    db.close().await;
}

// Audit: `migrate` set no lock timeout, so a deploy waited behind a long transaction for ever
// (and every query on the table queued behind its ACCESS EXCLUSIVE request). A statement that
// waits longer than the lock timeout fails with a typed, retryable error naming the step, and
// nothing is applied; the next call applies the version.
#[tokio::test]
async fn pg_a_lock_timeout_is_a_typed_retryable_error_naming_the_step() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::query("DELETE FROM trellis_outbox_migrations WHERE version = 6")
        .execute(&db.pool)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let err = pg_migrate_behind_a_lock(&db, std::time::Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    match &err {
        Error::MigrationLockTimeout {
            step, lock_timeout, ..
        } => {
            assert_eq!(step, "trellis_sql_outbox_inbox_postgres_v6");
            assert_eq!(*lock_timeout, std::time::Duration::from_millis(300));
        }
        other => panic!("expected MigrationLockTimeout, got {other:?}"),
    }
    assert!(err.is_retryable());
    let message = err.to_string();
    assert!(
        message.contains("trellis_sql_outbox_inbox_postgres_v6") && message.contains("retry"),
        "{message}"
    );
    let recorded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trellis_outbox_migrations WHERE version = 6")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(recorded, 0, "nothing applied");
    let report = migrate(&db.pool).await.unwrap();
    assert_eq!(report.applied, ["trellis_sql_outbox_inbox_postgres_v6"]);
    db.close().await;
}

// Audit: the error steps must name what failed. On SQLite the migration begins with
// `BEGIN IMMEDIATE`, which takes the write lock: when another writer holds it past the busy
// timeout, the step says so (and the error is retryable).
#[tokio::test]
async fn sqlite_a_busy_write_lock_is_reported_as_the_begin_step() {
    use sqlx::Connection as _;

    let db = TestSqlite::new().await;
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&db.path)
        .busy_timeout(std::time::Duration::ZERO);
    let mut holder = sqlx::SqliteConnection::connect_with(&options)
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut holder)
        .await
        .unwrap();
    let impatient = sqlx::SqlitePool::connect_with(options).await.unwrap();
    let err = migrate(&impatient).await.unwrap_err();
    impatient.close().await;
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    holder.close().await.unwrap();
    match &err {
        Error::Migrate { step, .. } => assert_eq!(step, "begin immediate (the write lock)"),
        other => panic!("expected Error::Migrate, got {other:?}"),
    }
    assert!(err.is_retryable(), "{err}");
}

/// The README's recipe for versions 8 and 9 on a large table: the index built beforehand with
/// `CREATE INDEX CONCURRENTLY` (the README's statement, copied here) is the one the migrations
/// would build, and they then apply without building another.
#[tokio::test]
async fn pg_version_8_accepts_its_index_built_concurrently_beforehand() {
    const README: &str = "CREATE INDEX CONCURRENTLY IF NOT EXISTS trellis_outbox_ord_open ON trellis_outbox (ordering_key) \
         WITH (deduplicate_items = off) \
         WHERE ordering_key IS NOT NULL AND state IN ('pending', 'failed', 'claimed')";
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let definition = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT pg_get_indexdef(indexrelid) FROM pg_index \
             WHERE indrelid = 'trellis_outbox'::regclass AND indisvalid \
             AND indexrelid::regclass::text = 'trellis_outbox_ord_open'",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap()
    };
    let migrated = definition().await;
    assert_eq!(migrated.len(), 1, "{migrated:?}");

    // A database at version 7, whose operator builds the index by hand.
    sqlx::raw_sql(
        "DROP INDEX trellis_outbox_ord_open; DELETE FROM trellis_outbox_migrations WHERE version >= 8",
    )
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::raw_sql(README).execute(&db.pool).await.unwrap();
    assert_eq!(
        definition().await,
        migrated,
        "the README's index is the migration's"
    );
    let report = migrate(&db.pool).await.unwrap();
    assert_eq!(
        report.applied,
        [
            "trellis_sql_outbox_inbox_postgres_v8",
            "trellis_sql_outbox_inbox_postgres_v9"
        ],
        "{report:?}"
    );
    let indexes: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_indexes WHERE tablename = 'trellis_outbox' AND indexname LIKE '%ord_open%'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(indexes, 1);
    db.close().await;
}

/// The fewest heap reads of one key-walk step (`min(ordering_key)` over `<outbox>_ord_open`)
/// in the scans after the first of up to 20 identical ones, after 50 of each key's 60 rows were dispatched (20 keys,
/// rows interleaved; autovacuum off, so only the scans can mark entries dead). The first
/// key's entries (two row versions each: the ordering trigger numbers a row with an update)
/// share one leaf page, and deduplicated one posting list, which then mixes dispatched rows
/// with open ones, as in a table whose keys have tens or hundreds of rows each. `<outbox>_ord_idx` is dropped so the step reads
/// `<outbox>_ord_open`, as the plan asserts.
async fn second_walk_heap_fetches(pool: &sqlx::PgPool) -> i64 {
    sqlx::raw_sql(
        "ALTER TABLE trellis_outbox SET (autovacuum_enabled = off); \
         DROP INDEX IF EXISTS trellis_outbox_ord_idx; TRUNCATE trellis_outbox; \
         INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, \
         created_at, updated_at, ordering_key, ordering_skip_dead) \
         SELECT lpad(i::text, 26, '0'), 'event.publish', 'Orders.Shipped', 'orders.shipped', '{}', \
         '{}', 'pending', 0, now(), now(), 'order-' || lpad((i % 20)::text, 2, '0'), false \
         FROM generate_series(1, 1200) AS i",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::raw_sql(
        "UPDATE trellis_outbox SET state = 'dispatched' WHERE id IN (SELECT id FROM \
         (SELECT id, row_number() OVER (PARTITION BY ordering_key ORDER BY ordering_seq) AS n \
         FROM trellis_outbox) AS r WHERE n <= 50); ANALYZE trellis_outbox",
    )
    .execute(pool)
    .await
    .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql("SET enable_seqscan = off; SET enable_bitmapscan = off")
        .execute(&mut *conn)
        .await
        .unwrap();
    // A scan can mark an entry dead only once no transaction (of any test running beside this
    // one) may still see its row: scan again, up to 20 times, until one reads almost nothing.
    let mut fetches = Vec::new();
    for scan in 0..20 {
        if scan > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let plan: serde_json::Value = sqlx::query_scalar(
            "EXPLAIN (ANALYZE, FORMAT JSON) SELECT min(ordering_key) FROM trellis_outbox \
             WHERE ordering_key IS NOT NULL AND state IN ('pending', 'failed', 'claimed') \
             AND ordering_key > ''",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        let text = plan.to_string();
        assert!(text.contains("trellis_outbox_ord_open"), "{text}");
        fn heap_fetches(node: &serde_json::Value) -> i64 {
            let own = node["Heap Fetches"].as_i64().unwrap_or(0);
            let below: i64 = node["Plans"]
                .as_array()
                .map_or(0, |plans| plans.iter().map(heap_fetches).sum());
            own + below
        }
        fetches.push(heap_fetches(&plan[0]["Plan"]));
        if scan > 0 && fetches[scan] < 20 {
            break;
        }
    }
    assert!(
        fetches[0] >= 80,
        "the first scan reads the dispatched rows: {fetches:?}"
    );
    eprintln!("key walk heap reads, scan by scan: {fetches:?}");
    fetches[1..].iter().copied().min().unwrap_or(fetches[0])
}

/// Version 9: with `<outbox>_ord_open` deduplicated (version 8), the entries of a key's
/// dispatched rows share a posting list with its open ones and are never marked dead, so
/// every key-walk step reads the heap for each of them again until a vacuum; without
/// posting lists the first scan marks them and the next reads almost none.
#[tokio::test]
async fn pg_key_walk_reads_dispatched_rows_once() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let undeduplicated = second_walk_heap_fetches(&db.pool).await;
    assert!(undeduplicated < 20, "version 9: {undeduplicated}");

    // Version 8's index: the same scan reads every dispatched row again.
    sqlx::raw_sql(
        "ALTER INDEX trellis_outbox_ord_open RESET (deduplicate_items); \
         REINDEX INDEX trellis_outbox_ord_open",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let deduplicated = second_walk_heap_fetches(&db.pool).await;
    assert!(deduplicated >= 80, "version 8: {deduplicated}");
    db.close().await;
}
