//! The outbox relay: publishes committed outbox rows in order and marks each sent only after its PUBACK.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rumqttc::v5::mqttbytes::v5::{PubAckReason, Publish, PublishProperties};
use rumqttc::v5::mqttbytes::QoS as Q5;

use crate::inbox::Inbox;
use crate::mqtt::conn::{next_event, MqttConfig, Protocol};
use crate::mqtt::consumer::StopHandle;
use crate::outbox::Qos;
use crate::store::error::{Error, Result};

/// Settings of a [`Relay`]. Start from [`RelayConfig::default`].
///
/// ```
/// use edge_inbox::RelayConfig;
/// use std::time::Duration;
/// let config = RelayConfig::default().inflight(16).max_backoff(Duration::from_secs(10));
/// assert_eq!(config.get_inflight(), 16);
/// ```
#[derive(Debug, Clone)]
pub struct RelayConfig {
    inflight: u16,
    poll: Duration,
    max_backoff: Duration,
    drain: Duration,
    max_refusals: u32,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            inflight: 32,
            poll: Duration::from_millis(50),
            max_backoff: Duration::from_secs(5),
            max_refusals: 5,
            drain: Duration::from_secs(2),
        }
    }
}

impl RelayConfig {
    /// Most messages published and not yet confirmed at any time. Default 32. The broker's Receive Maximum
    /// lowers it further.
    pub fn inflight(mut self, window: u16) -> Self {
        self.inflight = window.max(1);
        self
    }

    /// How many times the broker may refuse one message (a PUBACK with a failure reason code, e.g. not
    /// authorised; or a connection the broker closed within 2 s after the message was written, alone in
    /// flight, before its PUBACK, without a DISCONNECT naming another cause: a broker that closes the
    /// connection over a packet) before it is parked. Two relays under one client id, which take the session
    /// from each other, can have rows counted so too: give each relay a client id of its own. Parked: kept
    /// in the outbox, counted in [`OutboxBacklog::parked`](crate::OutboxBacklog), no longer holding back the
    /// messages after it, until [`Inbox::requeue_parked_outbox`]. Default 5.
    pub fn max_refusals(mut self, refusals: u32) -> Self {
        self.max_refusals = refusals.max(1);
        self
    }

    /// How often an idle relay looks for newly committed rows. Default 50 ms.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll = interval.max(Duration::from_millis(1));
        self
    }

    /// Longest wait between reconnection attempts (the wait doubles from 100 ms up to this). Default 5 s.
    pub fn max_backoff(mut self, max: Duration) -> Self {
        self.max_backoff = max.max(Duration::from_millis(100));
        self
    }

    /// On stop, how long to wait for the PUBACKs of messages already published. Default 2 s. Whatever is
    /// still unconfirmed stays pending and is sent again by the next relay.
    pub fn drain(mut self, drain: Duration) -> Self {
        self.drain = drain;
        self
    }

    /// The in-flight window.
    pub fn get_inflight(&self) -> u16 {
        self.inflight
    }
}

/// What a [`Relay`] has done since it started. In-memory counts; the durable view is
/// [`Inbox::outbox_backlog`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStats {
    /// Publishes handed to the connection (a resend counts again).
    pub published: u64,
    /// PUBACKs with a success reason code (QoS0 messages count when written).
    pub confirmed: u64,
    /// Rows marked sent in the database.
    pub marked: u64,
    /// PUBACKs with a failure reason code (the row stays pending and is sent again after a backoff, or is
    /// parked after [`RelayConfig::max_refusals`]), connections the broker closed right after a row written
    /// alone (counted against it the same way), and rows parked unsent because the broker's CONNACK rules
    /// them out.
    pub refused: u64,
    /// Connections accepted by the broker.
    pub connections: u64,
    /// Connection attempts that failed, and connections lost.
    pub connection_failures: u64,
    /// Storage errors met (reading rows or marking them; each retried).
    pub storage_errors: u64,
}

