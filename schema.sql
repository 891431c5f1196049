-- edge-inbox schema, version 6.
--
-- This file is the single source of the schema: `src/schema.rs` runs it on a new database and then sets
-- `PRAGMA user_version`. A later version adds a forward migration there and bumps the version; this file
-- always shows the current shape.
--
-- Times are Unix seconds (UTC). Hashes are xxh3 (stable across releases and platforms).

-- Facts about the file itself. name 'id_key': the secret (192 random bytes, created with the schema) under
-- which identity hashes are computed; NULL in a file migrated from version 1, whose identities stay unkeyed.
-- name 'created_at': when the schema was created (Unix seconds; in a migrated file the first scope's creation).
-- name 'clock_seen': the latest clock reading retention accepted (see src/retention.rs).
-- name 'id_order': the layout of identity keys (`IdOrder`: 'hashed', 'leading:N' or 'counter'), chosen when the
-- file is created and never changed: every stored key depends on it. 'hashed' in a file migrated from version 5.
CREATE TABLE inbox_meta (
    name  TEXT PRIMARY KEY,
    value
) WITHOUT ROWID;

-- Consumer scopes are interned: every other table stores the small integer, not the name.
CREATE TABLE scopes (
    id         INTEGER PRIMARY KEY,
    name       TEXT    NOT NULL UNIQUE,
    created_at INTEGER NOT NULL
);

-- The evidence. One compact row per (scope, producer, message id) ever committed.
-- id_hash is xxh3-128 of (producer, message id) under the file's id_key: fixed width whatever the id length, so the row stays small
-- after the payload is pruned. Under an id_order other than 'hashed' an order prefix goes ahead of those 16
-- bytes (up to 16 more), so that ids that grow with time are inserted near each other; every table stores the
-- same key for an identity. fingerprint is xxh3-64 of (topic, payload) and only detects conflicts.
-- day is the commit time in whole Unix days (UTC): two bytes until 2059 instead of four for seconds, which keeps
-- a retained identity under 40 bytes on disk (without an order prefix); the identity horizon only needs day precision. A delivery that
-- carried no send time stores -1 - day: the identity horizon never prunes it, since a repetition of it could
-- not be recognised as expired once its identity is gone.
-- No index on day: the identity horizon is applied by a bounded scan in key order (an index would cost more
-- bytes per identity than the row itself saves).
-- The PRIMARY KEY insert, inside BEGIN IMMEDIATE, is what arbitrates a duplicate.
CREATE TABLE identities (
    scope_id    INTEGER NOT NULL,
    id_hash     BLOB    NOT NULL,
    fingerprint INTEGER NOT NULL,
    day         INTEGER NOT NULL,
    PRIMARY KEY (scope_id, id_hash)
) WITHOUT ROWID;

-- Same identity, different content: recorded, never applied. One row per distinct (scope, identity, received
-- content): a redelivery of the same conflicting delivery adds an arrival (arrivals, last_at) instead of a row;
-- the UNIQUE index arbitrates that inside the write transaction. at is the first arrival. Retention deletes rows
-- whose last arrival is older than the scope's record_age (see retention).
CREATE TABLE conflicts (
    id                   INTEGER PRIMARY KEY,
    scope_id             INTEGER NOT NULL,
    id_hash              BLOB    NOT NULL,
    producer             TEXT,
    message_id           TEXT    NOT NULL,
    topic                TEXT    NOT NULL,
    stored_fingerprint   INTEGER NOT NULL,
    received_fingerprint INTEGER NOT NULL,
    at                   INTEGER NOT NULL,
    last_at              INTEGER NOT NULL,
    arrivals             INTEGER NOT NULL DEFAULT 1
);
CREATE UNIQUE INDEX conflicts_by_content ON conflicts (scope_id, id_hash, received_fingerprint);
CREATE INDEX conflicts_by_age ON conflicts (scope_id, last_at);

-- Durable counters per scope, updated in the same transaction as the outcomes they count.
-- One count is derived instead: a delivery the strong case processes by inserting a new identity row writes
-- no counter (that would be one more page per commit); the row itself is the count. The processed figure is
-- processed + (identity rows of the scope) - identity_offset, where identity_offset is kept by every other
-- writer of identity rows (pending and dead-lettered deliveries add theirs, pruning subtracts what it deletes)
-- in the same transaction. So the figure is exact at every commit and after any crash, and costs a count of
-- the scope's identities to read.
CREATE TABLE scope_stats (
    scope_id          INTEGER PRIMARY KEY,
    processed         INTEGER NOT NULL DEFAULT 0,
    duplicates        INTEGER NOT NULL DEFAULT 0,
    conflicts         INTEGER NOT NULL DEFAULT 0,
    handler_failures  INTEGER NOT NULL DEFAULT 0,
    quarantined       INTEGER NOT NULL DEFAULT 0,
    dead_lettered     INTEGER NOT NULL DEFAULT 0,
    identities_pruned INTEGER NOT NULL DEFAULT 0,
    payloads_pruned   INTEGER NOT NULL DEFAULT 0,
    expired           INTEGER NOT NULL DEFAULT 0,
    -- Numbered deliveries whose sequence was already claimed by another message (a producer that restarted
    -- its counter, or two producers sharing a namespace) or could no longer be compared: quarantined.
    sequence_conflicts INTEGER NOT NULL DEFAULT 0,
    -- Identities whose commit day could not be right (before the file existed, or in the future) and that
    -- retention stamped with the day it first saw a plausible clock instead.
    identities_restamped INTEGER NOT NULL DEFAULT 0,
    -- Identity rows that do not stand for a delivery processed by the strong case (see above).
    identity_offset INTEGER NOT NULL DEFAULT 0,
    -- conflicts and quarantined count arrivals (every delivery so recorded, redeliveries included);
    -- conflict_records and quarantine_records count the distinct records made (a new row in conflicts or
    -- quarantine). Pruning a record changes neither: they are history, like the other counters.
    conflict_records   INTEGER NOT NULL DEFAULT 0,
    quarantine_records INTEGER NOT NULL DEFAULT 0
);

-- Built-in key-value state for handlers. Values are CBOR. ns is the scope name unless the caller picks one.
CREATE TABLE kv (
    ns    TEXT NOT NULL,
    key   TEXT NOT NULL,
    value BLOB NOT NULL,
    PRIMARY KEY (ns, key)
) WITHOUT ROWID;

-- Deliveries that could not become a Delivery (no id, malformed envelope, over a limit), and numbered or expired
-- deliveries that cannot be applied: kept for an operator, not dropped. A bounded record, whatever the payload's
-- size: its first bytes (QUARANTINE_PREFIX, 256), its full length and its xxh3-128 (16 bytes, big-endian), and
-- the topic cut to the configured topic limit.
-- record_key is xxh3-128, under the file's id_key, of what makes the record distinct: (topic, payload) for a
-- delivery without an identity, (identity, topic, payload) for one with. A redelivery of the same delivery adds an
-- arrival (arrivals, last_at) to its record instead of a row; the UNIQUE index arbitrates that inside the write
-- transaction. The first reason and time (at) are kept. NULL for rows migrated from version 3 (never merged).
-- Retention deletes rows whose last arrival is older than the scope's record_age (see retention).
CREATE TABLE quarantine (
    id           INTEGER PRIMARY KEY,
    scope_id     INTEGER,
    record_key   BLOB,
    topic        TEXT    NOT NULL,
    payload      BLOB    NOT NULL,
    payload_len  INTEGER NOT NULL,
    payload_hash BLOB    NOT NULL,
    reason       TEXT    NOT NULL,
    at           INTEGER NOT NULL,
    last_at      INTEGER NOT NULL,
    arrivals     INTEGER NOT NULL DEFAULT 1
);
CREATE UNIQUE INDEX quarantine_by_key ON quarantine (scope_id, record_key);
CREATE INDEX quarantine_by_age ON quarantine (scope_id, last_at);

-- Message bodies: pending work of the received-then-deferred mode, and optionally the payloads of processed
-- deliveries. state: 0 pending, 1 processed, 2 failed (waiting for a retry), 3 dead-lettered.
-- A row in state 0 or 2 is an acknowledged obligation: retention must never delete it (nor its identity).
-- Retention deletes processed rows (and dead letters, only if so configured) after their age; the identity
-- row stays.
-- not_before and lease_until are Unix *milliseconds*: leases and backoff need sub-second precision.
-- A claim sets lease_owner, lease_until and bumps claims; claims doubles as the token of that one claim, so a
-- worker whose lease expired and was taken over cannot commit (see src/worker.rs).
-- attempts counts handler failures only (storage errors and crashes do not consume attempts).
-- order_key, when set, serialises the messages sharing it in seq (arrival) order.
CREATE TABLE messages (
    seq          INTEGER PRIMARY KEY,
    scope_id     INTEGER NOT NULL,
    id_hash      BLOB    NOT NULL,
    producer     TEXT,
    message_id   TEXT    NOT NULL,
    topic        TEXT    NOT NULL,
    payload      BLOB,
    sequence     INTEGER,
    sent_at      INTEGER,
    order_key    TEXT,
    state        INTEGER NOT NULL CHECK (state IN (0, 1, 2, 3)),
    attempts     INTEGER NOT NULL DEFAULT 0,
    claims       INTEGER NOT NULL DEFAULT 0,
    not_before   INTEGER NOT NULL DEFAULT 0,
    lease_owner  TEXT,
    lease_until  INTEGER,
    last_error   TEXT,
    received_at  INTEGER NOT NULL,
    finished_at  INTEGER
);
-- One open or dead-lettered body per identity, arbitrated inside the write transaction. Processed bodies, the
-- bulk of the table, are left out: retention deletes them in seq order, and an index over every row would put
-- each of those deletes on a leaf of its own (the index is in hash order), dozens of scattered pages per prune
-- step. A processed body is history: it is found by seq, not by id, and does not hold its identity back from
-- the identity horizon (which, for a deferred delivery, counts from the day it was processed).
CREATE UNIQUE INDEX messages_by_id ON messages (scope_id, id_hash) WHERE state IN (0, 2, 3);
-- Claims and the backlog scan the open (pending or failed) rows in arrival order. The indexes are partial, so
-- processed rows, the bulk of the table, cost nothing here; an index over every state would be rewritten at
-- each claim and each completion.
CREATE INDEX messages_open ON messages (scope_id, seq) WHERE state IN (0, 2);
CREATE INDEX messages_dead ON messages (scope_id, seq) WHERE state = 3;
-- Per-key ordering: "is an earlier message with this key still open?"
CREATE INDEX messages_open_by_key ON messages (scope_id, order_key, seq) WHERE state IN (0, 2) AND order_key IS NOT NULL;

-- Consumer outbox: messages a handler asked to publish, written in the same commit as its effect and the
-- identity of the delivery that caused them. A relay publishes pending rows in seq order and marks a row sent
-- only after the broker's PUBACK for it; a crash in between resends it, with the same (producer, message_id),
-- which the next consumer deduplicates on.
-- state: 0 pending, 1 sent (PUBACK received, or written to the connection for QoS0), 2 parked (the broker
-- refused it too many times; kept for an operator, no longer holding back the rows after it).
-- message_id is derived from the causing delivery's identity and the message's index within the handler call
-- (see src/outbox.rs), so a retried handler writes the same ids. properties: CBOR (NULL when empty).
-- attempts counts publishes the broker refused (a PUBACK with a failure reason code, or a connection it
-- closed right after the row was written alone).
-- created_at and sent_at are Unix seconds. Sent rows are deleted by a prune pass (Pruning::sent_outbox) or
-- Inbox::prune_outbox.
CREATE TABLE outbox (
    -- AUTOINCREMENT: a pruned row's seq is never handed out again, so a relay reading past its cursor cannot
    -- miss a new row, nor mark another row than the one the broker acknowledged.
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    scope_id   INTEGER NOT NULL,
    producer   TEXT    NOT NULL,
    message_id TEXT    NOT NULL,
    topic      TEXT    NOT NULL,
    payload    BLOB    NOT NULL,
    qos        INTEGER NOT NULL CHECK (qos IN (0, 1)),
    properties BLOB,
    state      INTEGER NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2)),
    attempts   INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    sent_at    INTEGER,
    UNIQUE (producer, message_id)
);
-- The relay reads pending rows in seq order; pruning finds sent rows by age. Partial: each row is in one.
CREATE INDEX outbox_pending ON outbox (seq) WHERE state = 0;
CREATE INDEX outbox_sent ON outbox (sent_at) WHERE state = 1;

