//! Versioned, checksummed schema migrations, compatible with Trellis' migration artifacts.

use std::fmt::Write as _;
use std::time::Duration;

use crate::driver::OutboxDatabase;
use crate::driver::sealed::Applied;
use crate::error::Result;
use crate::sql::{Ddl, Schema};
use crate::tables::{Dialect, OutboxTables};

/// The bookkeeping table [`migrate`](crate::migrate()) records applied migrations in.
pub const MIGRATIONS_TABLE: &str = "trellis_outbox_migrations";

/// One versioned schema change (Trellis' `SqlOutboxMigration`, spec §B.3).
///
/// Version 1 is upstream Trellis 0.11's DDL byte for byte, with its id and checksum, so a
/// database prepared by the TypeScript service is recognised as migrated. Later versions are
/// additive and never change an earlier version's text or checksum.
///
/// # Examples
///
/// ```
/// use trellis_outbox::{migrations, Dialect, OutboxTables};
///
/// let v1 = &migrations(Dialect::Sqlite, &OutboxTables::default())[0];
/// assert_eq!(v1.id, "trellis_sql_outbox_inbox_sqlite_v1");
/// assert_eq!(v1.version, 1);
/// assert_eq!(v1.checksum, "fnv1a64:8178e5295d0acfeb");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqlOutboxMigration {
    /// Stable id, e.g. `trellis_sql_outbox_inbox_postgres_v1`.
    pub id: String,
    /// Monotonic schema version, starting at 1.
    pub version: u32,
    /// The dialect the statements are written in.
    pub dialect: Dialect,
    /// Statements that apply the migration, without trailing semicolons.
    pub up: Vec<String>,
    /// Statements that revert it.
    pub down: Vec<String>,
    /// `fnv1a64:` + the hash of the canonical text (spec §B.4).
    pub checksum: String,
}

impl SqlOutboxMigration {
    fn new(id: String, version: u32, dialect: Dialect, up: Vec<String>, down: Vec<String>) -> Self {
        let checksum = checksum(&up, &down);
        Self {
            id,
            version,
            dialect,
            up,
            down,
            checksum,
        }
    }

    /// The `up` statements as a script, one `;`-terminated statement per line, headed by a
    /// comment naming the migration: ready to paste into sqlx-cli, refinery or any other
    /// migration tool.
    pub fn up_script(&self) -> String {
        script(self, "up", &self.up)
    }

    /// The `down` statements as a script.
    pub fn down_script(&self) -> String {
        script(self, "down", &self.down)
    }
}

fn script(m: &SqlOutboxMigration, direction: &str, statements: &[String]) -> String {
    let mut out = format!(
        "-- {} ({direction}), version {}, {}\n",
        m.id, m.version, m.checksum
    );
    for statement in statements {
        let _ = writeln!(out, "{statement};");
    }
    out
}

/// All migrations for `dialect` on `tables`, in version order (Trellis'
/// `getSqlOutboxMigrations`).
///
/// # Examples
///
/// ```
/// use trellis_outbox::{migrations, Dialect, OutboxTables};
///
/// let tables = OutboxTables::new("service_outbox", "service_inbox")?;
/// let v1 = &migrations(Dialect::Sqlite, &tables)[0];
/// assert!(v1.up[0].starts_with("CREATE TABLE IF NOT EXISTS service_outbox (id TEXT PRIMARY KEY"));
/// assert_eq!(v1.down[2], "DROP TABLE IF EXISTS service_outbox");
/// # Ok::<(), trellis_outbox::Error>(())
/// ```
pub fn migrations(dialect: Dialect, tables: &OutboxTables) -> Vec<SqlOutboxMigration> {
    Schema::of(dialect)
        .versions(tables)
        .into_iter()
        .zip(1..)
        .map(|(Ddl { up, down }, version)| {
            let id = format!("trellis_sql_outbox_inbox_{dialect}_v{version}");
            SqlOutboxMigration::new(id, version, dialect, up, down)
        })
        .collect()
}

/// Every migration's `up` script for `dialect` on `tables`, concatenated in version order.
///
/// ```
/// use trellis_outbox::{migration_script, Dialect, OutboxTables};
///
/// let sql = migration_script(Dialect::Postgres, &OutboxTables::default());
/// assert!(sql.contains("headers jsonb NOT NULL"));
/// assert!(sql.contains("CREATE INDEX IF NOT EXISTS trellis_outbox_due_idx ON trellis_outbox (state, next_attempt_at);"));
/// ```
pub fn migration_script(dialect: Dialect, tables: &OutboxTables) -> String {
    migrations(dialect, tables)
        .iter()
        .map(SqlOutboxMigration::up_script)
        .collect::<Vec<_>>()
        .join("\n")
}

