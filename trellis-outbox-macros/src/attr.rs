//! Attribute parsing (darling receivers). Builds a typed model; never generates code.

use darling::ast::NestedMeta;
use darling::util::Flag;
use darling::{FromAttributes, FromField, FromMeta};
use syn::{Attribute, Expr, Ident, Lit, LitStr, Meta, Type};

/// A string-literal attribute value, with a message naming the key when it is something else.
#[derive(Debug, Clone)]
pub(crate) struct StrLit(pub(crate) LitStr);

impl StrLit {
    pub(crate) fn value(&self) -> String {
        self.0.value()
    }
}

impl FromMeta for StrLit {
    fn from_meta(item: &Meta) -> darling::Result<Self> {
        let key = item
            .path()
            .get_ident()
            .map_or_else(|| "value".to_owned(), ToString::to_string);
        match item {
            Meta::NameValue(nv) => {
                let mut expr = &nv.value;
                while let Expr::Group(group) = expr {
                    expr = &group.expr;
                }
                match expr {
                    Expr::Lit(lit) => match &lit.lit {
                        Lit::Str(s) => Ok(StrLit(s.clone())),
                        other => Err(darling::Error::custom(format!(
                            "`{key}` must be a string literal, e.g. `{key} = \"...\"`"
                        ))
                        .with_span(other)),
                    },
                    other => Err(darling::Error::custom(format!(
                        "`{key}` must be a string literal, e.g. `{key} = \"...\"`; \
                         constants and macros are not supported"
                    ))
                    .with_span(other)),
                }
            }
            _ => Err(
                darling::Error::custom(format!("`{key}` needs a value: `{key} = \"...\"`"))
                    .with_span(item),
            ),
        }
    }
}

/// What darling made of an attribute: everything (`complete`), or, when darling refused it,
/// the keys that are well-formed on their own (the first of each), so validation can go on
/// and report its own problems in the same compile as darling's.
#[derive(Debug)]
pub(crate) struct Parsed<T> {
    pub(crate) value: T,
    /// `false` when darling reported errors and `value` was salvaged: a missing key may
    /// then be a misspelled or malformed one darling already reported.
    pub(crate) complete: bool,
}

/// `#[derive(OutboxEvent)]`'s struct-level `#[outbox(...)]` keys.
#[derive(Debug, Default, FromAttributes)]
#[darling(attributes(outbox))]
pub(crate) struct EventAttrs {
    /// `name = "Orders.Shipped"` (required).
    pub(crate) name: Option<StrLit>,
    /// `subject = "events.v1.Orders.Shipped.{order_id}"` (required).
    pub(crate) subject: Option<StrLit>,
    /// `api = "orders@v1"`: the Trellis API the event belongs to (its descriptor identity).
    pub(crate) api: Option<StrLit>,
    /// `ordering = "block" | "skip_dead"`: what a dead head of an ordering key does to the
    /// rows after it (needs an `#[outbox(ordering_key)]` field).
    pub(crate) ordering: Option<StrLit>,
    /// `crate = "path"`.
    #[darling(rename = "crate")]
    pub(crate) krate: Option<StrLit>,
}

impl EventAttrs {
    /// Parses the struct's `#[outbox(...)]` attributes; darling's errors go to `errors`.
    pub(crate) fn parse(
        attrs: &[Attribute],
        errors: &mut darling::error::Accumulator,
    ) -> Parsed<Self> {
        match Self::from_attributes(attrs) {
            Ok(value) => Parsed {
                value,
                complete: true,
            },
            Err(error) => {
                push_all(errors, error);
                let metas = outbox_metas(attrs);
                Parsed {
                    value: Self {
                        name: salvage_str(&metas, "name"),
                        subject: salvage_str(&metas, "subject"),
                        api: salvage_str(&metas, "api"),
                        ordering: salvage_str(&metas, "ordering"),
                        krate: salvage_str(&metas, "crate"),
                    },
                    complete: false,
                }
            }
        }
    }
}

