//! Replay and rebuild: replaying a scope's history respects its identities (nothing is applied twice), and a
//! new projection is rebuilt under a versioned scope (`name@2`) that starts with no identities.
//!
//! ```text
//! cargo run --example replay
//! ```

use edge_inbox::{versioned_scope, Config, Delivery, Inbox, Outcome, Tx};

/// The retained history, as a broker with retention, an archive or a producer's outbox would offer it again.
const HISTORY: &[(&str, &str, i64)] = &[
    ("evt-1-reserved", "A-1", 2),
    ("evt-2-reserved", "B-7", 1),
    ("evt-3-reserved", "A-1", 1),
    ("evt-4-released", "A-1", -1),
];

fn offer(
    inbox: &mut Inbox,
    scope: &str,
    handler: impl FnMut(&mut Tx<'_>, &Delivery<'_>) -> anyhow::Result<()>,
) -> anyhow::Result<(usize, usize)> {
    let payloads: Vec<Vec<u8>> = HISTORY
        .iter()
        .map(|(_, sku, qty)| format!("{sku}:{qty}").into_bytes())
        .collect();
    let deliveries: Vec<Delivery<'_>> = HISTORY
        .iter()
        .zip(&payloads)
        .map(|((id, _, _), p)| {
            Delivery::new(scope, id, "inventory/events", p).with_producer("orders-service")
        })
        .collect();
    let outcomes = inbox.process_batch(&deliveries, handler)?;
    let processed = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Processed))
        .count();
    let duplicates = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Duplicate))
        .count();
    Ok((processed, duplicates))
}

fn parse(d: &Delivery<'_>) -> anyhow::Result<(String, i64)> {
    let text = std::str::from_utf8(d.payload)?;
    let (sku, qty) = text
        .split_once(':')
        .ok_or_else(|| anyhow::anyhow!("bad payload {text:?}"))?;
    Ok((sku.to_owned(), qty.parse()?))
}

/// Version 1 of the projection: units reserved per SKU.
fn reserve_v1(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let (sku, qty) = parse(d)?;
    let reserved: i64 = tx.get(&sku)?.unwrap_or(0);
    tx.put(&sku, &(reserved + qty))?;
    Ok(())
}

/// Version 2: the same, plus how many events touched each SKU (a projection version 1 never kept).
fn reserve_v2(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    reserve_v1(tx, d)?;
    let (sku, _) = parse(d)?;
    let key = format!("{sku}/events");
    let events: i64 = tx.get(&key)?.unwrap_or(0);
    tx.put(&key, &(events + 1))?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default())?;
    let v1 = "inventory-reservation";

    let (p, d) = offer(&mut inbox, v1, reserve_v1)?;
    println!("{v1}: first delivery  -> {p} processed, {d} duplicates");

    // Replay of the same scope (a broker redelivers its retained history, an operator re-runs an archive):
    // every identity is known, so nothing is applied again.
    let (p, d) = offer(&mut inbox, v1, reserve_v1)?;
    println!("{v1}: replay          -> {p} processed, {d} duplicates");
    assert_eq!((p, d), (0, HISTORY.len()));

    // Rebuild a new projection: a versioned scope has no identities yet, so the history applies once. Its
    // state lives in its own namespace (the scope name), beside version 1's, which keeps serving until retired.
    let v2 = versioned_scope(v1, 2);
    let (p, d) = offer(&mut inbox, &v2, reserve_v2)?;
    println!("{v2}: rebuild         -> {p} processed, {d} duplicates");
    assert_eq!((p, d), (HISTORY.len(), 0));
    let (p, d) = offer(&mut inbox, &v2, reserve_v2)?;
    println!("{v2}: replay          -> {p} processed, {d} duplicates");
    assert_eq!((p, d), (0, HISTORY.len()));

    let read = |ns: &str, key: &str| -> anyhow::Result<i64> {
        let blob: Option<Vec<u8>> = inbox
            .connection()
            .query_row(
                "SELECT value FROM kv WHERE ns = ?1 AND key = ?2",
                (ns, key),
                |r| r.get(0),
            )
            .ok();
        Ok(match blob {
            Some(b) => ciborium::from_reader(&b[..])?,
            None => 0,
        })
    };
    println!(
        "A-1 reserved: v1 {} / v2 {} (v2 saw {} events)",
        read(v1, "A-1")?,
        read(&v2, "A-1")?,
        read(&v2, "A-1/events")?
    );
    assert_eq!(read(v1, "A-1")?, 2);
    assert_eq!(read(&v2, "A-1")?, 2);
    Ok(())
}
