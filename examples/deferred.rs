//! Received-then-deferred mode: store and ack first, apply later with worker threads.
//!
//! The receiving side stores each delivery as a pending message (one durable commit per batch) and may ack the
//! broker as soon as `receive_batch_into` returns. Two worker threads apply the messages with leases, retries
//! and dead letters; a message the handler cannot parse ends up dead-lettered, and is requeued once the
//! handler is fixed. Messages of one order are
//! applied in arrival order (order key).
//!
//! Run: `RUST_LOG=info cargo run --example deferred`

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use edge_inbox::{BacklogThreshold, Config, Delivery, Inbox, Outcome, Tx, Worker, WorkerConfig};

const SCOPE: &str = "inventory-reservation";

/// The effect: reserve stock, in the built-in key-value state. Refuses payloads it cannot parse.
fn reserve(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let text = std::str::from_utf8(d.payload)?;
    let (sku, qty) = text
        .split_once(':')
        .ok_or_else(|| anyhow::anyhow!("expected sku:qty, got {text:?}"))?;
    apply(tx, sku, qty.parse()?)
}

/// The next release of the handler, which also understands the bulk marker `lots` (10 units).
fn reserve_v2(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    match std::str::from_utf8(d.payload)?.split_once(':') {
        Some((sku, "lots")) => apply(tx, sku, 10),
        _ => reserve(tx, d),
    }
}

fn apply(tx: &mut Tx<'_>, sku: &str, qty: i64) -> anyhow::Result<()> {
    let reserved: i64 = tx.get(sku)?.unwrap_or(0);
    tx.put(sku, &(reserved + qty))?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default())?;

    // Receive: 20 deliveries (orders 0..5, four events each) plus one poison message, one commit.
    let ids: Vec<String> = (0..20).map(|i| format!("evt-{i}")).collect();
    let orders: Vec<String> = (0..20).map(|i| format!("order-{}", i % 5)).collect();
    let mut batch: Vec<Delivery<'_>> = ids
        .iter()
        .map(|id| Delivery::new(SCOPE, id, "orders", b"A-1:1"))
        .collect();
    let mut keys: Vec<Option<&str>> = orders.iter().map(|o| Some(o.as_str())).collect();
    batch.push(Delivery::new(SCOPE, "evt-poison", "orders", b"A-1:lots"));
    keys.push(None);
    let mut outcomes = Vec::new();
    inbox.receive_batch_ordered_into(&batch, &keys, &mut outcomes)?;
    assert!(outcomes.iter().all(|o| matches!(o, Outcome::Received)));
    println!(
        "stored {} deliveries as pending: now they may be acked",
        outcomes.len()
    );
    // The broker redelivers one (our ack was lost): a duplicate, ack it again.
    println!("redelivery of evt-3: {}", inbox.receive(&batch[3])?.name());
    println!(
        "backlog before the workers start: {:?}",
        inbox.backlog(SCOPE)?
    );

    // Two worker threads, each with its own connection.
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..2)
        .map(|i| {
            let (path, stop) = (path.clone(), stop.clone());
            std::thread::spawn(move || -> edge_inbox::Result<edge_inbox::Drained> {
                let config = WorkerConfig::default()
                    .owner(format!("example-{i}"))
                    .batch(4)
                    .max_attempts(3)
                    .backoff(Duration::from_millis(50), Duration::from_secs(1));
                let mut worker = Worker::open(&path, Config::default(), SCOPE, config)?;
                worker.run_until(&stop, &mut reserve)
            })
        })
        .collect();

    // Wait (bounded) until nothing is pending or failed; the poison message is dead-lettered by then.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let backlog = inbox.warn_if_backlogged(SCOPE, &BacklogThreshold::default())?;
        if backlog.pending + backlog.failed == 0 || Instant::now() > deadline {
            println!("backlog after draining: {backlog:?}");
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        println!("worker finished: {:?}", w.join().expect("worker thread")?);
    }

    for dead in inbox.dead_letters(SCOPE, 10)? {
        println!(
            "dead letter {} after {} attempts: {:?}",
            dead.message_id, dead.attempts, dead.last_error
        );
    }
    // The handler is fixed and deployed; the operator requeues the dead letters.
    println!(
        "requeued {} dead letter(s)",
        inbox.requeue_dead_letters(SCOPE)?
    );
    let mut worker = Worker::open(&path, Config::default(), SCOPE, WorkerConfig::default())?;
    println!("after requeue: {:?}", worker.run_once(&mut reserve_v2)?);

    let reserved: i64 = inbox.connection().query_row(
        "SELECT value FROM kv WHERE ns = ?1 AND key = 'A-1'",
        [SCOPE],
        |r| {
            r.get::<_, Vec<u8>>(0)
                .map(|v| ciborium::from_reader(&v[..]).unwrap_or(-1))
        },
    )?;
    println!("A-1 reserved: {reserved} (20 x 1, plus 10 for the requeued bulk order)");
    println!("stats: {:?}", inbox.scope_stats(SCOPE)?);
    assert_eq!(reserved, 30);
    Ok(())
}
