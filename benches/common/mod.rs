//! Workloads shared by the criterion benches (`benches/core.rs`) and the gateway benchmark binary
//! (`examples/bench/`), so both measure exactly the same statements.
//!
//! Every store here is opened with the pragmas the inbox itself uses (WAL, the same `synchronous`,
//! incremental auto-vacuum, foreign keys, a 64 MiB journal size limit, a 64-entry statement cache), so the
//! comparisons differ only in what each transaction does.

// Each of the two targets that include this file uses a different subset of it.
#![allow(dead_code)]

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use edge_inbox::rusqlite::{self, ffi, Connection};
use edge_inbox::{Config, Delivery, Fingerprint, IdHash, Inbox, Outcome, Tx};

/// Consumer scope of every benchmark delivery.
pub const SCOPE: &str = "bench";
/// Topic of every benchmark delivery.
pub const TOPIC: &str = "orders/created";
/// A typical small JSON event.
pub const PAYLOAD: &[u8] = br#"{"order":42,"sku":"A-1","qty":1,"kind":"created"}"#;
/// Same ids, other content: what the conflict path receives.
pub const OTHER_PAYLOAD: &[u8] = br#"{"order":42,"sku":"A-1","qty":2,"kind":"created"}"#;

/// The identity table of `schema.sql`, for the raw SQLite baseline.
const IDENTITIES: &str = "CREATE TABLE identities (
    scope_id    INTEGER NOT NULL,
    id_hash     BLOB    NOT NULL,
    fingerprint INTEGER NOT NULL,
    at          INTEGER NOT NULL,
    PRIMARY KEY (scope_id, id_hash)
) WITHOUT ROWID;";

/// What a user writes instead of an inbox: a table of processed ids and the same key-value effect.
/// The naive table has a plain index and no unique constraint: its query is the only guard, which is the
/// point of that design (and its flaw).
const PEERS: &str = "
CREATE TABLE processed_naive (message_id TEXT NOT NULL);
CREATE INDEX processed_naive_by_id ON processed_naive (message_id);
CREATE TABLE processed (message_id TEXT PRIMARY KEY);
CREATE TABLE kv (ns TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL, PRIMARY KEY (ns, key)) WITHOUT ROWID;";

/// `synchronous` setting of a plain SQLite connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sync {
    /// `synchronous=FULL`, the inbox default.
    Full,
    /// `synchronous=NORMAL`: in WAL mode no sync at commit (only at checkpoints), for instruction counts
    /// only. The inbox is configured so ([`edge_inbox::Synchronous::Normal`]); it offers no `OFF`, and puts
    /// back a level lowered through its connection before the next commit.
    Normal,
}

impl Sync {
    fn pragma(self) -> i64 {
        match self {
            Sync::Full => 2,
            Sync::Normal => 1,
        }
    }
}

/// Opens a plain SQLite connection with the inbox's pragmas and `ddl` as its schema.
pub fn open_plain(path: &Path, sync: Sync, ddl: &str) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    conn.set_prepared_statement_cache_capacity(64);
    conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL")?;
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
    assert_eq!(mode, "wal");
    conn.execute_batch(&format!(
        "PRAGMA synchronous = {}; PRAGMA foreign_keys = ON; PRAGMA journal_size_limit = {};",
        sync.pragma(),
        64 << 20
    ))?;
    let got: i64 = conn.query_row("PRAGMA synchronous", [], |r| r.get(0))?;
    assert_eq!(got, sync.pragma());
    conn.execute_batch(&format!("BEGIN IMMEDIATE; {ddl} COMMIT;"))?;
    Ok(conn)
}

static INBOX_CONFIG: std::sync::OnceLock<Config> = std::sync::OnceLock::new();

/// Sets the configuration every benchmark inbox opens with (once, before the first; default
/// `Config::default()`).
pub fn set_inbox_config(config: Config) {
    let _ = INBOX_CONFIG.set(config);
}

/// The configuration benchmark inboxes open with.
pub fn inbox_config() -> Config {
    INBOX_CONFIG.get().cloned().unwrap_or_default()
}

/// Opens an inbox at `sync` (`Sync::Normal`: configured with `Synchronous::Normal`).
pub fn open_inbox(path: &Path, sync: Sync) -> anyhow::Result<Inbox> {
    let config = match sync {
        Sync::Full => inbox_config(),
        Sync::Normal => inbox_config().synchronous(edge_inbox::Synchronous::Normal),
    };
    Ok(Inbox::open(path, config)?)
}

