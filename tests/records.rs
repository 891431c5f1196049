//! Issue 21, items 3-6: a handler's errors from its own other databases, redelivered quarantines and conflicts,
//! a known message id under a new sequence in a watermark scope, and bounded, pruned quarantine records.

use std::time::Duration;

use edge_inbox::{
    inspect, Config, Delivery, Error, Inbox, Outcome, Pruning, RetentionPolicy, Tx, Worker,
    WorkerConfig,
};
use rusqlite::{Connection, OpenFlags};

mod common;

const DAY: i64 = 86_400;

fn ok(_: &mut Tx<'_>, _: &Delivery<'_>) -> anyhow::Result<()> {
    Ok(())
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn count(conn: &Connection, sql: &str) -> i64 {
    conn.query_row(sql, [], |r| r.get(0)).unwrap()
}

/// A handler whose own lookup database cannot be opened: SQLITE_CANTOPEN from a connection that is not the
/// inbox's.
fn foreign_lookup(
    dir: &std::path::Path,
) -> impl FnMut(&mut Tx<'_>, &Delivery<'_>) -> anyhow::Result<()> {
    let missing = dir.join("no-such-dir").join("lookup.db");
    move |_tx: &mut Tx<'_>, _d: &Delivery<'_>| {
        let lookup = Connection::open_with_flags(&missing, OpenFlags::SQLITE_OPEN_READ_ONLY)?;
        lookup.query_row("SELECT 1", [], |_| Ok(()))?;
        Ok(())
    }
}

#[test]
fn a_foreign_databases_cantopen_is_a_handler_failure_not_inbox_storage_trouble() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let mut handler = foreign_lookup(dir.path());
    let d = Delivery::new("s", "evt-1", "t", b"x");
    match inbox.process(&d, &mut handler) {
        Ok(Outcome::HandlerFailed(e)) => {
            let code = e
                .downcast_ref::<rusqlite::Error>()
                .and_then(|e| e.sqlite_error_code());
            assert_eq!(code, Some(rusqlite::ErrorCode::CannotOpen), "{e:#}");
        }
        other => panic!("expected a handler failure, got {other:?}"),
    }
    // In a batch too, and the delivery beside it commits.
    let both = [
        Delivery::new("s", "evt-2", "t", b"x"),
        Delivery::new("s", "evt-3", "t", b"y"),
    ];
    let mut first = true;
    let out = inbox
        .process_batch(&both, |tx: &mut Tx<'_>, d: &Delivery<'_>| {
            if std::mem::take(&mut first) {
                handler(tx, d)
            } else {
                ok(tx, d)
            }
        })
        .unwrap();
    assert!(matches!(out[0], Outcome::HandlerFailed(_)), "{:?}", out[0]);
    assert!(matches!(out[1], Outcome::Processed), "{:?}", out[1]);
    let st = inbox.scope_stats("s").unwrap();
    assert_eq!((st.handler_failures, st.processed), (2, 1));
}

