//! The commands that work on a database: connect, then migrate, status, list, inspect,
//! retry, purge (and the relay, in `relay.rs`).

use std::io::Write;
use std::str::FromStr;
use std::time::Duration;

use sqlx::pool::PoolOptions;
use sqlx::postgres::PgConnectOptions;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{Pool, Postgres, Sqlite};

use super::{CliError, Command, Global};
use crate::driver::OutboxDatabase;
use crate::migrate::{MigrateOptions, migrate_with_options};
use crate::sql_repository::SqlOutboxRepository;
use crate::tables::OutboxTables;

/// How long connecting may take before the tool gives up with a message.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A pool on the database `--database-url` names.
pub(super) enum Database {
    Postgres(Pool<Postgres>),
    Sqlite(Pool<Sqlite>),
}

impl Database {
    async fn connect(url: Option<&str>, create: bool) -> Result<Self, CliError> {
        let url = url.ok_or(
            "no database: pass --database-url (or set DATABASE_URL) to postgres://… or sqlite:<path>",
        )?;
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let options =
                PgConnectOptions::from_str(url).map_err(|e| format!("bad --database-url: {e}"))?;
            Ok(Self::Postgres(pool(url, options).await?))
        } else if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url)
                .map_err(|e| format!("bad --database-url: {e}"))?
                .create_if_missing(create)
                .busy_timeout(Duration::from_secs(10));
            Ok(Self::Sqlite(pool(url, options).await?))
        } else {
            Err(format!(
                "unsupported --database-url {}: use postgres://… or sqlite:<path>",
                redact(url)
            )
            .into())
        }
    }
}

/// The tool's small pool on the database `options` describe (`url`, for messages).
async fn pool<DB: sqlx::Database>(
    url: &str,
    options: <DB::Connection as sqlx::Connection>::Options,
) -> Result<Pool<DB>, CliError> {
    PoolOptions::<DB>::new()
        .max_connections(4)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect_with(options)
        .await
        .map_err(|e| format!("cannot connect to the database at {}: {e}", redact(url)).into())
}

/// `url` without its secrets, for messages: the password of `user:password@`, a NATS URL's
/// token (`nats://token@host`), and the values of query parameters that carry secrets
/// (`password`, `sslpassword`, `token`).
pub(super) fn redact(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let mut out = match (base.find("://"), base.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let credentials = &base[scheme + 3..at];
            let kept = match credentials.split_once(':') {
                Some((user, _)) => format!("{user}:***"),
                None if ["nats", "tls", "ws"].iter().any(|s| base.starts_with(s)) => {
                    "***".to_owned()
                }
                None => credentials.to_owned(),
            };
            format!("{}{kept}{}", &base[..scheme + 3], &base[at..])
        }
        _ => base.to_owned(),
    };
    if let Some(query) = query {
        let parameters: Vec<String> = query
            .split('&')
            .map(|parameter| match parameter.split_once('=') {
                Some((key, _))
                    if ["password", "sslpassword", "token"]
                        .iter()
                        .any(|secret| key.eq_ignore_ascii_case(secret)) =>
                {
                    format!("{key}=***")
                }
                _ => parameter.to_owned(),
            })
            .collect();
        out.push('?');
        out.push_str(&parameters.join("&"));
    }
    out
}

/// What `relay` was asked to do.
pub(super) struct Relay {
    pub(super) progress_every: Duration,
    pub(super) beside_upstream: bool,
}

pub(super) async fn execute(
    global: &Global,
    tables: &OutboxTables,
    command: Command,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let create = matches!(command, Command::Migrate { .. });
    match Database::connect(global.database_url.as_deref(), create).await? {
        Database::Postgres(pool) => {
            if let Command::Relay {
                progress_every,
                beside_upstream,
            } = command
            {
                let listen = pool.clone();
                let relay = Relay {
                    progress_every,
                    beside_upstream,
                };
                return super::relay::relay(pool, global, tables, relay, out, |builder| {
                    builder.listen_postgres(&listen, tables)
                })
                .await;
            }
            on(pool, tables, command, out).await
        }
        Database::Sqlite(pool) => {
            if let Command::Relay {
                progress_every,
                beside_upstream,
            } = command
            {
                let relay = Relay {
                    progress_every,
                    beside_upstream,
                };
                return super::relay::relay(pool, global, tables, relay, out, |b| b).await;
            }
            on(pool, tables, command, out).await
        }
    }
}

