//! The failure table of the design, for everything that does not need MQTT, against real SQLite files.

mod common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use anyhow::bail;
use edge_inbox::rusqlite::Connection;
use edge_inbox::{
    Config, Delivery, Error, Inbox, InvalidDelivery, Limits, Outcome, Status, Synchronous, Tx,
};

const SCOPE: &str = "inventory-reservation";

fn open(dir: &tempfile::TempDir) -> Inbox {
    Inbox::open(dir.path().join("inbox.db"), Config::default()).expect("open inbox")
}

/// Adds 1 to the counter named by the payload: the simplest visible effect.
fn bump(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let key = std::str::from_utf8(d.payload)?;
    let n: i64 = tx.get(key)?.unwrap_or(0);
    tx.put(key, &(n + 1))?;
    Ok(())
}

fn counter(inbox: &Inbox, key: &str) -> i64 {
    let conn = inbox.connection();
    let blob: Option<Vec<u8>> = conn
        .query_row(
            "SELECT value FROM kv WHERE ns = ?1 AND key = ?2",
            (SCOPE, key),
            |r| r.get(0),
        )
        .ok();
    blob.map(|b| ciborium::from_reader(&b[..]).expect("cbor"))
        .unwrap_or(0)
}

fn identities(conn: &Connection) -> i64 {
    conn.query_row("SELECT count(*) FROM identities", [], |r| r.get(0))
        .unwrap()
}

#[test]
fn processed_then_duplicate_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let d = Delivery::new(SCOPE, "evt-42-created", "orders/42", b"A-1");
    {
        let mut inbox = open(&dir);
        assert!(matches!(
            inbox.process(&d, bump).unwrap(),
            Outcome::Processed
        ));
    }
    // Commit ok, PUBACK lost: the process restarts and the broker redelivers.
    let mut inbox = open(&dir);
    assert!(matches!(
        inbox.process(&d, bump).unwrap(),
        Outcome::Duplicate
    ));
    assert_eq!(counter(&inbox, "A-1"), 1);
    let stats = inbox.scope_stats(SCOPE).unwrap();
    assert_eq!((stats.processed, stats.duplicates), (1, 1));
    assert!(matches!(
        inbox.status(SCOPE, None, "evt-42-created").unwrap(),
        Status::Recorded { .. }
    ));
    assert_eq!(
        inbox.status(SCOPE, None, "evt-43-created").unwrap(),
        Status::NotFound
    );
}

#[test]
fn handler_failure_rolls_back_identity_and_effect() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir);
    let d = Delivery::new(SCOPE, "evt-1", "orders/1", b"A-1");
    let outcome = inbox
        .process(&d, |tx: &mut Tx<'_>, d: &Delivery<'_>| {
            bump(tx, d)?;
            bail!("sku unknown")
        })
        .unwrap();
    match outcome {
        Outcome::HandlerFailed(e) => assert_eq!(e.to_string(), "sku unknown"),
        other => panic!("expected HandlerFailed, got {other:?}"),
    }
    assert_eq!(counter(&inbox, "A-1"), 0, "effect rolled back");
    assert_eq!(
        identities(inbox.connection()),
        0,
        "identity rolled back with it"
    );
    assert_eq!(inbox.scope_stats(SCOPE).unwrap().handler_failures, 1);
    // The redelivery runs the handler again.
    assert!(matches!(
        inbox.process(&d, bump).unwrap(),
        Outcome::Processed
    ));
    assert_eq!(counter(&inbox, "A-1"), 1);
}

