//! Running the built inventory example as a user does: spawned (through `EDGE_INBOX_TEST_RUNNER` when set),
//! bounded in time, killed on drop.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use crate::common;

/// The scope the example consumes for.
pub const SCOPE: &str = "inventory-reservation";

/// The built inventory example, through `EDGE_INBOX_TEST_RUNNER` when set.
pub fn example(args: &[&str]) -> Command {
    let mut cmd = common::through_runner(&common::built_example("inventory"));
    cmd.args(args);
    cmd
}

/// A running example; killed (SIGKILL) on drop.
pub struct Guard(pub Option<Child>);

impl Guard {
    /// Waits, bounded, for the exit and returns the output; fails the test if it did not exit.
    pub fn wait(mut self, timeout: Duration) -> Output {
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

    /// Like [`Guard::wait`], and fails the test unless the exit status is success.
    pub fn success(self, timeout: Duration) -> Output {
        let out = self.wait(timeout);
        assert!(
            out.status.success(),
            "example failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// SIGKILL: no chance to finish a batch, ack, or stop the relay.
    pub fn kill9(mut self) {
        let mut child = self.0.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }

    pub fn pid(&self) -> u32 {
        self.0.as_ref().unwrap().id()
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

/// Spawns `cmd` with its output captured.
pub fn spawn_cmd(mut cmd: Command) -> Guard {
    Guard(Some(
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ))
}

pub fn spawn(args: &[&str]) -> Guard {
    spawn_cmd(example(args))
}

/// `inventory run --broker ADDR --db DB --client-id ID EXTRA...`.
pub fn run_cmd(addr: &str, db: &Path, client_id: &str, extra: &[&str]) -> Command {
    let mut cmd = example(&[
        "run",
        "--broker",
        addr,
        "--db",
        db.to_str().unwrap(),
        "--client-id",
        client_id,
    ]);
    cmd.args(extra);
    cmd
}

/// `inventory report --db DB`, parsed.
pub fn report(db: &Path) -> serde_json::Value {
    let out = spawn(&["report", "--db", db.to_str().unwrap()]).success(Duration::from_secs(60));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// An order event as the example reads it.
pub fn event(order: u64, sku: &str, qty: u64, kind: &str) -> String {
    format!(r#"{{"order":{order},"sku":"{sku}","qty":{qty},"kind":"{kind}"}}"#)
}

/// The id the example's events carry.
pub fn event_id(order: u64, kind: &str) -> String {
    format!("evt-{order}-{kind}")
}

/// The `message-id` the example gives the announcement of event `id` (the outbox's derived id).
pub fn announcement_id(id: &str) -> String {
    edge_inbox::outbox_message_id(SCOPE, None, id, 0)
}
