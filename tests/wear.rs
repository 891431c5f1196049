//! Flash wear: the bytes an inbox writes, counted by the inbox on a real file, and the device's own figures.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use edge_inbox::inspect::{self, FileSizes};
use edge_inbox::{open_read_only, Config, Delivery, Inbox, Outcome, Tx};

fn bump(tx: &mut Tx<'_>, _d: &Delivery<'_>) -> anyhow::Result<()> {
    let n: u64 = tx.get("n")?.unwrap_or(0);
    tx.put("n", &(n + 1))?;
    Ok(())
}

fn deliver(inbox: &mut Inbox, from: usize, to: usize) {
    for i in from..to {
        let id = format!("evt-{i}");
        let d = Delivery::new("wear", &id, "t/1", b"payload");
        assert!(matches!(
            inbox.process(&d, bump).unwrap(),
            Outcome::Processed
        ));
    }
}

const PAGE: u64 = 4096;
const FRAME: u64 = PAGE + 24;
const WAL_HEADER: u64 = 32;

#[test]
fn wal_bytes_are_exactly_the_frames_appended() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    // No checkpoint: the WAL file only grows, so its size tells every byte written to it.
    let mut inbox = Inbox::open(&path, Config::default().wal_autocheckpoint(0)).unwrap();
    let before = inbox.bytes_written().unwrap();
    deliver(&mut inbox, 0, 50);
    let after = inbox.bytes_written().unwrap();
    let wal_file = FileSizes::of(&path).wal_bytes;
    let written = after.wal_bytes - before.wal_bytes;
    assert!(
        written >= 50 * FRAME,
        "{written}: at least a frame per commit"
    );
    assert_eq!(written % FRAME, 0, "whole frames");
    // Opening wrote the schema's frames before the counter existed; those are in the file but not counted.
    assert!(
        wal_file >= WAL_HEADER + after.wal_bytes,
        "{wal_file} vs {after:?}"
    );
    assert_eq!(
        (wal_file - WAL_HEADER) - after.wal_bytes,
        (wal_file - WAL_HEADER) - written - before.wal_bytes
    );
    assert_eq!(after.checkpoint_bytes, 0, "no checkpoint ran");
}

#[test]
fn the_inbox_runs_the_automatic_checkpoint_and_counts_what_it_copied() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    // In the commits, so that the figures read below are final (`tests/checkpoint_thread.rs` covers the
    // checkpoint thread's).
    let config = Config::default()
        .wal_autocheckpoint(20)
        .checkpoint_thread(false);
    let mut inbox = Inbox::open(&path, config).unwrap();
    deliver(&mut inbox, 0, 200);
    let w = inbox.bytes_written().unwrap();
    assert!(w.checkpoint_bytes > 0, "{w:?}");
    assert_eq!(w.checkpoint_bytes % PAGE, 0, "whole pages");
    // The WAL starts over after each complete checkpoint instead of growing with every commit.
    let wal_file = FileSizes::of(&path).wal_bytes;
    assert!(
        wal_file < WAL_HEADER + 40 * FRAME,
        "WAL file {wal_file} bytes"
    );
    // A checkpoint ran, then more commits: the first of them saved the counts in the file, readable by a
    // tool while the inbox stays open.
    let conn = open_read_only(&path).unwrap();
    let saved = inspect::bytes_written(&conn).unwrap();
    assert!(
        saved.wal_bytes > 0 && saved.checkpoint_bytes > 0,
        "{saved:?}"
    );
    assert!(saved.wal_bytes <= w.wal_bytes, "{saved:?} {w:?}");
    drop(conn);
    // Closing saves the rest.
    drop(inbox);
    let conn = open_read_only(&path).unwrap();
    assert_eq!(inspect::bytes_written(&conn).unwrap(), w);
}

