//! What the two firmware examples (`firmware.rs`, sync; `firmware_tokio.rs`, on tokio) share: the device's
//! command line, the command handler that runs inside the inbox's transaction, and the check of the SUBACK.

use std::time::Duration;

use clap::Parser;
use edge_inbox::{Delivery, Tx};
use rumqttc::v5::mqttbytes::v5::{SubAck, SubscribeReasonCode};
use rumqttc::v5::mqttbytes::QoS;

#[derive(Parser, Debug)]
pub struct Args {
    /// Broker address.
    #[arg(long, default_value = "127.0.0.1:1883")]
    pub broker: String,
    /// The inbox database.
    #[arg(long)]
    pub db: std::path::PathBuf,
    /// Device name: client id, command topics `cmd/<device>/#`, telemetry topic `telemetry/<device>`.
    #[arg(long, default_value = "gw7")]
    pub device: String,
    /// Telemetry period in milliseconds.
    #[arg(long, default_value_t = 200)]
    pub telemetry_ms: u64,
    /// Exit once no command has arrived for this many seconds (tests, batch jobs).
    #[arg(long)]
    pub exit_when_idle: Option<u64>,
    /// Milliseconds each command takes to apply (a slow actuator: the tests stop it mid-batch).
    #[arg(long, default_value_t = 0)]
    pub apply_ms: u64,
}

pub const SCOPE: &str = "firmware-commands";

/// Receive Maximum: the broker sends at most this many unacked commands.
pub const WINDOW: u16 = 20;

/// The SUBACK of the commands' subscription (the only SUBSCRIBE of a connection): Ok when the broker
/// granted it at QoS1 or above. A refusal, or a grant at QoS0 (commands never acked nor redelivered), is an
/// error: no retry changes the broker's answer.
pub fn granted(ack: &SubAck, filter: &str) -> anyhow::Result<()> {
    match ack.return_codes.as_slice() {
        [SubscribeReasonCode::Success(QoS::AtLeastOnce | QoS::ExactlyOnce)] => Ok(()),
        other => anyhow::bail!("the broker did not grant {filter:?} at QoS1: {other:?}"),
    }
}

pub fn apply(tx: &mut Tx<'_>, d: &Delivery<'_>) -> anyhow::Result<()> {
    let cmd: serde_json::Value = serde_json::from_slice(d.payload)?;
    let add = cmd["add"]
        .as_i64()
        .ok_or_else(|| anyhow::anyhow!("no \"add\" in command"))?;
    let sum: i64 = tx.get("sum")?.unwrap_or(0);
    let count: i64 = tx.get("count")?.unwrap_or(0);
    tx.put("sum", &(sum + add))?;
    tx.put("count", &(count + 1))?;
    Ok(())
}

pub fn slowed(
    apply_ms: u64,
) -> impl FnMut(&mut Tx<'_>, &Delivery<'_>) -> anyhow::Result<()> + Send {
    move |tx, d| {
        std::thread::sleep(Duration::from_millis(apply_ms));
        apply(tx, d)
    }
}
