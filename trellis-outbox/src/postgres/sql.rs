//! Every statement trellis-outbox sends to PostgreSQL (except the schema's DDL, in
//! `schema.rs`), built once per table set from validated identifiers.

use crate::dispatch::KNOWN_STATES;
use crate::sql::OPEN_STATES;
#[cfg(feature = "postgres")]
use crate::sql::{OPEN_KEYED, holds_back};

/// The `next_attempt_at` of a `dead` row: far enough that an upstream Trellis dispatcher,
/// which claims every undispatched row once it is due, never takes it.
pub(crate) const NEVER: &str = "'9999-12-31 23:59:59.999+00'";
#[cfg(feature = "postgres")]
use crate::sql::SqlStatements;
use crate::sql::{COLUMNS, ROW_EXTRAS, Texts};
use crate::tables::OutboxTables;

/// Every state but `dispatched`, for the progress query.
const NOT_DISPATCHED: &str = "'pending', 'claimed', 'failed', 'dead'";

/// The statements both dialects send, in Postgres' words.
pub(crate) fn statements(tables: &OutboxTables) -> Texts {
    let (o, i) = (tables.outbox(), tables.inbox());
    Texts {
        // Upstream's INSERT, wrapped so that a row actually inserted also sends a wake-up
        // notification ($14 = channel; NULL sends none) in the same round trip; Postgres
        // delivers it only when the transaction commits.
        enqueue: format!(
            "WITH inserted AS (INSERT INTO {o} ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) ON CONFLICT (id) DO NOTHING RETURNING 1) \
             SELECT CASE WHEN $14::text IS NOT NULL THEN pg_notify($14, '')::text END FROM inserted"
        )
        .into(),
        // `ordering_seq` is set at commit by `<outbox>_ord_trg` (schema version 5).
        enqueue_ordered: format!(
            "WITH inserted AS (INSERT INTO {o} ({COLUMNS}, ordering_key, ordering_skip_dead) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $15, $16) ON CONFLICT (id) DO NOTHING RETURNING 1) \
             SELECT CASE WHEN $14::text IS NOT NULL THEN pg_notify($14, '')::text END FROM inserted"
        )
        .into(),
        // `clock_timestamp()`, not `now()`: the lease counts from the insert, not from the
        // start of the transaction, which may have begun long before.
        enqueue_leased: format!(
            "INSERT INTO {o} ({COLUMNS}, claim_token, claimed_until) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, \
             CASE WHEN $13 THEN clock_timestamp() + make_interval(secs => $12) END, NULL, NULL, \
             $11, clock_timestamp() + make_interval(secs => $12)) \
             ON CONFLICT (id) DO NOTHING"
        )
        .into(),
        lease_rows: format!(
            "UPDATE {o} SET claim_token = $2, claimed_until = clock_timestamp() + make_interval(secs => $3), \
             next_attempt_at = CASE WHEN $4 THEN clock_timestamp() + make_interval(secs => $3) \
             ELSE next_attempt_at END \
             WHERE id = ANY($1) AND state = 'pending' AND ordering_key IS NULL AND claim_token IS NULL \
             AND (next_attempt_at IS NULL OR next_attempt_at <= now()) RETURNING id"
        )
        .into(),
        select_by_id: format!("SELECT {COLUMNS} FROM {o} WHERE id = $1").into(),
        inbox_insert: format!(
            "INSERT INTO {i} (message_id, received_at) VALUES ($1, $2) ON CONFLICT (message_id) DO NOTHING"
        )
        .into(),
        mark_dispatched: format!(
            "UPDATE {o} SET state = 'dispatched', updated_at = now(), next_attempt_at = NULL, \
             last_error = NULL, outcome = NULL, claimed_until = NULL, claim_token = NULL \
             WHERE id = ANY($1) AND claim_token = $2"
        )
        .into(),
        mark_dispatched_with_outcomes: format!(
            "UPDATE {o} AS o SET state = 'dispatched', updated_at = now(), next_attempt_at = NULL, \
             last_error = NULL, outcome = d.outcome::jsonb, claimed_until = NULL, claim_token = NULL \
             FROM UNNEST($1::text[], $3::text[]) AS d(id, outcome) \
             WHERE o.id = d.id AND o.claim_token = $2"
        )
        .into(),
        // $1 ids, $2 errors, $3 retry delays in seconds (NULL: dead), $4 attempts to add,
        // $5 token.
        mark_failures: format!(
            "UPDATE {o} AS o SET \
             state = CASE WHEN f.delay IS NULL THEN 'dead' ELSE 'failed' END, \
             attempts = LEAST(o.attempts::int8 + f.add, 2147483647)::int4, updated_at = now(), \
             next_attempt_at = COALESCE(now() + make_interval(secs => f.delay), {NEVER}), \
             last_error = f.error, \
             claimed_until = NULL, claim_token = NULL \
             FROM UNNEST($1::text[], $2::text[], $3::float8[], $4::int4[]) AS f(id, error, delay, add) \
             WHERE o.id = f.id AND o.claim_token = $5 \
             RETURNING o.id"
        )
        .into(),
        extend_lease: format!(
            "UPDATE {o} SET claimed_until = now() + make_interval(secs => $3), \
             next_attempt_at = now() + make_interval(secs => $3) \
             WHERE id = ANY($1) AND claim_token = $2"
        )
        .into(),
        release: format!(
            "UPDATE {o} SET claimed_until = NULL, claim_token = NULL, next_attempt_at = NULL \
             WHERE id = ANY($1) AND claim_token = $2"
        )
        .into(),
        // One statement: `found` locks the row (FOR UPDATE reads its latest committed
        // version) and decides; `reset` updates it only if no live lease holds it; the
        // result says what was found either way (no result: no such row).
        retry: format!(
            "WITH found AS (SELECT id, state, claimed_until, \
             (claim_token IS NOT NULL AND claimed_until IS NOT NULL AND claimed_until > now()) AS leased \
             FROM {o} WHERE id = $1 FOR UPDATE), \
             reset AS (UPDATE {o} AS o SET state = 'pending', attempts = 0, updated_at = now(), \
             next_attempt_at = NULL, claimed_until = NULL, claim_token = NULL \
             FROM found WHERE o.id = found.id AND found.state IN ('failed', 'dead') AND NOT found.leased \
             RETURNING o.id) \
             SELECT found.state, found.claimed_until, EXISTS (SELECT 1 FROM reset) AS retried \
             FROM found"
        )
        .into(),
        // Rows no claim can finish: unknown states, and open rows never due or never
        // claimable again.
        sweep_unfinishable: format!(
            "UPDATE {o} SET state = 'dead', updated_at = now(), next_attempt_at = {NEVER}, \
             claimed_until = NULL, claim_token = NULL, \
             last_error = CASE WHEN state IS NULL THEN 'state is NULL' \
             WHEN state NOT IN ({KNOWN_STATES}) THEN 'unknown state ' || to_json(left(state, 100))::text \
             WHEN next_attempt_at = 'infinity' THEN 'next_attempt_at is infinity (never due)' \
             ELSE 'claimed_until is infinity (never claimable)' END \
             WHERE state IS NULL OR state NOT IN ({KNOWN_STATES}) \
             OR (state IN ({OPEN_STATES}) \
             AND (next_attempt_at = 'infinity' OR claimed_until = 'infinity')) \
             RETURNING id, last_error"
        )
        .into(),
        // $1 age in seconds, $2 limit: the oldest first, through `<outbox>_done_idx`.
        purge_dispatched: format!(
            "DELETE FROM {o} WHERE id = ANY(ARRAY(SELECT id FROM {o} \
             WHERE state = 'dispatched' AND updated_at < now() - make_interval(secs => $1) \
             ORDER BY updated_at LIMIT $2))"
        )
        .into(),
        purge_inbox: format!(
            "DELETE FROM {i} WHERE message_id = ANY(ARRAY(SELECT message_id FROM {i} \
             WHERE received_at < now() - make_interval(secs => $1) \
             ORDER BY received_at LIMIT $2))"
        )
        .into(),
        // A NULL state (another writer's) is counted under its own name. The ages leave out
        // `created_at` values that are not times (another writer's `±infinity`): Postgres
        // refuses to subtract them, which would fail the whole query.
        status: format!(
            "SELECT COALESCE(state, '(null)'), count(*), \
             EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE isfinite(created_at)))::float8 \
             FROM {o} GROUP BY state"
        )
        .into(),
        backlog: format!(
            "SELECT count(*), \
             EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE isfinite(created_at)))::float8 \
             FROM {o} WHERE state IN ({OPEN_STATES})"
        )
        .into(),
        inspect: format!("SELECT {COLUMNS}, {ROW_EXTRAS} FROM {o} WHERE id = $1").into(),
        progress: format!(
            "SELECT state, count(*), \
             EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE isfinite(created_at)))::float8 \
             FROM {o} WHERE state IN ({NOT_DISPATCHED}) GROUP BY state"
        )
        .into(),
        list: format!(
            "SELECT {COLUMNS}, {ROW_EXTRAS} FROM {o} WHERE state = $1 AND ($2::text IS NULL OR name = $2) \
             ORDER BY created_at, id LIMIT $3"
        )
        .into(),
        blocked_keys: crate::sql::blocked_keys(o, "$1").into(),
        blocked_key_count: crate::sql::blocked_key_count(o).into(),
        // $1 name or NULL, $2 limit: the oldest first. The outer test of the state is
        // evaluated again on the locked row, so a row retried meanwhile is left alone.
        retry_dead: format!(
            "UPDATE {o} SET state = 'pending', attempts = 0, updated_at = now(), \
             next_attempt_at = NULL, claimed_until = NULL, claim_token = NULL \
             WHERE id = ANY(ARRAY({dead})) AND state = 'dead'",
            dead = dead_rows(o, "id"),
        )
        .into(),
        count_dead: format!("SELECT count(*) FROM ({}) AS dead", dead_rows(o, "1")).into(),
        // Clamped to [now, now + 100 years]: an infinite time (written by another
        // writer) cannot be subtracted from now() and would fail every call.
        // Only the heads of ordering keys count: a row behind its key's head is not due
        // until the head is dispatched (a key blocked by a dead head is never due).
        next_due_in: format!(
            "SELECT CASE WHEN at IS NOT NULL THEN EXTRACT(EPOCH FROM \
             (LEAST(GREATEST(at, now()), now() + interval '100 years') - now()))::float8 END \
             FROM (SELECT min(GREATEST(COALESCE(next_attempt_at, now()), COALESCE(claimed_until, now()))) AS at \
             FROM {o} WHERE state IN ({OPEN_STATES}) AND {head}) AS due",
            head = crate::sql::head_test(o, o),
        )
        .into(),
    }
}

