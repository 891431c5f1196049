//! Flash wear: the bytes the inbox wrote over the file's life, and the wear figures an eMMC device reports.

use std::path::{Path, PathBuf};

use rusqlite::Connection;
use serde::Serialize;

use crate::inbox::Inbox;
use crate::store::error::Result;
use crate::store::schema::meta_i64;
use crate::store::wear::{CHECKPOINT_BYTES, WAL_BYTES};

/// Bytes the inbox wrote to its files since the file was created, for estimating flash wear.
///
/// Counted by every writing [`Inbox`] at no cost per commit (see [`Inbox::bytes_written`]) and saved in the
/// file from time to time, so the figure read from the file ([`bytes_written`]) lags: it lacks what open
/// connections wrote since their last checkpoint, and what a connection that died without closing wrote
/// since then (up to about two WALs' worth: about 80 MiB at the default checkpoint threshold and 4 KiB pages).
/// It is a floor of the bytes SQLite wrote, and SQLite's writes are a floor of what the device writes
/// (file-system metadata and journal, the flash's own write amplification come on top).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct BytesWritten {
    /// WAL frames (page plus frame header) appended by commits: exact for each connection.
    pub wal_bytes: u64,
    /// Bytes the inbox's checkpoints (the automatic one, and a prune's between its steps) wrote into the
    /// database file. On Linux: the pages the checkpointing thread wrote (its write calls), each once however
    /// many frames held it; with pages smaller than 4 KiB, an estimate of the 4 KiB blocks of the page cache
    /// they dirtied (what reaches the device), between the pages written and one block per page. Elsewhere
    /// the pages SQLite backfilled, an upper bound (a page changed in several frames of one WAL is written
    /// once). Other checkpoints (the one that ends a retention pass, the last connection closing) are not
    /// counted.
    pub checkpoint_bytes: u64,
}

impl BytesWritten {
    /// WAL plus checkpoints.
    pub fn total(&self) -> u64 {
        self.wal_bytes + self.checkpoint_bytes
    }
}

/// The bytes-written figures saved in the file (zeros for a file that never saved any).
pub fn bytes_written(conn: &Connection) -> Result<BytesWritten> {
    let get = |name| {
        Ok::<_, crate::store::error::Error>(meta_i64(conn, name)?.unwrap_or(0).max(0) as u64)
    };
    Ok(BytesWritten {
        wal_bytes: get(WAL_BYTES)?,
        checkpoint_bytes: get(CHECKPOINT_BYTES)?,
    })
}

impl Inbox {
    /// Bytes written to the inbox's files over the file's life: what the file has saved ([`bytes_written`])
    /// plus what this connection wrote and has not saved yet. Reads one table row; not for every delivery.
    pub fn bytes_written(&self) -> Result<BytesWritten> {
        let saved = bytes_written(&self.conn)?;
        let unsaved = self.conn.wear.unsaved();
        Ok(BytesWritten {
            wal_bytes: saved.wal_bytes + unsaved.wal,
            checkpoint_bytes: saved.checkpoint_bytes + unsaved.checkpoint,
        })
    }
}

/// Wear figures of the block device a database file lives on, where the device reports them (eMMC 5.0 and
/// later, through Linux's `mmc` driver: `life_time` and `pre_eol_info` in sysfs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct DeviceWear {
    /// The whole device's name (`mmcblk0`).
    pub device: String,
    /// Estimated life time used of the type A memory (`DEVICE_LIFE_TIME_EST_TYP_A`, SLC-like areas): 1 means
    /// 0-10 % used, 2 means 10-20 %, ..., 10 means 90-100 %, 11 means beyond the rated life; 0 undefined.
    pub life_time_a: Option<u8>,
    /// The same for type B memory (`DEVICE_LIFE_TIME_EST_TYP_B`, MLC-like areas; the main storage).
    pub life_time_b: Option<u8>,
    /// Reserved blocks consumed (`PRE_EOL_INFO`): 1 normal, 2 warning (80 % used), 3 urgent; 0 undefined.
    pub pre_eol_info: Option<u8>,
}

