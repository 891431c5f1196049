//! The automatic checkpoint runs on the inbox's own thread (`Config::checkpoint_thread`, the default): a commit
//! that leaves the WAL past the threshold returns without copying it back, the WAL still starts over beside
//! a writer that never pauses, and what the checkpoints copied is counted as before.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Once};
use std::time::{Duration, Instant};

use edge_inbox::rusqlite::ffi;
use edge_inbox::{Config, Delivery, Inbox, Tx};

#[path = "../examples/support/wrap_vfs.rs"]
mod wrap_vfs;

const VFS: &str = "edge-inbox-checkpoint-gate";
const SCOPE: &str = "commands";

/// Holds every sync of a main database file while closed. In WAL mode only a checkpoint syncs the database
/// file, so a commit that had to wait here is one that ran a checkpoint.
#[derive(Default)]
struct Gate {
    closed: Mutex<bool>,
    cv: Condvar,
    waiting: AtomicUsize,
}

static GATE: std::sync::OnceLock<Arc<Gate>> = std::sync::OnceLock::new();
/// Only the files of the test that closes the gate are held (tests run in parallel).
static GATED_DIR: Mutex<Option<String>> = Mutex::new(None);

impl wrap_vfs::Observer for Arc<Gate> {
    fn open(&self, name: Option<&str>, flags: c_int) -> Option<usize> {
        let dir = GATED_DIR.lock().unwrap().clone()?;
        (flags & ffi::SQLITE_OPEN_MAIN_DB != 0 && name?.starts_with(&dir)).then_some(0)
    }

    fn sync(&self, _tag: usize, real: &mut dyn FnMut() -> c_int) -> c_int {
        let mut closed = self.closed.lock().unwrap();
        if *closed {
            self.waiting.fetch_add(1, Ordering::SeqCst);
            while *closed {
                closed = self.cv.wait(closed).unwrap();
            }
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
        drop(closed);
        real()
    }
}

impl Gate {
    fn set(&self, closed: bool) {
        *self.closed.lock().unwrap() = closed;
        self.cv.notify_all();
    }
}

fn gate() -> Arc<Gate> {
    static ONCE: Once = Once::new();
    let g = GATE.get_or_init(Arc::default).clone();
    ONCE.call_once(|| wrap_vfs::register(VFS, Arc::new(g.clone()), false));
    g
}

fn noop(_: &mut Tx<'_>, _: &Delivery<'_>) -> anyhow::Result<()> {
    Ok(())
}

fn deliver(inbox: &mut Inbox, i: usize) {
    let id = format!("cmd-{i}");
    inbox
        .process(&Delivery::new(SCOPE, &id, "cmd", b"{}"), noop)
        .unwrap();
}

/// With the database file's syncs held, and so every checkpoint stuck in its last step, a writer still
/// commits far past its threshold: none of its commits runs the checkpoint. Failed with
/// `checkpoint_thread(false)`: the first commit past the threshold waited at the gate.
#[test]
fn a_commit_past_the_threshold_does_not_wait_for_the_checkpoint() {
    let gate = gate();
    let dir = tempfile::tempdir().unwrap();
    *GATED_DIR.lock().unwrap() = Some(dir.path().to_string_lossy().into_owned());
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default().vfs(VFS).wal_autocheckpoint(20)).unwrap();
    gate.set(true);
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    let writer = std::thread::spawn(move || {
        // Each commit appends a few frames: 200 of them cross the threshold of 20 many times over.
        for i in 0..200 {
            deliver(&mut inbox, i);
        }
        d.store(true, Ordering::SeqCst);
        inbox
    });
    // Bounded: a writer held at the gate would never finish.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done.load(Ordering::SeqCst) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let finished = done.load(Ordering::SeqCst);
    let held = gate.waiting.load(Ordering::SeqCst);
    gate.set(false);
    let mut inbox = writer.join().unwrap();
    *GATED_DIR.lock().unwrap() = None;
    assert!(
        finished,
        "the writer's commits waited for a checkpoint's sync of the database file"
    );
    assert!(
        held >= 1,
        "no checkpoint was running while the writer committed: the test saw nothing"
    );
    // Once let go, the checkpoint completes and its bytes are counted (taken over by a later commit).
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut i = 200;
    while inbox.bytes_written().unwrap().checkpoint_bytes == 0 && Instant::now() < deadline {
        deliver(&mut inbox, i);
        i += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        inbox.bytes_written().unwrap().checkpoint_bytes > 0,
        "the thread's checkpoints copied nothing"
    );
}

/// A writer that never pauses: a PASSIVE checkpoint beside it nearly always sees a commit land during its
/// copy, so the WAL could only start over by the thread's RESTART. The WAL file, which only grows until it
/// starts over (the size limit truncates it back only then), stays a small part of what was written to it.
#[test]
fn the_wal_starts_over_beside_a_writer_that_never_pauses() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default().wal_autocheckpoint(50)).unwrap();
    let before = inbox.bytes_written().unwrap().wal_bytes;
    for i in 0..3000 {
        deliver(&mut inbox, i);
    }
    let written = inbox.bytes_written().unwrap().wal_bytes - before;
    let wal = std::fs::metadata(dir.path().join("inbox.db-wal"))
        .unwrap()
        .len();
    assert!(
        wal * 4 < written,
        "the WAL file is {wal} bytes after {written} bytes were written to it: it did not start over"
    );
    assert!(inbox.bytes_written().unwrap().checkpoint_bytes > 0);
}