/// `what` of the oldest `dead` rows of `$1` (a name, or NULL for any), at most `$2`.
fn dead_rows(o: &str, what: &str) -> String {
    format!(
        "SELECT {what} FROM {o} WHERE state = 'dead' AND ($1::text IS NULL OR name = $1) \
         ORDER BY created_at, id LIMIT $2"
    )
}

/// The statements only Postgres sends.
///
/// Both claims take `$1` limit, `$2` lease in seconds, `$3` token, `$4` cutoff or NULL (now),
/// `$5` whether to write upstream Trellis' lease too (`next_attempt_at`, and `claimed` back
/// to `pending`; assigning a column its own value keeps the update HOT). They return
/// [`COLUMNS`], `ordering_key`, `ordering_seq`, the cutoff used and `keyed`: whether any
/// keyed row is still undispatched, which tells the repository which claim to send next.
/// They update the claimed rows by the `ctid` their locking scan returned
/// (`ctid = ANY(ARRAY(SELECT ctid … FOR UPDATE SKIP LOCKED))`, a TID scan: no second index
/// lookup; `id IN (SELECT …)` may become a hash join over a full scan of the table). The
/// locking scan rechecks a row another transaction updated meanwhile and returns its newest
/// version's `ctid`; a locked row cannot move before the update. They commit with
/// `synchronous_commit = off` for that transaction only: a lease is bookkeeping, and losing
/// one in a server crash only makes its rows claimable again.
#[derive(Debug)]
#[cfg(feature = "postgres")]
pub struct PgOnly {
    /// The claim of rows without an ordering key, oldest first through
    /// `<outbox>_claim_idx` (which holds only those since version 6). When it claims
    /// nothing it answers one row whose claimed columns (`id` too) are NULL, with
    /// `claim_cutoff` and `keyed` as a claimed row has them.
    pub(crate) claim_unkeyed: std::sync::Arc<str>,
    /// The claim of both kinds. `$6` the keyed rows the claimer published and is still
    /// marking (they count as dispatched), `$7` the key to walk on from (NULL: the first),
    /// `$8` the most rows to take from one key.
    ///
    /// Keyed rows are found **key by key**, not by age: a walk over the distinct keys of
    /// `<outbox>_ord_idx` (one index probe per key), round-robin from `$7` and wrapping
    /// around, tests each key's head (its first row that still holds the key back) and, if
    /// the head is claimable, reads the key's first `$8` rows that hold it back (its run).
    /// A key whose head is leased, failed and not yet due, or dead under `block` thus costs
    /// two probes, however many rows wait behind it; scanning rows by age would read every
    /// one of them. The claimable rows of the runs and the oldest unkeyed rows are locked
    /// (`SKIP LOCKED`) and the oldest `$1` of them kept. A run may then have lost a row (not
    /// claimable, locked by another transaction, or past the limit): each key's rows are cut
    /// before its first row of the run that was not kept, so the claim holds a prefix of each
    /// key's open rows, which the engine publishes one row of a key at a time, in
    /// `ordering_seq` order. (`cut` is `MATERIALIZED`: inlined, a generic plan ran it again
    /// for every candidate.)
    pub(crate) claim: std::sync::Arc<str>,
    /// Whether the last claim saw keyed rows undispatched: the next claim is then
    /// [`claim`](Self::claim), else [`claim_unkeyed`](Self::claim_unkeyed) (and `claim` only
    /// when that finds nothing, so keyed rows written meanwhile are found).
    pub(crate) keyed: std::sync::atomic::AtomicBool,
    /// Where the next key walk starts: after the last key the previous one claimed from.
    pub(crate) cursor: std::sync::Mutex<Option<String>>,
}