/// A field of an event struct and its `#[outbox(...)]` attribute.
#[derive(Debug, FromField)]
#[darling(attributes(outbox))]
pub(crate) struct EventField {
    pub(crate) ident: Option<Ident>,
    pub(crate) ty: Type,
    /// `#[outbox(id)]`: this field's value is the record id.
    pub(crate) id: Flag,
    /// `#[outbox(ordering_key)]`: events with the same value of this field are published
    /// in commit order.
    pub(crate) ordering_key: Flag,
}

impl EventField {
    /// Parses a field's `#[outbox(...)]` attributes; darling's errors go to `errors`, and a
    /// field darling refused keeps the flags that are well-formed on their own.
    pub(crate) fn parse(field: &syn::Field, errors: &mut darling::error::Accumulator) -> Self {
        match Self::from_field(field) {
            Ok(parsed) => parsed,
            Err(error) => {
                push_all(errors, error);
                let metas = outbox_metas(&field.attrs);
                Self {
                    ident: field.ident.clone(),
                    ty: field.ty.clone(),
                    id: salvage_flag(&metas, "id"),
                    ordering_key: salvage_flag(&metas, "ordering_key"),
                }
            }
        }
    }
}

/// `#[outbox_job(...)]` arguments.
#[derive(Debug, Default, FromMeta)]
pub(crate) struct JobArgs {
    /// `queue = "syncCustomer"` (required).
    pub(crate) queue: Option<StrLit>,
    /// `service = "billing"` (required).
    pub(crate) service: Option<StrLit>,
    /// `job_type = "sync-customer"` (required).
    pub(crate) job_type: Option<StrLit>,
    /// `mode = "create" | "submit"` (default `create`).
    pub(crate) mode: Option<StrLit>,
    /// `crate = "path"`.
    #[darling(rename = "crate")]
    pub(crate) krate: Option<StrLit>,
}

impl JobArgs {
    /// Parses the arguments; darling's (or syn's) errors go to `errors`.
    pub(crate) fn parse(
        args: proc_macro2::TokenStream,
        errors: &mut darling::error::Accumulator,
    ) -> Parsed<Self> {
        let list = match NestedMeta::parse_meta_list(args) {
            Ok(list) => list,
            Err(error) => {
                push_all(errors, error.into());
                return Parsed {
                    value: Self::default(),
                    complete: false,
                };
            }
        };
        match Self::from_list(&list) {
            Ok(value) => Parsed {
                value,
                complete: true,
            },
            Err(error) => {
                push_all(errors, error);
                Parsed {
                    value: Self {
                        queue: salvage_str(&list, "queue"),
                        service: salvage_str(&list, "service"),
                        job_type: salvage_str(&list, "job_type"),
                        mode: salvage_str(&list, "mode"),
                        krate: salvage_str(&list, "crate"),
                    },
                    complete: false,
                }
            }
        }
    }
}

/// Adds each of darling's errors to `errors` on its own (pushing a darling "multiple" error
/// as is would nest it, and it would print as one message at one span).
fn push_all(errors: &mut darling::error::Accumulator, error: darling::Error) {
    for error in error.flatten() {
        errors.push(error);
    }
}

/// The items of every `#[outbox(...)]` list in `attrs` (others, and lists that do not
/// parse, are skipped: darling reports those).
fn outbox_metas(attrs: &[Attribute]) -> Vec<NestedMeta> {
    attrs
        .iter()
        .filter(|a| a.path().is_ident("outbox"))
        .filter_map(|a| match &a.meta {
            Meta::List(list) => NestedMeta::parse_meta_list(list.tokens.clone()).ok(),
            _ => None,
        })
        .flatten()
        .collect()
}

