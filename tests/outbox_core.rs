//! The outbox in the core, against real SQLite files: rows commit and abort with the delivery, ids are
//! stable across attempts, input is validated, backlog and pruning count what they should.

use std::time::Duration;

use anyhow::bail;
use edge_inbox::rusqlite::Connection;
use edge_inbox::{
    outbox_message_id, Config, Delivery, Error, Inbox, Limits, OutboxProperties, Outcome, Pruning,
    Qos, Tx, Worker, WorkerConfig,
};

const SCOPE: &str = "inventory-reservation";

fn open(dir: &tempfile::TempDir) -> Inbox {
    Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap()
}

/// Reserves and announces it twice (two outbox messages per delivery).
fn reserve_and_publish(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let n: i64 = tx.get("reserved")?.unwrap_or(0);
    tx.put("reserved", &(n + 1))?;
    tx.publish(
        "stock/reserved",
        d.payload,
        Qos::AtLeastOnce,
        &OutboxProperties::new().content_type("application/json"),
    )?;
    tx.publish(
        "audit/reserved",
        d.message_id.as_bytes(),
        Qos::AtMostOnce,
        &OutboxProperties::new(),
    )?;
    Ok(())
}

/// (producer, message_id, topic, payload, qos, state) in seq order.
type Row = (String, String, String, Vec<u8>, i64, i64);

fn rows(conn: &Connection) -> Vec<Row> {
    let mut stmt = conn
        .prepare("SELECT producer, message_id, topic, payload, qos, state FROM outbox ORDER BY seq")
        .unwrap();
    stmt.query_map([], |r| {
        Ok((
            r.get(0)?,
            r.get(1)?,
            r.get(2)?,
            r.get(3)?,
            r.get(4)?,
            r.get(5)?,
        ))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

#[test]
fn publish_commits_with_the_effect_with_derived_ids_and_the_scope_as_producer() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir);
    let d = Delivery::new(SCOPE, "evt-1", "orders/1", b"{\"order\":1}");
    assert!(matches!(
        inbox.process(&d, reserve_and_publish).unwrap(),
        Outcome::Processed
    ));
    let got = rows(inbox.connection());
    assert_eq!(
        got,
        vec![
            (
                SCOPE.to_string(),
                outbox_message_id(SCOPE, None, "evt-1", 0),
                "stock/reserved".to_string(),
                b"{\"order\":1}".to_vec(),
                1,
                0
            ),
            (
                SCOPE.to_string(),
                outbox_message_id(SCOPE, None, "evt-1", 1),
                "audit/reserved".to_string(),
                b"evt-1".to_vec(),
                0,
                0
            ),
        ]
    );
    let b = inbox.outbox_backlog().unwrap();
    assert_eq!((b.pending, b.sent), (2, 0));
    assert!(b.oldest_pending_age.is_some());
}

#[test]
fn a_rolled_back_handler_leaves_no_outbox_row_and_a_duplicate_adds_none() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir);
    let d = Delivery::new(SCOPE, "evt-2", "orders/2", b"x");
    let failing = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        reserve_and_publish(tx, d)?;
        bail!("out of stock")
    };
    assert!(matches!(
        inbox.process(&d, failing).unwrap(),
        Outcome::HandlerFailed(_)
    ));
    assert!(
        rows(inbox.connection()).is_empty(),
        "rolled back with the effect"
    );
    assert_eq!(inbox.outbox_backlog().unwrap().pending, 0);

    // The retry writes exactly the ids the failed attempt would have written.
    assert!(matches!(
        inbox.process(&d, reserve_and_publish).unwrap(),
        Outcome::Processed
    ));
    let first = rows(inbox.connection());
    assert_eq!(first.len(), 2);
    assert_eq!(first[0].1, outbox_message_id(SCOPE, None, "evt-2", 0));

    // A redelivery is a duplicate: the handler does not run, no row is added.
    assert!(matches!(
        inbox.process(&d, reserve_and_publish).unwrap(),
        Outcome::Duplicate
    ));
    // In a batch too, where the second copy is a duplicate of the first.
    let e = Delivery::new(SCOPE, "evt-3", "orders/3", b"y");
    let out = inbox
        .process_batch(&[e, e, d], reserve_and_publish)
        .unwrap();
    assert!(matches!(
        out[..],
        [Outcome::Processed, Outcome::Duplicate, Outcome::Duplicate]
    ));
    assert_eq!(rows(inbox.connection()).len(), 4);
}

