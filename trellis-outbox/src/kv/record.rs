//! The KV value of an outbox record (upstream's `KvOutboxRecordSchema`, spec §E.1, plus our
//! lease's claim token) and the key of an id.

use std::collections::BTreeMap;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::record::OutboxMessage;
use crate::row::RawRow;
use crate::time::format_timestamp;

/// Where `dead` records' `nextAttemptAt` points: upstream's claim (0.11 final) takes any
/// record not `dispatched` that is due, so a dead one must never be due.
pub(crate) const NEVER: &str = "9999-12-31T00:00:00.000Z";

/// The prefix of keys that hold an encoded id.
const ENCODED: &str = "_b64.";

/// The key of record `id`: the id itself when NATS accepts it as a key (ULIDs do), otherwise
/// `_b64.` and the id in unpadded base64url. Escaped once, here: listing keys yields these
/// and they are read as they are (upstream escaped twice, spec §H 26).
pub(crate) fn key_of(id: &str) -> String {
    let plain = !id.is_empty()
        && !id.starts_with('.')
        && !id.ends_with('.')
        && !id.starts_with(ENCODED)
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'/' | b'_' | b'=' | b'.'));
    if plain {
        id.to_owned()
    } else {
        format!("{ENCODED}{}", URL_SAFE_NO_PAD.encode(id))
    }
}

/// A record as stored: camelCase JSON, optional fields omitted. (Changes are made on the
/// stored JSON object itself, so fields another writer added are kept.)
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct KvRecord {
    pub(crate) id: String,
    pub(crate) kind: String,
    pub(crate) name: String,
    pub(crate) subject: String,
    pub(crate) payload: String,
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) state: String,
    pub(crate) attempts: i64,
    pub(crate) created_at: String,
    pub(crate) updated_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) next_attempt_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) last_error: Option<String>,
    /// JSON text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) outcome: Option<String>,
    /// The fencing token of the claim that holds the record (ours; upstream ignores it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) claim_token: Option<String>,
}

impl KvRecord {
    /// The stored form of a new message.
    pub(crate) fn from_message(message: &OutboxMessage) -> Self {
        Self {
            id: message.id.clone(),
            kind: message.kind.as_str().to_owned(),
            name: message.name.clone(),
            subject: message.subject.clone(),
            payload: message.payload.clone(),
            headers: message.headers.clone(),
            state: message.state.as_str().to_owned(),
            attempts: i64::from(message.attempts),
            created_at: format_timestamp(message.created_at),
            updated_at: format_timestamp(message.updated_at),
            next_attempt_at: message.next_attempt_at.map(format_timestamp),
            last_error: message.last_error.clone(),
            outcome: message.outcome.as_ref().map(ToString::to_string),
            claim_token: None,
        }
    }

    /// Reads a stored value; `key` names the record when the value has no usable id.
    pub(crate) fn from_map(
        key: &str,
        value: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self> {
        serde_json::from_value(serde_json::Value::Object(value))
            .map_err(|e| Error::decode(key, "value", format!("not an outbox KV record: {e}")))
    }

    pub(crate) fn to_bytes(&self) -> Result<Vec<u8>> {
        serde_json::to_vec(self).map_err(|source| Error::Serialize {
            what: "outbox KV record",
            source,
        })
    }

    /// The message, with the same poison rules as a database row.
    pub(crate) fn to_message(&self) -> Result<OutboxMessage> {
        RawRow {
            id: self.id.clone(),
            kind: self.kind.as_str(),
            name: self.name.clone(),
            subject: self.subject.clone(),
            payload: self.payload.clone(),
            headers: self.headers.clone(),
            state: self.state.as_str(),
            attempts: self.attempts,
            created_at: self.created_at.as_str(),
            updated_at: self.updated_at.as_str(),
            next_attempt_at: self.next_attempt_at.as_deref(),
            last_error: self.last_error.clone(),
            outcome: self.outcome.as_deref(),
        }
        .into_message()
    }
}

#[cfg(test)]
mod tests {
    use super::key_of;

    #[test]
    fn ids_nats_accepts_are_their_own_keys_others_are_encoded_once() {
        assert_eq!(
            key_of("01J9ZK3V8Q2W4E6R8T0Y1U3I5O"),
            "01J9ZK3V8Q2W4E6R8T0Y1U3I5O"
        );
        assert_eq!(
            key_of("trellis-job-created:x"),
            "_b64.dHJlbGxpcy1qb2ItY3JlYXRlZDp4"
        );
        assert_eq!(key_of("a b"), "_b64.YSBi");
        assert_eq!(key_of(".a"), "_b64.LmE");
        // An id that looks encoded is encoded too, so no two ids share a key.
        assert_ne!(key_of("_b64.YSBi"), key_of("a b"));
    }
}
