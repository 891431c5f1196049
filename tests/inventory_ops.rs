//! The inventory example as an operator and a supervisor meet it: a password never sent or kept carelessly
//! without a word, and a run that cannot go on exits non-zero instead of running (or exiting 0) as if all
//! were well.
#![cfg(feature = "mqtt")]

mod broker;
mod common;
mod inventory_support;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::time::{Duration, Instant};

use broker::{Broker, Kind};
use inventory_support::{event, event_id, report, run_cmd, spawn_cmd};

const PASSWORD: &str = "pw-never-shown";

fn password_file(dir: &Path, mode: u32) -> std::path::PathBuf {
    let path = dir.join(format!("password-{mode:o}"));
    std::fs::write(&path, format!("{PASSWORD}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path
}

#[test]
fn a_password_file_readable_by_group_or_others_is_refused_before_connecting() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    for mode in [0o644, 0o640, 0o604, 0o660] {
        let file = password_file(dir.path(), mode);
        // Port 1: nothing listens; the refusal must come before any connection attempt.
        let mut cmd = run_cmd(
            "127.0.0.1:1",
            &db,
            "inv-pwfile",
            &[
                "--username",
                "gw",
                "--password-file",
                file.to_str().unwrap(),
            ],
        );
        cmd.env_remove("MQTT_PASSWORD");
        let out = spawn_cmd(cmd).wait(Duration::from_secs(60));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "mode {mode:o} was accepted: {stderr}"
        );
        assert!(
            stderr.contains(&format!("{mode:o}")) && stderr.contains("chmod 600"),
            "mode {mode:o}: {stderr}"
        );
        assert!(!stderr.contains(PASSWORD), "{stderr}");
        assert!(!db.exists(), "a refused run created the database");
    }
}

#[test]
fn a_private_password_file_logs_in_and_a_password_without_tls_is_warned_about_once() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    let warning = "in clear text";
    for mode in [0o600, 0o400] {
        let file = password_file(dir.path(), mode);
        // The consumer and the relay both log in (and would again after every reconnect): one warning.
        let mut cmd = run_cmd(
            &broker.addr(),
            &db,
            "inv-clear",
            &[
                "--username",
                "gw",
                "--password-file",
                file.to_str().unwrap(),
                "--announce",
                "--exit-when-idle",
                "1",
            ],
        );
        cmd.env_remove("MQTT_PASSWORD").env("RUST_LOG", "info");
        let out = spawn_cmd(cmd).success(Duration::from_secs(60));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("connected (session present"), "{stderr}");
        assert_eq!(stderr.matches(warning).count(), 1, "{stderr}");
        assert!(!stderr.contains(PASSWORD), "{stderr}");
    }
    // From the environment: the same warning.
    let mut cmd = run_cmd(
        &broker.addr(),
        &db,
        "inv-clear",
        &["--username", "gw", "--exit-when-idle", "1"],
    );
    cmd.env("MQTT_PASSWORD", PASSWORD);
    let out = spawn_cmd(cmd).success(Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.matches(warning).count(), 1, "{stderr}");
    assert!(!stderr.contains(PASSWORD), "{stderr}");
    // No login, no warning.
    let out = spawn_cmd(run_cmd(
        &broker.addr(),
        &db,
        "inv-clear",
        &["--exit-when-idle", "1"],
    ))
    .success(Duration::from_secs(60));
    assert!(!String::from_utf8_lossy(&out.stderr).contains(warning));
}

#[test]
fn a_worker_that_stops_for_good_ends_a_receive_only_run_with_a_failure_exit() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    // The broker keeps a session for the client id from here on.
    spawn_cmd(run_cmd(
        &broker.addr(),
        &db,
        "inv-worker",
        &["--receive-only", "--exit-when-idle", "1"],
    ))
    .success(Duration::from_secs(60));
    // Every claim of a stored event now fails with a constraint error: not retryable, so the worker ends.
    let conn = edge_inbox::rusqlite::Connection::open(&db).unwrap();
    conn.execute_batch(
        "CREATE TRIGGER no_claims BEFORE UPDATE ON messages
         BEGIN SELECT RAISE(ABORT, 'claims refused by the operator'); END;",
    )
    .unwrap();
    drop(conn);
    broker.publish_v5(
        "orders/1",
        Some(&event_id(1, "created")),
        &event(1, "W-1", 1, "created"),
    );

    // No idle exit: the run consumes until stopped. With its only worker gone it must not go on storing
    // events nobody applies; a supervisor sees the failure.
    let mut cmd = run_cmd(&broker.addr(), &db, "inv-worker", &["--receive-only"]);
    cmd.env("RUST_LOG", "warn");
    let out = spawn_cmd(cmd).wait(Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("claims refused by the operator"),
        "{stderr}"
    );
    // What the consumer stored before the stop was committed and acked, and is still there to apply.
    let r = report(&db);
    assert_eq!(r["pending"], 1, "{r}");
}

