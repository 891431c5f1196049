//! Settings for opening an inbox.

use std::time::Duration;

use crate::store::id_order::IdOrder;

/// How hard SQLite works to make a commit durable before [`Inbox::process`](crate::Inbox::process) returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Synchronous {
    /// `synchronous=FULL` (the default): the WAL is fsynced at every commit. When `process` returns
    /// `Ok`, the identity and the effect survive a crash of the process *and* a power loss.
    #[default]
    Full,
    /// `synchronous=NORMAL`: the WAL is fsynced only at checkpoints. A commit survives a crash of the
    /// process, but **a power loss can lose recently committed, already acknowledged deliveries**: the broker
    /// will not redeliver them, so their effects are lost. Opt in only where that is acceptable.
    Normal,
}

impl Synchronous {
    pub(crate) fn pragma_value(self) -> i64 {
        match self {
            Synchronous::Full => 2,
            Synchronous::Normal => 1,
        }
    }
}

/// Size limits checked before anything is written. A delivery over a limit is rejected with
/// [`InvalidDelivery::TooLong`](crate::InvalidDelivery::TooLong).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest consumer scope name, in bytes. Default 128.
    pub max_scope_len: usize,
    /// Longest message id or producer namespace, in bytes. Default 256.
    pub max_id_len: usize,
    /// Longest topic, in bytes. Default 1024.
    pub max_topic_len: usize,
    /// Largest payload, in bytes. Default 1 MiB.
    pub max_payload_len: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_scope_len: 128,
            max_id_len: 256,
            max_topic_len: 1024,
            max_payload_len: 1 << 20,
        }
    }
}

/// Default of [`Config::cache_size`].
pub(crate) const DEFAULT_CACHE_BYTES: usize = 512 << 10;

/// Options for [`Inbox::open`](crate::Inbox::open). Start from [`Config::default`] and change what you need.
///
/// ```
/// use edge_inbox::{Config, Synchronous};
/// use std::time::Duration;
/// let config = Config::default()
///     .busy_timeout(Duration::from_secs(10))
///     .synchronous(Synchronous::Full);
/// assert_eq!(config.get_synchronous(), Synchronous::Full);
/// ```
#[derive(Debug, Clone)]
pub struct Config {
    pub(crate) synchronous: Synchronous,
    pub(crate) busy_timeout: Duration,
    pub(crate) limits: Limits,
    pub(crate) journal_size_limit: i64,
    pub(crate) vfs: Option<String>,
    pub(crate) outbox_producer: Option<String>,
    pub(crate) slow_commit: Option<Duration>,
    pub(crate) wal_autocheckpoint: u32,
    pub(crate) checkpoint_thread: bool,
    pub(crate) page_size: Option<u32>,
    pub(crate) cache_bytes: usize,
    pub(crate) id_order: IdOrder,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            synchronous: Synchronous::Full,
            busy_timeout: Duration::from_secs(5),
            limits: Limits::default(),
            journal_size_limit: 64 << 20,
            vfs: None,
            outbox_producer: None,
            slow_commit: Some(Duration::from_secs(1)),
            wal_autocheckpoint: 10_000,
            checkpoint_thread: true,
            page_size: None,
            cache_bytes: DEFAULT_CACHE_BYTES,
            id_order: IdOrder::Hashed,
        }
    }
}

impl Config {
    /// Durability of each commit. Default [`Synchronous::Full`]; read the warning on
    /// [`Synchronous::Normal`] before changing it.
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// How long a write waits for another connection's write lock before failing with
    /// [`Error::Busy`](crate::Error::Busy). Default 5 s.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Input size limits. Default [`Limits::default`].
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Size, in bytes, the WAL file is truncated back to after a checkpoint. Default 64 MiB.
    pub fn journal_size_limit(mut self, bytes: i64) -> Self {
        self.journal_size_limit = bytes;
        self
    }