// The versions (`sql::Schema` writes each; what the dialects differ in is their `schema.rs`):
//
// 1. Upstream Trellis 0.11's tables and due index, byte for byte, with its ids and checksums.
// 2. (trellis-outbox) Claim leases and fencing tokens, a partial index that serves the claim
//    query, and on Postgres storage parameters for the claim's updates. Additive: new
//    nullable columns, a new index, a storage parameter.
// 3. (trellis-outbox) The schema refuses rows no dispatcher could finish. A row's `state`
//    must be one of `pending`, `claimed` (upstream Trellis), `dispatched`, `failed` and
//    `dead`, and on SQLite its `id` must not be NULL. Postgres: a `CHECK` constraint added
//    `NOT VALID`, so existing rows are not checked (the dispatcher moves them to `dead` when
//    it starts; see
//    [`OutboxRepository::sweep_unfinishable`](crate::OutboxRepository::sweep_unfinishable)).
//    SQLite: triggers that abort such inserts and updates.

/// Trellis' migration checksum: `fnv1a64:` + [`fnv1a64_hex`] of
/// `["-- up", ...up, "-- down", ...down].join("\n")`.
fn checksum(up: &[String], down: &[String]) -> String {
    let mut canonical = String::from("-- up");
    for s in up {
        canonical.push('\n');
        canonical.push_str(s);
    }
    canonical.push_str("\n-- down");
    for s in down {
        canonical.push('\n');
        canonical.push_str(s);
    }
    format!("fnv1a64:{}", fnv1a64_hex(&canonical))
}

/// FNV-1a 64 over the string's Unicode **code points** (not UTF-8 bytes), as Trellis
/// computes it, in 16 lowercase hex digits. Equal to byte-wise FNV-1a for ASCII input.
///
/// ```
/// use trellis_outbox::fnv1a64_hex;
///
/// assert_eq!(fnv1a64_hex(""), "cbf29ce484222325");
/// assert_eq!(fnv1a64_hex("foobar"), "85944171f73967e8");
/// assert_eq!(fnv1a64_hex("\u{e9}"), "af64644c8602d3a4");
/// ```
pub fn fnv1a64_hex(text: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for c in text.chars() {
        hash ^= u64::from(u32::from(c));
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{hash:016x}")
}

/// What a call to [`migrate`](crate::migrate()) did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationReport {
    /// Ids of the migrations applied by this call, in order.
    pub applied: Vec<String>,
    /// Ids of the migrations that were already applied (checksums verified).
    pub already_applied: Vec<String>,
    /// Whether a Trellis 0.10 outbox table (column `event`, no `kind`/`outcome`) was found
    /// and upgraded in place before version 1 was recorded: `event` renamed to `name`,
    /// `kind` added (`event.publish` for every existing row) and `outcome` added.
    pub upgraded_from_0_10: bool,
    /// Ids of migrations the database has recorded that this version of trellis-outbox does
    /// not know: a newer version migrated the tables. Nothing fails (an older version may
    /// run beside a newer one during a deploy, or after a rollback), but a caller that must
    /// not run on a newer schema can check this.
    pub unknown: Vec<String>,
}

/// Applies pending migrations to the default tables. See [`migrate_with`].
///
/// # Examples
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::SqlitePool::connect("sqlite://app.db?mode=rwc").await?;
/// trellis_outbox::migrate(&pool).await?;
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// As [`migrate_with`].
pub async fn migrate<DB: OutboxDatabase>(pool: &sqlx::Pool<DB>) -> Result<MigrationReport> {
    migrate_with(pool, &OutboxTables::default()).await
}

/// Applies the migrations of `tables` that the database has not recorded yet, in version
/// order, in one transaction, and records each in `trellis_outbox_migrations`, with the
/// default [`MigrateOptions`] (a lock timeout of 10 s on Postgres).
///
/// Safe to call from every process at start-up: calls are serialised (a transaction-scoped
/// advisory lock on Postgres, `BEGIN IMMEDIATE` on SQLite), and a second call does nothing.
///
/// # Errors
///
/// As [`migrate_with_options`].
pub async fn migrate_with<DB: OutboxDatabase>(
    pool: &sqlx::Pool<DB>,
    tables: &OutboxTables,
) -> Result<MigrationReport> {
    migrate_with_options(pool, tables, &MigrateOptions::default()).await
}

