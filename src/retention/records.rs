//! The retention step for quarantine and conflict records: rows whose last arrival is older than the scope's
//! [`RetentionPolicy::quarantine_and_conflicts`](crate::RetentionPolicy::quarantine_and_conflicts) age are
//! deleted, a bounded number per step, one scope at a time. Nothing else is touched: identities, stored messages
//! and counters stay.

use std::time::Duration;

use crate::inbox::Inbox;
use crate::retention::{clock_floor, Phase, PruneReport, Pruning};
use crate::store::error::Result;
use crate::store::txn::{begin, commit};

impl Inbox {
    /// One step of the records phase: up to `batch` quarantine rows and `batch` conflict rows of the next scope
    /// with a record age, in one short write transaction. Moves to the next scope once one has nothing more due,
    /// and to the outbox phase after the last.
    pub(super) fn prune_records(
        &mut self,
        opts: &Pruning,
        now: i64,
        report: &mut PruneReport,
    ) -> Result<()> {
        let cursor = self.retention.rec_scope;
        let batch = opts.batch as i64;
        begin(&self.conn)?;
        // The scope and its age are read inside the transaction that deletes: a policy another connection
        // changed a moment earlier is the one applied.
        let result = self.retention.refresh(&self.conn).and_then(|()| {
            let next: Option<(i64, Duration)> = self
                .retention
                .rules
                .iter()
                .filter_map(|(id, r)| r.policy.records.map(|age| (*id, age)))
                .filter(|(id, _)| *id >= cursor)
                .min_by_key(|(id, _)| *id);
            let Some((scope_id, age)) = next else {
                return Ok(None);
            };
            let cutoff = now.saturating_sub(age.as_secs().min(i64::MAX as u64) as i64);
            // Stamped before the database could exist by a wrong clock (a gateway booted at 1970): such a
            // record ages from now instead, as identities do, never deleted on the bad time.
            let floor = clock_floor(&self.conn)?;
            for table in ["quarantine", "conflicts"] {
                self.conn
                    .prepare_cached(&format!(
                        "UPDATE {table} SET last_at = ?2 WHERE scope_id = ?1 AND last_at < ?3"
                    ))?
                    .execute((scope_id, now, floor))?;
            }
            // Through the (scope_id, last_at) indexes: only rows that are due are visited.
            let quarantine = self
                .conn
                .prepare_cached(
                    "DELETE FROM quarantine WHERE id IN (SELECT id FROM quarantine WHERE scope_id = ?1 \
                     AND last_at <= ?2 LIMIT ?3)",
                )?
                .execute((scope_id, cutoff, batch))?;
            let conflicts = self
                .conn
                .prepare_cached(
                    "DELETE FROM conflicts WHERE id IN (SELECT id FROM conflicts WHERE scope_id = ?1 \
                     AND last_at <= ?2 LIMIT ?3)",
                )?
                .execute((scope_id, cutoff, batch))?;
            Ok(Some((scope_id, cutoff, quarantine, conflicts)))
        });
        let result = result.and_then(|v| commit(&self.conn).map(|()| v));
        if result.is_err() && !self.conn.is_autocommit() {
            let _ = self.conn.execute_batch("ROLLBACK");
        }
        let Some((scope_id, cutoff, quarantine, conflicts)) = result? else {
            self.retention.phase = Phase::Outbox;
            self.retention.rec_scope = 0;
            return Ok(());
        };
        report.quarantine_pruned += quarantine as u64;
        report.conflicts_pruned += conflicts as u64;
        if quarantine + conflicts > 0 {
            log::info!(
                "scope {scope_id}: pruned {quarantine} quarantine and {conflicts} conflict records last seen before \
                 {cutoff} (Unix seconds)"
            );
        }
        if (quarantine as i64) < batch && (conflicts as i64) < batch {
            self.retention.rec_scope = scope_id + 1;
        }
        Ok(())
    }
}
