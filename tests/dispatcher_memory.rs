//! Dispatcher behaviour on the memory repository with paused tokio time: spec §G.1 cases 1
//! and 4–14 (ported), plus the weak points the dispatcher fixes (§H 5–8, 15–19, 29).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, TimeZone, Utc};
use tokio::sync::watch;
use tokio::time::{Instant, sleep};
use trellis_outbox::{
    Claim, ClaimRequest, DispatchError, DispatchOptions, DispatchReport, Dispatched, Disposition,
    MemoryOutboxRepository, OutboxDispatcher, OutboxMessageState, OutboxRepository,
    PreparedOutboxRecord, PublishError, RetryPolicy, dispatch_outbox,
};
use trellis_outbox_tests::publisher::{Outcome, RecordingPublisher};

const LONG: Duration = Duration::from_secs(3600);
const WAIT: Duration = Duration::from_secs(60);

fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 5, 25, 0, 0, 0).unwrap()
}

/// The spec's `prepared(id)` fixture (§G.1).
fn prepared(id: &str) -> PreparedOutboxRecord {
    let mut record = PreparedOutboxRecord::event(
        "Thing.Changed",
        "events.v1.Thing.Changed",
        &serde_json::json!({ "value": "test" }),
    )
    .unwrap();
    record.id = id.to_owned();
    record
        .headers
        .insert("Nats-Msg-Id".to_owned(), id.to_owned());
    record.headers.insert(
        "Trellis-Event-Time".to_owned(),
        "2026-05-25T00:00:00.000Z".to_owned(),
    );
    record
}

fn state(repo: &MemoryOutboxRepository, id: &str) -> OutboxMessageState {
    repo.get(id).unwrap().state
}

/// Polls `condition` every millisecond of tokio time for up to [`WAIT`].
async fn eventually(mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if condition() {
            return true;
        }
        sleep(Duration::from_millis(1)).await;
    }
    condition()
}

/// Lets the dispatcher task run until it is idle, without moving paused time.
async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

/// `(cutoff passed, ids returned)` per claim.
type ClaimLog = Vec<(Option<DateTime<Utc>>, Vec<String>)>;

/// A repository wrapper that counts claims and can fail or block them.
#[derive(Debug)]
struct Probe {
    inner: Arc<MemoryOutboxRepository>,
    claims: AtomicUsize,
    in_claim: AtomicUsize,
    max_in_claim: AtomicUsize,
    /// Claims left to fail (`usize::MAX`: all).
    fail_claims: AtomicUsize,
    /// While set, claims wait for it to be cleared (after being counted).
    block: watch::Sender<bool>,
    /// While set, `mark_dispatched` waits for it to be cleared.
    block_marks: watch::Sender<bool>,
    /// Whether to overlap batches like the memory repository (off: one stage at a time).
    overlap: std::sync::atomic::AtomicBool,
    /// `(cutoff passed, ids returned)` per claim.
    log: Mutex<ClaimLog>,
    /// How long `next_due_in` takes.
    slow_due: Mutex<Duration>,
    /// How long `backlog` takes.
    slow_backlog: Mutex<Duration>,
    /// How often `next_due_in` was asked.
    due_asks: AtomicUsize,
    /// Repository calls dropped before they finished (on a database, each costs the
    /// connection the call was using).
    cancelled: Arc<AtomicUsize>,
}

/// Counts a repository call as cancelled if it is dropped before [`Running::done`].
struct Running(Option<Arc<AtomicUsize>>);

impl Running {
    fn done(mut self) {
        self.0 = None;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(cancelled) = self.0.take() {
            cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Probe {
    fn new(inner: Arc<MemoryOutboxRepository>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            claims: AtomicUsize::new(0),
            in_claim: AtomicUsize::new(0),
            max_in_claim: AtomicUsize::new(0),
            fail_claims: AtomicUsize::new(0),
            block: watch::Sender::new(false),
            block_marks: watch::Sender::new(false),
            overlap: std::sync::atomic::AtomicBool::new(false),
            log: Mutex::new(Vec::new()),
            slow_due: Mutex::new(Duration::ZERO),
            slow_backlog: Mutex::new(Duration::ZERO),
            due_asks: AtomicUsize::new(0),
            cancelled: Arc::new(AtomicUsize::new(0)),
        })
    }

    fn running(&self) -> Running {
        Running(Some(self.cancelled.clone()))
    }

    fn claims(&self) -> usize {
        self.claims.load(Ordering::SeqCst)
    }

    fn log(&self) -> ClaimLog {
        self.log.lock().unwrap().clone()
    }
}

impl OutboxRepository for Probe {
    async fn claim(&self, request: ClaimRequest) -> trellis_outbox::Result<Claim> {
        let running = self.running();
        self.claims.fetch_add(1, Ordering::SeqCst);
        let now_in = self.in_claim.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_claim.fetch_max(now_in, Ordering::SeqCst);
        let mut blocked = self.block.subscribe();
        let _ = blocked.wait_for(|b| !*b).await;
        let fail = self
            .fail_claims
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| match n {
                0 => None,
                usize::MAX => Some(usize::MAX),
                n => Some(n - 1),
            })
            .is_ok();
        let result = if fail {
            Err(trellis_outbox::Error::UnknownState(
                "database is down".into(),
            ))
        } else {
            self.inner.claim(request.clone()).await
        };
        if let Ok(claim) = &result {
            let ids = claim.messages.iter().map(|m| m.id.clone()).collect();
            self.log.lock().unwrap().push((request.cutoff, ids));
        }
        self.in_claim.fetch_sub(1, Ordering::SeqCst);
        running.done();
        result
    }

    async fn mark_dispatched(
        &self,
        claim: &Claim,
        rows: &[Dispatched],
    ) -> trellis_outbox::Result<u64> {
        let running = self.running();
        let mut blocked = self.block_marks.subscribe();
        let _ = blocked.wait_for(|b| !*b).await;
        let marked = self.inner.mark_dispatched(claim, rows).await;
        running.done();
        marked
    }

    async fn mark_failures(
        &self,
        claim: &Claim,
        failures: &[trellis_outbox::Failure],
    ) -> trellis_outbox::Result<Vec<String>> {
        self.inner.mark_failures(claim, failures).await
    }

    async fn release(&self, claim: &Claim, ids: &[&str]) -> trellis_outbox::Result<u64> {
        self.inner.release(claim, ids).await
    }

    async fn retry(&self, id: &str) -> trellis_outbox::Result<trellis_outbox::RetryOutcome> {
        self.inner.retry(id).await
    }

