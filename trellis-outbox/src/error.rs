//! The crate's error type.

use crate::tables::TableKind;

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
    #[error("unknown outbox message state {0:?} (expected pending, dispatched, failed or dead)")]
    UnknownState(String),

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
        /// The step that failed, e.g. the migration id or `lock`.
        step: String,
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
    /// True for transient database conditions: I/O errors, pool timeouts, closed pools being
    /// reopened, serialization failures and deadlocks (Postgres `40001`, `40P01`), and SQLite
    /// `BUSY`/`LOCKED`. Validation errors and checksum mismatches are never retryable.
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
            // A dispatcher retries repository operations on its own schedule; connection
            // and contention failures are worth retrying, constraint violations are not.
            Error::Repository { source, .. } => sqlx_is_retryable(source),
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
pub(crate) fn sqlx_is_retryable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => match db.code().as_deref() {
            // Postgres: serialization_failure, deadlock_detected, lock_not_available,
            // admin/crash shutdown, cannot_connect_now.
            Some("40001" | "40P01" | "55P03" | "57P01" | "57P02" | "57P03") => true,
            // SQLite primary result codes BUSY (5) and LOCKED (6), with extended codes.
            Some(code) => code
                .parse::<i32>()
                .map(|c| matches!(c & 0xff, 5 | 6))
                .unwrap_or(false),
            None => false,
        },
        _ => false,
    }
}
