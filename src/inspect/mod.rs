//! Read-only views of an inbox for operators and tools: each function answers one question over any
//! [`Connection`] (an open [`Inbox`]'s, or one from [`open_read_only`](crate::open_read_only)) and returns
//! plain structs. Nothing here writes; `inboxctl` is a thin layer over these functions.
//!
//! The structs implement `serde::Serialize`, so a tool can print them as JSON or CBOR. Byte strings (payloads)
//! serialize as hex text in human-readable formats (JSON) and as byte strings in binary ones (CBOR).

use std::path::Path;

use rusqlite::types::ValueRef;
use rusqlite::{Connection, OptionalExtension, Row};
use serde::{Serialize, Serializer};

use crate::inbox::{status, Inbox};
use crate::store::error::{Error, Result};
use crate::store::identity::{Fingerprint, IdHash};
use crate::store::outcome::{MessageState, Status};
use crate::store::schema::SCHEMA_VERSION;
use crate::store::txn::unix_now_ms;

mod invariants;
pub(crate) mod stats;
mod wear;

pub use invariants::{check_invariants, Breach, LEASE_BOUND};
pub use wear::{
    block_device_dir, bytes_written, device_wear, device_wear_in, BytesWritten, DeviceWear,
};

const DAY: i64 = 86_400;

/// Everything an operator wants to know about one scope, read in one transaction: the durable counters
/// ([`ScopeStats`](crate::ScopeStats)), the deferred backlog ([`Backlog`](crate::Backlog)) and what is retained.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ScopeReport {
    /// Scope name.
    pub scope: String,
    /// Deliveries whose effect was committed (durable counter).
    pub processed: u64,
    /// Redeliveries recognised as duplicates (durable counter).
    pub duplicates: u64,
    /// Arrivals of deliveries with a committed id and different content, redeliveries included (durable counter;
    /// the records are in `conflicts`).
    pub conflicts: u64,
    /// Handler failures, each rolled back (durable counter).
    pub handler_failures: u64,
    /// Arrivals of quarantined deliveries, redeliveries included (durable counter).
    pub quarantined: u64,
    /// Messages ever moved to the dead letters (durable counter).
    pub dead_lettered: u64,
    /// Identities deleted by retention (durable counter).
    pub identities_pruned: u64,
    /// Stored messages deleted by retention (durable counter).
    pub payloads_pruned: u64,
    /// Deliveries older than the pruned identity horizon without an identity (durable counter).
    pub expired: u64,
    /// Numbered deliveries whose sequence another message id had claimed (a restarted or duplicated producer),
    /// or that could no longer be compared; quarantined (durable counter).
    pub sequence_conflicts: u64,
    /// Identities re-dated because their commit day could not be right (durable counter).
    pub identities_restamped: u64,
    /// Distinct conflict records made, one per (identity, received content) (durable counter).
    pub conflict_records: u64,
    /// Distinct quarantine records made, one per distinct delivery (durable counter).
    pub quarantine_records: u64,
    /// Retained identities of deliveries without a send time: the identity horizon never prunes them.
    pub identities_undated: u64,
    /// Stored messages waiting to be processed (state pending, including those in flight).
    pub pending: u64,
    /// Stored messages whose last attempt failed, waiting for a retry.
    pub failed: u64,
    /// Open messages under a live worker lease.
    pub in_flight: u64,
    /// Age in seconds of the oldest message not yet processed (pending or failed); `None` when there is none.
    pub oldest_pending_age_secs: Option<u64>,
    /// Dead letters held now (state dead-lettered).
    pub dead_letters: u64,
    /// Identity rows retained: the evidence against a repeated effect.
    pub identities_retained: u64,
    /// Producers with a sequence watermark (each covers any number of contiguous sequences).
    pub watermark_producers: u64,
    /// Stored message rows in any state.
    pub messages_stored: u64,
    /// Outbox messages this scope's handlers committed that wait for the relay to publish them and the broker
    /// to acknowledge them; parked messages are not among them (`outbox_parked`).
    pub outbox_pending: u64,
    /// Outbox messages of this scope parked: refused by the broker too many times, or ones it cannot take
    /// (over its maximum packet size, say). Kept, not sent, until
    /// [`Inbox::requeue_parked_outbox`](crate::Inbox::requeue_parked_outbox).
    pub outbox_parked: u64,
}

/// Sizes of the database files on disk, in bytes (0 for a file that does not exist).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct FileSizes {
    /// The main database file.
    pub db_bytes: u64,
    /// The write-ahead log (`-wal`).
    pub wal_bytes: u64,
    /// The shared-memory index (`-shm`).
    pub shm_bytes: u64,
}

impl FileSizes {
    /// Sizes of the database at `path` and of its `-wal` and `-shm` files.
    pub fn of(path: &Path) -> FileSizes {
        let size = |suffix: &str| {
            let mut p = path.as_os_str().to_owned();
            p.push(suffix);
            std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
        };
        FileSizes {
            db_bytes: size(""),
            wal_bytes: size("-wal"),
            shm_bytes: size("-shm"),
        }
    }

    /// Database plus WAL: what the inbox occupies between checkpoints.
    pub fn total(&self) -> u64 {
        self.db_bytes + self.wal_bytes
    }
}

