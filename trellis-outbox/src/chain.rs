//! One way to write an error with its causes, for logs and for `last_error`.

use std::error::Error as StdError;

/// `error` and its whole cause chain, `outer: inner: innermost`.
///
/// A cause whose text already ends the chain written so far is skipped: many errors repeat
/// their source in their own message (`#[error("…: {0}")]`), and writing it twice would
/// only make the stored text longer.
pub(crate) fn error_chain(error: &(dyn StdError + 'static)) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(cause) = next {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        next = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("outer: {0}")]
    struct Repeating(#[source] std::io::Error);

    #[test]
    fn writes_each_cause_once() {
        let io = || std::io::Error::other("inner");
        assert_eq!(error_chain(&Outer(io())), "outer: inner");
        assert_eq!(error_chain(&Repeating(io())), "outer: inner");
    }
}
