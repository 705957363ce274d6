//! [`ChaosPublisher`]: a [`Publisher`] wrapper that injects faults at random (seeded) around
//! a real publisher, and a [`Ledger`] of what really reached the inner publisher, for the
//! chaos suite (`tests/chaos.rs`).
//!
//! Faults, decided per batch and per row from the publisher's own seeded PRNG:
//!
//! * **fail before sending**: the whole batch, or single rows, fail retryably and are never
//!   handed to the inner publisher (nothing reaches NATS);
//! * **delay**: the batch sleeps before it is sent, usually a little, sometimes past the
//!   dispatcher's lease; or it is sent in two parts with a sleep in between;
//! * **lost ack**: the inner publish of a row succeeded, but the row is reported as timed
//!   out (retryably), so the dispatcher publishes it again later;
//! * **trap**: once [armed](Trap::arm), the next batch sends a random prefix of its rows,
//!   tells the test which rows it held, and then blocks forever (until the dispatcher task is
//!   aborted): a dispatcher dying mid-batch.
//!
//! The [`Ledger`], shared by every publisher of a run, counts per row id how many times the
//! inner publisher returned `Ok` (and for which dispatcher), and which rows had a lost ack
//! injected.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use serde_json::Value;
use tokio::sync::watch;
use trellis_outbox::{OutboxMessage, PublishError, Publisher, RetryPolicy};

/// How often each fault is injected. Probabilities are in `0.0..=1.0`.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    /// Per batch: the whole batch fails retryably before anything is sent.
    pub fail_batch: f64,
    /// Per row: the row fails retryably before it is sent.
    pub fail_row: f64,
    /// Per row: the row is published, then reported as a (retryable) ack timeout.
    pub lost_ack: f64,
    /// Per batch: sleep for a duration from `delay` before sending.
    pub delay_batch: f64,
    /// The short delays.
    pub delay: Range<Duration>,
    /// Per batch: sleep for a duration from `long_delay` (past the lease) before sending.
    pub long_delay_batch: f64,
    /// The long delays; make them longer than the dispatcher's lease.
    pub long_delay: Range<Duration>,
    /// Per batch: send the batch in two parts with a short delay in between.
    pub split_batch: f64,
}

impl ChaosConfig {
    /// The suite's defaults, with long delays just past `lease`.
    pub fn for_lease(lease: Duration) -> Self {
        Self {
            fail_batch: 0.04,
            fail_row: 0.01,
            lost_ack: 0.01,
            delay_batch: 0.10,
            delay: Duration::from_millis(5)..Duration::from_millis(300),
            long_delay_batch: 0.01,
            long_delay: lease + Duration::from_millis(100)..lease + Duration::from_millis(800),
            split_batch: 0.05,
        }
    }
}

/// What a [`ChaosPublisher`] injected and what its inner publisher did, for every publisher
/// of a run. Cloning gives another handle on the same ledger.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    inner: Arc<Mutex<LedgerState>>,
}

#[derive(Debug, Default)]
struct LedgerState {
    /// Per row id: the dispatcher index of every `Ok` the inner publisher returned.
    inner_ok: HashMap<String, Vec<usize>>,
    /// Per row id: how many lost acks were injected.
    lost_acks: HashMap<String, u32>,
    /// Ids of rows in batches that were delayed past the lease before sending.
    long_delayed: HashSet<String>,
    /// Per dispatcher: the ids its inner publisher returned `Ok` for, in its last batches.
    recent_ok: HashMap<usize, VecDeque<Vec<String>>>,
    counts: Injections,
}

/// Counters of a run's injections and inner-publisher outcomes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Injections {
    /// `publish_batch` calls.
    pub batches: u64,
    /// Batches failed before sending.
    pub failed_batches: u64,
    /// Rows failed before sending (alone, not as part of a failed batch).
    pub failed_rows: u64,
    /// Lost acks injected.
    pub lost_acks: u64,
    /// Short delays.
    pub delays: u64,
    /// Long delays (past the lease).
    pub long_delays: u64,
    /// Batches sent in two parts.
    pub splits: u64,
    /// Rows the inner publisher returned `Ok` for.
    pub inner_ok: u64,
    /// Rows the inner publisher returned an error for.
    pub inner_errors: u64,
    /// Inner `publish_batch` calls that panicked.
    pub inner_panics: u64,
    /// Inner `publish_batch` calls dropped before they finished (aborted task).
    pub inner_cancelled: u64,
    /// Traps sprung.
    pub traps: u64,
}

