//! Retention benchmark: bytes on disk per retained identity, watermark space for numbered producers, and the
//! consumer's commit latency while a large prune runs on the same file.
//!
//! ```text
//! cargo run --release --example retention_bench            # full sizes (a few minutes)
//! cargo run --release --example retention_bench -- --small # a tenth of the sizes
//! cargo run --example retention_bench -- --divide 1000       # a quick check that every part runs
//! cargo run --release --example retention_bench -- --dir /path/on/the/target/disk
//! cargo run --release --example retention_bench -- --only latency --idle 9 --batch 64
//! ```
//!
//! The fills use `synchronous=NORMAL` and large group-commit batches to keep them quick; they measure space,
//! not speed. The latency part uses the default `synchronous=FULL` for the consumer, as in production.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use edge_inbox::{Config, Delivery, Inbox, Pruning, RetentionPolicy, Synchronous, Tx};

#[path = "support/field_vfs.rs"]
mod field_vfs;

/// Retention benchmark: space per identity, watermark space, commit latency while a prune runs.
#[derive(clap::Parser)]
#[command(name = "retention_bench")]
struct Args {
    /// A tenth of the sizes.
    #[arg(long)]
    small: bool,
    /// Where the files go (default: the current directory).
    #[arg(long, value_name = "PATH")]
    dir: Option<PathBuf>,
    /// Divide every size by N instead (`--small` is 10; CI runs 1000 to check that each part still works).
    #[arg(long, value_name = "N", conflicts_with = "small", value_parser = clap::value_parser!(u64).range(1..))]
    divide: Option<u64>,
    /// Run one part only.
    #[arg(long, value_parser = ["identities", "watermarks", "latency"])]
    only: Option<String>,
    /// The pruner rests N times as long as each step took (default: `Pruning::default()`).
    #[arg(long, value_name = "N")]
    idle: Option<u32>,
    /// Rows per prune step (default: `Pruning::default()`).
    #[arg(long, value_name = "ROWS")]
    batch: Option<usize>,
    /// Field storage: add this many milliseconds to every sync (SD card, eMMC), through a VFS that wraps the
    /// platform's.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    sync_delay_ms: u64,
    /// The consumer's `Config::wal_autocheckpoint` while the prune runs (0: it never checkpoints, the pruning
    /// connection does; default: the library's).
    #[arg(long, value_name = "PAGES")]
    consumer_autocheckpoint: Option<u32>,
    /// The pruner checkpoints between its steps once the WAL holds this many frames (0: never; default:
    /// `Pruning::default()`).
    #[arg(long, value_name = "PAGES")]
    checkpoint_pages: Option<u32>,
    /// The pruner's steps commit at the configured durability, with their own sync.
    #[arg(long)]
    sync_steps: bool,
    /// The pruner syncs the WAL after each step, outside the write lock (`Pruning::sync_after_steps`),
    /// instead of leaving the steps' frames for the consumers' commits to flush.
    #[arg(long)]
    sync_after_steps: bool,
}

fn main() -> anyhow::Result<()> {
    let args = <Args as clap::Parser>::parse();
    // Before any database opens: every connection goes through it.
    field_vfs::install(Duration::from_millis(args.sync_delay_ms));
    if args.sync_delay_ms > 0 {
        println!(
            "Field storage: every sync takes {} ms more (simulated).",
            args.sync_delay_ms
        );
    }
    let small = args.small;
    let div = match args.divide {
        Some(n) => n as usize,
        None if small => 10,
        None => 1,
    };
    let base: PathBuf = match &args.dir {
        Some(d) => d.clone(),
        None => std::env::current_dir()?,
    };
    let dir = tempfile::tempdir_in(&base)?;
    let only: Option<&str> = args.only.as_deref();

    let mut rows: Vec<(String, String, String)> = Vec::new();
    if only.is_none_or(|o| o == "identities") {
        identities(
            &dir.path().join("identities.db"),
            1_000_000 / div,
            &mut rows,
        )?;
    }
    if only.is_none_or(|o| o == "watermarks") {
        watermarks(
            &dir.path().join("watermarks.db"),
            10_000_000 / div,
            100,
            &mut rows,
        )?;
    }
    if only.is_none_or(|o| o == "latency") {
        let mut pruning = Pruning::default();
        if let Some(idle) = args.idle {
            pruning = pruning.idle(idle);
        }
        if let Some(batch) = args.batch {
            pruning = pruning.batch(batch);
        }
        if let Some(pages) = args.checkpoint_pages {
            pruning = pruning.checkpoint_pages(pages);
        }
        if args.sync_steps {
            pruning = pruning.sync_steps(true);
        }
        if args.sync_after_steps {
            pruning = pruning.sync_after_steps(true);
        }
        latency(
            &dir.path().join("latency.db"),
            1_000_000 / div,
            pruning,
            args.consumer_autocheckpoint,
            &mut rows,
        )?;
    }
    println!();
    println!("| measure | value | target |");
    println!("|---|---|---|");
    for (m, v, t) in rows {
        println!("| {m} | {v} | {t} |");
    }
    Ok(())
}

