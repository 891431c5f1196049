//! The commit thread's loop over a [`ConsumerCore`], fed through a channel by whoever polls the connection:
//! the same loop for the crate's [`Consumer`](crate::Consumer) and for an application's own connection.

use std::collections::VecDeque;
use std::fmt;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::inbox::Handler;
use crate::mqtt::budget::{self, Budget};
use crate::mqtt::core::{ConsumerCore, RunSummary, StopHandle};
use crate::mqtt::extract::Inbound;
use crate::mqtt::gate::{AckGate, AckSent, ConnectionId, PubAckSender};
use crate::store::error::{Error, Result};

/// What the connection's side hands to the commit thread, in the order it happened.
pub(crate) enum Event {
    Connected {
        connection: ConnectionId,
        session_present: bool,
    },
    Lost {
        connection: ConnectionId,
        cause: Option<String>,
    },
    Subscribed {
        connection: ConnectionId,
    },
    Publish {
        connection: ConnectionId,
        inbound: Inbound,
        packet_id: Option<u16>,
    },
    PassThrough {
        connection: ConnectionId,
        packet_id: u16,
    },
    /// The connection cannot succeed (refused credentials, bad TLS material): the run ends with it.
    Failed(Error),
    /// The sync thread ended a sync (acks may be ready, and a commit may begin) or the checkpoint thread a
    /// catch-up that held the next commit.
    Synced,
    /// The feed was dropped (the wakers of the sync and checkpoint threads keep the channel open).
    Closed,
}

/// The commit thread is gone (it stopped, or ended with an error): nothing more can be fed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeedClosed;

impl fmt::Display for FeedClosed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the inbox's commit thread has ended")
    }
}

impl std::error::Error for FeedClosed {}

/// The connection's side of a [`ConsumerCore`] that runs on a commit thread ([`ConsumerCore::spawn`]):
/// owned by the code that polls the rumqttc event loop, which calls it for every CONNACK, every PUBLISH
/// for the inbox, every connection error, and the SUBACK that grants its subscriptions
/// ([`Feed::subscribed`], for the health statistics only). It tags each delivery with the current
/// connection and keeps the [`AckGate`] in step, so the commit thread never sends an ack on a newer
/// connection.
///
/// [`Feed::publish`] (and [`Feed::pass_through`], for its event) blocks while the deliveries handed over and
/// not yet committed hold more than the memory budget ([`ConsumerCore::memory_budget`], 2 MiB by default; the
/// `Consumer`'s is [`Consumer::memory_budget`](crate::Consumer::memory_budget)): the caller stops polling the
/// event loop, so nothing more is read from the socket and TCP pushes back on the broker. This never
/// deadlocks on the client's request channel, which only this caller drains (by polling): while it is full of
/// acks, the commit thread keeps the next acks (in order, as runs of packet ids) and goes on committing, and
/// the room that frees in the budget brings this caller back to polling. Only while a commit thread that is
/// ending (stopped, or idle) waits to queue its last acks is the limit lifted (at most 10 s). A request
/// channel (rumqttc's `cap`) of about a thousand is enough: rumqttc's queue keeps the largest size it
/// reached, at 216 bytes a request in MQTT 5. A handler that panics closes the feed: a caller waiting here is
/// let go. On an async executor, wrap it in an `AsyncFeed` (feature `tokio`), which waits on the blocking
/// pool, or keep the event loop on a thread of its own.
pub struct Feed {
    tx: Sender<Event>,
    gate: AckGate,
    budget: Budget,
    current: ConnectionId,
    /// The cause for the next `lost`, set by [`Feed::because`].
    cause: Option<String>,
    /// The crate's own connection, which subscribes at QoS 1: a QoS 2 delivery is one a session kept from
    /// an earlier QoS 2 subscription (see [`Feed::publish_v5`]).
    pub(crate) qos2_leftovers: bool,
}

