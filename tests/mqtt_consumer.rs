//! The MQTT consumer against a real broker on 127.0.0.1 (mosquitto or the embedded one: see `broker`).
#![cfg(feature = "mqtt")]

mod broker;
mod common;

use std::time::Duration;

use broker::consumer::{consumer, drain, order, prime, SCOPE};
use broker::{inventory_handler, publish_v311, publish_v5, reserved, Broker, Msg};
use edge_inbox::{Config, Consumer, Envelope, Inbox, Limits, MqttConfig, Protocol};

#[test]
fn rumqttc_v5_publisher_with_producer_namespaces() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    prime(&broker, &db, "inv-rq", Protocol::V5);
    let mut msgs = Vec::new();
    for i in 0..50u32 {
        // The same id from two producers is two different events.
        for p in ["shop-1", "shop-2"] {
            let mut m = Msg::new(
                &format!("orders/{i}"),
                Some(&format!("evt-{i}")),
                order(i, "B-2", 1, "created"),
            );
            m.producer = Some(p.into());
            msgs.push(m);
        }
    }
    // Every event once more (a relay republishing).
    let repeats = msgs.clone();
    publish_v5(broker.port, &msgs);
    publish_v5(broker.port, &repeats);
    let s = drain(&broker, &db, "inv-rq", Protocol::V5);
    assert_eq!(
        (s.processed, s.duplicates, s.acked),
        (100, 100, 200),
        "{s:?}"
    );
    assert_eq!(reserved(&db, SCOPE, "B-2"), 100);
}

#[test]
fn mqtt_311_consumer_takes_identities_from_cbor_envelopes() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    prime(&broker, &db, "inv-311", Protocol::V311);
    let env = |id: &str, body: String| {
        Envelope::new(id, body.into_bytes())
            .producer("shop-1")
            .seq(1)
            .encode()
    };
    let msgs = vec![
        (
            "orders/1".to_string(),
            env("e-1", order(1, "C-3", 4, "created")),
        ),
        (
            "orders/1".to_string(),
            env("e-1", order(1, "C-3", 4, "created")),
        ),
        (
            "orders/1".to_string(),
            env("e-1", order(1, "C-3", 5, "created")),
        ),
        ("orders/2".to_string(), b"not cbor at all".to_vec()),
        (
            "orders/3".to_string(),
            env("e-3", order(3, "C-3", 1, "created")),
        ),
    ];
    publish_v311(broker.port, &msgs);
    let s = drain(&broker, &db, "inv-311", Protocol::V311);
    assert_eq!(
        (
            s.processed,
            s.duplicates,
            s.conflicts,
            s.quarantined,
            s.acked
        ),
        (2, 1, 1, 1, 5),
        "{s:?}"
    );
    assert_eq!(reserved(&db, SCOPE, "C-3"), 5);
    let reason: String = Inbox::open(&db, Config::default())
        .unwrap()
        .connection()
        .query_row("SELECT reason FROM quarantine", [], |r| r.get(0))
        .unwrap();
    assert!(reason.contains("malformed envelope"), "{reason}");
}

