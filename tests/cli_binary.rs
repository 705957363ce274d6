//! The `trellis-outbox` tool end to end, through the built binary, against SQLite, Postgres
//! and NATS (issue #14): migrate, status (text and `--json`), list, inspect, retry, bulk
//! retry, purge, relay until SIGTERM, and the error paths (one line, non-zero exit, no
//! panic).

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use trellis_outbox::{OutboxTransactionExt, PreparedOutboxRecord, migrate};
use trellis_outbox_tests::crash::ChildGuard;
use trellis_outbox_tests::nats::{TestStream, jetstream};
use trellis_outbox_tests::{TestPg, TestSqlite, nats_url};

const BIN: &str = env!("CARGO_BIN_EXE_trellis-outbox-cli");

/// Runs the tool with `args`, the database `url`, and NATS at `nats`.
fn tool(url: &str, nats: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("DATABASE_URL", url)
        .env("NATS_URL", nats)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap()
}

fn ok(output: &Output) -> String {
    assert!(
        output.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout.clone()).unwrap()
}

/// The one error line of a failed run, after checking the exit code and that nothing
/// panicked.
fn failed(output: &Output, code: i32) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(code), "stderr: {stderr}");
    assert!(
        !stderr.contains("panicked") && !stderr.contains("backtrace"),
        "{stderr}"
    );
    stderr
}