/// How many of a dispatcher's most recent batches [`Ledger::recent_ok`] remembers.
const RECENT_BATCHES: usize = 3;

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, LedgerState> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Per row id, the dispatcher index of every `Ok` its inner publisher returned.
    pub fn inner_ok(&self) -> HashMap<String, Vec<usize>> {
        self.state().inner_ok.clone()
    }

    /// Per row id, how many lost acks were injected.
    pub fn lost_acks(&self) -> HashMap<String, u32> {
        self.state().lost_acks.clone()
    }

    /// The ids dispatcher `index`'s inner publisher returned `Ok` for in its last few
    /// (up to 3) batches: the rows an abort of that dispatcher may leave published but not
    /// marked.
    pub fn recent_ok(&self, index: usize) -> HashSet<String> {
        self.state()
            .recent_ok
            .get(&index)
            .map(|batches| batches.iter().flatten().cloned().collect())
            .unwrap_or_default()
    }

    /// The ids of rows whose batch was delayed past the lease before it was sent.
    pub fn long_delayed(&self) -> HashSet<String> {
        self.state().long_delayed.clone()
    }

    /// The counters so far.
    pub fn injections(&self) -> Injections {
        self.state().counts
    }

    fn count(&self, f: impl FnOnce(&mut Injections)) {
        f(&mut self.state().counts);
    }

    fn record_inner(
        &self,
        dispatcher: usize,
        sent: &[&OutboxMessage],
        results: &[Result<Option<Value>, PublishError>],
    ) {
        let mut state = self.state();
        let mut ok_ids = Vec::new();
        for (message, result) in sent.iter().zip(results) {
            if result.is_ok() {
                state
                    .inner_ok
                    .entry(message.id.clone())
                    .or_default()
                    .push(dispatcher);
                state.counts.inner_ok += 1;
                ok_ids.push(message.id.clone());
            } else {
                state.counts.inner_errors += 1;
            }
        }
        let recent = state.recent_ok.entry(dispatcher).or_default();
        recent.push_back(ok_ids);
        while recent.len() > RECENT_BATCHES {
            recent.pop_front();
        }
    }

    fn record_delay(&self, long: bool, messages: &[OutboxMessage]) {
        let mut state = self.state();
        if long {
            state.counts.long_delays += 1;
            state
                .long_delayed
                .extend(messages.iter().map(|m| m.id.clone()));
        } else {
            state.counts.delays += 1;
        }
    }

    fn record_lost_ack(&self, id: &str) {
        let mut state = self.state();
        *state.lost_acks.entry(id.to_owned()).or_default() += 1;
        state.counts.lost_acks += 1;
    }
}

/// Makes the next batch of a [`ChaosPublisher`] block forever after sending part of it.
#[derive(Debug, Clone)]
pub struct Trap {
    armed: Arc<AtomicBool>,
    sprung: Arc<watch::Sender<Option<Vec<String>>>>,
}

impl Default for Trap {
    fn default() -> Self {
        Self {
            armed: Arc::new(AtomicBool::new(false)),
            sprung: Arc::new(watch::Sender::new(None)),
        }
    }
}

impl Trap {
    /// A trap that is not armed.
    pub fn new() -> Self {
        Self::default()
    }

    /// The next batch of the publisher holding this trap sends a random prefix of its rows
    /// and then blocks forever.
    pub fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Waits until the trap has sprung (or `timeout` passes) and returns the ids of the
    /// batch it caught.
    pub async fn sprung(&self, timeout: Duration) -> Option<Vec<String>> {
        let mut rx = self.sprung.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(Option::is_some))
            .await
            .ok()
            .and_then(Result::ok)
            .and_then(|ids| ids.clone())
    }

    fn take(&self) -> bool {
        self.armed.swap(false, Ordering::SeqCst)
    }
}

/// A [`Publisher`] that injects seeded random faults around `inner` and records in a
/// [`Ledger`] what really reached it.
#[derive(Debug)]
pub struct ChaosPublisher<P> {
    inner: P,
    dispatcher: usize,
    config: ChaosConfig,
    rng: Mutex<SmallRng>,
    ledger: Ledger,
    trap: Option<Trap>,
}

/// What happens to one row of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RowPlan {
    Send,
    FailBeforeSend,
    LoseAck,
}

#[derive(Debug)]
struct BatchPlan {
    fail: bool,
    delay: Option<(Duration, bool)>,
    split: Option<(usize, Duration)>,
    rows: Vec<RowPlan>,
    trap_prefix: Option<usize>,
}

impl<P: Publisher> ChaosPublisher<P> {
    /// Wraps `inner` for dispatcher number `dispatcher`; faults are drawn from a PRNG seeded
    /// with `seed`.
    pub fn new(
        inner: P,
        dispatcher: usize,
        seed: u64,
        config: ChaosConfig,
        ledger: Ledger,
    ) -> Self {
        Self {
            inner,
            dispatcher,
            config,
            rng: Mutex::new(SmallRng::seed_from_u64(seed)),
            ledger,
            trap: None,
        }
    }

    /// Gives this publisher a [`Trap`].
    pub fn with_trap(mut self, trap: Trap) -> Self {
        self.trap = Some(trap);
        self
    }

