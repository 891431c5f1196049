//! The per-scope counters stay exact on every write path and across kill -9, although the strong case writes
//! no counter for a delivery it processes (its new identity row is the count, see `schema.sql`).
//! The crash child is this test binary run again (through `EDGE_INBOX_TEST_RUNNER` when set).

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use edge_inbox::{Config, Delivery, Inbox, Outcome, Tx, Worker, WorkerConfig};

const DB_VAR: &str = "EDGE_INBOX_COUNTERS_DB";

/// The handler's effect: one durable counter per scope, bumped in the delivery's transaction.
fn bump(tx: &mut Tx<'_>, _: &Delivery<'_>) -> anyhow::Result<()> {
    let n: u64 = tx.get("effects")?.unwrap_or(0);
    tx.put("effects", &(n + 1))?;
    Ok(())
}

fn effects(inbox: &Inbox, scope: &str) -> u64 {
    inbox
        .connection()
        .query_row(
            "SELECT value FROM kv WHERE ns = ?1 AND key = 'effects'",
            [scope],
            |r| r.get::<_, Vec<u8>>(0),
        )
        .map(|v| ciborium::from_reader(&v[..]).unwrap())
        .unwrap_or(0)
}

#[test]
fn counters_match_the_outcomes_of_every_write_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    let s = "strong";
    let fail =
        |_: &mut Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> { anyhow::bail!("refused") };

    // Alone in their transaction (no savepoint).
    let a = Delivery::new(s, "a", "t", b"1");
    assert!(matches!(
        inbox.process(&a, bump).unwrap(),
        Outcome::Processed
    ));
    assert!(matches!(
        inbox.process(&a, bump).unwrap(),
        Outcome::Duplicate
    ));
    let a2 = Delivery::new(s, "a", "t", b"other");
    assert!(matches!(
        inbox.process(&a2, bump).unwrap(),
        Outcome::Conflict { .. }
    ));
    let b = Delivery::new(s, "b", "t", b"1");
    assert!(matches!(
        inbox.process(&b, fail).unwrap(),
        Outcome::HandlerFailed(_)
    ));
    assert_eq!(
        inbox.status(s, None, "b").unwrap(),
        edge_inbox::Status::NotFound,
        "a failed handler leaves no identity"
    );
    assert!(matches!(
        inbox.process(&b, bump).unwrap(),
        Outcome::Processed
    ));

    // In batches (a savepoint each): one refused, one repeated inside the batch, one already known.
    let batch = [
        Delivery::new(s, "c", "t", b"1"),
        Delivery::new(s, "d", "t", b"1"),
        Delivery::new(s, "c", "t", b"1"),
        Delivery::new(s, "a", "t", b"1"),
    ];
    let mut calls = 0;
    let outcomes = inbox
        .process_batch(&batch, |tx: &mut Tx<'_>, d: &Delivery<'_>| {
            calls += 1;
            if d.message_id == "d" {
                anyhow::bail!("refused");
            }
            bump(tx, d)
        })
        .unwrap();
    assert_eq!(
        outcomes.iter().map(Outcome::name).collect::<Vec<_>>(),
        ["processed", "handler-failed", "duplicate", "duplicate"]
    );

    let st = inbox.scope_stats(s).unwrap();
    assert_eq!(st.processed, 3, "a, b, c");
    assert_eq!(st.processed, effects(&inbox, s));
    assert_eq!(st.duplicates, 3);
    assert_eq!(st.conflicts, 1);
    assert_eq!(st.handler_failures, 2);

    // The deferred mode: stored pending, applied by a worker, one dead-lettered on arrival.
    let q = "deferred";
    let mut received = Vec::new();
    let pending = [
        Delivery::new(q, "p1", "t", b"1"),
        Delivery::new(q, "p2", "t", b"1"),
        Delivery::new(q, "p1", "t", b"1"),
    ];
    inbox.receive_batch_into(&pending, &mut received).unwrap();
    assert_eq!(
        received.iter().map(Outcome::name).collect::<Vec<_>>(),
        ["received", "received", "duplicate"]
    );
    let dead = Delivery::new(q, "p3", "t", b"1");
    inbox.dead_letter_after(&dead, 3, "poison").unwrap();
    let st = inbox.scope_stats(q).unwrap();
    assert_eq!(
        st.processed, 0,
        "stored and dead-lettered deliveries are not processed"
    );
    assert_eq!(st.duplicates, 1);
    assert_eq!(st.dead_lettered, 1);

    let mut worker = Worker::new(
        Inbox::open(&path, Config::default()).unwrap(),
        q,
        WorkerConfig::default(),
    )
    .unwrap();
    let done = worker.run_once(&mut bump).unwrap();
    assert_eq!(done.processed, 2);
    let st = inbox.scope_stats(q).unwrap();
    assert_eq!(st.processed, 2);
    assert_eq!(st.processed, effects(&inbox, q));

    // Read-only tools report the same figures.
    let ro = edge_inbox::open_read_only(&path).unwrap();
    let report = edge_inbox::inspect::stats(&ro, None).unwrap();
    let by = |name: &str| report.iter().find(|r| r.scope == name).unwrap().processed;
    assert_eq!((by(s), by(q)), (3, 2));
}

/// The child: processes deliveries (every fifth a repetition of the one before) until it is killed.
#[test]
#[ignore = "child process of counters_survive_kill_9"]
fn child_processes_until_killed() {
    let Ok(db) = std::env::var(DB_VAR) else {
        return;
    };
    let db = PathBuf::from(db);
    let mut inbox = Inbox::open(&db, Config::default()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut i = 0u64;
    while Instant::now() < deadline {
        let id = format!("m{}", if i % 5 == 4 { i - 1 } else { i });
        let d = Delivery::new("crash", &id, "t", b"x");
        inbox.process(&d, bump).unwrap();
        // Ready once more than 20 distinct ids are committed (every fifth offer is a repeat), so the check of
        // progress below does not depend on how many more commits fit before the kill (few under qemu).
        if i == 40 {
            std::fs::write(db.with_file_name("ready"), b"").unwrap();
        }
        i += 1;
    }
}

#[test]
fn counters_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    for round in 0..common::scaled(4) {
        let _ = std::fs::remove_file(dir.path().join("ready"));
        let mut child = common::child_command("child_processes_until_killed")
            .env(DB_VAR, &db)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        assert!(
            common::wait_for_file(&dir.path().join("ready"), Duration::from_secs(60)),
            "child never got going"
        );
        // Let it run into the middle of some commit.
        std::thread::sleep(Duration::from_millis(50 + 37 * round as u64));
        child.kill().unwrap();
        child.wait().unwrap();

        let inbox = Inbox::open(&db, Config::default()).unwrap();
        let st = inbox.scope_stats("crash").unwrap();
        let rows: i64 = inbox
            .connection()
            .query_row("SELECT count(*) FROM identities", [], |r| r.get(0))
            .unwrap();
        assert!(st.processed > 20);
        assert_eq!(st.processed, effects(&inbox, "crash"), "round {round}");
        assert_eq!(st.processed, rows as u64, "round {round}");
        // Every child starts again at m0: all it offers were seen, save the ones past where the last one died.
        assert!(st.duplicates > 0);
    }
}
