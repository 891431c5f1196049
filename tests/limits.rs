//! Every input limit is enforced with a clear error before anything is written: through `process`,
//! `process_batch`, `receive` and `dead_letter`, and through the MQTT consumer (quarantined with the reason).

#[cfg(feature = "mqtt")]
mod broker;
#[cfg(feature = "mqtt")]
mod common;

use edge_inbox::{Config, Delivery, Error, Inbox, InvalidDelivery, Limits, Outcome, Tx};

const SCOPE: &str = "limits";

fn limits() -> Limits {
    Limits {
        max_scope_len: 16,
        max_id_len: 8,
        max_topic_len: 12,
        max_payload_len: 32,
    }
}

fn nothing_written(inbox: &Inbox) {
    let c = inbox.connection();
    for table in ["identities", "messages", "kv", "conflicts", "quarantine"] {
        let n: i64 = c
            .query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 0, "{table} must stay empty");
    }
    let counted: i64 = c
        .query_row(
            "SELECT coalesce(sum(processed + duplicates + conflicts + handler_failures + quarantined + dead_lettered), 0) \
             FROM scope_stats",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(counted, 0);
}

fn effect(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    tx.put(d.message_id, &1)?;
    Ok(())
}

#[test]
fn each_limit_is_enforced_on_every_write_path_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(
        dir.path().join("inbox.db"),
        Config::default().limits(limits()),
    )
    .unwrap();
    let long_scope = "s".repeat(17);
    let long_id = "i".repeat(9);
    let long_topic = "t".repeat(13);
    let big = vec![0u8; 33];
    let cases: Vec<(Delivery<'_>, &str, usize, usize)> = vec![
        (Delivery::new(&long_scope, "id", "t", b"x"), "scope", 17, 16),
        (
            Delivery::new(SCOPE, &long_id, "t", b"x"),
            "message id",
            9,
            8,
        ),
        (
            Delivery::new(SCOPE, "id", "t", b"x").with_producer(&long_id),
            "producer",
            9,
            8,
        ),
        (
            Delivery::new(SCOPE, "id", &long_topic, b"x"),
            "topic",
            13,
            12,
        ),
        (Delivery::new(SCOPE, "id", "t", &big), "payload", 33, 32),
    ];
    let mut ran = false;
    for (d, field, len, max) in &cases {
        let expect = |e: Error| match e {
            Error::InvalidDelivery(InvalidDelivery::TooLong {
                field: f,
                len: l,
                max: m,
            }) => {
                assert_eq!((f, l, m), (*field, *len, *max));
                let text = Error::InvalidDelivery(InvalidDelivery::TooLong {
                    field: f,
                    len: l,
                    max: m,
                })
                .to_string();
                assert!(
                    text.contains(field) && text.contains(&max.to_string()),
                    "{text}"
                );
            }
            other => panic!("{field}: expected TooLong, got {other:?}"),
        };
        expect(
            inbox
                .process(d, |_: &mut Tx<'_>, _: &Delivery<'_>| {
                    ran = true;
                    Ok(())
                })
                .unwrap_err(),
        );
        // One bad delivery fails the whole batch before the good one is written.
        let good = Delivery::new(SCOPE, "good", "t", b"x");
        expect(inbox.process_batch(&[good, *d], effect).unwrap_err());
        expect(inbox.receive(d).unwrap_err());
        let mut outcomes = Vec::new();
        expect(
            inbox
                .receive_batch_into(&[good, *d], &mut outcomes)
                .unwrap_err(),
        );
        assert!(outcomes.is_empty());
        expect(inbox.dead_letter(d, "refused").unwrap_err());
    }
    assert!(!ran, "the handler never ran");
    nothing_written(&inbox);

    // At the limit exactly is fine.
    let at = Delivery::new(SCOPE, "iiiiiiii", "tttttttttttt", &big[..32]).with_producer("pppppppp");
    assert!(matches!(
        inbox.process(&at, effect).unwrap(),
        Outcome::Processed
    ));
}