    fn plan(&self, len: usize) -> BatchPlan {
        let trap = self.trap.as_ref().is_some_and(Trap::take);
        let c = &self.config;
        let mut rng = self.rng.lock().unwrap_or_else(PoisonError::into_inner);
        if trap {
            return BatchPlan {
                fail: false,
                delay: None,
                split: None,
                rows: vec![RowPlan::Send; len],
                trap_prefix: Some(rng.random_range(0..=len)),
            };
        }
        let fail = rng.random_bool(c.fail_batch);
        let delay = if rng.random_bool(c.long_delay_batch) && !c.long_delay.is_empty() {
            Some((rng.random_range(c.long_delay.clone()), true))
        } else if rng.random_bool(c.delay_batch) && !c.delay.is_empty() {
            Some((rng.random_range(c.delay.clone()), false))
        } else {
            None
        };
        let split = (len > 1 && rng.random_bool(c.split_batch) && !c.delay.is_empty())
            .then(|| (rng.random_range(1..len), rng.random_range(c.delay.clone())));
        let rows = (0..len)
            .map(|_| {
                if rng.random_bool(c.fail_row) {
                    RowPlan::FailBeforeSend
                } else if rng.random_bool(c.lost_ack) {
                    RowPlan::LoseAck
                } else {
                    RowPlan::Send
                }
            })
            .collect();
        BatchPlan {
            fail,
            delay,
            split,
            rows,
            trap_prefix: None,
        }
    }

    /// Publishes `sent` through the inner publisher and records the results.
    async fn send(&self, sent: &[&OutboxMessage]) -> Vec<Result<Option<Value>, PublishError>> {
        if sent.is_empty() {
            return Vec::new();
        }
        let messages: Vec<OutboxMessage> = sent.iter().map(|m| (*m).clone()).collect();
        let mut probe = Probe {
            ledger: &self.ledger,
            finished: false,
        };
        let mut results = self.inner.publish_batch(&messages).await;
        probe.finished = true;
        results.truncate(sent.len());
        while results.len() < sent.len() {
            results.push(Err(PublishError::retryable(
                "chaos: the inner publisher returned no result for this row",
            )));
        }
        self.ledger.record_inner(self.dispatcher, sent, &results);
        results
    }
}

/// Counts an inner `publish_batch` that panicked or was dropped before it finished.
struct Probe<'a> {
    ledger: &'a Ledger,
    finished: bool,
}

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if std::thread::panicking() {
            self.ledger.count(|c| c.inner_panics += 1);
        } else {
            self.ledger.count(|c| c.inner_cancelled += 1);
        }
    }
}

fn injected(what: &str) -> PublishError {
    PublishError::retryable(format!("chaos: {what}"))
}

impl<P: Publisher> Publisher for ChaosPublisher<P> {
    fn on_start(&self, retry_policy: &RetryPolicy) -> impl Future<Output = ()> + Send {
        self.inner.on_start(retry_policy)
    }

    async fn publish_batch(
        &self,
        messages: &[OutboxMessage],
    ) -> Vec<Result<Option<Value>, PublishError>> {
        let plan = self.plan(messages.len());
        self.ledger.count(|c| c.batches += 1);

        if let Some(prefix) = plan.trap_prefix {
            let sent: Vec<&OutboxMessage> = messages.iter().take(prefix).collect();
            self.send(&sent).await;
            self.ledger.count(|c| c.traps += 1);
            if let Some(trap) = &self.trap {
                trap.sprung
                    .send_replace(Some(messages.iter().map(|m| m.id.clone()).collect()));
            }
            // Blocked inside the batch until the dispatcher task is aborted.
            std::future::pending::<()>().await;
        }

        if plan.fail {
            self.ledger.count(|c| c.failed_batches += 1);
            return messages
                .iter()
                .map(|_| Err(injected("injected failure before sending the batch")))
                .collect();
        }
        if let Some((delay, long)) = plan.delay {
            self.ledger.record_delay(long, messages);
            tokio::time::sleep(delay).await;
        }

        let sent: Vec<(usize, &OutboxMessage)> = messages
            .iter()
            .enumerate()
            .filter(|(i, _)| plan.rows.get(*i) != Some(&RowPlan::FailBeforeSend))
            .collect();
        let refs: Vec<&OutboxMessage> = sent.iter().map(|(_, m)| *m).collect();
        let inner_results = match plan.split {
            Some((at, pause)) if at < refs.len() => {
                self.ledger.count(|c| c.splits += 1);
                let mut first = self.send(&refs[..at]).await;
                tokio::time::sleep(pause).await;
                first.extend(self.send(&refs[at..]).await);
                first
            }
            _ => self.send(&refs).await,
        };

        let mut results: Vec<Option<Result<Option<Value>, PublishError>>> =
            std::iter::repeat_with(|| None)
                .take(messages.len())
                .collect();
        for ((index, message), result) in sent.into_iter().zip(inner_results) {
            let result = match (plan.rows.get(index), result) {
                (Some(RowPlan::LoseAck), Ok(_)) => {
                    self.ledger.record_lost_ack(&message.id);
                    Err(injected(
                        "injected lost ack: published, but reported as an ack timeout",
                    ))
                }
                (_, result) => result,
            };
            if let Some(slot) = results.get_mut(index) {
                *slot = Some(result);
            }
        }
        results
            .into_iter()
            .map(|result| {
                result.unwrap_or_else(|| {
                    self.ledger.count(|c| c.failed_rows += 1);
                    Err(injected("injected failure before sending the row"))
                })
            })
            .collect()
    }
}
