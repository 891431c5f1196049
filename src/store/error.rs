//! Errors, classified by SQLite extended result codes (never by message text).

use std::fmt;
use std::path::PathBuf;

use rusqlite::ffi;

/// Why a delivery was refused before anything was written.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidDelivery {
    /// The consumer scope is empty.
    EmptyScope,
    /// The message id is empty.
    EmptyMessageId,
    /// The producer namespace is present but empty.
    EmptyProducer,
    /// A field is longer than the configured limit.
    TooLong {
        /// Which field: `scope`, `producer`, `message id`, `topic` or `payload`.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The configured maximum in bytes.
        max: usize,
    },
    /// No application message id could be found (MQTT adapter: no user property, no envelope).
    MissingId,
    /// The payload envelope could not be decoded.
    MalformedEnvelope(String),
    /// An MQTT 5 user property holds a value that cannot be read (a `sent-at` that is no time, say).
    MalformedProperty {
        /// The property's name.
        name: String,
        /// What is wrong with its value.
        why: String,
    },
    /// The topic matches a topic filter the [`Consumer`](crate::Consumer)'s earlier configuration subscribed
    /// and none of its current ones: the broker's session queued it for that subscription (the consumer
    /// unsubscribes such filters when it connects, but what was queued for them before still arrives).
    NotSubscribed,
}

impl fmt::Display for InvalidDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InvalidDelivery::EmptyScope => f.write_str("consumer scope is empty"),
            InvalidDelivery::EmptyMessageId => f.write_str("message id is empty"),
            InvalidDelivery::EmptyProducer => {
                f.write_str("producer namespace is present but empty")
            }
            InvalidDelivery::TooLong { field, len, max } => {
                write!(f, "{field} is {len} bytes, over the limit of {max}")
            }
            InvalidDelivery::MissingId => f.write_str("delivery carries no application message id"),
            InvalidDelivery::MalformedEnvelope(why) => write!(f, "malformed envelope: {why}"),
            InvalidDelivery::MalformedProperty { name, why } => {
                write!(f, "user property {name:?}: {why}")
            }
            InvalidDelivery::NotSubscribed => f.write_str(
                "the topic matches none of the consumer's topic filters, only one an earlier configuration \
                 subscribed and this one removed",
            ),
        }
    }
}

impl std::error::Error for InvalidDelivery {}

