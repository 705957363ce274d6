//! The dispatcher keeps its leases while it publishes, marks what it can when a mark fails,
//! and reports every failure once, aggregated per batch (issue #10, defects 2, 3 and 10).
//! Memory repository, paused tokio time.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::{Instant, sleep};
use trellis_outbox::{
    Claim, ClaimRequest, DispatchError, DispatchOptions, Dispatched, Error, Failure,
    MemoryOutboxRepository, OutboxDispatcher, OutboxMessageState, OutboxRepository,
    PreparedOutboxRecord, RetryPolicy, dispatch_outbox,
};
use trellis_outbox_tests::publisher::RecordingPublisher;

const LONG: Duration = Duration::from_secs(3600);
const WAIT: Duration = Duration::from_secs(60);

fn record(id: &str) -> PreparedOutboxRecord {
    let mut record =
        PreparedOutboxRecord::event("Thing.Changed", "events.v1.Thing.Changed", &1).unwrap();
    record.id = id.to_owned();
    record.headers.insert("Nats-Msg-Id".into(), id.into());
    record
}

fn repo_with(ids: &[&str]) -> Arc<MemoryOutboxRepository> {
    let repo = Arc::new(MemoryOutboxRepository::new());
    for id in ids {
        repo.enqueue(&record(id)).unwrap();
    }
    repo
}

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

fn all_dispatched(repo: &MemoryOutboxRepository, ids: &[&str]) -> bool {
    ids.iter()
        .all(|id| repo.get(id).unwrap().state == OutboxMessageState::Dispatched)
}

/// Every `on_error` report, as text and by variant.
#[derive(Debug, Default, Clone)]
struct Reports(Arc<Mutex<Vec<String>>>);

impl Reports {
    fn callback(&self) -> impl Fn(&DispatchError) + Send + Sync + 'static {
        let reports = self.0.clone();
        move |error| {
            let kind = match error {
                DispatchError::Repository { operation, .. } => format!("repository: {operation}"),
                DispatchError::Publish { id, .. } => format!("publish: {id}"),
                DispatchError::PublishBatch { rows, ids, .. } => {
                    format!("publish batch: {rows} rows, {} ids", ids.len())
                }
                DispatchError::LeaseLost { rows } => format!("lease lost: {rows}"),
                other => format!("other: {other}"),
            };
            reports.lock().unwrap().push(kind);
        }
    }

    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// A memory repository whose marks, claims and lease extensions fail on demand, and which
/// counts its mark calls.
#[derive(Debug)]
struct Faulty {
    inner: Arc<MemoryOutboxRepository>,
    /// `mark_dispatched` of more than one row fails (not retryably).
    fail_batch_dispatched: AtomicBool,
    /// Every `mark_dispatched` fails (retryably: a lost connection).
    fail_all_dispatched: AtomicBool,
    /// `mark_failures` of more than one row fails (not retryably).
    fail_batch_failures: AtomicBool,
    /// The claim with this number (1 for the first) fails.
    fail_claim: AtomicUsize,
    claims: AtomicUsize,
    /// Lease extensions are not supported (the trait's default).
    no_extend: AtomicBool,
    /// Calls of `mark_failures` (which `mark_failure` makes too).
    failure_marks: AtomicUsize,
    /// `mark_failures` also answers ids it was not asked about.
    answer_unasked: AtomicBool,
    /// `extend_lease` never returns (a pool with no free connection, a lock wait).
    hang_extend: AtomicBool,
    /// Calls of `purge_dispatched`, which never returns (a huge backlog being deleted).
    purges: AtomicUsize,
    /// Purges that ended (the never-ending ones can only be dropped).
    purges_ended: AtomicUsize,
    /// `next_due_in` and `backlog` never return (a slow server).
    hang_reads: AtomicBool,
    /// How long `mark_dispatched` takes, in milliseconds (a slow commit).
    slow_marks: AtomicU64,
    /// How many more one-row `mark_dispatched` calls fail with a transient error.
    fail_single_dispatched: AtomicUsize,
    /// Rows whose one-row `mark_dispatched` fails, not retryably (a value the statement
    /// refuses).
    refuse_single: Mutex<Vec<String>>,
    /// How long `release` takes to answer after releasing, in milliseconds (a late reply).
    slow_releases: AtomicU64,
}

