//! Broker connection: options, the rumqttc client for MQTT 5 or 3.1.1, and the thread that polls it.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use rumqttc::v5::mqttbytes::v5 as p5;
use rumqttc::v5::mqttbytes::QoS as Q5;
use rumqttc::{QoS, TlsConfiguration, Transport};

use crate::mqtt::driver::{Feed, FeedClosed};
use crate::mqtt::gate::PubAckSender;
use crate::mqtt::tls::TlsConfig;
use crate::store::error::Error;

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
    /// False while `inflight` is the default, which [`Consumer`](crate::Consumer) derives from its budget.
    pub(crate) inflight_set: bool,
    pub(crate) max_packet: u32,
    pub(crate) credentials: Option<(String, String)>,
    pub(crate) tls: Option<TlsConfig>,
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
            .field("inflight_set", &self.inflight_set)
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
            inflight: DEFAULT_INFLIGHT,
            inflight_set: false,
            max_packet: DEFAULT_MAX_PACKET,
            credentials: None,
            tls: None,
        }
    }

    /// Protocol version. Default [`Protocol::V5`].
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.protocol = protocol;
        self
    }

    /// Adds a topic filter, subscribed at QoS1 on every connection. The broker must grant it at QoS1 or
    /// above: refused (or granted only at QoS0) before any grant in the run,
    /// [`Consumer::run`](crate::Consumer::run) ends with an error; refused after one, the consumer connects
    /// again with growing backoff. While it is granted,
    /// [`ConsumerStats::subscribed`](crate::ConsumerStats::subscribed) is true. Without any filter the
    /// consumer subscribes to nothing and takes what the broker's kept session delivers.
    ///
    /// The session keeps a filter until it is unsubscribed, so the inbox file records the filters each
    /// client id subscribed (the last 64): one removed from the configuration is unsubscribed on every
    /// connection, and a delivery that only a removed filter covers (one the session had queued for it) is
    /// quarantined ([`InvalidDelivery::NotSubscribed`](crate::InvalidDelivery::NotSubscribed)), never handed
    /// to the handler. A subscription the file never recorded (made by another program with the same
    /// client id) is left as it is, and what it delivers is handled.
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
    /// until it acks. It does not bound memory (a broker may send more; the consumer's memory budget does).
    /// Default: the [`Consumer`](crate::Consumer) derives it from its memory budget (8192 at the default
    /// budget), so that batches can grow to what a slow commit needs.
    pub fn inflight(mut self, window: u16) -> Self {
        self.inflight = window.max(1);
        self.inflight_set = true;
        self
    }

    /// Largest packet accepted from the broker, in bytes. Default [`DEFAULT_MAX_PACKET`] (1 MiB + 64 KiB:
    /// the default payload limit plus room for topic and properties), so a publisher cannot make the
    /// consumer hold large packets in memory. A delivery up to this size but over the inbox
    /// [`Limits`](crate::Limits) arrives and is quarantined; a larger one is never read: with MQTT 5 the
    /// size is sent in CONNECT and the broker drops such a message (mosquitto discards it and logs
    /// "Dropping too large outgoing PUBLISH"; it is not redelivered. mosquitto 2.0.11 drops only an
    /// inflight window's worth per connection: what is queued behind waits for the next connection);
    /// a broker that ignores the announced size is treated like 3.1.1; with 3.1.1 the client cannot announce it, rumqttc drops the
    /// connection when the packet's header arrives and the broker redelivers it at every reconnect, which
    /// stalls the session (logged as an error naming the size): there, set the broker's own limit
    /// (mosquitto `message_size_limit`) at or below this one. At least 1024, at most the MQTT maximum.
    pub fn max_packet_size(mut self, bytes: u32) -> Self {
        self.max_packet = bytes.clamp(1024, MQTT_MAX_PACKET);
        self
    }

    /// Username and password. The password is never logged nor shown by `Debug`.
    pub fn credentials(mut self, username: impl Into<String>, password: impl Into<String>) -> Self {
        self.credentials = Some((username.into(), password.into()));
        self
    }

    /// Connects over TLS, with the settings (and the rustls provider) of `tls`.
    pub fn tls(mut self, tls: TlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The broker window set with [`MqttConfig::inflight`].
    pub fn get_inflight(&self) -> u16 {
        self.inflight
    }

    /// Refuses settings the broker or rumqttc would reject later, or that would silently give up the
    /// persistent session the inbox relies on (`session`: the consumer's; the relay keeps its messages in
    /// the outbox and needs none), with [`Error::InvalidArgument`] naming the setting, before connecting.
    pub(crate) fn check(&self, session: bool) -> Result<(), Error> {
        let bad = |why: String| Err(Error::InvalidArgument(why));
        let host = self.host.as_str();
        if host.is_empty()
            || host.contains("://")
            || host.chars().any(|c| c.is_whitespace() || c == '/')
        {
            return bad(format!(
                "broker host {host:?}: give a host name or an IP address alone (no scheme, path or port)"
            ));
        }
        // rumqttc joins host and port with a colon: a bare IPv6 address needs its brackets.
        if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
            return bad(format!(
                "broker host {host:?}: write an IPv6 address in brackets ([::1]), and the port apart"
            ));
        }
        if self.tls.is_some() && host.starts_with('[') {
            return bad(format!(
                "broker host {host:?}: with TLS give the broker's host name, which its certificate is checked \
                 against"
            ));
        }
        let id = self.client_id.as_str();
        if id.is_empty() && session {
            return bad(
                "an empty client id: the broker would assign a new one, and a new session, at every \
                 connection, so deliveries left unacked at a disconnect would never be redelivered"
                    .into(),
            );
        }
        if id.len() > 65_535 || id.contains('\0') {
            return bad(format!(
                "client id {:?}: at most 65,535 bytes of UTF-8 without NUL",
                crate::store::records::cut(id, 64)
            ));
        }
        let secs = self.keep_alive.as_secs();
        if self.keep_alive.subsec_nanos() != 0 || !(5..=65_535).contains(&secs) {
            return bad(format!(
                "keep-alive {:?}: whole seconds from 5 s to 65,535 s",
                self.keep_alive
            ));
        }
        if session && self.protocol == Protocol::V5 && self.session_expiry == 0 {
            return bad(
                "session expiry 0: the broker would drop the session at a disconnect, with the deliveries \
                 it holds for the consumer"
                    .into(),
            );
        }
        for t in self.topics.iter().filter(|_| session) {
            if t.is_empty() || t.len() > 65_535 || t.contains('\0') || !rumqttc::valid_filter(t) {
                return bad(format!(
                    "{:?} is not a valid MQTT topic filter",
                    crate::store::records::cut(t, 64)
                ));
            }
        }
        Ok(())
    }

    pub(crate) fn transport(&self) -> Transport {
        match &self.tls {
            None => Transport::Tcp,
            // The config's own provider: no process-wide default is read or installed.
            Some(tls) => Transport::Tls(TlsConfiguration::Rustls(tls.client_config())),
        }
    }
}

