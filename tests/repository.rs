//! The SQL repositories on real Postgres and SQLite: claim order, leases, fencing tokens,
//! retry timing, poison rows, release and operator retry.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::time::Duration;

use serde_json::json;
use trellis_outbox::{
    Dispatched, Failure, OutboxRepository, OutboxTransactionExt, PgOutboxRepository,
    PreparedOutboxRecord, RetryOutcome, SqliteOutboxRepository, migrate,
};
use trellis_outbox_tests::{TestPg, TestSqlite};

const LEASE: Duration = Duration::from_secs(30);

/// What the shared checks need from each database.
trait Db {
    type Repo: OutboxRepository;
    fn repo(&self) -> Self::Repo;
    /// Inserts a row with raw column values (to make poison rows and `created_at` ties).
    async fn insert_raw(&self, id: &str, kind: &str, headers: &str, created_at: &str);
    /// `(state, attempts, last_error, outcome as JSON text)` of a row.
    async fn row(&self, id: &str) -> (String, i64, Option<String>, Option<String>);
    async fn enqueue(&self, records: &[PreparedOutboxRecord]);
}

impl Db for TestPg {
    type Repo = PgOutboxRepository;
    fn repo(&self) -> PgOutboxRepository {
        PgOutboxRepository::new(self.pool.clone())
    }
    async fn insert_raw(&self, id: &str, kind: &str, headers: &str, created_at: &str) {
        sqlx::query("INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at) VALUES ($1, $2, 'A.B', 'events.v1.A.B', '{}', $3::jsonb, 'pending', 0, $4::timestamptz, $4::timestamptz)")
            .bind(id).bind(kind).bind(headers).bind(created_at)
            .execute(&self.pool).await.unwrap();
    }
    async fn row(&self, id: &str) -> (String, i64, Option<String>, Option<String>) {
        sqlx::query_as("SELECT state, attempts::int8, last_error, outcome::text FROM trellis_outbox WHERE id = $1")
            .bind(id).fetch_one(&self.pool).await.unwrap()
    }
    async fn enqueue(&self, records: &[PreparedOutboxRecord]) {
        let mut tx = self.pool.begin().await.unwrap();
        tx.enqueue_all(records).await.unwrap();
        tx.commit().await.unwrap();
    }
}

impl Db for TestSqlite {
    type Repo = SqliteOutboxRepository;
    fn repo(&self) -> SqliteOutboxRepository {
        SqliteOutboxRepository::new(self.pool.clone())
    }
    async fn insert_raw(&self, id: &str, kind: &str, headers: &str, created_at: &str) {
        sqlx::query("INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at) VALUES (?, ?, 'A.B', 'events.v1.A.B', '{}', ?, 'pending', 0, ?, ?)")
            .bind(id).bind(kind).bind(headers).bind(created_at).bind(created_at)
            .execute(&self.pool).await.unwrap();
    }
    async fn row(&self, id: &str) -> (String, i64, Option<String>, Option<String>) {
        sqlx::query_as(
            "SELECT state, attempts, last_error, outcome FROM trellis_outbox WHERE id = ?",
        )
        .bind(id)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }
    async fn enqueue(&self, records: &[PreparedOutboxRecord]) {
        let mut tx = self.pool.begin().await.unwrap();
        tx.enqueue_all(records).await.unwrap();
        tx.commit().await.unwrap();
    }
}

fn records(n: usize) -> Vec<PreparedOutboxRecord> {
    (0..n)
        .map(|i| PreparedOutboxRecord::event("A.B", "events.v1.A.B", &json!({ "n": i })).unwrap())
        .collect()
}

