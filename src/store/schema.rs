//! Opening the database file: permissions, pragmas, schema creation and forward migrations.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use rusqlite::{ffi, Connection, OpenFlags};

use crate::store::config::Config;
use crate::store::error::{extended_code, Error, Result};
use crate::store::id_order::IdOrder;
use crate::store::identity::IdKey;

/// The current schema, as a new database gets it.
pub(crate) const SCHEMA: &str = include_str!("../../schema.sql");

/// Version of the schema in `schema.sql` that this build creates and reads, stored in `PRAGMA user_version`.
pub const SCHEMA_VERSION: i64 = 6;

/// One forward migration: SQL, or code for what SQL cannot do.
enum Migration {
    Sql(&'static str),
    Code(fn(&Connection) -> rusqlite::Result<()>),
}

/// Forward migrations: `MIGRATIONS[i]` takes a database from version `i + 1` to `i + 2`.
/// They run in one transaction together with the `user_version` bump.
const MIGRATIONS: &[Migration] = &[
    // 1 -> 2: keyed identity hashes (this file keeps its unkeyed ones: id_key NULL), sequence windows, clock
    // bookkeeping.
    Migration::Sql(
        "CREATE TABLE inbox_meta (name TEXT PRIMARY KEY, value) WITHOUT ROWID; \
     INSERT INTO inbox_meta (name, value) VALUES ('id_key', NULL); \
     INSERT INTO inbox_meta (name, value) SELECT 'created_at', min(created_at) FROM scopes; \
     ALTER TABLE scope_stats ADD COLUMN sequence_conflicts INTEGER NOT NULL DEFAULT 0; \
     ALTER TABLE scope_stats ADD COLUMN identities_restamped INTEGER NOT NULL DEFAULT 0; \
     CREATE TABLE watermark_recent (scope_id INTEGER NOT NULL, producer TEXT NOT NULL, sequence INTEGER NOT NULL, \
       id_hash BLOB NOT NULL, fingerprint INTEGER NOT NULL, PRIMARY KEY (scope_id, producer, sequence)) WITHOUT ROWID;",
    ),
    // 2 -> 3: the strong case stops counting what it processes (its new identity rows are the count); every
    // identity row already there is accounted for in `processed`, so it all goes into the offset.
    Migration::Sql(
        "ALTER TABLE scope_stats ADD COLUMN identity_offset INTEGER NOT NULL DEFAULT 0; \
     UPDATE scope_stats SET identity_offset = (SELECT count(*) FROM identities i WHERE i.scope_id = scope_stats.scope_id);",
    ),
    // 3 -> 4: bounded, deduplicated quarantine and conflict records, their retention, and message ids
    // recognised under any sequence in the watermark window.
    Migration::Code(migrate_3_to_4),
    // 4 -> 5: processed bodies leave the index by id (see `schema.sql`, `messages_by_id`). The table is built
    // again: its inline UNIQUE constraint cannot be dropped. The rows and their seq are kept as they are. On a
    // file with many bodies the first open by this version copies the whole table once, through the WAL.
    Migration::Sql(
        "CREATE TABLE messages_v5 (seq INTEGER PRIMARY KEY, scope_id INTEGER NOT NULL, id_hash BLOB NOT NULL, \
           producer TEXT, message_id TEXT NOT NULL, topic TEXT NOT NULL, payload BLOB, sequence INTEGER, \
           sent_at INTEGER, order_key TEXT, state INTEGER NOT NULL CHECK (state IN (0, 1, 2, 3)), \
           attempts INTEGER NOT NULL DEFAULT 0, claims INTEGER NOT NULL DEFAULT 0, \
           not_before INTEGER NOT NULL DEFAULT 0, lease_owner TEXT, lease_until INTEGER, last_error TEXT, \
           received_at INTEGER NOT NULL, finished_at INTEGER); \
         INSERT INTO messages_v5 SELECT seq, scope_id, id_hash, producer, message_id, topic, payload, sequence, \
           sent_at, order_key, state, attempts, claims, not_before, lease_owner, lease_until, last_error, \
           received_at, finished_at FROM messages ORDER BY seq; \
         DROP TABLE messages; \
         ALTER TABLE messages_v5 RENAME TO messages; \
         CREATE UNIQUE INDEX messages_by_id ON messages (scope_id, id_hash) WHERE state IN (0, 2, 3); \
         CREATE INDEX messages_open ON messages (scope_id, seq) WHERE state IN (0, 2); \
         CREATE INDEX messages_dead ON messages (scope_id, seq) WHERE state = 3; \
         CREATE INDEX messages_open_by_key ON messages (scope_id, order_key, seq) \
           WHERE state IN (0, 2) AND order_key IS NOT NULL;",
    ),
    // 5 -> 6: identity keys may carry an order prefix (`IdOrder`), chosen when a file is created; a file
    // created before keeps the keyed hash alone. The version bump keeps older builds, which would hash
    // without the prefix and miss every stored identity, from opening a file that has one.
    Migration::Sql("INSERT OR IGNORE INTO inbox_meta (name, value) VALUES ('id_order', 'hashed');"),
];

const _: () = assert!(MIGRATIONS.len() as i64 == SCHEMA_VERSION - 1);

/// Schema 3 -> 4.
///
/// - `conflicts`: rows of the same (scope, identity, received content) merge into one, its `arrivals` the number
///   of rows, `at` the first and `last_at` the last; `conflict_records` starts at the merged row count.
/// - `quarantine`: every row becomes a bounded record (payload cut to its first `QUARANTINE_PREFIX` bytes, full
///   length and xxh3-128 kept, see `store::records`), with no record key: old rows are never merged with new
///   arrivals (their identity, if they had one, is not known). `quarantine_records` starts at the row count.
/// - `watermark_recent`: where one message id held several sequences (the defect this version fixes), only its
///   highest sequence keeps its row, so the new UNIQUE index on the id can be built; a later delivery on one of
///   the other sequences is compared with nothing and quarantined (`below-window`), never applied twice.
/// - `retention.record_age` (NULL: keep records forever, as before).
///
/// The counters `conflicts` and `quarantined` keep their figures (arrivals).
fn migrate_3_to_4(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "CREATE TABLE conflicts_v4 (id INTEGER PRIMARY KEY, scope_id INTEGER NOT NULL, id_hash BLOB NOT NULL, \
           producer TEXT, message_id TEXT NOT NULL, topic TEXT NOT NULL, stored_fingerprint INTEGER NOT NULL, \
           received_fingerprint INTEGER NOT NULL, at INTEGER NOT NULL, last_at INTEGER NOT NULL, \
           arrivals INTEGER NOT NULL DEFAULT 1); \
         INSERT INTO conflicts_v4 (id, scope_id, id_hash, producer, message_id, topic, stored_fingerprint, \
           received_fingerprint, at, last_at, arrivals) \
           SELECT min(id), scope_id, id_hash, producer, message_id, topic, stored_fingerprint, received_fingerprint, \
           min(at), max(at), count(*) FROM conflicts GROUP BY scope_id, id_hash, received_fingerprint; \
         DROP TABLE conflicts; \
         ALTER TABLE conflicts_v4 RENAME TO conflicts; \
         CREATE UNIQUE INDEX conflicts_by_content ON conflicts (scope_id, id_hash, received_fingerprint); \
         CREATE INDEX conflicts_by_age ON conflicts (scope_id, last_at); \
         CREATE TABLE quarantine_v4 (id INTEGER PRIMARY KEY, scope_id INTEGER, record_key BLOB, topic TEXT NOT NULL, \
           payload BLOB NOT NULL, payload_len INTEGER NOT NULL, payload_hash BLOB NOT NULL, reason TEXT NOT NULL, \
           at INTEGER NOT NULL, last_at INTEGER NOT NULL, arrivals INTEGER NOT NULL DEFAULT 1);",
    )?;
    crate::store::records::migrate_quarantine_v3(conn)?;
    conn.execute_batch(
        "DROP TABLE quarantine; \
         ALTER TABLE quarantine_v4 RENAME TO quarantine; \
         CREATE UNIQUE INDEX quarantine_by_key ON quarantine (scope_id, record_key); \
         CREATE INDEX quarantine_by_age ON quarantine (scope_id, last_at); \
         ALTER TABLE scope_stats ADD COLUMN conflict_records INTEGER NOT NULL DEFAULT 0; \
         ALTER TABLE scope_stats ADD COLUMN quarantine_records INTEGER NOT NULL DEFAULT 0; \
         UPDATE scope_stats SET \
           conflict_records = (SELECT count(*) FROM conflicts c WHERE c.scope_id = scope_stats.scope_id), \
           quarantine_records = (SELECT count(*) FROM quarantine q WHERE q.scope_id = scope_stats.scope_id); \
         ALTER TABLE retention ADD COLUMN record_age INTEGER; \
         DELETE FROM watermark_recent AS w WHERE EXISTS (SELECT 1 FROM watermark_recent o \
           WHERE o.scope_id = w.scope_id AND o.id_hash = w.id_hash \
           AND o.sequence > w.sequence); \
         CREATE UNIQUE INDEX watermark_recent_by_id ON watermark_recent (scope_id, id_hash);",
    )
}

