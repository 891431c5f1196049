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

use std::cell::Cell;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use edge_inbox::rusqlite::ffi;

#[path = "wrap_vfs.rs"]
mod wrap_vfs;

static DELAY_US: AtomicU64 = AtomicU64::new(0);
static WAL_BYTES: AtomicU64 = AtomicU64::new(0);
static DB_BYTES: AtomicU64 = AtomicU64::new(0);
static SYNCS: AtomicU64 = AtomicU64::new(0);
/// How long each successful sync of a WAL file took (microseconds, the simulated delay included), in order.
static WAL_SYNC_TIMES: Mutex<Vec<u32>> = Mutex::new(Vec::new());
/// Kept at most (4 MiB): a long run keeps its first syncs' times.
const WAL_SYNC_TIMES_CAP: usize = 1 << 20;
/// When each WAL header was written (a new WAL, or one that started over), in order; kept at most
/// [`WAL_SYNC_TIMES_CAP`].
static WAL_HEADER_TIMES: Mutex<Vec<Instant>> = Mutex::new(Vec::new());

/// Whether [`Field`] records its calls in [`TRACE`] ([`start_trace`]).
static TRACING: AtomicBool = AtomicBool::new(false);
/// The calls recorded since [`start_trace`], in order; kept at most [`TRACE_CAP`], room for which is made
/// before the trace starts (no reallocation inside a VFS call).
static TRACE: Mutex<Vec<Traced>> = Mutex::new(Vec::new());
const TRACE_CAP: usize = 1 << 19;
/// The names of the threads the trace numbers, by number.
static THREADS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// One call of SQLite's into the VFS, recorded while tracing.
#[derive(Clone, Copy, Debug)]
pub struct Traced {
    pub at: Instant,
    /// The calling thread: an index into the names [`take_trace`] returns.
    pub thread: u32,
    /// A WAL file's (or else a database file's).
    pub wal: bool,
    pub call: Call,
}

/// What the call was.
#[derive(Clone, Copy, Debug)]
pub enum Call {
    Write { bytes: u32 },
    SyncBegins,
    SyncEnds { took: Duration },
}

