//! Retention: payload pruning, the identity horizon and what happens after it, and space reclaim.
//!
//! Identities are the evidence that protects against a repeated effect; payloads are only cost. A
//! [`RetentionPolicy`] is stored per scope in the database (every connection and process sharing the file applies
//! the same rules) and [`Inbox::prune_step`](crate::Inbox::prune_step) applies all of them in small bounded transactions.
//!
//! [`Inbox::prune_step`]: crate::Inbox::prune_step

use std::collections::HashMap;
use std::time::Duration;

use rusqlite::Connection;

use crate::store::db::Db;
use crate::store::error::Result;
use crate::store::identity::{Delivery, IdHash};
use crate::store::outcome::Outcome;

mod prune;
mod records;
pub(crate) mod watermark;

const DAY: i64 = 86_400;

/// What to do with a delivery that was sent before the scope's identity horizon (older than
/// [`Inbox::pruned_before`](crate::Inbox::pruned_before)) and whose identity is not found: it may be new, or a repetition whose identity was
/// pruned, and the inbox can no longer tell which.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ExpiredPolicy {
    /// Treat it as new: the handler runs. Logged and counted (`expired`). Risks a repeated effect.
    Process,
    /// Refuse it: nothing is applied and no identity is recorded. The outcome is [`Outcome::Expired`] with no
    /// quarantine row, which must not be acked ([`Outcome::may_ack`] is false): the caller decides. Counted
    /// (`expired`). The MQTT adapter cannot refuse a delivery without stalling on it, so it quarantines such a
    /// delivery itself and then acks it.
    Reject,
    /// Keep it for an operator in the `quarantine` table and do not apply it: [`Outcome::Expired`] with the
    /// quarantine row id, which may be acked. Counted (`expired` and `quarantined`). The default.
    #[default]
    Quarantine,
}

impl ExpiredPolicy {
    fn to_sql(self) -> i64 {
        match self {
            ExpiredPolicy::Process => 0,
            ExpiredPolicy::Reject => 1,
            ExpiredPolicy::Quarantine => 2,
        }
    }

    fn from_sql(v: i64) -> ExpiredPolicy {
        match v {
            0 => ExpiredPolicy::Process,
            1 => ExpiredPolicy::Reject,
            _ => ExpiredPolicy::Quarantine,
        }
    }
}

/// How long a scope keeps payloads and identities, and how it deduplicates numbered producers.
///
/// The default keeps everything forever. Every limit is explicit:
///
/// ```
/// use edge_inbox::{ExpiredPolicy, RetentionPolicy};
/// use std::time::Duration;
/// const DAY: Duration = Duration::from_secs(86_400);
/// let policy = RetentionPolicy::new()
///     .processed_payloads(Duration::from_secs(3_600)) // bodies of processed messages: an hour
///     .dead_letter_payloads(30 * DAY) // dead letters: a month, for the operator
///     .identity_horizon(90 * DAY) // must cover broker retention, relays, DLQ replays, restores
///     .expired(ExpiredPolicy::Quarantine);
/// assert_eq!(policy.get_identity_horizon(), Some(90 * DAY));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionPolicy {
    processed_payloads: Option<Duration>,
    dead_letter_payloads: Option<Duration>,
    identity_horizon: Option<Duration>,
    expired: ExpiredPolicy,
    clock_skew: Duration,
    first_sequence: Option<u64>,
    records: Option<Duration>,
}

impl Default for RetentionPolicy {
    fn default() -> Self {
        RetentionPolicy {
            processed_payloads: None,
            dead_letter_payloads: None,
            identity_horizon: None,
            expired: ExpiredPolicy::default(),
            clock_skew: Duration::from_secs(300),
            first_sequence: None,
            records: None,
        }
    }
}

impl RetentionPolicy {
    /// Keep everything forever (the default).
    pub fn new() -> Self {
        Self::default()
    }

    /// Delete stored messages in state *processed* this long after they finished. Their identities stay (an
    /// [identity horizon](Self::identity_horizon), if set, applies to them on its own: a processed body kept
    /// longer than the horizon does not hold its identity back).
    pub fn processed_payloads(mut self, age: Duration) -> Self {
        self.processed_payloads = Some(age);
        self
    }

