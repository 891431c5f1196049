//! Received-then-deferred mode, receive side: store the delivery as a pending message and commit, so it may be
//! acked before its effect is applied. Workers ([`crate::Worker`]) apply it later.

use crate::inbox::{claim_identity, existing_as, keep_stored_fingerprint, Claim, Inbox};
use crate::store::db::Db;
use crate::store::error::{is_unique_violation, Error, InvalidDelivery, Result};
use crate::store::identity::{Delivery, Fingerprint, IdHash};
use crate::store::outcome::Outcome;
use crate::store::txn::{begin, commit, unix_now};

/// Duplicate and conflict counts of one receive transaction, per scope.
#[derive(Clone, Copy)]
struct Counts {
    scope_id: i64,
    duplicates: i64,
    conflicts: i64,
    /// Identity rows added (for `identity_offset`).
    rows: i64,
}

impl Inbox {
    /// Stores one delivery as a *pending* message, unordered (see [`Inbox::receive_ordered`]).
    ///
    /// In one `BEGIN IMMEDIATE` transaction the identity is inserted (the primary key decides, exactly as in
    /// [`Inbox::process`]) and, when it is new, a `messages` row with the payload in state pending. The
    /// commit is durable (with the default `synchronous=FULL`) before this returns.
    ///
    /// - `Ok(Outcome::Received)`: stored; the broker may be acked, the inbox now owns the obligation.
    /// - `Ok(Outcome::Duplicate)`: already stored or processed with the same content; ack.
    /// - `Ok(Outcome::Conflict {..})`: same id, other content: recorded in `conflicts`, not stored; ack.
    /// - `Err(_)`: nothing is known to be stored; do **not** ack.
    pub fn receive(&mut self, delivery: &Delivery<'_>) -> Result<Outcome> {
        self.receive_ordered(delivery, None)
    }

    /// [`Inbox::receive`] with an order key: messages sharing a key are processed one after the other in
    /// arrival order (a worker does not claim one while an earlier one with the same key is still pending or
    /// failed). `None` means unordered. Typical keys are the topic (`Some(d.topic)`) or a business id such as
    /// an order number. The key is limited to [`Limits::max_id_len`](crate::Limits::max_id_len) bytes.
    pub fn receive_ordered(
        &mut self,
        delivery: &Delivery<'_>,
        order_key: Option<&str>,
    ) -> Result<Outcome> {
        let mut outcome = None;
        self.receive_all(
            std::slice::from_ref(delivery),
            |_| order_key,
            |o| outcome = Some(o),
        )?;
        Ok(outcome.expect("one delivery yields one outcome"))
    }