/// Opens (creating if needed) the inbox database at `path` for reading and writing.
pub(crate) fn open(path: &Path, config: &Config) -> Result<Connection> {
    crate::store::sqlite_version::warn_if_affected();
    create_private(path)?;
    // Some lock conflicts while a new file is switched to WAL or its schema is created by another
    // connection return SQLITE_BUSY without consulting the busy handler; retry those within the timeout.
    // No deadline past what an Instant can hold (`Duration::MAX` for "wait for ever").
    let deadline = std::time::Instant::now().checked_add(config.busy_timeout);
    loop {
        match open_once(path, config) {
            Err(Error::Busy { .. }) if deadline.is_none_or(|d| std::time::Instant::now() < d) => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            other => return other,
        }
    }
}

/// Waits for a lock held by another connection in short sleeps, up to `timeout`.
///
/// SQLite's own busy timeout sleeps 1, 2, 5, 10, 15, 20, 25 ms...: a single-delivery commit that meets a
/// prune step holding the write lock for a millisecond waited 1 ms at least, and 3 or 8 ms after a second or
/// third try, so its latency was set by the sleep table, not by the lock. These sleeps start at 25 µs and
/// double up to 1 ms, and the timeout is measured on the clock (a coarse timer stretches short sleeps).
/// The timeout travels in the handler's pointer argument; on 32-bit targets it is capped at about 71
/// minutes.
pub(crate) fn install_busy_handler(
    conn: &Connection,
    timeout: std::time::Duration,
) -> rusqlite::Result<()> {
    use std::cell::Cell;
    use std::os::raw::{c_int, c_void};
    use std::time::{Duration, Instant};
    thread_local! {
        // When the current wait began. SQLite calls the handler on the thread running the statement, with
        // `count` 0 at the start of every wait, and one wait never interleaves with another on a thread.
        static WAIT_START: Cell<Option<Instant>> = const { Cell::new(None) };
    }
    unsafe extern "C" fn on_busy(arg: *mut c_void, count: c_int) -> c_int {
        let timeout = Duration::from_micros(arg as usize as u64);
        let now = Instant::now();
        let start = if count <= 0 {
            WAIT_START.with(|s| s.set(Some(now)));
            now
        } else {
            WAIT_START.with(|s| s.get()).unwrap_or(now)
        };
        let left = timeout.saturating_sub(now.duration_since(start));
        if left.is_zero() {
            return 0;
        }
        let step = u32::try_from(count).unwrap_or(0).min(6);
        let delay = Duration::from_micros((25u64 << step).min(1_000));
        std::thread::sleep(delay.min(left));
        1
    }
    let timeout_us = u64::try_from(timeout.as_micros()).unwrap_or(u64::MAX);
    let arg = usize::try_from(timeout_us).unwrap_or(usize::MAX) as *mut c_void;
    // SAFETY: `on_busy` never unwinds and never dereferences `arg`; the handle is this open connection's.
    let rc = unsafe { rusqlite::ffi::sqlite3_busy_handler(conn.handle(), Some(on_busy), arg) };
    if rc == rusqlite::ffi::SQLITE_OK {
        Ok(())
    } else {
        Err(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rc),
            None,
        ))
    }
}

