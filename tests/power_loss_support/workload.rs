//! A short run of every write path, through the power-loss VFS: single commits, group commits, handlers that
//! publish through the outbox, received-then-deferred messages applied by a worker on its own connection,
//! a scope with sequence watermarks, and retention passes (payload pruning, incremental vacuum, checkpoint).
//! Every call that returns `Ok` is recorded as an acknowledgement, in order.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use edge_inbox::{
    Completion, Config, ConsumerCore, Delivery, Inbound, Inbox, OutboxProperties, Outcome, Pruning,
    PubAckSender, Qos, RetentionPolicy, SyncOverlap, Synchronous, Tx, Worker, WorkerConfig,
};

use super::disk::{Disk, Snapshot};
use super::vfs;

/// Group commit off: one delivery per transaction.
pub const SINGLE: &str = "inventory-reservation";
/// Group commit on: batches of deliveries in one transaction.
pub const BATCHED: &str = "inventory-batched";
/// The consumer core's commit loop, each batch committed without its own sync while the sync thread syncs
/// the one before; an ack is recorded when the loop sends the PUBACK.
pub const OVERLAPPED: &str = "inventory-overlapped";
/// Handlers that publish through the outbox.
pub const OUTBOX: &str = "stock-announcer";
/// Received-then-deferred, applied by a worker.
pub const DEFERRED: &str = "shipping-deferred";
/// Numbered deliveries of one producer, deduplicated by sequence watermarks.
pub const NUMBERED: &str = "meter-readings";
/// The producer of the numbered scope.
pub const METER: &str = "meter-1";

/// The lease of the run's worker: short, so that a claim a cut leaves behind expires soon after the reopen.
pub const LEASE: Duration = Duration::from_millis(100);

/// One delivery of the run.
#[derive(Debug, Clone)]
pub struct Item {
    /// Its scope (one of the constants above).
    pub scope: &'static str,
    /// Message id.
    pub id: String,
    /// Sequence, in the numbered scope.
    pub seq: Option<u64>,
    /// Payload (large enough that the files grow, checkpoint and vacuum).
    pub payload: Vec<u8>,
}

impl Item {
    /// The delivery, as the broker sends it (again).
    pub fn delivery(&self) -> Delivery<'_> {
        let d = Delivery::new(self.scope, &self.id, "orders/created", &self.payload);
        match self.seq {
            Some(s) => d.with_producer(METER).with_sequence(s),
            None => d,
        }
    }
}

/// What an acknowledgement promises about an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Promise {
    /// `process` / `process_batch_into` returned: identity and effect committed.
    Effect,
    /// `receive` / `receive_batch_into` returned: the message is stored (pending or later).
    Stored,
    /// A worker's `complete` returned `Processed`: the deferred message's effect is committed.
    Applied,
}

/// One recorded acknowledgement.
#[derive(Debug, Clone, Copy)]
pub struct Ack {
    /// Index into [`Run::items`].
    pub item: usize,
    /// What it promises.
    pub promise: Promise,
    /// WAL syncs completed when the call returned.
    pub wal_syncs: u64,
}

/// Settings of one run.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Durability of the inbox under test.
    pub synchronous: Synchronous,
    /// Rounds of the workload (each round offers 24 deliveries).
    pub rounds: usize,
    /// A disk whose syncs make nothing durable (the harness's control).
    pub lying: bool,
}

/// A finished run: the files' history and what was acknowledged.
pub struct Run {
    /// Holds the run's files until the run is dropped.
    pub dir: tempfile::TempDir,
    /// The disk model with every snapshot.
    pub disk: Arc<Disk>,
    /// Every delivery offered, in order.
    pub items: Vec<Item>,
    /// Every acknowledgement, in order.
    pub acks: Vec<Ack>,
    /// Every cut point.
    pub snapshots: Vec<Snapshot>,
}

/// The handler of the strong-case scopes and of the worker: one counter per message id, so that an effect
/// applied twice shows as 2.
pub fn bump(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let n: i64 = tx.get(d.message_id)?.unwrap_or(0);
    tx.put(d.message_id, &(n + 1))?;
    Ok(())
}

/// The outbox scope's handler: the effect plus one message to publish, in the same transaction.
pub fn bump_and_announce(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    bump(tx, d)?;
    tx.publish(
        "stock/announced",
        d.message_id.as_bytes(),
        Qos::AtLeastOnce,
        &OutboxProperties::new(),
    )?;
    Ok(())
}

/// Unix seconds now.
pub fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Retention as the run sets it (before recording starts, on a disk that keeps it).
pub fn configure(inbox: &mut Inbox) {
    inbox
        .set_retention(
            DEFERRED,
            &RetentionPolicy::new().processed_payloads(Duration::from_secs(3_600)),
        )
        .unwrap();
    inbox
        .set_retention(NUMBERED, &RetentionPolicy::new().sequence_watermarks(1))
        .unwrap();
}

/// The worker settings of the run and of the checker.
pub fn worker_config() -> WorkerConfig {
    WorkerConfig::default().lease(LEASE).batch(4)
}