/// A handler that interrupts its own read on the inbox's connection (a progress handler guarding a slow query)
/// caused the failure itself: a handler failure, whether it returns the error or goes on without the read; an
/// interrupted write makes SQLite end the transaction, which fails the call as such.
#[test]
fn an_interrupt_the_handler_causes_is_its_own_failure_not_storage_trouble() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    inbox
        .connection()
        .execute_batch("CREATE TABLE marks (id TEXT PRIMARY KEY)")
        .unwrap();
    fn interrupted<T>(
        tx: &Tx<'_>,
        sql: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<T> {
        tx.sql().progress_handler(1, Some(|| true)).unwrap();
        let r = sql(tx.sql());
        tx.sql().progress_handler(1, None::<fn() -> bool>).unwrap();
        r
    }
    let read = |tx: &Tx<'_>| {
        interrupted(tx, |c| {
            c.query_row("SELECT count(*) FROM marks", [], |r| r.get::<_, i64>(0))
        })
    };
    let mark = |tx: &Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        tx.sql()
            .execute("INSERT INTO marks (id) VALUES (?1)", [d.message_id])?;
        Ok(())
    };
    let d = Delivery::new("s", "evt-1", "t", b"x");
    match inbox.process(&d, |tx: &mut Tx<'_>, d: &Delivery<'_>| {
        mark(tx, d)?;
        read(tx)?;
        Ok(())
    }) {
        Ok(Outcome::HandlerFailed(e)) => {
            let code = e
                .downcast_ref::<rusqlite::Error>()
                .and_then(|e| e.sqlite_error_code());
            assert_eq!(
                code,
                Some(rusqlite::ErrorCode::OperationInterrupted),
                "{e:#}"
            );
        }
        other => panic!("expected a handler failure, got {other:?}"),
    }
    // Swallowed: the interrupted read changed nothing, and the rest of the effect commits with the identity.
    let d = Delivery::new("s", "evt-2", "t", b"x");
    let out = inbox.process(&d, |tx: &mut Tx<'_>, d: &Delivery<'_>| {
        assert!(read(tx).is_err());
        mark(tx, d)
    });
    assert!(matches!(out, Ok(Outcome::Processed)), "{out:?}");
    // An interrupted write: SQLite rolled the transaction back.
    let d = Delivery::new("s", "evt-3", "t", b"x");
    let out = inbox.process(&d, |tx: &mut Tx<'_>, d: &Delivery<'_>| {
        interrupted(tx, |c| {
            c.execute("INSERT INTO marks (id) VALUES (?1)", [d.message_id])
        })?;
        Ok(())
    });
    assert!(
        matches!(out, Err(Error::HandlerEndedTransaction)),
        "{out:?}"
    );
    let marks = count(
        inbox.connection(),
        "SELECT group_concat(id) IS 'evt-2' FROM marks",
    );
    assert_eq!(
        marks, 1,
        "only the delivery that went on without its read left a mark"
    );
    // Through the inbox's own API, swallowed: the delivery fails (it may have gone on without the value),
    // the batch does not.
    let d = Delivery::new("s", "evt-4", "t", b"x");
    let out = inbox.process(&d, |tx: &mut Tx<'_>, d: &Delivery<'_>| {
        tx.sql().progress_handler(1, Some(|| true)).unwrap();
        let n = tx.get::<i64>("n").ok().flatten().unwrap_or_default();
        tx.sql().progress_handler(1, None::<fn() -> bool>).unwrap();
        tx.sql().execute(
            "INSERT INTO marks (id) VALUES (?1)",
            [format!("{}-{n}", d.message_id)],
        )?;
        Ok(())
    });
    assert!(matches!(out, Ok(Outcome::HandlerFailed(_))), "{out:?}");
    let st = inbox.scope_stats("s").unwrap();
    assert_eq!((st.handler_failures, st.processed), (2, 1));
    assert_eq!(count(inbox.connection(), "SELECT count(*) FROM marks"), 1);
}

#[test]
fn a_foreign_databases_cantopen_in_the_worker_uses_attempts_and_is_dead_lettered() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    inbox
        .receive(&Delivery::new("s", "evt-1", "t", b"x"))
        .unwrap();
    let config = WorkerConfig::default()
        .max_attempts(2)
        .backoff(Duration::ZERO, Duration::ZERO);
    let mut worker = Worker::open(&path, Config::default(), "s", config).unwrap();
    let mut handler = foreign_lookup(dir.path());
    let first = worker.run_once(&mut handler).unwrap();
    assert_eq!((first.claimed, first.retrying), (1, 1), "{first:?}");
    let second = worker.run_once(&mut handler).unwrap();
    assert_eq!((second.claimed, second.dead_lettered), (1, 1), "{second:?}");
    let st = inbox.scope_stats("s").unwrap();
    assert_eq!((st.handler_failures, st.dead_lettered), (2, 1));
}

