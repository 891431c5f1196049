//! Syncing a connection's WAL outside any transaction: a pruner that committed a step without a sync makes
//! its own frames durable after it released the write lock, so that the next commit at `synchronous=FULL`
//! on another connection (whose fsync of the same file would flush them too) has only its own to flush.
//!
//! Through SQLite's own handle of the WAL (`SQLITE_FCNTL_JOURNAL_POINTER`), so every VFS the connection was
//! opened with (a wrapping one, a simulated card) sees the sync as it sees SQLite's own.

use std::ffi::{c_int, c_void};
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

/// The handle SQLite holds on a file of the main database (`op`: `SQLITE_FCNTL_JOURNAL_POINTER` for the
/// WAL, `SQLITE_FCNTL_FILE_POINTER` for the database file), `None` when this connection has none open.
fn file_handle(conn: &Connection, op: c_int) -> Option<*mut ffi::sqlite3_file> {
    let mut file: *mut ffi::sqlite3_file = ptr::null_mut();
    // SAFETY: this open connection's handle and a schema name; SQLite writes one pointer into `file`.
    let rc = unsafe {
        ffi::sqlite3_file_control(
            conn.handle(),
            c"main".as_ptr(),
            op,
            &mut file as *mut *mut ffi::sqlite3_file as *mut c_void,
        )
    };
    // Without a WAL open the pager hands out its rollback journal's handle, closed in WAL mode (no methods).
    // SAFETY: `file` is null or one of the pager's handles, alive while the connection is open.
    if rc != ffi::SQLITE_OK || file.is_null() || unsafe { (*file).pMethods.is_null() } {
        return None;
    }
    Some(file)
}

/// The handle SQLite holds on the WAL of the main database, `None` when this connection has none open (no
/// transaction has read or written it yet).
fn wal_file(conn: &Connection) -> Option<*mut ffi::sqlite3_file> {
    file_handle(conn, ffi::SQLITE_FCNTL_JOURNAL_POINTER)
}

/// The sync flags SQLite's commit at `synchronous=FULL` would use (`PRAGMA fullfsync`).
fn sync_flags(conn: &Connection) -> Result<c_int> {
    let full: bool = conn
        .prepare_cached("PRAGMA fullfsync")?
        .query_row([], |r| r.get(0))?;
    Ok(if full {
        ffi::SQLITE_SYNC_FULL
    } else {
        ffi::SQLITE_SYNC_NORMAL
    })
}

/// `xSync` of the open WAL `file`.
///
/// # Safety
/// `file` comes from [`wal_file`] on this open connection, used on its own thread with no statement running.
unsafe fn sync_file(file: *mut ffi::sqlite3_file, flags: c_int) -> Result<()> {
    // SAFETY: an open file's methods, from its VFS (per the caller).
    match unsafe { (*(*file).pMethods).xSync } {
        // SAFETY: per the caller.
        Some(x_sync) => match unsafe { x_sync(file, flags) } {
            ffi::SQLITE_OK => Ok(()),
            rc => Err(storage_error(rc)),
        },
        None => Ok(()),
    }
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
    let flags = sync_flags(conn)?;
    let Some(file) = wal_file(conn) else {
        return Ok(false);
    };
    // SAFETY: the open WAL handle, used on the connection's thread outside any statement (see above).
    // The step committed, but its frames may not be on the disk: a storage error, never ignored.
    unsafe { sync_file(file, flags) }.map(|()| true)
}

/// Writes the whole WAL file again, the bytes it holds, then syncs it: after a failed write-back, whose pages
/// the kernel marked clean, this is what puts them on the disk (their content comes back from the page cache;
/// a later sync alone would not write them). Inside a write transaction of this connection, so that nobody
/// appends meanwhile; SQLite's own state is untouched, as the bytes are the same. Returns the bytes written.
///
/// Call it on the connection's own thread, with no statement running on it.
pub(crate) fn rewrite_wal(conn: &Connection) -> Result<u64> {
    debug_assert!(
        !conn.is_autocommit(),
        "the WAL is rewritten under the write lock"
    );
    let flags = sync_flags(conn)?;
    // Under the write lock in WAL mode the WAL is open: without it, nothing could be written out again.
    let missing = || storage_error(ffi::SQLITE_IOERR);
    let file = wal_file(conn).ok_or_else(missing)?;
    // SAFETY: an open file's methods, from its VFS; the handle is used on the connection's thread, between
    // statements, while this connection holds the write lock (no one else writes the WAL).
    let methods = unsafe { &*(*file).pMethods };
    let (Some(x_size), Some(x_read), Some(x_write)) =
        (methods.xFileSize, methods.xRead, methods.xWrite)
    else {
        return Err(missing());
    };
    let mut size: i64 = 0;
    // SAFETY: as above; `size` is a local.
    let rc = unsafe { x_size(file, &mut size) };
    if rc != ffi::SQLITE_OK {
        return Err(storage_error(rc));
    }
    let mut buf = vec![0u8; 64 << 10];
    let mut off: i64 = 0;
    while off < size {
        let n = (size - off).min(buf.len() as i64) as c_int;
        let p = buf.as_mut_ptr() as *mut c_void;
        // SAFETY: as above; `buf` holds at least `n` bytes.
        let rc = unsafe { x_read(file, p, n, off) };
        if rc != ffi::SQLITE_OK {
            return Err(storage_error(rc));
        }
        // SAFETY: as above.
        let rc = unsafe { x_write(file, p, n, off) };
        if rc != ffi::SQLITE_OK {
            return Err(storage_error(rc));
        }
        off += i64::from(n);
    }
    // SAFETY: as above.
    unsafe { sync_file(file, flags) }?;
    Ok(size as u64)
}

/// Syncs the main database file through SQLite's own handle of it (`SQLITE_FCNTL_FILE_POINTER`), with the
/// flags SQLite's checkpoint would use: after a checkpoint that copied pages into it without a sync
/// (`store/checkpointer.rs`). Outside any statement of this connection, on its own thread.
pub(crate) fn sync_database(conn: &Connection) -> Result<()> {
    let flags = sync_flags(conn)?;
    let file = file_handle(conn, ffi::SQLITE_FCNTL_FILE_POINTER)
        .ok_or_else(|| storage_error(ffi::SQLITE_IOERR))?;
    // SAFETY: the open database file's handle, used on the connection's thread outside any statement.
    unsafe { sync_file(file, flags) }
}