#[test]
fn counts_add_up_over_reopening_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    deliver(&mut inbox, 0, 10);
    let first = inbox.bytes_written().unwrap();
    drop(inbox);
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    assert_eq!(
        inbox.bytes_written().unwrap(),
        first,
        "saved at close, read at open"
    );
    deliver(&mut inbox, 10, 20);
    let second = inbox.bytes_written().unwrap();
    assert!(
        second.wal_bytes >= first.wal_bytes + 10 * FRAME,
        "{first:?} {second:?}"
    );
}

#[test]
fn a_smaller_page_size_applies_to_a_new_file_only() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default().page_size(1024)).unwrap();
    let page: i64 = inbox
        .connection()
        .query_row("PRAGMA page_size", [], |r| r.get(0))
        .unwrap();
    assert_eq!(page, 1024);
    let before = inbox.bytes_written().unwrap();
    deliver(&mut inbox, 0, 10);
    let w = inbox.bytes_written().unwrap().wal_bytes - before.wal_bytes;
    assert_eq!(w % (1024 + 24), 0, "frames of the file's page size: {w}");
    drop(inbox);
    let inbox = Inbox::open(&path, Config::default().page_size(8192)).unwrap();
    let page: i64 = inbox
        .connection()
        .query_row("PRAGMA page_size", [], |r| r.get(0))
        .unwrap();
    assert_eq!(page, 1024, "an existing file keeps its page size");
}

/// A sysfs tree with an eMMC partition for the device `path` lives on, as Linux lays it out.
fn fake_sysfs(root: &Path, path: &Path, life_time: &str, pre_eol: &str) -> PathBuf {
    let dev = std::fs::metadata(path).unwrap().dev();
    let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0x0fff);
    let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0xff);
    let disk = root.join("devices/platform/mmc0/mmc_host/mmc0/mmc0:0001/block/mmcblk0");
    let part = disk.join("mmcblk0p2");
    std::fs::create_dir_all(&part).unwrap();
    std::fs::write(part.join("partition"), "2\n").unwrap();
    std::fs::create_dir_all(disk.join("device")).unwrap();
    std::fs::write(disk.join("device/life_time"), life_time).unwrap();
    std::fs::write(disk.join("device/pre_eol_info"), pre_eol).unwrap();
    std::fs::create_dir_all(root.join("dev/block")).unwrap();
    std::os::unix::fs::symlink(&part, root.join(format!("dev/block/{major}:{minor}"))).unwrap();
    root.to_owned()
}

#[test]
fn emmc_wear_is_read_from_the_files_device() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    drop(Inbox::open(&path, Config::default()).unwrap());
    let sys = tempfile::tempdir().unwrap();
    let root = fake_sysfs(sys.path(), &path, "0x02 0x0b\n", "0x02\n");
    let wear = inspect::device_wear_in(&path, &root).expect("staged device");
    assert_eq!(wear.device, "mmcblk0");
    assert_eq!(wear.life_time_a, Some(2));
    assert_eq!(wear.life_time_b, Some(11));
    assert_eq!(wear.pre_eol_info, Some(2));
    // No such files: not reported.
    let empty = tempfile::tempdir().unwrap();
    assert_eq!(inspect::device_wear_in(&path, empty.path()), None);
    // A figure that cannot be read is unknown, and the other keeps its place.
    let odd = tempfile::tempdir().unwrap();
    let root = fake_sysfs(odd.path(), &path, "junk 0x05\n", "0x\n");
    let wear = inspect::device_wear_in(&path, &root).expect("staged device");
    assert_eq!(
        (wear.life_time_a, wear.life_time_b, wear.pre_eol_info),
        (None, Some(5), None)
    );
}

#[test]
fn a_device_without_wear_figures_reports_none() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    drop(Inbox::open(&path, Config::default()).unwrap());
    // This machine's own disk: reported exactly when its sysfs entry has the eMMC files.
    let dev = std::fs::metadata(&path).unwrap().dev();
    let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0x0fff);
    let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0xff);
    let entry = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    let has = [
        "device/life_time",
        "../device/life_time",
        "device/pre_eol_info",
        "../device/pre_eol_info",
    ]
    .iter()
    .any(|f| entry.join(f).exists());
    assert_eq!(
        inspect::device_wear(&path).is_some(),
        has,
        "{}",
        entry.display()
    );
}

