//! The outbox data model: records to enqueue, stored messages, kinds and states.

use std::collections::BTreeMap;
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::subject::subject_problem;
use crate::time::{format_timestamp, now_millis};
use crate::wire::{header_problem, id_problem};

/// The NATS header carrying the JetStream de-duplication id (the outbox row id).
pub const NATS_MSG_ID: &str = "Nats-Msg-Id";
/// The header carrying the Trellis event time (`YYYY-MM-DDTHH:mm:ss.sssZ`).
pub const TRELLIS_EVENT_TIME: &str = "Trellis-Event-Time";

/// `as_str`, `Display` and `FromStr` of a fieldless enum from one table of wire strings,
/// so the three can never disagree; an unknown string is refused with `unknown(string)`.
macro_rules! wire_strings {
    (
        $ty:ident, unknown: $unknown:path,
        #[doc = $doc:literal]
        $($variant:ident => $wire:literal),+ $(,)?
    ) => {
        impl $ty {
            #[doc = $doc]
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $wire),+
                }
            }
        }

        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::std::str::FromStr for $ty {
            type Err = $crate::Error;

            fn from_str(s: &str) -> ::std::result::Result<Self, $crate::Error> {
                match s {
                    $($wire => Ok($ty::$variant),)+
                    other => Err($unknown(other.to_owned())),
                }
            }
        }
    };
}

/// What an outbox record asks the dispatcher to do. Wire strings are Trellis' own.
///
/// # Examples
///
/// ```
/// use trellis_outbox::OutboxRecordKind;
///
/// let kind: OutboxRecordKind = "job.submit".parse()?;
/// assert_eq!(kind, OutboxRecordKind::JobSubmit);
/// assert_eq!(OutboxRecordKind::EventPublish.to_string(), "event.publish");
/// assert!("job.cancel".parse::<OutboxRecordKind>().is_err());
/// # Ok::<(), trellis_outbox::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum OutboxRecordKind {
    /// `event.publish`: publish the payload to the subject.
    #[serde(rename = "event.publish")]
    EventPublish,
    /// `job.create`: create a Trellis job (strict admission).
    #[serde(rename = "job.create")]
    JobCreate,
    /// `job.submit`: submit a Trellis job (policy-aware admission).
    #[serde(rename = "job.submit")]
    JobSubmit,
}

wire_strings! {
    OutboxRecordKind, unknown: Error::UnknownKind,
    /// The wire string: `event.publish`, `job.create` or `job.submit`.
    EventPublish => "event.publish",
    JobCreate => "job.create",
    JobSubmit => "job.submit",
}

/// Where a stored outbox message is in its life. Wire strings are Trellis' own, plus `dead`.
///
/// ```
/// use trellis_outbox::OutboxMessageState;
///
/// assert_eq!("dead".parse::<OutboxMessageState>()?, OutboxMessageState::Dead);
/// assert_eq!(OutboxMessageState::Pending.as_str(), "pending");
/// # Ok::<(), trellis_outbox::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum OutboxMessageState {
    /// Enqueued, not yet attempted.
    Pending,
    /// Claimed by an upstream Trellis (TypeScript) dispatcher, whose claim lasts until
    /// `next_attempt_at`; claimable again after that. trellis-outbox's own claims never
    /// leave a row in this state (they keep `pending`/`failed` and hold a lease).
    Claimed,
    /// Delivered (terminal).
    Dispatched,
    /// The last attempt failed; due again at `next_attempt_at`.
    Failed,
    /// Given up on (too many attempts, a permanent error, or an undecodable row); kept for
    /// inspection and manual retry. Not a Trellis state: a trellis-outbox extension.
    Dead,
}

wire_strings! {
    OutboxMessageState, unknown: Error::UnknownState,
    /// The wire string: `pending`, `claimed`, `dispatched`, `failed` or `dead`.
    Pending => "pending",
    Claimed => "claimed",
    Dispatched => "dispatched",
    Failed => "failed",
    Dead => "dead",
}

