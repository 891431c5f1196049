//! Broker connection: options, the rumqttc client for MQTT 5 or 3.1.1, and the thread that polls it.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rumqttc::v5::mqttbytes::v5 as p5;
use rumqttc::v5::mqttbytes::QoS as Q5;
use rumqttc::{QoS, TlsConfiguration, Transport};

use crate::mqtt::extract::Incoming;

/// MQTT protocol version spoken to the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Protocol {
    /// MQTT 5: identities from user properties; session kept with `clean_start=false` and a session expiry.
    #[default]
    V5,
    /// MQTT 3.1.1: identities from a payload envelope; session kept with `clean_session=false`.
    V311,
}

/// TLS settings (rustls with the ring provider). Certificates and keys are PEM.
#[derive(Clone, Default)]
pub struct Tls {
    /// CA certificates that sign the broker's certificate.
    pub ca_pem: Vec<u8>,
    /// Client certificate chain and private key, for brokers that require client authentication.
    pub client_auth: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The private key never reaches a log.
        f.debug_struct("Tls")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field(
                "client_auth",
                &self.client_auth.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// How to reach the broker and what to subscribe to.
///
/// The session is always persistent (MQTT 5 `clean_start=false` with [`MqttConfig::session_expiry`];
/// 3.1.1 `clean_session=false`) and acks are manual: the broker keeps unacknowledged deliveries across a
/// disconnect and redelivers them, which is what lets the inbox ack only after its commit.
///
/// ```
/// use edge_inbox::{MqttConfig, Protocol};
/// let config = MqttConfig::new("127.0.0.1", 1883, "inventory-gw7")
///     .protocol(Protocol::V5)
///     .subscribe("orders/#")
///     .credentials("gateway", "secret");
/// assert!(!format!("{config:?}").contains("secret"));
/// ```
#[derive(Clone)]
pub struct MqttConfig {
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) client_id: String,
    pub(crate) protocol: Protocol,
    pub(crate) topics: Vec<String>,
    pub(crate) keep_alive: Duration,
    pub(crate) session_expiry: u32,
    pub(crate) inflight: u16,
    pub(crate) max_packet: u32,
    pub(crate) credentials: Option<(String, String)>,
    pub(crate) tls: Option<Tls>,
}

impl fmt::Debug for MqttConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MqttConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("client_id", &self.client_id)
            .field("protocol", &self.protocol)
            .field("topics", &self.topics)
            .field("keep_alive", &self.keep_alive)
            .field("session_expiry", &self.session_expiry)
            .field("inflight", &self.inflight)
            .field("max_packet", &self.max_packet)
            .field("username", &self.credentials.as_ref().map(|(u, _)| u))
            .field("password", &self.credentials.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls)
            .finish()
    }
}

impl MqttConfig {
    /// A broker address and a client id. The client id must be stable across restarts: the broker keys the
    /// persistent session (and the deliveries it holds for us) by it.
    pub fn new(host: impl Into<String>, port: u16, client_id: impl Into<String>) -> MqttConfig {
        MqttConfig {
            host: host.into(),
            port,
            client_id: client_id.into(),
            protocol: Protocol::V5,
            topics: Vec::new(),
            keep_alive: Duration::from_secs(30),
            session_expiry: 7 * 24 * 3600,
            inflight: 20,
            max_packet: MQTT_MAX_PACKET,
            credentials: None,
            tls: None,
        }
    }