/// Opens `path` with `flags` through the configured VFS, with the configured busy timeout.
fn connect(path: &Path, flags: OpenFlags, config: &Config) -> Result<Connection> {
    let conn = match &config.vfs {
        None => Connection::open_with_flags(path, flags),
        Some(vfs) => Connection::open_with_flags_and_vfs(path, flags, vfs.as_str()),
    }
    .map_err(|e| classify_open(e, path))?;
    install_busy_handler(&conn, config.busy_timeout).map_err(Error::from)?;
    Ok(conn)
}

fn open_once(path: &Path, config: &Config) -> Result<Connection> {
    // Serialized where a thread of the connection's own may act on a deleted WAL while it is idle
    // (`store/db.rs`, `spawn_waiter`): SQLite's mutex then orders its calls with the owner's.
    #[cfg(target_os = "linux")]
    let threading = OpenFlags::SQLITE_OPEN_FULL_MUTEX;
    #[cfg(not(target_os = "linux"))]
    let threading = OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = connect(path, OpenFlags::SQLITE_OPEN_READ_WRITE | threading, config)?;
    // Room for the core's statements plus a handler's own cached ones, so neither evicts the other.
    conn.set_prepared_statement_cache_capacity(64);

    let version = known_version(&conn, path)?;
    if version == 0 {
        check_id_order(config.id_order)?;
        // Before auto_vacuum, which fixes the page size of the empty file.
        if let Some(size) = config.page_size {
            set_page_size(&conn, size)?;
        }
        // Must precede the first table: auto_vacuum can only be chosen on an empty database.
        conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL")
            .map_err(Error::from)?;
    }
    set_wal(&conn)?;
    apply_settings(&conn, config)?;
    if version != SCHEMA_VERSION {
        install_or_migrate(&conn, config.id_order)?;
    }
    Ok(conn)
}

