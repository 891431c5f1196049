//! Identity layouts (`IdOrder`): chosen when a file is created, kept by the file, the same guarantee under
//! each, and fewer pages written per batch on a file with history when ids grow with time.

use common::identity_keys as keys;
use edge_inbox::{
    inspect, Config, Delivery, Error, IdOrder, Inbox, Outcome, RetentionPolicy, Status, Worker,
    WorkerConfig,
};
use rusqlite::Connection;

mod common;

const SCOPE: &str = "orders";

fn ok(_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>) -> anyhow::Result<()> {
    Ok(())
}

#[test]
fn every_layout_keeps_the_guarantee_and_the_file_keeps_its_layout() {
    for order in [
        IdOrder::Hashed,
        IdOrder::Leading(1),
        IdOrder::Leading(8),
        IdOrder::Leading(16),
        IdOrder::Counter,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inbox.db");
        let mut inbox = Inbox::open(&path, Config::default().id_order(order)).unwrap();
        assert_eq!(inbox.id_key().order(), order);
        // Ids that share their counter, their leading bytes, or both, with other producers and stems.
        let ids = ["evt-7", "evt-07", "evt-8", "other-7", "7", "evt-7x"];
        for id in ids {
            for producer in ["gw-1", "gw-2"] {
                let d = Delivery::new(SCOPE, id, "t", b"v1").with_producer(producer);
                assert!(
                    matches!(inbox.process(&d, ok).unwrap(), Outcome::Processed),
                    "{order:?} {producer} {id}"
                );
            }
        }
        drop(inbox);

        // Reopened with another layout configured: the file's own layout is kept, so every stored identity
        // is still found.
        let mut inbox =
            Inbox::open(&path, Config::default().id_order(IdOrder::Leading(3))).unwrap();
        assert_eq!(inbox.id_key().order(), order);
        for id in ids {
            for producer in ["gw-1", "gw-2"] {
                let same = Delivery::new(SCOPE, id, "t", b"v1").with_producer(producer);
                assert!(
                    matches!(inbox.process(&same, ok).unwrap(), Outcome::Duplicate),
                    "{order:?} {producer} {id}"
                );
                let changed = Delivery::new(SCOPE, id, "t", b"v2").with_producer(producer);
                assert!(
                    matches!(
                        inbox.process(&changed, ok).unwrap(),
                        Outcome::Conflict { .. }
                    ),
                    "{order:?} {producer} {id}"
                );
                assert!(
                    matches!(
                        inbox.status(SCOPE, Some(producer), id).unwrap(),
                        Status::Recorded { .. }
                    ),
                    "{order:?} {producer} {id}"
                );
            }
        }
        let stored = keys(inbox.connection());
        assert_eq!(stored.len(), ids.len() * 2);
        assert!(stored.iter().all(|k| k.len() == 16 + order.prefix_len()));

        // Stored, then processed by the worker: the worker reads the key back from the messages table.
        let queued = Delivery::new(SCOPE, "evt-100", "t", b"later").with_producer("gw-1");
        assert!(matches!(inbox.receive(&queued).unwrap(), Outcome::Received));
        assert!(matches!(
            inbox.receive(&queued).unwrap(),
            Outcome::Duplicate
        ));
        let mut worker = Worker::new(
            Inbox::open(&path, Config::default()).unwrap(),
            SCOPE,
            WorkerConfig::default(),
        )
        .unwrap();
        let ran = worker
            .run_once(&mut |_: &mut edge_inbox::Tx<'_>, d: &Delivery<'_>| {
                assert_eq!(d.message_id, "evt-100");
                Ok(())
            })
            .unwrap();
        assert_eq!(ran.processed, 1);
        let queued_again = Delivery::new(SCOPE, "evt-100", "t", b"later").with_producer("gw-1");
        assert!(matches!(
            inbox.process(&queued_again, ok).unwrap(),
            Outcome::Duplicate
        ));

        // Dead-lettered by the worker after one failed attempt: its record keeps the same key.
        let doomed = Delivery::new(SCOPE, "evt-200", "t", b"bad").with_producer("gw-2");
        assert!(matches!(inbox.receive(&doomed).unwrap(), Outcome::Received));
        let mut worker = Worker::new(
            Inbox::open(&path, Config::default()).unwrap(),
            SCOPE,
            WorkerConfig::default().max_attempts(1),
        )
        .unwrap();
        worker
            .run_once(&mut |_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>| {
                Err(anyhow::anyhow!("refused"))
            })
            .unwrap();
        assert!(matches!(
            inbox.process(&doomed, ok).unwrap(),
            Outcome::Duplicate
        ));

        // A sequence-watermark scope: the recent-sequence table stores the same key.
        inbox
            .set_retention("telemetry", &RetentionPolicy::new().sequence_watermarks(1))
            .unwrap();
        for seq in 1..=3u64 {
            let id = format!("t-{seq}");
            let d = Delivery::new("telemetry", &id, "t", b"v")
                .with_producer("gw-1")
                .with_sequence(seq);
            assert!(matches!(inbox.process(&d, ok).unwrap(), Outcome::Processed));
            assert!(matches!(inbox.process(&d, ok).unwrap(), Outcome::Duplicate));
        }

        // Every table that stores an identity key stores it in the file's layout.
        let lengths: Vec<i64> = inbox
            .connection()
            .prepare(
                "SELECT length(id_hash) FROM identities UNION SELECT length(id_hash) FROM messages \
                 UNION SELECT length(id_hash) FROM conflicts UNION SELECT length(id_hash) FROM watermark_recent",
            )
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(lengths, [16 + order.prefix_len() as i64], "{order:?}");
        for table in ["messages", "conflicts", "watermark_recent"] {
            let rows: i64 = inbox
                .connection()
                .query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
                .unwrap();
            assert!(rows > 0, "{order:?}: no row in {table}");
        }

        let ro = edge_inbox::open_read_only(&path).unwrap();
        let found = inspect::identity(&ro, SCOPE, Some("gw-1"), "evt-7").unwrap();
        assert_eq!(found.status, "recorded", "{order:?}");
        assert_eq!(found.conflicts, 1, "{order:?}");
        assert_eq!(found.id_hash, inbox.id_hash(Some("gw-1"), "evt-7").to_hex());
        let report = inspect::check(&ro, 10).unwrap();
        assert!(report.ok, "{order:?}: {:?}", report.problems);
        assert_eq!(report.id_order, order.name());
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
        let breaches = inspect::check_invariants(&ro, now_ms, inspect::LEASE_BOUND).unwrap();
        assert!(breaches.is_empty(), "{order:?}: {breaches:?}");
    }
}