    async fn next_due_in(&self) -> trellis_outbox::Result<Option<Duration>> {
        let running = self.running();
        self.due_asks.fetch_add(1, Ordering::SeqCst);
        let slow = *self.slow_due.lock().unwrap();
        sleep(slow).await;
        let due = self.inner.next_due_in().await;
        running.done();
        due
    }

    async fn backlog(&self) -> trellis_outbox::Result<Option<trellis_outbox::Backlog>> {
        let slow = *self.slow_backlog.lock().unwrap();
        sleep(slow).await;
        self.inner.backlog().await
    }

    fn overlaps_batches(&self) -> bool {
        self.overlap.load(Ordering::SeqCst)
    }
}

/// Collects what `on_error` sees.
#[derive(Debug, Clone, Default)]
struct Errors(
    Arc<Mutex<Vec<String>>>,
    Arc<Mutex<Vec<(String, Disposition)>>>,
);

impl Errors {
    fn callback(&self) -> impl Fn(&DispatchError) + Send + Sync + 'static {
        let this = self.clone();
        move |error| {
            this.0.lock().unwrap().push(error.to_string());
            if let DispatchError::Publish {
                id, disposition, ..
            } = error
            {
                this.1.lock().unwrap().push((id.clone(), *disposition));
            }
        }
    }

    fn messages(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }

    fn publish(&self) -> Vec<(String, Disposition)> {
        self.1.lock().unwrap().clone()
    }
}

fn no_jitter(delay: Duration) -> RetryPolicy {
    RetryPolicy::fixed(delay)
}

// ---------------------------------------------------------------------------------------
// §G.1 case 1 (one-shot dispatch)
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn g01_dispatch_marks_successes_and_retries_failures() {
    let repo = MemoryOutboxRepository::starting_at(t0());
    repo.enqueue(&prepared("ok")).unwrap();
    let created = repo.enqueue(&prepared("fail")).unwrap();
    let publisher = RecordingPublisher::new();
    publisher.fail_always("fail", "An unexpected error has occurred");

    let options = DispatchOptions::new().retry_policy(no_jitter(Duration::from_secs(5)));
    let report = dispatch_outbox(&repo, &publisher, options).await.unwrap();

    let mut expected = DispatchReport::default();
    expected.dispatched = 1;
    expected.failed = 1;
    assert_eq!(report, expected);
    assert_eq!(state(&repo, "ok"), OutboxMessageState::Dispatched);
    let failed = repo.get("fail").unwrap();
    assert_eq!(failed.state, OutboxMessageState::Failed);
    assert_eq!(failed.attempts, 1);
    assert_eq!(failed.updated_at, t0());
    assert_eq!(failed.next_attempt_at, Some(t0() + TimeDelta::seconds(5)));
    assert_eq!(
        failed.last_error.as_deref(),
        Some("An unexpected error has occurred")
    );
    assert_eq!(failed.created_at, created.created_at);
    // The failed row was not retried within the call (one drain wave).
    assert_eq!(publisher.attempt_count("fail"), 1);
}

#[tokio::test(start_paused = true)]
async fn dispatch_outbox_rejects_bad_options() {
    let repo = MemoryOutboxRepository::new();
    let publisher = RecordingPublisher::new();
    for (options, name) in [
        (DispatchOptions::new().batch_size(0), "batch_size"),
        (DispatchOptions::new().lease(Duration::ZERO), "lease"),
    ] {
        let err = dispatch_outbox(&repo, &publisher, options)
            .await
            .unwrap_err();
        assert!(
            matches!(err, DispatchError::InvalidOption { option, .. } if option == name),
            "{err}"
        );
    }
    let builders = [
        OutboxDispatcher::builder(MemoryOutboxRepository::new(), RecordingPublisher::new())
            .batch_size(0),
        OutboxDispatcher::builder(MemoryOutboxRepository::new(), RecordingPublisher::new())
            .idle_interval(Duration::ZERO),
        OutboxDispatcher::builder(MemoryOutboxRepository::new(), RecordingPublisher::new())
            .lease(Duration::ZERO),
    ];
    for builder in builders {
        assert!(matches!(
            builder.start(),
            Err(DispatchError::InvalidOption { .. })
        ));
    }
}

// ---------------------------------------------------------------------------------------
// §G.1 cases 4–14 (the dispatcher)
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn g04_notify_coalesces() {
    let probe = Probe::new(Arc::new(MemoryOutboxRepository::new()));
    let dispatcher = OutboxDispatcher::builder(probe.clone(), RecordingPublisher::new())
        .idle_interval(LONG)
        .start()
        .unwrap();
    assert!(eventually(|| probe.claims() == 1).await, "start-up drain");
    settle().await;
    dispatcher.notify();
    dispatcher.notify();
    dispatcher.notify();
    sleep(Duration::from_secs(1)).await;
    assert_eq!(probe.claims(), 2);
    dispatcher.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn g05_follow_up_pass_without_concurrent_claims() {
    let probe = Probe::new(Arc::new(MemoryOutboxRepository::new()));
    let dispatcher = OutboxDispatcher::builder(probe.clone(), RecordingPublisher::new())
        .idle_interval(LONG)
        .start()
        .unwrap();
    assert!(eventually(|| probe.claims() == 1).await);
    settle().await;
    probe.block.send_replace(true);
    dispatcher.notify();
    assert!(eventually(|| probe.claims() == 2).await);
    // A notify while the claim is blocked: one more pass after it, never a concurrent claim.
    dispatcher.notify();
    dispatcher.notify();
    sleep(Duration::from_millis(50)).await;
    assert_eq!(probe.claims(), 2);
    probe.block.send_replace(false);
    sleep(Duration::from_secs(1)).await;
    assert_eq!(probe.claims(), 3);
    assert_eq!(probe.max_in_claim.load(Ordering::SeqCst), 1);
    dispatcher.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn g06_drains_multiple_batches_until_empty() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    let publisher = RecordingPublisher::new();
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .batch_size(1)
        .idle_interval(LONG)
        .start()
        .unwrap();
    settle().await;
    for id in ["a", "b", "c"] {
        repo.enqueue(&prepared(id)).unwrap();
    }
    dispatcher.notify();
    assert!(
        publisher
            .wait_until(WAIT, |p| p.successes().len() == 3)
            .await
    );
    dispatcher.shutdown().await;
    assert_eq!(publisher.successes(), ["a", "b", "c"]);
    assert_eq!(publisher.batches(), 3);
    for id in ["a", "b", "c"] {
        assert_eq!(state(&repo, id), OutboxMessageState::Dispatched);
    }
}

#[tokio::test(start_paused = true)]
async fn g07_keeps_draining_after_a_failed_batch() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    let publisher = RecordingPublisher::new();
    publisher.fail_always("fails_first", "boom");
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .batch_size(1)
        .retry_policy(no_jitter(Duration::from_secs(600)))
        .idle_interval(LONG)
        .start()
        .unwrap();
    settle().await;
    repo.enqueue(&prepared("fails_first")).unwrap();
    repo.enqueue(&prepared("still_due")).unwrap();
    dispatcher.notify();
    assert!(eventually(|| state(&repo, "still_due") == OutboxMessageState::Dispatched).await);
    dispatcher.shutdown().await;
    assert_eq!(state(&repo, "fails_first"), OutboxMessageState::Failed);
    assert_eq!(publisher.attempts_of("fails_first"), [0]);
}

