//! Receive side of the received-then-deferred mode, against a real database file.

mod deferred_support;

use deferred_support::*;
use edge_inbox::{
    Delivery, Error, MessageState, Outcome, RetentionPolicy, Status, Worker, WorkerConfig,
};

#[test]
fn receive_stores_pending_and_redelivery_is_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    let d = Delivery::new(SCOPE, "evt-1", "orders/1", b"{\"qty\":1}").with_producer("shop");

    assert!(matches!(inbox.receive(&d).unwrap(), Outcome::Received));
    assert!(inbox.receive(&d).unwrap().may_ack());
    // Stored, not applied: the state says pending and no effect exists.
    match inbox.status(SCOPE, Some("shop"), "evt-1").unwrap() {
        Status::Recorded { state, .. } => assert_eq!(state, Some(MessageState::Pending)),
        other => panic!("expected recorded, got {other:?}"),
    }
    assert!(matches!(inbox.receive(&d).unwrap(), Outcome::Duplicate));
    assert_eq!(
        states(&inbox),
        [1, 0, 0, 0],
        "a redelivery adds no second body"
    );

    // Same id, other content: conflict, recorded and counted, nothing stored.
    let other = Delivery::new(SCOPE, "evt-1", "orders/1", b"{\"qty\":2}").with_producer("shop");
    match inbox.receive(&other).unwrap() {
        Outcome::Conflict { stored, received } => {
            assert_eq!(stored, d.fingerprint());
            assert_eq!(received, other.fingerprint());
        }
        o => panic!("expected conflict, got {o:?}"),
    }
    let conflicts: i64 = inbox
        .connection()
        .query_row("SELECT count(*) FROM conflicts", [], |r| r.get(0))
        .unwrap();
    assert_eq!(conflicts, 1);
    let stats = inbox.scope_stats(SCOPE).unwrap();
    assert_eq!(
        (stats.duplicates, stats.conflicts, stats.processed),
        (2, 1, 0)
    );
    assert_eq!(states(&inbox), [1, 0, 0, 0]);

    // Once processed, a redelivery is still a duplicate, and the status shows no open body: the effect is
    // committed (processed bodies are not looked up by id).
    let mut worker = Worker::new(open(&path), SCOPE, WorkerConfig::default()).unwrap();
    assert_eq!(worker.run_once(&mut count_effect).unwrap().processed, 1);
    assert!(matches!(inbox.receive(&d).unwrap(), Outcome::Duplicate));
    match inbox.status(SCOPE, Some("shop"), "evt-1").unwrap() {
        Status::Recorded { state, .. } => assert_eq!(state, None),
        other => panic!("expected recorded, got {other:?}"),
    }
    assert_eq!(effects(&inbox), (1, 1, 1));
    assert_eq!(inbox.scope_stats(SCOPE).unwrap().processed, 1);
}

#[test]
fn strong_case_identity_makes_receive_a_duplicate_and_vice_versa() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir.path().join("inbox.db"));
    let a = Delivery::new(SCOPE, "a", "t", b"x");
    assert!(matches!(
        inbox.process(&a, count_effect).unwrap(),
        Outcome::Processed
    ));
    assert!(matches!(inbox.receive(&a).unwrap(), Outcome::Duplicate));
    let b = Delivery::new(SCOPE, "b", "t", b"y");
    assert!(matches!(inbox.receive(&b).unwrap(), Outcome::Received));
    assert!(matches!(
        inbox.process(&b, count_effect).unwrap(),
        Outcome::Duplicate
    ));
    assert_eq!(
        effects(&inbox),
        (1, 1, 1),
        "only the strong-case delivery ran so far"
    );
}

