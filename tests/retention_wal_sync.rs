//! `Pruning::sync_after_steps`: the pruner syncs the WAL after each step itself, outside the write lock
//! (issue 26). Its steps commit without a sync, and their scattered frames are otherwise flushed by a
//! consumer's next commit, inside the consumer's own fsync. Observed through a VFS that wraps the platform's and watches the WAL's syncs
//! per thread (each connection here is used on a thread of its own).

use std::cell::{Cell, RefCell};
use std::ffi::c_int;
use std::sync::mpsc;
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use edge_inbox::rusqlite::ffi;
use edge_inbox::{Config, Inbox, Pruning, Synchronous};

mod common;
#[path = "../examples/support/wrap_vfs.rs"]
mod wrap_vfs;

const VFS: &str = "edge-inbox-wal-sync-watch";
const SCOPE: &str = "history";
/// The option under test (`false` is the unchanged behaviour, for checking that these tests fail there).
const SYNC: bool = true;

/// Held by a thread whose next WAL sync must wait: says when the sync started, then waits to be released.
struct Gate {
    started: mpsc::Sender<Event>,
    release: mpsc::Receiver<()>,
}

enum Event {
    SyncStarted,
    StepReturned(Result<edge_inbox::PruneReport, String>),
}

thread_local! {
    /// Syncs of a WAL on this thread, bytes this thread wrote to a WAL, and WAL headers it wrote (the WAL
    /// starting over: SQLite syncs the new header at once, inside the commit, at any `synchronous` level).
    static WAL_SYNCS: Cell<u64> = const { Cell::new(0) };
    static WAL_WRITTEN: Cell<u64> = const { Cell::new(0) };
    static WAL_HEADERS: Cell<u64> = const { Cell::new(0) };
    static GATE: RefCell<Option<Gate>> = const { RefCell::new(None) };
}

struct Watch;

impl wrap_vfs::Observer for Watch {
    fn open(&self, _name: Option<&str>, flags: c_int) -> Option<usize> {
        (flags & ffi::SQLITE_OPEN_WAL != 0).then_some(0)
    }

    fn write(&self, _tag: usize, off: u64, data: &[u8]) {
        WAL_WRITTEN.with(|w| w.set(w.get() + data.len() as u64));
        if off == 0 {
            WAL_HEADERS.with(|h| h.set(h.get() + 1));
        }
    }

    fn sync(&self, _tag: usize, real: &mut dyn FnMut() -> c_int) -> c_int {
        WAL_SYNCS.with(|s| s.set(s.get() + 1));
        if let Some(gate) = GATE.with(|g| g.borrow_mut().take()) {
            let _ = gate.started.send(Event::SyncStarted);
            let _ = gate.release.recv_timeout(Duration::from_secs(120));
        }
        real()
    }
}

fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| wrap_vfs::register(VFS, Arc::new(Watch), false));
}

fn watched(sync: Synchronous) -> Config {
    Config::default().vfs(VFS).synchronous(sync)
}

/// What one step did to the WAL on its thread.
struct Step {
    written: u64,
    syncs: u64,
    headers: u64,
    report: edge_inbox::PruneReport,
}

/// Every step of a whole pass.
fn pass(inbox: &mut Inbox, opts: &Pruning) -> Vec<Step> {
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut steps = Vec::new();
    loop {
        assert!(Instant::now() < deadline, "the pass did not finish in time");
        let (w, s, h) = (
            WAL_WRITTEN.with(Cell::get),
            WAL_SYNCS.with(Cell::get),
            WAL_HEADERS.with(Cell::get),
        );
        let report = inbox.prune_step(opts).unwrap();
        steps.push(Step {
            written: WAL_WRITTEN.with(Cell::get) - w,
            syncs: WAL_SYNCS.with(Cell::get) - s,
            headers: WAL_HEADERS.with(Cell::get) - h,
            report,
        });
        if report.done {
            return steps;
        }
    }
}

