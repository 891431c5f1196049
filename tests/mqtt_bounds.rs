//! What a publisher or a failing disk cannot make the consumer do: hold large packets in memory, grow the
//! database with garbage, or retry a storage error for ever.
#![cfg(feature = "mqtt")]

mod broker;
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use broker::{inventory_handler, publish_v5, Broker, Msg};
use edge_inbox::{Config, Consumer, Error, Inbox, MqttConfig};

const SCOPE: &str = "inventory-reservation";

fn consumer(port: u16, db: &Path, client: &str, config: Config) -> Consumer {
    let inbox = Inbox::open(db, config).unwrap();
    let mqtt = MqttConfig::new("127.0.0.1", port, client).subscribe("orders/#");
    Consumer::new(inbox, SCOPE, mqtt)
}

/// Peak resident memory of this process, in KiB.
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/self/status")
}

/// The consumer process of the garbage test: prints its peak memory before and after draining.
#[test]
#[ignore = "child process of garbage_of_8_mib_without_an_id_grows_neither_memory_nor_the_database"]
fn garbage_child() {
    let (Ok(port), Ok(db)) = (
        std::env::var("EDGE_INBOX_BOUNDS_PORT"),
        std::env::var("EDGE_INBOX_BOUNDS_DB"),
    ) else {
        return;
    };
    // The idle limit also bounds the wait for the first CONNACK, which mosquitto can hold back for seconds
    // while it saves the 800 MiB just queued for this session (its test persistence autosaves every second):
    // a CI run on a loaded machine ended here idle before connecting with 3 s. The embedded broker ignores
    // the Maximum Packet Size and sends the 8 MiB again at every reconnect, every few seconds: there the run
    // ends idle only with a limit shorter than that cycle.
    let idle = match broker::selected() {
        broker::Kind::Mosquitto => Duration::from_secs(10),
        broker::Kind::Embedded => Duration::from_secs(3),
    };
    let mut c = consumer(
        port.parse().unwrap(),
        Path::new(&db),
        "inv-garbage",
        Config::default(),
    )
    .exit_when_idle(idle);
    let before = peak_rss_kib();
    let s = c.run(inventory_handler).unwrap();
    let after = peak_rss_kib();
    println!("peak_rss_kib before={before} after={after}");
    println!(
        "summary processed={} quarantined={}",
        s.processed, s.quarantined
    );
}

fn db_bytes(db: &Path) -> u64 {
    let mut total = 0;
    for suffix in ["", "-wal"] {
        let p = format!("{}{suffix}", db.display());
        total += std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    }
    total
}

#[test]
fn garbage_of_8_mib_without_an_id_grows_neither_memory_nor_the_database() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    // A persistent, subscribed session first.
    common::until_connected(|| {
        consumer(broker.port, &db, "inv-garbage", Config::default())
            .exit_when_idle(Duration::from_millis(300))
            .run(inventory_handler)
    });
    let size_before = db_bytes(&db);

    let garbage: Vec<u8> = (0..8u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let good = r#"{"order":1,"sku":"G-1","qty":1,"kind":"created"}"#;
    // Published while the consumer is away: the broker queues them for the session. mosquitto_pub sends
    // 8 MiB in a blink; rumqttc (to the embedded broker) takes seconds each in a debug build, so fewer.
    if broker.kind == broker::Kind::Mosquitto {
        let file = dir.path().join("garbage.bin");
        std::fs::write(&file, &garbage).unwrap();
        let file = file.to_str().unwrap();
        for i in 0..common::scaled(100) {
            broker.pub_cmd(&["-V", "5", "-t", &format!("orders/{i}"), "-f", file]);
        }
    } else {
        for i in 0..common::scaled(4) {
            publish_v5(
                broker.port,
                &[Msg::new(&format!("orders/{i}"), None, garbage.clone())],
            );
        }
    }
    drop(garbage);
    publish_v5(
        broker.port,
        &[Msg::new("orders/good", Some("evt-good"), good)],
    );

    let stdout = run_child("garbage_child", broker.port, &db);
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("peak_rss_kib ").map(|(_, v)| v))
        .unwrap_or_else(|| panic!("no memory figures: {stdout}"));
    let figure = |name: &str| -> u64 {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .unwrap()
    };
    let grown = figure("after=").saturating_sub(figure("before="));
    assert!(
        grown < 32 << 10,
        "peak memory grew by {grown} KiB: 8 MiB packets were read into memory"
    );
    let grown = db_bytes(&db).saturating_sub(size_before);
    assert!(grown < 1 << 20, "the database grew by {grown} bytes");
    // mosquitto drops what exceeds the Maximum Packet Size we announced, so the stream goes on behind it;
    // 2.0.11 drops only an inflight window's worth per connection (the rest wait for the next one).
    if broker.kind == broker::Kind::Mosquitto {
        let mut processed = 0;
        for _ in 0..10 {
            consumer(broker.port, &db, "inv-garbage", Config::default())
                .exit_when_idle(Duration::from_secs(2))
                .run(inventory_handler)
                .unwrap();
            let st = Inbox::open(&db, Config::default())
                .unwrap()
                .scope_stats(SCOPE)
                .unwrap();
            processed = st.processed;
            if processed == 1 {
                break;
            }
        }
        assert_eq!(
            processed, 1,
            "the delivery behind the garbage never arrived"
        );
        let grown = db_bytes(&db).saturating_sub(size_before);
        assert!(grown < 1 << 20, "the database grew by {grown} bytes");
    }
}

