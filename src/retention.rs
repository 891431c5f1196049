//! Retention: payload pruning, the identity horizon and what happens after it, and space reclaim.
//!
//! Identities are the evidence that protects against a repeated effect; payloads are only cost. A
//! [`RetentionPolicy`] is stored per scope in the database (every connection and process sharing the file applies
//! the same rules) and [`Inbox::prune_step`] applies all of them in small bounded transactions.

use std::collections::HashMap;
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension};

use crate::db::Db;
use crate::error::{Error, Result};
use crate::identity::{Delivery, IdHash};
use crate::inbox::{begin, commit, unix_now, Inbox};
use crate::outcome::Outcome;

const DAY: i64 = 86_400;
const MAX_BUSY_RETRIES: u32 = 100;

/// What to do with a delivery that was sent before the scope's identity horizon (older than
/// [`Inbox::pruned_before`]) and whose identity is not found: it may be new, or a repetition whose identity was
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
        }
    }
}

impl RetentionPolicy {
    /// Keep everything forever (the default).
    pub fn new() -> Self {
        Self::default()
    }

    /// Delete stored messages in state *processed* this long after they finished. Their identities stay.
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
    /// taken as new.
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
    /// sequence below `first` (or above `i64::MAX`), use identity rows as usual.
    ///
    /// Can only be chosen (or changed) while the scope has recorded nothing; to switch an existing consumer,
    /// start a versioned scope (`name@2`).
    pub fn sequence_watermarks(mut self, first: u64) -> Self {
        self.first_sequence = Some(first);
        self
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
}

impl Default for Pruning {
    fn default() -> Self {
        Pruning {
            batch: 128,
            vacuum_pages: 32,
            pause: Duration::from_millis(10),
            idle: 9,
            as_of: None,
            truncate_wal: true,
            max_clock_jump: Duration::from_secs(30 * DAY as u64),
            trust_clock: false,
        }
    }
}

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
                (now - seen).div_euclid(DAY)
            )),
        }
    }
}

/// The earliest plausible time for the database on `conn`: [`EARLIEST_PLAUSIBLE_TIME`], or the database's
/// creation time when that is later (and was itself plausible).
pub fn clock_floor(conn: &Connection) -> Result<i64> {
    let created = crate::schema::meta_i64(conn, "created_at")?;
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
    if let Some(seen) = crate::schema::meta_i64(conn, "clock_seen")? {
        if now.saturating_sub(seen) > max_jump.as_secs().min(i64::MAX as u64) as i64 {
            return Ok(ClockVerdict::TooFarAhead { seen });
        }
    }
    Ok(ClockVerdict::Plausible)
}

impl Pruning {
    /// Rows examined per step (default 128). Smaller steps hold the write lock for less time.
    pub fn batch(mut self, rows: usize) -> Self {
        self.batch = rows.max(1);
        self
    }

    /// Free pages returned to the file system per step (default 32).
    pub fn vacuum_pages(mut self, pages: u32) -> Self {
        self.vacuum_pages = pages.max(1);
        self
    }

    /// Pause between steps in [`Inbox::prune`] (default 10 ms), leaving the write lock to consumers.
    pub fn pause(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    /// In [`Inbox::prune`], rest at least `factor` times as long as each step took (default 9), so pruning uses
    /// about a tenth of the disk's time and a consumer rarely meets it: its I/O (WAL writes, checkpoints)
    /// competes with the consumer's fsyncs even when it does not hold the write lock. 0 rests only the fixed
    /// pause. Measured by `examples/retention_bench.rs`: with 9, pruning a million stored messages takes about
    /// six minutes beside a consumer committing one delivery at a time.
    pub fn idle(mut self, factor: u32) -> Self {
        self.idle = factor;
        self
    }

    /// Judge ages as if the time were `unix_seconds` instead of the clock (tools and tests).
    pub fn as_of(mut self, unix_seconds: i64) -> Self {
        self.as_of = Some(unix_seconds);
        self
    }

    /// End a pass with `wal_checkpoint(TRUNCATE)` so the WAL file shrinks to zero (default true).
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

    /// Accept the clock even if it jumped further ahead than [`Pruning::max_clock_jump`] (an operator confirmed
    /// the time). A time before the database was created is never accepted.
    pub fn trust_clock(mut self, trust: bool) -> Self {
        self.trust_clock = trust;
        self
    }
}

/// What pruning did: the counts of one step, or summed over [`Inbox::prune`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PruneReport {
    /// Processed messages deleted (their identities stay).
    pub payloads_pruned: u64,
    /// Dead-lettered messages deleted (their identities stay).
    pub dead_letters_pruned: u64,
    /// Identities deleted by an identity horizon.
    pub identities_pruned: u64,
    /// Free pages given back to the file system.
    pub pages_reclaimed: u64,
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
        self.pages_reclaimed += o.pages_reclaimed;
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
    pass: PruneReport,
}

