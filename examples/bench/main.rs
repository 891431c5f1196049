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
//! bare consumer that acks on receipt; `--n` messages per row; `--e2e-batches 256` for one size),
//! `latency` (publish-to-PUBACK latency of the default `Consumer` and the bare consumer at 10%, 50% and 90%
//! of the saturation rate, beside the disk's fsync time; `--n` messages per run; `--trace-tail DIR` writes the
//! timelines around each run's slowest delivery and its slowest consumer's part; `--burst-ms MS` publishes
//! each load in bursts, one every MS milliseconds; on Linux it also prints the CPU time the hypervisor took
//! from a virtual machine during each run, its `steal`; `--split-cores` gives the consumer under test the
//! upper half of the CPUs and the broker, the publisher and the relay the lower half, in e2e too), `disk`
//! (the device alone: 4 KiB syncs in a loop for `--seconds`, and how often one stalls). `--instructions
//! KIND` does `--n` deliveries of one kind with `synchronous=NORMAL` for `valgrind --tool=callgrind`; KIND is
//! `raw`, `classic`, `process`, `process-noop`, `raw256` or `batch256`.
//!
//! Every row runs on a fresh database file in `--db-dir` with `synchronous=FULL`; all rows run once per
//! round, rounds are interleaved, and the table shows the median rate and the median of the per-round ratios,
//! so a noisy neighbour shifts compared figures together. `--prefill N` gives every table row's file (and each
//! latency run's inbox file) N earlier deliveries first: what a delivery writes grows with the identities
//! the file keeps.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use anyhow::bail;
use edge_inbox::{Delivery, Inbox, Outcome, Tx};

#[path = "../../benches/common/mod.rs"]
mod common;
use common::*;
#[path = "../support/field_vfs.rs"]
mod field_vfs;

mod allocations;
#[cfg(feature = "mqtt")]
mod cores;
mod disk;
#[cfg(feature = "mqtt")]
mod e2e;
mod instructions;
#[cfg(feature = "mqtt")]
mod latency;
mod race;
#[cfg(feature = "mqtt")]
mod steal;
mod table;
#[cfg(feature = "mqtt")]
mod tail_trace;
#[cfg(feature = "mqtt")]
mod threads;

use allocations::{allocations, trace_allocations};
use instructions::{instructions, wal_frames};
use race::race;
use table::table;

// ---------------------------------------------------------------------------------------------------------
// Counting allocator

/// Counts every allocation and reallocation of Rust code. SQLite's own C allocations go to libc directly
/// and are not seen here (run under `valgrind --tool=dhat` for those).
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static TRACE: AtomicBool = AtomicBool::new(false);
/// `--fresh-wal`.
static FRESH_WAL: AtomicBool = AtomicBool::new(false);

/// Whether rows and runs are timed on a fresh WAL's first pass (`--fresh-wal`).
pub(crate) fn fresh_wal() -> bool {
    FRESH_WAL.load(Ordering::Relaxed)
}
/// The `Consumer`'s `overlap_syncs` in the e2e and latency modes.
#[cfg(feature = "mqtt")]
static OVERLAP_SYNCS: Mutex<edge_inbox::SyncOverlap> = Mutex::new(edge_inbox::SyncOverlap::Auto);

#[cfg(feature = "mqtt")]
fn set_overlap_syncs(mode: &str) {
    *OVERLAP_SYNCS.lock().unwrap() = match mode {
        "on" => edge_inbox::SyncOverlap::On,
        "off" => edge_inbox::SyncOverlap::Off,
        _ => edge_inbox::SyncOverlap::Auto,
    };
}

/// `--overlap-syncs`.
#[cfg(feature = "mqtt")]
pub(crate) fn overlap_syncs() -> edge_inbox::SyncOverlap {
    *OVERLAP_SYNCS.lock().unwrap()
}
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

