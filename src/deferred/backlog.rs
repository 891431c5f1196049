//! Backlog of the received-then-deferred mode: how much acknowledged work is waiting, and how old it is.

use std::time::Duration;

use crate::inbox::Inbox;
use crate::store::error::Result;
use crate::store::txn::unix_now_ms;

/// A snapshot of one scope's deferred work, from [`Inbox::backlog`]. One read transaction: the numbers agree.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Backlog {
    /// Messages stored and acknowledged but not yet processed (state pending), including those in flight.
    pub pending: u64,
    /// Age of the oldest message not yet processed (pending, or failed and waiting for a retry), measured from
    /// its receipt, in whole seconds. `None` when there is none.
    pub oldest_pending_age: Option<Duration>,
    /// Open messages under a live lease: a worker is applying them now.
    pub in_flight: u64,
    /// Messages whose last attempt failed, waiting for their backoff before a retry.
    pub failed: u64,
    /// Messages given up after the maximum attempts, kept for an operator ([`Inbox::requeue_dead_letters`]).
    pub dead_letters: u64,
}

impl Backlog {
    /// True when the backlog is beyond `threshold`: its oldest unprocessed message is older than
    /// [`BacklogThreshold::max_age`], or the open count (pending + failed) exceeds
    /// [`BacklogThreshold::max_open`].
    pub fn exceeds(&self, threshold: &BacklogThreshold) -> bool {
        self.oldest_pending_age
            .is_some_and(|age| age > threshold.max_age)
            || threshold
                .max_open
                .is_some_and(|max| self.pending + self.failed > max)
    }
}

/// When a backlog deserves a warning; see [`Inbox::warn_if_backlogged`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BacklogThreshold {
    /// Oldest unprocessed message age above which the backlog is reported. Default 5 minutes.
    pub max_age: Duration,
    /// Open message count above which the backlog is reported. Default `None` (age only).
    pub max_open: Option<u64>,
}

impl Default for BacklogThreshold {
    fn default() -> Self {
        BacklogThreshold {
            max_age: Duration::from_secs(300),
            max_open: None,
        }
    }
}

impl Inbox {
    /// The deferred-mode backlog of `scope` (all zero for a scope never seen).
    pub fn backlog(&self, scope: &str) -> Result<Backlog> {
        let now_ms = unix_now_ms();
        let row = self
            .conn
            .prepare_cached(
                "SELECT count(*) FILTER (WHERE state = 0), min(received_at), \
                 count(*) FILTER (WHERE lease_until >= ?2), count(*) FILTER (WHERE state = 2), \
                 coalesce((SELECT count(*) FROM messages WHERE scope_id = s.id AND state = 3), 0) \
                 FROM scopes s LEFT JOIN messages m ON m.scope_id = s.id AND m.state IN (0, 2) \
                 WHERE s.name = ?1",
            )?
            .query_row((scope, now_ms), |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Option<i64>>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, i64>(3)?,
                    r.get::<_, i64>(4)?,
                ))
            })?;
        let (pending, oldest, in_flight, failed, dead) = row;
        let now = now_ms.div_euclid(1000);
        Ok(Backlog {
            pending: pending as u64,
            oldest_pending_age: oldest
                .map(|at| Duration::from_secs(now.saturating_sub(at).max(0) as u64)),
            in_flight: in_flight as u64,
            failed: failed as u64,
            dead_letters: dead as u64,
        })
    }

    /// Reads [`Inbox::backlog`] and logs a warning (`log` crate, target `edge_inbox::backlog`) when it
    /// [exceeds](Backlog::exceeds) `threshold`. Call it periodically from the
    /// loop that runs the workers. Returns the snapshot either way.
    pub fn warn_if_backlogged(&self, scope: &str, threshold: &BacklogThreshold) -> Result<Backlog> {
        let b = self.backlog(scope)?;
        if b.exceeds(threshold) {
            log::warn!(
                "scope {scope}: deferred backlog of {} pending, {} failed, oldest {}s (threshold {}s); \
                 {} in flight, {} dead letters",
                b.pending,
                b.failed,
                b.oldest_pending_age.unwrap_or_default().as_secs(),
                threshold.max_age.as_secs(),
                b.in_flight,
                b.dead_letters
            );
        }
        Ok(b)
    }
}