/// One stored message (`messages` row), without its body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct MessageReport {
    /// Row id (arrival order); what `requeue` takes.
    pub seq: i64,
    /// Scope name.
    pub scope: String,
    /// Producer namespace, if any.
    pub producer: Option<String>,
    /// Application message id.
    pub message_id: String,
    /// Topic it arrived on.
    pub topic: String,
    /// `pending`, `processed`, `failed` or `dead-lettered`.
    pub state: &'static str,
    /// Body size in bytes; `None` once retention pruned it.
    pub body_bytes: Option<u64>,
    /// Handler failures recorded.
    pub attempts: u32,
    /// Times a worker claimed it.
    pub claims: u32,
    /// Producer sequence number, if any.
    pub sequence: Option<i64>,
    /// Producer creation time (Unix seconds), if any.
    pub sent_at: Option<i64>,
    /// Order key, if any.
    pub order_key: Option<String>,
    /// Worker holding the lease, if any.
    pub lease_owner: Option<String>,
    /// Lease end, Unix milliseconds.
    pub lease_until_ms: Option<i64>,
    /// Text of the last handler error.
    pub last_error: Option<String>,
    /// When it was stored, Unix seconds.
    pub received_at: i64,
    /// When it was processed or dead-lettered, Unix seconds.
    pub finished_at: Option<i64>,
}

/// What the inbox holds for one identity; see [`identity`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct IdentityReport {
    /// Scope name.
    pub scope: String,
    /// Producer namespace asked for.
    pub producer: Option<String>,
    /// Message id asked for.
    pub message_id: String,
    /// The stored key: xxh3-128 of (producer, message id), hex.
    pub id_hash: String,
    /// `recorded` or `not-found` (never committed, pruned, or covered by a sequence watermark instead).
    pub status: &'static str,
    /// Fingerprint of the committed content, hex.
    pub fingerprint: Option<String>,
    /// Commit time rounded down to the UTC day, Unix seconds.
    pub committed_day: Option<i64>,
    /// The stored message, when one is kept.
    pub message: Option<MessageReport>,
    /// Conflicts recorded against this identity.
    pub conflicts: u64,
}

/// A recorded conflict: an id that came back with different content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ConflictReport {
    /// Row id.
    pub id: i64,
    /// Scope name.
    pub scope: String,
    /// Producer namespace, if any.
    pub producer: Option<String>,
    /// Application message id.
    pub message_id: String,
    /// Topic of the conflicting delivery.
    pub topic: String,
    /// Fingerprint of the content committed first, hex.
    pub stored_fingerprint: String,
    /// Fingerprint of the content that conflicted, hex.
    pub received_fingerprint: String,
    /// When it first arrived, Unix seconds.
    pub at: i64,
    /// When it last arrived, Unix seconds.
    pub last_at: i64,
    /// How many times it arrived (a redelivery adds an arrival, not a record).
    pub arrivals: u64,
}

/// A quarantined delivery (its payload only in [`export`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct QuarantineReport {
    /// Row id.
    pub id: i64,
    /// Scope name, if known.
    pub scope: Option<String>,
    /// Topic it arrived on.
    pub topic: String,
    /// Size of the whole payload in bytes (the record keeps only its first
    /// [`QUARANTINE_PREFIX`](crate::QUARANTINE_PREFIX) bytes).
    pub payload_bytes: u64,
    /// xxh3-128 of the whole payload, hex (`None` in a file of schema version 3 or older).
    pub payload_hash: Option<String>,
    /// Why it was quarantined (at its first arrival).
    pub reason: String,
    /// When it first arrived, Unix seconds.
    pub at: i64,
    /// When it last arrived, Unix seconds.
    pub last_at: i64,
    /// How many times it arrived (a redelivery adds an arrival, not a record).
    pub arrivals: u64,
}

/// What a retention pass would delete now, per scope with a policy; see [`prune_preview`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PrunePreview {
    /// Scope name.
    pub scope: String,
    /// Processed messages past their payload age.
    pub payloads_due: u64,
    /// Dead letters past their age.
    pub dead_letters_due: u64,
    /// Identities past the identity horizon with no open or dead-lettered message, or whose dead letter is due as
    /// well.
    pub identities_due: u64,
    /// Quarantine records whose last arrival is older than the record age.
    pub quarantine_due: u64,
    /// Conflict records whose last arrival is older than the record age.
    pub conflicts_due: u64,
}

/// Quarantine and conflict records of scope `scope_id` due for deletion at `now` (none before schema version 4,
/// which added the record age).
fn records_due(conn: &Connection, scope_id: i64, now: i64) -> Result<(u64, u64)> {
    if crate::store::schema::version(conn)? < 4 {
        return Ok((0, 0));
    }
    let age: Option<i64> = conn
        .prepare_cached("SELECT record_age FROM retention WHERE scope_id = ?1")?
        .query_row([scope_id], |r| r.get(0))
        .optional()?
        .flatten();
    let Some(age) = age else { return Ok((0, 0)) };
    let cutoff = now.saturating_sub(age);
    let due = |table: &str| -> Result<u64> {
        Ok(u(conn
            .prepare_cached(&format!(
                "SELECT count(*) FROM {table} WHERE scope_id = ?1 AND last_at <= ?2"
            ))?
            .query_row((scope_id, cutoff), |r| r.get(0))?))
    };
    Ok((due("quarantine")?, due("conflicts")?))
}

