//! Identity from the property bag at the end of a topic, where Azure IoT Hub carries a cloud-to-device
//! message's id: `devices/d1/messages/devicebound/%24.mid=abc&%24.to=%2Fdevices%2Fd1%2Fmessages%2Fdevicebound`.

use crate::mqtt::extract::{ExtractIdentity, Identity, Inbound};
use crate::store::error::InvalidDelivery;

/// Identity from URL-encoded `key=value` pairs, separated by `&`, after the topic's last `/` (Azure IoT
/// Hub's cloud-to-device topic `devices/{device}/messages/devicebound/{property bag}`). The message id is
/// the value of property `$.mid` by default; keys and values are percent-decoded (`%24.mid` is `$.mid`;
/// `+` stays a `+`). The payload is the body.
///
/// Bad input is an `Err`, so the consumer quarantines the delivery with the reason: no bag or no such
/// property ([`InvalidDelivery::MissingId`]), the property given twice, an empty value, a bad `%` escape
/// or an escape that is not UTF-8 ([`InvalidDelivery::MalformedProperty`]). A value over the inbox
/// [`Limits`](crate::Limits) is quarantined by the consumer like any other over-long id.
///
/// ```
/// use edge_inbox::{ExtractIdentity, Inbound, PropertyBag};
/// let topic = "devices/d1/messages/devicebound/%24.mid=abc-1&%24.to=%2Fdevices%2Fd1%2Fmessages%2Fdevicebound";
/// let id = PropertyBag::default().extract(&Inbound::new(topic, b"{}".to_vec())).unwrap();
/// assert_eq!(id.message_id, "abc-1");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PropertyBag {
    /// The property holding the message id (decoded name). Default `$.mid`.
    pub id: String,
    /// The property holding the producer namespace, or `None` (the default) for none.
    pub producer: Option<String>,
}

impl Default for PropertyBag {
    fn default() -> Self {
        PropertyBag {
            id: "$.mid".into(),
            producer: None,
        }
    }
}

impl PropertyBag {
    /// The message id in property `id` (decoded name, e.g. `$.mid` or an application property).
    pub fn new(id: impl Into<String>) -> PropertyBag {
        PropertyBag {
            id: id.into(),
            producer: None,
        }
    }

    /// The same extractor reading the producer namespace from property `name` (`None`: no producer).
    pub fn with_producer(mut self, name: Option<String>) -> PropertyBag {
        self.producer = name;
        self
    }

    /// The value of property `name` in `topic`'s bag: `Ok(None)` when absent.
    fn find(&self, topic: &str, name: &str) -> Result<Option<String>, InvalidDelivery> {
        let bad = |why: String| InvalidDelivery::MalformedProperty {
            name: name.to_owned(),
            why,
        };
        let bag = topic.rsplit_once('/').map_or(topic, |(_, bag)| bag);
        let mut found = None;
        for pair in bag.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let key = decode(key)
                .map_err(|why| bad(format!("a key in the topic's property bag {why}")))?;
            if key != name {
                continue;
            }
            if found.is_some() {
                return Err(bad(
                    "given more than once in the topic's property bag".into()
                ));
            }
            let value = decode(value).map_err(|why| bad(format!("value {why}")))?;
            if value.is_empty() {
                return Err(bad("empty value in the topic's property bag".into()));
            }
            found = Some(value);
        }
        Ok(found)
    }
}

/// Percent-decodes `s`; `Err` says what is wrong.
fn decode(s: &str) -> Result<String, String> {
    if !s.contains('%') {
        return Ok(s.to_owned());
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'%' {
            out.push(b[i]);
            i += 1;
            continue;
        }
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b.get(i + 1).and_then(|&c| hex(c)),
            b.get(i + 2).and_then(|&c| hex(c)),
        ) {
            (Some(h), Some(l)) => out.push((h * 16 + l) as u8),
            _ => return Err(format!("has a bad % escape at byte {i}")),
        }
        i += 3;
    }
    String::from_utf8(out).map_err(|_| "decodes to bytes that are not UTF-8".into())
}

impl ExtractIdentity for PropertyBag {
    fn extract(&self, msg: &Inbound) -> Result<Identity, InvalidDelivery> {
        let id = self
            .find(&msg.topic, &self.id)?
            .ok_or(InvalidDelivery::MissingId)?;
        let producer = match &self.producer {
            Some(p) => self.find(&msg.topic, p)?,
            None => None,
        };
        Ok(Identity {
            message_id: id,
            producer,
            ..Identity::default()
        })
    }
}
