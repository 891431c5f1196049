//! Received-then-deferred mode, processing side: claim pending messages with a lease, apply each in a
//! strong-case transaction, retry with backoff, dead-letter after the last attempt.
//!
//! A claim is one `UPDATE ... RETURNING` inside `BEGIN IMMEDIATE`: it sets the lease owner, the lease expiry
//! and bumps `claims`, whose new value is the token of this one claim. The commit that applies the effect
//! first re-checks, in the same transaction, that the row is still open, still leased to this worker with this
//! token, and that the lease has not expired; otherwise the effect is not run and nothing is committed for it.
//! The write lock makes check and commit one step, so a message's effect commits at most once, and a worker that
//! dies leaves a lease that expires and is claimed again: at least once. Together: exactly once in effect.
//!
//! Per order key, the claim takes a message only when no earlier one of its key is open, and the commit
//! checks that again: a dead letter requeued while a later message of its key is leased is open and earlier,
//! so the later one gives its lease back instead of being applied first, and is claimed again after it.
//!
//! The claim transaction commits without an fsync of its own (`synchronous=NORMAL` for that one transaction):
//! a claim lost to a power cut only makes its messages claimable again, and the next durable commit on the file
//! syncs the claim's WAL frames with its own. This saves one of the two fsyncs per batch.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rusqlite::Connection;

use crate::inbox::{run_handler, Handler, Inbox};
use crate::store::config::Config;
use crate::store::db::Db;
use crate::store::error::{Error, Result};
use crate::store::identity::{Delivery, Fingerprint, IdHash};
use crate::store::txn::unix_now_ms;
use crate::store::txn::{begin, commit, release};

/// Longest `last_error` text kept per message.
const MAX_ERROR_LEN: usize = 2048;

/// How long a worker leaves the write lock free after a transaction that used its whole
/// [`WorkerConfig::lock_budget`]. A waiting writer on an inbox connection (a receiving consumer) polls the
/// lock in sleeps of 25 µs doubling up to 1 ms (the busy handler in `store/schema.rs`), so it needs only
/// about a millisecond; the gap is longer because a writer on the file through SQLite's own busy timeout
/// (the `sqlite3` shell, another program) sleeps up to 100 ms between tries, and a gap shorter than that
/// could fall between two of them every time and starve it.
const LOCK_YIELD: Duration = Duration::from_millis(120);

/// Settings of a [`Worker`]. Start from [`WorkerConfig::default`] and change what you need.
///
/// ```
/// use edge_inbox::WorkerConfig;
/// use std::time::Duration;
/// let config = WorkerConfig::default().lease(Duration::from_secs(60)).max_attempts(8).batch(32);
/// assert_eq!(config.get_max_attempts(), 8);
/// ```
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    lease: Duration,
    batch: usize,
    max_attempts: u32,
    backoff_base: Duration,
    backoff_max: Duration,
    idle_wait: Duration,
    lock_budget: Duration,
    owner: Option<String>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            lease: Duration::from_secs(30),
            batch: 16,
            max_attempts: 5,
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            idle_wait: Duration::from_millis(100),
            lock_budget: Duration::from_millis(100),
            owner: None,
        }
    }
}

