//! Dead letters: a delivery the handler keeps refusing is kept, with its reason, instead of being retried forever.

use crate::error::Result;
use crate::identity::Delivery;
use crate::inbox::{begin, claim_identity, commit, unix_now, Inbox};
use crate::outcome::{MessageState, Outcome};

impl Inbox {
    /// Moves a delivery to the dead letters: in one `BEGIN IMMEDIATE` transaction claims its identity and
    /// stores its body in `messages` with state dead-lettered, `attempts` and `last_error = reason`, and
    /// counts it in the scope's `dead_lettered`.
    ///
    /// Once this returns `Ok` the delivery may be acked: a redelivery is then a [`Outcome::Duplicate`] (or a
    /// [`Outcome::Conflict`]), and an operator can requeue the row (state dead-lettered to pending) for the
    /// deferred worker. Returns `Ok(Outcome::Processed)` when the dead letter was recorded, or the
    /// duplicate/conflict outcome when the identity was already committed (then nothing else is written
    /// besides the conflict record).
    ///
    /// The row records one attempt; [`Inbox::dead_letter_after`] records how many there were.
    pub fn dead_letter(&mut self, delivery: &Delivery<'_>, reason: &str) -> Result<Outcome> {
        self.dead_letter_after(delivery, 1, reason)
    }

    /// [`Inbox::dead_letter`] recording that the handler was tried `attempts` times.
    pub fn dead_letter_after(&mut self, delivery: &Delivery<'_>, attempts: u32, reason: &str) -> Result<Outcome> {
        delivery.validate(&self.config.limits)?;
        let scope_id = self.scope_id(delivery.scope)?;
        let now = unix_now();
        begin(&self.conn)?;
        let result = self.dead_letter_in_tx(delivery, scope_id, attempts, reason, now);
        let result = result.and_then(|o| commit(&self.conn).map(|()| o));
        if result.is_err() && !self.conn.is_autocommit() {
            let _ = self.conn.execute_batch("ROLLBACK");
        }
        if let Ok(Outcome::Processed) = result {
            log::warn!(
                "dead-lettered {}/{} (topic {:?}) after {attempts} attempt(s): {reason}",
                delivery.scope,
                delivery.message_id,
                delivery.topic
            );
        }
        result
    }

    fn dead_letter_in_tx(
        &self,
        d: &Delivery<'_>,
        scope_id: i64,
        attempts: u32,
        reason: &str,
        now: i64,
    ) -> Result<Outcome> {
        if let Some(outcome) = claim_identity(&self.conn, d, scope_id, now)? {
            let column = match outcome {
                Outcome::Conflict { .. } => "conflicts = conflicts + 1",
                _ => "duplicates = duplicates + 1",
            };
            self.conn
                .prepare_cached(&format!("UPDATE scope_stats SET {column} WHERE scope_id = ?1"))?
                .execute([scope_id])?;
            return Ok(outcome);
        }
        self.conn
            .prepare_cached(
                "INSERT INTO messages (scope_id, id_hash, producer, message_id, topic, payload, state, attempts, \
                 last_error, received_at, finished_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?10)",
            )?
            .execute((
                scope_id,
                &d.id_hash().0[..],
                d.producer,
                d.message_id,
                d.topic,
                d.payload,
                MessageState::DeadLettered.to_sql(),
                attempts,
                reason,
                now,
            ))?;
        self.conn
            .prepare_cached("UPDATE scope_stats SET dead_lettered = dead_lettered + 1 WHERE scope_id = ?1")?
            .execute([scope_id])?;
        Ok(Outcome::Processed)
    }
}