    /// Delete stored messages in state *dead-lettered* this long after they were given up. Their identities
    /// stay. Keep them long enough for an operator to look at them.
    pub fn dead_letter_payloads(mut self, age: Duration) -> Self {
        self.dead_letter_payloads = Some(age);
        self
    }

    /// Delete identities committed longer ago than `horizon` (rounded up to whole days). Default: never.
    ///
    /// After this, a repetition older than the horizon can no longer be recognised as a duplicate. The horizon
    /// must be longer than any path on which an old message can come back: the broker's retention of queued and
    /// retained messages, a relay or bridge that republishes, a dead-letter queue that is replayed, a restore of
    /// the producer or broker from a backup, and any deliberate replay. Deliveries that carry
    /// [`Delivery::sent_at`] and are older than what was pruned follow the [`ExpiredPolicy`]; others are
    /// taken as new. An identity whose send time is ahead of its commit (a producer's clock running ahead)
    /// counts from its send time, so that its repetitions are still known to be older than what was pruned.
    pub fn identity_horizon(mut self, horizon: Duration) -> Self {
        self.identity_horizon = Some(horizon);
        self
    }

    /// What to do with a delivery sent before the pruned horizon whose identity is not found. Default
    /// [`ExpiredPolicy::Quarantine`].
    pub fn expired(mut self, policy: ExpiredPolicy) -> Self {
        self.expired = policy;
        self
    }

    /// How far a producer's clock may run ahead of this gateway's. A delivery counts as older than the pruned
    /// horizon when `sent_at < pruned_before + clock_skew`. Default 5 minutes.
    pub fn clock_skew(mut self, skew: Duration) -> Self {
        self.clock_skew = skew;
        self
    }

    /// Opt in to per-producer sequence watermarks: deliveries carrying a producer namespace and a
    /// [`Delivery::sequence`] `>= first` are deduplicated by sequence instead of an identity row.
    ///
    /// The producer must number its messages `first, first + 1, ...` without gaps and never reuse a number.
    /// Then all processed sequences up to the highest contiguous one cost a single row per producer, and
    /// deduplication is exact for ever. Sequences that arrive out of order are kept individually until the gap
    /// closes (a permanent gap keeps them individually for good: still exact, only larger).
    ///
    /// A repeated sequence is compared with the identity that claimed it, kept for the last
    /// [`SEQUENCE_WINDOW`](crate::SEQUENCE_WINDOW) sequences of each producer: the same message is a duplicate,
    /// the same id with other content a conflict, another id (a restarted counter) or a sequence below the window
    /// an [`Outcome::SequenceConflict`], quarantined. Deliveries without a producer or sequence, or with a
    /// sequence below `first` (or above `i64::MAX`), use identity rows as usual. The same message arriving
    /// numbered and not (a bridge that drops the sequence, a replay) is compared across both: with its
    /// identity row, and with the window's record of its number while that is kept. A message id that comes
    /// back under a new number once its first number has left the window is not compared any more: a
    /// producer that republishes under new numbers needs a window that covers how far back it does so, or
    /// identity rows (no watermarks).
    ///
    /// The watermarks are never pruned: each producer name keeps its row (and up to a window's worth of
    /// recent rows) for good, and no retention setting removes them. Use them for a known set of producers;
    /// where publishers choose their producer names freely, identity rows with an
    /// [identity horizon](Self::identity_horizon) keep the disk bounded instead.
    ///
    /// Can only be chosen (or changed) while the scope has recorded nothing (no identity, message, quarantined
    /// delivery, conflict or counter, and no identity ever pruned); to switch an existing consumer, start a
    /// versioned scope (`name@2`). A numbered delivery sent before [`Inbox::pruned_before`](crate::Inbox::pruned_before)
    /// whose sequence is new follows the [`ExpiredPolicy`], as one without a sequence does.
    pub fn sequence_watermarks(mut self, first: u64) -> Self {
        self.first_sequence = Some(first);
        self
    }

    /// Delete the scope's quarantine and conflict records whose last arrival is older than `age`. Default: kept
    /// forever. Each record is small and bounded (see [`QUARANTINE_PREFIX`](crate::QUARANTINE_PREFIX)), but
    /// every distinct bad delivery adds one, so a scope open to untrusted publishers should set this. Only these
    /// records are deleted: never an identity, a stored message or a counter (`quarantined`, `conflicts` and
    /// their `_records` counts are history). A delivery arriving again after its record was deleted makes a new
    /// record.
    pub fn quarantine_and_conflicts(mut self, age: Duration) -> Self {
        self.records = Some(age);
        self
    }