#[cfg(feature = "mqtt")]
#[test]
fn the_mqtt_path_quarantines_each_over_limit_delivery_with_its_reason_and_processes_the_rest() {
    use std::time::Duration;
    let broker = broker::Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let config = Config::default().limits(limits());
    let consumer = |idle: Duration| {
        let inbox = Inbox::open(&db, config.clone()).unwrap();
        let mqtt =
            edge_inbox::MqttConfig::new("127.0.0.1", broker.port, "limits-consumer").subscribe("#");
        edge_inbox::Consumer::new(inbox, SCOPE, mqtt)
            .batch(16, Duration::from_millis(5))
            .exit_when_idle(idle)
    };
    // Subscribe first, so the persistent session keeps what is published next.
    consumer(Duration::from_millis(300)).run(effect).unwrap();

    let mut long_producer = broker::Msg::new("o/1", Some("p-ok"), "x");
    long_producer.producer = Some("p".repeat(9));
    broker::publish_v5(
        broker.port,
        &[
            broker::Msg::new("o/1", Some("ok-1"), "x"),
            broker::Msg::new("o/1", Some(&"i".repeat(9)), "x"),
            long_producer,
            broker::Msg::new(&"t".repeat(13), Some("t-ok"), "x"),
            broker::Msg::new("o/1", Some("big"), vec![b'x'; 33]),
            broker::Msg::new("o/1", Some("ok-2"), "x"),
        ],
    );
    let mut c = consumer(Duration::from_millis(1500));
    let s = c.run(effect).unwrap();
    assert_eq!((s.processed, s.quarantined, s.acked), (2, 4, 6), "{s:?}");
    let inbox = c.into_inbox();
    let mut stmt = inbox
        .connection()
        .prepare("SELECT topic, reason FROM quarantine ORDER BY id")
        .unwrap();
    let reasons: Vec<(String, String)> = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let expected = [
        "message id is 9 bytes, over the limit of 8",
        "producer is 9 bytes, over the limit of 8",
        "topic is 13 bytes, over the limit of 12",
        "payload is 33 bytes, over the limit of 32",
    ];
    assert_eq!(reasons.len(), 4, "{reasons:?}");
    for ((_, reason), want) in reasons.iter().zip(expected) {
        assert!(reason.contains(want), "{reason} should say {want}");
    }
    let identities: i64 = inbox
        .connection()
        .query_row("SELECT count(*) FROM identities", [], |r| r.get(0))
        .unwrap();
    assert_eq!(
        identities, 2,
        "only the two valid deliveries left an identity"
    );
}

/// In a scope with sequence watermarks, a numbered delivery quarantined by the consumer for breaking a limit
/// claims its sequence: the next sequences extend the watermark instead of piling up as exceptions, and a
/// redelivery of the bad message is recognised, not quarantined twice.
#[cfg(feature = "mqtt")]
#[test]
fn an_over_limit_numbered_delivery_claims_its_sequence() {
    use edge_inbox::{Envelope, Protocol, RetentionPolicy};
    use std::time::Duration;
    let broker = broker::Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let config = Config::default().limits(limits());
    {
        let mut inbox = Inbox::open(&db, config.clone()).unwrap();
        inbox
            .set_retention(SCOPE, &RetentionPolicy::new().sequence_watermarks(1))
            .unwrap();
    }
    let consumer = |idle: Duration| {
        let inbox = Inbox::open(&db, config.clone()).unwrap();
        let mqtt = edge_inbox::MqttConfig::new("127.0.0.1", broker.port, "limits-seq")
            .protocol(Protocol::V311)
            .subscribe("#");
        edge_inbox::Consumer::new(inbox, SCOPE, mqtt).exit_when_idle(idle)
    };
    consumer(Duration::from_millis(300)).run(effect).unwrap();

    let env = |id: &str, seq: u64, body: Vec<u8>| {
        (
            "o/1".to_string(),
            Envelope::new(id, body).producer("shop-1").seq(seq).encode(),
        )
    };
    let bad = env("e-2", 2, vec![b'x'; 40]);
    broker::publish_v311(
        broker.port,
        &[
            env("e-1", 1, b"x".to_vec()),
            bad.clone(),
            env("e-3", 3, b"x".to_vec()),
            env("e-4", 4, b"x".to_vec()),
            bad,
        ],
    );
    let mut c = consumer(Duration::from_millis(1500));
    let s = c.run(effect).unwrap();
    assert_eq!(
        (s.processed, s.quarantined, s.duplicates, s.acked),
        (3, 1, 1, 5),
        "{s:?}"
    );
    let inbox = c.into_inbox();
    let count = |sql: &str| -> i64 { inbox.connection().query_row(sql, [], |r| r.get(0)).unwrap() };
    assert_eq!(
        count("SELECT high FROM watermarks WHERE producer = 'shop-1'"),
        4
    );
    assert_eq!(count("SELECT count(*) FROM watermark_exceptions"), 0);
    assert_eq!(count("SELECT count(*) FROM quarantine"), 1);
}