#[test]
fn bad_json_is_dead_lettered_after_retries_and_oversized_payloads_are_quarantined() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let limits = Limits {
        max_payload_len: 1024,
        ..Limits::default()
    };
    prime(&broker, &db, "inv-bad", Protocol::V5);
    broker.publish_v5("orders/1", Some("evt-1"), &order(1, "D-4", 1, "created"));
    broker.publish_v5("orders/2", Some("evt-2"), "{not json");
    // Also over rumqttc's default packet limit (10 KiB): it must reach the inbox to be quarantined.
    broker.publish_v5("orders/3", Some("evt-3"), &"x".repeat(40_000));
    broker.publish_v5("orders/4", Some("evt-4"), &order(4, "D-4", 1, "created"));

    let mut c = consumer(
        &broker,
        &db,
        "inv-bad",
        Protocol::V5,
        Config::default().limits(limits),
    )
    .handler_attempts(3);
    let s = c.run(inventory_handler).unwrap();
    assert_eq!(
        (
            s.processed,
            s.handler_failures,
            s.failed_attempts,
            s.dead_lettered,
            s.quarantined,
            s.acked
        ),
        (2, 1, 3, 1, 1, 4),
        "one delivery failed, in three attempts: {s:?}"
    );
    assert_eq!(
        s.handler_failures + s.processed + s.quarantined,
        4,
        "the summary counts deliveries, each once: {s:?}"
    );
    assert_eq!(reserved(&db, SCOPE, "D-4"), 2);
    let inbox = c.into_inbox();
    let st = inbox.scope_stats(SCOPE).unwrap();
    assert_eq!(
        (st.dead_lettered, st.quarantined, st.handler_failures),
        (1, 1, 3)
    );
    let (state, attempts, err, payload): (i64, i64, String, Vec<u8>) = inbox
        .connection()
        .query_row(
            "SELECT state, attempts, last_error, payload FROM messages WHERE message_id = 'evt-2'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap();
    assert_eq!(
        (state, attempts, payload.as_slice()),
        (3, 3, &b"{not json"[..])
    );
    assert!(err.contains("handler failed 3 time(s)"), "{err}");
    let (reason, len, kept): (String, i64, i64) = inbox
        .connection()
        .query_row(
            "SELECT reason, payload_len, length(payload) FROM quarantine",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert!(reason.contains("payload is 40000 bytes"), "{reason}");
    // A bounded record for the operator: its length and a prefix, not the whole payload (issue 21, item 6).
    assert_eq!(
        (len, kept),
        (40_000, edge_inbox::QUARANTINE_PREFIX as i64),
        "the oversized payload's record"
    );

    // A redelivery of the dead-lettered message is a duplicate: the handler does not run again.
    drop(inbox);
    broker.publish_v5("orders/2", Some("evt-2"), "{not json");
    let s = drain(&broker, &db, "inv-bad", Protocol::V5);
    assert_eq!(
        (s.duplicates, s.handler_failures, s.acked),
        (1, 0, 1),
        "{s:?}"
    );
}

#[test]
fn a_batch_committed_after_its_connection_died_is_not_acked_and_its_redelivery_is_a_duplicate() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Arc};
    let mut broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    prime(&broker, &db, "inv-stale", Protocol::V5);
    let n = 10u32;
    let msgs: Vec<Msg> = (0..n)
        .map(|i| {
            Msg::new(
                &format!("orders/{i}"),
                Some(&format!("evt-{i}")),
                order(i, "H-8", 1, "created"),
            )
        })
        .collect();
    publish_v5(broker.port, &msgs);

    // The handler holds the first batch open until its connection has died under it.
    let (entered_tx, entered_rx) = mpsc::channel();
    let release = Arc::new(AtomicBool::new(false));
    let gate = release.clone();
    let mut first = true;
    let handler = move |tx: &mut edge_inbox::Tx<'_>, d: &edge_inbox::Delivery<'_>| {
        if first {
            first = false;
            let _ = entered_tx.send(());
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while !gate.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        inventory_handler(tx, d)
    };
    let mut c = consumer(&broker, &db, "inv-stale", Protocol::V5, Config::default())
        .exit_when_idle(Duration::from_secs(3));
    let worker = std::thread::spawn(move || c.run(handler).unwrap());
    entered_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the handler never ran");
    broker.drop_connections();
    release.store(true, Ordering::SeqCst);
    let s = worker.join().unwrap();

    assert!(s.connections >= 2, "{s:?}");
    assert!(
        s.dropped_stale >= 1,
        "the batch of the dead connection was not acked: {s:?}"
    );
    assert_eq!(s.processed, u64::from(n), "{s:?}");
    assert!(
        s.duplicates >= 1,
        "the broker redelivered what was committed but not acked: {s:?}"
    );
    assert_eq!(reserved(&db, SCOPE, "H-8"), i64::from(n));
    assert_eq!(drain(&broker, &db, "inv-stale", Protocol::V5).received, 0);
}

