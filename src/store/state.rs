//! The handler's view of the open transaction: built-in key-value state and the raw SQLite connection.

use std::cell::{Cell, RefCell};

use rusqlite::{ffi, Connection};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::store::db::Db;
use crate::store::error::{extended_code, Error, Result};

/// The transaction a handler runs in. Everything written through it (the key-value state, the user's own
/// tables through [`Tx::sql`], outbox rows) commits or aborts together with the delivery's identity.
///
/// Do not run `BEGIN`, `COMMIT`, `ROLLBACK`, `SAVEPOINT` or `RELEASE` yourself: the inbox owns the
/// transaction, and a handler that ends it fails the whole batch.
pub struct Tx<'a> {
    conn: &'a Db,
    scope: &'a str,
    scope_id: i64,
    now: i64,
    buf: &'a RefCell<Vec<u8>>,
    failure: &'a Cell<Option<i32>>,
    /// Identity (producer, message id) of the delivery being handled: the outbox derives its ids from it.
    origin: Option<(Option<&'a str>, &'a str)>,
    /// Outbox messages published so far by this handler call.
    published: Cell<u32>,
}

impl<'a> Tx<'a> {
    pub(crate) fn new(
        conn: &'a Db,
        scope: &'a str,
        scope_id: i64,
        now: i64,
        buf: &'a RefCell<Vec<u8>>,
        failure: &'a Cell<Option<i32>>,
    ) -> Self {
        Tx {
            conn,
            scope,
            scope_id,
            now,
            buf,
            failure,
            origin: None,
            published: Cell::new(0),
        }
    }

    /// The same transaction, handling the delivery `(producer, message_id)`.
    pub(crate) fn with_origin(mut self, producer: Option<&'a str>, message_id: &'a str) -> Self {
        self.origin = Some((producer, message_id));
        self
    }

    pub(crate) fn origin(&self) -> Option<(Option<&'a str>, &'a str)> {
        self.origin
    }

    /// Index of the next outbox message of this handler call, counting it.
    pub(crate) fn next_publish_index(&self) -> u32 {
        let i = self.published.get();
        self.published.set(i.wrapping_add(1));
        i
    }

    pub(crate) fn db(&self) -> &'a Db {
        self.conn
    }

    /// The consumer scope of the delivery being handled; also the default key-value namespace.
    pub fn scope(&self) -> &str {
        self.scope
    }

    /// Interned id of the scope (as stored in the inbox tables).
    pub fn scope_id(&self) -> i64 {
        self.scope_id
    }

    /// Time of this transaction, Unix seconds.
    pub fn now(&self) -> i64 {
        self.now
    }

    /// The SQLite connection, inside the open transaction, for the application's own tables.
    /// Storage trouble met on it (busy, full, I/O, read-only) fails the whole batch as an [`Error`], known by the
    /// connection's own last result code when the handler returns (so run nothing more on it after such an
    /// error: return it). Other errors the handler returns (a constraint of your own, or any error of another
    /// database the handler opened itself) are handler failures.
    ///
    /// No statement run through it can commit on its own: if SQLite rolls the transaction back (an I/O
    /// error, a trigger's `RAISE(ROLLBACK)`, `INSERT OR ROLLBACK`), later statements would run in
    /// autocommit, and the inbox refuses those commits (the statement fails with
    /// `SQLITE_CONSTRAINT_COMMITHOOK`) and fails the batch with [`Error::HandlerEndedTransaction`].
    ///
    /// Its commit and rollback hooks are that guard and reserved: a handler that replaces them
    /// (`commit_hook`, `rollback_hook`) fails its call with [`Error::HandlerEndedTransaction`], and what it
    /// committed on its own meanwhile cannot be undone. A handler's writes commit when the call returns `Ok`.
    pub fn sql(&self) -> &Connection {
        self.conn
    }

    /// Reads `key` from the scope's namespace.
    pub fn get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>> {
        self.get_in(self.scope, key)
    }

    /// Writes `key` in the scope's namespace.
    pub fn put<T: Serialize + ?Sized>(&self, key: &str, value: &T) -> Result<()> {
        self.put_in(self.scope, key, value)
    }

    /// Deletes `key` from the scope's namespace; true if it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        self.delete_in(self.scope, key)
    }

    /// Reads `key` from namespace `ns`.
    pub fn get_in<T: DeserializeOwned>(&self, ns: &str, key: &str) -> Result<Option<T>> {
        let found = self.track(|| {
            self.conn.kv_get(ns, key, |blob| {
                ciborium::from_reader::<T, _>(blob).map_err(|e| e.to_string())
            })
        })?;
        match found {
            None => Ok(None),
            Some(Ok(v)) => Ok(Some(v)),
            Some(Err(why)) => Err(Error::Codec(format!("value of {ns}/{key}: {why}"))),
        }
    }

    /// Writes `key` in namespace `ns`, replacing any previous value.
    pub fn put_in<T: Serialize + ?Sized>(&self, ns: &str, key: &str, value: &T) -> Result<()> {
        let mut buf = self.buf.borrow_mut();
        buf.clear();
        ciborium::into_writer(value, &mut *buf)
            .map_err(|e| Error::Codec(format!("{ns}/{key}: {e}")))?;
        self.track(|| self.conn.kv_put(ns, key, &buf))
    }

    /// Deletes `key` from namespace `ns`; true if it existed.
    pub fn delete_in(&self, ns: &str, key: &str) -> Result<bool> {
        self.track(|| self.conn.kv_delete(ns, key))
    }

    /// Runs a statement of the inbox's own and remembers storage trouble, so a handler that swallows the
    /// error cannot commit a half-applied effect.
    ///
    /// Once the transaction is gone (SQLite rolled it back) or storage trouble was met, nothing more runs:
    /// the batch fails anyway, and a write that ran now would run outside the delivery's transaction.
    pub(crate) fn track<T>(&self, f: impl FnOnce() -> rusqlite::Result<T>) -> Result<T> {
        if let Some(code) = self.failure.get() {
            return Err(crate::store::error::storage_error(code));
        }
        if self.conn.handler_tx_ended() {
            return Err(Error::HandlerEndedTransaction);
        }
        f().map_err(|e| {
            // Remembered, so that a handler that swallows the error cannot commit what it computed without
            // it; an interrupt (the handler's own doing) then fails the delivery, not the batch.
            if let Some(code) = extended_code(&e).filter(|c| is_storage_failure(*c)) {
                self.failure.set(Some(code));
            }
            Error::from(e)
        })
    }
}

/// An interrupt: on the inbox's connection only a handler causes one (`sqlite3_interrupt`, a progress
/// handler), as the inbox never interrupts its own statements.
pub(crate) fn is_interrupt(extended: i32) -> bool {
    extended & 0xff == ffi::SQLITE_INTERRUPT
}

/// True for result codes that mean the store itself is in trouble (as opposed to a statement that is wrong
/// or violates an application constraint). Such an error fails the batch; it is never a handler failure.
pub(crate) fn is_storage_failure(extended: i32) -> bool {
    matches!(
        extended & 0xff,
        ffi::SQLITE_BUSY
            | ffi::SQLITE_LOCKED
            | ffi::SQLITE_NOMEM
            | ffi::SQLITE_READONLY
            | ffi::SQLITE_INTERRUPT
            | ffi::SQLITE_IOERR
            | ffi::SQLITE_CORRUPT
            | ffi::SQLITE_FULL
            | ffi::SQLITE_CANTOPEN
            | ffi::SQLITE_PROTOCOL
            | ffi::SQLITE_NOTADB
            | ffi::SQLITE_NOLFS
    )
}
