//! Bytes the inbox writes to its files, counted for flash wear without touching the commit path: SQLite calls
//! the connection's WAL hook after each commit anyway, and the pager already counts the pages it wrote
//! (`SQLITE_DBSTATUS_CACHE_WRITE`, a field read, no system call). Installing a WAL hook replaces SQLite's
//! automatic checkpoint, so the hook runs that checkpoint itself, at the same threshold and in the same
//! (PASSIVE) mode, and counts what it wrote to the database file from the thread's I/O counters across the
//! checkpoint ([`checkpoint_bytes`](crate::store::checkpoint_bytes): two reads per checkpoint, none per
//! commit).
//!
//! The counts live in memory and are added to `inbox_meta` (names [`WAL_BYTES`] and [`CHECKPOINT_BYTES`])
//! inside the first commit after a checkpoint ran, and when the connection closes: one small page in a
//! commit every few thousand, never a page per commit.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rusqlite::{ffi, Connection};

use crate::store::checkpoint_bytes::{bytes_copied, ThreadIo};
use crate::store::checkpointer::{
    page_size, wal_checkpoint, Shared, RESTART_HANDSHAKE, RESTART_WAIT,
};
use crate::store::schema::install_busy_handler;
use crate::store::wal_sync::{pages_written, pages_written_by};

/// `inbox_meta` name of the cumulative bytes written to the WAL (frames and their headers).
pub(crate) const WAL_BYTES: &str = "bytes_written_wal";
/// `inbox_meta` name of the cumulative bytes checkpoints copied into the database file.
pub(crate) const CHECKPOINT_BYTES: &str = "bytes_written_checkpoint";

/// A WAL frame's header.
const FRAME_HEADER: u64 = 24;

/// The counters of one connection. Boxed and owned by the connection's [`Db`](crate::store::db::Db); the
/// WAL hook gets its address and runs on the connection's thread, inside `sqlite3_step`.
#[derive(Default)]
pub(crate) struct Wear {
    page_size: u64,
    /// Checkpoint when the WAL holds this many frames after a commit (0: never, as `wal_autocheckpoint=0`).
    autocheckpoint: i64,
    /// `SQLITE_DBSTATUS_CACHE_WRITE` at the last look.
    pages_seen: Cell<u32>,
    /// WAL frames after the last commit this connection saw, and how many of them its last checkpoint had
    /// copied back: a later checkpoint of the same WAL counts only what it adds.
    frames_in_wal: Cell<i64>,
    backfilled: Cell<i64>,
    /// Bytes not yet added to `inbox_meta`.
    unsaved_wal: Cell<u64>,
    unsaved_checkpoint: Cell<u64>,
    /// A checkpoint ran since the counts were last saved.
    save_due: Cell<bool>,
    /// Checkpoints that copied frames back, since the connection opened.
    checkpoints: Cell<u64>,
    /// The I/O error a checkpoint on this connection met (its sync of the WAL, say), not yet taken.
    io_error: Cell<Option<i32>>,
    /// A commit asked the checkpoint thread to catch up: nothing more is written until it has, or until
    /// this deadline (see [`Shared::after_commit`]).
    catch_up_until: Cell<Option<Instant>>,
    /// The checkpoint thread the hook asks instead of checkpointing itself ([`Config::checkpoint_thread`]).
    ///
    /// [`Config::checkpoint_thread`]: crate::Config::checkpoint_thread
    background: Option<Arc<Shared>>,
}

/// Bytes written, as the counters know them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Written {
    pub(crate) wal: u64,
    pub(crate) checkpoint: u64,
}

impl Wear {
    /// Installs the hook on `conn` and returns the counters it updates, which must be kept (the box, not
    /// necessarily where it is held) until the connection is closed. With `background`, the hook asks that
    /// thread for the automatic checkpoint instead of running it inside the commit.
    pub(crate) fn install(
        conn: &Connection,
        autocheckpoint: i64,
        background: Option<Arc<Shared>>,
    ) -> Box<Wear> {
        let wear = Box::new(Wear {
            autocheckpoint,
            background,
            page_size: page_size(conn),
            pages_seen: Cell::new(pages_written(conn)),
            ..Wear::default()
        });
        let arg = &*wear as *const Wear as *mut c_void;
        // SAFETY: the handle is this open connection's; the boxed counters outlive it (see above) and
        // `on_commit` only reads them through shared references on the connection's own thread.
        unsafe { ffi::sqlite3_wal_hook(conn.handle(), Some(on_commit), arg) };
        wear
    }