#[test]
fn storage_trouble_on_the_inbox_connection_through_tx_sql_is_still_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    inbox
        .connection()
        .execute_batch("CREATE TABLE bodies (b BLOB)")
        .unwrap();
    assert!(matches!(
        inbox
            .process(&Delivery::new("s", "warm", "t", b"x"), ok)
            .unwrap(),
        Outcome::Processed
    ));
    let pages: i64 = count(inbox.connection(), "PRAGMA page_count");
    inbox
        .connection()
        .execute_batch(&format!("PRAGMA max_page_count = {pages}"))
        .unwrap();
    let big = vec![7u8; 256 * 1024];
    let d = Delivery::new("s", "big", "t", &big);
    // The handler returns the inbox connection's SQLITE_FULL, wrapped in context of its own.
    let err = inbox
        .process(&d, |tx: &mut Tx<'_>, d: &Delivery<'_>| {
            use anyhow::Context;
            tx.sql()
                .execute("INSERT INTO bodies (b) VALUES (?1)", [d.payload])
                .context("storing the body")?;
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(err, Error::DiskFull), "{err:?}");
    // A handler that meets it, then a foreign database's error, and returns the latter: still the inbox's
    // trouble (its connection's last failure is SQLITE_FULL), never a handler failure.
    let missing = dir.path().join("no-such-dir").join("lookup.db");
    let err = inbox
        .process(&d, |tx: &mut Tx<'_>, d: &Delivery<'_>| {
            let _ = tx
                .sql()
                .execute("INSERT INTO bodies (b) VALUES (?1)", [d.payload]);
            Connection::open_with_flags(&missing, OpenFlags::SQLITE_OPEN_READ_ONLY)?;
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(err, Error::DiskFull), "{err:?}");
    // A handler that swallows it and returns Ok: SQLite rolled the whole transaction back (SQLITE_FULL in a
    // statement without a statement journal), and the call is still the inbox's full disk (retryable, never
    // acked), not a handler that ended the transaction (which the consumer would dead-letter and ack).
    let err = inbox
        .process(&d, |tx: &mut Tx<'_>, d: &Delivery<'_>| {
            let _ = tx
                .sql()
                .execute("INSERT INTO bodies (b) VALUES (?1)", [d.payload]);
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(err, Error::DiskFull), "{err:?}");
    assert!(err.is_retryable());
    assert_eq!(inbox.scope_stats("s").unwrap().handler_failures, 0);
    assert_eq!(
        inbox.status("s", None, "big").unwrap(),
        edge_inbox::Status::NotFound
    );
}

#[test]
fn a_redelivered_quarantine_is_one_record_with_two_arrivals() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let a = inbox.quarantine("s", "t/1", b"garbage", "no id").unwrap();
    let b = inbox.quarantine("s", "t/1", b"garbage", "no id").unwrap();
    assert_eq!(a, b, "the same record");
    let other = inbox
        .quarantine("s", "t/1", b"other garbage", "no id")
        .unwrap();
    assert_ne!(a, other);
    // A delivery with an identity, over a limit, redelivered (a lost PUBACK).
    let d = Delivery::new("s", "evt-1", "t/2", b"too big");
    let c = inbox.quarantine_delivery(&d, "over a limit").unwrap();
    let e = inbox.quarantine_delivery(&d, "over a limit").unwrap();
    assert_eq!(c, e);
    assert_eq!(
        count(inbox.connection(), "SELECT count(*) FROM quarantine"),
        3
    );
    let st = inbox.scope_stats("s").unwrap();
    assert_eq!(
        (st.quarantined, st.quarantine_records),
        (5, 3),
        "arrivals, records"
    );
    let rows = inspect::quarantine(inbox.connection(), Some("s"), 10).unwrap();
    assert_eq!(
        rows.iter().map(|r| r.arrivals).collect::<Vec<_>>(),
        vec![2, 1, 2]
    );
    assert!(rows[0].last_at >= rows[0].at);
    let rep = &inspect::stats(inbox.connection(), Some("s")).unwrap()[0];
    assert_eq!((rep.quarantined, rep.quarantine_records), (5, 3));
}

#[test]
fn a_redelivered_conflict_is_one_record_with_two_arrivals() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let d = Delivery::new("s", "evt-1", "t", b"v1");
    assert!(matches!(inbox.process(&d, ok).unwrap(), Outcome::Processed));
    let changed = Delivery::new("s", "evt-1", "t", b"v2");
    for _ in 0..2 {
        assert!(matches!(
            inbox.process(&changed, ok).unwrap(),
            Outcome::Conflict { .. }
        ));
    }
    // Through the deferred receive path as well.
    assert!(matches!(
        inbox.receive(&changed).unwrap(),
        Outcome::Conflict { .. }
    ));
    assert_eq!(
        count(inbox.connection(), "SELECT count(*) FROM conflicts"),
        1
    );
    let st = inbox.scope_stats("s").unwrap();
    assert_eq!(
        (st.conflicts, st.conflict_records),
        (3, 1),
        "arrivals, records"
    );
    let rows = inspect::conflicts(inbox.connection(), Some("s"), 10).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].arrivals, 3);
    let rep = &inspect::stats(inbox.connection(), Some("s")).unwrap()[0];
    assert_eq!((rep.conflicts, rep.conflict_records), (3, 1));
}

