//! Throughput table: every row on a fresh file, rows taking turns slice by slice.

use super::*;
use anyhow::Context;
use field_vfs::Written;
use std::time::Instant;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Row {
    Fsync,
    Raw1,
    Raw16,
    Raw256,
    Process,
    ProcessNoop,
    Batch16,
    Batch256,
    Batch256VsClassic,
    Naive,
    Classic,
    ClassicRandom,
    Duplicate,
    Conflict,
}

impl Row {
    const ALL: [Row; 14] = [
        Row::Fsync,
        Row::Raw1,
        Row::Raw16,
        Row::Raw256,
        Row::Process,
        Row::ProcessNoop,
        Row::Batch16,
        Row::Batch256,
        Row::Batch256VsClassic,
        Row::Naive,
        Row::Classic,
        Row::ClassicRandom,
        Row::Duplicate,
        Row::Conflict,
    ];

    fn label(self) -> &'static str {
        match self {
            Row::Fsync => "fsync limit (4 KiB write + fdatasync)",
            Row::Raw1 => "raw SQLite, 1 insert/tx",
            Row::Raw16 => "raw SQLite, 16 inserts/tx",
            Row::Raw256 => "raw SQLite, 256 inserts/tx",
            Row::Process => "edge-inbox `process` (1/tx)",
            Row::ProcessNoop => "edge-inbox `process` (1/tx), no-op handler",
            Row::Batch16 => "edge-inbox `process_batch_into` 16",
            Row::Batch256 => "edge-inbox `process_batch_into` 256",
            Row::Batch256VsClassic => "edge-inbox `process_batch_into` 256 (vs classic)",
            Row::Naive => "naive query-then-insert (2 tx)",
            Row::Classic => "classic 1 tx/msg, unique constraint",
            Row::ClassicRandom => "classic 1 tx/msg, unique constraint, random ids (UUIDv4)",
            Row::Duplicate => "duplicate path (`process`, redelivery)",
            Row::Conflict => "conflict path (`process`, same id, other payload)",
        }
    }

    /// The row this one is divided by, and the target ratio if there is one.
    fn reference(self) -> (Option<Row>, Option<f64>) {
        match self {
            Row::Fsync => (None, None),
            Row::Raw1 => (Some(Row::Fsync), None),
            Row::Raw16 | Row::Raw256 => (Some(Row::Raw1), None),
            Row::Process => (Some(Row::Raw1), Some(0.9)),
            Row::ProcessNoop => (Some(Row::Raw1), None),
            Row::Batch16 => (Some(Row::Raw16), None),
            Row::Batch256 => (Some(Row::Raw256), Some(0.5)),
            Row::Batch256VsClassic => (Some(Row::Classic), Some(20.0)),
            Row::Naive | Row::Classic | Row::ClassicRandom | Row::Duplicate | Row::Conflict => {
                (Some(Row::Process), None)
            }
        }
    }

    /// Deliveries per transaction.
    fn batch(self) -> usize {
        match self {
            Row::Raw16 | Row::Batch16 => 16,
            Row::Raw256 | Row::Batch256 => 256,
            _ => 1,
        }
    }

    /// Messages per slice, for `slices` slices: batched rows get more so they still commit many times.
    fn slice_len(self, n: usize, slices: usize) -> usize {
        let total = match self.batch() {
            1 => n,
            16 => n * 4,
            _ => (n * 16).max(256 * slices),
        };
        (total / slices / self.batch()).max(1) * self.batch()
    }

    /// The `n` message ids this row commits, `{prefix}-NNNNNNNN` in shape for it; the `i`th is committed
    /// at `slot(i)` of its file's history (`--id-shape uuidv7`).
    fn ids(self, prefix: &str, n: usize, slot: impl Fn(u64) -> u64) -> Vec<String> {
        self.shape(
            (0..n as u64)
                .map(|i| super::shaped_id(super::stream_id(prefix, i), slot(i)))
                .collect(),
        )
    }

    /// Ids that increase, as given, or for the random-id row UUIDv4-shaped ids drawn from them.
    fn shape(self, ids: Vec<String>) -> Vec<String> {
        if self == Row::ClassicRandom {
            ids.iter().map(|id| uuid_v4_like(id)).collect()
        } else {
            ids
        }
    }
}

