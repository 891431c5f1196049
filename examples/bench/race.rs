//! Race demo: two workers receive the same deliveries at the same moment.

use super::*;

/// Two workers receive the same deliveries at the same moment (a barrier per message). Counts effects
/// committed more than once, for the naive consumer and for the inbox.
pub(crate) fn race(dir: &Path, n: usize) -> anyhow::Result<()> {
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
