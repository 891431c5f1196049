//! Soak run: many deliveries through a real mosquitto into one inbox, a fifth of them repeats of earlier
//! messages, while a maintenance thread runs retention passes on the same file. Reports the process's
//! resident memory over time (VmRSS from /proc/self/status) and checks that the effect count is exact.
//!
//! ```text
//! cargo run --release --example soak -- --minutes 10                 # a million deliveries, at most 10 min
//! cargo run --release --example soak -- --count 200000 --minutes 3   # a shorter run
//! cargo run --release --example soak -- --rate 6000                  # paced: steady state, no broker backlog
//! ```
//!
//! Not part of `cargo test`: it runs for minutes. Exit status 0 only when every distinct message had exactly
//! one effect and every repeat was recognised as a duplicate.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use edge_inbox::{Config, Consumer, Delivery, Inbox, MqttConfig, Pruning, RetentionPolicy, Tx};
use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{Client, Event, MqttOptions};

#[path = "support/field_vfs.rs"]
mod field_vfs;

const SCOPE: &str = "soak";
/// The broker's and the publisher's window: the publisher floods, the consumer's own window limits it.
const WINDOW: u16 = 200;

/// Soak run: many deliveries through mosquitto into one inbox while retention passes run on the same file.
#[derive(clap::Parser)]
#[command(name = "soak")]
struct Args {
    /// Deliveries to publish (a fifth of them repeats of earlier messages).
    #[arg(long, default_value_t = 1_000_000)]
    count: u64,
    /// Give up after this many minutes.
    #[arg(long, default_value_t = 10)]
    minutes: u64,
    /// Publish at most this many deliveries per second (0: as fast as the broker takes them).
    #[arg(long, default_value_t = 0, value_name = "PER_SECOND")]
    rate: u64,
    /// The consumer's inflight window (MQTT 5 Receive Maximum); default: the `Consumer`'s, from its memory budget (8192).
    #[arg(long, value_name = "N")]
    window: Option<u16>,
    /// The consumer's batch size; default: `Consumer`'s (no count limit: the memory budget, capped at the window).
    #[arg(long, value_name = "N")]
    batch: Option<usize>,
    /// Field storage: add this many milliseconds to every sync (SD card, eMMC), through a VFS that wraps the
    /// platform's.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    sync_delay_ms: u64,
    /// Page cache of the consumer's and the pruner's connections, in KiB; default: `Config`'s.
    #[arg(long, value_name = "KIB")]
    cache_kib: Option<usize>,
    /// Internal: run as the publisher process against this port.
    #[arg(long, hide = true)]
    publish: Option<u16>,
}

fn args() -> anyhow::Result<Args> {
    Ok(<Args as clap::Parser>::parse())
}