/// A UUIDv4-shaped id drawn from `seed` (the same seed, the same id). A classic consumer keys its index on
/// the id itself: ids that increase append to one leaf (its best case), random ones land on scattered leaves,
/// as the inbox's keyed hashes always do.
fn uuid_v4_like(seed: &str) -> String {
    let h = xxhash_rust::xxh3::xxh3_128(seed.as_bytes());
    let h = (h & !(0xf << 76)) | (0x4 << 76); // version 4
    super::uuid_text((h & !(0x3 << 62)) | (0x2 << 62)) // RFC 4122 variant
}

/// Messages of warm-up per row, before the clock runs.
const WARM_UP: usize = 1100;

/// Warm-up chunks (of [`WARM_UP`] messages) at most, while a row's WAL still grows.
const MAX_WARM_CHUNKS: usize = 200;

/// Runs `chunk(0)`, `chunk(1)`, ... until one leaves the WAL file at `wal` as long as it found it, and not
/// empty: the WAL has wrapped once. Returns how many chunks ran; fails after `max` of them.
pub(crate) fn until_wal_wraps(
    wal: &Path,
    max: usize,
    mut chunk: impl FnMut(usize) -> anyhow::Result<()>,
) -> anyhow::Result<usize> {
    let len = || std::fs::metadata(wal).map_or(0, |m| m.len());
    for k in 0..max {
        let before = len();
        chunk(k)?;
        let after = len();
        if after == before && after > 0 {
            return Ok(k + 1);
        }
    }
    anyhow::bail!("the WAL still grew after {max} chunks")
}

/// How many slices each row's messages are cut into; the rows take turns slice by slice.
const SLICES: usize = 20;

/// Slices of the end-to-end rows (each slice is a publish run and a consumer connection of its own).
#[cfg(feature = "mqtt")]
pub(crate) const SLICES_E2E: usize = 4;

/// One contender of the table with its own fresh file.
struct Contender {
    row: Row,
    store: Store,
    ids: Vec<String>,
    slice_len: usize,
    next: usize,
    warm: usize,
    elapsed: Duration,
    /// Bytes written during the timed slices, as the VFS and the kernel saw them.
    written: Written,
    /// The same as the inbox counted it ([`Inbox::bytes_written`]): WAL, checkpoints.
    counted: (u64, u64),
    /// Messages committed before the clock ran (until the WAL had wrapped once).
    warmed: usize,
}

/// Bytes one row wrote over its timed deliveries, pooled over the rounds.
#[derive(Clone, Copy, Default)]
pub(crate) struct RowBytes {
    written: Written,
    counted: (u64, u64),
    deliveries: u64,
    inbox: bool,
    /// The most messages of warm-up a round gave this row.
    warmed: usize,
    /// Inbox rows: bytes of the pages of the identity index in the file at the round's end, and its rows,
    /// pooled over rounds.
    index: (u64, u64),
    /// Inbox rows: the file's identity layout.
    layout: Option<edge_inbox::IdOrder>,
}

/// The handler of an inbox row, chosen at run time.
type BoxedHandler = Box<dyn FnMut(&mut Tx<'_>, &Delivery<'_>) -> anyhow::Result<()>>;

enum Store {
    Fsync(Box<FsyncFile>),
    Raw(Raw),
    Inbox {
        inbox: Box<Inbox>,
        handler: BoxedHandler,
        outcomes: Vec<Outcome>,
    },
    Peer(Peer),
}

