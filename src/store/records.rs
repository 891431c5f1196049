//! Quarantine and conflict records: one bounded row per distinct delivery, redeliveries counted as arrivals.
//!
//! A publisher can send the same bad delivery again and again (a lost PUBACK, a broker redelivering after a
//! reconnect), and a bad delivery can be large. So a quarantine row keeps only [`QUARANTINE_PREFIX`] bytes of the
//! payload, its length and its hash, and the same delivery arriving again raises the row's `arrivals` instead of
//! adding a row. Conflict rows likewise, per (identity, received content). The UNIQUE index of each table decides
//! whether a record is new, inside the caller's write transaction (an upsert, never a query first).

use rusqlite::Connection;
use xxhash_rust::xxh3::{Xxh3, Xxh3Default};

use crate::store::db::Db;
use crate::store::identity::{Fingerprint, IdHash, IdKey};

/// Longest reason a quarantine record keeps, in bytes: reasons quote what a publisher sent.
pub(crate) const MAX_REASON: usize = 1024;
/// Longest message id, producer or topic a record keeps, in bytes, whatever the limits (a delivery
/// quarantined for breaking them carries them whole). The record's key covers the whole values.
pub(crate) const MAX_RECORD_TEXT: usize = 4096;

/// Bytes of a quarantined payload kept in its record (the rest is described by its length and xxh3-128 hash):
/// enough to recognise what a sender sent, never enough for a sender to fill the disk.
pub const QUARANTINE_PREFIX: usize = 256;

/// What to record for one quarantined delivery; see [`quarantine`].
pub(crate) struct Quarantine<'a> {
    pub(crate) scope_id: i64,
    /// The delivery's identity, when it has one: part of what makes the record distinct.
    pub(crate) identity: Option<&'a IdHash>,
    pub(crate) topic: &'a str,
    pub(crate) payload: &'a [u8],
    pub(crate) reason: &'a str,
    /// Longest topic stored (the configured topic limit); the record key covers the whole topic.
    pub(crate) max_topic: usize,
}

/// The time a record is stamped with: never before the latest clock reading retention accepted
/// (`clock_seen`), so that a clock running behind cannot make a record look older than it is, and have its
/// retention delete it early (as identities are dated, `inbox::stored_day`).
pub(crate) fn stamp(conn: &Db, now: i64) -> i64 {
    now.max(conn.clock_seen.get())
}

/// Records a quarantined delivery inside the caller's open transaction and counts it: `quarantined` for every
/// arrival, `quarantine_records` for a new record. Returns the record's row id and whether it is new.
pub(crate) fn quarantine(
    conn: &Db,
    key: &IdKey,
    q: &Quarantine<'_>,
    now: i64,
) -> rusqlite::Result<(i64, bool)> {
    let now = stamp(conn, now);
    let record_key = record_key(key, q.identity, q.topic, q.payload);
    let prefix = &q.payload[..q.payload.len().min(QUARANTINE_PREFIX)];
    let (id, arrivals): (i64, i64) = conn
        .prepare_cached(
            "INSERT INTO quarantine (scope_id, record_key, topic, payload, payload_len, payload_hash, reason, at, \
             last_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?8) \
             ON CONFLICT (scope_id, record_key) DO UPDATE SET arrivals = arrivals + 1, last_at = excluded.last_at \
             RETURNING id, arrivals",
        )?
        .query_row(
            (
                q.scope_id,
                &record_key[..],
                cut(q.topic, q.max_topic.min(MAX_RECORD_TEXT)),
                prefix,
                q.payload.len() as i64,
                &payload_hash(q.payload)[..],
                cut(q.reason, MAX_REASON),
                now,
            ),
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
    let new = arrivals == 1;
    conn.prepare_cached(
        "UPDATE scope_stats SET quarantined = quarantined + 1, quarantine_records = quarantine_records + ?2 \
         WHERE scope_id = ?1",
    )?
    .execute((q.scope_id, i64::from(new)))?;
    Ok((id, new))
}

/// One conflicting delivery to record; see [`conflict`].
pub(crate) struct Conflict<'a> {
    pub(crate) scope_id: i64,
    pub(crate) id_hash: &'a IdHash,
    pub(crate) producer: Option<&'a str>,
    pub(crate) message_id: &'a str,
    pub(crate) topic: &'a str,
    pub(crate) stored: Fingerprint,
    pub(crate) received: Fingerprint,
}