#[tokio::test(start_paused = true)]
async fn g08_schedules_a_retry_wakeup_after_a_failed_publish() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    let publisher = RecordingPublisher::new();
    publisher.fail_times("retry", 1, "temporary");
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .retry_policy(no_jitter(Duration::from_millis(1)))
        .idle_interval(LONG)
        .start()
        .unwrap();
    settle().await;
    repo.enqueue(&prepared("retry")).unwrap();
    dispatcher.notify();
    // No further notify: the retry timer alone brings the row back.
    assert!(eventually(|| state(&repo, "retry") == OutboxMessageState::Dispatched).await);
    assert_eq!(publisher.attempts_of("retry"), [0, 1]);
    let times = publisher.attempt_times("retry");
    assert!(times[1] - times[0] < Duration::from_millis(100));
    dispatcher.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn g09_retry_wakeups_skip_the_debounce() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    let publisher = RecordingPublisher::new();
    publisher.fail_times("debounced", 1, "temporary");
    let debounce = Duration::from_secs(10);
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .debounce(debounce)
        .max_wait(Duration::from_secs(20))
        .retry_policy(no_jitter(Duration::from_millis(1)))
        .idle_interval(LONG)
        .start()
        .unwrap();
    settle().await;
    repo.enqueue(&prepared("debounced")).unwrap();
    let notified = Instant::now();
    dispatcher.notify();
    assert!(publisher.wait_for_attempts(2, WAIT).await);
    let times = publisher.attempt_times("debounced");
    // The notify waits out the debounce …
    assert!(times[0] - notified >= debounce, "{:?}", times[0] - notified);
    // … the retry wakeup does not.
    assert!(
        times[1] - times[0] < Duration::from_millis(100),
        "{:?}",
        times[1] - times[0]
    );
    assert!(eventually(|| state(&repo, "debounced") == OutboxMessageState::Dispatched).await);
    dispatcher.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn g10_no_retry_within_the_same_drain_wave() {
    let inner = Arc::new(MemoryOutboxRepository::new());
    let probe = Probe::new(inner.clone());
    let publisher = RecordingPublisher::new();
    publisher.fail_times("slow_fail", 1, "temporary");
    publisher.delay("slow_fail", Duration::from_millis(10));
    let dispatcher = OutboxDispatcher::builder(probe.clone(), publisher.clone())
        .retry_policy(no_jitter(Duration::from_millis(5)))
        .idle_interval(LONG)
        .start()
        .unwrap();
    assert!(eventually(|| probe.claims() == 1).await);
    settle().await;
    inner.enqueue(&prepared("slow_fail")).unwrap();
    dispatcher.notify();
    assert!(eventually(|| inner.get("slow_fail").unwrap().attempts == 1).await);
    settle().await;
    assert_eq!(publisher.attempt_count("slow_fail"), 1);
    assert!(eventually(|| state(&inner, "slow_fail") == OutboxMessageState::Dispatched).await);
    assert_eq!(publisher.attempts_of("slow_fail"), [0, 1]);
    dispatcher.shutdown().await;
    // The claim after the failure kept the wave's cutoff and found nothing; the retry
    // came from a new wave (fresh cutoff).
    let log = probe.log();
    let first = log
        .iter()
        .position(|(_, ids)| ids.iter().any(|id| id == "slow_fail"))
        .unwrap();
    let (cutoff, ids) = &log[first + 1];
    assert!(cutoff.is_some() && ids.is_empty(), "{log:?}");
    let retry = log
        .iter()
        .rposition(|(_, ids)| ids.iter().any(|id| id == "slow_fail"))
        .unwrap();
    assert!(retry > first + 1);
    assert_eq!(log[retry].0, None);
}

/// A row failed elsewhere (by another dispatcher, or an earlier drain) comes due while a
/// producer's notifies keep one drain going: a later pass of that drain retries it, because
/// every pass takes a fresh cutoff.
#[tokio::test(start_paused = true)]
async fn a_row_failed_elsewhere_is_retried_while_notifies_keep_a_drain_going() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    repo.enqueue(&prepared("failed_elsewhere")).unwrap();
    let claim = repo
        .claim(ClaimRequest::new(10, Duration::from_secs(30)))
        .await
        .unwrap();
    let retry =
        trellis_outbox::Failure::retry("failed_elsewhere", "temporary", Duration::from_millis(100));
    repo.mark_failures(&claim, &[retry]).await.unwrap();
    let publisher = RecordingPublisher::new();
    publisher.delay_every_batch(Duration::from_millis(10));
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .idle_interval(LONG)
        .start()
        .unwrap();
    // A producer commits a row and notifies every 5 ms: each pass of the drain (at least
    // one 10 ms publish) sees a notify, so the drain never ends.
    let started = Instant::now();
    let mut n = 0;
    while state(&repo, "failed_elsewhere") != OutboxMessageState::Dispatched
        && started.elapsed() < Duration::from_secs(3)
    {
        repo.enqueue(&prepared(&format!("busy_{n}"))).unwrap();
        n += 1;
        dispatcher.notify();
        sleep(Duration::from_millis(5)).await;
    }
    let waited = started.elapsed();
    dispatcher.shutdown().await;
    assert_eq!(
        state(&repo, "failed_elsewhere"),
        OutboxMessageState::Dispatched,
        "not retried in {waited:?} of notifies"
    );
    assert!(waited < Duration::from_secs(1), "{waited:?}");
}