#[test]
fn conflict_is_recorded_and_not_applied() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir);
    let first = Delivery::new(SCOPE, "evt-7", "orders/7", b"A-1");
    let other = Delivery::new(SCOPE, "evt-7", "orders/7", b"B-2");
    assert!(matches!(
        inbox.process(&first, bump).unwrap(),
        Outcome::Processed
    ));
    let (stored, received) = match inbox.process(&other, bump).unwrap() {
        Outcome::Conflict { stored, received } => (stored, received),
        o => panic!("expected Conflict, got {o:?}"),
    };
    assert_eq!(stored, first.fingerprint());
    assert_eq!(received, other.fingerprint());
    assert_eq!(counter(&inbox, "B-2"), 0);
    let row: (String, i64, i64) = inbox
        .connection()
        .query_row(
            "SELECT message_id, stored_fingerprint, received_fingerprint FROM conflicts",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!(
        row,
        ("evt-7".to_string(), stored.0 as i64, received.0 as i64)
    );
    assert_eq!(inbox.scope_stats(SCOPE).unwrap().conflicts, 1);
    // The same topic on a different scope is another consumer: it processes the event too.
    let other_scope = Delivery::new("billing", "evt-7", "orders/7", b"B-2");
    assert!(matches!(
        inbox
            .process(&other_scope, |_: &mut Tx<'_>, _: &Delivery<'_>| Ok(()))
            .unwrap(),
        Outcome::Processed
    ));
}

#[test]
fn producer_namespaces_separate_identities() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir);
    let a = Delivery::new(SCOPE, "1", "t", b"A-1").with_producer("plc-a");
    let b = Delivery::new(SCOPE, "1", "t", b"A-1").with_producer("plc-b");
    let none = Delivery::new(SCOPE, "1", "t", b"A-1");
    for d in [&a, &b, &none] {
        assert!(matches!(
            inbox.process(d, bump).unwrap(),
            Outcome::Processed
        ));
    }
    assert!(matches!(
        inbox.process(&a, bump).unwrap(),
        Outcome::Duplicate
    ));
    assert_eq!(counter(&inbox, "A-1"), 3);
}

#[test]
fn batch_isolates_a_failing_handler_and_keeps_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir);
    let ds = [
        Delivery::new(SCOPE, "e1", "t", b"A-1"),
        Delivery::new(SCOPE, "e2", "t", b"POISON"),
        Delivery::new(SCOPE, "e3", "t", b"A-1"),
        Delivery::new(SCOPE, "e1", "t", b"A-1"),
        Delivery::new(SCOPE, "e3", "t", b"other"),
    ];
    let handler = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        bump(tx, d)?;
        if d.payload == b"POISON" {
            bail!("poison");
        }
        Ok(())
    };
    let outcomes = inbox.process_batch(&ds, handler).unwrap();
    let names: Vec<_> = outcomes.iter().map(Outcome::name).collect();
    assert_eq!(
        names,
        [
            "processed",
            "handler-failed",
            "processed",
            "duplicate",
            "conflict"
        ]
    );
    assert_eq!(counter(&inbox, "A-1"), 2);
    assert_eq!(
        counter(&inbox, "POISON"),
        0,
        "only the failing delivery was rolled back"
    );
    assert_eq!(identities(inbox.connection()), 2);
    let s = inbox.scope_stats(SCOPE).unwrap();
    assert_eq!(
        (s.processed, s.duplicates, s.conflicts, s.handler_failures),
        (2, 1, 1, 1)
    );
}

#[test]
fn invalid_delivery_is_refused_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir);
    let long = "x".repeat(300);
    for (d, what) in [
        (Delivery::new(SCOPE, "", "t", b""), "message id is empty"),
        (Delivery::new("", "e", "t", b""), "consumer scope is empty"),
        (
            Delivery::new(SCOPE, &long, "t", b""),
            "message id is 300 bytes, over the limit of 256",
        ),
    ] {
        match inbox.process(&d, bump) {
            Err(Error::InvalidDelivery(why)) => assert_eq!(why.to_string(), what),
            other => panic!("expected InvalidDelivery, got {other:?}"),
        }
    }
    // A batch with one invalid delivery writes nothing at all.
    let ds = [
        Delivery::new(SCOPE, "ok", "t", b"A-1"),
        Delivery::new(SCOPE, "", "t", b"A-1"),
    ];
    assert!(matches!(
        inbox.process_batch(&ds, bump),
        Err(Error::InvalidDelivery(_))
    ));
    assert_eq!(identities(inbox.connection()), 0);
}

