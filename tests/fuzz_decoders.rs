//! Property-based fuzzing of everything that parses outside input: the CBOR envelope decoder (arbitrary bytes
//! and mutated valid envelopes), identity extraction from arbitrary MQTT 5 user properties, and the CBOR state
//! values a handler reads back. No input may panic; every rejection must be a typed error with a message.
//!
//! Bounded for CI: `EDGE_INBOX_FUZZ_CASES` (default 512 per property) sets the number of cases.

use std::cell::RefCell;

use edge_inbox::{
    Config, Delivery, Envelope, Error, ExtractIdentity, Inbound, Inbox, InvalidDelivery, Outcome,
    Tx, UserProperty,
};
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, TestCaseError, TestRunner};

fn cases() -> u32 {
    std::env::var("EDGE_INBOX_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(512)
}

fn config() -> PtConfig {
    PtConfig {
        cases: cases(),
        failure_persistence: None,
        ..PtConfig::default()
    }
}

/// A rejection must say what is wrong.
fn clear(e: &InvalidDelivery) {
    match e {
        InvalidDelivery::MalformedEnvelope(why) => assert!(!why.is_empty()),
        InvalidDelivery::MissingId => {}
        other => panic!("the decoder returned {other:?}"),
    }
    assert!(!e.to_string().is_empty());
}

fn envelope() -> impl Strategy<Value = Envelope> {
    (
        ".{0,40}",
        proptest::option::of(".{0,20}"),
        proptest::option::of(any::<u64>()),
        proptest::option::of(any::<i64>()),
        proptest::collection::vec(any::<u8>(), 0..200),
    )
        .prop_map(|(id, producer, seq, sent_at, body)| {
            let mut e = Envelope::new(id, body);
            e.producer = producer;
            e.seq = seq;
            e.sent_at = sent_at;
            e
        })
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Truncate(usize),
    Insert(usize, u8),
    Delete(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1..=255u8).prop_map(|(i, x)| Mutation::Flip(i, x)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Delete),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let n = bytes.len();
    match *m {
        Mutation::Flip(i, x) if n > 0 => bytes[i % n] ^= x,
        Mutation::Truncate(i) => bytes.truncate(i % (n + 1)),
        Mutation::Insert(i, b) => bytes.insert(i % (n + 1), b),
        Mutation::Delete(i) if n > 0 => {
            bytes.remove(i % n);
        }
        _ => {}
    }
}

#[test]
fn envelope_decoder_survives_arbitrary_bytes() {
    let mut runner = TestRunner::new(config());
    runner
        .run(&proptest::collection::vec(any::<u8>(), 0..512), |bytes| {
            if let Err(e) = Envelope::decode(&bytes) {
                clear(&e);
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn envelope_decoder_survives_mutated_envelopes_and_round_trips_valid_ones() {
    let mut runner = TestRunner::new(config());
    runner
        .run(
            &(envelope(), proptest::collection::vec(mutation(), 0..6)),
            |(env, mutations)| {
                let mut bytes = env.encode();
                prop_assert_eq!(Envelope::decode(&bytes).unwrap(), env.clone());
                for m in &mutations {
                    apply(&mut bytes, m);
                }
                match Envelope::decode(&bytes) {
                    // Whatever decodes must survive its own round trip.
                    Ok(decoded) => {
                        prop_assert_eq!(Envelope::decode(&decoded.encode()).unwrap(), decoded)
                    }
                    Err(e) => clear(&e),
                }
                Ok(())
            },
        )
        .unwrap();
}

/// The decoder as it was written first: the whole CBOR value built, then the envelope's fields read from it.
/// The streaming decoder must agree with it on every input (the same envelope, or the same kind of error).
fn decode_whole_value(payload: &[u8]) -> Result<Envelope, InvalidDelivery> {
    use ciborium::Value;
    let bad = |why: String| InvalidDelivery::MalformedEnvelope(why);
    let value: Value = ciborium::from_reader(payload).map_err(|e| bad(format!("not CBOR: {e}")))?;
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
                env.seq = Some(u64::try_from(i).map_err(|_| bad("seq".into()))?)
            }
            ("sent_at", Value::Integer(i)) => {
                env.sent_at = Some(i64::try_from(i).map_err(|_| bad("sent_at".into()))?)
            }
            ("body", Value::Bytes(b)) => (env.body, have_body) = (b, true),
            ("id" | "producer" | "seq" | "sent_at" | "body", _) => {
                return Err(bad(format!("field {k:?}")))
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

fn same_decoding(bytes: &[u8]) -> Result<(), TestCaseError> {
    match (Envelope::decode(bytes), decode_whole_value(bytes)) {
        (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
        (Err(InvalidDelivery::MissingId), Err(InvalidDelivery::MissingId)) => {}
        (
            Err(InvalidDelivery::MalformedEnvelope(_)),
            Err(InvalidDelivery::MalformedEnvelope(_)),
        ) => {}
        (a, b) => prop_assert!(false, "{bytes:02x?}: streaming {a:?}, whole value {b:?}"),
    }
    Ok(())
}

#[test]
fn the_streaming_decoder_agrees_with_one_that_builds_the_whole_value() {
    let mut runner = TestRunner::new(config());
    runner
        .run(&proptest::collection::vec(any::<u8>(), 0..512), |bytes| {
            same_decoding(&bytes)
        })
        .unwrap();
    runner
        .run(
            &(envelope(), proptest::collection::vec(mutation(), 0..6)),
            |(env, mutations)| {
                let mut bytes = env.encode();
                for m in &mutations {
                    apply(&mut bytes, m);
                }
                same_decoding(&bytes)
            },
        )
        .unwrap();
    // Shapes random bytes rarely make: repeated keys, tags, other key types, padding.
    use ciborium::Value;
    let text = |s: &str| Value::Text(s.into());
    let tagged = |v: Value| Value::Tag(7, Box::new(v));
    let shapes = [
        vec![
            (text("id"), text("a")),
            (text("id"), text("b")),
            (text("body"), Value::Bytes(vec![1])),
        ],
        vec![
            (text("id"), text("a")),
            (text("seq"), Value::Integer((-1).into())),
            (text("seq"), Value::Integer(3.into())),
            (text("body"), Value::Bytes(vec![])),
        ],
        vec![
            (text("id"), tagged(text("a"))),
            (text("body"), Value::Bytes(vec![])),
        ],
        vec![
            (tagged(text("id")), text("a")),
            (text("id"), text("b")),
            (text("body"), Value::Bytes(vec![])),
        ],
        vec![
            (Value::Array(vec![Value::Null; 3]), Value::Map(vec![])),
            (text("id"), text("a")),
            (text("body"), Value::Bytes(vec![])),
        ],
        vec![
            (
                text("pad"),
                tagged(Value::Array(vec![Value::Integer(0.into()); 100])),
            ),
            (text("id"), text("a")),
            (text("body"), Value::Bytes(vec![9])),
        ],
        vec![
            (text("id"), text("a")),
            (text("body"), Value::Bytes(vec![])),
            (text("sent_at"), Value::Integer((-5).into())),
            (text("producer"), Value::Null),
        ],
    ];
    for map in shapes {
        let mut bytes = Vec::new();
        ciborium::into_writer(&Value::Map(map), &mut bytes).unwrap();
        same_decoding(&bytes).unwrap();
        let mut tagged_top = Vec::new();
        ciborium::into_writer(
            &tagged(ciborium::from_reader(&bytes[..]).unwrap()),
            &mut tagged_top,
        )
        .unwrap();
        same_decoding(&tagged_top).unwrap();
    }
}

#[test]
fn hostile_cbor_shapes_are_rejected_not_crashed_on() {
    // Nesting far deeper than any envelope: the decoder's recursion limit answers, not the stack.
    let deep = vec![0x81u8; 200_000];
    clear(&Envelope::decode(&deep).unwrap_err());
    let deep_maps: Vec<u8> = std::iter::repeat_n([0xa1u8, 0x60], 100_000)
        .flatten()
        .collect();
    clear(&Envelope::decode(&deep_maps).unwrap_err());
    // Declared lengths far beyond the input: no huge allocation, no panic.
    for huge in [
        &[0x5bu8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff][..],
        &[0x7b, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
        &[0xbb, 0x00, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
        &[0x9b, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00],
    ] {
        clear(&Envelope::decode(huge).unwrap_err());
    }
    // The right keys with the wrong types, and numbers out of range.
    use ciborium::Value;
    let map = |k: &str, v: Value| {
        let mut out = Vec::new();
        let m = vec![
            (Value::Text("id".into()), Value::Text("x".into())),
            (Value::Text(k.into()), v),
            (Value::Text("body".into()), Value::Bytes(vec![])),
        ];
        ciborium::into_writer(&Value::Map(m), &mut out).unwrap();
        out
    };
    let neg_seq = map("seq", Value::Integer((-1).into()));
    assert!(matches!(
        Envelope::decode(&neg_seq),
        Err(InvalidDelivery::MalformedEnvelope(_))
    ));
    let big_sent = map("sent_at", Value::Integer(u64::MAX.into()));
    assert!(matches!(
        Envelope::decode(&big_sent),
        Err(InvalidDelivery::MalformedEnvelope(_))
    ));
}

#[test]
fn identity_extraction_from_arbitrary_user_properties_is_total_and_validated_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = RefCell::new(Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap());
    let names = prop_oneof![
        Just("message-id".to_owned()),
        Just("producer".to_owned()),
        ".{0,12}"
    ];
    let props = proptest::collection::vec((names, ".{0,300}"), 0..6);
    let mut runner = TestRunner::new(PtConfig {
        cases: cases().min(256),
        ..config()
    });
    runner
        .run(&props, |props| {
            let mut msg = Inbound::new("t/1", b"payload".to_vec());
            for (k, v) in &props {
                msg = msg.with_user_property(k.clone(), v.clone());
            }
            let first = |name: &str| props.iter().find(|(k, _)| k == name).map(|(_, v)| v);
            match UserProperty::default().extract(&msg) {
                Err(e) => {
                    prop_assert_eq!(e, InvalidDelivery::MissingId);
                    prop_assert!(first("message-id").is_none());
                }
                Ok(id) => {
                    prop_assert_eq!(Some(&id.message_id), first("message-id"));
                    prop_assert_eq!(id.producer.as_ref(), first("producer"));
                    let mut d = Delivery::new("fuzz", &id.message_id, &msg.topic, &msg.payload);
                    if let Some(p) = &id.producer {
                        d = d.with_producer(p);
                    }
                    let mut inbox = inbox.borrow_mut();
                    let before = inbox.scope_stats("fuzz").unwrap();
                    match inbox.process(&d, |_: &mut Tx<'_>, _: &Delivery<'_>| Ok(())) {
                        Ok(o) => prop_assert!(matches!(o, Outcome::Processed | Outcome::Duplicate)),
                        Err(Error::InvalidDelivery(why)) => {
                            let expected = matches!(
                                why,
                                InvalidDelivery::EmptyMessageId
                                    | InvalidDelivery::EmptyProducer
                                    | InvalidDelivery::TooLong { .. }
                            );
                            prop_assert!(expected, "{:?}", why);
                            prop_assert_eq!(inbox.scope_stats("fuzz").unwrap(), before);
                        }
                        Err(e) => prop_assert!(false, "unexpected error {e:?}"),
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

#[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq)]
struct Stock {
    sku: String,
    qty: i64,
}

#[test]
fn state_values_of_another_type_or_garbage_are_codec_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = RefCell::new(Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap());
    let n = RefCell::new(0u64);
    let mut runner = TestRunner::new(PtConfig {
        cases: cases().min(256),
        ..config()
    });
    runner
        .run(&proptest::collection::vec(any::<u8>(), 0..64), |garbage| {
            let id = {
                let mut n = n.borrow_mut();
                *n += 1;
                format!("evt-{n}")
            };
            let d = Delivery::new("state", &id, "t", b"x");
            let outcome = inbox
                .borrow_mut()
                .process(&d, |tx: &mut Tx<'_>, _: &Delivery<'_>| {
                    // Arbitrary bytes where a value should be.
                    tx.sql().execute(
                        "INSERT OR REPLACE INTO kv (ns, key, value) VALUES (?1, 'raw', ?2)",
                        (tx.scope(), &garbage),
                    )?;
                    for r in [
                        tx.get::<Stock>("raw").map(drop),
                        tx.get::<serde_json::Value>("raw").map(drop),
                        tx.get::<i64>("raw").map(drop),
                    ] {
                        match r {
                            Ok(()) => {}
                            Err(Error::Codec(why)) => assert!(why.contains("state/raw"), "{why}"),
                            Err(e) => panic!("not a codec error: {e:?}"),
                        }
                    }
                    // A value of one type read as another.
                    tx.put("text", "forty-two")?;
                    match tx.get::<i64>("text") {
                        Err(Error::Codec(why)) => assert!(!why.is_empty()),
                        other => panic!("text read as a number: {other:?}"),
                    }
                    tx.put(
                        "stock",
                        &Stock {
                            sku: "A-1".into(),
                            qty: 3,
                        },
                    )?;
                    assert!(matches!(
                        tx.get::<Vec<String>>("stock"),
                        Err(Error::Codec(_))
                    ));
                    assert_eq!(
                        tx.get::<Stock>("stock")?,
                        Some(Stock {
                            sku: "A-1".into(),
                            qty: 3
                        })
                    );
                    Ok(())
                })
                .unwrap();
            prop_assert!(matches!(outcome, Outcome::Processed), "{outcome:?}");
            Ok(())
        })
        .unwrap();
    // A handler that passes the codec error on is a handler failure (rolled back), never a storage error.
    let mut inbox = inbox.into_inner();
    let d = Delivery::new("state", "strict", "t", b"x");
    let outcome = inbox
        .process(&d, |tx: &mut Tx<'_>, _: &Delivery<'_>| {
            tx.get::<i64>("text")?;
            Ok(())
        })
        .unwrap();
    match outcome {
        Outcome::HandlerFailed(e) => {
            assert!(matches!(e.downcast_ref::<Error>(), Some(Error::Codec(_))))
        }
        other => panic!("{other:?}"),
    }
}
