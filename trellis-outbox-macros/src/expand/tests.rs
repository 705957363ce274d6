//! Unit and snapshot tests of the expansion.

#![allow(clippy::unwrap_used)]

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
fn event_stubs_are_complete() {
    let input: DeriveInput = parse_quote! {
        #[outbox(name = "A.B", api = "orders@v1", crate = "my_app::outbox")]
        pub struct Broken { a: u8 }
    };
    let code = pretty(derive_event(&input));
    for item in [
        "pub const OUTBOX_NAME: &'static str",
        "pub const OUTBOX_SUBJECT: &'static str",
        "pub const OUTBOX_DESCRIPTOR: &'static str",
        "impl my_app::outbox::__private::OutboxEvent for Broken",
        "impl my_app::outbox::__private::ToOutboxRecord for Broken",
    ] {
        assert!(code.contains(item), "{item}:\n{code}");
    }
}

#[test]
fn job_stubs_implement_outbox_job() {
    let code = pretty(outbox_job(
        quote!(queue = "q", crate = "my_app::outbox"),
        quote! {
            #[derive(serde::Serialize)]
            pub struct SyncCustomer<T> { customer_id: T }
        },
    ));
    assert!(code.contains("compile_error!"), "{code}");
    for item in [
        "pub const OUTBOX_NAME: &'static str",
        "pub const OUTBOX_SUBJECT_PREFIX: &'static str",
        "impl<T> my_app::outbox::__private::OutboxJob for SyncCustomer<T>\n    where\n        Self: my_app::outbox::__private::Serialize,",
        "const QUEUE: &'static str",
        "const SERVICE: &'static str",
        "const JOB_TYPE: &'static str",
        "const SUBJECT_PREFIX: &'static str",
        "const MODE: my_app::outbox::__private::JobMode = my_app::outbox::__private::JobMode::Create;",
        "impl<T> my_app::outbox::__private::ToOutboxRecord for SyncCustomer<T>",
    ] {
        assert!(code.contains(item), "{item}:\n{code}");
    }
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
        ["missing `name` (the event name): add `name = \"Orders.Shipped\"` to `#[outbox(...)]`"]
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
    // darling's errors come with the problems found in what did parse: the first `subject`
    // is still checked against the fields, and the fields against each other. No "missing
    // `name`": the unknown `nmae` is what darling reports.
    let errors = event_errors(parse_quote! {
        #[outbox(nmae = "A.B", subject = "a.{nope}", subject = "b")]
        struct S { #[outbox(id)] a: u8, #[outbox(id)] b: u8 }
    });
    assert_eq!(
        errors,
        [
            "Unknown field: `nmae`. Did you mean `name`?",
            "Duplicate field `subject`",
            "`subject` placeholder `{nope}` does not name a field of `S`; its fields are `a`, `b`",
            "`#[outbox(id)]` is already on field `a`; only one field can be the record id",
        ]
    );
    // A field darling refuses keeps its flags (`c` is still the ordering key, so `ordering`
    // is not reported as lacking one), and the other fields are checked.
    let errors = event_errors(parse_quote! {
        #[outbox(name = "A", subject = "a.{zzz}", ordering = "fifo")]
        struct S {
            #[outbox(id, idd)] a: u8,
            #[outbox(id)] b: u8,
            #[outbox(ordering_key = "x")] c: u8,
        }
    });
    assert_eq!(
        errors,
        [
            "Unknown field: `idd`. Did you mean `id`?",
            "Unexpected type `string`",
            "`subject` placeholder `{zzz}` does not name a field of `S`; its fields are `a`, `b`, `c`",
            "`#[outbox(id)]` is already on field `a`; only one field can be the record id",
            "unknown `ordering` policy \"fifo\"; expected \"block\" (a dead head holds its key until retried) or \"skip_dead\" (later rows pass it)",
        ]
    );
    // Jobs: the other arguments and the fields are still checked; no "missing `job_type`".
    let errors = job_errors(
        quote!(queue = "q", service = "a.b", job_typ = "t"),
        parse_quote! { #[serde(rename_all = "camelCase")] struct S { job_id: String } },
    );
    assert_eq!(
        errors,
        [
            "Unknown field: `job_typ`. Did you mean `job_type`?",
            "`service` must be a single NATS subject token: `a.b` contains `.`",
            "field `job_id` serializes as `jobId`, which `#[outbox_job]` adds to the payload itself; rename it, e.g. `#[serde(rename = \"customerJobId\")]`",
        ]
    );
    // Arguments that are not even a list of `key = value`: the fields are still checked.
    let errors = job_errors(
        quote!(queue = "q",, service),
        parse_quote! { #[serde(rename_all = "camelCase")] struct S { job_id: String } },
    );
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors[1].starts_with("field `job_id` serializes as `jobId`"),
        "{errors:?}"
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
fn subject_control_characters() {
    let check = |subject: &str| {
        let lit = syn::LitStr::new(subject, Span::call_site());
        event_errors(parse_quote! {
            #[outbox(name = "A.B", subject = #lit)]
            struct Order { order_id: String }
        })
    };
    assert_eq!(
        check("events.v1\u{1}.A"),
        ["`subject` contains whitespace or a control character ('\\u{1}') in token `v1\u{1}`"]
    );
    assert_eq!(
        check("events.\0.{order_id}"),
        ["`subject` contains whitespace or a control character ('\\0') in token `\0`"]
    );
    assert_eq!(
        check("events.a\u{7f}"),
        ["`subject` contains whitespace or a control character ('\\u{7f}') in token `a\u{7f}`"]
    );
    assert_eq!(check("events.\u{feff}").len(), 1);
    // The runtime refuses ASCII controls and JavaScript whitespace only; a C1 control such as
    // U+0085 (not in JavaScript's `\s`) is accepted at run time, so at compile time too.
    assert!(check("events.a\u{85}").is_empty());
    assert!(check("events.a\u{9f}").is_empty());
}

#[test]
fn subjects_refuse_the_control_plane() {
    let check = |subject: &str| {
        let lit = syn::LitStr::new(subject, Span::call_site());
        event_errors(parse_quote! {
            #[outbox(name = "A.B", subject = #lit)]
            struct Order { order_id: String }
        })
    };
    assert_eq!(
        check("$JS.API.STREAM.DELETE.{order_id}"),
        [
            "`subject` starts with the system token `$JS`: `$`-prefixed subjects reach the NATS server's control plane (JetStream API, KV, system account), not a stream, and every enqueue would fail"
        ]
    );
    for bad in ["$KV.bucket.key", "$SYS.REQ", "$O.store", "$", "$x"] {
        let errors = check(bad);
        assert_eq!(errors.len(), 1, "{bad}: {errors:?}");
        assert!(
            errors[0].starts_with("`subject` starts with the system token `$"),
            "{bad}: {errors:?}"
        );
    }
    assert_eq!(
        check("_INBOX.{order_id}"),
        [
            "`subject` starts with `_INBOX`, the reply namespace where clients receive request replies, and every enqueue would fail"
        ]
    );
    assert_eq!(check("_INBOX").len(), 1);
    // Only the first token matters, as at run time; a placeholder's value is escaped (a
    // leading `$` gets a `_` prefix).
    for good in [
        "events.$JS.x",
        "events._INBOX.x",
        "_INBOXES.x",
        "_inbox.x",
        "x$.y",
        "{order_id}.x",
    ] {
        assert!(check(good).is_empty(), "{good}: {:?}", check(good));
    }
}

/// The compile error for a literal subject is at the subject literal, in the user's code.
#[test]
fn subject_errors_are_at_the_subject_literal() {
    let source = r#"#[outbox(name = "A.B", subject = "$JS.API.x")] struct S { a: u8 }"#;
    let input: DeriveInput = syn::parse_str(source).unwrap();
    let error = validate::event(&input).unwrap_err();
    let spans: Vec<(usize, usize)> = error
        .into_iter()
        .map(|e| {
            let span = e.span();
            (span.start().column, span.end().column)
        })
        .collect();
    let start = source.find(r#""$JS"#).unwrap();
    let end = start + r#""$JS.API.x""#.len();
    assert_eq!(spans, [(start, end)]);
}

#[test]
fn names() {
    assert_eq!(
        event_errors(parse_quote! { #[outbox(name = "", subject = "a")] struct S { a: u8 } }),
        ["`name` must not be empty"]
    );
    // The runtime (`PreparedOutboxRecord::validate`) refuses only empty names and control
    // characters; the spec's record `name` is any string. Whitespace is allowed.
    assert!(
        event_errors(parse_quote! { #[outbox(name = "A B", subject = "a")] struct S { a: u8 } })
            .is_empty()
    );
    assert!(
        event_errors(
            parse_quote! { #[outbox(name = "A\u{3000}B", subject = "a")] struct S { a: u8 } }
        )
        .is_empty()
    );
    assert_eq!(
        event_errors(parse_quote! { #[outbox(name = "A\tB", subject = "a")] struct S { a: u8 } }),
        ["`name` must not contain control characters ('\\t')"]
    );
    assert_eq!(
        event_errors(
            parse_quote! { #[outbox(name = "A\u{85}B", subject = "a")] struct S { a: u8 } }
        ),
        ["`name` must not contain control characters ('\\u{85}')"]
    );
    let item: DeriveInput = parse_quote! { struct S { a: u8 } };
    assert!(
        job_errors(
            quote!(queue = "sync customer", service = "s", job_type = "t"),
            item.clone()
        )
        .is_empty()
    );
    assert_eq!(
        job_errors(
            quote!(queue = "q\u{7}", service = "s", job_type = "t"),
            item
        ),
        ["`queue` must not contain control characters ('\\u{7}')"]
    );
    assert_eq!(
        event_errors(
            parse_quote! { #[outbox(name = "A", subject = "a", crate = "not a path")] struct S { a: u8 } }
        ),
        ["`crate` must be a path to the trellis-outbox crate, e.g. `crate = \"my_app::outbox\"`"]
    );
}

#[test]
fn descriptor_names() {
    // With `api`, the name is part of the descriptor identity, which the runtime's
    // `event_descriptor_identity` refuses to build for names with whitespace.
    assert_eq!(
        event_errors(parse_quote! {
            #[outbox(name = "A B", subject = "a", api = "orders@v1")] struct S { a: u8 }
        }),
        [
            "`name` must not contain whitespace (' ') when `api` is set: the Trellis event descriptor identity refuses such names"
        ]
    );
    // Control characters are reported once, by the name check.
    assert_eq!(
        event_errors(parse_quote! {
            #[outbox(name = "A\n B", subject = "a", api = "orders@v1")] struct S { a: u8 }
        }),
        ["`name` must not contain control characters ('\\n')"]
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
fn ordering() {
    assert!(
        event_errors(parse_quote! {
            #[outbox(name = "A", subject = "a", ordering = "skip_dead")]
            struct S { #[outbox(ordering_key)] a: String }
        })
        .is_empty()
    );
    assert_eq!(
        event_errors(parse_quote! {
            #[outbox(name = "A", subject = "a", ordering = "fifo")]
            struct S { #[outbox(ordering_key)] a: String }
        }),
        [
            "unknown `ordering` policy \"fifo\"; expected \"block\" (a dead head holds its key until retried) or \"skip_dead\" (later rows pass it)"
        ]
    );
    assert_eq!(
        event_errors(parse_quote! {
            #[outbox(name = "A", subject = "a", ordering = "block")]
            struct S { a: String }
        }),
        [
            "`ordering = \"...\"` needs a field marked `#[outbox(ordering_key)]` (the key events are published in order by)"
        ]
    );
    assert_eq!(
        event_errors(parse_quote! {
            #[outbox(name = "A", subject = "a")]
            struct S { #[outbox(ordering_key)] a: String, #[outbox(ordering_key)] b: String }
        }),
        ["`#[outbox(ordering_key)]` is already on field `a`; an event has one ordering key"]
    );
}

#[test]
fn several_errors_at_once() {
    let errors = event_errors(parse_quote! {
        #[outbox(name = "A\tB", subject = "events.{missing}")]
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

#[test]
fn api_identities() {
    let event: DeriveInput = parse_quote! {
        #[outbox(name = "Documents.Changed", subject = "events.v1.Documents.Changed.{id}", api = "documents@v1")]
        struct S { id: String }
    };
    let checked = validate::event(&event).unwrap();
    assert_eq!(
        checked.descriptor.as_deref(),
        Some("v1.ZG9jdW1lbnRzQHYx.RG9jdW1lbnRzLkNoYW5nZWQ.1")
    );
    let plain: DeriveInput = parse_quote! {
        #[outbox(name = "A.B", subject = "a.b")] struct S { id: String }
    };
    assert_eq!(validate::event(&plain).unwrap().descriptor, None);
    for bad in ["orders", "orders@v", "@v1", "or ders@v1"] {
        let input: DeriveInput = parse_quote! {
            #[outbox(name = "A.B", subject = "a.b", api = #bad)] struct S { id: String }
        };
        let errors = event_errors(input);
        assert_eq!(errors.len(), 1, "{bad}: {errors:?}");
        assert!(
            errors[0].starts_with("`api` must be a Trellis API identity"),
            "{bad}: {errors:?}"
        );
    }
}
