//! The consumer every consumer test starts from: a persistent session subscribed to `orders/#`, batches of 64,
//! and a run that ends when the broker has been idle for 1.5 s.
use std::path::Path;
use std::time::Duration;

use super::{inventory_handler, Broker};
use edge_inbox::{Config, Consumer, Inbox, MqttConfig, Protocol, RunSummary};

/// The scope the consumer tests record identities under.
pub const SCOPE: &str = "inventory-reservation";

pub fn consumer(
    broker: &Broker,
    db: &Path,
    client_id: &str,
    protocol: Protocol,
    config: Config,
) -> Consumer {
    let inbox = Inbox::open(db, config).unwrap();
    let mqtt = MqttConfig::new("127.0.0.1", broker.port, client_id)
        .protocol(protocol)
        .subscribe("orders/#");
    Consumer::new(inbox, SCOPE, mqtt)
        .batch(64, Duration::ZERO)
        .exit_when_idle(Duration::from_millis(1500))
}

pub fn init_log() {
    let _ = env_logger::builder().is_test(true).try_init();
}

/// Connects once so the broker holds a persistent, subscribed session for `client_id`.
pub fn prime(broker: &Broker, db: &Path, client_id: &str, protocol: Protocol) {
    init_log();
    let s = crate::common::until_connected(|| {
        consumer(broker, db, client_id, protocol, Config::default())
            .exit_when_idle(Duration::from_millis(300))
            .run(inventory_handler)
    });
    assert!(s.connections >= 1, "never connected: {s:?}");
}

pub fn drain(broker: &Broker, db: &Path, client_id: &str, protocol: Protocol) -> RunSummary {
    consumer(broker, db, client_id, protocol, Config::default())
        .run(inventory_handler)
        .unwrap()
}

pub fn order(order: u32, sku: &str, qty: i64, kind: &str) -> String {
    format!(r#"{{"order":{order},"sku":"{sku}","qty":{qty},"kind":"{kind}"}}"#)
}