#[test]
fn disk_full_is_a_storage_error_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir);
    assert!(matches!(
        inbox
            .process(&Delivery::new(SCOPE, "warm", "t", b"A-1"), bump)
            .unwrap(),
        Outcome::Processed
    ));
    let pages: i64 = inbox
        .connection()
        .query_row("PRAGMA page_count", [], |r| r.get(0))
        .unwrap();
    inbox
        .connection()
        .query_row(&format!("PRAGMA max_page_count = {pages}"), [], |_| Ok(()))
        .unwrap();

    // A handler whose write needs new pages.
    let big = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        bump(tx, d)?;
        tx.put("blob", &vec![7u8; 64 * 1024])?;
        Ok(())
    };
    let d = Delivery::new(SCOPE, "evt-full", "t", b"A-1");
    match inbox.process(&d, big) {
        Err(e @ Error::DiskFull) => assert!(e.is_retryable()),
        other => panic!("expected DiskFull, got {other:?}"),
    }
    // Also when the handler swallows the error: the inbox saw it and fails the batch anyway.
    let swallowing = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        bump(tx, d)?;
        let _ = tx.put("blob", &vec![7u8; 64 * 1024]);
        Ok(())
    };
    assert!(matches!(
        inbox.process(&d, swallowing),
        Err(Error::DiskFull)
    ));
    assert_eq!(
        inbox.status(SCOPE, None, "evt-full").unwrap(),
        Status::NotFound,
        "no identity without its effect"
    );
    assert_eq!(counter(&inbox, "A-1"), 1, "nothing half-applied");

    // The cause goes away; the redelivery is processed (not a duplicate).
    inbox
        .connection()
        .query_row("PRAGMA max_page_count = 1000000", [], |_| Ok(()))
        .unwrap();
    assert!(matches!(
        inbox.process(&d, big).unwrap(),
        Outcome::Processed
    ));
    assert_eq!(counter(&inbox, "A-1"), 2);
}

#[test]
fn read_only_connection_is_an_error_not_a_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir);
    let d = Delivery::new(SCOPE, "e", "t", b"A-1");
    inbox.scope_id(SCOPE).unwrap();
    inbox
        .connection()
        .execute_batch("PRAGMA query_only = ON")
        .unwrap();
    match inbox.process(&d, bump) {
        Err(e @ Error::ReadOnly { code }) => {
            assert_eq!(code & 0xff, 8);
            // Trouble of the storage, not of the delivery: retried, never dead-lettered.
            assert!(e.is_retryable(), "{e:?}");
        }
        other => panic!("expected ReadOnly, got {other:?}"),
    }
    inbox
        .connection()
        .execute_batch("PRAGMA query_only = OFF")
        .unwrap();
    assert!(matches!(
        inbox.process(&d, bump).unwrap(),
        Outcome::Processed
    ));
}

#[test]
fn busy_database_is_an_error_not_a_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(
        &path,
        Config::default().busy_timeout(Duration::from_millis(100)),
    )
    .unwrap();
    let d = Delivery::new(SCOPE, "e", "t", b"A-1");
    assert!(matches!(
        inbox.process(&d, bump).unwrap(),
        Outcome::Processed
    ));

    let other = Connection::open(&path).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    for delivery in [d, Delivery::new(SCOPE, "e2", "t", b"A-1")] {
        match inbox.process(&delivery, bump) {
            Err(e @ Error::Busy { .. }) => assert!(e.is_retryable()),
            other => panic!("expected Busy, got {other:?}"),
        }
    }
    other.execute_batch("ROLLBACK").unwrap();
    assert!(matches!(
        inbox
            .process(&Delivery::new(SCOPE, "e2", "t", b"A-1"), bump)
            .unwrap(),
        Outcome::Processed
    ));
    assert_eq!(counter(&inbox, "A-1"), 2);
}

