//! `inboxctl` where the library's own rules must hold too: `prune --apply` under a clock that jumped ahead,
//! and `check` finding breaches of the inbox's invariants in a file that SQLite finds sound.

mod cli_support;
mod common;

use std::path::Path;
use std::time::Duration;

use cli_support::{inboxctl, json, ok};
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

/// A time in milliseconds (`$(date +%s)000`), one days ahead, or one before 2025 is refused with
/// `prune --apply` before anything is written: the library trusts a stated time, and one far ahead would
/// delete every dated identity and take every later delivery for expired.
#[test]
fn prune_apply_refuses_an_as_of_in_milliseconds_ahead_or_before_2025() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    let scope = "horizon";
    inbox
        .set_retention(
            scope,
            &RetentionPolicy::new().identity_horizon(Duration::from_secs(DAY as u64)),
        )
        .unwrap();
    let t = now();
    for i in 0..3 {
        let id = format!("evt-{i}");
        let d = Delivery::new(scope, &id, "t", b"1").with_sent_at(t);
        let outcome = inbox.process(&d, |_: &mut Tx<'_>, _: &Delivery<'_>| Ok(()));
        assert!(matches!(outcome.unwrap(), Outcome::Processed));
    }
    drop(inbox);
    let conn = Connection::open(&path).unwrap();
    let identities = || count(&conn, "SELECT count(*) FROM identities");
    let pruned_before = || count(&conn, "SELECT count(pruned_before) FROM retention");
    assert_eq!((identities(), pruned_before()), (3, 0));

    let millis = (t * 1000).to_string();
    let ahead = (t + 2 * DAY).to_string();
    for (as_of, says) in [
        (millis.as_str(), "milliseconds"),
        (ahead.as_str(), "ahead"),
        ("1700000000", "before"),
    ] {
        for json in [false, true] {
            let mut args = vec!["prune", "--apply", "--as-of", as_of];
            if json {
                args.insert(0, "--json");
            }
            let out = inboxctl(&path, &args);
            let said = text(&out);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {said}");
            assert!(
                said.contains(as_of) && said.contains(says),
                "{args:?}: {said}"
            );
            assert_eq!(identities(), 3, "{args:?}: nothing deleted: {said}");
            assert_eq!(pruned_before(), 0, "{args:?}: no horizon recorded: {said}");
        }
    }
    // A time within the day ahead is the operator's to state: accepted, and nothing is due yet.
    let stated = (t + 3600).to_string();
    let doc = json(&path, &["prune", "--apply", "--as-of", &stated]);
    assert_eq!(doc["pruned"]["identities"], 0, "{doc}");
    assert_eq!(identities(), 3);
}

/// Numbered rows in `messages` of `scope` (processed, finished now), written in one statement: what a
/// pass steps over, without a commit per row.
fn processed_rows(path: &Path, scope: &str, n: i64, body: &[u8]) {
    let mut inbox = Inbox::open(path, Config::default()).unwrap();
    inbox
        .set_retention(
            scope,
            &RetentionPolicy::new().processed_payloads(Duration::from_secs(30 * DAY as u64)),
        )
        .unwrap();
    drop(inbox);
    let conn = Connection::open(path).unwrap();
    conn.execute(
        "WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < ?1) \
         INSERT INTO messages \
           (scope_id, id_hash, message_id, topic, payload, state, received_at, finished_at) \
         SELECT (SELECT id FROM scopes WHERE name = ?2), randomblob(16), 'm-' || i, 't', ?3, 1, ?4, ?4 \
         FROM k",
        (n, scope, body, now()),
    )
    .unwrap();
}

/// `prune --apply` rests between steps as `Inbox::prune` does (at least its pause, 10 ms, and nine times
/// the step), leaving the disk and the write lock to consumers; it does not run its steps back to back.
#[test]
fn prune_apply_rests_between_steps() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    // 100 windows of 32 messages, none of them due: a pass of over 100 steps.
    processed_rows(&path, "rested", 3200, b"x");
    let started = std::time::Instant::now();
    let doc = json(&path, &["prune", "--apply"]);
    let took = started.elapsed();
    let steps = doc["pruned"]["steps"].as_u64().unwrap();
    assert!(steps > 100, "{doc}");
    let rests = Duration::from_millis(10) * (steps as u32 - 1);
    assert!(
        took >= rests,
        "{steps} steps in {took:?}, less than their rests ({rests:?})"
    );
}

