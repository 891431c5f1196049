//! The inventory example as a user runs it: its demo, `run` against a broker, SIGTERM, `report`.
#![cfg(feature = "mqtt")]

mod broker;
mod common;

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use broker::Broker;

/// The built inventory example, through `EDGE_INBOX_TEST_RUNNER` when set.
fn example(args: &[&str]) -> Command {
    let mut cmd = common::through_runner(&common::built_example("inventory"));
    cmd.args(args);
    cmd
}

struct Guard(Option<Child>);

impl Guard {
    fn wait(mut self, timeout: Duration) -> Output {
        let mut child = self.0.take().unwrap();
        let done = common::wait_for(timeout, || child.try_wait().unwrap());
        if done.is_none() {
            let _ = child.kill();
        }
        let out = child.wait_with_output().unwrap();
        assert!(
            done.is_some(),
            "example did not finish: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn(args: &[&str]) -> Guard {
    Guard(Some(
        example(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ))
}

fn report(db: &Path) -> serde_json::Value {
    let out = spawn(&["report", "--db", db.to_str().unwrap()]).wait(Duration::from_secs(60));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn demo_runs_the_seed_scenario_on_its_own_broker() {
    let out = spawn(&[]).wait(Duration::from_secs(120));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        r#"{"reserved":{"A-1":3,"B-7":1},"processed":5,"duplicates":1,"conflicts":1,"quarantined":1}"#
    );
}

#[test]
fn without_mosquitto_the_demo_runs_on_the_embedded_broker_says_so_first_and_reports_the_same() {
    let child = example(&[])
        .env("EDGE_INBOX_MOSQUITTO", "/nonexistent/mosquitto")
        .env_remove("EDGE_INBOX_LOCAL_BROKER")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = Guard(Some(child)).wait(Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let first = stderr.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("broker: rumqttd embedded") && first.contains("--broker HOST:PORT"),
        "first line: {first}"
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        r#"{"reserved":{"A-1":3,"B-7":1},"processed":5,"duplicates":1,"conflicts":1,"quarantined":1}"#
    );
}

#[test]
fn run_stops_cleanly_on_sigterm_after_acking_and_report_reads_the_durable_counts() {
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    let db_s = db.to_str().unwrap();
    let addr = broker.addr();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--broker",
            &addr,
            "--db",
            db_s,
            "--client-id",
            "inv-example",
        ];
        args.extend_from_slice(extra);
        spawn(&args)
    };
    // Create the session.
    assert!(run(&["--exit-when-idle", "1"])
        .wait(Duration::from_secs(60))
        .status
        .success());

    let ev = |o: u32, sku: &str, q: u32, k: &str| {
        format!(r#"{{"order":{o},"sku":"{sku}","qty":{q},"kind":"{k}"}}"#)
    };
    broker.publish_v5(
        "orders/1",
        Some("evt-1-created"),
        &ev(1, "A-1", 3, "created"),
    );
    broker.publish_v5(
        "orders/2",
        Some("evt-2-created"),
        &ev(2, "Z-9", 1, "created"),
    );
    broker.publish_v5(
        "orders/1",
        Some("evt-1-created"),
        &ev(1, "A-1", 3, "created"),
    );
    broker.publish_v5(
        "orders/2",
        Some("evt-2-cancelled"),
        &ev(2, "Z-9", 1, "cancelled"),
    );
    broker.publish_v5("orders/3", Some("evt-3-created"), "{not json"); // handler fails, dead-lettered
    broker.publish_v5("orders/4", None, &ev(4, "A-1", 1, "created")); // quarantined

    let consumer = run(&[]);
    let settled = common::wait_for(Duration::from_secs(60), || {
        let st = edge_inbox::Inbox::open(&db, edge_inbox::Config::default())
            .ok()?
            .scope_stats("inventory-reservation")
            .ok()?;
        (st.processed + st.duplicates + st.dead_lettered + st.quarantined >= 6).then_some(())
    });
    assert!(
        settled.is_some(),
        "the consumer did not settle the deliveries"
    );
    let pid = consumer.0.as_ref().unwrap().id();
    assert!(Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    let out = consumer.wait(Duration::from_secs(30));
    assert!(
        out.status.success(),
        "SIGTERM is a clean stop: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let expected = serde_json::json!({"reserved":{"A-1":3,"Z-9":0},"processed":3,"duplicates":1,"conflicts":0,"quarantined":1});
    assert_eq!(report(&db), expected);
    // Everything was acked before the disconnect: a new run gets no redeliveries, the counts stay.
    assert!(run(&["--exit-when-idle", "1"])
        .wait(Duration::from_secs(60))
        .status
        .success());
    assert_eq!(report(&db), expected);
    let dead: i64 = edge_inbox::Inbox::open(&db, edge_inbox::Config::default())
        .unwrap()
        .scope_stats("inventory-reservation")
        .unwrap()
        .dead_lettered as i64;
    assert_eq!(dead, 1);
}
