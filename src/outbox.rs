//! Consumer outbox: messages a handler publishes, written in the same transaction as its effect.
//!
//! The core only records them (no MQTT types here); the [`Relay`](crate::Relay) of the MQTT adapter sends them.

use std::time::Duration;

use rusqlite::OptionalExtension;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3Default;

use crate::inbox::Inbox;
use crate::store::config::Limits;
use crate::store::error::{is_unique_violation, Error, Result};
use crate::store::state::Tx;
use crate::store::txn::{unix_now, write};

/// User property names the relay sets itself; a message may not carry its own.
pub(crate) const RESERVED_PROPERTIES: [&str; 3] = ["message-id", "producer", "sent-at"];

/// The broker's delivery guarantee for an outbox message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Qos {
    /// QoS0: sent once, never confirmed. The row is marked sent once written to the connection, so a crash
    /// or a dropped connection right after may lose it. Only for messages that may be lost.
    AtMostOnce,
    /// QoS1 (the default): the row is marked sent only after the broker's PUBACK; until then it is resent
    /// after every reconnect or restart. Receivers see it at least once, always with the same message id.
    #[default]
    AtLeastOnce,
}

impl Qos {
    pub(crate) fn to_sql(self) -> i64 {
        match self {
            Qos::AtMostOnce => 0,
            Qos::AtLeastOnce => 1,
        }
    }

    #[cfg(feature = "mqtt")]
    pub(crate) fn from_sql(v: i64) -> Qos {
        if v == 0 {
            Qos::AtMostOnce
        } else {
            Qos::AtLeastOnce
        }
    }
}

/// Publish properties of an outbox message, stored with it as CBOR. Plain data, not rumqttc types: the
/// relay maps them to MQTT 5 properties when it sends the message.
///
/// ```
/// use edge_inbox::OutboxProperties;
/// let props = OutboxProperties::new()
///     .content_type("application/json")
///     .user_property("order", "42");
/// assert_eq!(props.user_properties, [("order".to_string(), "42".to_string())]);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct OutboxProperties {
    /// MQTT 5 user properties, in order. `message-id`, `producer` and `sent-at` are reserved: the relay
    /// sets them.
    pub user_properties: Vec<(String, String)>,
    /// MQTT 5 content type.
    pub content_type: Option<String>,
    /// MQTT 5 response topic.
    pub response_topic: Option<String>,
    /// MQTT 5 correlation data.
    pub correlation_data: Option<Vec<u8>>,
    /// MQTT 5 message expiry interval, seconds.
    pub message_expiry: Option<u32>,
    /// The MQTT retain flag.
    pub retain: bool,
}

impl OutboxProperties {
    /// No properties.
    pub fn new() -> OutboxProperties {
        OutboxProperties::default()
    }

    /// Adds a user property.
    pub fn user_property(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.user_properties.push((name.into(), value.into()));
        self
    }

    /// Sets the content type.
    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = Some(content_type.into());
        self
    }

    /// Sets the response topic: a plain topic name, without wildcards (`Tx::publish` refuses one with them).
    pub fn response_topic(mut self, topic: impl Into<String>) -> Self {
        self.response_topic = Some(topic.into());
        self
    }

    /// Sets the correlation data.
    pub fn correlation_data(mut self, data: impl Into<Vec<u8>>) -> Self {
        self.correlation_data = Some(data.into());
        self
    }

    /// Sets the message expiry interval, in seconds.
    pub fn message_expiry(mut self, seconds: u32) -> Self {
        self.message_expiry = Some(seconds);
        self
    }

    /// Sets the retain flag.
    pub fn retain(mut self, retain: bool) -> Self {
        self.retain = retain;
        self
    }

    fn is_empty(&self) -> bool {
        *self == OutboxProperties::default()
    }

    /// Decodes stored properties (NULL: none).
    #[cfg(feature = "mqtt")]
    pub(crate) fn decode(blob: Option<&[u8]>) -> Result<OutboxProperties> {
        match blob {
            None => Ok(OutboxProperties::default()),
            Some(b) => ciborium::from_reader(b)
                .map_err(|e| Error::Codec(format!("outbox properties: {e}"))),
        }
    }
}

