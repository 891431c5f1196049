//! The checkpoint thread copies pages into the database file without a sync, writes them back paced, then
//! syncs the file (`store/checkpointer.rs`). Until that sync, the pages it copied are on the disk only in the
//! WAL, so no write may start the WAL over; and if the sync fails, the WAL must outlive the inbox.

use std::ffi::c_int;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use edge_inbox::rusqlite::ffi;
use edge_inbox::{Config, Delivery, Inbox, Outcome, Pruning, Tx};

#[path = "../examples/support/wrap_vfs.rs"]
mod wrap_vfs;

mod common;

const VFS: &str = "edge-inbox-checkpoint-rounds";
const SCOPE: &str = "commands";
const CHECKPOINT_THREAD: &str = "edge-inbox-checkpoint";
const THRESHOLD: u64 = 40;

/// Acts on the checkpoint thread's syncs of the database file of one test's directory: holds them while
/// `closed`, fails them while `failing`.
#[derive(Default)]
struct Gate {
    dir: Mutex<Option<String>>,
    latch: common::Latch,
    failing: AtomicBool,
    failed: AtomicUsize,
}

impl wrap_vfs::Observer for Arc<Gate> {
    fn open(&self, name: Option<&str>, flags: c_int) -> Option<usize> {
        let dir = self.dir.lock().unwrap().clone()?;
        (name?.starts_with(&dir) && flags & ffi::SQLITE_OPEN_MAIN_DB != 0).then_some(0)
    }

    fn sync(&self, _tag: usize, real: &mut dyn FnMut() -> c_int) -> c_int {
        if std::thread::current().name() != Some(CHECKPOINT_THREAD) {
            return real();
        }
        if self.failing.load(Ordering::SeqCst) {
            self.failed.fetch_add(1, Ordering::SeqCst);
            return ffi::SQLITE_IOERR_FSYNC;
        }
        self.latch.pass();
        real()
    }
}

impl Gate {
    fn set(&self, closed: bool) {
        self.latch.set(closed);
    }
}

/// One gate per test binary: the two tests take turns (`TURN`), each with its own directory.
fn gate() -> Arc<Gate> {
    static GATE: std::sync::OnceLock<Arc<Gate>> = std::sync::OnceLock::new();
    static ONCE: Once = Once::new();
    let g = GATE.get_or_init(Arc::default).clone();
    ONCE.call_once(|| wrap_vfs::register(VFS, Arc::new(g.clone()), false));
    g
}

static TURN: Mutex<()> = Mutex::new(());

/// Waits for this test's turn, and points the gate at a new directory of its own.
fn take_turn() -> (
    std::sync::MutexGuard<'static, ()>,
    Arc<Gate>,
    tempfile::TempDir,
) {
    let turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let gate = gate();
    let dir = tempfile::tempdir().unwrap();
    *gate.dir.lock().unwrap() = Some(dir.path().to_string_lossy().into_owned());
    (turn, gate, dir)
}

/// Opens the gate when dropped: a test that fails while it is closed must not leave the checkpoint thread
/// held in a sync, which the inbox's drop would wait for. Made after the inbox, so that it is dropped first.
struct Reopen(Arc<Gate>);

impl Drop for Reopen {
    fn drop(&mut self) {
        self.0.set(false);
        self.0.failing.store(false, Ordering::SeqCst);
    }
}

fn noop(_: &mut Tx<'_>, _: &Delivery<'_>) -> anyhow::Result<()> {
    Ok(())
}

fn deliver(inbox: &mut Inbox, i: usize) -> edge_inbox::Result<Outcome> {
    let id = format!("cmd-{i}");
    inbox.process(&Delivery::new(SCOPE, &id, "cmd", b"{}"), noop)
}

/// The WAL's length in bytes.
fn wal_len(dir: &Path) -> u64 {
    std::fs::metadata(dir.join("inbox.db-wal")).map_or(0, |m| m.len())
}

/// Delivers one at a time until the WAL holds the threshold's frames (the commit that got there asked the
/// thread for a checkpoint), then no more: returns the next index.
fn fill_to_threshold(inbox: &mut Inbox, dir: &Path, mut i: usize) -> usize {
    let frames = |dir: &Path| wal_len(dir).saturating_sub(32) / (4096 + 24);
    while frames(dir) < THRESHOLD && i < 10_000 {
        deliver(inbox, i).unwrap();
        i += 1;
    }
    assert!(
        frames(dir) >= THRESHOLD,
        "the WAL never reached the threshold"
    );
    i
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The thread copied every frame (no commit came after its snapshot) and waits in its sync of the database
/// file: a write that started the WAL over now would overwrite the only synced copy of those pages. The
/// next commit must append to the WAL instead. Fails when the thread lets go of its snapshot before that
/// sync: the WAL's length then stays where it was, its first frames written again.
#[test]
fn no_write_starts_the_wal_over_before_the_copied_pages_are_synced() {
    let (_turn, gate, dir) = take_turn();
    let config = Config::default()
        .vfs(VFS)
        .wal_autocheckpoint(THRESHOLD as u32);
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), config).unwrap();
    let _reopen = Reopen(gate.clone());
    gate.set(true);
    let mut i = fill_to_threshold(&mut inbox, dir.path(), 0);
    wait_until("the thread's sync of the database file", || {
        gate.latch.waiting.load(Ordering::SeqCst) >= 1
    });
    let before = wal_len(dir.path());
    for _ in 0..3 {
        deliver(&mut inbox, i).unwrap();
        i += 1;
    }
    let after = wal_len(dir.path());
    gate.set(false);
    *gate.dir.lock().unwrap() = None;
    assert!(
        after > before,
        "the WAL started over ({before} bytes, then {after}) while the pages copied from it were not synced"
    );
    // Once let go, the WAL starts over again beside the writer.
    let mut restarted = false;
    for _ in 0..2000 {
        let len = wal_len(dir.path());
        deliver(&mut inbox, i).unwrap();
        i += 1;
        if wal_len(dir.path()) <= len && len > 0 {
            restarted = true;
            break;
        }
    }
    assert!(restarted, "the WAL never started over after the sync");
}

