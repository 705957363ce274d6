//! Compile-fail (UI) tests: each `tests/ui/*.rs` file holds one mistake and its `.stderr` the
//! compiler's exact diagnostic. Recorded with rustc 1.95; bless with `TRYBUILD=overwrite`.

#[rustversion::attr(
    not(stable(1.95)),
    ignore = "ui .stderr files were recorded with rustc 1.95; re-bless with TRYBUILD=overwrite"
)]
#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
