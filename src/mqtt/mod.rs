//! The MQTT adapter over the core: connection, consumer loop, in-order acks and the outbox relay. Identity
//! extraction reads plain data ([`Incoming`](extract::Incoming)) and is compiled without the `mqtt` feature.

#[cfg(feature = "mqtt")]
pub(crate) mod ack_queue;
#[cfg(feature = "mqtt")]
pub(crate) mod conn;
#[cfg(feature = "mqtt")]
pub(crate) mod consumer;
pub(crate) mod extract;
#[cfg(feature = "mqtt")]
pub(crate) mod relay;
