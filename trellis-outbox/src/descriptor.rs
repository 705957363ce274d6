//! Trellis event descriptor identities (the `Trellis-Event-Descriptor` header).

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use crate::error::{Error, Result};
use crate::record::PreparedOutboxRecord;

/// The header carrying an event's descriptor identity. Current Trellis dispatchers refuse an
/// `event.publish` row without it ("Outbox event descriptor identity is required").
pub const TRELLIS_EVENT_DESCRIPTOR: &str = "Trellis-Event-Descriptor";

/// Why `api_id` is not a Trellis API identity (`<name>@v<major>`, e.g. `orders@v1` or
/// `trellis.auth@v1`), if it is not.
pub(crate) fn api_id_problem(api_id: &str) -> Option<&'static str> {
    let Some((name, major)) = api_id.rsplit_once("@v") else {
        return Some("must end with `@v<major>`, e.g. `orders@v1`");
    };
    if name.is_empty() {
        return Some("needs a name before `@v<major>`, e.g. `orders@v1`");
    }
    if major.is_empty() || !major.bytes().all(|b| b.is_ascii_digit()) {
        return Some("must end with `@v` and a major version number, e.g. `orders@v1`");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
    {
        return Some("may hold only ASCII letters, digits, `.`, `-` and `_` before `@v<major>`");
    }
    None
}

/// The descriptor identity of event `event_name` of API `api_id` whose subject has
/// `parameter_count` placeholders, in Trellis' format:
/// `v1.<base64url(api_id)>.<base64url(event_name)>.<parameter_count>` (unpadded URL-safe
/// base64 of the UTF-8 text). It is reversible, not a hash.
///
/// # Errors
///
/// [`Error::InvalidDescriptor`] when `api_id` is not `<name>@v<major>` or `event_name` is empty
/// or holds whitespace or control characters.
///
/// # Examples
///
/// ```
/// use trellis_outbox::event_descriptor_identity;
///
/// assert_eq!(
///     event_descriptor_identity("test@v1", "Connections.Opened", 0)?,
///     "v1.dGVzdEB2MQ.Q29ubmVjdGlvbnMuT3BlbmVk.0",
/// );
/// assert!(event_descriptor_identity("orders", "Orders.Placed", 0).is_err());
/// # Ok::<(), trellis_outbox::Error>(())
/// ```
pub fn event_descriptor_identity(
    api_id: &str,
    event_name: &str,
    parameter_count: u32,
) -> Result<String> {
    if let Some(problem) = api_id_problem(api_id) {
        return Err(Error::InvalidDescriptor {
            api_id: api_id.to_owned(),
            event_name: event_name.to_owned(),
            problem: format!("the API identity {problem}"),
        });
    }
    if event_name.is_empty()
        || event_name
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(Error::InvalidDescriptor {
            api_id: api_id.to_owned(),
            event_name: event_name.to_owned(),
            problem: "the event name must be non-empty, without whitespace or control characters"
                .to_owned(),
        });
    }
    Ok(format!(
        "v1.{}.{}.{parameter_count}",
        URL_SAFE_NO_PAD.encode(api_id),
        URL_SAFE_NO_PAD.encode(event_name)
    ))
}

impl PreparedOutboxRecord {
    /// Sets the `Trellis-Event-Descriptor` header to the descriptor identity of this event
    /// (its [`name`](Self::name)) in API `api_id`, whose subject template has
    /// `parameter_count` placeholders. `#[derive(OutboxEvent)]` does this at compile time
    /// with `#[outbox(api = "…")]`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidDescriptor`]; see [`event_descriptor_identity`].
    ///
    /// # Examples
    ///
    /// ```
    /// use trellis_outbox::PreparedOutboxRecord;
    ///
    /// let record = PreparedOutboxRecord::event(
    ///     "Documents.Changed",
    ///     "events.v1.ZG9jdW1lbnRzQHYx.Documents.Changed.ZG9jLTE",
    ///     &serde_json::json!({ "id": "doc-1" }),
    /// )?
    /// .with_event_descriptor("documents@v1", 1)?;
    /// assert_eq!(
    ///     record.headers["Trellis-Event-Descriptor"],
    ///     "v1.ZG9jdW1lbnRzQHYx.RG9jdW1lbnRzLkNoYW5nZWQ.1",
    /// );
    /// # Ok::<(), trellis_outbox::Error>(())
    /// ```
    pub fn with_event_descriptor(mut self, api_id: &str, parameter_count: u32) -> Result<Self> {
        let identity = event_descriptor_identity(api_id, &self.name, parameter_count)?;
        self.headers
            .insert(TRELLIS_EVENT_DESCRIPTOR.to_owned(), identity);
        Ok(self)
    }
}

/// The subject of a Trellis event on the current wire:
/// `events.v1.<base64url(api)>.<event>` followed by one unpadded base64url token per
/// parameter, in order, as upstream's `derive_event_subject` and subject templates build it.
///
/// # Examples
///
/// ```
/// use trellis_outbox::trellis_event_subject;
///
/// assert_eq!(
///     trellis_event_subject("orders@v1", "Orders.Created", &["o-1"]),
///     "events.v1.b3JkZXJzQHYx.Orders.Created.by0x"
/// );
/// ```
pub fn trellis_event_subject(api: &str, event: &str, params: &[&str]) -> String {
    let mut subject = format!("events.v1.{}.{event}", URL_SAFE_NO_PAD.encode(api));
    for param in params {
        subject.push('.');
        push_event_param(&mut subject, param);
    }
    subject
}

/// Appends `param` to `out` as one current-wire event parameter token: the unpadded
/// base64url of its UTF-8 text.
pub(crate) fn push_event_param(out: &mut String, param: &str) {
    URL_SAFE_NO_PAD.encode_string(param, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_vectors() {
        for (api, event, count, expected) in [
            (
                "test@v1",
                "Connections.Opened",
                0,
                "v1.dGVzdEB2MQ.Q29ubmVjdGlvbnMuT3BlbmVk.0",
            ),
            (
                "documents@v1",
                "Documents.Changed",
                1,
                "v1.ZG9jdW1lbnRzQHYx.RG9jdW1lbnRzLkNoYW5nZWQ.1",
            ),
            (
                "trellis.health@v1",
                "Heartbeat",
                0,
                "v1.dHJlbGxpcy5oZWFsdGhAdjE.SGVhcnRiZWF0.0",
            ),
        ] {
            assert_eq!(
                event_descriptor_identity(api, event, count).ok().as_deref(),
                Some(expected)
            );
        }
    }

    #[test]
    fn bad_identities_are_named() {
        for api in [
            "",
            "orders",
            "@v1",
            "orders@v",
            "orders@vx",
            "or ders@v1",
            "o/x@v2",
        ] {
            assert!(api_id_problem(api).is_some(), "{api:?} accepted");
        }
        for api in ["orders@v1", "trellis.auth@v12", "acme-orders.runtime@v1"] {
            assert_eq!(api_id_problem(api), None, "{api:?} refused");
        }
        let err = event_descriptor_identity("orders@v1", "Orders Placed", 0).unwrap_err();
        assert!(err.to_string().contains("event name"), "{err}");
    }
}
