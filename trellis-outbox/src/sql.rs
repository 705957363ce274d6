//! SQL text, built once per table set from validated identifiers.

use std::sync::Arc;

use crate::tables::{Dialect, OutboxTables};

/// The outbox columns in storage order (spec §B.2).
pub(crate) const COLUMNS: &str = "id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at, next_attempt_at, last_error, outcome";

/// The SQL trellis-outbox sends for one dialect and table set.
///
/// The enqueue and inbox statements are byte-for-byte upstream Trellis' (spec §B.5), so rows
/// written by either implementation are indistinguishable.
///
/// # Examples
///
/// ```
/// use trellis_outbox::{Dialect, Outbox};
///
/// let outbox = Outbox::default();
/// let sql = outbox.sql(Dialect::Postgres);
/// assert!(sql.enqueue().contains("VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) ON CONFLICT (id) DO NOTHING"));
/// assert_eq!(sql.notify_channel(), "trellis_outbox_wakeup");
/// assert_eq!(
///     sql.inbox_insert(),
///     "INSERT INTO trellis_inbox (message_id, received_at) VALUES ($1, $2) ON CONFLICT (message_id) DO NOTHING",
/// );
/// ```
#[derive(Debug, Clone)]
pub struct SqlStatements {
    pub(crate) dialect: Dialect,
    pub(crate) outbox_table: Arc<str>,
    pub(crate) enqueue: Arc<str>,
    pub(crate) select_by_id: Arc<str>,
    pub(crate) inbox_insert: Arc<str>,
    pub(crate) notify_channel: Arc<str>,
    /// Whether Postgres enqueues send `NOTIFY` (see [`Outbox::without_notify`](crate::Outbox::without_notify)).
    pub(crate) notify: bool,
}

impl SqlStatements {
    pub(crate) fn new(dialect: Dialect, tables: &OutboxTables, notify: bool) -> Self {
        let (o, i) = (tables.outbox(), tables.inbox());
        let (enqueue, select_by_id, inbox_insert) = match dialect {
            Dialect::Sqlite => (
                format!(
                    "INSERT INTO {o} ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO NOTHING"
                ),
                format!("SELECT {COLUMNS} FROM {o} WHERE id = ?"),
                format!(
                    "INSERT INTO {i} (message_id, received_at) VALUES (?, ?) ON CONFLICT(message_id) DO NOTHING"
                ),
            ),
            // Upstream's INSERT, wrapped so that a row actually inserted also sends a wake-up
            // notification ($14 = channel; NULL sends none) in the same round trip; Postgres
            // delivers it only when the transaction commits.
            Dialect::Postgres => (
                format!(
                    "WITH inserted AS (INSERT INTO {o} ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) ON CONFLICT (id) DO NOTHING RETURNING 1) \
                     SELECT CASE WHEN $14::text IS NOT NULL THEN pg_notify($14, '')::text END FROM inserted"
                ),
                format!("SELECT {COLUMNS} FROM {o} WHERE id = $1"),
                format!(
                    "INSERT INTO {i} (message_id, received_at) VALUES ($1, $2) ON CONFLICT (message_id) DO NOTHING"
                ),
            ),
        };
        Self {
            dialect,
            outbox_table: o.into(),
            enqueue: enqueue.into(),
            select_by_id: select_by_id.into(),
            inbox_insert: inbox_insert.into(),
            notify_channel: notify_channel(tables).into(),
            notify,
        }
    }

    /// The dialect these statements are written in.
    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// The single-row enqueue: upstream's `INSERT … ON CONFLICT … DO NOTHING`; on Postgres
    /// wrapped so that an inserted row also notifies [`SqlStatements::notify_channel`].
    pub fn enqueue(&self) -> &str {
        &self.enqueue
    }

    /// The Postgres `LISTEN`/`NOTIFY` channel that enqueues on this outbox notify:
    /// `<outbox table>_wakeup`. Notifications carry no payload; they are only a hint.
    pub fn notify_channel(&self) -> &str {
        &self.notify_channel
    }

    /// Whether enqueues send a `NOTIFY` on [`notify_channel`](Self::notify_channel): on
    /// Postgres unless the outbox was built [`without_notify`](crate::Outbox::without_notify);
    /// never on SQLite.
    pub fn notifies(&self) -> bool {
        self.notify
    }

    /// The channel to bind to the enqueue statements: `None` sends no notification.
    #[cfg(feature = "postgres")]
    pub(crate) fn notify_bind(&self) -> Option<&str> {
        self.notify.then_some(&*self.notify_channel)
    }

    /// Reads one stored row by id (used when an enqueue hits an existing id).
    pub fn select_by_id(&self) -> &str {
        &self.select_by_id
    }

    /// The inbox insert: upstream's statement; its affected-row count decides the receipt.
    pub fn inbox_insert(&self) -> &str {
        &self.inbox_insert
    }
}

/// The wake-up channel of an outbox table.
pub(crate) fn notify_channel(tables: &OutboxTables) -> String {
    format!("{}_wakeup", tables.outbox())
}