impl WorkerConfig {
    /// How long a claim is exclusive. It must comfortably exceed the time to process one claimed batch (with
    /// slow handlers, including the pauses after each transaction that used its
    /// [`lock_budget`](WorkerConfig::lock_budget), about a tenth of a second each): a
    /// worker that overruns its lease has its commit refused ([`Completion::LeaseLost`]) and the work is
    /// redone by whoever claims the message next. Default 30 s.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Most messages claimed and applied per transaction (group commit). Default 16; at least 1.
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// Handler failures after which a message is dead-lettered. Default 5; at least 1.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Exponential backoff between attempts: after the n-th failure the message waits
    /// `base * 2^(n-1)`, capped at `max`. Defaults 1 s and 5 min.
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_max = max.max(base);
        self
    }

    /// Longest time [`Worker::run_once`] (and so [`Worker::run_until`]) keeps running handlers in one apply
    /// transaction, which holds the database's write lock. Once it is used up, the claims done so far commit
    /// and the rest of the batch follows in further transactions (each runs at least one handler, so a
    /// transaction holds the lock for at most the budget plus one handler's run). After such a transaction
    /// the worker leaves the lock free for a moment before its next write, so that a consumer receiving on the
    /// same file (`Consumer::receive_only`, [`Inbox::receive`]) gets its turn instead of running into its busy
    /// timeout. Default 100 ms.
    pub fn lock_budget(mut self, budget: Duration) -> Self {
        self.lock_budget = budget;
        self
    }

    /// How long [`Worker::run_until`] sleeps when nothing is claimable. Default 100 ms.
    pub fn idle_wait(mut self, wait: Duration) -> Self {
        self.idle_wait = wait;
        self
    }

    /// Name written as `lease_owner` (for operators). Default: `worker-<pid>-<n>`. Safety never depends on
    /// it being unique: every claim also carries its own token.
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = Some(owner.into());
        self
    }

    /// The configured lease.
    pub fn get_lease(&self) -> Duration {
        self.lease
    }

    /// The configured lock budget per apply transaction.
    pub fn get_lock_budget(&self) -> Duration {
        self.lock_budget
    }

    /// The configured batch size.
    pub fn get_batch(&self) -> usize {
        self.batch
    }

    /// The configured maximum number of attempts.
    pub fn get_max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Delay before the next attempt after `failures` handler failures.
    pub fn backoff_after(&self, failures: u32) -> Duration {
        let shift = failures.saturating_sub(1).min(30);
        self.backoff_base
            .saturating_mul(1 << shift)
            .min(self.backoff_max)
    }
}

/// One message claimed by a [`Worker`]: a copy of the stored delivery and the token of the claim.
#[derive(Debug, Clone)]
pub struct Claim {
    seq: i64,
    token: i64,
    attempts: u32,
    id_hash: IdHash,
    producer: Option<String>,
    message_id: String,
    topic: String,
    payload: Vec<u8>,
    sequence: Option<u64>,
    sent_at: Option<i64>,
}

impl Claim {
    /// Row id of the message (`messages.seq`): arrival order.
    pub fn seq(&self) -> i64 {
        self.seq
    }

    /// Handler failures recorded for the message before this claim.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The application message id.
    pub fn message_id(&self) -> &str {
        &self.message_id
    }

    /// The stored delivery, as the handler sees it.
    pub fn delivery<'a>(&'a self, scope: &'a str) -> Delivery<'a> {
        let mut d = Delivery::new(scope, &self.message_id, &self.topic, &self.payload);
        d.producer = self.producer.as_deref();
        d.sequence = self.sequence;
        d.sent_at = self.sent_at;
        d
    }
}

/// What became of one claimed message in [`Worker::complete`].
#[derive(Debug)]
#[non_exhaustive]
pub enum Completion {
    /// The effect and the state `processed` committed together.
    Processed,
    /// The handler failed; its effect was rolled back and the message waits for another attempt.
    Retrying {
        /// The handler's error (also stored, as text, in `messages.last_error`).
        error: anyhow::Error,
        /// Handler failures so far, this one included.
        attempts: u32,
        /// Delay before the message may be claimed again.
        retry_in: Duration,
    },
    /// The handler failed for the last allowed time: the message is dead-lettered, kept for an operator.
    DeadLettered {
        /// The handler's error (also stored in `messages.last_error`).
        error: anyhow::Error,
        /// Handler failures, this one included.
        attempts: u32,
    },
    /// The lease expired or was taken over by another worker before this commit: nothing ran, nothing was
    /// committed for this message (whoever holds it now will apply it). Also when an earlier message of its
    /// order key became open again meanwhile (a requeued dead letter): the lease is given back and the
    /// message is claimed again once that one is done.
    LeaseLost,
}

/// Counts of what a worker did, from [`Worker::run_once`] and [`Worker::run_until`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Drained {
    /// Messages claimed.
    pub claimed: usize,
    /// Messages whose effect committed.
    pub processed: usize,
    /// Handler failures that left the message waiting for a retry.
    pub retrying: usize,
    /// Messages dead-lettered.
    pub dead_lettered: usize,
    /// Claims found lost at commit time.
    pub lease_lost: usize,
}

impl Drained {
    fn add(&mut self, other: Drained) {
        self.claimed += other.claimed;
        self.processed += other.processed;
        self.retrying += other.retrying;
        self.dead_lettered += other.dead_lettered;
        self.lease_lost += other.lease_lost;
    }
}

