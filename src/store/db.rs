//! The connection with the statements of the hot path prepared once and held.
//!
//! rusqlite's `prepare_cached` builds a fresh `Arc<str>` key on every call, hit or miss, so a consumer that
//! used it for every statement of every delivery would allocate several times per message. The handful of
//! statements each delivery runs are prepared when the inbox opens and kept beside the connection.

use std::cell::{Cell, RefCell};
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rusqlite::{Connection, OptionalExtension, Statement};

use crate::store::error::{storage_error, Error, Result};
use crate::store::files::{FileId, Files, Moved};
use crate::store::wal_watch::{Waiter, WalWatch};

/// Statements of the hot path. They borrow the boxed connection of their [`Db`] (hence the `'static`
/// lifetime, which never escapes this module) and are dropped before it.
struct Hot {
    begin: RefCell<Statement<'static>>,
    commit: RefCell<Statement<'static>>,
    savepoint: RefCell<Statement<'static>>,
    release: RefCell<Statement<'static>>,
    rollback_to: RefCell<Statement<'static>>,
    insert_identity: RefCell<Statement<'static>>,
    stored_fingerprint: RefCell<Statement<'static>>,
    add_counts: RefCell<Statement<'static>>,
    data_version: RefCell<Statement<'static>>,
    kv_get: RefCell<Statement<'static>>,
    kv_put: RefCell<Statement<'static>>,
    kv_delete: RefCell<Statement<'static>>,
}

/// An open database connection and its held statements. Dereferences to the connection for everything else.
///
/// It also keeps the connection's durability honest: a few internal transactions (a worker's claim, a prune
/// step) may commit without their own fsync, between [`Db::start_relaxed`] and [`Db::end_relaxed`]; every other transaction starts
/// at the configured `synchronous` level, set again and read back if a relaxed one ran before it.
pub(crate) struct Db {
    hot: ManuallyDrop<Hot>,
    /// Owned (from `Box::into_raw`); freed in `Drop` after the statements.
    conn: NonNull<Connection>,
    /// The configured `synchronous` level (2 FULL, 1 NORMAL).
    durable: i64,
    /// The level the connection is at now; [`UNKNOWN_LEVEL`] when it must be set and read back again.
    current: Cell<i64>,
    relaxed: Cell<bool>,
    /// A handler got outside its transaction, where it could change the connection's settings: the next
    /// transaction checks the journal mode again (see [`Db::recheck_settings`]).
    settings_suspect: Cell<bool>,
    /// What outbox writes on this connection need from the inbox configuration.
    pub(crate) outbox: crate::store::config::OutboxSettings,
    /// The database file and its WAL as this connection opened them, to notice when either is deleted or
    /// replaced underneath it (see [`Files`]). `None` for a database without a file.
    files: Option<Files>,
    /// (device, inode) of the WAL file this connection writes: learned at open, or at the first check if it
    /// was not there yet. A file recreated at the same path (another connection opening the database after
    /// the deletion) is not ours.
    wal_id: Cell<Option<FileId>>,
    /// Says when either path may have changed, so that a `stat` is needed (see [`WalWatch`]).
    wal_watch: Option<WalWatch>,
    /// Acts on a deletion while no commit runs; stopped before the connection closes.
    waiter: Option<Waiter>,
    /// The path the inbox was opened on, for errors and the log.
    pub(crate) path: std::path::PathBuf,
    /// Commits at least this slow are logged.
    pub(crate) slow_commit: Option<std::time::Duration>,
    /// How long the latest successful `COMMIT` took (its sync included, at `synchronous=FULL`).
    pub(crate) last_commit: Cell<std::time::Duration>,
    /// Shared with the connection's commit and rollback hooks: see [`HandlerGuard`].
    guard: Arc<HandlerGuard>,
    /// The database's identity key (read when the inbox opens; it never changes).
    pub(crate) id_key: crate::store::identity::IdKey,
    /// The latest clock reading retention accepted (`clock_seen`, Unix seconds; 0 when none), as of the
    /// last retention refresh: new identities are never dated before it.
    pub(crate) clock_seen: Cell<i64>,
    /// Bytes written to the files, for flash wear (see [`Wear`](crate::store::wear::Wear)).
    pub(crate) wear: Box<crate::store::wear::Wear>,
    /// The automatic checkpoint's thread, when it has one ([`Config::checkpoint_thread`]).
    ///
    /// [`Config::checkpoint_thread`]: crate::Config::checkpoint_thread
    pub(crate) checkpointer: Option<crate::store::checkpointer::Checkpointer>,
}

