//! The database file may receive a page only once the disk holds it in the WAL. A checkpoint that copies a
//! frame the WAL has not synced yet can, at a power cut during its write-back, leave in the database file
//! pages of a transaction whose frames recovery never sees (the WAL ends before them): half a transaction.
//!
//! A consumer core that overlaps its commits with their syncs commits without a sync of its own, so at
//! every moment its latest commits are in the WAL but not yet on the disk; the checkpoint thread must sync
//! the WAL before it copies them, in its rounds and in its catch-up alike. A VFS models the disk (a write
//! is durable once a sync that began after it succeeded) and checks every page the checkpoint thread writes
//! into the database file against the frames the disk's WAL holds.
//!
//! The same disk then loses a sync of the database file, the catch-up's: the WAL is then the only copy of
//! those pages on the disk, so it must not start over (neither by the commits that follow nor at the
//! inbox's close), and a power cut must lose no acknowledged delivery.
//!
//! And while the checkpoint thread catches up (the commit loop acking what the sync thread's syncs make
//! durable, the asking commit's own deliveries among them), every PUBACK is checked against what the disk
//! holds at the instant it leaves.

#![cfg(feature = "mqtt")]

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use edge_inbox::rusqlite::ffi;
use edge_inbox::{Config, ConsumerCore, Delivery, Inbound, Inbox, SyncOverlap, Tx};

#[path = "../examples/support/wrap_vfs.rs"]
mod wrap_vfs;

mod common;

const VFS: &str = "edge-inbox-checkpoint-wal-order";
const SCOPE: &str = "orders";
const CHECKPOINT_THREAD: &str = "edge-inbox-checkpoint";
const SYNC_THREAD: &str = "edge-inbox-sync";
const WAL_HEADER: usize = 32;
const FRAME_HEADER: usize = 24;
/// The sync thread's syncs and the checkpoint thread's syncs of the database file take 15 ms.
static SLOW: AtomicBool = AtomicBool::new(false);
/// The checkpoint thread's syncs of the database file that begin while set wait until it is cleared.
static HOLD_DB_SYNC: AtomicBool = AtomicBool::new(false);
static HELD: AtomicUsize = AtomicUsize::new(0);
/// The checkpoint thread's syncs of the database file that begin while set fail, and what they should have
/// written never reaches the disk (the kernel marks those pages clean).
static FAIL_DB_SYNC: AtomicBool = AtomicBool::new(false);
static FAILED: AtomicUsize = AtomicUsize::new(0);
/// The tests take turns: the flags and the disk are the process's.
static TURN: Mutex<()> = Mutex::new(());

#[derive(Default)]
struct File {
    name: String,
    durable: Vec<u8>,
    /// Written and not yet known durable, numbered in order: durable once a sync that begins after the
    /// write succeeds.
    pending: Vec<(u64, u64, Option<Vec<u8>>)>,
    writes: u64,
    /// Writes at offset 0: in a WAL, its header, written when the WAL (re)starts.
    header_writes: usize,
}

impl File {
    fn push(&mut self, off: u64, data: Option<Vec<u8>>) {
        self.writes += 1;
        if off == 0 && data.is_some() {
            self.header_writes += 1;
        }
        self.pending.push((self.writes, off, data));
    }
}

#[derive(Default)]
struct Disk {
    dir: Mutex<Option<String>>,
    files: Mutex<Vec<File>>,
    /// Pages the checkpoint thread wrote into the database file that the disk's WAL did not hold.
    unbacked: Mutex<Vec<String>>,
    /// Pages the checkpoint thread wrote into the database file (the test saw checkpoints at all).
    copied: AtomicUsize,
    /// Successful syncs: what the disk holds changes only with them.
    syncs: AtomicUsize,
}

/// Whether the WAL image `wal` holds a frame of page `page` with exactly `data`.
fn wal_holds(wal: &[u8], page: u32, data: &[u8]) -> bool {
    let frame = FRAME_HEADER + data.len();
    let mut at = WAL_HEADER;
    while at + frame <= wal.len() {
        let number = u32::from_be_bytes(wal[at..at + 4].try_into().unwrap());
        if number == page && &wal[at + FRAME_HEADER..at + frame] == data {
            return true;
        }
        at += frame;
    }
    false
}

