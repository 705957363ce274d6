//! The `trellis-outbox` command-line tool (feature `cli`): print the migrations, apply them,
//! and see and repair an outbox without writing SQL.
//!
//! `mod.rs` holds the arguments and `run`; `ops.rs` the database commands (migrate, status,
//! list, inspect, retry, purge); `relay.rs` the relay; `dead_letters.rs` a consumer's dead
//! letters (NATS only).

mod dead_letters;
mod ops;
mod relay;

use std::io::Write;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::migrate::{SqlOutboxMigration, migrations};
use crate::tables::{Dialect, OutboxTables};

/// See and repair a trellis-outbox outbox: migrate, status, relay, list, inspect, retry,
/// purge; list or replay a consumer's dead letters; or print the migrations as SQL.
///
/// Parsed by clap; [`run`] parses and runs it. A program that embeds the tool can parse the
/// arguments first, to reject bad ones before it opens anything:
///
/// ```
/// use clap::Parser;
/// use trellis_outbox::cli::Cli;
///
/// assert!(Cli::try_parse_from(["trellis-outbox", "sql", "--dialect", "postgres"]).is_ok());
/// let error = Cli::try_parse_from(["trellis-outbox", "sql", "--dialect", "mysql"]).unwrap_err();
/// assert_eq!(error.kind(), clap::error::ErrorKind::InvalidValue);
/// ```
#[derive(Debug, Parser)]
#[command(name = "trellis-outbox", version, long_about = None)]
pub struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

