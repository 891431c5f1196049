// Source layout, lowest layer first; a file imports only from its own layer or below, and no files import each
// other in a circle (`.ci/check-layers` checks both). `store/` is the storage layer: the connection and its hot
// statements, schema and migrations, the transaction primitives and clock (`txn.rs`), errors, config, identity,
// outcome, quarantine and conflict records and the handler's `Tx`; it imports nothing above it.
// `retention/mod.rs` and `retention/watermark.rs` hold the rules the identity claim applies. `inbox.rs` is the
// strong case, where a delivery's path reads top-down: identity claim, transaction, handler, commit. The features
// add `impl Inbox` blocks on top of it: `deferred/` (receive, workers, backlog, dead letters, requeue),
// `outbox.rs`, `retention/prune.rs` (policies, watermarks, pruning), `retention/records.rs` (pruning quarantine
// and conflict records), `kv.rs` (the key-value state read outside a handler). Highest are `mqtt/` (the
// connection-agnostic consumer core, the ack gate, the commit loop and its feed, health events and live
// statistics, the crate's own connection and consumer, in-order acks, relay; identity extraction is plain data
// and built without the `mqtt` feature), where the ack follows the commit, and `inspect/` with the durable
// counters. The `pub use` list below is the whole public surface; the folders stay private.

