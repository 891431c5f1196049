//! The relay's edges against a real mosquitto: the `sent-at` stamp every message carries (the same on a
//! resend), and a row too large for the broker's Maximum Packet Size or retained where the broker takes no
//! retained messages, which is parked instead of holding back the outbox.

mod broker;
mod common;
mod outbox_support;
#[path = "../examples/support/wrap_vfs.rs"]
mod wrap_vfs;

use std::ffi::c_int;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};
use std::time::Duration;

use broker::{Broker, Needs};
use edge_inbox::rusqlite::ffi;
use edge_inbox::{
    Config, Delivery, Inbox, MqttConfig, OutboxProperties, Qos, Relay, RelayConfig, Synchronous, Tx,
};
use outbox_support::relay::commit_routed;
use outbox_support::Subscriber;

const SCOPE: &str = "relay-edges";

/// Commits one delivery per payload; each handler call publishes its payload.
fn commit(inbox: &mut Inbox, topic: &str, payloads: &[Vec<u8>]) {
    let ids: Vec<String> = (0..payloads.len()).map(|i| format!("evt-{i}")).collect();
    let deliveries: Vec<Delivery<'_>> = ids
        .iter()
        .zip(payloads)
        .map(|(id, p)| Delivery::new(SCOPE, id, "orders", p))
        .collect();
    inbox
        .process_batch(&deliveries, |tx: &mut Tx<'_>, d: &Delivery<'_>| {
            tx.publish(topic, d.payload, Qos::AtLeastOnce, &OutboxProperties::new())?;
            Ok(())
        })
        .unwrap();
}

/// Waits (at most 30 s) until the relay has parked one row and sent the other two, and the subscriber got
/// them; stops the relay. Its statistics and the payloads received, in order.
fn one_parked_two_sent(
    relay: Relay,
    inbox: &Inbox,
    sub: &Subscriber,
) -> (edge_inbox::RelayStats, Vec<Vec<u8>>) {
    let done = common::wait_for(Duration::from_secs(30), || {
        let b = inbox.outbox_backlog().unwrap();
        (b.parked == 1 && b.pending == 0 && b.sent == 2 && sub.count() >= 2).then_some(b)
    });
    let stats = relay.stop();
    assert!(done.is_some(), "{:?} {stats:?}", inbox.outbox_backlog());
    (stats, sub.got().into_iter().map(|g| g.payload).collect())
}

/// A new inbox file, and a subscriber to `filter` on `broker`: the file's directory (removed when dropped),
/// its path, the subscriber and the inbox.
fn files(
    broker: &Broker,
    subscriber: &str,
    filter: &str,
) -> (tempfile::TempDir, PathBuf, Subscriber, Inbox) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let sub = Subscriber::start(broker.port, subscriber, filter);
    let inbox = Inbox::open(&db, Config::default()).unwrap();
    (dir, db, sub, inbox)
}

fn relay(db: &Path, port: u16, client: &str) -> Relay {
    Relay::start_with(
        Inbox::open(db, Config::default()).unwrap(),
        MqttConfig::new("127.0.0.1", port, client),
        RelayConfig::default().max_backoff(Duration::from_millis(200)),
    )
    .unwrap()
}

fn sent_at(props: &[(String, String)]) -> Vec<&str> {
    props
        .iter()
        .filter(|(k, _)| k == "sent-at")
        .map(|(_, v)| v.as_str())
        .collect()
}

