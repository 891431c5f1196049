//! The consumer's core: what happens between a received PUBLISH and its PUBACK, with no socket and no thread.
//! The application (or the crate's own [`Consumer`](crate::Consumer)) feeds it deliveries tagged with their
//! connection and sends the acks it hands back.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::deferred::backlog::BacklogThreshold;
use crate::inbox::{Handler, Inbox, Quarantined};
use crate::mqtt::ack_queue::AckQueue;
use crate::mqtt::budget::DELIVERY_OVERHEAD;
use crate::mqtt::extract::{Envelope, ExtractIdentity, Identity, Inbound, UserProperty};
use crate::mqtt::gate::{Ack, AckGate, ConnectionId};
use crate::mqtt::health::{Health, HealthEvents, Settled, StatsHandle};
use crate::mqtt::pipeline::{Pipeline, SyncOverlap};
use crate::mqtt::ready_acks::ReadyAcks;
pub use crate::mqtt::summary::RunSummary;
use crate::mqtt::topic_filter;
use crate::store::error::{Error, InvalidDelivery, Result};
use crate::store::identity::Delivery;
use crate::store::outcome::Outcome;
use crate::store::records;

/// Asks a running consumer to stop: it finishes the batch in flight (commit, then its PUBACKs, all
/// written before the DISCONNECT), disconnects and returns from [`Consumer::run`](crate::Consumer::run).
/// Cheap to clone; usable from any thread or a signal handler flag.
#[derive(Debug, Clone, Default)]
pub struct StopHandle(Arc<AtomicBool>);

impl StopHandle {
    /// Requests the stop.
    pub fn stop(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// True once a stop was requested.
    pub fn is_stopped(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// Clears a stop request, so that the consumer can run again.
    pub(crate) fn reset(&self) {
        self.0.store(false, Ordering::SeqCst);
    }

    /// The flag itself, e.g. for `signal_hook::flag::register`.
    pub fn flag(&self) -> Arc<AtomicBool> {
        self.0.clone()
    }
}

/// One received publish on its way to an ack.
struct Pending {
    inbound: Inbound,
    identity: Option<Identity>,
    ticket: u64,
}

/// How long the commit loop waits at a time for a sync that holds too many committed deliveries (see
/// [`ConsumerCore::commit_wait`]); the sync thread's wake-up ends it sooner.
const UNSYNCED_WAIT: Duration = Duration::from_millis(50);

/// What a commit attempt came to.
enum Tried<T> {
    Done(T),
    /// The connection ended or a stop came while storage kept failing: nothing may be acked.
    GaveUp,
    /// A failure that would repeat (not [retryable](Error::is_retryable)).
    Failed(Error),
    /// Storage kept failing for longer than the retry limit: the run must end.
    Exhausted(Error),
}

/// The part of an MQTT consumer that owns no connection: identity extraction, limits and quarantine,
/// group commit, handler retries and dead letters, and acks in arrival order per connection.
///
/// It is driven, never drives: the application hands it each delivery with the [`ConnectionId`] it arrived
/// on ([`ConsumerCore::push`]), says when a connection begins and ends ([`ConsumerCore::connected`],
/// [`ConsumerCore::connection_lost`]), calls [`ConsumerCore::settle`] to commit what was pushed, and sends
/// the acks that [`ConsumerCore::pop_ack`] hands back through an [`AckGate`]. It never hands back an ack of a
/// connection older than the latest one it was told about; the gate covers the rest of the race (a
/// connection that ends after the ack left the core).
///
/// `settle` blocks: it runs SQLite commits (an fsync each) and sleeps between retries. Call it on a thread
/// of its own, never on an async executor's thread. [`ConsumerCore::spawn`] runs it on such a thread, fed
/// through a channel; [`Consumer`](crate::Consumer) runs the same loop over a connection of its own.
pub struct ConsumerCore {
    pub(crate) inbox: Inbox,
    pub(crate) scope: String,
    extractor: Box<dyn ExtractIdentity>,
    /// The topic filters of the consumer's own connection, and those an earlier configuration subscribed
    /// and it unsubscribes: a delivery that only a removed one covers is quarantined (it was queued for
    /// it before). Any other delivery is handled, whatever subscription of the session brought it (both
    /// empty for a core fed by the application's connection).
    pub(crate) filters: Vec<String>,
    pub(crate) removed_filters: Vec<String>,
    pub(crate) batch_size: usize,
    pub(crate) linger: Duration,
    handler_attempts: u32,
    pub(crate) receive_only: Option<BacklogThreshold>,
    storage_retry_limit: Duration,
    pub(crate) memory_budget: usize,
    pub(crate) stop: StopHandle,
    pub(crate) exit_when_idle: Option<Duration>,
    gate: Option<AckGate>,
    /// The connection whose deliveries are held; `None` between connections.
    connection: Option<ConnectionId>,
    /// Pushed, not yet committed, in arrival order.
    held: VecDeque<Pending>,
    /// Every QoS1 delivery of the connection not yet acked, in arrival order.
    queue: AckQueue<Option<u16>>,
    /// Acks safe to send, in arrival order.
    ready: ReadyAcks,
    pub(crate) summary: RunSummary,
    outcomes: Vec<Outcome>,
    batch: Vec<Pending>,
    pub(crate) health: Health,
    /// When a commit loop overlaps commits with their syncs ([`ConsumerCore::overlap_syncs`]).
    overlap_syncs: SyncOverlap,
    /// While a commit loop overlaps them: the sync thread and the acks waiting for it.
    pipeline: Option<Pipeline>,
}

impl std::fmt::Debug for ConsumerCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerCore")
            .field("inbox", &self.inbox)
            .field("scope", &self.scope)
            .field("batch_size", &self.batch_size)
            .field("linger", &self.linger)
            .field("handler_attempts", &self.handler_attempts)
            .field("connection", &self.connection)
            .field("held", &self.held.len())
            .finish()
    }
}

