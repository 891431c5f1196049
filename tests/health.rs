//! A running consumer seen from outside, against a real broker (mosquitto or the embedded one): connection
//! and outcome events in order and matching the run's counts, live statistics read from another thread while
//! `run` runs, and the loss of a connection when the broker dies.
#![cfg(feature = "mqtt")]

mod broker;
mod common;

use std::path::Path;
use std::time::Duration;

use broker::{inventory_handler, publish_v5, Broker, Kind, Msg};
use edge_inbox::{
    BacklogThreshold, Config, Consumer, HealthEvent, HealthEvents, Inbox, MqttConfig, RunSummary,
    Settled, StatsHandle, StopHandle,
};

const SCOPE: &str = "inventory-reservation";

fn consumer(broker: &Broker, db: &Path, client_id: &str) -> Consumer {
    let _ = env_logger::builder().is_test(true).try_init();
    let inbox = Inbox::open(db, Config::default()).unwrap();
    let mqtt = MqttConfig::new("127.0.0.1", broker.port, client_id).subscribe("orders/#");
    Consumer::new(inbox, SCOPE, mqtt).handler_attempts(3)
}

/// Connects once so the broker holds a persistent, subscribed session for `client_id`.
fn prime(broker: &Broker, db: &Path, client_id: &str) {
    let s = common::until_connected(|| {
        consumer(broker, db, client_id)
            .exit_when_idle(Duration::from_millis(300))
            .run(inventory_handler)
    });
    assert!(s.connections >= 1, "never connected: {s:?}");
}