/// Applies the pending messages of one scope. Plain synchronous code: run one per thread, or one per process;
/// any number of workers may share a file.
///
/// ```
/// use edge_inbox::{Config, Delivery, Inbox, Worker, WorkerConfig};
///
/// # fn main() -> anyhow::Result<()> {
/// let dir = tempfile::tempdir()?;
/// let path = dir.path().join("inbox.db");
/// let mut inbox = Inbox::open(&path, Config::default())?;
/// inbox.receive(&Delivery::new("counter", "evt-1", "t", b"1"))?; // now the broker may be acked
///
/// let mut worker = Worker::open(&path, Config::default(), "counter", WorkerConfig::default())?;
/// let drained = worker.run_once(&mut |tx: &mut edge_inbox::Tx<'_>, _d: &Delivery<'_>| {
///     let n: i64 = tx.get("n")?.unwrap_or(0);
///     tx.put("n", &(n + 1))?;
///     Ok(())
/// })?;
/// assert_eq!(drained.processed, 1);
/// # Ok(()) }
/// ```
pub struct Worker {
    inbox: Inbox,
    scope: String,
    scope_id: i64,
    owner: String,
    config: WorkerConfig,
    /// After an apply transaction that used its whole lock budget: no write transaction before this instant.
    lock_free_until: Option<Instant>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("scope", &self.scope)
            .field("owner", &self.owner)
            .finish()
    }
}

static WORKERS: AtomicU64 = AtomicU64::new(0);

impl Worker {
    /// A worker for the pending messages of `scope`, on its own connection `inbox`.
    pub fn new(mut inbox: Inbox, scope: &str, config: WorkerConfig) -> Result<Worker> {
        let scope_id = inbox.scope_id(scope)?;
        let owner = config.owner.clone().unwrap_or_else(|| {
            format!(
                "worker-{}-{}",
                std::process::id(),
                WORKERS.fetch_add(1, Ordering::Relaxed)
            )
        });
        Ok(Worker {
            inbox,
            scope: scope.to_owned(),
            scope_id,
            owner,
            config,
            lock_free_until: None,
        })
    }

    /// Opens its own connection to the inbox at `path` and makes a worker for `scope`.
    pub fn open(
        path: impl AsRef<std::path::Path>,
        inbox_config: Config,
        scope: &str,
        config: WorkerConfig,
    ) -> Result<Worker> {
        Worker::new(Inbox::open(path, inbox_config)?, scope, config)
    }

    /// The scope this worker drains.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The `lease_owner` name of this worker.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The worker's connection (for reads, [`Inbox::backlog`], requeues).
    pub fn inbox(&mut self) -> &mut Inbox {
        &mut self.inbox
    }

    /// Claims up to `max` claimable messages, oldest first: open (pending, or failed with its backoff over),
    /// not under a live lease, and, for an order key, with no earlier open message of the same key.
    /// One `BEGIN IMMEDIATE` transaction running one `UPDATE ... RETURNING`.
    pub fn claim(&mut self, max: usize) -> Result<Vec<Claim>> {
        let mut claims = Vec::new();
        if max == 0 {
            return Ok(claims);
        }
        self.yield_lock();
        let conn = &self.inbox.conn;
        abandon_leftover(conn);
        // A claim need not survive a power cut: lost, it only makes its messages claimable again, and the
        // apply transaction's fsync covers the claim's WAL frames anyway. So it commits without an fsync of its
        // own; the next transaction on this connection is put back at the configured level (and checked).
        conn.start_relaxed();
        let result = claim_rows(
            conn,
            &self.owner,
            &self.config,
            self.scope_id,
            max,
            &mut claims,
        );
        let restored = conn.end_relaxed();
        result?;
        // Never go on with a connection whose commits would not be durable (the claims expire unused).
        restored?;
        // RETURNING order is unspecified; handlers see arrival order.
        claims.sort_unstable_by_key(|c| c.seq);
        Ok(claims)
    }

