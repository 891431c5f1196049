//! Commits overlapping their syncs ([`SyncOverlap`]), on a real file through a VFS that makes every sync 3 ms
//! slower (an SD card) and counts the WAL syncs made by the inbox's sync thread. That the PUBACKs wait for a
//! sync covering their commit is checked by cutting the power in `tests/power_loss.rs`, and after a failed
//! sync in `tests/wal_sync_failure.rs`; here: that the overlap is used where it should be and not elsewhere
//! (also when the sync time changes mid-stream), that acks and events still leave complete and in arrival
//! order, at a stop and when the feed is dropped, that a stop sends each sync's acks as it ends, and that acks
//! waiting for a sync when their connection ends never leave on the next one.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use edge_inbox::rusqlite::ffi;
use edge_inbox::{
    Config, ConsumerCore, Delivery, Feed, HealthEvent, Inbound, Inbox, RunSummary, Settled,
    SyncOverlap, Tx,
};

mod common;
use common::SentAcks;

#[path = "../examples/support/wrap_vfs.rs"]
mod wrap_vfs;

const VFS: &str = "edge-inbox-slow-card";
const SYNC_THREAD: &str = "edge-inbox-sync";
const SCOPE: &str = "inventory-reservation";

/// WAL syncs by the sync thread, per database file name (tests run in parallel, each on its own file).
static SYNC_THREAD_SYNCS: Mutex<Vec<(String, u64)>> = Mutex::new(Vec::new());
static OPENED: AtomicU64 = AtomicU64::new(0);

struct SlowCard;

impl wrap_vfs::Observer for SlowCard {
    fn open(&self, name: Option<&str>, flags: c_int) -> Option<usize> {
        let name = name?;
        if flags & ffi::SQLITE_OPEN_WAL == 0 {
            return None;
        }
        OPENED.fetch_add(1, Ordering::Relaxed);
        let db = std::path::Path::new(name.trim_end_matches("-wal"))
            .file_name()?
            .to_string_lossy()
            .into_owned();
        let mut syncs = SYNC_THREAD_SYNCS.lock().unwrap();
        if let Some(i) = syncs.iter().position(|(n, _)| *n == db) {
            return Some(i);
        }
        syncs.push((db, 0));
        Some(syncs.len() - 1)
    }

    fn sync(&self, tag: usize, real: &mut dyn FnMut() -> c_int) -> c_int {
        let (delay, db_is_switching) = {
            let mut syncs = SYNC_THREAD_SYNCS.lock().unwrap();
            if std::thread::current().name() == Some(SYNC_THREAD) {
                syncs[tag].1 += 1;
            }
            (delay_for(&syncs[tag].0), syncs[tag].0 == "switching.db")
        };
        // The fast phases of `switching.db` stand for a fast disk whatever the machine's load: no sync at
        // all (that test checks which thread syncs, not durability).
        if db_is_switching && delay.is_zero() {
            return ffi::SQLITE_OK;
        }
        let by_sync_thread = std::thread::current().name() == Some(SYNC_THREAD);
        let db = SYNC_THREAD_SYNCS.lock().unwrap()[tag].0.clone();
        if by_sync_thread && db == "stopping.db" {
            STOPPING_SYNC_STARTS.lock().unwrap().push(Instant::now());
        }
        let rc = real();
        std::thread::sleep(delay);
        if by_sync_thread && db == "stalled.db" {
            // Bounded: a test that fails still ends.
            let deadline = Instant::now() + Duration::from_secs(60);
            while STALLED.load(Ordering::Relaxed) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if by_sync_thread && db == "stopping.db" {
            STOPPING_SYNC_ENDS.lock().unwrap().push(Instant::now());
        }
        rc
    }
}

/// While set, the sync thread's syncs of `stalled.db` do not end (a card busy with its own housekeeping).
static STALLED: AtomicBool = AtomicBool::new(false);

/// When each sync of `stopping.db` by the sync thread began, and when it returned.
static STOPPING_SYNC_STARTS: Mutex<Vec<Instant>> = Mutex::new(Vec::new());
static STOPPING_SYNC_ENDS: Mutex<Vec<Instant>> = Mutex::new(Vec::new());

/// The sync delay of `switching.db`, in microseconds (changed while its consumer runs).
static SWITCHING_DELAY_US: AtomicU64 = AtomicU64::new(0);

/// Every file's syncs take 3 ms more, but for three: `lost.db` 50 ms, so that its acks are still waiting
/// when the connection ends, `stopping.db` [`STOPPING_SYNC`], and `switching.db` what
/// [`SWITCHING_DELAY_US`] says.
fn delay_for(db: &str) -> Duration {
    match db {
        "lost.db" => Duration::from_millis(50),
        "stopping.db" => STOPPING_SYNC,
        "switching.db" => Duration::from_micros(SWITCHING_DELAY_US.load(Ordering::Relaxed)),
        _ => Duration::from_millis(3),
    }
}

fn slow_card() -> Config {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| wrap_vfs::register(VFS, Arc::new(SlowCard), false));
    Config::default().vfs(VFS)
}