//! # edge-inbox
//!
//! An embedded, SQLite-backed inbox that lets an IoT gateway consume MQTT QoS1 deliveries
//! **exactly-once in effect**.
//!
//! QoS1 is at-least-once: a consumer can commit its local change and crash before its PUBACK reaches the
//! broker, and the broker then delivers the same message again. Marking a message "seen" before applying it
//! risks losing the effect; marking it afterwards risks applying it twice. The inbox makes both facts one:
//!
//! ```text
//! BEGIN IMMEDIATE
//!   INSERT identity (scope, producer, message id, fingerprint)   -- the PRIMARY KEY arbitrates
//!   handler(tx)                                                   -- your local state change
//! COMMIT                                                          -- synchronous=FULL: durable
//! PUBACK                                                          -- only now, in arrival order
//! ```
//!
//! ## The guarantee
//!
//! While an identity is retained, a repetition of that delivery does not commit the protected local effect
//! again. The identity row and the handler's writes commit or abort together in one SQLite transaction;
//! uniqueness is decided by the store's primary key inside `BEGIN IMMEDIATE`, never by a query followed by
//! an insert, so two threads or processes racing on the same delivery produce exactly one effect. A storage
//! error, a busy database or a `COMMIT` whose outcome is unknown is always an [`Error`], never a
//! [`Outcome::Duplicate`], and must not be acknowledged.
//!
//! It does **not** promise ordering or exactly-once *delivery*, and it does not cover effects outside the
//! database (an HTTP call, an e-mail, another store): those need their own idempotency (see
//! [the consumer outbox](#consumer-outbox-publishing-from-a-handler) for messages to the broker, and the
//! intent pattern after it for everything else).
//!
//! ## Quick start
//!
//! ```
//! use edge_inbox::{Config, Delivery, Inbox, Outcome};
//!
//! # fn main() -> anyhow::Result<()> {
//! let dir = tempfile::tempdir()?;
//! let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default())?;
//!
//! let payload = br#"{"order":42,"sku":"A-1","qty":1,"kind":"created"}"#;
//! let delivery = Delivery::in_scope("inventory-reservation")
//!     .with_message_id("evt-42-created")
//!     .with_topic("orders/42")
//!     .with_payload(payload);
//!
//! let reserve = |tx: &mut edge_inbox::Tx<'_>, _d: &Delivery<'_>| -> anyhow::Result<()> {
//!     let reserved: i64 = tx.get("A-1")?.unwrap_or(0);
//!     tx.put("A-1", &(reserved + 1))?;
//!     Ok(())
//! };
//! assert!(matches!(inbox.process(&delivery, reserve)?, Outcome::Processed));
//! // The broker redelivers (our PUBACK was lost): recognised, not applied again.
//! assert!(matches!(inbox.process(&delivery, reserve)?, Outcome::Duplicate));
//! # Ok(()) }
//! ```
//!
//! ## Outcomes and what to tell the broker
//!
//! | result | meaning | ack? |
//! |---|---|---|
//! | `Ok(Outcome::Processed)` | new identity; effect committed | yes |
//! | `Ok(Outcome::Duplicate)` | identity already committed with the same content; nothing ran | yes |
//! | `Ok(Outcome::Conflict {..})` | same identity, *different* content: recorded in `conflicts`, not applied | yes |
//! | `Ok(Outcome::HandlerFailed(e))` | your handler refused; effect and identity rolled back | by your policy |
//! | `Err(Error::Busy / DiskFull / ReadOnly)`, or `Storage` that [`Error::is_retryable`] (I/O, out of memory, cannot open, interrupted) | nothing written | no; retry |
//! | `Err(Error::Storage)` otherwise (corruption, a statement error) | nothing written | no; retrying fails the same way: dead-letter it, then ack (the consumer core does) |
//! | `Err(Error::CommitUnknown)` | COMMIT failed: may or may not be durable | no; the redelivery settles it |
//! | `Err(Error::InvalidDelivery)` | bad input; nothing written | quarantine, then ack |
//! | `Err(Error::DatabaseGone)` | the database file was deleted under the inbox; nothing durable | no; reopen |
//!
//! Errors are classified by SQLite extended result codes ([`Error::sqlite_code`]), never by message text.
//!
//! Quarantine and conflict records are bounded and kept once per distinct delivery. A quarantine record holds the
//! topic, the reason, the first [`QUARANTINE_PREFIX`] (256) bytes of the payload, its length and its xxh3-128,
//! never the whole payload. The same delivery arriving again (a lost PUBACK, a reconnect) adds an arrival
//! (`arrivals`, `last_at`) to its record instead of a new one: for a delivery without an identity the record is
//! that of (scope, topic, payload), for one with an identity that of (scope, identity, topic, payload), and a
//! conflict record that of (scope, identity, received content). The counters `quarantined` and `conflicts` count
//! arrivals, `quarantine_records` and `conflict_records` the records made ([`ScopeStats`]).
//!
//! ## Identity
//!
//! A [`Delivery`] is identified by *(scope, producer, message id)*:
//!
//! - the **scope** is the logical consumer function (`inventory-reservation`), shared by every instance of
//!   that consumer and never a host name. Two different consumers may each process the same event. A rebuilt
//!   projection uses a new, versioned scope (`inventory-reservation@2`), never a wipe of the old identities;
//! - the optional **producer** namespace is for ids that are only unique per producer;
//! - the **message id** comes from the application, never from the MQTT packet id (which the broker reuses).
//!
//! The identity is stored as a 16-byte xxh3-128 hash ([`IdHash`]; after an order prefix in a file created
//! with one, below), and beside it a 64-bit
//! [`Fingerprint`] of (topic, payload) that tells a redelivery from a conflicting reuse of the id.
//! The hash is keyed per database ([`IdKey`]): a random secret created with the schema from the operating
//! system's random source and stored in the file, so a producer that chooses its ids cannot craft a collision
//! with another message's identity. Compute a stored hash with [`Inbox::id_hash`]; a file migrated from schema
//! version 1 keeps the unkeyed hash of that version ([`IdKey::UNKEYED`], `inboxctl check` shows `identity key
//! none`), so its identity rows stay valid.
//!
//! A random hash puts each new identity on a random leaf of the identity index: on a file with a million
//! identities every delivery of a commit changes a leaf of its own, which the WAL and then the checkpoint
//! write whole. When ids grow with time, [`Config::id_order`] chosen for a new file puts an order prefix
//! ahead of the hash ([`IdOrder::Counter`] for a decimal counter at the end of the id, [`IdOrder::Leading`]
//! for ids that begin with a time, such as UUIDv7), so that a commit's identities share the last leaves of
//! their range. The full keyed hash still follows, so identities are told apart exactly as well. The layout
//! is stored in the file and kept for its life (`inboxctl check` shows `order`); the prefix costs its bytes
//! in every identity row (12 for a counter), and it keeps that part of the id, or its number, in the file.
//! A file of another layout than [`IdOrder::Hashed`] cannot be taken back to a build of schema version 5
//! ([`downgrade_schema`], for a firmware rollback), which would search for its identities without the prefix.
//!
//! ```
//! use edge_inbox::{Config, IdOrder, Inbox};
//! # let dir = tempfile::tempdir()?;
//! // Ids such as `gw-7/evt-000123`: each producer's counter in a range of its own. For text UUIDv7 ids,
//! // `IdOrder::Leading(13)`: their 48 bits of milliseconds.
//! let inbox = Inbox::open(dir.path().join("inbox.db"), Config::default().id_order(IdOrder::Counter))?;
//! assert_eq!(inbox.id_key().order(), IdOrder::Counter);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`UserProperty`] reads the message id from `message-id`, the producer from `producer` and the send time
//! ([`Delivery::sent_at`]) from `sent-at` ([`SENT_AT`]): Unix seconds in decimal or an RFC 3339 time; any
//! other value is bad input and quarantined.
//!
//! ## Handlers and state
//!
//! A handler is any `FnMut(&mut Tx, &Delivery) -> anyhow::Result<()>`. Through [`Tx`] it reads and writes
//! the built-in key-value state (serde values stored as CBOR, namespaced by scope or by your own namespace)
//! or, with [`Tx::sql`], its own tables in the same transaction. [`rusqlite`] is re-exported so the versions
//! match. Outside a handler (a status page, a report), [`Inbox::get`] and [`Inbox::entries`] read and decode
//! that state in the same namespaces.
//!
//! **Nothing a handler writes commits without its identity**, even when it swallows an error. SQLite may roll
//! the transaction back by itself (an I/O error, NOMEM, an interrupt, a trigger's `RAISE(ROLLBACK)`,
//! `INSERT OR ROLLBACK`); a statement run after that would be in autocommit and commit on its own. So while a
//! handler runs, the connection's commit hook refuses every commit (SQLite turns it into a rollback, and the
//! statement fails with `SQLITE_CONSTRAINT_COMMITHOOK`): only the inbox's own `COMMIT`, after the handler
//! returned, can commit. A commit hook, not a check of `is_autocommit` around each call, because such a
//! check comes after the statement has already committed. Once the transaction is gone every further call
//! through [`Tx`] fails at once, and the call (process, batch) fails with
//! [`Error::HandlerEndedTransaction`]: nothing committed, nothing to ack. The same holds for [`Tx::publish`].
//! The deferred [`Worker`] commits nothing of it either, and counts the message whose handler ended the
//! transaction a failed attempt (dead-lettered at the last). Outside the transaction, `PRAGMA synchronous` and `PRAGMA journal_mode` would
//! take effect for every later commit; after such a call the next transaction sets both again and reads them
//! back before it begins.
//!
//! **Only the inbox's own database is atomic with the identity.** A handler may `ATTACH` another file
//! through [`Tx::sql`], but in WAL mode SQLite commits a transaction across attached databases atomically
//! for each file, not as a whole: a power cut between the two can keep the identity without the effect in
//! the other file, and the redelivery is then a duplicate. Keep what must not be lost in the inbox's file. An
//! attached file's trouble is the connection's trouble: an `ATTACH` that cannot open its file
//! (`SQLITE_CANTOPEN`; the inbox's connection does not create files) or a read of it that fails leaves the
//! same result code as the inbox's own storage would, so the call fails as retryable storage trouble (and
//! the consumer retries it) instead of a handler failure. Read a lookup file that may be missing or damaged
//! through a connection of the handler's own.
//!
//! **The connection's commit and rollback hooks are reserved for this guard.** rusqlite lets anyone holding
//! the [`Connection`](rusqlite::Connection) ([`Inbox::connection`], [`Tx::sql`]) replace them, so the inbox
//! installs its own again before every handler runs (an application's hook installed between calls never
//! fires) and checks them when the handler returns: a handler that replaced them fails its call with
//! [`Error::HandlerEndedTransaction`] and an error in the log, but whatever such a handler committed on its own
//! in the meantime cannot be undone. To act on a commit, act on the `Ok` the call returns (it comes only once
//! the commit is durable); to notice commits by other connections, poll `PRAGMA data_version`.
//!
//! **Whose storage error it is.** Storage trouble of the inbox's own database fails the call as an [`Error`]
//! (nothing committed, nothing acked), however the handler met it: through [`Tx`] (remembered even if the
//! handler swallowed it) or through a statement on [`Tx::sql`] (the connection's own last result code,
//! read right after the handler returns, says so; an error value alone cannot tell which connection it came
//! from). Anything else a handler returns is a handler failure, a storage error of another SQLite database the
//! handler opened itself (on a connection of its own, not attached) included: a lookup file it cannot open
//! (`SQLITE_CANTOPEN`) or read (`SQLITE_IOERR`) gives [`Outcome::HandlerFailed`], and the consumer's or
//! [`Worker`]'s attempts and dead letter follow, instead of a retry for ever that holds back every delivery
//! behind it. An interrupt the handler causes (its own
//! `sqlite3_interrupt`, a progress handler that returns true) is its own too: an interrupted read is a
//! handler failure when the handler returns the error (through [`Tx`]'s own reads, whatever it returns), and
//! an interrupted write, which makes SQLite roll the whole transaction back, is
//! [`Error::HandlerEndedTransaction`]. Both cost the delivery an attempt (the
//! [`Consumer`] dead-letters a delivery whose handler ends the transaction; the [`Worker`] counts an attempt
//! and dead-letters at the last), so a handler that always interrupts itself cannot stall the stream. Remove
//! a progress handler before returning: left installed, it interrupts the inbox's own statements, which is
//! storage trouble.
//!
//! ## Group commit
//!
//! Each commit with `synchronous=FULL` costs at least one fsync, which bounds a consumer at the device's
//! fsync rate. [`Inbox::process_batch`] puts many deliveries in one transaction, each in its own savepoint
//! (a failing handler undoes only its own delivery), and returns outcomes in input order: one fsync per batch.
//! A batch of one (and [`Inbox::process`]) runs without a savepoint: a failing handler rolls the whole
//! transaction back.
//!
//! On storage whose syncs take milliseconds (SD cards, eMMC), a consumer that takes turns with the disk
//! (commit, sync, commit, sync) leaves the CPU idle during every sync. The commit loop of the
//! [`Consumer`] and of [`ConsumerCore::spawn`] overlaps them instead ([`SyncOverlap`], automatic by
//! default: while the commits that sync themselves take 1 ms or more): a batch commits without a sync of
//! its own, a thread of the inbox syncs the WAL through a second connection meanwhile, and the batch's
//! PUBACKs leave only once a sync that *began after its commit returned* has succeeded. The promise is
//! unchanged (`tests/power_loss.rs` cuts the power before every sync of that thread too); a failed sync
//! is never retried, and nothing committed since the last good one is acked until the WAL has been written
//! out again in full and synced (`tests/wal_sync_failure.rs`).
//!
//! The per-scope counters ([`Inbox::scope_stats`]) are exact and durable without a page of their own in the
//! common case: a delivery processed through a new identity row writes no counter, because `processed` is
//! derived from the scope's identity rows (kept in step by every other path that adds or prunes identity
//! rows, in the same transaction). Reading it counts those rows, which is cheap for an operator's poll and
//! not meant for every delivery.
//!
//! ## Durability
//!
//! The database runs in WAL mode with `synchronous=FULL` by default: when `process` returns `Ok`, the
//! outcome survives a process crash and a power loss (given storage that honours fsync). With
//! [`Synchronous::Normal`] a commit survives a process crash but **a power loss can lose acknowledged
//! deliveries**; opt in only where that is acceptable. Every setting is read back after it is applied.
//!
//! Both claims are tested by simulating the power cut, not a process kill (whose page cache survives):
//! `tests/power_loss.rs` runs every write path (single and group commits, the consumer core's commits
//! overlapping their syncs, outbox, deferred receive and worker, sequence watermarks, retention passes with
//! incremental vacuum and checkpoints) through a VFS that
//! keeps, per file, what the last sync made durable, and cuts before every sync and during every prune step,
//! vacuum and checkpoint, keeping none, all or a random subset of the unsynced sectors. With `FULL` no cut
//! loses an acknowledged delivery or applies one twice, and the reopened file passes `integrity_check` with
//! counters, watermarks and outbox consistent; with `NORMAL` most cuts lose the deliveries acknowledged since
//! the WAL's last sync (a checkpoint's), and only those.
//!
//! All of it assumes an SQLite with the fix for the WAL-reset race (3.51.3 or later, or the 3.50.7 and
//! 3.44.6 patch releases; <https://sqlite.org/wal.html#walresetbug>): a checkpoint that begins while
//! another connection starts the WAL over could make a later checkpoint skip frames, corrupting the
//! database or losing committed transactions. The `bundled` feature compiles a fixed one; with a system
//! library, an affected version is logged as a warning at the process's first open of an inbox (install
//! the logger before it).
//!
//! ## Flash wear
//!
//! [`Inbox::bytes_written`] tells the bytes the inbox wrote over the file's life ([`BytesWritten`]: WAL
//! frames, and what its checkpoints wrote into the database file), counted at no cost per commit through
//! SQLite's WAL hook; installing that hook replaces SQLite's automatic checkpoint, so the inbox runs it
//! itself at [`Config::wal_autocheckpoint`]: by default on a thread of its own with a connection of its own
//! ([`Config::checkpoint_thread`]), so that the commit which fills the WAL does not also copy it back and
//! sync twice before it returns (40-60 ms on a card whose sync takes 5 ms, paid by every delivery waiting
//! behind that commit). The thread sleeps until a commit asks, is stopped when the inbox is dropped, and
//! writes the copied pages out to the device in paced steps before it syncs the database file (on Linux). It
//! copies what came during its copies once no commit has come for 50 ms, so that the WAL starts over; a
//! writer that never pauses that long waits for it instead, once per threshold of WAL (its next write
//! transaction waits while the thread copies those frames, with two syncs). Every copy begins with a sync of
//! the WAL, at any `synchronous` level, so that no page reaches the database file before its frame is on the
//! disk. A handler that sets `PRAGMA wal_autocheckpoint` or its own WAL hook on the connection replaces the
//! inbox's and stops the counting. The counts are saved in the file after each checkpoint and at close
//! (`inboxctl stats` reads them), so they lag by up to about two WALs' worth (the frames of one WAL and the
//! checkpoint's copy of the one before); the eMMC's own wear figures come from
//! [`inspect::device_wear`]. [`Config::page_size`] sets the page size of a new file.
//!
//! ## Resolving an unknown commit
//!
//! When `COMMIT` fails with an I/O error the transaction may or may not be on disk
//! ([`Error::CommitUnknown`]). Do not ack. The broker redelivers, and the identity insert then either
//! succeeds (it was not committed) or reports a duplicate (it was). [`Inbox::status`] answers the same
//! question directly, except in a scope with sequence watermarks, whose numbered deliveries keep no identity
//! row: there the redelivery settles it. Other `COMMIT` failures are classified by their extended result code:
//! a busy database or a full disk leave nothing committed, and a deferred constraint of your own tables that
//! refuses the commit ([`Error::CommitRefused`]) makes that delivery a [`Outcome::HandlerFailed`] (a batch is
//! retried one delivery per transaction to find it).
//!
//! A failed sync of the WAL costs more than its own commit. Linux reports a failed write-back once per file
//! descriptor and marks the pages clean, so the next sync succeeds although frames committed before the
//! failure without a sync of their own (another connection's `NORMAL` commits, a prune step) may never reach
//! the disk, and WAL recovery after a power cut stops at the first such frame, taking every later commit with
//! it. So after an I/O error in a `COMMIT`, in a checkpoint on the inbox's connection or in a
//! [`Pruning::sync_after_steps`] sync, the connection commits nothing more until it has written the whole WAL
//! out again (the same bytes, from the page cache where the failed write-back left them) and synced it, and
//! neither it nor its checkpoint thread runs a checkpoint meanwhile (copying the frames after the gap into the
//! database file would leave it torn at a power cut). The next transaction does that first, under the write
//! lock; while it fails (the disk still failing), the call fails with a retryable error and nothing is acked
//! (`tests/wal_sync_failure.rs` cuts the power after such a failure). A commit during which the checkpoint
//! thread's sync failed is [`Error::CommitUnknown`]: that sync may have taken the report meant for the
//! commit's own. An inbox dropped in that state writes the WAL out again before SQLite's final checkpoint at
//! close, or closes without that checkpoint if it cannot. Not covered: pages the kernel evicted before that
//! (beyond repair, as they would be anyway); other connections to the file (another `Inbox` on it, other
//! processes), whose own descriptors report the error at their next sync; and a file opened again after a
//! close that could not write the WAL out, while the disk still lacks those frames (the flag is in memory).
//!
//! A failed sync of the database file, after the checkpoint thread copied pages into it, leaves those pages
//! on the disk only in the WAL, which may then never start over: the thread keeps it, commits go on
//! (durable in the WAL) until it holds four checkpoint thresholds, and from then on each is refused as
//! retryable storage trouble, nothing acked, until the inbox is opened again once every connection to the
//! file is closed (the relay's and a worker's inboxes too: a connection left open keeps SQLite's record
//! that those pages were copied, and a checkpoint after the reopening would then start the WAL over without
//! them); that open copies the WAL back with working syncs (`tests/checkpoint_rounds.rs`). So the WAL does
//! not fill the disk, and a consumer whose storage retries run out ends its run with the error, for the
//! application to close the file's inboxes and open them again.
//!
//! ## Received-then-deferred mode
//!
//! When the effect is slow, or must wait for something, store first and apply later:
//! [`Inbox::receive`] inserts the identity and a *pending* `messages` row with the payload in one durable
//! transaction and returns [`Outcome::Received`]. Only then ack: the obligation has moved from the broker to
//! the local store. A redelivery is a [`Outcome::Duplicate`] (ack it), the same id with other content a
//! [`Outcome::Conflict`]. [`Inbox::receive_batch_into`] stores many in one commit. Over MQTT,
//! `Consumer::receive_only` does exactly that for every batch, acks after the commit, and logs a warning
//! when the scope's backlog grows past a threshold.
//!
//! A [`Worker`] (plain synchronous code: one per thread or per process, any number on one file) drains a scope:
//!
//! 1. **claim**: one `UPDATE ... RETURNING` under `BEGIN IMMEDIATE` leases up to
//!    [`WorkerConfig::batch`] open messages to the worker until `now + lease`, with a fresh claim token. The
//!    claim commits without its own fsync: losing it to a power cut only makes the messages claimable again;
//! 2. **apply**: one strong-case transaction for the batch; per message, a savepoint that marks it processed
//!    *only if* it is still leased to this claim and the lease has not expired, then runs your [`Handler`] on
//!    the stored [`Delivery`]. Effect and state change commit together; a worker whose lease was lost or taken
//!    over commits nothing for that message ([`Completion::LeaseLost`]);
//! 3. **fail**: a handler error rolls back its effect and schedules a retry with exponential backoff
//!    ([`WorkerConfig::backoff`]); after [`WorkerConfig::max_attempts`] failures the message is dead-lettered
//!    with the last error text. [`Inbox::requeue_dead_letters`] / [`Inbox::requeue_dead_letter`] put dead
//!    letters back to work. Storage errors are not handler failures and consume no attempt.
//!
//! **Sharing the write lock.** The apply transaction holds SQLite's write lock while the handlers run, and a
//! consumer receiving on the same file waits for it up to its busy timeout. [`Worker::run_once`] therefore
//! stops taking further claims into a transaction once [`WorkerConfig::lock_budget`] (default 100 ms) is used
//! up (at least one handler runs per transaction), commits, and applies the rest of its claims in further
//! transactions; after such a transaction it leaves the lock free for 120 ms, so a waiting receiver gets
//! its turn and keeps acking however slow the handlers are. An inbox connection waiting for the lock tries
//! again at least every millisecond; the longer gap also serves writers that wait through SQLite's own busy
//! timeout, which sleeps up to 100 ms between tries. ([`Worker::complete`] applies exactly the claims it is
//! given in one transaction.)
//!
//! A worker killed at any point leaves either nothing (the apply transaction did not commit) or a lease that
//! expires and is claimed again: every pending message is applied exactly once in effect.
//!
//! The states are distinct and durable: `pending` (0), `processed` (1), `failed` awaiting a retry (2),
//! `dead-lettered` (3) ([`MessageState`], also reported by [`Inbox::status`]).
//!
//! **Ordering.** By default messages are unordered: workers take the oldest claimable ones, and with several
//! workers or retries a later message may be applied before an earlier one. [`Inbox::receive_ordered`] gives a
//! message an *order key* (the topic, an order id, ...): a message is not claimed while an earlier message with
//! the same key is pending or failed, so each key is applied strictly in arrival order, one at a time, while
//! different keys proceed in parallel. A dead-lettered message stops blocking its key (the next one proceeds);
//! requeued, it runs again before later open messages of its key.
//!
//! **Backlog.** [`Inbox::backlog`] returns pending count, age of the oldest unprocessed message, in-flight
//! leases, failures awaiting retry and dead letters in one call; [`Inbox::warn_if_backlogged`] logs a warning
//! beyond a [`BacklogThreshold`].
//!
//! **Retention.** An acknowledged message that is not processed yet is an obligation: it is never deleted or
//! forgotten: pruning never touches `messages` rows in states pending (0) and failed (2), nor their
//! identities. Processed rows (1) are pruned after their configured age; dead letters (3) are kept for an
//! operator unless a separate, explicit dead-letter age is configured ([`RetentionPolicy`]). The identity
//! row stays either way.
//!
//! **Leases and clocks.** Leases and backoff use the wall clock in milliseconds. All workers on one file share
//! that clock; a clock step forward expires leases early (work may be redone and refused at commit, never
//! applied twice), a step backward delays reclaiming a dead worker's messages. Pick a lease comfortably longer
//! than one batch takes. A message whose handler kills the process is claimed again after each lease expiry
//! without consuming attempts (attempts count handler errors only); the `claims` column shows such loops.
//!
//! ## The MQTT adapter (feature `mqtt`, on by default)
//!
//! [`Consumer`] wraps MQTT QoS1 deliveries from [rumqttc](https://docs.rs/rumqttc) around the inbox, so a
//! gateway developer writes only the handler:
//!
//! ```no_run
//! # #[cfg(feature = "mqtt")]
//! use edge_inbox::{Config, Consumer, Delivery, Inbox, MqttConfig, Tx};
//!
//! # #[cfg(feature = "mqtt")]
//! fn reserve(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
//!     let event: serde_json::Value = serde_json::from_slice(d.payload)?;
//!     let key = format!("reserved/{}", event["sku"].as_str().unwrap_or_default());
//!     let reserved: i64 = tx.get(&key)?.unwrap_or(0);
//!     tx.put(&key, &(reserved + event["qty"].as_i64().unwrap_or(0)))?;
//!     Ok(())
//! }
//!
//! # #[cfg(not(feature = "mqtt"))] fn main() {}
//! # #[cfg(feature = "mqtt")]
//! # fn main() -> anyhow::Result<()> {
//! let inbox = Inbox::open("/var/lib/gateway/inbox.db", Config::default())?;
//! let mqtt = MqttConfig::new("broker.local", 1883, "inventory-gw7").subscribe("orders/#");
//! let mut consumer = Consumer::new(inbox, "inventory-reservation", mqtt);
//! let stop = consumer.stop_handle(); // stop.stop() from another thread or a signal flag
//! consumer.run(reserve)?;
//! # Ok(()) }
//! ```
//!
//! What it does for you:
//!
//! - **Session.** Manual acks, a stable client id and a persistent session (MQTT 5 `clean_start=false`
//!   with a session expiry, or 3.1.1 `clean_session=false`), subscriptions at QoS1, made again at every
//!   connect (so a filter added to the configuration is subscribed even on a kept session). The broker
//!   keeps what we have not acked while we are away and sends it again.
//! - **Identity** from the application, never the packet id: the MQTT 5 user property `message-id` (and
//!   `producer`), a CBOR [`Envelope`] in the payload for 3.1.1, the topic's property bag ([`PropertyBag`]:
//!   Azure IoT Hub's `$.mid`), or your own [`ExtractIdentity`]. A delivery
//!   without an identity, with a malformed envelope or over the inbox [`Limits`] is logged, recorded with
//!   [`Inbox::quarantine`] (topic, payload, reason) and then acked: kept, not lost, and not blocking the
//!   stream. One whose identity is known but breaks a limit goes through [`Inbox::quarantine_delivery`],
//!   which in a watermark scope also claims its sequence (no permanent gap behind one bad message).
//! - **Group commit, adaptive.** A delivery reaching an idle consumer is committed at once, alone; whatever
//!   arrives while a commit syncs (the poll thread keeps reading) forms the next batch, committed in one
//!   [`Inbox::process_batch_into`], so batches grow with the load and the commit time and no delivery waits
//!   on a timer (an optional linger, [`Consumer::batch`], waits for more). By default a batch has no count
//!   limit: it is bounded by the memory budget ([`Consumer::memory_budget`], default 2 MiB of deliveries
//!   held between the socket and their commit) and never exceeds the broker's inflight window
//!   ([`MqttConfig::inflight`]: our Receive Maximum for MQTT 5, which by default follows the budget, 8192;
//!   mosquitto's `max_inflight_messages` for 3.1.1), or the consumer would wait for deliveries the broker
//!   withholds until it acks.
//! - **Memory**: while the deliveries received and not yet committed hold more than the budget, the poll
//!   thread stops reading the socket and TCP pushes back on the broker, which keeps the rest in its session
//!   (mosquitto 2.0.11 does not keep to our Receive Maximum, so the window alone would not bound it). The
//!   two threads never wait on each other: while rumqttc's request channel (1024 requests) is full of
//!   PUBACKs, the commit thread keeps the next acks (as runs of consecutive packet ids) and goes on
//!   committing, which makes room in the budget for the poll thread, the one that drains the channel.
//!   [`RunSummary::peak_held_bytes`] tells the most held at once.
//! - **Acks** only after the commit that covers the delivery returned `Ok` (processed, duplicate, conflict,
//!   quarantined or dead-lettered), strictly in arrival order (MQTT-4.6.0-2). A reconnect drops whatever
//!   was received on the old connection unacked (also what the MQTT library had buffered from it); the
//!   broker redelivers it and the inbox recognises what was already committed. An ack is never sent for a
//!   delivery of an earlier connection: the check and the queueing of each PUBACK are one step against the
//!   connection change, which purges the PUBACKs not yet written.
//! - **Storage errors** (and an unknown commit outcome) ack nothing: they are logged with the SQLite code
//!   and, when [`Error::is_retryable`] (busy, I/O, full disk, read-only, unknown commit outcome), the same
//!   batch is retried with backoff until it commits, the connection ends or a stop is asked. An error that
//!   would repeat (corruption, a handler that ended the transaction, a statement error) is not retried: the
//!   batch's deliveries are committed one at a time, and the one that fails for good is dead-lettered with
//!   the error as its reason, then acked, so the stream moves on. Nothing is acked without that durable
//!   record: if even the dead letter cannot be written, it is retried with backoff instead. A retryable error
//!   that persists is bounded: after [`Consumer::storage_retry_limit`] (default 60 s) of failures on one
//!   operation, `run` returns that error (nothing of the batch acked; logged at ERROR with its SQLite code),
//!   so a supervisor sees a failed process and restarts it, and the broker redelivers.
//! - **Handler failures** are retried ([`Consumer::handler_attempts`]), then the delivery is dead-lettered
//!   ([`Inbox::dead_letter_after`]: body kept with its reason; a redelivery is a duplicate; an operator can
//!   requeue it) and acked.
//!   [`RunSummary::handler_failures`] counts deliveries that failed at least once,
//!   [`RunSummary::failed_attempts`] the attempts (the durable [`ScopeStats::handler_failures`] counts
//!   attempts too).
//! - **Size.** [`MqttConfig::max_packet_size`] (default [`DEFAULT_MAX_PACKET`], 1 MiB + 64 KiB) bounds what
//!   is read from the socket: a delivery over the inbox [`Limits`] but within it is quarantined; a larger
//!   one is never read (MQTT 5: the broker drops it, as the CONNECT announced; 3.1.1: rumqttc drops the
//!   connection at its header, so set the broker's own limit, mosquitto `message_size_limit`).
//! - **Failing fast.** On the first connection of a run, what retrying cannot heal ends `run` with
//!   [`Error::Connection`] naming the cause: the broker refusing the login or the client id (CONNACK
//!   not authorized, bad user name or password, client id not valid, banned), TLS material that does not
//!   parse, a certificate either side rejects (with TLS 1.3 a broker rejects a client certificate by an
//!   alert after the handshake: unknown CA, certificate expired), and a SUBACK that refuses a filter or
//!   grants it only at QoS0 before the run was ever granted its subscription (deliveries at QoS0 are never
//!   acked nor redelivered). A topic filter that is not valid MQTT is refused before connecting
//!   ([`Error::InvalidArgument`]). Once a connection has succeeded, every failure is retried with backoff
//!   (a refused subscription after a grant too: the consumer connects again). An idle-bounded run
//!   ([`Consumer::exit_when_idle`]) that never connected is an error too.
//! - **Subscribed.** [`ConsumerStats::subscribed`] (and [`HealthEvent::Subscribed`]) says when the broker
//!   has acknowledged the subscriptions of the current connection: a message published before that may
//!   match no subscription and be dropped by the broker. A service reports itself ready from then on.
//! - **Stored deliveries.** A plain run on a file holding pending deliveries of a receive-only run logs
//!   at start how many wait and that a [`Worker`] on the scope applies them (the plain run does not).
//! - **Threads.** A poll thread owns the connection and only moves packets over a bounded channel (a
//!   [`Feed`]); it never touches SQLite and never waits on an ack. The thread in [`Consumer::run`] owns the
//!   inbox and the [`ConsumerCore`]; see [below](#the-core-and-the-connection-it-does-not-own).
//! - **Graceful stop.** A [`StopHandle`] (from the handler, another thread or a signal) finishes the batch
//!   in flight: it commits it, queues every PUBACK of it, then a DISCONNECT behind them, and returns once
//!   the broker has closed the connection (bounded at about 10 s), so a new run gets no redelivery of what
//!   was committed. Deliveries received but not yet in the batch are left unacked for the broker to
//!   redeliver; storage trouble at stop time acks nothing.
//! - **TLS** through rustls ([`TlsConfig`]: CA files or the system's roots, a client certificate and key,
//!   ALPN, a server name override, or a ready rustls `ClientConfig`), checked when built, not at the first
//!   connection. Each config carries its own provider (default *ring*: no cmake or bindgen in cross builds);
//!   the crate never installs a process-wide one, so it works beside firmware that uses another. Also
//!   username/password ([`MqttConfig::credentials`]); credentials and keys never appear in logs or `Debug`
//!   output. 0.1's `Tls` struct is replaced by [`TlsConfig`].
//!
//! ### The core and the connection it does not own
//!
//! Everything between a received PUBLISH and its PUBACK is one piece of code, [`ConsumerCore`]: identity
//! extraction, limits and quarantine, group commit, handler retries and dead letters, storage retries,
//! acks in arrival order, connection epochs. It owns no socket and no thread, like quinn-proto under quinn
//! (its [`Inbox`] keeps the checkpoint thread of [`Config::checkpoint_thread`], which only copies the WAL);
//! [`Consumer`] is that core plus a connection of its own, and a firmware that already holds the one MQTT
//! connection its cloud allows drives the same core from its own event loop. The names:
//!
//! - [`ConsumerCore`]: `push(connection, Inbound, packet id)`, `connected(connection, session_present)`,
//!   `connection_lost(connection)`, `settle(handler)` (blocking: commits), `pop_ack()` (the acks safe to
//!   send now, in arrival order, each an [`Ack`] tagged with its [`ConnectionId`]; never one of a connection
//!   older than the latest it was told about).
//! - [`AckGate`]: the current connection, shared by the thread that polls rumqttc and the thread that sends
//!   acks. `send(client, ack)` checks the ack's connection and queues the PUBACK in one step under a lock;
//!   `lost(purge)` ends the connection and, under the same lock, purges the PUBACKs rumqttc still holds
//!   (`lost_v5`/`lost_v311` do it for rumqttc's event loops). So a PUBACK computed for connection N can never
//!   be written on connection N+1, where its packet id may name another message.
//! - [`Feed`] and [`CommitThread`]: [`ConsumerCore::spawn`] puts the core on a commit thread of its own
//!   and returns the feed, owned by the code that polls the connection. Commits never run on the thread
//!   that polls the socket, nor on an async executor's threads.
//! - Conversions: `Inbound::from` rumqttc's MQTT 5 and 3.1.1 `Publish`, or [`Feed::publish_v5`] /
//!   [`Feed::publish_v311`].
//!
//! One delivery, from socket to PUBACK:
//!
//! ```text
//! poll thread (rumqttc event loop)        commit thread (owns Inbox + ConsumerCore)
//! ConnAck    -> feed.connected()  -- AckGate: connection N current; core.connected(N)
//! Publish p  -> feed.publish_v5(p) ----->  core.push(N, Inbound, pkid)
//!               (bounded channel:          core.settle(handler): extract id, check limits, BEGIN IMMEDIATE,
//!                back-pressure)              identity + handler writes, COMMIT (fsync)
//!                                          core.pop_ack() -> Ack{N, pkid} (in arrival order)
//!                                          gate.send(client, ack): under the lock, N still current?
//!                                            yes: client.try_ack(pkid) queued to rumqttc; no: dropped
//! rumqttc writes the PUBACK on N
//! Err(e)     -> feed.lost_v5(eventloop): under the lock, N ends and queued PUBACKs are purged;
//!               core.connection_lost(N): what N delivered is dropped unacked; the broker redelivers it
//!               on N+1 and the inbox recognises what was committed (a duplicate, acked then).
//! ```
//!
//! ### Three ways to run
//!
//! - **The crate's connection**: [`Consumer::run`]; the calling thread is the commit thread.
//! - **Your own connection** (one rumqttc client for telemetry and commands): build the client with
//!   `clean_start(false)` (3.1.1: `clean_session(false)`), manual acks, a Receive Maximum `W`,
//!   `max_packet_size(Some(DEFAULT_MAX_PACKET))` and TCP_NODELAY (`NetworkOptions::set_tcp_nodelay`; the
//!   PUBACKs of a batch leave back to back, and with Nagle's algorithm all but the first wait for the broker
//!   host's delayed TCP ACK, up to 40 ms, as the crate's own connection does not); `ConsumerCore::new(inbox, scope).spawn(handler,
//!   client.clone(), W)`; then, in your event loop: on every `ConnAck` call `feed.connected(session_present)`
//!   and subscribe; hand every PUBLISH for the inbox to `feed.publish_v5(p)`, and call
//!   `feed.pass_through(pkid)` for the QoS1 publishes of other topics you handle yourself instead of acking
//!   them (PUBACKs must leave in arrival order); on every `Err` from `recv`/`poll`, call
//!   `feed.lost_v5(&mut connection.eventloop)` **before polling again** (`feed.because(&e).lost_v5(..)`
//!   gives the loss its cause, for the [health events](#health-events-and-live-statistics)); never ack an
//!   inbox delivery
//!   yourself. To stop, `CommitThread::stop` (the batch in flight is committed and its acks queued), then
//!   disconnect the client and keep polling until the broker closes the connection; `join` gives back the
//!   summary. `examples/firmware.rs` is that program, tested with kill -9.
//! - **On tokio** (feature `tokio`, on by default: rumqttc already builds every part of tokio it uses, so it
//!   compiles no other crate). With your own `AsyncClient` and `EventLoop`, the same steps through
//!   `AsyncFeed` (the async [`Feed`]: a full channel is waited on in tokio's blocking pool, never on a
//!   runtime thread), and the stop through `CommitThread::join_until(cancel)`, from a task beside the one
//!   that polls (which keeps writing the last PUBACKs), with the DISCONNECT queued once it has returned.
//!   With the crate's connection, `Consumer::run_until(handler, cancel)`. Commits stay on the commit
//!   thread (or tokio's blocking pool), so both work on a current-thread runtime; when `cancel` completes,
//!   or the future is dropped, the run stops gracefully: what it committed is acked, nothing else.
//!   `examples/firmware_tokio.rs` is the firmware above on a current-thread runtime, stopped by tokio's
//!   signal handler, tested with SIGTERM mid-batch and kill -9.
//!
//! Entry points rather than a documented pattern, because the pattern's traps are the product's promise: a
//! [`Feed`] call blocks its thread when the channel is full (a current-thread runtime then stalls, the
//! broker's keep-alive with it), a stop that disconnects before the commit thread has queued its last
//! acks leaves committed deliveries unacked, and a dropped future must not leave a consumer running. The
//! loop that polls the event loop stays the application's own, since it also carries telemetry, other
//! subscriptions and its reconnect policy; the crate opens no second MQTT connection and starts no runtime
//! for it.
//!
//! ```no_run
//! # #[cfg(feature = "tokio")]
//! # mod doc {
//! use std::time::Duration;
//!
//! use edge_inbox::{AsyncFeed, Config, ConsumerCore, Delivery, Inbox, Tx};
//! use rumqttc::v5::mqttbytes::QoS;
//! use rumqttc::v5::{AsyncClient, Event, Incoming, MqttOptions};
//!
//! fn apply(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
//!     tx.put("last-command", &String::from_utf8_lossy(d.payload).into_owned())?;
//!     Ok(())
//! }
//!
//! pub async fn firmware() -> anyhow::Result<()> {
//!     let mut options = MqttOptions::new("gw7", "hub.example", 1883);
//!     options.set_clean_start(false).set_manual_acks(true);
//!     options.set_session_expiry_interval(Some(7 * 24 * 3600));
//!     options.set_receive_maximum(Some(20));
//!     options.set_max_packet_size(Some(edge_inbox::DEFAULT_MAX_PACKET));
//!     let mut network = options.network_options();
//!     network.set_tcp_nodelay(true);
//!     options.set_network_options(network);
//!     let (client, mut eventloop) = AsyncClient::new(options, 64);
//!     let inbox = tokio::task::spawn_blocking(|| Inbox::open("/var/lib/gw/inbox.db", Config::default()))
//!         .await??;
//!     let (feed, commits) = ConsumerCore::new(inbox, "commands").spawn(apply, client.clone(), 20)?;
//!     let mut feed = AsyncFeed::new(feed);
//!     let stopper = {
//!         let client = client.clone();
//!         tokio::spawn(async move {
//!             let ctrl_c = async {
//!                 let _ = tokio::signal::ctrl_c().await;
//!             };
//!             let (core, summary) = commits.join_until(ctrl_c).await; // last acks queued
//!             let _ = client.disconnect().await; // behind them
//!             // Closing the inbox blocks (a checkpoint, syncs): off the runtime's threads.
//!             let _ = tokio::task::spawn_blocking(move || drop(core)).await;
//!             summary
//!         })
//!     };
//!     loop {
//!         // A closed feed (`Err`) means the commit thread has ended: the stopper takes it from there.
//!         match eventloop.poll().await {
//!             Ok(Event::Incoming(Incoming::ConnAck(ack))) => {
//!                 let _ = feed.connected(ack.session_present).await;
//!                 client.try_subscribe("cmd/gw7/#", QoS::AtLeastOnce)?;
//!             }
//!             Ok(Event::Incoming(Incoming::Publish(p))) => {
//!                 let _ = feed.publish_v5(p).await;
//!             }
//!             Ok(_) => {}
//!             Err(_) => {
//!                 let _ = feed.lost_v5(&mut eventloop).await; // before polling again
//!                 if stopper.is_finished() {
//!                     break; // the broker closed the connection after the DISCONNECT
//!                 }
//!                 tokio::time::sleep(Duration::from_secs(1)).await;
//!             }
//!         }
//!     }
//!     println!("{:?}", stopper.await??);
//!     Ok(())
//! }
//! # }
//! # fn main() {}
//! ```
//!
//! Driving the core directly (a single thread, your own channel) is possible too: call `push`/`connected`/
//! `connection_lost` in the order events happened, `settle` from a thread that may block, and send each
//! `pop_ack()` with [`AckGate::send`]; give the core the same gate ([`ConsumerCore::gate`]) so that its
//! storage retries give up on a batch whose connection has ended.
//!
//! `examples/inventory.rs` is the whole scenario: `cargo run --example inventory` starts a local broker
//! (mosquitto when it is installed, else one embedded in the example's process; `--broker HOST:PORT` in `run`
//! mode for a real one), publishes order events with a redelivery, a conflicting reuse of an id and a message without an id, and
//! prints what was reserved.
//!
//! ### Health: events and live statistics
//!
//! A running consumer is watched from outside through two handles, on [`Consumer`] and on [`ConsumerCore`]
//! alike (take them before [`ConsumerCore::spawn`]; the [`Feed`]'s commit thread fills them the same way):
//!
//! - [`Consumer::events`] / [`ConsumerCore::events`]: a bounded channel of [`HealthEvent`]s: `Connected`
//!   (connection, session present), `Subscribed` (the broker acknowledged the connection's subscriptions at
//!   QoS1: from then on a message published reaches the consumer; [`Feed::subscribed`] on an own
//!   connection), `ConnectionLost` (connection, cause: rumqttc's error, a refused subscription, or what the
//!   application gave [`Feed::because`]), and one `Delivery` event per fate of a delivery (processed,
//!   duplicate, conflict, quarantined, stored, dead-lettered, each failed handler attempt; [`Settled`]) with
//!   its scope, message id and connection. A channel, not a callback: a callback would run on the commit
//!   thread, and a slow one (a blocked log sink, a metrics lock) would hold back every commit and PUBACK
//!   behind it. The commit thread only `try_send`s: when the reader lags the event is dropped and counted
//!   ([`HealthEvents::dropped`]), so neither the commit path nor memory grows with a slow reader. A
//!   delivery's event is sent once the commit (or, for a failed attempt, the rollback) that decided it is
//!   durable (it returned, or with [overlapping syncs](SyncOverlap) a sync covered it); its PUBACK follows. A batch's events come in arrival order.
//! - [`Consumer::stats`] / [`ConsumerCore::stats`]: a [`StatsHandle`] whose [`StatsHandle::snapshot`] gives,
//!   from any thread while `run` runs, the run's [`RunSummary`] so far, the current connection and whether
//!   its subscriptions are acknowledged ([`ConsumerStats::subscribed`]), the last loss's cause, the
//!   deliveries not yet committed, whether a commit loop runs and how often it turned
//!   ([`ConsumerStats::turns`]: at least every 100 ms unless a commit or a handler is stuck; what a watchdog
//!   should check). The commit thread updates it after each batch and loop turn, and skips an update rather
//!   than wait for a reader that holds its lock.
//!
//! ```no_run
//! # #[cfg(feature = "mqtt")]
//! # fn main() -> anyhow::Result<()> {
//! use edge_inbox::{Config, Consumer, HealthEvent, Inbox, MqttConfig, Settled, Tx, Delivery};
//! let inbox = Inbox::open("/var/lib/gateway/inbox.db", Config::default())?;
//! let mqtt = MqttConfig::new("broker.local", 1883, "inventory-gw7").subscribe("orders/#");
//! let mut consumer = Consumer::new(inbox, "inventory-reservation", mqtt);
//! let stats = consumer.stats();
//! let events = consumer.events(1024);
//! std::thread::spawn(move || {
//!     while let Some(event) = events.recv() {
//!         match event {
//!             HealthEvent::ConnectionLost { cause, .. } => eprintln!("broker lost: {cause:?}"),
//!             HealthEvent::Delivery { outcome: Settled::DeadLettered, message_id, .. } => {
//!                 eprintln!("dead letter {message_id:?}")
//!             }
//!             _ => {}
//!         }
//!     }
//! });
//! std::thread::spawn(move || loop {
//!     let s = stats.snapshot();
//!     println!("connected {} processed {}", s.connection.is_some(), s.summary.processed);
//!     std::thread::sleep(std::time::Duration::from_secs(10));
//! });
//! consumer.run(|_: &mut Tx<'_>, _: &Delivery<'_>| Ok(()))?;
//! # Ok(()) }
//! # #[cfg(not(feature = "mqtt"))] fn main() {}
//! ```
//!
//! The library never talks to systemd; `examples/inventory.rs` shows readiness and a watchdog built on these
//! handles (`READY=1` once a subscription is first acknowledged, `WATCHDOG=1` only while
//! [`ConsumerStats::turns`] grows), and the README a unit file.
//!
//! ## Consumer outbox: publishing from a handler
//!
//! A handler that must emit a message (`stock-reserved` after a reservation) must neither lose it nor send
//! it twice across a crash. Publishing from inside the handler would send before the commit (a rollback
//! leaves a message about an effect that never happened); publishing after it loses the message when the
//! process dies in between. [`Tx::publish`] writes the message to the `outbox` table **in the same
//! transaction** as the delivery's identity and its effect: all three commit, or none does. Nothing is sent
//! before the commit.
//!
//! ```no_run
//! # #[cfg(feature = "mqtt")]
//! use edge_inbox::{Config, Consumer, Delivery, Inbox, MqttConfig, OutboxProperties, Qos, Relay, Tx};
//!
//! # #[cfg(feature = "mqtt")]
//! fn reserve(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
//!     let reserved: i64 = tx.get("reserved/A-1")?.unwrap_or(0);
//!     tx.put("reserved/A-1", &(reserved + 1))?;
//!     tx.publish("stock/reserved/A-1", br#"{"sku":"A-1"}"#, Qos::AtLeastOnce, &OutboxProperties::new())?;
//!     Ok(())
//! }
//!
//! # #[cfg(not(feature = "mqtt"))] fn main() {}
//! # #[cfg(feature = "mqtt")]
//! # fn main() -> anyhow::Result<()> {
//! let db = "/var/lib/gateway/inbox.db";
//! let config = Config::default().outbox_producer("gateway-7");
//! // The relay has its own connection to the file and its own MQTT client id.
//! let relay = Relay::start(Inbox::open(db, config.clone())?, MqttConfig::new("broker.local", 1883, "gw7-relay"))?;
//! let mqtt = MqttConfig::new("broker.local", 1883, "inventory-gw7").subscribe("orders/#");
//! Consumer::new(Inbox::open(db, config)?, "inventory-reservation", mqtt).run(reserve)?;
//! relay.stop();
//! # Ok(()) }
//! ```
//!
//! - **Stable ids.** Each message gets an application message id derived from the handled delivery's
//!   identity and the message's index within the handler call ([`outbox_message_id`]; or your own with
//!   [`Tx::publish_with_id`]). No clock, no randomness: a retried handler, or a redelivery after a crash
//!   before the commit, derives the same ids, and only the attempt that commits writes them. The producer
//!   namespace is [`Config::outbox_producer`] (a gateway name, say), by default the scope.
//! - **The relay** ([`Relay`], feature `mqtt`) is a thread with its own [`Inbox`] on the same file and its
//!   own MQTT 5 connection. It publishes pending rows in commit order with the user properties `message-id`
//!   and `producer` (what [`UserProperty`] reads on the other side) and `sent-at`, the time the row was
//!   committed in Unix seconds as a decimal string (the same on every resend; a receiver's identity horizon
//!   reads it), at most [`RelayConfig::inflight`] unconfirmed at a time, and marks a row sent only after the
//!   broker's PUBACK for it. A crash, a lost connection or a refused publish leaves rows pending; they are
//!   sent again, from the oldest, after a reconnect with backoff or a restart. Receivers therefore see every
//!   message **at least once, always with the same id**: an edge-inbox consumer downstream applies each
//!   exactly once in effect. QoS0 messages are marked when written and may be lost. A row the broker keeps
//!   refusing ([`RelayConfig::max_refusals`]), or one its CONNACK rules out (over its Maximum Packet Size,
//!   retained where it takes no retained messages, QoS 1 where it takes QoS 0 only), is parked instead of
//!   holding back the rest: kept and counted, sent again after [`Inbox::requeue_parked_outbox`] (a running
//!   relay picks it up within its poll interval, after the rows that went on meanwhile: first copies arrive
//!   in commit order except for a refused publish resent after a backoff and such a requeued row).
//! - **Observability and retention.** [`Inbox::outbox_backlog`] gives pending count, oldest pending age and
//!   sent count; [`Inbox::prune_outbox`] deletes sent rows older than an age (pending rows never).
//! - Topic, payload and properties ([`OutboxProperties`]: user properties, content type, ..., stored as CBOR;
//!   no MQTT types in the core) are checked against the inbox [`Limits`] before anything is written.
//!
//! ### Outside the guarantee: HTTP, e-mail, other stores
//!
//! The outbox covers messages to the broker only. A call to an HTTP API, an e-mail or a write to another
//! database cannot join the SQLite transaction: if the handler made the call directly, a rollback or a
//! crash before the commit would leave the effect done and the delivery not recorded, and the redelivery
//! would do it again. The pattern is the same as the outbox's: **record the intent in the transaction,
//! perform it afterwards with an idempotency key, then mark it done.**
//!
//! ```
//! use edge_inbox::{outbox_message_id, Config, Delivery, Inbox, Tx};
//! # fn main() -> anyhow::Result<()> {
//! # let dir = tempfile::tempdir()?;
//! let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default())?;
//! inbox.connection().execute_batch(
//!     "CREATE TABLE IF NOT EXISTS mail_intents (key TEXT PRIMARY KEY, body TEXT NOT NULL, done INTEGER NOT NULL DEFAULT 0)",
//! )?;
//! // 1. In the handler: the intent commits with the effect; its key is stable across attempts.
//! let handler = |tx: &mut Tx<'_>, d: &Delivery<'_>| -> anyhow::Result<()> {
//!     let key = outbox_message_id(d.scope, d.producer, d.message_id, 0);
//!     tx.sql().execute(
//!         "INSERT INTO mail_intents (key, body) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
//!         (&key, "order 42 reserved"),
//!     )?;
//!     Ok(())
//! };
//! inbox.process(&Delivery::new("notify", "evt-42", "orders/42", b"{}"), handler)?;
//! // 2. After the commit, from a worker loop: perform each pending intent, passing the key as the
//! //    idempotency key (e.g. an `Idempotency-Key` header), then mark it done. A crash in between repeats
//! //    the call with the same key: the receiving system must deduplicate on it, or the effect may repeat.
//! let pending: Vec<String> = inbox
//!     .connection()
//!     .prepare("SELECT key FROM mail_intents WHERE done = 0")?
//!     .query_map([], |r| r.get(0))?
//!     .collect::<Result<_, _>>()?;
//! for key in pending {
//!     // send_mail(&key, body)?;   -- external call with the idempotency key
//!     inbox.connection().execute("UPDATE mail_intents SET done = 1 WHERE key = ?1", [&key])?;
//! }
//! # Ok(()) }
//! ```
//!
//! The external system's own deduplication (an idempotency key, a conditional write, a unique constraint)
//! is what makes the effect happen once; without it the effect is at-least-once.
//!
//! `examples/outbox.rs` runs the whole scenario on a local broker (as the inventory example
//! chooses it): a consumer whose handler publishes
//! `stock-reserved`, the relay, and a subscriber that prints what it gets (the redelivered order is announced
//! once).
//!
//! ## Several consumers on one gateway
//!
//! Each thread or process opens its own [`Inbox`] on the same file. SQLite admits one writer at a time; the
//! others wait up to [`Config::busy_timeout`] and then get [`Error::Busy`] (not a duplicate).
//!
//! ## Retention
//!
//! Identities are the evidence that protects against a repeated effect; payloads are only cost. A
//! [`RetentionPolicy`] set per scope with [`Inbox::set_retention`] (stored in the database, so every process on
//! the file applies the same rules; the default keeps everything forever) separates the two:
//!
//! - **payloads**: stored messages in state *processed* and, separately, *dead-lettered* are deleted after their
//!   own age. Pending and failed messages are never deleted. The compact identity row stays (interned scope,
//!   16-byte hash, fingerprint, commit day: 39.3 bytes on disk each for a million identities, 39.1 for 100 000
//!   beside the empty schema's fixed pages, measured by `examples/retention_bench.rs`; an order prefix of
//!   [`Config::id_order`] adds its bytes), so every redelivery is
//!   still a [`Outcome::Duplicate`];
//! - **identity horizon** (default: forever): when the operator sets one, identities older than it are deleted,
//!   counted (`identities_pruned`) and logged. An identity whose stored message is still open (pending or
//!   failed) or dead-lettered is never deleted. For a deferred delivery the horizon counts from the day it was
//!   processed; a processed body kept longer than the horizon does not hold its identity back (processed bodies
//!   are not indexed by id, so that pruning them writes few pages). The horizon must cover every way an
//!   old message can come back: the broker's retention of queued messages, relays and bridges that republish,
//!   dead-letter queues that are replayed, restores from backups, and deliberate replays;
//! - **after the horizon**: the scope records the bound [`Inbox::pruned_before`]. A delivery whose
//!   [`Delivery::sent_at`] is older than that (allowing [`RetentionPolicy::clock_skew`]) and whose identity is
//!   not found may be a repetition the inbox can no longer recognise. The scope's [`ExpiredPolicy`] decides:
//!   process it as new (logged), reject it, or quarantine it ([`Outcome::Expired`], never a duplicate);
//! - **deliveries without a send time**: nothing could ever say that a repetition of one is older than the
//!   horizon, so its identity is stored marked *undated* and the horizon never prunes it (`inboxctl stats`
//!   counts them). Safe: such a repetition always finds its identity; the cost is storage, until producers
//!   stamp `sent-at` (the outbox relay does);
//! - **the clock**: retention acts only on a time that can be right. Before [`EARLIEST_PLAUSIBLE_TIME`] or
//!   before the database was created (a gateway without a real-time clock boots at 1970), or more than
//!   [`Pruning::max_clock_jump`] (30 days) after the latest time a pass accepted, a pass prunes nothing
//!   ([`PruneReport::clock_refused`]), logs a warning, and `inboxctl check` says so; [`Pruning::trust_clock`]
//!   confirms a jump; a time stated with [`Pruning::as_of`] (`inboxctl prune --as-of`) is not held to the
//!   jump rule. An identity whose commit day is before the database could exist was stamped by a wrong
//!   clock: a pass re-dates it to the current day (it ages from a time that can be right, never faster),
//!   counted as `identities_restamped`. A commit clock that runs behind the latest time a pass accepted
//!   cannot date an identity before that time either, so a clock that is wrong at commit can only keep an
//!   identity longer. Each step reads the policies inside the transaction that deletes, so a policy another
//!   process changed is applied from the next step on, never half;
//! - **sequence watermarks** ([`RetentionPolicy::sequence_watermarks`], opt-in per new scope: refused once the
//!   scope recorded anything, even if the horizon since pruned all its identities): when producers
//!   number their messages, contiguous processed ranges collapse into one high-water mark per producer plus the
//!   few sequences that arrived out of order, so deduplication stays exact for ever in O(producers) space
//!   (10 million messages from 100 producers: an 84 KiB file, plus the window below, about 10 KiB per
//!   producer). A repeated sequence is never a duplicate on its number alone: the identity and fingerprint of the
//!   last [`SEQUENCE_WINDOW`] sequences of each producer (and of every out-of-order one) are kept, so the same
//!   message is a duplicate, the same id with other content a conflict, and another id (a producer that
//!   restarted its counter, or two producers in one namespace) an [`Outcome::SequenceConflict`]: quarantined with
//!   its reason and counted (`sequence_conflicts`). Below the window nothing can be compared any more, so such a
//!   sequence is quarantined too (cause `below-window`): never applied twice, never acked unseen. A numbered
//!   delivery sent before [`Inbox::pruned_before`] whose sequence is new meets the [`ExpiredPolicy`] like any
//!   other. The identity is (scope, producer, message id) here too: a message id known in the window is
//!   recognised whatever sequence it comes with (a producer that numbers publish attempts, or republishes after
//!   a restart), a duplicate with the same content and a conflict with other content, and a free sequence it
//!   comes with is claimed, so it leaves no gap. Known means: the sequence that first claimed the id is still
//!   among the producer's last [`SEQUENCE_WINDOW`] sequences at or below its mark, or is an out-of-order one.
//!   Beyond that the id is forgotten: coming again under a sequence at or below the mark it is quarantined
//!   (`below-window`, never applied twice), but under a new sequence above the mark it is taken as new and
//!   applied again: past the window a watermark scope tells numbered messages apart by (producer, sequence)
//!   only. A producer that may republish an id under a new number after more than [`SEQUENCE_WINDOW`] further
//!   messages should not use watermarks for that traffic;
//! - **quarantine and conflict records** ([`RetentionPolicy::quarantine_and_conflicts`], default: kept for
//!   ever): records whose last arrival is older than the age are deleted by a pass (and `inboxctl prune`), a
//!   bounded number per step; nothing else is. Set it on a scope that untrusted publishers can reach: each
//!   distinct bad delivery adds a record of a few hundred bytes.
//!
//! [`Inbox::prune_step`] does one bounded step (a window of rows, some free pages, or a WAL checkpoint) in its
//! own short transaction; [`Inbox::prune`] runs a whole pass, resting between steps so that consumers on the
//! same file keep committing. Freed pages go back to the file system (`auto_vacuum=INCREMENTAL`, run in steps)
//! and a pass ends with a PASSIVE checkpoint that keeps the WAL file's size, so the consumers' next commits
//! overwrite it in place instead of appending ([`Pruning::truncate_wal`] to shrink it to zero). Steps commit
//! without their own sync (a lost step is redone by the next pass; [`Pruning::sync_steps`] to sync each
//! inside its commit, or [`Pruning::sync_after_steps`] to sync the WAL after each once the write lock is
//! released: off by default, it did not lower a consumer's commit p99 where measured). The pruner copies the
//! WAL back itself whenever a step leaves [`Pruning::checkpoint_pages`] (250) frames not yet copied: a
//! PASSIVE checkpoint, and when the WAL has not started over by itself by twice that, a RESTART that copies
//! the few frames consumers added meanwhile (holding the write lock for that, and for at most 10 ms more
//! while readers leave the WAL) so that it does; both outside its transactions and its rest. The WAL so
//! stays below the consumers' [`Config::wal_autocheckpoint`] (10,000), and a consumer's commit does not
//! have to run a checkpoint while a pass runs (5 of 232,504 did beside a 1,000,000-row prune on a loaded
//! machine, 1,931 before); keep twice the pruner's figure below theirs when changing either. Other
//! defaults: 32 rows a step, rest 9 times as long as each step took and at least 10 ms
//! ([`Pruning::batch`], [`Pruning::idle`], [`Pruning::pause`]). A pass also deletes outbox messages the
//! broker confirmed more than 7 days ago ([`Pruning::sent_outbox`]; pending and parked ones never).
//! Measured beside a consumer committing one delivery at a time: BENCHMARKS.md, issue 26.
//!
//! ```
//! use edge_inbox::{Config, ExpiredPolicy, Inbox, Pruning, RetentionPolicy};
//! use std::time::Duration;
//!
//! # fn main() -> anyhow::Result<()> {
//! # let dir = tempfile::tempdir()?;
//! let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default())?;
//! const DAY: Duration = Duration::from_secs(86_400);
//! inbox.set_retention(
//!     "inventory-reservation",
//!     &RetentionPolicy::new()
//!         .processed_payloads(DAY)
//!         .dead_letter_payloads(30 * DAY)
//!         .identity_horizon(180 * DAY)
//!         .expired(ExpiredPolicy::Quarantine)
//!         .quarantine_and_conflicts(90 * DAY),
//! )?;
//! let report = inbox.prune(&Pruning::default())?; // e.g. from a maintenance thread, on its own Inbox
//! assert!(report.done);
//! # Ok(()) }
//! ```
//!
//! ## Operating an inbox
//!
//! Everything an operator asks about a file is answered by [`inspect`]: read-only functions over any
//! connection (an open inbox's, or [`open_read_only`] on a file another process is using) that return plain,
//! serializable structs. [`Inbox::stats`] gives, per scope, the durable counters, the deferred backlog, the dead
//! letters held and the identities retained ([`ScopeReport`]); [`Inbox::file_sizes`] the bytes of the database
//! and its WAL. The `inboxctl` binary (feature `cli`, off by default: `cargo build --features cli`) is a
//! thin shell over these functions: `stats`, `show`, `conflicts`, `quarantine`, `dead-letters`, `requeue`,
//! `prune` (a dry run unless `--apply`), `check` (`PRAGMA integrity_check`, the inbox's own invariants from
//! [`inspect::check_invariants`], each breach by name, and the settings; exit code 1 on any) and `export`
//! (JSON lines or CBOR).
//!
//! What the inbox does when the disk misbehaves, each case tested on real files and processes: a full disk is
//! [`Error::DiskFull`] and a read-only file [`Error::ReadOnly`] or [`Error::Open`], with nothing written; a lock
//! held by another process is [`Error::Busy`], never a duplicate; a file that is not a database is
//! [`Error::NotADatabase`] and a damaged page a [`Error::Storage`] with `SQLITE_CORRUPT` (and a failing `check`).
//!
//! **Files deleted underneath an open inbox.** The inbox learns the identity (device, inode) of its database
//! file and WAL when it opens, and after every commit compares them with what the paths name now (on local
//! file systems only when an inotify watch of the directory reports something about either name, and once a
//! second; elsewhere after every commit):
//!
//! - the **database file** gone (`rm inbox.db*`, renamed away, replaced): what the inbox writes from then on
//!   goes into a file without that name, lost when it closes. The commit that notices it returns
//!   [`Error::DatabaseGone`] (never `Ok`, so never acked), an error naming the path is logged, and every later
//!   write on that inbox fails the same way, also the application's own statements through
//!   [`Inbox::connection`], until it is reopened. Reopened, it works on whatever file is at the path: after a
//!   deletion a new, empty database, which knows none of the deleted file's identities (the deletion forgot
//!   them). Closing the orphaned inbox leaves the new file's `-wal` and `-shm` alone;
//! - the **WAL** alone gone: the commit that notices it copies every frame into the database file (a FULL
//!   checkpoint) before reporting success, and logs an error asking for a reopen. Frames committed before a
//!   deletion while the inbox is idle do not wait for a next commit: a thread of the inbox's own, woken by a
//!   second watch, checkpoints them through the same connection (which is opened in SQLite's serialized mode
//!   for it) within moments of the deletion. Without a watch (other file systems, more than 16 inboxes in
//!   the process) they are rescued by the next commit, and are lost if the process dies before it.
//!
//! ## Replay and rebuilds
//!
//! Replaying a scope's history (a broker's retained messages, an archive) into the **same** scope respects its
//! identities: what was applied is reported as a duplicate and not applied again. To build a **new** projection
//! from the same history, use a versioned scope ([`versioned_scope`]: `inventory-reservation@2`), which starts
//! with no identities; never wipe the old scope's identities. See `examples/replay.rs`.