-- Per-producer sequence watermarks (opt-in per scope, see retention.watermarks): every sequence <= high is
-- processed; exceptions holds the processed sequences above high + 1 that arrived out of order. Contiguous
-- processed ranges collapse into high, so an in-order producer costs one row whatever its volume.
CREATE TABLE watermarks (
    scope_id INTEGER NOT NULL,
    producer TEXT    NOT NULL,
    high     INTEGER NOT NULL,
    PRIMARY KEY (scope_id, producer)
) WITHOUT ROWID;
CREATE TABLE watermark_exceptions (
    scope_id INTEGER NOT NULL,
    producer TEXT    NOT NULL,
    sequence INTEGER NOT NULL,
    PRIMARY KEY (scope_id, producer, sequence)
) WITHOUT ROWID;
-- The identity of the most recent claimed sequences of each producer (a bounded window, see
-- src/retention/watermark.rs): a sequence that comes again is compared with the message that claimed it, so a
-- producer whose counter restarted is detected instead of being taken for a duplicate; and a message id that
-- comes again under another sequence is found by the UNIQUE index on (scope, id_hash) (id_hash covers the
-- producer; without its name the index stays small), which also arbitrates that one id claims at most one row
-- (a repeat under a new sequence claims that sequence in the watermark, without a row of its own).
CREATE TABLE watermark_recent (
    scope_id    INTEGER NOT NULL,
    producer    TEXT    NOT NULL,
    sequence    INTEGER NOT NULL,
    id_hash     BLOB    NOT NULL,
    fingerprint INTEGER NOT NULL,
    PRIMARY KEY (scope_id, producer, sequence)
) WITHOUT ROWID;
CREATE UNIQUE INDEX watermark_recent_by_id ON watermark_recent (scope_id, id_hash);

-- Retention policy and bookkeeping per scope. Durable, so every connection and process sharing the file applies
-- the same rules. Ages are seconds; NULL keeps forever. watermarks is fixed before the scope's first delivery.
-- expired: what to do with a delivery sent before pruned_before whose identity is not found
-- (0 process, 1 reject, 2 quarantine). pruned_before: every identity pruned so far was committed before this
-- time (Unix seconds); NULL while no identity of the scope was ever pruned. record_age: quarantine and conflict
-- rows whose last arrival is older than this are deleted (NULL keeps them).
CREATE TABLE retention (
    scope_id              INTEGER PRIMARY KEY,
    processed_payload_age INTEGER,
    dead_letter_age       INTEGER,
    identity_horizon      INTEGER,
    expired               INTEGER NOT NULL DEFAULT 0 CHECK (expired IN (0, 1, 2)),
    clock_skew            INTEGER NOT NULL DEFAULT 0,
    watermarks            INTEGER NOT NULL DEFAULT 0 CHECK (watermarks IN (0, 1)),
    first_sequence        INTEGER NOT NULL DEFAULT 1,
    pruned_before         INTEGER,
    record_age            INTEGER
);
