//! The crate's error type.

use std::fmt;

/// A `Result` whose error defaults to this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `trellis-outbox`.
///
/// Each variant names the operation that failed and keeps the underlying error as its
/// [`source`](std::error::Error::source). Use [`Error::is_retryable`] to decide whether the
/// same operation may succeed when tried again.
///
/// # Examples
///
/// ```
/// use trellis_outbox::{Error, OutboxTables};
///
/// let err = OutboxTables::new("tenant.outbox", "inbox").unwrap_err();
/// assert!(matches!(err, Error::InvalidTableName { .. }));
/// assert_eq!(
///     err.to_string(),
///     r#"Invalid SQL outbox table name "tenant.outbox". Use a simple identifier matching ^[A-Za-z_][A-Za-z0-9_]*$."#,
/// );
/// assert!(!err.is_retryable());
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A table name is not a simple SQL identifier (upstream Trellis wording, spec §B.1).
    #[error(
        "Invalid SQL {kind} table name \"{name}\". Use a simple identifier matching ^[A-Za-z_][A-Za-z0-9_]*$."
    )]
    InvalidTableName {
        /// Which of the two tables was named.
        kind: TableKind,
        /// The rejected name, as given.
        name: String,
    },

    /// A table name is a valid identifier, but it or an identifier derived from it (the
    /// `<outbox>_wakeup` notification channel, the `<outbox>_due_idx` and `<outbox>_claim_idx`
    /// indexes) is longer than PostgreSQL's 63-byte identifier limit, which PostgreSQL would
    /// reject or silently truncate (making two index names collide).
    #[error(
        "SQL {kind} table name \"{name}\" is too long: the identifier \"{derived}\" derived from it \
         is {length} bytes, over PostgreSQL's limit of {limit} bytes"
    )]
    TableNameTooLong {
        /// Which of the two tables was named.
        kind: TableKind,
        /// The rejected name, as given.
        name: String,
        /// The identifier that does not fit (the name itself, or one derived from it).
        derived: String,
        /// Its length in bytes.
        length: usize,
        /// The limit, 63 bytes.
        limit: usize,
    },

    /// A table name is a valid identifier that cannot name the table: a word SQL reserves
    /// (`order`, `user`, …), or the name of the other table or of the migrations bookkeeping
    /// table (compared without case, as the databases compare unquoted names).
    #[error("SQL {kind} table name \"{name}\" cannot be used: it {reason}")]
    TableNameUnusable {
        /// Which of the two tables was named.
        kind: TableKind,
        /// The rejected name, as given.
        name: String,
        /// Why: `is a reserved SQL word`, `is the outbox table's name too`, or `is the
        /// migrations bookkeeping table's name`.
        reason: &'static str,
    },

    /// An outbox record was rejected before any SQL was sent.
    #[error("invalid outbox record {id:?}: `{field}` {problem}")]
    InvalidRecord {
        /// The record's id (may be empty when the id itself is the problem).
        id: String,
        /// The offending field: `id`, `name`, `subject`, `payload` or `headers`.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },

    /// A [`HandoffTransaction`](crate::HandoffTransaction) could not be started: the
    /// dispatcher cannot take rows handed over at commit on this transaction.
    #[error("cannot hand rows over to this dispatcher: {problem}")]
    Handoff {
        /// Why not.
        problem: &'static str,
    },

    /// A retention call was given an out-of-range option.
    #[error("invalid retention option: {problem}")]
    InvalidRetention {
        /// What is wrong.
        problem: &'static str,
    },

    /// A Trellis event descriptor identity could not be built.
    #[error("invalid Trellis event descriptor for API {api_id:?}, event {event_name:?}: {problem}")]
    InvalidDescriptor {
        /// The API identity given.
        api_id: String,
        /// The event name given.
        event_name: String,
        /// What is wrong.
        problem: String,
    },

    /// An inbox message id was rejected before any SQL was sent.
    #[error("invalid inbox message id {message_id:?}: {problem}")]
    InvalidMessageId {
        /// The rejected id.
        message_id: String,
        /// What is wrong with it.
        problem: &'static str,
    },

    /// A wire string is not one of the known outbox record kinds.
    #[error("unknown outbox record kind {0:?} (expected event.publish, job.create or job.submit)")]
    UnknownKind(String),

    /// A wire string is not one of the known outbox message states.
    #[error(
        "unknown outbox message state {0:?} (expected pending, claimed, dispatched, failed or dead)"
    )]
    UnknownState(String),

    /// A string is not one of the head-of-line policies.
    #[error("unknown head-of-line policy {0:?} (expected block or skip_dead)")]
    UnknownHeadOfLine(String),

    /// A value could not be serialized to JSON.
    #[error("failed to serialize {what} to JSON")]
    Serialize {
        /// What was being serialized.
        what: &'static str,
        /// The serializer's error.
        #[source]
        source: serde_json::Error,
    },

    /// A stored outbox row could not be decoded.
    #[error("stored outbox row {id:?} has an invalid `{column}`: {problem}")]
    Decode {
        /// The row's id, when it could be read.
        id: String,
        /// The column that could not be decoded.
        column: &'static str,
        /// What is wrong with it.
        problem: String,
    },

    /// A record was enqueued with the id of a stored row whose content differs (upstream
    /// Trellis' `OutboxDuplicateIdentityError`, same text). Kind, name, subject, payload and
    /// headers are compared; the headers a retry of the same logical event re-creates
    /// (`Trellis-Event-Time`, `traceparent`, `tracestate`) are not. Nothing was written for
    /// this record; roll the transaction back if earlier records of the same call must not be
    /// kept either.
    #[error("Outbox message '{id}' already exists with different immutable content")]
    DuplicateIdentity {
        /// The record id.
        id: String,
        /// Which fields differ: `kind`, `name`, `subject`, `payload` and/or `headers`.
        fields: Vec<&'static str>,
    },

    /// An insert of a record conflicted on its id, but no stored row with that id could be
    /// read back (upstream Trellis' `OutboxStorageConflictError`, same text); for example the
    /// row was deleted meanwhile, or it is not visible to a `REPEATABLE READ` snapshot.
    #[error("Outbox message '{id}' conflicted but no stored row was found")]
    StorageConflict {
        /// The record id.
        id: String,
    },

    /// The database failed while inserting outbox records.
    #[error("database error while enqueueing outbox record {id:?}")]
    Enqueue {
        /// The id of the (first) record being enqueued.
        id: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// The database failed while recording an inbox message.
    #[error("database error while recording inbox message {message_id:?}")]
    RecordInbox {
        /// The message id being recorded.
        message_id: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// The database failed while applying or checking migrations.
    #[error("database error while migrating the outbox schema ({step})")]
    Migrate {
        /// The step that failed: `begin`, `advisory lock`, `set lock_timeout`, `bookkeeping
        /// table`, `read applied migrations`, …, the id of the migration being applied, or
        /// `commit`.
        step: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// A migration step waited longer than the lock timeout
    /// ([`MigrateOptions::lock_timeout`](crate::MigrateOptions::lock_timeout)) for a lock on a
    /// table, held by another transaction (a long query, say). Nothing was applied: the
    /// migration transaction rolled back. Retryable: run the migration again, when the table
    /// is quieter or with a longer timeout.
    #[error(
        "outbox migration step {step} waited more than the lock timeout ({lock_timeout:?}) for \
         a table lock held by another transaction; nothing was applied, retry the migration"
    )]
    MigrationLockTimeout {
        /// The step that waited: the id of the migration being applied, or another step of
        /// [`Error::Migrate`].
        step: String,
        /// The timeout it waited for.
        lock_timeout: std::time::Duration,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// The database failed during a dispatch operation (claim, mark, release, …).
    #[error("database error during outbox {operation}")]
    Repository {
        /// The operation: `claim`, `mark dispatched`, `mark failed`, `mark dead`, `release`,
        /// `retry` or `next due`.
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },

    /// A NATS KV operation of [`NatsKvOutboxRepository`](crate::NatsKvOutboxRepository) or
    /// [`NatsKvInboxRepository`](crate::NatsKvInboxRepository) failed.
    #[error("NATS KV error during outbox {operation} of key {key:?}")]
    Kv {
        /// The operation: `enqueue`, `record inbox`, `claim`, `mark`, `release`, `retry`,
        /// `purge` or `list keys`.
        operation: &'static str,
        /// The key, or `""` for a whole-bucket operation.
        key: String,
        /// The client's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
        /// Whether trying again may succeed (timeouts, a broken connection).
        retryable: bool,
    },

    /// A migration recorded in the database differs from the one this library would apply.
    #[error(
        "outbox migration {id} (version {version}) was applied with checksum {recorded}, \
         but this version of trellis-outbox expects {expected}; refusing to continue"
    )]
    ChecksumMismatch {
        /// The migration's id.
        id: String,
        /// The migration's version.
        version: u32,
        /// The checksum stored in the bookkeeping table.
        recorded: String,
        /// The checksum of the migration this library ships.
        expected: String,
    },
}

