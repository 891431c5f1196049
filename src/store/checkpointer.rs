//! The automatic checkpoint on a thread of the inbox's own ([`Config::checkpoint_thread`]), so that the
//! commit which leaves the WAL past its threshold does not also copy it back: that copy and its two syncs
//! are the tail of a consumer's commit latency on slow flash (40-60 ms at 5 ms per sync), and every
//! delivery waiting behind that commit pays them too.
//!
//! The committing connection's WAL hook ([`Wear`](crate::store::wear::Wear)) only asks; this thread runs the
//! checkpoint on connections of its own, which never write a page. Each request is served in rounds, while
//! commits go on:
//!
//! 1. a second connection opens a read transaction (the *pin*): no connection can start the WAL over while
//!    it lasts, and the copy stops at its snapshot;
//! 2. the WAL is synced (as SQLite's own checkpoint begins), then a PASSIVE checkpoint at `synchronous=OFF`
//!    copies the frames into the database file without syncing it;
//! 3. those pages are written out to the device in paced steps ([`WriteBack`]): on a file with a large index
//!    they are thousands of scattered pages, and handed over at once by one sync they stalled every commit's
//!    sync of the WAL for tens of milliseconds;
//! 4. the database file is synced, and only then the pin let go.
//!
//! Until the sync of step 4, every page copied is still in the WAL, which cannot start over: a power cut
//! then loses nothing, as recovery reads those pages from the WAL. A round copies what was committed until
//! it began; the next covers what came during it, until what is left is small. The WAL only starts over at
//! a write that begins once every frame is copied, and beside a writer committing every few milliseconds a
//! commit nearly always lands during a round. Two ways lead there:
//!
//! - once no commit has come for [`QUIET`], the thread runs one more round on its own, which copies every
//!   frame left; no writer waits for it, and a commit that lands during it only keeps the WAL going;
//! - a writer that never pauses that long is made to: the commit that adds a little more after the rounds
//!   (or that leaves the WAL [`PACED_CAP`] thresholds long while they go on) asks the thread to *catch
//!   up*: a round without the paced write-back, which, with that writer adding nothing meanwhile, copies
//!   every frame left. The commit itself returns at once; the connection's next write transaction waits,
//!   before it begins and holding no lock, until the catch-up has ended ([`Shared::await_catch_up`]), and
//!   then starts the WAL over.
//!
//! That wait is what is left in a writer of the checkpoint's cost: two syncs and the copy of a few frames,
//! then SQLite's sync of the new WAL header in the next commit, against two syncs and the copy of a whole
//! threshold's pages inside a commit. A writer under a steady load meets it once per threshold of WAL (the
//! deliveries arriving during it wait for it too), and one that pauses for [`QUIET`] now and then not at
//! all. It comes before the next write rather than inside the commit that asked so that a commit loop can
//! meanwhile ack what the syncs under way make durable, the asking commit's own deliveries among them,
//! instead of holding those acks until the catch-up ends; the thread wakes that loop when it has
//! ([`Shared::on_catch_up_end`]).
//!
//! Every round and catch-up syncs the WAL before it copies, even at `synchronous=FULL`: a commit loop that
//! overlaps its commits with their syncs commits at NORMAL, as other connections may, and leaves frames in
//! the WAL that are not on the disk yet; a page copied from one of them could reach the database file before
//! its frame reaches the WAL (`tests/checkpoint_wal_order.rs`).
//!
//! A failed sync of the database file leaves pages that only the WAL holds on the disk while SQLite counts
//! them as copied: the thread then keeps its pin until it stops, so the WAL never starts over, checkpoints no
//! more, and the inbox closes without SQLite's final checkpoint or any write (`Db`'s drop), leaving the next
//! open to replay the WAL. Commits go on meanwhile, durable in the WAL, until it holds [`UNSYNCED_WAL_CAP`]
//! thresholds; then each is refused as storage trouble (nothing acked) until the inbox is opened again
//! with no other connection left on the file, which copies the WAL back with working syncs. That holds when
//! the inbox's connections are the file's last: another connection open on it then (a second inbox,
//! another process) knows nothing of the failure, and its own checkpoints and writes may start the WAL over
//! once the pin is gone; not covered.
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