#[tokio::test(start_paused = true)]
async fn g11_retry_after_a_timer_fires_during_a_long_drain() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    let publisher = RecordingPublisher::new();
    publisher.fail_times("a_retry_during_drain", 1, "temporary");
    let gate = publisher.hold("b_blocked_publish");
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .batch_size(1)
        .retry_policy(no_jitter(Duration::from_millis(1)))
        .idle_interval(LONG)
        .start()
        .unwrap();
    settle().await;
    repo.enqueue(&prepared("a_retry_during_drain")).unwrap();
    repo.enqueue(&prepared("b_blocked_publish")).unwrap();
    dispatcher.notify();
    assert!(
        publisher
            .wait_until(WAIT, |p| p.attempt_count("b_blocked_publish") == 1)
            .await
    );
    // The retry is long due, but the blocked batch is in flight: nothing runs concurrently.
    sleep(Duration::from_millis(5)).await;
    assert_eq!(publisher.attempt_count("a_retry_during_drain"), 1);
    gate.open();
    assert!(
        eventually(|| state(&repo, "a_retry_during_drain") == OutboxMessageState::Dispatched).await
    );
    assert_eq!(
        state(&repo, "b_blocked_publish"),
        OutboxMessageState::Dispatched
    );
    assert_eq!(publisher.attempts_of("a_retry_during_drain"), [0, 1]);
    assert_eq!(publisher.max_concurrent_batches(), 1);
    dispatcher.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn g12_background_errors_are_reported_and_backed_off() {
    let probe = Probe::new(Arc::new(MemoryOutboxRepository::new()));
    probe.fail_claims.store(usize::MAX, Ordering::SeqCst);
    let errors = Errors::default();
    let dispatcher = OutboxDispatcher::builder(probe.clone(), RecordingPublisher::new())
        .retry_policy(no_jitter(Duration::from_secs(1)))
        .idle_interval(LONG)
        .on_error(errors.callback())
        .start()
        .unwrap();
    assert!(eventually(|| !errors.messages().is_empty()).await);
    assert_eq!(
        errors.messages()[0],
        "outbox repository failed to claim due rows"
    );
    assert_eq!(probe.claims(), 1);
    // Backing off (at least 80 ms after the first failure): notifies do not cause a hot
    // loop of failing claims.
    for _ in 0..7 {
        dispatcher.notify();
        sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(probe.claims(), 1);
    sleep(Duration::from_secs(1)).await;
    assert!(probe.claims() >= 2);
    dispatcher.shutdown().await;
}

/// The backoff after repository errors is its own (100 ms doubling to 5 s): neither a tiny
/// retry policy for rows nor a short idle interval makes a failing database hammered.
#[tokio::test(start_paused = true)]
async fn repository_errors_back_off_whatever_the_retry_policy_and_idle_interval() {
    let probe = Probe::new(Arc::new(MemoryOutboxRepository::new()));
    probe.fail_claims.store(usize::MAX, Ordering::SeqCst);
    let errors = Errors::default();
    let dispatcher = OutboxDispatcher::builder(probe.clone(), RecordingPublisher::new())
        .retry_policy(RetryPolicy::fixed(Duration::from_millis(1)))
        .idle_interval(Duration::from_millis(10))
        .on_error(errors.callback())
        .start()
        .unwrap();
    sleep(Duration::from_secs(10)).await;
    // 100 ms, 200, 400, 800, 1.6 s, 3.2 s, then 5 s (±20 %): about 8 claims in 10 s.
    let claims = probe.claims();
    assert!((5..=12).contains(&claims), "{claims} claims in 10 s");
    dispatcher.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn g13_recovery_continues_when_on_error_panics() {
    let inner = Arc::new(MemoryOutboxRepository::new());
    inner.enqueue(&prepared("survivor")).unwrap();
    let probe = Probe::new(inner.clone());
    probe.fail_claims.store(2, Ordering::SeqCst);
    let called = Arc::new(AtomicUsize::new(0));
    let counter = called.clone();
    let dispatcher = OutboxDispatcher::builder(probe.clone(), RecordingPublisher::new())
        .retry_policy(no_jitter(Duration::from_millis(1)))
        .idle_interval(LONG)
        .on_error(move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
            panic!("on_error exploded");
        })
        .start()
        .unwrap();
    assert!(eventually(|| state(&inner, "survivor") == OutboxMessageState::Dispatched).await);
    assert!(probe.claims() >= 3);
    assert_eq!(called.load(Ordering::SeqCst), 2);
    assert!(!dispatcher.handle().is_stopped());
    dispatcher.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn g14_shutdown_cancels_pending_and_later_work() {
    let probe = Probe::new(Arc::new(MemoryOutboxRepository::new()));
    let dispatcher = OutboxDispatcher::builder(probe.clone(), RecordingPublisher::new())
        .debounce(Duration::from_millis(10))
        .idle_interval(LONG)
        .start()
        .unwrap();
    assert!(eventually(|| probe.claims() == 1).await);
    settle().await;
    let handle = dispatcher.handle();
    dispatcher.notify();
    dispatcher.shutdown().await;
    handle.notify();
    assert!(handle.is_stopped());
    sleep(Duration::from_millis(15)).await;
    assert_eq!(probe.claims(), 1);
}

// ---------------------------------------------------------------------------------------
// Weak points fixed (§H)
// ---------------------------------------------------------------------------------------

/// §H15: rows left by a previous process go out at start, without a notify.
#[tokio::test(start_paused = true)]
async fn drains_at_start() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    repo.enqueue(&prepared("left_behind")).unwrap();
    let dispatcher = OutboxDispatcher::builder(repo.clone(), RecordingPublisher::new())
        .idle_interval(LONG)
        .start()
        .unwrap();
    settle().await;
    assert_eq!(state(&repo, "left_behind"), OutboxMessageState::Dispatched);
    dispatcher.shutdown().await;
}

/// The idle interval is a safety net for rows enqueued without a notify.
#[tokio::test(start_paused = true)]
async fn idle_interval_polls() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    let publisher = RecordingPublisher::new();
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .idle_interval(Duration::from_secs(5))
        .start()
        .unwrap();
    settle().await;
    let enqueued = Instant::now();
    repo.enqueue(&prepared("unnotified")).unwrap();
    assert!(publisher.wait_for_attempts(1, WAIT).await);
    let waited = publisher.attempt_times("unnotified")[0] - enqueued;
    assert!(waited <= Duration::from_secs(5), "{waited:?}");
    assert!(waited >= Duration::from_secs(4), "{waited:?}");
    dispatcher.shutdown().await;
}

