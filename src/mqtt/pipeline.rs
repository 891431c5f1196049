//! Commits overlapping their syncs: the consumer core commits a batch without a sync of its own and goes
//! on to the next while the store's sync thread ([`GroupSync`]) makes it durable. The batch's acks wait
//! here, behind the number of the sync request made after its commit, until a sync that began after the
//! commit has succeeded.

use std::collections::VecDeque;
use std::time::Duration;

use crate::mqtt::gate::Ack;
use crate::mqtt::ready_acks::ReadyAcks;
use crate::store::group_sync::{smoothed, GroupSync};

/// When a commit loop commits the next batch while the previous one syncs
/// ([`ConsumerCore::overlap_syncs`](crate::ConsumerCore::overlap_syncs)). In every mode a PUBACK leaves
/// only once its delivery's commit is durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SyncOverlap {
    /// Every commit syncs itself before the next begins.
    Off,
    /// While the commits that sync themselves take 1 ms or more (SD cards, eMMC), until the syncs take
    /// less than 0.5 ms. The default.
    #[default]
    Auto,
    /// Always, also on storage whose syncs are fast.
    On,
}

/// The acks of committed batches waiting for their sync, in arrival order.
#[derive(Debug)]
pub(crate) struct Pipeline {
    pub(crate) sync: GroupSync,
    mode: SyncOverlap,
    waiting: ReadyAcks,
    /// (sync request, how many of `waiting` it releases), oldest first.
    marks: VecDeque<(u64, usize)>,
    /// The latest sync request made.
    last: u64,
    /// What committing a delivery takes, smoothed (a batch's commit, handler included, per delivery).
    per_delivery: Duration,
    /// Whether batches commit without their own sync now ([`Pipeline::choose`]).
    overlapping: bool,
    /// How long a `COMMIT` with its own sync takes, smoothed (each sample at most [`SAMPLE_CAP`]).
    full_commit: Duration,
}

/// A commit that syncs itself for at least this long (smoothed) is worth overlapping with the next.
const OVERLAP_ON: Duration = Duration::from_millis(1);
/// A sync shorter than this (smoothed) is not worth the two hand-offs between threads that overlapping
/// adds (to the sync thread and back), under load on a small machine.
const OVERLAP_OFF: Duration = Duration::from_micros(500);
/// One slow commit (a checkpoint's restart) does not switch the overlap on by itself.
const SAMPLE_CAP: Duration = Duration::from_millis(4);

impl Pipeline {
    pub(crate) fn new(sync: GroupSync, mode: SyncOverlap) -> Pipeline {
        Pipeline {
            mode,
            sync,
            waiting: ReadyAcks::default(),
            marks: VecDeque::new(),
            last: 0,
            per_delivery: Duration::ZERO,
            overlapping: mode == SyncOverlap::On,
            full_commit: Duration::ZERO,
        }
    }

    /// Asks for a sync covering every commit so far: call it after each commit, before its acks are
    /// [`Pipeline::wait`]ed for. Returns the request's number.
    pub(crate) fn request(&mut self) -> u64 {
        self.last = self.sync.request();
        self.last
    }

    /// Whether the next batch commits without its own sync: while syncs are slow. It starts with commits
    /// that sync themselves, and switches when their `COMMIT`s take [`OVERLAP_ON`] or more; back when the
    /// sync thread's syncs take less than [`OVERLAP_OFF`].
    pub(crate) fn choose(&mut self) -> bool {
        if self.mode == SyncOverlap::On {
            return true;
        }
        if self.overlapping {
            let sync = self.sync.sync_time();
            if !sync.is_zero() && sync < OVERLAP_OFF {
                log::debug!("syncs take {sync:?}: each commit syncs itself again");
                self.overlapping = false;
                self.full_commit = Duration::ZERO;
            }
        } else if self.full_commit >= OVERLAP_ON {
            log::debug!(
                "commits take {:?} with their sync: the next commits overlap the syncs",
                self.full_commit
            );
            self.overlapping = true;
            self.sync.forget_sync_time();
        }
        self.overlapping
    }

    /// Whether batches commit without their own sync now.
    pub(crate) fn overlapping(&self) -> bool {
        self.overlapping
    }

    /// Notes that a `COMMIT` that synced itself took `took`.
    pub(crate) fn full_commit_took(&mut self, took: Duration) {
        self.full_commit = smoothed(self.full_commit, took.min(SAMPLE_CAP), 16);
    }

    /// Notes that committing `n` deliveries took `took`.
    pub(crate) fn commit_took(&mut self, n: usize, took: Duration) {
        self.per_delivery = smoothed(self.per_delivery, took / n.max(1) as u32, 8);
    }

    /// What committing `n` deliveries should take, with a margin for the transaction's own work.
    pub(crate) fn commit_estimate(&self, n: usize) -> Duration {
        self.per_delivery * n as u32 + Duration::from_micros(200)
    }

    /// The latest sync request made.
    pub(crate) fn last_request(&self) -> u64 {
        self.last
    }

    /// True while acks wait for a sync.
    pub(crate) fn is_waiting(&self) -> bool {
        !self.marks.is_empty()
    }

    /// Acks waiting for a sync.
    pub(crate) fn len(&self) -> usize {
        self.waiting.len()
    }

    /// `ack` leaves once the latest sync request made is done (behind every ack already waiting).
    pub(crate) fn wait(&mut self, ack: Ack) {
        match self.marks.back_mut() {
            Some((request, n)) if *request == self.last => *n += 1,
            _ => self.marks.push_back((self.last, 1)),
        }
        self.waiting.push_back(ack);
    }

    /// Moves the acks whose sync request is at or below `synced` to `ready`, in order. The latest request
    /// done.
    pub(crate) fn release(&mut self, synced: u64, ready: &mut ReadyAcks) {
        while let Some(&(request, n)) = self.marks.front() {
            if request > synced {
                break;
            }
            self.marks.pop_front();
            for _ in 0..n {
                if let Some(ack) = self.waiting.pop_front() {
                    ready.push_back(ack);
                }
            }
        }
    }

    /// Moves every waiting ack to `ready`: the WAL was written out again and synced as a whole.
    pub(crate) fn release_all(&mut self, ready: &mut ReadyAcks) {
        self.release(u64::MAX, ready);
    }

    /// Drops the waiting acks (their connection ended, or the run ends without their sync); how many.
    pub(crate) fn clear(&mut self) -> usize {
        let n = self.waiting.len();
        self.waiting.clear();
        self.marks.clear();
        n
    }
}