/// Health of the file: `PRAGMA integrity_check`, the inbox's own invariants and the settings found; see
/// [`check`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CheckReport {
    /// True when the integrity check found nothing, the schema version is known and no invariant of the inbox
    /// is broken: the inbox is sound, not only the file.
    pub ok: bool,
    /// Problems reported by `integrity_check` (empty when it answered `ok`), and an invariant check that could
    /// not run.
    pub problems: Vec<String>,
    /// Breaches of the inbox's own invariants ([`check_invariants`], leases judged with [`LEASE_BOUND`]),
    /// each named; checked in a file of the current schema version.
    pub breaches: Vec<Breach>,
    /// Why the invariants were not checked (another schema version, or the check failed; then it is among
    /// `problems` too); `None` when they were. An empty `breaches` says nothing without them.
    pub invariants_not_checked: Option<String>,
    /// `PRAGMA user_version`.
    pub schema_version: i64,
    /// The newest schema version this build knows.
    pub supported_schema_version: i64,
    /// `PRAGMA journal_mode` (an inbox always uses `wal`).
    pub journal_mode: String,
    /// `PRAGMA auto_vacuum`: `none`, `full` or `incremental` (an inbox file is `incremental`).
    pub auto_vacuum: &'static str,
    /// `PRAGMA synchronous` of the inspecting connection. It is a per-connection setting: each inbox applies its
    /// own ([`Config::synchronous`](crate::Config::synchronous), FULL by default) when it opens.
    pub synchronous: &'static str,
    /// Page size in bytes.
    pub page_size: i64,
    /// Pages in the file.
    pub page_count: i64,
    /// Free pages (reclaimed by pruning's incremental vacuum).
    pub freelist_count: i64,
    /// How identities are hashed: `keyed` (a random key per database, created with its schema) or `none`
    /// (a file created before schema version 2 keeps its unkeyed hashes).
    pub id_key: &'static str,
    /// Layout of the identity keys ([`IdOrder`](crate::IdOrder)'s name: `hashed`, `leading:N` or `counter`),
    /// chosen when the file was created.
    pub id_order: String,
    /// Why retention would refuse to act on this machine's clock now (it reads a time before the database
    /// was created, or too far after the latest time retention accepted); `None` when the clock can be right.
    pub clock_warning: Option<String>,
    /// Identities whose stored commit day is before the database could exist (a clock that was wrong when they
    /// were committed); the next retention pass re-dates them instead of pruning them.
    pub identities_implausible_day: u64,
}

/// Which table [`export`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Table {
    /// Identity rows (hash, fingerprint, day).
    Identities,
    /// Stored messages with their bodies.
    Messages,
    /// Conflict records.
    Conflicts,
    /// Quarantined deliveries with their payloads.
    Quarantine,
}

/// One exported row, tagged with its table (`"table": "identity"` and so on).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "table", rename_all = "kebab-case")]
#[non_exhaustive]
pub enum ExportRow {
    /// An identity row.
    Identity {
        /// Scope name.
        scope: String,
        /// xxh3-128 of (producer, message id), hex.
        id_hash: String,
        /// Fingerprint of the committed content, hex.
        fingerprint: String,
        /// Commit day, whole Unix days.
        day: i64,
    },
    /// A stored message and its body (`None` when pruned).
    Message {
        /// The row without its body.
        #[serde(flatten)]
        message: MessageReport,
        /// The body.
        #[serde(serialize_with = "bytes_opt")]
        payload: Option<Vec<u8>>,
    },
    /// A conflict record.
    Conflict(ConflictReport),
    /// A quarantined delivery and the part of its payload its record keeps.
    Quarantine {
        /// The row without its payload.
        #[serde(flatten)]
        record: QuarantineReport,
        /// The payload's first [`QUARANTINE_PREFIX`](crate::QUARANTINE_PREFIX) bytes (the whole payload in a
        /// file of schema version 3 or older).
        #[serde(serialize_with = "bytes")]
        payload: Vec<u8>,
    },
}

fn bytes<S: Serializer>(b: &[u8], s: S) -> std::result::Result<S::Ok, S::Error> {
    if s.is_human_readable() {
        s.serialize_str(&hex(b))
    } else {
        s.serialize_bytes(b)
    }
}

