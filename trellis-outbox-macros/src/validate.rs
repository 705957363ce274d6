//! Validation: turns parsed attributes into a checked model, reporting every problem at the
//! user's span. Generates no code.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::{Data, DeriveInput, Fields, Generics, Ident, LitStr, Path, Type, Visibility};

use crate::attr::{self, EventAttrs, JobArgs, SerdeKey, StrLit};

/// A checked `#[derive(OutboxEvent)]` input.
#[derive(Debug)]
pub(crate) struct Event {
    pub(crate) ident: Ident,
    pub(crate) vis: Visibility,
    pub(crate) generics: Generics,
    pub(crate) krate: Path,
    pub(crate) name: String,
    pub(crate) template: String,
    pub(crate) subject: Vec<SubjectPart>,
    pub(crate) id_field: Option<FieldRef>,
    /// The `#[outbox(ordering_key)]` field, if any.
    pub(crate) ordering_field: Option<FieldRef>,
    /// `ordering = "skip_dead"` (default `block`).
    pub(crate) skip_dead: bool,
    /// The `Trellis-Event-Descriptor` identity, with `api = "…"`.
    pub(crate) descriptor: Option<String>,
    /// With `api`, a subject on the current Trellis wire (`events.v1.<base64url(api)>.…`):
    /// its placeholders are encoded as event parameters (base64url), not `~HEX~`-escaped.
    pub(crate) current_wire: bool,
}

/// A named field used by the generated code.
#[derive(Debug, Clone)]
pub(crate) struct FieldRef {
    pub(crate) ident: Ident,
    pub(crate) ty: Type,
}

/// A piece of a subject template: literal text (dots included) or a field placeholder.
#[derive(Debug)]
pub(crate) enum SubjectPart {
    Literal(String),
    Field(Box<FieldRef>),
}

/// A checked `#[outbox_job(...)]` input.
#[derive(Debug)]
pub(crate) struct Job {
    pub(crate) ident: Ident,
    pub(crate) vis: Visibility,
    pub(crate) generics: Generics,
    pub(crate) krate: Path,
    pub(crate) queue: String,
    pub(crate) service: String,
    pub(crate) job_type: String,
    pub(crate) submit: bool,
}

/// The crate path to use when the input is too broken to validate.
pub(crate) fn fallback_crate_path(krate: Option<&StrLit>) -> Path {
    krate
        .and_then(|lit| lit.0.parse::<Path>().ok())
        .unwrap_or_else(default_crate_path)
}

fn default_crate_path() -> Path {
    syn::parse_quote!(::trellis_outbox)
}

fn crate_path(krate: Option<&StrLit>, errors: &mut darling::error::Accumulator) -> Path {
    match krate {
        None => default_crate_path(),
        Some(lit) => match lit.0.parse::<Path>() {
            Ok(path) => path,
            Err(_) => {
                errors.push(
                    darling::Error::custom(
                        "`crate` must be a path to the trellis-outbox crate, e.g. `crate = \"my_app::outbox\"`",
                    )
                    .with_span(&lit.0),
                );
                default_crate_path()
            }
        },
    }
}

/// Describes a non-named-struct shape for the "only supports structs" message.
fn bad_shape(data: &Data) -> Option<&'static str> {
    match data {
        Data::Struct(s) => match s.fields {
            Fields::Named(_) => None,
            Fields::Unnamed(_) => Some("a tuple struct"),
            Fields::Unit => Some("a unit struct"),
        },
        Data::Enum(_) => Some("an enum"),
        Data::Union(_) => Some("a union"),
    }
}

fn shape_error(what: &str, input: &DeriveInput, shape: &str) -> darling::Error {
    darling::Error::custom(format!(
        "{what} only supports structs with named fields, and `{}` is {shape}; \
         wrap the data in a struct like `struct {} {{ ... }}`",
        input.ident, input.ident
    ))
    .with_span(&input.ident)
}

