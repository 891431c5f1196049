//! Benchmark binary for the gateway's own storage: how close the inbox gets to the device's commit limit,
//! what it costs against a hand-written consumer, and what it allocates per delivery.
//!
//! ```text
//! cargo run --release --example bench -- --db-dir /path/on/the/sd-card [--n 500] [--rounds 3] [--mode all]
//! ```
//!
//! Modes: `all` (default: table, allocations, race demo), `table`, `allocs`, `race`, `trace-allocs`
//! (prints where each steady-state allocation of a batch comes from; build with
//! `CARGO_PROFILE_RELEASE_DEBUG=line-tables-only` for file names). `--instructions KIND` does `--n`
//! deliveries of one kind with `synchronous=OFF` for `valgrind --tool=callgrind`; KIND is `raw`,
//! `process`, `process-noop`, `raw256` or `batch256`.
//!
//! Every row runs on a fresh database file in `--db-dir` with `synchronous=FULL`; all rows run once per
//! round, rounds are interleaved, and the table shows the median rate and the median of the per-round ratios,
//! so a noisy neighbour shifts compared figures together.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use edge_inbox::{Delivery, Inbox, Outcome, Tx};

#[path = "../benches/common/mod.rs"]
mod common;
use common::*;

// ---------------------------------------------------------------------------------------------------------
// Counting allocator

/// Counts every allocation and reallocation of Rust code. SQLite's own C allocations go to libc directly
/// and are not seen here (run under `valgrind --tool=dhat` for those).
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static TRACE: AtomicBool = AtomicBool::new(false);
static TRACES: Mutex<Vec<String>> = Mutex::new(Vec::new());

thread_local! {
    static IN_TRACE: Cell<bool> = const { Cell::new(false) };
}