    /// Protocol version. Default [`Protocol::V5`].
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.protocol = protocol;
        self
    }

    /// Adds a topic filter, subscribed at QoS1.
    pub fn subscribe(mut self, filter: impl Into<String>) -> Self {
        self.topics.push(filter.into());
        self
    }

    /// Keep-alive interval. Default 30 s.
    pub fn keep_alive(mut self, keep_alive: Duration) -> Self {
        self.keep_alive = keep_alive;
        self
    }

    /// MQTT 5 session expiry interval in seconds: how long the broker keeps our session (and the deliveries
    /// queued for it) while we are disconnected. Default one week. Ignored for 3.1.1, where the broker's
    /// own setting applies.
    pub fn session_expiry(mut self, seconds: u32) -> Self {
        self.session_expiry = seconds;
        self
    }

    /// The broker's window of unacknowledged QoS1 deliveries to this client. For MQTT 5 it is sent as our
    /// Receive Maximum; for 3.1.1 set it to the broker's limit (mosquitto's `max_inflight_messages`, default
    /// 20). The consumer never batches more than this, or it would wait for deliveries the broker holds back
    /// until it acks. Default 20.
    pub fn inflight(mut self, window: u16) -> Self {
        self.inflight = window.max(1);
        self
    }

    /// Largest packet accepted from the broker, in bytes. Default: the MQTT maximum (256 MiB), so that a
    /// delivery over the inbox [`Limits`](crate::Limits) still arrives and is quarantined instead of failing
    /// the connection again at every redelivery. Lower it only together with the broker's own message size
    /// limit: with MQTT 5 the broker drops what exceeds it, with 3.1.1 such a delivery stalls the session.
    pub fn max_packet_size(mut self, bytes: u32) -> Self {
        self.max_packet = bytes.clamp(1024, MQTT_MAX_PACKET);
        self
    }

    /// Username and password. The password is never logged nor shown by `Debug`.
    pub fn credentials(mut self, username: impl Into<String>, password: impl Into<String>) -> Self {
        self.credentials = Some((username.into(), password.into()));
        self
    }

    /// Connects over TLS.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The broker window set with [`MqttConfig::inflight`].
    pub fn get_inflight(&self) -> u16 {
        self.inflight
    }

    pub(crate) fn transport(&self) -> Transport {
        match &self.tls {
            None => Transport::Tcp,
            Some(tls) => {
                // The only provider compiled in; installing it explicitly keeps the choice deterministic.
                let _ = rustls::crypto::ring::default_provider().install_default();
                Transport::Tls(TlsConfiguration::Simple {
                    ca: tls.ca_pem.clone(),
                    alpn: None,
                    client_auth: tls.client_auth.clone(),
                })
            }
        }
    }
}

/// What the poll thread hands to the consumer thread.
pub(crate) enum Event {
    /// A (re)connection was accepted; everything received before it is stale and must not be acked.
    Connected { epoch: u64, session_present: bool },
    /// A publish received on connection `epoch`. `token` is `None` for QoS0 (nothing to ack).
    Publish {
        epoch: u64,
        incoming: Incoming,
        token: Option<AckToken>,
    },
}

/// What a PUBACK needs: the packet id of a QoS1 publish (only ever acked on the connection it came on).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AckToken(u16);

/// The sending half of a connection, owned by the consumer thread.
pub(crate) enum Client {
    V4(rumqttc::Client),
    V5(rumqttc::v5::Client),
}

/// What [`Client::try_ack_on`] did with a PUBACK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AckQueued {
    /// In rumqttc's request queue, for the connection it came on.
    Queued,
    /// The request queue is full (or closed): try again after draining deliveries.
    Full,
    /// The connection it came on has ended: never to be sent.
    Stale,
}

impl Client {
    /// Queues the PUBACK of a delivery received on connection `epoch`, if that connection is still the
    /// current one, without blocking. See [`Shared`] for why the check and the queueing are one step.
    pub(crate) fn try_ack_on(&self, shared: &Shared, epoch: u64, token: AckToken) -> AckQueued {
        let current = shared.lock();
        if *current != epoch {
            return AckQueued::Stale;
        }
        if self.try_ack(token) {
            AckQueued::Queued
        } else {
            AckQueued::Full
        }
    }

    /// Queues the PUBACK without blocking: `false` when rumqttc's request channel is full (or closed).
    fn try_ack(&self, token: AckToken) -> bool {
        match self {
            Client::V4(c) => {
                let mut p = rumqttc::Publish::new("", QoS::AtLeastOnce, Vec::new());
                p.pkid = token.0;
                c.try_ack(&p).is_ok()
            }
            Client::V5(c) => {
                let mut p = p5::Publish::new("", Q5::AtLeastOnce, Vec::new(), None);
                p.pkid = token.0;
                c.try_ack(&p).is_ok()
            }
        }
    }

    /// Queues a DISCONNECT behind the PUBACKs already queued (rumqttc writes its requests in order).
    /// `false` when the request channel is full (or closed).
    pub(crate) fn try_disconnect(&self) -> bool {
        match self {
            Client::V4(c) => c.try_disconnect().is_ok(),
            Client::V5(c) => c.try_disconnect().is_ok(),
        }
    }
}

