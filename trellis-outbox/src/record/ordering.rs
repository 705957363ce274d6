//! Ordering keys: the key a record is published in order with, and what happens to the
//! rest of a key when its head goes `dead`.

use crate::error::Error;

/// What the dispatcher does with the later rows of an ordering key whose head (its oldest
/// undispatched row) has been given up on (`dead`).
///
/// ```
/// use trellis_outbox::HeadOfLine;
///
/// assert_eq!(HeadOfLine::default(), HeadOfLine::Block);
/// assert_eq!("skip_dead".parse::<HeadOfLine>()?, HeadOfLine::SkipDead);
/// assert_eq!(HeadOfLine::Block.to_string(), "block");
/// # Ok::<(), trellis_outbox::Error>(())
/// ```
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum HeadOfLine {
    /// The key waits: nothing after a dead head is published until an operator retries it
    /// (`OutboxRepository::retry`, `trellis-outbox retry`). `trellis-outbox status` lists
    /// blocked keys. The default: order is never broken silently.
    #[default]
    Block,
    /// A dead head no longer holds the key back: the rows after it are published, and the
    /// dead row stays for inspection (retrying it later publishes it out of order).
    SkipDead,
}

wire_strings! {
    HeadOfLine, unknown: Error::UnknownHeadOfLine,
    /// The policy's name: `block` or `skip_dead`.
    Block => "block",
    SkipDead => "skip_dead",
}

/// The longest ordering key accepted, in bytes.
pub const MAX_ORDERING_KEY_BYTES: usize = 1024;

/// The ordering key of a record and what happens when its key's head fails permanently.
///
/// Rows with the same key are published strictly in the order their transactions committed;
/// the dispatcher never publishes a row while an earlier row of its key is pending, failed,
/// in flight, or `dead` under [`HeadOfLine::Block`].
///
/// ```
/// use trellis_outbox::{HeadOfLine, OrderingKey, PreparedOutboxRecord};
///
/// let record = PreparedOutboxRecord::event("Orders.Placed", "events.v1.Orders.Placed", &1)?
///     .ordered_by("order-42");
/// assert_eq!(record.ordering, Some(OrderingKey::new("order-42")));
///
/// let skipping = record.with_head_of_line(HeadOfLine::SkipDead);
/// assert_eq!(skipping.ordering.unwrap().head_of_line, HeadOfLine::SkipDead);
/// # Ok::<(), trellis_outbox::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct OrderingKey {
    /// The key, e.g. an aggregate id. Not empty, no control characters, at most
    /// [`MAX_ORDERING_KEY_BYTES`] bytes.
    pub key: String,
    /// The policy when the key's head is dead.
    pub head_of_line: HeadOfLine,
}

impl OrderingKey {
    /// `key` with the default policy, [`HeadOfLine::Block`].
    pub fn new(key: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            head_of_line: HeadOfLine::Block,
        }
    }

    /// `self` with `policy`.
    #[must_use]
    pub fn with_head_of_line(mut self, policy: HeadOfLine) -> Self {
        self.head_of_line = policy;
        self
    }

    /// Whether a dead head of this key lets later rows through (the stored flag).
    pub(crate) fn skip_dead(&self) -> bool {
        self.head_of_line == HeadOfLine::SkipDead
    }

    /// What is wrong with the key, if anything.
    pub(super) fn problem(&self) -> Option<&'static str> {
        if self.key.is_empty() {
            Some("is empty")
        } else if self.key.len() > MAX_ORDERING_KEY_BYTES {
            Some("is longer than 1024 bytes")
        } else if self.key.chars().any(char::is_control) {
            Some("contains control characters")
        } else {
            None
        }
    }
}
