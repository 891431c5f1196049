//! Noticing that the database file or its WAL was deleted or renamed underneath an open connection, cheaply
//! enough to ask after every commit, and acting on it while the connection is idle.
//!
//! The direct question, a `stat` of the WAL path, is a few microseconds of CPU, but on ext4 any attribute read
//! of the WAL inode between two commits made each following `fsync` measurably slower (one delivery per
//! transaction on a virtio disk ran at 0.70x of the same commits without it, the same with `fstat` of an open
//! descriptor). On Linux an inotify watch on the database's directory answers instead: the kernel queues the
//! event inside `unlink`/`rename` itself, so a non-blocking read after the commit sees every removal or rename
//! of either name made through this kernel before it, and touches no inode. When the watch reports something
//! about the names (or cannot be trusted: queue overflow, the directory itself moved), and in any case once a
//! second, the caller asks `stat`.
//!
//! A second watch of the same names ([`Waiter`]) wakes a thread of the connection's own when an event comes
//! while no commit is running, so that frames committed before a deletion do not wait for the next commit.
//!
//! inotify does not see changes made outside this kernel (network and FUSE file systems, a host editing a
//! shared directory), nor a directory mounted over: the watches are used only on local file systems
//! (ext2/3/4, xfs, btrfs, f2fs, tmpfs, UBIFS, JFFS2), at most [`MAX_WATCHES`] per process, two per connection
//! (inotify instances are a per-user resource other daemons need too). Elsewhere every commit asks `stat`, as
//! without a watch, and nothing acts between commits.

use std::cell::Cell;
use std::path::Path;
use std::time::{Duration, Instant};

/// Watches this process keeps at most (two per connection: 16 connections); connections beyond them check
/// with `stat` after every commit.
pub(crate) const MAX_WATCHES: usize = 32;

/// Even with a quiet watch, a `stat` this often: a backstop for what inotify cannot see.
const BACKSTOP: Duration = Duration::from_secs(1);

/// A watch for removals of the database file's name and its WAL's name in their directory.
pub(crate) struct WalWatch {
    #[cfg(target_os = "linux")]
    inner: Option<linux::Watch>,
    last_stat: Cell<Instant>,
}

impl WalWatch {
    /// Watches the directory of the database file `db` for its name and its WAL's; a watch that cannot be set
    /// up answers "ask stat" every time.
    pub(crate) fn new(db: &Path) -> WalWatch {
        #[cfg(target_os = "linux")]
        {
            WalWatch {
                inner: linux::Watch::new(db),
                last_stat: Cell::new(Instant::now()),
            }
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = db;
            WalWatch {
                last_stat: Cell::new(Instant::now()),
            }
        }
    }

    /// False when no removal or rename of either name was seen since the watch was set up and the last `stat`
    /// is less than a second old; true means "ask stat".
    pub(crate) fn maybe_changed(&self) -> bool {
        #[cfg(target_os = "linux")]
        let seen = match &self.inner {
            Some(w) => w.maybe_changed(),
            None => true,
        };
        #[cfg(not(target_os = "linux"))]
        let seen = true;
        let now = Instant::now();
        if seen || now.duration_since(self.last_stat.get()) >= BACKSTOP {
            self.last_stat.set(now);
            return true;
        }
        false
    }
}