    /// Stores many deliveries in one transaction (group commit: one fsync for all of them), unordered.
    /// `outcomes` is cleared and then receives one outcome per delivery, in input order. A repeated identity
    /// within the batch is a [`Outcome::Duplicate`] of the first.
    ///
    /// All deliveries are validated first; an invalid one fails the call before anything is written. A storage
    /// error fails the whole batch: nothing of it is stored, nothing may be acked, and `outcomes` is left empty.
    pub fn receive_batch_into(
        &mut self,
        deliveries: &[Delivery<'_>],
        outcomes: &mut Vec<Outcome>,
    ) -> Result<()> {
        self.receive_batch_ordered_into(deliveries, &[], outcomes)
    }

    /// [`Inbox::receive_batch_into`] with one order key per delivery (`order_keys[i]` belongs to
    /// `deliveries[i]`; an empty slice means all unordered). See [`Inbox::receive_ordered`].
    pub fn receive_batch_ordered_into(
        &mut self,
        deliveries: &[Delivery<'_>],
        order_keys: &[Option<&str>],
        outcomes: &mut Vec<Outcome>,
    ) -> Result<()> {
        if !order_keys.is_empty() && order_keys.len() != deliveries.len() {
            return Err(Error::InvalidArgument(format!(
                "{} order keys for {} deliveries",
                order_keys.len(),
                deliveries.len()
            )));
        }
        outcomes.clear();
        let result = self.receive_all(
            deliveries,
            |i| order_keys.get(i).copied().flatten(),
            |o| outcomes.push(o),
        );
        if result.is_err() {
            outcomes.clear();
        }
        result
    }

    fn receive_all<'k>(
        &mut self,
        deliveries: &[Delivery<'_>],
        order_key: impl Fn(usize) -> Option<&'k str>,
        mut emit: impl FnMut(Outcome),
    ) -> Result<()> {
        let max_key = self.config.limits.max_id_len;
        let mut scope_ids = Vec::with_capacity(deliveries.len());
        for (i, d) in deliveries.iter().enumerate() {
            d.validate(&self.config.limits)?;
            match order_key(i) {
                Some("") => return Err(Error::InvalidArgument("order key is empty".into())),
                Some(k) if k.len() > max_key => {
                    return Err(InvalidDelivery::TooLong {
                        field: "order key",
                        len: k.len(),
                        max: max_key,
                    }
                    .into())
                }
                _ => {}
            }
            // Interned outside the transaction, as in the strong case: a rollback must not leave a cached id.
            scope_ids.push(self.scope_id(d.scope)?);
        }
        if deliveries.is_empty() {
            return Ok(());
        }
        let mut counts: Vec<Counts> = Vec::new();
        let now = unix_now();
        begin(&self.conn)?;
        let result = (|| -> Result<()> {
            // The same retention rules as the strong case (watermarks, expired deliveries).
            self.retention.refresh(&self.conn)?;
            for (i, d) in deliveries.iter().enumerate() {
                let scope_id = scope_ids[i];
                let rules = self.retention.rules(scope_id);
                let claim = claim_identity(&self.conn, d, scope_id, rules, now)?;
                let rows = claim.rows();
                let outcome = match claim {
                    Claim::Settled(existing) => existing,
                    Claim::Row | Claim::Sequence => {
                        store_pending(&self.conn, d, scope_id, order_key(i), now)?
                    }
                };
                let c = match counts.iter_mut().find(|c| c.scope_id == scope_id) {
                    Some(c) => c,
                    None => {
                        counts.push(Counts {
                            scope_id,
                            duplicates: 0,
                            conflicts: 0,
                            rows: 0,
                        });
                        counts.last_mut().expect("just pushed")
                    }
                };
                // A pending delivery's identity row is not a processed one (see `schema.sql`).
                c.rows += rows;
                match outcome {
                    Outcome::Duplicate => c.duplicates += 1,
                    Outcome::Conflict { .. } => c.conflicts += 1,
                    _ => {}
                }
                emit(outcome);
            }
            let mut stmt = self.conn.prepare_cached(
                "UPDATE scope_stats SET duplicates = duplicates + ?2, conflicts = conflicts + ?3, \
                 identity_offset = identity_offset + ?4 WHERE scope_id = ?1",
            )?;
            for c in counts
                .iter()
                .filter(|c| c.duplicates + c.conflicts + c.rows > 0)
            {
                stmt.execute((c.scope_id, c.duplicates, c.conflicts, c.rows))?;
            }
            drop(stmt);
            commit(&self.conn)
        })();
        if result.is_err() && !self.conn.is_autocommit() {
            let _ = self.conn.execute_batch("ROLLBACK");
        }
        result
    }
}

/// Inserts the pending row of a delivery whose identity was just claimed (same transaction).
fn store_pending(
    conn: &crate::store::db::Db,
    d: &Delivery<'_>,
    scope_id: i64,
    order_key: Option<&str>,
    now: i64,
) -> Result<Outcome> {
    let id_hash = d.id_hash(&conn.id_key);
    let mut insert = conn.prepare_cached(
        "INSERT INTO messages (scope_id, id_hash, producer, message_id, topic, payload, sequence, sent_at, \
         order_key, state, received_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, 0, ?10)",
    )?;
    let row = (
        scope_id,
        id_hash.as_bytes(),
        d.producer,
        d.message_id,
        d.topic,
        d.payload,
        d.sequence.map(|s| s as i64),
        d.sent_at,
        order_key,
        now,
    );
    match insert.execute(row) {
        Ok(_) => Ok(Outcome::Received),
        Err(e) if is_unique_violation(&e) => open_body_clash(conn, d, scope_id, &id_hash, now),
        Err(e) => Err(e.into()),
    }
}

/// A delivery whose identity was just claimed met an open or dead-lettered body of the same id that has no
/// identity of its own: in a scope with sequence watermarks, a body that outlived its sequence's place in
/// the window, or a body whose identity row was deleted. The body's content decides, as an identity row's
/// would: the same content is a duplicate, other content a recorded conflict, never a silent duplicate. A
/// processed body of the same id (its identity pruned by the horizon: the door is open again by design) is
/// not in the index and stays as history.
///
/// The claim stays: the identity row or the remembered sequence it added gives the body its identity back.
/// On a conflict they take the stored content's fingerprint, so that a later arrival of either content
/// compares against what is kept.
pub(crate) fn open_body_clash(
    conn: &Db,
    d: &Delivery<'_>,
    scope_id: i64,
    id_hash: &IdHash,
    now: i64,
) -> Result<Outcome> {
    // The index's own condition (`state IN (0, 2, 3)`), so the lookup uses it. The insert's constraint named
    // this body a moment ago, in the same transaction: not finding it is a storage error.
    let (topic, payload): (String, Option<Vec<u8>>) = conn
        .prepare_cached(
            "SELECT topic, payload FROM messages WHERE scope_id = ?1 AND id_hash = ?2 AND state IN (0, 2, 3)",
        )?
        .query_row((scope_id, id_hash.as_bytes()), |r| Ok((r.get(0)?, r.get(1)?)))?;
    let stored = Fingerprint::of(&topic, payload.as_deref().unwrap_or_default());
    let outcome = existing_as(conn, d, scope_id, id_hash, d.fingerprint(), stored, now)?;
    if matches!(outcome, Outcome::Conflict { .. }) {
        keep_stored_fingerprint(conn, scope_id, id_hash, stored)?;
    }
    Ok(outcome)
}