fn order(order: u32, sku: &str, qty: i64, kind: &str) -> String {
    format!(r#"{{"order":{order},"sku":"{sku}","qty":{qty},"kind":"{kind}"}}"#)
}

fn drain(events: &HealthEvents) -> Vec<HealthEvent> {
    std::iter::from_fn(|| events.try_recv()).collect()
}

/// The delivery events as (message id, outcome).
fn deliveries(events: &[HealthEvent]) -> Vec<(Option<String>, Settled)> {
    events
        .iter()
        .filter_map(|e| match e {
            HealthEvent::Delivery {
                message_id,
                outcome,
                scope,
                ..
            } => {
                assert_eq!(&**scope, SCOPE);
                Some((message_id.clone(), *outcome))
            }
            _ => None,
        })
        .collect()
}

/// What the delivery events add up to, counted as a [`RunSummary`] counts.
fn counted(events: &[HealthEvent]) -> [u64; 7] {
    let mut c = [0u64; 7];
    for (_, outcome) in deliveries(events) {
        match outcome {
            Settled::Processed => c[0] += 1,
            Settled::Duplicate => c[1] += 1,
            Settled::Conflict => c[2] += 1,
            Settled::Quarantined => c[3] += 1,
            Settled::DeadLettered => c[4] += 1,
            Settled::Stored => c[5] += 1,
            Settled::HandlerFailed { .. } => c[6] += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    c
}

fn summary_counts(s: &RunSummary) -> [u64; 7] {
    [
        s.processed,
        s.duplicates,
        s.conflicts,
        s.quarantined,
        s.dead_lettered,
        s.stored,
        s.failed_attempts,
    ]
}

#[test]
fn events_come_in_arrival_order_and_add_up_to_the_run_summary() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    prime(&broker, &db, "health-order");
    let msgs = vec![
        Msg::new("orders/1", Some("evt-1"), order(1, "A-1", 1, "created")),
        // A redelivery: recognised.
        Msg::new("orders/1", Some("evt-1"), order(1, "A-1", 1, "created")),
        Msg::new("orders/2", Some("evt-2"), order(2, "A-1", 2, "created")),
        // The same id with other content.
        Msg::new("orders/2", Some("evt-2"), order(2, "A-1", 7, "created")),
        // No id at all.
        Msg::new("orders/3", None, order(3, "A-1", 9, "created")),
        // The handler refuses it every time: three attempts, then a dead letter.
        Msg::new("orders/4", Some("evt-4"), order(4, "A-1", 1, "bogus")),
        Msg::new("orders/5", Some("evt-5"), order(5, "B-2", 1, "created")),
    ];
    publish_v5(broker.port, &msgs);

    let mut c = consumer(&broker, &db, "health-order").exit_when_idle(Duration::from_millis(1500));
    let events = c.events(1024);
    let s = c.run(inventory_handler).unwrap();
    let got = drain(&events);
    assert_eq!(events.dropped(), 0);

    let id = |s: &str| Some(s.to_owned());
    assert_eq!(
        deliveries(&got),
        vec![
            (id("evt-1"), Settled::Processed),
            (id("evt-1"), Settled::Duplicate),
            (id("evt-2"), Settled::Processed),
            (id("evt-2"), Settled::Conflict),
            (None, Settled::Quarantined),
            (id("evt-4"), Settled::HandlerFailed { attempt: 1 }),
            (id("evt-4"), Settled::HandlerFailed { attempt: 2 }),
            (id("evt-4"), Settled::HandlerFailed { attempt: 3 }),
            (id("evt-4"), Settled::DeadLettered),
            (id("evt-5"), Settled::Processed),
        ],
        "{got:#?}"
    );
    // The connection opens the stream and closes it; every delivery came on it.
    let first = match &got[0] {
        HealthEvent::Connected {
            connection,
            session_present,
        } => {
            assert!(session_present, "{got:#?}");
            *connection
        }
        other => panic!("first event {other:?}"),
    };
    match got.last().unwrap() {
        HealthEvent::ConnectionLost { connection, cause } => {
            assert_eq!(*connection, first);
            assert_eq!(cause.as_deref(), Some("the run ended"));
        }
        other => panic!("last event {other:?}"),
    }
    for e in &got {
        if let HealthEvent::Delivery { connection, .. } = e {
            assert_eq!(*connection, first);
        }
    }
    assert_eq!(counted(&got), summary_counts(&s), "{s:?}");
    assert_eq!((s.handler_failures, s.failed_attempts), (1, 3), "{s:?}");
    // The live statistics end with the run's summary.
    let end = c.stats().snapshot();
    assert_eq!(end.summary, s);
    assert!(!end.running && end.connection.is_none(), "{end:?}");
}

#[test]
fn a_receive_only_run_reports_each_delivery_as_stored() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    prime(&broker, &db, "health-stored");
    let msgs: Vec<Msg> = (1..=4)
        .map(|i| {
            Msg::new(
                &format!("orders/{i}"),
                Some(&format!("evt-{i}")),
                order(i, "S-1", 1, "created"),
            )
        })
        .collect();
    publish_v5(broker.port, &msgs);
    let mut c = consumer(&broker, &db, "health-stored")
        .receive_only(BacklogThreshold::default())
        .exit_when_idle(Duration::from_millis(1500));
    let events = c.events(64);
    let s = c.run(inventory_handler).unwrap();
    let got = drain(&events);
    let want: Vec<_> = (1..=4)
        .map(|i| (Some(format!("evt-{i}")), Settled::Stored))
        .collect();
    assert_eq!(deliveries(&got), want, "{got:#?}");
    assert_eq!(counted(&got), summary_counts(&s), "{s:?}");
}

/// Stops the consumer when dropped: a failed assertion must end the test, not leave `run` running in the
/// thread scope that waits for it.
struct StopOnDrop(StopHandle);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// The next event, waiting at most a minute for it.
fn next_event(events: &HealthEvents) -> HealthEvent {
    events
        .recv_timeout(Duration::from_secs(60))
        .expect("an event in time")
}

/// Waits, bounded, for the statistics to satisfy `f`.
fn wait_stats(stats: &StatsHandle, what: &str, f: impl Fn(&edge_inbox::ConsumerStats) -> bool) {
    let found = common::wait_for(Duration::from_secs(60), || {
        let s = stats.snapshot();
        f(&s).then_some(())
    });
    assert!(found.is_some(), "{what}: {:?}", stats.snapshot());
}

#[test]
fn statistics_read_from_another_thread_change_while_the_run_goes_on() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    prime(&broker, &db, "health-live");
    let mut c = consumer(&broker, &db, "health-live");
    let stats = c.stats();
    let stop = c.stop_handle();
    assert!(!stats.snapshot().running);
    std::thread::scope(|scope| {
        let run = scope.spawn(|| c.run(inventory_handler));
        let _stop_on_panic = StopOnDrop(stop.clone());
        wait_stats(&stats, "connected", |s| s.running && s.connection.is_some());
        let before = stats.snapshot();
        assert_eq!(before.summary.processed, 0, "{before:?}");
        let msgs: Vec<Msg> = (1..=5)
            .map(|i| {
                Msg::new(
                    &format!("orders/{i}"),
                    Some(&format!("live-{i}")),
                    order(i, "L-1", 1, "created"),
                )
            })
            .collect();
        publish_v5(broker.port, &msgs);
        wait_stats(&stats, "five processed", |s| {
            s.summary.processed == 5 && s.summary.acked == 5
        });
        // Still running, and its loop turns while idle.
        let mid = stats.snapshot();
        assert!(mid.running && !run.is_finished(), "{mid:?}");
        wait_stats(&stats, "the loop turns", |s| s.turns > mid.turns);
        stop.stop();
        let s = run.join().unwrap().unwrap();
        let end = stats.snapshot();
        assert_eq!(end.summary, s);
        assert!(!end.running, "{end:?}");
        assert_eq!((s.processed, s.received), (5, 5), "{s:?}");
    });
}