    /// Age after which quarantine and conflict records are deleted (`None`: kept).
    pub fn get_quarantine_and_conflicts(&self) -> Option<Duration> {
        self.records
    }

    /// Age after which processed payloads are deleted (`None`: kept).
    pub fn get_processed_payloads(&self) -> Option<Duration> {
        self.processed_payloads
    }

    /// Age after which dead-lettered payloads are deleted (`None`: kept).
    pub fn get_dead_letter_payloads(&self) -> Option<Duration> {
        self.dead_letter_payloads
    }

    /// The identity horizon (`None`: forever).
    pub fn get_identity_horizon(&self) -> Option<Duration> {
        self.identity_horizon
    }

    /// The policy for deliveries older than the pruned horizon.
    pub fn get_expired(&self) -> ExpiredPolicy {
        self.expired
    }

    /// The allowed clock skew of producers.
    pub fn get_clock_skew(&self) -> Duration {
        self.clock_skew
    }

    /// The first sequence number when sequence watermarks are on.
    pub fn get_sequence_watermarks(&self) -> Option<u64> {
        self.first_sequence
    }
}

/// Sizes of a pruning run. Each step is one short write transaction, so a consumer on the same file keeps
/// committing between steps.
#[derive(Debug, Clone)]
pub struct Pruning {
    batch: usize,
    vacuum_pages: u32,
    pause: Duration,
    idle: u32,
    as_of: Option<i64>,
    truncate_wal: bool,
    max_clock_jump: Duration,
    trust_clock: bool,
    checkpoint_pages: u32,
    sync_steps: bool,
    sync_after_steps: bool,
    sent_outbox: Option<Duration>,
}

impl Default for Pruning {
    fn default() -> Self {
        Pruning {
            batch: 32,
            vacuum_pages: 32,
            pause: Duration::from_millis(10),
            idle: 9,
            as_of: None,
            truncate_wal: false,
            max_clock_jump: Duration::from_secs(30 * DAY as u64),
            trust_clock: false,
            checkpoint_pages: 250,
            sync_steps: false,
            sync_after_steps: false,
            sent_outbox: Some(SENT_OUTBOX_AGE),
        }
    }
}

/// How long [`Pruning::default`] keeps outbox messages the broker confirmed: 7 days.
pub const SENT_OUTBOX_AGE: Duration = Duration::from_secs(7 * DAY as u64);

/// The earliest clock reading retention accepts: 2025-01-01T00:00:00Z, before this version of the inbox
/// existed. A gateway without a real-time clock that boots at 1970 reads less than this.
pub const EARLIEST_PLAUSIBLE_TIME: i64 = 1_735_689_600;

/// What retention made of the clock; see [`clock_verdict`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClockVerdict {
    /// The time can be right: retention acts on it.
    Plausible,
    /// The time is before `floor`: before [`EARLIEST_PLAUSIBLE_TIME`] or before the database was created.
    BeforeFloor {
        /// The earliest plausible time for this database.
        floor: i64,
    },
    /// The time is further ahead of the latest time retention accepted before (`seen`) than
    /// [`Pruning::max_clock_jump`] allows.
    TooFarAhead {
        /// The latest clock reading accepted before.
        seen: i64,
    },
}

impl ClockVerdict {
    /// True for [`ClockVerdict::Plausible`].
    pub fn is_plausible(&self) -> bool {
        matches!(self, ClockVerdict::Plausible)
    }

    /// Why retention refuses to act, in words (`None` when plausible).
    pub fn warning(&self, now: i64) -> Option<String> {
        match *self {
            ClockVerdict::Plausible => None,
            ClockVerdict::BeforeFloor { floor } => Some(format!(
                "the clock reads {now} (Unix seconds), before {floor}, when this database was created or before \
                 this software existed: it cannot be right; retention prunes nothing until it is"
            )),
            ClockVerdict::TooFarAhead { seen } => Some(format!(
                "the clock reads {now} (Unix seconds), {} days after the latest time retention accepted ({seen}): \
                 retention prunes nothing until the time is confirmed (Pruning::trust_clock)",
                now.saturating_sub(seen).div_euclid(DAY)
            )),
        }
    }
}