    /// Applies claimed messages in one transaction (group commit), each in its own savepoint, and returns one
    /// [`Completion`] per claim in input order.
    ///
    /// For each claim, inside the transaction: the row is marked processed *only if* it is still open and leased
    /// to this claim with an unexpired lease, and no earlier message of its order key is open (else
    /// [`Completion::LeaseLost`] and the handler does not run; in the latter case the lease is given back);
    /// the identity is ensured; the handler runs. A handler failure rolls back its own effect and state
    /// change and records the failure (backoff or dead letter) instead.
    ///
    /// A `COMMIT` refused by a deferred constraint of the application's tables (a deferred foreign key, say;
    /// as in [`Inbox::process_batch`](crate::Inbox::process_batch)) or a handler that ended the transaction
    /// ([`Error::HandlerEndedTransaction`]: a trigger's `RAISE(ROLLBACK)`, an interrupted write) is not an
    /// `Err`: the claims are then applied one per transaction, and the one whose own transaction fails that
    /// way records a failed attempt.
    ///
    /// An `Err` (storage trouble) commits nothing of the transaction it ended and consumes no attempts; the
    /// leases are given back when possible, else they expire. After such a failure, the claims applied one by
    /// one before the error stay committed.
    pub fn complete<H: Handler>(
        &mut self,
        claims: &[Claim],
        handler: &mut H,
    ) -> Result<Vec<Completion>> {
        let mut out = Vec::with_capacity(claims.len());
        self.complete_into(claims, handler, &mut out)?;
        Ok(out)
    }

    fn complete_into<H: Handler>(
        &mut self,
        claims: &[Claim],
        handler: &mut H,
        out: &mut Vec<Completion>,
    ) -> Result<()> {
        out.clear();
        if claims.is_empty() {
            return Ok(());
        }
        self.apply_transaction(claims, handler, None, out).map(drop)
    }

    /// One apply transaction over `claims`, or, with a `budget`, over the prefix of them whose handlers
    /// started within it (at least one). Returns how many claims it applied; `out` holds their completions.
    fn apply_transaction<H: Handler>(
        &mut self,
        claims: &[Claim],
        handler: &mut H,
        budget: Option<Duration>,
        out: &mut Vec<Completion>,
    ) -> Result<usize> {
        self.yield_lock();
        let conn = &self.inbox.conn;
        abandon_leftover(conn);
        begin(conn)?;
        let started = Instant::now();
        let deadline = budget.map(|b| started + b);
        // The cached `clock_seen` dates a restored identity (see `stored_day`).
        let result = self
            .inbox
            .retention
            .refresh(conn)
            .and_then(|()| {
                apply_claims(
                    conn,
                    &self.scope,
                    self.scope_id,
                    &self.owner,
                    &self.config,
                    claims,
                    handler,
                    &self.inbox.buf,
                    deadline,
                    out,
                )
            })
            .and_then(|n| commit(conn).map(|()| n));
        if deadline.is_some_and(|d| Instant::now() >= d) {
            self.lock_free_until = Some(Instant::now() + LOCK_YIELD);
        }
        let conn = &self.inbox.conn;
        if let Err(e) = result {
            out.clear();
            if !conn.is_autocommit() {
                let _ = conn.execute_batch("ROLLBACK");
            }
            match e {
                Error::CommitRefused { code, source } => {
                    let why = anyhow::Error::new(source).context(format!(
                        "COMMIT refused by a deferred constraint (SQLite code {code})"
                    ));
                    return self.isolate(claims, handler, why, out);
                }
                Error::HandlerEndedTransaction => {
                    let why = anyhow::Error::new(Error::HandlerEndedTransaction);
                    return self.isolate(claims, handler, why, out);
                }
                _ => {}
            }
            // Give the leases back so the messages need not wait for expiry; not when the database is busy
            // (that would wait out the busy timeout again) nor when the commit may have happened (harmless,
            // but pointless).
            if !matches!(e, Error::CommitUnknown { .. } | Error::Busy { .. }) {
                let _ = self.release(claims);
            }
            return Err(e);
        }
        result
    }

    /// After a failure one of the messages caused and that ended the whole transaction (nothing was
    /// committed): a `COMMIT` refused by a deferred constraint, which SQLite checks only then, or a handler
    /// that ended the transaction (a trigger's `RAISE(ROLLBACK)`, an interrupted write). As in the strong
    /// case, each message gets a transaction of its own, and the one whose own transaction fails that way
    /// counts a failed attempt (retried after its backoff, dead-lettered at the last), so one message cannot
    /// stop the worker or hold back the messages after it. An error meanwhile leaves the messages applied
    /// before it committed and gives back the leases of the rest.
    fn isolate<H: Handler>(
        &mut self,
        claims: &[Claim],
        handler: &mut H,
        why: anyhow::Error,
        out: &mut Vec<Completion>,
    ) -> Result<usize> {
        if let [c] = claims {
            out.push(self.refused(c, why)?);
            return Ok(1);
        }
        log::warn!(
            "scope {}: the transaction of up to {} messages failed ({why:#}); applying them one by one",
            self.scope,
            claims.len()
        );
        let mut one = Vec::with_capacity(1);
        for (i, c) in claims.iter().enumerate() {
            if let Err(e) = self.apply_transaction(std::slice::from_ref(c), handler, None, &mut one)
            {
                out.clear();
                if !matches!(e, Error::CommitUnknown { .. } | Error::Busy { .. }) {
                    let _ = self.release(&claims[i + 1..]);
                }
                return Err(e);
            }
            out.append(&mut one);
        }
        Ok(claims.len())
    }

