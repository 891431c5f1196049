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
//! Arbitration: a sequence above `high + 1` is claimed by the primary-key insert into `watermark_exceptions`; the
//! sequence `high + 1` by moving `high`. Both happen inside the caller's `BEGIN IMMEDIATE` transaction, which holds
//! the database's only write lock from the read of `high` to the commit, so no other writer can move it between.

use rusqlite::{Connection, OptionalExtension};

use crate::store::error::{is_unique_violation, Error, Result};
use crate::store::outcome::Outcome;

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

/// Claims `sequence` of `producer` inside the caller's open transaction. `None`: new, now recorded (it commits or
/// aborts with the caller's transaction). `Some(Duplicate)`: already processed.
///
/// No fingerprint is kept per sequence (that is the space saving): a reused sequence with other content is a
/// `Duplicate` here, never a `Conflict`.
pub(crate) fn claim(
    conn: &Connection,
    scope_id: i64,
    producer: &str,
    sequence: u64,
    first: i64,
) -> Result<Option<Outcome>> {
    let seq = i64::try_from(sequence).map_err(|_| {
        Error::InvalidArgument(format!(
            "sequence {sequence} is above the largest storable (2^63-1)"
        ))
    })?;
    let high: i64 = conn
        .prepare_cached("SELECT high FROM watermarks WHERE scope_id = ?1 AND producer = ?2")?
        .query_row((scope_id, producer), |r| r.get(0))
        .optional()?
        .unwrap_or(first - 1);
    if seq <= high {
        return Ok(Some(Outcome::Duplicate));
    }
    if seq > high + 1 {
        let inserted = conn
            .prepare_cached("INSERT INTO watermark_exceptions (scope_id, producer, sequence) VALUES (?1, ?2, ?3)")?
            .execute((scope_id, producer, seq));
        return match inserted {
            Ok(_) => Ok(None),
            Err(e) if is_unique_violation(&e) => Ok(Some(Outcome::Duplicate)),
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
    Ok(None)
}