fn every_message_carries_its_commit_time_as_sent_at_also_when_resent() {
    let broker = Broker::start();
    let (_dir, db, sub, mut inbox) = files(&broker, "edges-sub-sent-at", "stock/sent-at/#");
    commit(
        &mut inbox,
        "stock/sent-at/x",
        &[b"a".to_vec(), b"b".to_vec(), b"c".to_vec()],
    );
    // Rows committed long ago: the stamp must be the row's, not the time of sending.
    inbox
        .connection()
        .execute("UPDATE outbox SET created_at = 1700000000 + seq", [])
        .unwrap();
    let expected = |payload: &[u8]| -> String {
        inbox
            .connection()
            .query_row(
                "SELECT created_at FROM outbox WHERE payload = ?1",
                [payload],
                |r| r.get::<_, i64>(0),
            )
            .unwrap()
            .to_string()
    };

    let first = relay(&db, broker.port, "edges-relay-1");
    let drained = common::wait_for(Duration::from_secs(30), || {
        let b = inbox.outbox_backlog().unwrap();
        (b.pending == 0 && sub.count() >= 3).then_some(())
    });
    first.stop();
    assert!(
        drained.is_some(),
        "{:?}, {} received",
        inbox.outbox_backlog(),
        sub.count()
    );

    // Sent again (as after a crash before the mark): the copies carry the same stamp.
    inbox
        .connection()
        .execute("UPDATE outbox SET state = 0, sent_at = NULL", [])
        .unwrap();
    let second = relay(&db, broker.port, "edges-relay-2");
    let resent = common::wait_for(Duration::from_secs(30), || {
        let b = inbox.outbox_backlog().unwrap();
        (b.pending == 0 && sub.count() >= 6).then_some(())
    });
    second.stop();
    assert!(
        resent.is_some(),
        "{:?}, {} received",
        inbox.outbox_backlog(),
        sub.count()
    );

    let got = sub.got();
    assert_eq!(got.len(), 6, "each message twice");
    for g in &got {
        let want = expected(&g.payload);
        assert_eq!(sent_at(&g.user_properties), [want.as_str()], "{g:?}");
    }
    // A handler cannot set the stamp itself.
    let err = inbox.process(
        &Delivery::new(SCOPE, "own-stamp", "orders", b"x"),
        |tx: &mut Tx<'_>, _: &Delivery<'_>| {
            tx.publish(
                "stock/x",
                b"x",
                Qos::AtLeastOnce,
                &OutboxProperties::new().user_property("sent-at", "1"),
            )?;
            Ok(())
        },
    );
    assert!(
        matches!(err, Ok(edge_inbox::Outcome::HandlerFailed(_))),
        "{err:?}"
    );
}

fn a_row_over_the_brokers_maximum_packet_size_is_parked_and_the_rest_go_on() {
    let broker = Broker::start_with_options("max_packet_size 2048");
    let (_dir, db, sub, mut inbox) = files(&broker, "edges-sub-big", "stock/big/#");
    let big = vec![b'x'; 4096];
    commit(
        &mut inbox,
        "stock/big/x",
        &[b"small-0".to_vec(), big, b"small-2".to_vec()],
    );

    let relay = relay(&db, broker.port, "edges-relay-big");
    let (stats, payloads) = one_parked_two_sent(relay, &inbox, &sub);
    assert_eq!(payloads, [b"small-0".to_vec(), b"small-2".to_vec()]);
    assert_eq!(
        stats.connection_failures, 0,
        "the big row never reached the wire: {stats:?}"
    );
    // Kept for an operator.
    assert_eq!(inbox.requeue_parked_outbox().unwrap(), 1);
}

fn a_parked_row_requeued_while_the_relay_is_connected_is_sent_on_that_connection() {
    let broker = Broker::start_with_options("max_packet_size 2048");
    let (_dir, db, sub, mut inbox) = files(&broker, "edges-sub-requeue", "stock/requeue/#");
    commit(
        &mut inbox,
        "stock/requeue/x",
        &[b"small-0".to_vec(), vec![b'x'; 4096], b"small-2".to_vec()],
    );
    let relay = relay(&db, broker.port, "edges-relay-requeue");
    let parked = common::wait_for(Duration::from_secs(30), || {
        let b = inbox.outbox_backlog().unwrap();
        (b.parked == 1 && b.pending == 0 && b.sent == 2 && sub.count() >= 2).then_some(())
    });
    assert!(
        parked.is_some(),
        "{:?} {:?}",
        inbox.outbox_backlog(),
        relay.stats()
    );

    // The operator fixes the cause (here: the body is made to fit) and requeues, while the relay stays
    // connected.
    inbox
        .connection()
        .execute(
            "UPDATE outbox SET payload = CAST('small-1' AS BLOB) WHERE state = 2",
            [],
        )
        .unwrap();
    assert_eq!(inbox.requeue_parked_outbox().unwrap(), 1);
    let sent = common::wait_for(Duration::from_secs(30), || {
        let b = inbox.outbox_backlog().unwrap();
        (b.pending == 0 && b.parked == 0 && b.sent == 3 && sub.count() >= 3).then_some(())
    });
    let stats = relay.stop();
    assert!(sent.is_some(), "{:?} {stats:?}", inbox.outbox_backlog());
    assert_eq!(stats.connections, 1, "sent without a reconnect: {stats:?}");
    let payloads: Vec<Vec<u8>> = sub.got().into_iter().map(|g| g.payload).collect();
    // A requeued row goes out after the rows sent while it was parked.
    assert_eq!(
        payloads,
        [
            b"small-0".to_vec(),
            b"small-2".to_vec(),
            b"small-1".to_vec()
        ]
    );
}