fn sync_thread_syncs(db: &str) -> u64 {
    SYNC_THREAD_SYNCS
        .lock()
        .unwrap()
        .iter()
        .find(|(n, _)| n == db)
        .map_or(0, |(_, k)| *k)
}

fn bump(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let n: i64 = tx.get(d.message_id)?.unwrap_or(0);
    tx.put(d.message_id, &(n + 1))?;
    Ok(())
}

fn publish(feed: &mut Feed, id: &str, packet_id: u16) {
    let inbound =
        Inbound::new("orders/created", id.as_bytes().to_vec()).with_user_property("message-id", id);
    feed.publish(inbound, Some(packet_id)).unwrap();
}

/// Feeds `n` deliveries (packet ids 1..), with a pass-through publish of another subscription after every
/// fifth; returns the packet ids in arrival order.
fn feed_all(feed: &mut Feed, n: usize) -> Vec<u16> {
    let mut order = Vec::new();
    let mut packet_id = 0u16;
    for k in 0..n {
        packet_id += 1;
        publish(feed, &format!("evt-{k:04}"), packet_id);
        order.push(packet_id);
        if k % 5 == 4 {
            packet_id += 1;
            feed.pass_through(packet_id).unwrap();
            order.push(packet_id);
        }
    }
    order
}

/// Runs `core` on its commit thread over `n` deliveries (with pass-throughs, [`feed_all`]), waits for every
/// PUBACK, then ends the loop with a stop, or by dropping the feed (`drop_feed`). Returns the core, the
/// run's summary, the PUBACKs sent and the arrival order.
fn run(
    core: ConsumerCore,
    n: usize,
    drop_feed: bool,
) -> (ConsumerCore, RunSummary, Vec<u16>, Vec<u16>) {
    let sent = SentAcks::default();
    let (mut feed, commits) = core.spawn(bump, sent.clone(), 1000).unwrap();
    feed.connected(true).unwrap();
    let order = feed_all(&mut feed, n);
    if drop_feed {
        // No stop: the loop ends because its feed is gone, after the last batch is committed, synced and
        // acked.
        drop(feed);
    } else {
        sent.wait_for(order.len());
        commits.stop();
    }
    let (core, result) = commits.join();
    (core, result.unwrap(), sent.all(), order)
}

#[test]
fn on_a_slow_card_commits_overlap_their_syncs_and_acks_leave_in_arrival_order() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("auto.db"), slow_card()).unwrap();
    // One delivery per commit: taking turns with the disk, 60 commits would need 60 syncs.
    let mut core = ConsumerCore::new(inbox, SCOPE).batch(1, Duration::ZERO);
    let events = core.events(1000);
    let (mut core, summary, sent, order) = run(core, 60, false);
    assert_eq!(sent, order, "PUBACKs in arrival order");
    assert_eq!(summary.processed, 60, "{summary:?}");
    assert_eq!(summary.batches, 60, "{summary:?}");
    let overlapped = sync_thread_syncs("auto.db");
    // The first commits sync themselves (the automatic mode measures them first); the rest share the
    // sync thread's syncs.
    assert!(
        overlapped > 0 && overlapped < 55,
        "{overlapped} syncs by the sync thread for 60 commits"
    );
    let delivered: Vec<String> = std::iter::from_fn(|| events.try_recv())
        .filter_map(|e| match e {
            HealthEvent::Delivery {
                message_id,
                outcome: Settled::Processed,
                ..
            } => message_id,
            _ => None,
        })
        .collect();
    let expected: Vec<String> = (0..60).map(|k| format!("evt-{k:04}")).collect();
    assert_eq!(delivered, expected, "one event per delivery, in order");
    // Every effect once, and the connection back at FULL for the application's own commits.
    let inbox = core.inbox();
    let level: i64 = inbox
        .connection()
        .query_row("PRAGMA synchronous", [], |r| r.get(0))
        .unwrap();
    assert_eq!(level, 2);
    let stats = inbox.scope_stats(SCOPE).unwrap();
    assert_eq!(stats.processed, 60);
}