/// With the option at `synchronous=FULL`, every step that wrote WAL frames is followed by a sync of the WAL
/// on the pruner's own connection (not only the steps that happen to checkpoint), so no consumer's commit
/// has to flush them.
#[test]
fn every_prune_step_that_wrote_the_wal_syncs_it_on_the_pruners_connection() {
    register();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    common::old_processed_file(&path, SCOPE, 2_000);
    let mut pruner = Inbox::open(&path, watched(Synchronous::Full)).unwrap();
    let steps = pass(&mut pruner, &Pruning::default().sync_after_steps(SYNC));
    let pruned: u64 = steps.iter().map(|s| s.report.payloads_pruned).sum();
    assert_eq!(pruned, 2_000);
    let writing = steps.iter().filter(|s| s.written > 0).count();
    assert!(writing > 50, "{writing} steps wrote the WAL");
    let unsynced: Vec<usize> = steps
        .iter()
        .enumerate()
        .filter(|(_, s)| s.written > 0 && s.syncs == 0)
        .map(|(i, _)| i)
        .collect();
    assert!(
        unsynced.is_empty(),
        "{} of {} steps that wrote WAL frames left them unsynced (steps {:?}...)",
        unsynced.len(),
        writing,
        &unsynced[..unsynced.len().min(10)]
    );
}

/// At `synchronous=NORMAL` nothing on the file syncs at commit, so even with the option the pruner adds no
/// sync of its own: the
/// only WAL syncs of a pass are its checkpoints' and SQLite's own when the WAL starts over.
#[test]
fn a_pruner_at_synchronous_normal_adds_no_sync_to_its_steps() {
    register();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    common::old_processed_file(&path, SCOPE, 1_000);
    let mut pruner = Inbox::open(&path, watched(Synchronous::Normal)).unwrap();
    let steps = pass(&mut pruner, &Pruning::default().sync_after_steps(SYNC));
    let synced_without_checkpoint = steps
        .iter()
        .filter(|s| s.syncs > 0 && s.headers == 0 && s.report.checkpoints == 0 && !s.report.done)
        .count();
    assert_eq!(
        synced_without_checkpoint,
        0,
        "of {} steps, {synced_without_checkpoint} synced the WAL without a checkpoint",
        steps.len()
    );
}

/// The pruner's sync runs after its step released the write lock: while that sync is held up (an SD card
/// taking its time), another connection starts a write transaction at once, without waiting.
#[test]
fn the_pruners_wal_sync_runs_outside_the_write_lock() {
    register();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    common::old_processed_file(&path, SCOPE, 500);
    let (events, received) = mpsc::channel();
    let (release, released) = mpsc::channel();
    let pruner = {
        let path = path.clone();
        std::thread::spawn(move || {
            // No checkpoint by the pruner: the only sync its step may run is the one after the commit.
            let opts = Pruning::default()
                .checkpoint_pages(0)
                .sync_after_steps(SYNC);
            let mut inbox = Inbox::open(&path, watched(Synchronous::Full)).unwrap();
            // The first step after the setup's checkpoint starts the WAL over, and SQLite syncs the new
            // header inside that commit: it is not the sync looked at here. The second step appends.
            let first = inbox.prune_step(&opts).map_err(|e| e.to_string());
            assert_eq!(first.map(|r| r.payloads_pruned), Ok(32));
            GATE.with(|g| {
                *g.borrow_mut() = Some(Gate {
                    started: events.clone(),
                    release: released,
                })
            });
            let step = inbox.prune_step(&opts).map_err(|e| e.to_string());
            GATE.with(|g| g.borrow_mut().take());
            let _ = events.send(Event::StepReturned(step));
        })
    };
    match received.recv_timeout(Duration::from_secs(120)) {
        Ok(Event::SyncStarted) => {}
        Ok(Event::StepReturned(step)) => {
            panic!("the prune step returned without syncing the WAL: {step:?}")
        }
        Err(e) => panic!("neither a sync nor the step's end: {e}"),
    }
    // The pruner is inside its WAL sync now. No busy timeout: a write lock still held fails at once.
    let other = edge_inbox::rusqlite::Connection::open(&path).unwrap();
    other.busy_timeout(Duration::ZERO).unwrap();
    let begun = other.execute_batch("BEGIN IMMEDIATE");
    release.send(()).unwrap();
    match received.recv_timeout(Duration::from_secs(120)) {
        Ok(Event::StepReturned(step)) => {
            let step = step.expect("the step succeeded");
            assert_eq!(step.payloads_pruned, 32);
        }
        _ => panic!("the prune step did not return"),
    }
    pruner.join().unwrap();
    begun.expect("another connection took the write lock while the pruner synced the WAL");
    other.execute_batch("ROLLBACK").unwrap();
}
