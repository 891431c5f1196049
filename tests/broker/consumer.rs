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
///
/// The run ends once idle for 300 ms; on a busy machine the first connection may not be up by then (the run
/// then ends with an error and no connection), so that case is tried again, a few times.
pub fn prime(broker: &Broker, db: &Path, client_id: &str, protocol: Protocol) {
    init_log();
    for attempt in 1..=5 {
        let mut c = consumer(broker, db, client_id, protocol, Config::default())
            .exit_when_idle(Duration::from_millis(300));
        match c.run(inventory_handler) {
            Ok(s) => {
                assert!(s.connections >= 1, "never connected: {s:?}");
                return;
            }
            Err(e) if attempt < 5 && e.to_string().contains("no connection to the broker") => {}
            Err(e) => panic!("priming {client_id}: {e}"),
        }
    }
}

pub fn drain(broker: &Broker, db: &Path, client_id: &str, protocol: Protocol) -> RunSummary {
    consumer(broker, db, client_id, protocol, Config::default())
        .run(inventory_handler)
        .unwrap()
}

pub fn order(order: u32, sku: &str, qty: i64, kind: &str) -> String {
    format!(r#"{{"order":{order},"sku":"{sku}","qty":{qty},"kind":"{kind}"}}"#)
}
