//! Acks against a real mosquitto: a graceful stop acks everything it committed before it disconnects, no
//! ack crosses a reconnect, every configured filter is subscribed, a deterministic failure is dead-lettered
//! instead of stalling the stream.

mod broker;
mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use broker::{publish_v311, publish_v5, Broker, Msg, Needs};
use edge_inbox::{Config, Consumer, Envelope, Inbox, MqttConfig, Protocol, RunSummary, StopHandle};

const SCOPE: &str = "acks";
/// The id of the message published after all others: once it is processed, everything before it was seen.
const SENTINEL: &str = "sentinel";

fn init_log() {
    let _ = env_logger::builder().is_test(true).try_init();
}

fn mqtt(broker: &Broker, client_id: &str, protocol: Protocol) -> MqttConfig {
    MqttConfig::new("127.0.0.1", broker.port, client_id)
        .protocol(protocol)
        .subscribe("acks/#")
}

fn consumer(db: &Path, mqtt: MqttConfig) -> Consumer {
    let inbox = Inbox::open(db, Config::default()).unwrap();
    // The idle exit only bounds a run that never gets its signal; every test stops on a positive one.
    Consumer::new(inbox, SCOPE, mqtt)
        .batch(64, Duration::from_millis(5))
        .exit_when_idle(Duration::from_secs(30))
}

/// Connects once and stops at once, so the broker holds a persistent, subscribed session.
fn prime(db: &Path, mqtt: MqttConfig) {
    init_log();
    let s = common::until_connected(|| {
        consumer(db, mqtt.clone())
            .exit_when_idle(Duration::from_millis(300))
            .run(|_: &mut edge_inbox::Tx<'_>, _: &edge_inbox::Delivery<'_>| Ok(()))
    });
    assert!(s.connections >= 1, "never connected: {s:?}");
}

fn msgs(prefix: &str, n: usize) -> Vec<Msg> {
    (0..n)
        .map(|i| Msg::new("acks/m", Some(&format!("{prefix}-{i}")), format!("{i}")))
        .collect()
}

/// Counts applications per message id in the business state, so "exactly once" is checked on the effect.
fn count_handler(tx: &mut edge_inbox::Tx<'_>, d: &edge_inbox::Delivery<'_>) -> anyhow::Result<()> {
    let key = format!("applied/{}", d.message_id);
    let n: i64 = tx.get(&key)?.unwrap_or(0);
    tx.put(&key, &(n + 1))?;
    Ok(())
}

/// How many times each message id was applied.
fn applied(db: &Path) -> HashMap<String, i64> {
    let conn = rusqlite::Connection::open(db).unwrap();
    let mut stmt = conn
        .prepare("SELECT substr(key, 9), value FROM kv WHERE ns = ?1 AND key LIKE 'applied/%'")
        .unwrap();
    let rows = stmt
        .query_map([SCOPE], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, Vec<u8>>(1)?))
        })
        .unwrap();
    rows.map(|r| {
        let (k, v) = r.unwrap();
        (k, ciborium::from_reader(&v[..]).unwrap())
    })
    .collect()
}

/// A second run on the same session, until the sentinel (published now, after everything else) is
/// processed: what it sees besides new deliveries are redeliveries of what the first run settled.
fn run_until_sentinel(db: &Path, mqtt: MqttConfig, publish: impl FnOnce()) -> RunSummary {
    let mut c = consumer(db, mqtt);
    let stop = c.stop_handle();
    let saw = Arc::new(AtomicU64::new(0));
    let saw2 = saw.clone();
    publish();
    let s = c
        .run(
            move |tx: &mut edge_inbox::Tx<'_>, d: &edge_inbox::Delivery<'_>| {
                count_handler(tx, d)?;
                if d.message_id == SENTINEL {
                    saw2.store(1, Ordering::SeqCst);
                    stop.stop();
                }
                Ok(())
            },
        )
        .unwrap();
    assert_eq!(
        saw.load(Ordering::SeqCst),
        1,
        "the sentinel never arrived: {s:?}"
    );
    s
}

fn sentinel_v5(port: u16) {
    publish_v5(port, &[Msg::new("acks/m", Some(SENTINEL), "s")]);
}

