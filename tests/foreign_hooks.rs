//! The connection's commit and rollback hooks are the inbox's guard that nothing a handler writes commits
//! without its identity (see the crate guide, "Handlers and state"). rusqlite lets anyone holding the
//! `Connection` replace them (`commit_hook` and `rollback_hook` take `&self`): through `Inbox::connection()`,
//! through `Tx::sql()` in an earlier handler, or in the running handler itself. Whatever the application
//! installs, a handler that swallows SQLite's own rollback and writes again must not commit that write
//! without its identity, and never be answered `Ok`.

use edge_inbox::{Config, Delivery, Error, Inbox, Tx, Worker, WorkerConfig};

fn open(path: &std::path::Path) -> Inbox {
    let inbox = Inbox::open(path, Config::default()).unwrap();
    inbox
        .connection()
        .execute_batch(
            "CREATE TABLE IF NOT EXISTS once (k INTEGER PRIMARY KEY);
             INSERT OR IGNORE INTO once VALUES (1);
             CREATE TABLE IF NOT EXISTS effects (n INTEGER NOT NULL);",
        )
        .unwrap();
    inbox
}

/// Application hooks that observe commits and rollbacks (and refuse nothing).
fn install_hooks(conn: &edge_inbox::rusqlite::Connection) {
    conn.commit_hook(Some(|| false)).unwrap();
    conn.rollback_hook(Some(|| {})).unwrap();
}

/// `INSERT OR ROLLBACK` makes SQLite roll the transaction back; the handler swallows it and writes again.
fn careless(tx: &mut Tx<'_>, _d: &Delivery<'_>) -> anyhow::Result<()> {
    let refused = tx
        .sql()
        .execute("INSERT OR ROLLBACK INTO once VALUES (1)", []);
    assert!(refused.is_err(), "the provoking statement must fail");
    let _ = tx.sql().execute("INSERT INTO effects VALUES (1)", []);
    Ok(())
}

/// (effects, identities) on the file.
fn counts(inbox: &Inbox) -> (i64, i64) {
    inbox
        .connection()
        .query_row(
            "SELECT (SELECT count(*) FROM effects), (SELECT count(*) FROM identities)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap()
}

#[test]
fn hooks_installed_through_the_connection_do_not_lift_the_handler_guard() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir.path().join("inbox.db"));
    install_hooks(inbox.connection());
    let d = Delivery::new("s", "evt-1", "t", b"1");
    for round in 0..3 {
        let r = inbox.process(&d, careless);
        assert!(
            matches!(r, Err(Error::HandlerEndedTransaction)),
            "round {round}: {r:?}"
        );
    }
    assert_eq!(counts(&inbox), (0, 0), "(effects, identities)");
    // Still usable, and the delivery is still new.
    let ok = inbox.process(&d, |tx: &mut Tx<'_>, _: &Delivery<'_>| {
        tx.sql().execute("INSERT INTO effects VALUES (1)", [])?;
        Ok(())
    });
    assert!(ok.unwrap().may_ack());
    assert_eq!(counts(&inbox), (1, 1));
}

#[test]
fn hooks_installed_through_the_connection_do_not_lift_the_guard_in_a_batch_or_a_worker() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    assert!(inbox
        .process(
            &Delivery::new("s", "first", "t", b"0"),
            |_: &mut Tx<'_>, _: &Delivery<'_>| Ok(())
        )
        .unwrap()
        .may_ack());
    install_hooks(inbox.connection());
    let batch = [
        Delivery::new("s", "evt-1", "t", b"1"),
        Delivery::new("s", "evt-2", "t", b"2"),
    ];
    for round in 0..3 {
        let r = inbox.process_batch(&batch, careless);
        assert!(
            matches!(r, Err(Error::HandlerEndedTransaction)),
            "round {round}: {r:?}"
        );
    }
    assert_eq!(counts(&inbox), (0, 1), "(effects, identities)");

    inbox
        .receive(&Delivery::new("w", "evt-w", "t", b"w"))
        .unwrap();
    // The worker counts the message whose handler ended the transaction an attempt, and dead-letters it at
    // the last, so that it cannot hold back the messages after it.
    let config = WorkerConfig::default()
        .max_attempts(3)
        .backoff(std::time::Duration::ZERO, std::time::Duration::ZERO);
    let mut w = Worker::open(&path, Config::default(), "w", config).unwrap();
    install_hooks(w.inbox().connection());
    let before = counts(&inbox);
    for round in 1..=3 {
        let r = w.run_once(&mut careless);
        assert!(
            matches!(&r, Ok(d) if d.retrying + d.dead_lettered == 1 && d.processed == 0),
            "round {round}: {r:?}"
        );
    }
    assert_eq!(counts(&inbox), before, "no effect committed by the worker");
    let backlog = inbox.backlog("w").unwrap();
    assert_eq!(
        (backlog.pending, backlog.dead_letters),
        (0, 1),
        "dead-lettered, to requeue"
    );
}

#[test]
fn a_handler_that_replaces_the_hooks_while_it_runs_is_never_answered_ok() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir.path().join("inbox.db"));
    let d = Delivery::new("s", "evt-1", "t", b"1");
    // Replaces the hooks, has its transaction rolled back by SQLite, swallows that, writes, and opens a new
    // transaction so that the inbox's `COMMIT` finds one open.
    let sly = |tx: &mut Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> {
        install_hooks(tx.sql());
        let _ = tx
            .sql()
            .execute("INSERT OR ROLLBACK INTO once VALUES (1)", []);
        let _ = tx.sql().execute_batch("BEGIN IMMEDIATE");
        Ok(())
    };
    let r = inbox.process(&d, sly);
    assert!(
        matches!(r, Err(Error::HandlerEndedTransaction)),
        "a delivery whose identity did not commit was answered {r:?}"
    );
    assert_eq!(counts(&inbox), (0, 0));
    // Hooks installed by a handler that otherwise succeeds fail its call too, and are removed again.
    let installer = |tx: &mut Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> {
        install_hooks(tx.sql());
        Ok(())
    };
    let r = inbox.process(&d, installer);
    assert!(matches!(r, Err(Error::HandlerEndedTransaction)), "{r:?}");
    for _ in 0..3 {
        let r = inbox.process(&d, careless);
        assert!(matches!(r, Err(Error::HandlerEndedTransaction)), "{r:?}");
    }
    assert_eq!(counts(&inbox), (0, 0));
    let ok = inbox.process(&d, |_: &mut Tx<'_>, _: &Delivery<'_>| Ok(()));
    assert!(ok.unwrap().may_ack(), "the delivery is still new");
}
