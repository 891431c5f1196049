//! The automatic checkpoint on a thread of the inbox's own ([`Config::checkpoint_thread`]), so that the
//! commit which leaves the WAL past its threshold does not also copy it back: that copy and its two syncs
//! are the tail of a consumer's commit latency on slow flash (40-60 ms at 5 ms per sync), and every
//! delivery waiting behind that commit pays them too.
//!
//! The committing connection's WAL hook ([`Wear`](crate::store::wear::Wear)) only asks; this thread runs the
//! checkpoint on a connection of its own, which never writes. A PASSIVE checkpoint takes no lock a writer
//! needs, so commits go on meanwhile. But the WAL only starts over at a write that begins once every frame
//! is copied, and beside a writer committing every few milliseconds a commit nearly always lands during the
//! copy. So when a copy ends with commits added meanwhile, the commit that adds an eighth of a threshold
//! more (or, failing that, leaves the WAL twice the threshold long) waits, after its own commit and
//! holding no lock, while the thread runs a RESTART: the copy of those few frames and two syncs, waiting
//! [`RESTART_WAIT`] at most for readers. A writer that never pauses would otherwise take the write lock
//! back before the RESTART could. That wait, once per threshold of WAL, is what is left in a commit of the
//! checkpoint's cost: two syncs, against two syncs and the copy of a whole threshold's pages inside the
//! commit.
//!
//! The bytes it copied into the database file are handed to the committing connection's counters, which
//! save them with their own ([`Wear::stage`](crate::store::wear::Wear::stage)).
//!
//! [`Config::checkpoint_thread`]: crate::Config::checkpoint_thread

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rusqlite::{ffi, Connection};

use crate::store::config::Config;
use crate::store::error::Result;
use crate::store::schema::install_busy_handler;

/// How long a RESTART checkpoint (the thread's, or a pruner's) waits for readers to leave the WAL, holding
/// the write lock.
pub(crate) const RESTART_WAIT: Duration = Duration::from_millis(10);

/// What the committing connection and the checkpoint thread share.
#[derive(Default)]
pub(crate) struct Shared {
    wake: Mutex<Wake>,
    /// The thread waits on it for a request.
    cv: Condvar,
    /// A commit waits on it for the thread's RESTART.
    restarted: Condvar,
    /// A request is waiting (the hook's fast path: no lock while one is).
    requested: AtomicBool,
    /// Frames of the current WAL that the thread's last checkpoint copied back (0 once the WAL started over).
    backfilled: AtomicI64,
    /// WAL length (frames) at which a commit waits for a RESTART; 0 until the first commit sets it.
    restart_at: AtomicI64,
    /// Frames in the WAL after the latest commit.
    frames: AtomicI64,
    /// Times the hook saw the WAL start over: the thread's figures from a checkpoint of an earlier WAL are
    /// dropped instead of stored over the new one's.
    generation: AtomicU64,
    /// Bytes copied into the database file and not yet taken by the committing connection's counters.
    copied: AtomicU64,
    /// No checkpoint while set: a sync of the WAL failed, and frames of it may be missing on the disk. Copying
    /// the later frames into the database file before they are written out again would leave the file torn
    /// between the two at a power cut (see `Db::note_wal_sync_failed`).
    held: AtomicBool,
    /// The I/O error (SQLite code) a checkpoint of the thread met, for the committing connection: 0 for none.
    io_error: AtomicI32,
}

#[derive(Default)]
struct Wake {
    due: bool,
    restart: bool,
    stop: bool,
}

/// How long a commit waits for the thread's RESTART (a copy of the frames added since its last checkpoint,
/// two syncs, and [`RESTART_WAIT`] for readers): a bound for a thread held up by a slow sync. Later commits
/// do not wait while that request is still unanswered.
const RESTART_HANDSHAKE: Duration = Duration::from_millis(250);

impl Shared {
    /// The thread is done with a RESTART it was asked for (made, failed or skipped): the waiting commit goes on.
    fn answer_restart(&self) {
        let mut w = self.wake.lock().unwrap_or_else(|p| p.into_inner());
        w.restart = false;
        self.restarted.notify_all();
    }

