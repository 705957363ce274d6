//! Validated table names and SQL dialects.

use std::fmt;

use crate::error::{Error, Result, TableKind};

/// The SQL dialects trellis-outbox speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Dialect {
    /// SQLite 3.35 or later.
    Sqlite,
    /// PostgreSQL 12 or later.
    Postgres,
}

impl Dialect {
    /// The dialect's wire name, as used in migration ids: `sqlite` or `postgres`.
    ///
    /// ```
    /// assert_eq!(trellis_outbox::Dialect::Postgres.as_str(), "postgres");
    /// ```
    pub const fn as_str(self) -> &'static str {
        match self {
            Dialect::Sqlite => "sqlite",
            Dialect::Postgres => "postgres",
        }
    }
}

impl fmt::Display for Dialect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Dialect {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "sqlite" => Ok(Dialect::Sqlite),
            "postgres" | "postgresql" => Ok(Dialect::Postgres),
            other => Err(format!(
                "unknown SQL dialect {other:?} (expected sqlite or postgres)"
            )),
        }
    }
}

/// The names of the outbox and inbox tables, validated as simple SQL identifiers.
///
/// Names are checked with upstream Trellis' rule, `^[A-Za-z_][A-Za-z0-9_]*$` (spec §B.1),
/// outbox first, so an `OutboxTables` value can always be spliced into SQL safely. No SQL is
/// ever built from an unvalidated name: every API that takes table names takes this type.
///
/// # Examples
///
/// ```
/// use trellis_outbox::OutboxTables;
///
/// let tables = OutboxTables::new("billing_outbox", "billing_inbox")?;
/// assert_eq!(tables.outbox(), "billing_outbox");
///
/// let defaults = OutboxTables::default();
/// assert_eq!((defaults.outbox(), defaults.inbox()), ("trellis_outbox", "trellis_inbox"));
///
/// assert!(OutboxTables::new("x;drop table y", "inbox").is_err());
/// # Ok::<(), trellis_outbox::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OutboxTables {
    outbox: String,
    inbox: String,
}

impl OutboxTables {
    /// Upstream's default outbox table name.
    pub const DEFAULT_OUTBOX: &'static str = "trellis_outbox";
    /// Upstream's default inbox table name.
    pub const DEFAULT_INBOX: &'static str = "trellis_inbox";

    /// PostgreSQL's identifier limit in bytes (`NAMEDATALEN - 1`).
    pub const MAX_IDENTIFIER_BYTES: usize = 63;

    /// The suffixes of identifiers derived from the outbox table name: the `NOTIFY` channel
    /// and the indexes. Keep in sync with `migrate.rs` and `sql.rs`.
    /// (Version 5's `_ord_*` names are shorter than `_claim_idx`: they change no limit.)
    const OUTBOX_SUFFIXES: [&'static str; 9] = [
        "_wakeup",
        "_due_idx",
        "_claim_idx",
        "_done_idx",
        "_ord_idx",
        "_ord_new",
        "_ord_seq",
        "_ord_fn",
        "_ord_trg",
    ];
    /// The suffix of the index derived from the inbox table name.
    const INBOX_SUFFIX: &'static str = "_recv_idx";

    /// Validates both names (outbox first) and returns them.
    ///
    /// Both must be simple identifiers (upstream's rule) and fit PostgreSQL's 63-byte
    /// identifier limit together with every identifier derived from them: `<outbox>_wakeup`,
    /// `<outbox>_due_idx`, `<outbox>_claim_idx`, `<outbox>_done_idx`, version 5's
    /// `<outbox>_ord_{idx,new,seq,fn,trg}` and `<inbox>_recv_idx`, so an outbox name has at most
    /// 53 bytes and an inbox name at most 54.
    /// The limit applies on SQLite too, so a schema can move between the two.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidTableName`] naming the first invalid table, with upstream's exact message;
    /// then [`Error::TableNameTooLong`] naming the first identifier that does not fit.
    ///
    /// ```
    /// use trellis_outbox::{Error, OutboxTables};
    ///
    /// let err = OutboxTables::new("o".repeat(57), "inbox").unwrap_err();
    /// assert!(matches!(err, Error::TableNameTooLong { length: 64, .. }));
    /// assert!(err.to_string().contains("_wakeup\" derived from it is 64 bytes"));
    /// ```
    pub fn new(outbox: impl Into<String>, inbox: impl Into<String>) -> Result<Self> {
        let outbox = outbox.into();
        let inbox = inbox.into();
        validate_identifier(TableKind::Outbox, &outbox)?;
        validate_identifier(TableKind::Inbox, &inbox)?;
        usable(TableKind::Outbox, &outbox)?;
        usable(TableKind::Inbox, &inbox)?;
        if inbox.eq_ignore_ascii_case(&outbox) {
            return Err(Error::TableNameUnusable {
                kind: TableKind::Inbox,
                name: inbox,
                reason: "is the outbox table's name too",
            });
        }
        let outbox_derived = Self::OUTBOX_SUFFIXES
            .iter()
            .map(|suffix| format!("{outbox}{suffix}"));
        check_length(
            TableKind::Outbox,
            &outbox,
            std::iter::once(outbox.clone()).chain(outbox_derived),
        )?;
        check_length(
            TableKind::Inbox,
            &inbox,
            [inbox.clone(), format!("{inbox}{}", Self::INBOX_SUFFIX)],
        )?;
        Ok(Self { outbox, inbox })
    }

