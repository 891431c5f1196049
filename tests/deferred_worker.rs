//! Workers of the received-then-deferred mode: leases, retries, dead letters, requeue, ordering.
//! Several workers are several connections on one real database file.

mod deferred_support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deferred_support::*;
use edge_inbox::{
    Completion, Delivery, Error, MessageState, Outcome, Status, Tx, Worker, WorkerConfig,
};

fn worker(path: &std::path::Path, config: WorkerConfig) -> Worker {
    Worker::new(open(path), SCOPE, config).unwrap()
}

/// Runs `w` until nothing is claimable (bounded: panics after a minute); what it did in all.
fn drain(
    w: &mut Worker,
    handler: &mut impl FnMut(&mut Tx<'_>, &Delivery<'_>) -> anyhow::Result<()>,
) -> edge_inbox::Drained {
    let mut total = edge_inbox::Drained::default();
    until("nothing claimable", Duration::from_secs(60), || {
        let d = w.run_once(&mut *handler).unwrap();
        total.processed += d.processed;
        total.retrying += d.retrying;
        total.dead_lettered += d.dead_lettered;
        d.claimed == 0
    });
    total
}

/// The attempts recorded for message `id`.
fn attempts_of(inbox: &edge_inbox::Inbox, id: &str) -> i64 {
    inbox
        .connection()
        .query_row(
            "SELECT attempts FROM messages WHERE message_id = ?1",
            [id],
            |r| r.get(0),
        )
        .unwrap()
}

#[test]
fn live_lease_is_exclusive_and_expired_lease_is_reclaimed_and_stale_commit_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    receive_n(&mut inbox, 2);

    // A long lease keeps the message from everyone else.
    let mut holder = worker(
        &path,
        WorkerConfig::default()
            .lease(Duration::from_secs(3600))
            .owner("holder"),
    );
    let mut other = worker(&path, WorkerConfig::default().owner("other"));
    let held = holder.claim(1).unwrap();
    assert_eq!(held.len(), 1);
    // The claim ran without its own fsync; the connection is durable again for everything after it.
    let sync: i64 = holder
        .inbox()
        .connection()
        .query_row("PRAGMA synchronous", [], |r| r.get(0))
        .unwrap();
    assert_eq!(sync, 2);
    assert_eq!(held[0].message_id(), "m-0");
    let seen = other.claim(10).unwrap();
    assert_eq!(
        seen.iter().map(|c| c.message_id()).collect::<Vec<_>>(),
        ["m-1"]
    );
    assert_eq!(inbox.backlog(SCOPE).unwrap().in_flight, 2);
    other.release(&seen).unwrap();
    assert_eq!(
        inbox.backlog(SCOPE).unwrap().in_flight,
        1,
        "release gives the lease back"
    );

    // A short lease, abandoned (the worker stalls): it expires and another worker takes the message over.
    let mut stale = worker(
        &path,
        WorkerConfig::default()
            .lease(Duration::from_millis(200))
            .owner("stale"),
    );
    let stale_claims = stale.claim(10).unwrap();
    assert_eq!(
        stale_claims
            .iter()
            .map(|c| c.message_id())
            .collect::<Vec<_>>(),
        ["m-1"]
    );
    let mut taken = Vec::new();
    until("lease expiry", Duration::from_secs(30), || {
        taken = other.claim(10).unwrap();
        !taken.is_empty()
    });
    assert_eq!(taken[0].seq(), stale_claims[0].seq());
    let done = other.complete(&taken, &mut count_effect).unwrap();
    assert!(matches!(done[..], [Completion::Processed]), "{done:?}");

    // The stale worker wakes up and tries to commit: refused, its handler does not even run.
    let mut ran = false;
    let late = stale
        .complete(&stale_claims, &mut |tx: &mut Tx<'_>, d: &Delivery<'_>| {
            ran = true;
            count_effect(tx, d)
        })
        .unwrap();
    assert!(matches!(late[..], [Completion::LeaseLost]), "{late:?}");
    assert!(!ran);
    assert_eq!(effects(&inbox), (1, 1, 1));

    // Expired but not taken over: the late commit is refused too (the lease is what grants the right).
    let mut slow = worker(
        &path,
        WorkerConfig::default()
            .lease(Duration::from_millis(1))
            .owner("slow"),
    );
    // First let the holder's message go.
    holder.release(&held).unwrap();
    let slow_claims = slow.claim(10).unwrap();
    assert_eq!(slow_claims.len(), 1);
    std::thread::sleep(Duration::from_millis(20));
    let late = slow.complete(&slow_claims, &mut count_effect).unwrap();
    assert!(matches!(late[..], [Completion::LeaseLost]), "{late:?}");
    assert_eq!(effects(&inbox), (1, 1, 1));
    assert_eq!(other.run_once(&mut count_effect).unwrap().processed, 1);
    assert_eq!(effects(&inbox), (2, 2, 1));
    assert_eq!(states(&inbox), [0, 2, 0, 0]);
}

