//! The `trellis-outbox` command-line tool.

use serde_json::{Value, json};
use trellis_outbox::{OutboxTransactionExt, PreparedOutboxRecord, migrate};
use trellis_outbox_tests::{TestPg, TestSqlite};

fn run(args: &[&str]) -> Result<String, String> {
    let mut out = Vec::new();
    let argv = std::iter::once("trellis-outbox").chain(args.iter().copied());
    trellis_outbox::cli::run(argv, &mut out).map_err(|e| e.to_string())?;
    Ok(String::from_utf8(out).expect("utf-8 output"))
}

/// [`run`] on the database at `url`, off the test's runtime (the tool starts its own).
async fn run_on(url: &str, args: &[&str]) -> Result<String, String> {
    let argv: Vec<String> = ["--database-url", url]
        .iter()
        .chain(args)
        .map(|arg| (*arg).to_owned())
        .collect();
    tokio::task::spawn_blocking(move || run(&argv.iter().map(String::as_str).collect::<Vec<_>>()))
        .await
        .unwrap()
}

/// An event record of `Orders.Placed` on `events.v1.orders.<n>`.
fn placed(n: usize) -> PreparedOutboxRecord {
    PreparedOutboxRecord::event(
        "Orders.Placed",
        format!("events.v1.orders.{n}"),
        &json!({"n": n}),
    )
    .unwrap()
}

/// Enqueues `records` in one transaction.
async fn enqueue<DB: trellis_outbox::OutboxDatabase>(
    pool: &sqlx::Pool<DB>,
    records: &[PreparedOutboxRecord],
) {
    let mut tx = pool.begin().await.unwrap();
    tx.enqueue_all(records).await.unwrap();
    tx.commit().await.unwrap();
}

#[test]
fn prints_pasteable_migrations() {
    let sql = run(&["sql", "--dialect", "postgres"]).unwrap();
    assert!(sql.starts_with(
        "-- trellis_sql_outbox_inbox_postgres_v1 (up), version 1, fnv1a64:475148d1080cf8cf\n"
    ));
    assert!(sql.contains("CREATE TABLE IF NOT EXISTS trellis_outbox (id text PRIMARY KEY,"));
    assert!(
        sql.lines()
            .skip(1)
            .all(|l| l.is_empty() || l.starts_with("--") || l.ends_with(';'))
    );
}

#[test]
fn honours_custom_tables_and_down() {
    let sql = run(&[
        "sql",
        "--dialect",
        "sqlite",
        "--outbox-table",
        "service_outbox",
        "--inbox-table",
        "service_inbox",
        "--down",
    ])
    .unwrap();
    assert!(sql.contains("DROP TABLE IF EXISTS service_outbox;"));
    assert!(sql.contains(
        "-- trellis_sql_outbox_inbox_sqlite_v1 (down), version 1, fnv1a64:d10ccc8ff04a835d\n"
    ));
    let one = run(&["sql", "--dialect", "sqlite", "--down", "--version", "1"]).unwrap();
    assert!(one.starts_with("-- trellis_sql_outbox_inbox_sqlite_v1 (down)"));
    assert!(!one.contains("_v2"));
}

/// The versions' headers in the order printed.
fn versions(sql: &str) -> Vec<u32> {
    sql.lines()
        .filter_map(|l| l.split(", version ").nth(1))
        .map(|rest| rest.split(',').next().unwrap().parse().unwrap())
        .collect()
}

// Issue #10 defect 11: `sql --down` printed v1's DROP TABLE before v2's ALTERs, so the
// script failed. Down scripts run newest version first; up scripts oldest first.
#[test]
fn down_scripts_are_printed_newest_first() {
    for dialect in ["postgres", "sqlite"] {
        let up = run(&["sql", "--dialect", dialect]).unwrap();
        let down = run(&["sql", "--dialect", dialect, "--down"]).unwrap();
        assert_eq!(versions(&up), [1, 2, 3, 4, 5, 6, 7, 8, 9], "{dialect}");
        assert_eq!(versions(&down), [9, 8, 7, 6, 5, 4, 3, 2, 1], "{dialect}");
    }
}

async fn pg_relation_count(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_class WHERE relname IN ('trellis_outbox', 'trellis_inbox')",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn sqlite_schema_count(pool: &sqlx::SqlitePool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM sqlite_master WHERE name LIKE 'trellis\\_%' ESCAPE '\\' AND name <> 'trellis_outbox_migrations'")
        .fetch_one(pool)
        .await
        .unwrap()
}

