//! An MQTT broker inside this process (rumqttd), for machines without mosquitto.
//!
//! rumqttd serves MQTT 3.1.1 and MQTT 5 on two separate listeners; a small front on one loopback port reads the
//! protocol level of each CONNECT and forwards the connection to the matching one, so clients of either version
//! use the same `HOST:PORT`, as with mosquitto. Sessions (`clean_start=false`) and unacknowledged QoS1 deliveries
//! live in memory: they survive a reconnect, not the process. The broker runs until the process exits.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// A running embedded broker.
pub struct Embedded {
    /// The loopback port both protocol versions are served on.
    pub port: u16,
    /// The client side of every connection through the front.
    clients: Arc<Mutex<Vec<TcpStream>>>,
}

fn free_loopback_addr() -> anyhow::Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

fn server(name: &str, listen: SocketAddr) -> rumqttd::ServerSettings {
    rumqttd::ServerSettings {
        name: name.into(),
        listen,
        tls: None,
        next_connection_delay_ms: 0,
        connections: rumqttd::ConnectionSettings {
            connection_timeout_ms: 10_000,
            max_payload_size: 16 << 20,
            max_inflight_count: 1000,
            auth: None,
            external_auth: None,
            dynamic_filters: true,
        },
    }
}

impl Embedded {
    /// Starts rumqttd and the front on a free loopback port, and waits until it accepts connections.
    pub fn start() -> anyhow::Result<Embedded> {
        let v4 = free_loopback_addr()?;
        let v5 = free_loopback_addr()?;
        let config = rumqttd::Config {
            id: 0,
            router: rumqttd::RouterConfig {
                max_connections: 10_000,
                max_outgoing_packet_count: 200,
                // Retained in memory for sessions that are away; far more than any demo or test sends.
                max_segment_size: 64 << 20,
                max_segment_count: 16,
                custom_segment: None,
                initialized_filters: None,
                shared_subscriptions_strategy: Default::default(),
            },
            v4: Some(HashMap::from([("v4".to_string(), server("v4", v4))])),
            v5: Some(HashMap::from([("v5".to_string(), server("v5", v5))])),
            ..Default::default()
        };
        // rumqttd reports through `tracing`, which falls back to the `log` output while no subscriber is set;
        // its internal events are noise there. Only the first call in a process sets it.
        let _ =
            tracing::subscriber::set_global_default(tracing::subscriber::NoSubscriber::default());
        std::thread::Builder::new()
            .name("rumqttd".into())
            .spawn(move || {
                if let Err(e) = rumqttd::Broker::new(config).start() {
                    eprintln!("embedded broker stopped: {e}");
                }
            })?;
        let deadline = Instant::now() + Duration::from_secs(10);
        for backend in [v4, v5] {
            while TcpStream::connect(backend).is_err() {
                if Instant::now() > deadline {
                    bail!("the embedded broker did not listen on {backend}");
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let front = TcpListener::bind("127.0.0.1:0")?;
        let port = front.local_addr()?.port();
        let clients = Arc::new(Mutex::new(Vec::new()));
        let registry = clients.clone();
        std::thread::Builder::new()
            .name("mqtt-front".into())
            .spawn(move || {
                for client in front.incoming().flatten() {
                    if let Ok(c) = client.try_clone() {
                        let mut all = registry.lock().unwrap();
                        // Closed ones are dropped here, so the list stays as long as the live connections.
                        all.retain(|c: &TcpStream| c.peer_addr().is_ok());
                        all.push(c);
                    }
                    std::thread::spawn(move || {
                        let _ = forward(client, v4, v5);
                    });
                }
            })?;
        Ok(Embedded { port, clients })
    }

    /// Closes every client connection, as a network failure would; the broker keeps the sessions, and the
    /// clients' unacknowledged deliveries, for their reconnect.
    pub fn drop_connections(&self) {
        for c in self.clients.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

/// The protocol level byte of a CONNECT packet (4 = 3.1.1, 5 = MQTT 5), once enough of it has arrived.
fn protocol_level(head: &[u8]) -> Option<u8> {
    // Fixed header: type byte, then a remaining length of 1 to 4 bytes (high bit = more follow).
    let mut i = 1;
    while i < head.len() && i < 5 && head[i] & 0x80 != 0 {
        i += 1;
    }
    // Variable header: protocol name (2-byte length, then the name), then the level.
    let name_at = i + 1;
    let len = u16::from_be_bytes([*head.get(name_at)?, *head.get(name_at + 1)?]) as usize;
    head.get(name_at + 2 + len).copied()
}

fn forward(client: TcpStream, v4: SocketAddr, v5: SocketAddr) -> anyhow::Result<()> {
    client.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut head = [0u8; 64];
    let level = loop {
        let n = client.peek(&mut head)?;
        if n == 0 {
            return Ok(());
        }
        if let Some(level) = protocol_level(&head[..n]) {
            break level;
        }
        if n == head.len() {
            bail!("not an MQTT CONNECT");
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    client.set_read_timeout(None)?;
    let backend = TcpStream::connect(if level >= 5 { v5 } else { v4 }).context("backend")?;
    client.set_nodelay(true)?;
    backend.set_nodelay(true)?;
    let (c2, b2) = (client.try_clone()?, backend.try_clone()?);
    let up = std::thread::spawn(move || pipe(c2, b2));
    pipe(backend, client);
    let _ = up.join();
    Ok(())
}

/// Copies `from` to `to` until either side closes, then closes both (a dropped client is a dropped session
/// connection on the broker, as with a direct connection).
fn pipe(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