/// The earliest plausible time for the database on `conn`: [`EARLIEST_PLAUSIBLE_TIME`], or the database's
/// creation time when that is later (and was itself plausible).
pub fn clock_floor(conn: &Connection) -> Result<i64> {
    let created = crate::store::schema::meta_i64(conn, "created_at")?;
    Ok(created
        .filter(|c| *c > EARLIEST_PLAUSIBLE_TIME)
        .unwrap_or(EARLIEST_PLAUSIBLE_TIME))
}

/// Whether retention may act on the time `now` in the database on `conn`: not before [`clock_floor`], and not
/// more than `max_jump` after the latest time an earlier pass accepted.
pub fn clock_verdict(conn: &Connection, now: i64, max_jump: Duration) -> Result<ClockVerdict> {
    let floor = clock_floor(conn)?;
    if now < floor {
        return Ok(ClockVerdict::BeforeFloor { floor });
    }
    if let Some(seen) = crate::store::schema::meta_i64(conn, "clock_seen")? {
        if now.saturating_sub(seen) > max_jump.as_secs().min(i64::MAX as u64) as i64 {
            return Ok(ClockVerdict::TooFarAhead { seen });
        }
    }
    Ok(ClockVerdict::Plausible)
}

impl Pruning {
    /// Rows examined per step (default 32). Smaller steps hold the write lock for less time and leave fewer
    /// pages for the next consumer commit's fsync: beside a consumer committing one delivery at a time, 128
    /// rows per step made its commit p99 about 5x its baseline, 32 about 1.2-2.7x (`retention_bench`).
    pub fn batch(mut self, rows: usize) -> Self {
        self.batch = rows.max(1);
        self
    }

    /// Free pages returned to the file system per step (default 32).
    pub fn vacuum_pages(mut self, pages: u32) -> Self {
        self.vacuum_pages = pages.max(1);
        self
    }