use crate::store::checkpoint_bytes::{bytes_copied, ThreadIo};
use crate::store::config::Config;
use crate::store::error::Result;
use crate::store::schema::install_busy_handler;
use crate::store::wal_sync::{sync_database, sync_wal};
use crate::store::writeback::WriteBack;

/// How long a RESTART or TRUNCATE checkpoint (a pruner's) waits for the write lock or for readers, holding
/// what it has; also the busy wait of the checkpoint thread's connections.
pub(crate) const RESTART_WAIT: Duration = Duration::from_millis(10);

/// While the thread's rounds go on, the commit that leaves the WAL this many thresholds long waits for its
/// catch-up: the rounds have not kept up with the commits.
const PACED_CAP: i64 = 3;

/// After a failed sync of the database file the WAL only grows (see the module's doc): commits are refused
/// once it holds this many thresholds, one more than the rounds let it reach, until the inbox is opened
/// again. The disk is not filled by a WAL that can never start over.
pub(crate) const UNSYNCED_WAL_CAP: i64 = PACED_CAP + 1;

/// Rounds for one request, at most; the last ones are short, as each copies what came during the one before.
const MAX_ROUNDS: u32 = 8;

/// How long no commit must have come before the thread catches up on its own (a *quiet* catch-up: a round
/// that no writer waits for): longer than a catch-up takes on slow flash (two syncs and a few pages), so
/// that a writer that was only between commits rarely lands during it. One that does costs nothing but the
/// round's own I/O: its frames come after the pin, and the WAL goes on instead of starting over.
const QUIET: Duration = Duration::from_millis(50);

/// What the committing connection and the checkpoint thread share.
#[derive(Default)]
pub(crate) struct Shared {
    wake: Mutex<Wake>,
    /// The thread waits on it for a request.
    cv: Condvar,
    /// A writer waits on it for the thread's catch-up.
    restarted: Condvar,
    /// A request is waiting (the hook's fast path: no lock while one is).
    requested: AtomicBool,
    /// A writer waits for the catch-up: the write-back under way goes on without its pauses.
    hurry: AtomicBool,
    /// Frames of the current WAL that the thread's last checkpoint copied back (0 once the WAL started over).
    backfilled: AtomicI64,
    /// WAL length (frames) at which a commit waits for the catch-up; 0 until the first commit sets it.
    restart_at: AtomicI64,
    /// Frames in the WAL after the latest commit.
    frames: AtomicI64,
    /// When the latest commit's hook ran ([`since_start`]).
    last_commit: AtomicU64,
    /// Times the hook saw the WAL start over: the thread's figures from a checkpoint of an earlier WAL are
    /// dropped instead of stored over the new one's.
    generation: AtomicU64,
    /// Bytes copied into the database file and not yet taken by the committing connection's counters.
    copied: AtomicU64,
    /// No checkpoint while set: a sync of the WAL failed, and frames of it may be missing on the disk. Copying
    /// the later frames into the database file before they are written out again would leave the file torn
    /// between the two at a power cut (see `Db::note_wal_sync_failed`).
    held: AtomicBool,
    /// A sync of the database file failed after pages were copied into it: see the module's doc.
    database_unsynced: AtomicBool,
    /// The I/O error (SQLite code) a checkpoint of the thread met, for the committing connection: 0 for none.
    io_error: AtomicI32,
    /// Called once a catch-up asked for has ended, for a commit loop that does other work meanwhile instead
    /// of waiting in [`Shared::await_catch_up`] ([`Shared::on_catch_up_end`]).
    caught_up: Mutex<Option<Waker>>,
}

/// A commit loop's wake-up, called from the checkpoint thread.
pub(crate) type Waker = Box<dyn Fn() + Send>;