#[test]
fn handler_storage_error_through_sql_fails_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    inbox
        .connection()
        .execute_batch("CREATE TABLE stock (sku TEXT PRIMARY KEY, qty INTEGER CHECK (qty >= 0))")
        .unwrap();
    // An application constraint is the handler's business: HandlerFailed, rolled back.
    let sell = |tx: &mut Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> {
        tx.sql()
            .execute("INSERT INTO stock VALUES ('A-1', -1)", [])?;
        Ok(())
    };
    assert!(matches!(
        inbox
            .process(&Delivery::new(SCOPE, "s1", "t", b""), sell)
            .unwrap(),
        Outcome::HandlerFailed(_)
    ));
    // A handler that ends the inbox's transaction fails the call.
    let rogue = |tx: &mut Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> {
        tx.sql().execute_batch("ROLLBACK")?;
        Ok(())
    };
    assert!(matches!(
        inbox.process(&Delivery::new(SCOPE, "s2", "t", b""), rogue),
        Err(Error::HandlerEndedTransaction)
    ));
    assert_eq!(identities(inbox.connection()), 0);
}

#[test]
fn two_threads_racing_give_one_effect() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    Inbox::open(&path, Config::default())
        .unwrap()
        .scope_id(SCOPE)
        .unwrap();
    let rounds = common::scaled(40);
    let threads = 4;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (path, barrier) = (path.clone(), barrier.clone());
            std::thread::spawn(move || {
                let mut inbox = Inbox::open(
                    &path,
                    Config::default().busy_timeout(Duration::from_secs(30)),
                )
                .unwrap();
                let mut processed = 0;
                for i in 0..rounds {
                    let id = format!("race-{i}");
                    barrier.wait();
                    match inbox
                        .process(&Delivery::new(SCOPE, &id, "t", b"A-1"), bump)
                        .unwrap()
                    {
                        Outcome::Processed => processed += 1,
                        Outcome::Duplicate => {}
                        o => panic!("unexpected {o:?}"),
                    }
                }
                processed
            })
        })
        .collect();
    let processed: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(
        processed, rounds,
        "exactly one thread processed each delivery"
    );
    let inbox = open(&dir);
    assert_eq!(counter(&inbox, "A-1"), rounds as i64);
    let s = inbox.scope_stats(SCOPE).unwrap();
    assert_eq!(
        (s.processed, s.duplicates),
        (rounds as u64, (rounds * (threads - 1)) as u64)
    );
}

/// Child side of the two-process race: processes the same ids as its siblings, prints its Processed count.
#[test]
#[ignore = "run as a child process by two_processes_racing_give_one_effect"]
fn child_racer() {
    let Ok(path) = std::env::var("EDGE_INBOX_CHILD_DB") else {
        return;
    };
    let n: usize = std::env::var("EDGE_INBOX_CHILD_N")
        .unwrap()
        .parse()
        .unwrap();
    let start = std::path::PathBuf::from(std::env::var("EDGE_INBOX_CHILD_GO").unwrap());
    assert!(common::wait_for_file(&start, Duration::from_secs(60)));
    let mut inbox = Inbox::open(
        &path,
        Config::default().busy_timeout(Duration::from_secs(60)),
    )
    .unwrap();
    let mut processed = 0;
    for i in 0..n {
        let id = format!("p-{i}");
        if let Outcome::Processed = inbox
            .process(&Delivery::new(SCOPE, &id, "t", b"A-1"), bump)
            .unwrap()
        {
            processed += 1;
        }
    }
    println!("\nPROCESSED={processed}");
}