struct Driver {
    disk: Arc<Disk>,
    items: Vec<Item>,
    acks: Vec<Ack>,
}

impl Driver {
    fn item(&mut self, scope: &'static str, seq: Option<u64>) -> usize {
        let n = self.items.len();
        let id = format!("{scope}-evt-{n:05}");
        let mut payload =
            format!("{{\"order\":{n},\"sku\":\"A-{}\",\"note\":\"", n % 7).into_bytes();
        payload.resize(700, b'x');
        self.items.push(Item {
            scope,
            id,
            seq,
            payload,
        });
        self.disk.set_offered(self.items.len());
        n
    }

    fn ack(&mut self, item: usize, promise: Promise) {
        self.acks.push(Ack {
            item,
            promise,
            wal_syncs: self.disk.wal_syncs(),
        });
        self.disk.set_acked(self.acks.len());
    }

    fn done_step(&self) {
        self.disk.step_boundary();
    }
}

/// Records each PUBACK the commit loop sends (the packet id is the item's index + 1, modulo 2^16), with the
/// disk's count of acknowledgements, at the instant it is sent.
struct Recorder {
    disk: Arc<Disk>,
    /// Acknowledgements recorded before this loop.
    base: usize,
    sent: Arc<Mutex<Vec<(u16, u64)>>>,
}

impl PubAckSender for Recorder {
    fn try_puback(&self, packet_id: u16) -> bool {
        let mut sent = self.sent.lock().unwrap();
        sent.push((packet_id, self.disk.wal_syncs()));
        self.disk.set_acked(self.base + sent.len());
        true
    }
}