/// How [`migrate_with_options`] runs.
///
/// ```
/// use std::time::Duration;
/// use trellis_outbox::MigrateOptions;
///
/// let options = MigrateOptions::default();
/// assert_eq!(options.lock_timeout, Duration::from_secs(10));
/// let patient = MigrateOptions::default().with_lock_timeout(Duration::from_secs(60));
/// assert_eq!(patient.lock_timeout, Duration::from_secs(60));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrateOptions {
    /// Postgres: how long a migration statement may wait for a lock on a table before the
    /// migration gives up with [`Error::MigrationLockTimeout`](crate::Error::MigrationLockTimeout)
    /// (retryable; nothing is applied). Schema changes need an `ACCESS EXCLUSIVE` lock: one
    /// queued behind a long transaction holds up every query on the table after it, so a
    /// deploy should not wait long. Set for the migration transaction only (`SET LOCAL
    /// lock_timeout`), after the advisory lock that serialises migrators, which is waited
    /// for as long as another migration takes. Zero waits forever. Default: 10 s. SQLite
    /// locks the whole database at `BEGIN IMMEDIATE` and waits the connection's busy timeout.
    pub lock_timeout: Duration,
}

impl Default for MigrateOptions {
    fn default() -> Self {
        Self {
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
        }
    }
}

impl MigrateOptions {
    /// These options with [`lock_timeout`](Self::lock_timeout) set.
    #[must_use]
    pub fn with_lock_timeout(mut self, lock_timeout: Duration) -> Self {
        self.lock_timeout = lock_timeout;
        self
    }
}

/// [`MigrateOptions::lock_timeout`]'s default.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// [`migrate_with`] with `options`.
///
/// ```no_run
/// # async fn run(pool: sqlx::PgPool) -> Result<(), trellis_outbox::Error> {
/// use std::time::Duration;
/// use trellis_outbox::{migrate_with_options, MigrateOptions, OutboxTables};
///
/// let options = MigrateOptions::default().with_lock_timeout(Duration::from_secs(3));
/// match migrate_with_options(&pool, &OutboxTables::default(), &options).await {
///     Err(error) if error.is_retryable() => eprintln!("{error}; will try again at the next start"),
///     other => { other?; }
/// }
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// [`Error::ChecksumMismatch`](crate::Error::ChecksumMismatch) naming the migration if a
/// recorded checksum differs from this library's (nothing is applied then);
/// [`Error::MigrationLockTimeout`](crate::Error::MigrationLockTimeout) naming the step if a
/// statement waited longer than `options.lock_timeout` for a table lock (nothing is applied;
/// retryable); [`Error::Migrate`](crate::Error::Migrate) naming the failing step if the
/// database fails otherwise.
pub async fn migrate_with_options<DB: OutboxDatabase>(
    pool: &sqlx::Pool<DB>,
    tables: &OutboxTables,
    options: &MigrateOptions,
) -> Result<MigrationReport> {
    let lock = options.lock_timeout;
    let mut tx = DB::begin_migration(pool)
        .await
        .map_err(failed(DB::BEGIN_STEP, lock))?;
    DB::lock_migration(&mut tx, options.lock_timeout)
        .await
        .map_err(|(step, source)| failed(step, lock)(source))?;
    DB::run_ddl(&mut tx, DB::BOOKKEEPING)
        .await
        .map_err(failed("bookkeeping table", lock))?;
    let recorded = DB::fetch_migrations(&mut tx, DB::RECORDED, tables.outbox())
        .await
        .map_err(failed("read applied migrations", lock))?;
    let mut report = MigrationReport::default();
    if !recorded.iter().any(|(version, ..)| *version == 1) {
        let columns = DB::fetch_names(&mut tx, DB::COLUMNS, tables.outbox())
            .await
            .map_err(failed("read the outbox table's columns", lock))?;
        if columns.iter().any(|c| c == "event") && !columns.iter().any(|c| c == "name") {
            for statement in Schema::of(DB::DIALECT).upgrade_0_10(tables) {
                DB::run_ddl(&mut tx, &statement)
                    .await
                    .map_err(failed("upgrade the Trellis 0.10 outbox table", lock))?;
            }
            tracing::info!(
                table = tables.outbox(),
                "upgraded a Trellis 0.10 outbox table in place (event -> name, kind, outcome)"
            );
            report.upgraded_from_0_10 = true;
        }
    }
    for m in plan(
        migrations(DB::DIALECT, tables),
        tables,
        recorded,
        &mut report,
    )? {
        for statement in &m.up {
            if let Some((table, column)) = added_column(DB::DIALECT, statement) {
                let present = DB::fetch_names(&mut tx, DB::COLUMNS, table)
                    .await
                    .map_err(failed(&m.id, lock))?;
                if present.iter().any(|c| c.eq_ignore_ascii_case(column)) {
                    // Applied already, without a record (say by `migration_script`).
                    continue;
                }
            }
            DB::run_ddl(&mut tx, statement)
                .await
                .map_err(failed(&m.id, lock))?;
        }
        let applied = Applied {
            version: m.version,
            id: &m.id,
            checksum: &m.checksum,
        };
        DB::record_migration(&mut tx, DB::RECORD, tables.outbox(), applied)
            .await
            .map_err(failed(&m.id, lock))?;
        tracing::info!(migration = %m.id, "applied outbox migration");
        report.applied.push(m.id);
    }
    tx.commit().await.map_err(failed("commit", lock))?;
    Ok(report)
}