/// The application message id of the `index`-th message (from 0) that a handler call publishes while it
/// handles the delivery `(scope, producer, message_id)`: 32 hex digits of an xxh3-128 hash of those four.
///
/// Deterministic and random-free, so every attempt at the same delivery (a retried handler, a redelivery
/// after a crash before the commit) derives the same ids, and only the attempt that commits writes them. Two
/// different deliveries, or two scopes handling the same delivery, derive different ids. The hash is part of
/// the stored format and never changes within a schema version.
///
/// ```
/// use edge_inbox::outbox_message_id;
/// let a = outbox_message_id("inventory-reservation", None, "evt-42-created", 0);
/// assert_eq!(a, outbox_message_id("inventory-reservation", None, "evt-42-created", 0));
/// assert_ne!(a, outbox_message_id("inventory-reservation", None, "evt-42-created", 1));
/// assert_eq!(a.len(), 32);
/// ```
pub fn outbox_message_id(
    scope: &str,
    producer: Option<&str>,
    message_id: &str,
    index: u32,
) -> String {
    let mut h = Xxh3Default::new();
    h.update(b"edge-inbox outbox v1\0");
    let mut field = |bytes: &[u8]| {
        h.update(&(bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(scope.as_bytes());
    match producer {
        None => field(&[]),
        Some(p) => {
            field(&[1]);
            field(p.as_bytes());
        }
    }
    field(message_id.as_bytes());
    h.update(&index.to_le_bytes());
    format!("{:032x}", h.digest128())
}

/// The MQTT limit on a topic name, whatever the configured one.
const MQTT_MAX_TOPIC: usize = 65_535;

fn invalid(why: String) -> Error {
    Error::InvalidArgument(format!("outbox message: {why}"))
}

/// What in an MQTT string a broker may treat as a malformed packet (MQTT 5, 1.5.4): control characters
/// (U+0001 to U+001F, U+007F to U+009F) and Unicode non-characters. mosquitto closes the connection on them,
/// and a relay that sent such a row again at every reconnection would hold back every row behind it.
fn unsendable(s: &str) -> Option<&'static str> {
    s.chars().find_map(|c| {
        let u = u32::from(c);
        if (0x01..=0x1f).contains(&u) || (0x7f..=0x9f).contains(&u) {
            Some("a control character")
        } else if (0xfdd0..=0xfdef).contains(&u) || u & 0xfffe == 0xfffe {
            Some("a Unicode non-character")
        } else {
            None
        }
    })
}

fn validate(
    limits: &Limits,
    producer: &str,
    message_id: &str,
    topic: &str,
    payload: &[u8],
    properties: &OutboxProperties,
) -> Result<()> {
    if topic.is_empty() {
        return Err(invalid("topic is empty".into()));
    }
    let max_topic = limits.max_topic_len.min(MQTT_MAX_TOPIC);
    if topic.len() > max_topic {
        return Err(invalid(format!(
            "topic is {} bytes, over the limit of {max_topic}",
            topic.len()
        )));
    }
    if topic.contains(['+', '#', '\0']) {
        return Err(invalid(format!(
            "topic {topic:?} contains a wildcard or NUL; publish topics must be plain names"
        )));
    }
    if let Some(what) = unsendable(topic) {
        return Err(invalid(format!(
            "topic {topic:?} contains {what}, which brokers refuse"
        )));
    }
    if payload.len() > limits.max_payload_len {
        return Err(invalid(format!(
            "payload is {} bytes, over the limit of {}",
            payload.len(),
            limits.max_payload_len
        )));
    }
    for (what, v) in [("message id", message_id), ("producer", producer)] {
        if v.is_empty() {
            return Err(invalid(format!("{what} is empty")));
        }
        if v.len() > limits.max_id_len {
            return Err(invalid(format!(
                "{what} is {} bytes, over the limit of {}",
                v.len(),
                limits.max_id_len
            )));
        }
    }
    if let Some((name, _)) = properties
        .user_properties
        .iter()
        .find(|(k, _)| RESERVED_PROPERTIES.contains(&k.as_str()))
    {
        return Err(invalid(format!(
            "user property {name:?} is reserved: the relay sets it from the outbox row"
        )));
    }
    // MQTT encodes these with a 16-bit length and forbids U+0000 in strings: a row the broker would refuse
    // as malformed would stall the relay, so it is refused here, before it is written.
    let strings = properties
        .user_properties
        .iter()
        .flat_map(|(k, v)| {
            [
                ("user property", k.as_str()),
                ("user property value", v.as_str()),
            ]
        })
        .chain(
            properties
                .content_type
                .as_deref()
                .map(|v| ("content type", v)),
        )
        .chain(
            properties
                .response_topic
                .as_deref()
                .map(|v| ("response topic", v)),
        );
    // The relay sends the message id and the producer as user properties too.
    let strings = strings.chain([("message id", message_id), ("producer", producer)]);
    for (what, v) in strings {
        if v.len() > usize::from(u16::MAX) || v.contains('\0') {
            return Err(invalid(format!(
                "{what} is over 65535 bytes or contains NUL, which MQTT cannot carry"
            )));
        }
        if let Some(found) = unsendable(v) {
            return Err(invalid(format!(
                "{what} contains {found}, which brokers refuse"
            )));
        }
    }
    // A topic name like the publish topic (MQTT-3.3.2-14): a broker closes the connection on a wildcard
    // there, at every resend.
    if let Some(t) = properties.response_topic.as_deref() {
        if t.is_empty() || t.contains(['+', '#']) {
            return Err(invalid(format!(
                "response topic {t:?} is empty or contains a wildcard; it must be a plain topic name"
            )));
        }
    }
    if properties
        .correlation_data
        .as_ref()
        .is_some_and(|d| d.len() > usize::from(u16::MAX))
    {
        return Err(invalid("correlation data is over 65535 bytes".into()));
    }
    Ok(())
}

impl Tx<'_> {
    /// Publishes a message **after** this transaction commits: writes it to the outbox in the same
    /// transaction as the delivery's identity and the handler's state change. Nothing is sent before the
    /// commit; if the handler fails or the batch rolls back, the row goes with it. A
    /// [`Relay`](crate::Relay) sends committed rows in order and marks each sent only after the broker's
    /// PUBACK, so a receiver sees the message at least once, always with the same message id.
    ///
    /// The message id is derived from the handled delivery and the call's index within this handler
    /// invocation ([`outbox_message_id`]): a retried handler that publishes the same messages in the same
    /// order writes the same ids. The producer namespace is [`Config::outbox_producer`], or the scope.
    /// Returns the message id.
    ///
    /// Errors: [`Error::InvalidArgument`] for an empty, wildcard or over-long topic, an over-long payload
    /// ([`Limits`]) or a reserved user property; storage errors fail the whole batch, like every write
    /// through [`Tx`].
    ///
    /// ```
    /// use edge_inbox::{Config, Delivery, Inbox, OutboxProperties, Qos};
    /// # fn main() -> anyhow::Result<()> {
    /// # let dir = tempfile::tempdir()?;
    /// let mut inbox = Inbox::open(dir.path().join("inbox.db"), Config::default())?;
    /// let d = Delivery::new("inventory-reservation", "evt-42-created", "orders/42", b"{}");
    /// inbox.process(&d, |tx: &mut edge_inbox::Tx<'_>, _d: &Delivery<'_>| {
    ///     tx.put("reserved/A-1", &1)?;
    ///     tx.publish("stock/A-1/reserved", br#"{"order":42}"#, Qos::AtLeastOnce, &OutboxProperties::new())?;
    ///     Ok(())
    /// })?;
    /// assert_eq!(inbox.outbox_backlog()?.pending, 1);
    /// # Ok(()) }
    /// ```
    ///
    /// [`Config::outbox_producer`]: crate::Config::outbox_producer
    pub fn publish(
        &self,
        topic: &str,
        payload: &[u8],
        qos: Qos,
        properties: &OutboxProperties,
    ) -> Result<String> {
        let (producer, origin) = self.origin().ok_or_else(|| {
            Error::InvalidArgument("outbox message outside a delivery's handler".into())
        })?;
        let id = outbox_message_id(self.scope(), producer, origin, self.next_publish_index());
        self.insert_outbox(&id, topic, payload, qos, properties, true)?;
        Ok(id)
    }

    /// [`Tx::publish`] with an application message id of your own (unique within the producer namespace,
    /// and the same on every attempt at this delivery). Reusing an id already in the outbox is an
    /// [`Error::InvalidArgument`].
    pub fn publish_with_id(
        &self,
        message_id: &str,
        topic: &str,
        payload: &[u8],
        qos: Qos,
        properties: &OutboxProperties,
    ) -> Result<()> {
        self.insert_outbox(message_id, topic, payload, qos, properties, false)
    }

    fn insert_outbox(
        &self,
        message_id: &str,
        topic: &str,
        payload: &[u8],
        qos: Qos,
        properties: &OutboxProperties,
        derived: bool,
    ) -> Result<()> {
        let db = self.db();
        let producer = db.outbox.producer.as_deref().unwrap_or(self.scope());
        validate(
            &db.outbox.limits,
            producer,
            message_id,
            topic,
            payload,
            properties,
        )?;
        let props = if properties.is_empty() {
            None
        } else {
            let mut b = Vec::new();
            ciborium::into_writer(properties, &mut b)
                .map_err(|e| Error::Codec(format!("outbox properties: {e}")))?;
            Some(b)
        };
        let inserted = self.track(|| {
            db.prepare_cached(
                "INSERT INTO outbox (scope_id, producer, message_id, topic, payload, qos, properties, created_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            )?
            .execute((
                self.scope_id(),
                producer,
                message_id,
                topic,
                payload,
                qos.to_sql(),
                props.as_deref(),
                self.now(),
            ))
        });
        match inserted {
            Ok(_) => Ok(()),
            Err(Error::Storage { source, .. }) if is_unique_violation(&source) => {
                if derived {
                    // Only a delivery whose identity was pruned and that is handled again derives an id
                    // already in the outbox: the message is the same one, already recorded.
                    log::info!(
                        "outbox message {producer}/{message_id} is already recorded (its delivery was handled \
                         again after its identity was pruned); not written twice"
                    );
                    Ok(())
                } else {
                    Err(invalid(format!(
                        "message id {message_id:?} of producer {producer:?} is already in the outbox"
                    )))
                }
            }
            Err(e) => Err(e),
        }
    }
}

/// The outbox at a glance, from [`Inbox::outbox_backlog`]. One read: the numbers agree.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxBacklog {
    /// Messages committed and not yet confirmed by the broker.
    pub pending: u64,
    /// Age of the oldest pending message, from its commit, in whole seconds. `None` when none is pending.
    pub oldest_pending_age: Option<Duration>,
    /// Messages confirmed and not yet pruned ([`Inbox::prune_outbox`]).
    pub sent: u64,
    /// Publishes the broker refused so far (PUBACK with a failure reason code, or a connection it closed
    /// right after the row was written alone), summed over pending rows.
    pub refusals: u64,
    /// Messages parked after too many refusals ([`RelayConfig::max_refusals`](crate::RelayConfig)): kept,
    /// not sent, until [`Inbox::requeue_parked_outbox`].
    pub parked: u64,
}

/// One committed outbox message, as the relay reads it.
#[cfg(feature = "mqtt")]
#[derive(Debug, Clone)]
pub(crate) struct OutboxRow {
    pub(crate) seq: i64,
    pub(crate) producer: String,
    pub(crate) message_id: String,
    pub(crate) topic: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) qos: Qos,
    pub(crate) properties: OutboxProperties,
    /// When the row was committed, Unix seconds: the `sent-at` the relay stamps on it.
    pub(crate) created_at: i64,
}

