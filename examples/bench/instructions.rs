//! Fixed-size runs of one delivery kind for callgrind.

use super::*;

/// `n` deliveries of one kind with `synchronous=NORMAL` (no sync at commit), for callgrind. Setup is the
/// same whatever `n`, so the difference between two runs divided by the difference in `n` is the cost per
/// delivery.
pub(crate) fn instructions(dir: &Path, kind: &str, n: usize) -> anyhow::Result<()> {
    let path = dir.join(format!("instructions-{kind}.db"));
    let ids = ids("i", n);
    let now = now();
    match kind {
        "raw" | "raw256" => {
            let per_tx = if kind == "raw" { 1 } else { 256 };
            let mut raw = Raw::open(&path, Sync::Normal)?;
            for c in ids.chunks(per_tx) {
                raw.insert_tx(c, now)?;
            }
        }
        "process" | "process-noop" => {
            let mut inbox = open_inbox(&path, Sync::Normal)?;
            let ds = deliveries(&ids, PAYLOAD);
            let hits = if kind == "process" {
                process_each(&mut inbox, &ds, &mut kv_handler(), "processed")?
            } else {
                process_each(&mut inbox, &ds, &mut noop_handler, "processed")?
            };
            anyhow::ensure!(hits == n);
        }
        "classic" => {
            let mut peer = Peer::open(&path, Sync::Normal)?;
            for id in &ids {
                anyhow::ensure!(peer.classic(id)?);
            }
        }
        "batch256" => {
            let mut inbox = open_inbox(&path, Sync::Normal)?;
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

/// WAL frames (pages written) per commit of each one-delivery-per-transaction row: with checkpoints off, the
/// WAL's growth over `n` commits after a warm-up. A page more per commit is a 4 KiB write, its checksum, and a
/// page more for every checkpoint to copy back.
pub(crate) fn wal_frames(dir: &Path, n: usize) -> anyhow::Result<()> {
    let now = now();
    println!("\n| one delivery per transaction (n={n}) | WAL frames per commit |");
    println!("|---|---:|");
    for kind in ["raw", "classic", "process-noop", "process"] {
        let path = dir.join(format!("frames-{kind}.db"));
        let ids = ids("f", n + 50);
        let wal = PathBuf::from(format!("{}-wal", path.display()));
        let frames = |conn: &rusqlite::Connection| -> anyhow::Result<u64> {
            let page: i64 = conn.query_row("PRAGMA page_size", [], |r| r.get(0))?;
            let page = page as u64;
            let size = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
            Ok(size.saturating_sub(32) / (page + 24))
        };
        let per = match kind {
            "raw" => {
                let mut raw = Raw::open(&path, Sync::Normal)?;
                raw.conn().execute_batch("PRAGMA wal_autocheckpoint = 0")?;
                for c in ids[..50].chunks(1) {
                    raw.insert_tx(c, now)?;
                }
                let before = frames(raw.conn())?;
                for c in ids[50..].chunks(1) {
                    raw.insert_tx(c, now)?;
                }
                (frames(raw.conn())? - before) as f64 / n as f64
            }
            "classic" => {
                let mut peer = Peer::open(&path, Sync::Normal)?;
                peer.conn().execute_batch("PRAGMA wal_autocheckpoint = 0")?;
                for id in &ids[..50] {
                    anyhow::ensure!(peer.classic(id)?);
                }
                let before = frames(peer.conn())?;
                for id in &ids[50..] {
                    anyhow::ensure!(peer.classic(id)?);
                }
                (frames(peer.conn())? - before) as f64 / n as f64
            }
            _ => {
                let mut inbox = open_inbox(&path, Sync::Normal)?;
                inbox
                    .connection()
                    .execute_batch("PRAGMA wal_autocheckpoint = 0")?;
                let ds = deliveries(&ids, PAYLOAD);
                let mut handler = kv_handler();
                let mut run = |inbox: &mut Inbox, ds: &[Delivery<'_>]| -> anyhow::Result<usize> {
                    if kind == "process" {
                        process_each(inbox, ds, &mut handler, "processed")
                    } else {
                        process_each(inbox, ds, &mut noop_handler, "processed")
                    }
                };
                anyhow::ensure!(run(&mut inbox, &ds[..50])? == 50);
                let before = frames(inbox.connection())?;
                anyhow::ensure!(run(&mut inbox, &ds[50..])? == n);
                (frames(inbox.connection())? - before) as f64 / n as f64
            }
        };
        println!("| {kind} | {per:.2} |");
    }
    Ok(())
}