/// The sending half of the consumer's connection, owned by the commit thread.
pub(crate) enum Client {
    V4(rumqttc::Client),
    V5(rumqttc::v5::Client),
}

impl PubAckSender for Client {
    fn try_puback(&self, packet_id: u16) -> bool {
        match self {
            Client::V4(c) => c.try_puback(packet_id),
            Client::V5(c) => c.try_puback(packet_id),
        }
    }
}

impl Client {
    /// Queues a DISCONNECT behind the PUBACKs already queued (rumqttc writes its requests in order).
    /// `false` when the request channel is full (or closed).
    pub(crate) fn try_disconnect(&self) -> bool {
        match self {
            Client::V4(c) => c.try_disconnect().is_ok(),
            Client::V5(c) => c.try_disconnect().is_ok(),
        }
    }
}

/// Largest packet accepted from the broker by default: the default payload limit
/// ([`Limits::max_payload_len`](crate::Limits::max_payload_len), 1 MiB) plus 64 KiB for the topic and
/// properties, so that a delivery a little over the payload limit still arrives and is quarantined.
pub const DEFAULT_MAX_PACKET: u32 = (1 << 20) + (64 << 10);

/// Largest packet MQTT can encode (the maximum Remaining Length plus the fixed header).
const MQTT_MAX_PACKET: u32 = 268_435_455 + 5;

/// The default of [`MqttConfig::inflight`], as the consumer derives it from its default budget.
const DEFAULT_INFLIGHT: u16 = 8192;