/// The handler stops the consumer at its k-th delivery of one batch of n.
fn stop_in_handler_at(k: usize, n: usize, client_id: &str) {
    let broker = Broker::start_with(64);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let cfg = || mqtt(&broker, client_id, Protocol::V5).inflight(64);
    prime(&db, cfg());
    // Queued for the session while the consumer is away: they arrive in one burst, one batch.
    publish_v5(broker.port, &msgs("m", n));

    let mut c = consumer(&db, cfg()).batch(64, Duration::from_millis(300));
    let stop: StopHandle = c.stop_handle();
    let mut calls = 0;
    let first = c
        .run(
            move |tx: &mut edge_inbox::Tx<'_>, d: &edge_inbox::Delivery<'_>| {
                calls += 1;
                if calls == k {
                    stop.stop();
                }
                count_handler(tx, d)
            },
        )
        .unwrap();
    assert!(first.processed >= k as u64, "{first:?}");
    assert_eq!(
        first.acked,
        first.processed + first.duplicates,
        "a graceful stop acks every delivery it settled: {first:?}"
    );

    let second = run_until_sentinel(&db, cfg(), || sentinel_v5(broker.port));
    assert_eq!(
        second.duplicates, 0,
        "what the stopped run committed was redelivered: {first:?} then {second:?}"
    );
    let applied = applied(&db);
    assert_eq!(applied.len(), n + 1, "{first:?} {second:?}");
    assert!(applied.values().all(|&c| c == 1), "{applied:?}");
}

fn a_stop_from_the_handler_mid_batch_acks_the_whole_batch() {
    stop_in_handler_at(3, 10, "acks-stop-k");
}

fn a_stop_from_the_handler_at_the_last_delivery_acks_the_whole_batch() {
    stop_in_handler_at(10, 10, "acks-stop-n");
}

fn a_stop_from_another_thread_mid_flood_leaves_nothing_committed_unacked() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let cfg = || mqtt(&broker, "acks-flood", Protocol::V5);
    prime(&db, cfg());
    let n = common::scaled(5000);
    let port = broker.port;
    let publisher = std::thread::spawn(move || publish_v5(port, &msgs("f", n)));

    let mut c = consumer(&db, cfg());
    let stop = c.stop_handle();
    let seen = Arc::new(AtomicU64::new(0));
    let seen2 = seen.clone();
    let stopper = std::thread::spawn(move || {
        let mid = (n / 5).max(1) as u64;
        let hit = common::wait_for(Duration::from_secs(120), || {
            (seen2.load(Ordering::SeqCst) >= mid).then_some(())
        });
        stop.stop();
        hit.is_some()
    });
    let first = c
        .run(
            move |tx: &mut edge_inbox::Tx<'_>, d: &edge_inbox::Delivery<'_>| {
                seen.fetch_add(1, Ordering::SeqCst);
                count_handler(tx, d)
            },
        )
        .unwrap();
    assert!(
        stopper.join().unwrap(),
        "the flood never reached the consumer"
    );
    assert!(
        first.processed > 0 && first.processed < n as u64,
        "{first:?}"
    );
    assert_eq!(first.acked, first.processed + first.duplicates, "{first:?}");
    publisher.join().unwrap();

    let second = run_until_sentinel(&db, cfg(), || sentinel_v5(broker.port));
    assert_eq!(second.duplicates, 0, "{first:?} then {second:?}");
    let applied = applied(&db);
    assert_eq!(applied.len(), n + 1);
    assert!(applied.values().all(|&c| c == 1));
}

