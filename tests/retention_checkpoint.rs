//! Pruning keeps the WAL short itself: a consumer committing beside it never runs a checkpoint inside its
//! commit (issue 26), so the consumer's commit never pays for copying the pruner's pages into the file.

use std::time::{Duration, Instant};

use edge_inbox::{Config, Delivery, Inbox, Pruning, Tx};

mod common;

const SCOPE: &str = "history";

/// The consumers' checkpoint threshold here: SQLite's own default, ten times below the inbox's, so that the
/// pruner's margin (it keeps the WAL under 500 frames) is what these tests check, not the default's size.
const CONSUMER_THRESHOLD: u32 = 1000;

fn noop(_: &mut Tx<'_>, _: &Delivery<'_>) -> anyhow::Result<()> {
    Ok(())
}

/// Steps of a prune interleaved with a consumer's single-delivery commits (both at the default settings but
/// the consumer's threshold, 1000 pages): the consumer's checkpoint counter never moves while the prune runs,
/// yet the WAL was copied back many times over (by the pruner).
#[test]
fn a_consumer_never_checkpoints_while_a_prune_runs() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    // Not below 12,000 rows under emulation: a step writes about a third of a frame per row (schema 5), and
    // the prune must write the consumer's threshold twice over for the check to mean anything.
    let n = common::scaled(20_000).max(12_000);
    common::old_processed_file(&path, SCOPE, n);

    let mut consumer = Inbox::open(
        &path,
        Config::default().wal_autocheckpoint(CONSUMER_THRESHOLD),
    )
    .unwrap();
    let mut pruner = Inbox::open(&path, Config::default()).unwrap();
    let opts = Pruning::default();
    let deadline = Instant::now() + Duration::from_secs(300);
    let (mut steps, mut commits, mut consumer_checkpoints) = (0u64, 0u64, 0u64);
    let (mut pruned, mut pruner_checkpoints) = (0, 0);
    loop {
        assert!(
            Instant::now() < deadline,
            "the prune did not finish in time"
        );
        let step = pruner.prune_step(&opts).unwrap();
        steps += 1;
        pruned += step.payloads_pruned;
        pruner_checkpoints += step.checkpoints;
        if step.done {
            break;
        }
        // A few consumer commits between two steps, as a consumer committing every few milliseconds meets
        // a pruner that rests between its steps.
        for _ in 0..4 {
            let before = consumer.bytes_written().unwrap().checkpoint_bytes;
            let id = format!("new-{commits}");
            consumer
                .process(&Delivery::new("consumer", &id, "orders", b"{}"), noop)
                .unwrap();
            commits += 1;
            // Only the consumer ran between the two reads: any checkpoint bytes are its commit's.
            if consumer.bytes_written().unwrap().checkpoint_bytes != before {
                consumer_checkpoints += 1;
            }
        }
    }
    assert_eq!(pruned, n as u64);
    let wal_frames = pruner.bytes_written().unwrap().wal_bytes / (4096 + 24);
    // About 4,000 frames at 12,000 rows (under qemu), 6,700 at 20,000.
    assert!(
        wal_frames > 2_000,
        "{wal_frames} WAL frames were written: the consumer's checkpoint threshold twice over at least"
    );
    assert_eq!(
        consumer_checkpoints, 0,
        "of {commits} consumer commits during {steps} prune steps, {consumer_checkpoints} ran a checkpoint"
    );
    assert!(
        pruner_checkpoints > 0,
        "the pruner copied the WAL back itself"
    );
}