    /// Pause between steps in [`Inbox::prune`](crate::Inbox::prune) (default 10 ms), leaving the write lock to consumers.
    pub fn pause(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    /// In [`Inbox::prune`](crate::Inbox::prune), rest at least `factor` times as long as each step took (default 9), so pruning uses
    /// about a tenth of the disk's time and a consumer rarely meets it: its I/O (WAL writes, checkpoints)
    /// competes with the consumer's fsyncs even when it does not hold the write lock. 0 rests only the fixed
    /// pause. Measured by `examples/retention_bench.rs`: with 9, pruning a million stored messages takes about
    /// six minutes beside a consumer committing one delivery at a time.
    pub fn idle(mut self, factor: u32) -> Self {
        self.idle = factor;
        self
    }

    /// How long [`Inbox::prune`](crate::Inbox::prune) rests after a step that took `took`: the
    /// [pause](Self::pause), or [`idle`](Self::idle) times the step when that is longer. For a tool that runs
    /// [`Inbox::prune_step`](crate::Inbox::prune_step) itself and must pace it the same way.
    pub fn rest_after(&self, took: Duration) -> Duration {
        self.pause.max(took.saturating_mul(self.idle))
    }

    /// Judge ages as if the time were `unix_seconds` instead of the clock (tools and tests).
    pub fn as_of(mut self, unix_seconds: i64) -> Self {
        self.as_of = Some(unix_seconds);
        self
    }

    /// End a pass with `wal_checkpoint(TRUNCATE)` so the WAL file shrinks to zero (default false: a pass
    /// ends with a PASSIVE checkpoint, which copies back what readers allow and leaves the file its size).
    ///
    /// A WAL that starts again from zero appends to its file until it reaches the consumers' checkpoint
    /// threshold, and while it grows every sync also commits the file's new size: on ext4, single-delivery
    /// commits ran at 0.59-0.79x the rate they had on a WAL reused in place, and a 4 KiB write with its sync
    /// cost the device 8.2 KB instead of 4.2 (BENCHMARKS.md, issue 23, fifteenth round). A running consumer
    /// grows the file back within minutes, so shrinking it frees no space for long; SQLite deletes the WAL
    /// anyway when the file's last connection closes, and cuts it back to
    /// [`Config::journal_size_limit`](crate::Config::journal_size_limit) whenever it starts over (with no
    /// limit, -1, a WAL kept this way never shrinks). Turn it on for a file that stays open but idle after
    /// the pass.
    ///
    /// The TRUNCATE holds the write lock while it waits for readers of an older snapshot (a consumer's
    /// checkpoint thread keeps one for the length of its copy), so it gives up after 10 ms (waiting for the
    /// write lock included) and leaves the WAL as it is for the next pass, rather than holding every commit
    /// back for the busy timeout.
    pub fn truncate_wal(mut self, truncate: bool) -> Self {
        self.truncate_wal = truncate;
        self
    }

    /// How far the clock may have moved ahead since the latest time an earlier pass accepted (default 30
    /// days). A larger jump (a clock set to a far-future time, say) makes the pass prune nothing, with a
    /// warning, until the time is confirmed with [`Pruning::trust_clock`]. [`Pruning::as_of`] is a time the
    /// caller states, and is not held to it.
    pub fn max_clock_jump(mut self, jump: Duration) -> Self {
        self.max_clock_jump = jump;
        self
    }

    /// The allowed jump (crate-internal: `inboxctl check` judges with the default).
    pub(crate) fn jump(&self) -> Duration {
        self.max_clock_jump
    }

    /// How far the clock may have moved ahead since the latest accepted pass ([`Pruning::max_clock_jump`]).
    pub fn get_max_clock_jump(&self) -> Duration {
        self.max_clock_jump
    }

    /// After a step that leaves at least `pages` WAL frames not yet copied back, the pruner checkpoints
    /// itself, outside the step's transaction (default 250; 0 leaves checkpoints to the automatic one): a
    /// PASSIVE checkpoint and, once the WAL is twice `pages` long (a consumer committing during the copies
    /// kept it from starting over), a RESTART that copies what consumers committed meanwhile, holding the
    /// write lock for those few frames and their syncs and for at most 10 ms more while it waits for readers
    /// to leave the WAL (not the busy timeout: a long reader, such as a backup, would stall consumers), so
    /// the WAL starts over at the next write.
    ///
    /// Keep twice `pages` below the consumers'
    /// [`Config::wal_autocheckpoint`](crate::Config::wal_autocheckpoint) (10,000 by default): then the WAL never
    /// reaches their threshold while a pass runs, and a consumer's commit does not copy the pruner's pages
    /// into the file (issue 26: about 0.7 to 0.9% of a consumer's commits did during a prune, just under its
    /// p99; 0.002% with this, on a loaded machine).
    /// [`Inbox::prune`](crate::Inbox::prune) does not count the checkpoint's time into its rest
    /// ([`Pruning::idle`]).
    pub fn checkpoint_pages(mut self, pages: u32) -> Self {
        self.checkpoint_pages = pages;
        self
    }

    /// Commit each step at the connection's configured durability, with its own sync, instead of leaving its
    /// frames for a later sync (default false: a lost step is redone by the next pass). Such a commit holds
    /// the write lock through its sync; [`Pruning::sync_after_steps`] syncs once the lock is released.
    pub fn sync_steps(mut self, sync: bool) -> Self {
        self.sync_steps = sync;
        self
    }

    /// After a step that wrote WAL frames has committed (without its own sync) and released the write lock,
    /// sync the WAL on the pruner's connection (default false). Only on an inbox at
    /// [`Synchronous::Full`](crate::Synchronous::Full), where every consumer commit syncs the WAL and
    /// otherwise flushes the step's frames (scattered index pages, tens per step) inside its own fsync; at
    /// `Normal` nothing syncs at commit and neither does this. No lock is held during the sync, so consumers
    /// commit meanwhile; [`Inbox::prune`](crate::Inbox::prune) does not count its time into the rest
    /// ([`Pruning::idle`]). Has no effect with [`Pruning::sync_steps`], whose commits sync anyway.
    ///
    /// Not the default because it did not help where measured (issue 26, `retention_bench`): beside a
    /// consumer committing one delivery at a time, the consumer's commit p99 during a prune was the same
    /// with and without it (1,000,000 rows, fast disk: 4.76 against 4.47 ms; 100,000 rows at 5 ms syncs:
    /// 23.6 and 25.4 against 23.9 and 21.2 ms), while the pruner synced the WAL once more per step (more
    /// flash wear on a card) and the prune took up to 15% longer (not in every run). It may help on
    /// storage whose sync time grows with the pages it flushes, which the measurements did not model.
    ///
    /// When that sync fails, the step returns the error and the connection commits nothing more until its
    /// WAL has been written out again (see "Resolving an unknown commit" in the crate guide).
    pub fn sync_after_steps(mut self, sync: bool) -> Self {
        self.sync_after_steps = sync;
        self
    }

    /// Delete outbox messages the broker confirmed (sent) more than `age` ago; `None` keeps them
    /// ([`Inbox::prune_outbox`](crate::Inbox::prune_outbox) deletes them on demand). Default
    /// [`SENT_OUTBOX_AGE`], 7 days: each keeps its whole payload, and a gateway that publishes for every
    /// delivery would otherwise grow its file with every message it ever sent. Pending and parked messages
    /// are never deleted, and a deleted one's id stays derivable (a delivery handled again after its
    /// identity was pruned publishes it under the same id).
    pub fn sent_outbox(mut self, age: Option<Duration>) -> Self {
        self.sent_outbox = age;
        self
    }

    /// The age after which sent outbox messages are deleted ([`Pruning::sent_outbox`]).
    pub fn get_sent_outbox(&self) -> Option<Duration> {
        self.sent_outbox
    }

    /// Accept the clock even if it jumped further ahead than [`Pruning::max_clock_jump`] (an operator confirmed
    /// the time). A time before the database was created is never accepted.
    pub fn trust_clock(mut self, trust: bool) -> Self {
        self.trust_clock = trust;
        self
    }
}

/// What pruning did: the counts of one step, or summed over [`Inbox::prune`](crate::Inbox::prune).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PruneReport {
    /// Processed messages deleted (their identities stay).
    pub payloads_pruned: u64,
    /// Dead-lettered messages deleted (their identities stay).
    pub dead_letters_pruned: u64,
    /// Identities deleted by an identity horizon.
    pub identities_pruned: u64,
    /// Quarantine records deleted ([`RetentionPolicy::quarantine_and_conflicts`]).
    pub quarantine_pruned: u64,
    /// Conflict records deleted ([`RetentionPolicy::quarantine_and_conflicts`]).
    pub conflicts_pruned: u64,
    /// Sent outbox messages deleted ([`Pruning::sent_outbox`]).
    pub outbox_pruned: u64,
    /// Free pages given back to the file system.
    pub pages_reclaimed: u64,
    /// WAL checkpoints the pruner ran between steps ([`Pruning::checkpoint_pages`]).
    pub checkpoints: u64,
    /// Steps (short transactions) run.
    pub steps: u64,
    /// True when this step finished a pass: everything due was pruned and reclaimed.
    pub done: bool,
    /// True when the clock could not be right ([`ClockVerdict`]), so this pass pruned no message and no
    /// identity (it still reclaimed free space).
    pub clock_refused: bool,
    /// Identities whose stored commit day was before the database could exist, given the day of this pass
    /// instead (so they age from a time that can be right, never faster).
    pub identities_restamped: u64,
}