/// The one named field flagged `#[outbox(<attr>)]` (`flag` reads the flag), if any; every
/// further one is an error at its flag's span.
fn marked_field(
    fields: &[attr::EventField],
    flag: impl Fn(&attr::EventField) -> &darling::util::Flag,
    attr: &str,
    only_one: &str,
    errors: &mut darling::error::Accumulator,
) -> Option<FieldRef> {
    let mut found: Option<FieldRef> = None;
    for field in fields {
        let mark = flag(field);
        let (true, Some(ident)) = (mark.is_present(), &field.ident) else {
            continue;
        };
        match &found {
            None => {
                found = Some(FieldRef {
                    ident: ident.clone(),
                    ty: field.ty.clone(),
                });
            }
            Some(first) => errors.push(
                darling::Error::custom(format!(
                    "`#[outbox({attr})]` is already on field `{}`; {only_one}",
                    first.ident
                ))
                .with_span(&mark.span()),
            ),
        }
    }
    found
}

/// Validates a `#[derive(OutboxEvent)]` input. When darling refuses an attribute, its errors
/// are reported together with the problems found in whatever did parse.
pub(crate) fn event(input: &DeriveInput) -> darling::Result<Event> {
    let mut errors = darling::Error::accumulator();
    let shape = bad_shape(&input.data);
    if let Some(shape) = shape {
        errors.push(shape_error("`#[derive(OutboxEvent)]`", input, shape));
    }
    let attr::Parsed {
        value: parsed,
        complete,
    } = EventAttrs::parse(&input.attrs, &mut errors);
    let krate = crate_path(parsed.krate.as_ref(), &mut errors);

    // Every field is parsed (so each field's attribute errors are reported), but only a
    // struct with named fields has fields to check the rest against.
    let parsed_fields: Vec<attr::EventField> = match &input.data {
        Data::Struct(data) => data
            .fields
            .iter()
            .map(|field| attr::EventField::parse(field, &mut errors))
            .collect(),
        _ => Vec::new(),
    };
    let fields: &[attr::EventField] = if shape.is_none() { &parsed_fields } else { &[] };

    let has_outbox_attr = input.attrs.iter().any(|a| a.path().is_ident("outbox"));
    if !has_outbox_attr && shape.is_none() {
        errors.push(
            darling::Error::custom(
                "`#[derive(OutboxEvent)]` needs `#[outbox(name = \"...\", subject = \"...\")]` on the struct",
            )
            .with_span(&input.ident),
        );
    }
    // A key missing from an attribute darling refused may be the misspelled or malformed one
    // it reported: say it is missing only when the attribute parsed.
    let report_missing = has_outbox_attr && complete;
    let name = match &parsed.name {
        Some(lit) => {
            check_name("name", &lit.0, &mut errors);
            lit.value()
        }
        None => {
            if report_missing {
                errors.push(missing(
                    &input.ident,
                    "name",
                    "Orders.Shipped",
                    "the event name",
                ));
            }
            String::new()
        }
    };
    let (template, subject) = match &parsed.subject {
        Some(lit) if shape.is_none() => {
            let parts = parse_subject(&lit.0, &input.ident, fields, &mut errors);
            (lit.value(), parts)
        }
        Some(lit) => (lit.value(), Vec::new()),
        None => {
            if report_missing {
                errors.push(missing(
                    &input.ident,
                    "subject",
                    "events.v1.Orders.Shipped.{order_id}",
                    "the subject template",
                ));
            }
            (String::new(), Vec::new())
        }
    };

    let id_field = marked_field(
        fields,
        |field| &field.id,
        "id",
        "only one field can be the record id",
        &mut errors,
    );
    let ordering_field = marked_field(
        fields,
        |field| &field.ordering_key,
        "ordering_key",
        "an event has one ordering key",
        &mut errors,
    );
    let skip_dead = match &parsed.ordering {
        None => false,
        Some(lit) => {
            let skip_dead = match lit.value().as_str() {
                "block" => false,
                "skip_dead" => true,
                other => {
                    errors.push(
                        darling::Error::custom(format!(
                            "unknown `ordering` policy {other:?}; expected \"block\" (a dead head \
                             holds its key until retried) or \"skip_dead\" (later rows pass it)"
                        ))
                        .with_span(&lit.0),
                    );
                    false
                }
            };
            if ordering_field.is_none() && shape.is_none() {
                errors.push(
                    darling::Error::custom(
                        "`ordering = \"...\"` needs a field marked `#[outbox(ordering_key)]` \
                         (the key events are published in order by)",
                    )
                    .with_span(&lit.0),
                );
            }
            skip_dead
        }
    };

    let descriptor = parsed.api.as_ref().and_then(|api| {
        if let Some(lit) = &parsed.name {
            check_descriptor_name(&lit.0, &mut errors);
        }
        let placeholders = subject
            .iter()
            .filter(|part| matches!(part, SubjectPart::Field(_)))
            .count();
        match descriptor_identity(&api.value(), &name, placeholders) {
            Ok(identity) => Some(identity),
            Err(problem) => {
                errors.push(darling::Error::custom(problem).with_span(&api.0));
                None
            }
        }
    });

    let current_wire = descriptor.is_some()
        && parsed.api.as_ref().is_some_and(|api| {
            use base64::Engine as _;
            let api = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(api.value());
            template.starts_with(&format!("events.v1.{api}."))
        });
    errors.finish_with(Event {
        ident: input.ident.clone(),
        vis: input.vis.clone(),
        generics: input.generics.clone(),
        krate,
        name,
        template,
        subject,
        id_field,
        ordering_field,
        skip_dead,
        descriptor,
        current_wire,
    })
}

