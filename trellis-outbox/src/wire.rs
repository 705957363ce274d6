//! What may reach NATS: the rules for row ids (sent as `Nats-Msg-Id`), header names and
//! values, and subjects. Shared by enqueue validation ([`PreparedOutboxRecord::validate`]),
//! the claim's decode step ([`Claim`](crate::Claim)) and the JetStream publisher, so a row
//! that enqueue would refuse is never sent, whoever wrote it.
//!
//! The header rules match what async-nats 0.51 accepts without panicking
//! (`HeaderName::from_str`: printable ASCII without `:`; `HeaderValue::from_str`: no CR or
//! LF), plus an empty name, which async-nats accepts but which puts a header line without a
//! name on the wire.
//!
//! [`PreparedOutboxRecord::validate`]: crate::PreparedOutboxRecord::validate

use std::collections::BTreeMap;

use crate::record::NATS_MSG_ID;
use crate::subject::subject_problem;

/// Which part of a message a [`WireProblem`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WireField {
    Id,
    Subject,
    Headers,
}

impl WireField {
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            WireField::Id => "id",
            WireField::Subject => "subject",
            WireField::Headers => "headers",
        }
    }
}

/// Why a message cannot be sent as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WireProblem {
    pub(crate) field: WireField,
    pub(crate) problem: String,
}

impl WireProblem {
    fn new(field: WireField, problem: impl Into<String>) -> Self {
        Self {
            field,
            problem: problem.into(),
        }
    }
}

/// Checks a row id, which JetStream receives as the `Nats-Msg-Id` header value.
///
/// Refused: empty; any control character (CR and LF would break the header block, NUL and
/// the rest are not text); leading or trailing whitespace (the server trims header values,
/// so ` a` would be de-duplicated as `a`).
pub(crate) fn id_problem(id: &str) -> Option<String> {
    if id.is_empty() {
        return Some("is empty".into());
    }
    // Printable ASCII (a ULID) holds no control character and no whitespace: the common
    // case, read byte by byte (this runs for every claimed row).
    if id.bytes().all(|b| b.is_ascii_graphic()) {
        return None;
    }
    if let Some(c) = id.chars().find(|c| c.is_control()) {
        return Some(format!(
            "contains the control character {c:?}; the id is sent as the `{NATS_MSG_ID}` header"
        ));
    }
    if id.starts_with(char::is_whitespace) || id.ends_with(char::is_whitespace) {
        return Some(format!(
            "starts or ends with whitespace, which NATS trims from the `{NATS_MSG_ID}` header"
        ));
    }
    None
}

/// Checks a header name: non-empty printable ASCII without `:` (what async-nats'
/// `HeaderName::from_str` accepts, minus the empty name).
pub(crate) fn header_name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        return Some("has an empty name".into());
    }
    name.chars()
        .find(|&c| !c.is_ascii_graphic() || c == ':')
        .map(|c| {
            format!(
                "name {name:?} contains {c:?}; NATS header names are printable ASCII without ':'"
            )
        })
}

/// Checks a header value: no CR or LF (async-nats' `HeaderValue::from_str` refuses them:
/// they would end the header line) and no other control character except horizontal tab
/// (HTTP field values, which NATS headers follow, allow only visible characters, space and
/// tab; NUL, ESC or DEL reach consumers as garbage or break their parsers).
pub(crate) fn header_value_problem(name: &str, value: &str) -> Option<String> {
    // Printable ASCII, space and tab: the common case, read byte by byte.
    if value
        .bytes()
        .all(|b| b == b'\t' || (b' '..=b'~').contains(&b))
    {
        return None;
    }
    if value.contains(['\r', '\n']) {
        return Some(format!(
            "value of {name:?} contains a line break (CR or LF)"
        ));
    }
    value
        .chars()
        .find(|&c| c.is_control() && c != '\t')
        .map(|c| {
            format!("value of {name:?} contains the control character {c:?} (only tab is allowed)")
        })
}

/// Whether `name` is a NATS/JetStream control header other than `Nats-Msg-Id`: any name
/// starting with `Nats-` in any letter case (`Nats-Rollup`, `Nats-Expected-Stream`,
/// `Nats-Expected-Last-Sequence`, `Nats-TTL`, `Nats-Marker-Reason`, …). Such headers can
/// purge or alter a stream, so an outbox row may not carry them.
pub(crate) fn is_control_header(name: &str) -> bool {
    name.get(..5)
        .is_some_and(|prefix| prefix.eq_ignore_ascii_case("Nats-"))
        && !name.eq_ignore_ascii_case(NATS_MSG_ID)
}

/// The problem with a NATS control header, for enqueue and the claim check.
pub(crate) fn control_header_problem(name: &str) -> Option<String> {
    is_control_header(name).then(|| {
        format!(
            "{name:?} is a NATS control header; only `{NATS_MSG_ID}` of the `Nats-*` headers \
             may be stored (others can purge or alter the stream)"
        )
    })
}

/// The first problem of one header: its name, a control header, or its value.
pub(crate) fn header_problem(name: &str, value: &str) -> Option<String> {
    header_name_problem(name)
        .or_else(|| control_header_problem(name))
        .or_else(|| header_value_problem(name, value))
}

