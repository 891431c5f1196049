//! The tokio entry points: `AsyncFeed` never blocks the runtime (current-thread), an application's own
//! MQTT 3.1.1 `AsyncClient` fed through it on a multi-thread runtime, and `Consumer::run_until` on a
//! current-thread runtime, stopped by a cancellation future or by dropping it.
#![cfg(feature = "tokio")]

mod broker;
mod common;

use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use broker::{publish_v311, publish_v5, Broker, Msg};
use edge_inbox::{
    AsyncFeed, Config, Consumer, ConsumerCore, Delivery, Envelope, Inbound, Inbox, MqttConfig, Tx,
};

const SCOPE: &str = "tokio-commands";

fn count(tx: &mut Tx<'_>, _d: &Delivery<'_>) -> anyhow::Result<()> {
    let n: i64 = tx.get("count")?.unwrap_or(0);
    tx.put("count", &(n + 1))?;
    Ok(())
}

/// The handler's count, read from the file.
fn applied(db: &Path) -> i64 {
    let conn = rusqlite::Connection::open(db).unwrap();
    let blob: Option<Vec<u8>> = conn
        .query_row(
            "SELECT value FROM kv WHERE ns = ?1 AND key = 'count'",
            [SCOPE],
            |r| r.get(0),
        )
        .ok();
    blob.map(|b| ciborium::from_reader(&b[..]).unwrap())
        .unwrap_or(0)
}

/// Resolves once the handler has applied `n` commands (bounded: panics after a minute).
async fn applied_reaches(db: &Path, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while applied(db) < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} applied",
            applied(db)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A runtime that, when a test fails, is leaked instead of waiting for the blocking pool: a run that a
/// broken stop never ends must fail the test, not hang it.
struct Rt(Option<tokio::runtime::Runtime>);

impl std::ops::Deref for Rt {
    type Target = tokio::runtime::Runtime;
    fn deref(&self) -> &tokio::runtime::Runtime {
        self.0.as_ref().unwrap()
    }
}

impl Drop for Rt {
    fn drop(&mut self) {
        let rt = self.0.take().unwrap();
        if std::thread::panicking() {
            std::mem::forget(rt);
        } else {
            rt.shutdown_timeout(Duration::from_secs(10));
        }
    }
}

fn current_thread() -> Rt {
    Rt(Some(
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap(),
    ))
}

