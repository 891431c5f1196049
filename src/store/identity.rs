//! What a delivery is, how its identity is hashed and how its content is fingerprinted.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed, Xxh3Default};

use crate::store::config::Limits;
use crate::store::error::InvalidDelivery;

/// One delivery as the core sees it: borrowed, so the hot path copies nothing.
///
/// The identity is *(scope, producer, message id)*. It comes from the application (an MQTT 5 user property,
/// an envelope, a field of the payload), never from the MQTT packet id, which the broker reuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Delivery<'a> {
    /// Logical consumer function, e.g. `inventory-reservation`. Shared by every instance of that consumer;
    /// never a host name. A rebuild uses a new, versioned scope such as `inventory-reservation@2`.
    pub scope: &'a str,
    /// Optional producer namespace, for ids that are only unique per producer.
    pub producer: Option<&'a str>,
    /// The application message id, e.g. `evt-42-created`.
    pub message_id: &'a str,
    /// Topic the delivery arrived on (part of the fingerprint).
    pub topic: &'a str,
    /// Payload bytes (part of the fingerprint).
    pub payload: &'a [u8],
    /// Producer's sequence number, when the producer numbers its messages (used by sequence watermarks).
    pub sequence: Option<u64>,
    /// When the producer created the message, Unix seconds, if known (used to flag deliveries older than the
    /// identity horizon).
    pub sent_at: Option<i64>,
}

impl<'a> Delivery<'a> {
    /// A delivery without a producer namespace.
    pub fn new(scope: &'a str, message_id: &'a str, topic: &'a str, payload: &'a [u8]) -> Self {
        Delivery {
            scope,
            producer: None,
            message_id,
            topic,
            payload,
            sequence: None,
            sent_at: None,
        }
    }

    /// The same delivery with a producer namespace.
    pub fn with_producer(mut self, producer: &'a str) -> Self {
        self.producer = Some(producer);
        self
    }

    /// The same delivery with the producer's sequence number.
    pub fn with_sequence(mut self, sequence: u64) -> Self {
        self.sequence = Some(sequence);
        self
    }

    /// The same delivery with the producer's creation time (Unix seconds).
    pub fn with_sent_at(mut self, sent_at: i64) -> Self {
        self.sent_at = Some(sent_at);
        self
    }

    /// The stored identity key of this delivery (within its scope).
    pub fn id_hash(&self) -> IdHash {
        IdHash::of(self.producer, self.message_id)
    }

    /// The content fingerprint of this delivery.
    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of(self.topic, self.payload)
    }

    /// Checks the delivery against `limits`; called by the inbox before anything is written.
    pub fn validate(&self, limits: &Limits) -> Result<(), InvalidDelivery> {
        if self.scope.is_empty() {
            return Err(InvalidDelivery::EmptyScope);
        }
        if self.message_id.is_empty() {
            return Err(InvalidDelivery::EmptyMessageId);
        }
        if self.producer == Some("") {
            return Err(InvalidDelivery::EmptyProducer);
        }
        check_len("scope", self.scope.len(), limits.max_scope_len)?;
        check_len(
            "producer",
            self.producer.map_or(0, str::len),
            limits.max_id_len,
        )?;
        check_len("message id", self.message_id.len(), limits.max_id_len)?;
        check_len("topic", self.topic.len(), limits.max_topic_len)?;
        check_len("payload", self.payload.len(), limits.max_payload_len)?;
        Ok(())
    }
}

fn check_len(field: &'static str, len: usize, max: usize) -> Result<(), InvalidDelivery> {
    if len > max {
        Err(InvalidDelivery::TooLong { field, len, max })
    } else {
        Ok(())
    }
}

/// Fixed-width identity key: xxh3-128 of the producer namespace and the message id.
///
/// 16 bytes whatever the id length, which keeps retained identities compact. The encoding is length-prefixed,
/// so `("a", "bc")` and `("ab", "c")` differ, and "no producer" differs from every producer.
/// The hash is part of the on-disk format and never changes within a schema version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdHash(pub [u8; 16]);

impl IdHash {
    /// Hashes an identity.
    pub fn of(producer: Option<&str>, message_id: &str) -> IdHash {
        let mut h = Xxh3Default::new();
        match producer {
            None => h.update(&[0]),
            Some(p) => {
                h.update(&[1]);
                h.update(&(p.len() as u64).to_le_bytes());
                h.update(p.as_bytes());
            }
        }
        h.update(&(message_id.len() as u64).to_le_bytes());
        h.update(message_id.as_bytes());
        IdHash(h.digest128().to_be_bytes())
    }

    /// Lower-case hex, as shown by the CLI.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Stable 64-bit hash of (topic, payload), stored beside the identity to tell a redelivery from a conflict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub u64);

impl Fingerprint {
    /// Fingerprints a topic and payload.
    pub fn of(topic: &str, payload: &[u8]) -> Fingerprint {
        Fingerprint(xxh3_64_with_seed(payload, xxh3_64(topic.as_bytes())))
    }

    /// The value as SQLite stores it (a signed 64-bit integer with the same bits).
    pub(crate) fn to_sql(self) -> i64 {
        self.0 as i64
    }

    pub(crate) fn from_sql(v: i64) -> Fingerprint {
        Fingerprint(v as u64)
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_stable_across_builds() {
        // Stored on disk: a change here is a schema change.
        assert_eq!(
            Fingerprint::of("orders/42", b"{}").to_string(),
            format!("{:016x}", Fingerprint::of("orders/42", b"{}").0)
        );
        let a = IdHash::of(None, "evt-42-created");
        assert_eq!(a, IdHash::of(None, "evt-42-created"));
        assert_ne!(a, IdHash::of(Some(""), "evt-42-created"));
        assert_ne!(IdHash::of(Some("a"), "bc"), IdHash::of(Some("ab"), "c"));
        assert_ne!(Fingerprint::of("a", b"bc"), Fingerprint::of("ab", b"c"));
    }
}
