//! Transactional outbox and inbox for async Rust services on [sqlx] (PostgreSQL, SQLite) and
//! NATS JetStream: the Rust successor of the Trellis outbox, wire- and schema-compatible with
//! `@qlever-llc/trellis` 0.11.
//!
//! A handler writes its business rows and its events in **one** transaction; after commit a
//! dispatcher publishes each row once (with `Nats-Msg-Id` = row id) and marks it dispatched.
//! Consumers de-duplicate with an inbox row written in their own transaction.
//!
//! # Quick start
//!
//! ```no_run
//! use trellis_outbox::{OutboxTransactionExt, PreparedOutboxRecord};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::SqlitePool::connect("sqlite://app.db?mode=rwc").await?;
//! trellis_outbox::migrate(&pool).await?;
//!
//! let mut tx = pool.begin().await?;
//! sqlx::query("INSERT INTO orders (id) VALUES ('o-1')").execute(&mut *tx).await?;
//! let event = PreparedOutboxRecord::event(
//!     "Orders.Placed",
//!     "events.v1.Orders.Placed",
//!     &serde_json::json!({ "orderId": "o-1" }),
//! )?;
//! tx.enqueue(&event).await?; // written only if the transaction commits
//! tx.commit().await?;
//! # Ok(()) }
//! ```
//!
//! Consumers record each message id in the same transaction as their effects:
//!
//! ```no_run
//! use trellis_outbox::OutboxTransactionExt;
//!
//! # async fn handle(pool: sqlx::PgPool, message_id: &str) -> Result<(), Box<dyn std::error::Error>> {
//! # let mut tx = pool.begin().await?;
//! if tx.record_inbox(message_id).await?.is_accepted() {
//!     // apply the message's effects with `&mut *tx` …
//! }
//! # tx.commit().await?;
//! # Ok(()) }
//! ```
//!
//! # Feature flags
//!
//! | feature    | default | what it enables |
//! |------------|---------|-----------------|
//! | `postgres` | yes     | [`sqlx::Postgres`] as an [`OutboxDatabase`] |
//! | `sqlite`   | yes     | [`sqlx::Sqlite`] as an [`OutboxDatabase`] |
//! | `nats`     | yes     | [`JetStreamPublisher`], job dispatch ([`JobDispatcher`]), NATS header helpers |
//! | `macros`   | yes     | `#[derive(OutboxEvent)]` and `#[outbox_job]` |
//! | `cli`      | no      | the `trellis-outbox` command-line tool |
//! | `opentelemetry` | no | trace context from OpenTelemetry at enqueue; publish and consume spans under the stored context |
//! | `trellis-participant` | no | `TrellisParticipantPublisher`: event rows signed at dispatch by a Trellis participant (`trellis-rs`) |

#![forbid(unsafe_code)]
#![warn(missing_docs, clippy::unwrap_used)]
#![cfg_attr(test, allow(clippy::unwrap_used))]
#![cfg_attr(docsrs, feature(doc_cfg))]
// Without a database driver (`postgres` or `sqlite`), the SQL repository's row decoding and
// claim plumbing have no caller; every build with a driver checks them for dead code.
#![cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]

#[allow(unused_extern_crates)]
extern crate self as trellis_outbox;

#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod admin;
mod chain;
#[cfg(feature = "cli")]
pub mod cli;
#[cfg(feature = "nats")]
mod consumer;
mod descriptor;
mod dispatch;
mod driver;
mod error;
mod event;
mod job;
#[cfg(feature = "nats")]
mod kv;
pub mod metrics;
mod migrate;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "opentelemetry")]
mod otel;
mod outbox;
#[cfg(feature = "trellis-participant")]
mod participant;
mod postgres;
mod record;
mod row;
mod setters;
mod sql;
mod sql_repository;
mod sqlite;
mod subject;
mod tables;
mod time;
mod wire;