#[test]
fn poison_message_is_dead_lettered_after_max_attempts_and_requeue_processes_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    receive_n(&mut inbox, 10);
    let config = WorkerConfig::default()
        .max_attempts(3)
        .backoff(Duration::ZERO, Duration::ZERO)
        .batch(4);
    let mut w = worker(&path, config);
    let mut poisoned = true;
    let mut handler = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        count_effect(tx, d)?; // rolled back when the handler fails
        if poisoned && d.message_id == "m-3" {
            anyhow::bail!("cannot parse order {}", d.message_id);
        }
        Ok(())
    };
    let total = drain(&mut w, &mut handler);
    assert_eq!(
        (total.processed, total.retrying, total.dead_lettered),
        (9, 2, 1)
    );
    assert_eq!(
        effects(&inbox),
        (9, 9, 1),
        "the failing attempts left no effect"
    );
    assert_eq!(states(&inbox), [0, 9, 0, 1]);
    let dead = inbox.dead_letters(SCOPE, 10).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].message_id.as_str(), dead[0].attempts), ("m-3", 3));
    assert!(dead[0]
        .last_error
        .as_deref()
        .unwrap()
        .contains("cannot parse order m-3"));
    let stats = inbox.scope_stats(SCOPE).unwrap();
    assert_eq!(
        (stats.processed, stats.handler_failures, stats.dead_lettered),
        (9, 3, 1)
    );
    let b = inbox.backlog(SCOPE).unwrap();
    assert_eq!((b.pending, b.failed, b.dead_letters), (0, 0, 1));
    match inbox.status(SCOPE, None, "m-3").unwrap() {
        Status::Recorded { state, .. } => assert_eq!(state, Some(MessageState::DeadLettered)),
        s => panic!("{s:?}"),
    }
    // A redelivery of a dead letter is a duplicate: it is kept, not stored twice.
    assert!(matches!(
        inbox
            .receive(&Delivery::new(SCOPE, "m-3", "t/orders", b"{\"i\":3}"))
            .unwrap(),
        Outcome::Duplicate
    ));

    // Fixed handler, requeue: attempts reset, processed exactly once.
    poisoned = false;
    assert_eq!(inbox.requeue_dead_letters(SCOPE).unwrap(), 1);
    assert_eq!(inbox.requeue_dead_letters(SCOPE).unwrap(), 0);
    let attempts = attempts_of(&inbox, "m-3");
    assert_eq!(attempts, 0);
    let mut handler = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        assert!(!poisoned);
        count_effect(tx, d)
    };
    assert_eq!(w.run_once(&mut handler).unwrap().processed, 1);
    assert_eq!(effects(&inbox), (10, 10, 1));
    assert_eq!(states(&inbox), [0, 10, 0, 0]);
}

