//! Issue #10 defect 9: rows no dispatcher could ever finish (a SQLite row with a NULL id, a
//! row in an unknown state, a row never due) end `dead` with a reason, `on_error` hears of
//! each once, and schema version 3 refuses new ones. Rows are written by SQL, as another
//! writer (an operator, the TypeScript service, an older version) would.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::sync::{Arc, Mutex};
use std::time::Duration;

use trellis_outbox::{
    Dialect, DispatchError, OutboxDispatcher, OutboxRepository, OutboxTables, PgOutboxRepository,
    SqliteOutboxRepository, migrate, migrations,
};
use trellis_outbox_tests::publisher::RecordingPublisher;
use trellis_outbox_tests::{TestPg, TestSqlite};

const TS: &str = "2026-05-25T00:00:00.000Z";

/// Runs a dispatcher until `id` is published; returns what `on_error` heard, as
/// `(id, reason)` for poisoned rows and the message for anything else.
async fn dispatch_until_published(
    repo: impl OutboxRepository,
    id: &str,
) -> Vec<Result<(String, String), String>> {
    let heard = Arc::new(Mutex::new(Vec::new()));
    let sink = heard.clone();
    let publisher = RecordingPublisher::new();
    let dispatcher = OutboxDispatcher::builder(repo, publisher.clone())
        .idle_interval(Duration::from_millis(50))
        .on_error(move |error| {
            sink.lock().unwrap().push(match error {
                DispatchError::Poisoned { id, reason } => Ok((id.clone(), reason.clone())),
                other => Err(other.to_string()),
            });
        })
        .start()
        .unwrap();
    let published = publisher
        .wait_until(Duration::from_secs(20), |p| {
            p.successes().iter().any(|s| s == id)
        })
        .await;
    dispatcher.shutdown().await;
    assert!(published, "{id} was not published");
    Arc::try_unwrap(heard).unwrap().into_inner().unwrap()
}

fn poisoned(mut heard: Vec<Result<(String, String), String>>) -> Vec<(String, String)> {
    heard.sort();
    heard
        .into_iter()
        .map(|h| h.unwrap_or_else(|e| panic!("unexpected error: {e}")))
        .collect()
}