    /// One failed attempt for a message whose own transaction failed for its sake (see [`Worker::isolate`]),
    /// in a transaction of its own, if this worker still holds its lease.
    fn refused(&mut self, c: &Claim, err: anyhow::Error) -> Result<Completion> {
        let conn = &self.inbox.conn;
        begin(conn)?;
        let result = (|| -> Result<Completion> {
            let now_ms = unix_now_ms();
            // The failure's stamp, never before the clock retention accepted (see `records::stamp`).
            let now = crate::store::records::stamp(conn, now_ms.div_euclid(1000));
            let owned = conn
                .prepare_cached(
                    "SELECT 1 FROM messages WHERE seq = ?1 AND lease_owner = ?2 AND claims = ?3 \
                     AND state IN (0, 2) AND lease_until >= ?4",
                )?
                .exists((c.seq, &self.owner, c.token, now_ms))?;
            let completion = if owned {
                let completion =
                    record_failure(conn, &self.scope, &self.config, c, err, now, now_ms)?;
                let dead = i64::from(matches!(completion, Completion::DeadLettered { .. }));
                conn.prepare_cached(
                    "UPDATE scope_stats SET handler_failures = handler_failures + 1, \
                     dead_lettered = dead_lettered + ?2 WHERE scope_id = ?1",
                )?
                .execute((self.scope_id, dead))?;
                completion
            } else {
                Completion::LeaseLost
            };
            commit(conn).map(|()| completion)
        })();
        if result.is_err() && !conn.is_autocommit() {
            let _ = conn.execute_batch("ROLLBACK");
        }
        result
    }

    /// Waits out the pause owed to other writers after a transaction that used its whole lock budget.
    fn yield_lock(&mut self) {
        if let Some(until) = self.lock_free_until.take() {
            let left = until.saturating_duration_since(Instant::now());
            if !left.is_zero() {
                std::thread::sleep(left);
            }
        }
    }

    /// Gives leases back without consuming an attempt, so the messages are claimable at once. Safe whatever
    /// happened meanwhile: only rows still open and leased to these very claims are touched.
    pub fn release(&mut self, claims: &[Claim]) -> Result<()> {
        let conn = &self.inbox.conn;
        abandon_leftover(conn);
        begin(conn)?;
        let result = (|| -> Result<()> {
            let mut stmt = conn.prepare_cached(
                "UPDATE messages SET lease_owner = NULL, lease_until = NULL \
                 WHERE seq = ?1 AND lease_owner = ?2 AND claims = ?3 AND state IN (0, 2)",
            )?;
            for c in claims {
                stmt.execute((c.seq, &self.owner, c.token))?;
            }
            drop(stmt);
            commit(conn)
        })();
        if result.is_err() && !conn.is_autocommit() {
            let _ = conn.execute_batch("ROLLBACK");
        }
        result
    }

    /// Claims up to [`WorkerConfig::batch`] messages and applies them ([`Worker::claim`], then apply
    /// transactions like [`Worker::complete`], each within [`WorkerConfig::lock_budget`]). Returns what
    /// happened; `claimed == 0` means nothing was claimable.
    ///
    /// An `Err` leaves the failing transaction's messages uncommitted (their leases given back when possible);
    /// messages of earlier transactions of the same call stay committed.
    pub fn run_once<H: Handler>(&mut self, handler: &mut H) -> Result<Drained> {
        let claims = self.claim(self.config.batch)?;
        let mut drained = Drained {
            claimed: claims.len(),
            ..Drained::default()
        };
        let mut rest = &claims[..];
        let mut out = Vec::with_capacity(claims.len());
        while !rest.is_empty() {
            let budget = Some(self.config.lock_budget);
            // On an error the transaction gives back the leases of all of `rest`.
            let applied = self.apply_transaction(rest, handler, budget, &mut out)?;
            for c in out.drain(..) {
                match c {
                    Completion::Processed => drained.processed += 1,
                    Completion::Retrying { .. } => drained.retrying += 1,
                    Completion::DeadLettered { .. } => drained.dead_lettered += 1,
                    Completion::LeaseLost => drained.lease_lost += 1,
                }
            }
            rest = &rest[applied..];
        }
        Ok(drained)
    }