/// Opens the connection of the inbox's checkpoint thread ([`crate::store::checkpointer`], which sets its busy
/// handler): it never writes a page, and syncs its checkpoints at the inbox's `synchronous` level.
pub(crate) fn open_for_checkpoints(path: &Path, config: &Config) -> Result<Connection> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = connect(path, flags, config)?;
    apply_settings(&conn, config)?;
    // A checkpoint copies frames through a buffer of its own, not through the page cache.
    set_cache_kib(&conn, CHECKPOINT_CACHE_KIB)?;
    // Reads the schema, which opens the WAL and its index for the checkpoints.
    conn.query_row("SELECT count(*) FROM sqlite_master", [], |r| {
        r.get::<_, i64>(0)
    })
    .map_err(Error::from)?;
    Ok(conn)
}

/// Opens an existing inbox read-only (for inspection tools). Refuses a missing file or an unknown schema.
///
/// SQLite creates the `-wal` and `-shm` files of an idle inbox even for a read-only connection, owned by
/// whoever opens it, and leaves them: opened by another user than the file's owner (an operator in its
/// group), they would keep the owner's consumer from opening its own file. So an idle file (neither exists)
/// of another owner is opened `immutable`: read as it is on disk, nothing created. A write that begins
/// meanwhile is not seen (and a checkpoint copying into the file meanwhile could show a torn report); run
/// the command again, or as the file's owner.
pub fn open_read_only(path: &Path) -> Result<Connection> {
    must_exist(path)?;
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = if idle_and_not_ours(path) {
        let uri = format!("file:{}?immutable=1", uri_path(path));
        Connection::open_with_flags(uri, flags | OpenFlags::SQLITE_OPEN_URI)
    } else {
        Connection::open_with_flags(path, flags)
    }
    .map_err(|e| classify_open(e, path))?;
    let version = known_version(&conn, path)?;
    if version == 0 {
        return Err(no_inbox_schema(path));
    }
    Ok(conn)
}

