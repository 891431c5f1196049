//! The inbox's own invariants, checked over a file SQLite may find sound: what `inboxctl check` reports
//! beside `PRAGMA integrity_check`. Each breach is named, so a tool or a test can tell which rule failed.

use std::time::Duration;

use rusqlite::Connection;
use serde::Serialize;

use crate::store::error::Result;

/// How far past its expiry (or ahead of now) a lease may be before [`check_invariants`] reports it, in
/// [`check`](crate::inspect::check): one day, far beyond any sensible [`WorkerConfig::lease`](crate::WorkerConfig::lease).
pub const LEASE_BOUND: Duration = Duration::from_secs(86_400);

/// One invariant broken by some rows of one scope; see [`check_invariants`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Breach {
    /// Which invariant:
    ///
    /// - `message_without_identity`: a stored message whose identity is not recorded (no identity row, and in a
    ///   scope with sequence watermarks no claim of its sequence): a redelivery would be taken as new. A
    ///   processed body in a scope whose identity horizon has pruned is not counted: its identity may have
    ///   gone before it, by design.
    /// - `outbox_without_scope`: an outbox row of a scope that does not exist.
    /// - `counters_disagree`: the scope's counters cannot be right: one is negative, its counter row is
    ///   missing, or its identity rows are fewer than the rows counted as not processed by the strong case
    ///   (`identity_offset`, see `schema.sql`), so the derived processed figure is wrong.
    /// - `exception_not_above_high`: a watermark exception at or below its producer's high mark + 1 (it
    ///   should have been folded into the mark).
    /// - `lease_expired`: an open message still leased more than the bound after its lease ran out: the worker
    ///   that held it is gone and none has taken it over.
    /// - `lease_too_long`: an open message leased until more than the bound after now (taken under a clock
    ///   that was far ahead): no other worker can take it over until then.
    pub name: &'static str,
    /// The scope's name (`None` when the row names no existing scope).
    pub scope: Option<String>,
    /// How many rows break it.
    pub count: u64,
    /// One of them, described.
    pub example: String,
}