/// `n` distinct message ids, prefixed so separate runs never collide.
pub fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i:08}")).collect()
}

/// Deliveries for `ids`, all in [`SCOPE`] on [`TOPIC`].
pub fn deliveries<'a>(ids: &'a [String], payload: &'a [u8]) -> Vec<Delivery<'a>> {
    ids.iter()
        .map(|id| Delivery::new(SCOPE, id, TOPIC, payload))
        .collect()
}

/// The trivial state handler of the benchmarks: writes a small integer to the built-in key-value state.
pub fn kv_handler() -> impl FnMut(&mut Tx<'_>, &Delivery<'_>) -> anyhow::Result<()> {
    let mut n: u64 = 0;
    move |tx, _d| {
        n += 1;
        tx.put("counter", &n)?;
        Ok(())
    }
}

/// A handler that does nothing (isolates the inbox's own cost).
pub fn noop_handler(_tx: &mut Tx<'_>, _d: &Delivery<'_>) -> anyhow::Result<()> {
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------
// Physical limit

/// A file that is rewritten and fdatasync'ed: the device's commit limit.
pub struct FsyncFile {
    file: File,
    block: [u8; 4096],
}

impl FsyncFile {
    /// Creates `path`.
    pub fn create(path: &Path) -> std::io::Result<FsyncFile> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        Ok(FsyncFile {
            file,
            block: [7; 4096],
        })
    }

    /// One 4 KiB write in place plus `fdatasync`.
    pub fn write_sync(&mut self) -> std::io::Result<()> {
        self.file.seek(SeekFrom::Start(0))?;
        self.file.write_all(&self.block)?;
        self.file.sync_data()
    }
}

// ---------------------------------------------------------------------------------------------------------
// Raw SQLite: the identity insert alone, as the floor the inbox is compared with.

/// A plain connection holding only the identity table.
pub struct Raw {
    conn: Connection,
}

impl Raw {
    /// The connection, e.g. for pragmas of a measurement.
    pub fn conn(&self) -> &Connection {
        &self.conn
    }

    /// Opens `path` with the inbox's pragmas.
    pub fn open(path: &Path, sync: Sync) -> rusqlite::Result<Raw> {
        Ok(Raw {
            conn: open_plain(path, sync, IDENTITIES)?,
        })
    }

