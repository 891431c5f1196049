//! Group sync: commits made without a sync of their own (`synchronous=NORMAL`), made durable by a thread
//! that syncs the WAL while the next transaction is being committed, so that committing and syncing overlap
//! instead of taking turns.
//!
//! The rule that keeps an ack honest: a commit is durable once a sync of the WAL that *started after the
//! commit returned* has succeeded. The committing thread asks for a sync after each commit
//! ([`GroupSync::request`], which numbers the request); the thread takes every request made so far, syncs,
//! and then reports that number as synced. One sync covers every commit that returned before it began,
//! and no other sync counts (the checkpoint thread's syncs of the WAL are not relied on).
//!
//! The sync goes through the thread's own connection, on SQLite's own handle of the WAL (see
//! [`wal_sync`](crate::store::wal_sync)), so a wrapping VFS (a simulated card, a power-loss model) sees it as
//! it sees SQLite's syncs; the file is the same, so the sync flushes every connection's frames. What a
//! commit at NORMAL keeps: SQLite still syncs the WAL before each checkpoint and the WAL's header when it
//! starts the file over.
//!
//! A failed sync is never retried on the same file: the kernel may have marked the pages it could not write
//! clean, and a second sync would report success without them. The thread stops syncing, and the
//! committing connection writes the whole WAL out again ([`Db::recover_unsynced_wal`]); only then is
//! anything committed before the failure durable ([`GroupSync::recovered`]).
//!
//! [`Db::recover_unsynced_wal`]: crate::store::db::Db::recover_unsynced_wal

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rusqlite::Connection;

use crate::store::config::Config;
use crate::store::error::{Error, Result};
use crate::store::wal_sync;

/// What the sync thread is told and tells.
#[derive(Debug, Default)]
struct State {
    /// Number of the latest request (commits that returned before it want a sync).
    requested: u64,
    /// The latest request a sync began for.
    started: u64,
    /// The latest request a successful sync covered.
    synced: u64,
    /// The extended result code of the sync that failed; no sync runs until [`GroupSync::recovered`].
    failed: Option<i32>,
    /// A sync (of request `started`) is under way or about to begin.
    syncing: bool,
    /// When the sync under way began.
    began: Option<Instant>,
    /// How long a sync takes, smoothed (zero until the first).
    sync_time: Duration,
    stop: bool,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    /// The thread waits on it for requests.
    wake: Condvar,
    /// Waiters for a sync to end.
    done: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The sync thread of one committing connection; dropping it stops and joins the thread (a sync in
/// progress ends first).
pub(crate) struct GroupSync {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for GroupSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupSync")
            .field("state", &*self.shared.lock())
            .finish()
    }
}

impl GroupSync {
    /// Opens the thread's connection to the inbox at `path` (same VFS and settings as the inbox's) and
    /// starts it. `on_synced` runs on the thread after every sync, successful or not (to wake the
    /// committing thread).
    pub(crate) fn start(
        path: &Path,
        config: &Config,
        on_synced: Box<dyn Fn() + Send>,
    ) -> Result<GroupSync> {
        let conn = crate::store::schema::open_for_checkpoints(path, config)?;
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("edge-inbox-sync".into())
            .spawn(move || run(&conn, &s, &*on_synced))
            .map_err(|e| Error::Open {
                path: path.to_owned(),
                source: e,
            })?;
        Ok(GroupSync {
            shared,
            thread: Some(thread),
        })
    }

    /// Asks for a sync covering every commit that has returned: call it after each commit. Returns the
    /// request's number, which [`GroupSync::synced`] reaches once such a sync succeeded.
    pub(crate) fn request(&self) -> u64 {
        let mut s = self.shared.lock();
        s.requested += 1;
        // An idle thread takes it now: from here on it is covered by a sync that has begun.
        if !s.syncing && s.failed.is_none() {
            s.started = s.requested;
            s.syncing = true;
            s.began = Some(Instant::now());
            self.shared.wake.notify_one();
        }
        s.requested
    }

    /// The latest request a successful sync covered.
    pub(crate) fn synced(&self) -> u64 {
        self.shared.lock().synced
    }

