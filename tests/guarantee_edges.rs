//! Edges of the guarantee: a restarted producer in a watermark scope, the send time on the MQTT 5 path, a clock
//! that cannot be right, and keyed identity hashes (with a file of the previous schema version).

use std::time::Duration;

use edge_inbox::{
    inspect, Config, Delivery, ExtractIdentity, IdHash, Inbound, Inbox, Outcome, Pruning,
    RetentionPolicy, SequenceConflictCause, Status, UserProperty, SEQUENCE_WINDOW,
};

const DAY: i64 = 86_400;

fn ok(_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>) -> anyhow::Result<()> {
    Ok(())
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

#[test]
fn restarted_producer_is_quarantined_never_a_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let scope = "telemetry";
    inbox
        .set_retention(scope, &RetentionPolicy::new().sequence_watermarks(1))
        .unwrap();
    let ids: Vec<String> = (1..=10).map(|s| format!("boot1-{s}")).collect();
    let first: Vec<Delivery<'_>> = (1..=10u64)
        .map(|s| {
            Delivery::new(scope, &ids[s as usize - 1], "t", b"v1")
                .with_producer("p")
                .with_sequence(s)
        })
        .collect();
    let out = inbox.process_batch(&first, ok).unwrap();
    assert!(out.iter().all(|o| matches!(o, Outcome::Processed)));
    // The producer reboots without its counter: 1-5 again, new ids, new content.
    let ids2: Vec<String> = (1..=5).map(|s| format!("boot2-{s}")).collect();
    let again: Vec<Delivery<'_>> = (1..=5u64)
        .map(|s| {
            Delivery::new(scope, &ids2[s as usize - 1], "t", b"v2")
                .with_producer("p")
                .with_sequence(s)
        })
        .collect();
    for o in inbox.process_batch(&again, ok).unwrap() {
        assert!(
            matches!(
                o,
                Outcome::SequenceConflict {
                    cause: SequenceConflictCause::OtherMessage,
                    ..
                }
            ),
            "{o:?}"
        );
        assert!(o.may_ack(), "kept in quarantine");
    }
    let st = inbox.scope_stats(scope).unwrap();
    assert_eq!((st.sequence_conflicts, st.quarantined), (5, 5));
    let rep = inspect::stats(inbox.connection(), Some(scope)).unwrap();
    assert_eq!(rep[0].sequence_conflicts, 5);
    assert_eq!(
        inspect::quarantine(inbox.connection(), Some(scope), 10)
            .unwrap()
            .len(),
        5
    );
    // A true redelivery is still a duplicate; the same id with other content a conflict.
    assert!(matches!(
        inbox.process(&first[2], ok).unwrap(),
        Outcome::Duplicate
    ));
    let changed = Delivery::new(scope, &ids[3], "t", b"other")
        .with_producer("p")
        .with_sequence(4);
    assert!(matches!(
        inbox.process(&changed, ok).unwrap(),
        Outcome::Conflict { .. }
    ));
    // Below the window nothing can be compared: quarantined, not a silent duplicate.
    let more: Vec<String> = (11..=10 + SEQUENCE_WINDOW + 5)
        .map(|s| format!("boot1-{s}"))
        .collect();
    let batch: Vec<Delivery<'_>> = more
        .iter()
        .enumerate()
        .map(|(i, id)| {
            Delivery::new(scope, id, "t", b"v1")
                .with_producer("p")
                .with_sequence(11 + i as u64)
        })
        .collect();
    inbox.process_batch(&batch, ok).unwrap();
    assert!(matches!(
        inbox.process(&first[0], ok).unwrap(),
        Outcome::SequenceConflict {
            cause: SequenceConflictCause::BelowWindow,
            ..
        }
    ));
    let window: i64 = inbox
        .connection()
        .query_row("SELECT count(*) FROM watermark_recent", [], |r| r.get(0))
        .unwrap();
    assert_eq!(window as u64, SEQUENCE_WINDOW, "the window stays bounded");
}