/// What a publisher sends is quoted in quarantine and conflict records only up to a bound, whatever its size:
/// a `sent-at` property of a megabyte, and, in a scope with sequence watermarks, a message id far over the
/// limit that arrives again on its sequence with other content. That second arrival is a conflict and is
/// counted as one, not as a duplicate.
#[cfg(feature = "mqtt")]
#[test]
fn records_quote_what_a_publisher_sent_only_up_to_a_bound() {
    use edge_inbox::{ConsumerCore, Envelope, Inbound, RetentionPolicy};

    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&db, Config::default()).unwrap();
    inbox
        .set_retention(SCOPE, &RetentionPolicy::new().sequence_watermarks(1))
        .unwrap();
    // Nobody polls this client: QoS0 deliveries need no ack.
    let options = rumqttc::v5::MqttOptions::new("never-polled", "127.0.0.1", 1);
    let (client, _eventloop) = rumqttc::v5::Client::new(options, 10);

    // A send time of a megabyte: the delivery is quarantined, its reason quotes a few characters.
    let (mut feed, commits) = ConsumerCore::new(inbox, SCOPE)
        .spawn(effect, client.clone(), 20)
        .unwrap();
    feed.connected(false).unwrap();
    let huge = "\u{1}".repeat(1 << 20);
    let inbound = Inbound::new("o/1", b"x".to_vec())
        .with_user_property("message-id", "e-1")
        .with_user_property("sent-at", huge);
    feed.publish(inbound, None).unwrap();
    drop(feed);
    let (core, summary) = commits.join();
    assert_eq!(summary.unwrap().quarantined, 1);

    // An envelope whose id is half a megabyte, twice on sequence 5 with two bodies; then another message
    // on the same sequence (a sequence conflict).
    let mut core = ConsumerCore::new(core.into_inbox(), SCOPE).extractor(Envelope::default());
    let events = core.events(16);
    let (mut feed, commits) = core.spawn(effect, client, 20).unwrap();
    feed.connected(false).unwrap();
    let long_id = "i".repeat(500_000);
    for (id, body) in [(&*long_id, b"a"), (&*long_id, b"b"), ("short", b"c")] {
        let payload = Envelope::new(id, body.to_vec())
            .producer("shop-1")
            .seq(5)
            .encode();
        feed.publish(Inbound::new("o/1", payload), None).unwrap();
    }
    drop(feed);
    let (core, summary) = commits.join();
    let summary = summary.unwrap();
    assert_eq!(
        (summary.quarantined, summary.conflicts, summary.duplicates),
        (2, 1, 0),
        "{summary:?}"
    );
    // One event per delivery, the sequence conflict's too; the ids in them are cut as the records are.
    let outcomes: Vec<_> = std::iter::from_fn(|| events.try_recv())
        .filter_map(|e| match e {
            edge_inbox::HealthEvent::Delivery {
                message_id,
                outcome,
                ..
            } => Some((message_id.map_or(0, |m| m.len()), outcome)),
            _ => None,
        })
        .collect();
    use edge_inbox::Settled;
    assert_eq!(
        outcomes,
        [
            (4096, Settled::Quarantined),
            (4096, Settled::Conflict),
            (5, Settled::Quarantined)
        ]
    );

    let inbox = core.into_inbox();
    let longest = |sql: &str| -> i64 {
        inbox
            .connection()
            .query_row(sql, [], |r| r.get::<_, Option<i64>>(0))
            .unwrap()
            .unwrap_or(0)
    };
    assert_eq!(longest("SELECT count(*) FROM quarantine"), 3);
    assert_eq!(longest("SELECT count(*) FROM conflicts"), 1);
    assert!(longest("SELECT max(length(CAST(reason AS BLOB))) FROM quarantine") <= 1024);
    assert!(longest("SELECT max(length(CAST(topic AS BLOB))) FROM quarantine") <= 4096);
    assert!(longest("SELECT max(length(CAST(message_id AS BLOB))) FROM conflicts") <= 4096);
    let file: u64 = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert!(
        file < 4 << 20,
        "{file} bytes on disk for three bad deliveries"
    );
}