impl PruneReport {
    fn add(&mut self, o: &PruneReport) {
        self.payloads_pruned += o.payloads_pruned;
        self.dead_letters_pruned += o.dead_letters_pruned;
        self.identities_pruned += o.identities_pruned;
        self.quarantine_pruned += o.quarantine_pruned;
        self.conflicts_pruned += o.conflicts_pruned;
        self.outbox_pruned += o.outbox_pruned;
        self.pages_reclaimed += o.pages_reclaimed;
        self.checkpoints += o.checkpoints;
        self.steps += o.steps;
        self.done = o.done;
        self.clock_refused |= o.clock_refused;
        self.identities_restamped += o.identities_restamped;
    }
}

/// The per-scope rules the identity claim needs, cached in memory.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ScopeRules {
    policy: RetentionPolicy,
    pruned_before: Option<i64>,
}

impl ScopeRules {
    /// The first sequence of a watermark scope.
    #[inline]
    pub(crate) fn watermark_first(&self) -> Option<u64> {
        self.policy.first_sequence
    }
}

#[derive(Debug, Clone, Default)]
enum Phase {
    #[default]
    Messages,
    Identities,
    Records,
    Outbox,
    Vacuum,
    Checkpoint,
}

/// Per-connection retention state: the cached rules of every configured scope and the pruning cursor.
#[derive(Debug, Default)]
pub(crate) struct RetentionState {
    data_version: Option<i64>,
    rules: HashMap<i64, ScopeRules>,
    phase: Phase,
    msg_after: i64,
    id_scope: i64,
    id_after: Vec<u8>,
    /// The records phase's cursor: the next scope to look at.
    rec_scope: i64,
    pass: PruneReport,
    /// How long the last step's WAL sync and checkpoint after its transaction took (not part of the step's
    /// own time, which paces the rest).
    unpaced: Duration,
}