fn sigterm_to_inventory_run_mid_flood_acks_what_it_committed() {
    init_log();
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    let db_s = db.to_str().unwrap().to_owned();
    let addr = broker.addr();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--broker",
            &addr,
            "--db",
            &db_s,
            "--client-id",
            "acks-inv",
        ];
        args.extend_from_slice(extra);
        common::through_runner(&common::built_example("inventory"))
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let stats = || {
        Inbox::open(&db, Config::default())
            .ok()?
            .scope_stats("inventory-reservation")
            .ok()
    };
    let wait = |mut child: std::process::Child| {
        let done = common::wait_for(Duration::from_secs(60), || child.try_wait().unwrap());
        if done.is_none() {
            let _ = child.kill();
        }
        let out = child.wait_with_output().unwrap();
        assert!(
            done.is_some_and(|s| s.success()),
            "inventory run: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    wait(run(&["--exit-when-idle", "1"]));

    let n = common::scaled(3000);
    let order = |i: usize| format!(r#"{{"order":{i},"sku":"A-1","qty":1,"kind":"created"}}"#);
    let flood: Vec<Msg> = (0..n)
        .map(|i| Msg::new("orders/1", Some(&format!("o-{i}")), order(i)))
        .collect();
    let port = broker.port;
    let publisher = std::thread::spawn(move || publish_v5(port, &flood));
    let child = run(&[]);
    let mid = (n / 5).max(1) as u64;
    let hit = common::wait_for(Duration::from_secs(120), || {
        stats().filter(|s| s.processed >= mid)
    });
    assert!(hit.is_some(), "the flood never reached the consumer");
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    wait(child);
    let after_stop = stats().unwrap();
    publisher.join().unwrap();

    // The rest and then a sentinel order; once it is processed, everything before it was delivered.
    publish_v5(port, &[Msg::new("orders/1", Some(SENTINEL), order(n))]);
    let child = run(&[]);
    let done = common::wait_for(Duration::from_secs(120), || {
        stats().filter(|s| s.processed > n as u64)
    });
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    wait(child);
    let end = done.expect("the second run did not process everything");
    assert_eq!(
        end.duplicates, after_stop.duplicates,
        "committed deliveries were redelivered after SIGTERM ({after_stop:?}, then {end:?})"
    );
    assert_eq!(end.processed, n as u64 + 1);
}

/// A TCP proxy in front of the broker. While `hold` is set, what the broker sends is kept back; when the
/// broker's side closes, everything kept is written to the client at once, followed by the end of the
/// stream: publishes and the connection's end arrive in one burst, as under load.
struct Proxy {
    port: u16,
    hold: Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    fn start(upstream: u16) -> Proxy {
        let hold = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let held = hold.clone();
        let port = common::proxy(upstream, move |_| !held.load(Ordering::SeqCst));
        Proxy { port, hold }
    }
}

/// The connection ends right after a burst of publishes (held back by a proxy, then written with the end of
/// the stream), and the broker restarts without persistence: the session is gone and packet ids start
/// again at 1. Publishes of the dead connection must not be acked on the new one: the broker must see
/// exactly one PUBACK for each PUBLISH it sent on the new connection, for that PUBLISH, in order (a stale
/// ack would complete a new message before its commit). New messages are each applied exactly once.
fn cut_after_a_burst(protocol: Protocol, client_id: &str) {
    let mut broker = Broker::start_volatile_verbose(20);
    let proxy = Proxy::start(broker.port);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let cfg = || {
        MqttConfig::new("127.0.0.1", proxy.port, client_id)
            .protocol(protocol)
            .subscribe("acks/m")
    };
    let publish = move |port: u16, prefix: &str, n: usize| match protocol {
        Protocol::V311 => {
            let m: Vec<(String, Vec<u8>)> = (0..n)
                .map(|i| {
                    let env = Envelope::new(format!("{prefix}-{i}"), format!("{i}").into_bytes())
                        .encode();
                    ("acks/m".to_owned(), env)
                })
                .collect();
            publish_v311(port, &m)
        }
        _ => publish_v5(port, &msgs(prefix, n)),
    };
    let sentinel = move |port: u16| match protocol {
        Protocol::V311 => publish_v311(
            port,
            &[(
                "acks/m".to_owned(),
                Envelope::new(SENTINEL, b"s".to_vec()).encode(),
            )],
        ),
        _ => sentinel_v5(port),
    };
    init_log();
    let mut c = consumer(&db, cfg());
    let stop = c.stop_handle();
    let runner = std::thread::spawn(move || {
        c.run(
            move |tx: &mut edge_inbox::Tx<'_>, d: &edge_inbox::Delivery<'_>| {
                count_handler(tx, d)?;
                if d.message_id == SENTINEL {
                    stop.stop();
                }
                Ok(())
            },
        )
        .unwrap()
    });
    let sent_to = format!("Sending PUBLISH to {client_id} ");
    let suback = format!("Sending SUBACK to {client_id}");
    let subscribed = common::wait_for(Duration::from_secs(30), || {
        broker.log().contains(&suback).then_some(())
    });
    assert!(subscribed.is_some(), "the consumer never subscribed");

    // A burst the consumer gets only together with the end of its connection.
    proxy.hold.store(true, Ordering::SeqCst);
    let n_old = 10;
    publish(broker.port, "old", n_old);
    let held = common::wait_for(Duration::from_secs(30), || {
        (broker.log().matches(&sent_to).count() >= n_old).then_some(())
    });
    assert!(held.is_some(), "the broker did not send the burst");
    broker.kill();
    let log_before = broker.log().len();
    proxy.hold.store(false, Ordering::SeqCst);
    broker.start_again();

    let resubscribed = common::wait_for(Duration::from_secs(60), || {
        let log = broker.log();
        log[log_before.min(log.len())..]
            .contains(&suback)
            .then_some(())
    });
    assert!(
        resubscribed.is_some(),
        "the consumer did not subscribe again"
    );
    let n_new = 30;
    publish(broker.port, "new", n_new);
    sentinel(broker.port);
    let summary = runner.join().unwrap();

    let applied = applied(&db);
    for i in 0..n_new {
        assert_eq!(
            applied.get(&format!("new-{i}")),
            Some(&1),
            "new-{i}: {summary:?}"
        );
    }
    assert!(
        applied.values().all(|&c| c == 1),
        "applied twice: {applied:?}"
    );

    // The broker's view of the new connection: one PUBACK per PUBLISH sent, for that PUBLISH, in order.
    let log = broker.log();
    let log = &log[log_before.min(log.len())..];
    let mut sent: std::collections::VecDeque<u16> = Default::default();
    let from = format!("Received PUBACK from {client_id} ");
    let mid = |l: &str, key: &str| -> u16 {
        let at = l.find(key).unwrap() + key.len();
        l[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap()
    };
    for line in log.lines() {
        if line.contains(&sent_to) {
            sent.push_back(mid(line, ", m"));
        } else if line.contains(&from) {
            let acked = mid(line, "Mid: ");
            assert_eq!(
                sent.pop_front(),
                Some(acked),
                "a PUBACK for mid {acked} that the broker did not expect next ({summary:?}): {line}"
            );
        }
    }
}

fn v311_no_ack_crosses_a_broker_restart_without_persistence() {
    cut_after_a_burst(Protocol::V311, "acks-cut-v4");
}

fn v5_no_ack_crosses_a_broker_restart_without_persistence() {
    cut_after_a_burst(Protocol::V5, "acks-cut-v5");
}

fn a_filter_added_between_runs_is_subscribed_on_a_kept_session() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    prime(&db, mqtt(&broker, "acks-filters", Protocol::V5));
    // The same session, now with a second filter; the sentinel is published on it.
    let cfg = mqtt(&broker, "acks-filters", Protocol::V5).subscribe("extra/#");
    let port = broker.port;
    // The subscription is made on connect: publish once the broker has a subscriber for the new filter.
    let publisher = std::thread::spawn(move || {
        for _ in 0..600 {
            publish_v5(port, &[Msg::new("extra/x", Some(SENTINEL), "s")]);
            std::thread::sleep(Duration::from_millis(100));
            if DONE.load(Ordering::SeqCst) == 1 {
                return;
            }
        }
    });
    static DONE: AtomicU64 = AtomicU64::new(0);
    let s = run_until_sentinel(&db, cfg, || ());
    DONE.store(1, Ordering::SeqCst);
    publisher.join().unwrap();
    assert!(s.processed >= 1, "{s:?}");
}

fn a_handler_that_ends_the_transaction_is_dead_lettered_and_the_stream_moves_on() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let cfg = || mqtt(&broker, "acks-fatal", Protocol::V5);
    prime(&db, cfg());
    let mut batch = msgs("ok", 5);
    batch.insert(2, Msg::new("acks/m", Some("poison"), "p"));
    batch.push(Msg::new("acks/m", Some(SENTINEL), "s"));
    publish_v5(broker.port, &batch);

    let mut c = consumer(&db, cfg());
    let stop = c.stop_handle();
    // Bounds a stream stalled on the poison (its batch retried forever): stopped, nothing more is settled.
    let watchdog = c.stop_handle();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(60));
        watchdog.stop();
    });
    let s = c
        .run(
            move |tx: &mut edge_inbox::Tx<'_>, d: &edge_inbox::Delivery<'_>| {
                if d.message_id == "poison" {
                    // A deterministic failure: the same delivery would end the transaction at every attempt.
                    tx.sql().execute_batch("ROLLBACK")?;
                    return Ok(());
                }
                count_handler(tx, d)?;
                if d.message_id == SENTINEL {
                    stop.stop();
                }
                Ok(())
            },
        )
        .unwrap();
    assert_eq!(s.dead_lettered, 1, "{s:?}");
    let inbox = Inbox::open(&db, Config::default()).unwrap();
    let dead = inbox.dead_letters(SCOPE, 10).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message_id, "poison");
    assert!(
        dead[0]
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("ended"),
        "{dead:?}"
    );
    let applied = applied(&db);
    assert_eq!(applied.len(), 6, "{applied:?}");
    assert!(!applied.contains_key("poison"));
    assert_eq!(s.acked, 7, "{s:?}");
}