impl DeviceWear {
    /// A life-time estimate as text: `"0-10%"`, ..., `"90-100%"`, `"beyond rated life"`, `"undefined"`.
    pub fn life_time_text(v: u8) -> String {
        match v {
            1..=10 => format!("{}-{}%", (v - 1) * 10, v * 10),
            11 => "beyond rated life".into(),
            _ => "undefined".into(),
        }
    }

    /// `pre_eol_info` as text: `"normal"`, `"warning"`, `"urgent"`, `"undefined"`.
    pub fn pre_eol_text(v: u8) -> &'static str {
        match v {
            1 => "normal",
            2 => "warning",
            3 => "urgent",
            _ => "undefined",
        }
    }
}

/// The wear figures of the device holding `path`, found through the file's device number
/// (`/sys/dev/block/MAJOR:MINOR`, the whole device when that is a partition); `None` where the device reports
/// none (not eMMC, a virtual or network file system, not Linux).
pub fn device_wear(path: &Path) -> Option<DeviceWear> {
    device_wear_in(path, Path::new("/sys"))
}

/// [`device_wear`] with another sysfs root (for tests).
#[doc(hidden)]
pub fn device_wear_in(path: &Path, sysfs: &Path) -> Option<DeviceWear> {
    let mut dir = block_device_dir(path, sysfs)?;
    if dir.join("partition").exists() {
        dir = dir.parent()?.to_owned();
    }
    let device = dir.file_name()?.to_string_lossy().into_owned();
    let read = |name: &str| std::fs::read_to_string(dir.join("device").join(name)).ok();
    let life = read("life_time").map(|s| parse_codes(&s));
    let pre_eol = read("pre_eol_info").and_then(|s| parse_codes(&s).first().copied().flatten());
    if life.is_none() && pre_eol.is_none() {
        return None;
    }
    let life = life.unwrap_or_default();
    Some(DeviceWear {
        device,
        life_time_a: life.first().copied().flatten(),
        life_time_b: life.get(1).copied().flatten(),
        pre_eol_info: pre_eol,
    })
}

/// The sysfs directory of the block device (or partition) that holds `path`, from the file's device number
/// (`SYSFS/dev/block/MAJOR:MINOR`, resolved); `None` for a file system without one. Also the benchmarks'
/// way to the device's own count of sectors written (its `stat`).
#[doc(hidden)]
pub fn block_device_dir(path: &Path, sysfs: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(path).ok()?.dev();
    // glibc's gnu_dev_major / gnu_dev_minor encoding.
    let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0x0fff);
    let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0xff);
    sysfs
        .join("dev/block")
        .join(format!("{major}:{minor}"))
        .canonicalize()
        .ok()
}

/// Whitespace-separated byte values as the kernel prints them (`0x01 0x02`), by position: an unreadable one
/// is unknown (`None`), and the values after it keep their places (type A's figure is never taken for type
/// B's).
fn parse_codes(s: &str) -> Vec<Option<u8>> {
    s.split_whitespace()
        .map(
            |w| match w.strip_prefix("0x").or_else(|| w.strip_prefix("0X")) {
                Some(hex) => u8::from_str_radix(hex, 16).ok(),
                None => w.parse().ok(),
            },
        )
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_codes_parse() {
        assert_eq!(parse_codes("0x01 0x0a\n"), vec![Some(1), Some(10)]);
        assert_eq!(parse_codes("0x03\n"), vec![Some(3)]);
        assert_eq!(parse_codes("2 junk 0x0B"), vec![Some(2), None, Some(11)]);
        // An unreadable type A leaves type B in its place.
        assert_eq!(parse_codes("junk 0x05\n"), vec![None, Some(5)]);
        assert_eq!(parse_codes("0x100 0x02"), vec![None, Some(2)]);
        assert_eq!(DeviceWear::life_time_text(1), "0-10%");
        assert_eq!(DeviceWear::life_time_text(10), "90-100%");
        assert_eq!(DeviceWear::life_time_text(11), "beyond rated life");
        assert_eq!(DeviceWear::pre_eol_text(2), "warning");
    }
}
