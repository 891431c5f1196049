//! A handler that panics while the memory budget is full: the side reading the connection, waiting in
//! `Feed::publish` for room, must be let go (and then finds the feed closed) instead of waiting for ever with
//! its socket and the deliveries it holds.
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