    /// Runs [`Worker::run_once`] until `stop` is set, sleeping [`WorkerConfig::idle_wait`] whenever nothing
    /// is claimable. Retryable storage errors (busy, I/O, full disk, read-only) are logged and retried after
    /// a pause; they consume no attempts. Any other error ends the loop. Returns the totals.
    pub fn run_until<H: Handler>(&mut self, stop: &AtomicBool, handler: &mut H) -> Result<Drained> {
        let mut total = Drained::default();
        let mut pause = self.config.idle_wait;
        while !stop.load(Ordering::Relaxed) {
            match self.run_once(handler) {
                Ok(d) => {
                    total.add(d);
                    pause = self.config.idle_wait;
                    if d.claimed == 0 {
                        sleep_unless(stop, self.config.idle_wait);
                    }
                }
                Err(e) if e.is_retryable() => {
                    log::warn!(
                        "worker {} (scope {}): {e}; retrying in {pause:?}",
                        self.owner,
                        self.scope
                    );
                    sleep_unless(stop, pause);
                    pause = (pause * 2).clamp(Duration::from_millis(10), Duration::from_secs(5));
                }
                Err(e) => return Err(e),
            }
        }
        Ok(total)
    }
}

/// The claim itself: one `UPDATE ... RETURNING` in one `BEGIN IMMEDIATE` transaction.
fn claim_rows(
    conn: &Db,
    owner: &str,
    config: &WorkerConfig,
    scope_id: i64,
    max: usize,
    claims: &mut Vec<Claim>,
) -> Result<()> {
    begin(conn)?;
    let result = (|| -> Result<()> {
        // Read the clock under the write lock: it orders this claim after every commit it can see.
        let now = unix_now_ms();
        let mut stmt = conn.prepare_cached(
                "UPDATE messages SET lease_owner = ?1, lease_until = ?2 + ?3, claims = claims + 1 \
                 WHERE seq IN ( \
                   SELECT m.seq FROM messages m \
                   WHERE m.scope_id = ?4 AND m.state IN (0, 2) AND m.not_before <= ?2 \
                     AND (m.lease_until IS NULL OR m.lease_until < ?2) AND m.payload IS NOT NULL \
                     AND (m.order_key IS NULL OR NOT EXISTS ( \
                       SELECT 1 FROM messages e WHERE e.scope_id = m.scope_id AND e.order_key = m.order_key \
                         AND e.state IN (0, 2) AND e.seq < m.seq)) \
                   ORDER BY m.seq LIMIT ?5) \
                 RETURNING seq, claims, attempts, id_hash, producer, message_id, topic, payload, sequence, sent_at",
            )?;
        let lease_ms = config.lease.as_millis().min(i64::MAX as u128) as i64;
        let rows = stmt.query_map((owner, now, lease_ms, scope_id, max as i64), |r| {
            let hash: Vec<u8> = r.get(3)?;
            let id_hash = IdHash::from_bytes(&hash).ok_or_else(|| {
                rusqlite::Error::FromSqlConversionFailure(
                    3,
                    rusqlite::types::Type::Blob,
                    format!("an identity key of {} bytes", hash.len()).into(),
                )
            })?;
            Ok(Claim {
                seq: r.get(0)?,
                token: r.get(1)?,
                attempts: r.get::<_, i64>(2)?.max(0) as u32,
                id_hash,
                producer: r.get(4)?,
                message_id: r.get(5)?,
                topic: r.get(6)?,
                payload: r.get(7)?,
                sequence: r.get::<_, Option<i64>>(8)?.map(|s| s as u64),
                sent_at: r.get(9)?,
            })
        })?;
        for row in rows {
            claims.push(row?);
        }
        drop(stmt);
        commit(conn)
    })();
    if result.is_err() && !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    result
}