fn watermark_inbox(dir: &std::path::Path) -> Inbox {
    let mut inbox = Inbox::open(dir.join("inbox.db"), Config::default()).unwrap();
    inbox
        .set_retention("s", &RetentionPolicy::new().sequence_watermarks(1))
        .unwrap();
    inbox
}

#[test]
fn a_known_id_under_a_new_sequence_is_recognised_in_a_watermark_scope() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = watermark_inbox(dir.path());
    let applied = std::cell::Cell::new(0);
    let count_effect = |_: &mut Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> {
        applied.set(applied.get() + 1);
        Ok(())
    };
    let first = Delivery::new("s", "evt-42", "t", b"v")
        .with_producer("p")
        .with_sequence(1);
    assert!(matches!(
        inbox.process(&first, count_effect).unwrap(),
        Outcome::Processed
    ));
    let again = Delivery::new("s", "evt-42", "t", b"v")
        .with_producer("p")
        .with_sequence(2);
    let o = inbox.process(&again, count_effect).unwrap();
    assert!(matches!(o, Outcome::Duplicate), "{o:?}");
    let changed = Delivery::new("s", "evt-42", "t", b"w")
        .with_producer("p")
        .with_sequence(3);
    let o = inbox.process(&changed, count_effect).unwrap();
    assert!(matches!(o, Outcome::Conflict { .. }), "{o:?}");
    // The same id again far above the mark, and below it (its sequence 1 is still in the window).
    let later = Delivery::new("s", "evt-42", "t", b"v")
        .with_producer("p")
        .with_sequence(50);
    assert!(matches!(
        inbox.process(&later, count_effect).unwrap(),
        Outcome::Duplicate
    ));
    // A new message on the next sequence is applied: the repeats left no gap behind them.
    let next = Delivery::new("s", "evt-43", "t", b"v")
        .with_producer("p")
        .with_sequence(4);
    assert!(matches!(
        inbox.process(&next, count_effect).unwrap(),
        Outcome::Processed
    ));
    assert_eq!(applied.get(), 2);
    // Another id on a sequence a repeat claimed (2) has nothing to be compared with: quarantined, not applied.
    let reuse = Delivery::new("s", "evt-99", "t", b"v")
        .with_producer("p")
        .with_sequence(2);
    let o = inbox.process(&reuse, count_effect).unwrap();
    assert!(matches!(o, Outcome::SequenceConflict { .. }), "{o:?}");
    // Within one batch too: the second copy is found by its id.
    let batch = [
        Delivery::new("s", "evt-44", "t", b"v")
            .with_producer("p")
            .with_sequence(5),
        Delivery::new("s", "evt-44", "t", b"v")
            .with_producer("p")
            .with_sequence(6),
    ];
    let out = inbox.process_batch(&batch, count_effect).unwrap();
    assert!(
        matches!(out[..], [Outcome::Processed, Outcome::Duplicate]),
        "{out:?}"
    );
    assert_eq!(applied.get(), 3);
    // Far ahead of the mark, a repeat claims nothing: no exception that would never close, and the number
    // is left for the message that carries it.
    let far = Delivery::new("s", "evt-42", "t", b"v")
        .with_producer("p")
        .with_sequence(1_000_000);
    assert!(matches!(
        inbox.process(&far, count_effect).unwrap(),
        Outcome::Duplicate
    ));
    let wm = inbox.watermark("s", "p").unwrap();
    assert_eq!(wm.high, Some(6), "{wm:?}");
    assert_eq!(wm.exceptions, vec![50]);
    let owner = Delivery::new("s", "evt-1000000", "t", b"v")
        .with_producer("p")
        .with_sequence(1_000_000);
    assert!(matches!(
        inbox.process(&owner, count_effect).unwrap(),
        Outcome::Processed
    ));
    let st = inbox.scope_stats("s").unwrap();
    assert_eq!(
        (
            st.processed,
            st.duplicates,
            st.conflicts,
            st.sequence_conflicts
        ),
        (4, 4, 1, 1)
    );
}