fn bytes_opt<S: Serializer>(b: &Option<Vec<u8>>, s: S) -> std::result::Result<S::Ok, S::Error> {
    match b {
        Some(b) => bytes(b, s),
        None => s.serialize_none(),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn u(v: i64) -> u64 {
    v.max(0) as u64
}

/// Text column `i` of a report's row. Text that is not UTF-8 (written by hand, or by an older build) shows
/// each bad byte as `\xNN` instead of failing the whole report over one row.
fn text(r: &Row<'_>, i: usize) -> rusqlite::Result<String> {
    match r.get_ref(i)? {
        ValueRef::Text(b) | ValueRef::Blob(b) => Ok(escaped(b)),
        // NULL or a number: the error reading it as `String` gives.
        _ => r.get(i),
    }
}

/// [`text`] of a column that may be NULL.
fn text_opt(r: &Row<'_>, i: usize) -> rusqlite::Result<Option<String>> {
    match r.get_ref(i)? {
        ValueRef::Null => Ok(None),
        _ => text(r, i).map(Some),
    }
}

/// `b` as text: its UTF-8 as it is, each byte that is not part of valid UTF-8 as `\xNN`.
fn escaped(b: &[u8]) -> String {
    let mut out = String::with_capacity(b.len());
    for chunk in b.utf8_chunks() {
        out.push_str(chunk.valid());
        for byte in chunk.invalid() {
            out.push_str(&format!("\\x{byte:02x}"));
        }
    }
    out
}

/// Runs `f` inside one read transaction, so that every number it reads belongs to the same snapshot.
fn snapshot<T, E: From<Error>>(
    conn: &Connection,
    f: impl FnOnce() -> std::result::Result<T, E>,
) -> std::result::Result<T, E> {
    if !conn.is_autocommit() {
        // Already inside a transaction (a handler's, say): that is a snapshot too.
        return f();
    }
    conn.execute_batch("BEGIN DEFERRED")
        .map_err(|e| E::from(e.into()))?;
    let result = f();
    let _ = conn.execute_batch("COMMIT");
    result
}

/// Counters, backlog and retained identities of every scope (or only `scope`), in name order, from one snapshot.
///
/// Cost: counting retained identities walks each scope's identity keys, so this is a tool's call (and a
/// monitoring call every minute or so), not one for every delivery.
pub fn stats(conn: &Connection, scope: Option<&str>) -> Result<Vec<ScopeReport>> {
    let now_ms = unix_now_ms();
    snapshot(conn, || {
        let v2 = crate::inspect::stats::v2_columns(conn)?;
        let v4 = crate::inspect::stats::v4_columns(conn)?;
        let processed = crate::inspect::stats::processed_column(conn)?;
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT s.id, s.name, coalesce({processed}, 0), coalesce(st.duplicates, 0), coalesce(st.conflicts, 0), \
             coalesce(st.handler_failures, 0), coalesce(st.quarantined, 0), coalesce(st.dead_lettered, 0), \
             coalesce(st.identities_pruned, 0), coalesce(st.payloads_pruned, 0), coalesce(st.expired, 0), {v2}, {v4} \
             FROM scopes s LEFT JOIN scope_stats st ON st.scope_id = s.id \
             WHERE ?1 IS NULL OR s.name = ?1 ORDER BY s.name",
        ))?;
        let rows = stmt
            .query_map([scope], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    ScopeReport {
                        scope: text(r, 1)?,
                        processed: u(r.get(2)?),
                        duplicates: u(r.get(3)?),
                        conflicts: u(r.get(4)?),
                        handler_failures: u(r.get(5)?),
                        quarantined: u(r.get(6)?),
                        dead_lettered: u(r.get(7)?),
                        identities_pruned: u(r.get(8)?),
                        payloads_pruned: u(r.get(9)?),
                        expired: u(r.get(10)?),
                        sequence_conflicts: u(r.get(11)?),
                        identities_restamped: u(r.get(12)?),
                        conflict_records: u(r.get::<_, Option<i64>>(13)?.unwrap_or(0)),
                        quarantine_records: u(r.get::<_, Option<i64>>(14)?.unwrap_or(0)),
                        ..ScopeReport::default()
                    },
                ))
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let now = now_ms.div_euclid(1000);
        let mut out = Vec::with_capacity(rows.len());
        for (id, mut rep) in rows {
            // Open rows through the partial index messages_open, dead letters through messages_dead.
            let (pending, failed, in_flight, oldest) = conn
                .prepare_cached(
                    "SELECT count(*) FILTER (WHERE state = 0), count(*) FILTER (WHERE state = 2), \
                     count(*) FILTER (WHERE lease_until >= ?2), min(received_at) \
                     FROM messages WHERE scope_id = ?1 AND state IN (0, 2)",
                )?
                .query_row((id, now_ms), |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, i64>(2)?,
                        r.get::<_, Option<i64>>(3)?,
                    ))
                })?;
            let count = |sql: &str| -> Result<u64> {
                Ok(u(conn
                    .prepare_cached(sql)?
                    .query_row([id], |r| r.get(0))?))
            };
            rep.pending = u(pending);
            rep.failed = u(failed);
            rep.in_flight = u(in_flight);
            rep.oldest_pending_age_secs = oldest.map(|at| u(now.saturating_sub(at)));
            rep.dead_letters =
                count("SELECT count(*) FROM messages WHERE scope_id = ?1 AND state = 3")?;
            rep.identities_retained = count("SELECT count(*) FROM identities WHERE scope_id = ?1")?;
            rep.identities_undated =
                count("SELECT count(*) FROM identities WHERE scope_id = ?1 AND day < 0")?;
            rep.watermark_producers = count("SELECT count(*) FROM watermarks WHERE scope_id = ?1")?;
            rep.messages_stored = count("SELECT count(*) FROM messages WHERE scope_id = ?1")?;
            let (outbox_pending, outbox_parked) = conn
                .prepare_cached(
                    "SELECT count(*) FILTER (WHERE state = 0), count(*) FILTER (WHERE state = 2) \
                     FROM outbox WHERE scope_id = ?1",
                )?
                .query_row([id], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))?;
            rep.outbox_pending = u(outbox_pending);
            rep.outbox_parked = u(outbox_parked);
            out.push(rep);
        }
        Ok(out)
    })
}

