//! `inboxctl` where the library's own rules must hold too: `prune --apply` under a clock that jumped ahead,
//! and `check` finding breaches of the inbox's invariants in a file that SQLite finds sound.

mod cli_support;
mod common;

use std::path::Path;
use std::time::Duration;

use cli_support::{inboxctl, json};
use edge_inbox::{
    Config, Delivery, Inbox, OutboxProperties, Outcome, Pruning, Qos, RetentionPolicy, Tx,
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

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn prune_apply_keeps_the_clock_jump_refusal_unless_the_time_is_stated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    let scope = "jumped";
    inbox
        .set_retention(
            scope,
            &RetentionPolicy::new().dead_letter_payloads(Duration::from_secs(DAY as u64)),
        )
        .unwrap();
    inbox
        .dead_letter(&Delivery::new(scope, "evt-1", "t", b"1"), "bad")
        .unwrap();
    let t = now();
    // Given up three days ago; the latest time retention accepted is 60 days back, so today's clock reading
    // is a jump the library refuses to act on.
    let conn = inbox.connection();
    conn.execute("UPDATE messages SET finished_at = ?1", [t - 3 * DAY])
        .unwrap();
    conn.execute(
        "UPDATE inbox_meta SET value = ?1 WHERE name = 'created_at'",
        [edge_inbox::EARLIEST_PLAUSIBLE_TIME],
    )
    .unwrap();
    conn.execute(
        "INSERT INTO inbox_meta (name, value) VALUES ('clock_seen', ?1) \
         ON CONFLICT (name) DO UPDATE SET value = excluded.value",
        [t - 60 * DAY],
    )
    .unwrap();
    let report = inbox
        .prune(&Pruning::default().pause(Duration::ZERO))
        .unwrap();
    assert!(report.clock_refused, "{report:?}");
    assert_eq!(report.dead_letters_pruned, 0);
    drop(inbox);

    let out = inboxctl(&path, &["prune", "--apply"]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("refused"), "{said}");
    let conn = Connection::open(&path).unwrap();
    assert_eq!(
        count(&conn, "SELECT count(*) FROM messages"),
        1,
        "the dead letter stays: {said}"
    );
    let doc = {
        let out = inboxctl(&path, &["--json", "prune", "--apply"]);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    assert_eq!(doc["clock_refused"], true, "{doc}");
    assert_eq!(doc["pruned"]["dead_letters"], 0, "{doc}");

    // The operator states the time: that overrides the rule, and the output says so.
    let stated = t.to_string();
    let out = inboxctl(&path, &["prune", "--apply", "--as-of", &stated]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(said.contains("overrides"), "{said}");
    assert_eq!(count(&conn, "SELECT count(*) FROM messages"), 0, "{said}");
    let doc = json(&path, &["prune", "--apply", "--as-of", &stated]);
    assert_eq!(doc["clock_overridden"], true, "{doc}");
}

const SCOPE: &str = "sound";
const NUMBERED: &str = "numbered";

/// A file holding one of everything the invariants speak of: a processed identity, a pending message, a
/// dead letter, an outbox row, a watermark with an exception, a leased message.
fn populate(path: &Path) {
    let mut inbox = Inbox::open(path, Config::default()).unwrap();
    let publish = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        tx.publish(
            "out/a",
            d.payload,
            Qos::AtLeastOnce,
            &OutboxProperties::new(),
        )?;
        Ok(())
    };
    assert!(matches!(
        inbox
            .process(&Delivery::new(SCOPE, "evt-1", "t", b"1"), publish)
            .unwrap(),
        Outcome::Processed
    ));
    assert!(matches!(
        inbox
            .receive(&Delivery::new(SCOPE, "evt-p", "t", b"p"))
            .unwrap(),
        Outcome::Received
    ));
    assert!(matches!(
        inbox
            .receive(&Delivery::new(SCOPE, "evt-l", "t", b"l"))
            .unwrap(),
        Outcome::Received
    ));
    inbox
        .dead_letter(&Delivery::new(SCOPE, "evt-dl", "t", b"d"), "bad")
        .unwrap();
    inbox
        .set_retention(NUMBERED, &RetentionPolicy::new().sequence_watermarks(1))
        .unwrap();
    for seq in [1u64, 2, 5] {
        let id = format!("n-{seq}");
        let d = Delivery::new(NUMBERED, &id, "t", b"n")
            .with_producer("dev-1")
            .with_sequence(seq);
        assert!(matches!(inbox.receive(&d).unwrap(), Outcome::Received));
    }
    // A live lease, as a worker holds it.
    let until = (now() + 60) * 1000;
    inbox
        .connection()
        .execute(
            "UPDATE messages SET lease_owner = 'worker-1', lease_until = ?1, claims = 1 WHERE message_id = 'evt-l'",
            [until],
        )
        .unwrap();
}

#[test]
fn check_names_each_breach_of_the_inbox_invariants() {
    let dir = tempfile::tempdir().unwrap();
    let clean = dir.path().join("clean.db");
    populate(&clean);
    let doc = json(&clean, &["check"]);
    assert_eq!(doc["ok"], true, "{doc}");
    assert_eq!(doc["breaches"], serde_json::json!([]), "{doc}");
    let conn = Connection::open(&clean).unwrap();
    let report = edge_inbox::inspect::check(&conn, 10).unwrap();
    assert!(report.ok && report.breaches.is_empty(), "{report:?}");
    drop(conn);

    let past_ms = (now() - 2 * DAY) * 1000;
    let future_ms = (now() + 3 * DAY) * 1000;
    let cases: [(&str, String); 7] = [
        (
            "message_without_identity",
            "DELETE FROM identities WHERE id_hash = (SELECT id_hash FROM messages WHERE message_id = 'evt-p')"
                .into(),
        ),
        (
            "message_without_identity",
            // A numbered message of a watermark scope whose sequence nothing claims.
            "DELETE FROM watermark_exceptions".into(),
        ),
        (
            "outbox_without_scope",
            "UPDATE outbox SET scope_id = 999".into(),
        ),
        (
            "counters_disagree",
            "UPDATE scope_stats SET identity_offset = identity_offset + 100 \
             WHERE scope_id = (SELECT id FROM scopes WHERE name = 'sound')"
                .into(),
        ),
        (
            "exception_not_above_high",
            "INSERT INTO watermark_exceptions (scope_id, producer, sequence) \
             SELECT scope_id, producer, high + 1 FROM watermarks"
                .into(),
        ),
        (
            "lease_expired",
            format!("UPDATE messages SET lease_until = {past_ms} WHERE message_id = 'evt-l'"),
        ),
        (
            "lease_too_long",
            format!("UPDATE messages SET lease_until = {future_ms} WHERE message_id = 'evt-l'"),
        ),
    ];
    for (i, (name, sql)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("broken-{i}.db"));
        std::fs::copy(&clean, &path).unwrap();
        let raw = Connection::open(&path).unwrap();
        assert!(raw.execute(sql, []).unwrap() > 0, "{sql}");
        let integrity: String = raw
            .query_row("PRAGMA integrity_check", [], |r| r.get(0))
            .unwrap();
        assert_eq!(integrity, "ok", "SQLite finds the file sound");

        let report = edge_inbox::inspect::check(&raw, 10).unwrap();
        assert!(!report.ok, "{name}: {report:?}");
        let names: Vec<&str> = report.breaches.iter().map(|b| b.name).collect();
        assert!(names.contains(name), "{name}: {names:?}");
        drop(raw);

        let out = inboxctl(&path, &["check"]);
        let said = text(&out);
        assert_eq!(out.status.code(), Some(1), "{name}: {said}");
        assert!(said.contains(name), "{name}: {said}");
        let out = inboxctl(&path, &["--json", "check"]);
        assert_eq!(out.status.code(), Some(1), "{name}: {}", text(&out));
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(doc["ok"], false, "{name}: {doc}");
        assert!(
            doc["breaches"]
                .as_array()
                .unwrap()
                .iter()
                .any(|b| b["name"] == *name),
            "{name}: {doc}"
        );
    }
}

/// An odd value in a file (a message received, by a clock gone wrong, at the earliest time SQLite can store)
/// gives a report, not a panic.
#[test]
fn odd_values_in_a_file_give_reports_or_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let mut inbox = edge_inbox::Inbox::open(&db, edge_inbox::Config::default()).unwrap();
    let d = edge_inbox::Delivery::new("odd", "m-1", "t", b"x");
    inbox.receive(&d).unwrap();
    inbox
        .connection()
        .execute_batch(&format!("UPDATE messages SET received_at = {}", i64::MIN))
        .unwrap();
    drop(inbox);
    let conn =
        Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let reports = edge_inbox::inspect::stats(&conn, Some("odd")).unwrap();
    assert_eq!(reports[0].pending, 1);
    assert!(reports[0].oldest_pending_age_secs.unwrap() > 0);
}
