//! systemd's notification protocol (sd_notify(3)), written by hand over a Unix datagram socket: readiness,
//! the watchdog, status lines and the stop. Nothing is sent unless systemd asked for it (`NOTIFY_SOCKET` set,
//! as for `Type=notify`); the environment is read, never changed.

use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

use anyhow::{bail, Context};

/// Where systemd listens for this process's notifications.
pub struct Notifier {
    socket: UnixDatagram,
    addr: SocketAddr,
    watchdog: Option<Duration>,
}

impl Notifier {
    /// From `NOTIFY_SOCKET` (a path, or `@name` in the abstract namespace), and `WATCHDOG_USEC` when
    /// `WATCHDOG_PID` is unset or names this process. `None` without `NOTIFY_SOCKET`.
    pub fn from_env() -> anyhow::Result<Option<Notifier>> {
        let Some(name) = std::env::var_os("NOTIFY_SOCKET") else {
            return Ok(None);
        };
        let name = name.into_encoded_bytes();
        let addr = match name.split_first() {
            None => return Ok(None),
            Some((b'@', abstract_name)) => abstract_addr(abstract_name)?,
            Some((b'/', _)) => {
                use std::os::unix::ffi::OsStrExt;
                SocketAddr::from_pathname(std::ffi::OsStr::from_bytes(&name))
                    .context("NOTIFY_SOCKET: not a socket path")?
            }
            Some(_) => bail!("NOTIFY_SOCKET: neither an absolute path nor an @abstract name"),
        };
        let socket = UnixDatagram::unbound().context("NOTIFY_SOCKET: cannot make a socket")?;
        let ours = std::env::var("WATCHDOG_PID")
            .map(|pid| pid.trim() == std::process::id().to_string())
            .unwrap_or(true);
        let watchdog = std::env::var("WATCHDOG_USEC")
            .ok()
            .and_then(|us| us.trim().parse::<u64>().ok())
            .filter(|&us| us > 0 && ours)
            .map(Duration::from_micros);
        Ok(Some(Notifier {
            socket,
            addr,
            watchdog,
        }))
    }

    /// How often to send `WATCHDOG=1`: half the watchdog timeout, as sd_watchdog_enabled(3) advises.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.watchdog.map(|d| d / 2)
    }

    /// Sends one notification (newline-separated `KEY=value` lines). A failure is logged, never fatal:
    /// systemd may be gone while we stop.
    pub fn notify(&self, message: &str) {
        if let Err(e) = self.socket.send_to_addr(message.as_bytes(), &self.addr) {
            log::warn!("sd_notify {message:?}: {e}");
        }
    }
}

#[cfg(target_os = "linux")]
fn abstract_addr(name: &[u8]) -> anyhow::Result<SocketAddr> {
    use std::os::linux::net::SocketAddrExt;
    SocketAddr::from_abstract_name(name).context("NOTIFY_SOCKET: abstract name too long")
}

#[cfg(not(target_os = "linux"))]
fn abstract_addr(_: &[u8]) -> anyhow::Result<SocketAddr> {
    bail!("NOTIFY_SOCKET: abstract socket names exist on Linux only")
}
