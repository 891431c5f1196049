//! Sequence watermarks: exact deduplication under reordering, repeats and handler failures, in O(producers)
//! space.

use std::collections::HashSet;

use edge_inbox::{Config, Delivery, Error, Inbox, Outcome, RetentionPolicy, Synchronous};
use proptest::prelude::*;

fn cases() -> u32 {
    let scale: f64 = std::env::var("EDGE_INBOX_TEST_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0);
    ((24.0 * scale).round() as u32).max(2)
}

const PRODUCERS: [&str; 3] = ["sensor-a", "sensor-b", "sensor-c"];

/// One offered delivery: producer index, sequence, and whether the handler refuses it this time.
type Offer = (usize, u64, bool);

fn offers() -> impl Strategy<Value = (Vec<Offer>, Vec<usize>)> {
    (
        prop::collection::vec(1u64..40, 3),
        prop::collection::vec(1usize..12, 1..20),
    )
        .prop_flat_map(|(lens, batches)| {
            let mut all: Vec<(usize, u64)> = Vec::new();
            for (p, n) in lens.iter().enumerate() {
                all.extend((1..=*n).map(|s| (p, s)));
            }
            let len = all.len();
            // Every sequence at least once, some twice or more; shuffled; some refused by the handler.
            (
                Just(all),
                prop::collection::vec((0..len, any::<bool>()), 0..len),
                prop::collection::vec(prop::bool::weighted(0.1), len * 2 + 1),
                Just(batches),
            )
                .prop_flat_map(|(all, repeats, fails, batches)| {
                    let mut list: Vec<Offer> = all.iter().map(|&(p, s)| (p, s, false)).collect();
                    for (i, _) in &repeats {
                        let (p, s) = all[*i];
                        list.push((p, s, false));
                    }
                    for (o, f) in list.iter_mut().zip(&fails) {
                        o.2 = *f;
                    }
                    // A refused offer must come back later, so every sequence ends up processed.
                    let retries: Vec<Offer> = list
                        .iter()
                        .filter(|o| o.2)
                        .map(|&(p, s, _)| (p, s, false))
                        .collect();
                    (Just(list).prop_shuffle(), Just(retries), Just(batches))
                })
                .prop_map(|(mut list, retries, batches)| {
                    list.extend(retries);
                    (list, batches)
                })
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn watermark_dedup_is_exact((list, batches) in offers()) {
        let dir = tempfile::tempdir().unwrap();
        let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default().synchronous(Synchronous::Normal)).unwrap();
        let scope = "telemetry";
        inbox.set_retention(scope, &RetentionPolicy::new().sequence_watermarks(1)).unwrap();

        let ids: Vec<String> = list.iter().map(|(p, s, _)| format!("{}-{s}", PRODUCERS[*p])).collect();
        let mut done: HashSet<(usize, u64)> = HashSet::new();
        let mut effects: Vec<(usize, u64)> = Vec::new();
        let mut at = 0;
        let mut b = 0;
        while at < list.len() {
            let n = batches[b % batches.len()].min(list.len() - at);
            b += 1;
            let chunk = &list[at..at + n];
            let deliveries: Vec<Delivery<'_>> = chunk
                .iter()
                .zip(&ids[at..at + n])
                .map(|((p, s, fail), id)| {
                    // The refusal travels in the payload: a refused repeat of a processed sequence is then other
                    // content under the same id, which the window of recent sequences reports as a conflict.
                    let payload: &[u8] = if *fail { b"refuse" } else { b"ok" };
                    Delivery::new(scope, id, "t", payload).with_producer(PRODUCERS[*p]).with_sequence(*s)
                })
                .collect();
            let mut applied = Vec::new();
            let outcomes = inbox
                .process_batch(&deliveries, |_: &mut edge_inbox::Tx<'_>, d: &Delivery<'_>| {
                    if d.payload == b"refuse" {
                        anyhow::bail!("refused");
                    }
                    let p = PRODUCERS.iter().position(|n| Some(*n) == d.producer).unwrap();
                    applied.push((p, d.sequence.unwrap()));
                    Ok(())
                })
                .unwrap();
            // The handler is only called for deliveries that got past the claim: walk the outcomes in order.
            let mut expected_new = Vec::new();
            for ((p, s, fail), o) in chunk.iter().zip(&outcomes) {
                let new = !done.contains(&(*p, *s));
                match o {
                    Outcome::Processed => {
                        prop_assert!(new && !fail, "{p}/{s} processed twice");
                        done.insert((*p, *s));
                        expected_new.push((*p, *s));
                    }
                    Outcome::Duplicate => prop_assert!(!new && !fail, "{p}/{s} new but reported duplicate"),
                    Outcome::Conflict { .. } => prop_assert!(!new && *fail, "{p}/{s} conflict"),
                    Outcome::HandlerFailed(_) => prop_assert!(new && *fail),
                    other => prop_assert!(false, "unexpected {other:?}"),
                }
            }
            prop_assert_eq!(&applied, &expected_new);
            effects.extend(applied);
            at += n;
        }
        // Every sequence exactly once; the marks collapsed to one row per producer.
        let mut sorted = effects.clone();
        sorted.sort_unstable();
        sorted.dedup();
        prop_assert_eq!(sorted.len(), effects.len());
        prop_assert_eq!(effects.len(), done.len());
        for (p, name) in PRODUCERS.iter().enumerate() {
            let max = done.iter().filter(|(q, _)| *q == p).map(|(_, s)| *s).max();
            let w = inbox.watermark(scope, name).unwrap();
            prop_assert_eq!(w.high, max);
            prop_assert!(w.exceptions.is_empty(), "{:?}", w.exceptions);
        }
        let rows: i64 = inbox.connection().query_row("SELECT count(*) FROM identities", [], |r| r.get(0)).unwrap();
        prop_assert_eq!(rows, 0, "no identity rows for numbered deliveries");
    }
}

#[test]
fn out_of_order_sequences_wait_as_exceptions_then_fold() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let scope = "telemetry";
    inbox
        .set_retention(scope, &RetentionPolicy::new().sequence_watermarks(0))
        .unwrap();
    let ok = |_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> { Ok(()) };
    // Each sequence its own message id: a known id is recognised under any sequence (issue 21, item 5).
    let ids: Vec<String> = (0..8).map(|s| format!("evt-{s}")).collect();
    let d = |s: u64| {
        Delivery::new(scope, &ids[s as usize], "t", b"x")
            .with_producer("p")
            .with_sequence(s)
    };
    for s in [0, 1, 4, 5, 3] {
        assert!(
            matches!(inbox.process(&d(s), ok).unwrap(), Outcome::Processed),
            "{s}"
        );
    }
    let w = inbox.watermark(scope, "p").unwrap();
    assert_eq!((w.high, w.exceptions), (Some(1), vec![3, 4, 5]));
    for s in [0, 1, 3, 4, 5] {
        assert!(
            matches!(inbox.process(&d(s), ok).unwrap(), Outcome::Duplicate),
            "{s}"
        );
    }
    assert!(matches!(
        inbox.process(&d(2), ok).unwrap(),
        Outcome::Processed
    ));
    let w = inbox.watermark(scope, "p").unwrap();
    assert_eq!((w.high, w.exceptions), (Some(5), vec![]));
    // Another connection on the same file sees the marks.
    let mut other = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    assert!(matches!(
        other.process(&d(2), ok).unwrap(),
        Outcome::Duplicate
    ));
    assert!(matches!(
        other.process(&d(6), ok).unwrap(),
        Outcome::Processed
    ));
    // Without a producer or a sequence, identity rows apply as usual.
    let plain = Delivery::new(scope, "plain", "t", b"x");
    assert!(matches!(
        inbox.process(&plain, ok).unwrap(),
        Outcome::Processed
    ));
    assert!(matches!(
        inbox.process(&plain, ok).unwrap(),
        Outcome::Duplicate
    ));
}

#[test]
fn watermarks_cannot_be_switched_on_a_used_scope() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let ok = |_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> { Ok(()) };
    inbox
        .process(&Delivery::new("orders", "a", "t", b"x"), ok)
        .unwrap();
    let err = inbox
        .set_retention("orders", &RetentionPolicy::new().sequence_watermarks(1))
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // A versioned scope can.
    inbox
        .set_retention(
            &edge_inbox::versioned_scope("orders", 2),
            &RetentionPolicy::new().sequence_watermarks(1),
        )
        .unwrap();
    // And a used watermark scope cannot switch back to identity rows.
    inbox
        .set_retention("t@1", &RetentionPolicy::new().sequence_watermarks(1))
        .unwrap();
    inbox
        .process(
            &Delivery::new("t@1", "a", "t", b"x")
                .with_producer("p")
                .with_sequence(1),
            ok,
        )
        .unwrap();
    assert!(inbox.set_retention("t@1", &RetentionPolicy::new()).is_err());
    assert!(inbox
        .set_retention(
            "t@1",
            &RetentionPolicy::new()
                .sequence_watermarks(1)
                .processed_payloads(std::time::Duration::ZERO)
        )
        .is_ok());
}