#[derive(Default)]
struct Wake {
    due: bool,
    restart: bool,
    stop: bool,
}

/// How long after asking a writer waits for the thread's catch-up (the frames left after its rounds and two
/// syncs; the end of a round's write-back first): a bound for a thread held up by a slow sync. Later commits
/// do not ask again while that request is still unanswered.
pub(crate) const RESTART_HANDSHAKE: Duration = Duration::from_millis(250);

impl Shared {
    /// The thread is done with a catch-up it was asked for (made, failed or skipped): the waiting writer goes
    /// on.
    fn answer_restart(&self) {
        {
            let mut w = self.wake.lock().unwrap_or_else(|p| p.into_inner());
            w.restart = false;
            self.hurry.store(false, Ordering::Relaxed);
            self.restarted.notify_all();
        }
        if let Some(wake) = &*self.caught_up.lock().unwrap_or_else(|p| p.into_inner()) {
            wake();
        }
    }

    /// Sets (or, with `None`, removes) what the thread calls each time a catch-up asked for has ended: a
    /// commit loop that acks meanwhile learns it without looking again and again.
    #[cfg(feature = "mqtt")]
    pub(crate) fn on_catch_up_end(&self, wake: Option<Waker>) {
        *self.caught_up.lock().unwrap_or_else(|p| p.into_inner()) = wake;
    }

    /// Whether the committing connection asked for a catch-up that is not yet answered.
    fn restart_asked(&self) -> bool {
        self.wake.lock().unwrap_or_else(|p| p.into_inner()).restart
    }

    /// From the committing connection's WAL hook, after a commit that left `frames` in the WAL (SQLite
    /// calls the hook once the commit's write lock is released); `restarted` when the WAL started over
    /// since the hook last looked.
    ///
    /// Asks for the thread's rounds when `threshold` frames are not yet copied: no lock unless it asks,
    /// once until the thread has finished them. Once the WAL reaches the catch-up point (a little past the
    /// end of rounds that commits outran, [`PACED_CAP`] thresholds at most), asks for the thread's catch-up
    /// and returns true: the connection must then write nothing until [`Shared::await_catch_up`] has
    /// returned, so that the catch-up's copy reaches the end of the WAL, whereas a writer that never pauses
    /// would always add frames after its snapshot. A catch-up that fails (another writer, a reader that kept
    /// the WAL from starting over) is asked for again only after `threshold` more frames.
    pub(crate) fn after_commit(&self, frames: i64, restarted: bool, threshold: i64) -> bool {
        self.frames.store(frames, Ordering::Relaxed);
        self.last_commit.store(since_start(), Ordering::Relaxed);
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
                return false;
            }
            w.due = true;
            w.restart = true;
            self.hurry.store(true, Ordering::Relaxed);
            self.cv.notify_all();
            return true;
        }
        if frames - self.backfilled.load(Ordering::Relaxed) < threshold
            || self.requested.swap(true, Ordering::AcqRel)
        {
            return false;
        }
        let mut w = self.wake.lock().unwrap_or_else(|p| p.into_inner());
        w.due = true;
        self.cv.notify_all();
        false
    }

    /// Whether the catch-up asked for is still under way (not answered, the thread not stopped).
    #[cfg(feature = "mqtt")]
    pub(crate) fn catch_up_running(&self) -> bool {
        let w = self.wake.lock().unwrap_or_else(|p| p.into_inner());
        w.restart && !w.stop
    }

    /// Waits until the catch-up asked for has ended (made, failed or skipped) or the thread stopped, at most
    /// until `deadline`: the writer that asked calls it before its next write transaction.
    pub(crate) fn await_catch_up(&self, deadline: Instant) {
        let mut w = self.wake.lock().unwrap_or_else(|p| p.into_inner());
        while w.restart && !w.stop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                log::debug!(
                    "the checkpoint thread did not catch up with the WAL in {RESTART_HANDSHAKE:?}"
                );
                return;
            }
            w = self
                .restarted
                .wait_timeout(w, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
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

    /// Whether a sync of the database file failed after the thread copied pages into it: the WAL must then
    /// outlive the inbox's connections (no final checkpoint at close), for the next open to replay it.
    pub(crate) fn database_unsynced(&self) -> bool {
        self.database_unsynced.load(Ordering::SeqCst)
    }

    /// Bytes copied and not yet taken.
    pub(crate) fn peek_copied(&self) -> u64 {
        self.copied.load(Ordering::Acquire)
    }
}

