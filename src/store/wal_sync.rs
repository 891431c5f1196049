//! Syncing a connection's WAL outside any transaction: a pruner that committed a step without a sync makes
//! its own frames durable after it released the write lock, so that the next commit at `synchronous=FULL`
//! on another connection (whose fsync of the same file would flush them too) has only its own to flush.
//!
//! Through SQLite's own handle of the WAL (`SQLITE_FCNTL_JOURNAL_POINTER`), so every VFS the connection was
//! opened with (a wrapping one, a simulated card) sees the sync as it sees SQLite's own.

use std::ffi::c_void;
use std::ptr;

use rusqlite::{ffi, Connection};

use crate::store::error::{storage_error, Result};

/// Pages this connection's pager has written so far (to the WAL, in WAL mode; wrapping at 2^32): the WAL
/// got new frames between two reads that differ.
pub(crate) fn pages_written(conn: &Connection) -> u32 {
    // SAFETY: this open connection's handle.
    pages_written_by(unsafe { conn.handle() })
}

/// [`pages_written`] from a raw handle (SQLite's WAL hook has no `Connection`): a field read, no system call.
pub(crate) fn pages_written_by(db: *mut ffi::sqlite3) -> u32 {
    let (mut cur, mut high) = (0, 0);
    // SAFETY: a valid open handle; the out-pointers are locals.
    unsafe { ffi::sqlite3_db_status(db, ffi::SQLITE_DBSTATUS_CACHE_WRITE, &mut cur, &mut high, 0) };
    cur as u32
}

/// Syncs the WAL of the main database as SQLite's commit at `synchronous=FULL` would (`xSync` with the
/// flags `PRAGMA fullfsync` selects), outside any transaction of this connection: it holds no lock while
/// it waits for the disk, so other connections read and write meanwhile, and their frames appended during
/// the sync are simply not covered by it. Returns whether it synced: `false` when this connection has no
/// WAL open (none written or read yet).
///
/// Call it on the connection's own thread, with no statement running on it: the handle is SQLite's and
/// only this connection uses it; between transactions SQLite itself does nothing with it.
pub(crate) fn sync_wal(conn: &Connection) -> Result<bool> {
    debug_assert!(
        conn.is_autocommit(),
        "the WAL is synced between transactions"
    );
    let full: bool = conn
        .prepare_cached("PRAGMA fullfsync")?
        .query_row([], |r| r.get(0))?;
    let mut file: *mut ffi::sqlite3_file = ptr::null_mut();
    // SAFETY: this open connection's handle and a schema name; SQLite writes one pointer into `file`.
    let rc = unsafe {
        ffi::sqlite3_file_control(
            conn.handle(),
            c"main".as_ptr(),
            ffi::SQLITE_FCNTL_JOURNAL_POINTER,
            &mut file as *mut *mut ffi::sqlite3_file as *mut c_void,
        )
    };
    // Without a WAL open the pager hands out its rollback journal's handle, closed in WAL mode (no methods).
    // SAFETY: `file` is null or the pager's journal handle, alive while the connection is open.
    if rc != ffi::SQLITE_OK || file.is_null() || unsafe { (*file).pMethods.is_null() } {
        return Ok(false);
    }
    // SAFETY: an open file's methods, from its VFS.
    let Some(x_sync) = (unsafe { (*(*file).pMethods).xSync }) else {
        return Ok(false);
    };
    let flags = if full {
        ffi::SQLITE_SYNC_FULL
    } else {
        ffi::SQLITE_SYNC_NORMAL
    };
    // SAFETY: the open WAL handle, used on the connection's thread outside any statement (see above).
    match unsafe { x_sync(file, flags) } {
        ffi::SQLITE_OK => Ok(true),
        // The step committed, but its frames may not be on the disk: a storage error, never ignored.
        rc => Err(storage_error(rc)),
    }
}
