//! Per-producer sequence watermarks: exact deduplication with an unbounded horizon in O(producers) space.
//!
//! For a scope that opts in ([`RetentionPolicy::sequence_watermarks`](crate::RetentionPolicy::sequence_watermarks)),
//! a delivery that carries a producer namespace and a sequence number is identified by *(producer, sequence)*
//! instead of an identity row. Per producer the store keeps a high-water mark `high` (every sequence up to it is
//! processed) and the set of processed sequences above `high + 1` that arrived out of order. When the gap
//! closes, the contiguous run folds into `high` and its exceptions are deleted.
//!
//! Invariant kept by [`claim`]: every exception is greater than `high + 1`.
//!
//! A sequence that comes again is never taken for a duplicate on the number alone. The identity (hash of
//! producer and message id, and the content fingerprint) of the last [`SEQUENCE_WINDOW`] sequences below the
//! mark, and of every exception, is kept in `watermark_recent`: a repeated sequence with the same identity and
//! content is a duplicate, with the same id and other content a conflict, with another id a
//! [`SequenceConflict`](crate::Outcome::SequenceConflict) (a producer that restarted its counter, or two
//! producers in one namespace), quarantined with its reason. Below the window nothing can be compared any more,
//! so such a sequence is quarantined as well (cause `below-window`): safe (never applied twice, never dropped
//! unseen), at the price of an operator look at a very late redelivery. Choose the window to cover how far
//! behind a redelivery can come (the broker's in-flight and queued messages for the session).
//!
//! Arbitration: a sequence above `high + 1` is claimed by the primary-key insert into `watermark_exceptions`; the
//! sequence `high + 1` by moving `high`. Both happen inside the caller's `BEGIN IMMEDIATE` transaction, which holds
//! the database's only write lock from the read of `high` to the commit, so no other writer can move it between.

use rusqlite::{Connection, OptionalExtension};

use crate::store::error::{is_unique_violation, Error, Result};
use crate::store::identity::{Delivery, Fingerprint, IdHash};
use crate::store::outcome::{Outcome, SequenceConflictCause};

/// What is recorded for one producer of a watermark scope; see [`Inbox::watermark`].
///
/// [`Inbox::watermark`]: crate::Inbox::watermark
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Watermark {
    /// Every sequence up to and including this one is processed (`None`: no contiguous run yet).
    pub high: Option<u64>,
    /// Processed sequences above `high + 1`, in ascending order (arrived out of order; they fold into `high`
    /// once the gap before them closes).
    pub exceptions: Vec<u64>,
}

/// How many of a producer's most recent sequences keep the identity that claimed them (in
/// `watermark_recent`): a sequence that comes again within this window is compared with it. 128 rows of about
/// 40 bytes per producer.
pub const SEQUENCE_WINDOW: u64 = 128;

/// One numbered delivery to claim; see [`claim`].
pub(crate) struct Claim<'a> {
    pub(crate) scope_id: i64,
    pub(crate) producer: &'a str,
    pub(crate) sequence: u64,
    pub(crate) first: i64,
    pub(crate) id_hash: IdHash,
    pub(crate) fingerprint: Fingerprint,
}

/// Claims the delivery's sequence inside the caller's open transaction. `None`: new, now recorded (it commits or
/// aborts with the caller's transaction). `Some`: the sequence was already claimed, and the outcome says by
/// what: the same message with the same content ([`Outcome::Duplicate`]), the same message id with other content
/// ([`Outcome::Conflict`], recorded), or another message id, or nothing comparable any more
/// ([`Outcome::SequenceConflict`], quarantined). Never a duplicate without comparing the identity.
pub(crate) fn claim(
    conn: &Connection,
    c: &Claim<'_>,
    d: &Delivery<'_>,
    now: i64,
) -> Result<Option<Outcome>> {
    let (scope_id, producer) = (c.scope_id, c.producer);
    let seq = i64::try_from(c.sequence).map_err(|_| {
        Error::InvalidArgument(format!(
            "sequence {} is above the largest storable (2^63-1)",
            c.sequence
        ))
    })?;
    let high: i64 = conn
        .prepare_cached("SELECT high FROM watermarks WHERE scope_id = ?1 AND producer = ?2")?
        .query_row((scope_id, producer), |r| r.get(0))
        .optional()?
        .unwrap_or(c.first - 1);
    if seq <= high {
        return already_claimed(conn, c, d, now).map(Some);
    }
    if seq > high + 1 {
        let inserted = conn
            .prepare_cached("INSERT INTO watermark_exceptions (scope_id, producer, sequence) VALUES (?1, ?2, ?3)")?
            .execute((scope_id, producer, seq));
        return match inserted {
            Ok(_) => remember(conn, c, seq).map(|()| None),
            Err(e) if is_unique_violation(&e) => already_claimed(conn, c, d, now).map(Some),
            Err(e) => Err(e.into()),
        };
    }
    // seq == high + 1: the gap closes; fold the contiguous exceptions above it into the mark.
    let mut new_high = seq;
    {
        let mut stmt = conn.prepare_cached(
            "SELECT sequence FROM watermark_exceptions WHERE scope_id = ?1 AND producer = ?2 AND sequence > ?3 \
             ORDER BY sequence",
        )?;
        let mut rows = stmt.query((scope_id, producer, seq))?;
        while let Some(row) = rows.next()? {
            let s: i64 = row.get(0)?;
            if s != new_high + 1 {
                break;
            }
            new_high = s;
        }
    }
    if new_high > seq {
        conn.prepare_cached(
            "DELETE FROM watermark_exceptions WHERE scope_id = ?1 AND producer = ?2 AND sequence > ?3 \
             AND sequence <= ?4",
        )?
        .execute((scope_id, producer, seq, new_high))?;
    }
    conn.prepare_cached(
        "INSERT INTO watermarks (scope_id, producer, high) VALUES (?1, ?2, ?3) \
         ON CONFLICT (scope_id, producer) DO UPDATE SET high = excluded.high",
    )?
    .execute((scope_id, producer, new_high))?;
    remember(conn, c, seq)?;
    // The window slides: sequences this far below the mark are no longer compared (a range delete in key order).
    conn.prepare_cached(
        "DELETE FROM watermark_recent WHERE scope_id = ?1 AND producer = ?2 AND sequence <= ?3",
    )?
    .execute((scope_id, producer, new_high - SEQUENCE_WINDOW as i64))?;
    Ok(None)
}

