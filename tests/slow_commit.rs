//! Slow commits are logged (never with payloads), and the warning can be tuned or turned off.

use std::sync::Mutex;
use std::time::Duration;

use edge_inbox::{Config, Delivery, Inbox, Tx};

static LINES: Mutex<Vec<(log::Level, String)>> = Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, r: &log::Record<'_>) {
        LINES
            .lock()
            .unwrap()
            .push((r.level(), r.args().to_string()));
    }
    fn flush(&self) {}
}

static LOGGER: Capture = Capture;

fn slow_lines() -> Vec<String> {
    LINES
        .lock()
        .unwrap()
        .iter()
        .filter(|(l, m)| *l == log::Level::Warn && m.starts_with("slow commit"))
        .map(|(_, m)| m.clone())
        .collect()
}

/// One test: the logger is process-wide.
#[test]
fn commits_over_the_threshold_are_warned_about_and_the_warning_can_be_turned_off() {
    log::set_logger(&LOGGER).unwrap();
    log::set_max_level(log::LevelFilter::Trace);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let payload = b"secret-payload-bytes";
    let noop = |_: &mut Tx<'_>, _: &Delivery<'_>| Ok(());

    // A threshold no commit can beat: every commit is reported.
    let mut inbox = Inbox::open(
        &path,
        Config::default().slow_commit_warning(Some(Duration::ZERO)),
    )
    .unwrap();
    inbox
        .process(&Delivery::new("s", "a", "t", payload), noop)
        .unwrap();
    let lines = slow_lines();
    assert!(!lines.is_empty(), "the commit was reported");
    assert!(lines.iter().all(|l| l.contains("threshold")), "{lines:?}");
    drop(inbox);

    // Off: nothing reported, whatever the commit took.
    LINES.lock().unwrap().clear();
    let mut inbox = Inbox::open(&path, Config::default().slow_commit_warning(None)).unwrap();
    inbox
        .process(&Delivery::new("s", "b", "t", payload), noop)
        .unwrap();
    assert!(slow_lines().is_empty());
    // No log line at any level carries a payload.
    inbox
        .quarantine(
            "s",
            "t",
            payload,
            "delivery carries no application message id",
        )
        .unwrap();
    inbox
        .dead_letter(&Delivery::new("s", "c", "t", payload), "refused")
        .unwrap();
    let conflicting = Delivery::new("s", "b", "t", b"other-secret");
    inbox.process(&conflicting, noop).unwrap();
    let all = LINES.lock().unwrap().clone();
    assert!(all.iter().any(|(_, m)| m.contains("conflict")), "{all:?}");
    assert!(
        all.iter().any(|(_, m)| m.contains("quarantined")),
        "{all:?}"
    );
    assert!(
        all.iter().any(|(_, m)| m.contains("dead-lettered")),
        "{all:?}"
    );
    for (_, m) in &all {
        assert!(!m.contains("secret"), "payload in a log line: {m}");
    }
}