/// §H16: a stream of notifies closer together than the debounce cannot postpone the drain
/// beyond `max_wait`.
#[tokio::test(start_paused = true)]
async fn max_wait_bounds_the_debounce() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    let publisher = RecordingPublisher::new();
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .debounce(Duration::from_millis(50))
        .max_wait(Duration::from_millis(200))
        .idle_interval(LONG)
        .start()
        .unwrap();
    settle().await;
    repo.enqueue(&prepared("busy")).unwrap();
    let first = Instant::now();
    for _ in 0..100 {
        dispatcher.notify();
        sleep(Duration::from_millis(10)).await;
    }
    let times = publisher.attempt_times("busy");
    assert_eq!(times.len(), 1);
    let waited = times[0] - first;
    assert!(
        waited >= Duration::from_millis(200) && waited <= Duration::from_millis(210),
        "{waited:?}"
    );
    dispatcher.shutdown().await;
}

/// §H29: the retry timer goes to the earliest pending deadline, also when an earlier-armed
/// retry drain finds nothing else failing.
#[tokio::test(start_paused = true)]
async fn retry_timer_goes_to_the_earliest_deadline() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    let publisher = RecordingPublisher::new();
    publisher.fail_times("a", 1, "temporary");
    publisher.fail_times("b", 1, "temporary");
    let delay = Duration::from_secs(1);
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .retry_policy(no_jitter(delay))
        .idle_interval(LONG)
        .start()
        .unwrap();
    settle().await;
    let start = Instant::now();
    repo.enqueue(&prepared("a")).unwrap();
    dispatcher.notify();
    assert!(publisher.wait_for_attempts(1, WAIT).await);
    // Run B fails while A's retry timer (t = 1 s) is armed.
    sleep(Duration::from_millis(500)).await;
    repo.enqueue(&prepared("b")).unwrap();
    dispatcher.notify();
    assert!(publisher.wait_for_attempts(2, WAIT).await);
    // A's retry drain (t = 1 s) succeeds and fails nothing; B must still be retried at
    // t = 1.5 s, not at the next notify or idle poll.
    assert!(
        publisher
            .wait_until(WAIT, |p| p.successes().len() == 2)
            .await
    );
    let a = publisher.attempt_times("a");
    let b = publisher.attempt_times("b");
    assert_eq!((a.len(), b.len()), (2, 2));
    let ms = |t: Instant| (t - start).as_millis();
    assert!(
        (1000..1010).contains(&ms(a[1])),
        "a retried at {} ms",
        ms(a[1])
    );
    assert!(
        (1500..1510).contains(&ms(b[1])),
        "b retried at {} ms",
        ms(b[1])
    );
    dispatcher.shutdown().await;
}

/// §H7: an undecodable row goes dead with its reason; the rows behind it are dispatched.
#[tokio::test(start_paused = true)]
async fn poison_row_goes_dead_and_rows_behind_it_are_dispatched() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    repo.enqueue_undecodable(
        &prepared("0_poison"),
        "unknown outbox record kind \"job.cancel\"",
    )
    .unwrap();
    for i in 0..100 {
        repo.enqueue(&prepared(&format!("row_{i:03}"))).unwrap();
    }
    let publisher = RecordingPublisher::new();
    let errors = Errors::default();
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .batch_size(10)
        .idle_interval(LONG)
        .on_error(errors.callback())
        .start()
        .unwrap();
    assert!(
        publisher
            .wait_until(WAIT, |p| p.successes().len() == 100)
            .await
    );
    dispatcher.shutdown().await;
    let poison = repo.get("0_poison").unwrap();
    assert_eq!(poison.state, OutboxMessageState::Dead);
    assert_eq!(poison.attempts, 0);
    assert_eq!(
        poison.last_error.as_deref(),
        Some("unknown outbox record kind \"job.cancel\"")
    );
    assert_eq!(publisher.attempt_count("0_poison"), 0);
    assert_eq!(publisher.total_attempts(), 100);
    assert!(
        repo.snapshot()
            .iter()
            .filter(|m| m.id != "0_poison")
            .all(|m| m.state == OutboxMessageState::Dispatched)
    );
    assert!(
        errors
            .messages()
            .iter()
            .any(|e| e.contains("0_poison") && e.contains("dead"))
    );
}

#[derive(Debug)]
struct Wrapped(std::io::Error);

impl std::fmt::Display for Wrapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("publish to `events.v1.Thing.Changed` failed")
    }
}

impl std::error::Error for Wrapped {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// §H5/§H6: a permanent error goes dead at once, keeping the whole cause chain.
#[tokio::test(start_paused = true)]
async fn permanent_error_goes_dead_at_once_with_the_cause_chain() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    repo.enqueue(&prepared("huge")).unwrap();
    repo.enqueue(&prepared("fine")).unwrap();
    let publisher = RecordingPublisher::new();
    publisher.script(
        "huge",
        [Outcome::Fail(PublishError::permanent(Wrapped(
            std::io::Error::other("maximum payload exceeded"),
        )))],
    );
    let errors = Errors::default();
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .retry_policy(no_jitter(Duration::from_millis(1)))
        .idle_interval(Duration::from_secs(1))
        .on_error(errors.callback())
        .start()
        .unwrap();
    settle().await;
    sleep(Duration::from_secs(10)).await;
    dispatcher.shutdown().await;
    let huge = repo.get("huge").unwrap();
    assert_eq!(huge.state, OutboxMessageState::Dead);
    assert_eq!(huge.attempts, 1);
    assert_eq!(
        huge.last_error.as_deref(),
        Some("publish to `events.v1.Thing.Changed` failed: maximum payload exceeded")
    );
    assert_eq!(state(&repo, "fine"), OutboxMessageState::Dispatched);
    assert_eq!(publisher.attempt_count("huge"), 1);
    assert_eq!(errors.publish(), [("huge".to_owned(), Disposition::Dead)]);
}