const MESSAGE_COLUMNS: &str = "m.seq, s.name, m.producer, m.message_id, m.topic, m.state, length(m.payload), \
     m.attempts, m.claims, m.sequence, m.sent_at, m.order_key, m.lease_owner, m.lease_until, m.last_error, \
     m.received_at, m.finished_at";

fn message_row(r: &Row<'_>) -> rusqlite::Result<MessageReport> {
    Ok(MessageReport {
        seq: r.get(0)?,
        scope: text(r, 1)?,
        producer: text_opt(r, 2)?,
        message_id: text(r, 3)?,
        topic: text(r, 4)?,
        state: MessageState::from_sql(r.get(5)?).map_or("unknown", MessageState::name),
        body_bytes: r.get::<_, Option<i64>>(6)?.map(u),
        attempts: r.get::<_, i64>(7)?.clamp(0, u32::MAX as i64) as u32,
        claims: r.get::<_, i64>(8)?.clamp(0, u32::MAX as i64) as u32,
        sequence: r.get(9)?,
        sent_at: r.get(10)?,
        order_key: text_opt(r, 11)?,
        lease_owner: text_opt(r, 12)?,
        lease_until_ms: r.get(13)?,
        last_error: text_opt(r, 14)?,
        received_at: r.get(15)?,
        finished_at: r.get(16)?,
    })
}

/// The stored message with row id `seq`, if any.
pub fn message(conn: &Connection, seq: i64) -> Result<Option<MessageReport>> {
    Ok(conn
        .prepare_cached(&format!(
            "SELECT {MESSAGE_COLUMNS} FROM messages m JOIN scopes s ON s.id = m.scope_id WHERE m.seq = ?1"
        ))?
        .query_row([seq], message_row)
        .optional()?)
}

/// What is recorded for the identity (scope, producer, message id): status, fingerprint, stored message and
/// conflicts. The same lookup as [`Inbox::status`], with the details an operator needs.
pub fn identity(
    conn: &Connection,
    scope: &str,
    producer: Option<&str>,
    message_id: &str,
) -> Result<IdentityReport> {
    let id_hash = IdHash::keyed(&crate::store::schema::id_key(conn)?, producer, message_id);
    snapshot(conn, || {
        let st = status(conn, scope, producer, message_id)?;
        let open = conn
            .prepare_cached(&format!(
                "SELECT {MESSAGE_COLUMNS} FROM messages m JOIN scopes s ON s.id = m.scope_id \
                 WHERE s.name = ?1 AND m.id_hash = ?2 AND m.state IN (0, 2, 3)"
            ))?
            .query_row((scope, id_hash.as_bytes()), message_row)
            .optional()?;
        let message = match open {
            Some(m) => Some(m),
            // Processed bodies are not indexed by id (see `schema.sql`): an operator's lookup scans for the
            // latest one, newest first.
            None => conn
                .prepare_cached(&format!(
                    "SELECT {MESSAGE_COLUMNS} FROM messages m JOIN scopes s ON s.id = m.scope_id \
                     WHERE s.name = ?1 AND m.id_hash = ?2 AND m.state = 1 ORDER BY m.seq DESC LIMIT 1"
                ))?
                .query_row((scope, id_hash.as_bytes()), message_row)
                .optional()?,
        };
        let conflicts: i64 = conn
            .prepare_cached(
                "SELECT count(*) FROM conflicts c JOIN scopes s ON s.id = c.scope_id \
                 WHERE s.name = ?1 AND c.id_hash = ?2",
            )?
            .query_row((scope, id_hash.as_bytes()), |r| r.get(0))?;
        let (status, fingerprint, committed_day) = match st {
            Status::Recorded {
                fingerprint, at, ..
            } => ("recorded", Some(fingerprint.to_string()), Some(at)),
            _ => ("not-found", None, None),
        };
        Ok(IdentityReport {
            scope: scope.to_owned(),
            producer: producer.map(str::to_owned),
            message_id: message_id.to_owned(),
            id_hash: id_hash.to_hex(),
            status,
            fingerprint,
            committed_day,
            message,
            conflicts: u(conflicts),
        })
    })
}

/// True when `scope` names a scope of the inbox (one that ever recorded something, or has a retention
/// policy). The listings and [`stats`] return nothing for a name that is not one; a tool tells the two apart.
pub fn scope_exists(conn: &Connection, scope: &str) -> Result<bool> {
    Ok(conn
        .prepare_cached("SELECT 1 FROM scopes WHERE name = ?1")?
        .query_row([scope], |_| Ok(()))
        .optional()?
        .is_some())
}