/// Benchmarks of the inbox on the storage it will run on.
#[derive(clap::Parser)]
#[command(name = "bench")]
struct Args {
    /// A directory on the storage to measure (each row gets a fresh file in a temporary directory there).
    #[arg(long, value_name = "PATH")]
    db_dir: PathBuf,
    /// Messages per row.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..))]
    n: u64,
    /// Rounds, interleaved.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,
    /// What to run.
    #[arg(long, value_enum, default_value_t = Mode::All)]
    mode: Mode,
    /// Table and latency: commit this many earlier deliveries (other ids, transactions of 4096) to every
    /// inbox's file first (in the table every row's), as on a gateway that has kept months of identities.
    #[arg(long, value_name = "N", default_value_t = 0)]
    prefill: u64,
    /// Do `--n` deliveries of one kind with `synchronous=NORMAL`, for callgrind (overrides `--mode`).
    #[arg(long, value_name = "KIND", value_parser = ["raw", "classic", "process", "process-noop", "raw256", "batch256"])]
    instructions: Option<String>,
    /// Field storage: add this many milliseconds to every sync (SD card, eMMC), through a VFS that wraps the
    /// platform's; also added to the fsync probes.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    sync_delay_ms: u64,
    /// Page size of the inboxes' new files (`Config::page_size`); default SQLite's.
    #[arg(long, value_name = "BYTES")]
    page_size: Option<u32>,
    /// Layout of the identity keys of the inboxes' new files (`Config::id_order`): `hashed` (the default),
    /// `counter` or `leading:N`. The bench's ids end with a counter (`{prefix}-NNNNNNNN`, `{client}-N`).
    #[arg(long, value_name = "ORDER", value_parser = parse_id_order)]
    id_order: Option<edge_inbox::IdOrder>,
    /// Table and latency: spread the timed message ids over this many interleaved streams, as from as many
    /// producers (`{prefix}-sK-N`, K = i mod streams, N = i / streams), instead of one counter.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    id_streams: u64,
    /// Table and latency: the shape of every message id: `counter` (the default, ids that end with a counter)
    /// or `uuidv7` (text UUIDv7 drawn from them, whose milliseconds advance at `--id-rate` ids a second of
    /// each file's own history: the prefill's first, then the warm-up's, then the timed ones).
    #[arg(long, value_name = "SHAPE", default_value = "counter", value_parser = ["counter", "uuidv7"])]
    id_shape: String,
    /// `--id-shape uuidv7`: ids per second of the ids' clock (a gateway's message rate, not the bench's).
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    id_rate: u64,
    /// The inboxes' `Config::wal_autocheckpoint`.
    #[arg(long, value_name = "PAGES")]
    wal_autocheckpoint: Option<u32>,
    /// The inboxes' `Config::cache_size`, in KiB (the raw and classic rows keep SQLite's 2000 KiB).
    #[arg(long, value_name = "KIB")]
    cache_kib: Option<usize>,
    /// The inboxes' `Config::journal_size_limit`.
    #[arg(long, value_name = "BYTES")]
    journal_size_limit: Option<i64>,
    /// The inboxes' `Config::checkpoint_thread` (default on): `false` runs the automatic checkpoint inside
    /// the commit that crosses the threshold.
    #[arg(long, value_name = "BOOL")]
    checkpoint_thread: Option<bool>,
    /// e2e and latency: run mosquitto with its default Nagle's algorithm instead of `set_tcp_nodelay true`.
    #[arg(long)]
    broker_nagle: bool,
    /// e2e: the batch sizes of the `Consumer` and core-only rows (each row beside the bare consumer).
    #[arg(
        long,
        value_name = "N,N",
        value_delimiter = ',',
        default_value = "1,256",
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    e2e_batches: Vec<u16>,
    /// table and latency: warm up without waiting for each WAL to wrap, as before (the table's 1100
    /// messages, which wrap a WAL at SQLite's 1000 pages but not at the inbox's 10,000; no warm-up for a
    /// latency run), so that the inbox's rows and runs are timed on their WAL's first pass, whose appends
    /// make every sync also commit the file's new size. The default times them on a WAL that has wrapped
    /// once: a gateway's steady state.
    #[arg(long)]
    fresh_wal: bool,
    /// `--mode latency`: writes, for each run of the `Consumer`, the timeline around its slowest delivery
    /// (deliveries, and the writes and syncs of the WAL and the database file by thread) to a file in DIR,
    /// and the same around the delivery with the slowest consumer's part (from the relay's read of the
    /// PUBLISH to its read of the PUBACK) to a second file, `<run>-own.txt`.
    #[arg(long, value_name = "DIR")]
    trace_tail: Option<PathBuf>,
    /// `--mode disk`: how long to sync in a loop.
    #[arg(long, value_name = "S", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    seconds: u64,
    /// e2e and latency: the `Consumer`'s `overlap_syncs`: `auto` (the default), `on` or `off`.
    #[arg(long, value_name = "MODE", default_value = "auto", value_parser = ["auto", "on", "off"])]
    overlap_syncs: String,
    /// `--mode latency`: publish each load in bursts, one every MS milliseconds (the deliveries of that span
    /// back to back, then nothing), as a gateway's sensors report in rounds; the average rate is the same.
    /// 0 (the default): evenly paced.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    burst_ms: u64,
    /// e2e and latency (Linux): the consumer under test (the `Consumer` with the library's threads, or the
    /// bare consumer) on the upper half of the CPUs, mosquitto, the publisher and the relay on the lower
    /// half, as on a gateway whose broker and publishers are other machines.
    #[arg(long)]
    split_cores: bool,
}