/// The commit thread's handler waits for a task of the (single-threaded) runtime, while the feeding task
/// hands over far more than the feed's channel holds: with a feed that blocked its thread when full, that
/// task could never run.
#[test]
fn async_feed_hands_over_without_blocking_a_current_thread_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("a.db"), Config::default()).unwrap();
    let entered = Arc::new(AtomicBool::new(false));
    let released = Arc::new(AtomicBool::new(false));
    let timed_out = Arc::new(AtomicBool::new(false));
    let handler = {
        let (entered, released, timed_out) = (entered.clone(), released.clone(), timed_out.clone());
        move |tx: &mut Tx<'_>, d: &Delivery<'_>| {
            entered.store(true, Ordering::SeqCst);
            let deadline = Instant::now() + Duration::from_secs(20);
            while !released.load(Ordering::SeqCst) {
                if Instant::now() >= deadline {
                    timed_out.store(true, Ordering::SeqCst);
                    released.store(true, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            count(tx, d)
        }
    };
    // A real client whose requests nobody reads: QoS0 deliveries are never acked.
    let options = rumqttc::v5::MqttOptions::new("never-connected", "127.0.0.1", 1);
    let (client, _eventloop) = rumqttc::v5::AsyncClient::new(options, 10);
    let (feed, commits) = ConsumerCore::new(inbox, SCOPE)
        .spawn(handler, client, 20)
        .unwrap();

    let summary = current_thread().block_on(async move {
        let release = {
            let (entered, released) = (entered.clone(), released.clone());
            tokio::spawn(async move {
                while !entered.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                released.store(true, Ordering::SeqCst);
            })
        };
        let mut feed = AsyncFeed::new(feed);
        feed.connected(false).await.unwrap();
        for i in 0..300 {
            let inbound = Inbound::new("cmd/a", format!("{i}"))
                .with_user_property("message-id", format!("m-{i}"));
            feed.publish(inbound, None).await.unwrap();
        }
        // A dropped feed ends the commit thread once everything handed over is committed.
        drop(feed);
        let (_core, result) = commits.join_until(std::future::pending()).await;
        release.await.unwrap();
        result.unwrap()
    });
    assert!(
        !timed_out.load(Ordering::SeqCst),
        "the releasing task could not run while the feed was full"
    );
    assert_eq!(summary.processed, 300, "{summary:?}");
    assert_eq!(applied(&dir.path().join("a.db")), 300);
}

/// An application's own MQTT 3.1.1 `AsyncClient`, its event loop polled by a task of a multi-thread
/// runtime and fed through an `AsyncFeed`: subscribes at every CONNACK, then `stop` decides when
/// `join_until` stops the commit thread; the DISCONNECT goes behind its acks. Gives the inbox back.
async fn own_v311_connection(
    port: u16,
    inbox: Inbox,
    client_id: &str,
    stop: impl Future<Output = ()> + Send + 'static,
    idle: Option<Duration>,
) -> (Inbox, edge_inbox::RunSummary) {
    use rumqttc::{AsyncClient, Event, Incoming, MqttOptions, QoS};
    const MAX: usize = edge_inbox::DEFAULT_MAX_PACKET as usize;
    let mut options = MqttOptions::new(client_id, "127.0.0.1", port);
    options
        .set_clean_session(false)
        .set_manual_acks(true)
        .set_keep_alive(Duration::from_secs(30))
        .set_max_packet_size(MAX, MAX);
    let (client, mut eventloop) = AsyncClient::new(options, 64);
    let mut core = ConsumerCore::new(inbox, SCOPE).with_envelope();
    if let Some(idle) = idle {
        core = core.exit_when_idle(idle);
    }
    // 20: the broker's inflight window (tests/broker starts mosquitto with max_inflight_messages 20).
    let (feed, commits) = core.spawn(count, client.clone(), 20).unwrap();
    let mut feed = AsyncFeed::new(feed);
    let stopped = Arc::new(AtomicBool::new(false));
    let shutdown = {
        let (client, stopped) = (client.clone(), stopped.clone());
        tokio::spawn(async move {
            let (core, result) = commits.join_until(stop).await;
            stopped.store(true, Ordering::SeqCst);
            let _ = client.disconnect().await;
            (core, result)
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "the connection did not end");
        let event = match tokio::time::timeout(Duration::from_secs(1), eventloop.poll()).await {
            Ok(e) => e,
            Err(_) if shutdown.is_finished() => break,
            Err(_) => continue,
        };
        match event {
            Ok(Event::Incoming(Incoming::ConnAck(ack))) => {
                let _ = feed.connected(ack.session_present).await;
                client.try_subscribe("cmd311/#", QoS::AtLeastOnce).unwrap();
            }
            Ok(Event::Incoming(Incoming::Publish(p))) if !stopped.load(Ordering::SeqCst) => {
                let _ = feed.publish_v311(p).await;
            }
            Ok(_) => {}
            Err(_) => {
                let _ = feed.lost_v311(&mut eventloop).await;
                if stopped.load(Ordering::SeqCst) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    drop(feed);
    let (core, result) = shutdown.await.unwrap();
    (core.into_inbox(), result.unwrap())
}

#[test]
fn async_feed_over_an_own_v311_async_client_acks_what_it_committed_when_cancelled() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("b.db");
    let rt = Rt(Some(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap(),
    ));
    let inbox = Inbox::open(&db, Config::default()).unwrap();
    let idle = Some(Duration::from_secs(1));
    // The session and its subscription, before anything is published.
    let (inbox, _) = rt.block_on(own_v311_connection(
        broker.port,
        inbox,
        "own311",
        std::future::pending(),
        idle,
    ));
    let n = common::scaled(200) as i64;
    let msgs: Vec<(String, Vec<u8>)> = (0..n)
        .map(|i| {
            let body = Envelope::new(format!("c-{i}"), format!("{i}").into_bytes()).encode();
            (format!("cmd311/{i}"), body)
        })
        .collect();
    publish_v311(broker.port, &msgs);
    // Stopped by the cancellation future once everything is applied (no idle limit): the last acks are
    // written before the DISCONNECT.
    let done = {
        let db = db.clone();
        async move { applied_reaches(&db, n).await }
    };
    let (inbox, s) = rt.block_on(own_v311_connection(
        broker.port,
        inbox,
        "own311",
        done,
        None,
    ));
    assert_eq!(s.processed as i64, n, "{s:?}");
    let (_, s) = rt.block_on(own_v311_connection(
        broker.port,
        inbox,
        "own311",
        std::future::pending(),
        idle,
    ));
    assert_eq!((s.processed, s.duplicates), (0, 0), "all acked: {s:?}");
    assert_eq!(applied(&db), n);
}

fn consumer(db: &Path, port: u16) -> Consumer {
    let inbox = Inbox::open(db, Config::default()).unwrap();
    let mqtt = MqttConfig::new("127.0.0.1", port, "run-until").subscribe("cmd5/#");
    Consumer::new(inbox, SCOPE, mqtt)
}

fn commands(n: i64) -> Vec<Msg> {
    (0..n)
        .map(|i| Msg::new(&format!("cmd5/{i}"), Some(&format!("c-{i}")), "{}"))
        .collect()
}

#[test]
fn consumer_run_until_on_a_current_thread_runtime_stops_on_cancel_and_acks_what_it_committed() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("c.db");
    let rt = current_thread();
    // The session, before anything is published: an idle run.
    let idle = consumer(&db, broker.port).exit_when_idle(Duration::from_secs(1));
    let (idle, r) = rt.block_on(idle.run_until(count, std::future::pending()));
    r.unwrap();
    drop(idle);

    let n = common::scaled(100) as i64;
    publish_v5(broker.port, &commands(n));
    // No idle limit: only the cancellation ends this run.
    let running = consumer(&db, broker.port);
    let done = applied_reaches(&db, n);
    let (running, r) = rt
        .block_on(async {
            tokio::time::timeout(Duration::from_secs(60), running.run_until(count, done)).await
        })
        .expect("the cancellation did not stop the run");
    let s = r.unwrap();
    assert_eq!(s.processed as i64, n, "{s:?}");

    // The consumer given back runs again (the cancelled run's stop is spent), and finds everything acked.
    let again = running.exit_when_idle(Duration::from_secs(1));
    let (_, r) = rt.block_on(again.run_until(count, std::future::pending()));
    let s = r.unwrap();
    assert!(
        s.connections >= 1,
        "the consumer given back did not run again: {s:?}"
    );
    assert_eq!((s.processed, s.duplicates), (0, 0), "all acked: {s:?}");
}

#[test]
fn dropping_consumer_run_until_stops_the_run() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("d.db");
    let rt = current_thread();
    let alive = Arc::new(());
    let handler = {
        let alive = alive.clone();
        move |tx: &mut Tx<'_>, d: &Delivery<'_>| {
            let _ = &alive;
            count(tx, d)
        }
    };
    let running = consumer(&db, broker.port);
    rt.block_on(async {
        let run = running.run_until(handler, std::future::pending());
        // Dropped while it runs (no idle limit, no cancellation): the drop stops it.
        assert!(tokio::time::timeout(Duration::from_millis(500), run)
            .await
            .is_err());
    });
    // The handler is dropped when the run, on the blocking pool, has ended.
    let ended = common::wait_for(Duration::from_secs(60), || {
        (Arc::strong_count(&alive) == 1).then_some(())
    });
    assert!(
        ended.is_some(),
        "the run went on after its future was dropped"
    );
}

/// An `AsyncFeed::lost` dropped while the event before it is still being handed over (a `select!` that chose
/// another branch, a timeout) has ended the connection at the gate all the same: no ack of that connection
/// can be queued for the client to write on the next one.
#[test]
fn a_lost_call_dropped_before_it_returns_still_ends_the_connection_at_the_gate() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("lost.db"), Config::default()).unwrap();
    let released = Arc::new(AtomicBool::new(false));
    let handler = held_until(&released);
    let options = rumqttc::v5::MqttOptions::new("never-connected", "127.0.0.1", 1);
    let (client, _eventloop) = rumqttc::v5::AsyncClient::new(options, 10);
    let (feed, commits) = ConsumerCore::new(inbox, SCOPE)
        .memory_budget(4 << 10)
        .spawn(handler, client, 20)
        .unwrap();

    let summary = current_thread().block_on(async move {
        let mut feed = AsyncFeed::new(feed);
        let connection = feed.connected(false).await.unwrap();
        assert_eq!(feed.gate().current(), Some(connection));
        // The handler holds the first delivery: publish until a hand-over waits for room in the budget.
        let mut waiting = false;
        for i in 0..100u16 {
            let inbound = Inbound::new("cmd/a", vec![b'x'; 1024])
                .with_user_property("message-id", format!("m-{i}"));
            let publish = feed.publish(inbound, Some(i + 1));
            // A hand-over with room takes far less, under emulation too; one without room never ends.
            if tokio::time::timeout(Duration::from_secs(2), publish)
                .await
                .is_err()
            {
                waiting = true;
                break;
            }
        }
        assert!(waiting, "no hand-over waited for room in a budget of 4 KiB");
        // The connection fails, and the application gives up waiting for `lost`.
        let lost = tokio::time::timeout(Duration::from_millis(100), feed.lost(|| {})).await;
        assert!(
            lost.is_err(),
            "lost returned while the event before it was still in flight"
        );
        assert_eq!(
            feed.gate().current(),
            None,
            "the gate still takes acks of a connection that has ended"
        );
        released.store(true, Ordering::SeqCst);
        feed.lost(|| {}).await.unwrap();
        drop(feed);
        let (_core, result) = commits.join_until(std::future::pending()).await;
        result.unwrap()
    });
    assert!(summary.processed > 0, "{summary:?}");
    assert_eq!(summary.acked, 0, "{summary:?}");
}

/// A handler that waits until `released` (bounded, so a failing test still ends), then counts.
fn held_until(
    released: &Arc<AtomicBool>,
) -> impl FnMut(&mut Tx<'_>, &Delivery<'_>) -> anyhow::Result<()> + Send + 'static {
    let released = released.clone();
    move |tx: &mut Tx<'_>, d: &Delivery<'_>| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !released.load(Ordering::SeqCst) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        count(tx, d)
    }
}