/// Publishes the outbox: a thread that sends committed rows over its own MQTT 5 connection, in seq order,
/// with the user properties `message-id` and `producer` of each row and `sent-at` (the row's commit time,
/// Unix seconds as a decimal string, the same on every resend), and marks a row sent only after the
/// broker's PUBACK for it.
///
/// - **Durable first.** A row is published only after a sync of the WAL that began after its commit: a writer
///   that commits without a sync of its own (commits overlapping their syncs on a slow card, or
///   [`Synchronous::Normal`](crate::Synchronous)) could lose the row, and the effect it came with, at a power
///   cut, and the message would then be one the gateway never made. The relay syncs at most once per
///   [`RelayConfig::poll_interval`] for the rows committed since its last sync (a device flush even when the
///   writer synced them: one for many rows), so a new row waits up to that interval more.
/// - **At least once, stable id.** A crash or a lost connection between the publish and the mark leaves
///   the row pending; the next connection (or the next relay, after a restart) sends it again with the same
///   message id, which an edge-inbox consumer downstream deduplicates. Rows are never marked before their
///   PUBACK.
/// - **Order.** Rows leave in commit (seq) order. After a reconnect the relay starts again from the oldest
///   unconfirmed row, so a receiver may see repeats of messages it already has; the first copies arrive in
///   order. A publish the broker *refuses* (PUBACK with a failure reason code, e.g. not authorized) is sent
///   again after a backoff, by which time later messages of the same window may have been delivered; and a
///   row parked and then requeued ([`Inbox::requeue_parked_outbox`]) goes out after the rows that went on
///   while it was parked (the relay looks for rows requeued behind it once per
///   [`RelayConfig::poll_interval`], without reconnecting). Only these two cases reorder.
/// - **Parked, not stuck.** A row the broker refused [`RelayConfig::max_refusals`] times (a connection it
///   closed right after the row was written alone, before its PUBACK, counts as a refusal), or one its
///   CONNACK rules out (larger than its Maximum Packet Size, retained where Retain Available is false,
///   QoS 1 where its Maximum QoS is 0: it could never be sent, and the broker would close the connection on
///   it), is parked: kept, counted in [`OutboxBacklog::parked`](crate::OutboxBacklog), no longer holding
///   back the rows after it, until [`Inbox::requeue_parked_outbox`].
/// - **Bounded.** At most [`RelayConfig::inflight`] messages are unconfirmed at a time; while the broker is
///   away rows wait in the database and the relay retries with backoff.
/// - **Threads.** The relay thread owns its [`Inbox`] (open a second one on the same file: reading the
///   outbox never blocks a consumer beyond SQLite's usual locking) and a poll thread per connection owns
///   rumqttc: it only forwards events and never touches SQLite.
///
/// Give the relay a client id of its own (not the consumer's); it connects with a clean session. MQTT 3.1.1
/// is not supported (it has no user properties to carry the id).
pub struct Relay {
    stop: StopHandle,
    stats: Arc<Mutex<RelayStats>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("stats", &self.stats())
            .finish()
    }
}

impl Relay {
    /// Starts a relay with [`RelayConfig::default`]. See [`Relay::start_with`].
    pub fn start(inbox: Inbox, mqtt: MqttConfig) -> Result<Relay> {
        Relay::start_with(inbox, mqtt, RelayConfig::default())
    }

    /// Starts the relay thread on `inbox` (its own connection to the database file) and `mqtt` (host,
    /// port, client id, credentials, TLS; subscriptions are ignored). Returns at once; the thread connects,
    /// retries with backoff and publishes until [`Relay::stop`].
    ///
    /// Errors: [`Error::InvalidArgument`] for MQTT 3.1.1 or a host, client id or keep-alive the consumer
    /// would refuse too ([`Consumer::run`](crate::Consumer::run)), or when the thread cannot be started.
    pub fn start_with(inbox: Inbox, mqtt: MqttConfig, config: RelayConfig) -> Result<Relay> {
        if mqtt.protocol != Protocol::V5 {
            return Err(Error::InvalidArgument(
                "the outbox relay needs MQTT 5 (the message id travels in a user property)".into(),
            ));
        }
        mqtt.check(false)?;
        let stop = StopHandle::default();
        let stats = Arc::new(Mutex::new(RelayStats::default()));
        let thread = {
            let stop = stop.clone();
            let stats = stats.clone();
            std::thread::Builder::new()
                .name(crate::mqtt::conn::thread_name(
                    "outbox-relay-",
                    &mqtt.client_id,
                ))
                .spawn(move || {
                    RelayLoop {
                        inbox,
                        mqtt,
                        config,
                        stop,
                        stats,
                        suspects: Vec::new(),
                        durable_through: 0,
                        synced_at: None,
                        sync_retry_at: None,
                        sync_backoff: FIRST_BACKOFF,
                    }
                    .run()
                })
                .map_err(|e| {
                    Error::InvalidArgument(format!("cannot start the relay thread: {e}"))
                })?
        };
        Ok(Relay {
            stop,
            stats,
            thread: Some(thread),
        })
    }

