//! The disk model: per file, what a power cut would leave.
//!
//! Every write and truncation SQLite makes is logged per file. `xSync` of a file makes everything logged for it
//! so far durable (a lying disk never does). A *snapshot* records, at an instant, how far each file's log is
//! durable and how far it goes; materialising it with a [`Cut`] gives the bytes the files would hold after a
//! power cut at that instant: the durable prefix, plus none, all, or a random subset of the unsynced writes cut
//! into 512-byte sectors (reordered and torn writes). Bytes outside a write never change
//! (SQLite's powersafe-overwrite assumption, which the platform VFS reports). Deleting a file is durable at once;
//! the `-shm` index is not modelled at all (SQLite rebuilds it from the WAL), so a cut never leaves one.

use std::collections::HashMap;
use std::sync::Mutex;

/// Sector size of the torn-write model.
pub const SECTOR: u64 = 512;

enum Op {
    Write { off: u64, data: Vec<u8> },
    Truncate(u64),
}

struct FileLog {
    name: String,
    is_wal: bool,
    base: Vec<u8>,
    ops: Vec<Op>,
    synced: usize,
}

#[derive(Clone, PartialEq, Eq, Debug)]
struct FileRef {
    log: usize,
    synced: usize,
    len: usize,
}

/// Where in the run a snapshot was taken.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Boundary {
    /// Just before an `xSync` took effect: the cut that loses exactly that sync.
    BeforeSync,
    /// Just after a write while a watched operation (prune step, vacuum, checkpoint) runs.
    Write,
    /// Between two steps of the workload.
    Step,
}

/// One instant at which the power may go.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// What the workload was doing.
    pub label: String,
    /// Which kind of instant.
    pub boundary: Boundary,
    /// Acknowledgements the workload had recorded (calls that had returned `Ok`).
    pub acked: usize,
    /// Deliveries the workload had offered (calls made or returned).
    pub offered: usize,
    /// Syncs of any file completed before this instant.
    pub syncs: u64,
    /// Syncs of a WAL file completed before this instant.
    pub wal_syncs: u64,
    files: Vec<FileRef>,
}

impl Snapshot {
    /// Whether anything written is not yet durable at this instant.
    pub fn has_unsynced(&self) -> bool {
        self.files.iter().any(|f| f.len > f.synced)
    }

    /// Files that exist at this instant.
    pub fn files_len(&self) -> usize {
        self.files.len()
    }
}

/// What the power cut leaves of the writes no sync covered.
#[derive(Clone, Copy, Debug)]
pub enum Cut {
    /// Nothing: every file as of its last sync.
    DropUnsynced,
    /// Everything (what a killed process leaves: the page cache survives).
    KeepUnsynced,
    /// Each unsynced sector (and truncation) independently kept or lost, from this seed.
    Torn(u64),
}

#[derive(Default)]
struct State {
    logs: Vec<FileLog>,
    current: HashMap<String, usize>,
    lying: bool,
    recording: bool,
    watch_writes: bool,
    label: String,
    acked: usize,
    offered: usize,
    syncs: u64,
    wal_syncs: u64,
    snapshots: Vec<Snapshot>,
}

impl State {
    fn snapshot(&mut self, boundary: Boundary) {
        if !self.recording {
            return;
        }
        let mut files: Vec<FileRef> = self
            .current
            .values()
            .map(|&log| FileRef {
                log,
                synced: self.logs[log].synced,
                len: self.logs[log].ops.len(),
            })
            .collect();
        files.sort_by_key(|f| f.log);
        if let Some(last) = self.snapshots.last() {
            if last.files == files && last.acked == self.acked {
                return; // the same instant as far as the disk and the acks are concerned
            }
        }
        self.snapshots.push(Snapshot {
            label: self.label.clone(),
            boundary,
            acked: self.acked,
            offered: self.offered,
            syncs: self.syncs,
            wal_syncs: self.wal_syncs,
            files,
        });
    }
}

/// One simulated disk (one per registered VFS, so tests can run in parallel).
#[derive(Default)]
pub struct Disk {
    state: Mutex<State>,
}

impl Disk {
    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// A file SQLite opens: its log, created from what the file holds now if it is not tracked yet.
    pub fn open(&self, path: &str, is_wal: bool) -> usize {
        self.with(|s| {
            if let Some(&id) = s.current.get(path) {
                return id;
            }
            let base = std::fs::read(path).unwrap_or_default();
            let name = std::path::Path::new(path)
                .file_name()
                .expect("file name")
                .to_string_lossy()
                .into_owned();
            s.logs.push(FileLog {
                name,
                is_wal,
                base,
                ops: Vec::new(),
                synced: 0,
            });
            let id = s.logs.len() - 1;
            s.current.insert(path.to_owned(), id);
            id
        })
    }

