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
//! The identity is still (scope, producer, message id): before its sequence, a delivery's id is looked up in
//! `watermark_recent` (UNIQUE on scope and id hash, which covers the producer), so a known id is a duplicate or a conflict under
//! any sequence (a producer that numbers publish attempts, or republishes after a restart), and a free sequence
//! it comes with is claimed without a row of its own (no gap is left; the id keeps its one row). An id is known
//! while the sequence that first claimed it is in the window (one of the last [`SEQUENCE_WINDOW`] at or below
//! the mark, or an exception). Past that it is forgotten: under a sequence at or below the mark it is
//! quarantined (`below-window`), under a new sequence above the mark it is taken as new: beyond the window only
//! (producer, sequence) tells numbered messages apart.
//!
//! Arbitration: a sequence above `high + 1` is claimed by the primary-key insert into `watermark_exceptions`; the
//! sequence `high + 1` by moving `high`. Both happen inside the caller's `BEGIN IMMEDIATE` transaction, which holds
//! the database's only write lock from the read of `high` to the commit, so no other writer can move it between.

use rusqlite::{Connection, OptionalExtension};

use crate::store::db::Db;
use crate::store::error::{is_unique_violation, Error, Result};
use crate::store::identity::{Delivery, Fingerprint, IdHash};
use crate::store::outcome::{Outcome, SequenceConflictCause};
use crate::store::records;

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
/// `watermark_recent`): a sequence that comes again within this window is compared with it, and a message id
/// found there is recognised under any sequence. 128 rows of about 40 bytes per producer (more by an identity
/// order prefix, `Config::id_order`), plus an entry of about 35 bytes each in the message-id index: some
/// 10 KiB per producer (`retention_bench`: 980 KiB for 100 producers, 584 KiB before the index).
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
/// aborts with the caller's transaction). `Some`: not new, and the outcome says why: its message id is known in
/// the window, under this or another sequence ([`Outcome::Duplicate`] with the same content,
/// [`Outcome::Conflict`], recorded, with other content), or its sequence was claimed by another message id, or
/// is below the window and cannot be compared ([`Outcome::SequenceConflict`], quarantined). Never a duplicate
/// without comparing the identity.
///
/// The message id is looked up first, through the UNIQUE index on (scope, id_hash) of
/// `watermark_recent`: inside the caller's `BEGIN IMMEDIATE` no other writer can add a row between the lookup and
/// the claim, and the index makes a second row for the same id impossible (an insert would fail, never be taken
/// for a duplicate). A known id under a sequence nobody claimed yet claims that sequence too (so a producer
/// that numbers its publish attempts leaves no gap behind), without a row of its own: the id keeps one row.
pub(crate) fn claim(
    conn: &Db,
    c: &Claim<'_>,
    d: &Delivery<'_>,
    now: i64,
) -> Result<Option<Outcome>> {
    let seq = i64::try_from(c.sequence).map_err(|_| {
        Error::InvalidArgument(format!(
            "sequence {} is above the largest storable (2^63-1)",
            c.sequence
        ))
    })?;
    let known: Option<i64> = conn
        .prepare_cached(
            "SELECT fingerprint FROM watermark_recent WHERE scope_id = ?1 AND id_hash = ?2",
        )?
        .query_row((c.scope_id, c.id_hash.as_bytes()), |r| r.get(0))
        .optional()?;
    if let Some(fingerprint) = known {
        claim_number(conn, c, seq, false)?;
        return compare(conn, c, d, Fingerprint::from_sql(fingerprint), now).map(Some);
    }
    if claim_number(conn, c, seq, true)? {
        Ok(None)
    } else {
        already_claimed(conn, c, d, now).map(Some)
    }
}

