//! NATS JetStream delivery (feature `nats`): [`JetStreamPublisher`], Trellis job dispatch
//! ([`JobDispatcher`], [`JobAdmission`]) and header helpers.
//!
//! A row goes through [`publisher`](JetStreamPublisher) (pipelined publish and ack) after
//! its headers (`headers.rs`) or, for a job row, its `created` event (`created.rs`, built
//! from the parts `job_row.rs` decodes) or a [`JobDispatcher`] (`jobs.rs`) decide what is
//! sent; failures become a [`JetStreamError`] (`error.rs`). `builder.rs` holds the options,
//! `streams.rs` the start-up stream check.

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
    JetStreamPublisherBuilder,
};
pub use error::{JetStreamError, JetStreamErrorKind};
pub use jobs::{JobAdmission, JobDispatcher, JobRef, JobRequest, NoJobDispatcher};
pub use publisher::JetStreamPublisher;
pub use streams::{StreamCheck, StreamCheckError};