async fn on<DB: OutboxDatabase>(
    pool: Pool<DB>,
    tables: &OutboxTables,
    command: Command,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let repo = SqlOutboxRepository::with_tables(pool.clone(), tables);
    match command {
        Command::Migrate { lock_timeout } => {
            let options = MigrateOptions::default().with_lock_timeout(lock_timeout);
            let report = migrate_with_options(&pool, tables, &options).await?;
            if report.upgraded_from_0_10 {
                writeln!(out, "upgraded a Trellis 0.10 outbox table in place")?;
            }
            for id in &report.applied {
                writeln!(out, "applied {id}")?;
            }
            // The library only logs this, and the tool installs no logger.
            for id in &report.unknown {
                writeln!(
                    out,
                    "warning: the database records migration {id}, which this version does not \
                     know: a newer version of trellis-outbox migrated these tables"
                )?;
            }
            writeln!(
                out,
                "{} applied, {} already applied",
                report.applied.len(),
                report.already_applied.len()
            )?;
        }
        Command::Status { json } => {
            let status = repo.status().await?;
            if json {
                serde_json::to_writer(&mut *out, &status)?;
                writeln!(out)?;
            } else {
                for (state, count) in &status.counts {
                    writeln!(out, "{state:<11}{count}")?;
                }
                writeln!(out, "undispatched {}", status.undispatched())?;
                match status.oldest_undispatched {
                    Some(age) => writeln!(out, "lag        {}", seconds(age))?,
                    None => writeln!(out, "lag        none")?,
                }
                // Keys whose dead head holds them (policy `block`): retry the head.
                for blocked in &status.blocked_keys {
                    writeln!(
                        out,
                        "blocked    key {} behind dead {} ({} waiting)",
                        escaped(&blocked.key),
                        escaped(&blocked.head_id),
                        blocked.waiting
                    )?;
                }
                let more = status
                    .blocked_keys_total
                    .saturating_sub(status.blocked_keys.len() as u64);
                if more > 0 {
                    writeln!(
                        out,
                        "blocked    … and {more} more blocked keys ({} in all)",
                        status.blocked_keys_total
                    )?;
                }
            }
        }
        Command::List {
            state,
            limit,
            name,
            json,
        } => {
            let rows = repo
                .list_rows(state.state(), name.as_deref(), limit)
                .await?;
            if json {
                let rows: Vec<serde_json::Value> = rows
                    .into_iter()
                    .map(|row| match row {
                        Ok(row) => serde_json::to_value(row).unwrap_or_default(),
                        Err(poison) => {
                            serde_json::json!({"id": poison.id, "undecodable": poison.reason})
                        }
                    })
                    .collect();
                serde_json::to_writer_pretty(&mut *out, &rows)?;
                writeln!(out)?;
            } else {
                for row in rows {
                    // One line per row: text from the table (written by any writer) is
                    // escaped, so a newline in `last_error` cannot start a line of its own.
                    match row {
                        Ok(row) => {
                            let m = &row.message;
                            writeln!(
                                out,
                                "{}  {}  {}  attempts={}  created={}{}{}{}",
                                escaped(&m.id),
                                escaped(&m.name),
                                escaped(&m.subject),
                                m.attempts,
                                crate::time::format_timestamp(m.created_at),
                                row.ordering_key
                                    .as_deref()
                                    .map(|key| format!("  ordering_key={}", escaped(key)))
                                    .unwrap_or_default(),
                                lease(&row),
                                m.last_error
                                    .as_deref()
                                    .map(|e| format!("  error={}", escaped(e)))
                                    .unwrap_or_default()
                            )?;
                        }
                        Err(poison) => writeln!(
                            out,
                            "{}  undecodable: {}",
                            escaped(&poison.id),
                            escaped(&poison.reason)
                        )?,
                    }
                }
            }
        }
        Command::Inspect { id } => {
            let row = repo
                .get_row(&id)
                .await?
                .ok_or_else(|| format!("no outbox row with id {id:?}"))?;
            serde_json::to_writer_pretty(&mut *out, &row)?;
            writeln!(out)?;
        }
        Command::Retry {
            ids,
            all_dead,
            name,
            limit,
            dry_run,
        } => {
            if all_dead {
                let limit = limit.map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX));
                if dry_run {
                    let count = repo.count_dead(name.as_deref(), limit).await?;
                    writeln!(
                        out,
                        "would retry {count} dead rows (dry run: nothing changed)"
                    )?;
                } else {
                    let retried = repo.retry_dead_at_most(name.as_deref(), limit).await?;
                    writeln!(out, "retried {retried} dead rows")?;
                }
            } else {
                let mut refused = Vec::new();
                for id in &ids {
                    let outcome = crate::dispatch::OutboxRepository::retry(&repo, id).await?;
                    if outcome.is_retried() {
                        writeln!(out, "{id}: retried")?;
                    } else {
                        refused.push(format!("{id}: {outcome}"));
                    }
                }
                if !refused.is_empty() {
                    return Err(format!("not retried: {}", refused.join("; ")).into());
                }
            }
        }
        Command::Purge {
            dispatched_older_than,
            inbox_older_than,
            batch,
        } => {
            // Checked by clap (1 to 100,000) before connecting.
            let batch = usize::try_from(batch).unwrap_or(usize::MAX);
            if let Some(age) = dispatched_older_than {
                let deleted = repo.purge_dispatched(age, batch).await?;
                purged(out, deleted, "dispatched", age)?;
            }
            if let Some(age) = inbox_older_than {
                let deleted = repo.purge_inbox(age, batch).await?;
                purged(out, deleted, "inbox", age)?;
            }
        }
        // Handled before a database is opened.
        Command::Sql { .. } | Command::Relay { .. } | Command::DeadLetters { .. } => {
            return Err("this command does not run on a database".into());
        }
    }
    Ok(())
}

