//! The identity horizon: pruning identities is explicit and counted, never touches identities of pending or
//! failed work, and afterwards deliveries older than what was pruned follow the scope's expired policy.

use std::cell::Cell;
use std::time::Duration;

use edge_inbox::{
    Config, Delivery, ExpiredPolicy, Inbox, Outcome, Pruning, RetentionPolicy, Status,
};
use rusqlite::Connection;

const DAY: i64 = 86_400;

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn count(conn: &Connection, sql: &str) -> i64 {
    conn.query_row(sql, [], |r| r.get(0)).unwrap()
}

/// Moves the stored commit day of an identity into the past (as if it had been committed `days` ago), and the
/// database's creation before it (retention distrusts a commit day before the database existed).
fn backdate(inbox: &Inbox, scope_id: i64, id: &str, days: i64) {
    let conn = inbox.connection();
    let n = conn
        .execute(
            "UPDATE identities SET day = day - ?3 WHERE scope_id = ?1 AND id_hash = ?2",
            (scope_id, inbox.id_hash(None, id).as_bytes(), days),
        )
        .unwrap();
    assert_eq!(n, 1);
    conn.execute(
        "UPDATE inbox_meta SET value = ?1 WHERE name = 'created_at'",
        [edge_inbox::EARLIEST_PLAUSIBLE_TIME],
    )
    .unwrap();
}

fn insert_message(inbox: &Inbox, scope_id: i64, id: &str, state: i64) {
    inbox
        .connection()
        .execute(
            "INSERT INTO messages (scope_id, id_hash, message_id, topic, payload, state, received_at) \
             VALUES (?1, ?2, ?3, 't', x'00', ?4, 0)",
            (scope_id, inbox.id_hash(None, id).as_bytes(), id, state),
        )
        .unwrap();
}

fn run_policy(policy: ExpiredPolicy) {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let scope = "inventory-reservation";
    inbox
        .set_retention(
            scope,
            &RetentionPolicy::new()
                .identity_horizon(Duration::from_secs(7 * DAY as u64))
                .expired(policy)
                .clock_skew(Duration::ZERO),
        )
        .unwrap();
    let scope_id = inbox.scope_id(scope).unwrap();
    let effects = Cell::new(0);
    let handler = |_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> {
        effects.set(effects.get() + 1);
        Ok(())
    };

    let t = now();
    let old = Delivery::new(scope, "old", "orders", b"1").with_sent_at(t - 30 * DAY);
    let pending = Delivery::new(scope, "pending", "orders", b"2").with_sent_at(t - 30 * DAY);
    let failed = Delivery::new(scope, "failed", "orders", b"3").with_sent_at(t - 30 * DAY);
    let recent = Delivery::new(scope, "recent", "orders", b"4").with_sent_at(t - 30 * DAY);
    for d in [&old, &pending, &failed, &recent] {
        assert!(matches!(
            inbox.process(d, handler).unwrap(),
            Outcome::Processed
        ));
    }
    {
        for id in ["old", "pending", "failed"] {
            backdate(&inbox, scope_id, id, 30);
        }
        backdate(&inbox, scope_id, "recent", 2);
        insert_message(&inbox, scope_id, "pending", 0);
        insert_message(&inbox, scope_id, "failed", 2);
    }
    assert_eq!(inbox.pruned_before(scope).unwrap(), None);

    let report = inbox
        .prune(&Pruning::default().pause(Duration::ZERO))
        .unwrap();
    assert_eq!(
        report.identities_pruned, 1,
        "only the old identity without pending or failed work"
    );
    assert_eq!(inbox.scope_stats(scope).unwrap().identities_pruned, 1);
    let pruned_before = inbox
        .pruned_before(scope)
        .unwrap()
        .expect("watermark recorded");
    let old_day = (t - 30 * DAY).div_euclid(DAY);
    assert_eq!(
        pruned_before,
        (old_day + 1) * DAY,
        "tight bound: the end of the newest pruned day"
    );
    assert_eq!(inbox.status(scope, None, "old").unwrap(), Status::NotFound);
    assert_eq!(
        count(
            inbox.connection(),
            "SELECT count(*) FROM messages WHERE state IN (0, 2)"
        ),
        2
    );

    // Identities of pending and failed work, and recent ones, are retained: still duplicates.
    for d in [&pending, &failed, &recent] {
        assert!(
            matches!(inbox.process(d, handler).unwrap(), Outcome::Duplicate),
            "{}",
            d.message_id
        );
    }
    effects.set(0);

    // The old delivery comes back: its identity is gone and it is older than what was pruned.
    let outcome = inbox.process(&old, handler).unwrap();
    assert!(
        !matches!(outcome, Outcome::Duplicate),
        "never reported as a duplicate"
    );
    match policy {
        ExpiredPolicy::Process => {
            assert!(matches!(outcome, Outcome::Processed));
            assert_eq!(effects.get(), 1, "treated as new");
            assert!(matches!(
                inbox.status(scope, None, "old").unwrap(),
                Status::Recorded { .. }
            ));
            // Now recorded again: the next repetition is a plain duplicate.
            assert!(matches!(
                inbox.process(&old, handler).unwrap(),
                Outcome::Duplicate
            ));
        }
        ExpiredPolicy::Reject => {
            match outcome {
                Outcome::Expired {
                    sent_at,
                    pruned_before: p,
                    quarantined: None,
                } => {
                    assert_eq!(sent_at, t - 30 * DAY);
                    assert_eq!(p, pruned_before);
                }
                ref o => panic!("expected a rejection, got {o:?}"),
            }
            assert!(!outcome.may_ack());
            assert_eq!(effects.get(), 0);
            assert_eq!(
                inbox.status(scope, None, "old").unwrap(),
                Status::NotFound,
                "nothing recorded"
            );
            // Rejected again, not a duplicate, however often it comes.
            assert!(matches!(
                inbox.process(&old, handler).unwrap(),
                Outcome::Expired {
                    quarantined: None,
                    ..
                }
            ));
        }
        ExpiredPolicy::Quarantine => {
            let Outcome::Expired {
                quarantined: Some(qid),
                ..
            } = outcome
            else {
                panic!("expected quarantine, got {outcome:?}")
            };
            assert!(outcome.may_ack(), "kept for an operator");
            assert_eq!(effects.get(), 0);
            let payload: Vec<u8> = inbox
                .connection()
                .query_row("SELECT payload FROM quarantine WHERE id = ?1", [qid], |r| {
                    r.get(0)
                })
                .unwrap();
            assert_eq!(payload, b"1");
            assert_eq!(inbox.scope_stats(scope).unwrap().quarantined, 1);
            assert_eq!(inbox.status(scope, None, "old").unwrap(), Status::NotFound);
        }
        _ => unreachable!(),
    }
    let flagged = if policy == ExpiredPolicy::Process {
        1
    } else {
        2
    };
    let flagged = if policy == ExpiredPolicy::Quarantine {
        1
    } else {
        flagged
    };
    assert_eq!(inbox.scope_stats(scope).unwrap().expired, flagged);

    // New deliveries are unaffected: sent after the pruned horizon, or without a sending time.
    effects.set(0);
    let fresh = Delivery::new(scope, "fresh", "orders", b"5").with_sent_at(t);
    let undated = Delivery::new(scope, "undated", "orders", b"6");
    let outcomes = inbox.process_batch(&[fresh, undated], handler).unwrap();
    assert!(
        outcomes.iter().all(|o| matches!(o, Outcome::Processed)),
        "{outcomes:?}"
    );
    assert_eq!(effects.get(), 2);
}