#[test]
fn a_storage_error_that_persists_ends_the_run_with_it_and_acks_nothing() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let config = Config::default().busy_timeout(Duration::from_millis(100));
    common::until_connected(|| {
        consumer(broker.port, &db, "inv-busy", config.clone())
            .exit_when_idle(Duration::from_millis(300))
            .run(inventory_handler)
    });
    publish_v5(
        broker.port,
        &[Msg::new(
            "orders/1",
            Some("evt-1"),
            r#"{"order":1,"sku":"B-1","qty":1,"kind":"created"}"#,
        )],
    );
    // Another writer holds the database for as long as the test wants: every commit is busy.
    let lock = rusqlite::Connection::open(&db).unwrap();
    lock.execute_batch("BEGIN IMMEDIATE").unwrap();

    let c = consumer(broker.port, &db, "inv-busy", config.clone())
        .storage_retry_limit(Duration::from_secs(2));
    let started = Instant::now();
    let run = std::thread::spawn(move || {
        let mut c = c;
        c.run(inventory_handler)
    });
    let ended = common::wait_for(Duration::from_secs(120), || run.is_finished().then_some(()));
    assert!(
        ended.is_some(),
        "a storage error that persists was retried for ever"
    );
    match run.join().unwrap() {
        Err(e @ Error::Busy { .. }) => assert!(e.is_retryable()),
        other => panic!("the run must end with the storage error: {other:?}"),
    }
    println!("ended after {:?}", started.elapsed());
    lock.execute_batch("ROLLBACK").unwrap();

    // Nothing was acked: the next run gets the delivery again and applies it.
    let s = consumer(broker.port, &db, "inv-busy", config)
        .exit_when_idle(Duration::from_secs(2))
        .run(inventory_handler)
        .unwrap();
    assert_eq!(s.processed, 1, "{s:?}");
}

/// Deliveries of the flood test: 1 KiB payloads, 24 MiB in all.
const FLOOD: usize = 24 * 1024;
const FLOOD_BUDGET: usize = 256 << 10;

fn trivial_handler(
    tx: &mut edge_inbox::Tx<'_>,
    d: &edge_inbox::Delivery<'_>,
) -> anyhow::Result<()> {
    tx.put(&format!("seen/{}", d.message_id), &1u8)?;
    Ok(())
}