/// The notifications a test's `NOTIFY_SOCKET` received, one line each, in order.
struct Notifications {
    socket: UnixDatagram,
    lines: Vec<String>,
}

impl Notifications {
    fn new(socket: UnixDatagram) -> Notifications {
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        Notifications {
            socket,
            lines: Vec::new(),
        }
    }

    /// Reads for up to `timeout`; true once a line satisfies `f` (among those already read, too).
    fn until(&mut self, timeout: Duration, f: impl Fn(&str) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut checked = 0;
        loop {
            if self.lines[checked..].iter().any(|l| f(l)) {
                return true;
            }
            checked = self.lines.len();
            if Instant::now() >= deadline {
                return false;
            }
            let mut buf = [0u8; 4096];
            if let Ok(n) = self.socket.recv(&mut buf) {
                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                self.lines.extend(text.lines().map(str::to_owned));
            }
        }
    }

    fn count(&self, line: &str) -> usize {
        self.lines.iter().filter(|l| *l == line).count()
    }
}

#[test]
fn under_systemd_it_is_ready_once_subscribed_feeds_the_watchdog_and_says_stopping_on_sigterm() {
    let mut broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    let path = dir.path().join("notify");
    let mut notes = Notifications::new(UnixDatagram::bind(&path).unwrap());
    // mosquitto can be down at the start (the embedded broker lives in this process): readiness must wait
    // for the connection, not for the start.
    let down_first = broker.kind == Kind::Mosquitto;
    if down_first {
        broker.kill();
    }
    let mut cmd = run_cmd(&broker.addr(), &db, "inv-systemd", &[]);
    cmd.env("NOTIFY_SOCKET", &path)
        .env("WATCHDOG_USEC", "1000000")
        .env_remove("WATCHDOG_PID")
        .env("RUST_LOG", "info");
    let child = spawn_cmd(cmd);
    let minute = Duration::from_secs(60);
    assert!(
        notes.until(minute, |l| l.starts_with("STATUS=connecting to")),
        "{:?}",
        notes.lines
    );
    if down_first {
        // Any READY=1 now would be a lie: nothing listens.
        assert!(!notes.until(Duration::from_secs(1), |l| l == "READY=1"));
        broker.start_again();
    }
    assert!(notes.until(minute, |l| l == "READY=1"), "{:?}", notes.lines);
    // READY=1 comes after the SUBACK, and no earlier session of this client id holds a subscription: the
    // one message published now must arrive.
    broker.publish_v5(
        "orders/1",
        Some(&event_id(1, "created")),
        &event(1, "N-1", 1, "created"),
    );
    assert!(
        notes.until(minute, |l| l.starts_with("STATUS=connected")
            && l.contains("processed 1,")),
        "{:?}",
        notes.lines
    );
    assert!(
        notes.until(minute, |l| l == "WATCHDOG=1"),
        "{:?}",
        notes.lines
    );
    assert!(
        !notes.lines.iter().any(|l| l == "STOPPING=1"),
        "{:?}",
        notes.lines
    );
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(
        notes.until(minute, |l| l == "STOPPING=1"),
        "{:?}",
        notes.lines
    );
    let out = child.success(minute);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("connected (session present"), "{stderr}");
    assert_eq!(notes.count("READY=1"), 1, "{:?}", notes.lines);
    assert_eq!(notes.count("STOPPING=1"), 1, "{:?}", notes.lines);
    assert_eq!(report(&db)["processed"], 1);
}

#[test]
fn an_abstract_notify_socket_is_written_to_and_without_notify_socket_nothing_is_sent() {
    use std::os::linux::net::SocketAddrExt;
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    let name = format!("edge-inbox-test-{}-{}", std::process::id(), broker.port);
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let mut notes = Notifications::new(UnixDatagram::bind_addr(&addr).unwrap());
    let mut cmd = run_cmd(
        &broker.addr(),
        &db,
        "inv-abstract",
        &["--exit-when-idle", "1"],
    );
    cmd.env("NOTIFY_SOCKET", format!("@{name}"))
        .env_remove("WATCHDOG_USEC");
    spawn_cmd(cmd).success(Duration::from_secs(60));
    assert!(
        notes.until(Duration::from_secs(5), |l| l == "STOPPING=1"),
        "{:?}",
        notes.lines
    );
    assert_eq!(notes.count("READY=1"), 1, "{:?}", notes.lines);
    assert_eq!(notes.count("WATCHDOG=1"), 0, "{:?}", notes.lines);
    // Without NOTIFY_SOCKET the same run says nothing (this socket stays silent).
    let mut cmd = run_cmd(
        &broker.addr(),
        &db,
        "inv-abstract",
        &["--exit-when-idle", "1"],
    );
    cmd.env_remove("NOTIFY_SOCKET");
    spawn_cmd(cmd).success(Duration::from_secs(60));
    let before = notes.lines.len();
    notes.until(Duration::from_millis(500), |_| false);
    assert_eq!(notes.lines.len(), before, "{:?}", notes.lines);
}
