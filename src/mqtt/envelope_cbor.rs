//! Decoding a CBOR envelope as a stream: the fields it knows are read into place, everything else is
//! skipped without being built, so a publisher's padding (a long array, a deep map, keys of any type) costs
//! no memory. Building a whole `ciborium::Value` first took about fifty times the payload.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// The fields of an envelope as found (a repeated key: the last), before the checks that need all of them.
#[derive(Default)]
pub(crate) struct Fields {
    pub(crate) id: Option<String>,
    pub(crate) producer: Option<String>,
    pub(crate) seq: Option<u64>,
    pub(crate) sent_at: Option<i64>,
    pub(crate) body: Option<Vec<u8>>,
    /// The first problem with a known field, in the map's order: a value of the wrong type, or a number
    /// out of range.
    pub(crate) malformed: Option<String>,
}

/// An integer as CBOR carries it: up to 65 bits, sign included.
#[derive(Clone, Copy)]
struct Number(i128);

/// Why a payload is not an envelope at all.
pub(crate) enum NotAnEnvelope {
    /// Not CBOR, or cut short.
    Syntax(String),
    /// CBOR, but not a map.
    NotAMap,
}

/// Reads the envelope's fields from `payload`.
pub(crate) fn fields(payload: &[u8]) -> Result<Fields, NotAnEnvelope> {
    match ciborium::from_reader::<TopLevel, _>(payload) {
        Ok(TopLevel(Some(f))) => Ok(f),
        Ok(TopLevel(None)) => Err(NotAnEnvelope::NotAMap),
        Err(e) => Err(NotAnEnvelope::Syntax(e.to_string())),
    }
}

/// The decoded top level, for `ciborium::from_reader`.
struct TopLevel(Option<Fields>);

impl<'de> de::Deserialize<'de> for TopLevel {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<TopLevel, D::Error> {
        d.deserialize_any(Top).map(TopLevel)
    }
}

/// The top level: a map is an envelope's fields (`Some`), anything else is not one (`None`).
struct Top;

impl<'de> Visitor<'de> for Top {
    type Value = Option<Fields>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a CBOR map")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut f = Fields::default();
        while let Some(key) = map.next_key::<Key>()? {
            let (name, kind) = match key {
                Key::Id => ("id", Kind::Text),
                Key::Producer => ("producer", Kind::Text),
                Key::Seq => ("seq", Kind::Integer),
                Key::SentAt => ("sent_at", Kind::Integer),
                Key::Body => ("body", Kind::Bytes),
                Key::Other => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            let problem = match (key, map.next_value_seed(kind)?) {
                (Key::Id, Found::Text(s)) => set(&mut f.id, s),
                (Key::Producer, Found::Text(s)) => set(&mut f.producer, s),
                (Key::Seq, Found::Integer(Number(n))) => match u64::try_from(n) {
                    Ok(n) => set(&mut f.seq, n),
                    Err(_) => Some("seq is not an unsigned 64-bit integer".to_owned()),
                },
                (Key::SentAt, Found::Integer(Number(n))) => match i64::try_from(n) {
                    Ok(n) => set(&mut f.sent_at, n),
                    Err(_) => Some("sent_at is out of range".to_owned()),
                },
                (Key::Body, Found::Bytes(b)) => set(&mut f.body, b),
                _ => Some(format!("field {name:?} has the wrong type")),
            };
            if f.malformed.is_none() {
                f.malformed = problem;
            }
        }
        Ok(Some(f))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Ok(None)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_i128<E: de::Error>(self, _: i128) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_u128<E: de::Error>(self, _: u128) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, tagged: A) -> Result<Self::Value, A::Error> {
        // A tagged value (ciborium presents a tag as an enum): not a plain map.
        skip_tagged(tagged).map(|()| None)
    }
}

/// Stores a field's value; no problem.
fn set<T>(slot: &mut Option<T>, value: T) -> Option<String> {
    *slot = Some(value);
    None
}

/// Skips a tagged value and what it wraps.
fn skip_tagged<'de, A: de::EnumAccess<'de>>(tagged: A) -> Result<(), A::Error> {
    let (_, wrapped) = tagged.variant::<IgnoredAny>()?;
    de::VariantAccess::newtype_variant::<IgnoredAny>(wrapped).map(drop)
}

