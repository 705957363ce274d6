//! The generated code must compile in hostile surroundings: prelude names shadowed, local
//! modules named like the crates it uses, and strict lints. Only `trellis-outbox` (plus serde
//! for the user's own `Serialize` derive) is needed.

#![deny(warnings, unused_qualifications, missing_docs, unreachable_pub)]
#![deny(clippy::all)]

/// Events and jobs declared where prelude names mean something else.
pub mod shadowed {
    #![allow(dead_code, non_camel_case_types)]

    struct Result;
    struct Ok;
    struct Err;
    struct Option;
    struct Some;
    struct None;
    struct String;
    struct Box;
    struct Vec;
    struct ToString;
    struct Display;
    struct Serialize;
    mod core {}
    mod std {}
    mod serde_json {}
    mod trellis_outbox {}
    mod __private {}

    /// An event.
    #[derive(Debug, ::serde::Serialize, ::trellis_outbox::OutboxEvent)]
    #[outbox(
        name = "Orders.Shipped",
        subject = "events.v1.Orders.Shipped.{order_id}"
    )]
    pub struct OrderShipped {
        /// The order.
        pub order_id: ::std::string::String,
    }

    /// An event with an id field and a lifetime.
    #[derive(Debug, ::serde::Serialize, ::trellis_outbox::OutboxEvent)]
    #[outbox(name = "Orders.Paid", subject = "events.v1.Orders.Paid.{order_id}")]
    pub(crate) struct OrderPaid<'a> {
        #[outbox(id)]
        pub(crate) id: &'a str,
        pub(crate) order_id: u64,
    }

    /// A generic event.
    #[derive(Debug, ::serde::Serialize, ::trellis_outbox::OutboxEvent)]
    #[outbox(name = "Things.Changed", subject = "events.v1.Things.Changed.{key}")]
    pub struct Changed<K> {
        /// The key.
        pub key: K,
    }

    /// A job.
    #[::trellis_outbox::outbox_job(
        queue = "syncCustomer",
        service = "billing",
        job_type = "sync-customer",
        mode = "submit"
    )]
    #[derive(Debug, ::serde::Serialize)]
    pub struct SyncCustomer {
        /// The customer.
        pub customer_id: ::std::string::String,
    }
}

/// A re-export of trellis-outbox, as a facade crate would have.
mod facade {
    pub(crate) use ::trellis_outbox::__private;
}

/// An event naming the crate through `crate = "..."`.
#[derive(serde::Serialize, trellis_outbox::OutboxEvent)]
#[outbox(
    crate = "crate::facade",
    name = "Facade.Used",
    subject = "events.v1.Facade.Used"
)]
struct ThroughFacade {
    n: u8,
}

/// A job naming the crate through `crate = "..."`.
#[trellis_outbox::outbox_job(crate = "crate::facade", queue = "q", service = "s", job_type = "t")]
#[derive(serde::Serialize)]
struct JobThroughFacade {
    n: u8,
}

#[test]
fn shadowed_names_do_not_leak_into_generated_code() {
    use trellis_outbox::{OutboxEvent, OutboxJob, ToOutboxRecord};

    let event = shadowed::OrderShipped {
        order_id: "o 1".into(),
    };
    assert_eq!(event.subject(), "events.v1.Orders.Shipped.o~20~1");
    assert_eq!(shadowed::OrderShipped::OUTBOX_NAME, "Orders.Shipped");

    let paid = shadowed::OrderPaid {
        id: "fixed",
        order_id: 9,
    };
    assert_eq!(
        paid.to_outbox_record().map(|r| r.id).ok().as_deref(),
        Some("fixed")
    );

    let changed = shadowed::Changed { key: 'k' };
    assert_eq!(changed.subject(), "events.v1.Things.Changed.k");
    assert!(changed.to_outbox_record().is_ok());

    let job = shadowed::SyncCustomer {
        customer_id: "c".into(),
    };
    assert!(job.prepare_job().is_ok());
    assert_eq!(shadowed::SyncCustomer::OUTBOX_NAME, "syncCustomer");

    let facade = ThroughFacade { n: 1 };
    assert_eq!(
        facade.to_outbox_record().map(|r| r.payload).ok().as_deref(),
        Some(r#"{"n":1}"#)
    );
    assert_eq!(ThroughFacade::OUTBOX_NAME, "Facade.Used");
    let job = JobThroughFacade { n: 2 };
    assert!(job.to_outbox_record().is_ok());
    assert_eq!(JobThroughFacade::OUTBOX_SUBJECT_PREFIX, "trellis.jobs.s.t");
}