#[test]
fn requeue_by_seq_covers_dead_letters_written_by_the_strong_case_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    let scope_id = inbox.scope_id(SCOPE).unwrap();
    // What a strong-case dead-letter path leaves: a body in state 3 whose identity was rolled back with the
    // failed attempt.
    let d = Delivery::new(SCOPE, "strong-7", "orders/7", b"{\"qty\":7}").with_producer("shop");
    inbox
        .connection()
        .execute(
            "INSERT INTO messages (scope_id, id_hash, producer, message_id, topic, payload, state, attempts, last_error, \
             received_at, finished_at) VALUES (?1, ?2, 'shop', 'strong-7', 'orders/7', ?3, 3, 1, 'boom', 0, 0)",
            (scope_id, d.id_hash(inbox.id_key()).as_bytes(), d.payload),
        )
        .unwrap();
    let seq: i64 = inbox
        .connection()
        .query_row("SELECT seq FROM messages", [], |r| r.get(0))
        .unwrap();
    assert!(!inbox.requeue_dead_letter(seq + 1).unwrap());
    assert!(inbox.requeue_dead_letter(seq).unwrap());
    assert!(
        !inbox.requeue_dead_letter(seq).unwrap(),
        "no longer a dead letter"
    );

    let mut w = worker(&path, WorkerConfig::default());
    let mut seen = None;
    let drained = w
        .run_once(&mut |tx: &mut Tx<'_>, got: &Delivery<'_>| {
            seen = Some((
                got.producer.map(str::to_owned),
                got.topic.to_owned(),
                got.payload.to_vec(),
            ));
            count_effect(tx, got)
        })
        .unwrap();
    assert_eq!(drained.processed, 1);
    assert_eq!(
        seen,
        Some((
            Some("shop".into()),
            "orders/7".into(),
            b"{\"qty\":7}".to_vec()
        ))
    );
    // The worker restored the identity with the effect: the broker's redelivery is now a duplicate.
    assert!(matches!(
        inbox.process(&d, count_effect).unwrap(),
        Outcome::Duplicate
    ));
    assert_eq!(effects(&inbox), (1, 1, 1));
}

#[test]
fn failed_message_waits_for_its_backoff() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    receive_n(&mut inbox, 1);
    let config =
        WorkerConfig::default().backoff(Duration::from_secs(3600), Duration::from_secs(7200));
    assert_eq!(config.backoff_after(1), Duration::from_secs(3600));
    assert_eq!(config.backoff_after(3), Duration::from_secs(7200));
    let mut w = worker(&path, config);
    let claims = w.claim(1).unwrap();
    let done = w
        .complete(&claims, &mut |_: &mut Tx<'_>, _: &Delivery<'_>| {
            anyhow::bail!("not yet")
        })
        .unwrap();
    match &done[..] {
        [Completion::Retrying {
            attempts: 1,
            retry_in,
            ..
        }] => assert_eq!(*retry_in, Duration::from_secs(3600)),
        other => panic!("{other:?}"),
    }
    assert_eq!(states(&inbox), [0, 0, 1, 0]);
    assert!(
        w.claim(10).unwrap().is_empty(),
        "not claimable during its backoff"
    );
    let b = inbox.backlog(SCOPE).unwrap();
    assert_eq!((b.pending, b.failed, b.in_flight), (0, 1, 0));
    assert!(
        b.oldest_pending_age.is_some(),
        "a failed message is still unprocessed work"
    );
    // Backoff over (moved into the past): claimable again, and processed.
    inbox
        .connection()
        .execute("UPDATE messages SET not_before = 0", [])
        .unwrap();
    assert_eq!(w.run_once(&mut count_effect).unwrap().processed, 1);
    assert_eq!(states(&inbox), [0, 1, 0, 0]);
}

#[test]
fn storage_error_consumes_no_attempt_and_commits_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    inbox
        .connection()
        .execute_batch("CREATE TABLE blobs (b BLOB)")
        .unwrap();
    receive_n(&mut inbox, 3);
    let mut w = worker(&path, WorkerConfig::default().max_attempts(1));
    // A real SQLITE_FULL: cap this connection's database size just above what it holds.
    let pages: i64 = w
        .inbox()
        .connection()
        .query_row("PRAGMA page_count", [], |r| r.get(0))
        .unwrap();
    w.inbox()
        .connection()
        .execute_batch(&format!("PRAGMA max_page_count = {}", pages + 2))
        .unwrap();
    let mut big = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        count_effect(tx, d)?;
        tx.sql()
            .execute("INSERT INTO blobs (b) VALUES (zeroblob(1000000))", [])?;
        Ok(())
    };
    let err = w.run_once(&mut big).unwrap_err();
    assert!(matches!(err, Error::DiskFull), "{err:?}");
    assert_eq!(
        states(&inbox),
        [3, 0, 0, 0],
        "not failed, not dead-lettered (max_attempts is 1)"
    );
    assert_eq!(effects(&inbox), (0, 0, 0));
    let attempts: i64 = inbox
        .connection()
        .query_row("SELECT max(attempts) FROM messages", [], |r| r.get(0))
        .unwrap();
    assert_eq!(attempts, 0);
    assert_eq!(
        inbox.backlog(SCOPE).unwrap().in_flight,
        0,
        "leases were given back"
    );
    assert_eq!(inbox.scope_stats(SCOPE).unwrap().handler_failures, 0);
    // The cause goes away: everything is applied.
    w.inbox()
        .connection()
        .execute_batch("PRAGMA max_page_count = 1073741823")
        .unwrap();
    assert_eq!(w.run_once(&mut big).unwrap().processed, 3);
    assert_eq!(effects(&inbox), (3, 3, 1));
}