/// The default limit of [`ConsumerCore::storage_retry_limit`].
pub const STORAGE_RETRY_LIMIT: Duration = Duration::from_secs(60);

impl ConsumerCore {
    /// A core for the logical consumer function `scope` (e.g. `inventory-reservation`), with the MQTT 5
    /// [`UserProperty`] extractor, batches of up to 64 and 3 handler attempts.
    pub fn new(inbox: Inbox, scope: impl Into<String>) -> ConsumerCore {
        let scope = scope.into();
        ConsumerCore {
            health: Health::new(&scope),
            inbox,
            scope,
            extractor: Box::new(UserProperty::default()),
            filters: Vec::new(),
            removed_filters: Vec::new(),
            batch_size: 64,
            linger: Duration::ZERO,
            handler_attempts: 3,
            receive_only: None,
            storage_retry_limit: STORAGE_RETRY_LIMIT,
            memory_budget: crate::mqtt::budget::DEFAULT_MEMORY_BUDGET,
            stop: StopHandle::default(),
            exit_when_idle: None,
            gate: None,
            connection: None,
            held: VecDeque::new(),
            queue: AckQueue::new(),
            ready: ReadyAcks::default(),
            summary: RunSummary::default(),
            outcomes: Vec::new(),
            batch: Vec::new(),
            overlap_syncs: SyncOverlap::Auto,
            pipeline: None,
        }
    }

    /// The same core with the CBOR [`Envelope`] extractor (what MQTT 3.1.1 publishers use).
    pub fn with_envelope(self) -> ConsumerCore {
        self.extractor(Envelope::default())
    }

    /// Where identities come from.
    pub fn extractor(mut self, extractor: impl ExtractIdentity + 'static) -> Self {
        self.extractor = Box::new(extractor);
        self
    }

    pub(crate) fn boxed_extractor(mut self, extractor: Box<dyn ExtractIdentity>) -> Self {
        self.extractor = extractor;
        self
    }

    /// Group commit: at most `size` deliveries per transaction; see [`Consumer::batch`](crate::Consumer::batch).
    /// Keep `size` at or below the broker's inflight window, or a batch waits for deliveries the broker holds
    /// back until it gets acks.
    pub fn batch(mut self, size: usize, linger: Duration) -> Self {
        self.batch_size = size.max(1);
        self.linger = linger;
        self
    }

    /// How many times the handler is tried on one delivery before it is dead-lettered and acked. At least 1.
    pub fn handler_attempts(mut self, attempts: u32) -> Self {
        self.handler_attempts = attempts.max(1);
        self
    }

    /// Received-then-deferred mode; see [`Consumer::receive_only`](crate::Consumer::receive_only).
    pub fn receive_only(mut self, backlog_warning: BacklogThreshold) -> Self {
        self.receive_only = Some(backlog_warning);
        self
    }

    /// How long one storage operation is retried while it keeps failing with a
    /// [retryable](Error::is_retryable) error (busy, I/O, full disk, read-only, unknown commit outcome)
    /// before [`ConsumerCore::settle`] gives up with that error: nothing of the batch is acked, and a run
    /// ends with it (for a supervisor to see and restart; the broker redelivers). Default 60 s.
    pub fn storage_retry_limit(mut self, limit: Duration) -> Self {
        self.storage_retry_limit = limit;
        self
    }

    /// The memory budget of [`ConsumerCore::spawn`]'s feed: while the deliveries handed over and not yet
    /// committed hold more than `bytes`, [`Feed::publish`](crate::Feed::publish) waits (see
    /// [`Consumer::memory_budget`](crate::Consumer::memory_budget), which this is for the `Consumer`).
    /// Default [`DEFAULT_MEMORY_BUDGET`](crate::DEFAULT_MEMORY_BUDGET) (2 MiB).
    pub fn memory_budget(mut self, bytes: usize) -> Self {
        self.memory_budget = bytes.max(1);
        self
    }

    /// When the commit loop ([`ConsumerCore::spawn`], and the [`Consumer`](crate::Consumer)'s) commits the
    /// next batch while the previous one syncs; [`SyncOverlap::Auto`] by default: while commits that sync
    /// themselves take a millisecond or more (SD cards, eMMC).
    ///
    /// Overlapping, a batch commits without a sync of its own (`synchronous=NORMAL` for that transaction),
    /// and a thread of the inbox syncs the WAL meanwhile, through a second connection and the same VFS.
    /// The batch's PUBACKs and events leave once a sync that began after its commit returned has
    /// succeeded: the promise is the same, the disk is just busy while the next batch commits. (Its
    /// delivery events may then come after the [`HealthEvent::ConnectionLost`](crate::HealthEvent) of
    /// their connection.) Other connections to the file see a commit before its sync: an outbox
    /// [`Relay`](crate::Relay) may publish a message whose commit a power cut then undoes; the redelivery
    /// commits it again under the same outbox message id, so the subscriber sees it twice, as a
    /// duplicate it can recognise. A batch is
    /// committed so that its commit ends about when the sync under way ends (from the measured times of
    /// both), or at once when it is full, so batches still gather what arrives during a sync. A failed sync
    /// is not retried: nothing committed since the last good sync is acked until the connection has written
    /// the whole WAL out again and synced it (retried as storage errors are).
    ///
    /// [`ConsumerCore::settle`] called directly always syncs each commit. Without effect at
    /// `synchronous=NORMAL` (nothing is synced per commit).
    pub fn overlap_syncs(mut self, mode: SyncOverlap) -> Self {
        self.overlap_syncs = mode;
        self
    }