#[test]
fn the_subscription_is_reported_once_acknowledged_and_a_message_published_then_arrives() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let mut c = consumer(&broker, &db, "health-subscribed");
    let events = c.events(256);
    let stats = c.stats();
    let stop = c.stop_handle();
    assert!(!stats.snapshot().subscribed);
    std::thread::scope(|scope| {
        let run = scope.spawn(|| c.run(inventory_handler));
        let _stop_on_panic = StopOnDrop(stop.clone());
        let next = || next_event(&events);
        // A new client id on a new broker: no kept session holds a subscription before ours is made.
        let first = match next() {
            HealthEvent::Connected {
                connection,
                session_present,
            } => {
                assert!(!session_present);
                connection
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(next(), HealthEvent::Subscribed { connection: first });
        wait_stats(&stats, "subscribed", |s| {
            s.subscribed && s.connection == Some(first)
        });
        // Published once: from now on the broker has a subscription to route it to.
        publish_v5(
            broker.port,
            &[Msg::new(
                "orders/1",
                Some("subscribed-1"),
                order(1, "S-1", 1, "created"),
            )],
        );
        match next() {
            HealthEvent::Delivery {
                connection,
                message_id,
                outcome,
                ..
            } => {
                assert_eq!(connection, first);
                assert_eq!(message_id.as_deref(), Some("subscribed-1"));
                assert_eq!(outcome, Settled::Processed);
            }
            other => panic!("{other:?}"),
        }
        stop.stop();
        let s = run.join().unwrap().unwrap();
        assert_eq!(s.processed, 1, "{s:?}");
        let end = stats.snapshot();
        assert!(!end.subscribed && end.connection.is_none(), "{end:?}");
    });
}

#[test]
fn an_invalid_topic_filter_is_refused_before_connecting() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    // Nothing listens on this port: the error must come before any attempt to connect.
    let mqtt = MqttConfig::new("127.0.0.1", broker::free_port(), "health-bad-filter")
        .subscribe("orders/#")
        .subscribe("orders/#/late");
    // Bounded if the check regresses: the run would retry the refused port until idle, and fail otherwise.
    let mut c = Consumer::new(inbox, SCOPE, mqtt).exit_when_idle(Duration::from_secs(5));
    match c.run(inventory_handler) {
        Err(edge_inbox::Error::InvalidArgument(why)) => {
            assert!(why.contains("\"orders/#/late\""), "{why}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.stats().snapshot().summary.connections, 0);
}

/// Settings rumqttc would panic on, a host the lookup would fail on for ever, and settings that would give up
/// the persistent session without a word: each refused before connecting, naming what is wrong.
#[test]
fn bad_connection_settings_are_refused_before_connecting_not_panicked_on_or_retried() {
    let port = broker::free_port();
    let good = || MqttConfig::new("127.0.0.1", port, "health-settings").subscribe("orders/#");
    let cases: Vec<(MqttConfig, &str)> = vec![
        (good().keep_alive(Duration::ZERO), "keep-alive"),
        (good().keep_alive(Duration::from_secs(2)), "keep-alive"),
        (good().keep_alive(Duration::from_millis(5500)), "keep-alive"),
        (good().keep_alive(Duration::from_secs(70_000)), "keep-alive"),
        (
            good()
                .protocol(edge_inbox::Protocol::V311)
                .keep_alive(Duration::from_millis(500)),
            "keep-alive",
        ),
        (
            MqttConfig::new("127.0.0.1", port, "").subscribe("orders/#"),
            "empty client id",
        ),
        (
            MqttConfig::new("127.0.0.1", port, "")
                .protocol(edge_inbox::Protocol::V311)
                .subscribe("orders/#"),
            "empty client id",
        ),
        (MqttConfig::new("127.0.0.1", port, "gw\0x"), "client id"),
        (good().session_expiry(0), "session expiry 0"),
        (MqttConfig::new("mqtt://127.0.0.1", port, "h"), "no scheme"),
        (MqttConfig::new("127.0.0.1:1883", port, "h"), "IPv6"),
        (MqttConfig::new("::1", port, "h"), "brackets"),
        (MqttConfig::new("", port, "h"), "host"),
        (good().subscribe("orders/\0x"), "topic filter"),
        (good().subscribe("o".repeat(70_000)), "topic filter"),
    ];
    for (mqtt, expected) in cases {
        let shown = format!("{mqtt:?}");
        let dir = tempfile::tempdir().unwrap();
        let inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
        let mut c = Consumer::new(inbox, SCOPE, mqtt).exit_when_idle(Duration::from_secs(5));
        let run =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.run(inventory_handler)));
        match run {
            Ok(Err(edge_inbox::Error::InvalidArgument(why))) => {
                assert!(why.contains(expected), "{shown}: {why}")
            }
            Ok(other) => panic!("{shown}: {other:?}"),
            Err(_) => panic!("{shown}: panicked"),
        }
        assert_eq!(c.stats().snapshot().summary.connections, 0, "{shown}");
    }
}

#[test]
fn a_broker_that_dies_gives_a_lost_event_with_its_cause_then_a_new_connection() {
    let mut broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let mut c = consumer(&broker, &db, "health-lost");
    let events = c.events(256);
    let stats = c.stats();
    let stop = c.stop_handle();
    std::thread::scope(|scope| {
        let run = scope.spawn(|| c.run(inventory_handler));
        let _stop_on_panic = StopOnDrop(stop.clone());
        let next = || next_event(&events);
        let first = match next() {
            HealthEvent::Connected { connection, .. } => connection,
            other => panic!("{other:?}"),
        };
        assert_eq!(next(), HealthEvent::Subscribed { connection: first });
        match broker.kind {
            Kind::Mosquitto => {
                broker.kill();
                broker.start_again();
            }
            Kind::Embedded => broker.drop_connections(),
        }
        match next() {
            HealthEvent::ConnectionLost { connection, cause } => {
                assert_eq!(connection, first);
                let cause = cause.expect("a cause");
                assert!(!cause.is_empty());
                eprintln!("lost: {cause}");
            }
            other => panic!("{other:?}"),
        }
        let second = match next() {
            HealthEvent::Connected { connection, .. } => connection,
            other => panic!("{other:?}"),
        };
        assert_ne!(second, first);
        // Subscribed again on the new connection, whatever the broker kept of the session.
        assert_eq!(next(), HealthEvent::Subscribed { connection: second });
        wait_stats(&stats, "the second connection", |s| {
            s.connection == Some(second) && s.subscribed && s.last_lost_cause.is_some()
        });
        // Deliveries on the new connection are tagged with it. (Published again until one arrives: the
        // broker may have lost the session with its subscription, which the consumer makes again.)
        let mut tries = 0;
        let got = common::wait_for(Duration::from_secs(60), || {
            tries += 1;
            let id = format!("after-{tries}");
            publish_v5(
                broker.port,
                &[Msg::new(
                    "orders/9",
                    Some(&id),
                    order(9, "K-1", 1, "created"),
                )],
            );
            events.recv_timeout(Duration::from_secs(2))
        });
        match got.expect("a delivery on the new connection") {
            HealthEvent::Delivery {
                connection,
                message_id,
                outcome,
                ..
            } => {
                assert_eq!(connection, second);
                assert!(message_id.unwrap().starts_with("after-"));
                assert_eq!(outcome, Settled::Processed);
            }
            other => panic!("{other:?}"),
        }
        stop.stop();
        let s = run.join().unwrap().unwrap();
        assert!(s.connections >= 2, "{s:?}");
    });
}

#[test]
fn a_core_told_of_a_new_connection_first_ends_the_old_one_in_its_events() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let mut core = edge_inbox::ConsumerCore::new(inbox, SCOPE);
    let events = core.events(16);
    let gate = edge_inbox::AckGate::new();
    let first = gate.connected();
    core.connected(first, false);
    let second = gate.connected();
    core.connected(second, true);
    core.connection_lost_because(second, Some("socket closed".into()));
    // A loss told twice is one event.
    core.connection_lost(second);
    assert_eq!(
        drain(&events),
        vec![
            HealthEvent::Connected {
                connection: first,
                session_present: false
            },
            HealthEvent::ConnectionLost {
                connection: first,
                cause: Some("a new connection began".into())
            },
            HealthEvent::Connected {
                connection: second,
                session_present: true
            },
            HealthEvent::ConnectionLost {
                connection: second,
                cause: Some("socket closed".into())
            },
        ]
    );
    let s = core.stats().snapshot();
    assert_eq!(s.connection, None);
    assert_eq!(s.last_lost_cause.as_deref(), Some("socket closed"));
    assert_eq!(s.summary.connections, 2);
}