#![deny(missing_docs)]
#![warn(rust_2018_idioms)]

mod deferred;
mod inbox;
pub mod inspect;
mod kv;
mod mqtt;
mod outbox;
mod retention;
mod store;

pub use crate::deferred::backlog::{Backlog, BacklogThreshold};
pub use crate::deferred::requeue::DeadLetter;
pub use crate::deferred::worker::{Claim, Completion, Drained, Worker, WorkerConfig};
pub use crate::inbox::{Handler, Inbox};
pub use crate::inspect::stats::ScopeStats;
pub use crate::inspect::{BytesWritten, FileSizes, ScopeReport};
#[cfg(feature = "tokio")]
pub use crate::mqtt::async_feed::AsyncFeed;
#[cfg(feature = "mqtt")]
pub use crate::mqtt::budget::DEFAULT_MEMORY_BUDGET;
#[cfg(feature = "mqtt")]
pub use crate::mqtt::conn::{MqttConfig, Protocol, DEFAULT_MAX_PACKET};
#[cfg(feature = "mqtt")]
pub use crate::mqtt::consumer::{Consumer, RunSummary, StopHandle};
#[cfg(feature = "mqtt")]
pub use crate::mqtt::core::{ConsumerCore, STORAGE_RETRY_LIMIT};
#[cfg(feature = "mqtt")]
pub use crate::mqtt::driver::{CommitThread, Feed, FeedClosed};
#[allow(deprecated)]
pub use crate::mqtt::extract::Incoming;
pub use crate::mqtt::extract::{
    parse_sent_at, Envelope, ExtractIdentity, Identity, Inbound, UserProperty, SENT_AT,
};
#[cfg(feature = "mqtt")]
pub use crate::mqtt::gate::{Ack, AckGate, AckSent, ConnectionId, PubAckSender};
#[cfg(feature = "mqtt")]
pub use crate::mqtt::health::{ConsumerStats, HealthEvent, HealthEvents, Settled, StatsHandle};
#[cfg(feature = "mqtt")]
pub use crate::mqtt::pipeline::SyncOverlap;
pub use crate::mqtt::property_bag::PropertyBag;
#[cfg(feature = "mqtt")]
pub use crate::mqtt::relay::{Relay, RelayConfig, RelayStats};
#[cfg(feature = "mqtt")]
pub use crate::mqtt::tls::{TlsConfig, TlsConfigBuilder, TlsConfigError};
pub use crate::outbox::{outbox_message_id, OutboxBacklog, OutboxProperties, Qos};
pub use crate::retention::watermark::{Watermark, SEQUENCE_WINDOW};
pub use crate::retention::{
    clock_floor, clock_verdict, versioned_scope, ClockVerdict, ExpiredPolicy, PruneReport, Pruning,
    RetentionPolicy, EARLIEST_PLAUSIBLE_TIME, SENT_OUTBOX_AGE,
};
pub use crate::store::config::{Config, Limits, Synchronous};
pub use crate::store::error::{Error, InvalidDelivery, Result};
pub use crate::store::id_order::IdOrder;
pub use crate::store::identity::{Delivery, Fingerprint, IdHash, IdKey, ID_KEY_LEN};
pub use crate::store::outcome::{MessageState, Outcome, SequenceConflictCause, Status};
pub use crate::store::records::QUARANTINE_PREFIX;
pub use crate::store::schema::{
    downgrade_schema, open_read_only, OLDEST_DOWNGRADE, SCHEMA_VERSION,
};
pub use crate::store::state::Tx;

/// The rusqlite version this crate is built against, for handlers that use [`Tx::sql`].
pub use rusqlite;