#[test]
fn handler_ending_the_transaction_costs_its_message_an_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    receive_n(&mut inbox, 1);
    let config = WorkerConfig::default().backoff(Duration::ZERO, Duration::ZERO);
    let mut w = worker(&path, config);
    let d = w
        .run_once(&mut |tx: &mut Tx<'_>, _: &Delivery<'_>| {
            tx.sql().execute_batch("ROLLBACK")?;
            Ok(())
        })
        .unwrap();
    assert_eq!((d.processed, d.retrying), (0, 1));
    assert_eq!(states(&inbox), [0, 0, 1, 0]);
    assert_eq!(effects(&inbox), (0, 0, 0));
    assert_eq!(w.run_once(&mut count_effect).unwrap().processed, 1);
    assert_eq!(effects(&inbox), (1, 1, 1));
}

/// A message whose handler always ends the transaction (a trigger of the application's rolls it back on bad
/// data) or always interrupts its own read: each is dead-lettered after its attempts, and the messages behind
/// it, claimed in the same batches, are applied once each.
#[test]
fn a_handler_that_always_ends_or_interrupts_its_transaction_dead_letters_one_message_not_the_worker(
) {
    for poison in ["trigger", "interrupt"] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inbox.db");
        let mut inbox = open(&path);
        inbox
            .connection()
            .execute_batch(
                "CREATE TABLE seen (message_id TEXT PRIMARY KEY);
                 CREATE TRIGGER poison BEFORE INSERT ON seen WHEN NEW.message_id = 'm-0'
                 BEGIN SELECT RAISE(ROLLBACK, 'poison'); END;",
            )
            .unwrap();
        receive_n(&mut inbox, 5);
        let config = WorkerConfig::default()
            .max_attempts(2)
            .backoff(Duration::ZERO, Duration::ZERO)
            .batch(5);
        let mut w = worker(&path, config);
        let mut handler = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
            count_effect(tx, d)?;
            if poison == "interrupt" && d.message_id == "m-0" {
                // A guard on a slow query that always fires: the read is interrupted, the error returned.
                tx.sql().progress_handler(1, Some(|| true)).unwrap();
                let read = tx
                    .sql()
                    .query_row("SELECT count(*) FROM effects", [], |r| r.get::<_, i64>(0));
                tx.sql().progress_handler(1, None::<fn() -> bool>).unwrap();
                read?;
            }
            tx.sql()
                .execute("INSERT INTO seen (message_id) VALUES (?1)", [d.message_id])?;
            Ok(())
        };
        let total = drain(&mut w, &mut handler);
        assert_eq!(
            (total.processed, total.retrying, total.dead_lettered),
            (4, 1, 1),
            "{poison}"
        );
        assert_eq!(effects(&inbox), (4, 4, 1), "{poison}");
        assert_eq!(states(&inbox), [0, 4, 0, 1], "{poison}");
        let dead = inbox.dead_letters(SCOPE, 10).unwrap();
        assert_eq!(
            (dead[0].message_id.as_str(), dead[0].attempts),
            ("m-0", 2),
            "{poison}"
        );
        let stats = inbox.scope_stats(SCOPE).unwrap();
        assert_eq!(
            (stats.processed, stats.handler_failures, stats.dead_lettered),
            (4, 2, 1),
            "{poison}"
        );
    }
}

/// Receives `keys * per_key` messages, interleaved across keys; payload = position within its key.
fn receive_ordered(inbox: &mut edge_inbox::Inbox, keys: usize, per_key: usize) {
    let mut ids = Vec::new();
    let mut payloads = Vec::new();
    let mut key_names = Vec::new();
    for n in 0..per_key {
        for k in 0..keys {
            ids.push(format!("k{k}-{n}"));
            payloads.push(n.to_string());
            key_names.push(format!("k{k}"));
        }
    }
    let mut outcomes = Vec::new();
    for start in (0..ids.len()).step_by(50) {
        let end = (start + 50).min(ids.len());
        let batch: Vec<_> = (start..end)
            .map(|i| Delivery::new(SCOPE, &ids[i], "t", payloads[i].as_bytes()))
            .collect();
        let keys: Vec<_> = (start..end).map(|i| Some(key_names[i].as_str())).collect();
        inbox
            .receive_batch_ordered_into(&batch, &keys, &mut outcomes)
            .unwrap();
    }
}