/// The consumer process of the flood test: drains the queued flood with a small budget and a window far
/// larger than the budget, and prints its summary and its peak memory before and after.
#[test]
#[ignore = "child process of an_unpaced_flood_holds_no_more_than_the_memory_budget"]
fn flood_child() {
    let (Ok(port), Ok(db)) = (
        std::env::var("EDGE_INBOX_BOUNDS_PORT"),
        std::env::var("EDGE_INBOX_BOUNDS_DB"),
    ) else {
        return;
    };
    let inbox = Inbox::open(&db, Config::default()).unwrap();
    let mqtt = MqttConfig::new("127.0.0.1", port.parse().unwrap(), "inv-flood")
        .subscribe("flood/#")
        .inflight(u16::MAX);
    let mut c = Consumer::new(inbox, SCOPE, mqtt)
        .memory_budget(FLOOD_BUDGET)
        .exit_when_idle(Duration::from_secs(3));
    let before = peak_rss_kib();
    let s = c.run(trivial_handler).unwrap();
    let after = peak_rss_kib();
    println!("peak_rss_kib before={before} after={after}");
    println!(
        "summary processed={} acked={} duplicates={} peak_held={}",
        s.processed, s.acked, s.duplicates, s.peak_held_bytes
    );
}

/// A broker that sends everything it has at once (mosquitto with a window of 65,535, 24 MiB queued for the
/// session) cannot make the consumer hold more than its memory budget: it stops reading the socket instead.
/// Every delivery is still processed once and acked (a second run receives nothing).
#[test]
fn an_unpaced_flood_holds_no_more_than_the_memory_budget() {
    if broker::mosquitto_exe().is_none() && broker::selected() != broker::Kind::Mosquitto {
        println!("skipped: {}", broker::MOSQUITTO_MISSING);
        return;
    }
    let broker = Broker::mosquitto_with(u16::MAX);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let run = |idle: Duration| {
        let inbox = Inbox::open(&db, Config::default()).unwrap();
        let mqtt = MqttConfig::new("127.0.0.1", broker.port, "inv-flood").subscribe("flood/#");
        Consumer::new(inbox, SCOPE, mqtt)
            .exit_when_idle(idle)
            .run(trivial_handler)
            .unwrap()
    };
    run(Duration::from_millis(300));
    let n = common::scaled(FLOOD);
    let payload = vec![b'x'; 1024];
    let msgs: Vec<Msg> = (0..n)
        .map(|i| Msg::new("flood/a", Some(&format!("flood-{i}")), payload.clone()))
        .collect();
    publish_v5(broker.port, &msgs);
    drop(msgs);

    let stdout = run_child("flood_child", broker.port, &db);
    let figure = |name: &str| -> u64 {
        stdout
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {stdout}"))
    };
    assert_eq!(
        (
            figure("processed="),
            figure("acked="),
            figure("duplicates=")
        ),
        (n as u64, n as u64, 0),
        "every delivery processed once and acked"
    );
    let one = 1024 + 1024; // a delivery's payload, topic, properties and overhead, with room
    assert!(
        figure("peak_held=") <= (FLOOD_BUDGET + one) as u64,
        "deliveries held in memory beyond the budget of {FLOOD_BUDGET} bytes"
    );
    // Held whole, the flood (1 KiB payloads) would show here beyond its payload bytes (+42 MiB for 24 MiB).
    // What grows with the deliveries committed (SQLite's page cache, allocator slack, the acks waiting for
    // the client) is allowed an eighth of the flood plus 6 MiB: it measured 4.2-4.5 MiB for 24 MiB, and
    // 6.0-10.9 MiB while acks that found the client's request channel full made the loop hold deliveries.
    // Under an emulator the figure is the emulator's (its translated code grows as new paths run), so only
    // the budget, checked exactly above, is asserted there.
    let grown = figure("after=").saturating_sub(figure("before="));
    let flood_kib = (n as u64 * 1024) >> 10;
    println!("peak RSS grew by {grown} KiB draining {flood_kib} KiB");
    assert!(
        common::emulated() || grown < flood_kib / 8 + 6 * 1024,
        "peak memory grew by {grown} KiB while draining a flood of {flood_kib} KiB with a budget of 256 KiB"
    );
    let again = run(Duration::from_secs(1));
    assert_eq!(
        again.received, 0,
        "deliveries left unacked at the broker: {again:?}"
    );
    let st = Inbox::open(&db, Config::default())
        .unwrap()
        .scope_stats(SCOPE)
        .unwrap();
    assert_eq!(st.processed, n as u64);
}

