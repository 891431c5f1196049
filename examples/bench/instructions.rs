//! Fixed-size runs of one delivery kind for callgrind.

use super::*;

/// `n` deliveries of one kind with `synchronous=OFF`, for callgrind. Setup is the same whatever `n`, so the
/// difference between two runs divided by the difference in `n` is the cost per delivery.
pub(crate) fn instructions(dir: &Path, kind: &str, n: usize) -> anyhow::Result<()> {
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
