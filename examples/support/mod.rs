//! What the self-contained examples share: a local mosquitto and a QoS1 publisher.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// Publishes `events` (topic, optional `message-id` user property, body) at QoS1 with MQTT 5 and waits,
/// bounded, until the broker acknowledged every one.
pub fn publish(
    port: u16,
    client_id: &str,
    events: &[(&str, Option<&str>, String)],
) -> anyhow::Result<()> {
    use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::{Client, Event, MqttOptions};
    let (client, mut conn) = Client::new(MqttOptions::new(client_id, "127.0.0.1", port), 32);
    for (topic, id, body) in events {
        let mut props = PublishProperties::default();
        if let Some(id) = id {
            props
                .user_properties
                .push(("message-id".into(), id.to_string()));
        }
        client.publish_with_properties(*topic, QoS::AtLeastOnce, false, body.clone(), props)?;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut acked = 0;
    while acked < events.len() {
        if Instant::now() > deadline {
            bail!(
                "the broker acknowledged only {acked} of {} events",
                events.len()
            );
        }
        match conn.recv_timeout(Duration::from_millis(200)) {
            Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => acked += 1,
            Ok(Err(e)) => bail!("publisher: {e}"),
            _ => {}
        }
    }
    let _ = client.disconnect();
    Ok(())
}

/// A mosquitto on a free loopback port, killed on drop.
pub struct Mosquitto {
    child: Child,
    /// The loopback port it listens on.
    pub port: u16,
}

impl Mosquitto {
    /// Starts mosquitto (from `PATH`, else `/usr/sbin`) with its configuration in `dir`.
    pub fn start(dir: &Path) -> anyhow::Result<Mosquitto> {
        let exe = std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .map(|d| d.join("mosquitto"))
            .find(|p| p.is_file())
            .unwrap_or_else(|| PathBuf::from("/usr/sbin/mosquitto"));
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let conf = dir.join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!("listener {port} 127.0.0.1\nallow_anonymous true\n"),
        )?;
        let child = Command::new(&exe)
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("cannot start {}", exe.display()))?;
        let broker = Mosquitto { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                bail!("mosquitto did not start listening on {port}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(broker)
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
