//! Durable counters, as stored in the database.

use rusqlite::{Connection, OptionalExtension};

use crate::inbox::Inbox;
use crate::store::error::Result;

/// Counters of one scope, read from the database: they are updated in the same transactions as the
/// outcomes they count, so they survive restarts and agree with the committed state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScopeStats {
    /// Deliveries whose effect was committed.
    pub processed: u64,
    /// Redeliveries recognised as duplicates.
    pub duplicates: u64,
    /// Arrivals of deliveries that reused a committed id with different content, redeliveries of the same
    /// conflicting delivery included (each is answered [`Outcome::Conflict`](crate::Outcome::Conflict)).
    pub conflicts: u64,
    /// Handler failures (each rolled back).
    pub handler_failures: u64,
    /// Arrivals of quarantined deliveries, redeliveries of the same delivery included (each was kept and may be
    /// acked). Sequence conflicts and expired deliveries that were quarantined count here too.
    pub quarantined: u64,
    /// Messages moved to the dead letters.
    pub dead_lettered: u64,
    /// Identities deleted by retention.
    pub identities_pruned: u64,
    /// Payloads deleted by retention.
    pub payloads_pruned: u64,
    /// Deliveries without a found identity that were sent before the pruned identity horizon (whatever the
    /// scope's expired policy did with them).
    pub expired: u64,
    /// Numbered deliveries (sequence watermarks) whose sequence was claimed by another message id, or could no
    /// longer be compared: quarantined, never taken for duplicates.
    pub sequence_conflicts: u64,
    /// Identities whose commit day could not be right (before the database existed) and that retention
    /// re-dated to the day it first saw a plausible clock.
    pub identities_restamped: u64,
    /// Distinct conflict records made: one per (identity, received content); later arrivals of the same
    /// conflicting delivery count in `conflicts` only. Pruning a record does not lower it.
    pub conflict_records: u64,
    /// Distinct quarantine records made: one per distinct delivery (see
    /// [`Inbox::quarantine`](crate::Inbox::quarantine)); later arrivals count in `quarantined` only. Pruning a
    /// record does not lower it.
    pub quarantine_records: u64,
}

impl Inbox {
    /// The durable counters of `scope` (all zero for a scope never seen).
    ///
    /// Every figure is what is committed, also right after a crash. `processed` is partly derived from the
    /// scope's identity rows (the strong case writes no counter per processed delivery), so reading it counts
    /// them: fine for monitoring, not something to call per delivery.
    pub fn scope_stats(&self, scope: &str) -> Result<ScopeStats> {
        scope_stats(&self.conn, scope)
    }
}

/// Reads the counters of `scope` from any connection (read-only tools use it too).
pub(crate) fn scope_stats(conn: &Connection, scope: &str) -> Result<ScopeStats> {
    let row = conn
        .prepare_cached(&format!(
            "SELECT {}, duplicates, conflicts, handler_failures, quarantined, dead_lettered, \
             identities_pruned, payloads_pruned, expired, {}, {} FROM scope_stats st JOIN scopes s ON s.id = st.scope_id \
             WHERE s.name = ?1",
            processed_column(conn)?,
            v2_columns(conn)?,
            v4_columns(conn)?
        ))?
        .query_row([scope], |r| {
            Ok(ScopeStats {
                processed: r.get::<_, i64>(0)? as u64,
                duplicates: r.get::<_, i64>(1)? as u64,
                conflicts: r.get::<_, i64>(2)? as u64,
                handler_failures: r.get::<_, i64>(3)? as u64,
                quarantined: r.get::<_, i64>(4)? as u64,
                dead_lettered: r.get::<_, i64>(5)? as u64,
                identities_pruned: r.get::<_, i64>(6)? as u64,
                payloads_pruned: r.get::<_, i64>(7)? as u64,
                expired: r.get::<_, i64>(8)? as u64,
                sequence_conflicts: r.get::<_, i64>(9)? as u64,
                identities_restamped: r.get::<_, i64>(10)? as u64,
                conflict_records: r.get::<_, i64>(11)? as u64,
                quarantine_records: r.get::<_, i64>(12)? as u64,
            })
        })
        .optional()?;
    Ok(row.unwrap_or_default())
}

/// The processed figure of the `scope_stats` row `st`: since schema version 3 partly derived from the scope's
/// identity rows (see `schema.sql`), which costs a count of them.
pub(crate) fn processed_column(conn: &Connection) -> Result<&'static str> {
    Ok(if crate::store::schema::version(conn)? >= 3 {
        "st.processed + (SELECT count(*) FROM identities i WHERE i.scope_id = st.scope_id) - st.identity_offset"
    } else {
        "st.processed"
    })
}

/// The counters added by schema version 2, or zeros for a file of version 1 opened read-only.
pub(crate) fn v2_columns(conn: &Connection) -> Result<&'static str> {
    Ok(if crate::store::schema::version(conn)? >= 2 {
        "sequence_conflicts, identities_restamped"
    } else {
        "0, 0"
    })
}

/// The record counts added by schema version 4; for an older file opened read-only, the rows it holds (each
/// was a record, before redeliveries were merged).
pub(crate) fn v4_columns(conn: &Connection) -> Result<&'static str> {
    Ok(if crate::store::schema::version(conn)? >= 4 {
        "st.conflict_records, st.quarantine_records"
    } else {
        "(SELECT count(*) FROM conflicts c WHERE c.scope_id = st.scope_id), \
         (SELECT count(*) FROM quarantine q WHERE q.scope_id = st.scope_id)"
    })
}