/// The first well-formed `key = "..."` among `metas`.
fn salvage_str(metas: &[NestedMeta], key: &str) -> Option<StrLit> {
    metas.iter().find_map(|meta| match meta {
        NestedMeta::Meta(meta) if meta.path().is_ident(key) => StrLit::from_meta(meta).ok(),
        _ => None,
    })
}

/// The flag `key` at its first mention among `metas`, well-formed (`key`) or not
/// (`key = ...`, `key(...)`: darling reported that): the user meant to mark the field, so
/// the cross-field checks treat it as marked rather than report it missing.
fn salvage_flag(metas: &[NestedMeta], key: &str) -> Flag {
    metas
        .iter()
        .find_map(|meta| match meta {
            NestedMeta::Meta(meta) if meta.path().is_ident(key) => {
                Flag::from_meta(&Meta::Path(meta.path().clone())).ok()
            }
            _ => None,
        })
        .unwrap_or_default()
}

/// Best-effort `crate = "path"` lookup for inputs too broken to validate: the stubs emitted
/// after an error must name the same crate path as a successful expansion would.
pub(crate) fn find_crate_path(metas: &[NestedMeta]) -> Option<StrLit> {
    salvage_str(metas, "crate")
}

/// [`find_crate_path`] in the `#[outbox(...)]` attributes of a derive input.
pub(crate) fn find_crate_path_in_attrs(attrs: &[Attribute]) -> Option<StrLit> {
    find_crate_path(&outbox_metas(attrs))
}

/// What serde does with a field when serializing, as far as the payload's keys are concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SerdeKey {
    /// Serialized under this key.
    Key(String),
    /// Not serialized (`skip`, `skip_serializing`).
    Skipped,
    /// Its keys are the nested value's (`flatten`): unknown at compile time.
    Flattened,
}

/// Reads the container's `#[serde(rename_all = "...")]` (or `rename_all(serialize = "...")`).
/// Anything else inside `#[serde(...)]` is ignored: serde itself reports its own mistakes.
pub(crate) fn serde_rename_all(attrs: &[Attribute]) -> Option<String> {
    let mut rule = None;
    for attr in attrs.iter().filter(|a| a.path().is_ident("serde")) {
        let _ = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("rename_all") {
                rule = rename_value(&meta)?.or(rule.take());
            } else {
                skip_meta(&meta)?;
            }
            Ok(())
        });
    }
    rule
}

/// The key a field serializes as, given the container's `rename_all` rule.
pub(crate) fn serde_key(ident: &Ident, attrs: &[Attribute], rename_all: Option<&str>) -> SerdeKey {
    let mut rename = None;
    let mut skipped = false;
    let mut flattened = false;
    for attr in attrs.iter().filter(|a| a.path().is_ident("serde")) {
        let _ = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("rename") {
                rename = rename_value(&meta)?.or(rename.take());
            } else if meta.path.is_ident("skip") || meta.path.is_ident("skip_serializing") {
                skipped = true;
            } else if meta.path.is_ident("flatten") {
                flattened = true;
            } else {
                skip_meta(&meta)?;
            }
            Ok(())
        });
    }
    if skipped {
        return SerdeKey::Skipped;
    }
    if flattened {
        return SerdeKey::Flattened;
    }
    let name = ident.to_string();
    let name = name.strip_prefix("r#").unwrap_or(&name).to_owned();
    SerdeKey::Key(match (rename, rename_all) {
        (Some(rename), _) => rename,
        (None, Some(rule)) => apply_rename_rule(rule, &name),
        (None, None) => name,
    })
}

/// `rename = "x"` or `rename(serialize = "x", deserialize = "y")`: the serialize name.
fn rename_value(meta: &syn::meta::ParseNestedMeta<'_>) -> syn::Result<Option<String>> {
    if meta.input.peek(syn::Token![=]) {
        let lit: LitStr = meta.value()?.parse()?;
        return Ok(Some(lit.value()));
    }
    let mut found = None;
    if meta.input.peek(syn::token::Paren) {
        meta.parse_nested_meta(|inner| {
            if inner.path.is_ident("serialize") {
                let lit: LitStr = inner.value()?.parse()?;
                found = Some(lit.value());
            } else {
                skip_meta(&inner)?;
            }
            Ok(())
        })?;
    }
    Ok(found)
}