/// Checks arrival order per key: records a violation instead of failing, so the effect stays countable.
fn ordered_effect(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let key = d.message_id.split('-').next().unwrap();
    let n: i64 = std::str::from_utf8(d.payload)?.parse()?;
    let last: i64 = tx.sql().query_row(
        "SELECT coalesce((SELECT n FROM last_seen WHERE order_key = ?1), -1)",
        [key],
        |r| r.get(0),
    )?;
    if n != last + 1 {
        tx.sql().execute(
            "INSERT INTO violations VALUES (?1, ?2, ?3)",
            (key, last + 1, n),
        )?;
    }
    tx.sql()
        .execute("INSERT OR REPLACE INTO last_seen VALUES (?1, ?2)", (key, n))?;
    count_effect(tx, d)
}

#[test]
fn order_key_blocks_later_messages_until_the_earlier_one_is_done() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    receive_ordered(&mut inbox, 2, 3);
    inbox
        .receive(&Delivery::new(SCOPE, "free", "t", b"x"))
        .unwrap();
    let mut a = worker(&path, WorkerConfig::default().max_attempts(1));
    let mut b = worker(&path, WorkerConfig::default());
    // Only the head of each key (and the unordered message) is claimable.
    let head = a.claim(100).unwrap();
    assert_eq!(
        head.iter().map(|c| c.message_id()).collect::<Vec<_>>(),
        ["k0-0", "k1-0", "free"]
    );
    assert!(
        b.claim(100).unwrap().is_empty(),
        "later messages wait for the in-flight heads"
    );
    // k0's head fails for good: dead letters stop blocking, so k0-1 becomes claimable; k1-0 is processed.
    let done = a
        .complete(
            &head,
            &mut |tx: &mut Tx<'_>, d: &Delivery<'_>| match d.message_id {
                "k0-0" => anyhow::bail!("poison"),
                "free" => count_effect(tx, d),
                _ => ordered_effect(tx, d),
            },
        )
        .unwrap();
    assert!(
        matches!(
            done[..],
            [
                Completion::DeadLettered { .. },
                Completion::Processed,
                Completion::Processed
            ]
        ),
        "{done:?}"
    );
    let next = b.claim(100).unwrap();
    assert_eq!(
        next.iter().map(|c| c.message_id()).collect::<Vec<_>>(),
        ["k0-1", "k1-1"]
    );
    b.release(&next).unwrap();
    // Requeued, the dead letter is again the head of k0 and blocks k0-1.
    assert_eq!(inbox.requeue_dead_letters(SCOPE).unwrap(), 1);
    let next = b.claim(100).unwrap();
    assert_eq!(
        next.iter().map(|c| c.message_id()).collect::<Vec<_>>(),
        ["k0-0", "k1-1"]
    );
}

#[test]
fn per_key_order_holds_under_concurrent_workers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    let (keys, per_key) = (6, scaled_per_key());
    receive_ordered(&mut inbox, keys, per_key);
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..3)
        .map(|i| {
            let path = path.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let config = WorkerConfig::default()
                    .batch(1 + i * 3)
                    .idle_wait(Duration::from_millis(5));
                let mut w = worker(&path, config);
                // Workers dawdle between claim and commit, so claims of different workers overlap and
                // later claims often commit first: only the order key keeps a key's messages in order.
                let mut rng = Lcg::seeded();
                let mut processed = 0;
                while !stop.load(Ordering::Relaxed) {
                    let claims = match w.claim(1 + i * 3) {
                        Ok(c) => c,
                        Err(e) if e.is_retryable() => continue,
                        Err(e) => panic!("{e}"),
                    };
                    if claims.is_empty() {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    }
                    std::thread::sleep(Duration::from_millis(rng.below(4)));
                    let done = w.complete(&claims, &mut ordered_effect).unwrap();
                    processed += done
                        .iter()
                        .filter(|c| matches!(c, Completion::Processed))
                        .count();
                }
                processed
            })
        })
        .collect();
    until("drain", Duration::from_secs(120), || {
        inbox.backlog(SCOPE).unwrap().pending == 0
    });
    stop.store(true, Ordering::Relaxed);
    let processed: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let total = (keys * per_key) as i64;
    assert_eq!(processed as i64, total);
    assert_eq!(effects(&inbox), (total, total, 1));
    let violations: i64 = inbox
        .connection()
        .query_row("SELECT count(*) FROM violations", [], |r| r.get(0))
        .unwrap();
    assert_eq!(
        violations, 0,
        "a message ran before an earlier one with its key"
    );
}