    /// Makes the commit loop ([`ConsumerCore::spawn`]) end once nothing has arrived for `idle` (counted from
    /// the start, the latest connection or the latest delivery) and nothing is held.
    pub fn exit_when_idle(mut self, idle: Duration) -> Self {
        self.exit_when_idle = Some(idle);
        self
    }

    /// The gate the acks go through: while storage retries, the core checks it and gives up on a batch
    /// whose connection has ended (nothing of it may be acked any more).
    pub fn gate(mut self, gate: AckGate) -> Self {
        self.set_gate(gate);
        self
    }

    /// A new gate numbers its connections from the first again: what the core still holds of a connection
    /// of the gate before (a core given back by a commit loop that ended with acks unsent) must not be
    /// taken for a connection of the new one, where the same packet ids name other messages.
    pub(crate) fn set_gate(&mut self, gate: AckGate) {
        self.connection = None;
        self.drop_held("the core was given a new ack gate");
        self.gate = Some(gate);
    }

    /// A handle that makes retries give up and a driving loop stop.
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// Live statistics of this core, readable from any thread while it runs (take the handle before
    /// [`ConsumerCore::spawn`]).
    pub fn stats(&self) -> StatsHandle {
        self.health.stats()
    }

    /// The connection and outcome events of this core, over a bounded channel of `capacity` events (at
    /// least 1). Never blocks the commit thread: an event that finds the channel full is dropped and
    /// counted ([`HealthEvents::dropped`]). A delivery's event is sent once the commit that decided it
    /// is durable (it returned, or with overlapping syncs a sync covered it), before its PUBACK; a batch's
    /// events in arrival order. Call it before [`ConsumerCore::spawn`]; a second call ends the first
    /// receiver's stream.
    pub fn events(&mut self, capacity: usize) -> HealthEvents {
        self.health.subscribe(capacity)
    }

    /// The inbox, e.g. for [`Inbox::scope_stats`]. Its commits are durable when they return, whatever
    /// the core does between them.
    pub fn inbox(&mut self) -> &mut Inbox {
        // Back at the configured level now, not only at its next transaction's start.
        if let Err(e) = self.inbox.conn.end_relaxed() {
            log::warn!(
                "cannot restore the inbox's synchronous level yet: {e}; its next transaction will"
            );
        }
        &mut self.inbox
    }

    /// Gives the inbox back.
    pub fn into_inbox(mut self) -> Inbox {
        self.stop_pipeline();
        if let Err(e) = self.inbox.conn.end_relaxed() {
            log::warn!(
                "cannot restore the inbox's synchronous level yet: {e}; its next transaction will"
            );
        }
        self.inbox
    }

    /// This core's counts so far.
    pub fn summary(&self) -> RunSummary {
        self.summary
    }

    /// The scope deliveries are committed in.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// Deliveries pushed and not yet committed.
    pub fn unsettled(&self) -> usize {
        self.held.len()
    }

    /// The connection whose deliveries the core holds, if any.
    pub fn connection(&self) -> Option<ConnectionId> {
        self.connection
    }

    /// A connection began: whatever is held from an older one is dropped unacked (the broker redelivers it).
    /// `session_present` is the CONNACK's flag; a lost session after the first connection is logged.
    pub fn connected(&mut self, connection: ConnectionId, session_present: bool) {
        self.summary.connections += 1;
        if let Some(old) = self.connection.filter(|&old| old != connection) {
            // Not told of its end: it ends here.
            self.health
                .lost(old, Some("a new connection began".to_owned()));
        }
        self.drop_held("reconnected");
        self.connection = Some(connection);
        if !session_present && self.summary.connections > 1 {
            log::warn!(
                "the broker did not keep our session (expired, or restarted without persistence): \
                 deliveries published while we were away may not arrive"
            );
        }
        self.health.connected(connection, session_present);
        self.publish_stats();
    }

    /// The broker acknowledged `connection`'s subscriptions (its SUBACK granted every filter at QoS1 or
    /// above): [`ConsumerStats::subscribed`](crate::ConsumerStats::subscribed) is true and a
    /// [`HealthEvent::Subscribed`](crate::HealthEvent::Subscribed) is sent, until the connection ends.
    /// Ignored for a connection that is not the current one.
    pub fn subscribed(&mut self, connection: ConnectionId) {
        if self.connection == Some(connection) {
            self.health.subscribed(connection);
            self.publish_stats();
        }
    }

    /// `connection` ended: what is held from it is dropped unacked, acks not yet taken are discarded.
    pub fn connection_lost(&mut self, connection: ConnectionId) {
        self.connection_lost_because(connection, None);
    }

    /// [`ConsumerCore::connection_lost`], with the cause for its [`HealthEvent`](crate::HealthEvent).
    pub fn connection_lost_because(&mut self, connection: ConnectionId, cause: Option<String>) {
        if self.connection == Some(connection) {
            self.drop_held("the connection ended");
            self.connection = None;
            self.health.lost(connection, cause);
            self.publish_stats();
        }
    }

    /// A run over a connection of the crate's own ended: that connection is closed.
    pub(crate) fn finish_run(&mut self, summary: &RunSummary) {
        let connection = self.connection.take();
        self.health.finish(summary, connection);
    }