/// Rolls back a transaction left open by a handler that panicked (and was caught) in an earlier call, so the
/// worker stays usable; that transaction committed nothing.
fn abandon_leftover(conn: &Connection) {
    if !conn.is_autocommit() {
        log::warn!("rolling back a transaction left open by an earlier, interrupted call");
        let _ = conn.execute_batch("ROLLBACK");
    }
}

/// Sleeps up to `d`, waking early when `stop` is set.
fn sleep_unless(stop: &AtomicBool, d: Duration) {
    let deadline = Instant::now() + d;
    while !stop.load(Ordering::Relaxed) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        std::thread::sleep(left.min(Duration::from_millis(20)));
    }
}

#[allow(clippy::too_many_arguments)]
fn apply_claims<H: Handler>(
    conn: &Db,
    scope: &str,
    scope_id: i64,
    owner: &str,
    config: &WorkerConfig,
    claims: &[Claim],
    handler: &mut H,
    buf: &std::cell::RefCell<Vec<u8>>,
    deadline: Option<Instant>,
    out: &mut Vec<Completion>,
) -> Result<usize> {
    // Read the clock under the write lock, so "lease not expired" is judged at commit time.
    let now_ms = unix_now_ms();
    // Stamps (`finished_at`) never before the clock retention accepted (see `records::stamp`); the lease is
    // judged by the raw clock, as it was set.
    let now = crate::store::records::stamp(conn, now_ms.div_euclid(1000));
    let failure = std::cell::Cell::new(None);
    let (mut processed, mut failures, mut dead, mut rows) = (0i64, 0i64, 0i64, 0i64);
    let mut applied = 0;
    for c in claims {
        // The write lock is held from the first claim on: past the budget, the rest waits for the next
        // transaction.
        if applied > 0 && deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        applied += 1;
        conn.savepoint()?;
        // An earlier message of the same order key may have become open again since the claim (a requeued
        // dead letter): it runs first, so this one is not applied now (the claim alone cannot see that).
        let owned = conn
            .prepare_cached(
                "UPDATE messages SET state = 1, finished_at = ?4, lease_owner = NULL, lease_until = NULL \
                 WHERE seq = ?1 AND lease_owner = ?2 AND claims = ?3 AND state IN (0, 2) \
                   AND lease_until >= ?5 AND (order_key IS NULL OR NOT EXISTS ( \
                     SELECT 1 FROM messages e WHERE e.scope_id = messages.scope_id \
                       AND e.order_key = messages.order_key AND e.state IN (0, 2) AND e.seq < messages.seq))",
            )?
            .execute((c.seq, owner, c.token, now, now_ms))?;
        if owned != 1 {
            release(conn)?;
            // Still ours with a live lease: it gave way to an earlier message of its key. The lease goes back
            // at once, so it is claimed again as soon as that one is done, not only once the lease expires.
            let gave_way = conn
                .prepare_cached(
                    "UPDATE messages SET lease_owner = NULL, lease_until = NULL \
                     WHERE seq = ?1 AND lease_owner = ?2 AND claims = ?3 AND state IN (0, 2) \
                       AND lease_until >= ?4",
                )?
                .execute((c.seq, owner, c.token, now_ms))?;
            if gave_way == 1 {
                log::info!(
                    "scope {scope}: message {} (seq {}) waits for an earlier open message of its order key; \
                     lease given back, not applied here",
                    c.message_id,
                    c.seq
                );
            } else {
                log::info!(
                    "scope {scope}: lease on message {} (seq {}) lost; not applied here",
                    c.message_id,
                    c.seq
                );
            }
            out.push(Completion::LeaseLost);
            continue;
        }
        let d = c.delivery(scope);
        // A body moved here by a dead-letter path may lack its identity (a failed strong-case attempt
        // rolls it back): restore it, so a redelivery after this commit is a duplicate. Not when a sequence
        // claim in the watermark window holds the id (every numbered body of a watermark scope, received or
        // dead-lettered, until the window slides past it): a redelivery finds it there under any sequence,
        // and a row per message would grow a scope meant to cost O(producers) and, pruned, set
        // `pruned_before`.
        let day = crate::inbox::stored_day(conn, now, c.sent_at);
        let restored = if held_by_sequence(conn, scope_id, c)? {
            0
        } else {
            conn.prepare_cached(
                "INSERT OR IGNORE INTO identities (scope_id, id_hash, fingerprint, day) VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute((
                scope_id,
                c.id_hash.as_bytes(),
                Fingerprint::of(&c.topic, &c.payload).to_sql(),
                day,
            ))?
        };
        if restored == 0 && day >= 0 {
            // The horizon counts from the day the effect is committed: once processed, the body no longer holds
            // the identity back (see `schema.sql`), and a message that waited days (retries, a requeued dead
            // letter) must keep its identity a full horizon from now. Writes only when the day changed.
            conn.prepare_cached(
                "UPDATE identities SET day = ?3 WHERE scope_id = ?1 AND id_hash = ?2 AND day >= 0 AND day < ?3",
            )?
            .execute((scope_id, c.id_hash.as_bytes(), day))?;
        }

        let err = match run_handler(conn, &d, scope_id, now, handler, buf, &failure)? {
            Ok(()) => {
                release(conn)?;
                processed += 1;
                // Counted in `processed` already: the restored row must not count again (see `schema.sql`).
                rows += restored as i64;
                out.push(Completion::Processed);
                continue;
            }
            Err(err) => err,
        };
        conn.rollback_to()?;
        release(conn)?;
        failures += 1;
        // The ownership check above was rolled back with the effect, but the write lock is still held: nothing
        // can have changed the row since.
        let completion = record_failure(conn, scope, config, c, err, now, now_ms)?;
        if matches!(completion, Completion::DeadLettered { .. }) {
            dead += 1;
        }
        out.push(completion);
    }
    conn.prepare_cached(
        "UPDATE scope_stats SET processed = processed + ?2, handler_failures = handler_failures + ?3, \
         dead_lettered = dead_lettered + ?4, identity_offset = identity_offset + ?5 WHERE scope_id = ?1",
    )?
    .execute((scope_id, processed, failures, dead, rows))?;
    Ok(applied)
}