/// In a scope with sequence watermarks the same message may arrive numbered and, through a bridge or a
/// replay, without its number: its numbered arrivals are remembered in the window and the others as identity
/// rows, and each is compared with the other. Either order is one effect, and other content a recorded
/// conflict, answered as one again at its next arrival.
#[test]
fn a_message_numbered_once_and_unnumbered_once_has_one_effect() {
    let dir = tempfile::tempdir().unwrap();
    let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
    let scope = "numbered-and-not";
    inbox
        .set_retention(scope, &RetentionPolicy::new().sequence_watermarks(1))
        .unwrap();
    let mut effects = 0;
    let mut offer = |inbox: &mut Inbox, id: &str, seq: Option<u64>, body: &[u8]| -> Outcome {
        let mut d = Delivery::new(scope, id, "t/1", body).with_producer("p");
        if let Some(seq) = seq {
            d = d.with_sequence(seq);
        }
        inbox
            .process(&d, |_tx: &mut edge_inbox::Tx<'_>, _d: &Delivery<'_>| {
                effects += 1;
                Ok(())
            })
            .unwrap()
    };
    let name = |o: &Outcome| match o {
        Outcome::Processed => "processed",
        Outcome::Duplicate => "duplicate",
        Outcome::Conflict { .. } => "conflict",
        _ => "other",
    };
    let offers: [(&str, Option<u64>, &[u8]); 11] = [
        // Numbered first, then not; then the other way round.
        ("e-1", Some(1), b"A"),
        ("e-1", None, b"A"),
        ("e-2", None, b"A"),
        ("e-2", Some(2), b"A"),
        // Other content, both ways, and each conflict arriving again.
        ("e-3", Some(3), b"q=1"),
        ("e-3", None, b"q=2"),
        ("e-3", None, b"q=2"),
        ("e-4", None, b"q=1"),
        ("e-4", Some(4), b"q=2"),
        ("e-4", Some(4), b"q=2"),
        // The committed content under a new number is still a duplicate.
        ("e-4", Some(5), b"q=1"),
    ];
    let seen: Vec<Outcome> = offers
        .iter()
        .map(|&(id, seq, body)| offer(&mut inbox, id, seq, body))
        .collect();
    let names: Vec<&str> = seen.iter().map(name).collect();
    assert_eq!(
        names,
        [
            "processed",
            "duplicate",
            "processed",
            "duplicate",
            "processed",
            "conflict",
            "conflict",
            "processed",
            "conflict",
            "conflict",
            "duplicate"
        ]
    );
    assert_eq!(effects, 4, "one effect per message");
    let stats = inbox.scope_stats(scope).unwrap();
    assert_eq!(
        (stats.processed, stats.duplicates, stats.conflicts),
        (4, 3, 4)
    );
    let records: i64 = inbox
        .connection()
        .query_row("SELECT count(*) FROM conflicts", [], |r| r.get(0))
        .unwrap();
    assert_eq!(
        records, 2,
        "one record per conflicting content, arrivals counted on it"
    );
}