    /// Publishes the counts to the [`StatsHandle`]s.
    pub(crate) fn publish_stats(&self) {
        self.health
            .publish(&self.summary, self.connection, self.held.len());
    }

    /// Counts a delivery's fate and notes its event.
    fn settled(&mut self, message_id: Option<&str>, outcome: Settled) {
        let s = &mut self.summary;
        match outcome {
            Settled::Processed => s.processed += 1,
            Settled::Duplicate => s.duplicates += 1,
            Settled::Conflict => s.conflicts += 1,
            Settled::Quarantined => s.quarantined += 1,
            Settled::Stored => s.stored += 1,
            Settled::DeadLettered => s.dead_lettered += 1,
            Settled::HandlerFailed { attempt } => {
                s.failed_attempts += 1;
                if attempt == 1 {
                    s.handler_failures += 1;
                }
            }
        }
        self.health.settled(self.connection, message_id, outcome);
    }

    fn drop_held(&mut self, why: &str) {
        let n = self.held.len();
        let syncing = self.pipeline.as_ref().map_or(0, Pipeline::len);
        if n > 0 || self.queue.len() > 0 || !self.ready.is_empty() || syncing > 0 {
            log::info!(
                "{why}: dropping {n} uncommitted deliveries and {} unsent acks of the old connection; \
                 the broker redelivers them",
                self.ready.len() + syncing
            );
        }
        let syncing = self.pipeline.as_mut().map_or(0, Pipeline::clear);
        self.summary.dropped_stale += (n + self.ready.len() + syncing) as u64;
        self.held.clear();
        self.queue.clear();
        self.ready.clear();
    }

    /// A publish received on `connection` (`packet_id` is `None` for QoS0, which gets no ack). Queued for
    /// the next [`ConsumerCore::settle`]; one of a connection other than the latest begun is dropped.
    pub fn push(&mut self, connection: ConnectionId, inbound: Inbound, packet_id: Option<u16>) {
        self.summary.received += 1;
        if self.connection != Some(connection) {
            // Received on a connection that is gone: its redelivery will come on the new one.
            self.summary.dropped_stale += 1;
            return;
        }
        let ticket = self.queue.push(packet_id);
        self.held.push_back(Pending {
            inbound,
            identity: None,
            ticket,
        });
    }

    /// A QoS1 publish the inbox does not handle (another topic of the application's connection): its ack
    /// is handed back in turn, behind the deliveries received before it (acks leave in arrival order).
    pub fn pass_through(&mut self, connection: ConnectionId, packet_id: u16) {
        if self.connection != Some(connection) {
            return;
        }
        let ticket = self.queue.push(Some(packet_id));
        self.queue.settle(ticket);
        self.release_acks(false);
    }

    /// The next ack safe to send, in arrival order; send it with [`AckGate::send`].
    pub fn pop_ack(&mut self) -> Option<Ack> {
        self.ready.pop_front()
    }

    /// Puts back an ack taken with [`ConsumerCore::pop_ack`] that could not be queued yet: it stays first.
    pub(crate) fn unpop_ack(&mut self, ack: Ack) {
        self.ready.push_front(ack);
    }

    /// Acks waiting to be taken with [`ConsumerCore::pop_ack`].
    pub fn acks_ready(&self) -> usize {
        self.ready.len()
    }

    /// Commits the oldest held deliveries, up to the batch size, in one transaction (blocking: call it on a
    /// thread of its own), and makes their acks ready. Returns how many were taken.
    ///
    /// Bad input is quarantined, handler failures retried then dead-lettered, a batch that fails for good
    /// settled one delivery at a time; all of those are acked. Storage errors are retried with backoff; the
    /// batch is dropped unacked (`Ok`) when its connection ends or a stop is asked meanwhile, and `Err` comes
    /// back when they persist beyond [`ConsumerCore::storage_retry_limit`] (nothing acked; end the run).
    pub fn settle<H: Handler>(&mut self, handler: &mut H) -> Result<usize> {
        let n = self.held.len().min(self.batch_size);
        if n == 0 {
            return Ok(0);
        }
        if self.pipeline.is_some() && !self.recover_failed_sync()? {
            // The connection ended or a stop came while the WAL could not be written out again: what is
            // held is left for the broker to redeliver, as when a commit gives up.
            self.abandon(0);
            return Ok(0);
        }
        if let Some(p) = &mut self.pipeline {
            if p.choose() {
                // Until the connection is handed out again ([`ConsumerCore::inbox`]) or the syncs are
                // fast: its commits are made durable by the sync thread before anything of them is acked.
                self.inbox.conn.start_relaxed();
            } else if let Err(e) = self.inbox.conn.end_relaxed() {
                // The transaction's start sets the level again, or fails.
                log::debug!("cannot restore the synchronous level yet: {e}");
            }
        }
        let began = Instant::now();
        let mut batch = std::mem::take(&mut self.batch);
        batch.extend(self.held.drain(..n));
        let result = self.settle_batch(&mut batch, handler);
        batch.clear();
        self.batch = batch;
        let overlapped = self.pipeline.as_ref().is_some_and(Pipeline::overlapping);
        // Whatever was decided is committed, even when the batch then gave up; durable once synced.
        match &mut self.pipeline {
            Some(p) if overlapped => {
                p.commit_took(n, began.elapsed());
                let request = p.request();
                self.health.hold(request);
            }
            // Synced by its commit, but behind acks or events still waiting for the sync thread.
            Some(p) if p.is_waiting() || self.health.holding() => {
                p.full_commit_took(self.inbox.conn.last_commit.get());
                self.health.hold(p.last_request());
            }
            Some(p) => {
                p.full_commit_took(self.inbox.conn.last_commit.get());
                self.health.flush();
            }
            None => self.health.flush(),
        }
        self.publish_stats();
        match result {
            Ok(true) => {
                self.release_acks(overlapped);
                Ok(n)
            }
            Ok(false) => {
                self.abandon(n);
                Ok(n)
            }
            Err(e) => {
                self.abandon(n);
                Err(e)
            }
        }
    }