/// Declares a struct whose first fields are a record's content, written once for the
/// [`PreparedOutboxRecord`] and the [`OutboxMessage`] stored from it (see
/// [`OutboxMessage::pending`]), then the struct's own fields.
macro_rules! with_record_content {
    ($(#[$attr:meta])* pub struct $name:ident { $($own:tt)* }) => {
        $(#[$attr])*
        pub struct $name {
            /// Idempotency key and primary key; also the JetStream `Nats-Msg-Id` of events.
            pub id: String,
            /// What the dispatcher does with the record.
            pub kind: OutboxRecordKind,
            /// The event name (e.g. `Orders.Shipped`) or job queue name.
            pub name: String,
            /// The NATS subject to publish to.
            pub subject: String,
            /// The JSON text to publish, stored verbatim.
            pub payload: String,
            /// NATS headers to publish with.
            pub headers: BTreeMap<String, String>,
            $($own)*
        }
    };
}

with_record_content! {
    /// A record ready to be written to the outbox (Trellis' `PreparedOutboxRecord`).
    ///
    /// Build one by hand, with [`PreparedOutboxRecord::event`], or let `#[derive(OutboxEvent)]`
    /// build it. It is validated when enqueued; see [`PreparedOutboxRecord::validate`].
    ///
    /// # Examples
    ///
    /// ```
    /// use trellis_outbox::{OutboxRecordKind, PreparedOutboxRecord};
    ///
    /// let record = PreparedOutboxRecord::event(
    ///     "Orders.Shipped",
    ///     "events.v1.Orders.Shipped",
    ///     &serde_json::json!({ "orderId": "o-1" }),
    /// )?;
    /// assert_eq!(record.kind, OutboxRecordKind::EventPublish);
    /// assert_eq!(record.payload, r#"{"orderId":"o-1"}"#);
    /// assert_eq!(record.headers["Nats-Msg-Id"], record.id);
    /// assert!(record.headers["Trellis-Event-Time"].ends_with('Z'));
    /// # Ok::<(), trellis_outbox::Error>(())
    /// ```
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct PreparedOutboxRecord {
        /// The key this record is published in order with, if any (see [`OrderingKey`]):
        /// records of one key reach the stream in commit order; records without a key are
        /// unordered. Set with [`PreparedOutboxRecord::ordered_by`] or
        /// a field marked `#[outbox(ordering_key)]` (struct policy: `ordering = "block"|"skip_dead"`).
        pub ordering: Option<OrderingKey>,
    }
}

mod ordering;

pub use ordering::{HeadOfLine, MAX_ORDERING_KEY_BYTES, OrderingKey};

impl PreparedOutboxRecord {
    /// Builds an `event.publish` record the way Trellis prepares events (spec §C.1): a new
    /// ULID as id, the body serialized with serde_json as payload, and headers
    /// `Nats-Msg-Id` = id and `Trellis-Event-Time` = now (`YYYY-MM-DDTHH:mm:ss.sssZ`).
    ///
    /// # Errors
    ///
    /// [`Error::Serialize`] if the body cannot be serialized. The subject and name are
    /// checked when the record is enqueued.
    pub fn event<T: Serialize + ?Sized>(
        name: impl Into<String>,
        subject: impl Into<String>,
        payload: &T,
    ) -> Result<Self> {
        let payload = serde_json::to_string(payload).map_err(|source| Error::Serialize {
            what: "event payload",
            source,
        })?;
        let id = new_id();
        let mut headers = BTreeMap::new();
        headers.insert(NATS_MSG_ID.to_owned(), id.clone());
        headers.insert(
            TRELLIS_EVENT_TIME.to_owned(),
            format_timestamp(now_millis()),
        );
        Ok(Self {
            id,
            kind: OutboxRecordKind::EventPublish,
            name: name.into(),
            subject: subject.into(),
            payload,
            headers,
            ordering: None,
        })
    }

    /// `self` published in order with every other record of `key` (see [`OrderingKey`]),
    /// keeping its head-of-line policy if it had a key already ([`HeadOfLine::Block`] if not).
    ///
    /// ```
    /// use trellis_outbox::PreparedOutboxRecord;
    ///
    /// let record = PreparedOutboxRecord::event("Orders.Placed", "events.v1.Orders.Placed", &1)?
    ///     .ordered_by("order-42");
    /// assert_eq!(record.ordering.unwrap().key, "order-42");
    /// # Ok::<(), trellis_outbox::Error>(())
    /// ```
    #[must_use]
    pub fn ordered_by(mut self, key: impl Into<String>) -> Self {
        let policy = self
            .ordering
            .as_ref()
            .map_or(HeadOfLine::Block, |o| o.head_of_line);
        self.ordering = Some(OrderingKey::new(key).with_head_of_line(policy));
        self
    }

    /// `self` with `policy` for its ordering key; no effect on a record without a key.
    ///
    /// ```
    /// use trellis_outbox::{HeadOfLine, PreparedOutboxRecord};
    ///
    /// let record = PreparedOutboxRecord::event("Orders.Placed", "events.v1.Orders.Placed", &1)?
    ///     .ordered_by("order-42")
    ///     .with_head_of_line(HeadOfLine::SkipDead);
    /// assert_eq!(record.ordering.unwrap().head_of_line, HeadOfLine::SkipDead);
    /// # Ok::<(), trellis_outbox::Error>(())
    /// ```
    #[must_use]
    pub fn with_head_of_line(mut self, policy: HeadOfLine) -> Self {
        if let Some(ordering) = &mut self.ordering {
            ordering.head_of_line = policy;
        }
        self
    }

    /// The record's ordering key and whether a dead head lets later rows through, as stored.
    #[cfg(feature = "postgres")]
    pub(crate) fn ordering_columns(&self) -> (Option<&str>, Option<bool>) {
        match &self.ordering {
            Some(o) => (Some(o.key.as_str()), Some(o.skip_dead())),
            None => (None, None),
        }
    }

    /// Checks the record before any SQL is sent.
    ///
    /// Rejected: an empty id, name or subject; an id with control characters or leading or
    /// trailing whitespace (it is sent as the `Nats-Msg-Id` header); a name with control
    /// characters; a subject with whitespace, an empty token, a `*`/`>` wildcard token, a
    /// first token starting with `$` (`$JS`, `$KV`, `$SYS`, … reach the NATS server's control
    /// plane) or a first token `_INBOX`; a payload that is not valid JSON text; header names
    /// that are empty or not printable ASCII without `:`; NATS control headers (any name
    /// starting with `Nats-`, in any letter case, except `Nats-Msg-Id`: `Nats-Rollup`,
    /// `Nats-Expected-*`, `Nats-TTL`, … can purge or alter a stream); header values
    /// containing a control character other than tab (CR and LF would end the header line).
    /// Every kind is checked the same way.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidRecord`] naming the field and the problem.
    ///
    /// ```
    /// use trellis_outbox::PreparedOutboxRecord;
    ///
    /// let mut record = PreparedOutboxRecord::event("A.B", "events.v1.A.B", &1)?;
    /// record.subject = "events.v1.*".into();
    /// let err = record.validate().unwrap_err();
    /// assert!(err.to_string().contains("`subject` contains the wildcard token `*`"));
    ///
    /// record.subject = "$JS.API.STREAM.DELETE.orders".into();
    /// assert!(record.validate().unwrap_err().to_string().contains("`subject` starts with the system token `$JS`"));
    ///
    /// record.subject = "events.v1.A.B".into();
    /// record.headers.insert("Nats-Rollup".into(), "all".into());
    /// assert!(record.validate().unwrap_err().to_string().contains("NATS control header"));
    /// # Ok::<(), trellis_outbox::Error>(())
    /// ```
    pub fn validate(&self) -> Result<()> {
        let id = self.id.as_str();
        if let Some(problem) = id_problem(id) {
            return Err(Error::invalid_record(id, "id", problem));
        }
        if self.name.is_empty() {
            return Err(Error::invalid_record(id, "name", "is empty"));
        }
        if self.name.chars().any(char::is_control) {
            return Err(Error::invalid_record(
                id,
                "name",
                "contains control characters",
            ));
        }
        if let Some(problem) = subject_problem(&self.subject) {
            return Err(Error::invalid_record(id, "subject", problem));
        }
        if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&self.payload) {
            return Err(Error::invalid_record(
                id,
                "payload",
                format!("is not valid JSON text: {e}"),
            ));
        }
        for (name, value) in &self.headers {
            if let Some(problem) = header_problem(name, value) {
                return Err(Error::invalid_record(id, "headers", problem));
            }
        }
        if let Some(problem) = self.ordering.as_ref().and_then(OrderingKey::problem) {
            return Err(Error::invalid_record(id, "ordering key", problem));
        }
        Ok(())
    }
}

with_record_content! {
    /// A stored outbox row (Trellis' `OutboxMessage`, with typed columns).
    #[derive(Debug, Clone, PartialEq, serde::Serialize)]
    #[non_exhaustive]
    pub struct OutboxMessage {
        /// Where the row is in its life.
        pub state: OutboxMessageState,
        /// How many attempts have failed.
        pub attempts: u32,
        /// When the row was enqueued (millisecond precision).
        pub created_at: DateTime<Utc>,
        /// When the row last changed.
        pub updated_at: DateTime<Utc>,
        /// When a failed row is due again.
        pub next_attempt_at: Option<DateTime<Utc>>,
        /// The last failure's cause.
        pub last_error: Option<String>,
        /// What dispatching produced (e.g. a job admission outcome), as JSON.
        pub outcome: Option<serde_json::Value>,
    }
}

impl OutboxMessage {
    /// A freshly enqueued row built from `record`, as it is inserted.
    pub(crate) fn pending(record: PreparedOutboxRecord, now: DateTime<Utc>) -> Self {
        // The ordering key is storage, not content: a message carries none.
        Self {
            id: record.id,
            kind: record.kind,
            name: record.name,
            subject: record.subject,
            payload: record.payload,
            headers: record.headers,
            state: OutboxMessageState::Pending,
            attempts: 0,
            created_at: now,
            updated_at: now,
            next_attempt_at: None,
            last_error: None,
            outcome: None,
        }
    }
}

/// The result of recording a message in the inbox.
///
/// ```
/// use trellis_outbox::InboxReceipt;
///
/// assert!(InboxReceipt::Accepted.is_accepted());
/// assert!(!InboxReceipt::Duplicate.is_accepted());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InboxReceipt {
    /// First time this message id was seen: handle the message.
    Accepted,
    /// Seen before: skip it.
    Duplicate,
}