    /// What this connection (and its checkpoint thread) wrote and has not yet saved in the file.
    pub(crate) fn unsaved(&self) -> Written {
        let own = self.own_unsaved();
        Written {
            checkpoint: own.checkpoint + self.background.as_ref().map_or(0, |b| b.peek_copied()),
            ..own
        }
    }

    /// The counts this connection holds (what its thread copied since the last [`Wear::collect`] aside).
    fn own_unsaved(&self) -> Written {
        Written {
            wal: self.unsaved_wal.get(),
            checkpoint: self.unsaved_checkpoint.get(),
        }
    }

    /// Takes over what the checkpoint thread copied since the last look.
    fn collect(&self) {
        if let Some(copied) = self.background.as_ref().map(|b| b.take_copied()) {
            if copied > 0 {
                self.add(0, copied);
                self.save_due.set(true);
            }
        }
    }

    /// Inside an open write transaction, before its `COMMIT`: when a checkpoint ran since the last save, adds
    /// the unsaved counts to `inbox_meta` and returns what was added (to be forgotten once the commit
    /// succeeded, [`Wear::saved`]). A failure only leaves the counts for a later commit.
    pub(crate) fn stage(&self, conn: &Connection) -> Option<Written> {
        self.collect();
        if !self.save_due.get() {
            return None;
        }
        let w = self.own_unsaved();
        match add_to_meta(conn, w) {
            Ok(()) => Some(w),
            Err(e) => {
                log::debug!("bytes-written counters not saved this time: {e}");
                None
            }
        }
    }

    /// The commit that carried `staged` succeeded.
    pub(crate) fn saved(&self, staged: Written) {
        self.unsaved_wal.set(self.unsaved_wal.get() - staged.wal);
        self.unsaved_checkpoint
            .set(self.unsaved_checkpoint.get() - staged.checkpoint);
        self.save_due.set(false);
    }

    /// Saves what is left in a transaction of its own (the connection is closing). Best effort: a database
    /// busy for more than 100 ms, or failing, loses these counts, which only makes the cumulative figure low.
    pub(crate) fn save_on_close(&self, conn: &Connection) {
        self.collect();
        let w = self.own_unsaved();
        if w == Written::default() || !conn.is_autocommit() {
            return;
        }
        // The connection is closing: a short wait for the write lock instead of the configured busy
        // timeout (this replaces the inbox's busy handler, which nothing needs any more).
        let _ = conn.busy_timeout(std::time::Duration::from_millis(100));
        let r = conn
            .execute_batch("BEGIN IMMEDIATE")
            .and_then(|()| add_to_meta(conn, w))
            .and_then(|()| conn.execute_batch("COMMIT"));
        if let Err(e) = r {
            log::debug!("bytes-written counters not saved at close: {e}");
            if !conn.is_autocommit() {
                let _ = conn.execute_batch("ROLLBACK");
            }
        }
    }

    /// WAL frames this connection's last commit left that no checkpoint of its own has copied back yet (another
    /// connection's checkpoint is not seen).
    pub(crate) fn frames_not_copied(&self) -> i64 {
        (self.frames_in_wal.get() - self.backfilled.get()).max(0)
    }

    /// The I/O error a checkpoint on this connection met since the last call: its WAL sync may have used up
    /// the report of a failed write-back (see `Db::note_wal_sync_failed`).
    pub(crate) fn take_io_error(&self) -> Option<i32> {
        self.io_error.take()
    }

    /// Before a write transaction begins: waits for the checkpoint thread's catch-up a commit of this
    /// connection asked for, if it is still under way (at most [`RESTART_HANDSHAKE`] after the asking).
    pub(crate) fn await_catch_up(&self) {
        if let (Some(deadline), Some(b)) = (self.catch_up_until.take(), &self.background) {
            b.await_catch_up(deadline);
        }
    }

