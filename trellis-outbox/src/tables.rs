//! Validated table names and SQL dialects.

use std::fmt;

use crate::error::{Error, Result};

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

    /// Validates both names (outbox first) and returns them.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidTableName`] naming the first invalid table, with upstream's exact message.
    pub fn new(outbox: impl Into<String>, inbox: impl Into<String>) -> Result<Self> {
        let outbox = outbox.into();
        let inbox = inbox.into();
        validate_identifier(TableKind::Outbox, &outbox)?;
        validate_identifier(TableKind::Inbox, &inbox)?;
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
    fn accepts_identifiers() {
        for good in ["a", "_", "A_1", "trellis_outbox", "_x9"] {
            OutboxTables::new(good, good).unwrap();
        }
    }
}
