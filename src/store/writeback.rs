//! Paced write-back of the database file after a checkpoint copied pages into it without a sync.
//!
//! A checkpoint of a file with a large index copies thousands of scattered pages (tens of MB), and its sync
//! then hands them all to the device at once: every commit's sync of the WAL queues behind them. Linux's
//! `sync_file_range` writes a range of the file out without the device flush of a sync, so the pages go in
//! steps, with pauses as long as the steps took, and the commits' syncs meet at most one step in the queue.
//! The sync that follows (the one durability rests on) then finds little left to write.
//!
//! A hint, never what durability rests on: SQLite does not hand out its descriptor, so the step finds it in
//! `/proc/self/fd` by the file's path and uses it without owning it (closing a descriptor of the file would
//! drop SQLite's locks on it). A number closed and reused meanwhile makes a call fail or write back another
//! file, which harms nothing. Elsewhere than Linux, or when the file is not found, nothing is paced.
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
        }
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
        let Some(fd) = self.find_fd() else {
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
            // SAFETY: a plain system call on a descriptor number; no memory is passed. See the module's doc for
            // a number reused meanwhile.
            if unsafe { libc::sync_file_range(fd, off, step, flags) } != 0 {
                let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
                // A failed write-back of the file, now reported to this descriptor and to no later sync
                // of it; any other error is a descriptor number gone or reused, which harms nothing.
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

    /// A descriptor of this process open on the file.
    #[cfg(target_os = "linux")]
    fn find_fd(&self) -> Option<i32> {
        std::fs::read_dir("/proc/self/fd")
            .ok()?
            .filter_map(|e| e.ok())
            .find(|e| std::fs::read_link(e.path()).is_ok_and(|t| t == self.path))
            .and_then(|e| e.file_name().to_str()?.parse().ok())
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The descriptor is found by the file's path, through a symbolic link to its directory too, and a file
    /// not open in this process has none.
    #[test]
    fn finds_a_descriptor_open_on_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let file = std::fs::File::create(&path).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(dir.path(), &link).unwrap();
        let fd = WriteBack::new(&link.join("db")).find_fd().unwrap();
        use std::os::fd::AsRawFd;
        let other = std::fs::File::open(&path).unwrap();
        assert!(fd == file.as_raw_fd() || fd == other.as_raw_fd());
        std::fs::write(dir.path().join("closed"), b"x").unwrap();
        assert_eq!(WriteBack::new(&dir.path().join("closed")).find_fd(), None);
        // Dirty pages written back in steps that took time.
        use std::io::Write;
        let mut f = &file;
        f.write_all(&vec![7u8; 8 << 20]).unwrap();
        let steps = WriteBack::new(&path).run(&AtomicBool::new(true)).unwrap();
        assert!(steps >= 1, "nothing was written back");
    }
}