fn scaled_per_key() -> usize {
    let scale: f64 = std::env::var("EDGE_INBOX_TEST_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0);
    ((40.0 * scale) as usize).max(5)
}

#[test]
fn run_until_drains_and_stops_when_told() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    receive_n(&mut inbox, 50);
    let stop = Arc::new(AtomicBool::new(false));
    let thread = {
        let (path, stop) = (path.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut w = worker(
                &path,
                WorkerConfig::default().idle_wait(Duration::from_millis(5)),
            );
            w.run_until(&stop, &mut count_effect).unwrap()
        })
    };
    until("drain", Duration::from_secs(60), || {
        inbox.backlog(SCOPE).unwrap().pending == 0
    });
    // Work arriving while it idles is picked up too.
    receive_n_from(&mut inbox, 50, 10);
    until("drain", Duration::from_secs(60), || {
        inbox.backlog(SCOPE).unwrap().pending == 0
    });
    stop.store(true, Ordering::Relaxed);
    let drained = thread.join().unwrap();
    assert_eq!((drained.claimed, drained.processed), (60, 60));
    assert_eq!(effects(&inbox), (60, 60, 1));
}

fn receive_n_from(inbox: &mut edge_inbox::Inbox, start: usize, n: usize) {
    for i in start..start + n {
        let id = format!("m-{i}");
        assert!(matches!(
            inbox
                .receive(&Delivery::new(SCOPE, &id, "t", b"{}"))
                .unwrap(),
            Outcome::Received
        ));
    }
}

#[test]
fn worker_survives_a_panicking_handler_and_commits_nothing_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    receive_n(&mut inbox, 3);
    let mut w = worker(
        &path,
        WorkerConfig::default().lease(Duration::from_secs(3600)),
    );
    let claims = w.claim(10).unwrap();
    assert_eq!(claims.len(), 3);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        w.complete(&claims, &mut |tx: &mut Tx<'_>,
                                  d: &Delivery<'_>|
         -> anyhow::Result<()> {
            count_effect(tx, d)?;
            if d.message_id == "m-1" {
                panic!("handler bug");
            }
            Ok(())
        })
    }));
    assert!(panicked.is_err());
    // The same worker goes on with the same (still leased) claims; the interrupted batch left no effect and no
    // state change behind.
    let done = w.complete(&claims, &mut count_effect).unwrap();
    assert!(
        done.iter().all(|c| matches!(c, Completion::Processed)),
        "{done:?}"
    );
    assert_eq!(effects(&inbox), (3, 3, 1));
    assert_eq!(states(&inbox), [0, 3, 0, 0]);
}