// The printed scripts run as printed: up creates the tables, down removes them again.
#[tokio::test]
async fn printed_down_script_reverts_a_migrated_postgres_database() {
    let db = TestPg::new().await;
    trellis_outbox::migrate(&db.pool).await.unwrap();
    assert_eq!(pg_relation_count(&db.pool).await, 2);
    let down = run(&["sql", "--dialect", "postgres", "--down"]).unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(down))
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(pg_relation_count(&db.pool).await, 0);
    let up = run(&["sql", "--dialect", "postgres"]).unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(up))
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(pg_relation_count(&db.pool).await, 2);
    db.close().await;
}

#[tokio::test]
async fn printed_down_script_reverts_a_migrated_sqlite_database() {
    let db = TestSqlite::new().await;
    trellis_outbox::migrate(&db.pool).await.unwrap();
    // Tables, indexes and (v3) triggers.
    assert!(sqlite_schema_count(&db.pool).await >= 6);
    let down = run(&["sql", "--dialect", "sqlite", "--down"]).unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(down))
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(sqlite_schema_count(&db.pool).await, 0);
    let up = run(&["sql", "--dialect", "sqlite"]).unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(up))
        .execute(&db.pool)
        .await
        .unwrap();
    assert!(sqlite_schema_count(&db.pool).await >= 6);
}

#[test]
fn rejects_bad_input_with_a_clear_message() {
    let err = run(&[
        "sql",
        "--dialect",
        "sqlite",
        "--outbox-table",
        "x;drop table y",
    ])
    .unwrap_err();
    assert!(
        err.contains("Invalid SQL outbox table name \"x;drop table y\""),
        "{err}"
    );
    let err = run(&["sql", "--dialect", "oracle"]).unwrap_err();
    assert!(err.contains("invalid value 'oracle'"), "{err}");
    // The version as a number, and the versions there are (not `Some(99)`).
    let err = run(&["sql", "--dialect", "sqlite", "--version", "99"]).unwrap_err();
    assert_eq!(
        err, "no migration version 99; known versions: 1, 2, 3, 4, 5, 6, 7, 8, 9",
        "{err}"
    );
}

// Arguments are checked before the tool connects: a bad `--batch` with a database that cannot
// be reached is the argument error, not a connection error.
#[test]
fn purge_batch_is_checked_before_connecting() {
    for batch in ["0", "100001"] {
        let err = run(&[
            "--database-url",
            "postgres://postgres@127.0.0.1:1/unreachable",
            "purge",
            "--dispatched-older-than",
            "7d",
            "--batch",
            batch,
        ])
        .unwrap_err();
        assert!(
            err.contains("--batch") && err.contains("1..=100000") && !err.contains("connect"),
            "{err}"
        );
    }
}

// Audit: `list` and `inspect` showed neither a row's lease nor its ordering key. Both show
// `claim_token`, `claimed_until` and `ordering_key`, in text and JSON, on both databases.
async fn list_and_inspect_show_leases_and_ordering_keys(url: &str, lease: &str) {
    let list = run_on(url, &["list", "--state", "pending"]).await.unwrap();
    let lines: Vec<&str> = list.lines().collect();
    assert_eq!(lines.len(), 2, "{list}");
    assert!(
        lines[0].contains("  ordering_key=order-42")
            && lines[0].contains("  claim_token=token-1  claimed_until=2099-01-02T03:04:05.678Z"),
        "{list}"
    );
    assert!(
        !lines[1].contains("ordering_key=") && !lines[1].contains("claim_token="),
        "{list}"
    );
    let json: Value = serde_json::from_str(
        &run_on(url, &["list", "--state", "pending", "--json"])
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        (
            &json[0]["claim_token"],
            &json[0]["claimed_until"],
            &json[0]["ordering_key"]
        ),
        (&json!("token-1"), &json!(lease), &json!("order-42"))
    );
    assert_eq!(
        (
            &json[1]["claim_token"],
            &json[1]["claimed_until"],
            &json[1]["ordering_key"]
        ),
        (&Value::Null, &Value::Null, &Value::Null)
    );
    let id = json[0]["id"].as_str().unwrap();
    let inspected: Value =
        serde_json::from_str(&run_on(url, &["inspect", id]).await.unwrap()).unwrap();
    assert_eq!(inspected, json[0]);
}