#[cfg(feature = "postgres")]
impl PgOnly {
    pub(crate) fn new(tables: &OutboxTables) -> Self {
        let o = tables.outbox();
        let claimable = |row: &str| {
            format!(
                "{row}.state IN ({OPEN_STATES}) \
                 AND ({row}.next_attempt_at IS NULL OR {row}.next_attempt_at <= COALESCE($4, now())) \
                 AND ({row}.claimed_until IS NULL OR {row}.claimed_until <= now())"
            )
        };
        // A row that holds the rows behind it back; the rows in $6 count as dispatched.
        let holds = |row: &str| {
            format!(
                "{} AND {row}.id NOT IN (SELECT unnest($6::text[]))",
                holds_back(row)
            )
        };
        // The keys above `start` that have open rows, one index probe each
        // (`<outbox>_ord_open`'s predicate), the next one found by `step` from the last (`w.k`).
        let walk = |name: &str, start: &str, step: &str| {
            let least = |bound: &str| {
                format!("SELECT min(ordering_key) FROM {o} WHERE {OPEN_KEYED} AND {bound}")
            };
            format!(
                "{name}(k) AS ({} UNION ALL SELECT ({}) FROM {name} AS w WHERE w.k IS NOT NULL)",
                least(start),
                least(step)
            )
        };
        let update = format!(
            "UPDATE {o} SET claimed_until = now() + make_interval(secs => $2), claim_token = $3, \
             next_attempt_at = CASE WHEN $5 THEN now() + make_interval(secs => $2) \
             ELSE next_attempt_at END, \
             state = CASE WHEN $5 AND state = 'claimed' THEN 'pending' ELSE state END"
        );
        // Whether open keyed rows exist, as `min(ordering_key)`: Postgres answers a `min` from
        // the first entry of `<outbox>_ord_open`. An `EXISTS` of the same predicate can be
        // planned as a sequential scan (the statistics take keyed rows for open ones in
        // proportion), which reads the whole table when none is open: 12 ms at 120,000 rows.
        // Each claim commits without waiting for its WAL flush, and returns the claimed
        // columns and the answer: the claim's time and whether keyed rows wait.
        let async_commit = "AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL";
        let claimed = format!("{COLUMNS}, ordering_key, ordering_seq");
        let answer = format!(
            "COALESCE($4, now()) AS claim_cutoff, \
             (SELECT min(ordering_key) FROM {o} WHERE {OPEN_KEYED}) IS NOT NULL AS keyed"
        );
        let returning = format!("{async_commit} RETURNING {claimed}, {answer}");
        // The oldest claimable rows without a key, locked.
        let unkeyed = format!(
            "FROM {o} WHERE ordering_key IS NULL AND {} \
             ORDER BY created_at, id LIMIT $1 FOR UPDATE SKIP LOCKED",
            claimable(o)
        );
        Self {
            // Nothing claimed, the join still answers one row (claimed columns NULL) with the
            // claim's time and the keyed test: a claim that found nothing says whether keyed
            // rows wait, and needs no second statement (the keyed claim, in a transaction of
            // its own, four round trips) to find out.
            claim_unkeyed: format!(
                "WITH claimed AS ({update} WHERE ctid = ANY(ARRAY(SELECT ctid {unkeyed})) \
                 {async_commit} RETURNING {claimed}) \
                 SELECT claimed.*, {answer} FROM (SELECT) AS answer LEFT JOIN claimed ON true"
            )
            .into(),
            claim: format!(
                "{update} WHERE ctid = ANY(ARRAY(WITH RECURSIVE {above}, {below}, \
                 walk AS (SELECT k FROM above WHERE k IS NOT NULL UNION ALL SELECT k FROM below WHERE k IS NOT NULL), \
                 free AS (SELECT k FROM walk WHERE (SELECT {head_claimable} FROM {o} AS h \
                 WHERE h.ordering_key = walk.k AND {head_holds} ORDER BY h.ordering_seq LIMIT 1)), \
                 runs AS (SELECT r.loc, r.id, free.k AS key, r.seq FROM free, LATERAL (SELECT a.ctid AS loc, a.id, a.ordering_seq AS seq \
                 FROM {o} AS a WHERE a.ordering_key = free.k AND {run_holds} \
                 ORDER BY a.ordering_seq LIMIT $8) AS r LIMIT $1), \
                 oldest AS (SELECT ctid AS loc, id, created_at, ordering_key, ordering_seq {unkeyed}), \
                 locked_runs AS (SELECT ctid AS loc, id, created_at, ordering_key, ordering_seq FROM {o} \
                 WHERE ctid = ANY(ARRAY(SELECT loc FROM runs)) AND {own_claimable} FOR UPDATE SKIP LOCKED), \
                 candidate AS MATERIALIZED (SELECT loc, id, ordering_key, ordering_seq FROM \
                 (SELECT * FROM oldest UNION ALL SELECT * FROM locked_runs) AS locked ORDER BY created_at, id LIMIT $1), \
                 cut AS MATERIALIZED (SELECT key, min(seq) AS seq FROM runs \
                 WHERE id NOT IN (SELECT held.id FROM candidate AS held) GROUP BY key) \
                 SELECT c.loc FROM candidate AS c LEFT JOIN cut ON cut.key = c.ordering_key \
                 WHERE cut.seq IS NULL OR c.ordering_seq IS NULL OR c.ordering_seq < cut.seq)) {returning}",
                above = walk("above", "ordering_key > COALESCE($7, '')", "ordering_key > w.k"),
                // With no cursor, `above` starts after '': `below` then takes the empty
                // key (which only another writer can store).
                below = walk(
                    "below",
                    "ordering_key <= COALESCE($7, '')",
                    "ordering_key > w.k AND ordering_key <= COALESCE($7, '')"
                ),
                head_claimable = claimable("h"),
                head_holds = holds("h"),
                run_holds = holds("a"),
                own_claimable = claimable(o),
            )
            .into(),
            keyed: std::sync::atomic::AtomicBool::new(true),
            cursor: std::sync::Mutex::new(None),
        }
    }
}