/// Rows deleted per transaction by [`Inbox::prune_outbox`]: short write locks between consumer commits.
const PRUNE_CHUNK: i64 = 500;

impl Inbox {
    /// Pending, oldest pending age and sent counts of the outbox (all scopes).
    pub fn outbox_backlog(&self) -> Result<OutboxBacklog> {
        let (pending, oldest, sent, refusals, parked) = self
            .conn
            .prepare_cached(
                "SELECT (SELECT count(*) FROM outbox WHERE state = 0), \
                 (SELECT created_at FROM outbox WHERE state = 0 ORDER BY seq LIMIT 1), \
                 (SELECT count(*) FROM outbox WHERE state = 1), \
                 (SELECT coalesce(sum(attempts), 0) FROM outbox WHERE state = 0), \
                 (SELECT count(*) FROM outbox WHERE state = 2)",
            )?
            .query_row([], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Option<i64>>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, i64>(3)?,
                    r.get::<_, i64>(4)?,
                ))
            })?;
        let now = unix_now();
        Ok(OutboxBacklog {
            pending: pending as u64,
            oldest_pending_age: oldest
                .map(|at| Duration::from_secs(now.saturating_sub(at).max(0) as u64)),
            sent: sent as u64,
            refusals: refusals as u64,
            parked: parked as u64,
        })
    }

    /// Puts every parked outbox message back to pending (refusal count reset), for the relay to try again once
    /// the cause (an ACL, a topic the broker rejects) is fixed. Returns how many.
    ///
    /// A running relay picks them up within its poll interval ([`RelayConfig::poll_interval`](crate::RelayConfig::poll_interval)),
    /// on the same connection, and sends them after the rows it already sent: a requeued row arrives later than
    /// the rows committed after it, which went on while it was parked.
    pub fn requeue_parked_outbox(&mut self) -> Result<u64> {
        // In a transaction of the inbox's own, like every write on its connection: a failed sync is then
        // noticed, and one before it is made good first.
        write(&self.conn, || {
            let n = self
                .conn
                .prepare_cached("UPDATE outbox SET state = 0, attempts = 0 WHERE state = 2")?
                .execute([])?;
            Ok(n as u64)
        })
    }

    /// Deletes outbox messages confirmed (sent) more than `older_than` ago, in short transactions; returns
    /// how many. Pending messages are never deleted. Keep sent rows as long as you may want to inspect what
    /// was published; their ids stay derivable, so a pruned message that is published again (a delivery
    /// handled again after its identity was pruned) carries the same id as before.
    pub fn prune_outbox(&mut self, older_than: Duration) -> Result<u64> {
        let before = unix_now().saturating_sub(older_than.as_secs().min(i64::MAX as u64) as i64);
        let mut total = 0u64;
        loop {
            let deleted = write(&self.conn, || delete_sent(&self.conn, before, PRUNE_CHUNK))?;
            total += deleted as u64;
            if (deleted as i64) < PRUNE_CHUNK {
                return Ok(total);
            }
        }
    }

    /// Whether the outbox message `message_id` of `producer` was confirmed: `Some(true)` sent, `Some(false)`
    /// not yet (pending, or parked after refusals), `None` not in the outbox (never written, or pruned).
    pub fn outbox_status(&self, producer: &str, message_id: &str) -> Result<Option<bool>> {
        Ok(self
            .conn
            .prepare_cached("SELECT state FROM outbox WHERE producer = ?1 AND message_id = ?2")?
            .query_row((producer, message_id), |r| r.get::<_, i64>(0))
            .optional()?
            .map(|state| state == 1))
    }
}