impl wrap_vfs::Observer for Arc<Disk> {
    fn open(&self, name: Option<&str>, flags: c_int) -> Option<usize> {
        let dir = self.dir.lock().unwrap().clone()?;
        let name = name?;
        if !name.starts_with(&dir) || flags & (ffi::SQLITE_OPEN_MAIN_DB | ffi::SQLITE_OPEN_WAL) == 0
        {
            return None;
        }
        let mut files = self.files.lock().unwrap();
        if let Some(i) = files.iter().position(|f| f.name == name) {
            return Some(i);
        }
        // What a file holds when first opened here (closed before, and synced by its closing checkpoint) is
        // on the disk.
        files.push(File {
            name: name.to_owned(),
            durable: std::fs::read(name).unwrap_or_default(),
            ..File::default()
        });
        Some(files.len() - 1)
    }

    fn write(&self, tag: usize, off: u64, data: &[u8]) {
        let mut files = self.files.lock().unwrap();
        let is_db = !files[tag].name.ends_with("-wal");
        if is_db && std::thread::current().name() == Some(CHECKPOINT_THREAD) {
            self.copied.fetch_add(1, Ordering::SeqCst);
            let page = (off / data.len() as u64 + 1) as u32;
            let wal_name = format!("{}-wal", files[tag].name);
            let held = files
                .iter()
                .find(|f| f.name == wal_name)
                .is_some_and(|w| wal_holds(&w.durable, page, data));
            if !held {
                self.unbacked
                    .lock()
                    .unwrap()
                    .push(format!("page {page} at offset {off}"));
            }
        }
        files[tag].push(off, Some(data.to_vec()));
    }

    fn truncate(&self, tag: usize, size: u64) {
        self.files.lock().unwrap()[tag].push(size, None);
    }

    fn sync(&self, tag: usize, real: &mut dyn FnMut() -> c_int) -> c_int {
        // Only what was written before the sync began is sure to be on the disk when it ends.
        let covered = self.files.lock().unwrap()[tag].writes;
        let thread = std::thread::current();
        let wal = self.files.lock().unwrap()[tag].name.ends_with("-wal");
        let checkpoint_db = !wal && thread.name() == Some(CHECKPOINT_THREAD);
        if SLOW.load(Ordering::SeqCst) && (thread.name() == Some(SYNC_THREAD) || checkpoint_db) {
            // A card's sync: the commits made meanwhile stay in the WAL unsynced for a while, and commits
            // land while a round of the checkpoint thread syncs the database file (so that a catch-up
            // follows the rounds).
            std::thread::sleep(Duration::from_millis(15));
        }
        if checkpoint_db {
            let fail = FAIL_DB_SYNC.load(Ordering::SeqCst);
            if HOLD_DB_SYNC.load(Ordering::SeqCst) {
                HELD.fetch_add(1, Ordering::SeqCst);
                wait_until("the test releasing a sync of the database file", || {
                    !HOLD_DB_SYNC.load(Ordering::SeqCst)
                });
                HELD.fetch_sub(1, Ordering::SeqCst);
            }
            if fail {
                let mut files = self.files.lock().unwrap();
                files[tag].pending.retain(|(n, _, _)| *n > covered);
                FAILED.fetch_add(1, Ordering::SeqCst);
                return ffi::SQLITE_IOERR_FSYNC;
            }
        }
        let rc = real();
        if rc == ffi::SQLITE_OK {
            let mut files = self.files.lock().unwrap();
            let f = &mut files[tag];
            // Another connection's sync may have made some of them durable meanwhile.
            let (done, left) = std::mem::take(&mut f.pending)
                .into_iter()
                .partition(|(n, _, _)| *n <= covered);
            f.pending = left;
            for (_, off, data) in done {
                common::apply_write(&mut f.durable, off, data.as_deref());
            }
            self.syncs.fetch_add(1, Ordering::SeqCst);
        }
        rc
    }

    fn delete(&self, name: &str) {
        // An unlink is on the disk at once here: a file made again at that path starts empty.
        for f in self
            .files
            .lock()
            .unwrap()
            .iter_mut()
            .filter(|f| f.name == name)
        {
            f.durable.clear();
            f.pending.clear();
        }
    }

    fn mmap(&self) -> bool {
        false
    }
}

/// Clears the switches when made and when dropped: a test that fails half-way must not leave the checkpoint
/// thread held in a sync (its inbox's drop joins it) nor the next test's syncs failing. Made after the
/// inbox, so that it is dropped first.
struct Switches;

impl Switches {
    fn clear() -> Switches {
        drop(Switches);
        Switches
    }
}

impl Drop for Switches {
    fn drop(&mut self) {
        SLOW.store(false, Ordering::SeqCst);
        HOLD_DB_SYNC.store(false, Ordering::SeqCst);
        FAIL_DB_SYNC.store(false, Ordering::SeqCst);
    }
}