/// Up to `limit` conflict records, oldest first, of every scope or only `scope`.
pub fn conflicts(
    conn: &Connection,
    scope: Option<&str>,
    limit: usize,
) -> Result<Vec<ConflictReport>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {} FROM conflicts c JOIN scopes s ON s.id = c.scope_id WHERE ?1 IS NULL OR s.name = ?1 \
         ORDER BY c.id LIMIT ?2",
        conflict_columns(conn)?
    ))?;
    let rows = stmt.query_map((scope, clamp(limit)), conflict_row)?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

fn conflict_row(r: &Row<'_>) -> rusqlite::Result<ConflictReport> {
    Ok(ConflictReport {
        id: r.get(0)?,
        scope: text(r, 1)?,
        producer: text_opt(r, 2)?,
        message_id: text(r, 3)?,
        topic: text(r, 4)?,
        stored_fingerprint: Fingerprint::from_sql(r.get(5)?).to_string(),
        received_fingerprint: Fingerprint::from_sql(r.get(6)?).to_string(),
        at: r.get(7)?,
        last_at: r.get(8)?,
        arrivals: u(r.get(9)?),
    })
}

/// The columns `conflict_row` reads; a file older than schema version 4 has one arrival per row.
fn conflict_columns(conn: &Connection) -> Result<&'static str> {
    Ok(if crate::store::schema::version(conn)? >= 4 {
        "c.id, s.name, c.producer, c.message_id, c.topic, c.stored_fingerprint, c.received_fingerprint, c.at, \
         c.last_at, c.arrivals"
    } else {
        "c.id, s.name, c.producer, c.message_id, c.topic, c.stored_fingerprint, c.received_fingerprint, c.at, \
         c.at, 1"
    })
}

/// The columns `quarantine_row` reads (and the stored payload prefix last); a file older than schema version 4
/// holds whole payloads, one arrival per row.
fn quarantine_columns(conn: &Connection) -> Result<&'static str> {
    Ok(if crate::store::schema::version(conn)? >= 4 {
        "q.id, s.name, q.topic, q.payload_len, q.payload_hash, q.reason, q.at, q.last_at, q.arrivals, q.payload"
    } else {
        "q.id, s.name, q.topic, length(q.payload), NULL, q.reason, q.at, q.at, 1, q.payload"
    })
}

fn quarantine_row(r: &Row<'_>) -> rusqlite::Result<QuarantineReport> {
    Ok(QuarantineReport {
        id: r.get(0)?,
        scope: text_opt(r, 1)?,
        topic: text(r, 2)?,
        payload_bytes: u(r.get(3)?),
        payload_hash: r.get::<_, Option<Vec<u8>>>(4)?.map(|h| hex(&h)),
        reason: text(r, 5)?,
        at: r.get(6)?,
        last_at: r.get(7)?,
        arrivals: u(r.get(8)?),
    })
}

/// Up to `limit` quarantined deliveries, oldest first, of every scope or only `scope`.
pub fn quarantine(
    conn: &Connection,
    scope: Option<&str>,
    limit: usize,
) -> Result<Vec<QuarantineReport>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {} FROM quarantine q LEFT JOIN scopes s ON s.id = q.scope_id WHERE ?1 IS NULL OR s.name = ?1 \
         ORDER BY q.id LIMIT ?2",
        quarantine_columns(conn)?
    ))?;
    let rows = stmt.query_map((scope, clamp(limit)), quarantine_row)?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// Up to `limit` dead letters, oldest first, of every scope or only `scope`.
pub fn dead_letters(
    conn: &Connection,
    scope: Option<&str>,
    limit: usize,
) -> Result<Vec<MessageReport>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {MESSAGE_COLUMNS} FROM messages m JOIN scopes s ON s.id = m.scope_id \
         WHERE m.state = 3 AND (?1 IS NULL OR s.name = ?1) ORDER BY m.seq LIMIT ?2"
    ))?;
    let rows = stmt.query_map((scope, clamp(limit)), message_row)?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

fn clamp(limit: usize) -> i64 {
    limit.min(i64::MAX as usize) as i64
}

/// How many outbox messages sent before `before` (Unix seconds) a pass would delete
/// ([`Pruning::sent_outbox`](crate::Pruning::sent_outbox)).
pub fn sent_outbox_due(conn: &Connection, before: i64) -> Result<u64> {
    let n: i64 = conn
        .prepare_cached("SELECT count(*) FROM outbox WHERE state = 1 AND sent_at < ?1")?
        .query_row([before], |r| r.get(0))?;
    Ok(u(n))
}