    /// One `BEGIN IMMEDIATE` ... `COMMIT` inserting one identity row per id (hashed as the inbox does).
    pub fn insert_tx(&mut self, ids: &[String], now: i64) -> rusqlite::Result<()> {
        let fp = Fingerprint::of(TOPIC, PAYLOAD).0 as i64;
        self.conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
        {
            let mut stmt = self.conn.prepare_cached(
                "INSERT INTO identities (scope_id, id_hash, fingerprint, at) VALUES (?1, ?2, ?3, ?4)",
            )?;
            for id in ids {
                let h = IdHash::of(None, id);
                stmt.execute((1i64, h.as_bytes(), fp, now))?;
            }
        }
        self.conn.prepare_cached("COMMIT")?.execute([])?;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------------------
// Naive peers

/// A plain connection with the tables a hand-written consumer uses.
pub struct Peer {
    conn: Connection,
    n: u64,
}

impl Peer {
    /// The connection, e.g. for pragmas of a measurement.
    pub fn conn(&self) -> &Connection {
        &self.conn
    }

    /// Opens `path` (creating the peer tables on a new file).
    pub fn open(path: &Path, sync: Sync) -> rusqlite::Result<Peer> {
        let conn = if path.exists() {
            let conn = Connection::open(path)?;
            conn.busy_timeout(Duration::from_secs(5))?;
            conn.set_prepared_statement_cache_capacity(64);
            conn.execute_batch(&format!("PRAGMA synchronous = {}", sync.pragma()))?;
            conn
        } else {
            open_plain(path, sync, PEERS)?
        };
        Ok(Peer { conn, n: 0 })
    }

    fn effect(&mut self) -> rusqlite::Result<()> {
        self.n += 1;
        self.conn
            .prepare_cached(
                "INSERT INTO kv (ns, key, value) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (ns, key) DO UPDATE SET value = excluded.value",
            )?
            .execute((SCOPE, "counter", &self.n.to_le_bytes()[..]))?;
        Ok(())
    }

    /// Query, then insert in a second transaction. Returns whether the effect was applied. Racy: two
    /// workers can both see "not processed" and both apply it.
    pub fn query_then_insert(&mut self, id: &str) -> rusqlite::Result<bool> {
        let seen = self
            .conn
            .prepare_cached("SELECT 1 FROM processed_naive WHERE message_id = ?1")?
            .exists([id])?;
        if seen {
            return Ok(false);
        }
        self.conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
        let r = (|| {
            self.conn
                .prepare_cached("INSERT INTO processed_naive (message_id) VALUES (?1)")?
                .execute([id])?;
            self.effect()
        })();
        self.finish(r.map(|()| true))
    }

    /// The classic idempotent consumer: BEGIN; INSERT processed(id) (primary key); effect; COMMIT.
    /// Returns whether the effect was applied (false: duplicate).
    pub fn classic(&mut self, id: &str) -> rusqlite::Result<bool> {
        self.conn.prepare_cached("BEGIN")?.execute([])?;
        let inserted = self
            .conn
            .prepare_cached("INSERT INTO processed (message_id) VALUES (?1)")?
            .execute([id]);
        let r = match inserted {
            Ok(_) => self.effect().map(|()| true),
            Err(rusqlite::Error::SqliteFailure(e, _))
                if e.extended_code == ffi::SQLITE_CONSTRAINT_PRIMARYKEY =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        };
        self.finish(r)
    }

    fn finish(&mut self, r: rusqlite::Result<bool>) -> rusqlite::Result<bool> {
        match r {
            Ok(applied) => {
                self.conn.prepare_cached("COMMIT")?.execute([])?;
                Ok(applied)
            }
            Err(e) => {
                let _ = self.conn.execute_batch("ROLLBACK");
                Err(e)
            }
        }
    }

    /// Commits `ids` as already processed (the `processed` and `processed_naive` tables and the effect) in one
    /// transaction: a file with a history, before a measurement.
    pub fn fill(&mut self, ids: &[String]) -> rusqlite::Result<()> {
        self.conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
        let r = (|| {
            for id in ids {
                self.conn
                    .prepare_cached("INSERT INTO processed (message_id) VALUES (?1)")?
                    .execute([id])?;
                self.conn
                    .prepare_cached("INSERT INTO processed_naive (message_id) VALUES (?1)")?
                    .execute([id])?;
                self.effect()?;
            }
            Ok(true)
        })();
        self.finish(r).map(drop)
    }

    /// Committed rows of the naive processed table beyond one per id: each is a repeated effect.
    pub fn naive_repeats(&self) -> rusqlite::Result<i64> {
        self.conn.query_row(
            "SELECT count(*) - count(DISTINCT message_id) FROM processed_naive",
            [],
            |r| r.get(0),
        )
    }
}

// ---------------------------------------------------------------------------------------------------------
// The inbox

/// `process` of every delivery, one transaction each; returns how many were of `expect`.
pub fn process_each<H>(
    inbox: &mut Inbox,
    deliveries: &[Delivery<'_>],
    handler: &mut H,
    expect: &str,
) -> anyhow::Result<usize>
where
    H: FnMut(&mut Tx<'_>, &Delivery<'_>) -> anyhow::Result<()>,
{
    let mut hits = 0;
    for d in deliveries {
        let o = inbox.process(d, &mut *handler)?;
        hits += usize::from(o.name() == expect);
    }
    Ok(hits)
}

/// `process_batch_into` over `deliveries` in chunks of `batch`, reusing `outcomes`.
pub fn process_batches<H>(
    inbox: &mut Inbox,
    deliveries: &[Delivery<'_>],
    batch: usize,
    handler: &mut H,
    outcomes: &mut Vec<Outcome>,
) -> anyhow::Result<usize>
where
    H: FnMut(&mut Tx<'_>, &Delivery<'_>) -> anyhow::Result<()>,
{
    let mut processed = 0;
    for chunk in deliveries.chunks(batch) {
        inbox.process_batch_into(chunk, handler, outcomes)?;
        processed += outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::Processed))
            .count();
    }
    Ok(processed)
}

/// Unix seconds now.
pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Runs `f` and returns its wall time.
pub fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let start = Instant::now();
    let r = f();
    (r, start.elapsed())
}
