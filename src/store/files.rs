//! Whether the database file and its WAL are still the files at their paths.
//!
//! A connection keeps writing into the files it opened, whatever happens to their names. If the database file
//! is deleted, renamed away or replaced (`rm inbox.db*`), everything committed from then on lives in a file
//! without that name and is lost when the connection closes: nothing can be made durable any more. If only the
//! WAL is, its frames can still be copied into the database file by a checkpoint. The identities (device,
//! inode) are learned when the connection opens and compared with what the paths name now.

use std::path::{Path, PathBuf};

/// (device, inode) of a file.
pub(crate) type FileId = (u64, u64);

/// What a path names now, if anything (a symbolic link is not followed: it is not the file).
pub(crate) fn file_id(path: &Path) -> Option<FileId> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// Which file is no longer at its path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Moved {
    Neither,
    /// The WAL (deleted or replaced); the database file is in place.
    Wal,
    /// The database file (its WAL may be gone too).
    Database,
}

/// The paths of a database file and its WAL, with the identities they had when the connection opened.
#[derive(Clone, Debug)]
pub(crate) struct Files {
    pub(crate) db: PathBuf,
    pub(crate) wal: PathBuf,
    /// `None` only if the file could not be looked at when the connection opened; then it is not checked.
    pub(crate) db_id: Option<FileId>,
    pub(crate) wal_id: Option<FileId>,
}

impl Files {
    /// Learns the identities of the database file at `db` and its WAL, which the connection has just opened.
    pub(crate) fn at_open(db: &Path) -> Files {
        let mut wal = db.as_os_str().to_owned();
        wal.push("-wal");
        let wal = PathBuf::from(wal);
        Files {
            db_id: file_id(db),
            wal_id: file_id(&wal),
            db: db.to_owned(),
            wal,
        }
    }

    /// Two `stat`s: which file, if any, is no longer the one opened. `wal_id` is the WAL's known identity
    /// (`None`: not known, then only its absence counts).
    pub(crate) fn check(&self, wal_id: Option<FileId>) -> Moved {
        if self.db_id.is_some() && file_id(&self.db) != self.db_id {
            return Moved::Database;
        }
        match (file_id(&self.wal), wal_id) {
            (None, _) => Moved::Wal,
            (Some(now), Some(ours)) if now != ours => Moved::Wal,
            _ => Moved::Neither,
        }
    }
}

/// Makes the connection leave the WAL and shared-memory files at their paths when it closes. SQLite's last
/// connection to a database deletes `-wal` and `-shm` by name on close; once its own files are gone from those
/// names, the files there belong to another connection (a new database at the same path), which must keep them.
///
/// # Safety
/// `db` is an open connection's handle, used from this thread or opened in serialized mode.
pub(crate) unsafe fn keep_wal_on_close(db: *mut rusqlite::ffi::sqlite3) {
    let mut on: std::ffi::c_int = 1;
    // SAFETY: per the caller; the argument is the `int` this opcode reads.
    unsafe {
        rusqlite::ffi::sqlite3_file_control(
            db,
            c"main".as_ptr(),
            rusqlite::ffi::SQLITE_FCNTL_PERSIST_WAL,
            (&mut on as *mut std::ffi::c_int).cast(),
        );
    }
}