impl InboxReceipt {
    /// `true` for [`InboxReceipt::Accepted`].
    pub const fn is_accepted(self) -> bool {
        matches!(self, InboxReceipt::Accepted)
    }
}

/// Anything that can be turned into an outbox record: events made with
/// `#[derive(OutboxEvent)]`, jobs made with `#[outbox_job]`, or a [`PreparedOutboxRecord`]
/// built by hand.
///
/// # Examples
///
/// ```
/// use trellis_outbox::{PreparedOutboxRecord, ToOutboxRecord};
///
/// struct Ping;
///
/// impl ToOutboxRecord for Ping {
///     fn to_outbox_record(&self) -> trellis_outbox::Result<PreparedOutboxRecord> {
///         PreparedOutboxRecord::event("Health.Ping", "events.v1.Health.Ping", &serde_json::json!({}))
///     }
/// }
///
/// assert_eq!(Ping.to_outbox_record()?.name, "Health.Ping");
/// # Ok::<(), trellis_outbox::Error>(())
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be written to the outbox",
    note = "derive it with `#[derive(trellis_outbox::OutboxEvent)]`, annotate it with `#[trellis_outbox::outbox_job(...)]`, or build a `PreparedOutboxRecord`"
)]
pub trait ToOutboxRecord {
    /// Builds the record. Each call of a generated implementation makes a new id unless
    /// the type names its own id field (`#[outbox(id)]`). A chosen id is the row's key in the
    /// whole outbox: namespace it by event type (`format!("order-shipped:{order_id}")`), since
    /// enqueueing an id that is stored with different content fails with
    /// [`Error::DuplicateIdentity`].
    ///
    /// # Errors
    ///
    /// [`Error::Serialize`] if the payload cannot be serialized.
    fn to_outbox_record(&self) -> Result<PreparedOutboxRecord>;
}