#[tokio::test]
async fn sqlite_null_ids_and_unknown_states_go_dead_and_are_reported_once() {
    let db = TestSqlite::new().await;
    // A table at upstream's version 1 (the TypeScript service's), holding rows no claim
    // could finish.
    for statement in &migrations(Dialect::Sqlite, &OutboxTables::default())[0].up {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement.clone()))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let insert = "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, \
                  attempts, created_at, updated_at, next_attempt_at) \
                  VALUES (?, 'event.publish', 'A.B', 'events.v1.A.B', '{}', '{}', ?, 0, ?, ?, ?)";
    for (id, state, next) in [
        (None, "pending", None),
        (Some("frozen-1"), "frozen", None),
        (Some("claimed-1"), "claimed", None),
        (Some("someday-1"), "failed", Some("someday")),
        (Some("claimed-soon"), "claimed", Some("soon")),
        (Some("good-1"), "pending", None),
    ] {
        sqlx::query(insert)
            .bind(id)
            .bind(state)
            .bind(TS)
            .bind(TS)
            .bind(next)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let null_rowid: i64 = sqlx::query_scalar("SELECT rowid FROM trellis_outbox WHERE id IS NULL")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let report = migrate(&db.pool).await.unwrap();
    assert_eq!(report.applied.len(), 9, "{report:?}");

    let repo = SqliteOutboxRepository::new(db.pool.clone());
    let heard = poisoned(dispatch_until_published(repo.clone(), "good-1").await);
    assert_eq!(
        heard,
        [
            (
                String::new(),
                format!("id is NULL (SQLite rowid {null_rowid})")
            ),
            // Left `claimed` by another writer with a time that never comes.
            (
                "claimed-soon".into(),
                "next_attempt_at is not a time: 'soon'".into()
            ),
            ("frozen-1".into(), "unknown state \"frozen\"".into()),
            (
                "someday-1".into(),
                "next_attempt_at is not a time: 'someday'".into()
            ),
        ]
    );
    let rows: Vec<(Option<String>, String, Option<String>)> =
        sqlx::query_as("SELECT id, state, last_error FROM trellis_outbox ORDER BY rowid")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        [
            (
                None,
                "dead".into(),
                Some(format!("id is NULL (SQLite rowid {null_rowid})"))
            ),
            (
                Some("frozen-1".into()),
                "dead".into(),
                Some("unknown state \"frozen\"".into())
            ),
            // Not swept: an upstream claim without an end is due, and adopted by the claim.
            (Some("claimed-1".into()), "dispatched".into(), None),
            (
                Some("someday-1".into()),
                "dead".into(),
                Some("next_attempt_at is not a time: 'someday'".into())
            ),
            (
                Some("claimed-soon".into()),
                "dead".into(),
                Some("next_attempt_at is not a time: 'soon'".into())
            ),
            (Some("good-1".into()), "dispatched".into(), None),
        ]
    );

    // A second start does not hear of them again.
    sqlx::query(insert)
        .bind("good-2")
        .bind("pending")
        .bind(TS)
        .bind(TS)
        .bind(None::<&str>)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(dispatch_until_published(repo, "good-2").await, []);

    // Version 3 refuses such rows, with the reason.
    for (id, state, expected) in [
        (None, "pending", "trellis_outbox.id must not be NULL"),
        (
            Some("frozen-2"),
            "frozen",
            "trellis_outbox.state must be one of pending, claimed, dispatched, failed, dead",
        ),
    ] {
        let err = sqlx::query(insert)
            .bind(id)
            .bind(state)
            .bind(TS)
            .bind(TS)
            .bind(None::<&str>)
            .execute(&db.pool)
            .await
            .unwrap_err();
        assert!(err.to_string().contains(expected), "{err}");
    }
    let err = sqlx::query("UPDATE trellis_outbox SET state = 'thawed' WHERE id = 'good-1'")
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("trellis_outbox.state must be one of"),
        "{err}"
    );
    let err = sqlx::query("UPDATE trellis_outbox SET state = 'pending' WHERE id IS NULL")
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("trellis_outbox.id must not be NULL"),
        "{err}"
    );
    // Upstream's `claimed` is a known state; a NULL-id row can be given an id.
    sqlx::query(insert)
        .bind("claimed-2")
        .bind("claimed")
        .bind(TS)
        .bind(TS)
        .bind(None::<&str>)
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE trellis_outbox SET id = 'fixed-1', state = 'pending' WHERE id IS NULL")
        .execute(&db.pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn postgres_unknown_states_go_dead_and_are_reported_once() {
    let db = TestPg::new().await;
    for statement in &migrations(Dialect::Postgres, &OutboxTables::default())[0].up {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement.clone()))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let insert = "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, \
                  attempts, created_at, updated_at, next_attempt_at) \
                  VALUES ($1, 'event.publish', 'A.B', 'events.v1.A.B', '{}', '{}', $2, 0, $3::timestamptz, $3::timestamptz, $4::timestamptz)";
    for (id, state, next) in [
        ("frozen-1", "frozen", None),
        ("claimed-1", "claimed", None),
        ("never-1", "pending", Some("infinity")),
        ("claimed-never", "claimed", Some("infinity")),
        ("good-1", "pending", None),
    ] {
        sqlx::query(insert)
            .bind(id)
            .bind(state)
            .bind(TS)
            .bind(next)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let report = migrate(&db.pool).await.unwrap();
    assert_eq!(report.applied.len(), 9, "{report:?}");

    let repo = PgOutboxRepository::new(db.pool.clone());
    let heard = poisoned(dispatch_until_published(repo.clone(), "good-1").await);
    assert_eq!(
        heard,
        [
            // Left `claimed` by another writer, never due.
            (
                "claimed-never".into(),
                "next_attempt_at is infinity (never due)".into()
            ),
            ("frozen-1".into(), "unknown state \"frozen\"".into()),
            (
                "never-1".into(),
                "next_attempt_at is infinity (never due)".into()
            ),
        ]
    );
    let rows: Vec<(String, String, Option<String>)> =
        sqlx::query_as("SELECT id, state, last_error FROM trellis_outbox ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        [
            // Not swept: an upstream claim without an end is due, and adopted by the claim.
            ("claimed-1".into(), "dispatched".into(), None),
            (
                "claimed-never".into(),
                "dead".into(),
                Some("next_attempt_at is infinity (never due)".into())
            ),
            (
                "frozen-1".into(),
                "dead".into(),
                Some("unknown state \"frozen\"".into())
            ),
            ("good-1".into(), "dispatched".into(), None),
            (
                "never-1".into(),
                "dead".into(),
                Some("next_attempt_at is infinity (never due)".into())
            ),
        ]
    );

    sqlx::query(insert)
        .bind("good-2")
        .bind("pending")
        .bind(TS)
        .bind(None::<&str>)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(dispatch_until_published(repo, "good-2").await, []);

    let err = sqlx::query(insert)
        .bind("frozen-2")
        .bind("frozen")
        .bind(TS)
        .bind(None::<&str>)
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("violates check constraint \"trellis_outbox_state_ck\""),
        "{err}"
    );
    sqlx::query(insert)
        .bind("claimed-2")
        .bind("claimed")
        .bind(TS)
        .bind(None::<&str>)
        .execute(&db.pool)
        .await
        .unwrap();
    // (An upstream claim without an end is due now; out of the way of the check below.)
    sqlx::query("UPDATE trellis_outbox SET state = 'dispatched' WHERE id = 'claimed-2'")
        .execute(&db.pool)
        .await
        .unwrap();

    // A row never due, written while dispatchers run, does not fail every `next_due_in`
    // ("cannot subtract infinite timestamps"): it is due in the far future.
    sqlx::query(insert)
        .bind("never-2")
        .bind("failed")
        .bind(TS)
        .bind(Some("infinity"))
        .execute(&db.pool)
        .await
        .unwrap();
    let repo = PgOutboxRepository::new(db.pool.clone());
    let due_in = repo.next_due_in().await.unwrap().unwrap();
    assert!(
        due_in > Duration::from_secs(50 * 365 * 86_400),
        "{due_in:?}"
    );
    db.close().await;
}