#[test]
fn two_processes_racing_give_one_effect() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    Inbox::open(&path, Config::default())
        .unwrap()
        .scope_id(SCOPE)
        .unwrap();
    let go = dir.path().join("go");
    let n = common::scaled(150);
    let children: Vec<_> = (0..2)
        .map(|_| {
            common::child_command("child_racer")
                .env("EDGE_INBOX_CHILD_DB", &path)
                .env("EDGE_INBOX_CHILD_N", n.to_string())
                .env("EDGE_INBOX_CHILD_GO", &go)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    std::fs::write(&go, b"").unwrap();
    let mut total = 0;
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "child failed: {out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find_map(|l| l.split("PROCESSED=").nth(1))
            .expect("child report");
        total += line.trim().parse::<usize>().unwrap();
    }
    assert_eq!(total, n, "each delivery processed by exactly one process");
    let inbox = open(&dir);
    assert_eq!(counter(&inbox, "A-1"), n as i64);
}

/// Child side of the crash test: commits batches of 64 fresh ids until killed.
#[test]
#[ignore = "run as a child process by kill_mid_batch_leaves_no_partial_state"]
fn child_batcher() {
    let Ok(path) = std::env::var("EDGE_INBOX_CHILD_DB") else {
        return;
    };
    let ready = std::path::PathBuf::from(std::env::var("EDGE_INBOX_CHILD_READY").unwrap());
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    let slow = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        bump(tx, d)?;
        std::thread::sleep(Duration::from_micros(300));
        Ok(())
    };
    for round in 0..100_000 {
        let ids: Vec<String> = (0..64).map(|i| format!("r{round}-b{i}")).collect();
        let ds: Vec<_> = ids
            .iter()
            .map(|id| Delivery::new(SCOPE, id, "t", b"A-1"))
            .collect();
        inbox.process_batch(&ds, slow).unwrap();
        if round == 0 {
            std::fs::write(&ready, b"").unwrap();
        }
    }
}

#[test]
fn kill_mid_batch_leaves_no_partial_state() {
    let kills = common::scaled(8).max(3);
    for attempt in 0..kills {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inbox.db");
        let ready = dir.path().join("ready");
        let mut child = common::child_command("child_batcher")
            .env("EDGE_INBOX_CHILD_DB", &path)
            .env("EDGE_INBOX_CHILD_READY", &ready)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        assert!(
            common::wait_for_file(&ready, Duration::from_secs(120)),
            "child never committed a batch"
        );
        // Kill -9 at a varying moment: most of the time a batch transaction is open.
        std::thread::sleep(Duration::from_millis(10 + (attempt as u64 * 37) % 150));
        child.kill().unwrap();
        child.wait().unwrap();

        let mut inbox = open(&dir);
        let ids = identities(inbox.connection());
        assert!(
            ids >= 64,
            "attempt {attempt}: the first batch was committed"
        );
        assert_eq!(
            ids % 64,
            0,
            "attempt {attempt}: every batch is all or nothing, found {ids} identities"
        );
        assert_eq!(
            counter(&inbox, "A-1"),
            ids,
            "attempt {attempt}: identities and effects agree"
        );
        assert_eq!(
            inbox.scope_stats(SCOPE).unwrap().processed,
            ids as u64,
            "attempt {attempt}: counters agree"
        );
        // Redelivering the first batch changes nothing.
        let first: Vec<String> = (0..64).map(|i| format!("r0-b{i}")).collect();
        let first: Vec<_> = first
            .iter()
            .map(|id| Delivery::new(SCOPE, id, "t", b"A-1"))
            .collect();
        let outcomes = inbox.process_batch(&first, bump).unwrap();
        assert!(outcomes.iter().all(|o| matches!(o, Outcome::Duplicate)));
        assert_eq!(counter(&inbox, "A-1"), ids);
    }
}

