//! Procedural macros for `trellis-outbox`. Use them through the `trellis_outbox` crate, which
//! re-exports them and documents them with examples that are compiled and tested.
//!
//! The code is split parse → validate → expand: `attr` (darling receivers), `validate`
//! (cross-field rules, every error at its own span) and `expand` (code generation on
//! `proc_macro2` types, unit- and snapshot-tested).

mod attr;
mod expand;
mod validate;

use proc_macro::TokenStream;

/// Derives `trellis_outbox::OutboxEvent` and `trellis_outbox::ToOutboxRecord` for a struct
/// with named fields that also derives `serde::Serialize`.
///
/// ```ignore
/// #[derive(serde::Serialize, trellis_outbox::OutboxEvent)]
/// #[outbox(name = "Orders.Shipped", subject = "events.v1.Orders.Shipped.{order_id}")]
/// pub struct OrderShipped {
///     pub order_id: String,
///     pub carrier: String,
/// }
/// ```
///
/// # Struct attributes: `#[outbox(...)]`
///
/// - `name = "Orders.Shipped"` (required): the event name, stored as the record's `name`
///   and available as `OrderShipped::OUTBOX_NAME`. Checked at compile time as enqueue checks
///   it: not empty, no control characters (and, with `api`, no whitespace).
/// - `subject = "events.v1.Orders.Shipped.{order_id}"` (required): the subject template,
///   available as written as `OrderShipped::OUTBOX_SUBJECT`. A `{field}` token is replaced by
///   the field's `Display` output, escaped as Trellis does (`.`, `*`, `>`, `~`, whitespace and
///   NUL become `~HEX~`; an empty or `$`-leading value gets a `_` prefix). Literal tokens are
///   checked at compile time by the rules enqueue applies: no whitespace or ASCII control
///   character, no empty token, no `*`/`>` wildcard, and a first token that neither starts
///   with `$` (the NATS control plane) nor is `_INBOX` (request replies).
/// - `api = "orders@v1"` (optional): the Trellis API the event belongs to. The event's
///   descriptor identity (`v1.<base64url(api)>.<base64url(name)>.<placeholders>`, the
///   parameter count being the number of `{field}` placeholders in the subject) is computed at
///   compile time, sent as the `Trellis-Event-Descriptor` header that current Trellis
///   dispatchers require, and available as `OrderShipped::OUTBOX_DESCRIPTOR`. When the subject
///   is on the current Trellis wire (`events.v1.<base64url(api)>.…`, e.g.
///   `events.v1.b3JkZXJzQHYx.Orders.Shipped.{order_id}`), its placeholders are encoded as
///   Trellis event parameters (unpadded base64url of the `Display` output, as
///   `trellis_event_subject` does) instead of `~HEX~`-escaped.
/// - `crate = "path"`: where to find `trellis_outbox` when it is re-exported, e.g.
///   `#[outbox(crate = "my_app::outbox", ...)]`.
///
/// # Field attributes
///
/// - `#[outbox(id)]` on at most one field: its `Display` output is the record id (and the
///   `Nats-Msg-Id` header) instead of a new ULID, for deterministic idempotency. The id is
///   unique across the whole outbox table, so namespace it by event type, e.g. a field set to
///   `format!("order-shipped:{order_id}")`: another event type reusing a bare `order_id`
///   would fail to enqueue with `Error::DuplicateIdentity`.
///
/// Other attributes (`#[serde(...)]`, …) are left alone; the payload is serde's output, so
/// they apply. See the `trellis_outbox::OutboxEvent` trait for compiled examples.
#[proc_macro_derive(OutboxEvent, attributes(outbox))]
pub fn derive_outbox_event(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    expand::derive_event(&input).into()
}

/// Makes a `serde::Serialize` struct a Trellis job request that can be written to the outbox
/// (`tx.enqueue_job(&job)`), implementing `trellis_outbox::OutboxJob` and
/// `trellis_outbox::ToOutboxRecord`. Put it above `#[derive(serde::Serialize)]`.
///
/// ```ignore
/// #[trellis_outbox::outbox_job(queue = "syncCustomer", service = "billing", job_type = "sync-customer")]
/// #[derive(serde::Serialize)]
/// pub struct SyncCustomer {
///     pub customer_id: String,
/// }
/// ```
///
/// # Arguments
///
/// - `queue = "syncCustomer"` (required): the queue key; the record's `name` and
///   `SyncCustomer::OUTBOX_NAME` (not empty, no control characters).
/// - `service = "billing"` (required) and `job_type = "sync-customer"` (required): each a
///   single subject token (checked at compile time); the subject prefix is
///   `trellis.jobs.<service>.<job_type>` (`SyncCustomer::OUTBOX_SUBJECT_PREFIX`).
/// - `mode = "create"` (default) or `mode = "submit"`: record kind `job.create` or
///   `job.submit`.
/// - `crate = "path"`: where to find `trellis_outbox` when it is re-exported.
///
/// A field that would serialize as `jobId` or `submissionId` is a compile error: those keys
/// are added to the payload. See the `trellis_outbox::OutboxJob` trait for compiled examples.
#[proc_macro_attribute]
pub fn outbox_job(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::outbox_job(args.into(), item.into()).into()
}
