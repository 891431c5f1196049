//! The deferred worker bounds how long it holds the write lock, so a consumer receiving on the same file
//! keeps committing (and so acking) while slow handlers run.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use edge_inbox::{Config, Delivery, Inbox, Outcome, Tx, Worker, WorkerConfig};

#[test]
fn slow_handlers_never_make_the_receiving_side_busy() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    // A receiver that gives up after 1 s of waiting for the write lock.
    let mut receiver = Inbox::open(
        &path,
        Config::default().busy_timeout(Duration::from_secs(1)),
    )
    .unwrap();
    const BACKLOG: usize = 10;
    for i in 0..BACKLOG {
        let id = format!("old-{i}");
        assert!(matches!(
            receiver
                .receive(&Delivery::new("slow", &id, "t", b"x"))
                .unwrap(),
            Outcome::Received
        ));
    }

    let stop = Arc::new(AtomicBool::new(false));
    let handled = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (stop, handled, path) = (stop.clone(), handled.clone(), path.clone());
        std::thread::spawn(move || {
            let mut w =
                Worker::open(&path, Config::default(), "slow", WorkerConfig::default()).unwrap();
            w.run_until(&stop, &mut |tx: &mut Tx<'_>, _d: &Delivery<'_>| {
                // A slow effect, all of it under the write lock.
                std::thread::sleep(Duration::from_millis(200));
                let n: i64 = tx.get("n")?.unwrap_or(0);
                tx.put("n", &(n + 1))?;
                handled.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
        })
    };

    // Receive new deliveries the whole time the worker drains the backlog; every one must commit.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut received = 0;
    let mut failures = Vec::new();
    while handled.load(Ordering::SeqCst) < BACKLOG {
        assert!(
            Instant::now() < deadline,
            "the worker did not drain the backlog"
        );
        let id = format!("new-{received}");
        match receiver.receive(&Delivery::new("slow", &id, "t", b"y")) {
            Ok(o) => assert!(o.may_ack(), "{o:?}"),
            Err(e) => failures.push(format!("{id}: {e}")),
        }
        received += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::SeqCst);
    worker.join().unwrap().unwrap();
    assert!(
        failures.is_empty(),
        "receives that failed while the worker ran: {failures:?}"
    );
    assert!(received > 0);
}