    /// How long a commit expected to take `commit` should wait before it begins, so that it ends as the
    /// sync under way ends and the next sync covers it: a commit that ends earlier waits for that sync
    /// anyway, while what arrives meanwhile could have joined it. `None`: begin now (no sync under way, or
    /// it is about to end). `Some(Duration::MAX)`: a commit already waits for the next sync; wait for this
    /// one to end.
    pub(crate) fn commit_wait(&self, commit: Duration) -> Option<Duration> {
        let s = self.shared.lock();
        if !s.syncing || s.failed.is_some() {
            return None;
        }
        if s.started < s.requested {
            return Some(Duration::MAX);
        }
        let end = s.began? + s.sync_time;
        let wait = end.saturating_duration_since(Instant::now() + commit);
        (!wait.is_zero()).then_some(wait)
    }

    /// How long a sync takes, smoothed; zero until one was measured since [`GroupSync::forget_sync_time`].
    pub(crate) fn sync_time(&self) -> Duration {
        self.shared.lock().sync_time
    }

    /// Forgets the measured sync time (it is from a while ago).
    pub(crate) fn forget_sync_time(&self) {
        self.shared.lock().sync_time = Duration::ZERO;
    }

    /// The extended result code of a failed sync, until [`GroupSync::recovered`].
    pub(crate) fn failed(&self) -> Option<i32> {
        self.shared.lock().failed
    }

    /// The committing connection wrote the whole WAL out again and synced it after a failure: every request
    /// so far is durable, and syncing resumes.
    pub(crate) fn recovered(&self) {
        let mut s = self.shared.lock();
        s.failed = None;
        s.syncing = false;
        s.started = s.requested;
        s.synced = s.requested;
        self.shared.done.notify_all();
    }

    /// Waits until request `number` is synced, a sync failed, or `timeout` passed. True when synced.
    pub(crate) fn wait(&self, number: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut s = self.shared.lock();
        while s.synced < number && s.failed.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = self
                .shared
                .done
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        s.synced >= number
    }
}

impl Drop for GroupSync {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(conn: &Connection, shared: &Shared, on_synced: &dyn Fn()) {
    let mut s = shared.lock();
    loop {
        while !s.stop && !s.syncing {
            s = shared.wake.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        if s.stop {
            return;
        }
        // Every commit asked for until now has returned: this sync, beginning after, covers them all (the
        // thread may have been slow to wake).
        s.started = s.requested;
        s.began = Some(Instant::now());
        let target = s.started;
        drop(s);
        let began = Instant::now();
        let result = sync(conn);
        let took = began.elapsed();
        s = shared.lock();
        s.sync_time = smoothed(s.sync_time, took, 8);
        match result {
            Ok(()) => s.synced = s.synced.max(target),
            Err(e) => {
                let code = e.sqlite_code().unwrap_or(rusqlite::ffi::SQLITE_IOERR);
                log::error!(
                    "the sync thread's sync of the WAL failed (SQLite code {code}): {e}; nothing committed \
                     since the last sync is acked until the WAL is written out again"
                );
                s.failed = Some(code);
            }
        }
        // The requests made meanwhile are taken before the committing thread is woken, so that it sees
        // them covered by a sync that has begun.
        if s.failed.is_none() && s.requested > s.started {
            s.started = s.requested;
            s.began = Some(Instant::now());
        } else {
            s.syncing = false;
        }
        shared.done.notify_all();
        drop(s);
        on_synced();
        s = shared.lock();
    }
}

/// A duration smoothed over about the last `weight` samples: `sample` moves `old` by a `weight`th of the
/// difference; the first sample (`old` zero) is taken as it is.
pub(crate) fn smoothed(old: Duration, sample: Duration, weight: u32) -> Duration {
    if old.is_zero() {
        sample
    } else {
        (old * (weight - 1) + sample) / weight
    }
}

/// One sync of the WAL through this connection's handle of it, opening it first if needed (a read opens it).
fn sync(conn: &Connection) -> Result<()> {
    if wal_sync::sync_wal(conn)? {
        return Ok(());
    }
    conn.query_row("SELECT count(*) FROM sqlite_master", [], |r| {
        r.get::<_, i64>(0)
    })?;
    if wal_sync::sync_wal(conn)? {
        Ok(())
    } else {
        Err(crate::store::error::storage_error(
            rusqlite::ffi::SQLITE_CANTOPEN,
        ))
    }
}
