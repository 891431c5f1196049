//! The connection with the statements of the hot path prepared once and held.
//!
//! rusqlite's `prepare_cached` builds a fresh `Arc<str>` key on every call, hit or miss, so a consumer that
//! used it for every statement of every delivery would allocate several times per message. The handful of
//! statements each delivery runs are prepared when the inbox opens and kept beside the connection.

use std::cell::RefCell;
use std::mem::ManuallyDrop;
use std::ops::Deref;

use rusqlite::{Connection, OptionalExtension, Statement};

/// Statements of the hot path. They borrow the boxed connection of their [`Db`] (hence the `'static`
/// lifetime, which never escapes this module) and are dropped before it.
struct Hot {
    begin: RefCell<Statement<'static>>,
    commit: RefCell<Statement<'static>>,
    savepoint: RefCell<Statement<'static>>,
    release: RefCell<Statement<'static>>,
    rollback_to: RefCell<Statement<'static>>,
    insert_identity: RefCell<Statement<'static>>,
    stored_fingerprint: RefCell<Statement<'static>>,
    add_counts: RefCell<Statement<'static>>,
    data_version: RefCell<Statement<'static>>,
    kv_get: RefCell<Statement<'static>>,
    kv_put: RefCell<Statement<'static>>,
    kv_delete: RefCell<Statement<'static>>,
}

/// An open database connection and its held statements. Dereferences to the connection for everything else.
pub(crate) struct Db {
    hot: ManuallyDrop<Hot>,
    conn: Box<Connection>,
    /// The WAL file's path, to notice when it is deleted underneath the open connection.
    wal: Option<std::path::PathBuf>,
    /// Commits at least this slow are logged.
    pub(crate) slow_commit: Option<std::time::Duration>,
}

// SAFETY: `Connection` is `Send`. The statements only borrow the connection owned by this same value, so
// moving the whole `Db` to another thread moves every user of the connection with it. `Db` is not `Sync`.
unsafe impl Send for Db {}

impl Drop for Db {
    fn drop(&mut self) {
        // SAFETY: dropped exactly once, here, before `conn` (a field, dropped after this body).
        unsafe { ManuallyDrop::drop(&mut self.hot) }
    }
}

impl Deref for Db {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        &self.conn
    }
}

impl Db {
    /// Takes an opened connection with the current schema and prepares the hot statements on it.
    pub(crate) fn new(conn: Connection) -> rusqlite::Result<Db> {
        let wal = conn
            .path()
            .filter(|p| !p.is_empty())
            .map(|p| std::path::PathBuf::from(format!("{p}-wal")));
        let conn = Box::new(conn);
        // SAFETY: the box's heap address is stable for as long as `Db` owns it, and `Drop` releases every
        // statement before the connection; no `'static` statement is ever handed out.
        let c: &'static Connection = unsafe { &*(&*conn as *const Connection) };
        let p = |sql: &str| c.prepare(sql).map(RefCell::new);
        let hot = Hot {
            begin: p("BEGIN IMMEDIATE")?,
            commit: p("COMMIT")?,
            savepoint: p("SAVEPOINT delivery")?,
            release: p("RELEASE delivery")?,
            rollback_to: p("ROLLBACK TO delivery")?,
            insert_identity: p(
                "INSERT INTO identities (scope_id, id_hash, fingerprint, day) VALUES (?1, ?2, ?3, ?4) \
                 ON CONFLICT (scope_id, id_hash) DO NOTHING",
            )?,
            stored_fingerprint: p(
                "SELECT fingerprint FROM identities WHERE scope_id = ?1 AND id_hash = ?2",
            )?,
            add_counts: p(
                "UPDATE scope_stats SET processed = processed + ?2, duplicates = duplicates + ?3, \
                 conflicts = conflicts + ?4, handler_failures = handler_failures + ?5 WHERE scope_id = ?1",
            )?,
            data_version: p("PRAGMA data_version")?,
            kv_get: p("SELECT value FROM kv WHERE ns = ?1 AND key = ?2")?,
            kv_put: p(
                "INSERT INTO kv (ns, key, value) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (ns, key) DO UPDATE SET value = excluded.value",
            )?,
            kv_delete: p("DELETE FROM kv WHERE ns = ?1 AND key = ?2")?,
        };
        Ok(Db {
            hot: ManuallyDrop::new(hot),
            conn,
            wal,
            slow_commit: None,
        })
    }