#[test]
fn batch_outcomes_come_back_in_input_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir.path().join("inbox.db"));
    assert!(matches!(
        inbox
            .receive(&Delivery::new(SCOPE, "old", "t", b"1"))
            .unwrap(),
        Outcome::Received
    ));
    let batch = [
        Delivery::new(SCOPE, "new-1", "t", b"1"),
        Delivery::new(SCOPE, "old", "t", b"1"),
        Delivery::new(SCOPE, "new-1", "t", b"1"),
        Delivery::new(SCOPE, "old", "t", b"changed"),
        Delivery::new("other-scope", "old", "t", b"1"),
    ];
    let mut outcomes = Vec::new();
    inbox.receive_batch_into(&batch, &mut outcomes).unwrap();
    let names: Vec<_> = outcomes.iter().map(Outcome::name).collect();
    assert_eq!(
        names,
        ["received", "duplicate", "duplicate", "conflict", "received"]
    );
    assert_eq!(states(&inbox), [3, 0, 0, 0]);
    let stats = inbox.scope_stats(SCOPE).unwrap();
    assert_eq!((stats.duplicates, stats.conflicts), (2, 1));

    // Order keys must match the deliveries one to one; an invalid batch writes nothing.
    let err = inbox
        .receive_batch_ordered_into(&batch[..2], &[Some("k")], &mut outcomes)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let bad = [
        Delivery::new(SCOPE, "fresh", "t", b"1"),
        Delivery::new(SCOPE, "", "t", b"1"),
    ];
    assert!(matches!(
        inbox.receive_batch_into(&bad, &mut outcomes).unwrap_err(),
        Error::InvalidDelivery(_)
    ));
    assert!(outcomes.is_empty());
    assert_eq!(states(&inbox), [3, 0, 0, 0]);
    assert!(matches!(
        inbox.status(SCOPE, None, "fresh").unwrap(),
        Status::NotFound
    ));
}

#[test]
fn pending_messages_survive_reopen_and_are_processed_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    {
        let mut inbox = open(&path);
        receive_n(&mut inbox, 100);
        // Claimed by a worker that then goes away without applying anything.
        let mut worker = Worker::new(
            open(&path),
            SCOPE,
            WorkerConfig::default().lease(std::time::Duration::ZERO),
        )
        .unwrap();
        assert_eq!(worker.claim(10).unwrap().len(), 10);
    }
    let inbox = open(&path);
    let backlog = inbox.backlog(SCOPE).unwrap();
    assert_eq!(backlog.pending, 100);
    assert!(backlog.oldest_pending_age.is_some());
    assert_eq!(states(&inbox), [100, 0, 0, 0]);

    let mut worker = Worker::new(open(&path), SCOPE, WorkerConfig::default().batch(32)).unwrap();
    let mut total = 0;
    until("drain", std::time::Duration::from_secs(60), || {
        total += worker.run_once(&mut count_effect).unwrap().processed;
        total == 100
    });
    assert_eq!(effects(&inbox), (100, 100, 1));
    assert_eq!(states(&inbox), [0, 100, 0, 0]);
    let b = inbox.backlog(SCOPE).unwrap();
    assert_eq!(
        (b.pending, b.failed, b.in_flight, b.oldest_pending_age),
        (0, 0, 0, None)
    );
}

#[test]
fn backlog_reports_and_warns_past_threshold() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    assert_eq!(
        inbox.backlog(SCOPE).unwrap(),
        edge_inbox::Backlog::default()
    );
    receive_n(&mut inbox, 5);
    // Make the oldest message two hours old, as after a long outage of the workers.
    inbox
        .connection()
        .execute(
            "UPDATE messages SET received_at = received_at - 7200 WHERE message_id = 'm-0'",
            [],
        )
        .unwrap();
    let mut worker = Worker::new(open(&path), SCOPE, WorkerConfig::default()).unwrap();
    assert_eq!(worker.claim(2).unwrap().len(), 2);

    let b = inbox.backlog(SCOPE).unwrap();
    assert_eq!(
        (b.pending, b.in_flight, b.failed, b.dead_letters),
        (5, 2, 0, 0)
    );
    let age = b.oldest_pending_age.unwrap().as_secs();
    assert!((7200..7300).contains(&age), "age {age}");
    let threshold = edge_inbox::BacklogThreshold::default();
    assert!(b.exceeds(&threshold));
    assert!(!b.exceeds(&edge_inbox::BacklogThreshold {
        max_age: std::time::Duration::from_secs(86_400),
        max_open: None
    }));
    assert!(b.exceeds(&edge_inbox::BacklogThreshold {
        max_age: std::time::Duration::from_secs(86_400),
        max_open: Some(4)
    }));
    // Read again a moment later: the same counts, and an age that may have crossed one more second (under
    // qemu the two reads can straddle a second).
    let again = inbox.warn_if_backlogged(SCOPE, &threshold).unwrap();
    assert_eq!(
        (
            again.pending,
            again.in_flight,
            again.failed,
            again.dead_letters
        ),
        (b.pending, b.in_flight, b.failed, b.dead_letters)
    );
    let again_age = again.oldest_pending_age.unwrap().as_secs();
    assert!(
        (age..=age + 1).contains(&again_age),
        "age {again_age} after {age}"
    );
}

