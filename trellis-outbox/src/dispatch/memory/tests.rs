//! Unit tests of [`MemoryOutboxRepository`](super::MemoryOutboxRepository).

use super::*;
use crate::record::PreparedOutboxRecord;
use chrono::TimeDelta;
use chrono::TimeZone;

const LEASE: Duration = Duration::from_secs(30);
const SEC: Duration = Duration::from_secs(1);

fn start() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 5, 25, 0, 0, 0).unwrap()
}

fn record(id: &str) -> PreparedOutboxRecord {
    let mut r =
        PreparedOutboxRecord::event("Thing.Changed", "events.v1.Thing.Changed", &1).unwrap();
    r.id = id.to_owned();
    r
}

fn ids(claim: &Claim) -> Vec<&str> {
    claim.messages.iter().map(|m| m.id.as_str()).collect()
}

#[tokio::test(start_paused = true)]
async fn clock_follows_tokio_time() {
    let repo = MemoryOutboxRepository::starting_at(start());
    assert_eq!(repo.now(), start());
    tokio::time::advance(Duration::from_millis(1500)).await;
    assert_eq!(repo.now(), start() + TimeDelta::milliseconds(1500));
}

#[tokio::test(start_paused = true)]
async fn enqueue_is_idempotent_and_validates() {
    let repo = MemoryOutboxRepository::starting_at(start());
    let first = repo.enqueue(&record("a")).unwrap();
    tokio::time::advance(Duration::from_secs(1)).await;
    let mut changed = record("a");
    changed.payload = "2".into();
    assert_eq!(repo.enqueue(&changed).unwrap(), first);
    assert_eq!(repo.get("a").unwrap().payload, "1");
    let mut bad = record("b");
    bad.subject = "a.*".into();
    assert!(matches!(
        repo.enqueue(&bad),
        Err(crate::Error::InvalidRecord { .. })
    ));
    assert_eq!(repo.snapshot().len(), 1);
    assert!(repo.get("b").is_none());
}

#[tokio::test(start_paused = true)]
async fn claims_in_created_at_then_id_order_and_leases() {
    let repo = MemoryOutboxRepository::starting_at(start());
    repo.enqueue(&record("z-old")).unwrap();
    tokio::time::advance(Duration::from_millis(1)).await;
    for id in ["c", "a", "b"] {
        repo.enqueue(&record(id)).unwrap();
    }
    let first = repo.claim_due(3, LEASE, None).await.unwrap();
    assert_eq!(ids(&first), ["z-old", "a", "b"]);
    assert!(repo.is_leased("a"));
    let second = repo.claim_due(10, LEASE, None).await.unwrap();
    assert_eq!(ids(&second), ["c"]);
    assert_ne!(first.token, second.token);
    assert!(repo.claim_due(10, LEASE, None).await.unwrap().is_empty());
    assert!(repo.claim_due(0, LEASE, None).await.unwrap().is_empty());
    // Every row is leased: the next one is claimable when the leases expire.
    assert_eq!(repo.next_due_in().await.unwrap(), Some(LEASE));
    tokio::time::advance(LEASE).await;
    assert_eq!(repo.next_due_in().await.unwrap(), Some(Duration::ZERO));
    assert_eq!(repo.claim_due(10, LEASE, None).await.unwrap().len(), 4);
}

#[tokio::test(start_paused = true)]
async fn expired_lease_is_reclaimed_and_stale_token_cannot_mark() {
    let repo = MemoryOutboxRepository::starting_at(start());
    repo.enqueue(&record("a")).unwrap();
    let stale = repo.claim_due(10, LEASE, None).await.unwrap();
    tokio::time::advance(LEASE).await;
    let fresh = repo.claim_due(10, LEASE, None).await.unwrap();
    assert_eq!(ids(&fresh), ["a"]);
    assert_eq!(
        repo.mark_dispatched(&stale, &[Dispatched::new("a")])
            .await
            .unwrap(),
        0
    );
    assert!(
        !repo
            .mark_failure(&stale, Failure::retry("a", "x", LEASE))
            .await
            .unwrap()
    );
    assert!(
        !repo
            .mark_failure(&stale, Failure::dead("a", "x", true))
            .await
            .unwrap()
    );
    assert_eq!(repo.release(&stale, &["a"]).await.unwrap(), 0);
    assert_eq!(repo.get("a").unwrap().state, OutboxMessageState::Pending);
    let outcome = serde_json::json!({"ok": true});
    assert_eq!(
        repo.mark_dispatched(&fresh, &[Dispatched::with_outcome("a", outcome.clone())])
            .await
            .unwrap(),
        1
    );
    let row = repo.get("a").unwrap();
    assert_eq!(row.state, OutboxMessageState::Dispatched);
    assert_eq!(row.outcome, Some(outcome));
    assert_eq!(row.updated_at, start() + TimeDelta::seconds(30));
    assert!(!repo.is_leased("a"));
    // A second mark with the same token changes nothing: the lease is gone.
    assert_eq!(
        repo.mark_dispatched(&fresh, &[Dispatched::new("a")])
            .await
            .unwrap(),
        0
    );
    assert_eq!(repo.next_due_in().await.unwrap(), None);
}