impl Faulty {
    fn new(inner: Arc<MemoryOutboxRepository>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            fail_batch_dispatched: AtomicBool::new(false),
            fail_all_dispatched: AtomicBool::new(false),
            fail_batch_failures: AtomicBool::new(false),
            fail_claim: AtomicUsize::new(0),
            claims: AtomicUsize::new(0),
            no_extend: AtomicBool::new(false),
            failure_marks: AtomicUsize::new(0),
            answer_unasked: AtomicBool::new(false),
            hang_extend: AtomicBool::new(false),
            purges: AtomicUsize::new(0),
            purges_ended: AtomicUsize::new(0),
            hang_reads: AtomicBool::new(false),
            slow_marks: AtomicU64::new(0),
            fail_single_dispatched: AtomicUsize::new(0),
            refuse_single: Mutex::new(Vec::new()),
            slow_releases: AtomicU64::new(0),
        })
    }
}

/// Counts itself in its counter when dropped.
struct Counted<'a>(&'a AtomicUsize);

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn io_error() -> Error {
    Error::Repository {
        operation: "test",
        source: sqlx::Error::Io(std::io::Error::other("connection reset")),
    }
}

impl OutboxRepository for Faulty {
    async fn claim(&self, request: ClaimRequest) -> trellis_outbox::Result<Claim> {
        let n = self.claims.fetch_add(1, Ordering::SeqCst) + 1;
        if self.fail_claim.load(Ordering::SeqCst) == n {
            return Err(io_error());
        }
        self.inner.claim(request).await
    }

    async fn mark_dispatched(
        &self,
        claim: &Claim,
        rows: &[Dispatched],
    ) -> trellis_outbox::Result<u64> {
        let slow = self.slow_marks.load(Ordering::SeqCst);
        if slow > 0 {
            sleep(Duration::from_millis(slow)).await;
        }
        if self.fail_all_dispatched.load(Ordering::SeqCst) {
            return Err(io_error());
        }
        if rows.len() > 1 && self.fail_batch_dispatched.load(Ordering::SeqCst) {
            return Err(Error::UnknownKind(
                "a value the batch statement refuses".into(),
            ));
        }
        if rows.len() == 1 && self.refuse_single.lock().unwrap().contains(&rows[0].id) {
            return Err(Error::UnknownKind("a value the statement refuses".into()));
        }
        if rows.len() == 1
            && self
                .fail_single_dispatched
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            return Err(io_error());
        }
        self.inner.mark_dispatched(claim, rows).await
    }

    async fn mark_failures(
        &self,
        claim: &Claim,
        failures: &[Failure],
    ) -> trellis_outbox::Result<Vec<String>> {
        self.failure_marks.fetch_add(1, Ordering::SeqCst);
        if failures.len() > 1 && self.fail_batch_failures.load(Ordering::SeqCst) {
            return Err(Error::UnknownKind(
                "a value the batch statement refuses".into(),
            ));
        }
        let mut marked = self.inner.mark_failures(claim, failures).await?;
        if self.answer_unasked.load(Ordering::SeqCst) {
            marked.extend(["never-asked-1".to_owned(), "never-asked-2".to_owned()]);
        }
        Ok(marked)
    }

    async fn extend_lease(
        &self,
        claim: &Claim,
        ids: &[&str],
        lease: Duration,
    ) -> trellis_outbox::Result<u64> {
        if self.no_extend.load(Ordering::SeqCst) {
            return Ok(0);
        }
        if self.hang_extend.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.extend_lease(claim, ids, lease).await
    }

    async fn release(&self, claim: &Claim, ids: &[&str]) -> trellis_outbox::Result<u64> {
        let released = self.inner.release(claim, ids).await?;
        let slow = self.slow_releases.load(Ordering::SeqCst);
        if slow > 0 {
            sleep(Duration::from_millis(slow)).await;
        }
        Ok(released)
    }

    async fn purge_dispatched(
        &self,
        _older_than: Duration,
        _batch: usize,
    ) -> trellis_outbox::Result<u64> {
        self.purges.fetch_add(1, Ordering::SeqCst);
        let _running = Counted(&self.purges_ended);
        std::future::pending().await
    }

    async fn retry(&self, id: &str) -> trellis_outbox::Result<trellis_outbox::RetryOutcome> {
        self.inner.retry(id).await
    }

    async fn next_due_in(&self) -> trellis_outbox::Result<Option<Duration>> {
        if self.hang_reads.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.next_due_in().await
    }

    async fn backlog(&self) -> trellis_outbox::Result<Option<trellis_outbox::Backlog>> {
        if self.hang_reads.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.backlog().await
    }

    fn extends_leases(&self) -> bool {
        !self.no_extend.load(Ordering::SeqCst)
    }

    fn overlaps_batches(&self) -> bool {
        true
    }
}

