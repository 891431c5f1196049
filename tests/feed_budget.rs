//! The memory budget of a `Feed` (`ConsumerCore::spawn`): what the application's event loop hands over and
//! the commit thread has not committed stays within it, and a handler that panics while it is full lets the
//! waiting reader go.
#![cfg(feature = "mqtt")]

use std::time::{Duration, Instant};

use edge_inbox::{Config, ConsumerCore, Delivery, Inbound, Inbox, Tx};

#[test]
fn a_panicking_handler_lets_a_reader_waiting_for_room_in_the_budget_go() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("a.db"), Config::default()).unwrap();
    let handler = |_: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        // Long enough for the reader to fill the budget behind this delivery.
        std::thread::sleep(Duration::from_millis(300));
        panic!("bad payload {}", d.message_id);
    };
    // A real client whose requests nobody reads (no broker is needed: nothing is acked before the panic).
    let options = rumqttc::v5::MqttOptions::new("never-connected", "127.0.0.1", 1);
    let (client, _eventloop) = rumqttc::v5::Client::new(options, 10);
    let (mut feed, commits) = ConsumerCore::new(inbox, "commands")
        .spawn(handler, client, 20)
        .unwrap();

    let reader = std::thread::spawn(move || {
        feed.connected(false).unwrap();
        // 1 MiB deliveries: the default budget of 2 MiB is full after the first few.
        for i in 0..16 {
            let inbound = Inbound::new("cmd/a", vec![b'x'; 1 << 20])
                .with_user_property("message-id", format!("m-{i}"));
            if feed.publish(inbound, Some(i + 1)).is_err() {
                return Some(i);
            }
        }
        None
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while !reader.is_finished() {
        assert!(
            Instant::now() < deadline,
            "the reader still waits for room in the budget after the handler panicked"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Let go, the reader either finds the feed closed or hands over the rest to a commit thread that is
    // already unwinding: nothing of it is committed or acked either way.
    let _closed_at = reader.join().unwrap();
    let joined = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| commits.join()));
    assert!(joined.is_err(), "the handler's panic reaches the joiner");
}

/// The budget set on the core bounds what is held between `Feed::publish` and the commit, and the run's
/// summary reports the peak.
#[test]
fn the_cores_memory_budget_bounds_what_the_feed_holds() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("b.db"), Config::default()).unwrap();
    let handler = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        std::thread::sleep(Duration::from_millis(2));
        tx.put(d.message_id, &1u8)?;
        Ok(())
    };
    let options = rumqttc::v5::MqttOptions::new("never-connected", "127.0.0.1", 1);
    let (client, _eventloop) = rumqttc::v5::Client::new(options, 10);
    let budget = 64 << 10;
    let (mut feed, commits) = ConsumerCore::new(inbox, "telemetry")
        .memory_budget(budget)
        .spawn(handler, client, 20)
        .unwrap();
    feed.connected(false).unwrap();
    let n = 200;
    for i in 0..n {
        // QoS 0 (no packet id): nothing to ack, so no broker is needed.
        let inbound = Inbound::new("t/a", vec![b'x'; 16 << 10])
            .with_user_property("message-id", format!("t-{i}"));
        feed.publish(inbound, None).unwrap();
    }
    drop(feed);
    let (_, summary) = commits.join();
    let summary = summary.unwrap();
    assert_eq!(summary.processed, n, "{summary:?}");
    let one = (16 << 10) + 1024;
    assert!(
        summary.peak_held_bytes > 0 && summary.peak_held_bytes <= (budget + one) as u64,
        "held {} bytes at most with a budget of {budget}",
        summary.peak_held_bytes
    );
}

/// Acks that never find room in the client's request channel (nobody polls this client: it holds 4) are
/// counted as left unacked when the feed closes: every committed delivery is acked or counted.
#[test]
fn acks_without_room_when_the_feed_closes_are_counted_as_left_unacked() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("c.db"), Config::default()).unwrap();
    let handler = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        tx.put(d.message_id, &1u8)?;
        Ok(())
    };
    let options = rumqttc::v5::MqttOptions::new("never-polled", "127.0.0.1", 1);
    let (client, _eventloop) = rumqttc::v5::Client::new(options, 4);
    let (mut feed, commits) = ConsumerCore::new(inbox, "commands")
        .spawn(handler, client, 100)
        .unwrap();
    feed.connected(false).unwrap();
    for i in 0..50u16 {
        let inbound =
            Inbound::new("cmd/a", b"x".to_vec()).with_user_property("message-id", format!("c-{i}"));
        feed.publish(inbound, Some(i + 1)).unwrap();
    }
    drop(feed);
    let (_, summary) = commits.join();
    let summary = summary.unwrap();
    assert_eq!(
        (summary.processed, summary.acked, summary.dropped_stale),
        (50, 4, 46),
        "{summary:?}"
    );
}