    /// A write that reached the file.
    pub fn write(&self, log: usize, off: u64, data: &[u8]) {
        self.with(|s| {
            s.logs[log].ops.push(Op::Write {
                off,
                data: data.to_vec(),
            });
            if s.watch_writes {
                s.snapshot(Boundary::Write);
            }
        })
    }

    /// A truncation that reached the file.
    pub fn truncate(&self, log: usize, size: u64) {
        self.with(|s| {
            s.logs[log].ops.push(Op::Truncate(size));
            if s.watch_writes {
                s.snapshot(Boundary::Write);
            }
        })
    }

    /// `xSync`: the instant before it is a cut point; then the file's log is durable (unless the disk lies).
    pub fn sync(&self, log: usize) {
        self.with(|s| {
            s.snapshot(Boundary::BeforeSync);
            if !s.lying {
                s.logs[log].synced = s.logs[log].ops.len();
            }
            s.syncs += 1;
            if s.logs[log].is_wal {
                s.wal_syncs += 1;
            }
        })
    }

    /// A file deleted: gone at once, durably.
    pub fn delete(&self, path: &str) {
        self.with(|s| {
            s.current.remove(path);
        })
    }

    /// Start or stop taking snapshots.
    pub fn set_recording(&self, on: bool) {
        self.with(|s| s.recording = on)
    }

    /// A lying disk: syncs return success and make nothing durable.
    pub fn set_lying(&self, lying: bool) {
        self.with(|s| s.lying = lying)
    }

    /// Names what the workload does now, and whether every write of it is a cut point.
    pub fn phase(&self, label: &str, watch_writes: bool) {
        self.with(|s| {
            s.label.clear();
            s.label.push_str(label);
            s.watch_writes = watch_writes;
        })
    }

    /// Renames the snapshots taken since `from` (once a step's report says what it was).
    pub fn relabel_since(&self, from: usize, label: &str) {
        self.with(|s| {
            let from = from.min(s.snapshots.len());
            for snap in &mut s.snapshots[from..] {
                snap.label = label.to_owned();
            }
        })
    }

    /// The workload has recorded `n` acknowledgements so far.
    pub fn set_acked(&self, n: usize) {
        self.with(|s| s.acked = n)
    }

    /// The workload has offered `n` deliveries so far.
    pub fn set_offered(&self, n: usize) {
        self.with(|s| s.offered = n)
    }

    /// A cut point between two workload steps.
    pub fn step_boundary(&self) {
        self.with(|s| s.snapshot(Boundary::Step))
    }

    /// Completed WAL syncs so far.
    pub fn wal_syncs(&self) -> u64 {
        self.with(|s| s.wal_syncs)
    }

    /// Number of snapshots so far.
    pub fn snapshot_count(&self) -> usize {
        self.with(|s| s.snapshots.len())
    }

    /// Every snapshot taken.
    pub fn snapshots(&self) -> Vec<Snapshot> {
        self.with(|s| s.snapshots.clone())
    }

    /// The files (name, bytes) a power cut at `snap` leaves.
    pub fn materialize(&self, snap: &Snapshot, cut: Cut) -> Vec<(String, Vec<u8>)> {
        self.with(|s| {
            let mut rng = match cut {
                Cut::Torn(seed) => seed | 1,
                _ => 1,
            };
            snap.files
                .iter()
                .map(|f| {
                    let log = &s.logs[f.log];
                    let mut bytes = log.base.clone();
                    for op in &log.ops[..f.synced] {
                        apply(&mut bytes, op, None);
                    }
                    for op in &log.ops[f.synced..f.len] {
                        match cut {
                            Cut::DropUnsynced => {}
                            Cut::KeepUnsynced => apply(&mut bytes, op, None),
                            Cut::Torn(_) => apply(&mut bytes, op, Some(&mut rng)),
                        }
                    }
                    (log.name.clone(), bytes)
                })
                .collect()
        })
    }
}

fn coin(rng: &mut u64) -> bool {
    // xorshift64: deterministic per seed, no dependency.
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    *rng & 1 == 1
}

/// Applies one logged operation; with `rng`, each sector of a write (and a truncation) only by a coin toss.
fn apply(bytes: &mut Vec<u8>, op: &Op, mut rng: Option<&mut u64>) {
    match op {
        Op::Truncate(size) => {
            if rng.as_deref_mut().is_none_or(coin) {
                bytes.truncate(*size as usize);
            }
        }
        Op::Write { off, data } => {
            let mut at = *off;
            let end = off + data.len() as u64;
            while at < end {
                let chunk_end = ((at / SECTOR + 1) * SECTOR).min(end);
                if rng.as_deref_mut().is_none_or(coin) {
                    let (a, b) = (at as usize, chunk_end as usize);
                    if bytes.len() < b {
                        bytes.resize(b, 0);
                    }
                    bytes[a..b]
                        .copy_from_slice(&data[(at - off) as usize..(chunk_end - off) as usize]);
                }
                at = chunk_end;
            }
        }
    }
}