#[test]
fn expired_delivery_processed_by_policy() {
    run_policy(ExpiredPolicy::Process);
}

#[test]
fn expired_delivery_rejected_by_policy() {
    run_policy(ExpiredPolicy::Reject);
}

#[test]
fn expired_delivery_quarantined_by_policy() {
    run_policy(ExpiredPolicy::Quarantine);
}

#[test]
fn horizon_seen_by_another_connection() {
    // The consumer and the pruner are different connections: the consumer must see the new horizon.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let scope = "billing";
    let mut consumer = Inbox::open(&path, Config::default()).unwrap();
    let mut pruner = Inbox::open(&path, Config::default()).unwrap();
    let handler = |_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> { Ok(()) };
    let t = now();
    let old = Delivery::new(scope, "old", "b", b"1").with_sent_at(t - 30 * DAY);
    assert!(matches!(
        consumer.process(&old, handler).unwrap(),
        Outcome::Processed
    ));
    let scope_id = consumer.scope_id(scope).unwrap();
    backdate(&consumer, scope_id, "old", 30);

    pruner
        .set_retention(
            scope,
            &RetentionPolicy::new()
                .identity_horizon(Duration::from_secs(DAY as u64))
                .expired(ExpiredPolicy::Reject),
        )
        .unwrap();
    assert_eq!(
        pruner
            .prune(&Pruning::default().pause(Duration::ZERO))
            .unwrap()
            .identities_pruned,
        1
    );
    assert!(matches!(
        consumer.process(&old, handler).unwrap(),
        Outcome::Expired { .. }
    ));
}

/// A delivery sent "in the future" (its producer's clock runs ahead by more than the allowed skew): its
/// identity counts from its send time, not its commit. Dated by its commit, the horizon pruned it while its
/// repetitions, which carry the same send time, could never be told older than what was pruned: the effect
/// ran again.
#[test]
fn an_identity_sent_ahead_of_the_gateways_clock_is_kept_until_a_horizon_after_its_send_time() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let scope = "future";
    inbox
        .set_retention(
            scope,
            &RetentionPolicy::new()
                .identity_horizon(Duration::from_secs(30 * DAY as u64))
                .expired(ExpiredPolicy::Quarantine),
        )
        .unwrap();
    let effects = Cell::new(0);
    let handler = |_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> {
        effects.set(effects.get() + 1);
        Ok(())
    };
    let sent = now() + 60 * DAY;
    let d = Delivery::new(scope, "evt-f", "t", b"1").with_sent_at(sent);
    assert!(matches!(
        inbox.process(&d, handler).unwrap(),
        Outcome::Processed
    ));
    let scope_id = inbox.scope_id(scope).unwrap();
    let day: i64 = inbox
        .connection()
        .query_row(
            "SELECT day FROM identities WHERE scope_id = ?1",
            [scope_id],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(day, sent.div_euclid(DAY), "dated by its send time");
    // Forty days on, by the commit's clock: the identity is still within the horizon of its send time.
    backdate(&inbox, scope_id, "evt-f", 40);
    inbox
        .prune(&Pruning::default().pause(Duration::ZERO))
        .unwrap();
    let again = inbox.process(&d, handler).unwrap();
    assert!(matches!(again, Outcome::Duplicate), "{again:?}");
    assert_eq!(effects.get(), 1);
}