/// What the connection's commit and rollback hooks know about a running handler.
///
/// While a handler runs, the inbox's transaction is open, so no commit can legitimately happen: any commit
/// SQLite attempts then is a statement running in autocommit because the transaction is gone (SQLite rolled
/// it back on I/O trouble, NOMEM, an interrupt, a trigger's `RAISE(ROLLBACK)`, `INSERT OR ROLLBACK`; or the
/// handler ended it). The commit hook refuses every such commit, which SQLite turns into a rollback, so a
/// raw statement through [`crate::Tx::sql`] cannot commit without the identity. Checking `is_autocommit`
/// after the statement would be too late: it would already have committed. The rollback hook remembers that
/// the transaction ended, so a handler that even opens a new one is still caught.
///
/// The hooks are the connection's only ones, and anyone holding the `Connection` can replace them (rusqlite's
/// `commit_hook` and `rollback_hook` take `&self`). So they are installed again, straight through the C API
/// (no allocation), before every handler runs, and checked after it: a handler that replaced them while it
/// ran fails its call.
///
/// It also refuses every commit once the database file is known to be gone from its path (`gone`), and while
/// a failed sync may have left frames of the WAL off the disk (`unsynced`, see [`Db::note_wal_sync_failed`]).
#[derive(Default)]
struct HandlerGuard {
    active: AtomicBool,
    ended: AtomicBool,
    gone: AtomicBool,
    unsynced: AtomicBool,
    /// The deleted WAL's rescue was logged.
    wal_reported: AtomicBool,
    /// The WAL's cap after a failed sync of the database file was logged.
    wal_full_reported: AtomicBool,
}

/// `true` turns the COMMIT into a ROLLBACK.
unsafe extern "C" fn refuse_commit(guard: *mut std::ffi::c_void) -> std::ffi::c_int {
    // SAFETY: `guard` is the `HandlerGuard` the hook was installed with (`HandlerGuard::install`), kept alive
    // by the `Db` until after the connection is closed.
    let g = unsafe { &*(guard as *const HandlerGuard) };
    std::ffi::c_int::from(
        g.active.load(Ordering::SeqCst)
            || g.gone.load(Ordering::SeqCst)
            || g.unsynced.load(Ordering::SeqCst),
    )
}

unsafe extern "C" fn note_rollback(guard: *mut std::ffi::c_void) {
    // SAFETY: as in `refuse_commit`.
    let g = unsafe { &*(guard as *const HandlerGuard) };
    if g.active.load(Ordering::SeqCst) {
        g.ended.store(true, Ordering::SeqCst);
    }
}

impl HandlerGuard {
    /// Installs (again) this guard's commit and rollback hooks on `conn`; true if both were the ones in place.
    fn install(self: &Arc<Self>, conn: &Connection) -> bool {
        let arg = Arc::as_ptr(self) as *mut std::ffi::c_void;
        // SAFETY: the handle is the open connection's; the hooks only read `arg`, which the `Db` owning this
        // `Arc` keeps alive until its connection is closed (rusqlite clears the hooks when it closes).
        unsafe {
            let commit =
                rusqlite::ffi::sqlite3_commit_hook(conn.handle(), Some(refuse_commit), arg);
            let rollback =
                rusqlite::ffi::sqlite3_rollback_hook(conn.handle(), Some(note_rollback), arg);
            commit == arg && rollback == arg
        }
    }

    /// The database file is no longer at `path`: from now on every commit is refused, and the connection
    /// leaves the files at the path alone when it closes. Logged once.
    ///
    /// # Safety
    /// `db` is the open connection's handle, used from its own thread or opened in serialized mode.
    unsafe fn note_gone(&self, db: *mut rusqlite::ffi::sqlite3, path: &std::path::Path) {
        if self.gone.swap(true, Ordering::SeqCst) {
            return;
        }
        // SAFETY: per the caller.
        unsafe { crate::store::files::keep_wal_on_close(db) };
        log::error!(
            "the database file {} was deleted or replaced while the inbox had it open: nothing it writes can be \
             made durable under that name any more, so every further write fails (Error::DatabaseGone); \
             reopen the inbox, which then uses whatever file is at that path",
            path.display()
        );
    }
}

