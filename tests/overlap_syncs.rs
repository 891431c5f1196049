//! Commits overlapping their syncs ([`SyncOverlap`]), on a real file through a VFS that makes every sync 3 ms
//! slower (an SD card) and counts the WAL syncs made by the inbox's sync thread. That the PUBACKs wait for a
//! sync covering their commit is checked by cutting the power in `tests/power_loss.rs`, and after a failed
//! sync in `tests/wal_sync_failure.rs`; here: that the overlap is used where it should be and not elsewhere,
//! and that acks and events still leave complete and in arrival order, at a stop and when the feed is dropped.

use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

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
        let rc = real();
        std::thread::sleep(Duration::from_millis(3));
        if std::thread::current().name() == Some(SYNC_THREAD) {
            SYNC_THREAD_SYNCS.lock().unwrap()[tag].1 += 1;
        }
        rc
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