#[test]
fn counter_keys_sort_by_number_within_a_producer() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(
        dir.path().join("inbox.db"),
        Config::default().id_order(IdOrder::Counter),
    )
    .unwrap();
    // Committed out of order, and with a number of digits that grows (9, 10, 100...).
    let numbers = [100u64, 9, 12_345, 10, 11, 99, 1];
    let ids: Vec<String> = numbers.iter().map(|n| format!("evt-{n}")).collect();
    let batch: Vec<Delivery<'_>> = ids
        .iter()
        .map(|id| Delivery::new(SCOPE, id, "t", b"v").with_producer("gw-1"))
        .collect();
    inbox.process_batch(&batch, ok).unwrap();
    let mut sorted = numbers.to_vec();
    sorted.sort_unstable();
    let expected: Vec<Vec<u8>> = sorted
        .iter()
        .map(|n| {
            inbox
                .id_hash(Some("gw-1"), &format!("evt-{n}"))
                .as_bytes()
                .to_vec()
        })
        .collect();
    assert_eq!(keys(inbox.connection()), expected);
}

#[test]
fn two_opens_of_a_new_file_with_different_layouts_agree_on_one() {
    for round in 0..8 {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inbox.db");
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let opens: Vec<_> = [IdOrder::Counter, IdOrder::Leading(4)]
            .into_iter()
            .map(|order| {
                let (path, barrier) = (path.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let mut inbox = Inbox::open(&path, Config::default().id_order(order)).unwrap();
                    let id = format!("{order:?}-1");
                    let d = Delivery::new(SCOPE, &id, "t", b"v");
                    assert!(matches!(inbox.process(&d, ok).unwrap(), Outcome::Processed));
                    inbox
                })
            })
            .collect();
        let mut inboxes: Vec<Inbox> = opens.into_iter().map(|t| t.join().unwrap()).collect();
        let order = inboxes[0].id_key().order();
        assert_eq!(inboxes[1].id_key().order(), order, "round {round}");
        // Each sees the other's identity.
        for (inbox, other) in [(0, IdOrder::Leading(4)), (1, IdOrder::Counter)] {
            let id = format!("{other:?}-1");
            let d = Delivery::new(SCOPE, &id, "t", b"v");
            assert!(
                matches!(inboxes[inbox].process(&d, ok).unwrap(), Outcome::Duplicate),
                "round {round}"
            );
        }
    }
}

#[test]
fn a_leading_layout_of_zero_or_more_than_sixteen_bytes_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for n in [0u8, 17, 255] {
        let path = dir.path().join(format!("bad-{n}.db"));
        match Inbox::open(&path, Config::default().id_order(IdOrder::Leading(n))) {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains("leading"), "{msg}"),
            other => panic!("leading:{n}: {other:?}"),
        }
        // Nothing was created in the file: a later open with a valid layout starts it.
        let inbox = Inbox::open(&path, Config::default().id_order(IdOrder::Leading(8))).unwrap();
        assert_eq!(inbox.id_key().order(), IdOrder::Leading(8));
    }
}

