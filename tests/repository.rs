//! The SQL repositories on real Postgres and SQLite: claim order, leases, fencing tokens,
//! retry timing, poison rows, release and operator retry.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::time::Duration;

use serde_json::json;
use trellis_outbox::{
    Dispatched, Failure, OutboxRepository, OutboxTransactionExt, PgOutboxRepository,
    PreparedOutboxRecord, SqliteOutboxRepository, migrate,
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
            .mark_failed(&stale, id, "late", Duration::from_secs(1))
            .await
            .unwrap()
    );
    assert!(!repo.mark_dead(&stale, id, "late", true).await.unwrap());
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
        repo.mark_failed(
            &claim,
            id,
            "nats: timed out: no ack within 5s",
            Duration::from_millis(500)
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
        due_in > Duration::from_millis(200) && due_in <= Duration::from_millis(500),
        "{due_in:?}"
    );
    assert!(repo.claim_due(10, LEASE, None).await.unwrap().is_empty());

    tokio::time::sleep(Duration::from_millis(600)).await;
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
        repo.mark_failed(&first, &rec[0].id, "boom", Duration::from_millis(1))
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
            repo.mark_dead(&claim, &poison.id, &poison.reason, false)
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
    assert!(repo.retry("poison-kind").await.unwrap());
    assert_eq!(db.row("poison-kind").await.0, "pending");
    assert!(
        !repo.retry("poison-kind").await.unwrap(),
        "only failed or dead rows"
    );
    assert!(!repo.retry("no-such-row").await.unwrap());
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

/// A claim on SQLite returns most columns packed into one JSON value: every column must come
/// back exactly, whatever characters it holds.
#[tokio::test]
async fn sqlite_claim_reads_every_column_exactly() {
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
    // A header value may hold anything but CR/LF (a row with one is poison: it cannot be
    // sent to NATS).
    .bind(serde_json::to_string(&json!({ "X-Odd": awkward.replace('\n', " ") })).unwrap())
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
    assert_eq!(m.headers["X-Odd"], awkward.replace('\n', " "));
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
            repo.mark_dead(&claim, &poison.id, &poison.reason, false)
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
