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
//! database (an HTTP call, an e-mail, another store): those need their own idempotency.
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
//! let delivery = Delivery::new("inventory-reservation", "evt-42-created", "orders/42", payload);
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
//! | `Err(Error::Busy / DiskFull / ReadOnly / Storage)` | nothing written | no; retry |
//! | `Err(Error::CommitUnknown)` | COMMIT failed: may or may not be durable | no; the redelivery settles it |
//! | `Err(Error::InvalidDelivery)` | bad input; nothing written | quarantine, then ack |
//!
//! Errors are classified by SQLite extended result codes ([`Error::sqlite_code`]), never by message text.
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
//! The identity is stored as a 16-byte xxh3-128 hash ([`IdHash`]), and beside it a 64-bit
//! [`Fingerprint`] of (topic, payload) that tells a redelivery from a conflicting reuse of the id.
//!
//! ## Handlers and state
//!
//! A handler is any `FnMut(&mut Tx, &Delivery) -> anyhow::Result<()>`. Through [`Tx`] it reads and writes
//! the built-in key-value state (serde values stored as CBOR, namespaced by scope or by your own namespace)
//! or, with [`Tx::sql`], its own tables in the same transaction. [`rusqlite`] is re-exported so the versions
//! match.
//!
//! ## Group commit
//!
//! Each commit with `synchronous=FULL` costs at least one fsync, which bounds a consumer at the device's
//! fsync rate. [`Inbox::process_batch`] puts many deliveries in one transaction, each in its own savepoint
//! (a failing handler undoes only its own delivery), and returns outcomes in input order: one fsync per batch.
//!
//! ## Durability
//!
//! The database runs in WAL mode with `synchronous=FULL` by default: when `process` returns `Ok`, the
//! outcome survives a process crash and a power loss (given storage that honours fsync). With
//! [`Synchronous::Normal`] a commit survives a process crash but **a power loss can lose acknowledged
//! deliveries**; opt in only where that is acceptable. Every setting is read back after it is applied.
//!
//! ## Resolving an unknown commit
//!
//! When `COMMIT` fails with an I/O error the transaction may or may not be on disk
//! ([`Error::CommitUnknown`]). Do not ack. The broker redelivers, and the identity insert then either
//! succeeds (it was not committed) or reports a duplicate (it was). [`Inbox::status`] answers the same
//! question directly.
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
//!   16-byte hash, fingerprint, commit day: 39.3 bytes on disk each for a million identities, measured by
//!   `examples/retention_bench.rs`), so every redelivery is still a [`Outcome::Duplicate`];
//! - **identity horizon** (default: forever): when the operator sets one, identities older than it are deleted,
//!   counted (`identities_pruned`) and logged. An identity whose stored message still exists (pending, failed,
//!   or a processed or dead-lettered body not yet pruned) is never deleted. The horizon must cover every way an
//!   old message can come back: the broker's retention of queued messages, relays and bridges that republish,
//!   dead-letter queues that are replayed, restores from backups, and deliberate replays;
//! - **after the horizon**: the scope records the bound [`Inbox::pruned_before`]. A delivery whose
//!   [`Delivery::sent_at`] is older than that (allowing [`RetentionPolicy::clock_skew`]) and whose identity is
//!   not found may be a repetition the inbox can no longer recognise. The scope's [`ExpiredPolicy`] decides:
//!   process it as new (logged), reject it, or quarantine it ([`Outcome::Expired`], never a duplicate);
//! - **sequence watermarks** ([`RetentionPolicy::sequence_watermarks`], opt-in per new scope): when producers
//!   number their messages, contiguous processed ranges collapse into one high-water mark per producer plus the
//!   few sequences that arrived out of order, so deduplication stays exact for ever in O(producers) space
//!   (10 million messages from 100 producers: an 84 KiB file). No fingerprint is kept per sequence:
//!   a sequence reused with different content is a duplicate there, not a conflict.
//!
//! [`Inbox::prune_step`] does one bounded step (a window of rows, some free pages, or a WAL checkpoint) in its
//! own short transaction; [`Inbox::prune`] runs a whole pass, resting between steps so that consumers on the
//! same file keep committing. Freed pages go back to the file system (`auto_vacuum=INCREMENTAL`, run in steps)
//! and a pass ends with `wal_checkpoint(TRUNCATE)`.
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
//!         .expired(ExpiredPolicy::Quarantine),
//! )?;
//! let report = inbox.prune(&Pruning::default())?; // e.g. from a maintenance thread, on its own Inbox
//! assert!(report.done);
//! # Ok(()) }
//! ```
//!
//! ## Replay and rebuilds
//!
//! Replaying a scope's history (a broker's retained messages, an archive) into the **same** scope respects its
//! identities: what was applied is reported as a duplicate and not applied again. To build a **new** projection
//! from the same history, use a versioned scope ([`versioned_scope`]: `inventory-reservation@2`), which starts
//! with no identities; never wipe the old scope's identities. See `examples/replay.rs`.

#![deny(missing_docs)]
#![warn(rust_2018_idioms)]

mod config;
mod error;
mod identity;
mod inbox;
mod outcome;
mod retention;
mod schema;
mod state;
mod stats;
mod watermark;

pub use crate::config::{Config, Limits, Synchronous};
pub use crate::error::{Error, InvalidDelivery, Result};
pub use crate::identity::{Delivery, Fingerprint, IdHash};
pub use crate::inbox::{Handler, Inbox};
pub use crate::outcome::{MessageState, Outcome, Status};
pub use crate::retention::{versioned_scope, ExpiredPolicy, PruneReport, Pruning, RetentionPolicy};
pub use crate::schema::{open_read_only, SCHEMA_VERSION};
pub use crate::state::Tx;
pub use crate::stats::ScopeStats;
pub use crate::watermark::Watermark;

/// The rusqlite version this crate is built against, for handlers that use [`Tx::sql`].
pub use rusqlite;
