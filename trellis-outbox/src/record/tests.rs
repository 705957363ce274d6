//! Unit tests of the data model.
use super::*;

fn record() -> PreparedOutboxRecord {
    PreparedOutboxRecord::event("Thing.Changed", "events.v1.Thing.Changed", &1).unwrap()
}

#[test]
fn kinds_and_states_round_trip() {
    for kind in [
        OutboxRecordKind::EventPublish,
        OutboxRecordKind::JobCreate,
        OutboxRecordKind::JobSubmit,
    ] {
        assert_eq!(kind.as_str().parse::<OutboxRecordKind>().unwrap(), kind);
        assert_eq!(serde_json::to_string(&kind).unwrap(), format!("\"{kind}\""));
    }
    for state in [
        OutboxMessageState::Pending,
        OutboxMessageState::Claimed,
        OutboxMessageState::Dispatched,
        OutboxMessageState::Failed,
        OutboxMessageState::Dead,
    ] {
        assert_eq!(state.as_str().parse::<OutboxMessageState>().unwrap(), state);
    }
    assert!(matches!(
        "frozen".parse::<OutboxMessageState>(),
        Err(Error::UnknownState(s)) if s == "frozen"
    ));
    assert!(matches!(
        "Event.Publish".parse::<OutboxRecordKind>(),
        Err(Error::UnknownKind(_))
    ));
}

#[test]
fn validation_names_the_field() {
    type Mutation = fn(&mut PreparedOutboxRecord);
    let cases: Vec<(Mutation, &str)> = vec![
        (|r| r.id.clear(), "`id` is empty"),
        (
            |r| r.id = "a\nb".into(),
            "`id` contains the control character",
        ),
        (
            |r| r.id = "a\r\nb".into(),
            "`id` contains the control character",
        ),
        (
            |r| r.id = " a".into(),
            "`id` starts or ends with whitespace",
        ),
        (
            |r| r.subject = "$JS.API.STREAM.DELETE.x".into(),
            "`subject` starts with the system token `$JS`",
        ),
        (
            |r| r.subject = "$KV.bucket.key".into(),
            "`subject` starts with the system token `$KV`",
        ),
        (|r| r.subject = "$SYS.REQ.x".into(), "system token `$SYS`"),
        (
            |r| r.subject = "_INBOX.x".into(),
            "`subject` is in the `_INBOX` reply namespace",
        ),
        (
            |r| {
                r.headers.insert("Nats-Rollup".into(), "all".into());
            },
            "`headers` \"Nats-Rollup\" is a NATS control header",
        ),
        (
            |r| {
                r.headers
                    .insert("nats-expected-last-sequence".into(), "1".into());
            },
            "\"nats-expected-last-sequence\" is a NATS control header",
        ),
        (
            |r| {
                r.headers.insert("Nats-TTL".into(), "1s".into());
            },
            "\"Nats-TTL\" is a NATS control header",
        ),
        (|r| r.name.clear(), "`name` is empty"),
        (|r| r.subject.clear(), "`subject` is empty"),
        (
            |r| r.subject = "a b".into(),
            "`subject` contains whitespace",
        ),
        (
            |r| r.subject = "a..b".into(),
            "`subject` has an empty token",
        ),
        (|r| r.subject = "a.>".into(), "wildcard token `>`"),
        (|r| r.payload = "{".into(), "`payload` is not valid JSON"),
        (|r| r.payload = "{} x".into(), "`payload` is not valid JSON"),
        (|r| r.payload = String::new(), "`payload` is not valid JSON"),
        (
            |r| {
                r.headers.insert("a b".into(), "v".into());
            },
            "`headers` name \"a b\"",
        ),
        (
            |r| {
                r.headers.insert("a:b".into(), "v".into());
            },
            "`headers` name \"a:b\"",
        ),
        (
            |r| {
                r.headers.insert(String::new(), "v".into());
            },
            "`headers` has an empty name",
        ),
        (
            |r| {
                r.headers.insert("X".into(), "v\r\nY: z".into());
            },
            "line break",
        ),
    ];
    for (mutate, expected) in cases {
        let mut r = record();
        mutate(&mut r);
        let err = r.validate().unwrap_err();
        assert!(
            err.to_string().contains(expected),
            "{err} does not contain {expected}"
        );
    }
    record().validate().unwrap();
    // The dedupe id header itself is allowed, in any letter case.
    let mut r = record();
    r.headers.insert("nats-msg-id".into(), r.id.clone());
    r.validate().unwrap();
}

#[test]
fn ids_are_unique_and_ordered() {
    let ids: Vec<String> = (0..1000).map(|_| new_id()).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
}
