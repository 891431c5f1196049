//! Received-then-deferred throughput against the strong case, side by side in one run, on one file system.
//!
//! For batch sizes 1, 16 and 256 (messages per transaction):
//! - `strong`: `process_batch` (identity + effect, one commit per batch);
//! - `receive`: `receive_batch_into` (identity + pending row, one commit per batch);
//! - `drain`: a `Worker` with that batch size applying pending messages (claim commit without fsync + apply
//!   commit per batch); the backlog it drains is stored and checkpointed before the clock starts.
//!
//! Every database is a real file in the target directory (on disk, not tmpfs) with the default
//! `synchronous=FULL`. After criterion's report, two tables give messages/s and the ratios to `strong`: the
//! means of criterion's measured iterations, and an interleaved run in which the three modes take turns (the
//! steadier figure on a shared machine).
//! Run: `cargo bench --bench deferred` (add `-- --measurement-time 2` for a short run).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use edge_inbox::{Config, Delivery, Inbox, Tx, Worker, WorkerConfig};

const SCOPE: &str = "bench";
const BATCHES: [usize; 3] = [1, 16, 256];
const PAYLOAD: &[u8] = br#"{"order":42,"sku":"A-1","qty":1,"kind":"created"}"#;

/// (mode, batch) -> (messages, time): every measured iteration, for the ratio table.
type Totals = BTreeMap<(&'static str, usize), (u64, Duration)>;
static TOTALS: Mutex<Totals> = Mutex::new(BTreeMap::new());

fn record(mode: &'static str, batch: usize, messages: u64, time: Duration) {
    let mut t = TOTALS.lock().unwrap();
    let e = t.entry((mode, batch)).or_default();
    e.0 += messages;
    e.1 += time;
}

fn effect(tx: &mut Tx<'_>, _d: &Delivery<'_>) -> anyhow::Result<()> {
    let n: i64 = tx.get("n")?.unwrap_or(0);
    tx.put("n", &(n + 1))?;
    Ok(())
}

/// Message ids, unique across the whole run of one database.
struct Ids {
    next: u64,
}

impl Ids {
    fn take(&mut self, n: usize) -> Vec<String> {
        let ids = (self.next..self.next + n as u64)
            .map(|i| format!("msg-{i}"))
            .collect();
        self.next += n as u64;
        ids
    }
}

fn deliveries(ids: &[String]) -> Vec<Delivery<'_>> {
    ids.iter()
        .map(|id| Delivery::new(SCOPE, id, "orders/42", PAYLOAD))
        .collect()
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("bench dir");
    for &batch in &BATCHES {
        let mut group = c.benchmark_group(format!("deferred/batch-{batch}"));
        group.throughput(Throughput::Elements(batch as u64));

        let mut strong = Inbox::open(
            dir.path().join(format!("strong-{batch}.db")),
            Config::default(),
        )
        .unwrap();
        let mut ids = Ids { next: 0 };
        let mut outcomes = Vec::new();
        group.bench_function(BenchmarkId::new("strong", batch), |b| {
            b.iter_custom(|iters| {
                let all = ids.take(iters as usize * batch);
                let start = Instant::now();
                for chunk in all.chunks(batch) {
                    strong
                        .process_batch_into(&deliveries(chunk), &mut effect, &mut outcomes)
                        .unwrap();
                }
                let t = start.elapsed();
                record("strong", batch, all.len() as u64, t);
                t
            })
        });

        let mut receiver = Inbox::open(
            dir.path().join(format!("receive-{batch}.db")),
            Config::default(),
        )
        .unwrap();
        let mut ids = Ids { next: 0 };
        group.bench_function(BenchmarkId::new("receive", batch), |b| {
            b.iter_custom(|iters| {
                let all = ids.take(iters as usize * batch);
                let start = Instant::now();
                for chunk in all.chunks(batch) {
                    receiver
                        .receive_batch_into(&deliveries(chunk), &mut outcomes)
                        .unwrap();
                }
                let t = start.elapsed();
                record("receive", batch, all.len() as u64, t);
                t
            })
        });

        let path = dir.path().join(format!("drain-{batch}.db"));
        let mut filler = Inbox::open(&path, Config::default()).unwrap();
        let mut worker = Worker::open(
            &path,
            Config::default(),
            SCOPE,
            WorkerConfig::default().batch(batch),
        )
        .unwrap();
        let mut ids = Ids { next: 0 };
        group.bench_function(BenchmarkId::new("drain", batch), |b| {
            b.iter_custom(|iters| {
                // Untimed: the backlog this iteration drains.
                let all = ids.take(iters as usize * batch);
                for chunk in all.chunks(256) {
                    filler
                        .receive_batch_into(&deliveries(chunk), &mut outcomes)
                        .unwrap();
                }
                // The backlog's own checkpoint is receive-side work: keep it out of the drain's time.
                filler
                    .connection()
                    .execute_batch("PRAGMA wal_checkpoint(TRUNCATE)")
                    .unwrap();
                let start = Instant::now();
                let mut done = 0;
                while done < all.len() {
                    let d = worker.run_once(&mut effect).unwrap();
                    assert!(d.claimed > 0, "backlog ran dry early");
                    done += d.processed;
                }
                let t = start.elapsed();
                record("drain", batch, all.len() as u64, t);
                t
            })
        });
        group.finish();
    }
}