    /// Ok(false) when it gave up (nothing more of the connection's deliveries may be acked).
    fn settle_batch<H: Handler>(&mut self, batch: &mut [Pending], handler: &mut H) -> Result<bool> {
        let limits = *self.inbox.config().get_limits();
        // Identity and limits first: bad input is quarantined, so it can be acked like the rest.
        let mut good: Vec<usize> = Vec::with_capacity(batch.len());
        for (i, p) in batch.iter_mut().enumerate() {
            // An identity that was found but breaks a limit is kept, so its sequence can be claimed.
            let topic = &p.inbound.topic;
            let removed = !self.removed_filters.is_empty()
                && self
                    .removed_filters
                    .iter()
                    .any(|f| topic_filter::matches(topic, f))
                && !self.filters.iter().any(|f| topic_filter::matches(topic, f));
            let (why, known) = match self.extractor.extract(&p.inbound) {
                Ok(_) if removed => (InvalidDelivery::NotSubscribed, None),
                Ok(id) => match delivery_of(&self.scope, &p.inbound, &id).validate(&limits) {
                    Ok(()) => {
                        p.identity = Some(id);
                        good.push(i);
                        continue;
                    }
                    Err(why) => (why, Some(id)),
                },
                Err(why) => (why, None),
            };
            // What the publisher sent is quoted in it: bounded, for the log line and the record.
            let reason = records::cut(&why.to_string(), records::MAX_REASON).to_owned();
            log::warn!(
                "bad delivery on topic {:?} ({} bytes): {reason}; quarantining it",
                records::cut(&p.inbound.topic, records::MAX_RECORD_TEXT),
                p.inbound.payload.len()
            );
            self.health.ticket = p.ticket;
            let scope = self.scope.clone();
            let inbound = &p.inbound;
            let kept = self.retry("quarantine", |inbox| match &known {
                Some(id) => {
                    inbox.quarantine_delivery_as(&delivery_of(&scope, inbound, id), &reason)
                }
                None => inbox
                    .quarantine(&scope, &inbound.topic, &inbound.payload, &reason)
                    .map(Quarantined::Kept),
            })?;
            let settled = match kept {
                None => return Ok(false),
                Some(Quarantined::Kept(_)) => Settled::Quarantined,
                // Its sequence was claimed by this very message id before: a redelivery, or a conflict.
                Some(Quarantined::Duplicate) => Settled::Duplicate,
                Some(Quarantined::Conflict) => Settled::Conflict,
            };
            self.settled(known.as_ref().map(|id| id.message_id.as_str()), settled);
            self.queue.settle(p.ticket);
        }

        let scope = std::mem::take(&mut self.scope);
        let result = self.commit_good(&scope, batch, &good, handler);
        self.scope = scope;
        result
    }

    fn commit_good<H: Handler>(
        &mut self,
        scope: &str,
        batch: &[Pending],
        good: &[usize],
        handler: &mut H,
    ) -> Result<bool> {
        if good.is_empty() {
            return Ok(true);
        }
        let deliveries: Vec<Delivery<'_>> = good
            .iter()
            .map(|&i| {
                delivery_of(
                    scope,
                    &batch[i].inbound,
                    batch[i].identity.as_ref().expect("extracted"),
                )
            })
            .collect();
        let mut outcomes = std::mem::take(&mut self.outcomes);
        let receive_only = self.receive_only.is_some();
        let committed = self.attempt("commit", |inbox| {
            if receive_only {
                inbox.receive_batch_into(&deliveries, &mut outcomes)
            } else {
                inbox.process_batch_into(&deliveries, handler, &mut outcomes)
            }
        });
        let result = match committed {
            Tried::GaveUp => Ok(false),
            Tried::Exhausted(e) => Err(e),
            Tried::Done(()) => {
                self.summary.batches += 1;
                let mut result = Ok(true);
                for (k, outcome) in outcomes.drain(..).enumerate() {
                    self.health.ticket = batch[good[k]].ticket;
                    match self.settle_one(&deliveries[k], outcome, handler) {
                        Ok(true) => self.queue.settle(batch[good[k]].ticket),
                        other => {
                            result = other;
                            break;
                        }
                    }
                }
                result
            }
            Tried::Failed(why) => {
                // A deterministic failure would fail the batch forever: find the delivery behind it alone.
                log::warn!(
                    "a batch of {} failed for good ({why}); settling its deliveries one at a time",
                    deliveries.len()
                );
                let mut result = Ok(true);
                for (k, d) in deliveries.iter().enumerate() {
                    self.health.ticket = batch[good[k]].ticket;
                    let alone = self.attempt("commit", |inbox| {
                        if receive_only {
                            inbox.receive(d)
                        } else {
                            inbox.process(d, &mut *handler)
                        }
                    });
                    let settled = match alone {
                        Tried::Done(outcome) => self.settle_one(d, outcome, handler),
                        Tried::GaveUp => Ok(false),
                        Tried::Exhausted(e) => Err(e),
                        Tried::Failed(why) => self.dead_letter(d, 1, &format!("{why}")),
                    };
                    match settled {
                        Ok(true) => self.queue.settle(batch[good[k]].ticket),
                        other => {
                            result = other;
                            break;
                        }
                    }
                }
                result
            }
        };
        outcomes.clear();
        self.outcomes = outcomes;
        result
    }

