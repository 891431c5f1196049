//! Bad disks and bad neighbours, on real files and real processes: a full disk, a read-only database, the WAL
//! deleted underneath a running inbox, the database held busy by another process, a corrupt file. Each gives
//! a clear error of a known variant, nothing is reported done that is not durable, and the inbox recovers once
//! the cause is gone.
//!
//! A custom test harness (`harness = false`, libtest-mimic): a case this machine cannot stage (no private
//! mount namespace for a read-only file system) is reported as ignored, with the reason, never as passed.

mod cli_support;
mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use edge_inbox::rusqlite::{ffi, Connection};
use edge_inbox::{Config, Delivery, Error, Inbox, Outcome, Status, Tx};
use libtest_mimic::{Arguments, Completion, Trial};

const SCOPE: &str = "faults";
const CHILD_ENV: &str = "EDGE_INBOX_FAULT_DIR";

fn bump(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let n: i64 = tx.get(d.message_id)?.unwrap_or(0);
    tx.put(d.message_id, &(n + 1))?;
    Ok(())
}

fn effects(conn: &Connection, id: &str) -> i64 {
    conn.query_row(
        "SELECT value FROM kv WHERE ns = ?1 AND key = ?2",
        (SCOPE, id),
        |r| r.get::<_, Vec<u8>>(0),
    )
    .map(|b| ciborium::from_reader(&b[..]).unwrap())
    .unwrap_or(0)
}

fn delivery(id: &str) -> Delivery<'_> {
    Delivery::new(SCOPE, id, "t/1", b"payload")
}

fn recorded(inbox: &mut Inbox, id: &str) -> bool {
    matches!(
        inbox.status(SCOPE, None, id).unwrap(),
        Status::Recorded { .. }
    )
}

/// The child's working directory, when this process is a child started by a test below.
fn child_dir() -> Option<PathBuf> {
    std::env::var_os(CHILD_ENV).map(PathBuf::from)
}

fn spawn_child(test: &str, dir: &Path) -> Child {
    common::child_command(test)
        .env(CHILD_ENV, dir)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child test process")
}

fn kill(mut child: Child) {
    let _ = std::process::Command::new("kill")
        .args(["-9", &child.id().to_string()])
        .status();
    let _ = child.wait();
}

fn disk_full_fails_cleanly_and_the_same_delivery_commits_once_space_returns() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    assert!(matches!(
        inbox.process(&delivery("warm"), bump).unwrap(),
        Outcome::Processed
    ));
    // The file may not grow by a single page: the next effect that needs room cannot be written.
    let pages: i64 = inbox
        .connection()
        .query_row("PRAGMA page_count", [], |r| r.get(0))
        .unwrap();
    inbox
        .connection()
        .execute_batch(&format!("PRAGMA max_page_count = {pages}"))
        .unwrap();
    let big = vec![7u8; 256 * 1024];
    let d = Delivery::new(SCOPE, "big", "t/1", &big);
    let mut ran = 0;
    let mut store_body = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        ran += 1;
        tx.put("body", &d.payload.to_vec())?;
        bump(tx, d)
    };
    let err = inbox.process(&d, &mut store_body).unwrap_err();
    assert!(matches!(err, Error::DiskFull), "{err:?}");
    assert!(err.is_retryable());
    assert!(!recorded(&mut inbox, "big"), "nothing of it committed");
    assert_eq!(effects(inbox.connection(), "big"), 0);
    // A deferred receive of the same body hits the same wall.
    assert!(matches!(inbox.receive(&d).unwrap_err(), Error::DiskFull));
    assert!(!recorded(&mut inbox, "big"));

    // Space comes back: the redelivery is processed, exactly once.
    inbox
        .connection()
        .execute_batch("PRAGMA max_page_count = 1073741823")
        .unwrap();
    assert!(matches!(
        inbox.process(&d, &mut store_body).unwrap(),
        Outcome::Processed
    ));
    assert!(matches!(
        inbox.process(&d, &mut store_body).unwrap(),
        Outcome::Duplicate
    ));
    assert_eq!(ran, 2, "the failed attempt and the successful one");
    assert_eq!(effects(inbox.connection(), "big"), 1);
    assert_eq!(inbox.scope_stats(SCOPE).unwrap().processed, 2);
}

