//! Connection epochs and the gate every PUBACK passes: an ack leaves only on the connection its delivery came on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rumqttc::v5::mqttbytes::v5 as p5;
use rumqttc::v5::mqttbytes::QoS as Q5;

/// One connection to the broker, from its CONNACK to its end. Deliveries carry the connection they arrived
/// on; an ack is only ever sent on that same connection ([`AckGate::send`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionId(pub(crate) u64);

/// A PUBACK the [`ConsumerCore`](crate::ConsumerCore) has made safe to send: the delivery's fate is durable
/// and every delivery received before it on `connection` is acked or safe too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Ack {
    /// The connection the delivery arrived on; the ack is for it only.
    pub connection: ConnectionId,
    /// The MQTT packet id of the delivery.
    pub packet_id: u16,
}

/// What [`AckGate::send`] did with an ack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AckSent {
    /// Queued in the MQTT client's request channel, for the connection it came on.
    Sent,
    /// The client's request channel is full: try again once its event loop has run.
    Full,
    /// The connection it came on has ended: it must never be sent (the broker redelivers the message).
    Stale,
}

/// An MQTT client that can queue a PUBACK without blocking: rumqttc's four clients.
pub trait PubAckSender {
    /// Queues the PUBACK of packet `packet_id`; false when the request channel is full or closed.
    fn try_puback(&self, packet_id: u16) -> bool;
}

impl PubAckSender for rumqttc::Client {
    fn try_puback(&self, packet_id: u16) -> bool {
        self.try_ack(&v4_publish(packet_id)).is_ok()
    }
}

impl PubAckSender for rumqttc::AsyncClient {
    fn try_puback(&self, packet_id: u16) -> bool {
        self.try_ack(&v4_publish(packet_id)).is_ok()
    }
}

impl PubAckSender for rumqttc::v5::Client {
    fn try_puback(&self, packet_id: u16) -> bool {
        self.try_ack(&v5_publish(packet_id)).is_ok()
    }
}

impl PubAckSender for rumqttc::v5::AsyncClient {
    fn try_puback(&self, packet_id: u16) -> bool {
        self.try_ack(&v5_publish(packet_id)).is_ok()
    }
}

/// rumqttc builds a PUBACK from the publish it answers; only its QoS and packet id matter.
fn v4_publish(packet_id: u16) -> rumqttc::Publish {
    let mut p = rumqttc::Publish::new("", rumqttc::QoS::AtLeastOnce, Vec::new());
    p.pkid = packet_id;
    p
}

fn v5_publish(packet_id: u16) -> p5::Publish {
    let mut p = p5::Publish::new("", Q5::AtLeastOnce, Vec::new(), None);
    p.pkid = packet_id;
    p
}

/// The current connection, shared by the thread that polls the MQTT event loop and the thread that sends
/// acks. Cheap to clone.
///
/// rumqttc queues a PUBACK in a request channel and writes it on whatever connection its event loop has when
/// it gets to it: a PUBACK computed for connection N could leave on connection N+1, where the same packet id
/// may name another, uncommitted message. The gate closes that race: [`AckGate::send`] checks the ack's
/// connection and queues it in one step under a lock, and [`AckGate::lost`] (called by the event loop's
/// owner when `poll`/`recv` returns an error) ends the connection and, under the same lock, purges the
/// PUBACKs still queued. So a queued PUBACK is always one for the connection rumqttc currently writes to.
#[derive(Debug, Clone, Default)]
pub struct AckGate(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    state: Mutex<State>,
    acks_written: AtomicU64,
}

#[derive(Debug, Default, Clone, Copy)]
struct State {
    epoch: u64,
    connected: bool,
}

impl AckGate {
    /// A gate with no connection yet.
    pub fn new() -> AckGate {
        AckGate::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Two plain fields, each written in one step: a panic elsewhere cannot leave them inconsistent.
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A connection began (its CONNACK arrived): its id, for the deliveries that arrive on it.
    pub fn connected(&self) -> ConnectionId {
        let mut s = self.lock();
        s.epoch += 1;
        s.connected = true;
        ConnectionId(s.epoch)
    }

    /// The connection ended (rumqttc returned an error, or the application closed it). `purge` runs under
    /// the gate's lock and must drop the PUBACKs the client still holds for it (rumqttc:
    /// `eventloop.clean()`, then `eventloop.state.events.clear()` for the publishes it read before the error;
    /// [`AckGate::lost_v5`] and [`AckGate::lost_v311`] do both). From now on every [`Ack`] of that
    /// connection is [`AckSent::Stale`].
    pub fn lost(&self, purge: impl FnOnce()) {
        let mut s = self.lock();
        s.connected = false;
        purge();
    }

    /// [`AckGate::lost`] for rumqttc's MQTT 5 event loop (`connection.eventloop` of a sync client).
    pub fn lost_v5(&self, eventloop: &mut rumqttc::v5::EventLoop) {
        use rumqttc::v5::Event as E;
        self.lost(|| {
            eventloop.clean();
            self.drop_events(&mut eventloop.state.events, |e| {
                matches!(e, E::Outgoing(rumqttc::Outgoing::PubAck(_)))
            });
        });
    }

    /// [`AckGate::lost`] for rumqttc's MQTT 3.1.1 event loop.
    pub fn lost_v311(&self, eventloop: &mut rumqttc::EventLoop) {
        use rumqttc::Event as E;
        self.lost(|| {
            eventloop.clean();
            self.drop_events(&mut eventloop.state.events, |e| {
                matches!(e, E::Outgoing(rumqttc::Outgoing::PubAck(_)))
            });
        });
    }

    /// Drops the events a lost connection's event loop still holds, counting the PUBACKs among them (it wrote
    /// those before the error) as written.
    fn drop_events<E>(
        &self,
        events: &mut std::collections::VecDeque<E>,
        is_puback: impl Fn(&E) -> bool,
    ) {
        let written = events.iter().filter(|e| is_puback(e)).count();
        self.0
            .acks_written
            .fetch_add(written as u64, Ordering::Relaxed);
        events.clear();
    }

    /// The connection acks may be sent on now, if any.
    pub fn current(&self) -> Option<ConnectionId> {
        let s = self.lock();
        s.connected.then_some(ConnectionId(s.epoch))
    }

    /// True while `connection` is the current one.
    pub fn is_current(&self, connection: ConnectionId) -> bool {
        self.current() == Some(connection)
    }

    /// Queues `ack` with `client` if its connection is still the current one, without blocking.
    pub fn send(&self, client: &impl PubAckSender, ack: Ack) -> AckSent {
        let s = self.lock();
        if !s.connected || s.epoch != ack.connection.0 {
            return AckSent::Stale;
        }
        if client.try_puback(ack.packet_id) {
            AckSent::Sent
        } else {
            AckSent::Full
        }
    }

    /// Counts a PUBACK written to the socket (rumqttc's `Outgoing::PubAck` event).
    pub fn note_ack_written(&self) {
        self.0.acks_written.fetch_add(1, Ordering::Relaxed);
    }

    /// PUBACKs counted by [`AckGate::note_ack_written`] (and found written when a connection was lost).
    pub fn acks_written(&self) -> u64 {
        self.0.acks_written.load(Ordering::Relaxed)
    }
}