#[test]
fn receive_only_stores_pending_acks_and_workers_apply_each_once() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    prime(&broker, &db, "inv-defer", Protocol::V5);
    broker.publish_v5("orders/1", Some("evt-1"), &order(1, "R-1", 2, "created"));
    broker.publish_v5("orders/2", Some("evt-2"), &order(2, "R-1", 1, "created"));
    broker.publish_v5("orders/1", Some("evt-1"), &order(1, "R-1", 2, "created"));
    broker.publish_v5("orders/3", Some("evt-3"), &order(3, "R-1", 4, "created"));

    let never = |_: &mut edge_inbox::Tx<'_>, _: &edge_inbox::Delivery<'_>| -> anyhow::Result<()> {
        panic!("the handler is not called in receive-only mode")
    };
    let mut c = consumer(&broker, &db, "inv-defer", Protocol::V5, Config::default())
        .receive_only(edge_inbox::BacklogThreshold::default());
    let s = c.run(never).unwrap();
    assert_eq!(
        (s.stored, s.duplicates, s.processed, s.acked),
        (3, 1, 0, 4),
        "{s:?}"
    );
    let inbox = c.into_inbox();
    let b = inbox.backlog(SCOPE).unwrap();
    assert_eq!(
        b.pending, 3,
        "acked, and a durable obligation remains: {b:?}"
    );
    assert_eq!(reserved(&db, SCOPE, "R-1"), 0, "nothing applied yet");
    // Everything was acked: the broker redelivers nothing.
    let again = drain(&broker, &db, "inv-defer", Protocol::V5);
    assert_eq!(again.received, 0, "{again:?}");

    // A worker applies each stored message once.
    let mut worker =
        edge_inbox::Worker::new(inbox, SCOPE, edge_inbox::WorkerConfig::default()).unwrap();
    let mut handler = inventory_handler;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while worker.inbox().backlog(SCOPE).unwrap().pending > 0 {
        assert!(std::time::Instant::now() < deadline, "worker did not drain");
        worker.run_once(&mut handler).unwrap();
    }
    assert_eq!(reserved(&db, SCOPE, "R-1"), 7);
}

/// Adaptive group commit: a delivery reaching an idle consumer is committed at once, alone (no linger), and
/// what arrives while that commit is still in flight is gathered by the poll thread and committed as the
/// next batch, acked in arrival order after it.
#[test]
fn deliveries_arriving_during_a_commit_form_the_next_batch() {
    use std::sync::mpsc;
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    prime(&broker, &db, "inv-pipe", Protocol::V5);
    let (started_tx, started_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let consumer = {
        let db = db.clone();
        let port = broker.port;
        std::thread::spawn(move || {
            let inbox = Inbox::open(&db, Config::default()).unwrap();
            // The default batch settings: no linger.
            let mqtt = MqttConfig::new("127.0.0.1", port, "inv-pipe").subscribe("orders/#");
            let mut c =
                Consumer::new(inbox, SCOPE, mqtt).exit_when_idle(Duration::from_millis(1500));
            let mut order_seen = Vec::new();
            let s = c
                .run(
                    |tx: &mut edge_inbox::Tx<'_>, d: &edge_inbox::Delivery<'_>| {
                        order_seen.push(d.message_id.to_string());
                        if d.message_id == "gate" {
                            // The commit of this batch is in flight until the test lets it go.
                            started_tx.send(()).unwrap();
                            go_rx.recv_timeout(Duration::from_secs(30)).unwrap();
                        }
                        inventory_handler(tx, d)
                    },
                )
                .unwrap();
            (s, order_seen)
        })
    };
    publish_v5(
        broker.port,
        &[Msg::new(
            "orders/0",
            Some("gate"),
            order(0, "P-1", 1, "created"),
        )],
    );
    // Nothing else is published before the handler runs: a consumer waiting on a timer for the batch to
    // fill would still be waiting here.
    started_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("a lone delivery was not handled at once");
    // The broker's window is 20: 19 more fit in flight beside the blocked one.
    let more: Vec<Msg> = (1..20u32)
        .map(|i| {
            Msg::new(
                &format!("orders/{i}"),
                Some(&format!("evt-{i}")),
                order(i, "P-1", 1, "created"),
            )
        })
        .collect();
    publish_v5(broker.port, &more);
    // Loopback forwarding of 19 small publishes takes milliseconds; a second is slack for a loaded machine.
    std::thread::sleep(Duration::from_secs(1));
    go_tx.send(()).unwrap();
    let (s, seen) = consumer.join().unwrap();
    assert_eq!((s.processed, s.acked), (20, 20), "{s:?}");
    assert_eq!(seen[0], "gate");
    let expected: Vec<String> = std::iter::once("gate".to_string())
        .chain((1..20).map(|i| format!("evt-{i}")))
        .collect();
    assert_eq!(seen, expected, "handled out of arrival order");
    // One commit for the lone delivery, then the 19 that queued up during it: one batch, or two if the
    // broker's forwarding straddled the moment the first commit returned. One delivery per commit would be 20.
    assert!((2..=3).contains(&s.batches), "{s:?}");
    assert_eq!(reserved(&db, SCOPE, "P-1"), 20);
}