/// Starts a dispatcher that polls every 100 ms with a one-second lease.
fn polling_dispatcher<R: OutboxRepository>(
    repo: R,
    publisher: &RecordingPublisher,
    batch: usize,
    reports: &Reports,
) -> OutboxDispatcher {
    OutboxDispatcher::builder(repo, publisher.clone())
        .batch_size(batch)
        .lease(Duration::from_secs(1))
        .idle_interval(Duration::from_millis(100))
        .on_error(reports.callback())
        .start()
        .unwrap()
}

// ---------------------------------------------------------------------------------------
// Defect 2: leases run out mid-publish
// ---------------------------------------------------------------------------------------

/// Batch [c, d] is claimed while [a, b] is published (700 ms of a 1 s lease); it starts
/// publishing with 300 ms of lease left and takes 700 ms. Another dispatcher polling every
/// 100 ms must not get c or d meanwhile.
#[tokio::test(start_paused = true)]
async fn a_batch_claimed_ahead_keeps_its_lease_while_it_waits_and_publishes() {
    let ids = ["a", "b", "c", "d"];
    let repo = repo_with(&ids);
    let publisher = RecordingPublisher::new();
    publisher.delay_every_batch(Duration::from_millis(700));
    two_dispatchers_publish_each_row_once(repo.clone(), &repo, &publisher, &ids, 2, "c").await;
}

/// One publish takes 2.5 leases: the lease is extended while it runs.
#[tokio::test(start_paused = true)]
async fn a_publish_longer_than_the_lease_keeps_its_lease() {
    let ids = ["a", "b"];
    let repo = repo_with(&ids);
    let publisher = RecordingPublisher::new();
    publisher.delay_every_batch(Duration::from_millis(2500));
    two_dispatchers_publish_each_row_once(repo.clone(), &repo, &publisher, &ids, 2, "a").await;
}

/// A batch holding a row that cannot be decoded (it goes dead after the publish) and a
/// publish of 2.5 leases: the undecodable row's lease is kept with the others, so the second
/// dispatcher does not claim it meanwhile and it goes dead once.
#[tokio::test(start_paused = true)]
async fn an_undecodable_row_keeps_its_lease_while_its_batch_publishes() {
    let ids = ["a", "b"];
    let repo = repo_with(&ids);
    repo.enqueue_undecodable(&record("p"), "bad headers")
        .unwrap();
    let publisher = RecordingPublisher::new();
    publisher.delay_every_batch(Duration::from_millis(2500));
    let reports = Reports::default();
    let first = polling_dispatcher(repo.clone(), &publisher, 3, &reports);
    assert!(eventually(|| repo.is_leased("p")).await);
    let second = polling_dispatcher(repo.clone(), &publisher, 3, &reports);
    assert!(eventually(|| all_dispatched(&repo, &ids)).await);
    sleep(Duration::from_secs(3)).await;
    first.shutdown().await;
    second.shutdown().await;
    for id in ids {
        assert_eq!(publisher.attempt_count(id), 1, "{id} was published twice");
    }
    let poisoned = repo.get("p").unwrap();
    assert_eq!(poisoned.state, OutboxMessageState::Dead);
    // Once, by the dispatcher that claimed it: not also by the second one, nor a lost lease.
    assert_eq!(
        reports.all(),
        ["other: outbox message \"p\" could not be decoded and was moved to dead: bad headers"]
    );
}

