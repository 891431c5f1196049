//! Edges of retention: a policy switched after the horizon pruned a scope, a commit clock that runs behind the
//! latest time retention accepted, and a policy changed by another connection while a prune step runs.

use std::cell::Cell;
use std::time::Duration;

use edge_inbox::{
    Config, Delivery, Error, ExpiredPolicy, Inbox, Outcome, Pruning, RetentionPolicy,
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

/// Moves every identity of the file `days` into the past, and the database's creation before them (retention
/// distrusts a commit day before the database existed).
fn backdate_all(conn: &Connection, days: i64) {
    conn.execute("UPDATE identities SET day = day - ?1", [days])
        .unwrap();
    conn.execute(
        "UPDATE inbox_meta SET value = ?1 WHERE name = 'created_at'",
        [edge_inbox::EARLIEST_PLAUSIBLE_TIME],
    )
    .unwrap();
}

/// A new inbox at `path` whose retention has accepted a clock reading of `t` (Unix seconds).
fn clock_seen(path: &std::path::Path, t: i64) {
    let inbox = Inbox::open(path, Config::default()).unwrap();
    inbox
        .connection()
        .execute(
            "INSERT INTO inbox_meta (name, value) VALUES ('clock_seen', ?1) \
             ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            [t],
        )
        .unwrap();
}

fn horizon(days: i64) -> RetentionPolicy {
    RetentionPolicy::new()
        .identity_horizon(Duration::from_secs((days * DAY) as u64))
        .expired(ExpiredPolicy::Quarantine)
        .clock_skew(Duration::ZERO)
}

fn prune_all(inbox: &mut Inbox, opts: &Pruning) -> edge_inbox::PruneReport {
    inbox.prune(&opts.clone().pause(Duration::ZERO)).unwrap()
}

#[test]
fn watermarks_are_refused_for_a_scope_that_recorded_anything() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    let t = now();
    let ok = |_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> { Ok(()) };

    // Pruned: every identity gone, only `pruned_before` and the counters remember the scope was used.
    let pruned = "pruned";
    inbox.set_retention(pruned, &horizon(7)).unwrap();
    let d = Delivery::new(pruned, "evt-1", "t", b"1")
        .with_producer("dev-1")
        .with_sequence(1)
        .with_sent_at(t - 30 * DAY);
    assert!(matches!(inbox.process(&d, ok).unwrap(), Outcome::Processed));
    backdate_all(inbox.connection(), 30);
    assert_eq!(
        prune_all(&mut inbox, &Pruning::default()).identities_pruned,
        1
    );
    assert!(inbox.pruned_before(pruned).unwrap().is_some());
    assert_eq!(
        count(inbox.connection(), "SELECT count(*) FROM identities"),
        0
    );

    // Only a quarantined delivery.
    let quarantined = "quarantined";
    inbox
        .quarantine(quarantined, "t", b"?", "no message id")
        .unwrap();

    // Only a dead letter whose identity is gone (as after a restore of an older copy of the identities).
    let dead = "dead";
    inbox
        .dead_letter(&Delivery::new(dead, "evt-9", "t", b"9"), "bad")
        .unwrap();
    inbox
        .connection()
        .execute(
            "DELETE FROM identities WHERE scope_id = (SELECT id FROM scopes WHERE name = 'dead')",
            [],
        )
        .unwrap();

    for scope in [pruned, quarantined, dead] {
        let switched = inbox.set_retention(scope, &horizon(7).sequence_watermarks(1));
        assert!(
            matches!(switched, Err(Error::InvalidArgument(_))),
            "scope {scope}: {switched:?}"
        );
        assert_eq!(
            inbox.retention(scope).unwrap().get_sequence_watermarks(),
            None,
            "scope {scope}"
        );
    }
    // A scope that recorded nothing may still choose.
    inbox
        .set_retention("fresh", &horizon(7).sequence_watermarks(1))
        .unwrap();
    assert_eq!(
        inbox.retention("fresh").unwrap().get_sequence_watermarks(),
        Some(1)
    );
}