#[test]
fn ids_are_the_same_in_another_database_and_differ_per_delivery_scope_and_producer() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (mut x, mut y) = (open(&a), open(&b));
    let d = Delivery::new(SCOPE, "evt-9", "orders/9", b"z").with_producer("shop-1");
    x.process(&d, reserve_and_publish).unwrap();
    y.process(&d, reserve_and_publish).unwrap();
    let (rx, ry) = (rows(x.connection()), rows(y.connection()));
    assert_eq!(rx, ry, "derived from the delivery, not from time or chance");
    let ids = [
        outbox_message_id(SCOPE, Some("shop-1"), "evt-9", 0),
        outbox_message_id(SCOPE, None, "evt-9", 0),
        outbox_message_id("other-scope", Some("shop-1"), "evt-9", 0),
        outbox_message_id(SCOPE, Some("shop-1"), "evt-8", 0),
        outbox_message_id(SCOPE, Some("shop-1"), "evt-9", 1),
    ];
    assert_eq!(rx[0].1, ids[0]);
    let distinct: std::collections::BTreeSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len());
}

#[test]
fn configured_producer_namespace_is_stamped_on_each_row() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(
        dir.path().join("inbox.db"),
        Config::default().outbox_producer("gw-7"),
    )
    .unwrap();
    inbox
        .process(
            &Delivery::new(SCOPE, "evt-1", "orders/1", b"x"),
            reserve_and_publish,
        )
        .unwrap();
    let got = rows(inbox.connection());
    assert!(got.iter().all(|r| r.0 == "gw-7"), "{got:?}");
    assert_eq!(
        inbox
            .outbox_status("gw-7", &outbox_message_id(SCOPE, None, "evt-1", 0))
            .unwrap(),
        Some(false)
    );
}

#[test]
fn invalid_messages_are_refused_with_clear_errors_and_roll_back() {
    let dir = tempfile::tempdir().unwrap();
    let limits = Limits {
        max_payload_len: 16,
        max_topic_len: 20,
        ..Limits::default()
    };
    let mut inbox = Inbox::open(
        dir.path().join("inbox.db"),
        Config::default().limits(limits),
    )
    .unwrap();
    let cases: Vec<(&str, Vec<u8>, OutboxProperties, &str)> = vec![
        ("", vec![], OutboxProperties::new(), "topic is empty"),
        (
            "stock/+/reserved",
            vec![],
            OutboxProperties::new(),
            "wildcard",
        ),
        ("stock/#", vec![], OutboxProperties::new(), "wildcard"),
        (
            "stock",
            vec![],
            OutboxProperties::new().response_topic("replies/+"),
            "response topic \"replies/+\" is empty or contains a wildcard",
        ),
        (
            "stock",
            vec![],
            OutboxProperties::new().response_topic(""),
            "response topic \"\" is empty",
        ),
        (
            "stock",
            vec![],
            OutboxProperties::new().user_property("note", "a\0b"),
            "contains NUL",
        ),
        (
            "stock",
            vec![],
            OutboxProperties::new().content_type("x".repeat(70_000)),
            "over 65535 bytes",
        ),
        (
            "stock/a-very-long-topic-name",
            vec![],
            OutboxProperties::new(),
            "over the limit of 20",
        ),
        (
            "stock",
            vec![0; 17],
            OutboxProperties::new(),
            "payload is 17 bytes, over the limit of 16",
        ),
        (
            "stock",
            vec![],
            OutboxProperties::new().user_property("message-id", "mine"),
            "reserved",
        ),
        // Brokers take these as malformed and close the connection.
        (
            "st\u{1}ck",
            vec![],
            OutboxProperties::new(),
            "a control character",
        ),
        (
            "stock",
            vec![],
            OutboxProperties::new().user_property("note", "a\u{85}b"),
            "a control character",
        ),
        (
            "stock",
            vec![],
            OutboxProperties::new().content_type("text/\u{fffe}"),
            "a Unicode non-character",
        ),
    ];
    for (i, (topic, payload, props, expected)) in cases.into_iter().enumerate() {
        let id = format!("evt-{i}");
        let d = Delivery::new(SCOPE, &id, "orders", b"x");
        let mut seen = None;
        let outcome = inbox
            .process(&d, |tx: &mut Tx<'_>, _d: &Delivery<'_>| {
                tx.put("touched", &1)?;
                let err = tx
                    .publish(topic, &payload, Qos::AtLeastOnce, &props)
                    .unwrap_err();
                assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
                seen = Some(err.to_string());
                Err(err.into())
            })
            .unwrap();
        assert!(matches!(outcome, Outcome::HandlerFailed(_)));
        let msg = seen.unwrap();
        assert!(msg.contains(expected), "{topic:?}: {msg}");
    }
    assert!(rows(inbox.connection()).is_empty());
}

