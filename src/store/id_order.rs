//! The layouts of identity keys in the index: which part of an id, if any, goes ahead of its hash.

/// How a database lays out its identity keys ([`IdHash`](crate::IdHash)) in its index: chosen when the file
/// is created ([`Config::id_order`](crate::Config::id_order)), stored in it, and kept for the file's life.
///
/// Every layout ends with the full keyed hash of the identity, so two identities are told apart exactly as
/// well under each. What changes is where a new identity lands in the index. Under [`IdOrder::Hashed`] it
/// lands on a random leaf: on a file with a million identities each delivery of a commit changes a leaf of
/// its own, which the WAL and later the checkpoint write whole (about two 4 KiB pages per delivery). The
/// other layouts put a part of the id that grows with time ahead of the hash, so the identities of one
/// commit, and of the next ones, share a few leaves at the end of their range, as ids that increase do in a
/// classic consumer's table. They only help ids of the shape they name; on other ids they cost their prefix
/// in bytes and change nothing else. The prefix is stored as it is (a part of the id, or a number read from
/// it) in every identity row for as long as the row is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum IdOrder {
    /// The keyed hash alone (16 bytes): the layout of every file created before schema version 6, and the
    /// default. Best for random ids (UUIDv4), which no layout keeps together.
    #[default]
    Hashed,
    /// The first `n` bytes of the message id (1 to 16, shorter ids padded with zero bytes) ahead of the hash:
    /// for ids that begin with a time. Take the whole time field: 13 for a UUIDv7 (`0190a5d2-ac96`, its 48
    /// bits of milliseconds), 10 for a ULID (the same 48 bits in base 32, by its format; not measured). A
    /// shorter prefix holds only the time's high part (8 bytes of a UUIDv7: about a minute), and the ids of
    /// one such span land at random among themselves: on a file with a million identities batches of 256
    /// wrote 3-8 times the bytes they wrote with 13, and one delivery per commit about the same.
    Leading(u8),
    /// A decimal counter at the end of the id, such as `gw-7/evt-000123` or `4711`: 4 bytes of a keyed hash
    /// of the producer and of the id without its trailing digits, then those digits as a 64-bit number (the
    /// last 19 when there are more; 0 when there are none), then the hash. Each producer's and prefix's ids
    /// then sit in a range of their own in counter order. Not for UUIDs: their last characters are random
    /// (and may be digits), so they scatter as under [`IdOrder::Hashed`], with 12 bytes more per row.
    Counter,
}

impl IdOrder {
    /// Longest `n` of [`IdOrder::Leading`].
    pub const MAX_LEADING: u8 = 16;

    /// The form stored in the database and shown by `inboxctl`: `hashed`, `leading:N` or `counter`.
    pub fn name(&self) -> String {
        match self {
            IdOrder::Hashed => "hashed".into(),
            IdOrder::Leading(n) => format!("leading:{n}"),
            IdOrder::Counter => "counter".into(),
        }
    }

    /// Parses [`IdOrder::name`]'s form; `None` for anything else (also `leading:0` and `leading:17`).
    pub fn parse(name: &str) -> Option<IdOrder> {
        match name {
            "hashed" => Some(IdOrder::Hashed),
            "counter" => Some(IdOrder::Counter),
            _ => {
                let n: u8 = name.strip_prefix("leading:")?.parse().ok()?;
                (1..=Self::MAX_LEADING)
                    .contains(&n)
                    .then_some(IdOrder::Leading(n))
            }
        }
    }

    /// Bytes this layout puts ahead of the 16-byte hash.
    pub fn prefix_len(&self) -> usize {
        match self {
            IdOrder::Hashed => 0,
            IdOrder::Leading(n) => usize::from(*n),
            IdOrder::Counter => 12,
        }
    }
}