#[test]
fn a_numbered_repetition_older_than_the_pruned_horizon_stays_expired_under_watermarks() {
    // A file whose scope was switched to watermarks after its horizon pruned it (an earlier version accepted
    // that): a repetition that was Expired must not come out Processed.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    let scope = "switched";
    let t = now();
    let effects = Cell::new(0);
    let handler = |_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> {
        effects.set(effects.get() + 1);
        Ok(())
    };
    inbox.set_retention(scope, &horizon(7)).unwrap();
    let d = Delivery::new(scope, "evt-1", "t", b"1")
        .with_producer("dev-1")
        .with_sequence(1)
        .with_sent_at(t - 30 * DAY);
    assert!(matches!(
        inbox.process(&d, handler).unwrap(),
        Outcome::Processed
    ));
    backdate_all(inbox.connection(), 30);
    assert_eq!(
        prune_all(&mut inbox, &Pruning::default()).identities_pruned,
        1
    );
    assert!(matches!(
        inbox.process(&d, handler).unwrap(),
        Outcome::Expired { .. }
    ));

    // The switch, as written by an earlier version (another connection).
    let raw = Connection::open(&path).unwrap();
    raw.execute(
        "UPDATE retention SET watermarks = 1, first_sequence = 1",
        [],
    )
    .unwrap();
    drop(raw);

    let again = inbox.process(&d, handler).unwrap();
    assert!(
        matches!(
            again,
            Outcome::Expired {
                quarantined: Some(_),
                ..
            }
        ),
        "{again:?}"
    );
    assert_eq!(effects.get(), 1, "the handler ran once");
    // The expired delivery claimed its sequence (not applied), so the watermark has no gap.
    assert_eq!(inbox.watermark(scope, "dev-1").unwrap().high, Some(1));
    // A numbered delivery sent after the horizon is new, and claims its sequence.
    let fresh = Delivery::new(scope, "evt-2", "t", b"2")
        .with_producer("dev-1")
        .with_sequence(2)
        .with_sent_at(t);
    assert!(matches!(
        inbox.process(&fresh, handler).unwrap(),
        Outcome::Processed
    ));
    let mark = inbox.watermark(scope, "dev-1").unwrap();
    assert_eq!((mark.high, mark.exceptions), (Some(2), vec![]));
    // The expired one again: compared with what claimed its sequence, still not applied.
    assert!(!matches!(
        inbox.process(&d, handler).unwrap(),
        Outcome::Processed
    ));
    assert_eq!(effects.get(), 2, "evt-1 once, evt-2 once");
}

#[test]
fn identities_committed_by_a_clock_running_behind_are_kept_their_full_horizon() {
    // Retention accepted a reading ten days ahead of this process's clock: the clock now runs ten days
    // behind (but after the database's creation, so nothing else notices).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let behind = 10 * DAY;
    let t = now();
    let right = t + behind;
    clock_seen(&path, right);
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    let scope = "behind";
    inbox.set_retention(scope, &horizon(30)).unwrap();
    let effects = Cell::new(0);
    let handler = |_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> {
        effects.set(effects.get() + 1);
        Ok(())
    };
    // Sent at the right time, committed under the clock that runs behind: by the strong case and by the
    // deferred receive path.
    let strong = Delivery::new(scope, "evt-strong", "t", b"1").with_sent_at(right);
    let deferred = Delivery::new(scope, "evt-deferred", "t", b"2").with_sent_at(right);
    assert!(matches!(
        inbox.process(&strong, handler).unwrap(),
        Outcome::Processed
    ));
    assert!(matches!(
        inbox.receive(&deferred).unwrap(),
        Outcome::Received
    ));
    let mut worker =
        edge_inbox::Worker::new(inbox, scope, edge_inbox::WorkerConfig::default()).unwrap();
    worker
        .run_once(
            &mut |_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> { Ok(()) },
        )
        .unwrap();
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    inbox
        .set_retention(scope, &horizon(30).processed_payloads(Duration::ZERO))
        .unwrap();

    // Once the clock is right, 25 days later: both identities are younger than the 30-day horizon.
    let later = right + 25 * DAY;
    let report = prune_all(&mut inbox, &Pruning::default().as_of(later));
    assert_eq!(report.identities_pruned, 0, "{report:?}");
    assert!(inbox.pruned_before(scope).unwrap().is_none());
    assert!(matches!(
        inbox.process(&strong, handler).unwrap(),
        Outcome::Duplicate
    ));
    assert!(matches!(
        inbox.process(&deferred, handler).unwrap(),
        Outcome::Duplicate
    ));
    assert_eq!(effects.get(), 1);
    // They still go after a full horizon on the right clock.
    let report = prune_all(&mut inbox, &Pruning::default().as_of(right + 32 * DAY));
    assert_eq!(report.identities_pruned, 2, "{report:?}");
}

