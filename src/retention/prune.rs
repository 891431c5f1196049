//! The inbox's retention API: storing a scope's policy, reading its watermarks, and pruning in small bounded
//! transactions. The rules the identity claim applies live in the parent module, below the strong case.

use std::time::Duration;

use rusqlite::{Connection, OptionalExtension};

use crate::inbox::Inbox;
use crate::retention::watermark::Watermark;
use crate::retention::{
    clock_floor, clock_verdict, load_rules, versioned_scope, Phase, PruneReport, Pruning,
    RetentionPolicy, RetentionState,
};
use crate::store::checkpointer::RESTART_WAIT;
use crate::store::config::Synchronous;
use crate::store::db::Db;
use crate::store::error::{Error, Result};
use crate::store::schema::install_busy_handler;
use crate::store::txn::{unix_now, write};
use crate::store::wal_sync;

use super::DAY;

const MAX_BUSY_RETRIES: u32 = 100;

impl Inbox {
    /// Stores the retention policy of `scope` (durably: every connection on the file applies it).
    ///
    /// Errors: [`Error::InvalidArgument`] when the policy turns sequence watermarks on or off (or changes the
    /// first sequence) for a scope that has already recorded deliveries.
    pub fn set_retention(&mut self, scope: &str, policy: &RetentionPolicy) -> Result<()> {
        let scope_id = self.scope_id(scope)?;
        let result = write(&self.conn, || {
            store_policy(&self.conn, scope, scope_id, policy)
        });
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
    /// is not found follow the scope's [`ExpiredPolicy`](crate::ExpiredPolicy).
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
    /// one scope's identities or records, or `batch` sent outbox messages ([`Pruning::sent_outbox`]), or
    /// `vacuum_pages` of free space, or a WAL checkpoint. Each step is its own short
    /// `BEGIN IMMEDIATE` transaction. Call it repeatedly (or use [`Inbox::prune`]) until the report says
    /// `done`; the next call starts a new pass.
    ///
    /// Pending and failed messages are never deleted, and an identity is deleted only once no pending, failed or
    /// dead-lettered message refers to it any more (a processed body is history: its identity follows the
    /// horizon alone).
    ///
    /// After its transaction, a step that left the WAL [`Pruning::checkpoint_pages`] long copies it back
    /// itself (PASSIVE, and RESTART when needed; [`PruneReport::checkpoints`]), so that consumers on the file
    /// never reach their own automatic checkpoint while a pass runs. With [`Pruning::sync_after_steps`] (at
    /// [`Synchronous::Full`]), a step that wrote WAL frames first syncs the WAL itself, outside the lock.
    pub fn prune_step(&mut self, opts: &Pruning) -> Result<PruneReport> {
        let now = opts.as_of.unwrap_or_else(unix_now);
        let mut report = PruneReport {
            steps: 1,
            ..PruneReport::default()
        };
        // A prune step need not survive a power loss (a lost step is redone by the next pass; WAL keeps the file
        // consistent), so it skips the fsync and holds the write lock for less time. Consumers' own commits keep
        // their configured durability, and their next fsync covers these frames too.
        if !opts.sync_steps {
            self.conn.start_relaxed();
        }
        let pages = wal_sync::pages_written(&self.conn);
        let result = self.prune_phase(opts, now, &mut report);
        let restored = self.conn.end_relaxed();
        result?;
        restored?;
        self.retention.unpaced = Duration::ZERO;
        if opts.sync_after_steps
            && !opts.sync_steps
            && self.config.synchronous == Synchronous::Full
            && wal_sync::pages_written(&self.conn) != pages
        {
            // The write lock is released: the step's frames reach the disk now, on this connection's time,
            // not inside the next consumer's fsync of the WAL.
            let started = std::time::Instant::now();
            if let Err(e) = wal_sync::sync_wal(&self.conn) {
                self.conn
                    .note_wal_sync_failed(e.sqlite_code().unwrap_or(-1));
                return Err(e);
            }
            self.retention.unpaced = started.elapsed();
        }
        if opts.checkpoint_pages > 0
            && !self.conn.wal_unsynced()
            && self.conn.wear.frames_not_copied() >= i64::from(opts.checkpoint_pages)
        {
            // Between transactions, at the configured durability (the checkpoint syncs the WAL first, so the
            // step's unsynced frames are durable before any of them reaches the database file).
            let started = std::time::Instant::now();
            let before = self.conn.wear.checkpoints();
            // The WAL did not start over since twice the threshold: make it (see `Wear::checkpoint`).
            self.conn.wear.checkpoint(
                &self.conn,
                2 * i64::from(opts.checkpoint_pages),
                self.config.busy_timeout,
            );
            report.checkpoints = self.conn.wear.checkpoints() - before;
            let _ = self.conn.note_checkpoint_io_errors();
            self.retention.unpaced += started.elapsed();
        }
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
            let took = started.elapsed().saturating_sub(self.retention.unpaced);
            let rest = opts.rest_after(took);
            if !rest.is_zero() {
                std::thread::sleep(rest);
            }
        }
    }