#[test]
fn open_reports_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    // Not a database.
    let junk = dir.path().join("junk.db");
    std::fs::write(&junk, vec![0x42u8; 8192]).unwrap();
    match Inbox::open(&junk, Config::default()) {
        Err(Error::NotADatabase { path }) => assert_eq!(path, junk),
        other => panic!("expected NotADatabase, got {other:?}"),
    }
    // An SQLite file no version wrote (another application's, with a negative schema version).
    let foreign = dir.path().join("foreign.db");
    Connection::open(&foreign)
        .unwrap()
        .execute_batch("PRAGMA user_version = -1")
        .unwrap();
    match Inbox::open(&foreign, Config::default()) {
        Err(Error::NotADatabase { path }) => assert_eq!(path, foreign),
        other => panic!("expected NotADatabase, got {other:?}"),
    }
    // Written by a newer version.
    let newer = dir.path().join("newer.db");
    Connection::open(&newer)
        .unwrap()
        .execute_batch("PRAGMA user_version = 99")
        .unwrap();
    match Inbox::open(&newer, Config::default()) {
        Err(Error::SchemaTooNew {
            found: 99,
            supported,
        }) => assert_eq!(supported, edge_inbox::SCHEMA_VERSION),
        other => panic!("expected SchemaTooNew, got {other:?}"),
    }
    // A location that cannot be written (a directory that does not exist, and a read-only file system).
    let missing = dir.path().join("no/such/dir/inbox.db");
    assert!(matches!(
        Inbox::open(&missing, Config::default()),
        Err(Error::Open { .. })
    ));
    let ro = std::path::Path::new("/proc/edge-inbox-test.db");
    match Inbox::open(ro, Config::default()) {
        Err(e @ Error::Open { .. }) => {
            assert!(e.to_string().contains("/proc/edge-inbox-test.db"), "{e}")
        }
        other => panic!("expected Open error, got {other:?}"),
    }
}

#[test]
fn settings_are_applied_and_file_is_private() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let inbox = open(&dir);
    let conn = inbox.connection();
    let mode: String = conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    let sync: i64 = conn
        .query_row("PRAGMA synchronous", [], |r| r.get(0))
        .unwrap();
    let vacuum: i64 = conn
        .query_row("PRAGMA auto_vacuum", [], |r| r.get(0))
        .unwrap();
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(
        (mode.as_str(), sync, vacuum, version),
        ("wal", 2, 2, edge_inbox::SCHEMA_VERSION)
    );
    let perm = std::fs::metadata(inbox.path())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(perm, 0o600);
    drop(inbox);

    let normal = Inbox::open(
        dir.path().join("inbox.db"),
        Config::default().synchronous(Synchronous::Normal),
    )
    .unwrap();
    let sync: i64 = normal
        .connection()
        .query_row("PRAGMA synchronous", [], |r| r.get(0))
        .unwrap();
    assert_eq!(sync, 1);
    drop(normal);

    // The page cache: 512 KiB by default, as configured, and never below 64 KiB.
    let cache = |config: Config| -> i64 {
        Inbox::open(dir.path().join("inbox.db"), config)
            .unwrap()
            .connection()
            .query_row("PRAGMA cache_size", [], |r| r.get(0))
            .unwrap()
    };
    assert_eq!(cache(Config::default()), -512);
    assert_eq!(cache(Config::default().cache_size(3 << 20)), -3072);
    assert_eq!(cache(Config::default().cache_size(1000)), -64);
}

#[test]
fn concurrent_opens_of_a_new_file_agree() {
    // Opening a new file from several threads at once must not race the schema creation.
    for _ in 0..common::scaled(25) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inbox.db");
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let path = path.clone();
                std::thread::spawn(move || {
                    Inbox::open(
                        &path,
                        Config::default().busy_timeout(Duration::from_secs(30)),
                    )
                    .map(|_| ())
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap().unwrap();
        }
    }
}