impl fmt::Debug for Feed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Feed")
            .field("current", &self.current)
            .finish()
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        let _ = self.tx.send(Event::Closed);
    }
}

impl Feed {
    /// A sender for the commit loop's own wake-ups (the sync thread's).
    pub(crate) fn waker(&self) -> Sender<Event> {
        self.tx.clone()
    }

    fn send(&self, e: Event) -> std::result::Result<(), FeedClosed> {
        self.tx.send(e).map_err(|_| FeedClosed)
    }

    /// A CONNACK arrived (rumqttc `Incoming::ConnAck`): a new connection, whose deliveries follow.
    pub fn connected(
        &mut self,
        session_present: bool,
    ) -> std::result::Result<ConnectionId, FeedClosed> {
        self.current = self.gate.connected();
        self.send(Event::Connected {
            connection: self.current,
            session_present,
        })?;
        Ok(self.current)
    }

    /// The broker acknowledged the current connection's subscriptions: a SUBACK (rumqttc
    /// `Incoming::SubAck`) whose return codes all grant QoS1 or above. Read them first: a filter refused, or
    /// granted only at QoS0, delivers nothing the inbox can ack. Sets
    /// [`ConsumerStats::subscribed`](crate::ConsumerStats::subscribed) until the connection ends.
    pub fn subscribed(&mut self) -> std::result::Result<(), FeedClosed> {
        self.send(Event::Subscribed {
            connection: self.current,
        })
    }

    /// Why the connection ended, for the next [`Feed::lost`] (or `lost_v5`, `lost_v311`) to carry in its
    /// [`HealthEvent::ConnectionLost`](crate::HealthEvent::ConnectionLost):
    /// `feed.because(&e).lost_v5(&mut connection.eventloop)`.
    pub fn because(&mut self, cause: impl fmt::Display) -> &mut Self {
        self.cause = Some(cause.to_string());
        self
    }

    /// The connection ended: `purge` drops the PUBACKs still queued in the client, under the gate's lock
    /// (see [`AckGate::lost`]). Call it for every error `poll`/`recv` returns, before polling again.
    pub fn lost(&mut self, purge: impl FnOnce()) -> std::result::Result<(), FeedClosed> {
        self.gate.lost(purge);
        let cause = self.cause.take();
        self.send(Event::Lost {
            connection: self.current,
            cause,
        })
    }

    /// [`Feed::lost`] for rumqttc's MQTT 5 event loop (`connection.eventloop` of a sync client).
    pub fn lost_v5(
        &mut self,
        eventloop: &mut rumqttc::v5::EventLoop,
    ) -> std::result::Result<(), FeedClosed> {
        self.gate.lost_v5(eventloop);
        let cause = self.cause.take();
        self.send(Event::Lost {
            connection: self.current,
            cause,
        })
    }

    /// [`Feed::lost`] for rumqttc's MQTT 3.1.1 event loop.
    pub fn lost_v311(
        &mut self,
        eventloop: &mut rumqttc::EventLoop,
    ) -> std::result::Result<(), FeedClosed> {
        self.gate.lost_v311(eventloop);
        let cause = self.cause.take();
        self.send(Event::Lost {
            connection: self.current,
            cause,
        })
    }

    /// A publish for the inbox, received on the current connection at QoS 1 (`packet_id`: `None` for QoS 0;
    /// never a QoS 2 one, see [`Feed::publish_v5`]).
    pub fn publish(
        &mut self,
        inbound: Inbound,
        packet_id: Option<u16>,
    ) -> std::result::Result<(), FeedClosed> {
        self.budget.acquire(budget::held_size(&inbound));
        self.send(Event::Publish {
            connection: self.current,
            inbound,
            packet_id,
        })
    }

