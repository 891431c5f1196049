//! An SQLite VFS that wraps the platform's and reports every write, truncation, sync and deletion of the
//! database, WAL and journal files to a [`Disk`]. Data goes through to the real files (so the running inbox
//! reads what it wrote); `xSync` is answered by the model alone: the real fsync would only cost time, since
//! what is durable is decided by the model.

use std::ffi::c_int;
use std::sync::Arc;

use edge_inbox::rusqlite::ffi;

use super::disk::Disk;

#[path = "../../examples/support/wrap_vfs.rs"]
mod wrap_vfs;

/// Reports the database, WAL and journal files to the disk model; temporary files, which no cut needs, are
/// left unobserved.
struct Model(Arc<Disk>);

impl wrap_vfs::Observer for Model {
    fn open(&self, name: Option<&str>, flags: c_int) -> Option<usize> {
        let durable_kinds =
            ffi::SQLITE_OPEN_MAIN_DB | ffi::SQLITE_OPEN_WAL | ffi::SQLITE_OPEN_MAIN_JOURNAL;
        let name = name.filter(|_| flags & durable_kinds != 0)?;
        Some(self.0.open(name, flags & ffi::SQLITE_OPEN_WAL != 0))
    }

    fn write(&self, log: usize, off: u64, data: &[u8]) {
        self.0.write(log, off, data);
    }

    fn truncate(&self, log: usize, size: u64) {
        self.0.truncate(log, size);
    }

    // Answered by the model alone: what is durable is decided by the model, the real fsync would only cost time.
    fn sync(&self, log: usize, _real: &mut dyn FnMut() -> c_int) -> c_int {
        self.0.sync(log);
        ffi::SQLITE_OK
    }

    fn delete(&self, name: &str) {
        self.0.delete(name);
    }

    // Every page must be read and written through xRead/xWrite to be seen by the model.
    fn mmap(&self) -> bool {
        false
    }
}

/// Registers a VFS called `name` that reports to a new [`Disk`], and returns that disk. One name per test:
/// tests run in parallel threads, each with its own disk.
pub fn register(name: &str) -> Arc<Disk> {
    let disk = Arc::new(Disk::default());
    wrap_vfs::register(name, Arc::new(Model(disk.clone())), false);
    disk
}