    /// How long a write transaction would now wait, at most, for the checkpoint thread's catch-up
    /// ([`Wear::await_catch_up`]); `None` if it would not: a commit loop does something else meanwhile
    /// (acks what is durable), woken when the catch-up ends by [`Wear::on_catch_up_end`]'s waker.
    #[cfg(feature = "mqtt")]
    pub(crate) fn catch_up_left(&self) -> Option<Duration> {
        let (deadline, b) = (self.catch_up_until.get()?, self.background.as_ref()?);
        // The clock first: past the deadline the thread's lock is not taken.
        let left = deadline.saturating_duration_since(Instant::now());
        (!left.is_zero() && b.catch_up_running()).then_some(left)
    }

    /// Sets (or removes) what the checkpoint thread calls once each catch-up it was asked for has ended.
    /// Without the thread there is nothing to wait for, and `wake` is dropped.
    #[cfg(feature = "mqtt")]
    pub(crate) fn on_catch_up_end(&self, wake: Option<crate::store::checkpointer::Waker>) {
        if let Some(b) = &self.background {
            b.on_catch_up_end(wake);
        }
    }

    /// Checkpoints this connection ran (automatic ones in its commits, and [`Wear::checkpoint`]).
    pub(crate) fn checkpoints(&self) -> u64 {
        self.checkpoints.get()
    }

    /// A checkpoint run outside any commit (a pruner keeping the WAL short), counted as the automatic one is.
    /// Outside a transaction only.
    ///
    /// PASSIVE, which copies the bulk without blocking anyone. Beside a busy writer that is not always enough:
    /// the WAL only starts over at a write transaction that begins once every frame is copied, and a commit
    /// landing during the copy leaves frames behind, so the WAL can keep growing until a consumer's commit
    /// reaches its own threshold and checkpoints inside that commit. So once the WAL is `restart_at` frames
    /// long (it did not start over by itself), a RESTART follows: it copies the few frames added meanwhile,
    /// holding the write lock for that short copy and its syncs, and waits for readers to leave the WAL, so
    /// that the next write starts it over. It holds the write lock while it waits, so it waits
    /// [`RESTART_WAIT`] at most, not the connection's busy timeout (`busy_timeout`, restored after): a long
    /// reader (a backup, an open shell) would otherwise stall every consumer for that long at every step.
    pub(crate) fn checkpoint(&self, conn: &Connection, restart_at: i64, busy_timeout: Duration) {
        // SAFETY: this open connection's handle, on its own thread, outside a statement.
        let db = unsafe { conn.handle() };
        let passive = self.checkpoint_counted(db, c"main".as_ptr(), ffi::SQLITE_CHECKPOINT_PASSIVE);
        // After an I/O error the RESTART's own sync could succeed and copy frames past a hole in the WAL.
        let failed = self.io_error.get().is_some();
        let restart = if !failed
            && self.frames_in_wal.get() >= restart_at
            && install_busy_handler(conn, RESTART_WAIT).is_ok()
        {
            let copied =
                self.checkpoint_counted(db, c"main".as_ptr(), ffi::SQLITE_CHECKPOINT_RESTART);
            if let Err(e) = install_busy_handler(conn, busy_timeout) {
                log::error!("cannot restore the busy timeout after a checkpoint: {e}");
            }
            copied
        } else {
            None
        };
        if passive.is_some() || restart.is_some() {
            self.checkpoints.set(self.checkpoints.get() + 1);
        }
        self.add(0, passive.unwrap_or(0) + restart.unwrap_or(0));
    }

    /// Runs a checkpoint of `name` in `mode`; the bytes it wrote into the database file, `None` when it did
    /// not run (busy) or found nothing to copy.
    fn checkpoint_counted(
        &self,
        db: *mut ffi::sqlite3,
        name: *const c_char,
        mode: c_int,
    ) -> Option<u64> {
        let before = ThreadIo::now();
        // SAFETY: a valid open handle and schema name (SQLite's own in the hook); what its default hook does.
        let (rc, _, done) = unsafe { wal_checkpoint(db, name, mode) };
        if rc & 0xff == ffi::SQLITE_IOERR {
            self.io_error.set(Some(rc));
        }
        // A RESTART that copied everything but could not wait out a reader reports BUSY: it still copied.
        if (rc != ffi::SQLITE_OK && rc != ffi::SQLITE_BUSY) || done <= 0 {
            return None;
        }
        let copied = bytes_copied(before, done - self.backfilled.get(), self.page_size);
        self.backfilled.set(done);
        self.save_due.set(true);
        Some(copied)
    }