#[tokio::test(start_paused = true)]
async fn failed_rows_respect_next_attempt_and_cutoff() {
    let repo = MemoryOutboxRepository::starting_at(start());
    repo.enqueue(&record("a")).unwrap();
    let claim = repo.claim_due(10, LEASE, None).await.unwrap();
    assert_eq!(claim.cutoff, start());
    assert!(
        repo.mark_failure(&claim, Failure::retry("a", "boom", Duration::from_secs(5)))
            .await
            .unwrap()
    );
    let row = repo.get("a").unwrap();
    assert_eq!(row.state, OutboxMessageState::Failed);
    assert_eq!(row.attempts, 1);
    assert_eq!(row.last_error.as_deref(), Some("boom"));
    assert_eq!(row.next_attempt_at, Some(start() + TimeDelta::seconds(5)));
    assert_eq!(
        repo.next_due_in().await.unwrap(),
        Some(Duration::from_secs(5))
    );
    tokio::time::advance(Duration::from_secs(5)).await;
    // Due now, but not for a claim that keeps the old wave's cutoff.
    assert!(
        repo.claim_due(10, LEASE, Some(claim.cutoff))
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(repo.next_due_in().await.unwrap(), Some(Duration::ZERO));
    let again = repo.claim_due(10, LEASE, None).await.unwrap();
    assert_eq!(ids(&again), ["a"]);
    assert_eq!(again.messages[0].attempts, 1);
    assert!(
        repo.mark_failure(&again, Failure::dead("a", "gave up", true))
            .await
            .unwrap()
    );
    let row = repo.get("a").unwrap();
    assert_eq!(
        (row.state, row.attempts, row.last_error.as_deref()),
        (OutboxMessageState::Dead, 2, Some("gave up"))
    );
    assert!(repo.claim_due(10, LEASE, None).await.unwrap().is_empty());
    assert_eq!(repo.next_due_in().await.unwrap(), None);
    // An operator's retry makes it pending and due at once.
    assert_eq!(repo.retry("a").await.unwrap(), RetryOutcome::Retried);
    assert_eq!(
        repo.retry("a").await.unwrap(),
        RetryOutcome::NotRetryable {
            state: "pending".into()
        }
    );
    assert_eq!(repo.retry("missing").await.unwrap(), RetryOutcome::NotFound);
    let row = repo.get("a").unwrap();
    assert_eq!((row.state, row.attempts), (OutboxMessageState::Pending, 0));
    assert_eq!(repo.next_due_in().await.unwrap(), Some(Duration::ZERO));
}

// Issue #10 defect 7: an operator's retry must not reset a failed row a dispatcher
// holds again, or the holder's marks are fenced out while another claim publishes it.
#[tokio::test(start_paused = true)]
async fn retry_refuses_a_row_under_a_live_lease() {
    let repo = MemoryOutboxRepository::starting_at(start());
    repo.enqueue(&record("a")).unwrap();
    let first = repo.claim_due(10, LEASE, None).await.unwrap();
    assert!(
        repo.mark_failure(&first, Failure::retry("a", "boom", SEC))
            .await
            .unwrap()
    );
    tokio::time::advance(SEC).await;
    let holder = repo.claim_due(10, LEASE, None).await.unwrap();
    assert_eq!(ids(&holder), ["a"]);
    let until = start() + TimeDelta::seconds(31);
    assert_eq!(
        repo.retry("a").await.unwrap(),
        RetryOutcome::Leased { until }
    );
    assert!(repo.claim_due(10, LEASE, None).await.unwrap().is_empty());
    // The holder still owns the row: its mark lands.
    assert!(
        repo.mark_failure(&holder, Failure::retry("a", "again", SEC))
            .await
            .unwrap()
    );
    assert_eq!(repo.get("a").unwrap().attempts, 2);
    // A lease that expired does not hold the row.
    tokio::time::advance(SEC).await;
    let lapsed = repo.claim_due(10, LEASE, None).await.unwrap();
    assert_eq!(ids(&lapsed), ["a"]);
    tokio::time::advance(LEASE).await;
    assert_eq!(repo.retry("a").await.unwrap(), RetryOutcome::Retried);
    let row = repo.get("a").unwrap();
    assert_eq!((row.state, row.attempts), (OutboxMessageState::Pending, 0));
    assert!(
        !repo
            .mark_failure(&lapsed, Failure::retry("a", "late", SEC))
            .await
            .unwrap()
    );
}

#[tokio::test(start_paused = true)]
async fn next_due_in_is_the_earliest_deadline() {
    let repo = MemoryOutboxRepository::starting_at(start());
    for id in ["late", "early"] {
        repo.enqueue(&record(id)).unwrap();
    }
    let claim = repo.claim_due(10, LEASE, None).await.unwrap();
    assert!(
        repo.mark_failure(&claim, Failure::retry("late", "x", Duration::from_secs(9)))
            .await
            .unwrap()
    );
    assert!(
        repo.mark_failure(&claim, Failure::retry("early", "x", Duration::from_secs(2)))
            .await
            .unwrap()
    );
    assert_eq!(
        repo.next_due_in().await.unwrap(),
        Some(Duration::from_secs(2))
    );
}

#[tokio::test(start_paused = true)]
async fn poisoned_rows_and_release() {
    let repo = MemoryOutboxRepository::starting_at(start());
    repo.enqueue_undecodable(&record("a-bad"), "unknown kind \"job.cancel\"")
        .unwrap();
    repo.enqueue(&record("b")).unwrap();
    let claim = repo.claim_due(10, LEASE, None).await.unwrap();
    assert_eq!(ids(&claim), ["b"]);
    assert_eq!(claim.poisoned.len(), 1);
    assert_eq!(claim.poisoned[0].id, "a-bad");
    assert_eq!(claim.len(), 2);
    assert_eq!(repo.release(&claim, &["b", "missing"]).await.unwrap(), 1);
    assert!(!repo.is_leased("b"));
    assert!(
        repo.mark_failure(&claim, Failure::dead("a-bad", "unknown kind", false))
            .await
            .unwrap()
    );
    assert_eq!(repo.get("a-bad").unwrap().attempts, 0);
    let again = repo.claim_due(10, LEASE, None).await.unwrap();
    assert_eq!(ids(&again), ["b"]);
    assert!(again.poisoned.is_empty());
}

/// As the Postgres claim: a key's run (its claimable rows from the head on) is claimed
/// together and ordered for publishing in rounds; rows behind a published row still being
/// marked are claimable; a run cut by the limit keeps only its prefix.
#[tokio::test(start_paused = true)]
async fn a_claim_takes_runs_of_keys_in_rounds() {
    let repo = MemoryOutboxRepository::starting_at(start());
    for id in ["a1", "a2", "a3"] {
        repo.enqueue(&record(id).ordered_by("a")).unwrap();
    }
    repo.enqueue(&record("b1").ordered_by("b")).unwrap();
    repo.enqueue(&record("u")).unwrap();

    let claim = repo.claim_due(4, LEASE, None).await.unwrap();
    // Rounds: the first row of each key (and unkeyed rows), then the second, …
    assert_eq!(ids(&claim), ["a1", "b1", "a2", "a3"]);
    assert_eq!(claim.ahead_of("a2"), Some("a1"));
    assert_eq!(claim.ahead_of("a3"), Some("a2"));
    assert_eq!(claim.ahead_of("b1"), None);
    assert_eq!(ids(&repo.claim_due(10, LEASE, None).await.unwrap()), ["u"]);

    // a4 waits behind a1–a3 (leased) until they are published: then it is claimable
    // while they are still being marked.
    repo.enqueue(&record("a4").ordered_by("a")).unwrap();
    assert!(repo.claim_due(10, LEASE, None).await.unwrap().is_empty());
    let published: Vec<String> = ["a1", "a2", "a3"].map(String::from).to_vec();
    let behind = repo
        .claim(ClaimRequest::new(10, LEASE).published(published))
        .await
        .unwrap();
    assert_eq!(ids(&behind), ["a4"]);
}

/// Keys whose rows were not written in `created_at`/id order: the runs are capped at the
/// limit key by key, so they cannot cut each other out of every claim.
#[tokio::test(start_paused = true)]
async fn runs_written_out_of_id_order_still_make_progress() {
    let repo = MemoryOutboxRepository::starting_at(start());
    // Each key's second row sorts before both first rows: uncapped, the two runs cut each
    // other out of a claim of 2 every time.
    for (id, key) in [("kz", "k"), ("ak", "k"), ("jz", "j"), ("bj", "j")] {
        repo.enqueue(&record(id).ordered_by(key)).unwrap();
    }
    let mut order = Vec::new();
    for _ in 0..4 {
        let claim = repo.claim_due(2, LEASE, None).await.unwrap();
        assert!(!claim.is_empty(), "no progress after {order:?}");
        let dispatched: Vec<Dispatched> = claim
            .messages
            .iter()
            .map(|m| Dispatched::new(m.id.clone()))
            .collect();
        order.extend(ids(&claim).iter().map(|id| id.to_string()));
        repo.mark_dispatched(&claim, &dispatched).await.unwrap();
        if order.len() == 4 {
            break;
        }
    }
    // Each key in the order its rows were written.
    let pos = |id: &str| order.iter().position(|o| o == id).unwrap();
    assert!(pos("kz") < pos("ak") && pos("jz") < pos("bj"), "{order:?}");
}
