//! Payload pruning: processed and dead-lettered bodies go after their age, identities stay, and pending or
//! failed work is never touched.

mod common;

use std::time::Duration;

use edge_inbox::{Config, Delivery, IdHash, Inbox, Outcome, Pruning, RetentionPolicy};
use rusqlite::Connection;

const HOUR: i64 = 3_600;
const DAY: i64 = 86_400;

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// A stored message body as the received-then-deferred mode leaves it.
pub fn insert_message(
    conn: &Connection,
    scope_id: i64,
    id: &str,
    payload: &[u8],
    state: i64,
    finished_at: i64,
) {
    conn.execute(
        "INSERT INTO messages (scope_id, id_hash, producer, message_id, topic, payload, state, received_at, \
         finished_at) VALUES (?1, ?2, NULL, ?3, 't', ?4, ?5, ?6, ?7)",
        (scope_id, IdHash::of(None, id).as_bytes(), id, payload, state, finished_at - 60, finished_at),
    )
    .unwrap();
}

fn count(conn: &Connection, sql: &str) -> i64 {
    conn.query_row(sql, [], |r| r.get(0)).unwrap()
}

fn noop(_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>) -> anyhow::Result<()> {
    Ok(())
}

#[test]
fn pruned_payloads_keep_identities_and_spare_pending_and_failed_work() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    let scope = "inventory-reservation";
    let policy = RetentionPolicy::new()
        .processed_payloads(Duration::from_secs(HOUR as u64))
        .dead_letter_payloads(Duration::from_secs(DAY as u64));
    inbox.set_retention(scope, &policy).unwrap();
    assert_eq!(inbox.retention(scope).unwrap(), policy);
    let scope_id = inbox.scope_id(scope).unwrap();

    let n = common::scaled(2_000);
    let ids: Vec<String> = (0..n)
        .map(|i| format!("evt-{i:06}-created-by-gateway"))
        .collect();
    let payloads: Vec<Vec<u8>> = (0..n)
        .map(|i| format!("{{\"order\":{i},\"qty\":1}}").into_bytes())
        .collect();
    let deliveries: Vec<Delivery<'_>> = ids
        .iter()
        .zip(&payloads)
        .map(|(id, p)| Delivery::new(scope, id, "orders", p))
        .collect();
    for chunk in deliveries.chunks(500) {
        let outcomes = inbox.process_batch(chunk, noop).unwrap();
        assert!(outcomes.iter().all(|o| matches!(o, Outcome::Processed)));
    }

    // Bodies by state and age: i % 6 picks the case.
    let t = now();
    let kinds = [
        (1, t - 2 * HOUR), // processed, old: pruned
        (1, t - 60),       // processed, young: kept
        (3, t - 2 * DAY),  // dead-lettered, old: pruned
        (3, t - 2 * HOUR), // dead-lettered, young: kept
        (0, t - 9 * DAY),  // pending: never pruned
        (2, t - 9 * DAY),  // failed: never pruned
    ];
    {
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch("BEGIN").unwrap();
        // The file is as old as its oldest body: retention takes a finish before the file's creation for a
        // wrong clock's.
        conn.execute(
            "UPDATE inbox_meta SET value = ?1 WHERE name = 'created_at'",
            [t - 30 * DAY],
        )
        .unwrap();
        // Grouped by kind, as bodies of one age sit together in practice, so pruning frees whole pages.
        for kind in 0..kinds.len() {
            for (_, (id, p)) in ids
                .iter()
                .zip(&payloads)
                .enumerate()
                .filter(|(i, _)| i % kinds.len() == kind)
            {
                let (state, at) = kinds[kind];
                insert_message(&conn, scope_id, id, p, state, at);
            }
        }
        conn.execute_batch("COMMIT").unwrap();
    }
    let expect = |k: usize| (0..n).filter(|i| i % kinds.len() == k).count() as u64;

    let report = inbox
        .prune(
            &Pruning::default()
                .batch(97)
                .pause(Duration::ZERO)
                .truncate_wal(true),
        )
        .unwrap();
    assert!(report.done);
    assert_eq!(report.payloads_pruned, expect(0));
    assert_eq!(report.dead_letters_pruned, expect(2));
    assert_eq!(
        report.identities_pruned, 0,
        "no identity horizon: identities are kept forever"
    );
    assert!(
        report.pages_reclaimed > 0,
        "freed pages are given back: {report:?}"
    );

    let conn = inbox.connection();
    // Left: the young processed (kind 1) and dead-lettered (kind 3) bodies, and all pending and failed ones.
    for (state, kind) in [(1, 1), (3, 3), (0, 4), (2, 5)] {
        let left = count(
            conn,
            &format!("SELECT count(*) FROM messages WHERE state = {state}"),
        ) as u64;
        assert_eq!(left, expect(kind), "messages left in state {state}");
    }
    assert_eq!(count(conn, "SELECT count(*) FROM identities") as usize, n);
    assert_eq!(count(conn, "PRAGMA freelist_count"), 0);
    let stats = inbox.scope_stats(scope).unwrap();
    assert_eq!(stats.payloads_pruned, expect(0) + expect(2));
    assert_eq!(
        std::fs::metadata(dir.path().join("inbox.db-wal"))
            .unwrap()
            .len(),
        0,
        "WAL truncated"
    );

    // Every redelivery of a retained identity is still a duplicate; other content is still a conflict.
    for chunk in deliveries.chunks(500) {
        let outcomes = inbox.process_batch(chunk, noop).unwrap();
        assert!(
            outcomes.iter().all(|o| matches!(o, Outcome::Duplicate)),
            "{outcomes:?}"
        );
    }
    let changed = Delivery::new(scope, &ids[0], "orders", b"{\"order\":0,\"qty\":2}");
    assert!(matches!(
        inbox.process(&changed, noop).unwrap(),
        Outcome::Conflict { .. }
    ));

    // A second pass finds nothing more to do and still spares the pending and failed rows.
    let again = inbox
        .prune(&Pruning::default().pause(Duration::ZERO))
        .unwrap();
    assert_eq!(again.payloads_pruned + again.dead_letters_pruned, 0);
    let conn = inbox.connection();
    assert_eq!(
        count(conn, "SELECT count(*) FROM messages WHERE state IN (0, 2)") as u64,
        expect(4) + expect(5)
    );
}

#[test]
fn scopes_without_a_policy_are_not_pruned() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    let kept = inbox.scope_id("audit").unwrap();
    inbox
        .set_retention(
            "cache",
            &RetentionPolicy::new().processed_payloads(Duration::ZERO),
        )
        .unwrap();
    let pruned = inbox.scope_id("cache").unwrap();
    let old = now() - 30 * DAY;
    insert_message(inbox.connection(), kept, "a", b"x", 1, old);
    insert_message(inbox.connection(), pruned, "a", b"x", 1, old);
    let report = inbox
        .prune(&Pruning::default().pause(Duration::ZERO))
        .unwrap();
    assert_eq!(report.payloads_pruned, 1);
    assert_eq!(
        count(inbox.connection(), "SELECT count(*) FROM messages"),
        1
    );
    assert_eq!(
        count(inbox.connection(), "SELECT scope_id FROM messages"),
        kept
    );
}
