//! The NATS headers an outbox row is published with: [`OutboxMessage::nats_headers`] and
//! [`OutboxMessage::publish_headers`], which refuse unsendable headers instead of panicking.

use std::str::FromStr;

use async_nats::{HeaderName, HeaderValue};

use super::{JetStreamError, JetStreamErrorKind};
use crate::record::{NATS_MSG_ID, OutboxMessage};

impl OutboxMessage {
    /// The stored headers as an [`async_nats::HeaderMap`], ready to publish with.
    ///
    /// Every stored header is carried except NATS control headers (`Nats-*` other than
    /// `Nats-Msg-Id`, e.g. `Nats-Rollup`), which are dropped with a `tracing` warning naming
    /// the row and the header. [`JetStreamPublisher`](super::JetStreamPublisher) uses [`OutboxMessage::publish_headers`]
    /// instead, which also forces `Nats-Msg-Id` to the row id.
    ///
    /// # Errors
    ///
    /// A [`JetStreamError`] of kind [`InvalidHeader`](JetStreamErrorKind::InvalidHeader) when
    /// a stored header cannot be sent (a name that is empty or not printable ASCII without
    /// `:`, a value with a control character other than tab). Enqueue refuses such headers; a row written by another
    /// writer may still hold one. Never panics.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # async fn run(js: async_nats::jetstream::Context, message: trellis_outbox::OutboxMessage) -> Result<(), Box<dyn std::error::Error>> {
    /// js.publish_with_headers(message.subject.clone(), message.nats_headers()?, message.payload.clone().into())
    ///     .await?
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn nats_headers(&self) -> Result<async_nats::HeaderMap, JetStreamError> {
        let mut map = async_nats::HeaderMap::new();
        for (name, value) in &self.headers {
            self.carry(&mut map, name, value)?;
        }
        Ok(map)
    }

    /// The headers an `event.publish` row is published with: every stored header, except
    /// that `Nats-Msg-Id` is always the row id and NATS control headers are dropped. A stored
    /// `Nats-Msg-Id` in any letter case is dropped first, so a stale or hand-edited header
    /// can never change the dedupe id; any other `Nats-*` header (`Nats-Rollup`,
    /// `Nats-Expected-*`, `Nats-TTL`, …, which could purge or alter the stream) is dropped
    /// with a `tracing` warning naming the row id and the header (never the payload).
    ///
    /// # Errors
    ///
    /// A [`JetStreamError`] of kind [`InvalidHeader`](JetStreamErrorKind::InvalidHeader) when
    /// the row id cannot be a `Nats-Msg-Id` (empty, a control character such as CR or LF, or
    /// leading/trailing whitespace) or a stored header cannot be sent (see
    /// [`OutboxMessage::nats_headers`]). Never panics.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn run(message: trellis_outbox::OutboxMessage) -> Result<(), trellis_outbox::JetStreamError> {
    /// let headers = message.publish_headers()?;
    /// assert_eq!(headers.get("Nats-Msg-Id").map(|v| v.as_str()), Some(message.id.as_str()));
    /// # Ok(()) }
    /// ```
    pub fn publish_headers(&self) -> Result<async_nats::HeaderMap, JetStreamError> {
        let mut map = async_nats::HeaderMap::new();
        for (name, value) in &self.headers {
            if !name.eq_ignore_ascii_case(NATS_MSG_ID) {
                self.carry(&mut map, name, value)?;
            }
        }
        if let Some(problem) = crate::wire::id_problem(&self.id) {
            return Err(invalid_header(self, format!("the row id {problem}")));
        }
        let id = HeaderValue::from_str(&self.id).map_err(|e| {
            invalid_header(self, format!("the row id cannot be `{NATS_MSG_ID}`")).source(e)
        })?;
        map.insert(NATS_MSG_ID, id);
        Ok(map)
    }

