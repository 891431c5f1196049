//! The relay on mosquitto specifically: a restart with persistence, and an ACL that refuses a topic.
use std::time::Duration;

use crate::broker::Broker;
use crate::outbox_support::relay::{commit, commit_routed, first_seen, relay, SCOPE};
use crate::outbox_support::Subscriber;
use edge_inbox::{
    outbox_message_id, Config, Inbox, MqttConfig, OutboxProperties, Relay, RelayConfig,
};

pub fn rows_wait_while_the_broker_is_away_and_drain_in_order_when_it_returns() {
    let mut broker = Broker::mosquitto();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let sub = Subscriber::start(broker.port, "outbox-sub-down", "stock/#");
    let mut inbox = Inbox::open(&db, Config::default()).unwrap();
    let relay = relay(&db, broker.port);

    commit(&mut inbox, "a", 10);
    let drained = crate::common::wait_for(Duration::from_secs(30), || {
        let b = inbox.outbox_backlog().unwrap();
        (b.pending == 0 && sub.ids().len() == 10).then_some(())
    });
    assert!(drained.is_some(), "first batch not relayed");

    broker.stop();
    let n = crate::common::scaled(200);
    commit(&mut inbox, "b", n);
    // The relay keeps trying, with backoff, and marks nothing while the broker is away.
    let failures_before = relay.stats().connection_failures;
    let retried = crate::common::wait_for(Duration::from_secs(30), || {
        (relay.stats().connection_failures >= failures_before + 3).then_some(())
    });
    assert!(
        retried.is_some(),
        "relay stopped retrying: {:?}",
        relay.stats()
    );
    let b = inbox.outbox_backlog().unwrap();
    assert_eq!((b.pending, b.sent), (n as u64, 10), "rows wait, none lost");
    assert!(b.oldest_pending_age.is_some());

    broker.restart();
    let drained = crate::common::wait_for(Duration::from_secs(60), || {
        let b = inbox.outbox_backlog().unwrap();
        (b.pending == 0 && first_seen(&sub, "b-").len() == n).then_some(())
    });
    assert!(
        drained.is_some(),
        "backlog after the broker came back: {:?}, {} of {n} received",
        inbox.outbox_backlog(),
        first_seen(&sub, "b-").len()
    );
    let stats = relay.stop();
    assert!(stats.connections >= 2, "{stats:?}");
    let expected: Vec<String> = (0..n).map(|i| format!("b-{i}")).collect();
    assert_eq!(first_seen(&sub, "b-"), expected, "drained in commit order");
    for (id, payloads) in sub.payloads_by_id() {
        assert_eq!(payloads.len(), 1, "one payload per id: {id}");
    }
    let b = inbox.outbox_backlog().unwrap();
    assert_eq!((b.pending, b.sent), (0, 10 + n as u64));
}

pub fn a_message_the_broker_keeps_refusing_is_parked_and_the_rest_go_on() {
    let broker = Broker::start_with_acl("topic readwrite stock/#\n");
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let sub = Subscriber::start(broker.port, "outbox-sub-acl", "stock/#");
    let mut inbox = Inbox::open(&db, Config::default()).unwrap();
    // The first one goes to a topic the broker's ACL denies.
    commit_routed(&mut inbox, SCOPE, &["p-0", "p-1", "p-2"], |id| {
        let topic = if id == "p-0" {
            "denied/x"
        } else {
            "stock/reserved"
        };
        (topic.to_owned(), OutboxProperties::new())
    });
    let relay = Relay::start_with(
        Inbox::open(&db, Config::default()).unwrap(),
        MqttConfig::new("127.0.0.1", broker.port, "outbox-relay-acl"),
        RelayConfig::default()
            .max_backoff(Duration::from_millis(200))
            .max_refusals(2),
    )
    .unwrap();
    let done = crate::common::wait_for(Duration::from_secs(30), || {
        let b = inbox.outbox_backlog().unwrap();
        (b.parked == 1 && b.pending == 0 && b.sent == 2).then_some(b)
    });
    let stats = relay.stop();
    assert!(done.is_some(), "{:?} {stats:?}", inbox.outbox_backlog());
    assert!(stats.refused >= 2, "{stats:?}");
    assert_eq!(first_seen(&sub, "p-"), ["p-1", "p-2"]);
    let parked = outbox_message_id(SCOPE, None, "p-0", 0);
    assert_eq!(inbox.outbox_status(SCOPE, &parked).unwrap(), Some(false));
    // Kept for an operator, who puts it back once the cause is fixed.
    assert_eq!(inbox.requeue_parked_outbox().unwrap(), 1);
    let b = inbox.outbox_backlog().unwrap();
    assert_eq!((b.parked, b.pending, b.refusals), (0, 1, 0));
}