impl Contender {
    fn new(
        dir: &Path,
        row: Row,
        n: usize,
        round: usize,
        prefill: usize,
    ) -> anyhow::Result<Contender> {
        let path = dir.join(format!("{row:?}-{round}.db"));
        let slice_len = row.slice_len(n, SLICES);
        let warm = WARM_UP.div_ceil(row.batch()).max(4) * row.batch();
        // Slots in the order the ids are committed: the first warm-up chunk, the others, then the timed
        // slices (the redelivery rows commit all of theirs once before the prefill, then again in that order).
        let (w, timed_from) = (
            warm as u64,
            HISTORY + (MAX_WARM_CHUNKS as u64 + 1) * warm as u64,
        );
        let ids = row.ids(&format!("r{round}"), warm + slice_len * SLICES, |i| {
            if i < w {
                HISTORY + i
            } else {
                timed_from + i - w
            }
        });
        let mut store = match row {
            Row::Fsync => Store::Fsync(Box::new(FsyncFile::create(&path)?)),
            Row::Raw1 | Row::Raw16 | Row::Raw256 => Store::Raw(Raw::open(&path, Sync::Full)?),
            Row::Naive | Row::Classic | Row::ClassicRandom => {
                Store::Peer(Peer::open(&path, Sync::Full)?)
            }
            Row::Batch256VsClassic => unreachable!("derived from Batch256"),
            _ => {
                let mut inbox = open_inbox(&path, Sync::Full)?;
                let mut handler: BoxedHandler = if row == Row::ProcessNoop {
                    Box::new(noop_handler)
                } else {
                    Box::new(kv_handler())
                };
                let mut outcomes = Vec::with_capacity(256);
                if matches!(row, Row::Duplicate | Row::Conflict) {
                    // Committed before the clock runs: these rows measure the redelivery only.
                    let ds = deliveries(&ids, PAYLOAD);
                    process_batches(&mut inbox, &ds, 256, &mut handler, &mut outcomes)?;
                }
                Store::Inbox {
                    inbox: Box::new(inbox),
                    handler,
                    outcomes,
                }
            }
        };
        fill(&mut store, row, round, prefill)?;
        let mut c = Contender {
            row,
            store,
            ids,
            slice_len,
            next: 0,
            warm,
            elapsed: Duration::ZERO,
            written: Written::default(),
            counted: (0, 0),
            warmed: 0,
        };
        // Warm-up: until the WAL has wrapped once (a chunk of commits that did not grow it), so every row is
        // timed on a WAL of its steady size, as on a long-running gateway. The first pass of a fresh WAL
        // appends, and each fdatasync then also commits the file's new size: 1.5-2x the time of a sync in
        // place, measured on ext4. The rows' thresholds differ (SQLite's 1000 pages for the plain rows, the
        // inbox's own for the others), and so does how many commits fill them.
        if row == Row::Fsync || fresh_wal() {
            c.run(warm)?;
            c.warmed = warm;
        } else {
            let wal = PathBuf::from(format!("{}-wal", path.display()));
            let chunks = until_wal_wraps(&wal, MAX_WARM_CHUNKS, |chunk| {
                if chunk == 0 {
                    return c.run(warm);
                }
                // Before the timed ids in key order ('q' < 'r'): the classic rows keep appending to their
                // index.
                let first = HISTORY + (chunk * warm) as u64;
                let more = row.ids(&format!("q{round}-{chunk:04}"), warm, |i| first + i);
                c.run_ids(&more, !matches!(row, Row::Duplicate | Row::Conflict))
            })
            .with_context(|| format!("{row:?}: warm-up"))?;
            c.warmed = warm * chunks;
            // The warm-up's frames are copied now, so that the timed deliveries' bytes are their own; the WAL
            // keeps its size.
            checkpoint_all(&c.store, "RESTART")?;
        }
        c.elapsed = Duration::ZERO;
        c.written = Written::default();
        c.counted = (0, 0);
        Ok(c)
    }

    /// Runs the next `len` messages and adds their wall time.
    fn run(&mut self, len: usize) -> anyhow::Result<()> {
        let ids = std::mem::take(&mut self.ids);
        let result = self.run_ids(&ids[self.next..self.next + len], true);
        self.ids = ids;
        self.next += len;
        result
    }