/// The line `purge` prints for one table.
fn purged(out: &mut dyn Write, deleted: u64, what: &str, age: Duration) -> std::io::Result<()> {
    writeln!(
        out,
        "deleted {deleted} {what} rows older than {}",
        seconds(age)
    )
}

/// A listed row's lease for text output: `  claim_token=… claimed_until=…` while a claim
/// token is set (the lease may have run out: compare `claimed_until` with the database's
/// clock), nothing otherwise.
fn lease(row: &crate::admin::OutboxRow) -> String {
    match (&row.claim_token, row.claimed_until) {
        (None, None) => String::new(),
        (token, until) => format!(
            "  claim_token={}  claimed_until={}",
            token
                .as_deref()
                .map_or(std::borrow::Cow::Borrowed("none"), escaped),
            until.map_or_else(|| "none".to_owned(), crate::time::format_timestamp)
        ),
    }
}

/// `text` for one line of text output: control characters escaped (`\n`, `\r`, `\t`,
/// `\u{1b}`, …) and so backslashes too (`\\`), so that what a writer stored can neither
/// break a line nor be mistaken for an escape. JSON output carries the text as stored.
pub(super) fn escaped(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(|c| c.is_control() || c == '\\') {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.extend(c.escape_unicode()),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A duration for people: `3s`, `1h 2m`.
pub(super) fn seconds(duration: Duration) -> String {
    humantime::format_duration(Duration::from_secs(duration.as_secs())).to_string()
}

#[cfg(test)]
mod tests {
    use super::{escaped, redact};

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(escaped("plain text"), "plain text");
        assert_eq!(
            escaped("line 1\nline 2\r\ttab \\n \u{1b}[2K"),
            "line 1\\nline 2\\r\\ttab \\\\n \\u{1b}[2K"
        );
    }

    #[test]
    fn passwords_are_not_printed() {
        for (url, shown) in [
            ("postgres://u:secret@h/db", "postgres://u:***@h/db"),
            ("postgres://u@h/db", "postgres://u@h/db"),
            ("sqlite:app.db", "sqlite:app.db"),
            (
                "postgres://u@h:1/db?password=hunter2&sslmode=disable",
                "postgres://u@h:1/db?password=***&sslmode=disable",
            ),
            (
                "postgres://h/db?sslpassword=x",
                "postgres://h/db?sslpassword=***",
            ),
            ("nats://u:hunter2@h:4222", "nats://u:***@h:4222"),
            ("nats://s3cr3t-token@h:4222", "nats://***@h:4222"),
            ("nats://h:4222", "nats://h:4222"),
        ] {
            assert_eq!(redact(url), shown, "{url}");
        }
    }
}