#[test]
fn with_the_overlap_off_the_sync_thread_never_syncs() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("off.db"), slow_card()).unwrap();
    let core = ConsumerCore::new(inbox, SCOPE)
        .batch(1, Duration::ZERO)
        .overlap_syncs(SyncOverlap::Off);
    let (_core, summary, sent, order) = run(core, 20, false);
    assert_eq!(summary.processed, 20);
    assert_eq!(sent, order);
    assert!(OPENED.load(Ordering::Relaxed) > 0);
    assert_eq!(sync_thread_syncs("off.db"), 0);
}

#[test]
fn a_dropped_feed_ends_the_loop_once_every_commit_is_synced_and_acked() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("dropped.db"), slow_card()).unwrap();
    let core = ConsumerCore::new(inbox, SCOPE)
        .batch(4, Duration::ZERO)
        .overlap_syncs(SyncOverlap::On);
    let (_core, summary, sent, order) = run(core, 30, true);
    assert_eq!(summary.processed, 30, "{summary:?}");
    assert_eq!(summary.dropped_stale, 0, "{summary:?}");
    assert_eq!(sent, order);
    assert!(sync_thread_syncs("dropped.db") > 0);
}

#[test]
fn events_of_deliveries_without_acks_still_leave_once_synced() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("qos0.db"), slow_card()).unwrap();
    let mut core = ConsumerCore::new(inbox, SCOPE)
        .batch(4, Duration::ZERO)
        .overlap_syncs(SyncOverlap::On);
    let events = core.events(1000);
    let sent = SentAcks::default();
    let (mut feed, commits) = core.spawn(bump, sent.clone(), 1000).unwrap();
    feed.connected(true).unwrap();
    // QoS0: no PUBACK to wait for; the loop ends because its feed is gone.
    for k in 0..20 {
        let id = format!("qos0-{k:02}");
        let inbound = Inbound::new("orders/created", id.clone().into_bytes())
            .with_user_property("message-id", id);
        feed.publish(inbound, None).unwrap();
    }
    drop(feed);
    let (_core, result) = commits.join();
    assert_eq!(result.unwrap().processed, 20);
    assert!(sent.all().is_empty());
    let processed = std::iter::from_fn(|| events.try_recv())
        .filter(|e| {
            matches!(
                e,
                HealthEvent::Delivery {
                    outcome: Settled::Processed,
                    ..
                }
            )
        })
        .count();
    assert_eq!(processed, 20, "an event for every delivery");
}

/// Feeds deliveries `from..to` one at a time, each after the PUBACK of the one before (so that every commit
/// holds one delivery and, overlapping, every sync covers one commit).
fn feed_one_by_one(feed: &mut Feed, sent: &SentAcks, from: u16, to: u16) {
    for packet_id in from..to {
        publish(feed, &format!("sw-{packet_id:04}"), packet_id);
        sent.wait_for(usize::from(packet_id));
    }
}

#[test]
fn the_automatic_mode_follows_the_sync_time_both_ways_mid_stream() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("switching.db"), slow_card()).unwrap();
    let core = ConsumerCore::new(inbox, SCOPE).batch(1, Duration::ZERO);
    let sent = SentAcks::default();
    let (mut feed, commits) = core.spawn(bump, sent.clone(), 1000).unwrap();
    feed.connected(true).unwrap();
    // A fast disk: every commit syncs itself.
    feed_one_by_one(&mut feed, &sent, 1, 41);
    let fast = sync_thread_syncs("switching.db");
    // The card slows down: the commits' own syncs take 3 ms, and the loop hands syncs to the sync thread.
    SWITCHING_DELAY_US.store(3000, Ordering::Relaxed);
    feed_one_by_one(&mut feed, &sent, 41, 101);
    let slow = sync_thread_syncs("switching.db");
    // Fast again: once the sync thread's syncs are measured fast, commits sync themselves again, and the
    // last 40 use no sync thread at all.
    SWITCHING_DELAY_US.store(0, Ordering::Relaxed);
    feed_one_by_one(&mut feed, &sent, 101, 201);
    let fast_again = sync_thread_syncs("switching.db");
    feed_one_by_one(&mut feed, &sent, 201, 241);
    let last = sync_thread_syncs("switching.db");
    commits.stop();
    let (mut core, result) = commits.join();
    let summary = result.unwrap();
    assert_eq!(fast, 0, "the sync thread synced on a fast disk");
    assert!(
        slow - fast >= 30,
        "{} of 60 slow commits used the sync thread",
        slow - fast
    );
    assert!(
        fast_again > slow,
        "the overlap went on until the sync thread's syncs were measured fast"
    );
    assert_eq!(
        last, fast_again,
        "the overlap stayed on once the disk was fast"
    );
    assert_eq!(
        sent.all(),
        (1..241).collect::<Vec<u16>>(),
        "PUBACKs in arrival order"
    );
    assert_eq!(summary.processed, 240, "{summary:?}");
    assert_eq!(summary.dropped_stale, 0, "{summary:?}");
    let level: i64 = core
        .inbox()
        .connection()
        .query_row("PRAGMA synchronous", [], |r| r.get(0))
        .unwrap();
    assert_eq!(level, 2);
}

