//! Criterion benches of the core against the device's limits and against hand-written consumers.
//!
//! Each group holds one comparison, measured side by side on files in the same temporary directory
//! (`synchronous=FULL`; set `TMPDIR` to put it on the storage you care about), with throughput in messages.
//! The gateway binary `examples/bench.rs` runs the same workloads and prints ratios and targets.

use std::path::Path;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

mod common;
use common::*;

fn config(c: &mut Criterion) -> &mut Criterion {
    c
}

fn criterion() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
}

/// A fresh file in `dir` per benchmark, so tables grow the same way for every contender.
fn file(dir: &Path, name: &str) -> std::path::PathBuf {
    dir.join(format!("{name}.db"))
}

/// One delivery per transaction: the device's fsync rate, raw SQLite, the inbox, and the peers.
fn one_per_tx(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut g = config(c).benchmark_group("one_per_transaction");
    g.throughput(Throughput::Elements(1));

    let mut f = FsyncFile::create(&dir.path().join("fsync")).unwrap();
    g.bench_function("fsync_limit", |b| b.iter(|| f.write_sync().unwrap()));

    let mut raw = Raw::open(&file(dir.path(), "raw1"), Sync::Full).unwrap();
    let mut round = 0;
    g.bench_function("raw_insert", |b| {
        b.iter_custom(|iters| {
            round += 1;
            let ids = ids(&format!("raw{round}"), iters as usize);
            let now = now();
            let start = Instant::now();
            for id in ids.chunks(1) {
                raw.insert_tx(id, now).unwrap();
            }
            start.elapsed()
        })
    });

    let mut inbox = open_inbox(&file(dir.path(), "process"), Sync::Full).unwrap();
    let mut h = kv_handler();
    g.bench_function("process", |b| {
        b.iter_custom(|iters| {
            round += 1;
            let ids = ids(&format!("p{round}"), iters as usize);
            let ds = deliveries(&ids, PAYLOAD);
            let start = Instant::now();
            process_each(&mut inbox, &ds, &mut h, "processed").unwrap();
            start.elapsed()
        })
    });

    let mut peer = Peer::open(&file(dir.path(), "peers"), Sync::Full).unwrap();
    g.bench_function("naive_query_then_insert", |b| {
        b.iter_custom(|iters| {
            round += 1;
            let ids = ids(&format!("n{round}"), iters as usize);
            let start = Instant::now();
            for id in &ids {
                assert!(peer.query_then_insert(id).unwrap());
            }
            start.elapsed()
        })
    });
    g.bench_function("classic_unique_constraint", |b| {
        b.iter_custom(|iters| {
            round += 1;
            let ids = ids(&format!("c{round}"), iters as usize);
            let start = Instant::now();
            for id in &ids {
                assert!(peer.classic(id).unwrap());
            }
            start.elapsed()
        })
    });
    g.finish();
}

/// Group commit: raw batched inserts against `process_batch_into` (and the classic consumer, per message).
fn batched(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut round = 0;
    for batch in [16usize, 256] {
        let mut g = config(c).benchmark_group(format!("batch_{batch}"));
        g.throughput(Throughput::Elements(batch as u64));

        let mut raw = Raw::open(&file(dir.path(), &format!("raw{batch}")), Sync::Full).unwrap();
        g.bench_function(BenchmarkId::new("raw_insert", batch), |b| {
            b.iter_custom(|iters| {
                round += 1;
                let ids = ids(&format!("r{round}"), iters as usize * batch);
                let now = now();
                let start = Instant::now();
                for chunk in ids.chunks(batch) {
                    raw.insert_tx(chunk, now).unwrap();
                }
                start.elapsed()
            })
        });

        let mut inbox =
            open_inbox(&file(dir.path(), &format!("batch{batch}")), Sync::Full).unwrap();
        let mut h = kv_handler();
        let mut outcomes = Vec::with_capacity(batch);
        g.bench_function(BenchmarkId::new("process_batch_into", batch), |b| {
            b.iter_custom(|iters| {
                round += 1;
                let ids = ids(&format!("b{round}"), iters as usize * batch);
                let ds = deliveries(&ids, PAYLOAD);
                let start = Instant::now();
                process_batches(&mut inbox, &ds, batch, &mut h, &mut outcomes).unwrap();
                start.elapsed()
            })
        });

        if batch == 256 {
            // The target compares the batch with the classic consumer, one transaction per message.
            g.throughput(Throughput::Elements(1));
            let mut peer =
                Peer::open(&file(dir.path(), &format!("classic{batch}")), Sync::Full).unwrap();
            g.bench_function("classic_unique_constraint", |b| {
                b.iter_custom(|iters| {
                    round += 1;
                    let ids = ids(&format!("c{round}"), iters as usize);
                    let start = Instant::now();
                    for id in &ids {
                        assert!(peer.classic(id).unwrap());
                    }
                    start.elapsed()
                })
            });
        }
        g.finish();
    }
}

/// Redeliveries: a new delivery, a duplicate and a conflict, each one per transaction through `process`.
fn redelivery(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut g = config(c).benchmark_group("redelivery");
    g.throughput(Throughput::Elements(1));
    let mut inbox = open_inbox(&file(dir.path(), "redelivery"), Sync::Full).unwrap();
    let mut h = kv_handler();
    let mut outcomes = Vec::new();
    // Committed once up front; the duplicate and conflict benches cycle through them.
    let committed = ids("committed", 4096);
    let ds = deliveries(&committed, PAYLOAD);
    process_batches(&mut inbox, &ds, 256, &mut h, &mut outcomes).unwrap();
    let conflicting = deliveries(&committed, OTHER_PAYLOAD);

    let mut round = 0;
    g.bench_function("new", |b| {
        b.iter_custom(|iters| {
            round += 1;
            let ids = ids(&format!("new{round}"), iters as usize);
            let ds = deliveries(&ids, PAYLOAD);
            let start = Instant::now();
            process_each(&mut inbox, &ds, &mut h, "processed").unwrap();
            start.elapsed()
        })
    });
    let mut i = 0;
    g.bench_function("duplicate", |b| {
        b.iter(|| {
            i = (i + 1) % ds.len();
            let o = inbox.process(&ds[i], &mut h).unwrap();
            assert_eq!(o.name(), "duplicate");
        })
    });
    g.bench_function("conflict", |b| {
        b.iter(|| {
            i = (i + 1) % conflicting.len();
            let o = inbox.process(&conflicting[i], &mut h).unwrap();
            assert_eq!(o.name(), "conflict");
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = criterion();
    targets = one_per_tx, batched, redelivery
}
criterion_main!(benches);