/// The connection's handle for its [`Waiter`] thread.
struct SendHandle(*mut rusqlite::ffi::sqlite3);

// SAFETY: only used while the connection is open (the `Db` joins the thread before closing it), and only on a
// connection in serialized mode, where SQLite's own mutex orders every call on it. (The thread's checkpoint
// may then set the connection's error message between an owner's failing call and its reading the message;
// result codes, which are all the inbox classifies by, come back from each call itself.)
unsafe impl Send for SendHandle {}

/// The thread that acts on a deletion while the connection is idle: the database file gone, it marks the
/// connection gone (refusing every later commit); the WAL gone, it copies the frames committed before into
/// the database file with a FULL checkpoint, through the same connection (another connection would open a
/// new, empty WAL at the path). If the connection is inside a transaction the checkpoint fails
/// (`SQLITE_LOCKED`) and is retried once a second; the commit ending that transaction rescues them anyway.
/// Only for a connection in serialized mode; `None` otherwise, or where no watch can be set up.
fn spawn_waiter(conn: &Connection, files: &Files, guard: &Arc<HandlerGuard>) -> Option<Waiter> {
    // SAFETY: the handle of an open connection.
    let handle = unsafe { conn.handle() };
    // SAFETY: a plain query of the open connection.
    if unsafe { rusqlite::ffi::sqlite3_db_mutex(handle) }.is_null() {
        return None;
    }
    let handle = SendHandle(handle);
    let (files, guard) = (files.clone(), guard.clone());
    Waiter::spawn(&files.db.clone(), move || {
        let db = &handle;
        match files.check(files.wal_id) {
            Moved::Neither => true,
            Moved::Database => {
                // SAFETY: see `SendHandle`.
                unsafe { guard.note_gone(db.0, &files.db) };
                true
            }
            Moved::Wal => {
                // SAFETY: see `SendHandle`.
                unsafe { crate::store::files::keep_wal_on_close(db.0) };
                let (mut log, mut done) = (0, 0);
                // SAFETY: see `SendHandle`; the out-parameters are valid `int`s.
                let rc = unsafe {
                    rusqlite::ffi::sqlite3_wal_checkpoint_v2(
                        db.0,
                        c"main".as_ptr(),
                        rusqlite::ffi::SQLITE_CHECKPOINT_FULL,
                        &mut log,
                        &mut done,
                    )
                };
                if rc != rusqlite::ffi::SQLITE_OK || log != done {
                    log::debug!("rescue checkpoint of a deleted WAL not done yet (SQLite code {rc}); retrying");
                    return false;
                }
                if files.check(files.wal_id) == Moved::Database {
                    // SAFETY: see `SendHandle`.
                    unsafe { guard.note_gone(db.0, &files.db) };
                } else if !guard.wal_reported.swap(true, Ordering::SeqCst) {
                    log::error!(
                        "the WAL file {} was deleted while the inbox had it open: its frames were checkpointed \
                         into the database file; reopen the inbox to get a new WAL",
                        files.wal.display()
                    );
                }
                true
            }
        }
    })
}

/// Armed while a handler runs ([`Db::arm_handler_guard`]); disarms on drop, also when the handler panics.
pub(crate) struct Armed<'a>(&'a HandlerGuard);

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        self.0.active.store(false, Ordering::SeqCst);
    }
}

// SAFETY: `Connection` is `Send`. The statements only borrow the connection owned by this same value, so
// moving the whole `Db` to another thread moves every user of the connection with it. `Db` is not `Sync`.
unsafe impl Send for Db {}

