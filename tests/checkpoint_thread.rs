//! The automatic checkpoint runs on the inbox's own thread (`Config::checkpoint_thread`, the default): a commit
//! that leaves the WAL past the threshold returns without copying it back, the commit that asks the thread to
//! catch up returns too (the next write waits), the WAL still starts over beside a writer that never pauses,
//! and what the checkpoints copied is counted as before.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use edge_inbox::rusqlite::ffi;
use edge_inbox::{Config, Delivery, Inbox, Tx};

#[path = "../examples/support/wrap_vfs.rs"]
mod wrap_vfs;

mod common;

const VFS: &str = "edge-inbox-checkpoint-gate";
const SCOPE: &str = "commands";

/// While closed, holds every sync of the database file (in WAL mode only a checkpoint syncs it, so a commit
/// that had to wait here ran a checkpoint), and every sync of the WAL by a thread other than the writer's (a
/// checkpoint begins by syncing the WAL; the writer's commits sync it too, and go through).
#[derive(Default)]
struct Gate {
    latch: common::Latch,
    writer: Mutex<Option<std::thread::ThreadId>>,
    /// When the writer wrote to the WAL.
    writer_wal_writes: Mutex<Vec<Instant>>,
}

static GATE: std::sync::OnceLock<Arc<Gate>> = std::sync::OnceLock::new();
/// Only the files of the test that closes the gate are held (tests run in parallel).
static GATED_DIR: Mutex<Option<String>> = Mutex::new(None);
/// One test at a time closes the gate.
static GATE_TURN: Mutex<()> = Mutex::new(());

impl wrap_vfs::Observer for Arc<Gate> {
    fn open(&self, name: Option<&str>, flags: c_int) -> Option<usize> {
        let dir = GATED_DIR.lock().unwrap().clone()?;
        if !name?.starts_with(&dir) {
            return None;
        }
        if flags & ffi::SQLITE_OPEN_MAIN_DB != 0 {
            Some(0)
        } else {
            (flags & ffi::SQLITE_OPEN_WAL != 0).then_some(1)
        }
    }

    fn write(&self, tag: usize, _off: u64, _data: &[u8]) {
        if tag == 1 && *self.writer.lock().unwrap() == Some(std::thread::current().id()) {
            self.writer_wal_writes.lock().unwrap().push(Instant::now());
        }
    }

    fn sync(&self, tag: usize, real: &mut dyn FnMut() -> c_int) -> c_int {
        let by_writer = *self.writer.lock().unwrap() == Some(std::thread::current().id());
        if tag == 0 || !by_writer {
            self.latch.pass();
        }
        real()
    }
}

