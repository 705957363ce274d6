//! Events made with `#[derive(OutboxEvent)]`, and the trace context attached to records.

use std::collections::BTreeMap;
use std::fmt::{self, Display, Write as _};
use std::future::Future;
use std::sync::OnceLock;

use serde::Serialize;

use crate::descriptor::TRELLIS_EVENT_DESCRIPTOR;
use crate::error::{Error, Result};
use crate::record::{
    NATS_MSG_ID, OutboxRecordKind, PreparedOutboxRecord, TRELLIS_EVENT_TIME, new_id,
};
use crate::subject::escape_subject_token;
use crate::time::{format_timestamp, now_millis};

/// The W3C trace-context header carrying the trace and parent span ids.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C trace-context header carrying vendor-specific trace state.
pub const TRACESTATE: &str = "tracestate";

/// A Trellis event type: a struct with a name and a subject template.
///
/// Derive it with `#[derive(OutboxEvent)]` (feature `macros`, on by default), which also
/// implements [`ToOutboxRecord`](crate::ToOutboxRecord) so `tx.enqueue(&event)` works, and
/// adds the inherent constants `OUTBOX_NAME` and `OUTBOX_SUBJECT`.
///
/// # Examples
///
/// ```
/// use trellis_outbox::{OutboxEvent, OutboxRecordKind, ToOutboxRecord};
///
/// #[derive(serde::Serialize, OutboxEvent)]
/// #[serde(rename_all = "camelCase")]
/// #[outbox(name = "Orders.Shipped", subject = "events.v1.Orders.Shipped.{order_id}")]
/// pub struct OrderShipped {
///     pub order_id: String,
///     pub carrier: String,
/// }
///
/// let event = OrderShipped { order_id: "o.42".into(), carrier: "ups".into() };
/// assert_eq!(OrderShipped::OUTBOX_NAME, "Orders.Shipped");
/// assert_eq!(OrderShipped::OUTBOX_SUBJECT, "events.v1.Orders.Shipped.{order_id}");
/// // Values are escaped, so they can never add a token or a wildcard.
/// assert_eq!(event.subject(), "events.v1.Orders.Shipped.o~2E~42");
///
/// let record = event.to_outbox_record()?;
/// assert_eq!(record.kind, OutboxRecordKind::EventPublish);
/// assert_eq!(record.payload, r#"{"orderId":"o.42","carrier":"ups"}"#);
/// assert_eq!(record.headers["Nats-Msg-Id"], record.id); // a new ULID
/// # Ok::<(), trellis_outbox::Error>(())
/// ```
///
/// Mark a field `#[outbox(id)]` to make the record id (and `Nats-Msg-Id`) deterministic, so
/// enqueueing the same event twice stores it once:
///
/// ```
/// use trellis_outbox::{OutboxEvent, ToOutboxRecord};
///
/// #[derive(serde::Serialize, OutboxEvent)]
/// #[outbox(name = "Invoices.Paid", subject = "events.v1.Invoices.Paid.{invoice}")]
/// struct InvoicePaid {
///     #[outbox(id)]
///     event_id: String,
///     invoice: u64,
/// }
///
/// let record = InvoicePaid { event_id: "paid-7".into(), invoice: 7 }.to_outbox_record()?;
/// assert_eq!(record.id, "paid-7");
/// assert_eq!(record.subject, "events.v1.Invoices.Paid.7");
/// # Ok::<(), trellis_outbox::Error>(())
/// ```
///
/// The id is the row's primary key in the whole outbox table and the `Nats-Msg-Id` JetStream
/// de-duplicates on, so it must name *this* event, not just the entity it is about: two event
/// types marked `#[outbox(id)] order_id` would share ids, and enqueueing the second fails
/// with [`Error::DuplicateIdentity`] (`Outbox message '<id>'
/// already exists with different immutable content`). Namespace the id with the event, e.g.
/// `format!("order-shipped:{order_id}")` in a dedicated field. Enqueueing the same event again
/// (same name, subject, payload and headers; the event time and trace headers may differ) is
/// idempotent and returns the stored row.
///
/// ```
/// use trellis_outbox::{OutboxEvent, ToOutboxRecord};
///
/// #[derive(serde::Serialize, OutboxEvent)]
/// #[outbox(name = "Orders.Shipped", subject = "events.v1.Orders.Shipped.{order_id}")]
/// struct OrderShipped {
///     #[outbox(id)]
///     #[serde(skip)]
///     event_id: String,
///     order_id: String,
/// }
///
/// impl OrderShipped {
///     fn new(order_id: &str) -> Self {
///         Self { event_id: format!("order-shipped:{order_id}"), order_id: order_id.into() }
///     }
/// }
///
/// assert_eq!(OrderShipped::new("o-1").to_outbox_record()?.id, "order-shipped:o-1");
/// # Ok::<(), trellis_outbox::Error>(())
/// ```
///
/// Mistakes are compile errors at the attribute, e.g. a missing `subject`:
///
/// ```compile_fail
/// #[derive(serde::Serialize, trellis_outbox::OutboxEvent)]
/// #[outbox(name = "Orders.Shipped")] // error: missing `subject`
/// struct OrderShipped {
///     order_id: String,
/// }
/// ```
///
/// A literal subject token with a wildcard is rejected too:
///
/// ```compile_fail
/// #[derive(serde::Serialize, trellis_outbox::OutboxEvent)]
/// #[outbox(name = "Orders.Shipped", subject = "events.v1.*.{order_id}")] // error: wildcard
/// struct OrderShipped {
///     order_id: String,
/// }
/// ```
///
/// # Attributes
///
/// | attribute | where | meaning |
/// |---|---|---|
/// | `name = "..."` | struct, required | the event name (record `name`) |
/// | `subject = "..."` | struct, required | the subject template; `{field}` tokens are replaced by the field's escaped `Display` output |
/// | `crate = "path"` | struct | path to `trellis_outbox` when it is re-exported |
/// | `id` | one field | use the field's `Display` output as the record id instead of a new ULID; namespace it per event type (see above) |
/// | `ordering_key` | one field | publish events with the same field value (its `Display` output) in commit order (see [`OrderingKey`](crate::OrderingKey)) |
/// | `ordering = "block" \| "skip_dead"` | struct, with an `ordering_key` field | what a dead head of a key does to the rows after it (default `block`; see [`HeadOfLine`](crate::HeadOfLine)) |
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an outbox event",
    note = "derive it with `#[derive(serde::Serialize, trellis_outbox::OutboxEvent)]` and `#[outbox(name = \"...\", subject = \"...\")]`"
)]
pub trait OutboxEvent {
    /// The event name, e.g. `Orders.Shipped`.
    const NAME: &'static str;
    /// The subject template as written, e.g. `events.v1.Orders.Shipped.{order_id}`.
    const SUBJECT_TEMPLATE: &'static str;