impl Drop for Db {
    fn drop(&mut self) {
        // The thread uses the connection: it stops first.
        drop(self.waiter.take());
        // Its connection closes first, so this one stays the last: SQLite's final checkpoint at close, and
        // keeping the files of a database deleted meanwhile, are this connection's. An I/O error of its last
        // checkpoints flags this connection once it has ended.
        let _ = self.note_checkpoint_io_errors();
        let shared = self.checkpointer.as_ref().map(|c| c.shared().clone());
        if let Some(code) = self
            .checkpointer
            .take()
            .and_then(crate::store::checkpointer::Checkpointer::stop)
        {
            self.note_wal_sync_failed(code);
        }
        self.close_after_failed_sync();
        // After the thread stopped: no round can fail later.
        if shared.is_some_and(|s| s.database_unsynced()) {
            // Pages SQLite counts as copied may be missing from the disk's database file: its final
            // checkpoint would not copy them again before deleting the WAL. The next open replays the WAL.
            let _ = self.set_db_config(
                rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
                true,
            );
            // Nor may anything be written now: with the thread's pin gone, a write into a WAL whose frames
            // all count as copied would start it over, overwriting those pages' only copy on the disk.
            log::warn!(
                "{}: the bytes-written counters since their last save are not saved at close, after a failed \
                 sync of the database file",
                self.path.display()
            );
        } else {
            self.wear.save_on_close(self);
        }
        // SAFETY: the statements are dropped exactly once, here, and before the connection they borrow;
        // `conn` came from `Box::into_raw` in `Db::new` and is freed exactly once.
        unsafe {
            ManuallyDrop::drop(&mut self.hot);
            drop(Box::from_raw(self.conn.as_ptr()));
        }
    }
}

impl Deref for Db {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        // SAFETY: valid from `Db::new` until `Drop`; only shared references are ever made from it.
        unsafe { self.conn.as_ref() }
    }
}

/// A `synchronous` level no connection is at: the next transaction sets the level it needs and reads it back.
const UNKNOWN_LEVEL: i64 = -1;

impl Db {
    /// Takes an opened connection with the current schema, at `synchronous` level `durable`, and prepares
    /// the hot statements on it.
    pub(crate) fn new(conn: Connection, durable: i64) -> rusqlite::Result<Db> {
        // Learned now, from the files the connection has just opened (it read the database, so its WAL is open).
        let files = conn
            .path()
            .filter(|p| !p.is_empty())
            .map(|p| Files::at_open(std::path::Path::new(p)));
        let path = files.as_ref().map(|f| f.db.clone()).unwrap_or_default();
        let wal_watch = files.as_ref().map(|f| WalWatch::new(&f.db));
        let conn = NonNull::from(Box::leak(Box::new(conn)));
        // SAFETY: the allocation lives until `Drop`, which releases every statement first; no `'static`
        // statement or reference is ever handed out of this module.
        let c: &'static Connection = unsafe { &*conn.as_ptr() };
        let prepared = Self::prepare(c);
        let guard = Arc::new(HandlerGuard::default());
        guard.install(c);
        let waiter = match (&prepared, &files) {
            (Ok(_), Some(f)) => spawn_waiter(c, f, &guard),
            _ => None,
        };
        match prepared {
            Ok(hot) => Ok(Db {
                hot: ManuallyDrop::new(hot),
                conn,
                durable,
                current: Cell::new(durable),
                relaxed: Cell::new(false),
                settings_suspect: Cell::new(false),
                outbox: Default::default(),
                wal_id: Cell::new(files.as_ref().and_then(|f| f.wal_id)),
                files,
                wal_watch,
                waiter,
                path,
                slow_commit: None,
                last_commit: Cell::new(std::time::Duration::ZERO),
                guard,
                id_key: crate::store::identity::IdKey::UNKEYED,
                clock_seen: Cell::new(0),
                wear: Box::default(),
                checkpointer: None,
            }),
            Err(e) => {
                // SAFETY: no statement borrows the connection any more (`prepare` failed and dropped them).
                unsafe { drop(Box::from_raw(conn.as_ptr())) };
                Err(e)
            }
        }
    }