/// Two consumers given the same client id: the broker drops each one's connection as the other connects.
/// Each connection ends soon after its CONNACK, so the backoff must keep growing across them instead of
/// starting over at every CONNACK (which made ten connections a second, for ever).
#[test]
fn connections_the_broker_drops_soon_after_connack_back_off() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let mut a = consumer(&broker, &dir.path().join("a.db"), "health-twin");
    let mut b = consumer(&broker, &dir.path().join("b.db"), "health-twin");
    let (stop_a, stop_b) = (a.stop_handle(), b.stop_handle());
    let (stats_a, stats_b) = (a.stats(), b.stats());
    let watch = Duration::from_secs(8);
    std::thread::scope(|scope| {
        let _stop_a = StopOnDrop(stop_a.clone());
        let _stop_b = StopOnDrop(stop_b.clone());
        let run_a = scope.spawn(|| a.run(inventory_handler));
        let run_b = scope.spawn(|| b.run(inventory_handler));
        std::thread::sleep(watch);
        stop_a.stop();
        stop_b.stop();
        run_a.join().unwrap().unwrap();
        run_b.join().unwrap().unwrap();
    });
    let (na, nb) = (
        stats_a.snapshot().summary.connections,
        stats_b.snapshot().summary.connections,
    );
    // Doubling from 100 ms up to 5 s: about seven attempts each in 8 s; starting over at every CONNACK,
    // 40 or more each.
    assert!(
        na >= 2 && nb >= 2,
        "the twins did not take turns: {na} and {nb} connections"
    );
    assert!(na + nb <= 24, "{na} and {nb} connections in {watch:?}");
}