#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub use crate::admin::{BLOCKED_KEYS_SHOWN, BlockedKey, OutboxRow, OutboxStatus};
#[cfg(feature = "nats")]
pub use crate::consumer::{
    ConsumeFailure, Consumer, ConsumerBuilder, ConsumerError, ConsumerHandle, ConsumerReport,
    DEAD_LETTER_STREAM, DEAD_LETTER_SUBJECT_PREFIX, DEFAULT_ACK_WAIT, DEFAULT_CONSUMER_CONCURRENCY,
    DEFAULT_MAX_DELIVERIES, DeadLetter, Delivered, FailureAction, FailureKind, Handler,
    HandlerError, HandlerFn, HandlerFuture, NotReplayed, REPLAY_STREAM, REPLAY_SUBJECT_PREFIX,
    ReplayReport, dead_letter_headers, dead_letters, handler_fn, replay_dead_letters,
};
pub use crate::descriptor::{
    TRELLIS_EVENT_DESCRIPTOR, event_descriptor_identity, trellis_event_subject,
};
pub use crate::dispatch::{
    Backlog, BoxError, Claim, ClaimRequest, DEFAULT_BACKLOG_EVERY, DEFAULT_MAX_HANDOFF_BACKLOG,
    DispatchError, DispatchOptions, DispatchReport, Dispatched, DispatcherBuilder,
    DispatcherHandle, Disposition, ErrorCallback, Failure, FailureOutcome, HandoffTarget,
    HandoffTransaction, MAX_RETRY_DELAY, MIN_RETRY_DELAY, MemoryOutboxRepository, OutboxDispatcher,
    OutboxRepository, PoisonRow, PublishError, Publisher, RetryOutcome, RetryPolicy,
    dispatch_outbox,
};
pub use crate::driver::OutboxDatabase;
pub use crate::error::{Error, Result, TableKind};
pub use crate::event::{OutboxEvent, TRACEPARENT, TRACESTATE, TraceContext};
pub use crate::job::{JobMode, JobSubmission, OutboxJob, REQUEST_ID};
#[cfg(feature = "nats")]
pub use crate::kv::{NatsKvInboxRepository, NatsKvOutboxRepository};
pub use crate::migrate::{
    DEFAULT_LOCK_TIMEOUT, MIGRATIONS_TABLE, MigrateOptions, MigrationReport, SqlOutboxMigration,
    fnv1a64_hex, migrate, migrate_with, migrate_with_options, migration_script, migrations,
};
#[cfg(feature = "nats")]
pub use crate::nats::{
    DEFAULT_ACK_TIMEOUT, DEFAULT_ACK_WINDOW, DEFAULT_JOB_DISPATCH_TIMEOUT, DEFAULT_JOB_MAX_TRIES,
    JetStreamError, JetStreamErrorKind, JetStreamPublisher, JetStreamPublisherBuilder,
    JobAdmission, JobDispatcher, JobRef, JobRequest, MAX_QUEUE_DEADLINE, NoJobDispatcher,
    StreamCheck, StreamCheckError,
};
#[cfg(feature = "opentelemetry")]
pub use crate::otel::{opentelemetry_trace_context, use_opentelemetry_trace_context};
pub use crate::outbox::{Outbox, OutboxTransactionExt};
#[cfg(feature = "trellis-participant")]
pub use crate::participant::{
    DEFAULT_PARTICIPANT_PUBLISH_TIMEOUT, DEFAULT_PARTICIPANT_WINDOW, ParticipantError,
    TrellisParticipantPublisher, prepared_event,
};
#[cfg(feature = "postgres")]
pub use crate::postgres::{PgOutboxRepository, PgWakeups};
pub use crate::record::{
    HeadOfLine, InboxReceipt, MAX_ORDERING_KEY_BYTES, NATS_MSG_ID, OrderingKey, OutboxMessage,
    OutboxMessageState, OutboxRecordKind, PreparedOutboxRecord, TRELLIS_EVENT_TIME, ToOutboxRecord,
    new_id,
};
pub use crate::sql::SqlStatements;
pub use crate::sql_repository::SqlOutboxRepository;
#[cfg(feature = "sqlite")]
pub use crate::sqlite::SqliteOutboxRepository;
pub use crate::subject::escape_subject_token;
pub use crate::tables::{Dialect, OutboxTables};
pub use crate::time::format_timestamp;
/// Derives [`OutboxEvent`] and [`ToOutboxRecord`]; see the [`OutboxEvent`] trait for the
/// attributes and examples.
#[cfg(feature = "macros")]
pub use trellis_outbox_macros::OutboxEvent;
/// Implements [`OutboxJob`] and [`ToOutboxRecord`] for a job request struct; see the
/// [`OutboxJob`] trait for the arguments and examples.
#[cfg(feature = "macros")]
pub use trellis_outbox_macros::outbox_job;

/// Support for code generated by the macros. Not public API: it may change in any release.
#[doc(hidden)]
pub mod __private {
    pub use ::core;
    pub use ::serde;
    pub use ::serde_json;
    pub use ::std;

    pub use crate::error::Result;
    pub use crate::event::OutboxEvent;
    pub use crate::job::{JobMode, OutboxJob};
    pub use crate::record::{HeadOfLine, OrderingKey, PreparedOutboxRecord, ToOutboxRecord};
    pub use ::serde::Serialize;
    pub use ::std::string::String;

    /// Appends `value` to a subject as one escaped token (`{field}` placeholders).
    #[inline]
    pub fn push_subject_token<T: ::core::fmt::Display + ?Sized>(out: &mut String, value: &T) {
        crate::event::push_subject_token(out, value);
    }

    /// Appends `value` to a subject as one Trellis event parameter token (unpadded
    /// base64url), the placeholders of a current-wire subject with `api`.
    #[inline]
    pub fn push_param_token<T: ::core::fmt::Display + ?Sized>(out: &mut String, value: &T) {
        crate::event::push_param_token(out, value);
    }

    /// The record id of an event from its `#[outbox(id)]` field.
    #[inline]
    pub fn event_id<T: ::core::fmt::Display + ?Sized>(value: &T) -> String {
        let mut id = String::new();
        let _ = ::core::fmt::Write::write_fmt(&mut id, format_args!("{value}"));
        id
    }

    /// The ordering key of an event from its `#[outbox(ordering_key)]` field.
    #[inline]
    pub fn ordering_key<T: ::core::fmt::Display + ?Sized>(
        value: &T,
        skip_dead: bool,
    ) -> OrderingKey {
        let policy = if skip_dead {
            HeadOfLine::SkipDead
        } else {
            HeadOfLine::Block
        };
        OrderingKey::new(event_id(value)).with_head_of_line(policy)
    }

    /// `ToOutboxRecord` for a derived event.
    #[inline]
    pub fn event_record<E: OutboxEvent + Serialize + ?Sized>(
        event: &E,
    ) -> Result<PreparedOutboxRecord> {
        event.to_event_record()
    }

    /// `ToOutboxRecord` for a job made with `#[outbox_job]`.
    #[inline]
    pub fn job_record<J: OutboxJob + ?Sized>(job: &J) -> Result<PreparedOutboxRecord> {
        job.prepare_job().map(|(record, _)| record)
    }
}
