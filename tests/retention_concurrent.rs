//! Pruning runs in short steps: a consumer on the same file keeps committing while it runs, never Busy.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use edge_inbox::{Config, Delivery, Inbox, Outcome, Pruning, RetentionPolicy, Synchronous};

#[test]
fn consumer_commits_while_pruning_runs() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let scope = "inventory-reservation";
    let n = common::scaled(10_000);

    // Many old processed bodies to prune.
    let mut setup = Inbox::open(&path, Config::default().synchronous(Synchronous::Normal)).unwrap();
    setup
        .set_retention(
            scope,
            &RetentionPolicy::new()
                .processed_payloads(Duration::from_secs(60))
                .identity_horizon(Duration::from_secs(86_400)),
        )
        .unwrap();
    let scope_id = setup.scope_id(scope).unwrap();
    {
        let conn = setup.connection();
        conn.execute_batch("BEGIN").unwrap();
        let mut stmt = conn
            .prepare(
                "INSERT INTO messages (scope_id, id_hash, message_id, topic, payload, state, received_at, finished_at) \
                 VALUES (?1, ?2, ?3, 'orders', zeroblob(200), 1, ?4, ?4)",
            )
            .unwrap();
        // Committed and finished on a day long past, in a database as old (retention re-dates, never prunes,
        // a time before the database existed).
        let day = edge_inbox::EARLIEST_PLAUSIBLE_TIME / 86_400;
        conn.execute(
            "UPDATE inbox_meta SET value = ?1 WHERE name = 'created_at'",
            [edge_inbox::EARLIEST_PLAUSIBLE_TIME],
        )
        .unwrap();
        let mut ident = conn
            .prepare("INSERT INTO identities (scope_id, id_hash, fingerprint, day) VALUES (?1, ?2, 0, ?3)")
            .unwrap();
        for i in 0..n {
            let id = format!("old-{i}");
            let h = setup.id_hash(None, &id);
            stmt.execute((
                scope_id,
                h.as_bytes(),
                &id,
                edge_inbox::EARLIEST_PLAUSIBLE_TIME,
            ))
            .unwrap();
            ident.execute((scope_id, h.as_bytes(), day)).unwrap();
        }
        drop((stmt, ident));
        conn.execute_batch("COMMIT").unwrap();
    }
    drop(setup);

    let pruning = Arc::new(AtomicBool::new(true));
    let during = Arc::new(AtomicU64::new(0));
    let started = Arc::new(AtomicBool::new(false));
    let consumer = {
        let (path, pruning, during, started) = (
            path.clone(),
            pruning.clone(),
            during.clone(),
            started.clone(),
        );
        std::thread::spawn(move || {
            let mut inbox = Inbox::open(&path, Config::default()).unwrap();
            let deadline = Instant::now() + Duration::from_secs(120);
            let mut i = 0u64;
            started.store(true, Ordering::SeqCst);
            while Instant::now() < deadline {
                let still = pruning.load(Ordering::SeqCst);
                let id = format!("new-{i}");
                let d = Delivery::new(scope, &id, "orders", b"{}");
                // Any error (Busy above all) fails the test.
                let outcome = inbox
                    .process(&d, |_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>| Ok(()))
                    .unwrap();
                assert!(matches!(outcome, Outcome::Processed));
                i += 1;
                // A consumer that is not saturated (one that is leaves no room for maintenance at all).
                std::thread::sleep(Duration::from_millis(2));
                if still {
                    during.fetch_add(1, Ordering::SeqCst);
                } else {
                    break;
                }
            }
            i
        })
    };
    assert!(common::wait_for(Duration::from_secs(30), || started
        .load(Ordering::SeqCst)
        .then_some(()))
    .is_some());

    let mut pruner = Inbox::open(&path, Config::default()).unwrap();
    let opts = Pruning::default()
        .batch(200)
        .pause(Duration::from_millis(1));
    let total = pruner.prune(&opts).unwrap();
    assert!(total.done);
    pruning.store(false, Ordering::SeqCst);
    let committed = consumer.join().expect("consumer never saw an error");

    assert_eq!(total.payloads_pruned, n as u64);
    assert_eq!(
        total.identities_pruned, n as u64,
        "old identities whose bodies were pruned first"
    );
    assert!(
        during.load(Ordering::SeqCst) > 0,
        "the consumer committed while pruning ran"
    );
    let mut check = Inbox::open(&path, Config::default()).unwrap();
    let stats = check.scope_stats(scope).unwrap();
    // The old rows stand for deliveries the strong case processed: pruning them does not change the count.
    assert_eq!(stats.processed, n as u64 + committed);
    let left: i64 = check
        .connection()
        .query_row("SELECT count(*) FROM identities", [], |r| r.get(0))
        .unwrap();
    assert_eq!(
        left as u64, committed,
        "the consumer's own identities are all retained"
    );
    assert!(matches!(
        check.status(scope, None, "new-0").unwrap(),
        edge_inbox::Status::Recorded { .. }
    ));
}