/// Runs the ignored test `name` of this binary as a child process on the broker at `port` and the database
/// `db`; its stdout, once it exited successfully.
fn run_child(name: &str, port: u16, db: &std::path::Path) -> String {
    let mut cmd = common::child_command(name);
    cmd.env("EDGE_INBOX_BOUNDS_PORT", port.to_string())
        .env("EDGE_INBOX_BOUNDS_DB", db);
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{stdout}");
    stdout
}

/// The application's own connection, with a request channel of 4 (rumqttc's `cap`) that a flood keeps full
/// of PUBACKs: the commit thread keeps the acks waiting, in order, and goes on committing, instead of taking
/// in deliveries beyond the budget to keep the connection's side polling. Every delivery is processed once
/// and acked, in the order it arrived.
#[test]
fn a_request_channel_full_of_acks_holds_no_deliveries_beyond_the_budget() {
    use edge_inbox::ConsumerCore;
    use rumqttc::v5::mqttbytes::v5::Packet;
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::{Client, Event, MqttOptions};

    if broker::mosquitto_exe().is_none() && broker::selected() != broker::Kind::Mosquitto {
        println!("skipped: {}", broker::MOSQUITTO_MISSING);
        return;
    }
    let broker = Broker::mosquitto_with(u16::MAX);
    let options = || {
        let mut o = MqttOptions::new("own-tiny-channel", "127.0.0.1", broker.port);
        o.set_clean_start(false)
            .set_manual_acks(true)
            .set_keep_alive(Duration::from_secs(30));
        o.set_session_expiry_interval(Some(3600));
        o
    };
    // The session and its subscription first, so that the flood is queued for it.
    {
        let (client, mut conn) = Client::new(options(), 4);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            assert!(Instant::now() < deadline, "no SUBACK");
            match conn.recv_timeout(Duration::from_millis(200)) {
                Ok(Ok(Event::Incoming(Packet::ConnAck(_)))) => {
                    client.try_subscribe("tiny/#", QoS::AtLeastOnce).unwrap()
                }
                Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => break,
                _ => {}
            }
        }
        client.try_disconnect().unwrap();
        while let Ok(Ok(_)) = conn.recv_timeout(Duration::from_millis(200)) {}
    }
    let n = common::scaled(4000);
    let msgs: Vec<Msg> = (0..n)
        .map(|i| Msg::new("tiny/a", Some(&format!("tiny-{i}")), vec![b'x'; 1024]))
        .collect();
    publish_v5(broker.port, &msgs);
    drop(msgs);

    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let budget = 64 << 10;
    let (client, mut conn) = Client::new(options(), 4);
    let (mut feed, commits) = ConsumerCore::new(inbox, SCOPE)
        .memory_budget(budget)
        .spawn(trivial_handler, client.clone(), u16::MAX)
        .unwrap();
    let (mut received, mut acked) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let deadline = Instant::now() + Duration::from_secs(120);
    while acked.len() < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} received, {} acked",
            received.len(),
            acked.len()
        );
        match conn.recv_timeout(Duration::from_millis(100)) {
            Ok(Ok(Event::Incoming(Packet::ConnAck(ack)))) => {
                feed.connected(ack.session_present).unwrap();
            }
            Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                received.push(p.pkid);
                feed.publish_v5(p).unwrap();
            }
            Ok(Ok(Event::Outgoing(rumqttc::Outgoing::PubAck(pkid)))) => acked.push(pkid),
            Ok(Err(e)) => panic!("connection error: {e}"),
            _ => {}
        }
    }
    commits.stop();
    let (_, summary) = commits.join();
    let summary = summary.unwrap();
    assert_eq!(summary.processed, n as u64, "{summary:?}");
    assert_eq!(acked, received, "PUBACKs in the order of the deliveries");
    let one = 1024 + 1024;
    assert!(
        summary.peak_held_bytes <= (budget + one) as u64,
        "held {} bytes at most with a budget of {budget}",
        summary.peak_held_bytes
    );
}