/// Room in rumqttc's request channel (PUBACKs, subscriptions, the DISCONNECT): at 50,000 acks per second
/// 20 ms of them, and at most 216 KiB.
const REQUEST_CHANNEL: usize = 1024;

/// Outgoing publishes a consumer's connection may have in flight: it sends none. rumqttc also numbers
/// SUBSCRIBE and UNSUBSCRIBE packets within this limit (1, 2, ... then 1 again), so it is one more than the
/// UNSUBSCRIBEs sent with the one SUBSCRIBE at each connection, for no two in flight to share a packet id.
fn consumer_outgoing_inflight(unsubscribes: usize) -> u16 {
    u16::try_from(unsubscribes + 1).unwrap_or(u16::MAX)
}

/// Creates the client and starts the poll thread, which feeds every (re)connection, QoS1 publish and
/// connection loss to `feed`. Once `closing` is set it hands over no more publishes.
pub(crate) fn start(
    config: &MqttConfig,
    feed: Feed,
    closing: Arc<AtomicBool>,
    unsubscribe: Vec<String>,
) -> std::io::Result<(Client, JoinHandle<()>)> {
    // rumqttc's request channel carries our PUBACKs: 216 bytes each, and its queue keeps the largest size
    // it reached. When it is full the commit loop keeps the acks (runs of packet ids) and goes on
    // committing, so the room it frees in the budget keeps this thread polling, which drains the channel.
    let cap = REQUEST_CHANNEL;
    let topics = config.topics.clone();
    let name = thread_name("mqtt-poll-", &config.client_id);
    // TCP_NODELAY on both protocols: a committed batch's PUBACKs are written back to back, and with Nagle's
    // algorithm every one after the first would wait for the broker host's TCP ACK of the first, which a
    // quiet broker delays by up to 40 ms. The last batch before a pause paid that in full.
    let max_packet = config.max_packet;
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
            let (client, mut conn) = rumqttc::Client::new(o, cap);
            let mut net = conn.eventloop.network_options();
            net.set_tcp_nodelay(true);
            conn.eventloop.set_network_options(net);
            let sub = client.clone();
            let handle = std::thread::Builder::new().name(name).spawn(move || {
                poll_v4(conn, sub, topics, unsubscribe, feed, closing, max_packet)
            })?;
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
            o.set_outgoing_inflight_upper_limit(consumer_outgoing_inflight(unsubscribe.len()));
            // Sent in CONNECT: the broker must not send us a larger packet (it drops it instead), and rumqttc
            // refuses one before reading it, so an oversize publish never reaches memory.
            o.set_max_packet_size(Some(config.max_packet));
            o.set_transport(config.transport());
            let mut net = o.network_options();
            net.set_tcp_nodelay(true);
            o.set_network_options(net);
            if let Some((u, p)) = &config.credentials {
                o.set_credentials(u, p);
            }
            let (client, conn) = rumqttc::v5::Client::new(o, cap);
            let sub = client.clone();
            let handle = std::thread::Builder::new().name(name).spawn(move || {
                poll_v5(conn, sub, topics, unsubscribe, feed, closing, max_packet)
            })?;
            Ok((Client::V5(client), handle))
        }
    }
}