/// Consumes whatever follows a nested meta path (`= expr` or `(...)`).
fn skip_meta(meta: &syn::meta::ParseNestedMeta<'_>) -> syn::Result<()> {
    if meta.input.peek(syn::Token![=]) {
        let _: Expr = meta.value()?.parse()?;
    } else if meta.input.peek(syn::token::Paren) {
        let _group: proc_macro2::Group = meta.input.parse()?;
    }
    Ok(())
}

/// serde's `RenameRule::apply_to_field` (field names are snake_case by convention).
pub(crate) fn apply_rename_rule(rule: &str, field: &str) -> String {
    let pascal = || {
        let mut out = String::new();
        let mut capitalize = true;
        for c in field.chars() {
            if c == '_' {
                capitalize = true;
            } else if capitalize {
                out.push(c.to_ascii_uppercase());
                capitalize = false;
            } else {
                out.push(c);
            }
        }
        out
    };
    match rule {
        "UPPERCASE" | "SCREAMING_SNAKE_CASE" => field.to_ascii_uppercase(),
        "PascalCase" => pascal(),
        "camelCase" => {
            let pascal = pascal();
            let mut chars = pascal.chars();
            match chars.next() {
                Some(first) => first.to_ascii_lowercase().to_string() + chars.as_str(),
                None => pascal,
            }
        }
        "kebab-case" => field.replace('_', "-"),
        "SCREAMING-KEBAB-CASE" => field.to_ascii_uppercase().replace('_', "-"),
        // "lowercase", "snake_case", and rules serde itself rejects.
        _ => field.to_owned(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use syn::parse_quote;

    #[test]
    fn rename_rules_match_serde() {
        assert_eq!(apply_rename_rule("camelCase", "job_id"), "jobId");
        assert_eq!(apply_rename_rule("PascalCase", "job_id"), "JobId");
        assert_eq!(apply_rename_rule("kebab-case", "job_id"), "job-id");
        assert_eq!(
            apply_rename_rule("SCREAMING-KEBAB-CASE", "job_id"),
            "JOB-ID"
        );
        assert_eq!(
            apply_rename_rule("SCREAMING_SNAKE_CASE", "job_id"),
            "JOB_ID"
        );
        assert_eq!(apply_rename_rule("snake_case", "job_id"), "job_id");
    }

    #[test]
    fn serde_keys() {
        let input: syn::DeriveInput = parse_quote! {
            #[serde(rename_all(serialize = "camelCase", deserialize = "snake_case"), deny_unknown_fields)]
            struct S {
                job_id: u8,
                #[serde(rename = "x", default)] a: u8,
                #[serde(rename(deserialize = "d", serialize = "s"))] b: u8,
                #[serde(skip_serializing_if = "Option::is_none", skip)] c: u8,
                #[serde(flatten)] d: u8,
                #[serde(with = "m")] r#type: u8,
            }
        };
        let rule = serde_rename_all(&input.attrs);
        assert_eq!(rule.as_deref(), Some("camelCase"));
        let syn::Data::Struct(data) = input.data else {
            unreachable!()
        };
        let keys: Vec<SerdeKey> = data
            .fields
            .iter()
            .map(|f| serde_key(f.ident.as_ref().unwrap(), &f.attrs, rule.as_deref()))
            .collect();
        assert_eq!(
            keys,
            vec![
                SerdeKey::Key("jobId".into()),
                SerdeKey::Key("x".into()),
                SerdeKey::Key("s".into()),
                SerdeKey::Skipped,
                SerdeKey::Flattened,
                SerdeKey::Key("type".into()),
            ]
        );
    }
}