const NO_RULES: ScopeRules = ScopeRules {
    policy: RetentionPolicy {
        processed_payloads: None,
        dead_letter_payloads: None,
        identity_horizon: None,
        expired: ExpiredPolicy::Quarantine,
        clock_skew: Duration::ZERO,
        first_sequence: None,
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

fn load_rules(conn: &Connection) -> Result<HashMap<i64, ScopeRules>> {
    let mut stmt = conn.prepare_cached(
        "SELECT scope_id, processed_payload_age, dead_letter_age, identity_horizon, expired, clock_skew, \
         watermarks, first_sequence, pruned_before FROM retention",
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
    conn: &Connection,
    d: &Delivery<'_>,
    id_hash: &IdHash,
    scope_id: i64,
    now: i64,
    rules: &ScopeRules,
) -> Result<Option<Outcome>> {
    let (Some(pruned_before), Some(sent_at)) = (rules.pruned_before, d.sent_at) else {
        return Ok(None);
    };
    let skew = rules.policy.clock_skew.as_secs() as i64;
    if sent_at >= pruned_before.saturating_add(skew) {
        return Ok(None);
    }
    expired(
        conn,
        d,
        id_hash,
        scope_id,
        now,
        rules.policy.expired,
        sent_at,
        pruned_before,
    )
}

#[cold]
#[allow(clippy::too_many_arguments)]
fn expired(
    conn: &Connection,
    d: &Delivery<'_>,
    id_hash: &IdHash,
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
    conn.prepare_cached("DELETE FROM identities WHERE scope_id = ?1 AND id_hash = ?2")?
        .execute((scope_id, &id_hash.0[..]))?;
    let quarantined = if policy == ExpiredPolicy::Quarantine {
        let reason = format!(
            "message id {:?} (producer {:?}) sent at {sent_at}, before the pruned identity horizon ({pruned_before})",
            d.message_id, d.producer
        );
        conn.prepare_cached(
            "INSERT INTO quarantine (scope_id, topic, payload, reason, at) VALUES (?1, ?2, ?3, ?4, ?5)",
        )?
        .execute((scope_id, d.topic, d.payload, &reason, now))?;
        let id = conn.last_insert_rowid();
        conn.prepare_cached(
            "UPDATE scope_stats SET quarantined = quarantined + 1 WHERE scope_id = ?1",
        )?
        .execute([scope_id])?;
        Some(id)
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

impl Inbox {
    /// Stores the retention policy of `scope` (durably: every connection on the file applies it).
    ///
    /// Errors: [`Error::InvalidArgument`] when the policy turns sequence watermarks on or off (or changes the
    /// first sequence) for a scope that has already recorded deliveries.
    pub fn set_retention(&mut self, scope: &str, policy: &RetentionPolicy) -> Result<()> {
        let scope_id = self.scope_id(scope)?;
        begin(&self.conn)?;
        let result = store_policy(&self.conn, scope, scope_id, policy);
        let result = result.and_then(|()| commit(&self.conn));
        if result.is_err() && !self.conn.is_autocommit() {
            let _ = self.conn.execute_batch("ROLLBACK");
        }
        self.retention.invalidate();
        result?;
        match policy.identity_horizon {
            Some(h) => log::warn!(
                "scope {scope}: identity horizon set to {} days; repetitions older than that can no longer be \
                 recognised (the horizon must cover broker retention, relays, dead-letter replays and restores)",
                h.as_secs().div_ceil(DAY as u64)
            ),
            None => log::info!("scope {scope}: identities are kept forever"),
        }
        Ok(())
    }

    /// The retention policy of `scope` (the default, keep everything, when none was set).
    pub fn retention(&mut self, scope: &str) -> Result<RetentionPolicy> {
        let scope_id = self.scope_id(scope)?;
        Ok(load_rules(&self.conn)?
            .get(&scope_id)
            .map(|r| r.policy)
            .unwrap_or_default())
    }

    /// Every identity of `scope` pruned so far was committed before this time (Unix seconds); `None` while no
    /// identity of the scope was ever pruned. Deliveries sent before it (allowing the clock skew) whose identity
    /// is not found follow the scope's [`ExpiredPolicy`].
    pub fn pruned_before(&mut self, scope: &str) -> Result<Option<i64>> {
        let scope_id = self.scope_id(scope)?;
        Ok(self
            .conn
            .prepare_cached("SELECT pruned_before FROM retention WHERE scope_id = ?1")?
            .query_row([scope_id], |r| r.get::<_, Option<i64>>(0))
            .optional()?
            .flatten())
    }

    /// One bounded step of pruning over every scope with a policy: a window of `batch` stored messages, or of
    /// one scope's identities, or `vacuum_pages` of free space, or a WAL checkpoint. Each step is its own short
    /// `BEGIN IMMEDIATE` transaction. Call it repeatedly (or use [`Inbox::prune`]) until the report says
    /// `done`; the next call starts a new pass.
    ///
    /// Pending and failed messages are never deleted, and an identity is deleted only once no stored message
    /// refers to it any more.
    pub fn prune_step(&mut self, opts: &Pruning) -> Result<PruneReport> {
        let now = opts.as_of.unwrap_or_else(unix_now);
        let mut report = PruneReport {
            steps: 1,
            ..PruneReport::default()
        };
        // A prune step need not survive a power loss (a lost step is redone by the next pass; WAL keeps the file
        // consistent), so it skips the fsync and holds the write lock for less time. Consumers' own commits keep
        // their configured durability, and their next fsync covers these frames too.
        self.conn.start_relaxed();
        let result = self.prune_phase(opts, now, &mut report);
        let restored = self.conn.end_relaxed();
        result?;
        restored?;
        self.retention.pass.add(&report);
        if report.done {
            let pass = std::mem::take(&mut self.retention.pass);
            if pass.payloads_pruned + pass.dead_letters_pruned + pass.identities_pruned > 0 {
                log::info!(
                    "retention pass: {} processed and {} dead-lettered payloads, {} identities pruned; {} pages \
                     reclaimed in {} steps",
                    pass.payloads_pruned,
                    pass.dead_letters_pruned,
                    pass.identities_pruned,
                    pass.pages_reclaimed,
                    pass.steps
                );
            }
        }
        Ok(report)
    }

    /// Runs [`Inbox::prune_step`] until a pass is complete, pausing between steps; returns the summed report.
    /// A step that finds the database busy (a consumer held the write lock for the whole busy timeout) is
    /// retried after the pause, up to 100 times in a row, before [`Error::Busy`] is returned.
    pub fn prune(&mut self, opts: &Pruning) -> Result<PruneReport> {
        let mut total = PruneReport::default();
        let mut busy = 0;
        loop {
            let started = std::time::Instant::now();
            let step = match self.prune_step(opts) {
                // Maintenance yields to consumers: a step that could not get the write lock is retried later.
                Err(Error::Busy { .. }) if busy < MAX_BUSY_RETRIES => {
                    busy += 1;
                    std::thread::sleep(opts.pause.max(Duration::from_millis(1)));
                    continue;
                }
                other => other?,
            };
            busy = 0;
            total.add(&step);
            if step.done {
                return Ok(total);
            }
            // Leave the disk and the write lock to consumers most of the time: idle at least `idle` times as
            // long as the step took (its I/O competes with their fsyncs even after the lock is released).
            let rest = opts.pause.max(started.elapsed() * opts.idle);
            if !rest.is_zero() {
                std::thread::sleep(rest);
            }
        }
    }

    fn prune_phase(&mut self, opts: &Pruning, now: i64, report: &mut PruneReport) -> Result<()> {
        if matches!(self.retention.phase, Phase::Messages | Phase::Identities) {
            // Ages are only judged on a time that can be right (a gateway without a real-time clock boots at
            // 1970; a bad time source can jump years ahead).
            let jump = if opts.trust_clock || opts.as_of.is_some() {
                Duration::MAX
            } else {
                opts.max_clock_jump
            };
            let verdict = clock_verdict(&self.conn, now, jump)?;
            if let Some(why) = verdict.warning(now) {
                log::warn!("retention: {why}");
                report.clock_refused = true;
                self.retention.phase = Phase::Vacuum;
                self.retention.msg_after = 0;
                return Ok(());
            }
        }
        match self.retention.phase {
            Phase::Messages => self.prune_messages(opts, now, report)?,
            Phase::Identities => self.prune_identities(opts, now, report)?,
            Phase::Vacuum => {
                let freed = vacuum_step(&self.conn, opts.vacuum_pages)?;
                report.pages_reclaimed = freed;
                if freed == 0 {
                    self.retention.phase = Phase::Checkpoint;
                }
            }
            Phase::Checkpoint => {
                checkpoint(&self.conn, opts.truncate_wal)?;
                self.retention.phase = Phase::Messages;
                report.done = true;
            }
        }
        Ok(())
    }

    fn write_step<T>(&mut self, f: impl FnOnce(&Connection) -> Result<T>) -> Result<T> {
        begin(&self.conn)?;
        let result = self
            .retention
            .refresh(&self.conn)
            .and_then(|()| f(&self.conn));
        let result = result.and_then(|v| commit(&self.conn).map(|()| v));
        if result.is_err() && !self.conn.is_autocommit() {
            let _ = self.conn.execute_batch("ROLLBACK");
        }
        result
    }

    fn prune_messages(&mut self, opts: &Pruning, now: i64, report: &mut PruneReport) -> Result<()> {
        let after = self.retention.msg_after;
        let batch = opts.batch as i64;
        let (upper, pruned) = self.write_step(|conn| {
            let upper: Option<i64> = conn
                .prepare_cached("SELECT max(seq) FROM (SELECT seq FROM messages WHERE seq > ?1 ORDER BY seq LIMIT ?2)")?
                .query_row((after, batch), |r| r.get(0))?;
            let Some(upper) = upper else { return Ok((None, Vec::new())) };
            // Only states 1 (processed) and 3 (dead-lettered), each after its own age; never 0 or 2.
            let mut stmt = conn.prepare_cached(
                "DELETE FROM messages AS m WHERE m.seq > ?1 AND m.seq <= ?2 AND m.state IN (1, 3) AND EXISTS ( \
                   SELECT 1 FROM retention r WHERE r.scope_id = m.scope_id AND ( \
                     (m.state = 1 AND r.processed_payload_age IS NOT NULL \
                        AND coalesce(m.finished_at, m.received_at) <= ?3 - r.processed_payload_age) \
                     OR (m.state = 3 AND r.dead_letter_age IS NOT NULL \
                        AND coalesce(m.finished_at, m.received_at) <= ?3 - r.dead_letter_age))) \
                 RETURNING scope_id, state",
            )?;
            let pruned = stmt
                .query_map((after, upper, now), |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            let mut per_scope: Vec<(i64, i64)> = Vec::new();
            for (scope_id, _) in &pruned {
                match per_scope.iter_mut().find(|(s, _)| s == scope_id) {
                    Some((_, n)) => *n += 1,
                    None => per_scope.push((*scope_id, 1)),
                }
            }
            let mut count =
                conn.prepare_cached("UPDATE scope_stats SET payloads_pruned = payloads_pruned + ?2 WHERE scope_id = ?1")?;
            for (scope_id, n) in per_scope {
                count.execute((scope_id, n))?;
            }
            Ok((Some(upper), pruned))
        })?;
        for (_, state) in &pruned {
            if *state == 1 {
                report.payloads_pruned += 1;
            } else {
                report.dead_letters_pruned += 1;
            }
        }
        match upper {
            Some(upper) => self.retention.msg_after = upper,
            None => {
                self.retention.msg_after = 0;
                self.retention.phase = Phase::Identities;
                self.retention.id_scope = 0;
                self.retention.id_after.clear();
            }
        }
        Ok(())
    }

    fn prune_identities(
        &mut self,
        opts: &Pruning,
        now: i64,
        report: &mut PruneReport,
    ) -> Result<()> {
        self.retention.refresh(&self.conn)?;
        // The next scope with a horizon, at or after the cursor.
        let mut scopes: Vec<(i64, Duration)> = self
            .retention
            .rules
            .iter()
            .filter_map(|(id, r)| r.policy.identity_horizon.map(|h| (*id, h)))
            .filter(|(id, _)| *id >= self.retention.id_scope)
            .collect();
        scopes.sort_unstable_by_key(|(id, _)| *id);
        let Some(&(scope_id, horizon)) = scopes.first() else {
            self.retention.phase = Phase::Vacuum;
            if opts.as_of.is_none() {
                // The clock was judged plausible for this pass: later passes measure jumps from here.
                self.write_step(|conn| {
                    conn.prepare_cached(
                        "INSERT INTO inbox_meta (name, value) VALUES ('clock_seen', ?1) ON CONFLICT (name) \
                         DO UPDATE SET value = max(coalesce(value, ?1), ?1)",
                    )?
                    .execute([now])?;
                    Ok(())
                })?;
            }
            return Ok(());
        };
        let floor_day = clock_floor(&self.conn)?.div_euclid(DAY);
        let today = now.div_euclid(DAY);
        if scope_id != self.retention.id_scope {
            self.retention.id_scope = scope_id;
            self.retention.id_after.clear();
        }
        // Whole days only, rounded so that every deleted identity is older than the horizon.
        let cutoff_day = (now - horizon.as_secs() as i64).div_euclid(DAY);
        let after = std::mem::take(&mut self.retention.id_after);
        let batch = opts.batch as i64;
        let (upper, days, restamped) = self.write_step(|conn| {
            let upper: Option<Vec<u8>> = conn
                .prepare_cached(
                    "SELECT max(id_hash) FROM (SELECT id_hash FROM identities WHERE scope_id = ?1 AND id_hash > ?2 \
                     ORDER BY id_hash LIMIT ?3)",
                )?
                .query_row((scope_id, &after[..], batch), |r| r.get(0))?;
            let Some(upper) = upper else { return Ok((None, Vec::new(), 0)) };
            // A commit day before the database could exist was stamped by a clock that was wrong (a gateway
            // booted at 1970): it says nothing about the identity's age. Give it today instead, so it ages from a
            // time that can be right and is kept at least a full horizon from now; never pruned on the bad day.
            let restamped = conn
                .prepare_cached(
                    "UPDATE identities SET day = CASE WHEN day < 0 THEN -1 - ?5 ELSE ?5 END \
                     WHERE scope_id = ?1 AND id_hash > ?2 AND id_hash <= ?3 \
                     AND (CASE WHEN day < 0 THEN -1 - day ELSE day END) < ?4",
                )?
                .execute((scope_id, &after[..], &upper[..], floor_day, today))?;
            if restamped > 0 {
                conn.prepare_cached(
                    "UPDATE scope_stats SET identities_restamped = identities_restamped + ?2 WHERE scope_id = ?1",
                )?
                .execute((scope_id, restamped as i64))?;
                log::warn!(
                    "scope {scope_id}: {restamped} identities carried a commit day before this database could exist \
                     (a clock that was wrong when they were committed); they now count from day {today}"
                );
            }
            let days = conn
                .prepare_cached(
                    "DELETE FROM identities AS i WHERE i.scope_id = ?1 AND i.id_hash > ?2 AND i.id_hash <= ?3 \
                     AND i.day >= 0 AND i.day < ?4 AND NOT EXISTS ( \
                       SELECT 1 FROM messages m WHERE m.scope_id = ?1 AND m.id_hash = i.id_hash) \
                     RETURNING day",
                )?
                .query_map((scope_id, &after[..], &upper[..], cutoff_day), |r| r.get::<_, i64>(0))?
                .collect::<rusqlite::Result<Vec<i64>>>()?;
            if let Some(max_day) = days.iter().max() {
                let bound = (max_day + 1) * DAY;
                conn.prepare_cached(
                    "UPDATE retention SET pruned_before = max(coalesce(pruned_before, ?2), ?2) WHERE scope_id = ?1",
                )?
                .execute((scope_id, bound))?;
                conn.prepare_cached(
                    "UPDATE scope_stats SET identities_pruned = identities_pruned + ?2 WHERE scope_id = ?1",
                )?
                .execute((scope_id, days.len() as i64))?;
                log::info!(
                    "scope {scope_id}: pruned {} identities committed before day {cutoff_day} (Unix days)",
                    days.len()
                );
            }
            Ok((Some(upper), days, restamped as u64))
        })?;
        report.identities_restamped += restamped;
        // This connection wrote pruned_before itself: data_version does not see that.
        self.retention.invalidate();
        report.identities_pruned += days.len() as u64;
        match upper {
            Some(upper) => self.retention.id_after = upper,
            None => self.retention.id_scope = scope_id + 1,
        }
        Ok(())
    }
}

fn store_policy(
    conn: &Connection,
    scope: &str,
    scope_id: i64,
    policy: &RetentionPolicy,
) -> Result<()> {
    let stored: Option<(i64, i64)> = conn
        .prepare_cached("SELECT watermarks, first_sequence FROM retention WHERE scope_id = ?1")?
        .query_row([scope_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    let stored = stored.and_then(|(on, first)| (on == 1).then_some(first as u64));
    if stored != policy.first_sequence {
        let used: bool = conn
            .prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM identities WHERE scope_id = ?1) \
                 OR EXISTS (SELECT 1 FROM watermarks WHERE scope_id = ?1) \
                 OR EXISTS (SELECT 1 FROM watermark_exceptions WHERE scope_id = ?1)",
            )?
            .query_row([scope_id], |r| r.get(0))?;
        if used {
            return Err(Error::InvalidArgument(format!(
                "scope {scope} has already recorded deliveries: sequence watermarks can only be chosen for a new \
                 scope (start a versioned scope such as {})",
                versioned_scope(scope, 2)
            )));
        }
    }
    let secs = |d: Option<Duration>| d.map(|d| d.as_secs().min(i64::MAX as u64) as i64);
    conn.prepare_cached(
        "INSERT INTO retention (scope_id, processed_payload_age, dead_letter_age, identity_horizon, expired, \
         clock_skew, watermarks, first_sequence) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) \
         ON CONFLICT (scope_id) DO UPDATE SET processed_payload_age = excluded.processed_payload_age, \
         dead_letter_age = excluded.dead_letter_age, identity_horizon = excluded.identity_horizon, \
         expired = excluded.expired, clock_skew = excluded.clock_skew, watermarks = excluded.watermarks, \
         first_sequence = excluded.first_sequence",
    )?
    .execute((
        scope_id,
        secs(policy.processed_payloads),
        secs(policy.dead_letter_payloads),
        secs(policy.identity_horizon),
        policy.expired.to_sql(),
        policy.clock_skew.as_secs().min(i64::MAX as u64) as i64,
        policy.first_sequence.is_some() as i64,
        policy.first_sequence.unwrap_or(1).min(i64::MAX as u64) as i64,
    ))?;
    Ok(())
}

/// Returns up to `pages` free pages to the file system in one short write transaction; the number returned.
fn vacuum_step(conn: &Db, pages: u32) -> Result<u64> {
    begin(conn)?;
    let result = (|| -> rusqlite::Result<u64> {
        let before: i64 = conn.query_row("PRAGMA freelist_count", [], |r| r.get(0))?;
        if before == 0 {
            return Ok(0);
        }
        // Each step of this statement frees one page: run it to the end.
        let mut stmt = conn.prepare(&format!("PRAGMA incremental_vacuum({pages})"))?;
        let mut rows = stmt.query([])?;
        while rows.next()?.is_some() {}
        let after: i64 = conn.query_row("PRAGMA freelist_count", [], |r| r.get(0))?;
        Ok((before - after).max(0) as u64)
    })();
    match result {
        Ok(n) => commit(conn).map(|()| n),
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            Err(e.into())
        }
    }
}

/// Copies the WAL back into the database without blocking writers, then optionally truncates it (which waits,
/// within the busy timeout, for a moment with no writer and no reader on an old snapshot).
fn checkpoint(conn: &Connection, truncate: bool) -> Result<()> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))?;
    if truncate {
        let busy: i64 = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))?;
        if busy != 0 {
            log::debug!("WAL truncate skipped: the database was busy");
        }
    }
    Ok(())
}
