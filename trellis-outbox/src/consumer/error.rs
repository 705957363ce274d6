//! Errors of starting a consumer, and reports of messages it could not apply.

use std::fmt;
use std::time::Duration;

use crate::dispatch::BoxError;

/// Why a [`Consumer`](super::Consumer) could not start, or a dead letter could not be read
/// or replayed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// An option is out of range.
    #[error("invalid consumer option `{option}`: {problem}")]
    InvalidOptions {
        /// The option.
        option: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// The stream could not be read or created.
    #[error("JetStream stream `{stream}` could not be read or created")]
    Stream {
        /// The stream's name.
        stream: String,
        /// The server's or client's error.
        #[source]
        source: BoxError,
    },
    /// The durable consumer could not be read or created.
    #[error("JetStream consumer `{consumer}` on stream `{stream}` could not be read or created")]
    Consumer {
        /// The stream's name.
        stream: String,
        /// The consumer's name.
        consumer: String,
        /// The server's or client's error.
        #[source]
        source: BoxError,
    },
    /// The consumer exists but does not fit (not a pull consumer, not explicit ack).
    #[error("JetStream consumer `{consumer}` on stream `{stream}` cannot be used: {problem}")]
    Unsuitable {
        /// The stream's name.
        stream: String,
        /// The consumer's name.
        consumer: String,
        /// Why.
        problem: String,
    },
    /// Pulling messages failed.
    #[error("pulling messages from JetStream consumer `{consumer}` failed")]
    Pull {
        /// The consumer's name.
        consumer: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },
    /// A dead letter could not be replayed
    /// ([`replay_dead_letters`](crate::replay_dead_letters)); its copy and the ones after it
    /// stay in place.
    #[error(
        "dead letter {sequence} could not be replayed to `{subject}` ({replayed} replayed before it)"
    )]
    Replay {
        /// The copy's sequence in the dead-letter stream.
        sequence: u64,
        /// The replay subject it was published to.
        subject: String,
        /// How many dead letters this replay had replayed before it.
        replayed: u64,
        /// The client's or server's error.
        #[source]
        source: BoxError,
    },
    /// [`replay_dead_letters`](crate::replay_dead_letters) replayed nothing: the replay
    /// stream would not keep the replays until the consumer reads them, or no durable of the
    /// consumer's reads them (the consumer never started with replays on). Every copy stays.
    #[error("the dead letters of `{consumer}` were not replayed: {problem}")]
    ReplayRefused {
        /// The consumer.
        consumer: String,
        /// Why.
        problem: String,
    },
}

impl ConsumerError {
    /// Whether trying again later may succeed (the server was unreachable or busy).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::Stream { .. } | Self::Consumer { .. } | Self::Pull { .. } | Self::Replay { .. }
        )
    }
}

/// What went wrong with one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureKind {
    /// The message has no usable `Nats-Msg-Id`: it cannot be deduplicated, so it is not applied.
    MissingId,
    /// The payload is not the event type's JSON.
    Undecodable,
    /// The handler returned an error.
    Handler,
    /// The handler panicked.
    Panic,
    /// Beginning, recording the inbox row or committing failed.
    Database,
    /// The dead-letter copy could not be published.
    DeadLetter,
    /// Acknowledging to JetStream failed (the message will be redelivered and then found in
    /// the inbox).
    Ack,
}

/// What the consumer did with a message that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureAction {
    /// Asked JetStream to redeliver it after the delay.
    Redeliver {
        /// The delay.
        after: Duration,
    },
    /// Holds it (in progress, so JetStream does not redeliver it) until the database
    /// answers again, then tries it again, without spending a delivery: the attempt failed
    /// because the database could not be reached (the network, the pool's acquire timeout,
    /// the server starting, stopping or out of connections, an SQLite file locked by another
    /// writer), and the database did not answer the consumer's own check either. A message is
    /// not dead-lettered for a database outage, however long.
    WaitForDatabase,
    /// Copied it to the dead-letter subject and terminated it.
    DeadLettered,
    /// Terminated it without a dead-letter copy (dead letters are off, or the copy failed at
    /// the last delivery: the message is still in its stream at `stream_sequence`).
    Terminated,
    /// Nothing further: the effect is committed and a redelivery will be found in the inbox.
    None,
}

/// A message the consumer could not apply (or acknowledge), as reported to `on_error` and
/// logged. Never carries the payload.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ConsumeFailure {
    /// The JetStream consumer.
    pub consumer: String,
    /// The message id, if it had one.
    pub id: Option<String>,
    /// The message's stream sequence (a replay's: the original message's).
    pub stream_sequence: u64,
    /// For a replay ([`replay_dead_letters`](crate::replay_dead_letters)): its sequence in
    /// [`REPLAY_STREAM`](crate::REPLAY_STREAM), where a replay terminated without a copy
    /// stays.
    pub replay_sequence: Option<u64>,
    /// Which delivery failed.
    pub delivery: u64,
    /// What went wrong.
    pub kind: FailureKind,
    /// The error and its cause chain.
    pub error: String,
    /// What the consumer did about it.
    pub action: FailureAction,
}

impl fmt::Display for ConsumeFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "consumer `{}`: message {} (stream sequence {}, delivery {}) failed ({:?}): {}",
            self.consumer,
            self.id.as_deref().unwrap_or("<no id>"),
            self.stream_sequence,
            self.delivery,
            self.kind,
            self.error
        )?;
        if let Some(sequence) = self.replay_sequence {
            write!(f, " (a replay: sequence {sequence} of the replay stream)")?;
        }
        match self.action {
            FailureAction::Redeliver { after } => write!(f, "; redelivery in {after:?}"),
            FailureAction::WaitForDatabase => f.write_str(
                "; the database does not answer: held until it does, without a redelivery",
            ),
            FailureAction::DeadLettered => f.write_str("; dead-lettered and terminated"),
            FailureAction::Terminated => f.write_str("; terminated"),
            FailureAction::None => Ok(()),
        }
    }
}