const NO_RULES: ScopeRules = ScopeRules {
    policy: RetentionPolicy {
        processed_payloads: None,
        dead_letter_payloads: None,
        identity_horizon: None,
        expired: ExpiredPolicy::Quarantine,
        clock_skew: Duration::ZERO,
        first_sequence: None,
        records: None,
    },
    pruned_before: None,
};

impl RetentionState {
    /// Reloads the rules when another connection committed since the last look. Called inside the write
    /// transaction, so what it reads cannot change before the commit. `PRAGMA data_version` costs no I/O.
    pub(crate) fn refresh(&mut self, conn: &Db) -> Result<()> {
        let v = conn.data_version()?;
        if self.data_version != Some(v) {
            self.rules = load_rules(conn)?;
            conn.clock_seen.set(load_clock_seen(conn)?);
            self.data_version = Some(v);
        }
        Ok(())
    }

    /// Forces a reload at the next refresh (after this connection changed the rules itself).
    fn invalidate(&mut self) {
        self.data_version = None;
    }

    #[inline]
    pub(crate) fn rules(&self, scope_id: i64) -> &ScopeRules {
        self.rules.get(&scope_id).unwrap_or(&NO_RULES)
    }
}

fn load_clock_seen(conn: &Connection) -> Result<i64> {
    use rusqlite::OptionalExtension;
    Ok(conn
        .prepare_cached(
            "SELECT value FROM inbox_meta WHERE name = 'clock_seen' AND typeof(value) = 'integer'",
        )?
        .query_row([], |r| r.get::<_, i64>(0))
        .optional()?
        .unwrap_or(0))
}