    /// Commits `ids` and adds their wall time; with `check`, every outcome must be the row's (a warm-up
    /// with new ids gives the redelivery rows new deliveries instead).
    fn run_ids(&mut self, ids: &[String], check: bool) -> anyhow::Result<()> {
        let row = self.row;
        let batch = row.batch();
        let payload = if row == Row::Conflict {
            OTHER_PAYLOAD
        } else {
            PAYLOAD
        };
        let ds = deliveries(ids, payload);
        let now = now();
        let written = Written::now();
        let counted = self.counted_now()?;
        let (result, t) = match &mut self.store {
            Store::Fsync(f) => timed(|| {
                ids.iter().try_for_each(|_| {
                    f.write_sync()?;
                    field_vfs::after_sync();
                    Ok::<_, std::io::Error>(())
                })?;
                Ok::<_, anyhow::Error>(ids.len())
            }),
            Store::Raw(raw) => timed(|| {
                ids.chunks(batch).try_for_each(|c| raw.insert_tx(c, now))?;
                Ok(ids.len())
            }),
            Store::Peer(peer) => timed(|| {
                ids.iter().try_fold(0, |acc, id| {
                    let applied = if row == Row::Naive {
                        peer.query_then_insert(id)?
                    } else {
                        peer.classic(id)?
                    };
                    Ok(acc + usize::from(applied))
                })
            }),
            Store::Inbox {
                inbox,
                handler,
                outcomes,
            } => {
                let expect = match row {
                    Row::Duplicate => "duplicate",
                    Row::Conflict => "conflict",
                    _ => "processed",
                };
                timed(|| {
                    if batch == 1 {
                        process_each(inbox, &ds, handler, expect)
                    } else {
                        process_batches(inbox, &ds, batch, handler, outcomes)
                    }
                })
            }
        };
        let done = result?;
        anyhow::ensure!(!check || done == ids.len(), "{row:?}: unexpected outcomes");
        self.elapsed += t;
        self.written.add(Written::now().since(written));
        let after = self.counted_now()?;
        self.counted.0 += after.0 - counted.0;
        self.counted.1 += after.1 - counted.1;
        Ok(())
    }

    /// What the inbox of an inbox row has counted so far (zeros for the others).
    fn counted_now(&self) -> anyhow::Result<(u64, u64)> {
        Ok(match &self.store {
            Store::Inbox { inbox, .. } => {
                let w = inbox.bytes_written()?;
                (w.wal_bytes, w.checkpoint_bytes)
            }
            _ => (0, 0),
        })
    }

    fn rate(&self) -> f64 {
        (self.next - self.warm) as f64 / self.elapsed.as_secs_f64()
    }
}

/// Commits `count` deliveries of other ids to a row's file before its warm-up, in transactions of 4096 (the
/// inbox rows through `process_batch_into` with their handler): a file with a history, whose identity index
/// no longer fits in a few pages.
fn fill(store: &mut Store, row: Row, round: usize, count: usize) -> anyhow::Result<()> {
    for ids in prefill_chunks(&format!("p{round}"), count) {
        let ids = row.shape(ids);
        match store {
            Store::Fsync(_) => return Ok(()),
            Store::Raw(raw) => raw.insert_tx(&ids, now())?,
            Store::Peer(peer) => peer.fill(&ids)?,
            Store::Inbox {
                inbox,
                handler,
                outcomes,
            } => fill_inbox(inbox, &ids, handler, outcomes)?,
        }
    }
    // The history's WAL is copied back now, not by a checkpoint that would run during a timed slice.
    if count > 0 {
        checkpoint_all(store, "TRUNCATE")?;
    }
    Ok(())
}

/// `count` ids `{prefix}-NNNNNNNN` (in `--id-shape`, the file's first slots) in chunks of 4096, one chunk per
/// transaction of a prefill.
pub(crate) fn prefill_chunks(prefix: &str, count: usize) -> impl Iterator<Item = Vec<String>> + '_ {
    (0..count).step_by(4096).map(move |start| {
        (start..(start + 4096).min(count))
            .map(|i| super::shaped_id(format!("{prefix}-{i:08}"), i as u64))
            .collect()
    })
}

/// Commits `ids` (all new) to `inbox` through `process_batch_into` in one transaction.
pub(crate) fn fill_inbox<H>(
    inbox: &mut Inbox,
    ids: &[String],
    handler: &mut H,
    outcomes: &mut Vec<Outcome>,
) -> anyhow::Result<()>
where
    H: FnMut(&mut Tx<'_>, &Delivery<'_>) -> anyhow::Result<()>,
{
    let ds = deliveries(ids, PAYLOAD);
    let done = process_batches(inbox, &ds, ds.len(), handler, outcomes)?;
    anyhow::ensure!(done == ids.len(), "prefill: unexpected outcomes");
    Ok(())
}

/// Copies the whole WAL back into the database file (a no-op for the fsync row): `TRUNCATE` also empties the
/// file, `RESTART` keeps its size for the next writer to reuse.
fn checkpoint_all(store: &Store, mode: &str) -> anyhow::Result<()> {
    match store {
        Store::Fsync(_) => Ok(()),
        Store::Raw(raw) => checkpoint(raw.conn(), mode),
        Store::Peer(peer) => checkpoint(peer.conn(), mode),
        Store::Inbox { inbox, .. } => checkpoint(inbox.connection(), mode),
    }
}