/// Starts a polling dispatcher on `repo` (over `memory`), in batches of `batch`; once it
/// leases `leased`, a second one polling for rows whose lease ran out. After every row of
/// `ids` is dispatched (and time for late publishes), each was published once and nothing
/// was reported.
async fn two_dispatchers_publish_each_row_once<R: OutboxRepository + Clone>(
    repo: R,
    memory: &MemoryOutboxRepository,
    publisher: &RecordingPublisher,
    ids: &[&str],
    batch: usize,
    leased: &str,
) {
    let reports = Reports::default();
    let first = polling_dispatcher(repo.clone(), publisher, batch, &reports);
    assert!(eventually(|| memory.is_leased(leased)).await);
    let second = polling_dispatcher(repo, publisher, batch, &reports);
    assert!(eventually(|| all_dispatched(memory, ids)).await);
    sleep(Duration::from_secs(3)).await;
    first.shutdown().await;
    second.shutdown().await;
    for id in ids {
        assert_eq!(publisher.attempt_count(id), 1, "{id} was published twice");
    }
    assert!(reports.all().is_empty(), "{:?}", reports.all());
}

/// Marks of `ids` that take `mark_ms` each (a slow commit), with a one-second lease, batches
/// of `batch`, and a second dispatcher polling for rows whose lease ran out: no row may be
/// published twice.
async fn slow_marks_publish_each_row_once(ids: &[&str], batch: usize, mark_ms: u64) {
    let memory = repo_with(ids);
    let repo = Faulty::new(memory.clone());
    repo.slow_marks.store(mark_ms, Ordering::SeqCst);
    let publisher = RecordingPublisher::new();
    two_dispatchers_publish_each_row_once(repo, &memory, &publisher, ids, batch, ids[0]).await;
}

/// A mark that takes 2.5 leases keeps the lease of its published rows to its end.
#[tokio::test(start_paused = true)]
async fn a_mark_longer_than_the_lease_keeps_its_lease() {
    slow_marks_publish_each_row_once(&["a", "b"], 2, 2500).await;
}

/// Batches of one row, marks of 1.5 leases: while two marks are in flight the third
/// published batch waits for a mark slot, with its lease kept.
#[tokio::test(start_paused = true)]
async fn a_published_batch_waiting_for_a_mark_slot_keeps_its_lease() {
    slow_marks_publish_each_row_once(&["a", "b", "c", "d", "e"], 1, 1500).await;
}

/// Purging old dispatched rows takes as long as it takes (here: forever): it runs beside
/// the drains, which go on dispatching, and shutdown does not wait for it. A second purge
/// does not start while the first runs.
#[tokio::test(start_paused = true)]
async fn a_purge_that_never_ends_holds_up_neither_drains_nor_shutdown() {
    let memory = repo_with(&["a"]);
    let repo = Faulty::new(memory.clone());
    let publisher = RecordingPublisher::new();
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .idle_interval(Duration::from_millis(100))
        .retain_dispatched(Duration::from_secs(10))
        .start()
        .unwrap();
    assert!(eventually(|| all_dispatched(&memory, &["a"])).await);
    assert!(eventually(|| repo.purges.load(Ordering::SeqCst) == 1).await);
    // Rows committed while the purge runs are dispatched, past several purge intervals.
    for id in ["b", "c"] {
        memory.enqueue(&record(id)).unwrap();
        dispatcher.notify();
        assert!(eventually(|| all_dispatched(&memory, &[id])).await, "{id}");
        sleep(Duration::from_secs(2)).await;
    }
    assert_eq!(repo.purges.load(Ordering::SeqCst), 1, "one purge at a time");
    tokio::time::timeout(Duration::from_secs(5), dispatcher.shutdown())
        .await
        .expect("shutdown does not wait for the purge");
    // … nor leaves it running.
    assert!(eventually(|| repo.purges_ended.load(Ordering::SeqCst) == 1).await);
}