/// A thread that runs `check` whenever a second watch of the same names sees something about them (or goes
/// blind), and again once a second for as long as `check` returns false (not settled yet). Stopped and joined
/// on drop. Only on Linux, on the file systems [`WalWatch`] watches; `None` elsewhere or without resources.
pub(crate) struct Waiter {
    #[cfg(target_os = "linux")]
    stop: std::os::fd::OwnedFd,
    #[cfg(target_os = "linux")]
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Waiter {
    pub(crate) fn spawn(db: &Path, check: impl FnMut() -> bool + Send + 'static) -> Option<Waiter> {
        #[cfg(target_os = "linux")]
        {
            linux::spawn(db, check)
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = (db, check);
            None
        }
    }
}

#[cfg(target_os = "linux")]
impl Drop for Waiter {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        let one = 1u64;
        // SAFETY: writes 8 bytes from `one` to the eventfd this value owns.
        unsafe { libc::write(self.stop.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use std::cell::Cell;
    use std::ffi::OsString;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A name removed from the directory or replaced by a rename onto it, or the directory itself going away.
    const MASK: u32 = libc::IN_DELETE
        | libc::IN_MOVED_FROM
        | libc::IN_MOVED_TO
        | libc::IN_DELETE_SELF
        | libc::IN_MOVE_SELF;
    /// Events that make the watch blind: treat as "changed".
    const BLIND: u32 = libc::IN_Q_OVERFLOW
        | libc::IN_IGNORED
        | libc::IN_DELETE_SELF
        | libc::IN_MOVE_SELF
        | libc::IN_UNMOUNT;
    const HEADER: usize = std::mem::size_of::<libc::inotify_event>();

    /// `statfs` magic numbers of the local file systems whose changes all pass through this kernel.
    const LOCAL: [u32; 8] = [
        0xEF53,      // ext2, ext3, ext4
        0x5846_5342, // xfs
        0x9123_683E, // btrfs
        0xF2F5_2010, // f2fs
        0x0102_1994, // tmpfs
        0x2405_1905, // UBIFS
        0x72B6,      // JFFS2
        0x8584_58F6, // ramfs
    ];

    /// Watches alive in this process.
    static WATCHES: AtomicUsize = AtomicUsize::new(0);

    pub(super) struct Watch {
        fd: OwnedFd,
        /// The database file's name and its WAL's.
        names: [OsString; 2],
        /// Set for good once an event concerned the WAL or the watch went blind: from then on every check
        /// says "ask stat", as without a watch.
        tripped: Cell<bool>,
    }

    impl Drop for Watch {
        fn drop(&mut self) {
            WATCHES.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl Watch {
        pub(super) fn new(db: &Path) -> Option<Watch> {
            let name = db.file_name()?.to_os_string();
            let mut wal = name.clone();
            wal.push("-wal");
            let names = [name, wal];
            let dir = match db.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            let dir = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
            // SAFETY: `statfs` writes only into `fs`, which is plain data.
            let local = unsafe {
                let mut fs: libc::statfs = std::mem::zeroed();
                libc::statfs(dir.as_ptr(), &mut fs) == 0 && LOCAL.contains(&(fs.f_type as u32))
            };
            if !local {
                log::debug!("the WAL's file system is not known local: it is checked with stat after every commit");
                return None;
            }
            if WATCHES.fetch_add(1, Ordering::SeqCst) >= super::MAX_WATCHES {
                WATCHES.fetch_sub(1, Ordering::SeqCst);
                return None;
            }
            let watch = Self::add(dir, names);
            if watch.is_none() {
                WATCHES.fetch_sub(1, Ordering::SeqCst);
            }
            watch
        }

        fn add(dir: std::ffi::CString, names: [OsString; 2]) -> Option<Watch> {
            // SAFETY: plain syscalls; the descriptor is owned by `OwnedFd` from here on.
            unsafe {
                let fd = libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC);
                if fd < 0 {
                    log::debug!(
                        "no inotify instance ({}): the WAL is checked with stat after every commit",
                        std::io::Error::last_os_error()
                    );
                    return None;
                }
                let fd = OwnedFd::from_raw_fd(fd);
                if libc::inotify_add_watch(fd.as_raw_fd(), dir.as_ptr(), MASK | libc::IN_ONLYDIR)
                    < 0
                {
                    log::debug!(
                        "cannot watch the WAL's directory ({}): the WAL is checked with stat after every commit",
                        std::io::Error::last_os_error()
                    );
                    return None;
                }
                Some(Watch {
                    fd,
                    names,
                    tripped: Cell::new(false),
                })
            }
        }

        /// Drains the queued events; true if one of them (or an earlier one) may concern the WAL.
        pub(super) fn maybe_changed(&self) -> bool {
            if self.tripped.get() {
                return true;
            }
            let changed = self.drain();
            if changed {
                self.tripped.set(true);
            }
            changed
        }

        fn drain(&self) -> bool {
            // Room for several events with names up to NAME_MAX; aligned as the kernel writes them.
            #[repr(C, align(8))]
            struct Buf([u8; 4096]);
            let mut buf = Buf([0; 4096]);
            let mut changed = false;
            loop {
                // SAFETY: reads at most `buf.0.len()` bytes into `buf`.
                let n = unsafe {
                    libc::read(self.fd.as_raw_fd(), buf.0.as_mut_ptr().cast(), buf.0.len())
                };
                if n < 0 {
                    let e = std::io::Error::last_os_error();
                    return match e.kind() {
                        std::io::ErrorKind::WouldBlock => changed,
                        std::io::ErrorKind::Interrupted => continue,
                        _ => true,
                    };
                }
                let n = n as usize;
                if n == 0 {
                    return true;
                }
                let mut at = 0;
                while at + HEADER <= n {
                    // SAFETY: the kernel wrote a whole `inotify_event` header at `at` (reads are whole events).
                    let ev: libc::inotify_event =
                        unsafe { std::ptr::read_unaligned(buf.0.as_ptr().add(at).cast()) };
                    let len = ev.len as usize;
                    let name = &buf.0[(at + HEADER).min(n)..(at + HEADER + len).min(n)];
                    let name = name.split(|&b| b == 0).next().unwrap_or(&[]);
                    if ev.mask & BLIND != 0 || self.names.iter().any(|n| name == n.as_bytes()) {
                        changed = true;
                    }
                    at += HEADER + len;
                }
            }
        }
    }

    /// The [`super::Waiter`]'s thread: blocks on its own watch and the stop eventfd.
    pub(super) fn spawn(
        db: &Path,
        mut check: impl FnMut() -> bool + Send + 'static,
    ) -> Option<super::Waiter> {
        let watch = Watch::new(db)?;
        // SAFETY: a plain syscall; the descriptor is owned by `OwnedFd` from here on.
        let stop = unsafe {
            let fd = libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK);
            if fd < 0 {
                return None;
            }
            OwnedFd::from_raw_fd(fd)
        };
        let stop_fd = stop.as_raw_fd();
        let thread = std::thread::Builder::new()
            .name("inbox-watch".into())
            .stack_size(256 * 1024)
            .spawn(move || {
                let mut settled = true;
                loop {
                    let mut fds = [
                        libc::pollfd {
                            fd: watch.fd.as_raw_fd(),
                            events: libc::POLLIN,
                            revents: 0,
                        },
                        libc::pollfd {
                            fd: stop_fd,
                            events: libc::POLLIN,
                            revents: 0,
                        },
                    ];
                    let timeout = if settled { -1 } else { 1000 };
                    // SAFETY: `fds` is a valid array of two `pollfd`.
                    let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
                    if n < 0
                        && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
                    {
                        return;
                    }
                    if fds[1].revents != 0 {
                        return;
                    }
                    let seen = fds[0].revents != 0 && watch.drain();
                    if seen || !settled {
                        settled = check();
                    }
                }
            });
        match thread {
            Ok(t) => Some(super::Waiter {
                stop,
                thread: Some(t),
            }),
            Err(e) => {
                log::debug!("no watch thread ({e}): a deleted WAL is rescued at the next commit");
                None
            }
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::WalWatch;

    fn setup() -> (tempfile::TempDir, std::path::PathBuf, WalWatch) {
        // tmpfs where there is one (the temporary directory may be on an overlay, which is not watched).
        let shm = std::path::Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            tempfile::tempdir_in(shm).unwrap()
        } else {
            tempfile::tempdir().unwrap()
        };
        let wal = dir.path().join("inbox.db-wal");
        std::fs::write(&wal, b"frames").unwrap();
        let watch = WalWatch::new(&dir.path().join("inbox.db"));
        assert!(
            watch.inner.is_some(),
            "inotify is available on the test machine"
        );
        (dir, wal, watch)
    }

    #[test]
    fn quiet_directory_and_other_names_need_no_stat() {
        let (dir, wal, watch) = setup();
        assert!(!watch.maybe_changed());
        std::fs::write(&wal, b"more frames").unwrap();
        let other = dir.path().join("inbox.db-journal");
        std::fs::write(&other, b"x").unwrap();
        std::fs::remove_file(&other).unwrap();
        std::fs::write(dir.path().join("a"), b"x").unwrap();
        std::fs::rename(dir.path().join("a"), dir.path().join("b")).unwrap();
        assert!(!watch.maybe_changed());
    }

    #[test]
    fn deleting_the_wal_trips_the_watch_for_good() {
        let (_dir, wal, watch) = setup();
        std::fs::remove_file(&wal).unwrap();
        assert!(watch.maybe_changed());
        // Recreated or not, from now on every check asks stat.
        std::fs::write(&wal, b"new file").unwrap();
        assert!(watch.maybe_changed());
        assert!(watch.maybe_changed());
    }

    #[test]
    fn renaming_the_wal_away_or_another_file_onto_it_trips_the_watch() {
        let (dir, wal, watch) = setup();
        std::fs::rename(&wal, dir.path().join("moved")).unwrap();
        assert!(watch.maybe_changed());

        let (dir, wal, watch) = setup();
        let other = dir.path().join("other");
        std::fs::write(&other, b"impostor").unwrap();
        assert!(!watch.maybe_changed());
        std::fs::rename(&other, &wal).unwrap();
        assert!(watch.maybe_changed());
    }

    #[test]
    fn deleting_the_database_file_trips_the_watch() {
        let (dir, _wal, watch) = setup();
        let db = dir.path().join("inbox.db");
        std::fs::write(&db, b"pages").unwrap();
        assert!(!watch.maybe_changed());
        std::fs::remove_file(&db).unwrap();
        assert!(watch.maybe_changed());
    }

    #[test]
    fn the_waiter_runs_its_check_on_a_deletion_and_again_until_settled() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        let (dir, wal, _watch) = setup();
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        // Not settled on its first call: it must be called again without another event.
        let waiter = super::Waiter::spawn(&dir.path().join("inbox.db"), move || {
            c.fetch_add(1, Ordering::SeqCst) >= 1
        })
        .expect("a watch thread");
        std::fs::write(dir.path().join("other"), b"x").unwrap();
        std::fs::remove_file(dir.path().join("other")).unwrap();
        std::fs::remove_file(&wal).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while calls.load(Ordering::SeqCst) < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        drop(waiter);
        assert_eq!(
            calls.load(Ordering::SeqCst),
            2,
            "once for the event, once more until settled"
        );
    }

    #[test]
    fn moving_the_directory_trips_the_watch() {
        let (dir, _wal, watch) = setup();
        let moved = dir.path().with_extension("moved");
        std::fs::rename(dir.path(), &moved).unwrap();
        assert!(watch.maybe_changed());
        std::fs::rename(&moved, dir.path()).unwrap();
    }
}