/// A thread's name: `prefix` and `tail`, without the NUL a thread name cannot hold.
pub(crate) fn thread_name(prefix: &str, tail: &str) -> String {
    let mut name = String::from(prefix);
    name.extend(tail.chars().filter(|&c| c != '\0'));
    name
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

const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// How long a connection must have lasted for its end to start the backoff over: one that a broker drops
/// soon after its CONNACK (a filter it refuses by closing, a client id another client takes over, a packet
/// too large to read) ends each time again, and reconnecting at the first delay would loop ten times a second.
const STABLE_CONNECTION: Duration = Duration::from_secs(10);

/// The wait before the next connection attempt: doubles up to 5 s after each failure, and starts over
/// after a connection that lasted [`STABLE_CONNECTION`].
#[derive(Debug)]
struct Backoff {
    delay: Duration,
    /// When the current connection's CONNACK arrived.
    connected_at: Option<std::time::Instant>,
}

impl Backoff {
    fn new() -> Backoff {
        Backoff {
            delay: FIRST_BACKOFF,
            connected_at: None,
        }
    }

    fn connected(&mut self) {
        self.connected_at = Some(std::time::Instant::now());
    }

    /// The connection (or the attempt) ended: the delay to wait now.
    fn ended(&mut self) -> Duration {
        if self
            .connected_at
            .take()
            .is_some_and(|t| t.elapsed() >= STABLE_CONNECTION)
        {
            self.delay = FIRST_BACKOFF;
        }
        let d = self.delay;
        self.delay = (d * 2).min(Duration::from_secs(5));
        d
    }
}

/// How long a stopping poll thread keeps writing what was queued before it (the last PUBACKs, then the
/// DISCONNECT) before giving up on the connection.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// The next event, or `None` when the poll thread should end: every client is gone, or a stop has waited
/// its grace for the DISCONNECT to be written and the broker to close the connection. Until a stop it blocks:
/// rumqttc's `recv_timeout` drops its poll when the time is up, and with it a connection attempt under way (a
/// handshake slower than the timeout would never end) or a packet half written.
pub(crate) fn next_event<T, E>(
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

/// Why a TLS failure cannot heal by retrying, if it cannot: bad PEM, a certificate either side rejects.
fn tls_permanent(e: &rumqttc::TlsError) -> Option<String> {
    match e {
        rumqttc::TlsError::Io(io) => io_tls_permanent(io),
        other => Some(format!("TLS set-up failed: {other}")),
    }
}

/// A handshake failure is an I/O error wrapping the rustls error; a PEM that does not parse is
/// `InvalidData`.
fn io_tls_permanent(io: &std::io::Error) -> Option<String> {
    if let Some(tls) = io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
        return Some(format!("TLS handshake failed: {tls}"));
    }
    (io.kind() == std::io::ErrorKind::InvalidData)
        .then(|| format!("TLS material does not parse: {io}"))
}

/// With TLS 1.3 the broker checks our certificate after the client's side of the handshake is done: its
/// alert (unknown CA, certificate expired) arrives on the first read, wrapped in the MQTT layer's error.
fn tls_alert(io: &std::io::Error) -> Option<String> {
    match io.get_ref()?.downcast_ref::<rustls::Error>()? {
        alert @ rustls::Error::AlertReceived(_) => {
            Some(format!("the broker ended the TLS session: {alert}"))
        }
        _ => None,
    }
}

fn v4_permanent(e: &rumqttc::ConnectionError) -> Option<String> {
    use rumqttc::{ConnectReturnCode as C, ConnectionError as E};
    match e {
        E::ConnectionRefused(code @ (C::BadUserNamePassword | C::NotAuthorized | C::BadClientId)) => Some(
            format!("the broker refused the connection: {code:?} (check the username, password and client id)"),
        ),
        E::ConnectionRefused(code @ C::RefusedProtocolVersion) => {
            Some(format!("the broker refused the connection: {code:?}"))
        }
        E::Tls(t) => tls_permanent(t),
        E::Io(io) => io_tls_permanent(io),
        E::MqttState(
            rumqttc::StateError::Io(io)
            | rumqttc::StateError::Deserialization(rumqttc::mqttbytes::Error::Io(io)),
        ) => tls_alert(io),
        _ => None,
    }
}

fn v5_permanent(e: &rumqttc::v5::ConnectionError) -> Option<String> {
    use rumqttc::v5::mqttbytes::v5::ConnectReturnCode as C;
    use rumqttc::v5::ConnectionError as E;
    match e {
        E::ConnectionRefused(
            code @ (C::BadUserNamePassword
            | C::NotAuthorized
            | C::BadClientId
            | C::ClientIdentifierNotValid
            | C::Banned
            | C::BadAuthenticationMethod),
        ) => Some(format!(
            "the broker refused the connection: {code:?} (check the username, password and client id)"
        )),
        E::ConnectionRefused(
            code @ (C::RefusedProtocolVersion | C::UnsupportedProtocolVersion),
        ) => Some(format!("the broker refused the connection: {code:?}")),
        E::Tls(t) => tls_permanent(t),
        E::Io(io) => io_tls_permanent(io),
        E::MqttState(
            rumqttc::v5::StateError::Io(io)
            | rumqttc::v5::StateError::Deserialization(rumqttc::v5::mqttbytes::Error::Io(io)),
        ) => tls_alert(io),
        _ => None,
    }
}

/// The size a publish was refused for, when rumqttc dropped the connection over it.
fn oversize_v4(e: &rumqttc::ConnectionError) -> Option<usize> {
    match e {
        rumqttc::ConnectionError::MqttState(rumqttc::StateError::Deserialization(
            rumqttc::mqttbytes::Error::PayloadSizeLimitExceeded(n),
        )) => Some(*n),
        _ => None,
    }
}

fn oversize_v5(e: &rumqttc::v5::ConnectionError) -> Option<usize> {
    use rumqttc::v5::mqttbytes::Error as M;
    match e {
        rumqttc::v5::ConnectionError::MqttState(rumqttc::v5::StateError::Deserialization(
            M::PayloadSizeLimitExceeded { pkt_size, .. },
        )) => Some(*pkt_size),
        _ => None,
    }
}

/// A connection error, read for what matters to the poll thread.
struct Failure {
    /// Why it cannot heal by retrying, if it cannot.
    permanent: Option<String>,
    /// The size of a packet rumqttc refused.
    oversize: Option<usize>,
    shown: String,
}

/// What the poll thread does after a connection error: ends (the run fails, or is stopping) or retries.
fn after_error(
    feed: &Feed,
    closing: &AtomicBool,
    connected_once: bool,
    failure: Failure,
    max_packet: u32,
    backoff: &mut Backoff,
) -> bool {
    let Failure {
        permanent,
        oversize,
        shown,
    } = failure;
    if closing.load(Ordering::SeqCst) {
        log::debug!("connection to the broker closed while stopping: {shown}");
        return false;
    }
    if let (false, Some(why)) = (connected_once, permanent) {
        log::error!("cannot connect to the broker: {why}");
        let _ = feed.fail(Error::Connection(why));
        return false;
    }
    if let Some(n) = oversize {
        log::error!(
            "the broker sent a packet of {n} bytes, over the maximum packet size of {max_packet}: the \
             connection is dropped and the broker redelivers it at every reconnect. With MQTT 3.1.1 the broker \
             must refuse such messages itself (mosquitto: message_size_limit); or raise max_packet_size"
        );
    }
    let delay = backoff.ended();
    log::warn!("connection to the broker lost or refused: {shown}; retrying in {delay:?}");
    nap(delay, closing);
    // Asked to stop meanwhile: nothing is left to say on a new connection.
    !closing.load(Ordering::SeqCst)
}

/// Each topic filter a SUBACK did not grant at QoS1 or above, said for the log; empty when all were.
fn not_granted<C>(
    topics: &[String],
    codes: &[C],
    granted: impl Fn(&C) -> Result<(), String>,
) -> Vec<String> {
    let mut refused: Vec<String> = topics
        .iter()
        .zip(codes)
        .filter_map(|(t, c)| granted(c).err().map(|why| format!("{t:?} {why}")))
        .collect();
    if codes.len() != topics.len() {
        refused.push(format!(
            "the SUBACK answered {} of {} filters",
            codes.len(),
            topics.len()
        ));
    }
    refused
}

fn granted_v4(code: &rumqttc::SubscribeReasonCode) -> Result<(), String> {
    match code {
        rumqttc::SubscribeReasonCode::Success(QoS::AtMostOnce) => {
            Err("granted at QoS0 only".into())
        }
        rumqttc::SubscribeReasonCode::Success(_) => Ok(()),
        rumqttc::SubscribeReasonCode::Failure => Err("refused".into()),
    }
}

fn granted_v5(code: &p5::SubscribeReasonCode) -> Result<(), String> {
    match code {
        p5::SubscribeReasonCode::Success(Q5::AtMostOnce) => Err("granted at QoS0 only".into()),
        p5::SubscribeReasonCode::Success(_) => Ok(()),
        other => Err(format!("refused ({other:?})")),
    }
}

/// What the poll thread knows of its subscriptions, across the connections of one run.
#[derive(Debug, Default)]
struct Subscriptions {
    /// A SUBACK granted every filter in this run.
    granted_once: bool,
}

/// What the poll thread does after a SUBACK.
enum AfterSuback {
    Go,
    /// Drop the connection, for the reason given, and make it again with the backoff.
    Reconnect(String),
    /// End the poll thread: the run fails.
    End,
}

impl Subscriptions {
    /// A SUBACK arrived ([`Subscriptions::answered`]); after a refusal that does not end the run, the
    /// connection is ended here (`lose`), rather than by a DISCONNECT through the request channel, which
    /// may be full, and which rumqttc would replay on the next connection if this one failed first. False
    /// to end the poll thread.
    fn suback(
        &mut self,
        feed: &mut Feed,
        refused: Vec<String>,
        reason: Option<&str>,
        again: &Again<'_>,
        lose: impl FnOnce(&mut Feed) -> std::result::Result<(), FeedClosed>,
        backoff: &mut Backoff,
    ) -> bool {
        match self.answered(feed, again.closing, refused, reason) {
            AfterSuback::Go => true,
            AfterSuback::Reconnect(why) => again.after_refusal(feed, lose, why, backoff),
            AfterSuback::End => false,
        }
    }

    /// A CONNACK arrived and no filter is configured: the deliveries can only come from the subscriptions
    /// of a session the broker kept. False to end the poll thread.
    fn without_filters(&mut self, feed: &mut Feed, session_present: bool) -> bool {
        if !session_present {
            log::warn!(
                "no topic filter is configured and the broker kept no session: nothing will be delivered"
            );
            return true;
        }
        feed.subscribed().is_ok()
    }

    /// A SUBACK arrived, with the filters it did not grant at QoS1 or above (`refused`). All granted: the
    /// feed is told. Otherwise, before any grant in this run, the run ends: the broker refuses this
    /// configuration (a filter it denies, or grants only at QoS0, whose deliveries are never acked nor
    /// redelivered, outside the guarantee), and a supervisor must see it. After a grant, the connection is
    /// made again with growing backoff (a broker whose authorization backend is briefly away). While the
    /// run is closing, nothing changes.
    fn answered(
        &mut self,
        feed: &mut Feed,
        closing: &AtomicBool,
        refused: Vec<String>,
        reason: Option<&str>,
    ) -> AfterSuback {
        if refused.is_empty() {
            self.granted_once = true;
            return match feed.subscribed() {
                Ok(()) => AfterSuback::Go,
                Err(_) => AfterSuback::End,
            };
        }
        let mut why = format!(
            "the broker did not grant the subscription at QoS1: {}",
            refused.join("; ")
        );
        if let Some(reason) = reason {
            why.push_str(&format!(" (reason: {reason})"));
        }
        if closing.load(Ordering::SeqCst) {
            log::debug!("while stopping, {why}");
            return AfterSuback::Go;
        }
        if self.granted_once {
            log::error!("{why}; connecting again");
            return AfterSuback::Reconnect(why);
        }
        log::error!("{why}");
        let _ = feed.fail(Error::Connection(why));
        AfterSuback::End
    }
}

/// What the poll thread needs to connect again.
struct Again<'a> {
    closing: &'a AtomicBool,
    connected_once: bool,
    max_packet: u32,
}

