//! Ids carried in the topic's property bag (Azure IoT Hub cloud-to-device topics): found, and every
//! hostile bag refused with a reason, never a panic; through the consumer core, refused ones are
//! quarantined with that reason.

use edge_inbox::{ExtractIdentity, Identity, Inbound, InvalidDelivery, PropertyBag};
use proptest::prelude::*;

const C2D: &str = "devices/gw-7/messages/devicebound/";

fn extract(bag: &PropertyBag, topic: &str) -> Result<Identity, InvalidDelivery> {
    bag.extract(&Inbound::new(topic, b"{}".to_vec()))
}

fn id(topic: &str) -> Result<String, InvalidDelivery> {
    extract(&PropertyBag::default(), topic).map(|i| i.message_id)
}

fn malformed(topic: &str) -> String {
    match id(topic) {
        Err(InvalidDelivery::MalformedProperty { name, why }) => {
            assert_eq!(name, "$.mid");
            why
        }
        other => panic!("{topic:?}: expected a malformed property, got {other:?}"),
    }
}

#[test]
fn azure_cloud_to_device_topics_give_their_message_id() {
    let full = format!(
        "{C2D}%24.mid=7d3f-41a2&%24.to=%2Fdevices%2Fgw-7%2Fmessages%2Fdevicebound&%24.ct=application%2Fjson&%24.ce=utf-8&order=42"
    );
    assert_eq!(id(&full).unwrap(), "7d3f-41a2");
    // Undecoded names too, and an id that needs decoding.
    assert_eq!(id(&format!("{C2D}$.mid=a%2Fb%20c")).unwrap(), "a/b c");
    assert_eq!(id(&format!("{C2D}$.to=x&%24%2Emid=m-1")).unwrap(), "m-1");
    // `+` is not a space in this encoding.
    assert_eq!(id(&format!("{C2D}$.mid=a+b")).unwrap(), "a+b");
    // A settable property, and a producer.
    let custom = PropertyBag::new("event-id").with_producer(Some("$.cdid".into()));
    let got = extract(&custom, &format!("{C2D}event-id=e-9&%24.cdid=plant-2")).unwrap();
    assert_eq!(got, Identity::new("e-9").with_producer("plant-2"));
    // The bag is only what follows the last `/`: a `$.mid=` earlier in the topic is not it.
    assert_eq!(
        id("devices/$.mid=spoof/messages/devicebound/x=1"),
        Err(InvalidDelivery::MissingId)
    );
}

#[test]
fn hostile_bags_are_refused_with_a_reason() {
    for topic in [
        C2D.to_owned(),
        format!("{C2D}&&&"),
        format!("{C2D}%24.to=x"),
        "no-slash-at-all".to_owned(),
        String::new(),
    ] {
        assert_eq!(id(&topic), Err(InvalidDelivery::MissingId), "{topic:?}");
    }
    assert!(malformed(&format!("{C2D}$.mid=a&$.mid=b")).contains("more than once"));
    assert!(malformed(&format!("{C2D}$.mid=a&%24.mid=a")).contains("more than once"));
    assert!(malformed(&format!("{C2D}$.mid=")).contains("empty"));
    assert!(malformed(&format!("{C2D}$.mid")).contains("empty"));
    for bad in ["%", "%2", "%zz", "ab%4", "%%41"] {
        assert!(
            malformed(&format!("{C2D}$.mid={bad}")).contains("bad % escape"),
            "{bad}"
        );
    }
    assert!(malformed(&format!("{C2D}$.mid=%ff%fe")).contains("not UTF-8"));
    // A key that does not decode might be the id's: refused, not skipped.
    assert!(malformed(&format!("{C2D}%2=x&$.mid=m")).contains("a key"));
}

#[cfg(feature = "mqtt")]
#[test]
fn through_the_core_refused_and_over_long_ids_are_quarantined_with_the_reason() {
    use edge_inbox::{AckGate, Config, ConsumerCore, Delivery, Inbox, Tx};
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let gate = AckGate::new();
    let mut core = ConsumerCore::new(Inbox::open(&db, Config::default()).unwrap(), "c2d")
        .extractor(PropertyBag::default())
        .gate(gate.clone());
    let c = gate.connected();
    core.connected(c, false);
    let long = "x".repeat(300);
    let topics = [
        format!("{C2D}%24.mid=ok-1"),
        format!("{C2D}%24.mid=a&%24.mid=b"),
        format!("{C2D}%24.mid=%G0"),
        C2D.to_owned(),
        format!("{C2D}%24.mid={long}"),
        format!("{C2D}%24.mid=ok-1"),
    ];
    for (i, t) in topics.iter().enumerate() {
        core.push(
            c,
            Inbound::new(t.clone(), b"{}".to_vec()),
            Some(i as u16 + 1),
        );
    }
    let mut handled = 0;
    let mut handler = |_: &mut Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> {
        handled += 1;
        Ok(())
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while core.unsettled() > 0 {
        assert!(std::time::Instant::now() < deadline, "not settled");
        core.settle(&mut handler).unwrap();
    }
    let s = core.summary();
    assert_eq!(
        (s.processed, s.duplicates, s.quarantined),
        (1, 1, 4),
        "{s:?}"
    );
    assert_eq!(handled, 1);
    let conn = rusqlite::Connection::open(&db).unwrap();
    let reasons: Vec<String> = conn
        .prepare("SELECT reason FROM quarantine ORDER BY id")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(reasons.len(), 4, "{reasons:?}");
    assert!(reasons[0].contains("more than once"), "{reasons:?}");
    assert!(reasons[1].contains("bad % escape"), "{reasons:?}");
    assert!(
        reasons[2].contains("no application message id"),
        "{reasons:?}"
    );
    assert!(
        reasons[3].contains("300 bytes, over the limit"),
        "{reasons:?}"
    );
    // Every delivery is acked, in arrival order.
    let acks: Vec<u16> = std::iter::from_fn(|| core.pop_ack())
        .map(|a| a.packet_id)
        .collect();
    assert_eq!(acks, vec![1, 2, 3, 4, 5, 6]);
}

/// Percent-encodes every byte outside the unreserved set.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

proptest! {
    #[test]
    fn arbitrary_topics_never_panic(topic in any::<String>(), name in "[$.a-z%&=]{0,6}") {
        let _ = extract(&PropertyBag::default(), &topic);
        let _ = extract(&PropertyBag::new(name).with_producer(Some("p".into())), &topic);
    }

    #[test]
    fn bag_shaped_topics_never_panic(bag in "[%0-9a-fA-FzZ$.=&+/]{0,40}") {
        let _ = id(&format!("{C2D}{bag}"));
    }

    #[test]
    fn any_encoded_id_comes_back(mid in "\\PC{1,40}", other in "\\PC{0,20}") {
        let topic = format!("{C2D}%24.to={}&%24.mid={}&k={}", encode(&other), encode(&mid), encode(&other));
        prop_assert_eq!(id(&topic).unwrap(), mid);
    }
}