    fn add(&self, wal: u64, checkpoint: u64) {
        self.unsaved_wal.set(self.unsaved_wal.get() + wal);
        self.unsaved_checkpoint
            .set(self.unsaved_checkpoint.get() + checkpoint);
    }
}

fn add_to_meta(conn: &Connection, w: Written) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "INSERT INTO inbox_meta (name, value) VALUES (?1, ?2), (?3, ?4) \
         ON CONFLICT (name) DO UPDATE SET value = coalesce(value, 0) + excluded.value",
    )?
    .execute((
        WAL_BYTES,
        w.wal as i64,
        CHECKPOINT_BYTES,
        w.checkpoint as i64,
    ))
    .map(drop)
}

/// The WAL hook: after each commit that wrote frames, with `frames` = frames in the WAL now.
unsafe extern "C" fn on_commit(
    arg: *mut c_void,
    db: *mut ffi::sqlite3,
    name: *const c_char,
    frames: c_int,
) -> c_int {
    // SAFETY: `arg` is the connection's `Wear` (see `install`), alive while the connection is.
    let wear = unsafe { &*(arg as *const Wear) };
    let pages = pages_written_by(db);
    // SQLite keeps this counter in 31 bits (`nRet & 0x7fffffff`): the difference is taken in the same bits,
    // so that a wrap past 2^31 pages counts the pages written, not 2^31 more.
    let new = u64::from(pages.wrapping_sub(wear.pages_seen.get()) & 0x7fff_ffff);
    wear.pages_seen.set(pages);
    let frames = i64::from(frames);
    // The WAL started over from its beginning since this connection last looked.
    let restarted = frames < wear.frames_in_wal.get();
    if restarted {
        wear.backfilled.set(0);
    }
    wear.frames_in_wal.set(frames);
    let copied = if let Some(b) = wear.background.as_ref().filter(|_| wear.autocheckpoint > 0) {
        if b.after_commit(frames, restarted, wear.autocheckpoint) {
            wear.catch_up_until
                .set(Some(Instant::now() + RESTART_HANDSHAKE));
        }
        0
    } else if wear.autocheckpoint > 0 && frames >= wear.autocheckpoint {
        match wear.checkpoint_counted(db, name, ffi::SQLITE_CHECKPOINT_PASSIVE) {
            Some(copied) => {
                wear.checkpoints.set(wear.checkpoints.get() + 1);
                copied
            }
            None => 0,
        }
    } else {
        0
    };
    wear.add(new * (wear.page_size + FRAME_HEADER), copied);
    ffi::SQLITE_OK
}

#[cfg(all(test, feature = "mqtt"))]
mod tests {
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use crate::{Config, Delivery, Inbox, Tx};

    fn noop(_: &mut Tx<'_>, _: &Delivery<'_>) -> anyhow::Result<()> {
        Ok(())
    }

    /// A writer that never pauses asks the checkpoint thread to catch up; a commit loop that acks meanwhile
    /// instead of waiting learns of the catch-up's end from the waker, then finds nothing left to wait for.
    /// Failed while the loop had to look again every millisecond: no wake-up came.
    #[test]
    fn the_end_of_a_catch_up_wakes_the_commit_loop() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config::default().wal_autocheckpoint(50);
        let mut inbox = Inbox::open(dir.path().join("inbox.db"), config).unwrap();
        let (tx, rx) = mpsc::channel();
        inbox.conn.wear.on_catch_up_end(Some(Box::new(move || {
            let _ = tx.send(Instant::now());
        })));
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut i = 0;
        let asked = loop {
            assert!(
                i < 20_000 && Instant::now() < deadline,
                "{i} commits asked for no catch-up"
            );
            let id = format!("cmd-{i}");
            inbox
                .process(&Delivery::new("commands", &id, "cmd", b"{}"), noop)
                .unwrap();
            i += 1;
            if inbox.conn.wear.catch_up_until.get().is_some() {
                break Instant::now();
            }
        };
        let woken = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the catch-up's end woke nothing");
        assert_eq!(
            inbox.conn.wear.catch_up_left(),
            None,
            "woken {:?} after the asking commit, the next write would still wait",
            woken.saturating_duration_since(asked)
        );
        // Removed, it is dropped at once: the sender it holds must not keep a commit loop's channel open.
        inbox.conn.wear.on_catch_up_end(None);
        assert_eq!(rx.try_recv(), Err(mpsc::TryRecvError::Disconnected));
    }
}