impl Again<'_> {
    /// Ends the connection after a refused subscription, as after an error (`lose` tells the feed, which
    /// purges what the client holds of it), with the refusal as its cause, then naps with the backoff.
    /// False to end the poll thread.
    fn after_refusal(
        &self,
        feed: &mut Feed,
        lose: impl FnOnce(&mut Feed) -> std::result::Result<(), FeedClosed>,
        why: String,
        backoff: &mut Backoff,
    ) -> bool {
        if lose(feed.because(&why)).is_err() {
            return false;
        }
        let failure = Failure {
            permanent: None,
            oversize: None,
            shown: why,
        };
        after_error(
            feed,
            self.closing,
            self.connected_once,
            failure,
            self.max_packet,
            backoff,
        )
    }
}

fn poll_v4(
    mut conn: rumqttc::Connection,
    client: rumqttc::Client,
    topics: Vec<String>,
    unsubscribe: Vec<String>,
    mut feed: Feed,
    closing: Arc<AtomicBool>,
    max_packet: u32,
) {
    use rumqttc::{Event as E, Outgoing, Packet};
    let mut backoff = Backoff::new();
    let mut stopping_since = None;
    let mut connected_once = false;
    let mut subscriptions = Subscriptions::default();
    loop {
        let next = next_event(&mut stopping_since, &closing, |wait| match wait {
            None => conn.recv().ok(),
            Some(d) => conn.recv_timeout(d).ok(),
        });
        let Some(next) = next else { return };
        match next {
            Ok(E::Incoming(Packet::ConnAck(ack))) => {
                backoff.connected();
                connected_once = true;
                let Ok(c) = feed.connected(ack.session_present) else {
                    return;
                };
                log::info!(
                    "connected (session present: {}), connection {}",
                    ack.session_present,
                    c.0
                );
                // Before subscribing: a kept session may still hold a filter removed from the configuration.
                for f in &unsubscribe {
                    if let Err(e) = client.try_unsubscribe(f.clone()) {
                        log::warn!("could not queue the unsubscription of {f:?}: {e}");
                    }
                }
                // Always: a kept session may lack a filter added to the configuration since.
                let filters = topics
                    .iter()
                    .map(|t| rumqttc::SubscribeFilter::new(t.clone(), QoS::AtLeastOnce));
                if topics.is_empty() {
                    if !subscriptions.without_filters(&mut feed, ack.session_present) {
                        return;
                    }
                } else if let Err(e) = client.try_subscribe_many(filters) {
                    log::error!("could not queue the subscription: {e}");
                }
            }
            Ok(E::Incoming(Packet::SubAck(ack))) => {
                let refused = not_granted(&topics, &ack.return_codes, granted_v4);
                let again = Again {
                    closing: &closing,
                    connected_once,
                    max_packet,
                };
                let lose = |f: &mut Feed| f.lost_v311(&mut conn.eventloop);
                if !subscriptions.suback(&mut feed, refused, None, &again, lose, &mut backoff) {
                    return;
                }
            }
            Ok(E::Incoming(Packet::Publish(p))) => {
                if closing.load(Ordering::SeqCst) {
                    // Never to be committed by this run: left unacked for the broker to redeliver.
                    continue;
                }
                if feed.publish_v311(p).is_err() {
                    return;
                }
            }
            Ok(E::Outgoing(Outgoing::PubAck(_))) => feed.gate().note_ack_written(),
            Ok(E::Outgoing(Outgoing::Disconnect)) if closing.load(Ordering::SeqCst) => {
                // Not closed yet: the broker still sends into our socket, and closing it with unread data
                // would reset the connection, discarding the last PUBACKs and the DISCONNECT before the
                // broker reads them. Read on until the broker closes it (an error, below).
                log::debug!("DISCONNECT written; waiting for the broker to close the connection");
            }
            Ok(_) => {}
            Err(e) => {
                // Before anything else: nothing of the old connection may be acked or handed over any more.
                // rumqttc keeps publishes it read before the error and yields them after the next ConnAck.
                if feed.because(&e).lost_v311(&mut conn.eventloop).is_err() {
                    return;
                }
                let failure = Failure {
                    permanent: v4_permanent(&e),
                    oversize: oversize_v4(&e),
                    shown: e.to_string(),
                };
                if !after_error(
                    &feed,
                    &closing,
                    connected_once,
                    failure,
                    max_packet,
                    &mut backoff,
                ) {
                    return;
                }
            }
        }
    }
}