    fn prune_phase(&mut self, opts: &Pruning, now: i64, report: &mut PruneReport) -> Result<()> {
        if matches!(
            self.retention.phase,
            Phase::Messages | Phase::Identities | Phase::Records | Phase::Outbox
        ) {
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
            Phase::Records => self.prune_records(opts, now, report)?,
            Phase::Outbox => self.prune_sent_outbox(opts, now, report)?,
            Phase::Vacuum => {
                let freed = vacuum_step(&self.conn, opts.vacuum_pages)?;
                report.pages_reclaimed = freed;
                if freed == 0 {
                    self.retention.phase = Phase::Checkpoint;
                }
            }
            Phase::Checkpoint => {
                // After a failed sync, no checkpoint before the WAL is written out again (or the disk's error,
                // for the next step to try again).
                self.conn.write_out_unsynced_wal()?;
                if let Err(e) = checkpoint(&self.conn, opts.truncate_wal, self.config.busy_timeout)
                {
                    if let Some(code) = e.sqlite_code() {
                        self.conn.note_if_io_error(code);
                    }
                    return Err(e);
                }
                self.retention.phase = Phase::Messages;
                report.done = true;
            }
        }
        Ok(())
    }

    /// One step of [`Pruning::sent_outbox`]: up to a batch of the oldest sent outbox messages past the age.
    fn prune_sent_outbox(
        &mut self,
        opts: &Pruning,
        now: i64,
        report: &mut PruneReport,
    ) -> Result<()> {
        let Some(age) = opts.sent_outbox else {
            self.retention.phase = Phase::Vacuum;
            return Ok(());
        };
        let before = now.saturating_sub(age.as_secs().min(i64::MAX as u64) as i64);
        let batch = opts.batch as i64;
        let deleted = self.write_step(|conn, _| {
            // Marked sent under a clock that could not be right (a gateway booted at 1970): aged from now
            // instead, as messages and records are, never deleted on the bad time.
            conn.prepare_cached("UPDATE outbox SET sent_at = ?1 WHERE state = 1 AND sent_at < ?2")?
                .execute((now, clock_floor(conn)?))?;
            crate::outbox::delete_sent(conn, before, batch)
        })?;
        report.outbox_pruned += deleted as u64;
        if (deleted as i64) < batch {
            self.retention.phase = Phase::Vacuum;
        }
        Ok(())
    }

    /// Runs `f` in one write transaction, with the retention rules as they stand inside it: what the step
    /// deletes is judged on rules no other connection can change before its commit.
    fn write_step<T>(
        &mut self,
        f: impl FnOnce(&Connection, &RetentionState) -> Result<T>,
    ) -> Result<T> {
        let (conn, retention) = (&self.conn, &mut self.retention);
        write(conn, || {
            retention.refresh(conn)?;
            f(conn, retention)
        })
    }