#[test]
fn a_file_of_schema_version_5_is_migrated_and_keeps_its_hashed_keys() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v5.db");
    {
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL; PRAGMA journal_mode = WAL;")
            .unwrap();
        conn.execute_batch(include_str!("fixtures/schema_v5.sql"))
            .unwrap();
        conn.execute_batch(
            "PRAGMA user_version = 5; \
             INSERT INTO inbox_meta (name, value) VALUES ('id_key', NULL), ('created_at', 1735689600); \
             INSERT INTO scopes (id, name, created_at) VALUES (1, 'orders', 1735689600); \
             INSERT INTO scope_stats (scope_id) VALUES (1);",
        )
        .unwrap();
        conn.execute(
            "INSERT INTO identities (scope_id, id_hash, fingerprint, day) VALUES (1, ?1, ?2, 20089)",
            (
                edge_inbox::IdHash::of(Some("gw-1"), "evt-1").as_bytes(),
                edge_inbox::Fingerprint::of("t", b"v").0 as i64,
            ),
        )
        .unwrap();
    }
    // A layout configured for new files does not apply to this one.
    let mut inbox = Inbox::open(&path, Config::default().id_order(IdOrder::Counter)).unwrap();
    assert_eq!(inbox.id_key().order(), IdOrder::Hashed);
    let version: i64 = inbox
        .connection()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, edge_inbox::SCHEMA_VERSION);
    let d = Delivery::new(SCOPE, "evt-1", "t", b"v").with_producer("gw-1");
    assert!(matches!(inbox.process(&d, ok).unwrap(), Outcome::Duplicate));
    let order: String = inbox
        .connection()
        .query_row(
            "SELECT value FROM inbox_meta WHERE name = 'id_order'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(order, "hashed");
}

#[test]
fn a_file_whose_layout_this_version_does_not_know_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    drop(Inbox::open(&path, Config::default()).unwrap());
    Connection::open(&path)
        .unwrap()
        .execute(
            "UPDATE inbox_meta SET value = 'leading:40' WHERE name = 'id_order'",
            [],
        )
        .unwrap();
    match Inbox::open(&path, Config::default()) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("leading:40"), "{msg}"),
        other => panic!("{other:?}"),
    }
    // The check still runs, and says what is wrong.
    let report = inspect::check(&edge_inbox::open_read_only(&path).unwrap(), 10).unwrap();
    assert!(!report.ok);
    assert_eq!(report.id_order, "unknown");
    assert!(
        report.problems.iter().any(|p| p.contains("leading:40")),
        "{:?}",
        report.problems
    );
}

#[test]
fn a_file_that_lost_its_layout_is_refused_not_guessed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    drop(Inbox::open(&path, Config::default().id_order(IdOrder::Counter)).unwrap());
    Connection::open(&path)
        .unwrap()
        .execute("DELETE FROM inbox_meta WHERE name = 'id_order'", [])
        .unwrap();
    match Inbox::open(&path, Config::default()) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("id_order"), "{msg}"),
        other => panic!("{other:?}"),
    }
    let report = inspect::check(&edge_inbox::open_read_only(&path).unwrap(), 10).unwrap();
    assert!(!report.ok);
}

/// WAL pages written by `batches` batches of 64 new ids after `history` earlier ones, one commit each.
fn wal_pages_per_batch(order: IdOrder, history: usize, batches: usize) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let config = Config::default()
        .id_order(order)
        .checkpoint_thread(false)
        .wal_autocheckpoint(0);
    let mut inbox = Inbox::open(&path, config).unwrap();
    let ids: Vec<String> = (0..history + batches * 64)
        .map(|i| format!("gw-1/evt-{i:08}"))
        .collect();
    let all: Vec<Delivery<'_>> = ids
        .iter()
        .map(|id| Delivery::new(SCOPE, id, "t", b"{\"v\":1}"))
        .collect();
    for chunk in all[..history].chunks(2000) {
        inbox.process_batch(chunk, ok).unwrap();
    }
    inbox
        .connection()
        .execute_batch("PRAGMA wal_checkpoint(TRUNCATE)")
        .unwrap();
    let wal = dir.path().join("inbox.db-wal");
    assert_eq!(std::fs::metadata(&wal).unwrap().len(), 0);
    for chunk in all[history..].chunks(64) {
        let out = inbox.process_batch(chunk, ok).unwrap();
        assert!(out.iter().all(|o| matches!(o, Outcome::Processed)));
    }
    let frame = 4096.0 + 24.0;
    (std::fs::metadata(&wal).unwrap().len() as f64 - 32.0) / frame / batches as f64
}

#[test]
fn ordered_ids_share_leaves_in_a_file_with_history() {
    let hashed = wal_pages_per_batch(IdOrder::Hashed, 20_000, 8);
    let counter = wal_pages_per_batch(IdOrder::Counter, 20_000, 8);
    let leading = wal_pages_per_batch(IdOrder::Leading(16), 20_000, 8);
    eprintln!("WAL pages per batch of 64: hashed {hashed:.1}, counter {counter:.1}, leading:16 {leading:.1}");
    // Random keys: most of the 64 deliveries of a batch change a leaf of their own among a few hundred.
    assert!(hashed > 30.0, "hashed: {hashed:.1} pages per batch");
    // In order: the batch appends to the last leaves of its range.
    assert!(
        counter * 4.0 < hashed,
        "counter {counter:.1} against hashed {hashed:.1}"
    );
    assert!(
        leading * 4.0 < hashed,
        "leading {leading:.1} against hashed {hashed:.1}"
    );
}
