//! Dead letters of the received-then-deferred mode: listing them and putting them back to work.

use crate::inbox::Inbox;
use crate::store::error::Result;
use crate::store::txn::{begin, commit};

/// A dead-lettered message, as listed by [`Inbox::dead_letters`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Row id (`messages.seq`), for [`Inbox::requeue_dead_letter`].
    pub seq: i64,
    /// Producer namespace, if any.
    pub producer: Option<String>,
    /// The application message id.
    pub message_id: String,
    /// Topic the delivery arrived on.
    pub topic: String,
    /// Handler failures recorded.
    pub attempts: u32,
    /// Text of the last handler error.
    pub last_error: Option<String>,
    /// When it was dead-lettered, Unix seconds.
    pub at: Option<i64>,
}

impl Inbox {
    /// Up to `limit` dead letters of `scope`, oldest first.
    pub fn dead_letters(&self, scope: &str, limit: usize) -> Result<Vec<DeadLetter>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT m.seq, m.producer, m.message_id, m.topic, m.attempts, m.last_error, m.finished_at \
             FROM messages m JOIN scopes s ON s.id = m.scope_id WHERE s.name = ?1 AND m.state = 3 \
             ORDER BY m.seq LIMIT ?2",
        )?;
        let rows = stmt.query_map((scope, limit.min(i64::MAX as usize) as i64), |r| {
            Ok(DeadLetter {
                seq: r.get(0)?,
                producer: r.get(1)?,
                message_id: r.get(2)?,
                topic: r.get(3)?,
                attempts: r.get::<_, i64>(4)?.max(0) as u32,
                last_error: r.get(5)?,
                at: r.get(6)?,
            })
        })?;
        let mut out = Vec::new();
        for row in rows {
            out.push(row?);
        }
        Ok(out)
    }

    /// Puts every dead letter of `scope` back to pending with its attempts reset, in one transaction, and
    /// returns how many. They keep their arrival position (`seq`), so for an order key a requeued message runs
    /// before later messages of the same key that are still open (one a worker already claimed gives its
    /// lease back at commit and follows). Dead letters whose payload was pruned cannot be processed and stay
    /// where they are. `last_error` is kept for reference until the next failure.
    ///
    /// This also covers rows dead-lettered by the strong-case path ([`Inbox::process`] callers), since the
    /// worker restores the identity when it applies them (unless a sequence watermark holds it).
    ///
    /// A scope the inbox does not know requeues nothing and returns 0, as [`Inbox::scope_stats`] reads zeros
    /// for it: a caller that must tell a typo from a scope without dead letters checks the name first
    /// ([`inspect::scope_exists`](crate::inspect::scope_exists)).
    pub fn requeue_dead_letters(&mut self, scope: &str) -> Result<usize> {
        self.requeue_where(
            "UPDATE messages SET state = 0, attempts = 0, not_before = 0, lease_owner = NULL, lease_until = NULL, \
             finished_at = NULL WHERE scope_id = (SELECT id FROM scopes WHERE name = ?1) AND state = 3 \
             AND payload IS NOT NULL",
            scope,
        )
    }

    /// Puts the dead letter `seq` back to pending with its attempts reset. False when `seq` is not a dead
    /// letter (or its payload was pruned).
    pub fn requeue_dead_letter(&mut self, seq: i64) -> Result<bool> {
        self.requeue_where(
            "UPDATE messages SET state = 0, attempts = 0, not_before = 0, lease_owner = NULL, lease_until = NULL, \
             finished_at = NULL WHERE seq = ?1 AND state = 3 AND payload IS NOT NULL",
            seq,
        )
        .map(|n| n == 1)
    }

    fn requeue_where(&mut self, sql: &str, arg: impl rusqlite::ToSql) -> Result<usize> {
        begin(&self.conn)?;
        let result = (|| -> Result<usize> {
            let n = self.conn.prepare_cached(sql)?.execute([arg])?;
            commit(&self.conn)?;
            Ok(n)
        })();
        if result.is_err() && !self.conn.is_autocommit() {
            let _ = self.conn.execute_batch("ROLLBACK");
        }
        if let Ok(n) = result {
            if n > 0 {
                log::info!("requeued {n} dead letter(s)");
            }
        }
        result
    }
}