impl Error {
    /// Whether trying the same operation again may succeed.
    ///
    /// True for transient database conditions: I/O errors, pool timeouts; on Postgres,
    /// connection exceptions (SQLSTATE class `08`), insufficient resources (class `53`, e.g.
    /// too many connections), serialization failures (`40001`), deadlocks (`40P01`), lock
    /// timeouts (`55P03`) and server shutdown or start-up (`57P01`–`57P03`); on SQLite,
    /// `BUSY` and `LOCKED`. Each database error is read by the rules of the driver that
    /// raised it. Permission errors, constraint violations, validation errors and checksum
    /// mismatches are never retryable.
    ///
    /// # Examples
    ///
    /// ```
    /// use trellis_outbox::Error;
    ///
    /// let err = Error::UnknownKind("job.cancel".into());
    /// assert!(!err.is_retryable());
    /// ```
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Enqueue { source, .. }
            | Error::RecordInbox { source, .. }
            | Error::Migrate { source, .. } => sqlx_is_retryable(source),
            Error::MigrationLockTimeout { .. } => true,
            // A dispatcher retries repository operations on its own schedule; connection
            // and contention failures are worth retrying, constraint violations are not.
            Error::Repository { source, .. } => sqlx_is_retryable(source),
            Error::Kv { retryable, .. } => *retryable,
            _ => false,
        }
    }

    pub(crate) fn invalid_record(
        id: &str,
        field: &'static str,
        problem: impl Into<String>,
    ) -> Self {
        Error::InvalidRecord {
            id: id.to_owned(),
            field,
            problem: problem.into(),
        }
    }

    /// Maps a driver error during a dispatch `operation` to [`Error::Repository`].
    pub(crate) fn enqueue(id: &str) -> impl FnOnce(sqlx::Error) -> Self + '_ {
        move |source| Error::Enqueue {
            id: id.to_owned(),
            source,
        }
    }

    pub(crate) fn repository(operation: &'static str) -> impl Fn(sqlx::Error) -> Self {
        move |source| Error::Repository { operation, source }
    }

    pub(crate) fn decode(id: &str, column: &'static str, problem: impl ToString) -> Self {
        Error::Decode {
            id: id.to_owned(),
            column,
            problem: problem.to_string(),
        }
    }
}