#[test]
fn an_explicit_id_is_used_as_given_and_may_not_be_reused() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir);
    let with_id = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        tx.publish_with_id(
            "reservation-42",
            "stock/reserved",
            d.payload,
            Qos::AtLeastOnce,
            &OutboxProperties::new(),
        )?;
        Ok(())
    };
    inbox
        .process(&Delivery::new(SCOPE, "evt-1", "orders/1", b"a"), with_id)
        .unwrap();
    let out = inbox
        .process(&Delivery::new(SCOPE, "evt-2", "orders/2", b"b"), with_id)
        .unwrap();
    let Outcome::HandlerFailed(e) = out else {
        panic!("{out:?}")
    };
    assert!(e.to_string().contains("already in the outbox"), "{e}");
    let got = rows(inbox.connection());
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].1.as_str(), &got[0].3[..]),
        ("reservation-42", &b"a"[..])
    );
}

#[test]
fn deferred_worker_handlers_publish_with_ids_derived_from_the_stored_message() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir);
    let d = Delivery::new(SCOPE, "evt-5", "orders/5", b"p").with_producer("shop");
    inbox.receive(&d).unwrap();
    let mut worker = Worker::new(open(&dir), SCOPE, WorkerConfig::default()).unwrap();
    let drained = worker.run_once(&mut reserve_and_publish).unwrap();
    assert_eq!(drained.processed, 1);
    let got = rows(inbox.connection());
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].1, outbox_message_id(SCOPE, Some("shop"), "evt-5", 0));
}

/// Processes deliveries `evt-0` .. `evt-{n-1}`, each publishing two outbox messages.
fn publish_each(inbox: &mut Inbox, n: usize) {
    for i in 0..n {
        let id = format!("evt-{i}");
        inbox
            .process(
                &Delivery::new(SCOPE, &id, "orders", b"x"),
                reserve_and_publish,
            )
            .unwrap();
    }
}

#[test]
fn prune_outbox_deletes_only_sent_rows_older_than_asked() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir);
    publish_each(&mut inbox, 5);
    // As the relay would after PUBACKs: the first four rows were confirmed, two of them long ago.
    let conn = inbox.connection();
    conn.execute(
        "UPDATE outbox SET state = 1, sent_at = unixepoch() - 7200 WHERE seq IN (1, 2)",
        [],
    )
    .unwrap();
    // A minute ahead: "older than nothing" below must not catch them when the clock's second turns.
    conn.execute(
        "UPDATE outbox SET state = 1, sent_at = unixepoch() + 60 WHERE seq IN (3, 4)",
        [],
    )
    .unwrap();
    let b = inbox.outbox_backlog().unwrap();
    assert_eq!((b.pending, b.sent), (6, 4));
    assert_eq!(inbox.prune_outbox(Duration::from_secs(3600)).unwrap(), 2);
    let b = inbox.outbox_backlog().unwrap();
    assert_eq!((b.pending, b.sent), (6, 2));
    // Even "older than nothing" never deletes a pending row.
    assert_eq!(inbox.prune_outbox(Duration::ZERO).unwrap(), 0);
    inbox
        .connection()
        .execute("UPDATE outbox SET sent_at = sent_at - 65", [])
        .unwrap();
    assert_eq!(inbox.prune_outbox(Duration::ZERO).unwrap(), 2);
    assert_eq!(inbox.outbox_backlog().unwrap().pending, 6);
}