fn print_ratios() {
    let t = TOTALS.lock().unwrap();
    let rate = |mode, batch| {
        t.get(&(mode, batch))
            .map(|(n, d): &(u64, Duration)| *n as f64 / d.as_secs_f64().max(1e-9))
            .unwrap_or(0.0)
    };
    println!();
    println!("messages/s (mean over all measured iterations), ratio to strong-case process_batch of the same size");
    println!(
        "{:>6} {:>12} {:>12} {:>12} {:>14} {:>12}",
        "batch", "strong", "receive", "drain", "receive/strong", "drain/strong"
    );
    for &batch in &BATCHES {
        let (s, r, d) = (
            rate("strong", batch),
            rate("receive", batch),
            rate("drain", batch),
        );
        if s == 0.0 {
            continue;
        }
        println!(
            "{batch:>6} {s:>12.0} {r:>12.0} {d:>12.0} {:>14.2} {:>12.2}",
            r / s,
            d / s
        );
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).warm_up_time(Duration::from_millis(500));
    targets = bench
}

/// Ratios that survive a noisy machine: the three modes take turns in rounds of the same size, so a load spike
/// from elsewhere hits all of them alike. Own files, same directory, same settings as above.
fn interleaved_ratios() {
    const ROUNDS: usize = 6;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("bench dir");
    println!();
    println!("interleaved: {ROUNDS} rounds of 256 messages per mode and batch size, messages/s");
    println!(
        "{:>6} {:>12} {:>12} {:>12} {:>14} {:>12}",
        "batch", "strong", "receive", "drain", "receive/strong", "drain/strong"
    );
    for &batch in &BATCHES {
        let mut strong = Inbox::open(
            dir.path().join(format!("i-strong-{batch}.db")),
            Config::default(),
        )
        .unwrap();
        let mut receiver = Inbox::open(
            dir.path().join(format!("i-receive-{batch}.db")),
            Config::default(),
        )
        .unwrap();
        let drain_path = dir.path().join(format!("i-drain-{batch}.db"));
        let mut filler = Inbox::open(&drain_path, Config::default()).unwrap();
        let mut worker = Worker::open(
            &drain_path,
            Config::default(),
            SCOPE,
            WorkerConfig::default().batch(batch),
        )
        .unwrap();
        let (mut ids, mut outcomes) = (Ids { next: 0 }, Vec::new());
        let mut times = [Duration::ZERO; 3];
        for _ in 0..ROUNDS {
            let all = ids.take(256);
            let start = Instant::now();
            for chunk in all.chunks(batch) {
                strong
                    .process_batch_into(&deliveries(chunk), &mut effect, &mut outcomes)
                    .unwrap();
            }
            times[0] += start.elapsed();

            let start = Instant::now();
            for chunk in all.chunks(batch) {
                receiver
                    .receive_batch_into(&deliveries(chunk), &mut outcomes)
                    .unwrap();
            }
            times[1] += start.elapsed();

            filler
                .receive_batch_into(&deliveries(&all), &mut outcomes)
                .unwrap();
            filler
                .connection()
                .execute_batch("PRAGMA wal_checkpoint(PASSIVE)")
                .unwrap();
            let start = Instant::now();
            let mut done = 0;
            while done < all.len() {
                done += worker.run_once(&mut effect).unwrap().processed;
            }
            times[2] += start.elapsed();
        }
        let rate = |t: Duration| (ROUNDS * 256) as f64 / t.as_secs_f64().max(1e-9);
        let (s, r, d) = (rate(times[0]), rate(times[1]), rate(times[2]));
        println!(
            "{batch:>6} {s:>12.0} {r:>12.0} {d:>12.0} {:>14.2} {:>12.2}",
            r / s,
            d / s
        );
    }
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    // `cargo test --benches` runs each benchmark once: no figures worth printing.
    if std::env::args().any(|a| a == "--bench") {
        print_ratios();
        interleaved_ratios();
    }
}