/// Everything that can go wrong in the inbox.
///
/// None of these is ever a duplicate: a caller that gets an `Err` must not acknowledge the delivery.
/// [`Error::is_retryable`] tells whether the same call may succeed later without operator action.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The database stayed locked by another connection for longer than the busy timeout.
    /// Nothing was written; retry later.
    Busy {
        /// SQLite extended result code (`SQLITE_BUSY*` or `SQLITE_LOCKED*`).
        code: i32,
    },
    /// The disk (or `max_page_count`) is full. The transaction was rolled back; nothing was written.
    DiskFull,
    /// The database or its file system is read-only. Nothing was written.
    ReadOnly {
        /// SQLite extended result code (`SQLITE_READONLY*`).
        code: i32,
    },
    /// `COMMIT` failed with an I/O error: the transaction may or may not be durable.
    /// Do not acknowledge; when the broker redelivers, the identity lookup settles it.
    CommitUnknown {
        /// SQLite extended result code returned by `COMMIT`.
        code: i32,
        /// The underlying error.
        source: rusqlite::Error,
    },
    /// `COMMIT` was refused by a deferred constraint of the application's own tables (a deferred foreign
    /// key, say). Nothing was committed. [`Inbox::process`](crate::Inbox::process) and its batch forms turn
    /// this into [`Outcome::HandlerFailed`](crate::Outcome::HandlerFailed) for the delivery at fault, and a
    /// [`Worker`](crate::Worker) into a failed attempt of the message at fault; other callers see it as is.
    CommitRefused {
        /// SQLite extended result code (`SQLITE_CONSTRAINT*`).
        code: i32,
        /// The underlying error.
        source: rusqlite::Error,
    },
    /// Any other SQLite failure (I/O error, corruption, ...). Nothing was acknowledged.
    Storage {
        /// SQLite extended result code, or -1 when the error did not come from the SQLite library.
        code: i32,
        /// The underlying error.
        source: rusqlite::Error,
    },
    /// The file at this path is not an SQLite database (or is encrypted, or corrupt in its header), or is one
    /// no edge-inbox wrote (a negative schema version: another application's file).
    NotADatabase {
        /// The path that was opened.
        path: PathBuf,
    },
    /// The database was written by a newer edge-inbox whose schema this version cannot read. The newer
    /// version's [`downgrade_schema`](crate::downgrade_schema) (`inboxctl downgrade`) takes a file back where
    /// the older version reads it the same way.
    SchemaTooNew {
        /// `PRAGMA user_version` found in the file.
        found: i64,
        /// The newest version this build knows.
        supported: i64,
    },
    /// The database could not be created or opened.
    Open {
        /// The path that was opened.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// A setting could not be applied or read back as requested (e.g. WAL refused by the file system).
    Setting {
        /// What was asked for, e.g. `journal_mode=wal`.
        wanted: String,
        /// What SQLite reported instead.
        got: String,
    },
    /// The delivery is not acceptable input; nothing was written.
    InvalidDelivery(InvalidDelivery),
    /// A state value could not be encoded to or decoded from CBOR.
    Codec(String),
    /// An argument given to the inbox is invalid (e.g. an empty scope name in a query, a topic filter that
    /// is not valid MQTT, another connection setting refused before connecting), or a request cannot be
    /// carried out as made (a consumer's or relay's thread that cannot be started, a relay on MQTT 3.1.1, a
    /// refused schema downgrade). `Consumer::run` also returns it when an idle limit
    /// (`Consumer::exit_when_idle`) passes before any connection to the broker succeeded.
    InvalidArgument(String),
    /// The first MQTT connection of a run failed in a way retrying cannot heal: the broker refused the
    /// credentials or the client id, TLS material does not parse or a certificate was rejected, or a
    /// subscription was refused or granted only at QoS0 before the run was ever granted it. A broker that is
    /// merely unreachable is retried; an idle-bounded run that never connected ends with
    /// [`Error::InvalidArgument`] instead.
    Connection(String),
    /// The inbox's transaction ended while a handler ran: the handler ran `COMMIT` or `ROLLBACK` through
    /// [`Tx::sql`](crate::Tx::sql), or SQLite rolled it back by itself (a trigger's `RAISE(ROLLBACK)`,
    /// `INSERT OR ROLLBACK`). Nothing the handler wrote committed; the batch failed and nothing of it may be
    /// acked. Also returned when the handler replaced the connection's commit or rollback hook, which guard
    /// its transaction: then what it committed on its own meanwhile, if anything, cannot be undone.
    HandlerEndedTransaction,
    /// The database file is no longer the file at its path: deleted (`rm inbox.db*`), renamed away or
    /// replaced while this inbox had it open. Whatever this inbox writes from then on goes into a file
    /// without that name, lost when it closes, so the commit that noticed it, and every write after it on this
    /// inbox, fails with this error: nothing of it may be acked. Not retryable: an operator acts, and the
    /// application reopens the inbox, which then works on whatever file is at `path` (after a deletion, a
    /// new, empty database that knows none of the deleted file's identities).
    DatabaseGone {
        /// The path the inbox was opened on.
        path: PathBuf,
    },
}