fn a_read_only_database_refuses_writes_without_reporting_anything_done() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    inbox.process(&delivery("before"), bump).unwrap();
    // Root ignores file modes, so the connection itself is made read-only.
    inbox
        .connection()
        .execute_batch("PRAGMA query_only = ON")
        .unwrap();
    for attempt in [
        inbox.process(&delivery("ro"), bump).map(drop),
        inbox.receive(&delivery("ro")).map(drop),
        inbox.dead_letter(&delivery("ro"), "x").map(drop),
        inbox.quarantine(SCOPE, "t", b"p", "x").map(drop),
    ] {
        match attempt.unwrap_err() {
            Error::ReadOnly { code } => assert_eq!(code & 0xff, ffi::SQLITE_READONLY),
            other => panic!("expected ReadOnly, got {other:?}"),
        }
    }
    assert!(!recorded(&mut inbox, "ro"));
    inbox
        .connection()
        .execute_batch("PRAGMA query_only = OFF")
        .unwrap();
    assert!(matches!(
        inbox.process(&delivery("ro"), bump).unwrap(),
        Outcome::Processed
    ));
    assert_eq!(effects(inbox.connection(), "ro"), 1);
}

/// A read-only file system, when this machine lets us make one (a private mount namespace); else ignored.
fn a_database_on_a_read_only_mount_is_refused_at_open() -> Completion {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    inbox.process(&delivery("before"), bump).unwrap();
    drop(inbox);
    let ro_dir = dir.path().join("ro");
    std::fs::create_dir(&ro_dir).unwrap();
    std::fs::copy(&path, ro_dir.join("inbox.db")).unwrap();
    let mount = format!(
        "mount --bind {0} {0} && mount -o remount,ro,bind {0} {0}",
        ro_dir.display()
    );
    let probe = std::process::Command::new("unshare")
        .args([
            "-m",
            "sh",
            "-c",
            &format!("{mount} && ! touch {}/x", ro_dir.display()),
        ])
        .stderr(Stdio::null())
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        return Completion::ignored_with(
            "no private mount namespace here (`unshare -m` with a read-only bind mount failed)",
        );
    }
    let cmd = common::child_command("child_opens_on_a_read_only_mount");
    let mut args = vec![cmd.get_program().to_owned()];
    args.extend(cmd.get_args().map(|a| a.to_owned()));
    let out = std::process::Command::new("unshare")
        .args(["-m", "sh", "-c", &format!("{mount} && exec \"$@\""), "sh"])
        .args(args)
        .env(CHILD_ENV, &ro_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child on a read-only mount: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Completion::Completed
}

fn child_opens_on_a_read_only_mount() {
    let dir = child_dir().expect("started as a child, with its directory");
    let path = dir.join("inbox.db");
    let err = Inbox::open(&path, Config::default()).unwrap_err();
    // The file is there and intact, but SQLite can create neither the WAL nor its index next to it.
    match &err {
        Error::Open { path: p, .. } => assert_eq!(p, &path),
        other => panic!("expected Open, got {other:?}"),
    }
    assert!(!err.is_retryable(), "an operator has to act");
    assert!(err.to_string().contains("cannot open"), "{err}");
}

fn wal_deleted_underneath_a_running_inbox_loses_nothing_that_was_reported_done() {
    let dir = tempfile::tempdir().unwrap();
    let child = spawn_child("child_deletes_its_wal_and_keeps_committing", dir.path());
    let done = dir.path().join("reported-done");
    assert!(
        common::wait_for_file(&done, Duration::from_secs(60)),
        "child did not get through its deliveries"
    );
    // The process dies without closing: only what reached the database file survives.
    kill(child);
    let reported: Vec<String> = std::fs::read_to_string(&done)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(reported.len(), 6, "{reported:?}");

    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    for id in &reported {
        assert!(
            recorded(&mut inbox, id),
            "{id} was reported done but is gone"
        );
        assert_eq!(effects(inbox.connection(), id), 1, "{id}");
        // The broker's redelivery is recognised.
        assert!(matches!(
            inbox.process(&delivery(id), bump).unwrap(),
            Outcome::Duplicate
        ));
    }
    assert!(matches!(
        inbox.process(&delivery("after"), bump).unwrap(),
        Outcome::Processed
    ));
    assert!(dir.path().join("inbox.db-wal").exists(), "a new WAL");
    let check = cli_support::json(&dir.path().join("inbox.db"), &["check"]);
    assert_eq!(check["ok"], true, "{check}");
}

