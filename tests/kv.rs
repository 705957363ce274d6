//! `NatsKvOutboxRepository` and `NatsKvInboxRepository` against a real NATS KV (issue #13):
//! upstream's acceptance cases §G 3 and 15, leases that expire (a dead dispatcher's records
//! are reclaimed), fenced marks, poison values, keys escaped once, racing claimers and the
//! atomic inbox.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::kv::Store;
use chrono::Utc;
use serde_json::{Value, json};
use trellis_outbox::{
    DispatchOptions, Dispatched, Error, Failure, InboxReceipt, NatsKvInboxRepository,
    NatsKvOutboxRepository, OutboxDispatcher, OutboxMessageState, OutboxRepository,
    PreparedOutboxRecord, RetryOutcome, RetryPolicy, dispatch_outbox,
};
use trellis_outbox_tests::nats::jetstream;
use trellis_outbox_tests::publisher::RecordingPublisher;
use trellis_outbox_tests::relay::Relay;

/// A fresh bucket, deleted by [`Bucket::end`].
struct Bucket {
    js: Context,
    name: String,
    store: Store,
}

impl Bucket {
    async fn new() -> Self {
        let js = jetstream().await;
        let name = format!(
            "trellis_t_{}",
            ulid::Ulid::generate().to_string().to_lowercase()
        );
        let store = NatsKvOutboxRepository::open(&js, &name)
            .await
            .unwrap()
            .store()
            .clone();
        Self { js, name, store }
    }

    fn outbox(&self) -> NatsKvOutboxRepository {
        NatsKvOutboxRepository::new(self.store.clone())
    }

    async fn keys(&self) -> Vec<String> {
        use futures::TryStreamExt as _;
        let mut keys: Vec<String> = self
            .store
            .keys()
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        keys.sort();
        keys
    }

    async fn value(&self, key: &str) -> Value {
        serde_json::from_slice(&self.store.get(key).await.unwrap().unwrap()).unwrap()
    }

    async fn end(self) {
        let _ = self.js.delete_key_value(&self.name).await;
    }
}

fn event(id: &str) -> PreparedOutboxRecord {
    let mut record = PreparedOutboxRecord::event(
        "Orders.Placed",
        format!("events.v1.Orders.Placed.{}", id.len()),
        &json!({ "id": id }),
    )
    .unwrap();
    record.id = id.to_owned();
    record.headers.insert("Nats-Msg-Id".into(), id.to_owned());
    record
}

fn no_jitter(delay: Duration) -> RetryPolicy {
    RetryPolicy::fixed(delay).jitter(0.0)
}

const LEASE: Duration = Duration::from_secs(30);

#[tokio::test]
async fn g3_dispatches_through_kv_and_records_the_failure() {
    let bucket = Bucket::new().await;
    let outbox = bucket.outbox();
    outbox.enqueue(&event("kv_ok")).await.unwrap();
    outbox.enqueue(&event("kv_fail")).await.unwrap();
    let publisher = RecordingPublisher::new();
    publisher.fail_always("kv_fail", "broker said no");
    let before = Utc::now();
    let report = dispatch_outbox(
        &outbox,
        &publisher,
        DispatchOptions::new().retry_policy(no_jitter(Duration::from_secs(5))),
    )
    .await
    .unwrap();
    assert_eq!((report.dispatched, report.failed), (1, 1));
    assert_eq!(bucket.keys().await, vec!["kv_fail", "kv_ok"]);
    let ok = outbox.get("kv_ok").await.unwrap().unwrap();
    assert_eq!(ok.state, OutboxMessageState::Dispatched);
    let failed = outbox.get("kv_fail").await.unwrap().unwrap();
    assert_eq!(failed.state, OutboxMessageState::Failed);
    assert_eq!(failed.attempts, 1);
    assert_eq!(failed.last_error.as_deref(), Some("broker said no"));
    let due = failed.next_attempt_at.unwrap() - before;
    assert!(
        due >= chrono::TimeDelta::seconds(5) && due < chrono::TimeDelta::seconds(7),
        "next attempt in {due}"
    );
    // Upstream's field names and camelCase JSON, no claim token left behind.
    let stored = bucket.value("kv_fail").await;
    assert_eq!(stored["state"], "failed");
    assert_eq!(stored["attempts"], 1);
    assert!(stored.get("claimToken").is_none(), "{stored}");
    assert!(stored["nextAttemptAt"].as_str().unwrap().ends_with('Z'));
    bucket.end().await;
}