/// Records a conflict inside the caller's open transaction: a new row for a new (identity, received content),
/// else one more arrival on its row. Counts `conflict_records` for a new row; the caller counts the arrival
/// (`conflicts`) with its other outcomes. True when the record is new.
pub(crate) fn conflict(conn: &Db, c: &Conflict<'_>, now: i64) -> rusqlite::Result<bool> {
    let now = stamp(conn, now);
    let arrivals: i64 = conn
        .prepare_cached(
            "INSERT INTO conflicts (scope_id, id_hash, producer, message_id, topic, stored_fingerprint, \
             received_fingerprint, at, last_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?8) \
             ON CONFLICT (scope_id, id_hash, received_fingerprint) DO UPDATE SET arrivals = arrivals + 1, \
             last_at = excluded.last_at RETURNING arrivals",
        )?
        .query_row(
            (
                c.scope_id,
                c.id_hash.as_bytes(),
                c.producer.map(|p| cut(p, MAX_RECORD_TEXT)),
                cut(c.message_id, MAX_RECORD_TEXT),
                cut(c.topic, MAX_RECORD_TEXT),
                c.stored.to_sql(),
                c.received.to_sql(),
                now,
            ),
            |r| r.get(0),
        )?;
    let new = arrivals == 1;
    if new {
        conn.prepare_cached(
            "UPDATE scope_stats SET conflict_records = conflict_records + 1 WHERE scope_id = ?1",
        )?
        .execute([c.scope_id])?;
    }
    Ok(new)
}

/// xxh3-128 of the whole payload, unkeyed (an operator can compare it with a file), big-endian.
pub(crate) fn payload_hash(payload: &[u8]) -> [u8; 16] {
    xxhash_rust::xxh3::xxh3_128(payload).to_be_bytes()
}

/// What makes a quarantine record distinct, hashed under the file's key (as identities are), so a sender cannot
/// craft a delivery that merges into another one's record. Length-prefixed, like identity hashes.
fn record_key(key: &IdKey, identity: Option<&IdHash>, topic: &str, payload: &[u8]) -> [u8; 16] {
    let feed = |update: &mut dyn FnMut(&[u8])| {
        match identity {
            None => update(&[0]),
            Some(id) => {
                update(&[1]);
                // No length prefix: every key of one file has the same length (its layout's), and a
                // prefix now would change the record keys already stored.
                update(id.as_bytes());
            }
        }
        update(&(topic.len() as u64).to_le_bytes());
        update(topic.as_bytes());
        update(&(payload.len() as u64).to_le_bytes());
        update(payload);
    };
    match key.secret() {
        None => {
            let mut h = Xxh3Default::new();
            feed(&mut |b| h.update(b));
            h.digest128().to_be_bytes()
        }
        Some(secret) => {
            let mut h = Xxh3::with_secret(*secret);
            feed(&mut |b| h.update(b));
            h.digest128().to_be_bytes()
        }
    }
}

/// `s` cut to at most `max` bytes, at a character boundary.
pub(crate) fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Schema 3 -> 4, the part SQL cannot do: quarantine rows of version 3 hold whole payloads. Each is rewritten
/// as a bounded record (prefix, length, hash), read through incremental blob I/O so that a huge payload is
/// never held in memory whole. Runs inside the migration's transaction, after the SQL part created
/// `quarantine_v4`.
pub(crate) fn migrate_quarantine_v3(conn: &Connection) -> rusqlite::Result<()> {
    use std::io::Read;
    let ids: Vec<i64> = conn
        .prepare("SELECT id FROM quarantine ORDER BY id")?
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    let mut insert = conn.prepare(
        "INSERT INTO quarantine_v4 (id, scope_id, record_key, topic, payload, payload_len, payload_hash, reason, \
         at, last_at, arrivals) SELECT id, scope_id, NULL, topic, ?2, ?3, ?4, reason, at, at, 1 FROM quarantine \
         WHERE id = ?1",
    )?;
    let mut chunk = vec![0u8; 64 * 1024];
    for id in ids {
        let mut blob = conn.blob_open(rusqlite::MAIN_DB, "quarantine", "payload", id, true)?;
        let len = blob.len();
        let mut hash = Xxh3Default::new();
        let mut prefix = Vec::with_capacity(len.min(QUARANTINE_PREFIX));
        loop {
            let n = blob
                .read(&mut chunk)
                .map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
            if n == 0 {
                break;
            }
            let room = QUARANTINE_PREFIX - prefix.len();
            prefix.extend_from_slice(&chunk[..n.min(room)]);
            hash.update(&chunk[..n]);
        }
        drop(blob);
        insert.execute((id, prefix, len as i64, &hash.digest128().to_be_bytes()[..]))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_keys_separate_identity_topic_and_payload() {
        let key = IdKey::UNKEYED;
        let id = IdHash::of(None, "m");
        let a = record_key(&key, None, "t", b"p");
        assert_eq!(a, record_key(&key, None, "t", b"p"));
        assert_ne!(a, record_key(&key, Some(&id), "t", b"p"));
        assert_ne!(
            record_key(&key, None, "ab", b"c"),
            record_key(&key, None, "a", b"bc")
        );
        assert_eq!(cut("héllo", 2), "h");
        assert_eq!(cut("hello", 10), "hello");
    }
}
