//! The firmware examples (`firmware`: sync rumqttc client; `firmware_tokio`: `AsyncClient` on tokio) share a
//! command line and a behaviour: one connection for telemetry and commands, each command applied once. These
//! are their scenarios, run by `tests/firmware_example.rs` and `tests/firmware_tokio_example.rs` on the
//! example each names.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::broker::{publish_v5, Broker, Msg};
use crate::common;
use crate::inventory_support::{spawn_cmd, Guard};
use crate::outbox_support::Subscriber;

pub const SCOPE: &str = "firmware-commands";

/// The built example `example` on `broker`, with its output captured.
pub fn firmware(
    example: &str,
    broker: &Broker,
    db: &Path,
    device: &str,
    extra: &[&str],
) -> Command {
    let mut cmd = common::through_runner(&common::built_example(example));
    cmd.args(["--broker", &broker.addr(), "--db"])
        .arg(db)
        .args(["--device", device, "--telemetry-ms", "50"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Reads a number the handler keeps in the inbox's key-value state.
pub fn state(db: &Path, key: &str) -> i64 {
    let conn = rusqlite::Connection::open(db).unwrap();
    let blob: Option<Vec<u8>> = conn
        .query_row(
            "SELECT value FROM kv WHERE ns = ?1 AND key = ?2",
            (SCOPE, key),
            |r| r.get(0),
        )
        .ok();
    blob.map(|b| ciborium::from_reader(&b[..]).unwrap())
        .unwrap_or(0)
}

pub fn command(device: &str, i: i64) -> Msg {
    Msg::new(
        &format!("cmd/{device}/add"),
        Some(&format!("cmd-{i}")),
        format!(r#"{{"add":{i}}}"#),
    )
}

/// Runs the example until idle; its stdout summary.
pub fn run_until_idle(
    example: &str,
    broker: &Broker,
    db: &Path,
    device: &str,
) -> serde_json::Value {
    let out = spawn_cmd(firmware(
        example,
        broker,
        db,
        device,
        &["--exit-when-idle", "2"],
    ))
    .success(Duration::from_secs(120));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// Ten commands and two repeats: ten applied, two duplicates, telemetry on the same connection, and
/// everything acked (a third run gets no redelivery).
pub fn applies_each_command_once_and_publishes_telemetry(example: &str, device: &str) {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("fw.db");
    let telemetry = Subscriber::start(
        broker.port,
        &format!("{device}-telemetry-watch"),
        &format!("telemetry/{device}"),
    );
    // The session and its subscription exist before commands are published.
    run_until_idle(example, &broker, &db, device);
    let mut msgs: Vec<Msg> = (1..=10).map(|i| command(device, i)).collect();
    msgs.push(command(device, 3)); // a repeat
    msgs.push(command(device, 7));
    publish_v5(broker.port, &msgs);

    let s = run_until_idle(example, &broker, &db, device);
    assert_eq!(
        (s["processed"].as_u64(), s["duplicates"].as_u64()),
        (Some(10), Some(2)),
        "{s}"
    );
    assert!(s["telemetry"].as_u64().unwrap() > 0, "{s}");
    assert_eq!((state(&db, "count"), state(&db, "sum")), (10, 55));
    let deadline = Instant::now() + Duration::from_secs(20);
    while telemetry.count() == 0 {
        assert!(Instant::now() < deadline, "no telemetry reached the broker");
        std::thread::sleep(Duration::from_millis(20));
    }

    let s = run_until_idle(example, &broker, &db, device);
    assert_eq!(
        (s["processed"].as_u64(), s["duplicates"].as_u64()),
        (Some(0), Some(0)),
        "{s}"
    );
}

/// SIGTERM while running: it exits successfully, and what it committed was acked (the next run gets no
/// redelivery).
pub fn stops_on_sigterm_after_acking_what_it_committed(example: &str, device: &str) {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("fw.db");
    run_until_idle(example, &broker, &db, device);
    let child = spawn_cmd(firmware(example, &broker, &db, device, &[]));
    let msgs: Vec<Msg> = (1..=20).map(|i| command(device, i)).collect();
    publish_v5(broker.port, &msgs);
    let deadline = Instant::now() + Duration::from_secs(60);
    while state(&db, "count") < 20 {
        assert!(Instant::now() < deadline, "commands not applied");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = child.pid();
    assert!(Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    let out = child.success(Duration::from_secs(60));
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s["processed"].as_u64(), Some(20), "{s}");
    let s = run_until_idle(example, &broker, &db, device);
    assert_eq!(s["duplicates"].as_u64(), Some(0), "{s}");
}

/// SIGTERM while commands stream in: the run exits successfully having acked exactly what it committed, so
/// the next run gets no redelivery of it (no duplicate) and every command it left uncommitted (none lost).
pub fn sigterm_mid_stream_acks_what_it_committed_and_nothing_else(example: &str, device: &str) {
    let broker = Broker::start_logged();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("fw.db");
    run_until_idle(example, &broker, &db, device);
    let n = common::scaled(600) as i64;
    let stream: Vec<Msg> = (1..=n).map(|i| command(device, i)).collect();
    // Slow commands: batches take a while, so the stop lands in one.
    let child = spawn_cmd(firmware(
        example,
        &broker,
        &db,
        device,
        &["--apply-ms", "3"],
    ));
    let port = broker.port;
    let publisher = std::thread::spawn(move || {
        for chunk in stream.chunks(10) {
            publish_v5(port, chunk);
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while state(&db, "count") < n / 4 {
        assert!(Instant::now() < deadline, "commands not applied");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(Command::new("kill")
        .args(["-TERM", &child.pid().to_string()])
        .status()
        .unwrap()
        .success());
    let out = child.success(Duration::from_secs(60));
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let committed = s["processed"].as_i64().unwrap();
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(state(&db, "count"), committed, "{s}");
    publisher.join().unwrap();
    let s = run_until_idle(example, &broker, &db, device);
    assert_eq!(
        (s["duplicates"].as_i64(), s["processed"].as_i64()),
        (Some(0), Some(n - committed)),
        "{committed} committed before the stop; then {s}; the stopped run's log:\n{log}\nthe broker's \
         lines for {device}:\n{}",
        broker_lines(&broker, device)
    );
    assert_eq!(
        (state(&db, "count"), state(&db, "sum")),
        (n, n * (n + 1) / 2)
    );
}

/// The broker's log lines that name the client `device` (mosquitto's packet log; none from the embedded
/// broker).
fn broker_lines(broker: &Broker, device: &str) -> String {
    let log = broker.log();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains(device)).collect();
    lines.join("\n")
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Commands (a quarter repeated) published while the example is started and killed with SIGKILL 15 times
/// at random moments; then a run until idle: every distinct command applied exactly once, none left.
pub fn kill9_at_random_moments_loses_and_doubles_no_command(example: &str, device: &str) {
    let seed = common::crash_seed();
    let mut rng = Rng(seed);
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("fw.db");
    run_until_idle(example, &broker, &db, device);

    let n = common::scaled(1500) as i64;
    let mut stream: Vec<Msg> = Vec::new();
    for i in 1..=n {
        stream.push(command(device, i));
        if rng.below(4) == 0 {
            stream.push(command(device, 1 + (i - 1 - rng.below(100) as i64).max(0)));
        }
    }
    let total = stream.len();
    let port = broker.port;
    let publisher = std::thread::spawn(move || {
        for chunk in stream.chunks(total / 30 + 1) {
            publish_v5(port, chunk);
            std::thread::sleep(Duration::from_millis(150));
        }
    });
    let deadline = Instant::now() + Duration::from_secs(240);
    for _ in 0..15 {
        assert!(Instant::now() < deadline, "kill loop ran out of time");
        let child: Guard = spawn_cmd(firmware(example, &broker, &db, device, &[]));
        std::thread::sleep(Duration::from_millis(200 + rng.below(500)));
        child.kill9();
    }
    publisher.join().unwrap();
    run_until_idle(example, &broker, &db, device);

    assert_eq!(
        (state(&db, "count"), state(&db, "sum")),
        (n, n * (n + 1) / 2),
        "every distinct command applied exactly once ({total} published)"
    );
    let s = run_until_idle(example, &broker, &db, device);
    assert_eq!(
        s["processed"].as_u64(),
        Some(0),
        "nothing left unapplied: {s}"
    );
}