    /// The Trellis event descriptor identity (see [`event_descriptor_identity`]), sent as the
    /// `Trellis-Event-Descriptor` header; `None` (the default) sends none. The derive sets it
    /// from `#[outbox(api = "…")]`.
    ///
    /// [`event_descriptor_identity`]: crate::event_descriptor_identity
    const DESCRIPTOR: Option<&'static str> = None;

    /// The concrete subject: the template with each placeholder replaced by the escaped value.
    fn subject(&self) -> String;

    /// The record id to use, or `None` for a new ULID (the default). Derived from the field
    /// marked `#[outbox(id)]`, if any.
    fn event_id(&self) -> Option<String> {
        None
    }

    /// The key this event is published in order with, or `None` (the default): unordered.
    /// Derived from the field marked `#[outbox(ordering_key)]` (its `Display` output) with
    /// the policy of `#[outbox(ordering = "block" | "skip_dead")]`. See [`OrderingKey`].
    ///
    /// [`OrderingKey`]: crate::OrderingKey
    fn ordering_key(&self) -> Option<crate::record::OrderingKey> {
        None
    }

    /// Builds the `event.publish` record (spec §C.1): id = [`OutboxEvent::event_id`] or a new
    /// ULID, payload = the event serialized with serde_json, headers `Nats-Msg-Id` = id,
    /// `Trellis-Event-Time` = now and, when [`TraceContext::current`] returns a valid context,
    /// `traceparent`/`tracestate`.
    ///
    /// # Errors
    ///
    /// [`Error::Serialize`] if the event cannot be serialized.
    fn to_event_record(&self) -> Result<PreparedOutboxRecord>
    where
        Self: Serialize,
    {
        let payload = serde_json::to_string(self).map_err(|source| Error::Serialize {
            what: "event payload",
            source,
        })?;
        let id = self.event_id().unwrap_or_else(new_id);
        let mut headers = BTreeMap::new();
        headers.insert(NATS_MSG_ID.to_owned(), id.clone());
        headers.insert(
            TRELLIS_EVENT_TIME.to_owned(),
            format_timestamp(now_millis()),
        );
        if let Some(descriptor) = Self::DESCRIPTOR {
            headers.insert(TRELLIS_EVENT_DESCRIPTOR.to_owned(), descriptor.to_owned());
        }
        if let Some(context) = TraceContext::current().filter(TraceContext::is_valid) {
            context.insert_headers(&mut headers);
        }
        Ok(PreparedOutboxRecord {
            id,
            kind: OutboxRecordKind::EventPublish,
            name: Self::NAME.to_owned(),
            subject: self.subject(),
            payload,
            headers,
            ordering: self.ordering_key(),
        })
    }
}