#[test]
fn order_key_is_validated() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir.path().join("inbox.db"));
    let d = Delivery::new(SCOPE, "a", "t", b"1");
    assert!(matches!(
        inbox.receive_ordered(&d, Some("")).unwrap_err(),
        Error::InvalidArgument(_)
    ));
    let long = "k".repeat(10_000);
    assert!(matches!(
        inbox.receive_ordered(&d, Some(&long)).unwrap_err(),
        Error::InvalidDelivery(_)
    ));
    assert!(matches!(
        inbox.status(SCOPE, None, "a").unwrap(),
        Status::NotFound
    ));
    assert!(matches!(
        inbox.receive_ordered(&d, Some("order-7")).unwrap(),
        Outcome::Received
    ));
    let key: Option<String> = inbox
        .connection()
        .query_row("SELECT order_key FROM messages", [], |r| r.get(0))
        .unwrap();
    assert_eq!(key.as_deref(), Some("order-7"));
}

#[test]
fn empty_payload_is_stored_and_processed_not_mistaken_for_pruned() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    let d = Delivery::new(SCOPE, "ping", "t/ping", b"")
        .with_sequence(7)
        .with_sent_at(1_700_000_000);
    assert!(matches!(inbox.receive(&d).unwrap(), Outcome::Received));
    let mut worker = Worker::new(open(&path), SCOPE, WorkerConfig::default()).unwrap();
    let mut seen = None;
    let drained = worker
        .run_once(&mut |tx: &mut edge_inbox::Tx<'_>, got: &Delivery<'_>| {
            seen = Some((got.payload.len(), got.sequence, got.sent_at));
            count_effect(tx, got)
        })
        .unwrap();
    assert_eq!(drained.processed, 1);
    assert_eq!(seen, Some((0, Some(7), Some(1_700_000_000))));
}

/// The inbox at `path`, its scope deduplicating numbered deliveries by sequence watermarks from 1.
fn open_watermarked(path: &std::path::Path) -> edge_inbox::Inbox {
    let mut inbox = open(path);
    inbox
        .set_retention(SCOPE, &RetentionPolicy::new().sequence_watermarks(1))
        .unwrap();
    inbox
}

/// A body kept pending or dead-lettered after its sequence left the watermark window has no identity of its
/// own. The same id arriving again with a new sequence meets the body, and is compared with it by content: a
/// conflict is recorded and answered as one (again at its next arrival), the same content is a duplicate.
#[test]
fn an_open_body_past_the_watermark_window_is_compared_by_content() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open_watermarked(&dir.path().join("inbox.db"));
    let numbered = |id: &'static str, producer: &'static str, seq: u64, payload: &'static [u8]| {
        Delivery::new(SCOPE, id, "orders/1", payload)
            .with_producer(producer)
            .with_sequence(seq)
    };
    let x = numbered("X", "p", 1, b"A");
    assert!(matches!(inbox.receive(&x).unwrap(), Outcome::Received));
    let y = numbered("Y", "q", 1, b"A");
    assert!(matches!(
        inbox.dead_letter(&y, "refused").unwrap(),
        Outcome::Processed
    ));
    // The window (128 sequences) slides past sequence 1 of both producers.
    let ids: Vec<String> = (2..=200u64).map(|i| format!("m{i}")).collect();
    for (i, id) in (2..=200u64).zip(&ids) {
        for producer in ["p", "q"] {
            let d = Delivery::new(SCOPE, id, "orders/1", b"z")
                .with_producer(producer)
                .with_sequence(i);
            assert!(matches!(inbox.receive(&d).unwrap(), Outcome::Received));
        }
    }
    let conflicts = |inbox: &edge_inbox::Inbox| -> i64 {
        inbox
            .connection()
            .query_row("SELECT count(*) FROM conflicts", [], |r| r.get(0))
            .unwrap()
    };

    let x_other = numbered("X", "p", 201, b"B");
    for arrival in 0..2 {
        match inbox.receive(&x_other).unwrap() {
            Outcome::Conflict { stored, received } => {
                assert_eq!(stored, x.fingerprint());
                assert_eq!(received, x_other.fingerprint());
            }
            o => panic!("arrival {arrival} of other content: expected a conflict, got {o:?}"),
        }
    }
    assert_eq!(conflicts(&inbox), 1, "one record, two arrivals");
    assert!(matches!(
        inbox.receive(&numbered("X", "p", 202, b"A")).unwrap(),
        Outcome::Duplicate
    ));

    // The dead letter's body the same way, through both entry points.
    let y_other = numbered("Y", "q", 201, b"B");
    assert!(matches!(
        inbox.receive(&y_other).unwrap(),
        Outcome::Conflict { .. }
    ));
    assert!(matches!(
        inbox
            .dead_letter(&numbered("Y", "q", 202, b"C"), "refused")
            .unwrap(),
        Outcome::Conflict { .. }
    ));
    assert!(matches!(
        inbox
            .dead_letter(&numbered("Y", "q", 203, b"A"), "refused")
            .unwrap(),
        Outcome::Duplicate
    ));
    assert_eq!(conflicts(&inbox), 3);

    // Nothing stored twice: X still pending once, Y dead-lettered once, beside the 398 others.
    assert_eq!(states(&inbox), [1 + 398, 0, 0, 1]);
    let stats = inbox.scope_stats(SCOPE).unwrap();
    assert_eq!((stats.duplicates, stats.conflicts), (2, 4));
}