/// The TCP sockets of this process connected to `port`, with their `TCP_NODELAY` setting.
fn sockets_to(port: u16) -> Vec<(std::net::SocketAddr, bool)> {
    use std::os::fd::{BorrowedFd, RawFd};
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let is_socket = std::fs::read_link(entry.path())
            .map(|l| l.to_string_lossy().starts_with("socket:"))
            .unwrap_or(false);
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|f| f.parse::<RawFd>().ok())
        else {
            continue;
        };
        if !is_socket {
            continue;
        }
        // SAFETY: an fd of this process, listed a moment ago; only duplicated, and the copy is closed below.
        let Ok(owned) = unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned() else {
            continue;
        };
        let stream = std::net::TcpStream::from(owned);
        if let (Ok(peer), Ok(local), Ok(nodelay)) =
            (stream.peer_addr(), stream.local_addr(), stream.nodelay())
        {
            if peer.port() == port && local.port() != port {
                out.push((local, nodelay));
            }
        }
    }
    out
}

/// The PUBACKs of a batch go out back to back once it commits. With Nagle's algorithm on, every one after the
/// first waits until the broker's host acknowledges the first at the TCP level, which a quiet broker delays
/// by up to 40 ms (delayed ACK): the tail of every batch's latency. The consumer's socket turns it off.
fn the_consumers_connection_sends_its_acks_without_nagles_delay(protocol: Protocol) {
    init_log();
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let id = format!("nodelay-{protocol:?}");
    let config = mqtt(&broker, &id, protocol);
    prime(&db, config.clone());
    let mut c = consumer(&db, config);
    let stop = c.stop_handle();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    let port = broker.port;
    match protocol {
        Protocol::V5 => publish_v5(port, &msgs("nodelay", 1)),
        _ => publish_v311(
            port,
            &[(
                "acks/m".to_owned(),
                Envelope::new("nodelay-0", b"0".to_vec()).encode(),
            )],
        ),
    }
    let s = c
        .run(
            move |_: &mut edge_inbox::Tx<'_>, _: &edge_inbox::Delivery<'_>| {
                *seen2.lock().unwrap() = sockets_to(port);
                stop.stop();
                Ok(())
            },
        )
        .unwrap();
    assert_eq!(s.processed, 1, "{s:?}");
    let seen = seen.lock().unwrap();
    assert!(!seen.is_empty(), "no connection to the broker found");
    assert!(
        seen.iter().all(|&(_, nodelay)| nodelay),
        "sockets to the broker with Nagle's algorithm on: {seen:?}"
    );
}

