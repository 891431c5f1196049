//! The MQTT adapter over the core: the connection-agnostic consumer core and the gate its acks pass, the
//! commit loop and its feed (and its tokio counterpart), the crate's own connection and consumer, in-order
//! acks and the outbox relay. Identity extraction reads plain data ([`Inbound`](extract::Inbound)) and is
//! compiled without the `mqtt` feature.

#[cfg(feature = "mqtt")]
pub(crate) mod ack_queue;
#[cfg(feature = "tokio")]
pub(crate) mod async_feed;
#[cfg(feature = "mqtt")]
pub(crate) mod budget;
#[cfg(feature = "mqtt")]
pub(crate) mod conn;
#[cfg(feature = "mqtt")]
pub(crate) mod consumer;
#[cfg(feature = "mqtt")]
pub(crate) mod core;
#[cfg(feature = "mqtt")]
pub(crate) mod driver;
#[cfg(feature = "mqtt")]
pub(crate) mod dropped_filters;
pub(crate) mod envelope_cbor;
pub(crate) mod extract;
#[cfg(feature = "mqtt")]
pub(crate) mod gate;
#[cfg(feature = "mqtt")]
pub(crate) mod health;
#[cfg(feature = "mqtt")]
pub(crate) mod pipeline;
pub(crate) mod property_bag;
#[cfg(feature = "mqtt")]
pub(crate) mod ready_acks;
#[cfg(feature = "mqtt")]
pub(crate) mod relay;
#[cfg(feature = "mqtt")]
pub(crate) mod summary;
#[cfg(feature = "mqtt")]
pub(crate) mod tls;
#[cfg(feature = "mqtt")]
pub(crate) mod topic_filter;
