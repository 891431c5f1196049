//! What the two firmware examples (`firmware.rs`, sync; `firmware_tokio.rs`, on tokio) share: the device's
//! command line and the command handler that runs inside the inbox's transaction.

use std::time::Duration;

use clap::Parser;
use edge_inbox::{Delivery, Tx};

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
