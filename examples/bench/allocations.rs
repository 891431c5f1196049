//! Allocations per delivery, and where each steady-state allocation comes from.

use super::*;

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

pub(crate) fn allocations(dir: &Path) -> anyhow::Result<()> {
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
pub(crate) fn trace_allocations(dir: &Path) -> anyhow::Result<()> {
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