/// `ids` in a memory repository behind a `Faulty` with the fault `flag` picks switched on,
/// and a publisher taking `delay_ms` per batch.
fn slow_publishes(
    ids: &[&str],
    delay_ms: u64,
    flag: fn(&Faulty) -> &AtomicBool,
) -> (
    Arc<MemoryOutboxRepository>,
    Arc<Faulty>,
    RecordingPublisher,
    Reports,
) {
    let memory = repo_with(ids);
    let repo = Faulty::new(memory.clone());
    flag(&repo).store(true, Ordering::SeqCst);
    let publisher = RecordingPublisher::new();
    publisher.delay_every_batch(Duration::from_millis(delay_ms));
    (memory, repo, publisher, Reports::default())
}

/// The due-time query and the backlog count never answer: shutdown does not wait for them.
#[tokio::test(start_paused = true)]
async fn shutdown_does_not_wait_for_a_hanging_due_query_or_backlog_count() {
    let memory = repo_with(&["a"]);
    let repo = Faulty::new(memory.clone());
    repo.hang_reads.store(true, Ordering::SeqCst);
    let publisher = RecordingPublisher::new();
    let dispatcher = OutboxDispatcher::builder(repo, publisher.clone())
        .backlog_metrics(Some(Duration::from_millis(100)))
        .start()
        .unwrap();
    assert!(eventually(|| all_dispatched(&memory, &["a"])).await);
    sleep(Duration::from_millis(500)).await;
    tokio::time::timeout(Duration::from_secs(5), dispatcher.shutdown())
        .await
        .expect("shutdown ends although the reads never answer");
}

/// An extension that never returns: the publish is stopped before its lease ends (where a
/// dispatcher that cannot extend stops), not left running past it while the rows become
/// claimable again.
#[tokio::test(start_paused = true)]
async fn a_hanging_lease_extension_stops_the_publish_before_the_lease_ends() {
    let ids = ["a", "b"];
    let (memory, repo, publisher, reports) = slow_publishes(&ids, 2500, |r| &r.hang_extend);
    let dispatcher = polling_dispatcher(repo.clone(), &publisher, 2, &reports);
    assert!(eventually(|| memory.is_leased("a")).await);
    // The lease is 1 s; the publish would take 2.5 s.
    sleep(Duration::from_millis(950)).await;
    assert_eq!(reports.all(), ["lease lost: 2"]);
    repo.hang_extend.store(false, Ordering::SeqCst);
    assert!(eventually(|| all_dispatched(&memory, &ids)).await);
    dispatcher.shutdown().await;
}

/// A repository that cannot extend leases: the batch whose lease is nearly over is released
/// instead of published, and published once later.
#[tokio::test(start_paused = true)]
async fn without_lease_extension_a_nearly_expired_batch_is_released_not_published() {
    let ids = ["a", "b", "c", "d"];
    let (memory, repo, publisher, reports) = slow_publishes(&ids, 700, |r| &r.no_extend);
    let first = polling_dispatcher(repo.clone(), &publisher, 2, &reports);
    assert!(eventually(|| memory.is_leased("c")).await);
    let second = polling_dispatcher(repo.clone(), &publisher, 2, &reports);
    assert!(eventually(|| all_dispatched(&memory, &ids)).await);
    sleep(Duration::from_secs(3)).await;
    first.shutdown().await;
    second.shutdown().await;
    for id in ids {
        assert_eq!(publisher.attempt_count(id), 1, "{id} was published twice");
    }
    assert!(
        reports.all().contains(&"lease lost: 2".to_owned()),
        "{:?}",
        reports.all()
    );
}

// ---------------------------------------------------------------------------------------
// Defect 3: marks are all-or-nothing
// ---------------------------------------------------------------------------------------