#[test]
fn sent_at_property_makes_the_horizon_work_and_undated_identities_stay() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let scope = "orders";
    inbox
        .set_retention(
            scope,
            &RetentionPolicy::new()
                .identity_horizon(Duration::from_secs(DAY as u64))
                .clock_skew(Duration::ZERO),
        )
        .unwrap();
    let sent = now() - 10 * DAY;
    let dated = Inbound::new("orders/1", b"{}".to_vec())
        .with_user_property("message-id", "dated")
        .with_user_property("sent-at", sent.to_string());
    let undated =
        Inbound::new("orders/2", b"{}".to_vec()).with_user_property("message-id", "undated");
    let ex = UserProperty::default();
    let offer = |inbox: &mut Inbox, msg: &Inbound| {
        let id = ex.extract(msg).unwrap();
        let mut d = Delivery::new(scope, &id.message_id, &msg.topic, &msg.payload);
        if let Some(t) = id.sent_at {
            d = d.with_sent_at(t);
        }
        inbox.process(&d, ok).unwrap()
    };
    assert!(matches!(offer(&mut inbox, &dated), Outcome::Processed));
    assert!(matches!(offer(&mut inbox, &undated), Outcome::Processed));
    let later = now() + 3 * DAY;
    let report = inbox
        .prune(&Pruning::default().pause(Duration::ZERO).as_of(later))
        .unwrap();
    assert_eq!(report.identities_pruned, 1, "only the dated identity");
    // The dated redelivery is older than what was pruned: quarantined by the default policy, not applied.
    assert!(matches!(
        offer(&mut inbox, &dated),
        Outcome::Expired {
            quarantined: Some(_),
            ..
        }
    ));
    // The undated one kept its identity: still a duplicate.
    assert!(matches!(offer(&mut inbox, &undated), Outcome::Duplicate));
    assert_eq!(
        inspect::stats(inbox.connection(), Some(scope)).unwrap()[0].identities_undated,
        1
    );
}

#[test]
fn retention_does_not_act_on_a_clock_that_cannot_be_right() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let scope = "orders";
    inbox
        .set_retention(
            scope,
            &RetentionPolicy::new()
                .identity_horizon(Duration::from_secs(DAY as u64))
                .processed_payloads(Duration::ZERO),
        )
        .unwrap();
    let d = Delivery::new(scope, "booted-in-1970", "t", b"x").with_sent_at(5);
    assert!(matches!(inbox.process(&d, ok).unwrap(), Outcome::Processed));
    // As a gateway without a real-time clock stamps it: day 0.
    inbox
        .connection()
        .execute("UPDATE identities SET day = 0", [])
        .unwrap();
    let c = inspect::check(inbox.connection(), 10).unwrap();
    assert_eq!(c.identities_implausible_day, 1);
    assert_eq!(c.id_key, "keyed");
    // A prune while the clock still reads 1970 does nothing.
    let early = inbox
        .prune(&Pruning::default().pause(Duration::ZERO).as_of(DAY))
        .unwrap();
    assert!(early.clock_refused);
    assert_eq!(early.identities_pruned, 0);
    // After NTP: the identity is re-dated, not pruned at once.
    let fixed = inbox
        .prune(&Pruning::default().pause(Duration::ZERO))
        .unwrap();
    assert!(!fixed.clock_refused);
    assert_eq!(
        (fixed.identities_pruned, fixed.identities_restamped),
        (0, 1)
    );
    assert!(matches!(
        inbox.status(scope, None, "booted-in-1970").unwrap(),
        Status::Recorded { .. }
    ));
    assert_eq!(inbox.scope_stats(scope).unwrap().identities_restamped, 1);
    // A clock far ahead of the last accepted time is refused until trusted.
    inbox
        .connection()
        .execute(
            "UPDATE inbox_meta SET value = ?1 WHERE name = 'clock_seen'",
            [now() - 90 * DAY],
        )
        .unwrap();
    assert!(inspect::check(inbox.connection(), 10)
        .unwrap()
        .clock_warning
        .is_some());
    let ahead = inbox
        .prune(&Pruning::default().pause(Duration::ZERO))
        .unwrap();
    assert!(ahead.clock_refused);
    let trusted = inbox
        .prune(&Pruning::default().pause(Duration::ZERO).trust_clock(true))
        .unwrap();
    assert!(!trusted.clock_refused);
}

