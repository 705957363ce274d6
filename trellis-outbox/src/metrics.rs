//! The metrics trellis-outbox records, through the [`metrics`](https://docs.rs/metrics)
//! facade: install any recorder (Prometheus, OpenTelemetry, StatsD, …) in your application
//! and they appear; without one they cost a few atomic loads. Names follow Prometheus
//! conventions (`_total` counters, `_seconds` histograms).
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | [`DISPATCHED`] | counter | `name` | rows marked dispatched |
//! | [`FAILED`] | counter | `name` | attempts that failed and will be retried |
//! | [`DEAD`] | counter | `name` | rows moved to `dead` (given up, refused, or poison) |
//! | [`CLAIM_SECONDS`] | histogram | — | one claim statement |
//! | [`PUBLISH_SECONDS`] | histogram | — | one publisher call: a claimed batch, one round of it when it holds runs of ordering keys (one row per key per round), or a batch of handed-over rows |
//! | [`MARK_SECONDS`] | histogram | — | marking one published batch |
//! | [`CLAIMED_ROWS`] | histogram | — | rows per claim |
//! | [`HANDED_OVER_ROWS`] | histogram | — | rows per batch the dispatcher was handed at commit ([`HandoffTransaction`](crate::HandoffTransaction)), published without a claim |
//! | [`HANDOFF_OVERFLOW_ROWS`] | counter | — | committed rows not handed over because the dispatcher already had [`max_handoff_backlog`](crate::DispatcherBuilder::max_handoff_backlog) rows waiting (they are claimed after their lease) |
//! | [`UNDISPATCHED`] | gauge | — | rows waiting to be dispatched (a dispatcher reports it) |
//! | [`LAG_SECONDS`] | gauge | — | how long the oldest of them has waited (0 when none) |
//! | [`INBOX_DUPLICATES`] | counter | `inbox` | `record_inbox` calls that found the id already there |
//! | [`CONSUMED`] | counter | `consumer`, `outcome` | messages a [`Consumer`](crate::Consumer) settled: `applied`, `duplicate`, `redelivered`, `dead_lettered`, `terminated` |
//! | [`HANDLE_SECONDS`] | histogram | `consumer` | one message: begin to commit |
//!
//! `name` is the row's event name or job queue; rows that could not be decoded count under
//! `name = "_poison"`, and rows whose batch mark lost some leases (so which ones were marked
//! is not known) under `name = "_unattributed"`.

/// Rows marked `dispatched`, by `name`.
pub const DISPATCHED: &str = "trellis_outbox_dispatched_total";
/// Failed attempts that will be retried, by `name`.
pub const FAILED: &str = "trellis_outbox_failed_total";
/// Rows moved to `dead`, by `name`.
pub const DEAD: &str = "trellis_outbox_dead_total";
/// Seconds one claim took.
pub const CLAIM_SECONDS: &str = "trellis_outbox_claim_seconds";
/// Seconds one publisher call took (a claimed batch, one round of it when it holds runs of
/// ordering keys, or a batch of handed-over rows).
pub const PUBLISH_SECONDS: &str = "trellis_outbox_publish_seconds";
/// Seconds marking one published batch took.
pub const MARK_SECONDS: &str = "trellis_outbox_mark_seconds";
/// Rows per claim.
pub const CLAIMED_ROWS: &str = "trellis_outbox_claimed_rows";
/// Rows per batch of handed-over rows (published without a claim).
pub const HANDED_OVER_ROWS: &str = "trellis_outbox_handed_over_rows";
/// Committed rows a [`HandoffTransaction`](crate::HandoffTransaction) did not hand over
/// because the dispatcher's queue of handed-over rows was full.
pub const HANDOFF_OVERFLOW_ROWS: &str = "trellis_outbox_handoff_overflow_rows";
/// Rows waiting to be dispatched, as a dispatcher last saw them.
pub const UNDISPATCHED: &str = "trellis_outbox_undispatched";
/// Seconds the oldest undispatched row has waited since it was enqueued (0 when none).
pub const LAG_SECONDS: &str = "trellis_outbox_lag_seconds";
/// Inbox records that were duplicates, by `inbox` (the table).
pub const INBOX_DUPLICATES: &str = "trellis_outbox_inbox_duplicates_total";
/// Messages a consumer settled, by `consumer` and `outcome`.
pub const CONSUMED: &str = "trellis_outbox_consumed_total";
/// Seconds one consumed message took, from begin to commit, by `consumer`.
pub const HANDLE_SECONDS: &str = "trellis_outbox_handle_seconds";

/// The `name` label of rows that could not be decoded.
pub const POISON_NAME: &str = "_poison";
/// The `name` label of marked rows that cannot be told apart (some leases were lost).
pub const UNATTRIBUTED_NAME: &str = "_unattributed";

/// Adds `n` to counter `metric` for event name `name`.
pub(crate) fn count(metric: &'static str, name: &str, n: u64) {
    if n > 0 {
        metrics::counter!(metric, "name" => name.to_owned()).increment(n);
    }
}

/// Records `started.elapsed()` in histogram `metric`.
pub(crate) fn seconds(metric: &'static str, started: std::time::Instant) {
    metrics::histogram!(metric).record(started.elapsed().as_secs_f64());
}