/// A batch `mark_dispatched` that fails for a reason other than the connection is retried
/// row by row: the published rows are marked, not republished after their lease.
#[tokio::test(start_paused = true)]
async fn a_failed_batch_mark_falls_back_to_marking_row_by_row() {
    let ids = ["a", "b", "c"];
    let memory = repo_with(&ids);
    let repo = Faulty::new(memory.clone());
    repo.fail_batch_dispatched.store(true, Ordering::SeqCst);
    let publisher = RecordingPublisher::new();
    let reports = Reports::default();
    let dispatcher = polling_dispatcher(repo.clone(), &publisher, 10, &reports);
    assert!(eventually(|| all_dispatched(&memory, &ids)).await);
    sleep(Duration::from_secs(5)).await;
    dispatcher.shutdown().await;
    for id in ids {
        assert_eq!(publisher.attempt_count(id), 1, "{id} was published twice");
    }
    assert_eq!(
        reports.all(),
        ["repository: mark rows dispatched (retrying row by row)"]
    );
}

/// In the row-by-row fallback a transient error is not a reason to give a published row up:
/// the mark is tried again, and a row still unmarked stays leased and is claimed again after
/// its lease (published again, which the stream drops), never moved to `dead`, which would
/// stop its ordering key.
#[tokio::test(start_paused = true)]
async fn a_transient_error_in_the_row_by_row_mark_does_not_kill_a_published_row() {
    for failing in [1, 2] {
        let ids = ["a", "b", "c"];
        let memory = repo_with(&ids);
        let repo = Faulty::new(memory.clone());
        repo.fail_batch_dispatched.store(true, Ordering::SeqCst);
        repo.fail_single_dispatched.store(failing, Ordering::SeqCst);
        let publisher = RecordingPublisher::new();
        let reports = Reports::default();
        let dispatcher = polling_dispatcher(repo.clone(), &publisher, 10, &reports);
        assert!(
            eventually(|| all_dispatched(&memory, &ids)).await,
            "{failing}"
        );
        dispatcher.shutdown().await;
        let attempts: usize = ids.iter().map(|id| publisher.attempt_count(id)).sum();
        // One failure is absorbed by the second try; two leave "a" leased, and it is
        // published once more after its lease.
        assert_eq!(attempts, 3 + (failing - 1), "{failing}");
    }
}

/// Every counter `snapshotter` holds, as `(metric, name label, value)`, sorted (a snapshot
/// resets what it reads: take one).
fn counters(snapshotter: &metrics_util::debugging::Snapshotter) -> Vec<(String, String, u64)> {
    let mut all: Vec<_> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| match value {
            metrics_util::debugging::DebugValue::Counter(n) => {
                let name = key.key().labels().next().map(|l| l.value().to_owned());
                Some((key.key().name().to_owned(), name.unwrap_or_default(), n))
            }
            _ => None,
        })
        .collect();
    all.sort();
    all
}

/// A polling dispatcher on rows `ids` whose batch marks always fail (not retryably), so that
/// each published row is marked by itself, with the faults `configure` adds.
fn marked_one_by_one(
    ids: &[&str],
    configure: impl FnOnce(&Faulty),
) -> (
    Arc<MemoryOutboxRepository>,
    RecordingPublisher,
    OutboxDispatcher,
) {
    let memory = repo_with(ids);
    let repo = Faulty::new(memory.clone());
    repo.fail_batch_dispatched.store(true, Ordering::SeqCst);
    configure(&repo);
    let publisher = RecordingPublisher::new();
    let dispatcher = polling_dispatcher(repo, &publisher, 10, &Reports::default());
    (memory, publisher, dispatcher)
}

/// A published row whose own mark is refused (not a passing fault) goes `dead` with the
/// reason, once: it is not published again. The rest of its batch is marked, and each row is
/// counted by name.
#[tokio::test(start_paused = true)]
async fn a_published_row_whose_mark_is_refused_goes_dead_and_is_not_published_again() {
    // This test's runtime has one thread: the dispatcher's task records here too.
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let ids = ["a", "b", "c"];
    let (memory, publisher, dispatcher) = marked_one_by_one(&ids, |repo| {
        repo.refuse_single.lock().unwrap().push("b".into());
    });
    let settled = || {
        all_dispatched(&memory, &["a", "c"])
            && memory.get("b").unwrap().state == OutboxMessageState::Dead
    };
    assert!(eventually(settled).await);
    sleep(Duration::from_secs(60)).await;
    dispatcher.shutdown().await;
    for id in ids {
        assert_eq!(publisher.attempt_count(id), 1, "{id}");
    }
    let b = memory.get("b").unwrap();
    assert!(
        b.last_error
            .as_deref()
            .unwrap()
            .starts_with("published, but it could not be marked dispatched"),
        "{b:?}"
    );
    use trellis_outbox::metrics as m;
    let mut expected = vec![
        (m::DISPATCHED.to_owned(), "Thing.Changed".to_owned(), 2),
        (m::DEAD.to_owned(), "Thing.Changed".to_owned(), 1),
    ];
    expected.sort();
    assert_eq!(counters(&snapshotter), expected);
}