/// A dead letter or a receive that meets an open body whose identity row was deleted gives the body its
/// identity back. Like every identity row not written by the strong case, that row is counted in the scope's
/// `identity_offset` (`schema.sql`), so that it does not count as processed.
#[test]
fn an_identity_given_back_to_an_open_body_is_counted_as_not_processed() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir.path().join("inbox.db"));
    for id in ["X", "Y"] {
        let d = Delivery::new(SCOPE, id, "orders/1", b"A");
        assert!(matches!(inbox.receive(&d).unwrap(), Outcome::Received));
    }
    inbox
        .connection()
        .execute_batch("DELETE FROM identities")
        .unwrap();
    let rows_and_offset = |inbox: &edge_inbox::Inbox| -> (i64, i64) {
        inbox
            .connection()
            .query_row(
                "SELECT (SELECT count(*) FROM identities), identity_offset FROM scope_stats",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap()
    };
    let (rows, offset) = rows_and_offset(&inbox);
    let x_other = Delivery::new(SCOPE, "X", "orders/1", b"B");
    assert!(matches!(
        inbox.dead_letter(&x_other, "refused").unwrap(),
        Outcome::Conflict { .. }
    ));
    assert_eq!(
        rows_and_offset(&inbox),
        (rows + 1, offset + 1),
        "dead letter"
    );
    let y = Delivery::new(SCOPE, "Y", "orders/1", b"A");
    assert!(matches!(inbox.receive(&y).unwrap(), Outcome::Duplicate));
    assert_eq!(rows_and_offset(&inbox), (rows + 2, offset + 2), "receive");
}

/// Identity rows of `scope`.
fn identity_rows(inbox: &edge_inbox::Inbox, scope: &str) -> i64 {
    inbox
        .connection()
        .query_row(
            "SELECT count(*) FROM identities WHERE scope_id = (SELECT id FROM scopes WHERE name = ?1)",
            [scope],
            |r| r.get(0),
        )
        .unwrap()
}

/// Runs a worker on `scope` until nothing is claimable; the messages it processed.
fn drain_scope(path: &std::path::Path, scope: &str) -> usize {
    let mut worker = Worker::new(open(path), scope, WorkerConfig::default()).unwrap();
    let mut processed = 0;
    until("drain", std::time::Duration::from_secs(60), || {
        let d = worker.run_once(&mut count_effect).unwrap();
        processed += d.processed;
        d.claimed == 0
    });
    processed
}

/// In a scope with sequence watermarks the watermark window is the identity of a numbered message, received
/// or dead-lettered by the strong-case path alike: applying them adds no identity row (the scope stays
/// O(producers)), and every redelivery after that, under its sequence or without one, is a duplicate.
#[test]
fn draining_a_watermark_scope_adds_no_identity_rows_and_redeliveries_stay_duplicates() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open_watermarked(&path);
    let ids: Vec<String> = (1..=20).map(|i| format!("evt-{i}")).collect();
    let unnumbered = |i: u64| {
        let id = ids[i as usize - 1].as_str();
        Delivery::new(SCOPE, id, "orders/1", id.as_bytes()).with_producer("p")
    };
    let numbered = |i: u64| unnumbered(i).with_sequence(i);
    // Out of order (20 waits as an exception), and 7 dead-lettered by the strong-case path, then requeued.
    for i in std::iter::once(20).chain(1..20) {
        let outcome = if i == 7 {
            inbox.dead_letter(&numbered(i), "refused").unwrap()
        } else {
            inbox.receive(&numbered(i)).unwrap()
        };
        assert!(outcome.may_ack(), "sequence {i}: {outcome:?}");
    }
    assert_eq!(inbox.requeue_dead_letters(SCOPE).unwrap(), 1);
    assert_eq!(drain_scope(&path, SCOPE), 20);
    assert_eq!(
        identity_rows(&inbox, SCOPE),
        0,
        "the watermark is the identity"
    );
    let mark = inbox.watermark(SCOPE, "p").unwrap();
    assert_eq!((mark.high, mark.exceptions.len()), (Some(20), 0));
    assert_eq!(inbox.scope_stats(SCOPE).unwrap().processed, 20);

    for i in 1..=20 {
        let outcome = inbox.receive(&numbered(i)).unwrap();
        assert!(matches!(outcome, Outcome::Duplicate), "{i}: {outcome:?}");
        let outcome = inbox.process(&numbered(i), count_effect).unwrap();
        assert!(matches!(outcome, Outcome::Duplicate), "{i}: {outcome:?}");
        let outcome = inbox.receive(&unnumbered(i)).unwrap();
        assert!(matches!(outcome, Outcome::Duplicate), "{i}: {outcome:?}");
    }
    assert_eq!(effects(&inbox), (20, 20, 1));
    assert_eq!(identity_rows(&inbox, SCOPE), 0);
}

