//! A failed sync of the WAL loses more than the commit that saw it. Linux reports a failed write-back once per
//! file descriptor and marks the pages clean: the next sync succeeds, although frames written before the
//! failure (another connection's `synchronous=NORMAL` commits, a prune step) never reached the disk. A commit
//! appended after them and acked would vanish with them at a power cut, since WAL recovery stops at the first
//! bad frame. A VFS models exactly that disk here (writes durable only once synced; a failed sync drops what
//! it should have written), and the power cut is rebuilt from what it kept.

use std::ffi::c_int;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once};

use edge_inbox::rusqlite::ffi;

#[path = "../examples/support/wrap_vfs.rs"]
mod wrap_vfs;
use edge_inbox::{
    Config, ConsumerCore, Delivery, Error, Inbound, Inbox, Outcome, Pruning, Status, SyncOverlap,
    Synchronous, Tx,
};

mod common;

const SCOPE: &str = "inventory-reservation";
const VFS: &str = "edge-inbox-failed-writeback";

static FAIL_WAL_SYNC: AtomicBool = AtomicBool::new(false);
/// The same, for the WAL syncs of the inbox's checkpoint thread only (told by its thread name).
static FAIL_THREAD_WAL_SYNC: AtomicBool = AtomicBool::new(false);
/// While set, the checkpoint thread's next WAL sync waits (`THREAD_HELD`) until `RELEASE_THREAD` is set.
static HOLD_THREAD_SYNC: AtomicBool = AtomicBool::new(false);
static THREAD_HELD: AtomicBool = AtomicBool::new(false);
static RELEASE_THREAD: AtomicBool = AtomicBool::new(false);
/// The checkpoint thread's WAL sync failed.
static THREAD_FAILED: AtomicBool = AtomicBool::new(false);
const CHECKPOINT_THREAD: &str = "edge-inbox-checkpoint";
/// WAL syncs the inbox's sync thread (commits overlapping their syncs) made or tried.
static SYNC_THREAD_SYNCS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
const SYNC_THREAD: &str = "edge-inbox-sync";