fn rss_kib(pid: Option<u32>) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// A `kB` line of /proc/<pid>/status.
fn status_kib(pid: Option<u32>, key: &str) -> u64 {
    let path = match pid {
        Some(p) => format!("/proc/{p}/status"),
        None => "/proc/self/status".to_owned(),
    };
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Where the resident memory is, read together: the kernel's split, SQLite's heap and glibc's.
struct MemoryBreakdown {
    rss: u64,
    anon: u64,
    file: u64,
    sqlite: u64,
    /// glibc's `mallinfo2`: bytes in use in its arenas, free but kept in them, and in mmapped chunks.
    malloc: Option<(u64, u64, u64)>,
}

impl MemoryBreakdown {
    fn now() -> MemoryBreakdown {
        MemoryBreakdown {
            rss: rss_kib(None),
            anon: status_kib(None, "RssAnon:"),
            file: status_kib(None, "RssFile:"),
            // SAFETY: a plain read of SQLite's global memory statistics.
            sqlite: unsafe { edge_inbox::rusqlite::ffi::sqlite3_memory_used() } as u64 / 1024,
            malloc: malloc_kib(),
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn malloc_kib() -> Option<(u64, u64, u64)> {
    // SAFETY: mallinfo2 only reads the allocator's counters.
    let m = unsafe { libc::mallinfo2() };
    Some((
        m.uordblks as u64 / 1024,
        m.fordblks as u64 / 1024,
        m.hblkhd as u64 / 1024,
    ))
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn malloc_kib() -> Option<(u64, u64, u64)> {
    None
}

impl std::fmt::Display for MemoryBreakdown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RSS {} KiB: anon {} KiB, file {} KiB; SQLite heap {} KiB",
            self.rss, self.anon, self.file, self.sqlite
        )?;
        if let Some((used, free, mapped)) = self.malloc {
            write!(
                f,
                "; malloc: in use {used} KiB in arenas and {mapped} KiB mmapped, free in the arenas {free} KiB"
            )?;
        }
        Ok(())
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Broker(Child);

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_broker(dir: &std::path::Path, port: u16) -> anyhow::Result<Broker> {
    let conf = dir.join("mosquitto.conf");
    std::fs::write(
        &conf,
        format!(
            "listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nmax_inflight_messages {WINDOW}\n\
             max_queued_messages 10000000\nlog_dest none\n"
        ),
    )?;
    let exe = ["/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or("mosquitto");
    let child = Command::new(exe)
        .arg("-c")
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting mosquitto")?;
    let broker = Broker(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("mosquitto did not listen on {port}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(broker)
}

/// The message id of publish number `k`: every fifth publish repeats an earlier id (same payload), the others
/// are new. Deterministic, so the expected counts are exact.
fn plan(total: u64) -> impl Iterator<Item = (u64, bool)> {
    let mut next_new = 0u64;
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    (0..total).map(move |k| {
        if k % 5 == 4 && next_new > 0 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % next_new, true)
        } else {
            next_new += 1;
            (next_new - 1, false)
        }
    })
}

fn effect(tx: &mut Tx<'_>, _d: &Delivery<'_>) -> anyhow::Result<()> {
    let n: u64 = tx.get("effects")?.unwrap_or(0);
    tx.put("effects", &(n + 1))?;
    Ok(())
}

/// The publisher process: QoS1 publishes with the application id as an MQTT 5 user property; prints the number
/// of PUBACKs received so far, one number per line.
fn publish(port: u16, total: u64, rate: u64) -> anyhow::Result<()> {
    let mut o = MqttOptions::new("soak-publisher", "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(30));
    o.set_outgoing_inflight_upper_limit(WINDOW);
    let (client, mut connection) = Client::new(o, 1024);
    let sender = std::thread::spawn(move || {
        let started = Instant::now();
        for (k, (id, _)) in plan(total).enumerate() {
            if rate > 0 && k % 100 == 0 {
                let due = Duration::from_secs_f64(k as f64 / rate as f64);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
            let mut props = PublishProperties::default();
            props
                .user_properties
                .push(("message-id".into(), format!("evt-{id}")));
            let payload = format!("{{\"event\":{id},\"pad\":\"{id:0>48}\"}}");
            let topic = format!("soak/{}", id % 16);
            if client
                .publish_with_properties(topic, QoS::AtLeastOnce, false, payload, props)
                .is_err()
            {
                return;
            }
        }
    });
    let mut acked = 0u64;
    let mut shown = Instant::now();
    let mut out = std::io::stdout().lock();
    while acked < total {
        match connection.recv_timeout(Duration::from_millis(200)) {
            Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => acked += 1,
            Ok(Err(e)) => {
                eprintln!("publisher connection: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            _ => {}
        }
        if shown.elapsed() > Duration::from_millis(500) || acked == total {
            shown = Instant::now();
            writeln!(out, "{acked}")?;
            out.flush()?;
        }
    }
    let _ = sender.join();
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = args()?;
    if let Some(port) = args.publish {
        return publish(port, args.count, args.rate);
    }
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    // Before any database opens: every connection goes through it (bytes are counted always).
    field_vfs::install(Duration::from_millis(args.sync_delay_ms));
    let written = field_vfs::Written::now();
    let device_before = field_vfs::device_bytes(&std::env::temp_dir());
    let deadline = Instant::now() + Duration::from_secs(args.minutes * 60);
    let repeats = plan(args.count).filter(|(_, r)| *r).count() as u64;
    let distinct = args.count - repeats;
    let dir = tempfile::tempdir()?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777))?;
    let port = free_port();
    let broker = start_broker(dir.path(), port)?;
    let db = dir.path().join("inbox.db");
    println!(
        "soak: {} deliveries ({distinct} distinct, {repeats} repeats), at most {} min, broker 127.0.0.1:{port}, \
         consumer window {}, batch {}, page cache {}",
        args.count,
        args.minutes,
        args.window.map_or("default".to_string(), |w| w.to_string()),
        args.batch.map_or("default".to_string(), |b| b.to_string()),
        args.cache_kib
            .map_or("default".to_string(), |k| format!("{k} KiB"))
    );

    let mut config = Config::default();
    if let Some(kib) = args.cache_kib {
        config = config.cache_size(kib * 1024);
    }

    // Consumer: persistent session, subscribed before anything is published.
    let mut inbox = Inbox::open(&db, config.clone())?;
    inbox.set_retention(
        SCOPE,
        &RetentionPolicy::new()
            .processed_payloads(Duration::ZERO)
            .identity_horizon(Duration::from_secs(365 * 86_400)),
    )?;
    // The library's defaults unless told otherwise: the memory figure is for a consumer as shipped.
    let mut mqtt = MqttConfig::new("127.0.0.1", port, "soak-consumer").subscribe("soak/#");
    if let Some(window) = args.window {
        mqtt = mqtt.inflight(window);
    }
    let mut consumer = Consumer::new(inbox, SCOPE, mqtt);
    if let Some(batch) = args.batch {
        consumer = consumer.batch(batch, Duration::ZERO);
    }
    let stop = consumer.stop_handle();
    let consumer_thread = std::thread::spawn(move || {
        let summary = consumer.run(effect);
        (summary, consumer.into_inbox())
    });
    std::thread::sleep(Duration::from_millis(500));

    // Maintenance on its own connection: whole retention passes (scans of every identity, vacuum steps,
    // checkpoints) competing for the write lock the whole time.
    let done = Arc::new(AtomicBool::new(false));
    let passes = Arc::new(AtomicU64::new(0));
    let pruner = {
        let (db, done, passes, config) = (db.clone(), done.clone(), passes.clone(), config.clone());
        std::thread::spawn(move || -> anyhow::Result<()> {
            let mut inbox = Inbox::open(&db, config)?;
            let opts = Pruning::default().batch(512);
            // Step by step (as Inbox::prune does, resting between steps) so the run can end mid-pass.
            while !done.load(Ordering::Relaxed) {
                let started = Instant::now();
                match inbox.prune_step(&opts) {
                    Ok(step) if step.done => {
                        passes.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) | Err(edge_inbox::Error::Busy { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
                std::thread::sleep(Duration::from_millis(10).max(started.elapsed() * 4));
            }
            Ok(())
        })
    };

    // Publisher in its own process, so the memory figures below are the consumer's alone.
    let acked = Arc::new(AtomicU64::new(0));
    let mut publisher = Command::new(std::env::current_exe()?)
        .args([
            "--publish",
            &port.to_string(),
            "--count",
            &args.count.to_string(),
            "--rate",
            &args.rate.to_string(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the publisher process")?;
    let progress = {
        let (acked, out) = (acked.clone(), publisher.stdout.take().expect("piped"));
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if let Ok(n) = line.trim().parse() {
                    acked.store(n, Ordering::Relaxed);
                }
            }
        })
    };
    let total = args.count;

    // Sample memory and progress until every delivery is settled or the time is up.
    let started = Instant::now();
    let stats_conn = edge_inbox::open_read_only(&db)?;
    // The sampler is the harness, not the gateway: a small page cache keeps its counting scans out of the
    // memory figure.
    stats_conn.pragma_update(None, "cache_size", -256)?;
    let mut samples: Vec<(u64, u64)> = Vec::new();
    let mut at_peak = MemoryBreakdown::now();
    let mut last_print = Instant::now() - Duration::from_secs(60);
    let settled = |conn: &edge_inbox::rusqlite::Connection| -> anyhow::Result<(u64, u64)> {
        let s = edge_inbox::inspect::stats(conn, Some(SCOPE))?;
        Ok(s.first().map_or((0, 0), |s| (s.processed, s.duplicates)))
    };
    let finished = loop {
        let (processed, duplicates) = settled(&stats_conn)?;
        let rss = rss_kib(None);
        if samples.iter().all(|&(_, r)| r < rss) {
            at_peak = MemoryBreakdown::now();
        }
        samples.push((started.elapsed().as_secs(), rss));
        if last_print.elapsed() >= Duration::from_secs(15) {
            last_print = Instant::now();
            println!(
                "t={:>4}s published+acked {:>8}  processed {:>8}  duplicates {:>8}  RSS {:>6} KiB (anon {}, file {}, shmem {})  broker RSS {:>6} KiB  prune passes {}",
                started.elapsed().as_secs(),
                acked.load(Ordering::Relaxed),
                processed,
                duplicates,
                rss,
                status_kib(None, "RssAnon:"),
                status_kib(None, "RssFile:"),
                status_kib(None, "RssShmem:"),
                rss_kib(Some(broker.0.id())),
                passes.load(Ordering::Relaxed)
            );
            let _ = std::io::stdout().flush();
        }
        if processed + duplicates >= total && acked.load(Ordering::Relaxed) >= total {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    let elapsed = started.elapsed();
    done.store(true, Ordering::Relaxed);
    stop.stop();
    let _ = publisher.kill();
    let _ = publisher.wait();
    let _ = progress.join();
    let (summary, inbox) = consumer_thread.join().expect("consumer thread");
    let summary = summary?;
    pruner.join().expect("pruner thread")?;

    let effects: u64 = inbox
        .connection()
        .query_row(
            "SELECT value FROM kv WHERE ns = ?1 AND key = 'effects'",
            [SCOPE],
            |r| r.get::<_, Vec<u8>>(0),
        )
        .map(|b| ciborium::from_reader(&b[..]).unwrap_or(0))
        .unwrap_or(0);
    let report = inbox.stats()?;
    let s = report
        .iter()
        .find(|s| s.scope == SCOPE)
        .cloned()
        .unwrap_or_default();
    let files = inbox.file_sizes();
    let rss: Vec<u64> = samples.iter().map(|(_, r)| *r).collect();
    let (min, max) = (
        rss.iter().min().copied().unwrap_or(0),
        rss.iter().max().copied().unwrap_or(0),
    );
    let tail = &rss[rss.len() * 3 / 4..];
    println!("---");
    println!(
        "finished: {finished} in {:.0}s ({:.0} deliveries/s)",
        elapsed.as_secs_f64(),
        (s.processed + s.duplicates) as f64 / elapsed.as_secs_f64()
    );
    println!(
        "expected: {distinct} effects, {repeats} duplicates; got effects {effects}, processed {}, duplicates {}, \
         conflicts {}, quarantined {}, storage errors {}",
        s.processed, s.duplicates, s.conflicts, s.quarantined, summary.storage_errors
    );
    println!(
        "RSS KiB: first {} min {min} max {max} last {} (last quarter {}..{}); {} samples",
        rss.first().unwrap_or(&0),
        rss.last().unwrap_or(&0),
        tail.iter().min().unwrap_or(&0),
        tail.iter().max().unwrap_or(&0),
        rss.len()
    );
    // SAFETY: plain reads of SQLite's global memory statistics.
    let (sqlite_now, sqlite_peak) = unsafe {
        (
            edge_inbox::rusqlite::ffi::sqlite3_memory_used(),
            edge_inbox::rusqlite::ffi::sqlite3_memory_highwater(0),
        )
    };
    println!(
        "RSS now: anon {} KiB, file {} KiB, shmem {} KiB; SQLite heap {} KiB (peak {} KiB)",
        status_kib(None, "RssAnon:"),
        status_kib(None, "RssFile:"),
        status_kib(None, "RssShmem:"),
        sqlite_now / 1024,
        sqlite_peak / 1024
    );
    println!("at the RSS peak: {at_peak}");
    let w = field_vfs::Written::now().since(written);
    let deliveries = (s.processed + s.duplicates).max(1);
    let (wal, dbw, block) = w.per(deliveries);
    let counted = inbox.bytes_written()?;
    let device = match (
        device_before,
        field_vfs::device_bytes(&std::env::temp_dir()),
    ) {
        (Some(b), Some(a)) => format!("{:.0} B", a.saturating_sub(b) as f64 / deliveries as f64),
        _ => "unknown".into(),
    };
    println!(
        "written per delivery (sync +{} ms): WAL {wal:.0} B, database file {dbw:.0} B, block layer {block:.0} B, \
         {:.3} syncs (consumer and pruner); the inbox counted {} B of WAL and {} B of checkpoints in all; \
         the device holding the files wrote {device} per delivery (every process, file system journal included)",
        args.sync_delay_ms,
        w.syncs as f64 / deliveries as f64,
        counted.wal_bytes,
        counted.checkpoint_bytes
    );
    println!(
        "identities retained {}; database {} bytes, WAL {} bytes; prune passes {}",
        s.identities_retained,
        files.db_bytes,
        files.wal_bytes,
        passes.load(Ordering::Relaxed)
    );
    drop(broker);
    if !finished {
        bail!("time ran out before every delivery was settled");
    }
    // Repeats published by the producer are duplicates; broker redeliveries could only add more duplicates.
    if effects != distinct || s.processed != distinct || s.duplicates < repeats || s.conflicts != 0
    {
        bail!("effect count is not exact");
    }
    println!("exact: every distinct message had one effect");
    Ok(())
}
