//! A running consumer's health, seen from outside: connection and outcome events over a bounded channel,
//! and live statistics readable from any thread. Both are fed by the thread that owns the
//! [`ConsumerCore`](crate::ConsumerCore) and never make it wait.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::Duration;

use crate::mqtt::gate::ConnectionId;
use crate::mqtt::summary::RunSummary;
use crate::store::records::{cut, MAX_RECORD_TEXT};

/// What became of one delivery, as a [`HealthEvent::Delivery`] tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settled {
    /// Its effect was committed.
    Processed,
    /// Its identity was already committed with the same content: nothing ran.
    Duplicate,
    /// Its identity was already committed with other content: recorded as a conflict, not applied.
    Conflict,
    /// No identity, a malformed envelope, over a limit, expired, or a sequence another message claimed:
    /// kept in quarantine.
    Quarantined,
    /// Stored as pending (receive-only mode), for a worker to apply.
    Stored,
    /// The handler failed on its last attempt: kept as a dead letter.
    DeadLettered,
    /// Attempt `attempt` (from 1) of the handler failed and was rolled back; another attempt or the dead
    /// letter follows.
    HandlerFailed {
        /// Which attempt failed, from 1.
        attempt: u32,
    },
}

/// A connection change or a delivery's settled fate, in the order the core learnt of it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HealthEvent {
    /// A connection began (its CONNACK arrived).
    Connected {
        /// The connection its deliveries are tagged with.
        connection: ConnectionId,
        /// The CONNACK's flag: false when the broker did not keep our session.
        session_present: bool,
    },
    /// A connection ended; what it delivered and was not acked is redelivered on the next one.
    ConnectionLost {
        /// The connection that ended.
        connection: ConnectionId,
        /// Why, when known: rumqttc's error on the [`Consumer`](crate::Consumer)'s own connection, what the
        /// application gave [`Feed::because`](crate::Feed::because), "a new connection began" when the core
        /// learnt of the next connection first, "the run ended" at the end of a `Consumer::run`.
        cause: Option<String>,
    },
    /// The broker acknowledged the connection's subscriptions: its SUBACK granted every topic filter at
    /// QoS1 or above (or, with no filter configured, the broker kept the session that holds them). From now
    /// on the broker routes matching messages to this connection (to one member of the group, for a
    /// `$share/` filter); those published between the [`HealthEvent::Connected`] and this event may match
    /// no subscription and be dropped, unless a kept session held the subscriptions already.
    Subscribed {
        /// The connection whose subscriptions are in place.
        connection: ConnectionId,
    },
    /// A delivery's fate, sent once the commit (or rollback, for a failed attempt) that decided it is
    /// durable (it returned, or with [overlapping syncs](crate::SyncOverlap) a sync covered it), but not
    /// yet acked (its PUBACK follows; a redelivery after a reconnect is then a
    /// [`Settled::Duplicate`]).
    Delivery {
        /// The connection it arrived on.
        connection: ConnectionId,
        /// The scope it was committed in.
        scope: Arc<str>,
        /// Its message id, its first 4 KiB for a longer one (quarantined over the id limit); `None` for one
        /// quarantined for lack of an identity.
        message_id: Option<String>,
        /// What became of it.
        outcome: Settled,
    },
}

/// The receiving end of a consumer's [`HealthEvent`]s ([`ConsumerCore::events`](crate::ConsumerCore::events),
/// [`Consumer::events`](crate::Consumer::events)).
///
/// The channel is bounded: the commit thread never waits for the reader. When it is full an event is
/// dropped and counted ([`HealthEvents::dropped`]); the counts of [`StatsHandle::snapshot`] stay exact
/// either way. Read it from a thread of your own, or poll it with [`HealthEvents::try_recv`].
#[derive(Debug)]
pub struct HealthEvents {
    rx: Receiver<HealthEvent>,
    shared: Arc<Shared>,
}

impl HealthEvents {
    /// The next event, waiting for it; `None` once the core is gone (or gave its events to a newer
    /// receiver) and every event sent before was taken.
    pub fn recv(&self) -> Option<HealthEvent> {
        self.rx.recv().ok()
    }

    /// The next event, waiting at most `timeout`.
    pub fn recv_timeout(&self, timeout: Duration) -> Option<HealthEvent> {
        self.rx.recv_timeout(timeout).ok()
    }

    /// The next event if one is waiting.
    pub fn try_recv(&self) -> Option<HealthEvent> {
        self.rx.try_recv().ok()
    }

    /// Events dropped so far because the channel was full.
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }
}