fn record(size: usize) {
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    if TRACE.load(Ordering::Relaxed) && !IN_TRACE.with(Cell::get) {
        IN_TRACE.with(|t| t.set(true));
        let bt = std::backtrace::Backtrace::force_capture();
        let text = format!("{size} bytes\n{bt}");
        TRACES.lock().unwrap().push(text);
        IN_TRACE.with(|t| t.set(false));
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------------------------
// Arguments

struct Args {
    db_dir: PathBuf,
    n: usize,
    rounds: usize,
    mode: String,
    instructions: Option<String>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        db_dir: PathBuf::new(),
        n: 500,
        rounds: 3,
        mode: "all".into(),
        instructions: None,
    };
    let mut db_dir = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--db-dir" => db_dir = Some(PathBuf::from(value()?)),
            "--n" => args.n = value()?.parse().context("--n")?,
            "--rounds" => args.rounds = value()?.parse().context("--rounds")?,
            "--mode" => args.mode = value()?,
            "--instructions" => args.instructions = Some(value()?),
            "-h" | "--help" => {
                println!(
                    "usage: bench --db-dir PATH [--n N] [--rounds R] \
                     [--mode all|table|allocs|race|trace-allocs] [--instructions raw|process|process-noop|raw256|batch256]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (try --help)"),
        }
    }
    args.db_dir =
        db_dir.context("--db-dir PATH is required (a directory on the storage to measure)")?;
    anyhow::ensure!(
        args.n > 0 && args.rounds > 0,
        "--n and --rounds must be positive"
    );
    Ok(args)
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    std::fs::create_dir_all(&args.db_dir)?;
    let dir = tempfile::Builder::new()
        .prefix("edge-inbox-bench-")
        .tempdir_in(&args.db_dir)?;
    if let Some(kind) = &args.instructions {
        return instructions(dir.path(), kind, args.n);
    }
    let mode = args.mode.as_str();
    if matches!(mode, "all" | "table") {
        table(dir.path(), args.n, args.rounds)?;
    }
    if matches!(mode, "all" | "allocs") {
        allocations(dir.path())?;
    }
    if mode == "trace-allocs" {
        trace_allocations(dir.path())?;
    }
    if matches!(mode, "all" | "race") {
        race(dir.path(), 200)?;
    }
    if !matches!(mode, "all" | "table" | "allocs" | "race" | "trace-allocs") {
        bail!("unknown mode {mode:?}");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------
// Throughput table

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
    Duplicate,
    Conflict,
}

impl Row {
    const ALL: [Row; 13] = [
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
            Row::Naive | Row::Classic | Row::Duplicate | Row::Conflict => {
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
}

/// Messages of warm-up per row, before the clock runs.
const WARM_UP: usize = 1100;

/// How many slices each row's messages are cut into; the rows take turns slice by slice.
const SLICES: usize = 20;

/// One contender of the table with its own fresh file.
struct Contender {
    row: Row,
    store: Store,
    ids: Vec<String>,
    slice_len: usize,
    next: usize,
    warm: usize,
    elapsed: Duration,
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
    fn new(dir: &Path, row: Row, n: usize, round: usize) -> anyhow::Result<Contender> {
        let path = dir.join(format!("{row:?}-{round}.db"));
        let slice_len = row.slice_len(n, SLICES);
        // Warm-up: enough one-page commits for the WAL to wrap once (the default checkpoint runs at 1000
        // pages), so every row is timed on a WAL of its steady size, as on a long-running gateway. The first
        // pass of a fresh WAL appends and makes every fdatasync also commit file-size metadata.
        let warm = WARM_UP.div_ceil(row.batch()).max(4) * row.batch();
        let ids = ids(&format!("r{round}"), warm + slice_len * SLICES);
        let store = match row {
            Row::Fsync => Store::Fsync(Box::new(FsyncFile::create(&path)?)),
            Row::Raw1 | Row::Raw16 | Row::Raw256 => Store::Raw(Raw::open(&path, Sync::Full)?),
            Row::Naive | Row::Classic => Store::Peer(Peer::open(&path, Sync::Full)?),
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
        let mut c = Contender {
            row,
            store,
            ids,
            slice_len,
            next: 0,
            warm,
            elapsed: Duration::ZERO,
        };
        c.run(warm)?;
        c.elapsed = Duration::ZERO;
        Ok(c)
    }

    /// Runs the next `len` messages and adds their wall time.
    fn run(&mut self, len: usize) -> anyhow::Result<()> {
        let ids = &self.ids[self.next..self.next + len];
        self.next += len;
        let row = self.row;
        let batch = row.batch();
        let payload = if row == Row::Conflict {
            OTHER_PAYLOAD
        } else {
            PAYLOAD
        };
        let ds = deliveries(ids, payload);
        let now = now();
        let (result, t) = match &mut self.store {
            Store::Fsync(f) => timed(|| {
                ids.iter().try_for_each(|_| f.write_sync())?;
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
        anyhow::ensure!(result? == ids.len(), "{row:?}: unexpected outcomes");
        self.elapsed += t;
        Ok(())
    }

    fn rate(&self) -> f64 {
        (self.next - self.warm) as f64 / self.elapsed.as_secs_f64()
    }
}

/// One round: every row on a fresh file, taking turns slice by slice so that a busy neighbour slows all of
/// them alike. Returns messages per second indexed like [`Row::ALL`].
fn round(dir: &Path, n: usize, round: usize) -> anyhow::Result<Vec<f64>> {
    let mut contenders = Row::ALL
        .into_iter()
        .filter(|r| *r != Row::Batch256VsClassic)
        .map(|row| Contender::new(dir, row, n, round))
        .collect::<anyhow::Result<Vec<_>>>()?;
    for _ in 0..SLICES {
        for c in &mut contenders {
            c.run(c.slice_len)?;
        }
    }
    let mut rates = vec![0.0; Row::ALL.len()];
    for c in &contenders {
        rates[idx(c.row)] = c.rate();
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn table(dir: &Path, n: usize, rounds: usize) -> anyhow::Result<()> {
    let rates = (0..rounds)
        .map(|r| round(dir, n, r))
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
    Ok(())
}

fn short(row: Row) -> &'static str {
    match row {
        Row::Fsync => "fsync limit",
        Row::Raw1 => "raw 1/tx",
        Row::Raw16 => "raw 16/tx",
        Row::Raw256 => "raw 256/tx",
        Row::Process => "process",
        Row::Classic => "classic",
        _ => "?",
    }
}

// ---------------------------------------------------------------------------------------------------------
// Allocations

/// Allocations per delivery of `run`, after warming up with the same work.
fn per_delivery(
    label: &str,
    deliveries_per_call: usize,
    calls: usize,
    mut run: impl FnMut(usize) -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    for i in 0..calls {
        run(i)?;
    }
    let before = allocs();
    for i in calls..2 * calls {
        run(i)?;
    }
    let per = (allocs() - before) as f64 / (calls * deliveries_per_call) as f64;
    println!("| {label} | {per:.2} |");
    Ok(per)
}

fn allocations(dir: &Path) -> anyhow::Result<()> {
    println!("\n| steady state, after warm-up (Rust heap only) | allocations per delivery |");
    println!("|---|---:|");
    for (batch, calls) in [(16usize, 40usize), (256, 8)] {
        for kv in [false, true] {
            let path = dir.join(format!("allocs-{batch}-{kv}.db"));
            let mut inbox = open_inbox(&path, Sync::Full)?;
            let ids = ids("a", batch * calls * 2);
            let ds = deliveries(&ids, PAYLOAD);
            let mut outcomes = Vec::with_capacity(batch);
            let mut kv_h = kv_handler();
            let label = format!(
                "`process_batch_into` {batch}, {} handler",
                if kv {
                    "`tx.put` (small integer)"
                } else {
                    "no-op"
                }
            );
            per_delivery(&label, batch, calls, |i| {
                let chunk = &ds[i * batch..(i + 1) * batch];
                if kv {
                    inbox.process_batch_into(chunk, &mut kv_h, &mut outcomes)?;
                } else {
                    inbox.process_batch_into(chunk, &mut noop_handler, &mut outcomes)?;
                }
                Ok(())
            })?;
        }
    }
    let path = dir.join("allocs-process.db");
    let mut inbox = open_inbox(&path, Sync::Full)?;
    let ids = ids("p", 400);
    let ds = deliveries(&ids, PAYLOAD);
    per_delivery("`process`, no-op handler", 1, 200, |i| {
        inbox.process(&ds[i], noop_handler)?;
        Ok(())
    })?;
    per_delivery("`process`, duplicate (redelivery)", 1, 200, |i| {
        let o = inbox.process(&ds[i % 200], noop_handler)?;
        anyhow::ensure!(matches!(o, Outcome::Duplicate));
        Ok(())
    })?;
    Ok(())
}

/// Prints the backtrace of every allocation in one steady-state batch of 16 with a no-op handler.
fn trace_allocations(dir: &Path) -> anyhow::Result<()> {
    let path = dir.join("trace.db");
    let mut inbox = open_inbox(&path, Sync::Full)?;
    let ids = ids("t", 16 * 11);
    let ds = deliveries(&ids, PAYLOAD);
    let mut outcomes = Vec::with_capacity(16);
    let mut kv_h = kv_handler();
    for chunk in ds.chunks(16).take(10) {
        inbox.process_batch_into(chunk, &mut kv_h, &mut outcomes)?;
    }
    let last = &ds[160..176];
    TRACE.store(true, Ordering::SeqCst);
    inbox.process_batch_into(last, &mut kv_h, &mut outcomes)?;
    TRACE.store(false, Ordering::SeqCst);
    let traces = std::mem::take(&mut *TRACES.lock().unwrap());
    // Grouped by size and the frames that name a crate; the counter itself is not read here because
    // resolving the backtraces allocates too.
    let mut groups: Vec<(String, usize)> = Vec::new();
    for t in &traces {
        let mut lines = t.lines();
        let size = lines.next().unwrap_or_default().to_string();
        let frames: Vec<&str> = lines
            .filter(|l| !l.trim_start().starts_with("at "))
            .map(|l| l.trim().split_once(": ").map_or(l.trim(), |(_, f)| f))
            .filter(|f| {
                !f.starts_with("std::backtrace")
                    && !f.starts_with("bench::record")
                    && !f.starts_with("<bench::Counting")
                    && !f.starts_with("__rust")
                    && !f.starts_with("alloc::")
            })
            .take(4)
            .collect();
        let key = format!("{size}: {}", frames.join(" <- "));
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, n)) => *n += 1,
            None => groups.push((key, 1)),
        }
    }
    println!(
        "{} allocations in one steady-state batch of 16 (`tx.put` handler), by call site:\n",
        traces.len()
    );
    for (key, n) in groups {
        println!("- {n} x {key}");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------
// Race demo

/// Two workers receive the same deliveries at the same moment (a barrier per message). Counts effects
/// committed more than once, for the naive consumer and for the inbox.
fn race(dir: &Path, n: usize) -> anyhow::Result<()> {
    let ids = Arc::new(ids("race", n));

    let naive_path = dir.join("race-naive.db");
    drop(Peer::open(&naive_path, Sync::Full)?);
    let applied = two_workers(&ids, {
        let naive_path = naive_path.clone();
        move |ids: &[String], barrier: &Barrier| {
            let mut peer = Peer::open(&naive_path, Sync::Full)?;
            let mut applied = 0usize;
            for id in ids {
                barrier.wait();
                applied += usize::from(peer.query_then_insert(id)?);
            }
            Ok(applied)
        }
    })?;
    let repeats = Peer::open(&naive_path, Sync::Full)?.naive_repeats()?;

    let inbox_path = dir.join("race-inbox.db");
    drop(Inbox::open(&inbox_path, edge_inbox::Config::default())?);
    let processed = two_workers(&ids, {
        let inbox_path = inbox_path.clone();
        move |ids: &[String], barrier: &Barrier| {
            let mut inbox = Inbox::open(&inbox_path, edge_inbox::Config::default())?;
            let mut processed = 0usize;
            let h = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
                let n: u64 = tx.get(d.message_id)?.unwrap_or(0);
                tx.put(d.message_id, &(n + 1))?;
                Ok(())
            };
            for id in ids {
                barrier.wait();
                let o = inbox.process(&Delivery::new(SCOPE, id, TOPIC, PAYLOAD), h)?;
                processed += usize::from(matches!(o, Outcome::Processed));
            }
            Ok(processed)
        }
    })?;
    let inbox = Inbox::open(&inbox_path, edge_inbox::Config::default())?;
    let effects: i64 = inbox
        .connection()
        .query_row("SELECT count(*) FROM kv", [], |r| r.get(0))?;
    let mut repeated_effects = 0u64;
    {
        let mut stmt = inbox.connection().prepare("SELECT value FROM kv")?;
        let mut rows = stmt.query([])?;
        while let Some(r) = rows.next()? {
            let v: Vec<u8> = r.get(0)?;
            let n: u64 = ciborium::from_reader(&v[..])?;
            repeated_effects += n.saturating_sub(1);
        }
    }

    println!(
        "\nRace demo: two threads, each with its own connection, receive the same {n} ids at once \
         (synchronous=FULL):\n"
    );
    println!("| consumer | effects applied | ids | double effects (committed) |");
    println!("|---|---:|---:|---:|");
    println!(
        "| naive query-then-insert | {applied} | {n} | {} (processed rows beyond one per id: {repeats}) |",
        applied as i64 - n as i64
    );
    println!(
        "| edge-inbox `process` | {processed} | {n} | {} (ids with an effect: {effects}, repeated effects: {repeated_effects}) |",
        processed as i64 - n as i64
    );
    Ok(())
}

fn two_workers(
    ids: &Arc<Vec<String>>,
    work: impl Fn(&[String], &Barrier) -> anyhow::Result<usize> + Send + Clone + 'static,
) -> anyhow::Result<usize> {
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = (0..2)
        .map(|_| {
            let (ids, barrier, work) = (ids.clone(), barrier.clone(), work.clone());
            std::thread::spawn(move || work(&ids, &barrier))
        })
        .collect();
    let mut total = 0;
    for h in handles {
        total += h.join().expect("worker panicked")?;
    }
    Ok(total)
}

// ---------------------------------------------------------------------------------------------------------
// Instruction counts

/// `n` deliveries of one kind with `synchronous=OFF`, for callgrind. Setup is the same whatever `n`, so the
/// difference between two runs divided by the difference in `n` is the cost per delivery.
fn instructions(dir: &Path, kind: &str, n: usize) -> anyhow::Result<()> {
    let path = dir.join(format!("instructions-{kind}.db"));
    let ids = ids("i", n);
    let now = now();
    match kind {
        "raw" | "raw256" => {
            let per_tx = if kind == "raw" { 1 } else { 256 };
            let mut raw = Raw::open(&path, Sync::Off)?;
            for c in ids.chunks(per_tx) {
                raw.insert_tx(c, now)?;
            }
        }
        "process" | "process-noop" => {
            let mut inbox = open_inbox(&path, Sync::Off)?;
            let ds = deliveries(&ids, PAYLOAD);
            let hits = if kind == "process" {
                process_each(&mut inbox, &ds, &mut kv_handler(), "processed")?
            } else {
                process_each(&mut inbox, &ds, &mut noop_handler, "processed")?
            };
            anyhow::ensure!(hits == n);
        }
        "batch256" => {
            let mut inbox = open_inbox(&path, Sync::Off)?;
            let ds = deliveries(&ids, PAYLOAD);
            let mut outcomes = Vec::with_capacity(256);
            let hits = process_batches(&mut inbox, &ds, 256, &mut kv_handler(), &mut outcomes)?;
            anyhow::ensure!(hits == n);
        }
        other => bail!("unknown --instructions kind {other:?}"),
    }
    let _ = Duration::ZERO;
    eprintln!("{n} deliveries of kind {kind} done");
    Ok(())
}
