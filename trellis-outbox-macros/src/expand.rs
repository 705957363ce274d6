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
        .flatten()
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
        ordering_field,
        skip_dead,
        descriptor,
        current_wire,
    } = event;
    let private = quote!(#krate::__private);

    let placeholder_fields: Vec<&FieldRef> = subject
        .iter()
        .filter_map(|part| match part {
            SubjectPart::Field(field) => Some(&**field),
            SubjectPart::Literal(_) => None,
        })
        .chain(id_field)
        .chain(ordering_field)
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

    let subject_body = subject_body(subject, &private, *current_wire);
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
    let ordering_key = ordering_field.as_ref().map(|field| {
        let FieldRef {
            ident: field_ident,
            ty,
        } = field;
        let value = quote_spanned! {at(ty.span())=>
            #private::ordering_key(&self.#field_ident, #skip_dead)
        };
        quote! {
            fn ordering_key(&self) -> #private::core::option::Option<#private::OrderingKey> {
                #private::core::option::Option::Some(#value)
            }
        }
    });
    let record = quote_spanned! {at(ident.span())=> #private::event_record(self) };
    let descriptor_const = descriptor.as_ref().map(|identity| {
        quote! {
            const DESCRIPTOR: #private::core::option::Option<&'static str> =
                #private::core::option::Option::Some(#identity);
        }
    });
    let descriptor_inherent = descriptor.as_ref().map(|identity| {
        let doc = format!(" The Trellis event descriptor identity, `{identity}`.");
        quote! {
            #[doc = #doc]
            #vis const OUTBOX_DESCRIPTOR: &'static str = #identity;
        }
    });
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
                #descriptor_inherent
            }

            #[automatically_derived]
            #[allow(unused_qualifications)]
            impl #bounded_impl_generics #private::OutboxEvent for #ident #ty_generics #bounded_where {
                const NAME: &'static str = #name;
                const SUBJECT_TEMPLATE: &'static str = #template;
                #descriptor_const

                fn subject(&self) -> #private::String {
                    #subject_body
                }

                #event_id
                #ordering_key
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

/// Renders the subject: literal runs pushed as they are, placeholders escaped (or, on the
/// current Trellis wire, encoded as event parameters).
fn subject_body(subject: &[SubjectPart], private: &TokenStream, current_wire: bool) -> TokenStream {
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
            // Spanned at the field's type, so an unmet `Display` bound points at the field.
            let push = if current_wire {
                quote_spanned!(at(ty.span())=> push_param_token)
            } else {
                quote_spanned!(at(ty.span())=> push_subject_token)
            };
            quote_spanned! {at(ty.span())=>
                #private::#push(&mut __subject, &self.#ident);
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

/// Impls that keep the rest of the user's crate compiling after a reported error: every
/// item a successful expansion adds that user code can name (the inherent constants,
/// `OUTBOX_DESCRIPTOR` included, and the trait impls), with `unreachable!` bodies. The
/// trait's `DESCRIPTOR`, `event_id` and `ordering_key` have defaults.
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
                #vis const OUTBOX_DESCRIPTOR: &'static str = "";
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

/// The job counterpart of [`event_stubs`]. `OutboxJob` has `Serialize` as a supertrait, so
/// its stub gets the same `Self: Serialize` bound (generic types) and span (the struct's
/// name) as the real impl: a struct that does not derive `Serialize` is told so once, as it
/// would be after the error is fixed.
fn job_stubs(ident: &Ident, vis: &Visibility, generics: &Generics, krate: &Path) -> TokenStream {
    let private = quote!(#krate::__private);
    let bounded = bounded(generics, |clause| {
        clause
            .predicates
            .push(syn::parse_quote!(Self: #private::Serialize));
    });
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    let (bounded_impl_generics, _, bounded_where) = bounded.split_for_impl();
    let job_trait = quote_spanned! {at(ident.span())=> #private::OutboxJob };
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
            impl #bounded_impl_generics #job_trait for #ident #ty_generics #bounded_where {
                const QUEUE: &'static str = "";
                const SERVICE: &'static str = "";
                const JOB_TYPE: &'static str = "";
                const SUBJECT_PREFIX: &'static str = "";
                const MODE: #private::JobMode = #private::JobMode::Create;
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
mod tests;