/// The batch enqueue: $1–$6 the records' id, kind, name, subject, payload and headers as
/// arrays, $7 the time, $8 the notify channel (NULL: none), $9 and $10 the ordering keys
/// and `skip_dead` flags (NULL for unordered records). Returns the inserted count.
#[cfg(feature = "postgres")]
pub(crate) fn insert_batch(sql: &SqlStatements) -> String {
    let o = &*sql.outbox_table;
    format!(
        "WITH inserted AS (INSERT INTO {o} ({COLUMNS}, ordering_key, ordering_skip_dead) \
         SELECT t.id, t.kind, t.name, t.subject, t.payload, t.headers::jsonb, 'pending', 0, $7, $7, NULL, NULL, NULL, \
         t.ordering_key, t.skip_dead \
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $9::text[], $10::bool[]) \
         AS t(id, kind, name, subject, payload, headers, ordering_key, skip_dead) \
         ON CONFLICT (id) DO NOTHING RETURNING 1), \
         counted AS (SELECT count(*) AS n FROM inserted) \
         SELECT n, CASE WHEN n > 0 AND $8::text IS NOT NULL THEN pg_notify($8, '')::text END FROM counted"
    )
}

/// The stored rows of the ids in the array $1.
#[cfg(feature = "postgres")]
pub(crate) fn select_stored(sql: &SqlStatements) -> String {
    format!(
        "SELECT {COLUMNS} FROM {} WHERE id = ANY($1)",
        sql.outbox_table
    )
}