    /// A handle that stops the relay from anywhere (the relay then finishes as [`Relay::stop`] describes).
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// A snapshot of the counts so far.
    pub fn stats(&self) -> RelayStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// True while the relay thread runs.
    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Stops publishing new rows, waits up to [`RelayConfig::drain`] for the PUBACKs of those in flight,
    /// marks them, disconnects (waiting up to 6 s for the connection to end; a dead link is left to time out
    /// on its own) and joins the thread. Returns the final counts.
    pub fn stop(mut self) -> RelayStats {
        self.shutdown();
        self.stats()
    }

    fn shutdown(&mut self) {
        self.stop.stop();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                log::error!("the outbox relay thread panicked");
            }
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// What the broker's CONNACK allows a publish to be.
#[derive(Debug, Clone, Copy)]
struct Allowed {
    /// Maximum Packet Size, if it set one.
    max_packet: Option<u32>,
    /// Retain Available (absent: yes).
    retain: bool,
    /// Maximum QoS (absent: 2).
    max_qos: u8,
}

impl Allowed {
    /// Before any CONNACK: nothing known, nothing refused.
    const ANY: Allowed = Allowed {
        max_packet: None,
        retain: true,
        max_qos: 2,
    };
}

/// What a connection's poll thread tells the relay thread.
enum RelayEvent {
    /// CONNACK, with what the broker allows.
    Connected(Allowed),
    /// rumqttc wrote the next queued publish, with this packet id (0 for QoS0).
    Published(u16),
    PubAck {
        pkid: u16,
        ok: bool,
    },
    /// The connection ended; `blames_a_packet` unless the broker's DISCONNECT named a cause that is not
    /// about what it was sent (another connection took the session, the server shuts down, a quota).
    Lost {
        why: String,
        blames_a_packet: bool,
    },
}

/// One connection: a fresh rumqttc client, so that nothing of an earlier connection is replayed behind our
/// back and every `Outgoing::Publish` is one of ours, in the order we queued them.
struct Link {
    client: rumqttc::v5::Client,
    rx: Receiver<RelayEvent>,
    stop: Arc<AtomicBool>,
    poller: Option<JoinHandle<()>>,
}

impl Link {
    fn open(mqtt: &MqttConfig, window: u16) -> std::io::Result<Link> {
        let mut o = rumqttc::v5::MqttOptions::new(&mqtt.client_id, &mqtt.host, mqtt.port);
        o.set_clean_start(true)
            .set_keep_alive(mqtt.keep_alive)
            .set_outgoing_inflight_upper_limit(window);
        o.set_transport(mqtt.transport());
        if let Some((u, p)) = &mqtt.credentials {
            o.set_credentials(u, p);
        }
        let (client, conn) = rumqttc::v5::Client::new(o, usize::from(window) + 8);
        let (tx, rx) = channel();
        let stop = Arc::new(AtomicBool::new(false));
        let poller = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(crate::mqtt::conn::thread_name(
                    "relay-poll-",
                    &mqtt.client_id,
                ))
                .spawn(move || poll(conn, tx, stop))?
        };
        Ok(Link {
            client,
            rx,
            stop,
            poller: Some(poller),
        })
    }

    fn close(mut self) {
        // The flag first: the poll thread, woken by the DISCONNECT, then waits no longer than its grace.
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.client.try_disconnect();
        // rumqttc reads no request while its in-flight window is full, the DISCONNECT included: on a dead
        // link the poll thread could wait for the next keep-alive. It is left to end on its own then.
        let deadline = Instant::now() + CLOSE_WAIT;
        loop {
            match self
                .rx
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(_) => continue,
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    log::warn!(
                        "outbox relay: the connection's poll thread did not end within {CLOSE_WAIT:?}; \
                         left to end with its connection"
                    );
                    return;
                }
            }
        }
        if let Some(p) = self.poller.take() {
            let _ = p.join();
        }
    }
}