/// Whether `path` has neither a `-wal` nor a `-shm` beside it and belongs to another user than this
/// process's (root excepted: SQLite gives the files it creates as root to the database's owner).
#[cfg(target_os = "linux")]
fn idle_and_not_ours(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let beside = |suffix: &str| {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        std::path::PathBuf::from(p).exists()
    };
    // SAFETY: a plain system call without arguments.
    let euid = unsafe { libc::geteuid() };
    euid != 0
        && std::fs::metadata(path).is_ok_and(|m| m.uid() != euid)
        && !beside("-wal")
        && !beside("-shm")
}

#[cfg(not(target_os = "linux"))]
fn idle_and_not_ours(_path: &Path) -> bool {
    false
}

/// `path` for an SQLite URI: the characters a URI gives a meaning to, percent-encoded.
fn uri_path(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut out = String::new();
    for &b in path.as_os_str().as_bytes() {
        match b {
            b'%' | b'?' | b'#' | b' ' | 0x80..=0xff | 0..=0x1f | 0x7f => {
                out.push_str(&format!("%{b:02X}"))
            }
            _ => out.push(b as char),
        }
    }
    out
}

/// Refuses a path where nothing is, with the operating system's own reason (missing, or a directory on the
/// way that cannot be searched), before SQLite would report a generic "unable to open" or create a file.
fn must_exist(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(_) => Ok(()),
        Err(source) => Err(Error::Open {
            path: path.to_owned(),
            source,
        }),
    }
}

/// A database that holds no inbox schema.
fn no_inbox_schema(path: &Path) -> Error {
    Error::InvalidArgument(format!("{} holds no edge-inbox schema", path.display()))
}

/// Oldest schema version [`downgrade_schema`] can take a file back to.
pub const OLDEST_DOWNGRADE: i64 = 5;