    /// Makes one committed outcome final (retrying a failed handler, quarantining an expired delivery) and
    /// counts it. Ok(false) when storage trouble outlived the connection or a stop (nothing may be acked).
    fn settle_one<H: Handler>(
        &mut self,
        d: &Delivery<'_>,
        outcome: Outcome,
        handler: &mut H,
    ) -> Result<bool> {
        match outcome {
            Outcome::HandlerFailed(err) => {
                self.settled(Some(d.message_id), Settled::HandlerFailed { attempt: 1 });
                self.retry_handler(d, err, handler)
            }
            Outcome::Expired {
                quarantined: None,
                sent_at,
                pruned_before,
            } => self.quarantine_expired(d, sent_at, pruned_before),
            other => {
                self.count(d, &other);
                Ok(true)
            }
        }
    }

    /// An expired delivery rejected by the scope's policy. A consumer cannot refuse a delivery without
    /// stalling on it, so its body is kept in quarantine before it is acked: nothing silently lost.
    fn quarantine_expired(
        &mut self,
        d: &Delivery<'_>,
        sent_at: i64,
        pruned_before: i64,
    ) -> Result<bool> {
        let reason = format!(
            "expired: sent at {sent_at}, before the pruned identity horizon {pruned_before}"
        );
        let kept = self.retry("quarantine", |inbox| {
            inbox.quarantine(d.scope, d.topic, d.payload, &reason)
        })?;
        if kept.is_some() {
            self.settled(Some(d.message_id), Settled::Quarantined);
        }
        Ok(kept.is_some())
    }

    /// Tries a failed delivery again, alone, up to the attempt limit; then dead-letters it.
    fn retry_handler<H: Handler>(
        &mut self,
        d: &Delivery<'_>,
        mut err: anyhow::Error,
        handler: &mut H,
    ) -> Result<bool> {
        let mut attempts = 1;
        while attempts < self.handler_attempts {
            attempts += 1;
            std::thread::sleep(Duration::from_millis(10 * u64::from(attempts)));
            match self.attempt("commit", |inbox| inbox.process(d, &mut *handler)) {
                Tried::GaveUp => return Ok(false),
                Tried::Exhausted(e) => return Err(e),
                Tried::Failed(why) => {
                    let reason = format!("handler failed {attempts} time(s), the last with: {why}");
                    return self.dead_letter(d, attempts, &reason);
                }
                Tried::Done(Outcome::HandlerFailed(e)) => {
                    self.settled(
                        Some(d.message_id),
                        Settled::HandlerFailed { attempt: attempts },
                    );
                    err = e;
                }
                Tried::Done(Outcome::Expired {
                    quarantined: None,
                    sent_at,
                    pruned_before,
                }) => {
                    return self.quarantine_expired(d, sent_at, pruned_before);
                }
                Tried::Done(o) => {
                    self.count(d, &o);
                    return Ok(true);
                }
            }
        }
        let reason = format!("handler failed {attempts} time(s): {err:#}");
        self.dead_letter(d, attempts, &reason)
    }

    /// Records `d` as a dead letter with its reason; only then may it be acked. The record is retried
    /// whatever the error: without it nothing may be acked.
    fn dead_letter(&mut self, d: &Delivery<'_>, attempts: u32, reason: &str) -> Result<bool> {
        match self.retry("dead letter", |inbox| {
            inbox.dead_letter_after(d, attempts, reason)
        })? {
            None => Ok(false),
            Some(Outcome::Processed) => {
                self.settled(Some(d.message_id), Settled::DeadLettered);
                Ok(true)
            }
            Some(Outcome::Expired {
                quarantined: None,
                sent_at,
                pruned_before,
            }) => self.quarantine_expired(d, sent_at, pruned_before),
            Some(other) => {
                self.count(d, &other);
                Ok(true)
            }
        }
    }

    /// Counts a settled outcome.
    fn count(&mut self, d: &Delivery<'_>, outcome: &Outcome) {
        let settled = match outcome {
            Outcome::Processed => Settled::Processed,
            Outcome::Duplicate => Settled::Duplicate,
            Outcome::Conflict { .. } => Settled::Conflict,
            Outcome::Expired { .. } | Outcome::SequenceConflict { .. } => Settled::Quarantined,
            Outcome::Received => Settled::Stored,
            // Handler failures are counted where they are retried.
            _ => return,
        };
        self.settled(Some(d.message_id), settled);
    }

    /// Runs `f` until it succeeds, backing off on errors, whatever they are: for the durable records that
    /// must exist before an ack (quarantine, dead letters). `Ok(None)` when the batch's connection ended or a
    /// stop was requested first; `Err` when the retry limit ran out.
    fn retry<T>(
        &mut self,
        what: &str,
        f: impl FnMut(&mut Inbox) -> Result<T>,
    ) -> Result<Option<T>> {
        match self.backoff(what, true, f) {
            Tried::Done(v) => Ok(Some(v)),
            Tried::GaveUp | Tried::Failed(_) => Ok(None),
            Tried::Exhausted(e) => Err(e),
        }
    }

    /// Like [`ConsumerCore::retry`] for a commit of deliveries, but an error that is not
    /// [retryable](Error::is_retryable) comes back as [`Tried::Failed`] at once: trying again would fail
    /// the same way and hold back everything behind it.
    fn attempt<T>(&mut self, what: &str, f: impl FnMut(&mut Inbox) -> Result<T>) -> Tried<T> {
        self.backoff(what, false, f)
    }

