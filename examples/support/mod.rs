//! What the self-contained examples share: a local broker (mosquitto, else one embedded in the process) and a
//! QoS1 publisher.
#![allow(dead_code)]

mod embedded;

pub use embedded::Embedded;

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

/// Where mosquitto is: `EDGE_INBOX_MOSQUITTO` when set, else the first `mosquitto` on `PATH`, else
/// `/usr/sbin/mosquitto`; `None` when that file does not exist.
pub fn mosquitto_exe() -> Option<PathBuf> {
    if let Some(exe) = std::env::var_os("EDGE_INBOX_MOSQUITTO") {
        let exe = PathBuf::from(exe);
        return exe.is_file().then_some(exe);
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("mosquitto"))
        .chain([PathBuf::from("/usr/sbin/mosquitto")])
        .find(|p| p.is_file())
}

/// The broker a self-contained example runs on.
pub struct LocalBroker {
    /// The loopback port it listens on (MQTT 3.1.1 and 5).
    pub port: u16,
    kind: Kind,
}

enum Kind {
    Mosquitto(Mosquitto),
    /// Why: mosquitto is not installed, or the environment chose it.
    Embedded(&'static str),
}

impl LocalBroker {
    /// mosquitto when it is installed, else the embedded broker; `EDGE_INBOX_LOCAL_BROKER=mosquitto|embedded`
    /// chooses (`auto`, the default, decides by whether mosquitto is installed).
    pub fn start(dir: &Path) -> anyhow::Result<LocalBroker> {
        let choice = std::env::var("EDGE_INBOX_LOCAL_BROKER").unwrap_or_default();
        let mosquitto = match choice.as_str() {
            "mosquitto" => true,
            "embedded" => false,
            "" | "auto" => mosquitto_exe().is_some(),
            other => {
                bail!("EDGE_INBOX_LOCAL_BROKER={other:?}: expected auto, mosquitto or embedded")
            }
        };
        Ok(if mosquitto {
            let m = Mosquitto::start(dir)?;
            LocalBroker {
                port: m.port,
                kind: Kind::Mosquitto(m),
            }
        } else {
            let why = if choice == "embedded" {
                "EDGE_INBOX_LOCAL_BROKER=embedded"
            } else {
                "mosquitto is not installed"
            };
            LocalBroker {
                port: Embedded::start()?.port,
                kind: Kind::Embedded(why),
            }
        })
    }

    /// `HOST:PORT` of the broker.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Which broker serves, on which address.
    pub fn describe(&self) -> String {
        match &self.kind {
            Kind::Mosquitto(m) => format!("mosquitto ({}) on {}", m.exe.display(), self.addr()),
            Kind::Embedded(why) => format!(
                "rumqttd embedded in this process on {} ({why})",
                self.addr()
            ),
        }
    }

    /// One line: which broker serves, and `switch`, how to use a real one instead.
    pub fn banner(&self, switch: &str) -> String {
        format!("broker: {}; for a real broker: {switch}", self.describe())
    }
}

/// A mosquitto on a free loopback port, killed on drop.
pub struct Mosquitto {
    child: Child,
    /// The loopback port it listens on.
    pub port: u16,
    /// The executable that runs.
    pub exe: PathBuf,
}

impl Mosquitto {
    /// Starts mosquitto (see [`mosquitto_exe`]) with its configuration in `dir`.
    pub fn start(dir: &Path) -> anyhow::Result<Mosquitto> {
        let exe = mosquitto_exe().context(
            "mosquitto is not installed (apt-get install mosquitto), or EDGE_INBOX_MOSQUITTO does not name it",
        )?;
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
        let broker = Mosquitto { child, port, exe };
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
