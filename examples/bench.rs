//! Benchmark binary for the gateway's own storage: how close the inbox gets to the device's commit limit,
//! what it costs against a hand-written consumer, and what it allocates per delivery.
//!
//! ```text
//! cargo run --release --example bench -- --db-dir /path/on/the/sd-card [--n 500] [--rounds 3] [--mode all]
//! ```
//!
//! Modes: `all` (default: table, allocations, race demo), `table`, `allocs`, `race`, `trace-allocs`
//! (prints where each steady-state allocation of a batch comes from; build with
//! `CARGO_PROFILE_RELEASE_DEBUG=line-tables-only` for file names), `e2e` (publish to PUBACK through a
//! mosquitto it starts on a free 127.0.0.1 port: the MQTT `Consumer` with batches of 1 and 256 against a
//! bare consumer that acks on receipt; `--n` messages per row). `--instructions KIND` does `--n`
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
                     [--mode all|table|allocs|race|trace-allocs|e2e] [--instructions raw|process|process-noop|raw256|batch256]"
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
    if mode == "e2e" {
        #[cfg(feature = "mqtt")]
        e2e::run(dir.path(), args.n, args.rounds, &[1, 256])?;
        #[cfg(not(feature = "mqtt"))]
        println!("--mode e2e needs the `mqtt` feature");
    }
    if !matches!(
        mode,
        "all" | "table" | "allocs" | "race" | "trace-allocs" | "e2e"
    ) {
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

/// Slices of the end-to-end rows (each slice is a publish run and a consumer connection of its own).
const SLICES_E2E: usize = 4;

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

// ---------------------------------------------------------------------------------------------------------
// End to end through a real mosquitto

#[cfg(feature = "mqtt")]
mod e2e {
    //! Publish-to-PUBACK throughput through mosquitto on loopback: the edge-inbox [`Consumer`] (commit, then
    //! PUBACK, in order) against a bare rumqttc consumer that acks every publish on receipt.

    use std::path::{Path, PathBuf};
    use std::process::{Child, Command, Stdio};
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use anyhow::{bail, Context};
    use edge_inbox::{Config, Consumer, Delivery, Inbox, MqttConfig, Tx};
    use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::{Client, Event, MqttOptions};
    use rumqttc::Outgoing;

    use super::{median, PAYLOAD, SLICES_E2E};

    /// The broker's window of unacknowledged QoS1 deliveries per client, both ways (our Receive Maximum,
    /// mosquitto's `max_inflight_messages` and the publisher's own limit).
    pub const INFLIGHT: u16 = 1024;
    /// Longest any one slice may take before the run is abandoned.
    const SLICE_DEADLINE: Duration = Duration::from_secs(300);

    /// What consumes a row's deliveries.
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    enum E2eRow {
        Bare,
        Inbox(usize),
        /// The same handler and batch straight into `process_batch_into`, no MQTT: the storage's share.
        Core(usize),
    }

    impl E2eRow {
        fn label(self) -> String {
            match self {
                E2eRow::Bare => "bare rumqttc, PUBACK on receipt (upper bound)".into(),
                E2eRow::Inbox(b) => format!("edge-inbox `Consumer`, batch {b}, commit then PUBACK"),
                E2eRow::Core(b) => format!("core only: `process_batch_into` {b}, no MQTT"),
            }
        }
        fn tag(self) -> String {
            match self {
                E2eRow::Bare => "bare".into(),
                E2eRow::Inbox(b) => format!("inbox{b}"),
                E2eRow::Core(b) => format!("core{b}"),
            }
        }
    }

    /// A mosquitto on a free loopback port, killed on drop.
    struct Mosquitto {
        child: Child,
        port: u16,
    }

    fn mosquitto_exe() -> Option<PathBuf> {
        std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .map(|d| d.join("mosquitto"))
            .chain([PathBuf::from("/usr/sbin/mosquitto")])
            .find(|p| p.is_file())
    }

    impl Mosquitto {
        fn start(exe: &Path, dir: &Path) -> anyhow::Result<Mosquitto> {
            // Started as root, mosquitto drops to its own user; it only needs to read its config here.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let conf = dir.join("mosquitto.conf");
            // No broker persistence: sessions live in memory for the run. The windows are raised so the
            // broker never holds back what a batch of 256 needs, and the queue holds a whole slice.
            std::fs::write(
                &conf,
                format!(
                    "listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n\
                     max_inflight_messages {INFLIGHT}\nmax_queued_messages 1000000\n\
                     log_dest stderr\nlog_type error\nlog_type warning\n"
                ),
            )?;
            let child = Command::new(exe)
                .arg("-c")
                .arg(&conf)
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .with_context(|| format!("cannot start {}", exe.display()))?;
            let broker = Mosquitto { child, port };
            let deadline = Instant::now() + Duration::from_secs(10);
            while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
                if Instant::now() > deadline {
                    bail!("mosquitto did not start listening on {port}");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(broker)
        }
    }

    impl Drop for Mosquitto {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// Publishes `ids` with QoS1 as fast as the broker takes them, each with its `message-id` user
    /// property. Returns the instant of the first publish, taken once the publisher is connected.
    fn publish(
        port: u16,
        client_id: &str,
        topic: &str,
        ids: Vec<String>,
    ) -> anyhow::Result<Instant> {
        let mut o = MqttOptions::new(client_id, "127.0.0.1", port);
        o.set_outgoing_inflight_upper_limit(INFLIGHT);
        let (client, mut conn) = Client::new(o, 1024);
        let deadline = Instant::now() + SLICE_DEADLINE;
        let n = ids.len();
        let (ready_tx, ready_rx) = mpsc::channel();
        let poller = std::thread::spawn(move || -> anyhow::Result<()> {
            let mut acked = 0;
            while acked < n {
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "publisher: only {acked} of {n} acked in time"
                );
                match conn.recv_timeout(Duration::from_millis(200)) {
                    Ok(Ok(Event::Incoming(Packet::ConnAck(_)))) => {
                        let _ = ready_tx.send(());
                    }
                    Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => acked += 1,
                    Ok(Err(e)) => bail!("publisher: {e}"),
                    _ => {}
                }
            }
            Ok(())
        });
        ready_rx
            .recv_timeout(Duration::from_secs(10))
            .context("publisher did not connect")?;
        let start = Instant::now();
        let topic = topic.to_string();
        for id in ids {
            let mut props = PublishProperties::default();
            props.user_properties.push(("message-id".into(), id));
            client.publish_with_properties(
                topic.clone(),
                QoS::AtLeastOnce,
                false,
                PAYLOAD,
                props,
            )?;
        }
        poller.join().expect("publisher poll thread")?;
        let _ = client.try_disconnect();
        Ok(start)
    }

    /// The upper bound: a persistent-session consumer with manual acks that acks each publish as soon as
    /// it arrives, on the thread that polls the connection. Returns when `n` are acked and the disconnect
    /// (queued after the acks) has gone out, with that instant. `ready` is signalled once subscribed.
    fn bare_consume(
        port: u16,
        client_id: &str,
        topic: &str,
        n: usize,
        ready: mpsc::Sender<()>,
    ) -> anyhow::Result<Instant> {
        let mut o = MqttOptions::new(client_id, "127.0.0.1", port);
        o.set_clean_start(false)
            .set_manual_acks(true)
            .set_session_expiry_interval(Some(3600))
            .set_receive_maximum(Some(INFLIGHT));
        let (client, mut conn) = Client::new(o, usize::from(INFLIGHT) + 16);
        let deadline = Instant::now() + SLICE_DEADLINE;
        let mut acked = 0;
        let mut waiting = std::collections::VecDeque::new();
        loop {
            anyhow::ensure!(
                Instant::now() < deadline,
                "bare consumer: {acked} of {n} in time"
            );
            match conn.recv_timeout(Duration::from_millis(200)) {
                Ok(Ok(Event::Incoming(Packet::ConnAck(ack)))) => {
                    if ack.session_present {
                        let _ = ready.send(());
                    } else {
                        client.try_subscribe(topic, QoS::AtLeastOnce)?;
                    }
                }
                Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => {
                    let _ = ready.send(());
                }
                Ok(Ok(Event::Incoming(Packet::Publish(p)))) => waiting.push_back(p),
                Ok(Ok(Event::Outgoing(Outgoing::Disconnect))) => return Ok(Instant::now()),
                Ok(Err(e)) => bail!("bare consumer: {e}"),
                _ => {}
            }
            // Acks wait here only while rumqttc's request channel is full (it is drained as it polls).
            while let Some(p) = waiting.front() {
                if client.try_ack(p).is_err() {
                    break;
                }
                waiting.pop_front();
                acked += 1;
                if acked == n {
                    client.try_disconnect()?;
                }
            }
        }
    }

    /// CPU time (user + system) of a process so far, in clock ticks (1/100 s on Linux).
    fn cpu_ticks(pid: &str) -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
        // utime and stime are fields 14 and 15; `rest` starts at field 3.
        let get = |i: usize| {
            fields
                .get(i)
                .and_then(|f| f.parse::<u64>().ok())
                .unwrap_or(0)
        };
        get(11) + get(12)
    }

    /// One row's state across slices: its inbox file (kept, so its WAL is warm) and its names.
    struct E2eContender {
        row: E2eRow,
        inbox: Option<Inbox>,
        topic: String,
        client_id: String,
        next: usize,
        elapsed: Duration,
        timed: usize,
        acked: u64,
        /// CPU ticks of timed slices: this process (publisher, consumer, SQLite) and the broker.
        cpu_self: u64,
        cpu_broker: u64,
    }

    impl E2eContender {
        fn new(dir: &Path, row: E2eRow, round: usize) -> anyhow::Result<E2eContender> {
            let inbox = match row {
                E2eRow::Bare => None,
                E2eRow::Inbox(_) | E2eRow::Core(_) => Some(Inbox::open(
                    dir.join(format!("e2e-{}-{round}.db", row.tag())),
                    Config::default(),
                )?),
            };
            Ok(E2eContender {
                row,
                inbox,
                topic: format!("bench/e2e/{}/{round}", row.tag()),
                client_id: format!("bench-e2e-{}-{round}", row.tag()),
                next: 0,
                elapsed: Duration::ZERO,
                timed: 0,
                acked: 0,
                cpu_self: 0,
                cpu_broker: 0,
            })
        }

        /// Publishes `len` new deliveries and consumes them; times first publish to last PUBACK.
        fn slice(&mut self, broker: &Mosquitto, len: usize, timed: bool) -> anyhow::Result<()> {
            let port = broker.port;
            let broker_pid = broker.child.id().to_string();
            let cpu = (cpu_ticks("self"), cpu_ticks(&broker_pid));
            let prefix = format!("{}-{}", self.client_id, self.next);
            let ids = super::ids(&prefix, len);
            self.next += len;
            if let E2eRow::Core(batch) = self.row {
                let inbox = self.inbox.as_mut().expect("core row");
                let ds = super::deliveries(&ids, PAYLOAD);
                let mut outcomes = Vec::with_capacity(batch);
                let mut handler = super::kv_handler();
                let (done, t) = super::timed(|| {
                    super::process_batches(inbox, &ds, batch, &mut handler, &mut outcomes)
                });
                anyhow::ensure!(done? == len, "core row: unexpected outcomes");
                if timed {
                    self.elapsed += t;
                    self.timed += len;
                    self.cpu_self += cpu_ticks("self") - cpu.0;
                    self.cpu_broker += cpu_ticks(&broker_pid) - cpu.1;
                }
                self.acked += len as u64;
                return Ok(());
            }
            let (ready_tx, ready_rx) = mpsc::channel();
            let acked = std::thread::scope(|s| -> anyhow::Result<u64> {
                let consumer = match self.row {
                    E2eRow::Bare => {
                        let (id, topic) = (self.client_id.clone(), self.topic.clone());
                        s.spawn(move || {
                            bare_consume(port, &id, &topic, len, ready_tx).map(|t| (t, len as u64))
                        })
                    }
                    E2eRow::Core(_) => unreachable!("handled above"),
                    E2eRow::Inbox(batch) => {
                        let inbox = self.inbox.take().expect("inbox row");
                        let mqtt = MqttConfig::new("127.0.0.1", port, &self.client_id)
                            .subscribe(&self.topic)
                            .inflight(INFLIGHT);
                        let inbox_slot = &mut self.inbox;
                        s.spawn(move || {
                            // Idle exit only bounds a run that lost deliveries; a complete one stops
                            // itself at the last delivery.
                            let mut consumer = Consumer::new(inbox, super::SCOPE, mqtt)
                                .batch(batch, Duration::from_millis(5))
                                .exit_when_idle(Duration::from_secs(30));
                            let stop = consumer.stop_handle();
                            let mut seen = 0usize;
                            let mut n: u64 = 0;
                            // The trivial handler of the table, counting: the stop lets the batch that
                            // holds the last delivery commit and ack before `run` returns.
                            let handler =
                                |tx: &mut Tx<'_>, _d: &Delivery<'_>| -> anyhow::Result<()> {
                                    n += 1;
                                    tx.put("counter", &n)?;
                                    seen += 1;
                                    if seen == len {
                                        stop.stop();
                                    }
                                    Ok(())
                                };
                            // The broker keeps the session: the first run subscribes, later ones find
                            // their deliveries queued. Ready once the poll thread has had time to connect.
                            let waker = std::thread::spawn(move || {
                                std::thread::sleep(Duration::from_millis(300));
                                let _ = ready_tx.send(());
                            });
                            let summary = consumer.run(handler);
                            let end = Instant::now();
                            let _ = waker.join();
                            *inbox_slot = Some(consumer.into_inbox());
                            let summary = summary?;
                            anyhow::ensure!(
                                summary.processed == len as u64
                                    && summary.acked == len as u64
                                    && summary.duplicates == 0,
                                "consumer: {summary:?}, expected {len} processed and acked"
                            );
                            Ok((end, summary.acked))
                        })
                    }
                };
                ready_rx
                    .recv_timeout(Duration::from_secs(10))
                    .context("consumer did not subscribe")?;
                let publisher = format!("{}-pub", self.client_id);
                let start = publish(port, &publisher, &self.topic, ids)?;
                let (end, acked) = consumer.join().expect("consumer thread")?;
                if timed {
                    self.elapsed += end - start;
                    self.timed += len;
                    self.cpu_self += cpu_ticks("self") - cpu.0;
                    self.cpu_broker += cpu_ticks(&broker_pid) - cpu.1;
                }
                Ok(acked)
            })?;
            self.acked += acked;
            Ok(())
        }

        fn rate(&self) -> f64 {
            self.timed as f64 / self.elapsed.as_secs_f64()
        }

        /// CPU µs per message of this process and of the broker, and the cores busy on average (both
        /// processes over the timed wall time).
        fn cpu(&self) -> [f64; 3] {
            let us = |ticks: u64| ticks as f64 * 10_000.0 / self.timed as f64;
            let cores =
                (self.cpu_self + self.cpu_broker) as f64 / 100.0 / self.elapsed.as_secs_f64();
            [us(self.cpu_self), us(self.cpu_broker), cores]
        }
    }

    /// Runs `rounds` rounds of `n` messages per row, rows taking turns slice by slice (order rotated per
    /// slice), and prints the table. Skips with a message when mosquitto is not installed.
    pub fn run(dir: &Path, n: usize, rounds: usize, batches: &[usize]) -> anyhow::Result<()> {
        let Some(exe) = mosquitto_exe() else {
            println!(
                "\n--mode e2e skipped: mosquitto not found on PATH nor at /usr/sbin/mosquitto"
            );
            return Ok(());
        };
        let broker_dir = tempfile::Builder::new()
            .prefix("mosquitto-")
            .tempdir_in(dir)?;
        let broker = Mosquitto::start(&exe, broker_dir.path())?;
        eprintln!("mosquitto ({}) on 127.0.0.1:{}", exe.display(), broker.port);
        let mut rows = vec![E2eRow::Bare];
        for &b in batches {
            rows.extend([E2eRow::Inbox(b), E2eRow::Core(b)]);
        }
        let slice = (n / SLICES_E2E).max(1);
        let mut rates: Vec<Vec<f64>> = Vec::new();
        let mut cpus: Vec<Vec<[f64; 3]>> = Vec::new();
        for round in 0..rounds {
            let mut cs = rows
                .iter()
                .map(|&r| E2eContender::new(dir, r, round))
                .collect::<anyhow::Result<Vec<_>>>()?;
            // Warm-up (untimed): creates the sessions and subscriptions and wraps each inbox's WAL once.
            for c in &mut cs {
                c.slice(&broker, 1100, false)?;
            }
            for s in 0..SLICES_E2E {
                let k = cs.len();
                for j in 0..k {
                    let c = &mut cs[(s + j) % k];
                    c.slice(&broker, slice, true)?;
                }
            }
            for c in &cs {
                eprintln!(
                    "round {}: {:<60} {:>10.0} msg/s ({} acked)",
                    round + 1,
                    c.row.label(),
                    c.rate(),
                    c.acked
                );
            }
            rates.push(cs.iter().map(E2eContender::rate).collect());
            cpus.push(cs.iter().map(E2eContender::cpu).collect());
            drop(cs);
            for entry in std::fs::read_dir(dir)? {
                let path = entry?.path();
                if path.is_file() {
                    std::fs::remove_file(path)?;
                }
            }
        }
        drop(broker);
        println!(
            "\n| end to end, mosquitto on loopback, QoS1, synchronous=FULL, n={} per row, {SLICES_E2E} slices, median of {rounds} rounds | msgs/s | ratio to bare | `Consumer` / core only, same batch | target | met? |",
            slice * SLICES_E2E
        );
        println!("|---|---:|---:|---:|---|---|");
        for (i, row) in rows.iter().enumerate() {
            let rate = median(rates.iter().map(|r| r[i]).collect());
            let ratio = median(rates.iter().map(|r| r[i] / r[0]).collect());
            // The core row follows its consumer row.
            let vs_core = match row {
                E2eRow::Inbox(_) => format!(
                    "{:.2}x",
                    median(rates.iter().map(|r| r[i] / r[i + 1]).collect())
                ),
                _ => "-".into(),
            };
            let (target, met) = match row {
                E2eRow::Inbox(b) if *b > 1 => {
                    (">= 0.8x", if ratio >= 0.8 { "yes" } else { "**no**" })
                }
                _ => ("-", "-"),
            };
            println!(
                "| {} | {rate:.0} | {ratio:.2}x | {vs_core} | {target} | {met} |",
                row.label()
            );
        }
        println!("\nPer-round rates (msgs/s):\n");
        for (i, row) in rows.iter().enumerate() {
            let per: Vec<String> = rates.iter().map(|r| format!("{:.0}", r[i])).collect();
            println!("- {}: {}", row.label(), per.join(", "));
        }
        println!(
            "\n| CPU per message (timed slices, median of {rounds} rounds) | this process (publisher, consumer, SQLite) µs | mosquitto µs | cores busy (of {}) |",
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        println!("|---|---:|---:|---:|");
        for (i, row) in rows.iter().enumerate() {
            let m = |k: usize| median(cpus.iter().map(|c| c[i][k]).collect());
            println!(
                "| {} | {:.1} | {:.1} | {:.2} |",
                row.label(),
                m(0),
                m(1),
                m(2)
            );
        }
        Ok(())
    }
}