    /// The outbox table's name.
    pub fn outbox(&self) -> &str {
        &self.outbox
    }

    /// The inbox table's name.
    pub fn inbox(&self) -> &str {
        &self.inbox
    }
}

impl Default for OutboxTables {
    fn default() -> Self {
        Self {
            outbox: Self::DEFAULT_OUTBOX.to_owned(),
            inbox: Self::DEFAULT_INBOX.to_owned(),
        }
    }
}

fn validate_identifier(kind: TableKind, name: &str) -> Result<()> {
    let mut chars = name.chars();
    let valid = matches!(chars.next(), Some(c) if c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric());
    if valid {
        Ok(())
    } else {
        Err(Error::InvalidTableName {
            kind,
            name: name.to_owned(),
        })
    }
}

/// PostgreSQL's reserved key words (those that cannot name a table, including the ones that
/// can name a function or type), in lower case. Most are reserved in SQLite too.
const RESERVED: [&str; 101] = [
    "all",
    "analyse",
    "analyze",
    "and",
    "any",
    "array",
    "as",
    "asc",
    "asymmetric",
    "authorization",
    "binary",
    "both",
    "case",
    "cast",
    "check",
    "collate",
    "collation",
    "column",
    "concurrently",
    "constraint",
    "create",
    "cross",
    "current_catalog",
    "current_date",
    "current_role",
    "current_schema",
    "current_time",
    "current_timestamp",
    "current_user",
    "default",
    "deferrable",
    "desc",
    "distinct",
    "do",
    "else",
    "end",
    "except",
    "false",
    "fetch",
    "for",
    "foreign",
    "freeze",
    "from",
    "full",
    "grant",
    "group",
    "having",
    "ilike",
    "in",
    "initially",
    "inner",
    "intersect",
    "into",
    "is",
    "isnull",
    "join",
    "lateral",
    "leading",
    "left",
    "like",
    "limit",
    "localtime",
    "localtimestamp",
    "natural",
    "not",
    "notnull",
    "null",
    "offset",
    "on",
    "only",
    "or",
    "order",
    "outer",
    "overlaps",
    "placing",
    "primary",
    "references",
    "returning",
    "right",
    "select",
    "session_user",
    "similar",
    "some",
    "symmetric",
    "system_user",
    "table",
    "tablesample",
    "then",
    "to",
    "trailing",
    "true",
    "union",
    "unique",
    "user",
    "using",
    "variadic",
    "verbose",
    "when",
    "where",
    "window",
    "with",
];

/// Refuses a name SQL reserves, and the migrations bookkeeping table's.
fn usable(kind: TableKind, name: &str) -> Result<()> {
    let reason = if RESERVED.iter().any(|word| word.eq_ignore_ascii_case(name)) {
        "is a reserved SQL word"
    } else if crate::migrate::MIGRATIONS_TABLE.eq_ignore_ascii_case(name) {
        "is the migrations bookkeeping table's name"
    } else {
        return Ok(());
    };
    Err(Error::TableNameUnusable {
        kind,
        name: name.to_owned(),
        reason,
    })
}