#[test]
fn a_horizon_removed_by_another_connection_during_a_prune_step_deletes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut pruner = Inbox::open(
        &path,
        Config::default().busy_timeout(Duration::from_secs(60)),
    )
    .unwrap();
    let scope = "raced";
    pruner.set_retention(scope, &horizon(7)).unwrap();
    let t = now();
    for i in 0..3 {
        let id = format!("evt-{i}");
        let d = Delivery::new(scope, &id, "t", b"1").with_sent_at(t - 30 * DAY);
        pruner
            .process(&d, |_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>| Ok(()))
            .unwrap();
    }
    backdate_all(pruner.connection(), 30);
    let opts = Pruning::default().batch(8);
    // The first step looks at stored messages (there are none); the next one prunes identities.
    let first = pruner.prune_step(&opts).unwrap();
    assert_eq!(first.identities_pruned, 0);

    // Another connection holds the write lock while it removes the horizon; the prune step starts meanwhile
    // (it can read, not write) and gets the lock only once the change is committed.
    let other = Connection::open(&path).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    other
        .execute(
            "UPDATE retention SET identity_horizon = NULL WHERE scope_id = (SELECT id FROM scopes WHERE name = ?1)",
            [scope],
        )
        .unwrap();
    let step = std::thread::spawn(move || {
        let report = pruner.prune_step(&opts).unwrap();
        (pruner, report)
    });
    // Let the step reach its write transaction before the change commits (if it is slower, it reads the new
    // rules before its transaction, and the test cannot tell the difference; it never fails for that).
    std::thread::sleep(Duration::from_millis(500));
    other.execute_batch("COMMIT").unwrap();
    let (mut pruner, report) = step.join().unwrap();
    assert_eq!(report.identities_pruned, 0, "{report:?}");
    assert_eq!(count(&other, "SELECT count(*) FROM identities"), 3);
    assert!(pruner.pruned_before(scope).unwrap().is_none());
}

/// Quarantine and conflict records and dead letters written under a clock running behind what retention
/// accepted, or stamped at 1970 by a gateway that booted without its clock: each is kept its full age from a
/// time that can be right, not deleted by the first prune once the clock is right.
#[test]
fn records_and_dead_letters_stamped_by_a_wrong_clock_are_kept_their_full_age() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let t = now();
    let right = t + 10 * DAY;
    clock_seen(&path, right);
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    let scope = "stamps";
    inbox
        .set_retention(
            scope,
            &RetentionPolicy::new()
                .quarantine_and_conflicts(Duration::from_secs(7 * DAY as u64))
                .dead_letter_payloads(Duration::from_secs(7 * DAY as u64)),
        )
        .unwrap();
    let ok = |_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> { Ok(()) };
    // Under the clock running ten days behind (`process` reads what retention accepted first).
    inbox
        .process(&Delivery::new(scope, "evt-1", "t", b"1"), ok)
        .unwrap();
    let conflict = inbox
        .process(&Delivery::new(scope, "evt-1", "t", b"2"), ok)
        .unwrap();
    assert!(matches!(conflict, Outcome::Conflict { .. }), "{conflict:?}");
    inbox.quarantine(scope, "t", b"bad", "no id").unwrap();
    inbox
        .dead_letter(&Delivery::new(scope, "evt-dl", "t", b"3"), "gave up")
        .unwrap();
    // And records stamped at 1970.
    inbox.quarantine(scope, "t2", b"bad", "no id").unwrap();
    inbox
        .dead_letter(&Delivery::new(scope, "evt-dl-1970", "t", b"4"), "gave up")
        .unwrap();
    inbox
        .connection()
        .execute_batch(
            "UPDATE quarantine SET at = 100, last_at = 100 WHERE topic = 't2';
             UPDATE messages SET received_at = 100, finished_at = 100 WHERE message_id = 'evt-dl-1970';",
        )
        .unwrap();

    // A minute after the accepted clock: nothing is a week old.
    let report = prune_all(&mut inbox, &Pruning::default().as_of(right + 60));
    assert_eq!(
        (
            report.quarantine_pruned,
            report.conflicts_pruned,
            report.dead_letters_pruned
        ),
        (0, 0, 0),
        "{report:?}"
    );
    let conn = inbox.connection();
    assert_eq!(count(conn, "SELECT count(*) FROM quarantine"), 2);
    assert_eq!(count(conn, "SELECT count(*) FROM conflicts"), 1);
    assert_eq!(
        count(conn, "SELECT count(*) FROM messages WHERE state = 3"),
        2
    );
    // A week and more later, they go.
    let report = prune_all(&mut inbox, &Pruning::default().as_of(right + 60 + 8 * DAY));
    assert_eq!(
        (
            report.quarantine_pruned,
            report.conflicts_pruned,
            report.dead_letters_pruned
        ),
        (2, 1, 2),
        "{report:?}"
    );
}