/// Feeds `batch` to a consumer core running on its commit thread with overlapping syncs, waits for every
/// PUBACK, and gives the inbox back.
fn overlapped_commits(inbox: Inbox, d: &mut Driver, batch: &[usize]) -> Inbox {
    let sent = Arc::new(Mutex::new(Vec::new()));
    let recorder = Recorder {
        disk: d.disk.clone(),
        base: d.acks.len(),
        sent: sent.clone(),
    };
    let core = ConsumerCore::new(inbox, OVERLAPPED)
        .batch(3, Duration::ZERO)
        .overlap_syncs(SyncOverlap::On);
    let (mut feed, commits) = core.spawn(bump, recorder, 64).unwrap();
    feed.connected(true).unwrap();
    for &i in batch {
        let it = &d.items[i];
        let inbound = Inbound::new("orders/created", it.payload.clone())
            .with_user_property("message-id", it.id.clone());
        feed.publish(inbound, Some(packet_id(i))).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while sent.lock().unwrap().len() < batch.len() {
        assert!(
            Instant::now() < deadline,
            "the commit loop acked {:?}",
            sent
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    commits.stop();
    let (core, result) = commits.join();
    let summary = result.unwrap();
    assert_eq!(summary.processed, batch.len() as u64, "{summary:?}");
    drop(feed);
    for &(packet, wal_syncs) in sent.lock().unwrap().iter() {
        let item = *batch
            .iter()
            .find(|&&i| packet_id(i) == packet)
            .expect("a PUBACK of the batch");
        d.acks.push(Ack {
            item,
            promise: Promise::Effect,
            wal_syncs,
        });
    }
    core.into_inbox()
}

fn packet_id(item: usize) -> u16 {
    (item % 65_535 + 1) as u16
}

fn expect_new(outcome: &Outcome, what: &str) {
    assert!(
        matches!(outcome, Outcome::Processed | Outcome::Received),
        "{what}: {outcome:?}"
    );
}

/// Runs the workload; every sync, every step boundary and every write of a maintenance step is a cut point.
pub fn run(vfs_name: &str, plan: Plan) -> Run {
    let disk = vfs::register(vfs_name);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.db");
    let config = Config::default()
        .vfs(vfs_name)
        .synchronous(plan.synchronous)
        .slow_commit_warning(None);
    let mut inbox = Inbox::open(&path, config.clone()).unwrap();
    configure(&mut inbox);
    // The settings must be durable before the run whatever the synchronous mode (NORMAL would keep them in
    // the unsynced WAL, and a cut would lose the scope's watermark mode itself).
    inbox
        .connection()
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .unwrap();
    let mut worker = Worker::open(&path, config, DEFERRED, worker_config()).unwrap();

    let mut d = Driver {
        disk: disk.clone(),
        items: Vec::new(),
        acks: Vec::new(),
    };
    disk.set_lying(plan.lying);
    disk.set_recording(true);
    disk.step_boundary();
    let mut outcomes = Vec::new();
    let mut next_seq = 1u64;
    let far_future = unix_now() + 2 * 86_400;

    for round in 0..plan.rounds {
        // Group commit off.
        disk.phase("single commit", false);
        for _ in 0..4 {
            let i = d.item(SINGLE, None);
            let o = inbox.process(&d.items[i].delivery(), bump).unwrap();
            expect_new(&o, "single");
            d.ack(i, Promise::Effect);
            d.done_step();
        }

        // Group commit on.
        disk.phase("group commit", false);
        let batch: Vec<usize> = (0..8).map(|_| d.item(BATCHED, None)).collect();
        let deliveries: Vec<Delivery<'_>> = batch.iter().map(|&i| d.items[i].delivery()).collect();
        inbox
            .process_batch_into(&deliveries, &mut bump, &mut outcomes)
            .unwrap();
        drop(deliveries);
        for (&i, o) in batch.iter().zip(&outcomes) {
            expect_new(o, "batched");
            d.ack(i, Promise::Effect);
        }
        d.done_step();

        // The consumer core's loop, commits overlapping their syncs: 8 deliveries fed at once, in batches
        // of up to 3, each acked only once a sync covers its commit.
        disk.phase("overlapped commits", false);
        let batch: Vec<usize> = (0..8).map(|_| d.item(OVERLAPPED, None)).collect();
        inbox = overlapped_commits(inbox, &mut d, &batch);
        d.done_step();

        // Outbox: effect and message to publish in one commit.
        disk.phase("outbox commit", false);
        let batch: Vec<usize> = (0..3).map(|_| d.item(OUTBOX, None)).collect();
        let deliveries: Vec<Delivery<'_>> = batch.iter().map(|&i| d.items[i].delivery()).collect();
        inbox
            .process_batch_into(&deliveries, &mut bump_and_announce, &mut outcomes)
            .unwrap();
        drop(deliveries);
        for (&i, o) in batch.iter().zip(&outcomes) {
            expect_new(o, "outbox");
            d.ack(i, Promise::Effect);
        }
        d.done_step();

        // Received-then-deferred: two alone, four in one commit.
        disk.phase("deferred receive", false);
        for _ in 0..2 {
            let i = d.item(DEFERRED, None);
            let o = inbox.receive(&d.items[i].delivery()).unwrap();
            expect_new(&o, "receive");
            d.ack(i, Promise::Stored);
            d.done_step();
        }
        let batch: Vec<usize> = (0..4).map(|_| d.item(DEFERRED, None)).collect();
        let deliveries: Vec<Delivery<'_>> = batch.iter().map(|&i| d.items[i].delivery()).collect();
        inbox
            .receive_batch_into(&deliveries, &mut outcomes)
            .unwrap();
        drop(deliveries);
        for (&i, o) in batch.iter().zip(&outcomes) {
            expect_new(o, "receive batch");
            d.ack(i, Promise::Stored);
        }
        d.done_step();

        // The worker applies them on its own connection.
        disk.phase("worker claim and apply", false);
        for _ in 0..16 {
            let claims = worker.claim(4).unwrap();
            if claims.is_empty() {
                break;
            }
            d.done_step();
            let completions = worker.complete(&claims, &mut bump).unwrap();
            for (c, done) in claims.iter().zip(&completions) {
                if matches!(done, Completion::Processed) {
                    let i = d
                        .items
                        .iter()
                        .position(|it| it.scope == DEFERRED && it.id == c.message_id())
                        .expect("claimed message is an item");
                    d.ack(i, Promise::Applied);
                }
            }
            d.done_step();
        }

        // Numbered deliveries; every other round one pair arrives out of order.
        disk.phase("watermark commit", false);
        let mut seqs = vec![next_seq, next_seq + 1, next_seq + 2];
        next_seq += 3;
        if round % 2 == 1 {
            seqs.swap(0, 1);
        }
        for s in seqs {
            let i = d.item(NUMBERED, Some(s));
            let o = inbox.process(&d.items[i].delivery(), bump).unwrap();
            expect_new(&o, "numbered");
            d.ack(i, Promise::Effect);
            d.done_step();
        }

        // Maintenance: a whole retention pass, step by step, or a plain checkpoint.
        if round % 4 == 3 {
            let opts = Pruning::default()
                .as_of(far_future)
                .batch(6)
                .vacuum_pages(2)
                .pause(Duration::ZERO);
            for _ in 0..500 {
                let from = disk.snapshot_count();
                disk.phase("prune step", true);
                let report = inbox.prune_step(&opts).unwrap();
                let label = if report.pages_reclaimed > 0 {
                    "incremental vacuum"
                } else if report.done {
                    "checkpoint (end of prune pass)"
                } else if report.payloads_pruned > 0 {
                    "prune payloads"
                } else {
                    "prune step"
                };
                disk.relabel_since(from, label);
                disk.phase(label, false);
                d.done_step();
                if report.done {
                    break;
                }
            }
        } else if round % 4 == 1 {
            disk.phase("checkpoint", true);
            inbox
                .connection()
                .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
                .unwrap();
            disk.phase("checkpoint", false);
            d.done_step();
        }
    }
    disk.phase("end of run", false);
    d.done_step();
    disk.set_recording(false);
    drop(worker);
    drop(inbox);
    let snapshots = disk.snapshots();
    Run {
        dir,
        disk,
        items: d.items,
        acks: d.acks,
        snapshots,
    }
}