/// Takes the inbox file at `path` back to schema version `to`, so that an older build (a firmware rolled
/// back) opens it instead of refusing it as too new ([`Error::SchemaTooNew`]). Stop every process that has
/// the file open first: one that keeps running goes on at the version it opened.
///
/// Only what the older version can read the same way is taken back, so that no identity is lost:
///
/// - 6 to 5 removes the file's recorded identity layout (`inbox_meta` 'id_order'). Allowed only for
///   [`IdOrder::Hashed`], the one layout version 5 knows; a file of another layout is refused with
///   [`Error::InvalidArgument`], since version 5 would hash every id without the prefix, find none of the
///   stored identities and apply redeliveries again.
/// - Below [`OLDEST_DOWNGRADE`]: refused (those migrations rebuilt tables).
///
/// Returns the version the file was at. A file already at `to` is left as it is, unwritten. The change is
/// one write transaction, durable when this returns (`synchronous=FULL`). The next
/// [`Inbox::open`](crate::Inbox::open) by this version migrates the file forward again.
///
/// ```no_run
/// edge_inbox::downgrade_schema(std::path::Path::new("/data/inbox.db"), 5)?;
/// # Ok::<(), edge_inbox::Error>(())
/// ```
pub fn downgrade_schema(path: &Path, to: i64) -> Result<i64> {
    must_exist(path)?;
    let conn = connect(path, OpenFlags::SQLITE_OPEN_READ_WRITE, &Config::default())?;
    if known_version(&conn, path)? == 0 {
        return Err(no_inbox_schema(path));
    }
    if !(OLDEST_DOWNGRADE..=SCHEMA_VERSION).contains(&to) {
        return Err(Error::InvalidArgument(format!(
            "schema version {to}: this version takes files back to versions {OLDEST_DOWNGRADE} to {SCHEMA_VERSION}"
        )));
    }
    conn.execute_batch("PRAGMA synchronous = FULL; BEGIN IMMEDIATE")
        .map_err(Error::from)?;
    let result = (|| {
        // Read again under the write lock: another process may have migrated the file meanwhile.
        let found = version(&conn)?;
        if found > SCHEMA_VERSION {
            return Err(Error::SchemaTooNew {
                found,
                supported: SCHEMA_VERSION,
            });
        }
        if found < to {
            return Err(Error::InvalidArgument(format!(
                "the file is at schema version {found}, below {to}: `Inbox::open` migrates it forward"
            )));
        }
        let has_meta: bool = conn.query_row(
            "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = 'inbox_meta'",
            [],
            |r| r.get(0),
        )?;
        if !has_meta {
            return Err(no_inbox_schema(path));
        }
        let mut version = found;
        while version > to {
            match version {
                6 => {
                    let order = meta(&conn, "id_order")?;
                    if order.as_deref() != Some(&b"hashed"[..]) {
                        let order = order.map_or("no recorded layout".into(), |o| {
                            format!("{:?}", String::from_utf8_lossy(&o))
                        });
                        return Err(Error::InvalidArgument(format!(
                            "the file's identity keys have {order}: version 5 knows only \"hashed\" and \
                             would find none of its identities"
                        )));
                    }
                    conn.execute("DELETE FROM inbox_meta WHERE name = 'id_order'", [])?;
                }
                // Ruled out by the range check above; refused rather than assumed.
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "schema version {version} cannot be taken back by this version"
                    )))
                }
            }
            log::info!(
                "inbox schema taken back from version {version} to {}",
                version - 1
            );
            version -= 1;
        }
        if found == to {
            // Nothing to change, and nothing written.
            conn.execute_batch("ROLLBACK")?;
        } else {
            conn.execute_batch(&format!("PRAGMA user_version = {version}; COMMIT;"))?;
        }
        Ok(found)
    })();
    if result.is_err() && !conn.is_autocommit() {
        if let Err(e) = conn.execute_batch("ROLLBACK") {
            // Closing the connection below rolls back all the same.
            log::warn!("downgrade: ROLLBACK failed: {e}");
        }
    }
    result
}

