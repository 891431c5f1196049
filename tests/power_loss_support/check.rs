//! After a cut: rebuild the files from what the disk kept, reopen the inbox with the platform's own VFS and
//! check every promise the acknowledgements made, then let the broker redeliver everything and check that
//! nothing is applied twice and everything is applied once.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use edge_inbox::{outbox_message_id, Config, Inbox, Outcome, Status, Synchronous, Worker};

use super::disk::{Cut, Snapshot};
use super::workload::{self, Item, Promise, Run, DEFERRED, METER, NUMBERED, OUTBOX};

/// What one cut showed.
#[derive(Debug, Default)]
pub struct Findings {
    /// Acknowledgements (indices into [`Run::acks`]) whose promise the reopened inbox does not keep.
    pub lost: Vec<usize>,
    /// Items whose effect is present more than once, before or after the redelivery.
    pub doubled: Vec<String>,
    /// Everything else that is wrong: the file does not open, integrity, counters, watermarks, outbox.
    pub problems: Vec<String>,
    /// Deliveries offered but not acknowledged at the cut whose commit survived anyway.
    pub unacked_survived: usize,
    /// Deliveries offered but not acknowledged at the cut whose commit was lost (as it may be).
    pub unacked_lost: usize,
}

impl Findings {
    /// Nothing wrong at all.
    pub fn clean(&self) -> bool {
        self.lost.is_empty() && self.doubled.is_empty() && self.problems.is_empty()
    }
}

/// The scopes whose acknowledgement promises the effect itself (the deferred one promises a stored message).
const EFFECT_SCOPES: [&str; 5] = [
    workload::SINGLE,
    workload::BATCHED,
    workload::OVERLAPPED,
    OUTBOX,
    NUMBERED,
];

