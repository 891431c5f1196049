//! A consumer that reserves stock and announces each reservation through the outbox.
//!
//! Order events arrive on `orders/#` (JSON, id in the MQTT 5 user property `message-id`). The handler reserves
//! the stock and, in the same transaction, publishes `stock-reserved` on `stock/reserved/<order>`. A relay
//! sends the outbox with its own connection, with the user properties `message-id`, `producer` and `sent-at`, and marks
//! each message sent only after the broker's PUBACK. A subscriber prints what it gets.
//!
//! ```text
//! cargo run --example outbox      # starts a local broker on a free loopback port
//! ```
//!
//! The broker delivers order 42 twice: the reservation, and its announcement, happen once.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use edge_inbox::{Config, Consumer, Delivery, Inbox, MqttConfig, OutboxProperties, Qos, Relay, Tx};

mod support;

const SCOPE: &str = "inventory-reservation";
/// The subscriber's end marker: not an announcement.
const END_TOPIC: &str = "stock/end";

/// Reserve, and say so: both commit together, or neither does.
fn reserve(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let event: serde_json::Value = serde_json::from_slice(d.payload).context("not JSON")?;
    let order = event["order"].as_u64().context("no order")?;
    let sku = event["sku"].as_str().context("no sku")?;
    let qty = event["qty"].as_i64().context("no qty")?;
    let key = format!("reserved/{sku}");
    let reserved: i64 = tx.get(&key)?.unwrap_or(0) + qty;
    tx.put(&key, &reserved)?;
    let announcement = serde_json::json!({
        "event": "stock-reserved", "order": order, "sku": sku, "qty": qty, "reserved": reserved,
    });
    tx.publish(
        &format!("stock/reserved/{order}"),
        announcement.to_string().as_bytes(),
        Qos::AtLeastOnce,
        &OutboxProperties::new().content_type("application/json"),
    )?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let dir = tempfile::tempdir()?;
    // Started as root, mosquitto drops to its own user; it only needs to read its config here.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let broker = support::LocalBroker::start(dir.path())?;
    eprintln!("broker: {}", broker.describe());
    let db = dir.path().join("gateway.db");
    // The producer namespace downstream consumers see; by default it would be the scope.
    let config = Config::default().outbox_producer("gateway-7");
    let consumer = || -> anyhow::Result<Consumer> {
        let mqtt =
            MqttConfig::new("127.0.0.1", broker.port, "outbox-demo-consumer").subscribe("orders/#");
        Ok(Consumer::new(
            Inbox::open(&db, config.clone())?,
            SCOPE,
            mqtt,
        ))
    };
    // First connection: the broker keeps our subscription from now on.
    consumer()?
        .exit_when_idle(Duration::from_millis(300))
        .run(reserve)?;

    let subscriber = Subscriber::start(broker.port)?;
    // The relay reads the outbox through its own connection to the same file.
    let relay = Relay::start(
        Inbox::open(&db, config.clone())?,
        MqttConfig::new("127.0.0.1", broker.port, "outbox-demo-relay"),
    )?;

    let created = |order: u32, sku: &str, qty: u32| {
        format!(r#"{{"order":{order},"sku":"{sku}","qty":{qty}}}"#)
    };
    support::publish(
        broker.port,
        "outbox-demo-publisher",
        &[
            ("orders/42", Some("evt-42-created"), created(42, "A-1", 1)),
            ("orders/43", Some("evt-43-created"), created(43, "A-1", 2)),
            // The broker redelivers 42 (our PUBACK was lost): not reserved, not announced again.
            ("orders/42", Some("evt-42-created"), created(42, "A-1", 1)),
            ("orders/44", Some("evt-44-created"), created(44, "B-7", 1)),
        ],
    )?;
    // Run until all four deliveries are settled (three reserved, the redelivery recognised).
    let mut running = consumer()?;
    let stop = running.stop_handle();
    let stats = Inbox::open(&db, config.clone())?;
    let watcher = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            match stats.scope_stats(SCOPE) {
                Ok(s) if s.processed + s.duplicates >= 4 => break,
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        stop.stop();
    });
    let summary = running.run(reserve)?;
    let _ = watcher.join();
    eprintln!("consumer: {summary:?}");

    let inbox = Inbox::open(&db, config)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while inbox.outbox_backlog()?.pending > 0 {
        if Instant::now() > deadline {
            bail!(
                "the relay did not drain the outbox: {:?}",
                inbox.outbox_backlog()?
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("relay: {:?}", relay.stop());
    // Every announcement reached the broker before the relay stopped; a marker published now arrives after
    // all of them (and after any repeat), so the count is complete once it is seen.
    support::publish(
        broker.port,
        "outbox-demo-marker",
        &[(END_TOPIC, None, String::new())],
    )?;
    let received = subscriber.stop_at_marker(Duration::from_secs(10));
    let backlog = inbox.outbox_backlog()?;
    println!(
        "received {received} announcements; outbox: {} pending, {} sent",
        backlog.pending, backlog.sent
    );
    Ok(())
}

/// Prints every `stock/#` message with its id and producer; returns how many it got.
struct Subscriber {
    stop: Arc<AtomicBool>,
    ended: Arc<AtomicBool>,
    received: Arc<AtomicUsize>,
    thread: std::thread::JoinHandle<()>,
}

impl Subscriber {
    fn start(port: u16) -> anyhow::Result<Subscriber> {
        use rumqttc::v5::mqttbytes::v5::Packet;
        use rumqttc::v5::mqttbytes::QoS;
        use rumqttc::v5::{Client, Event, MqttOptions};
        let (client, mut conn) = Client::new(
            MqttOptions::new("outbox-demo-subscriber", "127.0.0.1", port),
            16,
        );
        client.subscribe("stock/#", QoS::AtLeastOnce)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match conn.recv_timeout(Duration::from_millis(100)) {
                Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => break,
                Ok(Err(e)) => bail!("subscriber: {e}"),
                _ if Instant::now() > deadline => bail!("subscriber: no SUBACK"),
                _ => {}
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let ended = Arc::new(AtomicBool::new(false));
        let received = Arc::new(AtomicUsize::new(0));
        let (flag, end, count) = (stop.clone(), ended.clone(), received.clone());
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                if let Ok(Ok(Event::Incoming(Packet::Publish(p)))) =
                    conn.recv_timeout(Duration::from_millis(50))
                {
                    if p.topic == END_TOPIC.as_bytes() {
                        end.store(true, Ordering::SeqCst);
                        continue;
                    }
                    let props = p.properties.unwrap_or_default();
                    let prop = |name: &str| {
                        props
                            .user_properties
                            .iter()
                            .find(|(k, _)| k == name)
                            .map_or("-", |(_, v)| v.as_str())
                            .to_owned()
                    };
                    println!(
                        "{} {} message-id={} producer={}",
                        String::from_utf8_lossy(&p.topic),
                        String::from_utf8_lossy(&p.payload),
                        prop("message-id"),
                        prop("producer")
                    );
                    count.fetch_add(1, Ordering::SeqCst);
                }
            }
            let _ = client.disconnect();
        });
        Ok(Subscriber {
            stop,
            ended,
            received,
            thread,
        })
    }

    /// Waits (bounded) for the end marker, then stops.
    fn stop_at_marker(self, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        while !self.ended.load(Ordering::SeqCst) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
        self.received.load(Ordering::SeqCst)
    }
}