/// Options every command takes.
#[derive(Debug, Args)]
struct Global {
    /// The database: `postgres://…` or `sqlite:<path>`.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// The NATS server (relay, dead-letters).
    #[arg(
        long,
        env = "NATS_URL",
        global = true,
        hide_env_values = true,
        default_value = "nats://127.0.0.1:4222"
    )]
    nats_url: String,
    /// The outbox table's name.
    #[arg(long, global = true, default_value = OutboxTables::DEFAULT_OUTBOX)]
    outbox_table: String,
    /// The inbox table's name.
    #[arg(long, global = true, default_value = OutboxTables::DEFAULT_INBOX)]
    inbox_table: String,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the schema migrations as SQL, to paste into sqlx-cli, refinery or any other tool.
    #[command(after_help = "Example: trellis-outbox sql --dialect postgres > outbox.sql")]
    Sql {
        /// The SQL dialect.
        #[arg(long, value_enum)]
        dialect: DialectArg,
        /// Print the `down` statements instead of `up`, newest version first (the order
        /// they must run in).
        #[arg(long)]
        down: bool,
        /// Print only this migration version.
        #[arg(long)]
        version: Option<u32>,
    },
    /// Apply the pending migrations (safe to run from every replica at once).
    #[command(after_help = "Example: trellis-outbox --database-url sqlite:app.db migrate")]
    Migrate {
        /// Postgres: how long a migration statement may wait for a lock on a table before the
        /// migration gives up (nothing applied; retry it); 0 waits forever.
        #[arg(long, default_value = "10s", value_parser = duration)]
        lock_timeout: Duration,
    },
    /// Rows per state, the undispatched count and the age of the oldest undispatched row.
    #[command(after_help = "Example: trellis-outbox status --json")]
    Status {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Run the dispatcher, publishing to NATS JetStream until SIGINT or SIGTERM, then shut
    /// down gracefully (the batch in flight finishes; rows not attempted are released).
    #[command(after_help = "Example: trellis-outbox relay --progress-every 30s")]
    Relay {
        /// How often to print a progress line (dispatched, failed, dead, lag); at least
        /// 100 ms, at most a day.
        #[arg(long, default_value = "10s", value_parser = duration)]
        progress_every: Duration,
        /// Run beside upstream Trellis dispatchers on the same table: every claim also
        /// writes upstream's lease (`next_attempt_at`), so theirs skip rows this relay holds.
        #[arg(long)]
        beside_upstream: bool,
    },
    /// List rows in a state, oldest first.
    #[command(after_help = "Example: trellis-outbox list --state dead --name Orders.Shipped")]
    List {
        /// The state.
        #[arg(long, value_enum)]
        state: StateArg,
        /// At most this many rows.
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// Only rows of this event name or job queue.
        #[arg(long)]
        name: Option<String>,
        /// Print JSON (one array) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print one row as JSON.
    #[command(after_help = "Example: trellis-outbox inspect 01J9ZK3V8Q2W4E6R8T0Y1U3I5O")]
    Inspect {
        /// The row's id.
        id: String,
    },
    /// Make failed or dead rows due again now (bulk replay with --all-dead) and wake the
    /// dispatchers (Postgres NOTIFY).
    #[command(
        after_help = "Examples:\n  trellis-outbox retry 01J9ZK3V8Q2W4E6R8T0Y1U3I5O\n  trellis-outbox retry --all-dead --name Orders.Shipped --limit 100 --dry-run"
    )]
    Retry {
        /// The rows' ids.
        #[arg(required_unless_present = "all_dead", conflicts_with = "all_dead")]
        ids: Vec<String>,
        /// Every dead row (of --name, if given).
        #[arg(long)]
        all_dead: bool,
        /// With --all-dead: only rows of this event name or job queue.
        // Not `requires = "all_dead"`: clap counts the flag's default (false) as present. Without
        // ids, --all-dead is required anyway.
        #[arg(long, conflicts_with = "ids")]
        name: Option<String>,
        /// With --all-dead: at most this many rows, the oldest first.
        #[arg(long, conflicts_with = "ids", value_parser = clap::value_parser!(u64).range(1..))]
        limit: Option<u64>,
        /// With --all-dead: print how many rows would be retried, and change nothing.
        #[arg(long, conflicts_with = "ids")]
        dry_run: bool,
    },
    /// List a JetStream consumer's dead letters, oldest first, or hand them back to it with
    /// --replay (to that consumer only, through the stream trellis_consumer_replays; a
    /// replayed copy is deleted). Needs NATS only, no database.
    #[command(
        after_help = "Examples:\n  trellis-outbox dead-letters --consumer billing\n  trellis-outbox dead-letters --consumer billing --replay --limit 100\n\nA replay reaches only the named consumer (no other consumer of the subject sees the\nmessage again); it waits in the replay stream until that consumer runs."
    )]
    DeadLetters {
        /// The durable consumer's name.
        #[arg(long)]
        consumer: String,
        /// At most this many copies.
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
        limit: u64,
        /// Hand them back to the consumer instead of listing them.
        #[arg(long)]
        replay: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Delete old dispatched rows and/or old inbox rows (dead rows are never deleted).
    #[command(
        after_help = "Example: trellis-outbox purge --dispatched-older-than 7d --inbox-older-than 30d"
    )]
    Purge {
        /// Delete dispatched rows last updated longer ago than this (e.g. `7d`, `12h`).
        #[arg(long, value_parser = duration, required_unless_present = "inbox_older_than")]
        dispatched_older_than: Option<Duration>,
        /// Delete inbox rows received longer ago than this (e.g. `30d`).
        #[arg(long, value_parser = duration)]
        inbox_older_than: Option<Duration>,
        /// Rows per delete statement, 1 to 100,000 (checked before connecting).
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=MAX_PURGE_BATCH))]
        batch: u64,
    },
}

