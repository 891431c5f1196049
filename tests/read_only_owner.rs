//! A read-only command run by another user than the inbox file's owner (an operator in its group) creates
//! no `-wal` or `-shm` beside an idle file: SQLite would create them owned by that user, and the owner's
//! consumer could then not open its own file.
#![cfg(target_os = "linux")]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

#[test]
fn a_read_by_another_user_leaves_an_idle_inbox_without_wal_files() {
    // SAFETY: a plain system call without arguments.
    if unsafe { libc::geteuid() } != 0 || Command::new("setpriv").arg("--version").output().is_err()
    {
        println!("skipped: needs root and setpriv to run a command as another user");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let db = dir.path().join("inbox.db");
    {
        let mut inbox = edge_inbox::Inbox::open(&db, edge_inbox::Config::default()).unwrap();
        inbox
            .process(
                &edge_inbox::Delivery::new("s", "evt-1", "t", b"1"),
                |_: &mut edge_inbox::Tx<'_>, _: &edge_inbox::Delivery<'_>| Ok(()),
            )
            .unwrap();
    }
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644)).unwrap();
    let beside = |suffix: &str| Path::new(&format!("{}{suffix}", db.display())).exists();
    assert!(!beside("-wal") && !beside("-shm"), "the inbox is idle");

    let runner = std::env::var("EDGE_INBOX_TEST_RUNNER").unwrap_or_default();
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .args(runner.split_whitespace())
        .arg(env!("CARGO_BIN_EXE_inboxctl"))
        .arg("--db")
        .arg(&db)
        .arg("stats")
        .env_remove("EDGE_INBOX_DB");
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("processed 1"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        !beside("-wal") && !beside("-shm"),
        "a read by another user created files the owner's consumer may not be able to open"
    );
}