/// The table and column of a SQLite `ALTER TABLE <table> ADD COLUMN <column> …` statement.
///
/// SQLite has no `ADD COLUMN IF NOT EXISTS` (Postgres' versions use it): the runner skips such
/// a statement when the column is there already, so a schema set up from
/// [`migration_script`], which records nothing, can still be migrated.
fn added_column(dialect: Dialect, statement: &str) -> Option<(&str, &str)> {
    if dialect != Dialect::Sqlite {
        return None;
    }
    let mut words = statement.strip_prefix("ALTER TABLE ")?.split_whitespace();
    let table = words.next()?;
    (words.next()? == "ADD" && words.next()? == "COLUMN").then_some(())?;
    Some((table, words.next()?))
}

/// Checks what the database recorded against `migrations` and returns the ones still to apply.
///
/// `recorded` holds `(version, id, checksum, outbox table)`: the table as it was spelled
/// when the version was recorded. Names are compared without case (the databases fold
/// unquoted names), but a checksum covers the statements' text, spelling included: a
/// version recorded under another spelling only counts as applied, its checksum unchecked.
pub(crate) fn plan(
    migrations: Vec<SqlOutboxMigration>,
    tables: &OutboxTables,
    recorded: Vec<(i64, String, String, String)>,
    report: &mut MigrationReport,
) -> Result<Vec<SqlOutboxMigration>> {
    let mut pending = Vec::new();
    for m in migrations {
        let version = |(v, ..): &&(i64, String, String, String)| *v == i64::from(m.version);
        let same = recorded
            .iter()
            .filter(version)
            .find(|(.., spelling)| spelling == tables.outbox());
        match same.or_else(|| recorded.iter().find(version)) {
            Some((_, _, recorded_checksum, spelling))
                if spelling == tables.outbox() && *recorded_checksum != m.checksum =>
            {
                return Err(crate::Error::ChecksumMismatch {
                    id: m.id,
                    version: m.version,
                    recorded: recorded_checksum.clone(),
                    expected: m.checksum,
                });
            }
            Some(_) => report.already_applied.push(m.id),
            None => pending.push(m),
        }
    }
    for (version, id, ..) in &recorded {
        if !report.already_applied.contains(id) && !report.unknown.contains(id) {
            report.unknown.push(id.clone());
            tracing::warn!(
                version,
                id,
                "the database has an outbox migration this version of trellis-outbox does not know; \
                 it was probably applied by a newer version"
            );
        }
    }
    Ok(pending)
}

/// Maps a driver error during `step` to [`Error::MigrationLockTimeout`](crate::Error::MigrationLockTimeout)
/// if it is Postgres' lock timeout (`55P03`, `lock_not_available`), else to
/// [`Error::Migrate`](crate::Error::Migrate).
fn failed(step: &str, lock_timeout: Duration) -> impl Fn(sqlx::Error) -> crate::Error + '_ {
    move |source| {
        let timed_out = matches!(&source, sqlx::Error::Database(db)
            if db.code().as_deref() == Some("55P03"));
        if timed_out {
            crate::Error::MigrationLockTimeout {
                step: step.to_owned(),
                lock_timeout,
                source,
            }
        } else {
            crate::Error::Migrate {
                step: step.to_owned(),
                source,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_vectors_hash_code_points() {
        for (input, expected) in [
            ("", "cbf29ce484222325"),
            ("a", "af63dc4c8601ec8c"),
            ("foobar", "85944171f73967e8"),
            ("-- up", "a8cce2fb53a94818"),
            ("\u{e9}", "af64644c8602d3a4"),
            ("e\u{301}", "088f4b07b53b19f3"),
            ("\u{1F600}", "b115bd4c88e32ddf"),
        ] {
            assert_eq!(fnv1a64_hex(input), expected, "{input:?}");
        }
    }

    #[test]
    fn canonical_text_matches_upstream_length() {
        let tables = OutboxTables::default();
        for (dialect, len) in [(Dialect::Sqlite, 645), (Dialect::Postgres, 675)] {
            let m = migrations(dialect, &tables).remove(0);
            let canonical = ["-- up".to_owned()]
                .into_iter()
                .chain(m.up.iter().cloned())
                .chain(["-- down".to_owned()])
                .chain(m.down.iter().cloned())
                .collect::<Vec<_>>()
                .join("\n");
            assert_eq!(canonical.chars().count(), len, "{dialect}");
            assert_eq!(m.checksum, format!("fnv1a64:{}", fnv1a64_hex(&canonical)));
        }
    }
}