    fn prune_messages(&mut self, opts: &Pruning, now: i64, report: &mut PruneReport) -> Result<()> {
        let after = self.retention.msg_after;
        let batch = opts.batch as i64;
        let (upper, pruned) = self.write_step(|conn, _| {
            let upper: Option<i64> = conn
                .prepare_cached("SELECT max(seq) FROM (SELECT seq FROM messages WHERE seq > ?1 ORDER BY seq LIMIT ?2)")?
                .query_row((after, batch), |r| r.get(0))?;
            let Some(upper) = upper else { return Ok((None, Vec::new())) };
            // A finish stamped before the database could exist came from a wrong clock (a gateway booted at
            // 1970): it ages from now instead, as identities do, never deleted on the bad time.
            conn.prepare_cached(
                "UPDATE messages SET finished_at = ?3 WHERE seq > ?1 AND seq <= ?2 AND state IN (1, 3) \
                 AND coalesce(finished_at, received_at) < ?4",
            )?
            .execute((after, upper, now, clock_floor(conn)?))?;
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
        let cursor = self.retention.id_scope;
        let after = std::mem::take(&mut self.retention.id_after);
        let batch = opts.batch as i64;
        let record_clock = opts.as_of.is_none();
        let today = now.div_euclid(DAY);
        // The scope and its horizon are read inside the transaction that deletes: a policy another connection
        // changed a moment earlier is the one applied.
        let step = self.write_step(|conn, state| {
            // The next scope with a horizon, at or after the cursor.
            let next = state
                .rules
                .iter()
                .filter_map(|(id, r)| r.policy.identity_horizon.map(|h| (*id, h)))
                .filter(|(id, _)| *id >= cursor)
                .min_by_key(|(id, _)| *id);
            let Some((scope_id, horizon)) = next else {
                if record_clock {
                    // The clock was judged plausible for this pass: later passes measure jumps from here.
                    conn.prepare_cached(
                        "INSERT INTO inbox_meta (name, value) VALUES ('clock_seen', ?1) ON CONFLICT (name) \
                         DO UPDATE SET value = max(coalesce(value, ?1), ?1)",
                    )?
                    .execute([now])?;
                }
                return Ok(None);
            };
            let after: &[u8] = if scope_id == cursor { &after } else { &[] };
            let floor_day = clock_floor(conn)?.div_euclid(DAY);
            // Whole days only, rounded so that every deleted identity is older than the horizon.
            let cutoff_day = now
                .saturating_sub(i64::try_from(horizon.as_secs()).unwrap_or(i64::MAX))
                .div_euclid(DAY);
            let upper: Option<Vec<u8>> = conn
                .prepare_cached(
                    "SELECT max(id_hash) FROM (SELECT id_hash FROM identities WHERE scope_id = ?1 AND id_hash > ?2 \
                     ORDER BY id_hash LIMIT ?3)",
                )?
                .query_row((scope_id, after, batch), |r| r.get(0))?;
            let Some(upper) = upper else { return Ok(Some((scope_id, None, Vec::new(), 0))) };
            // A commit day before the database could exist was stamped by a clock that was wrong (a gateway
            // booted at 1970): it says nothing about the identity's age. Give it today instead, so it ages from a
            // time that can be right and is kept at least a full horizon from now; never pruned on the bad day.
            let restamped = conn
                .prepare_cached(
                    "UPDATE identities SET day = CASE WHEN day < 0 THEN -1 - ?5 ELSE ?5 END \
                     WHERE scope_id = ?1 AND id_hash > ?2 AND id_hash <= ?3 \
                     AND (CASE WHEN day < 0 THEN -1 - day ELSE day END) < ?4",
                )?
                .execute((scope_id, after, &upper[..], floor_day, today))?;
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
                       SELECT 1 FROM messages m WHERE m.scope_id = ?1 AND m.id_hash = i.id_hash \
                       AND m.state IN (0, 2, 3)) \
                     RETURNING day",
                )?
                .query_map((scope_id, after, &upper[..], cutoff_day), |r| r.get::<_, i64>(0))?
                .collect::<rusqlite::Result<Vec<i64>>>()?;
            if let Some(max_day) = days.iter().max() {
                let bound = (max_day + 1) * DAY;
                conn.prepare_cached(
                    "UPDATE retention SET pruned_before = max(coalesce(pruned_before, ?2), ?2) WHERE scope_id = ?1",
                )?
                .execute((scope_id, bound))?;
                conn.prepare_cached(
                    // The deleted rows leave the derived processed figure unchanged (see `schema.sql`).
                    "UPDATE scope_stats SET identities_pruned = identities_pruned + ?2, \
                     identity_offset = identity_offset - ?2 WHERE scope_id = ?1",
                )?
                .execute((scope_id, days.len() as i64))?;
                log::info!(
                    "scope {scope_id}: pruned {} identities committed before day {cutoff_day} (Unix days)",
                    days.len()
                );
            }
            Ok(Some((scope_id, Some(upper), days, restamped as u64)))
        })?;
        // This connection wrote pruned_before or clock_seen itself: data_version does not see that.
        self.retention.invalidate();
        let Some((scope_id, upper, days, restamped)) = step else {
            self.retention.phase = Phase::Records;
            return Ok(());
        };
        report.identities_restamped += restamped;
        report.identities_pruned += days.len() as u64;
        self.retention.id_scope = scope_id;
        match upper {
            Some(upper) => self.retention.id_after = upper,
            None => self.retention.id_scope = scope_id + 1,
        }
        Ok(())
    }
}

