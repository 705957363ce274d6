//! `trellis-outbox relay`: the dispatcher until SIGINT or SIGTERM, with a progress line.

use std::future::Future;
use std::io::{IsTerminal as _, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::Pool;

use super::ops::{Relay, redact, seconds};
use super::{CliError, Global};
use crate::dispatch::{DispatcherBuilder, OutboxDispatcher, PublishError, Publisher, RetryPolicy};
use crate::driver::OutboxDatabase;
use crate::nats::JetStreamPublisher;
use crate::record::OutboxMessage;
use crate::sql_repository::SqlOutboxRepository;
use crate::tables::OutboxTables;

type Builder<DB> = DispatcherBuilder<SqlOutboxRepository<DB>, Counted<JetStreamPublisher>>;

/// A publisher that counts the rows it published (acknowledged), for the progress line.
pub(super) struct Counted<P> {
    publisher: P,
    published: Arc<AtomicU64>,
}

impl<P: Publisher> Publisher for Counted<P> {
    async fn publish_batch(
        &self,
        messages: &[OutboxMessage],
    ) -> Vec<Result<Option<serde_json::Value>, PublishError>> {
        let results = self.publisher.publish_batch(messages).await;
        let published = results.iter().filter(|result| result.is_ok()).count();
        self.published.fetch_add(
            u64::try_from(published).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        results
    }

    fn on_start(&self, retry_policy: &RetryPolicy) -> impl Future<Output = ()> + Send {
        self.publisher.on_start(retry_policy)
    }

    fn publish_budget(&self, rows: usize) -> Option<Duration> {
        self.publisher.publish_budget(rows)
    }
}

/// The longest `--progress-every`: tokio's interval adds its period to instants, so a
/// period near `u64::MAX` seconds is not handed to it.
const MAX_PROGRESS_EVERY: Duration = Duration::from_secs(86_400);

/// Connects to `global`'s NATS server, failing fast (5 s) when it is not there at all, then
/// reconnecting for as long as the command runs.
pub(super) async fn connect_nats(
    global: &Global,
    name: &str,
) -> Result<async_nats::Client, CliError> {
    let nats_url = redact(&global.nats_url);
    let nats = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .max_reconnects(None)
        .name(name);
    let client = tokio::time::timeout(Duration::from_secs(5), nats.connect(&global.nats_url))
        .await
        .map_err(|_| format!("cannot reach NATS at {nats_url}: no answer within 5 s"))?
        .map_err(|e| format!("cannot reach NATS at {nats_url}: {e}"))?;
    Ok(client)
}

pub(super) async fn relay<DB: OutboxDatabase>(
    pool: Pool<DB>,
    global: &Global,
    tables: &OutboxTables,
    relay: Relay,
    out: &mut dyn Write,
    configure: impl FnOnce(Builder<DB>) -> Builder<DB>,
) -> Result<(), CliError> {
    let client = connect_nats(global, "trellis-outbox relay").await?;
    let mut repo = SqlOutboxRepository::with_tables(pool.clone(), tables);
    if relay.beside_upstream {
        repo = repo.beside_upstream();
    }
    let published = Arc::new(AtomicU64::new(0));
    let publisher = Counted {
        publisher: JetStreamPublisher::builder(async_nats::jetstream::new(client)).build(),
        published: Arc::clone(&published),
    };
    let dispatcher: OutboxDispatcher = configure(
        OutboxDispatcher::builder(repo, publisher).on_error(|error| {
            // tracing is not set up by the tool: errors go to stderr, one line each.
            eprintln!("relay: {}", crate::chain::error_chain(error));
        }),
    )
    .start()?;
    let status = SqlOutboxRepository::with_tables(pool, tables);
    let terminal = std::io::stdout().is_terminal();
    let period = relay
        .progress_every
        .clamp(Duration::from_millis(100), MAX_PROGRESS_EVERY);
    let mut ticks = tokio::time::interval(period);
    // A status query slower than the period is not followed by another at once.
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut signals = Signals::new()?;
    // Output that cannot be written (`relay | head -1`) stops the relay, gracefully.
    let mut broken: Option<std::io::Error> = None;
    loop {
        tokio::select! {
            () = signals.next() => break,
            _ = ticks.tick() => {
                let line = tokio::select! {
                    () = signals.next() => break,
                    // Not `status()`: that counts every row of the table, dispatched ones
                    // included, each period. `progress()` reads only the rows not dispatched
                    // (through the index on `state`); the dispatched count is this relay's own.
                    now = status.progress() => match now {
                        Ok(now) => {
                            format!(
                                "dispatched +{} since start  failed {}  dead {}  undispatched {}  lag {}",
                                published.load(Ordering::Relaxed),
                                now.count("failed"),
                                now.count("dead"),
                                now.undispatched(),
                                now.oldest_undispatched.map_or_else(|| "none".to_owned(), seconds),
                            )
                        }
                        Err(e) => {
                            eprintln!("relay: status: {}", crate::chain::error_chain(&e));
                            continue;
                        }
                    },
                };
                let written = if terminal {
                    write!(out, "\r\x1b[2K{line}")
                } else {
                    writeln!(out, "{line}")
                };
                if let Err(error) = written.and_then(|()| out.flush()) {
                    broken = Some(error);
                    break;
                }
            }
        }
    }
    // From here on, output is best effort: the shutdown matters more.
    if terminal {
        let _ = writeln!(out);
    }
    let _ = writeln!(
        out,
        "stopping: finishing the batch in flight (signal again to stop at once)"
    );
    let _ = out.flush();
    tokio::select! {
        () = dispatcher.shutdown() => {}
        () = signals.next() => {
            return Err("stopped at once by a second signal: rows in flight are published \
                again after their lease (JetStream drops the duplicates within its window)"
                .into());
        }
    }
    let _ = writeln!(out, "stopped");
    match broken {
        Some(error) => Err(format!("cannot write the progress line: {error}").into()),
        None => Ok(()),
    }
}

/// SIGINT and SIGTERM (Ctrl-C elsewhere), each received as often as it comes.
struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> Result<Self, CliError> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Self {
                term: signal(SignalKind::terminate())?,
                int: signal(SignalKind::interrupt())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// Resolves at the next signal.
    async fn next(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