/// `PRAGMA wal_checkpoint(TRUNCATE)` until it is not busy (another connection's checkpoint), for up to 60 s.
#[cfg(feature = "mqtt")]
pub(crate) fn checkpoint_truncate(conn: &edge_inbox::rusqlite::Connection) -> anyhow::Result<()> {
    checkpoint(conn, "TRUNCATE")
}

/// `PRAGMA wal_checkpoint(mode)` until it is not busy, for up to 60 s.
pub(crate) fn checkpoint(
    conn: &edge_inbox::rusqlite::Connection,
    mode: &str,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while conn.query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |r| {
        r.get::<_, i64>(0)
    })? != 0
    {
        anyhow::ensure!(Instant::now() < deadline, "the WAL stayed busy for 60 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// One round: every row on a fresh file, taking turns slice by slice so that a busy neighbour slows all of
/// them alike. Returns messages per second indexed like [`Row::ALL`].
fn round(
    dir: &Path,
    n: usize,
    round: usize,
    prefill: usize,
    bytes: &mut [RowBytes],
) -> anyhow::Result<Vec<f64>> {
    let mut contenders = Row::ALL
        .into_iter()
        .filter(|r| *r != Row::Batch256VsClassic)
        .map(|row| Contender::new(dir, row, n, round, prefill))
        .collect::<anyhow::Result<Vec<_>>>()?;
    for _ in 0..SLICES {
        for c in &mut contenders {
            c.run(c.slice_len)?;
        }
    }
    // What the timed deliveries left in the WAL is copied back too, and counted as theirs: the checkpoint
    // that would copy it later is part of what a delivery costs (on a large file, most of it).
    for c in &mut contenders {
        let before = Written::now();
        checkpoint_all(&c.store, "TRUNCATE")?;
        // Its syncs are not a delivery's: the syncs column stays the commits'.
        let copied = Written::now().since(before);
        c.written.add(Written { syncs: 0, ..copied });
    }
    let mut rates = vec![0.0; Row::ALL.len()];
    for c in &contenders {
        rates[idx(c.row)] = c.rate();
        let b = &mut bytes[idx(c.row)];
        b.written.add(c.written);
        b.counted.0 += c.counted.0;
        b.counted.1 += c.counted.1;
        b.deliveries += (c.next - c.warm) as u64;
        b.inbox = matches!(c.store, Store::Inbox { .. });
        b.warmed = b.warmed.max(c.warmed);
        if let Store::Inbox { inbox, .. } = &c.store {
            // Every page of the index, leaves and interior, as the file holds them after the last checkpoint.
            let (bytes, rows): (i64, i64) = inbox.connection().query_row(
                "SELECT (SELECT sum(pgsize) FROM dbstat WHERE name = 'identities'), \
                 (SELECT count(*) FROM identities)",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
            b.index.0 += bytes as u64;
            b.index.1 += rows as u64;
            b.layout = Some(inbox.id_key().order());
        }
        eprintln!(
            "round {}: {:<56} {:>10.0} msg/s",
            round + 1,
            c.row.label(),
            c.rate()
        );
    }
    rates[idx(Row::Batch256VsClassic)] = rates[idx(Row::Batch256)];
    drop(contenders);
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_file() {
            std::fs::remove_file(path)?;
        }
    }
    Ok(rates)
}

fn idx(row: Row) -> usize {
    Row::ALL.iter().position(|r| *r == row).expect("listed")
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

pub(crate) fn table(dir: &Path, n: usize, rounds: usize, prefill: usize) -> anyhow::Result<()> {
    let mut bytes = vec![RowBytes::default(); Row::ALL.len()];
    let rates = (0..rounds)
        .map(|r| round(dir, n, r, prefill, &mut bytes))
        .collect::<anyhow::Result<Vec<_>>>()?;
    println!(
        "\n| workload (synchronous=FULL, n={n}, rows interleaved in {SLICES} slices, median of {rounds} rounds) | msgs/s | ratio | target | met? |"
    );
    println!("|---|---:|---|---|---|");
    for row in Row::ALL {
        let rate = median(rates.iter().map(|r| r[idx(row)]).collect());
        let (reference, target) = row.reference();
        let (ratio, ratio_text) = match reference {
            Some(base) => {
                let ratio = median(rates.iter().map(|r| r[idx(row)] / r[idx(base)]).collect());
                (Some(ratio), format!("{ratio:.2}x {}", short(base)))
            }
            None => (None, "reference".to_string()),
        };
        let (target_text, met) = match (target, ratio) {
            (Some(t), Some(r)) => (format!(">= {t}x"), if r >= t { "yes" } else { "**no**" }),
            _ => ("-".to_string(), "-"),
        };
        println!(
            "| {} | {:.0} | {} | {} | {} |",
            row.label(),
            rate,
            ratio_text,
            target_text,
            met
        );
    }
    println!("\nPer-round rates (msgs/s):\n");
    for row in Row::ALL {
        let per: Vec<String> = rates
            .iter()
            .map(|r| format!("{:.0}", r[idx(row)]))
            .collect();
        println!("- {}: {}", row.label(), per.join(", "));
    }
    println!(
        "\n| bytes written per delivery (timed slices and a checkpoint of their WAL at the end, pooled over {rounds} rounds; sync +{} ms; {prefill} earlier deliveries in each file) | WAL | database file (checkpoints) | block layer (/proc/self/io) | syncs | counted by the inbox: WAL / checkpoints |",
        field_vfs::delay().as_millis()
    );
    println!("|---|---:|---:|---:|---:|---|");
    for row in Row::ALL {
        if row == Row::Batch256VsClassic {
            continue;
        }
        let b = &bytes[idx(row)];
        let (wal, db, block) = b.written.per(b.deliveries);
        let counted = if b.inbox {
            let n = b.deliveries.max(1) as f64;
            format!(
                "{:.0} / {:.0}",
                b.counted.0 as f64 / n,
                b.counted.1 as f64 / n
            )
        } else {
            "-".into()
        };
        println!(
            "| {} | {wal:.0} | {db:.0} | {block:.0} | {:.3} | {counted} |",
            row.label(),
            b.written.syncs as f64 / b.deliveries.max(1) as f64
        );
    }
    let block = |row: Row| {
        let b = &bytes[idx(row)];
        b.written.per(b.deliveries).2
    };
    let process = block(Row::Process);
    for classic in [Row::Classic, Row::ClassicRandom] {
        let theirs = block(classic);
        println!(
            "\nbytes target, `process` 1/tx <= {} at the block layer: {process:.0} against {theirs:.0} per delivery ({:.2}x): {}",
            short(classic),
            process / theirs,
            if process <= theirs { "met" } else { "**not met**" }
        );
    }
    let warmed: Vec<String> = Row::ALL
        .into_iter()
        .filter(|r| !matches!(r, Row::Fsync | Row::Batch256VsClassic))
        .map(|r| format!("{} {}", short_or_label(r), bytes[idx(r)].warmed))
        .collect();
    let until = if fresh_wal() {
        "(--fresh-wal: rows timed on their WAL's first pass)"
    } else {
        "until the row's WAL had wrapped once"
    };
    println!(
        "\nwarm-up, messages committed before the clock {until} (its file keeps their identities): {}",
        warmed.join(", ")
    );
    let index: Vec<String> = [Row::Process, Row::Batch16, Row::Batch256]
        .iter()
        .map(|&row| {
            let (bytes, rows) = bytes[idx(row)].index;
            format!(
                "{} {:.1} ({rows} identities)",
                short_or_label(row),
                bytes as f64 / rows.max(1) as f64
            )
        })
        .collect();
    println!(
        "\nidentity index, bytes of its pages per identity in the file at the end (layout {}): {}",
        bytes[idx(Row::Process)]
            .layout
            .map_or("?".into(), |o| o.name()),
        index.join(", ")
    );
    Ok(())
}

/// The short name of `row` where it has one, its label otherwise.
fn short_or_label(row: Row) -> &'static str {
    match short(row) {
        "?" => row.label(),
        s => s,
    }
}

fn short(row: Row) -> &'static str {
    match row {
        Row::Fsync => "fsync limit",
        Row::Raw1 => "raw 1/tx",
        Row::Raw16 => "raw 16/tx",
        Row::Raw256 => "raw 256/tx",
        Row::Process => "process",
        Row::Classic => "classic",
        Row::ClassicRandom => "classic, random ids",
        _ => "?",
    }
}
