//! An SQLite VFS that wraps the platform's and forwards every call to it, telling an [`Observer`] about the
//! files it opens and what is written, truncated, synced and deleted. One implementation of the C plumbing
//! for the benchmarks' field storage (`field_vfs.rs`) and the tests' injected faults and power-loss model.
//!
//! Test and benchmark support only: the library opens its file with the platform's VFS unless `Config::vfs`
//! names another.

#![allow(dead_code)]

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::Arc;

use edge_inbox::rusqlite::ffi;

/// What a wrapping VFS does besides forwarding to the platform's VFS. Called from SQLite's threads.
pub trait Observer: Send + Sync + 'static {
    /// A file is being opened (`name` is `None` for SQLite's anonymous temporary files). Returns a tag kept
    /// with the file and passed to the other calls, or `None` to leave the file unobserved.
    fn open(&self, name: Option<&str>, flags: c_int) -> Option<usize>;

    /// `data` was written at `off` (called after the real write succeeded).
    fn write(&self, _tag: usize, _off: u64, _data: &[u8]) {}

    /// The file was truncated to `size` (called after the real truncation succeeded).
    fn truncate(&self, _tag: usize, _size: u64) {}

    /// A sync of an observed file: `real` runs the platform's sync. What this returns is SQLite's result.
    fn sync(&self, _tag: usize, real: &mut dyn FnMut() -> c_int) -> c_int {
        real()
    }

    /// A lock on the shared-memory index of an observed database file (`xShmLock`): `real` takes or releases
    /// it. What this returns is SQLite's result.
    fn shm_lock(
        &self,
        _tag: usize,
        _offset: c_int,
        _n: c_int,
        _flags: c_int,
        real: &mut dyn FnMut() -> c_int,
    ) -> c_int {
        real()
    }

    /// A file was deleted (or was already gone).
    fn delete(&self, _name: &str) {}

    /// Whether SQLite may memory-map observed files. `false` sends every page through xRead/xWrite, so that
    /// [`Observer::write`] sees all of them.
    fn mmap(&self) -> bool {
        true
    }
}

#[repr(C)]
struct File {
    base: ffi::sqlite3_file,
    real: *mut ffi::sqlite3_file,
    observer: *const dyn Observer,
    tag: Option<usize>,
}

struct AppData {
    base: *mut ffi::sqlite3_vfs,
    observer: Arc<dyn Observer>,
}

unsafe fn file<'a>(f: *mut ffi::sqlite3_file) -> &'a File {
    &*(f as *mut File)
}

unsafe fn observed<'a>(f: *mut ffi::sqlite3_file) -> Option<(&'a dyn Observer, usize)> {
    let me = file(f);
    me.tag.map(|tag| (&*me.observer, tag))
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
    if rc == ffi::SQLITE_OK {
        if let Some((observer, tag)) = observed(f) {
            let data = std::slice::from_raw_parts(buf as *const u8, n as usize);
            observer.write(tag, off as u64, data);
        }
    }
    rc
}
unsafe extern "C" fn x_truncate(f: *mut ffi::sqlite3_file, size: i64) -> c_int {
    let rc = forward!(f, xTruncate, size);
    if rc == ffi::SQLITE_OK {
        if let Some((observer, tag)) = observed(f) {
            observer.truncate(tag, size as u64);
        }
    }
    rc
}
unsafe extern "C" fn x_sync(f: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    match observed(f) {
        Some((observer, tag)) => observer.sync(tag, &mut || forward!(f, xSync, flags)),
        None => forward!(f, xSync, flags),
    }
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
    match observed(f) {
        Some((observer, tag)) => observer.shm_lock(tag, off, n, flags, &mut || {
            forward!(f, xShmLock, off, n, flags)
        }),
        None => forward!(f, xShmLock, off, n, flags),
    }
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
unsafe extern "C" fn x_fetch(
    f: *mut ffi::sqlite3_file,
    off: i64,
    n: c_int,
    pp: *mut *mut c_void,
) -> c_int {
    if let Some((observer, _)) = observed(f) {
        if !observer.mmap() {
            // A null page makes SQLite read it through xRead.
            *pp = std::ptr::null_mut();
            return ffi::SQLITE_OK;
        }
    }
    forward!(f, xFetch, off, n, pp)
}
unsafe extern "C" fn x_unfetch(f: *mut ffi::sqlite3_file, off: i64, p: *mut c_void) -> c_int {
    if let Some((observer, _)) = observed(f) {
        if !observer.mmap() {
            return ffi::SQLITE_OK;
        }
    }
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
    (*me).observer = Arc::as_ptr(&app.observer);
    let path = (!name.is_null()).then(|| CStr::from_ptr(name).to_string_lossy());
    (*me).tag = app.observer.open(path.as_deref(), flags);
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
        app.observer.delete(&CStr::from_ptr(name).to_string_lossy());
    }
    rc
}

/// Registers a VFS called `name` over the platform's default VFS, reporting to `observer`; `make_default`
/// makes it the process's default (so connections that name no VFS use it too). The registration lasts for
/// the life of the process, as SQLite keeps the pointer: register each name once.
pub fn register(name: &str, observer: Arc<dyn Observer>, make_default: bool) {
    unsafe {
        let base = ffi::sqlite3_vfs_find(std::ptr::null());
        assert!(!base.is_null(), "no default VFS");
        let mut vfs = *base;
        vfs.szOsFile = (std::mem::size_of::<File>() + (*base).szOsFile as usize) as c_int;
        vfs.zName = CString::new(name).unwrap().into_raw();
        vfs.pNext = std::ptr::null_mut();
        vfs.pAppData = Box::into_raw(Box::new(AppData { base, observer })) as *mut c_void;
        vfs.xOpen = Some(x_open);
        vfs.xDelete = Some(x_delete);
        let rc = ffi::sqlite3_vfs_register(Box::into_raw(Box::new(vfs)), make_default as c_int);
        assert_eq!(rc, ffi::SQLITE_OK);
    }
}
