//! Processed bodies are not indexed by id (schema version 5): what that changes for the identity horizon, for
//! a redelivery after the horizon, for the operator's lookups, and the migration of a version-4 file.

mod deferred_support;

use deferred_support::*;
use edge_inbox::{
    inspect, Config, Delivery, ExpiredPolicy, Inbox, Outcome, Pruning, RetentionPolicy, Status,
    Worker, WorkerConfig,
};
use rusqlite::Connection;
use std::time::Duration;

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

fn breaches(conn: &Connection) -> Vec<String> {
    inspect::check_invariants(conn, now() * 1000, inspect::LEASE_BOUND)
        .unwrap()
        .into_iter()
        .map(|b| format!("{b:?}"))
        .collect()
}

/// A deferred message received ten days ago and processed today keeps its identity a full horizon from today:
/// the processed body no longer holds the identity back, so the worker moves its day. Past that horizon the
/// identity goes while the body (kept forever here) stays, and a redelivery is new again, by design.
#[test]
fn the_horizon_of_a_deferred_message_counts_from_its_processing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    inbox
        .set_retention(
            SCOPE,
            &RetentionPolicy::new()
                .identity_horizon(Duration::from_secs(7 * DAY as u64))
                .expired(ExpiredPolicy::Process),
        )
        .unwrap();
    let sent = now();
    let d = Delivery::new(SCOPE, "late", "t", b"v").with_sent_at(sent);
    assert!(matches!(inbox.receive(&d).unwrap(), Outcome::Received));
    // Received ten days ago (and the file older than that: retention distrusts days before its creation).
    let conn = inbox.connection();
    assert_eq!(
        conn.execute("UPDATE identities SET day = day - 10", [])
            .unwrap(),
        1
    );
    conn.execute(
        "UPDATE inbox_meta SET value = ?1 WHERE name = 'created_at'",
        [edge_inbox::EARLIEST_PLAUSIBLE_TIME],
    )
    .unwrap();
    let today = sent.div_euclid(DAY);

    let mut worker = Worker::new(open(&path), SCOPE, WorkerConfig::default()).unwrap();
    assert_eq!(worker.run_once(&mut count_effect).unwrap().processed, 1);
    assert_eq!(
        count(inbox.connection(), "SELECT day FROM identities"),
        today,
        "processing moves the identity's day to the day of its effect"
    );

    // Today the identity is inside its horizon: kept, and a redelivery is a duplicate.
    let report = inbox.prune(&Pruning::default().trust_clock(true)).unwrap();
    assert_eq!(report.identities_pruned, 0);
    assert!(matches!(inbox.receive(&d).unwrap(), Outcome::Duplicate));
    assert_eq!(effects(&inbox), (1, 1, 1));

    // Eight days on, it is past the horizon. The processed body is history and stays.
    let report = inbox
        .prune(&Pruning::default().as_of(sent + 8 * DAY))
        .unwrap();
    assert_eq!(report.identities_pruned, 1);
    assert!(matches!(
        inbox.status(SCOPE, None, "late").unwrap(),
        Status::NotFound
    ));
    assert_eq!(states(&inbox), [0, 1, 0, 0]);
    assert!(
        breaches(inbox.connection()).is_empty(),
        "a processed body whose identity the horizon pruned is no breach"
    );

    // The door is open again: a new body beside the old one, and the operator's lookup shows the open one.
    assert!(matches!(inbox.receive(&d).unwrap(), Outcome::Received));
    assert_eq!(states(&inbox), [1, 1, 0, 0]);
    let shown = inspect::identity(inbox.connection(), SCOPE, None, "late").unwrap();
    assert_eq!(shown.message.map(|m| m.state), Some("pending"));
    assert!(matches!(inbox.receive(&d).unwrap(), Outcome::Duplicate));
    assert_eq!(worker.run_once(&mut count_effect).unwrap().processed, 1);
    assert_eq!(states(&inbox), [0, 2, 0, 0]);
    // With two processed bodies, the lookup finds the latest.
    let shown = inspect::identity(inbox.connection(), SCOPE, None, "late").unwrap();
    let latest = count(inbox.connection(), "SELECT max(seq) FROM messages");
    assert_eq!(
        shown.message.map(|m| (m.seq, m.state)),
        Some((latest, "processed"))
    );
    assert!(breaches(inbox.connection()).is_empty());

    // A body processed after everything the horizon pruned must still have its identity: losing it is a breach.
    let conn = inbox.connection();
    conn.execute(
        "UPDATE messages SET finished_at = (SELECT pruned_before FROM retention) WHERE seq = ?1",
        [latest],
    )
    .unwrap();
    conn.execute("DELETE FROM identities", []).unwrap();
    let found = breaches(conn);
    assert!(
        found
            .iter()
            .any(|b| b.contains("message_without_identity") && b.contains("seq 2")),
        "a processed body newer than the pruned horizon, without its identity: {found:?}"
    );
}

/// A pending body is still unique per identity and still holds its identity, whatever the horizon.
#[test]
fn an_open_body_stays_unique_and_holds_its_identity() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    inbox
        .set_retention(
            SCOPE,
            &RetentionPolicy::new().identity_horizon(Duration::from_secs(DAY as u64)),
        )
        .unwrap();
    let d = Delivery::new(SCOPE, "open", "t", b"v").with_sent_at(now());
    assert!(matches!(inbox.receive(&d).unwrap(), Outcome::Received));
    let report = inbox
        .prune(&Pruning::default().as_of(now() + 30 * DAY))
        .unwrap();
    assert_eq!(
        report.identities_pruned, 0,
        "a pending body holds its identity"
    );

    // Something deletes the identity of the open body: a redelivery restores it and stores nothing twice.
    inbox
        .connection()
        .execute("DELETE FROM identities", [])
        .unwrap();
    assert!(matches!(inbox.receive(&d).unwrap(), Outcome::Duplicate));
    assert_eq!(states(&inbox), [1, 0, 0, 0]);
    assert_eq!(
        count(inbox.connection(), "SELECT count(*) FROM identities"),
        1
    );
    let dup = inbox.connection().execute(
        "INSERT INTO messages (scope_id, id_hash, message_id, topic, state, received_at) \
         SELECT scope_id, id_hash, message_id, topic, 3, 0 FROM messages",
        [],
    );
    assert!(
        matches!(&dup, Err(rusqlite::Error::SqliteFailure(e, _)) if e.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE),
        "an open and a dead-lettered body of one identity: {dup:?}"
    );
}

