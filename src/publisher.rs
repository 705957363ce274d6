//! [`RecordingPublisher`]: a scriptable [`Publisher`] that records every attempt, for
//! dispatcher tests on any repository.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::watch;
use tokio::time::Instant;
use trellis_outbox::{OutboxMessage, PublishError, Publisher};

/// What one publish of one message returns.
#[derive(Debug)]
pub enum Outcome {
    /// Success with no outcome.
    Ok,
    /// Success with an outcome to store.
    OkWith(Value),
    /// Failure.
    Fail(PublishError),
}

impl Outcome {
    /// A retryable failure with `message`.
    pub fn retryable(message: impl Into<String>) -> Self {
        Outcome::Fail(PublishError::retryable(message.into()))
    }

    /// A permanent failure with `message`.
    pub fn permanent(message: impl Into<String>) -> Self {
        Outcome::Fail(PublishError::permanent(message.into()))
    }
}

/// One publish attempt of one message, recorded when the publisher is called.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// The row id.
    pub id: String,
    /// The row's `attempts` when it was published (failed attempts before this one).
    pub attempts: u32,
    /// Which `publish_batch` call it was part of (1 for the first).
    pub batch: usize,
    /// When the call started, on tokio's clock (paused time works).
    pub at: Instant,
}

/// A [`Publisher`] whose per-message results, delays and blocking the test controls, and
/// which records every attempt (id and the row's attempt count), so tests can count
/// attempts rather than only look at final states.
///
/// Unless scripted otherwise, every message succeeds. Cloning gives another handle on the
/// same recorder, so a test can keep one and hand one to the dispatcher.
///
/// ```
/// use trellis_outbox_tests::publisher::{Outcome, RecordingPublisher};
///
/// let publisher = RecordingPublisher::new();
/// publisher.script("flaky", [Outcome::retryable("timed out"), Outcome::Ok]);
/// publisher.fail_always("broken", "no responders");
/// publisher.fail_permanently("huge", "maximum payload exceeded");
/// assert_eq!(publisher.total_attempts(), 0);
/// ```
#[derive(Debug, Clone, Default)]
pub struct RecordingPublisher {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    changed: watch::Sender<u64>,
}

impl Default for Inner {
    fn default() -> Self {
        Self {
            state: Mutex::new(State::default()),
            changed: watch::Sender::new(0),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    attempts: Vec<Attempt>,
    successes: Vec<String>,
    scripts: HashMap<String, VecDeque<Outcome>>,
    always: HashMap<String, (bool, String)>,
    outcomes: HashMap<String, Value>,
    delays: HashMap<String, Duration>,
    batch_delay: Duration,
    gates: HashMap<String, Gate>,
    panic_on: HashSet<String>,
    short_results: usize,
    batches: usize,
    in_flight: usize,
    max_in_flight: usize,
}

/// Blocks publishing of batches holding a given id until [`Gate::open`] is called.
#[derive(Debug, Clone)]
pub struct Gate {
    open: Arc<watch::Sender<bool>>,
}

impl Gate {
    fn new() -> Self {
        Self {
            open: Arc::new(watch::Sender::new(false)),
        }
    }

    /// Lets blocked and later publishes proceed.
    pub fn open(&self) {
        self.open.send_replace(true);
    }

    async fn wait(&self) {
        let mut rx = self.open.subscribe();
        let _ = rx.wait_for(|open| *open).await;
    }
}

impl RecordingPublisher {
    /// A publisher on which every message succeeds.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn bump(&self) {
        self.inner.changed.send_modify(|v| *v += 1);
    }

    /// Queues outcomes for the next publishes of `id`, one per attempt; once they are used
    /// up, `id` falls back to [`fail_always`](Self::fail_always) if set, else success.
    pub fn script(&self, id: &str, outcomes: impl IntoIterator<Item = Outcome>) {
        self.state()
            .scripts
            .entry(id.to_owned())
            .or_default()
            .extend(outcomes);
    }

    /// Makes the next `times` publishes of `id` fail retryably with `message`.
    pub fn fail_times(&self, id: &str, times: usize, message: &str) {
        self.script(id, (0..times).map(|_| Outcome::retryable(message)));
    }

    /// Makes every publish of `id` fail retryably with `message` (after any script).
    pub fn fail_always(&self, id: &str, message: &str) {
        self.state()
            .always
            .insert(id.to_owned(), (true, message.to_owned()));
    }

    /// Makes every publish of `id` fail permanently with `message` (after any script).
    pub fn fail_permanently(&self, id: &str, message: &str) {
        self.state()
            .always
            .insert(id.to_owned(), (false, message.to_owned()));
    }

    /// Stops failing `id`: clears its script and permanent failure.
    pub fn heal(&self, id: &str) {
        let mut state = self.state();
        state.scripts.remove(id);
        state.always.remove(id);
    }

    /// The outcome successful publishes of `id` return.
    pub fn outcome(&self, id: &str, outcome: Value) {
        self.state().outcomes.insert(id.to_owned(), outcome);
    }

    /// A batch holding `id` takes `delay` (tokio time) before answering.
    pub fn delay(&self, id: &str, delay: Duration) {
        self.state().delays.insert(id.to_owned(), delay);
    }

    /// Every batch takes `delay` (tokio time) before answering.
    pub fn delay_every_batch(&self, delay: Duration) {
        self.state().batch_delay = delay;
    }

    /// Blocks every batch holding `id` (attempts are recorded first) until the returned
    /// gate is opened.
    pub fn hold(&self, id: &str) -> Gate {
        self.state()
            .gates
            .entry(id.to_owned())
            .or_insert_with(Gate::new)
            .clone()
    }

    /// The next batch holding `id` panics inside `publish_batch` (once).
    pub fn panic_on(&self, id: &str) {
        self.state().panic_on.insert(id.to_owned());
    }

    /// The next batch returns `missing` fewer results than messages (a broken publisher).
    pub fn drop_results(&self, missing: usize) {
        self.state().short_results = missing;
    }

    /// Every attempt so far, in order.
    pub fn attempts(&self) -> Vec<Attempt> {
        self.state().attempts.clone()
    }

    /// The `attempts` value each publish of `id` saw, in order (`[0, 1, 2]` for two
    /// failures and a third try).
    pub fn attempts_of(&self, id: &str) -> Vec<u32> {
        self.state()
            .attempts
            .iter()
            .filter(|a| a.id == id)
            .map(|a| a.attempts)
            .collect()
    }

    /// When each publish of `id` started.
    pub fn attempt_times(&self, id: &str) -> Vec<Instant> {
        self.state()
            .attempts
            .iter()
            .filter(|a| a.id == id)
            .map(|a| a.at)
            .collect()
    }

    /// How many times `id` was published (attempts, successful or not).
    pub fn attempt_count(&self, id: &str) -> usize {
        self.state().attempts.iter().filter(|a| a.id == id).count()
    }

    /// How many message publishes were attempted in total.
    pub fn total_attempts(&self) -> usize {
        self.state().attempts.len()
    }

    /// Ids whose publish succeeded, in order; an id appears once per success.
    pub fn successes(&self) -> Vec<String> {
        self.state().successes.clone()
    }

    /// How many `publish_batch` calls were made.
    pub fn batches(&self) -> usize {
        self.state().batches
    }

    /// The most `publish_batch` calls that ran at the same time.
    pub fn max_concurrent_batches(&self) -> usize {
        self.state().max_in_flight
    }

    /// Waits until `condition` holds (checked after every change), or `timeout` (tokio
    /// time) passes. Returns whether it holds.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        mut condition: impl FnMut(&RecordingPublisher) -> bool,
    ) -> bool {
        let mut changes = self.inner.changed.subscribe();
        let deadline = Instant::now() + timeout;
        loop {
            if condition(self) {
                return true;
            }
            tokio::select! {
                changed = changes.changed() => {
                    if changed.is_err() {
                        return condition(self);
                    }
                }
                () = tokio::time::sleep_until(deadline) => return condition(self),
            }
        }
    }