/// A consumer core overlapping its commits with their syncs, on a new inbox in `dir` seen by the disk, with
/// slow syncs and a small threshold: rounds and catch-ups every few batches.
fn slow_overlapping_core(disk: &Disk, dir: &std::path::Path) -> ConsumerCore {
    *disk.dir.lock().unwrap() = Some(dir.to_str().unwrap().to_owned());
    SLOW.store(true, Ordering::SeqCst);
    let config = Config::default().vfs(VFS).wal_autocheckpoint(16);
    let inbox = Inbox::open(dir.join("inbox.db"), config).unwrap();
    ConsumerCore::new(inbox, SCOPE).overlap_syncs(SyncOverlap::On)
}

/// Stops the commit loop once every PUBACK left, checks it processed `n` deliveries, closes its inbox and
/// ends the slow syncs.
fn stop_loop(commits: edge_inbox::CommitThread, feed: edge_inbox::Feed, n: usize) {
    commits.stop();
    let (core, result) = commits.join();
    let summary = result.unwrap();
    assert_eq!(summary.processed, n as u64, "{summary:?}");
    drop(feed);
    drop(core);
    SLOW.store(false, Ordering::SeqCst);
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn disk() -> Arc<Disk> {
    static DISK: std::sync::OnceLock<Arc<Disk>> = std::sync::OnceLock::new();
    static ONCE: Once = Once::new();
    let d = DISK.get_or_init(Arc::default).clone();
    ONCE.call_once(|| wrap_vfs::register(VFS, Arc::new(d.clone()), false));
    d
}

fn bump(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let n: i64 = tx.get(d.message_id)?.unwrap_or(0);
    tx.put(d.message_id, &(n + 1))?;
    Ok(())
}

#[test]
fn checkpoints_copy_only_frames_the_disk_holds_while_commits_overlap_their_syncs() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let disk = disk();
    let dir = tempfile::tempdir().unwrap();
    disk.unbacked.lock().unwrap().clear();
    disk.copied.store(0, Ordering::SeqCst);
    let _switches = Switches::clear();
    let core = slow_overlapping_core(&disk, dir.path());
    let sent = common::SentAcks::default();
    let (mut feed, commits) = core.spawn(bump, sent.clone(), 64).unwrap();
    feed.connected(true).unwrap();
    let n = common::scaled(600).max(200);
    for i in 0..n {
        let id = format!("m-{i}");
        let inbound =
            Inbound::new("orders/1", id.clone().into_bytes()).with_user_property("message-id", &id);
        feed.publish(inbound, Some((i % 60_000 + 1) as u16))
            .unwrap();
        if i % 8 == 7 {
            // Deliveries arrive in small groups, so that many commits (and checkpoints) follow each other.
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    sent.wait_for(n);
    stop_loop(commits, feed, n);
    let copied = disk.copied.load(Ordering::SeqCst);
    assert!(copied > 0, "the checkpoint thread copied no page");
    let unbacked = disk.unbacked.lock().unwrap().clone();
    assert!(
        unbacked.is_empty(),
        "{} of {copied} pages copied into the database file before the disk held them in the WAL: {:?}",
        unbacked.len(),
        &unbacked[..unbacked.len().min(10)]
    );
}

/// Sends no PUBACK: checks, at the instant each would leave, that the files as the disk holds them then
/// hold its delivery (packet id `i + 1` for message `m-{i}`), as a power cut at that instant would leave
/// them.
struct DurableAcks {
    disk: Arc<Disk>,
    dir: std::path::PathBuf,
    /// The files as the disk held them at its latest sync, open: (syncs then, their directory, connection).
    image: Mutex<Option<(usize, tempfile::TempDir, edge_inbox::rusqlite::Connection)>>,
    /// (packet id, whether the disk held its delivery when it left).
    sent: Arc<Mutex<Vec<(u16, bool)>>>,
}

impl edge_inbox::PubAckSender for DurableAcks {
    fn try_puback(&self, packet_id: u16) -> bool {
        let id = format!("m-{}", packet_id - 1);
        let mut image = self.image.lock().unwrap();
        // Taken again only when a sync changed what the disk holds: a copy per PUBACK would slow the loop.
        let syncs = self.disk.syncs.load(Ordering::SeqCst);
        if image.as_ref().is_none_or(|(at, _, _)| *at != syncs) {
            *image = None;
            *image = Some(disk_image(&self.disk, &self.dir));
        }
        let (_, _, conn) = image.as_ref().unwrap();
        let held = conn
            .query_row("SELECT count(*) FROM kv WHERE key = ?1", [&id], |r| {
                r.get::<_, i64>(0)
            })
            .unwrap()
            == 1;
        self.sent.lock().unwrap().push((packet_id, held));
        true
    }
}

/// The files under `dir` as the disk holds them now, copied to a directory of their own and opened
/// (SQLite recovers the WAL as after a power cut), with the disk's count of syncs they reflect.
fn disk_image(
    disk: &Disk,
    dir: &std::path::Path,
) -> (usize, tempfile::TempDir, edge_inbox::rusqlite::Connection) {
    let cut = tempfile::tempdir().unwrap();
    let files = disk.files.lock().unwrap();
    // Counted under the files' lock, which every sync holds while it changes them.
    let syncs = disk.syncs.load(Ordering::SeqCst);
    for f in files.iter() {
        if let Some(rest) = f.name.strip_prefix(dir.to_str().unwrap()) {
            let name = std::path::Path::new(rest).file_name().unwrap();
            std::fs::write(cut.path().join(name), &f.durable).unwrap();
        }
    }
    drop(files);
    let conn = edge_inbox::rusqlite::Connection::open(cut.path().join("inbox.db")).unwrap();
    (syncs, cut, conn)
}

/// While the checkpoint thread catches up with the WAL, the commit loop goes on acking what the sync
/// thread's syncs make durable (the commit that asked for the catch-up among them) and commits nothing.
/// Every PUBACK is checked at the instant it leaves, with catch-ups every few batches (a small threshold).
/// Fails when an ack leaves before a sync that began after its commit succeeded.
#[test]
fn every_puback_is_on_the_disk_when_it_leaves_also_behind_a_catch_up() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let disk = disk();
    let dir = tempfile::tempdir().unwrap();
    let _switches = Switches::clear();
    let core = slow_overlapping_core(&disk, dir.path());
    let sent = Arc::new(Mutex::new(Vec::new()));
    let acks = DurableAcks {
        disk: disk.clone(),
        dir: dir.path().to_owned(),
        image: Mutex::new(None),
        sent: sent.clone(),
    };
    let (mut feed, commits) = core.spawn(bump, acks, 64).unwrap();
    feed.connected(true).unwrap();
    // Until the WAL has started over a few times (each time behind a commit that waited for a catch-up),
    // bounded in deliveries and in time.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut n = 0;
    while n < 20_000 && std::time::Instant::now() < deadline {
        let id = format!("m-{n}");
        let inbound =
            Inbound::new("orders/1", id.clone().into_bytes()).with_user_property("message-id", &id);
        feed.publish(inbound, Some((n + 1) as u16)).unwrap();
        n += 1;
        if n % 8 == 0 {
            std::thread::sleep(Duration::from_millis(2));
            // No more than a few hundred in flight: what is published must also be acked in time on a slow
            // machine.
            while n - sent.lock().unwrap().len() > 256 && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if n >= 200 && wal_starts(&disk, dir.path()) >= 8 {
                break;
            }
        }
    }
    wait_until("every PUBACK", || sent.lock().unwrap().len() >= n);
    stop_loop(commits, feed, n);
    *disk.dir.lock().unwrap() = None;
    let wal_starts = wal_starts(&disk, dir.path());
    assert!(
        wal_starts >= 8,
        "the WAL started over {wal_starts} times: too few catch-ups to test"
    );
    let early: Vec<u16> = sent
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, held)| !held)
        .map(|&(p, _)| p)
        .collect();
    assert!(
        early.is_empty(),
        "{} of {n} PUBACKs left before the disk held their delivery (packet ids {:?})",
        early.len(),
        &early[..early.len().min(10)]
    );
}

