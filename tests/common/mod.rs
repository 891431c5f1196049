//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// A command that runs `exe` (built for the target under test) through `EDGE_INBOX_TEST_RUNNER` when set:
/// cross-compiled binaries run under qemu-user, and so must every program a test starts from them.
pub fn through_runner(exe: &Path) -> Command {
    let runner = std::env::var("EDGE_INBOX_TEST_RUNNER").unwrap_or_default();
    let mut words = runner.split_whitespace();
    match words.next() {
        Some(first) => {
            let mut c = Command::new(first);
            c.args(words).arg(exe);
            c
        }
        None => Command::new(exe),
    }
}

/// The seed of a randomized crash test: `EDGE_INBOX_CRASH_SEED` to replay one, else from the clock (odd, as
/// the tests' xorshift needs a non-zero state). Printed, so that a failure can be replayed.
pub fn crash_seed() -> u64 {
    let seed = std::env::var("EDGE_INBOX_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    println!("seed {seed} (set EDGE_INBOX_CRASH_SEED to replay)");
    seed
}

/// Whether the binaries under test run under an emulator (`EDGE_INBOX_TEST_RUNNER`): a child's memory figures
/// are then the emulator's, its translated code included.
pub fn emulated() -> bool {
    std::env::var("EDGE_INBOX_TEST_RUNNER").is_ok_and(|r| !r.trim().is_empty())
}

/// A command that runs this test binary again as a child, to run the (ignored) test `test_name`.
pub fn child_command(test_name: &str) -> Command {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = through_runner(&exe);
    cmd.args([
        test_name,
        "--exact",
        "--nocapture",
        "--test-threads=1",
        "--include-ignored",
    ]);
    cmd
}

/// The example `name` as cargo builds it beside the test binaries (`cargo test`, or `cargo build --examples`
/// for a cross target).
pub fn built_example(name: &str) -> std::path::PathBuf {
    let deps = std::env::current_exe().expect("test binary path");
    let exe = deps
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join("examples")
        .join(name);
    assert!(exe.exists(), "{} not built", exe.display());
    exe
}

/// Multiplier for loop sizes: heavy tests shrink under emulation by setting `EDGE_INBOX_TEST_SCALE`
/// below 1.0 (never to zero).
pub fn scaled(n: usize) -> usize {
    let scale: f64 = std::env::var("EDGE_INBOX_TEST_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0);
    ((n as f64 * scale).round() as usize).max(1)
}

/// Polls `f` until it returns `Some` or `timeout` passes.
pub fn wait_for<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for a file to exist, bounded.
pub fn wait_for_file(path: &Path, timeout: Duration) -> bool {
    wait_for(timeout, || path.exists().then_some(())).is_some()
}

/// A file holding `n` old processed messages of `scope` with their identities, due for payload pruning
/// (retention keeps processed payloads for an hour there), and a scope `consumer` for a consumer beside the
/// pruner.
pub fn old_processed_file(path: &Path, scope: &str, n: usize) {
    use edge_inbox::{Config, Inbox, RetentionPolicy, Synchronous};
    let mut setup = Inbox::open(path, Config::default().synchronous(Synchronous::Normal)).unwrap();
    setup
        .set_retention(
            scope,
            &RetentionPolicy::new().processed_payloads(Duration::from_secs(3_600)),
        )
        .unwrap();
    let scope_id = setup.scope_id(scope).unwrap();
    setup.scope_id("consumer").unwrap();
    let conn = setup.connection();
    // Finished long ago, in a file that existed then: retention takes a time before the file's creation
    // for a wrong clock's, and ages it from the pass instead.
    const OLD: i64 = edge_inbox::EARLIEST_PLAUSIBLE_TIME;
    conn.execute_batch("BEGIN").unwrap();
    conn.execute(
        "UPDATE inbox_meta SET value = ?1 WHERE name = 'created_at'",
        [OLD],
    )
    .unwrap();
    {
        let mut msg = conn
            .prepare(
                "INSERT INTO messages (scope_id, id_hash, message_id, topic, payload, state, received_at, \
                 finished_at) VALUES (?1, ?2, ?3, 'orders', zeroblob(120), 1, ?4, ?4)",
            )
            .unwrap();
        let mut ident = conn
            .prepare("INSERT INTO identities (scope_id, id_hash, fingerprint, day) VALUES (?1, ?2, 0, 0)")
            .unwrap();
        for i in 0..n {
            let id = format!("evt-{i:010}-xxxxxxxx");
            let h = setup.id_hash(None, &id);
            msg.execute((scope_id, h.as_bytes(), &id, OLD)).unwrap();
            ident.execute((scope_id, h.as_bytes())).unwrap();
        }
    }
    conn.execute_batch("COMMIT").unwrap();
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .unwrap();
}

/// A `PubAckSender` that records the PUBACKs a commit loop sends, in order (a stand-in for the MQTT client
/// where the test is about what the loop acks, not about the broker).
#[cfg(feature = "mqtt")]
#[derive(Clone, Default)]
pub struct SentAcks(pub std::sync::Arc<std::sync::Mutex<Vec<u16>>>);

#[cfg(feature = "mqtt")]
impl edge_inbox::PubAckSender for SentAcks {
    fn try_puback(&self, packet_id: u16) -> bool {
        self.0.lock().unwrap().push(packet_id);
        true
    }
}

#[cfg(feature = "mqtt")]
impl SentAcks {
    /// Waits until `n` PUBACKs were sent; fails the test after 20 s.
    pub fn wait_for(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.0.lock().unwrap().len() < n {
            assert!(
                Instant::now() < deadline,
                "{n} PUBACKs: only {:?} in 20 s",
                self.0.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The packet ids sent so far, in order.
    pub fn all(&self) -> Vec<u16> {
        self.0.lock().unwrap().clone()
    }
}

/// A disk model's file image after a write of `data` at `off`, or a truncation to `off` (`None`).
pub fn apply_write(bytes: &mut Vec<u8>, off: u64, data: Option<&[u8]>) {
    let Some(data) = data else {
        bytes.truncate(off as usize);
        return;
    };
    let end = off as usize + data.len();
    if bytes.len() < end {
        bytes.resize(end, 0);
    }
    bytes[off as usize..end].copy_from_slice(data);
}

/// A gate a VFS callback waits at while it is closed (a sync held by a test), counting who waits there.
#[derive(Default)]
pub struct Latch {
    closed: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
    /// Callbacks waiting at the latch now.
    pub waiting: std::sync::atomic::AtomicUsize,
}

impl Latch {
    pub fn set(&self, closed: bool) {
        *self.closed.lock().unwrap() = closed;
        self.cv.notify_all();
    }

    /// Returns at once while open; while closed, waits until it opens.
    pub fn pass(&self) {
        use std::sync::atomic::Ordering;
        let mut closed = self.closed.lock().unwrap();
        if *closed {
            self.waiting.fetch_add(1, Ordering::SeqCst);
            while *closed {
                closed = self.cv.wait(closed).unwrap();
            }
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Runs `run`, a consumer's run that sets up a broker session and ends once idle for a short limit, until it
/// connected: on a busy machine the first connection may not be up within that limit, which ends the run
/// with an error and no connection. Other errors fail the test.
#[cfg(feature = "mqtt")]
pub fn until_connected(
    mut run: impl FnMut() -> edge_inbox::Result<edge_inbox::RunSummary>,
) -> edge_inbox::RunSummary {
    for attempt in 1.. {
        match run() {
            Ok(s) => return s,
            Err(e) if attempt < 5 && e.to_string().contains("no connection to the broker") => {}
            Err(e) => panic!("setting up the session: {e}"),
        }
    }
    unreachable!()
}

/// Every identity key stored in the file on `conn`, in the index's order.
pub fn identity_keys(conn: &rusqlite::Connection) -> Vec<Vec<u8>> {
    conn.prepare("SELECT id_hash FROM identities ORDER BY scope_id, id_hash")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap()
}

/// A TCP proxy on 127.0.0.1 in front of `upstream`; returns its port. What the client sends goes straight
/// through. Each chunk the server sends is handed to `chunk` first: `true` writes it to the client now (after
/// whatever `chunk` waited), `false` keeps it back, to be written with everything kept once the server's side
/// closes, followed by the end of the stream.
pub fn proxy(upstream: u16, chunk: impl Fn(&[u8]) -> bool + Send + Sync + 'static) -> u16 {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    let chunk = std::sync::Arc::new(chunk);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                continue; // the server is down: the client retries
            };
            let (mut c_in, mut s_out) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                let mut buf = [0u8; 16384];
                while let Ok(n) = c_in.read(&mut buf) {
                    if n == 0 || s_out.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = s_out.shutdown(Shutdown::Both);
            });
            let chunk = chunk.clone();
            let (mut s_in, mut c_out) = (server, client);
            std::thread::spawn(move || {
                let mut kept = Vec::new();
                let mut buf = [0u8; 16384];
                while let Ok(n) = s_in.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    if !chunk(&buf[..n]) {
                        kept.extend_from_slice(&buf[..n]);
                    } else if c_out.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = c_out.write_all(&kept);
                let _ = c_out.shutdown(Shutdown::Both);
            });
        }
    });
    port
}