/// Two pending rows: the first keyed `order-42` and leased to `token-1` until 2099.
fn keyed_and_plain() -> [PreparedOutboxRecord; 2] {
    [placed(0).ordered_by("order-42"), placed(1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_list_and_inspect_show_leases_and_ordering_keys() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    let records = keyed_and_plain();
    enqueue(&db.pool, &records).await;
    sqlx::query("UPDATE trellis_outbox SET claim_token = 'token-1', claimed_until = '2099-01-02T03:04:05.678Z' WHERE id = ?")
        .bind(&records[0].id)
        .execute(&db.pool)
        .await
        .unwrap();
    list_and_inspect_show_leases_and_ordering_keys(&db.url(), "2099-01-02T03:04:05.678Z").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_list_and_inspect_show_leases_and_ordering_keys() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let records = keyed_and_plain();
    enqueue(&db.pool, &records).await;
    sqlx::query("UPDATE trellis_outbox SET claim_token = 'token-1', claimed_until = '2099-01-02T03:04:05.678Z' WHERE id = $1")
        .bind(&records[0].id)
        .execute(&db.pool)
        .await
        .unwrap();
    list_and_inspect_show_leases_and_ordering_keys(&db.url(), "2099-01-02T03:04:05.678Z").await;
    db.close().await;
}

// Audit: `list` printed `last_error` as stored, so a newline in it broke the one-row-a-line
// table. Text output escapes control characters (and backslashes); JSON keeps the text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_text_escapes_control_characters_and_json_keeps_them() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    let records = [placed(0), placed(1)];
    enqueue(&db.pool, &records).await;
    let error = "publish failed\ncaused by: timeout\r\t\u{1b}[2K back\\slash";
    sqlx::query("UPDATE trellis_outbox SET state = 'dead', last_error = ?")
        .bind(error)
        .execute(&db.pool)
        .await
        .unwrap();
    let url = db.url();
    let text = run_on(&url, &["list", "--state", "dead"]).await.unwrap();
    assert_eq!(text.lines().count(), 2, "{text}");
    assert!(
        text.lines().all(|line| line.ends_with(
            "  error=publish failed\\ncaused by: timeout\\r\\t\\u{1b}[2K back\\\\slash"
        )),
        "{text}"
    );
    let json: Value = serde_json::from_str(
        &run_on(&url, &["list", "--state", "dead", "--json"])
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(json[0]["last_error"], json!(error));
}

// Audit: `status --json` had no `undispatched` count and left out states without rows. Every
// count is there, 0 when none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_json_has_every_count() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    let url = db.url();
    let empty: Value =
        serde_json::from_str(&run_on(&url, &["status", "--json"]).await.unwrap()).unwrap();
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
    let records = [placed(0), placed(1), placed(2)];
    enqueue(&db.pool, &records).await;
    sqlx::query("UPDATE trellis_outbox SET state = 'failed' WHERE id = ?")
        .bind(&records[0].id)
        .execute(&db.pool)
        .await
        .unwrap();
    let busy: Value =
        serde_json::from_str(&run_on(&url, &["status", "--json"]).await.unwrap()).unwrap();
    assert_eq!(
        busy["counts"],
        json!({"pending": 2, "claimed": 0, "failed": 1, "dispatched": 0, "dead": 0})
    );
    assert_eq!(busy["undispatched"], json!(3));
    let text = run_on(&url, &["status"]).await.unwrap();
    assert!(
        text.contains("dispatched 0") && text.contains("undispatched 3"),
        "{text}"
    );
}

// Audit: `status` showed at most 100 blocked keys and did not say there were more. The text
// says how many more, the JSON gives the total.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_says_how_many_blocked_keys_it_leaves_out() {
    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    // 103 keys, each a dead head with one row waiting behind it.
    let records: Vec<_> = (0..206)
        .map(|n| placed(n).ordered_by(format!("key-{:03}", n / 2)))
        .collect();
    enqueue(&db.pool, &records).await;
    sqlx::query("UPDATE trellis_outbox SET state = 'dead' WHERE ordering_seq = 1")
        .execute(&db.pool)
        .await
        .unwrap();
    let url = db.url();
    let text = run_on(&url, &["status"]).await.unwrap();
    let shown = text
        .lines()
        .filter(|l| l.starts_with("blocked    key "))
        .count();
    assert_eq!(shown, trellis_outbox::BLOCKED_KEYS_SHOWN, "{text}");
    assert!(
        text.contains("blocked    … and 3 more blocked keys (103 in all)"),
        "{text}"
    );
    let json: Value =
        serde_json::from_str(&run_on(&url, &["status", "--json"]).await.unwrap()).unwrap();
    assert_eq!(json["blocked_keys"].as_array().unwrap().len(), 100);
    assert_eq!(json["blocked_keys_total"], json!(103));
}

