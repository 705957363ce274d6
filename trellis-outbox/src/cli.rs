//! The `trellis-outbox` command-line tool (feature `cli`).

use std::io::Write;

use clap::{Parser, Subcommand, ValueEnum};

use crate::migrate::{SqlOutboxMigration, migrations};
use crate::tables::{Dialect, OutboxTables};

/// Command-line tool for trellis-outbox.
#[derive(Debug, Parser)]
#[command(name = "trellis-outbox", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the schema migrations as SQL, to paste into sqlx-cli, refinery or any other tool.
    Sql {
        /// The SQL dialect.
        #[arg(long, value_enum)]
        dialect: DialectArg,
        /// The outbox table's name.
        #[arg(long, default_value = OutboxTables::DEFAULT_OUTBOX)]
        outbox_table: String,
        /// The inbox table's name.
        #[arg(long, default_value = OutboxTables::DEFAULT_INBOX)]
        inbox_table: String,
        /// Print the `down` statements instead of `up`, newest version first (the order
        /// they must run in).
        #[arg(long)]
        down: bool,
        /// Print only this migration version.
        #[arg(long)]
        version: Option<u32>,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DialectArg {
    Postgres,
    Sqlite,
}

/// Runs the tool with `args` (the first item is the program name), writing to `out`.
///
/// # Errors
///
/// A message for the user: bad arguments (including `--help`/`--version`, which clap reports
/// as errors carrying their text), an invalid table name or an unknown version.
///
/// # Examples
///
/// ```
/// let mut out = Vec::new();
/// trellis_outbox::cli::run(["trellis-outbox", "sql", "--dialect", "sqlite"], &mut out)?;
/// assert!(String::from_utf8(out)?.contains("CREATE TABLE IF NOT EXISTS trellis_outbox"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn run<I, T>(args: I, out: &mut dyn Write) -> Result<(), Box<dyn std::error::Error>>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = Cli::try_parse_from(args)?;
    match cli.command {
        Command::Sql {
            dialect,
            outbox_table,
            inbox_table,
            down,
            version,
        } => {
            let dialect = match dialect {
                DialectArg::Postgres => Dialect::Postgres,
                DialectArg::Sqlite => Dialect::Sqlite,
            };
            let tables = OutboxTables::new(outbox_table, inbox_table)?;
            let all = migrations(dialect, &tables);
            let mut selected: Vec<&SqlOutboxMigration> = all
                .iter()
                .filter(|m| version.is_none_or(|v| m.version == v))
                .collect();
            if down {
                // Reverting runs newest version first: v1's DROP TABLE before v2's ALTERs
                // would leave nothing for them to alter.
                selected.reverse();
            }
            if selected.is_empty() {
                let known: Vec<u32> = all.iter().map(|m| m.version).collect();
                return Err(format!("no migration version {version:?}; known: {known:?}").into());
            }
            for (i, m) in selected.iter().enumerate() {
                if i > 0 {
                    writeln!(out)?;
                }
                let text = if down { m.down_script() } else { m.up_script() };
                out.write_all(text.as_bytes())?;
            }
            Ok(())
        }
    }
}