#[tokio::test]
async fn g15_claims_are_revision_checked_racing_claimers_share_nothing() {
    let bucket = Bucket::new().await;
    let outbox = Arc::new(bucket.outbox());
    for n in 0..200 {
        outbox
            .enqueue(&event(&format!("cas-{n:03}")))
            .await
            .unwrap();
    }
    let mut claimers = Vec::new();
    for _ in 0..4 {
        let outbox = outbox.clone();
        claimers.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let claim = outbox.claim_due(25, LEASE, None).await.unwrap();
                if claim.is_empty() {
                    break mine;
                }
                mine.extend(claim.messages.iter().map(|m| m.id.clone()));
            }
        }));
    }
    let mut all = Vec::new();
    for claimer in claimers {
        all.extend(claimer.await.unwrap());
    }
    let distinct: HashSet<&String> = all.iter().collect();
    assert_eq!(all.len(), 200, "every record claimed once in total");
    assert_eq!(distinct.len(), 200, "no record claimed twice");
    let stored = bucket.value("cas-000").await;
    assert_eq!(stored["state"], "claimed");
    bucket.end().await;
}

/// A lease of `Duration::MAX` (the trait does not stop a caller passing one) holds the
/// record for a century, stored in Trellis' time format; it used to be written as a year
/// past 9999 with a sign, which no reader parses, so the record was claimable at once.
#[tokio::test]
async fn an_endless_lease_holds_the_record() {
    let bucket = Bucket::new().await;
    let outbox = bucket.outbox();
    outbox.enqueue(&event("held")).await.unwrap();
    let first = outbox.claim_due(10, Duration::MAX, None).await.unwrap();
    assert_eq!(first.messages.len(), 1);
    assert!(
        outbox.claim_due(10, LEASE, None).await.unwrap().is_empty(),
        "still held"
    );
    let until = bucket.value("held").await["nextAttemptAt"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(until.len() == 24 && until.ends_with('Z'), "{until}");
    assert!(until.as_str() > "2100", "{until}");
    bucket.end().await;
}

#[tokio::test]
async fn a_dead_dispatchers_claim_expires_and_its_late_marks_are_fenced() {
    let bucket = Bucket::new().await;
    let outbox = bucket.outbox();
    outbox.enqueue(&event("orphan")).await.unwrap();
    let first = outbox
        .claim_due(10, Duration::from_millis(300), None)
        .await
        .unwrap();
    assert_eq!(first.messages.len(), 1);
    assert!(
        outbox.claim_due(10, LEASE, None).await.unwrap().is_empty(),
        "held while the lease runs"
    );
    assert_eq!(
        outbox.retry("orphan").await.unwrap(),
        RetryOutcome::Leased {
            until: chrono::DateTime::parse_from_rfc3339(
                bucket.value("orphan").await["nextAttemptAt"]
                    .as_str()
                    .unwrap()
            )
            .unwrap()
            .with_timezone(&Utc)
        }
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let second = outbox.claim_due(10, LEASE, None).await.unwrap();
    assert_eq!(second.messages.len(), 1, "reclaimed after the lease");
    assert_eq!(second.messages[0].state, OutboxMessageState::Pending);
    // The first dispatcher wakes up: its marks change nothing.
    assert_eq!(
        outbox
            .mark_dispatched(&first, &[Dispatched::new("orphan")])
            .await
            .unwrap(),
        0
    );
    assert!(
        outbox
            .mark_failure(
                &first,
                Failure::retry("orphan", "late", Duration::from_secs(1))
            )
            .await
            .unwrap()
            .eq(&false)
    );
    assert_eq!(outbox.release(&first, &["orphan"]).await.unwrap(), 0);
    assert_eq!(
        outbox
            .mark_dispatched(&second, &[Dispatched::new("orphan")])
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        outbox.get("orphan").await.unwrap().unwrap().state,
        OutboxMessageState::Dispatched
    );
    bucket.end().await;
}

/// Current upstream stores KV values in its typed-KV envelope (`TRKV`, format 1, a `u32`
/// version, then the JSON). Such a record is dispatched like a bare one and written back in
/// the same envelope, so upstream can still read it; it is not taken for poison.
#[tokio::test]
async fn records_in_upstreams_trkv_envelope_are_dispatched_and_stay_in_it() {
    let bucket = Bucket::new().await;
    let outbox = bucket.outbox();
    outbox.enqueue(&event("wrapped")).await.unwrap();
    let bare = bucket.store.get("wrapped").await.unwrap().unwrap();
    let mut wrapped = b"TRKV\x01\x00\x00\x00\x03".to_vec();
    wrapped.extend_from_slice(&bare);
    bucket.store.put("wrapped", wrapped.into()).await.unwrap();
    let publisher = RecordingPublisher::new();
    let report = dispatch_outbox(&outbox, &publisher, DispatchOptions::new())
        .await
        .unwrap();
    assert_eq!((report.dispatched, report.dead), (1, 0), "{report:?}");
    assert_eq!(publisher.attempt_count("wrapped"), 1);
    let stored = bucket.store.get("wrapped").await.unwrap().unwrap();
    let (header, body) = stored.split_at(9);
    assert_eq!(header, b"TRKV\x01\x00\x00\x00\x03");
    let body: Value = serde_json::from_slice(body).unwrap();
    assert_eq!(body["state"], "dispatched");
    assert_eq!(
        outbox.get("wrapped").await.unwrap().unwrap().state,
        OutboxMessageState::Dispatched
    );
    bucket.end().await;
}

/// Upstream's KV claimer re-claims a record whose lease ran out by spreading it
/// (`{...record, state: "claimed", attempts: attempts + 1, …}`), so our `claimToken` stays
/// in it. Our late marks must see that the record is no longer ours and change nothing.
#[tokio::test]
async fn a_record_upstream_reclaimed_keeps_our_token_but_our_late_marks_are_fenced() {
    let bucket = Bucket::new().await;
    let outbox = bucket.outbox();
    outbox.enqueue(&event("shared")).await.unwrap();
    let ours = outbox.claim_due(10, LEASE, None).await.unwrap();
    assert_eq!(ours.messages.len(), 1);
    // Upstream's claim, as its `claimDue` writes it.
    let mut value = bucket.value("shared").await;
    let attempts = value["attempts"].as_u64().unwrap();
    value["state"] = json!("claimed");
    value["attempts"] = json!(attempts + 1);
    value["nextAttemptAt"] = json!("2100-01-01T00:00:00.000Z");
    bucket
        .store
        .put("shared", serde_json::to_vec(&value).unwrap().into())
        .await
        .unwrap();
    assert_eq!(
        outbox
            .mark_dispatched(&ours, &[Dispatched::new("shared")])
            .await
            .unwrap(),
        0,
        "a late mark overwrote upstream's live claim"
    );
    assert!(
        !outbox
            .mark_failure(
                &ours,
                Failure::retry("shared", "late", Duration::from_secs(1))
            )
            .await
            .unwrap()
    );
    assert_eq!(outbox.release(&ours, &["shared"]).await.unwrap(), 0);
    let stored = bucket.value("shared").await;
    assert_eq!(stored["state"], "claimed");
    assert_eq!(stored["attempts"], json!(attempts + 1));
    bucket.end().await;
}

/// Records another writer stored under keys their ids do not map back to (a non-JSON value
/// under an escaped-looking key; a good record copied under another key): the marks find
/// the record the claim took, by its key, so the poison goes dead and the good one is
/// dispatched once, not republished after every lease.
#[tokio::test]
async fn records_whose_id_does_not_name_their_key_are_marked_where_they_were_claimed() {
    let bucket = Bucket::new().await;
    let outbox = bucket.outbox();
    bucket
        .store
        .put("_b64.Zm9v", "not json either".into())
        .await
        .unwrap();
    outbox.enqueue(&event("original")).await.unwrap();
    let copy = bucket.value("original").await;
    bucket
        .store
        .put(
            "copied-elsewhere",
            serde_json::to_vec(&copy).unwrap().into(),
        )
        .await
        .unwrap();
    bucket.store.delete("original").await.unwrap();

    let publisher = RecordingPublisher::new();
    let report = dispatch_outbox(&outbox, &publisher, DispatchOptions::new())
        .await
        .unwrap();
    assert_eq!((report.dispatched, report.dead), (1, 1), "{report:?}");
    assert_eq!(bucket.value("_b64.Zm9v").await["state"], "dead");
    assert_eq!(
        bucket.value("copied-elsewhere").await["state"],
        "dispatched"
    );
    let again = dispatch_outbox(&outbox, &publisher, DispatchOptions::new())
        .await
        .unwrap();
    assert_eq!((again.dispatched, again.dead), (0, 0), "{again:?}");
    assert_eq!(publisher.attempt_count("original"), 1);
    bucket.end().await;
}

#[tokio::test]
async fn poison_values_go_dead_and_the_rest_is_dispatched() {
    let bucket = Bucket::new().await;
    let outbox = bucket.outbox();
    outbox.enqueue(&event("good-1")).await.unwrap();
    bucket
        .store
        .put("garbage", "not json at all".into())
        .await
        .unwrap();
    let mut unknown = serde_json::to_value(bucket.value("good-1").await).unwrap();
    unknown["id"] = json!("weird-kind");
    unknown["kind"] = json!("event.teleport");
    bucket
        .store
        .put("weird-kind", serde_json::to_vec(&unknown).unwrap().into())
        .await
        .unwrap();
    outbox.enqueue(&event("good-2")).await.unwrap();
    bucket
        .store
        .put("binary", vec![0xff_u8, 0x00, 0x80].into())
        .await
        .unwrap();

    let publisher = RecordingPublisher::new();
    let report = dispatch_outbox(&outbox, &publisher, DispatchOptions::new())
        .await
        .unwrap();
    assert_eq!((report.dispatched, report.dead), (2, 3), "{report:?}");
    let garbage = bucket.value("garbage").await;
    assert_eq!(garbage["state"], "dead");
    assert_eq!(garbage["raw"], "not json at all", "what was there is kept");
    let bytes = bucket.value("binary").await;
    assert_eq!(bytes["state"], "dead");
    assert_eq!(
        bytes["rawBase64"], "/wCA",
        "bytes that are not UTF-8 are kept exactly: {bytes}"
    );
    assert_eq!(garbage["nextAttemptAt"], "9999-12-31T00:00:00.000Z");
    let weird = bucket.value("weird-kind").await;
    assert_eq!(weird["state"], "dead");
    assert!(
        weird["lastError"]
            .as_str()
            .unwrap()
            .contains("event.teleport"),
        "{weird}"
    );
    // Dead records stay dead.
    let again = dispatch_outbox(&outbox, &publisher, DispatchOptions::new())
        .await
        .unwrap();
    assert_eq!((again.dispatched, again.dead), (0, 0));
    assert_eq!(publisher.total_attempts(), 2);
    assert!(matches!(
        outbox.get("garbage").await,
        Err(Error::Decode { .. })
    ));
    bucket.end().await;
}

/// A foreign value that, wrapped to be kept (base64) with the lease fields, no longer fits
/// in a message: it cannot be claimed (nor put to rest), but it no longer fails every claim
/// and so stops the whole outbox; the other records are dispatched.
#[tokio::test]
async fn a_value_too_large_to_claim_is_left_alone_and_the_rest_is_dispatched() {
    let bucket = Bucket::new().await;
    let outbox = bucket.outbox();
    bucket
        .store
        .put("huge", vec![0xff_u8; 800_000].into())
        .await
        .unwrap();
    outbox.enqueue(&event("good-1")).await.unwrap();
    let publisher = RecordingPublisher::new();
    let report = dispatch_outbox(&outbox, &publisher, DispatchOptions::new())
        .await
        .unwrap();
    assert_eq!((report.dispatched, report.dead), (1, 0), "{report:?}");
    assert_eq!(bucket.value("good-1").await["state"], "dispatched");
    // Left exactly as it was.
    let huge = bucket.store.get("huge").await.unwrap().unwrap();
    assert_eq!(huge.len(), 800_000);
    bucket.end().await;
}

#[tokio::test]
async fn ids_nats_refuses_as_keys_are_escaped_once_and_dispatched() {
    let bucket = Bucket::new().await;
    let outbox = bucket.outbox();
    for id in ["order 7", "a*b>c~d", "$odd", "trellis-job-created:x"] {
        outbox.enqueue(&event(id)).await.unwrap();
    }
    let publisher = RecordingPublisher::new();
    let report = dispatch_outbox(&outbox, &publisher, DispatchOptions::new())
        .await
        .unwrap();
    assert_eq!(
        report.dispatched, 4,
        "upstream could never claim these (spec §H 26)"
    );
    assert!(bucket.keys().await.iter().all(|k| k.starts_with("_b64.")));
    assert_eq!(
        outbox.get("order 7").await.unwrap().unwrap().state,
        OutboxMessageState::Dispatched
    );
    bucket.end().await;
}

#[tokio::test]
async fn enqueue_is_idempotent_and_refuses_a_different_record_under_the_same_id() {
    let bucket = Bucket::new().await;
    let outbox = bucket.outbox();
    let first = outbox.enqueue(&event("same")).await.unwrap();
    let again = outbox.enqueue(&event("same")).await.unwrap();
    assert_eq!(
        first.created_at, again.created_at,
        "the stored record is returned"
    );
    let mut other = event("same");
    other.payload = r#"{"id":"different"}"#.into();
    match outbox.enqueue(&other).await {
        Err(Error::DuplicateIdentity { id, fields }) => {
            assert_eq!((id.as_str(), fields), ("same", vec!["payload"]));
        }
        other => panic!("expected DuplicateIdentity, got {other:?}"),
    }
    bucket.end().await;
}

#[tokio::test]
async fn retry_and_purge() {
    let bucket = Bucket::new().await;
    let outbox = bucket.outbox();
    outbox.enqueue(&event("bad")).await.unwrap();
    outbox.enqueue(&event("fine")).await.unwrap();
    let publisher = RecordingPublisher::new();
    publisher.fail_permanently("bad", "payload too large");
    dispatch_outbox(&outbox, &publisher, DispatchOptions::new())
        .await
        .unwrap();
    assert_eq!(
        outbox.get("bad").await.unwrap().unwrap().state,
        OutboxMessageState::Dead
    );
    assert_eq!(outbox.retry("bad").await.unwrap(), RetryOutcome::Retried);
    assert_eq!(
        outbox.retry("fine").await.unwrap(),
        RetryOutcome::NotRetryable {
            state: "dispatched".into()
        }
    );
    assert_eq!(
        outbox.retry("nobody").await.unwrap(),
        RetryOutcome::NotFound
    );
    publisher.heal("bad");
    let report = dispatch_outbox(&outbox, &publisher, DispatchOptions::new())
        .await
        .unwrap();
    assert_eq!(report.dispatched, 1);
    assert_eq!(outbox.next_due_in().await.unwrap(), None, "nothing open");
    // Purge: only dispatched records older than the cutoff.
    assert_eq!(
        outbox
            .purge_dispatched(Duration::from_secs(3600), 100)
            .await
            .unwrap(),
        0
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        outbox
            .purge_dispatched(Duration::from_millis(1), 1)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        outbox
            .purge_dispatched(Duration::from_millis(1), 100)
            .await
            .unwrap(),
        1
    );
    assert!(bucket.keys().await.is_empty());
    bucket.end().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_dispatchers_on_one_bucket_publish_each_record_once() {
    let bucket = Bucket::new().await;
    let outbox = bucket.outbox();
    for n in 0..300 {
        outbox.enqueue(&event(&format!("r-{n:03}"))).await.unwrap();
    }
    let publisher = Arc::new(RecordingPublisher::new());
    let mut dispatchers = Vec::new();
    for _ in 0..4 {
        dispatchers.push(
            OutboxDispatcher::builder(bucket.outbox(), publisher.clone())
                .batch_size(20)
                .start()
                .unwrap(),
        );
    }
    for _ in 0..200 {
        if publisher.successes().len() >= 300 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for dispatcher in dispatchers {
        dispatcher.shutdown().await;
    }
    let successes = publisher.successes();
    let distinct: HashSet<&String> = successes.iter().collect();
    assert_eq!(
        (successes.len(), distinct.len()),
        (300, 300),
        "each published once"
    );
    assert_eq!(publisher.total_attempts(), 300);
    bucket.end().await;
}

#[tokio::test]
async fn the_kv_inbox_accepts_an_id_once_even_under_a_race() {
    let js = jetstream().await;
    let name = format!(
        "trellis_t_{}",
        ulid::Ulid::generate().to_string().to_lowercase()
    );
    let inbox = Arc::new(NatsKvInboxRepository::open(&js, &name).await.unwrap());
    assert_eq!(inbox.record("evt 1").await.unwrap(), InboxReceipt::Accepted);
    assert_eq!(
        inbox.record("evt 1").await.unwrap(),
        InboxReceipt::Duplicate
    );
    let racers: Vec<_> = (0..10)
        .map(|_| {
            let inbox = inbox.clone();
            tokio::spawn(async move { inbox.record("evt-race").await.unwrap() })
        })
        .collect();
    let mut accepted = 0;
    for racer in racers {
        if racer.await.unwrap().is_accepted() {
            accepted += 1;
        }
    }
    assert_eq!(accepted, 1);
    assert!(matches!(
        inbox.record("").await,
        Err(Error::InvalidMessageId { .. })
    ));
    let _ = js.delete_key_value(&name).await;
}

/// The write lands but its acknowledgement comes after the client's timeout: async-nats'
/// `create` then reads the key back and finds this call's own value. That is the first
/// record of the id, not a duplicate (which would make the caller skip the effect).
#[tokio::test]
async fn the_kv_inbox_accepts_its_own_write_whose_ack_came_late() {
    let js = jetstream().await;
    let name = format!(
        "trellis_t_{}",
        ulid::Ulid::generate().to_string().to_lowercase()
    );
    NatsKvInboxRepository::open(&js, &name).await.unwrap();
    let upstream = trellis_outbox_tests::nats_url()
        .trim_start_matches("nats://")
        .to_owned();
    let relay = Relay::start(upstream).await;
    let paused = relay.paused.clone();
    let slow = async_nats::jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(1))
        .build(async_nats::connect(&relay.url).await.unwrap());
    let inbox = NatsKvInboxRepository::open(&slow, &name).await.unwrap();

    paused.store(true, Ordering::SeqCst);
    let resume = {
        let paused = paused.clone();
        tokio::spawn(async move {
            // After the write's ack timed out (1 s), well within the read-back's.
            tokio::time::sleep(Duration::from_millis(1300)).await;
            paused.store(false, Ordering::SeqCst);
        })
    };
    let receipt = inbox.record("late-ack").await;
    resume.await.unwrap();
    assert_eq!(receipt.unwrap(), InboxReceipt::Accepted);
    // Anyone else is still told it is a duplicate.
    assert_eq!(
        inbox.record("late-ack").await.unwrap(),
        InboxReceipt::Duplicate
    );
    let _ = js.delete_key_value(&name).await;
}