/// The first reason a message with this id, subject and headers must not be sent to NATS.
pub(crate) fn message_problem(
    id: &str,
    subject: &str,
    headers: &BTreeMap<String, String>,
) -> Option<WireProblem> {
    if let Some(problem) = id_problem(id) {
        return Some(WireProblem::new(WireField::Id, problem));
    }
    if let Some(problem) = subject_problem(subject) {
        return Some(WireProblem::new(WireField::Subject, problem));
    }
    headers
        .iter()
        .find_map(|(name, value)| header_problem(name, value))
        .map(|problem| WireProblem::new(WireField::Headers, problem))
}

#[cfg(test)]
mod tests {
    #[cfg(feature = "nats")]
    use std::str::FromStr;

    use super::*;

    /// The byte-wise fast paths decide as the character rules do, for every character of
    /// the Basic Multilingual Plane (and some beyond) in the middle of an id, a subject and
    /// a header value.
    #[test]
    fn fast_paths_agree_with_the_character_rules() {
        for c in (0..=0xffff_u32)
            .chain([0x1_0000, 0x1_f600, 0x10_ffff])
            .filter_map(char::from_u32)
        {
            assert_eq!(
                id_problem(&format!("a{c}b")).is_some(),
                c.is_control(),
                "{c:?}"
            );
            let subject = format!("events.a{c}b");
            let bad_subject = crate::subject::is_js_whitespace(c) || c.is_ascii_control();
            assert_eq!(
                crate::subject::subject_problem(&subject).is_some(),
                bad_subject,
                "{c:?}"
            );
            let bad_value = c.is_control() && c != '\t';
            assert_eq!(
                header_value_problem("X", &format!("a{c}b")).is_some(),
                bad_value,
                "{c:?}"
            );
        }
    }

    #[test]
    fn ids() {
        assert_eq!(id_problem("01JABC"), None);
        assert_eq!(id_problem("order-shipped:o 1"), None);
        for bad in [
            "", "a\r\nb", "a\nb", "a\0b", "a\u{7f}", "a\u{85}", " a", "a ",
        ] {
            assert!(id_problem(bad).is_some(), "{bad:?} accepted");
        }
    }

    #[cfg(feature = "nats")]
    #[test]
    fn header_rules_match_what_async_nats_accepts() {
        for name in ["X", "traceparent", "Nats-Msg-Id", "a-b_c.d", "~!"] {
            assert_eq!(header_name_problem(name), None);
            assert!(async_nats::HeaderName::from_str(name).is_ok());
        }
        for name in ["a b", "a:b", "é", "a\tb", "a\r\n"] {
            assert!(header_name_problem(name).is_some(), "{name:?} accepted");
            assert!(async_nats::HeaderName::from_str(name).is_err(), "{name:?}");
        }
        assert!(header_name_problem("").is_some());
        for value in ["", "v", "a b", "é", "a\tb"] {
            assert_eq!(header_value_problem("X", value), None);
            assert!(async_nats::HeaderValue::from_str(value).is_ok());
        }
        for value in ["a\rb", "a\nb", "\r\nNats-Rollup: all"] {
            assert!(header_value_problem("X", value).is_some(), "{value:?}");
            assert!(async_nats::HeaderValue::from_str(value).is_err());
        }
        // async-nats would send these; we refuse them like HTTP field values do.
        for value in ["a\0b", "\u{1b}[31m", "a\u{7f}", "a\u{85}"] {
            let problem = header_value_problem("X", value);
            assert!(
                problem
                    .as_deref()
                    .is_some_and(|p| p.contains("control character")),
                "{value:?}: {problem:?}"
            );
        }
    }

    #[test]
    fn control_headers() {
        for name in [
            "Nats-Rollup",
            "nats-rollup",
            "NATS-EXPECTED-STREAM",
            "Nats-Expected-Last-Sequence",
            "Nats-TTL",
            "Nats-Marker-Reason",
            "Nats-",
        ] {
            assert!(is_control_header(name), "{name}");
            assert!(header_problem(name, "all").is_some());
        }
        for name in [
            "Nats-Msg-Id",
            "nats-msg-id",
            "Nats",
            "NatsRollup",
            "X-Nats-Rollup",
            "é",
        ] {
            assert!(!is_control_header(name), "{name}");
        }
    }

    #[test]
    fn message_problem_names_the_field() {
        let ok = BTreeMap::from([("X".to_owned(), "v".to_owned())]);
        assert_eq!(message_problem("a", "events.a", &ok), None);
        let field = |id: &str, subject: &str, headers: &BTreeMap<String, String>| {
            message_problem(id, subject, headers).map(|p| p.field)
        };
        assert_eq!(field("a\r\n", "events.a", &ok), Some(WireField::Id));
        assert_eq!(
            field("a", "$JS.API.STREAM.DELETE.x", &ok),
            Some(WireField::Subject)
        );
        let rollup = BTreeMap::from([("Nats-Rollup".to_owned(), "all".to_owned())]);
        assert_eq!(field("a", "events.a", &rollup), Some(WireField::Headers));
    }
}