/// What [`Inbox::prune`] would delete if it ran at `now` (Unix seconds), per scope with a retention policy,
/// by the same rules: processed and dead-lettered messages past their ages, and identities past the horizon
/// with no pending, failed or dead-lettered message (a processed one does not hold its identity back).
/// Pending and failed messages are never due.
pub fn prune_preview(conn: &Connection, now: i64) -> Result<Vec<PrunePreview>> {
    snapshot(conn, || {
        let mut stmt = conn.prepare_cached(
            "SELECT r.scope_id, s.name, r.processed_payload_age, r.dead_letter_age, r.identity_horizon \
             FROM retention r JOIN scopes s ON s.id = r.scope_id ORDER BY s.name",
        )?;
        let scopes = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    text(r, 1)?,
                    r.get::<_, Option<i64>>(2)?,
                    r.get::<_, Option<i64>>(3)?,
                    r.get::<_, Option<i64>>(4)?,
                ))
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        // Identities with a commit day before the database existed are re-dated, not pruned (nor undated ones).
        let floor_day = crate::retention::clock_floor(conn)?.div_euclid(DAY);
        // A message is due when its state's age is set and it finished longer ago than that.
        const DUE: &str = "(m.state = 1 AND ?2 IS NOT NULL AND coalesce(m.finished_at, m.received_at) <= ?4 - ?2) \
             OR (m.state = 3 AND ?3 IS NOT NULL AND coalesce(m.finished_at, m.received_at) <= ?4 - ?3)";
        let mut out = Vec::with_capacity(scopes.len());
        for (id, name, processed_age, dead_age, horizon) in scopes {
            let (payloads, dead): (i64, i64) = conn
                .prepare_cached(&format!(
                    "SELECT count(*) FILTER (WHERE m.state = 1), count(*) FILTER (WHERE m.state = 3) \
                     FROM messages m WHERE m.scope_id = ?1 AND ({DUE})"
                ))?
                .query_row((id, processed_age, dead_age, now), |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })?;
            let identities: i64 = match horizon {
                None => 0,
                Some(h) => conn
                    .prepare_cached(&format!(
                        "SELECT count(*) FROM identities i WHERE i.scope_id = ?1 AND i.day >= ?6 AND i.day < ?5 AND NOT EXISTS ( \
                           SELECT 1 FROM messages m WHERE m.scope_id = ?1 AND m.id_hash = i.id_hash \
                           AND m.state IN (0, 2, 3) AND NOT ({DUE}))"
                    ))?
                    .query_row(
                        (
                            id,
                            processed_age,
                            dead_age,
                            now,
                            now.saturating_sub(h).div_euclid(DAY),
                            floor_day,
                        ),
                        |r| r.get(0),
                    )?,
            };
            let (quarantine_due, conflicts_due) = records_due(conn, id, now)?;
            out.push(PrunePreview {
                scope: name,
                payloads_due: u(payloads),
                dead_letters_due: u(dead),
                identities_due: u(identities),
                quarantine_due,
                conflicts_due,
            });
        }
        Ok(out)
    })
}

/// Runs `PRAGMA integrity_check` (reporting at most `max_problems` problems) and reads the schema version and
/// file settings. A file so damaged that the check itself fails is reported as not ok, with the error as its
/// problem.
pub fn check(conn: &Connection, max_problems: usize) -> Result<CheckReport> {
    let pragma_i64 = |name: &str| -> Result<i64> {
        Ok(conn.query_row(&format!("PRAGMA {name}"), [], |r| r.get(0))?)
    };
    let schema_version = pragma_i64("user_version")?;
    let mut problems: Vec<String> = match integrity(conn, max_problems.max(1)) {
        Ok(lines) => lines.into_iter().filter(|l| l != "ok").collect(),
        Err(e) => vec![format!("integrity_check failed: {e}")],
    };
    let (breaches, invariants_not_checked) = if schema_version == SCHEMA_VERSION {
        match snapshot(conn, || check_invariants(conn, unix_now_ms(), LEASE_BOUND)) {
            Ok(found) => (found, None),
            Err(e) => {
                problems.push(format!("the invariant checks failed: {e}"));
                (Vec::new(), Some(e.to_string()))
            }
        }
    } else {
        let why = format!("schema version {schema_version}; checked at {SCHEMA_VERSION} only");
        (Vec::new(), Some(why))
    };
    // A layout this version does not know is a problem of the file to report, not a reason to stop checking.
    let (id_key, id_order) = match crate::store::schema::id_key(conn) {
        Ok(key) => (key.kind(), key.order().name()),
        Err(e) => {
            problems.push(format!("the identity key cannot be read: {e}"));
            ("unknown", "unknown".to_owned())
        }
    };
    let journal_mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
    let auto_vacuum = match pragma_i64("auto_vacuum")? {
        0 => "none",
        1 => "full",
        2 => "incremental",
        _ => "unknown",
    };
    let synchronous = match pragma_i64("synchronous")? {
        0 => "off",
        1 => "normal",
        2 => "full",
        3 => "extra",
        _ => "unknown",
    };
    let ok = problems.is_empty()
        && breaches.is_empty()
        && (1..=SCHEMA_VERSION).contains(&schema_version);
    let now = crate::store::txn::unix_now();
    let clock_warning =
        crate::retention::clock_verdict(conn, now, crate::retention::Pruning::default().jump())?
            .warning(now);
    let floor_day = crate::retention::clock_floor(conn)?.div_euclid(DAY);
    let identities_implausible_day: i64 = conn.query_row(
        "SELECT count(*) FROM identities WHERE (CASE WHEN day < 0 THEN -1 - day ELSE day END) < ?1",
        [floor_day],
        |r| r.get(0),
    )?;
    if let Some(w) = &clock_warning {
        log::warn!("{w}");
    }
    Ok(CheckReport {
        ok,
        problems,
        breaches,
        invariants_not_checked,
        schema_version,
        supported_schema_version: SCHEMA_VERSION,
        journal_mode,
        auto_vacuum,
        synchronous,
        page_size: pragma_i64("page_size")?,
        page_count: pragma_i64("page_count")?,
        freelist_count: pragma_i64("freelist_count")?,
        id_key,
        id_order,
        clock_warning,
        identities_implausible_day: u(identities_implausible_day),
    })
}