#[test]
fn a_full_disk_while_publishing_fails_the_batch_even_when_the_handler_swallows_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir);
    // Warm up: every table has its pages, so only the large message needs new ones.
    inbox
        .process(
            &Delivery::new(SCOPE, "warm", "orders", b"x"),
            reserve_and_publish,
        )
        .unwrap();
    let pages: i64 = inbox
        .connection()
        .query_row("PRAGMA page_count", [], |r| r.get(0))
        .unwrap();
    inbox
        .connection()
        .query_row(&format!("PRAGMA max_page_count = {pages}"), [], |_| Ok(()))
        .unwrap();
    let swallowing = |tx: &mut Tx<'_>, _d: &Delivery<'_>| -> anyhow::Result<()> {
        let _ = tx.publish(
            "stock/reserved",
            &vec![7u8; 64 * 1024],
            Qos::AtLeastOnce,
            &OutboxProperties::new(),
        );
        Ok(())
    };
    let d = Delivery::new(SCOPE, "evt-full", "orders", b"x");
    assert!(matches!(
        inbox.process(&d, swallowing),
        Err(Error::DiskFull)
    ));
    inbox
        .connection()
        .query_row("PRAGMA max_page_count = 1000000", [], |_| Ok(()))
        .unwrap();
    assert_eq!(rows(inbox.connection()).len(), 2, "only the warm-up's");
    // The redelivery is new, not a duplicate, and writes its message.
    assert!(matches!(
        inbox.process(&d, reserve_and_publish).unwrap(),
        Outcome::Processed
    ));
    assert_eq!(rows(inbox.connection()).len(), 4);
}

/// A prune pass deletes outbox messages the broker confirmed more than `Pruning::sent_outbox` ago (7 days by
/// default), in steps: the outbox no longer grows with every message a gateway ever sent. Pending and parked
/// messages stay, and `sent_outbox(None)` keeps the sent ones too.
#[test]
fn a_prune_pass_deletes_sent_outbox_messages_past_their_age_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir);
    publish_each(&mut inbox, 40);
    let total = inbox.outbox_backlog().unwrap().pending;
    assert_eq!(total, 80);
    let day = 86_400;
    let conn = inbox.connection();
    // The file stands for one created a month ago: a row cannot have been sent before the file existed.
    conn.execute(
        "UPDATE inbox_meta SET value = unixepoch() - 31 * ?1 WHERE name = 'created_at'",
        [day],
    )
    .unwrap();
    // Sent 8 days ago (due), sent 6 days ago (kept), parked 30 days ago, and the rest pending.
    conn.execute(
        "UPDATE outbox SET state = 1, sent_at = unixepoch() - 8 * ?1 WHERE seq <= 50",
        [day],
    )
    .unwrap();
    conn.execute(
        "UPDATE outbox SET state = 1, sent_at = unixepoch() - 6 * ?1 WHERE seq > 50 AND seq <= 60",
        [day],
    )
    .unwrap();
    conn.execute(
        "UPDATE outbox SET state = 2, sent_at = unixepoch() - 30 * ?1 WHERE seq > 60 AND seq <= 65",
        [day],
    )
    .unwrap();

    // Marked sent while the clock read 1970 (a gateway without a real-time clock): aged from the pass, not
    // deleted on the bad time.
    conn.execute(
        "UPDATE outbox SET state = 1, sent_at = 1000 WHERE seq > 65 AND seq <= 67",
        [],
    )
    .unwrap();

    let kept = inbox.prune(&Pruning::default().sent_outbox(None)).unwrap();
    assert_eq!(kept.outbox_pruned, 0);
    assert_eq!(inbox.outbox_backlog().unwrap().sent, 62);

    // In steps of a batch (32 by default): 32, then 18.
    let mut per_step = Vec::new();
    loop {
        let step = inbox.prune_step(&Pruning::default()).unwrap();
        if step.outbox_pruned > 0 {
            per_step.push(step.outbox_pruned);
        }
        if step.done {
            break;
        }
    }
    assert_eq!(per_step, [32, 18]);
    let b = inbox.outbox_backlog().unwrap();
    assert_eq!((b.sent, b.parked, b.pending), (12, 5, 13), "{b:?}");
}