/// A map key: one of the envelope's names, or anything else (skipped, whatever its type or size).
#[derive(Clone, Copy)]
enum Key {
    Id,
    Producer,
    Seq,
    SentAt,
    Body,
    Other,
}

impl<'de> de::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        d.deserialize_any(KeyVisitor)
    }
}

struct KeyVisitor;

impl<'de> Visitor<'de> for KeyVisitor {
    type Value = Key;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map key")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Key, E> {
        Ok(match s {
            "id" => Key::Id,
            "producer" => Key::Producer,
            "seq" => Key::Seq,
            "sent_at" => Key::SentAt,
            "body" => Key::Body,
            _ => Key::Other,
        })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Key, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Key::Other)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Key, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Key::Other)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Key, E> {
        Ok(Key::Other)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Key, E> {
        Ok(Key::Other)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Key, E> {
        Ok(Key::Other)
    }

    fn visit_i128<E: de::Error>(self, _: i128) -> Result<Key, E> {
        Ok(Key::Other)
    }

    fn visit_u128<E: de::Error>(self, _: u128) -> Result<Key, E> {
        Ok(Key::Other)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Key, E> {
        Ok(Key::Other)
    }

    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Key, E> {
        Ok(Key::Other)
    }

    fn visit_none<E: de::Error>(self) -> Result<Key, E> {
        Ok(Key::Other)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Key, E> {
        Ok(Key::Other)
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, tagged: A) -> Result<Key, A::Error> {
        skip_tagged(tagged).map(|()| Key::Other)
    }
}

/// The type a known field should have.
#[derive(Clone, Copy)]
enum Kind {
    Text,
    Integer,
    Bytes,
}

/// A known field's value: of its type, or of another (skipped).
enum Found {
    Text(String),
    Integer(Number),
    Bytes(Vec<u8>),
    Wrong,
}

impl<'de> DeserializeSeed<'de> for Kind {
    type Value = Found;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Found, D::Error> {
        d.deserialize_any(FieldVisitor(self))
    }
}

struct FieldVisitor(Kind);

impl FieldVisitor {
    fn integer(&self, n: i128) -> Found {
        match self.0 {
            Kind::Integer => Found::Integer(Number(n)),
            _ => Found::Wrong,
        }
    }
}

impl<'de> Visitor<'de> for FieldVisitor {
    type Value = Found;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an envelope field")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Found, E> {
        Ok(match self.0 {
            Kind::Text => Found::Text(s.to_owned()),
            _ => Found::Wrong,
        })
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Found, E> {
        Ok(match self.0 {
            Kind::Text => Found::Text(s),
            _ => Found::Wrong,
        })
    }

    fn visit_bytes<E: de::Error>(self, b: &[u8]) -> Result<Found, E> {
        Ok(match self.0 {
            Kind::Bytes => Found::Bytes(b.to_vec()),
            _ => Found::Wrong,
        })
    }

    fn visit_byte_buf<E: de::Error>(self, b: Vec<u8>) -> Result<Found, E> {
        Ok(match self.0 {
            Kind::Bytes => Found::Bytes(b),
            _ => Found::Wrong,
        })
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<Found, E> {
        Ok(self.integer(n.into()))
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Found, E> {
        Ok(self.integer(n.into()))
    }

    fn visit_i128<E: de::Error>(self, n: i128) -> Result<Found, E> {
        Ok(self.integer(n))
    }

    fn visit_u128<E: de::Error>(self, n: u128) -> Result<Found, E> {
        // Beyond any CBOR integer: out of range for both integer fields.
        Ok(self.integer(i128::try_from(n).unwrap_or(i128::MAX)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Found, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Found::Wrong)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Found::Wrong)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Found, E> {
        Ok(Found::Wrong)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Found, E> {
        Ok(Found::Wrong)
    }

    fn visit_none<E: de::Error>(self) -> Result<Found, E> {
        Ok(Found::Wrong)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Found, E> {
        Ok(Found::Wrong)
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, tagged: A) -> Result<Found, A::Error> {
        // A tagged value is not of a field's plain type.
        skip_tagged(tagged).map(|()| Found::Wrong)
    }
}