// Audit: on SQLite the lag was NULL as soon as one undispatched row's `created_at` was text
// that is not a time (another writer's), and a number read as a Julian day gave a lag of
// millennia. Such values are left out of the lag; the status and the backlog gauge still
// report the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_lag_ignores_created_at_values_that_are_not_times() {
    use trellis_outbox::OutboxRepository as _;

    let db = TestSqlite::new().await;
    migrate(&db.pool).await.unwrap();
    let records = [placed(0), placed(1), placed(2), placed(3)];
    enqueue(&db.pool, &records).await;
    for (record, created_at) in records
        .iter()
        .zip([json!(""), json!("yesterday"), json!(12345)])
    {
        let query = sqlx::query("UPDATE trellis_outbox SET created_at = ? WHERE id = ?");
        let query = match created_at {
            Value::Number(n) => query.bind(n.as_i64().unwrap()),
            text => query.bind(text.as_str().unwrap().to_owned()),
        };
        query.bind(&record.id).execute(&db.pool).await.unwrap();
    }
    let status: Value =
        serde_json::from_str(&run_on(&db.url(), &["status", "--json"]).await.unwrap()).unwrap();
    assert_eq!(status["counts"]["pending"], json!(4), "{status}");
    let lag = status["oldest_undispatched"].as_f64();
    assert!(lag.is_some_and(|lag| lag < 3600.0), "{status}");
    let backlog = trellis_outbox::SqliteOutboxRepository::new(db.pool.clone())
        .backlog()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(backlog.undispatched, 4);
    assert!(
        backlog.oldest.is_some_and(|age| age.as_secs() < 3600),
        "{backlog:?}"
    );
}

/// Whether a wake-up arrives on `listener` within `wait`.
async fn woken(listener: &mut sqlx::postgres::PgListener, wait: std::time::Duration) -> bool {
    tokio::time::timeout(wait, listener.recv()).await.is_ok()
}

/// The states of `records`' rows, in order.
async fn states(pool: &sqlx::PgPool, records: &[PreparedOutboxRecord]) -> Vec<String> {
    let mut states = Vec::new();
    for record in records {
        let state: String = sqlx::query_scalar("SELECT state FROM trellis_outbox WHERE id = $1")
            .bind(&record.id)
            .fetch_one(pool)
            .await
            .unwrap();
        states.push(state);
    }
    states
}