/// Validates an `#[outbox_job(...)]` input.
pub(crate) fn job(args: TokenStream, input: &DeriveInput) -> darling::Result<Job> {
    let mut errors = darling::Error::accumulator();
    let shape = bad_shape(&input.data);
    if let Some(shape) = shape {
        errors.push(shape_error("`#[outbox_job]`", input, shape));
    }
    let attr::Parsed {
        value: parsed,
        complete,
    } = JobArgs::parse(args, &mut errors);
    let krate = crate_path(parsed.krate.as_ref(), &mut errors);

    let queue = match &parsed.queue {
        Some(lit) => {
            check_name("queue", &lit.0, &mut errors);
            lit.value()
        }
        None => {
            if complete {
                errors.push(missing_job("queue", "syncCustomer", "the queue name"));
            }
            String::new()
        }
    };
    let mut token = |key: &str, value: Option<&StrLit>, example: &str, what: &str| match value {
        Some(lit) => {
            if let Some(problem) = token_problem(&lit.value()) {
                errors.push(
                    darling::Error::custom(format!(
                        "`{key}` must be a single NATS subject token: {problem}"
                    ))
                    .with_span(&lit.0),
                );
            }
            lit.value()
        }
        None => {
            // As for events: a key darling refused may be the one that looks missing.
            if complete {
                errors.push(missing_job(key, example, what));
            }
            String::new()
        }
    };
    let service = token(
        "service",
        parsed.service.as_ref(),
        "billing",
        "the service name",
    );
    let job_type = token(
        "job_type",
        parsed.job_type.as_ref(),
        "sync-customer",
        "the job type",
    );
    let submit = match &parsed.mode {
        None => false,
        Some(lit) => match lit.value().as_str() {
            "create" => false,
            "submit" => true,
            other => {
                errors.push(
                    darling::Error::custom(format!(
                        "unknown `mode` {other:?}: expected \"create\" (the default) or \"submit\""
                    ))
                    .with_span(&lit.0),
                );
                false
            }
        },
    };

    if let Data::Struct(data) = &input.data {
        let rename_all = attr::serde_rename_all(&input.attrs);
        for field in &data.fields {
            let Some(ident) = &field.ident else { continue };
            if let SerdeKey::Key(key) = attr::serde_key(ident, &field.attrs, rename_all.as_deref())
                && (key == "jobId" || key == "submissionId")
            {
                errors.push(
                    darling::Error::custom(format!(
                        "field `{ident}` serializes as `{key}`, which `#[outbox_job]` adds to the payload itself; \
                         rename it, e.g. `#[serde(rename = \"customer{}\")]`",
                        upper_first(&key)
                    ))
                    .with_span(ident),
                );
            }
        }
    }

    errors.finish_with(Job {
        ident: input.ident.clone(),
        vis: input.vis.clone(),
        generics: input.generics.clone(),
        krate,
        queue,
        service,
        job_type,
        submit,
    })
}

fn upper_first(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) => c.to_ascii_uppercase().to_string() + chars.as_str(),
        None => String::new(),
    }
}