/// Whether the end of a connection can have been over a packet the relay sent: a plain close or error, or a
/// DISCONNECT whose reason code is about a packet (malformed, not authorised, a topic the broker does not
/// take), not about the session or the server.
fn blames_a_packet(e: &rumqttc::v5::ConnectionError) -> bool {
    use rumqttc::v5::mqttbytes::v5::DisconnectReasonCode as R;
    match e {
        rumqttc::v5::ConnectionError::MqttState(rumqttc::v5::StateError::ServerDisconnect {
            reason_code,
            ..
        }) => matches!(
            reason_code,
            R::UnspecifiedError
                | R::MalformedPacket
                | R::ProtocolError
                | R::ImplementationSpecificError
                | R::NotAuthorized
                | R::TopicNameInvalid
                | R::PacketTooLarge
                | R::PayloadFormatInvalid
                | R::RetainNotSupported
                | R::QoSNotSupported
        ),
        _ => true,
    }
}

fn poll(mut conn: rumqttc::v5::Connection, tx: Sender<RelayEvent>, stop: Arc<AtomicBool>) {
    use rumqttc::v5::{Event as E, Incoming as Packet};
    use rumqttc::Outgoing;
    let mut stopping_since = None;
    loop {
        let next = next_event(&mut stopping_since, &stop, |wait| match wait {
            None => conn.recv().ok(),
            Some(d) => conn.recv_timeout(d).ok(),
        });
        let Some(next) = next else { return };
        let event = match next {
            Ok(E::Incoming(Packet::ConnAck(ack))) => {
                let p = ack.properties.as_ref();
                RelayEvent::Connected(Allowed {
                    max_packet: p.and_then(|p| p.max_packet_size),
                    retain: p.and_then(|p| p.retain_available) != Some(0),
                    max_qos: p.and_then(|p| p.max_qos).unwrap_or(2),
                })
            }
            Ok(E::Outgoing(Outgoing::Publish(pkid))) => RelayEvent::Published(pkid),
            Ok(E::Incoming(Packet::PubAck(ack))) => RelayEvent::PubAck {
                pkid: ack.pkid,
                ok: matches!(
                    ack.reason,
                    PubAckReason::Success | PubAckReason::NoMatchingSubscribers
                ),
            },
            Ok(_) => continue,
            Err(e) => {
                // A fresh link is opened for the next attempt; this one is done.
                let blames_a_packet = blames_a_packet(&e);
                let _ = tx.send(RelayEvent::Lost {
                    why: e.to_string(),
                    blames_a_packet,
                });
                return;
            }
        };
        if tx.send(event).is_err() {
            return;
        }
    }
}

const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// How long closing a connection waits for its poll thread: the thread's own grace for the DISCONNECT, and
/// a second more.
const CLOSE_WAIT: Duration = Duration::from_secs(6);

/// A connection lost within this time after a write makes the rows still in flight suspects, and a row
/// written alone a refusal ([`RelayLoop::lost_after`]): a broker closes the connection over a packet as soon
/// as it reads it.
const SUSPECT_LOSS: Duration = Duration::from_secs(2);

/// How a connection ended.
enum Ended {
    Stopped,
    Lost {
        was_connected: bool,
        blames_a_packet: bool,
    },
    /// The broker refused a publish: start over from the oldest pending row after a backoff.
    Refused,
}

struct RelayLoop {
    inbox: Inbox,
    mqtt: MqttConfig,
    config: RelayConfig,
    stop: StopHandle,
    stats: Arc<Mutex<RelayStats>>,
    /// Rows in flight when a connection was lost right after a write, before their PUBACKs: the broker may
    /// have closed it over one of them. While any is left, rows go one at a time, so that a loss right
    /// after one names it ([`RelayLoop::lost_after`]).
    suspects: Vec<i64>,
    /// Rows up to this seq were committed before a successful sync of the WAL began: they may be published.
    durable_through: i64,
    /// When the latest sync for new rows began: at most one per poll interval.
    synced_at: Option<Instant>,
    /// After a failed sync, none before this; the wait doubles up to the longest backoff.
    sync_retry_at: Option<Instant>,
    sync_backoff: Duration,
}

/// Rows of one connection on their way to being marked sent.
#[derive(Default)]
struct Flight {
    /// Queued to rumqttc, packet id not assigned yet, in queue order: (seq, qos).
    queued: VecDeque<(i64, Qos)>,
    /// Packet id -> seq, published and awaiting the PUBACK.
    unacked: HashMap<u16, i64>,
    /// Confirmed, not yet marked in the database.
    confirmed: Vec<i64>,
    /// Highest seq queued on this connection.
    cursor: i64,
    /// When to look again for pending rows behind the cursor (rows requeued from parked).
    behind_at: Option<Instant>,
    /// When this connection last wrote a QoS 1 row to the broker, and whether it went one at a time then.
    last_written: Option<(Instant, bool)>,
}