#[test]
fn a_known_id_under_a_new_sequence_is_not_stored_again_by_receive() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = watermark_inbox(dir.path());
    let first = Delivery::new("s", "evt-42", "t", b"v")
        .with_producer("p")
        .with_sequence(1);
    assert!(matches!(inbox.receive(&first).unwrap(), Outcome::Received));
    let again = Delivery::new("s", "evt-42", "t", b"v")
        .with_producer("p")
        .with_sequence(2);
    let o = inbox.receive(&again).unwrap();
    assert!(matches!(o, Outcome::Duplicate), "{o:?}");
    let changed = Delivery::new("s", "evt-42", "t", b"w")
        .with_producer("p")
        .with_sequence(3);
    let o = inbox.receive(&changed).unwrap();
    assert!(matches!(o, Outcome::Conflict { .. }), "{o:?}");
    assert_eq!(
        count(inbox.connection(), "SELECT count(*) FROM messages"),
        1
    );
    let mut worker = Worker::new(
        Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap(),
        "s",
        WorkerConfig::default(),
    )
    .unwrap();
    assert_eq!(worker.run_once(&mut ok).unwrap().processed, 1);
}

/// A cheap, deterministic filler: garbage that differs per delivery.
fn garbage(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

fn file_bytes(path: &std::path::Path) -> u64 {
    let wal = std::path::PathBuf::from(format!("{}-wal", path.display()));
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
        + std::fs::metadata(wal).map(|m| m.len()).unwrap_or(0)
}

#[test]
fn a_hundred_quarantined_8_mib_deliveries_grow_the_file_by_less_than_1_mib() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    inbox.quarantine("s", "t", b"warm", "warm up").unwrap();
    let checkpoint = |inbox: &Inbox| {
        inbox
            .connection()
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .unwrap();
    };
    checkpoint(&inbox);
    let before = file_bytes(&path);
    let mut payload = vec![0u8; 8 << 20];
    garbage(&mut payload, 1);
    // 100 natively; fewer under an emulator (EDGE_INBOX_TEST_SCALE), where hashing 8 MiB is slow.
    let n = common::scaled(100) as u64;
    for i in 0..n {
        // A different delivery each time: its first bytes differ.
        payload[..8].copy_from_slice(&i.to_le_bytes());
        inbox
            .quarantine(
                "s",
                "sensors/raw",
                &payload,
                "delivery carries no application message id",
            )
            .unwrap();
    }
    checkpoint(&inbox);
    let grown = file_bytes(&path) - before;
    eprintln!("{n} quarantined deliveries of 8 MiB grew the file by {grown} bytes");
    assert!(grown < 1 << 20, "grew by {grown} bytes");
    assert_eq!(
        count(inbox.connection(), "SELECT count(*) FROM quarantine"),
        n as i64 + 1
    );
    let rows = inspect::quarantine(inbox.connection(), Some("s"), 200).unwrap();
    assert_eq!(
        rows[1].payload_bytes,
        8 << 20,
        "the full length is recorded"
    );
    payload[..8].copy_from_slice(&0u64.to_le_bytes());
    let hash: String = xxhash_rust::xxh3::xxh3_128(&payload)
        .to_be_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(rows[1].payload_hash.as_deref(), Some(hash.as_str()));
    let stored: Vec<u8> = inbox
        .connection()
        .query_row(
            "SELECT payload FROM quarantine WHERE id = ?1",
            [rows[1].id],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(stored, payload[..edge_inbox::QUARANTINE_PREFIX]);
}

#[test]
fn pruning_deletes_old_quarantine_and_conflict_records_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    inbox
        .set_retention(
            "s",
            &RetentionPolicy::new().quarantine_and_conflicts(Duration::from_secs(7 * DAY as u64)),
        )
        .unwrap();
    for scope in ["s", "keep"] {
        inbox.quarantine(scope, "t", b"garbage", "no id").unwrap();
        let d = Delivery::new(scope, "evt-1", "t", b"v1");
        assert!(matches!(inbox.process(&d, ok).unwrap(), Outcome::Processed));
        let changed = Delivery::new(scope, "evt-1", "t", b"v2");
        assert!(matches!(
            inbox.process(&changed, ok).unwrap(),
            Outcome::Conflict { .. }
        ));
        inbox
            .receive(&Delivery::new(scope, "evt-2", "t", b"pending"))
            .unwrap();
    }
    let c = inbox.connection();
    let totals = |c: &Connection| {
        (
            count(c, "SELECT count(*) FROM identities"),
            count(c, "SELECT count(*) FROM messages"),
            count(c, "SELECT count(*) FROM quarantine"),
            count(c, "SELECT count(*) FROM conflicts"),
        )
    };
    assert_eq!(totals(c), (4, 2, 2, 2));
    // Not old enough yet: nothing goes.
    let report = inbox
        .prune(&Pruning::default().as_of(now() + 6 * DAY))
        .unwrap();
    assert_eq!((report.quarantine_pruned, report.conflicts_pruned), (0, 0));
    assert_eq!(totals(inbox.connection()), (4, 2, 2, 2));
    // Older than the policy's age: the records of "s" go, those of "keep" (no policy) and everything else stay.
    let report = inbox
        .prune(&Pruning::default().as_of(now() + 8 * DAY))
        .unwrap();
    assert_eq!((report.quarantine_pruned, report.conflicts_pruned), (1, 1));
    assert_eq!(totals(inbox.connection()), (4, 2, 1, 1));
    assert_eq!(
        inspect::quarantine(inbox.connection(), Some("keep"), 10)
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        inspect::conflicts(inbox.connection(), Some("keep"), 10)
            .unwrap()
            .len(),
        1
    );
    let st = inbox.scope_stats("s").unwrap();
    assert_eq!(
        (st.quarantined, st.conflicts),
        (1, 1),
        "counters are history: pruning keeps them"
    );
}

