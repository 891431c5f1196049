//! Dead letters: a delivery the handler keeps refusing is kept, with its reason, instead of being retried forever.

use crate::deferred::receive::open_body_clash;
use crate::inbox::{claim_identity, Claim, Inbox};
use crate::store::error::{is_unique_violation, Result};
use crate::store::identity::Delivery;
use crate::store::outcome::{MessageState, Outcome};
use crate::store::txn::{begin, commit, unix_now};

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
    pub fn dead_letter_after(
        &mut self,
        delivery: &Delivery<'_>,
        attempts: u32,
        reason: &str,
    ) -> Result<Outcome> {
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
        &mut self,
        d: &Delivery<'_>,
        scope_id: i64,
        attempts: u32,
        reason: &str,
        now: i64,
    ) -> Result<Outcome> {
        self.retention.refresh(&self.conn)?;
        // Stamped never before the clock retention accepted, so that its retention does not delete it early.
        let now = crate::store::records::stamp(&self.conn, now);
        let rules = self.retention.rules(scope_id);
        let claim = claim_identity(&self.conn, d, scope_id, rules, now)?;
        let rows = claim.rows();
        if let Claim::Settled(outcome) = claim {
            return self.count_settled(scope_id, outcome);
        }
        let id_hash = d.id_hash(&self.conn.id_key);
        let inserted = self
            .conn
            .prepare_cached(
                "INSERT INTO messages (scope_id, id_hash, producer, message_id, topic, payload, state, attempts, \
                 last_error, received_at, finished_at, sequence, sent_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?10, ?11, ?12)",
            )?
            .execute((
                scope_id,
                id_hash.as_bytes(),
                d.producer,
                d.message_id,
                d.topic,
                d.payload,
                MessageState::DeadLettered.to_sql(),
                attempts,
                reason,
                now,
                d.sequence.map(|s| s as i64),
                d.sent_at,
            ));
        match inserted {
            Ok(_) => {}
            // An open or dead-lettered body of the same id without an identity of its own.
            Err(e) if is_unique_violation(&e) => {
                let outcome = open_body_clash(&self.conn, d, scope_id, &id_hash, now)?;
                // An identity row this claim added for the body is not a processed delivery either.
                self.conn
                    .prepare_cached(
                        "UPDATE scope_stats SET identity_offset = identity_offset + ?2 WHERE scope_id = ?1",
                    )?
                    .execute((scope_id, rows))?;
                return self.count_settled(scope_id, outcome);
            }
            Err(e) => return Err(e.into()),
        }
        self.conn
            .prepare_cached(
                // A dead letter's identity row is not a processed delivery (see `schema.sql`).
                "UPDATE scope_stats SET dead_lettered = dead_lettered + 1, identity_offset = identity_offset + ?2 \
                 WHERE scope_id = ?1",
            )?
            .execute((scope_id, rows))?;
        Ok(Outcome::Processed)
    }

    /// Counts a delivery that was not dead-lettered because its identity or its body was already kept.
    /// Expired deliveries and sequence conflicts were counted where they were found.
    fn count_settled(&mut self, scope_id: i64, outcome: Outcome) -> Result<Outcome> {
        let column = match outcome {
            Outcome::Conflict { .. } => Some("conflicts = conflicts + 1"),
            Outcome::Duplicate => Some("duplicates = duplicates + 1"),
            _ => None,
        };
        if let Some(column) = column {
            self.conn
                .prepare_cached(&format!(
                    "UPDATE scope_stats SET {column} WHERE scope_id = ?1"
                ))?
                .execute([scope_id])?;
        }
        Ok(outcome)
    }
}

#[cfg(test)]
mod tests {
    use crate::{Config, Delivery, Inbox, MessageState, Outcome, Status};

    fn open() -> (tempfile::TempDir, Inbox) {
        let dir = tempfile::tempdir().unwrap();
        let inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
        (dir, inbox)
    }

    #[test]
    fn dead_letter_is_durable_and_makes_redelivery_a_duplicate() {
        let (dir, mut inbox) = open();
        let d = Delivery::new("inv", "evt-1", "orders/1", b"{bad").with_producer("shop-1");
        assert!(matches!(
            inbox.dead_letter_after(&d, 3, "bad JSON").unwrap(),
            Outcome::Processed
        ));
        drop(inbox);

        let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default()).unwrap();
        let row: (i64, i64, String, Vec<u8>, String, Option<String>) = inbox
            .connection()
            .query_row(
                "SELECT state, attempts, last_error, payload, topic, producer FROM messages WHERE message_id = 'evt-1'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?)),
            )
            .unwrap();
        assert_eq!(
            row,
            (
                3,
                3,
                "bad JSON".into(),
                b"{bad".to_vec(),
                "orders/1".into(),
                Some("shop-1".into())
            )
        );
        assert!(matches!(
            inbox.status("inv", Some("shop-1"), "evt-1").unwrap(),
            Status::Recorded {
                state: Some(MessageState::DeadLettered),
                ..
            }
        ));
        assert_eq!(inbox.scope_stats("inv").unwrap().dead_lettered, 1);

        let mut ran = false;
        let outcome = inbox.process(&d, |_: &mut crate::Tx<'_>, _: &Delivery<'_>| {
            ran = true;
            Ok(())
        });
        assert!(matches!(outcome.unwrap(), Outcome::Duplicate));
        assert!(
            !ran,
            "a dead-lettered delivery is not handled again on redelivery"
        );

        // Other content under the same id is a conflict, not a second dead letter.
        let other = Delivery::new("inv", "evt-1", "orders/1", b"{other").with_producer("shop-1");
        assert!(matches!(
            inbox.dead_letter(&other, "x").unwrap(),
            Outcome::Conflict { .. }
        ));
        let st = inbox.scope_stats("inv").unwrap();
        assert_eq!((st.dead_lettered, st.conflicts), (1, 1));

        // An operator's requeue makes it pending work for the deferred worker.
        inbox
            .connection()
            .execute("UPDATE messages SET state = 0 WHERE state = 3", [])
            .unwrap();
        assert!(matches!(
            inbox.status("inv", Some("shop-1"), "evt-1").unwrap(),
            Status::Recorded {
                state: Some(MessageState::Pending),
                ..
            }
        ));
    }

    #[test]
    fn dead_letter_of_a_processed_identity_is_a_duplicate_and_writes_no_body() {
        let (_dir, mut inbox) = open();
        let d = Delivery::new("inv", "evt-2", "orders/2", b"{}");
        inbox
            .process(&d, |_: &mut crate::Tx<'_>, _: &Delivery<'_>| Ok(()))
            .unwrap();
        assert!(matches!(
            inbox.dead_letter(&d, "late").unwrap(),
            Outcome::Duplicate
        ));
        let n: i64 = inbox
            .connection()
            .query_row("SELECT count(*) FROM messages", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 0);
        assert_eq!(inbox.scope_stats("inv").unwrap().dead_lettered, 0);
    }
}
