//! Taking a file back to an older schema version for a rollback (`downgrade_schema`, `inboxctl downgrade`):
//! the result is the older version's file, identities still found; a file the older version would misread
//! is refused and left as it was.

mod cli_support;
mod common;

use std::path::Path;

use edge_inbox::{
    downgrade_schema, Config, Delivery, Error, IdOrder, Inbox, MessageState, Outcome, Status,
};
use rusqlite::Connection;

const SCOPE: &str = "orders";

fn ok(_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>) -> anyhow::Result<()> {
    Ok(())
}

fn user_version(path: &Path) -> i64 {
    Connection::open(path)
        .unwrap()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap()
}

fn meta_names(path: &Path) -> Vec<String> {
    Connection::open(path)
        .unwrap()
        .prepare("SELECT name FROM inbox_meta ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap()
}

/// Every table and index of the file, with its SQL less comments and spacing.
fn shape(conn: &Connection) -> Vec<(String, String, String)> {
    conn.prepare(
        "SELECT type, name, coalesce(sql, '') FROM sqlite_master \
         WHERE name NOT LIKE 'sqlite_%' ORDER BY type, name",
    )
    .unwrap()
    .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get::<_, String>(2)?)))
    .unwrap()
    .map(|row| {
        let (kind, name, sql) = row.unwrap();
        let sql = sql
            .lines()
            .map(|l| l.split("--").next().unwrap())
            .collect::<Vec<_>>()
            .join(" ");
        (
            kind,
            name,
            sql.split_whitespace().collect::<Vec<_>>().join(" "),
        )
    })
    .collect()
}

/// Three processed identities, one stored message still pending.
fn populate(path: &Path, order: IdOrder) {
    let mut inbox = Inbox::open(path, Config::default().id_order(order)).unwrap();
    for id in ["evt-1", "evt-2", "evt-3"] {
        let d = Delivery::new(SCOPE, id, "t", b"v").with_producer("gw-1");
        assert!(matches!(inbox.process(&d, ok).unwrap(), Outcome::Processed));
    }
    let pending = Delivery::new(SCOPE, "evt-4", "t", b"later").with_producer("gw-1");
    assert!(matches!(
        inbox.receive(&pending).unwrap(),
        Outcome::Received
    ));
}

fn keys(path: &Path) -> Vec<Vec<u8>> {
    common::identity_keys(&Connection::open(path).unwrap())
}

#[test]
fn a_hashed_file_goes_back_to_version_5_as_that_version_made_it_and_comes_forward_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    populate(&path, IdOrder::Hashed);
    assert_eq!(user_version(&path), 6);
    let keys_before = keys(&path);
    assert_eq!(keys_before.len(), 4);

    assert_eq!(downgrade_schema(&path, 5).unwrap(), 6);
    assert_eq!(user_version(&path), 5);
    assert!(
        !meta_names(&path).contains(&"id_order".to_string()),
        "{:?}",
        meta_names(&path)
    );
    // The shape of a file of version 5: its schema, as that version's `schema.sql` creates it.
    let v5 = Connection::open_in_memory().unwrap();
    v5.execute_batch(include_str!("fixtures/schema_v5.sql"))
        .unwrap();
    assert_eq!(shape(&Connection::open(&path).unwrap()), shape(&v5));
    // The keys stay the keyed hash alone, as version 5 computes them (the migration test of
    // `tests/id_order.rs` shows version 5's keys read back by this one).
    let keys_after = keys(&path);
    assert_eq!(keys_after, keys_before);
    assert!(keys_after.iter().all(|k| k.len() == 16));
    // Taking it to the version it is at changes nothing: not a byte of the file or its WAL.
    let files = |p: &Path| {
        let wal = p.with_extension("db-wal");
        (
            std::fs::read(p).unwrap(),
            std::fs::metadata(p).unwrap().modified().unwrap(),
            std::fs::read(&wal).unwrap_or_default(),
        )
    };
    let before = files(&path);
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(downgrade_schema(&path, 5).unwrap(), 5);
    assert_eq!(files(&path), before);
    assert_eq!(user_version(&path), 5);

    // This version migrates it forward again, and every identity and message is where it was.
    let mut inbox = Inbox::open(&path, Config::default().id_order(IdOrder::Counter)).unwrap();
    assert_eq!(inbox.id_key().order(), IdOrder::Hashed);
    assert_eq!(user_version(&path), 6);
    for id in ["evt-1", "evt-2", "evt-3"] {
        let d = Delivery::new(SCOPE, id, "t", b"v").with_producer("gw-1");
        assert!(
            matches!(inbox.process(&d, ok).unwrap(), Outcome::Duplicate),
            "{id}"
        );
    }
    assert!(matches!(
        inbox.status(SCOPE, Some("gw-1"), "evt-4").unwrap(),
        Status::Recorded {
            state: Some(MessageState::Pending),
            ..
        }
    ));
}