    /// An MQTT 5 publish for the inbox (rumqttc `Incoming::Publish`), at QoS 1 or 0.
    ///
    /// A QoS 2 one (a subscription made at QoS 2) ends the run with [`Error::InvalidArgument`], unanswered:
    /// a PUBACK would break the protocol (the broker drops the connection and sends it again, for ever),
    /// and rumqttc forgets the QoS 2 flows it answered at a reconnect, so the broker's PUBREL of one would
    /// then fail the new connection. Subscribe at QoS 1; the broker sends it again once the run is restarted.
    /// (On the [`Consumer`](crate::Consumer)'s own connection, which subscribes at QoS 1, a QoS 2 delivery
    /// was queued by a session under an earlier QoS 2 subscription, and comes at QoS 2 whatever the
    /// subscription now: it is handled as a QoS 0 one, once, and left unanswered, with a warning.)
    pub fn publish_v5(
        &mut self,
        publish: rumqttc::v5::mqttbytes::v5::Publish,
    ) -> std::result::Result<(), FeedClosed> {
        use rumqttc::v5::mqttbytes::QoS;
        if publish.qos == QoS::ExactlyOnce {
            let topic = String::from_utf8_lossy(&publish.topic).into_owned();
            return self.exactly_once(&topic, Inbound::from(publish));
        }
        let packet_id = (publish.qos != QoS::AtMostOnce).then_some(publish.pkid);
        self.publish(Inbound::from(publish), packet_id)
    }

    /// An MQTT 3.1.1 publish for the inbox, at QoS 1 or 0 (QoS 2: see [`Feed::publish_v5`]).
    pub fn publish_v311(
        &mut self,
        publish: rumqttc::Publish,
    ) -> std::result::Result<(), FeedClosed> {
        if publish.qos == rumqttc::QoS::ExactlyOnce {
            let topic = publish.topic.clone();
            return self.exactly_once(&topic, Inbound::from(publish));
        }
        let packet_id = (publish.qos != rumqttc::QoS::AtMostOnce).then_some(publish.pkid);
        self.publish(Inbound::from(publish), packet_id)
    }

    fn exactly_once(
        &mut self,
        topic: &str,
        inbound: Inbound,
    ) -> std::result::Result<(), FeedClosed> {
        let topic = crate::store::records::cut(topic, 256);
        if self.qos2_leftovers {
            log::warn!(
                "a QoS 2 delivery on topic {topic:?}, queued by the session under an earlier QoS 2 \
                 subscription: handled once and left unanswered (the broker holds it until the session ends)"
            );
            return self.publish(inbound, None);
        }
        let why = format!(
            "a QoS 2 delivery on topic {topic:?}: the inbox answers QoS 1 deliveries after their commit; subscribe \
             at QoS 1",
        );
        log::error!("{why}");
        self.fail(Error::InvalidArgument(why))
    }

    /// A QoS1 publish of the same connection that the inbox does not handle (another subscription): the
    /// application has dealt with it, and the commit thread acks it in turn (MQTT requires PUBACKs in
    /// arrival order, so it must not be acked ahead of inbox deliveries received before it).
    ///
    /// Blocks, as [`Feed::publish`] does, while the memory budget is full: a flood of them while the commit
    /// loop is busy (a slow handler, storage being retried) would otherwise pile up in its channel.
    pub fn pass_through(&mut self, packet_id: u16) -> std::result::Result<(), FeedClosed> {
        self.budget.acquire(PASS_THROUGH_HELD);
        self.send(Event::PassThrough {
            connection: self.current,
            packet_id,
        })
    }

    /// Ends the run with `error`: a connection that cannot succeed by retrying, or a subscription the inbox
    /// cannot serve.
    pub(crate) fn fail(&self, error: Error) -> std::result::Result<(), FeedClosed> {
        self.send(Event::Failed(error))
    }

    /// The gate this feed keeps in step.
    pub fn gate(&self) -> &AckGate {
        &self.gate
    }
}

/// What a pass-through holds of the budget until the commit loop takes it from the channel: its event. The
/// loop then keeps only its packet id, among the acks.
const PASS_THROUGH_HELD: usize = std::mem::size_of::<Event>();

