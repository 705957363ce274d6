//! OpenTelemetry trace propagation (feature `opentelemetry`): the trace context of the
//! current span goes into each record at enqueue, and publishing a row — and consuming it —
//! runs in a span whose parent is that stored context, so one trace runs from the handler
//! that enqueued an event, through the outbox, to the consumer that applied it.
//!
//! With [`tracing-opentelemetry`](https://docs.rs/tracing-opentelemetry), the current
//! `tracing` span's OpenTelemetry context is used; otherwise OpenTelemetry's own current
//! context.

use std::collections::BTreeMap;
use std::str::FromStr as _;

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::event::{TRACEPARENT, TRACESTATE, TraceContext};

/// The W3C trace context of the current span, if it has a valid one: the current `tracing`
/// span's OpenTelemetry context (tracing-opentelemetry), else
/// `opentelemetry::Context::current()`.
///
/// ```
/// // Outside any span there is no context.
/// assert_eq!(trellis_outbox::opentelemetry_trace_context(), None);
/// ```
pub fn opentelemetry_trace_context() -> Option<TraceContext> {
    let from_tracing = tracing::Span::current().context();
    let span = from_tracing.span();
    let context = if span.span_context().is_valid() {
        span.span_context().clone()
    } else {
        opentelemetry::Context::current()
            .span()
            .span_context()
            .clone()
    };
    if !context.is_valid() {
        return None;
    }
    let state = context.trace_state().header();
    Some(TraceContext::new(
        format!(
            "00-{}-{}-{:02x}",
            context.trace_id(),
            context.span_id(),
            context.trace_flags().to_u8()
        ),
        (!state.is_empty()).then_some(state),
    ))
}

/// Makes records take their trace context from OpenTelemetry
/// ([`opentelemetry_trace_context`]) when no [`TraceContext::scope`] is set: installs it as
/// the [`TraceContext::set_provider`]. Returns `false` if a provider was already installed.
///
/// ```
/// trellis_outbox::use_opentelemetry_trace_context();
/// ```
pub fn use_opentelemetry_trace_context() -> bool {
    TraceContext::set_provider(opentelemetry_trace_context)
}

/// The OpenTelemetry context a row or message carries in `traceparent`/`tracestate`, if it
/// is valid.
pub(crate) fn stored_context<'a>(
    mut header: impl FnMut(&str) -> Option<&'a str>,
) -> Option<opentelemetry::Context> {
    let traceparent = header(TRACEPARENT)?;
    let parts: Vec<&str> = traceparent.split('-').collect();
    let [_, trace, span, flags] = parts.as_slice() else {
        return None;
    };
    if !TraceContext::new(traceparent, None).is_valid() {
        return None;
    }
    let flags = u8::from_str_radix(flags, 16).ok()?;
    let state = header(TRACESTATE)
        .and_then(|s| TraceState::from_str(s).ok())
        .unwrap_or_default();
    let remote = SpanContext::new(
        TraceId::from_hex(trace).ok()?,
        SpanId::from_hex(span).ok()?,
        TraceFlags::new(flags),
        true,
        state,
    );
    Some(opentelemetry::Context::new().with_remote_span_context(remote))
}

/// Makes `span` a child of the context stored in `headers` (a row's), if any.
pub(crate) fn adopt_stored(span: &tracing::Span, headers: &BTreeMap<String, String>) {
    if let Some(parent) = stored_context(|name| headers.get(name).map(String::as_str)) {
        let _ = span.set_parent(parent);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use opentelemetry::trace::TraceContextExt as _;

    use super::stored_context;

    #[test]
    fn a_stored_traceparent_becomes_a_remote_parent() {
        let headers = BTreeMap::from([
            (
                "traceparent".to_owned(),
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
            ),
            ("tracestate".to_owned(), "vendor=1".to_owned()),
        ]);
        let context = stored_context(|n| headers.get(n).map(String::as_str)).unwrap();
        let span = context.span();
        let parent = span.span_context();
        assert_eq!(
            parent.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(parent.span_id().to_string(), "00f067aa0ba902b7");
        assert!(parent.is_sampled() && parent.is_remote());
        assert_eq!(parent.trace_state().header(), "vendor=1");
        let bad = BTreeMap::from([("traceparent".to_owned(), "garbage".to_owned())]);
        assert!(stored_context(|n| bad.get(n).map(String::as_str)).is_none());
    }
}