fn materialize(run: &Run, snap: &Snapshot, cut: Cut, dir: &Path) {
    for entry in std::fs::read_dir(dir).unwrap() {
        std::fs::remove_file(entry.unwrap().path()).unwrap();
    }
    for (name, bytes) in run.disk.materialize(snap, cut) {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

fn effects(inbox: &Inbox) -> HashMap<(String, String), i64> {
    let mut stmt = inbox
        .connection()
        .prepare("SELECT ns, key, value FROM kv")
        .unwrap();
    let rows = stmt
        .query_map([], |r| {
            Ok((
                (r.get::<_, String>(0)?, r.get::<_, String>(1)?),
                r.get::<_, Vec<u8>>(2)?,
            ))
        })
        .unwrap();
    rows.map(|r| {
        let (k, v) = r.unwrap();
        (k, ciborium::from_reader::<i64, _>(&v[..]).unwrap())
    })
    .collect()
}

fn count(inbox: &Inbox, sql: &str) -> i64 {
    inbox.connection().query_row(sql, [], |r| r.get(0)).unwrap()
}

fn integrity(inbox: &Inbox, f: &mut Findings, when: &str) {
    let result: String = inbox
        .connection()
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap_or_else(|e| e.to_string());
    if result != "ok" {
        f.problems.push(format!("integrity_check {when}: {result}"));
    }
}

/// The outbox id the handler of `item` wrote.
fn outbox_id(item: &Item) -> String {
    outbox_message_id(item.scope, None, &item.id, 0)
}

/// Cross-checks that must hold in any state: counters, identities of stored messages, watermarks, outbox.
fn consistency(
    run: &Run,
    inbox: &mut Inbox,
    fx: &HashMap<(String, String), i64>,
    f: &mut Findings,
) {
    let effect = |it: &Item| {
        fx.get(&(it.scope.to_owned(), it.id.clone()))
            .copied()
            .unwrap_or(0)
    };
    for ((ns, key), n) in fx {
        if *n > 1 {
            f.doubled.push(format!("{ns}/{key} applied {n} times"));
        }
    }
    // The processed counter commits with the effects it counts.
    for scope in EFFECT_SCOPES {
        let applied = run
            .items
            .iter()
            .filter(|it| it.scope == scope && effect(it) > 0)
            .count() as u64;
        let stats = inbox.scope_stats(scope).unwrap();
        if stats.processed != applied {
            f.problems.push(format!(
                "{scope}: processed counter {} but {applied} effects",
                stats.processed
            ));
        }
    }
    // A stored message always has its identity (retention never deletes one under a stored body).
    let orphans = count(
        inbox,
        "SELECT count(*) FROM messages m WHERE NOT EXISTS \
         (SELECT 1 FROM identities i WHERE i.scope_id = m.scope_id AND i.id_hash = m.id_hash)",
    );
    if orphans != 0 {
        f.problems
            .push(format!("{orphans} stored messages without identity"));
    }
    // A deferred effect exists only for a message marked processed (or pruned after it was).
    for it in run.items.iter().filter(|it| it.scope == DEFERRED) {
        let status = inbox.status(DEFERRED, None, &it.id).unwrap();
        let applied = effect(it) > 0;
        match status {
            Status::NotFound if applied => f
                .problems
                .push(format!("{}: effect without a stored identity", it.id)),
            Status::Recorded { state: Some(s), .. }
                if applied != (s == edge_inbox::MessageState::Processed) =>
            {
                f.problems.push(format!(
                    "{}: state {} but applied={applied}",
                    it.id,
                    s.name()
                ))
            }
            _ => {}
        }
    }
    // The watermark covers exactly the sequences whose effect committed.
    let wm = inbox.watermark(NUMBERED, METER).unwrap();
    for it in run.items.iter().filter(|it| it.scope == NUMBERED) {
        let s = it.seq.unwrap();
        let covered = wm.high.is_some_and(|h| s <= h) || wm.exceptions.contains(&s);
        if covered != (effect(it) > 0) {
            f.problems.push(format!(
                "sequence {s}: watermark {wm:?} covers it={covered}, effect {}",
                effect(it)
            ));
        }
    }
    // Exactly the outbox messages of the committed effects.
    for it in run.items.iter().filter(|it| it.scope == OUTBOX) {
        let row = inbox
            .outbox_status(OUTBOX, &outbox_id(it))
            .unwrap()
            .is_some();
        if row != (effect(it) > 0) {
            f.problems.push(format!(
                "{}: outbox row {row}, effect {}",
                it.id,
                effect(it)
            ));
        }
    }
}

/// Cuts the power at `snap`, keeping what `cut` says of the unsynced writes, and checks the reopened inbox.
pub fn check(run: &Run, snap: &Snapshot, cut: Cut, dir: &Path) -> Findings {
    let mut f = Findings::default();
    materialize(run, snap, cut, dir);
    let path = dir.join("inbox.db");
    // The platform's own VFS, as the gateway restarts. The checker's own commits need no fsync: it is done
    // with the file when it returns.
    let config = Config::default()
        .synchronous(Synchronous::Normal)
        .slow_commit_warning(None);
    let mut inbox = match Inbox::open(&path, config.clone()) {
        Ok(i) => i,
        Err(e) => {
            f.problems.push(format!("does not reopen: {e}"));
            return f;
        }
    };
    integrity(&inbox, &mut f, "after the cut");

    // Every acknowledged promise is kept.
    let fx = effects(&inbox);
    let acks = &run.acks[..snap.acked];
    let mut acked: HashMap<usize, Promise> = HashMap::new();
    for (k, ack) in acks.iter().enumerate() {
        let it = &run.items[ack.item];
        let kept = match ack.promise {
            Promise::Effect | Promise::Applied => {
                fx.get(&(it.scope.to_owned(), it.id.clone())).copied() == Some(1)
            }
            Promise::Stored => !matches!(
                inbox.status(DEFERRED, None, &it.id).unwrap(),
                Status::NotFound
            ),
        };
        if !kept {
            f.lost.push(k);
        }
        acked.entry(ack.item).or_insert(ack.promise);
    }
    consistency(run, &mut inbox, &fx, &mut f);
    // Offered at the cut (the call in flight) but not acknowledged: either way is allowed; counted.
    for (i, it) in run.items.iter().enumerate().take(snap.offered) {
        if acked.contains_key(&i) || it.scope == DEFERRED {
            continue;
        }
        if fx.contains_key(&(it.scope.to_owned(), it.id.clone())) {
            f.unacked_survived += 1;
        } else {
            f.unacked_lost += 1;
        }
    }

    // The broker redelivers everything: what was acknowledged must be recognised, the rest applied once.
    let lost_items: Vec<usize> = f.lost.iter().map(|&k| acks[k].item).collect();
    let must_be_duplicate = |i: usize| acked.contains_key(&i) && !lost_items.contains(&i);
    let mut outcomes = Vec::new();
    for scope in EFFECT_SCOPES.into_iter().chain([DEFERRED]) {
        let idx: Vec<usize> = (0..run.items.len())
            .filter(|&i| run.items[i].scope == scope)
            .collect();
        for chunk in idx.chunks(32) {
            let ds: Vec<_> = chunk.iter().map(|&i| run.items[i].delivery()).collect();
            let result = if scope == DEFERRED {
                inbox.receive_batch_into(&ds, &mut outcomes)
            } else if scope == OUTBOX {
                inbox.process_batch_into(&ds, &mut workload::bump_and_announce, &mut outcomes)
            } else {
                inbox.process_batch_into(&ds, &mut workload::bump, &mut outcomes)
            };
            if let Err(e) = result {
                f.problems
                    .push(format!("redelivery to {scope} failed: {e}"));
                return f;
            }
            for (&i, o) in chunk.iter().zip(&outcomes) {
                let ok = match o {
                    Outcome::Duplicate => true,
                    Outcome::Processed | Outcome::Received => !must_be_duplicate(i),
                    _ => false,
                };
                if !ok {
                    f.problems.push(format!(
                        "redelivered {} (acknowledged: {}): {o:?}",
                        run.items[i].id,
                        must_be_duplicate(i)
                    ));
                }
            }
        }
    }

    // The deferred messages are applied: claims a cut left behind expire after the lease.
    let mut worker = Worker::new(inbox, DEFERRED, workload::worker_config()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let drained = worker.run_once(&mut workload::bump).unwrap();
        let backlog = worker.inbox().backlog(DEFERRED).unwrap();
        if backlog.pending == 0 && backlog.failed == 0 {
            break;
        }
        if Instant::now() > deadline {
            f.problems
                .push(format!("deferred backlog not drained: {backlog:?}"));
            break;
        }
        if drained.claimed == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let inbox = worker.inbox();

    // Everything applied exactly once now.
    let fx = effects(inbox);
    for it in &run.items {
        let n = fx
            .get(&(it.scope.to_owned(), it.id.clone()))
            .copied()
            .unwrap_or(0);
        if n != 1 {
            f.problems
                .push(format!("{}: applied {n} times after redelivery", it.id));
        }
    }
    let before = f.problems.len();
    consistency(run, inbox, &fx, &mut f);
    if f.problems.len() > before {
        f.problems.insert(before, "after redelivery:".to_string());
    }
    integrity(inbox, &mut f, "after redelivery");
    f
}
