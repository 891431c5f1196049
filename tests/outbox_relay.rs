//! The relay against a real broker (mosquitto or the embedded one: see `broker`): properties and ids on the
//! wire. A broker that goes away while rows are committed needs a mosquitto restart: see `mosquitto_only`.
#![cfg(feature = "mqtt")]

mod broker;
mod common;
mod outbox_support;

use std::path::Path;
use std::time::Duration;

use broker::Broker;
use edge_inbox::{
    outbox_message_id, Config, Delivery, Inbox, MqttConfig, OutboxProperties, Qos, Relay,
    RelayConfig, Tx,
};
use outbox_support::Subscriber;

const SCOPE: &str = "inventory-reservation";

/// Commits one delivery per payload; each handler call publishes one message carrying the payload.
fn commit(inbox: &mut Inbox, prefix: &str, n: usize) {
    let ids: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    let deliveries: Vec<Delivery<'_>> = ids
        .iter()
        .map(|id| Delivery::new(SCOPE, id, "orders", id.as_bytes()))
        .collect();
    for chunk in deliveries.chunks(50) {
        inbox
            .process_batch(chunk, |tx: &mut Tx<'_>, d: &Delivery<'_>| {
                tx.publish(
                    "stock/reserved",
                    d.payload,
                    Qos::AtLeastOnce,
                    &OutboxProperties::new()
                        .content_type("text/plain")
                        .user_property("order", d.message_id),
                )?;
                Ok(())
            })
            .unwrap();
    }
}

fn relay(db: &Path, port: u16) -> Relay {
    Relay::start_with(
        Inbox::open(db, Config::default()).unwrap(),
        MqttConfig::new("127.0.0.1", port, "outbox-relay-test"),
        RelayConfig::default().max_backoff(Duration::from_millis(400)),
    )
    .unwrap()
}

/// Payloads in the order they were first received.
fn first_seen(sub: &Subscriber, prefix: &str) -> Vec<String> {
    let mut seen = std::collections::BTreeSet::new();
    let mut order = Vec::new();
    for g in sub.got() {
        let p = String::from_utf8(g.payload).unwrap();
        if p.starts_with(prefix) && seen.insert(p.clone()) {
            order.push(p);
        }
    }
    order
}

#[test]
fn messages_carry_their_id_producer_and_properties_and_are_marked_sent_after_the_puback() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let sub = Subscriber::start(broker.port, "outbox-sub-props", "stock/#");
    let mut inbox = Inbox::open(&db, Config::default()).unwrap();
    commit(&mut inbox, "a", 5);
    let relay = relay(&db, broker.port);
    let done = common::wait_for(Duration::from_secs(30), || {
        (inbox.outbox_backlog().unwrap().pending == 0 && sub.ids().len() == 5).then_some(())
    });
    assert!(
        done.is_some(),
        "not drained: {:?}, {} received",
        inbox.outbox_backlog(),
        sub.count()
    );
    let stats = relay.stop();
    assert!(stats.confirmed >= 5 && stats.marked >= 5, "{stats:?}");
    for g in sub.got() {
        let p = String::from_utf8(g.payload.clone()).unwrap();
        assert_eq!(g.topic, "stock/reserved");
        assert_eq!(
            g.message_id.as_deref(),
            Some(outbox_message_id(SCOPE, None, &p, 0).as_str())
        );
        assert_eq!(g.producer.as_deref(), Some(SCOPE));
        assert_eq!(g.content_type.as_deref(), Some("text/plain"));
        assert!(g
            .user_properties
            .contains(&("order".to_string(), p.clone())));
    }
    assert_eq!(first_seen(&sub, "a-"), ["a-0", "a-1", "a-2", "a-3", "a-4"]);
    let b = inbox.outbox_backlog().unwrap();
    assert_eq!((b.pending, b.sent, b.oldest_pending_age), (0, 5, None));
    for i in 0..5 {
        let id = outbox_message_id(SCOPE, None, &format!("a-{i}"), 0);
        assert_eq!(inbox.outbox_status(SCOPE, &id).unwrap(), Some(true));
    }
}