/// Waits until `flag` is set, 10 s at most.
fn wait_for(flag: &AtomicBool, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !flag.load(Ordering::SeqCst) {
        assert!(std::time::Instant::now() < deadline, "{what}: not in 10 s");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[derive(Default)]
struct Image {
    name: String,
    durable: Vec<u8>,
    /// Written (or truncated: no data) since the file's last sync: on the disk only once a sync succeeds.
    pending: Vec<(u64, Option<Vec<u8>>)>,
}

/// The database file and its WAL as the disk holds them; one image per path, whichever connection writes.
#[derive(Default)]
struct Disk {
    files: Mutex<Vec<Image>>,
}

impl wrap_vfs::Observer for Disk {
    fn open(&self, name: Option<&str>, flags: c_int) -> Option<usize> {
        let name = name?;
        if flags & (ffi::SQLITE_OPEN_MAIN_DB | ffi::SQLITE_OPEN_WAL) == 0 {
            return None;
        }
        let mut files = self.files.lock().unwrap();
        if let Some(i) = files.iter().position(|f| f.name == name) {
            return Some(i);
        }
        files.push(Image {
            name: name.to_owned(),
            ..Image::default()
        });
        Some(files.len() - 1)
    }

    fn write(&self, tag: usize, off: u64, data: &[u8]) {
        self.files.lock().unwrap()[tag]
            .pending
            .push((off, Some(data.to_vec())));
    }

    fn truncate(&self, tag: usize, size: u64) {
        self.files.lock().unwrap()[tag].pending.push((size, None));
    }

    fn sync(&self, tag: usize, real: &mut dyn FnMut() -> c_int) -> c_int {
        let wal = self.files.lock().unwrap()[tag].name.ends_with("-wal");
        let checkpoint_thread = std::thread::current().name() == Some(CHECKPOINT_THREAD);
        if wal && std::thread::current().name() == Some(SYNC_THREAD) {
            SYNC_THREAD_SYNCS.fetch_add(1, Ordering::SeqCst);
        }
        if wal && checkpoint_thread && HOLD_THREAD_SYNC.load(Ordering::SeqCst) {
            THREAD_HELD.store(true, Ordering::SeqCst);
            wait_for(&RELEASE_THREAD, "the test releasing the checkpoint thread");
        }
        if wal && checkpoint_thread && FAIL_THREAD_WAL_SYNC.load(Ordering::SeqCst) {
            self.files.lock().unwrap()[tag].pending.clear();
            THREAD_FAILED.store(true, Ordering::SeqCst);
            return ffi::SQLITE_IOERR_FSYNC;
        }
        if wal && FAIL_WAL_SYNC.load(Ordering::SeqCst) {
            // The write-back failed: those pages never reach the disk, and no later sync writes them.
            self.files.lock().unwrap()[tag].pending.clear();
            return ffi::SQLITE_IOERR_FSYNC;
        }
        let rc = real();
        if rc == ffi::SQLITE_OK {
            let mut files = self.files.lock().unwrap();
            let f = &mut files[tag];
            for (off, data) in std::mem::take(&mut f.pending) {
                common::apply_write(&mut f.durable, off, data.as_deref());
            }
        }
        rc
    }

    fn mmap(&self) -> bool {
        false
    }
}

fn disk() -> Arc<Disk> {
    static ONCE: Once = Once::new();
    static DISK: Mutex<Option<Arc<Disk>>> = Mutex::new(None);
    ONCE.call_once(|| {
        let d = Arc::new(Disk::default());
        wrap_vfs::register(VFS, d.clone(), false);
        *DISK.lock().unwrap() = Some(d);
    });
    DISK.lock().unwrap().clone().unwrap()
}

/// Writes what the disk holds now of the database file `db` (a file name) and its WAL into `dir`, under
/// their own names: the files after a power cut.
fn power_cut(disk: &Disk, dir: &Path, db: &str) -> std::path::PathBuf {
    let wal = format!("{db}-wal");
    let mut found = false;
    for f in disk.files.lock().unwrap().iter() {
        let name = Path::new(&f.name).file_name().unwrap();
        if name == db || name.to_str() == Some(wal.as_str()) {
            std::fs::write(dir.join(name), &f.durable).unwrap();
            found |= name == db;
        }
    }
    assert!(found, "the database file {db} was opened");
    dir.join(db)
}

fn bump(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let n: i64 = tx.get(d.message_id)?.unwrap_or(0);
    tx.put(d.message_id, &(n + 1))?;
    Ok(())
}

/// Offers `id` until it is settled; a busy database (the WAL being copied back) is retried, a bounded number
/// of times.
fn process(inbox: &mut Inbox, id: &str) -> Outcome {
    let d = Delivery::new(SCOPE, id, "orders/1", b"x");
    for _ in 0..100 {
        match inbox.process(&d, bump) {
            Err(Error::Busy { .. }) => std::thread::sleep(std::time::Duration::from_millis(20)),
            other => return other.unwrap(),
        }
    }
    panic!("{id}: still busy after 100 tries");
}

/// Reopens the files of database `db` (a file name) a power cut would leave now (in a directory of their
/// own) and checks them: whole (`integrity_check`), and holding each of `kept`.
fn check_after_power_cut(disk: &Disk, db: &str, kept: &[&str]) {
    let cut = tempfile::tempdir().unwrap();
    let db = power_cut(disk, cut.path(), db);
    let mut after = Inbox::open(&db, Config::default()).unwrap();
    let integrity: String = after
        .connection()
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(integrity, "ok");
    for id in kept {
        assert!(
            matches!(
                after.status(SCOPE, None, id).unwrap(),
                Status::Recorded { .. }
            ),
            "{id} must survive a power cut"
        );
    }
}

/// One test function: the fault switch and the disk model are process-wide.
#[test]
fn a_commit_after_a_failed_wal_sync_is_not_acked_until_the_wal_is_written_out_again() {
    let disk = disk();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    // No checkpoint threads: only the connections below touch the WAL, in the order written here.
    let config = Config::default().vfs(VFS).checkpoint_thread(false);
    let mut inbox = Inbox::open(&path, config.clone()).unwrap();
    assert!(matches!(process(&mut inbox, "a"), Outcome::Processed));

    // Another consumer on the file commits at NORMAL: its frames are in the WAL, not yet on the disk.
    let mut relaxed = Inbox::open(&path, config.clone().synchronous(Synchronous::Normal)).unwrap();
    for id in ["n-1", "n-2", "n-3"] {
        assert!(matches!(process(&mut relaxed, id), Outcome::Processed));
    }

    // The next sync fails: the commit is not acked (its outcome is unknown) ...
    FAIL_WAL_SYNC.store(true, Ordering::SeqCst);
    let d = Delivery::new(SCOPE, "b", "orders/1", b"x");
    let err = inbox.process(&d, bump).unwrap_err();
    assert!(matches!(err, Error::CommitUnknown { .. }), "{err:?}");
    assert!(err.is_retryable());
    // ... nor is anything while the disk keeps failing (never a duplicate) ...
    let err = inbox.process(&d, bump).unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
    FAIL_WAL_SYNC.store(false, Ordering::SeqCst);

    // ... and once it works again, a transaction that writes nothing (a duplicate) leaves the files whole:
    // the WAL on the disk holds every frame committed before the failure again, the NORMAL ones too.
    let a = Delivery::new(SCOPE, "a", "orders/1", b"x");
    assert!(matches!(
        inbox.process(&a, bump).unwrap(),
        Outcome::Duplicate
    ));
    check_after_power_cut(&disk, "inbox.db", &["a", "n-1", "n-2", "n-3"]);

    // The next commit, whose own sync succeeds, rests on frames that are on the disk.
    assert!(matches!(process(&mut inbox, "c"), Outcome::Processed));
    check_after_power_cut(&disk, "inbox.db", &["a", "n-1", "n-2", "n-3", "c"]);

    // A checkpoint's sync of the WAL fails (the one that ends a prune pass): the same as a commit's. The next
    // commit, which syncs fine, is acked only once the frames before it are on the disk again.
    assert!(matches!(process(&mut relaxed, "n-5"), Outcome::Processed));
    FAIL_WAL_SYNC.store(true, Ordering::SeqCst);
    let err = inbox.prune(&Pruning::default()).unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
    FAIL_WAL_SYNC.store(false, Ordering::SeqCst);
    assert!(matches!(process(&mut inbox, "e"), Outcome::Processed));
    check_after_power_cut(
        &disk,
        "inbox.db",
        &["a", "n-1", "n-2", "n-3", "c", "n-5", "e"],
    );

    // Another failed sync, and then the inbox is closed with no transaction after it. As the last connection
    // it checkpoints at close: that copy must not put frames the disk lacks into the database file, where
    // recovery would replay the WAL's older prefix over them after a power cut.
    assert!(matches!(process(&mut relaxed, "n-4"), Outcome::Processed));
    FAIL_WAL_SYNC.store(true, Ordering::SeqCst);
    let d = Delivery::new(SCOPE, "d", "orders/1", b"x");
    let err = inbox.process(&d, bump).unwrap_err();
    assert!(matches!(err, Error::CommitUnknown { .. }), "{err:?}");
    FAIL_WAL_SYNC.store(false, Ordering::SeqCst);
    drop(relaxed);
    drop(inbox);
    check_after_power_cut(
        &disk,
        "inbox.db",
        &["a", "n-1", "n-2", "n-3", "c", "n-5", "e", "n-4"],
    );

    // The checkpoint thread's sync of the WAL fails while a transaction of the inbox is open. That sync took
    // the failure of frames written before (another connection's NORMAL commit), so the commit that follows
    // them is not durable for certain, although its own sync succeeds: its outcome is unknown, not acked.
    let path = dir.path().join("threaded.db");
    let mut inbox = Inbox::open(&path, Config::default().vfs(VFS).wal_autocheckpoint(1)).unwrap();
    let mut relaxed = Inbox::open(&path, config.synchronous(Synchronous::Normal)).unwrap();
    HOLD_THREAD_SYNC.store(true, Ordering::SeqCst);
    // Its commit asks the thread for a checkpoint, whose sync of the WAL is held.
    assert!(matches!(process(&mut inbox, "t-1"), Outcome::Processed));
    wait_for(&THREAD_HELD, "the checkpoint thread's sync");
    assert!(matches!(process(&mut relaxed, "t-n"), Outcome::Processed));
    FAIL_THREAD_WAL_SYNC.store(true, Ordering::SeqCst);
    let d = Delivery::new(SCOPE, "t-2", "orders/1", b"x");
    let err = inbox
        .process(&d, |tx, d| {
            RELEASE_THREAD.store(true, Ordering::SeqCst);
            wait_for(&THREAD_FAILED, "the checkpoint thread's failed sync");
            // The thread records the error as its checkpoint returns, a moment after the sync.
            std::thread::sleep(std::time::Duration::from_millis(500));
            bump(tx, d)
        })
        .unwrap_err();
    assert!(matches!(err, Error::CommitUnknown { .. }), "{err:?}");
    assert!(err.is_retryable());
    FAIL_THREAD_WAL_SYNC.store(false, Ordering::SeqCst);
    HOLD_THREAD_SYNC.store(false, Ordering::SeqCst);
    // Offered again: the next transaction writes the WAL out again first, and finds the commit made.
    assert!(matches!(process(&mut inbox, "t-2"), Outcome::Duplicate));
    check_after_power_cut(&disk, "threaded.db", &["t-1", "t-n", "t-2"]);
    drop(relaxed);
    drop(inbox);

    overlapped_commits_are_not_acked_after_a_failed_sync_until_the_wal_is_written_out_again(
        &disk,
        dir.path(),
    );
}

/// A consumer core's commit loop commits without a sync of its own while the sync thread syncs the WAL. When
/// that sync fails, the frames it should have written are lost: nothing committed since the last good sync is
/// acked while the disk fails (the commit connection's rewrite of the WAL fails too), and once the WAL has
/// been written out again the acks leave, with every acked delivery on the disk.
fn overlapped_commits_are_not_acked_after_a_failed_sync_until_the_wal_is_written_out_again(
    disk: &Disk,
    dir: &Path,
) {
    let path = dir.join("overlapped.db");
    let config = Config::default().vfs(VFS).checkpoint_thread(false);
    let inbox = Inbox::open(&path, config).unwrap();
    let core = ConsumerCore::new(inbox, SCOPE)
        .overlap_syncs(SyncOverlap::On)
        .storage_retry_limit(std::time::Duration::from_secs(60));
    let sent = common::SentAcks::default();
    let (mut feed, commits) = core.spawn(bump, sent.clone(), 64).unwrap();
    feed.connected(true).unwrap();
    let publish = |feed: &mut edge_inbox::Feed, id: &str, packet_id: u16| {
        let inbound = Inbound::new("orders/1", b"x".to_vec()).with_user_property("message-id", id);
        feed.publish(inbound, Some(packet_id)).unwrap();
    };
    let syncs_before = SYNC_THREAD_SYNCS.load(Ordering::SeqCst);
    publish(&mut feed, "o-1", 1);
    sent.wait_for(1);
    assert!(
        SYNC_THREAD_SYNCS.load(Ordering::SeqCst) > syncs_before,
        "o-1 was acked after a sync of the sync thread"
    );
    check_after_power_cut(disk, "overlapped.db", &["o-1"]);

    // Every sync of the WAL fails now, the sync thread's and the rewrite's.
    FAIL_WAL_SYNC.store(true, Ordering::SeqCst);
    publish(&mut feed, "o-2", 2);
    publish(&mut feed, "o-3", 3);
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(sent.all(), [1], "acked while the disk fails");
    FAIL_WAL_SYNC.store(false, Ordering::SeqCst);
    sent.wait_for(3);
    assert_eq!(sent.all(), [1, 2, 3]);
    check_after_power_cut(disk, "overlapped.db", &["o-1", "o-2", "o-3"]);

    // A stop while the disk fails again: the commit made is left unacked (the broker redelivers it), and
    // the loop ends without waiting out its 10 s for acks that cannot come.
    FAIL_WAL_SYNC.store(true, Ordering::SeqCst);
    publish(&mut feed, "o-4", 4);
    std::thread::sleep(std::time::Duration::from_millis(200));
    let stopping = std::time::Instant::now();
    commits.stop();
    let (core, result) = commits.join();
    let took = stopping.elapsed();
    FAIL_WAL_SYNC.store(false, Ordering::SeqCst);
    let summary = result.unwrap();
    assert!(
        took < std::time::Duration::from_secs(5),
        "the stop took {took:?}"
    );
    assert_eq!(sent.all(), [1, 2, 3], "acked while the disk fails");
    assert_eq!(
        (summary.processed, summary.acked, summary.dropped_stale),
        (4, 3, 1),
        "{summary:?}"
    );
    drop(feed);
    drop(core);
}