impl Error {
    /// True when the same call may succeed later without anyone changing anything in it (busy, I/O hiccup,
    /// unknown commit outcome, a full disk that gets space again, a read-only file system or file made
    /// writable again): trouble of the storage, not of a delivery, so it is never dead-lettered.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Busy { .. }
            | Error::DiskFull
            | Error::ReadOnly { .. }
            | Error::CommitUnknown { .. } => true,
            // I/O trouble may pass; a statement error, corruption or a non-SQLite failure will not.
            Error::Storage { code, .. } => matches!(
                code & 0xff,
                ffi::SQLITE_IOERR
                    | ffi::SQLITE_NOMEM
                    | ffi::SQLITE_PROTOCOL
                    | ffi::SQLITE_INTERRUPT
                    | ffi::SQLITE_CANTOPEN
            ),
            _ => false,
        }
    }

    /// The SQLite extended result code behind this error, if any.
    pub fn sqlite_code(&self) -> Option<i32> {
        match self {
            Error::Busy { code } | Error::ReadOnly { code } => Some(*code),
            Error::DiskFull => Some(ffi::SQLITE_FULL),
            Error::CommitUnknown { code, .. }
            | Error::CommitRefused { code, .. }
            | Error::Storage { code, .. } => Some(*code),
            _ => None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Busy { code } => {
                write!(f, "database is busy (SQLite code {code}); nothing written")
            }
            Error::DiskFull => f.write_str("database or disk is full; nothing written"),
            Error::ReadOnly { code } => {
                write!(
                    f,
                    "database is read-only (SQLite code {code}); nothing written"
                )
            }
            Error::CommitUnknown { code, .. } => write!(
                f,
                "COMMIT failed with SQLite code {code}: outcome unknown, resolve by identity lookup"
            ),
            Error::CommitRefused { code, .. } => write!(
                f,
                "COMMIT refused by a deferred constraint (SQLite code {code}); nothing committed"
            ),
            Error::Storage { code, source } => {
                write!(f, "storage error (SQLite code {code}): {source}")
            }
            Error::NotADatabase { path } => {
                write!(f, "{} is not an SQLite database of edge-inbox", path.display())
            }
            Error::SchemaTooNew { found, supported } => write!(
                f,
                "database schema version {found} is newer than this build supports ({supported})"
            ),
            Error::Open { path, source } => write!(f, "cannot open {}: {source}", path.display()),
            Error::Setting { wanted, got } => {
                write!(f, "could not set {wanted}: SQLite reports {got}")
            }
            Error::InvalidDelivery(why) => write!(f, "invalid delivery: {why}"),
            Error::Codec(why) => write!(f, "state value codec error: {why}"),
            Error::InvalidArgument(why) => write!(f, "invalid argument: {why}"),
            Error::Connection(why) => write!(f, "MQTT connection failed: {why}"),
            Error::HandlerEndedTransaction => {
                f.write_str("the handler ended the inbox's transaction; batch not acknowledged")
            }
            Error::DatabaseGone { path } => write!(
                f,
                "the database file {} was deleted or replaced while the inbox had it open; nothing written \
                 since is durable, reopen the inbox",
                path.display()
            ),
        }
    }
}

impl std::error::Error for Error {
    /// The cause, for the variants whose message does not already say it. [`Error::Open`],
    /// [`Error::Storage`] and [`Error::InvalidDelivery`] put their cause in the message (what a log line
    /// shows with `{}`) and therefore return none here: a report that walks the chain (`anyhow`'s `{:#}`
    /// and `{:?}`) would print it twice. Their `source` field still holds it.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::CommitUnknown { source, .. } | Error::CommitRefused { source, .. } => {
                Some(source)
            }
            _ => None,
        }
    }
}

impl From<InvalidDelivery> for Error {
    fn from(why: InvalidDelivery) -> Self {
        Error::InvalidDelivery(why)
    }
}

/// The extended result code of a rusqlite error, if it came from the SQLite library.
pub(crate) fn extended_code(err: &rusqlite::Error) -> Option<i32> {
    match err {
        rusqlite::Error::SqliteFailure(e, _) => Some(e.extended_code),
        _ => None,
    }
}

impl From<rusqlite::Error> for Error {
    /// Classifies by the primary result code (low byte of the extended code).
    fn from(err: rusqlite::Error) -> Self {
        let Some(code) = extended_code(&err) else {
            return Error::Storage {
                code: -1,
                source: err,
            };
        };
        match code & 0xff {
            ffi::SQLITE_BUSY | ffi::SQLITE_LOCKED => Error::Busy { code },
            ffi::SQLITE_FULL => Error::DiskFull,
            ffi::SQLITE_READONLY => Error::ReadOnly { code },
            _ => Error::Storage { code, source: err },
        }
    }
}

/// True when the error is the primary-key or unique violation that marks an existing identity.
pub(crate) fn is_unique_violation(err: &rusqlite::Error) -> bool {
    matches!(
        extended_code(err),
        Some(ffi::SQLITE_CONSTRAINT_PRIMARYKEY) | Some(ffi::SQLITE_CONSTRAINT_UNIQUE)
    )
}

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The [`Error`] for a storage failure known only by its extended result code.
pub(crate) fn storage_error(code: i32) -> Error {
    Error::from(rusqlite::Error::SqliteFailure(
        rusqlite::ffi::Error::new(code),
        None,
    ))
}