impl Flight {
    fn outstanding(&self) -> usize {
        self.queued.len() + self.unacked.len() + self.confirmed.len()
    }

    /// The seqs this connection holds, in any stage.
    fn held(&self) -> std::collections::HashSet<i64> {
        let queued = self.queued.iter().map(|(s, _)| *s);
        queued
            .chain(self.unacked.values().copied())
            .chain(self.confirmed.iter().copied())
            .collect()
    }
}

impl RelayLoop {
    fn bump(&self, f: impl FnOnce(&mut RelayStats)) {
        f(&mut self.stats.lock().unwrap_or_else(|e| e.into_inner()));
    }

    fn run(mut self) {
        log::info!("outbox relay starting: {:?}", self.mqtt);
        let mut backoff = FIRST_BACKOFF;
        let mut leftover: Vec<i64> = Vec::new();
        while !self.stop.is_stopped() {
            let link = match Link::open(&self.mqtt, self.config.inflight) {
                Ok(l) => l,
                Err(e) => {
                    log::error!("outbox relay cannot start its poll thread: {e}");
                    self.nap(backoff);
                    backoff = (backoff * 2).min(self.config.max_backoff);
                    continue;
                }
            };
            let carried = leftover.len();
            let marked_before = self.marked();
            let mut flight = Flight {
                confirmed: std::mem::take(&mut leftover),
                ..Flight::default()
            };
            self.keep_pending_suspects();
            let ended = self.connection(&link, &mut flight);
            // Lost right after a write, with rows still unacknowledged: one of them may be why. `probing`:
            // that write went one at a time.
            let (in_flight_at_loss, probing) = match (&ended, flight.last_written) {
                (
                    Ended::Lost {
                        was_connected: true,
                        blames_a_packet: true,
                    },
                    Some((at, probing)),
                ) if at.elapsed() <= SUSPECT_LOSS => {
                    let mut seqs: Vec<i64> = flight.unacked.values().copied().collect();
                    seqs.sort_unstable();
                    (seqs, probing)
                }
                _ => (Vec::new(), false),
            };
            // Only a connection that got a row confirmed resets the backoff: one that drops each time a row
            // is sent (a row the broker cannot take) must not reconnect in a tight loop.
            let progressed = self.marked() > marked_before || flight.confirmed.len() > carried;
            link.close();
            // Marks that could not be written yet are kept for the next connection (resending them is
            // harmless, but needless).
            self.mark(&mut flight);
            leftover = flight.confirmed;
            match ended {
                Ended::Stopped => break,
                Ended::Refused => {
                    self.nap(backoff);
                    backoff = (backoff * 2).min(self.config.max_backoff);
                }
                Ended::Lost { was_connected, .. } => {
                    self.bump(|s| s.connection_failures += 1);
                    match in_flight_at_loss[..] {
                        [] => {}
                        // One at a time: the row the broker dropped the connection over.
                        [seq] if probing => self.lost_after(seq),
                        _ => self.suspects = in_flight_at_loss,
                    }
                    if was_connected && progressed {
                        backoff = FIRST_BACKOFF;
                    }
                    self.nap(backoff);
                    backoff = (backoff * 2).min(self.config.max_backoff);
                }
            }
        }
        log::info!("outbox relay stopped: {:?}", self.stats.lock().map(|s| *s));
    }

    /// The connection was lost right after it wrote row `seq`, the only one in flight, before its PUBACK: the
    /// broker may have closed it over that row (a topic deeper than it allows, an ACL that disconnects), and
    /// would again at every reconnection, holding back every row behind it. Such a loss counts as a refusal
    /// of the row, so that it is parked after [`RelayConfig::max_refusals`] refusals and such losses, as a
    /// refused row is.
    fn lost_after(&mut self, seq: i64) {
        log::warn!(
            "outbox relay: the connection was lost within {} s after it wrote message seq {seq}, alone in \
             flight, before its PUBACK; counted as a refusal of that message",
            SUSPECT_LOSS.as_secs()
        );
        self.bump(|s| s.refused += 1);
        match self.inbox.outbox_refused(seq, self.config.max_refusals) {
            Ok(true) => {
                self.suspects.retain(|s| *s != seq);
                log::error!(
                    "outbox message seq {seq}: the broker refused it or dropped the connection over it \
                     {} times: parked for an operator (Inbox::requeue_parked_outbox); the messages after it \
                     go on",
                    self.config.max_refusals
                );
            }
            Ok(false) => {}
            Err(_) => self.bump(|s| s.storage_errors += 1),
        }
    }

