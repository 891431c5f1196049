//! `inboxctl` where the library's own rules must hold too: `prune --apply` under a clock that jumped ahead.

mod cli_support;
mod common;

use std::time::Duration;

use cli_support::{inboxctl, json};
use edge_inbox::{Config, Delivery, Inbox, Pruning, RetentionPolicy};
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