/// Checks the inbox's invariants on `conn` (read-only), as of `now_ms` (Unix milliseconds), allowing leases
/// `lease_bound` past their expiry or ahead of now. Returns every breach found, by invariant and scope; empty
/// when the inbox is sound. The caller gives the snapshot (one read transaction) if it wants one.
///
/// Cost: a scan of the messages, outbox and watermark tables and a count of each scope's identities: a
/// tool's call.
pub fn check_invariants(
    conn: &Connection,
    now_ms: i64,
    lease_bound: Duration,
) -> Result<Vec<Breach>> {
    let bound_ms = lease_bound.as_millis().min(i64::MAX as u128) as i64;
    let mut out = Vec::new();
    let mut add = |name: &'static str, sql: &str, params: &[&dyn rusqlite::ToSql]| -> Result<()> {
        let mut stmt = conn.prepare(sql)?;
        let rows = stmt.query_map(params, |r| {
            Ok(Breach {
                name,
                // Escaped, so that one name that is not UTF-8 does not hide every breach.
                scope: super::text_opt(r, 0)?,
                count: r.get::<_, i64>(1)?.max(0) as u64,
                example: super::text(r, 2)?,
            })
        })?;
        for b in rows {
            out.push(b?);
        }
        Ok(())
    };
    // Each query yields (scope name, count, example) per scope.
    add(
        "message_without_identity",
        "SELECT s.name, count(*), 'message seq ' || min(m.seq) || ' (message id ' || quote(min(m.message_id)) || ')' \
         FROM messages m LEFT JOIN scopes s ON s.id = m.scope_id LEFT JOIN retention r ON r.scope_id = m.scope_id \
         WHERE NOT EXISTS (SELECT 1 FROM identities i WHERE i.scope_id = m.scope_id AND i.id_hash = m.id_hash) \
         AND NOT (m.state = 1 AND coalesce(m.finished_at, m.received_at) < r.pruned_before) \
         AND coalesce(r.watermarks = 1 AND m.producer IS NOT NULL AND m.sequence >= r.first_sequence AND ( \
           EXISTS (SELECT 1 FROM watermarks w WHERE w.scope_id = m.scope_id AND w.producer = m.producer \
                   AND w.high >= m.sequence) \
           OR EXISTS (SELECT 1 FROM watermark_exceptions e WHERE e.scope_id = m.scope_id \
                   AND e.producer = m.producer AND e.sequence = m.sequence)), 0) = 0 \
         GROUP BY m.scope_id ORDER BY m.scope_id",
        &[],
    )?;
    add(
        "outbox_without_scope",
        "SELECT NULL, count(*), 'outbox seq ' || min(o.seq) || ' (scope id ' || o.scope_id || ')' FROM outbox o \
         WHERE NOT EXISTS (SELECT 1 FROM scopes s WHERE s.id = o.scope_id) GROUP BY o.scope_id ORDER BY o.scope_id",
        &[],
    )?;
    add(
        "counters_disagree",
        "SELECT s.name, 1, CASE \
           WHEN st.scope_id IS NULL THEN 'no counter row' \
           WHEN min(st.processed, st.duplicates, st.conflicts, st.handler_failures, st.quarantined, \
                    st.dead_lettered, st.identities_pruned, st.payloads_pruned, st.expired, \
                    st.sequence_conflicts, st.identities_restamped) < 0 THEN 'a negative counter' \
           ELSE (SELECT count(*) FROM identities i WHERE i.scope_id = s.id) || ' identity rows, identity_offset ' \
                || st.identity_offset END \
         FROM scopes s LEFT JOIN scope_stats st ON st.scope_id = s.id \
         WHERE st.scope_id IS NULL \
            OR min(st.processed, st.duplicates, st.conflicts, st.handler_failures, st.quarantined, \
                   st.dead_lettered, st.identities_pruned, st.payloads_pruned, st.expired, \
                   st.sequence_conflicts, st.identities_restamped) < 0 \
            OR (SELECT count(*) FROM identities i WHERE i.scope_id = s.id) < st.identity_offset \
         ORDER BY s.id",
        &[],
    )?;
    add(
        "exception_not_above_high",
        "SELECT s.name, count(*), 'producer ' || quote(min(e.producer)) || ' sequence ' || min(e.sequence) \
         FROM watermark_exceptions e LEFT JOIN scopes s ON s.id = e.scope_id \
         LEFT JOIN watermarks w ON w.scope_id = e.scope_id AND w.producer = e.producer \
         LEFT JOIN retention r ON r.scope_id = e.scope_id \
         WHERE e.sequence <= coalesce(w.high, coalesce(r.first_sequence, 1) - 1) + 1 \
         GROUP BY e.scope_id ORDER BY e.scope_id",
        &[],
    )?;
    add(
        "lease_expired",
        "SELECT s.name, count(*), 'message seq ' || min(m.seq) || ' leased by ' || quote(min(m.lease_owner)) \
         FROM messages m LEFT JOIN scopes s ON s.id = m.scope_id \
         WHERE m.state IN (0, 2) AND m.lease_owner IS NOT NULL AND m.lease_until < ?1 - ?2 \
         GROUP BY m.scope_id ORDER BY m.scope_id",
        &[&now_ms, &bound_ms],
    )?;
    add(
        "lease_too_long",
        "SELECT s.name, count(*), 'message seq ' || min(m.seq) || ' leased by ' || quote(min(m.lease_owner)) \
         FROM messages m LEFT JOIN scopes s ON s.id = m.scope_id \
         WHERE m.state IN (0, 2) AND m.lease_owner IS NOT NULL AND m.lease_until > ?1 + ?2 \
         GROUP BY m.scope_id ORDER BY m.scope_id",
        &[&now_ms, &bound_ms],
    )?;
    Ok(out)
}