    /// Forgets suspects that are no longer pending (sent or parked meanwhile, by this relay or another).
    fn keep_pending_suspects(&mut self) {
        let inbox = &self.inbox;
        self.suspects
            .retain(|seq| !matches!(inbox.outbox_pending_row(*seq), Ok(None)));
    }

    /// Rows in flight at most: one at a time while suspects are left.
    fn window(&self) -> usize {
        if self.suspects.is_empty() {
            usize::from(self.config.inflight)
        } else {
            1
        }
    }

    fn marked(&self) -> u64 {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).marked
    }

    fn nap(&self, d: Duration) {
        let deadline = Instant::now() + d;
        while !self.stop.is_stopped() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            std::thread::sleep(left.min(Duration::from_millis(20)));
        }
    }

    /// Publishes over one link until it is lost or a stop is asked.
    fn connection(&mut self, link: &Link, flight: &mut Flight) -> Ended {
        let mut connected = false;
        // What the broker's CONNACK allows.
        let mut allowed = Allowed::ANY;
        let mut drain_until: Option<Instant> = None;
        loop {
            if self.stop.is_stopped() {
                let until = *drain_until.get_or_insert_with(|| Instant::now() + self.config.drain);
                if !connected
                    || (flight.queued.is_empty() && flight.unacked.is_empty())
                    || Instant::now() >= until
                {
                    return Ended::Stopped;
                }
            } else if connected && flight.outstanding() < self.window() {
                if let Err(e) = self.fill(link, flight, self.window(), allowed) {
                    return e;
                }
            }
            let mut next = match link.rx.recv_timeout(self.config.poll) {
                Ok(e) => Some(e),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => {
                    return Ended::Lost {
                        was_connected: connected,
                        blames_a_packet: false,
                    }
                }
            };
            while let Some(event) = next.take() {
                match event {
                    RelayEvent::Connected(a) => {
                        connected = true;
                        allowed = a;
                        self.bump(|s| s.connections += 1);
                        log::info!("outbox relay connected");
                    }
                    RelayEvent::Published(pkid) => match flight.queued.pop_front() {
                        Some((seq, Qos::AtMostOnce)) => {
                            flight.confirmed.push(seq);
                            self.bump(|s| s.confirmed += 1);
                        }
                        Some((seq, _)) => {
                            flight.last_written = Some((Instant::now(), !self.suspects.is_empty()));
                            flight.unacked.insert(pkid, seq);
                        }
                        None => log::warn!("outbox relay: publish {pkid} that was not queued"),
                    },
                    RelayEvent::PubAck { pkid, ok } => match flight.unacked.remove(&pkid) {
                        None => log::warn!("outbox relay: PUBACK {pkid} for nothing in flight"),
                        Some(seq) if ok => {
                            flight.confirmed.push(seq);
                            self.suspects.retain(|s| *s != seq);
                            self.bump(|s| s.confirmed += 1);
                        }
                        Some(seq) => {
                            self.bump(|s| s.refused += 1);
                            log::warn!(
                                "the broker refused outbox message seq {seq}; it stays pending and is sent \
                                 again after a backoff"
                            );
                            match self.inbox.outbox_refused(seq, self.config.max_refusals) {
                                Ok(true) => log::error!(
                                    "outbox message seq {seq} refused {} times: parked for an operator \
                                     (Inbox::requeue_parked_outbox); the messages after it go on",
                                    self.config.max_refusals
                                ),
                                Ok(false) => {}
                                Err(_) => self.bump(|s| s.storage_errors += 1),
                            }
                            // Start over from the oldest pending row, after a backoff, keeping the order.
                            return Ended::Refused;
                        }
                    },
                    RelayEvent::Lost {
                        why,
                        blames_a_packet,
                    } => {
                        if connected {
                            log::warn!(
                                "outbox relay lost its connection: {why}; unconfirmed messages are sent again"
                            );
                        } else {
                            log::warn!("outbox relay cannot connect: {why}");
                        }
                        return Ended::Lost {
                            was_connected: connected,
                            blames_a_packet,
                        };
                    }
                }
                next = link.rx.try_recv().ok();
            }
            self.mark(flight);
        }
    }

    /// Queues pending rows after the cursor, up to the window. A row too large for the broker's Maximum
    /// Packet Size is parked instead: rumqttc would fail to encode it and drop the connection, and it would
    /// hold back every row after it, for ever.
    fn fill(
        &mut self,
        link: &Link,
        flight: &mut Flight,
        window: usize,
        allowed: Allowed,
    ) -> Result<(), Ended> {
        let room = window - flight.outstanding();
        let mut rows = match self.behind(flight, room).and_then(|mut rows| {
            let more = self
                .inbox
                .outbox_pending(flight.cursor, room - rows.len())?;
            rows.extend(more);
            Ok(rows)
        }) {
            Ok(rows) => rows,
            Err(e) => {
                self.bump(|s| s.storage_errors += 1);
                log::warn!("outbox relay cannot read the outbox: {e}; retrying");
                return Ok(());
            }
        };
        // Nothing is published before the commit that wrote it is on the disk.
        self.make_durable(&rows);
        rows.retain(|r| r.seq <= self.durable_through);
        for row in rows {
            let mut props = PublishProperties {
                user_properties: Vec::with_capacity(row.properties.user_properties.len() + 2),
                content_type: row.properties.content_type,
                response_topic: row.properties.response_topic,
                correlation_data: row.properties.correlation_data.map(Into::into),
                message_expiry_interval: row.properties.message_expiry,
                ..PublishProperties::default()
            };
            props
                .user_properties
                .push(("message-id".into(), row.message_id));
            props
                .user_properties
                .push(("producer".into(), row.producer));
            // When the row was committed, not when it is sent: every resend carries the same stamp.
            props
                .user_properties
                .push(("sent-at".into(), row.created_at.to_string()));
            props.user_properties.extend(row.properties.user_properties);
            let qos = match row.qos {
                Qos::AtMostOnce => Q5::AtMostOnce,
                Qos::AtLeastOnce => Q5::AtLeastOnce,
            };
            // A publish the broker's CONNACK rules out would be answered by closing the connection, and
            // the relay would send it again at every reconnection, holding back every row behind it: it is
            // parked instead, for an operator.
            let too_large = allowed.max_packet.and_then(|max| {
                let size = packet_size(&row.topic, qos, &row.payload, &props);
                (size > max as usize).then(|| {
                    format!("is {size} bytes on the wire, over the broker's maximum packet size of {max}")
                })
            });
            let refused = if too_large.is_some() {
                too_large
            } else if row.properties.retain && !allowed.retain {
                Some("is retained, and the broker does not take retained messages".to_owned())
            } else if qos == Q5::AtLeastOnce && allowed.max_qos == 0 {
                Some("is QoS 1, and the broker takes QoS 0 only".to_owned())
            } else {
                None
            };
            if let Some(why) = refused {
                match self.inbox.outbox_park(row.seq) {
                    Ok(()) => {
                        self.suspects.retain(|s| *s != row.seq);
                        self.bump(|s| s.refused += 1);
                        log::error!(
                            "outbox message seq {} {why}: parked for an operator \
                             (Inbox::requeue_parked_outbox); the messages after it go on",
                            row.seq
                        );
                        flight.cursor = flight.cursor.max(row.seq);
                        continue;
                    }
                    Err(e) => {
                        self.bump(|s| s.storage_errors += 1);
                        log::warn!("outbox relay cannot park a refused message: {e}; retrying");
                        return Ok(());
                    }
                }
            }
            if let Err(e) = link.client.try_publish_with_properties(
                row.topic,
                qos,
                row.properties.retain,
                row.payload,
                props,
            ) {
                log::warn!("outbox relay could not queue a publish: {e}");
                return Err(Ended::Lost {
                    was_connected: true,
                    blames_a_packet: false,
                });
            }
            flight.queued.push_back((row.seq, row.qos));
            flight.cursor = flight.cursor.max(row.seq);
            self.bump(|s| s.published += 1);
        }
        Ok(())
    }

    /// Syncs the WAL when `rows` holds some that no sync covered yet, at most once per poll interval (rows
    /// committed meanwhile wait for the next: one device flush for many rows, on storage where each costs
    /// milliseconds and wear), and not before the backoff after a failed one.
    fn make_durable(&mut self, rows: &[crate::outbox::OutboxRow]) {
        let Some(newest) = rows.iter().map(|r| r.seq).max() else {
            return;
        };
        let now = Instant::now();
        if newest <= self.durable_through
            || self.synced_at.is_some_and(|t| now < t + self.config.poll)
            || self.sync_retry_at.is_some_and(|t| now < t)
        {
            return;
        }
        self.synced_at = Some(now);
        // Every row read was committed before this sync begins; a row committed later has a higher seq.
        match self.inbox.outbox_make_durable() {
            Ok(()) => {
                self.durable_through = newest;
                self.sync_retry_at = None;
                self.sync_backoff = FIRST_BACKOFF;
            }
            Err(e) => {
                self.bump(|s| s.storage_errors += 1);
                log::warn!(
                    "outbox relay cannot sync the outbox's new rows: {e}; trying again in {:?}",
                    self.sync_backoff
                );
                self.sync_retry_at = Some(now + self.sync_backoff);
                self.sync_backoff = (self.sync_backoff * 2).min(self.config.max_backoff);
            }
        }
    }

    /// Pending rows behind the cursor that this connection does not hold (put back by
    /// [`Inbox::requeue_parked_outbox`] after the cursor passed them), up to `room`, oldest first. Looked for
    /// once per poll interval, so a stream of new rows cannot hold them back; a query of the pending index.
    fn behind(
        &mut self,
        flight: &mut Flight,
        room: usize,
    ) -> Result<Vec<crate::outbox::OutboxRow>> {
        let now = Instant::now();
        if flight.cursor == 0 || flight.behind_at.is_some_and(|at| now < at) {
            return Ok(Vec::new());
        }
        flight.behind_at = Some(now + self.config.poll);
        // At most `outstanding` of them are this connection's own.
        let seqs = self
            .inbox
            .outbox_pending_upto(flight.cursor, flight.outstanding() + room)?;
        let held = flight.held();
        let mut rows = Vec::new();
        for seq in seqs.into_iter().filter(|s| !held.contains(s)) {
            if rows.len() == room {
                break;
            }
            if let Some(row) = self.inbox.outbox_pending_row(seq)? {
                log::info!(
                    "outbox relay: message seq {seq} is pending again (requeued); sending it"
                );
                rows.push(row);
            }
        }
        Ok(rows)
    }

    /// Marks confirmed rows sent; on a storage error keeps them for the next try.
    fn mark(&mut self, flight: &mut Flight) {
        if flight.confirmed.is_empty() {
            return;
        }
        match self.inbox.outbox_mark_sent(&flight.confirmed) {
            Ok(()) => {
                let n = flight.confirmed.len() as u64;
                self.bump(|s| s.marked += n);
                flight.confirmed.clear();
            }
            Err(e) => {
                self.bump(|s| s.storage_errors += 1);
                log::warn!("outbox relay cannot mark messages sent: {e}; retrying");
            }
        }
    }
}