/// A commit thread over a new inbox at `db`, a budget of 4 KiB, a handler held until the flag is set, and
/// acks recorded.
fn held_core(
    db: &Path,
) -> (
    edge_inbox::Feed,
    edge_inbox::CommitThread,
    Arc<AtomicBool>,
    common::SentAcks,
) {
    let inbox = Inbox::open(db, Config::default()).unwrap();
    let released = Arc::new(AtomicBool::new(false));
    let sent = common::SentAcks::default();
    let (feed, commits) = ConsumerCore::new(inbox, SCOPE)
        .memory_budget(4 << 10)
        .spawn(held_until(&released), sent.clone(), 100)
        .unwrap();
    (feed, commits, released, sent)
}

fn command(i: u16) -> Inbound {
    Inbound::new("cmd/a", vec![b'x'; 1024]).with_user_property("message-id", format!("m-{i}"))
}

/// Publishes until a hand-over waits for room in the budget (the handler holds the first delivery); returns
/// the packet id of the one left waiting, whose call was dropped.
async fn fill_budget(feed: &mut AsyncFeed) -> u16 {
    for id in 1..100u16 {
        // A hand-over with room takes far less, under emulation too; one without room never ends.
        let publish = feed.publish(command(id), Some(id));
        if tokio::time::timeout(Duration::from_secs(2), publish)
            .await
            .is_err()
        {
            return id;
        }
    }
    panic!("no hand-over waited for room in the budget");
}