/// `export` to a reader that stops reading (a pipe into a pager) does not keep its snapshot open: the
/// first byte reaches the reader after the read transaction ended, so a checkpoint can start the WAL over
/// while the reader waits, instead of the WAL growing with every commit beside it.
#[test]
fn export_to_a_stalled_reader_does_not_hold_its_snapshot() {
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    // About 650 KB of JSON lines: far more than a pipe holds.
    processed_rows(&path, "big", 300, &[b'x'; 1024]);
    // A writer whose frames stay in the WAL, as a consumer's do between checkpoints: the export's snapshot
    // then reads the WAL.
    let writer = Connection::open(&path).unwrap();
    writer
        .execute_batch(
            "PRAGMA wal_autocheckpoint = 0; CREATE TABLE scratch (x); INSERT INTO scratch VALUES (1);",
        )
        .unwrap();
    let exe = Path::new(env!("CARGO_BIN_EXE_inboxctl"));
    let mut child = common::through_runner(exe)
        .env_remove("EDGE_INBOX_DB")
        .arg("--db")
        .arg(&path)
        .args(["export", "--table", "messages"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).unwrap();

    // The reader stalls; a consumer commits and the WAL is checkpointed back to its start.
    writer
        .execute("INSERT INTO scratch VALUES (2)", [])
        .unwrap();
    let checkpointer = Connection::open(&path).unwrap();
    checkpointer.busy_timeout(Duration::ZERO).unwrap();
    let truncated = common::wait_for(Duration::from_secs(5), || {
        let busy: i64 = checkpointer
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))
            .unwrap();
        (busy == 0).then_some(())
    });
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    let wal_bytes = std::fs::metadata(&wal).unwrap().len();

    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let status = child.wait().unwrap();
    assert!(
        truncated.is_some(),
        "the export held its snapshot while its reader stalled"
    );
    assert_eq!(wal_bytes, 0, "the WAL started over");
    assert!(status.success());
    let text = [&first[..], &rest].concat();
    let rows = String::from_utf8(text).unwrap();
    assert_eq!(rows.lines().count(), 300, "one snapshot, every row");
}