    fn prepare(c: &'static Connection) -> rusqlite::Result<Hot> {
        // A savepoint name no handler can guess: a handler running `ROLLBACK TO` on it through `Tx::sql`
        // would undo the identity insert and let the batch commit the effect twice.
        let sp = format!("edge_inbox_{:016x}", savepoint_salt(c));
        let p = |sql: &str| c.prepare(sql).map(RefCell::new);
        Ok(Hot {
            begin: p("BEGIN IMMEDIATE")?,
            commit: p("COMMIT")?,
            savepoint: p(&format!("SAVEPOINT {sp}"))?,
            release: p(&format!("RELEASE {sp}"))?,
            rollback_to: p(&format!("ROLLBACK TO {sp}"))?,
            insert_identity: p(
                "INSERT INTO identities (scope_id, id_hash, fingerprint, day) VALUES (?1, ?2, ?3, ?4) \
                 ON CONFLICT (scope_id, id_hash) DO NOTHING",
            )?,
            stored_fingerprint: p(
                "SELECT fingerprint FROM identities WHERE scope_id = ?1 AND id_hash = ?2",
            )?,
            add_counts: p(
                "UPDATE scope_stats SET processed = processed + ?2, duplicates = duplicates + ?3, \
                 conflicts = conflicts + ?4, handler_failures = handler_failures + ?5 WHERE scope_id = ?1",
            )?,
            data_version: p("PRAGMA data_version")?,
            kv_get: p("SELECT value FROM kv WHERE ns = ?1 AND key = ?2")?,
            kv_put: p(
                "INSERT INTO kv (ns, key, value) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (ns, key) DO UPDATE SET value = excluded.value",
            )?,
            kv_delete: p("DELETE FROM kv WHERE ns = ?1 AND key = ?2")?,
        })
    }

    /// Until [`Db::end_relaxed`], transactions started with [`crate::store::txn::begin`] commit without their own
    /// fsync (`synchronous=NORMAL`): for internal work whose loss on power failure is harmless.
    pub(crate) fn start_relaxed(&self) {
        self.relaxed.set(true);
    }

    /// Puts the connection back at the configured level and reads it back. Should that fail, the next
    /// [`crate::store::txn::begin`] tries again before anything is committed.
    pub(crate) fn end_relaxed(&self) -> Result<()> {
        self.relaxed.set(false);
        self.prepare_level()
    }

    /// Puts the connection at the level the next transaction needs; called outside any transaction (SQLite
    /// ignores the pragma inside one). Going back to the durable level is read back, never assumed.
    pub(crate) fn prepare_level(&self) -> Result<()> {
        let want = if self.relaxed.get() {
            self.durable.min(1)
        } else {
            self.durable
        };
        if self.current.get() == want {
            return Ok(());
        }
        self.execute_batch(&format!("PRAGMA synchronous = {want}"))?;
        let got: i64 = self.query_row("PRAGMA synchronous", [], |r| r.get(0))?;
        if got != want {
            return Err(Error::Setting {
                wanted: format!("synchronous={want}"),
                got: got.to_string(),
            });
        }
        self.current.set(want);
        Ok(())
    }
}

/// Differs between connections and processes, so the savepoint name is not a constant anyone could use.
fn savepoint_salt(c: &Connection) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut seed = [0u8; 24];
    seed[..8].copy_from_slice(&nanos.to_le_bytes());
    seed[8..16].copy_from_slice(&(std::process::id() as u64).to_le_bytes());
    seed[16..].copy_from_slice(&(c as *const Connection as usize as u64).to_le_bytes());
    xxhash_rust::xxh3::xxh3_64(&seed)
}

