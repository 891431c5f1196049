//! `--mode disk`: the device alone, with nothing of the inbox running. One 4 KiB block rewritten in place and
//! synced (`fdatasync`), over and over for `--seconds`: the distribution of the syncs, and every sync slower
//! than 10 ms (plus `--sync-delay-ms`) with its time into the run. The latency mode's probe (1000 syncs, a
//! fraction of a second) rarely meets a stall that comes once in minutes; this loop shows how often the device
//! itself stalls, which no consumer can hide.

use std::path::Path;
use std::time::{Duration, Instant};

use super::common::FsyncFile;
use super::field_vfs;

pub fn run(dir: &Path, seconds: u64) -> anyhow::Result<()> {
    let path = dir.join("disk-probe");
    let mut f = FsyncFile::create(&path)?;
    // Once outside the samples: the file's first write appends.
    f.write_sync()?;
    let slow = Duration::from_millis(10) + field_vfs::delay();
    let start = Instant::now();
    let end = start + Duration::from_secs(seconds);
    let mut syncs = Vec::new();
    let mut stalls = Vec::new();
    while Instant::now() < end {
        let t = Instant::now();
        f.write_sync()?;
        field_vfs::after_sync();
        let took = t.elapsed();
        if took > slow {
            stalls.push((t - start, took));
        }
        syncs.push(took);
    }
    drop(f);
    std::fs::remove_file(&path)?;
    let ran = start.elapsed();
    syncs.sort_unstable();
    let at = |p: f64| syncs[((syncs.len() - 1) as f64 * p).round() as usize];
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "\n## The device alone: 4 KiB rewritten in place + fdatasync, in a loop for {:.1} s (sync +{} ms)\n",
        ran.as_secs_f64(),
        field_vfs::delay().as_millis()
    );
    println!(
        "{} syncs: p50 {:.3} ms, p99 {:.3} ms, p99.9 {:.3} ms, max {:.2} ms; {} over {:.0} ms ({:.1} a minute){}",
        syncs.len(),
        ms(at(0.5)),
        ms(at(0.99)),
        ms(at(0.999)),
        ms(at(1.0)),
        stalls.len(),
        ms(slow),
        stalls.len() as f64 * 60.0 / ran.as_secs_f64().max(1e-3),
        if stalls.is_empty() { "" } else { ":" }
    );
    let list: Vec<String> = stalls
        .iter()
        .map(|(at, took)| format!("{:.1} s: {:.1} ms", at.as_secs_f64(), ms(*took)))
        .collect();
    if !list.is_empty() {
        println!("{}", list.join(", "));
    }
    Ok(())
}