fn missing(ident: &Ident, key: &str, example: &str, what: &str) -> darling::Error {
    darling::Error::custom(format!(
        "missing `{key}` ({what}): add `{key} = \"{example}\"` to `#[outbox(...)]`"
    ))
    .with_span(ident)
}

fn missing_job(key: &str, example: &str, what: &str) -> darling::Error {
    darling::Error::custom(format!(
        "missing `{key}` ({what}): add `{key} = \"{example}\"` to `#[outbox_job(...)]`"
    ))
    .with_span(&Span::call_site())
}

/// Names (event names, queues): the runtime's rule (`PreparedOutboxRecord::validate`),
/// non-empty and no control characters. Whitespace is allowed: Trellis' record `name` is any
/// string (with `api`, see [`check_descriptor_name`]).
fn check_name(key: &str, lit: &LitStr, errors: &mut darling::error::Accumulator) {
    let value = lit.value();
    let problem = if value.is_empty() {
        "must not be empty".to_owned()
    } else if let Some(c) = value.chars().find(|c| c.is_control()) {
        format!("must not contain control characters ({c:?})")
    } else {
        return;
    };
    errors.push(darling::Error::custom(format!("`{key}` {problem}")).with_span(lit));
}

/// With `api`, the event name is also part of the descriptor identity, which the runtime's
/// `event_descriptor_identity` builds only for names without whitespace (Rust's
/// `char::is_whitespace`). Control characters and emptiness are [`check_name`]'s to report.
fn check_descriptor_name(lit: &LitStr, errors: &mut darling::error::Accumulator) {
    let value = lit.value();
    if value.chars().any(char::is_control) {
        return;
    }
    if let Some(c) = value.chars().find(|c| c.is_whitespace()) {
        errors.push(
            darling::Error::custom(format!(
                "`name` must not contain whitespace ({c:?}) when `api` is set: the Trellis \
                 event descriptor identity refuses such names"
            ))
            .with_span(lit),
        );
    }
}

/// Whether `c` is in JavaScript's `\s`, the set Trellis escapes (mirrors the runtime crate).
fn is_js_whitespace(c: char) -> bool {
    matches!(
        c,
        '\t' | '\n' | '\u{b}' | '\u{c}' | '\r' | ' ' | '\u{a0}' | '\u{1680}' | '\u{2000}'
            ..='\u{200a}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202f}'
                | '\u{205f}'
                | '\u{3000}'
                | '\u{feff}'
    )
}

/// Whether the runtime's `subject_problem` refuses `c` anywhere in a subject: JavaScript
/// whitespace or an ASCII control character (`char::is_ascii_control`, so C1 controls such
/// as U+0085 pass, as they do at run time).
fn is_forbidden_subject_char(c: char) -> bool {
    is_js_whitespace(c) || c.is_ascii_control()
}

/// The first token of the reply subjects NATS clients use; the runtime refuses it as a
/// subject's first token (mirrors `trellis_outbox::subject::INBOX_PREFIX`).
const INBOX_PREFIX: &str = "_INBOX";

/// The problem with a literal subject token that is not the subject's first (the job
/// `service` and `job_type`), if any: the runtime's per-token rules.
fn token_problem(token: &str) -> Option<String> {
    if token.is_empty() {
        return Some("it is empty".into());
    }
    if let Some(c) = token.chars().find(|&c| is_forbidden_subject_char(c)) {
        return Some(format!(
            "`{token}` contains whitespace or a control character ({c:?})"
        ));
    }
    if token.contains('.') {
        return Some(format!("`{token}` contains `.`"));
    }
    if token == "*" || token == ">" {
        return Some(format!(
            "`{token}` is a wildcard; outbox subjects must be literal"
        ));
    }
    None
}