/// A QoS 2 delivery (an application's own connection subscribed at QoS 2, or a session kept with such a
/// subscription) ends the run with an error that says so, unanswered and uncommitted: a PUBACK for it would
/// break the protocol, and the broker would drop the connection and send it again, for ever.
#[test]
fn a_qos2_delivery_ends_the_run_with_an_error_instead_of_a_wrong_ack() {
    use rumqttc::v5::mqttbytes::v5::Publish;
    use rumqttc::v5::mqttbytes::QoS;

    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let sent = common::SentAcks::default();
    let (mut feed, commits) = edge_inbox::ConsumerCore::new(inbox, SCOPE)
        .spawn(inventory_handler, sent.clone(), 20)
        .unwrap();
    feed.connected(false).unwrap();
    let mut first = Publish::new(
        "orders/1",
        QoS::AtLeastOnce,
        order(1, "A-1", 1, "created"),
        None,
    );
    first.pkid = 1;
    first.properties = Some(rumqttc::v5::mqttbytes::v5::PublishProperties {
        user_properties: vec![("message-id".into(), "evt-1".into())],
        ..Default::default()
    });
    let mut second = first.clone();
    second.qos = QoS::ExactlyOnce;
    second.pkid = 2;
    second.properties = Some(rumqttc::v5::mqttbytes::v5::PublishProperties {
        user_properties: vec![("message-id".into(), "evt-2".into())],
        ..Default::default()
    });
    feed.publish_v5(first).unwrap();
    let _ = feed.publish_v5(second);
    drop(feed);
    let (mut core, result) = commits.join();
    match result {
        Err(edge_inbox::Error::InvalidArgument(why)) => assert!(why.contains("QoS 2"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert!(
        !sent.all().contains(&2),
        "the QoS 2 delivery was answered with a PUBACK"
    );
    let stats = core.inbox().scope_stats(SCOPE).unwrap();
    assert!(stats.processed <= 1, "{stats:?}");
}

/// A core given a new gate (as a commit loop does when it starts) drops the acks it still held of the old
/// gate's connection: the new gate numbers its connections from the first again, so they would pass its
/// check on the new connection, where the same packet ids name other messages.
#[test]
fn acks_held_from_an_old_gate_are_not_sent_through_a_new_one() {
    use edge_inbox::{AckGate, ConsumerCore, Inbound};

    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let old = AckGate::new();
    let mut core = ConsumerCore::new(inbox, SCOPE).gate(old.clone());
    let first = old.connected();
    core.connected(first, false);
    let payload = order(1, "A-1", 1, "created").into_bytes();
    core.push(
        first,
        Inbound::new("orders/1", payload).with_user_property("message-id", "evt-1"),
        Some(7),
    );
    let mut handler = inventory_handler;
    while core.unsettled() > 0 {
        core.settle(&mut handler).unwrap();
    }
    let new = AckGate::new();
    let mut core = core.gate(new.clone());
    assert_eq!(
        new.connected(),
        first,
        "the new gate's first connection has the same id"
    );
    assert_eq!(
        core.pop_ack(),
        None,
        "an ack of the old gate's connection is still held"
    );
}

/// A filter removed from the configuration: the broker's kept session still held its subscription. The
/// consumer unsubscribes it when it connects, so nothing more comes through it, and what the session had
/// already queued for it is quarantined, never handed to the handler.
#[test]
fn a_filter_removed_from_the_configuration_delivers_nothing_to_the_handler() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let client_id = "health-refilter";
    let with = |filter: &str| {
        let inbox = Inbox::open(&db, Config::default()).unwrap();
        let mqtt = MqttConfig::new("127.0.0.1", broker.port, client_id).subscribe(filter);
        Consumer::new(inbox, SCOPE, mqtt)
    };
    // The session, subscribed to the old filter; then a message queued for it while nobody is connected.
    common::until_connected(|| {
        with("old/#")
            .exit_when_idle(Duration::from_millis(300))
            .run(inventory_handler)
    });
    broker.publish_v5("old/1", Some("o-1"), &order(1, "A-1", 1, "created"));

    let mut c = with("new/#");
    let stats = c.stats();
    let stop = c.stop_handle();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let handler = {
        let seen = seen.clone();
        move |tx: &mut edge_inbox::Tx<'_>, d: &edge_inbox::Delivery<'_>| {
            seen.lock().unwrap().push(d.topic.to_owned());
            inventory_handler(tx, d)
        }
    };
    let summary = std::thread::scope(|scope| {
        let _stop_on_panic = StopOnDrop(stop.clone());
        let run = scope.spawn(|| c.run(handler));
        let subscribed = common::wait_for(Duration::from_secs(30), || {
            stats.snapshot().subscribed.then_some(())
        });
        assert!(subscribed.is_some(), "never subscribed");
        // In this order from one publisher: once new/1 is handled, old/2 would have come before it.
        broker.publish_v5("old/2", Some("o-2"), &order(2, "A-1", 1, "created"));
        broker.publish_v5("new/1", Some("n-1"), &order(3, "A-1", 1, "created"));
        let handled = common::wait_for(Duration::from_secs(30), || {
            (stats.snapshot().summary.processed >= 1).then_some(())
        });
        assert!(handled.is_some(), "new/1 was not handled");
        stop.stop();
        run.join().unwrap().unwrap()
    });
    assert_eq!(*seen.lock().unwrap(), ["new/1"], "{summary:?}");
    let conn = rusqlite::Connection::open(&db).unwrap();
    let quarantined: Vec<(String, String)> = conn
        .prepare("SELECT topic, reason FROM quarantine ORDER BY id")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(quarantined[0].0, "old/1", "queued before: {quarantined:?}");
    for (_, reason) in &quarantined {
        assert!(
            reason.contains("none of the consumer's topic filters"),
            "{reason}"
        );
    }
    // mosquitto honours the UNSUBSCRIBE: old/2 never came. (The embedded broker keeps the subscription; the
    // delivery is quarantined all the same.)
    if broker.kind == Kind::Mosquitto {
        assert_eq!(quarantined.len(), 1, "{quarantined:?}");
    }
    assert_eq!(summary.quarantined, quarantined.len() as u64, "{summary:?}");
}

/// A session kept with a QoS 2 subscription (made by an earlier program under the same client id) holds a
/// QoS 2 message: it still comes at QoS 2 after the consumer subscribes the filter at QoS 1. The consumer
/// handles it once and leaves it unanswered, and goes on with the rest, instead of ending every run.
#[test]
fn a_qos2_message_a_kept_session_queued_is_handled_once_and_the_run_goes_on() {
    use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::{Client, Event, MqttOptions};

    if broker::selected() != Kind::Mosquitto {
        println!("skipped: needs mosquitto (QoS 2 sessions)");
        return;
    }
    let broker = Broker::start();
    let client_id = "health-qos2-kept";
    // Bounded wait for an event the test needs.
    let wait = |conn: &mut rumqttc::v5::Connection, what: &str, pred: &dyn Fn(&Event) -> bool| {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            assert!(std::time::Instant::now() < deadline, "no {what}");
            if let Ok(Ok(e)) = conn.recv_timeout(Duration::from_millis(200)) {
                if pred(&e) {
                    return;
                }
            }
        }
    };
    {
        let mut o = MqttOptions::new(client_id, "127.0.0.1", broker.port);
        o.set_clean_start(false)
            .set_session_expiry_interval(Some(3600))
            .set_keep_alive(Duration::from_secs(30));
        let (client, mut conn) = Client::new(o, 10);
        wait(&mut conn, "CONNACK", &|e| {
            matches!(e, Event::Incoming(Packet::ConnAck(_)))
        });
        client.try_subscribe("orders/#", QoS::ExactlyOnce).unwrap();
        wait(&mut conn, "SUBACK", &|e| {
            matches!(e, Event::Incoming(Packet::SubAck(_)))
        });
        client.try_disconnect().unwrap();
        let _ = conn.recv_timeout(Duration::from_millis(500));
    }
    {
        let mut o = MqttOptions::new("health-qos2-pub", "127.0.0.1", broker.port);
        o.set_keep_alive(Duration::from_secs(30));
        let (client, mut conn) = Client::new(o, 10);
        let props = PublishProperties {
            user_properties: vec![("message-id".into(), "q2-1".into())],
            ..Default::default()
        };
        client
            .publish_with_properties(
                "orders/1",
                QoS::ExactlyOnce,
                false,
                order(1, "A-1", 1, "created"),
                props,
            )
            .unwrap();
        wait(&mut conn, "PUBCOMP", &|e| {
            matches!(e, Event::Incoming(Packet::PubComp(_)))
        });
    }
    let dir = tempfile::tempdir().unwrap();
    let mut c = consumer(&broker, &dir.path().join("inbox.db"), client_id);
    let stats = c.stats();
    let stop = c.stop_handle();
    let summary = std::thread::scope(|scope| {
        let _stop_on_panic = StopOnDrop(stop.clone());
        let run = scope.spawn(|| c.run(inventory_handler));
        let subscribed = common::wait_for(Duration::from_secs(30), || {
            stats.snapshot().subscribed.then_some(())
        });
        assert!(subscribed.is_some(), "never subscribed");
        broker.publish_v5("orders/2", Some("q1-2"), &order(2, "A-1", 1, "created"));
        let handled = common::wait_for(Duration::from_secs(30), || {
            (stats.snapshot().summary.processed >= 2).then_some(())
        });
        assert!(handled.is_some(), "{:?}", stats.snapshot().summary);
        stop.stop();
        run.join().unwrap()
    });
    let summary = summary.unwrap();
    assert_eq!(
        (summary.processed, summary.connections),
        (2, 1),
        "{summary:?}"
    );
}
