//! "COMMIT returns an uncertain error": injected with a VFS that wraps the platform's and fails the fsync of
//! the WAL on demand. The outcome must be `CommitUnknown` (never a duplicate, never acked), and the
//! redelivery plus the identity lookup settle it, with exactly one effect.

use std::ffi::{c_int, c_void, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

use edge_inbox::rusqlite::ffi;
use edge_inbox::{Config, Delivery, Error, Inbox, Outcome, Status, Tx};

const SCOPE: &str = "inventory-reservation";
const VFS: &str = "edge-inbox-fault";

static FAIL_WAL_SYNC: AtomicBool = AtomicBool::new(false);
static mut BASE: *mut ffi::sqlite3_vfs = std::ptr::null_mut();

#[repr(C)]
struct FaultFile {
    base: ffi::sqlite3_file,
    real: *mut ffi::sqlite3_file,
    is_wal: bool,
}

unsafe fn real(f: *mut ffi::sqlite3_file) -> *mut ffi::sqlite3_file {
    (*(f as *mut FaultFile)).real
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
    forward!(f, xWrite, buf, n, off)
}
unsafe extern "C" fn x_truncate(f: *mut ffi::sqlite3_file, size: i64) -> c_int {
    forward!(f, xTruncate, size)
}
unsafe extern "C" fn x_sync(f: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    if (*(f as *mut FaultFile)).is_wal && FAIL_WAL_SYNC.load(Ordering::SeqCst) {
        return ffi::SQLITE_IOERR_FSYNC;
    }
    forward!(f, xSync, flags)
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
    _vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let ff = file as *mut FaultFile;
    let real = (file as *mut u8).add(std::mem::size_of::<FaultFile>()) as *mut ffi::sqlite3_file;
    (*ff).base.pMethods = std::ptr::null();
    (*ff).real = real;
    (*ff).is_wal = flags & ffi::SQLITE_OPEN_WAL != 0;
    let base = BASE;
    let rc = ((*base).xOpen.expect("base xOpen"))(base, name, real, flags, out_flags);
    if rc == ffi::SQLITE_OK && !(*real).pMethods.is_null() {
        (*ff).base.pMethods = &METHODS;
    }
    rc
}

fn register_fault_vfs() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| unsafe {
        let base = ffi::sqlite3_vfs_find(std::ptr::null());
        assert!(!base.is_null());
        BASE = base;
        let mut vfs = *base;
        vfs.szOsFile = (std::mem::size_of::<FaultFile>() + (*base).szOsFile as usize) as c_int;
        vfs.zName = CString::new(VFS).unwrap().into_raw();
        vfs.pNext = std::ptr::null_mut();
        vfs.xOpen = Some(x_open);
        let rc = ffi::sqlite3_vfs_register(Box::into_raw(Box::new(vfs)), 0);
        assert_eq!(rc, ffi::SQLITE_OK);
    });
}

fn bump(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let n: i64 = tx.get(d.message_id)?.unwrap_or(0);
    tx.put(d.message_id, &(n + 1))?;
    Ok(())
}

fn effects(inbox: &Inbox, id: &str) -> i64 {
    let blob: Option<Vec<u8>> = inbox
        .connection()
        .query_row("SELECT value FROM kv WHERE key = ?1", [id], |r| r.get(0))
        .ok();
    blob.map(|b| ciborium::from_reader(&b[..]).unwrap())
        .unwrap_or(0)
}

/// One test function: the fault switch is process-wide.
#[test]
fn commit_with_unknown_outcome_is_never_a_duplicate_and_settles_on_redelivery() {
    register_fault_vfs();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let config = Config::default().vfs(VFS);
    let mut inbox = Inbox::open(&path, config.clone()).unwrap();
    let warm = Delivery::new(SCOPE, "evt-1", "orders/1", b"x");
    assert!(matches!(
        inbox.process(&warm, bump).unwrap(),
        Outcome::Processed
    ));

    // Same connection: COMMIT fails, then the redelivery settles it.
    let d = Delivery::new(SCOPE, "evt-2", "orders/2", b"x");
    FAIL_WAL_SYNC.store(true, Ordering::SeqCst);
    let err = inbox.process(&d, bump).unwrap_err();
    FAIL_WAL_SYNC.store(false, Ordering::SeqCst);
    match &err {
        Error::CommitUnknown { code, .. } => assert_eq!(*code, ffi::SQLITE_IOERR_FSYNC),
        other => panic!("expected CommitUnknown, got {other:?}"),
    }
    assert!(err.is_retryable());
    let redelivered = inbox.process(&d, bump).unwrap();
    assert!(
        matches!(redelivered, Outcome::Processed | Outcome::Duplicate),
        "{redelivered:?}"
    );
    assert_eq!(
        effects(&inbox, "evt-2"),
        1,
        "exactly one effect after the redelivery"
    );
    assert!(matches!(
        inbox.status(SCOPE, None, "evt-2").unwrap(),
        Status::Recorded { .. }
    ));

    // A batch whose COMMIT fails reports no outcome at all; then the process dies and restarts (WAL recovery
    // may or may not bring the frames back), and the broker redelivers the batch.
    let ids: Vec<String> = (0..8).map(|i| format!("batch-{i}")).collect();
    let batch: Vec<_> = ids
        .iter()
        .map(|id| Delivery::new(SCOPE, id, "orders/b", b"x"))
        .collect();
    let mut outcomes = Vec::new();
    FAIL_WAL_SYNC.store(true, Ordering::SeqCst);
    let err = inbox
        .process_batch_into(&batch, &mut bump, &mut outcomes)
        .unwrap_err();
    FAIL_WAL_SYNC.store(false, Ordering::SeqCst);
    assert!(matches!(err, Error::CommitUnknown { .. }), "{err:?}");
    assert!(outcomes.is_empty(), "nothing reported as done");
    drop(inbox);

    let mut inbox = Inbox::open(&path, config).unwrap();
    let status = inbox.status(SCOPE, None, "batch-0").unwrap();
    let outcomes = inbox.process_batch(&batch, bump).unwrap();
    let expected = if status == Status::NotFound {
        "processed"
    } else {
        "duplicate"
    };
    assert!(
        outcomes.iter().all(|o| o.name() == expected),
        "lookup and redelivery agree: {outcomes:?}"
    );
    for id in &ids {
        assert_eq!(effects(&inbox, id), 1, "{id}: exactly one effect");
    }
    assert_eq!(effects(&inbox, "evt-2"), 1);
    let stats = inbox.scope_stats(SCOPE).unwrap();
    assert_eq!(stats.processed, 10);
}
