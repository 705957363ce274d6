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

/// The methods of an error type made of a boxed `source` and a `retryable` flag
/// ([`PublishError`](crate::PublishError), [`HandlerError`](crate::HandlerError)): the two
/// constructors (documented by the caller), `is_retryable`, `source_error`, `chain`, and a
/// `Display` that shows the source.
macro_rules! retry_classified {
    ($ty:ident, retryable: $retryable:literal, permanent: $permanent:literal) => {
        impl $ty {
            #[doc = $retryable]
            pub fn retryable(source: impl Into<$crate::dispatch::BoxError>) -> Self {
                Self {
                    retryable: true,
                    source: source.into(),
                }
            }

            #[doc = $permanent]
            pub fn permanent(source: impl Into<$crate::dispatch::BoxError>) -> Self {
                Self {
                    retryable: false,
                    source: source.into(),
                }
            }

            /// Whether a later attempt may succeed.
            pub fn is_retryable(&self) -> bool {
                self.retryable
            }

            /// The underlying error.
            pub fn source_error(&self) -> &(dyn ::std::error::Error + Send + Sync + 'static) {
                &*self.source
            }

            /// The error and its whole cause chain, `outer: inner: innermost`.
            pub fn chain(&self) -> String {
                $crate::chain::error_chain(&*self.source)
            }
        }

        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                ::std::fmt::Display::fmt(&self.source, f)
            }
        }
    };
}
pub(crate) use retry_classified;

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