/// The identity a worker does give back in a watermark scope: a body that outlived its sequence's place in
/// the window is held by nothing else, so it gets an identity row, and a redelivery under a new sequence or
/// without one is still a duplicate once it is applied.
#[test]
fn a_body_past_the_watermark_window_keeps_its_identity_through_the_worker() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open_watermarked(&path);
    let ids: Vec<String> = (1..=200).map(|i| format!("m{i}")).collect();
    for (i, id) in (1..=200u64).zip(&ids) {
        let d = Delivery::new(SCOPE, id, "orders/1", b"z")
            .with_producer("p")
            .with_sequence(i);
        assert!(matches!(inbox.receive(&d).unwrap(), Outcome::Received));
    }
    assert_eq!(drain_scope(&path, SCOPE), 200);
    // Sequences up to 200 - 128 left the window before they were applied.
    let outside = 200 - edge_inbox::SEQUENCE_WINDOW as i64;
    assert_eq!(identity_rows(&inbox, SCOPE), outside);
    let again = Delivery::new(SCOPE, "m1", "orders/1", b"z").with_producer("p");
    assert!(matches!(
        inbox.receive(&again.with_sequence(201)).unwrap(),
        Outcome::Duplicate
    ));
    assert!(matches!(inbox.receive(&again).unwrap(), Outcome::Duplicate));
    assert_eq!(effects(&inbox), (200, 200, 1));
}

/// Dated numbered deliveries in a watermark scope with an identity horizon: applied by a worker, they leave
/// the horizon nothing to prune, so the scope records no `pruned_before` and a new, out-of-order sequence is
/// taken as new, exactly as in a scope where the strong case processed the same traffic.
#[test]
fn a_drained_watermark_scope_gives_the_identity_horizon_nothing_to_prune() {
    const DAY: i64 = 86_400;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    let strong = "strong-case";
    let policy = RetentionPolicy::new()
        .sequence_watermarks(1)
        .identity_horizon(std::time::Duration::from_secs(DAY as u64));
    for scope in [SCOPE, strong] {
        inbox.set_retention(scope, &policy).unwrap();
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let ids: Vec<(String, String)> = (1..=5)
        .map(|i| (format!("deferred-{i}"), format!("strong-{i}")))
        .collect();
    let numbered = |scope: &'static str, i: u64| {
        let (deferred, strong) = &ids[i as usize - 1];
        let id = if scope == SCOPE { deferred } else { strong };
        Delivery::new(scope, id, "orders/1", b"{}")
            .with_producer("p")
            .with_sequence(i)
            .with_sent_at(now)
    };
    for i in 1..=3 {
        assert!(matches!(
            inbox.receive(&numbered(SCOPE, i)).unwrap(),
            Outcome::Received
        ));
        assert!(matches!(
            inbox.process(&numbered(strong, i), count_effect).unwrap(),
            Outcome::Processed
        ));
    }
    assert_eq!(drain_scope(&path, SCOPE), 3);
    inbox
        .prune(&edge_inbox::Pruning::default().as_of(now + 3 * DAY))
        .unwrap();
    // Sequence 5 was never seen (4 is still to come).
    let outcome = inbox.process(&numbered(strong, 5), count_effect).unwrap();
    assert!(matches!(outcome, Outcome::Processed), "{outcome:?}");
    let outcome = inbox.receive(&numbered(SCOPE, 5)).unwrap();
    assert!(matches!(outcome, Outcome::Received), "{outcome:?}");
    for scope in [SCOPE, strong] {
        assert_eq!(inbox.pruned_before(scope).unwrap(), None, "{scope}");
    }
}
