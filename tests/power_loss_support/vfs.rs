//! An SQLite VFS that wraps the platform's and reports every write, truncation, sync and deletion of the
//! database, WAL and journal files to a [`Disk`]. Data goes through to the real files (so the running inbox
//! reads what it wrote); `xSync` is answered by the model alone: the real fsync would only cost time, since
//! what is durable is decided by the model.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::Arc;

use edge_inbox::rusqlite::ffi;

use super::disk::Disk;

#[repr(C)]
struct File {
    base: ffi::sqlite3_file,
    real: *mut ffi::sqlite3_file,
    disk: *const Disk,
    /// The file's log in the disk model; `usize::MAX` for temporary files, which no cut needs.
    log: usize,
}

struct AppData {
    base: *mut ffi::sqlite3_vfs,
    disk: Arc<Disk>,
}

const UNTRACKED: usize = usize::MAX;

unsafe fn file<'a>(f: *mut ffi::sqlite3_file) -> &'a File {
    &*(f as *mut File)
}

macro_rules! forward {
    ($f:expr, $method:ident $(, $arg:expr)*) => {{
        let r = file($f).real;
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
    let me = file(f);
    if rc == ffi::SQLITE_OK && me.log != UNTRACKED {
        let data = std::slice::from_raw_parts(buf as *const u8, n as usize);
        (*me.disk).write(me.log, off as u64, data);
    }
    rc
}
unsafe extern "C" fn x_truncate(f: *mut ffi::sqlite3_file, size: i64) -> c_int {
    let rc = forward!(f, xTruncate, size);
    let me = file(f);
    if rc == ffi::SQLITE_OK && me.log != UNTRACKED {
        (*me.disk).truncate(me.log, size as u64);
    }
    rc
}
unsafe extern "C" fn x_sync(f: *mut ffi::sqlite3_file, _flags: c_int) -> c_int {
    let me = file(f);
    if me.log != UNTRACKED {
        (*me.disk).sync(me.log);
    }
    ffi::SQLITE_OK
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
    let r = file(f).real;
    if let Some(m) = (*(*r).pMethods).xShmBarrier {
        m(r)
    }
}
unsafe extern "C" fn x_shm_unmap(f: *mut ffi::sqlite3_file, delete: c_int) -> c_int {
    forward!(f, xShmUnmap, delete)
}
// No memory-mapped I/O: every page must be read and written through xRead/xWrite to be seen by the model.
unsafe extern "C" fn x_fetch(
    _f: *mut ffi::sqlite3_file,
    _off: i64,
    _n: c_int,
    pp: *mut *mut c_void,
) -> c_int {
    *pp = std::ptr::null_mut();
    ffi::SQLITE_OK
}
unsafe extern "C" fn x_unfetch(_f: *mut ffi::sqlite3_file, _off: i64, _p: *mut c_void) -> c_int {
    ffi::SQLITE_OK
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

unsafe fn app<'a>(vfs: *mut ffi::sqlite3_vfs) -> &'a AppData {
    &*((*vfs).pAppData as *const AppData)
}

unsafe extern "C" fn x_open(
    vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    f: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let app = app(vfs);
    let me = f as *mut File;
    let real = (f as *mut u8).add(std::mem::size_of::<File>()) as *mut ffi::sqlite3_file;
    (*me).base.pMethods = std::ptr::null();
    (*me).real = real;
    (*me).disk = Arc::as_ptr(&app.disk);
    let durable_kinds =
        ffi::SQLITE_OPEN_MAIN_DB | ffi::SQLITE_OPEN_WAL | ffi::SQLITE_OPEN_MAIN_JOURNAL;
    (*me).log = if !name.is_null() && flags & durable_kinds != 0 {
        let path = CStr::from_ptr(name).to_string_lossy();
        app.disk.open(&path, flags & ffi::SQLITE_OPEN_WAL != 0)
    } else {
        UNTRACKED
    };
    let rc = ((*app.base).xOpen.expect("base xOpen"))(app.base, name, real, flags, out_flags);
    if rc == ffi::SQLITE_OK && !(*real).pMethods.is_null() {
        (*me).base.pMethods = &METHODS;
    }
    rc
}

unsafe extern "C" fn x_delete(
    vfs: *mut ffi::sqlite3_vfs,
    name: *const c_char,
    sync_dir: c_int,
) -> c_int {
    let app = app(vfs);
    let rc = ((*app.base).xDelete.expect("base xDelete"))(app.base, name, sync_dir);
    if rc == ffi::SQLITE_OK || rc == ffi::SQLITE_IOERR_DELETE_NOENT {
        app.disk.delete(&CStr::from_ptr(name).to_string_lossy());
    }
    rc
}

/// Registers a VFS called `name` that reports to a new [`Disk`], and returns that disk. One name per test:
/// tests run in parallel threads, each with its own disk.
pub fn register(name: &str) -> Arc<Disk> {
    let disk = Arc::new(Disk::default());
    unsafe {
        let base = ffi::sqlite3_vfs_find(std::ptr::null());
        assert!(!base.is_null(), "no default VFS");
        let mut vfs = *base;
        vfs.szOsFile = (std::mem::size_of::<File>() + (*base).szOsFile as usize) as c_int;
        vfs.zName = CString::new(name).unwrap().into_raw();
        vfs.pNext = std::ptr::null_mut();
        vfs.pAppData = Box::into_raw(Box::new(AppData {
            base,
            disk: disk.clone(),
        })) as *mut c_void;
        vfs.xOpen = Some(x_open);
        vfs.xDelete = Some(x_delete);
        // Registered for the life of the test process; SQLite keeps the pointer.
        let rc = ffi::sqlite3_vfs_register(Box::into_raw(Box::new(vfs)), 0);
        assert_eq!(rc, ffi::SQLITE_OK);
    }
    disk
}