/// Records which message claimed `seq`.
fn remember(conn: &Connection, c: &Claim<'_>, seq: i64) -> Result<()> {
    conn.prepare_cached(
        "INSERT OR REPLACE INTO watermark_recent (scope_id, producer, sequence, id_hash, fingerprint) \
         VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute((c.scope_id, c.producer, seq, &c.id_hash.0[..], c.fingerprint.to_sql()))?;
    Ok(())
}

/// The sequence is claimed: compare the delivery with the message that claimed it.
fn already_claimed(
    conn: &Connection,
    c: &Claim<'_>,
    d: &Delivery<'_>,
    now: i64,
) -> Result<Outcome> {
    let claimed: Option<(Vec<u8>, i64)> = conn
        .prepare_cached(
            "SELECT id_hash, fingerprint FROM watermark_recent WHERE scope_id = ?1 AND producer = ?2 AND sequence = ?3",
        )?
        .query_row((c.scope_id, c.producer, c.sequence as i64), |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    let cause = match claimed {
        Some((hash, fp)) if hash[..] == c.id_hash.0[..] => {
            let stored = Fingerprint::from_sql(fp);
            if stored == c.fingerprint {
                return Ok(Outcome::Duplicate);
            }
            conn.prepare_cached(
                "INSERT INTO conflicts (scope_id, id_hash, producer, message_id, topic, stored_fingerprint, \
                 received_fingerprint, at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            )?
            .execute((
                c.scope_id,
                &c.id_hash.0[..],
                d.producer,
                d.message_id,
                d.topic,
                stored.to_sql(),
                c.fingerprint.to_sql(),
                now,
            ))?;
            log::warn!(
                "conflict in scope {}: sequence {} of producer {:?} (message id {:?}) arrived with fingerprint {}, \
                 committed with {stored}; recorded, not applied",
                d.scope,
                c.sequence,
                c.producer,
                d.message_id,
                c.fingerprint
            );
            return Ok(Outcome::Conflict {
                stored,
                received: c.fingerprint,
            });
        }
        Some(_) => SequenceConflictCause::OtherMessage,
        None => SequenceConflictCause::BelowWindow,
    };
    let reason = match cause {
        SequenceConflictCause::OtherMessage => format!(
            "sequence {} of producer {:?} was already claimed by another message id (message id {:?} now): the \
             producer restarted its counter or shares its namespace with another producer",
            c.sequence, c.producer, d.message_id
        ),
        _ => format!(
            "sequence {} of producer {:?} (message id {:?}) is at or below its high-water mark but outside the \
             window of {SEQUENCE_WINDOW} recent sequences: it cannot be compared with the message that claimed it",
            c.sequence, c.producer, d.message_id
        ),
    };
    conn.prepare_cached(
        "INSERT INTO quarantine (scope_id, topic, payload, reason, at) VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute((c.scope_id, d.topic, d.payload, &reason, now))?;
    let quarantined = conn.last_insert_rowid();
    conn.prepare_cached(
        "UPDATE scope_stats SET sequence_conflicts = sequence_conflicts + 1, quarantined = quarantined + 1 \
         WHERE scope_id = ?1",
    )?
    .execute([c.scope_id])?;
    log::warn!("scope {}: {reason}; quarantined, not applied", d.scope);
    Ok(Outcome::SequenceConflict {
        sequence: c.sequence,
        cause,
        quarantined,
    })
}