/// Commits `count` deliveries in batches of 100, each storing a 3 KB value under a key of its own: a file of
/// some MiB in a few commits (quick under an emulator too).
fn fill(inbox: &mut Inbox, count: usize) {
    let ids: Vec<String> = (0..count).map(|i| format!("fill-{i}")).collect();
    let value = "v".repeat(3000);
    let store = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        tx.put(d.message_id, &value)?;
        Ok(())
    };
    for chunk in ids.chunks(100) {
        let ds: Vec<Delivery<'_>> = chunk
            .iter()
            .map(|id| Delivery::new("wear", id, "t/1", b"payload"))
            .collect();
        let outcomes = inbox.process_batch(&ds, store).unwrap();
        assert!(outcomes.iter().all(|o| matches!(o, Outcome::Processed)));
    }
}

/// A file of about 6 MiB, closed (its WAL copied back and removed), then written again as a new file in
/// one write: the page cache then holds it in large folios on kernels that have them (ext4 on recent Linux),
/// as after a copy or a restore of the file.
fn file_cached_in_large_folios(path: &Path) {
    let mut inbox = Inbox::open(path, Config::default()).unwrap();
    fill(&mut inbox, 2000);
    drop(inbox);
    assert_eq!(FileSizes::of(path).wal_bytes, 0, "closed cleanly");
    let bytes = std::fs::read(path).unwrap();
    assert!(bytes.len() > 4 << 20, "{} bytes", bytes.len());
    let copy = path.with_extension("copy");
    std::fs::write(&copy, &bytes).unwrap();
    std::fs::File::open(&copy).unwrap().sync_all().unwrap();
    std::fs::rename(&copy, path).unwrap();
}

/// What a checkpoint counts can never exceed the pages of the frames it had to copy, on any kernel. The old
/// count broke it only where the page cache holds the file in large folios (ext4 on recent Linux): the
/// kernel's `write_bytes` counts a whole folio each time one turns dirty, so a 4 KiB page written into such
/// a file counted as up to 2 MiB.
fn assert_checkpoint_bytes_within_the_frames(
    before: &edge_inbox::BytesWritten,
    after: &edge_inbox::BytesWritten,
) {
    let copied = after.checkpoint_bytes - before.checkpoint_bytes;
    let frames = (after.wal_bytes - before.wal_bytes) / FRAME;
    assert!(copied > 0, "a checkpoint ran: {before:?} {after:?}");
    assert_eq!(copied % PAGE, 0, "whole pages: {copied}");
    assert!(
        copied <= frames * PAGE,
        "{copied} bytes counted for checkpoints of {frames} frames ({} bytes of pages)",
        frames * PAGE
    );
}

#[test]
fn checkpoint_bytes_of_a_file_in_large_folios_are_its_pages_in_the_commits() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    file_cached_in_large_folios(&path);
    let config = Config::default()
        .wal_autocheckpoint(20)
        .checkpoint_thread(false);
    let mut inbox = Inbox::open(&path, config).unwrap();
    let before = inbox.bytes_written().unwrap();
    deliver(&mut inbox, 0, 300);
    let after = inbox.bytes_written().unwrap();
    assert_checkpoint_bytes_within_the_frames(&before, &after);
}

#[test]
fn checkpoint_bytes_of_a_file_in_large_folios_are_its_pages_on_the_thread() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    file_cached_in_large_folios(&path);
    let mut inbox = Inbox::open(&path, Config::default().wal_autocheckpoint(20)).unwrap();
    let before = inbox.bytes_written().unwrap();
    deliver(&mut inbox, 0, 300);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while inbox.bytes_written().unwrap().checkpoint_bytes == before.checkpoint_bytes
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let after = inbox.bytes_written().unwrap();
    assert_checkpoint_bytes_within_the_frames(&before, &after);
}