async fn claims_in_order_and_holds_the_lease(db: &impl Db) {
    let repo = db.repo();
    // Two rows created in the same millisecond with ids out of insertion order, one older.
    db.insert_raw(
        "b-same-ms",
        "event.publish",
        "{}",
        "2026-01-01T00:00:00.000Z",
    )
    .await;
    db.insert_raw(
        "a-same-ms",
        "event.publish",
        "{}",
        "2026-01-01T00:00:00.000Z",
    )
    .await;
    db.insert_raw(
        "z-oldest",
        "event.publish",
        "{}",
        "2025-12-31T23:59:59.999Z",
    )
    .await;
    let fresh = records(3);
    db.enqueue(&fresh).await;

    let claim = repo.claim_due(4, LEASE, None).await.unwrap();
    let ids: Vec<&str> = claim.messages.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(
        ids,
        ["z-oldest", "a-same-ms", "b-same-ms", fresh[0].id.as_str()]
    );
    assert!(claim.poisoned.is_empty());

    // Leased rows are not claimed again; the rest are.
    let second = repo.claim_due(10, LEASE, None).await.unwrap();
    let ids: Vec<&str> = second.messages.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, [fresh[1].id.as_str(), fresh[2].id.as_str()]);
    assert_ne!(claim.token, second.token);
    assert!(repo.claim_due(10, LEASE, None).await.unwrap().is_empty());

    // Dispatched rows are never claimed again, even after the lease would have expired.
    let done: Vec<Dispatched> = claim
        .messages
        .iter()
        .map(|m| Dispatched::new(&m.id))
        .collect();
    assert_eq!(repo.mark_dispatched(&claim, &done).await.unwrap(), 4);
    let (state, attempts, last_error, outcome) = db.row("z-oldest").await;
    assert_eq!(
        (state.as_str(), attempts, last_error, outcome),
        ("dispatched", 0, None, None)
    );
}

async fn expired_lease_is_reclaimed_and_stale_token_is_fenced(db: &impl Db) {
    let repo = db.repo();
    let rec = records(1);
    db.enqueue(&rec).await;
    let id = rec[0].id.as_str();
    let stale = repo
        .claim_due(10, Duration::from_millis(300), None)
        .await
        .unwrap();
    assert_eq!(stale.messages.len(), 1);
    assert!(repo.claim_due(10, LEASE, None).await.unwrap().is_empty());
    assert_eq!(
        repo.next_due_in()
            .await
            .unwrap()
            .map(|d| d <= Duration::from_millis(300)),
        Some(true)
    );

    tokio::time::sleep(Duration::from_millis(400)).await;
    let fresh = repo.claim_due(10, LEASE, None).await.unwrap();
    assert_eq!(
        fresh.messages.len(),
        1,
        "an expired lease makes the row claimable again"
    );
    assert_eq!(fresh.messages[0].id, id);

    // The dispatcher that lost its lease cannot mark the row any more.
    assert_eq!(
        repo.mark_dispatched(&stale, &[Dispatched::new(id)])
            .await
            .unwrap(),
        0
    );
    assert!(
        !repo
            .mark_failure(&stale, Failure::retry(id, "late", Duration::from_secs(1)))
            .await
            .unwrap()
    );
    assert!(
        !repo
            .mark_failure(&stale, Failure::dead(id, "late", true))
            .await
            .unwrap()
    );
    assert_eq!(repo.release(&stale, &[id]).await.unwrap(), 0);
    assert_eq!(db.row(id).await.0, "pending");

    let outcome = json!({ "kind": "accepted", "ref": { "id": "job-1" } });
    assert_eq!(
        repo.mark_dispatched(&fresh, &[Dispatched::with_outcome(id, outcome.clone())])
            .await
            .unwrap(),
        1
    );
    let (state, _, _, stored) = db.row(id).await;
    assert_eq!(state, "dispatched");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&stored.unwrap()).unwrap(),
        outcome
    );
    assert_eq!(repo.next_due_in().await.unwrap(), None);
}

async fn failed_rows_wait_for_their_retry_time(db: &impl Db) {
    let repo = db.repo();
    let rec = records(1);
    db.enqueue(&rec).await;
    let id = rec[0].id.as_str();
    let claim = repo.claim_due(10, LEASE, None).await.unwrap();
    assert!(
        repo.mark_failure(
            &claim,
            Failure::retry(
                id,
                "nats: timed out: no ack within 5s",
                // Long enough that a stalled machine does not make the row due before the
                // checks below (they allow a second and a half of delay).
                Duration::from_secs(2)
            )
        )
        .await
        .unwrap()
    );
    let (state, attempts, last_error, _) = db.row(id).await;
    assert_eq!((state.as_str(), attempts), ("failed", 1));
    assert_eq!(
        last_error.as_deref(),
        Some("nats: timed out: no ack within 5s")
    );

    let due_in = repo.next_due_in().await.unwrap().unwrap();
    assert!(
        due_in > Duration::from_millis(500) && due_in <= Duration::from_secs(2),
        "{due_in:?}"
    );
    assert!(repo.claim_due(10, LEASE, None).await.unwrap().is_empty());

    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let again = repo.claim_due(10, LEASE, None).await.unwrap();
    assert_eq!(again.messages.len(), 1);
    assert_eq!(again.messages[0].attempts, 1);
    assert_eq!(
        again.messages[0].last_error.as_deref(),
        Some("nats: timed out: no ack within 5s")
    );
}

