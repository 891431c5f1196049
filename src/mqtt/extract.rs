//! Where a delivery's identity comes from: an MQTT 5 user property, a CBOR envelope, or your own extractor.
//!
//! Never the MQTT packet id: the broker reuses packet ids as soon as they are acked.

use ciborium::Value;

use crate::mqtt::envelope_cbor::{self, NotAnEnvelope};
use crate::store::error::InvalidDelivery;

/// One QoS1 publish as received, owned, before its identity is known. Built from rumqttc's publishes with
/// `Inbound::from` (MQTT 5 and 3.1.1; feature `mqtt`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Inbound {
    /// Topic name of the publish.
    pub topic: String,
    /// Payload bytes.
    pub payload: Vec<u8>,
    /// MQTT 5 user properties, in packet order (always empty for MQTT 3.1.1).
    pub user_properties: Vec<(String, String)>,
}

/// The former name of [`Inbound`] (it clashed with `rumqttc::v5::Incoming`).
#[deprecated(since = "0.2.0", note = "renamed to `Inbound`")]
pub type Incoming = Inbound;

impl Inbound {
    /// A publish without user properties.
    pub fn new(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Inbound {
        Inbound {
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
    ) -> Inbound {
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
/// Any `Fn(&Inbound) -> Result<Identity, InvalidDelivery> + Send` is an extractor, for identities carried
/// elsewhere (a field of a JSON payload, say).
pub trait ExtractIdentity: Send {
    /// The identity of `msg`, or why it has none.
    fn extract(&self, msg: &Inbound) -> Result<Identity, InvalidDelivery>;
}

impl<F: Fn(&Inbound) -> Result<Identity, InvalidDelivery> + Send> ExtractIdentity for F {
    fn extract(&self, msg: &Inbound) -> Result<Identity, InvalidDelivery> {
        self(msg)
    }
}

/// Identity from MQTT 5 user properties: the message id in `message-id`, the optional producer namespace
/// in `producer` and the optional send time in `sent-at` (names configurable). The payload is the body.
///
/// `sent-at` is when the producer created the message, as Unix seconds in decimal (`1767225600`, what the
/// outbox relay stamps) or as an RFC 3339 time (`2026-01-01T00:00:00Z`, `2026-01-01T01:00:00.5+01:00`;
/// fractions of a second are dropped). It feeds [`Delivery::sent_at`](crate::Delivery::sent_at), which lets
/// a scope with an identity horizon recognise a repetition older than what it pruned. A value that is
/// neither is bad input ([`InvalidDelivery::MalformedProperty`]): the publish is quarantined, not taken as
/// undated.
///
/// ```
/// use edge_inbox::{ExtractIdentity, Inbound, UserProperty};
/// let msg = Inbound::new("orders/42", b"{}".to_vec())
///     .with_user_property("message-id", "evt-42-created")
///     .with_user_property("sent-at", "2026-01-01T00:00:00Z");
/// let id = UserProperty::default().extract(&msg).unwrap();
/// assert_eq!(id.sent_at, Some(1_767_225_600));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct UserProperty {
    /// Name of the property holding the message id. Default `message-id`.
    pub id: String,
    /// Name of the property holding the producer namespace, or `None` to ignore producers.
    /// Default `producer`.
    pub producer: Option<String>,
    /// Name of the property holding the send time, or `None` to ignore it. Default `sent-at`.
    pub sent_at: Option<String>,
}

impl Default for UserProperty {
    fn default() -> Self {
        UserProperty {
            id: "message-id".into(),
            producer: Some("producer".into()),
            sent_at: Some(SENT_AT.into()),
        }
    }
}

/// The user property that carries a message's send time: `sent-at`.
pub const SENT_AT: &str = "sent-at";

impl UserProperty {
    /// The default names with the message id in property `id` and the producer in `producer`.
    pub fn new(id: impl Into<String>, producer: Option<String>) -> UserProperty {
        UserProperty {
            id: id.into(),
            producer,
            ..UserProperty::default()
        }
    }

    /// The same extractor reading the send time from property `name` (`None`: ignore send times).
    pub fn with_sent_at(mut self, name: Option<String>) -> UserProperty {
        self.sent_at = name;
        self
    }
}

/// Parses a send time: Unix seconds in decimal, or an RFC 3339 date-time; `Err` says why not.
pub fn parse_sent_at(value: &str) -> Result<i64, String> {
    let v = value.trim();
    if !v.is_empty()
        && v.bytes()
            .enumerate()
            .all(|(i, b)| b.is_ascii_digit() || (i == 0 && b == b'-'))
    {
        return v
            .parse::<i64>()
            .map_err(|_| format!("{} is out of range for Unix seconds", shown(value)));
    }
    rfc3339(v).ok_or_else(|| {
        format!(
            "{} is neither Unix seconds nor an RFC 3339 time",
            shown(value)
        )
    })
}

/// A publisher's value quoted in an error: its first characters only, so that a huge property does not
/// become a huge log line and quarantine reason.
fn shown(value: &str) -> String {
    const SHOWN: usize = 64;
    match value.char_indices().nth(SHOWN) {
        Some((end, _)) => format!("{:?}... ({} bytes)", &value[..end], value.len()),
        None => format!("{value:?}"),
    }
}

/// `YYYY-MM-DDTHH:MM:SS[.frac](Z|+HH:MM|-HH:MM)`, to Unix seconds.
fn rfc3339(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let part = b.get(r)?;
        part.iter().all(u8::is_ascii_digit).then_some(())?;
        std::str::from_utf8(part).ok()?.parse().ok()
    };
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let mut i = 19;
    if b[i] == b'.' {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if i == start {
            return None;
        }
    }
    let offset = match b.get(i)? {
        b'Z' | b'z' if i + 1 == b.len() => 0,
        sign @ (b'+' | b'-') if i + 6 == b.len() && b[i + 3] == b':' => {
            let (h, m) = (num(i + 1..i + 3)?, num(i + 4..i + 6)?);
            if h > 23 || m > 59 {
                return None;
            }
            let o = h * 3600 + m * 60;
            if *sign == b'+' {
                o
            } else {
                -o
            }
        }
        _ => return None,
    };
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let days_in = [
        31,
        if leap { 29 } else { 28 },
        31,
        30,
        31,
        30,
        31,
        31,
        30,
        31,
        30,
        31,
    ];
    if !(1..=12).contains(&month) || day < 1 || day > days_in[(month - 1) as usize] {
        return None;
    }
    if hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    Some(days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second - offset)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

impl ExtractIdentity for UserProperty {
    fn extract(&self, msg: &Inbound) -> Result<Identity, InvalidDelivery> {
        let id = msg
            .user_property(&self.id)
            .ok_or(InvalidDelivery::MissingId)?;
        let producer = self.producer.as_deref().and_then(|p| msg.user_property(p));
        let sent_at = match self
            .sent_at
            .as_deref()
            .and_then(|name| msg.user_property(name).map(|v| (name, v)))
        {
            None => None,
            Some((name, v)) => {
                Some(
                    parse_sent_at(v).map_err(|why| InvalidDelivery::MalformedProperty {
                        name: name.to_owned(),
                        why,
                    })?,
                )
            }
        };
        Ok(Identity {
            message_id: id.to_owned(),
            producer: producer.map(str::to_owned),
            sent_at,
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
/// use edge_inbox::{Envelope, ExtractIdentity, Inbound};
/// let payload = Envelope::new("evt-42-created", br#"{"order":42}"#.to_vec()).producer("shop-1").encode();
/// let id = Envelope::default().extract(&Inbound::new("orders/42", payload)).unwrap();
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
        // Read as a stream: what the envelope does not use is skipped, never built in memory.
        let f = envelope_cbor::fields(payload).map_err(|e| match e {
            NotAnEnvelope::Syntax(e) => bad(format!("not CBOR: {e}")),
            NotAnEnvelope::NotAMap => bad("not a CBOR map".into()),
        })?;
        if let Some(why) = f.malformed {
            return Err(bad(why));
        }
        let Some(id) = f.id else {
            return Err(InvalidDelivery::MissingId);
        };
        let Some(body) = f.body else {
            return Err(bad("no body".into()));
        };
        Ok(Envelope {
            id,
            producer: f.producer,
            seq: f.seq,
            sent_at: f.sent_at,
            body,
        })
    }
}

impl ExtractIdentity for Envelope {
    /// Ignores `self`'s fields: the extractor is `Envelope::default()`.
    fn extract(&self, msg: &Inbound) -> Result<Identity, InvalidDelivery> {
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
        let msg = Inbound::new("t", b"x".to_vec())
            .with_user_property("msg", "42")
            .with_user_property("src", "s1");
        assert_eq!(
            UserProperty::default().extract(&msg),
            Err(InvalidDelivery::MissingId)
        );
        let ex = UserProperty::new("msg", Some("src".into()));
        assert_eq!(
            ex.extract(&msg).unwrap(),
            Identity::new("42").with_producer("s1")
        );
    }

    #[test]
    fn sent_at_is_read_as_unix_seconds_or_rfc_3339() {
        assert_eq!(parse_sent_at("1767225600"), Ok(1_767_225_600));
        assert_eq!(parse_sent_at("2026-01-01T00:00:00Z"), Ok(1_767_225_600));
        assert_eq!(
            parse_sent_at("2026-01-01T01:00:00.25+01:00"),
            Ok(1_767_225_600)
        );
        assert_eq!(
            parse_sent_at("2025-12-31T19:00:00-05:00"),
            Ok(1_767_225_600)
        );
        assert_eq!(parse_sent_at("1970-01-01T00:00:00Z"), Ok(0));
        assert_eq!(parse_sent_at("2024-02-29T12:00:00Z"), Ok(1_709_208_000));
        for bad in [
            "",
            "soon",
            "2026-02-30T00:00:00Z",
            "2026-01-01T00:00:00",
            "2026-01-01T24:00:00Z",
            "1e9",
        ] {
            assert!(parse_sent_at(bad).is_err(), "{bad:?}");
        }
        let msg = Inbound::new("t", b"x".to_vec())
            .with_user_property("message-id", "m")
            .with_user_property("sent-at", "yesterday");
        assert!(matches!(
            UserProperty::default().extract(&msg),
            Err(InvalidDelivery::MalformedProperty { .. })
        ));
        let ignoring = UserProperty::default().with_sent_at(None);
        assert_eq!(ignoring.extract(&msg).unwrap().sent_at, None);
    }
}