fn poll_v5(
    mut conn: rumqttc::v5::Connection,
    client: rumqttc::v5::Client,
    topics: Vec<String>,
    unsubscribe: Vec<String>,
    mut feed: Feed,
    closing: Arc<AtomicBool>,
    max_packet: u32,
) {
    use rumqttc::v5::{Event as E, Incoming as Packet};
    use rumqttc::Outgoing;
    let mut backoff = Backoff::new();
    let mut stopping_since = None;
    let mut connected_once = false;
    let mut subscriptions = Subscriptions::default();
    loop {
        let next = next_event(&mut stopping_since, &closing, |wait| match wait {
            None => conn.recv().ok(),
            Some(d) => conn.recv_timeout(d).ok(),
        });
        let Some(next) = next else { return };
        match next {
            Ok(E::Incoming(Packet::ConnAck(ack))) => {
                backoff.connected();
                connected_once = true;
                let Ok(c) = feed.connected(ack.session_present) else {
                    return;
                };
                log::info!(
                    "connected (session present: {}), connection {}",
                    ack.session_present,
                    c.0
                );
                // Before subscribing: a kept session may still hold a filter removed from the configuration.
                for f in &unsubscribe {
                    if let Err(e) = client.try_unsubscribe(f.clone()) {
                        log::warn!("could not queue the unsubscription of {f:?}: {e}");
                    }
                }
                // Always: a kept session may lack a filter added to the configuration since.
                let filters = topics
                    .iter()
                    .map(|t| p5::Filter::new(t.clone(), Q5::AtLeastOnce));
                if topics.is_empty() {
                    if !subscriptions.without_filters(&mut feed, ack.session_present) {
                        return;
                    }
                } else if let Err(e) = client.try_subscribe_many(filters) {
                    log::error!("could not queue the subscription: {e}");
                }
            }
            Ok(E::Incoming(Packet::SubAck(ack))) => {
                let refused = not_granted(&topics, &ack.return_codes, granted_v5);
                let reason = ack
                    .properties
                    .as_ref()
                    .and_then(|p| p.reason_string.as_deref());
                let again = Again {
                    closing: &closing,
                    connected_once,
                    max_packet,
                };
                let lose = |f: &mut Feed| f.lost_v5(&mut conn.eventloop);
                if !subscriptions.suback(&mut feed, refused, reason, &again, lose, &mut backoff) {
                    return;
                }
            }
            Ok(E::Incoming(Packet::Publish(p))) => {
                if closing.load(Ordering::SeqCst) {
                    // Never to be committed by this run: left unacked for the broker to redeliver.
                    continue;
                }
                if feed.publish_v5(p).is_err() {
                    return;
                }
            }
            Ok(E::Outgoing(Outgoing::PubAck(_))) => feed.gate().note_ack_written(),
            Ok(E::Outgoing(Outgoing::Disconnect)) if closing.load(Ordering::SeqCst) => {
                // Not closed yet: the broker still sends into our socket, and closing it with unread data
                // would reset the connection, discarding the last PUBACKs and the DISCONNECT before the
                // broker reads them. Read on until the broker closes it (an error, below).
                log::debug!("DISCONNECT written; waiting for the broker to close the connection");
            }
            Ok(_) => {}
            Err(e) => {
                // Before anything else: nothing of the old connection may be acked or handed over any more.
                if feed.because(&e).lost_v5(&mut conn.eventloop).is_err() {
                    return;
                }
                let failure = Failure {
                    permanent: v5_permanent(&e),
                    oversize: oversize_v5(&e),
                    shown: e.to_string(),
                };
                if !after_error(
                    &feed,
                    &closing,
                    connected_once,
                    failure,
                    max_packet,
                    &mut backoff,
                ) {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topics() -> Vec<String> {
        vec!["orders/#".to_owned(), "stock/+".to_owned()]
    }

    #[test]
    fn a_suback_that_grants_qos1_or_2_to_every_filter_refuses_nothing() {
        use rumqttc::SubscribeReasonCode as C;
        let codes = [C::Success(QoS::AtLeastOnce), C::Success(QoS::ExactlyOnce)];
        assert!(not_granted(&topics(), &codes, granted_v4).is_empty());
    }

    #[test]
    fn a_refused_or_qos0_filter_is_named_in_both_protocols() {
        use rumqttc::SubscribeReasonCode as C;
        let v4 = not_granted(
            &topics(),
            &[C::Success(QoS::AtMostOnce), C::Failure],
            granted_v4,
        );
        assert_eq!(
            v4,
            ["\"orders/#\" granted at QoS0 only", "\"stock/+\" refused"]
        );
        use p5::SubscribeReasonCode as C5;
        let v5 = not_granted(
            &topics(),
            &[C5::Success(Q5::AtLeastOnce), C5::NotAuthorized],
            granted_v5,
        );
        assert_eq!(v5, ["\"stock/+\" refused (NotAuthorized)"]);
    }

    #[test]
    fn a_suback_with_fewer_codes_than_filters_is_not_a_grant() {
        use rumqttc::SubscribeReasonCode as C;
        let refused = not_granted(&topics(), &[C::Success(QoS::AtLeastOnce)], granted_v4);
        assert_eq!(refused, ["the SUBACK answered 1 of 2 filters"]);
    }
}