/// Identities committed in the file at `path`, as another connection sees them (commits show before their
/// sync).
fn identities_in(path: &std::path::Path) -> i64 {
    let c = edge_inbox::rusqlite::Connection::open(path).unwrap();
    c.query_row("SELECT count(*) FROM identities", [], |r| r.get(0))
        .unwrap()
}

/// Waits until the file at `path` holds `n` identities (the first batch's); fails the test after 20 s.
fn first_batch_committed(path: &std::path::Path, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while identities_in(path) < n {
        assert!(Instant::now() < deadline, "the first batch never committed");
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn acks_waiting_for_a_sync_when_their_connection_ends_are_never_sent_on_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lost.db");
    let inbox = Inbox::open(&path, slow_card()).unwrap();
    // Syncs of this file take 50 ms: the first connection's acks are waiting when it ends.
    let core = ConsumerCore::new(inbox, SCOPE)
        .batch(8, Duration::from_millis(100))
        .overlap_syncs(SyncOverlap::On);
    let sent = SentAcks::default();
    let (mut feed, commits) = core.spawn(bump, sent.clone(), 1000).unwrap();
    feed.connected(true).unwrap();
    for k in 0..8u16 {
        publish(&mut feed, &format!("lost-{k}"), k + 1);
    }
    first_batch_committed(&path, 8);
    feed.because("network down").lost(|| {}).unwrap();
    // The broker redelivers the eight under new packet ids, and sends eight more.
    feed.connected(true).unwrap();
    for k in 0..16u16 {
        publish(&mut feed, &format!("lost-{k}"), 101 + k);
    }
    sent.wait_for(16);
    commits.stop();
    let (mut core, result) = commits.join();
    let summary = result.unwrap();
    assert_eq!(
        sent.all(),
        (101..117).collect::<Vec<u16>>(),
        "only the second connection's PUBACKs, in order"
    );
    assert_eq!(summary.dropped_stale, 8, "{summary:?}");
    assert_eq!(summary.duplicates, 8, "{summary:?}");
    assert_eq!(summary.processed, 16, "{summary:?}");
    let inbox = core.inbox();
    for k in 0..16 {
        let id = format!("lost-{k}");
        let n: Option<i64> = inbox.get(SCOPE, &id).unwrap();
        assert_eq!(n, Some(1), "{id} applied once");
    }
}

/// How long a sync of `stopping.db` takes: long beside a commit, so that a second batch commits while the
/// first one's sync is under way.
const STOPPING_SYNC: Duration = Duration::from_millis(200);

/// PUBACKs with the time each was queued.
#[derive(Clone, Default)]
struct TimedAcks(Arc<Mutex<Vec<(u16, Instant)>>>);

impl edge_inbox::PubAckSender for TimedAcks {
    fn try_puback(&self, packet_id: u16) -> bool {
        self.0.lock().unwrap().push((packet_id, Instant::now()));
        true
    }
}

#[test]
fn a_stop_sends_each_syncs_acks_as_it_ends_not_all_after_the_last() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stopping.db");
    let inbox = Inbox::open(&path, slow_card()).unwrap();
    let core = ConsumerCore::new(inbox, SCOPE)
        .batch(4, Duration::from_secs(1))
        .overlap_syncs(SyncOverlap::On);
    let stop = core.stop_handle();
    let mut seen = 0;
    // The stop comes with the last delivery, as when an application stops after a known count: the loop
    // then waits for the syncs of the two batches it committed.
    let handler = move |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        bump(tx, d)?;
        seen += 1;
        if seen == 8 {
            stop.stop();
        }
        Ok(())
    };
    let sent = TimedAcks::default();
    let (mut feed, commits) = core.spawn(handler, sent.clone(), 1000).unwrap();
    feed.connected(true).unwrap();
    // Two full batches: the second commits while the first one's sync is under way, and waits for the
    // sync after it.
    for k in 0..4u16 {
        publish(&mut feed, &format!("stop-{k}"), k + 1);
    }
    first_batch_committed(&path, 4);
    // The second batch must commit while the first one's sync is under way: on a loaded machine the sync
    // thread may start it late, and a sync that began after both commits would cover both.
    let deadline = Instant::now() + Duration::from_secs(20);
    while STOPPING_SYNC_STARTS.lock().unwrap().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the sync thread never synced stopping.db"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    for k in 4..8u16 {
        publish(&mut feed, &format!("stop-{k}"), k + 1);
    }
    let (_core, result) = commits.join();
    let summary = result.unwrap();
    assert_eq!(summary.processed, 8, "{summary:?}");
    assert_eq!(summary.dropped_stale, 0, "{summary:?}");
    assert_eq!(summary.batches, 2, "{summary:?}");
    let acks = sent.0.lock().unwrap().clone();
    let order: Vec<u16> = acks.iter().map(|&(id, _)| id).collect();
    assert_eq!(
        order,
        (1..=8).collect::<Vec<u16>>(),
        "PUBACKs in arrival order"
    );
    // The second batch's PUBACKs only after the sync that made it durable, the sync thread's last; the
    // first batch's when its own sync ended, before that one.
    let last_sync = *STOPPING_SYNC_ENDS
        .lock()
        .unwrap()
        .last()
        .expect("the sync thread synced stopping.db");
    assert!(acks[4].1 >= last_sync, "a PUBACK before its sync");
    assert!(
        acks[3].1 < last_sync,
        "the first batch's PUBACKs were held until the second batch's sync ended ({:?} after it)",
        acks[3].1 - last_sync
    );
}