thread_local! {
    /// This thread's number in [`THREADS`].
    static THREAD_NO: u32 = {
        let mut names = THREADS.lock().unwrap_or_else(|p| p.into_inner());
        names.push(std::thread::current().name().unwrap_or("unnamed").to_owned());
        (names.len() - 1) as u32
    };
    static THREAD_DB_BYTES: Cell<u64> = const { Cell::new(0) };
    static THREAD_SYNC: Cell<Duration> = const { Cell::new(Duration::ZERO) };
    static THREAD_LOCK_WAIT: Cell<Duration> = const { Cell::new(Duration::ZERO) };
    static THREAD_WAL_HEADERS: Cell<u64> = const { Cell::new(0) };
    /// When this thread's current attempt at the write lock first found it taken.
    static WAITING_SINCE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// What this thread's SQLite calls did so far, to break a commit's time down.
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadTimes {
    /// Bytes written to database files (any: the commit ran a checkpoint).
    pub db_bytes: u64,
    /// Time in syncs of WAL and database files (the simulated delay included).
    pub sync: Duration,
    /// Time from the first refusal of the WAL's write lock to getting it (another connection held it).
    pub lock_wait: Duration,
    /// WAL headers written: the WAL started over, and SQLite synced the new header inside this commit.
    pub wal_headers: u64,
}

impl ThreadTimes {
    pub fn now() -> ThreadTimes {
        ThreadTimes {
            db_bytes: THREAD_DB_BYTES.with(Cell::get),
            sync: THREAD_SYNC.with(Cell::get),
            lock_wait: THREAD_LOCK_WAIT.with(Cell::get),
            wal_headers: THREAD_WAL_HEADERS.with(Cell::get),
        }
    }

    /// What happened since `earlier`.
    pub fn since(self, earlier: ThreadTimes) -> ThreadTimes {
        ThreadTimes {
            db_bytes: self.db_bytes - earlier.db_bytes,
            sync: self.sync - earlier.sync,
            lock_wait: self.lock_wait - earlier.lock_wait,
            wal_headers: self.wal_headers - earlier.wal_headers,
        }
    }
}

/// Name the VFS is registered under (also the default VFS once [`install`] ran).
pub const NAME: &str = "edge-inbox-field";

/// Registers the VFS as the default one, with `delay` added to every sync. Call before opening any database;
/// calling it again only changes the delay.
pub fn install(delay: Duration) {
    DELAY_US.store(delay.as_micros() as u64, Ordering::Relaxed);
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(register);
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

/// A mark in the record of WAL sync times, for [`wal_syncs_since`].
pub fn wal_sync_mark() -> usize {
    WAL_SYNC_TIMES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .len()
}

/// How long each sync of a WAL file since `mark` took (every connection's, the simulated delay included).
pub fn wal_syncs_since(mark: usize) -> Vec<Duration> {
    let times = WAL_SYNC_TIMES.lock().unwrap_or_else(|p| p.into_inner());
    times
        .get(mark..)
        .unwrap_or_default()
        .iter()
        .map(|&us| Duration::from_micros(u64::from(us)))
        .collect()
}

/// When each WAL header written at or after `since` was written: every start of a WAL over (and a new WAL).
pub fn wal_headers_since(since: Instant) -> Vec<Instant> {
    let times = WAL_HEADER_TIMES.lock().unwrap_or_else(|p| p.into_inner());
    times.iter().copied().filter(|&t| t >= since).collect()
}

/// Starts recording every write and sync of WAL and database files (the trace of an earlier start is
/// dropped).
pub fn start_trace() {
    let mut trace = TRACE.lock().unwrap_or_else(|p| p.into_inner());
    trace.clear();
    trace.reserve_exact(TRACE_CAP);
    TRACING.store(true, Ordering::SeqCst);
}

/// Stops recording; the calls recorded since [`start_trace`], and the names of the threads they number.
pub fn take_trace() -> (Vec<Traced>, Vec<String>) {
    TRACING.store(false, Ordering::SeqCst);
    let mut trace = TRACE.lock().unwrap_or_else(|p| p.into_inner());
    // A copy: the recording keeps its room for the next trace.
    let calls = trace.clone();
    trace.clear();
    drop(trace);
    let names = THREADS.lock().unwrap_or_else(|p| p.into_inner()).clone();
    (calls, names)
}

fn trace(wal: bool, call: Call) {
    if !TRACING.load(Ordering::Relaxed) {
        return;
    }
    let thread = THREAD_NO.with(|n| *n);
    let mut trace = TRACE.lock().unwrap_or_else(|p| p.into_inner());
    if trace.len() < TRACE_CAP {
        trace.push(Traced {
            at: Instant::now(),
            thread,
            wal,
            call,
        });
    }
}

/// Bytes written since the process started: by SQLite to WAL and database files (through this VFS), and by
/// the whole process to the block layer (`write_bytes` of `/proc/self/io`: page cache turned dirty, a folio
/// at a time, which is 4 KiB for files written in small pieces as SQLite writes them; see [`device_bytes`]
/// for a check; 0 where the file is not readable).
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

/// Bytes written to the block device that holds `path` since it came up, by every process (the file
/// system's journal and metadata included): sectors written, from `/sys/dev/block/MAJOR:MINOR/stat`. A check
/// on the process's `write_bytes`, which counts page cache turned dirty a whole folio at a time (a file held in
/// large folios counts a folio for a page written). `None` off Linux or for a device without the file.
pub fn device_bytes(path: &std::path::Path) -> Option<u64> {
    let dir = edge_inbox::inspect::block_device_dir(path, std::path::Path::new("/sys"))?;
    let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
    // The seventh field: sectors written, always of 512 bytes.
    let sectors: u64 = stat.split_whitespace().nth(6)?.parse().ok()?;
    Some(sectors * 512)
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

const WAL: usize = 1;
const DB: usize = 2;

/// Counts what SQLite writes to WAL and database files and slows their syncs; other files pass untouched.
struct Field;

impl wrap_vfs::Observer for Field {
    fn open(&self, _name: Option<&str>, flags: c_int) -> Option<usize> {
        if flags & ffi::SQLITE_OPEN_WAL != 0 {
            Some(WAL)
        } else if flags & ffi::SQLITE_OPEN_MAIN_DB != 0 {
            Some(DB)
        } else {
            None
        }
    }

    fn write(&self, tag: usize, off: u64, data: &[u8]) {
        let n = data.len() as u64;
        trace(
            tag == WAL,
            Call::Write {
                bytes: data.len() as u32,
            },
        );
        if tag == WAL {
            WAL_BYTES.fetch_add(n, Ordering::Relaxed);
            if off == 0 {
                THREAD_WAL_HEADERS.with(|h| h.set(h.get() + 1));
                let mut times = WAL_HEADER_TIMES.lock().unwrap_or_else(|p| p.into_inner());
                if times.len() < WAL_SYNC_TIMES_CAP {
                    times.push(Instant::now());
                }
            }
        } else {
            THREAD_DB_BYTES.with(|b| b.set(b.get() + n));
            DB_BYTES.fetch_add(n, Ordering::Relaxed);
        }
    }

    fn sync(&self, tag: usize, real: &mut dyn FnMut() -> c_int) -> c_int {
        trace(tag == WAL, Call::SyncBegins);
        let started = Instant::now();
        let rc = real();
        if rc == ffi::SQLITE_OK {
            SYNCS.fetch_add(1, Ordering::Relaxed);
            after_sync();
        }
        let took = started.elapsed();
        trace(tag == WAL, Call::SyncEnds { took });
        THREAD_SYNC.with(|t| t.set(t.get() + took));
        if rc == ffi::SQLITE_OK && tag == WAL {
            let mut times = WAL_SYNC_TIMES.lock().unwrap_or_else(|p| p.into_inner());
            if times.len() < WAL_SYNC_TIMES_CAP {
                times.push(took.as_micros().min(u128::from(u32::MAX)) as u32);
            }
        }
        rc
    }

    fn shm_lock(
        &self,
        _tag: usize,
        offset: c_int,
        _n: c_int,
        flags: c_int,
        real: &mut dyn FnMut() -> c_int,
    ) -> c_int {
        let rc = real();
        // Slot 0 of the shared-memory index, taken exclusively, is the WAL's write lock.
        if offset == 0 && flags == ffi::SQLITE_SHM_LOCK | ffi::SQLITE_SHM_EXCLUSIVE {
            let now = Instant::now();
            match rc {
                ffi::SQLITE_OK => {
                    if let Some(since) = WAITING_SINCE.with(|w| w.take()) {
                        THREAD_LOCK_WAIT.with(|t| t.set(t.get() + (now - since)));
                    }
                }
                ffi::SQLITE_BUSY => WAITING_SINCE.with(|w| {
                    if w.get().is_none() {
                        w.set(Some(now));
                    }
                }),
                _ => {}
            }
        }
        rc
    }
}

fn register() {
    // Made the default, so every connection of the benchmark goes through it.
    wrap_vfs::register(NAME, Arc::new(Field), true);
}