    pub(crate) fn begin_immediate(&self) -> rusqlite::Result<()> {
        self.hot.begin.borrow_mut().execute([]).map(drop)
    }

    /// True when the WAL file is gone from its path while this connection has it open (someone deleted it).
    /// Frames committed since then live only in the unlinked file and vanish if the process dies. One `stat`,
    /// no allocation for ordinary path lengths: negligible beside the commit's fsync.
    pub(crate) fn wal_unlinked(&self) -> bool {
        self.wal
            .as_deref()
            .is_some_and(|p| std::fs::symlink_metadata(p).is_err())
    }

    pub(crate) fn commit_raw(&self) -> rusqlite::Result<()> {
        self.hot.commit.borrow_mut().execute([]).map(drop)
    }

    pub(crate) fn savepoint(&self) -> rusqlite::Result<()> {
        self.hot.savepoint.borrow_mut().execute([]).map(drop)
    }

    pub(crate) fn release(&self) -> rusqlite::Result<()> {
        self.hot.release.borrow_mut().execute([]).map(drop)
    }

    pub(crate) fn rollback_to(&self) -> rusqlite::Result<()> {
        self.hot.rollback_to.borrow_mut().execute([]).map(drop)
    }

    pub(crate) fn insert_identity(
        &self,
        scope_id: i64,
        id_hash: &[u8; 16],
        fingerprint: i64,
        day: i64,
    ) -> rusqlite::Result<usize> {
        self.hot
            .insert_identity
            .borrow_mut()
            .execute((scope_id, &id_hash[..], fingerprint, day))
    }

    pub(crate) fn stored_fingerprint(
        &self,
        scope_id: i64,
        id_hash: &[u8; 16],
    ) -> rusqlite::Result<i64> {
        self.hot
            .stored_fingerprint
            .borrow_mut()
            .query_row((scope_id, &id_hash[..]), |r| r.get(0))
    }

    pub(crate) fn add_counts(&self, scope_id: i64, counts: [i64; 4]) -> rusqlite::Result<()> {
        let [processed, duplicates, conflicts, failures] = counts;
        self.hot
            .add_counts
            .borrow_mut()
            .execute((scope_id, processed, duplicates, conflicts, failures))
            .map(drop)
    }

    /// `PRAGMA data_version`: changes when another connection commits.
    pub(crate) fn data_version(&self) -> rusqlite::Result<i64> {
        self.hot
            .data_version
            .borrow_mut()
            .query_row([], |r| r.get(0))
    }

    /// Runs `f` on the stored value of `ns`/`key`, if any, without copying it.
    pub(crate) fn kv_get<T>(
        &self,
        ns: &str,
        key: &str,
        f: impl FnOnce(&[u8]) -> T,
    ) -> rusqlite::Result<Option<T>> {
        self.hot
            .kv_get
            .borrow_mut()
            .query_row((ns, key), |row| Ok(f(row.get_ref(0)?.as_blob()?)))
            .optional()
    }

    pub(crate) fn kv_put(&self, ns: &str, key: &str, value: &[u8]) -> rusqlite::Result<()> {
        self.hot
            .kv_put
            .borrow_mut()
            .execute((ns, key, value))
            .map(drop)
    }

    pub(crate) fn kv_delete(&self, ns: &str, key: &str) -> rusqlite::Result<bool> {
        self.hot
            .kv_delete
            .borrow_mut()
            .execute((ns, key))
            .map(|n| n > 0)
    }
}