fn columns_and_indexes(conn: &Connection) -> (Vec<String>, Vec<String>) {
    let mut cols = Vec::new();
    let mut stmt = conn.prepare("PRAGMA table_xinfo(messages)").unwrap();
    let mut rows = stmt.query([]).unwrap();
    while let Some(r) = rows.next().unwrap() {
        let (name, ty, notnull, default, pk): (String, String, i64, Option<String>, i64) = (
            r.get(1).unwrap(),
            r.get(2).unwrap(),
            r.get(3).unwrap(),
            r.get(4).unwrap(),
            r.get(5).unwrap(),
        );
        cols.push(format!("{name} {ty} {notnull} {default:?} {pk}"));
    }
    let mut stmt = conn
        .prepare("SELECT name, coalesce(sql, '') FROM sqlite_master WHERE tbl_name = 'messages' AND type = 'index' ORDER BY name")
        .unwrap();
    let indexes = stmt
        .query_map([], |r| {
            let sql: String = r.get(1)?;
            Ok(format!(
                "{}: {}",
                r.get::<_, String>(0)?,
                sql.split_whitespace().collect::<Vec<_>>().join(" ")
            ))
        })
        .unwrap()
        .collect::<rusqlite::Result<Vec<_>>>()
        .unwrap();
    (cols, indexes)
}

#[test]
fn a_file_of_schema_version_4_is_migrated_with_its_messages() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v4.db");
    let fresh = dir.path().join("v5.db");
    drop(Inbox::open(&fresh, Config::default()).unwrap());
    {
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL; PRAGMA journal_mode = WAL;")
            .unwrap();
        conn.execute_batch(include_str!("fixtures/schema_v4.sql"))
            .unwrap();
        conn.execute_batch(
            "PRAGMA user_version = 4; \
             INSERT INTO inbox_meta (name, value) VALUES ('id_key', NULL), ('created_at', 1735689600); \
             INSERT INTO scopes (id, name, created_at) VALUES (1, 'deferred-test', 1735689600); \
             INSERT INTO scope_stats (scope_id, identity_offset) VALUES (1, 4);",
        )
        .unwrap();
        // One body in each state, with gaps in seq, and their identities.
        for (seq, id, state) in [
            (5i64, "pending", 0i64),
            (7, "done", 1),
            (9, "failed", 2),
            (11, "dead", 3),
        ] {
            let hash = edge_inbox::IdHash::of(None, id);
            conn.execute(
                "INSERT INTO messages (seq, scope_id, id_hash, message_id, topic, payload, state, received_at) \
                 VALUES (?1, 1, ?2, ?3, 't', ?4, ?5, 1735689600)",
                (seq, hash.as_bytes(), id, id.as_bytes(), state),
            )
            .unwrap();
            conn.execute(
                "INSERT INTO identities (scope_id, id_hash, fingerprint, day) VALUES (1, ?1, ?2, 20089)",
                (hash.as_bytes(), edge_inbox::Fingerprint::of("t", id.as_bytes()).0 as i64),
            )
            .unwrap();
        }
        assert_eq!(
            count(
                &conn,
                "SELECT count(*) FROM sqlite_master WHERE name = 'sqlite_autoindex_messages_1'"
            ),
            1
        );
    }
    let mut inbox = open(&path);
    let conn = inbox.connection();
    assert_eq!(
        count(conn, "PRAGMA user_version"),
        edge_inbox::SCHEMA_VERSION
    );
    assert_eq!(edge_inbox::SCHEMA_VERSION, 6);
    let rows: Vec<(i64, String, i64, Vec<u8>)> = conn
        .prepare("SELECT seq, message_id, state, payload FROM messages ORDER BY seq")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    let expected: Vec<(i64, String, i64, Vec<u8>)> = [
        (5, "pending", 0),
        (7, "done", 1),
        (9, "failed", 2),
        (11, "dead", 3),
    ]
    .into_iter()
    .map(|(s, id, st)| (s, id.to_owned(), st, id.as_bytes().to_vec()))
    .collect();
    assert_eq!(rows, expected, "every body kept, with its seq");
    assert_eq!(
        columns_and_indexes(conn),
        columns_and_indexes(&Connection::open(&fresh).unwrap()),
        "the migrated table is the one a new file gets"
    );
    let integrity: String = conn
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(integrity, "ok");
    assert!(breaches(conn).is_empty());

    // The migrated bodies behave: redeliveries are duplicates, the pending one is processed.
    for id in ["pending", "done", "failed", "dead"] {
        let d = Delivery::new(SCOPE, id, "t", id.as_bytes());
        assert!(
            matches!(inbox.receive(&d).unwrap(), Outcome::Duplicate),
            "{id}"
        );
    }
    let mut worker = Worker::new(open(&path), SCOPE, WorkerConfig::default()).unwrap();
    assert_eq!(worker.run_once(&mut count_effect).unwrap().processed, 2);
    assert_eq!(states(&inbox), [0, 3, 0, 1]);
}