/// The thread's sync of the database file fails: the WAL is never started over after that, SQLite's
/// final checkpoint is not run at close (the WAL file stays), and the next open replays it: every
/// delivery acknowledged is still known. Commits go on until the WAL holds `UNSYNCED_WAL_CAP` (4)
/// thresholds, then each is refused as storage trouble until the inbox is opened again, so the WAL does not
/// grow until the disk is full. Fails when the inbox closes as usual (the WAL copied back, once more without
/// a working sync, and deleted), or when the WAL grows past its cap.
#[test]
fn a_failed_sync_of_the_database_file_keeps_the_wal_for_the_next_open() {
    let (_turn, gate, dir) = take_turn();
    let path = dir.path().join("inbox.db");
    let config = Config::default()
        .vfs(VFS)
        .wal_autocheckpoint(THRESHOLD as u32);
    let mut inbox = Inbox::open(&path, config.clone()).unwrap();
    let _reopen = Reopen(gate.clone());
    gate.failing.store(true, Ordering::SeqCst);
    let mut acked = Vec::new();
    let mut i = 0;
    // Commits may be refused for a moment after the failure (the WAL is written out again first); once the
    // WAL holds its cap, every one is.
    let mut refused_in_a_row = 0;
    let mut len = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while (gate.failed.load(Ordering::SeqCst) == 0 || refused_in_a_row < 50)
        && Instant::now() < deadline
    {
        match deliver(&mut inbox, i) {
            Ok(_) => {
                acked.push(i);
                refused_in_a_row = 0;
            }
            Err(e) => {
                assert!(e.is_retryable(), "{e:?}");
                refused_in_a_row += 1;
            }
        }
        i += 1;
        // From the failure on, the WAL only grows.
        let now = wal_len(dir.path());
        assert!(
            gate.failed.load(Ordering::SeqCst) == 0 || now >= len,
            "the WAL started over after a failed sync of the database file"
        );
        len = now;
    }
    assert!(gate.failed.load(Ordering::SeqCst) >= 1, "no sync failed");
    assert!(
        refused_in_a_row >= 50,
        "commits were never refused: WAL {len} bytes"
    );
    let frames = wal_len(dir.path()).saturating_sub(32) / (4096 + 24);
    assert!(
        (4 * THRESHOLD..6 * THRESHOLD).contains(&frames),
        "the WAL holds {frames} frames when commits are refused"
    );
    assert!(
        acked.len() > 2 * THRESHOLD as usize,
        "{} acked",
        acked.len()
    );
    drop(inbox);
    gate.failing.store(false, Ordering::SeqCst);
    *gate.dir.lock().unwrap() = None;
    assert!(
        wal_len(dir.path()) > 0,
        "the WAL was copied back and deleted at close after a failed sync of the database file"
    );
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    for &k in &acked {
        let outcome = deliver(&mut inbox, k).unwrap();
        assert!(
            matches!(outcome, Outcome::Duplicate),
            "delivery {k} was acknowledged but is {outcome:?} after reopening"
        );
    }
    assert!(matches!(deliver(&mut inbox, i), Ok(Outcome::Processed)));
}

/// While a round pins its snapshot (its sync of the database file held here), a pruner's pass asked to
/// truncate the WAL ends with `wal_checkpoint(TRUNCATE)`, which holds the write lock while it waits for that reader: it gives up after a
/// short wait instead of the busy timeout (30 s here), so the commits behind it are not held for that long.
/// Fails when the TRUNCATE waits with the connection's busy timeout.
#[test]
fn a_pruners_truncate_does_not_wait_out_the_busy_timeout_behind_a_rounds_pin() {
    let (_turn, gate, dir) = take_turn();
    let path = dir.path().join("inbox.db");
    let config = Config::default()
        .vfs(VFS)
        .busy_timeout(Duration::from_secs(30))
        .wal_autocheckpoint(THRESHOLD as u32);
    let mut inbox = Inbox::open(&path, config.clone()).unwrap();
    let _reopen = Reopen(gate.clone());
    gate.set(true);
    let i = fill_to_threshold(&mut inbox, dir.path(), 0);
    wait_until("the thread's sync of the database file", || {
        gate.latch.waiting.load(Ordering::SeqCst) >= 1
    });
    let mut pruner = Inbox::open(&path, config.checkpoint_thread(false)).unwrap();
    let started = Instant::now();
    let report = pruner.prune(&Pruning::default().pause(Duration::ZERO).truncate_wal(true));
    let took = started.elapsed();
    deliver(&mut inbox, i).unwrap();
    gate.set(false);
    *gate.dir.lock().unwrap() = None;
    report.unwrap();
    assert!(
        took < Duration::from_secs(10),
        "the pruner's pass took {took:?} beside the round's pin (busy timeout 30 s)"
    );
}
