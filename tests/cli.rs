//! The `trellis-outbox` command-line tool.

fn run(args: &[&str]) -> Result<String, String> {
    let mut out = Vec::new();
    let argv = std::iter::once("trellis-outbox").chain(args.iter().copied());
    trellis_outbox::cli::run(argv, &mut out).map_err(|e| e.to_string())?;
    Ok(String::from_utf8(out).expect("utf-8 output"))
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
    assert!(sql.starts_with(
        "-- trellis_sql_outbox_inbox_sqlite_v1 (down), version 1, fnv1a64:d10ccc8ff04a835d\n"
    ));
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
    let err = run(&["sql", "--dialect", "sqlite", "--version", "99"]).unwrap_err();
    assert!(err.contains("no migration version Some(99)"), "{err}");
}