/// `--id-streams`.
static ID_STREAMS: AtomicU64 = AtomicU64::new(1);

/// The `i`th timed message id after `prefix`: one counter, or `--id-streams` counters interleaved.
pub(crate) fn stream_id(prefix: &str, i: u64) -> String {
    match ID_STREAMS.load(Ordering::Relaxed) {
        1 => format!("{prefix}-{i:08}"),
        s => format!("{prefix}-s{:04}-{:08}", i % s, i / s),
    }
}

/// `--id-shape uuidv7`'s `--id-rate`; 0 for ids that end with a counter.
static UUID7_RATE: AtomicU64 = AtomicU64::new(0);

/// The first slot after a file's history (its prefill), in [`shaped_id`]'s clock.
pub(crate) const HISTORY: u64 = 1 << 32;

/// 2026-01-01T00:00:00Z: the first slot's time under `--id-shape uuidv7`.
const UUID7_EPOCH_MS: u64 = 1_767_225_600_000;

/// `id` in the shape of `--id-shape`: as it is, or a text UUIDv7 drawn from it whose milliseconds are the
/// `slot`th id's at `--id-rate` ids a second. Slots order a file's ids in time: the bench gives its prefill
/// slots from 0, the rest from [`HISTORY`], in the order they are committed.
pub(crate) fn shaped_id(id: String, slot: u64) -> String {
    match UUID7_RATE.load(Ordering::Relaxed) {
        0 => id,
        rate => uuid_v7_like(&id, UUID7_EPOCH_MS + slot * 1000 / rate),
    }
}

/// A UUIDv7 (RFC 9562) in text: `millis` in its first 48 bits, the rest drawn from `seed`.
fn uuid_v7_like(seed: &str, millis: u64) -> String {
    let r = xxhash_rust::xxh3::xxh3_128(seed.as_bytes());
    let h = (u128::from(millis & 0xffff_ffff_ffff) << 80) | (r & ((1u128 << 80) - 1));
    let h = (h & !(0xf << 76)) | (0x7 << 76); // version 7
    uuid_text((h & !(0x3 << 62)) | (0x2 << 62)) // RFC 9562 variant
}

/// A UUID's 128 bits in its text form (8-4-4-4-12 lower-case hex digits).
pub(crate) fn uuid_text(h: u128) -> String {
    let s = format!("{h:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &s[..8],
        &s[8..12],
        &s[12..16],
        &s[16..20],
        &s[20..]
    )
}

fn parse_id_order(name: &str) -> Result<edge_inbox::IdOrder, String> {
    edge_inbox::IdOrder::parse(name)
        .ok_or_else(|| format!("{name:?}: hashed, counter or leading:N (N from 1 to 16)"))
}

/// The modes of `--mode`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
enum Mode {
    /// Table, allocations and race demo.
    All,
    /// Throughput table.
    Table,
    /// Allocations per delivery.
    Allocs,
    /// Two workers racing on the same deliveries.
    Race,
    /// Where each steady-state allocation of a batch comes from.
    TraceAllocs,
    /// Publish to PUBACK through mosquitto.
    E2e,
    /// Publish-to-PUBACK latency at 10%, 50% and 90% of the saturation rate, beside the disk's fsync time.
    Latency,
    /// The device alone: syncs in a loop for `--seconds`, and how often they stall.
    Disk,
}