impl Db {
    /// Refuses every commit on this connection until the returned value is dropped, and starts noting
    /// whether the open transaction ends. For the span of one handler call, inside the inbox's transaction.
    pub(crate) fn arm_handler_guard(&self) -> Armed<'_> {
        // The application may have replaced the hooks since (they are reserved, but nothing stops it).
        self.guard.install(self);
        self.guard.ended.store(false, Ordering::SeqCst);
        self.guard.active.store(true, Ordering::SeqCst);
        Armed(&self.guard)
    }

    /// After a handler ran: puts the guard's hooks back if the handler replaced them, and says whether it
    /// did (then nothing can vouch that none of its statements committed on its own).
    pub(crate) fn handler_replaced_guard(&self) -> bool {
        !self.guard.install(self)
    }

    /// True when the transaction the armed handler runs in is gone (rolled back by SQLite or by the handler,
    /// or committed by the handler), even if a new one was opened since.
    pub(crate) fn handler_tx_ended(&self) -> bool {
        self.guard.ended.load(Ordering::SeqCst) || self.is_autocommit()
    }

    /// A handler got outside the inbox's transaction, or the application was handed the connection: out of a
    /// transaction, `PRAGMA synchronous` and `PRAGMA journal_mode` take effect, and either could have been
    /// lowered for every later commit.
    /// The next transaction sets and reads back both before it begins.
    pub(crate) fn distrust_settings(&self) {
        self.settings_suspect.set(true);
        self.current.set(UNKNOWN_LEVEL);
    }

    /// After [`Db::distrust_settings`]: the journal back in WAL mode, read back (the `synchronous` level is
    /// set again by [`Db::prepare_level`]). Called outside any transaction.
    pub(crate) fn recheck_settings(&self) -> Result<()> {
        if !self.settings_suspect.get() {
            return Ok(());
        }
        let mode: String = self.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            log::error!(
                "the connection's journal mode was changed to {mode} (by a handler, or through \
                 Inbox::connection); back to WAL"
            );
            let mode: String = self.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
            if !mode.eq_ignore_ascii_case("wal") {
                return Err(Error::Setting {
                    wanted: "journal_mode=wal".into(),
                    got: mode,
                });
            }
        }
        self.settings_suspect.set(false);
        Ok(())
    }

    /// `BEGIN IMMEDIATE`, once the checkpoint thread's catch-up a commit of this connection asked for has
    /// ended: nothing this connection writes may land in the WAL while it copies the end of it.
    pub(crate) fn begin_immediate(&self) -> rusqlite::Result<()> {
        self.wear.await_catch_up();
        self.hot.begin.borrow_mut().execute([]).map(drop)
    }

    /// Which of the database file and its WAL is gone from its path (deleted, renamed away, replaced) while
    /// this connection has it open. Frames committed since then live only in the unlinked file and vanish if
    /// the process dies. Two `stat`s only when the directory watch says a path may have changed (always,
    /// without a watch), and once a second as a backstop; `Database` at once if that is already known.
    pub(crate) fn moved(&self) -> Moved {
        let Some(files) = &self.files else {
            return Moved::Neither;
        };
        if self.guard.gone.load(Ordering::SeqCst) {
            return Moved::Database;
        }
        let known = self.wal_id.get().is_some();
        if known && !self.wal_watch.as_ref().is_none_or(WalWatch::maybe_changed) {
            return Moved::Neither;
        }
        if !known {
            if let Some(id) = crate::store::files::file_id(&files.wal) {
                self.wal_id.set(Some(id));
            }
        }
        files.check(self.wal_id.get())
    }

    /// True when the database file is gone from its path (a `stat`, or already known).
    pub(crate) fn database_moved(&self) -> bool {
        self.guard.gone.load(Ordering::SeqCst)
            || self
                .files
                .as_ref()
                .is_some_and(|f| f.check(self.wal_id.get()) == Moved::Database)
    }

    /// Records that the database file is gone from its path (see [`Moved::Database`]): every later commit is
    /// refused, also of the application's own statements, and the connection leaves the files now at the path
    /// alone when it closes. Returns the error to report.
    pub(crate) fn database_gone(&self) -> Error {
        // The application may have replaced the hook that refuses the commits.
        self.guard.install(self);
        // SAFETY: this connection's handle, on its own thread.
        unsafe { self.guard.note_gone(self.handle(), &self.path) };
        Error::DatabaseGone {
            path: self.path.clone(),
        }
    }

    /// Storage trouble, when a failed sync of the database file has kept the WAL from starting over until it
    /// reached its cap (`UNSYNCED_WAL_CAP`): the inbox must be opened again. Logged once.
    pub(crate) fn unsynced_wal_full(&self) -> Option<Error> {
        if !self.checkpointer.as_ref()?.unsynced_wal_full() {
            return None;
        }
        if !self.guard.wal_full_reported.swap(true, Ordering::SeqCst) {
            log::error!(
                "{}: after a failed sync of the database file the WAL can no longer start over, and it has \
                 reached its cap: nothing more is committed or acked until the inbox is opened again (which \
                 copies the WAL back with working syncs)",
                self.path.display()
            );
        }
        Some(storage_error(rusqlite::ffi::SQLITE_IOERR_FSYNC))
    }

    /// The error every write reports once the database file is known to be gone, if it is.
    pub(crate) fn gone(&self) -> Option<Error> {
        self.guard
            .gone
            .load(Ordering::SeqCst)
            .then(|| self.database_gone())
    }

    /// A sync of this connection's WAL failed (a COMMIT's, a checkpoint's, or the pruner's after its step).
    /// Linux reports a failed write-back once per file descriptor and marks the pages clean, so the next sync
    /// on it succeeds although frames that were committed before may never have reached the disk; a commit
    /// appended after them and acked would be lost with them at a power cut, as recovery stops at the first
    /// bad frame (and a checkpoint that copied the later frames into the database file would leave it torn
    /// between the two). So every commit on this connection is refused until [`Db::recover_unsynced_wal`]
    /// has written the WAL out again.
    pub(crate) fn note_wal_sync_failed(&self, code: i32) {
        // The application may have replaced the hook that refuses the commits.
        self.guard.install(self);
        if let Some(c) = &self.checkpointer {
            c.hold(true);
        }
        if !self.guard.unsynced.swap(true, Ordering::SeqCst) {
            log::error!(
                "a sync of the WAL of {} failed (SQLite code {code}): frames committed before it may not be on \
                 the disk, so no commit is made on this connection until the WAL has been written out again",
                self.path.display()
            );
        }
    }

    /// [`Db::note_wal_sync_failed`] when `code` (an extended result code) is an I/O error: whatever its
    /// extended code names, it may have been a sync of the WAL.
    pub(crate) fn note_if_io_error(&self, code: i32) {
        if code & 0xff == rusqlite::ffi::SQLITE_IOERR {
            self.note_wal_sync_failed(code);
        }
    }

    /// [`Db::note_wal_sync_failed`] for an I/O error a checkpoint met since the last call: one on this
    /// connection (a commit's automatic checkpoint, the pruner's) or on the inbox's checkpoint thread. Their
    /// syncs of the WAL may have taken the report of a failed write-back. Returns the thread's error, if it
    /// had one: its sync runs beside this connection's transactions.
    pub(crate) fn note_checkpoint_io_errors(&self) -> Option<i32> {
        let own = self.wear.take_io_error();
        let thread = self.checkpointer.as_ref().and_then(|c| c.take_io_error());
        if let Some(code) = own.or(thread) {
            self.note_wal_sync_failed(code);
        }
        thread
    }

    /// Whether a failed sync left the WAL to be written out again ([`Db::note_wal_sync_failed`]): no commit,
    /// and no checkpoint, until then.
    pub(crate) fn wal_unsynced(&self) -> bool {
        self.guard.unsynced.load(Ordering::SeqCst)
    }

    /// After [`Db::note_wal_sync_failed`], first thing in a write transaction (so nobody appends meanwhile):
    /// writes the whole WAL file again from what it holds (the page cache, where the failed write-back left
    /// the committed frames) and syncs it, so the disk holds every committed frame again. Until that
    /// succeeds, the error it met (retryable I/O): the caller rolls back, nothing is committed or acked.
    ///
    /// What it cannot undo: pages of the failed write-back that the kernel evicted before this runs come
    /// back from the disk as they are there; the WAL's checksums then end recovery at them after a crash,
    /// as they would have anyway.
    pub(crate) fn recover_unsynced_wal(&self) -> Result<()> {
        let _ = self.note_checkpoint_io_errors();
        if !self.wal_unsynced() {
            return Ok(());
        }
        let bytes = crate::store::wal_sync::rewrite_wal(self)?;
        self.guard.unsynced.store(false, Ordering::SeqCst);
        if let Some(c) = &self.checkpointer {
            c.hold(false);
        }
        log::warn!(
            "the WAL of {} was written out again after a failed sync ({bytes} bytes); commits resume",
            self.path.display()
        );
        Ok(())
    }

    /// Outside a transaction: if a failed sync flagged the connection, writes the WAL out again now
    /// ([`Db::recover_unsynced_wal`]), in a write transaction of its own that is then rolled back (it is
    /// what makes a checkpoint safe again). Its error when that fails.
    pub(crate) fn write_out_unsynced_wal(&self) -> Result<()> {
        if !self.wal_unsynced() {
            return Ok(());
        }
        self.begin_immediate()?;
        let result = self.recover_unsynced_wal();
        let _ = self.execute_batch("ROLLBACK");
        result
    }

    /// Before closing: if this connection may be the last, SQLite copies the WAL into the database file as it
    /// closes. After a failed sync that copy would put frames the disk may lack into the database file, torn
    /// from the WAL that recovery replays after a power cut. So the WAL is written out again first (in a
    /// transaction of its own, rolled back); if that fails too, the connection closes without the copy and
    /// leaves the WAL as it is. (The flag lives in this connection only: a process that opens the file
    /// again while the disk still lacks those frames cannot know it; not covered.)
    fn close_after_failed_sync(&self) {
        if !self.wal_unsynced() {
            return;
        }
        // Closing: a short wait for the write lock, not the configured busy timeout.
        let _ = self.busy_timeout(std::time::Duration::from_millis(100));
        if !self.is_autocommit() {
            let _ = self.execute_batch("ROLLBACK");
        }
        if self.write_out_unsynced_wal().is_err() {
            let _ = self.set_db_config(
                rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
                true,
            );
            log::error!(
                "closing {} after a failed sync of its WAL that could not be written out again: closed without \
                 the final checkpoint, the WAL left as it is; frames of it may be missing on the disk, which a \
                 connection that opens the file before the disk has them cannot tell",
                self.path.display()
            );
        }
    }

    /// The connection's own WAL is gone from its path: on close, leave whatever is there now alone.
    pub(crate) fn keep_wal_on_close(&self) {
        // SAFETY: this connection's handle, on its own thread.
        unsafe { crate::store::files::keep_wal_on_close(self.handle()) };
    }

    pub(crate) fn commit_raw(&self) -> rusqlite::Result<()> {
        self.hot.commit.borrow_mut().execute([]).map(drop)
    }

    pub(crate) fn savepoint(&self) -> rusqlite::Result<()> {
        self.hot.savepoint.borrow_mut().execute([]).map(drop)
    }

    pub(crate) fn release(&self) -> rusqlite::Result<()> {
        self.hot.release.borrow_mut().execute([]).map(drop)
    }

    pub(crate) fn rollback_to(&self) -> rusqlite::Result<()> {
        self.hot.rollback_to.borrow_mut().execute([]).map(drop)
    }

    pub(crate) fn insert_identity(
        &self,
        scope_id: i64,
        id_hash: &[u8],
        fingerprint: i64,
        day: i64,
    ) -> rusqlite::Result<usize> {
        self.hot
            .insert_identity
            .borrow_mut()
            .execute((scope_id, id_hash, fingerprint, day))
    }

    pub(crate) fn stored_fingerprint(
        &self,
        scope_id: i64,
        id_hash: &[u8],
    ) -> rusqlite::Result<i64> {
        self.hot
            .stored_fingerprint
            .borrow_mut()
            .query_row((scope_id, id_hash), |r| r.get(0))
    }

    pub(crate) fn add_counts(&self, scope_id: i64, counts: [i64; 4]) -> rusqlite::Result<()> {
        let [processed, duplicates, conflicts, failures] = counts;
        self.hot
            .add_counts
            .borrow_mut()
            .execute((scope_id, processed, duplicates, conflicts, failures))
            .map(drop)
    }

    /// `PRAGMA data_version`: changes when another connection commits.
    pub(crate) fn data_version(&self) -> rusqlite::Result<i64> {
        self.hot
            .data_version
            .borrow_mut()
            .query_row([], |r| r.get(0))
    }

    /// Runs `f` on the stored value of `ns`/`key`, if any, without copying it.
    pub(crate) fn kv_get<T>(
        &self,
        ns: &str,
        key: &str,
        f: impl FnOnce(&[u8]) -> T,
    ) -> rusqlite::Result<Option<T>> {
        self.hot
            .kv_get
            .borrow_mut()
            .query_row((ns, key), |row| Ok(f(row.get_ref(0)?.as_blob()?)))
            .optional()
    }

    pub(crate) fn kv_put(&self, ns: &str, key: &str, value: &[u8]) -> rusqlite::Result<()> {
        self.hot
            .kv_put
            .borrow_mut()
            .execute((ns, key, value))
            .map(drop)
    }

    pub(crate) fn kv_delete(&self, ns: &str, key: &str) -> rusqlite::Result<bool> {
        self.hot
            .kv_delete
            .borrow_mut()
            .execute((ns, key))
            .map(|n| n > 0)
    }
}