    /// From the committing connection's WAL hook, after a commit that left `frames` in the WAL (SQLite
    /// calls the hook once the commit's write lock is released); `restarted` when the WAL started over
    /// since the hook last looked.
    ///
    /// Asks for a PASSIVE checkpoint when `threshold` frames are not yet copied: no lock unless it asks,
    /// once until the thread has finished that checkpoint. Once the WAL reaches the RESTART point (an
    /// eighth of a threshold past the end of a copy that commits outran, twice the threshold at most),
    /// waits for the thread's RESTART: with this writer waiting here the write lock is free, whereas a
    /// writer that never pauses would take it back before the RESTART's busy handler looked again. A
    /// RESTART that fails (a reader it cannot wait out, another writer) is asked for again only after
    /// `threshold` more frames.
    pub(crate) fn after_commit(&self, frames: i64, restarted: bool, threshold: i64) {
        self.frames.store(frames, Ordering::Relaxed);
        let restart_at = self.restart_at.load(Ordering::Relaxed);
        if restarted || restart_at == 0 {
            self.generation.fetch_add(1, Ordering::AcqRel);
            self.backfilled.store(0, Ordering::Relaxed);
            self.restart_at
                .store(threshold.saturating_mul(2), Ordering::Relaxed);
        } else if frames >= restart_at {
            let mut w = self.wake.lock().unwrap_or_else(|p| p.into_inner());
            if w.restart {
                // Asked before and not answered: the thread is still in a checkpoint (a slow sync).
                return;
            }
            w.due = true;
            w.restart = true;
            self.cv.notify_all();
            let deadline = Instant::now() + RESTART_HANDSHAKE;
            while w.restart && !w.stop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    log::debug!(
                        "the checkpoint thread did not restart the WAL in {RESTART_HANDSHAKE:?}"
                    );
                    break;
                }
                w = self
                    .restarted
                    .wait_timeout(w, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            return;
        }
        if frames - self.backfilled.load(Ordering::Relaxed) < threshold
            || self.requested.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let mut w = self.wake.lock().unwrap_or_else(|p| p.into_inner());
        w.due = true;
        self.cv.notify_all();
    }

    fn take_io_error(&self) -> Option<i32> {
        // A load first: every commit asks, and an error is rare.
        if self.io_error.load(Ordering::Acquire) == 0 {
            return None;
        }
        Some(self.io_error.swap(0, Ordering::SeqCst)).filter(|&c| c != 0)
    }

    /// Bytes the thread copied since the last call.
    pub(crate) fn take_copied(&self) -> u64 {
        self.copied.swap(0, Ordering::AcqRel)
    }

    /// Bytes copied and not yet taken.
    pub(crate) fn peek_copied(&self) -> u64 {
        self.copied.load(Ordering::Acquire)
    }
}

/// The thread and its connection; stopped and joined when dropped (before the inbox's own connection
/// closes, so that one stays the last and runs SQLite's final checkpoint).
pub(crate) struct Checkpointer {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Checkpointer {
    /// Holds (or lets go) the thread's checkpoints: see [`Shared`]'s `held`.
    pub(crate) fn hold(&self, held: bool) {
        self.shared.held.store(held, Ordering::SeqCst);
    }

    /// The I/O error the thread's checkpoint met since the last call, if any: its WAL sync may have used
    /// up the report of a failed write-back.
    pub(crate) fn take_io_error(&self) -> Option<i32> {
        self.shared.take_io_error()
    }

    /// Stops and joins the thread, then returns the I/O error its checkpoints met since the last
    /// [`Checkpointer::take_io_error`], if any (none can come after).
    pub(crate) fn stop(mut self) -> Option<i32> {
        self.join();
        self.shared.take_io_error()
    }