/// A W3C trace context (`traceparent` and optional `tracestate`) to attach to outbox records.
///
/// trellis-outbox has no OpenTelemetry dependency. Records pick up the *current* context,
/// which is, in order:
///
/// 1. the innermost [`TraceContext::scope`] / [`TraceContext::sync_scope`] around the call;
/// 2. otherwise what the provider installed with [`TraceContext::set_provider`] returns
///    (for example a function reading the current OpenTelemetry span);
/// 3. otherwise none.
///
/// Events get `traceparent`/`tracestate` headers only when the current context is valid. Jobs
/// always get a `traceparent`: the current one if valid, otherwise a synthesized
/// `00-<32 hex>-<16 hex>-01` (spec §D.2); `tracestate` is only sent with a current context.
///
/// # Examples
///
/// ```
/// use trellis_outbox::{OutboxEvent, ToOutboxRecord, TraceContext};
///
/// #[derive(serde::Serialize, OutboxEvent)]
/// #[outbox(name = "Health.Ping", subject = "events.v1.Health.Ping")]
/// struct Ping {}
///
/// let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
/// let record = TraceContext::new(parent, Some("vendor=1".into()))
///     .sync_scope(|| Ping {}.to_outbox_record())?;
/// assert_eq!(record.headers["traceparent"], parent);
/// assert_eq!(record.headers["tracestate"], "vendor=1");
///
/// // Outside a scope (and with no provider) there are no trace headers.
/// assert!(!Ping {}.to_outbox_record()?.headers.contains_key("traceparent"));
/// # Ok::<(), trellis_outbox::Error>(())
/// ```
///
/// In async code, wrap the handler's future:
///
/// ```no_run
/// # use trellis_outbox::TraceContext;
/// # async fn handle() {}
/// # async fn run(traceparent: String) {
/// TraceContext::new(traceparent, None).scope(handle()).await;
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TraceContext {
    traceparent: String,
    tracestate: Option<String>,
}

tokio::task_local! {
    static CURRENT: TraceContext;
}

static PROVIDER: OnceLock<fn() -> Option<TraceContext>> = OnceLock::new();

impl TraceContext {
    /// A context from header values. It is not checked here; an invalid `traceparent` is
    /// treated as no context when a record is built (see [`TraceContext::is_valid`]).
    pub fn new(traceparent: impl Into<String>, tracestate: Option<String>) -> Self {
        Self {
            traceparent: traceparent.into(),
            tracestate,
        }
    }

    /// A new random context, `00-<32 hex>-<16 hex>-01`, as Trellis synthesizes for jobs.
    ///
    /// ```
    /// let context = trellis_outbox::TraceContext::random();
    /// assert!(context.is_valid());
    /// assert_eq!(context.traceparent().len(), 55);
    /// assert!(context.traceparent().starts_with("00-") && context.traceparent().ends_with("-01"));
    /// ```
    pub fn random() -> Self {
        // W3C trace context forbids all-zero ids; the thread's CSPRNG makes one unlikely
        // enough that mapping it to 1 costs no uniqueness.
        let trace_id = rand::random::<u128>().max(1);
        let span_id = rand::random::<u64>().max(1);
        Self {
            traceparent: format!("00-{trace_id:032x}-{span_id:016x}-01"),
            tracestate: None,
        }
    }

    /// The `traceparent` header value.
    pub fn traceparent(&self) -> &str {
        &self.traceparent
    }

    /// The `tracestate` header value, if any.
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// The 32-hex-digit trace id (`traceparent[3..35]`), if the context is valid.
    pub fn trace_id(&self) -> Option<&str> {
        self.is_valid()
            .then(|| self.traceparent.get(3..35))
            .flatten()
    }

