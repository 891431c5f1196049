//! Running the `inboxctl` binary from integration tests.
#![allow(dead_code)]

use std::path::Path;
use std::process::Output;

/// `inboxctl` as built for these tests, through `EDGE_INBOX_TEST_RUNNER` when set (cross builds run under
/// qemu-user, and so must the binary).
pub fn inboxctl(db: &Path, args: &[&str]) -> Output {
    let exe = env!("CARGO_BIN_EXE_inboxctl");
    let mut cmd = super::common::through_runner(Path::new(exe));
    cmd.env_remove("EDGE_INBOX_DB")
        .arg("--db")
        .arg(db)
        .args(args)
        .output()
        .expect("run inboxctl")
}

/// Stdout of a run that must succeed.
pub fn ok(db: &Path, args: &[&str]) -> String {
    let out = inboxctl(db, args);
    assert_eq!(
        out.status.code(),
        Some(0),
        "inboxctl {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The single JSON document printed by a successful `--json` run.
pub fn json(db: &Path, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    serde_json::from_str(&ok(db, &all)).expect("one JSON document")
}

/// The JSON lines printed by a successful `--json` listing.
pub fn json_lines(db: &Path, args: &[&str]) -> Vec<serde_json::Value> {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    ok(db, &all)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}