fn on_disk(path: &Path) -> u64 {
    let wal = PathBuf::from(format!("{}-wal", path.display()));
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
        + std::fs::metadata(wal).map(|m| m.len()).unwrap_or(0)
}

fn fill_config() -> Config {
    Config::default().synchronous(Synchronous::Normal)
}

/// An id of 20 to 40 bytes.
fn message_id(i: usize, out: &mut String) {
    use std::fmt::Write;
    out.clear();
    let pad = 6 + (i * 7919) % 21; // 6..=26 extra bytes
    write!(out, "evt-{i:010}-").unwrap();
    for _ in 0..pad {
        out.push('x');
    }
}

fn identities(
    path: &Path,
    n: usize,
    rows: &mut Vec<(String, String, String)>,
) -> anyhow::Result<()> {
    eprintln!("identities: filling {n} processed deliveries with stored payloads ...");
    let mut inbox = Inbox::open(path, fill_config())?;
    inbox.scope_id("another-consumer")?; // the measured scope gets a one-byte id, as most real ones
    let scope = "inventory-reservation";
    inbox.set_retention(
        scope,
        &RetentionPolicy::new().processed_payloads(Duration::ZERO),
    )?;
    // The file with its schema and scopes but no identity: fixed pages (one per table and index) that the
    // per-identity figure must not be charged with.
    inbox
        .connection()
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
    let empty = on_disk(path);
    let payload = vec![b'p'; 120];
    let batch = 10_000;
    let mut ids: Vec<String> = vec![String::new(); batch];
    let mut id_bytes = 0usize;
    let started = Instant::now();
    let key = inbox.id_key().clone();
    let mut store = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        // What the received-then-deferred mode leaves behind: the processed body.
        tx.sql()
            .prepare_cached(
                "INSERT INTO messages (scope_id, id_hash, producer, message_id, topic, payload, state, received_at, \
                 finished_at) VALUES (?1, ?2, NULL, ?3, ?4, ?5, 1, ?6, ?6)",
            )?
            .execute((tx.scope_id(), d.id_hash(&key).as_bytes(), d.message_id, d.topic, d.payload, tx.now()))?;
        Ok(())
    };
    let mut outcomes = Vec::with_capacity(batch);
    let mut i = 0;
    while i < n {
        let m = batch.min(n - i);
        for (k, s) in ids.iter_mut().take(m).enumerate() {
            message_id(i + k, s);
            id_bytes += s.len();
        }
        let deliveries: Vec<Delivery<'_>> = ids[..m]
            .iter()
            .map(|id| Delivery::new(scope, id, "orders/created", &payload))
            .collect();
        inbox.process_batch_into(&deliveries, &mut store, &mut outcomes)?;
        i += m;
    }
    inbox
        .connection()
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
    let before = on_disk(path);
    eprintln!(
        "  filled in {:.1?}: {} bytes on disk",
        started.elapsed(),
        before
    );

    let started = Instant::now();
    let report = inbox.prune(
        &Pruning::default()
            .batch(5_000)
            .vacuum_pages(4_096)
            .pause(Duration::ZERO)
            .idle(0)
            // The space the identities take, not a WAL the next commits would reuse.
            .truncate_wal(true),
    )?;
    eprintln!("  pruned in {:.1?}: {report:?}", started.elapsed());
    let after = on_disk(path);
    let (pages, page_size, free): (i64, i64, i64) = inbox.connection().query_row(
        "SELECT (SELECT page_count FROM pragma_page_count), (SELECT page_size FROM pragma_page_size), \
         (SELECT freelist_count FROM pragma_freelist_count)",
        [],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )?;
    let left: i64 = inbox
        .connection()
        .query_row("SELECT count(*) FROM identities", [], |r| r.get(0))?;
    assert_eq!(left as usize, n);
    let per = after.saturating_sub(empty) as f64 / n as f64;
    let whole = after as f64 / n as f64;
    eprintln!(
        "  after prune + vacuum + checkpoint: {after} bytes ({pages} pages of {page_size}, {free} free), {empty} bytes \
         of them the empty schema: {per:.2} B/identity ({whole:.2} with the empty schema), identity key {}",
        inbox.id_key().kind()
    );
    // Row estimate: header 5 + scope 1 + hash 16 + fingerprint 8 + day 2, plus 1 length byte and a 2-byte slot.
    rows.push((
        format!(
            "bytes on disk per retained identity, {n} ids of 20-40 B (mean {:.1} B), payloads pruned",
            id_bytes as f64 / n as f64
        ),
        format!(
            "{per:.2} (whole file {whole:.2}; before pruning {:.1}; row estimate 35 + B-tree fill; key {})",
            before as f64 / n as f64,
            inbox.id_key().kind()
        ),
        "<= 40".into(),
    ));
    Ok(())
}