    /// Copy the WAL back into the database file (a PASSIVE checkpoint) when a commit leaves it this many
    /// pages long, as SQLite's `wal_autocheckpoint`; 0 never does (then run checkpoints yourself). Default
    /// 10,000 (SQLite's is 1000). A larger value copies a page changed by many commits back fewer times (less
    /// flash wear) and makes the WAL start over less often, for a larger WAL file and a longer recovery after
    /// a crash: at 4 KiB pages the WAL grows to about 40 MiB (twice that beside a writer that never pauses)
    /// and keeps that size on disk.
    ///
    /// Why not SQLite's 1000: the first commit after the WAL starts over also writes and syncs the new WAL
    /// header, and once per threshold a writer that never pauses waits for the checkpoint thread to catch
    /// up ([`Config::checkpoint_thread`]), so on a card whose sync takes 5 ms the deliveries behind those
    /// commits wait two to four syncs. At 1000 pages that was more than 1% of a consumer's deliveries at
    /// 10% load, and set its p99 (31 ms, against 18 ms at 10,000, two runs each); the checkpoints also
    /// wrote 5 times the bytes into the database file (BENCHMARKS.md, issue 23).
    pub fn wal_autocheckpoint(mut self, pages: u32) -> Self {
        self.wal_autocheckpoint = pages;
        self
    }

    /// Run the automatic checkpoint ([`Config::wal_autocheckpoint`]) on a thread of the inbox's own, with a
    /// connection of its own, instead of inside the commit that leaves the WAL past the threshold. Default
    /// `true`.
    ///
    /// Inside the commit, that commit also copies up to a threshold's worth of pages into the database file
    /// and syncs twice before it returns: on an SD card or eMMC whose sync takes 5 ms that is 40-60 ms at
    /// 1000 pages, paid by the delivery and by every delivery waiting behind it (the tail of a consumer's
    /// latency). On the thread,
    /// commits go on while it copies (a PASSIVE checkpoint takes no lock a writer needs), and on Linux the
    /// copied pages reach the device in paced steps before the database file is synced, instead of all at
    /// once in that sync: on a file with a large index they are thousands of scattered pages, which stalled
    /// every commit's sync behind them. Once no commit has come for 50 ms, the thread copies what the commits
    /// added meanwhile, and the next commit starts the WAL over without waiting. A writer that never pauses
    /// that long keeps the WAL from starting over (a commit lands during every copy): soon after the copies,
    /// one commit asks the thread to catch up (a sync of the WAL, the few frames added since, a sync of the
    /// database file), and the connection's next write transaction waits until it has, before it begins (a
    /// consumer meanwhile acks what its syncs made durable). Deliveries arriving then wait for it too: about
    /// three syncs, once per threshold of WAL. The thread sleeps until a commit asks (or, with frames left
    /// after its copies, until the commits pause), and is stopped when the inbox is dropped. A
    /// [`Config::vfs`] serves the inbox's connection and the thread's two, from two threads. If they cannot
    /// be opened, the inbox logs a warning and checkpoints in the commits. `false` keeps one connection and
    /// no thread, SQLite's own behaviour.
    pub fn checkpoint_thread(mut self, on: bool) -> Self {
        self.checkpoint_thread = on;
        self
    }

    /// Page size, in bytes (a power of two from 512 to 65536), of a database file this inbox *creates*; an
    /// existing file keeps the page size it was created with. Default: SQLite's (4096). Smaller pages make
    /// each commit's WAL frames smaller, but flash and the kernel write whole 4 KiB blocks anyway: see the
    /// README's section on flash wear before changing it. [`Config::wal_autocheckpoint`] counts pages: with
    /// 1 KiB pages, 40,000 keeps the default's bytes of WAL between restarts.
    pub fn page_size(mut self, bytes: u32) -> Self {
        self.page_size = Some(bytes);
        self
    }