async fn a_drain_wave_does_not_retry_its_own_failures(db: &impl Db) {
    let repo = db.repo();
    let rec = records(2);
    db.enqueue(&rec).await;
    let first = repo.claim_due(1, LEASE, None).await.unwrap();
    assert!(
        repo.mark_failure(
            &first,
            Failure::retry(&rec[0].id, "boom", Duration::from_millis(1))
        )
        .await
        .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    // Same wave: the cutoff of the first claim excludes the row that failed after it.
    let second = repo.claim_due(10, LEASE, Some(first.cutoff)).await.unwrap();
    let ids: Vec<&str> = second.messages.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, [rec[1].id.as_str()]);
    assert_eq!(second.cutoff, first.cutoff);
    // A new wave picks it up.
    let third = repo.claim_due(10, LEASE, None).await.unwrap();
    assert_eq!(third.messages[0].id, rec[0].id);
}

async fn poison_rows_are_reported_not_fatal(db: &impl Db, bad_headers: &str) {
    let repo = db.repo();
    db.insert_raw(
        "poison-kind",
        "event.bogus",
        "{}",
        "2026-01-01T00:00:00.000Z",
    )
    .await;
    db.insert_raw(
        "poison-headers",
        "event.publish",
        bad_headers,
        "2026-01-01T00:00:00.001Z",
    )
    .await;
    let good = records(2);
    db.enqueue(&good).await;

    let claim = repo.claim_due(10, LEASE, None).await.unwrap();
    assert_eq!(
        claim.messages.len(),
        2,
        "the rows behind the poison are claimed"
    );
    assert_eq!(claim.poisoned.len(), 2);
    let kind = claim
        .poisoned
        .iter()
        .find(|p| p.id == "poison-kind")
        .unwrap();
    assert!(
        kind.reason.contains("kind") && kind.reason.contains("event.bogus"),
        "{}",
        kind.reason
    );
    let headers = claim
        .poisoned
        .iter()
        .find(|p| p.id == "poison-headers")
        .unwrap();
    assert!(headers.reason.contains("headers"), "{}", headers.reason);

    for poison in &claim.poisoned {
        assert!(
            repo.mark_failure(&claim, Failure::dead(&poison.id, &poison.reason, false))
                .await
                .unwrap()
        );
    }
    let (state, attempts, last_error, _) = db.row("poison-kind").await;
    assert_eq!((state.as_str(), attempts), ("dead", 0));
    assert!(last_error.unwrap().contains("event.bogus"));
    // Dead rows are not claimed, and not due.
    let done: Vec<Dispatched> = claim
        .messages
        .iter()
        .map(|m| Dispatched::new(&m.id))
        .collect();
    repo.mark_dispatched(&claim, &done).await.unwrap();
    assert!(
        repo.claim_due(10, Duration::ZERO, None)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(repo.next_due_in().await.unwrap(), None);

    // An operator's retry brings a dead row back.
    assert_eq!(
        repo.retry("poison-kind").await.unwrap(),
        RetryOutcome::Retried
    );
    assert_eq!(db.row("poison-kind").await.0, "pending");
    assert_eq!(
        repo.retry("poison-kind").await.unwrap(),
        RetryOutcome::NotRetryable {
            state: "pending".into()
        },
        "only failed or dead rows"
    );
    assert_eq!(
        repo.retry("no-such-row").await.unwrap(),
        RetryOutcome::NotFound
    );
}

/// Issue #10 defect 7: `retry` on a failed row that a dispatcher has claimed again used to
/// reset it and clear its claim token, fencing out the holder's marks while another
/// dispatcher could claim and publish the row. A row under a live lease is refused.
async fn retry_refuses_a_row_under_a_live_lease(db: &impl Db) {
    let (holder, operator, other) = (db.repo(), db.repo(), db.repo());
    let rec = records(2);
    db.enqueue(&rec).await;
    let id = rec[0].id.as_str();
    let first = holder.claim_due(1, LEASE, None).await.unwrap();
    assert!(
        holder
            .mark_failure(&first, Failure::retry(id, "boom", Duration::from_millis(1)))
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    // The dispatcher retries the failed row: claimed again, `failed`, under a live lease.
    let claim = holder.claim_due(1, LEASE, None).await.unwrap();
    assert_eq!(claim.messages[0].id, id);
    assert_eq!(db.row(id).await.0, "failed");
    match operator.retry(id).await.unwrap() {
        RetryOutcome::Leased { until } => {
            let left = until - chrono::Utc::now();
            assert!(
                left > chrono::TimeDelta::seconds(20) && left <= chrono::TimeDelta::seconds(31),
                "lease ends in {left}"
            );
        }
        other => panic!("expected Leased, got {other:?}"),
    }
    let (state, attempts, ..) = db.row(id).await;
    assert_eq!((state.as_str(), attempts), ("failed", 1), "left alone");
    // No other dispatcher can take it meanwhile, and the holder's mark lands.
    let others = other.claim_due(10, LEASE, None).await.unwrap();
    let ids: Vec<&str> = others.messages.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, [rec[1].id.as_str()]);
    assert!(
        holder
            .mark_failure(&claim, Failure::dead(id, "gave up", true))
            .await
            .unwrap()
    );
    assert_eq!(db.row(id).await.0, "dead");

    // A dead row claimed by nobody is retried. So is a failed row whose lease expired.
    assert_eq!(operator.retry(id).await.unwrap(), RetryOutcome::Retried);
    let lapsed = holder
        .claim_due(1, Duration::from_millis(300), None)
        .await
        .unwrap();
    assert_eq!(lapsed.messages[0].id, id);
    assert!(
        holder
            .mark_failure(
                &lapsed,
                Failure::retry(id, "boom", Duration::from_millis(1))
            )
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    let lapsed = holder
        .claim_due(1, Duration::from_millis(300), None)
        .await
        .unwrap();
    assert_eq!(lapsed.messages[0].id, id);
    assert!(matches!(
        operator.retry(id).await.unwrap(),
        RetryOutcome::Leased { .. }
    ));
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(operator.retry(id).await.unwrap(), RetryOutcome::Retried);
    let (state, attempts, ..) = db.row(id).await;
    assert_eq!((state.as_str(), attempts), ("pending", 0));
    // The expired claim's token was cleared: its marks are fenced out.
    assert!(
        !holder
            .mark_failure(&lapsed, Failure::retry(id, "late", LEASE))
            .await
            .unwrap()
    );

    // Rows in other states say which state they are in.
    assert_eq!(
        other
            .mark_dispatched(&others, &[Dispatched::new(&rec[1].id)])
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        operator.retry(&rec[1].id).await.unwrap(),
        RetryOutcome::NotRetryable {
            state: "dispatched".into()
        }
    );
    assert_eq!(
        operator.retry("missing").await.unwrap(),
        RetryOutcome::NotFound
    );
}

/// Issue #10 defect 11: a lease or retry delay too long for the database's interval and
/// time types (`Duration::MAX`) used to fail the statement (Postgres `make_interval`) or
/// store NULL (SQLite), making the row claimable at once. It is stored as "far future".
async fn huge_leases_and_delays_mean_far_future(db: &impl Db) {
    let repo = db.repo();
    let rec = records(2);
    db.enqueue(&rec).await;
    let claim = repo.claim_due(1, Duration::MAX, None).await.unwrap();
    assert_eq!(claim.messages[0].id, rec[0].id);
    assert!(
        repo.mark_failure(&claim, Failure::retry(&rec[0].id, "boom", Duration::MAX))
            .await
            .unwrap()
    );
    let leased = repo.claim_due(1, Duration::MAX, None).await.unwrap();
    assert_eq!(leased.messages[0].id, rec[1].id);
    // Neither row is claimable again: one is due in ~100 years, one leased as long.
    assert!(repo.claim_due(10, LEASE, None).await.unwrap().is_empty());
    let due_in = repo.next_due_in().await.unwrap().unwrap();
    assert!(
        due_in > Duration::from_secs(50 * 365 * 86_400),
        "next due in {due_in:?}"
    );
    let (state, attempts, last_error, _) = db.row(&rec[0].id).await;
    assert_eq!(
        (state.as_str(), attempts, last_error.as_deref()),
        ("failed", 1, Some("boom"))
    );
}

async fn release_makes_rows_claimable_at_once(db: &impl Db) {
    let repo = db.repo();
    let rec = records(3);
    db.enqueue(&rec).await;
    let claim = repo.claim_due(10, LEASE, None).await.unwrap();
    let ids: Vec<&str> = rec[1..].iter().map(|r| r.id.as_str()).collect();
    assert_eq!(repo.release(&claim, &ids).await.unwrap(), 2);
    let again = repo.claim_due(10, LEASE, None).await.unwrap();
    let got: Vec<&str> = again.messages.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(got, ids);
}

/// `extend_lease` keeps a claim's rows from being claimed after the original lease, and is
/// fenced by the claim token; `mark_failures` marks a mixed list in one call, fenced too.
async fn leases_extend_and_failures_mark_in_one_call(db: &impl Db) {
    db.enqueue(&records(3)).await;
    let repo = db.repo();
    assert!(repo.extends_leases());
    let short = Duration::from_millis(300);
    let claim = repo.claim_due(10, short, None).await.unwrap();
    assert_eq!(claim.len(), 3);
    let ids: Vec<&str> = claim.messages.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(repo.extend_lease(&claim, &ids, LEASE).await.unwrap(), 3);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let other = repo.claim_due(10, LEASE, None).await.unwrap();
    assert!(
        other.is_empty(),
        "rows of an extended lease were claimed again"
    );
    // A stale token extends nothing.
    let stale = trellis_outbox::Claim::empty("stale".into(), claim.cutoff);
    assert_eq!(repo.extend_lease(&stale, &ids, LEASE).await.unwrap(), 0);

    let failures = [
        Failure::retry(ids[0], "timed out", Duration::from_secs(60)),
        Failure::dead(ids[1], "too large", true),
        Failure::dead(ids[2], "undecodable", false),
    ];
    assert!(
        repo.mark_failures(&stale, &failures)
            .await
            .unwrap()
            .is_empty()
    );
    let mut marked = repo.mark_failures(&claim, &failures).await.unwrap();
    marked.sort();
    let mut expected: Vec<String> = ids.iter().map(|id| (*id).to_owned()).collect();
    expected.sort();
    assert_eq!(marked, expected);
    let (state, attempts, error, _) = db.row(ids[0]).await;
    assert_eq!(
        (state.as_str(), attempts, error.as_deref()),
        ("failed", 1, Some("timed out"))
    );
    let (state, attempts, error, _) = db.row(ids[1]).await;
    assert_eq!(
        (state.as_str(), attempts, error.as_deref()),
        ("dead", 1, Some("too large"))
    );
    let (state, attempts, error, _) = db.row(ids[2]).await;
    assert_eq!(
        (state.as_str(), attempts, error.as_deref()),
        ("dead", 0, Some("undecodable"))
    );
    // The failed row is due in a minute, not now; the dead ones never.
    assert!(repo.claim_due(10, LEASE, None).await.unwrap().is_empty());
}

async fn pg() -> TestPg {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    db
}

async fn sqlite() -> TestSqlite {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    db
}

macro_rules! both {
    ($name:ident $(, $arg_pg:expr, $arg_sqlite:expr)?) => {
        mod $name {
            use super::*;
            #[tokio::test]
            async fn postgres() {
                let db = pg().await;
                super::$name(&db $(, $arg_pg)?).await;
                db.close().await;
            }
            #[tokio::test]
            async fn sqlite() {
                let db = super::sqlite().await;
                super::$name(&db $(, $arg_sqlite)?).await;
            }
        }
    };
}

both!(claims_in_order_and_holds_the_lease);
both!(expired_lease_is_reclaimed_and_stale_token_is_fenced);
both!(failed_rows_wait_for_their_retry_time);
both!(a_drain_wave_does_not_retry_its_own_failures);
both!(poison_rows_are_reported_not_fatal, "[1, 2]", "not json");
both!(release_makes_rows_claimable_at_once);
both!(leases_extend_and_failures_mark_in_one_call);
both!(retry_refuses_a_row_under_a_live_lease);
both!(huge_leases_and_delays_mean_far_future);

/// A claim on SQLite returns most columns packed into one JSON value: every column must come
/// back exactly, whatever characters it holds.
#[tokio::test]
async fn sqlite_claim_reads_every_column_exactly() {
    let header_value = |text: &str| text.replace('\n', " ").replace('\u{1f}', "\u{a0}");
    use chrono::{TimeZone, Utc};
    use trellis_outbox::{OutboxMessageState, OutboxRecordKind};

    let db = sqlite().await;
    let repo = db.repo();
    let awkward = "quote \" backslash \\ newline \n tab \t unit \u{1f} emoji \u{1f600} end";
    sqlx::query(
        "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, \
         created_at, updated_at, next_attempt_at, last_error, outcome) \
         VALUES ('failed-row', 'job.create', ?1, 'events.v1.A.B', '{\"p\":\"\\u00e9\"}', ?2, 'failed', 3, \
         '2026-01-01T00:00:00.123Z', '2026-01-02T00:00:00.456Z', '2026-01-01T00:00:01.000Z', ?1, ?3)",
    )
    .bind(awkward)
    // A header value may hold anything but control characters other than tab (a row with
    // one is poison: CR/LF cannot be sent to NATS, and enqueue refuses the others).
    .bind(serde_json::to_string(&json!({ "X-Odd": header_value(awkward) })).unwrap())
    .bind(serde_json::to_string(&json!({ "note": awkward, "n": [1, 2.5, null] })).unwrap())
    .execute(&db.pool)
    .await
    .unwrap();

    let claim = repo.claim_due(10, LEASE, None).await.unwrap();
    assert!(claim.poisoned.is_empty(), "{:?}", claim.poisoned);
    let [m] = claim.messages.as_slice() else {
        panic!("{:?}", claim.messages)
    };
    assert_eq!(m.id, "failed-row");
    assert_eq!(m.kind, OutboxRecordKind::JobCreate);
    assert_eq!(m.name, awkward);
    assert_eq!(m.subject, "events.v1.A.B");
    assert_eq!(m.payload, "{\"p\":\"\\u00e9\"}");
    assert_eq!(m.headers["X-Odd"], header_value(awkward));
    assert_eq!(m.state, OutboxMessageState::Failed);
    assert_eq!(m.attempts, 3);
    assert_eq!(
        m.created_at,
        Utc.timestamp_millis_opt(1_767_225_600_123).unwrap()
    );
    assert_eq!(
        m.updated_at,
        Utc.timestamp_millis_opt(1_767_312_000_456).unwrap()
    );
    assert_eq!(
        m.next_attempt_at,
        Some(Utc.timestamp_millis_opt(1_767_225_601_000).unwrap())
    );
    assert_eq!(m.last_error.as_deref(), Some(awkward));
    assert_eq!(
        m.outcome,
        Some(json!({ "note": awkward, "n": [1, 2.5, null] }))
    );
}

/// Values a decodable row cannot hold (text in `attempts`, an escaped character in a time, a
/// BLOB) still make precise poison rows on SQLite, and do not block the rows behind them.
#[tokio::test]
async fn sqlite_unusual_poison_rows_are_reported_exactly() {
    let db = sqlite().await;
    let repo = db.repo();
    for (id, attempts, created_at) in [
        ("poison-attempts", "'many'", "'2026-01-01T00:00:00.000Z'"),
        ("poison-time", "0", "'2026-01-01T00:00:00.001Z\"'"),
        ("poison-negative", "-1", "'2026-01-01T00:00:00.002Z'"),
        // A BLOB: SQLite's JSON functions reject it outright.
        (
            "poison-blob",
            "0",
            "CAST('2026-01-01T00:00:00.003Z' AS BLOB)",
        ),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, \
             created_at, updated_at) VALUES ('{id}', 'event.publish', 'A.B', 'events.v1.A.B', '{{}}', \
             '{{}}', 'pending', {attempts}, {created_at}, '2026-01-01T00:00:00.000Z')"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let good = records(2);
    db.enqueue(&good).await;

    let claim = repo.claim_due(10, LEASE, None).await.unwrap();
    let ids: Vec<&str> = claim.messages.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, [good[0].id.as_str(), good[1].id.as_str()]);
    let reason = |id: &str| {
        claim
            .poisoned
            .iter()
            .find(|p| p.id == id)
            .unwrap_or_else(|| panic!("{id} is not poisoned: {:?}", claim.poisoned))
            .reason
            .clone()
    };
    assert_eq!(claim.poisoned.len(), 4);
    assert!(reason("poison-attempts").contains("attempts"));
    assert!(reason("poison-time").contains("created_at"));
    assert!(reason("poison-negative").contains("attempts"));
    assert!(reason("poison-negative").contains("out of range"));
    assert!(reason("poison-blob").contains("created_at"));
    for poison in &claim.poisoned {
        assert!(
            repo.mark_failure(&claim, Failure::dead(&poison.id, &poison.reason, false))
                .await
                .unwrap()
        );
    }
    assert_eq!(db.row("poison-time").await.0, "dead");
}

/// The claim's batch size is part of its SQL on SQLite: changing it between claims works.
#[tokio::test]
async fn sqlite_claims_with_varying_batch_sizes() {
    let db = sqlite().await;
    let repo = db.repo();
    let rec = records(6);
    db.enqueue(&rec).await;
    let mut seen = Vec::new();
    let mut cutoff = None;
    for limit in [1, 2, 1, 5, 5] {
        let claim = repo.claim_due(limit, LEASE, cutoff).await.unwrap();
        assert!(claim.len() <= limit);
        cutoff = Some(claim.cutoff);
        seen.extend(claim.messages.into_iter().map(|m| m.id));
    }
    let expected: Vec<String> = rec.into_iter().map(|r| r.id).collect();
    assert_eq!(seen, expected);
}

/// Issue #10 defect 10: Postgres SQLSTATE 42501 (insufficient privilege) was read as an
/// SQLite code (42501 & 0xff = 5, BUSY) and called retryable.
#[tokio::test]
async fn postgres_permission_error_is_not_retryable() {
    let db = pg().await;
    let role = format!("{}_noperm", db.name);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE ROLE {role} NOLOGIN")))
        .execute(&db.pool)
        .await
        .unwrap();
    // One connection, switched to the role that may not touch the outbox.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options.clone())
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SET ROLE {role}")))
        .execute(&pool)
        .await
        .unwrap();
    let err = PgOutboxRepository::new(pool.clone())
        .claim_due(10, LEASE, None)
        .await
        .unwrap_err();
    pool.close().await;
    let code = match &err {
        trellis_outbox::Error::Repository {
            source: sqlx::Error::Database(db_err),
            ..
        } => db_err.code().map(|c| c.into_owned()),
        other => panic!("expected a database error, got {other:?}"),
    };
    assert_eq!(code.as_deref(), Some("42501"));
    assert!(!err.is_retryable(), "{err:?}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP ROLE {role}")))
        .execute(&db.pool)
        .await
        .unwrap();
    db.close().await;
}

/// A real SQLite BUSY (another connection holds the write lock, no busy timeout) is
/// retryable.
#[tokio::test]
async fn sqlite_busy_is_retryable() {
    let db = sqlite().await;
    db.enqueue(&records(1)).await;
    let mut blocker = db.pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    sqlx::query("UPDATE trellis_outbox SET attempts = attempts")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let impatient = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            sqlx::sqlite::SqliteConnectOptions::new()
                .filename(&db.path)
                .busy_timeout(Duration::ZERO),
        )
        .await
        .unwrap();
    let err = SqliteOutboxRepository::new(impatient)
        .claim_due(10, LEASE, None)
        .await
        .unwrap_err();
    blocker.rollback().await.unwrap();
    let code = match &err {
        trellis_outbox::Error::Repository {
            source: sqlx::Error::Database(db_err),
            ..
        } => db_err.code().map(|c| c.into_owned()),
        other => panic!("expected a database error, got {other:?}"),
    };
    assert_eq!(
        code.as_deref().map(|c| c.parse::<i32>().unwrap() & 0xff),
        Some(5)
    );
    assert!(err.is_retryable(), "{err:?}");
}
