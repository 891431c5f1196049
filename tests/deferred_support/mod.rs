//! Helpers shared by the received-then-deferred tests.
#![allow(dead_code)]

use std::path::Path;
use std::time::{Duration, Instant};

use edge_inbox::{Config, Delivery, Inbox, Tx};

pub const SCOPE: &str = "deferred-test";

/// Test settings: durable as in production, but patient with four processes on one file under emulation.
pub fn config() -> Config {
    Config::default().busy_timeout(Duration::from_secs(30))
}

/// Opens an inbox and creates the application table the handlers below write to.
pub fn open(path: &Path) -> Inbox {
    let inbox = Inbox::open(path, config()).expect("open inbox");
    inbox
        .connection()
        .execute_batch(
            "CREATE TABLE IF NOT EXISTS effects (message_id TEXT PRIMARY KEY, n INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS last_seen (order_key TEXT PRIMARY KEY, n INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS violations (order_key TEXT, expected INTEGER, got INTEGER);",
        )
        .expect("create application tables");
    inbox
}

/// The effect: counts applications per message id (a repeated effect shows as n > 1, not as a hidden no-op).
pub fn count_effect(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    tx.sql().execute(
        "INSERT INTO effects (message_id, n) VALUES (?1, 1) ON CONFLICT (message_id) DO UPDATE SET n = n + 1",
        [d.message_id],
    )?;
    Ok(())
}

/// (distinct messages with an effect, total effects, largest count for one message).
pub fn effects(inbox: &Inbox) -> (i64, i64, i64) {
    inbox
        .connection()
        .query_row(
            "SELECT count(*), coalesce(sum(n), 0), coalesce(max(n), 0) FROM effects",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .expect("read effects")
}

/// Messages per state: [pending, processed, failed, dead].
pub fn states(inbox: &Inbox) -> [i64; 4] {
    let mut out = [0; 4];
    let mut stmt = inbox
        .connection()
        .prepare("SELECT state, count(*) FROM messages GROUP BY state")
        .unwrap();
    let rows = stmt
        .query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))
        .unwrap();
    for row in rows {
        let (s, n) = row.unwrap();
        out[s as usize] = n;
    }
    out
}

/// Receives `n` messages `m-0` .. `m-{n-1}` in batches of 64.
pub fn receive_n(inbox: &mut Inbox, n: usize) {
    let ids: Vec<String> = (0..n).map(|i| format!("m-{i}")).collect();
    let payloads: Vec<String> = (0..n).map(|i| format!("{{\"i\":{i}}}")).collect();
    let mut outcomes = Vec::new();
    for chunk in (0..n).collect::<Vec<_>>().chunks(64) {
        let batch: Vec<Delivery<'_>> = chunk
            .iter()
            .map(|&i| Delivery::new(SCOPE, &ids[i], "t/orders", payloads[i].as_bytes()))
            .collect();
        inbox
            .receive_batch_into(&batch, &mut outcomes)
            .expect("receive batch");
        assert!(outcomes
            .iter()
            .all(|o| matches!(o, edge_inbox::Outcome::Received)));
    }
}

/// Small deterministic pseudo-random sequence (no extra dependency), seeded per run.
pub struct Lcg(pub u64);

impl Lcg {
    pub fn seeded() -> Lcg {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        Lcg(t ^ u64::from(std::process::id()))
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n.max(1)
    }
}

/// Runs `f` until it returns true, failing the test at `deadline`.
pub fn until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}
