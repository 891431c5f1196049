//! The strong case: identity insert and handler effect in one SQLite transaction.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rusqlite::{Connection, OptionalExtension};

use crate::retention::{self, RetentionState, ScopeRules};
use crate::store::checkpointer::Checkpointer;
use crate::store::config::{Config, OutboxSettings};
use crate::store::db::Db;
use crate::store::error::{storage_error, Error, Result};
use crate::store::identity::{Delivery, Fingerprint, IdHash};
use crate::store::outcome::{MessageState, Outcome, Status};
use crate::store::records::{self, Quarantine};
use crate::store::schema;
use crate::store::state::{is_interrupt, is_storage_failure, Tx};
use crate::store::txn::{begin, commit, release, unix_now};

/// A handler: applies one delivery's effect inside the open transaction.
///
/// Return `Err` to refuse the delivery: its effect and identity are rolled back together
/// ([`Outcome::HandlerFailed`]). Storage trouble of the inbox's own database (a full disk, a busy or read-only
/// file), met through [`Tx`] or on the connection [`Tx::sql`] hands out, is recognised and fails the whole call
/// as an [`Error`] instead. An error of any other database the handler opens itself (a lookup file that cannot
/// be opened, say) is the handler's failure like any other error.
pub trait Handler: FnMut(&mut Tx<'_>, &Delivery<'_>) -> anyhow::Result<()> {}
impl<F: FnMut(&mut Tx<'_>, &Delivery<'_>) -> anyhow::Result<()>> Handler for F {}

/// Outcome counts of one transaction, per scope, written to `scope_stats` before it commits.
#[derive(Default, Clone, Copy)]
struct Counts {
    scope_id: i64,
    processed: i64,
    duplicates: i64,
    conflicts: i64,
    handler_failures: i64,
}

/// An open inbox: one SQLite connection on one database file.
///
/// An `Inbox` is used from one thread at a time (it is `Send`, not `Sync`). Several threads or processes
/// share a file by each opening their own `Inbox`; SQLite lets one of them write at a time, and the others
/// wait up to the busy timeout.
pub struct Inbox {
    pub(crate) conn: Db,
    pub(crate) config: Config,
    path: PathBuf,
    scopes: HashMap<String, i64>,
    counts: Vec<Counts>,
    pub(crate) buf: RefCell<Vec<u8>>,
    pub(crate) retention: RetentionState,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("path", &self.path)
            .field("config", &self.config)
            .finish()
    }
}

impl Inbox {
    /// Opens the inbox at `path`, creating the file (mode 0600) and the schema if needed, and applying the
    /// settings in `config`: WAL journal, `synchronous` (FULL unless you opted out), busy timeout, foreign
    /// keys. Each setting is read back; one that does not stick is an [`Error::Setting`].
    ///
    /// Errors: [`Error::NotADatabase`] for a file that is not SQLite, [`Error::SchemaTooNew`] for a file
    /// written by a newer version, [`Error::Open`] or [`Error::ReadOnly`] for a location that cannot be
    /// written.
    pub fn open(path: impl AsRef<Path>, config: Config) -> Result<Inbox> {
        let path = path.as_ref();
        // Every publishing handler would fail on it, one delivery after the other.
        if let Some(p) = config.get_outbox_producer() {
            let max = config.limits.max_id_len;
            if p.is_empty() || p.len() > max || p.contains('\0') {
                return Err(Error::InvalidArgument(format!(
                    "the outbox producer must be 1 to {max} bytes without NUL, not {} bytes",
                    p.len()
                )));
            }
        }
        let mut conn = Db::new(
            schema::open(path, &config)?,
            config.synchronous.pragma_value(),
        )?;
        conn.outbox = OutboxSettings::from_config(&config);
        conn.id_key = schema::id_key(&conn)?;
        if conn.id_key.order() != config.id_order {
            log::info!(
                "{} keeps the identity layout it was created with ({}), not the configured {}",
                path.display(),
                conn.id_key.order().name(),
                config.id_order.name()
            );
        }
        conn.slow_commit = config.slow_commit;
        conn.path = path.to_owned();
        let threshold = i64::from(config.wal_autocheckpoint);
        let checkpointer = if config.checkpoint_thread && threshold > 0 {
            match Checkpointer::start(path, &config, threshold) {
                Ok(c) => Some(c),
                Err(e) => {
                    // The inbox works without it, as with `checkpoint_thread(false)`.
                    log::warn!(
                        "no checkpoint thread for {} ({e}): the automatic checkpoint runs in the commits",
                        path.display()
                    );
                    None
                }
            }
        } else {
            None
        };
        conn.wear = crate::store::wear::Wear::install(
            &conn,
            threshold,
            checkpointer.as_ref().map(|c| c.shared().clone()),
        );
        conn.checkpointer = checkpointer;
        Ok(Inbox {
            conn,
            config,
            path: path.to_owned(),
            scopes: HashMap::new(),
            counts: Vec::new(),
            buf: RefCell::new(Vec::new()),
            retention: RetentionState::default(),
        })
    }

    /// The settings this inbox was opened with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The key under which this database hashes identities (random per database since schema version 2;
    /// [`IdKey::UNKEYED`](crate::IdKey::UNKEYED) in a file migrated from version 1).
    pub fn id_key(&self) -> &crate::store::identity::IdKey {
        &self.conn.id_key
    }