fn load_rules(conn: &Connection) -> Result<HashMap<i64, ScopeRules>> {
    let mut stmt = conn.prepare_cached(
        "SELECT scope_id, processed_payload_age, dead_letter_age, identity_horizon, expired, clock_skew, \
         watermarks, first_sequence, pruned_before, record_age FROM retention",
    )?;
    let rows = stmt.query_map([], |r| {
        let secs = |v: Option<i64>| v.map(|s| Duration::from_secs(s.max(0) as u64));
        let policy = RetentionPolicy {
            processed_payloads: secs(r.get(1)?),
            dead_letter_payloads: secs(r.get(2)?),
            identity_horizon: secs(r.get(3)?),
            expired: ExpiredPolicy::from_sql(r.get(4)?),
            clock_skew: Duration::from_secs(r.get::<_, i64>(5)?.max(0) as u64),
            first_sequence: (r.get::<_, i64>(6)? == 1).then_some(r.get::<_, i64>(7)?.max(0) as u64),
            records: secs(r.get(9)?),
        };
        Ok((
            r.get::<_, i64>(0)?,
            ScopeRules {
                policy,
                pruned_before: r.get(8)?,
            },
        ))
    })?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// Called by `claim_identity` after a *new* identity was inserted: flags a delivery older than what the
/// scope's identity horizon pruned. `None`: go on as new. Costs no query unless the delivery is flagged.
#[inline]
pub(crate) fn check_new_identity(
    conn: &Db,
    d: &Delivery<'_>,
    id_hash: &IdHash,
    scope_id: i64,
    now: i64,
    rules: &ScopeRules,
) -> Result<Option<Outcome>> {
    let Some((sent_at, pruned_before)) = before_horizon(d, rules) else {
        return Ok(None);
    };
    expired(
        conn,
        d,
        Some(id_hash),
        scope_id,
        now,
        rules.policy.expired,
        sent_at,
        pruned_before,
    )
}

/// `(sent_at, pruned_before)` when `d` was sent before what the scope's horizon pruned (allowing the skew).
#[inline]
fn before_horizon(d: &Delivery<'_>, rules: &ScopeRules) -> Option<(i64, i64)> {
    let (pruned_before, sent_at) = (rules.pruned_before?, d.sent_at?);
    let skew = rules.policy.clock_skew.as_secs() as i64;
    (sent_at < pruned_before.saturating_add(skew)).then_some((sent_at, pruned_before))
}

/// Whether a delivery whose claim is new would meet the expired rule (see [`check_new_sequence`]).
#[inline]
pub(crate) fn sent_before_horizon(d: &Delivery<'_>, rules: &ScopeRules) -> bool {
    before_horizon(d, rules).is_some()
}

/// [`check_new_identity`] for a delivery that claimed a new watermark sequence (no identity row): the caller
/// keeps the claim, so that the producer's watermark has no gap. A numbered delivery older than what the
/// horizon pruned may repeat one recorded by an identity row before the scope took watermarks.
#[cold]
pub(crate) fn check_new_sequence(
    conn: &Db,
    d: &Delivery<'_>,
    scope_id: i64,
    now: i64,
    rules: &ScopeRules,
) -> Result<Option<Outcome>> {
    let Some((sent_at, pruned_before)) = before_horizon(d, rules) else {
        return Ok(None);
    };
    expired(
        conn,
        d,
        None,
        scope_id,
        now,
        rules.policy.expired,
        sent_at,
        pruned_before,
    )
}

/// Whether the scope's policy applies a delivery sent before the pruned horizon anyway.
#[inline]
pub(crate) fn processes_expired(rules: &ScopeRules) -> bool {
    rules.policy.expired == ExpiredPolicy::Process
}

#[cold]
#[allow(clippy::too_many_arguments)]
fn expired(
    conn: &Db,
    d: &Delivery<'_>,
    id_hash: Option<&IdHash>,
    scope_id: i64,
    now: i64,
    policy: ExpiredPolicy,
    sent_at: i64,
    pruned_before: i64,
) -> Result<Option<Outcome>> {
    conn.prepare_cached("UPDATE scope_stats SET expired = expired + 1 WHERE scope_id = ?1")?
        .execute([scope_id])?;
    if policy == ExpiredPolicy::Process {
        log::warn!(
            "scope {}: message id {:?} (producer {:?}) sent at {sent_at}, before the pruned identity horizon \
             ({pruned_before}), has no identity: processing it as new by policy (a repetition cannot be ruled out)",
            d.scope,
            d.message_id,
            d.producer
        );
        return Ok(None);
    }
    // Undo the claim: the delivery is not applied, so it must not be remembered as processed.
    if let Some(id_hash) = id_hash {
        conn.prepare_cached("DELETE FROM identities WHERE scope_id = ?1 AND id_hash = ?2")?
            .execute((scope_id, id_hash.as_bytes()))?;
    }
    let quarantined = if policy == ExpiredPolicy::Quarantine {
        let reason = format!(
            "message id {:?} (producer {:?}) sent at {sent_at}, before the pruned identity horizon ({pruned_before})",
            d.message_id, d.producer
        );
        // The record of this identity and content (a numbered delivery has no identity row to undo).
        let identity = id_hash.copied().unwrap_or_else(|| d.id_hash(&conn.id_key));
        let record = crate::store::records::Quarantine {
            scope_id,
            identity: Some(&identity),
            topic: d.topic,
            payload: d.payload,
            reason: &reason,
            max_topic: usize::MAX,
        };
        Some(crate::store::records::quarantine(conn, &conn.id_key, &record, now)?.0)
    } else {
        None
    };
    log::warn!(
        "scope {}: message id {:?} (producer {:?}) sent at {sent_at}, before the pruned identity horizon \
         ({pruned_before}), has no identity: not applied ({})",
        d.scope,
        d.message_id,
        d.producer,
        if quarantined.is_some() { "quarantined" } else { "rejected" }
    );
    Ok(Some(Outcome::Expired {
        sent_at,
        pruned_before,
        quarantined,
    }))
}

/// A versioned scope name for a rebuilt projection: `versioned_scope("inventory", 2)` is `"inventory@2"`.
///
/// A new version starts with no identities, so replaying the retained history into it applies every message
/// once, while the old scope keeps its identities (and keeps refusing repetitions) until it is retired.
pub fn versioned_scope(scope: &str, version: u32) -> String {
    format!("{scope}@{version}")
}