/// The thread and its connections; stopped and joined when dropped (before the inbox's own connection
/// closes, so that one stays the last and runs SQLite's final checkpoint).
pub(crate) struct Checkpointer {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    threshold: i64,
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

    /// Stops the thread and waits until it has ended (its connections closed).
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

    /// Opens the thread's connections to the inbox at `path` (same VFS as the inbox's, whose syncs the
    /// checkpoints go through) and starts the thread. `threshold` is the WAL hook's.
    pub(crate) fn start(path: &Path, config: &Config, threshold: i64) -> Result<Checkpointer> {
        let open = || -> Result<Connection> {
            let conn = crate::store::schema::open_for_checkpoints(path, config)?;
            // From now on these only checkpoint or pin: a wait for the write lock or for readers is short.
            install_busy_handler(&conn, RESTART_WAIT).map_err(crate::store::error::Error::from)?;
            // Never the last to close (the thread stops first), but if one were, no copy without its sync.
            conn.set_db_config(
                rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
                true,
            )
            .map_err(crate::store::error::Error::from)?;
            Ok(conn)
        };
        let write_back = WriteBack::new(path);
        let before = write_back.descriptors();
        let conn = open()?;
        // The copies do not sync: the thread syncs the files itself, in the order the module's doc gives.
        conn.execute_batch("PRAGMA synchronous = OFF")
            .map_err(crate::store::error::Error::from)?;
        let pin = open()?;
        let write_back = write_back.own(&before, 2);
        let thread = Thread {
            page_size: page_size(&conn),
            conn,
            pin,
            write_back,
            threshold,
            copied_before: (0, 0),
            quiet_tried: (u64::MAX, 0),
        };
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let handle = std::thread::Builder::new()
            .name("edge-inbox-checkpoint".into())
            .spawn(move || thread.run(&s))
            .map_err(|e| crate::store::error::Error::Open {
                path: path.to_owned(),
                source: e,
            })?;
        Ok(Checkpointer {
            shared,
            thread: Some(handle),
            threshold,
        })
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// A sync of the database file failed, and the WAL, which can no longer start over, has reached
    /// [`UNSYNCED_WAL_CAP`] thresholds: no more commits until the inbox is opened again.
    pub(crate) fn unsynced_wal_full(&self) -> bool {
        self.shared.database_unsynced()
            && self.shared.frames.load(Ordering::Relaxed)
                >= self.threshold.saturating_mul(UNSYNCED_WAL_CAP)
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.join();
    }
}

/// What one round or catch-up did: SQLite's result code (or a sync's), the frames in the WAL and the frames
/// copied back.
#[derive(Clone, Copy)]
struct Copy {
    rc: i32,
    log: i64,
    done: i64,
    /// The sync of the database file failed after the copy: see the module's doc.
    database_unsynced: bool,
}

impl Copy {
    fn failed(rc: i32) -> Copy {
        Copy {
            rc,
            log: 0,
            done: 0,
            database_unsynced: false,
        }
    }
}

/// The SQLite code of an error, for the thread's reports.
fn code_of(e: &rusqlite::Error) -> i32 {
    e.sqlite_error()
        .map_or(ffi::SQLITE_ERROR, |f| f.extended_code)
}

fn code_of_store(e: &crate::store::error::Error) -> i32 {
    e.sqlite_code().unwrap_or(ffi::SQLITE_IOERR)
}

struct Thread {
    /// Runs the copies, at `synchronous=OFF`.
    conn: Connection,
    /// Holds the read transaction of a round or a catch-up.
    pin: Connection,
    write_back: WriteBack,
    threshold: i64,
    page_size: u64,
    /// Frames of the current WAL (by generation) this thread had copied back, to count what a checkpoint
    /// adds where the kernel does not report the bytes written.
    copied_before: (u64, i64),
    /// The WAL (generation) and its length when the thread last caught up on its own.
    quiet_tried: (u64, i64),
}

/// What the thread was woken for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Job {
    /// The hook asked for rounds.
    Rounds,
    /// The hook asked for the catch-up, and its writer waits.
    CatchUp,
    /// No commit came for [`QUIET`] while frames were left after the rounds.
    QuietCatchUp,
}