fn child_deletes_its_wal_and_keeps_committing() {
    let dir = child_dir().expect("started as a child, with its directory");
    let path = dir.join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    let mut done = Vec::new();
    for id in ["a0", "a1", "a2"] {
        assert!(matches!(
            inbox.process(&delivery(id), bump).unwrap(),
            Outcome::Processed
        ));
        done.push(id);
    }
    std::fs::remove_file(dir.join("inbox.db-wal")).unwrap();
    // An operator's look (as `inboxctl stats` does) recreates an empty WAL at the same path: it is not the
    // file this inbox writes into.
    let _ = edge_inbox::open_read_only(&path);
    for id in ["b0", "b1", "b2"] {
        // Whatever the inbox answers, an Ok must be durable.
        if let Ok(Outcome::Processed) = inbox.process(&delivery(id), bump) {
            done.push(id);
        }
    }
    let tmp = dir.join("reported-done.tmp");
    std::fs::write(&tmp, done.join("\n")).unwrap();
    std::fs::rename(&tmp, dir.join("reported-done")).unwrap();
    std::thread::sleep(Duration::from_secs(120)); // killed by the parent
}

fn a_database_held_busy_by_another_process_is_busy_not_duplicate_and_recovers_when_it_dies() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(
        &path,
        Config::default().busy_timeout(Duration::from_millis(200)),
    )
    .unwrap();
    inbox.process(&delivery("first"), bump).unwrap();
    let child = spawn_child("child_holds_the_write_lock", dir.path());
    assert!(
        common::wait_for_file(&dir.path().join("locked"), Duration::from_secs(60)),
        "child did not take the lock"
    );
    let d = delivery("contended");
    for _ in 0..2 {
        match inbox.process(&d, bump).unwrap_err() {
            e @ Error::Busy { .. } => {
                assert!(e.is_retryable());
                assert_eq!(e.sqlite_code().unwrap() & 0xff, ffi::SQLITE_BUSY);
            }
            other => panic!("expected Busy, got {other:?}"),
        }
    }
    // Readers are not blocked: the operator can look while it is stuck.
    let stats = cli_support::json(&path, &["stats"]);
    assert_eq!(stats["scopes"][0]["processed"], 1);
    assert!(!recorded(&mut inbox, "contended"));

    kill(child); // the lock holder dies mid-transaction: its write is rolled back, the lock released
    assert!(matches!(
        inbox.process(&d, bump).unwrap(),
        Outcome::Processed
    ));
    assert_eq!(effects(inbox.connection(), "contended"), 1);
    assert_eq!(
        effects(inbox.connection(), "intruder"),
        0,
        "the dead holder's write never committed"
    );
    assert_eq!(inbox.scope_stats(SCOPE).unwrap().duplicates, 0);
}

fn child_holds_the_write_lock() {
    let dir = child_dir().expect("started as a child, with its directory");
    let conn = Connection::open(dir.join("inbox.db")).unwrap();
    conn.execute_batch("BEGIN IMMEDIATE").unwrap();
    conn.execute(
        "INSERT INTO kv (ns, key, value) VALUES (?1, 'intruder', x'01')",
        [SCOPE],
    )
    .unwrap();
    std::fs::write(dir.join("locked"), b"").unwrap();
    std::thread::sleep(Duration::from_secs(120)); // killed by the parent
}