impl ToOutboxRecord for PreparedOutboxRecord {
    fn to_outbox_record(&self) -> Result<PreparedOutboxRecord> {
        Ok(self.clone())
    }
}

impl<T: ToOutboxRecord + ?Sized> ToOutboxRecord for &T {
    fn to_outbox_record(&self) -> Result<PreparedOutboxRecord> {
        (**self).to_outbox_record()
    }
}

impl<T: ToOutboxRecord + ?Sized> ToOutboxRecord for Box<T> {
    fn to_outbox_record(&self) -> Result<PreparedOutboxRecord> {
        (**self).to_outbox_record()
    }
}

static ULIDS: Mutex<ulid::Generator> = Mutex::new(ulid::Generator::new());

/// A new ULID string (26 characters, Crockford base32), monotonic within this process, so
/// ids made in the same millisecond still sort in the order they were made.
///
/// ```
/// let a = trellis_outbox::new_id();
/// let b = trellis_outbox::new_id();
/// assert_eq!(a.len(), 26);
/// assert!(a < b);
/// ```
pub fn new_id() -> String {
    let ulid = match ULIDS.lock() {
        Ok(mut generator) => match generator.generate() {
            Ok(ulid) => ulid,
            Err(overflow) => overflow.commit_overflow_increment(),
        },
        // A panic while holding the lock cannot leave the generator inconsistent; fall back
        // to a non-monotonic id rather than propagate the poison.
        Err(_) => ulid::Ulid::generate(),
    };
    ulid.to_string()
}

#[cfg(test)]
mod tests;