/// The same with the consumer committing on its own thread while the pruner steps and rests: commits land
/// during the pruner's checkpoints. The WAL file, which never shrinks during a pass, never reaches the
/// consumer's threshold of 1000 frames, so no consumer commit can have run a checkpoint (its WAL hook
/// checkpoints only at 1000 frames or more).
#[test]
fn the_wal_stays_below_the_consumers_threshold_while_a_prune_runs_beside_it() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let wal = dir.path().join("inbox.db-wal");
    // As above: enough rows for the prune to write the consumer's threshold several times over.
    let n = common::scaled(20_000).max(12_000);
    common::old_processed_file(&path, SCOPE, n);

    let done = Arc::new(AtomicBool::new(false));
    let commits = Arc::new(AtomicU64::new(0));
    let consumer = {
        let (path, done, commits) = (path.clone(), done.clone(), commits.clone());
        std::thread::spawn(move || {
            let config = Config::default().wal_autocheckpoint(CONSUMER_THRESHOLD);
            let mut inbox = Inbox::open(&path, config).unwrap();
            let deadline = Instant::now() + Duration::from_secs(300);
            while !done.load(Ordering::SeqCst) && Instant::now() < deadline {
                let id = format!("new-{}", commits.load(Ordering::SeqCst));
                inbox
                    .process(&Delivery::new("consumer", &id, "orders", b"{}"), noop)
                    .unwrap();
                commits.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };

    let mut pruner = Inbox::open(&path, Config::default()).unwrap();
    let opts = Pruning::default();
    let deadline = Instant::now() + Duration::from_secs(300);
    let (mut largest, mut pruned, mut checkpoints) = (0u64, 0, 0);
    loop {
        assert!(
            Instant::now() < deadline,
            "the prune did not finish in time"
        );
        let step = pruner.prune_step(&opts).unwrap();
        pruned += step.payloads_pruned;
        checkpoints += step.checkpoints;
        if step.done {
            break;
        }
        largest = largest.max(std::fs::metadata(&wal).map_or(0, |m| m.len()));
        std::thread::sleep(Duration::from_millis(2));
    }
    done.store(true, Ordering::SeqCst);
    consumer.join().expect("the consumer never failed");
    assert_eq!(pruned, n as u64);
    assert!(commits.load(Ordering::SeqCst) > 0);
    let frames = largest.saturating_sub(32) / (4096 + 24);
    assert!(
        frames < u64::from(CONSUMER_THRESHOLD),
        "the WAL grew to {frames} frames while the prune ran ({} consumer commits, {checkpoints} checkpoints \
         by the pruner)",
        commits.load(Ordering::SeqCst)
    );
    assert!(checkpoints > 0, "the pruner copied the WAL back itself");
}

/// A reader that stays on an old snapshot (a backup, an open shell) keeps the WAL from starting over, so
/// every pruner step past the threshold runs a RESTART, which holds the write lock while it waits for that
/// reader. It must not wait the connection's busy timeout (here 30 s): consumers would be locked out that
/// long at every step. The steps finish, and a consumer on another connection commits between them.
#[test]
fn a_long_reader_does_not_make_the_pruners_restart_hold_the_write_lock_for_the_busy_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    common::old_processed_file(&path, SCOPE, 2_000);
    let config = Config::default().busy_timeout(Duration::from_secs(30));
    let mut pruner = Inbox::open(&path, config.clone()).unwrap();
    let mut consumer = Inbox::open(&path, config).unwrap();
    let reader = rusqlite::Connection::open(&path).unwrap();
    reader.execute_batch("BEGIN").unwrap();
    let _: i64 = reader
        .query_row("SELECT count(*) FROM messages", [], |r| r.get(0))
        .unwrap();

    // One frame past the threshold of 1 triggers the RESTART at every step.
    let opts = Pruning::default().checkpoint_pages(1).batch(8);
    for i in 0..5 {
        let started = Instant::now();
        pruner.prune_step(&opts).unwrap();
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(15),
            "step {i} took {took:?}: its checkpoint waited out the busy timeout behind the reader"
        );
        consumer
            .process(
                &Delivery::new("consumer", &format!("new-{i}"), "orders", b"{}"),
                noop,
            )
            .unwrap();
    }
    reader.execute_batch("COMMIT").unwrap();
}

/// A pass ends with a checkpoint that copies the WAL back and keeps the file's size, so that a consumer's
/// next commits overwrite it from its start: a WAL emptied to zero appends again until it reaches the
/// consumers' threshold, and each of those syncs also commits the file's new size. Asked to, the pass
/// empties the file. Fails when the default truncates, and when the pass leaves frames not copied back.
#[test]
fn a_pass_keeps_the_wal_files_size_unless_asked_to_truncate_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let wal = dir.path().join("inbox.db-wal");
    let wal_len = || std::fs::metadata(&wal).map_or(0, |m| m.len());
    let n = common::scaled(2_000).max(500);
    common::old_processed_file(&path, SCOPE, n);
    let mut consumer = Inbox::open(&path, Config::default()).unwrap();
    let mut deliver = |from: usize, count: usize| {
        for i in from..from + count {
            let id = format!("new-{i}");
            consumer
                .process(&Delivery::new("consumer", &id, "orders", b"{}"), noop)
                .unwrap();
        }
    };
    deliver(0, 20);

    let mut pruner = Inbox::open(&path, Config::default()).unwrap();
    let report = pruner
        .prune(&Pruning::default().pause(Duration::ZERO))
        .unwrap();
    assert!(report.done);
    assert_eq!(report.payloads_pruned, n as u64);
    let size = wal_len();
    assert!(size > 0, "the pass emptied the WAL file");

    // A WAL that starts over gets new salts in its header (bytes 16..24); appending leaves the header as it
    // is. Only a WAL whose every frame the pass copied back starts over at the consumer's next commit;
    // otherwise the commit appends after the pass's frames.
    let salts = || std::fs::read(&wal).unwrap()[16..24].to_vec();
    let before = salts();
    deliver(20, 1);
    assert_ne!(
        salts(),
        before,
        "the consumer's commit after the pass did not start the WAL over"
    );
    // Fewer frames than the file holds: they overwrite it in place.
    deliver(21, 9);
    assert_eq!(wal_len(), size, "the consumer's commits grew the WAL file");

    let report = pruner
        .prune(&Pruning::default().pause(Duration::ZERO).truncate_wal(true))
        .unwrap();
    assert!(report.done);
    assert_eq!(
        wal_len(),
        0,
        "asked to, the pass did not empty the WAL file"
    );
}