/// A numbered delivery sent before what the identity horizon pruned, and not applied by the scope's policy,
/// still claims its sequence: undone, its gap in the producer's watermark would never close (each redelivery
/// is expired again), and every later sequence would be kept as an exception for good.
#[test]
fn an_expired_numbered_delivery_leaves_no_gap_in_the_watermark() {
    use edge_inbox::{ExpiredPolicy, Pruning};
    use std::time::Duration;

    const DAY: i64 = 86_400;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    for policy in [ExpiredPolicy::Quarantine, ExpiredPolicy::Reject] {
        let dir = tempfile::tempdir().unwrap();
        let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
        let s = "meters";
        inbox
            .set_retention(
                s,
                &RetentionPolicy::new()
                    .sequence_watermarks(1)
                    .identity_horizon(Duration::from_secs(30 * DAY as u64))
                    .expired(policy),
            )
            .unwrap();
        let applied = std::cell::Cell::new(0);
        let handler = |_: &mut edge_inbox::Tx<'_>, _: &Delivery<'_>| -> anyhow::Result<()> {
            applied.set(applied.get() + 1);
            Ok(())
        };
        // An unnumbered identity, committed "40 days ago" and pruned: the scope has a pruned horizon.
        let old = Delivery::new(s, "unnumbered", "t", b"u").with_sent_at(now - 40 * DAY);
        inbox.process(&old, handler).unwrap();
        let scope_id = inbox.scope_id(s).unwrap();
        inbox
            .connection()
            .execute_batch(&format!(
                "UPDATE identities SET day = day - 40 WHERE scope_id = {scope_id};
                 UPDATE inbox_meta SET value = {} WHERE name = 'created_at';",
                edge_inbox::EARLIEST_PLAUSIBLE_TIME
            ))
            .unwrap();
        let pruned = inbox
            .prune(&Pruning::default().pause(Duration::ZERO))
            .unwrap();
        assert_eq!(pruned.identities_pruned, 1);
        let ids: Vec<String> = (0..=60).map(|seq| format!("m-{seq}")).collect();
        let numbered = |seq: u64, sent_at: i64| {
            Delivery::new(s, &ids[seq as usize], "t", b"x")
                .with_producer("p")
                .with_sequence(seq)
                .with_sent_at(sent_at)
        };
        for seq in 1..=20 {
            assert!(matches!(
                inbox.process(&numbered(seq, now), handler).unwrap(),
                Outcome::Processed
            ));
        }
        // Sequence 21 comes late, sent before the pruned horizon: not applied.
        let late = numbered(21, now - 45 * DAY);
        let first = inbox.process(&late, handler).unwrap();
        assert!(
            matches!(first, Outcome::Expired { .. }),
            "{policy:?}: {first:?}"
        );
        for seq in 22..=60 {
            assert!(matches!(
                inbox.process(&numbered(seq, now), handler).unwrap(),
                Outcome::Processed
            ));
        }
        let mark = inbox.watermark(s, "p").unwrap();
        assert_eq!(
            (mark.high, mark.exceptions.len()),
            (Some(60), 0),
            "{policy:?}"
        );
        // Its redelivery is compared with what claimed the sequence: not applied either.
        let again = inbox.process(&late, handler).unwrap();
        assert!(
            !matches!(again, Outcome::Processed),
            "{policy:?}: {again:?}"
        );
        assert_eq!(applied.get(), 1 + 59, "{policy:?}");
    }
}