/// While a sync does not end, commits go no further ahead of it than the memory budget's worth of deliveries:
/// the reader then stops (and TCP pushes back), instead of batch after batch committing and its acks and
/// events piling up in memory. Once the sync ends, everything is acked in arrival order.
#[test]
fn commits_go_no_further_than_the_budget_ahead_of_a_sync_that_does_not_end() {
    use std::sync::atomic::AtomicUsize;

    let dir = tempfile::tempdir().unwrap();
    let inbox = Inbox::open(dir.path().join("stalled.db"), slow_card()).unwrap();
    let budget = 64 << 10;
    let mut core = ConsumerCore::new(inbox, SCOPE)
        .batch(8, Duration::ZERO)
        .overlap_syncs(SyncOverlap::On)
        .memory_budget(budget);
    let _events = core.events(100_000);
    let sent = SentAcks::default();
    let (mut feed, commits) = core.spawn(bump, sent.clone(), 65_000).unwrap();
    // Far more than the bound below, and light enough for the tests beside it under emulation.
    let total = 4_000usize;
    let handed = Arc::new(AtomicUsize::new(0));
    let counter = handed.clone();
    STALLED.store(true, Ordering::Relaxed);
    let reader = std::thread::spawn(move || {
        feed.connected(true).unwrap();
        for k in 0..total {
            publish(&mut feed, &format!("evt-{k:05}"), k as u16 + 1);
            counter.fetch_add(1, Ordering::Relaxed);
        }
        feed
    });
    // Until the reader stops (a slow machine takes longer to fill the budget).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut held = handed.load(Ordering::Relaxed);
    loop {
        std::thread::sleep(Duration::from_millis(500));
        let now = handed.load(Ordering::Relaxed);
        if now == held || now == total || Instant::now() >= deadline {
            held = now;
            break;
        }
        held = now;
    }
    let stalled_acks = sent.all().len();
    STALLED.store(false, Ordering::Relaxed);
    // The budget's worth held for their commit and as much committed and waiting for the sync (at the
    // budget's 384 bytes of overhead a delivery; 314 here on x86_64), with room for another platform.
    let bound = 3 * budget / 384;
    assert!(
        held <= bound,
        "{held} of {total} deliveries handed over while a sync did not end (bound {bound})"
    );
    assert_eq!(stalled_acks, 0, "nothing is acked before its sync ends");

    let mut feed = reader.join().unwrap();
    let order: Vec<u16> = (1..=total as u16).collect();
    sent.wait_for(order.len());
    assert_eq!(sent.all(), order, "PUBACKs in arrival order");
    feed.lost(|| {}).unwrap();
    drop(feed);
    let (_, summary) = commits.join();
    assert_eq!(summary.unwrap().processed, total as u64);
}