/// The relay on `url`, printing progress every `every`; killed by the guard if the test fails
/// before [`stop_relay`].
fn spawn_relay(url: &str, every: &str) -> ChildGuard {
    ChildGuard::new(
        Command::new(BIN)
            .args(["relay", "--progress-every", every])
            .env("DATABASE_URL", url)
            .env("NATS_URL", nats_url())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

/// Sends the relay SIGTERM, checks that it exits 0, and returns its stdout.
async fn stop_relay(relay: ChildGuard) -> String {
    let status = Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let output = tokio::task::spawn_blocking(move || relay.into_inner().wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert_eq!(
        output.status.code(),
        Some(0),
        "stdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

fn record(name: &str, subject: String) -> PreparedOutboxRecord {
    PreparedOutboxRecord::event(name, subject, &json!({"n": 1})).unwrap()
}

#[tokio::test]
async fn sqlite_migrate_status_list_inspect_retry_purge() {
    let db = TestSqlite::new().await;
    let url = db.url();
    let nats = nats_url();

    let migrated = ok(&tool(&url, &nats, &["migrate"]));
    assert!(
        migrated.contains("applied trellis_sql_outbox_inbox_sqlite_v1"),
        "{migrated}"
    );
    assert!(ok(&tool(&url, &nats, &["migrate"])).contains("0 applied, 9 already applied"));

    let empty: Value =
        serde_json::from_str(&ok(&tool(&url, &nats, &["status", "--json"]))).unwrap();
    assert_eq!(
        empty,
        json!({
            "counts": {"pending": 0, "claimed": 0, "failed": 0, "dispatched": 0, "dead": 0},
            "undispatched": 0,
            "oldest_undispatched": null,
            "blocked_keys": [],
            "blocked_keys_total": 0,
        })
    );

    // A busy outbox: three pending rows, two of them then dead, one dispatched long ago.
    let records: Vec<_> = (0..4)
        .map(|n| {
            record(
                if n == 0 {
                    "Orders.Shipped"
                } else {
                    "Orders.Placed"
                },
                format!("events.v1.orders.{n}"),
            )
        })
        .collect();
    let mut tx = db.pool.begin().await.unwrap();
    tx.enqueue_all(&records).await.unwrap();
    tx.commit().await.unwrap();
    let id = |n: usize| records[n].id.clone();
    sqlx::query(
        "UPDATE trellis_outbox SET state = 'dead', last_error = 'too large' WHERE id IN (?, ?)",
    )
    .bind(id(0))
    .bind(id(1))
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("UPDATE trellis_outbox SET state = 'dispatched', updated_at = '2020-01-01T00:00:00.000Z' WHERE id = ?")
        .bind(id(3))
        .execute(&db.pool)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;

    let status: Value =
        serde_json::from_str(&ok(&tool(&url, &nats, &["status", "--json"]))).unwrap();
    assert_eq!(
        status["counts"],
        json!({"dead": 2, "dispatched": 1, "pending": 1, "claimed": 0, "failed": 0})
    );
    assert!(
        status["oldest_undispatched"].as_f64().unwrap() > 0.0,
        "{status}"
    );
    let text = ok(&tool(&url, &nats, &["status"]));
    assert!(
        text.contains("undispatched 1") && text.contains("dead       2"),
        "{text}"
    );

    let dead = ok(&tool(&url, &nats, &["list", "--state", "dead"]));
    assert!(
        dead.contains(&id(0)) && dead.contains(&id(1)) && dead.contains("error=too large"),
        "{dead}"
    );
    let shipped: Value = serde_json::from_str(&ok(&tool(
        &url,
        &nats,
        &[
            "list",
            "--state",
            "dead",
            "--name",
            "Orders.Shipped",
            "--json",
        ],
    )))
    .unwrap();
    assert_eq!(shipped.as_array().unwrap().len(), 1);
    assert_eq!(shipped[0]["id"], json!(id(0)));

    let inspected: Value =
        serde_json::from_str(&ok(&tool(&url, &nats, &["inspect", &id(2)]))).unwrap();
    assert_eq!(
        (inspected["id"].clone(), inspected["state"].clone()),
        (json!(id(2)), json!("pending"))
    );
    let unknown = failed(&tool(&url, &nats, &["inspect", "no-such-id"]), 1);
    assert_eq!(
        unknown.trim(),
        "error: no outbox row with id \"no-such-id\""
    );

    assert!(ok(&tool(&url, &nats, &["retry", &id(0)])).contains("retried"));
    let refused = failed(&tool(&url, &nats, &["retry", &id(2)]), 1);
    assert!(
        refused.contains("not retried") && refused.contains("pending"),
        "{refused}"
    );
    assert_eq!(
        ok(&tool(
            &url,
            &nats,
            &["retry", "--all-dead", "--name", "Orders.Placed"]
        ))
        .trim(),
        "retried 1 dead rows"
    );
    let after: Value =
        serde_json::from_str(&ok(&tool(&url, &nats, &["status", "--json"]))).unwrap();
    assert_eq!(
        after["counts"],
        json!({"dispatched": 1, "pending": 3, "claimed": 0, "failed": 0, "dead": 0})
    );

    let purged = ok(&tool(
        &url,
        &nats,
        &[
            "purge",
            "--dispatched-older-than",
            "7d",
            "--inbox-older-than",
            "30d",
        ],
    ));
    assert!(
        purged.contains("deleted 1 dispatched rows") && purged.contains("deleted 0 inbox rows"),
        "{purged}"
    );
}

#[tokio::test]
async fn errors_are_one_line_and_a_non_zero_exit() {
    let nats = nats_url();
    let no_db = Command::new(BIN)
        .arg("status")
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert!(failed(&no_db, 1).contains("no database: pass --database-url"));
    let unreachable = failed(
        &tool("postgres://postgres@127.0.0.1:1/test", &nats, &["status"]),
        1,
    );
    assert!(
        unreachable.starts_with(
            "error: cannot connect to the database at postgres://postgres@127.0.0.1:1/test"
        ),
        "{unreachable}"
    );
    assert_eq!(unreachable.trim().lines().count(), 1, "{unreachable}");
    let secret = failed(
        &tool("postgres://u:hunter2@127.0.0.1:1/test", &nats, &["status"]),
        1,
    );
    assert!(!secret.contains("hunter2"), "{secret}");
    let scheme = failed(&tool("mysql://localhost/db", &nats, &["status"]), 1);
    assert!(scheme.contains("unsupported --database-url"), "{scheme}");
    let bad_flag = failed(&tool("sqlite::memory:", &nats, &["status", "--jsn"]), 2);
    assert!(bad_flag.contains("--jsn"), "{bad_flag}");
    let bad_duration = failed(
        &tool(
            "sqlite::memory:",
            &nats,
            &["purge", "--dispatched-older-than", "a week"],
        ),
        2,
    );
    assert!(bad_duration.contains("7d"), "{bad_duration}");
    let help = ok(&tool("sqlite::memory:", &nats, &["retry", "--help"]));
    assert!(
        help.contains("Example") && help.contains("--all-dead"),
        "{help}"
    );

    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    let no_nats = failed(&tool(&db.url(), "nats://127.0.0.1:1", &["relay"]), 1);
    assert!(
        no_nats.contains("cannot reach NATS at nats://127.0.0.1:1"),
        "{no_nats}"
    );
    // Secrets are masked: a NATS password and token, a `password=` parameter, and
    // environment values in `--help`.
    for nats in ["nats://u:hunter2@127.0.0.1:1", "nats://hunter2@127.0.0.1:1"] {
        let masked = failed(&tool(&db.url(), nats, &["relay"]), 1);
        assert!(
            masked.contains("@127.0.0.1:1") && !masked.contains("hunter2"),
            "{masked}"
        );
    }
    let pg_password = failed(
        &tool(
            "postgres://u@127.0.0.1:1/db?password=hunter2",
            &nats,
            &["status"],
        ),
        1,
    );
    assert!(
        pg_password.contains("password=***") && !pg_password.contains("hunter2"),
        "{pg_password}"
    );
    let help = ok(&tool(
        "postgres://u:hunter2@h/db",
        "nats://u:hunter2@h",
        &["--help"],
    ));
    assert!(!help.contains("hunter2"), "{help}");
    // The command's own text, not its Rust documentation (an example for embedders).
    assert!(
        help.starts_with("See and repair a trellis-outbox outbox")
            && !help.contains("```")
            && !help.contains("Parsed by clap"),
        "{help}"
    );
}

/// A `--progress-every` near `u64::MAX` seconds (which humantime accepts; an audit read
/// tokio's interval as overflowing on it) is capped at a day: the relay runs and stops as
/// usual, on SQLite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_relay_with_an_endless_progress_period_runs_and_stops() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    let relay = spawn_relay(&db.url(), "9300000000000000000s");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stdout = stop_relay(relay).await;
    assert!(stdout.trim_end().ends_with("stopped"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_relay_runs_until_sigterm_and_leaves_nothing_claimed() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let js = jetstream().await;
    let stream = TestStream::events(&js).await;
    let records: Vec<_> = (0..50)
        .map(|n| record("Orders.Placed", stream.subject(&format!("o{n}"))))
        .collect();
    let mut tx = db.pool.begin().await.unwrap();
    tx.enqueue_all(&records).await.unwrap();
    tx.commit().await.unwrap();
    let url = db.url();

    let busy: Value =
        serde_json::from_str(&ok(&tool(&url, &nats_url(), &["status", "--json"]))).unwrap();
    assert_eq!(
        busy["counts"],
        json!({"pending": 50, "claimed": 0, "failed": 0, "dispatched": 0, "dead": 0})
    );

    let relay = spawn_relay(&url, "200ms");
    let started = Instant::now();
    loop {
        let dispatched: i64 =
            sqlx::query_scalar("SELECT count(*) FROM trellis_outbox WHERE state = 'dispatched'")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        if dispatched == 50 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the relay dispatched {dispatched} of 50"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A row enqueued while it runs is woken by LISTEN/NOTIFY and dispatched too.
    let late = record("Orders.Placed", stream.subject("late"));
    let mut tx = db.pool.begin().await.unwrap();
    tx.enqueue(&late).await.unwrap();
    tx.commit().await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;

    let stdout = stop_relay(relay).await;
    // The progress line counts what this relay published, not the table's dispatched rows.
    assert!(
        stdout.lines().any(|line| line
            .starts_with("dispatched +51 since start  failed 0  dead 0  undispatched 0  lag none")),
        "{stdout}"
    );
    assert!(stdout.trim_end().ends_with("stopped"), "{stdout}");
    let (dispatched, claimed): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state = 'dispatched'), count(*) FILTER (WHERE claim_token IS NOT NULL) FROM trellis_outbox",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (dispatched, claimed),
        (51, 0),
        "everything dispatched, nothing left claimed"
    );
    assert_eq!(stream.count().await, 51);
    stream.delete().await;
    db.close().await;
}
