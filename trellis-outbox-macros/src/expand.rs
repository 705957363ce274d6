//! Code generation. Works on `proc_macro2`/`syn` types only so it can be unit-tested; assumes
//! validated input. On errors it still emits stub impls, so the user sees only the real mistake.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{DeriveInput, Generics, Ident, Path, Visibility};

use crate::validate::{self, Event, FieldRef, Job, SubjectPart};

/// `#[derive(OutboxEvent)]`: the impls, or the errors plus stubs.
pub(crate) fn derive_event(input: &DeriveInput) -> TokenStream {
    match validate::event(input) {
        Ok(event) => event_impls(&event),
        Err(error) => {
            let krate = validate::fallback_crate_path(
                crate::attr::find_crate_path_in_attrs(&input.attrs).as_ref(),
            );
            let errors = compile_errors(error);
            let stubs = event_stubs(&input.ident, &input.vis, &input.generics, &krate);
            quote! { #errors #stubs }
        }
    }
}

/// `#[outbox_job(...)]`: the item unchanged, plus the impls (or the errors plus stubs).
pub(crate) fn outbox_job(args: TokenStream, item: TokenStream) -> TokenStream {
    let krate = validate::fallback_crate_path(
        darling::ast::NestedMeta::parse_meta_list(args.clone())
            .ok()
            .and_then(|metas| crate::attr::find_crate_path(&metas))
            .as_ref(),
    );
    let input = match syn::parse2::<syn::Item>(item.clone()) {
        Ok(syn::Item::Struct(item_struct)) => DeriveInput::from(item_struct),
        Ok(other) => {
            let error = syn::Error::new(
                item_span(&other),
                "`#[outbox_job]` only supports structs with named fields",
            )
            .into_compile_error();
            return quote! { #item #error };
        }
        Err(error) => {
            let error = error.into_compile_error();
            return quote! { #item #error };
        }
    };
    match validate::job(args, &input) {
        Ok(job) => {
            let impls = job_impls(&job);
            quote! { #item #impls }
        }
        Err(error) => {
            let errors = compile_errors(error);
            let stubs = if matches!(input.data, syn::Data::Union(_)) {
                TokenStream::new()
            } else {
                job_stubs(&input.ident, &input.vis, &input.generics, &krate)
            };
            quote! { #item #errors #stubs }
        }
    }
}

/// One `compile_error!` per problem, each at its own span. darling appends the attribute
/// path (" at name") to its messages; the span already shows where, so it is dropped.
fn compile_errors(error: darling::Error) -> TokenStream {
    error
        .into_iter()
        .map(|error| syn::Error::new(error.span(), message(&error)).into_compile_error())
        .collect()
}

/// The message of a single darling error, without darling's location suffix.
pub(crate) fn message(error: &darling::Error) -> String {
    let text = error.to_string();
    match text.rsplit_once(" at ") {
        Some((head, path))
            if !path.is_empty()
                && path
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '/') =>
        {
            head.to_owned()
        }
        _ => text,
    }
}

fn item_span(item: &syn::Item) -> Span {
    match item {
        syn::Item::Enum(e) => e.ident.span(),
        syn::Item::Union(u) => u.ident.span(),
        syn::Item::Fn(f) => f.sig.ident.span(),
        other => other.span(),
    }
}

/// A span located at `span` that resolves names at the call site.
fn at(span: Span) -> Span {
    Span::call_site().located_at(span)
}

/// The impl generics with extra `where` predicates when the type has type parameters.
fn bounded(generics: &Generics, extra: impl FnOnce(&mut syn::WhereClause)) -> Generics {
    let mut generics = generics.clone();
    if generics.type_params().next().is_some() {
        extra(generics.make_where_clause());
    }
    generics
}

fn event_impls(event: &Event) -> TokenStream {
    let Event {
        ident,
        vis,
        generics,
        krate,
        name,
        template,
        subject,
        id_field,
    } = event;
    let private = quote!(#krate::__private);

    let placeholder_fields: Vec<&FieldRef> = subject
        .iter()
        .filter_map(|part| match part {
            SubjectPart::Field(field) => Some(&**field),
            SubjectPart::Literal(_) => None,
        })
        .chain(id_field)
        .collect();
    let bounded = bounded(generics, |clause| {
        clause
            .predicates
            .push(syn::parse_quote!(Self: #private::Serialize));
        for field in &placeholder_fields {
            let ty = &field.ty;
            clause
                .predicates
                .push(syn::parse_quote!(#ty: #private::core::fmt::Display));
        }
    });
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    let (bounded_impl_generics, _, bounded_where) = bounded.split_for_impl();

    let subject_body = subject_body(subject, &private);
    let event_id = id_field.as_ref().map(|field| {
        let FieldRef {
            ident: field_ident,
            ty,
        } = field;
        let value = quote_spanned! {at(ty.span())=>
            #private::event_id(&self.#field_ident)
        };
        quote! {
            fn event_id(&self) -> #private::core::option::Option<#private::String> {
                #private::core::option::Option::Some(#value)
            }
        }
    });
    let record = quote_spanned! {at(ident.span())=> #private::event_record(self) };
    let name_doc = format!(" The outbox event name, `{name}`.");
    let subject_doc = format!(" The outbox subject template, `{template}`.");

    quote! {
        #[doc(hidden)]
        #[allow(non_upper_case_globals, unused_qualifications, clippy::absolute_paths)]
        const _: () = {
            #[automatically_derived]
            #[allow(unused_qualifications)]
            impl #impl_generics #ident #ty_generics #where_clause {
                #[doc = #name_doc]
                #vis const OUTBOX_NAME: &'static str = #name;
                #[doc = #subject_doc]
                #vis const OUTBOX_SUBJECT: &'static str = #template;
            }

            #[automatically_derived]
            #[allow(unused_qualifications)]
            impl #bounded_impl_generics #private::OutboxEvent for #ident #ty_generics #bounded_where {
                const NAME: &'static str = #name;
                const SUBJECT_TEMPLATE: &'static str = #template;

                fn subject(&self) -> #private::String {
                    #subject_body
                }

                #event_id
            }

            #[automatically_derived]
            #[allow(unused_qualifications)]
            impl #bounded_impl_generics #private::ToOutboxRecord for #ident #ty_generics #bounded_where {
                fn to_outbox_record(
                    &self,
                ) -> #private::Result<#private::PreparedOutboxRecord> {
                    #record
                }
            }
        };
    }
}

/// Renders the subject: literal runs pushed as they are, placeholders escaped.
fn subject_body(subject: &[SubjectPart], private: &TokenStream) -> TokenStream {
    if let [SubjectPart::Literal(literal)] = subject {
        return quote! { #private::String::from(#literal) };
    }
    let capacity: usize = subject
        .iter()
        .map(|part| match part {
            SubjectPart::Literal(literal) => literal.len(),
            SubjectPart::Field(_) => 16,
        })
        .sum();
    let pushes = subject.iter().map(|part| match part {
        SubjectPart::Literal(literal) => quote! {
            __subject.push_str(#literal);
        },
        SubjectPart::Field(field) => {
            let FieldRef { ident, ty } = &**field;
            quote_spanned! {at(ty.span())=>
                #private::push_subject_token(&mut __subject, &self.#ident);
            }
        }
    });
    quote! {
        let mut __subject = #private::String::with_capacity(#capacity);
        #(#pushes)*
        __subject
    }
}

fn job_impls(job: &Job) -> TokenStream {
    let Job {
        ident,
        vis,
        generics,
        krate,
        queue,
        service,
        job_type,
        submit,
    } = job;
    let private = quote!(#krate::__private);
    let prefix = format!("trellis.jobs.{service}.{job_type}");
    let mode = if *submit {
        quote!(#private::JobMode::Submit)
    } else {
        quote!(#private::JobMode::Create)
    };
    let bounded = bounded(generics, |clause| {
        clause
            .predicates
            .push(syn::parse_quote!(Self: #private::Serialize));
    });
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    let (bounded_impl_generics, _, bounded_where) = bounded.split_for_impl();
    let job_trait = quote_spanned! {at(ident.span())=> #private::OutboxJob };
    let name_doc = format!(" The job queue, `{queue}`.");
    let prefix_doc = format!(" The subject prefix of this job's events, `{prefix}`.");

    quote! {
        #[doc(hidden)]
        #[allow(non_upper_case_globals, unused_qualifications, clippy::absolute_paths)]
        const _: () = {
            #[automatically_derived]
            #[allow(unused_qualifications)]
            impl #impl_generics #ident #ty_generics #where_clause {
                #[doc = #name_doc]
                #vis const OUTBOX_NAME: &'static str = #queue;
                #[doc = #prefix_doc]
                #vis const OUTBOX_SUBJECT_PREFIX: &'static str = #prefix;
            }

            #[automatically_derived]
            #[allow(unused_qualifications)]
            impl #bounded_impl_generics #job_trait for #ident #ty_generics #bounded_where {
                const QUEUE: &'static str = #queue;
                const SERVICE: &'static str = #service;
                const JOB_TYPE: &'static str = #job_type;
                const SUBJECT_PREFIX: &'static str = #prefix;
                const MODE: #private::JobMode = #mode;
            }

            #[automatically_derived]
            #[allow(unused_qualifications)]
            impl #bounded_impl_generics #private::ToOutboxRecord for #ident #ty_generics #bounded_where {
                fn to_outbox_record(
                    &self,
                ) -> #private::Result<#private::PreparedOutboxRecord> {
                    #private::job_record(self)
                }
            }
        };
    }
}

/// Impls that keep the rest of the user's crate compiling after a reported error.
fn event_stubs(ident: &Ident, vis: &Visibility, generics: &Generics, krate: &Path) -> TokenStream {
    let private = quote!(#krate::__private);
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    quote! {
        #[doc(hidden)]
        const _: () = {
            #[automatically_derived]
            #[allow(unused_qualifications, dead_code)]
            impl #impl_generics #ident #ty_generics #where_clause {
                #vis const OUTBOX_NAME: &'static str = "";
                #vis const OUTBOX_SUBJECT: &'static str = "";
            }
            #[automatically_derived]
            #[allow(unused_qualifications)]
            impl #impl_generics #private::OutboxEvent for #ident #ty_generics #where_clause {
                const NAME: &'static str = "";
                const SUBJECT_TEMPLATE: &'static str = "";
                fn subject(&self) -> #private::String {
                    #private::core::unreachable!()
                }
            }
            #[automatically_derived]
            #[allow(unused_qualifications)]
            impl #impl_generics #private::ToOutboxRecord for #ident #ty_generics #where_clause {
                fn to_outbox_record(&self) -> #private::Result<#private::PreparedOutboxRecord> {
                    #private::core::unreachable!()
                }
            }
        };
    }
}

fn job_stubs(ident: &Ident, vis: &Visibility, generics: &Generics, krate: &Path) -> TokenStream {
    let private = quote!(#krate::__private);
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    quote! {
        #[doc(hidden)]
        const _: () = {
            #[automatically_derived]
            #[allow(unused_qualifications, dead_code)]
            impl #impl_generics #ident #ty_generics #where_clause {
                #vis const OUTBOX_NAME: &'static str = "";
                #vis const OUTBOX_SUBJECT_PREFIX: &'static str = "";
            }
            #[automatically_derived]
            #[allow(unused_qualifications)]
            impl #impl_generics #private::ToOutboxRecord for #ident #ty_generics #where_clause {
                fn to_outbox_record(&self) -> #private::Result<#private::PreparedOutboxRecord> {
                    #private::core::unreachable!()
                }
            }
        };
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use syn::parse_quote;

    fn pretty(tokens: TokenStream) -> String {
        match syn::parse2::<syn::File>(tokens.clone()) {
            Ok(file) => prettyplease::unparse(&file),
            Err(e) => panic!("generated code does not parse: {e}\n{tokens}"),
        }
    }

    /// The compile errors a derive produces, one message per line.
    fn event_errors(input: DeriveInput) -> Vec<String> {
        match validate::event(&input) {
            Ok(_) => Vec::new(),
            Err(e) => e.into_iter().map(|e| message(&e)).collect(),
        }
    }

    fn job_errors(args: TokenStream, item: DeriveInput) -> Vec<String> {
        match validate::job(args, &item) {
            Ok(_) => Vec::new(),
            Err(e) => e.into_iter().map(|e| message(&e)).collect(),
        }
    }

    #[test]
    fn snapshot_event() {
        let input: DeriveInput = parse_quote! {
            #[derive(serde::Serialize, OutboxEvent)]
            #[outbox(name = "Orders.Shipped", subject = "events.v1.Orders.Shipped.{order_id}")]
            pub struct OrderShipped {
                pub order_id: String,
                pub carrier: String,
            }
        };
        insta::assert_snapshot!(pretty(derive_event(&input)));
    }

    #[test]
    fn snapshot_event_with_id() {
        let input: DeriveInput = parse_quote! {
            #[derive(serde::Serialize, OutboxEvent)]
            #[outbox(name = "Invoices.Paid", subject = "events.v1.Invoices.Paid.{tenant}.{invoice}", crate = "my_app::outbox")]
            pub(crate) struct InvoicePaid<'a> {
                #[outbox(id)]
                event_id: ulid::Ulid,
                tenant: &'a str,
                invoice: u64,
            }
        };
        insta::assert_snapshot!(pretty(derive_event(&input)));
    }

    #[test]
    fn snapshot_job() {
        let expanded = outbox_job(
            quote!(
                queue = "syncCustomer",
                service = "billing",
                job_type = "sync-customer",
                mode = "submit"
            ),
            quote! {
                #[derive(serde::Serialize)]
                #[serde(rename_all = "camelCase")]
                pub struct SyncCustomer {
                    pub customer_id: String,
                }
            },
        );
        insta::assert_snapshot!(pretty(expanded));
    }

    #[test]
    fn snapshot_errors_keep_stubs() {
        let input: DeriveInput = parse_quote! {
            #[outbox(name = "A.B")]
            struct Missing { a: u8 }
        };
        insta::assert_snapshot!(pretty(derive_event(&input)));
    }

    #[test]
    fn generic_events_get_bounds() {
        let input: DeriveInput = parse_quote! {
            #[outbox(name = "A.B", subject = "a.{key}")]
            struct Generic<K> { key: K }
        };
        let code = pretty(derive_event(&input));
        assert!(
            code.contains("Self: ::trellis_outbox::__private::Serialize"),
            "{code}"
        );
        assert!(
            code.contains("K: ::trellis_outbox::__private::core::fmt::Display"),
            "{code}"
        );
    }

    #[test]
    fn literal_subjects_are_built_once() {
        let input: DeriveInput = parse_quote! {
            #[outbox(name = "A.B", subject = "events.v1.A.B")]
            struct Plain { a: u8 }
        };
        let code = pretty(derive_event(&input));
        assert!(code.contains(r#"String::from("events.v1.A.B")"#), "{code}");
    }

    #[test]
    fn missing_keys() {
        assert_eq!(
            event_errors(parse_quote! { #[outbox(name = "A.B")] struct S { a: u8 } }),
            [
                "missing `subject` (the subject template): add `subject = \"events.v1.Orders.Shipped.{order_id}\"` to `#[outbox(...)]`"
            ]
        );
        assert_eq!(
            event_errors(parse_quote! { #[outbox(subject = "a")] struct S { a: u8 } }),
            [
                "missing `name` (the event name): add `name = \"Orders.Shipped\"` to `#[outbox(...)]`"
            ]
        );
        assert_eq!(
            event_errors(parse_quote! { struct S { a: u8 } }),
            [
                "`#[derive(OutboxEvent)]` needs `#[outbox(name = \"...\", subject = \"...\")]` on the struct"
            ]
        );
        assert_eq!(
            job_errors(quote!(queue = "q"), parse_quote! { struct S { a: u8 } }),
            [
                "missing `service` (the service name): add `service = \"billing\"` to `#[outbox_job(...)]`",
                "missing `job_type` (the job type): add `job_type = \"sync-customer\"` to `#[outbox_job(...)]`",
            ]
        );
    }

    #[test]
    fn unknown_and_duplicate_keys() {
        let errors = event_errors(parse_quote! {
            #[outbox(nmae = "A.B", subject = "a", subject = "b")]
            struct S { a: u8 }
        });
        assert_eq!(
            errors,
            [
                "Unknown field: `nmae`. Did you mean `name`?",
                "Duplicate field `subject`"
            ]
        );
        let errors = job_errors(
            quote!(queue = "q", service = "s", job_typ = "t"),
            parse_quote! { struct S { a: u8 } },
        );
        assert_eq!(
            errors,
            ["Unknown field: `job_typ`. Did you mean `job_type`?"]
        );
    }

    #[test]
    fn non_literal_values() {
        assert_eq!(
            event_errors(parse_quote! {
                #[outbox(name = NAME, subject = concat!("a", "b"))]
                struct S { a: u8 }
            }),
            [
                "`name` must be a string literal, e.g. `name = \"...\"`; constants and macros are not supported",
                "`subject` must be a string literal, e.g. `subject = \"...\"`; constants and macros are not supported",
            ]
        );
        assert_eq!(
            event_errors(parse_quote! { #[outbox(name = 1, subject)] struct S { a: u8 } }),
            [
                "`name` must be a string literal, e.g. `name = \"...\"`",
                "`subject` needs a value: `subject = \"...\"`",
            ]
        );
    }

    #[test]
    fn shapes() {
        assert_eq!(
            event_errors(parse_quote! { #[outbox(name = "A", subject = "a")] enum E { A } }),
            [
                "`#[derive(OutboxEvent)]` only supports structs with named fields, and `E` is an enum; wrap the data in a struct like `struct E { ... }`"
            ]
        );
        assert_eq!(
            event_errors(parse_quote! { #[outbox(name = "A", subject = "a")] struct T(u8); }),
            [
                "`#[derive(OutboxEvent)]` only supports structs with named fields, and `T` is a tuple struct; wrap the data in a struct like `struct T { ... }`"
            ]
        );
        assert_eq!(
            event_errors(parse_quote! { #[outbox(name = "A", subject = "a")] struct U; }),
            [
                "`#[derive(OutboxEvent)]` only supports structs with named fields, and `U` is a unit struct; wrap the data in a struct like `struct U { ... }`"
            ]
        );
        assert_eq!(
            event_errors(parse_quote! { #[outbox(name = "A", subject = "a")] union X { a: u8 } }),
            [
                "`#[derive(OutboxEvent)]` only supports structs with named fields, and `X` is a union; wrap the data in a struct like `struct X { ... }`"
            ]
        );
        let code = outbox_job(
            quote!(queue = "q", service = "s", job_type = "t"),
            quote!(
                fn f() {}
            ),
        );
        assert!(
            code.to_string()
                .contains("`#[outbox_job]` only supports structs with named fields")
        );
    }

    #[test]
    fn subjects() {
        let check = |subject: &str| {
            let lit = syn::LitStr::new(subject, Span::call_site());
            event_errors(parse_quote! {
                #[outbox(name = "A.B", subject = #lit)]
                struct Order { order_id: String, r#type: String }
            })
        };
        assert!(check("events.v1.A.{order_id}.{type}").is_empty());
        assert_eq!(
            check(""),
            ["`subject` is empty; expected e.g. `events.v1.Orders.Shipped.{order_id}`"]
        );
        assert_eq!(
            check("events..a"),
            ["`subject` has an empty token at position 2 (a leading, trailing or doubled `.`)"]
        );
        assert_eq!(
            check("events.v1.A."),
            ["`subject` has an empty token at position 4 (a leading, trailing or doubled `.`)"]
        );
        assert_eq!(
            check("events.v1 A"),
            ["`subject` contains whitespace or a control character (' ') in token `v1 A`"]
        );
        assert_eq!(
            check("events.*.A"),
            [
                "`subject` contains the wildcard token `*`; outbox subjects must be literal (use a `{field}` placeholder for a variable token)"
            ]
        );
        assert_eq!(
            check("events.>"),
            [
                "`subject` contains the wildcard token `>`; outbox subjects must be literal (use a `{field}` placeholder for a variable token)"
            ]
        );
        assert_eq!(
            check("events.v1.{orderid}"),
            [
                "`subject` placeholder `{orderid}` does not name a field of `Order`; its fields are `order_id`, `type`"
            ]
        );
        assert_eq!(
            check("events.v1.{}"),
            [
                "`subject` has an empty placeholder `{}` at token 3; write the field name, e.g. `{order_id}`"
            ]
        );
        assert_eq!(
            check("events.v1.id-{order_id}"),
            [
                "`subject` token `id-{order_id}` mixes text and braces; a placeholder must be a whole token, e.g. `events.v1.Orders.Shipped.{order_id}`"
            ]
        );
        // Several problems in one subject are all reported.
        assert_eq!(check("a..*.{x}").len(), 3);
    }

    #[test]
    fn names() {
        assert_eq!(
            event_errors(parse_quote! { #[outbox(name = "", subject = "a")] struct S { a: u8 } }),
            ["`name` must not be empty"]
        );
        assert_eq!(
            event_errors(
                parse_quote! { #[outbox(name = "A B", subject = "a")] struct S { a: u8 } }
            ),
            ["`name` must not contain whitespace or control characters"]
        );
        assert_eq!(
            event_errors(
                parse_quote! { #[outbox(name = "A", subject = "a", crate = "not a path")] struct S { a: u8 } }
            ),
            [
                "`crate` must be a path to the trellis-outbox crate, e.g. `crate = \"my_app::outbox\"`"
            ]
        );
    }

    #[test]
    fn id_fields() {
        assert_eq!(
            event_errors(parse_quote! {
                #[outbox(name = "A", subject = "a")]
                struct S { #[outbox(id)] a: String, #[outbox(id)] b: String }
            }),
            ["`#[outbox(id)]` is already on field `a`; only one field can be the record id"]
        );
        assert_eq!(
            event_errors(parse_quote! {
                #[outbox(name = "A", subject = "a")]
                struct S { #[outbox(idd)] a: String }
            }),
            ["Unknown field: `idd`. Did you mean `id`?"]
        );
    }

    #[test]
    fn several_errors_at_once() {
        let errors = event_errors(parse_quote! {
            #[outbox(name = "A B", subject = "events.{missing}")]
            struct S { #[outbox(id)] a: String, #[outbox(id)] b: String }
        });
        assert_eq!(errors.len(), 3, "{errors:?}");
    }

    #[test]
    fn other_attributes_are_ignored() {
        let errors = event_errors(parse_quote! {
            #[derive(Clone)]
            #[serde(rename_all = "camelCase")]
            #[doc = "x"]
            #[outbox(name = "A", subject = "a.{b}")]
            struct S { #[serde(rename = "x")] #[other(anything = 1)] b: String }
        });
        assert!(errors.is_empty(), "{errors:?}");
    }

    #[test]
    fn job_checks() {
        let item: DeriveInput = parse_quote! { struct S { a: u8 } };
        assert_eq!(
            job_errors(
                quote!(queue = "q", service = "a.b", job_type = "*"),
                item.clone()
            ),
            [
                "`service` must be a single NATS subject token: `a.b` contains `.`",
                "`job_type` must be a single NATS subject token: `*` is a wildcard; outbox subjects must be literal",
            ]
        );
        assert_eq!(
            job_errors(
                quote!(queue = "", service = "s t", job_type = ""),
                item.clone()
            ),
            [
                "`queue` must not be empty",
                "`service` must be a single NATS subject token: `s t` contains whitespace or a control character (' ')",
                "`job_type` must be a single NATS subject token: it is empty",
            ]
        );
        assert_eq!(
            job_errors(
                quote!(queue = "q", service = "s", job_type = "t", mode = "later"),
                item.clone()
            ),
            ["unknown `mode` \"later\": expected \"create\" (the default) or \"submit\""]
        );
        assert_eq!(
            job_errors(
                quote!(queue = "q", service = "s", job_type = "t", mode = submit),
                item
            ),
            [
                "`mode` must be a string literal, e.g. `mode = \"...\"`; constants and macros are not supported"
            ]
        );
    }

    #[test]
    fn job_payload_collisions() {
        let args = quote!(queue = "q", service = "s", job_type = "t");
        assert_eq!(
            job_errors(
                args.clone(),
                parse_quote! {
                    #[serde(rename_all = "camelCase")]
                    struct S { job_id: String, #[serde(rename = "submissionId")] sub: String, #[serde(skip)] submission_id: u8 }
                }
            ),
            [
                "field `job_id` serializes as `jobId`, which `#[outbox_job]` adds to the payload itself; rename it, e.g. `#[serde(rename = \"customerJobId\")]`",
                "field `sub` serializes as `submissionId`, which `#[outbox_job]` adds to the payload itself; rename it, e.g. `#[serde(rename = \"customerSubmissionId\")]`",
            ]
        );
        // Without camelCase, `job_id` stays `job_id`: no collision.
        assert!(job_errors(args, parse_quote! { struct S { job_id: String } }).is_empty());
    }
}
