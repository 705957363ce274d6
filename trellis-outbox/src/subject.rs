//! NATS subject rules: validating subjects and escaping values placed into them.

use std::borrow::Cow;

/// Whether `c` is matched by JavaScript's `\s` (WhiteSpace and LineTerminator).
///
/// Trellis escapes exactly this set, so the port must not use Rust's `char::is_whitespace`,
/// which differs (it includes U+0085 and excludes U+FEFF).
pub(crate) fn is_js_whitespace(c: char) -> bool {
    matches!(
        c,
        '\t' | '\n' | '\u{b}' | '\u{c}' | '\r' | ' ' | '\u{a0}' | '\u{1680}' | '\u{2000}'
            ..='\u{200a}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202f}'
                | '\u{205f}'
                | '\u{3000}'
                | '\u{feff}'
    )
}

/// Escapes a value so it is exactly one literal NATS subject token, as Trellis does
/// (spec §C.1 step 2).
///
/// Every character matching `[\u0000\s.*>~]` becomes `~HEX~` (the code point in uppercase
/// hexadecimal), and an empty result or one starting with `$` gets a `_` prefix. A value can
/// therefore never add a token, a wildcard, or reach a `$`-prefixed system subject.
///
/// Beyond Trellis, the other ASCII control characters (U+0001–U+001F, U+007F), which
/// Trellis leaves in place, are escaped the same way: a subject cannot carry them, so enqueue
/// would refuse the record. Values without them escape exactly as in Trellis.
///
/// # Examples
///
/// ```
/// use trellis_outbox::escape_subject_token;
///
/// assert_eq!(escape_subject_token("order-42"), "order-42");
/// assert_eq!(escape_subject_token("a.b"), "a~2E~b");
/// assert_eq!(escape_subject_token("a b"), "a~20~b");
/// assert_eq!(escape_subject_token("*"), "~2A~");
/// assert_eq!(escape_subject_token(">"), "~3E~");
/// assert_eq!(escape_subject_token("~"), "~7E~");
/// assert_eq!(escape_subject_token(""), "_");
/// assert_eq!(escape_subject_token("$x"), "_$x");
/// assert_eq!(escape_subject_token("a\u{1}b"), "a~1~b");
/// ```
pub fn escape_subject_token(value: &str) -> Cow<'_, str> {
    let needs_escape =
        |c: char| matches!(c, '.' | '*' | '>' | '~') || c.is_ascii_control() || is_js_whitespace(c);
    let escaped: Cow<'_, str> = if value.chars().any(needs_escape) {
        let mut out = String::with_capacity(value.len() + 8);
        for c in value.chars() {
            if needs_escape(c) {
                out.push('~');
                out.push_str(&format!("{:X}", u32::from(c)));
                out.push('~');
            } else {
                out.push(c);
            }
        }
        Cow::Owned(out)
    } else {
        Cow::Borrowed(value)
    };
    if escaped.is_empty() || escaped.starts_with('$') {
        Cow::Owned(format!("_{escaped}"))
    } else {
        escaped
    }
}

/// The first token of the reply subjects NATS clients use (async-nats' default inbox prefix).
pub(crate) const INBOX_PREFIX: &str = "_INBOX";

/// Checks that `subject` is a literal NATS subject an outbox row may be published to.
///
/// Returns a description of the first problem: empty, whitespace or control characters,
/// an empty token (leading, trailing or doubled `.`), a `*`/`>` wildcard token, a first
/// token starting with `$` (the server's control plane: `$JS` JetStream API, `$KV`, `$O`,
/// `$SYS`, …) or a first token `_INBOX` (request replies).
pub(crate) fn subject_problem(subject: &str) -> Option<String> {
    if subject.is_empty() {
        return Some("is empty".into());
    }
    // Printable ASCII holds no whitespace and no control character: the common case, read
    // byte by byte (this runs for every claimed row).
    if !subject.bytes().all(|b| b.is_ascii_graphic())
        && let Some(c) = subject
            .chars()
            .find(|&c| is_js_whitespace(c) || c.is_ascii_control())
    {
        return Some(format!(
            "contains whitespace or a control character ({c:?})"
        ));
    }
    for (index, token) in subject.split('.').enumerate() {
        match token {
            "" => return Some(format!("has an empty token at position {}", index + 1)),
            "*" | ">" => {
                return Some(format!(
                    "contains the wildcard token `{token}`; outbox subjects must be literal"
                ));
            }
            _ => {}
        }
    }
    let first = subject.split('.').next().unwrap_or_default();
    if first.starts_with('$') {
        return Some(format!(
            "starts with the system token `{first}`: `$`-prefixed subjects reach the NATS \
             server's control plane (JetStream API, KV, system account), not a stream"
        ));
    }
    if first == INBOX_PREFIX {
        return Some(format!(
            "is in the `{INBOX_PREFIX}` reply namespace, where clients receive request replies"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_like_trellis() {
        assert_eq!(escape_subject_token("\0"), "~0~");
        assert_eq!(escape_subject_token("a\tb"), "a~9~b");
        assert_eq!(escape_subject_token("\u{3000}"), "~3000~");
        assert_eq!(escape_subject_token("\u{feff}"), "~FEFF~");
        // U+0085 is not in JavaScript's \s, so Trellis keeps it.
        assert_eq!(escape_subject_token("\u{85}"), "\u{85}");
        assert_eq!(escape_subject_token("ünïcødé"), "ünïcødé");
        assert_eq!(escape_subject_token("$"), "_$");
        assert_eq!(escape_subject_token("x$"), "x$");
        // Beyond Trellis: ASCII controls a subject cannot carry are escaped, so every
        // escaped value makes a subject enqueue accepts.
        assert_eq!(escape_subject_token("a\u{1}b\u{1b}\u{7f}"), "a~1~b~1B~~7F~");
        for c in (0u8..=0x7f).map(char::from) {
            let subject = format!("events.{}", escape_subject_token(&c.to_string()));
            assert_eq!(subject_problem(&subject), None, "{c:?} -> {subject}");
        }
    }

    #[test]
    fn validates_subjects() {
        assert_eq!(subject_problem("events.v1.Thing.Changed"), None);
        assert_eq!(subject_problem("events.v1.a*b.c>d"), None);
        for bad in [
            "", "a b", "a..b", ".a", "a.", "a.*.b", "a.>", "a\nb", "a\0b",
        ] {
            assert!(subject_problem(bad).is_some(), "{bad:?} accepted");
        }
    }

    #[test]
    fn refuses_the_control_plane() {
        assert_eq!(subject_problem("events.$JS.x"), None);
        assert_eq!(subject_problem("_INBOXES.x"), None);
        assert_eq!(subject_problem("events._INBOX.x"), None);
        for bad in [
            "$JS.API.STREAM.DELETE.x",
            "$JS",
            "$KV.bucket.key",
            "$SYS.REQ.SERVER.PING",
            "$O.store.x",
            "$JSC.x",
            "_INBOX.abc",
            "_INBOX",
        ] {
            assert!(subject_problem(bad).is_some(), "{bad:?} accepted");
        }
    }
}