/// A retained row, where the broker's CONNACK says it takes no retained messages: mosquitto would close the
/// connection on it at every reconnection, holding back every row behind it. The relay parks it instead.
fn a_row_the_brokers_connack_rules_out_is_parked_and_the_rest_go_on() {
    let broker = Broker::start_with_options("retain_available false");
    let (_dir, db, sub, mut inbox) = files(&broker, "edges-sub-retain", "stock/retain/#");
    commit_routed(&mut inbox, SCOPE, &["evt-0", "evt-1", "evt-2"], |id| {
        let props = OutboxProperties::new().retain(id == "evt-1");
        ("stock/retain/x".to_owned(), props)
    });

    let relay = relay(&db, broker.port, "edges-relay-retain");
    let (stats, payloads) = one_parked_two_sent(relay, &inbox, &sub);
    assert_eq!(payloads, [b"evt-0".to_vec(), b"evt-2".to_vec()]);
    assert_eq!(
        stats.connection_failures, 0,
        "the retained row never reached the wire: {stats:?}"
    );
}

/// A proxy on 127.0.0.1 that hands each chunk the broker sends on only after `delay`: a link with a long
/// round trip (a cellular uplink, a TLS handshake far away). Client to broker goes straight through.
fn slow_link(upstream: u16, delay: Duration) -> u16 {
    common::proxy(upstream, move |_| {
        std::thread::sleep(delay);
        true
    })
}

/// A broker whose CONNACK takes 150 ms to arrive: the relay still connects and sends (its poll once gave up
/// every connection attempt after 100 ms and started a new one, for ever).
fn a_relay_connects_over_a_link_slower_than_its_poll_interval() {
    let broker = Broker::start();
    let (_dir, db, sub, mut inbox) = files(&broker, "edges-sub-slow", "stock/slow/#");
    commit(&mut inbox, "stock/slow/x", &[b"a".to_vec(), b"b".to_vec()]);
    let port = slow_link(broker.port, Duration::from_millis(150));
    let relay = relay(&db, port, "edges-relay-slow");
    let sent = common::wait_for(Duration::from_secs(30), || {
        let b = inbox.outbox_backlog().unwrap();
        (b.pending == 0 && b.sent == 2 && sub.count() >= 2).then_some(())
    });
    let stats = relay.stop();
    assert!(sent.is_some(), "{:?} {stats:?}", inbox.outbox_backlog());
    assert_eq!(stats.connections, 1, "{stats:?}");
    let payloads: Vec<Vec<u8>> = sub.got().into_iter().map(|g| g.payload).collect();
    assert_eq!(payloads, [b"a".to_vec(), b"b".to_vec()]);
}

const HELD_VFS: &str = "edge-inbox-relay-held-syncs";
/// While set, a sync of a WAL from a relay thread waits (a card that has not finished the sync yet).
static HOLD_RELAY_SYNCS: AtomicBool = AtomicBool::new(false);

struct HeldSyncs;

impl wrap_vfs::Observer for HeldSyncs {
    fn open(&self, name: Option<&str>, flags: c_int) -> Option<usize> {
        (name.is_some() && flags & ffi::SQLITE_OPEN_WAL != 0).then_some(0)
    }

    fn sync(&self, _tag: usize, real: &mut dyn FnMut() -> c_int) -> c_int {
        let relay = std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("outbox-relay-"));
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while relay
            && HOLD_RELAY_SYNCS.load(Ordering::SeqCst)
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        real()
    }
}