fn a_corrupt_file_is_refused_at_open_and_a_corrupt_page_is_reported_by_check() {
    let dir = tempfile::tempdir().unwrap();
    // Garbage where the header should be.
    let garbage = dir.path().join("garbage.db");
    let noise: Vec<u8> = (0..16_384u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&garbage, &noise).unwrap();
    match Inbox::open(&garbage, Config::default()).unwrap_err() {
        Error::NotADatabase { path } => assert_eq!(path, garbage),
        other => panic!("expected NotADatabase, got {other:?}"),
    }
    assert_eq!(
        std::fs::read(&garbage).unwrap(),
        noise,
        "the file is left as it was"
    );
    let out = cli_support::inboxctl(&garbage, &["check"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not an SQLite database"));

    // A valid inbox with one damaged b-tree page.
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    let ids: Vec<String> = (0..3000).map(|i| format!("evt-{i}")).collect();
    let batch: Vec<_> = ids.iter().map(|id| delivery(id)).collect();
    inbox.process_batch(&batch, bump).unwrap();
    drop(inbox); // the last connection checkpoints the WAL into the file
    let backup = dir.path().join("backup.db");
    std::fs::copy(&path, &backup).unwrap();
    let (page_size, root): (i64, i64) = {
        let c = Connection::open(&path).unwrap();
        (
            c.query_row("PRAGMA page_size", [], |r| r.get(0)).unwrap(),
            c.query_row(
                "SELECT rootpage FROM sqlite_schema WHERE name = 'kv'",
                [],
                |r| r.get(0),
            )
            .unwrap(),
        )
    };
    let (page_size, root) = (page_size as u64, root as u64);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = ((root - 1) * page_size) as usize;
    for (i, b) in bytes[at..at + page_size as usize].iter_mut().enumerate() {
        *b = 0xA5 ^ i as u8;
    }
    std::fs::write(&path, &bytes).unwrap();

    let out = cli_support::inboxctl(&path, &["--json", "check"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "check must fail on a corrupt page"
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["ok"], false);
    assert!(
        !report["problems"].as_array().unwrap().is_empty(),
        "{report}"
    );
    // Reading the damaged table is a storage error, never an answer.
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    match inbox.process(&delivery("fresh"), bump) {
        Err(Error::Storage { code, .. }) => assert_eq!(code & 0xff, ffi::SQLITE_CORRUPT),
        other => panic!("expected a corruption error, got {other:?}"),
    }
    drop(inbox);

    // Recovery is a restore: the backup checks clean and deduplicates as before.
    std::fs::copy(&backup, &path).unwrap();
    assert_eq!(cli_support::json(&path, &["check"])["ok"], true);
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    assert!(matches!(
        inbox.process(&delivery("evt-1"), bump).unwrap(),
        Outcome::Duplicate
    ));
}

type Case = (&'static str, fn());

/// The cases, each run in this process.
const CASES: [Case; 4] = [
    (
        "disk_full_fails_cleanly_and_the_same_delivery_commits_once_space_returns",
        disk_full_fails_cleanly_and_the_same_delivery_commits_once_space_returns,
    ),
    (
        "a_read_only_database_refuses_writes_without_reporting_anything_done",
        a_read_only_database_refuses_writes_without_reporting_anything_done,
    ),
    (
        "wal_deleted_underneath_a_running_inbox_loses_nothing_that_was_reported_done",
        wal_deleted_underneath_a_running_inbox_loses_nothing_that_was_reported_done,
    ),
    (
        "a_database_held_busy_by_another_process_is_busy_not_duplicate_and_recovers_when_it_dies",
        a_database_held_busy_by_another_process_is_busy_not_duplicate_and_recovers_when_it_dies,
    ),
];

/// The other halves of the cases above, run only in a child process started by one of them.
const CHILDREN: [Case; 3] = [
    (
        "child_opens_on_a_read_only_mount",
        child_opens_on_a_read_only_mount,
    ),
    (
        "child_deletes_its_wal_and_keeps_committing",
        child_deletes_its_wal_and_keeps_committing,
    ),
    ("child_holds_the_write_lock", child_holds_the_write_lock),
];

fn main() {
    let args = Arguments::from_args();
    let mut trials: Vec<Trial> = CASES
        .iter()
        .chain(
            [(
                "a_corrupt_file_is_refused_at_open_and_a_corrupt_page_is_reported_by_check",
                a_corrupt_file_is_refused_at_open_and_a_corrupt_page_is_reported_by_check as fn(),
            )]
            .iter(),
        )
        .map(|&(name, f)| {
            Trial::test(name, move || {
                f();
                Ok(())
            })
        })
        .collect();
    trials.push(Trial::ignorable_test(
        "a_database_on_a_read_only_mount_is_refused_at_open",
        || Ok(a_database_on_a_read_only_mount_is_refused_at_open()),
    ));
    if child_dir().is_some() {
        trials.extend(CHILDREN.iter().map(|&(name, f)| {
            Trial::test(name, move || {
                f();
                Ok(())
            })
        }));
    }
    libtest_mimic::run(&args, trials).exit();
}