/// Times the WAL of the inbox in `dir` started over (its header written again).
fn wal_starts(disk: &Disk, dir: &std::path::Path) -> usize {
    let wal = dir.join("inbox.db-wal");
    disk.files
        .lock()
        .unwrap()
        .iter()
        .find(|f| std::path::Path::new(&f.name) == wal)
        .map_or(0, |f| f.header_writes.saturating_sub(1))
}

fn deliver(inbox: &mut Inbox, i: usize) -> edge_inbox::Result<edge_inbox::Outcome> {
    let id = format!("c-{i}");
    inbox.process(&Delivery::new(SCOPE, &id, "orders/1", b"x"), bump)
}

/// Frames in the WAL file (its length: it does not shrink when the WAL starts over).
fn wal_frames(dir: &std::path::Path) -> u64 {
    std::fs::metadata(dir.join("inbox.db-wal"))
        .map_or(0, |m| m.len())
        .saturating_sub(WAL_HEADER as u64)
        / (4096 + FRAME_HEADER as u64)
}

/// The catch-up's sync of the database file fails (the rounds' succeeded): the pages it copied are then on
/// the disk only in the WAL, which must never start over, and a power cut later loses no acknowledged
/// delivery. Fails when the catch-up lets the WAL start over after that failure.
#[test]
fn a_failed_sync_of_the_catch_up_keeps_the_wal_for_a_power_cut() {
    failed_catch_up_then_power_cut(80);
}

