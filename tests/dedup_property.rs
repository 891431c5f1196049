//! Property: over any sequence of deliveries with repeats, reorderings and conflicting reuse of ids, split
//! into batches of any size, the effect count equals the number of distinct identities.

use std::collections::HashMap;

use edge_inbox::{Config, Delivery, Inbox, Outcome, Tx};
use proptest::prelude::*;

const SCOPE: &str = "counter";

fn effect(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let n: u64 = tx.get("effects")?.unwrap_or(0);
    tx.put("effects", &(n + 1))?;
    let per_id: u64 = tx.get(d.message_id)?.unwrap_or(0);
    tx.put(d.message_id, &(per_id + 1))?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn effect_count_equals_distinct_ids(
        // (id, content variant): variant != the first seen for that id is a conflicting reuse.
        stream in prop::collection::vec((0u8..24, prop::bool::weighted(0.1)), 1..120),
        batch_sizes in prop::collection::vec(1usize..40, 1..10),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut inbox = Inbox::open(dir.path().join("p.db"), Config::default()).unwrap();
        let ids: Vec<String> = stream.iter().map(|(i, _)| format!("id-{i}")).collect();
        let payloads: Vec<&[u8]> = stream.iter().map(|(_, alt)| if *alt { &b"other"[..] } else { &b"same"[..] }).collect();
        let deliveries: Vec<Delivery<'_>> =
            ids.iter().zip(&payloads).map(|(id, p)| Delivery::new(SCOPE, id, "t", p)).collect();

        let mut first: HashMap<&str, &[u8]> = HashMap::new();
        let (mut want_dup, mut want_conflict) = (0u64, 0u64);
        for d in &deliveries {
            match first.get(d.message_id) {
                None => { first.insert(d.message_id, d.payload); }
                Some(p) if *p == d.payload => want_dup += 1,
                Some(_) => want_conflict += 1,
            }
        }

        let mut rest = &deliveries[..];
        let mut sizes = batch_sizes.iter().cycle();
        let mut seen = Vec::new();
        while !rest.is_empty() {
            let n = (*sizes.next().unwrap()).min(rest.len());
            let (batch, tail) = rest.split_at(n);
            let outcomes = if n == 1 {
                vec![inbox.process(&batch[0], effect).unwrap()]
            } else {
                inbox.process_batch(batch, effect).unwrap()
            };
            prop_assert_eq!(outcomes.len(), n);
            seen.extend(outcomes.iter().map(Outcome::name));
            rest = tail;
        }

        let stats = inbox.scope_stats(SCOPE).unwrap();
        prop_assert_eq!(stats.processed, first.len() as u64);
        prop_assert_eq!(stats.duplicates, want_dup);
        prop_assert_eq!(stats.conflicts, want_conflict);
        prop_assert_eq!(seen.iter().filter(|n| **n == "processed").count(), first.len());
        let conn = inbox.connection();
        let blob: Vec<u8> = conn.query_row("SELECT value FROM kv WHERE key = 'effects'", [], |r| r.get(0)).unwrap();
        let effects: u64 = ciborium::from_reader(&blob[..]).unwrap();
        prop_assert_eq!(effects, first.len() as u64);
        let max_per_id: u64 = conn
            .prepare("SELECT value FROM kv WHERE key LIKE 'id-%'").unwrap()
            .query_map([], |r| r.get::<_, Vec<u8>>(0)).unwrap()
            .map(|b| ciborium::from_reader::<u64, _>(&b.unwrap()[..]).unwrap())
            .max().unwrap();
        prop_assert_eq!(max_per_id, 1);
    }
}