/// Whether a scope has recorded anything: an identity pruned long ago still left `pruned_before` and its
/// counters behind, and a repetition of it must keep meeting the expired rule, not a fresh watermark.
const SCOPE_USED: &str = "SELECT EXISTS (SELECT 1 FROM identities WHERE scope_id = ?1) \
     OR EXISTS (SELECT 1 FROM watermarks WHERE scope_id = ?1) \
     OR EXISTS (SELECT 1 FROM watermark_exceptions WHERE scope_id = ?1) \
     OR EXISTS (SELECT 1 FROM watermark_recent WHERE scope_id = ?1) \
     OR EXISTS (SELECT 1 FROM messages WHERE scope_id = ?1) \
     OR EXISTS (SELECT 1 FROM quarantine WHERE scope_id = ?1) \
     OR EXISTS (SELECT 1 FROM conflicts WHERE scope_id = ?1) \
     OR EXISTS (SELECT 1 FROM retention WHERE scope_id = ?1 AND pruned_before IS NOT NULL) \
     OR EXISTS (SELECT 1 FROM scope_stats WHERE scope_id = ?1 AND (processed, duplicates, conflicts, \
        handler_failures, quarantined, dead_lettered, identities_pruned, payloads_pruned, expired, \
        sequence_conflicts, identities_restamped, identity_offset) != (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))";

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
            .prepare_cached(SCOPE_USED)?
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
         clock_skew, watermarks, first_sequence, record_age) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) \
         ON CONFLICT (scope_id) DO UPDATE SET processed_payload_age = excluded.processed_payload_age, \
         dead_letter_age = excluded.dead_letter_age, identity_horizon = excluded.identity_horizon, \
         expired = excluded.expired, clock_skew = excluded.clock_skew, watermarks = excluded.watermarks, \
         first_sequence = excluded.first_sequence, record_age = excluded.record_age",
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
        secs(policy.records),
    ))?;
    Ok(())
}

/// Returns up to `pages` free pages to the file system in one short write transaction; the number returned.
fn vacuum_step(conn: &Db, pages: u32) -> Result<u64> {
    write(conn, || {
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
    })
}

/// Copies the WAL back into the database without blocking writers, then optionally truncates it. The
/// TRUNCATE holds the write lock while it waits for readers on an old snapshot (a consumer's checkpoint
/// thread pins one for the length of a round, and for good after a failed sync of the database file), so
/// it waits [`RESTART_WAIT`] at most, not the busy timeout that every commit would wait behind it too;
/// that bound covers its wait for the write lock as well, so beside a writer that seldom lets go of it the
/// TRUNCATE is skipped more often (the next pass tries again).
fn checkpoint(conn: &Connection, truncate: bool, busy_timeout: Duration) -> Result<()> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))?;
    if truncate {
        install_busy_handler(conn, RESTART_WAIT)?;
        let busy = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
            r.get::<_, i64>(0)
        });
        // The TRUNCATE's error (an I/O error the caller records) before one of restoring the handler.
        let restored = install_busy_handler(conn, busy_timeout);
        let busy = busy?;
        restored?;
        if busy != 0 {
            log::debug!("WAL truncate skipped: the database was busy");
        }
    }
    Ok(())
}

impl Inbox {
    /// The sequence watermark recorded for `producer` in `scope` (empty when nothing is recorded).
    pub fn watermark(&mut self, scope: &str, producer: &str) -> Result<Watermark> {
        let scope_id = self.scope_id(scope)?;
        let high: Option<i64> = self
            .conn
            .prepare_cached("SELECT high FROM watermarks WHERE scope_id = ?1 AND producer = ?2")?
            .query_row((scope_id, producer), |r| r.get(0))
            .optional()?;
        let mut stmt = self.conn.prepare_cached(
            "SELECT sequence FROM watermark_exceptions WHERE scope_id = ?1 AND producer = ?2 ORDER BY sequence",
        )?;
        let exceptions = stmt
            .query_map((scope_id, producer), |r| {
                r.get::<_, i64>(0).map(|s| s as u64)
            })?
            .collect::<rusqlite::Result<Vec<u64>>>()?;
        Ok(Watermark {
            high: high.map(|h| h as u64),
            exceptions,
        })
    }
}