/// A handler whose writes break a deferred foreign key makes the batch's `COMMIT` fail. The worker then
/// applies the claims one per transaction, and the message at fault counts failed attempts until it is
/// dead-lettered, as a handler error would; the others are processed, and the worker never stops.
#[test]
fn a_refused_commit_costs_the_message_at_fault_an_attempt_not_the_worker_its_run() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    inbox
        .connection()
        .execute_batch(
            "CREATE TABLE parents (id INTEGER PRIMARY KEY);
             INSERT INTO parents (id) VALUES (1);
             CREATE TABLE children (message_id TEXT PRIMARY KEY,
                 parent INTEGER NOT NULL REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED);",
        )
        .unwrap();
    receive_n(&mut inbox, 10);
    let config = WorkerConfig::default()
        .max_attempts(3)
        .backoff(Duration::ZERO, Duration::ZERO)
        .batch(4);
    let mut w = worker(&path, config);
    // Foreign keys are enforced per connection.
    w.inbox()
        .connection()
        .execute_batch("PRAGMA foreign_keys = ON")
        .unwrap();
    let mut handler = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
        count_effect(tx, d)?;
        let parent = if d.message_id == "m-3" { 999 } else { 1 };
        tx.sql().execute(
            "INSERT INTO children (message_id, parent) VALUES (?1, ?2)",
            (d.message_id, parent),
        )?;
        Ok(())
    };
    let total = drain(&mut w, &mut handler);
    assert_eq!(
        (total.processed, total.retrying, total.dead_lettered),
        (9, 2, 1)
    );
    assert_eq!(
        effects(&inbox),
        (9, 9, 1),
        "the refused commits left no effect"
    );
    let children: i64 = inbox
        .connection()
        .query_row("SELECT count(*) FROM children", [], |r| r.get(0))
        .unwrap();
    assert_eq!(children, 9);
    assert_eq!(states(&inbox), [0, 9, 0, 1]);
    let dead = inbox.dead_letters(SCOPE, 10).unwrap();
    assert_eq!((dead[0].message_id.as_str(), dead[0].attempts), ("m-3", 3));
    assert!(
        dead[0]
            .last_error
            .as_deref()
            .unwrap()
            .contains("COMMIT refused by a deferred constraint"),
        "{:?}",
        dead[0].last_error
    );
    let stats = inbox.scope_stats(SCOPE).unwrap();
    assert_eq!(
        (stats.processed, stats.handler_failures, stats.dead_lettered),
        (9, 3, 1)
    );
}

/// A dead letter requeued while a worker holds the lease on a later message of its key still runs first: the
/// later claim gives its lease back at commit instead of being applied (no attempt consumed, claimable again
/// at once, so nothing waits for the lease to expire), and the key is applied in arrival order, each once.
#[test]
fn a_dead_letter_requeued_while_a_later_message_of_its_key_is_leased_runs_first() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = open(&path);
    // `ordered_effect` reads the key from the id and the position within it from the payload.
    for (id, n) in [("k-1", "0"), ("k-2", "1")] {
        let d = Delivery::new(SCOPE, id, "t", n.as_bytes());
        assert!(matches!(
            inbox.receive_ordered(&d, Some("K")).unwrap(),
            Outcome::Received
        ));
    }
    let mut a = worker(&path, WorkerConfig::default().max_attempts(1));
    let mut b = worker(&path, WorkerConfig::default());
    let ids = |claims: &[edge_inbox::Claim]| {
        claims
            .iter()
            .map(|c| c.message_id().to_owned())
            .collect::<Vec<_>>()
    };
    let first = a.claim(10).unwrap();
    assert_eq!(ids(&first), ["k-1"]);
    let done = a
        .complete(&first, &mut |_: &mut Tx<'_>, _: &Delivery<'_>| {
            anyhow::bail!("poison")
        })
        .unwrap();
    assert!(
        matches!(done[..], [Completion::DeadLettered { .. }]),
        "{done:?}"
    );
    // The dead letter stops blocking its key: worker A takes k-2. Then the operator requeues k-1.
    let held = a.claim(10).unwrap();
    assert_eq!(ids(&held), ["k-2"]);
    assert_eq!(inbox.requeue_dead_letters(SCOPE).unwrap(), 1);
    let taken = b.claim(10).unwrap();
    assert_eq!(ids(&taken), ["k-1"]);

    // A commits first: k-2 must not be applied before the open, earlier k-1.
    let done_a = a.complete(&held, &mut ordered_effect).unwrap();
    let done_b = b.complete(&taken, &mut ordered_effect).unwrap();
    let drained = drain(&mut a, &mut ordered_effect);
    let violations: i64 = inbox
        .connection()
        .query_row("SELECT count(*) FROM violations", [], |r| r.get(0))
        .unwrap();
    assert_eq!(violations, 0, "k-2 was applied before k-1");
    assert_eq!(effects(&inbox), (2, 2, 1));
    assert!(matches!(done_a[..], [Completion::LeaseLost]), "{done_a:?}");
    assert!(matches!(done_b[..], [Completion::Processed]), "{done_b:?}");
    assert_eq!(drained.processed, 1);
    assert_eq!(states(&inbox), [0, 2, 0, 0]);
    let attempts = attempts_of(&inbox, "k-2");
    assert_eq!(attempts, 0, "giving way is not a failure");
}