    /// Whether `traceparent` is valid as Trellis checks it:
    /// `^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$`, with a trace id and a parent id
    /// that are not all zeros.
    ///
    /// ```
    /// use trellis_outbox::TraceContext;
    ///
    /// assert!(TraceContext::new("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None).is_valid());
    /// assert!(!TraceContext::new("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None).is_valid());
    /// assert!(!TraceContext::new("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", None).is_valid());
    /// assert!(!TraceContext::new("garbage", None).is_valid());
    /// ```
    pub fn is_valid(&self) -> bool {
        let parts: Vec<&str> = self.traceparent.split('-').collect();
        let hex = |s: &str, len: usize| {
            s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
        matches!(parts.as_slice(), [version, trace, parent, flags]
            if hex(version, 2) && hex(trace, 32) && hex(parent, 16) && hex(flags, 2)
                && nonzero(trace) && nonzero(parent))
    }

    /// The current context: the innermost scope's, else the provider's, else `None`.
    pub fn current() -> Option<TraceContext> {
        CURRENT
            .try_with(Clone::clone)
            .ok()
            .or_else(|| PROVIDER.get().and_then(|provider| provider()))
    }

    /// Runs `future` with this context as the current one (a tokio task-local).
    pub async fn scope<F: Future>(self, future: F) -> F::Output {
        CURRENT.scope(self, future).await
    }

    /// Runs `f` with this context as the current one, in synchronous code.
    pub fn sync_scope<R>(self, f: impl FnOnce() -> R) -> R {
        CURRENT.sync_scope(self, f)
    }

    /// Installs a process-wide provider, consulted when no scope is active; for example a
    /// function that formats the current OpenTelemetry span context. Only the first call
    /// succeeds: it returns `false` if a provider was already installed.
    ///
    /// ```no_run
    /// use trellis_outbox::TraceContext;
    ///
    /// fn from_my_tracer() -> Option<TraceContext> {
    ///     Some(TraceContext::new("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None))
    /// }
    ///
    /// assert!(TraceContext::set_provider(from_my_tracer));
    /// assert!(TraceContext::current().is_some());
    /// ```
    pub fn set_provider(provider: fn() -> Option<TraceContext>) -> bool {
        PROVIDER.set(provider).is_ok()
    }

    /// Adds `traceparent` and, when present and a header value NATS can carry (no control
    /// character but tab), `tracestate`: an unusable ambient `tracestate` is dropped, not
    /// allowed to fail every enqueue in its scope.
    pub(crate) fn insert_headers(self, headers: &mut BTreeMap<String, String>) {
        headers.insert(TRACEPARENT.to_owned(), self.traceparent);
        if let Some(state) = self
            .tracestate
            .filter(|s| !s.is_empty() && crate::wire::header_value_problem(TRACESTATE, s).is_none())
        {
            headers.insert(TRACESTATE.to_owned(), state);
        }
    }
}

impl Display for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.traceparent)
    }
}

/// Appends `value`'s `Display` output to `out` as a current-wire Trellis event parameter
/// (unpadded base64url of its UTF-8 text, as `trellis_event_subject` writes it). Used by the
/// code `#[derive(OutboxEvent)]` generates for `api` events on `events.v1.<base64url(api)>.…`.
pub(crate) fn push_param_token<T: Display + ?Sized>(out: &mut String, value: &T) {
    let mut text = String::new();
    let _ = write!(text, "{value}");
    crate::descriptor::push_event_param(out, &text);
}

/// Appends `value`'s `Display` output to `out`, escaped as one subject token. Used by the
/// code `#[derive(OutboxEvent)]` generates.
pub(crate) fn push_subject_token<T: Display + ?Sized>(out: &mut String, value: &T) {
    let mut text = String::new();
    // Writing to a String cannot fail unless `Display` itself reports an error, in which
    // case whatever was written is used (as `to_string` would panic instead).
    let _ = write!(text, "{value}");
    out.push_str(&escape_subject_token(&text));
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn random_contexts_are_valid_and_distinct() {
        let a = TraceContext::random();
        let b = TraceContext::random();
        assert!(a.is_valid() && b.is_valid());
        assert_ne!(a, b);
        assert_eq!(a.trace_id().map(str::len), Some(32));
    }

    #[test]
    fn validity() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(!TraceContext::new(bad, None).is_valid(), "{bad}");
        }
    }

    #[test]
    fn scopes_nest() {
        let outer = TraceContext::random();
        let inner = TraceContext::random();
        outer.clone().sync_scope(|| {
            assert_eq!(TraceContext::current(), Some(outer.clone()));
            inner
                .clone()
                .sync_scope(|| assert_eq!(TraceContext::current(), Some(inner.clone())));
            assert_eq!(TraceContext::current(), Some(outer.clone()));
        });
    }

    #[test]
    fn tracestate_with_control_characters_is_dropped() {
        for state in ["a\r\nb", "a\u{1b}b", "k=v\u{85}", ""] {
            let mut headers = BTreeMap::new();
            TraceContext::new(TraceContext::random().traceparent, Some(state.into()))
                .insert_headers(&mut headers);
            assert!(headers.contains_key(TRACEPARENT));
            assert!(!headers.contains_key(TRACESTATE), "{state:?} was kept");
        }
        let mut headers = BTreeMap::new();
        TraceContext::new(TraceContext::random().traceparent, Some("a=1,\tb=2".into()))
            .insert_headers(&mut headers);
        assert_eq!(headers[TRACESTATE], "a=1,\tb=2");
    }

    #[test]
    fn pushes_escaped_tokens() {
        let mut s = String::from("a.");
        push_subject_token(&mut s, "x.y");
        push_subject_token(&mut s, &42);
        assert_eq!(s, "a.x~2E~y42");
    }
}
