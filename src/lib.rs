//! Test support for the trellis-outbox workspace: fresh databases on the real services.
//!
//! Tests read `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`) and
//! `NATS_URL` (default `nats://127.0.0.1:4222`). A service that cannot be reached fails the
//! test with a message saying how to start it: nothing silently passes.

pub mod chaos;
pub mod crash;
pub mod cut;
pub mod nats;
pub mod nats_server;
pub mod publisher;
pub mod relay;

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgPool, SqlitePool};

/// The Postgres server tests use.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// The NATS server tests use.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// An `Orders.Placed` event (subject `events.v1.Orders.Placed`) with payload `{"n": n}`: a
/// fresh row for tests that need many.
///
/// # Panics
///
/// Never for these inputs: the payload always serializes.
pub fn order_placed(n: usize) -> trellis_outbox::PreparedOutboxRecord {
    trellis_outbox::PreparedOutboxRecord::event(
        "Orders.Placed",
        "events.v1.Orders.Placed",
        &serde_json::json!({ "n": n }),
    )
    .expect("a JSON object serializes")
}

const PG_HINT: &str = "start it with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` \
     (if it runs but the URL's database is missing: `createdb -h 127.0.0.1 -U postgres test`), \
     or point DATABASE_URL at a server you can create databases on";

/// Test databases are named `trellis_t_<ulid>`; ones older than this are swept.
const STALE_AFTER: Duration = Duration::from_secs(3600);

/// Whether a test resource named with `ulid` (as `trellis_t_<ulid>`, `TRELLIS_T_<ulid>`) was
/// created more than [`STALE_AFTER`] ago: a test that panicked left it behind.
pub(crate) fn is_stale(ulid: &str) -> bool {
    ulid::Ulid::from_string(&ulid.to_uppercase()).is_ok_and(|id| {
        let created = std::time::UNIX_EPOCH + Duration::from_millis(id.timestamp_ms());
        std::time::SystemTime::now()
            .duration_since(created)
            .unwrap_or_default()
            > STALE_AFTER
    })
}

/// A freshly created Postgres database, dropped by [`TestPg::close`].
#[derive(Debug)]
pub struct TestPg {
    /// A pool on the new database.
    pub pool: PgPool,
    /// The database's name.
    pub name: String,
    /// Connection options for the new database (to open more pools or connections).
    pub options: PgConnectOptions,
    admin: PgConnectOptions,
}

impl TestPg {
    /// Creates a new, empty database on the server at [`database_url`].
    ///
    /// # Panics
    ///
    /// If the server cannot be reached, with a message saying how to start it.
    pub async fn new() -> Self {
        let url = database_url();
        let admin = PgConnectOptions::from_str(&url)
            .unwrap_or_else(|e| panic!("DATABASE_URL {url:?} is not a Postgres URL: {e}"));
        let mut conn = admin
            .connect()
            .await
            .unwrap_or_else(|e| panic!("cannot reach Postgres at {url}: {e}; {PG_HINT}"));
        sweep_stale(&mut conn).await;
        let name = format!(
            "trellis_t_{}",
            ulid::Ulid::generate().to_string().to_lowercase()
        );
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE DATABASE {name} TEMPLATE template0"
        )))
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("cannot create test database {name}: {e}; {PG_HINT}"));
        let _ = conn.close().await;
        let options = admin.clone().database(&name);
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .connect_with(options.clone())
            .await
            .unwrap_or_else(|e| panic!("cannot connect to test database {name}: {e}"));
        Self {
            pool,
            name,
            options,
            admin,
        }
    }

    /// The URL of this database (what the CLI takes as `DATABASE_URL`).
    pub fn url(&self) -> String {
        let base = database_url();
        let server = base
            .rsplit_once('/')
            .map_or(base.as_str(), |(server, _)| server);
        format!("{server}/{}", self.name)
    }

    /// How many of this database's connections (other than the asking one) are listening:
    /// idle after a `LISTEN`.
    pub async fn listening_connections(&self) -> sqlx::Result<i64> {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND query LIKE 'LISTEN%' AND pid <> pg_backend_pid()",
        )
        .fetch_one(&self.pool)
        .await
    }

    /// Closes the pool and drops the database.
    pub async fn close(self) {
        self.pool.close().await;
        if let Ok(mut conn) = self.admin.connect().await {
            let _ = sqlx::raw_sql(AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            )))
            .execute(&mut conn)
            .await;
        }
    }
}

/// Drops test databases left behind by runs that panicked more than an hour ago.
async fn sweep_stale(conn: &mut sqlx::PgConnection) {
    let names: Vec<String> =
        sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'trellis\\_t\\_%'")
            .fetch_all(&mut *conn)
            .await
            .unwrap_or_default();
    for name in names {
        if name.strip_prefix("trellis_t_").is_some_and(is_stale) {
            let _ = sqlx::raw_sql(AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
            )))
            .execute(&mut *conn)
            .await;
        }
    }
}

/// A fresh SQLite database file in its own temporary directory (removed on drop).
#[derive(Debug)]
pub struct TestSqlite {
    /// A pool on the database (WAL, `synchronous=NORMAL`, 10 s busy timeout).
    pub pool: SqlitePool,
    /// The database file.
    pub path: PathBuf,
    _dir: tempfile::TempDir,
}

impl TestSqlite {
    /// The URL of this database (what the CLI takes as `DATABASE_URL`).
    pub fn url(&self) -> String {
        format!("sqlite:{}", self.path.display())
    }

    /// Creates the database.
    pub async fn new() -> Self {
        let dir = tempfile::tempdir().expect("create a temporary directory");
        let path = dir.path().join("test.db");
        let pool = sqlite_pool(&path, 8).await;
        Self {
            pool,
            path,
            _dir: dir,
        }
    }
}

/// Opens (creating if needed) the SQLite database at `path` with the settings
/// trellis-outbox recommends: WAL, `synchronous=NORMAL`, a 10 s busy timeout.
pub async fn sqlite_pool(path: &std::path::Path, max_connections: u32) -> SqlitePool {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(10));
    SqlitePoolOptions::new()
        .max_connections(max_connections)
        .connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("cannot open SQLite database {}: {e}", path.display()))
}