/// `PRAGMA user_version`, refusing a file that is not a database or was written by a newer version.
fn known_version(conn: &Connection, path: &Path) -> Result<i64> {
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(|e| classify_open(e, path))?;
    if version > SCHEMA_VERSION {
        return Err(Error::SchemaTooNew {
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    // No version of the inbox writes a negative one: another application's file.
    if version < 0 {
        return Err(Error::NotADatabase {
            path: path.to_path_buf(),
        });
    }
    Ok(version)
}

/// Creates the file with mode 0600 before SQLite sees it: SQLite would use the umask, and the WAL and
/// shared-memory files copy the database's mode.
fn create_private(path: &Path) -> Result<()> {
    match OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(Error::Open {
            path: path.to_owned(),
            source: e,
        }),
    }
}

fn classify_open(err: rusqlite::Error, path: &Path) -> Error {
    match extended_code(&err).map(|c| c & 0xff) {
        Some(ffi::SQLITE_NOTADB) => Error::NotADatabase {
            path: path.to_owned(),
        },
        Some(ffi::SQLITE_CANTOPEN) => {
            // rusqlite ends the message with the path, which `Error::Open` prints already.
            let text = err.to_string();
            let suffix = format!(": {}", path.display());
            Error::Open {
                path: path.to_owned(),
                source: std::io::Error::other(text.strip_suffix(&suffix).unwrap_or(&text)),
            }
        }
        _ => Error::from(err),
    }
}

/// The page size of a new, still empty file (SQLite fixes it with the first page written), read back.
fn set_page_size(conn: &Connection, size: u32) -> Result<()> {
    conn.execute_batch(&format!("PRAGMA page_size = {size}"))
        .map_err(Error::from)?;
    let got: i64 = conn
        .query_row("PRAGMA page_size", [], |r| r.get(0))
        .map_err(Error::from)?;
    if got != i64::from(size) {
        return Err(Error::Setting {
            wanted: format!("page_size={size}"),
            got: got.to_string(),
        });
    }
    Ok(())
}

fn set_wal(conn: &Connection) -> Result<()> {
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
        .map_err(Error::from)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(Error::Setting {
            wanted: "journal_mode=wal".into(),
            got: mode,
        });
    }
    Ok(())
}

/// The smallest page cache [`Config::cache_size`] sets, and the checkpoint thread's.
const MIN_CACHE_KIB: usize = 64;
const CHECKPOINT_CACHE_KIB: usize = MIN_CACHE_KIB;

/// Sets the page cache's limit in KiB (a negative `cache_size`), read back.
fn set_cache_kib(conn: &Connection, kib: usize) -> Result<()> {
    set_pragma(conn, "cache_size", -i64::try_from(kib).unwrap_or(i64::MAX))
}

/// Sets an integer pragma and reads it back: one SQLite ignores is an [`Error::Setting`].
fn set_pragma(conn: &Connection, name: &str, wanted: i64) -> Result<()> {
    conn.execute_batch(&format!("PRAGMA {name} = {wanted}"))
        .map_err(Error::from)?;
    let got: i64 = conn
        .query_row(&format!("PRAGMA {name}"), [], |r| r.get(0))
        .map_err(Error::from)?;
    if got != wanted {
        return Err(Error::Setting {
            wanted: format!("{name}={wanted}"),
            got: got.to_string(),
        });
    }
    Ok(())
}

/// Per-connection settings, each read back: a silently ignored pragma would void the durability promise.
fn apply_settings(conn: &Connection, config: &Config) -> Result<()> {
    set_pragma(conn, "synchronous", config.synchronous.pragma_value())?;
    conn.execute_batch("PRAGMA foreign_keys = ON")
        .map_err(Error::from)?;
    set_cache_kib(conn, (config.cache_bytes / 1024).max(MIN_CACHE_KIB))?;
    let limit: i64 = conn
        .query_row(
            &format!("PRAGMA journal_size_limit = {}", config.journal_size_limit),
            [],
            |r| r.get(0),
        )
        .map_err(Error::from)?;
    if limit != config.journal_size_limit {
        return Err(Error::Setting {
            wanted: format!("journal_size_limit={}", config.journal_size_limit),
            got: limit.to_string(),
        });
    }
    Ok(())
}

/// Creates or upgrades the schema in one write transaction. The version is read again under the write lock,
/// so two processes opening a new file at once do not both create it.
fn install_or_migrate(conn: &Connection, order: IdOrder) -> Result<()> {
    conn.execute_batch("BEGIN IMMEDIATE").map_err(Error::from)?;
    let result = (|| {
        let mut version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if version > SCHEMA_VERSION {
            return Ok(Some(version));
        }
        if version == 0 {
            conn.execute_batch(SCHEMA)?;
            let key = IdKey::generate()
                .map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
            conn.execute(
                "INSERT INTO inbox_meta (name, value) VALUES ('id_key', ?1), ('created_at', ?2), ('id_order', ?3)",
                (
                    key.secret().map(|s| &s[..]),
                    crate::store::txn::unix_now(),
                    order.name(),
                ),
            )?;
            version = SCHEMA_VERSION;
        }
        while version < SCHEMA_VERSION {
            log::info!(
                "migrating inbox schema from version {version} to {}",
                version + 1
            );
            match &MIGRATIONS[(version - 1) as usize] {
                Migration::Sql(sql) => conn.execute_batch(sql)?,
                Migration::Code(f) => f(conn)?,
            }
            version += 1;
        }
        conn.execute_batch(&format!("PRAGMA user_version = {version}; COMMIT;"))?;
        Ok(None)
    })();
    match result {
        Ok(None) => Ok(()),
        Ok(Some(found)) => {
            let _ = conn.execute_batch("ROLLBACK");
            Err(Error::SchemaTooNew {
                found,
                supported: SCHEMA_VERSION,
            })
        }
        Err(e) => Err(rollback_after(conn, e)),
    }
}

/// The identity key of the database on `conn` ([`IdKey::UNKEYED`](crate::IdKey::UNKEYED) for a file of
/// schema version 1, migrated or not), with the file's layout ([`IdOrder::Hashed`] before version 6).
pub(crate) fn id_key(conn: &Connection) -> Result<IdKey> {
    let key = if version(conn)? < 2 {
        IdKey::UNKEYED
    } else {
        use rusqlite::OptionalExtension;
        // NULL: a file migrated from version 1 keeps its unkeyed hashes. No row, or another length: damage
        // or an edit, and hashing under any other key would miss every stored identity.
        let stored: Option<Option<Vec<u8>>> = conn
            .prepare_cached("SELECT value FROM inbox_meta WHERE name = 'id_key'")?
            .query_row([], |r| r.get(0))
            .optional()?;
        match stored {
            None => return Err(Error::InvalidArgument(
                "the file records no identity key (inbox_meta 'id_key'): it was damaged or edited"
                    .into(),
            )),
            Some(bytes) => IdKey::from_stored(bytes.as_deref()).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "the file's identity key is {} bytes, not {}: it was damaged or edited",
                    bytes.as_ref().map_or(0, Vec::len),
                    crate::store::identity::ID_KEY_LEN
                ))
            })?,
        }
    };
    let order = match meta(conn, "id_order")? {
        // From version 6 every file records its layout: guessing one for a file that lost the row could
        // miss every stored identity and apply redeliveries again.
        None if version(conn)? >= 6 => return Err(Error::InvalidArgument(
            "the file records no identity order (inbox_meta 'id_order'): it was damaged or edited"
                .into(),
        )),
        None => IdOrder::Hashed,
        Some(name) => std::str::from_utf8(&name)
            .ok()
            .and_then(IdOrder::parse)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "the file's identity order {:?} is not one this version knows",
                    String::from_utf8_lossy(&name)
                ))
            })?,
    };
    Ok(key.with_order(order))
}

