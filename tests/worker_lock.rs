//! The deferred worker bounds how long it holds the write lock, so a consumer receiving on the same file
//! keeps committing (and so acking) while slow handlers run.

mod broker;
mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use edge_inbox::{Config, Delivery, Inbox, Outcome, Tx, Worker, WorkerConfig};

/// A worker on `path` whose every handler run takes 200 ms under the write lock, until `stop`.
fn slow_worker(
    path: &std::path::Path,
    stop: &Arc<AtomicBool>,
    handled: &Arc<AtomicUsize>,
) -> std::thread::JoinHandle<edge_inbox::Result<edge_inbox::Drained>> {
    let (stop, handled, path) = (stop.clone(), handled.clone(), path.to_owned());
    std::thread::spawn(move || {
        let mut w =
            Worker::open(&path, Config::default(), "slow", WorkerConfig::default()).unwrap();
        w.run_until(&stop, &mut |tx: &mut Tx<'_>, _d: &Delivery<'_>| {
            std::thread::sleep(Duration::from_millis(200));
            let n: i64 = tx.get("n")?.unwrap_or(0);
            tx.put("n", &(n + 1))?;
            handled.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    })
}

#[test]
fn slow_handlers_never_make_the_receiving_side_busy() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    // A receiver that gives up after 1 s of waiting for the write lock.
    let mut receiver = Inbox::open(
        &path,
        Config::default().busy_timeout(Duration::from_secs(1)),
    )
    .unwrap();
    const BACKLOG: usize = 10;
    for i in 0..BACKLOG {
        let id = format!("old-{i}");
        assert!(matches!(
            receiver
                .receive(&Delivery::new("slow", &id, "t", b"x"))
                .unwrap(),
            Outcome::Received
        ));
    }

    let stop = Arc::new(AtomicBool::new(false));
    let handled = Arc::new(AtomicUsize::new(0));
    let worker = slow_worker(&path, &stop, &handled);

    // Receive new deliveries the whole time the worker drains the backlog; every one must commit.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut received = 0;
    let mut failures = Vec::new();
    while handled.load(Ordering::SeqCst) < BACKLOG {
        assert!(
            Instant::now() < deadline,
            "the worker did not drain the backlog"
        );
        let id = format!("new-{received}");
        match receiver.receive(&Delivery::new("slow", &id, "t", b"y")) {
            Ok(o) => assert!(o.may_ack(), "{o:?}"),
            Err(e) => failures.push(format!("{id}: {e}")),
        }
        received += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::SeqCst);
    worker.join().unwrap().unwrap();
    assert!(
        failures.is_empty(),
        "receives that failed while the worker ran: {failures:?}"
    );
    assert!(received > 0);
}

#[test]
fn a_receive_only_consumer_keeps_acking_while_slow_handlers_run() {
    use broker::{publish_v5, Broker, Msg};
    use edge_inbox::{BacklogThreshold, Consumer, MqttConfig};

    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    const BACKLOG: usize = 10;
    for i in 0..BACKLOG {
        let id = format!("old-{i}");
        inbox
            .receive(&Delivery::new("slow", &id, "t", b"x"))
            .unwrap();
    }
    let receiving = Inbox::open(
        &path,
        Config::default().busy_timeout(Duration::from_secs(1)),
    )
    .unwrap();
    let mqtt = MqttConfig::new("127.0.0.1", broker.port, "lock-receiver").subscribe("orders/#");
    let mut consumer = Consumer::new(receiving, "slow", mqtt)
        .batch(1, Duration::from_millis(1))
        .receive_only(BacklogThreshold::default());
    let consumer_stop = consumer.stop_handle();
    let never = |_: &mut Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> {
        panic!("the handler is not called in receive-only mode")
    };
    let consumer = std::thread::spawn(move || consumer.run(never));
    let count = |prefix: &str| -> usize {
        inbox
            .connection()
            .query_row(
                "SELECT count(*) FROM messages WHERE message_id LIKE ?1 || '%'",
                [prefix],
                |r| r.get::<_, i64>(0),
            )
            .unwrap() as usize
    };
    // Subscribed once a probe is stored (publishes before the subscription reach nobody).
    let mut probes = 0;
    let subscribed = common::wait_for(Duration::from_secs(30), || {
        probes += 1;
        let id = format!("probe-{probes}");
        publish_v5(
            broker.port,
            &[Msg::new("orders/0", Some(&id), b"p".to_vec())],
        );
        std::thread::sleep(Duration::from_millis(50));
        (count("probe-") > 0).then_some(())
    });
    assert!(subscribed.is_some(), "the consumer did not subscribe");

    let stop = Arc::new(AtomicBool::new(false));
    let handled = Arc::new(AtomicUsize::new(0));
    let worker = slow_worker(&path, &stop, &handled);

    // Deliveries keep arriving while the worker drains the backlog.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut published = 0;
    while handled.load(Ordering::SeqCst) < BACKLOG {
        assert!(
            Instant::now() < deadline,
            "the worker did not drain the backlog"
        );
        let id = format!("new-{published}");
        publish_v5(
            broker.port,
            &[Msg::new("orders/1", Some(&id), b"y".to_vec())],
        );
        published += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    // Every one of them stored (so acked), a positive signal.
    let mut seen = 0;
    let stored = common::wait_for(Duration::from_secs(30), || {
        seen = count("new-");
        (seen == published).then_some(())
    });
    consumer_stop.stop();
    let summary = consumer.join().unwrap().unwrap();
    stop.store(true, Ordering::SeqCst);
    worker.join().unwrap().unwrap();
    assert!(
        stored.is_some(),
        "{seen} of {published} deliveries stored: {summary:?}"
    );
    assert_eq!(
        summary.storage_errors, 0,
        "the receiving side ran into the lock: {summary:?}"
    );
    let probes = count("probe-") as u64;
    assert_eq!(
        (summary.stored, summary.acked),
        (published as u64 + probes, published as u64 + probes),
        "{summary:?}"
    );
}