/// Refuses `name` when one of `identifiers` (the name and those derived from it) is longer
/// than PostgreSQL allows.
fn check_length(
    kind: TableKind,
    name: &str,
    identifiers: impl IntoIterator<Item = String>,
) -> Result<()> {
    let limit = OutboxTables::MAX_IDENTIFIER_BYTES;
    match identifiers.into_iter().find(|id| id.len() > limit) {
        Some(derived) => Err(Error::TableNameTooLong {
            kind,
            name: name.to_owned(),
            length: derived.len(),
            derived,
            limit,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_what_upstream_rejects() {
        for bad in [
            "tenant.trellis_outbox",
            "trellis-inbox",
            "1abc",
            "",
            "a b",
            "x;drop table y",
            "abc\n",
            "é",
        ] {
            let err = OutboxTables::new(bad, "inbox").unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "Invalid SQL outbox table name \"{bad}\". Use a simple identifier matching ^[A-Za-z_][A-Za-z0-9_]*$."
                )
            );
        }
        let err = OutboxTables::new("ok", "trellis-inbox").unwrap_err();
        assert!(matches!(
            err,
            Error::InvalidTableName {
                kind: TableKind::Inbox,
                ..
            }
        ));
        // Outbox is checked first.
        let err = OutboxTables::new("bad-outbox", "bad-inbox").unwrap_err();
        assert!(err.to_string().contains("outbox table name \"bad-outbox\""));
    }

    #[test]
    fn refuses_reserved_words_and_names_taken() {
        for (outbox, inbox, kind, reason) in [
            (
                "order",
                "inbox",
                TableKind::Outbox,
                "is a reserved SQL word",
            ),
            ("outbox", "User", TableKind::Inbox, "is a reserved SQL word"),
            (
                "events",
                "events",
                TableKind::Inbox,
                "is the outbox table's name too",
            ),
            (
                "Events",
                "events",
                TableKind::Inbox,
                "is the outbox table's name too",
            ),
            (
                "trellis_outbox_migrations",
                "inbox",
                TableKind::Outbox,
                "is the migrations bookkeeping table's name",
            ),
        ] {
            let err = OutboxTables::new(outbox, inbox).unwrap_err();
            assert!(
                matches!(&err, Error::TableNameUnusable { kind: k, reason: r, .. } if *k == kind && *r == reason),
                "{outbox}, {inbox}: {err:?}"
            );
        }
        let err = OutboxTables::new("order", "inbox").unwrap_err();
        assert_eq!(
            err.to_string(),
            "SQL outbox table name \"order\" cannot be used: it is a reserved SQL word"
        );
        // Words that are only keywords in some positions are fine.
        assert!(OutboxTables::new("event", "message").is_ok());
    }

    #[test]
    fn refuses_names_whose_derived_identifiers_exceed_63_bytes() {
        // 57: `<outbox>_wakeup` is 64 bytes (every enqueue's NOTIFY would fail).
        let err = OutboxTables::new("a".repeat(57), "inbox").unwrap_err();
        let wakeup = format!("{}_wakeup", "a".repeat(57));
        assert!(
            matches!(
                &err,
                Error::TableNameTooLong { kind: TableKind::Outbox, derived, length: 64, limit: 63, .. }
                    if *derived == wakeup
            ),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "SQL outbox table name \"{}\" is too long: the identifier \"{wakeup}\" derived from it is 64 bytes, over PostgreSQL's limit of 63 bytes",
                "a".repeat(57)
            )
        );
        // 62: `_due_idx` and `_claim_idx` would be truncated to the same name.
        let err = OutboxTables::new("b".repeat(62), "inbox").unwrap_err();
        assert!(
            matches!(&err, Error::TableNameTooLong { length: 69, .. }),
            "{err:?}"
        );
        // 54: `<outbox>_claim_idx` is 64 bytes.
        let err = OutboxTables::new("c".repeat(54), "inbox").unwrap_err();
        assert!(err.to_string().contains("_claim_idx"), "{err}");
        assert!(!err.is_retryable());
        // 53 (outbox) and 54 (inbox) fit every derived identifier.
        OutboxTables::new("d".repeat(53), "e".repeat(54)).unwrap();
        // 55: `<inbox>_recv_idx` is 64 bytes.
        let err = OutboxTables::new("outbox", "e".repeat(55)).unwrap_err();
        assert!(err.to_string().contains("_recv_idx"), "{err}");
        // The inbox's own name must fit too.
        let err = OutboxTables::new("outbox", "i".repeat(64)).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::TableNameTooLong {
                    kind: TableKind::Inbox,
                    length: 64,
                    ..
                }
            ),
            "{err:?}"
        );
        // Upstream's identifier rule is checked first, with upstream's message.
        let err = OutboxTables::new(format!("{}-x", "a".repeat(70)), "inbox").unwrap_err();
        assert!(matches!(err, Error::InvalidTableName { .. }));
    }

    #[test]
    fn accepts_identifiers() {
        for good in ["a", "_", "A_1", "trellis_outbox", "_x9"] {
            OutboxTables::new(good, "inbox").unwrap();
            OutboxTables::new("outbox", good).unwrap();
        }
    }
}