#[test]
fn a_panicking_handler_leaves_no_transaction_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    let d = Delivery::new(SCOPE, "boom", "t", b"A-1");
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = inbox.process(
            &d,
            |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
                bump(tx, d)?;
                panic!("handler bug")
            },
        );
    }));
    assert!(caught.is_err());
    // Nothing of the panicked call is visible through the same inbox, and the write lock is free at once.
    assert!(matches!(
        inbox.status(SCOPE, None, "boom").unwrap(),
        edge_inbox::Status::NotFound
    ));
    assert_eq!(counter(&inbox, "A-1"), 0);
    let at_once = Inbox::open(
        &path,
        Config::default().busy_timeout(Duration::from_millis(200)),
    );
    assert!(matches!(
        at_once
            .unwrap()
            .process(&Delivery::new(SCOPE, "first", "t", b"A-0"), bump)
            .unwrap(),
        Outcome::Processed
    ));
    // The same inbox goes on, and nothing of the panicked call stays.
    assert!(matches!(
        inbox.process(&d, bump).unwrap(),
        Outcome::Processed
    ));
    assert_eq!(counter(&inbox, "A-1"), 1);
    // And the write lock is free for other connections.
    let other = Inbox::open(
        &path,
        Config::default().busy_timeout(Duration::from_millis(200)),
    );
    let mut other = other.unwrap();
    assert!(matches!(
        other
            .process(&Delivery::new(SCOPE, "other", "t", b"A-1"), bump)
            .unwrap(),
        Outcome::Processed
    ));
}

#[test]
fn a_deferred_constraint_refused_at_commit_fails_only_its_delivery() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = open(&dir);
    inbox
        .connection()
        .execute_batch(
            "CREATE TABLE sku (id TEXT PRIMARY KEY);
             INSERT INTO sku VALUES ('A-1');
             CREATE TABLE reservation (sku TEXT REFERENCES sku (id) DEFERRABLE INITIALLY DEFERRED);",
        )
        .unwrap();
    // SQLite checks a deferred foreign key only at COMMIT: the handler itself succeeds.
    let reserve = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        tx.sql().execute(
            "INSERT INTO reservation VALUES (?1)",
            [std::str::from_utf8(d.payload)?],
        )?;
        bump(tx, d)?;
        Ok(())
    };
    let ds = [
        Delivery::new(SCOPE, "r1", "t", b"A-1"),
        Delivery::new(SCOPE, "r2", "t", b"NO-SUCH-SKU"),
        Delivery::new(SCOPE, "r3", "t", b"A-1"),
    ];
    let outcomes = inbox.process_batch(&ds, reserve).unwrap();
    let names: Vec<_> = outcomes.iter().map(Outcome::name).collect();
    assert_eq!(names, ["processed", "handler-failed", "processed"]);
    match &outcomes[1] {
        Outcome::HandlerFailed(e) => {
            assert!(format!("{e:#}").contains("deferred constraint"), "{e:#}")
        }
        _ => unreachable!(),
    }
    assert_eq!(counter(&inbox, "A-1"), 2);
    assert_eq!(counter(&inbox, "NO-SUCH-SKU"), 0);
    assert_eq!(inbox.status(SCOPE, None, "r2").unwrap(), Status::NotFound);
    let s = inbox.scope_stats(SCOPE).unwrap();
    assert_eq!((s.processed, s.handler_failures), (2, 1));
}

/// The inbox waits for another connection's write lock up to its busy timeout, in short sleeps: a lock
/// released within the timeout is waited for, one held longer gives `Busy`, and not before the timeout.
#[test]
fn lock_waits_last_the_busy_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let timeout = Duration::from_millis(300);
    let mut inbox = Inbox::open(&path, Config::default().busy_timeout(timeout)).unwrap();
    inbox.scope_id(SCOPE).unwrap();

    let other = Connection::open(&path).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let started = std::time::Instant::now();
    match inbox.process(&Delivery::new(SCOPE, "held", "t", b"A-1"), bump) {
        Err(Error::Busy { .. }) => {}
        other => panic!("expected Busy, got {other:?}"),
    }
    assert!(
        started.elapsed() >= timeout,
        "gave up after {:?}, before the timeout",
        started.elapsed()
    );

    // Released a little after the wait began: the same call succeeds.
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        other.execute_batch("ROLLBACK").unwrap();
    });
    assert!(matches!(
        inbox
            .process(&Delivery::new(SCOPE, "held", "t", b"A-1"), bump)
            .unwrap(),
        Outcome::Processed
    ));
    releaser.join().unwrap();
}