/// Claims sequence `seq` in the producer's watermark: true when it was free and is now claimed (with the
/// claiming identity in `watermark_recent` if `remember`), false when it was claimed before (or, for an id
/// already known, is further than the window ahead of the mark: left unclaimed).
fn claim_number(conn: &Db, c: &Claim<'_>, seq: i64, remember_it: bool) -> Result<bool> {
    let (scope_id, producer) = (c.scope_id, c.producer);
    let high: i64 = conn
        .prepare_cached("SELECT high FROM watermarks WHERE scope_id = ?1 AND producer = ?2")?
        .query_row((scope_id, producer), |r| r.get(0))
        .optional()?
        .unwrap_or(c.first - 1);
    if seq <= high {
        return Ok(false);
    }
    if seq > high + 1 {
        // A known id (a repetition) renumbered far ahead of the mark claims nothing there: the exception
        // would never close, a publisher could add one per repetition, and a later message of that number
        // would be taken for one below the window. Near the mark it claims, so that a producer that numbers
        // its publish attempts leaves no gap.
        if !remember_it && seq > high.saturating_add(SEQUENCE_WINDOW as i64) {
            return Ok(false);
        }
        let inserted = conn
            .prepare_cached("INSERT INTO watermark_exceptions (scope_id, producer, sequence) VALUES (?1, ?2, ?3)")?
            .execute((scope_id, producer, seq));
        return match inserted {
            Ok(_) if remember_it => remember(conn, c, seq).map(|()| true),
            Ok(_) => Ok(true),
            Err(e) if is_unique_violation(&e) => Ok(false),
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
    if remember_it {
        remember(conn, c, seq)?;
    }
    // The window slides: sequences this far below the mark are no longer compared (a range delete in key order).
    conn.prepare_cached(
        "DELETE FROM watermark_recent WHERE scope_id = ?1 AND producer = ?2 AND sequence <= ?3",
    )?
    .execute((scope_id, producer, new_high - SEQUENCE_WINDOW as i64))?;
    Ok(true)
}

/// Records which message claimed `seq`. Never `INSERT OR REPLACE`: that would silently delete the row of
/// another sequence holding the same id; a clash with the id's UNIQUE index fails instead.
fn remember(conn: &Connection, c: &Claim<'_>, seq: i64) -> Result<()> {
    conn.prepare_cached(
        "INSERT INTO watermark_recent (scope_id, producer, sequence, id_hash, fingerprint) \
         VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (scope_id, producer, sequence) \
         DO UPDATE SET id_hash = excluded.id_hash, fingerprint = excluded.fingerprint",
    )?
    .execute((
        c.scope_id,
        c.producer,
        seq,
        c.id_hash.as_bytes(),
        c.fingerprint.to_sql(),
    ))?;
    Ok(())
}

/// The sequence is claimed and the delivery's id is not known in the window: another message claimed it, or
/// it is below the window and nothing is left to compare with. Quarantined either way.
fn already_claimed(conn: &Db, c: &Claim<'_>, d: &Delivery<'_>, now: i64) -> Result<Outcome> {
    let claimed: Option<(Vec<u8>, i64)> = conn
        .prepare_cached(
            "SELECT id_hash, fingerprint FROM watermark_recent WHERE scope_id = ?1 AND producer = ?2 AND sequence = ?3",
        )?
        .query_row((c.scope_id, c.producer, c.sequence as i64), |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    let cause = match claimed {
        // Found by id first in `claim`; kept so that the sequence's own record still decides if they disagree.
        Some((hash, fp)) if hash[..] == *c.id_hash.as_bytes() => {
            return compare(conn, c, d, Fingerprint::from_sql(fp), now);
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
    // It quotes the message id, which may be one quarantined for breaking the limits.
    let reason = records::cut(&reason, records::MAX_REASON);
    let record = records::Quarantine {
        scope_id: c.scope_id,
        identity: Some(&c.id_hash),
        topic: d.topic,
        payload: d.payload,
        reason,
        max_topic: records::MAX_RECORD_TEXT,
    };
    let (quarantined, new) = records::quarantine(conn, &conn.id_key, &record, now)?;
    conn.prepare_cached(
        "UPDATE scope_stats SET sequence_conflicts = sequence_conflicts + 1 WHERE scope_id = ?1",
    )?
    .execute([c.scope_id])?;
    if new {
        log::warn!("scope {}: {reason}; quarantined, not applied", d.scope);
    }
    Ok(Outcome::SequenceConflict {
        sequence: c.sequence,
        cause,
        quarantined,
    })
}

/// The delivery's id claimed a sequence with content `stored`: a duplicate if the content matches, else a
/// conflict (recorded once per distinct content).
fn compare(
    conn: &Db,
    c: &Claim<'_>,
    d: &Delivery<'_>,
    stored: Fingerprint,
    now: i64,
) -> Result<Outcome> {
    if stored == c.fingerprint {
        return Ok(Outcome::Duplicate);
    }
    let new = records::conflict(
        conn,
        &records::Conflict {
            scope_id: c.scope_id,
            id_hash: &c.id_hash,
            producer: d.producer,
            message_id: d.message_id,
            topic: d.topic,
            stored,
            received: c.fingerprint,
        },
        now,
    )?;
    if new {
        log::warn!(
            "conflict in scope {}: sequence {} of producer {:?} (message id {:?}) arrived with fingerprint {}, \
             committed with {stored}; recorded, not applied",
            d.scope,
            c.sequence,
            records::cut(c.producer, records::MAX_RECORD_TEXT),
            records::cut(d.message_id, records::MAX_RECORD_TEXT),
            c.fingerprint
        );
    }
    Ok(Outcome::Conflict {
        stored,
        received: c.fingerprint,
    })
}