/// A feed and the receiving end for the commit loop. The channel itself is unbounded: `budget` bounds
/// the deliveries in it (a channel sized for them would allocate all its slots up front).
pub(crate) fn channel(gate: AckGate, budget: Budget) -> (Feed, Receiver<Event>) {
    let (tx, rx) = mpsc::channel();
    (
        Feed {
            tx,
            gate,
            budget,
            current: ConnectionId(0),
            cause: None,
            qos2_leftovers: false,
        },
        rx,
    )
}

/// How long a stop waits for the last PUBACKs to be queued.
pub(crate) const STOP_WAIT: Duration = Duration::from_secs(10);

/// How a commit loop ended (when not with an error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// A stop was requested.
    Stopped,
    /// Nothing arrived for the idle limit.
    Idle,
    /// The feed was dropped: the connection's side is gone.
    Closed,
}

/// The commit loop's state, on the thread that owns the core.
pub(crate) struct Driver<'a, S: PubAckSender> {
    pub(crate) core: &'a mut ConsumerCore,
    pub(crate) rx: &'a Receiver<Event>,
    pub(crate) gate: &'a AckGate,
    pub(crate) sender: &'a S,
    pub(crate) exit_when_idle: Option<Duration>,
    /// The inflight window: how many unacked deliveries the broker may send.
    pub(crate) window: usize,
    overfed_warned: Option<ConnectionId>,
    budget: Budget,
    /// The budget's bytes of each delivery the core holds, in arrival order (the core lets go of its
    /// deliveries oldest first, or all at once).
    held: VecDeque<usize>,
    /// Wakes the loop when the sync thread ended a sync or the checkpoint thread a catch-up.
    waker: Sender<Event>,
    /// The feed is gone (this loop and the sync and checkpoint threads hold senders of the channel, so it
    /// never disconnects while they run).
    closed: bool,
}

// Also when the handler panics: a reader waiting for room in the budget must wake and find the feed closed,
// not wait for ever.
impl<S: PubAckSender> Drop for Driver<'_, S> {
    fn drop(&mut self) {
        self.budget.close();
        self.core.stop_pipeline();
        // Committed, but the loop ended (an error, the feed closed) before their acks could be queued.
        if self.core.acks_ready() > 0 {
            self.drop_unsent_acks("the commit loop ended before the acks");
        }
    }
}

impl<'a, S: PubAckSender> Driver<'a, S> {
    pub(crate) fn new(
        core: &'a mut ConsumerCore,
        rx: &'a Receiver<Event>,
        gate: &'a AckGate,
        sender: &'a S,
        window: usize,
        budget: Budget,
        waker: Sender<Event>,
    ) -> Self {
        Driver {
            waker,
            closed: false,
            budget,
            held: VecDeque::new(),
            exit_when_idle: core.exit_when_idle,
            core,
            rx,
            gate,
            sender,
            window,
            overfed_warned: None,
        }
    }