    /// Stops the thread and waits until it has ended (its connection closed).
    fn join(&mut self) {
        {
            let mut w = self.shared.wake.lock().unwrap_or_else(|p| p.into_inner());
            w.stop = true;
            self.shared.cv.notify_one();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Opens the thread's connection to the inbox at `path` (same VFS and `synchronous` level as the inbox's,
    /// which set how the checkpoint syncs) and starts the thread. `threshold` is the WAL hook's.
    pub(crate) fn start(path: &Path, config: &Config, threshold: i64) -> Result<Checkpointer> {
        let conn = crate::store::schema::open_for_checkpoints(path, config)?;
        // Opened with the configured busy timeout; from now on it only checkpoints, and a RESTART holds the
        // write lock while its busy handler waits for readers.
        install_busy_handler(&conn, RESTART_WAIT).map_err(crate::store::error::Error::from)?;
        let page_size = page_size(&conn);
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("edge-inbox-checkpoint".into())
            .spawn(move || run(conn, &s, threshold, page_size))
            .map_err(|e| crate::store::error::Error::Open {
                path: path.to_owned(),
                source: e,
            })?;
        Ok(Checkpointer {
            shared,
            thread: Some(thread),
        })
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.join();
    }
}

fn run(conn: Connection, shared: &Shared, threshold: i64, page_size: u64) {
    // Frames of the current WAL this thread had copied back, to count what a checkpoint adds where the
    // kernel does not report the bytes written.
    let mut copied_before = (0u64, 0i64);
    loop {
        let restart = {
            let mut w = shared.wake.lock().unwrap_or_else(|p| p.into_inner());
            while !w.due && !w.stop {
                w = shared.cv.wait(w).unwrap_or_else(|p| p.into_inner());
            }
            if w.stop {
                w.restart = false;
                shared.restarted.notify_all();
                return;
            }
            w.due = false;
            w.restart
        };
        if shared.held.load(Ordering::SeqCst) {
            shared.requested.store(false, Ordering::Release);
            if restart {
                shared.answer_restart();
            }
            continue;
        }
        let generation = shared.generation.load(Ordering::Acquire);
        let before = thread_write_bytes();
        // SAFETY: the thread's own open connection, outside any statement.
        let db = unsafe { conn.handle() };
        let mode = if restart {
            ffi::SQLITE_CHECKPOINT_RESTART
        } else {
            ffi::SQLITE_CHECKPOINT_PASSIVE
        };
        // SAFETY: the thread's own open handle, and SQLite's name of the main schema.
        let (rc, log, done) = unsafe { wal_checkpoint(db, c"main".as_ptr(), mode) };
        if rc & 0xff == ffi::SQLITE_IOERR {
            // Its sync of the WAL may have taken the report of a failed write-back from the inbox.
            log::error!("background checkpoint failed (SQLite code {rc}); checkpoints held");
            shared.held.store(true, Ordering::SeqCst);
            shared.io_error.store(rc, Ordering::SeqCst);
        } else if rc != ffi::SQLITE_OK && rc != ffi::SQLITE_BUSY {
            log::debug!("background checkpoint failed (SQLite code {rc})");
        }
        // Only while the WAL is still the one checkpointed (the hook resets both when it starts over).
        let same_wal = shared.generation.load(Ordering::Acquire) == generation;
        if restart && rc != ffi::SQLITE_OK && same_wal {
            shared
                .restart_at
                .store(log.max(threshold) + threshold, Ordering::Relaxed);
        }
        let now = shared.frames.load(Ordering::Relaxed);
        if !restart && same_wal && done > 0 && now > done {
            // Commits landed during the copy, so the WAL will not start over by itself: the commit that adds
            // an eighth of a threshold more waits for a RESTART, which then copies only those few frames
            // under the write lock, not a whole threshold's worth.
            shared
                .restart_at
                .store(now + (threshold / 8).max(1), Ordering::Relaxed);
        }
        if done > 0 {
            if same_wal {
                // Even when all was copied: commits that land meanwhile keep the WAL from starting over, and
                // what they add must reach the threshold again before the next request.
                shared.backfilled.store(done, Ordering::Relaxed);
            }
            let frames_before = if copied_before.0 == generation {
                copied_before.1
            } else {
                0
            };
            copied_before = (generation, done);
            shared.copied.fetch_add(
                bytes_copied(before, done - frames_before, page_size),
                Ordering::AcqRel,
            );
        }
        // Commits from now on may ask again (not during the copy: they would ask for its tail at once).
        shared.requested.store(false, Ordering::Release);
        if restart {
            shared.answer_restart();
        }
    }
}

/// One checkpoint of schema `name` in `mode`: SQLite's result code, the frames in the WAL and the frames
/// copied back. A RESTART that copied everything but could not wait out a reader reports BUSY: it still
/// copied.
///
/// # Safety
/// `db` is a valid open handle used on its own thread outside a statement, `name` a schema name.
pub(crate) unsafe fn wal_checkpoint(
    db: *mut ffi::sqlite3,
    name: *const std::ffi::c_char,
    mode: std::ffi::c_int,
) -> (std::ffi::c_int, i64, i64) {
    let (mut log, mut done) = (0, 0);
    // SAFETY: per the caller.
    let rc = unsafe { ffi::sqlite3_wal_checkpoint_v2(db, name, mode, &mut log, &mut done) };
    (rc, i64::from(log.max(0)), i64::from(done.max(0)))
}

/// Bytes a checkpoint wrote into the database file: the thread's `write_bytes` since `before`, or, where
/// the kernel does not report it, the `frames` it copied back times the page size (an upper bound).
pub(crate) fn bytes_copied(before: Option<u64>, frames: i64, page_size: u64) -> u64 {
    match (before, thread_write_bytes()) {
        (Some(b), Some(a)) => a.saturating_sub(b),
        _ => frames.max(0) as u64 * page_size,
    }
}

/// The connection's page size, for the byte counts.
pub(crate) fn page_size(conn: &Connection) -> u64 {
    conn.query_row("PRAGMA page_size", [], |r| r.get::<_, i64>(0))
        .map_or(4096, |p| p.max(512) as u64)
}

/// Bytes this thread has caused to be written to storage (`write_bytes` of `/proc/thread-self/io`: page-cache
/// pages it dirtied); `None` where the kernel does not report it.
pub(crate) fn thread_write_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/io").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("write_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}
