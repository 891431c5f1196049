//! Paced write-back of the database file after a checkpoint copied pages into it without a sync.
//!
//! A checkpoint of a file with a large index copies thousands of scattered pages (tens of MB), and its sync
//! then hands them all to the device at once: every commit's sync of the WAL queues behind them. Linux's
//! `sync_file_range` writes a range of the file out without the device flush of a sync, so the pages go in
//! steps, with pauses as long as the steps took, and the commits' syncs meet at most one step in the queue.
//! The sync that follows (the one durability rests on) then finds little left to write.
//!
//! A hint, never what durability rests on: SQLite does not hand out its descriptor, and one of our own would
//! drop SQLite's locks on the file when closed. So the checkpoint thread notes which descriptors of the file
//! (in `/proc/self/fd`) appeared when it opened its own two connections, and paces through one of those:
//! they live as long as the thread, and no other connection's descriptor is ever waited on (a wait takes the
//! report of a failed write-back meant for that descriptor's next sync). When the two cannot be told from
//! others (another thread opened the file at the same time, SQLite reused a descriptor it kept), and
//! elsewhere than Linux, nothing is paced.
//!
//! One thing it must not do is hide a failure: waiting for the write-back reports a failed write of the file
//! (`EIO`, `ENOSPC`) to the descriptor it used, and only once, as a sync would. That descriptor may be the
//! one the database file's next sync goes through, which would then succeed with pages lost. So such an
//! error is returned, and the checkpoint takes it as a failed sync of the database file.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
#[cfg(target_os = "linux")]
use std::time::{Duration, Instant};

/// The database file whose write-back is paced.
pub(crate) struct WriteBack {
    path: PathBuf,
    /// A descriptor of the file that the checkpoint thread's own connections hold ([`WriteBack::own`]).
    fd: Option<i32>,
}

/// Bytes of file range written back in one step to start with; each step's range then follows how long the
/// last one took, between [`MIN_STEP`] and [`MAX_STEP`].
#[cfg(target_os = "linux")]
const FIRST_STEP: i64 = 1 << 20;
#[cfg(target_os = "linux")]
const MIN_STEP: i64 = 64 << 10;
#[cfg(target_os = "linux")]
const MAX_STEP: i64 = 64 << 20;
/// A step that took longer halves the next one's range; one much shorter doubles it. A commit's sync that
/// arrives during a step waits about this long behind it.
#[cfg(target_os = "linux")]
const STEP_TIME: Duration = Duration::from_millis(2);

impl WriteBack {
    /// For the database file at `path` (resolved now, as `/proc/self/fd` names files by their real path).
    pub(crate) fn new(path: &Path) -> WriteBack {
        WriteBack {
            path: std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned()),
            fd: None,
        }
    }

    /// The descriptors of this process open on the file now (none elsewhere than Linux).
    pub(crate) fn descriptors(&self) -> Vec<i32> {
        #[cfg(target_os = "linux")]
        {
            let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
                return Vec::new();
            };
            let mut fds: Vec<i32> = dir
                .filter_map(|e| e.ok())
                .filter(|e| std::fs::read_link(e.path()).is_ok_and(|t| t == self.path))
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect();
            fds.sort_unstable();
            fds
        }
        #[cfg(not(target_os = "linux"))]
        Vec::new()
    }

    /// Paces through a descriptor that appeared since `before` was taken, when exactly `opened` did (the
    /// caller's own connections opened the file meanwhile); otherwise paces nothing.
    pub(crate) fn own(mut self, before: &[i32], opened: usize) -> WriteBack {
        let new: Vec<i32> = self
            .descriptors()
            .into_iter()
            .filter(|fd| !before.contains(fd))
            .collect();
        self.fd = (new.len() == opened)
            .then(|| new.first().copied())
            .flatten();
        if self.fd.is_none() {
            log::debug!(
                "{}: the checkpoint thread's descriptors of the file are not known; its write-back is not \
                 paced",
                self.path.display()
            );
        }
        self
    }

    /// Writes the file's dirty pages out to the device in steps, pausing after each as long as it took,
    /// without pauses once `hurry` is set (a commit waits for the checkpoint thread). Returns the steps that
    /// wrote (took measurable time), 0 where nothing is paced; `Err` with the error number when the kernel
    /// reported a failed write-back of the file (see the module's doc).
    pub(crate) fn run(&self, hurry: &AtomicBool) -> Result<u32, i32> {
        #[cfg(target_os = "linux")]
        {
            self.run_linux(hurry)
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = hurry;
            Ok(0)
        }
    }

    #[cfg(target_os = "linux")]
    fn run_linux(&self, hurry: &AtomicBool) -> Result<u32, i32> {
        let Some(fd) = self.fd else {
            return Ok(0);
        };
        let Ok(len) = std::fs::metadata(&self.path).map(|m| m.len() as i64) else {
            return Ok(0);
        };
        let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        let (mut off, mut step, mut wrote) = (0i64, FIRST_STEP, 0);
        while off < len {
            let t = Instant::now();
            // SAFETY: a plain system call on a descriptor of the checkpoint thread's connections, open while
            // it runs; no memory is passed.
            if unsafe { libc::sync_file_range(fd, off, step, flags) } != 0 {
                let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
                // A failed write-back of the file, now reported to this descriptor and to no later sync
                // of it; any other error leaves the rest to the sync.
                return match errno {
                    libc::EIO | libc::ENOSPC => Err(errno),
                    _ => Ok(wrote),
                };
            }
            let took = t.elapsed();
            off += step;
            if took > STEP_TIME {
                step = (step / 2).max(MIN_STEP);
            } else if took < STEP_TIME / 4 {
                step = (step * 2).min(MAX_STEP);
            }
            // A range with nothing dirty returns at once.
            if took > Duration::from_micros(50) {
                wrote += 1;
                if !hurry.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(took);
                }
            }
        }
        Ok(wrote)
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Only a descriptor opened between the two looks is used, found by the file's path (through a symbolic
    /// link to its directory too); one opened before, another connection's, never is.
    #[test]
    fn paces_only_through_a_descriptor_opened_meanwhile() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let other = std::fs::File::create(&path).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(dir.path(), &link).unwrap();
        let wb = WriteBack::new(&link.join("db"));
        let before = wb.descriptors();
        assert_eq!(before, [other.as_raw_fd()]);
        let own = std::fs::File::open(&path).unwrap();
        let wb = wb.own(&before, 1);
        assert_eq!(wb.fd, Some(own.as_raw_fd()));
        // Two expected, one seen: not told apart, not paced.
        assert_eq!(WriteBack::new(&path).own(&before, 2).fd, None);
        // Dirty pages written back in steps that took time.
        use std::io::Write;
        let mut f = &other;
        f.write_all(&vec![7u8; 8 << 20]).unwrap();
        let steps = wb.run(&AtomicBool::new(true)).unwrap();
        assert!(steps >= 1, "nothing was written back");
    }

    /// SQLite opens the database file when a connection opens: the checkpoint thread's two connections are
    /// two new descriptors.
    #[test]
    fn a_connection_opens_its_descriptor_of_the_database_file_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        drop(rusqlite::Connection::open(&path).unwrap());
        let wb = WriteBack::new(&path);
        let before = wb.descriptors();
        let _a = rusqlite::Connection::open(&path).unwrap();
        let _b = rusqlite::Connection::open(&path).unwrap();
        assert!(wb.own(&before, 2).fd.is_some());
    }
}