/// Rows marked one by one are counted by name, also when one of them could not be marked
/// (the rows marked were all counted under `_unattributed` then): here "a" stays leased after
/// two transient failures and is marked when claimed again after its lease.
#[tokio::test(start_paused = true)]
async fn rows_marked_one_by_one_are_counted_by_name() {
    // This test's runtime has one thread: the dispatcher's task records here too.
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let ids = ["a", "b", "c"];
    let (memory, _, dispatcher) = marked_one_by_one(&ids, |repo| {
        repo.fail_single_dispatched.store(2, Ordering::SeqCst);
    });
    assert!(eventually(|| all_dispatched(&memory, &ids)).await);
    dispatcher.shutdown().await;
    assert_eq!(
        counters(&snapshotter),
        [(
            trellis_outbox::metrics::DISPATCHED.to_owned(),
            "Thing.Changed".to_owned(),
            3
        )]
    );
}

/// Failed rows of a batch are marked in one call, and a failing batch call falls back to
/// row by row; the rows published in the same batch are marked dispatched regardless.
#[tokio::test(start_paused = true)]
async fn failed_rows_are_marked_in_one_call_with_a_row_by_row_fallback() {
    let ids: Vec<String> = (0..20).map(|n| format!("r{n:02}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let memory = repo_with(&refs);
    let repo = Faulty::new(memory.clone());
    let publisher = RecordingPublisher::new();
    for id in &refs[..10] {
        publisher.fail_always(id, "no responders");
    }
    let options = DispatchOptions::new()
        .batch_size(20)
        .retry_policy(RetryPolicy::fixed(LONG));
    dispatch_outbox(&repo, &publisher, options.clone())
        .await
        .unwrap();
    assert_eq!(repo.failure_marks.load(Ordering::SeqCst), 1);
    for id in &refs[..10] {
        assert_eq!(memory.get(id).unwrap().state, OutboxMessageState::Failed);
    }
    assert!(all_dispatched(&memory, &refs[10..]));

    // The same with the batch call failing: every row is still marked.
    let more: Vec<String> = (0..6).map(|n| format!("s{n}")).collect();
    for id in &more {
        memory.enqueue(&record(id)).unwrap();
        publisher.fail_always(id, "no responders");
    }
    repo.fail_batch_failures.store(true, Ordering::SeqCst);
    let report = dispatch_outbox(&repo, &publisher, options).await.unwrap();
    assert_eq!(report.failed, 6);
    for id in &more {
        let row = memory.get(id).unwrap();
        assert_eq!(row.state, OutboxMessageState::Failed, "{id}");
        assert!(!memory.is_leased(id), "{id} is still leased");
    }
}

/// A custom repository whose failure mark answers more ids than it was asked about (the
/// trait cannot stop it): the rows asked about count as marked, the others are ignored, and
/// nothing is reported lost (the count used to underflow).
#[tokio::test(start_paused = true)]
async fn a_failure_mark_answering_extra_ids_is_not_a_lost_lease() {
    let memory = repo_with(&["a", "b"]);
    let repo = Faulty::new(memory.clone());
    repo.answer_unasked.store(true, Ordering::SeqCst);
    let publisher = RecordingPublisher::new();
    publisher.fail_always("a", "no responders");
    let reports = Reports::default();
    let dispatcher = OutboxDispatcher::builder(repo, publisher.clone())
        .batch_size(10)
        .retry_policy(RetryPolicy::fixed(LONG))
        .on_error(reports.callback())
        .start()
        .unwrap();
    assert!(eventually(|| memory.get("a").unwrap().state == OutboxMessageState::Failed).await);
    assert!(eventually(|| all_dispatched(&memory, &["b"])).await);
    dispatcher.shutdown().await;
    assert_eq!(reports.all(), ["publish: a"]);
}

// ---------------------------------------------------------------------------------------
// Defect 10: every failure reaches on_error once, aggregated per batch
// ---------------------------------------------------------------------------------------

/// 50 rows of one batch fail: one report for the batch, with counts and the first ids.
#[tokio::test(start_paused = true)]
async fn an_outage_is_reported_once_per_batch() {
    let ids: Vec<String> = (0..50).map(|n| format!("r{n:02}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let repo = repo_with(&refs);
    let publisher = RecordingPublisher::new();
    for id in &refs {
        publisher.fail_always(id, "no responders");
    }
    let reports = Reports::default();
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .batch_size(100)
        .retry_policy(RetryPolicy::fixed(LONG))
        .idle_interval(LONG)
        .on_error(reports.callback())
        .start()
        .unwrap();
    assert!(publisher.wait_for_attempts(50, WAIT).await);
    assert!(eventually(|| !reports.all().is_empty()).await);
    sleep(Duration::from_secs(1)).await;
    dispatcher.shutdown().await;
    assert_eq!(reports.all(), ["publish batch: 50 rows, 10 ids"]);
}

/// The mark of the previous batch fails while the claim of the next one fails too: both
/// failures are reported.
#[tokio::test(start_paused = true)]
async fn a_mark_failure_beside_a_claim_failure_is_reported() {
    let ids = ["a", "b", "c"];
    let memory = repo_with(&ids);
    let repo = Faulty::new(memory.clone());
    repo.fail_all_dispatched.store(true, Ordering::SeqCst);
    // Claims: 1 = [a], 2 = [b] (while a is published), 3 fails (while b is published and a
    // is marked).
    repo.fail_claim.store(3, Ordering::SeqCst);
    let publisher = RecordingPublisher::new();
    let reports = Reports::default();
    let dispatcher = OutboxDispatcher::builder(repo.clone(), publisher.clone())
        .batch_size(1)
        .retry_policy(RetryPolicy::fixed(LONG))
        .idle_interval(LONG)
        .on_error(reports.callback())
        .start()
        .unwrap();
    assert!(
        eventually(|| {
            let all = reports.all();
            all.contains(&"repository: claim due rows".to_owned())
                && all
                    .iter()
                    .filter(|r| *r == "repository: mark rows dispatched")
                    .count()
                    >= 2
        })
        .await,
        "{:?}",
        reports.all()
    );
    dispatcher.shutdown().await;
}

/// The rows of a key held back behind its failed head are released after the lease keeper
/// has stopped: released while it runs, its next extension covered fewer rows than asked,
/// looked like a lost lease, and the head's failure was never recorded (no attempt counted,
/// no backoff).
#[tokio::test(start_paused = true)]
async fn releasing_rows_held_behind_a_failed_head_is_not_a_lost_lease() {
    let memory = Arc::new(MemoryOutboxRepository::new());
    for n in 1..=2 {
        memory
            .enqueue(&record(&format!("k{n}")).ordered_by("k"))
            .unwrap();
    }
    let repo = Faulty::new(Arc::clone(&memory));
    repo.slow_releases.store(500, Ordering::SeqCst);
    // The failure comes just before two thirds of the 3 s lease, so the keeper's extension
    // falls due while the held row's release is being answered.
    let publisher = RecordingPublisher::new();
    publisher.delay("k1", Duration::from_millis(1900));
    publisher.fail_times("k1", 1, "broker hiccup");
    let report = dispatch_outbox(
        &*repo,
        &publisher,
        DispatchOptions::new().lease(Duration::from_secs(3)),
    )
    .await
    .unwrap();
    assert_eq!(report.failed, 1, "{report:?}");
    let rows = memory.snapshot();
    let head = rows.iter().find(|r| r.id == "k1").unwrap();
    assert_eq!(head.state, OutboxMessageState::Failed);
    assert_eq!(head.attempts, 1, "the head's failure was not recorded");
}