/// Shared between the poll thread and the consumer: the connection epoch, the stop flag and the count of
/// PUBACKs written to a socket.
///
/// The epoch changes under its lock, and the poll thread purges rumqttc's request queue of PUBACKs while
/// still holding it; [`Client::try_ack_on`] checks the epoch and queues the PUBACK under the same lock. So a
/// PUBACK in that queue was always queued for the connection rumqttc currently writes to: when the
/// connection ends, it is purged before anyone can take the new epoch for it.
pub(crate) struct Shared {
    epoch: Mutex<u64>,
    pub(crate) stop: Arc<AtomicBool>,
    acks_written: AtomicU64,
}

impl Shared {
    pub(crate) fn new() -> Shared {
        Shared {
            epoch: Mutex::new(0),
            stop: Arc::new(AtomicBool::new(false)),
            acks_written: AtomicU64::new(0),
        }
    }

    /// The current connection epoch (odd gaps mark the time between a lost connection and the next).
    pub(crate) fn epoch(&self) -> u64 {
        *self.lock()
    }

    /// PUBACKs rumqttc wrote (and flushed) to a connection so far.
    pub(crate) fn acks_written(&self) -> u64 {
        self.acks_written.load(Ordering::SeqCst)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, u64> {
        // The guarded value is a counter: a panic elsewhere cannot leave it inconsistent.
        self.epoch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a new epoch and, under the same lock, runs `purge` (which drops what belongs to the old one).
    fn next_epoch(&self, purge: impl FnOnce()) -> u64 {
        let mut epoch = self.lock();
        *epoch += 1;
        purge();
        *epoch
    }
}

/// Largest packet MQTT can encode (the maximum Remaining Length plus the fixed header).
const MQTT_MAX_PACKET: u32 = 268_435_455 + 5;

/// The least room in rumqttc's request channel (PUBACKs, subscriptions, the DISCONNECT).
const REQUEST_CHANNEL_MIN: usize = 1024;

/// Outgoing publishes a consumer's connection may have in flight: it sends none. (rumqttc then hands out
/// packet id 1 to every SUBSCRIBE; the consumer sends one SUBSCRIBE per connection, so no two are in flight.)
const CONSUMER_OUTGOING_INFLIGHT: u16 = 1;

/// Creates the client and starts the poll thread, which sends every QoS1 publish and (re)connection to `tx`.
pub(crate) fn start(
    config: &MqttConfig,
    tx: SyncSender<Event>,
    shared: Arc<Shared>,
) -> std::io::Result<(Client, JoinHandle<()>)> {
    // rumqttc's request channel carries our PUBACKs. Roomy (it grows only as used) so queueing one almost
    // never fails: when it is full the consumer must drain deliveries into memory to keep the poll thread
    // moving, and a broker that sends beyond our Receive Maximum (mosquitto 2.0.11 does, with a queue
    // behind the window) would then fill that memory instead of waiting in its own socket buffer.
    let cap = (usize::from(config.inflight) * 4).max(REQUEST_CHANNEL_MIN);
    let topics = config.topics.clone();
    let name = format!("mqtt-poll-{}", config.client_id);
    match config.protocol {
        Protocol::V311 => {
            let mut o = rumqttc::MqttOptions::new(&config.client_id, &config.host, config.port);
            o.set_clean_session(false)
                .set_manual_acks(true)
                .set_keep_alive(config.keep_alive)
                .set_max_packet_size(config.max_packet as usize, config.max_packet as usize);
            o.set_transport(config.transport());
            if let Some((u, p)) = &config.credentials {
                o.set_credentials(u, p);
            }
            let (client, conn) = rumqttc::Client::new(o, cap);
            let sub = client.clone();
            let handle = std::thread::Builder::new()
                .name(name)
                .spawn(move || poll_v4(conn, sub, topics, tx, shared))?;
            Ok((Client::V4(client), handle))
        }
        Protocol::V5 => {
            let mut o = rumqttc::v5::MqttOptions::new(&config.client_id, &config.host, config.port);
            o.set_clean_start(false)
                .set_manual_acks(true)
                .set_keep_alive(config.keep_alive);
            o.set_session_expiry_interval(Some(config.session_expiry));
            o.set_receive_maximum(Some(config.inflight));
            // The consumer publishes nothing, and rumqttc allocates one slot per outgoing inflight message up
            // front: its default (65,535 slots) is 14 MiB of resident memory.
            o.set_outgoing_inflight_upper_limit(CONSUMER_OUTGOING_INFLIGHT);
            o.set_max_packet_size(Some(config.max_packet));
            o.set_transport(config.transport());
            if let Some((u, p)) = &config.credentials {
                o.set_credentials(u, p);
            }
            let (client, conn) = rumqttc::v5::Client::new(o, cap);
            let sub = client.clone();
            let handle = std::thread::Builder::new()
                .name(name)
                .spawn(move || poll_v5(conn, sub, topics, tx, shared))?;
            Ok((Client::V5(client), handle))
        }
    }
}

/// Sleeps `d` in small steps, returning early when stopping.
fn nap(d: Duration, stop: &AtomicBool) {
    let step = Duration::from_millis(20);
    let mut left = d;
    while !left.is_zero() && !stop.load(Ordering::Relaxed) {
        let s = left.min(step);
        std::thread::sleep(s);
        left -= s;
    }
}

fn backoff_next(b: Duration) -> Duration {
    (b * 2).min(Duration::from_secs(5))
}

const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// How long a stopping poll thread keeps writing what was queued before it (the last PUBACKs, then the
/// DISCONNECT) before giving up on the connection.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// The next event, or `None` when the poll thread should end: every client is gone, or a stop has waited
/// its grace for the DISCONNECT to be written and the broker to close the connection.
fn next_event<T, E>(
    stopping_since: &mut Option<std::time::Instant>,
    stop: &AtomicBool,
    recv: impl FnOnce(Option<Duration>) -> Option<Result<T, E>>,
) -> Option<Result<T, E>> {
    if stopping_since.is_none() && stop.load(Ordering::SeqCst) {
        *stopping_since = Some(std::time::Instant::now());
    }
    match stopping_since {
        None => recv(None),
        Some(since) => {
            let left = STOP_GRACE.checked_sub(since.elapsed())?;
            recv(Some(left))
        }
    }
}

fn poll_v4(
    mut conn: rumqttc::Connection,
    client: rumqttc::Client,
    topics: Vec<String>,
    tx: SyncSender<Event>,
    shared: Arc<Shared>,
) {
    use rumqttc::{Event as E, Outgoing, Packet};
    let mut backoff = FIRST_BACKOFF;
    let mut epoch = shared.epoch();
    let mut stopping_since = None;
    loop {
        let next = next_event(&mut stopping_since, &shared.stop, |wait| match wait {
            None => conn.recv().ok(),
            Some(d) => conn.recv_timeout(d).ok(),
        });
        let Some(next) = next else { return };
        match next {
            Ok(E::Incoming(Packet::ConnAck(ack))) => {
                backoff = FIRST_BACKOFF;
                epoch = shared.next_epoch(|| ());
                log::info!(
                    "connected (session present: {}), connection epoch {epoch}",
                    ack.session_present
                );
                // Always: a kept session may lack a filter added to the configuration since.
                let filters = topics
                    .iter()
                    .map(|t| rumqttc::SubscribeFilter::new(t.clone(), QoS::AtLeastOnce));
                if let Err(e) = client.try_subscribe_many(filters) {
                    log::error!("could not queue the subscription: {e}");
                }
                if tx
                    .send(Event::Connected {
                        epoch,
                        session_present: ack.session_present,
                    })
                    .is_err()
                {
                    return;
                }
            }
            Ok(E::Incoming(Packet::Publish(mut p))) => {
                if shared.stop.load(Ordering::SeqCst) {
                    // Never to be committed by this run: left unacked for the broker to redeliver.
                    continue;
                }
                let payload = std::mem::take(&mut p.payload).to_vec();
                let incoming = Incoming::new(std::mem::take(&mut p.topic), payload);
                let token = (p.qos == QoS::AtLeastOnce).then_some(AckToken(p.pkid));
                if tx
                    .send(Event::Publish {
                        epoch,
                        incoming,
                        token,
                    })
                    .is_err()
                {
                    return;
                }
            }
            Ok(E::Outgoing(Outgoing::PubAck(_))) => {
                shared.acks_written.fetch_add(1, Ordering::SeqCst);
            }
            Ok(E::Outgoing(Outgoing::Disconnect)) if shared.stop.load(Ordering::SeqCst) => {
                // Not closed yet: the broker still sends into our socket, and closing it with unread data
                // would reset the connection, discarding the last PUBACKs and the DISCONNECT before the
                // broker reads them. Read on until the broker closes it (an error, below).
                log::debug!("DISCONNECT written; waiting for the broker to close the connection");
            }
            Ok(_) => {}
            Err(e) => {
                // Before anything else: nothing of the old connection may be acked or handed over any more.
                // rumqttc keeps publishes it read before the error and yields them after the next ConnAck.
                let el = &mut conn.eventloop;
                epoch = shared.next_epoch(|| {
                    el.clean();
                    let written = el
                        .state
                        .events
                        .iter()
                        .filter(|e| matches!(e, E::Outgoing(Outgoing::PubAck(_))))
                        .count();
                    shared
                        .acks_written
                        .fetch_add(written as u64, Ordering::SeqCst);
                    el.state.events.clear();
                });
                if shared.stop.load(Ordering::SeqCst) {
                    log::debug!("connection to the broker closed while stopping: {e}");
                    return;
                }
                log::warn!(
                    "connection to the broker lost or refused: {e}; retrying in {backoff:?}"
                );
                nap(backoff, &shared.stop);
                backoff = backoff_next(backoff);
            }
        }
    }
}

fn poll_v5(
    mut conn: rumqttc::v5::Connection,
    client: rumqttc::v5::Client,
    topics: Vec<String>,
    tx: SyncSender<Event>,
    shared: Arc<Shared>,
) {
    use rumqttc::v5::{Event as E, Incoming as Packet};
    use rumqttc::Outgoing;
    let mut backoff = FIRST_BACKOFF;
    let mut epoch = shared.epoch();
    let mut stopping_since = None;
    loop {
        let next = next_event(&mut stopping_since, &shared.stop, |wait| match wait {
            None => conn.recv().ok(),
            Some(d) => conn.recv_timeout(d).ok(),
        });
        let Some(next) = next else { return };
        match next {
            Ok(E::Incoming(Packet::ConnAck(ack))) => {
                backoff = FIRST_BACKOFF;
                epoch = shared.next_epoch(|| ());
                log::info!(
                    "connected (session present: {}), connection epoch {epoch}",
                    ack.session_present
                );
                // Always: a kept session may lack a filter added to the configuration since.
                let filters = topics
                    .iter()
                    .map(|t| p5::Filter::new(t.clone(), Q5::AtLeastOnce));
                if let Err(e) = client.try_subscribe_many(filters) {
                    log::error!("could not queue the subscription: {e}");
                }
                if tx
                    .send(Event::Connected {
                        epoch,
                        session_present: ack.session_present,
                    })
                    .is_err()
                {
                    return;
                }
            }
            Ok(E::Incoming(Packet::Publish(mut p))) => {
                if shared.stop.load(Ordering::SeqCst) {
                    // Never to be committed by this run: left unacked for the broker to redeliver.
                    continue;
                }
                let payload = std::mem::take(&mut p.payload).to_vec();
                let topic = String::from_utf8_lossy(&p.topic).into_owned();
                let mut incoming = Incoming::new(topic, payload);
                if let Some(props) = p.properties.as_mut() {
                    incoming.user_properties = std::mem::take(&mut props.user_properties);
                }
                let token = (p.qos == Q5::AtLeastOnce).then_some(AckToken(p.pkid));
                if tx
                    .send(Event::Publish {
                        epoch,
                        incoming,
                        token,
                    })
                    .is_err()
                {
                    return;
                }
            }
            Ok(E::Outgoing(Outgoing::PubAck(_))) => {
                shared.acks_written.fetch_add(1, Ordering::SeqCst);
            }
            Ok(E::Outgoing(Outgoing::Disconnect)) if shared.stop.load(Ordering::SeqCst) => {
                // Not closed yet: the broker still sends into our socket, and closing it with unread data
                // would reset the connection, discarding the last PUBACKs and the DISCONNECT before the
                // broker reads them. Read on until the broker closes it (an error, below).
                log::debug!("DISCONNECT written; waiting for the broker to close the connection");
            }
            Ok(_) => {}
            Err(e) => {
                // Before anything else: nothing of the old connection may be acked or handed over any more.
                let el = &mut conn.eventloop;
                epoch = shared.next_epoch(|| {
                    el.clean();
                    let written = el
                        .state
                        .events
                        .iter()
                        .filter(|e| matches!(e, E::Outgoing(Outgoing::PubAck(_))))
                        .count();
                    shared
                        .acks_written
                        .fetch_add(written as u64, Ordering::SeqCst);
                    el.state.events.clear();
                });
                if shared.stop.load(Ordering::SeqCst) {
                    log::debug!("connection to the broker closed while stopping: {e}");
                    return;
                }
                log::warn!(
                    "connection to the broker lost or refused: {e}; retrying in {backoff:?}"
                );
                nap(backoff, &shared.stop);
                backoff = backoff_next(backoff);
            }
        }
    }
}