/// Splits a subject template into literal runs and placeholders, reporting every problem.
fn parse_subject(
    lit: &LitStr,
    ident: &Ident,
    fields: &[attr::EventField],
    errors: &mut darling::error::Accumulator,
) -> Vec<SubjectPart> {
    let template = lit.value();
    let mut error = |message: String| {
        errors.push(darling::Error::custom(format!("`subject` {message}")).with_span(lit));
    };
    if template.is_empty() {
        error("is empty; expected e.g. `events.v1.Orders.Shipped.{order_id}`".into());
        return Vec::new();
    }
    let mut parts = Vec::new();
    let mut literal = String::new();
    for (index, token) in template.split('.').enumerate() {
        if index > 0 {
            literal.push('.');
        }
        let position = index + 1;
        if let Some(inner) = token.strip_prefix('{').and_then(|t| t.strip_suffix('}')) {
            let name = inner.trim();
            let name = name.strip_prefix("r#").unwrap_or(name);
            let field = fields
                .iter()
                .find(|f| f.ident.as_ref().is_some_and(|i| unraw(i) == name));
            match field {
                Some(field) if !inner.contains(['{', '}']) => {
                    if !literal.is_empty() {
                        parts.push(SubjectPart::Literal(std::mem::take(&mut literal)));
                    }
                    if let Some(field_ident) = &field.ident {
                        parts.push(SubjectPart::Field(Box::new(FieldRef {
                            ident: field_ident.clone(),
                            ty: field.ty.clone(),
                        })));
                    }
                }
                _ if name.is_empty() => error(format!(
                    "has an empty placeholder `{{}}` at token {position}; write the field name, e.g. `{{order_id}}`"
                )),
                _ => {
                    let names: Vec<String> = fields
                        .iter()
                        .filter_map(|f| f.ident.as_ref().map(|i| format!("`{}`", unraw(i))))
                        .collect();
                    let known = if names.is_empty() {
                        "it has no fields".to_owned()
                    } else {
                        format!("its fields are {}", names.join(", "))
                    };
                    error(format!(
                        "placeholder `{{{inner}}}` does not name a field of `{ident}`; {known}"
                    ));
                }
            }
            continue;
        }
        if token.contains(['{', '}']) {
            error(format!(
                "token `{token}` mixes text and braces; a placeholder must be a whole token, e.g. `events.v1.Orders.Shipped.{{order_id}}`"
            ));
        } else if token.is_empty() {
            error(format!(
                "has an empty token at position {position} (a leading, trailing or doubled `.`)"
            ));
        } else if let Some(c) = token.chars().find(|&c| is_forbidden_subject_char(c)) {
            error(format!(
                "contains whitespace or a control character ({c:?}) in token `{token}`"
            ));
        } else if token == "*" || token == ">" {
            error(format!(
                "contains the wildcard token `{token}`; outbox subjects must be literal \
                 (use a `{{field}}` placeholder for a variable token)"
            ));
        } else if index == 0 && token.starts_with('$') {
            error(format!(
                "starts with the system token `{token}`: `$`-prefixed subjects reach the NATS \
                 server's control plane (JetStream API, KV, system account), not a stream, \
                 and every enqueue would fail"
            ));
        } else if index == 0 && token == INBOX_PREFIX {
            error(format!(
                "starts with `{INBOX_PREFIX}`, the reply namespace where clients receive request \
                 replies, and every enqueue would fail"
            ));
        }
        literal.push_str(token);
    }
    if !literal.is_empty() {
        parts.push(SubjectPart::Literal(literal));
    }
    parts
}

fn unraw(ident: &Ident) -> String {
    let s = ident.to_token_stream().to_string();
    s.strip_prefix("r#").map(str::to_owned).unwrap_or(s)
}

/// The Trellis descriptor identity of event `name` in API `api` whose subject has
/// `placeholders` placeholders: `v1.<base64url(api)>.<base64url(name)>.<placeholders>`, as the
/// runtime's `event_descriptor_identity` builds it (the same rules, checked at compile time).
fn descriptor_identity(api: &str, name: &str, placeholders: usize) -> Result<String, String> {
    use base64::Engine as _;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;

    let valid = api.rsplit_once("@v").is_some_and(|(api_name, major)| {
        !api_name.is_empty()
            && !major.is_empty()
            && major.bytes().all(|b| b.is_ascii_digit())
            && api_name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
    });
    if !valid {
        return Err(format!(
            "`api` must be a Trellis API identity `<name>@v<major>` (ASCII letters, digits, `.`, `-`, `_`), e.g. `orders@v1`; got {api:?}"
        ));
    }
    Ok(format!(
        "v1.{}.{}.{placeholders}",
        URL_SAFE_NO_PAD.encode(api),
        URL_SAFE_NO_PAD.encode(name)
    ))
}
