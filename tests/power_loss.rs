//! Power-loss simulation. A killed process cannot show a durability bug: the kernel's page cache survives
//! it. Here a VFS (tests/power_loss_support) models what the disk keeps across a power cut: per file, the
//! bytes as of its last sync, plus none, all or a random subset of the sectors written since. One run of
//! every write path records a cut point before every sync, between every two steps, and after every write
//! of a prune step, an incremental vacuum and a checkpoint; for each, the files are rebuilt as the cut
//! leaves them, the inbox is reopened with the platform's VFS and every acknowledgement is checked, then
//! the broker's redelivery of everything is checked for exactly one effect.

mod common;
mod power_loss_support;

use std::collections::BTreeMap;

use edge_inbox::Synchronous;
use power_loss_support::check::{check, Findings};
use power_loss_support::disk::{Boundary, Cut};
use power_loss_support::workload::{self, Plan, Run};

fn rounds() -> usize {
    // 10 rounds: 240 deliveries, two retention passes and three plain checkpoints.
    common::scaled(10).max(4)
}

/// Checks the run at every cut point with each of `cuts`; returns the findings per (cut point, cut).
fn check_all(run: &Run, cuts: &[Cut]) -> Vec<(usize, Cut, Findings)> {
    let dir = tempfile::tempdir().unwrap();
    let mut all = Vec::new();
    for (k, snap) in run.snapshots.iter().enumerate() {
        for &cut in cuts {
            let cut = match cut {
                Cut::Torn(seed) => Cut::Torn(seed ^ (k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
                other => other,
            };
            if !snap.has_unsynced() && !matches!(cut, Cut::DropUnsynced) {
                continue; // every cut leaves the same files
            }
            all.push((k, cut, check(run, snap, cut, dir.path())));
        }
    }
    all
}

/// The cuts whose reopened inbox broke a promise, described.
fn failing(run: &Run, results: &[(usize, Cut, Findings)]) -> Vec<String> {
    results
        .iter()
        .filter(|(_, _, f)| !f.clean())
        .map(|(k, cut, f)| describe(run, *k, *cut, f))
        .collect()
}

fn describe(run: &Run, k: usize, cut: Cut, f: &Findings) -> String {
    let s = &run.snapshots[k];
    let lost: Vec<String> = f
        .lost
        .iter()
        .take(5)
        .map(|&a| {
            format!(
                "{:?} {}",
                run.acks[a].promise, run.items[run.acks[a].item].id
            )
        })
        .collect();
    format!(
        "cut {k} ({}, {:?}, {cut:?}, {} acks): lost {} {lost:?}, doubled {:?}, problems {:?}",
        s.label,
        s.boundary,
        s.acked,
        f.lost.len(),
        f.doubled.iter().take(5).collect::<Vec<_>>(),
        f.problems.iter().take(8).collect::<Vec<_>>()
    )
}

#[test]
fn full_sync_keeps_every_acknowledged_delivery_at_every_cut() {
    let run = workload::run(
        "edge-inbox-powerloss-full",
        Plan {
            synchronous: Synchronous::Full,
            rounds: rounds(),
            lying: false,
        },
    );
    let results = check_all(
        &run,
        &[Cut::DropUnsynced, Cut::Torn(0x5eed), Cut::KeepUnsynced],
    );

    let bad = failing(&run, &results);
    assert!(
        bad.is_empty(),
        "{} failing cuts:\n{}",
        bad.len(),
        bad.join("\n")
    );

    // What was cut, for the record, and proof that the cuts reached every phase and did discard work.
    let mut by_label: BTreeMap<&str, usize> = BTreeMap::new();
    for s in &run.snapshots {
        *by_label.entry(s.label.as_str()).or_default() += 1;
    }
    let syncs = run
        .snapshots
        .iter()
        .filter(|s| s.boundary == Boundary::BeforeSync)
        .count();
    let unacked_lost: usize = results.iter().map(|(_, _, f)| f.unacked_lost).sum();
    let unacked_survived: usize = results.iter().map(|(_, _, f)| f.unacked_survived).sum();
    eprintln!(
        "FULL: {} deliveries, {} acks, {} cut points ({} before a sync), {} reopened states; \
         in-flight deliveries lost {unacked_lost}, survived {unacked_survived}; cut points by phase {by_label:?}",
        run.items.len(),
        run.acks.len(),
        run.snapshots.len(),
        syncs,
        results.len()
    );
    for phase in [
        "single commit",
        "group commit",
        "overlapped commits",
        "outbox commit",
        "deferred receive",
        "worker claim and apply",
        "watermark commit",
        "prune payloads",
        "incremental vacuum",
        "checkpoint",
        "checkpoint (end of prune pass)",
    ] {
        assert!(
            by_label.get(phase).copied().unwrap_or(0) > 0,
            "no cut during {phase}"
        );
    }
    // Inside the maintenance steps, not only around them: after their own writes, before their syncs.
    for phase in ["prune payloads", "incremental vacuum", "checkpoint"] {
        let inside = run
            .snapshots
            .iter()
            .filter(|s| s.label.starts_with(phase) && s.boundary != Boundary::Step)
            .count();
        assert!(inside > 0, "no cut inside a {phase} step");
    }
    assert!(syncs >= run.acks.len() / 8, "{syncs} sync boundaries");
    assert!(unacked_lost > 0, "no cut ever discarded a commit in flight");
}

#[test]
fn normal_sync_loses_acknowledged_deliveries_only_after_the_last_wal_sync() {
    let run = workload::run(
        "edge-inbox-powerloss-normal",
        Plan {
            synchronous: Synchronous::Normal,
            rounds: rounds(),
            lying: false,
        },
    );
    let results = check_all(&run, &[Cut::DropUnsynced, Cut::KeepUnsynced]);
    let mut lost_total = 0;
    let mut worst = 0;
    let mut cuts_with_loss = 0;
    for (k, cut, f) in &results {
        let s = &run.snapshots[*k];
        assert!(
            f.doubled.is_empty() && f.problems.is_empty(),
            "{}",
            describe(&run, *k, *cut, f)
        );
        match cut {
            // The page cache survives a killed process: NORMAL loses nothing there.
            Cut::KeepUnsynced => assert!(f.lost.is_empty(), "{}", describe(&run, *k, *cut, f)),
            _ => {
                // Bounded: only what was acknowledged after the last sync of the WAL (a checkpoint's).
                for &a in &f.lost {
                    assert_eq!(
                        run.acks[a].wal_syncs,
                        s.wal_syncs,
                        "lost an ack the WAL had synced: {}",
                        describe(&run, *k, *cut, f)
                    );
                }
                let window = run.acks[..s.acked]
                    .iter()
                    .filter(|a| a.wal_syncs == s.wal_syncs)
                    .count();
                assert!(f.lost.len() <= window);
                lost_total += f.lost.len();
                worst = worst.max(f.lost.len());
                cuts_with_loss += usize::from(!f.lost.is_empty());
            }
        }
    }
    eprintln!(
        "NORMAL: {} acks, {} cut points, {} WAL syncs in the run; {cuts_with_loss} cuts lost acknowledged \
         deliveries, {lost_total} in all, at most {worst} at one cut",
        run.acks.len(),
        run.snapshots.len(),
        run.snapshots.last().map_or(0, |s| s.wal_syncs)
    );
    assert!(
        cuts_with_loss > 0,
        "NORMAL never lost an acknowledged delivery"
    );
}

/// The control: a disk whose syncs make nothing durable must make the main check fail.
#[test]
fn a_lying_disk_fails_the_check() {
    let run = workload::run(
        "edge-inbox-powerloss-lying",
        Plan {
            synchronous: Synchronous::Full,
            rounds: 2,
            lying: true,
        },
    );
    let results = check_all(&run, &[Cut::DropUnsynced]);
    let bad = failing(&run, &results);
    assert!(
        !bad.is_empty(),
        "the check passed on a disk that never syncs"
    );
    let last = results.last().unwrap();
    assert_eq!(
        last.2.lost.len(),
        run.acks.len(),
        "every ack is lost at the end: {}",
        bad.join("\n")
    );
    // The same files with every write kept are fine: the failure is the lost writes, not the harness.
    let dir = tempfile::tempdir().unwrap();
    let f = check(
        &run,
        run.snapshots.last().unwrap(),
        Cut::KeepUnsynced,
        dir.path(),
    );
    assert!(
        f.clean(),
        "{}",
        describe(&run, run.snapshots.len() - 1, Cut::KeepUnsynced, &f)
    );
}

/// The disk model itself: only synced writes are durable; a torn cut keeps whole sectors of the rest.
#[test]
fn the_disk_model_keeps_synced_bytes_and_tears_unsynced_ones_by_sector() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let disk = power_loss_support::disk::Disk::default();
    disk.set_recording(true);
    let log = disk.open(path.to_str().unwrap(), false);
    disk.write(log, 0, &[1u8; 1024]);
    disk.sync(log);
    disk.write(log, 0, &[2u8; 4096]);
    disk.truncate(log, 3000);
    disk.step_boundary();
    let snaps = disk.snapshots();
    let (first, last) = (&snaps[0], snaps.last().unwrap());
    // Just before the sync: the first write is not durable yet.
    assert!(first.has_unsynced() && first.files_len() == 1);
    assert_eq!(
        disk.materialize(first, Cut::DropUnsynced)[0].1,
        Vec::<u8>::new()
    );
    assert_eq!(
        disk.materialize(first, Cut::KeepUnsynced)[0].1,
        vec![1u8; 1024]
    );
    let only = |cut| disk.materialize(last, cut).remove(0).1;
    assert_eq!(only(Cut::DropUnsynced), vec![1u8; 1024]);
    let mut all = vec![2u8; 4096];
    all.truncate(3000);
    assert_eq!(only(Cut::KeepUnsynced), all);
    let mut torn_seen = false;
    for seed in 1..64 {
        let t = only(Cut::Torn(seed));
        // Every 512-byte sector is wholly old, wholly new, or (past the old end) zero-filled or cut off.
        for (i, sector) in t.chunks(512).enumerate() {
            let old = if i < 2 { 1 } else { 0 };
            assert!(sector.iter().all(|&b| b == sector[0]), "sector {i} mixed");
            assert!(
                sector[0] == 2 || sector[0] == old,
                "sector {i}: {}",
                sector[0]
            );
        }
        torn_seen |= t.chunks(512).any(|s| s[0] == 2) && t.chunks(512).any(|s| s[0] != 2);
    }
    assert!(torn_seen, "no seed tore the write");
}