#[test]
fn identity_hashes_are_keyed_per_database() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = Inbox::open(dir.path().join("a.db"), Config::default()).unwrap();
    let b = Inbox::open(dir.path().join("b.db"), Config::default()).unwrap();
    assert!(a.id_key().is_keyed());
    // Nobody can compute the stored key without the database's secret.
    assert_ne!(a.id_hash(None, "evt-1"), IdHash::of(None, "evt-1"));
    assert_ne!(a.id_hash(None, "evt-1"), b.id_hash(None, "evt-1"));
    let d = Delivery::new("s", "evt-1", "t", b"x");
    a.process(&d, ok).unwrap();
    let rep = inspect::identity(a.connection(), "s", None, "evt-1").unwrap();
    assert_eq!(rep.status, "recorded");
    assert_eq!(rep.id_hash, a.id_hash(None, "evt-1").to_hex());
    assert!(matches!(a.process(&d, ok).unwrap(), Outcome::Duplicate));
}

#[test]
fn a_file_of_schema_version_1_keeps_its_identities() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v1.db");
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL; PRAGMA journal_mode = WAL;")
            .unwrap();
        conn.execute_batch(include_str!("fixtures/schema_v1.sql"))
            .unwrap();
        conn.execute_batch("PRAGMA user_version = 1").unwrap();
        conn.execute(
            "INSERT INTO scopes (id, name, created_at) VALUES (1, 's', 0)",
            [],
        )
        .unwrap();
        conn.execute(
            "INSERT INTO scope_stats (scope_id, processed) VALUES (1, 7)",
            [],
        )
        .unwrap();
        conn.execute(
            "INSERT INTO identities (scope_id, id_hash, fingerprint, day) VALUES (1, ?1, ?2, ?3)",
            (
                IdHash::of(Some("p"), "old-1").as_bytes(),
                edge_inbox::Fingerprint::of("t", b"x").0 as i64,
                now() / DAY,
            ),
        )
        .unwrap();
    }
    // Read-only tools see it before any migration.
    let ro = edge_inbox::open_read_only(&path).unwrap();
    assert_eq!(
        inspect::identity(&ro, "s", Some("p"), "old-1")
            .unwrap()
            .status,
        "recorded"
    );
    assert_eq!(inspect::stats(&ro, None).unwrap()[0].identities_retained, 1);
    drop(ro);
    let mut inbox = Inbox::open(&path, Config::default()).unwrap();
    assert_eq!(
        inspect::check(inbox.connection(), 10)
            .unwrap()
            .schema_version,
        edge_inbox::SCHEMA_VERSION
    );
    assert!(
        !inbox.id_key().is_keyed(),
        "old rows stay valid: the file stays unkeyed"
    );
    assert_eq!(
        inbox.scope_stats("s").unwrap().processed,
        7,
        "the migrated counters keep their figures"
    );
    let d = Delivery::new("s", "old-1", "t", b"x").with_producer("p");
    assert!(matches!(inbox.process(&d, ok).unwrap(), Outcome::Duplicate));
    let new = Delivery::new("s", "new-1", "t", b"x").with_producer("p");
    assert!(matches!(
        inbox.process(&new, ok).unwrap(),
        Outcome::Processed
    ));
    assert_eq!(inbox.scope_stats("s").unwrap().processed, 8);
    assert!(matches!(
        inbox.status("s", Some("p"), "old-1").unwrap(),
        Status::Recorded { .. }
    ));
    assert_eq!(
        inspect::check(inbox.connection(), 10).unwrap().id_key,
        "none"
    );
}
