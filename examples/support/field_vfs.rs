//! Field storage for the benchmarks: an SQLite VFS that wraps the platform's, registered as the process's
//! default (so every connection of the benchmark, the inbox's and the baselines', goes through it), that
//!
//! - sleeps a fixed time after every real `xSync`, to run on this machine as on an SD card or eMMC whose sync
//!   takes milliseconds (`--sync-delay-ms`); the benchmarks' own fsync probes call [`after_sync`] too;
//! - counts the bytes SQLite writes to WAL files and to database files (a checkpoint's pages, chiefly),
//!   beside the process's block-layer figure from `/proc/self/io` ([`Written::now`]).
//!
//! Benchmarks only: the library opens its file with the platform's VFS unless `Config::vfs` names another.

#![allow(dead_code)]

use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use edge_inbox::rusqlite::ffi;

static DELAY_US: AtomicU64 = AtomicU64::new(0);
static WAL_BYTES: AtomicU64 = AtomicU64::new(0);
static DB_BYTES: AtomicU64 = AtomicU64::new(0);
static SYNCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static THREAD_DB_BYTES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Bytes this thread's SQLite calls wrote to database files (not WALs) through the VFS: a commit that writes
/// any ran a checkpoint.
pub fn thread_db_bytes() -> u64 {
    THREAD_DB_BYTES.with(|b| b.get())
}

/// Name the VFS is registered under (also the default VFS once [`install`] ran).
pub const NAME: &str = "edge-inbox-field";

/// Registers the VFS as the default one, with `delay` added to every sync. Call before opening any database;
/// calling it again only changes the delay.
pub fn install(delay: Duration) {
    DELAY_US.store(delay.as_micros() as u64, Ordering::Relaxed);
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| unsafe { register() });
}

/// The simulated sync time.
pub fn delay() -> Duration {
    Duration::from_micros(DELAY_US.load(Ordering::Relaxed))
}

/// What a sync outside SQLite (a benchmark's fsync probe) adds, to match the VFS.
pub fn after_sync() {
    let d = delay();
    if !d.is_zero() {
        std::thread::sleep(d);
    }
}

/// Bytes written since the process started: by SQLite to WAL and database files (through this VFS), and by
/// the whole process to the block layer (`write_bytes` of `/proc/self/io`: page-cache pages dirtied, in
/// whole 4 KiB pages; 0 where the file is not readable).
#[derive(Clone, Copy, Debug, Default)]
pub struct Written {
    pub wal: u64,
    pub db: u64,
    pub block: u64,
    pub syncs: u64,
}

impl Written {
    pub fn now() -> Written {
        Written {
            wal: WAL_BYTES.load(Ordering::Relaxed),
            db: DB_BYTES.load(Ordering::Relaxed),
            block: block_bytes(),
            syncs: SYNCS.load(Ordering::Relaxed),
        }
    }

    /// What was written since `earlier`.
    pub fn since(self, earlier: Written) -> Written {
        Written {
            wal: self.wal - earlier.wal,
            db: self.db - earlier.db,
            block: self.block.saturating_sub(earlier.block),
            syncs: self.syncs - earlier.syncs,
        }
    }

    /// Adds `other` (sums over slices).
    pub fn add(&mut self, other: Written) {
        self.wal += other.wal;
        self.db += other.db;
        self.block += other.block;
        self.syncs += other.syncs;
    }

    /// Per-delivery figures in bytes: (WAL, database file, block layer), for `n` deliveries.
    pub fn per(&self, n: u64) -> (f64, f64, f64) {
        let n = n.max(1) as f64;
        (
            self.wal as f64 / n,
            self.db as f64 / n,
            self.block as f64 / n,
        )
    }
}