    /// Collects, commits and acks until stopped, idle, closed or failed.
    pub(crate) fn run<H: Handler>(&mut self, handler: &mut H) -> Result<End> {
        let mut last_activity = Instant::now();
        let mut connections_seen = self.core.summary.connections;
        let mut backlog_checked = Instant::now();
        let mut acks_waiting = false;
        let stop = self.core.stop.clone();
        let _running = self.core.health.running();
        let waker = self.waker.clone();
        self.core.start_pipeline(move || {
            let _ = waker.send(Event::Synced);
        });
        loop {
            self.core.health.turn();
            self.core.publish_stats();
            if stop.is_stopped() {
                self.finish_acks()?;
                return Ok(End::Stopped);
            }
            if let Some(threshold) = &self.core.receive_only {
                if backlog_checked.elapsed() >= Duration::from_secs(10) {
                    backlog_checked = Instant::now();
                    if let Err(e) = self
                        .core
                        .inbox
                        .warn_if_backlogged(&self.core.scope, threshold)
                    {
                        log::warn!("cannot read the backlog of scope {}: {e}", self.core.scope);
                    }
                }
            }
            // Acks that found rumqttc's request channel full are tried again after a short wait; meanwhile
            // the loop goes on committing, so that the budget's room keeps the poll side polling (it is the
            // only one that drains that channel).
            let first_wait = if acks_waiting {
                Duration::from_millis(1)
            } else {
                Duration::from_millis(100)
            };
            let closed = self.collect(&stop, first_wait)?;
            if self.core.unsettled() > 0 && (closed || self.core.commit_wait().is_none()) {
                let settled = self.core.settle(handler);
                self.release_settled();
                settled?;
                last_activity = Instant::now();
            }
            self.core.take_synced()?;
            acks_waiting = self.send_acks();
            if closed && self.core.unsettled() == 0 {
                self.finish_syncs()?;
                self.send_acks();
                return Ok(End::Closed);
            }
            // A (re)connection is activity too: idle time counts from the latest session start, so a slow
            // handshake does not end the run before the broker had a chance to deliver.
            if self.core.summary.connections != connections_seen {
                connections_seen = self.core.summary.connections;
                last_activity = Instant::now();
            }
            if let Some(idle) = self.exit_when_idle {
                if self.core.unsettled() == 0 && last_activity.elapsed() >= idle {
                    self.finish_acks()?;
                    log::info!("idle for {idle:?}: stopping");
                    return Ok(End::Idle);
                }
            }
        }
    }

    /// Applies events to the core until a batch is held: waits up to `first_wait` for the first, then takes
    /// what is already queued, waiting up to the linger (if any) for more. True when the feed is gone.
    fn collect(&mut self, stop: &StopHandle, first_wait: Duration) -> Result<bool> {
        let size = self.core.batch_size;
        let linger = self.core.linger;
        let mut deadline: Option<Instant> = None;
        if self.closed {
            return Ok(true);
        }
        // A full batch is committed at once, unless the checkpoint thread's catch-up holds it.
        while self.core.unsettled() < size || self.core.commit_wait().is_some() {
            // While the batch should wait for the sync under way, the loop waits for the next event (the
            // sync thread's wake-up among them) or the time to commit.
            let hold = match self.core.unsettled() {
                0 => None,
                _ => self.core.commit_wait(),
            };
            let wait = match (hold, deadline) {
                (Some(hold), _) => hold.min(first_wait),
                (None, Some(d)) => d.saturating_duration_since(Instant::now()),
                // Held from an earlier turn (a batch that was waiting for the sync, or what a full batch
                // left): take what is queued and commit.
                (None, None) if self.core.unsettled() > 0 => Duration::ZERO,
                (None, None) => first_wait,
            };
            let next = if wait.is_zero() {
                self.rx.try_recv().map_err(|e| match e {
                    TryRecvError::Empty => RecvTimeoutError::Timeout,
                    TryRecvError::Disconnected => RecvTimeoutError::Disconnected,
                })
            } else {
                self.rx.recv_timeout(wait)
            };
            let event = match next {
                Ok(e) => e,
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => {
                    self.closed = true;
                    return Ok(true);
                }
            };
            match event {
                Event::Synced => {
                    self.core.take_synced()?;
                    self.send_acks();
                }
                Event::Closed => {
                    self.closed = true;
                    return Ok(true);
                }
                Event::Connected {
                    connection,
                    session_present,
                } => {
                    self.core.connected(connection, session_present);
                    self.release_settled();
                }
                Event::Lost { connection, cause } => {
                    self.core.connection_lost_because(connection, cause);
                    self.release_settled();
                }
                Event::Subscribed { connection } => self.core.subscribed(connection),
                Event::Publish {
                    connection,
                    inbound,
                    packet_id,
                } => {
                    self.held.push_back(budget::held_size(&inbound));
                    self.core.push(connection, inbound, packet_id);
                    self.release_settled();
                    if self.core.unsettled() > 0 {
                        deadline.get_or_insert_with(|| Instant::now() + linger);
                    }
                }
                Event::PassThrough {
                    connection,
                    packet_id,
                } => {
                    self.budget.release(PASS_THROUGH_HELD);
                    self.core.pass_through(connection, packet_id);
                    if self.core.unsettled() == 0 {
                        self.send_acks();
                    }
                }
                Event::Failed(e) => return Err(e),
            }
            if stop.is_stopped() {
                break;
            }
        }
        Ok(false)
    }