/// §H5: retries back off and stop after `max_attempts`; the row is dead.
#[tokio::test(start_paused = true)]
async fn max_attempts_moves_the_row_to_dead() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    repo.enqueue(&prepared("hopeless")).unwrap();
    let publisher = RecordingPublisher::new();
    publisher.fail_always("hopeless", "no responders");
    let errors = Errors::default();
    let policy = RetryPolicy::new()
        .initial_delay(Duration::from_secs(1))
        .jitter(0.0)
        .max_attempts(4);
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .retry_policy(policy)
        .idle_interval(Duration::from_secs(1))
        .on_error(errors.callback())
        .start()
        .unwrap();
    let start = Instant::now();
    assert!(eventually(|| state(&repo, "hopeless") == OutboxMessageState::Dead).await);
    sleep(Duration::from_secs(30)).await;
    dispatcher.shutdown().await;
    let row = repo.get("hopeless").unwrap();
    assert_eq!(row.attempts, 4);
    assert_eq!(row.last_error.as_deref(), Some("no responders"));
    assert_eq!(publisher.attempts_of("hopeless"), [0, 1, 2, 3]);
    // Exponential schedule: 1 s, 2 s, 4 s after each failure.
    let at: Vec<u128> = publisher
        .attempt_times("hopeless")
        .iter()
        .map(|t| (*t - start).as_millis())
        .collect();
    assert!(at[0] < 10 && (1000..1010).contains(&at[1]), "{at:?}");
    assert!(
        (3000..3010).contains(&at[2]) && (7000..7010).contains(&at[3]),
        "{at:?}"
    );
    assert_eq!(
        errors.publish(),
        [
            (
                "hopeless".to_owned(),
                Disposition::RetryAfter(Duration::from_secs(1))
            ),
            (
                "hopeless".to_owned(),
                Disposition::RetryAfter(Duration::from_secs(2))
            ),
            (
                "hopeless".to_owned(),
                Disposition::RetryAfter(Duration::from_secs(4))
            ),
            ("hopeless".to_owned(), Disposition::Dead),
        ]
    );
}

/// A panicking publisher fails its batch retryably; the dispatcher carries on.
#[tokio::test(start_paused = true)]
async fn publisher_panic_fails_the_batch_retryably() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    repo.enqueue(&prepared("p")).unwrap();
    let publisher = RecordingPublisher::new();
    publisher.panic_on("p");
    let errors = Errors::default();
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .retry_policy(no_jitter(Duration::from_millis(1)))
        .idle_interval(LONG)
        .on_error(errors.callback())
        .start()
        .unwrap();
    assert!(eventually(|| state(&repo, "p") == OutboxMessageState::Dispatched).await);
    dispatcher.shutdown().await;
    assert_eq!(publisher.attempts_of("p"), [0, 1]);
    assert!(
        errors.messages()[0].contains("publisher panicked"),
        "{:?}",
        errors.messages()
    );
}

/// A publisher returning too few results: the unanswered messages are retried.
#[tokio::test(start_paused = true)]
async fn missing_publish_results_are_retryable_failures() {
    let repo = MemoryOutboxRepository::new();
    repo.enqueue(&prepared("a")).unwrap();
    repo.enqueue(&prepared("b")).unwrap();
    let publisher = RecordingPublisher::new();
    publisher.drop_results(1);
    let options = DispatchOptions::new().retry_policy(no_jitter(Duration::from_secs(1)));
    let report = dispatch_outbox(&repo, &publisher, options).await.unwrap();
    assert_eq!((report.dispatched, report.failed), (1, 1));
    let b = repo.get("b").unwrap();
    assert_eq!(b.state, OutboxMessageState::Failed);
    assert_eq!(
        b.last_error.as_deref(),
        Some("the publisher returned no result for this message")
    );
}

/// Outcomes returned by the publisher are stored.
#[tokio::test(start_paused = true)]
async fn outcomes_are_stored() {
    let repo = MemoryOutboxRepository::new();
    repo.enqueue(&prepared("job")).unwrap();
    let publisher = RecordingPublisher::new();
    publisher.outcome("job", serde_json::json!({ "admitted": true }));
    dispatch_outbox(&repo, &publisher, DispatchOptions::new())
        .await
        .unwrap();
    assert_eq!(
        repo.get("job").unwrap().outcome,
        Some(serde_json::json!({ "admitted": true }))
    );
}

// ---------------------------------------------------------------------------------------
// Shutdown and drop
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn shutdown_finishes_the_in_flight_batch() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    let publisher = RecordingPublisher::new();
    let gate = publisher.hold("in_flight");
    repo.enqueue(&prepared("in_flight")).unwrap();
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .idle_interval(LONG)
        .start()
        .unwrap();
    assert!(publisher.wait_for_attempts(1, WAIT).await);
    let done = Arc::new(AtomicBool::new(false));
    let flag = done.clone();
    let stopping = tokio::spawn(async move {
        dispatcher.shutdown().await;
        flag.store(true, Ordering::SeqCst);
    });
    sleep(Duration::from_secs(1)).await;
    assert!(!done.load(Ordering::SeqCst), "shutdown returned mid-batch");
    repo.enqueue(&prepared("later")).unwrap();
    gate.open();
    stopping.await.unwrap();
    assert_eq!(state(&repo, "in_flight"), OutboxMessageState::Dispatched);
    // Stopped claiming: the row enqueued during shutdown stays for the next process.
    assert_eq!(state(&repo, "later"), OutboxMessageState::Pending);
    assert_eq!(publisher.attempt_count("later"), 0);
}

#[tokio::test(start_paused = true)]
async fn shutdown_releases_claimed_rows_not_attempted() {
    let inner = Arc::new(MemoryOutboxRepository::new());
    inner.enqueue(&prepared("claimed")).unwrap();
    let probe = Probe::new(inner.clone());
    probe.block.send_replace(true);
    let publisher = RecordingPublisher::new();
    let dispatcher = OutboxDispatcher::builder(probe.clone(), publisher.clone())
        .idle_interval(LONG)
        .start()
        .unwrap();
    assert!(eventually(|| probe.claims() == 1).await);
    let stopping = tokio::spawn(dispatcher.shutdown());
    settle().await;
    probe.block.send_replace(false);
    stopping.await.unwrap();
    assert_eq!(publisher.total_attempts(), 0);
    assert_eq!(state(&inner, "claimed"), OutboxMessageState::Pending);
    assert!(!inner.is_leased("claimed"), "the lease was not released");
}

#[tokio::test(start_paused = true)]
async fn shutdown_timeout_aborts_a_stuck_publish() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    let publisher = RecordingPublisher::new();
    let _gate = publisher.hold("stuck");
    repo.enqueue(&prepared("stuck")).unwrap();
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .idle_interval(LONG)
        .start()
        .unwrap();
    assert!(publisher.wait_for_attempts(1, WAIT).await);
    assert!(!dispatcher.shutdown_timeout(Duration::from_secs(1)).await);
    // The row keeps its lease until it expires, then is claimable again.
    assert!(repo.is_leased("stuck"));
}