    /// Adds one stored header to `map` without panicking; drops a control header (logged).
    fn carry(
        &self,
        map: &mut async_nats::HeaderMap,
        name: &str,
        value: &str,
    ) -> Result<(), JetStreamError> {
        if crate::wire::is_control_header(name) {
            tracing::warn!(
                id = ?self.id,
                header = ?name,
                "dropping a NATS control header from an outbox row: only Nats-Msg-Id of the \
                 Nats-* headers is published (others can purge or alter the stream)"
            );
            return Ok(());
        }
        if let Some(problem) = crate::wire::header_name_problem(name)
            .or_else(|| crate::wire::header_value_problem(name, value))
        {
            return Err(invalid_header(self, problem));
        }
        let header_name = HeaderName::from_str(name)
            .map_err(|e| invalid_header(self, format!("name {name:?} is invalid")).source(e))?;
        let header_value = HeaderValue::from_str(value)
            .map_err(|e| invalid_header(self, format!("value of {name:?} is invalid")).source(e))?;
        map.insert(header_name, header_value);
        Ok(())
    }
}

fn invalid_header(message: &OutboxMessage, problem: impl Into<String>) -> JetStreamError {
    JetStreamError::new(JetStreamErrorKind::InvalidHeader, message).detail(problem)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::record::PreparedOutboxRecord;

    fn row(id: &str, headers: &[(&str, &str)]) -> OutboxMessage {
        let record = PreparedOutboxRecord {
            id: id.into(),
            kind: crate::OutboxRecordKind::EventPublish,
            name: "A.B".into(),
            subject: "events.v1.A.B".into(),
            payload: "{}".into(),
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>(),
            ordering: None,
        };
        OutboxMessage::pending(record, chrono::Utc::now())
    }

    #[test]
    fn control_headers_are_stripped_and_the_id_overlaid() {
        let message = row(
            "01ROW",
            &[
                ("Nats-Rollup", "all"),
                ("nats-expected-last-sequence", "7"),
                ("Nats-TTL", "1s"),
                ("NATS-MSG-ID", "stale"),
                ("traceparent", "00-a-b-01"),
            ],
        );
        let headers = message.publish_headers().unwrap();
        assert_eq!(headers.len(), 2, "{headers:?}");
        assert_eq!(headers.get(NATS_MSG_ID).unwrap().as_str(), "01ROW");
        assert_eq!(headers.get("traceparent").unwrap().as_str(), "00-a-b-01");
        assert!(headers.get("Nats-Rollup").is_none());
        assert!(headers.get("Nats-TTL").is_none());

        let carried = message.nats_headers().unwrap();
        assert!(carried.get("Nats-Rollup").is_none());
        assert!(carried.get("nats-expected-last-sequence").is_none());
        assert_eq!(carried.get("NATS-MSG-ID").unwrap().as_str(), "stale");
    }

    /// These rows made `HeaderMap::insert` panic before: the whole batch failed.
    #[test]
    fn unsendable_ids_and_headers_are_permanent_errors_not_panics() {
        let cases = [
            row("01ROW", &[("X", "a\r\nNats-Rollup: all")]),
            row("01ROW", &[("X", "a\nb")]),
            row("01ROW", &[("a b", "v")]),
            row("01ROW", &[("é", "v")]),
            row("01ROW", &[("", "v")]),
            row("01\r\nROW", &[]),
            row("", &[]),
        ];
        for message in cases {
            let err = message.publish_headers().unwrap_err();
            assert_eq!(err.kind(), JetStreamErrorKind::InvalidHeader, "{err}");
            assert!(!err.is_retryable());
            assert!(
                err.to_string()
                    .contains("has an id or header that cannot be sent to NATS"),
                "{err}"
            );
        }
        let err = row("01ROW", &[("X", "a\r\nb")]).nats_headers().unwrap_err();
        assert!(err.to_string().contains("line break"), "{err}");
        let err = row("01\nROW", &[]).publish_headers().unwrap_err();
        assert!(
            err.to_string()
                .contains("the row id contains the control character"),
            "{err}"
        );
    }
}