    /// Queues the ready acks through the gate, in order, until rumqttc's request channel is full. True when
    /// some are left for the next try: they wait in the core (runs of packet ids there, 216 bytes a request
    /// in rumqttc's channel), not the deliveries behind them. Once the connection has ended the rest stay
    /// unacked (the broker redelivers them).
    fn send_acks(&mut self) -> bool {
        while let Some(ack) = self.core.pop_ack() {
            match self.gate.send(self.sender, ack) {
                AckSent::Sent => self.core.summary.acked += 1,
                AckSent::Stale => {
                    self.core.unpop_ack(ack);
                    self.drop_unsent_acks("the connection ended before the acks");
                    return false;
                }
                AckSent::Full => {
                    self.core.unpop_ack(ack);
                    self.warn_if_overfed(ack.connection);
                    return true;
                }
            }
        }
        false
    }

    /// Waits (at most [`STOP_WAIT`]) for the syncs of the batches committed, queueing each sync's acks as
    /// it ends.
    fn finish_syncs(&mut self) -> Result<()> {
        let deadline = Instant::now() + STOP_WAIT;
        while self.core.await_sync(deadline)? {
            self.send_acks();
        }
        Ok(())
    }

    /// Before the loop ends: queues the acks still waiting for room, for at most [`STOP_WAIT`]. The limit of
    /// the budget is lifted meanwhile: the side that drains rumqttc's channel may be waiting for room in it,
    /// and nothing is committed any more to make room. What arrives meanwhile is not committed: left unacked
    /// for the broker to redeliver, and dropped rather than held.
    fn finish_acks(&mut self) -> Result<()> {
        let started = Instant::now();
        self.finish_syncs()?;
        self.budget.lend();
        let result = loop {
            if !self.send_acks() {
                break Ok(());
            }
            if started.elapsed() >= STOP_WAIT {
                self.drop_unsent_acks("the MQTT client's request channel stayed full");
                break Ok(());
            }
            let mut failed = None;
            while let Ok(event) = self.rx.try_recv() {
                match event {
                    Event::Publish { inbound, .. } => {
                        self.budget.release(budget::held_size(&inbound));
                        self.core.summary.received += 1;
                        self.core.summary.dropped_stale += 1;
                    }
                    // The gate then refuses the old connection's acks, and they are counted as dropped.
                    Event::Connected {
                        connection,
                        session_present,
                    } => self.core.connected(connection, session_present),
                    Event::Lost { connection, cause } => {
                        self.core.connection_lost_because(connection, cause)
                    }
                    Event::Subscribed { connection } => self.core.subscribed(connection),
                    Event::PassThrough { .. } => self.budget.release(PASS_THROUGH_HELD),
                    Event::Synced | Event::Closed => {}
                    Event::Failed(e) => failed = Some(e),
                }
            }
            if let Some(e) = failed {
                self.drop_unsent_acks("the connection failed before the acks");
                break Err(e);
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        self.budget.restore();
        result
    }

    /// Gives the budget back the bytes of the deliveries the core no longer holds.
    fn release_settled(&mut self) {
        let mut freed = 0;
        while self.held.len() > self.core.unsettled() {
            freed += self.held.pop_front().unwrap_or(0);
        }
        self.budget.release(freed);
    }

    fn drop_unsent_acks(&mut self, why: &str) {
        let mut left = 0;
        while self.core.pop_ack().is_some() {
            left += 1;
        }
        log::info!("{why}: leaving {left} settled deliveries unacked; the broker redelivers them");
        self.core.summary.dropped_stale += left;
    }

    /// More deliveries unacked than the inflight window allows: the broker does not wait for our PUBACKs
    /// (MQTT 5 Receive Maximum, or the 3.1.1 window configured). The budget still bounds the deliveries
    /// held, and the acks waiting for the client's event loop are kept as runs of packet ids; said once
    /// per connection.
    fn warn_if_overfed(&mut self, connection: ConnectionId) {
        let unacked = self.core.acks_ready() + self.core.acks_syncing() + self.core.unsettled();
        if unacked > self.window && self.overfed_warned != Some(connection) {
            self.overfed_warned = Some(connection);
            log::warn!(
                "{unacked} deliveries wait unacked, more than the inflight window of {}: the broker does not \
                 wait for our PUBACKs (it ignores the window), and the MQTT client sends them more slowly \
                 than it reads",
                self.window
            );
        }
    }
}

/// The commit thread of a [`ConsumerCore`] started with [`ConsumerCore::spawn`].
#[derive(Debug)]
pub struct CommitThread {
    handle: JoinHandle<(ConsumerCore, Result<RunSummary>)>,
    stop: StopHandle,
}

impl CommitThread {
    /// Asks the thread to stop: it finishes the batch in flight, queues its acks, and ends.
    pub fn stop(&self) {
        self.stop.stop();
    }

    /// A handle that stops the thread, usable from anywhere (a signal flag, say).
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// True once the thread has ended (stopped, its feed dropped, or an error).
    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Waits for the thread to end; gives back the core (and its inbox) and how the run went. Stop it (or
    /// drop its [`Feed`]) first.
    pub fn join(self) -> (ConsumerCore, Result<RunSummary>) {
        match self.handle.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

impl ConsumerCore {
    /// Runs this core on a commit thread of its own and returns the [`Feed`] for the code that polls the
    /// connection. The thread commits what it is fed with `handler`, and queues each PUBACK with
    /// `client` (a clone of the rumqttc client of that connection) through the feed's [`AckGate`]. It
    /// ends when stopped ([`CommitThread::stop`]: the batch in flight is committed and acked first), when
    /// the feed is dropped, or with the error of storage that kept failing
    /// ([`ConsumerCore::storage_retry_limit`]). `window` is the broker's inflight window (our MQTT 5
    /// Receive Maximum, or the broker's 3.1.1 limit).
    pub fn spawn<H, S>(
        self,
        mut handler: H,
        client: S,
        window: u16,
    ) -> std::io::Result<(Feed, CommitThread)>
    where
        H: Handler + Send + 'static,
        S: PubAckSender + Send + 'static,
    {
        let gate = AckGate::new();
        let mut core = self.gate(gate.clone());
        if core.batch_size > usize::from(window.max(1)) {
            core.batch_size = usize::from(window.max(1));
        }
        let stop = core.stop_handle();
        let budget = Budget::new(core.memory_budget);
        let (feed, rx) = channel(gate.clone(), budget.clone());
        let waker = feed.waker();
        let handle = std::thread::Builder::new()
            .name(crate::mqtt::conn::thread_name("inbox-commit-", &core.scope))
            .spawn(move || {
                let window = usize::from(window.max(1));
                let ran = Driver::new(
                    &mut core,
                    &rx,
                    &gate,
                    &client,
                    window,
                    budget.clone(),
                    waker,
                )
                .run(&mut handler);
                core.summary.peak_held_bytes = budget.peak() as u64;
                let result = ran.map(|_| core.summary);
                core.health
                    .publish_final(&core.summary, core.connection(), core.unsettled());
                (core, result)
            })?;
        Ok((feed, CommitThread { handle, stop }))
    }
}