    fn backoff<T>(
        &mut self,
        what: &str,
        retry_all: bool,
        mut f: impl FnMut(&mut Inbox) -> Result<T>,
    ) -> Tried<T> {
        let mut backoff = Duration::from_millis(50);
        let mut failing_since: Option<Instant> = None;
        loop {
            match f(&mut self.inbox) {
                Ok(v) => return Tried::Done(v),
                Err(e) if !retry_all && !e.is_retryable() => {
                    self.summary.storage_errors += 1;
                    log::error!(
                        "{what} failed for good (SQLite code {}): {e}; not acked",
                        code_of(&e)
                    );
                    return Tried::Failed(e);
                }
                Err(e) => {
                    self.summary.storage_errors += 1;
                    let since = *failing_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= self.storage_retry_limit {
                        log::error!(
                            "{what} kept failing for {:?} (SQLite code {}): {e}; giving up, nothing of the \
                             batch acked",
                            since.elapsed(),
                            code_of(&e)
                        );
                        return Tried::Exhausted(e);
                    }
                    log::error!(
                        "{what} failed (SQLite code {}): {e}; not acked, retrying in {backoff:?}",
                        code_of(&e)
                    );
                    let until = Instant::now() + backoff;
                    while Instant::now() < until {
                        if !self.connection_current() || self.stop.is_stopped() {
                            return Tried::GaveUp;
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    fn connection_current(&self) -> bool {
        match (&self.gate, self.connection) {
            (Some(gate), Some(c)) => gate.is_current(c),
            (None, Some(_)) => true,
            (_, None) => false,
        }
    }

    /// Gives up on what is held: nothing more of it is acked; the broker redelivers it.
    fn abandon(&mut self, n: usize) {
        // The batch given up on (taken out of `held` already) and everything behind it.
        let left = n + self.held.len();
        log::warn!("leaving {left} deliveries unacked; the broker redelivers them");
        self.summary.dropped_stale += left as u64;
        self.held.clear();
        self.queue.clear();
    }

    /// Moves the acks of the settled prefix of the queue to the ready list; with the pipeline, those of a
    /// batch just committed (`committed`), and any behind acks still waiting, wait for their sync.
    fn release_acks(&mut self, committed: bool) {
        let Some(connection) = self.connection else {
            return;
        };
        while let Some(token) = self.queue.pop_ready() {
            if let Some(packet_id) = token {
                let ack = Ack {
                    connection,
                    packet_id,
                };
                match &mut self.pipeline {
                    Some(p) if committed || p.is_waiting() => p.wait(ack),
                    _ => self.ready.push_back(ack),
                }
            }
        }
    }

    /// Starts the sync thread for a commit loop that overlaps commits with their syncs, when
    /// [`ConsumerCore::overlap_syncs`] is on and the inbox syncs every commit. `wake` runs on that thread
    /// after each sync, and on the checkpoint thread after each catch-up that the next commit waits for.
    /// Without the thread (it could not start: logged) every commit syncs itself.
    pub(crate) fn start_pipeline<W: Fn() + Send + Clone + 'static>(&mut self, wake: W) {
        let config = self.inbox.config();
        if self.overlap_syncs == SyncOverlap::Off
            || config.get_synchronous() != crate::store::config::Synchronous::Full
            || self.pipeline.is_some()
        {
            return;
        }
        match crate::store::group_sync::GroupSync::start(
            self.inbox.path(),
            config,
            Box::new(wake.clone()),
        ) {
            Ok(sync) => {
                self.pipeline = Some(Pipeline::new(sync, self.overlap_syncs));
                self.inbox.conn.wear.on_catch_up_end(Some(Box::new(wake)));
            }
            Err(e) => log::warn!(
                "cannot start the sync thread ({e}); every commit syncs before the next one begins"
            ),
        }
    }

    /// Ends the sync thread (after the sync under way): acks still waiting for a sync are dropped and
    /// counted, and the connection goes back to syncing its own commits.
    pub(crate) fn stop_pipeline(&mut self) {
        let Some(mut p) = self.pipeline.take() else {
            return;
        };
        self.inbox.conn.wear.on_catch_up_end(None);
        // Closing, the connection must not copy into the database file frames the disk may lack.
        if let Some(code) = p.sync.failed() {
            self.inbox.conn.note_wal_sync_failed(code);
        }
        let left = p.clear();
        if left > 0 {
            log::info!(
                "the commit loop ended before the sync of {left} committed deliveries: left unacked; \
                 the broker redelivers them"
            );
            self.summary.dropped_stale += left as u64;
        }
        self.health.forget_held();
        drop(p);
        if let Err(e) = self.inbox.conn.end_relaxed() {
            log::warn!(
                "cannot restore the inbox's synchronous level yet: {e}; its next transaction will"
            );
        }
    }

    /// How long the held deliveries should wait before they are committed (`None`: commit now). Always now
    /// without the pipeline. With it, while commits overlap their syncs, not while the checkpoint thread
    /// catches up with the WAL, even with a full batch (the commit would only wait for it, holding back the
    /// acks the syncs release meanwhile); otherwise now with a full batch, or timed so that its commit ends
    /// as the sync under way ends (from the measured times of both): the next sync then covers it, and what
    /// arrives until then joins it. Not while the memory budget's worth of committed deliveries (at
    /// [`DELIVERY_OVERHEAD`] each) waits for a sync, full batch or not.
    pub(crate) fn commit_wait(&self) -> Option<Duration> {
        let p = self.pipeline.as_ref()?;
        // The next commit would wait for the checkpoint thread's catch-up before it begins: meanwhile the
        // commit loop acks what the sync thread makes durable, until the checkpoint thread's wake-up (or
        // the catch-up's deadline). Commits that sync themselves have nothing waiting for it: they wait in
        // the next transaction's start.
        if p.overlapping() || p.is_waiting() {
            if let Some(left) = self.inbox.conn.wear.catch_up_left() {
                return Some(left);
            }
        }
        // A sync that does not end (a card stalled in its housekeeping) must not let commits run on without
        // it: their acks and events wait in memory, and the budget, given back at each commit, would keep the
        // reader reading. With the budget's worth of deliveries waiting, the next commit waits for the sync
        // (the sync thread's wake-up ends the wait), so the budget fills and the reader stops.
        if p.overlapping() && p.len() >= (self.memory_budget / DELIVERY_OVERHEAD).max(1) {
            return Some(UNSYNCED_WAIT);
        }
        if !p.overlapping() || self.held.len() >= self.batch_size {
            return None;
        }
        p.sync.commit_wait(p.commit_estimate(self.held.len()))
    }

    /// Acks of committed deliveries waiting for a sync.
    pub(crate) fn acks_syncing(&self) -> usize {
        self.pipeline.as_ref().map_or(0, Pipeline::len)
    }

    /// Makes the acks (and events) of every synced commit ready. After a failed sync, first writes the WAL
    /// out again (retried as storage errors are); `Err` once that failed for longer than the retry limit.
    pub(crate) fn take_synced(&mut self) -> Result<()> {
        if self.pipeline.is_none() || !self.recover_failed_sync()? {
            return Ok(());
        }
        if let Some(p) = &mut self.pipeline {
            let synced = p.sync.synced();
            p.release(synced, &mut self.ready);
            self.health.release(synced);
        }
        Ok(())
    }

    /// Waits for the next sync to end (at most until `deadline`) and makes the acks it covers ready: the
    /// commit loop queues them before it waits again, so a stop does not hold a batch's acks until the
    /// last batch's sync. False once nothing waits for a sync, after a failed sync whose WAL could not be
    /// written out again (a stop gives up at once: the rest stay unacked), or at the deadline.
    pub(crate) fn await_sync(&mut self, deadline: Instant) -> Result<bool> {
        self.take_synced()?;
        let Some(p) = &self.pipeline else {
            return Ok(false);
        };
        if p.sync.failed().is_some() {
            return Ok(false);
        }
        let synced = p.sync.synced();
        if synced >= p.last_request() {
            // The last sync may have ended since the release above: what it covers is released too.
            self.take_synced()?;
            return Ok(false);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        p.sync
            .wait(synced + 1, left.min(Duration::from_millis(100)));
        self.take_synced()?;
        Ok(true)
    }

    /// After a failed sync of the thread: the committing connection writes the whole WAL out again and
    /// syncs it (nothing may be acked or committed before), and then every commit so far is durable.
    /// `Ok(false)` when it gave up for now (the connection ended, or a stop).
    fn recover_failed_sync(&mut self) -> Result<bool> {
        let Some(p) = &mut self.pipeline else {
            return Ok(true);
        };
        let Some(code) = p.sync.failed() else {
            return Ok(true);
        };
        // Every time, also when a transaction's start wrote the WAL out since: commits may have followed.
        self.inbox.conn.note_wal_sync_failed(code);
        match self.backoff("write the WAL out again", true, |inbox| {
            inbox.conn.write_out_unsynced_wal()
        }) {
            Tried::Done(()) => {}
            Tried::GaveUp | Tried::Failed(_) => return Ok(false),
            Tried::Exhausted(e) => return Err(e),
        }
        if let Some(p) = &mut self.pipeline {
            p.sync.recovered();
            p.release_all(&mut self.ready);
            self.health.release(u64::MAX);
        }
        Ok(true)
    }
}

fn code_of(e: &Error) -> String {
    e.sqlite_code()
        .map_or_else(|| "none".to_owned(), |c| c.to_string())
}

fn delivery_of<'a>(scope: &'a str, inbound: &'a Inbound, id: &'a Identity) -> Delivery<'a> {
    let payload = id.body.as_deref().unwrap_or(&inbound.payload);
    let mut d = Delivery::new(scope, &id.message_id, &inbound.topic, payload);
    if let Some(p) = id.producer.as_deref() {
        d = d.with_producer(p);
    }
    if let Some(s) = id.sequence {
        d = d.with_sequence(s);
    }
    if let Some(t) = id.sent_at {
        d = d.with_sent_at(t);
    }
    d
}

impl From<rumqttc::v5::mqttbytes::v5::Publish> for Inbound {
    /// Takes topic, payload and user properties (the topic decoded as UTF-8, as MQTT requires).
    fn from(mut p: rumqttc::v5::mqttbytes::v5::Publish) -> Inbound {
        let topic = match String::from_utf8(p.topic.to_vec()) {
            Ok(t) => t,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        };
        let mut inbound = Inbound::new(topic, Vec::from(std::mem::take(&mut p.payload)));
        if let Some(props) = p.properties.as_mut() {
            inbound.user_properties = std::mem::take(&mut props.user_properties);
        }
        inbound
    }
}

impl From<rumqttc::Publish> for Inbound {
    /// Takes topic and payload (MQTT 3.1.1 has no properties).
    fn from(mut p: rumqttc::Publish) -> Inbound {
        Inbound::new(
            std::mem::take(&mut p.topic),
            Vec::from(std::mem::take(&mut p.payload)),
        )
    }
}