    /// The stored key of the identity (producer, message id) in this database, under its [`Inbox::id_key`] and
    /// in its layout ([`IdKey::order`](crate::IdKey::order)).
    pub fn id_hash(&self, producer: Option<&str>, message_id: &str) -> IdHash {
        IdHash::keyed(&self.conn.id_key, producer, message_id)
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The underlying connection, for reads of the application's own tables outside a delivery.
    /// Writes that must be atomic with a delivery belong in the handler ([`Tx::sql`]).
    ///
    /// Its commit and rollback hooks are reserved: they guard every handler's transaction, and the inbox
    /// installs them again before each handler runs, so a hook set here never fires (see the crate guide,
    /// "Handlers and state"). Observe commits through the `Ok` of the inbox's calls instead.
    ///
    /// It is handed out at the configured `synchronous` level: if a consumer could not put the level back
    /// after its commits that left their syncs to the sync thread, this tries again (and logs a failure).
    /// A `synchronous` level or journal mode changed through it holds until the inbox's next write
    /// transaction, which sets both again and reads them back. End a transaction begun through it before the
    /// next call of the inbox: one left open is rolled back by that call (with a warning in the log), as a
    /// transaction an interrupted call left behind is.
    pub fn connection(&self) -> &Connection {
        if self.conn.is_autocommit() {
            if let Err(e) = self.conn.prepare_level() {
                log::warn!("cannot restore the inbox's synchronous level: {e}");
            }
        }
        // Whatever is done with it, the next commit is not made at a level the inbox did not check.
        self.conn.distrust_settings();
        &self.conn
    }

    /// Offers one delivery: in one `BEGIN IMMEDIATE` transaction inserts its identity and runs `handler`,
    /// then commits (durably, with the default `synchronous=FULL`).
    ///
    /// `Ok` means the outcome is committed; acknowledge the delivery if [`Outcome::may_ack`]. `Err` means
    /// nothing is known to be committed: do not acknowledge ([`Error::CommitUnknown`] may in fact have
    /// committed; a redelivery and [`Inbox::status`] settle it).
    pub fn process<H: Handler>(
        &mut self,
        delivery: &Delivery<'_>,
        mut handler: H,
    ) -> Result<Outcome> {
        let mut outcome = None;
        self.run(std::slice::from_ref(delivery), &mut handler, &mut |_, o| {
            outcome = Some(o)
        })?;
        Ok(outcome.expect("one delivery yields one outcome"))
    }

    /// Offers many deliveries in one transaction (group commit: one fsync for all of them). Each runs in
    /// its own savepoint, so a failing handler rolls back only its own delivery. Outcomes come back in
    /// input order. A repeated identity within the batch is a [`Outcome::Duplicate`] of the first.
    ///
    /// All deliveries are validated first; an invalid one fails the call before anything is written.
    /// A storage error fails the whole batch: nothing may be acked. Nothing of it is committed, except
    /// after a `COMMIT` a deferred constraint refused: the deliveries are then retried in a transaction each,
    /// and those before the one that met the error may be committed (their redeliveries are duplicates).
    pub fn process_batch<H: Handler>(
        &mut self,
        deliveries: &[Delivery<'_>],
        mut handler: H,
    ) -> Result<Vec<Outcome>> {
        let mut outcomes = Vec::with_capacity(deliveries.len());
        self.process_batch_into(deliveries, &mut handler, &mut outcomes)?;
        Ok(outcomes)
    }

    /// [`Inbox::process_batch`] writing into a caller-owned vector (cleared first), so a consumer that reuses
    /// it allocates nothing per batch. On `Err` the vector is left empty.
    pub fn process_batch_into<H: Handler>(
        &mut self,
        deliveries: &[Delivery<'_>],
        handler: &mut H,
        outcomes: &mut Vec<Outcome>,
    ) -> Result<()> {
        outcomes.clear();
        // A batch retried one by one after a refused COMMIT emits its outcomes again from the start.
        let result = self.run(deliveries, handler, &mut |i, o| {
            outcomes.truncate(i);
            outcomes.push(o)
        });
        if result.is_err() {
            outcomes.clear();
        }
        result
    }

    /// What is durably recorded for an identity: used to settle an [`Error::CommitUnknown`], and by tools.
    pub fn status(
        &mut self,
        scope: &str,
        producer: Option<&str>,
        message_id: &str,
    ) -> Result<Status> {
        let id_hash = self.id_hash(producer, message_id);
        status_of(&self.conn, scope, &id_hash)
    }

    /// Records a delivery that could not be turned into a [`Delivery`] (no id, malformed envelope, over a
    /// limit) in the `quarantine` table, with its topic, reason and a bounded record of its payload (the first
    /// [`QUARANTINE_PREFIX`](crate::QUARANTINE_PREFIX) bytes, the full length and an xxh3-128 hash, never the
    /// whole payload), and counts it for `scope`. Once this returns `Ok` the delivery may be acked: it is kept for
    /// an operator, not lost. The reason is kept up to 1 KiB and the topic up to the topic limit (4 KiB at
    /// most): both may quote what a publisher sent.
    ///
    /// The same delivery arriving again (same scope, topic and payload: a redelivery after a lost PUBACK) adds an
    /// arrival to its record instead of a new one: `quarantined` counts arrivals, `quarantine_records` records
    /// ([`ScopeStats`](crate::ScopeStats)). Returns the record's row id (the same for every arrival).
    pub fn quarantine(
        &mut self,
        scope: &str,
        topic: &str,
        payload: &[u8],
        reason: &str,
    ) -> Result<i64> {
        let scope_id = self.scope_id(scope)?;
        let now = unix_now();
        begin(&self.conn)?;
        let record = Quarantine {
            scope_id,
            identity: None,
            topic,
            payload,
            reason,
            max_topic: self.config.limits.max_topic_len,
        };
        // The refresh reads the clock retention accepted, which the record's stamp is never before.
        let result = self.retention.refresh(&self.conn).and_then(|()| {
            Ok(records::quarantine(
                &self.conn,
                &self.conn.id_key,
                &record,
                now,
            )?)
        });
        match result {
            Ok((id, new)) => {
                commit(&self.conn)?;
                log_quarantine(topic, scope, reason, new);
                Ok(id)
            }
            Err(e) => {
                if !self.conn.is_autocommit() {
                    let _ = self.conn.execute_batch("ROLLBACK");
                }
                Err(e)
            }
        }
    }

    /// Quarantines a delivery whose identity is known but which cannot be applied (over a
    /// [`Limits`](crate::Limits), for example), like [`Inbox::quarantine`] (one bounded record per distinct
    /// identity and content, redeliveries counted as arrivals); in a scope with sequence watermarks a
    /// numbered delivery also claims its sequence in the same transaction, so one bad message leaves no gap
    /// that would turn every later sequence into a watermark exception.
    ///
    /// Returns the quarantine row id, or `None` when the sequence was already claimed by the same message
    /// (a redelivery of what was quarantined before: counted as a duplicate) or by the same id with other
    /// content (recorded as a conflict). Another message id on a claimed sequence is quarantined as a
    /// sequence conflict, as in [`Inbox::process`]. Once this returns `Ok` the delivery may be acked.
    pub fn quarantine_delivery(&mut self, d: &Delivery<'_>, reason: &str) -> Result<Option<i64>> {
        Ok(match self.quarantine_delivery_as(d, reason)? {
            Quarantined::Kept(id) => Some(id),
            Quarantined::Duplicate | Quarantined::Conflict => None,
        })
    }

    /// [`Inbox::quarantine_delivery`], telling a duplicate from a conflict.
    pub(crate) fn quarantine_delivery_as(
        &mut self,
        d: &Delivery<'_>,
        reason: &str,
    ) -> Result<Quarantined> {
        let scope_id = self.scope_id(d.scope)?;
        let now = unix_now();
        begin(&self.conn)?;
        let result = (|| -> Result<Result<(i64, bool), Quarantined>> {
            self.retention.refresh(&self.conn)?;
            let rules = self.retention.rules(scope_id);
            match claim_sequence(&self.conn, d, scope_id, rules, now)? {
                Some(Some(Outcome::Duplicate)) => {
                    self.conn.add_counts(scope_id, [0, 1, 0, 0])?;
                    return Ok(Err(Quarantined::Duplicate));
                }
                Some(Some(Outcome::Conflict { .. })) => {
                    self.conn.add_counts(scope_id, [0, 0, 1, 0])?;
                    return Ok(Err(Quarantined::Conflict));
                }
                Some(Some(Outcome::SequenceConflict { quarantined, .. })) => {
                    return Ok(Ok((quarantined, false)));
                }
                _ => {}
            }
            let id_hash = d.id_hash(&self.conn.id_key);
            let record = Quarantine {
                scope_id,
                identity: Some(&id_hash),
                topic: d.topic,
                payload: d.payload,
                reason,
                max_topic: self.config.limits.max_topic_len,
            };
            let (id, new) = records::quarantine(&self.conn, &self.conn.id_key, &record, now)?;
            Ok(Ok((id, new)))
        })();
        match result {
            Ok(kept) => {
                commit(&self.conn)?;
                Ok(match kept {
                    Ok((id, new)) => {
                        log_quarantine(d.topic, d.scope, reason, new);
                        Quarantined::Kept(id)
                    }
                    Err(settled) => settled,
                })
            }
            Err(e) => {
                if !self.conn.is_autocommit() {
                    let _ = self.conn.execute_batch("ROLLBACK");
                }
                Err(e)
            }
        }
    }

    /// Interned id of `scope`, creating it (in its own small transaction) on first use.
    pub fn scope_id(&mut self, scope: &str) -> Result<i64> {
        if let Some(id) = self.scopes.get(scope) {
            return Ok(*id);
        }
        if scope.is_empty() {
            return Err(crate::InvalidDelivery::EmptyScope.into());
        }
        let max = self.config.limits.max_scope_len;
        if scope.len() > max {
            let (field, len) = ("scope", scope.len());
            return Err(crate::InvalidDelivery::TooLong { field, len, max }.into());
        }
        let id = intern_scope(&self.conn, scope, unix_now())?;
        self.scopes.insert(scope.to_owned(), id);
        Ok(id)
    }

    fn run<H: Handler>(
        &mut self,
        deliveries: &[Delivery<'_>],
        handler: &mut H,
        emit: &mut dyn FnMut(usize, Outcome),
    ) -> Result<()> {
        // Every delivery is checked before any scope is written.
        for d in deliveries {
            d.validate(&self.config.limits)?;
        }
        for d in deliveries {
            // Interning happens outside the batch transaction: a rollback must not leave a cached id behind.
            self.scope_id(d.scope)?;
        }
        if deliveries.is_empty() {
            return Ok(());
        }
        match self.run_transaction(deliveries, handler, emit) {
            Err(Error::CommitRefused { code, .. }) if deliveries.len() > 1 => {
                // Some handler's writes broke a deferred constraint, which SQLite checks only at COMMIT.
                // Nothing was committed; find the delivery at fault by giving each its own transaction.
                log::warn!(
                    "batch COMMIT refused (SQLite code {code}); retrying its deliveries one by one"
                );
                for (i, d) in deliveries.iter().enumerate() {
                    self.run(std::slice::from_ref(d), handler, &mut |_, o| emit(i, o))?;
                }
                Ok(())
            }
            Err(Error::CommitRefused { code, source }) => {
                // The effect was refused as a whole, like a handler error: rolled back with its identity.
                let d = &deliveries[0];
                let scope_id = self.scopes[d.scope];
                begin(&self.conn)?;
                let counted = flush_counts(
                    &self.conn,
                    &[Counts {
                        scope_id,
                        handler_failures: 1,
                        ..Counts::default()
                    }],
                )
                .and_then(|()| commit(&self.conn));
                if counted.is_err() && !self.conn.is_autocommit() {
                    let _ = self.conn.execute_batch("ROLLBACK");
                }
                counted?;
                let err = anyhow::Error::new(source).context(format!(
                    "COMMIT refused by a deferred constraint (SQLite code {code})"
                ));
                emit(0, Outcome::HandlerFailed(err));
                Ok(())
            }
            other => other,
        }
    }

    /// One transaction over the whole batch: identities, handlers, counters, commit.
    fn run_transaction<H: Handler>(
        &mut self,
        deliveries: &[Delivery<'_>],
        handler: &mut H,
        emit: &mut dyn FnMut(usize, Outcome),
    ) -> Result<()> {
        let now = unix_now();
        self.counts.clear();
        begin(&self.conn)?;
        // Per-scope retention rules, reloaded only if another connection committed since the last look.
        let applied = self
            .retention
            .refresh(&self.conn)
            .and_then(|()| self.apply_all(deliveries, handler, now, emit));
        let result = applied
            .and_then(|()| flush_counts(&self.conn, &self.counts))
            .and_then(|()| commit(&self.conn));
        if result.is_err() && !self.conn.is_autocommit() {
            // Best effort: if even ROLLBACK fails, the next `begin` rolls back before anything else;
            // nothing uncommitted is ever reported as done.
            let _ = self.conn.execute_batch("ROLLBACK");
        }
        result
    }

    fn apply_all<H: Handler>(
        &mut self,
        deliveries: &[Delivery<'_>],
        handler: &mut H,
        now: i64,
        emit: &mut dyn FnMut(usize, Outcome),
    ) -> Result<()> {
        let failure = Cell::new(None);
        // A batch of one needs no savepoint: its handler failing rolls back the whole transaction.
        let alone = deliveries.len() == 1;
        for (i, d) in deliveries.iter().enumerate() {
            let scope_id = self.scopes[d.scope];
            let rules = self.retention.rules(scope_id);
            let (outcome, row_counts) = apply_one(
                &self.conn, d, scope_id, rules, now, handler, &self.buf, &failure, alone,
            )?;
            let counts = match self.counts.iter_mut().find(|c| c.scope_id == scope_id) {
                Some(c) => c,
                None => {
                    self.counts.push(Counts {
                        scope_id,
                        ..Counts::default()
                    });
                    self.counts.last_mut().expect("just pushed")
                }
            };
            match outcome {
                // A new identity row is its own count (see `schema.sql`): one page fewer per commit.
                Outcome::Processed if row_counts => {}
                Outcome::Processed => counts.processed += 1,
                Outcome::Duplicate => counts.duplicates += 1,
                Outcome::Conflict { .. } => counts.conflicts += 1,
                Outcome::HandlerFailed(_) => counts.handler_failures += 1,
                // Only the receive path yields it; the strong case never does.
                Outcome::Received => {}
                Outcome::Expired { .. } => {} // counted by the retention module when it flagged it
                Outcome::SequenceConflict { .. } => {} // counted by the watermark module
            }
            emit(i, outcome);
        }
        Ok(())
    }
}

fn flush_counts(conn: &Db, counts: &[Counts]) -> Result<()> {
    for c in counts {
        if c.processed == 0 && c.duplicates == 0 && c.conflicts == 0 && c.handler_failures == 0 {
            continue;
        }
        conn.add_counts(
            c.scope_id,
            [c.processed, c.duplicates, c.conflicts, c.handler_failures],
        )?;
    }
    Ok(())
}

/// One delivery inside the open transaction: in its own savepoint, or (`alone`, the only delivery of its
/// transaction) without one, a failing handler then rolling back the whole transaction and starting a new one
/// for the counters. The flag is true when a new identity row counts the delivery (see `schema.sql`).
#[allow(clippy::too_many_arguments)]
fn apply_one<H: Handler>(
    conn: &Db,
    d: &Delivery<'_>,
    scope_id: i64,
    rules: &ScopeRules,
    now: i64,
    handler: &mut H,
    buf: &RefCell<Vec<u8>>,
    failure: &Cell<Option<i32>>,
    alone: bool,
) -> Result<(Outcome, bool)> {
    if !alone {
        conn.savepoint()?;
    }
    let claim = match claim_identity(conn, d, scope_id, rules, now)? {
        Claim::Settled(outcome) => {
            if !alone {
                release(conn)?;
            }
            return Ok((outcome, false));
        }
        claim => claim,
    };

    match run_handler(conn, d, scope_id, now, handler, buf, failure)? {
        Ok(()) => {
            if !alone {
                release(conn)?;
            }
            Ok((Outcome::Processed, matches!(claim, Claim::Row)))
        }
        Err(err) => {
            if alone {
                // Identity and effect go together; the failure is counted in a transaction of its own.
                conn.execute_batch("ROLLBACK")?;
                begin(conn)?;
            } else {
                conn.rollback_to()?;
                release(conn)?;
            }
            log::debug!("handler failed for {}/{}: {err:#}", d.scope, d.message_id);
            Ok((Outcome::HandlerFailed(err), false))
        }
    }
}

/// Rolls the inbox's transaction back when a handler panics through it: an application that catches the panic
/// must not find the half-written transaction open (a read through the same inbox would see it, and it would
/// hold the write lock from every other connection until the inbox's next call).
struct RollBackIfUnwinding<'a>(&'a Db);

impl Drop for RollBackIfUnwinding<'_> {
    fn drop(&mut self) {
        if !self.0.is_autocommit() {
            let _ = self.0.execute_batch("ROLLBACK");
        }
    }
}

/// Runs `handler` on `d` inside the open savepoint and sorts what it returned. Storage trouble of the inbox's own
/// connection fails the whole transaction (`Err`): met through the inbox's API (even if the handler swallowed
/// the error), returned by the handler after it met it on the connection through [`Tx::sql`] (see
/// [`own_storage_failure`]), SQLite or the handler ended the transaction (the connection's own storage code
/// when SQLite did, an interrupt excepted), or met on the connection and not returned; checked in that order,
/// since a full disk makes SQLite roll back by itself. Otherwise
/// `Ok` carries the handler's own verdict: any error it returned, a storage error of some other database it
/// opened itself included, is a handler failure (attempts, then a dead letter), never the inbox's trouble.
pub(crate) fn run_handler<H: Handler>(
    conn: &Db,
    d: &Delivery<'_>,
    scope_id: i64,
    now: i64,
    handler: &mut H,
    buf: &RefCell<Vec<u8>>,
    failure: &Cell<Option<i32>>,
) -> Result<anyhow::Result<()>> {
    failure.set(None);
    let mut tx =
        Tx::new(conn, d.scope, scope_id, now, buf, failure).with_origin(d.producer, d.message_id);
    // Refuses any commit while the handler runs (see the crate guide, "Handlers and state").
    let armed = conn.arm_handler_guard();
    let unwinding = RollBackIfUnwinding(conn);
    let result = handler(&mut tx, d);
    std::mem::forget(unwinding);
    drop(armed);
    let replaced = conn.handler_replaced_guard();
    if replaced || conn.handler_tx_ended() {
        conn.distrust_settings();
    }
    if replaced {
        log::error!(
            "the handler for {}/{} replaced the connection's commit or rollback hook, which the inbox reserves: \
             failing the call (what the handler committed on its own, if anything, cannot be undone)",
            d.scope,
            d.message_id
        );
        return Err(Error::HandlerEndedTransaction);
    }
    if let Some(code) = failure.get() {
        // A statement through `Tx` the handler interrupted itself: a write, which ended the transaction, as
        // below; a read, its own failure whatever it returned, as it may have gone on without the value.
        if is_interrupt(code) {
            if conn.handler_tx_ended() {
                return Err(Error::HandlerEndedTransaction);
            }
            return Ok(Err(anyhow::Error::new(storage_error(code)).context(
                "a read through the inbox was interrupted by the handler",
            )));
        }
        return Err(storage_error(code));
    }
    // An interrupt comes from the handler (the inbox never interrupts): of a read, the transaction is whole
    // and the handler's verdict stands; of a write, SQLite ended the transaction (below).
    let own = own_storage_failure(conn).filter(|c| !is_interrupt(*c));
    // The handler returned the inbox connection's own failure (wrapped or not): that error, as before a
    // rollback it may have caused is reported, so a full disk stays `DiskFull` (retryable).
    if let (Some(own), Err(e)) = (own, &result) {
        if let Some(code) = storage_code_in(e).filter(|c| c & 0xff == own & 0xff) {
            return Err(storage_error(code));
        }
    }
    if conn.handler_tx_ended() {
        // SQLite rolls the whole transaction back by itself on a full disk, an I/O error or NOMEM: that is the
        // inbox's storage trouble (retryable, never acked), even when the handler swallowed it. An interrupt
        // (or a rollback the handler asked for) is the handler ending the transaction.
        return Err(match own {
            Some(code) => storage_error(code),
            None => Error::HandlerEndedTransaction,
        });
    }
    // Met on the inbox connection and swallowed (or another error returned): the transaction is not whole.
    if let Some(code) = own {
        return Err(storage_error(code));
    }
    Ok(result)
}

/// The first storage failure code in a handler error's chain (a rusqlite error, or an inbox [`Error`]).
fn storage_code_in(err: &anyhow::Error) -> Option<i32> {
    err.chain().find_map(|cause| {
        let code = match cause.downcast_ref::<rusqlite::Error>() {
            Some(rusqlite::Error::SqliteFailure(e, _)) => Some(e.extended_code),
            Some(_) => None,
            None => cause.downcast_ref::<Error>().and_then(Error::sqlite_code),
        };
        code.filter(|c| is_storage_failure(*c))
    })
}

/// Claims the sequence of a numbered delivery in a scope with sequence watermarks, inside the caller's open
/// transaction (see [`crate::retention::watermark::claim`]). `None`: not such a delivery (no producer or
/// sequence, watermarks off, or outside the watermark's range: below `first`, above i64::MAX), identity rows
/// apply as usual.
fn claim_sequence(
    conn: &Db,
    d: &Delivery<'_>,
    scope_id: i64,
    rules: &ScopeRules,
    now: i64,
) -> Result<Option<Option<Outcome>>> {
    let (Some(first), Some(producer), Some(seq)) =
        (rules.watermark_first(), d.producer, d.sequence)
    else {
        return Ok(None);
    };
    if seq < first || seq > i64::MAX as u64 {
        return Ok(None);
    }
    let claim = crate::retention::watermark::Claim {
        scope_id,
        producer,
        sequence: seq,
        first: first as i64,
        id_hash: d.id_hash(&conn.id_key),
        fingerprint: d.fingerprint(),
    };
    crate::retention::watermark::claim(conn, &claim, d, now).map(Some)
}

/// Logs a quarantined arrival: a warning for a new record, a debug line for a repeat (a redelivery must not
/// flood the log).
fn log_quarantine(topic: &str, scope: &str, reason: &str, new: bool) {
    if new {
        log::warn!("quarantined a delivery on topic {topic:?} for scope {scope}: {reason}");
    } else {
        log::debug!(
            "quarantined delivery on topic {topic:?} for scope {scope} arrived again: {reason}"
        );
    }
}

/// What [`Inbox::quarantine_delivery_as`] did with a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Quarantined {
    /// Kept in quarantine: the record's row id.
    Kept(i64),
    /// Its sequence was claimed by this same message, with the same content, before.
    Duplicate,
    /// Its sequence was claimed by this same message id with other content: recorded as a conflict.
    Conflict,
}

/// How [`claim_identity`] settled a delivery.
#[derive(Debug)]
pub(crate) enum Claim {
    /// New: its identity row is inserted (it commits or aborts with the caller's transaction).
    Row,
    /// New: its sequence is claimed in the producer's watermark; no identity row.
    Sequence,
    /// Not new, or not to be applied: the outcome says why.
    Settled(Outcome),
}

impl Claim {
    /// The identity rows this claim added, for `scope_stats.identity_offset` (see `schema.sql`): a writer
    /// other than the strong case adds them to the offset, so they do not count as processed.
    pub(crate) fn rows(&self) -> i64 {
        i64::from(matches!(self, Claim::Row))
    }
}

/// Inserts the identity of `d`, inside the caller's open transaction. [`Claim::Row`] or [`Claim::Sequence`]:
/// the identity is new and now claimed (it commits or aborts with the caller's transaction).
/// [`Claim::Settled`]: it already existed, and the outcome says whether as a duplicate or a (now recorded)
/// conflict; or ([`Outcome::Expired`]) it is not found but older than the scope's pruned identity horizon, and
/// was not claimed. The primary key decides, never a prior query.
///
/// `rules` are the scope's cached retention rules ([`RetentionState::rules`], refreshed inside the same write
/// transaction). A scope with sequence watermarks records numbered deliveries as watermarks, not identity rows.
pub(crate) fn claim_identity(
    conn: &Db,
    d: &Delivery<'_>,
    scope_id: i64,
    rules: &ScopeRules,
    now: i64,
) -> Result<Claim> {
    if retention::sent_before_horizon(d, rules) {
        if let Some(claim) = claim_old_sequence(conn, d, scope_id, rules, now)? {
            return numbered_claim_seen_unnumbered(conn, d, scope_id, claim, now);
        }
    } else if let Some(claimed) = claim_sequence(conn, d, scope_id, rules, now)? {
        let claim = match claimed {
            None => Claim::Sequence,
            Some(outcome) => Claim::Settled(outcome),
        };
        return numbered_claim_seen_unnumbered(conn, d, scope_id, claim, now);
    }
    let id_hash = d.id_hash(&conn.id_key);
    let fingerprint = d.fingerprint();
    // In a scope with sequence watermarks the same message may arrive numbered and not (a bridge that drops
    // the sequence, a replay): its numbered arrivals are remembered in the window, not as identity rows.
    if rules.watermark_first().is_some() {
        let numbered: Option<i64> = conn
            .prepare_cached(
                "SELECT fingerprint FROM watermark_recent WHERE scope_id = ?1 AND id_hash = ?2",
            )?
            .query_row((scope_id, id_hash.as_bytes()), |r| r.get(0))
            .optional()?;
        if let Some(stored) = numbered {
            let stored = Fingerprint::from_sql(stored);
            return existing_as(conn, d, scope_id, &id_hash, fingerprint, stored, now)
                .map(Claim::Settled);
        }
    }
    let inserted = conn.insert_identity(
        scope_id,
        id_hash.as_bytes(),
        fingerprint.to_sql(),
        stored_day(conn, now, d.sent_at),
    );
    // The primary key arbitrates: `ON CONFLICT DO NOTHING` changes no row when the identity exists, and
    // saves building an error (and its message) on the duplicate path.
    match inserted? {
        0 => existing(conn, d, scope_id, &id_hash, fingerprint, now).map(Claim::Settled),
        _ => Ok(
            match retention::check_new_identity(conn, d, &id_hash, scope_id, now, rules)? {
                None => Claim::Row,
                // Its claim was undone: no row.
                Some(outcome) => Claim::Settled(outcome),
            },
        ),
    }
}

/// [`claim_sequence`] for a delivery sent before what the scope's horizon pruned: a new sequence meets the
/// expired rule as a new identity row does. Its claim is kept whatever the policy, as a quarantined numbered
/// delivery's is ([`Inbox::quarantine_delivery_as`]): undone, it would leave a gap in the producer's
/// watermark that its redeliveries (expired again) never close, and every later sequence would be kept as an
/// exception for good. A redelivery is then compared with it (a duplicate, or a conflict). `None`: not a
/// numbered delivery of a watermark scope.
#[cold]
fn claim_old_sequence(
    conn: &Db,
    d: &Delivery<'_>,
    scope_id: i64,
    rules: &ScopeRules,
    now: i64,
) -> Result<Option<Claim>> {
    conn.savepoint()?;
    let claimed = claim_sequence(conn, d, scope_id, rules, now)?;
    let claim = match claimed {
        None => None,
        Some(Some(outcome)) => Some(Claim::Settled(outcome)),
        Some(None) if retention::processes_expired(rules) => {
            // Counted and logged; applied by policy.
            retention::check_new_sequence(conn, d, scope_id, now, rules)?;
            Some(Claim::Sequence)
        }
        Some(None) => {
            let outcome = retention::check_new_sequence(conn, d, scope_id, now, rules)?
                .expect("sent before the horizon and not processed by policy");
            Some(Claim::Settled(outcome))
        }
    };
    conn.release()?;
    Ok(claim)
}

/// The time an identity row keeps: whole days since the Unix epoch (enough for retention, and it keeps the
/// row small).
pub(crate) fn identity_day(unix_seconds: i64) -> i64 {
    unix_seconds.div_euclid(86_400)
}

/// The `day` column of a new identity: its commit day, or `-1 - day` for a delivery that carried no send time
/// ([`Delivery::sent_at`]). The identity horizon never prunes the latter: once its identity was gone, a
/// repetition of it could not be told from a new message (nothing would say it is older than the horizon).
///
/// The commit day is never before the latest clock reading retention accepted (`clock_seen`, cached on
/// `conn` by the retention refresh of the same transaction): a commit clock running behind would date the
/// identity too early and the horizon would delete it early; so a wrong clock can only keep it longer.
///
/// Nor is a dated identity's day before its send time (`sent_at`): a repetition is known to be older than
/// what the horizon pruned by its send time, so an identity sent ahead of the gateway's clock (a
/// producer's clock running ahead by more than the allowed skew) must be kept until a horizon after that
/// time, or its repetitions could never be told apart from new messages once it was pruned.
pub(crate) fn stored_day(conn: &Db, unix_seconds: i64, sent_at: Option<i64>) -> i64 {
    let at = unix_seconds.max(conn.clock_seen.get());
    match sent_at {
        Some(sent) => identity_day(at.max(sent)),
        None => -1 - identity_day(at),
    }
}

/// The commit day of a stored `day` column (see [`stored_day`]).
pub(crate) fn commit_day(stored: i64) -> i64 {
    if stored < 0 {
        -1 - stored
    } else {
        stored
    }
}

/// A numbered delivery whose sequence was just claimed as new, in a scope with sequence watermarks: the same
/// message may have arrived before without its number, as an identity row. Then it is not new: a duplicate
/// if the content matches, else a recorded conflict; the claimed sequence keeps the stored content's
/// fingerprint, so that its next arrival compares against what was committed.
fn numbered_claim_seen_unnumbered(
    conn: &Db,
    d: &Delivery<'_>,
    scope_id: i64,
    claim: Claim,
    now: i64,
) -> Result<Claim> {
    if !matches!(claim, Claim::Sequence) {
        return Ok(claim);
    }
    let id_hash = d.id_hash(&conn.id_key);
    let Some(stored) = conn
        .stored_fingerprint(scope_id, id_hash.as_bytes())
        .optional()?
    else {
        return Ok(claim);
    };
    let stored = Fingerprint::from_sql(stored);
    let outcome = existing_as(conn, d, scope_id, &id_hash, d.fingerprint(), stored, now)?;
    if matches!(outcome, Outcome::Conflict { .. }) {
        keep_stored_fingerprint(conn, scope_id, &id_hash, stored)?;
    }
    Ok(Claim::Settled(outcome))
}

/// After a conflict found across two records of one identity: the record the delivery's claim just added
/// (an identity row, or its sequence in the watermark window) takes the fingerprint of what was committed,
/// so that the next arrival of either content compares against that.
pub(crate) fn keep_stored_fingerprint(
    conn: &Db,
    scope_id: i64,
    id_hash: &IdHash,
    stored: Fingerprint,
) -> Result<()> {
    for table in ["identities", "watermark_recent"] {
        conn.prepare_cached(&format!(
            "UPDATE {table} SET fingerprint = ?3 WHERE scope_id = ?1 AND id_hash = ?2"
        ))?
        .execute((scope_id, id_hash.as_bytes(), stored.to_sql()))?;
    }
    Ok(())
}

/// The identity exists: a duplicate if the content matches, else a recorded conflict.
fn existing(
    conn: &Db,
    d: &Delivery<'_>,
    scope_id: i64,
    id_hash: &IdHash,
    received: Fingerprint,
    now: i64,
) -> Result<Outcome> {
    let stored = conn.stored_fingerprint(scope_id, id_hash.as_bytes())?;
    existing_as(
        conn,
        d,
        scope_id,
        id_hash,
        received,
        Fingerprint::from_sql(stored),
        now,
    )
}

/// [`existing`] with the stored content's fingerprint already read.
pub(crate) fn existing_as(
    conn: &Db,
    d: &Delivery<'_>,
    scope_id: i64,
    id_hash: &IdHash,
    received: Fingerprint,
    stored: Fingerprint,
    now: i64,
) -> Result<Outcome> {
    if stored == received {
        return Ok(Outcome::Duplicate);
    }
    let new = records::conflict(
        conn,
        &records::Conflict {
            scope_id,
            id_hash,
            producer: d.producer,
            message_id: d.message_id,
            topic: d.topic,
            stored,
            received,
        },
        now,
    )?;
    if !new {
        log::debug!(
            "conflict in scope {} for message id {:?} (producer {:?}) arrived again; counted on its record",
            d.scope,
            d.message_id,
            d.producer
        );
        return Ok(Outcome::Conflict { stored, received });
    }
    log::warn!(
        "conflict in scope {}: message id {:?} (producer {:?}) arrived with fingerprint {received}, \
         committed with {stored}; recorded, not applied",
        d.scope,
        d.message_id,
        d.producer
    );
    Ok(Outcome::Conflict { stored, received })
}

/// The storage failure the inbox's own connection met last, if its most recent call failed with one.
///
/// A handler's error value cannot say which connection produced it: a lookup database the handler opens itself
/// fails with the same `SQLITE_CANTOPEN` or `SQLITE_IOERR` as the inbox's file would, and taking that for the
/// inbox's trouble retried the delivery for ever. So the connection is asked instead of the error: SQLite keeps,
/// per connection, the extended result code of its most recent statement step or call
/// (`sqlite3_extended_errcode`), and every step sets it, to `SQLITE_ROW`/`SQLITE_DONE` on success. Read right
/// after the handler returns, it holds a storage code only if the last thing run on the inbox's connection (a
/// statement through [`Tx::sql`], typically) failed with one, whatever the handler then returned, a swallowed
/// error or `Ok` included: such a transaction must not commit. A failure on another connection never touches
/// it. Not seen here: trouble met on the inbox's connection by a statement after which the handler ran another
/// one that succeeded; the inbox's API calls record theirs in the transaction's `failure` cell, a failure that
/// ended the transaction is caught by `handler_tx_ended`, and trouble that persists fails the inbox's own next
/// statements (the rollback, the failure count, the commit).
fn own_storage_failure(conn: &Connection) -> Option<i32> {
    // SAFETY: the handle is this open connection's; reading its error code has no side effect.
    let code = unsafe { rusqlite::ffi::sqlite3_extended_errcode(conn.handle()) };
    is_storage_failure(code).then_some(code)
}

pub(crate) fn intern_scope(conn: &Db, scope: &str, now: i64) -> Result<i64> {
    begin(conn)?;
    let result = (|| -> rusqlite::Result<i64> {
        conn.execute(
            "INSERT OR IGNORE INTO scopes (name, created_at) VALUES (?1, ?2)",
            (scope, now),
        )?;
        let id: i64 = conn.query_row("SELECT id FROM scopes WHERE name = ?1", [scope], |r| {
            r.get(0)
        })?;
        conn.execute(
            "INSERT OR IGNORE INTO scope_stats (scope_id) VALUES (?1)",
            [id],
        )?;
        Ok(id)
    })();
    match result {
        Ok(id) => commit(conn).map(|()| id),
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            Err(e.into())
        }
    }
}

/// Identity lookup shared by [`Inbox::status`] and read-only tools, under the database's own key.
pub(crate) fn status(
    conn: &Connection,
    scope: &str,
    producer: Option<&str>,
    message_id: &str,
) -> Result<Status> {
    let id_hash = IdHash::keyed(&schema::id_key(conn)?, producer, message_id);
    status_of(conn, scope, &id_hash)
}

fn status_of(conn: &Connection, scope: &str, id_hash: &IdHash) -> Result<Status> {
    let row = conn
        .prepare_cached(
            "SELECT i.fingerprint, (CASE WHEN i.day < 0 THEN -1 - i.day ELSE i.day END) * 86400, m.state FROM identities i JOIN scopes s ON s.id = i.scope_id \
             LEFT JOIN messages m ON m.scope_id = i.scope_id AND m.id_hash = i.id_hash AND m.state IN (0, 2, 3) \
             WHERE s.name = ?1 AND i.id_hash = ?2",
        )?
        .query_row((scope, id_hash.as_bytes()), |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?, r.get::<_, Option<i64>>(2)?))
        })
        .optional()?;
    Ok(match row {
        None => Status::NotFound,
        Some((fp, at, state)) => Status::Recorded {
            fingerprint: Fingerprint::from_sql(fp),
            at,
            state: state.and_then(MessageState::from_sql),
        },
    })
}
