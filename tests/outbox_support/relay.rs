//! What the relay tests share: committed deliveries whose handlers publish, a relay with a short backoff, and
//! what a subscriber saw first.
use std::path::Path;
use std::time::Duration;

use super::Subscriber;
use edge_inbox::{
    Config, Delivery, Inbox, MqttConfig, OutboxProperties, Qos, Relay, RelayConfig, Tx,
};

/// The scope the relay tests commit under.
pub const SCOPE: &str = "inventory-reservation";

/// Commits one delivery per payload; each handler call publishes one message carrying the payload.
pub fn commit(inbox: &mut Inbox, prefix: &str, n: usize) {
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

pub fn relay(db: &Path, port: u16) -> Relay {
    Relay::start_with(
        Inbox::open(db, Config::default()).unwrap(),
        MqttConfig::new("127.0.0.1", port, "outbox-relay-test"),
        RelayConfig::default().max_backoff(Duration::from_millis(400)),
    )
    .unwrap()
}

/// Payloads in the order they were first received.
pub fn first_seen(sub: &Subscriber, prefix: &str) -> Vec<String> {
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

/// Commits one delivery per id in `scope` (its payload: the id); each handler call publishes the payload on
/// the topic, and with the properties, that `route` gives for the id.
pub fn commit_routed(
    inbox: &mut Inbox,
    scope: &str,
    ids: &[&str],
    route: impl Fn(&str) -> (String, OutboxProperties),
) {
    let deliveries: Vec<Delivery<'_>> = ids
        .iter()
        .map(|id| Delivery::new(scope, id, "orders", id.as_bytes()))
        .collect();
    inbox
        .process_batch(&deliveries, |tx: &mut Tx<'_>, d: &Delivery<'_>| {
            let (topic, props) = route(d.message_id);
            tx.publish(&topic, d.payload, Qos::AtLeastOnce, &props)?;
            Ok(())
        })
        .unwrap();
}