fn integrity(conn: &Connection, max: usize) -> rusqlite::Result<Vec<String>> {
    let mut stmt = conn.prepare(&format!("PRAGMA integrity_check({max})"))?;
    let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
    rows.collect()
}

/// Number of rows [`export`] will visit for `table` (for a progress indicator).
pub fn count(conn: &Connection, table: Table) -> Result<u64> {
    let name = match table {
        Table::Identities => "identities",
        Table::Messages => "messages",
        Table::Conflicts => "conflicts",
        Table::Quarantine => "quarantine",
    };
    Ok(u(conn.query_row(
        &format!("SELECT count(*) FROM {name}"),
        [],
        |r| r.get(0),
    )?))
}

/// Calls `f` with every row of `table`, in key order, from one snapshot; returns how many. An error from `f`
/// (writing the row out, say) stops the export and is returned.
///
/// `f` runs inside the snapshot's read transaction, and while it lasts no checkpoint can take the WAL back
/// to its start: consumers on the file grow the WAL for as long as `f` takes. Give it a fast sink (a file),
/// never one that can stall (a pipe to a reader); `inboxctl export` writes to a temporary file and copies
/// that to standard output after the snapshot ends.
pub fn export<E: From<Error>>(
    conn: &Connection,
    table: Table,
    mut f: impl FnMut(ExportRow) -> std::result::Result<(), E>,
) -> std::result::Result<u64, E> {
    snapshot(conn, || {
        let mut n = 0u64;
        let mut each = |row: ExportRow| -> std::result::Result<(), E> {
            n += 1;
            f(row)
        };
        export_rows(conn, table, &mut each).map_err(|e| match e {
            Stop::Db(e) => E::from(e),
            Stop::Caller(e) => e,
        })?;
        Ok(n)
    })
}

enum Stop<E> {
    Db(Error),
    Caller(E),
}

impl<E> From<rusqlite::Error> for Stop<E> {
    fn from(e: rusqlite::Error) -> Self {
        Stop::Db(e.into())
    }
}

fn export_rows<E>(
    conn: &Connection,
    table: Table,
    each: &mut impl FnMut(ExportRow) -> std::result::Result<(), E>,
) -> std::result::Result<(), Stop<E>> {
    let mut each = |row: ExportRow| each(row).map_err(Stop::Caller);
    {
        match table {
            Table::Identities => {
                let mut stmt = conn.prepare(
                    "SELECT s.name, i.id_hash, i.fingerprint, i.day FROM identities i \
                     JOIN scopes s ON s.id = i.scope_id ORDER BY i.scope_id, i.id_hash",
                )?;
                let mut rows = stmt.query([])?;
                while let Some(r) = rows.next()? {
                    each(ExportRow::Identity {
                        scope: text(r, 0)?,
                        id_hash: hex(&r.get::<_, Vec<u8>>(1)?),
                        fingerprint: Fingerprint::from_sql(r.get(2)?).to_string(),
                        day: crate::inbox::commit_day(r.get(3)?),
                    })?;
                }
            }
            Table::Messages => {
                let mut stmt = conn.prepare(&format!(
                    "SELECT {MESSAGE_COLUMNS}, m.payload FROM messages m JOIN scopes s ON s.id = m.scope_id \
                     ORDER BY m.seq"
                ))?;
                let mut rows = stmt.query([])?;
                while let Some(r) = rows.next()? {
                    each(ExportRow::Message {
                        message: message_row(r)?,
                        payload: r.get(17)?,
                    })?;
                }
            }
            Table::Conflicts => {
                let mut stmt = conn.prepare(&format!(
                    "SELECT {} FROM conflicts c JOIN scopes s ON s.id = c.scope_id ORDER BY c.id",
                    conflict_columns(conn).map_err(Stop::Db)?
                ))?;
                let mut rows = stmt.query([])?;
                while let Some(r) = rows.next()? {
                    each(ExportRow::Conflict(conflict_row(r)?))?;
                }
            }
            Table::Quarantine => {
                let mut stmt = conn.prepare(&format!(
                    "SELECT {} FROM quarantine q LEFT JOIN scopes s ON s.id = q.scope_id ORDER BY q.id",
                    quarantine_columns(conn).map_err(Stop::Db)?
                ))?;
                let mut rows = stmt.query([])?;
                while let Some(r) = rows.next()? {
                    each(ExportRow::Quarantine {
                        record: quarantine_row(r)?,
                        payload: r.get(9)?,
                    })?;
                }
            }
        }
    }
    Ok(())
}

impl Inbox {
    /// Counters, backlog and retained identities of every scope, from one snapshot; see [`stats`].
    pub fn stats(&self) -> Result<Vec<ScopeReport>> {
        stats(&self.conn, None)
    }

    /// Sizes of this inbox's database and WAL files on disk.
    pub fn file_sizes(&self) -> FileSizes {
        FileSizes::of(self.path())
    }
}