/// Deletes up to `limit` of the oldest outbox messages sent before `before` (Unix seconds), in the caller's
/// transaction; returns how many. Reads the `outbox_sent` index only.
pub(crate) fn delete_sent(conn: &rusqlite::Connection, before: i64, limit: i64) -> Result<usize> {
    Ok(conn
        .prepare_cached(
            "DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox WHERE state = 1 AND sent_at < ?1 \
             ORDER BY sent_at LIMIT ?2)",
        )?
        .execute((before, limit))?)
}

/// A row of the relay's reads, its properties still encoded.
#[cfg(feature = "mqtt")]
fn outbox_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<(OutboxRow, Option<Vec<u8>>)> {
    Ok((
        OutboxRow {
            seq: r.get(0)?,
            producer: r.get(1)?,
            message_id: r.get(2)?,
            topic: r.get(3)?,
            payload: r.get(4)?,
            qos: Qos::from_sql(r.get(5)?),
            properties: OutboxProperties::default(),
            created_at: r.get(7)?,
        },
        r.get::<_, Option<Vec<u8>>>(6)?,
    ))
}

/// The relay's reads and writes, on its own connection.
#[cfg(feature = "mqtt")]
impl Inbox {
    /// Up to `limit` pending rows after `after_seq`, in seq order (the relay's read).
    pub(crate) fn outbox_pending(&self, after_seq: i64, limit: usize) -> Result<Vec<OutboxRow>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT seq, producer, message_id, topic, payload, qos, properties, created_at FROM outbox \
             WHERE state = 0 AND seq > ?1 ORDER BY seq LIMIT ?2",
        )?;
        let rows = stmt.query_map((after_seq, limit as i64), outbox_row)?;
        let mut out = Vec::new();
        for row in rows {
            let (mut row, props) = row?;
            row.properties = OutboxProperties::decode(props.as_deref())?;
            out.push(row);
        }
        Ok(out)
    }

    /// The seqs of up to `limit` pending rows at or below `upto`, in seq order: where the relay looks for
    /// rows put back to pending behind its cursor ([`Inbox::requeue_parked_outbox`]). Reads only the
    /// `outbox_pending` index.
    pub(crate) fn outbox_pending_upto(&self, upto: i64, limit: usize) -> Result<Vec<i64>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT seq FROM outbox WHERE state = 0 AND seq <= ?1 ORDER BY seq LIMIT ?2",
        )?;
        let seqs = stmt
            .query_map((upto, limit as i64), |r| r.get(0))?
            .collect::<rusqlite::Result<Vec<i64>>>()?;
        Ok(seqs)
    }

    /// The row `seq`, if it is pending.
    pub(crate) fn outbox_pending_row(&self, seq: i64) -> Result<Option<OutboxRow>> {
        let row = self
            .conn
            .prepare_cached(
                "SELECT seq, producer, message_id, topic, payload, qos, properties, created_at FROM outbox \
                 WHERE seq = ?1 AND state = 0",
            )?
            .query_row([seq], outbox_row)
            .optional()?;
        row.map(|(mut row, props)| {
            row.properties = OutboxProperties::decode(props.as_deref())?;
            Ok(row)
        })
        .transpose()
    }

    /// Makes the rows the relay has read durable before it publishes them: a sync of the WAL, which began
    /// after their commits, so it covers them. A writer that commits without a sync of its own (commits
    /// overlapping their syncs, or `Synchronous::Normal`) has rows in the WAL a power cut can still take
    /// back, and with them the effect they came with; a message already published for such a row would
    /// then be one the gateway never made. The relay calls it at most once per poll interval: even with
    /// nothing left to write, a sync flushes the device's cache.
    ///
    /// A failed sync is handled as the inbox's own (the WAL is written out again before anything more is
    /// published): the kernel may have marked the lost pages clean, so a second sync alone would not prove
    /// them.
    pub(crate) fn outbox_make_durable(&mut self) -> Result<()> {
        self.conn.write_out_unsynced_wal()?;
        if let Err(e) = crate::store::wal_sync::sync_wal(&self.conn) {
            self.conn
                .note_wal_sync_failed(e.sqlite_code().unwrap_or(-1));
            return Err(e);
        }
        Ok(())
    }

    /// Marks rows sent, in one transaction. Losing the mark (a crash before it commits) only sends the rows
    /// again, which receivers deduplicate.
    pub(crate) fn outbox_mark_sent(&mut self, seqs: &[i64]) -> Result<()> {
        if seqs.is_empty() {
            return Ok(());
        }
        let now = unix_now();
        write(&self.conn, || {
            let mut stmt = self.conn.prepare_cached(
                "UPDATE outbox SET state = 1, sent_at = ?2 WHERE seq = ?1 AND state = 0",
            )?;
            for s in seqs {
                stmt.execute((s, now))?;
            }
            Ok(())
        })
    }

    /// Parks a pending row the broker cannot take at all (its CONNACK rules it out), as if refused
    /// `max_refusals` times.
    pub(crate) fn outbox_park(&mut self, seq: i64) -> Result<()> {
        // In a transaction of the inbox's own, like every write on its connection (see
        // `requeue_parked_outbox`).
        write(&self.conn, || {
            self.conn
                .prepare_cached(
                    "UPDATE outbox SET attempts = attempts + 1, state = 2 WHERE seq = ?1 AND state = 0",
                )?
                .execute([seq])?;
            Ok(())
        })
    }

    /// Counts a publish the broker refused; parks the row once it was refused `max_refusals` times, so it no
    /// longer holds back the rows after it. True when it was parked now.
    pub(crate) fn outbox_refused(&mut self, seq: i64, max_refusals: u32) -> Result<bool> {
        let state: Option<i64> = write(&self.conn, || {
            Ok(self
                .conn
                .prepare_cached(
                    "UPDATE outbox SET attempts = attempts + 1, \
                     state = CASE WHEN attempts + 1 >= ?2 THEN 2 ELSE state END \
                     WHERE seq = ?1 AND state = 0 RETURNING state",
                )?
                .query_row((seq, max_refusals), |r| r.get(0))
                .optional()?)
        })?;
        Ok(state == Some(2))
    }
}
