//! Transaction primitives every write path shares: start, commit (its failure classified), savepoint release,
//! and the wall clock.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::store::db::Db;
use crate::store::error::{extended_code, Error, Result};
use crate::store::files::Moved;

pub(crate) fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Starts a write transaction: rolls back one left open by an interrupted call (a handler that panicked),
/// refuses if the database file is known to be gone from its path ([`Error::DatabaseGone`]), puts the
/// connection at the durability this transaction needs, then `BEGIN IMMEDIATE`, and after a failed sync first
/// writes the WAL out again ([`Db::recover_unsynced_wal`]).
pub(crate) fn begin(conn: &Db) -> Result<()> {
    if !conn.is_autocommit() {
        log::warn!(
            "rolling back a transaction left open on the inbox's connection (by an earlier, interrupted \
             call, or begun through Inbox::connection and not ended)"
        );
        conn.execute_batch("ROLLBACK")?;
    }
    if let Some(gone) = conn.gone() {
        return Err(gone);
    }
    if let Some(full) = conn.unsynced_wal_full() {
        return Err(full);
    }
    conn.recheck_settings()?;
    conn.prepare_level()?;
    conn.begin_immediate()?;
    if let Err(e) = conn.recover_unsynced_wal() {
        let _ = conn.execute_batch("ROLLBACK");
        return Err(e);
    }
    Ok(())
}

/// Runs `f` in one write transaction: [`begin`], `f`, [`commit`]; rolled back when `f` or the commit fails.
pub(crate) fn write<T>(conn: &Db, f: impl FnOnce() -> Result<T>) -> Result<T> {
    begin(conn)?;
    let result = f().and_then(|v| commit(conn).map(|()| v));
    if result.is_err() && !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    result
}

/// `COMMIT`, its failure classified by the extended result code: a refused constraint, a busy database or a
/// full disk leave nothing committed; any other failure (I/O above all) leaves the outcome unknown. A commit
/// into a database file that is no longer at its path is [`Error::DatabaseGone`]: it can never be durable.
pub(crate) fn commit(conn: &Db) -> Result<()> {
    let started = std::time::Instant::now();
    let staged = conn.wear.stage(conn);
    conn.commit_raw().map_err(|e| {
        let code = extended_code(&e).unwrap_or(-1);
        match code & 0xff {
            rusqlite::ffi::SQLITE_CONSTRAINT => Error::CommitRefused { code, source: e },
            rusqlite::ffi::SQLITE_BUSY | rusqlite::ffi::SQLITE_LOCKED | rusqlite::ffi::SQLITE_FULL => Error::from(e),
            _ => {
                log::warn!(
                    "COMMIT failed with SQLite code {code}: outcome unknown until the identity is looked up"
                );
                // An I/O error may have been the WAL's sync, whatever its extended code says.
                conn.note_if_io_error(code);
                Error::CommitUnknown { code, source: e }
            }
        }
    })?;
    if let Some(staged) = staged {
        conn.wear.saved(staged);
    }
    // A checkpoint (this commit's automatic one, after its sync, or the inbox's thread's) met an I/O error.
    // The thread's sync may have run during this transaction and taken the report of a failed write-back
    // of this commit's own frames, so that its sync succeeded without them: not durable for certain.
    if let Some(code) = conn.note_checkpoint_io_errors() {
        return Err(Error::CommitUnknown {
            code,
            source: rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(code),
                Some(
                    "the checkpoint thread's sync of the WAL failed during this commit".to_owned(),
                ),
            ),
        });
    }
    let took = started.elapsed();
    conn.last_commit.set(took);
    if let Some(threshold) = conn.slow_commit {
        if took >= threshold {
            log::warn!("slow commit: COMMIT took {took:?} (warning threshold {threshold:?})");
        }
    }
    match conn.moved() {
        Moved::Neither => Ok(()),
        Moved::Wal => rescue_unlinked_wal(conn),
        Moved::Database => Err(conn.database_gone()),
    }
}

/// How long the rescue retries a checkpoint that found the checkpoint lock taken.
const RESCUE_BUSY_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The WAL was deleted while open: the commit just made (and every frame not yet checkpointed) is only in the
/// unlinked file, which a crash would take with it. Copy it all into the database file (a FULL checkpoint,
/// fsynced) before reporting success; if that cannot be done, the outcome is not durable: `CommitUnknown`.
/// Unless the database file has gone from its path too: then nothing can be durable (`DatabaseGone`).
#[cold]
fn rescue_unlinked_wal(conn: &Db) -> Result<()> {
    // Closing must not delete by name the WAL and index another connection may have created there since.
    conn.keep_wal_on_close();
    let unknown = |code: i32, why: &str| Error::CommitUnknown {
        code,
        source: rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(code),
            Some(why.to_owned()),
        ),
    };
    let checkpoint = || {
        conn.query_row("PRAGMA wal_checkpoint(FULL)", [], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, i64>(2)?,
            ))
        })
    };
    // The inbox's checkpoint thread may hold the checkpoint lock for its own copy (SQLite then answers BUSY
    // at once, without the busy handler): that copy ends within a few syncs.
    let deadline = std::time::Instant::now() + RESCUE_BUSY_WAIT;
    let mut result = checkpoint();
    while matches!(result, Ok((1, _, _))) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
        result = checkpoint();
    }
    match result {
        Ok((0, log, done)) if log == done => {
            if conn.database_moved() {
                return Err(conn.database_gone());
            }
            log::error!(
                "the WAL file was deleted while the inbox was open: committed frames were checkpointed into the \
                 database file; reopen the inbox to get a new WAL"
            );
            Ok(())
        }
        Ok(_) => Err(unknown(
            rusqlite::ffi::SQLITE_BUSY,
            "the WAL file was deleted and the rescue checkpoint could not complete",
        )),
        Err(e) => {
            let code = extended_code(&e).unwrap_or(rusqlite::ffi::SQLITE_IOERR);
            log::error!(
                "the WAL file was deleted and the rescue checkpoint failed (SQLite code {code})"
            );
            Err(Error::CommitUnknown { code, source: e })
        }
    }
}

pub(crate) fn release(conn: &Db) -> Result<()> {
    conn.release()?;
    Ok(())
}

/// Wall-clock Unix milliseconds: leases and backoff need sub-second precision.
pub(crate) fn unix_now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