/// A consumer's statistics while it runs, at one moment ([`StatsHandle::snapshot`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// The counts of the current (or latest) run so far, as [`RunSummary`]. `acked` counts the PUBACKs
    /// handed to the client while the run goes on, and those written to the socket once a
    /// [`Consumer::run`](crate::Consumer::run) has returned.
    pub summary: RunSummary,
    /// The connection deliveries are taken from now; `None` between connections.
    pub connection: Option<ConnectionId>,
    /// True once the broker acknowledged the current connection's subscriptions
    /// ([`HealthEvent::Subscribed`]), until that connection ends. On an own connection, only once the
    /// application called [`Feed::subscribed`](crate::Feed::subscribed). What a service should wait for
    /// before it reports itself ready: a message published while it is false may match no subscription yet.
    pub subscribed: bool,
    /// The cause of the latest connection loss, if one was given.
    pub last_lost_cause: Option<String>,
    /// Deliveries received and not yet committed.
    pub unsettled: usize,
    /// True while a commit loop runs the core ([`Consumer::run`](crate::Consumer::run) or a
    /// [`CommitThread`](crate::CommitThread)).
    pub running: bool,
    /// Turns of the commit loop so far: it grows at least every 100 ms while the loop is alive and not stuck
    /// in a commit or a handler (what a watchdog should check).
    pub turns: u64,
    /// [`HealthEvent`]s dropped because their channel was full.
    pub events_dropped: u64,
}

/// Reads a consumer's [`ConsumerStats`] from any thread while it runs. Cheap to clone.
///
/// The commit thread updates them after every batch and every turn of its loop (at least every 100 ms
/// while it is alive), and skips an update rather than wait when a reader holds the lock at that moment.
#[derive(Debug, Clone)]
pub struct StatsHandle(Arc<Shared>);

impl StatsHandle {
    /// The statistics now: consistent with each other (one lock, held for a copy).
    pub fn snapshot(&self) -> ConsumerStats {
        let mut s = self.0.lock().clone();
        s.events_dropped = self.0.dropped.load(Ordering::Relaxed);
        s.turns = self.0.turns.load(Ordering::Relaxed);
        s
    }
}

#[derive(Debug, Default)]
struct Shared {
    stats: Mutex<ConsumerStats>,
    dropped: AtomicU64,
    turns: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, ConsumerStats> {
        // Plain counters, each written in one step: a panic elsewhere cannot leave them half-made.
        self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The core's side: the statistics it publishes and the events it sends.
pub(crate) struct Health {
    shared: Arc<Shared>,
    events: Option<SyncSender<HealthEvent>>,
    scope: Arc<str>,
    /// The delivery being settled, by its arrival ticket: a batch's events leave in arrival order.
    pub(crate) ticket: u64,
    /// A batch's delivery events until its settling ends, with their tickets.
    batch: Vec<(u64, HealthEvent)>,
    /// Settled batches' events waiting for the sync that makes their commit durable, by the number of the
    /// sync request that followed the commit (see [`Health::hold`]). One entry per event, so that holding
    /// a batch allocates nothing once the queue has grown.
    held: VecDeque<(u64, HealthEvent)>,
    last_lost_cause: Option<String>,
    /// The current connection's subscriptions are acknowledged; cleared when a connection begins or ends,
    /// so never true without a connection.
    subscribed: bool,
}

impl Health {
    pub(crate) fn new(scope: &str) -> Health {
        Health {
            shared: Arc::default(),
            events: None,
            scope: scope.into(),
            ticket: 0,
            batch: Vec::new(),
            held: VecDeque::new(),
            last_lost_cause: None,
            subscribed: false,
        }
    }

    pub(crate) fn stats(&self) -> StatsHandle {
        StatsHandle(self.shared.clone())
    }

    /// A new bounded channel for the events; a receiver made before sees the end of its stream.
    pub(crate) fn subscribe(&mut self, capacity: usize) -> HealthEvents {
        let (tx, rx) = sync_channel(capacity.max(1));
        self.events = Some(tx);
        HealthEvents {
            rx,
            shared: self.shared.clone(),
        }
    }

    fn send(&mut self, event: HealthEvent) {
        let Some(tx) = &self.events else { return };
        match tx.try_send(event) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            }
            // Nobody listens any more: stop building events.
            Err(TrySendError::Disconnected(_)) => self.events = None,
        }
    }

    pub(crate) fn connected(&mut self, connection: ConnectionId, session_present: bool) {
        self.subscribed = false;
        self.send(HealthEvent::Connected {
            connection,
            session_present,
        });
    }