/// Pass-throughs (QoS1 publishes of the application's other topics) hold room in the budget until the commit
/// loop takes them: a flood of them behind a handler that is busy stops the reader, instead of piling up in
/// the loop's channel, and it goes on once the handler returns.
#[test]
fn pass_throughs_behind_a_busy_handler_wait_for_room_in_the_budget() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("d.db"), Config::default()).unwrap();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let go_rx = Mutex::new(go_rx);
    let handler = move |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        // Bounded: a test that fails still ends.
        let _ = go_rx.lock().unwrap().recv_timeout(Duration::from_secs(60));
        tx.put(d.message_id, &1u8)?;
        Ok(())
    };
    // Nobody polls this client: the acks wait in the core, as runs of packet ids.
    let options = rumqttc::v5::MqttOptions::new("never-polled", "127.0.0.1", 1);
    let (client, _eventloop) = rumqttc::v5::Client::new(options, 10);
    let budget = 16 << 10;
    // Batches of one: the loop commits the first delivery, and so calls the handler, as soon as it has it.
    let (mut feed, commits) = ConsumerCore::new(inbox, "commands")
        .memory_budget(budget)
        .batch(1, Duration::ZERO)
        .spawn(handler, client, 20)
        .unwrap();
    let total = 100_000usize;
    let handed = Arc::new(AtomicUsize::new(0));
    let counter = handed.clone();
    let reader = std::thread::spawn(move || {
        feed.connected(false).unwrap();
        let inbound =
            Inbound::new("cmd/a", b"x".to_vec()).with_user_property("message-id", "first");
        feed.publish(inbound, Some(1)).unwrap();
        for i in 0..total {
            feed.pass_through(2 + (i % 60_000) as u16).unwrap();
            counter.fetch_add(1, Ordering::Relaxed);
        }
        feed
    });
    // Until the reader stops handing over (a slow machine takes longer to fill the budget).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut held = 0;
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = handed.load(Ordering::Relaxed);
        if (now == held && now > 0) || now == total || Instant::now() >= deadline {
            held = now;
            break;
        }
        held = now;
    }
    assert!(
        !reader.is_finished(),
        "{total} pass-throughs were handed over behind a busy handler"
    );
    assert!(
        held > 0 && held < 1000,
        "{held} pass-throughs in a budget of {budget} bytes"
    );

    go_tx.send(()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !reader.is_finished() {
        assert!(
            Instant::now() < deadline,
            "the reader still waits after the handler returned"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut feed = reader.join().unwrap();
    assert_eq!(handed.load(Ordering::Relaxed), total);
    // The acks of this connection are then stale: the loop drops them instead of waiting for room.
    feed.lost(|| {}).unwrap();
    drop(feed);
    let (_, summary) = commits.join();
    let summary = summary.unwrap();
    assert_eq!(summary.processed, 1, "{summary:?}");
    assert!(
        summary.peak_held_bytes <= budget as u64 + 1024,
        "peak {} over a budget of {budget}",
        summary.peak_held_bytes
    );
}

/// A batch given up on (its storage stayed busy past the retry limit) is counted among the deliveries left
/// unacked, with those behind it: every delivery is processed, acked or counted as left.
#[test]
fn a_batch_given_up_on_counts_as_left_unacked() {
    use edge_inbox::{AckGate, Error};

    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("e.db");
    let inbox = Inbox::open(
        &db,
        Config::default().busy_timeout(Duration::from_millis(20)),
    )
    .unwrap();
    let gate = AckGate::new();
    let mut core = ConsumerCore::new(inbox, "commands")
        .batch(2, Duration::ZERO)
        .storage_retry_limit(Duration::from_millis(200))
        .gate(gate.clone());
    let c = gate.connected();
    core.connected(c, false);
    for i in 0..3u16 {
        let inbound =
            Inbound::new("cmd/a", b"x".to_vec()).with_user_property("message-id", format!("e-{i}"));
        core.push(c, inbound, Some(i + 1));
    }
    // Another writer holds the file: every commit is busy.
    let lock = rusqlite::Connection::open(&db).unwrap();
    lock.execute_batch("BEGIN IMMEDIATE").unwrap();
    let mut handler = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        tx.put(d.message_id, &1u8)?;
        Ok(())
    };
    match core.settle(&mut handler) {
        Err(Error::Busy { .. }) => {}
        other => panic!("expected the busy error, got {other:?}"),
    }
    lock.execute_batch("ROLLBACK").unwrap();
    let s = core.summary();
    assert_eq!(
        (s.received, s.processed, s.acked, s.dropped_stale),
        (3, 0, 0, 3),
        "{s:?}"
    );
}