// Audit: `retry --all-dead` had neither a limit nor a dry run, and no retry woke the
// dispatchers (an enqueue sends a NOTIFY; a retried row waited for the next poll).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_retry_has_a_limit_and_a_dry_run_and_wakes_dispatchers() {
    use std::time::Duration;

    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    let records: Vec<_> = (0..4).map(placed).collect();
    enqueue(&db.pool, &records).await;
    sqlx::query("UPDATE trellis_outbox SET state = 'dead' WHERE id <> $1")
        .bind(&records[3].id)
        .execute(&db.pool)
        .await
        .unwrap();
    // Listening after the enqueue's commit: only what the tool sends arrives.
    let mut listener = sqlx::postgres::PgListener::connect_with(&db.pool)
        .await
        .unwrap();
    listener.listen("trellis_outbox_wakeup").await.unwrap();
    let url = db.url();

    let dry = run_on(&url, &["retry", "--all-dead", "--dry-run"])
        .await
        .unwrap();
    assert_eq!(dry, "would retry 3 dead rows (dry run: nothing changed)\n");
    let dry = run_on(&url, &["retry", "--all-dead", "--limit", "2", "--dry-run"])
        .await
        .unwrap();
    assert_eq!(dry, "would retry 2 dead rows (dry run: nothing changed)\n");
    assert_eq!(
        states(&db.pool, &records).await,
        ["dead", "dead", "dead", "pending"]
    );
    assert!(
        !woken(&mut listener, Duration::from_millis(300)).await,
        "a dry run woke"
    );

    let retried = run_on(&url, &["retry", "--all-dead", "--limit", "2"])
        .await
        .unwrap();
    assert_eq!(retried, "retried 2 dead rows\n");
    assert_eq!(
        states(&db.pool, &records).await,
        ["pending", "pending", "dead", "pending"],
        "the oldest first"
    );
    assert!(
        woken(&mut listener, Duration::from_secs(5)).await,
        "no wake-up after --all-dead"
    );

    let one = run_on(&url, &["retry", &records[2].id]).await.unwrap();
    assert!(one.contains("retried"), "{one}");
    assert!(
        woken(&mut listener, Duration::from_secs(5)).await,
        "no wake-up after retry <id>"
    );

    // The options of --all-dead are refused with ids (`--name` was silently ignored).
    for option in [
        &["--limit", "2"][..],
        &["--dry-run"],
        &["--name", "Orders.Placed"],
    ] {
        let args: Vec<&str> = ["retry"]
            .iter()
            .chain(option)
            .chain([&*records[0].id].iter())
            .copied()
            .collect();
        let err = run_on(&url, &args).await.unwrap_err();
        assert!(err.contains("cannot be used with"), "{err}");
    }
    // The listener holds a connection of the pool, which `close` waits for.
    drop(listener);
    db.close().await;
}

// Audit: the relay's progress line ran `status()`, a `GROUP BY` over the whole table, every
// period. It now reads `progress()`: only the rows not dispatched, through the index on
// `state`. With 20,000 dispatched rows, its plan reads no table sequentially, and it
// counts what `status()` counts for the other states.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_progress_reads_only_rows_not_dispatched() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::query(
        "INSERT INTO trellis_outbox (id, kind, name, subject, payload, headers, state, attempts, created_at, updated_at) \
         SELECT 'done-' || n, 'event.publish', 'Orders.Placed', 'events.v1.orders.done', '{}', '{}'::jsonb, \
         'dispatched', 0, now(), now() FROM generate_series(1, 20000) AS n",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let records = [placed(0), placed(1), placed(2)];
    enqueue(&db.pool, &records).await;
    sqlx::query("UPDATE trellis_outbox SET state = 'dead' WHERE id = $1")
        .bind(&records[0].id)
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("ANALYZE trellis_outbox")
        .execute(&db.pool)
        .await
        .unwrap();

    let sql = trellis_outbox::Outbox::default()
        .sql(trellis_outbox::Dialect::Postgres)
        .progress()
        .to_owned();
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {sql}")))
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let plan = plan.join("\n");
    assert!(
        !plan.contains("Seq Scan") && plan.contains("trellis_outbox_due_idx"),
        "{plan}"
    );

    let repository = trellis_outbox::PgOutboxRepository::new(db.pool.clone());
    let progress = repository.progress().await.unwrap();
    let status = repository.status().await.unwrap();
    assert_eq!(progress.undispatched(), 2);
    assert_eq!(progress.count("dead"), 1);
    assert!(!progress.counts.contains_key("dispatched"), "{progress:?}");
    assert_eq!(status.count("dispatched"), 20_000);
    assert_eq!(
        progress.oldest_undispatched.is_some(),
        status.oldest_undispatched.is_some()
    );
    db.close().await;
}

// A schema a newer version migrated (after a rollback of the deploy, say): the tool says so
// instead of only "already applied" (the library's warning goes to a logger the tool lacks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_names_migrations_of_a_newer_version() {
    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::query(
        "INSERT INTO trellis_outbox_migrations (outbox_table, version, id, checksum) \
         VALUES ('trellis_outbox', 99, 'trellis_sql_outbox_inbox_postgres_v99', '0')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let out = run_on(&db.url(), &["migrate"]).await.unwrap();
    assert!(
        out.contains("trellis_sql_outbox_inbox_postgres_v99") && out.contains("newer version"),
        "{out}"
    );
    db.close().await;
}