/// The same, closing the inbox right after the failure: every frame counts as copied, so the close must
/// write nothing (a write would start the WAL over, the pin being gone with the thread). Fails when the
/// close saves its counters as usual.
#[test]
fn an_inbox_closed_right_after_a_failed_sync_of_the_catch_up_keeps_the_wal() {
    failed_catch_up_then_power_cut(0);
}

/// A catch-up whose sync of the database file fails, `more` deliveries after it, a close, a power cut.
fn failed_catch_up_then_power_cut(more_after: usize) {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let disk = disk();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    // A large identity index (outside the model: the file is on the disk once closed), so that the pages
    // the catch-up copies are mostly not written again by the commits after it.
    {
        let mut inbox = Inbox::open(&path, Config::default()).unwrap();
        let ids: Vec<String> = (0..50_000).map(|k| format!("p-{k}")).collect();
        for chunk in ids.chunks(5000) {
            let batch: Vec<Delivery<'_>> = chunk
                .iter()
                .map(|id| Delivery::new(SCOPE, id, "orders/1", b"x"))
                .collect();
            inbox
                .process_batch(&batch, |_: &mut Tx<'_>, _: &Delivery<'_>| Ok(()))
                .unwrap();
        }
    }
    *disk.dir.lock().unwrap() = Some(dir.path().to_str().unwrap().to_owned());
    const THRESHOLD: u64 = 40;
    let config = Config::default()
        .vfs(VFS)
        .wal_autocheckpoint(THRESHOLD as u32);
    let mut inbox = Inbox::open(&path, config).unwrap();
    let _switches = Switches::clear();
    FAILED.store(0, Ordering::SeqCst);
    let mut acked = Vec::new();
    let mut i = 0;
    // The first round's sync of the database file is held while commits go on, until the WAL reaches the
    // catch-up point (three thresholds while rounds run): that commit asks for the catch-up (and, the
    // thread being busy, goes on after a short wait).
    HOLD_DB_SYNC.store(true, Ordering::SeqCst);
    while wal_frames(dir.path()) < THRESHOLD && i < 10_000 {
        deliver(&mut inbox, i).unwrap();
        acked.push(i);
        i += 1;
    }
    wait_until("a round's sync of the database file", || {
        HELD.load(Ordering::SeqCst) >= 1
    });
    while wal_frames(dir.path()) <= 3 * THRESHOLD + 4 && i < 10_000 {
        deliver(&mut inbox, i).unwrap();
        acked.push(i);
        i += 1;
    }
    // The held round's sync succeeds; the catch-up's, which follows it, fails.
    FAIL_DB_SYNC.store(true, Ordering::SeqCst);
    HOLD_DB_SYNC.store(false, Ordering::SeqCst);
    wait_until("the catch-up's failed sync", || {
        FAILED.load(Ordering::SeqCst) >= 1
    });
    // Commits go on (the WAL grows); a few may be refused while the WAL is written out again.
    let mut more = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while more < more_after && std::time::Instant::now() < deadline {
        if deliver(&mut inbox, i).is_ok() {
            acked.push(i);
            more += 1;
        }
        i += 1;
    }
    drop(inbox);
    FAIL_DB_SYNC.store(false, Ordering::SeqCst);
    *disk.dir.lock().unwrap() = None;

    // The power cut: the files as the disk holds them.
    let cut = tempfile::tempdir().unwrap();
    for f in disk.files.lock().unwrap().iter() {
        if let Some(rest) = f.name.strip_prefix(dir.path().to_str().unwrap()) {
            let name = std::path::Path::new(rest).file_name().unwrap();
            std::fs::write(cut.path().join(name), &f.durable).unwrap();
        }
    }
    let mut after = Inbox::open(cut.path().join("inbox.db"), Config::default()).unwrap();
    let integrity: String = after
        .connection()
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(integrity, "ok");
    let lost: Vec<usize> = acked
        .iter()
        .copied()
        .filter(|&k| {
            !matches!(
                after.status(SCOPE, None, &format!("c-{k}")).unwrap(),
                edge_inbox::Status::Recorded { .. }
            )
        })
        .collect();
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged deliveries lost at the power cut: {:?}",
        lost.len(),
        acked.len(),
        &lost[..lost.len().min(10)]
    );
}