/// Bad input the docs are silent on is refused with a clear error, not accepted and paid for later: a busy
/// timeout meant as "for ever", a scope name over the limit given to `scope_id`, an empty outbox producer,
/// and a batch whose invalid delivery comes after a new scope (nothing of the batch is written).
#[test]
fn edge_settings_and_names_get_clear_answers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let forever = Config::default().busy_timeout(std::time::Duration::MAX);
    let opened = std::panic::catch_unwind(|| Inbox::open(&path, forever).map(drop));
    assert!(matches!(opened, Ok(Ok(()))), "{opened:?}");

    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    let long = "s".repeat(Limits::default().max_scope_len + 1);
    match inbox.scope_id(&long) {
        Err(Error::InvalidDelivery(InvalidDelivery::TooLong { field: "scope", .. })) => {}
        other => panic!("{other:?}"),
    }
    match inbox.quarantine(&long, "t", b"x", "why") {
        Err(Error::InvalidDelivery(InvalidDelivery::TooLong { field: "scope", .. })) => {}
        other => panic!("{other:?}"),
    }

    let batch = [
        Delivery::new("fresh-scope", "a", "t", b"x"),
        Delivery::new(SCOPE, "", "t", b"x"),
    ];
    match inbox.process_batch(&batch, |_: &mut Tx<'_>, _: &Delivery<'_>| Ok(())) {
        Err(Error::InvalidDelivery(InvalidDelivery::EmptyMessageId)) => {}
        other => panic!("{other:?}"),
    }
    let fresh: i64 = inbox
        .connection()
        .query_row(
            "SELECT count(*) FROM scopes WHERE name = 'fresh-scope'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(fresh, 0, "a scope written for a batch refused as invalid");
    drop(inbox);

    match Inbox::open(&path, Config::default().outbox_producer("")) {
        Err(Error::InvalidArgument(why)) => assert!(why.contains("outbox producer"), "{why}"),
        other => panic!("{:?}", other.map(drop)),
    }
}

/// The file's identity key row lost or cut short (damage, an edit): every stored identity would be missed
/// under another key and every redelivery applied again, so the file is refused, as one that lost its
/// identity order is.
#[test]
fn a_file_whose_identity_key_is_missing_or_damaged_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let d = Delivery::new(SCOPE, "evt-1", "t", b"x");
    let ok = |_: &mut Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> { Ok(()) };
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    assert!(matches!(inbox.process(&d, ok), Ok(Outcome::Processed)));
    drop(inbox);
    let conn = Connection::open(&path).unwrap();
    let key: Vec<u8> = conn
        .query_row(
            "SELECT value FROM inbox_meta WHERE name = 'id_key'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    for damage in [
        "DELETE FROM inbox_meta WHERE name = 'id_key'",
        "UPDATE inbox_meta SET value = zeroblob(32) WHERE name = 'id_key'",
    ] {
        conn.execute_batch(damage).unwrap();
        match Inbox::open(&path, Config::default()) {
            Err(Error::InvalidArgument(why)) => assert!(why.contains("identity key"), "{why}"),
            other => panic!("{damage}: {:?}", other.map(drop)),
        }
        conn.execute(
            "INSERT OR REPLACE INTO inbox_meta (name, value) VALUES ('id_key', ?1)",
            [&key],
        )
        .unwrap();
    }
    drop(conn);
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    assert!(matches!(inbox.process(&d, ok), Ok(Outcome::Duplicate)));
}