#[test]
fn a_file_of_schema_version_3_is_migrated_to_bounded_merged_records() {
    use edge_inbox::{Fingerprint, IdHash};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v3.db");
    let big: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    let id = IdHash::of(Some("p"), "evt-42");
    {
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL; PRAGMA journal_mode = WAL;")
            .unwrap();
        conn.execute_batch(include_str!("fixtures/schema_v3.sql"))
            .unwrap();
        conn.execute_batch(
            "PRAGMA user_version = 3; \
             INSERT INTO inbox_meta (name, value) VALUES ('id_key', NULL), ('created_at', 1735689600); \
             INSERT INTO scopes (id, name, created_at) VALUES (1, 's', 1735689600); \
             INSERT INTO scope_stats (scope_id, conflicts, quarantined) VALUES (1, 3, 2); \
             INSERT INTO retention (scope_id, watermarks, first_sequence) VALUES (1, 1, 1); \
             INSERT INTO watermarks (scope_id, producer, high) VALUES (1, 'p', 2);",
        )
        .unwrap();
        // The defect of version 3: one message id under two sequences.
        for seq in [1, 2] {
            conn.execute(
                "INSERT INTO watermark_recent (scope_id, producer, sequence, id_hash, fingerprint) \
                 VALUES (1, 'p', ?1, ?2, ?3)",
                (seq, id.as_bytes(), Fingerprint::of("t", b"v").0 as i64),
            )
            .unwrap();
        }
        // A conflicting delivery recorded twice, and another one once.
        for (received, at) in [(7i64, 100i64), (7, 200), (8, 300)] {
            conn.execute(
                "INSERT INTO conflicts (scope_id, id_hash, producer, message_id, topic, stored_fingerprint, \
                 received_fingerprint, at) VALUES (1, ?1, 'p', 'evt-1', 't', 5, ?2, ?3)",
                (IdHash::of(Some("p"), "evt-1").as_bytes(), received, at),
            )
            .unwrap();
        }
        // A quarantined delivery stored whole, twice.
        for at in [100i64, 200] {
            conn.execute(
                "INSERT INTO quarantine (scope_id, topic, payload, reason, at) VALUES (1, 't/q', ?1, 'no id', ?2)",
                (&big, at),
            )
            .unwrap();
        }
    }
    // Read-only tools read it as it is.
    let ro = edge_inbox::open_read_only(&path).unwrap();
    let rows = inspect::quarantine(&ro, Some("s"), 10).unwrap();
    assert_eq!(
        (
            rows.len(),
            rows[0].payload_bytes,
            rows[0].payload_hash.clone()
        ),
        (2, 10_000, None)
    );
    let rep = &inspect::stats(&ro, Some("s")).unwrap()[0];
    assert_eq!(
        (rep.conflicts, rep.conflict_records, rep.quarantine_records),
        (3, 3, 2)
    );
    drop(ro);

    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    assert_eq!(edge_inbox::SCHEMA_VERSION, 6);
    assert_eq!(count(inbox.connection(), "PRAGMA user_version"), 6);
    // Conflicts merged per (identity, received content), arrivals and times kept.
    let conflicts = inspect::conflicts(inbox.connection(), Some("s"), 10).unwrap();
    let merged: Vec<(u64, i64, i64)> = conflicts
        .iter()
        .map(|c| (c.arrivals, c.at, c.last_at))
        .collect();
    assert_eq!(merged, vec![(2, 100, 200), (1, 300, 300)]);
    // Quarantine rows bounded: prefix, full length, hash of the whole payload.
    let rows = inspect::quarantine(inbox.connection(), Some("s"), 10).unwrap();
    let hash: String = xxhash_rust::xxh3::xxh3_128(&big)
        .to_be_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    for r in &rows {
        assert_eq!(
            (r.payload_bytes, r.payload_hash.as_deref()),
            (10_000, Some(hash.as_str()))
        );
    }
    assert_eq!(
        count(
            inbox.connection(),
            "SELECT max(length(payload)) FROM quarantine"
        ),
        edge_inbox::QUARANTINE_PREFIX as i64
    );
    // Counters keep their figures (arrivals); the record counts start at the rows now held.
    let st = inbox.scope_stats("s").unwrap();
    assert_eq!(
        (
            st.conflicts,
            st.conflict_records,
            st.quarantined,
            st.quarantine_records
        ),
        (3, 2, 2, 2)
    );
    // The id keeps one row in the window, and is recognised under a new sequence.
    assert_eq!(
        count(inbox.connection(), "SELECT count(*) FROM watermark_recent"),
        1
    );
    let again = Delivery::new("s", "evt-42", "t", b"v")
        .with_producer("p")
        .with_sequence(3);
    assert!(matches!(
        inbox.process(&again, ok).unwrap(),
        Outcome::Duplicate
    ));
    // Retention of records can now be set on the migrated file.
    inbox
        .set_retention(
            "s",
            &RetentionPolicy::new()
                .sequence_watermarks(1)
                .quarantine_and_conflicts(Duration::from_secs(DAY as u64)),
        )
        .unwrap();
    // Stamped at 1970, a time the file cannot be from: the first pass ages them from its own time instead,
    // and a later one past their age deletes them.
    let report = inbox.prune(&Pruning::default().as_of(now())).unwrap();
    assert_eq!((report.quarantine_pruned, report.conflicts_pruned), (0, 0));
    let report = inbox
        .prune(&Pruning::default().as_of(now() + 2 * DAY))
        .unwrap();
    assert_eq!((report.quarantine_pruned, report.conflicts_pruned), (2, 2));
}
