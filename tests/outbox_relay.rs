//! The relay against a real broker (mosquitto or the embedded one: see `broker`): properties and ids on the
//! wire. A broker that goes away while rows are committed needs a mosquitto restart: see `mosquitto_only`.
#![cfg(feature = "mqtt")]

mod broker;
mod common;
mod outbox_support;

use std::time::Duration;

use broker::Broker;
use edge_inbox::{outbox_message_id, Config, Inbox};
use outbox_support::relay::{commit, first_seen, relay, SCOPE};
use outbox_support::Subscriber;

#[test]
fn messages_carry_their_id_producer_and_properties_and_are_marked_sent_after_the_puback() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let sub = Subscriber::start(broker.port, "outbox-sub-props", "stock/#");
    let mut inbox = Inbox::open(&db, Config::default()).unwrap();
    commit(&mut inbox, "a", 5);
    let relay = relay(&db, broker.port);
    let done = common::wait_for(Duration::from_secs(30), || {
        (inbox.outbox_backlog().unwrap().pending == 0 && sub.ids().len() == 5).then_some(())
    });
    assert!(
        done.is_some(),
        "not drained: {:?}, {} received",
        inbox.outbox_backlog(),
        sub.count()
    );
    let stats = relay.stop();
    assert!(stats.confirmed >= 5 && stats.marked >= 5, "{stats:?}");
    for g in sub.got() {
        let p = String::from_utf8(g.payload.clone()).unwrap();
        assert_eq!(g.topic, "stock/reserved");
        assert_eq!(
            g.message_id.as_deref(),
            Some(outbox_message_id(SCOPE, None, &p, 0).as_str())
        );
        assert_eq!(g.producer.as_deref(), Some(SCOPE));
        assert_eq!(g.content_type.as_deref(), Some("text/plain"));
        assert!(g
            .user_properties
            .contains(&("order".to_string(), p.clone())));
    }
    assert_eq!(first_seen(&sub, "a-"), ["a-0", "a-1", "a-2", "a-3", "a-4"]);
    let b = inbox.outbox_backlog().unwrap();
    assert_eq!((b.pending, b.sent, b.oldest_pending_age), (0, 5, None));
    for i in 0..5 {
        let id = outbox_message_id(SCOPE, None, &format!("a-{i}"), 0);
        assert_eq!(inbox.outbox_status(SCOPE, &id).unwrap(), Some(true));
    }
}