/// Rows committed without a sync of their own (a writer at `Synchronous::Normal`; commits overlapping their
/// syncs are the same on the disk) are published only once a sync covering them ended: a power cut before it
/// would take back the effect, and the message would be one the gateway never made.
fn rows_committed_without_a_sync_are_published_only_after_one() {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| wrap_vfs::register(HELD_VFS, Arc::new(HeldSyncs), false));
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let sub = Subscriber::start(broker.port, "edges-sub-durable", "stock/durable/#");
    let config = Config::default().vfs(HELD_VFS);
    let mut inbox = Inbox::open(&db, config.clone().synchronous(Synchronous::Normal)).unwrap();
    commit(
        &mut inbox,
        "stock/durable/x",
        &[b"a".to_vec(), b"b".to_vec()],
    );

    HOLD_RELAY_SYNCS.store(true, Ordering::SeqCst);
    let relay = Relay::start_with(
        Inbox::open(&db, config).unwrap(),
        MqttConfig::new("127.0.0.1", broker.port, "edges-relay-durable"),
        RelayConfig::default().max_backoff(Duration::from_millis(200)),
    )
    .unwrap();
    let connected = common::wait_for(Duration::from_secs(30), || {
        (relay.stats().connections == 1).then_some(())
    });
    std::thread::sleep(Duration::from_millis(1500));
    let early = (sub.count(), relay.stats());
    HOLD_RELAY_SYNCS.store(false, Ordering::SeqCst);
    assert!(connected.is_some(), "{:?}", relay.stats());
    assert_eq!(
        early.0, 0,
        "published before a sync covered the rows: {:?}",
        early.1
    );
    assert_eq!(early.1.published, 0, "{:?}", early.1);

    let sent = common::wait_for(Duration::from_secs(30), || {
        let b = inbox.outbox_backlog().unwrap();
        (b.pending == 0 && b.sent == 2 && sub.count() >= 2).then_some(())
    });
    let stats = relay.stop();
    assert!(sent.is_some(), "{:?} {stats:?}", inbox.outbox_backlog());
}

/// A row the broker closes the connection over, with no PUBACK and nothing its CONNACK announced: mosquitto
/// takes no topic of more than 200 levels. The relay counts each such loss right after the row as a refusal
/// and parks it, instead of sending it first at every reconnection for ever.
fn a_row_the_broker_closes_the_connection_over_is_parked_and_the_rest_go_on() {
    let broker = Broker::mosquitto();
    let (_dir, db, sub, mut inbox) = files(&broker, "edges-sub-deep", "stock/deep/#");
    let deep = format!("stock/deep/{}x", "l/".repeat(200));
    commit_routed(&mut inbox, SCOPE, &["evt-0", "evt-1", "evt-2"], |id| {
        let topic = if id == "evt-1" {
            deep.clone()
        } else {
            "stock/deep/x".to_owned()
        };
        (topic, OutboxProperties::new())
    });

    let relay = relay(&db, broker.port, "edges-relay-deep");
    let (stats, mut payloads) = one_parked_two_sent(relay, &inbox, &sub);
    // evt-0 may come twice: the broker can close the connection before its PUBACK left.
    payloads.dedup();
    assert_eq!(payloads, [b"evt-0".to_vec(), b"evt-2".to_vec()]);
    assert!(stats.connection_failures >= 5, "{stats:?}");
    // Only the row at fault was counted.
    let attempts: Vec<(String, i64)> = inbox
        .connection()
        .prepare("SELECT message_id, attempts FROM outbox ORDER BY seq")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let counted: Vec<i64> = attempts.iter().map(|(_, a)| *a).collect();
    assert_eq!(counted, [0, 5, 0], "{attempts:?}");
}

fn main() {
    broker::run_tests(&[
        (
            "a_row_the_broker_closes_the_connection_over_is_parked_and_the_rest_go_on",
            a_row_the_broker_closes_the_connection_over_is_parked_and_the_rest_go_on,
            Needs::Mosquitto,
        ),
        (
            "rows_committed_without_a_sync_are_published_only_after_one",
            rows_committed_without_a_sync_are_published_only_after_one,
            Needs::AnyBroker,
        ),
        (
            "a_relay_connects_over_a_link_slower_than_its_poll_interval",
            a_relay_connects_over_a_link_slower_than_its_poll_interval,
            Needs::AnyBroker,
        ),
        (
            "a_row_the_brokers_connack_rules_out_is_parked_and_the_rest_go_on",
            a_row_the_brokers_connack_rules_out_is_parked_and_the_rest_go_on,
            Needs::Mosquitto,
        ),
        (
            "every_message_carries_its_commit_time_as_sent_at_also_when_resent",
            every_message_carries_its_commit_time_as_sent_at_also_when_resent,
            Needs::AnyBroker,
        ),
        (
            "a_row_over_the_brokers_maximum_packet_size_is_parked_and_the_rest_go_on",
            a_row_over_the_brokers_maximum_packet_size_is_parked_and_the_rest_go_on,
            Needs::Mosquitto,
        ),
        (
            "a_parked_row_requeued_while_the_relay_is_connected_is_sent_on_that_connection",
            a_parked_row_requeued_while_the_relay_is_connected_is_sent_on_that_connection,
            Needs::Mosquitto,
        ),
    ])
}