#[test]
fn a_file_whose_layout_version_5_does_not_know_is_refused_and_left_as_it_was() {
    for order in [IdOrder::Counter, IdOrder::Leading(8)] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inbox.db");
        populate(&path, order);
        match downgrade_schema(&path, 5) {
            Err(Error::InvalidArgument(msg)) => {
                assert!(msg.contains(&order.name()), "{msg}")
            }
            other => panic!("{order:?}: {other:?}"),
        }
        assert_eq!(user_version(&path), 6);
        assert!(meta_names(&path).contains(&"id_order".to_string()));
        let mut inbox = Inbox::open(&path, Config::default()).unwrap();
        assert_eq!(inbox.id_key().order(), order);
        let d = Delivery::new(SCOPE, "evt-2", "t", b"v").with_producer("gw-1");
        assert!(matches!(inbox.process(&d, ok).unwrap(), Outcome::Duplicate));
    }
}

#[test]
fn versions_out_of_reach_and_missing_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    populate(&path, IdOrder::Hashed);
    for to in [4, 0, -1, edge_inbox::SCHEMA_VERSION + 1] {
        match downgrade_schema(&path, to) {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains("schema version"), "{msg}"),
            other => panic!("{to}: {other:?}"),
        }
        assert_eq!(user_version(&path), 6);
    }
    // The current version: nothing to do.
    downgrade_schema(&path, edge_inbox::SCHEMA_VERSION).unwrap();
    assert_eq!(user_version(&path), 6);
    // Forward is `Inbox::open`'s job.
    downgrade_schema(&path, 5).unwrap();
    match downgrade_schema(&path, 6) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("migrates it forward"), "{msg}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(user_version(&path), 5);
    // Nothing is created where there was no file, nor installed in a file that is not an inbox.
    let missing = dir.path().join("missing.db");
    assert!(matches!(
        downgrade_schema(&missing, 5),
        Err(Error::Open { .. })
    ));
    assert!(!missing.exists());
    let empty = dir.path().join("empty.db");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(
        downgrade_schema(&empty, 5),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(std::fs::metadata(&empty).unwrap().len(), 0);
    // Another application's database that happens to carry the same user_version.
    let other = dir.path().join("other.db");
    Connection::open(&other)
        .unwrap()
        .execute_batch("CREATE TABLE t (x); PRAGMA user_version = 6;")
        .unwrap();
    match downgrade_schema(&other, 5) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("no edge-inbox schema"), "{msg}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(user_version(&other), 6);
}

#[test]
fn a_file_of_a_newer_version_is_refused_as_too_new() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    populate(&path, IdOrder::Hashed);
    Connection::open(&path)
        .unwrap()
        .execute_batch(&format!(
            "PRAGMA user_version = {}",
            edge_inbox::SCHEMA_VERSION + 1
        ))
        .unwrap();
    assert!(matches!(
        downgrade_schema(&path, 5),
        Err(Error::SchemaTooNew { .. })
    ));
    assert_eq!(user_version(&path), edge_inbox::SCHEMA_VERSION + 1);
}

#[test]
fn inboxctl_downgrade_takes_a_hashed_file_back_and_refuses_a_counter_file() {
    let dir = tempfile::tempdir().unwrap();
    let hashed = dir.path().join("hashed.db");
    populate(&hashed, IdOrder::Hashed);
    let out = cli_support::ok(&hashed, &["downgrade", "--to", "5"]);
    assert_eq!(out.trim(), "schema version 6 -> 5");
    assert_eq!(user_version(&hashed), 5);
    let doc = cli_support::json(&hashed, &["downgrade", "--to", "5"]);
    assert_eq!(doc["from"], 5);
    assert_eq!(doc["to"], 5);

    // The file stays where it was taken back to: commands that write refuse it instead of migrating it
    // forward, which would lock out the build rolled back to.
    for args in [&["requeue", "--scope", "s"][..], &["prune", "--apply"][..]] {
        let out = cli_support::inboxctl(&hashed, args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("schema version 5"), "{args:?}: {err}");
        assert_eq!(user_version(&hashed), 5, "{args:?}");
    }
    // Read-only commands still work on it.
    cli_support::ok(&hashed, &["stats"]);

    let counter = dir.path().join("counter.db");
    populate(&counter, IdOrder::Counter);
    let out = cli_support::inboxctl(&counter, &["downgrade", "--to", "5"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("counter"), "{err}");
    assert_eq!(user_version(&counter), 6);
}
