//! Once SQLite has rolled the delivery's transaction back by itself (a trigger's `RAISE(ROLLBACK)`,
//! `INSERT OR ROLLBACK`, an interrupted write), nothing the handler writes afterwards may commit: not
//! through `Tx::put`, not through raw SQL on `Tx::sql`, not as an outbox row. Each path (process, process_batch, the deferred
//! worker, Tx::publish) is offered the same delivery three times, like three redeliveries.

use edge_inbox::{Config, Delivery, Error, Inbox, OutboxProperties, Qos, Tx, Worker, WorkerConfig};

/// How the handler provokes SQLite's own rollback.
#[derive(Clone, Copy, Debug)]
enum Cause {
    /// A trigger that runs `RAISE(ROLLBACK, ...)`.
    Trigger,
    /// `INSERT OR ROLLBACK` hitting a unique constraint.
    InsertOrRollback,
    /// A write statement interrupted (here by a progress handler): SQLite rolls the whole transaction back.
    Interrupt,
}

/// What the handler tries to write after the rollback (swallowing every error).
#[derive(Clone, Copy, Debug)]
enum Write {
    Put,
    RawSql,
    Publish,
}

const ALL: [(Cause, Write); 9] = [
    (Cause::Trigger, Write::Put),
    (Cause::Trigger, Write::RawSql),
    (Cause::Trigger, Write::Publish),
    (Cause::InsertOrRollback, Write::Put),
    (Cause::InsertOrRollback, Write::RawSql),
    (Cause::InsertOrRollback, Write::Publish),
    (Cause::Interrupt, Write::Put),
    (Cause::Interrupt, Write::RawSql),
    (Cause::Interrupt, Write::Publish),
];

fn open(path: &std::path::Path) -> Inbox {
    let inbox = Inbox::open(path, Config::default()).unwrap();
    inbox
        .connection()
        .execute_batch(
            "CREATE TABLE IF NOT EXISTS audit (x INTEGER);
             CREATE TRIGGER IF NOT EXISTS audit_refused BEFORE INSERT ON audit
               BEGIN SELECT RAISE(ROLLBACK, 'audit refused'); END;
             CREATE TABLE IF NOT EXISTS once (k INTEGER PRIMARY KEY);
             INSERT OR IGNORE INTO once VALUES (1);
             CREATE TABLE IF NOT EXISTS counter (n INTEGER NOT NULL);
             INSERT INTO counter SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM counter);",
        )
        .unwrap();
    inbox
}

fn handler(
    rollback: Cause,
    write: Write,
) -> impl FnMut(&mut Tx<'_>, &Delivery<'_>) -> anyhow::Result<()> {
    move |tx: &mut Tx<'_>, _d: &Delivery<'_>| {
        let refused = match rollback {
            Cause::Trigger => tx.sql().execute("INSERT INTO audit VALUES (1)", []),
            Cause::Interrupt => {
                tx.sql().progress_handler(1, Some(|| true)).unwrap();
                let r = tx.sql().execute("INSERT INTO once VALUES (2)", []);
                tx.sql().progress_handler(0, None::<fn() -> bool>).unwrap();
                r
            }
            Cause::InsertOrRollback => tx
                .sql()
                .execute("INSERT OR ROLLBACK INTO once VALUES (1)", []),
        };
        assert!(refused.is_err(), "the provoking statement must fail");
        // A careless handler swallows every error from here on.
        match write {
            Write::Put => {
                let n: i64 = tx.get("n").ok().flatten().unwrap_or(0);
                let _ = tx.put("n", &(n + 1));
            }
            Write::RawSql => {
                let _ = tx.sql().execute("UPDATE counter SET n = n + 1", []);
            }
            Write::Publish => {
                let _ = tx.publish("out/t", b"x", Qos::AtLeastOnce, &OutboxProperties::new());
            }
        }
        Ok(())
    }
}