fn v311_the_consumers_connection_sends_its_acks_without_nagles_delay() {
    the_consumers_connection_sends_its_acks_without_nagles_delay(Protocol::V311)
}

fn v5_the_consumers_connection_sends_its_acks_without_nagles_delay() {
    the_consumers_connection_sends_its_acks_without_nagles_delay(Protocol::V5)
}

fn main() {
    broker::run_tests(&[
        (
            "v311_the_consumers_connection_sends_its_acks_without_nagles_delay",
            v311_the_consumers_connection_sends_its_acks_without_nagles_delay,
            Needs::AnyBroker,
        ),
        (
            "v5_the_consumers_connection_sends_its_acks_without_nagles_delay",
            v5_the_consumers_connection_sends_its_acks_without_nagles_delay,
            Needs::AnyBroker,
        ),
        (
            "a_stop_from_the_handler_mid_batch_acks_the_whole_batch",
            a_stop_from_the_handler_mid_batch_acks_the_whole_batch,
            Needs::AnyBroker,
        ),
        (
            "a_stop_from_the_handler_at_the_last_delivery_acks_the_whole_batch",
            a_stop_from_the_handler_at_the_last_delivery_acks_the_whole_batch,
            Needs::AnyBroker,
        ),
        (
            "a_stop_from_another_thread_mid_flood_leaves_nothing_committed_unacked",
            a_stop_from_another_thread_mid_flood_leaves_nothing_committed_unacked,
            Needs::AnyBroker,
        ),
        (
            "sigterm_to_inventory_run_mid_flood_acks_what_it_committed",
            sigterm_to_inventory_run_mid_flood_acks_what_it_committed,
            Needs::AnyBroker,
        ),
        (
            "v311_no_ack_crosses_a_broker_restart_without_persistence",
            v311_no_ack_crosses_a_broker_restart_without_persistence,
            Needs::Mosquitto,
        ),
        (
            "v5_no_ack_crosses_a_broker_restart_without_persistence",
            v5_no_ack_crosses_a_broker_restart_without_persistence,
            Needs::Mosquitto,
        ),
        (
            "a_filter_added_between_runs_is_subscribed_on_a_kept_session",
            a_filter_added_between_runs_is_subscribed_on_a_kept_session,
            Needs::AnyBroker,
        ),
        (
            "a_handler_that_ends_the_transaction_is_dead_lettered_and_the_stream_moves_on",
            a_handler_that_ends_the_transaction_is_dead_lettered_and_the_stream_moves_on,
            Needs::AnyBroker,
        ),
    ])
}
