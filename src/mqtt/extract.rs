//! Where a delivery's identity comes from: an MQTT 5 user property, a CBOR envelope, or your own extractor.
//!
//! Never the MQTT packet id: the broker reuses packet ids as soon as they are acked.

use ciborium::Value;

use crate::store::error::InvalidDelivery;

/// One QoS1 publish as received, owned, before its identity is known.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Incoming {
    /// Topic name of the publish.
    pub topic: String,
    /// Payload bytes.
    pub payload: Vec<u8>,
    /// MQTT 5 user properties, in packet order (always empty for MQTT 3.1.1).
    pub user_properties: Vec<(String, String)>,
}

impl Incoming {
    /// A publish without user properties.
    pub fn new(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Incoming {
        Incoming {
            topic: topic.into(),
            payload: payload.into(),
            user_properties: Vec::new(),
        }
    }

    /// The same publish with one more user property.
    pub fn with_user_property(
        mut self,
        name: impl Into<String>,
        value: impl Into<String>,
    ) -> Incoming {
        self.user_properties.push((name.into(), value.into()));
        self
    }

    /// The first user property called `name`.
    pub fn user_property(&self, name: &str) -> Option<&str> {
        self.user_properties
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The application identity of one delivery, and the body the handler sees.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Identity {
    /// Application message id (required, non-empty).
    pub message_id: String,
    /// Optional producer namespace.
    pub producer: Option<String>,
    /// Producer's sequence number, if any.
    pub sequence: Option<u64>,
    /// Producer's creation time, Unix seconds, if any.
    pub sent_at: Option<i64>,
    /// The body for the handler and the fingerprint when it is not the whole payload (an envelope's `body`).
    /// `None`: the payload itself.
    pub body: Option<Vec<u8>>,
}

impl Identity {
    /// An identity with only a message id; the payload is the body.
    pub fn new(message_id: impl Into<String>) -> Identity {
        Identity {
            message_id: message_id.into(),
            ..Identity::default()
        }
    }

    /// The same identity with a producer namespace.
    pub fn with_producer(mut self, producer: impl Into<String>) -> Identity {
        self.producer = Some(producer.into());
        self
    }
}

/// Finds the identity of an incoming publish. An `Err` is bad input: the consumer quarantines the publish
/// (topic, payload, reason) and acks it, so it is kept for an operator and does not block the stream.
///
/// Any `Fn(&Incoming) -> Result<Identity, InvalidDelivery> + Send` is an extractor, for identities carried
/// elsewhere (a field of a JSON payload, say).
pub trait ExtractIdentity: Send {
    /// The identity of `msg`, or why it has none.
    fn extract(&self, msg: &Incoming) -> Result<Identity, InvalidDelivery>;
}

impl<F: Fn(&Incoming) -> Result<Identity, InvalidDelivery> + Send> ExtractIdentity for F {
    fn extract(&self, msg: &Incoming) -> Result<Identity, InvalidDelivery> {
        self(msg)
    }
}

/// Identity from MQTT 5 user properties: the message id in `message-id` and the optional producer namespace
/// in `producer` (names configurable). The payload is the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserProperty {
    /// Name of the property holding the message id. Default `message-id`.
    pub id: String,
    /// Name of the property holding the producer namespace, or `None` to ignore producers.
    /// Default `producer`.
    pub producer: Option<String>,
}

impl Default for UserProperty {
    fn default() -> Self {
        UserProperty {
            id: "message-id".into(),
            producer: Some("producer".into()),
        }
    }
}

impl ExtractIdentity for UserProperty {
    fn extract(&self, msg: &Incoming) -> Result<Identity, InvalidDelivery> {
        let id = msg
            .user_property(&self.id)
            .ok_or(InvalidDelivery::MissingId)?;
        let producer = self.producer.as_deref().and_then(|p| msg.user_property(p));
        Ok(Identity {
            message_id: id.to_owned(),
            producer: producer.map(str::to_owned),
            ..Identity::default()
        })
    }
}

/// Identity from a CBOR envelope in the payload, for MQTT 3.1.1 where there are no user properties.
///
/// The payload is one CBOR map with text keys:
///
/// | key | type | |
/// |---|---|---|
/// | `id` | text | required, the message id |
/// | `producer` | text | optional producer namespace |
/// | `seq` | unsigned integer | optional producer sequence number |
/// | `sent_at` | integer | optional creation time, Unix seconds |
/// | `body` | byte string | required, what the handler sees |
///
/// Unknown keys are ignored (room for later additions). The handler and the fingerprint see `body`, so two
/// envelopes with the same `id` and `body` are the same delivery, and a changed `body` is a conflict.
///
/// ```
/// use edge_inbox::{Envelope, ExtractIdentity, Incoming};
/// let payload = Envelope::new("evt-42-created", br#"{"order":42}"#.to_vec()).producer("shop-1").encode();
/// let id = Envelope::default().extract(&Incoming::new("orders/42", payload)).unwrap();
/// assert_eq!(id.message_id, "evt-42-created");
/// assert_eq!(id.body.as_deref(), Some(&br#"{"order":42}"#[..]));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Envelope {
    /// Message id.
    pub id: String,
    /// Producer namespace.
    pub producer: Option<String>,
    /// Producer sequence number.
    pub seq: Option<u64>,
    /// Creation time, Unix seconds.
    pub sent_at: Option<i64>,
    /// The application payload.
    pub body: Vec<u8>,
}

impl Envelope {
    /// An envelope with an id and a body.
    pub fn new(id: impl Into<String>, body: Vec<u8>) -> Envelope {
        Envelope {
            id: id.into(),
            body,
            ..Envelope::default()
        }
    }