    /// Waits until at least `n` attempts were made in total (see
    /// [`wait_until`](Self::wait_until)).
    pub async fn wait_for_attempts(&self, n: usize, timeout: Duration) -> bool {
        self.wait_until(timeout, |p| p.total_attempts() >= n).await
    }

    fn result_for(state: &mut State, id: &str) -> Result<Option<Value>, PublishError> {
        if let Some(outcome) = state.scripts.get_mut(id).and_then(VecDeque::pop_front) {
            return match outcome {
                Outcome::Ok => Ok(None),
                Outcome::OkWith(value) => Ok(Some(value)),
                Outcome::Fail(error) => Err(error),
            };
        }
        if let Some((retryable, message)) = state.always.get(id) {
            return Err(if *retryable {
                PublishError::retryable(message.clone())
            } else {
                PublishError::permanent(message.clone())
            });
        }
        Ok(state.outcomes.get(id).cloned())
    }
}

impl Publisher for RecordingPublisher {
    async fn publish_batch(
        &self,
        messages: &[OutboxMessage],
    ) -> Vec<Result<Option<Value>, PublishError>> {
        let (delay, gates, panic) = {
            let mut state = self.state();
            state.batches += 1;
            state.in_flight += 1;
            state.max_in_flight = state.max_in_flight.max(state.in_flight);
            let batch = state.batches;
            let now = Instant::now();
            let mut delay = state.batch_delay;
            let mut gates = Vec::new();
            let mut panic = false;
            for m in messages {
                state.attempts.push(Attempt {
                    id: m.id.clone(),
                    attempts: m.attempts,
                    batch,
                    at: now,
                });
                if let Some(d) = state.delays.get(&m.id) {
                    delay = delay.max(*d);
                }
                if let Some(gate) = state.gates.get(&m.id) {
                    gates.push(gate.clone());
                }
                panic |= state.panic_on.remove(&m.id);
            }
            if panic {
                state.in_flight -= 1;
            }
            (delay, gates, panic)
        };
        self.bump();
        if panic {
            panic!("RecordingPublisher: scripted panic");
        }
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        for gate in gates {
            gate.wait().await;
        }
        let results = {
            let mut state = self.state();
            let missing = std::mem::take(&mut state.short_results);
            let answered = messages.len().saturating_sub(missing);
            let mut results = Vec::with_capacity(answered);
            for m in &messages[..answered] {
                let result = Self::result_for(&mut state, &m.id);
                if result.is_ok() {
                    state.successes.push(m.id.clone());
                }
                results.push(result);
            }
            state.in_flight -= 1;
            results
        };
        self.bump();
        results
    }
}