#[tokio::test(start_paused = true)]
async fn dropping_the_dispatcher_stops_its_task() {
    let probe = Probe::new(Arc::new(MemoryOutboxRepository::new()));
    let dispatcher = OutboxDispatcher::builder(probe.clone(), RecordingPublisher::new())
        .idle_interval(Duration::from_secs(1))
        .start()
        .unwrap();
    assert!(eventually(|| probe.claims() == 1).await);
    let handle = dispatcher.handle();
    drop(dispatcher);
    assert!(handle.is_stopped());
    handle.notify();
    sleep(Duration::from_secs(10)).await;
    assert_eq!(probe.claims(), 1);
}

/// Real time, multi-threaded runtime: every row is published exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_time_multi_thread_publishes_each_row_once() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    let publisher = RecordingPublisher::new();
    publisher.fail_times("row_007", 2, "flaky");
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .batch_size(16)
        .debounce(Duration::from_millis(2))
        .retry_policy(no_jitter(Duration::from_millis(5)))
        .start()
        .unwrap();
    for i in 0..200 {
        repo.enqueue(&prepared(&format!("row_{i:03}"))).unwrap();
        if i % 10 == 0 {
            dispatcher.notify();
        }
    }
    dispatcher.notify();
    assert!(
        publisher
            .wait_until(Duration::from_secs(20), |p| p.successes().len() == 200)
            .await
    );
    dispatcher.shutdown().await;
    let mut successes = publisher.successes();
    successes.sort();
    successes.dedup();
    assert_eq!(successes.len(), 200);
    assert_eq!(publisher.total_attempts(), 202);
    assert!(
        repo.snapshot()
            .iter()
            .all(|m| m.state == OutboxMessageState::Dispatched)
    );
}

// ---------------------------------------------------------------------------------------
// Overlapping batches (the memory repository overlaps, as Postgres does)
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn overlapping_claims_the_next_batch_while_one_is_published() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    assert!(repo.overlaps_batches());
    for id in ["a", "b", "c", "d", "e", "f"] {
        repo.enqueue(&prepared(id)).unwrap();
    }
    let publisher = RecordingPublisher::new();
    let gate = publisher.hold("a");
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .batch_size(2)
        .idle_interval(LONG)
        .start()
        .unwrap();
    assert!(publisher.wait_for_attempts(2, WAIT).await);
    // While [a, b] is held in publishing, [c, d] is claimed, and nothing beyond it.
    assert!(eventually(|| repo.is_leased("c") && repo.is_leased("d")).await);
    settle().await;
    assert!(!repo.is_leased("e"), "claimed two batches ahead");
    assert_eq!(publisher.attempt_count("c"), 0);
    assert_eq!(publisher.max_concurrent_batches(), 1);
    gate.open();
    assert!(
        eventually(|| ["a", "b", "c", "d", "e", "f"]
            .iter()
            .all(|id| state(&repo, id) == OutboxMessageState::Dispatched))
        .await
    );
    dispatcher.shutdown().await;
    assert_eq!(publisher.total_attempts(), 6, "a row was published twice");
    assert_eq!(publisher.successes(), ["a", "b", "c", "d", "e", "f"]);
}

#[tokio::test(start_paused = true)]
async fn a_slow_mark_holds_up_neither_the_next_claim_nor_the_next_publish() {
    let inner = Arc::new(MemoryOutboxRepository::new());
    for id in ["a", "b", "c", "d", "e", "f"] {
        inner.enqueue(&prepared(id)).unwrap();
    }
    let probe = Probe::new(inner.clone());
    probe.overlap.store(true, Ordering::SeqCst);
    probe.block_marks.send_replace(true);
    let publisher = RecordingPublisher::new();
    let dispatcher = OutboxDispatcher::builder(probe.clone(), publisher.clone())
        .batch_size(2)
        .idle_interval(LONG)
        .start()
        .unwrap();
    // No mark has finished, yet all three batches were claimed and published.
    assert!(publisher.wait_for_attempts(6, WAIT).await);
    settle().await;
    assert!(
        ["a", "b", "c", "d", "e", "f"]
            .iter()
            .all(|id| state(&inner, id) == OutboxMessageState::Pending)
    );
    probe.block_marks.send_replace(false);
    assert!(
        eventually(|| ["a", "b", "c", "d", "e", "f"]
            .iter()
            .all(|id| state(&inner, id) == OutboxMessageState::Dispatched))
        .await
    );
    dispatcher.shutdown().await;
    assert_eq!(publisher.total_attempts(), 6, "a row was published twice");
    assert_eq!(publisher.successes(), ["a", "b", "c", "d", "e", "f"]);
}

#[tokio::test(start_paused = true)]
async fn a_notify_while_the_last_mark_runs_claims_at_once() {
    let inner = Arc::new(MemoryOutboxRepository::new());
    inner.enqueue(&prepared("a")).unwrap();
    let probe = Probe::new(inner.clone());
    probe.overlap.store(true, Ordering::SeqCst);
    probe.block_marks.send_replace(true);
    let publisher = RecordingPublisher::new();
    let dispatcher = OutboxDispatcher::builder(probe.clone(), publisher.clone())
        .idle_interval(LONG)
        .start()
        .unwrap();
    assert!(publisher.wait_for_attempts(1, WAIT).await);
    settle().await;
    // The mark of [a] is stuck; a row committed now goes out without waiting for it.
    inner.enqueue(&prepared("b")).unwrap();
    dispatcher.notify();
    assert!(publisher.wait_for_attempts(2, WAIT).await);
    assert_eq!(state(&inner, "a"), OutboxMessageState::Pending);
    probe.block_marks.send_replace(false);
    assert!(
        eventually(|| ["a", "b"]
            .iter()
            .all(|id| state(&inner, id) == OutboxMessageState::Dispatched))
        .await
    );
    dispatcher.shutdown().await;
    assert_eq!(publisher.successes(), ["a", "b"]);
}