fn main() -> anyhow::Result<()> {
    let args = <Args as clap::Parser>::parse();
    let (n, rounds) = (args.n as usize, args.rounds as usize);
    // Before any database opens: every connection of the run goes through it (bytes are counted always).
    field_vfs::install(Duration::from_millis(args.sync_delay_ms));
    let mut config = edge_inbox::Config::default();
    if let Some(p) = args.page_size {
        config = config.page_size(p);
    }
    if let Some(p) = args.wal_autocheckpoint {
        config = config.wal_autocheckpoint(p);
    }
    if let Some(order) = args.id_order {
        println!("Identity keys of the inboxes' files: {}.", order.name());
        config = config.id_order(order);
    }
    if let Some(k) = args.cache_kib {
        config = config.cache_size(k * 1024);
    }
    if let Some(b) = args.journal_size_limit {
        config = config.journal_size_limit(b);
    }
    if let Some(on) = args.checkpoint_thread {
        config = config.checkpoint_thread(on);
    }
    set_inbox_config(config);
    ID_STREAMS.store(args.id_streams, Ordering::Relaxed);
    if args.id_streams > 1 {
        println!(
            "Timed message ids: {} interleaved streams.",
            args.id_streams
        );
    }
    if args.id_shape == "uuidv7" {
        println!(
            "Message ids: text UUIDv7, {} ids a second of each file's history.",
            args.id_rate
        );
        UUID7_RATE.store(args.id_rate, Ordering::Relaxed);
    }
    FRESH_WAL.store(args.fresh_wal, Ordering::Relaxed);
    #[cfg(feature = "mqtt")]
    if let Some(dir) = &args.trace_tail {
        tail_trace::set_dir(dir.clone())?;
    }
    #[cfg(feature = "mqtt")]
    e2e::set_broker_nagle(args.broker_nagle);
    #[cfg(feature = "mqtt")]
    set_overlap_syncs(&args.overlap_syncs);
    #[cfg(feature = "mqtt")]
    if args.split_cores {
        anyhow::ensure!(
            matches!(args.mode, Mode::E2e | Mode::Latency),
            "--split-cores is for --mode e2e and latency"
        );
        cores::enable()?;
        cores::pin_current(cores::Side::Consumer)?;
    }
    #[cfg(not(feature = "mqtt"))]
    anyhow::ensure!(!args.split_cores, "--split-cores needs the `mqtt` feature");
    #[cfg(feature = "mqtt")]
    if args.burst_ms > 0 {
        println!(
            "Loads published in bursts, one every {} ms (the same average rate).",
            args.burst_ms
        );
        latency::set_burst(Duration::from_millis(args.burst_ms));
    }
    if args.sync_delay_ms > 0 {
        println!(
            "Field storage: every sync takes {} ms more (simulated).",
            args.sync_delay_ms
        );
    }
    std::fs::create_dir_all(&args.db_dir)?;
    let dir = tempfile::Builder::new()
        .prefix("edge-inbox-bench-")
        .tempdir_in(&args.db_dir)?;
    if let Some(kind) = &args.instructions {
        return instructions(dir.path(), kind, n);
    }
    let mode = args.mode;
    if matches!(mode, Mode::All | Mode::Table) {
        table(dir.path(), n, rounds, args.prefill as usize)?;
        wal_frames(dir.path(), n)?;
    }
    if matches!(mode, Mode::All | Mode::Allocs) {
        allocations(dir.path())?;
    }
    if mode == Mode::TraceAllocs {
        trace_allocations(dir.path())?;
    }
    if matches!(mode, Mode::All | Mode::Race) {
        race(dir.path(), 200)?;
    }
    if mode == Mode::E2e {
        #[cfg(feature = "mqtt")]
        e2e::run(
            dir.path(),
            n,
            rounds,
            &args
                .e2e_batches
                .iter()
                .map(|&b| usize::from(b))
                .collect::<Vec<_>>(),
        )?;
        #[cfg(not(feature = "mqtt"))]
        println!("--mode e2e needs the `mqtt` feature");
    }
    if mode == Mode::Disk {
        disk::run(dir.path(), args.seconds)?;
    }
    if mode == Mode::Latency {
        #[cfg(feature = "mqtt")]
        latency::run(dir.path(), n, rounds, args.prefill as usize)?;
        #[cfg(not(feature = "mqtt"))]
        println!("--mode latency needs the `mqtt` feature");
    }
    Ok(())
}