fn block_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("write_bytes:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

const WAL: u8 = 1;
const DB: u8 = 2;
const OTHER: u8 = 0;

#[repr(C)]
struct File {
    base: ffi::sqlite3_file,
    real: *mut ffi::sqlite3_file,
    kind: u8,
}

unsafe fn real(f: *mut ffi::sqlite3_file) -> *mut ffi::sqlite3_file {
    (*(f as *mut File)).real
}

macro_rules! forward {
    ($f:expr, $method:ident $(, $arg:expr)*) => {{
        let r = real($f);
        match (*(*r).pMethods).$method {
            Some(m) => m(r $(, $arg)*),
            None => ffi::SQLITE_IOERR,
        }
    }};
}

unsafe extern "C" fn x_close(f: *mut ffi::sqlite3_file) -> c_int {
    forward!(f, xClose)
}
unsafe extern "C" fn x_read(
    f: *mut ffi::sqlite3_file,
    buf: *mut c_void,
    n: c_int,
    off: i64,
) -> c_int {
    forward!(f, xRead, buf, n, off)
}
unsafe extern "C" fn x_write(
    f: *mut ffi::sqlite3_file,
    buf: *const c_void,
    n: c_int,
    off: i64,
) -> c_int {
    let rc = forward!(f, xWrite, buf, n, off);
    if rc == ffi::SQLITE_OK {
        match (*(f as *mut File)).kind {
            WAL => WAL_BYTES.fetch_add(n as u64, Ordering::Relaxed),
            DB => {
                THREAD_DB_BYTES.with(|b| b.set(b.get() + n as u64));
                DB_BYTES.fetch_add(n as u64, Ordering::Relaxed)
            }
            _ => 0,
        };
    }
    rc
}
unsafe extern "C" fn x_truncate(f: *mut ffi::sqlite3_file, size: i64) -> c_int {
    forward!(f, xTruncate, size)
}
unsafe extern "C" fn x_sync(f: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    let rc = forward!(f, xSync, flags);
    if rc == ffi::SQLITE_OK && (*(f as *mut File)).kind != OTHER {
        SYNCS.fetch_add(1, Ordering::Relaxed);
        after_sync();
    }
    rc
}
unsafe extern "C" fn x_file_size(f: *mut ffi::sqlite3_file, size: *mut i64) -> c_int {
    forward!(f, xFileSize, size)
}
unsafe extern "C" fn x_lock(f: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    forward!(f, xLock, level)
}
unsafe extern "C" fn x_unlock(f: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    forward!(f, xUnlock, level)
}
unsafe extern "C" fn x_check_reserved(f: *mut ffi::sqlite3_file, out: *mut c_int) -> c_int {
    forward!(f, xCheckReservedLock, out)
}
unsafe extern "C" fn x_file_control(
    f: *mut ffi::sqlite3_file,
    op: c_int,
    arg: *mut c_void,
) -> c_int {
    forward!(f, xFileControl, op, arg)
}
unsafe extern "C" fn x_sector_size(f: *mut ffi::sqlite3_file) -> c_int {
    forward!(f, xSectorSize)
}
unsafe extern "C" fn x_device_characteristics(f: *mut ffi::sqlite3_file) -> c_int {
    forward!(f, xDeviceCharacteristics)
}
unsafe extern "C" fn x_shm_map(
    f: *mut ffi::sqlite3_file,
    pg: c_int,
    sz: c_int,
    ext: c_int,
    pp: *mut *mut c_void,
) -> c_int {
    forward!(f, xShmMap, pg, sz, ext, pp)
}
unsafe extern "C" fn x_shm_lock(
    f: *mut ffi::sqlite3_file,
    off: c_int,
    n: c_int,
    flags: c_int,
) -> c_int {
    forward!(f, xShmLock, off, n, flags)
}
unsafe extern "C" fn x_shm_barrier(f: *mut ffi::sqlite3_file) {
    let r = real(f);
    if let Some(m) = (*(*r).pMethods).xShmBarrier {
        m(r)
    }
}
unsafe extern "C" fn x_shm_unmap(f: *mut ffi::sqlite3_file, delete: c_int) -> c_int {
    forward!(f, xShmUnmap, delete)
}
unsafe extern "C" fn x_fetch(
    f: *mut ffi::sqlite3_file,
    off: i64,
    n: c_int,
    pp: *mut *mut c_void,
) -> c_int {
    forward!(f, xFetch, off, n, pp)
}
unsafe extern "C" fn x_unfetch(f: *mut ffi::sqlite3_file, off: i64, p: *mut c_void) -> c_int {
    forward!(f, xUnfetch, off, p)
}

static METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 3,
    xClose: Some(x_close),
    xRead: Some(x_read),
    xWrite: Some(x_write),
    xTruncate: Some(x_truncate),
    xSync: Some(x_sync),
    xFileSize: Some(x_file_size),
    xLock: Some(x_lock),
    xUnlock: Some(x_unlock),
    xCheckReservedLock: Some(x_check_reserved),
    xFileControl: Some(x_file_control),
    xSectorSize: Some(x_sector_size),
    xDeviceCharacteristics: Some(x_device_characteristics),
    xShmMap: Some(x_shm_map),
    xShmLock: Some(x_shm_lock),
    xShmBarrier: Some(x_shm_barrier),
    xShmUnmap: Some(x_shm_unmap),
    xFetch: Some(x_fetch),
    xUnfetch: Some(x_unfetch),
};

unsafe extern "C" fn x_open(
    vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    f: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let base = (*vfs).pAppData as *mut ffi::sqlite3_vfs;
    let me = f as *mut File;
    let real = (f as *mut u8).add(std::mem::size_of::<File>()) as *mut ffi::sqlite3_file;
    (*me).base.pMethods = std::ptr::null();
    (*me).real = real;
    (*me).kind = if flags & ffi::SQLITE_OPEN_WAL != 0 {
        WAL
    } else if flags & ffi::SQLITE_OPEN_MAIN_DB != 0 {
        DB
    } else {
        OTHER
    };
    let rc = ((*base).xOpen.expect("base xOpen"))(base, name, real, flags, out_flags);
    if rc == ffi::SQLITE_OK && !(*real).pMethods.is_null() {
        (*me).base.pMethods = &METHODS;
    }
    rc
}

unsafe fn register() {
    let base = ffi::sqlite3_vfs_find(std::ptr::null());
    assert!(!base.is_null(), "no default VFS");
    let mut vfs = *base;
    vfs.szOsFile = (std::mem::size_of::<File>() + (*base).szOsFile as usize) as c_int;
    vfs.zName = CString::new(NAME).unwrap().into_raw() as *const c_char;
    vfs.pNext = std::ptr::null_mut();
    vfs.pAppData = base as *mut c_void;
    vfs.xOpen = Some(x_open);
    // Kept for the life of the process, as SQLite requires; made the default so every connection uses it.
    let rc = ffi::sqlite3_vfs_register(Box::into_raw(Box::new(vfs)), 1);
    assert_eq!(rc, ffi::SQLITE_OK);
}