/// A notify never drops a repository call in flight (on a database that would cost the
/// call's connection, and the next call a new session), and one that arrives while the
/// post-drain `next_due_in` runs still starts the next drain at once, without waiting for it.
/// Counting the backlog for the gauges (every 15 s by default) runs beside the drains: a slow
/// count (a large backlog) does not hold up the drain a notify asks for.
#[tokio::test(start_paused = true)]
async fn a_slow_backlog_count_does_not_hold_up_drains() {
    let inner = Arc::new(MemoryOutboxRepository::new());
    let probe = Probe::new(inner.clone());
    *probe.slow_backlog.lock().unwrap() = Duration::from_secs(10);
    let publisher = RecordingPublisher::new();
    let dispatcher = OutboxDispatcher::builder(probe.clone(), publisher.clone())
        .idle_interval(LONG)
        .start()
        .unwrap();
    // The start-up drain is over and the first count is running.
    sleep(Duration::from_millis(50)).await;
    inner.enqueue(&prepared("a")).unwrap();
    let notified = Instant::now();
    dispatcher.notify();
    assert!(publisher.wait_for_attempts(1, WAIT).await);
    assert!(
        notified.elapsed() < Duration::from_secs(1),
        "the drain waited {:?} for the backlog count",
        notified.elapsed()
    );
    dispatcher.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_notify_does_not_cancel_a_running_repository_call() {
    let inner = Arc::new(MemoryOutboxRepository::new());
    let probe = Probe::new(inner.clone());
    probe.overlap.store(true, Ordering::SeqCst);
    *probe.slow_due.lock().unwrap() = Duration::from_millis(100);
    let publisher = RecordingPublisher::new();
    let dispatcher = OutboxDispatcher::builder(probe.clone(), publisher.clone())
        .idle_interval(LONG)
        .start()
        .unwrap();
    for (n, id) in ["a", "b", "c", "d"].into_iter().enumerate() {
        inner.enqueue(&prepared(id)).unwrap();
        let notified = Instant::now();
        dispatcher.notify();
        assert!(publisher.wait_for_attempts(n + 1, WAIT).await);
        if n > 0 {
            assert!(
                notified.elapsed() < Duration::from_millis(40),
                "{id} waited {:?} for the running next_due_in",
                notified.elapsed()
            );
        }
        // The drain is over and its `next_due_in` is running: notify in the middle of it.
        sleep(Duration::from_millis(50)).await;
    }
    assert!(
        eventually(|| ["a", "b", "c", "d"]
            .iter()
            .all(|id| state(&inner, id) == OutboxMessageState::Dispatched))
        .await
    );
    dispatcher.shutdown().await;
    assert_eq!(
        probe.cancelled.load(Ordering::SeqCst),
        0,
        "repository calls dropped before they finished"
    );
}

/// While notifies keep it draining, the dispatcher asks `next_due_in` about every 100 ms,
/// not after every drain; a row that fails meanwhile is still retried when it is due.
#[tokio::test(start_paused = true)]
async fn a_busy_dispatcher_asks_for_the_next_due_time_now_and_then() {
    let inner = Arc::new(MemoryOutboxRepository::new());
    let probe = Probe::new(inner.clone());
    probe.overlap.store(true, Ordering::SeqCst);
    let publisher = RecordingPublisher::new();
    publisher.fail_times("r100", 1, "broker busy");
    let dispatcher = OutboxDispatcher::builder(probe.clone(), publisher.clone())
        .idle_interval(LONG)
        .retry_policy(no_jitter(Duration::from_millis(250)))
        .start()
        .unwrap();
    let started = Instant::now();
    // One row every 2 ms for a second.
    for n in 0..500 {
        inner.enqueue(&prepared(&format!("r{n}"))).unwrap();
        dispatcher.notify();
        sleep(Duration::from_millis(2)).await;
    }
    assert!(
        eventually(
            || (0..500).all(|n| state(&inner, &format!("r{n}")) == OutboxMessageState::Dispatched)
        )
        .await
    );
    let asks = probe.due_asks.load(Ordering::SeqCst);
    assert!(
        (5..=25).contains(&asks),
        "next_due_in asked {asks} times in about a second"
    );
    // r100 failed about 200 ms in; it went out again 250 ms later, not at the next poll.
    let times = publisher.attempt_times("r100");
    assert_eq!(times.len(), 2);
    let waited = times[1] - times[0];
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_millis(300),
        "retried after {waited:?}"
    );
    assert!(times[0] - started < Duration::from_millis(250));
    dispatcher.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn shutdown_releases_the_batch_claimed_ahead() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    for id in ["a", "b", "c", "d"] {
        repo.enqueue(&prepared(id)).unwrap();
    }
    let publisher = RecordingPublisher::new();
    let gate = publisher.hold("a");
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .batch_size(2)
        .idle_interval(LONG)
        .start()
        .unwrap();
    assert!(eventually(|| repo.is_leased("c")).await);
    let stopping = tokio::spawn(dispatcher.shutdown());
    settle().await;
    gate.open();
    stopping.await.unwrap();
    // The published batch is marked; the one claimed ahead was never attempted and is free.
    assert_eq!(state(&repo, "a"), OutboxMessageState::Dispatched);
    assert_eq!(state(&repo, "b"), OutboxMessageState::Dispatched);
    for id in ["c", "d"] {
        assert_eq!(state(&repo, id), OutboxMessageState::Pending);
        assert!(!repo.is_leased(id), "{id} is still leased");
        assert_eq!(publisher.attempt_count(id), 0);
    }
}

// ---------------------------------------------------------------------------------------
// Publisher start-up hook
// ---------------------------------------------------------------------------------------

/// A publisher that records when `on_start` ran, relative to publishes.
#[derive(Debug, Default)]
struct StartProbe {
    events: Mutex<Vec<String>>,
}

impl trellis_outbox::Publisher for StartProbe {
    async fn publish_batch(
        &self,
        messages: &[trellis_outbox::OutboxMessage],
    ) -> Vec<Result<Option<serde_json::Value>, PublishError>> {
        let mut events = self.events.lock().unwrap();
        messages
            .iter()
            .map(|m| {
                events.push(format!("publish {}", m.id));
                Ok(None)
            })
            .collect()
    }

    async fn on_start(&self, retry_policy: &RetryPolicy) {
        self.events
            .lock()
            .unwrap()
            .push(format!("start {:?}", retry_policy.longest_delay()));
    }
}

#[tokio::test(start_paused = true)]
async fn publisher_on_start_runs_once_before_the_first_drain() {
    let repo = Arc::new(MemoryOutboxRepository::new());
    repo.enqueue(&prepared("left_over")).unwrap();
    let publisher = Arc::new(StartProbe::default());
    let policy = no_jitter(Duration::from_secs(7)).max_attempts(3);
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .retry_policy(policy)
        .idle_interval(LONG)
        .start()
        .unwrap();
    assert!(eventually(|| state(&repo, "left_over") == OutboxMessageState::Dispatched).await);
    repo.enqueue(&prepared("later")).unwrap();
    dispatcher.notify();
    assert!(eventually(|| state(&repo, "later") == OutboxMessageState::Dispatched).await);
    dispatcher.shutdown().await;
    assert_eq!(
        *publisher.events.lock().unwrap(),
        [
            format!("start {:?}", policy.longest_delay()),
            "publish left_over".to_owned(),
            "publish later".to_owned(),
        ]
    );
}