impl Gate {
    fn set(&self, closed: bool) {
        self.latch.set(closed);
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

/// With the gate closed, a checkpoint stays in its first sync (of the WAL, on the thread) or its last (of the
/// database file, in a commit). A writer commits just past its threshold and returns while a checkpoint is
/// held: none of its commits ran it. Failed with `checkpoint_thread(false)`: the commit that crossed the
/// threshold stayed at the gate. (The writer stops below twice the threshold, where a commit would wait for
/// the thread's RESTART, which holds the write lock through its syncs.)
#[test]
fn a_commit_past_the_threshold_does_not_wait_for_the_checkpoint() {
    const THRESHOLD: u64 = 100;
    let _turn = GATE_TURN.lock().unwrap_or_else(|p| p.into_inner());
    let gate = gate();
    let dir = tempfile::tempdir().unwrap();
    *GATED_DIR.lock().unwrap() = Some(dir.path().to_string_lossy().into_owned());
    let path = dir.path().join("inbox.db");
    let wal = dir.path().join("inbox.db-wal");
    let config = Config::default()
        .vfs(VFS)
        .wal_autocheckpoint(THRESHOLD as u32);
    let mut inbox = Inbox::open(&path, config).unwrap();
    gate.set(true);
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    let g = gate.clone();
    let writer = std::thread::spawn(move || {
        *g.writer.lock().unwrap() = Some(std::thread::current().id());
        // Frames in the WAL, from its size: it has not started over yet, so the file is exactly its frames.
        let frames =
            || std::fs::metadata(&wal).map_or(0, |m| m.len().saturating_sub(32) / (4096 + 24));
        let mut i = 0;
        while frames() < THRESHOLD + 5 && i < 1000 {
            deliver(&mut inbox, i);
            i += 1;
        }
        d.store(true, Ordering::SeqCst);
        (inbox, frames())
    });
    // Bounded: a writer held at the gate would never finish.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(done.load(Ordering::SeqCst) && gate.latch.waiting.load(Ordering::SeqCst) >= 1)
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    let finished = done.load(Ordering::SeqCst);
    let held = gate.latch.waiting.load(Ordering::SeqCst);
    gate.set(false);
    let (mut inbox, frames) = writer.join().unwrap();
    *GATED_DIR.lock().unwrap() = None;
    assert!(
        finished,
        "the writer's commits waited for a checkpoint's sync of the database file"
    );
    assert!(
        held >= 1,
        "no checkpoint was held at the gate: the test saw nothing"
    );
    assert!(
        frames < 2 * THRESHOLD,
        "{frames} frames: the writer went too far"
    );
    // Once let go, the checkpoint completes and its bytes are counted (taken over by a later commit).
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut i = 1000;
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

/// With the gate closed the thread stays in its first round, so the catch-up the writer asks for once the WAL
/// reaches the catch-up point cannot run. The commit that asks returns; the connection's next write
/// transaction waits for the catch-up (here until the 250 ms handshake runs out) before it writes a frame,
/// so that a commit loop can ack meanwhile what is durable. Failed when the asking commit waited in its WAL
/// hook, after writing its frames: no write waited before its first frame.
#[test]
fn the_next_write_waits_for_the_catch_up_not_the_commit_that_asked_for_it() {
    const THRESHOLD: u64 = 100;
    const WAITED: Duration = Duration::from_millis(200);
    let _turn = GATE_TURN.lock().unwrap_or_else(|p| p.into_inner());
    let gate = gate();
    let dir = tempfile::tempdir().unwrap();
    *GATED_DIR.lock().unwrap() = Some(dir.path().to_string_lossy().into_owned());
    let config = Config::default()
        .vfs(VFS)
        .wal_autocheckpoint(THRESHOLD as u32);
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), config).unwrap();
    gate.writer_wal_writes.lock().unwrap().clear();
    gate.set(true);
    let g = gate.clone();
    let writer = std::thread::spawn(move || {
        *g.writer.lock().unwrap() = Some(std::thread::current().id());
        // Each call's start and end, until a few calls after the first that took the wait (bounded).
        let mut calls: Vec<(Instant, Instant)> = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut after_wait = None;
        let mut i = 0;
        while i < 3000 && Instant::now() < deadline && after_wait.is_none_or(|n| n < 5) {
            let began = Instant::now();
            deliver(&mut inbox, i);
            calls.push((began, Instant::now()));
            if began.elapsed() >= WAITED {
                after_wait.get_or_insert(0);
            }
            if let Some(n) = after_wait.as_mut() {
                *n += 1;
            }
            i += 1;
        }
        *g.writer.lock().unwrap() = None;
        (inbox, calls)
    });
    let (inbox, calls) = writer.join().unwrap();
    gate.set(false);
    *GATED_DIR.lock().unwrap() = None;
    let writes = gate.writer_wal_writes.lock().unwrap().clone();
    let slow: Vec<(Instant, Instant)> = calls
        .iter()
        .copied()
        .filter(|&(began, ended)| ended - began >= WAITED)
        .collect();
    assert!(
        !slow.is_empty(),
        "no write waited for the catch-up ({} calls)",
        calls.len()
    );
    // Where each slow call spent its time: before its first frame (the wait for the catch-up at the start of
    // its transaction), or after it (a wait inside its commit).
    let waited_first = slow.iter().any(|&(began, _)| {
        writes
            .iter()
            .find(|&&t| t >= began)
            .is_some_and(|&first| first - began >= WAITED)
    });
    assert!(
        waited_first,
        "every write that waited for the catch-up had written its frames first: the commit that asked \
         waited for it ({} slow calls)",
        slow.len()
    );
    drop(inbox);
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

/// The thread copies back what the commits' own checkpoints would, not more: each WAL frame once, then the
/// next request only once another threshold of frames is not yet copied. (A first version took a copy of
/// the whole WAL as the WAL starting over, and checkpointed after almost every commit between one and two
/// thresholds: 6.2 times the database-file bytes.)
#[test]
fn the_thread_copies_back_no_more_than_the_commits_own_checkpoints_would() {
    let dir = tempfile::tempdir().unwrap();
    let mut copied = Vec::new();
    for thread in [false, true] {
        let path = dir.path().join(format!("inbox-{thread}.db"));
        let config = Config::default()
            .wal_autocheckpoint(100)
            .checkpoint_thread(thread);
        let mut inbox = Inbox::open(&path, config).unwrap();
        for i in 0..1500 {
            deliver(&mut inbox, i);
        }
        let w = inbox.bytes_written().unwrap();
        assert!(w.checkpoint_bytes > 0, "thread {thread}: {w:?}");
        copied.push(w.checkpoint_bytes);
    }
    let (in_commits, by_thread) = (copied[0], copied[1]);
    assert!(
        by_thread <= 2 * in_commits,
        "the thread copied {by_thread} bytes into the database file where the commits' own checkpoints \
         copied {in_commits}"
    );
}

/// `mxFrame` (frames in the WAL) and `nBackfill` (frames copied back) from the WAL index: the `-shm` file,
/// which SQLite maps shared, so it holds what the connections see (two copies of the 48-byte index header,
/// then the checkpoint information, all in the machine's byte order).
fn wal_index(db: &std::path::Path) -> (u32, u32) {
    let shm = std::fs::read(db.with_extension("db-shm")).unwrap();
    let word = |at: usize| u32::from_ne_bytes(shm[at..at + 4].try_into().unwrap());
    (word(16), word(96))
}

/// A writer commits past the threshold until the thread's rounds have copied part of the WAL back, commits
/// once more (after their snapshot), then pauses. Before, the frames left after the rounds stayed in the WAL
/// until later commits reached the catch-up point and the writer's next write waited for the catch-up; now
/// the thread copies them once no commit came for a while, and the next commit starts the WAL over without
/// waiting for anything. Failed before the quiet catch-up: during the pause the frames were never all
/// copied back.
#[test]
fn after_a_pause_the_wal_starts_over_without_the_writer_waiting_for_a_catch_up() {
    const THRESHOLD: u32 = 100;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default().wal_autocheckpoint(THRESHOLD)).unwrap();
    let mut i = 0;
    while wal_index(&path).1 == 0 && i < 10_000 {
        deliver(&mut inbox, i);
        i += 1;
    }
    let (frames, backfilled) = wal_index(&path);
    assert!(
        backfilled > 0 && frames < THRESHOLD * 2,
        "{backfilled} of {frames} frames copied back after {i} commits"
    );
    deliver(&mut inbox, i);
    i += 1;
    // The thread lets go of its snapshot (which keeps the WAL from starting over) just after it syncs what
    // it copied: a commit right after the copy may still append. A few tries, each after another pause.
    for _ in 0..3 {
        let deadline = Instant::now() + Duration::from_secs(30);
        let frames = loop {
            let (frames, backfilled) = wal_index(&path);
            if frames > 0 && backfilled == frames {
                break frames;
            }
            assert!(
                Instant::now() < deadline,
                "{backfilled} of {frames} frames copied back after the writer paused for 30 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        std::thread::sleep(Duration::from_millis(200));
        deliver(&mut inbox, i);
        i += 1;
        let (after, _) = wal_index(&path);
        if after < frames {
            return;
        }
        // Past the frames the thread waits for before it catches up on its own again.
        for _ in 0..3 {
            deliver(&mut inbox, i);
            i += 1;
        }
    }
    panic!("the WAL never started over after the writer's pauses");
}