/// Classifies a driver error as transient.
///
/// A database error is classified by the driver that raised it: Postgres SQLSTATEs and
/// SQLite result codes are different code spaces (Postgres `42501`, insufficient privilege,
/// read as an SQLite code would look like `BUSY`).
pub(crate) fn sqlx_is_retryable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => database_is_retryable(db.as_ref()),
        _ => false,
    }
}

/// Whether a driver error may say the database could not serve anyone just now (the
/// network, the pool, the server starting, stopping or out of connections, an SQLite file
/// locked by another writer), as against something in the work itself: a deadlock or a
/// serialization failure is retryable but caused by the work, and so is not counted here.
/// Some of these can still be the work's own doing (a backend killed for running too long, a
/// handler waiting on its own lock): the consumer checks the database before it believes it.
#[cfg(feature = "nats")]
pub(crate) fn sqlx_is_unavailable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => database_is_unavailable(db.as_ref()),
        _ => false,
    }
}

/// [`sqlx_is_unavailable`] for a database error.
#[cfg(feature = "nats")]
fn database_is_unavailable(db: &dyn sqlx::error::DatabaseError) -> bool {
    #[cfg(feature = "postgres")]
    if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        // Connection exceptions but `08P01` (a protocol violation: the client's statement),
        // too many connections, shutdown and start-up. Not the rest of class 53 (out of
        // memory, disk or locks): a statement can cause those.
        let code = pg.code();
        return (code.starts_with("08") && code != "08P01")
            || matches!(code, "53300" | "57P01" | "57P02" | "57P03");
    }
    // SQLite's retryable codes (BUSY, LOCKED) are all another connection's lock.
    database_is_retryable(db)
}