    pub(crate) fn lost(&mut self, connection: ConnectionId, cause: Option<String>) {
        self.subscribed = false;
        self.last_lost_cause.clone_from(&cause);
        self.send(HealthEvent::ConnectionLost { connection, cause });
    }

    pub(crate) fn subscribed(&mut self, connection: ConnectionId) {
        self.subscribed = true;
        self.send(HealthEvent::Subscribed { connection });
    }

    /// Notes the fate of the delivery being settled ([`Health::ticket`]); sent by [`Health::flush`].
    pub(crate) fn settled(
        &mut self,
        connection: Option<ConnectionId>,
        message_id: Option<&str>,
        outcome: Settled,
    ) {
        if self.events.is_none() {
            return;
        }
        let event = HealthEvent::Delivery {
            connection: connection.unwrap_or(ConnectionId(0)),
            scope: self.scope.clone(),
            // Cut as the records are: a publisher's over-limit id must not be held whole in every event the
            // application has not read yet (the channel is bounded by count, not bytes).
            message_id: message_id.map(|m| cut(m, MAX_RECORD_TEXT).to_owned()),
            outcome,
        };
        self.batch.push((self.ticket, event));
    }

    /// Sends the settled batch's events, in arrival order (a batch quarantines its bad input before it
    /// commits the rest); each attempt's order is kept.
    pub(crate) fn flush(&mut self) {
        let mut batch = std::mem::take(&mut self.batch);
        batch.sort_by_key(|(ticket, _)| *ticket);
        for (_, event) in batch.drain(..) {
            self.send(event);
        }
        self.batch = batch;
    }

    /// Like [`Health::flush`], for a batch committed without its own sync: its events wait until sync
    /// request `request` is done ([`Health::release`]).
    pub(crate) fn hold(&mut self, request: u64) {
        self.batch.sort_by_key(|(ticket, _)| *ticket);
        self.held
            .extend(self.batch.drain(..).map(|(_, event)| (request, event)));
    }

    /// Sends the held events of every batch that sync request `synced` covers, in order.
    pub(crate) fn release(&mut self, synced: u64) {
        while self
            .held
            .front()
            .is_some_and(|(request, _)| *request <= synced)
        {
            let Some((_, event)) = self.held.pop_front() else {
                break;
            };
            self.send(event);
        }
    }

    /// True while events wait for a sync.
    pub(crate) fn holding(&self) -> bool {
        !self.held.is_empty()
    }

    /// Drops the held events: their sync will not come (the run ended without it).
    pub(crate) fn forget_held(&mut self) {
        self.held.clear();
    }

    /// Publishes the counts, unless a reader holds the lock right now (the next turn publishes them).
    pub(crate) fn publish(
        &self,
        summary: &RunSummary,
        connection: Option<ConnectionId>,
        unsettled: usize,
    ) {
        let mut s = match self.shared.stats.try_lock() {
            Ok(s) => s,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        s.summary = *summary;
        s.connection = connection;
        s.subscribed = self.subscribed;
        s.unsettled = unsettled;
        s.last_lost_cause.clone_from(&self.last_lost_cause);
    }

    /// Publishes the counts, waiting for a reader to let go of the lock: at the end of a loop.
    pub(crate) fn publish_final(
        &self,
        summary: &RunSummary,
        connection: Option<ConnectionId>,
        unsettled: usize,
    ) {
        let mut s = self.shared.lock();
        s.summary = *summary;
        s.connection = connection;
        s.subscribed = self.subscribed;
        s.unsettled = unsettled;
        s.last_lost_cause.clone_from(&self.last_lost_cause);
    }

    /// One turn of the commit loop.
    pub(crate) fn turn(&self) {
        self.shared.turns.fetch_add(1, Ordering::Relaxed);
    }

    /// A run's final counts, published whatever readers do, and its connection closed.
    pub(crate) fn finish(&mut self, summary: &RunSummary, connection: Option<ConnectionId>) {
        if let Some(c) = connection {
            self.lost(c, Some("the run ended".to_owned()));
        }
        let mut s = self.shared.lock();
        s.summary = *summary;
        s.connection = None;
        s.subscribed = false;
        s.unsettled = 0;
        s.last_lost_cause.clone_from(&self.last_lost_cause);
    }

    /// Marks a commit loop as running until the guard is dropped.
    pub(crate) fn running(&self) -> Running {
        self.shared.lock().running = true;
        Running(self.shared.clone())
    }
}

/// While alive, a commit loop runs the core.
pub(crate) struct Running(Arc<Shared>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.lock().running = false;
    }
}