fn watermarks(
    path: &Path,
    n: usize,
    producers: usize,
    rows: &mut Vec<(String, String, String)>,
) -> anyhow::Result<()> {
    eprintln!("watermarks: {n} in-order messages from {producers} producers ...");
    let mut inbox = Inbox::open(path, fill_config())?;
    let scope = "telemetry";
    inbox.set_retention(scope, &RetentionPolicy::new().sequence_watermarks(1))?;
    let names: Vec<String> = (0..producers).map(|p| format!("sensor-{p:03}")).collect();
    let batch = 10_000;
    let mut ids: Vec<String> = vec![String::new(); batch];
    let mut meta: Vec<(usize, u64)> = vec![(0, 0); batch];
    let mut next = vec![1u64; producers];
    let mut outcomes = Vec::with_capacity(batch);
    let mut noop = |_: &mut Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> { Ok(()) };
    let started = Instant::now();
    let mut i = 0;
    while i < n {
        let m = batch.min(n - i);
        for k in 0..m {
            let p = (i + k) % producers;
            meta[k] = (p, next[p]);
            next[p] += 1;
            ids[k].clear();
            use std::fmt::Write;
            write!(ids[k], "{}-{}", names[p], meta[k].1).unwrap();
        }
        let deliveries: Vec<Delivery<'_>> = (0..m)
            .map(|k| {
                Delivery::new(scope, &ids[k], "telemetry/reading", b"{\"t\":21.5}")
                    .with_producer(&names[meta[k].0])
                    .with_sequence(meta[k].1)
            })
            .collect();
        inbox.process_batch_into(&deliveries, &mut noop, &mut outcomes)?;
        i += m;
    }
    let fill = started.elapsed();
    inbox
        .connection()
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
    let size = on_disk(path);
    let stats = inbox.scope_stats(scope)?;
    assert_eq!(stats.processed as usize, n);
    let w = inbox.watermark(scope, &names[0])?;
    eprintln!(
        "  filled in {fill:.1?} ({:.0}/s); {size} bytes; producer 0 at {:?}",
        n as f64 / fill.as_secs_f64(),
        w.high
    );
    rows.push((
        format!(
            "file size, {n} processed messages from {producers} in-order producers (watermarks)"
        ),
        format!("{:.1} KiB", size as f64 / 1024.0),
        "< 1024 KiB".into(),
    ));
    Ok(())
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// One consumer commit: its time and what it spent it on.
#[derive(Clone, Copy)]
struct Commit {
    took: Duration,
    times: field_vfs::ThreadTimes,
}

/// Commits one delivery at a time (synchronous=FULL) until `stop`, pausing `gap` between them; each commit's
/// time and breakdown, in commit order.
fn consume(
    path: &Path,
    config: Config,
    prefix: &str,
    stop: &AtomicBool,
    min: usize,
    gap: Duration,
) -> anyhow::Result<Vec<Commit>> {
    // A long prune (a million rows with slow syncs takes half an hour) shows how it goes every minute.
    let mut next_report = Instant::now() + Duration::from_secs(60);
    let mut inbox = Inbox::open(path, config)?;
    let mut commits = Vec::new();
    let mut id = String::new();
    let payload = b"{\"order\":1}";
    let noop = |_: &mut Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> { Ok(()) };
    while !stop.load(Ordering::SeqCst) || commits.len() < min {
        id.clear();
        use std::fmt::Write;
        write!(id, "{prefix}-{}", commits.len())?;
        let d = Delivery::new("consumer", &id, "orders", payload);
        let t = Instant::now();
        let before = field_vfs::ThreadTimes::now();
        inbox.process(&d, noop)?;
        commits.push(Commit {
            took: t.elapsed(),
            times: field_vfs::ThreadTimes::now().since(before),
        });
        if !stop.load(Ordering::SeqCst) && Instant::now() >= next_report {
            next_report += Duration::from_secs(60);
            let s = Summary::of(&commits);
            eprintln!(
                "    so far: {} commits, p50 {:.2} ms p99 {:.2} ms, {} ran a checkpoint",
                commits.len(),
                ms(s.p50),
                ms(s.p99),
                s.checkpointed
            );
        }
        std::thread::sleep(gap);
    }
    Ok(commits)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Percentiles of a set of commits, and where the slowest 1% spent their time.
struct Summary {
    n: usize,
    p50: Duration,
    p99: Duration,
    max: Duration,
    checkpointed: usize,
    restarted: usize,
    /// Over the commits at or above p99: how many, their mean time, mean time in syncs, mean wait for the
    /// write lock, and how many started the WAL over (a header sync) or ran a checkpoint.
    tail: usize,
    tail_mean: Duration,
    tail_sync: Duration,
    tail_lock: Duration,
    tail_restarted: usize,
    tail_checkpointed: usize,
    /// Mean time in syncs over all commits.
    mean_sync: Duration,
}

impl Summary {
    fn of(commits: &[Commit]) -> Summary {
        let mut sorted: Vec<Duration> = commits.iter().map(|c| c.took).collect();
        sorted.sort_unstable();
        let p99 = percentile(&sorted, 0.99);
        let tail: Vec<&Commit> = commits.iter().filter(|c| c.took >= p99).collect();
        let mean = |f: &dyn Fn(&Commit) -> Duration, of: &[&Commit]| {
            of.iter().map(|c| f(c)).sum::<Duration>() / of.len().max(1) as u32
        };
        let all: Vec<&Commit> = commits.iter().collect();
        Summary {
            n: commits.len(),
            p50: percentile(&sorted, 0.5),
            p99,
            max: *sorted.last().unwrap(),
            checkpointed: commits.iter().filter(|c| c.times.db_bytes > 0).count(),
            restarted: commits.iter().filter(|c| c.times.wal_headers > 0).count(),
            tail: tail.len(),
            tail_mean: mean(&|c| c.took, &tail),
            tail_sync: mean(&|c| c.times.sync, &tail),
            tail_lock: mean(&|c| c.times.lock_wait, &tail),
            tail_restarted: tail.iter().filter(|c| c.times.wal_headers > 0).count(),
            tail_checkpointed: tail.iter().filter(|c| c.times.db_bytes > 0).count(),
            mean_sync: mean(&|c| c.times.sync, &all),
        }
    }

    /// "p99 (p50 ..., n commits, ...)" for the table.
    fn describe(&self) -> String {
        format!(
            "{:.2} ms (p50 {:.2} ms, max {:.2} ms, {} commits, {} ran a checkpoint, {} started the WAL over; \
             mean sync {:.2} ms; slowest {}: mean {:.2} ms = sync {:.2} + write-lock wait {:.2} + other, {} of them \
             started the WAL over, {} checkpointed)",
            ms(self.p99),
            ms(self.p50),
            ms(self.max),
            self.n,
            self.checkpointed,
            self.restarted,
            ms(self.mean_sync),
            self.tail,
            ms(self.tail_mean),
            ms(self.tail_sync),
            ms(self.tail_lock),
            self.tail_restarted,
            self.tail_checkpointed
        )
    }
}

fn latency(
    path: &Path,
    n: usize,
    pruning: Pruning,
    consumer_autocheckpoint: Option<u32>,
    rows: &mut Vec<(String, String, String)>,
) -> anyhow::Result<()> {
    eprintln!("latency: preparing {n} old processed messages ...");
    {
        let mut inbox = Inbox::open(path, fill_config())?;
        let scope = "history";
        inbox.set_retention(
            scope,
            &RetentionPolicy::new().processed_payloads(Duration::from_secs(3_600)),
        )?;
        let scope_id = inbox.scope_id(scope)?;
        inbox.scope_id("consumer")?;
        let conn = inbox.connection();
        // Finished long ago, in a file as old: retention ages a time before the file's creation from the pass.
        const OLD: i64 = edge_inbox::EARLIEST_PLAUSIBLE_TIME;
        conn.execute(
            "UPDATE inbox_meta SET value = ?1 WHERE name = 'created_at'",
            [OLD],
        )?;
        let mut i = 0;
        let mut id = String::new();
        while i < n {
            conn.execute_batch("BEGIN")?;
            {
                let mut msg = conn.prepare_cached(
                    "INSERT INTO messages (scope_id, id_hash, message_id, topic, payload, state, received_at, \
                     finished_at) VALUES (?1, ?2, ?3, 'orders', zeroblob(120), 1, ?4, ?4)",
                )?;
                let mut ident = conn.prepare_cached(
                    "INSERT INTO identities (scope_id, id_hash, fingerprint, day) VALUES (?1, ?2, 0, 0)",
                )?;
                for k in i..(i + 10_000).min(n) {
                    message_id(k, &mut id);
                    let h = inbox.id_hash(None, &id);
                    msg.execute((scope_id, h.as_bytes(), &id, OLD))?;
                    ident.execute((scope_id, h.as_bytes()))?;
                }
            }
            conn.execute_batch("COMMIT")?;
            i += 10_000;
        }
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
    }
    let gap = Duration::from_millis(2);
    // Fewer commits only when the prune is tiny (a check run), the same 3000 from 100 000 rows up.
    let samples = (n / 33).clamp(300, 3_000);

    eprintln!("  baseline: {samples} single-delivery commits, no pruning ...");
    let stop = AtomicBool::new(true);
    let mut base = consume(path, Config::default(), "base", &stop, samples, gap)?;

    eprintln!("  the same consumer while another connection prunes {n} rows ...");
    let stop = Arc::new(AtomicBool::new(false));
    let pruner = {
        let (path, stop) = (path.to_owned(), stop.clone());
        std::thread::spawn(
            move || -> anyhow::Result<(edge_inbox::PruneReport, Duration, field_vfs::ThreadTimes)> {
                // Default settings: prune_step itself skips the per-step fsync (a lost step is simply redone).
                let mut inbox = Inbox::open(&path, Config::default())?;
                let t = Instant::now();
                let before = field_vfs::ThreadTimes::now();
                let total = inbox.prune(&pruning)?;
                stop.store(true, Ordering::SeqCst);
                Ok((total, t.elapsed(), field_vfs::ThreadTimes::now().since(before)))
            },
        )
    };
    let during_config = match consumer_autocheckpoint {
        Some(pages) => Config::default().wal_autocheckpoint(pages),
        None => Config::default(),
    };
    let during = consume(path, during_config, "during", &stop, samples, gap)?;
    let (report, took, pruner_times) = pruner.join().expect("pruner thread")?;
    // The machine is shared and noisy: measure the baseline again after the prune and pool both halves.
    eprintln!("  baseline again after the prune ...");
    let stop = AtomicBool::new(true);
    let after = consume(path, Config::default(), "after", &stop, samples, gap)?;
    base.extend(after);
    assert_eq!(report.payloads_pruned as usize, n);
    eprintln!(
        "  prune: {report:?} in {took:.1?}: {:.1?} in syncs (its checkpoints' and any after its steps), \
         {:.1?} waiting for the write lock",
        pruner_times.sync, pruner_times.lock_wait
    );

    let (base, during) = (Summary::of(&base), Summary::of(&during));
    eprintln!("  baseline: {}", base.describe());
    eprintln!("  during the prune: {}", during.describe());
    rows.push((
        "consumer commit p99, no pruning (synchronous=FULL, one delivery per commit)".into(),
        base.describe(),
        String::new(),
    ));
    rows.push((
        format!(
            "consumer commit p99 while pruning {n} rows (prune took {took:.1?}, {} steps, {} pruner checkpoints, \
             {:.1?} of the pruner's time in syncs)",
            report.steps, report.checkpoints, pruner_times.sync
        ),
        format!("{} = {:.2}x", during.describe(), ms(during.p99) / ms(base.p99)),
        "<= 2x baseline".into(),
    ));
    Ok(())
}