/// Whether a database error is transient, by the rules of the driver that raised it; an
/// error from any other driver is not.
fn database_is_retryable(db: &dyn sqlx::error::DatabaseError) -> bool {
    #[cfg(feature = "postgres")]
    if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        return pg_sqlstate_is_retryable(pg.code());
    }
    #[cfg(feature = "sqlite")]
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        // SqliteError keeps its extended result code private but reports it as `code()`.
        return db
            .code()
            .and_then(|code| code.parse::<i32>().ok())
            .is_some_and(sqlite_code_is_retryable);
    }
    let _ = db;
    false
}

/// Postgres SQLSTATEs worth retrying: connection exceptions (class `08`), insufficient
/// resources (class `53`, e.g. `53300` too many connections), serialization failure
/// (`40001`), deadlock (`40P01`), lock not available (`55P03`), and server shutdown or
/// start-up (`57P01`–`57P03`).
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
fn pg_sqlstate_is_retryable(code: &str) -> bool {
    code.starts_with("08")
        || code.starts_with("53")
        || matches!(
            code,
            "40001" | "40P01" | "55P03" | "57P01" | "57P02" | "57P03"
        )
}

/// SQLite result codes worth retrying: `BUSY` (5) and `LOCKED` (6), with their extended
/// codes (the primary code is the low byte).
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
fn sqlite_code_is_retryable(code: i32) -> bool {
    matches!(code & 0xff, 5 | 6)
}

/// Which of the two helper tables a name is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TableKind {
    /// The outbox table.
    Outbox,
    /// The inbox table.
    Inbox,
}

impl fmt::Display for TableKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TableKind::Outbox => "outbox",
            TableKind::Inbox => "inbox",
        })
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;

    #[test]
    fn postgres_sqlstates() {
        for code in [
            "08000", "08003", "08006", "08001", "08004", "08P01", "40001", "40P01", "55P03",
            "57P01", "57P02", "57P03", "53000", "53100", "53200", "53300", "53400",
        ] {
            assert!(pg_sqlstate_is_retryable(code), "{code}");
        }
        // 42501 (insufficient privilege) & 0xff would be 5, SQLite's BUSY.
        for code in [
            "42501", "42P01", "23505", "23514", "22001", "42703", "40002", "57014", "XX000",
            "00000", "", "5", "261",
        ] {
            assert!(!pg_sqlstate_is_retryable(code), "{code}");
        }
    }

    #[test]
    fn sqlite_result_codes() {
        // BUSY, LOCKED, BUSY_RECOVERY, BUSY_SNAPSHOT, BUSY_TIMEOUT, LOCKED_SHAREDCACHE.
        for code in [5, 6, 261, 517, 773, 262] {
            assert!(sqlite_code_is_retryable(code), "{code}");
        }
        // ERROR, CONSTRAINT_CHECK, CONSTRAINT_NOTNULL, READONLY, CORRUPT, NOTADB.
        for code in [1, 275, 1299, 8, 11, 26, 0] {
            assert!(!sqlite_code_is_retryable(code), "{code}");
        }
    }

    /// A database error from a driver this crate does not know.
    #[derive(Debug)]
    struct Foreign(&'static str);

    impl std::fmt::Display for Foreign {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "foreign error {}", self.0)
        }
    }

    impl std::error::Error for Foreign {}

    impl sqlx::error::DatabaseError for Foreign {
        fn message(&self) -> &str {
            "foreign"
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.0))
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    #[test]
    fn codes_are_read_by_the_driver_that_raised_them() {
        // Before: any database error whose code parsed as an integer with low byte 5 or 6
        // was retryable, whatever the driver: 42501 & 0xff == 5.
        for code in ["42501", "5", "40001"] {
            let error = Error::Repository {
                operation: "claim",
                source: sqlx::Error::Database(Box::new(Foreign(code))),
            };
            assert!(!error.is_retryable(), "{code}");
        }
        assert!(
            Error::Repository {
                operation: "claim",
                source: sqlx::Error::PoolTimedOut,
            }
            .is_retryable()
        );
        assert!(
            !Error::Repository {
                operation: "claim",
                source: sqlx::Error::PoolClosed,
            }
            .is_retryable()
        );
    }
}