/// Nanoseconds since the first call in the process: a clock that fits an atomic.
fn since_start() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

impl Thread {
    fn run(mut self, shared: &Shared) {
        loop {
            let job = {
                let mut w = shared.wake.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if w.stop {
                        w.restart = false;
                        shared.restarted.notify_all();
                        return;
                    }
                    if w.due {
                        w.due = false;
                        break if w.restart { Job::CatchUp } else { Job::Rounds };
                    }
                    w = match self.quiet_in(shared) {
                        None => shared.cv.wait(w).unwrap_or_else(|p| p.into_inner()),
                        Some(left) if left.is_zero() => break Job::QuietCatchUp,
                        Some(left) => {
                            shared
                                .cv
                                .wait_timeout(w, left)
                                .unwrap_or_else(|p| p.into_inner())
                                .0
                        }
                    };
                }
            };
            if shared.held.load(Ordering::SeqCst) || shared.database_unsynced.load(Ordering::SeqCst)
            {
                shared.requested.store(false, Ordering::Release);
                if job == Job::CatchUp {
                    shared.answer_restart();
                }
                continue;
            }
            match job {
                Job::CatchUp => {
                    self.catch_up_and_count(shared);
                    shared.answer_restart();
                }
                Job::QuietCatchUp => {
                    let generation = shared.generation.load(Ordering::Acquire);
                    self.quiet_tried = (generation, shared.frames.load(Ordering::Relaxed));
                    // A round: with no commit meanwhile it copies every frame left, and what is left may
                    // be most of a threshold, written back paced as the rounds' pages are.
                    self.counted(shared, generation, |t| t.round(&shared.hurry));
                }
                Job::Rounds => self.rounds(shared),
            }
        }
    }

    /// The rounds for one request of the hook, then where a writer will wait for the catch-up.
    fn rounds(&mut self, shared: &Shared) {
        let generation = shared.generation.load(Ordering::Acquire);
        shared
            .restart_at
            .fetch_max(self.threshold.saturating_mul(PACED_CAP), Ordering::Relaxed);
        let mut last = None;
        for _ in 0..MAX_ROUNDS {
            let c = self.counted(shared, generation, |t| t.round(&shared.hurry));
            last = Some(c);
            let now = shared.frames.load(Ordering::Relaxed);
            if c.rc != ffi::SQLITE_OK
                || shared.generation.load(Ordering::Acquire) != generation
                || now - c.done <= self.threshold / 16
                || shared.restart_asked()
                || shared.held.load(Ordering::SeqCst)
            {
                break;
            }
        }
        let now = shared.frames.load(Ordering::Relaxed);
        // Commits landed during the rounds, so the WAL will not start over by itself. A quiet moment lets
        // the thread catch up on its own ([`QUIET`]); failing one, the commit that adds a little more waits
        // for the catch-up, which copies only those few frames.
        if last.is_some_and(|c| c.done > 0 && now > c.done)
            && shared.generation.load(Ordering::Acquire) == generation
        {
            shared
                .restart_at
                .store(now + (self.threshold / 32).max(1), Ordering::Relaxed);
        }
        // Commits from now on may ask again (not during the rounds: they would ask for their tail at once).
        shared.requested.store(false, Ordering::Release);
    }

    /// How long until the thread may catch up on its own: frames are left after rounds of this WAL, no
    /// commit came for [`QUIET`], and, after a quiet catch-up that a commit outran, a thirty-second of a
    /// threshold more frames came (so that a writer pausing often does not have every few pages copied
    /// twice). `None` while none is due.
    fn quiet_in(&self, shared: &Shared) -> Option<Duration> {
        if shared.held.load(Ordering::SeqCst) || shared.database_unsynced.load(Ordering::SeqCst) {
            return None;
        }
        let generation = shared.generation.load(Ordering::Acquire);
        let frames = shared.frames.load(Ordering::Relaxed);
        let backfilled = shared.backfilled.load(Ordering::Relaxed);
        if backfilled == 0 || frames <= backfilled {
            return None;
        }
        let (tried_generation, tried_at) = self.quiet_tried;
        if tried_generation == generation && frames < tried_at + (self.threshold / 32).max(1) {
            return None;
        }
        let since = Duration::from_nanos(
            since_start().saturating_sub(shared.last_commit.load(Ordering::Relaxed)),
        );
        Some(QUIET.saturating_sub(since))
    }

    /// A catch-up, its figures stored as a round's; a catch-up that did not leave everything copied is
    /// asked for again only `threshold` frames later.
    fn catch_up_and_count(&mut self, shared: &Shared) -> Copy {
        let generation = shared.generation.load(Ordering::Acquire);
        let c = self.counted(shared, generation, Thread::catch_up);
        if shared.generation.load(Ordering::Acquire) == generation {
            // Even when all was copied: a reader in the WAL keeps the next write from starting it over.
            shared.restart_at.store(
                c.log.max(self.threshold) + self.threshold,
                Ordering::Relaxed,
            );
        }
        c
    }

    /// Runs `f` (a round or a catch-up) and records what it did: its I/O error for the committing
    /// connection, the frames copied back, the bytes written into the database file.
    fn counted(
        &mut self,
        shared: &Shared,
        generation: u64,
        f: impl FnOnce(&mut Thread) -> Copy,
    ) -> Copy {
        let before = ThreadIo::now();
        let c = f(self);
        if c.database_unsynced {
            shared.database_unsynced.store(true, Ordering::SeqCst);
        }
        if c.rc & 0xff == ffi::SQLITE_IOERR {
            // Its sync of the WAL may have taken the report of a failed write-back from the inbox.
            log::error!(
                "background checkpoint failed (SQLite code {}); checkpoints held",
                c.rc
            );
            shared.held.store(true, Ordering::SeqCst);
            shared.io_error.store(c.rc, Ordering::SeqCst);
        } else if c.rc != ffi::SQLITE_OK && c.rc != ffi::SQLITE_BUSY {
            log::debug!("background checkpoint failed (SQLite code {})", c.rc);
        }
        if c.done > 0 {
            // Only while the WAL is still the one checkpointed (the hook resets it when it starts over).
            if shared.generation.load(Ordering::Acquire) == generation {
                shared.backfilled.store(c.done, Ordering::Relaxed);
            }
            let frames_before = if self.copied_before.0 == generation {
                self.copied_before.1
            } else {
                0
            };
            self.copied_before = (generation, c.done);
            shared.copied.fetch_add(
                bytes_copied(before, c.done - frames_before, self.page_size),
                Ordering::AcqRel,
            );
        }
        c
    }

    /// One round: pin, sync the WAL, copy without a sync, write back paced, sync the database file, unpin.
    fn round(&mut self, hurry: &AtomicBool) -> Copy {
        self.pinned_copy(Some(hurry))
    }

    /// The catch-up, while the writer that asked waits (so that it adds no frame): every frame left is
    /// copied and the database file synced, so that the next write starts the WAL over.
    fn catch_up(&mut self) -> Copy {
        let mut c = self.pinned_copy(None);
        if c.rc == ffi::SQLITE_OK && c.done < c.log {
            // Another connection committed after the pin began, or a reader with an older snapshot kept
            // frames from the copy.
            c.rc = ffi::SQLITE_BUSY;
        }
        c
    }

    /// Pins, syncs the WAL, copies without a sync, writes back paced (with `hurry`, in a round), syncs the
    /// database file, unpins.
    ///
    /// The pin is a read transaction begun while frames are left to copy, so it holds one of the WAL's
    /// read marks: no write can start the WAL over while it lasts, even once every frame is copied (a
    /// write lock would not do: once released after a failed sync, with every frame copied, a reader
    /// begun then would read past the WAL and hold nothing back). When another connection copied every
    /// frame just before (a pruner's checkpoint), the pin is such a reader, on read mark 0: that stops
    /// every copy while it lasts (a checkpoint takes mark 0 exclusively before it writes the database
    /// file), so this one copies nothing, and a commit landing after the WAL's sync is never copied.
    fn pinned_copy(&mut self, write_back: Option<&AtomicBool>) -> Copy {
        let pinned = self.pin.execute_batch("BEGIN").and_then(|()| {
            self.pin
                .query_row("SELECT count(*) FROM sqlite_master", [], |r| {
                    r.get::<_, i64>(0)
                })
                .map(drop)
        });
        if let Err(e) = pinned {
            let _ = self.pin.execute_batch("ROLLBACK");
            return Copy::failed(code_of(&e));
        }
        // As SQLite's own checkpoint begins, and at every `synchronous` level: a commit loop that overlaps
        // its commits with their syncs commits at NORMAL, and so may another connection, so the frames up
        // to the pin may not be on the disk yet; a page copied from one of them could reach the database
        // file first.
        if let Err(e) = sync_wal(&self.conn) {
            let _ = self.pin.execute_batch("ROLLBACK");
            return Copy::failed(code_of_store(&e));
        }
        let c = self.copy();
        if c.rc == ffi::SQLITE_OK && c.done > 0 {
            if let Some(hurry) = write_back {
                if let Err(errno) = self.write_back.run(hurry) {
                    // The failure was reported to a descriptor the sync below may go through, and would
                    // not be reported again: the database file counts as unsynced.
                    log::error!("writing the database file back failed (errno {errno})");
                    return self.database_unsynced(ffi::SQLITE_IOERR_FSYNC);
                }
            }
            if let Err(e) = sync_database(&self.conn) {
                // The pin stays: see the module's doc.
                return self.database_unsynced(code_of_store(&e));
            }
        }
        let _ = self.pin.execute_batch("ROLLBACK");
        c
    }

    /// The PASSIVE checkpoint at `synchronous=OFF`: copies up to the oldest snapshot still read (the pin's,
    /// in a round), syncing nothing.
    fn copy(&self) -> Copy {
        // SAFETY: the thread's own open connection, outside any statement, and SQLite's name of the main schema.
        let (rc, log, done) = unsafe {
            wal_checkpoint(
                self.conn.handle(),
                c"main".as_ptr(),
                ffi::SQLITE_CHECKPOINT_PASSIVE,
            )
        };
        Copy {
            rc,
            log,
            done,
            database_unsynced: false,
        }
    }

    fn database_unsynced(&self, rc: i32) -> Copy {
        log::error!(
            "a sync of the database file failed after a checkpoint copied pages into it (SQLite code {rc}): \
             the WAL is kept until the inbox closes, and replayed when it is opened again"
        );
        Copy {
            database_unsynced: true,
            ..Copy::failed(rc)
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

/// The connection's page size, for the byte counts.
pub(crate) fn page_size(conn: &Connection) -> u64 {
    conn.query_row("PRAGMA page_size", [], |r| r.get::<_, i64>(0))
        .map_or(4096, |p| p.max(512) as u64)
}