/// The largest `purge --batch` ([`SqlOutboxRepository::purge_dispatched`]'s limit).
///
/// [`SqlOutboxRepository::purge_dispatched`]: crate::SqlOutboxRepository::purge_dispatched
const MAX_PURGE_BATCH: u64 = 100_000;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DialectArg {
    Postgres,
    Sqlite,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum StateArg {
    Pending,
    Claimed,
    Failed,
    Dead,
    Dispatched,
}

impl StateArg {
    fn state(self) -> crate::OutboxMessageState {
        use crate::OutboxMessageState as S;
        match self {
            Self::Pending => S::Pending,
            Self::Claimed => S::Claimed,
            Self::Failed => S::Failed,
            Self::Dead => S::Dead,
            Self::Dispatched => S::Dispatched,
        }
    }
}

/// `7d`, `12h`, `30m`, `45s`, `1h 30m`, … (humantime's format).
fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text)
        .map_err(|e| format!("{e}; write a duration such as 30s, 15m, 12h or 7d"))
}

/// A boxed error with a message for the user.
type CliError = Box<dyn std::error::Error>;

/// Runs the tool with `args` (the first item is the program name), writing to `out`.
///
/// # Errors
///
/// A message for the user: bad arguments (including `--help`/`--version`, which clap reports
/// as errors carrying their text), an invalid table name or an unknown version, an
/// unreachable database or NATS server, an unknown id.
///
/// # Examples
///
/// ```
/// let mut out = Vec::new();
/// trellis_outbox::cli::run(["trellis-outbox", "sql", "--dialect", "sqlite"], &mut out)?;
/// assert!(String::from_utf8(out)?.contains("CREATE TABLE IF NOT EXISTS trellis_outbox"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn run<I, T>(args: I, out: &mut dyn Write) -> Result<(), CliError>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = Cli::try_parse_from(args)?;
    let tables = OutboxTables::new(&cli.global.outbox_table, &cli.global.inbox_table)?;
    match cli.command {
        Command::Sql {
            dialect,
            down,
            version,
        } => print_sql(dialect, &tables, down, version, out),
        command => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            match command {
                Command::DeadLetters {
                    consumer,
                    limit,
                    replay,
                    json,
                } => {
                    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
                    let listing = dead_letters::Listing {
                        consumer,
                        limit,
                        replay,
                        json,
                    };
                    runtime.block_on(dead_letters::run(&cli.global, listing, out))
                }
                command => runtime.block_on(ops::execute(&cli.global, &tables, command, out)),
            }
        }
    }
}

/// The tool's `main`: runs it with the process's arguments and exits with 0, 1 after an
/// error (one line on stderr), or clap's code for bad arguments (2) and `--help` (0).
///
/// The `trellis-outbox` binary is this function; a service can ship the tool inside its own
/// binary the same way:
///
/// ```no_run
/// // The body of `fn main` in, say, the service's `src/bin/outbox.rs`:
/// trellis_outbox::cli::main();
/// ```
pub fn main() {
    let stdout = std::io::stdout();
    if let Err(error) = run(std::env::args_os(), &mut stdout.lock()) {
        match error.downcast_ref::<clap::Error>() {
            Some(clap_error) => clap_error.exit(),
            None => {
                eprintln!("error: {}", crate::chain::error_chain(&*error));
                std::process::exit(1);
            }
        }
    }
}

fn print_sql(
    dialect: DialectArg,
    tables: &OutboxTables,
    down: bool,
    version: Option<u32>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let dialect = match dialect {
        DialectArg::Postgres => Dialect::Postgres,
        DialectArg::Sqlite => Dialect::Sqlite,
    };
    let all = migrations(dialect, tables);
    let mut selected: Vec<&SqlOutboxMigration> = all
        .iter()
        .filter(|m| version.is_none_or(|v| m.version == v))
        .collect();
    if down {
        // Reverting runs newest version first: v1's DROP TABLE before v2's ALTERs would
        // leave nothing for them to alter.
        selected.reverse();
    }
    if let (Some(version), true) = (version, selected.is_empty()) {
        let known: Vec<String> = all.iter().map(|m| m.version.to_string()).collect();
        return Err(format!(
            "no migration version {version}; known versions: {}",
            known.join(", ")
        )
        .into());
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

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    #[test]
    fn the_arguments_are_consistent() {
        super::Cli::command().debug_assert();
    }
}