    /// Layout of the identity keys of a database file this inbox *creates* ([`IdOrder`]); an existing file
    /// keeps the layout it was created with (`inboxctl check` shows it, [`Inbox::id_key`](crate::Inbox::id_key)
    /// returns it). Default [`IdOrder::Hashed`]. With ids that grow with time, [`IdOrder::Counter`] or
    /// [`IdOrder::Leading`] keep a commit's new identities on a few leaves of the index instead of one each,
    /// which on a large file is most of the bytes a delivery writes: see the README's section on flash wear.
    /// A [`IdOrder::Leading`] of 0 or more than 16 bytes is refused when the file is created
    /// ([`Error::InvalidArgument`](crate::Error::InvalidArgument)).
    pub fn id_order(mut self, order: IdOrder) -> Self {
        self.id_order = order;
        self
    }

    /// Most memory, in bytes, SQLite's page cache of the inbox's connection may hold (`PRAGMA cache_size`,
    /// rounded down to whole KiB, at least 64 KiB). Default 512 KiB (SQLite's is 2000 KiB).
    ///
    /// Every [`Inbox`](crate::Inbox) opened on a file has its own connection and cache (a consumer's and a
    /// pruner's are two); the checkpoint thread's connection reads no pages through it and keeps 64 KiB.
    /// Once the tables outgrow the cache, a commit reads its pages back from the operating system's cache;
    /// SQLite also empties a connection's cache whenever another connection has written the file. Measured
    /// against 2000 KiB (BENCHMARKS.md, issue 23): the same consumer latency on a file of 100,000 rows,
    /// beside a prune and without, and the same rate through mosquitto; a soak's resident memory under a
    /// flood fell by about 3 MiB.
    pub fn cache_size(mut self, bytes: usize) -> Self {
        self.cache_bytes = bytes;
        self
    }

    /// Name of a registered SQLite VFS to open the file with (for example one that adds encryption or
    /// fault injection). Default: the platform's own.
    pub fn vfs(mut self, name: impl Into<String>) -> Self {
        self.vfs = Some(name.into());
        self
    }

    /// Producer namespace stamped on the messages handlers publish through the outbox
    /// ([`Tx::publish`](crate::Tx::publish)), sent as the MQTT 5 user property `producer`. Default: the
    /// consumer scope of the handler. Set it (a gateway name, say) when several gateways run the same scope
    /// on their own event streams, so that their outbox ids cannot meet downstream. The value is stored with
    /// each outbox row when it is written: changing it later does not change rows already written.
    pub fn outbox_producer(mut self, producer: impl Into<String>) -> Self {
        self.outbox_producer = Some(producer.into());
        self
    }

    /// The configured outbox producer namespace, if set.
    pub fn get_outbox_producer(&self) -> Option<&str> {
        self.outbox_producer.as_deref()
    }

    /// Log a warning (`log` crate, target `edge_inbox::store::txn`) for every `COMMIT` that takes at least
    /// this long: a sign of a slow or failing flash device, or of a checkpoint competing for the disk. `None`
    /// turns it off.
    /// Default 1 s. Costs one clock read per commit.
    pub fn slow_commit_warning(mut self, threshold: Option<Duration>) -> Self {
        self.slow_commit = threshold;
        self
    }

    /// The configured durability.
    pub fn get_synchronous(&self) -> Synchronous {
        self.synchronous
    }

    /// The configured busy timeout.
    pub fn get_busy_timeout(&self) -> Duration {
        self.busy_timeout
    }

    /// The configured input limits.
    pub fn get_limits(&self) -> &Limits {
        &self.limits
    }
}

/// What outbox writes need from the inbox configuration, kept beside the connection.
#[derive(Debug, Clone, Default)]
pub(crate) struct OutboxSettings {
    pub(crate) producer: Option<String>,
    pub(crate) limits: Limits,
}

impl OutboxSettings {
    pub(crate) fn from_config(config: &Config) -> OutboxSettings {
        OutboxSettings {
            producer: config.outbox_producer.clone(),
            limits: config.limits,
        }
    }
}