/// Writes that reached the file: kv counter, raw counter, outbox rows; and identities recorded.
fn effects(inbox: &Inbox) -> (i64, i64, i64, i64) {
    inbox
        .connection()
        .query_row(
            "SELECT (SELECT count(*) FROM kv), (SELECT n FROM counter), (SELECT count(*) FROM outbox), \
             (SELECT count(*) FROM identities)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap()
}

fn check_ended(
    result: &Result<impl std::fmt::Debug, Error>,
    case: (Cause, Write),
    wrong: &mut Vec<String>,
) {
    if !matches!(result, Err(Error::HandlerEndedTransaction)) {
        wrong.push(format!("{case:?}: returned {result:?}"));
    }
}

fn check_effects(
    got: (i64, i64, i64, i64),
    want: (i64, i64, i64, i64),
    case: (Cause, Write),
    wrong: &mut Vec<String>,
) {
    if got != want {
        wrong.push(format!(
            "{case:?}: (kv, counter, outbox, identities) = {got:?}, want {want:?}"
        ));
    }
}

#[test]
fn process_commits_nothing_after_sqlite_rolled_back() {
    let mut wrong = Vec::new();
    for case in ALL {
        let dir = tempfile::tempdir().unwrap();
        let mut inbox = open(&dir.path().join("inbox.db"));
        let d = Delivery::new("s", "evt-1", "t", b"1");
        for _ in 0..3 {
            let r = inbox.process(&d, handler(case.0, case.1));
            check_ended(&r, case, &mut wrong);
        }
        check_effects(effects(&inbox), (0, 0, 0, 0), case, &mut wrong);
        // The inbox is still usable, and the delivery is still new.
        let ok = inbox.process(&d, |tx: &mut Tx<'_>, _: &Delivery<'_>| {
            tx.put("n", &1)?;
            Ok(())
        });
        assert!(ok.unwrap().may_ack(), "{case:?}");
        check_effects(effects(&inbox), (1, 0, 0, 1), case, &mut wrong);
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn process_batch_commits_nothing_after_sqlite_rolled_back() {
    let mut wrong = Vec::new();
    for case in ALL {
        let dir = tempfile::tempdir().unwrap();
        let mut inbox = open(&dir.path().join("inbox.db"));
        let batch = [
            Delivery::new("s", "evt-1", "t", b"1"),
            Delivery::new("s", "evt-2", "t", b"2"),
        ];
        for _ in 0..3 {
            let r = inbox.process_batch(&batch, handler(case.0, case.1));
            check_ended(&r, case, &mut wrong);
        }
        check_effects(effects(&inbox), (0, 0, 0, 0), case, &mut wrong);
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn worker_commits_nothing_after_sqlite_rolled_back() {
    let mut wrong = Vec::new();
    for case in ALL {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inbox.db");
        let mut inbox = open(&path);
        inbox
            .receive(&Delivery::new("s", "evt-1", "t", b"1"))
            .unwrap();
        let received = effects(&inbox);
        // The worker isolates the message whose handler ended the transaction and counts it an attempt
        // (no backoff here, so each run tries it again), dead-lettering it at the last.
        let config = WorkerConfig::default()
            .max_attempts(3)
            .backoff(std::time::Duration::ZERO, std::time::Duration::ZERO);
        let mut w = Worker::open(&path, Config::default(), "s", config).unwrap();
        for attempt in 1..=3 {
            match w.run_once(&mut handler(case.0, case.1)) {
                Ok(d)
                    if (d.retrying, d.dead_lettered)
                        == (usize::from(attempt < 3), usize::from(attempt == 3)) => {}
                other => wrong.push(format!("{case:?}: attempt {attempt} returned {other:?}")),
            }
        }
        check_effects(effects(&inbox), received, case, &mut wrong);
        let backlog = inbox.backlog("s").unwrap();
        assert_eq!(
            (backlog.pending, backlog.failed, backlog.dead_letters),
            (0, 0, 1),
            "{case:?}: the message is a dead letter, to requeue once its cause is fixed"
        );
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// The same settings lowered by the application through `Inbox::connection()` between two deliveries: the
/// next commit is made at the configured level again, not at the application's.
#[test]
fn settings_lowered_through_the_connection_are_put_back_before_the_next_commit() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config::default().checkpoint_thread(false);
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), config).unwrap();
    let during_commit = |inbox: &mut Inbox, id: &str| -> (i64, String) {
        let mut seen = (0, String::new());
        let d = Delivery::new("settings", id, "t", b"x");
        inbox
            .process(&d, |tx: &mut Tx<'_>, _d: &Delivery<'_>| {
                let level = tx.sql().query_row("PRAGMA synchronous", [], |r| r.get(0))?;
                let mode = tx
                    .sql()
                    .query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
                seen = (level, mode);
                Ok(())
            })
            .unwrap();
        seen
    };
    assert_eq!(during_commit(&mut inbox, "first"), (2, "wal".to_owned()));
    inbox
        .connection()
        .execute_batch("PRAGMA synchronous = OFF")
        .unwrap();
    assert_eq!(during_commit(&mut inbox, "second"), (2, "wal".to_owned()));
    let mode: String = inbox
        .connection()
        .query_row("PRAGMA journal_mode = DELETE", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "delete");
    assert_eq!(during_commit(&mut inbox, "third"), (2, "wal".to_owned()));
}

/// Outside its transaction (after a `ROLLBACK` of its own) a handler's `PRAGMA synchronous` and
/// `PRAGMA journal_mode` take effect: lowered there, they would weaken every later commit. The call fails,
/// and the next transaction puts both back and reads them back before it begins.
#[test]
fn settings_a_handler_changes_outside_its_transaction_are_put_back() {
    let dir = tempfile::tempdir().unwrap();
    // No checkpoint thread: its connection would keep the journal mode from being changed at all.
    let config = Config::default().checkpoint_thread(false);
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), config).unwrap();
    let read = |inbox: &Inbox, pragma: &str| -> String {
        inbox
            .connection()
            .query_row(&format!("PRAGMA {pragma}"), [], |r| {
                r.get::<_, rusqlite::types::Value>(0)
            })
            .map(|v| match v {
                rusqlite::types::Value::Integer(i) => i.to_string(),
                rusqlite::types::Value::Text(t) => t,
                other => format!("{other:?}"),
            })
            .unwrap()
    };
    assert_eq!(read(&inbox, "synchronous"), "2");
    for (i, pragmas) in [
        "ROLLBACK; PRAGMA synchronous = OFF",
        "ROLLBACK; PRAGMA journal_mode = DELETE",
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("bad-{i}");
        let d = Delivery::new("settings", &id, "t", b"x");
        let err = inbox
            .process(&d, |tx: &mut Tx<'_>, _d: &Delivery<'_>| {
                tx.sql().execute_batch(pragmas)?;
                Ok(())
            })
            .unwrap_err();
        assert!(matches!(err, Error::HandlerEndedTransaction), "{err:?}");
        let id = format!("good-{i}");
        let d = Delivery::new("settings", &id, "t", b"x");
        inbox
            .process(&d, |tx: &mut Tx<'_>, d: &Delivery<'_>| {
                tx.put(d.message_id, &1)?;
                Ok(())
            })
            .unwrap();
        assert_eq!(read(&inbox, "synchronous"), "2", "after {pragmas}");
        assert_eq!(read(&inbox, "journal_mode"), "wal", "after {pragmas}");
    }
}