/// The size of the PUBLISH packet rumqttc would write for this message, as it checks it against the broker's
/// Maximum Packet Size (with the packet id a QoS1 publish gets).
fn packet_size(topic: &str, qos: Q5, payload: &[u8], props: &PublishProperties) -> usize {
    let mut p = Publish::new(topic, qos, payload.to_vec(), Some(props.clone()));
    if qos != Q5::AtMostOnce {
        p.pkid = 1;
    }
    p.size()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rumqttc::v5::mqttbytes::v5::DisconnectReasonCode as R;
    use rumqttc::v5::{ConnectionError, StateError};

    fn disconnect(reason_code: R) -> ConnectionError {
        ConnectionError::MqttState(StateError::ServerDisconnect {
            reason_code,
            reason_string: None,
        })
    }

    /// A DISCONNECT that names the session or the server (another client took the session, the server shuts
    /// down, a quota) is no row's fault; one about a packet, or a plain close, may be.
    #[test]
    fn only_a_loss_that_can_be_over_a_packet_blames_one() {
        for reason in [
            R::SessionTakenOver,
            R::ServerShuttingDown,
            R::ServerBusy,
            R::KeepAliveTimeout,
            R::QuotaExceeded,
            R::AdministrativeAction,
            R::UseAnotherServer,
            R::NormalDisconnection,
        ] {
            assert!(!blames_a_packet(&disconnect(reason)), "{reason:?}");
        }
        for reason in [
            R::MalformedPacket,
            R::ProtocolError,
            R::TopicNameInvalid,
            R::NotAuthorized,
            R::PacketTooLarge,
            R::UnspecifiedError,
        ] {
            assert!(blames_a_packet(&disconnect(reason)), "{reason:?}");
        }
        assert!(blames_a_packet(&ConnectionError::MqttState(
            StateError::ConnectionAborted
        )));
    }
}