// `migrate --lock-timeout`: behind a long transaction on the outbox table, the tool gives up
// after the timeout with the step and "retry" instead of waiting for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_migrate_gives_up_after_its_lock_timeout() {
    use sqlx::Connection as _;

    let db = TestPg::new().await;
    migrate(&db.pool).await.unwrap();
    sqlx::query("DELETE FROM trellis_outbox_migrations WHERE version = 6")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut holder = sqlx::PgConnection::connect_with(&db.options).await.unwrap();
    sqlx::raw_sql("BEGIN; LOCK TABLE trellis_outbox IN ACCESS SHARE MODE")
        .execute(&mut holder)
        .await
        .unwrap();
    let url = db.url();
    let outcome = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        run_on(&url, &["migrate", "--lock-timeout", "300ms"]),
    )
    .await;
    holder.close().await.unwrap();
    let err = outcome.expect("still waiting after 30 s").unwrap_err();
    assert!(
        err.contains("trellis_sql_outbox_inbox_postgres_v6") && err.contains("retry the migration"),
        "{err}"
    );
    let applied = run_on(&url, &["migrate"]).await.unwrap();
    assert!(
        applied.contains("1 applied, 8 already applied"),
        "{applied}"
    );
    db.close().await;
}

/// `dead-letters` lists a consumer's dead-letter copies (NATS only, no database) and, with
/// `--replay`, hands each to that consumer through the replay stream (every header value
/// kept, the message's id and subject in the copy's headers, nothing published to the
/// message's own subject) and deletes the copy; a copy without an id is left, with the
/// reason.
#[tokio::test]
async fn dead_letters_are_listed_and_replayed() {
    use async_nats::HeaderMap;
    use trellis_outbox::{
        DEAD_LETTER_STREAM, DEAD_LETTER_SUBJECT_PREFIX, REPLAY_STREAM, REPLAY_SUBJECT_PREFIX,
        dead_letter_headers as h,
    };
    use trellis_outbox_tests::nats::{TestStream, jetstream};
    use trellis_outbox_tests::nats_url;

    let js = jetstream().await;
    let target = TestStream::events(&js).await;
    let dlq = js
        .get_or_create_stream(async_nats::jetstream::stream::Config {
            name: DEAD_LETTER_STREAM.into(),
            subjects: vec![format!("{DEAD_LETTER_SUBJECT_PREFIX}.>")],
            ..Default::default()
        })
        .await
        .unwrap();
    let consumer = format!("cli{}", ulid::Ulid::generate().to_string().to_lowercase());
    let copy = |id: Option<&str>| {
        let mut headers = HeaderMap::new();
        headers.insert("Trellis-Event-Time", "2026-12-06T10:00:00.000Z");
        headers.append("X-Tag", "first");
        headers.append("X-Tag", "second");
        headers.insert(h::KIND, if id.is_some() { "Handler" } else { "MissingId" });
        headers.insert(h::ERROR, "no such table: orders");
        headers.insert(h::SUBJECT, target.subject("orders.placed").as_str());
        headers.insert(h::DELIVERIES, "5");
        if let Some(id) = id {
            headers.insert(h::MESSAGE_ID, id);
        }
        headers
    };
    let subject = format!("{DEAD_LETTER_SUBJECT_PREFIX}.{consumer}");
    for (id, payload) in [(Some("evt-7"), "{\"n\":7}"), (None, "{\"n\":8}")] {
        js.publish_with_headers(subject.clone(), copy(id), payload.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    // A copy of a message whose subject no stream takes any more: its consumer can still
    // have it back.
    let mut orphan = copy(Some("evt-9"));
    orphan.insert(h::SUBJECT, format!("nostream{consumer}.orders").as_str());
    js.publish_with_headers(subject.clone(), orphan, "{\"n\":9}".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let nats = nats_url();
    let cli = |args: &'static [&'static str]| {
        let mut argv = vec![
            "--nats-url".to_owned(),
            nats.clone(),
            "dead-letters".to_owned(),
        ];
        argv.extend(["--consumer".to_owned(), consumer.clone()]);
        argv.extend(args.iter().map(|a| (*a).to_owned()));
        async move {
            tokio::task::spawn_blocking(move || {
                run(&argv.iter().map(String::as_str).collect::<Vec<_>>())
            })
            .await
            .unwrap()
        }
    };

    let listed: Value = serde_json::from_str(&cli(&["--json"]).await.unwrap()).unwrap();
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 3, "{listed:?}");
    assert_eq!(listed[0]["messageId"], "evt-7");
    assert_eq!(listed[0]["kind"], "Handler");
    assert_eq!(listed[0]["deliveries"], 5);
    assert_eq!(listed[0]["error"], "no such table: orders");
    assert_eq!(listed[0]["payload"], "{\"n\":7}");
    assert_eq!(listed[1]["messageId"], Value::Null);
    let text = cli(&["--limit", "1"]).await.unwrap();
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(text.contains("evt-7 kind=Handler deliveries=5"), "{text}");

    let listed_sequence = |n: usize| listed[n]["sequence"].as_u64().unwrap();
    let (seven, nine) = (listed_sequence(0), listed_sequence(2));
    // No consumer of that name ever read its replays: nothing is replayed.
    let refused = cli(&["--replay"]).await.unwrap_err();
    assert!(refused.to_string().contains("no durable"), "{refused}");
    assert_eq!(
        cli(&["--json"])
            .await
            .map(|out| serde_json::from_str::<Value>(&out).unwrap())
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        3
    );
    // The durable a consumer with replays on makes.
    js.get_stream(REPLAY_STREAM)
        .await
        .unwrap()
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some(consumer.clone()),
            filter_subject: format!("{REPLAY_SUBJECT_PREFIX}.{consumer}.>"),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();
    let replayed = cli(&["--replay"]).await.unwrap();
    assert!(replayed.starts_with("replayed 2\n"), "{replayed}");
    assert!(
        replayed.contains("(no id): it has no `Trellis-Dlq-Msg-Id` header"),
        "{replayed}"
    );
    // Each went to the consumer's replay subject, whatever its own subject: the message's
    // stream got nothing. Read through a consumer: a direct get keeps only the last value of
    // a repeated header.
    assert_eq!(target.count().await, 0);
    let replays = js.get_stream(REPLAY_STREAM).await.unwrap();
    let reader = replays
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            filter_subject: format!("{REPLAY_SUBJECT_PREFIX}.{consumer}.>"),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut fetched = reader
        .fetch()
        .max_messages(10)
        .expires(std::time::Duration::from_secs(1))
        .messages()
        .await
        .unwrap();
    let mut back = Vec::new();
    while let Some(message) = futures::StreamExt::next(&mut fetched).await {
        back.push(message.unwrap().message.clone());
    }
    assert_eq!(back.len(), 2, "{back:?}");
    let first = &back[0];
    let first_headers = first.headers.clone().unwrap_or_default();
    assert_eq!(
        first.subject.as_str(),
        format!("{REPLAY_SUBJECT_PREFIX}.{consumer}.{seven}")
    );
    assert_eq!(first.payload.as_ref(), b"{\"n\":7}");
    assert_eq!(
        first_headers.get("Nats-Msg-Id").unwrap().as_str(),
        format!("replay:{consumer}:evt-7:{seven}"),
        "a copy without its own id: the consumer, the message's id and the copy's sequence"
    );
    assert!(
        first_headers.get(h::ERROR).is_none(),
        "the error text stays with the copy"
    );
    assert_eq!(first_headers.get(h::MESSAGE_ID).unwrap().as_str(), "evt-7");
    assert_eq!(
        first_headers.get(h::SUBJECT).unwrap().as_str(),
        target.subject("orders.placed")
    );
    assert_eq!(
        first_headers.get("Trellis-Event-Time").unwrap().as_str(),
        "2026-12-06T10:00:00.000Z"
    );
    let tags: Vec<&str> = first_headers.get_all("X-Tag").map(|v| v.as_str()).collect();
    assert_eq!(
        tags,
        ["first", "second"],
        "every value of a repeated header"
    );
    assert_eq!(
        back[1].subject.as_str(),
        format!("{REPLAY_SUBJECT_PREFIX}.{consumer}.{nine}")
    );
    // The copy without an id is left.
    let left: Value = serde_json::from_str(&cli(&["--json"]).await.unwrap()).unwrap();
    assert_eq!(left.as_array().unwrap().len(), 1, "{left:?}");
    assert_eq!(left[0]["kind"], "MissingId");

    let _ = replays
        .purge()
        .filter(format!("{REPLAY_SUBJECT_PREFIX}.{consumer}.>"))
        .await;
    let _ = replays.delete_consumer(&consumer).await;
    let _ = dlq.purge().filter(subject).await;
    target.delete().await;
}