/// `export -o` and `stats -o` rename their output over the path: never over the database or its `-wal` and
/// `-shm`, however the path is spelled, while a consumer has the file open.
#[test]
fn output_paths_that_are_the_database_or_its_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    populate(&path);
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    let identities = |p: &Path| {
        let conn = Connection::open(p).unwrap();
        count(&conn, "SELECT count(*) FROM identities")
    };
    let before = identities(&path);
    let beside = |suffix: &str| {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        std::path::PathBuf::from(p)
    };
    // Another spelling through a symlinked directory, and a hard link (same device and inode).
    std::os::unix::fs::symlink(dir.path(), dir.path().join("via")).unwrap();
    let alias = dir.path().join("alias.db");
    std::fs::hard_link(&path, &alias).unwrap();
    let targets = [
        path.clone(),
        beside("-wal"),
        beside("-shm"),
        dir.path().join(".").join("inbox.db"),
        dir.path().join("via").join("inbox.db-wal"),
        alias.clone(),
    ];
    for target in &targets {
        assert!(target.exists(), "{}", target.display());
        let t = target.to_str().unwrap();
        for args in [
            &["export", "--table", "messages", "-o", t][..],
            &["stats", "-o", t],
            &["stats", "--format", "prometheus", "-o", t],
        ] {
            let out = inboxctl(&path, args);
            let said = text(&out);
            assert_eq!(out.status.code(), Some(1), "{args:?}: {said}");
            assert!(said.contains("refusing"), "{args:?}: {said}");
            assert_eq!(
                identities(&path),
                before,
                "{args:?}: the database is intact"
            );
        }
    }
    std::fs::remove_file(&alias).unwrap();
    // The consumer's file is still the one at the path: a new commit is seen there.
    let d = Delivery::new(SCOPE, "evt-after", "t", b"1");
    let outcome = inbox.process(&d, |_: &mut Tx<'_>, _: &Delivery<'_>| Ok(()));
    assert!(matches!(outcome.unwrap(), Outcome::Processed));
    assert_eq!(identities(&path), before + 1);
    // A file beside the database is fine.
    let fine = dir.path().join("inbox.db.jsonl");
    let out = inboxctl(
        &path,
        &[
            "export",
            "--table",
            "messages",
            "-o",
            fine.to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

/// A `--scope` that names no scope is an error naming it (exit 1), not an empty report; a scope without
/// dead letters still requeues nothing with success.
#[test]
fn an_unknown_scope_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    populate(&path);
    let typo = "sonud";
    for args in [
        &["requeue", "--scope", typo][..],
        &["stats", "--scope", typo],
        &["stats", "--format", "prometheus", "--scope", typo],
        &["conflicts", "--scope", typo],
        &["quarantine", "--scope", typo],
        &["dead-letters", "--scope", typo],
    ] {
        let out = inboxctl(&path, args);
        let said = text(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {said}");
        assert!(
            said.contains(&format!("no scope \"{typo}\"")),
            "{args:?}: {said}"
        );
    }
    assert_eq!(
        json(&path, &["requeue", "--scope", NUMBERED])["requeued"],
        0
    );
    assert_eq!(json(&path, &["requeue", "--scope", SCOPE])["requeued"], 1);
}

/// Text that is not UTF-8 in a scope name or a message id (written by hand, or by an older build) is shown
/// escaped in the reports, `check`'s breaches too, instead of failing them.
#[test]
fn text_that_is_not_utf8_is_reported_escaped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    populate(&path);
    let conn = Connection::open(&path).unwrap();
    conn.execute(
        "UPDATE scopes SET name = CAST(x'626164ff' AS TEXT) WHERE name = ?1",
        [SCOPE],
    )
    .unwrap();
    drop(conn);
    let bad = "bad\\xff";

    let stats = json(&path, &["stats"]);
    let scopes = stats["scopes"].as_array().unwrap();
    let s = scopes
        .iter()
        .find(|s| s["scope"] == bad)
        .expect("the scope, escaped");
    assert_eq!(s["dead_letters"], 1, "{stats}");
    assert!(ok(&path, &["stats"]).contains(&format!("scope {bad}")));
    let prom = ok(&path, &["stats", "--format", "prometheus"]);
    assert!(prom.contains(r#"scope="bad\\xff""#), "{prom}");
    let dead = ok(&path, &["--json", "dead-letters"]);
    let row: serde_json::Value = serde_json::from_str(dead.lines().next().unwrap()).unwrap();
    assert_eq!(row["scope"], bad, "{row}");
    let messages = ok(&path, &["export", "--table", "messages"]);
    assert!(messages.lines().count() >= 4, "{messages}");
    assert!(messages.contains(r#""scope":"bad\\xff""#), "{messages}");
    let ids = ok(&path, &["export", "--table", "identities"]);
    assert!(ids.contains(r#""scope":"bad\\xff""#), "{ids}");

    // A breach in that scope, and a message id that is not UTF-8 either: `check` names the breach with
    // both escaped instead of leaving the invariants unchecked.
    let conn = Connection::open(&path).unwrap();
    conn.execute(
        "UPDATE scope_stats SET identity_offset = identity_offset + 100 \
         WHERE scope_id = (SELECT id FROM scopes WHERE name = CAST(x'626164ff' AS TEXT))",
        [],
    )
    .unwrap();
    conn.execute(
        "UPDATE messages SET message_id = CAST(x'6964fe' AS TEXT), id_hash = x'00' \
         WHERE seq = (SELECT min(seq) FROM messages \
           WHERE scope_id = (SELECT id FROM scopes WHERE name = CAST(x'626164ff' AS TEXT)))",
        [],
    )
    .unwrap();
    drop(conn);
    let out = inboxctl(&path, &["check"]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("integrity: ok"), "{said}");
    assert!(said.contains("invariants: BREACHED"), "{said}");
    assert!(
        said.contains(&format!("counters_disagree in scope {bad:?}")),
        "{said}"
    );
    assert!(said.contains("message_without_identity in scope"), "{said}");
    assert!(said.contains(r"'id\xfe'"), "{said}");
    let out = inboxctl(&path, &["--json", "check"]);
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(doc["invariants_not_checked"].is_null(), "{doc}");
    let names: Vec<&str> = doc["breaches"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["scope"] == bad)
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"counters_disagree"), "{doc}");
}