/// Whether the identity of claim `c` is held by a sequence claim in its scope's watermark window
/// (`watermark_recent`, looked up by id as `retention/watermark.rs` does, since a known id may have claimed
/// another sequence than the one the body carries). Only a numbered message can be held there; any other body
/// was stored under an identity row.
fn held_by_sequence(conn: &Db, scope_id: i64, c: &Claim) -> Result<bool> {
    if c.producer.is_none() || c.sequence.is_none() {
        return Ok(false);
    }
    Ok(conn
        .prepare_cached("SELECT 1 FROM watermark_recent WHERE scope_id = ?1 AND id_hash = ?2")?
        .exists((scope_id, c.id_hash.as_bytes()))?)
}

/// Records a failed attempt at claim `c`, inside the caller's transaction, which owns its row: back to
/// failed with a backoff, or dead-lettered once the attempts reach [`WorkerConfig::max_attempts`]. The
/// caller counts it in `scope_stats`.
fn record_failure(
    conn: &Db,
    scope: &str,
    config: &WorkerConfig,
    c: &Claim,
    err: anyhow::Error,
    now: i64,
    now_ms: i64,
) -> Result<Completion> {
    let attempts = c.attempts.saturating_add(1);
    let mut text = format!("{err:#}");
    if text.len() > MAX_ERROR_LEN {
        let mut cut = MAX_ERROR_LEN;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    if attempts >= config.max_attempts {
        conn.prepare_cached(
            "UPDATE messages SET state = 3, attempts = ?2, last_error = ?3, finished_at = ?4, \
             lease_owner = NULL, lease_until = NULL WHERE seq = ?1",
        )?
        .execute((c.seq, attempts, &text, now))?;
        log::warn!(
            "scope {scope}: message {} (seq {}) dead-lettered after {attempts} attempts: {text}",
            c.message_id,
            c.seq
        );
        return Ok(Completion::DeadLettered {
            error: err,
            attempts,
        });
    }
    let retry_in = config.backoff_after(attempts);
    let not_before = now_ms.saturating_add(retry_in.as_millis().min(i64::MAX as u128) as i64);
    conn.prepare_cached(
        "UPDATE messages SET state = 2, attempts = ?2, last_error = ?3, not_before = ?4, \
         lease_owner = NULL, lease_until = NULL WHERE seq = ?1",
    )?
    .execute((c.seq, attempts, &text, not_before))?;
    log::debug!(
        "scope {scope}: message {} failed (attempt {attempts}), retry in {retry_in:?}: {text}",
        c.message_id
    );
    Ok(Completion::Retrying {
        error: err,
        attempts,
        retry_in,
    })
}
