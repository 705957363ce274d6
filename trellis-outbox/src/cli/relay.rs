//! `trellis-outbox relay`: the dispatcher until SIGINT or SIGTERM, with a progress line.

use std::io::{IsTerminal as _, Write};
use std::time::Duration;

use sqlx::Pool;

use super::ops::seconds;
use super::{CliError, Global};
use crate::dispatch::{DispatcherBuilder, OutboxDispatcher};
use crate::driver::OutboxDatabase;
use crate::nats::JetStreamPublisher;
use crate::sql_repository::SqlOutboxRepository;
use crate::tables::OutboxTables;

type Builder<DB> = DispatcherBuilder<SqlOutboxRepository<DB>, JetStreamPublisher>;

pub(super) async fn relay<DB: OutboxDatabase>(
    pool: Pool<DB>,
    global: &Global,
    tables: &OutboxTables,
    progress_every: Duration,
    out: &mut dyn Write,
    configure: impl FnOnce(Builder<DB>) -> Builder<DB>,
) -> Result<(), CliError> {
    let nats = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .max_reconnects(None)
        .name("trellis-outbox relay");
    // Fail fast when the server is not there at all, then keep reconnecting while running.
    let client = tokio::time::timeout(Duration::from_secs(5), nats.connect(&global.nats_url))
        .await
        .map_err(|_| {
            format!(
                "cannot reach NATS at {}: no answer within 5 s",
                global.nats_url
            )
        })?
        .map_err(|e| format!("cannot reach NATS at {}: {e}", global.nats_url))?;
    let repo = SqlOutboxRepository::with_tables(pool.clone(), tables);
    let publisher = JetStreamPublisher::builder(async_nats::jetstream::new(client)).build();
    let dispatcher: OutboxDispatcher = configure(
        OutboxDispatcher::builder(repo, publisher).on_error(|error| {
            // tracing is not set up by the tool: errors go to stderr, one line each.
            eprintln!("relay: {}", crate::chain::error_chain(error));
        }),
    )
    .start()?;
    let status = SqlOutboxRepository::with_tables(pool, tables);
    let terminal = std::io::stdout().is_terminal();
    let mut ticks = tokio::time::interval(progress_every.max(Duration::from_millis(100)));
    let stop = stop_signal()?;
    tokio::pin!(stop);
    let mut first = None;
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = ticks.tick() => {
                match status.status().await {
                    Ok(now) => {
                        let dispatched = now.count("dispatched");
                        let since = dispatched.saturating_sub(*first.get_or_insert(dispatched));
                        let line = format!(
                            "dispatched {dispatched} (+{since} since start)  failed {}  dead {}  undispatched {}  lag {}",
                            now.count("failed"),
                            now.count("dead"),
                            now.undispatched(),
                            now.oldest_undispatched.map_or_else(|| "none".to_owned(), seconds),
                        );
                        if terminal {
                            write!(out, "\r\x1b[2K{line}")?;
                        } else {
                            writeln!(out, "{line}")?;
                        }
                        out.flush()?;
                    }
                    Err(e) => eprintln!("relay: status: {}", crate::chain::error_chain(&e)),
                }
            }
        }
    }
    if terminal {
        writeln!(out)?;
    }
    writeln!(out, "stopping: finishing the batch in flight")?;
    out.flush()?;
    dispatcher.shutdown().await;
    writeln!(out, "stopped")?;
    Ok(())
}

/// Resolves at the first SIGINT or SIGTERM.
fn stop_signal() -> Result<impl std::future::Future<Output = ()>, CliError> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}
