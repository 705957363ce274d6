//! NATS JetStream delivery (feature `nats`): [`JetStreamPublisher`], Trellis job dispatch
//! ([`JobDispatcher`], [`JobAdmission`]) and header helpers.
//!
//! One row's path: `publisher.rs` ([`JetStreamPublisher`]: pipelined publish and ack) sends
//! an event row with the headers of `headers.rs`; a job row becomes the `created` event of
//! `created.rs` (from the parts `job_row.rs` decodes) or goes to a [`JobDispatcher`]
//! (`jobs.rs`). Every failure is a [`JetStreamError`] (`error.rs`, which also classifies
//! async-nats errors). `builder.rs` holds the options and defaults, `streams.rs` the
//! start-up stream check.

mod builder;
mod created;
mod error;
mod headers;
mod job_row;
mod jobs;
mod publisher;
mod streams;

pub use builder::{
    DEFAULT_ACK_TIMEOUT, DEFAULT_ACK_WINDOW, DEFAULT_JOB_DISPATCH_TIMEOUT, DEFAULT_JOB_MAX_TRIES,
    JetStreamPublisherBuilder, MAX_QUEUE_DEADLINE,
};
pub use error::{JetStreamError, JetStreamErrorKind};
pub use jobs::{JobAdmission, JobDispatcher, JobRef, JobRequest, NoJobDispatcher};
pub use publisher::JetStreamPublisher;
pub use streams::{StreamCheck, StreamCheckError};