    /// Sets the producer namespace.
    pub fn producer(mut self, producer: impl Into<String>) -> Envelope {
        self.producer = Some(producer.into());
        self
    }

    /// Sets the producer sequence number.
    pub fn seq(mut self, seq: u64) -> Envelope {
        self.seq = Some(seq);
        self
    }

    /// Sets the creation time.
    pub fn sent_at(mut self, sent_at: i64) -> Envelope {
        self.sent_at = Some(sent_at);
        self
    }

    /// The CBOR encoding, for publishers.
    pub fn encode(&self) -> Vec<u8> {
        let mut map = vec![(Value::Text("id".into()), Value::Text(self.id.clone()))];
        if let Some(p) = &self.producer {
            map.push((Value::Text("producer".into()), Value::Text(p.clone())));
        }
        if let Some(s) = self.seq {
            map.push((Value::Text("seq".into()), Value::Integer(s.into())));
        }
        if let Some(t) = self.sent_at {
            map.push((Value::Text("sent_at".into()), Value::Integer(t.into())));
        }
        map.push((Value::Text("body".into()), Value::Bytes(self.body.clone())));
        let mut out = Vec::with_capacity(self.body.len() + self.id.len() + 32);
        ciborium::into_writer(&Value::Map(map), &mut out)
            .expect("writing CBOR to a Vec cannot fail");
        out
    }

    /// Decodes an envelope; every error is a [`InvalidDelivery::MalformedEnvelope`] or
    /// [`InvalidDelivery::MissingId`].
    pub fn decode(payload: &[u8]) -> Result<Envelope, InvalidDelivery> {
        let bad = |why: String| InvalidDelivery::MalformedEnvelope(why);
        let value: Value =
            ciborium::from_reader(payload).map_err(|e| bad(format!("not CBOR: {e}")))?;
        let Value::Map(entries) = value else {
            return Err(bad("not a CBOR map".into()));
        };
        let mut env = Envelope::default();
        let (mut have_id, mut have_body) = (false, false);
        for (k, v) in entries {
            let Value::Text(k) = k else { continue };
            match (k.as_str(), v) {
                ("id", Value::Text(s)) => (env.id, have_id) = (s, true),
                ("producer", Value::Text(s)) => env.producer = Some(s),
                ("seq", Value::Integer(i)) => {
                    env.seq = Some(
                        u64::try_from(i)
                            .map_err(|_| bad("seq is not an unsigned 64-bit integer".into()))?,
                    )
                }
                ("sent_at", Value::Integer(i)) => {
                    env.sent_at =
                        Some(i64::try_from(i).map_err(|_| bad("sent_at is out of range".into()))?)
                }
                ("body", Value::Bytes(b)) => (env.body, have_body) = (b, true),
                ("id" | "producer" | "seq" | "sent_at" | "body", _) => {
                    return Err(bad(format!("field {k:?} has the wrong type")))
                }
                _ => {}
            }
        }
        if !have_id {
            return Err(InvalidDelivery::MissingId);
        }
        if !have_body {
            return Err(bad("no body".into()));
        }
        Ok(env)
    }
}

impl ExtractIdentity for Envelope {
    /// Ignores `self`'s fields: the extractor is `Envelope::default()`.
    fn extract(&self, msg: &Incoming) -> Result<Identity, InvalidDelivery> {
        let env = Envelope::decode(&msg.payload)?;
        Ok(Identity {
            message_id: env.id,
            producer: env.producer,
            sequence: env.seq,
            sent_at: env.sent_at,
            body: Some(env.body),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trips_and_rejects_bad_input() {
        let env = Envelope::new("e-1", b"body".to_vec())
            .producer("p")
            .seq(7)
            .sent_at(1_700_000_000);
        assert_eq!(Envelope::decode(&env.encode()).unwrap(), env);
        assert!(matches!(
            Envelope::decode(b"{\"json\":1}"),
            Err(InvalidDelivery::MalformedEnvelope(_))
        ));
        let mut no_id = Vec::new();
        ciborium::into_writer(
            &Value::Map(vec![(Value::Text("body".into()), Value::Bytes(vec![1]))]),
            &mut no_id,
        )
        .unwrap();
        assert_eq!(Envelope::decode(&no_id), Err(InvalidDelivery::MissingId));
        let mut wrong = Vec::new();
        ciborium::into_writer(
            &Value::Map(vec![(Value::Text("id".into()), Value::Integer(5.into()))]),
            &mut wrong,
        )
        .unwrap();
        assert!(matches!(
            Envelope::decode(&wrong),
            Err(InvalidDelivery::MalformedEnvelope(_))
        ));
    }

    #[test]
    fn user_property_names_are_configurable() {
        let msg = Incoming::new("t", b"x".to_vec())
            .with_user_property("msg", "42")
            .with_user_property("src", "s1");
        assert_eq!(
            UserProperty::default().extract(&msg),
            Err(InvalidDelivery::MissingId)
        );
        let ex = UserProperty {
            id: "msg".into(),
            producer: Some("src".into()),
        };
        assert_eq!(
            ex.extract(&msg).unwrap(),
            Identity::new("42").with_producer("s1")
        );
    }
}