/// Refuses an [`IdOrder`] no file can be created with (a [`IdOrder::Leading`] of 0 or more than 16 bytes).
fn check_id_order(order: IdOrder) -> Result<()> {
    if IdOrder::parse(&order.name()) == Some(order) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "identity order {order:?}: leading takes 1 to {} bytes",
            IdOrder::MAX_LEADING
        )))
    }
}

/// A value of `inbox_meta` as bytes (a blob, or a text's UTF-8); `None` when absent, NULL, or the file
/// predates the table.
pub(crate) fn meta(conn: &Connection, name: &str) -> Result<Option<Vec<u8>>> {
    if version(conn)? < 2 {
        return Ok(None);
    }
    use rusqlite::types::ValueRef;
    use rusqlite::OptionalExtension;
    Ok(conn
        .prepare_cached("SELECT value FROM inbox_meta WHERE name = ?1")?
        .query_row([name], |r| match r.get_ref(0)? {
            ValueRef::Blob(b) | ValueRef::Text(b) => Ok(Some(b.to_vec())),
            ValueRef::Null => Ok(None),
            other => Err(rusqlite::Error::InvalidColumnType(
                0,
                "value".into(),
                other.data_type(),
            )),
        })
        .optional()?
        .flatten())
}

/// An integer value of `inbox_meta`.
pub(crate) fn meta_i64(conn: &Connection, name: &str) -> Result<Option<i64>> {
    if version(conn)? < 2 {
        return Ok(None);
    }
    use rusqlite::OptionalExtension;
    Ok(conn
        .prepare_cached(
            "SELECT value FROM inbox_meta WHERE name = ?1 AND typeof(value) = 'integer'",
        )?
        .query_row([name], |r| r.get::<_, i64>(0))
        .optional()?)
}

/// `PRAGMA user_version` of the open file.
pub(crate) fn version(conn: &Connection) -> Result<i64> {
    Ok(conn.query_row("PRAGMA user_version", [], |r| r.get(0))?)
}

fn rollback_after(conn: &Connection, err: rusqlite::Error) -> Error {
    if !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    Error::from(err)
}