/// Calls dropped while the event before them still waits for room in the budget (a timeout, a `select!`),
/// one of them never polled, still hand their events over, in order: the PUBACKs skip no arrival.
#[test]
fn calls_dropped_behind_a_waiting_event_still_hand_theirs_over_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let (feed, commits, released, sent) = held_core(&dir.path().join("dropped.db"));
    let last = current_thread().block_on(async move {
        let mut feed = AsyncFeed::new(feed);
        feed.connected(false).await.unwrap();
        let waiting = fill_budget(&mut feed).await;
        let dropped = tokio::time::timeout(
            Duration::from_millis(100),
            feed.publish(command(waiting + 1), Some(waiting + 1)),
        )
        .await;
        assert!(dropped.is_err(), "a call behind a waiting one returned");
        drop(feed.publish(command(waiting + 2), Some(waiting + 2)));
        released.store(true, Ordering::SeqCst);
        let last = waiting + 3;
        feed.publish(command(last), Some(last)).await.unwrap();
        drop(feed);
        let (_core, result) = commits.join_until(std::future::pending()).await;
        result.unwrap();
        last
    });
    sent.wait_for(usize::from(last));
    assert_eq!(sent.all(), (1..=last).collect::<Vec<_>>());
    assert_eq!(applied(&dir.path().join("dropped.db")), i64::from(last));
}

/// `connected` and `lost` calls dropped before they were first polled: the loss ended the connection at the
/// gate when it was called, and a CONNACK handed over after a loss taken behind it does not open the gate
/// again, so only the connection after them takes acks.
#[test]
fn connection_calls_dropped_unpolled_still_take_effect_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let (feed, commits, released, sent) = held_core(&dir.path().join("unpolled.db"));
    let summary = current_thread().block_on(async move {
        let mut feed = AsyncFeed::new(feed);
        let first = feed.connected(false).await.unwrap();
        drop(feed.lost(|| {}));
        assert_eq!(
            feed.gate().current(),
            None,
            "an unpolled lost left the gate open"
        );
        // A CONNACK, then its connection's loss, both dropped behind a hand-over that waits for room.
        drop(feed.connected(true));
        feed.subscribed().await.unwrap();
        let _ = feed.publish(command(1), Some(1)).await;
        let waiting = fill_budget(&mut feed).await;
        assert!(waiting > 1);
        drop(feed.connected(true));
        drop(feed.lost(|| {}));
        released.store(true, Ordering::SeqCst);
        let third = feed.connected(true).await.unwrap();
        assert!(third > first);
        assert_eq!(feed.gate().current(), Some(third));
        for id in 500..505u16 {
            feed.publish(command(id), Some(id)).await.unwrap();
        }
        drop(feed);
        let (_core, result) = commits.join_until(std::future::pending()).await;
        result.unwrap()
    });
    sent.wait_for(5);
    assert_eq!(sent.all(), (500..505).collect::<Vec<_>>(), "{summary:?}");
}
